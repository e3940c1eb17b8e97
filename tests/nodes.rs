//! Machines as Kubernetes Nodes, on a whole test cluster (kube-apiserver, etcd,
//! kube-controller-manager, kube-scheduler and kwok's simulated kubelets, all real processes):
//! the fake cloud's VMs register Nodes as kubelets do (`fake-driver --join-cluster`), the
//! controller links each Machine to its Node, counts it Running only when the Node is Ready,
//! and drains the Node before every VM delete — evictions through the Eviction API, so
//! PodDisruptionBudgets hold, with a finite deadline.
//!
//! Each test runs in its own cluster and namespace; the controller runs with `--store
//! kubernetes` (the target cluster is then the same) unless the test says otherwise.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use e2e_tests::kube_cluster::{node_ready, pod_ready, Cluster};
use e2e_tests::world::{Driver, World};
use e2e_tests::{eventually, joining, joining_class};
use fake_driver::pb as fake;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::watcher;
use machine_controller::resources::*;
use machine_controller::store::Key;
use serde_json::{json, Value};

const MINUTE: Duration = Duration::from_secs(60);
const FAST: &[&str] = &["--create-latency", "300ms", "--delete-latency", "200ms", "--update-latency", "200ms"];

fn ar(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("machine.driver.dev", "v1alpha1", kind), plural)
}

/// What these tests apply and read besides the world's own operations.
trait Nodes {
    async fn class(&self);
    async fn apply_md(&self, name: &str, replicas: i64, provider_spec: Value, extra: Value);
    async fn machine(&self, name: &str) -> Option<Machine>;
    async fn rolled_out(&self, name: &str, within: Duration) -> MachineDeployment;
    async fn nodes(&self) -> Vec<Node>;
    async fn node(&self, name: &str) -> Option<Node>;
    async fn events(&self, machine: &str) -> Vec<machine_controller::store::Event>;
}

impl Nodes for World {
    async fn class(&self) {
        let spec = json!({"driver": "fake", "providerSpec": {"machineType": "small"}});
        self.apply_object(
            "MachineClass",
            "machineclasses",
            json!({"metadata": {"name": "small"}, "spec": joining(spec)}),
        )
        .await;
    }

