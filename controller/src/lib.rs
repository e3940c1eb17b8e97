//! # machine-controller
//!
//! Reconciles Kubernetes-shaped machine resources (`MachineClass`, `MachineDeployment`,
//! `MachinePool`, `Machine`) through `machinedriver.v1` driver sidecars. Operation handles are
//! stored in status before anything else, so a restart of the controller or a sidecar loses
//! nothing: in-flight operations resume from status, no machine is created twice, none leaks.
//!
//! - [`resources`] and [`manifest`]: the model and validated YAML input (from the `machine-api`
//!   crate, re-exported here);
//! - [`registry`]: one line per kind, from which every list of kinds follows (`machine-api`);
//! - [`store`]: the storage trait, the embedded SQLite store and the Kubernetes backend;
//! - [`events`]: the reasons of the events the reconcilers record, with their types;
//! - [`crd`]: CustomResourceDefinitions generated from the resource types (`machine-api`);
//! - [`leader`]: leader election with a `coordination.k8s.io/v1` Lease;
//! - [`nodes`]: the target cluster where the machines' Nodes live (linking, drain calls);
//! - [`plan`]: pure planners (rollouts, in-place updates, pool upgrades);
//! - [`policy`]: the error policy (what a driver error means: retry, back off, fail, done);
//! - [`runtime`]: work queue, workers, rate limits, backoff, generic over the application's
//!   context; [`app`]: that context for the reconcilers (drivers, target cluster, orphans);
//! - [`safety`]: whether the API servers answer; health timers start over after an outage;
//! - [`state_metrics`]: what the objects say (conditions, owners' replicas, disruptions) as metrics;
//! - [`targets`]: the target clusters (the default one, and those owners name by a kubeconfig
//!   Secret), each with its own connection, probe, Node watch and metrics;
//! - [`reconcile`]: the machine, deployment, pool, health-check and orphan reconcilers;
//! - [`cli`]: `apply`, `get`, `describe`, `delete`, `rollout`, `run`, `demo`; [`exit`]: how a
//!   failed command ends;
//! - [`autoscaler`]: the cluster-autoscaler's externalgrpc cloud provider (`run
//!   --autoscaler-listen`): autoscaled deployments and pools as node groups;
//! - [`defaults`]: the default of every flag, shared by the CLI, the runtime's and the
//!   controller's settings and the book.

#![warn(missing_docs)]

pub mod app;
pub mod autoscaler;
pub mod cli;
pub mod defaults;
pub mod demo;
pub mod events;
pub mod exit;
pub mod leader;
pub mod nodes;
pub mod plan;
pub mod policy;
pub mod reconcile;
pub mod runtime;
pub mod safety;
pub mod state_metrics;
pub mod store;
pub mod targets;

pub use machine_api::{crd, manifest, registry, resources};

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use crate::resources::OperationKind;

    /// The API's operation kinds name the protocol's RPCs, one for one.
    #[test]
    fn operation_kinds_are_the_protocols() {
        let ours: BTreeSet<String> = OperationKind::ALL.iter().map(|k| k.as_str().to_uppercase()).collect();
        let protocol: BTreeSet<String> = (1..)
            .map_while(|v| driver_sdk::proto::OperationKind::try_from(v).ok())
            .map(|p| p.as_str_name().trim_start_matches("OPERATION_KIND_").replace('_', ""))
            .collect();
        assert_eq!(ours, protocol);
    }
}
