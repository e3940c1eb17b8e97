//! The reasons of the events the controller records ([`crate::store::Store::event`]), each with
//! its type. Operators read them in `docs/src/operating/running-the-controller.md` (section
//! "Events"); a test keeps that table and this enum the same.

/// An event's type, spelled as Kubernetes spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventType {
    /// Something went as it should.
    Normal,
    /// Something an operator may have to look at.
    Warning,
}

impl EventType {
    /// The wire string (`Normal`, `Warning`).
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        }
    }
}

/// Declares the event reasons: the variant's name is the wire string, so it cannot differ.
macro_rules! event_reasons {
    ( $( $(#[$vmeta:meta])* $variant:ident: $ty:ident, )+ ) => {
        /// Why the controller recorded an event. Distinct from a condition's
        /// [`Reason`](crate::resources::Reason): some strings are alike, the sets are not.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum EventReason {
            $( $(#[$vmeta])* $variant, )+
        }

        impl EventReason {
            /// Every reason, in declaration order.
            pub const ALL: &'static [EventReason] = &[ $( EventReason::$variant, )+ ];

            /// The stable UpperCamel string `describe` shows and Kubernetes stores.
            pub fn as_str(self) -> &'static str {
                match self {
                    $( EventReason::$variant => stringify!($variant), )+
                }
            }

            /// Whether it is a `Normal` or a `Warning` event.
            pub fn event_type(self) -> EventType {
                match self {
                    $( EventReason::$variant => EventType::$ty, )+
                }
            }
        }
    };
}

event_reasons! {
    /// MachineClass: the driver accepted the class.
    Validated: Normal,
    /// MachineClass: the driver refused the class. MachineHealthCheck: its spec cannot be
    /// assessed.
    Invalid: Warning,
    /// MachineClass: a cloud machine tagged as this controller's without a Machine was deleted
    /// after `--orphan-grace`.
    OrphanDeleted: Warning,
    /// MachineDeployment: a new revision started rolling out.
    RolloutStarted: Normal,
    /// MachineDeployment: a revision is fully rolled out.
    RolloutComplete: Normal,
    /// MachineDeployment: new machines used up `failureBudget`; the revision is bad.
    RolloutAborted: Warning,
    /// MachineDeployment, MachinePool: the canary of a revision (a pool's model) held through
    /// its pause; the rollout goes on.
    CanaryPassed: Normal,
    /// MachineDeployment: a failure domain refused a create for capacity or availability, or its
    /// machines are all unhealthy: it gets no new machines for a backoff.
    FailureDomainUnavailable: Warning,
    /// MachineDeployment: a failure domain's backoff is over: it takes machines again.
    FailureDomainAvailable: Normal,
    /// MachineDeployment: a machine moves to a domain below its share: its replacement is
    /// created there first.
    Rebalancing: Normal,
    /// MachineDeployment: the machine a rebalance relieves goes (its replacement runs).
    Rebalanced: Normal,
    /// MachinePool: a canary instance of a new model failed; the upgrade stops until the
    /// template changes again.
    CanaryFailed: Warning,
    /// MachinePool: a stored ApplyPool or DeletePool handle was unusable and is dropped.
    /// Machine: a stored operation handle was unusable; the driver is asked again by name.
    OperationTokenUnusable: Warning,
    /// MachinePool: an ApplyPool, DeletePool, DeletePoolInstances or UpgradePoolInstances
    /// operation ended with an error.
    OperationFailed: Warning,
    /// MachinePool: scale-down deletes these Machines (each Node is drained first).
    DeletingMachines: Normal,
    /// MachineHealthCheck: more machines are unhealthy than `maxUnhealthy` allows; none is
    /// remediated.
    RemediationRestricted: Warning,
    /// MachineHealthCheck: it found a Machine unhealthy (and, unless it only observes or the
    /// Machine has no owner, asked the owner to remediate it).
    MachineUnhealthy: Warning,
    /// Machine: a MachineHealthCheck found it unhealthy.
    Unhealthy: Warning,
    /// MachineDeployment, MachinePool: a disruption budget (or a health check's short circuit)
    /// began to hold disruptions back.
    DisruptionBlocked: Normal,
    /// The Machine's owner (the Machine when it has none): a cloud machine runs after its create.
    Created: Normal,
    /// The Machine's owner (the Machine when it has none): a cloud machine runs the new spec
    /// after an in-place update.
    Updated: Normal,
    /// Machine: the driver refused a create, or its operation ended with an error.
    CreateFailed: Warning,
    /// Machine: the driver refused an in-place update, or its operation ended with an error.
    UpdateFailed: Warning,
    /// Machine: the cloud refuses the credentials; the create or update is retried with backoff.
    CloudCredentialsRefused: Warning,
    /// Machine: not Running `creationTimeoutSeconds` after its create started; it fails.
    CreationTimeout: Warning,
    /// Machine: unhealthy or missing in the cloud for `healthTimeoutSeconds`; it fails.
    HealthTimeout: Warning,
    /// Machine: its owner takes it for remediation (failed, unhealthy or requested); a
    /// replacement comes first where the surge allows.
    Remediating: Warning,
    /// Machine: its deployment replaces it because the new template cannot be applied in place.
    ReplacingForUpdate: Normal,
    /// Machine: its cloud machine is deleted; the finalizer is removed.
    Deleted: Normal,
    /// Machine (of a pool): its instance is being deleted from the pool.
    DeletingInstance: Normal,
    /// Machine: the template's labels, annotations and taints are on its Node.
    NodeMetadataApplied: Normal,
    /// Machine: its Node is Ready; the machine is Running.
    NodeReady: Normal,
    /// Machine: no Ready Node within `nodeStartupTimeoutSeconds`; it fails (`NODE_NOT_JOINED`).
    NodeNotJoined: Warning,
    /// Machine or MachinePool: its class's boot data cannot be rendered; nothing is created
    /// until it can.
    BootDataUnrenderable: Warning,
    /// Machine: the Node of its running VM disappeared.
    NodeMissing: Warning,
    /// Machine: `pre-drain.delete.hook…` annotations hold its deletion.
    WaitingForPreDrainHooks: Normal,
    /// Machine: `pre-terminate.delete.hook…` annotations hold its deletion.
    WaitingForPreTerminateHooks: Normal,
    /// Machine: a PodDisruptionBudget (or the API server) refuses an eviction of its drain.
    EvictionBlocked: Warning,
    /// Machine: a PodDisruptionBudget that can never allow an eviction blocks its drain.
    DisruptionBudgetUnsatisfiable: Warning,
    /// Machine: the drain deadline passed; the pods left were deleted without eviction.
    DrainForced: Warning,
    /// Machine: its Node is drained.
    Drained: Normal,
    /// Machine: its Node is cordoned and drained before an in-place update its driver says
    /// disrupts it (`Drain`, `Reboot`).
    DrainingForUpdate: Normal,
    /// Machine: its Node is Ready again after an in-place update and is uncordoned.
    Uncordoned: Normal,
    /// Machine: its Node was not Ready again within `nodeStartupTimeoutSeconds` of an in-place
    /// update; it fails (`NODE_NOT_BACK_AFTER_UPDATE`).
    NodeNotBackAfterUpdate: Warning,
    /// Machine: the VM is gone and the Node not Ready; its pods were deleted without eviction.
    OutOfService: Warning,
    /// Machine: its Node is deleted after the VM.
    NodeDeleted: Normal,
    /// Machine: its driver's event stream says the cloud takes it (a spot interruption, a
    /// maintenance, a stop or termination behind the controller's back, impaired hardware),
    /// with the deadline; recorded in `status.interruption`.
    Interrupted: Warning,
    /// Machine: its driver recommends replacing it (a rebalance recommendation): a voluntary
    /// replacement, within the owner's budgets.
    RebalanceRecommended: Normal,
    /// MachineDeployment: machines the cloud takes are deleted at once (their drains end before
    /// the deadline) and replaced beside the surge.
    ReplacingInterrupted: Warning,
    /// Machine: created to replace an interrupted machine, it is Ready (how long before the
    /// deadline, or after it, in the message).
    InterruptionReplaced: Normal,
    /// MachineDeployment, MachinePool: the cluster-autoscaler changed `replicas` (raised it, or
    /// lowered it to remove the nodes it names, or dropped requests not yet fulfilled).
    AutoscalerResized: Normal,
    /// MachineDeployment, MachinePool: a request of the cluster-autoscaler was refused (a node not
    /// in the group, below `minReplicas`, a rollout in progress, a disruption budget).
    AutoscalerRefused: Warning,
    /// Any kind: the stored object cannot be read as its kind (which field, and why, in the
    /// message); reads of it by name, and selections it may belong to, fail, and sweeps of its
    /// kind pass over it, until it is repaired or deleted.
    Unreadable: Warning,
}

impl std::fmt::Display for EventReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = include_str!("../../docs/src/operating/running-the-controller.md");

    /// The rows of the events table: `| \`Reason\` | Type | … |` under the `## Events` heading.
    fn doc_rows() -> Vec<(String, String)> {
        let section = DOC.split("\n## Events\n").nth(1).expect("running-the-controller.md has an `## Events` section");
        let section = section.split("\n## ").next().unwrap_or(section);
        section
            .lines()
            .filter_map(|l| {
                let cells: Vec<&str> = l.trim().strip_prefix('|')?.split('|').map(str::trim).collect();
                let reason = cells.first()?.strip_prefix('`')?.strip_suffix('`')?;
                Some((reason.to_string(), cells.get(1)?.to_string()))
            })
            .collect()
    }

    #[test]
    fn every_reason_is_in_the_docs_table_with_its_type_and_nothing_else_is() {
        let rows = doc_rows();
        for r in EventReason::ALL {
            let row = rows.iter().find(|(name, _)| name == r.as_str());
            assert_eq!(
                row.map(|(_, ty)| ty.as_str()),
                Some(r.event_type().as_str()),
                "the events table of docs/src/operating/running-the-controller.md: row of {r}"
            );
        }
        for (name, _) in &rows {
            assert!(
                EventReason::ALL.iter().any(|r| r.as_str() == name),
                "the events table lists `{name}`, which is no EventReason"
            );
        }
        assert_eq!(rows.len(), EventReason::ALL.len(), "the events table lists a reason twice");
    }
}
