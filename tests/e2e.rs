//! The end-to-end suites, one module each, in one test executable: linked once, where one
//! executable per suite linked the same dependencies 18 times. `cargo xtask e2e` runs it with
//! cargo-nextest, a process per test (`.config/nextest.toml`); one suite: `cargo xtask e2e nodes::`.

// Test code: a setup that fails is a failed test (the workspace warns of `unwrap` in what ships).
#![allow(clippy::unwrap_used)]

mod autoscaler;
mod aws_ec2;
/// The AWS driver's event stream on moto: EventBridge → SQS → `WatchEvents`.
mod aws_events;
/// Shared by the AWS suites (`aws_ec2`, `interop`): moto and the loopback EC2 stub.
mod aws_support;
mod azure;
/// The Helm charts: lint, template per driver, `helm install` into a test cluster.
mod chart;
mod controller;
mod disruption;
mod failure_domains;
mod fake_driver;
mod go_driver;
mod health_check;
mod hpack_interop;
mod interop;
mod interruptions;
/// Boot data rendered per machine, a bootstrap token each, nodes that join by TLS bootstrap.
mod joining;
mod kubernetes;
/// One controller, a management cluster, many target clusters.
mod multi_target;
mod nodes;
mod store_conformance;
mod telemetry;
mod test_cluster;
/// One trace, controller to cloud, in a real Jaeger.
mod tracing_jaeger;
mod validation_rules;
