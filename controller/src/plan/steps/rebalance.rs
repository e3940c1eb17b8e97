//! Rebalancing (a deployment's failure domains, `spec.rebalance`), surge-first: when everything
//! is settled and the spread is off by more than `maxSkew`, one unit is created in the
//! least-populated domain ([`start`]); once every unit created to rebalance is available, the
//! excess goes from the crowded domains ([`excess`]), each asked of the disruption planner as a
//! `Rebalance`, and never so that fewer than `replicas` units are available.

use crate::plan::disruption::Planner;
use crate::plan::domains::Spread;
use crate::plan::owner::Unit;
use crate::resources::{DisruptionReason, FailureDomain};

/// Why no rebalance starts although the spread is off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotNow {
    /// The spread is even enough, or not everything is settled.
    Nothing,
    /// `maxSurge` is 0: the new unit needs room above `replicas`.
    NeedsSurge,
    /// The surge is in use.
    NoRoom,
}

/// A move that evens the spread out, if one is due: from the most-populated domain (`None`:
/// units in no listed domain) to the least-populated one that takes machines. `settled`: nothing
/// else is under way; `unlisted`: live units in no listed domain; `room`: units above `replicas`
/// the surge still allows.
pub fn start<'d>(
    spread: &Spread<'d>,
    settled: bool,
    unlisted: i64,
    max_skew: u32,
    max_surge: i64,
    room: i64,
) -> Result<(Option<&'d FailureDomain>, &'d FailureDomain), NotNow> {
    if !spread.active() || !settled {
        return Err(NotNow::Nothing);
    }
    let moving = spread.imbalance(unlisted, max_skew).ok_or(NotNow::Nothing)?;
    if max_surge < 1 {
        return Err(NotNow::NeedsSurge);
    }
    if room < 1 {
        return Err(NotNow::NoRoom);
    }
    Ok(moving)
}

/// The excess over `replicas` while units created to rebalance (`movers`) are there: nothing
/// goes until each of them is available (`Err`: the first that is not); then the units of
/// `order` go, at most `count`, each a `Rebalance`, while more than `replicas` units stay
/// available (`available` now), stopping at the first the planner holds.
pub fn excess<'u, 'a, T>(
    movers: &[&'u Unit<'a, T>],
    order: impl IntoIterator<Item = &'u Unit<'a, T>>,
    count: usize,
    available: i64,
    replicas: i64,
    planner: &mut Planner,
) -> Result<Vec<&'u Unit<'a, T>>, &'u Unit<'a, T>> {
    if let Some(waiting) = movers.iter().find(|u| !u.available) {
        return Err(waiting);
    }
    let mut available = available;
    let mut out = Vec::new();
    for u in order {
        if out.len() >= count {
            break;
        }
        // Surge-first: never fewer than `replicas` available.
        if u.available && available <= replicas {
            break;
        }
        if !planner.ask(DisruptionReason::Rebalance, u.candidate()).allowed() {
            break;
        }
        available -= i64::from(u.available);
        out.push(u);
    }
    Ok(out)
}
