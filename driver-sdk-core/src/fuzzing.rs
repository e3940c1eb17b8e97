//! The checks behind the `token_open` and `provider_spec_validate` fuzz targets in `fuzz/`
//! (built with the `fuzzing` feature). Not a stable API. The HPACK and `:authority` targets'
//! checks live with that code, in `h2_authority::fuzzing`.
//!
//! Every check takes the fuzzer's bytes and panics when the code under test breaks its contract.
//! The same functions replay the committed seeds and every crash found so far
//! (`fuzz/corpus/<target>/`, `fuzz/regressions/<target>/`) under plain `cargo test`, so a fixed
//! crash stays fixed and the fuzz targets and the regression tests cannot drift apart.

use std::time::{Duration, UNIX_EPOCH};

use serde_json::Value;

use crate::token::{Opened, TokenCodec, TokenKey};
use crate::OperationKind;

#[cfg(test)]
mod tests;

// ---------------------------------------------------------------------------------------------
// token_open

/// Reads structured values out of fuzz bytes (zeros once they run out).
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }

    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(std::array::from_fn(|_| self.byte()))
    }

    fn bytes(&mut self, max: usize) -> &[u8] {
        let n = (usize::from(self.byte()) % (max + 1)).min(self.0.len());
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        head
    }

    fn string(&mut self) -> String {
        String::from_utf8_lossy(self.bytes(40)).into_owned()
    }

    fn json(&mut self, depth: usize) -> Value {
        match self.byte() % 8 {
            0 => Value::Null,
            1 => Value::Bool(self.byte() & 1 == 1),
            2 => Value::from(self.u64()),
            3 => Value::from(self.u64() as i64),
            4 => serde_json::Number::from_f64(f64::from_bits(self.u64())).map_or(Value::Null, Value::Number),
            5 => Value::String(self.string()),
            6 if depth > 0 => Value::Array((0..self.byte() % 4).map(|_| self.json(depth - 1)).collect()),
            7 if depth > 0 => {
                Value::Object((0..self.byte() % 4).map(|_| (self.string(), self.json(depth - 1))).collect())
            }
            _ => Value::Null,
        }
    }
}

const KINDS: [OperationKind; 7] = [
    OperationKind::CreateMachine,
    OperationKind::DeleteMachine,
    OperationKind::UpdateMachine,
    OperationKind::ApplyPool,
    OperationKind::DeletePoolInstances,
    OperationKind::UpgradePoolInstances,
    OperationKind::DeletePool,
];

/// The driver name and key the `token_open` target seals with (the seed tokens are sealed so).
pub const TOKEN_DRIVER: &str = "fuzz.example.com";
/// See [`TOKEN_DRIVER`].
pub const TOKEN_KEY: &[u8] = b"fuzzing-token-key-0123456789abcdef";

/// The codec of the `token_open` target.
pub fn token_codec() -> TokenCodec {
    match TokenKey::try_new(TOKEN_KEY) {
        Ok(key) => TokenCodec::new(key, TOKEN_DRIVER),
        Err(e) => unreachable!("the fuzzing key is long enough: {e}"),
    }
}

/// The operation the `token_open` target builds from its input's bytes, to seal (its
/// [`Opened::sealed`]): any start time (before the epoch, to the nanosecond, far ahead), a state
/// nested up to 100 levels.
pub fn token_operation(data: &[u8]) -> Opened {
    let mut r = Reader(data);
    let kind = KINDS[usize::from(r.byte()) % KINDS.len()];
    let name = r.string();
    let target = r.string();
    let start_time = match r.byte() % 4 {
        0 => None,
        1 => UNIX_EPOCH.checked_add(Duration::from_millis(r.u64() % (1 << 45))),
        2 => UNIX_EPOCH.checked_add(Duration::new(r.u64(), (r.u64() % 1_000_000_000) as u32)),
        _ => UNIX_EPOCH.checked_sub(Duration::from_secs(r.u64() % (1 << 40))),
    };
    // Up to 100 levels: a state nested past 126 seals into a token that does not open (see
    // TokenCodec::seal).
    let depth = usize::from(r.byte()) % 100;
    let state = r.json(depth);
    Opened { name, kind, target, start_time, state }
}

/// The `token_open` target. Arbitrary bytes never panic and open only if they are exactly a
/// token the codec seals; an operation built from the bytes, sealed, opens to the same
/// operation (its start time to the millisecond), and sealed then altered in one place (a byte
/// changed, cut short or lengthened, as the input says) never opens.
pub fn check_token_open(data: &[u8]) {
    let codec = token_codec();
    if let Ok(opened) = codec.open(data) {
        assert_eq!(codec.seal(opened.sealed()), data, "bytes opened that the codec would not seal so");
    }

    let op = token_operation(data);
    let token = codec.seal(op.sealed());
    let opened = match codec.open(&token) {
        Ok(opened) => opened,
        Err(e) => panic!("a sealed token does not open: {e}; {op:?}"),
    };
    let start =
        op.start_time.and_then(|t| t.duration_since(UNIX_EPOCH).ok()).and_then(|d| u64::try_from(d.as_millis()).ok());
    assert_eq!(opened.name, op.name);
    assert_eq!(opened.kind, op.kind);
    assert_eq!(opened.target, op.target);
    assert_eq!(opened.state, op.state);
    assert_eq!(opened.start_time, start.map(|ms| UNIX_EPOCH + Duration::from_millis(ms)), "start time of {op:?}");

    let mut r = Reader(data.get(data.len().saturating_sub(4)..).unwrap_or_default());
    let (how, at, with) = (r.byte() % 3, usize::from(u16::from_le_bytes([r.byte(), r.byte()])) % token.len(), r.byte());
    let mut altered = token.clone();
    match how {
        0 => altered[at] ^= with.max(1),
        1 => altered.truncate(at),
        _ => altered.extend(std::iter::repeat_n(with, 1 + at % 40)),
    }
    if let Ok(o) = codec.open(&altered) {
        panic!("an altered token opened (change {how} at {at} with {with:#x}): {o:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// provider_spec_validate

/// The `provider_spec_validate` target. Input: a schema and a value, both JSON, split at the
/// first NUL byte (inputs that are not two JSON documents are dropped). Compiling the schema
/// and validating the value never panic; every violation names a field under the root; and the
/// one-off [`crate::schema::validate`] agrees with the compiled schema.
pub fn check_provider_spec_validate(data: &[u8]) {
    let Some(split) = data.iter().position(|&b| b == 0) else { return };
    let (Ok(schema), Ok(value)) =
        (serde_json::from_slice::<Value>(&data[..split]), serde_json::from_slice::<Value>(&data[split + 1..]))
    else {
        return;
    };
    let Ok(compiled) = crate::schema::ProviderSchema::compile(&schema) else { return };
    let violations = compiled.validate(&value, "provider_spec");
    for v in &violations {
        assert!(v.field.starts_with("provider_spec"), "violation outside the root: {v:?}");
    }
    assert_eq!(crate::schema::validate(&schema, &value, "provider_spec"), violations);
}
