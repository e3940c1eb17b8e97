//! One controller for many target clusters (docs/src/operating/many-clusters.md): what each
//! target and each machine costs the controller, and what a dead target costs the others. Real
//! processes: ten whole test clusters (`Cluster::start_full`: kube-apiserver, etcd,
//! controller-manager, scheduler, kwok), a `fake-driver --join-cluster` per target (`dist`
//! builds), and one `machine-controller run --no-target-cluster` (`dist`) on the embedded store,
//! where each target has a kubeconfig Secret (the controller's ServiceAccount there, with the RBAC
//! of `deploy/target-rbac.yaml`), a class of its cloud and a MachineDeployment of 50 machines
//! whose VMs join it by TLS bootstrap.
//!
//! 1. One process, growing: 1, then 5, then 10 targets of 50 machines each. At each level, once
//!    every machine is Running (its Node Ready), a steady window: the controller's RSS, its CPU
//!    over the window, and its requests to the targets. The per-target figure is the slope
//!    between levels; the per-machine one, RSS over machines.
//! 2. With the ten targets: a reconcile's latency on healthy targets — a deployment scaled from
//!    50 to 51, timed until its new Machine exists (the deployment's reconcile) and until it is
//!    Running (its Node Ready) — for three healthy targets, then again for three others while
//!    target 10's kube-apiserver is dead (kill -9).
//!
//! ```text
//! CARGO_TARGET_DIR=... cargo build --profile dist -p fake-driver -p machine-controller --features fake-driver/join-cluster
//! export KUBE_CLUSTER_DIR=$(bash tests/tools/install-kube-cluster.sh)
//! cargo bench -p e2e-tests --bench multi_target              # 1, 5, 10 targets × 50 machines, 60 s windows
//! cargo bench -p e2e-tests --bench multi_target -- --quick   # 1, 2, 3 targets × 20 machines, 20 s windows
//! ```
//! Set BENCH_OUT=path to also write the markdown table there.

// Test code: a setup that fails is a failed test (the workspace warns of `unwrap` in what ships).
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use e2e_tests::kube_cluster::Cluster;
use e2e_tests::world::{Driver, World};
use e2e_tests::Sidecar;
use machine_controller::resources::{Machine, MachineDeployment, Phase, LABEL_DEPLOYMENT};

const MINUTE: Duration = Duration::from_secs(60);

struct Target {
    cluster: Cluster,
    _sidecar: Option<Sidecar>,
}

fn fake(i: usize, cluster: &Cluster) -> Driver {
    let kubeconfig = cluster.kubeconfig.to_string_lossy().into_owned();
    Driver::dist_fake(&["--create-latency", "1s", "--delete-latency", "500ms", "--join-cluster", &kubeconfig])
        .named(&format!("fake-{i}"))
}

/// What the controller used over one steady window.
struct Window {
    targets: usize,
    machines: usize,
    rss_mb: f64,
    cpu_percent: f64,
    requests_per_min: f64,
}

