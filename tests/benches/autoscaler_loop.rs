//! The controller's cluster-autoscaler server (docs/src/operating/autoscaling.md), in one run so
//! the figures compare:
//!
//! 1. **CPU per autoscaler loop** with 1,000 machines in 20 autoscaled MachineDeployments, on the
//!    embedded store, the server called in this process (the `CloudProvider` trait, no network)
//!    and again over gRPC on loopback (tonic client and server in this process: both sides'
//!    CPU). One loop is what the real autoscaler calls per scan (autoscaler-reference.md):
//!    `Refresh`, `NodeGroups`, `NodeGroupForNode` for every node, and per group
//!    `NodeGroupTargetSize`, 3 × `NodeGroupGetOptions`, `NodeGroupTemplateNodeInfo` and
//!    `NodeGroupNodes`. Side by side, the same loop answered by a scan of the store per call
//!    (a snapshot read before every `NodeGroupForNode`: what an implementation without the
//!    index pays).
//! 2. **Pending pod to Running on a new node**, with the real cluster-autoscaler (1.36.1,
//!    `tests/tools/install-autoscaler.sh`; 2 s scan interval) on the test cluster, the fake
//!    cloud (create latency 300 ms) and release builds: split into the autoscaler's decision (pod
//!    created → `replicas` raised), our create (→ the VM runs: `status.provisioned`) and the join
//!    (→ the Node Ready, the pod Running). 3 rounds, one pod each.
//!
//! ```text
//! cargo build --release -p machine-controller -p fake-driver --features fake-driver/join-cluster
//! export KUBE_CLUSTER_DIR=$(bash tests/tools/install-kube-cluster.sh)
//! export CLUSTER_AUTOSCALER_BIN=$(bash tests/tools/install-autoscaler.sh)
//! cargo bench -p e2e-tests --bench autoscaler_loop             # both parts
//! cargo bench -p e2e-tests --bench autoscaler_loop -- --loop   # only 1.
//! ```
//! Set BENCH_OUT=path to also write the markdown table there.

// Test code: a setup that fails is a failed test (the workspace warns of `unwrap` in what ships).
#![allow(clippy::unwrap_used)]

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use autoscaler_proto::pb;
use autoscaler_proto::pb::cloud_provider_client::CloudProviderClient;
use autoscaler_proto::pb::cloud_provider_server::CloudProvider;
use e2e_tests::world::World;
use machine_controller::autoscaler::Server;
use machine_controller::resources::*;
use machine_controller::store::Store;
use serde_json::json;
use tonic::Request;

const GROUPS: usize = 20;
const MACHINES: usize = 1000;

/// This process's CPU time (user + system), in seconds.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // After the command: state is field 0, utime 11, stime 12; 100 ticks a second.
    (ticks(11) + ticks(12)) / 100.0
}

fn provider_id(group: usize, i: usize) -> String {
    format!("fake:///zone-a/vm-{group:02}-{i:04}")
}

/// 20 autoscaled deployments of 50 Running machines each, written straight into a new store.
async fn fill(store: &Store) {
    let class = json!({"apiVersion": API_VERSION, "kind": "MachineClass", "metadata": {"name": "small", "namespace": "default"},
        "spec": {"driver": "fake", "providerSpec": {"machineType": "small"}, "capacity": {"cpu": "2", "memory": "4Gi"}}});
    store.create(&serde_json::from_value::<MachineClass>(class).unwrap()).await.unwrap();
    for g in 0..GROUPS {
        let md = json!({"apiVersion": API_VERSION, "kind": "MachineDeployment",
            "metadata": {"name": format!("group-{g:02}"), "namespace": "default"},
            "spec": {"replicas": MACHINES / GROUPS, "autoscaling": {"minReplicas": 1, "maxReplicas": 100},
                     "template": {"spec": {"classRef": {"name": "small"}}}}});
        store.create(&serde_json::from_value::<MachineDeployment>(md).unwrap()).await.unwrap();
        for i in 0..MACHINES / GROUPS {
            let m = json!({"apiVersion": API_VERSION, "kind": "Machine",
                "metadata": {"name": format!("group-{g:02}-{i:04}"), "namespace": "default",
                             "labels": {LABEL_DEPLOYMENT: format!("group-{g:02}")}},
                "spec": {"classRef": {"name": "small"}}});
            let mut m = store.create(&serde_json::from_value::<Machine>(m).unwrap()).await.unwrap();
            m.status.phase = Phase::Running;
            m.status.provider_id = provider_id(g, i);
            store.replace_status(&m).await.unwrap();
        }
    }
}

