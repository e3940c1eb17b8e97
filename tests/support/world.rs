//! One test world for the end-to-end tests: a driver sidecar (any driver binary, [`Driver`]), a
//! store, and controllers, built with [`World::builder`] and cleaned up when dropped. The tests
//! and the benchmarks start sidecars and controllers through it (a benchmark with release
//! builds: [`Builder::controller_binary`], [`Builder::timings`]).
//!
//! ```no_run
//! # async fn f() {
//! use e2e_tests::world::{Driver, World};
//! let w = World::builder()
//!     .driver(Driver::fake(&["--create-latency", "300ms"]))
//!     .controller_args(&["--resync-interval", "5s"])
//!     .in_process()
//!     .start()
//!     .await;
//! w.apply("apiVersion: machine.driver.dev/v1alpha1\nkind: MachineClass\n…").await;
//! # }
//! ```
//!
//! Two modes:
//! - **process** (the default): the driver sidecar and every controller are the real binaries,
//!   as a user runs them; they can be killed with `kill -9` and restarted, and their logs are
//!   files that failures print.
//! - **in-process** ([`Builder::in_process`], fake driver and embedded store only): the fake
//!   cloud is served on a Unix socket and the controller's store and runtime run as tasks of the
//!   test's own tokio runtime, wired the way `machine-controller run` wires them. For tests that
//!   kill nothing and read no process log.
//!
//! Nothing binds a port to hand it over: sidecars serve on Unix sockets in the world's folder,
//! and a controller's metrics listener (`--metrics-addr 127.0.0.1:0`, [`Builder::metrics`]) is
//! read back from the address the controller logs. Tests read state through the store API or
//! the CLI, never the store's file (a benchmark may: [`World::store_path`]).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::collections::HashSet;

use driver_sdk::DriverClient;
use fake_driver::pb as fake;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use machine_controller::resources::{Machine, MachineDeployment};
use machine_controller::store::kubernetes::KubernetesBackend;
use machine_controller::store::sqlite::SqliteBackend;
use machine_controller::store::{Backend, Store};
use tokio::process::{Child, Command};

use crate::kube_cluster::Cluster;
use crate::{addr_after, bin, rolled_out, Sidecar, READY};

/// How long one CLI command may take.
const CLI: Duration = Duration::from_secs(60);

/// The timings every controller of a world gets first, unless [`Builder::timings`] replaces
/// them: fast enough for tests.
const TEST_TIMINGS: [&str; 4] = ["--debounce", "20ms", "--health-check-interval", "1s"];

/// A driver sidecar: a binary, its arguments and environment, and the name the controller knows
/// it by (`--driver NAME=…`, which classes name in `spec.driver`). Any driver binary that takes
/// `--endpoint` fits (every SDK driver, the Go driver); [`Driver::fake`], [`Driver::go`] and
/// [`Driver::azure`] are shorthands for this repository's. A [`World`] runs one
/// ([`Builder::driver`]); [`Driver::start`] runs one on its own.
///
/// ```no_run
/// # async fn f() {
/// use e2e_tests::world::Driver;
/// let aws = Driver::binary("aws-ec2-driver").named("aws").args(["--dev"]).env([("AWS_REGION", "eu-west-1")]);
/// let sidecar = aws.start().await;
/// # }
/// ```
///
/// The sidecar gets `--endpoint …` and then the arguments, and the test's environment with
/// `RUST_LOG=info`, without `OTEL_EXPORTER_OTLP_ENDPOINT`, and then the driver's variables.
#[derive(Debug, Clone)]
#[must_use]
pub struct Driver {
    binary: PathBuf,
    name: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

fn owned(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| a.to_string()).collect()
}

impl Driver {
    /// `binary` (a workspace binary's or example's name, or a path) with no arguments,
    /// named after its file name without `-driver` (`aws-ec2-driver`: `aws-ec2`).
    pub fn binary(binary: impl Into<PathBuf>) -> Self {
        let binary = binary.into();
        let file = binary.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
        let name = file.strip_suffix("-driver").unwrap_or(&file).to_string();
        Driver { binary, name, args: Vec::new(), env: Vec::new() }
    }

    /// The name the controller registers the driver under.
    pub fn named(mut self, name: &str) -> Self {
        self.name = name.into();
        self
    }

    /// More arguments, after those given so far.
    pub fn args<S: AsRef<str>>(mut self, args: impl IntoIterator<Item = S>) -> Self {
        self.args.extend(args.into_iter().map(|a| a.as_ref().to_string()));
        self
    }

    /// More environment variables for the sidecar process.
    pub fn env<K: AsRef<str>, V: AsRef<str>>(mut self, vars: impl IntoIterator<Item = (K, V)>) -> Self {
        self.env.extend(vars.into_iter().map(|(k, v)| (k.as_ref().to_string(), v.as_ref().to_string())));
        self
    }

    /// `fake-driver ARGS`, named `fake`.
    pub fn fake(args: &[&str]) -> Self {
        Driver::binary("fake-driver").named("fake").args(args)
    }

    /// The Go driver ([`go_driver`]) with `--dev ARGS`, named `go`.
    pub fn go(args: &[&str]) -> Self {
        Driver::binary(go_driver()).named("go").args(["--dev"]).args(args)
    }

