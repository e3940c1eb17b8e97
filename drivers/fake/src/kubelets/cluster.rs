//! The Kubernetes side of the [kubelets](super) (cargo feature `join-cluster`): the Node a VM
//! registers, the stopped mark, and the task that keeps the cluster in step with the cloud.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, NodeAddress, NodeCondition, NodeSpec, NodeStatus, NodeSystemInfo};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::{watcher, WatchStreamExt};
use serde_json::{json, Value};

use super::join::{self, BootData, Pending};
use super::{
    capacity, plan, KubeletMode, Vm, CLOUD_ANNOTATION, KWOK_ANNOTATION, MAX_PODS, PROVIDER_PREFIX, SETTLE,
    STOPPED_MESSAGE, STOPPED_REASON, TICK,
};
use crate::FakeDriver;

/// The kubelet's node conditions, which the node lifecycle controller turns Unknown.
const KUBELET_CONDITIONS: [&str; 4] = ["Ready", "MemoryPressure", "DiskPressure", "PIDPressure"];
/// Creates and marks under way at once.
const CONCURRENCY: usize = 8;
/// A warning about the same subject is repeated at most this often (else logged at debug).
const WARN_EVERY: Duration = Duration::from_secs(30);
/// Connect timeout of the kubelets' API calls (not the watch): a slow API server delays a
/// registration, never the task for long.
const API_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Read and write timeout of the kubelets' API calls (not the watch).
const API_CALL_TIMEOUT: Duration = Duration::from_secs(15);
/// Nodes per page when the Nodes registered before a restart are listed.
const LIST_PAGE_SIZE: u32 = 500;
/// The `User-Agent` of the kubelets' requests: an audit log tells their Node writes from the
/// controller's, as it tells a real kubelet's (`kubelet/VERSION`).
const USER_AGENT: &str = concat!("fake-driver-kubelet/", env!("CARGO_PKG_VERSION"));

/// The Node a VM's kubelet registers (with no labels or taints of its boot data: [`node_with`]).
pub fn node(vm: &Vm, cloud_id: &str) -> Node {
    node_with(vm, cloud_id, &BootData::default())
}

/// The Node a VM's kubelet registers, with the labels (`--node-labels`) and taints
/// (`--register-with-taints`) of its boot data `boot`.
pub fn node_with(vm: &Vm, cloud_id: &str, boot: &BootData) -> Node {
    let (cpu, memory) = capacity(&vm.machine_type);
    let resources: BTreeMap<String, Quantity> = [("cpu", cpu), ("memory", memory), ("pods", MAX_PODS)]
        .into_iter()
        .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
        .collect();
    let labels = [
        ("kubernetes.io/hostname", vm.hostname.as_str()),
        ("kubernetes.io/os", "linux"),
        ("kubernetes.io/arch", "amd64"),
        ("node.kubernetes.io/instance-type", vm.machine_type.as_str()),
        ("topology.kubernetes.io/zone", vm.zone.as_str()),
    ];
    let mut annotations = BTreeMap::from([(CLOUD_ANNOTATION.to_string(), cloud_id.to_string())]);
    let mut conditions = None;
    match vm.kubelet {
        KubeletMode::JoinsNotReady => {
            let now = Time(k8s_openapi::jiff::Timestamp::now());
            conditions = Some(vec![NodeCondition {
                type_: "Ready".into(),
                status: "False".into(),
                reason: Some("KubeletNotReady".into()),
                message: Some(
                    "container runtime network not ready: NetworkReady=false reason:NetworkPluginNotReady \
                     message:Network plugin returns error: cni plugin not initialized"
                        .into(),
                ),
                last_heartbeat_time: Some(now.clone()),
                last_transition_time: Some(now),
            }]);
        }
        KubeletMode::Joins | KubeletMode::NeverJoins => {
            annotations.insert(KWOK_ANNOTATION.into(), "fake".into());
        }
    }
    let mut labels: BTreeMap<String, String> =
        labels.into_iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    labels.extend(boot.labels.clone());
    let taints = (!boot.taints.is_empty()).then(|| boot.taints.clone());
    Node {
        metadata: ObjectMeta {
            name: Some(vm.hostname.clone()),
            labels: Some(labels),
            annotations: Some(annotations),
            ..ObjectMeta::default()
        },
        spec: Some(NodeSpec { provider_id: Some(vm.provider_id.clone()), taints, ..NodeSpec::default() }),
        status: Some(NodeStatus {
            capacity: Some(resources.clone()),
            allocatable: Some(resources),
            addresses: Some(vec![
                NodeAddress { type_: "InternalIP".into(), address: vm.ip.clone() },
                NodeAddress { type_: "Hostname".into(), address: vm.hostname.clone() },
            ]),
            conditions,
            // What a kubelet reads of its machine; kwok fills in the versions it leaves empty.
            node_info: Some(NodeSystemInfo {
                architecture: "amd64".into(),
                boot_id: vm.boot_id.clone(),
                operating_system: "linux".into(),
                ..NodeSystemInfo::default()
            }),
            ..NodeStatus::default()
        }),
    }
}

