//! The part of HPACK (RFC 7541) that [`crate::authority`] needs: a decoder that keeps the
//! client's dynamic table, and an encoder of plain literals that never touch the peer's table.

use std::borrow::Cow;
use std::collections::VecDeque;

/// SETTINGS_HEADER_TABLE_SIZE's initial value. Our server never advertises another, so this is
/// the largest dynamic table a client may use (RFC 7541 §4.2).
pub(crate) const MAX_TABLE_SIZE: usize = 4096;
/// What a field adds to a table's size beside its name and value (RFC 7541 §4.1); HTTP/2 counts
/// SETTINGS_MAX_HEADER_LIST_SIZE the same way.
pub(crate) const ENTRY_OVERHEAD: usize = 32;

/// Why a header block could not be decoded; the connection is then unusable (a COMPRESSION_ERROR
/// in HTTP/2 terms).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HpackError {
    Truncated,
    IntegerOverflow,
    BadIndex(usize),
    BadHuffman,
    TableSizeTooLarge(usize),
    LateTableSizeUpdate,
}

impl std::fmt::Display for HpackError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Truncated => f.write_str("a header field is cut short"),
            Self::IntegerOverflow => f.write_str("an integer is too large"),
            Self::BadIndex(i) => write!(f, "index {i} is in neither the static nor the dynamic table"),
            Self::BadHuffman => f.write_str("a Huffman-coded string is malformed"),
            Self::TableSizeTooLarge(n) => {
                write!(f, "dynamic table size update to {n} exceeds the {MAX_TABLE_SIZE} allowed")
            }
            Self::LateTableSizeUpdate => f.write_str("a dynamic table size update follows a header field"),
        }
    }
}

/// A header field in the dynamic table: name and value.
type Entry = (Box<[u8]>, Box<[u8]>);

/// Decodes the header blocks of one connection, in order.
pub(crate) struct Decoder {
    /// The dynamic table, newest entry first (index 62).
    table: VecDeque<Entry>,
    /// The table's size as RFC 7541 §4.1 counts it.
    size: usize,
    max_size: usize,
}

impl Default for Decoder {
    fn default() -> Self {
        Self { table: VecDeque::new(), size: 0, max_size: MAX_TABLE_SIZE }
    }
}

