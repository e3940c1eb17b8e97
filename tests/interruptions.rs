//! The cloud's own moves, end to end on a whole test cluster (kube-apiserver, etcd,
//! kube-controller-manager, kube-scheduler and kwok's simulated kubelets, all real processes)
//! with the fake driver as a real sidecar process: the fake cloud injects an event
//! (`fakecloud.v1.FakeCloud/InjectEvent`), streams it over `machinedriver.v1.Events`, and acts
//! on it (a spot interruption takes the VM at its deadline if it still exists, a termination
//! removes it at once); the controller records it on the Machine, acknowledges it, drains before
//! the deadline and replaces the machine beside the surge. Each test runs in its own cluster.

use std::time::Duration;

use e2e_tests::world::World;
use e2e_tests::{eventually, joining};
use fake_driver::pb as fake;
use machine_controller::resources::*;
use serde_json::{json, Value};

const MINUTE: Duration = Duration::from_secs(60);
const FAST: &[&str] = &["--create-latency", "300ms", "--delete-latency", "200ms"];
/// The notice a test's spot interruption gives (AWS gives two minutes).
const NOTICE: Duration = Duration::from_secs(20);

trait Interruptions {
    async fn spot_class(&self);
    async fn apply_md(&self, spec: Value);
    async fn inject(&self, machine: &str, kind: &str, notice: Option<Duration>) -> String;
    async fn machine(&self, name: &str) -> Option<Machine>;
    async fn counters(&self) -> fake::Counters;
    async fn events_of(&self, machine: &str) -> Vec<machine_controller::store::Event>;
    async fn machine_with_pod(&self, app: &str) -> String;
}

impl Interruptions for World {
    async fn spot_class(&self) {
        let spec = json!({"driver": "fake", "providerSpec": {"machineType": "small", "capacityType": "spot"}});
        self.apply_object(
            "MachineClass",
            "machineclasses",
            json!({"metadata": {"name": "spot"}, "spec": joining(spec)}),
        )
        .await;
    }

