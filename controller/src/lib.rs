//! # machine-controller
//!
//! Reconciles Kubernetes-shaped machine resources (`MachineClass`, `MachineDeployment`,
//! `MachinePool`, `Machine`) through `machinedriver.v1` driver sidecars. Operation handles are
//! stored in status before anything else, so a restart of the controller or a sidecar loses
//! nothing: in-flight operations resume from status, no machine is created twice, none leaks.
//!
//! - [`resources`] and [`manifest`]: the model and validated YAML input;
//! - [`registry`]: one line per kind, from which every list of kinds follows;
//! - [`store`]: the storage trait, the embedded SQLite store and the Kubernetes backend;
//! - [`events`]: the reasons of the events the reconcilers record, with their types;
//! - [`crd`]: CustomResourceDefinitions generated from the resource types;
//! - [`leader`]: leader election with a `coordination.k8s.io/v1` Lease;
//! - [`nodes`]: the target cluster where the machines' Nodes live (linking, drain calls);
//! - [`plan`]: pure planners (rollouts, in-place updates, pool upgrades);
//! - [`policy`]: the error policy (what a driver error means: retry, back off, fail, done);
//! - [`runtime`]: work queue, workers, rate limits, backoff;
//! - [`safety`]: whether the API servers answer; health timers start over after an outage;
//! - [`reconcile`]: the machine, deployment, pool, health-check and orphan reconcilers;
//! - [`cli`]: `apply`, `get`, `describe`, `delete`, `rollout`, `run`, `demo`;
//! - [`defaults`]: the default of every flag, shared by the CLI, the runtime's settings and the book.

#![warn(missing_docs)]

pub mod cli;
pub mod crd;
pub mod defaults;
pub mod demo;
pub mod events;
#[doc(hidden)]
pub mod fuzzing;
pub mod leader;
pub mod manifest;
pub mod nodes;
pub mod plan;
pub mod policy;
pub mod reconcile;
pub mod registry;
pub mod resources;
pub mod runtime;
pub mod safety;
pub mod store;
