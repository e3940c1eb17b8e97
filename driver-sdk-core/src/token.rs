//! Operation tokens: versioned, self-contained, HMAC-protected.
//!
//! Wire layout: `version (1 byte) || payload (JSON) || HMAC-SHA256(key, version || payload)`.
//! The payload names the driver, so a token from another driver is refused even when both
//! share a key. The driver SDK's `TokenCodec` seals its operations with this codec and turns a
//! [`TokenError`] into its OPERATION_TOKEN_INVALID error.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::Sha256;

use crate::OperationKind;

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

/// What a token carries: the operation a driver resumes from it.
#[derive(Debug, Clone, Copy)]
pub struct Sealed<'a> {
    /// The operation's name.
    pub name: &'a str,
    /// The RPC that started it.
    pub kind: OperationKind,
    /// The machine or pool name.
    pub target: &'a str,
    /// When it started (carried to the millisecond; see [`TokenCodec::seal`]).
    pub start_time: Option<SystemTime>,
    /// The driver's resume data.
    pub state: &'a Value,
}

/// What a verified token opens to: the fields of [`Sealed`], owned.
#[derive(Debug, Clone, PartialEq)]
pub struct Opened {
    /// The operation's name.
    pub name: String,
    /// The RPC that started it.
    pub kind: OperationKind,
    /// The machine or pool name.
    pub target: String,
    /// When it started, to the millisecond.
    pub start_time: Option<SystemTime>,
    /// The driver's resume data.
    pub state: Value,
}

impl Opened {
    /// What to seal to get the same token again.
    pub fn sealed(&self) -> Sealed<'_> {
        Sealed {
            name: &self.name,
            kind: self.kind,
            target: &self.target,
            start_time: self.start_time,
            state: &self.state,
        }
    }
}

/// Why a token does not open. Nothing in an unverified token is ever acted on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenError {
    /// No bytes.
    #[error("operation token is empty")]
    Empty,
    /// A version this codec does not read.
    #[error("operation token version {0} is not supported (this driver reads version {TOKEN_VERSION})")]
    Version(u8),
    /// Too short to hold a version, a payload and a MAC.
    #[error("operation token is truncated")]
    Truncated,
    /// No key's MAC matches.
    #[error("operation token failed its integrity check: it was altered, or sealed by another driver or key")]
    Integrity,
    /// Verified, but the payload does not decode (a token of another codec version).
    #[error("operation token payload is malformed")]
    Malformed(#[source] serde_json::Error),
    /// Sealed for another driver with a shared key.
    #[error("operation token belongs to driver {token:?}, not {driver:?}")]
    ForeignDriver {
        /// The driver the token names.
        token: String,
        /// This codec's driver.
        driver: String,
    },
}

impl TokenError {
    /// What is wrong with the `token` field, in a word or two (a BadRequest field violation);
    /// `None` for a malformed payload, whose cause is the source instead.
    pub fn violation(&self) -> Option<&'static str> {
        match self {
            Self::Empty => Some("required"),
            Self::Version(_) => Some("unknown version"),
            Self::Truncated => Some("truncated"),
            Self::Integrity => Some("integrity check failed"),
            Self::Malformed(_) => None,
            Self::ForeignDriver { .. } => Some("foreign driver"),
        }
    }
}

#[derive(Serialize)]
struct PayloadRef<'a> {
    d: &'a str,
    n: &'a str,
    k: OperationKind,
    t: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    s: Option<u64>,
    st: &'a Value,
}

/// The payload's fields: one letter each, to keep tokens short.
#[derive(Deserialize)]
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
    #[serde(default)]
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
    pub fn seal(&self, op: Sealed<'_>) -> Vec<u8> {
        let payload = PayloadRef {
            d: &self.driver,
            n: op.name,
            k: op.kind,
            t: op.target,
            s: start_millis(op.start_time),
            st: op.state,
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
    /// A [`TokenError`] for an empty, truncated, tampered, foreign or unknown-version token.
    pub fn open(&self, token: &[u8]) -> Result<Opened, TokenError> {
        match token.first() {
            None => return Err(TokenError::Empty),
            Some(&v) if v != TOKEN_VERSION => return Err(TokenError::Version(v)),
            Some(_) => {}
        }
        if token.len() < 1 + 2 + MAC_LEN {
            return Err(TokenError::Truncated);
        }
        let (body, tag) = token.split_at(token.len() - MAC_LEN);
        if !self.key().verifies(body, tag) {
            return Err(TokenError::Integrity);
        }
        let payload: Payload = serde_json::from_slice(&body[1..]).map_err(TokenError::Malformed)?;
        if payload.d != self.driver {
            return Err(TokenError::ForeignDriver { token: payload.d, driver: self.driver.clone() });
        }
        Ok(Opened {
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
