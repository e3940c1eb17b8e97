//! Scale-down, for both kinds: when an owner has more live units than `replicas` (its capacity),
//! the excess goes in the deletion order, each asked of the disruption planner as a `ScaleDown`
//! — or as an `Autoscaler` removal when the cluster-autoscaler asked for that unit
//! (`NodeGroupDeleteNodes` marked it), so a budget that limits `Autoscaler` holds it whichever
//! kind owns it. A unit a budget holds is passed over: the next may be down already and cost
//! nothing.

use crate::plan::disruption::{Hold, Planner, Verdict};
use crate::plan::owner::Unit;
use crate::resources::DisruptionReason;

/// Walks `order`, asking the planner for each unit with the reason `reason` gives it, and takes
/// at most `limit` of those allowed (only those are counted: the walk stops at `limit`). With
/// `stop_at_hold` the walk also stops at the first unit held (an in-place update's candidates are
/// all alike: the next would be held too).
pub fn take<'u, 'a, T>(
    order: impl IntoIterator<Item = &'u Unit<'a, T>>,
    limit: usize,
    stop_at_hold: bool,
    reason: impl Fn(&Unit<'a, T>) -> DisruptionReason,
    planner: &mut Planner,
) -> Vec<&'u Unit<'a, T>>
where
    'a: 'u,
{
    let mut taken = Vec::new();
    for u in order {
        if taken.len() >= limit {
            break;
        }
        if planner.ask(reason(u), u.candidate()).allowed() {
            taken.push(u);
        } else if stop_at_hold {
            break;
        }
    }
    taken
}

/// The step: `count` units of `order` (the owner's deletion order) go, each a `ScaleDown` or
/// the autoscaler's.
pub fn scale_down<'u, 'a, T>(
    order: impl IntoIterator<Item = &'u Unit<'a, T>>,
    count: usize,
    planner: &mut Planner,
) -> Vec<&'u Unit<'a, T>>
where
    'a: 'u,
{
    take(order, count, false, Unit::scale_down_reason, planner)
}

/// The cluster-autoscaler's `NodeGroupDeleteNodes` of the units `named` (by key): each asked as an
/// `Autoscaler` removal — the reason the owner's plan asks with when it removes them — in one
/// planner, so two nodes of one call share the budget. The first hold refuses them all (the
/// autoscaler takes its taint off again and retries later). A unit not found, or on its way out
/// already, is not asked.
///
/// # Errors
/// The planner's hold.
pub fn autoscaler<T>(units: &[Unit<'_, T>], named: &[&str], planner: &mut Planner) -> Result<(), Hold> {
    for key in named {
        let Some(u) = units.iter().find(|u| u.key == *key && u.live()) else { continue };
        if let Verdict::Held(hold) = planner.ask(DisruptionReason::Autoscaler, u.candidate()) {
            return Err(hold);
        }
    }
    Ok(())
}
