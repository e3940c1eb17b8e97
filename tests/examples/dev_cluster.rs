//! A whole test cluster to look at by hand: kube-apiserver, etcd, kube-controller-manager,
//! kube-scheduler and kwok (the same as the node tests start), with the machine-driver CRDs
//! installed. Prints the kubeconfig and runs until Ctrl-C, then stops every process.
//!
//! ```text
//! export KUBE_CLUSTER_DIR=$(bash tests/tools/install-kube-cluster.sh)
//! cargo run -p e2e-tests --example dev_cluster
//! # in another shell, with the printed KUBECONFIG (a fake-driver with the cargo feature
//! # join-cluster: `cargo build --workspace`, or `cargo build -p fake-driver --features join-cluster`):
//! fake-driver --endpoint unix:///tmp/md/fake.sock --join-cluster "$KUBECONFIG" &
//! machine-controller --store kubernetes run --driver fake=unix:///tmp/md/fake.sock &
//! machine-controller --store kubernetes apply -f examples/machineclass.yaml -f examples/machinedeployment.yaml
//! $KUBE_CLUSTER_DIR/kubectl get machines,nodes
//! ```

// Test code: a setup that fails is a failed test (the workspace warns of `unwrap` in what ships).
#![allow(clippy::unwrap_used)]

use e2e_tests::kube_cluster::Cluster;

#[tokio::main]
async fn main() {
    let cluster = Cluster::start_full().await;
    println!("export KUBECONFIG={}", cluster.kubeconfig.display());
    println!("kubectl: {}", e2e_tests::kube_cluster::kubectl().display());
    println!("logs:    {}", cluster.dir.path().display());
    println!("Ctrl-C (or SIGTERM) stops the cluster.");
    // Returning drops the cluster, which stops every process it started.
    machine_controller::cli::shutdown_signal().await;
}
