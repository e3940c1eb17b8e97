//! Benchmark for issue "SDK overhead": unary `GetMachineStatus` throughput, latency and server
//! CPU per call over a Unix socket through the full SDK stack (the real `fake-driver` sidecar:
//! request-ID layer, tracing, metrics, validation, concurrency limit, the Unix-socket authority
//! filter) versus two servers of the same proto with no SDK layers, in the same run: a bare tonic
//! server (`MachinesServer` with a trivial in-memory impl that returns a fixed `Machine`) and a
//! grpc-go server doing the same (`tests/benches/grpc-go-server`, built from the proto by
//! `tests/tools/build-grpc-go-server.sh`); plus the sidecar's RSS.
//!
//! Every server is a child process on a temporary Unix socket (the sidecars started through the
//! test harness, `e2e_tests::Driver`); the bare tonic one is this executable re-run with
//! `--serve-bare` (tokio's default multi-threaded runtime). Every server
//! gets the identical client load (raw generated `MachinesClient`, fixed concurrency over a fixed
//! number of HTTP/2 connections, `x-request-id` and `grpc-timeout` on every call as
//! `DriverClient` sends them). Rounds run in the order A B C D, D C B A so linear drift cancels out.
//!
//! ```text
//! cargo build --profile dist -p fake-driver && cargo bench -p e2e-tests --bench sdk_overhead
//! ```
//!
//! Go must be installed (the grpc-go peer is built on the first run; without Go the bench fails).
//!
//! Environment: `BENCH_OUT=<file>` also writes the markdown report there; `BENCH_FAKE_DRIVER=<path>`
//! benchmarks another fake-driver build; `BENCH_COMPARE=<path>` adds that fake-driver build as one
//! more `RUST_LOG=warn` server in the same rounds (before / after a change side by side);
//! `BENCH_INFO=0` leaves out the `RUST_LOG=info` sidecar; `BENCH_GRPC_GO_SERVER=<path>` uses that
//! grpc-go server binary instead of building it. For quick checks: `BENCH_WARMUP_S`,
//! `BENCH_MEASURE_S`, `BENCH_ROUNDS`, `BENCH_CONCURRENCY`, `BENCH_CONNECTIONS`.

// Test code: a setup that fails is a failed test (the workspace warns of `unwrap` in what ships).
#![allow(clippy::unwrap_used)]

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use driver_sdk::prost::Message as _;
use driver_sdk::proto as pb;
use driver_sdk::OperationExt as _;
use e2e_tests::{Driver, Sidecar};
use hyper_util::rt::TokioIo;
use pb::machines_client::MachinesClient;
use tokio::process::{Child, Command};
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Request, Response, Status};

const MACHINE: &str = "bench-0";
const READY: Duration = Duration::from_secs(30);
const CALL_TIMEOUT: Duration = Duration::from_secs(15);
/// The peak RSS target of the fake sidecar, in bytes (12 MB, decimal: the stricter reading).
const RSS_TARGET_BYTES: u64 = 12_000_000;
/// The throughput the SDK stack must keep, relative to bare tonic.
const THROUGHPUT_TARGET: f64 = 0.85;
/// The server CPU per call the SDK stack (RUST_LOG=warn) may use, relative to grpc-go.
const GRPC_GO_CPU_TARGET: f64 = 0.6;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    // `cargo bench` passes `--bench` (and maybe a filter); only `--serve-bare` is ours.
    if let Some(i) = args.iter().position(|a| a == "--serve-bare") {
        let (Some(socket), Some(machine)) = (args.get(i + 1), args.get(i + 2)) else {
            eprintln!("usage: sdk_overhead --serve-bare <socket> <machine.pb>");
            return ExitCode::from(2);
        };
        // The same runtime `#[tokio::main]` gives the fake-driver.
        let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
        return match rt.block_on(serve_bare(PathBuf::from(socket), PathBuf::from(machine))) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("bare server: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    match rt.block_on(bench()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sdk_overhead: {e}");
            ExitCode::FAILURE
        }
    }
}

// ------------------------------------------------------------------------------ bare server

/// The bare server: the generated `MachinesServer`, a fixed `Machine`, nothing else.
struct Bare {
    machine: pb::Machine,
}

