//! The disruption planner: the one place that decides how many of an owner's machines may be
//! down. Every path that takes a machine away or disrupts it — the rolling update, the in-place
//! update, scale-down, remediation, a pool's instance deletes — asks [`Planner::ask`] with its
//! [`DisruptionReason`] and gets an answer: allowed now, or held and by what ([`Hold`]).
//!
//! The brakes, and the reasons each one holds:
//! - **`maxUnavailable`** (`Rollout`, `InPlaceUpdate`, `Rebalance`): a disruption that would take
//!   an available machine is held while `available ≤ replicas − maxUnavailable`; a rollout's
//!   removals are also bounded by `live − (replicas − maxUnavailable) − new machines not yet
//!   available` (the Kubernetes Deployment's `maxScaledDown`), so old machines do not go faster
//!   than new ones come up.
//! - **Disruption budgets** (`spec.disruption.budgets[]`; the reasons each names, by default the
//!   voluntary ones): while active, at most `machines` of the owner's machines may be down.
//!   Every machine that is down counts against every budget, whatever took it; a disruption of
//!   a machine already down costs nothing. The most restrictive active budget wins; a budget
//!   that cannot be read holds every reason it would limit (it must not fail open).
//! - **Remediation limits** (`Remediation`): a MachineHealthCheck's `maxUnhealthy` short circuit
//!   halts it; `remediation.maxInFlight` bounds how many are under way; remediations in a row
//!   are paced exponentially.
//!
//! `Interruption` is never held (the cloud takes the machine), but it counts as a machine down.
//!
//! The planner is pure: the owner's planner counts its machines into a [`Census`], builds a
//! [`Planner`] with its [`Limits`] and the moment, asks for each candidate in its own order, and
//! keeps the [`Report`] in its plan (table tests assert it) and in status (`describe` shows it).
//! Adding a disruption is naming a reason and asking: see the book's Disruptions page.

use std::collections::BTreeMap;
use std::fmt;

use crate::resources::{
    BudgetStatus, DisruptionBudget, DisruptionReason, DisruptionStatus, HeldStatus, IntOrPercent, RemediationStatus,
    Time,
};

/// The owner's machines as the planner counts them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Census {
    /// `spec.replicas`.
    pub replicas: i64,
    /// Machines not being deleted.
    pub live: i64,
    /// Available machines (Running, Node Ready for `minReadySeconds`, not disrupted).
    pub available: i64,
    /// Machines down now: being deleted, updating in place, failed, unhealthy, Node not Ready.
    /// (A new machine on its way up is not down.)
    pub disrupted: i64,
    /// Live machines of the target revision not available yet.
    pub new_unavailable: i64,
    /// Machines being deleted for remediation.
    pub remediating: i64,
}

/// What the owner's spec and status say about disruptions, resolved for this moment.
#[derive(Debug, Clone, Copy)]
pub struct Limits<'a> {
    /// `maxUnavailable`, resolved against `replicas`.
    pub max_unavailable: i64,
    /// `spec.disruption.budgets`.
    pub budgets: &'a [DisruptionBudget],
    /// `remediation.maxInFlight`, resolved (at least 1).
    pub max_in_flight: i64,
    /// No remediation starts before this (the pacing in `status.disruption.remediation`).
    pub remediation_not_before: Option<Time>,
    /// What halts remediation, if anything does: a MachineHealthCheck's short circuit, in words.
    pub remediation_halted: Option<&'a str>,
    /// The moment of the plan.
    pub now: Time,
}

/// A machine a path wants to take away or disrupt, as the planner weighs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// It is available: taking it lowers availability.
    pub available: bool,
    /// It is down already: taking it adds no machine down.
    pub disrupted: bool,
}

/// The planner's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Go ahead (the planner has counted it).
    Allowed,
    /// Not now.
    Held(Hold),
}

impl Verdict {
    /// Whether it is [`Verdict::Allowed`].
    pub fn allowed(&self) -> bool {
        *self == Verdict::Allowed
    }
}

