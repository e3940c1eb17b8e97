//! The Kubernetes backend at scale (issue: Kubernetes backend), side by side with the embedded
//! store in the same run. Real processes: `fake-driver` and `machine-controller run` (`dist`
//! builds) over a Unix socket, started through the test harness (`e2e_tests::world`);
//! kube-apiserver + etcd from `tests/tools/install-kube-cluster.sh`.
//!
//! 1. 1,000 machines from one MachineDeployment to Running (fake create latency 2 s, 10 workers):
//!    through the API server vs through the embedded store.
//! 2. API requests per reconciled machine (kube-apiserver's own `apiserver_request_total`,
//!    minus the benchmark's own polling).
//! 3. Controller peak RSS holding 10,000 Machines through the API server.
//!
//! ```text
//! cargo build --profile dist -p fake-driver -p machine-controller
//! export KUBE_CLUSTER_DIR=$(bash tests/tools/install-kube-cluster.sh)
//! cargo bench -p e2e-tests --bench kube_scale              # full run
//! cargo bench -p e2e-tests --bench kube_scale -- --quick   # 200 / 2,000 machines
//! cargo bench -p e2e-tests --bench kube_scale -- --rss-only  # only the 10,000-machine run
//! ```
//! Set BENCH_OUT=path to also write the markdown table there, and BENCH_COMPARE=<another
//! machine-controller binary> to run every step with both builds in the same run (A/B).

// Test code: a setup that fails is a failed test (the workspace warns of `unwrap` in what ships).
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e_tests::kube_cluster::Cluster;
use e2e_tests::world::{Builder, Driver, World};
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use machine_controller::resources::MachineDeployment;
use serde_json::json;

/// The controller build to measure: this tree's dist build, or `BENCH_COMPARE`'s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Build {
    This,
    Compare,
}

impl Build {
    fn binary(self) -> std::path::PathBuf {
        match self {
            Build::This => e2e_tests::dist_bin("machine-controller"),
            Build::Compare => std::env::var_os("BENCH_COMPARE").expect("BENCH_COMPARE").into(),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Build::This => "this build",
            Build::Compare => "BENCH_COMPARE build",
        }
    }
}

/// The fake cloud (create latency 2 s, delete 1 s) and `build`'s controller (10 workers, no
/// client-side rate limit, health checks every 300 s, a resync every 600 s), both quiet; the
/// store is yet to choose.
fn world(build: Build) -> Builder {
    World::builder()
        .driver(Driver::dist_fake(&["--create-latency", "2s", "--delete-latency", "1s"]))
        .controller_binary(build.binary())
        .controller_env([("RUST_LOG", "warn")])
        .timings(&[])
        .controller_args(&["--workers", "10", "--driver-qps", "100000", "--driver-burst", "100000"])
        .controller_args(&["--health-check-interval", "300s", "--resync-interval", "600s"])
}

fn objects(replicas: usize) -> (serde_json::Value, serde_json::Value) {
    (
        json!({"apiVersion": "machine.driver.dev/v1alpha1", "kind": "MachineClass", "metadata": {"name": "small"},
               "spec": {"driver": "fake", "providerSpec": {"machineType": "small"}}}),
        json!({"apiVersion": "machine.driver.dev/v1alpha1", "kind": "MachineDeployment", "metadata": {"name": "bench"},
               "spec": {"replicas": replicas,
                        "template": {"spec": {"classRef": {"name": "small"}, "providerSpec": {"image": "os-1"}}},
                        "strategy": {"rollingUpdate": {"maxSurge": "10%", "maxUnavailable": 0}}}}),
    )
}

fn converged(md: &MachineDeployment, n: i64) -> bool {
    md.status.observed_generation >= md.metadata.generation
        && md.status.available_replicas == n
        && md.status.replicas == n
        && md.status.updated_replicas == n
}

