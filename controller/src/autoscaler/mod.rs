//! The cluster-autoscaler's cloud provider: an externalgrpc server (`run --autoscaler-listen`)
//! through which the real Kubernetes cluster-autoscaler (`--cloud-provider=externalgrpc`) sizes
//! every MachineDeployment and MachinePool that has `spec.autoscaling`.
//!
//! - Reads come from a [`groups::Snapshot`] built on `Refresh` (before every autoscaler loop) or
//!   when the last one is older than [`MAX_SNAPSHOT_AGE`]: `NodeGroupForNode`, called for every
//!   node on every loop, is one hash lookup.
//! - Writes (`NodeGroupIncreaseSize`, `NodeGroupDeleteNodes`, `NodeGroupDecreaseTargetSize`) read
//!   the owner fresh and change it in one write (`replicas`, the last-change annotation), one at
//!   a time; they return at once (the autoscaler's call deadline is a few seconds) and the owner's
//!   reconciler creates or removes the machines. `DeleteNodes` marks the exact machines
//!   (`machine.driver.dev/delete-machine`, disruption reason `Autoscaler`) in the same pass.
//! - Only the leader answers; a replica that is not acting answers `UNAVAILABLE`, and the
//!   autoscaler retries.

pub mod groups;
pub mod template;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use autoscaler_proto::pb;
use autoscaler_proto::pb::cloud_provider_server::{CloudProvider, CloudProviderServer};
use chrono::Utc;
use tonic::{Request, Response, Status};

use self::groups::{delete_nodes_verdict, parse_group_id, Group, NodeGroupOwner, Shared, Snapshot};
use crate::events::EventReason;
use crate::nodes::provider_id::normalize;
use crate::nodes::Target;
use crate::plan::member::Member;
use crate::resources::*;
use crate::store::{Error as StoreError, Key, Store};

/// A snapshot older than this is read again before a call is answered from it (the autoscaler
/// refreshes before every loop; this bounds staleness for callers that do not).
pub const MAX_SNAPSHOT_AGE: Duration = Duration::from_secs(10);
/// Attempts at a size write that conflicts with the owner's reconciler.
const WRITE_ATTEMPTS: usize = 5;
/// The pause after a conflicting size write, times the attempt (within the autoscaler's call
/// deadline: 50 + 100 + … + 250 ms at most).
const CONFLICT_PAUSE: Duration = Duration::from_millis(50);

/// Where and how the server listens.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The TCP address.
    pub listen: SocketAddr,
    /// Mutual TLS: the server's certificate and key and the CA its clients' certificates are
    /// checked against (the autoscaler speaks mTLS or plaintext, nothing between).
    pub tls: Option<TlsFiles>,
    /// Serve plaintext on an address other than loopback.
    pub allow_plaintext: bool,
}

/// PEM files of mutual TLS.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The server's certificate chain.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// The CA of the client certificates.
    pub client_ca: PathBuf,
}

impl Settings {
    /// Checks the combination: plaintext only on loopback unless allowed.
    ///
    /// # Errors
    /// What is wrong, naming the flags.
    pub fn check(&self) -> Result<(), String> {
        if self.tls.is_none() && !self.listen.ip().is_loopback() && !self.allow_plaintext {
            return Err(format!(
                "--autoscaler-listen {} is not a loopback address: give --autoscaler-tls-cert, \
                 --autoscaler-tls-key and --autoscaler-client-ca (mutual TLS), or \
                 --autoscaler-allow-plaintext",
                self.listen
            ));
        }
        Ok(())
    }
}

/// The open connection to a server's target cluster, looked up per call (a named target's
/// connection is built by the reconcilers, and built again after a rotation).
pub type TargetLookup = Arc<dyn Fn() -> Option<Arc<Target>> + Send + Sync>;

/// The externalgrpc `CloudProvider` service of one target cluster: its node groups are the
/// autoscaled owners whose Nodes live there (the autoscaler of each cluster sees its own).
pub struct Server {
    store: Store,
    scope: crate::targets::TargetId,
    target: TargetLookup,
    acting: Arc<AtomicBool>,
    snapshot: RwLock<Option<(Instant, Shared)>>,
    /// One size write at a time: two calls for one group must not both read the old size.
    writes: tokio::sync::Mutex<()>,
}