async fn target_requests(w: &World) -> f64 {
    let addr = w.metrics_addr(0).await;
    let (_, body) = e2e_tests::http_get(addr.port(), "/metrics").await.expect("/metrics");
    body.lines()
        .filter(|l| l.starts_with("controller_target_calls_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn running(w: &World, t: usize) -> usize {
    let md = format!("web-{t}");
    let machines = w.store().list::<Machine>().await.unwrap_or_default();
    machines
        .iter()
        .filter(|m| m.metadata.labels.get(LABEL_DEPLOYMENT) == Some(&md))
        .filter(|m| m.status.phase == Phase::Running && m.metadata.deletion_timestamp.is_none())
        .count()
}

async fn apply_md(w: &World, t: usize, replicas: usize) {
    let yaml = format!(
        "apiVersion: machine.driver.dev/v1alpha1\nkind: MachineDeployment\nmetadata: {{name: web-{t}}}\nspec:\n  \
         replicas: {replicas}\n  targetCluster: {{kubeconfigSecretRef: {{name: target-{t}}}}}\n  template:\n    \
         spec: {{classRef: {{name: small-{t}}}}}\n  strategy: {{rollingUpdate: {{maxSurge: 10, maxUnavailable: 0}}}}\n"
    );
    w.apply(&yaml).await;
}

async fn all_running(w: &World, targets: std::ops::Range<usize>, per: usize, within: Duration) -> Duration {
    let started = Instant::now();
    let what = format!("{} targets × {per} machines Running", targets.len());
    w.wait_for(&what, within, || {
        let targets = targets.clone();
        async move {
            for t in targets {
                if running(w, t).await < per {
                    return None;
                }
            }
            Some(())
        }
    })
    .await;
    started.elapsed()
}

async fn window(w: &World, targets: usize, per: usize, length: Duration) -> Window {
    let pid = w.controller_pid(0);
    let (cpu0, req0, t0) = (e2e_tests::cpu_seconds(pid), target_requests(w).await, Instant::now());
    // Deliberate: the steady window being measured.
    tokio::time::sleep(length).await;
    let elapsed = t0.elapsed().as_secs_f64();
    let (cpu1, req1) = (e2e_tests::cpu_seconds(pid), target_requests(w).await);
    Window {
        targets,
        machines: targets * per,
        rss_mb: e2e_tests::proc_status_kb(pid, "VmRSS:") as f64 / 1024.0,
        cpu_percent: (cpu1 - cpu0) / elapsed * 100.0,
        requests_per_min: (req1 - req0) / elapsed * 60.0,
    }
}

/// Scales `web-T` by one: how long until its new Machine exists, and until it is Running.
async fn scale_up_latency(w: &World, t: usize, per: usize) -> (Duration, Duration) {
    let md = format!("web-{t}");
    let count = || async {
        let machines = w.store().list::<Machine>().await.unwrap_or_default();
        machines.iter().filter(|m| m.metadata.labels.get(LABEL_DEPLOYMENT) == Some(&md)).count()
    };
    let started = Instant::now();
    apply_md(w, t, per + 1).await;
    w.wait_for(&format!("{md}'s new Machine"), MINUTE, || async { (count().await > per).then_some(()) }).await;
    let made = started.elapsed();
    w.wait_for(&format!("{md}'s new Machine Running"), 3 * MINUTE, || async {
        (running(w, t).await > per).then_some(())
    })
    .await;
    let ready = started.elapsed();
    apply_md(w, t, per).await;
    (made, ready)
}

#[tokio::main]
async fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let (levels, per, length) =
        if quick { (vec![1, 2, 3], 20, Duration::from_secs(20)) } else { (vec![1, 5, 10], 50, MINUTE) };
    let n = *levels.last().unwrap();
    let started = Instant::now();
    let mut clusters = Vec::new();
    for _ in 0..n {
        clusters.push(Cluster::start_full().await);
    }
    println!("{n} target clusters started in {:.0} s", started.elapsed().as_secs_f64());
    let mut targets = Vec::new();
    let mut driver_args = Vec::new();
    let mut first = None;
    for (i, cluster) in clusters.into_iter().enumerate() {
        let driver = fake(i, &cluster);
        let sidecar = if i == 0 {
            first = Some(driver);
            None
        } else {
            let s = driver.start().await;
            driver_args.extend(["--driver".to_string(), format!("fake-{i}={}", s.endpoint())]);
            Some(s)
        };
        targets.push(Target { cluster, _sidecar: sidecar });
    }
    let mut args: Vec<&str> = vec!["--no-target-cluster", "--driver-qps", "100000", "--driver-burst", "100000"];
    args.extend(driver_args.iter().map(String::as_str));
    let w = World::builder()
        .driver(first.unwrap())
        .controller_binary(e2e_tests::dist_bin("machine-controller"))
        .timings(&[])
        .metrics()
        .controller_args(&args)
        .controller_env([("RUST_LOG", "warn,machine_controller::cli::run=info")])
        .start()
        .await;
    for (i, t) in targets.iter().enumerate() {
        let kubeconfig = t.cluster.target_kubeconfig("bench").await;
        let indented: String = kubeconfig.lines().map(|l| format!("    {l}\n")).collect();
        w.apply(&format!(
            "apiVersion: v1\nkind: Secret\nmetadata: {{name: target-{i}}}\nstringData:\n  value: |\n{indented}"
        ))
        .await;
        let class = e2e_tests::joining_class(&format!("small-{i}"), "{machineType: small}")
            .replace("driver: fake\n", &format!("driver: fake-{i}\n"));
        w.apply(&class).await;
    }

    let mut windows = Vec::new();
    let mut active = 0;
    for &level in &levels {
        for t in active..level {
            apply_md(&w, t, per).await;
        }
        let took = all_running(&w, active..level, per, 10 * MINUTE).await;
        println!("{level} targets: {} more machines Running in {:.0} s", (level - active) * per, took.as_secs_f64());
        active = level;
        let win = window(&w, level, per, length).await;
        println!(
            "  {} machines: RSS {:.1} MB, CPU {:.2} %, {:.0} target requests/min",
            win.machines, win.rss_mb, win.cpu_percent, win.requests_per_min
        );
        windows.push(win);
    }

    // A reconcile's latency on healthy targets, with every target up and then with one dead.
    let probe = |range: std::ops::Range<usize>| {
        let w = &w;
        async move {
            let mut out = Vec::new();
            for t in range {
                out.push(scale_up_latency(w, t, per).await);
            }
            out
        }
    };
    let healthy = probe(0..3.min(n - 1)).await;
    let dead = n - 1;
    let mut killed = targets.remove(dead);
    killed.cluster.kill9_apiserver().await;
    // The probe notices within one interval (5 s); the latency is measured after that.
    w.wait_for("the dead target's deployment TargetReachable False", MINUTE, || async {
        let md = w.store().get::<MachineDeployment>("default", &format!("web-{dead}")).await.ok().flatten()?;
        let c = machine_controller::resources::condition(
            &md.status.conditions,
            machine_controller::resources::ConditionType::TargetReachable,
        )?;
        (c.status == machine_controller::resources::ConditionStatus::False).then_some(())
    })
    .await;
    let first_healthy = 3.min(n - 1);
    let with_dead = probe(first_healthy..(2 * first_healthy).min(dead)).await;

    let mb = |w: &Window| w.rss_mb;
    let (lo, hi) = (&windows[0], windows.last().unwrap());
    let per_target_mb = (mb(hi) - mb(lo)) / (hi.targets - lo.targets) as f64;
    let per_target_cpu = (hi.cpu_percent - lo.cpu_percent) / (hi.targets - lo.targets) as f64;
    let mut out = format!(
        "Machine: {} cores ({}); {}; dist builds; fake create latency 1 s; controller on the embedded store, \
         `run --no-target-cluster`, default timings; each target a whole test cluster (kube-apiserver 1.37.2, \
         etcd 3.7.3, controller-manager, scheduler, kwok 0.8.0) on the same machine, {per} machines each\n\n\
         | targets | machines | controller RSS | CPU (steady, {} s) | target requests/min |\n|---|---|---|---|---|\n",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        e2e_tests::cpu_model(),
        if quick { "quick run (--quick)" } else { "full run" },
        length.as_secs()
    );
    for win in &windows {
        out += &format!(
            "| {} | {} | {:.1} MB | {:.2} % | {:.0} |\n",
            win.targets, win.machines, win.rss_mb, win.cpu_percent, win.requests_per_min
        );
    }
    out += &format!(
        "\nPer target of {per} machines (slope from {} to {} targets): {per_target_mb:.2} MB of RSS ({:.1} KB per \
         machine, if all of it were the machines'), {per_target_cpu:.3} % of a core. At 200 targets of {per} machines \
         that extrapolates to {:.0} MB and {:.1} % of a core.\n\n",
        lo.targets,
        hi.targets,
        per_target_mb * 1024.0 / per as f64,
        mb(lo) + per_target_mb * (200 - lo.targets) as f64,
        lo.cpu_percent + per_target_cpu * (200 - lo.targets) as f64
    );
    out += "| reconcile on a healthy target | new Machine made | its Node Ready |\n|---|---|---|\n";
    let row = |label: &str, r: &[(Duration, Duration)]| {
        let avg = |f: fn(&(Duration, Duration)) -> Duration| {
            r.iter().map(f).map(|d| d.as_secs_f64()).sum::<f64>() / r.len().max(1) as f64
        };
        format!("| {label} | {:.2} s | {:.1} s |\n", avg(|x| x.0), avg(|x| x.1))
    };
    out += &row("every target up", &healthy);
    out += &row(&format!("target {dead} dead (kill -9 of its kube-apiserver)"), &with_dead);
    println!("\n{out}");
    if let Ok(path) = std::env::var("BENCH_OUT") {
        std::fs::write(path, &out).unwrap();
    }
}
