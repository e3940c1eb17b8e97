//! Failure domains of a MachineDeployment (`spec.failureDomains`): where new machines go, which
//! go first, which domains take no machines now and why, and when a rebalance moves one.
//!
//! - **Placement**: a new machine goes to the domain that takes machines with the fewest machines
//!   per unit of weight (ties: the first listed). Only the open domains of the highest
//!   `priority` take machines: a lower one (on-demand beside spot) is the fallback while every
//!   higher one is closed. Machines being remediated or withdrawn do not count: they are going.
//! - **Removal order** ([`Spread::order`]): machines that are broken (marked for deletion,
//!   failed, unknown, Node not Ready) go first, as everywhere; then the spread decides — a machine
//!   in no listed domain, then one of the lowest priority, then one in the most-populated domain
//!   — and the deletion policy only among equals. A rollout's old machines go in that order too, so the spread holds during it.
//! - **Fail-over**: a create refused for capacity or availability marks its domain unavailable
//!   for a backoff (the first `initialSeconds`, doubled at each refusal after the domain was
//!   tried again, up to `maxSeconds`; 0 again once a machine created there since runs). The
//!   refused machine never ran: it is withdrawn, and its replacement placed elsewhere.
//! - **Outage**: a domain whose machines (those past creation) are all unhealthy while another
//!   domain has available machines is degraded: it takes no machines while that lasts and for a
//!   backoff after, and the owner says so (`FailureDomainDegraded`).
//! - **Rebalance**: when everything is settled and two domains that take machines differ by more
//!   than `maxSkew` machines per unit of weight (weights scaled so the smallest is 1), or machines
//!   run in a domain of lower priority than an open one, one machine is created in the
//!   least-populated domain, annotated
//!   [`ANNOTATION_REBALANCE`](crate::resources::ANNOTATION_REBALANCE); once it is
//!   available (and more machines are available than `replicas`) one in the crowded domain goes,
//!   asked of the disruption planner as `Rebalance`.

use std::collections::BTreeMap;

use super::member::Member;
use serde_json::Value;

use crate::resources::{merge, FailureDomain, FailureDomainBackoff, FailureDomainStatus, Phase, Time};

/// The reason a degraded domain is marked with.
pub const DEGRADED: &str = "Degraded";
/// The reason a domain whose spot (or reserved) capacity the cloud took back is marked with.
pub const RECLAIMED: &str = "CapacityReclaimed";

/// The machines per domain, as placement and removal count them.
#[derive(Debug, Clone)]
pub struct Spread<'a> {
    domains: &'a [FailureDomain],
    /// Machines per listed domain (same order as `domains`).
    count: Vec<i64>,
    /// Of those, machines of an older revision (a rollout replaces them).
    old: Vec<i64>,
    /// Whether each listed domain takes new machines now.
    open: Vec<bool>,
}

