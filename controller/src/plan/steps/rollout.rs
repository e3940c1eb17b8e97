//! The rollout (a deployment's rolling update, a pool's upgrade by deletion), for both kinds:
//! units of an older revision (model) go in the owner's order, each asked of the disruption
//! planner as a `Rollout` — within `maxUnavailable` (an unavailable one costs no availability),
//! the rollout's pace (old units go no faster than new ones become available) and the budgets —
//! at most `limit` of them (a canary's room).

use super::scale_down::take;
use crate::plan::disruption::Planner;
use crate::plan::owner::Unit;
use crate::resources::DisruptionReason;

/// The old units of `order` that go now.
pub fn replace_old<'u, 'a, T>(
    order: impl IntoIterator<Item = &'u Unit<'a, T>>,
    limit: Option<usize>,
    planner: &mut Planner,
) -> Vec<&'u Unit<'a, T>>
where
    'a: 'u,
{
    take(order, limit.unwrap_or(usize::MAX), false, |_| DisruptionReason::Rollout, planner)
}