impl Server {
    /// A server over `store` for the owners of the default target cluster `target`; it answers
    /// while `acting` is true.
    pub fn new(store: Store, target: Option<Arc<Target>>, acting: Arc<AtomicBool>) -> Self {
        Self::for_target(store, crate::targets::TargetId::Default, Arc::new(move || target.clone()), acting)
    }

    /// A server over `store` for the owners whose Nodes live in `scope` (its connection from
    /// `target`); it answers while `acting` is true.
    pub fn for_target(
        store: Store,
        scope: crate::targets::TargetId,
        target: TargetLookup,
        acting: Arc<AtomicBool>,
    ) -> Self {
        Self { store, scope, target, acting, snapshot: RwLock::new(None), writes: tokio::sync::Mutex::new(()) }
    }

    fn check_acting(&self) -> Result<(), Status> {
        if self.acting.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err(Status::unavailable("this machine-controller replica is not the leader; retry"))
        }
    }

    /// The current snapshot; read again when `fresh`, or when there is none or it is too old.
    async fn snapshot(&self, fresh: bool) -> Result<Shared, Status> {
        self.check_acting()?;
        if !fresh {
            let held = self.snapshot.read().unwrap_or_else(|p| p.into_inner()).clone();
            if let Some((_, snap)) = held.filter(|(at, _)| at.elapsed() < MAX_SNAPSHOT_AGE) {
                return Ok(snap);
            }
        }
        let cache = (self.target)().map(|t| t.cache.clone());
        let node_provider_id = move |name: &str| cache.as_ref()?.get(name).map(|n| n.provider_id.clone());
        let snap = Arc::new(Snapshot::read(&self.store, &self.scope, &node_provider_id).await.map_err(store_status)?);
        *self.snapshot.write().unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), snap.clone()));
        Ok(snap)
    }

    fn invalidate(&self) {
        *self.snapshot.write().unwrap_or_else(|p| p.into_inner()) = None;
    }

    async fn group(&self, id: &str) -> Result<Group, Status> {
        let snap = self.snapshot(false).await?;
        snap.groups.get(id).cloned().ok_or_else(|| unknown_group(id))
    }

    /// Reads the owner of group `id` fresh, with its `spec.autoscaling`.
    async fn owner<O: NodeGroupOwner>(&self, key: &Key, id: &str) -> Result<(O, Autoscaling), Status> {
        let owner = self.store.get::<O>(&key.namespace, &key.name).await.map_err(store_status)?;
        let owner = owner.ok_or_else(|| unknown_group(id))?;
        let autoscaling = owner.autoscaling().cloned().ok_or_else(|| {
            Status::not_found(format!("{} {} has no spec.autoscaling: it is not a node group", key.kind, key.name))
        })?;
        Ok((owner, autoscaling))
    }

    /// Writes `replicas` (and marks `doomed` machines) in the owner's one write, retrying when its
    /// reconciler wrote in between. `change` gets the fresh owner and returns the new size and
    /// the machines to mark, or the refusal.
    async fn resize<O: NodeGroupOwner>(
        &self,
        key: &Key,
        id: &str,
        call: &str,
        change: impl Fn(&O, &Autoscaling) -> Result<Resize, Status>,
    ) -> Result<(), Status> {
        self.check_acting()?;
        let _one = self.writes.lock().await;
        // Machines this call marked: unmarked again if it does not lower the size after all (a
        // later attempt refused, the store failed), so no mark outlives a refusal.
        let mut marked: Vec<(String, String)> = Vec::new();
        let result = self.resize_attempts(key, id, call, &change, &mut marked).await;
        if result.is_err() {
            for (namespace, name) in &marked {
                if let Err(e) = self.unmark(namespace, name).await {
                    tracing::warn!("unmarking machine {namespace}/{name} after a refused {call}: {}", e.message());
                }
            }
        }
        result
    }

    async fn resize_attempts<O: NodeGroupOwner>(
        &self,
        key: &Key,
        id: &str,
        call: &str,
        change: &impl Fn(&O, &Autoscaling) -> Result<Resize, Status>,
        marked: &mut Vec<(String, String)>,
    ) -> Result<(), Status> {
        for attempt in 0..WRITE_ATTEMPTS as u32 {
            let (owner, autoscaling) = self.owner::<O>(key, id).await?;
            let resize = match change(&owner, &autoscaling) {
                Ok(r) => r,
                Err(status) => {
                    let message = format!("refused {call} from the cluster-autoscaler: {}", status.message());
                    self.store.event(key.kind, owner.meta(), EventReason::AutoscalerRefused, message).await;
                    return Err(status);
                }
            };
            if resize.replicas == owner.replicas() && resize.mark.is_empty() {
                // Nothing to change (the named machines are on their way out already).
                return Ok(());
            }
            for machine in &resize.mark {
                self.mark(&key.namespace, machine).await?;
                marked.push((key.namespace.clone(), machine.clone()));
            }
            let (from, to) = (owner.replicas(), resize.replicas);
            let note = format!("{} {call} {from} -> {to}{}", Utc::now().format("%Y-%m-%dT%H:%M:%SZ"), resize.detail);
            let mut next = owner.clone();
            next.set_replicas(to);
            next.meta_mut().annotations.insert(ANNOTATION_AUTOSCALER_LAST_CHANGE.into(), note);
            match self.store.update(&next).await {
                Ok(_) => {
                    self.invalidate();
                    let message = format!("the cluster-autoscaler's {call}: replicas {from} -> {to}{}", resize.detail);
                    self.store.event(key.kind, owner.meta(), EventReason::AutoscalerResized, message).await;
                    return Ok(());
                }
                // The reconciler wrote it in between (or this process's view is behind another
                // writer's): read it again, a little later each time.
                Err(StoreError::Conflict { .. }) => tokio::time::sleep(CONFLICT_PAUSE * (attempt + 1)).await,
                Err(e) => return Err(store_status(e)),
            }
        }
        Err(Status::aborted(format!("{id} kept changing while {call} wrote it; retry")))
    }

    /// Marks a machine for removal by the autoscaler: deleted first on the scale-down that
    /// follows, as an `Autoscaler` disruption. Written before `replicas` is lowered, so a crash in
    /// between leaves a marked machine and the old size (the autoscaler retries), never a lower
    /// size that takes another machine.
    async fn mark(&self, namespace: &str, name: &str) -> Result<(), Status> {
        for _ in 0..WRITE_ATTEMPTS {
            let Some(mut m) = self.store.get::<Machine>(namespace, name).await.map_err(store_status)? else {
                return Err(Status::not_found(format!("machine {namespace}/{name} is gone")));
            };
            let deleted_first = m.metadata.annotations.insert(ANNOTATION_DELETE.into(), "true".into());
            let newly = m.mark_disruption(DisruptionReason::Autoscaler);
            if !newly && deleted_first.as_deref() == Some("true") {
                return Ok(());
            }
            match self.store.update(&m).await {
                Ok(_) => return Ok(()),
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(store_status(e)),
            }
        }
        Err(Status::aborted(format!("machine {namespace}/{name} kept changing; retry")))
    }
}

