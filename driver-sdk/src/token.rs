//! Operation tokens: versioned, self-contained, HMAC-protected.
//!
//! Wire layout: `version (1 byte) || payload (JSON) || HMAC-SHA256(key, version || payload)`.
//! The payload names the driver, so a token from another driver is refused even when both
//! share a key. A driver never sees a token: it returns [`crate::Operation::state`] and gets it
//! back, verified, as [`crate::OperationHandle::state`].

use std::path::Path;
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

/// Errors loading the token key at startup.
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
    /// The key is too short.
    #[error("operation token key is {0} bytes; at least {MIN_KEY_LEN} are required")]
    TooShort(usize),
}

/// The key that seals operation tokens. `Debug` never prints it.
#[derive(Clone)]
pub struct TokenKey {
    key: Vec<u8>,
    dev: bool,
}

impl std::fmt::Debug for TokenKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenKey").field("dev", &self.dev).finish_non_exhaustive()
    }
}

impl TokenKey {
    /// A key from raw bytes.
    ///
    /// # Errors
    /// [`KeyError::TooShort`] below 16 bytes.
    pub fn try_new(key: impl Into<Vec<u8>>) -> Result<Self, KeyError> {
        let key = key.into();
        if key.len() < MIN_KEY_LEN {
            return Err(KeyError::TooShort(key.len()));
        }
        Ok(Self { key, dev: false })
    }

    /// The well-known development key.
    pub fn dev() -> Self {
        Self { key: DEV_KEY.to_vec(), dev: true }
    }

    /// Whether this is the development key.
    pub fn is_dev(&self) -> bool {
        self.dev
    }

    /// Loads the key: `file` (from `--token-key-file`), else `$DRIVER_TOKEN_KEY_FILE`, else
    /// `$DRIVER_TOKEN_KEY`, else the development key when `dev_mode`.
    ///
    /// # Errors
    /// [`KeyError::Missing`] when nothing is configured outside dev mode; read and length errors.
    pub fn load(file: Option<&Path>, dev_mode: bool) -> Result<Self, KeyError> {
        let from_file = |path: &Path| {
            let bytes =
                std::fs::read(path).map_err(|source| KeyError::Read { path: path.display().to_string(), source })?;
            Self::try_new(trim_ascii_end(&bytes).to_vec())
        };
        if let Some(path) = file {
            return from_file(path);
        }
        if let Some(path) = std::env::var_os(KEY_FILE_ENV).filter(|p| !p.is_empty()) {
            return from_file(Path::new(&path));
        }
        if let Some(key) = std::env::var_os(KEY_ENV).filter(|k| !k.is_empty()) {
            return Self::try_new(key.into_encoded_bytes());
        }
        if dev_mode {
            return Ok(Self::dev());
        }
        Err(KeyError::Missing)
    }

    fn mac(&self) -> Hmac<Sha256> {
        // HMAC accepts keys of any length; this cannot fail.
        match Hmac::<Sha256>::new_from_slice(&self.key) {
            Ok(mac) => mac,
            Err(_) => unreachable!("HMAC-SHA256 takes keys of any length"),
        }
    }
}

fn trim_ascii_end(bytes: &[u8]) -> &[u8] {
    let end = bytes.iter().rposition(|b| !b.is_ascii_whitespace()).map_or(0, |i| i + 1);
    &bytes[..end]
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

/// Seals operations into tokens and opens them again, for one driver.
#[derive(Debug, Clone)]
pub struct TokenCodec {
    key: TokenKey,
    driver: String,
}

impl TokenCodec {
    /// A codec for the driver named `driver`.
    pub fn new(key: TokenKey, driver: impl Into<String>) -> Self {
        Self { key, driver: driver.into() }
    }

    /// The token for a running operation.
    pub fn seal(&self, op: &Operation) -> Vec<u8> {
        let payload = Payload {
            d: self.driver.clone(),
            n: op.name.clone(),
            k: op.kind,
            t: op.target.clone(),
            s: op.start_time.and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map(|d| d.as_millis() as u64),
            st: op.state.clone(),
        };
        // Serializing plain data to JSON cannot fail.
        let json = serde_json::to_vec(&payload).unwrap_or_default();
        let mut out = Vec::with_capacity(1 + json.len() + MAC_LEN);
        out.push(TOKEN_VERSION);
        out.extend_from_slice(&json);
        let mut mac = self.key.mac();
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
        let mut mac = self.key.mac();
        mac.update(body);
        if mac.verify_slice(tag).is_err() {
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

    #[test]
    fn every_flipped_byte_is_refused() {
        let c = codec();
        let token = c.seal(&op());
        for i in 0..token.len() {
            let mut bad = token.clone();
            bad[i] ^= 0x20;
            let err = c.open(&bad).unwrap_err();
            assert_eq!(err.reason(), crate::reason::OPERATION_TOKEN_INVALID, "byte {i}");
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
            assert_eq!(c.open(bad).unwrap_err().reason(), crate::reason::OPERATION_TOKEN_INVALID);
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
        assert!(!format!("{key:?}").contains("secret"));
        let missing = TokenKey::load(Some(&dir.path().join("nope")), false).unwrap_err();
        assert!(missing.to_string().contains("nope"));
    }
}
