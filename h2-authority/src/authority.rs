//! Lets every gRPC client stack call a server over a Unix socket, whatever it sends as `:authority`.
//!
//! A Unix socket has no host, so clients fill HTTP/2's `:authority` as they like: `localhost`
//! (grpc-go with a `unix:///` target, grpc-js), the socket path (grpc-java, grpcurl 1.8), the
//! percent-encoded path (Python grpcio, grpc-go `Dial(path)` with a unix dialer, as the kubelet
//! and CSI sidecars dial). `h2` parses the value as a URI authority and resets the stream with
//! PROTOCOL_ERROR before any of our code runs when it holds `/`, `%` and the like
//! (hyperium/h2#487).
//!
//! This filter sits on the inbound bytes of Unix-socket connections and re-encodes every header
//! block: it decodes the client's HPACK (keeping the client's dynamic table in step), replaces
//! the value of `:authority` with `localhost`, and writes the block back as plain literals that
//! never touch the server's dynamic table. Because the value is replaced, not repaired, nothing a
//! client may put there — any byte, Huffman-coded or not, indexed, split over CONTINUATION
//! frames — reaches the URI parser. All other frames pass through untouched, most of them
//! without a copy. TCP connections do not use the filter.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::hpack::{encode_literal, entry_size, Decoder};

/// What every Unix-socket request's `:authority` becomes.
pub const AUTHORITY: &[u8] = b"localhost";

const PREFACE_LEN: usize = 24;
/// Every HTTP/2 frame starts with a 9-byte header: length (3), type, flags, stream (4).
const FRAME_HEADER_LEN: usize = 9;
const FRAME_HEADERS: u8 = 0x1;
const FRAME_PUSH_PROMISE: u8 = 0x5;
const FRAME_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
/// The frame size every HTTP/2 server accepts (SETTINGS_MAX_FRAME_SIZE's initial value); the
/// re-encoded blocks are cut into frames of at most this.
pub(crate) const MAX_FRAME: usize = 16_384;
/// The largest header block (all its frames) accepted. The server's own header-list limit is far
/// lower; this only bounds what is buffered before the server gets to judge it.
pub(crate) const MAX_BLOCK: usize = 1 << 20;
/// The largest header list re-encoded, counted as HTTP/2 counts SETTINGS_MAX_HEADER_LIST_SIZE
/// (each field's name and value plus 32 bytes), which also bounds the re-encoded block. HPACK
/// lets one byte name a table entry of up to 4 KB, so a block within [`MAX_BLOCK`] could
/// otherwise expand to gigabytes here, before the server's own limit sees it.
pub(crate) const MAX_HEADER_LIST: usize = 1 << 20;

/// Wraps an accepted Unix-socket connection's IO. Inbound bytes (the client preface, then HTTP/2
/// frames) are read through the filter: every header block is re-encoded as plain literals with
/// `:authority` = [`AUTHORITY`], all other frames pass through. Outbound bytes pass untouched.
///
/// # Errors
/// A read fails with [`io::ErrorKind::InvalidData`] when the client breaks HTTP/2 framing or
/// HPACK, or sends a header block or header list over 1 MiB, so the connection ends with a clear
/// error before the server parses anything.
pub struct AuthorityRewrite<IO> {
    io: IO,
    frames: Frames,
    /// Bytes read but not yet taken: a partial frame header or an incomplete header-block frame.
    pending: Vec<u8>,
    /// Bytes ready to hand out, and how many were handed out already.
    ready: Vec<u8>,
    ready_pos: usize,
    /// Read buffer for completing held-back bytes (allocated on first use, then reused).
    scratch: Vec<u8>,
}

/// The inbound frame stream: where frames start, and the header block being collected.
struct Frames {
    /// Bytes of the client preface still to come.
    preface_left: usize,
    /// Bytes still to come of a frame passed through before it was complete.
    passthrough_left: usize,
    /// The HEADERS frame that started the block being collected, until END_HEADERS.
    block_start: Option<BlockStart>,
    /// The collected fragments of that block.
    block: Vec<u8>,
    /// The re-encoded block (kept to reuse its allocation).
    encoded: Vec<u8>,
    decoder: Decoder,
}

