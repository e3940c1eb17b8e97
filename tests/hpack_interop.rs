//! h2-authority's HPACK code (the SDK's Unix-socket `:authority` filter) against an independent implementation, Python hpack 4.1.0 (PyPI; `cargo xtask install`
//! installs it and sets `$PYTHON_HPACK_PY` to its Python). Never skipped: without that Python the
//! tests fail.
//!
//! - Python's Encoder writes header blocks (Huffman on and off, literals with incremental
//!   indexing, without indexing and never indexed, indexed fields, dynamic table size updates,
//!   small and large values, several blocks per connection sharing the dynamic table); the SDK's
//!   decoder must read each as Python's own Decoder does.
//! - The same blocks go through the SDK's Unix-socket `:authority` filter; Python's Decoder must
//!   read every block the filter writes as the client's fields with `:authority` = localhost.
//! - Damaged blocks (a byte changed, inserted or dropped, cut short): the SDK refuses exactly
//!   what Python refuses and reads the rest alike.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use h2_authority::fuzzing::{rewrite_authority, HeaderField, HpackDecoder, REWRITTEN_AUTHORITY};
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;

/// A small deterministic PRNG (xorshift64*), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// Authorities clients send over Unix sockets, and worse.
const AUTHORITIES: &[&[u8]] = &[
    b"localhost",
    b"/run/machine-driver/driver.sock",
    b"%2Frun%2Fmachine-driver%2Fdriver.sock",
    b"/tmp/a dir/@sock",
    b"/tmp/\xc3\xa9t\xc3\xa9/\xff.sock",
    b"",
    b"[::1]:50051",
];

