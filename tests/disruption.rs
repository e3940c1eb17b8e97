//! One disruption budget for every way a machine goes away, on a whole test cluster
//! (kube-apiserver, etcd, kube-controller-manager, kube-scheduler and kwok's simulated kubelets,
//! all real processes): the fake cloud's VMs register Nodes, `StopKubelet`/`StartKubelet` take a
//! Node's kubelet away and bring it back, a MachineHealthCheck marks, the owner remediates, and
//! budgets with schedules hold rollouts. Each test runs in its own cluster and namespace.

use std::time::Duration;

use e2e_tests::kube_cluster::Cluster;
use e2e_tests::watch::Most;
use e2e_tests::world::{Driver, World};
use e2e_tests::{eventually, joining, joining_class};
use fake_driver::pb as fake;
use machine_controller::resources::*;
use serde_json::{json, Value};

const MINUTE: Duration = Duration::from_secs(60);
const FAST: &[&str] = &["--create-latency", "300ms", "--delete-latency", "200ms"];

/// What these tests do besides the world's own operations.
trait Disruptions {
    async fn class(&self);
    async fn apply_md(&self, name: &str, spec: Value);
    async fn health_check(&self, timeout_seconds: u64, max_unhealthy: Value);
    async fn stop_kubelet(&self, machine: &str);
    async fn start_kubelet(&self, machine: &str);
    async fn created(&self) -> u64;
    async fn machine(&self, name: &str) -> Option<Machine>;
}

impl Disruptions for World {
    async fn class(&self) {
        let spec = json!({"driver": "fake", "providerSpec": {"machineType": "small"}});
        self.apply_object(
            "MachineClass",
            "machineclasses",
            json!({"metadata": {"name": "small"}, "spec": joining(spec)}),
        )
        .await;
    }

    /// A MachineDeployment of image `os-1` unless `spec` says otherwise (its fields merged over).
    async fn apply_md(&self, name: &str, spec: Value) {
        let mut full = json!({
            "replicas": 3,
            "template": {"spec": {"classRef": {"name": "small"}, "providerSpec": {"image": "os-1"}}},
            "strategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 1}},
        });
        for (k, v) in spec.as_object().cloned().unwrap_or_default() {
            full[k] = v;
        }
        self.apply_object("MachineDeployment", "machinedeployments", json!({"metadata": {"name": name}, "spec": full}))
            .await;
    }

    /// A health check of deployment `web`: a Node Ready False or Unknown for `timeout_seconds`.
    async fn health_check(&self, timeout_seconds: u64, max_unhealthy: Value) {
        let spec = json!({
            "selector": {"matchLabels": {"machine.driver.dev/deployment": "web"}},
            "unhealthyConditions": [
                {"type": "Ready", "status": "False", "timeoutSeconds": timeout_seconds},
                {"type": "Ready", "status": "Unknown", "timeoutSeconds": timeout_seconds},
            ],
            "maxUnhealthy": max_unhealthy,
        });
        self.apply_object(
            "MachineHealthCheck",
            "machinehealthchecks",
            json!({"metadata": {"name": "web"}, "spec": spec}),
        )
        .await;
    }

    async fn stop_kubelet(&self, machine: &str) {
        self.fake().await.stop_kubelet(fake::StopKubeletRequest { machine: machine.into() }).await.unwrap();
    }

    async fn start_kubelet(&self, machine: &str) {
        self.fake().await.start_kubelet(fake::StartKubeletRequest { machine: machine.into() }).await.unwrap();
    }

    /// Machines the fake cloud created so far.
    async fn created(&self) -> u64 {
        self.inspect().await.counters.expect("counters").machines_created
    }

    async fn machine(&self, name: &str) -> Option<Machine> {
        self.store().get::<Machine>(self.ns(), name).await.unwrap()
    }
}

/// The deployment once `f` holds for it.
async fn md_until(
    w: &World,
    what: &str,
    within: Duration,
    f: impl Fn(&MachineDeployment) -> bool,
) -> MachineDeployment {
    let f = &f;
    w.wait_for(what, within, || async move {
        let md = w.store().get::<MachineDeployment>(w.ns(), "web").await.ok().flatten()?;
        f(&md).then_some(md)
    })
    .await
}

fn blocked(md: &MachineDeployment) -> Option<&Condition> {
    condition(&md.status.conditions, ConditionType::DisruptionBlocked).filter(|c| c.status == ConditionStatus::True)
}

