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
//!
//! [`plan`] classifies the instances, chooses the step ([`Step`]) with or without nodes, and
//! the Ready condition to set; [`Plan::notes`] say why ([`Note`]). With nodes managed an
//! instance is ready only once its Node is ([`Observed::ready`]).

use std::collections::HashSet;

use super::Limits;
use crate::resources::{Phase, Reason, RollingUpdate};

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
    /// Its Machine says its Node is Ready (`NodeReady=True`); read only with nodes managed.
    pub node_ready: bool,
}

impl Instance {
    /// Provisioned and running (its Node aside: see [`Observed::ready`]).
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

impl Observed<'_> {
    /// Whether an instance counts as ready: provisioned and running, and with nodes managed,
    /// its Node Ready.
    pub fn ready(&self, i: &Instance) -> bool {
        i.ready() && (!self.nodes_managed || i.node_ready)
    }
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

/// Why the pool planner chose its step, or held back: in the order it decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    /// The template changed since it was last applied: applied with room for the surge.
    TemplateChanged {
        /// The capacity applied (`replicas + maxSurge` while old instances remain).
        capacity: i64,
    },
    /// The capacity to apply differs from the one applied (a scale, or the surge given back).
    CapacityChanged {
        /// `status.appliedCapacity`.
        from: i64,
        /// The capacity now.
        to: i64,
    },
    /// Fewer live instances than the capacity: the pool is refilled.
    Missing {
        /// Live instances.
        live: i64,
        /// The capacity.
        capacity: i64,
    },
    /// Instances are missing, but Machines are being deleted: no refill until they are gone.
    RefillHeld {
        /// Machines being deleted.
        deleting: usize,
    },
    /// Nodes managed: ApplyPool waits, as a capacity below the instances the cloud still holds
    /// would let it pick one.
    ApplyHeld {
        /// The capacity to apply.
        capacity: i64,
        /// Instances the cloud holds (draining ones included).
        held: i64,
    },
    /// Nodes managed: more live instances than the capacity; the excess goes as Machines.
    AboveCapacity {
        /// Live instances.
        live: i64,
        /// The capacity.
        capacity: i64,
    },
    /// Old-model instances are upgraded (by deletion, or in place with maxSurge 0 and no
    /// nodes), `budget` ready ones at most (`ready − replicas + maxUnavailable`, in place
    /// `maxUnavailable` less those not ready).
    Upgrading {
        /// Old-model instances.
        old: usize,
        /// Ready ones that may go.
        budget: i64,
    },
    /// Old-model instances wait: none may go without leaving fewer than `min_ready` ready.
    WaitingForReady {
        /// Old-model instances.
        old: usize,
        /// Ready instances.
        ready: i64,
        /// `replicas − maxUnavailable`.
        min_ready: i64,
    },
    /// maxSurge 0 without nodes: old-model instances wait, `maxUnavailable` are not ready.
    WaitingForUnavailable {
        /// Old-model instances.
        old: usize,
        /// Live instances not ready.
        busy: i64,
        /// maxUnavailable.
        max_unavailable: i64,
    },
    /// `replicas` instances, all ready, on the latest model.
    Done,
}

impl Note {
    /// Whether it says what keeps the pool from moving on.
    pub fn holds_back(&self) -> bool {
        matches!(
            self,
            Note::RefillHeld { .. }
                | Note::ApplyHeld { .. }
                | Note::WaitingForReady { .. }
                | Note::WaitingForUnavailable { .. }
        )
    }
}

impl std::fmt::Display for Note {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Note::TemplateChanged { capacity } => write!(f, "new template applied with capacity {capacity}"),
            Note::CapacityChanged { from, to } => write!(f, "capacity {from} → {to}"),
            Note::Missing { live, capacity } => write!(f, "{live} of {capacity} instances: refilling"),
            Note::RefillHeld { deleting } => write!(f, "no refill while {deleting} Machine(s) are being deleted"),
            Note::ApplyHeld { capacity, held } => {
                write!(f, "capacity {capacity} waits: the cloud still holds {held} instances")
            }
            Note::AboveCapacity { live, capacity } => write!(f, "{live} instances for capacity {capacity}"),
            Note::Upgrading { old, budget } => {
                write!(f, "{old} old instance(s); {budget} ready one(s) may go")
            }
            Note::WaitingForReady { old, ready, min_ready } => {
                write!(f, "{old} old instance(s) wait: {ready} ready, {min_ready} required")
            }
            Note::WaitingForUnavailable { old, busy, max_unavailable } => {
                write!(f, "{old} old instance(s) wait: {busy} not ready, maxUnavailable {max_unavailable}")
            }
            Note::Done => write!(f, "every instance ready on the latest model"),
        }
    }
}