impl<'a> Spread<'a> {
    /// Counts `machines` (those that stay) into `domains`, those not of `revision` as old;
    /// `open[i]` says whether domain `i` takes machines.
    pub fn new<'m>(
        domains: &'a [FailureDomain],
        machines: impl Iterator<Item = &'m Member>,
        revision: &str,
        open: Vec<bool>,
    ) -> Self {
        let (mut count, mut old) = (vec![0; domains.len()], vec![0; domains.len()]);
        for m in machines {
            if let Some(i) = index(domains, m.domain.as_deref()) {
                count[i] += 1;
                old[i] += i64::from(m.revision != revision);
            }
        }
        Self { domains, count, old, open }
    }

    /// A spread from counts already made (`count[i]` machines in domain `i`, none of them old).
    pub fn from_counts(domains: &'a [FailureDomain], count: Vec<i64>, open: Vec<bool>) -> Self {
        let old = vec![0; domains.len()];
        Self { domains, count, old, open }
    }

    /// Whether the owner has failure domains at all.
    pub fn active(&self) -> bool {
        !self.domains.is_empty()
    }

    /// The highest priority among the domains that take machines now.
    fn best_open(&self) -> Option<i32> {
        (0..self.domains.len()).filter(|&i| self.open[i]).map(|i| self.domains[i].priority).max()
    }

    /// Whether domain `i` takes new machines now: it is open, and no open domain has a higher
    /// priority (spot first, on-demand while every spot domain is closed).
    fn preferred(&self, i: usize) -> bool {
        self.open[i] && Some(self.domains[i].priority) == self.best_open()
    }

    /// Machines in domain `i` per unit of weight, weights scaled so the smallest is 1.
    fn score(&self, i: usize, count: i64) -> f64 {
        let min = self.domains.iter().map(|d| d.weight.max(1)).min().unwrap_or(1);
        count as f64 * f64::from(min) / f64::from(self.domains[i].weight.max(1))
    }

    /// The domain a new machine goes to (and counts it there): `None` when no domain takes
    /// machines now. Among equals, the one with the most old machines: in a rollout the old
    /// machine that makes room for it leaves the same domain, so the spread holds.
    pub fn place(&mut self) -> Option<&'a FailureDomain> {
        let i = (0..self.domains.len()).filter(|&i| self.preferred(i)).min_by(|&a, &b| {
            let (x, y) = (self.score(a, self.count[a] + 1), self.score(b, self.count[b] + 1));
            x.total_cmp(&y).then(self.old[b].cmp(&self.old[a]))
        })?;
        self.count[i] += 1;
        Some(&self.domains[i])
    }

    /// `candidates` (in the deletion policy's order) in the order they go: broken ones first
    /// (`broken`), then by the spread — no listed domain first, then the most-populated domain —
    /// and the policy's order among equals. Each pick counts as gone.
    /// `domain` says which domain a candidate is in.
    pub fn order<'m, T>(
        &self,
        candidates: Vec<&'m T>,
        domain: impl Fn(&T) -> Option<&str>,
        broken: impl Fn(&T) -> bool,
    ) -> Vec<&'m T> {
        if !self.active() {
            return candidates;
        }
        // One queue per (tier, domain) in the policy's order, the last domain slot for machines
        // in no listed domain: each pick is the front of a queue (O(machines × domains)).
        let slots = self.domains.len() + 1;
        let mut queues: Vec<std::collections::VecDeque<&'m T>> = vec![Default::default(); 2 * slots];
        for m in candidates {
            let tier = usize::from(!broken(m));
            let slot = index(self.domains, domain(m)).unwrap_or(self.domains.len());
            queues[tier * slots + slot].push_back(m);
        }
        let mut count = self.count.clone();
        let mut out = Vec::with_capacity(queues.iter().map(|q| q.len()).sum());
        for tier in 0..2 {
            let queues = &mut queues[tier * slots..(tier + 1) * slots];
            loop {
                // Machines in no listed domain first, then those of the lowest priority (the
                // fallback's), then by score.
                let rank = |i: usize| {
                    if i == self.domains.len() {
                        (i64::MIN, f64::INFINITY)
                    } else {
                        (i64::from(self.domains[i].priority), self.score(i, count[i]))
                    }
                };
                let goes_before = |a: usize, b: usize| {
                    let ((pa, sa), (pb, sb)) = (rank(a), rank(b));
                    pa < pb || (pa == pb && sa > sb)
                };
                // The first listed among equals.
                let Some(i) =
                    (0..slots).filter(|&i| !queues[i].is_empty()).fold(None, |best: Option<usize>, i| match best {
                        Some(b) if !goes_before(i, b) => Some(b),
                        _ => Some(i),
                    })
                else {
                    break;
                };
                if let Some(m) = queues[i].pop_front() {
                    if i < self.domains.len() {
                        count[i] -= 1;
                    }
                    out.push(m);
                }
            }
        }
        out
    }

    /// A move that would even the spread out, if one is due: from the most-populated domain (or
    /// machines in no listed domain, `None`) to the least-populated domain that takes machines,
    /// when they differ by more than `max_skew` per unit of weight and the move does not
    /// overshoot.
    pub fn imbalance(&self, unlisted: i64, max_skew: u32) -> Option<(Option<&'a FailureDomain>, &'a FailureDomain)> {
        let to = (0..self.domains.len())
            .filter(|&i| self.preferred(i))
            .min_by(|&a, &b| self.score(a, self.count[a]).total_cmp(&self.score(b, self.count[b])))?;
        if unlisted > 0 {
            return Some((None, &self.domains[to]));
        }
        // Machines of a lower priority than the open domains' move back first (on-demand back to
        // spot once a spot domain takes machines again): the lowest priority, then the fullest.
        let best = self.domains[to].priority;
        let fallback = (0..self.domains.len())
            .filter(|&i| self.domains[i].priority < best && self.count[i] > 0)
            .min_by(|&a, &b| {
                let (da, db) = (&self.domains[a], &self.domains[b]);
                da.priority
                    .cmp(&db.priority)
                    .then(self.score(b, self.count[b]).total_cmp(&self.score(a, self.count[a])))
            });
        if let Some(from) = fallback {
            return Some((Some(&self.domains[from]), &self.domains[to]));
        }
        let from = (0..self.domains.len())
            .filter(|&i| i != to && self.preferred(i))
            .max_by(|&a, &b| self.score(a, self.count[a]).total_cmp(&self.score(b, self.count[b])))?;
        let skew = self.score(from, self.count[from]) - self.score(to, self.count[to]);
        let after = self.score(from, self.count[from] - 1) - self.score(to, self.count[to] + 1);
        (skew > f64::from(max_skew) && after >= -1e-9).then(|| (Some(&self.domains[from]), &self.domains[to]))
    }

    /// The number of machines each domain should hold of `replicas`, by weight over the domains
    /// that take machines (the open ones of the highest priority; largest remainder; the others
    /// get 0).
    pub fn shares(&self, replicas: i64) -> Vec<i64> {
        let total: i64 =
            (0..self.domains.len()).filter(|&i| self.preferred(i)).map(|i| i64::from(self.domains[i].weight)).sum();
        if total == 0 {
            return vec![0; self.domains.len()];
        }
        let mut share: Vec<i64> = (0..self.domains.len())
            .map(|i| if self.preferred(i) { replicas * i64::from(self.domains[i].weight) / total } else { 0 })
            .collect();
        let mut rest = replicas - share.iter().sum::<i64>();
        let mut by_remainder: Vec<usize> = (0..self.domains.len()).filter(|&i| self.preferred(i)).collect();
        by_remainder.sort_by_key(|&i| std::cmp::Reverse(replicas * i64::from(self.domains[i].weight) % total));
        for i in by_remainder.into_iter().cycle() {
            if rest <= 0 {
                break;
            }
            share[i] += 1;
            rest -= 1;
        }
        share
    }
}

