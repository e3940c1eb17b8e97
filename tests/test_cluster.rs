//! The whole test cluster that node tests build on (`Cluster::start_full`): etcd,
//! kube-apiserver, kube-controller-manager, kube-scheduler, and kwok standing in for the kubelets.
//! Nodes that carry the kwok annotation go Ready, a Deployment's pods run on them, the controller
//! manager computes a PodDisruptionBudget's status, the Eviction API honours it, and kubectl sees
//! what a user would.

use std::collections::HashSet;
use std::time::Duration;

use e2e_tests::eventually;
use e2e_tests::kube_cluster::{kwok_node_annotation, node_ready, Cluster};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, EvictParams, ListParams};
use serde_json::json;

const MINUTE: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_test_cluster_runs_pods_on_simulated_nodes_and_enforces_disruption_budgets() {
    let started = std::time::Instant::now();
    let cluster = Cluster::start_full().await;
    eprintln!("full cluster started in {:?}", started.elapsed());
    let ns = cluster.namespace("pdb").await;
    let (key, value) = kwok_node_annotation();
    for vm in ["vm-1", "vm-2"] {
        cluster
            .apply_json(json!({
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": vm, "annotations": {key: value}},
                "spec": {"providerID": format!("fake:///zone-a/{vm}")},
            }))
            .await;
    }
    let nodes = Api::<Node>::all(cluster.client.clone());
    eventually(MINUTE, "both nodes Ready", || {
        let nodes = nodes.clone();
        async move {
            let list = nodes.list(&ListParams::default()).await.ok()?;
            let ready: HashSet<String> =
                list.items.iter().filter(|n| node_ready(n)).filter_map(|n| n.metadata.name.clone()).collect();
            (ready == HashSet::from(["vm-1".to_string(), "vm-2".to_string()])).then_some(())
        }
    })
    .await;

    cluster
        .apply_json(json!({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web", "namespace": ns},
            "spec": {
                "replicas": 4,
                "selector": {"matchLabels": {"app": "web"}},
                "template": {
                    "metadata": {"labels": {"app": "web"}},
                    // kwok pulls no image.
                    "spec": {"containers": [{"name": "web", "image": "registry.invalid/pause:1"}]},
                },
            },
        }))
        .await;
    cluster
        .apply_json(json!({
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "web", "namespace": ns},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "web"}}},
        }))
        .await;

    let pods = Api::<Pod>::namespaced(cluster.client.clone(), &ns);
    let running: Vec<String> = eventually(MINUTE, "4 pods Running on the two nodes", || {
        let pods = pods.clone();
        async move {
            let list = pods.list(&ListParams::default().labels("app=web")).await.ok()?;
            let running: Vec<String> = list
                .items
                .iter()
                .filter(|p| p.metadata.deletion_timestamp.is_none())
                .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
                .filter(|p| {
                    let node = p.spec.as_ref().and_then(|s| s.node_name.as_deref());
                    matches!(node, Some("vm-1" | "vm-2"))
                })
                .filter_map(|p| p.metadata.name.clone())
                .collect();
            (running.len() == 4 && list.items.len() == 4).then_some(running)
        }
    })
    .await;
    let pdbs = Api::<PodDisruptionBudget>::namespaced(cluster.client.clone(), &ns);
    eventually(MINUTE, "the PDB allowing 1 disruption of 4 healthy pods", || {
        let pdbs = pdbs.clone();
        async move {
            let status = pdbs.get("web").await.ok()?.status?;
            let counts = (status.disruptions_allowed, status.current_healthy, status.expected_pods);
            (counts == (Some(1), Some(4), Some(4))).then_some(())
        }
    })
    .await;

    // Cordon both nodes, as a drain does: the evicted pod's replacement then stays Pending, so
    // the budget cannot recover between the two evictions.
    let (code, out, err) = cluster.kubectl(&["cordon", "vm-1", "vm-2"]).await;
    assert_eq!(code, 0, "kubectl cordon: {out}{err}");

    // Without the client's own retries: kube's default client retries 429 for minutes.
    let pods = Api::<Pod>::namespaced(cluster.client_without_retries().await, &ns);
    let evict = |name: String| {
        let pods = pods.clone();
        async move { tokio::time::timeout(MINUTE, pods.evict(&name, &EvictParams::default())).await.expect("evict") }
    };
    evict(running[0].clone()).await.unwrap_or_else(|e| panic!("the first eviction is allowed: {e}"));
    match evict(running[1].clone()).await {
        Err(kube::Error::Api(status)) => assert_eq!(
            (status.code, status.reason.as_str()),
            (429, "TooManyRequests"),
            "the second eviction is refused by the budget: {status:?}"
        ),
        other => panic!("the second eviction must be refused with 429, got {other:?}"),
    }

    let (code, out, err) = cluster.kubectl(&["get", "nodes", "-o", "wide"]).await;
    assert_eq!(code, 0, "kubectl get nodes: {err}");
    for vm in ["vm-1", "vm-2"] {
        let line = out.lines().find(|l| l.split_whitespace().next() == Some(vm));
        let line = line.unwrap_or_else(|| panic!("kubectl get nodes lists {vm}:\n{out}"));
        assert!(line.contains("Ready,SchedulingDisabled"), "{vm} Ready and cordoned:\n{out}");
    }
}