/// The boot ID `node` shows (`status.nodeInfo.bootID`; empty when it shows none).
pub fn boot_id(node: &Node) -> &str {
    node.status.as_ref().and_then(|s| s.node_info.as_ref()).map_or("", |i| i.boot_id.as_str())
}

/// The `nodes/status` merge patch a VM's kubelet posts after a reboot: its new boot ID.
pub fn reboot_status_patch(vm: &Vm) -> Value {
    json!({"status": {"nodeInfo": {"bootID": vm.boot_id}}})
}

/// Whether `node` is one of the fake cloud's (its provider ID was issued by a fake cloud).
pub fn is_fake(node: &Node) -> bool {
    node.spec.as_ref().and_then(|s| s.provider_id.as_deref()).is_some_and(|p| p.starts_with(PROVIDER_PREFIX))
}

/// The `nodes/status` strategic-merge patch that marks `node` as a kubelet that stopped posting
/// status, or `None` when it is marked already: every kubelet condition it has (and `Ready` in
/// any case) turns `Unknown` / [`STOPPED_REASON`], keeping its last heartbeat time, and
/// `status.phase` (set by kwok only) goes, so that no kwok stage matches the Node any more.
pub fn stopped_status_patch(node: &Node, now: &Time) -> Option<Value> {
    let status = node.status.as_ref();
    let phase = status.and_then(|s| s.phase.as_ref()).is_some();
    let existing = status.and_then(|s| s.conditions.as_deref()).unwrap_or_default();
    let mut conditions = Vec::new();
    for t in KUBELET_CONDITIONS {
        let current = existing.iter().find(|c| c.type_ == t);
        if current.is_none() && t != "Ready" {
            continue;
        }
        if current.is_some_and(|c| c.status == "Unknown" && c.reason.as_deref() == Some(STOPPED_REASON)) {
            continue;
        }
        let mut c = json!({"type": t, "status": "Unknown", "reason": STOPPED_REASON, "message": STOPPED_MESSAGE});
        if current.is_none_or(|c| c.status != "Unknown") {
            c["lastTransitionTime"] = serde_json::to_value(now).unwrap_or(Value::Null);
        }
        conditions.push(c);
    }
    if conditions.is_empty() && !phase {
        return None;
    }
    let mut patch = json!({"status": {"conditions": conditions}});
    if phase {
        patch["status"]["phase"] = Value::Null;
    }
    Some(patch)
}

/// Whether `node` carries the kwok annotation.
fn kwok_annotated(node: &Node) -> bool {
    node.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(KWOK_ANNOTATION))
}

/// Whether `node` carries the kwok annotation or lacks (part of) the stopped mark.
fn needs_mark(node: &Node) -> bool {
    kwok_annotated(node) || stopped_status_patch(node, &Time(k8s_openapi::jiff::Timestamp::now())).is_some()
}

/// The merge patch that gives `node`, the existing Node of `vm` (same name and provider ID),
/// back what `vm`'s kubelet registers, or `None` when it has it: the kwok annotation, which the
/// stopped mark removed (its kubelet has been started again), for a [`KubeletMode::Joins`]
/// kubelet (a `JoinsNotReady` one never had it). Nothing else: kwok, seeing the Node again,
/// makes it Ready (its `Ready` is not `True`, so kwok's first stage matches).
pub fn restart_patch(node: &Node, vm: &Vm) -> Option<Value> {
    (vm.kubelet == KubeletMode::Joins && !kwok_annotated(node))
        .then(|| json!({"metadata": {"annotations": {KWOK_ANNOTATION: "fake"}}}))
}

/// The connection to the cluster of a kubeconfig file (its current context), from that file
/// alone: nothing is read from the process environment (`KUBECONFIG`, in-cluster config).
/// Nothing is contacted yet.
///
/// # Errors
/// An unreadable or unusable kubeconfig.
pub async fn config(kubeconfig: &Path) -> Result<kube::Config, String> {
    let file =
        Kubeconfig::read_from(kubeconfig).map_err(|e| format!("--join-cluster {}: {e}", kubeconfig.display()))?;
    kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
        .await
        .map_err(|e| format!("--join-cluster {}: {e}", kubeconfig.display()))
}

/// The kubelets' user agent on `config`'s requests.
fn with_user_agent(mut config: kube::Config) -> kube::Config {
    use tonic::codegen::http::{header, HeaderValue};
    // kube's client sends no User-Agent of its own.
    config.headers.retain(|(name, _)| name != header::USER_AGENT);
    config.headers.push((header::USER_AGENT, HeaderValue::from_static(USER_AGENT)));
    config
}

