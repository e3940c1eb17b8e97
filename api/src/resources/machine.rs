//! `Machine`: one cloud machine, created, polled, health-checked and deleted through its class's
//! driver; with its phase and the state of its deletion.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::checks::{self, Check};
use super::disruption::DisruptionReason;
use super::kind::{Column, ColumnType, KindInfo, Shown, Via};
use super::meta::{is_default, KindOf, Object, Time, ANNOTATION_DISRUPTION, LABEL_REVISION};
use super::state::{wire_enum, Reason};
use super::status::{Condition, LastOperation, StoredOperation};
use super::template::{NameRef, NodeSettings, NodeTemplate, TargetCluster};
use crate::registry::Kind;

/// Which pool instance a pool Machine stands for.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolInstanceRef {
    /// The MachinePool.
    pub name: String,
    /// The instance ID in the pool.
    pub instance_id: String,
}

/// Desired state of a Machine.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MachineSpec {
    /// The MachineClass.
    pub class_ref: NameRef,
    /// Fields merged over the class's provider spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_spec: Option<Value>,
    /// Set for pool Machines: the instance this Machine mirrors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_ref: Option<PoolInstanceRef>,
    /// Not Running this long after create started → Failed (default 1200).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_timeout_seconds: Option<u64>,
    /// Unhealthy or missing this long → Failed (default 600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_timeout_seconds: Option<u64>,
    /// Node lifecycle settings (copied from the owning deployment or pool; defaults otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<NodeSettings>,
    /// Labels, annotations and taints kept on the Node (from the template).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_template: Option<NodeTemplate>,
    /// The cluster its Nodes live in, when not the controller's default target: a kubeconfig
    /// Secret in this namespace (see the book's "Many target clusters"). Fixed once set: the
    /// machines already made stay in the cluster they joined.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_cluster: Option<TargetCluster>,
    /// The failure domain its owner put it in (one of the owner's `spec.failureDomains`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_domain: Option<String>,
}

wire_enum! {
    /// Lifecycle phase of a Machine. [`Phase::ALL`] lists every phase (the controller's
    /// `controller_machines` gauge has a series for each).
    #[derive(Default)]
    pub enum Phase {
        /// Accepted; nothing asked of the cloud yet.
        #[default]
        Pending,
        /// A create operation is in flight.
        Creating,
        /// The VM runs; its Node has not joined or is not Ready yet (only with a target cluster).
        Provisioned,
        /// Up (with a target cluster: its Node is Ready).
        Running,
        /// An in-place update is in flight.
        Updating,
        /// Being deleted.
        Terminating,
        /// Failed; the owner replaces it.
        Failed,
        /// The cloud reports it unhealthy or cannot find it.
        Unknown,
    }
}

impl From<Phase> for Reason {
    /// A phase as the reason of a pool Machine's `Ready` condition.
    fn from(p: Phase) -> Self {
        Reason::parse(&p.to_string())
    }
}

/// A network address.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Address {
    /// InternalIP, ExternalIP, Hostname, ...
    #[serde(rename = "type")]
    pub address_type: String,
    /// An IP address or a host name, per `type`.
    pub address: String,
}

/// A permanent failure, remembered so it is not retried until the spec changes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Failure {
    /// gRPC code name.
    pub code: String,
    /// UPPER_SNAKE: the driver's ErrorInfo reason, or the controller's own
    /// (`CREATION_TIMEOUT`, `HEALTH_TIMEOUT`, `NODE_NOT_JOINED`, `RETRIES_EXHAUSTED`).
    pub reason: String,
    /// The driver's message, or the controller's for its own reasons.
    pub message: String,
    /// The Machine generation it applies to.
    pub generation: i64,
    /// The class generation it applies to.
    #[serde(default)]
    pub class_generation: i64,
}

