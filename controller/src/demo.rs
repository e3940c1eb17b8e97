//! `machine-controller demo`: the whole system on one machine, in about a minute.
//!
//! Starts `fake-driver` as a real sidecar process on a Unix socket (2 s creates), applies the
//! sample MachineClass and MachineDeployment (20 machines) into a temporary store, runs the
//! reconcilers, rolls out a new template with maxSurge / maxUnavailable while watching how many
//! machines exist in the cloud, scales up and down, prints a summary with request IDs, deletes
//! everything, and stops the sidecar. Nothing is left behind.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

use crate::app::{App, Settings};
use crate::exit::Exit;
use crate::manifest;
use crate::resources::*;
use crate::runtime::{self, Config};
use crate::store::{Key, Store};

/// The sample manifests (also in `examples/`).
pub const SAMPLE_CLASS: &str = include_str!("../../examples/machineclass.yaml");
/// The sample deployment.
pub const SAMPLE_DEPLOYMENT: &str = include_str!("../../examples/machinedeployment.yaml");

/// `demo --create-latency`: the fake's own default, so machines are seen creating.
pub const DEFAULT_CREATE_LATENCY: Duration = Duration::from_secs(2);
/// `demo --step-timeout`: each step (20 creates, a rolling update, scaling) takes seconds;
/// this only ends a demo that is stuck.
pub const DEFAULT_STEP_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the sidecar may take to start answering Probe ready, and to stop after SIGTERM.
const SIDECAR_TIMEOUT: Duration = Duration::from_secs(20);
/// How often the sidecar is probed while it starts.
const READY_POLL: Duration = Duration::from_millis(50);
/// How often the demo looks at the cloud and the store while a step converges.
const WATCH_INTERVAL: Duration = Duration::from_millis(100);
/// The demo's health-check interval: shorter than `run`'s default, for a demo that lasts a
/// minute or two.
const HEALTH_CHECK_INTERVAL: Duration = Duration::from_secs(5);

/// `demo` options.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// The fake-driver binary (default: next to this one, else on PATH).
    #[arg(long)]
    pub fake_driver: Option<PathBuf>,
    /// How long a fake create takes.
    // Duration defaults are strings (no `Display`); `defaults`' tests pin them to the constants.
    #[arg(long, default_value = "2s", value_parser = machine_driver_util::parse_duration)]
    pub create_latency: Duration,
    /// Give up on any step after this long.
    #[arg(long, default_value = "120s", value_parser = machine_driver_util::parse_duration)]
    pub step_timeout: Duration,
}

fn fail(msg: impl Into<String>) -> Exit {
    Exit::fail(msg)
}

fn fake_driver_path(arg: Option<PathBuf>) -> Result<PathBuf, Exit> {
    if let Some(p) = arg {
        return Ok(p);
    }
    if let Some(dir) = std::env::current_exe().ok().and_then(|e| e.parent().map(PathBuf::from)) {
        let p = dir.join("fake-driver");
        if p.exists() {
            return Ok(p);
        }
    }
    Ok(PathBuf::from("fake-driver"))
}

/// Kills the sidecar on every exit path.
struct Sidecar(tokio::process::Child);

impl Sidecar {
    async fn stop(mut self) -> Result<(), Exit> {
        if let Some(pid) = self.0.id() {
            let _ = std::process::Command::new("kill").arg("-TERM").arg(pid.to_string()).status();
        }
        match tokio::time::timeout(SIDECAR_TIMEOUT, self.0.wait()).await {
            Ok(Ok(_)) => Ok(()),
            _ => {
                let _ = self.0.kill().await;
                Err(fail("the fake-driver sidecar did not stop on SIGTERM"))
            }
        }
    }
}

/// Runs the demo.
///
/// # Errors
/// A step that fails or takes longer than `step_timeout`.
pub async fn run(args: DemoArgs) -> Result<(), Exit> {
    let dir = tempfile::Builder::new()
        .prefix("machine-driver-demo-")
        .tempdir()
        .map_err(|e| fail(format!("temp dir: {e}")))?;
    let socket = dir.path().join("fake.sock");
    let endpoint = format!("unix://{}", socket.display());
    let bin = fake_driver_path(args.fake_driver.clone())?;
    println!("== starting the fake-driver sidecar on {endpoint}");
    let child = tokio::process::Command::new(&bin)
        .arg("--endpoint")
        .arg(&endpoint)
        .arg("--create-latency")
        .arg(format!("{}ms", args.create_latency.as_millis()))
        .arg("--delete-latency")
        .arg("1s")
        // Quiet: the demo prints its own story (the sidecar logs every call with its request ID
        // at RUST_LOG=info).
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| {
            fail(format!(
                "starting {}: {e} (build it with `cargo build -p fake-driver`, or pass --fake-driver)",
                bin.display()
            ))
        })?;
    let sidecar = Sidecar(child);
    let result = demo(&args, dir.path(), &endpoint).await;
    let stopped = sidecar.stop().await;
    let leftover = socket.exists();
    drop(dir);
    result?;
    stopped?;
    if leftover {
        return Err(fail("the sidecar left its socket behind"));
    }
    println!("== done: the sidecar stopped, its socket and the demo store are removed");
    Ok(())
}

