//! OpenTelemetry export from the real fake-driver sidecar: one OTLP/gRPC span per RPC, parented on
//! the caller's W3C `traceparent`, received by an in-process OTLP trace collector.

use std::time::Duration;

use driver_sdk::proto as pb;
use e2e_tests::{eventually, Driver};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use tokio::sync::mpsc;

/// The batch span processor exports every 100 ms instead of every 5 s.
const FAST_EXPORT: (&str, &str) = ("OTEL_BSP_SCHEDULE_DELAY", "100");

/// A span as received, with the `service.name` of the resource that sent it.
#[derive(Debug, Clone)]
struct Received {
    service: Option<String>,
    span: Span,
}

/// An OTLP trace collector: every exported span goes into a channel.
struct Collector {
    tx: mpsc::UnboundedSender<Received>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        for rs in request.into_inner().resource_spans {
            let service = rs.resource.as_ref().and_then(|r| attr(&r.attributes, "service.name"));
            for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                let _ = self.tx.send(Received { service: service.clone(), span });
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

/// Starts the collector on 127.0.0.1:0; returns its port and the span channel. The server stops
/// when the test's runtime does.
async fn start_collector() -> (u16, mpsc::UnboundedReceiver<Received>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind collector");
    let port = listener.local_addr().expect("collector addr").port();
    let (tx, rx) = mpsc::unbounded_channel();
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(Collector { tx }))
            .serve_with_incoming(incoming),
    );
    (port, rx)
}

