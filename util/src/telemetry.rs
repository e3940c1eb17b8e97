//! Logging and tracing setup: `tracing` to stderr (text or JSON), plus OpenTelemetry OTLP export
//! when `OTEL_EXPORTER_OTLP_ENDPOINT` is set. W3C trace context is propagated either way.
//!
//! [`rpc`] gives the spans of gRPC calls, on both sides, the attributes of the OpenTelemetry
//! semantic conventions for RPC ([`rpc::SEMCONV_VERSION`]).

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
            .fmt_fields(WithoutOtelFields)
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

/// Text log fields as `tracing_subscriber` writes them by default, without the `otel.*` fields
/// (the exported span's name and kind: the span's other fields already say the same).
struct WithoutOtelFields;

impl<'w> tracing_subscriber::fmt::FormatFields<'w> for WithoutOtelFields {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(
        &self,
        writer: tracing_subscriber::fmt::format::Writer<'w>,
        fields: R,
    ) -> std::fmt::Result {
        let mut visitor = SkipOtel(tracing_subscriber::fmt::format::DefaultVisitor::new(writer, true));
        fields.record(&mut visitor);
        tracing_subscriber::field::VisitOutput::finish(visitor.0)
    }
}

struct SkipOtel<'w>(tracing_subscriber::fmt::format::DefaultVisitor<'w>);

impl tracing::field::Visit for SkipOtel<'_> {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if !field.name().starts_with("otel.") {
            self.0.record_str(field, value);
        }
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if !field.name().starts_with("otel.") {
            self.0.record_debug(field, value);
        }
    }
}

/// The OpenTelemetry semantic conventions of gRPC spans, as both ends of a driver call set them.
///
/// A span made for a call declares `"otel.name"` (the fully qualified method, the span's name in
/// the conventions) and `"otel.kind"` (`"client"` or `"server"`) among its fields, and
/// `"rpc.method"` for the logs; [`rpc::start`] and [`rpc::finish`] set the rest as attributes of
/// the exported span only, so log lines stay short.
pub mod rpc {
    use opentelemetry::trace::Status;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    /// The version of the semantic conventions these attributes follow: RPC spans are a release
    /// candidate there (`rpc.system.name`, the fully qualified `rpc.method`, the string
    /// `rpc.response.status_code`).
    pub const SEMCONV_VERSION: &str = "1.40.0";

    /// `server.address` and `server.port` of an endpoint: a Unix socket's path (no port), or a
    /// TCP endpoint's host and port (`unix:///run/x.sock`, `unix:/run/x.sock`, `/run/x.sock`,
    /// `http://host:50051`, `host:50051`).
    pub fn server_address(endpoint: &str) -> (String, Option<i64>) {
        if let Some(path) = endpoint.strip_prefix("unix://").or_else(|| endpoint.strip_prefix("unix:")) {
            return (path.to_string(), None);
        }
        if endpoint.starts_with('/') {
            return (endpoint.to_string(), None);
        }
        let rest = endpoint.split_once("://").map_or(endpoint, |(_, rest)| rest);
        let rest = rest.trim_end_matches('/');
        match rest.rsplit_once(':') {
            Some((host, port)) => match port.parse::<i64>() {
                Ok(port) => (host.trim_start_matches('[').trim_end_matches(']').to_string(), Some(port)),
                Err(_) => (rest.to_string(), None),
            },
            None => (rest.to_string(), None),
        }
    }

    /// The attributes known when a call starts, besides the span's own `rpc.method` field:
    /// `rpc.system.name`, `server.address` (and `server.port` on TCP).
    pub fn start(span: &tracing::Span, endpoint: &str) {
        span.set_attribute("rpc.system.name", "grpc");
        let (address, port) = server_address(endpoint);
        span.set_attribute("server.address", address);
        if let Some(port) = port {
            span.set_attribute("server.port", port);
        }
    }

    /// The call's outcome: `rpc.response.status_code` (`"OK"`, `"NOT_FOUND"`, …), and for any
    /// other code than OK `error.type` (the same code) and the span's status Error.
    pub fn finish(span: &tracing::Span, code: &'static str) {
        span.set_attribute("rpc.response.status_code", code);
        if code != "OK" {
            span.set_attribute("error.type", code);
            span.set_status(Status::error(code));
        }
    }
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

    #[test]
    fn server_addresses_of_endpoints() {
        use super::rpc::server_address;
        assert_eq!(
            server_address("unix:///run/machine-driver/driver.sock"),
            ("/run/machine-driver/driver.sock".into(), None)
        );
        assert_eq!(server_address("unix:/tmp/d.sock"), ("/tmp/d.sock".into(), None));
        assert_eq!(server_address("/tmp/d.sock"), ("/tmp/d.sock".into(), None));
        assert_eq!(server_address("http://127.0.0.1:50051"), ("127.0.0.1".into(), Some(50051)));
        assert_eq!(server_address("https://[::1]:443/"), ("::1".into(), Some(443)));
        assert_eq!(server_address("driver.local:7000"), ("driver.local".into(), Some(7000)));
        assert_eq!(server_address("http://driver.local"), ("driver.local".into(), None));
    }

    /// Text logs leave out the `otel.*` fields (the exported span's name and kind).
    #[test]
    fn text_logs_leave_out_otel_fields() {
        let out = Captured::default();
        let writer = out.clone();
        let subscriber = tracing_subscriber::registry().with(
            tracing_subscriber::fmt::layer()
                .fmt_fields(super::WithoutOtelFields)
                .with_ansi(false)
                .with_writer(move || writer.clone()),
        );
        tracing::subscriber::with_default(subscriber, || {
            let span =
                tracing::info_span!("rpc", "otel.name" = "pkg.S/M", "otel.kind" = "server", "rpc.method" = "pkg.S/M");
            let _in = span.enter();
            tracing::info!(answer = 42, "rpc finished");
        });
        let text = String::from_utf8(crate::lock(&out.0).clone()).unwrap_or_default();
        assert!(text.contains("rpc{rpc.method=\"pkg.S/M\"}") && text.contains("rpc finished answer=42"), "{text}");
        assert!(!text.contains("otel."), "{text}");
    }

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
