//! The `machine-controller` command line.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use serde_json::Value;

use crate::exit::Exit;
use crate::manifest::{self, AnyObject};
use crate::resources::*;
use crate::runtime::{self, Config};
use crate::store::{Key, Store, StoreSpec, WatchEvent};

/// Reconciles machine resources through driver sidecars.
#[derive(Debug, Parser)]
#[command(name = "machine-controller", version)]
pub struct Cli {
    /// Where objects live: `sqlite://PATH` (or just PATH) for the embedded store, or
    /// `kubernetes` for custom resources on the API server of the kubeconfig / in-cluster config.
    #[arg(long, global = true, env = "MACHINE_CONTROLLER_STORE", default_value = crate::defaults::STORE)]
    pub store: StoreSpec,
    /// How log lines on stderr look (`RUST_LOG` sets the filter).
    #[arg(long, global = true, value_enum, default_value_t = machine_driver_util::telemetry::LogFormat::Text)]
    pub log_format: machine_driver_util::telemetry::LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Output formats of `get`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// A table of the kind's main columns.
    Table,
    /// The table with the wide columns too (address, request ID, …).
    Wide,
    /// YAML: the object when a name is given, else a `List` of them (as kubectl prints).
    Yaml,
    /// JSON: the object when a name is given, else a `List` of them (as kubectl prints).
    Json,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
// Parsed once per process: the size of `run`'s arguments does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Command {
    /// Creates or updates objects from YAML/JSON files or folders. All documents are validated
    /// first; an invalid one changes nothing.
    Apply {
        /// Files or folders.
        #[arg(short = 'f', long = "filename", required = true)]
        files: Vec<PathBuf>,
        /// Set `replicas` from the manifest even on an autoscaled MachineDeployment or MachinePool
        /// (by default the stored size, the cluster-autoscaler's, is kept).
        #[arg(long)]
        force_replicas: bool,
    },
    /// Lists objects.
    Get {
        /// Kind: machines, md, mc, mp, secrets (or the full kind name).
        kind: String,
        /// One object.
        name: Option<String>,
        /// Namespace.
        #[arg(short, long, default_value = "default")]
        namespace: String,
        /// Output format.
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Shows one object with its conditions, stored operations, request IDs and recent events.
    Describe {
        /// Kind: machines, md, mc, mp, secrets (or the full kind name).
        kind: String,
        /// The object's name.
        name: String,
        /// Namespace.
        #[arg(short, long, default_value = "default")]
        namespace: String,
    },
    /// Deletes objects (machines go through their finalizer: the cloud machine is deleted first).
    Delete {
        /// Kind (or use -f): machines, md, mc, mp, secrets (or the full kind name).
        kind: Option<String>,
        /// The object's name (or use -f).
        name: Option<String>,
        /// Delete what these manifests name.
        #[arg(short = 'f', long = "filename")]
        files: Vec<PathBuf>,
        /// Namespace.
        #[arg(short, long, default_value = "default")]
        namespace: String,
    },
    /// Rollout of a MachineDeployment: its status (with progress bars and its canary), pause,
    /// resume.
    Rollout {
        /// `status`, `pause` or `resume`.
        #[command(subcommand)]
        action: RolloutAction,
    },
    /// Runs the reconcilers.
    Run(RunArgs),
    /// Prints the CustomResourceDefinitions of the Kubernetes backend as YAML
    /// (`machine-controller crds | kubectl apply -f -`).
    Crds,
    /// Runs a demo: a fake driver sidecar, a 20-machine deployment, a rolling update, scaling.
    Demo(crate::demo::DemoArgs),
}

/// `rollout` actions.
#[derive(Debug, Subcommand)]
pub enum RolloutAction {
    /// Waits until the rollout completes (exit 0), is aborted (exit 1) or times out (exit 2).
    Status {
        /// The MachineDeployment.
        name: String,
        /// Namespace.
        #[arg(short, long, default_value = "default")]
        namespace: String,
        /// Give up after this long.
        // Duration defaults are strings (no `Display`); `defaults`' tests pin them to the constants.
        #[arg(long, default_value = "10m", value_parser = machine_driver_util::parse_duration)]
        timeout: Duration,
        /// Print the status once instead of waiting.
        #[arg(long)]
        no_watch: bool,
    },
    /// Pauses the rollout (`spec.paused: true`): no machine of the new revision is made and no
    /// old one removed until `resume` (scaling and remediation go on; a canary's pause clock too).
    Pause {
        /// The MachineDeployment.
        name: String,
        /// Namespace.
        #[arg(short, long, default_value = "default")]
        namespace: String,
    },
    /// Resumes a paused rollout (`spec.paused: false`).
    Resume {
        /// The MachineDeployment.
        name: String,
        /// Namespace.
        #[arg(short, long, default_value = "default")]
        namespace: String,
    },
}

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
    #[arg(long, env = "MACHINE_CONTROLLER_AUTOSCALER_LISTEN")]
    pub autoscaler_listen: Option<std::net::SocketAddr>,
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