/// A string attribute's value.
fn attr(attrs: &[KeyValue], key: &str) -> Option<String> {
    attrs.iter().find(|kv| kv.key == key).and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
        AnyValue::StringValue(s) => Some(s.clone()),
        _ => None,
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn rpc_spans_are_exported_over_otlp_with_the_callers_trace_as_parent() {
    let (port, mut spans) = start_collector().await;
    let endpoint = format!("http://127.0.0.1:{port}");
    let sidecar =
        Driver::fake(&[]).env([("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()), FAST_EXPORT]).start().await;

    // A caller's trace context: fresh random IDs, so no other span can match by accident.
    let trace_id = uuid::Uuid::new_v4().as_bytes().to_vec();
    let parent_span_id = uuid::Uuid::new_v4().as_bytes()[..8].to_vec();
    let traceparent = format!("00-{}-{}-01", hex(&trace_id), hex(&parent_span_id));

    let mut identity = pb::identity_client::IdentityClient::new(sidecar.client().await.channel());
    let mut req = tonic::Request::new(pb::GetDriverInfoRequest {});
    req.metadata_mut().insert("traceparent", traceparent.parse().expect("traceparent metadata"));
    req.metadata_mut().insert("x-request-id", "otel-test-1".parse().expect("request id metadata"));
    req.set_timeout(Duration::from_secs(10));
    let resp = tokio::time::timeout(Duration::from_secs(15), identity.get_driver_info(req))
        .await
        .expect("GetDriverInfo answered in time")
        .expect("GetDriverInfo");
    assert_eq!(resp.metadata().get("x-request-id").and_then(|v| v.to_str().ok()), Some("otel-test-1"));

    // The batch exporter sends the call's span within a few schedule delays. It is found by its
    // request ID, so a span in the wrong trace fails on the trace ID below, not as a timeout.
    let mut received: Vec<Received> = Vec::new();
    let span = eventually(Duration::from_secs(20), "the GetDriverInfo span at the collector", || {
        while let Ok(r) = spans.try_recv() {
            received.push(r);
        }
        let found =
            received.iter().find(|r| attr(&r.span.attributes, "request.id").as_deref() == Some("otel-test-1")).cloned();
        async move { found }
    })
    .await;
    assert_eq!(hex(&span.span.trace_id), hex(&trace_id), "the span is in the caller's trace: {span:?}");
    assert_eq!(hex(&span.span.parent_span_id), hex(&parent_span_id), "the caller's span is the parent: {span:?}");
    assert_eq!(attr(&span.span.attributes, "request.id").as_deref(), Some("otel-test-1"), "{span:?}");
    // The semantic conventions of gRPC server spans (docs: Observability).
    let method = "machinedriver.v1.Identity/GetDriverInfo";
    assert_eq!(attr(&span.span.attributes, "rpc.method").as_deref(), Some(method), "{span:?}");
    assert_eq!(span.span.name, method);
    assert_eq!(span.span.kind, opentelemetry_proto::tonic::trace::v1::span::SpanKind::Server as i32);
    assert_eq!(attr(&span.span.attributes, "rpc.system.name").as_deref(), Some("grpc"));
    assert_eq!(attr(&span.span.attributes, "rpc.response.status_code").as_deref(), Some("OK"));
    let socket = sidecar.socket.to_string_lossy().into_owned();
    assert_eq!(attr(&span.span.attributes, "server.address").as_deref(), Some(socket.as_str()), "{span:?}");
    assert!(attr(&span.span.attributes, "error.type").is_none());
    assert_eq!(span.service.as_deref(), Some("fake-driver"), "resource service.name");
    assert!(span.span.end_time_unix_nano >= span.span.start_time_unix_nano && span.span.start_time_unix_nano > 0);

    // SIGTERM flushes what is left; then every span the sidecar made has arrived (the exporter's
    // shutdown waits for the collector's answer). The one call made exactly one span in the
    // caller's trace, and the readiness Probes got spans (new traces) of their own.
    let (status, _dir) = sidecar.terminate().await;
    assert!(status.success(), "exit status after SIGTERM: {status}");
    while let Ok(r) = spans.try_recv() {
        received.push(r);
    }
    let is_ours = |r: &Received| r.span.trace_id == trace_id;
    let ours: Vec<_> = received.iter().filter(|r| is_ours(r)).collect();
    assert_eq!(ours.len(), 1, "exactly one span in the caller's trace: {ours:?}");
    let methods: Vec<_> = received.iter().filter_map(|r| attr(&r.span.attributes, "rpc.method")).collect();
    assert_eq!(methods.iter().filter(|m| *m == method).count(), 1, "{methods:?}");
    assert!(methods.iter().any(|m| m == "machinedriver.v1.Identity/Probe"), "{methods:?}");
    for r in received.iter().filter(|r| !is_ours(r)) {
        assert!(r.span.parent_span_id.is_empty(), "an un-traced call is a root span: {r:?}");
    }
}

#[tokio::test]
async fn export_failures_do_not_stop_serving() {
    // Nothing listens there: every export fails. The port stays the test's own (bound, never
    // listening) until the end, so no other process can answer on it.
    let reserved = tokio::net::TcpSocket::new_v4().expect("socket");
    reserved.bind(([127, 0, 0, 1], 0).into()).expect("bind");
    let endpoint = format!("http://{}", reserved.local_addr().expect("addr"));
    let sidecar =
        Driver::fake(&[]).env([("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()), FAST_EXPORT]).start().await;
    let client = sidecar.client().await;
    client.get_driver_info(pb::GetDriverInfoRequest {}).await.expect("GetDriverInfo");

    // The exporter has tried and failed (the SDK logs it through the sidecar's subscriber) ...
    eventually(Duration::from_secs(30), "a failed export in the sidecar log", || {
        let failed = sidecar.log_text().contains("BatchSpanProcessor.ExportError");
        async move { failed.then_some(()) }
    })
    .await;
    // ... and the sidecar still answers, promptly.
    for _ in 0..5 {
        let reply = tokio::time::timeout(Duration::from_secs(5), client.get_driver_info(pb::GetDriverInfoRequest {}))
            .await
            .expect("GetDriverInfo answered in time after export failures")
            .expect("GetDriverInfo after export failures");
        assert!(!reply.value.name.is_empty());
    }
    client.probe(pb::ProbeRequest {}).await.expect("Probe after export failures");

    // Shutdown still ends cleanly, whatever the unflushed spans do.
    let (status, _dir) = sidecar.terminate().await;
    assert!(status.success(), "exit status after SIGTERM: {status}");
}
