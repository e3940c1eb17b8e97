//! Object text kept compressed in memory.
//!
//! Both backends cache every object as JSON text (reads never reach SQLite or the API server),
//! and with thousands of Machines that cache is most of the controller's heap: a Running
//! Machine is about 1.7 KB, and most of those bytes are field names and values every other
//! Machine has too. [`Packed`] holds one object's text compressed with LZ4 against a
//! dictionary of typical objects (`packed/dictionary.json`, one stored object of each kind per
//! line): what objects share is in the dictionary once, and what stays in each is mostly what
//! is its own (names, uids, times, request IDs). Each text is compressed alone, so any one
//! object reads without the others. LZ4 rather than zstd: with the same dictionary zstd packs a
//! Running Machine to about 160 bytes against LZ4's 280 (of 1.6 KB), but unpacks about four
//! times slower, and a deployment's reconcile unpacks every Machine it owns.
//!
//! The dictionary is only an aid to compression: a text the dictionary does not resemble (a
//! field renamed since it was made) still packs and reads back exactly, just larger. A unit
//! test keeps it in step with the resource types.

use std::cell::RefCell;
use std::sync::Arc;

use super::{Error, Result};

/// Typical stored objects, one per line: LZ4's external dictionary, the text that each
/// compressed object may refer back to.
const DICTIONARY: &str = include_str!("packed/dictionary.json");

/// The largest unpacking buffer a thread keeps for the next [`Packed::read`].
const BUFFER_KEPT: usize = 64 * 1024;

thread_local! {
    static BUFFER: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// One object's JSON text, compressed. Cheap to clone (shared bytes).
#[derive(Clone)]
pub(crate) struct Packed(Repr);

#[derive(Clone)]
enum Repr {
    /// An LZ4 block of a text of `len` bytes.
    Lz4 { block: Arc<[u8]>, len: u32 },
    /// A text longer than a `u32` counts, kept as it is.
    Plain(Arc<str>),
}

impl Packed {
    /// Packs `text`.
    pub(crate) fn new(text: &str) -> Self {
        match u32::try_from(text.len()) {
            Ok(len) => {
                let block = lz4_flex::block::compress_with_dict(text.as_bytes(), DICTIONARY.as_bytes());
                Self(Repr::Lz4 { block: block.into(), len })
            }
            Err(_) => Self(Repr::Plain(text.into())),
        }
    }

    /// The text again.
    ///
    /// # Errors
    /// [`Error::Backend`] when the block does not unpack to its text, which only memory
    /// corruption can cause: never for a block [`Packed::new`] made.
    pub(crate) fn text(&self) -> Result<Arc<str>> {
        self.read(|text| Arc::from(text))
    }

    /// Calls `f` with the text, unpacked into a buffer this thread reuses (no allocation per
    /// object when a listing reads thousands in a row).
    ///
    /// # Errors
    /// As [`Packed::text`].
    pub(crate) fn read<R>(&self, f: impl FnOnce(&str) -> R) -> Result<R> {
        let (block, len) = match &self.0 {
            Repr::Plain(text) => return Ok(f(text)),
            Repr::Lz4 { block, len } => (block, *len as usize),
        };
        // Taken out of the thread-local while `f` runs, so `f` may unpack too.
        let mut buffer = BUFFER.with(|b| std::mem::take(&mut *b.borrow_mut()));
        buffer.clear();
        buffer.resize(len, 0);
        let out = match lz4_flex::block::decompress_into_with_dict(block, &mut buffer, DICTIONARY.as_bytes()) {
            Ok(n) if n == len => match std::str::from_utf8(&buffer) {
                Ok(text) => Ok(f(text)),
                Err(e) => Err(Error::backend("cache", e)),
            },
            Ok(n) => Err(Error::backend("cache", format!("a cached text unpacked to {n} bytes, not {len}"))),
            Err(e) => Err(Error::backend("cache", e)),
        };
        // A rare huge object does not keep its buffer.
        if buffer.capacity() <= BUFFER_KEPT {
            BUFFER.with(|b| *b.borrow_mut() = buffer);
        }
        out
    }

    /// Whether `other` is this very packing (shared, not an equal copy).
    pub(crate) fn same(&self, other: &Packed) -> bool {
        match (&self.0, &other.0) {
            (Repr::Lz4 { block: a, .. }, Repr::Lz4 { block: b, .. }) => Arc::ptr_eq(a, b),
            (Repr::Plain(a), Repr::Plain(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// Bytes held (the block, or the plain text), for the tests.
    #[cfg(test)]
    pub(crate) fn packed_len(&self) -> usize {
        match &self.0 {
            Repr::Plain(text) => text.len(),
            Repr::Lz4 { block, .. } => block.len(),
        }
    }
}

impl std::fmt::Debug for Packed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Repr::Plain(text) => write!(f, "Packed(plain, {} bytes)", text.len()),
            Repr::Lz4 { block, len } => write!(f, "Packed({len} bytes in {})", block.len()),
        }
    }
}

#[cfg(test)]
mod tests;
