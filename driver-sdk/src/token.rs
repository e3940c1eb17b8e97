//! Operation tokens: versioned, self-contained, HMAC-protected.
//!
//! Wire layout: `version (1 byte) || payload (JSON) || HMAC-SHA256(key, version || payload)`.
//! The payload names the driver, so a token from another driver is refused even when both
//! share a key. A driver never sees a token: it returns [`crate::Operation::state`] and gets it
//! back, verified, as [`crate::OperationHandle::state`].
//!
//! The codec itself is `driver-sdk-core`'s (where the `token_open` fuzz target drives it without
//! any gRPC); this module gives it the SDK's types and errors.

pub use driver_sdk_core::token::{unix_millis, KeyError, TokenError, TokenKey, KEY_ENV, KEY_FILE_ENV, TOKEN_VERSION};
use driver_sdk_core::token::{Opened, Sealed};

use crate::error::{DriverError, Result};
use crate::types::{Operation, OperationHandle};

/// Seals operations into tokens and opens them again, for one driver. Clones share the keys, so
/// [`TokenCodec::replace_key`] on one (a reloaded key file) reaches them all.
#[derive(Debug, Clone)]
pub struct TokenCodec(driver_sdk_core::token::TokenCodec);

impl TokenCodec {
    /// A codec for the driver named `driver`.
    pub fn new(key: TokenKey, driver: impl Into<String>) -> Self {
        Self(driver_sdk_core::token::TokenCodec::new(key, driver))
    }

    /// Uses new keys from now on (tokens in flight keep verifying if their key is still among
    /// them).
    pub fn replace_key(&self, key: TokenKey) {
        self.0.replace_key(key);
    }

    /// The token for a running operation.
    ///
    /// # Caveats
    /// The start time is carried to the millisecond, and not at all when it is before the Unix
    /// epoch or too far ahead for 64 bits of milliseconds. A state nested more than 126 levels
    /// deep seals into a token that [`TokenCodec::open`] refuses (the JSON parser's recursion
    /// limit).
    pub fn seal(&self, op: &Operation) -> Vec<u8> {
        self.0.seal(Sealed {
            name: &op.name,
            kind: op.kind,
            target: &op.target,
            start_time: op.start_time,
            state: &op.state,
        })
    }

    /// Verifies and opens a token.
    ///
    /// # Errors
    /// INVALID_ARGUMENT / OPERATION_TOKEN_INVALID for an empty, truncated, tampered, foreign or
    /// unknown-version token. Nothing in an unverified token is ever acted on.
    pub fn open(&self, token: &[u8]) -> Result<OperationHandle> {
        let Opened { name, kind, target, start_time, state } = self.0.open(token).map_err(token_error)?;
        Ok(OperationHandle { name, kind, target, start_time, state })
    }
}

/// OPERATION_TOKEN_INVALID, with the `token` field's violation or the payload's decoding error.
fn token_error(e: TokenError) -> DriverError {
    let err = DriverError::token_invalid(e.to_string());
    match (e.violation(), e) {
        (Some(v), _) => err.with_violation("token", v),
        (None, TokenError::Malformed(source)) => err.with_source(source),
        (None, _) => err,
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;
    use crate::types::OperationKind;
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