impl Server {
    /// Takes the autoscaler's marks off a machine again.
    async fn unmark(&self, namespace: &str, name: &str) -> Result<(), Status> {
        for _ in 0..WRITE_ATTEMPTS {
            let Some(mut m) = self.store.get::<Machine>(namespace, name).await.map_err(store_status)? else {
                return Ok(());
            };
            if m.disruption() != Some(DisruptionReason::Autoscaler) {
                return Ok(());
            }
            m.metadata.annotations.remove(ANNOTATION_DELETE);
            m.clear_disruption();
            match self.store.update(&m).await {
                Ok(_) => return Ok(()),
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(store_status(e)),
            }
        }
        Err(Status::aborted(format!("machine {namespace}/{name} kept changing; retry")))
    }
}

/// What a size call changes.
struct Resize {
    replicas: i64,
    /// Machines to mark for removal.
    mark: Vec<String>,
    /// Said in the event and the annotation (`: removing web-1`).
    detail: String,
}

fn unknown_group(id: &str) -> Status {
    Status::not_found(format!(
        "node group {id:?} not found: a group is a MachineDeployment (namespace/name) or a MachinePool \
         (MachinePool/namespace/name) with spec.autoscaling"
    ))
}

fn store_status(e: StoreError) -> Status {
    match e {
        StoreError::Unavailable { .. } => Status::unavailable(machine_driver_util::error_chain(&e)),
        StoreError::NotFound(_) => Status::not_found(e.to_string()),
        StoreError::Conflict { .. } => Status::aborted(e.to_string()),
        StoreError::Unreadable { .. } => Status::failed_precondition(machine_driver_util::error_chain(&e)),
        e => Status::internal(machine_driver_util::error_chain(&e)),
    }
}

