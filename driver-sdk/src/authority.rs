//! Lets grpcurl 1.8.x (grpc-go 1.44) talk to us over a Unix socket.
//!
//! That client sends the socket *path* as the HTTP/2 `:authority` (e.g. `/run/d/driver.sock`).
//! `h2` rejects such a request as malformed (PROTOCOL_ERROR) before any of our code runs. This
//! filter sits on the inbound bytes of Unix-socket connections, finds `:authority` literals in
//! HEADERS frames and rewrites every `/` to `-` in place. Both characters have 6-bit Huffman
//! codes, so the encoded and decoded lengths are unchanged, and the HPACK dynamic tables of
//! client and server stay in step. Nothing else is touched.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

const PREFACE_LEN: usize = 24;
const FRAME_HEADERS: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;

/// Wraps an accepted connection's IO.
pub(crate) struct AuthorityFix<IO> {
    io: IO,
    frames: FrameScanner,
    /// Bytes read but not yet handed out: the start of a frame that must be complete before it
    /// can go (a partial frame header, or a HEADERS frame that may need fixing).
    pending: Vec<u8>,
    /// Bytes ready to hand out, and how many were handed out already.
    ready: Vec<u8>,
    ready_pos: usize,
    /// Read buffer for completing a held-back frame (allocated on first use, then reused).
    scratch: Vec<u8>,
}

/// Where the frame boundaries are in the inbound byte stream.
struct FrameScanner {
    /// Bytes of the client preface still to come.
    preface_left: usize,
    /// Bytes still to come of a frame that was let through before it was complete (a frame that
    /// is never rewritten).
    passthrough_left: usize,
}

impl FrameScanner {
    /// Walks the frames of `data`, which starts where the previous call stopped, and fixes every
    /// complete HEADERS frame in place. Returns how many leading bytes may be handed out; the rest
    /// (a partial frame header, or an incomplete HEADERS frame) must be kept and passed again,
    /// with more bytes after it, to the next call.
    fn scan(&mut self, data: &mut [u8]) -> usize {
        let mut i = 0;
        loop {
            if self.preface_left > 0 {
                let n = self.preface_left.min(data.len() - i);
                self.preface_left -= n;
                i += n;
            }
            if self.passthrough_left > 0 {
                let n = self.passthrough_left.min(data.len() - i);
                self.passthrough_left -= n;
                i += n;
            }
            let rest = &mut data[i..];
            if rest.len() < 9 || self.preface_left > 0 {
                // Everything is consumed, or a frame header is incomplete: keep it.
                return i;
            }
            let len = (usize::from(rest[0]) << 16) | (usize::from(rest[1]) << 8) | usize::from(rest[2]);
            let (kind, flags) = (rest[3], rest[4]);
            if kind == FRAME_HEADERS && flags & FLAG_END_HEADERS != 0 {
                if rest.len() < 9 + len {
                    return i;
                }
                fix_headers_payload(&mut rest[9..9 + len], flags);
                i += 9 + len;
            } else {
                // Never rewritten: let it through even if only part of it is here.
                let n = (9 + len).min(rest.len());
                self.passthrough_left = 9 + len - n;
                i += n;
            }
        }
    }
}

impl<IO> AuthorityFix<IO> {
    pub(crate) fn new(io: IO) -> Self {
        Self {
            io,
            frames: FrameScanner { preface_left: PREFACE_LEN, passthrough_left: 0 },
            pending: Vec::new(),
            ready: Vec::new(),
            ready_pos: 0,
            scratch: Vec::new(),
        }
    }