/// What holds a disruption back.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Hold {
    /// Another would leave fewer than `replicas − maxUnavailable` machines available, or take old
    /// machines faster than new ones become available.
    MaxUnavailable {
        /// Machines available.
        available: i64,
        /// `replicas − maxUnavailable`.
        min_available: i64,
        /// New machines not available yet.
        new_unavailable: i64,
    },
    /// A disruption budget has no room left: it allows `machines` down, `disrupted` are, and
    /// `planned` more go in this plan.
    Budget {
        /// Its index in `spec.disruption.budgets`.
        index: usize,
        /// Its `machines`, resolved: at most this many down.
        machines: i64,
        /// Machines down when the plan began.
        disrupted: i64,
        /// Machines this plan takes already (counted against it).
        planned: i64,
        /// When its window closes (a scheduled budget).
        until: Option<Time>,
    },
    /// A budget that cannot be read holds every reason it would limit.
    BudgetInvalid {
        /// Its index.
        index: usize,
        /// The field below the budget (`schedule`, `duration`, `timeZone`, `machines`).
        field: &'static str,
        /// Why.
        message: String,
    },
    /// A MachineHealthCheck's `maxUnhealthy` short circuit halts remediation.
    ShortCircuit {
        /// Which health check, and what it counts.
        by: String,
    },
    /// Remediations in a row are paced: the next waits until then.
    Paced {
        /// When the next may start.
        until: Time,
    },
    /// `remediation.maxInFlight` machines are being remediated.
    MaxInFlight {
        /// Remediations under way (and allowed this time).
        in_flight: i64,
        /// `remediation.maxInFlight`.
        max: i64,
    },
}

impl Hold {
    /// Whether it is a disruption budget's (or the health check's short circuit) doing: what the
    /// owner's `DisruptionBlocked` condition reports. `maxUnavailable` and the remediation pace
    /// are a rollout's and a remediation's usual pace.
    pub fn blocks(&self) -> bool {
        matches!(self, Hold::Budget { .. } | Hold::BudgetInvalid { .. } | Hold::ShortCircuit { .. })
    }
}

impl fmt::Display for Hold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Hold::MaxUnavailable { available, min_available, new_unavailable } => write!(
                f,
                "maxUnavailable: {available} available, {min_available} required, {new_unavailable} new not available yet"
            ),
            Hold::Budget { index, machines, disrupted, planned, until } => {
                write!(f, "disruption budget {index} allows {machines} machine(s) down and {disrupted} are")?;
                if *planned > 0 {
                    write!(f, ", {planned} more going now")?;
                }
                write!(f, ": none left")?;
                match until {
                    Some(t) => write!(f, " until {}", t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)),
                    None => Ok(()),
                }
            }
            Hold::BudgetInvalid { index, field, message } => {
                write!(f, "disruption budget {index} cannot be read (spec.disruption.budgets[{index}].{field}: {message})")
            }
            Hold::ShortCircuit { by } => write!(f, "{by}"),
            Hold::Paced { until } => {
                write!(f, "remediations are paced: the next at {}", until.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
            }
            Hold::MaxInFlight { in_flight, max } => {
                write!(f, "remediation.maxInFlight: {in_flight} under way, {max} allowed")
            }
        }
    }
}

/// One budget as the planner resolved it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetReport {
    /// Its index in `spec.disruption.budgets`.
    pub index: usize,
    /// `machines`, resolved against `replicas` (0 when it cannot be read).
    pub machines: i64,
    /// The reasons it limits.
    pub reasons: Vec<DisruptionReason>,
    /// Active now.
    pub active: bool,
    /// Active: disruptions it allowed when the plan began.
    pub allowed: i64,
    /// Not active: when it opens next.
    pub opens: Option<Time>,
    /// Active with a schedule: when it closes.
    pub closes: Option<Time>,
    /// Why it cannot be read (`field: message`).
    pub invalid: Option<(&'static str, String)>,
    /// Disruptions it held this time.
    pub held: i64,
}

/// Disruptions of one reason held by one brake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// The disruption.
    pub reason: DisruptionReason,
    /// What held it.
    pub hold: Hold,
    /// How many.
    pub machines: i64,
}

/// What the planner decided, for the plan and the owner's status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// The machines as counted.
    pub census: Census,
    /// `replicas − maxUnavailable`.
    pub min_available: i64,
    /// The budgets, in spec order.
    pub budgets: Vec<BudgetReport>,
    /// Disruptions allowed, by reason.
    pub allowed: BTreeMap<DisruptionReason, i64>,
    /// Disruptions held, by reason and brake, in the order first held.
    pub held: Vec<Held>,
    /// `remediation.maxInFlight`.
    pub max_in_flight: i64,
    /// When to look again: a budget's window opens or closes, or the remediation pace allows the
    /// next.
    pub recheck_at: Option<Time>,
}

impl Report {
    /// Disruptions of `reason` allowed.
    pub fn allowed(&self, reason: DisruptionReason) -> i64 {
        self.allowed.get(&reason).copied().unwrap_or(0)
    }

    /// The first hold that blocks (a budget, an unreadable budget, a short circuit).
    pub fn blocking(&self) -> Option<&Held> {
        self.held.iter().find(|h| h.hold.blocks())
    }

