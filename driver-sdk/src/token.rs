//! Operation tokens: versioned, self-contained, HMAC-protected.
//!
//! Wire layout: `version (1 byte) || payload (JSON) || HMAC-SHA256(key, version || payload)`.
//! The payload names the driver, so a token from another driver is refused even when both
//! share a key. A driver never sees a token: it returns [`crate::Operation::state`] and gets it
//! back, verified, as [`crate::OperationHandle::state`].

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::Sha256;

use crate::error::{DriverError, Result};
use crate::types::{Operation, OperationHandle, OperationKind};

/// The token format version this SDK writes and reads.
pub const TOKEN_VERSION: u8 = 1;
const MAC_LEN: usize = 32;
/// The key used in dev mode. Tokens sealed with it protect against corruption, not forgery.
const DEV_KEY: &[u8] = b"machine-driver dev-mode token key -- not for production";
/// Environment variable holding the key itself.
pub const KEY_ENV: &str = "DRIVER_TOKEN_KEY";
/// Environment variable naming a file that holds the key.
pub const KEY_FILE_ENV: &str = "DRIVER_TOKEN_KEY_FILE";
const MIN_KEY_LEN: usize = 16;

/// Errors loading the token keys.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// No key was configured and dev mode is off.
    #[error(
        "no operation token key: pass --token-key-file, or set {KEY_FILE_ENV} or {KEY_ENV} \
         (at least {MIN_KEY_LEN} bytes), or run with --dev to use the insecure development key"
    )]
    Missing,
    /// The key file could not be read.
    #[error("reading token key file {path}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A key is too short.
    #[error("operation token key is {0} bytes; at least {MIN_KEY_LEN} are required")]
    TooShort(usize),
    /// The key file holds no key (only blank and comment lines).
    #[error("token key file {0} holds no key (one key per line; the first seals, all verify)")]
    Empty(String),
}

/// The keys that seal and verify operation tokens: the first seals, every one verifies, so a key
/// can be rotated without stranding a token sealed with the old one (see
/// `docs/src/operating/token-rotation.md`). `Debug` never prints them.
#[derive(Clone)]
pub struct TokenKey {
    keys: Vec<Vec<u8>>,
    dev: bool,
}

impl std::fmt::Debug for TokenKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenKey").field("keys", &self.keys.len()).field("dev", &self.dev).finish_non_exhaustive()
    }
}

impl TokenKey {
    /// A single key from raw bytes.
    ///
    /// # Errors
    /// [`KeyError::TooShort`] below 16 bytes.
    pub fn try_new(key: impl Into<Vec<u8>>) -> Result<Self, KeyError> {
        Self::try_from_keys(vec![key.into()])
    }

    /// Several keys: the first seals, all verify.
    ///
    /// # Errors
    /// [`KeyError::TooShort`] for a key below 16 bytes; [`KeyError::Missing`] for none.
    pub fn try_from_keys(keys: Vec<Vec<u8>>) -> Result<Self, KeyError> {
        if keys.is_empty() {
            return Err(KeyError::Missing);
        }
        if let Some(short) = keys.iter().find(|k| k.len() < MIN_KEY_LEN) {
            return Err(KeyError::TooShort(short.len()));
        }
        Ok(Self { keys, dev: false })
    }

    /// Parses a key file: one key per line (surrounding whitespace trimmed); blank lines and
    /// lines starting with `#` are skipped. The first key seals, all verify.
    ///
    /// # Errors
    /// [`KeyError::Empty`] without a key; [`KeyError::TooShort`] for a short one.
    pub fn parse_file(contents: &[u8], path: &Path) -> Result<Self, KeyError> {
        let keys: Vec<Vec<u8>> = contents
            .split(|b| *b == b'\n')
            .map(|line| line.trim_ascii())
            .filter(|line| !line.is_empty() && !line.starts_with(b"#"))
            .map(<[u8]>::to_vec)
            .collect();
        if keys.is_empty() {
            return Err(KeyError::Empty(path.display().to_string()));
        }
        Self::try_from_keys(keys)
    }

    /// The well-known development key.
    pub fn dev() -> Self {
        Self { keys: vec![DEV_KEY.to_vec()], dev: true }
    }

    /// Whether this is the development key.
    pub fn is_dev(&self) -> bool {
        self.dev
    }