    /// Moves what can go from `pending` to `ready`, fixing HEADERS frames on the way.
    fn process(&mut self) {
        let n = self.frames.scan(&mut self.pending);
        if self.ready_pos >= self.ready.len() {
            self.ready.clear();
            self.ready_pos = 0;
        }
        self.ready.extend(self.pending.drain(..n));
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for AuthorityFix<IO> {
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
                // The usual case: read straight into the caller's buffer and fix frames in place;
                // only an incomplete frame header or HEADERS frame is taken back and kept.
                let before = buf.filled().len();
                ready!(Pin::new(&mut this.io).poll_read(cx, buf))?;
                let read = buf.filled().len() - before;
                if read == 0 {
                    // EOF (nothing is kept back).
                    return Poll::Ready(Ok(()));
                }
                let keep = this.frames.scan(&mut buf.filled_mut()[before..]);
                if keep < read {
                    this.pending.extend_from_slice(&buf.filled()[before + keep..]);
                    buf.set_filled(before + keep);
                }
                if keep > 0 {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            // Completing a held-back frame.
            if this.scratch.is_empty() {
                this.scratch = vec![0u8; 16 * 1024];
            }
            let mut rb = ReadBuf::new(&mut this.scratch);
            ready!(Pin::new(&mut this.io).poll_read(cx, &mut rb))?;
            let n = rb.filled().len();
            if n == 0 {
                // EOF: hand out whatever is left as it is.
                this.ready.extend(this.pending.drain(..));
                if this.ready_pos >= this.ready.len() {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            this.pending.extend_from_slice(&this.scratch[..n]);
            this.process();
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<IO> {
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

fn fix_headers_payload(payload: &mut [u8], flags: u8) {
    let mut start = 0;
    let mut end = payload.len();
    if flags & FLAG_PADDED != 0 {
        let Some(&pad) = payload.first() else { return };
        start = 1;
        end = match end.checked_sub(usize::from(pad)) {
            Some(e) if e >= start => e,
            _ => return,
        };
    }
    if flags & FLAG_PRIORITY != 0 {
        start += 5;
    }
    if start <= end {
        fix_header_block(&mut payload[start..end]);
    }
}

/// Reads an HPACK integer with an `n`-bit prefix at `i`; returns (value, next index).
fn read_int(b: &[u8], i: usize, n: u8) -> Option<(usize, usize)> {
    let mask = (1usize << n) - 1;
    let mut v = usize::from(*b.get(i)?) & mask;
    let mut i = i + 1;
    if v < mask {
        return Some((v, i));
    }
    let mut shift = 0;
    loop {
        let byte = *b.get(i)?;
        i += 1;
        v = v.checked_add((usize::from(byte & 0x7f)).checked_shl(shift)?)?;
        shift += 7;
        if byte & 0x80 == 0 || shift > 28 {
            return Some((v, i));
        }
    }
}

/// The range of a string literal at `i`, whether it is Huffman-coded, and the next index.
fn string_at(b: &[u8], i: usize) -> Option<(std::ops::Range<usize>, bool, usize)> {
    let huffman = b.get(i)? & 0x80 != 0;
    let (len, j) = read_int(b, i, 7)?;
    let end = j.checked_add(len)?;
    (end <= b.len()).then_some((j..end, huffman, end))
}

fn fix_header_block(b: &mut [u8]) {
    let mut i = 0;
    while i < b.len() {
        let first = b[i];
        let step = if first & 0x80 != 0 {
            read_int(b, i, 7).map(|(_, j)| j)
        } else if first & 0xe0 == 0x20 {
            read_int(b, i, 5).map(|(_, j)| j)
        } else {
            let prefix = if first & 0xc0 == 0x40 { 6 } else { 4 };
            literal(b, i, prefix)
        };
        match step {
            Some(j) => i = j,
            None => return,
        }
    }
}

/// Handles one literal field at `i`; rewrites it when it is `:authority`.
fn literal(b: &mut [u8], i: usize, prefix: u8) -> Option<usize> {
    let (name_index, mut j) = read_int(b, i, prefix)?;
    let is_authority = if name_index == 0 {
        let (range, huffman, next) = string_at(b, j)?;
        j = next;
        let name = if huffman { huffman_decode(&b[range])? } else { b[range].to_vec() };
        name == b":authority"
    } else {
        // Index 1 of the static table is :authority (dynamic indices start at 62).
        name_index == 1
    };
    let (range, huffman, next) = string_at(b, j)?;
    if is_authority {
        let value = &mut b[range];
        if huffman {
            if let Some(mut decoded) = huffman_decode(value) {
                if decoded.contains(&b'/') {
                    decoded.iter_mut().filter(|c| **c == b'/').for_each(|c| *c = b'-');
                    huffman_encode_into(&decoded, value);
                }
            }
        } else {
            value.iter_mut().filter(|c| **c == b'/').for_each(|c| *c = b'-');
        }
    }
    Some(next)
}

/// Decodes an HPACK Huffman string (RFC 7541 §5.2); `None` when malformed.
fn huffman_decode(src: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(src.len() * 8 / 5);
    let (mut code, mut len) = (0u32, 0usize);
    for byte in src {
        for bit in (0..8).rev() {
            code = (code << 1) | u32::from((byte >> bit) & 1);
            len += 1;
            if len > 30 {
                return None;
            }
            if let Some(sym) = DECODE.symbol(len, code) {
                out.push(sym);
                code = 0;
                len = 0;
            }
        }
    }
    // The leftover must be padding: fewer than 8 bits, all ones.
    (len < 8 && code == (1u32 << len) - 1).then_some(out)
}

/// The code table by code length: for each length, its (code, symbol) pairs sorted by code.
struct DecodeTable {
    entries: [(u32, u8); 256],
    /// `entries[start[len]..start[len + 1]]` are the codes `len` bits long.
    start: [u16; 32],
}

impl DecodeTable {
    const fn build() -> Self {
        let mut entries = [(0u32, 0u8); 256];
        let mut start = [0u16; 32];
        let mut n = 0usize;
        let mut len = 1;
        while len <= 30 {
            start[len] = n as u16;
            let mut sym = 0;
            while sym < 256 {
                if ENCODE_CODE_LENGTHS[sym] as usize == len {
                    // Insertion sort by code within this length.
                    let code = ENCODE_CODES[sym];
                    let mut j = n;
                    while j > start[len] as usize && entries[j - 1].0 > code {
                        entries[j] = entries[j - 1];
                        j -= 1;
                    }
                    entries[j] = (code, sym as u8);
                    n += 1;
                }
                sym += 1;
            }
            len += 1;
        }
        start[31] = n as u16;
        Self { entries, start }
    }

    /// The symbol whose code is `code`, `len` bits long.
    fn symbol(&self, len: usize, code: u32) -> Option<u8> {
        let codes = &self.entries[usize::from(self.start[len])..usize::from(self.start[len + 1])];
        codes.binary_search_by_key(&code, |e| e.0).ok().map(|i| codes[i].1)
    }
}

static DECODE: DecodeTable = DecodeTable::build();

/// Huffman-encodes `src` into `dst`, padding with ones. `dst` must be exactly the encoded size.
fn huffman_encode_into(src: &[u8], dst: &mut [u8]) {
    let (mut acc, mut bits, mut pos) = (0u64, 0u32, 0usize);
    for &c in src {
        acc = (acc << ENCODE_CODE_LENGTHS[c as usize]) | u64::from(ENCODE_CODES[c as usize]);
        bits += u32::from(ENCODE_CODE_LENGTHS[c as usize]);
        while bits >= 8 {
            bits -= 8;
            if let Some(d) = dst.get_mut(pos) {
                *d = (acc >> bits) as u8;
            }
            pos += 1;
        }
    }
    if bits > 0 {
        if let Some(d) = dst.get_mut(pos) {
            *d = ((acc << (8 - bits)) as u8) | ((1u8 << (8 - bits)) - 1);
        }
    }
}

// The HPACK Huffman code (RFC 7541 Appendix B), as tabulated by the h2 crate (MIT).
const ENCODE_CODES: [u32; 256] = [
    0x1ff8, 0x7fffd8, 0xfffffe2, 0xfffffe3, 0xfffffe4, 0xfffffe5, 0xfffffe6, 0xfffffe7, 0xfffffe8, 0xffffea,
    0x3ffffffc, 0xfffffe9, 0xfffffea, 0x3ffffffd, 0xfffffeb, 0xfffffec, 0xfffffed, 0xfffffee, 0xfffffef, 0xffffff0,
    0xffffff1, 0xffffff2, 0x3ffffffe, 0xffffff3, 0xffffff4, 0xffffff5, 0xffffff6, 0xffffff7, 0xffffff8, 0xffffff9,
    0xffffffa, 0xffffffb, 0x14, 0x3f8, 0x3f9, 0xffa, 0x1ff9, 0x15, 0xf8, 0x7fa, 0x3fa, 0x3fb, 0xf9, 0x7fb, 0xfa, 0x16,
    0x17, 0x18, 0x0, 0x1, 0x2, 0x19, 0x1a, 0x1b, 0x1c, 0x1d, 0x1e, 0x1f, 0x5c, 0xfb, 0x7ffc, 0x20, 0xffb, 0x3fc,
    0x1ffa, 0x21, 0x5d, 0x5e, 0x5f, 0x60, 0x61, 0x62, 0x63, 0x64, 0x65, 0x66, 0x67, 0x68, 0x69, 0x6a, 0x6b, 0x6c, 0x6d,
    0x6e, 0x6f, 0x70, 0x71, 0x72, 0xfc, 0x73, 0xfd, 0x1ffb, 0x7fff0, 0x1ffc, 0x3ffc, 0x22, 0x7ffd, 0x3, 0x23, 0x4,
    0x24, 0x5, 0x25, 0x26, 0x27, 0x6, 0x74, 0x75, 0x28, 0x29, 0x2a, 0x7, 0x2b, 0x76, 0x2c, 0x8, 0x9, 0x2d, 0x77, 0x78,
    0x79, 0x7a, 0x7b, 0x7ffe, 0x7fc, 0x3ffd, 0x1ffd, 0xffffffc, 0xfffe6, 0x3fffd2, 0xfffe7, 0xfffe8, 0x3fffd3,
    0x3fffd4, 0x3fffd5, 0x7fffd9, 0x3fffd6, 0x7fffda, 0x7fffdb, 0x7fffdc, 0x7fffdd, 0x7fffde, 0xffffeb, 0x7fffdf,
    0xffffec, 0xffffed, 0x3fffd7, 0x7fffe0, 0xffffee, 0x7fffe1, 0x7fffe2, 0x7fffe3, 0x7fffe4, 0x1fffdc, 0x3fffd8,
    0x7fffe5, 0x3fffd9, 0x7fffe6, 0x7fffe7, 0xffffef, 0x3fffda, 0x1fffdd, 0xfffe9, 0x3fffdb, 0x3fffdc, 0x7fffe8,
    0x7fffe9, 0x1fffde, 0x7fffea, 0x3fffdd, 0x3fffde, 0xfffff0, 0x1fffdf, 0x3fffdf, 0x7fffeb, 0x7fffec, 0x1fffe0,
    0x1fffe1, 0x3fffe0, 0x1fffe2, 0x7fffed, 0x3fffe1, 0x7fffee, 0x7fffef, 0xfffea, 0x3fffe2, 0x3fffe3, 0x3fffe4,
    0x7ffff0, 0x3fffe5, 0x3fffe6, 0x7ffff1, 0x3ffffe0, 0x3ffffe1, 0xfffeb, 0x7fff1, 0x3fffe7, 0x7ffff2, 0x3fffe8,
    0x1ffffec, 0x3ffffe2, 0x3ffffe3, 0x3ffffe4, 0x7ffffde, 0x7ffffdf, 0x3ffffe5, 0xfffff1, 0x1ffffed, 0x7fff2,
    0x1fffe3, 0x3ffffe6, 0x7ffffe0, 0x7ffffe1, 0x3ffffe7, 0x7ffffe2, 0xfffff2, 0x1fffe4, 0x1fffe5, 0x3ffffe8,
    0x3ffffe9, 0xffffffd, 0x7ffffe3, 0x7ffffe4, 0x7ffffe5, 0xfffec, 0xfffff3, 0xfffed, 0x1fffe6, 0x3fffe9, 0x1fffe7,
    0x1fffe8, 0x7ffff3, 0x3fffea, 0x3fffeb, 0x1ffffee, 0x1ffffef, 0xfffff4, 0xfffff5, 0x3ffffea, 0x7ffff4, 0x3ffffeb,
    0x7ffffe6, 0x3ffffec, 0x3ffffed, 0x7ffffe7, 0x7ffffe8, 0x7ffffe9, 0x7ffffea, 0x7ffffeb, 0xffffffe, 0x7ffffec,
    0x7ffffed, 0x7ffffee, 0x7ffffef, 0x7fffff0, 0x3ffffee,
];

const ENCODE_CODE_LENGTHS: [u8; 256] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 30, 28, 28, 28, 28, 28, 28,
    28, 28, 28, 6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12,
    10, 13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6, 15, 5, 6,
    5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5, 6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28, 20, 22, 20, 20, 22, 22,
    22, 23, 22, 23, 23, 23, 23, 23, 24, 23, 24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, 22, 21, 20,
    22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23, 21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23,
    26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25, 19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28,
    27, 27, 27, 20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23, 26, 27, 26, 26, 27, 27, 27, 27, 27, 28,
    27, 27, 27, 27, 27, 26,
];

#[cfg(test)]
mod tests {
    use super::*;

    /// The HEADERS block grpcurl 1.8.6 sent for `-unix /tmp/cap.sock`, captured on the wire.
    const GRPCURL_BLOCK: &str = "838645ad626b2b22f6165a0a4498f52fdc23a2b9c6bee2d9dcb66d2cb4148931ea63716cee5b36965a0a4498f564aa53ff418a6134d6c1075ae8393aff5f8b1d75d0620d263d4c4d65647a999acac96d9431dc2bbcbb8a4d65645a63b015da6970ad217bff40027465864d833505b11f";

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    #[test]
    fn rewrites_the_socket_path_authority_keeping_lengths() {
        let mut block = unhex(GRPCURL_BLOCK);
        let before = block.len();
        // The value of the :authority literal (0x41, then 0x8a = Huffman, 10 bytes).
        let at = block.windows(2).position(|w| w == [0x41, 0x8a]).unwrap();
        assert_eq!(huffman_decode(&block[at + 2..at + 12]).unwrap(), b"/tmp/cap.sock");
        fix_header_block(&mut block);
        assert_eq!(block.len(), before);
        assert_eq!(huffman_decode(&block[at + 2..at + 12]).unwrap(), b"-tmp-cap.sock");
        // Everything else is untouched.
        let original = unhex(GRPCURL_BLOCK);
        assert_eq!(block[..at + 2], original[..at + 2]);
        assert_eq!(block[at + 12..], original[at + 12..]);
    }

    #[test]
    fn huffman_round_trips() {
        let text = b"www.example.com/with-some_path~1";
        let mut enc = vec![0u8; 64];
        huffman_encode_into(text, &mut enc);
        let bits: usize = text.iter().map(|c| ENCODE_CODE_LENGTHS[*c as usize] as usize).sum();
        let n = bits.div_ceil(8);
        assert_eq!(huffman_decode(&enc[..n]).unwrap(), text);
    }

    #[test]
    fn plain_literals_and_garbage_are_safe() {
        // Literal without indexing, name index 1 (:authority), raw value "/a/b".
        let mut block = vec![0x01, 0x04, b'/', b'a', b'/', b'b'];
        fix_header_block(&mut block);
        assert_eq!(block, vec![0x01, 0x04, b'-', b'a', b'-', b'b']);
        for junk in [vec![0xff], vec![0x41, 0xff, 0xff], vec![0x40, 0x85, 1, 2]] {
            let mut j = junk.clone();
            fix_header_block(&mut j);
        }
    }

    /// The original decoder: a linear search of the code table at every bit.
    fn huffman_decode_reference(src: &[u8]) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        let (mut code, mut len) = (0u32, 0u8);
        for byte in src {
            for bit in (0..8).rev() {
                code = (code << 1) | u32::from((byte >> bit) & 1);
                len += 1;
                if len > 30 {
                    return None;
                }
                if let Some(sym) = (0..256).find(|&s| ENCODE_CODE_LENGTHS[s] == len && ENCODE_CODES[s] == code) {
                    out.push(sym as u8);
                    code = 0;
                    len = 0;
                }
            }
        }
        (len < 8 && code == (1u32 << len) - 1).then_some(out)
    }

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

    #[test]
    fn table_decoder_matches_the_linear_search() {
        // Every symbol alone, padded with ones.
        for sym in 0..=255u8 {
            let bits = usize::from(ENCODE_CODE_LENGTHS[usize::from(sym)]);
            let mut enc = vec![0u8; bits.div_ceil(8)];
            huffman_encode_into(&[sym], &mut enc);
            assert_eq!(huffman_decode(&enc), Some(vec![sym]), "symbol {sym}");
        }
        // Random text and random garbage decode (or fail) exactly as before.
        let mut rng = Rng(0x1234_5678_9abc_def1);
        for _ in 0..2000 {
            let text: Vec<u8> = (0..rng.below(40)).map(|_| rng.next() as u8).collect();
            let bits: usize = text.iter().map(|c| usize::from(ENCODE_CODE_LENGTHS[usize::from(*c)])).sum();
            let mut enc = vec![0u8; bits.div_ceil(8)];
            huffman_encode_into(&text, &mut enc);
            assert_eq!(huffman_decode(&enc).as_deref(), Some(text.as_slice()));
            let junk: Vec<u8> = (0..rng.below(12)).map(|_| rng.next() as u8).collect();
            assert_eq!(huffman_decode(&junk), huffman_decode_reference(&junk), "{junk:02x?}");
        }
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

    fn frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags, 0, 0, 0, 1];
        f.extend_from_slice(payload);
        f
    }

    /// A random connection: the preface, then HEADERS (with socket-path authorities, padded or
    /// not, with or without END_HEADERS), CONTINUATION, DATA of many sizes and SETTINGS frames.
    /// Returns (inbound bytes, what the server must read).
    fn random_connection(rng: &mut Rng) -> (Vec<u8>, Vec<u8>) {
        let mut wire = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        let mut want = wire.clone();
        let mut fixable = Vec::new();
        for _ in 0..rng.below(60) {
            let (kind, flags, payload) = match rng.below(6) {
                0 | 1 => {
                    let mut block = if rng.below(2) == 0 {
                        unhex(GRPCURL_BLOCK)
                    } else {
                        vec![0x01, 0x06, b'/', b'a', b'/', b'b', b'/', b'c']
                    };
                    let mut flags = if rng.below(5) == 0 { 0 } else { FLAG_END_HEADERS };
                    if rng.below(3) == 0 {
                        block.splice(0..0, [0, 0, 0, 1, 16]);
                        flags |= FLAG_PRIORITY;
                    }
                    if rng.below(3) == 0 {
                        let pad = rng.below(20);
                        block.insert(0, pad as u8);
                        block.extend(std::iter::repeat_n(0, pad));
                        flags |= FLAG_PADDED;
                    }
                    (FRAME_HEADERS, flags, block)
                }
                2 => (0x9, FLAG_END_HEADERS, vec![0x01, 0x02, b'/', b'x']),
                3 | 4 => {
                    let len = if rng.below(8) == 0 { rng.below(20_000) } else { rng.below(64) };
                    (0x0, 0, (0..len).map(|_| rng.next() as u8).collect())
                }
                _ => (0x4, 0, vec![0, 3, 0, 0, 0, 100]),
            };
            let f = frame(kind, flags, &payload);
            let start = wire.len();
            wire.extend_from_slice(&f);
            let mut fixed = f;
            if kind == FRAME_HEADERS && flags & FLAG_END_HEADERS != 0 {
                fix_headers_payload(&mut fixed[9..], flags);
                fixable.push(start..wire.len());
            }
            want.extend_from_slice(&fixed);
        }
        // Sometimes the connection ends in the middle of a frame; an incomplete HEADERS frame is
        // handed out as it came.
        if rng.below(4) == 0 && wire.len() > 24 {
            let cut = rng.below(wire.len() - 24) + 24;
            wire.truncate(cut);
            want.truncate(cut);
            if let Some(r) = fixable.iter().find(|r| r.start < cut && cut < r.end) {
                want[r.start..].copy_from_slice(&wire[r.start..]);
            }
        }
        (wire, want)
    }

    #[tokio::test]
    async fn any_read_pattern_yields_the_same_fixed_stream() {
        use tokio::io::AsyncReadExt;
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for round in 0..300 {
            let (wire, want) = random_connection(&mut rng);
            let sizes = [1, 5, 9, 64, 1500, 20_000];
            let max_chunk = sizes[rng.below(sizes.len())];
            let max_buf = sizes[rng.below(sizes.len())];
            let mut fix = AuthorityFix::new(Chunked { data: wire, pos: 0, max_chunk, rng: Rng(rng.next() | 1) });
            let mut got = Vec::new();
            loop {
                let mut buf = vec![0u8; 1 + rng.below(max_buf)];
                let n = fix.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..n]);
            }
            let first_diff = got.iter().zip(&want).position(|(a, b)| a != b);
            assert!(
                got == want,
                "round {round} (chunks <= {max_chunk}, reads <= {max_buf}): streams differ: got {} bytes, want {}, first difference at {first_diff:?}",
                got.len(),
                want.len()
            );
        }
        // The fixture really contains authorities that get fixed.
        let mut raw = frame(FRAME_HEADERS, FLAG_END_HEADERS, &[0x01, 0x04, b'/', b'a', b'/', b'b']);
        fix_headers_payload(&mut raw[9..], FLAG_END_HEADERS);
        assert_eq!(&raw[11..], b"-a-b");
    }
}