fn revision_of(m: &Machine) -> &str {
    m.metadata.labels.get(LABEL_REVISION).map_or("", String::as_str)
}

/// A rolling update while one machine is being remediated never has more machines unavailable
/// than `maxUnavailable`, watched at every event; the health check's machine is replaced by its
/// owner: one replacement, counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_during_a_remediation_stays_within_max_unavailable_and_replaces_once() {
    let mut w = World::on_full_cluster(FAST, "disruption").await;
    w.start_controller(&[]);
    w.class().await;
    w.apply_md("web", json!({"replicas": 4})).await;
    let before = w.converged("web", 2 * MINUTE).await;
    w.health_check(10, json!("100%")).await;
    let watch = Most::unavailable(&w, 4);
    let created = w.created().await;
    assert_eq!(created, 4);

    // A Node's kubelet stops: the health check marks its machine, its owner takes it and creates
    // its replacement first (the surge has room).
    let sick = w.machines().await[0].metadata.name.clone();
    w.stop_kubelet(&sick).await;
    eventually(MINUTE, "the sick machine taken for remediation, its replacement created", || async {
        let m = w.machine(&sick).await?;
        let marked = condition(&m.status.conditions, ConditionType::HealthCheckSucceeded)
            .is_some_and(|c| c.status == ConditionStatus::False);
        let taken = m.metadata.annotations.get(ANNOTATION_DISRUPTION).map(String::as_str) == Some("Remediation");
        (marked && taken && w.created().await == created + 1).then_some(())
    })
    .await;

    // Meanwhile a new image rolls out (the replacement, of the old image, is replaced too).
    w.apply_md("web", json!({"replicas": 4, "template": {"spec": {"classRef": {"name": "small"}, "providerSpec": {"image": "os-2"}}}}))
        .await;
    let md = md_until(&w, "the rollout complete", 4 * MINUTE, |md| {
        e2e_tests::rolled_out(md) && md.status.current_revision != before.status.current_revision
    })
    .await;
    assert!(w.machine(&sick).await.is_none(), "the sick machine is gone");
    assert!(watch.most() <= 1, "{} machines were unavailable at once (maxUnavailable 1)", watch.most());
    // One replacement for the sick machine, and four machines of the new revision: nothing
    // was created twice.
    assert_eq!(w.created().await, created + 5, "one replacement, counted once");
    assert_eq!(md.status.bad_revisions.len(), 0, "an unhealthy machine does not spend the failure budget");
    let events = w
        .store()
        .backend()
        .events(&machine_controller::store::Key::new(Kind::Machine, w.ns(), &sick), 50)
        .await
        .unwrap();
    assert_eq!(events.iter().filter(|e| e.reason == "Remediating").count(), 1, "{events:?}");
    w.assert_consistent(4).await;
    w.assert_controller_never_forbidden();
    w.kill9().await;
}