impl Decoder {
    /// Decodes `block`, calling `field(name, value, never_indexed)` for each field in order.
    pub(crate) fn decode(&mut self, block: &[u8], mut field: impl FnMut(&[u8], &[u8], bool)) -> Result<(), HpackError> {
        let mut i = 0;
        let mut fields = 0usize;
        while i < block.len() {
            let first = block[i];
            if first & 0x80 != 0 {
                // Indexed field (§6.1).
                let (index, next) = read_int(block, i, 7)?;
                i = next;
                let (name, value) = self.entry(index)?;
                field(name, value, false);
            } else if first & 0xe0 == 0x20 {
                // Dynamic table size update (§6.3): only before the first field.
                if fields > 0 {
                    return Err(HpackError::LateTableSizeUpdate);
                }
                let (size, next) = read_int(block, i, 5)?;
                i = next;
                if size > MAX_TABLE_SIZE {
                    return Err(HpackError::TableSizeTooLarge(size));
                }
                self.max_size = size;
                self.evict_to(size);
                continue;
            } else {
                // Literal field (§6.2): with incremental indexing (01), without indexing (0000)
                // or never indexed (0001).
                let (prefix, indexed, never) = match first {
                    0x40..=0x7f => (6, true, false),
                    0x10..=0x1f => (4, false, true),
                    _ => (4, false, false),
                };
                let (index, mut next) = read_int(block, i, prefix)?;
                let name: Cow<'_, [u8]> = if index == 0 {
                    let (name, after) = read_string(block, next)?;
                    next = after;
                    name
                } else if let Some((name, _)) = static_entry(index) {
                    Cow::Borrowed(name)
                } else {
                    Cow::Owned(self.entry(index)?.0.to_vec())
                };
                let (value, after) = read_string(block, next)?;
                i = after;
                field(&name, &value, never);
                if indexed {
                    self.insert(name.into_owned().into(), value.into_owned().into());
                }
            }
            fields += 1;
        }
        Ok(())
    }

    /// The field at `index`: 1–61 in the static table, 62 and up in the dynamic table.
    fn entry(&self, index: usize) -> Result<(&[u8], &[u8]), HpackError> {
        static_entry(index)
            .or_else(|| {
                let i = index.checked_sub(STATIC_TABLE.len() + 1)?;
                self.table.get(i).map(|(n, v)| (&n[..], &v[..]))
            })
            .ok_or(HpackError::BadIndex(index))
    }

    fn insert(&mut self, name: Box<[u8]>, value: Box<[u8]>) {
        let size = entry_size(&name, &value);
        if size > self.max_size {
            // An entry larger than the table empties it and is not added (§4.4).
            self.table.clear();
            self.size = 0;
            return;
        }
        self.evict_to(self.max_size - size);
        self.size += size;
        self.table.push_front((name, value));
    }

    /// Evicts the oldest entries until the table's size is at most `limit`.
    fn evict_to(&mut self, limit: usize) {
        while self.size > limit {
            match self.table.pop_back() {
                Some((n, v)) => self.size -= entry_size(&n, &v),
                None => self.size = 0,
            }
        }
    }

    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn table_size(&self) -> usize {
        self.size
    }

    /// Checks the table's bookkeeping: its counted size is its entries' sizes, within the
    /// current maximum, which is within [`MAX_TABLE_SIZE`].
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn assert_consistent(&self) {
        let counted: usize = self.table.iter().map(|(n, v)| entry_size(n, v)).sum();
        assert_eq!(self.size, counted, "the dynamic table's size is not its entries' sizes");
        assert!(
            self.size <= self.max_size,
            "the dynamic table holds {} bytes over its {} maximum",
            self.size,
            self.max_size
        );
        assert!(
            self.max_size <= MAX_TABLE_SIZE,
            "the dynamic table's maximum {} exceeds {MAX_TABLE_SIZE}",
            self.max_size
        );
    }
}

fn static_entry(index: usize) -> Option<(&'static [u8], &'static [u8])> {
    let (name, value) = STATIC_TABLE.get(index.checked_sub(1)?)?;
    Some((name.as_bytes(), value.as_bytes()))
}

/// A field's size as RFC 7541 §4.1 (and HTTP/2's header-list limit) counts it.
pub(crate) fn entry_size(name: &[u8], value: &[u8]) -> usize {
    name.len() + value.len() + ENTRY_OVERHEAD
}

/// Reads an integer with an `n`-bit prefix at `i` (§5.1); returns it and the next index.
fn read_int(b: &[u8], i: usize, n: u8) -> Result<(usize, usize), HpackError> {
    let mask = (1usize << n) - 1;
    let mut value = usize::from(*b.get(i).ok_or(HpackError::Truncated)?) & mask;
    let mut i = i + 1;
    if value < mask {
        return Ok((value, i));
    }
    let mut shift = 0u32;
    loop {
        let byte = *b.get(i).ok_or(HpackError::Truncated)?;
        i += 1;
        if shift > 28 {
            return Err(HpackError::IntegerOverflow);
        }
        value = value.checked_add(usize::from(byte & 0x7f) << shift).ok_or(HpackError::IntegerOverflow)?;
        shift += 7;
        if byte & 0x80 == 0 {
            return Ok((value, i));
        }
    }
}