    /// The status fields it fills (`remediation.waiting` and the pace are the owner's).
    pub fn status(&self, remediation: RemediationStatus) -> DisruptionStatus {
        DisruptionStatus {
            available: self.census.available,
            disrupted: self.census.disrupted,
            min_available: self.min_available,
            budgets: self
                .budgets
                .iter()
                .map(|b| BudgetStatus {
                    machines: b.machines,
                    reasons: b.reasons.clone(),
                    active: b.active,
                    allowed: b.allowed,
                    opens: b.opens,
                    closes: b.closes,
                    invalid: b.invalid.as_ref().map(|(f, m)| format!("{f}: {m}")).unwrap_or_default(),
                })
                .collect(),
            held: self
                .held
                .iter()
                .map(|h| HeldStatus { reason: h.reason, machines: h.machines, by: h.hold.to_string() })
                .collect(),
            remediation: RemediationStatus {
                in_flight: self.census.remediating,
                max_in_flight: self.max_in_flight,
                ..remediation
            },
        }
    }
}

/// A budget while the plan runs.
struct Budget {
    report: BudgetReport,
    limits: [bool; DisruptionReason::ALL.len()],
    /// Disruptions it still allows.
    left: i64,
}

/// Answers one plan's disruptions, keeping count as it allows them.
pub struct Planner {
    census: Census,
    min_available: i64,
    max_in_flight: i64,
    remediation_not_before: Option<Time>,
    remediation_halted: Option<String>,
    now: Time,
    budgets: Vec<Budget>,
    /// Available machines that may still go (`available − min_available`).
    available_room: i64,
    /// Old machines a rollout may still remove (`maxScaledDown`).
    rollout_room: i64,
    /// Remediations allowed this time.
    remediations: i64,
    allowed: BTreeMap<DisruptionReason, i64>,
    held: Vec<Held>,
}

/// `machines` of a budget resolved against `replicas`: percentages round up (Karpenter).
fn resolve_machines(machines: &IntOrPercent, replicas: i64) -> Result<i64, String> {
    machines.resolve(replicas, true)
}

impl Planner {
    /// A planner for one owner at `limits.now`.
    pub fn new(census: Census, limits: Limits<'_>) -> Self {
        let now = limits.now;
        let min_available = census.replicas - limits.max_unavailable;
        let budgets = limits
            .budgets
            .iter()
            .enumerate()
            .map(|(index, spec)| {
                let mut limits = [false; DisruptionReason::ALL.len()];
                for r in DisruptionReason::ALL {
                    limits[r.index()] = spec.limits(*r);
                }
                let checked = spec
                    .check()
                    .and_then(|()| resolve_machines(&spec.machines, census.replicas).map_err(|why| ("machines", why)))
                    .and_then(|machines| spec.window(now).map(|w| (machines, w)));
                let report = match checked {
                    Ok((machines, w)) => BudgetReport {
                        index,
                        machines,
                        reasons: spec.limited(),
                        active: w.active,
                        allowed: if w.active { (machines - census.disrupted).max(0) } else { 0 },
                        opens: w.opens,
                        closes: w.closes,
                        invalid: None,
                        held: 0,
                    },
                    Err(invalid) => BudgetReport {
                        index,
                        machines: 0,
                        reasons: spec.limited(),
                        active: true,
                        allowed: 0,
                        opens: None,
                        closes: None,
                        invalid: Some(invalid),
                        held: 0,
                    },
                };
                let left = report.allowed;
                Budget { report, limits, left }
            })
            .collect();
        Planner {
            census,
            min_available,
            max_in_flight: limits.max_in_flight.max(1),
            remediation_not_before: limits.remediation_not_before.filter(|t| *t > now),
            remediation_halted: limits.remediation_halted.map(str::to_string),
            now,
            budgets,
            available_room: census.available - min_available,
            rollout_room: census.live - min_available - census.new_unavailable,
            remediations: 0,
            allowed: BTreeMap::new(),
            held: Vec::new(),
        }
    }

    /// Whether a disruption of `reason` taking `candidate` may happen now. Allowed ones are
    /// counted: ask only for what will be done if allowed.
    pub fn ask(&mut self, reason: DisruptionReason, candidate: Candidate) -> Verdict {
        match self.hold(reason, candidate) {
            Some(hold) => {
                if let Hold::Budget { index, .. } | Hold::BudgetInvalid { index, .. } = &hold {
                    self.budgets[*index].report.held += 1;
                }
                match self.held.iter_mut().find(|h| h.reason == reason && h.hold == hold) {
                    Some(h) => h.machines += 1,
                    None => self.held.push(Held { reason, hold: hold.clone(), machines: 1 }),
                }
                Verdict::Held(hold)
            }
            None => {
                self.count(reason, candidate);
                Verdict::Allowed
            }
        }
    }

