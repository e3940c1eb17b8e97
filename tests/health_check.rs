//! MachineHealthCheck end to end on the embedded store with the fake driver, as a user runs it:
//! `machine-controller run` and `fake-driver` as processes, the health check applied with
//! `machine-controller apply` and read with `get` / `describe`. Without a target cluster the
//! test plays the Node's part: it writes the Machine's `NodeReady` condition (what the Node
//! watch writes when a Node's Ready condition changes).

use std::time::Duration;

use e2e_tests::world::{Driver, World};
use machine_controller::resources::*;

const MINUTE: Duration = Duration::from_secs(60);

const FAST: &[&str] = &["--create-latency", "200ms", "--delete-latency", "100ms"];

const CLASS_AND_DEPLOYMENT: &str = "apiVersion: machine.driver.dev/v1alpha1
kind: MachineClass
metadata: {name: small}
spec:
  driver: fake
  providerSpec: {machineType: small}
---
apiVersion: machine.driver.dev/v1alpha1
kind: MachineDeployment
metadata: {name: web}
spec:
  replicas: 3
  template:
    spec:
      classRef: {name: small}
";

/// The health check of deployment `web`'s machines, unhealthy when Ready has been `status` for a
/// minute, remediating while at most one is unhealthy.
fn health_check(status: &str) -> String {
    format!(
        "apiVersion: machine.driver.dev/v1alpha1
kind: MachineHealthCheck
metadata: {{name: web}}
spec:
  selector:
    matchLabels: {{machine.driver.dev/deployment: web}}
  unhealthyConditions:
  - {{type: Ready, status: {status}, timeoutSeconds: 60}}
  maxUnhealthy: 1
"
    )
}

/// Writes machine `name`'s `NodeReady` condition as the Node watch would, as if it changed an
/// hour ago (retrying on conflicts with the controller's own writes).
async fn node_ready(w: &World, name: &str, ready: bool) {
    let store = w.store();
    let ns = w.ns().to_string();
    w.wait_for(&format!("NodeReady={ready} written on {name}"), MINUTE, || {
        let (store, ns) = (store.clone(), ns.clone());
        async move {
            let mut m = store.get::<Machine>(&ns, name).await.ok().flatten()?;
            let reason = if ready { Reason::NodeReady } else { Reason::NodeNotReady };
            m.status.conditions.retain(|c| c.condition_type != ConditionType::NodeReady);
            m.status.conditions.push(Condition {
                condition_type: ConditionType::NodeReady,
                status: ConditionStatus::from(ready),
                reason,
                message: String::new(),
                last_transition_time: chrono::Utc::now() - chrono::Duration::hours(1),
            });
            store.replace_status(&m).await.ok()
        }
    })
    .await;
}

/// The health check, once `f` holds for it.
async fn check_until(w: &World, what: &str, f: impl Fn(&MachineHealthCheck) -> bool) -> MachineHealthCheck {
    let store = w.store();
    let ns = w.ns().to_string();
    let f = &f;
    w.wait_for(what, MINUTE, || {
        let (store, ns) = (store.clone(), ns.clone());
        async move { store.get::<MachineHealthCheck>(&ns, "web").await.ok().flatten().filter(|h| f(h)) }
    })
    .await
}

