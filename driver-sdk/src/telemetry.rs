//! Logging and tracing setup: `tracing` to stderr (text or JSON), plus OpenTelemetry OTLP export
//! when `OTEL_EXPORTER_OTLP_ENDPOINT` is set. W3C trace context is propagated either way.
//!
//! The setup lives in [`machine_driver_util::telemetry`], shared with the controller; it is
//! re-exported here unchanged. The server's RPC layer reads the trace context of each call with
//! the helpers below.

pub use machine_driver_util::telemetry::{init, init_with_default_level, LogFormat, TelemetryGuard};

/// Reads W3C trace context from HTTP/gRPC headers.
#[cfg(feature = "server")]
pub(crate) struct HeaderExtractor<'a>(pub(crate) &'a http::HeaderMap);

#[cfg(feature = "server")]
impl opentelemetry::propagation::Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// The trace ID of a `traceparent` header (`00-<trace id>-<span id>-<flags>`).
#[cfg(feature = "server")]
pub(crate) fn trace_id_of(traceparent: &str) -> Option<&str> {
    let mut parts = traceparent.split('-');
    let (_version, id) = (parts.next()?, parts.next()?);
    (id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())).then_some(id)
}
