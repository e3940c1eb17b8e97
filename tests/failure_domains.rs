//! Failure domains on a whole test cluster (kube-apiserver, etcd, controller-manager, scheduler
//! and kwok's kubelets, all real processes; the fake cloud's VMs register Nodes with their
//! zone): one MachineDeployment spread over three zones, a zone out of capacity (the fake
//! cloud's per-zone fault, RESOURCE_EXHAUSTED / INSUFFICIENT_CAPACITY), surge-first rebalancing
//! when it recovers (through a kill -9 of the controller), and a zone whose Nodes all go
//! NotReady. Every invariant is watched at every event of the Machines.

use std::collections::BTreeMap;
use std::time::Duration;

use e2e_tests::watch::{available, Most};
use e2e_tests::world::World;
use e2e_tests::{eventually, joining};
use fake_driver::pb as fake;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use machine_controller::resources::*;
use serde_json::{json, Value};

const MINUTE: Duration = Duration::from_secs(60);
const FAST: &[&str] = &["--create-latency", "300ms", "--delete-latency", "200ms"];
const ZONES: [&str; 3] = ["a", "b", "c"];

/// A class and deployment `web` of `replicas` over zones a, b and c (fake zones `zone-a`, …),
/// with `extra` merged over its spec.
async fn deploy(w: &World, replicas: i64, extra: Value) {
    let class = json!({"driver": "fake", "providerSpec": {"machineType": "small"}});
    w.apply_object("MachineClass", "machineclasses", json!({"metadata": {"name": "small"}, "spec": joining(class)}))
        .await;
    let domains: Vec<Value> =
        ZONES.iter().map(|z| json!({"name": z, "providerSpec": {"zone": format!("zone-{z}")}})).collect();
    let mut spec = json!({
        "replicas": replicas,
        "template": {"spec": {"classRef": {"name": "small"}, "providerSpec": {"image": "os-1"}}},
        "strategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 1}},
        "failureDomains": domains,
    });
    for (k, v) in extra.as_object().cloned().unwrap_or_default() {
        spec[k] = v;
    }
    w.apply_object("MachineDeployment", "machinedeployments", json!({"metadata": {"name": "web"}, "spec": spec})).await;
}

/// Machines per zone (not being deleted).
fn per_zone(machines: impl IntoIterator<Item = Machine>) -> BTreeMap<String, i64> {
    let mut out: BTreeMap<String, i64> = ZONES.iter().map(|z| (z.to_string(), 0)).collect();
    for m in machines.into_iter().filter(|m| !m.is_deleting()) {
        *out.entry(m.spec.failure_domain.clone().unwrap_or_else(|| "-".into())).or_default() += 1;
    }
    out
}

/// The largest difference between two zones' machines (not being deleted).
fn skew(machines: &BTreeMap<String, Machine>) -> i64 {
    let counts = per_zone(machines.values().cloned());
    counts.values().max().unwrap_or(&0) - counts.values().min().unwrap_or(&0)
}

/// Waits until the deployment has `want` available machines per zone, and no others.
async fn spread(w: &World, want: [i64; 3], within: Duration) {
    let want: BTreeMap<String, i64> = ZONES.iter().map(|z| z.to_string()).zip(want).collect();
    w.wait_for(&format!("the machines spread {want:?}"), within, || async {
        let machines = w.machines().await;
        let all_up = machines.iter().all(available);
        (all_up && per_zone(machines) == want).then_some(())
    })
    .await;
}

/// The deployment's events, as `REASON: message`.
async fn events(w: &World) -> Vec<String> {
    let key = machine_controller::store::Key::new(Kind::MachineDeployment, w.ns(), "web");
    let events = w.store().backend().events(&key, 200).await.expect("the deployment's events");
    events.iter().map(|e| format!("{}: {}", e.reason, e.message)).collect()
}

async fn created(w: &World) -> u64 {
    w.inspect().await.counters.expect("counters").machines_created
}

fn domain_status<'a>(md: &'a MachineDeployment, zone: &str) -> Option<&'a FailureDomainStatus> {
    md.status.failure_domains.iter().find(|d| d.name == zone)
}