/// 1,000 (or `n`) machines to Running through the embedded store.
async fn embedded(build: Build, n: usize) -> Duration {
    let mut w = world(build).sqlite().start().await;
    let store = w.store();
    let (class, md) = objects(n);
    let started = Instant::now();
    store.apply(machine_controller::resources::Kind::MachineClass, class).await.unwrap();
    store.apply(machine_controller::resources::Kind::MachineDeployment, md).await.unwrap();
    loop {
        if let Some(md) = store.get::<MachineDeployment>("default", "bench").await.ok().flatten() {
            if converged(&md, n as i64) {
                break;
            }
        }
        assert!(started.elapsed() < Duration::from_secs(600), "embedded run did not converge");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let t = started.elapsed();
    w.kill9().await;
    t
}

/// kube-apiserver's `apiserver_request_total` by "VERB resource[/subresource] [(code)]".
async fn api_requests(client: &kube::Client) -> BTreeMap<String, f64> {
    let text = client.request_text(http::Request::get("/metrics").body(Vec::new()).unwrap()).await.unwrap_or_default();
    let label = |l: &str, name: &str| -> String {
        let start = format!("{name}=\"");
        l.split(start.as_str()).nth(1).and_then(|r| r.split('"').next()).unwrap_or("").to_string()
    };
    let mut out = BTreeMap::new();
    for l in text.lines().filter(|l| l.starts_with("apiserver_request_total{")) {
        let Some(n) = l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else { continue };
        let sub = label(l, "subresource");
        let sub = if sub.is_empty() { sub } else { format!("/{sub}") };
        // Refused requests (a 409 conflict, say) count apart: they are work that bought nothing.
        let code = label(l, "code");
        let code = if code.starts_with('2') { String::new() } else { format!(" ({code})") };
        *out.entry(format!("{} {}{sub}{code}", label(l, "verb"), label(l, "resource"))).or_insert(0.0) += n;
    }
    out
}

/// Requests per machine by verb and resource between two readings (those ≥ 0.05 per machine).
fn breakdown(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>, n: usize) -> String {
    let mut parts: Vec<(String, f64)> = after
        .iter()
        .map(|(k, v)| (k.clone(), (v - before.get(k).copied().unwrap_or(0.0)) / n as f64))
        .filter(|(_, v)| *v >= 0.05)
        .collect();
    parts.sort_by(|a, b| b.1.total_cmp(&a.1));
    parts.iter().map(|(k, v)| format!("{k} {v:.2}")).collect::<Vec<_>>().join(", ")
}

struct KubeRun {
    breakdown: String,
    time: Duration,
    requests_per_machine: f64,
    peak_rss_mb: u64,
}

/// `n` machines to Running through the API server.
async fn through_api_server(build: Build, cluster: &Arc<Cluster>, n: usize) -> KubeRun {
    // Machines through the API server, without Nodes (no kubelets here), in a namespace of the
    // run's own: the runs before it left their machines, which are not this run's work.
    let mut w =
        world(build).kubernetes(cluster.clone(), "bench").controller_args(&["--no-target-cluster"]).start().await;
    let ns = w.ns().to_string();
    let ar = |kind: &str, plural: &str| {
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("machine.driver.dev", "v1alpha1", kind), plural)
    };
    let mc: Api<DynamicObject> =
        Api::namespaced_with(cluster.client.clone(), &ns, &ar("MachineClass", "machineclasses"));
    let mds: Api<DynamicObject> =
        Api::namespaced_with(cluster.client.clone(), &ns, &ar("MachineDeployment", "machinedeployments"));
    let (class, md) = objects(n);
    let before = api_requests(&cluster.client).await;
    let started = Instant::now();
    let pp = PatchParams::apply("bench").force();
    mc.patch("small", &pp, &Patch::Apply(&class)).await.unwrap();
    mds.patch("bench", &pp, &Patch::Apply(&md)).await.unwrap();
    let mut polls = 0u64;
    loop {
        polls += 1;
        if let Ok(o) = mds.get("bench").await {
            let md: MachineDeployment = serde_json::from_value(json!({
                "apiVersion": "machine.driver.dev/v1alpha1", "kind": "MachineDeployment",
                "metadata": {"name": "bench", "generation": o.metadata.generation.unwrap_or(0)},
                "spec": o.data["spec"], "status": o.data.get("status").filter(|s| !s.is_null()).cloned().unwrap_or(json!({}))}))
            .unwrap();
            if converged(&md, n as i64) {
                break;
            }
        }
        assert!(started.elapsed() < Duration::from_secs(900), "API server run did not converge");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let time = started.elapsed();
    let after = api_requests(&cluster.client).await;
    // The benchmark's own requests: 2 applies, the polls, 2 metrics reads.
    let ours = 2.0 + polls as f64 + 2.0;
    let breakdown = breakdown(&before, &after, n);
    let (before, after): (f64, f64) = (before.values().sum(), after.values().sum());
    let peak_rss_mb = e2e_tests::proc_status_kb(w.controller_pid(0), "VmHWM:") / 1024;
    w.kill9().await;
    KubeRun { breakdown, time, requests_per_machine: (after - before - ours) / n as f64, peak_rss_mb }
}

#[tokio::main]
async fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let (n, big) = if quick { (200, 2_000) } else { (1_000, 10_000) };
    let compare = std::env::var_os("BENCH_COMPARE").is_some();
    let cluster = Arc::new(Cluster::start().await);
    let mut out = format!(
        "Machine: {} cores ({}), {} — fake create latency 2 s, 10 workers, dist builds; \
         kube-apiserver 1.37.2 + etcd 3.7.3 on the same machine (etcd --unsafe-no-fsync)\n\n",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        e2e_tests::cpu_model(),
        if quick { "quick run" } else { "full run" }
    );
    if std::env::args().any(|a| a == "--rss-only") {
        let r = through_api_server(Build::This, &cluster, big).await;
        println!(
            "{big} machines: {:.1} s, {:.1} requests/machine, peak RSS {} MB",
            r.time.as_secs_f64(),
            r.requests_per_machine,
            r.peak_rss_mb
        );
        return;
    }
    // With a second build, each step runs both, alternating which goes first so drift in the
    // shared API server (it grows with every run) does not favour one.
    let builds: &[Build] = if compare { &[Build::This, Build::Compare] } else { &[Build::This] };
    let order = |step: usize| -> Vec<Build> {
        let mut b = builds.to_vec();
        if step % 2 == 1 {
            b.reverse();
        }
        b
    };
    let mut emb = BTreeMap::new();
    let mut api = BTreeMap::new();
    let mut bigrun = BTreeMap::new();
    for build in order(0) {
        println!("[1a] {n} machines through the embedded store, {} ...", build.name());
        let t = embedded(build, n).await;
        println!("     {:.2} s", t.as_secs_f64());
        emb.insert(build.name(), t);
    }
    for build in order(1) {
        println!("[1b] {n} machines through the API server, {} ...", build.name());
        let r = through_api_server(build, &cluster, n).await;
        println!("     {:.2} s, {:.2} API requests per machine", r.time.as_secs_f64(), r.requests_per_machine);
        println!("     per machine: {} (the benchmark's own polling included)", r.breakdown);
        api.insert(build.name(), r);
    }
    for build in order(2) {
        println!("[3] {big} machines through the API server, {} ...", build.name());
        let r = through_api_server(build, &cluster, big).await;
        println!(
            "     {:.1} s, {:.2} API requests per machine, controller peak RSS {} MB",
            r.time.as_secs_f64(),
            r.requests_per_machine,
            r.peak_rss_mb
        );
        println!("     per machine: {} (the benchmark's own polling included)", r.breakdown);
        bigrun.insert(build.name(), r);
    }
    let yes = |b: bool| if b { "yes" } else { "NO" };
    let this = Build::This.name();
    let (emb_t, api_r, big_r) = (emb[this].as_secs_f64(), &api[this], &bigrun[this]);
    out += "| benchmark | result | target | met |\n|---|---|---|---|\n";
    out += &format!("| {n} machines Running, embedded store | {emb_t:.2} s | — | |\n");
    out += &format!("| {n} machines Running, API server | {:.2} s | — | |\n", api_r.time.as_secs_f64());
    let ratio = api_r.time.as_secs_f64() / emb_t;
    out += &format!("| ratio (API server ÷ embedded), same run | {ratio:.2}× | ≤ 1.5× | {} |\n", yes(ratio <= 1.5));
    out += &format!(
        "| API requests per machine, create to Running ({n}) | {:.2} | ≤ 3 | {} |\n",
        api_r.requests_per_machine,
        yes(api_r.requests_per_machine <= 3.0)
    );
    out += &format!(
        "| controller peak RSS holding {big} Machines, API server ({:.1} s to Running, {:.2} requests/machine) | {} MB | ≤ 64 MB | {} |\n",
        big_r.time.as_secs_f64(),
        big_r.requests_per_machine,
        big_r.peak_rss_mb,
        yes(big_r.peak_rss_mb <= 64)
    );
    if compare {
        let other = Build::Compare.name();
        let (old_emb, old_api, old_big) = (emb[other].as_secs_f64(), &api[other], &bigrun[other]);
        out += &format!(
            "| {n} machines, embedded store, this ÷ {other} | {:.2}× ({emb_t:.2} s ÷ {old_emb:.2} s) | — | |\n",
            emb_t / old_emb
        );
        out += &format!(
            "| {n} machines, API server, this ÷ {other} | {:.2}× ({:.2} s ÷ {:.2} s; ratio to embedded then {:.2}×) | — | |\n",
            api_r.time.as_secs_f64() / old_api.time.as_secs_f64(),
            api_r.time.as_secs_f64(),
            old_api.time.as_secs_f64(),
            old_api.time.as_secs_f64() / old_emb
        );
        let big_ratio = big_r.time.as_secs_f64() / old_big.time.as_secs_f64();
        out += &format!(
            "| {big} machines, API server, this ÷ {other} | {big_ratio:.2}× ({:.1} s ÷ {:.1} s) | ≤ 0.65× | {} |\n",
            big_r.time.as_secs_f64(),
            old_big.time.as_secs_f64(),
            yes(big_ratio <= 0.65)
        );
        out += &format!(
            "| {other}: requests per machine ({n}); peak RSS at {big} | {:.2}; {} MB | — | |\n",
            old_api.requests_per_machine, old_big.peak_rss_mb
        );
    }
    println!("\n{out}");
    if let Ok(path) = std::env::var("BENCH_OUT") {
        std::fs::write(path, &out).unwrap();
    }
}
