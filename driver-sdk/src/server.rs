//! `serve`: runs a [`Driver`] as a gRPC sidecar.
//!
//! - Endpoint from `--endpoint` / `DRIVER_ENDPOINT`: `unix:///path.sock` (default; created with
//!   mode 0660, a stale socket is removed, a live one is an error) or `tcp://host:port`, with
//!   optional TLS / mTLS.
//! - `grpc.health.v1` (NOT_SERVING until Probe says ready, and again while draining) and server
//!   reflection (v1 and v1alpha, so grpcurl 1.8 works) are always on.
//! - Request IDs, spans, metrics ([`crate::layer`]); message-size and concurrency limits.
//! - SIGTERM / SIGINT: stop accepting, drain in-flight calls (bounded), remove the socket, exit.

use std::convert::Infallible;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use machine_driver_proto::v1 as pb;
use prometheus_client::registry::Registry;
use tonic::server::NamedService;
use tonic::service::RoutesBuilder;
use tonic_health::ServingStatus;

use crate::connection::{BoxedConnection, Conn, ConnectionData, ConnectionHook};
use crate::context::RequestContext;
use crate::driver::Driver;
use crate::endpoint::{Endpoint, EndpointError};
use crate::layer::RpcLayer;
use crate::metrics::RpcMetrics;
use crate::service::DriverService;
use crate::telemetry::LogFormat;
use crate::token::{KeyError, TokenKey};