struct BlockStart {
    stream: [u8; 4],
    end_stream: bool,
    priority: Option<[u8; 5]>,
}

fn invalid(what: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("HTTP/2 header block from the client: {what}"))
}

fn push_frame_head(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: [u8; 4]) {
    out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
    out.extend_from_slice(&stream);
}

impl Frames {
    fn new() -> Self {
        Self {
            preface_left: PREFACE_LEN,
            passthrough_left: 0,
            block_start: None,
            block: Vec::new(),
            encoded: Vec::new(),
            decoder: Decoder::default(),
        }
    }

    /// How many leading bytes of `data` go through untouched: the preface and every frame that
    /// carries no header block, partial ones included. Stops at a header-block frame, at an
    /// incomplete frame header, and while a header block is being collected.
    fn passable(&mut self, data: &[u8]) -> usize {
        let mut i = 0;
        loop {
            let n = self.preface_left.min(data.len() - i);
            self.preface_left -= n;
            i += n;
            let n = self.passthrough_left.min(data.len() - i);
            self.passthrough_left -= n;
            i += n;
            let rest = &data[i..];
            if self.preface_left > 0
                || self.passthrough_left > 0
                || self.block_start.is_some()
                || rest.len() < FRAME_HEADER_LEN
            {
                return i;
            }
            if matches!(rest[3], FRAME_HEADERS | FRAME_CONTINUATION | FRAME_PUSH_PROMISE) {
                return i;
            }
            self.passthrough_left = FRAME_HEADER_LEN + frame_len(rest);
        }
    }

    /// Takes one header-block frame from the start of `data`. When it ends the block, appends
    /// the re-encoded block, framed, to `out`. Returns the bytes taken: 0 while the frame is
    /// incomplete.
    fn take_header_frame(&mut self, data: &[u8], out: &mut Vec<u8>) -> io::Result<usize> {
        if data.len() < FRAME_HEADER_LEN {
            return Ok(0);
        }
        let len = frame_len(data);
        let (kind, flags) = (data[3], data[4]);
        let stream = [data[5], data[6], data[7], data[8]];
        if len > MAX_BLOCK {
            return Err(invalid(format_args!("a {len}-byte frame is larger than the {MAX_BLOCK} accepted")));
        }
        let Some(payload) = data.get(FRAME_HEADER_LEN..FRAME_HEADER_LEN + len) else { return Ok(0) };
        match (kind, &self.block_start) {
            (FRAME_HEADERS, None) => {
                let (fragment, priority) = headers_fragment(payload, flags)?;
                self.block_start = Some(BlockStart { stream, end_stream: flags & FLAG_END_STREAM != 0, priority });
                self.block.clear();
                self.block.extend_from_slice(fragment);
            }
            (FRAME_CONTINUATION, Some(start)) if start.stream == stream => self.block.extend_from_slice(payload),
            (FRAME_PUSH_PROMISE, _) => return Err(invalid("clients may not send PUSH_PROMISE")),
            (_, Some(_)) => return Err(invalid("a header block is interrupted by another frame")),
            (_, None) => return Err(invalid("CONTINUATION without a header block")),
        }
        if self.block.len() > MAX_BLOCK {
            return Err(invalid(format_args!("the header block exceeds the {MAX_BLOCK} bytes accepted")));
        }
        if flags & FLAG_END_HEADERS != 0 {
            if let Some(start) = self.block_start.take() {
                self.reencode(&start, out)?;
            }
        }
        Ok(FRAME_HEADER_LEN + len)
    }