    /// Deployment `web` of the spot class (its fields merged over 3 replicas, maxSurge 1,
    /// maxUnavailable 0).
    async fn apply_md(&self, spec: Value) {
        let mut full = json!({
            "replicas": 3,
            "template": {"spec": {"classRef": {"name": "spot"}, "providerSpec": {"image": "os-1"}}},
            "strategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        });
        for (k, v) in spec.as_object().cloned().unwrap_or_default() {
            full[k] = v;
        }
        self.apply_object(
            "MachineDeployment",
            "machinedeployments",
            json!({"metadata": {"name": "web"}, "spec": full}),
        )
        .await;
    }

    async fn inject(&self, machine: &str, kind: &str, notice: Option<Duration>) -> String {
        let notice = notice.map(|d| driver_sdk::prost_types::Duration { seconds: d.as_secs() as i64, nanos: 0 });
        let req = fake::InjectEventRequest {
            machine: machine.into(),
            kind: kind.into(),
            notice,
            message: "injected by the test".into(),
        };
        self.fake().await.inject_event(req).await.unwrap().into_inner().event_id
    }

    async fn machine(&self, name: &str) -> Option<Machine> {
        self.store().get::<Machine>(self.ns(), name).await.unwrap()
    }

    async fn counters(&self) -> fake::Counters {
        self.inspect().await.counters.expect("counters")
    }

    async fn events_of(&self, machine: &str) -> Vec<machine_controller::store::Event> {
        let key = machine_controller::store::Key::new(Kind::Machine, self.ns(), machine);
        self.store().backend().events(&key, 100).await.unwrap()
    }

    /// A machine whose Node runs a pod of `app`.
    async fn machine_with_pod(&self, app: &str) -> String {
        let node = self.ready_pods(app).await[0].spec.as_ref().and_then(|s| s.node_name.clone());
        let machines = self.machines().await;
        let m = machines
            .iter()
            .find(|m| m.status.node_ref.as_ref().map(|r| &r.name) == node.as_ref())
            .unwrap_or_else(|| panic!("no machine runs a pod of {app} (on {node:?})"));
        m.metadata.name.clone()
    }
}

fn reasons(events: &[machine_controller::store::Event]) -> Vec<&str> {
    events.iter().map(|e| e.reason.as_str()).collect()
}

/// A spot interruption with a 20 s notice on a node running pods under a PodDisruptionBudget:
/// recorded on the Machine, the node drained (its pods evicted, the budget honoured) and the
/// machine deleted before the deadline, its replacement created at once beside the surge and
/// Ready before the deadline; the fake cloud never had to take the VM itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spot_interruption_is_drained_and_replaced_before_its_deadline() {
    let mut w = World::on_full_cluster(FAST, "interrupt").await;
    w.start_controller(&[]);
    w.spot_class().await;
    // maxSurge 0: the replacement goes beside the surge, or not at all.
    w.apply_md(json!({"strategy": {"rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}})).await;
    w.converged("web", 2 * MINUTE).await;
    w.workload("db", 3, Some(json!({"minAvailable": 2}))).await;
    let created = w.counters().await.machines_created;
    let victim = w.machine_with_pod("db").await;
    let event_id = w.inject(&victim, "SPOT_INTERRUPTION", Some(NOTICE)).await;

    let m = eventually(MINUTE, "the interruption recorded and the machine's drain begun", || async {
        let m = w.machine(&victim).await?;
        let d = m.status.deletion.as_ref()?;
        (m.status.interruption.is_some() && d.drain_deadline.is_some()).then_some(m)
    })
    .await;
    let i = m.status.interruption.clone().unwrap();
    assert_eq!(i.kind, InterruptionKind::SpotInterruption);
    assert_eq!(i.event_id, event_id);
    assert_eq!(i.action, "Terminate");
    assert_eq!(i.offering.as_ref().map(|o| o.capacity_type.as_str()), Some("spot"));
    let not_before = i.not_before.expect("a deadline");
    let deadline = m.status.deletion.as_ref().and_then(|d| d.drain_deadline).unwrap();
    assert_eq!(not_before - deadline, chrono::Duration::seconds(5), "the drain ends 5 s before the cloud acts");

    // The replacement, created at once (maxSurge 0 does not hold it), Ready; the victim gone.
    eventually(MINUTE, "the interrupted machine deleted", || async {
        w.machine(&victim).await.is_none().then_some(())
    })
    .await;
    w.converged("web", 2 * MINUTE).await;
    assert_eq!(w.counters().await.machines_created, created + 1, "one replacement");
    w.assert_consistent(3).await;
    let c = w.counters().await;
    assert_eq!(c.machines_reclaimed, 0, "the cloud had to take the VM itself: the deadline was missed");

    let events = w.events_of(&victim).await;
    let drained = events.iter().find(|e| e.reason == "Drained").unwrap_or_else(|| panic!("{:?}", reasons(&events)));
    assert!(drained.message.contains("before the SpotInterruption deadline"), "{}", drained.message);
    assert!(!reasons(&events).contains(&"DrainForced"), "time allowed evictions: {:?}", reasons(&events));
    assert!(reasons(&events).contains(&"Interrupted"), "{:?}", reasons(&events));
    let replacement = w
        .machines()
        .await
        .into_iter()
        .find(|m| m.metadata.annotations.contains_key(ANNOTATION_REPLACES_INTERRUPTION))
        .expect("the replacement carries its annotation");
    let value = &replacement.metadata.annotations[ANNOTATION_REPLACES_INTERRUPTION];
    assert!(value.starts_with(&format!("{victim}/SpotInterruption/")), "{value}");
    let ready = eventually(MINUTE, "the replacement's InterruptionReplaced event", || async {
        w.events_of(&replacement.metadata.name).await.into_iter().find(|e| e.reason == "InterruptionReplaced")
    })
    .await;
    assert!(ready.message.contains("before the deadline"), "{}", ready.message);
    // Every pod of the workload runs again.
    eventually(MINUTE, "3 db pods Ready", || async { (w.ready_pods("db").await.len() == 3).then_some(()) }).await;
    w.kill9().await;
}

/// Three of six machines interrupted at once under a disruption budget of 0 machines (for every
/// reason a budget can name): all three handled at once, none held, six machines again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_of_six_interrupted_under_a_budget_of_zero_are_all_handled() {
    let mut w = World::on_full_cluster(FAST, "interrupt").await;
    w.start_controller(&[]);
    w.spot_class().await;
    let budget = json!({"budgets": [{"machines": 0, "reasons": ["Rollout", "ScaleDown", "Remediation", "Rebalance"]}]});
    w.apply_md(json!({"replicas": 6, "disruption": budget})).await;
    w.converged("web", 3 * MINUTE).await;
    let created = w.counters().await.machines_created;
    let victims: Vec<String> = w.machines().await.iter().take(3).map(|m| m.metadata.name.clone()).collect();
    for v in &victims {
        w.inject(v, "SPOT_INTERRUPTION", Some(NOTICE)).await;
    }
    eventually(2 * MINUTE, "the three interrupted machines gone and six Running", || async {
        let machines = w.machines().await;
        let gone = victims.iter().all(|v| !machines.iter().any(|m| &m.metadata.name == v));
        let running = machines.iter().filter(|m| m.status.phase == Phase::Running).count();
        (gone && running == 6).then_some(())
    })
    .await;
    assert_eq!(w.counters().await.machines_created, created + 3, "one replacement each");
    assert_eq!(w.counters().await.machines_reclaimed, 0);
    let md = w.md("web").await;
    let held = md.status.disruption.held.iter().any(|h| h.reason == DisruptionReason::Interruption);
    assert!(!held, "an interruption is never held: {:?}", md.status.disruption);
    w.assert_consistent(6).await;
    w.kill9().await;
}

/// A VM terminated behind the controller's back: its Node out of service and the machine
/// replaced within seconds, not after a health timeout (600 s here) or the node-startup timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_terminated_out_of_band_is_replaced_at_once() {
    let mut w = World::on_full_cluster(FAST, "interrupt").await;
    w.start_controller(&[]);
    w.spot_class().await;
    w.apply_md(json!({"replicas": 2, "healthTimeoutSeconds": 600, "nodeStartupTimeoutSeconds": 600})).await;
    w.converged("web", 2 * MINUTE).await;
    w.workload("db", 2, None).await;
    let victim = w.machine_with_pod("db").await;
    let node = w.machine(&victim).await.unwrap().status.node_ref.unwrap().name;
    let started = std::time::Instant::now();
    w.inject(&victim, "TERMINATED", None).await;
    assert_eq!(w.counters().await.machines_removed_out_of_band, 1, "the fake cloud removed the VM");
    eventually(MINUTE, "the terminated machine gone and two Running", || async {
        let machines = w.machines().await;
        let gone = !machines.iter().any(|m| m.metadata.name == victim);
        let running = machines.iter().filter(|m| m.status.phase == Phase::Running).count();
        (gone && running == 2).then_some(())
    })
    .await;
    let took = started.elapsed();
    let events = w.events_of(&victim).await;
    let out = events.iter().find(|e| e.reason == "OutOfService").unwrap_or_else(|| panic!("{:?}", reasons(&events)));
    assert!(out.message.contains("terminated"), "{}", out.message);
    // Far inside either timeout: the event, not a timer, moved it.
    assert!(took < Duration::from_secs(300), "took {took:?}");
    let nodes = node_names(&w).await;
    assert!(!nodes.contains(&node), "the terminated machine's Node is deleted: {nodes:?}");
    w.assert_consistent(2).await;
    w.kill9().await;
}

/// kill -9 of the controller after it recorded an event and before the acknowledgement reached
/// the cloud (the fake cloud refuses AckEvents for a while): the new controller is sent the event
/// again, finds it recorded, and the machine is replaced once. Then kill -9 of the sidecar
/// mid-stream: the controller reconnects, and an event injected after the restart is handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_survives_kill_9_of_either_side_and_is_handled_once() {
    // The cloud keeps its machines and pending events in a state file across the sidecar's
    // restart, as a real cloud (and its queue) outlives a driver.
    let state_dir = tempfile::tempdir().unwrap();
    let state = state_dir.path().join("cloud.json");
    let args = [FAST, &["--state-file", state.to_str().unwrap()]].concat();
    let mut w = World::on_full_cluster(&args, "interrupt").await;
    w.start_controller(&[]);
    w.spot_class().await;
    w.apply_md(json!({"replicas": 2, "drainTimeoutSeconds": 600})).await;
    w.converged("web", 2 * MINUTE).await;
    let created = w.counters().await.machines_created;
    let refuse_acks = fake::FaultRule {
        rpc: "AckEvents".into(),
        target: "*".into(),
        action: "error".into(),
        code: "UNAVAILABLE".into(),
        ..Default::default()
    };
    w.set_faults(vec![refuse_acks]).await;
    let victim = w.machines().await[0].metadata.name.clone();
    // A long notice: the machine's deletion (not the cloud) is what the test watches.
    let event_id = w.inject(&victim, "SCHEDULED_MAINTENANCE", Some(Duration::from_secs(600))).await;
    eventually(MINUTE, "the event recorded and its acknowledgement refused", || async {
        let m = w.machine(&victim).await?;
        let recorded = m.status.interruption.as_ref().is_some_and(|i| i.event_id == event_id);
        let refused = w.inspect().await.counters?.faults_fired > 0;
        (recorded && refused).then_some(())
    })
    .await;
    w.kill9().await;
    w.set_faults(Vec::new()).await;
    w.start_controller(&[]);
    eventually(MINUTE, "the new controller acknowledged the replayed event", || async {
        (w.inspect().await.events_pending == 0).then_some(())
    })
    .await;
    let m = w.machine(&victim).await;
    let still = m.as_ref().and_then(|m| m.status.interruption.as_ref()).map(|i| i.event_id.clone());
    assert!(still.is_none() || still.as_deref() == Some(event_id.as_str()), "recorded once: {still:?}");
    eventually(MINUTE, "the maintained machine deleted", || async { w.machine(&victim).await.is_none().then_some(()) })
        .await;
    w.converged("web", 2 * MINUTE).await;
    assert_eq!(w.counters().await.machines_created, created + 1, "exactly one replacement");

    // The sidecar killed mid-stream and started again on the same socket and state.
    w.restart_driver().await;
    let created = w.counters().await.machines_created;
    let next = w.machines().await[0].metadata.name.clone();
    w.inject(&next, "IMPAIRED", None).await;
    eventually(2 * MINUTE, "the impaired machine replaced after the sidecar's restart", || async {
        let machines = w.machines().await;
        let gone = !machines.iter().any(|m| m.metadata.name == next);
        let running = machines.iter().filter(|m| m.status.phase == Phase::Running).count();
        (gone && running == 2).then_some(())
    })
    .await;
    assert_eq!(w.counters().await.machines_created, created + 1, "exactly one replacement");
    w.assert_consistent(2).await;
    w.kill9().await;
}

async fn node_names(w: &World) -> Vec<String> {
    use kube::api::{Api, ListParams};
    let nodes = Api::<k8s_openapi::api::core::v1::Node>::all(w.cluster().client.clone());
    nodes.list(&ListParams::default()).await.unwrap().items.into_iter().filter_map(|n| n.metadata.name).collect()
}

/// Machines per failure domain (not being deleted).
async fn per_domain(w: &World) -> std::collections::BTreeMap<String, usize> {
    let mut out = std::collections::BTreeMap::new();
    for m in w.machines().await.into_iter().filter(|m| !m.is_deleting()) {
        *out.entry(m.spec.failure_domain.clone().unwrap_or_else(|| "-".into())).or_default() += 1;
    }
    out
}

/// Spot first, on-demand as the fallback (embedded store, the fake cloud as a real sidecar):
/// while the cloud refuses spot capacity the deployment runs on on-demand; once spot is back it
/// moves there surge-first (never below `replicas` available at any poll); a spot interruption then closes
/// the spot domain (`CapacityReclaimed`), so the replacement goes to on-demand, and after the
/// backoff back to spot. Every machine is created once per placement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spot_refused_for_capacity_runs_on_demand_and_moves_back_to_spot_when_it_recovers() {
    let mut w = World::builder()
        .driver(e2e_tests::world::Driver::fake(FAST))
        .controller_args(&["--resync-interval", "5s"])
        .without_controller()
        .start()
        .await;
    let no_spot = fake::FaultRule {
        rpc: "CreateMachine".into(),
        capacity_type: "spot".into(),
        action: "error".into(),
        code: "RESOURCE_EXHAUSTED".into(),
        reason: "INSUFFICIENT_CAPACITY".into(),
        message: "no spot capacity for small".into(),
        ..Default::default()
    };
    w.set_faults(vec![no_spot]).await;
    let c = w.start_controller(&[]);
    // The embedded store: applied with the CLI (JSON is YAML).
    let class = json!({
        "apiVersion": "machine.driver.dev/v1alpha1", "kind": "MachineClass", "metadata": {"name": "small"},
        "spec": {"driver": "fake", "providerSpec": {"machineType": "small"}},
    });
    w.apply(&class.to_string()).await;
    let md = json!({
        "apiVersion": "machine.driver.dev/v1alpha1", "kind": "MachineDeployment", "metadata": {"name": "web"},
        "spec": {
            "replicas": 3,
            "template": {"spec": {"classRef": {"name": "small"}, "providerSpec": {"image": "os-1"}}},
            "strategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "failureDomains": [
                {"name": "spot", "providerSpec": {"capacityType": "spot"}, "priority": 1},
                {"name": "on-demand", "providerSpec": {"capacityType": "on-demand"}},
            ],
            "failureDomainBackoff": {"initialSeconds": 10, "maxSeconds": 10},
        },
    });
    w.apply(&md.to_string()).await;
    eventually(2 * MINUTE, "3 machines on on-demand while spot is refused", || async {
        let md = w.md("web").await;
        let spot_closed = md.status.failure_domains.iter().any(|d| d.name == "spot" && !d.reason.is_empty());
        let placed = per_domain(&w).await == [("on-demand".to_string(), 3)].into();
        (md.status.available_replicas == 3 && placed && spot_closed).then_some(())
    })
    .await;

