//! `serve`: runs a [`Driver`] as a gRPC sidecar.
//!
//! - Endpoint from `--endpoint` / `DRIVER_ENDPOINT`: `unix:///path.sock` (default; created with
//!   mode 0660, a stale socket is removed, a live one is an error) or `tcp://host:port`, with
//!   optional TLS / mTLS.
//! - `grpc.health.v1` (NOT_SERVING until Probe says ready, and again while draining) and server
//!   reflection (v1 and v1alpha, so grpcurl 1.8 works) are always on.
//! - Request IDs, spans, metrics ([`crate::layer`]); message-size and concurrency limits.
//! - SIGTERM / SIGINT: stop accepting, drain in-flight calls (bounded), remove the socket, exit.
//!
//! [`DriverServer::serve`] wires together [`routes`] (what is answered), [`listeners`] (where)
//! and [`shutdown`] (when to stop).

mod error;
mod listeners;
mod routes;
mod shutdown;
#[cfg(test)]
mod tests;

use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use prometheus_client::registry::Registry;
use tonic::server::NamedService;
use tonic::service::RoutesBuilder;

pub use self::error::ServeError;
use self::routes::RouteFn;
use crate::connection::{BoxedConnection, ConnectionData, ConnectionHook};
use crate::driver::Driver;
use crate::endpoint::Endpoint;
use crate::layer::RpcLayer;
use crate::metrics::RpcMetrics;
use crate::service::DriverService;
use crate::telemetry::LogFormat;
use crate::token::TokenKey;

/// The endpoint used when neither `--endpoint` nor `DRIVER_ENDPOINT` is given.
pub const DEFAULT_ENDPOINT: &str = "unix:///run/machine-driver/driver.sock";
/// `--max-message-bytes`: gRPC's own default receive limit (4 MiB), which every stack's client
/// already stays within.
pub(crate) const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
/// `--max-concurrent-calls`: far above what a controller keeps in flight (one call per
/// worker), low enough that a flood of calls queues instead of all reaching the cloud at once.
pub(crate) const DEFAULT_MAX_CONCURRENT_CALLS: usize = 256;
/// `--drain-timeout`: Kubernetes' default `terminationGracePeriodSeconds`, after which the pod
/// is killed anyway.
pub(crate) const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// `--probe-interval`: half the kubelet's default probe period (10 s), so a readiness probe never
/// reads a status older than one period.
pub(crate) const DEFAULT_PROBE_INTERVAL: Duration = Duration::from_secs(5);
/// `--token-key-reload-interval`: small next to the kubelet's own delay in updating a Secret
/// volume (up to a minute), for one small file read.
pub(crate) const DEFAULT_TOKEN_KEY_RELOAD_INTERVAL: Duration = Duration::from_secs(5);
/// The shortest key reload interval honoured, so `--token-key-reload-interval 0` cannot spin.
const MIN_TOKEN_KEY_RELOAD_INTERVAL: Duration = Duration::from_millis(100);
/// How often the server pings an idle client connection, to notice a dead peer (HTTP/2 PING).
const HTTP2_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// How long a keepalive ping may go unanswered before the connection is closed.
const HTTP2_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Command-line / environment configuration of a driver sidecar. Flatten it into your CLI:
/// `#[command(flatten)] serve: ServeArgs`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Where to listen: unix:///path.sock or tcp://host:port.
    #[arg(long, env = "DRIVER_ENDPOINT", default_value = DEFAULT_ENDPOINT)]
    pub endpoint: String,
    /// Serve Prometheus /metrics, /healthz and /readyz on this address (e.g. 127.0.0.1:9464).
    #[arg(long, env = "DRIVER_METRICS_ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// File holding the operation-token HMAC key (else $DRIVER_TOKEN_KEY_FILE / $DRIVER_TOKEN_KEY).
    #[arg(long, env = "DRIVER_TOKEN_KEY_FILE")]
    pub token_key_file: Option<PathBuf>,
    /// Development mode: use a well-known token key when none is configured.
    #[arg(long, env = "DRIVER_DEV_MODE")]
    pub dev: bool,
    /// PEM certificate chain: serve TLS on a tcp:// endpoint.
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for --tls-cert.
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA bundle: require client certificates signed by it (mTLS).
    #[arg(long, requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// Largest request message accepted, in bytes.
    #[arg(long, default_value_t = DEFAULT_MAX_MESSAGE_BYTES)]
    pub max_message_bytes: usize,
    /// Most calls served at once (more wait their turn).
    #[arg(long, default_value_t = DEFAULT_MAX_CONCURRENT_CALLS)]
    pub max_concurrent_calls: usize,
    /// How long in-flight calls may take to finish after SIGTERM.
    // Durations have no `Display` for `default_value_t`: the test `cli_defaults_are_the_constants`
    // pins these strings to the constants.
    #[arg(long, default_value = "30s", value_parser = crate::parse_duration)]
    pub drain_timeout: Duration,
    /// How often the driver's Probe drives the health service.
    #[arg(long, default_value = "5s", value_parser = crate::parse_duration)]
    pub probe_interval: Duration,
    /// How often the token key file is checked for new keys (a rotated Secret takes effect
    /// without a restart).
    #[arg(long, default_value = "5s", value_parser = crate::parse_duration)]
    pub token_key_reload_interval: Duration,
    /// How log lines on stderr look (`RUST_LOG` sets the filter, default `info`).
    #[arg(long, env = "DRIVER_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