/// A client for the kubelets' calls (not the watch) from `config`: their user agent, and
/// timeouts soon, so that a slow API server delays registrations, never the task for long.
///
/// # Errors
/// No client could be built from `config`.
pub(super) fn call_client(config: kube::Config) -> Result<kube::Client, String> {
    let mut calls = with_user_agent(config);
    calls.connect_timeout = Some(API_CONNECT_TIMEOUT);
    calls.read_timeout = Some(API_CALL_TIMEOUT);
    calls.write_timeout = Some(API_CALL_TIMEOUT);
    kube::Client::try_from(calls).map_err(|e| e.to_string())
}

/// Starts the kubelets of `driver`'s cloud in the cluster of `config` (whose credentials only
/// watch the Nodes and mark those whose kubelet stopped, as the node lifecycle controller does:
/// each kubelet joins with its VM's boot data, [`join`]); runs until the runtime stops (or the
/// handle is aborted).
///
/// # Errors
/// No client could be built from `config`.
pub fn spawn(driver: Arc<FakeDriver>, config: kube::Config) -> Result<tokio::task::JoinHandle<()>, String> {
    let calls = call_client(config.clone()).map_err(|e| format!("--join-cluster: {e}"))?;
    // The watch keeps kube's defaults (its requests last up to ~5 minutes).
    let watch = kube::Client::try_from(with_user_agent(config)).map_err(|e| format!("--join-cluster: {e}"))?;
    Ok(tokio::spawn(async move {
        let mut kubelets = Kubelets::new(driver, calls);
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Reconnects with backoff by itself; keeps no objects.
        let watch = watcher(Api::<Node>::all(watch), watcher::Config::default()).default_backoff();
        let mut watch = std::pin::pin!(watch);
        let mut watching = true;
        tracing::info!("kubelets started: running machines register as Nodes");
        loop {
            tokio::select! {
                _ = tick.tick() => kubelets.pass().await,
                event = watch.next(), if watching => match event {
                    Some(Ok(event)) => kubelets.observe(event).await,
                    Some(Err(e)) => kubelets.warn("watch", "watching Nodes failed", &e),
                    None => watching = false,
                },
            }
        }
    }))
}

/// How long a kubelet that could not join (no usable boot data, its token refused, its CSR
/// denied) waits before it tries again.
const JOIN_RETRY: Duration = Duration::from_secs(3);

/// A kubelet on its way to join the cluster.
enum Joining {
    /// Its CSR waits for approval and signature.
    Csr(Pending),
    /// It could not join; it tries again at this time.
    RetryAt(Instant),
}

/// The outcome of one kubelet's step towards its registered Node.
enum Step {
    /// It has its credentials and registered (or tried to).
    Registered(kube::Result<Registered>),
    /// Its CSR waits.
    Joining(Pending),
    /// It cannot join now (why; no secret in it).
    CannotJoin(String),
}

/// The outcome of one registration.
enum Registered {
    /// Created now, or found with this VM's provider ID (and given the kwok annotation back if
    /// it lacked it): the boot ID the Node shows.
    Yes(String),
    /// A Node of that name exists with another provider ID.
    Conflict(String),
    /// Created and deleted meanwhile: try again.
    Again,
}

/// A Node marked as no longer reporting, watched until `until`.
struct Settling {
    provider_id: String,
    until: Instant,
    /// Resource versions this task's own mark wrote (their watch events are no news).
    own: Vec<String>,
}

/// The outcome of marking a Node.
enum Marked {
    /// No Node of that name with that provider ID.
    Absent,
    /// It was marked already.
    Already,
    /// Marked now: the resource versions written.
    Now(Vec<String>),
}

struct Kubelets {
    driver: Arc<FakeDriver>,
    nodes: Api<Node>,
    /// Registered Nodes: name → provider ID.
    registered: BTreeMap<String, String>,
    /// Nodes (name, provider ID) not known to be registered nor marked: a registration or mark
    /// that failed (it may have been half done), a Node found without the kwok annotation after
    /// a restart. Marked while the VM is gone or its kubelet stopped, else registered again.
    in_doubt: BTreeSet<(String, String)>,
    settling: BTreeMap<String, Settling>,
    /// The boot ID each registered Node was last seen with: name → boot ID.
    boots: BTreeMap<String, String>,
    /// Kubelets joining (TLS bootstrap): name → (provider ID, where it stands).
    joining: BTreeMap<String, (String, Joining)>,
    /// The cloud's earlier Nodes have been looked up (after a restart).
    adopted: bool,
    warned: BTreeMap<String, Instant>,
}

impl Kubelets {
    fn new(driver: Arc<FakeDriver>, client: kube::Client) -> Self {
        Self {
            driver,
            nodes: Api::all(client),
            registered: BTreeMap::new(),
            in_doubt: BTreeSet::new(),
            settling: BTreeMap::new(),
            boots: BTreeMap::new(),
            joining: BTreeMap::new(),
            adopted: false,
            warned: BTreeMap::new(),
        }
    }