fn unimplemented<T>() -> Result<Response<T>, Status> {
    Err(Status::unimplemented("not in the bare benchmark server"))
}

#[tonic::async_trait]
impl pb::machines_server::Machines for Bare {
    async fn get_machine_status(
        &self,
        req: Request<pb::GetMachineStatusRequest>,
    ) -> Result<Response<pb::Machine>, Status> {
        if req.get_ref().name == self.machine.name {
            Ok(Response::new(self.machine.clone()))
        } else {
            Err(Status::not_found("no such machine"))
        }
    }

    async fn create_machine(&self, _: Request<pb::CreateMachineRequest>) -> Result<Response<pb::Operation>, Status> {
        unimplemented()
    }

    async fn delete_machine(&self, _: Request<pb::DeleteMachineRequest>) -> Result<Response<pb::Operation>, Status> {
        unimplemented()
    }

    async fn list_machines(
        &self,
        _: Request<pb::ListMachinesRequest>,
    ) -> Result<Response<pb::ListMachinesResponse>, Status> {
        unimplemented()
    }

    async fn validate_machine_class(
        &self,
        _: Request<pb::ValidateMachineClassRequest>,
    ) -> Result<Response<pb::ValidateMachineClassResponse>, Status> {
        unimplemented()
    }

    async fn can_update_machine(
        &self,
        _: Request<pb::CanUpdateMachineRequest>,
    ) -> Result<Response<pb::CanUpdateMachineResponse>, Status> {
        unimplemented()
    }

    async fn update_machine(&self, _: Request<pb::UpdateMachineRequest>) -> Result<Response<pb::Operation>, Status> {
        unimplemented()
    }
}

async fn serve_bare(socket: PathBuf, machine_file: PathBuf) -> Result<(), Box<dyn std::error::Error>> {
    let bytes = std::fs::read(&machine_file)?;
    let machine = pb::Machine::decode(bytes.as_slice())?;
    let listener = tokio::net::UnixListener::bind(&socket)?;
    tonic::transport::Server::builder()
        .add_service(pb::machines_server::MachinesServer::new(Bare { machine }))
        .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener))
        .await?;
    Ok(())
}

// ------------------------------------------------------------------------------ the bench

type BoxError = Box<dyn std::error::Error + Send + Sync>;

struct Settings {
    warmup: Duration,
    measure: Duration,
    rounds: usize,
    concurrency: usize,
    connections: usize,
    /// Whether the RUST_LOG=info sidecar runs too.
    info: bool,
    /// Another fake-driver build to run as one more RUST_LOG=warn server.
    compare: Option<PathBuf>,
}

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).filter(|v| *v > 0).unwrap_or(default)
}

impl Settings {
    fn from_env() -> Self {
        Self {
            warmup: Duration::from_secs(env_num("BENCH_WARMUP_S", 2)),
            measure: Duration::from_secs(env_num("BENCH_MEASURE_S", 10)),
            rounds: env_num("BENCH_ROUNDS", 2) as usize,
            concurrency: env_num("BENCH_CONCURRENCY", 32) as usize,
            connections: env_num("BENCH_CONNECTIONS", 4) as usize,
            info: std::env::var("BENCH_INFO").map_or(true, |v| v != "0"),
            compare: std::env::var_os("BENCH_COMPARE").map(PathBuf::from),
        }
    }
}

/// A server under test: a child process on a Unix socket.
struct Server {
    label: String,
    child: Child,
    socket: PathBuf,
    log: PathBuf,
    idle_rss_kib: u64,
    /// A sidecar's own folder (the harness's), removed with it.
    _dir: Option<tempfile::TempDir>,
}

impl Server {
    fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }
}

fn spawn(program: &Path, args: &[&str], envs: &[(&str, &str)], log: &Path) -> Result<Child, BoxError> {
    let log_file = std::fs::File::create(log)?;
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .stdin(Stdio::null())
        .stdout(log_file.try_clone()?)
        .stderr(log_file)
        .kill_on_drop(true);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    Ok(cmd.spawn().map_err(|e| format!("starting {}: {e}", program.display()))?)
}

