//! The MachinePool planner. Rolling upgrades follow CAPZ: with maxSurge > 0 the pool grows to
//! `replicas + maxSurge` on the new model, then old-model instances are deleted in CAPZ's order
//! (failed, annotated, unready, then ready — ready ones within `ready − replicas +
//! maxUnavailable`); with maxSurge = 0 old instances are upgraded in place, maxUnavailable at a
//! time.
//!
//! **With nodes managed** (a target cluster, [`Observed::nodes_managed`]) every instance that
//! goes must have its Node drained first, so the pool never lets the cloud choose and never
//! reimages in place:
//! - the planner chooses the instances to remove and names their Machines
//!   ([`Step::DeleteMachines`]); each Machine's deletion runs the recorded sequence (hooks,
//!   cordon, drain, volumes, then DeletePoolInstances of exactly that instance, then its Node);
//! - a scale-down deletes `live − capacity` Machines, in the order failed, annotated
//!   (`machine.driver.dev/delete-machine`), unready, old model, then the highest instance ID;
//!   it is not bounded by maxUnavailable (fewer replicas is what was asked);
//! - surge upgrades delete the same old instances they would delete without nodes, as Machines;
//! - maxSurge = 0 upgrades are **delete and replace** rather than in-place reimages (a reimage
//!   disrupts the Node's pods without a drain): old instances are deleted as Machines in CAPZ's
//!   order within `ready − replicas + maxUnavailable` (so one at a time with the defaults), and
//!   the pool refills on the latest model once each is gone;
//! - ApplyPool is never sent with a capacity below the instances the cloud still holds (live
//!   ones plus those whose Machines are being deleted): while a chosen Machine drains, a lower
//!   capacity would let the cloud pick another instance. A higher one (a scale-up, a template
//!   change's surge) goes ahead: it removes nothing.

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
    /// The controller manages the instances' Nodes (it has a target cluster): instances are
    /// removed only by deleting their Machines, which drains their Nodes first.
    pub nodes_managed: bool,
}

/// The one call a pool reconcile makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// ApplyPool with this capacity and the template (recording the revision and capacity).
    Apply {
        /// Instances wanted.
        capacity: i64,
    },
    /// DeletePoolInstances of these (surge upgrades, in CAPZ's order). Only without nodes.
    Delete(Vec<String>),
    /// UpgradePoolInstances of these (maxSurge 0). Only without nodes.
    Upgrade(Vec<String>),
    /// Delete the Machines of these instances (nodes managed: scale-down, and upgrades by
    /// deletion). Each Machine's deletion drains its Node, then deletes exactly its instance.
    DeleteMachines(Vec<String>),
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

/// Where an instance goes in a deletion order: failed, annotated, unready, old model, the rest.
fn rank(o: &Observed<'_>, i: &Instance, old: bool) -> u8 {
    if i.state == InstanceState::Failed {
        0
    } else if o.annotated.contains(&i.id) {
        1
    } else if !i.ready() {
        2
    } else if old {
        3
    } else {
        4
    }
}

/// An instance ID as a number, so that "9" comes before "10" (IDs that are not numbers last).
fn number(i: &Instance) -> u64 {
    i.id.parse::<u64>().unwrap_or(u64::MAX)
}

/// CAPZ's upgrade by deletion: old instances in order (failed, annotated, unready, ready; lowest
/// ID first); unready ones cost no availability, ready ones go only within `budget`.
fn upgrade_victims(o: &Observed<'_>, old: &[&Instance], budget: i64) -> Vec<String> {
    let mut order: Vec<&Instance> = old.to_vec();
    order.sort_by_key(|i| (rank(o, i, true), number(i)));
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
    victims
}

/// A scale-down with nodes managed: `count` instances in the order failed, annotated, unready,
/// old model, then the highest ID (the newest).
fn scale_down_victims(o: &Observed<'_>, live: &[&Instance], old: &[&Instance], count: usize) -> Vec<String> {
    let mut order: Vec<&Instance> = live.to_vec();
    order.sort_by_key(|i| {
        let is_old = old.iter().any(|x| x.id == i.id);
        (rank(o, i, is_old), std::cmp::Reverse(number(i)), std::cmp::Reverse(i.id.clone()))
    });
    order.into_iter().take(count).map(|i| i.id.clone()).collect()
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

    let wants_apply =
        template_changed || o.applied_capacity != capacity || (live.len() as i64) < capacity && o.deleting.is_empty();
    if !o.nodes_managed {
        if wants_apply {
            return plan(Step::Apply { capacity });
        }
        if old.is_empty() {
            return plan(Step::Wait);
        }
        if surge > 0 {
            // CAPZ: delete old-model instances within ready − replicas + maxUnavailable.
            let victims = upgrade_victims(&o, &old, ready_replicas - replicas + unavailable);
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
        return plan(Step::Wait);
    }

    // Nodes managed: the pool chooses what goes, and it goes as Machines (drained first).
    let excess = live.len() as i64 - capacity;
    if excess > 0 {
        return plan(Step::DeleteMachines(scale_down_victims(&o, &live, &old, excess as usize)));
    }
    if wants_apply {
        // The instances the cloud still holds: a lower capacity would make it pick among them,
        // and those whose Machines drain are not yet to go.
        let held =
            o.instances.iter().filter(|i| i.state != InstanceState::Deleting || o.deleting.contains(&i.id)).count()
                as i64;
        if capacity >= held {
            return plan(Step::Apply { capacity });
        }
        return plan(Step::Wait);
    }
    if old.is_empty() {
        return plan(Step::Wait);
    }
    // Upgrades by deletion, with or without surge: within ready − replicas + maxUnavailable.
    let victims = upgrade_victims(&o, &old, ready_replicas - replicas + unavailable);
    if !victims.is_empty() {
        return plan(Step::DeleteMachines(victims));
    }
    plan(Step::Wait)
}

#[cfg(test)]
mod tests;
