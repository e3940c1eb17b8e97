//! Machines as Kubernetes Nodes at scale (docs/src/operating/nodes.md), all in one process run so the
//! figures are comparable. Real processes: `fake-driver` and `machine-controller run` (`dist`
//! builds) over a Unix socket, started through the test harness (`e2e_tests::world`); a whole
//! test cluster from `tests/tools/install-kube-cluster.sh`
//! (kube-apiserver, etcd, kube-controller-manager, kube-scheduler, kwok) on the same machine,
//! started by `Cluster::start_full`. The controller runs on the embedded store (SQLite, read here
//! read-only) with `--target-kubeconfig` pointing at a counting proxy in front of the test
//! cluster ([`Proxy`]); the fake cloud's VMs register Nodes (`fake-driver --join-cluster`) that
//! kwok keeps Ready.
//!
//! 1. A rolling update with drain under load: 200 machines (one MachineDeployment, maxSurge 10%,
//!    maxUnavailable 0) carrying 2,000 pods (one Deployment spread over the nodes, a
//!    PodDisruptionBudget of maxUnavailable 10%). The template changes; timed until the
//!    deployment is rolled out again, every old Node is deleted and 2,000 pods are Ready on the
//!    new nodes. Also: the controller's requests per replaced machine (the proxy) and every
//!    client's (kube-apiserver's `apiserver_request_total`: the controller manager, the
//!    scheduler, kwok and the fake kubelets too), controller peak RSS, the fewest Ready pods a
//!    watch saw, and each old node's drain (cordon → last pod gone → Node deleted) from watches
//!    on Nodes and pods.
//! 2. 1,000 machines to Running, same run, on a fresh cluster: without a target cluster (no
//!    Nodes), and with Nodes joining (Running = Node Ready).
//! 3. Steady state: 1,000 machines with Ready Nodes carrying 10,000 pods (bound by the bench,
//!    `spec.nodeName` set; kwok runs them). Over a 5-minute window (longer than a watch's 290 s): the controller's requests to
//!    the target cluster per machine per minute, what its watches receive (bytes, events), its
//!    RSS and CPU against the same controller with the same machines and no target cluster,
//!    running through the same window.
//!
//! ```text
//! CARGO_TARGET_DIR=... cargo build --profile dist -p fake-driver -p machine-controller --features fake-driver/join-cluster
//! export KUBE_CLUSTER_DIR=$(bash tests/tools/install-kube-cluster.sh)
//! cargo bench -p e2e-tests --bench nodes_scale              # 200 machines / 2,000 pods; 1,000 machines
//! cargo bench -p e2e-tests --bench nodes_scale -- --quick   # 50 / 500; 200; steady 200 / 2,000, 1 min
//! cargo bench -p e2e-tests --bench nodes_scale -- --steady  # only 3. (add --quick for 200 / 2,000)
//! ```
//! Set BENCH_OUT=path to also write the markdown table there.

// Test code: a setup that fails is a failed test (the workspace warns of `unwrap` in what ships).
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use e2e_tests::kube_cluster::Cluster;
use e2e_tests::world::{Driver, World};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::Api;
use kube::runtime::{watcher, WatchStreamExt};
use machine_controller::resources::{Kind, MachineDeployment};
use machine_controller::store::Store;
use serde_json::json;

const CONTROLLER_ARGS: [&str; 12] = [
    "--workers",
    "10",
    "--driver-qps",
    "100000",
    "--driver-burst",
    "100000",
    "--drain-poll-interval",
    "1s",
    "--health-check-interval",
    "300s",
    "--resync-interval",
    "600s",
];

// ------------------------------------------------------------------------------ the cluster

/// The tails of the whole cluster's parts' logs (for a bench that times out).
fn cluster_logs(cluster: &Cluster) -> String {
    ["controller-manager.log", "scheduler.log", "kwok.log"]
        .iter()
        .map(|name| format!("--- {name}:\n{}", cluster.log(name)))
        .collect::<Vec<_>>()
        .join("\n")
}

// ------------------------------------------------------------------------------ the controller's requests

/// A plain-HTTP proxy in front of the API server for the controller's target cluster, counting
/// each request as "verb resource[/subresource]" (`apiserver_request_total` cannot tell the
/// controller's requests from kube-controller-manager's, the scheduler's and kwok's). It
/// forwards with an admin client that does not retry, so the controller sees every 429 itself.
struct Proxy {
    kubeconfig: PathBuf,
    counts: Arc<Mutex<BTreeMap<String, f64>>>,
    /// Response bytes and lines by "verb resource": a watch sends one JSON line per event.
    received: Arc<Mutex<BTreeMap<String, Received>>>,
    task: tokio::task::JoinHandle<()>,
    _dir: tempfile::TempDir,
}

impl Proxy {
    fn counts(&self) -> BTreeMap<String, f64> {
        self.counts.lock().unwrap().clone()
    }

    fn received(&self) -> BTreeMap<String, Received> {
        self.received.lock().unwrap().clone()
    }
}

