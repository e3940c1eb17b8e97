//! The `machine-controller` command line: the commands and their arguments here, each
//! subcommand in a module of its own.

mod apply;
mod rollout;
mod run;
mod show;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};

use crate::exit::Exit;
use crate::resources::*;
use crate::store::{Store, StoreSpec};

pub use apply::read_manifests;
use apply::{apply, delete};
use rollout::{rollout_status, set_paused};
use run::run;
pub use run::{shutdown_signal, RunArgs};
use show::{describe, get};

/// Reconciles machine resources through driver sidecars.
#[derive(Debug, Parser)]
#[command(name = "machine-controller", version)]
pub struct Cli {
    /// Where objects live: `sqlite://PATH` (or just PATH) for the embedded store, or
    /// `kubernetes` for custom resources on the API server of the kubeconfig / in-cluster config.
    #[arg(long, global = true, env = "MACHINE_CONTROLLER_STORE", default_value = crate::defaults::STORE)]
    pub store: StoreSpec,
    /// How log lines on stderr look (`RUST_LOG` sets the filter).
    #[arg(long, global = true, value_enum, default_value_t = machine_driver_util::telemetry::LogFormat::Text)]
    pub log_format: machine_driver_util::telemetry::LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Output formats of `get`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// A table of the kind's main columns.
    Table,
    /// The table with the wide columns too (address, request ID, …).
    Wide,
    /// YAML: the object when a name is given, else a `List` of them (as kubectl prints).
    Yaml,
    /// JSON: the object when a name is given, else a `List` of them (as kubectl prints).
    Json,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
// Parsed once per process: the size of `run`'s arguments does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Command {
    /// Creates or updates objects from YAML/JSON files or folders. All documents are validated
    /// first; an invalid one changes nothing.
    Apply {
        /// Files or folders.
        #[arg(short = 'f', long = "filename", required = true)]
        files: Vec<PathBuf>,
        /// Set `replicas` from the manifest even on an autoscaled MachineDeployment or MachinePool
        /// (by default the stored size, the cluster-autoscaler's, is kept).
        #[arg(long)]
        force_replicas: bool,
    },
    /// Lists objects.
    Get {
        /// Kind: machines, md, mc, mp, secrets (or the full kind name).
        kind: String,
        /// One object.
        name: Option<String>,
        /// Namespace.
        #[arg(short, long, default_value = "default")]
        namespace: String,
        /// Output format.
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Shows one object with its conditions, stored operations, request IDs and recent events.
    Describe {
        /// Kind: machines, md, mc, mp, secrets (or the full kind name).
        kind: String,
        /// The object's name.
        name: String,
        /// Namespace.
        #[arg(short, long, default_value = "default")]
        namespace: String,
    },
    /// Deletes objects (machines go through their finalizer: the cloud machine is deleted first).
    Delete {
        /// Kind (or use -f): machines, md, mc, mp, secrets (or the full kind name).
        kind: Option<String>,
        /// The object's name (or use -f).
        name: Option<String>,
        /// Delete what these manifests name.
        #[arg(short = 'f', long = "filename")]
        files: Vec<PathBuf>,
        /// Namespace.
        #[arg(short, long, default_value = "default")]
        namespace: String,
    },
    /// Rollout of a MachineDeployment: its status (with progress bars and its canary), pause,
    /// resume.
    Rollout {
        /// `status`, `pause` or `resume`.
        #[command(subcommand)]
        action: RolloutAction,
    },
    /// Runs the reconcilers.
    Run(RunArgs),
    /// Prints the CustomResourceDefinitions of the Kubernetes backend as YAML
    /// (`machine-controller crds | kubectl apply -f -`).
    Crds,
    /// Runs a demo: a fake driver sidecar, a 20-machine deployment, a rolling update, scaling.
    Demo(crate::demo::DemoArgs),
}

/// `rollout` actions.
#[derive(Debug, Subcommand)]
pub enum RolloutAction {
    /// Waits until the rollout completes (exit 0), is aborted (exit 1) or times out (exit 2).
    Status {
        /// The MachineDeployment.
        name: String,
        /// Namespace.
        #[arg(short, long, default_value = "default")]
        namespace: String,
        /// Give up after this long.
        // Duration defaults are strings (no `Display`); `defaults`' tests pin them to the constants.
        #[arg(long, default_value = "10m", value_parser = machine_driver_util::parse_duration)]
        timeout: Duration,
        /// Print the status once instead of waiting.
        #[arg(long)]
        no_watch: bool,
    },
    /// Pauses the rollout (`spec.paused: true`): no machine of the new revision is made and no
    /// old one removed until `resume` (scaling and remediation go on; a canary's pause clock too).
    Pause {
        /// The MachineDeployment.
        name: String,
        /// Namespace.
        #[arg(short, long, default_value = "default")]
        namespace: String,
    },
    /// Resumes a paused rollout (`spec.paused: false`).
    Resume {
        /// The MachineDeployment.
        name: String,
        /// Namespace.
        #[arg(short, long, default_value = "default")]
        namespace: String,
    },
}

fn fail(message: impl Into<String>) -> Exit {
    Exit::fail(message)
}

fn kind_arg(s: &str) -> Result<Kind, Exit> {
    Kind::parse(s).ok_or_else(|| {
        let names: Vec<String> = Kind::ALL
            .iter()
            .rev()
            .map(|k| match k.aliases().first() {
                Some(alias) => format!("{} ({alias})", k.plural()),
                None => k.plural().to_string(),
            })
            .collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        fail(format!("unknown kind {s:?}; use {}", one_of(&names)))
    })
}

/// Runs a parsed command.
///
/// # Errors
/// What to print, and the exit code.
pub async fn execute(cli: Cli) -> Result<(), Exit> {
    match cli.command {
        Command::Apply { files, force_replicas } => apply(&cli.store, &files, force_replicas).await,
        Command::Get { kind, name, namespace, output } => {
            let kind = kind_arg(&kind)?;
            get(&open(&cli.store).await?, kind, name.as_deref(), &namespace, output).await
        }
        Command::Describe { kind, name, namespace } => {
            let kind = kind_arg(&kind)?;
            describe(&open(&cli.store).await?, kind, &name, &namespace).await
        }
        Command::Delete { kind, name, files, namespace } => delete(&cli.store, kind, name, &files, &namespace).await,
        Command::Rollout { action: RolloutAction::Status { name, namespace, timeout, no_watch } } => {
            rollout_status(&open(&cli.store).await?, &namespace, &name, timeout, !no_watch).await
        }
        Command::Rollout { action: RolloutAction::Pause { name, namespace } } => {
            set_paused(&open(&cli.store).await?, &namespace, &name, true).await
        }
        Command::Rollout { action: RolloutAction::Resume { name, namespace } } => {
            set_paused(&open(&cli.store).await?, &namespace, &name, false).await
        }
        Command::Run(args) => run(&cli.store, &args).await,
        Command::Crds => {
            print!("{}", crate::crd::crds_yaml()?);
            Ok(())
        }
        Command::Demo(args) => crate::demo::run(args).await,
    }
}

async fn open(spec: &StoreSpec) -> Result<Store, Exit> {
    Ok(connect(spec).await?.0)
}

/// The store `spec` names, and the Kubernetes client it was built with (`--store kubernetes`),
/// for whatever else talks to that API server (leader election).
async fn connect(spec: &StoreSpec) -> Result<(Store, Option<kube::Client>), Exit> {
    let failed =
        |e: crate::store::Error| fail(format!("opening store {spec}: {}", machine_driver_util::error_chain(&e)));
    let client = spec.kube_client().await.map_err(failed)?;
    let store = Store::connect(spec, client.clone()).map_err(failed)?;
    Ok((store, client))
}

#[cfg(test)]
mod tests;