    // Spot recovers: the machines move back, one at a time, launch before terminate.
    // (The embedded store has no watch a test can follow: the deployment's status is sampled at
    // every poll instead.)
    let fewest = std::cell::Cell::new(i64::MAX);
    let before = w.counters().await.machines_created;
    w.set_faults(vec![]).await;
    eventually(3 * MINUTE, "3 machines on spot", || async {
        let md = w.md("web").await;
        fewest.set(fewest.get().min(md.status.available_replicas));
        let placed = per_domain(&w).await == [("spot".to_string(), 3)].into();
        (md.status.available_replicas == 3 && md.status.replicas == 3 && placed).then_some(())
    })
    .await;
    assert_eq!(fewest.get(), 3, "fewer than replicas available while moving back");
    assert_eq!(w.counters().await.machines_created, before + 3, "each move created one machine");

    // A spot interruption: the spot offering is reclaimed, so the replacement goes to on-demand.
    let victim = w.machines().await.into_iter().find(|m| !m.is_deleting()).expect("a machine").metadata.name;
    w.inject(&victim, "SPOT_INTERRUPTION", Some(NOTICE)).await;
    let md = eventually(MINUTE, "the spot domain closed for the reclaim", || async {
        let md = w.md("web").await;
        md.status.failure_domains.iter().any(|d| d.name == "spot" && d.reason == "CapacityReclaimed").then_some(md)
    })
    .await;
    let spot = md.status.failure_domains.iter().find(|d| d.name == "spot").expect("the spot domain's status");
    assert!(spot.message.contains(&victim), "{spot:?}");
    let replacement = eventually(MINUTE, "the replacement created", || async {
        w.machines().await.into_iter().find(|m| {
            m.metadata.annotations.get(ANNOTATION_REPLACES_INTERRUPTION).is_some_and(|v| v.starts_with(&victim))
        })
    })
    .await;
    assert_eq!(replacement.spec.failure_domain.as_deref(), Some("on-demand"), "not back into the reclaimed offering");
    // After the backoff it moves back to spot.
    eventually(2 * MINUTE, "3 machines on spot again", || async {
        let md = w.md("web").await;
        let placed = per_domain(&w).await == [("spot".to_string(), 3)].into();
        let settled = w.machines().await.len() == 3 && w.machine(&victim).await.is_none();
        (md.status.available_replicas == 3 && placed && settled).then_some(())
    })
    .await;
    assert_eq!(w.counters().await.machines_reclaimed, 0, "the interrupted machine left before its deadline");
    w.assert_consistent(3).await;
    w.kill9_controller(c).await;
}

