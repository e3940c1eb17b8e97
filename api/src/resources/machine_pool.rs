//! `MachinePool`: a cloud-side group of instances (a driver's `Pools` capability), each mirrored
//! as a Machine.

use serde::{Deserialize, Serialize};

use serde_json::Value;

use super::checks::{self, Check};
use super::disruption::{self, DisruptionSpec, DisruptionStatus, RemediationSpec};
use super::kind::{Column, ColumnType, KindInfo, Shown, Via};
use super::machine_deployment::CanaryStatus;
use super::meta::{is_default, KindOf, Object};
use super::status::{Condition, LastOperation, StoredOperation};
use super::template::{
    default_drain_timeout, default_node_startup_timeout, default_volume_detach_timeout, MachineTemplate, NodeSettings,
    RollingUpdate, TargetCluster,
};
use crate::registry::Kind;

/// Desired state of a MachinePool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MachinePoolSpec {
    /// Number of instances.
    #[schemars(range(min = 0))]
    pub replicas: i64,
    /// The cluster-autoscaler sizes it within these bounds (it is then a node group of the
    /// controller's externalgrpc server, and `apply` leaves `replicas` to the autoscaler).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<super::autoscaling::Autoscaling>,
    /// The cluster its Nodes live in, when not the controller's default target: a kubeconfig
    /// Secret in this namespace (see the book's "Many target clusters"). Fixed once set: the
    /// machines already made stay in the cluster they joined.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_cluster: Option<TargetCluster>,
    /// The instance template.
    pub template: MachineTemplate,
    /// Rolling instance upgrades (maxSurge / maxUnavailable, and a canary).
    #[serde(default)]
    pub strategy: RollingUpdate,
    /// A machine whose VM runs but whose Node is not Ready this long after the VM came up fails
    /// with reason `NodeNotJoined` and is replaced (default 600; 0 waits forever; with a target
    /// cluster).
    #[serde(default = "default_node_startup_timeout")]
    pub node_startup_timeout_seconds: u64,
    /// The drain before a machine's deletion ends by this deadline: pods still there at the
    /// deadline minus their grace period are deleted with that grace (default 3600).
    #[serde(default = "default_drain_timeout")]
    pub drain_timeout_seconds: u64,
    /// After the drain, a deletion waits at most this long for the node's VolumeAttachments to
    /// go (default 600).
    #[serde(default = "default_volume_detach_timeout")]
    pub volume_detach_timeout_seconds: u64,
    /// How failed and unhealthy instances are replaced.
    #[serde(default, skip_serializing_if = "is_default")]
    pub remediation: RemediationSpec,
    /// Disruption budgets: how many instances voluntary disruptions may take at once, and when.
    #[serde(default, skip_serializing_if = "is_default")]
    pub disruption: DisruptionSpec,
}

/// Observed state of a MachinePool.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachinePoolStatus {
    /// Instances in the pool.
    #[serde(default)]
    pub replicas: i64,
    /// Instances provisioned and running.
    #[serde(default)]
    pub ready_replicas: i64,
    /// Instances on the latest model.
    #[serde(default)]
    pub updated_replicas: i64,
    /// The pool's provider ID.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub provider_id: String,
    /// Hash of the template last applied.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub applied_revision: String,
    /// Capacity last applied.
    #[serde(default)]
    pub applied_capacity: i64,
    /// The operation in flight.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub operations: Vec<StoredOperation>,
    /// The last driver call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_operation: Option<LastOperation>,
    /// What is down, what the disruption budgets allow and what they hold back.
    #[serde(default, skip_serializing_if = "is_default")]
    pub disruption: DisruptionStatus,
    /// The canary of the model upgrading (or of the last one that had one): `revision` is the
    /// template's hash (`appliedRevision` once applied).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<CanaryStatus>,
    /// `Ready` (every instance ready on the latest model; `CanaryFailed` when the canary stops
    /// the upgrade), `OperationTokenUnusable`,
    /// `DisruptionBlocked`, `Valid`, and the environment's (`QuotaExceeded`,
    /// `CloudCredentialsRefused`, `CloudUnavailable`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The bootstrap token the pool's instances join with (its ID, never its secret): one per
    /// pool, since they share their boot data; kept from expiring while the pool exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_token: Option<super::machine::BootstrapTokenRef>,
}

/// A MachinePool: a cloud-side group of instances (a driver's `Pools` capability), each
/// mirrored as a Machine.
pub type MachinePool = Object<MachinePoolSpec, MachinePoolStatus>;

impl KindOf for MachinePool {
    const KIND: Kind = Kind::MachinePool;
}

impl KindInfo for MachinePool {
    const PLURAL: &'static str = "machinepools";
    const SHORT_NAMES: &'static [&'static str] = &["mp"];
    const ALIASES: &'static [&'static str] = &["mp", "pool", "pools"];
    type Spec = MachinePoolSpec;
    type Status = MachinePoolStatus;
    const COLUMNS: &'static [Column] = &[
        Column::new("Desired", ColumnType::Integer, ".spec.replicas"),
        Column::new("Current", ColumnType::Integer, ".status.replicas").shown(Shown::Table),
        Column::new("Ready", ColumnType::Integer, ".status.readyReplicas"),
        Column::new("Updated", ColumnType::Integer, ".status.updatedReplicas"),
        Column::new("Provider-ID", ColumnType::String, ".status.providerId").shown(Shown::CrdOnly),
        Column::age(),
    ];
    const SCALE: bool = true;
    const WOKEN_BY: &'static [(Kind, Via)] = &[(Kind::Machine, Via::Owner), (Kind::MachineClass, Via::ClassRef)];

    fn rules() -> Vec<checks::Rule> {
        checks::replicated_rules(Kind::MachinePool)
    }

    fn describe_head(status: &Value) -> String {
        super::machine_deployment::describe_canary(status)
    }

    fn describe_tail(status: &Value) -> String {
        disruption::describe(status)
    }

    fn validate(&self) -> Check {
        checks::template(&self.spec.template)?;
        super::autoscaling::check(self.spec.autoscaling.as_ref())?;
        checks::disruption(&self.spec.disruption)
    }
}

impl MachinePoolSpec {
    /// The node settings its instances' machines get.
    pub fn node_settings(&self) -> NodeSettings {
        NodeSettings {
            node_startup_timeout_seconds: self.node_startup_timeout_seconds,
            drain_timeout_seconds: self.drain_timeout_seconds,
            volume_detach_timeout_seconds: self.volume_detach_timeout_seconds,
        }
    }
}