/// Three of five Nodes NotReady at once with `maxUnhealthy: 40%`: nothing is remediated, the
/// short circuit shows on the health check and the deployment, and all is well again when they
/// return.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_of_five_nodes_down_short_circuit_remediation_until_they_return() {
    let mut w = World::on_full_cluster(FAST, "disruption").await;
    w.start_controller(&[]);
    w.class().await;
    w.apply_md("web", json!({"replicas": 5})).await;
    w.converged("web", 2 * MINUTE).await;
    let created = w.created().await;
    let names: Vec<String> = w.machines().await.iter().map(|m| m.metadata.name.clone()).collect();
    let down = &names[..3];
    for name in down {
        w.stop_kubelet(name).await;
    }
    // "At once": the check comes once all three Nodes have been not Ready for longer than its
    // timeout, so it sees three unhealthy machines in its first pass. (The kubelets stop one
    // after the other and the Nodes turn Unknown seconds apart; a check already in place could
    // find one of them unhealthy alone, within its budget, and rightly remediate it.)
    let timeout = 8;
    eventually(2 * MINUTE, "the three Nodes not Ready for longer than the check's timeout", || async {
        for name in down {
            let m = w.machine(name).await?;
            let ready = condition(&m.status.conditions, ConditionType::NodeReady)?;
            let age = chrono::Utc::now() - ready.last_transition_time;
            (ready.status != ConditionStatus::True && age.num_seconds() > timeout + 1).then_some(())?;
        }
        Some(())
    })
    .await;
    w.health_check(timeout as u64, json!("40%")).await;
    let ns = w.ns().to_string();
    let store = w.store();
    let check = w
        .wait_for("the short circuit, with all three unhealthy", 2 * MINUTE, || {
            let (store, ns) = (store.clone(), ns.clone());
            async move {
                let h = store.get::<MachineHealthCheck>(&ns, "web").await.ok().flatten()?;
                let c = condition(&h.status.conditions, ConditionType::RemediationAllowed)?;
                (c.reason == Reason::TooManyUnhealthy && h.status.unhealthy.len() == 3).then_some(h)
            }
        })
        .await;
    assert_eq!((check.status.expected_machines, check.status.current_healthy), (5, 2));
    md_until(&w, "the deployment holds the remediation of all three", MINUTE, |md| {
        blocked(md).is_some_and(|c| c.reason == Reason::TooManyUnhealthy)
            && md.status.disruption.held.iter().any(|h| h.reason == DisruptionReason::Remediation && h.machines == 3)
    })
    .await;
    let (_, out, _) = w.cli(&["describe", "md", "web", "-n", w.ns()]).await;
    assert!(out.contains("3 Remediation: MachineHealthCheck web: 3 of 5 machines are unhealthy"), "{out}");
    for m in w.machines().await {
        assert!(
            !m.is_deleting() && !m.metadata.annotations.contains_key(ANNOTATION_DISRUPTION),
            "{} was taken",
            m.metadata.name
        );
    }
    // They return: healthy again, nothing was remediated. (The kubelets come back one after
    // another: with two of five still down, 40% allows remediation, and the check would rightly
    // take them. A longer timeout first makes the return count as one.)
    w.health_check(600, json!("40%")).await;
    w.wait_for("the check with its longer timeout finding none unhealthy", MINUTE, || {
        let (store, ns) = (store.clone(), ns.clone());
        async move {
            let h = store.get::<MachineHealthCheck>(&ns, "web").await.ok().flatten()?;
            h.status.unhealthy.is_empty().then_some(())
        }
    })
    .await;
    for name in down {
        w.start_kubelet(name).await;
    }
    w.wait_for("every machine healthy again", 2 * MINUTE, || {
        let (store, ns) = (store.clone(), ns.clone());
        async move {
            let h = store.get::<MachineHealthCheck>(&ns, "web").await.ok().flatten()?;
            let allowed = condition(&h.status.conditions, ConditionType::RemediationAllowed)?;
            (allowed.status == ConditionStatus::True && h.status.current_healthy == 5).then_some(())
        }
    })
    .await;
    md_until(&w, "the deployment no longer blocked", MINUTE, |md| blocked(md).is_none()).await;
    assert_eq!(w.created().await, created, "nothing was replaced");
    assert_eq!(w.machines().await.len(), 5);
    w.assert_controller_never_forbidden();
    w.kill9().await;
}

