//! # machine-api
//!
//! The `machine.driver.dev/v1alpha1` API as data: the Kubernetes-shaped resource types the
//! controller reconciles, the facts of each kind, the manifest parser with every check `apply`
//! makes, and the CustomResourceDefinitions generated from the same types. Nothing here talks to
//! a network, a database or a runtime (no Kubernetes client, SQLite, tokio or gRPC), so a tool
//! that only reads or checks manifests — the `manifest_parse` fuzz target in `fuzz/`, say —
//! builds this crate alone.
//!
//! - [`registry`]: one line per kind, from which every list of kinds follows, and
//!   [`Kind`](registry::Kind), the kinds by name;
//! - [`resources`]: the types, one file per kind, with their [`KindInfo`](resources::KindInfo)
//!   (the facts of the kind), the typed status vocabulary and the checks;
//! - [`schema`]: Kubernetes structural schemas of Rust types;
//! - [`dispatch`]: from a kind to its type: each kind's facts as [`Kind`](registry::Kind)
//!   methods, and [`AnyObject`](dispatch::AnyObject);
//! - [`crd`]: the CustomResourceDefinitions, generated from the resource types;
//! - [`manifest`]: YAML or JSON files into validated objects.
//!
//! Each module uses only those listed before it: the imports run one way, with no circle.

#![warn(missing_docs)]

pub mod crd;
pub mod dispatch;
#[doc(hidden)]
pub mod fuzzing;
pub mod manifest;
pub mod registry;
pub mod resources;
pub mod schema;
