//! The checks behind the `hpack_decode` and `authority_reencode` fuzz targets in `fuzz/` (built
//! with the `fuzzing` feature), and the entry points into the private HPACK code for the
//! differential test against another HPACK implementation (`tests/hpack_interop.rs`). Not a
//! stable API.
//!
//! Every check takes the fuzzer's bytes and panics when the code under test breaks its contract.
//! The same functions replay the committed seeds and every crash found so far
//! (`fuzz/corpus/<target>/`, `fuzz/regressions/<target>/`) under plain `cargo test`, so a fixed
//! crash stays fixed and the fuzz targets and the regression tests cannot drift apart.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use tokio::io::{AsyncRead, ReadBuf};

use crate::authority::{self, AuthorityRewrite};
use crate::hpack::{self, Decoder};

#[cfg(test)]
mod tests;

/// One decoded header field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderField {
    /// The name, as sent.
    pub name: Vec<u8>,
    /// The value, as sent.
    pub value: Vec<u8>,
    /// Whether the sender marked it never-indexed (RFC 7541 §6.2.3).
    pub never_indexed: bool,
}

/// The SDK's HPACK decoder: one per connection, blocks in order.
#[derive(Default)]
pub struct HpackDecoder(Decoder);

impl HpackDecoder {
    /// Decodes one header block.
    ///
    /// # Errors
    /// Why the block is malformed (the connection would be closed).
    pub fn decode(&mut self, block: &[u8]) -> Result<Vec<HeaderField>, String> {
        let mut fields = Vec::new();
        self.0
            .decode(block, |name, value, never_indexed| {
                fields.push(HeaderField { name: name.to_vec(), value: value.to_vec(), never_indexed })
            })
            .map_err(|e| e.to_string())?;
        Ok(fields)
    }

    /// The dynamic table's size (RFC 7541 §4.1).
    pub fn table_size(&self) -> usize {
        self.0.table_size()
    }
}

/// What the Unix-socket `:authority` filter makes of a connection's inbound bytes (client
/// preface included), read through it in one go.
///
/// # Errors
/// The filter's error, with everything it handed out before it.
pub fn rewrite_authority(inbound: &[u8]) -> Result<Vec<u8>, (io::Error, Vec<u8>)> {
    read_through_filter(inbound, &mut Pieces::whole())
}

/// The value every `:authority` becomes.
pub const REWRITTEN_AUTHORITY: &[u8] = authority::AUTHORITY;

// ---------------------------------------------------------------------------------------------
// hpack_decode

/// Splits fuzz input into header blocks: each is a 2-byte big-endian length and that many bytes
/// (the last one takes what is left).
pub fn split_blocks(mut data: &[u8]) -> Vec<&[u8]> {
    let mut blocks = Vec::new();
    while !data.is_empty() {
        if data.len() < 2 {
            blocks.push(data);
            break;
        }
        let len = usize::from(u16::from_be_bytes([data[0], data[1]])).min(data.len() - 2);
        blocks.push(&data[2..2 + len]);
        data = &data[2 + len..];
    }
    blocks
}

/// The `hpack_decode` target: the blocks of [`split_blocks`] decoded in order on one connection.
/// Never panics; the dynamic table stays within its limits; no field is larger than a table
/// entry or what the block's bytes can hold; every decoded block survives a round trip through
/// the plain-literal encoder and a fresh decoder.
pub fn check_hpack_decode(data: &[u8]) {
    let mut decoder = Decoder::default();
    for block in split_blocks(data) {
        let mut fields = Vec::new();
        let result = decoder.decode(block, |name, value, never_indexed| {
            // A field is a table entry (at most MAX_TABLE_SIZE - 32 bytes) or strings read from
            // the block (Huffman codes are at least 5 bits a byte).
            let bound = hpack::MAX_TABLE_SIZE - 32 + block.len() * 8 / 5;
            assert!(
                name.len() + value.len() <= bound,
                "a {}-byte field from a {}-byte block",
                name.len() + value.len(),
                block.len()
            );
            fields.push(HeaderField { name: name.to_vec(), value: value.to_vec(), never_indexed });
        });
        decoder.assert_consistent();
        assert!(fields.len() <= block.len(), "{} fields from {} bytes", fields.len(), block.len());
        if result.is_err() {
            // The connection is over.
            return;
        }
        let mut literal = Vec::new();
        for f in &fields {
            hpack::encode_literal(&mut literal, &f.name, &f.value, f.never_indexed);
        }
        let mut fresh = HpackDecoder::default();
        assert_eq!(fresh.decode(&literal).as_ref(), Ok(&fields), "the plain-literal re-encoding decodes differently");
        assert_eq!(fresh.table_size(), 0, "plain literals reached the dynamic table");
    }
}