#[tonic::async_trait]
impl CloudProvider for Server {
    async fn node_groups(&self, _: Request<pb::NodeGroupsRequest>) -> Result<Response<pb::NodeGroupsResponse>, Status> {
        let snap = self.snapshot(false).await?;
        Ok(Response::new(pb::NodeGroupsResponse { node_groups: snap.groups.values().map(Group::to_pb).collect() }))
    }

    async fn node_group_for_node(
        &self,
        request: Request<pb::NodeGroupForNodeRequest>,
    ) -> Result<Response<pb::NodeGroupForNodeResponse>, Status> {
        let node = request.into_inner().node.ok_or_else(|| Status::invalid_argument("node is required"))?;
        let snap = self.snapshot(false).await?;
        // A node that is not ours (or has no provider ID yet) has the empty group: not an error.
        let group = snap.group_of(&node.provider_id).map_or_else(pb::NodeGroup::default, Group::to_pb);
        Ok(Response::new(pb::NodeGroupForNodeResponse { node_group: Some(group) }))
    }

    async fn pricing_node_price(
        &self,
        _: Request<pb::PricingNodePriceRequest>,
    ) -> Result<Response<pb::PricingNodePriceResponse>, Status> {
        Err(Status::unimplemented("no pricing: use an expander other than price"))
    }

    async fn pricing_pod_price(
        &self,
        _: Request<pb::PricingPodPriceRequest>,
    ) -> Result<Response<pb::PricingPodPriceResponse>, Status> {
        Err(Status::unimplemented("no pricing: use an expander other than price"))
    }

    async fn gpu_label(&self, _: Request<pb::GpuLabelRequest>) -> Result<Response<pb::GpuLabelResponse>, Status> {
        self.check_acting()?;
        Ok(Response::new(pb::GpuLabelResponse { label: template::GPU_LABEL.into() }))
    }

    async fn get_available_gpu_types(
        &self,
        _: Request<pb::GetAvailableGpuTypesRequest>,
    ) -> Result<Response<pb::GetAvailableGpuTypesResponse>, Status> {
        self.check_acting()?;
        Ok(Response::new(pb::GetAvailableGpuTypesResponse::default()))
    }

    async fn cleanup(&self, _: Request<pb::CleanupRequest>) -> Result<Response<pb::CleanupResponse>, Status> {
        self.invalidate();
        Ok(Response::new(pb::CleanupResponse {}))
    }

    async fn refresh(&self, _: Request<pb::RefreshRequest>) -> Result<Response<pb::RefreshResponse>, Status> {
        self.snapshot(true).await?;
        Ok(Response::new(pb::RefreshResponse {}))
    }

    async fn node_group_target_size(
        &self,
        request: Request<pb::NodeGroupTargetSizeRequest>,
    ) -> Result<Response<pb::NodeGroupTargetSizeResponse>, Status> {
        let g = self.group(&request.into_inner().id).await?;
        Ok(Response::new(pb::NodeGroupTargetSizeResponse { target_size: groups::clamp_i32(g.replicas) }))
    }