/// What the controller received for one kind of request.
#[derive(Clone, Copy, Default, Debug)]
struct Received {
    bytes: u64,
    /// Newlines: a watch's events.
    lines: u64,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// "verb resource[/subresource]" of an API request, as the API server's metrics name them.
fn request_key(method: &http::Method, uri: &http::Uri) -> String {
    let path = uri.path().trim_end_matches('/');
    let rest = if let Some(r) = path.strip_prefix("/api/v1") {
        r
    } else if let Some(r) = path.strip_prefix("/apis/") {
        // group/version/rest
        r.splitn(3, '/').nth(2).unwrap_or("")
    } else {
        return format!("{} {path}", method.as_str().to_lowercase());
    };
    let mut segs: Vec<&str> = rest.split('/').filter(|s| !s.is_empty()).collect();
    if segs.first() == Some(&"namespaces") && segs.len() >= 3 {
        segs.drain(..2);
    }
    let resource = segs.first().copied().unwrap_or("");
    let named = segs.len() >= 2;
    let sub = segs.get(2).map(|s| format!("/{s}")).unwrap_or_default();
    let query = uri.query().unwrap_or("");
    let verb = match *method {
        http::Method::GET if named => "get",
        http::Method::GET if query.split('&').any(|q| q == "watch=true" || q == "watch=1") => "watch",
        http::Method::GET => "list",
        http::Method::POST => "post",
        http::Method::PUT => "put",
        http::Method::PATCH => "patch",
        http::Method::DELETE if named => "delete",
        http::Method::DELETE => "deletecollection",
        _ => method.as_str(),
    };
    format!("{verb} {resource}{sub}")
}

async fn start_proxy(cluster: &Cluster) -> Proxy {
    use http_body_util::BodyExt;
    let client = cluster.client_without_retries().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let counts: Arc<Mutex<BTreeMap<String, f64>>> = Arc::default();
    let received: Arc<Mutex<BTreeMap<String, Received>>> = Arc::default();
    let (c, r) = (counts.clone(), received.clone());
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let (client, counts, received) = (client.clone(), c.clone(), r.clone());
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let (client, counts, received) = (client.clone(), counts.clone(), received.clone());
                    async move {
                        let (parts, body) = req.into_parts();
                        let mut key = request_key(&parts.method, &parts.uri);
                        let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
                        let mut up = http::Request::builder()
                            .method(parts.method.clone())
                            .uri(parts.uri.path_and_query().map_or("/", |p| p.as_str()));
                        for (k, v) in &parts.headers {
                            if k != http::header::HOST && k != http::header::CONNECTION {
                                up = up.header(k, v);
                            }
                        }
                        let reply = client.send(up.body(kube::client::Body::from(body)).unwrap()).await;
                        let response = match reply {
                            Ok(r) => {
                                if key.ends_with("/eviction") {
                                    key = format!("{key} {}", r.status().as_u16());
                                }
                                let (mut parts, body) = r.into_parts();
                                parts.headers.remove(http::header::TRANSFER_ENCODING);
                                parts.headers.remove(http::header::CONNECTION);
                                let counted = key.clone();
                                let body = body.map_frame(move |frame| {
                                    if let Some(data) = frame.data_ref() {
                                        let mut received = received.lock().unwrap();
                                        let r = received.entry(counted.clone()).or_default();
                                        r.bytes += data.len() as u64;
                                        r.lines += data.iter().filter(|b| **b == b'\n').count() as u64;
                                    }
                                    frame
                                });
                                http::Response::from_parts(parts, body.boxed_unsync())
                            }
                            Err(e) => http::Response::builder()
                                .status(502)
                                .body(kube::client::Body::from(e.to_string().into_bytes()).boxed_unsync())
                                .unwrap(),
                        };
                        {
                            let mut counts = counts.lock().unwrap();
                            *counts.entry(key.split(' ').take(2).collect::<Vec<_>>().join(" ")).or_insert(0.0) += 1.0;
                            if key.split(' ').count() > 2 {
                                *counts.entry(key).or_insert(0.0) += 1.0;
                            }
                        }
                        Ok::<_, std::convert::Infallible>(response)
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1
kind: Config
clusters:
- name: proxy
  cluster: {{server: \"http://127.0.0.1:{port}\"}}
users:
- name: none
  user: {{}}
contexts:
- name: proxy
  context: {{cluster: proxy, user: none}}
current-context: proxy
"
        ),
    )
    .unwrap();
    Proxy { kubeconfig, counts, received, task, _dir: dir }
}

// ------------------------------------------------------------------------------ processes

/// The fake cloud (create latency 2 s, delete latency 1 s; with `join`, its VMs register Nodes)
/// on the embedded store (read here too), and no controller yet: [`controller`] starts them,
/// `dist` builds, quiet.
async fn start(join: Option<&Path>) -> World {
    let mut fake = Driver::dist_fake(&["--create-latency", "2s", "--delete-latency", "1s"]);
    if let Some(k) = join {
        // A fake-driver built without the cargo feature join-cluster refuses --join-cluster.
        fake = fake.args(["--join-cluster", &*k.to_string_lossy()]);
    }
    World::builder()
        .driver(fake)
        .controller_binary(e2e_tests::dist_bin("machine-controller"))
        .controller_env([("RUST_LOG", "warn")])
        .timings(&[])
        .controller_args(&CONTROLLER_ARGS)
        .without_controller()
        .start()
        .await
}

/// Starts a controller of `w`, with `--target-kubeconfig` when given; returns its index.
fn controller(w: &mut World, target: Option<&Path>) -> usize {
    match target {
        Some(k) => w.start_controller(&["--target-kubeconfig", &k.to_string_lossy()]),
        None => w.start_controller(&[]),
    }
}

fn peak_rss_mb(w: &World, i: usize) -> u64 {
    e2e_tests::proc_status_kb(w.controller_pid(i), "VmHWM:") / 1024
}

// ------------------------------------------------------------------------------ objects

fn class() -> serde_json::Value {
    json!({"apiVersion": "machine.driver.dev/v1alpha1", "kind": "MachineClass", "metadata": {"name": "small"},
           "spec": e2e_tests::joining(json!({"driver": "fake", "providerSpec": {"machineType": "small"}}))})
}

/// [`class`] without a boot data template: for a controller with no target cluster to join.
fn class_without_join() -> serde_json::Value {
    let mut c = class();
    c["spec"].as_object_mut().map(|s| s.remove("userData"));
    c
}

fn deployment(replicas: usize, image: &str) -> serde_json::Value {
    json!({"apiVersion": "machine.driver.dev/v1alpha1", "kind": "MachineDeployment", "metadata": {"name": "bench"},
           "spec": {"replicas": replicas,
                    "template": {"spec": {"classRef": {"name": "small"},
                                          "providerSpec": {"machineType": "small", "image": image}}},
                    "strategy": {"rollingUpdate": {"maxSurge": "10%", "maxUnavailable": 0}}}})
}

async fn md(store: &Store) -> Option<MachineDeployment> {
    store.get::<MachineDeployment>("default", "bench").await.ok().flatten()
}

/// Polls `f` every `every` until it returns `Some`; after `within`, panics with `what` and
/// `diag()`. Prints `progress()` every 30 s.
async fn until<T, F, Fut>(
    what: &str,
    within: Duration,
    every: Duration,
    mut f: F,
    progress: impl Fn() -> String,
    diag: impl Fn() -> String,
) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let started = Instant::now();
    let mut said = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        if started.elapsed() > within {
            panic!("timed out after {within:?} waiting for {what} ({})\n{}", progress(), diag());
        }
        if said.elapsed() >= Duration::from_secs(30) {
            said = Instant::now();
            println!("     … {:.0} s: {}", started.elapsed().as_secs_f64(), progress());
        }
        tokio::time::sleep(every).await;
    }
}

// ------------------------------------------------------------------------------ watches

#[derive(Clone)]
struct PodInfo {
    node: String,
    ready: bool,
    deleting: bool,
}