    /// How many keys verify (the first of them seals).
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Never true: there is always a sealing key.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The key file in effect: `file` (from `--token-key-file`), else `$DRIVER_TOKEN_KEY_FILE`.
    pub fn file(file: Option<&Path>) -> Option<PathBuf> {
        file.map(Path::to_path_buf)
            .or_else(|| std::env::var_os(KEY_FILE_ENV).filter(|p| !p.is_empty()).map(PathBuf::from))
    }

    /// Reads and parses a key file.
    ///
    /// # Errors
    /// Read errors, [`KeyError::Empty`], [`KeyError::TooShort`].
    pub fn read_file(path: &Path) -> Result<Self, KeyError> {
        let bytes =
            std::fs::read(path).map_err(|source| KeyError::Read { path: path.display().to_string(), source })?;
        Self::parse_file(&bytes, path)
    }

    /// Loads the keys: the key file (`file`, from `--token-key-file`, else
    /// `$DRIVER_TOKEN_KEY_FILE`), else `$DRIVER_TOKEN_KEY` (one key), else the development key
    /// when `dev_mode`.
    ///
    /// # Errors
    /// [`KeyError::Missing`] when nothing is configured outside dev mode; read and length errors.
    pub fn load(file: Option<&Path>, dev_mode: bool) -> Result<Self, KeyError> {
        if let Some(path) = Self::file(file) {
            return Self::read_file(&path);
        }
        if let Some(key) = std::env::var_os(KEY_ENV).filter(|k| !k.is_empty()) {
            return Self::try_new(key.into_encoded_bytes());
        }
        if dev_mode {
            return Ok(Self::dev());
        }
        Err(KeyError::Missing)
    }

    fn mac(key: &[u8]) -> Hmac<Sha256> {
        // HMAC accepts keys of any length; this cannot fail.
        match Hmac::<Sha256>::new_from_slice(key) {
            Ok(mac) => mac,
            Err(_) => unreachable!("HMAC-SHA256 takes keys of any length"),
        }
    }

    fn sealing_mac(&self) -> Hmac<Sha256> {
        Self::mac(self.keys.first().map_or(DEV_KEY, Vec::as_slice))
    }

    /// Whether any key's HMAC of `body` is `tag`.
    fn verifies(&self, body: &[u8], tag: &[u8]) -> bool {
        self.keys.iter().any(|k| {
            let mut mac = Self::mac(k);
            mac.update(body);
            mac.verify_slice(tag).is_ok()
        })
    }
}

#[derive(Serialize, Deserialize)]
struct Payload {
    /// Driver name.
    d: String,
    /// Operation name.
    n: String,
    /// Kind.
    k: OperationKind,
    /// Target.
    t: String,
    /// Start time, ms since the epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    s: Option<u64>,
    /// Driver resume state.
    #[serde(default)]
    st: Value,
}

/// Seals operations into tokens and opens them again, for one driver. Clones share the keys, so
/// [`TokenCodec::replace_key`] on one (a reloaded key file) reaches them all.
#[derive(Debug, Clone)]
pub struct TokenCodec {
    key: Arc<RwLock<TokenKey>>,
    driver: String,
}

impl TokenCodec {
    /// A codec for the driver named `driver`.
    pub fn new(key: TokenKey, driver: impl Into<String>) -> Self {
        Self { key: Arc::new(RwLock::new(key)), driver: driver.into() }
    }

    /// Uses new keys from now on (tokens in flight keep verifying if their key is still among
    /// them).
    pub fn replace_key(&self, key: TokenKey) {
        *self.key.write().unwrap_or_else(|p| p.into_inner()) = key;
    }

    fn key(&self) -> std::sync::RwLockReadGuard<'_, TokenKey> {
        // A poisoned lock only means a writer panicked; the keys themselves are whole.
        self.key.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The token for a running operation.
    ///
    /// # Caveats
    /// The start time is carried to the millisecond, and not at all when it is before the Unix
    /// epoch or too far ahead for 64 bits of milliseconds. A state nested more than 126 levels
    /// deep seals into a token that [`TokenCodec::open`] refuses (the JSON parser's recursion
    /// limit).
    pub fn seal(&self, op: &Operation) -> Vec<u8> {
        let payload = Payload {
            d: self.driver.clone(),
            n: op.name.clone(),
            k: op.kind,
            t: op.target.clone(),
            s: start_millis(op.start_time),
            st: op.state.clone(),
        };
        // Serializing plain data to JSON cannot fail.
        let json = serde_json::to_vec(&payload).unwrap_or_default();
        let mut out = Vec::with_capacity(1 + json.len() + MAC_LEN);
        out.push(TOKEN_VERSION);
        out.extend_from_slice(&json);
        let mut mac = self.key().sealing_mac();
        mac.update(&out);
        out.extend_from_slice(&mac.finalize().into_bytes());
        out
    }

