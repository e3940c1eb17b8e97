//! # machine-driver-util
//!
//! The process helpers that the controller (`machine-controller`) and the driver sidecars (through
//! `driver-sdk`, which re-exports all of them under their old paths) share, and that need no gRPC:
//!
//! - [`error_chain`]: an error and its whole cause chain on one line;
//! - [`parse_duration`]: `250ms`, `2s`, `5m`, `1h30m`, as flags and environment variables take them
//!   (the one grammar, budgets' too: `driver_sdk_core::duration`);
//! - [`lock`]: a mutex's guard, whether or not a panic poisoned it;
//! - [`telemetry`]: the `tracing` subscriber (text or JSON to stderr, credential-leaking targets
//!   fenced) and OTLP trace export when `OTEL_EXPORTER_OTLP_ENDPOINT` is set;
//! - [`metrics`]: Prometheus text encoding and the small HTTP server of `/metrics`, `/healthz`
//!   and `/readyz`.
//!
//! A client of drivers takes these from here and the gRPC client from `driver-sdk` without its
//! `server` feature, so it compiles none of the SDK's server side.

#![warn(missing_docs)]

mod duration;
pub mod metrics;
pub mod telemetry;

pub use duration::parse_duration;

/// Locks `m`, taking its value even when a thread panicked while it held it. Every mutex of
/// these crates guards state its critical sections leave whole (caches, queues, counters): a
/// panic in one caller must not make every later lock panic too. The one way to lock here
/// (`clippy::unwrap_used` warns about the others).
pub fn lock<T: ?Sized>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
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
    use std::fmt;

    #[derive(Debug)]
    struct Wrapped(&'static str, Option<Box<Wrapped>>);

    impl fmt::Display for Wrapped {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Wrapped {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    #[test]
    fn error_chain_joins_every_cause() {
        let err = Wrapped("outer", Some(Box::new(Wrapped("inner", Some(Box::new(Wrapped("innermost", None)))))));
        assert_eq!(super::error_chain(&err), "outer: inner: innermost");
        assert_eq!(super::error_chain(&Wrapped("alone", None)), "alone");
    }
}