/// Reads a string literal at `i` (§5.2); returns it and the next index.
fn read_string(b: &[u8], i: usize) -> Result<(Cow<'_, [u8]>, usize), HpackError> {
    let huffman = *b.get(i).ok_or(HpackError::Truncated)? & 0x80 != 0;
    let (len, start) = read_int(b, i, 7)?;
    let end = start.checked_add(len).filter(|&e| e <= b.len()).ok_or(HpackError::Truncated)?;
    let raw = &b[start..end];
    if huffman {
        let mut out = Vec::with_capacity(len * 8 / 5);
        huffman_decode(raw, &mut out)?;
        Ok((Cow::Owned(out), end))
    } else {
        Ok((Cow::Borrowed(raw), end))
    }
}

/// Appends a field as a literal that the peer's decoder does not add to its dynamic table
/// (§6.2.2, or §6.2.3 when the client marked it never-indexed), with a literal name and raw
/// (not Huffman-coded) strings.
pub(crate) fn encode_literal(out: &mut Vec<u8>, name: &[u8], value: &[u8], never_indexed: bool) {
    out.push(if never_indexed { 0x10 } else { 0x00 });
    write_int(out, 7, 0x00, name.len());
    out.extend_from_slice(name);
    write_int(out, 7, 0x00, value.len());
    out.extend_from_slice(value);
}

/// Appends an integer with an `n`-bit prefix; `flags` are the bits above the prefix (§5.1).
pub(crate) fn write_int(out: &mut Vec<u8>, n: u8, flags: u8, value: usize) {
    let mask = (1usize << n) - 1;
    if value < mask {
        out.push(flags | value as u8);
        return;
    }
    out.push(flags | mask as u8);
    let mut rest = value - mask;
    while rest >= 0x80 {
        out.push((rest as u8 & 0x7f) | 0x80);
        rest >>= 7;
    }
    out.push(rest as u8);
}

/// The static table (RFC 7541 Appendix A); index 1 is the first entry.
const STATIC_TABLE: [(&str, &str); 61] = [
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
];

/// Decodes a Huffman-coded string (§5.2, Appendix B), appending to `out`.
fn huffman_decode(src: &[u8], out: &mut Vec<u8>) -> Result<(), HpackError> {
    let mut state = 0usize;
    for &byte in src {
        for nibble in [byte >> 4, byte & 0x0f] {
            let step = HUFFMAN.steps[state][usize::from(nibble)];
            if step & STEP_FAILS != 0 {
                return Err(HpackError::BadHuffman);
            }
            if step & STEP_EMITS != 0 {
                out.push(step as u8);
            }
            state = (step >> 16) as usize;
        }
    }
    // What is left must be padding: a prefix of EOS (all ones), shorter than 8 bits.
    if HUFFMAN.eos_prefix_len[state] < 8 {
        Ok(())
    } else {
        Err(HpackError::BadHuffman)
    }
}

const STEP_EMITS: u32 = 1 << 8;
const STEP_FAILS: u32 = 1 << 9;
const LEAF: u16 = 0x8000;
const EOS: u16 = 256;

/// A Huffman decoder that takes four bits per step. A state is an inner node of the code tree (0
/// is the root); as the shortest code has 5 bits, a step completes at most one symbol.
struct HuffmanTable {
    /// `steps[state][nibble]` = next state << 16 | STEP_FAILS | STEP_EMITS | symbol.
    steps: [[u32; 16]; 256],
    /// For each state, how many bits deep it is if the bits so far are all ones, else 255.
    eos_prefix_len: [u8; 256],
}

