//! The tower layer every RPC passes through: request ID (read or generated, echoed), one span
//! per call (with the caller's W3C trace context), the call's deadline, and metrics.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use http::{HeaderValue, Request, Response};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::connection::{connection_data, Connection};
use crate::context::RequestContext;
use crate::metrics::RpcMetrics;
use crate::telemetry::{trace_id_of, HeaderExtractor};
use crate::types::code_name as code_label;

pub use crate::types::REQUEST_ID_HEADER;
const MAX_REQUEST_ID_LEN: usize = 128;

/// Adds request IDs, spans, deadlines and metrics to every call.
#[derive(Clone)]
pub(crate) struct RpcLayer {
    shared: Arc<LayerShared>,
}

struct LayerShared {
    metrics: RpcMetrics,
    /// The driver's name: the domain of the errors this layer makes.
    domain: String,
    /// The services served (`machinedriver.v1.Machines`, …): their methods get their own metric
    /// labels, anything else is `other`.
    services: Vec<String>,
    /// The endpoint served (`unix:///…` or `host:port`): the spans' `server.address`.
    endpoint: String,
}

impl RpcLayer {
    pub(crate) fn new(metrics: RpcMetrics, domain: String, services: Vec<String>, endpoint: String) -> Self {
        Self { shared: Arc::new(LayerShared { metrics, domain, services, endpoint }) }
    }
}

impl<S> tower::Layer<S> for RpcLayer {
    type Service = RpcService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RpcService { inner, shared: self.shared.clone() }
    }
}

#[derive(Clone)]
pub(crate) struct RpcService<S> {
    inner: S,
    shared: Arc<LayerShared>,
}

/// A request ID the caller sent, if it is usable: printable ASCII, at most 128 characters.
fn caller_request_id(v: &HeaderValue) -> Option<String> {
    let s = v.to_str().ok()?;
    (!s.is_empty() && s.len() <= MAX_REQUEST_ID_LEN && s.bytes().all(|b| b.is_ascii_graphic())).then(|| s.to_string())
}

/// `grpc-timeout` (e.g. `500m`, `3S`) as a duration.
fn grpc_timeout(v: &HeaderValue) -> Option<Duration> {
    let s = v.to_str().ok()?;
    let (num, unit) = s.split_at(s.len().checked_sub(1)?);
    let n: u64 = num.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The RPC's method name for labels: the method of a served service, `other` for any other path
/// (keeps metric cardinality bounded).
fn method_label<'a>(path: &'a str, services: &[String]) -> &'a str {
    match path.strip_prefix('/').and_then(|p| p.split_once('/')) {
        Some((service, method)) if !method.is_empty() && services.iter().any(|s| s == service) => method,
        _ => "other",
    }
}

/// How much earlier than the caller's deadline a call is stopped.
const DEADLINE_MARGIN: Duration = Duration::from_millis(1);

/// A call's bookkeeping — the metrics and the "rpc finished" line — done exactly once, also when
/// the call is dropped before it finishes (the caller cancelled, or its deadline passed).
struct CallRecord {
    shared: Arc<LayerShared>,
    method: String,
    started: Instant,
    quiet: bool,
    /// The call's code once it finished; a call dropped before that is CANCELLED.
    code: Option<tonic::Code>,
    span: tracing::Span,
}

impl Drop for CallRecord {
    fn drop(&mut self) {
        let code = self.code.unwrap_or(tonic::Code::Cancelled);
        let elapsed = self.started.elapsed();
        self.shared.metrics.finished(&self.method, code_label(code), elapsed);
        machine_driver_util::telemetry::rpc::finish(&self.span, code_label(code));
        let _in = self.span.enter();
        if self.quiet {
            tracing::debug!("rpc.code" = ?code, "duration_ms" = elapsed.as_secs_f64() * 1e3, "rpc finished");
        } else {
            tracing::info!("rpc.code" = ?code, "duration_ms" = elapsed.as_secs_f64() * 1e3, "rpc finished");
        }
    }
}

/// The answer to a call whose `grpc-timeout` passed: DEADLINE_EXCEEDED with the usual details.
fn deadline_exceeded<RB: Default>(domain: &str, request_id: &str, timeout: Duration) -> Response<RB> {
    let err = crate::error::DriverError::new(
        tonic::Code::DeadlineExceeded,
        crate::error::reason::DEADLINE_EXCEEDED,
        format!(
            "the caller's deadline ({} ms, from grpc-timeout) passed before the driver answered",
            timeout.as_millis()
        ),
    );
    err.to_status(domain, request_id, None).into_http()
}