/// Observed state of a Machine.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineStatus {
    /// Where the machine is in its life: Pending, Creating, Provisioned, Running, Updating,
    /// Terminating, Failed or Unknown.
    #[serde(default)]
    pub phase: Phase,
    /// The cloud's ID.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub provider_id: String,
    /// The cloud machine's addresses, as its driver last reported them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<Address>,
    /// `Ready`, `UpToDate`, `Failed`, `NodeReady`, `Deleting`, `DeletionFailed`,
    /// `OperationTokenUnusable`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The operation in flight (at most one).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub operations: Vec<StoredOperation>,
    /// The last driver call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_operation: Option<LastOperation>,
    /// Request IDs of recent driver calls, newest last.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub request_ids: Vec<String>,
    /// Hash of the provider spec the cloud machine runs.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub spec_hash: String,
    /// The Machine generation the cloud machine was last created or updated from. A newer
    /// generation with a different spec is applied in place (class edits alone are not: they
    /// reach new machines, as in MCM).
    #[serde(default, skip_serializing_if = "is_default")]
    pub observed_generation: i64,
    /// When the first create call was made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub create_started: Option<Time>,
    /// Since when the machine is unhealthy or missing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unhealthy_since: Option<Time>,
    /// A permanent failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<Failure>,
    /// The Node this machine's VM became (with a target cluster).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_ref: Option<NodeRef>,
    /// When the VM came up and the wait for its Node began (`nodeStartupTimeoutSeconds`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioned: Option<Time>,
    /// Where the deletion sequence stands (drain, hooks, VM, Node), so a restarted or newly
    /// elected controller resumes it with the same deadlines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deletion: Option<Deletion>,
    /// Where an in-place update that disrupts the machine stands (drain, update, the node back,
    /// uncordon), so a restarted controller resumes it with the same deadlines. Absent when no
    /// such update runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_place: Option<InPlaceProgress>,
    /// What the cloud did or will do to the machine on its own (a spot interruption, a
    /// maintenance, a stop behind the controller's back), as its driver's event stream said:
    /// recorded before the event is acknowledged, and what the owner acts on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interruption: Option<Interruption>,
    /// The bootstrap token minted for this machine in the target cluster (its ID, never its
    /// secret), while its Node has not joined: created before the machine, kept from expiring,
    /// deleted once the Node is linked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_token: Option<BootstrapTokenRef>,
}

/// A bootstrap token the controller minted: the Secret `kube-system/bootstrap-token-<id>` of the
/// target cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BootstrapTokenRef {
    /// The token's public ID (six characters; the Secret is `bootstrap-token-<id>`).
    pub id: String,
    /// When it expires, unless refreshed before.
    pub expires: Time,
}

/// On a Machine created to replace an interrupted one: `<machine>/<kind>/<notBefore or ->`, so
/// that the margin by which it was Ready before the deadline is measured once it is.
pub const ANNOTATION_REPLACES_INTERRUPTION: &str = "machine.driver.dev/replaces-interruption";

wire_enum! {
    /// What the cloud does to a machine on its own: the protocol's `MachineEventKind`.
    #[derive(PartialOrd, Ord)]
    pub enum InterruptionKind {
        /// The cloud suggests moving off soon (an elevated risk of a spot interruption): a
        /// voluntary replacement, within the owner's budgets.
        RebalanceRecommendation,
        /// The hardware under the machine is impaired: it is replaced.
        Impaired,
        /// A maintenance is scheduled at `notBefore`.
        ScheduledMaintenance,
        /// Spot capacity is reclaimed at `notBefore`.
        SpotInterruption,
        /// A capacity reservation ends at `notBefore`.
        CapacityReservationInterruption,
        /// The machine is being stopped.
        Stopping,
        /// The machine is stopped (behind the controller's back, or by the cloud).
        Stopped,
        /// The machine is terminated.
        Terminated,
    }
}

impl InterruptionKind {
    /// Whether the cloud takes the machine whatever the controller does: everything but a
    /// rebalance recommendation (a suggestion, replaced within the budgets).
    pub fn involuntary(self) -> bool {
        self != InterruptionKind::RebalanceRecommendation
    }

    /// Whether the machine is down already: stopped or terminated (its Node is taken out of
    /// service at once, its pods deleted without eviction).
    pub fn gone(self) -> bool {
        matches!(self, InterruptionKind::Stopped | InterruptionKind::Terminated)
    }

    /// Whether the cloud takes the machine back for want of capacity (a spot interruption, a
    /// capacity reservation ending): its offering is short of capacity for a while. (A spot
    /// machine stopped or terminated by the cloud counts too: the planner reads the offering.)
    pub fn reclaims(self) -> bool {
        matches!(self, InterruptionKind::SpotInterruption | InterruptionKind::CapacityReservationInterruption)
    }
}