    /// The autoscaler server's settings, if it is to run.
    pub fn autoscaler(&self) -> Option<crate::autoscaler::Settings> {
        let tls = match (&self.autoscaler_tls_cert, &self.autoscaler_tls_key, &self.autoscaler_client_ca) {
            (Some(cert), Some(key), Some(ca)) => {
                Some(crate::autoscaler::TlsFiles { cert: cert.clone(), key: key.clone(), client_ca: ca.clone() })
            }
            _ => None,
        };
        Some(crate::autoscaler::Settings {
            listen: self.autoscaler_listen?,
            tls,
            allow_plaintext: self.autoscaler_allow_plaintext,
        })
    }

    /// The controller's own settings.
    pub fn settings(&self) -> crate::app::Settings {
        crate::app::Settings {
            health_check_interval: self.health_check_interval,
            orphan_interval: self.orphan_interval,
            orphan_grace: self.orphan_grace,
            controller_id: self.controller_id.clone(),
            drain_poll_interval: self.drain_poll_interval,
        }
    }
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

fn fail(message: impl Into<String>) -> Exit {
    Exit::fail(message)
}

fn kind_arg(s: &str) -> Result<Kind, Exit> {
    Kind::parse(s).ok_or_else(|| {
        let names: Vec<String> = Kind::ALL
            .iter()
            .rev()
            .map(|k| match k.aliases().first() {
                Some(alias) => format!("{} ({alias})", k.plural()),
                None => k.plural().to_string(),
            })
            .collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        fail(format!("unknown kind {s:?}; use {}", one_of(&names)))
    })
}

/// Runs a parsed command.
///
/// # Errors
/// What to print, and the exit code.
pub async fn execute(cli: Cli) -> Result<(), Exit> {
    match cli.command {
        Command::Apply { files, force_replicas } => apply(&cli.store, &files, force_replicas).await,
        Command::Get { kind, name, namespace, output } => {
            let kind = kind_arg(&kind)?;
            get(&open(&cli.store).await?, kind, name.as_deref(), &namespace, output).await
        }
        Command::Describe { kind, name, namespace } => {
            let kind = kind_arg(&kind)?;
            describe(&open(&cli.store).await?, kind, &name, &namespace).await
        }
        Command::Delete { kind, name, files, namespace } => delete(&cli.store, kind, name, &files, &namespace).await,
        Command::Rollout { action: RolloutAction::Status { name, namespace, timeout, no_watch } } => {
            rollout_status(&open(&cli.store).await?, &namespace, &name, timeout, !no_watch).await
        }
        Command::Rollout { action: RolloutAction::Pause { name, namespace } } => {
            set_paused(&open(&cli.store).await?, &namespace, &name, true).await
        }
        Command::Rollout { action: RolloutAction::Resume { name, namespace } } => {
            set_paused(&open(&cli.store).await?, &namespace, &name, false).await
        }
        Command::Run(args) => run(&cli.store, &args).await,
        Command::Crds => {
            print!("{}", crate::crd::crds_yaml()?);
            Ok(())
        }
        Command::Demo(args) => crate::demo::run(args).await,
    }
}

async fn open(spec: &StoreSpec) -> Result<Store, Exit> {
    Ok(connect(spec).await?.0)
}

/// The store `spec` names, and the Kubernetes client it was built with (`--store kubernetes`),
/// for whatever else talks to that API server (leader election).
async fn connect(spec: &StoreSpec) -> Result<(Store, Option<kube::Client>), Exit> {
    let failed =
        |e: crate::store::Error| fail(format!("opening store {spec}: {}", machine_driver_util::error_chain(&e)));
    let client = spec.kube_client().await.map_err(failed)?;
    let store = Store::connect(spec, client.clone()).map_err(failed)?;
    Ok((store, client))
}

/// Reads and validates every manifest; any error means nothing is applied.
pub fn read_manifests(files: &[PathBuf]) -> Result<Vec<AnyObject>, Exit> {
    let mut objects = Vec::new();
    let mut errors = Vec::new();
    for path in files {
        let list = manifest::files(path).map_err(|e| fail(format!("{}: {e}", path.display())))?;
        if list.is_empty() {
            return Err(fail(format!("{}: no .yaml, .yml or .json files", path.display())));
        }
        for file in list {
            let text = std::fs::read_to_string(&file).map_err(|e| fail(format!("{}: {e}", file.display())))?;
            match manifest::parse(&text, &file.display().to_string()) {
                Ok(objs) => objects.extend(objs),
                Err(errs) => errors.extend(errs),
            }
        }
    }
    if !errors.is_empty() {
        let lines: Vec<String> = errors.iter().map(|e| format!("error: {e}")).collect();
        return Err(Exit { message: format!("{}\nnothing was applied", lines.join("\n")), code: 1 });
    }
    Ok(objects)
}

async fn apply(spec: &StoreSpec, files: &[PathBuf], force_replicas: bool) -> Result<(), Exit> {
    let mut objects = read_manifests(files)?;
    let store = open(spec).await?;
    objects.sort_by_key(|o| o.kind());
    for o in objects {
        let meta = o.meta();
        let mut desired = o.to_json();
        if !force_replicas {
            keep_autoscaled_replicas(&store, o.kind(), &mut desired).await?;
        }
        let (created, _) = store.apply(o.kind(), desired).await?;
        println!(
            "{}/{} {}",
            o.kind().as_str().to_ascii_lowercase(),
            meta.name,
            if created { "created" } else { "configured" }
        );
    }
    Ok(())
}

/// `replicas` has one owner at a time: on an autoscaled MachineDeployment or MachinePool that
/// exists, the stored size (the cluster-autoscaler's) is kept, brought within the manifest's
/// bounds, instead of the manifest's (like a Deployment's replicas under a HorizontalPodAutoscaler).
async fn keep_autoscaled_replicas(store: &Store, kind: Kind, desired: &mut Value) -> Result<(), Exit> {
    if !matches!(kind, Kind::MachineDeployment | Kind::MachinePool) {
        return Ok(());
    }
    let Some(bounds) = desired.pointer("/spec/autoscaling").cloned() else { return Ok(()) };
    let Ok(bounds) = serde_json::from_value::<crate::resources::Autoscaling>(bounds) else { return Ok(()) };
    let key = Key::new(
        kind,
        desired["metadata"]["namespace"].as_str().unwrap_or("default"),
        desired["metadata"]["name"].as_str().unwrap_or_default(),
    );
    let Some(stored) = store.backend().get(&key).await? else { return Ok(()) };
    let stored: Value = serde_json::from_str(&stored).map_err(|e| fail(format!("{key}: {e}")))?;
    if let Some(n) = stored.pointer("/spec/replicas").and_then(Value::as_i64) {
        desired["spec"]["replicas"] = Value::from(bounds.clamp(n));
    }
    Ok(())
}

async fn delete(
    spec: &StoreSpec,
    kind: Option<String>,
    name: Option<String>,
    files: &[PathBuf],
    namespace: &str,
) -> Result<(), Exit> {
    let mut keys = Vec::new();
    if !files.is_empty() {
        for o in read_manifests(files)? {
            keys.push(Key::new(o.kind(), &o.meta().namespace, &o.meta().name));
        }
    }
    match (kind, name) {
        (Some(k), Some(n)) => keys.push(Key::new(kind_arg(&k)?, namespace, &n)),
        (Some(_), None) => return Err(fail("delete needs KIND NAME, or -f FILE")),
        _ if keys.is_empty() => return Err(fail("delete needs KIND NAME, or -f FILE")),
        _ => {}
    }
    let store = open(spec).await?;
    for key in keys.iter().rev() {
        let exists = store.backend().get(key).await?.is_some();
        if !exists {
            return Err(fail(format!("{} {} not found in namespace {}", key.kind, key.name, key.namespace)));
        }
        let left = store.delete(key).await?;
        let how = if left.is_some() {
            "deleting (waiting for the controller to remove it from the cloud)"
        } else {
            "deleted"
        };
        println!("{}/{} {how}", key.kind.as_str().to_ascii_lowercase(), key.name);
    }
    Ok(())
}

fn age(t: Option<Time>) -> String {
    let Some(t) = t else { return "-".into() };
    let s = (chrono::Utc::now() - t).num_seconds().max(0);
    match s {
        0..=119 => format!("{s}s"),
        120..=7199 => format!("{}m", s / 60),
        7200..=172_799 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86400),
    }
}