/// With the embedded store and `--target-kubeconfig`: the target cluster's API server freezes
/// for longer than the health timeout and comes back. A machine whose Node went down just before
/// is not remediated at once on its return (the timers start over), nor is any other; its
/// kubelet returns within the new timeout, and nothing is remediated at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_of_the_target_cluster_restarts_the_health_timers() {
    let cluster = Cluster::start_full().await;
    let kubeconfig = cluster.kubeconfig.to_string_lossy().into_owned();
    let mut args = FAST.to_vec();
    args.extend(["--join-cluster", &kubeconfig]);
    let timeout = 30;
    let mut w = World::builder()
        .driver(Driver::fake(&args))
        .controller_args(&["--target-kubeconfig", &kubeconfig, "--resync-interval", "5s"])
        .manifest(&format!(
            "{}---
apiVersion: machine.driver.dev/v1alpha1
kind: MachineDeployment
metadata: {{name: web}}
spec:
  replicas: 3
  template: {{spec: {{classRef: {{name: small}}}}}}
---
apiVersion: machine.driver.dev/v1alpha1
kind: MachineHealthCheck
metadata: {{name: web}}
spec:
  selector: {{matchLabels: {{machine.driver.dev/deployment: web}}}}
  unhealthyConditions:
  - {{type: Ready, status: \"False\", timeoutSeconds: {timeout}}}
  - {{type: Ready, status: Unknown, timeoutSeconds: {timeout}}}
",
            joining_class("small", "{machineType: small}")
        ))
        .start()
        .await;
    w.converged("web", 2 * MINUTE).await;
    let created = w.created().await;
    let sick = w.machines().await[0].metadata.name.clone();
    w.stop_kubelet(&sick).await;
    eventually(MINUTE, "the sick machine's Node seen not Ready", || async {
        let m = w.machine(&sick).await?;
        condition(&m.status.conditions, ConditionType::NodeReady).filter(|c| c.status != ConditionStatus::True)?;
        Some(())
    })
    .await;
    // The target cluster freezes for longer than the timeout (and than the 30 s that make an
    // outage). Without the reset its timer would have run out on the return.
    cluster.pause_apiserver();
    tokio::time::sleep(Duration::from_secs(50)).await; // Deliberate: the outage itself.
    cluster.resume_apiserver();
    w.wait_for("the controller sees the target cluster again", MINUTE, || async {
        let log = w.controller_log(0);
        log.contains("the target cluster was unreachable for").then_some(())
    })
    .await;
    // Its timer started over: it would be due `timeout` after the return. Its kubelet is back
    // before that.
    w.start_kubelet(&sick).await;
    eventually(MINUTE, "the sick machine's Node Ready again", || async {
        let m = w.machine(&sick).await?;
        condition(&m.status.conditions, ConditionType::NodeReady).filter(|c| c.status == ConditionStatus::True)?;
        Some(())
    })
    .await;
    let store = w.store();
    let check = store.get::<MachineHealthCheck>(w.ns(), "web").await.unwrap().expect("the health check");
    assert!(check.status.unhealthy.is_empty(), "{:?}", check.status);
    assert_eq!(w.created().await, created, "nothing was remediated");
    for m in w.machines().await {
        assert!(
            !m.is_deleting() && !m.metadata.annotations.contains_key(ANNOTATION_DISRUPTION),
            "{} was taken",
            m.metadata.name
        );
    }
    w.kill9().await;
}

/// The minute and hour it is now in a fixed-offset zone (`Etc/GMT-3` is UTC+3: the IANA names
/// count the other way), and the seconds into this minute.
fn now_in_utc_plus_3() -> (u32, u32, u32) {
    use chrono::Timelike;
    let t = chrono::Utc::now() + chrono::Duration::hours(3);
    (t.minute(), t.hour(), t.second())
}

/// Budgets: `machines: 0` holds a rollout (and survives a kill -9 of the controller); one naming
/// only `Remediation` does not; a scheduled freeze holds it until its window closes, then it
/// proceeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budgets_hold_rollouts_until_they_allow_them() {
    let mut w = World::on_full_cluster(FAST, "disruption").await;
    w.start_controller(&[]);
    w.class().await;
    let image = |i: &str| json!({"spec": {"classRef": {"name": "small"}, "providerSpec": {"image": i}}});
    let freeze = json!({"budgets": [{"machines": 0}]});
    w.apply_md("web", json!({"replicas": 2, "disruption": freeze})).await;
    let first = w.converged("web", 2 * MINUTE).await;
    let created = w.created().await;

    // A new image under `machines: 0`: the surge machine comes, no old one goes.
    w.apply_md("web", json!({"replicas": 2, "disruption": freeze, "template": image("os-2")})).await;
    let held = md_until(&w, "the rollout held by the budget", 2 * MINUTE, |md| {
        md.status.available_replicas == 1 && blocked(md).is_some_and(|c| c.reason == Reason::BudgetExhausted)
    })
    .await;
    assert!(
        held.status.disruption.held.iter().any(|h| h.reason == DisruptionReason::Rollout),
        "{:?}",
        held.status.disruption
    );
    let (_, out, _) = w.cli(&["describe", "md", "web", "-n", w.ns()]).await;
    assert!(
        out.contains("[0] 0 machine(s) for Rollout, InPlaceUpdate, Rebalance, Autoscaler: active, allows 0 now"),
        "{out}"
    );
    assert!(out.contains("DisruptionBlocked"), "{out}");

    // kill -9 of the controller while it holds: the new one holds the same, deletes nothing and
    // creates nothing twice.
    w.kill9().await;
    w.start_controller(&[]);
    eventually(MINUTE, "the new controller at work", || async {
        w.controller_log(1).contains("running").then_some(())
    })
    .await;
    md_until(&w, "still held", MINUTE, |md| {
        md.status.observed_generation == md.metadata.generation && blocked(md).is_some()
    })
    .await;
    let old: Vec<Machine> =
        w.machines().await.into_iter().filter(|m| revision_of(m) == first.status.current_revision).collect();
    assert_eq!(old.len(), 2, "no old machine went");
    assert!(old.iter().all(|m| !m.is_deleting()));
    assert_eq!(w.created().await, created + 1, "one surge machine, created once");

    // A budget that names only Remediation does not hold a rollout: it completes.
    let remediation_only = json!({"budgets": [{"machines": 0, "reasons": ["Remediation"]}]});
    w.apply_md("web", json!({"replicas": 2, "disruption": remediation_only, "template": image("os-2")})).await;
    let second = md_until(&w, "the rollout complete", 3 * MINUTE, |md| {
        e2e_tests::rolled_out(md) && md.status.current_revision != first.status.current_revision
    })
    .await;
    assert!(blocked(&second).is_none());

    // A freeze window, open now in UTC+3, closing about 40 s from now: the next rollout waits
    // for it to close, then proceeds.
    let (minute, hour, second_now) = now_in_utc_plus_3();
    let window = json!({"budgets": [{
        "machines": 0,
        "schedule": format!("{minute} {hour} * * *"),
        "duration": format!("{}s", second_now + 40),
        "timeZone": "Etc/GMT-3",
    }]});
    w.apply_md("web", json!({"replicas": 2, "disruption": window, "template": image("os-3")})).await;
    let held = md_until(&w, "the rollout held by the open freeze window", 2 * MINUTE, |md| {
        md.status.observed_generation == md.metadata.generation
            && blocked(md).is_some()
            && md.status.disruption.budgets.first().is_some_and(|b| b.active && b.closes.is_some())
    })
    .await;
    let closes = held.status.disruption.budgets[0].closes.expect("when the window closes");
    let done = md_until(&w, "the rollout complete after the window", 3 * MINUTE, |md| {
        e2e_tests::rolled_out(md) && md.status.current_revision != second.status.current_revision
    })
    .await;
    let retired: Vec<_> = w
        .store()
        .backend()
        .events(&machine_controller::store::Key::new(Kind::MachineDeployment, w.ns(), "web"), 50)
        .await
        .unwrap();
    let complete = retired
        .iter()
        .filter(|e| e.reason == "RolloutComplete")
        .map(|e| e.time)
        .max()
        .expect("a RolloutComplete event");
    assert!(complete >= closes, "completed at {complete}, before the window closed at {closes}");
    assert!(blocked(&done).is_none());
    w.kill9().await;
}

