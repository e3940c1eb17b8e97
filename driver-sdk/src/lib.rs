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
//! - at-least-once delivery of the cloud's own events ([`events`]): a driver yields them from
//!   [`Driver::watch_events`]; the SDK streams them, redelivers until acknowledged and dedupes;
//! - [`DriverClient`] for callers, and a [`conformance`] suite (also the `driver-conformance`
//!   binary) that proves a live driver keeps the protocol's promises.
//!
//! # Features
//!
//! - `server` (default): everything a driver needs to serve — [`Driver`], [`DriverServer`] with
//!   its RPC layer ([`layer`]), gRPC health and reflection, provider-spec [`schema`]s, HMAC
//!   operation [`token`]s, and the [`conformance`] suite with the `driver-conformance` binary.
//!   Without it (`default-features = false`) the crate is a client of drivers: [`DriverClient`],
//!   [`DriverError`] / [`ErrorReport`], the domain [`types`], [`convert`] to and from
//!   [`proto`], [`endpoint`]s and [`reason`]s — and compiles no server code nor its
//!   dependencies (`tonic-health`, `tonic-reflection`, `hmac`, `jsonschema`, `h2-authority`).
//!   That is how `machine-controller` uses it.
//!
//! The operation-token codec and the provider-spec schemas, the code that reads untrusted bytes,
//! live in the small `driver-sdk-core` crate (no gRPC), where the fuzz targets build them; the
//! `server` feature turns them on and they appear here as [`token`] and [`schema`].
//!
//! The process helpers that are not gRPC — [`error_chain`], [`parse_duration`], [`telemetry`]
//! setup and the [`metrics`] HTTP endpoint — live in the small `machine-driver-util` crate,
//! shared with the controller, and are re-exported here under their usual paths.
//!
//! ```no_run
//! # #[cfg(feature = "server")] mod example {
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
//! # }
//! ```
//!
//! See `examples/minimal_driver.rs` for a complete driver that passes the conformance suite.

#![warn(missing_docs)]
// Without `server` the crate docs above still name the server's items, which are not compiled.
#![cfg_attr(not(feature = "server"), allow(rustdoc::broken_intra_doc_links))]

pub mod client;
#[cfg(feature = "server")]
pub mod conformance;
#[cfg(feature = "server")]
mod connection;
#[cfg(feature = "server")]
mod context;
pub mod convert;
#[cfg(feature = "server")]
mod driver;
pub mod endpoint;
pub mod error;
#[cfg(feature = "server")]
pub mod events;
#[cfg(feature = "server")]
pub mod layer;
pub mod metrics;
#[cfg(feature = "server")]
pub use driver_sdk_core::schema;
mod secrets;
#[cfg(feature = "server")]
mod server;
#[cfg(feature = "server")]
mod service;
pub mod telemetry;
#[cfg(feature = "server")]
pub mod token;
pub mod types;

#[cfg(feature = "server")]
pub use async_trait::async_trait;
pub use client::{CallError, CallResult, DriverClient, OperationExt, Reply};
#[cfg(feature = "server")]
pub use connection::{BoxedConnection, ConnectionData, ConnectionIo};
#[cfg(feature = "server")]
pub use context::RequestContext;
#[cfg(feature = "server")]
pub use driver::Driver;
pub use error::{reason, DriverError, ErrorReport, Result, Violation};
#[cfg(feature = "server")]
pub use events::EventStream;
pub use machine_driver_proto::v1 as proto;
// Shared with the controller, which takes them from machine-driver-util itself.
pub use machine_driver_util::{error_chain, lock, parse_duration};
#[cfg(feature = "server")]
pub use server::{DriverServer, ServeArgs, ServeError, DEFAULT_ENDPOINT};
#[cfg(feature = "server")]
pub use token::{TokenCodec, TokenKey};
pub use types::*;
pub use {prost, prost_types, tonic};
