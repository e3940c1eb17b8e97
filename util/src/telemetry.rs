//! Logging and tracing setup: `tracing` to stderr (text or JSON), plus OpenTelemetry OTLP export
//! when `OTEL_EXPORTER_OTLP_ENDPOINT` is set. W3C trace context is propagated either way.

use opentelemetry::trace::TracerProvider as _;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Flushes and stops trace export when dropped.
#[must_use = "dropping the guard stops trace export"]
pub struct TelemetryGuard {
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            let _ = p.shutdown();
        }
    }
}

/// Log targets whose debug and trace events carry credentials: dropped whatever `RUST_LOG`
/// says. The legacy Azure SDK (`azure_core` 0.21, the Azure driver's) writes the outgoing
/// `authorization` header (a live bearer token) at those levels (RUSTSEC-2026-0275).
const CREDENTIAL_LEAKING_TARGETS: &[&str] = &["azure_core"];

/// Whether an event or span may be recorded at all: not debug or trace from a target of
/// [`CREDENTIAL_LEAKING_TARGETS`] (or one of its modules).
fn may_record(meta: &tracing::Metadata<'_>) -> bool {
    let leaky = CREDENTIAL_LEAKING_TARGETS
        .iter()
        .any(|t| meta.target().strip_prefix(t).is_some_and(|rest| rest.is_empty() || rest.starts_with("::")));
    !(leaky && *meta.level() > tracing::Level::INFO)
}

/// Installs the global subscriber. `RUST_LOG` sets the filter (default `info`); debug and trace
/// of libraries known to log credentials stay off whatever it says. Call once, from `main`; a
/// second call leaves the first subscriber in place.
pub fn init(service_name: &str, format: LogFormat) -> TelemetryGuard {
    init_with_default_level(service_name, format, "info")
}

/// [`init`] with another filter than `info` when `RUST_LOG` is not set (a CLI that prints its
/// own output logs only warnings by default).
pub fn init_with_default_level(service_name: &str, format: LogFormat, default: &str) -> TelemetryGuard {
    opentelemetry::global::set_text_map_propagator(opentelemetry_sdk::propagation::TraceContextPropagator::new());
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let fmt = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_writer(std::io::stderr)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .with_writer(std::io::stderr)
            .boxed(),
    };
    let mut provider = None;
    let otel = match std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT") {
        Ok(endpoint) if !endpoint.is_empty() => match otlp_provider(service_name) {
            Ok(p) => {
                let tracer = p.tracer(service_name.to_string());
                provider = Some(p);
                Some(tracing_opentelemetry::layer().with_tracer(tracer))
            }
            Err(e) => {
                eprintln!("warning: OTLP export to {endpoint} disabled: {e}");
                None
            }
        },
        _ => None,
    };
    let _ = tracing_subscriber::registry()
        .with(tracing_subscriber::filter::filter_fn(may_record))
        .with(filter)
        .with(fmt)
        .with(otel)
        .try_init();
    TelemetryGuard { provider }
}

fn otlp_provider(
    service_name: &str,
) -> Result<opentelemetry_sdk::trace::SdkTracerProvider, Box<dyn std::error::Error>> {
    let exporter = opentelemetry_otlp::SpanExporter::builder().with_tonic().build()?;
    let resource = opentelemetry_sdk::Resource::builder().with_service_name(service_name.to_string()).build();
    Ok(opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build())
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::EnvFilter;

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            crate::lock(&self.0).extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// `RUST_LOG=trace` (what someone debugging the Azure driver sets) still never writes the
    /// legacy Azure SDK's debug and trace events, which carry the authorization header; its
    /// info and above, and everyone else's debug, are kept.
    #[test]
    fn credential_leaking_debug_logs_stay_off_even_at_trace() {
        let out = Captured::default();
        let writer = out.clone();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_subscriber::filter::filter_fn(super::may_record))
            .with(EnvFilter::new("trace"))
            .with(tracing_subscriber::fmt::layer().with_ansi(false).with_writer(move || writer.clone()));
        tracing::subscriber::with_default(subscriber, || {
            tracing::debug!(target: "azure_core::policies::transport", "authorization: Bearer eyJ0eXAi-debug");
            tracing::trace!(target: "azure_core", "authorization: Bearer eyJ0eXAi-trace");
            tracing::info!(target: "azure_core::policies::retry", "retrying after 429");
            tracing::debug!(target: "azure_core_like::x", "a crate that only shares the prefix");
            tracing::debug!(target: "azure_vmss_driver::arm", "GET virtualMachines/web-1");
        });
        let text = String::from_utf8(crate::lock(&out.0).clone()).unwrap_or_default();
        assert!(!text.contains("eyJ0eXAi"), "a credential reached the log:\n{text}");
        for kept in ["retrying after 429", "shares the prefix", "GET virtualMachines/web-1"] {
            assert!(text.contains(kept), "{kept:?} missing from:\n{text}");
        }
    }
}
