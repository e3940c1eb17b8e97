//! # driver-sdk-core
//!
//! The parts of the driver SDK (`driver-sdk`) that take untrusted bytes and do no I/O beyond
//! reading a key file: they depend on serde, HMAC and JSON Schema, never on gRPC, tokio or a
//! network stack. `driver-sdk` re-exports all of it under its usual paths (`driver_sdk::token`,
//! `driver_sdk::schema`, `driver_sdk::Violation`, `driver_sdk::OperationKind`); a driver author
//! does not need this crate directly.
//!
//! It is its own crate so that the fuzz targets in `fuzz/` (`token_open`,
//! `provider_spec_validate`) build it under AddressSanitizer without the SDK's transport,
//! TLS and telemetry.
//!
//! # Features
//!
//! - `token` (default): the operation-token codec ([`token`]): HMAC-SHA256-sealed, versioned, bound to one
//!   driver.
//! - `schema` (default): provider-spec schemas ([`schema`]): JSON Schema draft 2020-12, refused at start
//!   when a keyword would be silently ignored.
//! - `fuzzing`: the hidden checks behind the two fuzz targets (turns both on).

pub mod duration;
#[cfg(all(feature = "token", feature = "schema", any(test, feature = "fuzzing")))]
#[doc(hidden)]
pub mod fuzzing;
#[cfg(feature = "schema")]
pub mod schema;
#[cfg(feature = "token")]
pub mod token;

/// One invalid field: which (a request field path or a JSON pointer into the provider spec) and
/// why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// Path of the field, e.g. `name` or `provider_spec.instanceType`.
    pub field: String,
    /// What is wrong with it.
    pub description: String,
}

impl Violation {
    /// A violation of `field`.
    pub fn new(field: impl Into<String>, description: impl Into<String>) -> Self {
        Self { field: field.into(), description: description.into() }
    }
}

/// What an operation does: the RPC that started it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[allow(missing_docs)]
pub enum OperationKind {
    CreateMachine,
    DeleteMachine,
    UpdateMachine,
    ApplyPool,
    DeletePoolInstances,
    UpgradePoolInstances,
    DeletePool,
}

/// Checks the name rules of machines and pools: DNS-subdomain style, 1..=253 characters of
/// `[a-z0-9.-]`, starting and ending with an alphanumeric character.
///
/// Ungated (no feature): the SDK checks the names a driver is sent with it, and the controller's
/// API crate (`machine-api`) the names of its objects, so both refuse the same names with the
/// same words.
pub fn check_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("is required");
    }
    if name.len() > 253 {
        return Err("must be at most 253 characters");
    }
    let ok_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.';
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    if !name.chars().all(ok_char) || !alnum(name.chars().next()) || !alnum(name.chars().last()) {
        return Err(
            "must consist of lower-case letters, digits, '-' and '.', and start and end with a letter or digit",
        );
    }
    Ok(())
}