/// `v` with the values of its kind's secret fields replaced by `<redacted>` (a Secret's `data`
/// and `stringData`: [`Shape::secret_fields`](crate::resources::Shape::secret_fields)).
fn redact(kind: Kind, mut v: Value) -> Value {
    for field in kind.shape().secret_fields() {
        if let Some(Value::Object(m)) = v.get_mut(*field) {
            for val in m.values_mut() {
                *val = Value::String("<redacted>".into());
            }
        }
    }
    v
}

fn print_table(rows: Vec<Vec<String>>) {
    let widths: Vec<usize> =
        (0..rows.first().map_or(0, Vec::len)).map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0)).collect();
    let mut out = std::io::stdout().lock();
    for r in rows {
        let line: Vec<String> = r.iter().enumerate().map(|(i, c)| format!("{c:<w$}", w = widths[i])).collect();
        let _ = writeln!(out, "{}", line.join("   ").trim_end());
    }
}

/// The stored object as JSON. One that does not parse (a store file edited by hand, a damaged
/// restore) is an error that names it: `get` and `describe` never pass over it in silence.
fn stored_json(key: &Key, json: &str) -> Result<Value, String> {
    serde_json::from_str(json).map_err(|source| {
        machine_driver_util::error_chain(&crate::store::Error::Unreadable { key: key.clone(), source })
    })
}

async fn get(store: &Store, kind: Kind, name: Option<&str>, namespace: &str, output: Output) -> Result<(), Exit> {
    // By key, so an object whose text does not parse is still found, and named.
    let keys = store.keys(kind).await?;
    let mut raw: Vec<Value> = Vec::new();
    let mut unreadable: Vec<String> = Vec::new();
    for key in keys.iter().filter(|k| k.namespace == namespace && name.is_none_or(|n| k.name == n)) {
        let Some(json) = store.backend().get(key).await? else { continue };
        match stored_json(key, &json) {
            Ok(v) => raw.push(v),
            Err(e) => unreadable.push(e),
        }
    }
    if !unreadable.is_empty() {
        // The readable ones are still shown; the exit code says the list is not whole.
        let shown = raw.len();
        if shown > 0 {
            show(kind, name, namespace, output, raw)?;
        }
        return Err(fail(format!(
            "{} of {} {kind} objects could not be read:\n  {}",
            unreadable.len(),
            unreadable.len() + shown,
            unreadable.join("\n  ")
        )));
    }
    if let Some(n) = name {
        if raw.is_empty() {
            return Err(fail(format!("{kind} {n} not found in namespace {namespace}")));
        }
    }
    show(kind, name, namespace, output, raw)
}

