//! `machine-controller run`: the controller assembled from its parts — the store, the target
//! cluster, the metrics and autoscaler servers, and the reconcilers, alone or behind a leader
//! election.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::exit::Exit;
use crate::runtime::{self, Config};
use crate::store::StoreSpec;

use super::{connect, fail};

/// `run` options.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// A driver sidecar: NAME=ENDPOINT (e.g. fake=unix:///run/machine-driver/fake.sock). Repeat for more.
    #[arg(long = "driver", value_parser = parse_driver, required = true)]
    pub drivers: Vec<(String, String)>,
    /// Concurrent reconciles.
    #[arg(long, default_value_t = crate::defaults::WORKERS)]
    pub workers: usize,
    /// Serve /metrics, /healthz and /readyz here.
    #[arg(long, env = "MACHINE_CONTROLLER_METRICS_ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Deadline of one driver call.
    #[arg(long, default_value = "5s", value_parser = machine_driver_util::parse_duration)]
    pub call_timeout: Duration,
    /// Changes within this window coalesce into one reconcile.
    #[arg(long, default_value = "100ms", value_parser = machine_driver_util::parse_duration)]
    pub debounce: Duration,
    /// Driver calls per second, per driver.
    #[arg(long, default_value_t = crate::defaults::DRIVER_QPS)]
    pub driver_qps: f64,
    /// Burst of driver calls, per driver.
    #[arg(long, default_value_t = crate::defaults::DRIVER_BURST)]
    pub driver_burst: u32,
    /// How often Running machines are checked.
    #[arg(long, default_value = "30s", value_parser = machine_driver_util::parse_duration)]
    pub health_check_interval: Duration,
    /// How often each class is listed for orphans.
    #[arg(long, default_value = "60s", value_parser = machine_driver_util::parse_duration)]
    pub orphan_interval: Duration,
    /// How long an orphan is left alone before it is deleted.
    #[arg(long, default_value = "5m", value_parser = machine_driver_util::parse_duration)]
    pub orphan_grace: Duration,
    /// The tag value that marks cloud machines as this controller's.
    #[arg(long, default_value = crate::defaults::CONTROLLER_ID)]
    pub controller_id: String,
    /// Reconcile every object again this often, even without a change.
    #[arg(long, default_value = "60s", value_parser = machine_driver_util::parse_duration)]
    pub resync_interval: Duration,
    /// With `--store kubernetes`: reconcile only this namespace (default: all namespaces).
    #[arg(long, env = "MACHINE_CONTROLLER_NAMESPACE")]
    pub namespace: Option<String>,
    /// Run as one of several replicas: only the holder of a coordination.k8s.io/v1 Lease acts
    /// (needs `--store kubernetes`).
    #[arg(long)]
    pub leader_elect: bool,
    /// The cluster where the machines' Nodes live (link, readiness, drain before delete). With
    /// `--store kubernetes` and no flag: the same cluster.
    #[arg(long, env = "MACHINE_CONTROLLER_TARGET_KUBECONFIG")]
    pub target_kubeconfig: Option<std::path::PathBuf>,
    /// Do not manage Nodes, even with `--store kubernetes` (machines are Running when their VM runs).
    #[arg(long, conflicts_with = "target_kubeconfig")]
    pub no_target_cluster: bool,
    /// How often a drain looks at its node's pods again.
    #[arg(long, default_value = "5s", value_parser = machine_driver_util::parse_duration)]
    pub drain_poll_interval: Duration,
    /// The target cluster's API server as machines reach it, for boot data (`.APIServerURL`,
    /// `.APIServerHost`; default: the server of the target's kubeconfig, which in a Pod is the
    /// in-cluster service address machines cannot use).
    #[arg(long)]
    pub target_api_server_url: Option<String>,
    /// How long a bootstrap token minted for a machine lives unless refreshed (it is refreshed
    /// while the machine's Node has not joined, and deleted once it has).
    #[arg(long, default_value = "15m", value_parser = machine_driver_util::parse_duration)]
    pub bootstrap_token_ttl: Duration,
    /// The group a bootstrap token authenticates in besides `system:bootstrappers` (kubeadm's, so
    /// a kubeadm cluster's own TLS bootstrap and CSR approval bindings admit it).
    #[arg(long, default_value = crate::nodes::bootstrap::DEFAULT_TOKEN_GROUP)]
    pub bootstrap_token_group: String,
    /// Requests per second to the target cluster (every call, the Node watch, the probe).
    #[arg(long, default_value_t = crate::defaults::TARGET_QPS)]
    pub target_qps: f64,
    /// Burst of requests to the target cluster.
    #[arg(long, default_value_t = crate::defaults::TARGET_BURST)]
    pub target_burst: u32,
    /// Namespace of the Lease (default: POD_NAMESPACE, else `--namespace`, else `default`).
    #[arg(long)]
    pub leader_elect_namespace: Option<String>,
    /// Name of the Lease.
    #[arg(long, default_value = crate::defaults::LEASE_NAME)]
    pub leader_elect_lease_name: String,
    /// This replica's identity (default: POD_NAME, else the host name and a random suffix).
    #[arg(long, env = "POD_NAME")]
    pub leader_elect_identity: Option<String>,
    /// How long a Lease stays valid after its last renewal.
    #[arg(long, default_value = "15s", value_parser = machine_driver_util::parse_duration)]
    pub leader_elect_lease_duration: Duration,
    /// The leader stops acting when it could not renew for this long.
    #[arg(long, default_value = "10s", value_parser = machine_driver_util::parse_duration)]
    pub leader_elect_renew_deadline: Duration,
    /// How often candidates try to acquire and the leader renews.
    #[arg(long, default_value = "2s", value_parser = machine_driver_util::parse_duration)]
    pub leader_elect_retry_period: Duration,
    /// Serve the cluster-autoscaler's externalgrpc cloud provider here (host:port; off when not
    /// given): every MachineDeployment and MachinePool with spec.autoscaling is a node group.
    /// `NAMESPACE/SECRET=host:port` serves the groups whose spec.targetCluster names that
    /// kubeconfig Secret (one autoscaler per target cluster); plain `host:port` serves those of
    /// the default target. Repeat for more.
    #[arg(long, env = "MACHINE_CONTROLLER_AUTOSCALER_LISTEN", value_delimiter = ',', value_parser = parse_autoscaler_listen)]
    pub autoscaler_listen: Vec<(crate::targets::TargetId, std::net::SocketAddr)>,
    /// The autoscaler server's certificate (PEM); with --autoscaler-tls-key and
    /// --autoscaler-client-ca: mutual TLS.
    #[arg(long, requires_all = ["autoscaler_tls_key", "autoscaler_client_ca"])]
    pub autoscaler_tls_cert: Option<std::path::PathBuf>,
    /// The autoscaler server's private key (PEM).
    #[arg(long, requires_all = ["autoscaler_tls_cert", "autoscaler_client_ca"])]
    pub autoscaler_tls_key: Option<std::path::PathBuf>,
    /// The CA the autoscaler's client certificate must chain to (PEM).
    #[arg(long, requires_all = ["autoscaler_tls_cert", "autoscaler_tls_key"])]
    pub autoscaler_client_ca: Option<std::path::PathBuf>,
    /// Serve the autoscaler plaintext on an address other than loopback (anyone who reaches it
    /// can resize the node groups).
    #[arg(long)]
    pub autoscaler_allow_plaintext: bool,
}

