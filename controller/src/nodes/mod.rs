//! The target cluster: where the Nodes of the machines live (machine-controller-manager's
//! control/target split). With one, a Machine is linked to its Node by provider ID, counts as
//! Running only once its Node is Ready, and is deleted in a recorded sequence that drains its
//! Node first (see [`crate::reconcile::node`]); without one, nodes are not managed.
//!
//! - [`bootstrap`]: how machines join (the API server and CA they are given) and the bootstrap
//!   tokens minted for them;
//! - [`cache`]: the Nodes from one watch, indexed by name and normalized provider ID;
//! - [`provider_id`]: how provider IDs compare;
//! - [`scheduled`]: the interruptions a Node's conditions announce (node-problem-detector's
//!   `PreemptionScheduled`, `VMEventScheduled`);
//! - [`drain`]: what a drain does with each pod, what an eviction's refusal means, and one
//!   pass over a node's pods, bounded in time;
//! - [`metadata`]: the template's labels, annotations and taints kept on the Node;
//! - [`calls`]: the one way every request to the target cluster goes (rate limit,
//!   `Retry-After`, metrics, logs);
//! - [`Target`]: the calls to the target cluster (cordon, evict, delete, annotate).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod, Taint};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::api::{Api, DeleteParams, EvictParams, ListParams, Patch, PatchParams, PostParams, Preconditions};

pub mod bootstrap;
pub mod cache;
pub mod calls;
pub mod drain;
pub mod metadata;
pub mod provider_id;
pub mod scheduled;

pub use cache::{Lookup, NodeCache, NodeView, Readiness};
pub use drain::{Evicted, PodKey};

use crate::resources::{ANNOTATION_NODE_MACHINE, TAINT_DRAINING};
use crate::store::Key;

/// The label that takes a node out of external load balancers (kube-proxy and the cloud
/// load-balancer controllers honour it).
pub const LABEL_EXCLUDE_FROM_LB: &str = "node.kubernetes.io/exclude-from-external-load-balancers";
/// The taint that marks a node whose machine is shut down, so its pods are deleted and its
/// volumes detached without the kubelet (Kubernetes' non-graceful node shutdown).
pub const TAINT_OUT_OF_SERVICE: &str = "node.kubernetes.io/out-of-service";

/// The longest a call waits out a target cluster's `Retry-After` inside a reconcile; a longer
/// hold fails the call at once (`Target::guard`).
pub const MAX_WAIT_FOR_HOLD: Duration = Duration::from_secs(1);

/// Errors of calls to the target cluster.
pub type Error = kube::Error;

/// Whether the API server refused a write because the object changed since it was read (409:
/// a resourceVersion or uid precondition failed).
pub fn is_conflict(e: &Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// What a write guarded by the Node's resourceVersion did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeWrite {
    /// Written, or nothing was left to write.
    Done,
    /// The Node changed since the view it was computed from (409): nothing was written; compute
    /// it again from a fresh view.
    Conflict,
}

/// How long a connection to a target cluster's API server may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a call to a target cluster waits for its answer (the Node watch has its own): a
/// slow cluster holds a worker this long at most, and not again while its probe finds it down.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(15);

/// The target cluster.
pub struct Target {
    /// Every request goes through [`calls::Measure`]; each waits [`CALL_TIMEOUT`] at most.
    client: kube::Client,
    /// The Node watch's client (a watch request lasts minutes), measured the same way.
    watch_client: kube::Client,
    calls: Arc<calls::Calls>,
    /// Its Nodes.
    pub cache: Arc<NodeCache>,
    /// How machines join it (the boot data's cluster variables, the bootstrap tokens).
    pub join: bootstrap::JoinSettings,
}

