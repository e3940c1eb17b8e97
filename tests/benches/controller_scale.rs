//! Controller benchmarks (issue: controller). Real processes: `fake-driver` and
//! `machine-controller run` (release builds) over a Unix socket.
//!
//! 1. 1,000 machines from one MachineDeployment, fake create latency 2 s, 10 workers: time until
//!    all are Running — non-blocking (store the operation, requeue at poll_after) versus a
//!    blocking mode in which each worker awaits its operation, in the same run.
//! 2. Rolling update of those 1,000 machines, maxSurge 10 %, maxUnavailable 0: duration and the
//!    peak number of machines in the cloud (the fake counts it exactly).
//! 3. Peak RSS of the controller holding 10,000 Machine objects in the embedded store.
//!
//! ```text
//! cargo build --release -p fake-driver -p machine-controller
//! cargo bench -p e2e-tests --bench controller_scale            # full run (~6 min)
//! cargo bench -p e2e-tests --bench controller_scale -- --quick # 200 / 2,000 machines
//! cargo bench -p e2e-tests --bench controller_scale -- --rss-only # only the 10,000-machine RSS
//! ```
//! Set BENCH_OUT=path to also write the markdown table there.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};

struct Procs {
    fake: Child,
    controller: Option<Child>,
    dir: tempfile::TempDir,
}

impl Procs {
    fn sock(&self) -> PathBuf {
        self.dir.path().join("fake.sock")
    }

    fn store(&self) -> PathBuf {
        self.dir.path().join("store.db")
    }
}

