//! The target cluster: where the Nodes of the machines live (machine-controller-manager's
//! control/target split). With one, a Machine is linked to its Node by provider ID, counts as
//! Running only once its Node is Ready, and is deleted in a recorded sequence that drains its
//! Node first (see [`crate::reconcile::node`]); without one, nodes are not managed.
//!
//! - [`cache`]: the Nodes from one watch, indexed by name and normalized provider ID;
//! - [`provider_id`]: how provider IDs compare;
//! - [`drain`]: what a drain does with each pod, and what an eviction's refusal means;
//! - [`metadata`]: the template's labels, annotations and taints kept on the Node;
//! - [`Target`]: the calls to the target cluster (cordon, evict, delete, annotate).

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod, Taint};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::api::{Api, DeleteParams, EvictParams, ListParams, Patch, PatchParams, PostParams, Preconditions};

pub mod cache;
pub mod drain;
pub mod metadata;
pub mod provider_id;

pub use cache::{Lookup, NodeCache, NodeView, Readiness};

use crate::resources::{ANNOTATION_NODE_MACHINE, TAINT_DRAINING};
use crate::store::Key;

/// The label that takes a node out of external load balancers (kube-proxy and the cloud
/// load-balancer controllers honour it).
pub const LABEL_EXCLUDE_FROM_LB: &str = "node.kubernetes.io/exclude-from-external-load-balancers";
/// The taint that marks a node whose machine is shut down, so its pods are deleted and its
/// volumes detached without the kubelet (Kubernetes' non-graceful node shutdown).
pub const TAINT_OUT_OF_SERVICE: &str = "node.kubernetes.io/out-of-service";

/// Errors of calls to the target cluster.
pub type Error = kube::Error;

/// What an eviction did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Evicted {
    /// Accepted: the pod is being deleted.
    Accepted,
    /// The pod is gone already (or was replaced by another of the same name).
    Gone,
    /// Refused for now (a PodDisruptionBudget, or several of them, or throttling).
    Refused(drain::Refusal),
}

/// The target cluster.
pub struct Target {
    client: kube::Client,
    /// Its Nodes.
    pub cache: Arc<NodeCache>,
}

impl Target {
    /// A target cluster reached with `client` (its cache fills once [`watch`] runs).
    pub fn new(client: kube::Client) -> Self {
        Self { client, cache: Arc::new(NodeCache::default()) }
    }