// ---------------------------------------------------------------------------------------------
// authority_reencode

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const PUSH_PROMISE: u8 = 0x5;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

/// What a connection carries, frame by frame, with header blocks decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Event {
    /// A frame that carries no header block, as it is on the wire.
    Frame { kind: u8, flags: u8, stream: [u8; 4], payload: Vec<u8> },
    /// A whole header block (HEADERS and its CONTINUATIONs).
    Block { stream: [u8; 4], end_stream: bool, priority: Option<[u8; 5]>, fields: Vec<HeaderField> },
}

/// An in-memory connection handing out its bytes in pieces of varying size.
struct Pieces<'a> {
    data: &'a [u8],
    pos: usize,
    rng: u64,
    max_piece: usize,
}

impl Pieces<'_> {
    fn whole() -> Pieces<'static> {
        Pieces { data: &[], pos: 0, rng: 1, max_piece: usize::MAX }
    }

    fn next(&mut self) -> usize {
        // xorshift64: a fixed sequence for a given seed, so crashes reproduce.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng as usize
    }
}

impl AsyncRead for Pieces<'_> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if self.max_piece != usize::MAX && self.next().is_multiple_of(5) {
            // Nothing to read just now.
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let piece = if self.max_piece == usize::MAX { usize::MAX } else { 1 + self.next() % self.max_piece };
        let n = piece.min(self.data.len() - self.pos).min(buf.remaining());
        let pos = self.pos;
        buf.put_slice(&self.data[pos..pos + n]);
        self.pos += n;
        Poll::Ready(Ok(()))
    }
}

/// Reads `inbound` through the filter to its end, with read buffers of varying size.
fn read_through_filter(inbound: &[u8], pieces: &mut Pieces<'_>) -> Result<Vec<u8>, (io::Error, Vec<u8>)> {
    let mut source = Pieces { data: inbound, pos: 0, rng: pieces.rng, max_piece: pieces.max_piece };
    let sizes = [1usize, 7, 9, 100, 4096, 70_000];
    let mut filter = AuthorityRewrite::new(&mut source);
    let mut cx = Context::from_waker(Waker::noop());
    let mut out = Vec::new();
    let mut buf = vec![0u8; 70_000];
    // A poll that does not end in Pending reads input or hands out output, and the source
    // pauses one time in five at random, so this ends; bound it all the same.
    let mut polls = 0usize;
    loop {
        polls += 1;
        assert!(polls <= 4 * (inbound.len() + out.len()) + 1000, "the filter does not get to the end of its input");
        let size = if pieces.max_piece == usize::MAX { buf.len() } else { sizes[pieces.next() % sizes.len()] };
        let mut rb = ReadBuf::new(&mut buf[..size]);
        match Pin::new(&mut filter).poll_read(&mut cx, &mut rb) {
            Poll::Pending => continue,
            Poll::Ready(Err(e)) => return Err((e, out)),
            Poll::Ready(Ok(())) if rb.filled().is_empty() => return Ok(out),
            Poll::Ready(Ok(())) => out.extend_from_slice(rb.filled()),
        }
    }
}