/// Where the cloud ran a machine: what an interruption reclaims.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Offering {
    /// The zone.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub zone: String,
    /// The machine type.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub machine_type: String,
    /// `on-demand`, `spot` or `reserved`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub capacity_type: String,
}

/// `status.interruption`: the cloud's own move on a machine, recorded from its driver's event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Interruption {
    /// What the cloud does.
    pub kind: InterruptionKind,
    /// The event's ID (the cloud's own where it has one): the same event again changes nothing.
    pub event_id: String,
    /// When the cloud acts, if it said: the drain ends a margin before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_before: Option<Time>,
    /// When the controller received the event.
    pub received_at: Time,
    /// When the driver (or the cloud) observed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_at: Option<Time>,
    /// What the cloud will do: `Terminate`, `Stop`, `Hibernate` (empty: not said).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub action: String,
    /// Where the machine ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offering: Option<Offering>,
    /// What the driver said.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

/// A Node, by name and uid.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeRef {
    /// The Node's name.
    pub name: String,
    /// The Node's uid (a Node re-created under the same name is another node).
    #[serde(default)]
    pub uid: String,
}

/// The steps of a Machine's deletion, in order. Each is recorded with its start time before it
/// acts, so a restart resumes the same step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum DeletionPhase {
    /// Waiting while `pre-drain.delete.hook…` annotations are present.
    PreDrainHooks,
    /// Cordoned and tainted; pods evicted (PodDisruptionBudgets respected) until the deadline.
    Draining,
    /// Waiting for the node's VolumeAttachments to go.
    VolumesDetaching,
    /// Waiting while `pre-terminate.delete.hook…` annotations are present.
    PreTerminateHooks,
    /// The VM is being deleted through the driver; once it is gone, its Node is deleted and the
    /// Machine released (a restart polls the VM's delete again, then does both).
    InstanceDeleting,
}

impl fmt::Display for DeletionPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// Where a Machine's deletion stands.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Deletion {
    /// The current step.
    pub phase: DeletionPhase,
    /// When the current step began.
    pub phase_started: Time,
    /// When the drain began (its deadline is this plus `drainTimeoutSeconds`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_started: Option<Time>,
    /// The drain's deadline: pods still there are deleted so that they are gone by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_deadline: Option<Time>,
    /// Pods still to leave the node at the last look.
    #[serde(default, skip_serializing_if = "is_default")]
    pub pods_left: u32,
    /// What holds the step (a PodDisruptionBudget and the pod it protects, a hook annotation…).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub blocked_by: String,
    /// The node's VM was reported gone or stopped while the node was not Ready: pods were
    /// deleted without eviction (`node.kubernetes.io/out-of-service`).
    #[serde(default, skip_serializing_if = "is_default")]
    pub out_of_service: bool,
    /// Pods were deleted at the drain deadline instead of evicted.
    #[serde(default, skip_serializing_if = "is_default")]
    pub forced: bool,
}

wire_enum! {
    /// What an in-place update does to a running machine, as its driver answered
    /// `CanUpdateMachine` (an unset answer is `Reboot`). The owner writes it into
    /// [`ANNOTATION_IN_PLACE_DISRUPTION`](super::ANNOTATION_IN_PLACE_DISRUPTION) with the new
    /// spec; a Machine without it is treated as `Reboot`.
    pub enum InPlaceDisruption {
        /// Nothing restarts (tags, labels): the update runs with no pod touched.
        None,
        /// The workloads must move off first: cordon and drain, update, uncordon.
        Drain,
        /// The machine restarts: cordon and drain, update, wait for the Node to be Ready with a
        /// new boot ID (or to have gone NotReady and come back), uncordon.
        Reboot,
    }
}

wire_enum! {
    /// The steps of an in-place update that drains, in order. Each is recorded with its start
    /// time before it acts, so a restart resumes the same step.
    pub enum InPlacePhase {
        /// Cordoned and tainted; pods evicted (PodDisruptionBudgets respected) until the drain
        /// deadline.
        Draining,
        /// The driver applies the new spec (`UpdateMachine`, its operation polled).
        Updating,
        /// Updated: waiting, at most `nodeStartupTimeoutSeconds`, for the Node to be Ready again
        /// (after a reboot: with a new boot ID, or after having gone NotReady).
        WaitingForNode,
    }
}

