//! Prometheus metrics as text, and a small HTTP server that exposes them with liveness and
//! readiness: what the controller and every sidecar serve on their `--metrics-addr`.

use std::net::SocketAddr;
use std::sync::Arc;

use prometheus_client::registry::Registry;

/// The metrics as Prometheus text.
pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}

/// A readiness source for `/readyz`.
pub type ReadyFn = Arc<dyn Fn() -> bool + Send + Sync>;

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener` until `shutdown` resolves.
pub async fn serve_http(
    listener: tokio::net::TcpListener,
    registry: Arc<Registry>,
    ready: ReadyFn,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::http::{header, StatusCode};
    use axum::routing::get;
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let registry = registry.clone();
                async move {
                    (
                        [(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
                        encode(&registry),
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(move || {
                let ready = ready.clone();
                async move {
                    if ready() {
                        (StatusCode::OK, "ready\n")
                    } else {
                        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
                    }
                }
            }),
        );
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}

/// Binds the metrics listener (so a bad address fails at startup, not later).
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}