/// The endpoint used when neither `--endpoint` nor `DRIVER_ENDPOINT` is given.
pub const DEFAULT_ENDPOINT: &str = "unix:///run/machine-driver/driver.sock";

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
    #[arg(long, default_value_t = 4 * 1024 * 1024)]
    pub max_message_bytes: usize,
    /// Most calls served at once (more wait their turn).
    #[arg(long, default_value_t = 256)]
    pub max_concurrent_calls: usize,
    /// How long in-flight calls may take to finish after SIGTERM.
    #[arg(long, default_value = "30s", value_parser = crate::parse_duration)]
    pub drain_timeout: Duration,
    /// How often the driver's Probe drives the health service.
    #[arg(long, default_value = "5s", value_parser = crate::parse_duration)]
    pub probe_interval: Duration,
    /// How often the token key file is checked for new keys (a rotated Secret takes effect
    /// without a restart).
    #[arg(long, default_value = "5s", value_parser = crate::parse_duration)]
    pub token_key_reload_interval: Duration,
    /// Log format.
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
            max_message_bytes: 4 * 1024 * 1024,
            max_concurrent_calls: 256,
            drain_timeout: Duration::from_secs(30),
            probe_interval: Duration::from_secs(5),
            token_key_reload_interval: Duration::from_secs(5),
            log_format: LogFormat::Text,
        }
    }
}

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The endpoint string is malformed.
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    /// The token key is missing or unusable.
    #[error(transparent)]
    Key(#[from] KeyError),
    /// Another process serves on the socket.
    #[error("another process is already serving on {0}")]
    SocketInUse(PathBuf),
    /// A non-socket file is where the socket should go.
    #[error("{0} exists and is not a socket; refusing to remove it")]
    NotASocket(PathBuf),
    /// Binding or preparing the listener failed.
    #[error("listening on {endpoint}")]
    Bind {
        /// The endpoint.
        endpoint: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// TLS files could not be read or used.
    #[error("configuring TLS")]
    Tls(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The driver's provider-spec schema is not a valid JSON Schema draft 2020-12 schema or would
    /// be weaker than it reads (an unknown keyword, a reference outside it, …): see
    /// [`crate::schema`].
    #[error("the driver's provider_spec_schema is refused")]
    ProviderSpecSchema(#[source] crate::schema::SchemaError),
    /// The driver's name is not DNS-style or longer than 63 characters.
    #[error("driver name {0:?} must be 1 to 63 characters of letters, digits, '-' and '.'")]
    DriverName(String),
    /// TLS was asked for on a Unix socket.
    #[error("TLS is only supported on tcp:// endpoints")]
    TlsOnUnix,
    /// Building the reflection service failed.
    #[error("building the reflection service")]
    Reflection(#[source] tonic_reflection::server::Error),
    /// The gRPC server failed.
    #[error("serving gRPC")]
    Transport(#[source] tonic::transport::Error),
}

type RouteFn = Box<dyn FnOnce(&mut RoutesBuilder) + Send>;

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

        // Health: NOT_SERVING until the first successful ready probe.
        let (health, health_service) = tonic_health::server::health_reporter();
        let mut names: Vec<&str> = vec![""];
        names.extend(machine_driver_proto::SERVICE_NAMES);
        for n in &names {
            health.set_service_status(*n, ServingStatus::NotServing).await;
        }
        let ready = Arc::new(AtomicBool::new(false));
        let draining = Arc::new(AtomicBool::new(false));
        let prober = tokio::spawn(probe_loop(
            self.driver.clone(),
            health.clone(),
            names.iter().map(|s| s.to_string()).collect(),
            ready.clone(),
            draining.clone(),
            args.probe_interval,
        ));

        let reflection = |fds: &[&'static [u8]]| {
            let mut b = tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(machine_driver_proto::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
                // google.rpc.ErrorInfo & co., so grpcurl can print error details.
                .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET);
            for f in fds {
                b = b.register_encoded_file_descriptor_set(f);
            }
            b
        };
        let reflection_v1 = reflection(&self.descriptor_sets).build_v1().map_err(ServeError::Reflection)?;
        let reflection_v1alpha = reflection(&self.descriptor_sets).build_v1alpha().map_err(ServeError::Reflection)?;

        let limit = args.max_message_bytes;
        let mut routes = RoutesBuilder::default();
        routes
            .add_service(pb::identity_server::IdentityServer::new(service.clone()).max_decoding_message_size(limit))
            .add_service(pb::machines_server::MachinesServer::new(service.clone()).max_decoding_message_size(limit))
            .add_service(pb::pools_server::PoolsServer::new(service.clone()).max_decoding_message_size(limit))
            .add_service(pb::operations_server::OperationsServer::new(service.clone()).max_decoding_message_size(limit))
            .add_service(health_service)
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha);
        for add in self.routes {
            add(&mut routes);
        }

        let mut served: Vec<String> = names.iter().filter(|n| !n.is_empty()).map(|n| n.to_string()).collect();
        served.extend(
            [
                "grpc.health.v1.Health",
                "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection",
            ]
            .map(String::from),
        );
        served.extend(self.extra_services);
        let layers = tower::ServiceBuilder::new()
            .layer(RpcLayer::new(metrics, driver_name.clone(), served))
            .layer(tower::limit::GlobalConcurrencyLimitLayer::new(args.max_concurrent_calls.max(1)));
        let mut server = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(Duration::from_secs(30)))
            .http2_keepalive_timeout(Some(Duration::from_secs(10)));
        if let (Some(cert), Some(key_file)) = (&args.tls_cert, &args.tls_key) {
            if matches!(endpoint, Endpoint::Unix(_)) {
                return Err(ServeError::TlsOnUnix);
            }
            server = server
                .tls_config(tls_config(cert, key_file, args.tls_client_ca.as_deref())?)
                .map_err(|e| ServeError::Tls(Box::new(e)))?;
        }
        let router = server.layer(layers).add_routes(routes.routes());

        // Shutdown: a signal or the caller's future; then drain, bounded.
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let external = self.shutdown;
        let signal = {
            let health = health.clone();
            let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
            let draining = draining.clone();
            let ready = ready.clone();
            async move {
                let why = match external {
                    Some(f) => tokio::select! { w = os_signal() => w, () = f => "shutdown requested" },
                    None => os_signal().await,
                };
                tracing::info!("{why}: draining in-flight calls");
                draining.store(true, Ordering::SeqCst);
                // /readyz answers 503 while draining, like the health service.
                ready.store(false, Ordering::SeqCst);
                for n in &names {
                    health.set_service_status(n.as_str(), ServingStatus::NotServing).await;
                }
                let _ = stop_tx.send(true);
            }
        };

        let metrics_task = match args.metrics_addr {
            Some(addr) => {
                let listener = crate::metrics::bind(addr)
                    .await
                    .map_err(|source| ServeError::Bind { endpoint: format!("http://{addr}"), source })?;
                tracing::info!(
                    "metrics on http://{}/metrics",
                    listener.local_addr().map(|a| a.to_string()).unwrap_or_default()
                );
                let ready = ready.clone();
                let mut stop = stop_rx.clone();
                Some(tokio::spawn(crate::metrics::serve_http(
                    listener,
                    Arc::new(registry),
                    Arc::new(move || ready.load(Ordering::SeqCst)),
                    async move {
                        let _ = stop.wait_for(|s| *s).await;
                    },
                )))
            }
            None => None,
        };

        let mut stop = stop_rx.clone();
        let drain_timeout = args.drain_timeout;
        let drain_deadline = async move {
            let _ = stop.wait_for(|s| *s).await;
            tokio::time::sleep(drain_timeout).await;
        };

        let hook = self.connection_hook;
        let result = match &endpoint {
            Endpoint::Unix(path) => {
                let listener = bind_unix(path)?;
                tracing::info!(driver = %driver_name, "serving on {endpoint}");
                let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener)
                    .map(move |r| r.map(|s| Conn::new(crate::authority::AuthorityRewrite::new(s), hook.as_ref())));
                let served = router.serve_with_incoming_shutdown(incoming, signal);
                let r = tokio::select! { r = served => r.map_err(ServeError::Transport), () = drain_deadline => {
                    tracing::warn!("drain timeout passed; closing remaining calls");
                    Ok(())
                }};
                let _ = std::fs::remove_file(path);
                r
            }
            Endpoint::Tcp(addr) => {
                let listener = tokio::net::TcpListener::bind(addr.as_str())
                    .await
                    .map_err(|source| ServeError::Bind { endpoint: endpoint.to_string(), source })?;
                let local = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
                tracing::info!(driver = %driver_name, "serving on tcp://{local}");
                let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).map(|r| {
                    r.map(|s| {
                        let _ = s.set_nodelay(true);
                        Conn::new(s, hook.as_ref())
                    })
                });
                let served = router.serve_with_incoming_shutdown(incoming, signal);
                tokio::select! { r = served => r.map_err(ServeError::Transport), () = drain_deadline => {
                    tracing::warn!("drain timeout passed; closing remaining calls");
                    Ok(())
                }}
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
    let mut tick = tokio::time::interval(interval.max(Duration::from_millis(100)));
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

fn tls_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<tonic::transport::ServerTlsConfig, ServeError> {
    let read = |p: &Path| std::fs::read(p).map_err(|e| ServeError::Tls(format!("reading {}: {e}", p.display()).into()));
    let identity = tonic::transport::Identity::from_pem(read(cert)?, read(key)?);
    let mut cfg = tonic::transport::ServerTlsConfig::new().identity(identity);
    if let Some(ca) = client_ca {
        cfg = cfg.client_ca_root(tonic::transport::Certificate::from_pem(read(ca)?));
    }
    Ok(cfg)
}

async fn os_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(mut term), Ok(mut int)) => tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        },
        _ => {
            // Without signal handlers we can only wait for the other shutdown source.
            futures::future::pending::<()>().await;
            "unreachable"
        }
    }
}

