//! Interruptions (docs/src/operating/interruptions.md), two figures in one run. Real processes:
//! `fake-driver` and `machine-controller run` (`dist` builds) over a Unix socket, started through
//! the test harness (`e2e_tests::world`); events injected into the fake cloud
//! (`fakecloud.v1.FakeCloud/InjectEvent`) and streamed to the controller over
//! `machinedriver.v1.Events`.
//!
//! 1. **Notice to replacement Ready and to node drained**, over 50 interruptions: a whole test
//!    cluster (`Cluster::start_full`: kube-apiserver, etcd, controller manager, scheduler, kwok),
//!    the controller on the Kubernetes store, a MachineDeployment of 10 spot machines (maxSurge
//!    1, maxUnavailable 0) carrying 20 pods under a PodDisruptionBudget (maxUnavailable 1).
//!    Five waves: each injects a spot interruption with a 60 s notice into all 10 machines at
//!    once and waits until every one is replaced. Per interruption, from the injection: its
//!    replacement Running with its Node Ready, and its Machine past the drain. Polled every
//!    200 ms (the resolution).
//! 2. **Controller CPU per event at 1,000 events per second**: 2,000 Machines without an owner
//!    on the embedded store (an interruption is recorded and nothing else happens, so the
//!    figure is the event's own cost: the stream, the Machine's read and status write, its
//!    event, the acknowledgement). Each Machine gets five events of rising weight (each one is
//!    recorded, none is a duplicate): 10,000 events injected at 1,000 per second by 20 clients.
//!    Controller CPU (utime + stime) from the first injection until the cloud holds no
//!    unacknowledged event, less the controller's idle CPU over a window as long, divided by the
//!    events.
//!
//! ```text
//! cargo build --profile dist -p fake-driver -p machine-controller --features fake-driver/join-cluster
//! export KUBE_CLUSTER_DIR=$(bash tests/tools/install-kube-cluster.sh)
//! cargo bench -p e2e-tests --bench interruptions              # both
//! cargo bench -p e2e-tests --bench interruptions -- --cpu     # only 2.
//! ```
//! Set BENCH_OUT=path to also write the markdown table there.

// Test code: a setup that fails is a failed test (the workspace warns of `unwrap` in what ships).
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use e2e_tests::kube_cluster::Cluster;
use e2e_tests::world::{Driver, World};
use fake_driver::pb as fake;
use machine_controller::resources::*;
use serde_json::json;

const WAVES: usize = 5;
const PER_WAVE: usize = 10;
const NOTICE: Duration = Duration::from_secs(60);
const CPU_MACHINES: usize = 2_000;
const KINDS: [&str; 5] = [
    "REBALANCE_RECOMMENDATION",
    "IMPAIRED",
    "SCHEDULED_MAINTENANCE",
    "SPOT_INTERRUPTION",
    "CAPACITY_RESERVATION_INTERRUPTION",
];
const RATE: f64 = 1_000.0;
const CLIENTS: usize = 20;

fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn inject_request(machine: &str, kind: &str, notice: Option<Duration>) -> fake::InjectEventRequest {
    fake::InjectEventRequest {
        machine: machine.into(),
        kind: kind.into(),
        notice: notice.map(|d| driver_sdk::prost_types::Duration { seconds: d.as_secs() as i64, nanos: 0 }),
        message: "injected by the benchmark".into(),
    }
}

