//! Interruptions, for both kinds: the cloud takes a machine — a spot interruption, a scheduled
//! maintenance, a capacity reservation ending, a stop or termination behind the controller's
//! back, impaired hardware: its Machine's `status.interruption`, recorded from the driver's
//! event stream ([`crate::reconcile::interruptions`]).
//!
//! - [`choose`]: each live interrupted unit is asked of the disruption planner as
//!   `Interruption`, which never holds it (no budget, `maxUnavailable` or short circuit can:
//!   the cloud acts whatever the controller says) but counts it as a machine down, so the
//!   voluntary disruptions of the same plan see it. The owner removes it at once: its deletion
//!   cordons and drains its node until a margin before the deadline (a stopped or terminated
//!   machine's node goes out of service instead), then deletes it.
//! - [`extra_surge`]: its replacement is created at once too, beside the voluntary surge: the
//!   owner may go above `replicas + maxSurge` by as many machines as are interrupted and still
//!   exist, and never by more than `replicas` (at least 1) — the hard cap the book's
//!   Interruptions page states.
//!
//! A rebalance recommendation is not an interruption here: the machine is replaced
//! voluntarily, through remediation, asked as `Rebalance` (within the budgets and
//! `maxUnavailable`, replace before remove: [`super::remediation`]).

use crate::plan::disruption::Planner;
use crate::plan::owner::Unit;
use crate::resources::DisruptionReason;

/// The live units the cloud takes, each asked as `Interruption` (always allowed, counted).
pub fn choose<'u, 'a, T>(units: &'u [Unit<'a, T>], planner: &mut Planner) -> Vec<&'u Unit<'a, T>> {
    units
        .iter()
        .filter(|u| u.live() && u.interrupted())
        .filter(|u| planner.ask(DisruptionReason::Interruption, u.candidate()).allowed())
        .collect()
}

/// How many machines above `replicas + maxSurge` the replacements of interrupted machines may
/// take: as many as interrupted machines still exist (live, or being deleted), at most
/// `replicas` (at least 1).
pub fn extra_surge<T>(units: &[Unit<'_, T>], replicas: i64) -> i64 {
    let interrupted = units.iter().filter(|u| u.interrupted()).count() as i64;
    interrupted.min(replicas.max(1))
}