    /// Logs a failure at warn, or at debug when `subject` was warned about recently.
    fn warn(&mut self, subject: &str, what: &str, err: &dyn std::fmt::Display) {
        let now = Instant::now();
        let recent = self.warned.get(subject).is_some_and(|at| now.duration_since(*at) < WARN_EVERY);
        if recent {
            tracing::debug!(about = subject, error = %err, "{what}");
        } else {
            self.warned.insert(subject.to_string(), now);
            tracing::warn!(about = subject, error = %err, "{what} (retrying)");
        }
    }

    async fn pass(&mut self) {
        let driver = self.driver.clone();
        // The cloud's lock is taken (and released) in this call only.
        let (cloud_id, vms) = driver.kubelet_view();
        if !self.adopted {
            self.adopt(&cloud_id).await;
        }
        let plan = plan(&vms, &self.registered, &self.in_doubt, &self.boots);
        let live: BTreeSet<(&str, &str)> = vms.iter().map(|v| (v.hostname.as_str(), v.provider_id.as_str())).collect();
        self.joining.retain(|name, (pid, _)| live.contains(&(name.as_str(), pid.as_str())));
        drop(live);
        drop(vms);
        self.unsettle(&plan.register);
        self.mark_gone(plan.mark_gone).await;
        self.register(plan.register, &cloud_id).await;
        self.reboot(plan.reboot).await;
        self.settle().await;
    }

    /// Ends the watch over the marked Nodes of `vms`, VMs whose kubelet reports (started again):
    /// their Nodes are registered again, not marked again.
    fn unsettle(&mut self, vms: &[Vm]) {
        for vm in vms {
            if self.settling.get(&vm.hostname).is_some_and(|s| s.provider_id == vm.provider_id) {
                self.settling.remove(&vm.hostname);
            }
        }
    }