/// Figure 1: (seconds to replacement Ready, seconds to drained) per interruption.
async fn notice_to_ready() -> (Vec<f64>, Vec<f64>) {
    let cluster = Cluster::start_full().await;
    let kubeconfig = cluster.kubeconfig.to_string_lossy().into_owned();
    let fake_args = ["--create-latency", "1s", "--delete-latency", "500ms", "--join-cluster", &kubeconfig];
    let mut w = World::builder()
        .driver(Driver::dist_fake(&fake_args))
        .controller_binary(e2e_tests::dist_bin("machine-controller"))
        .controller_env([("RUST_LOG", "warn")])
        .kubernetes(cluster, "bench-interrupt")
        .controller_args(&["--resync-interval", "5s", "--drain-poll-interval", "500ms"])
        .without_controller()
        .start()
        .await;
    w.start_controller(&[]);
    let class = json!({"driver": "fake", "providerSpec": {"machineType": "small", "capacityType": "spot"}});
    w.apply_object(
        "MachineClass",
        "machineclasses",
        json!({"metadata": {"name": "spot"}, "spec": e2e_tests::joining(class)}),
    )
    .await;
    let spec = json!({
        "replicas": PER_WAVE,
        "template": {"spec": {"classRef": {"name": "spot"}, "providerSpec": {"image": "os-1"}}},
        "strategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
    });
    w.apply_object("MachineDeployment", "machinedeployments", json!({"metadata": {"name": "web"}, "spec": spec})).await;
    w.converged("web", Duration::from_secs(300)).await;
    w.workload("app", 2 * PER_WAVE as i32, Some(json!({"maxUnavailable": 1}))).await;
    let (mut ready, mut drained) = (Vec::new(), Vec::new());
    for wave in 0..WAVES {
        let victims: Vec<String> =
            w.machines().await.into_iter().filter(|m| !m.is_deleting()).map(|m| m.metadata.name).collect();
        let mut client = w.fake().await;
        let started = Instant::now();
        for v in &victims {
            client.inject_event(inject_request(v, "SPOT_INTERRUPTION", Some(NOTICE))).await.unwrap();
        }
        let mut ready_at: HashMap<String, f64> = HashMap::new();
        let mut drained_at: HashMap<String, f64> = HashMap::new();
        while ready_at.len() < victims.len() || drained_at.len() < victims.len() {
            assert!(started.elapsed() < 3 * NOTICE, "wave {wave}: not handled in {:?}", 3 * NOTICE);
            let machines = w.machines().await;
            let now = started.elapsed().as_secs_f64();
            for v in &victims {
                let past_drain = machines.iter().find(|m| &m.metadata.name == v).is_none_or(|m| {
                    m.status
                        .deletion
                        .as_ref()
                        .is_some_and(|d| !matches!(d.phase, DeletionPhase::PreDrainHooks | DeletionPhase::Draining))
                });
                if past_drain {
                    drained_at.entry(v.clone()).or_insert(now);
                }
                let replaced = machines.iter().any(|m| {
                    m.metadata
                        .annotations
                        .get(ANNOTATION_REPLACES_INTERRUPTION)
                        .is_some_and(|a| a.starts_with(&format!("{v}/")))
                        && m.status.phase == Phase::Running
                        && condition(&m.status.conditions, ConditionType::NodeReady)
                            .is_some_and(|c| c.status == ConditionStatus::True)
                });
                if replaced {
                    ready_at.entry(v.clone()).or_insert(now);
                }
            }
            // Deliberate: the measuring protocol's poll interval (the figures' resolution).
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        eprintln!("wave {wave}: {} interruptions handled in {:.1} s", victims.len(), started.elapsed().as_secs_f64());
        ready.extend(ready_at.into_values());
        drained.extend(drained_at.into_values());
        w.converged("web", Duration::from_secs(300)).await;
    }
    let reclaimed = w.inspect().await.counters.map_or(0, |c| c.machines_reclaimed);
    assert_eq!(reclaimed, 0, "a VM was still there at its deadline");
    w.kill9().await;
    (ready, drained)
}

/// Figure 2: (events, seconds injecting, controller CPU µs per event, idle CPU µs per second).
async fn cpu_per_event() -> (usize, f64, f64, f64) {
    let w = World::builder()
        .driver(Driver::dist_fake(&["--create-latency", "100ms", "--delete-latency", "100ms"]))
        .controller_binary(e2e_tests::dist_bin("machine-controller"))
        .controller_env([("RUST_LOG", "warn")])
        .timings(&[])
        .controller_args(&["--workers", "10", "--driver-qps", "100000", "--driver-burst", "100000"])
        .controller_args(&["--health-check-interval", "300s"])
        .start()
        .await;
    let mut yaml = String::from(
        "apiVersion: machine.driver.dev/v1alpha1\nkind: MachineClass\nmetadata: {name: small}\nspec: {driver: fake, providerSpec: {machineType: small}}\n",
    );
    for i in 0..CPU_MACHINES {
        yaml += &format!(
            "---\napiVersion: machine.driver.dev/v1alpha1\nkind: Machine\nmetadata: {{name: m-{i:05}}}\nspec: {{classRef: {{name: small}}, providerSpec: {{image: os-1}}}}\n"
        );
    }
    w.apply(&yaml).await;
    let started = Instant::now();
    loop {
        let running = w.inspect().await.machines.len();
        if running >= CPU_MACHINES {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(600), "{running} of {CPU_MACHINES} machines in the cloud");
        // A poll with a deadline (above).
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let pid = w.controller_pid(0);
    // Deliberate, the measuring protocol: let the creates' tail settle, then the idle baseline
    // over the injection's length.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let total = CPU_MACHINES * KINDS.len();
    let window = Duration::from_secs_f64(total as f64 / RATE);
    let idle0 = e2e_tests::cpu_seconds(pid);
    tokio::time::sleep(window).await;
    let idle = (e2e_tests::cpu_seconds(pid) - idle0) / window.as_secs_f64();

    let cpu0 = e2e_tests::cpu_seconds(pid);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..CLIENTS {
        let mut client = w.fake().await;
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs_f64(CLIENTS as f64 / RATE));
            // Kind by kind over every machine: each event weighs more than the one recorded.
            for kind in KINDS {
                for i in (c..CPU_MACHINES).step_by(CLIENTS) {
                    tick.tick().await;
                    client.inject_event(inject_request(&format!("m-{i:05}"), kind, None)).await.unwrap();
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let injecting = started.elapsed().as_secs_f64();
    loop {
        let pending = w.inspect().await.events_pending;
        if pending == 0 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(600), "{pending} events not acknowledged");
        // A poll with a deadline (above).
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let handled = started.elapsed().as_secs_f64();
    let cpu = e2e_tests::cpu_seconds(pid) - cpu0 - idle * handled;
    eprintln!("{total} events injected in {injecting:.1} s, all acknowledged after {handled:.1} s");
    (total, injecting, cpu / total as f64 * 1e6, idle * 1e6)
}

#[tokio::main]
async fn main() {
    let only_cpu = std::env::args().any(|a| a == "--cpu");
    let mut out = String::from("| figure | value |\n|---|---|\n");
    if !only_cpu {
        let (ready, drained) = notice_to_ready().await;
        let row = |v: &Vec<f64>| {
            format!(
                "median {:.1} s, p95 {:.1} s, max {:.1} s ({} of {})",
                percentile(v.clone(), 0.5),
                percentile(v.clone(), 0.95),
                percentile(v.clone(), 1.0),
                v.len(),
                WAVES * PER_WAVE
            )
        };
        out += &format!("| notice ({} s) to replacement Ready | {} |\n", NOTICE.as_secs(), row(&ready));
        out += &format!("| notice ({} s) to node drained | {} |\n", NOTICE.as_secs(), row(&drained));
    }
    let (events, injecting, per_event, idle) = cpu_per_event().await;
    out += &format!(
        "| controller CPU per event, {events} events at {:.0}/s | **{per_event:.0} µs** (idle: {idle:.0} µs of CPU per second) |\n",
        events as f64 / injecting
    );
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    out += &format!("\nload average at the end: {load}");
    println!("{out}");
    if let Some(path) = std::env::var_os("BENCH_OUT") {
        std::fs::write(path, &out).unwrap();
    }
}