fn remediation_allowed(h: &MachineHealthCheck) -> Option<&Condition> {
    condition(&h.status.conditions, ConditionType::RemediationAllowed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unhealthy_machines_are_replaced_unless_too_many_are() {
    let w = World::builder().driver(Driver::fake(FAST)).controller_args(&["--resync-interval", "5s"]).start().await;
    w.apply(CLASS_AND_DEPLOYMENT).await;
    w.converged("web", MINUTE).await;

    // A health check of a healthy deployment counts its machines and allows one remediation.
    w.apply(&health_check("\"False\"")).await;
    check_until(&w, "3 healthy machines, 1 remediation allowed", |h| {
        let s = &h.status;
        (s.expected_machines, s.current_healthy, s.remediations_allowed) == (3, 3, 1)
            && remediation_allowed(h).is_some_and(|c| c.status == ConditionStatus::True)
    })
    .await;
    let (code, out, err) = w.cli(&["get", "mhc"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("NAME   EXPECTED   HEALTHY   REMEDIATIONS-ALLOWED   AGE"), "{out}");
    let row: Vec<&str> = out.lines().nth(1).unwrap_or("").split_whitespace().collect();
    assert_eq!(row[..4], ["web", "3", "3", "1"], "{out}");

    // One machine's Node has not been Ready for an hour: the check marks it, and its deployment
    // replaces it (the replacement first: the default maxSurge is 1).
    let victim = w.machines().await[0].metadata.name.clone();
    node_ready(&w, &victim, false).await;
    w.wait_for("the unhealthy machine replaced", MINUTE, || async {
        let machines = w.machines().await;
        let md = w.md("web").await;
        let replaced = machines.len() == 3 && machines.iter().all(|m| m.metadata.name != victim);
        (replaced && e2e_tests::rolled_out(&md)).then_some(())
    })
    .await;
    let (code, out, err) = w.cli(&["describe", "mhc", "web"]).await;
    assert_eq!(code, 0, "{err}");
    let marked = format!("Machine {victim} is unhealthy: its Node's Ready condition has been False");
    assert!(out.contains("MachineUnhealthy") && out.contains(&marked), "{out}");
    assert!(out.contains("its MachineDeployment web remediates it"), "{out}");
    check_until(&w, "3 healthy machines again", |h| h.status.current_healthy == 3).await;

    // Two Nodes go NotReady while the check only counts Unknown; counting False then finds both
    // unhealthy at once: more than maxUnhealthy, so neither is deleted.
    w.apply(&health_check("Unknown")).await;
    let unknown_only = check_until(&w, "the Unknown-only check in force", |h| {
        h.status.observed_generation == h.metadata.generation && h.spec.unhealthy_conditions[0].status == "Unknown"
    })
    .await;
    let mut pair: Vec<String> = w.machines().await.iter().map(|m| m.metadata.name.clone()).take(2).collect();
    pair.sort();
    for name in &pair {
        node_ready(&w, name, false).await;
    }
    w.apply(&health_check("\"False\"")).await;
    let h = check_until(&w, "remediation stopped: too many unhealthy", |h| {
        h.status.observed_generation > unknown_only.metadata.generation
            && remediation_allowed(h).is_some_and(|c| c.reason == Reason::TooManyUnhealthy)
    })
    .await;
    assert_eq!(h.status.unhealthy, pair);
    assert_eq!((h.status.current_healthy, h.status.remediations_allowed), (1, 0));
    assert!(remediation_allowed(&h).is_some_and(|c| c.status == ConditionStatus::False));
    // The status was written by the pass that decided: nothing was deleted or taken, and the
    // deployment says why.
    let machines = w.machines().await;
    for name in &pair {
        let m = machines.iter().find(|m| &m.metadata.name == name).expect("still there");
        assert!(!m.is_deleting(), "{name} is being deleted");
    }
    for name in &pair {
        let m = machines.iter().find(|m| &m.metadata.name == name).expect("still there");
        assert!(!m.metadata.annotations.contains_key(ANNOTATION_DISRUPTION), "{name} was taken for remediation");
    }
    let md = w
        .wait_for("the deployment holds remediation: the short circuit", MINUTE, || async {
            let md = w.md("web").await;
            let blocked = condition(&md.status.conditions, ConditionType::DisruptionBlocked)
                .is_some_and(|c| c.status == ConditionStatus::True && c.reason == Reason::TooManyUnhealthy);
            blocked.then_some(md)
        })
        .await;
    assert!(
        md.status.disruption.held.iter().any(|h| h.reason == DisruptionReason::Remediation),
        "{:?}",
        md.status.disruption
    );
    let (_, out, _) = w.cli(&["describe", "md", "web"]).await;
    assert!(out.contains("2 Remediation: MachineHealthCheck web: 2 of 3 machines are unhealthy"), "{out}");
    let (_, out, _) = w.cli(&["describe", "mhc", "web"]).await;
    assert!(out.contains("RemediationRestricted"), "{out}");
    assert!(out.contains(&format!("Unhealthy:    {}, {}\n", pair[0], pair[1])), "{out}");

    // One Node recovers: one unhealthy is within maxUnhealthy again, and it is remediated.
    node_ready(&w, &pair[0], true).await;
    w.wait_for("the other unhealthy machine replaced", MINUTE, || async {
        let machines = w.machines().await;
        let names: Vec<&str> = machines.iter().map(|m| m.metadata.name.as_str()).collect();
        (names.contains(&pair[0].as_str()) && !names.contains(&pair[1].as_str())).then_some(())
    })
    .await;
    check_until(&w, "remediation allowed again", |h| {
        remediation_allowed(h).is_some_and(|c| c.status == ConditionStatus::True)
    })
    .await;
    w.converged("web", MINUTE).await;
}