fn frame_len(head: &[u8]) -> usize {
    (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2])
}

/// The events of a client's connection (after the preface), as the filter's contract reads them:
/// frames up to the first incomplete one, and whether the filter must refuse the connection
/// (it does so at the first frame it cannot accept, after the events returned).
/// A header block being collected: the opening HEADERS frame's stream id, whether it ended the
/// stream, its priority fields, and the fragments so far.
type OpenBlock = ([u8; 4], bool, Option<[u8; 5]>, Vec<u8>);

fn inbound_events(mut data: &[u8]) -> (Vec<Event>, bool) {
    let mut events = Vec::new();
    let mut client = Decoder::default();
    // The HEADERS frame that opened the block being collected, and the fragments so far.
    let mut open: Option<OpenBlock> = None;
    loop {
        if data.len() < 9 {
            return (events, false);
        }
        let (len, kind, flags) = (frame_len(data), data[3], data[4]);
        let stream = [data[5], data[6], data[7], data[8]];
        let carries_block = matches!(kind, HEADERS | CONTINUATION | PUSH_PROMISE);
        if (carries_block || open.is_some()) && len > authority::MAX_BLOCK {
            return (events, true);
        }
        let Some(payload) = data.get(9..9 + len) else { return (events, false) };
        data = &data[9 + len..];
        if !carries_block && open.is_none() {
            events.push(Event::Frame { kind, flags, stream, payload: payload.to_vec() });
            continue;
        }
        match (kind, &mut open) {
            (HEADERS, None) => {
                let mut body = payload;
                if flags & PADDED != 0 {
                    let Some((&pad, rest)) = body.split_first() else { return (events, true) };
                    let Some(keep) = rest.len().checked_sub(usize::from(pad)) else { return (events, true) };
                    body = &rest[..keep];
                }
                let mut priority = None;
                if flags & PRIORITY != 0 {
                    let Some((p, rest)) = body.split_first_chunk::<5>() else { return (events, true) };
                    priority = Some(*p);
                    body = rest;
                }
                open = Some((stream, flags & END_STREAM != 0, priority, body.to_vec()));
            }
            (CONTINUATION, Some(block)) if block.0 == stream => block.3.extend_from_slice(payload),
            _ => return (events, true),
        }
        if open.as_ref().is_some_and(|b| b.3.len() > authority::MAX_BLOCK) {
            return (events, true);
        }
        if flags & END_HEADERS != 0 {
            if let Some((stream, end_stream, priority, block)) = open.take() {
                let mut fields = Vec::new();
                let mut size = 0usize;
                let decoded = client.decode(&block, |name, value, never_indexed| {
                    let value = if name == b":authority" { authority::AUTHORITY } else { value };
                    size += name.len() + value.len() + 32;
                    fields.push(HeaderField { name: name.to_vec(), value: value.to_vec(), never_indexed });
                });
                if decoded.is_err() || size > authority::MAX_HEADER_LIST {
                    return (events, true);
                }
                events.push(Event::Block { stream, end_stream, priority, fields });
            }
        }
    }
}

