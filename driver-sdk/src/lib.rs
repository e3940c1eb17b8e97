//! # driver-sdk
//!
//! Build a `machinedriver.v1` driver sidecar by implementing one trait, [`Driver`], with plain
//! Rust types. The SDK owns everything else:
//!
//! - the gRPC services (generated from `proto/`), proto ↔ domain conversion, required-field and
//!   provider-spec schema validation (INVALID_ARGUMENT with BadRequest field violations) and
//!   capability gating (UNIMPLEMENTED for what a driver does not advertise);
//! - transport ([`DriverServer::serve`]): Unix socket (0660, stale socket removed) or TCP with
//!   optional TLS, `grpc.health.v1` driven by [`Driver::probe`], server reflection for grpcurl,
//!   message-size and concurrency limits, graceful drain on SIGTERM;
//! - request IDs (`x-request-id`, read or generated, echoed, on every log line, in
//!   [`RequestContext`] and in every error as RequestInfo);
//! - typed errors ([`DriverError`] → google.rpc.Status with ErrorInfo / RetryInfo / RequestInfo /
//!   BadRequest, cause chain kept as a list) with secret values redacted;
//! - self-contained, versioned, HMAC-protected operation tokens ([`token`]): a restarted driver
//!   resumes an operation from its token alone;
//! - telemetry ([`telemetry`]): one span per RPC, W3C trace context, OTLP export when
//!   `OTEL_EXPORTER_OTLP_ENDPOINT` is set, Prometheus metrics;
//! - [`DriverClient`] for callers, and a [`conformance`] suite (also the `driver-conformance`
//!   binary) that proves a live driver keeps the protocol's promises.
//!
//! ```no_run
//! use driver_sdk::{async_trait, Capability, Driver, DriverInfo, DriverServer, OperationHandle,
//!                  Operation, RequestContext, Result, Secrets, ServeArgs};
//!
//! struct Hello;
//!
//! #[async_trait]
//! impl Driver for Hello {
//!     fn info(&self) -> DriverInfo {
//!         DriverInfo {
//!             name: "hello.example.com".into(),
//!             vendor_version: "0.1.0".into(),
//!             provider_spec_schema: serde_json::json!({"type": "object"}),
//!         }
//!     }
//!     fn capabilities(&self) -> Vec<Capability> { vec![] }
//!     async fn get_operation(&self, _: &RequestContext, h: OperationHandle, _: Secrets) -> Result<Operation> {
//!         Ok(h.resume())
//!     }
//! }
//!
//! # async fn run() -> Result<(), driver_sdk::ServeError> {
//! let args = ServeArgs { endpoint: "unix:///tmp/hello.sock".into(), dev: true, ..Default::default() };
//! DriverServer::new(Hello).serve(&args).await
//! # }
//! ```
//!
//! See `examples/minimal_driver.rs` for a complete driver that passes the conformance suite.

#![warn(missing_docs)]

pub mod client;
pub mod conformance;
mod connection;
mod context;
pub mod convert;
mod driver;
pub mod endpoint;
pub mod error;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod layer;
pub mod metrics;
pub mod schema;
mod secrets;
mod server;
mod service;
pub mod telemetry;
pub mod token;
pub mod types;

pub use async_trait::async_trait;
pub use client::{CallError, CallResult, DriverClient, OperationExt, Reply};
pub use connection::{BoxedConnection, ConnectionData, ConnectionIo};
pub use context::RequestContext;
pub use driver::Driver;
pub use error::{reason, DriverError, ErrorReport, Result, Violation};
pub use machine_driver_proto::v1 as proto;
pub use server::{DriverServer, ServeArgs, ServeError, DEFAULT_ENDPOINT};
pub use service::{DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE};
pub use token::{TokenCodec, TokenKey};
pub use types::*;
pub use {prost, prost_types, tonic};

/// The protocol version this SDK speaks.
pub const PROTOCOL_VERSION: &str = "v1";

/// Parses a duration such as `250ms`, `2s`, `1.5s`, `5m`, `1h` (a bare number means seconds).
///
/// # Errors
/// A message naming the accepted forms.
pub fn parse_duration(s: &str) -> std::result::Result<std::time::Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("invalid duration {s:?}: expected e.g. 250ms, 2s, 5m, 1h"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "" | "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("invalid duration {s:?}: unit must be ms, s, m or h")),
    };
    if !secs.is_finite() || !(0.0..=1.0e9).contains(&secs) {
        return Err(format!("invalid duration {s:?}: out of range"));
    }
    Ok(std::time::Duration::from_secs_f64(secs))
}

/// Prints an error and its whole cause chain: `outer: inner: innermost`.
pub fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut next = err.source();
    while let Some(e) = next {
        out.push_str(": ");
        out.push_str(&e.to_string());
        next = e.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn parses_durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }
}