    /// The `dist` build of `fake-driver` ([`dist_bin`](crate::dist_bin), for benchmarks) with
    /// `ARGS`, named `fake`, quiet (`RUST_LOG=warn`).
    pub fn dist_fake(args: &[&str]) -> Self {
        Driver::binary(crate::dist_bin("fake-driver")).named("fake").args(args).env([("RUST_LOG", "warn")])
    }

    /// `azure-vmss-driver ARGS` (its ARM endpoint among them), named `azure`.
    pub fn azure(args: &[&str]) -> Self {
        Driver::binary("azure-vmss-driver").named("azure").args(args)
    }

    /// The name the controller registers the driver under (`--driver NAME=…`), which classes
    /// name in `spec.driver`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Starts the sidecar on a Unix socket in a new temporary folder and waits until it answers
    /// a Probe.
    ///
    /// # Panics
    /// If it exits first or is not ready within [`READY`] (with its log).
    pub async fn start(&self) -> Sidecar {
        self.start_in(tempfile::tempdir().expect("tempdir")).await
    }

    /// Like [`Driver::start`], in `dir` (to restart on the same socket and state).
    pub async fn start_in(&self, dir: tempfile::TempDir) -> Sidecar {
        Sidecar::launch(self, dir, false).await
    }

    /// Like [`Driver::start`], on `tcp://127.0.0.1:0`: the port the sidecar bound is read from
    /// its log ("serving on tcp://…"), so no other process can take it first.
    pub async fn start_tcp(&self) -> Sidecar {
        Sidecar::launch(self, tempfile::tempdir().expect("tempdir"), true).await
    }

    /// The program to run: a bare name is a workspace binary ([`bin`]); a path (e.g. the Go
    /// driver, built outside the workspace, or a release build) is run as it is.
    pub(crate) fn program(&self) -> PathBuf {
        if self.binary.components().count() == 1 && !self.binary.is_absolute() {
            bin(&self.binary.to_string_lossy())
        } else {
            self.binary.clone()
        }
    }

    /// The binary's file name, for logs.
    pub(crate) fn label(&self) -> String {
        self.binary.file_name().map_or_else(|| self.name.clone(), |n| n.to_string_lossy().into_owned())
    }

    pub(crate) fn arguments(&self) -> &[String] {
        &self.args
    }

    pub(crate) fn environment(&self) -> impl Iterator<Item = (&str, &str)> {
        self.env.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// `fake-driver` with no extra environment: what an in-process world can serve itself.
    fn is_plain_fake(&self) -> bool {
        self.binary == Path::new("fake-driver") && self.env.is_empty()
    }
}

/// The Go driver binary. Never skipped: a missing binary fails with the command that builds it.
pub fn go_driver() -> String {
    let how = "build it and pass its path: \
               GO_DRIVER_BIN=\"$(bash tests/tools/build-go-driver.sh)\" cargo test -p e2e-tests --test e2e go_driver:: \
               (cargo xtask e2e does this)";
    let path = std::env::var("GO_DRIVER_BIN").unwrap_or_default();
    assert!(!path.is_empty(), "GO_DRIVER_BIN is not set: {how}");
    assert!(Path::new(&path).is_absolute(), "GO_DRIVER_BIN={path} must be an absolute path: {how}");
    assert!(Path::new(&path).is_file(), "GO_DRIVER_BIN={path} does not exist: {how}");
    path
}

enum StoreChoice {
    Sqlite,
    Kubernetes { cluster: Arc<Cluster>, namespace_prefix: String },
}

/// Builds a [`World`]; see the module docs.
#[must_use]
pub struct Builder {
    driver: Driver,
    store: StoreChoice,
    controller_binary: Option<PathBuf>,
    controller_env: Vec<(String, String)>,
    timings: Vec<String>,
    controller_args: Vec<String>,
    controller: bool,
    metrics: bool,
    in_process: bool,
    manifest: Option<String>,
    store_layer: Option<StoreLayer>,
    as_service_account: bool,
}

/// What an in-process world's controller puts between itself and the embedded backend.
type StoreLayer = Arc<dyn Fn(Arc<dyn Backend>) -> Arc<dyn Backend> + Send + Sync>;

impl Default for Builder {
    fn default() -> Self {
        Self {
            driver: Driver::fake(&[]),
            store: StoreChoice::Sqlite,
            controller_binary: None,
            controller_env: Vec::new(),
            timings: owned(&TEST_TIMINGS),
            controller_args: Vec::new(),
            controller: true,
            metrics: false,
            in_process: false,
            manifest: None,
            store_layer: None,
            as_service_account: false,
        }
    }
}

impl Builder {
    /// The driver sidecar, any binary ([`Driver::binary`]; default: `fake-driver` with its
    /// default arguments).
    pub fn driver(mut self, driver: Driver) -> Self {
        self.driver = driver;
        self
    }

    /// The store is the embedded SQLite store in the world's folder (the default).
    pub fn sqlite(mut self) -> Self {
        self.store = StoreChoice::Sqlite;
        self
    }

