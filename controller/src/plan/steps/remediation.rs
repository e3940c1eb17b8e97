//! Remediation, for both kinds: failed machines, machines a MachineHealthCheck marked
//! (`OwnerRemediated=False`) and machines annotated `machine.driver.dev/remediate` are replaced,
//! replace before remove where the surge allows.
//!
//! - [`choose`]: units taken before (marked) go on; each other live unit that wants remediation
//!   is asked of the disruption planner as `Remediation` — failed first, then unhealthy, then
//!   requested; oldest first — and those allowed are to be marked. While a health check's short
//!   circuit halts remediation, the units it marked unhealthy are what waits: the planner holds
//!   them, and says so.
//! - A plan that marks does nothing else: the owner writes the marks, and acts on them from
//!   the next plan on, once they are stored. A mark that did not land (a conflicting write) then
//!   leaves nothing behind — no replacement created for it, no machine removed in its place.
//! - [`go_now`]: of the units taken, as many wait as replacements are coming up; the others go
//!   (the first in order).
//! - [`pace`]: remediations in a row are paced (the disruption planner holds the next until
//!   then), and the pace starts over once nothing is being remediated.

use std::time::Duration;

use crate::plan::disruption::{self, Planner};
use crate::plan::owner::{holds, Remediation, Unit};
use crate::resources::{InterruptionKind, RemediationStatus, Time};

/// What [`choose`] decided.
#[derive(Debug)]
pub struct Chosen<'u, 'a, T> {
    /// Units to mark now, with why, in remediation order.
    pub mark: Vec<(&'u Unit<'a, T>, Remediation)>,
    /// Units taken before (marked, still live), in the owner's order.
    pub taken: Vec<&'u Unit<'a, T>>,
}

impl<'u, 'a, T> Chosen<'u, 'a, T> {
    /// Every unit being remediated that is still here: taken before, then marked now.
    pub fn targets(&self) -> Vec<&'u Unit<'a, T>> {
        self.taken.iter().copied().chain(self.mark.iter().map(|(u, _)| *u)).collect()
    }

    /// The keys and reasons of the units to mark.
    pub fn marks(&self) -> Vec<(String, Remediation)> {
        self.mark.iter().map(|(u, why)| (u.key.to_string(), *why)).collect()
    }
}

/// Why `u` wants remediation now, if it does and is not taken yet: its own reason, or, while a
/// short circuit halts remediation (`halted`), the health check's mark, or its cloud's
/// recommendation to move off it. A unit the cloud takes is the interruption step's.
pub fn wants<T>(u: &Unit<'_, T>, halted: bool) -> Option<Remediation> {
    if u.remediating() || !u.live() || u.interrupted() {
        return None;
    }
    let recommended = u.interrupted == Some(InterruptionKind::RebalanceRecommendation);
    u.remediation
        .or((halted && u.marked_unhealthy).then_some(Remediation::Unhealthy))
        .or(recommended.then_some(Remediation::Recommended))
}

/// Chooses the units to remediate (see the module docs). `skip` leaves units out that go
/// otherwise (a deployment's machines withdrawn from a failure domain).
pub fn choose<'u, 'a, T>(
    units: &'u [Unit<'a, T>],
    halted: bool,
    skip: impl Fn(&Unit<'a, T>) -> bool,
    planner: &mut Planner,
) -> Chosen<'u, 'a, T> {
    let taken = units.iter().filter(|u| u.live() && u.remediating()).collect();
    let mut wanting: Vec<(&Unit<'a, T>, Remediation)> =
        units.iter().filter(|u| !skip(u)).filter_map(|u| Some((u, wants(u, halted)?))).collect();
    wanting.sort_by(|(a, x), (b, y)| (x, a.age, a.key).cmp(&(y, b.age, b.key)));
    let mark = wanting
        .into_iter()
        .filter(|(u, why)| {
            // A recommended move is replace before remove: it costs a budget's room, not
            // availability (its replacement comes first).
            let mut candidate = u.candidate();
            candidate.available &= *why != Remediation::Recommended;
            planner.ask(why.disruption(), candidate).allowed()
        })
        .collect();
    Chosen { mark, taken }
}

/// Units on their way up that `among` counts as replacements (live, not available, not down,
/// not being remediated themselves).
pub fn coming<T>(units: &[Unit<'_, T>], targets: &[&Unit<'_, T>], among: impl Fn(&Unit<'_, T>) -> bool) -> usize {
    units.iter().filter(|u| u.coming() && among(u) && !holds(targets, u.key)).count()
}

/// Of `targets` (the units being remediated, in order), the keys of those that go now and how
/// many wait: as many wait as replacements are `coming`; the others go, the first in order.
pub fn go_now<T>(targets: &[&Unit<'_, T>], coming: usize) -> (Vec<String>, usize) {
    let waiting = coming.min(targets.len());
    let go = targets.len() - waiting;
    (targets[..go].iter().map(|u| u.key.to_string()).collect(), waiting)
}

/// The remediation pace to record after a plan that marks `started` units:
/// `status.disruption.remediation`'s `consecutive` and `notBefore`
/// ([`disruption::next_pace`]). It starts over once no unit is being remediated or wants it.
pub fn pace<T>(
    prev: &RemediationStatus,
    units: &[Unit<'_, T>],
    started: usize,
    halted: bool,
    now: Time,
    (base, max): (Duration, Duration),
) -> (u32, Option<Time>) {
    let idle = started == 0 && !units.iter().any(|u| u.remediating() || wants(u, halted).is_some());
    disruption::next_pace(prev, started, idle, now, base, max)
}
