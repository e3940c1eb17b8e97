//! The per-call context a driver method receives.

use std::time::{Duration, Instant};

use crate::connection::Connection;

/// Everything the SDK knows about the current call.
#[derive(Debug, Clone)]
pub struct RequestContext {
    pub(crate) request_id: String,
    pub(crate) method: String,
    pub(crate) deadline: Option<Instant>,
    pub(crate) trace_id: Option<String>,
    pub(crate) connection: Option<Connection>,
}

impl RequestContext {
    /// A context for calling driver methods directly (tests, embedding).
    pub fn new(request_id: impl Into<String>) -> Self {
        Self { request_id: request_id.into(), method: String::new(), deadline: None, trace_id: None, connection: None }
    }

    /// A context for calling driver methods directly as if serving `method` (tests).
    pub fn for_method(request_id: impl Into<String>, method: &str) -> Self {
        Self { method: method.to_string(), ..Self::new(request_id) }
    }

    /// The call's request ID (from `x-request-id`, or generated). Pass it on to the cloud where
    /// the cloud accepts one (Azure `x-ms-client-request-id`).
    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// The RPC's name, e.g. `CreateMachine`.
    pub fn method(&self) -> &str {
        &self.method
    }

    /// When the caller stops waiting (from `grpc-timeout`).
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Time left before the deadline.
    pub fn remaining(&self) -> Option<Duration> {
        self.deadline.map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// The W3C trace ID of the caller's `traceparent`, if it sent one.
    pub fn trace_id(&self) -> Option<&str> {
        self.trace_id.as_deref()
    }

    /// What the server's connection hook ([`crate::DriverServer::with_connection_hook`])
    /// attached to the caller's connection, if it is a `T`.
    pub fn connection<T: std::any::Any + Send + Sync>(&self) -> Option<&T> {
        self.connection.as_ref()?.0.downcast_ref::<T>()
    }
}
