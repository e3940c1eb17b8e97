//! One owner view under both kinds. A MachineDeployment's Machines and a MachinePool's instances
//! project to [`Unit`]s — what every disruption step weighs: available, down, coming up, taken,
//! to be remediated, its place in the deletion order — and the steps ([`super::steps`]) are
//! written once, over units. The owners' planners ([`super::deployment`], [`super::pool`])
//! project their items, run the steps in their order and keep what only they have (revisions
//! and a failure budget; a scale set's capacity).
//!
//! Here too is what the steps share with the owners: why a machine is remediated
//! ([`Remediation`]), the events a plan records ([`PlannedEvent`]), the deletion order
//! ([`deletion_order`]), the census the disruption planner counts ([`census`]) and the owner's
//! disruption conditions ([`disruption_conditions`]).

use std::cmp::Reverse;

use super::disruption::{Candidate, Census, Hold, Report};
use crate::events::EventReason;
use crate::resources::*;

/// Why a machine is to be remediated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Remediation {
    /// Its phase is Failed (the owner's own: a driver failure, a timeout, a Node that never
    /// joined).
    Failed,
    /// A MachineHealthCheck found it unhealthy and asks its owner to remediate it.
    Unhealthy,
    /// The [`ANNOTATION_REMEDIATE`] annotation asks for it.
    Requested,
    /// Its driver recommends moving off it (a rebalance recommendation): a voluntary
    /// replacement, asked as `Rebalance` (within the budgets and `maxUnavailable`).
    Recommended,
}

impl Remediation {
    /// The reason it is asked of the disruption planner with.
    pub fn disruption(self) -> DisruptionReason {
        match self {
            Remediation::Recommended => DisruptionReason::Rebalance,
            _ => DisruptionReason::Remediation,
        }
    }
}

impl std::fmt::Display for Remediation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Remediation::Failed => "failed",
            Remediation::Unhealthy => "unhealthy (a MachineHealthCheck asks for its remediation)",
            Remediation::Requested => "remediation requested (machine.driver.dev/remediate)",
            Remediation::Recommended => "recommended for replacement by its cloud (a rebalance recommendation)",
        })
    }
}

/// An event to record on the owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedEvent {
    /// Why (its type with it).
    pub reason: EventReason,
    /// For a person: the Event's message.
    pub message: String,
}

/// Where a unit stands, as the deletion order ranks it (broken ones go first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Standing {
    /// Failed for good.
    Failed,
    /// Down: unknown to the cloud, stopped, its Node not Ready.
    Down,
    /// On its way up: pending, being created, waiting for its Node.
    Coming,
    /// Updating in place.
    Updating,
    /// Up (or going).
    Running,
}

/// One machine of an owner as every step weighs it: a MachineDeployment's [`Member`] or a
/// MachinePool's instance, `item`, with what the owner's planner read of it.
///
/// [`Member`]: super::member::Member
#[derive(Debug)]
pub struct Unit<'a, T> {
    /// The owner's own view of it.
    pub item: &'a T,
    /// What a plan names it by: the Machine's name, or the instance ID.
    pub key: &'a str,
    /// What the Random deletion policy orders by (the Machine's UID; the instance ID).
    pub uid: &'a str,
    /// Older units have smaller values (a creation time in microseconds; an instance number).
    pub age: i64,
    /// It is being deleted (its removal is under way; not live).
    pub going: bool,
    /// It is of the revision (the model) the owner moves to.
    pub new: bool,
    /// It is available (taking it lowers availability).
    pub available: bool,
    /// It is down (taking it adds no machine down).
    pub disrupted: bool,
    /// Where it stands in the deletion order.
    pub standing: Standing,
    /// The disruption it was taken for (its Machine's mark), if any.
    pub taken: Option<DisruptionReason>,
    /// It carries the delete-machine annotation: it goes first.
    pub marked_for_deletion: bool,
    /// Why it is to be remediated, if it is.
    pub remediation: Option<Remediation>,
    /// A MachineHealthCheck marked it unhealthy (asking for its remediation or not).
    pub marked_unhealthy: bool,
    /// The cloud takes it, or recommends moving off it (its Machine's `status.interruption`).
    pub interrupted: Option<InterruptionKind>,
}

impl<T> Clone for Unit<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Unit<'_, T> {}

