//! Pure planners: observed state in, a plan out (which machines to create, delete, update, and
//! the status to write). No I/O, no clock reads beyond the `now` they are given, so every
//! decision is tested over tables of situations without processes (Cluster API's rollout
//! planner is the model). The reconcilers observe, call a planner, act on its plan and write
//! status once.
//!
//! - [`disruption`]: how many of an owner's machines may be down: `maxUnavailable`, the
//!   disruption budgets and the remediation limits, asked by every path that takes a machine;
//! - [`owner`]: the one view of an owner's machines under both kinds ([`owner::Unit`]), with
//!   what the steps share;
//! - [`steps`]: each disruption step once, over units — remediation, canary, scale-down,
//!   rollout, in place, rebalance;
//! - [`deployment`]: a MachineDeployment's plan: revisions, failure budget and rollback, the
//!   steps in its order, status; [`member`]: its Machines as it reads them;
//! - [`pool`]: a MachinePool's plan: capacity, the steps in its order, with or without nodes;
//! - [`domains`]: failure domains: placement, removal order, fail-over, outages, rebalancing;
//! - [`health`]: MachineHealthCheck: which machines are unhealthy, the maxUnhealthy short circuit
//!   (it marks; owners remediate).

use crate::resources::{IntOrPercent, RollingUpdate};

pub mod deployment;
pub mod disruption;
pub mod domains;
pub mod health;
pub mod member;
pub mod owner;
pub mod pool;
pub mod steps;

/// How far a rollout may leave `replicas`, resolved to machine counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Machines allowed above `replicas`.
    pub max_surge: i64,
    /// Machines allowed below `replicas` unavailable.
    pub max_unavailable: i64,
}

impl Limits {
    /// The Kubernetes Deployment arithmetic: a percentage of `replicas` rounds up for maxSurge
    /// and down for maxUnavailable; when both come out 0, one machine may be unavailable (or
    /// nothing could ever move). A value that does not parse counts as its default (1 surge,
    /// 0 unavailable; manifests are validated before they get here).
    pub fn resolve(replicas: i64, rolling: &RollingUpdate) -> Self {
        let max_surge = rolling.max_surge.resolve(replicas, true).unwrap_or(1);
        let mut max_unavailable = rolling.max_unavailable.resolve(replicas, false).unwrap_or(0);
        if max_surge == 0 && max_unavailable == 0 {
            max_unavailable = 1;
        }
        Self { max_surge, max_unavailable }
    }

    /// The InPlace strategy: maxSurge as for rolling updates (it bounds creates of missing
    /// machines), and its own maxUnavailable, at least 1 (default 1).
    pub fn in_place(replicas: i64, rolling: &RollingUpdate, max_unavailable: &IntOrPercent) -> Self {
        Self {
            max_surge: Self::resolve(replicas, rolling).max_surge,
            max_unavailable: max_unavailable.resolve(replicas, false).unwrap_or(1).max(1),
        }
    }
}

/// `IntOrPercent` values for the planners' test tables: `int(1)`, `pct("25%")`.
#[cfg(test)]
pub(crate) mod literals {
    use crate::resources::IntOrPercent;

    /// A count of machines.
    pub(crate) fn int(n: i64) -> IntOrPercent {
        IntOrPercent::Int(n)
    }

    /// A percentage of replicas (or any string: one that does not parse, too).
    pub(crate) fn pct(s: &str) -> IntOrPercent {
        IntOrPercent::Str(s.into())
    }
}

#[cfg(test)]
mod tests {
    use super::literals::{int, pct};
    use super::*;

    fn ru(surge: IntOrPercent, unavailable: IntOrPercent) -> RollingUpdate {
        RollingUpdate { max_surge: surge, max_unavailable: unavailable, canary: None }
    }

    #[test]
    fn limits_round_like_kubernetes() {
        // (replicas, maxSurge, maxUnavailable) → (surge, unavailable)
        let rows = [
            (10, int(1), int(0), (1, 0)),
            (10, int(3), int(2), (3, 2)),
            (10, pct("25%"), pct("25%"), (3, 2)),
            (4, pct("25%"), pct("25%"), (1, 1)),
            (3, pct("10%"), pct("10%"), (1, 0)),
            (3, pct("50%"), pct("50%"), (2, 1)),
            (10, pct("0%"), pct("0%"), (0, 1)),
            (10, int(0), int(0), (0, 1)),
            (0, pct("25%"), pct("25%"), (0, 1)),
            (10, pct("100%"), int(0), (10, 0)),
            (10, int(0), pct("30%"), (0, 3)),
            (10, pct("bogus"), int(0), (1, 0)),
            (5, IntOrPercent::Str("2".into()), IntOrPercent::Str("1".into()), (2, 1)),
        ];
        for (replicas, surge, unavailable, want) in rows {
            let got = Limits::resolve(replicas, &ru(surge.clone(), unavailable.clone()));
            assert_eq!((got.max_surge, got.max_unavailable), want, "{replicas} {surge:?} {unavailable:?}");
        }
    }

    #[test]
    fn in_place_unavailable_is_at_least_one() {
        let rolling = RollingUpdate::default();
        assert_eq!(Limits::in_place(10, &rolling, &int(0)).max_unavailable, 1);
        assert_eq!(Limits::in_place(10, &rolling, &pct("30%")).max_unavailable, 3);
        assert_eq!(Limits::in_place(10, &rolling, &pct("5%")).max_unavailable, 1);
        assert_eq!(Limits::in_place(10, &rolling, &int(4)).max_surge, 1);
    }
}