    /// Verifies and opens a token.
    ///
    /// # Errors
    /// INVALID_ARGUMENT / OPERATION_TOKEN_INVALID for an empty, truncated, tampered, foreign or
    /// unknown-version token. Nothing in an unverified token is ever acted on.
    pub fn open(&self, token: &[u8]) -> Result<OperationHandle> {
        if token.is_empty() {
            return Err(DriverError::token_invalid("operation token is empty").with_violation("token", "required"));
        }
        if token[0] != TOKEN_VERSION {
            return Err(DriverError::token_invalid(format!(
                "operation token version {} is not supported (this driver reads version {TOKEN_VERSION})",
                token[0]
            ))
            .with_violation("token", "unknown version"));
        }
        if token.len() < 1 + 2 + MAC_LEN {
            return Err(DriverError::token_invalid("operation token is truncated").with_violation("token", "truncated"));
        }
        let (body, tag) = token.split_at(token.len() - MAC_LEN);
        if !self.key().verifies(body, tag) {
            return Err(DriverError::token_invalid(
                "operation token failed its integrity check: it was altered, or sealed by another driver or key",
            )
            .with_violation("token", "integrity check failed"));
        }
        let payload: Payload = serde_json::from_slice(&body[1..])
            .map_err(|e| DriverError::token_invalid("operation token payload is malformed").with_source(e))?;
        if payload.d != self.driver {
            return Err(DriverError::token_invalid(format!(
                "operation token belongs to driver {:?}, not {:?}",
                payload.d, self.driver
            ))
            .with_violation("token", "foreign driver"));
        }
        Ok(OperationHandle {
            name: payload.n,
            kind: payload.k,
            target: payload.t,
            start_time: payload.s.map(|ms| UNIX_EPOCH + Duration::from_millis(ms)),
            state: payload.st,
        })
    }
}

/// The start time as the token carries it: ms since the epoch, or nothing for a time before the
/// epoch or too far ahead for 64 bits of ms (which `as u64` would wrap to another time).
fn start_millis(t: Option<SystemTime>) -> Option<u64> {
    u64::try_from(t?.duration_since(UNIX_EPOCH).ok()?.as_millis()).ok()
}