async fn start_fake() -> Procs {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("fake.sock");
    let fake = Command::new(e2e_tests::release_bin("fake-driver"))
        .args(["--endpoint", &format!("unix://{}", sock.display())])
        .args(["--create-latency", "2s", "--delete-latency", "1s"])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !sock.exists() {
        assert!(Instant::now() < deadline, "fake-driver did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Procs { fake, controller: None, dir }
}

fn start_controller(p: &mut Procs, blocking: bool) {
    let mut cmd = Command::new(e2e_tests::release_bin("machine-controller"));
    cmd.arg("--store")
        .arg(p.store())
        .args(["run", "--driver", &format!("fake=unix://{}", p.sock().display())])
        .args(["--workers", "10", "--driver-qps", "100000", "--driver-burst", "100000"])
        .args(["--health-check-interval", "300s"])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    if blocking {
        cmd.arg("--blocking");
    }
    p.controller = Some(cmd.spawn().unwrap());
}

async fn apply(p: &Procs, yaml: &str) {
    let f = p.dir.path().join(format!("{}.yaml", uuid::Uuid::new_v4()));
    std::fs::write(&f, yaml).unwrap();
    let out = Command::new(e2e_tests::release_bin("machine-controller"))
        .arg("--store")
        .arg(p.store())
        .args(["apply", "-f", f.to_str().unwrap()])
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

fn manifests(replicas: usize, image: &str) -> String {
    format!(
        "apiVersion: machine.driver.dev/v1alpha1
kind: MachineClass
metadata: {{name: small}}
spec: {{driver: fake, providerSpec: {{machineType: small}}}}
---
apiVersion: machine.driver.dev/v1alpha1
kind: MachineDeployment
metadata: {{name: bench}}
spec:
  replicas: {replicas}
  template:
    spec:
      classRef: {{name: small}}
      providerSpec: {{image: {image}}}
  strategy:
    rollingUpdate: {{maxSurge: \"10%\", maxUnavailable: 0}}
"
    )
}

/// Reads the deployment through the store interface (the same one the controller uses).
async fn md_status(store: &machine_controller::store::Store) -> Option<serde_json::Value> {
    let md = store.get::<machine_controller::resources::MachineDeployment>("default", "bench").await.ok()??;
    serde_json::to_value(md).ok()
}

async fn wait_converged(p: &Procs, replicas: usize, timeout: Duration) -> Option<Duration> {
    let started = Instant::now();
    let store = machine_controller::store::Store::open(&p.store()).expect("store");
    loop {
        if let Some(v) = md_status(&store).await {
            let st = &v["status"];
            let gen_ok = st["observedGeneration"].as_i64() >= v["metadata"]["generation"].as_i64();
            let n = replicas as i64;
            if gen_ok
                && st["availableReplicas"].as_i64() == Some(n)
                && st["replicas"].as_i64() == Some(n)
                && st["updatedReplicas"].as_i64() == Some(n)
            {
                return Some(started.elapsed());
            }
        }
        if started.elapsed() > timeout {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn fake_counters(p: &Procs, reset: bool) -> fake_driver::pb::Counters {
    let client = driver_sdk::DriverClient::connect(&format!("unix://{}", p.sock().display())).await.unwrap();
    let mut f = fake_driver::pb::fake_cloud_client::FakeCloudClient::new(client.channel());
    f.inspect(fake_driver::pb::InspectRequest { reset_peak: reset }).await.unwrap().into_inner().counters.unwrap()
}

async fn create_run(replicas: usize, blocking: bool, timeout: Duration) -> (Option<Duration>, Procs) {
    let mut p = start_fake().await;
    start_controller(&mut p, blocking);
    let started = Instant::now();
    apply(&p, &manifests(replicas, "os-1")).await;
    let t = wait_converged(&p, replicas, timeout).await.map(|_| started.elapsed());
    (t, p)
}

#[tokio::main]
async fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let (n, big) = if quick { (200, 2_000) } else { (1_000, 10_000) };
    let mut out = String::new();
    out += &format!(
        "Machine: {} cores ({}), {} — fake create latency 2 s, delete 1 s, 10 workers, release builds\n\n",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        e2e_tests::cpu_model(),
        if quick { "quick run" } else { "full run" }
    );

    if std::env::args().any(|a| a == "--rss-only") {
        let (t, mut pc) = create_run(big, false, Duration::from_secs(600)).await;
        let pid = pc.controller.as_ref().and_then(|c| c.id()).unwrap_or(0);
        println!(
            "{big} machines Running after {:?}; controller peak RSS {} MB",
            t,
            e2e_tests::proc_status_kb(pid, "VmHWM:") / 1024
        );
        if let Some(c) = pc.controller.as_mut() {
            let _ = c.kill().await;
        }
        return;
    }
    println!("[1] {n} machines, non-blocking ...");
    let (fast, mut p) = create_run(n, false, Duration::from_secs(120)).await;
    let fast = fast.expect("non-blocking run did not converge in 120 s");
    println!("    all Running after {:.2}s", fast.as_secs_f64());

    println!("[2] rolling update of {n} machines, maxSurge 10%, maxUnavailable 0 ...");
    fake_counters(&p, true).await;
    let started = Instant::now();
    apply(&p, &manifests(n, "os-2")).await;
    let rolled = wait_converged(&p, n, Duration::from_secs(600)).await.map(|_| started.elapsed());
    let c = fake_counters(&p, false).await;
    let rolled = rolled.expect("rolling update did not converge in 600 s");
    println!(
        "    done after {:.2}s, peak {} machines in the cloud (limit {})",
        rolled.as_secs_f64(),
        c.peak_machines,
        n + n / 10
    );
    if let Some(c) = p.controller.as_mut() {
        let _ = c.kill().await;
    }
    let _ = p.fake.kill().await;

    println!("[1b] {n} machines, blocking (each worker awaits its operation) ...");
    let (slow, mut pb) = create_run(n, true, Duration::from_secs(900)).await;
    let slow = slow.expect("blocking run did not converge in 900 s");
    println!("    all Running after {:.2}s", slow.as_secs_f64());
    if let Some(c) = pb.controller.as_mut() {
        let _ = c.kill().await;
    }
    let _ = pb.fake.kill().await;

    println!("[3] controller holding {big} machines ...");
    let (big_t, mut pc) = create_run(big, false, Duration::from_secs(600)).await;
    let pid = pc.controller.as_ref().and_then(|c| c.id()).unwrap_or(0);
    let hwm = e2e_tests::proc_status_kb(pid, "VmHWM:");
    let rss = e2e_tests::proc_status_kb(pid, "VmRSS:");
    let machines_in_cloud = fake_counters(&pc, false).await.machines_now;
    println!(
        "    {big} Running after {:?}; controller peak RSS {} MB, now {} MB",
        big_t.map(|d| d.as_secs_f64()),
        hwm / 1024,
        rss / 1024
    );
    if let Some(c) = pc.controller.as_mut() {
        let _ = c.kill().await;
    }
    let _ = pc.fake.kill().await;

    let ratio = slow.as_secs_f64() / fast.as_secs_f64();
    out += "| benchmark | result | target | met |\n|---|---|---|---|\n";
    out += &format!(
        "| {n} machines Running, non-blocking | {:.2} s | ≤ 15 s | {} |\n",
        fast.as_secs_f64(),
        yes(fast.as_secs_f64() <= 15.0)
    );
    out += &format!("| {n} machines Running, blocking workers | {:.1} s | — | |\n", slow.as_secs_f64());
    out += &format!("| speed-up (blocking ÷ non-blocking) | {ratio:.1}× | ≥ 20× | {} |\n", yes(ratio >= 20.0));
    out +=
        &format!("| rolling update of {n}, maxSurge 10 %, maxUnavailable 0 | {:.1} s | — | |\n", rolled.as_secs_f64());
    out += &format!(
        "| peak machines in the cloud during it | {} | ≤ {} | {} |\n",
        c.peak_machines,
        n + n / 10,
        yes(c.peak_machines as usize <= n + n / 10)
    );
    out += &format!(
        "| controller peak RSS with {big} Machines ({} Running in {}) | {} MB | ≤ 150 MB | {} |\n",
        machines_in_cloud,
        big_t.map_or("not all Running in 600 s".to_string(), |d| format!("{:.1} s", d.as_secs_f64())),
        hwm / 1024,
        yes(hwm / 1024 <= 150)
    );
    println!("\n{out}");
    if let Ok(path) = std::env::var("BENCH_OUT") {
        std::fs::write(path, &out).unwrap();
    }
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "NO"
    }
}