/// Where a Machine's draining in-place update stands.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InPlaceProgress {
    /// What the driver said the update does.
    pub disruption: InPlaceDisruption,
    /// The current step.
    pub phase: InPlacePhase,
    /// When the current step began (the Node's wait is counted from `WaitingForNode`'s).
    pub phase_started: Time,
    /// When the drain began (its deadline is this plus `drainTimeoutSeconds`).
    pub drain_started: Time,
    /// The drain's deadline: pods still there are deleted so that they are gone by it.
    pub drain_deadline: Time,
    /// Pods still to leave the node at the last look.
    #[serde(default, skip_serializing_if = "is_default")]
    pub pods_left: u32,
    /// What holds the drain (a PodDisruptionBudget and the pod it protects).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub blocked_by: String,
    /// Pods were deleted at the drain deadline instead of evicted.
    #[serde(default, skip_serializing_if = "is_default")]
    pub forced: bool,
    /// The Node's boot ID when the update began: after a reboot it differs.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub boot_id: String,
    /// The Node went NotReady since the update was asked (a reboot seen without a boot ID).
    #[serde(default, skip_serializing_if = "is_default")]
    pub node_went_not_ready: bool,
    /// The Node was already unschedulable (cordoned by someone else) when the drain began: it is
    /// left so afterwards.
    #[serde(default, skip_serializing_if = "is_default")]
    pub was_unschedulable: bool,
}

/// A Machine: one cloud machine, created, polled, health-checked and deleted through its
/// class's driver.
pub type Machine = Object<MachineSpec, MachineStatus>;

impl KindOf for Machine {
    const KIND: Kind = Kind::Machine;
}