#[derive(Default)]
struct PodState {
    pods: HashMap<String, PodInfo>,
    relist: Option<HashMap<String, PodInfo>>,
    listed: bool,
    /// Track the fewest Ready pods from now on.
    tracking: bool,
    min_ready: usize,
    /// Node → when a pod on it was first seen being deleted (its first eviction).
    first_leaving: HashMap<String, Instant>,
    /// Node → when the last pod on it was seen gone.
    last_gone: HashMap<String, Instant>,
}

impl PodState {
    fn ready(&self) -> usize {
        self.pods.values().filter(|p| p.ready).count()
    }

    fn ready_off(&self, excluded: &HashSet<String>) -> usize {
        self.pods.values().filter(|p| p.ready && !excluded.contains(&p.node)).count()
    }
}

fn pod_info(p: &Pod) -> PodInfo {
    let deleting = p.metadata.deletion_timestamp.is_some();
    let ready = !deleting
        && p.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    PodInfo { node: p.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default(), ready, deleting }
}

/// A watch on the workload's pods: how many are Ready, the fewest seen, and when each node's
/// pods began to leave and were all gone.
fn watch_pods(client: kube::Client, ns: &str, app: &str) -> (Arc<Mutex<PodState>>, tokio::task::JoinHandle<()>) {
    let state = Arc::new(Mutex::new(PodState { min_ready: usize::MAX, ..Default::default() }));
    let s = state.clone();
    let api: Api<Pod> = Api::namespaced(client, ns);
    let config = watcher::Config::default().labels(&format!("app={app}"));
    let task = tokio::spawn(async move {
        let mut stream = std::pin::pin!(watcher(api, config).default_backoff());
        while let Some(event) = stream.next().await {
            let now = Instant::now();
            let mut st = s.lock().unwrap();
            let st = &mut *st;
            match event {
                Ok(watcher::Event::Apply(p)) => {
                    let info = pod_info(&p);
                    if info.deleting && !info.node.is_empty() {
                        st.first_leaving.entry(info.node.clone()).or_insert(now);
                    }
                    st.pods.insert(p.metadata.name.clone().unwrap_or_default(), info);
                }
                Ok(watcher::Event::Delete(p)) => {
                    if let Some(info) = st.pods.remove(&p.metadata.name.clone().unwrap_or_default()) {
                        if !info.node.is_empty() {
                            st.last_gone.insert(info.node, now);
                        }
                    }
                }
                Ok(watcher::Event::Init) => st.relist = Some(HashMap::new()),
                Ok(watcher::Event::InitApply(p)) => {
                    let info = pod_info(&p);
                    st.relist
                        .get_or_insert_with(HashMap::new)
                        .insert(p.metadata.name.clone().unwrap_or_default(), info);
                }
                Ok(watcher::Event::InitDone) => {
                    st.pods = st.relist.take().unwrap_or_default();
                    st.listed = true;
                }
                Err(e) => eprintln!("pod watch: {e}"),
            }
            if st.listed && st.tracking {
                let ready = st.ready();
                st.min_ready = st.min_ready.min(ready);
            }
        }
    });
    (state, task)
}

#[derive(Default)]
struct NodeState {
    /// Name → Ready.
    nodes: HashMap<String, bool>,
    relist: Option<HashMap<String, bool>>,
    /// When each node was first seen cordoned (`spec.unschedulable`).
    cordoned: HashMap<String, Instant>,
    /// When each node was seen deleted.
    deleted: HashMap<String, Instant>,
    /// When each node was first seen, and first seen Ready.
    created: HashMap<String, Instant>,
    ready_at: HashMap<String, Instant>,
}

impl NodeState {
    /// Records what a Node event says (into the relist when one is under way).
    fn seen(&mut self, n: &Node, now: Instant, relist: bool) {
        let name = n.metadata.name.clone().unwrap_or_default();
        if n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true) {
            self.cordoned.entry(name.clone()).or_insert(now);
        }
        let ready = node_ready(n);
        self.created.entry(name.clone()).or_insert(now);
        if ready {
            self.ready_at.entry(name.clone()).or_insert(now);
        }
        let map = if relist { self.relist.get_or_insert_with(HashMap::new) } else { &mut self.nodes };
        map.insert(name, ready);
    }
}

fn node_ready(n: &Node) -> bool {
    e2e_tests::kube_cluster::node_ready(n)
}

/// A watch on every Node: which exist and are Ready, when each was cordoned and deleted.
fn watch_nodes(client: kube::Client) -> (Arc<Mutex<NodeState>>, tokio::task::JoinHandle<()>) {
    let state = Arc::new(Mutex::new(NodeState::default()));
    let s = state.clone();
    let api: Api<Node> = Api::all(client);
    let task = tokio::spawn(async move {
        let mut stream = std::pin::pin!(watcher(api, watcher::Config::default()).default_backoff());
        while let Some(event) = stream.next().await {
            let now = Instant::now();
            let mut st = s.lock().unwrap();
            match event {
                Ok(watcher::Event::Apply(n)) => st.seen(&n, now, false),
                Ok(watcher::Event::Delete(n)) => {
                    let name = n.metadata.name.clone().unwrap_or_default();
                    st.nodes.remove(&name);
                    st.deleted.insert(name, now);
                }
                Ok(watcher::Event::Init) => st.relist = Some(HashMap::new()),
                Ok(watcher::Event::InitApply(n)) => st.seen(&n, now, true),
                Ok(watcher::Event::InitDone) => st.nodes = st.relist.take().unwrap_or_default(),
                Err(e) => eprintln!("node watch: {e}"),
            }
        }
    });
    (state, task)
}

// ------------------------------------------------------------------------------ API requests

/// kube-apiserver's `apiserver_request_total` by "VERB resource[/subresource]"; evictions also
/// by answer ("post pods/eviction 429").
async fn api_requests(client: &kube::Client) -> BTreeMap<String, f64> {
    let text = client.request_text(http::Request::get("/metrics").body(Vec::new()).unwrap()).await.unwrap_or_default();
    let label = |l: &str, name: &str| -> String {
        let start = format!(",{name}=\"");
        let l = l.replacen('{', "{,", 1);
        l.split(start.as_str()).nth(1).and_then(|r| r.split('"').next()).unwrap_or("").to_string()
    };
    let mut out = BTreeMap::new();
    for l in text.lines().filter(|l| l.starts_with("apiserver_request_total{")) {
        let Some(n) = l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else { continue };
        let sub = label(l, "subresource");
        let sub = if sub.is_empty() { sub } else { format!("/{sub}") };
        let key = format!("{} {}{sub}", label(l, "verb").to_lowercase(), label(l, "resource"));
        if sub == "/eviction" {
            *out.entry(format!("{key} {}", label(l, "code"))).or_insert(0.0) += n;
        }
        *out.entry(key).or_insert(0.0) += n;
    }
    out
}