/// Nine machines go 3/3/3 with each Node in its zone, and stay within a skew of 1 through a
/// rolling update and a scale-down to six, watched at every event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nine_machines_spread_over_three_zones_and_keep_the_spread_through_a_rollout_and_a_scale_down() {
    let mut w = World::on_full_cluster(FAST, "zones").await;
    w.start_controller(&[]);
    deploy(&w, 9, json!({})).await;
    w.converged("web", 2 * MINUTE).await;
    spread(&w, [3, 3, 3], MINUTE).await;
    let nodes: Api<Node> = Api::all(w.cluster().client.clone());
    for m in w.machines().await {
        let node = m.status.node_ref.as_ref().map(|n| n.name.clone()).expect("a node");
        let node = nodes.get(&node).await.expect("the node");
        let zone = node.metadata.labels.unwrap_or_default().get("topology.kubernetes.io/zone").cloned();
        let want = m.spec.failure_domain.as_ref().map(|d| format!("zone-{d}"));
        assert_eq!(zone, want, "{}'s Node is in its domain's zone", m.metadata.name);
    }

    let watch = Most::watch(&w, skew);
    let before = w.md("web").await.status.current_revision;
    deploy(&w, 9, json!({"template": {"spec": {"classRef": {"name": "small"}, "providerSpec": {"image": "os-2"}}}}))
        .await;
    eventually(4 * MINUTE, "the rollout complete", || async {
        let md = w.md("web").await;
        (e2e_tests::rolled_out(&md) && md.status.current_revision != before).then_some(())
    })
    .await;
    spread(&w, [3, 3, 3], MINUTE).await;
    assert!(watch.most() <= 1, "the zones differed by {} machines during the rollout", watch.most());

    deploy(&w, 6, json!({"template": {"spec": {"classRef": {"name": "small"}, "providerSpec": {"image": "os-2"}}}}))
        .await;
    spread(&w, [2, 2, 2], 2 * MINUTE).await;
    assert!(watch.most() <= 1, "the zones differed by {} machines during the scale-down", watch.most());
    let (code, out, _) = w.cli(&["get", "machines", "-o", "wide", "-n", w.ns()]).await;
    assert_eq!(code, 0);
    let column = out.lines().next().and_then(|h| h.split_whitespace().position(|c| c == "DOMAIN"));
    let zones: Vec<&str> = out.lines().skip(1).filter_map(|l| l.split_whitespace().nth(column?)).collect();
    assert_eq!(zones.len(), 6, "{out}");
    assert!(zones.iter().all(|z| ZONES.contains(z)), "{out}");
    w.assert_consistent(6).await;
    w.kill9().await;
}

/// Zone c refuses creates for capacity: the machines land in a and b, the zone is marked with
/// its reason and backoff, and the failure budget is untouched. When it recovers the deployment
/// moves machines back surge-first — never fewer than `replicas` available, within a
/// disruption budget of 1 — and a controller killed with -9 in the middle of a move creates
/// nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zone_out_of_capacity_fails_over_then_rebalances_surge_first_through_a_kill_9() {
    let mut w = World::on_full_cluster(&["--create-latency", "2s", "--delete-latency", "200ms"], "zones").await;
    w.set_faults(vec![fake::FaultRule {
        rpc: "CreateMachine".into(),
        zone: "zone-c".into(),
        action: "error".into(),
        code: "RESOURCE_EXHAUSTED".into(),
        reason: "INSUFFICIENT_CAPACITY".into(),
        message: "no capacity for small in zone-c".into(),
        ..Default::default()
    }])
    .await;
    let mut c = w.start_controller(&[]);
    let extra = json!({
        "failureDomainBackoff": {"initialSeconds": 15, "maxSeconds": 15},
        "disruption": {"budgets": [{"machines": 1}]},
        "failureBudget": 1,
    });
    deploy(&w, 9, extra.clone()).await;
    w.converged("web", 3 * MINUTE).await;
    spread(&w, [5, 4, 0], MINUTE).await;
    // While the fault lasts the zone is closed, and tried again (and closed again) each time its
    // backoff ends: read it while it is closed.
    let md = eventually(MINUTE, "zone c closed", || async {
        let md = w.md("web").await;
        let closed = domain_status(&md, "c").is_some_and(|c| c.reason == "InsufficientCapacity");
        closed.then_some(md)
    })
    .await;
    let zone_c = domain_status(&md, "c").expect("zone c's status");
    assert!(zone_c.backoff_seconds >= 15 && zone_c.unavailable_until.is_some(), "{zone_c:?}");
    assert!(zone_c.message.contains("no capacity for small in zone-c"), "{zone_c:?}");
    assert!(md.status.bad_revisions.is_empty(), "the zone, not the revision, is to blame: {:?}", md.status);
    eventually(MINUTE, "kubectl describe showing zone c closed", || async {
        let (code, out, _) = w.cluster().kubectl(&["describe", "machinedeployment", "web", "-n", w.ns()]).await;
        let shown = out.contains("Failure Domains")
            && out.contains("InsufficientCapacity")
            && out.contains("Unavailable Until");
        (code == 0 && shown).then_some(())
    })
    .await;
    eventually(MINUTE, "describe showing zone c closed", || async {
        let (_, table, _) = w.cli(&["describe", "md", "web", "-n", w.ns()]).await;
        (table.contains("Failure Domains:") && table.contains("until") && table.contains("InsufficientCapacity"))
            .then_some(())
    })
    .await;
    let said = events(&w).await;
    assert!(said.iter().any(|e| e.starts_with("FailureDomainUnavailable: c refused")), "{said:?}");

    // The zone recovers: after its backoff the deployment moves machines back, one at a time.
    let unavailable = Most::unavailable(&w, 9);
    let base = created(&w).await;
    w.set_faults(vec![]).await;
    let mover = eventually(MINUTE, "a machine created in zone c to rebalance", || async {
        let machines = w.machines().await;
        machines.into_iter().find(|m| m.metadata.annotations.contains_key(ANNOTATION_REBALANCE))
    })
    .await;
    assert_eq!(mover.spec.failure_domain.as_deref(), Some("c"));
    // Killed while the move is under way (its machine is still being created).
    w.kill9_controller(c).await;
    c = w.start_controller(&[]);
    spread(&w, [3, 3, 3], 4 * MINUTE).await;
    let md = w.md("web").await;
    assert!(md.status.rebalance.is_none(), "{:?}", md.status.rebalance);
    let said = events(&w).await;
    assert_eq!(created(&w).await, base + 3, "three moves, each machine created once:\n{}", said.join("\n"));
    assert!(unavailable.most() <= 0, "{} machines were unavailable at once during the rebalance", unavailable.most());
    // (Events of one reason are aggregated by the API server's client, so their number is not
    // the moves'.)
    assert!(said.iter().any(|e| e.starts_with("Rebalanced: ") && e.contains(" leaves ")), "{said:?}");
    w.assert_consistent(9).await;
    w.kill9_controller(c).await;
}