/// The events of what the filter hands the server (after the preface), checking on the way that
/// it is what a server accepts from the filter: header frames within the frame size, blocks in
/// plain literals that leave the server's dynamic table empty, within the header-list limit.
/// A trailing incomplete frame (one passed through as it arrived) is left out.
fn outbound_events(mut data: &[u8]) -> Vec<Event> {
    let mut events = Vec::new();
    let mut server = Decoder::default();
    let mut open: Option<OpenBlock> = None;
    while data.len() >= 9 {
        let (len, kind, flags) = (frame_len(data), data[3], data[4]);
        let stream = [data[5], data[6], data[7], data[8]];
        let Some(payload) = data.get(9..9 + len) else {
            assert!(!matches!(kind, HEADERS | CONTINUATION), "the filter handed out part of a header frame");
            break;
        };
        data = &data[9 + len..];
        match kind {
            HEADERS | CONTINUATION => {
                assert!(len <= authority::MAX_FRAME, "a {len}-byte header frame");
                if kind == HEADERS {
                    assert!(open.is_none(), "a header block interrupted by HEADERS");
                    assert_eq!(flags & !(END_STREAM | END_HEADERS | PRIORITY), 0, "HEADERS flags {flags:#x}");
                    let (priority, body) = if flags & PRIORITY != 0 {
                        let (p, rest) = payload.split_first_chunk::<5>().expect("priority fields");
                        (Some(*p), rest)
                    } else {
                        (None, payload)
                    };
                    open = Some((stream, flags & END_STREAM != 0, priority, body.to_vec()));
                } else {
                    let block = open.as_mut().expect("CONTINUATION without HEADERS");
                    assert_eq!(block.0, stream, "CONTINUATION on another stream");
                    assert_eq!(flags & !END_HEADERS, 0, "CONTINUATION flags {flags:#x}");
                    block.3.extend_from_slice(payload);
                }
                if flags & END_HEADERS != 0 {
                    let (stream, end_stream, priority, block) = open.take().expect("an open block");
                    assert!(block.len() <= authority::MAX_HEADER_LIST, "a {}-byte re-encoded block", block.len());
                    let mut fields = Vec::new();
                    server
                        .decode(&block, |name, value, never_indexed| {
                            fields.push(HeaderField { name: name.to_vec(), value: value.to_vec(), never_indexed })
                        })
                        .expect("the re-encoded block decodes");
                    assert_eq!(server.table_size(), 0, "the re-encoded block touched the server's dynamic table");
                    events.push(Event::Block { stream, end_stream, priority, fields });
                }
            }
            _ => {
                assert!(open.is_none(), "a re-encoded header block interrupted by a frame of type {kind}");
                events.push(Event::Frame { kind, flags, stream, payload: payload.to_vec() });
            }
        }
    }
    assert!(open.is_none(), "the filter handed out part of a header block");
    events
}

/// The `authority_reencode` target. Input: one byte choosing how the connection arrives (piece
/// sizes and pauses), then the client's bytes after the preface. The filter never panics, and
/// what it hands the server is the client's frames with every header block re-encoded to the
/// same fields (never-indexed flags, stream, END_STREAM and priority kept) except `:authority`,
/// which is `localhost`; it refuses exactly the connections its contract refuses, after handing
/// out everything before the offending frame (some of it may be lost with the error).
pub fn check_authority_reencode(data: &[u8]) {
    let Some((&seed, client)) = data.split_first() else { return };
    let mut inbound = PREFACE.to_vec();
    inbound.extend_from_slice(client);
    let max_piece = [1usize, 5, 9, 64, 1500, 20_000, usize::MAX][usize::from(seed % 7)];
    let mut pieces = Pieces { data: &[], pos: 0, rng: u64::from(seed) | 0x100, max_piece };
    let (expected, refused) = inbound_events(client);
    let (out, error) = match read_through_filter(&inbound, &mut pieces) {
        Ok(out) => (out, None),
        Err((e, out)) => (out, Some(e)),
    };
    let handed = out.len().min(PREFACE.len());
    assert_eq!(&out[..handed], &PREFACE[..handed], "the preface changed");
    let got = if out.len() > PREFACE.len() { outbound_events(&out[PREFACE.len()..]) } else { Vec::new() };
    match (refused, error) {
        (false, None) => assert!(
            got == expected,
            "the server reads other frames than the client sent:\n got {got:?}\nwant {expected:?}"
        ),
        (true, Some(e)) => {
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
            assert!(
                expected.starts_with(&got),
                "before its error the filter handed out other frames:\n got {got:?}\nwant {expected:?}"
            );
        }
        (false, Some(e)) => panic!("the filter refused an acceptable connection: {e}"),
        (true, None) => panic!("the filter accepted a connection its contract refuses; it handed out {got:?}"),
    }
}