impl HuffmanTable {
    const fn build() -> Self {
        // The code tree: 257 symbols (with EOS) make 256 inner nodes. A child is an inner node's
        // index or LEAF | symbol; 0 means "not yet made" (the root is nobody's child).
        let mut children = [[0u16; 2]; 256];
        let mut eos_prefix_len = [255u8; 256];
        eos_prefix_len[0] = 0;
        let mut nodes = 1usize;
        let mut sym = 0usize;
        while sym <= 256 {
            let (code, len) =
                if sym == 256 { (0x3fff_ffffu32, 30u32) } else { (ENCODE_CODES[sym], ENCODE_CODE_LENGTHS[sym] as u32) };
            let mut node = 0usize;
            let mut bit = len;
            while bit > 1 {
                bit -= 1;
                let b = ((code >> bit) & 1) as usize;
                if children[node][b] == 0 {
                    children[node][b] = nodes as u16;
                    if b == 1 && eos_prefix_len[node] != 255 {
                        eos_prefix_len[nodes] = eos_prefix_len[node] + 1;
                    }
                    nodes += 1;
                }
                node = children[node][b] as usize;
            }
            children[node][(code & 1) as usize] = LEAF | sym as u16;
            sym += 1;
        }
        let mut steps = [[0u32; 16]; 256];
        let mut state = 0usize;
        while state < 256 {
            let mut nibble = 0usize;
            while nibble < 16 {
                let mut node = state;
                let mut step = 0u32;
                let mut bit = 4;
                while bit > 0 {
                    bit -= 1;
                    let child = children[node][(nibble >> bit) & 1];
                    if child & LEAF != 0 {
                        let symbol = child & !LEAF;
                        step |= if symbol == EOS { STEP_FAILS } else { STEP_EMITS | symbol as u32 };
                        node = 0;
                    } else {
                        node = child as usize;
                    }
                }
                steps[state][nibble] = step | (node as u32) << 16;
                nibble += 1;
            }
            state += 1;
        }
        Self { steps, eos_prefix_len }
    }
}

static HUFFMAN: HuffmanTable = HuffmanTable::build();

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