    /// Finds the Nodes this cloud registered before a restart of the sidecar: those with the
    /// kwok annotation count as registered, those without (marked, or never annotated: a
    /// [`KubeletMode::JoinsNotReady`] one) are in doubt, so that one whose kubelet reports again
    /// meanwhile gets its annotation back.
    async fn adopt(&mut self, cloud_id: &str) {
        let mut found = BTreeMap::new();
        let mut doubtful = Vec::new();
        let mut params = ListParams::default().limit(LIST_PAGE_SIZE);
        loop {
            let page = match self.nodes.list(&params).await {
                Ok(p) => p,
                Err(e) => return self.warn("list", "listing Nodes failed", &e),
            };
            for n in &page.items {
                let ours = n.metadata.annotations.as_ref().and_then(|a| a.get(CLOUD_ANNOTATION)).map(String::as_str)
                    == Some(cloud_id);
                if let (true, true, Some(name), Some(pid)) =
                    (ours, is_fake(n), &n.metadata.name, n.spec.as_ref().and_then(|s| s.provider_id.as_ref()))
                {
                    if kwok_annotated(n) {
                        found.insert(name.clone(), (pid.clone(), boot_id(n).to_string()));
                    } else {
                        doubtful.push((name.clone(), pid.clone()));
                    }
                }
            }
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(c) => params = params.continue_token(&c),
                None => break,
            }
        }
        if !found.is_empty() || !doubtful.is_empty() {
            let nodes = found.len() + doubtful.len();
            tracing::info!(nodes, unannotated = doubtful.len(), "found the Nodes this cloud registered before");
        }
        // Registrations made meanwhile (an earlier list failed) win over what the list saw.
        for (name, (pid, boot)) in found {
            if !self.registered.contains_key(&name) {
                self.boots.insert(name.clone(), boot);
                self.registered.insert(name, pid);
            }
        }
        for (name, pid) in doubtful {
            if !self.registered.contains_key(&name) {
                self.in_doubt.insert((name, pid));
            }
        }
        self.adopted = true;
    }

    /// Takes each of `vms` (whose kubelet reports and whose Node is not registered) a step towards
    /// its registered Node: a kubelet without credentials yet creates its CSR, or looks whether it
    /// was signed; one with credentials registers its Node with them.
    async fn register(&mut self, vms: Vec<Vm>, cloud_id: &str) {
        let now = Instant::now();
        let mut steps = Vec::new();
        for vm in vms {
            let csr = match self.joining.remove(&vm.hostname) {
                Some((pid, Joining::RetryAt(at))) if pid == vm.provider_id && at > now => {
                    self.joining.insert(vm.hostname, (pid, Joining::RetryAt(at)));
                    continue;
                }
                Some((pid, Joining::Csr(p))) if pid == vm.provider_id => Some(p),
                _ => None,
            };
            steps.push((vm, csr));
        }
        let driver = &self.driver;
        let results: Vec<(Vm, Step)> = futures::stream::iter(steps)
            .map(|(vm, csr)| async move {
                let r = step(driver, &vm, cloud_id, csr).await;
                (vm, r)
            })
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        for (vm, r) in results {
            match r {
                Step::Registered(Ok(Registered::Yes(boot))) => {
                    self.warned.remove(&vm.hostname);
                    self.settling.remove(&vm.hostname);
                    let key = (vm.hostname, vm.provider_id);
                    self.in_doubt.remove(&key);
                    self.boots.insert(key.0.clone(), boot);
                    self.registered.insert(key.0, key.1);
                }
                Step::Registered(Ok(Registered::Conflict(other))) => {
                    let msg = format!("a Node of that name has provider ID {other:?}, not {:?}", vm.provider_id);
                    self.warn(&vm.hostname, "Node not registered: waiting for the stale Node to go", &msg);
                }
                Step::Registered(Ok(Registered::Again)) => {}
                Step::Registered(Err(e)) => {
                    self.warn(&vm.hostname, "registering the Node failed", &e);
                    // The Node may have been created or annotated all the same.
                    self.in_doubt.insert((vm.hostname, vm.provider_id));
                }
                Step::Joining(csr) => {
                    self.joining.insert(vm.hostname, (vm.provider_id, Joining::Csr(csr)));
                }
                Step::CannotJoin(why) => {
                    self.warn(&vm.hostname, "the kubelet cannot join the cluster", &why);
                    self.joining.insert(vm.hostname, (vm.provider_id, Joining::RetryAt(now + JOIN_RETRY)));
                }
            }
        }
    }

    async fn mark_gone(&mut self, gone: Vec<(String, String)>) {
        let nodes = &self.nodes;
        let results: Vec<(String, String, kube::Result<Marked>)> = futures::stream::iter(gone)
            .map(|(name, pid)| async move {
                let r = mark_one(nodes, &name, &pid).await;
                (name, pid, r)
            })
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        for (name, pid, r) in results {
            let own = match r {
                Ok(Marked::Absent) => None,
                Ok(Marked::Already) => Some(Vec::new()),
                Ok(Marked::Now(own)) => {
                    tracing::info!(node = %name, provider_id = %pid, "Node marked: its kubelet stopped posting status");
                    Some(own)
                }
                Err(e) => {
                    self.warn(&name, "marking the Node as not reporting failed", &e);
                    // Perhaps half marked: retried while the VM is gone or its kubelet stopped,
                    // registered again (annotation back) if its kubelet reports meanwhile.
                    self.forget(&name, &pid);
                    self.in_doubt.insert((name, pid));
                    continue;
                }
            };
            self.forget(&name, &pid);
            self.in_doubt.remove(&(name.clone(), pid.clone()));
            self.warned.remove(&name);
            if let Some(own) = own {
                let until = Instant::now() + SETTLE;
                self.settling.insert(name, Settling { provider_id: pid, until, own });
            }
        }
    }

    /// Posts the new boot ID of each VM that rebooted (its kubelet's first status after the
    /// boot). A failure is retried on the next pass: the Node still shows the old one.
    async fn reboot(&mut self, vms: Vec<Vm>) {
        let driver = &self.driver;
        let results: Vec<(Vm, Result<Node, String>)> = futures::stream::iter(vms)
            .map(|vm| async move {
                let patch = reboot_status_patch(&vm);
                let r = match node_api(driver, &vm).await {
                    Ok(nodes) => nodes
                        .patch_status(&vm.hostname, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(e),
                };
                (vm, r)
            })
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        for (vm, r) in results {
            match r {
                Ok(n) => {
                    tracing::info!(node = %vm.hostname, boot_id = %vm.boot_id, "Node rebooted: new boot ID posted");
                    self.boots.insert(vm.hostname, boot_id(&n).to_string());
                }
                Err(e) => self.warn(&vm.hostname, "posting the Node's new boot ID failed", &e),
            }
        }
    }

    /// No longer counts the Node `name` of provider ID `pid` as registered.
    fn forget(&mut self, name: &str, pid: &str) {
        if self.registered.get(name).is_some_and(|p| p == pid) {
            self.registered.remove(name);
            self.boots.remove(name);
        }
    }

    /// A watch event: a recently marked Node whose mark was undone is marked again at once,
    /// unless its kubelet was started again (the next pass registers it again).
    async fn observe(&mut self, event: watcher::Event<Node>) {
        let node = match event {
            watcher::Event::Apply(n) | watcher::Event::InitApply(n) => n,
            watcher::Event::Delete(n) => {
                if let Some(name) = &n.metadata.name {
                    self.settling.remove(name);
                }
                return;
            }
            watcher::Event::Init | watcher::Event::InitDone => return,
        };
        let Some(name) = node.metadata.name.clone() else { return };
        // The boot ID a registered Node shows now: one that something overwrote is posted again.
        let pid = node.spec.as_ref().and_then(|s| s.provider_id.as_deref());
        if pid.is_some() && self.registered.get(&name).map(String::as_str) == pid {
            self.boots.insert(name.clone(), boot_id(&node).to_string());
        }
        let Some(s) = self.settling.get(&name) else { return };
        let pid = s.provider_id.clone();
        let own = node.metadata.resource_version.as_ref().is_some_and(|rv| s.own.contains(rv));
        if own || s.until < Instant::now() || !needs_mark(&node) {
            return;
        }
        if self.driver.kubelet_reports(&name, &pid) {
            self.settling.remove(&name);
            return;
        }
        match mark_node(&self.nodes, &node, &pid).await {
            Ok(Marked::Now(own)) => {
                tracing::info!(node = %name, "Node marked again: a heartbeat had undone the mark");
                if let Some(s) = self.settling.get_mut(&name) {
                    s.own = own;
                }
            }
            Ok(Marked::Absent | Marked::Already) => {}
            Err(e) => self.warn(&name, "marking the Node as not reporting failed", &e),
        }
    }

    /// Ends the watch over Nodes marked long enough ago, with a last look at each (in case the
    /// watch missed something).
    async fn settle(&mut self) {
        let now = Instant::now();
        let done: Vec<(String, String)> = self
            .settling
            .iter()
            .filter(|(_, s)| s.until <= now)
            .map(|(name, s)| (name.clone(), s.provider_id.clone()))
            .collect();
        for (name, pid) in done {
            self.settling.remove(&name);
            if self.registered.contains_key(&name) {
                continue;
            }
            match mark_one(&self.nodes, &name, &pid).await {
                Ok(Marked::Now(_)) => tracing::info!(node = %name, "Node marked again: its mark had been undone"),
                Ok(Marked::Absent | Marked::Already) => {}
                Err(e) => self.warn(&name, "marking the Node as not reporting failed", &e),
            }
        }
        self.settling.retain(|name, _| !self.registered.contains_key(name));
    }
}