/// The pool's Ready condition as a plan sets it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ready {
    /// Its status.
    pub holds: bool,
    /// Its reason.
    pub reason: Reason,
    /// Its message.
    pub message: String,
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
    /// The Ready condition to set with [`Step::DeleteMachines`] and [`Step::Wait`] (after a
    /// call, its outcome sets it).
    pub ready: Option<Ready>,
    /// Why, in the order decided.
    pub notes: Vec<Note>,
}

/// The instances sorted by what the steps decide on, and the numbers they share.
struct Classes<'a> {
    limits: Limits,
    template_changed: bool,
    /// Not being deleted.
    live: Vec<&'a Instance>,
    /// Live, not on the latest model of the current template.
    old: Vec<&'a Instance>,
    /// maxSurge, at most one per old instance.
    surge: i64,
    /// The capacity wanted: `replicas`, plus the surge while old instances remain.
    capacity: i64,
    /// Live and ready.
    ready: i64,
    /// Live and on the latest model of the current template.
    updated: i64,
}

/// Where an instance goes in a deletion order: failed, annotated, unready, old model, the rest.
fn rank(o: &Observed<'_>, i: &Instance, old: bool) -> u8 {
    if i.state == InstanceState::Failed {
        0
    } else if o.annotated.contains(&i.id) {
        1
    } else if !o.ready(i) {
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
        if !o.ready(i) {
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

/// Plans one reconcile of a pool: classify, choose the one step (with or without nodes), then
/// the Ready condition.
pub fn plan(o: Observed<'_>) -> Plan {
    let c = classify(&o);
    let mut notes = Vec::new();
    let step =
        if o.nodes_managed { step_with_nodes(&o, &c, &mut notes) } else { step_without_nodes(&o, &c, &mut notes) };
    let done = c.old.is_empty() && c.live.len() as i64 == o.replicas && c.ready == o.replicas;
    if done {
        notes.push(Note::Done);
    }
    Plan {
        ready: ready_condition(&o, &c, &step, done, &notes),
        step,
        replicas: c.live.len() as i64,
        ready_replicas: c.ready,
        updated_replicas: c.updated,
        done,
        notes,
    }
}

/// Sorts the instances into live and old, and resolves the capacity.
fn classify<'a>(o: &Observed<'a>) -> Classes<'a> {
    let limits = Limits::resolve(o.replicas, o.strategy);
    let template_changed = o.applied_revision != o.revision;
    let live: Vec<&Instance> =
        o.instances.iter().filter(|i| i.state != InstanceState::Deleting && !o.deleting.contains(&i.id)).collect();
    let old: Vec<&Instance> = live.iter().copied().filter(|i| !i.latest_model || template_changed).collect();
    let surge = limits.max_surge.min(old.len() as i64);
    let capacity = if old.is_empty() { o.replicas } else { o.replicas + surge };
    let ready = live.iter().filter(|i| o.ready(i)).count() as i64;
    let updated = live.iter().filter(|i| i.latest_model && !template_changed).count() as i64;
    Classes { limits, template_changed, live, old, surge, capacity, ready, updated }
}

/// Whether ApplyPool is due: a new template, another capacity, or instances missing (unless
/// Machines are being deleted: then the cloud refills once they are gone).
fn wants_apply(o: &Observed<'_>, c: &Classes<'_>, notes: &mut Vec<Note>) -> bool {
    let (live, capacity) = (c.live.len() as i64, c.capacity);
    if c.template_changed {
        notes.push(Note::TemplateChanged { capacity });
    } else if o.applied_capacity != capacity {
        notes.push(Note::CapacityChanged { from: o.applied_capacity, to: capacity });
    } else if live < capacity && o.deleting.is_empty() {
        notes.push(Note::Missing { live, capacity });
    } else {
        if live < capacity {
            notes.push(Note::RefillHeld { deleting: o.deleting.len() });
        }
        return false;
    }
    true
}

/// Without nodes: apply, or upgrade old instances, by deletion with a surge (CAPZ) or in place
/// without.
fn step_without_nodes(o: &Observed<'_>, c: &Classes<'_>, notes: &mut Vec<Note>) -> Step {
    if wants_apply(o, c, notes) {
        return Step::Apply { capacity: c.capacity };
    }
    if c.old.is_empty() {
        return Step::Wait;
    }
    if c.surge > 0 {
        // CAPZ: delete old-model instances.
        return upgrade_by_deletion(o, c, notes).map_or(Step::Wait, Step::Delete);
    }
    let busy = c.live.iter().filter(|i| !o.ready(i)).count() as i64;
    let max_unavailable = c.limits.max_unavailable;
    let budget = (max_unavailable - busy).max(0) as usize;
    let ids: Vec<String> = c.old.iter().filter(|i| o.ready(i)).take(budget).map(|i| i.id.clone()).collect();
    if ids.is_empty() {
        notes.push(Note::WaitingForUnavailable { old: c.old.len(), busy, max_unavailable });
        return Step::Wait;
    }
    notes.push(Note::Upgrading { old: c.old.len(), budget: budget as i64 });
    Step::Upgrade(ids)
}

/// Nodes managed: the pool chooses what goes, and it goes as Machines (drained first); ApplyPool
/// never lets the cloud pick an instance.
fn step_with_nodes(o: &Observed<'_>, c: &Classes<'_>, notes: &mut Vec<Note>) -> Step {
    let (live, capacity) = (c.live.len() as i64, c.capacity);
    if live > capacity {
        notes.push(Note::AboveCapacity { live, capacity });
        return Step::DeleteMachines(scale_down_victims(o, &c.live, &c.old, (live - capacity) as usize));
    }
    if wants_apply(o, c, notes) {
        // The instances the cloud still holds: a lower capacity would make it pick among them,
        // and those whose Machines drain are not yet to go.
        let held =
            o.instances.iter().filter(|i| i.state != InstanceState::Deleting || o.deleting.contains(&i.id)).count()
                as i64;
        if capacity >= held {
            return Step::Apply { capacity };
        }
        notes.push(Note::ApplyHeld { capacity, held });
        return Step::Wait;
    }
    if c.old.is_empty() {
        return Step::Wait;
    }
    // Upgrades by deletion, with or without surge.
    upgrade_by_deletion(o, c, notes).map_or(Step::Wait, Step::DeleteMachines)
}

/// Old instances to delete in CAPZ's order within `ready − replicas + maxUnavailable`, if any.
fn upgrade_by_deletion(o: &Observed<'_>, c: &Classes<'_>, notes: &mut Vec<Note>) -> Option<Vec<String>> {
    let budget = c.ready - o.replicas + c.limits.max_unavailable;
    let victims = upgrade_victims(o, &c.old, budget);
    let old = c.old.len();
    if victims.is_empty() {
        notes.push(Note::WaitingForReady { old, ready: c.ready, min_ready: o.replicas - c.limits.max_unavailable });
        return None;
    }
    notes.push(Note::Upgrading { old, budget });
    Some(victims)
}

/// The Ready condition after [`Step::DeleteMachines`] (rolling, naming the Nodes drained) or
/// [`Step::Wait`] (ready once done; what holds the pool back follows the message).
fn ready_condition(o: &Observed<'_>, c: &Classes<'_>, step: &Step, done: bool, notes: &[Note]) -> Option<Ready> {
    let (ready, replicas) = (c.ready, o.replicas);
    match step {
        Step::DeleteMachines(ids) => Some(Ready {
            holds: false,
            reason: Reason::Rolling,
            message: format!("{ready} of {replicas} ready; draining the Nodes of {}", ids.join(", ")),
        }),
        Step::Wait => {
            let message = format!("{ready} of {replicas} ready, {} on the latest model", c.updated);
            Some(Ready {
                holds: done,
                reason: if done { Reason::Ready } else { Reason::Rolling },
                message: notes.iter().filter(|n| n.holds_back()).fold(message, |m, n| format!("{m}; {n}")),
            })
        }
        Step::Apply { .. } | Step::Delete(_) | Step::Upgrade(_) => None,
    }
}

#[cfg(test)]
mod tests;