impl Default for ServeArgs {
    fn default() -> Self {
        Self {
            endpoint: DEFAULT_ENDPOINT.to_string(),
            metrics_addr: None,
            token_key_file: None,
            dev: false,
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            max_concurrent_calls: DEFAULT_MAX_CONCURRENT_CALLS,
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
            probe_interval: DEFAULT_PROBE_INTERVAL,
            token_key_reload_interval: DEFAULT_TOKEN_KEY_RELOAD_INTERVAL,
            log_format: LogFormat::Text,
        }
    }
}

/// A driver sidecar server. See the [crate docs](crate) for an example.
pub struct DriverServer<D> {
    driver: Arc<D>,
    routes: Vec<RouteFn>,
    /// The names of the services added with `add_service`.
    extra_services: Vec<String>,
    descriptor_sets: Vec<&'static [u8]>,
    registry: Registry,
    shutdown: Option<BoxFuture<'static, ()>>,
    key: Option<TokenKey>,
    connection_hook: Option<ConnectionHook>,
}

impl<D: Driver> DriverServer<D> {
    /// A server for `driver`.
    pub fn new(driver: impl Into<Arc<D>>) -> Self {
        Self {
            driver: driver.into(),
            routes: Vec::new(),
            extra_services: Vec::new(),
            descriptor_sets: Vec::new(),
            registry: Registry::default(),
            shutdown: None,
            key: None,
            connection_hook: None,
        }
    }

    /// Serves an extra gRPC service beside the protocol (e.g. a fake cloud's inspection API). It
    /// gets the same request-ID, tracing and metrics layer.
    #[must_use]
    pub fn add_service<S>(mut self, svc: S) -> Self
    where
        S: tower::Service<
                http::Request<tonic::body::Body>,
                Error = Infallible,
                Response = http::Response<tonic::body::Body>,
            > + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Future: Send + 'static,
    {
        self.extra_services.push(S::NAME.to_string());
        self.routes.push(Box::new(move |b: &mut RoutesBuilder| {
            b.add_service(svc);
        }));
        self
    }

    /// Makes an extra encoded `FileDescriptorSet` visible through reflection.
    #[must_use]
    pub fn register_descriptor_set(mut self, fds: &'static [u8]) -> Self {
        self.descriptor_sets.push(fds);
        self
    }