impl RunArgs {
    /// The runtime configuration.
    pub fn config(&self) -> Config {
        Config {
            workers: self.workers.max(1),
            call_timeout: self.call_timeout,
            debounce: self.debounce,
            driver_qps: self.driver_qps,
            driver_burst: self.driver_burst,
            resync_interval: self.resync_interval,
            ..Config::default()
        }
    }

    /// The autoscaler servers' settings (none, one, or one per target cluster), each with the
    /// target whose node groups it serves.
    pub fn autoscaler(&self) -> Vec<(crate::targets::TargetId, crate::autoscaler::Settings)> {
        let tls = match (&self.autoscaler_tls_cert, &self.autoscaler_tls_key, &self.autoscaler_client_ca) {
            (Some(cert), Some(key), Some(ca)) => {
                Some(crate::autoscaler::TlsFiles { cert: cert.clone(), key: key.clone(), client_ca: ca.clone() })
            }
            _ => None,
        };
        self.autoscaler_listen
            .iter()
            .map(|(target, listen)| {
                let settings = crate::autoscaler::Settings {
                    listen: *listen,
                    tls: tls.clone(),
                    allow_plaintext: self.autoscaler_allow_plaintext,
                };
                (target.clone(), settings)
            })
            .collect()
    }

    /// The controller's own settings.
    pub fn settings(&self) -> crate::app::Settings {
        crate::app::Settings {
            health_check_interval: self.health_check_interval,
            orphan_interval: self.orphan_interval,
            orphan_grace: self.orphan_grace,
            controller_id: self.controller_id.clone(),
            drain_poll_interval: self.drain_poll_interval,
            targets: crate::targets::TargetSettings {
                limits: crate::nodes::calls::Limits { qps: self.target_qps, burst: self.target_burst },
                token_ttl: self.bootstrap_token_ttl,
                token_group: self.bootstrap_token_group.clone(),
            },
        }
    }
}