/// kill -9 of the controller in the middle of a remediation: the sick machine's drain is held by
/// a PodDisruptionBudget when the controller dies; the new one resumes the same drain with the
/// same deadline, and the machine is replaced once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remediation_resumes_after_kill_9_with_its_deadline_and_one_replacement() {
    let mut w = World::on_full_cluster(FAST, "disruption").await;
    w.start_controller(&[]);
    w.class().await;
    // maxSurge 0: the sick machine goes first (its drain), then its replacement comes.
    let spec = json!({
        "replicas": 2,
        "strategy": {"rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
        "drainTimeoutSeconds": 30,
    });
    w.apply_md("web", spec).await;
    w.converged("web", 2 * MINUTE).await;
    w.workload("db", 2, Some(json!({"minAvailable": 2}))).await;
    w.health_check(5, json!("100%")).await;
    let created = w.created().await;
    // The sick machine is one that runs a pod of the budget (the spread is only preferred).
    let db_node = w.ready_pods("db").await[0].spec.as_ref().and_then(|s| s.node_name.clone());
    let machines = w.machines().await;
    let sick = machines
        .iter()
        .find(|m| m.status.node_ref.as_ref().map(|r| &r.name) == db_node.as_ref())
        .unwrap_or_else(|| panic!("no machine runs a db pod (on {db_node:?})"))
        .metadata
        .name
        .clone();
    w.stop_kubelet(&sick).await;
    let first = eventually(2 * MINUTE, "the remediated machine's drain held by the budget", || async {
        let m = w.machine(&sick).await?;
        let d = m.status.deletion.clone()?;
        let taken = m.metadata.annotations.get(ANNOTATION_DISRUPTION).map(String::as_str) == Some("Remediation");
        (taken && d.phase == DeletionPhase::Draining && !d.blocked_by.is_empty()).then_some(d)
    })
    .await;
    w.kill9().await;
    w.start_controller(&[]);
    let resumed = eventually(MINUTE, "the new process at work on the same drain", || async {
        let m = w.machine(&sick).await?;
        let d = m.status.deletion.clone()?;
        (w.controller_log(1).contains("running") && d.phase == DeletionPhase::Draining).then_some(d)
    })
    .await;
    assert_eq!(resumed.drain_started, first.drain_started, "the drain did not start over");
    assert_eq!(resumed.drain_deadline, first.drain_deadline, "the deadline did not move");
    w.converged("web", 3 * MINUTE).await;
    assert!(w.machine(&sick).await.is_none());
    assert_eq!(w.created().await, created + 1, "one replacement");
    w.assert_consistent(2).await;
    w.kill9().await;
}