    /// The metrics registry, to add driver metrics before serving.
    pub fn registry_mut(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// Stops the server when `signal` resolves (in addition to SIGTERM / SIGINT).
    #[must_use]
    pub fn with_shutdown(mut self, signal: impl std::future::Future<Output = ()> + Send + 'static) -> Self {
        self.shutdown = Some(signal.boxed());
        self
    }

    /// Wraps every accepted connection (Unix or TCP, under TLS) with `hook`, which returns the
    /// IO to serve and data that each call on the connection reads with
    /// [`RequestContext::connection`](crate::RequestContext::connection). The fake driver uses it
    /// to cut a connection from inside a call; drivers that need nothing like it pay nothing.
    #[must_use]
    pub fn with_connection_hook(
        mut self,
        hook: impl Fn(BoxedConnection) -> (BoxedConnection, ConnectionData) + Send + Sync + 'static,
    ) -> Self {
        self.connection_hook = Some(Arc::new(hook));
        self
    }

    /// Uses this token key instead of loading one from the arguments.
    #[must_use]
    pub fn with_token_key(mut self, key: TokenKey) -> Self {
        self.key = Some(key);
        self
    }

    /// Serves until SIGTERM / SIGINT (or the [`with_shutdown`](Self::with_shutdown) signal),
    /// then drains.
    ///
    /// # Errors
    /// Startup problems (endpoint, key, socket in use, TLS, bind) and transport failures.
    pub async fn serve(self, args: &ServeArgs) -> Result<(), ServeError> {
        let endpoint: Endpoint = args.endpoint.parse()?;
        // Keys given in code stay; keys from a file follow the file.
        let key_file = if self.key.is_none() { TokenKey::file(args.token_key_file.as_deref()) } else { None };
        let key = match self.key {
            Some(k) => k,
            None => TokenKey::load(args.token_key_file.as_deref(), args.dev)?,
        };
        if key.is_dev() {
            tracing::warn!("using the development token key: operation tokens are not protected against forgery");
        }
        let mut registry = self.registry;
        let metrics = RpcMetrics::register(&mut registry);
        let service = DriverService::new(self.driver.clone(), key).map_err(ServeError::ProviderSpecSchema)?;
        let driver_name = service.shared().info.name.clone();
        let key_reloader = key_file.map(|path| {
            tokio::spawn(reload_keys(path, service.shared().codec.clone(), args.token_key_reload_interval))
        });
        let dns = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '.';
        if driver_name.is_empty() || driver_name.len() > 63 || !driver_name.chars().all(dns) {
            return Err(ServeError::DriverName(driver_name));
        }

        let routes::Routes { routes, served, health } =
            routes::build(&service, &self.descriptor_sets, self.routes, self.extra_services, args.max_message_bytes)
                .await?;
        let prober = tokio::spawn(health.clone().probe_loop(self.driver.clone(), args.probe_interval));

        let layers = tower::ServiceBuilder::new()
            .layer(RpcLayer::new(metrics, driver_name.clone(), served, args.endpoint.clone()))
            .layer(tower::limit::GlobalConcurrencyLimitLayer::new(args.max_concurrent_calls.max(1)));
        let mut server = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(HTTP2_KEEPALIVE_INTERVAL))
            .http2_keepalive_timeout(Some(HTTP2_KEEPALIVE_TIMEOUT));
        if let (Some(cert), Some(key_file)) = (&args.tls_cert, &args.tls_key) {
            if matches!(endpoint, Endpoint::Unix(_)) {
                return Err(ServeError::TlsOnUnix);
            }
            server = server
                .tls_config(listeners::tls_config(cert, key_file, args.tls_client_ca.as_deref())?)
                .map_err(|e| ServeError::Tls(Box::new(e)))?;
        }
        let router = server.layer(layers).add_routes(routes.routes());

        // Shutdown: a signal or the caller's future; then drain, bounded.
        let (signal, stopped) = shutdown::signal(self.shutdown, health.clone());
        // Event streams never end by themselves: end them when the drain starts, so the drain
        // waits for calls, not for watchers.
        let events = service.shared().events.clone();
        let closer = stopped.clone();
        tokio::spawn(async move {
            closer.wait().await;
            events.close();
        });

        let metrics_task = match args.metrics_addr {
            Some(addr) => {
                let listener = crate::metrics::bind(addr)
                    .await
                    .map_err(|source| ServeError::Bind { endpoint: format!("http://{addr}"), source })?;
                tracing::info!(
                    "metrics on http://{}/metrics",
                    listener.local_addr().map(|a| a.to_string()).unwrap_or_default()
                );
                let health = health.clone();
                Some(tokio::spawn(crate::metrics::serve_http(
                    listener,
                    Arc::new(registry),
                    Arc::new(move || health.is_ready()),
                    stopped.clone().wait(),
                )))
            }
            None => None,
        };

        let hook = self.connection_hook;
        let result = match &endpoint {
            Endpoint::Unix(path) => {
                let incoming = listeners::unix(path, hook, &driver_name)?;
                let served = router.serve_with_incoming_shutdown(incoming, signal);
                let r = stopped.drain_bounded(served, args.drain_timeout).await;
                let _ = std::fs::remove_file(path);
                r
            }
            Endpoint::Tcp(addr) => {
                let incoming = listeners::tcp(addr, hook, &driver_name).await?;
                let served = router.serve_with_incoming_shutdown(incoming, signal);
                stopped.drain_bounded(served, args.drain_timeout).await
            }
        };
        prober.abort();
        if let Some(t) = key_reloader {
            t.abort();
        }
        if let Some(t) = metrics_task {
            let _ = t.await;
        }
        tracing::info!("stopped");
        result
    }
}

/// Re-reads the token key file every `interval` and swaps the keys in when its content changed,
/// so that a rotated key (e.g. an updated Secret volume) takes effect without a restart. A file
/// that is unreadable or holds no valid key keeps the current keys.
async fn reload_keys(path: PathBuf, codec: crate::token::TokenCodec, interval: Duration) {
    let mut last = tokio::fs::read(&path).await.ok();
    let mut tick = tokio::time::interval(interval.max(MIN_TOKEN_KEY_RELOAD_INTERVAL));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Ok(now) = tokio::fs::read(&path).await else { continue };
        if last.as_ref() == Some(&now) {
            continue;
        }
        match TokenKey::parse_file(&now, &path) {
            Ok(key) => {
                tracing::info!(keys = key.len(), "reloaded the operation token keys from {}", path.display());
                codec.replace_key(key);
            }
            Err(e) => tracing::warn!("keeping the current operation token keys: {e}"),
        }
        last = Some(now);
    }
}
