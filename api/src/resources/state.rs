//! Typed status vocabulary: condition types, statuses and reasons, operation kinds, the last
//! operation's type and state. Each is a Rust enum that serializes to exactly the string the
//! controller wrote before these types existed, so stored objects, YAML and the CRD schema read
//! the same; each compares equal to its wire string (`c.status == "True"`), as `http::Method`
//! does, for tests and tools that think in strings.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Declares a closed enum of unit variants whose wire strings are the variant names, with
/// `as_str`, `Display`, `FromStr` and comparisons with `str`. Serde refuses any other string,
/// naming the field and the values it expects; the CRD schema lists them as an `enum`.
macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(
            Debug, Clone, Copy, PartialEq, Eq, Hash,
            ::serde::Serialize, ::serde::Deserialize, ::schemars::JsonSchema,
        )]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )+
        }

        impl $name {
            /// Every variant.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The wire string (the same in status, YAML and the CRD schema).
            pub fn as_str(self) -> &'static str {
                match self {
                    $( $name::$variant => stringify!($variant), )+
                }
            }
        }

        impl ::std::str::FromStr for $name {
            type Err = $crate::resources::UnknownValue;

            fn from_str(s: &str) -> Result<Self, $crate::resources::UnknownValue> {
                match s {
                    $( stringify!($variant) => Ok($name::$variant), )+
                    _ => Err($crate::resources::UnknownValue { what: stringify!($name), value: s.into() }),
                }
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.as_str() == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.as_str() == *other
            }
        }
    };
}

pub(crate) use wire_enum;

/// A string that is not one of an enum's wire values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{value:?} is not a {what}")]
pub struct UnknownValue {
    /// The enum.
    pub what: &'static str,
    /// The string.
    pub value: String,
}

wire_enum! {
    /// A condition's status (Kubernetes `metav1.ConditionStatus`).
    pub enum ConditionStatus {
        /// The condition holds.
        True,
        /// It does not.
        False,
        /// The controller cannot tell.
        Unknown,
    }
}

impl From<bool> for ConditionStatus {
    fn from(holds: bool) -> Self {
        if holds {
            ConditionStatus::True
        } else {
            ConditionStatus::False
        }
    }
}

wire_enum! {
    /// The conditions the controller sets.
    pub enum ConditionType {
        /// Machine: running and healthy; pool: every instance ready on the latest model.
        Ready,
        /// Machine: failed for good (its owner replaces it); the reason is the driver's.
        Failed,
        /// Machine: the cloud machine runs the Machine's spec.
        UpToDate,
        /// MachineClass: the driver accepted the class.
        Valid,
        /// MachineDeployment: a rollout or scaling moves on.
        Progressing,
        /// MachineDeployment: at least `replicas − maxUnavailable` machines run.
        Available,
        /// MachineDeployment (InPlace): every old machine can be updated in place.
        InPlaceUpdatePossible,
        /// Machine, MachinePool: a stored operation handle was unusable and dropped.
        OperationTokenUnusable,
        /// Machine: the cloud refused the delete (it is retried).
        DeletionFailed,
        /// Environment: the cloud refuses the class's credentials.
        CloudCredentialsRefused,
        /// Environment: a quota or capacity limit was hit.
        QuotaExceeded,
        /// Environment: the cloud (or the driver) is unavailable.
        CloudUnavailable,
        /// Environment: the class's boot data cannot be rendered for its machines (no target
        /// cluster, no CA).
        BootDataUnrenderable,
        /// Machine: its Node is Ready (only with a target cluster).
        NodeReady,
        /// Machine: the deletion sequence and the step it is in (hooks, drain, volumes, VM, Node).
        Deleting,
        /// MachineHealthCheck: whether it may remediate (not more unhealthy machines than
        /// `maxUnhealthy`).
        RemediationAllowed,
        /// Machine: whether a MachineHealthCheck finds it healthy (False: the reason says why).
        HealthCheckSucceeded,
        /// Machine: False while a MachineHealthCheck asks its owner to remediate it.
        OwnerRemediated,
        /// MachineDeployment, MachinePool: a disruption budget (or a health check's short
        /// circuit) holds disruptions back.
        DisruptionBlocked,
        /// MachineDeployment: every machine of a failure domain is unhealthy while other domains
        /// are healthy (a zone outage): nothing new goes there, and its machines do not count
        /// toward a health check's `maxUnhealthy`.
        FailureDomainDegraded,
        /// MachineDeployment, MachinePool, Machine with `spec.targetCluster`: its target
        /// cluster's kubeconfig Secret is usable and its API server answers.
        TargetReachable,
    }
}