/// A strategy with a canary of one machine paused `pause` seconds (maxSurge 1, maxUnavailable 1).
fn canary_strategy(pause: u64) -> Value {
    json!({"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 1, "canary": {"machines": 1, "pauseSeconds": pause}}})
}

fn image(image: &str, kubelet: Option<&str>) -> Value {
    let mut provider = json!({"image": image});
    if let Some(k) = kubelet {
        provider["kubelet"] = json!(k);
    }
    json!({"spec": {"classRef": {"name": "small"}, "providerSpec": provider}})
}

fn canary_phase(md: &MachineDeployment) -> Option<CanaryPhase> {
    md.status.canary.as_ref().map(|k| k.phase)
}

fn names_of(machines: &[Machine]) -> std::collections::BTreeSet<String> {
    machines.iter().map(|m| m.metadata.name.clone()).collect()
}

/// A canary of 1 whose Node never joins: the machine fails with NodeNotJoined, the rollout is
/// aborted at once (with a failure budget of 3), the revision remembered as bad, and only the
/// canary machine was ever touched: the old machines are the same three, never deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_whose_node_never_joins_aborts_the_rollout_touching_only_it() {
    let mut w = World::on_full_cluster(FAST, "disruption").await;
    w.start_controller(&[]);
    w.class().await;
    // Nodes that join get a minute (a loaded machine can take more than 3 s to make one Ready);
    // those that never join, 3 s. A Machine keeps what it was created with.
    let spec = |template: Value| {
        let startup = if template.to_string().contains("NeverJoins") { 3 } else { 60 };
        json!({"replicas": 3, "strategy": canary_strategy(5), "nodeStartupTimeoutSeconds": startup, "template": template})
    };
    w.apply_md("web", spec(image("os-1", None))).await;
    let good = w.converged("web", 2 * MINUTE).await;
    let before = names_of(&w.machines().await);
    let created = w.created().await;

    w.apply_md("web", spec(image("os-2", Some("NeverJoins")))).await;
    let aborted = md_until(&w, "the canary failed and the rollout aborted", 3 * MINUTE, |md| {
        canary_phase(md) == Some(CanaryPhase::Failed) && !md.status.bad_revisions.is_empty()
    })
    .await;
    let canary = aborted.status.canary.clone().unwrap();
    assert_eq!(canary.machines.len(), 1, "{canary:?}");
    assert!(canary.message.contains("NODE_NOT_JOINED"), "{canary:?}");
    let bad = &aborted.status.bad_revisions[0];
    assert_eq!(bad.revision, canary.revision);
    assert!(bad.reason.contains(&canary.machines[0]), "{bad:?}");
    // (Aborted, or already rolling back: either way the failed canary is shown.)
    let (_, out, err) = w.cli(&["rollout", "status", "web", "-n", w.ns(), "--no-watch"]).await;
    assert!(out.contains(&format!("canary of revision {}: Failed, 1 of 1 machine(s)", canary.revision)), "{out}");
    eprintln!("rollout status of the failed canary:\n{out}{err}");

    let back = md_until(&w, "rolled back", 3 * MINUTE, |md| {
        e2e_tests::rolled_out(md) && md.status.target_revision == good.status.target_revision
    })
    .await;
    assert_eq!(back.status.bad_revisions.len(), 1);
    assert_eq!(names_of(&w.machines().await), before, "the old machines are the same");
    assert_eq!(w.created().await, created + 1, "only the canary machine was made");
    // Remembered: the bad revision is not tried again.
    assert_eq!(canary_phase(&back), Some(CanaryPhase::Failed));
    w.kill9().await;
}

/// The MachineHealthCheck events of deployment `web`'s check.
async fn health_check_events(w: &World) -> Vec<machine_controller::store::Event> {
    let key = machine_controller::store::Key::new(Kind::MachineHealthCheck, w.ns(), "web");
    w.store().backend().events(&key, 100).await.unwrap()
}

/// A revision whose Nodes never join, under a MachineHealthCheck whose Ready timeout (2 s) is far
/// shorter than the node-startup timeout (8 s): a machine without a Node is not unhealthy — it
/// has not joined, and its own clock judges it — so the check marks none of them, each fails
/// NODE_NOT_JOINED (its revision's failure), and the failure budget (2) aborts the rollout: two
/// machines of the bad revision, no churn, then the rollback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_that_never_join_spend_the_failure_budget_under_a_faster_health_check() {
    let mut w = World::on_full_cluster(FAST, "disruption").await;
    w.start_controller(&[]);
    w.class().await;
    w.health_check(2, json!("100%")).await;
    let spec = |template: Value| {
        let startup = if template.to_string().contains("NeverJoins") { 8 } else { 60 };
        json!({"replicas": 3, "failureBudget": 2, "nodeStartupTimeoutSeconds": startup, "template": template})
    };
    w.apply_md("web", spec(image("os-1", None))).await;
    let good = w.converged("web", 2 * MINUTE).await;
    let created = w.created().await;

    w.apply_md("web", spec(image("os-2", Some("NeverJoins")))).await;
    let aborted = md_until(&w, "the rollout aborted", 3 * MINUTE, |md| !md.status.bad_revisions.is_empty()).await;
    let bad = &aborted.status.bad_revisions[0];
    assert!(bad.reason.starts_with("2 machines of revision"), "{bad:?}");
    md_until(&w, "rolled back", 3 * MINUTE, |md| {
        e2e_tests::rolled_out(md) && md.status.target_revision == good.status.target_revision
    })
    .await;
    assert_eq!(w.created().await, created + 2 + 1, "two machines of the bad revision and one to roll back");
    let events = health_check_events(&w).await;
    let by_node =
        |e: &&machine_controller::store::Event| e.reason == "MachineUnhealthy" && e.message.contains("Node's Ready");
    assert!(!events.iter().any(|e| by_node(&e)), "a machine without a Node was marked by its Node: {events:?}");
    w.kill9().await;
}