/// One header block for Python's Encoder to write.
struct BlockSpec {
    table_sizes: Vec<usize>,
    huffman: bool,
    fields: Vec<(Vec<u8>, Vec<u8>, &'static str)>,
}

impl BlockSpec {
    fn to_json(&self) -> Value {
        let fields: Vec<Value> = self.fields.iter().map(|(n, v, mode)| json!([to_hex(n), to_hex(v), mode])).collect();
        json!({"table_sizes": self.table_sizes, "huffman": self.huffman, "fields": fields})
    }
}

fn random_value(rng: &mut Rng, earlier: &[Vec<u8>]) -> Vec<u8> {
    match rng.below(10) {
        0..=2 => format!("value-{}", rng.below(50)).into_bytes(),
        3 => {
            let n = rng.below(40);
            rng.bytes(n)
        }
        4 => {
            let c = b"abz~"[rng.below(4)];
            vec![c; 200 + rng.below(2800)]
        }
        // Larger than the whole dynamic table: indexing it empties the table.
        5 => vec![b'L'; 4064 + rng.below(200)],
        6 => Vec::new(),
        _ if !earlier.is_empty() => earlier[rng.below(earlier.len())].clone(),
        _ => b"again".to_vec(),
    }
}

/// A gRPC-like request: pseudo-headers (with an awkward `:authority`), then random fields.
fn random_block(rng: &mut Rng, n: usize, earlier: &mut Vec<Vec<u8>>) -> BlockSpec {
    let mode = |rng: &mut Rng| ["index", "index", "index", "never", "none"][rng.below(5)];
    let mut fields = vec![
        (b":method".to_vec(), b"POST".to_vec(), mode(rng)),
        (b":scheme".to_vec(), b"http".to_vec(), mode(rng)),
        (b":path".to_vec(), format!("/machinedriver.v1.Machines/M{}", n % 5).into_bytes(), mode(rng)),
        (b":authority".to_vec(), AUTHORITIES[rng.below(AUTHORITIES.len())].to_vec(), mode(rng)),
        (b"content-type".to_vec(), b"application/grpc".to_vec(), mode(rng)),
        (b"te".to_vec(), b"trailers".to_vec(), mode(rng)),
    ];
    for _ in 0..rng.below(10) {
        let name = match rng.below(6) {
            0 => b"x-request-id".to_vec(),
            1 => b"authorization".to_vec(),
            2 => b"user-agent".to_vec(),
            3 => format!("x-custom-{}", rng.below(8)).into_bytes(),
            4 => {
                let n = 1 + rng.below(20);
                rng.bytes(n)
            }
            _ => b"grpc-timeout".to_vec(),
        };
        let value = random_value(rng, earlier);
        earlier.push(value.clone());
        fields.push((name, value, mode(rng)));
    }
    let table_sizes = match rng.below(8) {
        0 => vec![[0, 64, 256, 1024, 4096][rng.below(5)]],
        1 => vec![[0, 100][rng.below(2)], [512, 4096][rng.below(2)]],
        _ => Vec::new(),
    };
    BlockSpec { table_sizes, huffman: rng.below(2) == 0, fields }
}

fn random_connections(seed: u64, count: usize) -> Vec<Vec<BlockSpec>> {
    let mut rng = Rng(seed);
    (0..count)
        .map(|_| {
            let mut earlier = Vec::new();
            (0..1 + rng.below(8)).map(|n| random_block(&mut rng, n, &mut earlier)).collect()
        })
        .collect()
}

/// Runs tests/hpack_interop.py on one JSON request, bounded by a timeout.
async fn python(request: Value) -> Vec<Vec<Value>> {
    let python = std::env::var_os("PYTHON_HPACK_PY").map(PathBuf::from).unwrap_or_else(|| {
        panic!(
            "PYTHON_HPACK_PY is not set: it names a Python with hpack==4.1.0 (`cargo xtask install` installs one \
             into .tools/venv and sets it)"
        )
    });
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("hpack_interop.py");
    let mut child = tokio::process::Command::new(&python)
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", python.display()));
    let mut stdin = child.stdin.take().unwrap();
    let input = serde_json::to_vec(&request).unwrap();
    let run = async move {
        // Write and read at once: the answer may be larger than a pipe holds.
        let write = async move {
            stdin.write_all(&input).await.unwrap();
            drop(stdin);
        };
        let (_, output) = tokio::join!(write, child.wait_with_output());
        output.unwrap()
    };
    let output =
        tokio::time::timeout(Duration::from_secs(120), run).await.expect("Python hpack did not answer in 120 s");
    assert!(output.status.success(), "{} failed: {}", script.display(), String::from_utf8_lossy(&output.stderr));
    let answer: Value = serde_json::from_slice(&output.stdout).unwrap();
    answer["connections"].as_array().unwrap().iter().map(|c| c.as_array().unwrap().clone()).collect()
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(v: &Value) -> Vec<u8> {
    let s = v.as_str().unwrap();
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// Python's decoding of a block, as fields; an error text when it refused it.
fn python_fields(answer: &Value) -> Result<Vec<HeaderField>, String> {
    if let Some(e) = answer.get("error") {
        return Err(e.to_string());
    }
    Ok(answer["decoded"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| HeaderField { name: unhex(&f[0]), value: unhex(&f[1]), never_indexed: f[2].as_bool().unwrap() })
        .collect())
}

/// Python writes, the SDK reads: every block decodes to what Python's own decoder reads, which
/// is what was encoded; a table size update beyond the 4096 bytes allowed is refused by both.
#[tokio::test]
async fn blocks_python_encodes_decode_the_same_in_the_sdk() {
    let connections = random_connections(0x5eed_0001, 150);
    let mut request: Vec<Value> = connections.iter().map(|c| c.iter().map(BlockSpec::to_json).collect()).collect();
    // Past SETTINGS_HEADER_TABLE_SIZE, which the SDK never raises.
    let too_large = BlockSpec {
        table_sizes: vec![8192],
        huffman: true,
        fields: vec![(b":method".to_vec(), b"POST".to_vec(), "index")],
    };
    request.push(json!([too_large.to_json()]));
    let answers = python(json!({"op": "encode", "connections": request})).await;
    assert_eq!(answers.len(), connections.len() + 1);

    let (mut blocks, mut fields, mut never, mut huffman, mut updates) = (0, 0, 0, 0, 0);
    for (c, (specs, answers)) in connections.iter().zip(&answers).enumerate() {
        let mut ours = HpackDecoder::default();
        for (b, (spec, answer)) in specs.iter().zip(answers).enumerate() {
            let block = unhex(&answer["block"]);
            let theirs = python_fields(answer).unwrap_or_else(|e| panic!("connection {c} block {b}: Python: {e}"));
            let got = ours.decode(&block).unwrap_or_else(|e| panic!("connection {c} block {b}: {e}: {block:02x?}"));
            assert_eq!(got, theirs, "connection {c} block {b}: {block:02x?}");
            let sent: Vec<_> = spec.fields.iter().map(|(n, v, _)| (n.clone(), v.clone())).collect();
            let read: Vec<_> = got.iter().map(|f| (f.name.clone(), f.value.clone())).collect();
            assert_eq!(read, sent, "connection {c} block {b}");
            assert!(ours.table_size() <= 4096);
            blocks += 1;
            fields += got.len();
            never += got.iter().filter(|f| f.never_indexed).count();
            huffman += usize::from(spec.huffman);
            updates += spec.table_sizes.len();
        }
    }
    // The cases cover what they claim to.
    assert!(blocks > 400 && never > 100 && huffman > 150 && updates > 50, "{blocks} {never} {huffman} {updates}");
    eprintln!("{blocks} blocks, {fields} fields ({never} never indexed), {huffman} Huffman-coded, {updates} table size updates");

    let answer = &answers[connections.len()][0];
    assert!(python_fields(answer).is_err(), "Python took a table size update to 8192");
    let err = HpackDecoder::default().decode(&unhex(&answer["block"])).unwrap_err();
    assert!(err.contains("8192"), "{err}");
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len();
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// The header blocks of an HTTP/2 byte stream after the preface, in order.
fn header_blocks(mut data: &[u8]) -> Vec<Vec<u8>> {
    let (mut blocks, mut open) = (Vec::new(), None::<Vec<u8>>);
    while !data.is_empty() {
        let len = (usize::from(data[0]) << 16) | (usize::from(data[1]) << 8) | usize::from(data[2]);
        let (kind, flags, payload) = (data[3], data[4], &data[9..9 + len]);
        data = &data[9 + len..];
        match kind {
            0x1 => {
                assert!(open.is_none());
                open = Some(payload[if flags & 0x20 != 0 { 5 } else { 0 }..].to_vec());
            }
            0x9 => open.as_mut().unwrap().extend_from_slice(payload),
            _ => continue,
        }
        if flags & 0x4 != 0 {
            blocks.push(open.take().unwrap());
        }
    }
    blocks
}

/// The SDK writes, Python reads: every block the `:authority` filter writes decodes in Python
/// to the client's fields (never-indexed ones still never indexed) with `:authority` = localhost.
#[tokio::test]
async fn blocks_the_authority_filter_writes_decode_in_python() {
    let mut rng = Rng(0x5eed_0002);
    let connections = random_connections(rng.next(), 100);
    let request: Vec<Value> = connections.iter().map(|c| c.iter().map(BlockSpec::to_json).collect()).collect();
    let encoded = python(json!({"op": "encode", "connections": request})).await;

    let mut rewritten = Vec::new();
    let mut expected = Vec::new();
    for answers in &encoded {
        let mut wire = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        wire.extend_from_slice(&frame(0x4, 0, 0, &[]));
        let mut want = Vec::new();
        for (k, answer) in answers.iter().enumerate() {
            let stream = 2 * k as u32 + 1;
            let block = unhex(&answer["block"]);
            // Split over CONTINUATION frames at random (the client's frames may be small).
            let mut pieces: Vec<&[u8]> = block.chunks(1 + rng.below(block.len().clamp(1, 16_384))).collect();
            if pieces.is_empty() {
                pieces.push(&[]);
            }
            let last = pieces.len() - 1;
            for (i, piece) in pieces.iter().enumerate() {
                let end_headers = if i == last { 0x4 } else { 0 };
                // HEADERS (with END_STREAM), then CONTINUATIONs.
                let (kind, end_stream) = if i == 0 { (0x1, 0x1) } else { (0x9, 0) };
                wire.extend_from_slice(&frame(kind, end_headers | end_stream, stream, piece));
            }
            wire.extend_from_slice(&frame(0x8, 0, 0, &[0, 0, 1, 0]));
            let mut fields = python_fields(answer).unwrap();
            for f in fields.iter_mut().filter(|f| f.name == b":authority") {
                f.value = REWRITTEN_AUTHORITY.to_vec();
            }
            want.push(fields);
        }
        let out = rewrite_authority(&wire).unwrap_or_else(|(e, _)| panic!("the filter refused a connection: {e}"));
        let blocks = header_blocks(&out[24..]);
        assert_eq!(blocks.len(), answers.len());
        rewritten.push(blocks.iter().map(|b| to_hex(b)).collect::<Vec<_>>());
        expected.push(want);
    }

    let decoded = python(json!({"op": "decode", "connections": rewritten})).await;
    let mut never = 0;
    for (c, (answers, want)) in decoded.iter().zip(&expected).enumerate() {
        assert_eq!(answers.len(), want.len());
        for (b, (answer, want)) in answers.iter().zip(want).enumerate() {
            let got = python_fields(answer).unwrap_or_else(|e| panic!("connection {c} block {b}: Python: {e}"));
            assert_eq!(&got, want, "connection {c} block {b}");
            never += got.iter().filter(|f| f.never_indexed).count();
        }
    }
    assert!(never > 50, "only {never} never-indexed fields went through the filter");
}

/// Damaged blocks (a byte changed, inserted or dropped, the block cut short), each on a fresh
/// connection: the SDK refuses exactly what Python refuses, and reads the rest as Python does.
#[tokio::test]
async fn damaged_blocks_are_refused_or_read_alike() {
    let mut rng = Rng(0x5eed_0003);
    let connections = random_connections(rng.next(), 60);
    let request: Vec<Value> = connections.iter().map(|c| c.iter().map(BlockSpec::to_json).collect()).collect();
    let encoded = python(json!({"op": "encode", "connections": request})).await;
    let mut damaged = Vec::new();
    for block in encoded.iter().flatten().map(|answer| unhex(&answer["block"])).filter(|b| !b.is_empty()) {
        for _ in 0..8 {
            let mut b = block.clone();
            let at = rng.below(b.len());
            match rng.below(4) {
                0 => b[at] ^= 1 << rng.below(8),
                1 => b[at] = rng.next() as u8,
                2 => b.insert(at, rng.next() as u8),
                _ => b.truncate(at),
            }
            damaged.push(b);
        }
    }
    let connections: Vec<Value> = damaged.iter().map(|b| json!([to_hex(b)])).collect();
    let answers = python(json!({"op": "decode", "connections": connections})).await;
    let (mut refused, mut read) = (0, 0);
    for (block, answer) in damaged.iter().zip(&answers) {
        let ours = HpackDecoder::default().decode(block);
        match (ours, python_fields(&answer[0])) {
            (Ok(ours), Ok(theirs)) => {
                assert_eq!(ours, theirs, "{block:02x?}");
                read += 1;
            }
            (Err(_), Err(_)) => refused += 1,
            (ours, theirs) => {
                panic!("the SDK and Python disagree on {block:02x?}:\n SDK: {ours:?}\n Python: {theirs:?}")
            }
        }
    }
    assert!(refused > 100 && read > 100, "{refused} refused, {read} read");
    eprintln!("{} damaged blocks: {refused} refused by both, {read} read alike", damaged.len());
}
