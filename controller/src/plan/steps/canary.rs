//! The canary, for both kinds (`strategy.rollingUpdate.canary` of a deployment,
//! `strategy.canary` of a pool): a change of revision (model) first makes at most
//! `canary.machines` units of it; once every canary unit is available, healthy and not to be
//! remediated for `pauseSeconds`, the canary has passed and the change goes on at its usual pace.
//! `status.canary` records where it stands, so a restarted controller goes on with the same
//! pause; a canary that passed or failed stays recorded until the next revision's.
//!
//! The owner says when a canary starts ([`Input::starts`]: a deployment's rollout of a new spec
//! revision from an earlier one, a pool's new model upgrading instances) and whether a canary
//! unit failed for its revision ([`Input::failed`]); what a failure then does is the owner's (a
//! deployment aborts the rollout and rolls back, a pool stops its upgrade).

use crate::events::EventReason;
use crate::plan::owner::{PlannedEvent, Unit};
use crate::resources::{Canary, CanaryPhase, CanaryStatus, Time};

/// How an owner's events name its revisions and what follows a canary.
#[derive(Debug, Clone, Copy)]
pub struct Words {
    /// `revision` or `model`.
    pub revision: &'static str,
    /// `machine` or `instance`.
    pub unit: &'static str,
    /// What goes on once it passed: `rolling out the rest`, `upgrading the rest`.
    pub then: &'static str,
    /// What stops once it failed: `the upgrade stops until the template changes`.
    pub stops: &'static str,
}

/// What the owner tells the step.
#[derive(Debug)]
pub struct Input<'a> {
    /// The strategy's canary, if it has one.
    pub spec: Option<&'a Canary>,
    /// The revision (model) the owner moves to.
    pub revision: &'a str,
    /// The owner's `replicas`.
    pub replicas: i64,
    /// A canary starts for this change when none of `revision` is recorded.
    pub starts: bool,
    /// `status.canary` as read.
    pub recorded: Option<CanaryStatus>,
    /// A canary unit failed for its revision: which, and why (`None`: none did, or the owner
    /// counts failures itself).
    pub failed: Option<(String, String)>,
    /// The moment of the plan.
    pub now: Time,
    /// The owner's words.
    pub words: Words,
}

/// Where the canary leaves the change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// No canary holds it (none asked, none applies, or it passed).
    Free,
    /// At most `wanted` units of the revision until it passes.
    Holds {
        /// Canary units wanted.
        wanted: i64,
    },
    /// A canary unit failed: no old unit is taken until the revision changes.
    Failed {
        /// Canary units wanted.
        wanted: i64,
    },
}

impl Outcome {
    /// How many units of the revision the canary wants, while it holds or failed.
    pub fn wanted(self) -> Option<i64> {
        match self {
            Outcome::Free => None,
            Outcome::Holds { wanted } | Outcome::Failed { wanted } => Some(wanted),
        }
    }
}

/// What the step decided.
#[derive(Debug)]
pub struct Decision {
    /// `status.canary` to write.
    pub status: Option<CanaryStatus>,
    /// Where it leaves the change.
    pub outcome: Outcome,
    /// Canary units available and healthy (while it holds).
    pub ready: usize,
    /// The canary passed now.
    pub passed: bool,
    /// Events to record (passed, failed).
    pub events: Vec<PlannedEvent>,
}

fn under_way(k: &CanaryStatus) -> bool {
    matches!(k.phase, CanaryPhase::Progressing | CanaryPhase::Pausing)
}

/// Runs the canary over `new`, the owner's live units of the revision (any order), naming each
/// unit's Machine with `name_of`.
pub fn step<T>(input: Input<'_>, new: &[&Unit<'_, T>], name_of: impl Fn(&Unit<'_, T>) -> String) -> Decision {
    let free = |status| Decision { status, outcome: Outcome::Free, ready: 0, passed: false, events: Vec::new() };
    let Some(spec) = input.spec else {
        // No canary asked (any more): one under way is dropped; one that passed or failed stays.
        return free(input.recorded.filter(|k| !under_way(k)));
    };
    let wanted = spec.machines_of(input.replicas);
    let mut k = match input.recorded {
        Some(k) if k.revision == input.revision => k,
        other if input.starts && wanted > 0 => {
            drop(other);
            CanaryStatus {
                revision: input.revision.to_string(),
                phase: CanaryPhase::Progressing,
                wanted,
                machines: Vec::new(),
                ready_since: None,
                pause_until: None,
                message: String::new(),
            }
        }
        other => return free(other.filter(|k| !under_way(k))),
    };
    let w = input.words;
    match k.phase {
        CanaryPhase::Passed => return free(Some(k)),
        CanaryPhase::Failed => {
            let wanted = k.wanted.max(1);
            return Decision { status: Some(k), outcome: Outcome::Failed { wanted }, ..free(None) };
        }
        CanaryPhase::Progressing | CanaryPhase::Pausing => {}
    }
    // The canary units: the revision's, oldest first (a replacement of one that went takes its
    // place).
    let mut members: Vec<&Unit<'_, T>> = new.to_vec();
    members.sort_by_key(|u| (u.age, u.key));
    members.truncate(usize::try_from(wanted).unwrap_or(usize::MAX));
    k.wanted = wanted;
    k.machines = members.iter().map(|u| name_of(u)).collect();
    if let Some((unit, why)) = input.failed {
        k.phase = CanaryPhase::Failed;
        (k.ready_since, k.pause_until) = (None, None);
        k.message = format!("canary {} {unit} of {} {} failed ({why}): {}", w.unit, w.revision, k.revision, w.stops);
        let events = vec![PlannedEvent { reason: EventReason::CanaryFailed, message: k.message.clone() }];
        return Decision { status: Some(k), outcome: Outcome::Failed { wanted }, ready: 0, passed: false, events };
    }
    let ready = members
        .iter()
        .filter(|u| u.available && !u.marked_unhealthy && u.remediation.is_none() && u.taken.is_none())
        .count();
    if ready as i64 >= wanted {
        if k.pause(input.now, spec.pause_seconds) {
            let message = format!(
                "the canary of {} {} ({}) held {}s: {}",
                w.revision,
                k.revision,
                k.machines.join(", "),
                spec.pause_seconds,
                w.then
            );
            let events = vec![PlannedEvent { reason: EventReason::CanaryPassed, message }];
            return Decision { status: Some(k), outcome: Outcome::Free, ready, passed: true, events };
        }
    } else {
        // One of them is not (or no longer) available and healthy.
        k.not_ready();
    }
    Decision { status: Some(k), outcome: Outcome::Holds { wanted }, ready, passed: false, events: Vec::new() }
}
