//! Controller benchmarks (issue: controller). Real processes: `fake-driver` and
//! `machine-controller run` (`dist` builds) over a Unix socket.
//!
//! Both are started through the test harness (`e2e_tests::world`), with the `dist` builds.
//!
//! 1. 1,000 machines from one MachineDeployment, fake create latency 2 s, 10 workers: time until
//!    all are Running. The controller stores each operation and requeues at `poll_after`, so a
//!    worker is free while the cloud works. For comparison, in the same run, a client in this
//!    benchmark drives the same fake the blocking way — 10 tasks, each creating a machine and
//!    polling its operation until done before taking the next — which is the floor of a
//!    controller whose workers await their operations (it leaves out the store writes). The
//!    controller has no blocking mode of its own.
//! 2. Rolling update of those 1,000 machines, maxSurge 10 %, maxUnavailable 0: duration and the
//!    peak number of machines in the cloud (the fake counts it exactly).
//! 3. 10,000 machines from one MachineDeployment: time until all are Running, and the
//!    controller's peak RSS (VmHWM) holding them.
//! 4. With `--100k` only: the same with 100,000 machines — time, peak RSS, store file size.
//!
//! ```text
//! cargo build --profile dist -p fake-driver -p machine-controller
//! cargo bench -p e2e-tests --bench controller_scale            # full run (~6 min)
//! cargo bench -p e2e-tests --bench controller_scale -- --quick # 200 / 2,000 machines
//! cargo bench -p e2e-tests --bench controller_scale -- --rss-only # only the 10,000-machine run
//! cargo bench -p e2e-tests --bench controller_scale -- --100k  # only the 100,000-machine run
//! ```
//! Set BENCH_OUT=path to also write the markdown table there, and BENCH_COMPARE=<another
//! machine-controller binary> to run the 10,000 (`--rss-only`) or 100,000 (`--100k`) step with
//! both builds in the same run (A/B), alternating which goes first, BENCH_ROUNDS times each
//! (default 2 at 10,000, 1 at 100,000), with the ratios this build ÷ that one.

// Test code: a setup that fails is a failed test (the workspace warns of `unwrap` in what ships).
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use e2e_tests::world::{Driver, World};

/// The fake cloud's dist build: create latency 2 s, delete 1 s, quiet.
fn fake() -> Driver {
    Driver::dist_fake(&["--create-latency", "2s", "--delete-latency", "1s"])
}

/// The controller build to measure: this tree's dist build, or `BENCH_COMPARE`'s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Build {
    This,
    Compare,
}