/// A channel over one new HTTP/2 connection on `socket`, built the same way for every server.
async fn channel(socket: &Path) -> Result<Channel, tonic::transport::Error> {
    let path = socket.to_path_buf();
    Endpoint::from_static("http://bench.sock")
        .connect_timeout(Duration::from_secs(5))
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
        }))
        .await
}

fn status_request() -> Request<pb::GetMachineStatusRequest> {
    // What `DriverClient` sends: a fresh request ID and a deadline.
    let mut req = Request::new(pb::GetMachineStatusRequest { name: MACHINE.into(), ..Default::default() });
    if let Ok(v) = uuid::Uuid::new_v4().to_string().parse() {
        req.metadata_mut().insert("x-request-id", v);
    }
    req.set_timeout(CALL_TIMEOUT);
    req
}

/// Waits until `server` answers GetMachineStatus for the bench machine.
async fn wait_serving(server: &mut Server) -> Result<(), BoxError> {
    let deadline = Instant::now() + READY;
    loop {
        if let Some(status) = server.child.try_wait()? {
            return Err(format!("{} exited early ({status}); log:\n{}", server.label, log_text(&server.log)).into());
        }
        if server.socket.exists() {
            if let Ok(ch) = channel(&server.socket).await {
                if MachinesClient::new(ch).get_machine_status(status_request()).await.is_ok() {
                    return Ok(());
                }
            }
        }
        if Instant::now() > deadline {
            return Err(
                format!("{} not serving within {READY:?}; log:\n{}", server.label, log_text(&server.log)).into()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn log_text(p: &Path) -> String {
    let text = std::fs::read_to_string(p).unwrap_or_default();
    let tail: Vec<&str> = text.lines().rev().take(20).collect();
    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
}

/// Starts the fake-driver sidecar built at `fake` through the test harness (its own folder, a
/// Unix socket, ready once it answers a Probe) with `RUST_LOG=rust_log`, creates the bench
/// machine in it and waits until it is running.
async fn start_sidecar(label: String, fake: &Path, rust_log: &str) -> Result<(Server, pb::Machine), BoxError> {
    let sidecar = Driver::binary(fake)
        .args(["--log-format", "json", "--create-latency", "100ms"])
        .env([("RUST_LOG", rust_log)])
        .start()
        .await;
    let client = sidecar.client().await;
    let Sidecar { child, dir, socket, log, .. } = sidecar;
    let server = Server { label: label.clone(), child, socket, log, idle_rss_kib: 0, _dir: Some(dir) };
    let deadline = Instant::now() + READY;
    let mut op = client
        .create_machine(pb::CreateMachineRequest {
            name: MACHINE.into(),
            provider_spec: Some(driver_sdk::convert::json_to_struct(&serde_json::json!({"machineType": "small"}))),
            ..Default::default()
        })
        .await?
        .value;
    while !op.done {
        if Instant::now() > deadline {
            return Err(format!("{label}: CreateMachine {MACHINE} not done within {READY:?}").into());
        }
        tokio::time::sleep(op.poll_after().min(Duration::from_millis(50))).await;
        op = client.get_operation(pb::GetOperationRequest { token: op.token.clone(), secrets: None }).await?.value;
    }
    if let Some(err) = op.error_report() {
        return Err(format!("{label}: CreateMachine {MACHINE} failed: {err:?}").into());
    }
    let machine =
        client.get_machine_status(pb::GetMachineStatusRequest { name: MACHINE.into(), ..Default::default() }).await?;
    Ok((server, machine.value))
}

/// The process's CPU time (user + system, all threads) from /proc/<pid>/stat.
fn cpu_time(pid: &str, tick: f64) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of stat(5); `rest` starts at field 3.
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_secs_f64(ticks as f64 / tick))
}

/// A `/proc/<pid>/status` field in KiB (VmRSS, VmHWM).
fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// Busy time of the whole machine (all CPUs, including steal) from /proc/stat.
fn machine_busy(tick: f64) -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let f: Vec<u64> = stat.lines().next()?.split_whitespace().skip(1).map(|v| v.parse().unwrap_or(0)).collect();
    // user nice system idle iowait irq softirq steal (guest time is already in user).
    let busy = f.first()? + f.get(1)? + f.get(2)? + f.get(5)? + f.get(6)? + f.get(7)?;
    Some(Duration::from_secs_f64(busy as f64 / tick))
}

fn clock_tick() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

struct RoundResult {
    round: usize,
    server: usize,
    ok: usize,
    errors: usize,
    window: Duration,
    /// Sorted latencies of the successful calls in the window, in microseconds.
    lat: Vec<u32>,
    server_cpu: Duration,
    client_cpu: Duration,
    /// CPU used by everything else on the machine during the window (other processes, steal).
    other_cpu: Duration,
}

impl RoundResult {
    /// Other CPU use as a share of the machine's capacity during the window.
    fn other_share(&self) -> f64 {
        let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as f64;
        self.other_cpu.as_secs_f64() / (self.window.as_secs_f64() * cpus)
    }

    fn rate(&self) -> f64 {
        self.ok as f64 / self.window.as_secs_f64()
    }

    fn pct(&self, p: f64) -> u32 {
        percentile(&self.lat, p)
    }

    fn server_us_per_call(&self) -> f64 {
        self.server_cpu.as_secs_f64() * 1e6 / self.ok.max(1) as f64
    }

    fn client_us_per_call(&self) -> f64 {
        self.client_cpu.as_secs_f64() * 1e6 / self.ok.max(1) as f64
    }
}

fn percentile(sorted: &[u32], p: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// Drives one server for warm-up + measure; records calls that start and finish in the window.
async fn drive(server: &Server, idx: usize, round: usize, s: &Settings, tick: f64) -> Result<RoundResult, BoxError> {
    let mut channels = Vec::new();
    for _ in 0..s.connections {
        channels.push(channel(&server.socket).await?);
    }
    let start = Instant::now();
    let measure_start = start + s.warmup;
    let end = measure_start + s.measure;
    let mut tasks = Vec::new();
    for i in 0..s.concurrency {
        let mut client = MachinesClient::new(channels[i % channels.len()].clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(1 << 16);
            let mut errors = 0usize;
            loop {
                let t0 = Instant::now();
                if t0 >= end {
                    break;
                }
                let r = client.get_machine_status(status_request()).await;
                let t1 = Instant::now();
                if t0 < measure_start || t1 > end {
                    continue;
                }
                match r {
                    Ok(m) if m.get_ref().name == MACHINE => {
                        lat.push(u32::try_from(t1.duration_since(t0).as_micros()).unwrap_or(u32::MAX))
                    }
                    _ => errors += 1,
                }
            }
            (lat, errors)
        }));
    }
    let pid = server.pid().to_string();
    tokio::time::sleep_until(measure_start.into()).await;
    let (srv0, cli0, all0) = (cpu_time(&pid, tick), cpu_time("self", tick), machine_busy(tick));
    tokio::time::sleep_until(end.into()).await;
    let (srv1, cli1, all1) = (cpu_time(&pid, tick), cpu_time("self", tick), machine_busy(tick));
    let mut lat = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (l, e) = t.await?;
        lat.extend(l);
        errors += e;
    }
    lat.sort_unstable();
    let diff = |a: Option<Duration>, b: Option<Duration>| match (a, b) {
        (Some(a), Some(b)) => b.saturating_sub(a),
        _ => Duration::ZERO,
    };
    let (server_cpu, client_cpu) = (diff(srv0, srv1), diff(cli0, cli1));
    Ok(RoundResult {
        round,
        server: idx,
        ok: lat.len(),
        errors,
        window: s.measure,
        lat,
        server_cpu,
        client_cpu,
        other_cpu: diff(all0, all1).saturating_sub(server_cpu + client_cpu),
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn mib(kib: u64) -> String {
    format!("{:.1}", kib as f64 / 1024.0)
}

/// What a server is, for the summary's comparisons.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Bare,
    Warn,
    Info,
    GrpcGo,
    Compare,
}

/// The grpc-go peer: `BENCH_GRPC_GO_SERVER`, else built (or found in its cache) by
/// `tests/tools/build-grpc-go-server.sh`. A missing Go toolchain is an error, never a skip.
fn grpc_go_server() -> Result<PathBuf, BoxError> {
    if let Some(p) = std::env::var_os("BENCH_GRPC_GO_SERVER").map(PathBuf::from) {
        return if p.exists() {
            Ok(p)
        } else {
            Err(format!("BENCH_GRPC_GO_SERVER {} does not exist", p.display()).into())
        };
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().ok_or("cannot locate the workspace root")?;
    let script = root.join("tests/tools/build-grpc-go-server.sh");
    let out = std::process::Command::new("bash")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("running {}: {e}", script.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} failed ({}): the grpc-go peer of this benchmark needs Go (see the messages above)",
            script.display(),
            out.status
        )
        .into());
    }
    let path = PathBuf::from(String::from_utf8(out.stdout)?.trim());
    if !path.exists() {
        return Err(format!("{} printed {}, which does not exist", script.display(), path.display()).into());
    }
    Ok(path)
}