impl<T> Unit<'_, T> {
    /// Not being deleted.
    pub fn live(&self) -> bool {
        !self.going
    }

    /// On its way up: live, not available and not down.
    pub fn coming(&self) -> bool {
        self.live() && !self.available && !self.disrupted
    }

    /// The cloud takes it whatever the controller does (an interruption other than a rebalance
    /// recommendation).
    pub fn interrupted(&self) -> bool {
        self.interrupted.is_some_and(InterruptionKind::involuntary)
    }

    /// Its owner took it for remediation: in flight until it is gone.
    pub fn remediating(&self) -> bool {
        self.taken == Some(DisruptionReason::Remediation)
    }

    /// How the disruption planner weighs it.
    pub fn candidate(&self) -> Candidate {
        Candidate { available: self.available, disrupted: self.disrupted }
    }

    /// The reason of its removal below `replicas`: the cluster-autoscaler's when it asked for
    /// it (so a budget naming `Autoscaler` holds it), else a scale-down.
    pub fn scale_down_reason(&self) -> DisruptionReason {
        match self.taken {
            Some(DisruptionReason::Autoscaler) => DisruptionReason::Autoscaler,
            _ => DisruptionReason::ScaleDown,
        }
    }

    /// Its place in the deletion order before any policy: annotated, failed, down, coming up,
    /// updating, running.
    fn rank(&self) -> u8 {
        if self.marked_for_deletion {
            0
        } else {
            1 + self.standing as u8
        }
    }
}

/// The deletion order: annotated, failed, down, coming up, updating, running; of an older
/// revision before the new one; then by `policy` (oldest or newest first, or a random order
/// fixed by UID), the key among equals.
pub fn deletion_order<T>(units: &mut [&Unit<'_, T>], policy: DeletePolicy) {
    let first = |u: &Unit<'_, T>| (u.rank(), u.new);
    match policy {
        DeletePolicy::Oldest => units.sort_by(|a, b| (first(a), a.age, a.key).cmp(&(first(b), b.age, b.key))),
        DeletePolicy::Newest => {
            units.sort_by(|a, b| (first(a), Reverse(a.age), a.key).cmp(&(first(b), Reverse(b.age), b.key)))
        }
        DeletePolicy::Random => units.sort_by_cached_key(|u| (first(u), short_hash(&u.uid))),
    }
}

/// The units as the disruption planner counts them, for an owner of `replicas`.
pub fn census<T>(replicas: i64, units: &[Unit<'_, T>]) -> Census {
    let count = |f: &dyn Fn(&Unit<'_, T>) -> bool| units.iter().filter(|u| f(u)).count() as i64;
    Census {
        replicas,
        live: count(&|u| u.live()),
        available: count(&|u| u.live() && u.available),
        disrupted: count(&|u| u.disrupted),
        new_unavailable: count(&|u| u.live() && u.new && !u.available),
        remediating: count(&|u| u.remediating()),
    }
}

/// Whether `units` holds the unit named `key`.
pub fn holds<T>(units: &[&Unit<'_, T>], key: &str) -> bool {
    units.iter().any(|u| u.key == key)
}

/// The owner's `DisruptionBlocked` condition (a budget or a short circuit holds something back)
/// and its `Valid` condition (every budget reads). Both kinds set them from their plan's report.
pub fn disruption_conditions(conditions: &mut Vec<Condition>, report: &Report) {
    match report.blocking() {
        Some(h) => {
            let reason = match &h.hold {
                Hold::BudgetInvalid { .. } => Reason::BudgetInvalid,
                Hold::ShortCircuit { .. } => Reason::TooManyUnhealthy,
                _ => Reason::BudgetExhausted,
            };
            let others: i64 =
                report.held.iter().filter(|x| x.hold.blocks()).map(|x| x.machines).sum::<i64>() - h.machines;
            let mut message = format!("{} {} held: {}", h.machines, h.reason, h.hold);
            if others > 0 {
                message += &format!(" (and {others} more held)");
            }
            set_condition(conditions, ConditionType::DisruptionBlocked, true, reason, &message);
        }
        None => {
            if condition(conditions, ConditionType::DisruptionBlocked).is_some() {
                set_condition(conditions, ConditionType::DisruptionBlocked, false, Reason::NothingHeld, "");
            }
        }
    }
    let invalid: Vec<String> = report
        .budgets
        .iter()
        .filter_map(|b| b.invalid.as_ref().map(|(f, m)| format!("spec.disruption.budgets[{}].{f}: {m}", b.index)))
        .collect();
    if invalid.is_empty() {
        if condition(conditions, ConditionType::Valid).is_some() {
            set_condition(conditions, ConditionType::Valid, true, Reason::Validated, "");
        }
    } else {
        set_condition(conditions, ConditionType::Valid, false, Reason::Invalid, &invalid.join("; "));
    }
}