/// Prints `get`'s objects in `output`'s format.
fn show(kind: Kind, name: Option<&str>, namespace: &str, output: Output, mut raw: Vec<Value>) -> Result<(), Exit> {
    raw = raw.into_iter().map(|v| redact(kind, v)).collect();
    match output {
        Output::Json => {
            let v = if name.is_some() {
                raw.remove(0)
            } else {
                serde_json::json!({"apiVersion": "v1", "kind": "List", "items": raw})
            };
            println!("{}", serde_json::to_string_pretty(&v)?);
            return Ok(());
        }
        Output::Yaml => {
            let v = if name.is_some() {
                raw.remove(0)
            } else {
                serde_json::json!({"apiVersion": "v1", "kind": "List", "items": raw})
            };
            print!("{}", serde_saphyr::to_string(&v).map_err(|e| fail(e.to_string()))?);
            return Ok(());
        }
        Output::Table | Output::Wide => {}
    }
    let wide = output == Output::Wide;
    if raw.is_empty() {
        eprintln!("no {kind} objects in namespace {namespace}");
        return Ok(());
    }
    print_table(table(kind, raw, wide)?);
    Ok(())
}

/// The rows of `get`'s table: a header (NAME, then the kind's [`Column`]s in capitals, the wide
/// ones after the others), then one row per object.
fn table(kind: Kind, raw: Vec<Value>, wide: bool) -> Result<Vec<Vec<String>>, Exit> {
    let columns = kind.columns().iter().filter(|c| c.in_table(wide) && !c.is_wide());
    let columns: Vec<&Column> =
        columns.chain(kind.columns().iter().filter(|c| c.in_table(wide) && c.is_wide())).collect();
    let mut rows =
        vec![std::iter::once("NAME".to_string()).chain(columns.iter().map(|c| c.name.to_uppercase())).collect()];
    for v in raw {
        let v = kind.normalize(v)?;
        let mut row = vec![v["metadata"]["name"].as_str().unwrap_or("").to_string()];
        row.extend(columns.iter().map(|c| cell(c, &v)));
        rows.push(row);
    }
    Ok(rows)
}

/// One cell of `get`'s table.
fn cell(column: &Column, object: &Value) -> String {
    if let Some(f) = column.cell {
        return f(object);
    }
    let value = column.lookup(object).filter(|v| !v.is_null());
    match (column.ty, value) {
        (ColumnType::Date, v) => age(v
            .and_then(Value::as_str)
            .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
            .map(|t| t.with_timezone(&chrono::Utc))),
        (ColumnType::Integer, None) => "0".into(),
        (_, None) => "-".into(),
        (_, Some(Value::String(s))) => or_dash(s),
        (_, Some(v)) => v.to_string(),
    }
}

fn or_dash(s: &str) -> String {
    if s.is_empty() {
        "-".into()
    } else {
        s.into()
    }
}

async fn describe(store: &Store, kind: Kind, name: &str, namespace: &str) -> Result<(), Exit> {
    let key = Key::new(kind, namespace, name);
    let Some(json) = store.backend().get(&key).await? else {
        return Err(fail(format!("{kind} {name} not found in namespace {namespace}")));
    };
    let v = redact(kind, stored_json(&key, &json).map_err(fail)?);
    let mut out = String::new();
    let meta = &v["metadata"];
    out += &format!("Name:         {}\nNamespace:    {}\nKind:         {}\n", name, namespace, kind);
    out += &format!("Created:      {}\n", meta["creationTimestamp"].as_str().unwrap_or("-"));
    if let Some(d) = meta["deletionTimestamp"].as_str() {
        out += &format!("Deleting:     since {d}\n");
    }
    out += &format!(
        "Generation:   {}\nVersion:      {}\n",
        meta["generation"],
        meta["resourceVersion"].as_str().unwrap_or("-")
    );
    for (title, field) in [("Labels", "labels"), ("Annotations", "annotations")] {
        if let Some(o) = meta[field].as_object() {
            out += &format!("{title}:\n");
            for (k, val) in o {
                out += &format!("  {k}={}\n", val.as_str().unwrap_or(""));
            }
        }
    }
    if let Some(f) = meta["finalizers"].as_array() {
        out += &format!("Finalizers:   {}\n", f.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(", "));
    }
    if let Some(spec) = v.get("spec") {
        out += "Spec:\n";
        out += &indent(&serde_saphyr::to_string(spec).unwrap_or_default());
    }
    let status = &v["status"];
    if let Some(phase) = status["phase"].as_str() {
        out += &format!("Phase:        {phase}\n");
    }
    if let Some(p) = status["providerId"].as_str() {
        out += &format!("Provider ID:  {p}\n");
    }
    let (head, tail) = kind.describe(status);
    out += &head;
    if let Some(a) = status["addresses"].as_array() {
        for addr in a {
            out += &format!(
                "Address:      {} {}\n",
                addr["type"].as_str().unwrap_or(""),
                addr["address"].as_str().unwrap_or("")
            );
        }
    }
    if let Some(conds) = status["conditions"].as_array() {
        out += "Conditions:\n  TYPE                    STATUS  REASON                        MESSAGE\n";
        for c in conds {
            out += &format!(
                "  {:<23} {:<7} {:<29} {}\n",
                c["type"].as_str().unwrap_or(""),
                c["status"].as_str().unwrap_or(""),
                c["reason"].as_str().unwrap_or(""),
                c["message"].as_str().unwrap_or("")
            );
        }
    }
    if let Some(ops) = status["operations"].as_array() {
        out += "Operations in flight:\n";
        for o in ops {
            out += &format!(
                "  {} {} started {} ({}% done), request {}\n",
                o["kind"].as_str().unwrap_or(""),
                o["name"].as_str().unwrap_or(""),
                o["started"].as_str().unwrap_or(""),
                o["progress"],
                o["requestId"].as_str().unwrap_or("")
            );
        }
    }
    if let Some(l) = status.get("lastOperation").filter(|l| !l.is_null()) {
        out += &format!(
            "Last operation: {} {} code={} {} request={} at {}\n",
            l["type"].as_str().unwrap_or(""),
            l["state"].as_str().unwrap_or(""),
            l["code"].as_str().unwrap_or(""),
            l["reason"].as_str().map(|r| format!("reason={r}")).unwrap_or_default(),
            l["requestId"].as_str().unwrap_or(""),
            l["time"].as_str().unwrap_or("")
        );
        if let Some(m) = l["message"].as_str() {
            out += &format!("  message: {m}\n");
        }
    }
    if let Some(ids) = status["requestIds"].as_array() {
        out +=
            &format!("Recent request IDs: {}\n", ids.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(", "));
    }
    if let Some(f) = status.get("failure").filter(|f| !f.is_null()) {
        out += &format!(
            "Exit:      {} {}: {}\n",
            f["code"].as_str().unwrap_or(""),
            f["reason"].as_str().unwrap_or(""),
            f["message"].as_str().unwrap_or("")
        );
    }
    out += &tail;
    let events = store.backend().events(&key, 15).await?;
    out += "Events:\n";
    if events.is_empty() {
        out += "  <none>\n";
    }
    for e in events {
        out += &format!("  {}  {:<7} {:<22} {}\n", e.time.format("%H:%M:%S%.3f"), e.event_type, e.reason, e.message);
    }
    print!("{out}");
    Ok(())
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("  {l}\n")).collect()
}