    async fn node_group_increase_size(
        &self,
        request: Request<pb::NodeGroupIncreaseSizeRequest>,
    ) -> Result<Response<pb::NodeGroupIncreaseSizeResponse>, Status> {
        let r = request.into_inner();
        let key = parse_group_id(&r.id).ok_or_else(|| unknown_group(&r.id))?;
        match key.kind {
            Kind::MachinePool => self.increase_size::<MachinePool>(&key, &r).await?,
            _ => self.increase_size::<MachineDeployment>(&key, &r).await?,
        }
        Ok(Response::new(pb::NodeGroupIncreaseSizeResponse {}))
    }

    async fn node_group_delete_nodes(
        &self,
        request: Request<pb::NodeGroupDeleteNodesRequest>,
    ) -> Result<Response<pb::NodeGroupDeleteNodesResponse>, Status> {
        let r = request.into_inner();
        if r.nodes.is_empty() {
            return Err(Status::invalid_argument("nodes is empty"));
        }
        let key = parse_group_id(&r.id).ok_or_else(|| unknown_group(&r.id))?;
        match key.kind {
            Kind::MachinePool => self.delete_nodes::<MachinePool>(&key, &r).await?,
            _ => self.delete_nodes::<MachineDeployment>(&key, &r).await?,
        }
        Ok(Response::new(pb::NodeGroupDeleteNodesResponse {}))
    }

    async fn node_group_decrease_target_size(
        &self,
        request: Request<pb::NodeGroupDecreaseTargetSizeRequest>,
    ) -> Result<Response<pb::NodeGroupDecreaseTargetSizeResponse>, Status> {
        let r = request.into_inner();
        let key = parse_group_id(&r.id).ok_or_else(|| unknown_group(&r.id))?;
        match key.kind {
            Kind::MachinePool => self.decrease_target_size::<MachinePool>(&key, &r).await?,
            _ => self.decrease_target_size::<MachineDeployment>(&key, &r).await?,
        }
        Ok(Response::new(pb::NodeGroupDecreaseTargetSizeResponse {}))
    }

    async fn node_group_nodes(
        &self,
        request: Request<pb::NodeGroupNodesRequest>,
    ) -> Result<Response<pb::NodeGroupNodesResponse>, Status> {
        let g = self.group(&request.into_inner().id).await?;
        Ok(Response::new(pb::NodeGroupNodesResponse { instances: g.instances }))
    }

    async fn node_group_template_node_info(
        &self,
        request: Request<pb::NodeGroupTemplateNodeInfoRequest>,
    ) -> Result<Response<pb::NodeGroupTemplateNodeInfoResponse>, Status> {
        let g = self.group(&request.into_inner().id).await?;
        let class = self.store.get::<MachineClass>(&g.key.namespace, &g.class).await.map_err(store_status)?;
        let node_bytes = template::node_bytes(&g, class.as_ref())?;
        Ok(Response::new(pb::NodeGroupTemplateNodeInfoResponse { node_bytes }))
    }

    async fn node_group_get_options(
        &self,
        request: Request<pb::NodeGroupAutoscalingOptionsRequest>,
    ) -> Result<Response<pb::NodeGroupAutoscalingOptionsResponse>, Status> {
        let r = request.into_inner();
        let g = self.group(&r.id).await?;
        let options = template::options(&g.autoscaling.scale_down, r.defaults.unwrap_or_default());
        Ok(Response::new(pb::NodeGroupAutoscalingOptionsResponse { node_group_autoscaling_options: Some(options) }))
    }
}

/// A machine of a group, as `DeleteNodes` and `DecreaseTargetSize` weigh it.
#[derive(Debug, Clone)]
struct MachineRef {
    name: String,
    /// The IDs it answers to, normalized: its provider ID (and its Node's) and its placeholder.
    ids: Vec<String>,
    /// Being deleted (its removal is counted in `replicas` already).
    going: bool,
    /// It has a provider ID: the cloud has it.
    registered: bool,
}