/// The Nodes as the kubelet of `vm` sees them: with the credentials it joined with.
///
/// # Errors
/// It has not joined (no credentials), or they are unusable.
async fn node_api(driver: &FakeDriver, vm: &Vm) -> Result<Api<Node>, String> {
    let credentials = driver.kubelet_identity(&vm.hostname, &vm.provider_id).and_then(|(_, c)| c);
    let credentials = credentials.ok_or_else(|| "the kubelet has no credentials (it has not joined)".to_string())?;
    Ok(Api::all(join::client(&credentials.kubeconfig).await?))
}

/// One kubelet's step towards its registered Node, with `csr`, its CSR if it made one: without
/// credentials, it creates a CSR with its boot data's bootstrap kubeconfig, or looks whether
/// its CSR was signed (and keeps the credentials with its VM); with them, it registers.
async fn step(driver: &FakeDriver, vm: &Vm, cloud_id: &str, csr: Option<Pending>) -> Step {
    let Some((boot_data, credentials)) = driver.kubelet_identity(&vm.hostname, &vm.provider_id) else {
        return Step::Registered(Ok(Registered::Again));
    };
    let boot = match boot_data.as_deref().map(BootData::parse) {
        Some(Ok(boot)) => boot,
        Some(Err(e)) => return Step::CannotJoin(format!("its boot data: {e}")),
        None => BootData::default(),
    };
    let credentials = match credentials {
        Some(c) => c,
        None => match csr {
            Some(csr) => match join::poll(&csr).await {
                Ok(None) => return Step::Joining(csr),
                Ok(Some(c)) => {
                    if let Err(e) = driver.kubelet_joined(&vm.hostname, &vm.provider_id, c.clone()) {
                        return Step::CannotJoin(format!("keeping its credentials failed: {e}"));
                    }
                    tracing::info!(node = %vm.hostname, csr = %csr.csr, "kubelet certificate issued (TLS bootstrap)");
                    c
                }
                Err(e) => return Step::CannotJoin(e),
            },
            None => {
                let Some(bootstrap) = boot.bootstrap_kubeconfig.as_deref() else {
                    return Step::CannotJoin(
                        "its boot data writes no bootstrap kubeconfig (see the book's \"Joining nodes\")".into(),
                    );
                };
                return match join::request_certificate(bootstrap, &vm.hostname).await {
                    Ok(csr) => {
                        tracing::info!(node = %vm.hostname, csr = %csr.csr, "kubelet CSR created (TLS bootstrap)");
                        Step::Joining(csr)
                    }
                    Err(e) => Step::CannotJoin(e),
                };
            }
        },
    };
    match join::client(&credentials.kubeconfig).await {
        Ok(client) => Step::Registered(register_one(&Api::all(client), vm, cloud_id, &boot).await),
        Err(e) => Step::CannotJoin(format!("its kubeconfig: {e}")),
    }
}