impl Target {
    /// A target cluster from a kubeconfig file (never the process's environment: the control
    /// cluster may be another), its requests within `limits`.
    ///
    /// # Errors
    /// An unreadable or invalid kubeconfig.
    pub async fn from_kubeconfig(path: &std::path::Path, limits: calls::Limits) -> Result<Self, String> {
        let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let config = kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Self::from_config(config, limits, crate::targets::DEFAULT_LABEL).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// A target cluster from a kubeconfig's text (a Secret's; [`crate::targets`] checked that it
    /// runs no command), its requests within `limits` and measured as `label`.
    ///
    /// # Errors
    /// An invalid kubeconfig.
    pub async fn from_kubeconfig_text(yaml: &str, limits: calls::Limits, label: &str) -> Result<Self, String> {
        let kc = kube::config::Kubeconfig::from_yaml(yaml).map_err(|e| e.to_string())?;
        let config = kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .map_err(|e| e.to_string())?;
        Self::from_config(config, limits, label).map_err(|e| e.to_string())
    }

    /// The target cluster of the process's environment (in-cluster, or `KUBECONFIG`): the
    /// same cluster as `--store kubernetes`, its requests within `limits`.
    ///
    /// # Errors
    /// No usable configuration.
    pub async fn infer(limits: calls::Limits) -> Result<Self, String> {
        let config = kube::Config::infer().await.map_err(|e| e.to_string())?;
        Self::from_config(config, limits, crate::targets::DEFAULT_LABEL).map_err(|e| e.to_string())
    }

    /// A target cluster from a client configuration (its cache fills once [`watch`] runs). Every
    /// request goes through [`calls::Measure`] (within `limits`, `Retry-After` honoured,
    /// measured, logged) and names the controller ([`crate::store::kubernetes::USER_AGENT`]).
    /// The client's own retries are off: kube's default retries 429 for minutes, and a 429 from
    /// the Eviction API is a PodDisruptionBudget's answer that the drain reports and asks again,
    /// not throttling to sit out inside one call (throttling's `Retry-After` holds the next
    /// request instead).
    ///
    /// # Errors
    /// A configuration the client refuses.
    pub fn from_config(mut config: kube::Config, limits: calls::Limits, label: &str) -> Result<Self, kube::Error> {
        config.default_retry = false;
        config.connect_timeout = Some(CONNECT_TIMEOUT);
        crate::store::kubernetes::identify(&mut config);
        let calls = Arc::new(calls::Calls::new(limits, label));
        let join = bootstrap::JoinSettings::of(&config);
        let measured = |config: kube::Config| -> Result<kube::Client, kube::Error> {
            Ok(kube::client::ClientBuilder::try_from(config)?.with_layer(&calls::Measure(calls.clone())).build())
        };
        let watch_client = measured(config.clone())?;
        config.read_timeout = Some(CALL_TIMEOUT);
        let client = measured(config)?;
        Ok(Self { client, watch_client, calls, cache: Arc::new(NodeCache::default()), join })
    }

    /// Its calls' shared state (rate limit, hold, metrics, whether it is down).
    pub fn calls(&self) -> &Arc<calls::Calls> {
        &self.calls
    }

    /// Fails at once while the cluster's probe finds it down or a `Retry-After` holds its calls
    /// longer than a moment: a reconcile must not hold a shared worker on a cluster that does
    /// not answer now (the reconcile is retried; machines on other clusters go on).
    fn guard(&self) -> Result<(), Error> {
        if self.calls.is_down() {
            return Err(kube::Error::Service(
                "the target cluster does not answer its probe: not called until it does".into(),
            ));
        }
        let held = self.calls.hold_left();
        if held > MAX_WAIT_FOR_HOLD {
            return Err(kube::Error::Service(
                format!(
                    "the target cluster throttles (Retry-After, {}s left): not called until then",
                    held.as_secs() + 1
                )
                .into(),
            ));
        }
        Ok(())
    }

    /// The same target with other join settings (`run --target-api-server-url`,
    /// `--bootstrap-token-ttl`, `--bootstrap-token-group`).
    #[must_use]
    pub fn with_join(mut self, join: bootstrap::JoinSettings) -> Self {
        self.join = join;
        self
    }

    /// Counts and times its requests in `metrics` (the controller's registry:
    /// [`crate::app::Metrics`]).
    pub fn report_to(&self, metrics: calls::CallMetrics) {
        self.calls.report_to(metrics);
    }

    /// How long until its next request may go (a 429's `Retry-After` being waited out).
    pub fn hold_left(&self) -> Duration {
        self.calls.hold_left()
    }

    /// Its client (for probes: [`crate::safety`]); measured like every call.
    pub fn client(&self) -> kube::Client {
        self.client.clone()
    }

    fn nodes(&self) -> Api<Node> {
        Api::all(self.client.clone())
    }

    /// Annotates a Node with the Machine it belongs to (`namespace/name`), unless it says so.
    ///
    /// # Errors
    /// The API server's refusal.
    pub async fn annotate(&self, node: &NodeView, namespace: &str, name: &str) -> Result<(), Error> {
        let value = format!("{namespace}/{name}");
        if node.annotations.get(ANNOTATION_NODE_MACHINE) == Some(&value) {
            return Ok(());
        }
        self.guard()?;
        let patch = serde_json::json!({"metadata": {"annotations": {ANNOTATION_NODE_MACHINE: value}}});
        self.nodes().patch(&node.name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
        Ok(())
    }

    /// Brings the Node's labels, annotations and taints to the template's (see [`metadata`]).
    /// `true` when it wrote.
    ///
    /// # Errors
    /// The API server's refusal; a conflict (409: a patch of the taints is guarded by the
    /// Node's resourceVersion, and the Node changed since `node` was seen) is retried by the
    /// reconcile's retry, from a fresh view.
    pub async fn sync_metadata(
        &self,
        node: &NodeView,
        desired: &crate::resources::NodeTemplate,
    ) -> Result<bool, Error> {
        let Some(patch) = metadata::patch(node, desired) else { return Ok(false) };
        self.guard()?;
        self.nodes().patch(&node.name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
        Ok(true)
    }

    /// Cordons a Node: `spec.unschedulable`, the draining `NoSchedule` taint and the label that
    /// takes it out of external load balancers ([`cordon_patch`]), unless all three are there.
    ///
    /// # Errors
    /// The API server's refusal; a conflict (the Node changed since `node` was seen) is
    /// [`NodeWrite::Conflict`].
    pub async fn cordon(&self, node: &NodeView) -> Result<NodeWrite, Error> {
        self.patch_node(node, cordon_patch(node)).await
    }

    /// Undoes [`Target::cordon`] after an in-place update ([`uncordon_patch`]); the Node stays
    /// unschedulable when `keep_unschedulable` (it was cordoned before the update).
    ///
    /// # Errors
    /// The API server's refusal; a conflict is [`NodeWrite::Conflict`].
    pub async fn uncordon(&self, node: &NodeView, keep_unschedulable: bool) -> Result<NodeWrite, Error> {
        self.patch_node(node, uncordon_patch(node, keep_unschedulable)).await
    }

    /// Adds `node.kubernetes.io/out-of-service=nodeshutdown:NoExecute` ([`out_of_service_patch`]):
    /// the VM is gone, so the pods are deleted and volumes detached without waiting for its
    /// kubelet.
    ///
    /// # Errors
    /// The API server's refusal; a conflict is [`NodeWrite::Conflict`].
    pub async fn mark_out_of_service(&self, node: &NodeView) -> Result<NodeWrite, Error> {
        self.patch_node(node, out_of_service_patch(node)).await
    }

    async fn patch_node(&self, node: &NodeView, patch: Option<serde_json::Value>) -> Result<NodeWrite, Error> {
        let Some(patch) = patch else { return Ok(NodeWrite::Done) };
        self.guard()?;
        match self.nodes().patch(&node.name, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => Ok(NodeWrite::Done),
            Err(e) if is_conflict(&e) => Ok(NodeWrite::Conflict),
            Err(e) => Err(e),
        }
    }

    /// The pods bound to a Node.
    ///
    /// # Errors
    /// The API server's refusal.
    pub async fn pods_on(&self, node: &str) -> Result<Vec<Pod>, Error> {
        self.guard()?;
        let api: Api<Pod> = Api::all(self.client.clone());
        Ok(api.list(&ListParams::default().fields(&format!("spec.nodeName={node}"))).await?.items)
    }

    /// Evicts a pod through the Eviction API (PodDisruptionBudgets decide), with its uid as a
    /// precondition so a new pod of the same name is not evicted in its place.
    ///
    /// # Errors
    /// Failures other than the answers [`Evicted`] names.
    pub async fn evict(&self, pod: &Pod, grace_seconds: Option<i64>) -> Result<Evicted, Error> {
        self.guard()?;
        let (ns, name) = pod_key(pod);
        let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let params = EvictParams {
            delete_options: Some(DeleteParams {
                grace_period_seconds: grace_seconds.map(|g| u32::try_from(g.max(0)).unwrap_or(u32::MAX)),
                preconditions: Some(Preconditions { uid: pod.metadata.uid.clone(), resource_version: None }),
                ..Default::default()
            }),
            post_options: PostParams::default(),
        };
        match api.evict(name, &params).await {
            Ok(_) => Ok(Evicted::Accepted),
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(Evicted::Gone),
            // 429: a budget forbids it now (or plain throttling); 500: several budgets select
            // the pod — both are reported and retried.
            Err(kube::Error::Api(s)) if s.code == 429 || s.code == 500 => Ok(Evicted::Refused(drain::refusal(&s))),
            Err(e) => Err(e),
        }
    }

    /// Deletes a pod with this grace period (uid precondition; gone is done).
    ///
    /// # Errors
    /// The API server's refusal.
    pub async fn delete_pod(&self, pod: &Pod, grace_seconds: i64) -> Result<(), Error> {
        self.guard()?;
        let (ns, name) = pod_key(pod);
        let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let params = DeleteParams {
            grace_period_seconds: Some(u32::try_from(grace_seconds.max(0)).unwrap_or(u32::MAX)),
            preconditions: Some(Preconditions { uid: pod.metadata.uid.clone(), resource_version: None }),
            ..Default::default()
        };
        match api.delete(name, &params).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// A PodDisruptionBudget.
    ///
    /// # Errors
    /// The API server's refusal.
    pub async fn budget(&self, namespace: &str, name: &str) -> Result<Option<PodDisruptionBudget>, Error> {
        self.guard()?;
        Api::<PodDisruptionBudget>::namespaced(self.client.clone(), namespace).get_opt(name).await
    }

    /// How many VolumeAttachments still name the Node.
    ///
    /// # Errors
    /// The API server's refusal.
    pub async fn volume_attachments(&self, node: &str) -> Result<usize, Error> {
        self.guard()?;
        let api: Api<VolumeAttachment> = Api::all(self.client.clone());
        let all = api.list(&ListParams::default()).await?;
        Ok(all.items.iter().filter(|va| va.spec.node_name == node).count())
    }

    /// Deletes a Node (uid precondition when known; gone is done).
    ///
    /// # Errors
    /// The API server's refusal.
    pub async fn delete_node(&self, name: &str, uid: &str) -> Result<(), Error> {
        self.guard()?;
        let params = DeleteParams {
            preconditions: (!uid.is_empty())
                .then(|| Preconditions { uid: Some(uid.to_string()), resource_version: None }),
            ..Default::default()
        };
        match self.nodes().delete(name, &params).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
            Err(e) => Err(e),
        }
    }
}

#[async_trait::async_trait]
impl drain::PodCalls for Target {
    async fn evict(&self, pod: &Pod, grace_seconds: Option<i64>) -> Result<Evicted, Error> {
        Target::evict(self, pod, grace_seconds).await
    }

    async fn delete_pod(&self, pod: &Pod, grace_seconds: i64) -> Result<(), Error> {
        Target::delete_pod(self, pod, grace_seconds).await
    }

    async fn budget(&self, namespace: &str, name: &str) -> Result<Option<PodDisruptionBudget>, Error> {
        Target::budget(self, namespace, name).await
    }

    fn hold_left(&self) -> Duration {
        Target::hold_left(self)
    }
}

fn pod_key(pod: &Pod) -> (&str, &str) {
    (pod.metadata.namespace.as_deref().unwrap_or("default"), pod.metadata.name.as_deref().unwrap_or_default())
}

/// The merge patch that cordons `node` (`None` when it is cordoned): `spec.unschedulable`, the
/// taints with [`TAINT_DRAINING`]`:NoSchedule` added, the label [`LABEL_EXCLUDE_FROM_LB`].
pub fn cordon_patch(node: &NodeView) -> Option<serde_json::Value> {
    let tainted = node.has_taint(TAINT_DRAINING, "NoSchedule");
    if node.unschedulable && tainted && node.labels.contains_key(LABEL_EXCLUDE_FROM_LB) {
        return None;
    }
    let mut taints = node.taints.clone();
    if !tainted {
        taints.push(Taint { key: TAINT_DRAINING.into(), effect: "NoSchedule".into(), ..Default::default() });
    }
    Some(node_spec_patch(node, taints, Some(true), BTreeMap::from([(LABEL_EXCLUDE_FROM_LB, "true")])))
}

/// The merge patch that undoes [`cordon_patch`] (`None` when nothing is left to undo): the
/// [`TAINT_DRAINING`] taint and the label [`LABEL_EXCLUDE_FROM_LB`] go, and `spec.unschedulable`
/// is cleared unless `keep_unschedulable`.
pub fn uncordon_patch(node: &NodeView, keep_unschedulable: bool) -> Option<serde_json::Value> {
    let tainted = node.has_taint(TAINT_DRAINING, "NoSchedule");
    let labelled = node.labels.contains_key(LABEL_EXCLUDE_FROM_LB);
    let cordoned = node.unschedulable && !keep_unschedulable;
    if !tainted && !labelled && !cordoned {
        return None;
    }
    let taints = node.taints.iter().filter(|t| t.key != TAINT_DRAINING).cloned().collect();
    let mut patch = node_spec_patch(node, taints, (!keep_unschedulable).then_some(false), BTreeMap::new());
    if labelled {
        patch["metadata"]["labels"] = serde_json::json!({ LABEL_EXCLUDE_FROM_LB: null });
    }
    Some(patch)
}

/// The merge patch that adds [`TAINT_OUT_OF_SERVICE`]`=nodeshutdown:NoExecute` to `node`
/// (`None` when it is there).
pub fn out_of_service_patch(node: &NodeView) -> Option<serde_json::Value> {
    if node.has_taint(TAINT_OUT_OF_SERVICE, "NoExecute") {
        return None;
    }
    let mut taints = node.taints.clone();
    taints.push(Taint {
        key: TAINT_OUT_OF_SERVICE.into(),
        value: Some("nodeshutdown".into()),
        effect: "NoExecute".into(),
        ..Default::default()
    });
    Some(node_spec_patch(node, taints, None, BTreeMap::new()))
}

/// A merge patch of a Node's taints — a list the API replaces whole, so a taint someone else
/// added since `node` was seen would be lost: the patch carries the view's resourceVersion (the
/// API server answers 409 if the Node changed since) and its uid (a Node re-created under the
/// same name is another).
fn node_spec_patch(
    node: &NodeView,
    taints: Vec<Taint>,
    unschedulable: Option<bool>,
    labels: BTreeMap<&str, &str>,
) -> serde_json::Value {
    let mut spec = serde_json::json!({"taints": taints});
    if let Some(u) = unschedulable {
        spec["unschedulable"] = u.into();
    }
    let mut patch = serde_json::json!({"metadata": {"uid": node.uid}, "spec": spec});
    if !node.resource_version.is_empty() {
        patch["metadata"]["resourceVersion"] = node.resource_version.clone().into();
    }
    if !labels.is_empty() {
        patch["metadata"]["labels"] = serde_json::to_value(labels).unwrap_or_default();
    }
    patch
}

/// Keeps `target`'s cache current from a watch on Nodes, calling `wake` with every Machine a
/// Node change concerns. Runs until dropped; reconnects with backoff.
pub async fn watch(target: Arc<Target>, wake: impl Fn(Key)) {
    use futures::StreamExt;
    use kube::runtime::{watcher, WatchStreamExt};
    let stream = watcher(Api::<Node>::all(target.watch_client.clone()), watcher::Config::default()).default_backoff();
    let mut stream = std::pin::pin!(stream);
    while let Some(event) = stream.next().await {
        let woken = match event {
            Ok(watcher::Event::Apply(n)) => target.cache.apply(&n),
            Ok(watcher::Event::Delete(n)) => target.cache.delete(&n),
            Ok(watcher::Event::Init) => {
                target.cache.relist_begin();
                Vec::new()
            }
            Ok(watcher::Event::InitApply(n)) => {
                target.cache.relist_apply(&n);
                Vec::new()
            }
            Ok(watcher::Event::InitDone) => target.cache.relist_done(),
            Err(e) => {
                tracing::warn!("watching the target cluster's Nodes: {}", machine_driver_util::error_chain(&e));
                Vec::new()
            }
        };
        for key in woken {
            wake(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(taints: &[(&str, &str)], unschedulable: bool) -> NodeView {
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n1", "uid": "u1", "resourceVersion": "42"},
            "spec": {
                "unschedulable": unschedulable,
                "taints": taints.iter().map(|(k, e)| serde_json::json!({"key": k, "effect": e})).collect::<Vec<_>>(),
            },
        }))
        .unwrap();
        NodeView::of(&node).unwrap()
    }

    #[test]
    fn an_uncordon_undoes_the_cordon_and_keeps_what_others_set() {
        let mut node = view(&[("example.com/gpu", "NoSchedule"), (TAINT_DRAINING, "NoSchedule")], true);
        node.labels.insert(LABEL_EXCLUDE_FROM_LB.into(), "true".into());
        let patch = uncordon_patch(&node, false).expect("a patch");
        assert_eq!(patch["spec"]["unschedulable"], false);
        assert_eq!(patch["spec"]["taints"], serde_json::json!([{"key": "example.com/gpu", "effect": "NoSchedule"}]));
        assert_eq!(patch["metadata"]["labels"][LABEL_EXCLUDE_FROM_LB], serde_json::Value::Null);
        assert_eq!(patch["metadata"]["resourceVersion"], "42", "409 if the Node changed since it was seen");
        // Cordoned by someone else before the update: it stays unschedulable.
        let kept = uncordon_patch(&node, true).expect("a patch");
        assert!(kept["spec"].get("unschedulable").is_none(), "{kept}");
        // Nothing of ours left: no patch.
        assert_eq!(uncordon_patch(&view(&[("example.com/gpu", "NoSchedule")], false), false), None);
        assert_eq!(uncordon_patch(&view(&[], true), true), None);
    }

    #[test]
    fn a_cordon_keeps_others_taints_and_is_guarded_by_the_nodes_resource_version() {
        let node = view(&[("example.com/gpu", "NoSchedule")], false);
        let patch = cordon_patch(&node).expect("a patch");
        assert_eq!(patch["metadata"]["resourceVersion"], "42", "409 if the Node changed since it was seen");
        assert_eq!(patch["metadata"]["uid"], "u1");
        assert_eq!(patch["spec"]["unschedulable"], true);
        let taints: Vec<&str> =
            patch["spec"]["taints"].as_array().unwrap().iter().map(|t| t["key"].as_str().unwrap()).collect();
        assert_eq!(taints, ["example.com/gpu", TAINT_DRAINING]);
        assert_eq!(patch["metadata"]["labels"][LABEL_EXCLUDE_FROM_LB], "true");

        let mut cordoned = view(&[("example.com/gpu", "NoSchedule"), (TAINT_DRAINING, "NoSchedule")], true);
        cordoned.labels.insert(LABEL_EXCLUDE_FROM_LB.into(), "true".into());
        assert_eq!(cordon_patch(&cordoned), None, "nothing to write");

        let patch = out_of_service_patch(&cordoned).expect("a patch");
        assert_eq!(patch["metadata"]["resourceVersion"], "42");
        assert_eq!(patch["spec"]["taints"].as_array().unwrap().len(), 3);
        assert!(patch["spec"].get("unschedulable").is_none());
    }

    #[test]
    fn only_a_409_is_a_conflict() {
        let status = |code: u16| {
            kube::Error::Api(Box::new(
                serde_json::from_value(serde_json::json!({"code": code, "message": "m"})).unwrap(),
            ))
        };
        assert!(is_conflict(&status(409)));
        assert!(!is_conflict(&status(404)));
        assert!(!is_conflict(&status(422)));
    }
}