    /// Re-encodes the collected block with `:authority` replaced and appends it to `out` as a
    /// HEADERS frame and as many CONTINUATION frames as it needs.
    fn reencode(&mut self, start: &BlockStart, out: &mut Vec<u8>) -> io::Result<()> {
        let encoded = &mut self.encoded;
        encoded.clear();
        // Each field re-encodes to at most its name and value plus 11 bytes, so the block stays
        // within the list's size. The rest of an oversized block is still decoded (not encoded)
        // to keep the client's table in step until the error ends the connection.
        let mut list_size = 0usize;
        self.decoder
            .decode(&self.block, |name, value, never_indexed| {
                let value = if name == b":authority" { AUTHORITY } else { value };
                list_size = list_size.saturating_add(entry_size(name, value));
                if list_size <= MAX_HEADER_LIST {
                    encode_literal(encoded, name, value, never_indexed);
                }
            })
            .map_err(invalid)?;
        if list_size > MAX_HEADER_LIST {
            return Err(invalid(format_args!("the header list exceeds the {MAX_HEADER_LIST} bytes accepted")));
        }
        let priority: &[u8] = match &start.priority {
            Some(p) => p,
            None => &[],
        };
        let (first, mut rest) = encoded.split_at(encoded.len().min(MAX_FRAME - priority.len()));
        let mut flags = if start.end_stream { FLAG_END_STREAM } else { 0 };
        if !priority.is_empty() {
            flags |= FLAG_PRIORITY;
        }
        if rest.is_empty() {
            flags |= FLAG_END_HEADERS;
        }
        push_frame_head(out, priority.len() + first.len(), FRAME_HEADERS, flags, start.stream);
        out.extend_from_slice(priority);
        out.extend_from_slice(first);
        while !rest.is_empty() {
            let (chunk, after) = rest.split_at(rest.len().min(MAX_FRAME));
            rest = after;
            let flags = if rest.is_empty() { FLAG_END_HEADERS } else { 0 };
            push_frame_head(out, chunk.len(), FRAME_CONTINUATION, flags, start.stream);
            out.extend_from_slice(chunk);
        }
        Ok(())
    }
}

fn frame_len(head: &[u8]) -> usize {
    (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2])
}

/// The header block fragment of a HEADERS payload (without padding) and its priority fields.
fn headers_fragment(payload: &[u8], flags: u8) -> io::Result<(&[u8], Option<[u8; 5]>)> {
    let mut body = payload;
    if flags & FLAG_PADDED != 0 {
        let (&pad, rest) = body.split_first().ok_or_else(|| invalid("a padded HEADERS frame is empty"))?;
        body = rest
            .get(..rest.len().wrapping_sub(usize::from(pad)))
            .filter(|_| usize::from(pad) <= rest.len())
            .ok_or_else(|| invalid("HEADERS padding is longer than the frame"))?;
    }
    let mut priority = None;
    if flags & FLAG_PRIORITY != 0 {
        let (fields, rest) =
            body.split_at_checked(5).ok_or_else(|| invalid("HEADERS priority fields are cut short"))?;
        let mut p = [0u8; 5];
        p.copy_from_slice(fields);
        priority = Some(p);
        body = rest;
    }
    Ok((body, priority))
}

impl<IO> AuthorityRewrite<IO> {
    /// Filters `io`'s inbound bytes, from the client preface on.
    pub fn new(io: IO) -> Self {
        Self { io, frames: Frames::new(), pending: Vec::new(), ready: Vec::new(), ready_pos: 0, scratch: Vec::new() }
    }

