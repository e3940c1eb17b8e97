//! The MachinePool planner. Rolling upgrades follow CAPZ: with maxSurge > 0 the pool grows to
//! `replicas + maxSurge` on the new model, then old-model instances are deleted in CAPZ's order
//! (failed, annotated, unready, then ready — ready ones within `ready − replicas +
//! maxUnavailable`); with maxSurge = 0 old instances are upgraded in place, maxUnavailable at a
//! time.

use std::collections::HashSet;

use super::Limits;
use crate::resources::{Phase, RollingUpdate};

/// An instance's lifecycle state: the protocol's, as the SDK types it.
pub use driver_sdk::InstanceState;

/// Reads the deprecated `PoolInstance.provisioning_state` of a driver older than the protocol's
/// `InstanceState` (it sends `INSTANCE_STATE_UNSPECIFIED`). Those drivers used Azure's words,
/// the only vocabulary the controller ever read.
pub fn legacy_instance_state(provisioning_state: &str) -> InstanceState {
    match provisioning_state {
        "Succeeded" => InstanceState::Running,
        "Failed" => InstanceState::Failed,
        "Deleting" => InstanceState::Deleting,
        "Updating" => InstanceState::Updating,
        _ => InstanceState::Creating,
    }
}

/// The phase of the Machine that mirrors an instance in `state`.
pub fn instance_phase(state: InstanceState) -> Phase {
    match state {
        InstanceState::Running => Phase::Running,
        InstanceState::Failed => Phase::Failed,
        InstanceState::Deleting => Phase::Terminating,
        InstanceState::Updating => Phase::Updating,
        InstanceState::Creating => Phase::Creating,
    }
}

/// One pool instance as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instance {
    /// The instance ID.
    pub id: String,
    /// Provisioning state.
    pub state: InstanceState,
    /// The power state is running.
    pub running: bool,
    /// The instance runs the pool's latest model.
    pub latest_model: bool,
}

impl Instance {
    /// Provisioned and running.
    pub fn ready(&self) -> bool {
        self.state == InstanceState::Running && self.running
    }
}

/// What the pool reconciler observed.
#[derive(Debug, Clone, Copy)]
pub struct Observed<'a> {
    /// `spec.replicas`.
    pub replicas: i64,
    /// `spec.strategy`.
    pub strategy: &'a RollingUpdate,
    /// The revision (hash) of the pool's template.
    pub revision: &'a str,
    /// `status.appliedRevision`.
    pub applied_revision: &'a str,
    /// `status.appliedCapacity`.
    pub applied_capacity: i64,
    /// The instances listed.
    pub instances: &'a [Instance],
    /// Instances whose Machine is being deleted (their delete is in flight).
    pub deleting: &'a HashSet<String>,
    /// Instances whose Machine carries the delete-machine annotation.
    pub annotated: &'a HashSet<String>,
}

/// The one call a pool reconcile makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// ApplyPool with this capacity and the template (recording the revision and capacity).
    Apply {
        /// Instances wanted.
        capacity: i64,
    },
    /// DeletePoolInstances of these (surge upgrades, in CAPZ's order).
    Delete(Vec<String>),
    /// UpgradePoolInstances of these (maxSurge 0).
    Upgrade(Vec<String>),
    /// Nothing to call; write status.
    Wait,
}

/// The plan for one pool reconcile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The call to make.
    pub step: Step,
    /// Instances not being deleted.
    pub replicas: i64,
    /// Of those, ready.
    pub ready_replicas: i64,
    /// Of those, on the latest model of the current template.
    pub updated_replicas: i64,
    /// `replicas` instances, all ready, all on the latest model.
    pub done: bool,
}

/// Plans one reconcile of a pool.
pub fn plan(o: Observed<'_>) -> Plan {
    let replicas = o.replicas;
    let limits = Limits::resolve(replicas, o.strategy);
    let unavailable = limits.max_unavailable;
    let template_changed = o.applied_revision != o.revision;
    let live: Vec<&Instance> =
        o.instances.iter().filter(|i| i.state != InstanceState::Deleting && !o.deleting.contains(&i.id)).collect();
    let old: Vec<&Instance> = live.iter().copied().filter(|i| !i.latest_model || template_changed).collect();
    let surge = limits.max_surge.min(old.len() as i64);
    let capacity = if old.is_empty() { replicas } else { replicas + surge };
    let ready_replicas = live.iter().filter(|i| i.ready()).count() as i64;
    let updated_replicas = live.iter().filter(|i| i.latest_model && !template_changed).count() as i64;
    let done = old.is_empty() && live.len() as i64 == replicas && ready_replicas == replicas;
    let plan = |step| Plan { step, replicas: live.len() as i64, ready_replicas, updated_replicas, done };

    if template_changed || o.applied_capacity != capacity || (live.len() as i64) < capacity && o.deleting.is_empty() {
        return plan(Step::Apply { capacity });
    }
    if old.is_empty() {
        return plan(Step::Wait);
    }
    if surge > 0 {
        // CAPZ: delete old-model instances within ready − replicas + maxUnavailable.
        let budget = ready_replicas - replicas + unavailable;
        let mut order: Vec<&Instance> = old.clone();
        order.sort_by_key(|i| {
            let rank = if i.state == InstanceState::Failed {
                0
            } else if o.annotated.contains(&i.id) {
                1
            } else if !i.ready() {
                2
            } else {
                3
            };
            (rank, i.id.parse::<u64>().unwrap_or(u64::MAX))
        });
        // Unready old instances cost no availability; ready ones only within the budget.
        let mut left = budget;
        let mut victims = Vec::new();
        for i in order {
            if !i.ready() {
                victims.push(i.id.clone());
            } else if left > 0 {
                victims.push(i.id.clone());
                left -= 1;
            }
        }
        if !victims.is_empty() {
            return plan(Step::Delete(victims));
        }
    } else {
        let busy = live.iter().filter(|i| !i.ready()).count() as i64;
        let budget = (unavailable - busy).max(0) as usize;
        let ids: Vec<String> = old.iter().filter(|i| i.ready()).take(budget).map(|i| i.id.clone()).collect();
        if !ids.is_empty() {
            return plan(Step::Upgrade(ids));
        }
    }
    plan(Step::Wait)
}

#[cfg(test)]
mod tests;