impl Build {
    fn binary(self) -> PathBuf {
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

/// The fake cloud and `build`'s controller on the embedded store (10 workers, no client-side
/// rate limit, health checks every 300 s, quiet); its CLI ([`World::apply`]) is the same build,
/// whose store file it is.
async fn start(build: Build) -> World {
    World::builder()
        .driver(fake())
        .controller_binary(build.binary())
        .controller_env([("RUST_LOG", "warn")])
        .timings(&[])
        .controller_args(&["--workers", "10", "--driver-qps", "100000", "--driver-burst", "100000"])
        .controller_args(&["--health-check-interval", "300s"])
        .start()
        .await
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

/// Reads the deployment's row straight from the store file (read-only, no cache: opening the
/// store itself would load and follow every Machine in this process too).
fn md_status(db: &rusqlite::Connection) -> Option<serde_json::Value> {
    let body: String = db
        .query_row(
            "SELECT body FROM objects WHERE kind = 'MachineDeployment' AND namespace = 'default' AND name = 'bench'",
            [],
            |r| r.get(0),
        )
        .ok()?;
    serde_json::from_str(&body).ok()
}

async fn wait_converged(w: &World, replicas: usize, timeout: Duration) -> Option<Duration> {
    let started = Instant::now();
    let db = rusqlite::Connection::open_with_flags(w.store_path(), rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).ok()?;
    db.busy_timeout(Duration::from_secs(10)).ok()?;
    loop {
        if let Some(v) = md_status(&db) {
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

async fn fake_counters(w: &World, reset: bool) -> fake_driver::pb::Counters {
    // The answer carries the whole fake cloud: 30 MB with 100,000 machines.
    let mut f = w.fake().await.max_decoding_message_size(usize::MAX);
    f.inspect(fake_driver::pb::InspectRequest { reset_peak: reset }).await.unwrap().into_inner().counters.unwrap()
}

async fn create_run(build: Build, replicas: usize, timeout: Duration) -> (Option<Duration>, World) {
    let w = start(build).await;
    let started = Instant::now();
    w.apply(&manifests(replicas, "os-1")).await;
    let t = wait_converged(&w, replicas, timeout).await.map(|_| started.elapsed());
    (t, w)
}

/// The blocking way, without a controller: `workers` tasks, each creating a machine and polling
/// its operation (sleeping `poll_after` in between) until done before it takes the next.
async fn blocking_client_run(machines: usize, workers: usize) -> Duration {
    use driver_sdk::proto as pb;
    use driver_sdk::OperationExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    let fake = fake().start().await;
    let client = fake.client().await;
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..workers {
        let (client, next) = (client.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= machines {
                    return;
                }
                let req = pb::CreateMachineRequest {
                    name: format!("blocking-{i}"),
                    provider_spec: Some(driver_sdk::convert::json_to_struct(
                        &serde_json::json!({"machineType": "small", "image": "os-1"}),
                    )),
                    uid: uuid::Uuid::new_v4().to_string(),
                    ..Default::default()
                };
                let mut op = client.create_machine(req).await.unwrap().value;
                while !op.done {
                    // Deliberate: this is the blocking worker being measured — it waits out the
                    // operation's poll_after itself.
                    tokio::time::sleep(op.poll_after()).await;
                    let req = pb::GetOperationRequest { token: op.token.clone(), secrets: None };
                    op = client.get_operation(req).await.unwrap().value;
                }
                assert!(op.error_report().is_none(), "create of blocking-{i} failed");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    started.elapsed()
}

/// How long the A/B runs leave the controller holding its Running machines before reading its
/// RSS: what it holds once the burst of work is over, not the freed memory the allocator has
/// yet to give back (mimalloc returns freed pages after a delay, when the freeing thread next
/// allocates).
const HOLDING: Duration = Duration::from_secs(2);

/// Runs `replicas` machines to Running and stops both processes: (time, controller peak RSS in
/// MB, controller CPU seconds, store file size in MB including the WAL, machines in the cloud,
/// controller RSS in MB [`HOLDING`] after all were Running).
async fn scale_run(build: Build, replicas: usize, timeout: Duration) -> (Option<Duration>, u64, f64, f64, u64, u64) {
    let (t, mut w) = create_run(build, replicas, timeout).await;
    let pid = w.controller_pid(0);
    let hwm = e2e_tests::proc_status_kb(pid, "VmHWM:") / 1024;
    let cpu = e2e_tests::cpu_seconds(pid);
    let in_cloud = fake_counters(&w, false).await.machines_now;
    // Deliberate: a fixed dwell, the measuring protocol of "RSS holding them", not a wait for
    // an event.
    tokio::time::sleep(HOLDING).await;
    let held = e2e_tests::proc_status_kb(pid, "VmRSS:") / 1024;
    w.kill9().await;
    let size = |suffix: &str| {
        std::fs::metadata(format!("{}{suffix}", w.store_path().display())).map(|m| m.len()).unwrap_or(0) as f64
    };
    let store_mb = (size("") + size("-wal")) / 1e6;
    (t, hwm, cpu, store_mb, in_cloud, held)
}

fn secs(t: Option<Duration>, timeout: &str) -> String {
    t.map_or(format!("not all Running in {timeout}"), |d| format!("{:.1} s", d.as_secs_f64()))
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let flag = |f: &str| args.iter().any(|a| a == f);
    let quick = flag("--quick");
    let (n, big) = if quick { (200, 2_000) } else { (1_000, 10_000) };
    let mut out = String::new();
    out += &format!(
        "Machine: {} cores ({}), {} — fake create latency 2 s, delete 1 s, 10 workers, dist builds\n\n",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        e2e_tests::cpu_model(),
        if quick { "quick run" } else { "full run" }
    );
    if std::env::var_os("BENCH_COMPARE").is_some() && (flag("--rss-only") || flag("--100k")) {
        let machines = if flag("--100k") { 100_000 } else { big };
        return compare(machines, out).await;
    }
    out += "| benchmark | result | target | met |\n|---|---|---|---|\n";

    if flag("--100k") {
        let huge = 100_000;
        println!("[4] {huge} machines from one MachineDeployment ...");
        let (t, hwm, cpu, store_mb, in_cloud, _) = scale_run(Build::This, huge, Duration::from_secs(1800)).await;
        println!(
            "    {in_cloud} in the cloud, Running after {}; controller peak RSS {hwm} MB, {cpu:.0} s CPU; store {store_mb:.0} MB",
            secs(t, "1800 s")
        );
        out += &format!(
            "| {huge} machines Running ({in_cloud} in the cloud; controller CPU {cpu:.0} s) | {} | ≤ 120 s | {} |\n",
            secs(t, "1800 s"),
            yes(t.is_some_and(|d| d.as_secs_f64() <= 120.0))
        );
        out += &format!("| controller peak RSS (VmHWM) holding them | {hwm} MB | ≤ 512 MB | {} |\n", yes(hwm <= 512));
        out += &format!("| store file (with its WAL) | {store_mb:.0} MB | — | |\n");
        return report(&out);
    }

    let scale_rows =
        |out: &mut String, (t, hwm, cpu, _store_mb, in_cloud, _held): (Option<Duration>, u64, f64, f64, u64, u64)| {
            println!(
                "    {in_cloud} in the cloud, Running after {}; controller peak RSS {hwm} MB, {cpu:.1} s CPU",
                secs(t, "600 s")
            );
            *out += &format!(
            "| {big} machines from one MachineDeployment until all Running (controller CPU {cpu:.1} s) | {} | ≤ 10 s | {} |\n",
            secs(t, "600 s"),
            yes(t.is_some_and(|d| d.as_secs_f64() <= 10.0))
        );
            *out += &format!(
            "| controller peak RSS (VmHWM) holding {big} Running Machines ({in_cloud} in the cloud) | {hwm} MB | ≤ 64 MB | {} |\n",
            yes(hwm <= 64)
        );
        };
    if flag("--rss-only") {
        println!("[3] {big} machines from one MachineDeployment ...");
        let run = scale_run(Build::This, big, Duration::from_secs(600)).await;
        scale_rows(&mut out, run);
        return report(&out);
    }

    println!("[1] {n} machines, non-blocking controller ...");
    let (fast, w) = create_run(Build::This, n, Duration::from_secs(120)).await;
    let fast = fast.expect("non-blocking run did not converge in 120 s");
    println!("    all Running after {:.2}s", fast.as_secs_f64());

    println!("[2] rolling update of {n} machines, maxSurge 10%, maxUnavailable 0 ...");
    fake_counters(&w, true).await;
    let started = Instant::now();
    w.apply(&manifests(n, "os-2")).await;
    let rolled = wait_converged(&w, n, Duration::from_secs(600)).await.map(|_| started.elapsed());
    let c = fake_counters(&w, false).await;
    let rolled = rolled.expect("rolling update did not converge in 600 s");
    println!(
        "    done after {:.2}s, peak {} machines in the cloud (limit {})",
        rolled.as_secs_f64(),
        c.peak_machines,
        n + n / 10
    );
    drop(w);

    println!("[1b] {n} machines, blocking client (10 tasks, each awaits its operation) ...");
    let slow = blocking_client_run(n, 10).await;
    println!("    all Running after {:.2}s (floor: {n} × 2 s ÷ 10 = {} s)", slow.as_secs_f64(), n / 5);

    println!("[3] {big} machines from one MachineDeployment ...");
    let run = scale_run(Build::This, big, Duration::from_secs(600)).await;

    let ratio = slow.as_secs_f64() / fast.as_secs_f64();
    out += &format!(
        "| {n} machines Running, non-blocking controller | {:.2} s | ≤ 15 s | {} |\n",
        fast.as_secs_f64(),
        yes(fast.as_secs_f64() <= 15.0)
    );
    out += &format!(
        "| {n} machines Running, blocking client (10 tasks awaiting their operations; no store) | {:.1} s | — | |\n",
        slow.as_secs_f64()
    );
    out += &format!("| speed-up (blocking ÷ non-blocking) | {ratio:.1}× | ≥ 20× | {} |\n", yes(ratio >= 20.0));
    out +=
        &format!("| rolling update of {n}, maxSurge 10 %, maxUnavailable 0 | {:.1} s | — | |\n", rolled.as_secs_f64());
    out += &format!(
        "| peak machines in the cloud during it | {} | ≤ {} | {} |\n",
        c.peak_machines,
        n + n / 10,
        yes(c.peak_machines as usize <= n + n / 10)
    );
    scale_rows(&mut out, run);
    report(&out);
}

/// A/B: `machines` to Running with both builds, alternating which goes first each round.
async fn compare(machines: usize, mut out: String) {
    let default_rounds = if machines > 10_000 { 1 } else { 2 };
    let rounds: usize = std::env::var("BENCH_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(default_rounds);
    let timeout = Duration::from_secs(if machines > 10_000 { 1800 } else { 600 });
    out += &format!(
        "A/B, {machines} machines, {rounds} round(s); BENCH_COMPARE = {}\n\n",
        Build::Compare.binary().display()
    );
    out += "| round | build | time to Running | controller CPU | CPU per machine | peak RSS (VmHWM) | RSS holding them (2 s after) | store + WAL |\n";
    out += "|---|---|---|---|---|---|---|---|\n";
    let mut ratios = String::from(
        "\n| round | time ratio (this ÷ compare) | CPU ratio | peak RSS ratio | load average before |\n|---|---|---|---|---|\n",
    );
    for round in 1..=rounds {
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        let load: String = load.split_whitespace().take(3).collect::<Vec<_>>().join(" ");
        let order = if round % 2 == 1 { [Build::This, Build::Compare] } else { [Build::Compare, Build::This] };
        let mut results = Vec::new();
        for build in order {
            println!("[round {round}] {machines} machines, {} ...", build.name());
            let (t, hwm, cpu, store_mb, in_cloud, held) = scale_run(build, machines, timeout).await;
            println!(
                "    {in_cloud} in the cloud, Running after {}; controller CPU {cpu:.1} s, peak RSS {hwm} MB, holding {held} MB, store {store_mb:.0} MB",
                secs(t, &format!("{} s", timeout.as_secs()))
            );
            out += &format!(
                "| {round} | {} | {} | {cpu:.1} s | {:.3} ms | {hwm} MB | {held} MB | {store_mb:.0} MB |\n",
                build.name(),
                secs(t, &format!("{} s", timeout.as_secs())),
                cpu * 1e3 / machines as f64
            );
            results.push((build, t, hwm, cpu));
        }
        let get = |b: Build| *results.iter().find(|r| r.0 == b).unwrap();
        let (this, other) = (get(Build::This), get(Build::Compare));
        let time_ratio = match (this.1, other.1) {
            (Some(a), Some(b)) => format!("{:.2}", a.as_secs_f64() / b.as_secs_f64()),
            _ => "—".into(),
        };
        ratios += &format!(
            "| {round} | {time_ratio} | {:.2} | {:.2} | {load} |\n",
            this.3 / other.3,
            this.2 as f64 / other.2 as f64
        );
    }
    out += &ratios;
    report(&out);
}

fn report(out: &str) {
    println!("\n{out}");
    if let Ok(path) = std::env::var("BENCH_OUT") {
        std::fs::write(path, out).unwrap();
    }
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "NO"
    }
}