    /// Moves what can go from `pending` to `ready`, re-encoding header blocks on the way. What
    /// stays in `pending` needs more bytes.
    fn process(&mut self) -> io::Result<()> {
        if self.ready_pos >= self.ready.len() {
            self.ready.clear();
            self.ready_pos = 0;
        }
        let mut i = 0;
        loop {
            let n = self.frames.passable(&self.pending[i..]);
            self.ready.extend_from_slice(&self.pending[i..i + n]);
            i += n;
            let n = self.frames.take_header_frame(&self.pending[i..], &mut self.ready)?;
            if n == 0 {
                break;
            }
            i += n;
        }
        self.pending.drain(..i);
        Ok(())
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for AuthorityRewrite<IO> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        loop {
            let this = &mut *self;
            if this.ready_pos < this.ready.len() {
                let n = (this.ready.len() - this.ready_pos).min(buf.remaining());
                buf.put_slice(&this.ready[this.ready_pos..this.ready_pos + n]);
                this.ready_pos += n;
                return Poll::Ready(Ok(()));
            }
            if this.pending.is_empty() {
                // The usual case: read straight into the caller's buffer and keep only what
                // starts at a header-block frame (or an incomplete frame header).
                let before = buf.filled().len();
                ready!(Pin::new(&mut this.io).poll_read(cx, buf))?;
                let read = buf.filled().len() - before;
                if read == 0 {
                    return Poll::Ready(Ok(()));
                }
                let pass = this.frames.passable(&buf.filled()[before..]);
                if pass < read {
                    this.pending.extend_from_slice(&buf.filled()[before + pass..]);
                    buf.set_filled(before + pass);
                    this.process()?;
                }
                if pass > 0 {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            // `pending` holds an incomplete frame: read more.
            if this.scratch.is_empty() {
                this.scratch = vec![0u8; MAX_FRAME + FRAME_HEADER_LEN];
            }
            let mut rb = ReadBuf::new(&mut this.scratch);
            ready!(Pin::new(&mut this.io).poll_read(cx, &mut rb))?;
            let n = rb.filled().len();
            if n == 0 {
                // EOF in the middle of a frame: the connection is over either way.
                this.pending.clear();
                return Poll::Ready(Ok(()));
            }
            this.pending.extend_from_slice(&this.scratch[..n]);
            this.process()?;
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for AuthorityRewrite<IO> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hpack::{huffman_encode, write_int};

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
    }

    type Field = (Vec<u8>, Vec<u8>);

    /// A client's HPACK encoder, written apart from [`Decoder`] so that each checks the other:
    /// it picks at random among every representation (indexed, literal with or without
    /// indexing, never indexed, indexed or literal names, Huffman or not, table size updates).
    struct ClientEncoder {
        /// Newest first, as the decoder numbers them.
        table: Vec<Field>,
        max: usize,
    }

    impl ClientEncoder {
        fn size(&self) -> usize {
            self.table.iter().map(|(n, v)| n.len() + v.len() + 32).sum()
        }

        fn shrink(&mut self) {
            while self.size() > self.max {
                self.table.pop();
            }
        }

        fn string(out: &mut Vec<u8>, s: &[u8], rng: &mut Rng) {
            if rng.below(2) == 0 {
                let h = huffman_encode(s);
                write_int(out, 7, 0x80, h.len());
                out.extend_from_slice(&h);
            } else {
                write_int(out, 7, 0, s.len());
                out.extend_from_slice(s);
            }
        }

        fn encode(&mut self, fields: &[Field], rng: &mut Rng) -> Vec<u8> {
            let mut out = Vec::new();
            if rng.below(6) == 0 {
                self.max = [0, 64, 256, 4096][rng.below(4)];
                self.shrink();
                write_int(&mut out, 5, 0x20, self.max);
            }
            for (name, value) in fields {
                let exact = self.table.iter().position(|f| f.0 == *name && f.1 == *value);
                let named = self.table.iter().position(|f| f.0 == *name);
                if let (Some(i), true) = (exact, rng.below(3) > 0) {
                    write_int(&mut out, 7, 0x80, 62 + i);
                    continue;
                }
                let (prefix, flags, indexing) = match rng.below(3) {
                    0 => (6, 0x40, true),
                    1 => (4, 0x00, false),
                    _ => (4, 0x10, false),
                };
                match (named, name.as_slice() == b":authority", rng.below(2)) {
                    (Some(i), _, 0) => write_int(&mut out, prefix, flags, 62 + i),
                    (_, true, 0) => write_int(&mut out, prefix, flags, 1),
                    _ => {
                        write_int(&mut out, prefix, flags, 0);
                        Self::string(&mut out, name, rng);
                    }
                }
                Self::string(&mut out, value, rng);
                if indexing {
                    self.table.insert(0, (name.clone(), value.clone()));
                    self.shrink();
                }
            }
            out
        }
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = Vec::new();
        push_frame_head(&mut f, payload.len(), kind, flags, stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// Authorities clients send over Unix sockets, and worse.
    const AUTHORITIES: &[&[u8]] = &[
        b"localhost",
        b"/run/machine-driver/driver.sock",
        b"run%2Fmachine-driver%2Fdriver.sock",
        b"%2Frun%2Fmachine-driver%2Fdriver.sock",
        b"/tmp/a dir/@sock",
        b"/tmp/\xc3\xa9t\xc3\xa9/\xff.sock",
        b"",
        b"[::1]:50051",
    ];

    fn random_request(rng: &mut Rng, stream: u32) -> Vec<Field> {
        let mut fields: Vec<Field> = vec![
            (b":method".to_vec(), b"POST".to_vec()),
            (b":scheme".to_vec(), b"http".to_vec()),
            (b":path".to_vec(), format!("/machinedriver.v1.Driver/M{}", rng.below(4)).into_bytes()),
            (b":authority".to_vec(), AUTHORITIES[rng.below(AUTHORITIES.len())].to_vec()),
            (b"content-type".to_vec(), b"application/grpc".to_vec()),
            (b"te".to_vec(), b"trailers".to_vec()),
        ];
        fields.push((b"x-request-id".to_vec(), format!("req-{stream}").into_bytes()));
        if rng.below(4) == 0 {
            fields.push((b"x-big".to_vec(), vec![b'b'; rng.below(40_000)]));
        }
        fields
    }

    /// One parsed output frame: (kind, flags, stream, payload).
    fn parse_frames(mut data: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        let mut frames = Vec::new();
        while data.len() >= 9 {
            let len = frame_len(data);
            let stream = u32::from_be_bytes([data[5], data[6], data[7], data[8]]);
            frames.push((data[3], data[4], stream, data[9..9 + len].to_vec()));
            data = &data[9 + len..];
        }
        assert!(data.is_empty(), "output ends inside a frame");
        frames
    }

    /// Inbound bytes handed out in random pieces, with random `Pending`s.
    struct Chunked {
        data: Vec<u8>,
        pos: usize,
        max_chunk: usize,
        rng: Rng,
    }

    impl AsyncRead for Chunked {
        fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
            if self.rng.below(8) == 0 {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            let max_chunk = self.max_chunk;
            let chunk = 1 + self.rng.below(max_chunk);
            let n = chunk.min(self.data.len() - self.pos).min(buf.remaining());
            let pos = self.pos;
            buf.put_slice(&self.data[pos..pos + n]);
            self.pos += n;
            Poll::Ready(Ok(()))
        }
    }

    /// Random connections (requests with every kind of authority and encoding, split over
    /// CONTINUATION frames, padded, with priority; DATA, SETTINGS, PING and WINDOW_UPDATE frames
    /// between them), read through the filter in random pieces: the server sees the same frames
    /// and the same fields, with `:authority` = localhost, and its dynamic table stays empty.
    #[tokio::test]
    async fn any_connection_reads_as_the_same_requests_with_a_clean_authority() {
        use tokio::io::AsyncReadExt;
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for round in 0..200 {
            let mut client = ClientEncoder { table: Vec::new(), max: 4096 };
            let mut wire = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
            let mut sent_requests = Vec::new();
            let mut other_frames = Vec::new();
            for n in 0..rng.below(30) {
                let stream = 2 * n as u32 + 1;
                if rng.below(2) == 0 {
                    let f = match rng.below(4) {
                        0 => frame(0x0, 0, stream, &vec![7u8; rng.below(20_000)]),
                        1 => frame(0x4, 0, 0, &[0, 4, 0, 1, 0, 0]),
                        2 => frame(0x6, 0, 0, &[1, 2, 3, 4, 5, 6, 7, 8]),
                        _ => frame(0x8, 0, 0, &[0, 1, 0, 0]),
                    };
                    other_frames.push(parse_frames(&f).remove(0));
                    wire.extend_from_slice(&f);
                }
                let fields = random_request(&mut rng, stream);
                let block = client.encode(&fields, &mut rng);
                let mut pieces: Vec<&[u8]> = Vec::new();
                let mut rest = block.as_slice();
                while !rest.is_empty() {
                    let n = 1 + rng.below(rest.len().min(20_000));
                    pieces.push(&rest[..n]);
                    rest = &rest[n..];
                }
                if pieces.is_empty() {
                    pieces.push(&[]);
                }
                let end_stream = if rng.below(2) == 0 { FLAG_END_STREAM } else { 0 };
                let mut first = Vec::new();
                let mut flags = end_stream;
                let pad = rng.below(3) == 0;
                if pad {
                    flags |= FLAG_PADDED;
                    first.push(3);
                }
                if rng.below(3) == 0 {
                    flags |= FLAG_PRIORITY;
                    first.extend_from_slice(&[0, 0, 0, 0, 15]);
                }
                first.extend_from_slice(pieces[0]);
                if pad {
                    first.extend_from_slice(&[0, 0, 0]);
                }
                if pieces.len() == 1 {
                    flags |= FLAG_END_HEADERS;
                }
                wire.extend_from_slice(&frame(FRAME_HEADERS, flags, stream, &first));
                for (k, piece) in pieces.iter().enumerate().skip(1) {
                    let flags = if k == pieces.len() - 1 { FLAG_END_HEADERS } else { 0 };
                    wire.extend_from_slice(&frame(FRAME_CONTINUATION, flags, stream, piece));
                }
                sent_requests.push((stream, end_stream != 0, fields));
            }

            let sizes = [1, 5, 9, 64, 1500, 20_000];
            let max_chunk = sizes[rng.below(sizes.len())];
            let max_buf = sizes[rng.below(sizes.len())];
            let mut filter = AuthorityRewrite::new(Chunked { data: wire, pos: 0, max_chunk, rng: Rng(rng.next() | 1) });
            let mut got = Vec::new();
            loop {
                let mut buf = vec![0u8; 1 + rng.below(max_buf)];
                let n = filter.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..n]);
            }

            assert_eq!(&got[..24], b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "round {round}");
            let mut server = Decoder::default();
            let (mut requests, mut others) = (Vec::new(), Vec::new());
            let mut block: Option<(u32, bool, Vec<u8>)> = None;
            for (kind, flags, stream, payload) in parse_frames(&got[24..]) {
                if matches!(kind, FRAME_HEADERS | FRAME_CONTINUATION) {
                    assert!(payload.len() <= MAX_FRAME, "round {round}: a {}-byte header frame", payload.len());
                }
                match kind {
                    FRAME_HEADERS => {
                        assert!(block.is_none() && flags & FLAG_PADDED == 0);
                        let skip = if flags & FLAG_PRIORITY != 0 { 5 } else { 0 };
                        block = Some((stream, flags & FLAG_END_STREAM != 0, payload[skip..].to_vec()));
                    }
                    FRAME_CONTINUATION => block.as_mut().map(|b| b.2.extend_from_slice(&payload)).unwrap(),
                    _ => others.push((kind, flags, stream, payload)),
                }
                if matches!(kind, FRAME_HEADERS | FRAME_CONTINUATION) && flags & FLAG_END_HEADERS != 0 {
                    let (stream, end_stream, bytes) = block.take().unwrap();
                    let mut fields = Vec::new();
                    server.decode(&bytes, |n, v, _| fields.push((n.to_vec(), v.to_vec()))).unwrap();
                    assert_eq!(server.table_size(), 0);
                    requests.push((stream, end_stream, fields));
                }
            }
            let want: Vec<_> = sent_requests
                .into_iter()
                .map(|(s, e, mut fields)| {
                    fields.iter_mut().filter(|f| f.0 == b":authority").for_each(|f| f.1 = b"localhost".to_vec());
                    (s, e, fields)
                })
                .collect();
            assert!(requests == want, "round {round}: the server reads other requests than were sent");
            assert_eq!(others, other_frames, "round {round}");
        }
    }

    impl<IO> tonic::transport::server::Connected for AuthorityRewrite<IO> {
        type ConnectInfo = ();

        fn connect_info(&self) {}
    }

    /// A real tonic (h2) server behind the filter on a Unix socket, called with raw HTTP/2: one
    /// connection, a request per authority (several encodings, split over CONTINUATION frames),
    /// every one answered with `grpc-status: 0`.
    #[tokio::test]
    async fn a_real_server_answers_whatever_the_authority() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        use tokio_stream::StreamExt;

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h2.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener).map(|r| r.map(AuthorityRewrite::new));
        let (_reporter, health) = tonic_health::server::health_reporter();
        let server =
            tokio::spawn(tonic::transport::Server::builder().add_service(health).serve_with_incoming(incoming));

        for seed in [1, 2, 3] {
            let mut rng = Rng(seed);
            let mut client = ClientEncoder { table: Vec::new(), max: 4096 };
            let mut wire = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
            wire.extend_from_slice(&frame(0x4, 0, 0, &[]));
            let mut streams = Vec::new();
            for (k, authority) in AUTHORITIES.iter().enumerate() {
                let stream = 2 * k as u32 + 1;
                let fields: Vec<Field> = [
                    (":method", &b"POST"[..]),
                    (":scheme", b"http"),
                    (":path", b"/grpc.health.v1.Health/Check"),
                    (":authority", authority),
                    ("content-type", b"application/grpc"),
                    ("te", b"trailers"),
                ]
                .iter()
                .map(|(n, v)| (n.as_bytes().to_vec(), v.to_vec()))
                .collect();
                let block = client.encode(&fields, &mut rng);
                let (head, tail) = block.split_at(block.len() / 2);
                wire.extend_from_slice(&frame(FRAME_HEADERS, 0, stream, head));
                wire.extend_from_slice(&frame(FRAME_CONTINUATION, FLAG_END_HEADERS, stream, tail));
                // An empty HealthCheckRequest: no compression flag, zero length.
                wire.extend_from_slice(&frame(0x0, FLAG_END_STREAM, stream, &[0, 0, 0, 0, 0]));
                streams.push(stream);
            }
            let mut conn = tokio::net::UnixStream::connect(&path).await.unwrap();
            conn.write_all(&wire).await.unwrap();

            let mut server_hpack = Decoder::default();
            let mut answers: std::collections::BTreeMap<u32, Vec<(String, String)>> = Default::default();
            let mut finished = std::collections::BTreeSet::new();
            let mut inbound = Vec::new();
            let read_all = async {
                while finished.len() < streams.len() {
                    let mut buf = [0u8; 4096];
                    let n = conn.read(&mut buf).await.unwrap();
                    assert!(n > 0, "the server closed the connection; answers so far: {answers:?}");
                    inbound.extend_from_slice(&buf[..n]);
                    while inbound.len() >= 9 && inbound.len() >= 9 + frame_len(&inbound) {
                        let len = frame_len(&inbound);
                        let frame_bytes: Vec<u8> = inbound.drain(..9 + len).collect();
                        let (kind, flags) = (frame_bytes[3], frame_bytes[4]);
                        let stream =
                            u32::from_be_bytes([frame_bytes[5], frame_bytes[6], frame_bytes[7], frame_bytes[8]]);
                        let payload = &frame_bytes[9..];
                        match kind {
                            0x4 if flags & 0x1 == 0 => conn.write_all(&frame(0x4, 0x1, 0, &[])).await.unwrap(),
                            0x3 => {
                                panic!("the server reset stream {stream}: {payload:?} (answers so far: {answers:?})")
                            }
                            0x7 => panic!("the server sent GOAWAY: {payload:?}"),
                            FRAME_HEADERS => {
                                assert!(flags & FLAG_END_HEADERS != 0, "the test reads single-frame responses only");
                                server_hpack
                                    .decode(payload, |n, v, _| {
                                        answers.entry(stream).or_default().push((
                                            String::from_utf8_lossy(n).into_owned(),
                                            String::from_utf8_lossy(v).into_owned(),
                                        ))
                                    })
                                    .unwrap();
                                if flags & FLAG_END_STREAM != 0 {
                                    finished.insert(stream);
                                }
                            }
                            _ => {}
                        }
                    }
                }
            };
            tokio::time::timeout(std::time::Duration::from_secs(10), read_all)
                .await
                .unwrap_or_else(|_| panic!("seed {seed}: not every stream was answered in 10 s"));
            for stream in &streams {
                let fields = &answers[stream];
                let has = |n: &str, v: &str| fields.iter().any(|f| f.0 == n && f.1 == v);
                assert!(has(":status", "200") && has("grpc-status", "0"), "seed {seed}, stream {stream}: {fields:?}");
            }
        }
        server.abort();
    }

    /// Found by the authority_reencode fuzz target's contract: a 4 KB field named again and again
    /// by one-byte references (fuzz/regressions/authority_reencode/header-list-bomb) re-encoded
    /// to a block a thousand times its size, limited by nothing. Now refused past
    /// MAX_HEADER_LIST, without building the block.
    #[test]
    fn a_header_list_bomb_is_refused_not_expanded() {
        let mut block = Vec::new();
        write_int(&mut block, 6, 0x40, 0);
        write_int(&mut block, 7, 0, 6);
        block.extend_from_slice(b"x-bomb");
        write_int(&mut block, 7, 0, 4000);
        block.extend_from_slice(&[b'b'; 4000]);
        // Up to the limit the block is re-encoded; one more reference is refused.
        let fits = MAX_HEADER_LIST / (6 + 4000 + 32);
        let mut frames = Frames::new();
        frames.preface_left = 0;
        let mut out = Vec::new();
        let mut ok = block.clone();
        ok.extend(std::iter::repeat_n(0xbe, fits - 1));
        frames.take_header_frame(&frame(FRAME_HEADERS, FLAG_END_HEADERS, 1, &ok), &mut out).unwrap();
        assert!(out.len() <= MAX_HEADER_LIST + 9 * (1 + MAX_HEADER_LIST / MAX_FRAME), "{}", out.len());
        let mut frames = Frames::new();
        frames.preface_left = 0;
        let mut out = Vec::new();
        block.extend(std::iter::repeat_n(0xbe, fits));
        let err = frames.take_header_frame(&frame(FRAME_HEADERS, FLAG_END_HEADERS, 1, &block), &mut out).unwrap_err();
        assert!(err.to_string().contains("header list exceeds"), "{err}");
        assert!(out.is_empty() && frames.encoded.len() <= MAX_HEADER_LIST);
    }

    #[test]
    fn protocol_violations_end_the_connection_with_a_clear_error() {
        let cases: [(&[u8], &str); 4] = [
            (&frame(FRAME_CONTINUATION, FLAG_END_HEADERS, 1, &[0x82]), "CONTINUATION without a header block"),
            (&frame(FRAME_PUSH_PROMISE, FLAG_END_HEADERS, 1, &[0, 0, 0, 2, 0x82]), "PUSH_PROMISE"),
            (&frame(FRAME_HEADERS, FLAG_END_HEADERS, 1, &[0xbe]), "index 62 is in neither"),
            (&frame(FRAME_HEADERS, FLAG_END_HEADERS | FLAG_PADDED, 1, &[9, 0x82]), "padding is longer"),
        ];
        for (bytes, message) in cases {
            let mut frames = Frames::new();
            frames.preface_left = 0;
            let err = frames.take_header_frame(bytes, &mut Vec::new()).unwrap_err();
            assert!(err.to_string().contains(message), "{err}");
        }
        let mut frames = Frames::new();
        frames.preface_left = 0;
        let mut out = Vec::new();
        assert_eq!(frames.take_header_frame(&frame(FRAME_HEADERS, 0, 1, &[0x82]), &mut out).unwrap(), 10);
        let err = frames.take_header_frame(&frame(0x0, 0, 1, b"data"), &mut out).unwrap_err();
        assert!(err.to_string().contains("interrupted"), "{err}");
        assert!(out.is_empty());
    }
}