/// `host:port` (the default target's groups) or `NAMESPACE/SECRET=host:port`.
fn parse_autoscaler_listen(s: &str) -> Result<(crate::targets::TargetId, std::net::SocketAddr), String> {
    let (target, addr) = match s.split_once('=') {
        None => (crate::targets::TargetId::Default, s),
        Some((target, addr)) => {
            let Some((namespace, name)) = target.split_once('/').filter(|(n, s)| !n.is_empty() && !s.is_empty()) else {
                return Err(format!(
                    "{s:?}: expected host:port or NAMESPACE/SECRET=host:port (the kubeconfig Secret a \
                     spec.targetCluster names)"
                ));
            };
            (crate::targets::TargetId::Secret { namespace: namespace.into(), name: name.into() }, addr)
        }
    };
    let addr = addr.parse().map_err(|e| format!("{s:?}: {addr:?} is not host:port ({e})"))?;
    Ok((target, addr))
}

fn parse_driver(s: &str) -> Result<(String, String), String> {
    let (name, endpoint) =
        s.split_once('=').ok_or_else(|| format!("{s:?}: expected NAME=ENDPOINT, e.g. fake=unix:///tmp/fake.sock"))?;
    if name.is_empty() {
        return Err(format!("{s:?}: the driver name is empty"));
    }
    endpoint.parse::<driver_sdk::endpoint::Endpoint>().map_err(|e| e.to_string())?;
    Ok((name.to_string(), endpoint.to_string()))
}