/// `<program> --version`, first line.
fn version_of(program: &Path) -> String {
    std::process::Command::new(program)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().next().map(str::to_string))
        .unwrap_or_default()
}

async fn bench() -> Result<(), BoxError> {
    let s = Settings::from_env();
    let exe = std::env::current_exe()?;
    // The bench executable is target/release/deps/sdk_overhead-<hash>; the sidecar it measures
    // is the dist build, in target/dist.
    let bin_dir =
        exe.parent().and_then(Path::parent).and_then(Path::parent).ok_or("cannot locate the target dir")?.join("dist");
    // BENCH_FAKE_DRIVER: another fake-driver build, e.g. to compare before / after a change.
    let fake = std::env::var_os("BENCH_FAKE_DRIVER").map(PathBuf::from).unwrap_or_else(|| bin_dir.join("fake-driver"));
    if !fake.exists() {
        return Err(format!(
            "{} is missing: build it first, into the same target dir, with `cargo build --profile dist -p fake-driver`",
            fake.display()
        )
        .into());
    }
    if let Some(c) = &s.compare {
        if !c.exists() {
            return Err(format!("BENCH_COMPARE {} does not exist", c.display()).into());
        }
    }
    let grpc_go = grpc_go_server()?;
    let grpc_go_version = version_of(&grpc_go);
    let tick = clock_tick();
    let started = Instant::now();
    let load_before = loadavg();
    let dir = tempfile::Builder::new().prefix("sdk-overhead-").tempdir()?;

    eprintln!("starting servers in {}", dir.path().display());
    let mut servers: Vec<(Role, Server)> = Vec::new();
    let (warn, machine) = start_sidecar("SDK (fake-driver), RUST_LOG=warn".into(), &fake, "warn").await?;
    if s.info {
        let (info, _) = start_sidecar("SDK (fake-driver), RUST_LOG=info".into(), &fake, "info").await?;
        servers.push((Role::Info, info));
    }
    if let Some(c) = &s.compare {
        let (cmp, _) = start_sidecar("SDK (BENCH_COMPARE build), RUST_LOG=warn".into(), c, "warn").await?;
        servers.push((Role::Compare, cmp));
    }
    servers.insert(0, (Role::Warn, warn));
    // The peers answer with exactly the Machine the sidecar returns: same payload size.
    let machine_file = dir.path().join("machine.pb");
    std::fs::write(&machine_file, machine.encode_to_vec())?;
    let machine_arg = machine_file.to_str().ok_or("non-UTF-8 temp path")?;
    let bare_socket = dir.path().join("bare.sock");
    let bare_log = dir.path().join("bare.log");
    let bare_child = spawn(
        &exe,
        &["--serve-bare", bare_socket.to_str().ok_or("non-UTF-8 temp path")?, machine_arg],
        &[],
        &bare_log,
    )?;
    servers.insert(
        0,
        (
            Role::Bare,
            Server {
                label: "bare tonic".into(),
                child: bare_child,
                socket: bare_socket,
                log: bare_log,
                idle_rss_kib: 0,
                _dir: None,
            },
        ),
    );
    let go_socket = dir.path().join("grpc-go.sock");
    let go_log = dir.path().join("grpc-go.log");
    let go_child = spawn(&grpc_go, &[go_socket.to_str().ok_or("non-UTF-8 temp path")?, machine_arg], &[], &go_log)?;
    let go_pos = if s.info { 3 } else { 2 };
    servers.insert(
        go_pos,
        (
            Role::GrpcGo,
            Server {
                label: "grpc-go".into(),
                child: go_child,
                socket: go_socket,
                log: go_log,
                idle_rss_kib: 0,
                _dir: None,
            },
        ),
    );
    for (_, srv) in &mut servers {
        wait_serving(srv).await?;
    }
    for (_, srv) in &mut servers {
        srv.idle_rss_kib = status_kib(srv.pid(), "VmRSS");
    }
    let log_size = |srv: &Server| std::fs::metadata(&srv.log).map(|m| m.len()).unwrap_or(0);
    let log_before: Vec<u64> = servers.iter().map(|(_, srv)| log_size(srv)).collect();
    let letters: Vec<char> = (0..servers.len()).map(|i| (b'A' + i as u8) as char).collect();
    let forward: String = letters.iter().map(char::to_string).collect::<Vec<_>>().join(" ");
    let backward: String = letters.iter().rev().map(char::to_string).collect::<Vec<_>>().join(" ");

    // A B C D, D C B A, A B C D, ...
    let mut results = Vec::new();
    for round in 1..=s.rounds {
        let mut order: Vec<usize> = (0..servers.len()).collect();
        if round % 2 == 0 {
            order.reverse();
        }
        for idx in order {
            let srv = &servers[idx].1;
            eprintln!("round {round}: {} ...", srv.label);
            let r = drive(srv, idx, round, &s, tick).await?;
            eprintln!(
                "round {round}: {}: {:.0} calls/s, p50 {} us, p99 {} us, server {:.1} us/call, other CPU {:.0}%, errors {}",
                srv.label,
                r.rate(),
                r.pct(0.50),
                r.pct(0.99),
                r.server_us_per_call(),
                r.other_share() * 100.0,
                r.errors
            );
            results.push(r);
        }
    }
    let peak: Vec<u64> = servers.iter().map(|(_, srv)| status_kib(srv.pid(), "VmHWM")).collect();
    // What the resident memory is at the end: the heap and stacks, or pages of the executable.
    let anon: Vec<u64> = servers.iter().map(|(_, srv)| status_kib(srv.pid(), "RssAnon")).collect();
    let file: Vec<u64> = servers.iter().map(|(_, srv)| status_kib(srv.pid(), "RssFile")).collect();
    let log_bytes: Vec<u64> =
        servers.iter().zip(&log_before).map(|((_, srv), b)| log_size(srv).saturating_sub(*b)).collect();
    let calls: Vec<usize> =
        (0..servers.len()).map(|i| results.iter().filter(|r| r.server == i).map(|r| r.ok).sum()).collect();
    let load_after = loadavg();
    let total = started.elapsed();

    // ------------------------------------------------------------------ report
    let pos = |role: Role| servers.iter().position(|(r, _)| *r == role);
    let (bare_i, warn_i, go_i) =
        (pos(Role::Bare).unwrap_or(0), pos(Role::Warn).unwrap_or(0), pos(Role::GrpcGo).unwrap_or(0));
    let mut out = String::new();
    let w = &mut out;
    let _ = writeln!(w, "### Results: unary GetMachineStatus over a Unix socket\n");
    let _ = writeln!(
        w,
        "- Host: {} x {}; load average before / after the run: {load_before} / {load_after}.",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        e2e_tests::cpu_model()
    );
    let _ = writeln!(
        w,
        "- Client: this process (tokio multi-threaded runtime, default workers), {} calls in flight over {} \
         HTTP/2 connections, raw generated `MachinesClient` for every server, `x-request-id` + `grpc-timeout` \
         on every call (as `DriverClient` sends them). Warm-up {} s, measurement {} s per round; {} rounds, \
         order {forward} then {backward}.",
        s.concurrency,
        s.connections,
        s.warmup.as_secs(),
        s.measure.as_secs(),
        s.rounds
    );
    let _ = writeln!(
        w,
        "- **The client runs on the same 2-core machine as the server**: calls/s is what client + server \
         together sustain, so the client's own CPU dilutes the difference between servers. \
         *Server CPU µs/call* (user + system time of the server process over the window, from \
         /proc/<pid>/stat) isolates the server's cost. *Other CPU* is what the rest of the machine \
         (other processes, hypervisor steal) used during the window, as a share of both cores: rounds \
         with a high value were disturbed."
    );
    let describe = |role: Role| match role {
        Role::Bare => "bare tonic (`MachinesServer`, fixed `Machine`, no SDK layers, tokio's default multi-threaded \
                       runtime; this bench re-executed with `--serve-bare`)"
            .to_string(),
        Role::Warn => "SDK stack (real `fake-driver`, `--log-format json`, RUST_LOG=warn, the production default \
                       under load)"
            .to_string(),
        Role::Info => "the same sidecar with RUST_LOG=info (one JSON log line per RPC)".to_string(),
        Role::GrpcGo => format!(
            "grpc-go (`tests/benches/grpc-go-server`: generated `Machines` service on `grpc.NewServer()` \
             defaults, fixed `Machine`, no interceptors; {grpc_go_version})"
        ),
        Role::Compare => format!(
            "the BENCH_COMPARE fake-driver build, RUST_LOG=warn: `{}`",
            s.compare.as_deref().map(Path::display).map(|d| d.to_string()).unwrap_or_default()
        ),
    };
    let list: Vec<String> =
        servers.iter().enumerate().map(|(i, (role, _))| format!("{} = {}", letters[i], describe(*role))).collect();
    let _ = writeln!(
        w,
        "- Servers: {}. Each is its own process; logs go to a file. The peers return the exact `Machine` \
         the sidecar returns ({} bytes encoded). fake-driver: `{}`.",
        list.join("; "),
        machine.encoded_len(),
        fake.display()
    );
    let _ = writeln!(w);
    let _ = writeln!(
        w,
        "| Round | Server | calls/s | p50 µs | p99 µs | p99.9 µs | max µs | server CPU µs/call | client CPU µs/call | other CPU | errors |"
    );
    let _ = writeln!(w, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &results {
        let _ = writeln!(
            w,
            "| {} | {} | {:.0} | {} | {} | {} | {} | {:.1} | {:.1} | {:.0}% | {} |",
            r.round,
            servers[r.server].1.label,
            r.rate(),
            r.pct(0.50),
            r.pct(0.99),
            r.pct(0.999),
            r.lat.last().copied().unwrap_or(0),
            r.server_us_per_call(),
            r.client_us_per_call(),
            r.other_share() * 100.0,
            r.errors
        );
    }
    let med = |idx: usize, f: &dyn Fn(&RoundResult) -> f64| {
        median(results.iter().filter(|r| r.server == idx).map(f).collect())
    };
    let cpu = |idx: usize| med(idx, &|r| r.server_us_per_call());
    let bare_rate = med(bare_i, &|r| r.rate());
    let (bare_cpu, go_cpu) = (cpu(bare_i), cpu(go_i));
    let _ = writeln!(w, "\nMedian over rounds:\n");
    let _ = writeln!(
        w,
        "| Server | calls/s | vs bare | p50 µs | p99 µs | server CPU µs/call | vs bare tonic | vs grpc-go | RSS idle (after start + 1 machine) | peak RSS (VmHWM) | RSS at the end: anon + file | log bytes/call |"
    );
    let _ = writeln!(w, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (i, (_, srv)) in servers.iter().enumerate() {
        let _ = writeln!(
            w,
            "| {} | {:.0} | {:.1}% | {:.0} | {:.0} | {:.1} | {:.2}x | {:.2}x | {} MiB | {} MiB | {} + {} MiB | {:.0} |",
            srv.label,
            med(i, &|r| r.rate()),
            100.0 * med(i, &|r| r.rate()) / bare_rate.max(1e-9),
            med(i, &|r| f64::from(r.pct(0.50))),
            med(i, &|r| f64::from(r.pct(0.99))),
            cpu(i),
            cpu(i) / bare_cpu.max(1e-9),
            cpu(i) / go_cpu.max(1e-9),
            mib(srv.idle_rss_kib),
            mib(peak[i]),
            mib(anon[i]),
            mib(file[i]),
            log_bytes[i] as f64 / calls[i].max(1) as f64,
        );
    }
    let verdict = |ok: bool| if ok { "**met**" } else { "**NOT met**" };
    let warn_cpu = cpu(warn_i);
    let vs_go = warn_cpu / go_cpu.max(1e-9);
    let vs_bare = warn_cpu / bare_cpu.max(1e-9);
    let ratio = med(warn_i, &|r| r.rate()) / bare_rate.max(1e-9);
    let _ = writeln!(w);
    let _ = writeln!(
        w,
        "- Server CPU per call, SDK (RUST_LOG=warn) vs grpc-go at {} in flight: {vs_go:.2}x ({warn_cpu:.1} vs \
         {go_cpu:.1} µs) — target <= {GRPC_GO_CPU_TARGET}x {}.",
        s.concurrency,
        verdict(vs_go <= GRPC_GO_CPU_TARGET)
    );
    let _ = writeln!(
        w,
        "- Server CPU per call, SDK (RUST_LOG=warn) vs bare tonic: {vs_bare:.2}x ({warn_cpu:.1} vs {bare_cpu:.1} µs) \
         — target below bare tonic {}. bare tonic vs grpc-go: {:.2}x.",
        verdict(vs_bare < 1.0),
        bare_cpu / go_cpu.max(1e-9)
    );
    let _ = writeln!(
        w,
        "- Throughput (SDK >= {:.0}% of bare tonic, RUST_LOG=warn): {:.1}% — {}.",
        THROUGHPUT_TARGET * 100.0,
        ratio * 100.0,
        verdict(ratio >= THROUGHPUT_TARGET),
    );
    if let Some(i) = pos(Role::Info) {
        let _ = writeln!(
            w,
            "- RUST_LOG=info: {:.1}% of bare tonic's throughput, server CPU per call {:.2}x bare tonic.",
            100.0 * med(i, &|r| r.rate()) / bare_rate.max(1e-9),
            cpu(i) / bare_cpu.max(1e-9)
        );
    }
    if let Some(i) = pos(Role::Compare) {
        let _ = writeln!(
            w,
            "- This fake-driver build vs the BENCH_COMPARE build (RUST_LOG=warn): server CPU per call {:.2}x \
             ({warn_cpu:.1} vs {:.1} µs), calls/s {:.1}%, peak RSS {} vs {} MiB.",
            warn_cpu / cpu(i).max(1e-9),
            cpu(i),
            100.0 * med(warn_i, &|r| r.rate()) / med(i, &|r| r.rate()).max(1e-9),
            mib(peak[warn_i]),
            mib(peak[i]),
        );
    }
    let fake_peak = servers
        .iter()
        .enumerate()
        .filter(|(_, (role, _))| matches!(role, Role::Warn | Role::Info))
        .map(|(i, _)| peak[i])
        .max()
        .unwrap_or(0)
        * 1024;
    let _ = writeln!(
        w,
        "- Peak RSS target (fake sidecar <= 12 MB): peak {:.1} MB ({} MiB), idle {} MiB — {}.",
        fake_peak as f64 / 1e6,
        mib(fake_peak / 1024),
        mib(servers[warn_i].1.idle_rss_kib),
        verdict(fake_peak <= RSS_TARGET_BYTES)
    );
    let errors: usize = results.iter().map(|r| r.errors).sum();
    let max_other = results.iter().map(RoundResult::other_share).fold(0.0, f64::max);
    let _ = writeln!(
        w,
        "- Failed or wrong calls in the measurement windows: {errors}. Highest other CPU in a round: {:.0}%. \
         Bench wall time: {:.0} s.",
        max_other * 100.0,
        total.as_secs_f64()
    );

    print!("{out}");
    if let Some(path) = std::env::var_os("BENCH_OUT") {
        std::fs::write(&path, &out).map_err(|e| format!("writing BENCH_OUT {}: {e}", Path::new(&path).display()))?;
        eprintln!("report written to {}", Path::new(&path).display());
    }
    drop(servers); // kill_on_drop
    dir.close()?;
    Ok(())
}