/// The same with a canary: the canary machine fails NODE_NOT_JOINED under the faster health
/// check, and the rollout is aborted at once — one machine of the bad revision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_whose_node_never_joins_is_aborted_at_once_under_a_faster_health_check() {
    let mut w = World::on_full_cluster(FAST, "disruption").await;
    w.start_controller(&[]);
    w.class().await;
    w.health_check(2, json!("100%")).await;
    let spec = |template: Value| {
        let startup = if template.to_string().contains("NeverJoins") { 8 } else { 60 };
        json!({"replicas": 3, "strategy": canary_strategy(5), "nodeStartupTimeoutSeconds": startup, "template": template})
    };
    w.apply_md("web", spec(image("os-1", None))).await;
    w.converged("web", 2 * MINUTE).await;
    let before = names_of(&w.machines().await);
    let created = w.created().await;

    w.apply_md("web", spec(image("os-2", Some("NeverJoins")))).await;
    let aborted = md_until(&w, "the canary failed and the rollout aborted", 3 * MINUTE, |md| {
        canary_phase(md) == Some(CanaryPhase::Failed) && !md.status.bad_revisions.is_empty()
    })
    .await;
    let canary = aborted.status.canary.clone().unwrap();
    assert!(canary.message.contains("NODE_NOT_JOINED"), "{canary:?}");
    assert_eq!(w.created().await, created + 1, "only the canary machine was made");
    assert!(names_of(&w.machines().await).is_superset(&before), "no old machine went");
    let events = health_check_events(&w).await;
    let by_node =
        |e: &&machine_controller::store::Event| e.reason == "MachineUnhealthy" && e.message.contains("Node's Ready");
    assert!(!events.iter().any(|e| by_node(&e)), "a machine without a Node was marked by its Node: {events:?}");
    // `rollout status` says aborted, watching or not, before and after the rollback.
    let (code, out, err) = w.cli(&["rollout", "status", "web", "-n", w.ns(), "--no-watch"]).await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("aborted"), "{err}");
    w.converged("web", 2 * MINUTE).await;
    let (code, out, err) = w.cli(&["rollout", "status", "web", "-n", w.ns(), "--no-watch"]).await;
    assert_eq!(code, 1, "after the rollback too: {out}{err}");
    assert!(err.contains("aborted") && err.contains("failed"), "{err}");
    w.kill9().await;
}