/// Runs the controller until SIGTERM / SIGINT (or, with `--leader-elect`, until leadership is
/// lost: then it stops acting at once and exits with an error, so its pod restarts as a follower).
pub(super) async fn run(spec: &StoreSpec, args: &RunArgs) -> Result<(), Exit> {
    let spec = store_spec(spec, args)?;
    check_token_settings(args)?;
    let (store, kube_client) = connect(&spec).await?;
    let target = target_cluster(&spec, args).await?;
    let mut registry = prometheus_client::registry::Registry::default();
    let ctx =
        crate::app::App::context(store.clone(), &args.drivers, args.config(), args.settings(), &mut registry, target)?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut stop: tokio::sync::watch::Receiver<bool>| async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    // Ready = this replica acts: it has drivers and, with leader election, holds the lease.
    let acting = Arc::new(AtomicBool::new(!args.leader_elect));
    if let Some(addr) = args.metrics_addr {
        serve_metrics(addr, registry, &ctx, acting.clone(), stopped(stop_rx.clone())).await?;
    }
    let mut served = std::collections::HashSet::new();
    for (scope, settings) in args.autoscaler() {
        if !served.insert(scope.clone()) {
            return Err(fail(format!("--autoscaler-listen: the groups of target {scope} are served twice")));
        }
        let lookup_ctx = ctx.clone();
        let id = scope.clone();
        let lookup: crate::autoscaler::TargetLookup =
            Arc::new(move || lookup_ctx.app.targets.open(&id).map(|c| c.target.clone()));
        let server = crate::autoscaler::Server::for_target(store.clone(), scope, lookup, acting.clone());
        crate::autoscaler::serve(settings, server, stopped(stop_rx.clone())).await.map_err(fail)?;
    }
    let names: Vec<String> = args.drivers.iter().map(|(n, e)| format!("{n}={e}")).collect();
    let result = if args.leader_elect {
        let Some(client) = kube_client else { return Err(fail("--leader-elect needs --store kubernetes")) };
        let config = election(args);
        let lease = format!("{}/{}", config.namespace, config.name);
        tracing::info!(identity = %config.identity, lease = %lease, "waiting to become the leader");
        let elector = crate::leader::Elector::new(client, config);
        lead(ctx, elector, &acting, || tracing::info!(workers = args.workers, drivers = ?names, store = %spec, "machine-controller running (leader)")).await
    } else {
        tracing::info!(workers = args.workers, drivers = ?names, store = %spec, "machine-controller running");
        runtime::run(ctx, Arc::new(crate::reconcile::Controller), shutdown_signal()).await;
        Ok(())
    };
    let _ = stop_tx.send(true);
    result
}

/// The store to run on: `--namespace` narrows a Kubernetes store; leader election needs one.
fn store_spec(spec: &StoreSpec, args: &RunArgs) -> Result<StoreSpec, Exit> {
    match spec {
        StoreSpec::Kubernetes { .. } => Ok(StoreSpec::Kubernetes { namespace: args.namespace.clone() }),
        StoreSpec::Sqlite(_) if args.leader_elect => {
            Err(fail("--leader-elect needs --store kubernetes (the embedded store has one writer)"))
        }
        other => Ok(other.clone()),
    }
}

/// The bootstrap token flags, which every target cluster's tokens follow.
fn check_token_settings(args: &RunArgs) -> Result<(), Exit> {
    if !args.bootstrap_token_group.starts_with("system:bootstrappers:") {
        return Err(fail(format!(
            "--bootstrap-token-group {:?}: must start with system:bootstrappers: (the API server refuses other groups)",
            args.bootstrap_token_group
        )));
    }
    if args.bootstrap_token_ttl < Duration::from_secs(60) {
        return Err(fail("--bootstrap-token-ttl: at least 1m (it is refreshed once half of it is gone)".to_string()));
    }
    Ok(())
}

/// The cluster where the machines' Nodes live: `--target-kubeconfig`, else the store's own API
/// server, else none (and none with `--no-target-cluster`).
async fn target_cluster(spec: &StoreSpec, args: &RunArgs) -> Result<Option<crate::nodes::Target>, Exit> {
    let limits = crate::nodes::calls::Limits { qps: args.target_qps, burst: args.target_burst };
    let target = match (&args.target_kubeconfig, spec) {
        _ if args.no_target_cluster => None,
        (Some(path), _) => Some(
            crate::nodes::Target::from_kubeconfig(path, limits)
                .await
                .map_err(|e| fail(format!("--target-kubeconfig {e}")))?,
        ),
        (None, StoreSpec::Kubernetes { .. }) => Some(
            crate::nodes::Target::infer(limits)
                .await
                .map_err(|e| fail(format!("the target cluster (the store's): {e}")))?,
        ),
        (None, _) => None,
    };
    let Some(target) = target else {
        tracing::info!("no target cluster: Nodes are not managed (machines are Running when their VM runs)");
        return Ok(None);
    };
    let mut join = target.join.clone();
    if let Some(url) = &args.target_api_server_url {
        if !url.starts_with("https://") {
            return Err(fail(format!("--target-api-server-url {url:?}: must be an https:// URL")));
        }
        join.api_server_url = url.trim_end_matches('/').to_string();
    }
    join.token_ttl = args.bootstrap_token_ttl;
    join.token_group = args.bootstrap_token_group.clone();
    Ok(Some(target.with_join(join)))
}