    /// The store is `cluster`'s API server, in a new namespace named after `namespace_prefix`;
    /// controllers run with `--store kubernetes --namespace NS` and the cluster's kubeconfig.
    /// The world holds the cluster ([`World::cluster`]): a `Cluster` given here stops with the
    /// world, an `Arc<Cluster>` (one cluster for several worlds) with its last holder.
    pub fn kubernetes(mut self, cluster: impl Into<Arc<Cluster>>, namespace_prefix: &str) -> Self {
        self.store = StoreChoice::Kubernetes { cluster: cluster.into(), namespace_prefix: namespace_prefix.into() };
        self
    }

    /// With a Kubernetes store: the controllers authenticate as the ServiceAccount of
    /// `deploy/controller.yaml`, with its RBAC ([`Cluster::controller_kubeconfig`]), not as the
    /// administrator; [`World::assert_controller_never_forbidden`] reads the audit log. The CLI
    /// ([`World::cli`]) stays the administrator's, as a user's.
    pub fn as_service_account(mut self) -> Self {
        self.as_service_account = true;
        self
    }

    /// The `machine-controller` binary the controllers and [`World::cli`] run (default: the
    /// workspace's, [`bin`]); e.g. a release build for a benchmark.
    pub fn controller_binary(mut self, binary: impl Into<PathBuf>) -> Self {
        self.controller_binary = Some(binary.into());
        self
    }

    /// More environment variables for every controller process (after `RUST_LOG=info`).
    pub fn controller_env<K: AsRef<str>, V: AsRef<str>>(mut self, vars: impl IntoIterator<Item = (K, V)>) -> Self {
        self.controller_env.extend(vars.into_iter().map(|(k, v)| (k.as_ref().to_string(), v.as_ref().to_string())));
        self
    }

    /// The timing flags every controller gets first, instead of the tests' fast ones
    /// (`--debounce 20ms --health-check-interval 1s`); `&[]` leaves the binary's defaults (a
    /// benchmark).
    pub fn timings(mut self, args: &[&str]) -> Self {
        self.timings = owned(args);
        self
    }

    /// Arguments every controller of this world gets after `run --driver …` and the timings
    /// (and before those of [`World::start_controller`]).
    pub fn controller_args(mut self, args: &[&str]) -> Self {
        self.controller_args.extend(owned(args));
        self
    }

    /// Start no controller ([`World::start_controller`] starts them).
    pub fn without_controller(mut self) -> Self {
        self.controller = false;
        self
    }

    /// Controllers serve /metrics, /healthz and /readyz on `127.0.0.1:0`; [`World::metrics_addr`]
    /// reads the address each one bound from its log.
    pub fn metrics(mut self) -> Self {
        self.metrics = true;
        self
    }

    /// `yaml` (classes, secrets) is applied with the CLI once the first controller runs.
    pub fn manifest(mut self, yaml: &str) -> Self {
        self.manifest = Some(yaml.into());
        self
    }

    /// Real processes (the default).
    pub fn process(mut self) -> Self {
        self.in_process = false;
        self
    }

    /// The fake driver, the store and the controller's runtime in this test's tokio runtime
    /// (fake driver and embedded store only).
    pub fn in_process(mut self) -> Self {
        self.in_process = true;
        self
    }

    /// An in-process world's controller reads and writes its store through `layer` over the
    /// embedded backend: a test's own [`Backend`] in between (to inject a conflicting write, say,
    /// at the one seam the controller has for it). The test's own handles
    /// ([`World::store`]) go straight to the file.
    pub fn store_layer(mut self, layer: impl Fn(Arc<dyn Backend>) -> Arc<dyn Backend> + Send + Sync + 'static) -> Self {
        self.store_layer = Some(Arc::new(layer));
        self
    }