impl KindInfo for Machine {
    const PLURAL: &'static str = "machines";
    const SHORT_NAMES: &'static [&'static str] = &["ma"];
    const ALIASES: &'static [&'static str] = &["m"];
    type Spec = MachineSpec;
    type Status = MachineStatus;
    const COLUMNS: &'static [Column] = &[
        Column::new("Phase", ColumnType::String, ".status.phase"),
        Column::new("Node", ColumnType::String, ".status.nodeRef.name"),
        Column::new("Provider-ID", ColumnType::String, ".status.providerId"),
        Column::new("Class", ColumnType::String, ".spec.classRef.name").shown(Shown::TableWide),
        Column::new("Domain", ColumnType::String, ".spec.failureDomain").shown(Shown::Wide),
        Column::computed("Revision", |v| {
            let revision = v.pointer("/metadata/labels").and_then(|l| l.get(LABEL_REVISION)?.as_str());
            revision.unwrap_or("-").to_string()
        })
        .shown(Shown::TableWide),
        Column::new("Address", ColumnType::String, ".status.addresses[0].address").shown(Shown::Wide),
        Column::age(),
        Column::computed("Last-Op", |v| match v.pointer("/status/lastOperation") {
            Some(l) if l.is_object() => {
                let field = |k: &str| l.get(k).and_then(Value::as_str).unwrap_or("").to_string();
                format!("{}/{}/{}", field("type"), field("state"), field("code"))
            }
            _ => "-".into(),
        })
        .shown(Shown::TableWide),
        Column::new("Request-ID", ColumnType::String, ".status.lastOperation.requestId").shown(Shown::Wide),
    ];
    const WOKEN_BY: &'static [(Kind, Via)] = &[(Kind::MachineClass, Via::ClassRef)];

    fn validate(&self) -> Check {
        checks::name("spec.classRef.name", &self.spec.class_ref.name)?;
        checks::object_or_absent("spec.providerSpec", self.spec.provider_spec.as_ref())?;
        if let Some(p) = &self.spec.pool_ref {
            checks::name("spec.poolRef.name", &p.name)?;
        }
        Ok(())
    }

    fn describe_head(status: &Value) -> String {
        let mut out = String::new();
        match status["nodeRef"]["name"].as_str() {
            Some(node) => out += &format!("Node:         {node}\n"),
            None => {
                out += "Node:         <none> (nodes are managed when the controller runs with a target cluster: \
                        run --target-kubeconfig, or --store kubernetes)\n"
            }
        }
        if let Some(i) = status.get("interruption").filter(|i| !i.is_null()) {
            let field = |k: &str| i[k].as_str().unwrap_or("-").to_string();
            out += &format!(
                "Interruption: {} (event {}), received {}\n",
                field("kind"),
                field("eventId"),
                field("receivedAt")
            );
            if let Some(t) = i["notBefore"].as_str() {
                out += &format!("  not before: {t} (the drain ends a margin before)\n");
            }
            if let Some(a) = i["action"].as_str() {
                out += &format!("  action:     {a}\n");
            }
            if let Some(o) = i.get("offering").filter(|o| o.is_object()) {
                let of = |k: &str| o[k].as_str().unwrap_or("-").to_string();
                out += &format!("  offering:   {} {} {}\n", of("zone"), of("machineType"), of("capacityType"));
            }
            if let Some(m) = i["message"].as_str() {
                out += &format!("  message:    {m}\n");
            }
        }
        if let Some(d) = status.get("deletion").filter(|d| !d.is_null()) {
            out += &format!(
                "Deletion:     {} since {}\n",
                d["phase"].as_str().unwrap_or(""),
                d["phaseStarted"].as_str().unwrap_or("")
            );
            if let Some(deadline) = d["drainDeadline"].as_str() {
                out += &format!(
                    "  drain:      started {}, deadline {deadline}\n",
                    d["drainStarted"].as_str().unwrap_or("-")
                );
            }
            if let Some(n) = d["podsLeft"].as_u64() {
                out += &format!("  pods left:  {n}\n");
            }
            if let Some(b) = d["blockedBy"].as_str() {
                out += &format!("  blocked by: {b}\n");
            }
            if d["forced"].as_bool() == Some(true) {
                out += "  forced:     pods were deleted at the drain deadline\n";
            }
            if d["outOfService"].as_bool() == Some(true) {
                out += "  out of service: the VM was gone; pods deleted without eviction\n";
            }
        }
        if let Some(u) = status.get("inPlace").filter(|u| !u.is_null()) {
            let field = |k: &str| u[k].as_str().unwrap_or("-").to_string();
            out += &format!(
                "In-place update: {} since {} (the driver says: {})\n",
                field("phase"),
                field("phaseStarted"),
                field("disruption")
            );
            out += &format!("  drain:      started {}, deadline {}\n", field("drainStarted"), field("drainDeadline"));
            out += &format!("  pods left:  {}\n", u["podsLeft"].as_u64().unwrap_or(0));
            if let Some(b) = u["blockedBy"].as_str() {
                out += &format!("  blocked by: {b}\n");
            }
            if u["forced"].as_bool() == Some(true) {
                out += "  forced:     pods were deleted at the drain deadline\n";
            }
            if let Some(boot) = u["bootId"].as_str() {
                out += &format!("  boot ID before the update: {boot}\n");
            }
        }
        out
    }
}

impl Machine {
    /// Its node settings: the spec's, else the defaults.
    pub fn node_settings(&self) -> NodeSettings {
        self.spec.node.unwrap_or_default()
    }

    /// The deployment or pool that owns this machine, if any.
    pub fn owner(&self) -> Option<(Kind, &str)> {
        self.metadata.owner_references.iter().find(|o| o.controller).and_then(|o| {
            let kind = Kind::from_name(&o.kind)?;
            Some((kind, o.name.as_str()))
        })
    }

    /// Whether a delete was asked for.
    pub fn is_deleting(&self) -> bool {
        self.metadata.deletion_timestamp.is_some()
    }

    /// The disruption its owner (or the cluster-autoscaler) took it for: its
    /// [`ANNOTATION_DISRUPTION`]. A value this version does not know reads as none.
    pub fn disruption(&self) -> Option<DisruptionReason> {
        self.metadata.annotations.get(ANNOTATION_DISRUPTION)?.parse().ok()
    }

    /// Marks it as taken for `reason` ([`ANNOTATION_DISRUPTION`]). Returns whether that changed
    /// anything (it may carry the mark already).
    pub fn mark_disruption(&mut self, reason: DisruptionReason) -> bool {
        if self.disruption() == Some(reason) {
            return false;
        }
        self.metadata.annotations.insert(ANNOTATION_DISRUPTION.into(), reason.as_str().into());
        true
    }

    /// Takes the mark off again. Returns whether it carried one.
    pub fn clear_disruption(&mut self) -> bool {
        self.metadata.annotations.remove(ANNOTATION_DISRUPTION).is_some()
    }
}