/// Huffman-encodes `src` (padding with ones), for tests that play the client's encoder.
#[cfg(test)]
pub(crate) fn huffman_encode(src: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u64, 0u32);
    for &c in src {
        acc = (acc << ENCODE_CODE_LENGTHS[usize::from(c)]) | u64::from(ENCODE_CODES[usize::from(c)]);
        bits += u32::from(ENCODE_CODE_LENGTHS[usize::from(c)]);
        while bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    if bits > 0 {
        out.push(((acc << (8 - bits)) as u8) | ((1u8 << (8 - bits)) - 1));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unhex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    fn decode(d: &mut Decoder, block: &[u8]) -> Result<Vec<(String, String)>, HpackError> {
        let mut fields = Vec::new();
        d.decode(block, |n, v, _| {
            fields.push((String::from_utf8_lossy(n).into_owned(), String::from_utf8_lossy(v).into_owned()))
        })?;
        Ok(fields)
    }

    fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
        p.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect()
    }

    /// RFC 7541 C.3 (plain strings) and C.4 (Huffman): three requests on one connection, with
    /// the dynamic table carried from one to the next.
    #[test]
    fn decodes_the_rfc_request_examples() {
        let first =
            pairs(&[(":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com")]);
        let mut second = first.clone();
        second.push(("cache-control".into(), "no-cache".into()));
        let third = pairs(&[
            (":method", "GET"),
            (":scheme", "https"),
            (":path", "/index.html"),
            (":authority", "www.example.com"),
            ("custom-key", "custom-value"),
        ]);
        for blocks in [
            [
                "8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
                "8286 84be 5808 6e6f 2d63 6163 6865",
                "8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65",
            ],
            [
                "8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff",
                "8286 84be 5886 a8eb 1064 9cbf",
                "8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf",
            ],
        ] {
            let mut d = Decoder::default();
            assert_eq!(decode(&mut d, &unhex(blocks[0])).unwrap(), first);
            assert_eq!(d.table_size(), 57);
            assert_eq!(decode(&mut d, &unhex(blocks[1])).unwrap(), second);
            assert_eq!(d.table_size(), 110);
            assert_eq!(decode(&mut d, &unhex(blocks[2])).unwrap(), third);
            assert_eq!(d.table_size(), 164);
        }
    }

    /// RFC 7541 C.5's first two responses: a 256-byte table, where the second evicts.
    #[test]
    fn evicts_the_oldest_entries() {
        let mut d = Decoder::default();
        let mut block = Vec::new();
        write_int(&mut block, 5, 0x20, 256);
        for (index, value) in
            [(8, "302"), (24, "private"), (33, "Mon, 21 Oct 2013 20:13:21 GMT"), (46, "https://www.example.com")]
        {
            write_int(&mut block, 6, 0x40, index);
            write_int(&mut block, 7, 0, value.len());
            block.extend_from_slice(value.as_bytes());
        }
        decode(&mut d, &block).unwrap();
        assert_eq!(d.table_size(), 222);
        let fields = decode(&mut d, &unhex("4803 3330 37c1 c0bf")).unwrap();
        assert_eq!(
            fields,
            pairs(&[
                (":status", "307"),
                ("cache-control", "private"),
                ("date", "Mon, 21 Oct 2013 20:13:21 GMT"),
                ("location", "https://www.example.com")
            ])
        );
        assert_eq!(d.table_size(), 222);
        // The evicted ":status: 302" is gone: index 66 no longer exists.
        assert_eq!(decode(&mut d, &[0x80 | 66]), Err(HpackError::BadIndex(66)));
    }

    #[test]
    fn huffman_round_trips_every_symbol() {
        for sym in 0..=255u8 {
            let mut out = Vec::new();
            huffman_decode(&huffman_encode(&[sym, b'a', sym]), &mut out).unwrap();
            assert_eq!(out, [sym, b'a', sym]);
        }
        let text = b"/run/machine-driver/driver.sock %2F \xc3\xa9@ x";
        let mut out = Vec::new();
        huffman_decode(&huffman_encode(text), &mut out).unwrap();
        assert_eq!(out, text);
    }

    #[test]
    fn malformed_input_is_an_error_not_a_panic() {
        let mut out = Vec::new();
        // EOS (30 ones) inside a string; padding of 8 ones; padding with a zero bit.
        assert_eq!(huffman_decode(&[0xff, 0xff, 0xff, 0xfc], &mut out), Err(HpackError::BadHuffman));
        assert_eq!(huffman_decode(&[0x1f, 0xff], &mut out), Err(HpackError::BadHuffman));
        assert_eq!(huffman_decode(&[0x1e], &mut out), Err(HpackError::BadHuffman));
        let mut d = Decoder::default();
        assert_eq!(decode(&mut d, &[0x80]), Err(HpackError::BadIndex(0)));
        assert_eq!(decode(&mut d, &[0xbe]), Err(HpackError::BadIndex(62)));
        assert_eq!(decode(&mut d, &[0x41, 0x05, b'a']), Err(HpackError::Truncated));
        assert_eq!(decode(&mut d, &[0x7f]), Err(HpackError::Truncated));
        assert_eq!(decode(&mut d, &[0x82, 0x3f, 0xe1, 0x1f]), Err(HpackError::LateTableSizeUpdate));
        let mut too_large = Vec::new();
        write_int(&mut too_large, 5, 0x20, 5000);
        assert_eq!(decode(&mut d, &too_large), Err(HpackError::TableSizeTooLarge(5000)));
        assert_eq!(decode(&mut d, &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]), Err(HpackError::IntegerOverflow));
    }

    #[test]
    fn literals_round_trip_through_a_fresh_decoder() {
        let mut block = Vec::new();
        let long = "v".repeat(300);
        encode_literal(&mut block, b":authority", b"localhost", false);
        encode_literal(&mut block, b"x-long", long.as_bytes(), false);
        encode_literal(&mut block, b"authorization", b"secret", true);
        let mut d = Decoder::default();
        let mut seen = Vec::new();
        d.decode(&block, |n, v, never| seen.push((n.to_vec(), v.to_vec(), never))).unwrap();
        assert_eq!(
            seen,
            vec![
                (b":authority".to_vec(), b"localhost".to_vec(), false),
                (b"x-long".to_vec(), long.into_bytes(), false),
                (b"authorization".to_vec(), b"secret".to_vec(), true)
            ]
        );
        assert_eq!(d.table_size(), 0, "plain literals never reach the dynamic table");
    }
}