impl Server {
    /// The owner's machines, read fresh: as the size calls match them, and as its planner reads
    /// them.
    async fn machines_of(&self, key: &Key) -> Result<(Vec<MachineRef>, Vec<Member>), Status> {
        let label = if key.kind == Kind::MachinePool { LABEL_POOL } else { LABEL_DEPLOYMENT };
        let params = crate::store::ListParams::namespaced(&key.namespace).label(label, &key.name);
        let machines = self.store.list_with::<Machine>(&params).await.map_err(store_status)?;
        let members = machines
            .iter()
            .map(|m| Member::read(m).map_err(|e| Status::internal(format!("machine {}: {e}", m.metadata.name))))
            .collect::<Result<Vec<Member>, Status>>()?;
        let cache = (self.target)().map(|t| t.cache.clone());
        let refs = machines
            .into_iter()
            .map(|m| {
                let mut ids =
                    vec![normalize(&m.status.provider_id), groups::placeholder(&key.namespace, &m.metadata.name)];
                if let Some(n) = m.status.node_ref.as_ref().and_then(|n| cache.as_ref()?.get(&n.name)) {
                    ids.push(normalize(&n.provider_id));
                }
                ids.retain(|id| !id.is_empty());
                // A machine only marked is counted again: a mark whose size write never
                // happened (a crash in between) must not make the retry a no-op.
                MachineRef {
                    going: m.metadata.deletion_timestamp.is_some(),
                    registered: !m.status.provider_id.is_empty(),
                    name: m.metadata.name,
                    ids,
                }
            })
            .collect();
        Ok((refs, members))
    }

    /// `NodeGroupIncreaseSize`: `replicas` up by `delta`, within `maxReplicas`.
    async fn increase_size<O: NodeGroupOwner>(
        &self,
        key: &Key,
        r: &pb::NodeGroupIncreaseSizeRequest,
    ) -> Result<(), Status> {
        let delta = i64::from(r.delta);
        self.resize::<O>(key, &r.id, "IncreaseSize", |owner, a| {
            if delta <= 0 {
                return Err(Status::invalid_argument(format!("delta must be positive, got {delta}")));
            }
            let to = owner.replicas() + delta;
            if to > a.max_replicas {
                return Err(Status::failed_precondition(format!(
                    "size increase too large: {} + {delta} is above maxReplicas {}",
                    owner.replicas(),
                    a.max_replicas
                )));
            }
            Ok(Resize { replicas: to, mark: Vec::new(), detail: String::new() })
        })
        .await
    }

    /// `NodeGroupDeleteNodes`: the machines of exactly these nodes marked and `replicas` lowered
    /// by as many, in one pass — unless the owner is rolling out, it would go below
    /// `minReplicas`, or the disruption planner holds their removal (an `Autoscaler` disruption:
    /// the hold's words are the refusal's).
    async fn delete_nodes<O: NodeGroupOwner>(
        &self,
        key: &Key,
        r: &pb::NodeGroupDeleteNodesRequest,
    ) -> Result<(), Status> {
        // The machines of the nodes, read fresh.
        let wanted: Vec<(String, String)> =
            r.nodes.iter().map(|n| (normalize(&n.provider_id), n.name.clone())).collect();
        let (machines, members) = self.machines_of(key).await?;
        let mut doomed = Vec::new();
        for (pid, node) in &wanted {
            let found = machines.iter().find(|m| !pid.is_empty() && m.ids.iter().any(|id| id == pid));
            let Some(m) = found else {
                return Err(Status::invalid_argument(format!(
                    "node {node:?} (provider ID {pid:?}) is not a machine of node group {}",
                    r.id
                )));
            };
            doomed.push(m.clone());
        }
        self.resize::<O>(key, &r.id, "DeleteNodes", |owner, a| {
            if let Some((updated, machines)) = owner.rolling_out() {
                return Err(Status::failed_precondition(format!(
                    "{} is rolling out (updated {updated} of {machines}): no scale-down until it is done",
                    r.id
                )));
            }
            // Machines already on their way out lower nothing again.
            let names: Vec<&str> = doomed.iter().filter(|m| !m.going).map(|m| m.name.as_str()).collect();
            let n = names.len() as i64;
            let to = owner.replicas() - n;
            if to < a.min_replicas {
                return Err(Status::failed_precondition(format!(
                    "removing {n} node(s) would leave {to}, below minReplicas {}",
                    a.min_replicas
                )));
            }
            if let Err(hold) = delete_nodes_verdict(owner, &members, &names, Utc::now()) {
                return Err(Status::failed_precondition(format!(
                    "the removal of {} (reason Autoscaler) is held: {hold}",
                    names.join(", ")
                )));
            }
            let mark: Vec<String> = names.iter().map(|n| n.to_string()).collect();
            Ok(Resize { replicas: to, detail: format!(": removing {}", names.join(", ")), mark })
        })
        .await
    }