/// The position of `name` among the listed domains.
pub fn index(domains: &[FailureDomain], name: Option<&str>) -> Option<usize> {
    let name = name?;
    domains.iter().position(|d| d.name == name)
}

/// The [`ANNOTATION_REBALANCE`](crate::resources::ANNOTATION_REBALANCE) value of a machine created to relieve `from` (`-` for machines in
/// no listed domain) for `replicas`.
pub fn rebalance_value(from: Option<&FailureDomain>, replicas: i64) -> String {
    format!("{}/{replicas}", from.map_or("-", |d| d.name.as_str()))
}

/// The domain a rebalance machine relieves, if it was created for `replicas` (a scale-down since
/// then makes it an ordinary machine).
pub fn rebalance_from(m: &Member, replicas: i64) -> Option<&str> {
    let (from, n) = m.rebalance.as_deref()?.rsplit_once('/')?;
    (n.parse::<i64>().ok()? == replicas).then_some(from)
}

/// Whether a machine is past its creation: its health says something about its domain.
fn established(m: &Member) -> bool {
    !m.deleting && !matches!(m.phase, Phase::Pending | Phase::Creating | Phase::Provisioned)
}

/// Whether an established machine is unhealthy: Node not Ready, marked by a health check,
/// unknown to the cloud or failed.
fn unhealthy(m: &Member) -> bool {
    m.node_not_ready || m.marked_unhealthy || matches!(m.phase, Phase::Unknown | Phase::Failed)
}