/// Registers one VM's Node with its kubelet's own credentials (`nodes`; create only; an
/// existing Node of this VM only gets the kwok annotation back, [`restart_patch`]).
async fn register_one(nodes: &Api<Node>, vm: &Vm, cloud_id: &str, boot: &BootData) -> kube::Result<Registered> {
    let want = node_with(vm, cloud_id, boot);
    match nodes.create(&PostParams::default(), &want).await {
        Ok(created) => {
            tracing::info!(node = %vm.hostname, provider_id = %vm.provider_id, mode = ?vm.kubelet, "Node registered");
            // The API server keeps a created Node's status; should one drop it, post it as a
            // kubelet's first status update would.
            if created.status.as_ref().and_then(|s| s.capacity.as_ref()).is_none() {
                let status = json!({"status": want.status});
                let posted = nodes.patch_status(&vm.hostname, &PatchParams::default(), &Patch::Merge(&status)).await?;
                return Ok(Registered::Yes(boot_id(&posted).to_string()));
            }
            Ok(Registered::Yes(boot_id(&created).to_string()))
        }
        Err(kube::Error::Api(s)) if s.is_already_exists() => {
            let Some(existing) = nodes.get_opt(&vm.hostname).await? else { return Ok(Registered::Again) };
            let pid = existing.spec.as_ref().and_then(|s| s.provider_id.as_deref());
            if pid != Some(vm.provider_id.as_str()) {
                return Ok(Registered::Conflict(pid.unwrap_or_default().to_string()));
            }
            if let Some(patch) = restart_patch(&existing, vm) {
                match nodes.patch(&vm.hostname, &PatchParams::default(), &Patch::Merge(&patch)).await {
                    Err(kube::Error::Api(s)) if s.is_not_found() => return Ok(Registered::Again),
                    r => r?,
                };
                let pid = &vm.provider_id;
                tracing::info!(node = %vm.hostname, provider_id = %pid, "Node reports again: kwok annotation put back");
            }
            // A VM that rebooted meanwhile posts its boot ID on the next pass.
            Ok(Registered::Yes(boot_id(&existing).to_string()))
        }
        Err(e) => Err(e),
    }
}

/// Marks the Node `name` as a kubelet that stopped posting status, if it is still the one of
/// provider ID `pid` (a fake one).
async fn mark_one(nodes: &Api<Node>, name: &str, pid: &str) -> kube::Result<Marked> {
    match nodes.get_opt(name).await? {
        Some(n) => mark_node(nodes, &n, pid).await,
        None => Ok(Marked::Absent),
    }
}

/// [`mark_one`] with the Node at hand. A Node deleted meanwhile (the controller deletes the Node
/// of a VM that is gone) is [`Marked::Absent`].
async fn mark_node(nodes: &Api<Node>, n: &Node, pid: &str) -> kube::Result<Marked> {
    match try_mark_node(nodes, n, pid).await {
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(Marked::Absent),
        r => r,
    }
}

async fn try_mark_node(nodes: &Api<Node>, n: &Node, pid: &str) -> kube::Result<Marked> {
    let Some(name) = n.metadata.name.as_deref() else { return Ok(Marked::Absent) };
    let same = n.spec.as_ref().and_then(|s| s.provider_id.as_deref()) == Some(pid);
    if !same || !is_fake(n) {
        return Ok(Marked::Absent);
    }
    let mut written = Vec::new();
    // The kwok annotation goes first: a kwok that heard of it would not make the Node Ready
    // again (kwok 0.8 does not hear of it; see the module's documentation).
    if kwok_annotated(n) {
        let patch = json!({"metadata": {"annotations": {KWOK_ANNOTATION: null}}});
        let after = nodes.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
        written.extend(after.metadata.resource_version);
    }
    if let Some(patch) = stopped_status_patch(n, &Time(k8s_openapi::jiff::Timestamp::now())) {
        let after = nodes.patch_status(name, &PatchParams::default(), &Patch::Strategic(&patch)).await?;
        written.extend(after.metadata.resource_version);
    }
    Ok(if written.is_empty() { Marked::Already } else { Marked::Now(written) })
}

#[cfg(test)]
mod tests {
    use driver_sdk::{CreateMachine, Driver, RequestContext, Secrets};

    use super::super::Credentials;
    use super::*;

    /// An address where nothing listens: every call to it fails at once.
    fn unreachable_url() -> String {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        format!("http://127.0.0.1:{port}")
    }

    /// A client whose every call fails at once.
    fn unreachable() -> kube::Client {
        kube::Client::try_from(kube::Config::new(unreachable_url().parse().unwrap())).unwrap()
    }