    /// A target cluster from a kubeconfig file (never the process's environment: the control
    /// cluster may be another).
    ///
    /// # Errors
    /// An unreadable or invalid kubeconfig.
    pub async fn from_kubeconfig(path: &std::path::Path) -> Result<Self, String> {
        let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let config = kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Self::from_config(config).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The target cluster of the process's environment (in-cluster, or `KUBECONFIG`): the
    /// same cluster as `--store kubernetes`.
    ///
    /// # Errors
    /// No usable configuration.
    pub async fn infer() -> Result<Self, String> {
        let config = kube::Config::infer().await.map_err(|e| e.to_string())?;
        Self::from_config(config).map_err(|e| e.to_string())
    }

    /// A target cluster from a client configuration, with the client's own retries off: kube's
    /// default retries 429 for minutes, and a 429 from the Eviction API is a
    /// PodDisruptionBudget's answer that the drain reports and asks again, not throttling to
    /// sit out inside one call.
    ///
    /// # Errors
    /// A configuration the client refuses.
    pub fn from_config(mut config: kube::Config) -> Result<Self, kube::Error> {
        config.default_retry = false;
        Ok(Self::new(kube::Client::try_from(config)?))
    }

    /// Its client (for probes: [`crate::safety`]).
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
        let patch = serde_json::json!({"metadata": {"annotations": {ANNOTATION_NODE_MACHINE: value}}});
        self.nodes().patch(&node.name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
        Ok(())
    }

    /// Brings the Node's labels, annotations and taints to the template's (see [`metadata`]).
    /// `true` when it wrote.
    ///
    /// # Errors
    /// The API server's refusal.
    pub async fn sync_metadata(
        &self,
        node: &NodeView,
        desired: &crate::resources::NodeTemplate,
    ) -> Result<bool, Error> {
        let Some(patch) = metadata::patch(node, desired) else { return Ok(false) };
        self.nodes().patch(&node.name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
        Ok(true)
    }

    /// Cordons a Node: `spec.unschedulable`, the draining `NoSchedule` taint and the label that
    /// takes it out of external load balancers. Does nothing if all three are there already.
    ///
    /// # Errors
    /// The API server's refusal (a conflict is retried by the next reconcile).
    pub async fn cordon(&self, node: &NodeView) -> Result<(), Error> {
        let tainted = node.has_taint(TAINT_DRAINING, "NoSchedule");
        if node.unschedulable && tainted && node.labels.contains_key(LABEL_EXCLUDE_FROM_LB) {
            return Ok(());
        }
        let mut taints = node.taints.clone();
        if !tainted {
            taints.push(Taint { key: TAINT_DRAINING.into(), effect: "NoSchedule".into(), ..Default::default() });
        }
        self.patch_node_spec(node, taints, Some(true), BTreeMap::from([(LABEL_EXCLUDE_FROM_LB, "true")])).await
    }

    /// Adds `node.kubernetes.io/out-of-service=nodeshutdown:NoExecute`: the VM is gone, so the
    /// pods are deleted and volumes detached without waiting for its kubelet.
    ///
    /// # Errors
    /// The API server's refusal.
    pub async fn mark_out_of_service(&self, node: &NodeView) -> Result<(), Error> {
        if node.has_taint(TAINT_OUT_OF_SERVICE, "NoExecute") {
            return Ok(());
        }
        let mut taints = node.taints.clone();
        taints.push(Taint {
            key: TAINT_OUT_OF_SERVICE.into(),
            value: Some("nodeshutdown".into()),
            effect: "NoExecute".into(),
            ..Default::default()
        });
        self.patch_node_spec(node, taints, None, BTreeMap::new()).await
    }

    /// Writes a Node's taints (a list the API replaces whole), guarded by its uid so a Node
    /// re-created under the same name is not touched.
    async fn patch_node_spec(
        &self,
        node: &NodeView,
        taints: Vec<Taint>,
        unschedulable: Option<bool>,
        labels: BTreeMap<&str, &str>,
    ) -> Result<(), Error> {
        let mut spec = serde_json::json!({"taints": taints});
        if let Some(u) = unschedulable {
            spec["unschedulable"] = u.into();
        }
        let mut patch = serde_json::json!({"metadata": {"uid": node.uid}, "spec": spec});
        if !labels.is_empty() {
            patch["metadata"]["labels"] = serde_json::to_value(labels).unwrap_or_default();
        }
        self.nodes().patch(&node.name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
        Ok(())
    }

    /// The pods bound to a Node.
    ///
    /// # Errors
    /// The API server's refusal.
    pub async fn pods_on(&self, node: &str) -> Result<Vec<Pod>, Error> {
        let api: Api<Pod> = Api::all(self.client.clone());
        Ok(api.list(&ListParams::default().fields(&format!("spec.nodeName={node}"))).await?.items)
    }

    /// Evicts a pod through the Eviction API (PodDisruptionBudgets decide), with its uid as a
    /// precondition so a new pod of the same name is not evicted in its place.
    ///
    /// # Errors
    /// Failures other than the answers [`Evicted`] names.
    pub async fn evict(&self, pod: &Pod) -> Result<Evicted, Error> {
        let (ns, name) = pod_key(pod);
        let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let params = EvictParams {
            delete_options: Some(DeleteParams {
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
        Api::<PodDisruptionBudget>::namespaced(self.client.clone(), namespace).get_opt(name).await
    }

    /// How many VolumeAttachments still name the Node.
    ///
    /// # Errors
    /// The API server's refusal.
    pub async fn volume_attachments(&self, node: &str) -> Result<usize, Error> {
        let api: Api<VolumeAttachment> = Api::all(self.client.clone());
        let all = api.list(&ListParams::default()).await?;
        Ok(all.items.iter().filter(|va| va.spec.node_name == node).count())
    }

    /// Deletes a Node (uid precondition when known; gone is done).
    ///
    /// # Errors
    /// The API server's refusal.
    pub async fn delete_node(&self, name: &str, uid: &str) -> Result<(), Error> {
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

fn pod_key(pod: &Pod) -> (&str, &str) {
    (pod.metadata.namespace.as_deref().unwrap_or("default"), pod.metadata.name.as_deref().unwrap_or_default())
}

/// `namespace/name` of a pod.
pub fn pod_name(pod: &Pod) -> String {
    let (ns, name) = pod_key(pod);
    format!("{ns}/{name}")
}

/// Keeps `target`'s cache current from a watch on Nodes, calling `wake` with every Machine a
/// Node change concerns. Runs until dropped; reconnects with backoff.
pub async fn watch(target: Arc<Target>, wake: impl Fn(Key)) {
    use futures::StreamExt;
    use kube::runtime::{watcher, WatchStreamExt};
    let stream = watcher(target.nodes(), watcher::Config::default()).default_backoff();
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