/// `/metrics`, `/healthz` and `/readyz` on `addr` until `stopped`; ready while this replica has
/// drivers and acts.
async fn serve_metrics(
    addr: std::net::SocketAddr,
    registry: prometheus_client::registry::Registry,
    ctx: &Arc<crate::app::Ctx>,
    acting: Arc<AtomicBool>,
    stopped: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), Exit> {
    let listener =
        machine_driver_util::metrics::bind(addr).await.map_err(|e| fail(format!("metrics address {addr}: {e}")))?;
    tracing::info!("metrics on http://{}/metrics", listener.local_addr().map(|a| a.to_string()).unwrap_or_default());
    let ctx = ctx.clone();
    let ready = move || !ctx.app.driver_names().is_empty() && acting.load(Ordering::SeqCst);
    tokio::spawn(machine_driver_util::metrics::serve_http(listener, Arc::new(registry), Arc::new(ready), stopped));
    Ok(())
}

/// The Lease this replica competes for, from the flags and the pod's environment.
fn election(args: &RunArgs) -> crate::leader::Config {
    let identity = args.leader_elect_identity.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        format!("{}-{}", host.trim(), &uuid::Uuid::new_v4().simple().to_string()[..8])
    });
    crate::leader::Config {
        namespace: args
            .leader_elect_namespace
            .clone()
            .or_else(|| std::env::var("POD_NAMESPACE").ok())
            .or_else(|| args.namespace.clone())
            .unwrap_or_else(|| "default".into()),
        name: args.leader_elect_lease_name.clone(),
        identity,
        lease_duration: args.leader_elect_lease_duration,
        renew_deadline: args.leader_elect_renew_deadline,
        retry_period: args.leader_elect_retry_period,
    }
}

/// Waits for the Lease, then runs the reconcilers while it is held: until a signal (gracefully,
/// still renewing meanwhile, then released) or as soon as the Lease is lost — then the runtime
/// is dropped mid-flight (everything it did is resumable) and the run fails.
async fn lead(
    ctx: Arc<crate::app::Ctx>,
    mut elector: crate::leader::Elector,
    acting: &AtomicBool,
    running: impl FnOnce(),
) -> Result<(), Exit> {
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    tokio::select! {
        _ = elector.acquire() => {}
        _ = &mut shutdown => return Ok(()),
    }
    acting.store(true, Ordering::SeqCst);
    running();
    let lost = tokio::select! {
        _ = runtime::run(ctx, Arc::new(crate::reconcile::Controller), &mut shutdown) => None,
        lost = elector.hold() => Some(lost),
    };
    match lost {
        None => {
            elector.release().await;
            Ok(())
        }
        Some(lost) => {
            acting.store(false, Ordering::SeqCst);
            tracing::error!("leader election lost: {lost}; stopped acting");
            Err(fail(format!("leader election lost: {lost}")))
        }
    }
}

/// SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(mut t), Ok(mut i)) => {
            tokio::select! {
                _ = t.recv() => {}
                _ = i.recv() => {}
            }
        }
        _ => futures::future::pending::<()>().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::targets::TargetId;

    #[test]
    fn an_autoscaler_listener_serves_the_default_target_or_the_one_a_secret_names() {
        let (target, addr) = parse_autoscaler_listen("127.0.0.1:8086").unwrap();
        assert_eq!((target, addr.port()), (TargetId::Default, 8086));
        let (target, addr) = parse_autoscaler_listen("fleet/east=0.0.0.0:9000").unwrap();
        assert_eq!(target, TargetId::Secret { namespace: "fleet".into(), name: "east".into() });
        assert_eq!(addr.port(), 9000);
        for bad in ["east=127.0.0.1:1", "/east=127.0.0.1:1", "fleet/=127.0.0.1:1", "fleet/east=nowhere"] {
            let e = parse_autoscaler_listen(bad).unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
    }
}