    /// Starts the driver, then (unless [`Builder::without_controller`]) a controller.
    ///
    /// # Panics
    /// In-process with another driver than the fake or another store than SQLite; a driver that
    /// does not become ready within [`READY`].
    pub async fn start(self) -> World {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut controller_kubeconfig = None;
        let (store, cluster) = match self.store {
            StoreChoice::Sqlite => (WorldStore::Sqlite(dir.path().join("store.db")), None),
            StoreChoice::Kubernetes { cluster, namespace_prefix } => {
                let ns = cluster.namespace(&namespace_prefix).await;
                let store = Store::new(Arc::new(KubernetesBackend::new(cluster.client.clone(), Some(ns.clone()))));
                controller_kubeconfig = Some(if self.as_service_account {
                    cluster.controller_kubeconfig().await
                } else {
                    cluster.kubeconfig.clone()
                });
                (WorldStore::Kubernetes { ns, store }, Some(cluster))
            }
        };
        let driver = if self.in_process {
            assert!(
                self.driver.is_plain_fake(),
                "in-process worlds run the fake driver only; use .process() for {:?}",
                self.driver
            );
            assert!(matches!(store, WorldStore::Sqlite(_)), "in-process worlds use the embedded store only");
            DriverSlot::InProcess(InProcessFake::start(dir.path(), self.driver.arguments()).await)
        } else {
            DriverSlot::Process(Some(Box::new(self.driver.start().await)))
        };
        assert!(self.store_layer.is_none() || self.in_process, "a store layer needs an in-process world");
        let in_process_store = match (&store, self.in_process) {
            (WorldStore::Sqlite(path), true) => {
                let backend: Arc<dyn Backend> =
                    Arc::new(SqliteBackend::open(path).expect("opening the embedded store"));
                Some(Store::new(match &self.store_layer {
                    Some(layer) => layer(backend),
                    None => backend,
                }))
            }
            _ => None,
        };
        let mut w = World {
            controllers: Vec::new(),
            driver_slot: driver,
            driver: self.driver,
            store,
            in_process_store,
            controller_binary: self.controller_binary.unwrap_or_else(|| bin("machine-controller")),
            controller_env: self.controller_env,
            controller_kubeconfig,
            timings: self.timings,
            controller_args: self.controller_args,
            metrics: self.metrics,
            cluster,
            dir,
        };
        if self.controller {
            w.start_controller(&[]);
        }
        if let Some(yaml) = self.manifest {
            w.apply(&yaml).await;
        }
        w
    }
}

enum WorldStore {
    Sqlite(PathBuf),
    Kubernetes { ns: String, store: Store },
}

enum DriverSlot {
    /// `None` between a kill and the restart (boxed: a Sidecar is large).
    Process(Option<Box<Sidecar>>),
    InProcess(InProcessFake),
}

enum ControllerSlot {
    Process {
        child: Child,
        log: PathBuf,
    },
    InProcess {
        stop: Option<tokio::sync::oneshot::Sender<()>>,
        task: tokio::task::JoinHandle<()>,
    },
    /// Killed with kill -9; its log stays.
    Killed {
        log: PathBuf,
    },
}

/// One test's world: a driver sidecar, a store, controllers, and a scratch folder. Dropping it
/// stops the controllers first, then the driver, then removes the folder (and lets go of the
/// Kubernetes cluster it holds, which stops with its last holder).
pub struct World {
    controllers: Vec<ControllerSlot>,
    driver_slot: DriverSlot,
    driver: Driver,
    store: WorldStore,
    in_process_store: Option<Store>,
    controller_binary: PathBuf,
    controller_env: Vec<(String, String)>,
    /// The kubeconfig of controllers with a Kubernetes store.
    controller_kubeconfig: Option<PathBuf>,
    timings: Vec<String>,
    controller_args: Vec<String>,
    metrics: bool,
    cluster: Option<Arc<Cluster>>,
    dir: tempfile::TempDir,
}

impl Drop for World {
    fn drop(&mut self) {
        for c in &mut self.controllers {
            match c {
                // kill_on_drop: killed when the child is dropped below.
                ControllerSlot::Process { child, .. } => {
                    let _ = child.start_kill();
                }
                ControllerSlot::InProcess { stop, task } => {
                    if let Some(stop) = stop.take() {
                        let _ = stop.send(());
                    }
                    task.abort();
                }
                ControllerSlot::Killed { .. } => {}
            }
        }
        self.controllers.clear();
        if let DriverSlot::InProcess(f) = &mut self.driver_slot {
            f.stop();
        }
    }
}

impl World {
    /// One test's world on a whole cluster (`Cluster::start_full`) in a new namespace named after
    /// `namespace_prefix`: a fake cloud with `fake_args` whose VMs join it as Nodes (by TLS
    /// bootstrap, from the boot data of a [`crate::joining_class`]), and no controller yet (the
    /// test starts it; it runs with `--store kubernetes`, so the target cluster is the same, as
    /// the ServiceAccount of `deploy/controller.yaml`: [`Builder::as_service_account`]).
    pub async fn on_full_cluster(fake_args: &[&str], namespace_prefix: &str) -> World {
        let cluster = Cluster::start_full().await;
        let kubeconfig = cluster.kubeconfig.to_string_lossy().into_owned();
        let mut args = fake_args.to_vec();
        args.extend(["--join-cluster", &kubeconfig]);
        World::builder()
            .driver(Driver::fake(&args))
            .kubernetes(cluster, namespace_prefix)
            .as_service_account()
            .controller_args(&["--resync-interval", "5s", "--drain-poll-interval", "500ms"])
            .without_controller()
            .start()
            .await
    }

    /// A builder: process mode, the fake driver, the embedded store, one controller.
    pub fn builder() -> Builder {
        Builder::default()
    }

    /// The world's scratch folder (store file, logs, manifests).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The embedded store's file (for a benchmark that reads it as it is; tests read through
    /// [`World::store`] or [`World::cli`]).
    ///
    /// # Panics
    /// In a world on the Kubernetes store.
    pub fn store_path(&self) -> &Path {
        match &self.store {
            WorldStore::Sqlite(path) => path,
            WorldStore::Kubernetes { .. } => panic!("a world on the Kubernetes store has no store file"),
        }
    }

    /// The Kubernetes cluster of a [`Builder::kubernetes`] world.
    pub fn cluster(&self) -> &Cluster {
        self.cluster.as_deref().expect("a world with a Kubernetes store")
    }

    /// The namespace the world's objects live in (`default` on the embedded store).
    pub fn ns(&self) -> &str {
        match &self.store {
            WorldStore::Sqlite(_) => "default",
            WorldStore::Kubernetes { ns, .. } => ns,
        }
    }

    // ----- the driver -----