/// Azure's Scheduled Events reach the cluster as a Node condition (node-problem-detector sets
/// `PreemptionScheduled` with the event's `NotBefore` in its message): the controller records it
/// as a spot interruption with that deadline — not "now" — drains the node before it and
/// replaces the machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preemption_scheduled_node_condition_is_an_interruption_with_its_deadline() {
    let mut w = World::on_full_cluster(FAST, "interrupt").await;
    w.start_controller(&[]);
    w.spot_class().await;
    w.apply_md(json!({"replicas": 2})).await;
    w.converged("web", 2 * MINUTE).await;
    w.workload("db", 2, None).await;
    let victim = w.machine_with_pod("db").await;
    let node = w.machine(&victim).await.unwrap().status.node_ref.unwrap().name;
    // As node-problem-detector writes it: RFC 1123, whole seconds.
    let deadline = chrono::Utc::now() + chrono::Duration::seconds(NOTICE.as_secs() as i64);
    let deadline = chrono::DateTime::from_timestamp(deadline.timestamp(), 0).unwrap();
    let message = format!(
        "Preempt Scheduled: {}. Resources: [{node}]. EventId: 602d9444-d2cd-49c7-8624-8643e7171297",
        deadline.format("%a, %d %b %Y %H:%M:%S GMT")
    );
    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let patch = json!({"status": {"conditions": [{
        "type": "PreemptionScheduled", "status": "True", "reason": "SpotEvictionIncoming",
        "message": message, "lastHeartbeatTime": now, "lastTransitionTime": now,
    }]}});
    let (code, _, err) = w
        .cluster()
        .kubectl(&["patch", "node", &node, "--subresource=status", "--type=strategic", "-p", &patch.to_string()])
        .await;
    assert_eq!(code, 0, "{err}");
    let m = eventually(MINUTE, "the condition recorded as an interruption", || async {
        let m = w.machine(&victim).await?;
        m.status.interruption.is_some().then_some(m)
    })
    .await;
    let i = m.status.interruption.unwrap();
    assert_eq!(i.kind, InterruptionKind::SpotInterruption);
    assert_eq!(i.not_before, Some(deadline), "the deadline the message gives, not now");
    assert!(i.event_id.ends_with("602d9444-d2cd-49c7-8624-8643e7171297"), "{}", i.event_id);
    eventually(2 * MINUTE, "the machine replaced before its deadline", || async {
        let machines = w.machines().await;
        let gone = !machines.iter().any(|m| m.metadata.name == victim);
        let ready = machines.iter().filter(|m| m.status.phase == Phase::Running).count();
        (gone && ready == 2).then_some(())
    })
    .await;
    let events = w.events_of(&victim).await;
    let drained = events.iter().find(|e| e.reason == "Drained").unwrap_or_else(|| panic!("{:?}", reasons(&events)));
    assert!(drained.message.contains("before the SpotInterruption deadline"), "{}", drained.message);
    assert!(!reasons(&events).contains(&"DrainForced"), "{:?}", reasons(&events));
    assert!(reasons(&events).contains(&"Interrupted"), "{:?}", reasons(&events));
    w.assert_consistent(2).await;
    w.kill9().await;
}