/// Every Node of zone c goes NotReady: the zone is degraded (a condition names it), no machine
/// goes there, its machines do not trip the health check's maxUnhealthy (2 of 9) and are replaced
/// in the other zones, once each, with nothing elsewhere touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zone_whose_nodes_all_go_not_ready_is_degraded_and_replaced_elsewhere_once() {
    let mut w = World::on_full_cluster(FAST, "zones").await;
    w.start_controller(&[]);
    deploy(&w, 9, json!({"rebalance": {"enabled": false}, "remediation": {"maxInFlight": 3}})).await;
    w.converged("web", 2 * MINUTE).await;
    spread(&w, [3, 3, 3], MINUTE).await;
    let spec = json!({
        "selector": {"matchLabels": {"machine.driver.dev/deployment": "web"}},
        "unhealthyConditions": [
            {"type": "Ready", "status": "False", "timeoutSeconds": 5},
            {"type": "Ready", "status": "Unknown", "timeoutSeconds": 5},
        ],
        "maxUnhealthy": 2,
    });
    w.apply_object("MachineHealthCheck", "machinehealthchecks", json!({"metadata": {"name": "web"}, "spec": spec}))
        .await;
    let machines = w.machines().await;
    let healthy: Vec<String> = machines
        .iter()
        .filter(|m| m.spec.failure_domain.as_deref() != Some("c"))
        .map(|m| m.metadata.name.clone())
        .collect();
    let base = created(&w).await;
    for m in machines.iter().filter(|m| m.spec.failure_domain.as_deref() == Some("c")) {
        w.fake().await.stop_kubelet(fake::StopKubeletRequest { machine: m.metadata.name.clone() }).await.unwrap();
    }
    let md = eventually(MINUTE, "zone c degraded", || async {
        let md = w.md("web").await;
        let c = condition(&md.status.conditions, ConditionType::FailureDomainDegraded)?;
        (c.status == ConditionStatus::True).then_some(md)
    })
    .await;
    let degraded = condition(&md.status.conditions, ConditionType::FailureDomainDegraded).expect("the condition");
    assert!(degraded.message.contains("c: 3 machine(s) unhealthy"), "{degraded:?}");
    spread(&w, [5, 4, 0], 3 * MINUTE).await;
    assert_eq!(created(&w).await, base + 3, "each machine of zone c replaced once");
    let names: Vec<String> = w.machines().await.iter().map(|m| m.metadata.name.clone()).collect();
    assert!(healthy.iter().all(|n| names.contains(n)), "nothing in zones a and b was touched");
    let mhc = w.store().get::<MachineHealthCheck>(w.ns(), "web").await.unwrap().expect("the health check");
    let allowed = condition(&mhc.status.conditions, ConditionType::RemediationAllowed).expect("RemediationAllowed");
    assert_eq!(allowed.reason, Reason::WithinMaxUnhealthy, "{allowed:?}");
    // Nothing more is replaced once the zone's Nodes are gone with their machines.
    assert_eq!(created(&w).await, base + 3);
    w.assert_consistent(9).await;
    w.kill9().await;
}