/// The calls of one autoscaler loop, through `call`.
fn loop_calls() -> Vec<Call> {
    let mut calls = vec![Call::Refresh, Call::NodeGroups];
    for g in 0..GROUPS {
        for i in 0..MACHINES / GROUPS {
            calls.push(Call::ForNode(provider_id(g, i)));
        }
    }
    for g in 0..GROUPS {
        let id = format!("default/group-{g:02}");
        calls.extend([Call::TargetSize(id.clone()), Call::Options(id.clone()), Call::Options(id.clone())]);
        calls.extend([Call::Options(id.clone()), Call::Template(id.clone()), Call::Nodes(id)]);
    }
    calls
}

#[derive(Clone)]
enum Call {
    Refresh,
    NodeGroups,
    ForNode(String),
    TargetSize(String),
    Options(String),
    Template(String),
    Nodes(String),
}

fn node(pid: &str) -> Option<pb::ExternalGrpcNode> {
    Some(pb::ExternalGrpcNode { provider_id: pid.into(), ..Default::default() })
}

/// One loop on the server directly; with `scan`, a store read before every node lookup.
async fn loop_direct(s: &Server, calls: &[Call], scan: bool) {
    for c in calls {
        match c.clone() {
            Call::Refresh => drop(s.refresh(Request::new(pb::RefreshRequest {})).await.unwrap()),
            Call::NodeGroups => drop(s.node_groups(Request::new(pb::NodeGroupsRequest {})).await.unwrap()),
            Call::ForNode(pid) => {
                if scan {
                    s.refresh(Request::new(pb::RefreshRequest {})).await.unwrap();
                }
                let r = s.node_group_for_node(Request::new(pb::NodeGroupForNodeRequest { node: node(&pid) })).await;
                assert!(!r.unwrap().into_inner().node_group.unwrap().id.is_empty());
            }
            Call::TargetSize(id) => {
                drop(s.node_group_target_size(Request::new(pb::NodeGroupTargetSizeRequest { id })).await.unwrap())
            }
            Call::Options(id) => {
                let r = pb::NodeGroupAutoscalingOptionsRequest { id, defaults: Some(Default::default()) };
                drop(s.node_group_get_options(Request::new(r)).await.unwrap())
            }
            Call::Template(id) => {
                let r = pb::NodeGroupTemplateNodeInfoRequest { id };
                drop(s.node_group_template_node_info(Request::new(r)).await.unwrap())
            }
            Call::Nodes(id) => drop(s.node_group_nodes(Request::new(pb::NodeGroupNodesRequest { id })).await.unwrap()),
        }
    }
}

/// One loop over gRPC.
async fn loop_grpc(c: &mut CloudProviderClient<tonic::transport::Channel>, calls: &[Call]) {
    for call in calls {
        match call.clone() {
            Call::Refresh => drop(c.refresh(pb::RefreshRequest {}).await.unwrap()),
            Call::NodeGroups => drop(c.node_groups(pb::NodeGroupsRequest {}).await.unwrap()),
            Call::ForNode(pid) => {
                let r = c.node_group_for_node(pb::NodeGroupForNodeRequest { node: node(&pid) }).await;
                assert!(!r.unwrap().into_inner().node_group.unwrap().id.is_empty());
            }
            Call::TargetSize(id) => {
                drop(c.node_group_target_size(pb::NodeGroupTargetSizeRequest { id }).await.unwrap())
            }
            Call::Options(id) => {
                let r = pb::NodeGroupAutoscalingOptionsRequest { id, defaults: Some(Default::default()) };
                drop(c.node_group_get_options(r).await.unwrap())
            }
            Call::Template(id) => {
                drop(c.node_group_template_node_info(pb::NodeGroupTemplateNodeInfoRequest { id }).await.unwrap())
            }
            Call::Nodes(id) => drop(c.node_group_nodes(pb::NodeGroupNodesRequest { id }).await.unwrap()),
        }
    }
}