    /// The driver's endpoint (`unix://…`).
    pub fn endpoint(&self) -> String {
        match &self.driver_slot {
            DriverSlot::Process(s) => s.as_ref().expect("the sidecar runs").endpoint(),
            DriverSlot::InProcess(f) => f.endpoint(),
        }
    }

    /// The driver sidecar process.
    ///
    /// # Panics
    /// In an in-process world (use [`Builder::process`] to read the sidecar's log or kill it).
    pub fn sidecar(&self) -> &Sidecar {
        match &self.driver_slot {
            DriverSlot::Process(s) => s.as_deref().expect("the sidecar runs"),
            DriverSlot::InProcess(_) => panic!("the fake driver runs in-process; use .process() for its process"),
        }
    }

    /// A client of the driver.
    pub async fn driver_client(&self) -> DriverClient {
        tokio::time::timeout(READY, DriverClient::connect(&self.endpoint()))
            .await
            .expect("connecting to the driver in time")
            .expect("connect to the driver")
    }

    /// The fake cloud's inspection API.
    pub async fn fake(&self) -> fake::fake_cloud_client::FakeCloudClient<tonic::transport::Channel> {
        fake::fake_cloud_client::FakeCloudClient::new(self.driver_client().await.channel())
    }

    /// What the fake cloud holds now.
    pub async fn inspect(&self) -> fake::InspectResponse {
        let call = async { self.fake().await.inspect(fake::InspectRequest::default()).await };
        tokio::time::timeout(READY, call).await.expect("Inspect in time").expect("Inspect").into_inner()
    }

    /// Replaces the fake cloud's fault rules.
    pub async fn set_faults(&self, rules: Vec<fake::FaultRule>) {
        let call = async { self.fake().await.set_faults(fake::SetFaultsRequest { rules }).await };
        tokio::time::timeout(READY, call).await.expect("SetFaults in time").expect("SetFaults");
    }

    /// kill -9 of the sidecar, and a new one with the same arguments on the same socket (and
    /// folder, so a state file survives).
    pub async fn restart_driver(&mut self) {
        let DriverSlot::Process(slot) = &mut self.driver_slot else {
            panic!("the fake driver runs in-process; use .process() to kill it")
        };
        let dir = slot.take().expect("the sidecar runs").kill9().await;
        *slot = Some(Box::new(self.driver.start_in(dir).await));
    }

    /// SIGTERM to the sidecar; returns its exit status and the socket it served on.
    pub async fn terminate_driver(&mut self) -> (std::process::ExitStatus, PathBuf) {
        let DriverSlot::Process(slot) = &mut self.driver_slot else {
            panic!("the fake driver runs in-process; use .process() to signal it")
        };
        let sidecar = slot.take().expect("the sidecar runs");
        let socket = sidecar.socket.clone();
        let (status, _dir) = sidecar.terminate().await;
        (status, socket)
    }

    // ----- controllers -----

    /// Starts a controller with the world's arguments and `extra`; returns its index.
    pub fn start_controller(&mut self, extra: &[&str]) -> usize {
        self.start_controller_env(extra, &[])
    }