    /// A MachineDeployment of `replicas` machines with `provider_spec` and extra spec fields.
    async fn apply_md(&self, name: &str, replicas: i64, provider_spec: Value, extra: Value) {
        let mut spec = json!({
            "replicas": replicas,
            "template": {"spec": {"classRef": {"name": "small"}, "providerSpec": provider_spec}},
            "strategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        });
        for (k, v) in extra.as_object().cloned().unwrap_or_default() {
            spec[k] = v;
        }
        self.apply_object("MachineDeployment", "machinedeployments", json!({"metadata": {"name": name}, "spec": spec}))
            .await;
    }

    async fn machine(&self, name: &str) -> Option<Machine> {
        self.store().get::<Machine>(self.ns(), name).await.unwrap()
    }

    async fn rolled_out(&self, name: &str, within: Duration) -> MachineDeployment {
        let what = format!("{name} rolled out");
        let store = self.store();
        let store = &store;
        let ns = self.ns();
        let md = tokio::time::timeout(
            within,
            eventually(within + Duration::from_secs(1), &what, || async move {
                let md = store.get::<MachineDeployment>(ns, name).await.ok().flatten()?;
                e2e_tests::rolled_out(&md).then_some(md)
            }),
        )
        .await;
        md.unwrap_or_else(|_| panic!("{what}: not within {within:?}\n{}", self.logs()))
    }

    async fn nodes(&self) -> Vec<Node> {
        Api::<Node>::all(self.cluster().client.clone()).list(&ListParams::default()).await.unwrap().items
    }

    async fn node(&self, name: &str) -> Option<Node> {
        Api::<Node>::all(self.cluster().client.clone()).get_opt(name).await.unwrap()
    }

    async fn events(&self, machine: &str) -> Vec<machine_controller::store::Event> {
        self.store().backend().events(&Key::new(Kind::Machine, self.ns(), machine), 100).await.unwrap()
    }
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

fn cordoned(n: &Node) -> bool {
    let spec = n.spec.as_ref();
    spec.and_then(|s| s.unschedulable) == Some(true)
        && spec
            .and_then(|s| s.taints.as_ref())
            .is_some_and(|ts| ts.iter().any(|t| t.key == TAINT_DRAINING && t.effect == "NoSchedule"))
        && n.metadata
            .labels
            .as_ref()
            .is_some_and(|l| l.contains_key("node.kubernetes.io/exclude-from-external-load-balancers"))
}

fn provider_id(n: &Node) -> String {
    n.spec.as_ref().and_then(|s| s.provider_id.clone()).unwrap_or_default()
}

fn has_event(events: &[machine_controller::store::Event], reason: &str) -> bool {
    events.iter().any(|e| e.reason == reason)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machines_join_as_ready_nodes_linked_by_provider_id() {
    let mut w = World::on_full_cluster(FAST, "nodes").await;
    w.start_controller(&[]);
    w.class().await;
    w.apply_md("web", 2, json!({"machineType": "small"}), json!({})).await;
    w.rolled_out("web", 2 * MINUTE).await;
    let nodes: HashMap<String, Node> =
        w.nodes().await.into_iter().map(|n| (n.metadata.name.clone().unwrap(), n)).collect();
    let machines = w.machines().await;
    assert_eq!(machines.len(), 2);
    for m in &machines {
        assert_eq!(m.status.phase, Phase::Running, "{}", m.metadata.name);
        let r = m.status.node_ref.as_ref().unwrap_or_else(|| panic!("{} has no nodeRef", m.metadata.name));
        let node = &nodes[&r.name];
        assert_eq!(provider_id(node), m.status.provider_id, "the Node has the machine's provider ID");
        assert_eq!(node.metadata.uid.as_deref(), Some(r.uid.as_str()));
        assert!(node_ready(node));
        let annotation = node.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_NODE_MACHINE));
        assert_eq!(annotation, Some(&format!("{}/{}", w.ns(), m.metadata.name)), "the Node names its Machine");
        let ready = condition(&m.status.conditions, ConditionType::NodeReady).expect("NodeReady");
        assert_eq!(ready.status, ConditionStatus::True);
        // Running only after the Node was Ready: the events say so in that order.
        let events = w.events(&m.metadata.name).await;
        assert!(has_event(&events, "NodeReady"), "{events:?}");
    }
    // As a user sees it: the NODE column, in kubectl and in our CLI.
    let (code, out, err) = w.cluster().kubectl(&["get", "machines", "-n", w.ns()]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.lines().next().unwrap_or("").contains("NODE"), "{out}");
    for m in &machines {
        let node = &m.status.node_ref.as_ref().unwrap().name;
        assert!(out.lines().any(|l| l.starts_with(&m.metadata.name) && l.contains(node.as_str())), "{out}");
    }
    let (code, out, err) = w.cli(&["get", "machines", "-n", w.ns()]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("NODE"), "{out}");
    // Node metadata from the template, kept in sync; others' keys stay; nothing is replaced.
    let node_template = |labels: Value, taints: Value| {
        json!({"replicas": 2, "template": {"spec": {"classRef": {"name": "small"},
            "providerSpec": {"machineType": "small"},
            "nodeTemplate": {"labels": labels, "taints": taints}}}})
    };
    let apply = |spec: Value| {
        let w = &w;
        async move {
            w.apply_object(
                "MachineDeployment",
                "machinedeployments",
                json!({"metadata": {"name": "web"}, "spec": spec}),
            )
            .await
        }
    };
    apply(node_template(
        json!({"tier": "web", "team": "shop"}),
        json!([{"key": "dedicated", "value": "web", "effect": "NoSchedule"}]),
    ))
    .await;
    let names: Vec<String> = machines.iter().map(|m| m.status.node_ref.clone().unwrap().name).collect();
    eventually(MINUTE, "the template's labels and taint on both Nodes", || async {
        let nodes = w.nodes().await;
        nodes
            .iter()
            .all(|n| {
                let l = n.metadata.labels.clone().unwrap_or_default();
                let tainted = n
                    .spec
                    .as_ref()
                    .and_then(|s| s.taints.as_ref())
                    .is_some_and(|ts| ts.iter().any(|t| t.key == "dedicated"));
                l.get("tier").map(String::as_str) == Some("web")
                    && l.get("team").map(String::as_str) == Some("shop")
                    && tainted
            })
            .then_some(())
    })
    .await;
    // Someone else labels a node; the template drops "team" and the taint.
    let nodes_api = Api::<Node>::all(w.cluster().client.clone());
    let other = json!({"metadata": {"labels": {"ops.example.com/owner": "alice"}}});
    nodes_api.patch(&names[0], &PatchParams::default(), &Patch::Merge(&other)).await.unwrap();
    apply(node_template(json!({"tier": "api"}), json!([]))).await;
    eventually(MINUTE, "team and the taint removed, tier changed, alice's label kept", || async {
        let n = w.node(&names[0]).await?;
        let l = n.metadata.labels.clone().unwrap_or_default();
        let tainted =
            n.spec.as_ref().and_then(|s| s.taints.as_ref()).is_some_and(|ts| ts.iter().any(|t| t.key == "dedicated"));
        (l.get("tier").map(String::as_str) == Some("api")
            && !l.contains_key("team")
            && l.get("ops.example.com/owner").map(String::as_str) == Some("alice")
            && !tainted)
            .then_some(())
    })
    .await;
    let now: Vec<String> = w.machines().await.iter().map(|m| m.metadata.name.clone()).collect();
    let before: Vec<String> = machines.iter().map(|m| m.metadata.name.clone()).collect();
    assert_eq!(sorted(now), sorted(before), "a metadata-only change replaces no machine");
    let cloud = w.fake().await.inspect(fake::InspectRequest::default()).await.unwrap().into_inner();
    assert_eq!(cloud.counters.unwrap().machines_created, 2, "no machine was created for it");
    // Scaling down drains and deletes the Node after its VM.
    apply(json!({"replicas": 1, "template": {"spec": {"classRef": {"name": "small"},
        "providerSpec": {"machineType": "small"}, "nodeTemplate": {"labels": {"tier": "api"}}}}}))
    .await;
    w.rolled_out("web", 2 * MINUTE).await;
    let left = eventually(MINUTE, "one machine left", || async {
        let left = w.machines().await;
        (left.len() == 1).then_some(left)
    })
    .await;
    eventually(MINUTE, "one Node left", || async {
        let nodes = w.nodes().await;
        (nodes.len() == 1 && provider_id(&nodes[0]) == left[0].status.provider_id).then_some(())
    })
    .await;
    w.assert_controller_never_forbidden();
    w.kill9().await;
}

/// A watch on the workload's pods, counting the fewest Ready at any moment, and the cordon state
/// of each pod's node when its eviction was seen.
struct PodWatch {
    /// Ready pods now.
    ready: Arc<Mutex<usize>>,
    /// The fewest Ready pods seen since the first list was complete.
    min_ready: Arc<Mutex<usize>>,
    uncordoned_evictions: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl PodWatch {
    fn start(w: &World, app: &str) -> PodWatch {
        let min_ready = Arc::new(Mutex::new(usize::MAX));
        let ready_now = Arc::new(Mutex::new(0));
        let uncordoned = Arc::new(Mutex::new(Vec::new()));
        let pods = w.pods_api();
        let nodes = Api::<Node>::all(w.cluster().client.clone());
        let (min, now, bad) = (min_ready.clone(), ready_now.clone(), uncordoned.clone());
        let config = watcher::Config::default().labels(&format!("app={app}"));
        let task = tokio::spawn(async move {
            let mut known: BTreeMap<String, Pod> = BTreeMap::new();
            let mut listed = false;
            let mut seen_deleting = std::collections::HashSet::new();
            let mut stream = std::pin::pin!(watcher(pods, config));
            while let Some(Ok(event)) = stream.next().await {
                match event {
                    watcher::Event::Apply(p) | watcher::Event::InitApply(p) => {
                        let name = p.metadata.name.clone().unwrap_or_default();
                        if p.metadata.deletion_timestamp.is_some() && seen_deleting.insert(name.clone()) {
                            // The node must be cordoned and tainted by the time a pod leaves it.
                            let node = p.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default();
                            let n = nodes.get_opt(&node).await.ok().flatten();
                            if !n.as_ref().is_some_and(cordoned) {
                                bad.lock().unwrap().push(format!("{name} left {node} before it was cordoned"));
                            }
                        }
                        known.insert(name, p);
                    }
                    watcher::Event::Delete(p) => {
                        known.remove(&p.metadata.name.clone().unwrap_or_default());
                    }
                    watcher::Event::Init => {}
                    watcher::Event::InitDone => listed = true,
                }
                let ready = known.values().filter(|p| pod_ready(p)).count();
                *now.lock().unwrap() = ready;
                if listed {
                    let mut m = min.lock().unwrap();
                    *m = (*m).min(ready);
                }
            }
        });
        PodWatch { ready: ready_now, min_ready, uncordoned_evictions: uncordoned, task }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_update_drains_each_old_node_by_eviction_within_the_disruption_budget() {
    let mut w = World::on_full_cluster(FAST, "nodes").await;
    w.start_controller(&[]);
    w.class().await;
    w.apply_md("web", 3, json!({"machineType": "small", "image": "os-1"}), json!({})).await;
    let before = w.rolled_out("web", 2 * MINUTE).await;
    let old_nodes: Vec<String> =
        w.machines().await.iter().map(|m| m.status.node_ref.as_ref().unwrap().name.clone()).collect();
    w.workload("shop", 6, Some(json!({"maxUnavailable": 1}))).await;
    let watch = PodWatch::start(&w, "shop");
    eventually(MINUTE, "the pod watch to see 6 Ready", || async {
        (*watch.ready.lock().unwrap() == 6 && *watch.min_ready.lock().unwrap() == 6).then_some(())
    })
    .await;
    w.apply_md("web", 3, json!({"machineType": "small", "image": "os-2"}), json!({})).await;
    eventually(3 * MINUTE, "a new revision rolled out", || async {
        let md = w.store().get::<MachineDeployment>(w.ns(), "web").await.ok().flatten()?;
        (e2e_tests::rolled_out(&md) && md.status.target_revision != before.status.target_revision).then_some(())
    })
    .await;
    // Old Nodes go after their VMs; every pod then runs on a new node.
    eventually(MINUTE, "the old Nodes gone", || async {
        let names: Vec<String> = w.nodes().await.iter().filter_map(|n| n.metadata.name.clone()).collect();
        old_nodes.iter().all(|o| !names.contains(o)).then_some(())
    })
    .await;
    let new_nodes: Vec<String> =
        w.machines().await.iter().map(|m| m.status.node_ref.as_ref().unwrap().name.clone()).collect();
    let pods = eventually(MINUTE, "6 pods Ready on the new nodes", || async {
        let pods = w.ready_pods("shop").await;
        let on_new = pods.iter().all(|p| new_nodes.contains(p.spec.as_ref().unwrap().node_name.as_ref().unwrap()));
        (pods.len() == 6 && on_new).then_some(pods)
    })
    .await;
    assert_eq!(pods.len(), 6);
    watch.task.abort();
    let min_ready = *watch.min_ready.lock().unwrap();
    assert!(min_ready >= 5, "the budget allows one pod down at a time, but the watch saw only {min_ready} Ready");
    let uncordoned = watch.uncordoned_evictions.lock().unwrap().clone();
    assert!(uncordoned.is_empty(), "{uncordoned:?}");
    // Nothing was forced: every pod left by eviction.
    for m in w.store().list::<Machine>().await.unwrap() {
        assert!(!has_event(&w.events(&m.metadata.name).await, "DrainForced"));
    }
    let cloud = w.fake().await.inspect(fake::InspectRequest::default()).await.unwrap().into_inner();
    assert_eq!(cloud.machines.len(), 3, "the old VMs are gone");
    w.assert_controller_never_forbidden();
    w.kill9().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_that_forbids_every_eviction_holds_the_drain_until_its_deadline() {
    let mut w = World::on_full_cluster(FAST, "nodes").await;
    w.start_controller(&[]);
    w.class().await;
    w.apply_md("web", 1, json!({"machineType": "small"}), json!({"drainTimeoutSeconds": 20})).await;
    w.rolled_out("web", 2 * MINUTE).await;
    let m = w.machines().await.remove(0);
    let name = m.metadata.name.clone();
    let node = m.status.node_ref.clone().unwrap().name;
    // minAvailable = every replica: no eviction can ever be allowed.
    w.workload("db", 2, Some(json!({"minAvailable": 2}))).await;
    w.apply_object(
        "MachineDeployment",
        "machinedeployments",
        json!({"metadata": {"name": "web"}, "spec": {"replicas": 0,
            "template": {"spec": {"classRef": {"name": "small"}, "providerSpec": {"machineType": "small"}}},
            "drainTimeoutSeconds": 20}}),
    )
    .await;
    let held = eventually(MINUTE, "the drain held by the budget", || async {
        let m = w.machine(&name).await?;
        let c = condition(&m.status.conditions, ConditionType::Deleting)?;
        (c.reason == Reason::DisruptionBudgetUnsatisfiable).then_some(m)
    })
    .await;
    let d = held.status.deletion.clone().unwrap();
    assert_eq!(d.phase, DeletionPhase::Draining);
    assert!(d.blocked_by.contains(&format!("{}/db-budget", w.ns())), "{}", d.blocked_by);
    assert_eq!(d.pods_left, 2);
    let msg = &condition(&held.status.conditions, ConditionType::Deleting).unwrap().message;
    assert!(msg.contains("db-budget") && msg.contains("pod"), "{msg}");
    assert!(w.node(&node).await.as_ref().is_some_and(cordoned), "the node is cordoned while held");
    // What an operator sees.
    let (code, out, _) = w.cluster().kubectl(&["describe", "machine", &name, "-n", w.ns()]).await;
    assert_eq!(code, 0);
    assert!(out.contains("DisruptionBudgetUnsatisfiable") && out.contains("db-budget"), "{out}");
    // At the deadline the pods are deleted and the machine goes, with an event saying so.
    eventually(2 * MINUTE, "the machine gone after its deadline", || async {
        w.machine(&name).await.is_none().then_some(())
    })
    .await;
    let events = w.events(&name).await;
    assert!(has_event(&events, "DrainForced"), "{events:?}");
    assert!(has_event(&events, "EvictionBlocked") || has_event(&events, "DisruptionBudgetUnsatisfiable"), "{events:?}");
    assert!(w.node(&node).await.is_none(), "the Node goes after its VM");
    w.assert_controller_never_forbidden();
    w.kill9().await;
}

/// The cluster-autoscaler's taint proves nothing about a drain: it goes on before the autoscaler
/// evicts, and anyone who may patch Nodes can set it. A machine removed by a scale-down while its
/// Node carries `ToBeDeletedByClusterAutoscaler` is drained as always — held by its pods'
/// PodDisruptionBudget, its VM kept — and goes only once the budget lets the pods go. (A removal
/// the real autoscaler asked for, and drained itself, is not drained twice:
/// `autoscaler::pending_pods_scale_a_deployment_up_and_idle_nodes_go_exactly_without_a_second_drain`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_autoscalers_taint_on_a_node_skips_no_drain_the_autoscaler_did_not_ask_for() {
    let mut w = World::on_full_cluster(FAST, "nodes").await;
    w.start_controller(&[]);
    w.class().await;
    let spec = json!({"drainTimeoutSeconds": 600});
    w.apply_md("web", 1, json!({"machineType": "small"}), spec.clone()).await;
    w.rolled_out("web", 2 * MINUTE).await;
    let m = w.machines().await.remove(0);
    let name = m.metadata.name.clone();
    let node = m.status.node_ref.clone().unwrap().name;
    // Both pods on the one node, and a budget that allows no eviction while they run.
    w.workload("db", 2, Some(json!({"minAvailable": 2}))).await;
    let taint = json!({"spec": {"taints": [{"key": TAINT_AUTOSCALER_DELETING, "value": "1767225600", "effect": "NoSchedule"}]}});
    Api::<Node>::all(w.cluster().client.clone())
        .patch(&node, &PatchParams::default(), &Patch::Merge(&taint))
        .await
        .expect("tainting the node");
    // A scale-down (no autoscaler asked for it) removes the machine.
    w.apply_md("web", 0, json!({"machineType": "small"}), spec).await;
    let held = eventually(MINUTE, "the drain held by the budget despite the taint", || async {
        let m = w.machine(&name).await?;
        let c = condition(&m.status.conditions, ConditionType::Deleting)?;
        (c.reason == Reason::DisruptionBudgetUnsatisfiable).then_some(m)
    })
    .await;
    let d = held.status.deletion.clone().unwrap();
    assert_eq!(d.phase, DeletionPhase::Draining, "{d:?}");
    assert!(d.blocked_by.contains(&format!("{}/db-budget", w.ns())), "{}", d.blocked_by);
    assert_eq!(d.pods_left, 2);
    assert_eq!(w.inspect().await.machines.len(), 1, "the VM is kept while its pods are protected");
    let events = w.events(&name).await;
    assert!(!events.iter().any(|e| e.message.contains("drained by the cluster-autoscaler")), "{events:?}");
    // The budget goes: the pods are evicted, then the VM and the Node.
    w.cluster().kubectl(&["delete", "pdb", "db-budget", "-n", w.ns()]).await;
    eventually(2 * MINUTE, "the machine gone once its pods could go", || async {
        w.machine(&name).await.is_none().then_some(())
    })
    .await;
    let events = w.events(&name).await;
    assert!(events.iter().any(|e| e.reason == "Drained" && e.message.contains("every pod evicted")), "{events:?}");
    w.kill9().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hooks_hold_the_deletion_and_daemon_set_pods_are_not_evicted() {
    let mut w = World::on_full_cluster(FAST, "nodes").await;
    w.start_controller(&[]);
    w.class().await;
    w.apply_md("web", 1, json!({"machineType": "small"}), json!({})).await;
    w.rolled_out("web", 2 * MINUTE).await;
    let m = w.machines().await.remove(0);
    let name = m.metadata.name.clone();
    let node = m.status.node_ref.clone().unwrap().name;
    w.cluster()
        .apply_json(json!({
            "apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": "agent", "namespace": w.ns()},
            "spec": {"selector": {"matchLabels": {"app": "agent"}},
                     "template": {"metadata": {"labels": {"app": "agent"}},
                                  "spec": {"containers": [{"name": "a", "image": "registry.invalid/agent:1"}]}}}
        }))
        .await;
    eventually(MINUTE, "the DaemonSet pod Ready", || async { (w.ready_pods("agent").await.len() == 1).then_some(()) })
        .await;
    let pre_drain = format!("{PRE_DRAIN_HOOK_PREFIX}/backup");
    let pre_terminate = format!("{PRE_TERMINATE_HOOK_PREFIX}/detach-storage");
    let patch = json!({"metadata": {"annotations": {pre_drain.clone(): "", pre_terminate.clone(): ""}}});
    let machines =
        Api::<DynamicObject>::namespaced_with(w.cluster().client.clone(), w.ns(), &ar("Machine", "machines"));
    machines.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
    machines.delete(&name, &DeleteParams::default()).await.unwrap();
    let phase = |m: &Machine| m.status.deletion.as_ref().map(|d| d.phase);
    eventually(MINUTE, "held before the drain", || async {
        let m = w.machine(&name).await?;
        let blocked = m.status.deletion.as_ref().is_some_and(|d| d.blocked_by.contains("backup"));
        (phase(&m) == Some(DeletionPhase::PreDrainHooks) && blocked).then_some(())
    })
    .await;
    assert!(!w.node(&node).await.as_ref().is_some_and(cordoned), "nothing is cordoned while a pre-drain hook holds");
    let remove = |key: &str| json!({"metadata": {"annotations": {key: null}}});
    machines.patch(&name, &PatchParams::default(), &Patch::Merge(&remove(&pre_drain))).await.unwrap();
    let held = eventually(MINUTE, "held before the VM's delete", || async {
        let m = w.machine(&name).await?;
        let blocked = m.status.deletion.as_ref().is_some_and(|d| d.blocked_by.contains("detach-storage"));
        (phase(&m) == Some(DeletionPhase::PreTerminateHooks) && blocked).then_some(m)
    })
    .await;
    let c = condition(&held.status.conditions, ConditionType::Deleting).unwrap();
    assert_eq!(c.reason, Reason::WaitingForPreTerminateHooks);
    assert!(w.node(&node).await.as_ref().is_some_and(cordoned), "drained: cordoned");
    // The DaemonSet's pod was left alone by the drain. (The deployment's replacement machine may
    // have joined meanwhile, with a DaemonSet pod of its own.)
    let agents = w.ready_pods("agent").await;
    let on_node = agents.iter().filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node.as_str()));
    assert_eq!(on_node.count(), 1, "the DaemonSet pod is not evicted");
    let cloud = w.fake().await.inspect(fake::InspectRequest::default()).await.unwrap().into_inner();
    assert!(cloud.machines.iter().any(|vm| vm.name == name), "the VM stays while a pre-terminate hook holds");
    machines.patch(&name, &PatchParams::default(), &Patch::Merge(&remove(&pre_terminate))).await.unwrap();
    eventually(MINUTE, "the machine and its Node gone", || async {
        (w.machine(&name).await.is_none() && w.node(&node).await.is_none()).then_some(())
    })
    .await;
    w.kill9().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_that_never_join_fail_their_machines_and_the_revision_is_rolled_back() {
    let mut w = World::on_full_cluster(FAST, "nodes").await;
    w.start_controller(&[]);
    w.class().await;
    // The first revision's Nodes get a minute (a loaded machine can take more than 3 s to make one
    // Ready); the one whose Nodes never join, 3 s. A Machine keeps what it was created with.
    let settings = |startup: i64| json!({"nodeStartupTimeoutSeconds": startup, "failureBudget": 2});
    w.apply_md("web", 2, json!({"machineType": "small", "image": "os-1"}), settings(60)).await;
    let good = w.rolled_out("web", 2 * MINUTE).await;
    // A new revision whose VMs run but whose Nodes never join.
    w.apply_md("web", 2, json!({"machineType": "small", "image": "os-2", "kubelet": "NeverJoins"}), settings(3)).await;
    let md = eventually(3 * MINUTE, "the revision aborted and rolled back", || async {
        let md = w.store().get::<MachineDeployment>(w.ns(), "web").await.ok().flatten()?;
        (!md.status.bad_revisions.is_empty() && e2e_tests::rolled_out(&md)).then_some(md)
    })
    .await;
    assert_eq!(md.status.target_revision, good.status.target_revision, "back on the good revision");
    for m in w.machines().await {
        assert_eq!(m.metadata.labels.get(LABEL_REVISION), Some(&good.status.target_revision));
    }
    // The failures said why.
    let api = Api::<k8s_openapi::api::events::v1::Event>::namespaced(w.cluster().client.clone(), w.ns());
    let failed: Vec<String> = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("NodeNotJoined"))
        .map(|e| e.note.unwrap_or_default())
        .collect();
    assert!(!failed.is_empty(), "no NodeNotJoined event");
    assert!(failed[0].contains("no Ready Node 3s after the VM came up"), "{}", failed[0]);
    w.kill9().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_resumes_after_kill_9_with_the_same_phase_and_deadline() {
    let mut w = World::on_full_cluster(FAST, "nodes").await;
    w.start_controller(&[]);
    w.class().await;
    w.apply_md("web", 1, json!({"machineType": "small"}), json!({"drainTimeoutSeconds": 25})).await;
    w.rolled_out("web", 2 * MINUTE).await;
    let name = w.machines().await.remove(0).metadata.name;
    w.workload("db", 1, Some(json!({"minAvailable": 1}))).await;
    let machines =
        Api::<DynamicObject>::namespaced_with(w.cluster().client.clone(), w.ns(), &ar("Machine", "machines"));
    machines.delete(&name, &DeleteParams::default()).await.unwrap();
    let first = eventually(MINUTE, "the drain under way", || async {
        let m = w.machine(&name).await?;
        let d = m.status.deletion.clone()?;
        (d.phase == DeletionPhase::Draining && !d.blocked_by.is_empty()).then_some(d)
    })
    .await;
    w.kill9().await;
    w.start_controller(&[]);
    let resumed = eventually(MINUTE, "the new process at work on the same drain", || async {
        let m = w.machine(&name).await?;
        let log = w.controller_log(1);
        let d = m.status.deletion.clone()?;
        (log.contains("running") && d.phase == DeletionPhase::Draining).then_some(d)
    })
    .await;
    assert_eq!(resumed.drain_started, first.drain_started, "the drain did not start over");
    assert_eq!(resumed.drain_deadline, first.drain_deadline, "the deadline did not move");
    eventually(2 * MINUTE, "the machine gone at its deadline", || async {
        w.machine(&name).await.is_none().then_some(())
    })
    .await;
    // Pods were deleted no earlier than their grace period (5 s) before the recorded deadline.
    let events = w.events(&name).await;
    let forced = events.iter().find(|e| e.reason == "DrainForced").expect("a DrainForced event");
    let deadline = first.drain_deadline.unwrap();
    assert!(
        forced.time >= deadline - chrono::Duration::seconds(6),
        "forced at {} before the deadline {deadline}",
        forced.time
    );
    w.kill9().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_gone_out_of_band_takes_its_not_ready_node_out_of_service_without_evictions() {
    let mut w = World::on_full_cluster(FAST, "nodes").await;
    w.start_controller(&[]);
    w.class().await;
    w.apply_md("web", 1, json!({"machineType": "small"}), json!({"healthTimeoutSeconds": 2})).await;
    w.rolled_out("web", 2 * MINUTE).await;
    let m = w.machines().await.remove(0);
    let node = m.status.node_ref.clone().unwrap().name;
    // A budget that would block any eviction: an out-of-service node must not wait for it.
    w.workload("db", 1, Some(json!({"minAvailable": 1}))).await;
    w.fake().await.remove_machine(fake::RemoveMachineRequest { machine: m.metadata.name.clone() }).await.unwrap();
    eventually(2 * MINUTE, "the machine replaced and its Node deleted", || async {
        (w.machine(&m.metadata.name).await.is_none() && w.node(&node).await.is_none()).then_some(())
    })
    .await;
    let events = w.events(&m.metadata.name).await;
    assert!(has_event(&events, "OutOfService"), "{events:?}");
    assert!(
        !has_event(&events, "EvictionBlocked") && !has_event(&events, "DisruptionBudgetUnsatisfiable"),
        "{events:?}"
    );
    w.rolled_out("web", 2 * MINUTE).await;
    w.kill9().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_deployment_drains_every_node_before_its_vm_goes() {
    let mut w = World::on_full_cluster(FAST, "nodes").await;
    w.start_controller(&[]);
    w.class().await;
    w.apply_md("web", 2, json!({"machineType": "small"}), json!({})).await;
    w.rolled_out("web", 2 * MINUTE).await;
    w.workload("shop", 2, None).await;
    let mds = Api::<DynamicObject>::namespaced_with(
        w.cluster().client.clone(),
        w.ns(),
        &ar("MachineDeployment", "machinedeployments"),
    );
    mds.delete("web", &DeleteParams::default()).await.unwrap();
    eventually(2 * MINUTE, "every machine and Node gone", || async {
        (w.machines().await.is_empty() && w.nodes().await.is_empty()).then_some(())
    })
    .await;
    let api = Api::<k8s_openapi::api::events::v1::Event>::namespaced(w.cluster().client.clone(), w.ns());
    let events = api.list(&ListParams::default()).await.unwrap().items;
    let drained = events.iter().filter(|e| e.reason.as_deref() == Some("Drained")).count();
    let deleted = events.iter().filter(|e| e.reason.as_deref() == Some("NodeDeleted")).count();
    assert_eq!((drained, deleted), (2, 2), "each node drained, then deleted after its VM");
    w.assert_controller_never_forbidden();
    w.kill9().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_store_manages_nodes_in_a_target_cluster() {
    let cluster = Cluster::start_full().await;
    let kubeconfig = cluster.kubeconfig.to_string_lossy().into_owned();
    let mut args = FAST.to_vec();
    args.extend(["--join-cluster", &kubeconfig]);
    let mut w = World::builder()
        .driver(Driver::fake(&args))
        .controller_args(&["--target-kubeconfig", &kubeconfig, "--drain-poll-interval", "500ms"])
        .manifest(&format!(
            "{}---
apiVersion: machine.driver.dev/v1alpha1
kind: MachineDeployment
metadata: {{name: web}}
spec:
  replicas: 2
  template: {{spec: {{classRef: {{name: small}}}}}}
",
            joining_class("small", "{machineType: small}")
        ))
        .start()
        .await;
    let md = w.converged("web", 2 * MINUTE).await;
    assert_eq!(md.status.available_replicas, 2);
    let (code, out, err) = w.cli(&["get", "machines"]).await;
    assert_eq!(code, 0, "{err}");
    let nodes = Api::<Node>::all(cluster.client.clone()).list(&ListParams::default()).await.unwrap().items;
    assert_eq!(nodes.len(), 2);
    for n in &nodes {
        assert!(
            out.contains(n.metadata.name.as_deref().unwrap()),
            "the NODE column names {:?}:\n{out}",
            n.metadata.name
        );
    }
    let (code, _, err) = w.cli(&["delete", "machinedeployment", "web"]).await;
    assert_eq!(code, 0, "{err}");
    eventually(2 * MINUTE, "the Nodes gone after their VMs", || async {
        let nodes = Api::<Node>::all(cluster.client.clone()).list(&ListParams::default()).await.ok()?.items;
        nodes.is_empty().then_some(())
    })
    .await;
    w.kill9().await;
}

/// The pool's Machines now (not being deleted), by name.
async fn pool_machines(w: &World, pool: &str) -> BTreeMap<String, Machine> {
    w.machines()
        .await
        .into_iter()
        .filter(|m| !m.is_deleting() && m.spec.pool_ref.as_ref().is_some_and(|p| p.name == pool))
        .map(|m| (m.metadata.name.clone(), m))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machine_pool_scale_down_drains_the_chosen_instance_first() {
    let mut w = World::on_full_cluster(FAST, "nodes").await;
    w.start_controller(&[]);
    w.class().await;
    let pool = |replicas: i64| {
        json!({"metadata": {"name": "workers"}, "spec": {
            "replicas": replicas,
            "template": {"spec": {"classRef": {"name": "small"}, "providerSpec": {"machineType": "small"}}},
            "strategy": {"maxSurge": 1, "maxUnavailable": 0},
        }})
    };
    w.apply_object("MachinePool", "machinepools", pool(2)).await;
    // Two instances running, their Nodes (named <pool>-<id>) Ready and carrying their provider IDs.
    let before = eventually(2 * MINUTE, "2 pool Machines Running with Ready Nodes", || async {
        let p = w.store().get::<MachinePool>(w.ns(), "workers").await.ok().flatten()?;
        let machines = pool_machines(&w, "workers").await;
        let nodes: HashMap<String, Node> =
            w.nodes().await.into_iter().map(|n| (n.metadata.name.clone().unwrap_or_default(), n)).collect();
        let joined = machines.values().all(|m| {
            m.status.phase == Phase::Running
                && m.status.node_ref.as_ref().is_some_and(|r| r.name == m.metadata.name)
                && nodes.get(&m.metadata.name).is_some_and(|n| node_ready(n) && provider_id(n) == m.status.provider_id)
        });
        (p.status.replicas == 2 && p.status.ready_replicas == 2 && machines.len() == 2 && joined).then_some(machines)
    })
    .await;
    assert_eq!(before.keys().cloned().collect::<Vec<_>>(), ["workers-0", "workers-1"]);
    w.workload("shop", 4, None).await;
    let on = |pods: &[Pod], node: &str| {
        pods.iter().filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)).count()
    };
    // The victim is a node with pods on it (the scheduler's spread is only a preference): the
    // oldest instance if it has any.
    let (victim, survivor) = if on(&w.ready_pods("shop").await, "workers-0") > 0 {
        ("workers-0", "workers-1")
    } else {
        ("workers-1", "workers-0")
    };
    let survivor_node = w.node(survivor).await.unwrap();
    let watch = PodWatch::start(&w, "shop");
    eventually(MINUTE, "the pod watch to see 4 Ready", || async { (*watch.ready.lock().unwrap() == 4).then_some(()) })
        .await;
    // The annotation chooses the victim: the cloud, left to pick, might take the other.
    let machines =
        Api::<DynamicObject>::namespaced_with(w.cluster().client.clone(), w.ns(), &ar("Machine", "machines"));
    let mark = json!({"metadata": {"annotations": {ANNOTATION_DELETE: "true"}}});
    machines.patch(victim, &PatchParams::default(), &Patch::Merge(&mark)).await.unwrap();
    w.apply_object("MachinePool", "machinepools", pool(1)).await;
    eventually(2 * MINUTE, "the pool scaled down to 1 and its Node gone", || async {
        let p = w.store().get::<MachinePool>(w.ns(), "workers").await.ok().flatten()?;
        let all = w.machines().await;
        let gone = w.machine(victim).await.is_none() && w.node(victim).await.is_none();
        (gone && all.len() == 1 && p.status.replicas == 1 && p.status.ready_replicas == 1).then_some(())
    })
    .await;
    // The chosen instance was drained before it went, and its Node deleted after it.
    let events = w.events(victim).await;
    let at = |reason: &str| {
        events.iter().find(|e| e.reason == reason).map(|e| e.time).unwrap_or_else(|| panic!("no {reason}: {events:?}"))
    };
    assert!(at("Drained") <= at("DeletingInstance"), "{events:?}");
    assert!(at("DeletingInstance") <= at("NodeDeleted"), "{events:?}");
    let pool_events = w.store().backend().events(&Key::new(Kind::MachinePool, w.ns(), "workers"), 100).await.unwrap();
    assert!(
        pool_events.iter().any(|e| e.reason == "DeletingMachines" && e.message.contains(victim)),
        "{pool_events:?}"
    );
    // Every pod left the chosen node by eviction from a cordoned node; all run on the survivor.
    eventually(MINUTE, "4 pods Ready on the remaining node", || async {
        let pods = w.ready_pods("shop").await;
        (pods.len() == 4 && on(&pods, survivor) == 4).then_some(())
    })
    .await;
    watch.task.abort();
    let uncordoned = watch.uncordoned_evictions.lock().unwrap().clone();
    assert!(uncordoned.is_empty(), "{uncordoned:?}");
    assert!(!has_event(&events, "DrainForced"), "{events:?}");
    // The other instance was left alone: same Machine, same Node, not cordoned.
    let left = pool_machines(&w, "workers").await;
    assert_eq!(left.keys().cloned().collect::<Vec<_>>(), [survivor]);
    assert_eq!(left[survivor].metadata.uid, before[survivor].metadata.uid);
    let node = w.node(survivor).await.unwrap();
    assert_eq!(node.metadata.uid, survivor_node.metadata.uid);
    assert!(!cordoned(&node) && node_ready(&node));
    // The cloud: exactly one instance, capacity 1, nothing created or deleted beyond the change.
    let cloud = w.fake().await.inspect(fake::InspectRequest::default()).await.unwrap().into_inner();
    let p = cloud.pools.iter().find(|p| p.name == "workers").unwrap();
    let ids: Vec<&str> = p.instances.iter().map(|i| i.instance_id.as_str()).collect();
    let survivor_id = survivor.trim_start_matches("workers-");
    assert_eq!((ids, p.capacity), (vec![survivor_id], 1));
    let counters = cloud.counters.unwrap();
    assert_eq!((counters.instances_created, counters.instances_deleted), (2, 1));
    // The pool records the capacity it settled on (its last ApplyPool, a no-op in the cloud).
    eventually(MINUTE, "the pool's status at 1 replica, Ready", || async {
        let p = w.store().get::<MachinePool>(w.ns(), "workers").await.ok().flatten()?;
        let ready =
            condition(&p.status.conditions, ConditionType::Ready).is_some_and(|c| c.status == ConditionStatus::True);
        ((p.status.replicas, p.status.ready_replicas, p.status.applied_capacity) == (1, 1, 1) && ready).then_some(())
    })
    .await;
    // Deleting the pool drains its last node before the pool goes.
    let pools =
        Api::<DynamicObject>::namespaced_with(w.cluster().client.clone(), w.ns(), &ar("MachinePool", "machinepools"));
    pools.delete("workers", &DeleteParams::default()).await.unwrap();
    eventually(2 * MINUTE, "the pool, its Machines and Nodes gone", || async {
        let pool_gone = w.store().get::<MachinePool>(w.ns(), "workers").await.ok()?.is_none();
        (pool_gone && w.machines().await.is_empty() && w.nodes().await.is_empty()).then_some(())
    })
    .await;
    let events = w.events(survivor).await;
    assert!(has_event(&events, "Drained") && has_event(&events, "NodeDeleted"), "{events:?}");
    let cloud = w.fake().await.inspect(fake::InspectRequest::default()).await.unwrap().into_inner();
    assert!(cloud.pools.is_empty(), "the pool is gone from the cloud");
    w.assert_controller_never_forbidden();
    w.kill9().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machine_pool_max_surge_0_upgrade_replaces_drained_instances_instead_of_reimaging() {
    let mut w = World::on_full_cluster(FAST, "nodes").await;
    w.start_controller(&[]);
    w.class().await;
    let pool = |machine_type: &str| {
        json!({"metadata": {"name": "workers"}, "spec": {
            "replicas": 2,
            "template": {"spec": {"classRef": {"name": "small"}, "providerSpec": {"machineType": machine_type}}},
            "strategy": {"maxSurge": 0, "maxUnavailable": 1},
        }})
    };
    let rolled = |ids: &'static [&'static str]| {
        let w = &w;
        move || async move {
            let p = w.store().get::<MachinePool>(w.ns(), "workers").await.ok().flatten()?;
            let names: Vec<String> = pool_machines(w, "workers").await.into_keys().collect();
            let want: Vec<String> = ids.iter().map(|id| format!("workers-{id}")).collect();
            let nodes = w.nodes().await;
            let ready = want
                .iter()
                .all(|n| nodes.iter().any(|node| node.metadata.name.as_ref() == Some(n) && node_ready(node)));
            let done = p.status.replicas == 2 && p.status.ready_replicas == 2 && p.status.updated_replicas == 2;
            (done && names == want && ready && nodes.len() == 2).then_some(())
        }
    };
    w.apply_object("MachinePool", "machinepools", pool("small")).await;
    eventually(2 * MINUTE, "2 pool instances with Ready Nodes", rolled(&["0", "1"])).await;
    w.workload("shop", 2, None).await;
    w.apply_object("MachinePool", "machinepools", pool("large")).await;
    // Each old instance goes through its Machine's deletion (drained first), and a new one on
    // the latest model takes its place: nothing is reimaged under its pods.
    eventually(3 * MINUTE, "both instances replaced on the new model", rolled(&["2", "3"])).await;
    for old in ["workers-0", "workers-1"] {
        let events = w.events(old).await;
        assert!(has_event(&events, "Drained") && has_event(&events, "NodeDeleted"), "{old}: {events:?}");
    }
    let cloud = w.fake().await.inspect(fake::InspectRequest::default()).await.unwrap().into_inner();
    let p = cloud.pools.iter().find(|p| p.name == "workers").unwrap();
    assert!(p.instances.iter().all(|i| i.latest_model_applied), "{p:?}");
    let counters = cloud.counters.unwrap();
    assert_eq!((counters.instances_created, counters.instances_deleted), (4, 2));
    eventually(MINUTE, "2 pods Ready on the new nodes", || async {
        let pods = w.ready_pods("shop").await;
        let on_new = pods.iter().all(|p| {
            let node = p.spec.as_ref().and_then(|s| s.node_name.as_deref()).unwrap_or_default();
            node == "workers-2" || node == "workers-3"
        });
        (pods.len() == 2 && on_new).then_some(())
    })
    .await;
    w.kill9().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deletion_waits_for_the_nodes_volume_attachments_and_a_vanished_node_is_recorded() {
    let mut w = World::on_full_cluster(FAST, "nodes").await;
    w.start_controller(&[]);
    w.class().await;
    w.apply_md("web", 2, json!({"machineType": "small"}), json!({"volumeDetachTimeoutSeconds": 300})).await;
    w.rolled_out("web", 2 * MINUTE).await;
    let mut machines = w.machines().await;
    machines.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let (first, second) = (machines[0].clone(), machines[1].clone());
    // A Node deleted while its VM runs is recorded, not ignored.
    let second_node = second.status.node_ref.clone().unwrap().name;
    Api::<Node>::all(w.cluster().client.clone()).delete(&second_node, &DeleteParams::default()).await.unwrap();
    eventually(MINUTE, "NodeMissing on the machine whose Node vanished", || async {
        let m = w.machine(&second.metadata.name).await?;
        let c = condition(&m.status.conditions, ConditionType::NodeReady)?;
        (c.reason == Reason::NodeMissing && c.status == ConditionStatus::False).then_some(())
    })
    .await;
    assert!(has_event(&w.events(&second.metadata.name).await, "NodeMissing"));
    // A volume still attached to a node holds the VM's delete after the drain.
    let node = first.status.node_ref.clone().unwrap().name;
    w.cluster()
        .apply_json(json!({
            "apiVersion": "storage.k8s.io/v1", "kind": "VolumeAttachment",
            "metadata": {"name": "data-1"},
            "spec": {"attacher": "disk.csi.example.com", "nodeName": node,
                     "source": {"persistentVolumeName": "pv-data-1"}}
        }))
        .await;
    let machines_api =
        Api::<DynamicObject>::namespaced_with(w.cluster().client.clone(), w.ns(), &ar("Machine", "machines"));
    machines_api.delete(&first.metadata.name, &DeleteParams::default()).await.unwrap();
    let held = eventually(MINUTE, "held for the volume", || async {
        let m = w.machine(&first.metadata.name).await?;
        let c = condition(&m.status.conditions, ConditionType::Deleting)?;
        let attached = c.message.contains("1 volume(s) still attached");
        (m.status.deletion.as_ref()?.phase == DeletionPhase::VolumesDetaching && attached).then_some(m)
    })
    .await;
    let c = condition(&held.status.conditions, ConditionType::Deleting).unwrap();
    assert_eq!(c.reason, Reason::WaitingForVolumeDetach);
    let cloud = w.fake().await.inspect(fake::InspectRequest::default()).await.unwrap().into_inner();
    assert!(cloud.machines.iter().any(|vm| vm.name == first.metadata.name), "the VM stays while a volume is attached");
    let vas = Api::<k8s_openapi::api::storage::v1::VolumeAttachment>::all(w.cluster().client.clone());
    vas.delete("data-1", &DeleteParams::default()).await.unwrap();
    eventually(MINUTE, "the machine and its Node gone once the volume detached", || async {
        (w.machine(&first.metadata.name).await.is_none() && w.node(&node).await.is_none()).then_some(())
    })
    .await;
    w.kill9().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_instance_whose_node_never_joins_is_replaced() {
    let mut w = World::on_full_cluster(FAST, "nodes").await;
    w.start_controller(&[]);
    w.class().await;
    w.apply_object(
        "MachinePool",
        "machinepools",
        json!({"metadata": {"name": "workers"}, "spec": {
            "replicas": 1,
            "template": {"spec": {"classRef": {"name": "small"},
                                  "providerSpec": {"machineType": "small", "kubelet": "NeverJoins"}}},
            "nodeStartupTimeoutSeconds": 2,
        }}),
    )
    .await;
    // The instance runs but its Node never joins: Provisioned, then failed and replaced.
    eventually(MINUTE, "workers-0 Provisioned", || async {
        let m = w.machine("workers-0").await?;
        (m.status.phase == Phase::Provisioned).then_some(())
    })
    .await;
    let replaced = eventually(MINUTE, "the instance replaced", || async {
        let cloud = w.fake().await.inspect(fake::InspectRequest::default()).await.ok()?.into_inner();
        let c = cloud.counters?;
        (c.instances_deleted >= 1 && c.instances_created >= 2).then_some(c)
    })
    .await;
    assert!(
        replaced.instances_created - replaced.instances_deleted <= 1,
        "never more than the one instance: {replaced:?}"
    );
    let events = w.events("workers-0").await;
    let e = events.iter().find(|e| e.reason == "NodeNotJoined").unwrap_or_else(|| panic!("{events:?}"));
    assert!(e.message.contains("no Ready Node 2s"), "{}", e.message);
    w.kill9().await;
}

/// A pool's canary whose Node never joins fails: `status.canary` Failed naming the instance and
/// why, `Ready=False` with reason `CanaryFailed`, a `CanaryFailed` event; the failed instance is
/// replaced and no old instance is touched. A new template is a new canary, and the upgrade
/// finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_canary_whose_node_never_joins_stops_the_upgrade_until_the_template_changes() {
    let mut w = World::on_full_cluster(FAST, "nodes").await;
    w.start_controller(&[]);
    w.class().await;
    // Nodes that join get a minute (a loaded machine can take more than 2 s to make one Ready,
    // and a canary failed that way stops the upgrade for good); those that never join, 2 s.
    let pool = |machine_type: &str, kubelet: &str| {
        let startup = if kubelet == "NeverJoins" { 2 } else { 60 };
        json!({"metadata": {"name": "workers"}, "spec": {
            "replicas": 2,
            "template": {"spec": {"classRef": {"name": "small"},
                                  "providerSpec": {"machineType": machine_type, "kubelet": kubelet}}},
            "strategy": {"maxSurge": 1, "maxUnavailable": 0, "canary": {"machines": 1, "pauseSeconds": 1}},
            "nodeStartupTimeoutSeconds": startup,
        }})
    };
    let get = || async { w.store().get::<MachinePool>(w.ns(), "workers").await.ok().flatten() };
    let settled = |p: &MachinePool| {
        (p.status.replicas, p.status.ready_replicas, p.status.updated_replicas) == (2, 2, 2)
            && condition(&p.status.conditions, ConditionType::Ready).is_some_and(|c| c.status == ConditionStatus::True)
    };
    w.apply_object("MachinePool", "machinepools", pool("small", "Joins")).await;
    eventually(2 * MINUTE, "a pool of 2 with Ready Nodes", || async { get().await.filter(settled) }).await;
    let before = pool_machines(&w, "workers").await;
    assert_eq!(before.keys().cloned().collect::<Vec<_>>(), ["workers-0", "workers-1"]);

    w.apply_object("MachinePool", "machinepools", pool("small", "NeverJoins")).await;
    let failed = eventually(2 * MINUTE, "the canary failed", || async {
        get().await.filter(|p| p.status.canary.as_ref().is_some_and(|k| k.phase == CanaryPhase::Failed))
    })
    .await;
    let k = failed.status.canary.clone().unwrap();
    assert_eq!(k.machines, ["workers-2"], "{k:?}");
    assert!(k.message.contains("canary instance 2 of model"), "{}", k.message);
    assert!(k.message.contains("NODE_NOT_JOINED"), "{}", k.message);
    let ready = condition(&failed.status.conditions, ConditionType::Ready).cloned();
    assert!(
        ready.as_ref().is_some_and(|c| c.status == ConditionStatus::False && c.reason == Reason::CanaryFailed),
        "{ready:?}"
    );
    // The failed instance is replaced (its replacement never joins either, and is replaced in
    // turn); the old instances stay as they were.
    eventually(2 * MINUTE, "the failed canary instance replaced", || async {
        let c = w.fake().await.inspect(fake::InspectRequest::default()).await.ok()?.into_inner().counters?;
        (c.instances_deleted >= 1 && c.instances_created >= 4).then_some(())
    })
    .await;
    let now = pool_machines(&w, "workers").await;
    for (name, m) in &before {
        let kept = now.get(name).unwrap_or_else(|| panic!("{name} gone: {:?}", now.keys()));
        assert_eq!(kept.metadata.uid, m.metadata.uid, "{name}");
        assert_eq!(kept.status.phase, Phase::Running, "{name}");
    }
    let p = get().await.unwrap();
    assert_eq!(p.status.canary.as_ref(), Some(&k), "the failed canary is kept as it was");
    let events = w.store().backend().events(&Key::new(Kind::MachinePool, w.ns(), "workers"), 100).await.unwrap();
    let failures: Vec<_> = events.iter().filter(|e| e.reason == "CanaryFailed").collect();
    assert_eq!(failures.len(), 1, "{events:?}");

    // A fixed template: a new model, a new canary, and the upgrade goes on to the end.
    w.apply_object("MachinePool", "machinepools", pool("large", "Joins")).await;
    let done = w
        .wait_seen("the upgrade finished", 3 * MINUTE, || async {
            let p = get().await.ok_or("no pool")?;
            let passed =
                p.status.canary.as_ref().is_some_and(|c| c.phase == CanaryPhase::Passed && c.revision != k.revision);
            if settled(&p) && passed {
                Ok(p)
            } else {
                Err(format!("the pool's status {:?}", p.status))
            }
        })
        .await;
    let passed = done.status.canary.unwrap();
    assert_eq!(passed.wanted, 1);
    let left = pool_machines(&w, "workers").await;
    assert!(before.keys().all(|name| !left.contains_key(name)), "old instances left: {:?}", left.keys());
    w.kill9().await;
}

/// The value of the sample `name{labels}` in a Prometheus text exposition (`labels` as the
/// controller writes them, in order); 0 when absent.
fn sample(metrics: &str, name_and_labels: &str) -> f64 {
    metrics.lines().find_map(|l| l.strip_prefix(name_and_labels)?.strip_prefix(' ')?.trim().parse().ok()).unwrap_or(0.0)
}

/// `controller_target_calls_total` for one verb, resource and code.
fn target_calls(metrics: &str, verb: &str, resource: &str, code: &str) -> f64 {
    sample(
        metrics,
        &format!(
            r#"controller_target_calls_total{{target="default",verb="{verb}",resource="{resource}",code="{code}"}}"#
        ),
    )
}

/// During a drain, `/metrics` counts the controller's calls to the target cluster by verb,
/// resource and code — evictions accepted and refused, the cordon's patch, the budget's reads,
/// the forced deletions — a refusing budget is asked once a pass, and the API server's audit log
/// names the controller (`machine-controller/VERSION`) as the user agent of its evictions and
/// Node patches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drains_calls_are_counted_by_verb_resource_and_code_and_audited_under_the_controllers_name() {
    let mut w = World::on_full_cluster(FAST, "nodes").await;
    let c = w.start_controller(&["--metrics-addr", "127.0.0.1:0"]);
    w.class().await;
    w.apply_md("web", 1, json!({"machineType": "small"}), json!({"drainTimeoutSeconds": 15})).await;
    w.rolled_out("web", 2 * MINUTE).await;
    let m = w.machines().await.remove(0);
    let name = m.metadata.name.clone();
    let node = m.status.node_ref.clone().unwrap().name;
    // Three pods that can only run on this node, under a budget of one disruption: the first
    // eviction is accepted, and its replacement cannot run (the node is cordoned), so the budget
    // refuses every other eviction until the drain's deadline deletes the pods.
    let ns = w.ns().to_string();
    w.cluster()
        .apply_json(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "pinned", "namespace": ns},
            "spec": {
                "replicas": 3,
                "selector": {"matchLabels": {"app": "pinned"}},
                "template": {
                    "metadata": {"labels": {"app": "pinned"}},
                    "spec": {
                        "containers": [{"name": "app", "image": "registry.invalid/app:1"}],
                        "terminationGracePeriodSeconds": 5,
                        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [{"matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}
                    }
                }
            }
        }))
        .await;
    w.cluster()
        .apply_json(json!({
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": "pinned-budget", "namespace": ns},
            "spec": {"selector": {"matchLabels": {"app": "pinned"}}, "maxUnavailable": 1}
        }))
        .await;
    let pdbs = Api::<k8s_openapi::api::policy::v1::PodDisruptionBudget>::namespaced(w.cluster().client.clone(), &ns);
    eventually(2 * MINUTE, "3 pinned pods Ready and their budget allowing one disruption", || async {
        let pdb = pdbs.get_opt("pinned-budget").await.ok().flatten()?;
        let status = pdb.status.as_ref()?;
        let current = status.observed_generation == pdb.metadata.generation;
        let ready = w.ready_pods("pinned").await.len() == 3;
        (ready && current && status.disruptions_allowed == Some(1)).then_some(())
    })
    .await;
    let addr = w.metrics_addr(c).await;

    w.apply_md("web", 0, json!({"machineType": "small"}), json!({"drainTimeoutSeconds": 15})).await;
    eventually(2 * MINUTE, "the machine drained (forced at its deadline) and gone", || async {
        w.machine(&name).await.is_none().then_some(())
    })
    .await;
    let events = w.events(&name).await;
    assert!(has_event(&events, "EvictionBlocked") && has_event(&events, "DrainForced"), "{events:?}");

    // What /metrics says of the drain's calls.
    let metrics = eventually(MINUTE, "/metrics", || async {
        tokio::time::timeout(Duration::from_secs(10), e2e_tests::http_get(addr.port(), "/metrics"))
            .await
            .ok()
            .flatten()
            .filter(|(code, _)| *code == 200)
            .map(|(_, body)| body)
    })
    .await;
    let accepted = target_calls(&metrics, "create", "pods/eviction", "201");
    let refused = target_calls(&metrics, "create", "pods/eviction", "429");
    let budget_reads = target_calls(&metrics, "get", "poddisruptionbudgets", "200");
    let report = || {
        let lines: Vec<&str> = metrics.lines().filter(|l| l.starts_with("controller_target_call")).collect();
        lines.join("\n")
    };
    assert_eq!(accepted, 1.0, "one eviction accepted\n{}", report());
    assert!(refused >= 1.0, "the budget refused the others\n{}", report());
    assert_eq!(budget_reads, refused, "the budget is read once per refusing pass, its other pod spared\n{}", report());
    assert!(target_calls(&metrics, "patch", "nodes", "200") >= 1.0, "the cordon\n{}", report());
    assert!(target_calls(&metrics, "delete", "pods", "200") >= 2.0, "the forced deletions\n{}", report());
    assert!(target_calls(&metrics, "delete", "nodes", "200") >= 1.0, "the Node after its VM\n{}", report());
    assert!(target_calls(&metrics, "list", "pods", "200") >= 1.0, "the node's pods\n{}", report());
    assert!(target_calls(&metrics, "watch", "nodes", "200") >= 1.0, "the Node watch\n{}", report());
    let timed =
        r#"controller_target_call_duration_seconds_count{target="default",verb="create",resource="pods/eviction"}"#;
    assert_eq!(sample(&metrics, timed), accepted + refused, "every eviction timed\n{}", report());

    // What the API server's audit log says of them: the controller by name.
    let agent = machine_controller::store::kubernetes::USER_AGENT;
    assert!(agent.starts_with("machine-controller/") && agent.len() > "machine-controller/".len(), "{agent}");
    let audit = w.cluster().audit_events();
    let of = |verb: &str, resource: &str, sub: Option<&str>| -> Vec<&Value> {
        audit
            .iter()
            .filter(|e| {
                let r = &e["objectRef"];
                e["verb"] == verb && r["resource"] == resource && r["subresource"].as_str() == sub
            })
            .collect()
    };
    let evictions = of("create", "pods", Some("eviction"));
    let agents: std::collections::BTreeSet<&str> =
        evictions.iter().map(|e| e["userAgent"].as_str().unwrap_or_default()).collect();
    assert_eq!(agents, [agent].into(), "every eviction names the controller");
    let codes = |events: &[&Value], code: i64| events.iter().filter(|e| e["responseStatus"]["code"] == code).count();
    assert_eq!(codes(&evictions, 201) as f64, accepted, "the audit log and /metrics agree");
    assert_eq!(codes(&evictions, 429) as f64, refused, "the audit log and /metrics agree");
    let asked: std::collections::BTreeSet<&str> =
        evictions.iter().map(|e| e["objectRef"]["name"].as_str().unwrap_or_default()).collect();
    assert_eq!(asked.len(), 2, "the third pod was never asked while its budget refused: {asked:?}");
    let patches: Vec<&Value> =
        of("patch", "nodes", None).into_iter().filter(|e| e["objectRef"]["name"] == node.as_str()).collect();
    assert!(
        patches.iter().any(|e| e["userAgent"] == agent && e["responseStatus"]["code"] == 200),
        "the cordon names the controller: {patches:?}"
    );
    assert!(
        patches.iter().all(|e| !e["userAgent"].as_str().unwrap_or_default().is_empty()),
        "no anonymous patch of the Node: {patches:?}"
    );
    let budget_gets = of("get", "poddisruptionbudgets", None).into_iter().filter(|e| e["userAgent"] == agent).count();
    assert_eq!(budget_gets as f64, budget_reads, "the audit log and /metrics agree");
    w.kill9().await;
}

// ------------------------------------------------------------------- in-place updates that drain

/// A Node's state as a watch saw it: (boot ID, Ready, cordoned by the controller).
type NodeState = (String, bool, bool);

/// Every state a watch saw of each Node.
struct NodeWatch {
    seen: Arc<Mutex<BTreeMap<String, Vec<NodeState>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl NodeWatch {
    fn start(w: &World) -> NodeWatch {
        let seen = Arc::new(Mutex::new(BTreeMap::<String, Vec<NodeState>>::new()));
        let nodes = Api::<Node>::all(w.cluster().client.clone());
        let record = seen.clone();
        let task = tokio::spawn(async move {
            let mut stream = std::pin::pin!(watcher(nodes, watcher::Config::default()));
            while let Some(Ok(event)) = stream.next().await {
                if let watcher::Event::Apply(n) | watcher::Event::InitApply(n) = event {
                    let boot = n.status.as_ref().and_then(|s| s.node_info.as_ref()).map(|i| i.boot_id.clone());
                    let state = (boot.unwrap_or_default(), node_ready(&n), cordoned(&n));
                    let mut seen = record.lock().unwrap();
                    let states = seen.entry(n.metadata.name.clone().unwrap_or_default()).or_default();
                    if states.last() != Some(&state) {
                        states.push(state);
                    }
                }
            }
        });
        NodeWatch { seen, task }
    }
}

/// The boot ID a Node shows (`status.nodeInfo.bootID`; empty when none).
fn boot_id(n: &Node) -> String {
    n.status.as_ref().and_then(|s| s.node_info.as_ref()).map(|i| i.boot_id.clone()).unwrap_or_default()
}

/// An InPlace deployment of `replicas` fake machines whose in-place changes do `disruption`
/// (the fake driver's `inPlaceDisruption`), rolled out, with a workload of `pods` under a
/// PodDisruptionBudget `maxUnavailable: 1` watched from the start.
async fn in_place_fleet(w: &World, replicas: i64, disruption: &str, pods: i32) -> PodWatch {
    w.class().await;
    let strategy = json!({"strategy": {"type": "InPlace", "inPlace": {"maxUnavailable": 1}}});
    let spec = json!({"machineType": "small", "tags": {"os": "1"}, "inPlaceDisruption": disruption});
    w.apply_md("web", replicas, spec, strategy).await;
    w.rolled_out("web", 2 * MINUTE).await;
    w.workload("shop", pods, Some(json!({"maxUnavailable": 1}))).await;
    let watch = PodWatch::start(w, "shop");
    let n = pods as usize;
    eventually(MINUTE, "the pod watch to see every pod Ready", || async {
        (*watch.ready.lock().unwrap() == n && *watch.min_ready.lock().unwrap() == n).then_some(())
    })
    .await;
    watch
}

/// Moves the fleet to tag `os: 2` in place, keeping `disruption`, and waits until every machine
/// runs it.
async fn update_in_place(w: &World, replicas: i64, disruption: &str) {
    update_in_place_to(w, replicas, disruption, "2").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebooting_in_place_update_drains_one_node_at_a_time_and_uncordons_it_when_it_is_back() {
    let mut w = World::on_full_cluster(FAST, "nodes").await;
    w.start_controller(&[]);
    let pods = in_place_fleet(&w, 3, "Reboot", 6).await;
    let before: BTreeMap<String, String> =
        w.nodes().await.iter().map(|n| (n.metadata.name.clone().unwrap(), boot_id(n))).collect();
    assert!(before.values().all(|b| !b.is_empty()), "the fake's Nodes carry a boot ID: {before:?}");
    let names: Vec<String> = w.machines().await.iter().map(|m| m.metadata.name.clone()).collect();
    let created = w.fake().await.inspect(fake::InspectRequest::default()).await.unwrap().into_inner();
    let nodes = NodeWatch::start(&w);
    // Machines not Running (Updating from the cordon to the uncordon), at every Machine event.
    let most_down = Arc::new(Mutex::new(0usize));
    let machines_watch = {
        let (most_down, api) = (
            most_down.clone(),
            Api::<DynamicObject>::namespaced_with(w.cluster().client.clone(), w.ns(), &ar("Machine", "machines")),
        );
        tokio::spawn(async move {
            let mut phases: BTreeMap<String, String> = BTreeMap::new();
            let mut events = std::pin::pin!(watcher(api, watcher::Config::default()));
            while let Some(Ok(event)) = events.next().await {
                if let watcher::Event::Apply(m) | watcher::Event::InitApply(m) = event {
                    let phase = m.data["status"]["phase"].as_str().unwrap_or("").to_string();
                    phases.insert(m.metadata.name.clone().unwrap_or_default(), phase);
                    let down = phases.values().filter(|p| *p != "Running").count();
                    let mut most = most_down.lock().unwrap();
                    *most = (*most).max(down);
                }
            }
        })
    };
    update_in_place(&w, 3, "Reboot").await;
    pods.task.abort();
    nodes.task.abort();
    machines_watch.abort();
    let most_down = *most_down.lock().unwrap();
    assert_eq!(most_down, 1, "maxUnavailable 1: one machine down at a time, and one was");

    // The PodDisruptionBudget held: never more than one pod down; none left an uncordoned node.
    let min_ready = *pods.min_ready.lock().unwrap();
    assert!(min_ready >= 5, "one pod down at a time, but the watch saw only {min_ready} Ready");
    let uncordoned = pods.uncordoned_evictions.lock().unwrap().clone();
    assert!(uncordoned.is_empty(), "{uncordoned:?}");
    // Each Node: cordoned on its old boot, back with a new boot ID, and uncordoned only once Ready.
    let seen = nodes.seen.lock().unwrap().clone();
    for (node, old_boot) in &before {
        let states = &seen[node];
        let cordoned_first = states.iter().any(|(b, _, c)| b == old_boot && *c);
        assert!(cordoned_first, "{node} cordoned before its reboot: {states:?}\n{}", w.logs());
        let (boot, ready, cordoned) = states.last().unwrap().clone();
        assert!(boot != *old_boot && ready && !cordoned, "{node} back, rebooted and uncordoned: {states:?}");
        let first_uncordoned_after = states.iter().find(|(b, _, c)| b != old_boot && !*c).unwrap();
        assert!(first_uncordoned_after.1, "{node} uncordoned only once Ready: {states:?}");
    }
    // Same machines, same VMs: nothing was created or replaced.
    let after = w.fake().await.inspect(fake::InspectRequest::default()).await.unwrap().into_inner();
    let counters = |c: &fake::InspectResponse| c.counters.unwrap_or_default();
    assert_eq!(counters(&after).machines_created, counters(&created).machines_created, "no VM was created");
    assert_eq!(sorted(w.machines().await.iter().map(|m| m.metadata.name.clone()).collect()), sorted(names));
    for m in w.machines().await {
        let events = w.events(&m.metadata.name).await;
        for reason in ["DrainingForUpdate", "Drained", "Uncordoned"] {
            assert!(has_event(&events, reason), "{}: no {reason} event", m.metadata.name);
        }
        assert!(!has_event(&events, "DrainForced"), "every pod left by eviction");
    }
    w.assert_controller_never_forbidden();
    w.kill9().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_that_disrupts_nothing_evicts_no_pod_and_an_unsaid_one_drains_as_a_reboot() {
    let mut w = World::on_full_cluster(FAST, "nodes").await;
    w.start_controller(&[]);
    let pods = in_place_fleet(&w, 2, "None", 4).await;
    let nodes = NodeWatch::start(&w);
    update_in_place(&w, 2, "None").await;
    assert_eq!(*pods.min_ready.lock().unwrap(), 4, "no pod was evicted");
    let seen = nodes.seen.lock().unwrap().clone();
    assert!(seen.values().flatten().all(|(_, _, c)| !c), "no Node was cordoned: {seen:?}");
    for m in w.machines().await {
        let events = w.events(&m.metadata.name).await;
        assert!(!has_event(&events, "DrainingForUpdate"), "{}: {events:?}", m.metadata.name);
        assert_eq!(m.metadata.annotations.get(ANNOTATION_IN_PLACE_DISRUPTION).map(String::as_str), Some("None"));
    }

    // A driver that does not say (older than the field) is drained as for a reboot.
    update_in_place_to(&w, 2, "Unset", "3").await;
    pods.task.abort();
    nodes.task.abort();
    assert!(*pods.min_ready.lock().unwrap() >= 3, "the budget held");
    for m in w.machines().await {
        let events = w.events(&m.metadata.name).await;
        assert!(has_event(&events, "DrainingForUpdate") && has_event(&events, "Uncordoned"), "{events:?}");
        assert_eq!(m.metadata.annotations.get(ANNOTATION_IN_PLACE_DISRUPTION).map(String::as_str), Some("Reboot"));
    }
    w.kill9().await;
}

/// [`update_in_place`] to tag `os` = `tag`.
async fn update_in_place_to(w: &World, replicas: i64, disruption: &str, tag: &str) {
    let strategy = json!({"strategy": {"type": "InPlace", "inPlace": {"maxUnavailable": 1}}});
    let spec = json!({"machineType": "small", "tags": {"os": tag}, "inPlaceDisruption": disruption});
    w.apply_md("web", replicas, spec, strategy).await;
    eventually(4 * MINUTE, "every machine updated in place and Running", || async {
        let machines = w.machines().await;
        let done = machines.iter().all(|m| {
            m.status.phase == Phase::Running
                && m.status.in_place.is_none()
                && m.status.observed_generation == m.metadata.generation
                && m.spec.provider_spec.as_ref().is_some_and(|s| s["tags"]["os"] == tag)
        });
        (machines.len() == replicas as usize && done).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_place_drain_resumes_after_kill_9_with_the_same_deadline() {
    let mut w = World::on_full_cluster(FAST, "nodes").await;
    w.start_controller(&[]);
    w.class().await;
    let strategy =
        json!({"strategy": {"type": "InPlace", "inPlace": {"maxUnavailable": 1}}, "drainTimeoutSeconds": 25});
    let spec = |os: &str| json!({"machineType": "small", "tags": {"os": os}, "inPlaceDisruption": "Reboot"});
    w.apply_md("web", 1, spec("1"), strategy.clone()).await;
    w.rolled_out("web", 2 * MINUTE).await;
    let name = w.machines().await.remove(0).metadata.name;
    // One pod that must stay: the drain is held until its deadline.
    w.workload("db", 1, Some(json!({"minAvailable": 1}))).await;
    eventually(MINUTE, "the pod Ready", || async { (w.ready_pods("db").await.len() == 1).then_some(()) }).await;
    w.apply_md("web", 1, spec("2"), strategy).await;
    let first = eventually(MINUTE, "the in-place drain held by the budget", || async {
        let m = w.machine(&name).await?;
        let p = m.status.in_place.clone()?;
        (p.phase == InPlacePhase::Draining && p.blocked_by.contains("PodDisruptionBudget")).then_some(p)
    })
    .await;
    let m = w.machine(&name).await.unwrap();
    let c = condition(&m.status.conditions, ConditionType::UpToDate).unwrap();
    assert_eq!(c.reason, Reason::DisruptionBudgetUnsatisfiable, "UpToDate says what blocks: {}", c.message);
    assert_eq!(m.status.phase, Phase::Updating);
    // `describe` and `kubectl describe` show the step, the pods left and what blocks.
    let (code, out, err) = w.cli(&["describe", "machine", &name, "-n", w.ns()]).await;
    assert_eq!(code, 0, "{err}");
    for line in
        ["In-place update: Draining", "(the driver says: Reboot)", "pods left:  1", "blocked by: PodDisruptionBudget"]
    {
        assert!(out.contains(line), "describe shows {line:?}:\n{out}");
    }
    let (code, out, err) = w.cluster().kubectl(&["describe", "machine", "-n", w.ns(), &name]).await;
    assert_eq!(code, 0, "{err}");
    let in_place = out.split("In Place:").nth(1).unwrap_or_else(|| panic!("kubectl describe shows inPlace:\n{out}"));
    for (field, value) in [("Phase:", "Draining"), ("Disruption:", "Reboot"), ("Pods Left:", "1")] {
        let shown = in_place.lines().any(|l| l.trim().strip_prefix(field).is_some_and(|v| v.trim() == value));
        assert!(shown, "kubectl describe shows {field} {value}:\n{out}");
    }
    assert!(in_place.contains("Blocked By:      PodDisruptionBudget"), "{out}");
    if std::env::var_os("SHOW_DESCRIBE").is_some() {
        eprintln!("{}", w.cli(&["describe", "machine", &name, "-n", w.ns()]).await.1);
    }
    w.kill9().await;
    w.start_controller(&[]);
    let resumed = eventually(MINUTE, "the new process at work on the same drain", || async {
        let m = w.machine(&name).await?;
        let p = m.status.in_place.clone()?;
        (w.controller_log(1).contains("running") && p.phase == InPlacePhase::Draining).then_some(p)
    })
    .await;
    assert_eq!(resumed.drain_started, first.drain_started, "the drain did not start over");
    assert_eq!(resumed.drain_deadline, first.drain_deadline, "the deadline did not move");
    eventually(2 * MINUTE, "updated after the forced drain, and Running", || async {
        let m = w.machine(&name).await?;
        (m.status.phase == Phase::Running && m.status.in_place.is_none()).then_some(())
    })
    .await;
    let events = w.events(&name).await;
    let forced = events.iter().find(|e| e.reason == "DrainForced").expect("a DrainForced event");
    assert!(forced.time >= first.drain_deadline - chrono::Duration::seconds(6), "forced at {}", forced.time);
    let cloud = w.fake().await.inspect(fake::InspectRequest::default()).await.unwrap().into_inner();
    assert_eq!(cloud.counters.unwrap_or_default().machines_created, 1, "updated, not replaced");
    w.kill9().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_place_update_that_fails_fails_its_machine_which_is_replaced_and_counted_against_the_revision() {
    let mut w = World::on_full_cluster(FAST, "nodes").await;
    w.start_controller(&[]);
    w.class().await;
    let settings = json!({"strategy": {"type": "InPlace", "inPlace": {"maxUnavailable": 1}}, "failureBudget": 1});
    let spec = |os: &str| json!({"machineType": "small", "tags": {"os": os}, "inPlaceDisruption": "Reboot"});
    w.apply_md("web", 2, spec("1"), settings.clone()).await;
    let good = w.rolled_out("web", 2 * MINUTE).await;
    let before: Vec<String> = w.machines().await.iter().map(|m| m.metadata.name.clone()).collect();
    // The cloud accepts the update, then its operation ends with an error that blames the spec.
    w.set_faults(vec![fake::FaultRule {
        rpc: "UpdateMachine".into(),
        target: "*".into(),
        action: "fail_operation".into(),
        code: "INVALID_ARGUMENT".into(),
        reason: "IMAGE_NOT_BOOTABLE".into(),
        message: "the image does not boot".into(),
        ..Default::default()
    }])
    .await;
    w.apply_md("web", 2, spec("2"), settings).await;
    let md = eventually(3 * MINUTE, "the revision aborted and rolled back", || async {
        let md = w.store().get::<MachineDeployment>(w.ns(), "web").await.ok().flatten()?;
        (!md.status.bad_revisions.is_empty() && e2e_tests::rolled_out(&md)).then_some(md)
    })
    .await;
    assert_eq!(md.status.target_revision, good.status.target_revision, "back on the good revision");
    let after = w.machines().await;
    assert!(after.iter().all(|m| m.metadata.labels.get(LABEL_REVISION) == Some(&good.status.target_revision)));
    // Exactly one machine was touched: it failed its update after its drain and was replaced;
    // the other was never drained.
    let replaced: Vec<&String> = before.iter().filter(|n| !after.iter().any(|m| &m.metadata.name == *n)).collect();
    assert_eq!(replaced.len(), 1, "one machine replaced: {replaced:?}");
    let kept = before.iter().find(|n| !replaced.contains(n)).unwrap();
    assert!(!has_event(&w.events(kept).await, "DrainingForUpdate"), "the other machine was not touched");
    let api = Api::<k8s_openapi::api::events::v1::Event>::namespaced(w.cluster().client.clone(), w.ns());
    let notes: Vec<(String, String)> = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
        .collect();
    let failed =
        notes.iter().find(|(r, _)| r == "UpdateFailed").unwrap_or_else(|| panic!("no UpdateFailed: {notes:?}"));
    assert!(failed.1.contains("IMAGE_NOT_BOOTABLE"), "{failed:?}");
    assert!(notes.iter().any(|(r, _)| r == "DrainingForUpdate"), "drained before the update: {notes:?}");
    assert!(notes.iter().any(|(r, _)| r == "RolloutAborted"), "{notes:?}");
    w.kill9().await;
}

/// When kwok last heart-beat the Node (its Ready condition's `lastHeartbeatTime`).
fn last_heartbeat(n: &Node) -> Option<k8s_openapi::jiff::Timestamp> {
    let conditions = n.status.as_ref()?.conditions.as_ref()?;
    conditions.iter().find(|c| c.type_ == "Ready")?.last_heartbeat_time.as_ref().map(|t| t.0)
}

/// The fake driver alone on a full cluster (no controller): it states what an in-place update
/// disrupts as the provider spec's `inPlaceDisruption` says, and an update that says `Reboot`
/// reboots the VM: its Node posts a new `status.nodeInfo.bootID` and stays Ready; one that says
/// `None` does not. kwok keeps the bootID the fake set, through registration (its
/// node-initialize stage) and its heartbeats: a watch sees every value the Node had, and none
/// goes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_place_update_that_reboots_gives_the_node_a_new_boot_id_which_kwok_keeps() {
    use driver_sdk::convert::json_to_struct;
    use driver_sdk::proto as pb;
    use driver_sdk::OperationExt;

    let cluster = Cluster::start_full().await;
    let kubeconfig = cluster.kubeconfig.to_string_lossy().into_owned();
    let mut args = FAST.to_vec();
    args.extend(["--join-cluster", &kubeconfig]);
    let sidecar = e2e_tests::Sidecar::start("fake-driver", &args).await;
    let client = sidecar.client().await;
    let nodes = Api::<Node>::all(cluster.client.clone());
    // Every boot ID the Node shows, in order, from before it registers.
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let watch = {
        let (seen, nodes) = (seen.clone(), nodes.clone());
        tokio::spawn(async move {
            let config = watcher::Config::default().fields("metadata.name=m1");
            let mut events = std::pin::pin!(watcher(nodes, config));
            while let Some(e) = events.next().await {
                if let Ok(watcher::Event::Apply(n) | watcher::Event::InitApply(n)) = e {
                    let b = boot_id(&n);
                    let mut seen = seen.lock().unwrap();
                    if seen.last() != Some(&b) {
                        seen.push(b);
                    }
                }
            }
        })
    };
    let wait = |op: pb::Operation| {
        let client = &client;
        async move {
            let op = e2e_tests::wait_done(client, op, None, MINUTE, Duration::from_millis(200)).await;
            assert!(op.error_report().is_none(), "{} failed: {:?}", op.name, op.error_report());
        }
    };
    let spec = json!({"machineType": "small"});
    let boot_data = cluster.boot_data_with_a_new_token().await;
    let create = pb::CreateMachineRequest {
        name: "m1".into(),
        provider_spec: Some(json_to_struct(&spec)),
        secrets: Some(pb::Secrets { data: [("userData".to_string(), boot_data)].into() }),
        ..Default::default()
    };
    wait(client.create_machine(create).await.expect("CreateMachine").value).await;
    let first = eventually(MINUTE, "m1's Node Ready (kwok) with a boot ID", || async {
        let n = nodes.get_opt("m1").await.ok()??;
        (node_ready(&n) && !boot_id(&n).is_empty()).then(|| boot_id(&n))
    })
    .await;

    // What CanUpdateMachine says is the spec's choice; absent, None.
    let plan = |desired: Value| {
        let (client, spec) = (&client, &spec);
        async move {
            let req = pb::CanUpdateMachineRequest {
                name: "m1".into(),
                current_provider_spec: Some(json_to_struct(spec)),
                desired_provider_spec: Some(json_to_struct(&desired)),
                secrets: None,
            };
            let plan = client.can_update_machine(req).await.expect("CanUpdateMachine").value;
            assert!(plan.replace_paths.is_empty(), "{plan:?}");
            plan.disruption
        }
    };
    for (knob, want) in [
        (None, pb::InPlaceDisruption::None),
        (Some("Drain"), pb::InPlaceDisruption::Drain),
        (Some("Reboot"), pb::InPlaceDisruption::Reboot),
        (Some("Unset"), pb::InPlaceDisruption::Unspecified),
    ] {
        let mut desired = json!({"machineType": "medium"});
        if let Some(k) = knob {
            desired["inPlaceDisruption"] = json!(k);
        }
        assert_eq!(plan(desired).await, want as i32, "{knob:?}");
    }
    let bad = json!({"machineType": "small", "inPlaceDisruption": "Sometimes"});
    let req = pb::CanUpdateMachineRequest {
        name: "m1".into(),
        current_provider_spec: Some(json_to_struct(&spec)),
        desired_provider_spec: Some(json_to_struct(&bad)),
        secrets: None,
    };
    let err = client.can_update_machine(req).await.expect_err("an unknown inPlaceDisruption");
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    let fields: Vec<&str> = err.report.violations.iter().map(|v| v.field.as_str()).collect();
    assert!(fields.contains(&"desired_provider_spec.inPlaceDisruption"), "the violation names the field: {err}");

    // An update that disrupts nothing keeps the boot; one that reboots gets a new one.
    let update = |desired: Value| pb::UpdateMachineRequest {
        name: "m1".into(),
        provider_spec: Some(json_to_struct(&desired)),
        secrets: None,
    };
    let quiet = json!({"machineType": "medium", "inPlaceDisruption": "None"});
    wait(client.update_machine(update(quiet)).await.expect("UpdateMachine").value).await;
    let rebooting = json!({"machineType": "large", "inPlaceDisruption": "Reboot"});
    wait(client.update_machine(update(rebooting)).await.expect("UpdateMachine").value).await;
    let (second, at) = eventually(MINUTE, "m1's Node with a new boot ID, Ready", || async {
        let n = nodes.get_opt("m1").await.ok()??;
        let b = boot_id(&n);
        (b != first && !b.is_empty() && node_ready(&n)).then(|| (b, k8s_openapi::jiff::Timestamp::now()))
    })
    .await;
    // kwok heart-beats the Node (every 20-45 s) and leaves the boot ID alone.
    let n = eventually(2 * MINUTE, "a kwok heartbeat after the reboot", || async {
        let n = nodes.get_opt("m1").await.ok()??;
        last_heartbeat(&n).is_some_and(|t| t > at).then_some(n)
    })
    .await;
    assert_eq!(boot_id(&n), second, "the heartbeat kept the boot ID");
    assert!(node_ready(&n));
    let seen = seen.lock().unwrap().clone();
    watch.abort();
    // Possibly an empty one first (a watch event of the create, before kwok's status): never
    // one that goes back.
    let seen: Vec<&String> = seen.iter().filter(|b| !b.is_empty()).collect();
    assert_eq!(seen, [&first, &second], "every boot ID m1's Node had, in order (the None update kept the boot)");
    let log = std::fs::read_to_string(&sidecar.log).unwrap_or_default();
    assert_eq!(log.matches("Node rebooted: new boot ID posted").count(), 1, "posted once, never again:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_place_canary_updates_one_machine_and_pauses_before_the_rest_follow() {
    let mut w = World::on_full_cluster(FAST, "nodes").await;
    w.start_controller(&[]);
    w.class().await;
    let strategy = json!({"strategy": {
        "type": "InPlace",
        "inPlace": {"maxUnavailable": 1},
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0, "canary": {"machines": 1, "pauseSeconds": 8}},
    }});
    let spec = |os: &str| json!({"machineType": "small", "tags": {"os": os}, "inPlaceDisruption": "Reboot"});
    w.apply_md("web", 3, spec("1"), strategy.clone()).await;
    w.rolled_out("web", 2 * MINUTE).await;
    let names = sorted(w.machines().await.iter().map(|m| m.metadata.name.clone()).collect());
    w.apply_md("web", 3, spec("2"), strategy).await;
    let md = || async { w.store().get::<MachineDeployment>(w.ns(), "web").await.ok().flatten() };
    let on_new = |m: &Machine| {
        m.spec.provider_spec.as_ref().is_some_and(|s| s["tags"]["os"] == "2")
            && m.status.observed_generation == m.metadata.generation
    };
    let pausing = eventually(2 * MINUTE, "the canary updated in place and pausing", || async {
        let k = md().await?.status.canary?;
        (k.phase == CanaryPhase::Pausing).then_some(k)
    })
    .await;
    assert_eq!(pausing.machines.len(), 1, "{pausing:?}");
    let moved: Vec<String> = w.machines().await.iter().filter(|m| on_new(m)).map(|m| m.metadata.name.clone()).collect();
    assert_eq!(moved, pausing.machines, "only the canary is on the new template while it pauses");
    eventually(3 * MINUTE, "every machine updated in place", || async {
        let machines = w.machines().await;
        let done =
            machines.iter().all(|m| on_new(m) && m.status.phase == Phase::Running && m.status.in_place.is_none());
        (machines.len() == 3 && done).then_some(())
    })
    .await;
    assert_eq!(md().await.unwrap().status.canary.map(|k| k.phase), Some(CanaryPhase::Passed));
    assert_eq!(
        sorted(w.machines().await.iter().map(|m| m.metadata.name.clone()).collect()),
        names,
        "updated, not replaced"
    );
    // The others were drained only after the canary's pause was over.
    let until = pausing.pause_until.expect("a pause end");
    for name in names.iter().filter(|n| !pausing.machines.contains(n)) {
        let events = w.events(name).await;
        let drained = events.iter().find(|e| e.reason == "DrainingForUpdate").expect("drained for its update");
        assert!(drained.time >= until, "{name} drained at {} before the canary's pause ended at {until}", drained.time);
    }
    w.kill9().await;
}