fn diff(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>, key: &str) -> f64 {
    after.get(key).copied().unwrap_or(0.0) - before.get(key).copied().unwrap_or(0.0)
}

/// Requests per machine by verb and resource between two readings (those ≥ 0.05 per machine).
fn breakdown(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>, n: usize) -> String {
    let mut parts: Vec<(String, f64)> = after
        .keys()
        .filter(|k| !k.contains("/eviction "))
        .map(|k| (k.clone(), diff(before, after, k) / n as f64))
        .filter(|(_, v)| *v >= 0.05)
        .collect();
    parts.sort_by(|a, b| b.1.total_cmp(&a.1));
    parts.iter().map(|(k, v)| format!("{k} {v:.2}")).collect::<Vec<_>>().join(", ")
}

fn total(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>) -> f64 {
    after.keys().filter(|k| !k.contains("/eviction ")).map(|k| diff(before, after, k)).sum()
}

// ------------------------------------------------------------------------------ 1. rolling update

struct Rollout {
    machines: usize,
    pods: usize,
    initial: Duration,
    pods_ready: Duration,
    time: Duration,
    /// The controller's own requests to the target cluster (through the proxy).
    controller: Requests,
    /// Every client's (`apiserver_request_total`).
    cluster_wide: Requests,
    min_ready: usize,
    peak_rss_mb: u64,
    drain: Vec<Duration>,
    to_deleted: Vec<Duration>,
    max_in_flight: usize,
}

/// Requests between two readings.
struct Requests {
    /// Per machine.
    per_machine: f64,
    /// Per machine, by verb and resource.
    breakdown: String,
    evictions_ok: f64,
    evictions_refused: f64,
    /// Pod lists: one per look at a drain.
    pod_lists: f64,
    total: f64,
}

impl Requests {
    fn between(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>, n: usize) -> Requests {
        let total = total(before, after);
        Requests {
            per_machine: total / n as f64,
            breakdown: breakdown(before, after, n),
            evictions_ok: diff(before, after, "post pods/eviction 201"),
            evictions_refused: diff(before, after, "post pods/eviction 429"),
            pod_lists: diff(before, after, "list pods"),
            total,
        }
    }
}

fn quantile(v: &[Duration], q: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    let mut v = v.to_vec();
    v.sort();
    v[((v.len() - 1) as f64 * q).round() as usize]
}

async fn rolling_update(n: usize, pods: usize) -> Rollout {
    let cluster = Cluster::start_full().await;
    let ns = cluster.namespace("bench").await;
    let mut w = start(Some(&cluster.kubeconfig)).await;
    let proxy = start_proxy(&cluster).await;
    let c = controller(&mut w, Some(&proxy.kubeconfig));
    let store = w.store();
    let (nodes, node_task) = watch_nodes(cluster.client.clone());
    let (watch, pod_task) = watch_pods(cluster.client.clone(), &ns, "shop");
    let node_count = || {
        let st = nodes.lock().unwrap();
        (st.nodes.len(), st.nodes.values().filter(|r| **r).count())
    };

    let last = Mutex::new(String::new());
    let md_seen = |md: MachineDeployment| {
        *last.lock().unwrap() = status_line(&md);
        md
    };
    // n machines Running, each with a Ready Node.
    let started = Instant::now();
    store.apply(Kind::MachineClass, class()).await.unwrap();
    store.apply(Kind::MachineDeployment, deployment(n, "os-1")).await.unwrap();
    let first = until(
        &format!("{n} machines Running (Nodes Ready)"),
        Duration::from_secs(900),
        Duration::from_millis(100),
        || async { md(&store).await.map(md_seen).filter(e2e_tests::rolled_out) },
        || format!("{}; nodes (total, Ready) {:?}", last.lock().unwrap(), node_count()),
        || format!("{}\n{}", w.logs(), cluster_logs(&cluster)),
    )
    .await;
    let initial = started.elapsed();
    println!("     {n} machines Running with Ready Nodes in {:.1} s", initial.as_secs_f64());

    // The workload: `pods` pods spread over the nodes, a budget of 10% unavailable.
    let started = Instant::now();
    cluster
        .apply_json(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "shop", "namespace": ns},
            "spec": {
                "replicas": pods,
                "selector": {"matchLabels": {"app": "shop"}},
                "template": {
                    "metadata": {"labels": {"app": "shop"}},
                    "spec": {
                        "containers": [{"name": "app", "image": "registry.invalid/app:1"}],
                        "terminationGracePeriodSeconds": 5,
                        "topologySpreadConstraints": [{
                            "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                            "whenUnsatisfiable": "ScheduleAnyway",
                            "labelSelector": {"matchLabels": {"app": "shop"}}
                        }]
                    }
                }
            }
        }))
        .await;
    cluster
        .apply_json(json!({
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": "shop-budget", "namespace": ns},
            "spec": {"selector": {"matchLabels": {"app": "shop"}}, "maxUnavailable": "10%"}
        }))
        .await;
    until(
        &format!("{pods} pods Ready"),
        Duration::from_secs(1200),
        Duration::from_millis(250),
        || async { (watch.lock().unwrap().ready() == pods).then_some(()) },
        || format!("{} pods Ready", watch.lock().unwrap().ready()),
        || format!("{}\n{}", w.logs(), cluster_logs(&cluster)),
    )
    .await;
    let pods_ready = started.elapsed();
    println!("     {pods} pods Ready in {:.1} s", pods_ready.as_secs_f64());
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(cluster.client.clone(), &ns);
    let allowed = (pods / 10) as i32;
    until(
        "the budget's status current",
        Duration::from_secs(120),
        Duration::from_millis(250),
        || async {
            let s = pdbs.get("shop-budget").await.ok()?.status?;
            (s.current_healthy == Some(pods as i32) && s.disruptions_allowed == Some(allowed)).then_some(())
        },
        String::new,
        || format!("{}\n{}", w.logs(), cluster_logs(&cluster)),
    )
    .await;

    // The rollout: a new image.
    let old_nodes: HashSet<String> = nodes.lock().unwrap().nodes.keys().cloned().collect();
    assert_eq!(old_nodes.len(), n, "one Node per machine before the rollout");
    let before = api_requests(&cluster.client).await;
    let ctl_before = proxy.counts();
    {
        let mut st = watch.lock().unwrap();
        st.tracking = true;
        st.min_ready = st.ready();
    }
    let started = Instant::now();
    store.apply(Kind::MachineDeployment, deployment(n, "os-2")).await.unwrap();
    let old_rev = first.status.target_revision.clone();
    let progress = || {
        let left = old_nodes.iter().filter(|o| nodes.lock().unwrap().nodes.contains_key(*o)).count();
        let st = watch.lock().unwrap();
        format!(
            "{}; old Nodes left {left}, nodes {:?}, pods Ready {} (on new nodes {}), fewest Ready {}",
            last.lock().unwrap(),
            node_count(),
            st.ready(),
            st.ready_off(&old_nodes),
            st.min_ready
        )
    };
    until(
        "the new revision rolled out, the old Nodes gone, every pod Ready on a new node",
        Duration::from_secs(3600),
        Duration::from_millis(200),
        || async {
            let md = md_seen(md(&store).await?);
            let done = e2e_tests::rolled_out(&md) && md.status.target_revision != old_rev;
            let gone = {
                let st = nodes.lock().unwrap();
                old_nodes.iter().all(|o| !st.nodes.contains_key(o))
            };
            let on_new = watch.lock().unwrap().ready_off(&old_nodes) == pods;
            (done && gone && on_new).then_some(())
        },
        progress,
        || format!("{}\n{}", w.logs(), cluster_logs(&cluster)),
    )
    .await;
    let time = started.elapsed();
    let after = api_requests(&cluster.client).await;
    let ctl_after = proxy.counts();
    let peak_rss_mb = peak_rss_mb(&w, c);
    w.kill9_controller(c).await;
    node_task.abort();
    pod_task.abort();
    let min_ready = watch.lock().unwrap().min_ready;

    // Each old node's drain, from the watches.
    let (mut drain, mut to_deleted, mut spans) = (Vec::new(), Vec::new(), Vec::new());
    {
        let (ns_, ps) = (nodes.lock().unwrap(), watch.lock().unwrap());
        for o in &old_nodes {
            let Some(&cordoned) = ns_.cordoned.get(o) else { continue };
            if let Some(&gone) = ps.last_gone.get(o) {
                drain.push(gone.saturating_duration_since(cordoned));
            }
            if let Some(&deleted) = ns_.deleted.get(o) {
                to_deleted.push(deleted.saturating_duration_since(cordoned));
                spans.push((cordoned, deleted));
            }
        }
    }
    let mut edges: Vec<(Instant, i64)> = spans.iter().flat_map(|(a, b)| [(*a, 1), (*b, -1)]).collect();
    edges.sort();
    let (mut now, mut max_in_flight) = (0i64, 0i64);
    for (_, d) in edges {
        now += d;
        max_in_flight = max_in_flight.max(now);
    }

    let controller = Requests::between(&ctl_before, &ctl_after, n);
    let cluster_wide = Requests::between(&before, &after, n);
    Rollout {
        machines: n,
        pods,
        initial,
        pods_ready,
        time,
        controller,
        cluster_wide,
        min_ready,
        peak_rss_mb,
        drain,
        to_deleted,
        max_in_flight: max_in_flight as usize,
    }
}