/// Unix time in ms (helper for drivers that put times in their resume state).
pub fn unix_millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn codec() -> TokenCodec {
        TokenCodec::new(TokenKey::try_new(*b"0123456789abcdef0123").unwrap(), "test.driver")
    }

    fn op() -> Operation {
        Operation::running(OperationKind::CreateMachine, "m1", json!({"id": "op-7", "zone": "a"}))
    }

    #[test]
    fn seals_and_opens() {
        let c = codec();
        let op = op();
        let handle = c.open(&c.seal(&op)).unwrap();
        assert_eq!(handle.name, op.name);
        assert_eq!(handle.kind, OperationKind::CreateMachine);
        assert_eq!(handle.target, "m1");
        assert_eq!(handle.state, json!({"id": "op-7", "zone": "a"}));
    }

    /// Found by the token_open fuzz target: a start time past what 64 bits of ms hold came back
    /// as another, wrapped time. It is not carried at all now, like one before the epoch.
    #[test]
    fn start_times_open_to_the_millisecond_or_not_at_all() {
        let c = codec();
        for (start, opened) in [
            (
                UNIX_EPOCH + Duration::new(1_764_028_800, 123_456_789),
                Some(UNIX_EPOCH + Duration::from_millis(1_764_028_800_123)),
            ),
            (UNIX_EPOCH + Duration::from_secs(1 << 60), None),
            (UNIX_EPOCH - Duration::from_secs(1), None),
        ] {
            let mut op = op();
            op.start_time = Some(start);
            assert_eq!(c.open(&c.seal(&op)).unwrap().start_time, opened, "{start:?}");
        }
    }

    /// Where serde_json's recursion limit (128, the payload's own object included) falls.
    #[test]
    fn states_open_up_to_126_levels_deep() {
        let c = codec();
        let nested = |levels: usize| (0..levels).fold(json!(1), |v, _| json!([v]));
        let mut op = op();
        op.state = nested(126);
        assert_eq!(c.open(&c.seal(&op)).unwrap().state, op.state);
        op.state = nested(127);
        assert!(c.open(&c.seal(&op)).is_err());
    }

    #[test]
    fn every_flipped_byte_is_refused() {
        let c = codec();
        let token = c.seal(&op());
        for i in 0..token.len() {
            let mut bad = token.clone();
            bad[i] ^= 0x20;
            let err = c.open(&bad).unwrap_err();
            assert_eq!(err.reason(), crate::error::reason::OPERATION_TOKEN_INVALID, "byte {i}");
            assert_eq!(err.code(), tonic::Code::InvalidArgument);
        }
    }

    #[test]
    fn foreign_driver_and_foreign_key_are_refused() {
        let key = TokenKey::try_new(*b"0123456789abcdef0123").unwrap();
        let other_driver = TokenCodec::new(key, "other.driver");
        assert!(codec().open(&other_driver.seal(&op())).unwrap_err().message().contains("other.driver"));
        let other_key = TokenCodec::new(TokenKey::try_new(*b"fedcba9876543210fedc").unwrap(), "test.driver");
        assert!(codec().open(&other_key.seal(&op())).is_err());
    }

    #[test]
    fn empty_truncated_and_garbage_tokens_are_refused() {
        let c = codec();
        for bad in [&b""[..], &[1u8][..], &[1u8, b'{', b'}'][..], b"hello world, this is not a token at all!!"] {
            assert_eq!(c.open(bad).unwrap_err().reason(), crate::error::reason::OPERATION_TOKEN_INVALID);
        }
    }

    #[test]
    fn missing_key_outside_dev_mode_is_a_clear_error() {
        // Only meaningful when the environment does not configure a key.
        if std::env::var_os(KEY_ENV).is_none() && std::env::var_os(KEY_FILE_ENV).is_none() {
            let err = TokenKey::load(None, false).unwrap_err();
            assert!(err.to_string().contains("--token-key-file"), "{err}");
            assert!(TokenKey::load(None, true).unwrap().is_dev());
        }
        assert!(matches!(TokenKey::try_new(*b"short"), Err(KeyError::TooShort(5))));
    }

    #[test]
    fn key_file_is_read_and_trimmed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        std::fs::write(&path, "a-long-enough-secret-key\n").unwrap();
        let key = TokenKey::load(Some(&path), false).unwrap();
        assert!(!key.is_dev());
        assert_eq!(key.len(), 1);
        assert!(!format!("{key:?}").contains("secret"));
        let missing = TokenKey::load(Some(&dir.path().join("nope")), false).unwrap_err();
        assert!(missing.to_string().contains("nope"));
    }

    #[test]
    fn the_first_key_seals_and_every_key_verifies() {
        let path = Path::new("keys");
        let old = TokenKey::parse_file(b"old-key-0123456789abcdef\n", path).unwrap();
        let both = TokenKey::parse_file(
            b"# rotation in progress\nnew-key-0123456789abcdef\n\n  old-key-0123456789abcdef  \n",
            path,
        )
        .unwrap();
        assert_eq!(both.len(), 2);
        let new = TokenKey::parse_file(b"new-key-0123456789abcdef", path).unwrap();
        let (old, both, new) = (
            TokenCodec::new(old, "test.driver"),
            TokenCodec::new(both, "test.driver"),
            TokenCodec::new(new, "test.driver"),
        );
        // Tokens sealed before the rotation still open; new ones are sealed with the new key.
        assert!(both.open(&old.seal(&op())).is_ok());
        let sealed_during = both.seal(&op());
        assert!(new.open(&sealed_during).is_ok());
        assert!(old.open(&sealed_during).is_err());
        // Replacing the keys of a running codec takes effect at once, in every clone.
        let clone = old.clone();
        old.replace_key(TokenKey::parse_file(b"new-key-0123456789abcdef", path).unwrap());
        assert!(clone.open(&sealed_during).is_ok());
        assert!(clone
            .open(&TokenCodec::new(TokenKey::try_new(*b"0123456789abcdef0123").unwrap(), "test.driver").seal(&op()))
            .is_err());
    }

    #[test]
    fn bad_key_files_are_clear_errors() {
        let path = Path::new("/etc/keys");
        let empty = TokenKey::parse_file(b"# nothing yet\n\n", path).unwrap_err();
        assert!(empty.to_string().contains("/etc/keys holds no key"), "{empty}");
        assert!(matches!(TokenKey::parse_file(b"a-long-enough-key-0001\nshort\n", path), Err(KeyError::TooShort(5))));
    }
}