/// A healthy canary: one machine of the new revision, then a pause of `pauseSeconds` during which
/// no old machine goes (and which survives a kill -9 of the controller); `rollout pause` holds the
/// rollout after the canary passed, `rollout resume` lets it finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_canary_pauses_then_the_rollout_finishes_and_the_cli_pauses_and_resumes_it() {
    let mut w = World::on_full_cluster(FAST, "disruption").await;
    w.start_controller(&[]);
    w.class().await;
    let spec = |template: Value| json!({"replicas": 3, "strategy": canary_strategy(20), "template": template});
    w.apply_md("web", spec(image("os-1", None))).await;
    let first = w.converged("web", 2 * MINUTE).await;
    let before = names_of(&w.machines().await);

    w.apply_md("web", spec(image("os-2", None))).await;
    let pausing = md_until(&w, "the canary pausing", 2 * MINUTE, |md| {
        md.status.observed_generation == md.metadata.generation && canary_phase(md) == Some(CanaryPhase::Pausing)
    })
    .await;
    let canary = pausing.status.canary.clone().unwrap();
    let (code, out, err) = w.cli(&["rollout", "status", "web", "-n", w.ns(), "--no-watch"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let line = format!("canary of revision {}: Pausing, 1 of 1 machine(s) ({})", canary.revision, canary.machines[0]);
    assert!(out.contains(&line) && out.contains("s of pause left"), "{out}");
    eprintln!("rollout status of the pausing canary:\n{out}");
    let (_, described, _) = w.cli(&["describe", "md", "web", "-n", w.ns()]).await;
    assert!(described.contains(&format!("Canary:       revision {} Pausing", canary.revision)), "{described}");
    assert!(described.contains("Pause until:"), "{described}");
    eprintln!("describe of the pausing canary:\n{described}");
    let machines = w.machines().await;
    let old: Vec<&Machine> = machines.iter().filter(|m| before.contains(&m.metadata.name)).collect();
    assert_eq!(old.len(), 3);
    assert!(old.iter().all(|m| !m.is_deleting()), "no old machine goes during the canary");

    // kill -9 of the controller during the pause: the new one resumes the same pause.
    w.kill9().await;
    w.start_controller(&[]);
    let resumed = md_until(&w, "the new controller on the same pause", MINUTE, |md| {
        w.controller_log(1).contains("running")
            && md.status.canary.as_ref().is_some_and(|k| k.phase != CanaryPhase::Progressing)
    })
    .await;
    let k = resumed.status.canary.clone().unwrap();
    assert_eq!(k.ready_since, canary.ready_since, "the pause did not start over");

    // Paused from the CLI: the canary passes, nothing else moves.
    let (code, out, err) = w.cli(&["rollout", "pause", "web", "-n", w.ns()]).await;
    assert_eq!((code, out.trim()), (0, "machinedeployment web paused"), "{err}");
    let passed = md_until(&w, "the canary passed while paused", MINUTE, |md| {
        md.spec.paused
            && md.status.observed_generation == md.metadata.generation
            && canary_phase(md) == Some(CanaryPhase::Passed)
    })
    .await;
    let machines = w.machines().await;
    assert_eq!(machines.iter().filter(|m| before.contains(&m.metadata.name) && !m.is_deleting()).count(), 3);
    assert_eq!(machines.len(), 4, "the canary machine and the old three");
    let (_, out, _) = w.cli(&["rollout", "status", "web", "-n", w.ns(), "--no-watch"]).await;
    assert!(out.contains("Passed") && out.contains("paused: "), "{out}");
    eprintln!("rollout status, paused after the canary:\n{out}");

    // Resumed: the rollout goes on and finishes.
    let (code, out, err) = w.cli(&["rollout", "resume", "web", "-n", w.ns()]).await;
    assert_eq!((code, out.trim()), (0, "machinedeployment web resumed"), "{err}");
    let (code, out, err) = w.cli(&["rollout", "status", "web", "-n", w.ns(), "--timeout", "3m"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("successfully rolled out"), "{out}");
    eprintln!("rollout status after the resume:\n{out}");
    let done = w.converged("web", MINUTE).await;
    assert_ne!(done.status.current_revision, first.status.current_revision);
    assert_eq!(canary_phase(&done), Some(CanaryPhase::Passed));
    assert!(names_of(&w.machines().await).is_disjoint(&before), "every old machine replaced");
    let events = w
        .store()
        .backend()
        .events(&machine_controller::store::Key::new(Kind::MachineDeployment, w.ns(), "web"), 50)
        .await
        .unwrap();
    let passed_at = events.iter().find(|e| e.reason == "CanaryPassed").map(|e| e.time).expect("a CanaryPassed event");
    assert!(passed_at >= passed.status.canary.unwrap().pause_until.unwrap(), "passed only after the pause");
    w.kill9().await;
}