    /// `NodeGroupDecreaseTargetSize`: `replicas` down by `delta` without removing a machine
    /// that has joined (only `DeleteNodes` removes those).
    async fn decrease_target_size<O: NodeGroupOwner>(
        &self,
        key: &Key,
        r: &pb::NodeGroupDecreaseTargetSizeRequest,
    ) -> Result<(), Status> {
        let delta = i64::from(r.delta);
        let (machines, _) = self.machines_of(key).await?;
        // Machines that have a Node (or at least a provider ID) are fulfilled requests: only
        // DeleteNodes removes them.
        let fulfilled = machines.iter().filter(|m| !m.going && m.registered).count() as i64;
        self.resize::<O>(key, &r.id, "DecreaseTargetSize", |owner, _| {
            if delta >= 0 {
                return Err(Status::invalid_argument(format!("delta must be negative, got {delta}")));
            }
            let to = owner.replicas() + delta;
            if to < fulfilled {
                return Err(Status::failed_precondition(format!(
                    "attempt to delete existing nodes: {} + {delta} is below the {fulfilled} machine(s) that have \
                     joined; remove those with DeleteNodes",
                    owner.replicas()
                )));
            }
            Ok(Resize { replicas: to, mark: Vec::new(), detail: String::new() })
        })
        .await
    }
}

/// Serves the autoscaler's cloud provider until `stop` resolves.
///
/// # Errors
/// An address that cannot be bound, a TLS file that cannot be read, a plaintext non-loopback
/// address without `allow_plaintext`.
pub async fn serve(
    settings: Settings,
    server: Server,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<tokio::task::JoinHandle<()>, String> {
    settings.check()?;
    let listener = tokio::net::TcpListener::bind(settings.listen)
        .await
        .map_err(|e| format!("--autoscaler-listen {}: {e}", settings.listen))?;
    let local = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
    let mut builder = tonic::transport::Server::builder();
    let scheme = if let Some(tls) = &settings.tls {
        let read = |p: &PathBuf| std::fs::read(p).map_err(|e| format!("reading {}: {e}", p.display()));
        let config = tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(read(&tls.cert)?, read(&tls.key)?))
            .client_ca_root(tonic::transport::Certificate::from_pem(read(&tls.client_ca)?));
        builder = builder.tls_config(config).map_err(|e| format!("autoscaler TLS: {e}"))?;
        "mutual TLS"
    } else {
        "plaintext"
    };
    // Reflection in both versions: grpcurl before 1.9 asks only v1alpha.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(autoscaler_proto::FILE_DESCRIPTOR_SET)
    };
    let v1 = reflection().build_v1().map_err(|e| format!("reflection: {e}"))?;
    let v1alpha = reflection().build_v1alpha().map_err(|e| format!("reflection: {e}"))?;
    let scope = server.scope.clone();
    let router = builder.add_service(CloudProviderServer::new(server)).add_service(v1).add_service(v1alpha);
    tracing::info!(
        "cluster-autoscaler cloud provider (externalgrpc) on {local} ({scheme}) for the node groups of target {scope}"
    );
    // Calls come one after another on one connection: no Nagle delay on the answers.
    let incoming = tokio_stream::StreamExt::map(tokio_stream::wrappers::TcpListenerStream::new(listener), |conn| {
        conn.inspect(|s| {
            let _ = s.set_nodelay(true);
        })
    });
    Ok(tokio::spawn(async move {
        if let Err(e) = router.serve_with_incoming_shutdown(incoming, stop).await {
            tracing::error!("the autoscaler server stopped: {e}");
        }
    }))
}