/// Binds a Unix socket: creates the parent folder, removes a stale socket, refuses to remove a
/// live one or a non-socket file, and sets mode 0660.
fn bind_unix(path: &Path) -> Result<tokio::net::UnixListener, ServeError> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let bind_err = |source| ServeError::Bind { endpoint: format!("unix://{}", path.display()), source };
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(bind_err)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(ServeError::SocketInUse(path.to_path_buf()));
            }
            tracing::info!("removing stale socket {}", path.display());
            std::fs::remove_file(path).map_err(bind_err)?;
        }
        Ok(_) => return Err(ServeError::NotASocket(path.to_path_buf())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(bind_err(e)),
    }
    let listener = tokio::net::UnixListener::bind(path).map_err(bind_err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(bind_err)?;
    Ok(listener)
}

async fn probe_loop<D: Driver>(
    driver: Arc<D>,
    health: tonic_health::server::HealthReporter,
    names: Vec<String>,
    ready: Arc<AtomicBool>,
    draining: Arc<AtomicBool>,
    interval: Duration,
) {
    let mut last: Option<bool> = None;
    loop {
        let ctx = RequestContext::new(format!("probe-{}", uuid::Uuid::new_v4()));
        let now_ready = match driver.probe(&ctx).await {
            Ok(p) => {
                if !p.ready && last != Some(false) {
                    tracing::info!("driver not ready yet: {}", p.message);
                }
                p.ready
            }
            Err(e) => {
                tracing::warn!("probe failed: {e}");
                false
            }
        };
        if draining.load(Ordering::SeqCst) {
            return;
        }
        if last != Some(now_ready) {
            let status = if now_ready { ServingStatus::Serving } else { ServingStatus::NotServing };
            for n in &names {
                health.set_service_status(n.as_str(), status).await;
            }
            ready.store(now_ready, Ordering::SeqCst);
            last = Some(now_ready);
        }
        // Deliberate periodic probe; re-probe faster while not ready.
        let wait = if now_ready { interval } else { interval.min(Duration::from_millis(500)) };
        tokio::time::sleep(wait).await;
    }
}