async fn wait_ready(endpoint: &str, timeout: Duration) -> Result<driver_sdk::DriverClient, Exit> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(c) = driver_sdk::DriverClient::connect(endpoint).await {
            if c.probe(Default::default()).await.is_ok_and(|r| r.value.ready) {
                return Ok(c);
            }
        }
        if Instant::now() > deadline {
            return Err(fail(format!("the sidecar at {endpoint} did not become ready")));
        }
        tokio::time::sleep(READY_POLL).await;
    }
}

struct Watch {
    peak: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

/// Counts the machines that exist in the cloud (any state) every 100 ms, through the protocol.
fn watch_cloud(client: driver_sdk::DriverClient) -> Watch {
    let peak = Arc::new(AtomicUsize::new(0));
    let p = peak.clone();
    let task = tokio::spawn(async move {
        loop {
            if let Ok(list) = client.list_all_machines(HashMap::new(), driver_sdk::MAX_PAGE_SIZE as i32, None).await {
                p.fetch_max(list.len(), Ordering::SeqCst);
            }
            tokio::time::sleep(WATCH_INTERVAL).await;
        }
    });
    Watch { peak, task }
}

async fn demo(args: &DemoArgs, dir: &std::path::Path, endpoint: &str) -> Result<(), Exit> {
    let client = wait_ready(endpoint, SIDECAR_TIMEOUT).await?;
    let info = client.get_driver_info(Default::default()).await.map_err(|e| fail(e.to_string()))?;
    println!(
        "   driver {} {} (protocol {}), request {}",
        info.value.name, info.value.vendor_version, info.value.protocol_version, info.request_id
    );

    let store = Store::open(&dir.join("demo.db"))?;
    let mut objects =
        manifest::parse(SAMPLE_CLASS, "examples/machineclass.yaml").map_err(|e| fail(format!("{e:?}")))?;
    objects.extend(
        manifest::parse(SAMPLE_DEPLOYMENT, "examples/machinedeployment.yaml").map_err(|e| fail(format!("{e:?}")))?,
    );
    println!("== applying examples/machineclass.yaml and examples/machinedeployment.yaml");
    for o in &objects {
        store.apply(o.kind(), o.to_json()).await?;
        println!("   {}/{} created", o.kind(), o.meta().name);
    }
    let mut registry = prometheus_client::registry::Registry::default();
    let settings = Settings { health_check_interval: HEALTH_CHECK_INTERVAL, ..Settings::default() };
    let ctx = App::context(
        store.clone(),
        &[("fake".into(), endpoint.into())],
        Config::default(),
        settings,
        &mut registry,
        None,
    )
    .map_err(|e| fail(e.to_string()))?;
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let controller = tokio::spawn(runtime::run(ctx.clone(), Arc::new(crate::reconcile::Controller), async move {
        let _ = stop_rx.wait_for(|s| *s).await;
    }));
    let watch = watch_cloud(client.clone());
    let outcome = steps(args, &store, &client, &watch).await;
    let _ = stop_tx.send(true);
    watch.task.abort();
    let _ = controller.await;
    outcome
}

async fn get_md(store: &Store) -> Result<MachineDeployment, Exit> {
    store.get::<MachineDeployment>("default", "web").await?.ok_or_else(|| fail("the demo deployment disappeared"))
}

/// Waits until the deployment has `replicas` available machines of its target revision and no
/// others, showing a progress bar.
async fn converge(store: &Store, what: &str, timeout: Duration) -> Result<Duration, Exit> {
    let started = Instant::now();
    let md = get_md(store).await?;
    let bar = ProgressBar::new(md.spec.replicas.max(0) as u64).with_style(
        ProgressStyle::with_template("   {prefix:<22} [{bar:30}] {pos}/{len} {msg}")
            .map_err(|e| fail(e.to_string()))?
            .progress_chars("=> "),
    );
    bar.set_prefix(what.to_string());
    loop {
        let md = get_md(store).await?;
        let machines = store.list::<Machine>().await?;
        let mut phases: HashMap<Phase, usize> = HashMap::new();
        for m in machines.iter().filter(|m| m.metadata.labels.get(LABEL_DEPLOYMENT).is_some_and(|d| d == "web")) {
            *phases.entry(if m.is_deleting() { Phase::Terminating } else { m.status.phase }).or_default() += 1;
        }
        let mut summary: Vec<String> = phases.iter().map(|(p, n)| format!("{p} {n}")).collect();
        summary.sort();
        bar.set_length(md.spec.replicas.max(0) as u64);
        bar.set_position(md.status.available_replicas.max(0) as u64);
        bar.set_message(summary.join(", "));
        let done = md.status.observed_generation >= md.metadata.generation
            && md.status.available_replicas == md.spec.replicas
            && md.status.replicas == md.spec.replicas
            && md.status.updated_replicas == md.spec.replicas;
        if done {
            bar.finish_with_message(format!("done in {:.1}s", started.elapsed().as_secs_f64()));
            return Ok(started.elapsed());
        }
        if started.elapsed() > timeout {
            bar.abandon();
            return Err(fail(format!("{what}: not converged after {timeout:?}")));
        }
        tokio::time::sleep(WATCH_INTERVAL).await;
    }
}

async fn edit(store: &Store, f: impl Fn(&mut MachineDeployment)) -> Result<(), Exit> {
    for _ in 0..10 {
        let mut md = get_md(store).await?;
        f(&mut md);
        match store.update(&md).await {
            Ok(_) => return Ok(()),
            Err(crate::store::Error::Conflict { .. }) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(fail("could not update the deployment"))
}

async fn steps(args: &DemoArgs, store: &Store, client: &driver_sdk::DriverClient, watch: &Watch) -> Result<(), Exit> {
    let t = args.step_timeout;
    println!(
        "== creating 20 machines (each create takes {:?} in the fake cloud; 10 workers never wait for it)",
        args.create_latency
    );
    let created = converge(store, "create 20", t).await?;

    let md = get_md(store).await?;
    let ru = &md.spec.strategy.rolling_update;
    let surge = ru.max_surge.resolve(md.spec.replicas, true).unwrap_or(0);
    let unavailable = ru.max_unavailable.resolve(md.spec.replicas, false).unwrap_or(0);
    let limit = (md.spec.replicas + surge) as usize;
    println!(
        "== rolling update to image fake-os-2: maxSurge {surge}, maxUnavailable {unavailable} (the cloud may hold at most {limit} machines)"
    );
    watch.peak.store(0, Ordering::SeqCst);
    edit(store, |md| {
        let spec = md.spec.template.spec.provider_spec.get_or_insert_with(|| serde_json::json!({}));
        spec["image"] = "fake-os-2".into();
    })
    .await?;
    let rolled = converge(store, "rolling update", t).await?;
    let peak = watch.peak.load(Ordering::SeqCst);
    println!("   peak machines in the cloud during the rollout: {peak} (limit {limit})");
    if peak > limit {
        return Err(fail(format!("the rollout exceeded maxSurge: {peak} machines > {limit}")));
    }

    println!("== scaling to 30");
    edit(store, |md| md.spec.replicas = 30).await?;
    let up = converge(store, "scale to 30", t).await?;
    println!("== scaling to 12 (oldest machines go first)");
    edit(store, |md| md.spec.replicas = 12).await?;
    let down = converge(store, "scale to 12", t).await?;

    let machines = store.list::<Machine>().await?;
    println!("== summary");
    println!(
        "   create 20: {:.1}s   rolling update: {:.1}s   scale to 30: {:.1}s   scale to 12: {:.1}s",
        created.as_secs_f64(),
        rolled.as_secs_f64(),
        up.as_secs_f64(),
        down.as_secs_f64()
    );
    println!("   a few driver calls and their request IDs (the sidecar logs each call with its ID at RUST_LOG=info):");
    for m in machines.iter().take(4) {
        if let Some(l) = &m.status.last_operation {
            println!(
                "     {:<24} {:<7} {:<10} {:<3} request {}",
                m.metadata.name, l.op_type, l.state, l.code, l.request_id
            );
        }
    }
    let md = get_md(store).await?;
    println!(
        "   deployment: revision {} current, {} good revisions in history",
        md.status.current_revision,
        md.status.revision_history.len()
    );

    println!("== deleting the deployment: every machine is deleted in the cloud first");
    store.delete(&Key::new(Kind::MachineDeployment, "default", "web")).await?;
    let started = Instant::now();
    loop {
        let cloud = client
            .list_all_machines(HashMap::new(), driver_sdk::MAX_PAGE_SIZE as i32, None)
            .await
            .map_err(|e| fail(e.to_string()))?;
        let objects = store.list::<Machine>().await?.len();
        if cloud.is_empty() && objects == 0 && store.get::<MachineDeployment>("default", "web").await?.is_none() {
            println!("   cloud empty, no Machine objects left ({:.1}s)", started.elapsed().as_secs_f64());
            break;
        }
        if started.elapsed() > t {
            return Err(fail(format!("delete: {} cloud machines and {objects} objects left after {t:?}", cloud.len())));
        }
        tokio::time::sleep(WATCH_INTERVAL).await;
    }
    Ok(())
}