    /// A fake cloud with one running machine, `m1`, and its VM.
    async fn cloud_with_m1() -> (Arc<FakeDriver>, Vm) {
        let config = crate::Config { create_latency: Duration::from_millis(10), ..crate::Config::default() };
        let d = Arc::new(FakeDriver::new(config).unwrap());
        let ctx = RequestContext::for_method("test", "CreateMachine");
        let req = CreateMachine {
            name: "m1".into(),
            provider_spec: json!({"machineType": "small"}),
            secrets: Secrets::default(),
            labels: BTreeMap::new(),
            uid: String::new(),
        };
        d.create_machine(&ctx, req).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let vm = d.kubelet_view().1.remove(0);
            if vm.booted {
                // As if it had joined: its kubelet's kubeconfig (a cluster that is not there).
                let kubeconfig = json!({
                    "apiVersion": "v1", "kind": "Config",
                    "clusters": [{"name": "c", "cluster": {"server": unreachable_url()}}],
                    "users": [{"name": "u", "user": {}}],
                    "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "x",
                });
                let credentials = Credentials { kubeconfig: kubeconfig.to_string() };
                d.kubelet_joined(&vm.hostname, &vm.provider_id, credentials).unwrap();
                return (d, vm);
            }
            assert!(Instant::now() < deadline, "m1 never booted");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The task as it is right after marking `vm`'s Node (no cluster: every call fails).
    fn marked_a_moment_ago(d: &Arc<FakeDriver>, vm: &Vm) -> Kubelets {
        let mut k = Kubelets::new(d.clone(), unreachable());
        k.adopted = true;
        let s = Settling { provider_id: vm.provider_id.clone(), until: Instant::now() + SETTLE, own: Vec::new() };
        k.settling.insert(vm.hostname.clone(), s);
        k
    }

    fn key(vm: &Vm) -> (String, String) {
        (vm.hostname.clone(), vm.provider_id.clone())
    }

    #[tokio::test]
    async fn a_started_kubelet_s_node_is_not_marked_again_by_the_watch() {
        let (d, vm) = cloud_with_m1().await;
        d.stop_kubelet("m1").unwrap();
        let mut k = marked_a_moment_ago(&d, &vm);
        // A kwok heartbeat scheduled before the mark undoes it: marked again (tried, and failed
        // for want of a cluster).
        let undone = node(&vm, "c");
        k.observe(watcher::Event::Apply(undone.clone())).await;
        assert!(k.settling.contains_key("m1"), "still watched");
        assert!(k.warned.contains_key("m1"), "marking it again was tried");
        // StartKubelet: the same event changes nothing, and the watch over the Node ends.
        k.warned.clear();
        d.start_kubelet("m1").unwrap();
        k.observe(watcher::Event::Apply(undone)).await;
        assert!(!k.settling.contains_key("m1"));
        assert!(k.warned.is_empty(), "no call to the API server");
    }

    #[tokio::test]
    async fn a_started_kubelet_s_node_is_registered_again_not_marked() {
        let (d, vm) = cloud_with_m1().await;
        d.stop_kubelet("m1").unwrap();
        d.start_kubelet("m1").unwrap();
        let mut k = marked_a_moment_ago(&d, &vm);
        // The marked Node of another machine stays watched.
        let other = Vm { hostname: "m0".into(), provider_id: "fake:///zone-a/m0".into(), ..vm.clone() };
        k.settling.insert(
            other.hostname.clone(),
            Settling { provider_id: other.provider_id.clone(), until: Instant::now() + SETTLE, own: Vec::new() },
        );
        let p = plan(&d.kubelet_view().1, &k.registered, &k.in_doubt, &k.boots);
        assert_eq!((p.register, p.mark_gone), (vec![vm.clone()], Vec::new()));
        k.pass().await;
        assert!(!k.settling.contains_key("m1"), "its Node is no longer kept marked");
        assert!(k.settling.contains_key("m0"));
        // The registration failed (no cluster): it may have put the annotation back all the same.
        assert!(k.registered.is_empty());
        assert_eq!(k.in_doubt, BTreeSet::from([key(&vm)]));
        // In doubt and stopped again: marked again.
        d.stop_kubelet("m1").unwrap();
        let p = plan(&d.kubelet_view().1, &k.registered, &k.in_doubt, &k.boots);
        assert_eq!((p.register, p.mark_gone), (Vec::new(), vec![key(&vm)]));
        // Only this VM's kubelet ends the watch: a new VM of that name (another provider ID)
        // leaves the earlier VM's marked Node watched.
        let mut k = marked_a_moment_ago(&d, &vm);
        k.unsettle(&[Vm { provider_id: "fake:///zone-a/newer".into(), ..vm.clone() }]);
        assert!(k.settling.contains_key("m1"));
        k.unsettle(std::slice::from_ref(&vm));
        assert!(!k.settling.contains_key("m1"));
    }

    #[tokio::test]
    async fn a_failed_mark_is_in_doubt_until_the_kubelet_reports_again() {
        let (d, vm) = cloud_with_m1().await;
        let mut k = Kubelets::new(d.clone(), unreachable());
        k.adopted = true;
        k.registered.insert(vm.hostname.clone(), vm.provider_id.clone());
        d.stop_kubelet("m1").unwrap();
        k.pass().await;
        // Perhaps half marked (its annotation gone): no longer counted as registered.
        assert!(k.registered.is_empty());
        assert_eq!(k.in_doubt, BTreeSet::from([key(&vm)]));
        assert!(k.settling.is_empty());
        // Retried while the kubelet is stopped.
        let p = plan(&d.kubelet_view().1, &k.registered, &k.in_doubt, &k.boots);
        assert_eq!((p.register, p.mark_gone), (Vec::new(), vec![key(&vm)]));
        // Started again meanwhile: registered again (its annotation put back), not marked.
        d.start_kubelet("m1").unwrap();
        let p = plan(&d.kubelet_view().1, &k.registered, &k.in_doubt, &k.boots);
        assert_eq!((p.register, p.mark_gone), (vec![vm.clone()], Vec::new()));
    }
}