impl<S, B, RB> tower::Service<Request<B>> for RpcService<S>
where
    S: tower::Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Send + 'static,
    RB: Default + Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let started = Instant::now();
        let headers = req.headers();
        let request_id = headers
            .get(REQUEST_ID_HEADER)
            .and_then(caller_request_id)
            .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
        let timeout = headers.get("grpc-timeout").and_then(grpc_timeout);
        let deadline = timeout.map(|d| started + d);
        let trace_id =
            headers.get("traceparent").and_then(|v| v.to_str().ok()).and_then(trace_id_of).map(str::to_string);
        let path = req.uri().path().to_string();
        let method = method_label(&path, &self.shared.services).to_string();
        // The span's name and `rpc.method` in the semantic conventions: `package.Service/Method`
        // of a served method, `_OTHER` for any other path (unbounded names stay out of spans).
        let full_method = if method == "other" { "_OTHER" } else { path.trim_start_matches('/') };
        let quiet = path.starts_with("/grpc.");
        let span = if quiet {
            tracing::debug_span!(
                "rpc",
                "otel.name" = %full_method,
                "otel.kind" = "server",
                "rpc.method" = %full_method,
                "request.id" = %request_id,
            )
        } else {
            let span = tracing::info_span!(
                "rpc",
                "otel.name" = %full_method,
                "otel.kind" = "server",
                "rpc.method" = %full_method,
                "request.id" = %request_id,
                "trace.id" = tracing::field::Empty,
            );
            if let Some(id) = &trace_id {
                span.record("trace.id", id.as_str());
            }
            span
        };
        machine_driver_util::telemetry::rpc::start(&span, &self.shared.endpoint);
        if trace_id.is_some() {
            let parent = opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(req.headers())));
            let _ = span.set_parent(parent);
        }
        let connection = connection_data(&req).map(Connection);
        req.extensions_mut().insert(RequestContext {
            request_id: request_id.clone(),
            method: method.clone(),
            deadline,
            trace_id,
            connection,
        });

        // The service that was polled ready is the one that must be called.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        shared.metrics.started();
        let mut record = CallRecord { shared, method, started, quiet, code: None, span: span.clone() };
        Box::pin(
            async move {
                let call = inner.call(req);
                // Every RPC stops at the caller's deadline, answered with DEADLINE_EXCEEDED and
                // the usual details. tonic's own grpc-timeout layer, outside this one, would stop
                // it too but answer CANCELLED without details; stopping a millisecond early keeps
                // this answer first (that layer polls the call before its own timer).
                let mut result = match deadline {
                    Some(d) => match tokio::time::timeout_at((d - DEADLINE_MARGIN.min(d - started)).into(), call).await
                    {
                        Ok(r) => r,
                        Err(_) => {
                            Ok(deadline_exceeded(&record.shared.domain, &request_id, timeout.unwrap_or_default()))
                        }
                    },
                    None => call.await,
                };
                let code = match &mut result {
                    Ok(resp) => {
                        if let Ok(v) = HeaderValue::from_str(&request_id) {
                            resp.headers_mut().insert(REQUEST_ID_HEADER, v);
                        }
                        // Errors are sent trailers-only, so their status is in the headers.
                        resp.headers()
                            .get("grpc-status")
                            .and_then(|v| v.to_str().ok())
                            .and_then(|v| v.parse::<i32>().ok())
                            .map_or(tonic::Code::Ok, tonic::Code::from_i32)
                    }
                    Err(_) => tonic::Code::Unavailable,
                };
                record.code = Some(code);
                drop(record);
                result
            }
            .instrument(span),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_grpc_timeouts() {
        assert_eq!(grpc_timeout(&HeaderValue::from_static("500m")), Some(Duration::from_millis(500)));
        assert_eq!(grpc_timeout(&HeaderValue::from_static("3S")), Some(Duration::from_secs(3)));
        assert_eq!(grpc_timeout(&HeaderValue::from_static("x")), None);
        assert_eq!(grpc_timeout(&HeaderValue::from_static("")), None);
    }

    #[test]
    fn only_sane_request_ids_are_taken() {
        assert_eq!(caller_request_id(&HeaderValue::from_static("abc-1")), Some("abc-1".into()));
        assert_eq!(caller_request_id(&HeaderValue::from_static("has space")), None);
        assert_eq!(caller_request_id(&HeaderValue::from_str(&"a".repeat(129)).unwrap()), None);
    }

    #[test]
    fn method_labels_are_bounded() {
        let served = ["machinedriver.v1.Machines".to_string(), "grpc.health.v1.Health".to_string()];
        assert_eq!(method_label("/machinedriver.v1.Machines/CreateMachine", &served), "CreateMachine");
        assert_eq!(method_label("/grpc.health.v1.Health/Check", &served), "Check");
        assert_eq!(method_label("/evil.Service/Random123", &served), "other");
        assert_eq!(method_label("/machinedriver.v1.Machines", &served), "other");
        assert_eq!(method_label("/machinedriver.v1.MachinesX/Create", &served), "other");
    }
}