// ------------------------------------------------------------------------------ 2. joining

struct Join {
    time: Duration,
    peak_rss_mb: u64,
    /// The controller's requests to the target cluster, per machine, by verb and resource.
    requests: Option<(f64, String)>,
    /// With Nodes: when the last Node was registered, and when the last one turned Ready
    /// (from the start).
    last_node: Option<(Duration, Duration)>,
}

/// `n` machines to Running on the embedded store; with `cluster`, their VMs join it and the
/// controller manages Nodes (Running = Node Ready).
async fn to_running(n: usize, cluster: Option<&Cluster>) -> Join {
    let kubeconfig = cluster.map(|c| c.kubeconfig.as_path());
    let mut w = start(kubeconfig).await;
    let proxy = match cluster {
        Some(cluster) => Some(start_proxy(cluster).await),
        None => None,
    };
    let c = controller(&mut w, proxy.as_ref().map(|p| p.kubeconfig.as_path()));
    let store = w.store();
    let nodes = cluster.map(|c| watch_nodes(c.client.clone()));
    let last = Mutex::new(String::new());
    let started = Instant::now();
    store.apply(Kind::MachineClass, class()).await.unwrap();
    store.apply(Kind::MachineDeployment, deployment(n, "os-1")).await.unwrap();
    until(
        &format!("{n} machines Running"),
        Duration::from_secs(1200),
        Duration::from_millis(100),
        || async {
            let md = md(&store).await?;
            *last.lock().unwrap() = status_line(&md);
            e2e_tests::rolled_out(&md).then_some(())
        },
        || last.lock().unwrap().clone(),
        || w.logs(),
    )
    .await;
    let time = started.elapsed();
    let peak_rss_mb = peak_rss_mb(&w, c);
    w.kill9_controller(c).await;
    let requests = proxy.map(|p| {
        let after = p.counts();
        (total(&BTreeMap::new(), &after) / n as f64, breakdown(&BTreeMap::new(), &after, n))
    });
    let last_node = nodes.map(|(st, task)| {
        task.abort();
        let st = st.lock().unwrap();
        let latest = |m: &HashMap<String, Instant>| {
            m.values().max().map_or(Duration::ZERO, |t| t.saturating_duration_since(started))
        };
        (latest(&st.created), latest(&st.ready_at))
    });
    Join { time, peak_rss_mb, requests, last_node }
}

fn status_line(md: &MachineDeployment) -> String {
    let s = &md.status;
    format!("replicas {}, updated {}, available {}", s.replicas, s.updated_replicas, s.available_replicas)
}

// ------------------------------------------------------------------------------ 3. steady state

/// The controller's memory and CPU at one moment.
#[derive(Clone, Copy, Default)]
struct Usage {
    rss_kb: u64,
    peak_rss_kb: u64,
    /// Anonymous memory (heap and stacks: what the controller allocated, not its mapped binary).
    anon_kb: u64,
    /// User + system CPU since it started.
    cpu: Duration,
}