    /// [`World::start_controller`] with more environment variables (after the world's): a
    /// `RUST_LOG` of its own, say. A process controller only.
    pub fn start_controller_env(&mut self, extra: &[&str], env: &[(&str, &str)]) -> usize {
        let i = self.controllers.len();
        let mut args = self.timings.clone();
        args.extend(self.controller_args.iter().cloned());
        if self.metrics {
            args.extend(owned(&["--metrics-addr", "127.0.0.1:0"]));
        }
        args.extend(owned(extra));
        let driver = format!("{}={}", self.driver.name(), self.endpoint());
        let slot = if let Some(store) = &self.in_process_store {
            start_in_process_controller(store.clone(), &driver, &args)
        } else {
            let log = self.dir.path().join(format!("controller-{i}.log"));
            let file = std::fs::File::create(&log).expect("controller log file");
            let mut cmd = Command::new(&self.controller_binary);
            match &self.store {
                WorldStore::Sqlite(path) => {
                    cmd.arg("--store").arg(path).arg("run");
                }
                WorldStore::Kubernetes { ns, .. } => {
                    cmd.args(["--store", "kubernetes", "run", "--namespace", ns]);
                    cmd.env("KUBECONFIG", self.controller_kubeconfig.as_ref().expect("a kubeconfig"));
                }
            }
            let child = cmd
                .args(["--driver", &driver])
                .args(&args)
                .env("RUST_LOG", "info")
                .envs(self.controller_env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .envs(env.iter().copied())
                .stdin(Stdio::null())
                .stdout(file.try_clone().expect("controller log file"))
                .stderr(file)
                .kill_on_drop(true)
                .spawn()
                .expect("starting machine-controller");
            ControllerSlot::Process { child, log }
        };
        self.controllers.push(slot);
        i
    }

    /// kill -9 of controller `i` (waits for it to be gone). A no-op for one already killed.
    pub async fn kill9_controller(&mut self, i: usize) {
        match &mut self.controllers[i] {
            ControllerSlot::Process { child, log } => {
                tokio::time::timeout(READY, child.kill()).await.expect("kill -9 in time").expect("kill -9");
                let log = log.clone();
                self.controllers[i] = ControllerSlot::Killed { log };
            }
            ControllerSlot::InProcess { .. } => panic!("the controller runs in-process; use .process() to kill it"),
            ControllerSlot::Killed { .. } => {}
        }
    }

    /// kill -9 of the controller started last.
    pub async fn kill9(&mut self) {
        if let Some(i) = self.controllers.len().checked_sub(1) {
            self.kill9_controller(i).await;
        }
    }

    /// Waits (within `within`) for controller process `i` to exit by itself.
    pub async fn wait_controller_exit(&mut self, i: usize, within: Duration) -> std::process::ExitStatus {
        let ControllerSlot::Process { child, .. } = &mut self.controllers[i] else {
            panic!("controller {i} is not a running process")
        };
        tokio::time::timeout(within, child.wait())
            .await
            .unwrap_or_else(|_| panic!("controller {i} still running after {within:?}"))
            .expect("wait")
    }

    /// The process ID of controller `i`.
    ///
    /// # Panics
    /// If it runs in-process or was killed.
    pub fn controller_pid(&self, i: usize) -> u32 {
        match &self.controllers[i] {
            ControllerSlot::Process { child, .. } => child.id().expect("the controller runs"),
            _ => panic!("controller {i} is not a running process"),
        }
    }

    /// Controller `i`'s whole log ("" in-process).
    pub fn controller_log(&self, i: usize) -> String {
        match &self.controllers[i] {
            ControllerSlot::Process { log, .. } | ControllerSlot::Killed { log } => {
                std::fs::read_to_string(log).unwrap_or_default()
            }
            ControllerSlot::InProcess { .. } => String::new(),
        }
    }

    /// The ends of every controller's log and the sidecar's, for failure messages.
    pub fn logs(&self) -> String {
        let mut out: Vec<String> = (0..self.controllers.len())
            .map(|i| match &self.controllers[i] {
                ControllerSlot::InProcess { .. } => format!("--- controller {i}: in-process, no log"),
                _ => format!("--- controller {i}\n{}", tail(&self.controller_log(i), 40)),
            })
            .collect();
        if let DriverSlot::Process(Some(s)) = &self.driver_slot {
            out.push(format!("--- {}\n{}", self.driver.label(), tail(&s.log_text(), 15)));
        }
        if let Some(cluster) = &self.cluster {
            let forbidden = cluster.controller_forbidden();
            if !forbidden.is_empty() {
                out.push(format!("--- the controller's requests refused (403)\n{}", forbidden.join("\n")));
            }
        }
        out.join("\n")
    }

    /// The address controller `i` serves /metrics, /healthz and /readyz on ([`Builder::metrics`]),
    /// as it logged it once bound.
    pub async fn metrics_addr(&self, i: usize) -> std::net::SocketAddr {
        let what = format!("controller {i}'s metrics address in its log");
        self.wait_for(&what, READY, || async { addr_after(&self.controller_log(i), "metrics on http://") }).await
    }

    // ----- the store and the CLI -----

    /// The store the controllers use: the embedded store, opened afresh so it reads everything
    /// committed so far (by the CLI, a controller process, or the in-process runtime, whose own
    /// handle learns of other processes' commits only by polling), or the world's namespace
    /// through the API server.
    pub fn store(&self) -> Store {
        match &self.store {
            WorldStore::Sqlite(path) => Store::open(path).expect("opening the embedded store"),
            WorldStore::Kubernetes { store, .. } => store.clone(),
        }
    }

    /// Fails the test if the API server refused any request of the controller's ServiceAccount
    /// (its audit log: `403`), naming each; returns how many requests it made.
    pub fn assert_controller_never_forbidden(&self) -> usize {
        let forbidden = self.cluster().controller_forbidden();
        let made = self.cluster().controller_requests();
        assert!(
            forbidden.is_empty(),
            "{} of the controller's {made} requests were refused (deploy/controller.yaml's RBAC):\n{}",
            forbidden.len(),
            forbidden.join("\n")
        );
        made
    }

    /// `machine-controller --store … ARGS`: exit code, stdout, stderr (within a minute).
    pub async fn cli(&self, args: &[&str]) -> (i32, String, String) {
        let mut cmd = Command::new(&self.controller_binary);
        match &self.store {
            WorldStore::Sqlite(path) => {
                cmd.arg("--store").arg(path);
            }
            WorldStore::Kubernetes { .. } => {
                cmd.args(["--store", "kubernetes"]).env("KUBECONFIG", &self.cluster().kubeconfig);
            }
        }
        let out = tokio::time::timeout(CLI, cmd.args(args).stdin(Stdio::null()).kill_on_drop(true).output())
            .await
            .unwrap_or_else(|_| panic!("machine-controller {args:?} did not finish in {CLI:?}"))
            .expect("running machine-controller");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// `machine-controller apply -f` of `yaml` (written into the world's folder); fails the test
    /// when the CLI refuses it.
    pub async fn apply(&self, yaml: &str) {
        let file = self.dir.path().join(format!("m-{}.yaml", uuid::Uuid::new_v4()));
        std::fs::write(&file, yaml).expect("writing the manifest");
        let (code, out, err) = self.cli(&["apply", "-f", &file.to_string_lossy()]).await;
        assert_eq!(code, 0, "apply failed:\n{out}\n{err}");
    }

    /// The MachineDeployment `name` of the world's namespace.
    pub async fn md(&self, name: &str) -> MachineDeployment {
        self.store().get::<MachineDeployment>(self.ns(), name).await.expect("reading the store").expect("deployment")
    }

    /// The Machines of the world's namespace.
    pub async fn machines(&self) -> Vec<Machine> {
        let all = self.store().list::<Machine>().await.expect("listing machines");
        all.into_iter().filter(|m| m.metadata.namespace == self.ns()).collect()
    }

    /// The fake cloud and the store agree: every Machine has exactly one cloud machine, created
    /// once, and no cloud machine is without a Machine.
    pub async fn assert_consistent(&self, replicas: usize) {
        let cloud = self.inspect().await;
        let machines = self.machines().await;
        let names: HashSet<String> = machines.iter().map(|m| m.metadata.name.clone()).collect();
        let cloud_names: HashSet<String> = cloud.machines.iter().map(|m| m.name.clone()).collect();
        assert_eq!(names, cloud_names, "store and cloud disagree");
        assert_eq!(machines.len(), replicas);
        for m in &cloud.machines {
            assert_eq!(m.times_created, 1, "{} was created {} times", m.name, m.times_created);
        }
        let c = cloud.counters.expect("counters");
        // A VM that vanished without a delete (removed out of band, taken by the cloud at an
        // interruption's deadline) is no longer in the cloud either.
        let vanished = c.machines_removed_out_of_band + c.machines_reclaimed;
        assert_eq!(
            c.machines_created - c.machines_deleted - vanished,
            replicas as u64,
            "creates {} − deletes {} − vanished {vanished} ≠ {replicas}",
            c.machines_created,
            c.machines_deleted
        );
    }

    /// The world's namespace's `kind` objects (`plural`) through the API server.
    pub fn api(&self, kind: &str, plural: &str) -> Api<DynamicObject> {
        let gvk = GroupVersionKind::gvk("machine.driver.dev", "v1alpha1", kind);
        Api::namespaced_with(self.cluster().client.clone(), self.ns(), &ApiResource::from_gvk_with_plural(&gvk, plural))
    }

    /// Server-side apply of `obj` (a `machine.driver.dev/v1alpha1` `kind`), as
    /// `kubectl apply --server-side` does.
    pub async fn apply_object(&self, kind: &str, plural: &str, mut obj: serde_json::Value) {
        let name = obj["metadata"]["name"].as_str().expect("metadata.name").to_string();
        obj["apiVersion"] = serde_json::json!("machine.driver.dev/v1alpha1");
        obj["kind"] = serde_json::json!(kind);
        let (api, params, patch) = (self.api(kind, plural), PatchParams::apply("e2e-test").force(), Patch::Apply(&obj));
        tokio::time::timeout(CLI, api.patch(&name, &params, &patch))
            .await
            .unwrap_or_else(|_| panic!("applying {kind} {name}: no answer in {CLI:?}"))
            .unwrap_or_else(|e| panic!("applying {kind} {name}: {e}"));
    }

    /// Polls `f` until it returns `Some`; after `within`, fails with `what` and the logs.
    pub async fn wait_for<T, F, Fut>(&self, what: &str, within: Duration, mut f: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Option<T>>,
    {
        self.wait_seen(what, within, || {
            let look = f();
            async move { look.await.ok_or_else(|| "nothing yet".to_string()) }
        })
        .await
    }

    /// As [`World::wait_for`], with `f` saying what it saw instead (`Err`): a timeout names the
    /// last of it, then the logs.
    pub async fn wait_seen<T, F, Fut>(&self, what: &str, within: Duration, mut f: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, String>>,
    {
        let deadline = Instant::now() + within;
        let mut seen = String::from("nothing (every look ran past the deadline)");
        loop {
            match tokio::time::timeout_at(deadline.into(), f()).await {
                Ok(Ok(v)) => return v,
                Ok(Err(s)) => seen = s,
                Err(_) => {}
            }
            assert!(
                Instant::now() < deadline,
                "timed out after {within:?} waiting for {what}; last saw {seen}\n{}",
                self.logs()
            );
            // Deliberate: the interval between polls of a condition with a deadline.
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Waits until deployment `name` has all its replicas available, of its target revision,
    /// and no others.
    pub async fn converged(&self, name: &str, within: Duration) -> MachineDeployment {
        let store = self.store();
        let ns = self.ns().to_string();
        self.wait_for(&format!("deployment {name} rolled out"), within, || {
            let (store, ns) = (store.clone(), ns.clone());
            async move {
                let md = store.get::<MachineDeployment>(&ns, name).await.ok().flatten()?;
                rolled_out(&md).then_some(md)
            }
        })
        .await
    }
}

/// Workloads on the Nodes of a world's cluster.
impl World {
    /// The pods of the world's namespace, through the cluster's API server.
    pub fn pods_api(&self) -> Api<Pod> {
        Api::namespaced(self.cluster().client.clone(), self.ns())
    }

    /// Running, Ready pods of `app` (not being deleted).
    pub async fn ready_pods(&self, app: &str) -> Vec<Pod> {
        let pods = self.pods_api().list(&ListParams::default().labels(&format!("app={app}"))).await.unwrap().items;
        pods.into_iter().filter(crate::kube_cluster::pod_ready).collect()
    }

    /// A Deployment of `replicas` pods labelled `app=NAME`, spread over nodes, and optionally
    /// a PodDisruptionBudget with `budget` as its spec's rule ([`Cluster::workload`], in the
    /// world's namespace).
    pub async fn workload(&self, name: &str, replicas: i32, budget: Option<serde_json::Value>) {
        self.cluster().workload(self.ns(), name, replicas, budget).await;
    }
}

/// The last `lines` lines of `text`.
pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

// ----- in-process mode -----

/// The `machine-controller run` arguments, parsed as the binary parses them.
#[derive(clap::Parser)]
struct RunCli {
    #[command(flatten)]
    run: machine_controller::cli::RunArgs,
}

/// The store and runtime of `machine-controller run` as tasks of this runtime, with the
/// runtime configuration the binary would take from `args`.
fn start_in_process_controller(store: Store, driver: &str, args: &[String]) -> ControllerSlot {
    use clap::Parser;
    let argv = ["machine-controller", "--driver", driver].into_iter().map(String::from).chain(args.iter().cloned());
    let cli = RunCli::try_parse_from(argv).unwrap_or_else(|e| panic!("controller arguments {args:?}: {e}"));
    let run = cli.run;
    assert!(
        run.metrics_addr.is_none() && run.target_kubeconfig.is_none() && !run.leader_elect,
        "in-process controllers serve no metrics, manage no Nodes and elect no leader; use .process()"
    );
    let mut registry = prometheus_client::registry::Registry::default();
    let ctx =
        machine_controller::app::App::context(store, &run.drivers, run.config(), run.settings(), &mut registry, None)
            .expect("the driver endpoint");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(machine_controller::runtime::run(
        ctx,
        Arc::new(machine_controller::reconcile::Controller),
        async move {
            let _ = stopped.await;
        },
    ));
    ControllerSlot::InProcess { stop: Some(stop), task }
}

/// The fake cloud served on a Unix socket in the world's folder, in this runtime.
struct InProcessFake {
    socket: PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl InProcessFake {
    async fn start(dir: &Path, args: &[String]) -> InProcessFake {
        let (config, serve) = fake_config(args);
        let socket = dir.join("driver.sock");
        let serve = driver_sdk::ServeArgs { endpoint: format!("unix://{}", socket.display()), ..serve };
        let driver = fake_driver::shared(fake_driver::FakeDriver::new(config).expect("fake driver config"));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = driver_sdk::DriverServer::<fake_driver::FakeDriver>::new(driver.clone())
            .add_service(fake_driver::FakeCloudService::server(driver))
            .with_connection_hook(fake_driver::connections::cuttable)
            .register_descriptor_set(fake_driver::FILE_DESCRIPTOR_SET)
            .with_shutdown(async move {
                let _ = stopped.await;
            });
        let task = tokio::spawn(async move {
            if let Err(e) = server.serve(&serve).await {
                panic!("the in-process fake driver stopped: {}", driver_sdk::error_chain(&e));
            }
        });
        let f = InProcessFake { socket, stop: Some(stop), task };
        let deadline = Instant::now() + READY;
        loop {
            if f.socket.exists() {
                if let Ok(Ok(c)) = tokio::time::timeout(READY, DriverClient::connect(&f.endpoint())).await {
                    if c.probe(Default::default()).await.is_ok() {
                        return f;
                    }
                }
            }
            assert!(!f.task.is_finished(), "the in-process fake driver stopped before serving");
            assert!(Instant::now() < deadline, "the in-process fake driver not ready within {READY:?}");
            // Deliberate: the socket has no readiness feed; poll it.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn endpoint(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.abort();
    }
}

/// `fake-driver` arguments as the fake's [`fake_driver::Config`] and the server's
/// [`driver_sdk::ServeArgs`] (dev mode, as the binary runs without `--production`). Only the
/// flags the in-process tests use; any other fails the test.
fn fake_config(args: &[String]) -> (fake_driver::Config, driver_sdk::ServeArgs) {
    let mut config = fake_driver::Config::default();
    let serve = driver_sdk::ServeArgs { dev: true, ..Default::default() };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| panic!("fake-driver {flag}: a value is missing"));
        let duration = || driver_sdk::parse_duration(value).unwrap_or_else(|e| panic!("{flag} {value}: {e}"));
        let number = || value.parse::<f64>().unwrap_or_else(|e| panic!("{flag} {value}: {e}"));
        match flag.as_str() {
            "--create-latency" => config.create_latency = duration(),
            "--delete-latency" => config.delete_latency = duration(),
            "--update-latency" => config.update_latency = duration(),
            "--pool-latency" => config.pool_latency = duration(),
            "--max-machines" => config.max_machines = Some(number() as u32),
            "--rate-limit" => config.rate_limit = Some(number()),
            "--burst" => config.burst = number() as u32,
            "--api-key" => config.api_key = Some(value.clone()),
            "--state-file" => config.state_file = Some(PathBuf::from(value)),
            other => panic!("fake-driver {other} is not supported in-process; use .process()"),
        }
    }
    (config, serve)
}