/// (CPU ms, wall ms) per loop of `f` over `loops` loops.
async fn measure<F: std::future::Future<Output = ()>>(loops: usize, mut f: impl FnMut() -> F) -> (f64, f64) {
    f().await; // warm
    let (cpu, wall) = (cpu_seconds(), Instant::now());
    for _ in 0..loops {
        f().await;
    }
    let per = |s: f64| s * 1000.0 / loops as f64;
    (per(cpu_seconds() - cpu), per(wall.elapsed().as_secs_f64()))
}

async fn part_loop(out: &mut String) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("store.db")).unwrap();
    let t = Instant::now();
    fill(&store).await;
    println!("filled the store with {MACHINES} machines in {GROUPS} groups in {:.1} s", t.elapsed().as_secs_f64());
    let acting = Arc::new(AtomicBool::new(true));
    let calls = loop_calls();
    let server = Server::new(store.clone(), None, acting.clone());
    let (index_cpu, index_wall) = measure(50, || loop_direct(&server, &calls, false)).await;
    let (scan_cpu, scan_wall) = measure(3, || loop_direct(&server, &calls, true)).await;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let served = Server::new(store.clone(), None, acting);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(autoscaler_proto::pb::cloud_provider_server::CloudProviderServer::new(served))
            .serve_with_incoming(tokio_stream::StreamExt::map(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                |conn| {
                    conn.inspect(|s| {
                        let _ = s.set_nodelay(true);
                    })
                },
            )),
    );
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
    let client = CloudProviderClient::new(channel);
    let (grpc_cpu, grpc_wall) = measure(20, || {
        let (mut c, calls) = (client.clone(), &calls);
        async move { loop_grpc(&mut c, calls).await }
    })
    .await;
    let n = calls.len();
    *out += &format!(
        "\n### CPU per autoscaler loop: {MACHINES} machines in {GROUPS} groups ({n} calls a loop)\n\n\
         | answered | CPU per loop | wall per loop | vs. the index |\n|---|---|---|---|\n\
         | from the index (in process) | {index_cpu:.1} ms | {index_wall:.1} ms | 1.0× |\n\
         | from the index, over gRPC on loopback (client + server CPU) | {grpc_cpu:.1} ms | {grpc_wall:.1} ms | {:.1}× |\n\
         | by a store scan per node (in process) | {scan_cpu:.0} ms | {scan_wall:.0} ms | {:.0}× |\n",
        grpc_cpu / index_cpu.max(0.001),
        scan_cpu / index_cpu.max(0.001),
    );
}