/// Of controller `i` of `w`.
fn usage(w: &World, i: usize) -> Usage {
    let pid = w.controller_pid(i);
    let anon_kb = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("Anonymous:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0);
    // Fields 14 and 15 of /proc/PID/stat (after the command's parenthesis): utime, stime in ticks.
    let ticks: u64 = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let rest = s.rsplit_once(')')?.1.split_whitespace().collect::<Vec<_>>();
            Some(rest.get(11)?.parse::<u64>().ok()? + rest.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or(0);
    Usage {
        rss_kb: e2e_tests::proc_status_kb(pid, "VmRSS:"),
        peak_rss_kb: e2e_tests::proc_status_kb(pid, "VmHWM:"),
        anon_kb,
        // The kernel's USER_HZ is 100 on Linux.
        cpu: Duration::from_millis(ticks * 10),
    }
}

struct Steady {
    machines: usize,
    pods: usize,
    window: Duration,
    join: Duration,
    pods_ready: Duration,
    /// The controller without a target cluster, same machines, same window: at its end.
    without: Usage,
    without_cpu: Duration,
    /// With the target cluster: once the Nodes were Ready (before any pod), and at the window's
    /// end (10,000 pods on the nodes).
    before_pods: Usage,
    with: Usage,
    with_cpu: Duration,
    /// The controller's requests in the window, by "verb resource".
    requests: BTreeMap<String, f64>,
    /// What it received in the window, by "verb resource".
    received: BTreeMap<String, Received>,
    /// The same since it started (the initial list and watch included).
    received_all: BTreeMap<String, Received>,
    /// The controller restarted after the window (same store and cluster), after
    /// [`RESTART_WINDOW`].
    restarted: Usage,
    restart_requests: BTreeMap<String, f64>,
}

/// Creates `pods` pods bound to `nodes` round-robin (`spec.nodeName` set: no scheduler, and
/// faster than kube-controller-manager's 20 requests/s), many requests at once.
async fn create_bound_pods(client: &kube::Client, ns: &str, nodes: &[String], pods: usize) {
    use kube::api::PostParams;
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    futures::stream::iter(0..pods)
        .map(|i| {
            let api = api.clone();
            let pod: Pod = serde_json::from_value(json!({
                "metadata": {"name": format!("idle-{i}"), "labels": {"app": "idle"}},
                "spec": {
                    "nodeName": nodes[i % nodes.len()],
                    "containers": [{"name": "app", "image": "registry.invalid/app:1"}],
                    "terminationGracePeriodSeconds": 0
                }
            }))
            .unwrap();
            async move {
                loop {
                    match api.create(&PostParams::default(), &pod).await {
                        Ok(_) => break,
                        Err(kube::Error::Api(s)) if s.code == 409 => break,
                        Err(e) => {
                            eprintln!("creating {}: {e}", pod.metadata.name.as_deref().unwrap_or(""));
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                    }
                }
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<()>>()
        .await;
}

/// `n` machines whose Nodes are Ready and carry `pods` pods: what the controller asks of the
/// target cluster and what it holds in memory over `window`, against the same controller with
/// the same machines and no target cluster, in the same window.
async fn steady_state(n: usize, pods: usize, window: Duration) -> Steady {
    // Without a target cluster: its own fake cloud and controller, left running through the
    // window so both are measured over the same time.
    let mut w_alone = start(None).await;
    let alone = controller(&mut w_alone, None);
    let store_alone = w_alone.store();
    store_alone.apply(Kind::MachineClass, class_without_join()).await.unwrap();
    store_alone.apply(Kind::MachineDeployment, deployment(n, "os-1")).await.unwrap();
    until(
        &format!("{n} machines Running, no target cluster"),
        Duration::from_secs(600),
        Duration::from_millis(200),
        || async { md(&store_alone).await.filter(e2e_tests::rolled_out) },
        String::new,
        || w_alone.logs(),
    )
    .await;

    let cluster = Cluster::start_full().await;
    let ns = cluster.namespace("steady").await;
    let mut w = start(Some(&cluster.kubeconfig)).await;
    let proxy = start_proxy(&cluster).await;
    let c = controller(&mut w, Some(&proxy.kubeconfig));
    let store = w.store();
    let (nodes, node_task) = watch_nodes(cluster.client.clone());
    let (watch, pod_task) = watch_pods(cluster.client.clone(), &ns, "idle");
    let started = Instant::now();
    store.apply(Kind::MachineClass, class()).await.unwrap();
    store.apply(Kind::MachineDeployment, deployment(n, "os-1")).await.unwrap();
    let last = Mutex::new(String::new());
    until(
        &format!("{n} machines Running (Nodes Ready)"),
        Duration::from_secs(900),
        Duration::from_millis(200),
        || async {
            let md = md(&store).await?;
            *last.lock().unwrap() = status_line(&md);
            e2e_tests::rolled_out(&md).then_some(())
        },
        || last.lock().unwrap().clone(),
        || format!("{}\n{}", w.logs(), cluster_logs(&cluster)),
    )
    .await;
    let join = started.elapsed();
    println!("     {n} machines Running with Ready Nodes in {:.1} s", join.as_secs_f64());
    let before_pods = usage(&w, c);

    let started = Instant::now();
    let names: Vec<String> = nodes.lock().unwrap().nodes.keys().cloned().collect();
    assert_eq!(names.len(), n, "one Node per machine");
    create_bound_pods(&cluster.client, &ns, &names, pods).await;
    println!("     {pods} pods created in {:.1} s", started.elapsed().as_secs_f64());
    until(
        &format!("{pods} pods Ready (kwok)"),
        Duration::from_secs(1200),
        Duration::from_millis(500),
        || async { (watch.lock().unwrap().ready() == pods).then_some(()) },
        || format!("{} pods Ready", watch.lock().unwrap().ready()),
        || format!("{}\n{}", w.logs(), cluster_logs(&cluster)),
    )
    .await;
    let pods_ready = started.elapsed();
    println!("     {pods} pods Ready in {:.1} s", pods_ready.as_secs_f64());
    pod_task.abort();

    // The window: nothing changes but kwok's heartbeats (Node status every ~20 s, pod status
    // not at all once Running).
    let (requests_0, received_0) = (proxy.counts(), proxy.received());
    let (cpu_0, alone_cpu_0) = (usage(&w, c).cpu, usage(&w_alone, alone).cpu);
    println!("     steady window of {:.0} s ...", window.as_secs_f64());
    tokio::time::sleep(window).await;
    let (requests_1, received_1) = (proxy.counts(), proxy.received());
    let (with, without) = (usage(&w, c), usage(&w_alone, alone));
    let still = md(&store).await.is_some_and(|m| e2e_tests::rolled_out(&m));
    assert!(still, "every machine still Running after the window");
    w.kill9_controller(c).await;
    w_alone.kill9_controller(alone).await;

    // A restart: the first list now holds every Node (it was empty when the controller first
    // started), the most the controller decodes at once.
    let requests_2 = proxy.counts();
    let c = controller(&mut w, Some(&proxy.kubeconfig));
    tokio::time::sleep(RESTART_WINDOW).await;
    let restarted = usage(&w, c);
    let still = md(&store).await.is_some_and(|m| e2e_tests::rolled_out(&m));
    assert!(still, "every machine still Running after the restart");
    let requests_3 = proxy.counts();
    w.kill9_controller(c).await;
    node_task.abort();
    let restart_requests =
        requests_3.keys().map(|k| (k.clone(), diff(&requests_2, &requests_3, k))).filter(|(_, v)| *v > 0.0).collect();

    let requests =
        requests_1.keys().map(|k| (k.clone(), diff(&requests_0, &requests_1, k))).filter(|(_, v)| *v > 0.0).collect();
    let received = received_1
        .iter()
        .map(|(k, r)| {
            let r0 = received_0.get(k).copied().unwrap_or_default();
            (k.clone(), Received { bytes: r.bytes - r0.bytes, lines: r.lines - r0.lines })
        })
        .filter(|(_, r)| r.bytes > 0)
        .collect();
    Steady {
        machines: n,
        pods,
        window,
        join,
        pods_ready,
        without,
        without_cpu: without.cpu.saturating_sub(alone_cpu_0),
        before_pods,
        with,
        with_cpu: with.cpu.saturating_sub(cpu_0),
        requests,
        received,
        received_all: received_1,
        restarted,
        restart_requests,
    }
}

/// How long a restarted controller runs before it is measured.
const RESTART_WINDOW: Duration = Duration::from_secs(60);

fn mb(kb: u64) -> String {
    format!("{:.1} MB", kb as f64 / 1024.0)
}

fn steady_table(s: &Steady) -> String {
    let minutes = s.window.as_secs_f64() / 60.0;
    // (+ 0.0: an empty f64 sum is −0.)
    let total: f64 = s.requests.iter().filter(|(k, _)| !k.contains("/eviction ")).map(|(_, v)| v).sum::<f64>() + 0.0;
    let per_machine_minute = total / s.machines as f64 / minutes;
    let growth = s.with.rss_kb as i64 - s.without.rss_kb as i64;
    let peak_growth = s.with.peak_rss_kb as i64 - s.without.peak_rss_kb as i64;
    let signed = |kb: i64| format!("{}{:.1} MB", if kb < 0 { "−" } else { "+" }, kb.unsigned_abs() as f64 / 1024.0);
    let met = |ok: bool| if ok { "met" } else { "**not met**" };
    let mut out = format!(
        "| steady state, {} machines, {} pods, {:.0} s window | result | target | |\n|---|---|---|---|\n",
        s.machines,
        s.pods,
        s.window.as_secs_f64()
    );
    out += &format!(
        "| controller's requests to the target cluster per machine per minute | {per_machine_minute:.4} ({total:.0} in the window) | ≤ 1 | {} |\n",
        met(per_machine_minute <= 1.0)
    );
    out += &format!(
        "| controller RSS now (VmRSS): no target cluster / Nodes + pods — growth | {} / {} — {} | ≤ +30 MB | {} |\n",
        mb(s.without.rss_kb),
        mb(s.with.rss_kb),
        signed(growth),
        met(growth <= 30 * 1024)
    );
    out += &format!(
        "| controller peak RSS (VmHWM): no target cluster / Nodes + pods — growth | {} / {} — {} | ≤ +30 MB | {} |\n",
        mb(s.without.peak_rss_kb),
        mb(s.with.peak_rss_kb),
        signed(peak_growth),
        met(peak_growth <= 30 * 1024)
    );
    out += &format!(
        "| controller anonymous memory (smaps_rollup): no target cluster / Nodes + pods | {} / {} | | |\n",
        mb(s.without.anon_kb),
        mb(s.with.anon_kb)
    );
    out += &format!(
        "| controller RSS with the target cluster: Nodes Ready, no pods / {} pods, window's end | {} / {} | | |\n",
        s.pods,
        mb(s.before_pods.rss_kb),
        mb(s.with.rss_kb)
    );
    out += &format!(
        "| controller CPU in the window: no target cluster / Nodes + pods | {:.1} s / {:.1} s ({:.1}% / {:.1}% of one core) | | |\n",
        s.without_cpu.as_secs_f64(),
        s.with_cpu.as_secs_f64(),
        100.0 * s.without_cpu.as_secs_f64() / s.window.as_secs_f64(),
        100.0 * s.with_cpu.as_secs_f64() / s.window.as_secs_f64()
    );
    for (k, r) in &s.received {
        out += &format!(
            "| received in the window, `{k}` | {:.1} KB/s, {:.1} lines/s ({:.0} bytes per line) | | |\n",
            r.bytes as f64 / 1024.0 / s.window.as_secs_f64(),
            r.lines as f64 / s.window.as_secs_f64(),
            if r.lines > 0 { r.bytes as f64 / r.lines as f64 } else { 0.0 }
        );
    }
    out += &format!(
        "| {} machines Running with Ready Nodes / {} bound pods created and Ready (kwok) | {} / {} | | |\n",
        s.machines,
        s.pods,
        secs(s.join),
        secs(s.pods_ready)
    );
    out += &format!(
        "| restarted with every Node and pod in place, after {:.0} s: RSS / peak RSS (VmHWM) / CPU | {} / {} / {:.1} s | ≤ +30 MB over {} | {} |\n",
        RESTART_WINDOW.as_secs_f64(),
        mb(s.restarted.rss_kb),
        mb(s.restarted.peak_rss_kb),
        s.restarted.cpu.as_secs_f64(),
        mb(s.without.peak_rss_kb),
        met(s.restarted.peak_rss_kb as i64 - s.without.peak_rss_kb as i64 <= 30 * 1024)
    );
    let list =
        |m: &BTreeMap<String, f64>| m.iter().map(|(k, v)| format!("`{k}` {v:.0}")).collect::<Vec<_>>().join(", ");
    out += &format!(
        "\nThe controller's requests in the window: {}\n",
        if s.requests.is_empty() { "none".into() } else { list(&s.requests) }
    );
    out += &format!("\nThe restarted controller's requests: {}\n", list(&s.restart_requests));
    let all: Vec<String> = s
        .received_all
        .iter()
        .map(|(k, r)| format!("`{k}` {:.1} MB in {} lines", r.bytes as f64 / 1048576.0, r.lines))
        .collect();
    out +=
        &format!("\nEverything the controller received from the target cluster since it started: {}\n", all.join(", "));
    out
}

// ------------------------------------------------------------------------------ main

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

#[tokio::main]
async fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let steady_only = std::env::args().any(|a| a == "--steady");
    let (n, pods, big) = if quick { (50, 500, 200) } else { (200, 2_000, 1_000) };
    let (steady_pods, window) =
        if quick { (2_000, Duration::from_secs(60)) } else { (10_000, Duration::from_secs(300)) };
    let mut out = format!(
        "Machine: {} cores ({}), {} — dist builds; fake create latency 2 s, delete latency 1 s; controller \
         on the embedded store with `--target-kubeconfig` (through the bench's counting proxy), `{}`; kube-apiserver 1.37.2 + etcd 3.7.3 \
         (--unsafe-no-fsync) + kube-controller-manager + kube-scheduler + kwok 0.8.0 on the same machine\n\n",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        e2e_tests::cpu_model(),
        if quick { "quick run (--quick)" } else { "full run" },
        CONTROLLER_ARGS.join(" ")
    );

    if steady_only {
        println!("[3] steady state: {big} machines with Ready Nodes, {steady_pods} pods ...");
        let s = steady_state(big, steady_pods, window).await;
        out += &steady_table(&s);
        println!("\n{out}");
        if let Ok(path) = std::env::var("BENCH_OUT") {
            std::fs::write(path, &out).unwrap();
        }
        return;
    }

    println!("[1] rolling update of {n} machines carrying {pods} pods (PDB maxUnavailable 10%) ...");
    let r = rolling_update(n, pods).await;
    let (ctl, all) = (&r.controller, &r.cluster_wide);
    println!("     rollout {} ; fewest Ready {} of {}", secs(r.time), r.min_ready, r.pods);
    println!("     controller, per replaced machine: {:.1} requests; {}", ctl.per_machine, ctl.breakdown);
    println!(
        "     controller: evictions {} accepted, {} refused (429); {} pod lists (looks at a drain)",
        ctl.evictions_ok, ctl.evictions_refused, ctl.pod_lists
    );
    println!("     all clients, per replaced machine: {:.1} requests; {}", all.per_machine, all.breakdown);

    println!("[2a] {big} machines to Running, no target cluster ...");
    let cluster = Cluster::start_full().await;
    let without = to_running(big, None).await;
    println!("     {} (peak RSS {} MB)", secs(without.time), without.peak_rss_mb);
    println!("[2b] {big} machines to Running, Nodes joining (Running = Node Ready) ...");
    let with = to_running(big, Some(&cluster)).await;
    println!("     {} (peak RSS {} MB)", secs(with.time), with.peak_rss_mb);
    drop(cluster);

    let ms = |d: Duration| format!("{:.1}", d.as_secs_f64());
    out += "| benchmark | result |\n|---|---|\n";
    out += &format!(
        "| {} machines to Running with Ready Nodes (before the rollout) | {} |\n",
        r.machines,
        secs(r.initial)
    );
    out += &format!("| {} pods Ready on them (kcm, scheduler, kwok) | {} |\n", r.pods, secs(r.pods_ready));
    out += &format!(
        "| **rolling update, {} machines, {} pods**: rolled out, old Nodes deleted, every pod Ready on a new node | **{}** |\n",
        r.machines,
        r.pods,
        secs(r.time)
    );
    out += &format!(
        "| fewest Ready pods seen during the rollout (pod watch; the budget allows {} down) | {} of {} |\n",
        r.pods / 10,
        r.min_ready,
        r.pods
    );
    out += &format!(
        "| per old node: cordon → last pod gone (median / p90 / max) | {} / {} / {} s |\n",
        ms(quantile(&r.drain, 0.5)),
        ms(quantile(&r.drain, 0.9)),
        ms(quantile(&r.drain, 1.0))
    );
    out += &format!(
        "| per old node: cordon → Node deleted (median / p90 / max) | {} / {} / {} s |\n",
        ms(quantile(&r.to_deleted, 0.5)),
        ms(quantile(&r.to_deleted, 0.9)),
        ms(quantile(&r.to_deleted, 1.0))
    );
    out += &format!("| old nodes cordoned and not yet deleted at once (most) | {} |\n", r.max_in_flight);
    out += &format!(
        "| controller's requests to the target cluster per replaced machine (counted by a proxy) | {:.1} |\n",
        ctl.per_machine
    );
    out += &format!(
        "| controller: evictions accepted / refused (429) / looks at a drain (pod lists) / requests per look | \
         {:.0} / {:.0} / {:.0} / {:.1} |\n",
        ctl.evictions_ok,
        ctl.evictions_refused,
        ctl.pod_lists,
        if ctl.pod_lists > 0.0 { ctl.total / ctl.pod_lists } else { 0.0 }
    );
    out += &format!(
        "| API requests per replaced machine, all clients (`apiserver_request_total`: controller, kcm, scheduler, kwok, fake kubelets) | {:.1} |\n",
        all.per_machine
    );
    out += &format!("| controller peak RSS (VmHWM), rollout | {} MB |\n", r.peak_rss_mb);
    out += &format!("| {big} machines Running, no target cluster | {} |\n", secs(without.time));
    out += &format!("| {big} machines Running, Nodes joining (Running = Node Ready) | {} |\n", secs(with.time));
    out += &format!(
        "| ratio (joining ÷ no target cluster), same run | {:.2}× |\n",
        with.time.as_secs_f64() / without.time.as_secs_f64()
    );
    out += &format!(
        "| controller peak RSS (VmHWM), {big} machines: no target / joining | {} / {} MB |\n",
        without.peak_rss_mb, with.peak_rss_mb
    );
    if let Some((created, ready)) = with.last_node {
        out += &format!(
            "| joining: last Node registered (fake kubelets) / last Node Ready (kwok) / last machine Running | {} / {} / {} |\n",
            secs(created),
            secs(ready),
            secs(with.time)
        );
    }
    if let Some((per, _)) = &with.requests {
        out += &format!("| controller's requests to the target cluster per machine, joining | {per:.1} |\n");
    }
    out += &format!("\nThe controller's requests during the rollout, per replaced machine: {}\n", ctl.breakdown);
    out += &format!("\nAll clients' requests during the rollout, per replaced machine: {}\n", all.breakdown);
    if let Some((_, b)) = &with.requests {
        out += &format!("\nThe controller's requests while {big} machines joined, per machine: {b}\n");
    }

    println!("[3] steady state: {big} machines with Ready Nodes, {steady_pods} pods ...");
    let s = steady_state(big, steady_pods, window).await;
    out += "\n";
    out += &steady_table(&s);
    println!("\n{out}");
    if let Ok(path) = std::env::var("BENCH_OUT") {
        std::fs::write(path, &out).unwrap();
    }
}