/// `rollout pause` / `rollout resume`: sets `spec.paused` (read again and retried on a
/// conflict with the controller or another writer).
async fn set_paused(store: &Store, namespace: &str, name: &str, paused: bool) -> Result<(), Exit> {
    let what = if paused { "paused" } else { "resumed" };
    for _ in 0..5 {
        let Some(mut md) = store.get::<MachineDeployment>(namespace, name).await? else {
            return Err(fail(format!("MachineDeployment {name} not found in namespace {namespace}")));
        };
        if md.spec.paused == paused {
            println!("machinedeployment {name} already {what}");
            return Ok(());
        }
        md.spec.paused = paused;
        match store.update(&md).await {
            Ok(_) => {
                println!("machinedeployment {name} {what}");
                return Ok(());
            }
            Err(crate::store::Error::Conflict { .. }) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(fail(format!("MachineDeployment {name} kept changing; try again")))
}

/// The canary and pause lines of `rollout status`, if there are any.
fn rollout_lines(md: &MachineDeployment, now: Time) -> Vec<String> {
    let mut out = Vec::new();
    // The latest canary, whether it is under way, passed or failed (and its revision was rolled back).
    if let Some(k) = &md.status.canary {
        out.push(k.summary(now));
    }
    if md.spec.paused {
        out.push(format!(
            "paused: no machine of the new revision is made and no old one removed (machine-controller rollout resume {})",
            md.metadata.name
        ));
    }
    out
}

async fn rollout_status(
    store: &Store,
    namespace: &str,
    name: &str,
    timeout: Duration,
    watch: bool,
) -> Result<(), Exit> {
    use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
    let deadline = tokio::time::Instant::now() + timeout;
    let bars = MultiProgress::new();
    let style = ProgressStyle::with_template("{prefix:>10} [{bar:40}] {pos}/{len} {msg}")
        .map_err(|e| fail(e.to_string()))?
        .progress_chars("=> ");
    let updated = bars.add(ProgressBar::new(0).with_style(style.clone()).with_prefix("updated"));
    let available = bars.add(ProgressBar::new(0).with_style(style).with_prefix("available"));
    // Subscribed before the first read: every status change after it wakes this loop.
    let mut changes = store.watch::<MachineDeployment>(None);
    // The canary and pause lines last printed (watching: printed again when they change, the
    // seconds of pause left aside).
    let mut shown = String::new();
    loop {
        let Some(md) = store.get::<MachineDeployment>(namespace, name).await? else {
            return Err(fail(format!("MachineDeployment {name} not found in namespace {namespace}")));
        };
        let desired = md.spec.replicas.max(0) as u64;
        updated.set_length(desired);
        available.set_length(desired);
        updated.set_position((md.status.updated_replicas.max(0) as u64).min(desired));
        available.set_position((md.status.available_replicas.max(0) as u64).min(desired));
        let progressing = condition(&md.status.conditions, ConditionType::Progressing);
        let msg = progressing.map(|c| format!("{}: {}", c.reason, c.message)).unwrap_or_default();
        available.set_message(msg.clone());
        updated.set_message(format!("revision {} ({} machines total)", md.status.target_revision, md.status.replicas));
        let observed = md.status.observed_generation >= md.metadata.generation;
        let lines = rollout_lines(&md, chrono::Utc::now());
        let key = {
            let mut k = md.status.canary.clone();
            if let Some(k) = k.as_mut() {
                k.pause_until = None;
            }
            format!("{k:?} {}", md.spec.paused)
        };
        if watch && key != shown && !lines.is_empty() {
            bars.suspend(|| lines.iter().for_each(|l| println!("{l}")));
        }
        shown = key;
        // The spec's revision failed (the rollout was aborted, and rolled back if it could): the
        // same answer whenever it is asked, watching or not, and however far the rollback got.
        let spec_rev = crate::plan::deployment::revision(&md.spec.template);
        let failed = md.status.bad_revisions.iter().rev().find(|b| b.revision == spec_rev);
        let aborted = progressing.is_some_and(|c| matches!(c.reason, Reason::RolloutAborted | Reason::NoGoodRevision));
        if observed && (aborted || failed.is_some()) {
            bars.clear().ok();
            if !watch {
                lines.iter().for_each(|l| println!("{l}"));
            }
            let why = match failed {
                Some(b) if !msg.contains(&b.reason) => format!("revision {spec_rev} failed ({}); {msg}", b.reason),
                _ => msg,
            };
            return Err(Exit { message: format!("rollout of {name} aborted: {why}"), code: 1 });
        }
        let done = observed
            && md.status.available_replicas == md.spec.replicas
            && md.status.replicas == md.spec.replicas
            && md.status.updated_replicas == md.spec.replicas;
        if done {
            updated.finish();
            available.finish();
            if !watch {
                lines.iter().for_each(|l| println!("{l}"));
            }
            println!("machinedeployment {name} successfully rolled out (revision {})", md.status.target_revision);
            return Ok(());
        }
        if !watch {
            bars.clear().ok();
            println!(
                "waiting for rollout of {name}: {} of {} updated machines available",
                md.status.available_replicas, md.spec.replicas
            );
            lines.iter().for_each(|l| println!("{l}"));
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            bars.clear().ok();
            return Err(Exit { message: format!("rollout of {name} not finished after {timeout:?}"), code: 2 });
        }
        // Wait for a change of this deployment (or the deadline).
        loop {
            match tokio::time::timeout_at(deadline, changes.next()).await {
                Err(_) => break,
                Ok(Ok(WatchEvent::Apply(m))) if m.metadata.name == name && m.metadata.namespace == namespace => break,
                Ok(Ok(WatchEvent::Delete(k))) if k.name == name && k.namespace == namespace => break,
                Ok(Ok(WatchEvent::InitDone)) => break,
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(e.into()),
            }
        }
    }
}

/// Runs the controller until SIGTERM / SIGINT (or, with `--leader-elect`, until leadership is
/// lost: then it stops acting at once and exits with an error, so its pod restarts as a follower).
async fn run(spec: &StoreSpec, args: &RunArgs) -> Result<(), Exit> {
    let spec = match spec {
        StoreSpec::Kubernetes { .. } => StoreSpec::Kubernetes { namespace: args.namespace.clone() },
        StoreSpec::Sqlite(_) if args.leader_elect => {
            return Err(fail("--leader-elect needs --store kubernetes (the embedded store has one writer)"))
        }
        other => other.clone(),
    };
    let (store, kube_client) = connect(&spec).await?;
    let limits = crate::nodes::calls::Limits { qps: args.target_qps, burst: args.target_burst };
    let target = match (&args.target_kubeconfig, &spec) {
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
    if target.is_none() {
        tracing::info!("no target cluster: Nodes are not managed (machines are Running when their VM runs)");
    }
    let mut registry = prometheus_client::registry::Registry::default();
    let ctx =
        crate::app::App::context(store.clone(), &args.drivers, args.config(), args.settings(), &mut registry, target)?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // Ready = this replica acts: it has drivers and, with leader election, holds the lease.
    let acting = Arc::new(std::sync::atomic::AtomicBool::new(!args.leader_elect));
    if let Some(addr) = args.metrics_addr {
        let listener =
            machine_driver_util::metrics::bind(addr).await.map_err(|e| fail(format!("metrics address {addr}: {e}")))?;
        tracing::info!(
            "metrics on http://{}/metrics",
            listener.local_addr().map(|a| a.to_string()).unwrap_or_default()
        );
        let mut stop = stop_rx.clone();
        let ready_ctx = ctx.clone();
        let ready_acting = acting.clone();
        tokio::spawn(machine_driver_util::metrics::serve_http(
            listener,
            Arc::new(registry),
            Arc::new(move || {
                !ready_ctx.app.driver_names().is_empty() && ready_acting.load(std::sync::atomic::Ordering::SeqCst)
            }),
            async move {
                let _ = stop.wait_for(|s| *s).await;
            },
        ));
    }
    if let Some(settings) = args.autoscaler() {
        let server = crate::autoscaler::Server::new(store.clone(), ctx.app.target.clone(), acting.clone());
        let mut stop = stop_rx.clone();
        crate::autoscaler::serve(settings, server, async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await
        .map_err(fail)?;
    }
    let names: Vec<String> = args.drivers.iter().map(|(n, e)| format!("{n}={e}")).collect();
    let result = if args.leader_elect {
        let Some(client) = kube_client else { return Err(fail("--leader-elect needs --store kubernetes")) };
        let identity = args.leader_elect_identity.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            format!("{}-{}", host.trim(), &uuid::Uuid::new_v4().simple().to_string()[..8])
        });
        let config = crate::leader::Config {
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
        };
        tracing::info!(identity = %config.identity, lease = %format!("{}/{}", config.namespace, config.name), "waiting to become the leader");
        let mut elector = crate::leader::Elector::new(client, config);
        let shutdown = shutdown_signal();
        tokio::pin!(shutdown);
        tokio::select! {
            _ = elector.acquire() => {}
            _ = &mut shutdown => {
                let _ = stop_tx.send(true);
                return Ok(());
            }
        }
        acting.store(true, std::sync::atomic::Ordering::SeqCst);
        tracing::info!(workers = args.workers, drivers = ?names, store = %spec, "machine-controller running (leader)");
        // The run ends on a signal (gracefully, still renewing meanwhile) or as soon as the lease
        // is lost: then the runtime is dropped mid-flight; everything it did is resumable.
        let lost = tokio::select! {
            _ = runtime::run(ctx.clone(), std::sync::Arc::new(crate::reconcile::Controller), &mut shutdown) => None,
            lost = elector.hold() => Some(lost),
        };
        match lost {
            None => {
                elector.release().await;
                Ok(())
            }
            Some(lost) => {
                acting.store(false, std::sync::atomic::Ordering::SeqCst);
                tracing::error!("leader election lost: {lost}; stopped acting");
                Err(fail(format!("leader election lost: {lost}")))
            }
        }
    } else {
        tracing::info!(workers = args.workers, drivers = ?names, store = %spec, "machine-controller running");
        runtime::run(ctx, std::sync::Arc::new(crate::reconcile::Controller), shutdown_signal()).await;
        Ok(())
    };
    let _ = stop_tx.send(true);
    result
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

    fn samples() -> Vec<(Kind, Vec<Value>)> {
        use serde_json::json;
        let meta = |name: &str| json!({"name": name, "namespace": "default"});
        vec![
            (
                Kind::Secret,
                vec![
                    json!({"apiVersion": "v1", "kind": "Secret", "metadata": meta("s"), "stringData": {"a": "b"}, "data": {"c": "ZA=="}}),
                    json!({"apiVersion": "v1", "kind": "Secret", "metadata": meta("t")}),
                ],
            ),
            (
                Kind::MachineClass,
                vec![
                    json!({"apiVersion": API_VERSION, "kind": "MachineClass", "metadata": meta("c"), "spec": {"driver": "fake", "providerSpec": {}}}),
                    json!({"apiVersion": API_VERSION, "kind": "MachineClass", "metadata": meta("d"), "spec": {"driver": "fake", "providerSpec": {}},
                    "status": {"conditions": [{"type": "Valid", "status": "False", "reason": "Invalid", "message": "m", "lastTransitionTime": "2024-01-01T00:00:00Z"}]}}),
                ],
            ),
            (
                Kind::MachineDeployment,
                vec![
                    json!({"apiVersion": API_VERSION, "kind": "MachineDeployment", "metadata": meta("web"), "spec": {"replicas": 3, "template": {"spec": {"classRef": {"name": "c"}}}}}),
                    json!({"apiVersion": API_VERSION, "kind": "MachineDeployment", "metadata": meta("api"),
                    "spec": {"replicas": 2, "template": {"spec": {"classRef": {"name": "c"}}}, "strategy": {"type": "InPlace"}},
                    "status": {"replicas": 2, "updatedReplicas": 1, "readyReplicas": 1, "availableReplicas": 1, "targetRevision": "abc",
                        "badRevisions": [{"revision": "0123456789abcdef0123", "reason": "r", "time": "2024-01-01T00:00:00Z"}, {"revision": "fedcba98765432100000", "reason": "r", "time": "2024-01-01T00:00:00Z"}],
                        "conditions": [{"type": "Progressing", "status": "True", "reason": "NewRevisionAvailable", "message": "", "lastTransitionTime": "2024-01-01T00:00:00Z"}]}}),
                ],
            ),
            (
                Kind::MachinePool,
                vec![
                    json!({"apiVersion": API_VERSION, "kind": "MachinePool", "metadata": meta("p"), "spec": {"replicas": 4, "template": {"spec": {"classRef": {"name": "c"}}}},
                    "status": {"replicas": 3, "readyReplicas": 2, "updatedReplicas": 1, "providerId": "pool-1"}}),
                ],
            ),
            (
                Kind::Machine,
                vec![
                    json!({"apiVersion": API_VERSION, "kind": "Machine", "metadata": meta("m"), "spec": {"classRef": {"name": "c"}}}),
                    json!({"apiVersion": API_VERSION, "kind": "Machine", "metadata": {"name": "n", "namespace": "default", "labels": {LABEL_REVISION: "r1"}},
                    "spec": {"classRef": {"name": "c"}},
                    "status": {"phase": "Running", "providerId": "fake:///a/1", "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}],
                        "nodeRef": {"name": "node-1"},
                        "lastOperation": {"type": "Create", "state": "Succeeded", "code": "OK", "requestId": "req-1", "time": "2024-01-01T00:00:00Z"}}}),
                ],
            ),
            (
                Kind::MachineHealthCheck,
                vec![
                    json!({"apiVersion": API_VERSION, "kind": "MachineHealthCheck", "metadata": meta("web"), "spec": {"selector": {"matchLabels": {"a": "b"}}}}),
                    json!({"apiVersion": API_VERSION, "kind": "MachineHealthCheck", "metadata": meta("api"),
                    "spec": {"selector": {"matchLabels": {"a": "b"}}, "maxUnhealthy": "40%"},
                    "status": {"expectedMachines": 5, "currentHealthy": 4, "remediationsAllowed": 1}}),
                ],
            ),
        ]
    }

    /// What `get` printed before the columns were declared on the types (checked against that
    /// code when they moved), and the tables of kinds added since.
    fn golden(kind: Kind, wide: bool) -> Vec<Vec<&'static str>> {
        match (kind, wide) {
            (Kind::Secret, _) => vec![vec!["NAME", "KEYS", "AGE"], vec!["s", "2", "-"], vec!["t", "0", "-"]],
            (Kind::MachineClass, _) => vec![
                vec!["NAME", "DRIVER", "VALID", "AGE"],
                vec!["c", "fake", "-", "-"],
                vec!["d", "fake", "False/Invalid", "-"],
            ],
            (Kind::MachineDeployment, false) => vec![
                vec!["NAME", "DESIRED", "CURRENT", "UPDATED", "READY", "AVAILABLE", "REVISION", "AGE"],
                vec!["web", "3", "0", "0", "0", "0", "-", "-"],
                vec!["api", "2", "2", "1", "1", "1", "abc", "-"],
            ],
            (Kind::MachineDeployment, true) => vec![
                vec![
                    "NAME",
                    "DESIRED",
                    "CURRENT",
                    "UPDATED",
                    "READY",
                    "AVAILABLE",
                    "REVISION",
                    "AGE",
                    "STRATEGY",
                    "DOMAINS",
                    "PROGRESSING",
                    "BAD-REVISIONS",
                ],
                vec!["web", "3", "0", "0", "0", "0", "-", "-", "RollingUpdate", "-", "-", ""],
                vec![
                    "api",
                    "2",
                    "2",
                    "1",
                    "1",
                    "1",
                    "abc",
                    "-",
                    "InPlace",
                    "-",
                    "True/NewRevisionAvailable",
                    "0123456789abcdef0123,fedcba9876543210000",
                ],
            ],
            (Kind::MachinePool, _) => {
                vec![vec!["NAME", "DESIRED", "CURRENT", "READY", "UPDATED", "AGE"], vec!["p", "4", "3", "2", "1", "-"]]
            }
            (Kind::Machine, false) => vec![
                vec!["NAME", "PHASE", "NODE", "PROVIDER-ID", "AGE"],
                vec!["m", "Pending", "-", "-", "-"],
                vec!["n", "Running", "node-1", "fake:///a/1", "-"],
            ],
            (Kind::Machine, true) => vec![
                vec![
                    "NAME",
                    "PHASE",
                    "NODE",
                    "PROVIDER-ID",
                    "AGE",
                    "CLASS",
                    "DOMAIN",
                    "REVISION",
                    "ADDRESS",
                    "LAST-OP",
                    "REQUEST-ID",
                ],
                vec!["m", "Pending", "-", "-", "-", "c", "-", "-", "-", "-", "-"],
                vec![
                    "n",
                    "Running",
                    "node-1",
                    "fake:///a/1",
                    "-",
                    "c",
                    "-",
                    "r1",
                    "10.0.0.1",
                    "Create/Succeeded/OK",
                    "req-1",
                ],
            ],
            (Kind::MachineHealthCheck, false) => vec![
                vec!["NAME", "EXPECTED", "HEALTHY", "REMEDIATIONS-ALLOWED", "AGE"],
                vec!["web", "0", "0", "0", "-"],
                vec!["api", "5", "4", "1", "-"],
            ],
            (Kind::MachineHealthCheck, true) => vec![
                vec!["NAME", "EXPECTED", "HEALTHY", "REMEDIATIONS-ALLOWED", "AGE", "MAX-UNHEALTHY"],
                vec!["web", "0", "0", "0", "-", "100%"],
                vec!["api", "5", "4", "1", "-", "40%"],
            ],
        }
    }

    #[test]
    fn get_prints_each_kinds_declared_columns() {
        for (kind, raw) in samples() {
            for wide in [false, true] {
                assert_eq!(table(kind, raw.clone(), wide).unwrap(), golden(kind, wide), "{kind} wide={wide}");
            }
        }
        let kinds: Vec<Kind> = samples().into_iter().map(|(k, _)| k).collect();
        assert_eq!(kinds, Kind::ALL, "a sample of every kind");
    }

    #[test]
    fn every_kind_is_named_by_its_plural_short_names_and_aliases() {
        for kind in Kind::ALL {
            for name in [kind.as_str(), kind.plural()].iter().chain(kind.short_names()).chain(kind.aliases()) {
                assert_eq!(Kind::parse(name), Some(kind), "{name}");
                assert_eq!(Kind::parse(&name.to_uppercase()), Some(kind), "{name}");
            }
        }
        let e = kind_arg("gizmos").unwrap_err().message;
        assert!(e.starts_with("unknown kind \"gizmos\"; use ") && e.contains("machines (m), "), "{e}");
    }
}
