//! The resource model: Kubernetes-shaped objects (`apiVersion`, `kind`, `metadata`, `spec`,
//! `status`) in the `machine.driver.dev/v1alpha1` API group, so the same YAML works with the
//! embedded store and as CRDs.
//!
//! One file per kind — `secret.rs`, `machine_class.rs`, `machine_deployment.rs`,
//! `machine_pool.rs`, `machine.rs`, `machine_health_check.rs` — each with its types and its
//! [`KindInfo`]; the parts kinds share in `meta.rs` (metadata, [`Object`], [`Resource`], the
//! label and annotation names), `template.rs` (machine templates, [`IntOrPercent`],
//! [`NodeSettings`]) and `status.rs` (conditions, stored operations); the status vocabulary in
//! `state.rs`; disruption budgets, remediation limits and what an owner reports of them in
//! [`disruption`]; failure domains in [`failure_domain`]; the facts of a kind in `kind.rs`; the checks of `apply` in [`checks`]. Every
//! item is re-exported here: `resources::Machine`, `resources::Condition`, ….

mod autoscaling;
pub mod boot_data;
pub mod checks;
pub mod disruption;
pub mod failure_domain;
mod kind;
mod machine;
mod machine_class;
mod machine_deployment;
mod machine_health_check;
mod machine_pool;
mod meta;
mod secret;
mod state;
mod status;
mod template;

pub use autoscaling::*;
pub use disruption::*;
pub use failure_domain::*;
pub use kind::*;
pub use machine::*;
pub use machine_class::*;
pub use machine_deployment::*;
pub use machine_health_check::*;
pub use machine_pool::*;
pub use meta::*;
pub use secret::*;
pub use state::*;
pub use status::*;
pub use template::*;

pub use crate::registry::Kind;