async fn part_latency(out: &mut String) {
    let mut w = World::on_full_cluster(&["--create-latency", "300ms", "--delete-latency", "200ms"], "bench-ca").await;
    let c = w.start_controller(&["--autoscaler-listen", "127.0.0.1:0"]);
    let address = w
        .wait_for("the autoscaler server address", Duration::from_secs(60), || async {
            e2e_tests::addr_after(&w.controller_log(c), "cloud provider (externalgrpc) on ").map(|a| a.to_string())
        })
        .await;
    let spec =
        json!({"driver": "fake", "providerSpec": {"machineType": "small"}, "capacity": {"cpu": "2", "memory": "4Gi"}});
    w.apply_object(
        "MachineClass",
        "machineclasses",
        json!({"metadata": {"name": "small"}, "spec": e2e_tests::joining(spec)}),
    )
    .await;
    let md = json!({"replicas": 1, "autoscaling": {"minReplicas": 1, "maxReplicas": 10},
        "template": {"spec": {"classRef": {"name": "small"}}}});
    w.apply_object("MachineDeployment", "machinedeployments", json!({"metadata": {"name": "web"}, "spec": md})).await;
    w.converged("web", Duration::from_secs(120)).await;
    let config = w.dir().join("cloud-config.yaml");
    std::fs::write(&config, format!("address: \"{address}\"\ngrpc_timeout: 10s\n")).unwrap();
    let log = std::fs::File::create(w.dir().join("ca.log")).unwrap();
    let bin = std::env::var("CLUSTER_AUTOSCALER_BIN").expect("CLUSTER_AUTOSCALER_BIN");
    let _ca = tokio::process::Command::new(bin)
        .args(["--cloud-provider=externalgrpc", &format!("--cloud-config={}", config.display())])
        .arg(format!("--kubeconfig={}", w.cluster().kubeconfig.display()))
        .args(["--leader-elect=false", &format!("--namespace={}", w.ns()), "--address=127.0.0.1:0"])
        .args(["--scan-interval=2s", "--scale-down-enabled=false", "--max-node-provision-time=2m"])
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut rows = Vec::new();
    for round in 1..=3i32 {
        // One more pod of 1.5 CPUs than there are nodes (one fits a node): it stays Pending until
        // a node comes. (An autoscaler loop can ask for a node more than the pods need: the next
        // round starts from the nodes there are.)
        let nodes = w.md("web").await.spec.replicas;
        let want = nodes + 1;
        let start = Instant::now();
        let pods = json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "big", "namespace": w.ns()},
            "spec": {"replicas": want, "selector": {"matchLabels": {"app": "big"}},
                     "template": {"metadata": {"labels": {"app": "big"}}, "spec": {"containers": [{"name": "app",
                        "image": "registry.invalid/app:1", "resources": {"requests": {"cpu": "1500m"}}}]}}}});
        w.cluster().apply_json(pods).await;
        let (mut decided, mut created, mut joined) = (None, None, None);
        let ready = loop {
            let md = w.md("web").await;
            if decided.is_none() && md.spec.replicas >= want {
                decided = Some(start.elapsed());
            }
            let machines = w.machines().await;
            if created.is_none() && machines.iter().filter(|m| m.status.provisioned.is_some()).count() as i64 >= want {
                created = Some(start.elapsed());
            }
            if joined.is_none() && machines.iter().filter(|m| m.status.phase == Phase::Running).count() as i64 >= want {
                joined = Some(start.elapsed());
            }
            if w.ready_pods("big").await.len() as i64 >= want {
                break start.elapsed();
            }
            assert!(start.elapsed() < Duration::from_secs(180), "round {round}: no pod Running in 3 minutes");
            // Deliberate: the sampling interval of the timeline.
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let s = |d: Option<Duration>| d.map_or(f64::NAN, |d| d.as_secs_f64());
        let (d, c2, j) = (s(decided), s(created), s(joined));
        rows.push((d, c2 - d, j - c2, ready.as_secs_f64() - j, ready.as_secs_f64()));
        println!(
            "round {round}: decided {d:.2} s, VM running {c2:.2} s, Node Ready {j:.2} s, pod Running {:.2} s",
            ready.as_secs_f64()
        );
    }
    *out += "\n### Pending pod to Running on a new node (real cluster-autoscaler, 2 s scan)\n\n\
             | round | autoscaler's decision | our create (VM running) | join (Node Ready) | pod Running after | total |\n\
             |---|---|---|---|---|---|\n";
    for (i, (d, c, j, p, t)) in rows.iter().enumerate() {
        *out += &format!("| {} | {d:.2} s | {c:.2} s | {j:.2} s | {p:.2} s | {t:.2} s |\n", i + 1);
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let only_loop = std::env::args().any(|a| a == "--loop");
    let mut out = format!(
        "## Autoscaler server ({}, {} cores)\n",
        e2e_tests::cpu_model(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    part_loop(&mut out).await;
    if !only_loop {
        part_latency(&mut out).await;
    }
    println!("{out}");
    if let Ok(path) = std::env::var("BENCH_OUT") {
        std::fs::write(path, &out).unwrap();
    }
}