wire_enum! {
    /// What a stored operation does (the protocol's `OperationKind`, as its RPC names).
    pub enum OperationKind {
        /// On a Machine: the cloud creates it.
        CreateMachine,
        /// On a Machine being deleted: the cloud deletes it.
        DeleteMachine,
        /// On a Machine: the cloud applies a new spec in place.
        UpdateMachine,
        /// On a MachinePool: the cloud applies its template and capacity.
        ApplyPool,
        /// On a MachinePool: the cloud deletes some of its instances.
        DeletePoolInstances,
        /// On a MachinePool: some of its instances move to the latest model.
        UpgradePoolInstances,
        /// On a MachinePool being deleted: the cloud deletes the pool.
        DeletePool,
    }
}

impl OperationKind {
    /// The method name (for errors and metrics).
    pub fn method(self) -> &'static str {
        self.as_str()
    }
}

wire_enum! {
    /// Which driver call a [`LastOperation`](super::LastOperation) records.
    pub enum OperationType {
        /// CreateMachine (and its operation).
        Create,
        /// UpdateMachine (and its operation).
        Update,
        /// DeleteMachine, or DeletePoolInstances of a pool Machine (and its operation).
        Delete,
        /// A poll (GetOperation) that failed.
        Poll,
        /// A ListPoolInstances that failed (a pool's reconcile starts with one).
        ListPoolInstances,
        /// ApplyPool (and its operation). Objects written before these types say `Apply`
        /// for a refused call; it reads as this.
        #[serde(alias = "Apply")]
        ApplyPool,
        /// DeletePool (and its operation).
        DeletePool,
        /// DeletePoolInstances of a pool's planner (and its operation).
        DeletePoolInstances,
        /// UpgradePoolInstances (and its operation).
        UpgradePoolInstances,
    }
}

impl From<OperationKind> for OperationType {
    fn from(kind: OperationKind) -> Self {
        match kind {
            OperationKind::CreateMachine => OperationType::Create,
            OperationKind::UpdateMachine => OperationType::Update,
            OperationKind::DeleteMachine => OperationType::Delete,
            OperationKind::ApplyPool => OperationType::ApplyPool,
            OperationKind::DeletePool => OperationType::DeletePool,
            OperationKind::DeletePoolInstances => OperationType::DeletePoolInstances,
            OperationKind::UpgradePoolInstances => OperationType::UpgradePoolInstances,
        }
    }
}

wire_enum! {
    /// How the last driver call went.
    pub enum OperationState {
        /// Accepted; its operation is in flight.
        Processing,
        /// Done without an error.
        Succeeded,
        /// Refused, or its operation ended with an error.
        Failed,
    }
}

