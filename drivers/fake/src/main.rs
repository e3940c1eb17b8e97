//! `fake-driver`: the fake cloud as a driver sidecar; with `--join-cluster` its machines also
//! register as Nodes of a Kubernetes cluster ([`fake_driver::kubelets`]).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use driver_sdk::{telemetry, DriverServer, ServeArgs};
use fake_driver::{Config, FakeCloudService, FakeDriver, FaultRule};

/// mimalloc: about 17% less server CPU per call than glibc malloc on the SDK overhead benchmark
/// (docs/src/reference/benchmarks-history.md), for about 2 MiB more peak RSS.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(
    name = "fake-driver",
    version,
    about = "An in-memory cloud behind the machinedriver.v1 protocol",
    after_help = "With --join-cluster the cloud's machines join that Kubernetes cluster the way a kubelet \
registers: each running machine and pool instance gets a Node (name = its Hostname address, \
spec.providerID = its provider ID, annotated kwok.x-k8s.io/node=fake for kwok to keep Ready); \
the Node of a VM that is gone (or whose kubelet was stopped with fakecloud.v1.FakeCloud/StopKubelet) \
is left in place with Ready=Unknown. Provider spec field \"kubelet\": Joins (default), NeverJoins, \
JoinsNotReady."
)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
    /// How long a machine create takes.
    // The test `cli_defaults_are_the_constants` pins the duration strings to the constants.
    #[arg(long, env = "FAKE_CREATE_LATENCY", default_value = "2s", value_parser = driver_sdk::parse_duration)]
    create_latency: Duration,
    /// How long a machine delete takes.
    #[arg(long, env = "FAKE_DELETE_LATENCY", default_value = "1s", value_parser = driver_sdk::parse_duration)]
    delete_latency: Duration,
    /// How long an in-place update takes.
    #[arg(long, env = "FAKE_UPDATE_LATENCY", default_value = "1s", value_parser = driver_sdk::parse_duration)]
    update_latency: Duration,
    /// How long a pool operation takes.
    #[arg(long, env = "FAKE_POOL_LATENCY", default_value = "2s", value_parser = driver_sdk::parse_duration)]
    pool_latency: Duration,
    /// Most machines (plus pool instances) that may exist at once.
    #[arg(long, env = "FAKE_MAX_MACHINES")]
    max_machines: Option<u32>,
    /// Cloud API calls per second allowed; beyond it calls are throttled with RetryInfo.
    #[arg(long, env = "FAKE_RATE_LIMIT")]
    rate_limit: Option<f64>,
    /// Burst size of the rate limit.
    #[arg(long, env = "FAKE_BURST", default_value_t = fake_driver::DEFAULT_BURST)]
    burst: u32,
    /// Keep the cloud in this JSON file so it survives a restart.
    #[arg(long, env = "FAKE_STATE_FILE")]
    state_file: Option<PathBuf>,
    /// Require calls to carry this value as secret `apiKey`.
    #[arg(long, env = "FAKE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// JSON file with fault-injection rules (see fakecloud.v1.FaultRule).
    #[arg(long, env = "FAKE_FAULTS")]
    faults: Option<PathBuf>,
    /// Kubeconfig of a Kubernetes cluster the cloud's machines join: a Node is registered for each
    /// running machine (as a kubelet would; kwok keeps it Ready) and marked not reporting when
    /// the VM is gone. Only this file is read (not $KUBECONFIG nor an in-cluster config).
    /// A test device: only in a fake-driver built with the cargo feature `join-cluster`.
    #[arg(long, env = "FAKE_JOIN_CLUSTER", value_name = "KUBECONFIG")]
    join_cluster: Option<PathBuf>,
    /// Require a configured token key instead of falling back to the development key.
    #[arg(long)]
    production: bool,
}

fn config(cli: &Cli) -> Result<Config, String> {
    let faults: Vec<FaultRule> = match &cli.faults {
        Some(p) => {
            let text = std::fs::read_to_string(p).map_err(|e| format!("reading faults file {}: {e}", p.display()))?;
            serde_json::from_str(&text).map_err(|e| format!("faults file {}: {e}", p.display()))?
        }
        None => Vec::new(),
    };
    if let Some(r) = cli.rate_limit {
        if !(r.is_finite() && r > 0.0) {
            return Err(format!("--rate-limit must be a positive number, got {r}"));
        }
    }
    Ok(Config {
        create_latency: cli.create_latency,
        delete_latency: cli.delete_latency,
        update_latency: cli.update_latency,
        pool_latency: cli.pool_latency,
        max_machines: cli.max_machines,
        rate_limit: cli.rate_limit,
        burst: cli.burst,
        state_file: cli.state_file.clone(),
        api_key: cli.api_key.clone(),
        faults,
    })
}

/// Starts the kubelets of `--join-cluster`; they run for the life of the process, beside the
/// server.
#[cfg(feature = "join-cluster")]
async fn join_cluster(driver: &Arc<FakeDriver>, kubeconfig: &Path) -> Result<(), String> {
    let config = fake_driver::kubelets::config(kubeconfig).await?;
    fake_driver::kubelets::spawn(driver.clone(), config).map(drop)
}