    /// What holds `reason` for `candidate` now, if anything: the remediation limits, then
    /// `maxUnavailable`, then the budgets.
    fn hold(&self, reason: DisruptionReason, c: Candidate) -> Option<Hold> {
        if !reason.can_be_held() {
            return None;
        }
        if reason == DisruptionReason::Remediation {
            if let Some(by) = &self.remediation_halted {
                return Some(Hold::ShortCircuit { by: by.clone() });
            }
            if let Some(until) = self.remediation_not_before {
                return Some(Hold::Paced { until });
            }
            let in_flight = self.census.remediating + self.remediations;
            if in_flight >= self.max_in_flight {
                return Some(Hold::MaxInFlight { in_flight, max: self.max_in_flight });
            }
        }
        if reason.within_max_unavailable() {
            let short = (reason == DisruptionReason::Rollout && self.rollout_room <= 0)
                || (c.available && self.available_room <= 0);
            if short {
                return Some(Hold::MaxUnavailable {
                    available: self.census.available,
                    min_available: self.min_available,
                    new_unavailable: self.census.new_unavailable,
                });
            }
        }
        let i = reason.index();
        let limiting = self.budgets.iter().filter(|b| b.limits[i] && b.report.active);
        if let Some(b) = limiting.clone().find(|b| b.report.invalid.is_some()) {
            let (field, message) = b.report.invalid.clone().unwrap_or(("", String::new()));
            return Some(Hold::BudgetInvalid { index: b.report.index, field, message });
        }
        if c.disrupted {
            return None;
        }
        // The most restrictive active budget wins (the first of equals).
        let tightest = limiting.min_by_key(|b| (b.left, b.report.index))?;
        (tightest.left <= 0).then_some(Hold::Budget {
            index: tightest.report.index,
            machines: tightest.report.machines,
            disrupted: self.census.disrupted,
            planned: (tightest.report.allowed - tightest.left).max(0),
            until: tightest.report.closes,
        })
    }

    /// Counts an allowed disruption.
    fn count(&mut self, reason: DisruptionReason, c: Candidate) {
        *self.allowed.entry(reason).or_default() += 1;
        if reason == DisruptionReason::Remediation {
            self.remediations += 1;
        }
        if c.available {
            self.available_room -= 1;
        }
        if reason != DisruptionReason::InPlaceUpdate {
            // A machine removed: one fewer a rollout may remove.
            self.rollout_room -= 1;
        }
        if !c.disrupted {
            // One more machine down, for every budget.
            for b in &mut self.budgets {
                b.left -= 1;
            }
        }
    }

    /// What it decided.
    pub fn report(self) -> Report {
        let now = self.now;
        let windows = self.budgets.iter().flat_map(|b| [b.report.opens, b.report.closes]).flatten();
        let recheck_at = windows.chain(self.remediation_not_before).filter(|t| *t > now).min();
        Report {
            census: self.census,
            min_available: self.min_available,
            budgets: self.budgets.into_iter().map(|b| b.report).collect(),
            allowed: self.allowed,
            held: self.held,
            max_in_flight: self.max_in_flight,
            recheck_at,
        }
    }
}

/// `remediation.maxInFlight` resolved against `replicas`: percentages round up, at least 1;
/// default 1.
pub fn max_in_flight(max: Option<&IntOrPercent>, replicas: i64) -> i64 {
    max.and_then(|m| m.resolve(replicas, true).ok()).unwrap_or(1).max(1)
}

/// The remediation pace after a plan that started `started` remediations: each pushes the next
/// further out ([`remediation_pace`]); it starts over once nothing wants remediation or is being
/// remediated (`idle`).
pub fn next_pace(
    prev: &RemediationStatus,
    started: usize,
    idle: bool,
    now: Time,
    base: std::time::Duration,
    max: std::time::Duration,
) -> (u32, Option<Time>) {
    if started > 0 {
        let consecutive = prev.consecutive.saturating_add(started as u32);
        return (consecutive, Some(now + remediation_pace(consecutive, base, max)));
    }
    if idle {
        return (0, None);
    }
    (prev.consecutive, prev.not_before)
}

/// The pace of remediations in a row: after `consecutive` of them the next waits
/// `base × 2^(consecutive − 1)`, at most `max` (1 s, 2 s, 4 s, … with the default backoff), so a
/// failure budget is spent over time, not in one burst.
pub fn remediation_pace(consecutive: u32, base: std::time::Duration, max: std::time::Duration) -> chrono::Duration {
    if consecutive == 0 {
        return chrono::Duration::zero();
    }
    let delay = base.as_secs_f64() * 2f64.powi(consecutive.min(30) as i32 - 1);
    chrono::Duration::milliseconds((delay.min(max.as_secs_f64()) * 1000.0) as i64)
}

#[cfg(test)]
mod tests;