/// Declares the condition reasons the controller makes, plus `Other` for reasons it passes on.
macro_rules! reasons {
    ( $( $(#[$vmeta:meta])* $variant:ident, )+ ) => {
        /// A condition's reason (UpperCamel). The controller's own reasons are variants; a
        /// reason it passes on from a driver (`QUOTA_EXCEEDED` → `QuotaExceeded`) that is not
        /// one of them is [`Reason::Other`]. Serializes as the bare string.
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub enum Reason {
            $( $(#[$vmeta])* $variant, )+
            /// A reason the controller does not make itself (a driver's, in UpperCamel).
            Other(String),
        }

        impl Reason {
            /// The wire string.
            pub fn as_str(&self) -> &str {
                match self {
                    $( Reason::$variant => stringify!($variant), )+
                    Reason::Other(s) => s,
                }
            }

            /// Reads a reason: one of the variants when the string is, else `Other`.
            pub fn parse(s: &str) -> Self {
                match s {
                    $( stringify!($variant) => Reason::$variant, )+
                    _ => Reason::Other(s.to_string()),
                }
            }
        }
    };
}

reasons! {
    /// The MachineClass does not exist.
    ClassNotFound,
    /// The class names a driver the controller does not run with.
    DriverNotConfigured,
    /// The class's Secret does not exist.
    SecretNotFound,
    /// Accepted; nothing asked of the cloud yet.
    Pending,
    /// The cloud is creating it.
    Creating,
    /// The machine runs (with a target cluster: its Node is Ready).
    Running,
    /// The cloud is updating it.
    Updating,
    /// The cloud is deleting it.
    Deleting,
    /// Being deleted.
    Terminating,
    /// Failed (the `Failed` condition has the driver's reason).
    Failed,
    /// The cloud reports it unhealthy or cannot find it.
    Unknown,
    /// A stored operation handle was dropped.
    Dropped,
    /// An operation ended with an error.
    OperationFailed,
    /// A driver call failed.
    CallFailed,
    /// A pool is ready.
    Ready,
    /// A pool is moving instances to its latest model.
    Rolling,
    /// Every machine can be updated in place.
    Updatable,
    /// Some machine needs replacement.
    NeedsReplacement,
    /// A rollout used up its failure budget.
    RolloutAborted,
    /// A pool's canary instance failed: its upgrade stops until the template changes.
    CanaryFailed,
    /// The spec's revision is bad and nothing good is left to roll back to.
    NoGoodRevision,
    /// A rollout made no progress within its deadline.
    ProgressDeadlineExceeded,
    /// Scaling, no rollout.
    Scaling,
    /// A new revision is fully rolled out.
    NewRevisionAvailable,
    /// Rolled back to the last good revision.
    RolledBack,
    /// Enough machines are available.
    MinimumAvailable,
    /// Fewer machines are available than required.
    BelowMinimum,
    /// The driver accepted the class.
    Validated,
    /// The driver does not validate classes.
    NotValidated,
    /// The driver refused the class.
    Invalid,
    /// The cloud machine runs the spec.
    SpecApplied,
    /// An in-place update failed.
    UpdateFailed,
    /// A pool instance runs the latest model.
    LatestModel,
    /// A pool instance runs an older model.
    OldModel,
    /// The cloud reports the machine in a state that is not running.
    MachineUnhealthy,
    /// The cloud no longer has the machine.
    MachineMissing,
    /// A create is retried (a transient failure).
    CreateRetrying,
    /// An update is retried.
    UpdateRetrying,
    /// The cloud refuses the credentials.
    CloudCredentialsRefused,
    /// A quota or capacity limit.
    QuotaExceeded,
    /// The cloud is unavailable.
    CloudUnavailable,
    /// The VM runs; its Node has not joined yet.
    WaitingForNode,
    /// The Node exists but is not Ready.
    NodeNotReady,
    /// The Node is Ready.
    NodeReady,
    /// The Node of a running VM disappeared.
    NodeMissing,
    /// No Ready Node within `nodeStartupTimeoutSeconds`, or the bootstrap token it was to
    /// join with is gone.
    NodeNotJoined,
    /// The class's boot data template cannot be rendered for the machine (a variable without a
    /// value: no target cluster, no CA): nothing is created until it can.
    BootDataUnrenderable,
    /// A `pre-drain.delete.hook…` annotation holds the deletion.
    WaitingForPreDrainHooks,
    /// Evicting the node's pods.
    Draining,
    /// A PodDisruptionBudget refuses an eviction now.
    EvictionBlocked,
    /// A PodDisruptionBudget that can never allow an eviction.
    DisruptionBudgetUnsatisfiable,
    /// Pods were deleted at the drain deadline.
    DrainForced,
    /// The VM is gone and the node not Ready: pods deleted without eviction.
    OutOfService,
    /// Waiting for the node's VolumeAttachments to go.
    WaitingForVolumeDetach,
    /// A `pre-terminate.delete.hook…` annotation holds the deletion.
    WaitingForPreTerminateHooks,
    /// The VM is being deleted.
    DeletingInstance,
    /// An in-place update waits for its Node to be Ready again (after a reboot: with a new boot
    /// ID).
    WaitingForNodeAfterUpdate,
    /// The Node did not come back Ready within `nodeStartupTimeoutSeconds` of an in-place
    /// update.
    NodeNotBackAfterUpdate,
    /// MachineHealthCheck: no more machines are unhealthy than `maxUnhealthy`.
    WithinMaxUnhealthy,
    /// MachineHealthCheck: more machines are unhealthy than `maxUnhealthy`; none is remediated.
    TooManyUnhealthy,
    /// MachineHealthCheck: the target cluster cannot be reached; nothing is judged meanwhile.
    TargetUnreachable,
    /// MachineHealthCheck: `mode: Observe`; unhealthy machines are marked, never remediated.
    Observing,
    /// Machine: a MachineHealthCheck finds it healthy.
    HealthCheckPassed,
    /// Machine: its phase is Failed.
    MachineFailed,
    /// Machine: the `machine.driver.dev/remediate` annotation asks for its remediation.
    RemediationRequested,
    /// Machine: a MachineHealthCheck asks its owner to remediate it.
    WaitingForRemediation,
    /// Owner: a disruption budget has no room for what waits.
    BudgetExhausted,
    /// Owner: a disruption budget cannot be read; it holds what it would limit.
    BudgetInvalid,
    /// Owner: no disruption is held by a budget or a short circuit.
    NothingHeld,
    /// Owner: every machine of a failure domain is unhealthy while others are healthy.
    DomainOutage,
    /// Owner: no failure domain is down as a whole.
    DomainsHealthy,
    /// Owner with a target cluster: its API server answers.
    TargetReachable,
    /// Owner: the Secret `spec.targetCluster.kubeconfigSecretRef` names does not exist.
    TargetSecretNotFound,
    /// Owner: the target cluster's Secret has no key `value`, or its kubeconfig is unusable.
    TargetKubeconfigInvalid,
    /// Owner: the target cluster's kubeconfig runs a command (an exec or auth-provider
    /// plugin): refused, nothing is run.
    ExecPluginRefused,
}

impl Reason {
    /// A driver's UPPER_SNAKE reason as a condition reason (`QUOTA_EXCEEDED` → `QuotaExceeded`).
    pub fn from_driver(reason: &str) -> Self {
        Reason::parse(&upper_camel(reason))
    }

    /// `{op}Retrying`: a call of this type is retried after a transient failure.
    pub fn retrying(op: OperationType) -> Self {
        match op {
            OperationType::Update => Reason::UpdateRetrying,
            OperationType::Create => Reason::CreateRetrying,
            other => Reason::Other(format!("{other}Retrying")),
        }
    }
}

impl From<ConditionType> for Reason {
    /// An environment condition's type as the reason of a machine's `Ready` condition.
    fn from(t: ConditionType) -> Self {
        Reason::parse(t.as_str())
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<str> for Reason {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for Reason {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl Serialize for Reason {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Reason {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Ok(Reason::parse(&s))
    }
}

impl schemars::JsonSchema for Reason {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Reason".into()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        // Open-ended: drivers add their own reasons.
        String::json_schema(generator)
    }
}

/// `QUOTA_EXCEEDED` → `QuotaExceeded` (condition reasons are UpperCamel).
pub fn upper_camel(reason: &str) -> String {
    reason
        .split('_')
        .filter(|s| !s.is_empty())
        .map(|w| {
            let mut c = w.chars();
            c.next().map(|f| f.to_ascii_uppercase().to_string() + &c.as_str().to_ascii_lowercase()).unwrap_or_default()
        })
        .collect()
}

#[cfg(test)]
mod tests;