/// The degraded domains: each `(index, unhealthy machines)` whose established machines are all
/// unhealthy while another domain has an available machine ([`down_as_a_whole`]).
pub fn degraded(
    domains: &[FailureDomain],
    machines: &[&Member],
    available: impl Fn(&Member) -> bool,
) -> Vec<(usize, i64)> {
    let seen = machines.iter().filter_map(|m| {
        let i = index(domains, m.domain.as_deref())?;
        Some(((), i, Seen { counted: established(m), bad: established(m) && unhealthy(m), serving: available(m) }))
    });
    down_as_a_whole(seen).into_iter().map(|((), i, n)| (i, n)).collect()
}

/// What a rule about whole domains sees of one machine.
#[derive(Debug, Clone, Copy)]
pub struct Seen {
    /// Its health says something about its domain (it is past its creation).
    pub counted: bool,
    /// Counted, and unhealthy.
    pub bad: bool,
    /// It serves (available, or healthy).
    pub serving: bool,
}

/// Zone outages are not node outages: among machines grouped by owner and domain, the domains
/// whose counted machines (at least one) are all bad while another domain of the same owner has
/// a machine that serves. Returns each with its bad machines. The owner's planner and the
/// MachineHealthCheck (over several owners) apply the same rule.
pub fn down_as_a_whole<O: Ord + Clone, D: Ord + Clone>(
    machines: impl IntoIterator<Item = (O, D, Seen)>,
) -> Vec<(O, D, i64)> {
    // (owner, domain) → (counted, bad, serving)
    let mut per: BTreeMap<(O, D), (i64, i64, i64)> = BTreeMap::new();
    for (owner, domain, seen) in machines {
        let e = per.entry((owner, domain)).or_default();
        e.0 += i64::from(seen.counted);
        e.1 += i64::from(seen.bad);
        e.2 += i64::from(seen.serving);
    }
    let serving_elsewhere =
        |o: &O, d: &D| per.iter().any(|((owner, domain), (_, _, serving))| owner == o && domain != d && *serving > 0);
    per.iter()
        .filter(|((o, d), (counted, bad, _))| *counted > 0 && bad == counted && serving_elsewhere(o, d))
        .map(|((o, d), (_, bad, _))| (o.clone(), d.clone(), *bad))
        .collect()
}

/// A template's provider spec with a failure domain's fields merged over it (a JSON merge patch).
pub fn provider_spec(template: Option<&Value>, domain: Option<&FailureDomain>) -> Option<Value> {
    match (template, domain.and_then(|d| d.provider_spec.as_ref())) {
        (base, Some(fields)) => Some(merge(base.unwrap_or(&Value::Null), fields)),
        (base, None) => base.cloned(),
    }
}

/// Marks a domain unavailable at `now` for `reason`: the backoff doubles when the domain had one
/// before (a refusal after it was tried again), up to the maximum. Returns the backoff.
pub fn mark(
    d: &mut FailureDomainStatus,
    backoff: &FailureDomainBackoff,
    now: Time,
    reason: &str,
    message: &str,
) -> u64 {
    let seconds = if d.backoff_seconds == 0 {
        backoff.initial_seconds
    } else {
        d.backoff_seconds.saturating_mul(2).min(backoff.max_seconds)
    }
    .max(1);
    d.backoff_seconds = seconds;
    d.unavailable_until = Some(now + chrono::Duration::seconds(i64::try_from(seconds).unwrap_or(i64::MAX / 2)));
    d.reason = reason.to_string();
    d.message = message.to_string();
    seconds
}

#[cfg(test)]
mod tests;