/// Without the cargo feature `join-cluster` there is no Kubernetes client to join with.
#[cfg(not(feature = "join-cluster"))]
async fn join_cluster(_: &Arc<FakeDriver>, _: &Path) -> Result<(), String> {
    Err("--join-cluster needs a fake-driver built with the cargo feature `join-cluster` (the \
simulated kubelets' Kubernetes client), which this one was not: \
`cargo build -p fake-driver --features join-cluster` (`cargo build --workspace` turns it on)"
        .to_string())
}

/// One thread: a sidecar serves one controller over a few connections, and tokio's
/// current-thread runtime answers a unary call with about 17% less CPU than the multi-threaded
/// one (no cross-thread wake-ups or work stealing; docs/src/reference/benchmarks-history.md). Nothing in
/// the fake blocks a thread for long.
#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let mut cli = Cli::parse();
    let _telemetry = telemetry::init("fake-driver", cli.serve.log_format);
    // The fake cloud is a development tool: it runs with the development token key unless told
    // to behave like a production sidecar.
    if !cli.production {
        cli.serve.dev = true;
    }
    let driver = match config(&cli).and_then(FakeDriver::new) {
        Ok(d) => fake_driver::shared(d),
        Err(e) => {
            eprintln!("fake-driver: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(kubeconfig) = &cli.join_cluster {
        if let Err(e) = join_cluster(&driver, kubeconfig).await {
            eprintln!("fake-driver: {e}");
            return ExitCode::from(2);
        }
    }
    let server = DriverServer::<FakeDriver>::new(driver.clone())
        .add_service(FakeCloudService::server(driver))
        .with_connection_hook(fake_driver::connections::cuttable)
        .register_descriptor_set(fake_driver::FILE_DESCRIPTOR_SET);
    match server.serve(&cli.serve).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fake-driver: {}", driver_sdk::error_chain(&e));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    /// The default of `--long` as clap shows it in `--help` and parses it.
    fn default_of(cmd: &clap::Command, long: &str) -> String {
        let arg = cmd.get_arguments().find(|a| a.get_long() == Some(long)).unwrap_or_else(|| panic!("no --{long}"));
        arg.get_default_values().iter().map(|v| v.to_string_lossy()).collect::<Vec<_>>().join(",")
    }

    #[test]
    fn cli_defaults_are_the_constants() {
        let cmd = Cli::command();
        let duration = |long: &str| driver_sdk::parse_duration(&default_of(&cmd, long)).unwrap();
        assert_eq!(duration("create-latency"), fake_driver::DEFAULT_CREATE_LATENCY);
        assert_eq!(duration("delete-latency"), fake_driver::DEFAULT_DELETE_LATENCY);
        assert_eq!(duration("update-latency"), fake_driver::DEFAULT_UPDATE_LATENCY);
        assert_eq!(duration("pool-latency"), fake_driver::DEFAULT_POOL_LATENCY);
        let d = Config::default();
        assert_eq!(
            (d.create_latency, d.delete_latency, d.update_latency, d.pool_latency, d.burst),
            (
                fake_driver::DEFAULT_CREATE_LATENCY,
                fake_driver::DEFAULT_DELETE_LATENCY,
                fake_driver::DEFAULT_UPDATE_LATENCY,
                fake_driver::DEFAULT_POOL_LATENCY,
                fake_driver::DEFAULT_BURST
            )
        );
    }

    /// A build without the feature refuses `--join-cluster`, naming the feature and how to get it.
    #[cfg(not(feature = "join-cluster"))]
    #[tokio::test]
    async fn join_cluster_without_the_feature_names_it() {
        let driver = fake_driver::shared(FakeDriver::new(Config::default()).unwrap());
        let e = join_cluster(&driver, Path::new("kubeconfig")).await.unwrap_err();
        assert!(e.contains("--features join-cluster"), "{e}");
    }

    /// `docs/src/operating/fake-driver.md` (the fake's own flags) and `sidecar.md` (the shared
    /// ones) have a row for every flag with a default, stating that default.
    #[test]
    fn the_book_states_the_cli_defaults() {
        let doc = [
            include_str!("../../../docs/src/operating/fake-driver.md"),
            include_str!("../../../docs/src/operating/sidecar.md"),
        ]
        .concat();
        let cmd = Cli::command();
        for arg in cmd.get_arguments().filter(|a| a.get_action().takes_values()) {
            let (Some(long), [default]) = (arg.get_long(), arg.get_default_values()) else { continue };
            let row = doc
                .lines()
                .find(|l| l.starts_with(&format!("| `--{long}` |")))
                .unwrap_or_else(|| panic!("fake-driver.md has no row for --{long}"));
            let default = default.to_string_lossy();
            assert!(row.contains(&format!("| `{default}` |")), "--{long} defaults to {default}: {row}");
        }
    }
}
