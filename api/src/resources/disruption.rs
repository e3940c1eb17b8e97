//! What an owner (MachineDeployment, MachinePool) says about taking its machines away: the
//! disruption budgets (`spec.disruption.budgets[]`, Karpenter's shape with a time zone) and the
//! remediation limits (`spec.remediation`), the reasons a machine goes, and what the owner's
//! status reports of them (`status.disruption`). The controller's disruption planner
//! (`machine_controller::plan::disruption`) decides; this module holds the types and reads a
//! budget's schedule.

use serde::{Deserialize, Serialize};

use super::state::wire_enum;
use super::{is_default, IntOrPercent, Time};

wire_enum! {
    /// Why a machine is taken away or disrupted: every path that does so names its reason when it
    /// asks the controller's disruption planner (`machine_controller::plan::disruption`). On a
    /// Machine the owner took, its annotation `machine.driver.dev/disruption-reason` holds it.
    #[derive(PartialOrd, Ord)]
    pub enum DisruptionReason {
        /// A rolling update replaces a machine of an older revision.
        Rollout,
        /// A machine is updated in place (it is unavailable while it updates).
        InPlaceUpdate,
        /// `replicas` went down: the owner removes machines.
        ScaleDown,
        /// A failed or unhealthy machine is replaced.
        Remediation,
        /// Machines move between failure domains.
        Rebalance,
        /// The cluster-autoscaler removes a node it drained (`NodeGroupDeleteNodes`).
        Autoscaler,
        /// The cloud takes the machine (a spot interruption, maintenance; reserved). Never held.
        Interruption,
    }
}

impl DisruptionReason {
    /// Its place in [`DisruptionReason::ALL`]: an index for per-reason tables.
    pub fn index(self) -> usize {
        self as usize
    }

    /// Whether a budget without `reasons` limits it: the voluntary disruptions the controller
    /// starts on its own. A scale-down the user asked for, a remediation of a broken machine and
    /// an interruption by the cloud are limited only by a budget that names them.
    pub fn limited_by_default(self) -> bool {
        matches!(
            self,
            DisruptionReason::Rollout
                | DisruptionReason::InPlaceUpdate
                | DisruptionReason::Rebalance
                | DisruptionReason::Autoscaler
        )
    }

    /// Whether `maxUnavailable` bounds it: the disruptions that trade availability for progress.
    /// A scale-down lowers the target itself, a remediation takes a machine that is already
    /// down, an interruption is the cloud's.
    pub fn within_max_unavailable(self) -> bool {
        matches!(self, DisruptionReason::Rollout | DisruptionReason::InPlaceUpdate | DisruptionReason::Rebalance)
    }

    /// Whether anything can hold it: an interruption happens whatever the controller says.
    pub fn can_be_held(self) -> bool {
        self != DisruptionReason::Interruption
    }
}

/// `spec.disruption`: how many machines voluntary disruptions may take at once, and when.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DisruptionSpec {
    /// Budgets; the most restrictive active one wins. None: only `maxUnavailable` and the
    /// remediation limits hold disruptions back.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 50))]
    pub budgets: Vec<DisruptionBudget>,
}

/// One disruption budget (Karpenter's `NodePool.spec.disruption.budgets[]`, with a time zone).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DisruptionBudget {
    /// At most this many of the owner's machines may be down at once while the budget is
    /// active: a number, or a percentage of `replicas` (rounded up). Every machine that is down
    /// counts, whatever took it; `0` stops the disruptions the budget names.
    pub machines: IntOrPercent,
    /// When the budget is active: a cron expression (5 fields, or `@daily`, `@hourly`, …) in
    /// `timeZone`; each time it fires, the budget is active for `duration`. Absent: always
    /// active.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 128))]
    pub schedule: Option<String>,
    /// How long the budget stays active each time its schedule fires (`1h`, `30m`, `1h30m`,
    /// `90s`). Required with a schedule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    pub duration: Option<String>,
    /// The IANA time zone of the schedule (`Europe/Berlin`); default `UTC`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub time_zone: Option<String>,
    /// The disruptions it limits. Absent or empty: the voluntary ones (`Rollout`,
    /// `InPlaceUpdate`, `Rebalance`, `Autoscaler`); `ScaleDown` and `Remediation` only when
    /// named. `Interruption` cannot be limited.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 7))]
    pub reasons: Vec<DisruptionReason>,
}

impl DisruptionBudget {
    /// Whether it limits disruptions of `reason`.
    pub fn limits(&self, reason: DisruptionReason) -> bool {
        reason.can_be_held()
            && if self.reasons.is_empty() { reason.limited_by_default() } else { self.reasons.contains(&reason) }
    }

    /// The reasons it limits, in order.
    pub fn limited(&self) -> Vec<DisruptionReason> {
        DisruptionReason::ALL.iter().copied().filter(|r| self.limits(*r)).collect()
    }

    /// Checks what a CRD schema cannot: the schedule, duration and time zone read, and the
    /// reasons can be held. `Err((field below the budget, message))`.
    ///
    /// # Errors
    /// The first field that does not read, and why.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        self.machines.resolve(100, true).map_err(|why| ("machines", why))?;
        if let Some(r) = self.reasons.iter().find(|r| !r.can_be_held()) {
            return Err((
                "reasons",
                format!("{r} cannot be limited: the cloud takes the machine whatever a budget says"),
            ));
        }
        self.window_spec().map(drop).map_err(|e| (e.field, e.message))
    }

    /// Its schedule read: `None` when it has none (always active).
    fn window_spec(&self) -> Result<Option<Schedule>, BudgetError> {
        let zone = match &self.time_zone {
            None => chrono_tz::UTC,
            Some(name) => name.parse::<chrono_tz::Tz>().map_err(|_| BudgetError {
                field: "timeZone",
                message: format!("{name:?} is not an IANA time zone name (like Europe/Berlin or UTC)"),
            })?,
        };
        let duration = match &self.duration {
            None => None,
            Some(d) => Some(parse_duration(d).map_err(|message| BudgetError { field: "duration", message })?),
        };
        let Some(expr) = &self.schedule else {
            if duration.is_some() {
                return Err(BudgetError { field: "duration", message: "needs a schedule".into() });
            }
            if self.time_zone.is_some() {
                return Err(BudgetError { field: "timeZone", message: "needs a schedule".into() });
            }
            return Ok(None);
        };
        let cron = parse_cron(expr).map_err(|message| BudgetError { field: "schedule", message })?;
        let Some(duration) = duration else {
            return Err(BudgetError { field: "duration", message: "is required with a schedule".into() });
        };
        Ok(Some(Schedule { cron, duration, zone }))
    }

    /// Whether the budget is active at `now`, and when its window opens or closes.
    ///
    /// # Errors
    /// A schedule, duration or time zone that does not read (the field and why).
    pub fn window(&self, now: Time) -> Result<Window, (&'static str, String)> {
        let Some(s) = self.window_spec().map_err(|e| (e.field, e.message))? else {
            return Ok(Window { active: true, opens: None, closes: None });
        };
        Ok(s.window(now))
    }
}

/// A budget's schedule, read.
struct Schedule {
    cron: croner::Cron,
    duration: chrono::Duration,
    zone: chrono_tz::Tz,
}

impl Schedule {
    /// Active when the schedule fired at some `t` with `t ≤ now < t + duration`: the first time
    /// it fires after `now − duration` tells.
    fn window(&self, now: Time) -> Window {
        use chrono::{SubsecRound, TimeZone};
        let from = (now - self.duration).trunc_subsecs(0).with_timezone(&self.zone);
        let next = |after: &chrono::DateTime<chrono_tz::Tz>| {
            self.cron.find_next_occurrence(after, false).ok().map(|t| t.with_timezone(&chrono::Utc))
        };
        match next(&from) {
            Some(t) if t <= now => {
                // Windows that overlap or touch make one (looked ahead a bounded number of
                // firings: `closes` is what the status shows and when to look again).
                let (mut fired, mut closes) = (t, t + self.duration);
                for _ in 0..1000 {
                    match next(&self.zone.from_utc_datetime(&fired.naive_utc())) {
                        Some(t) if t <= closes => (fired, closes) = (t, closes.max(t + self.duration)),
                        _ => break,
                    }
                }
                Window { active: true, opens: None, closes: Some(closes) }
            }
            opens => Window { active: false, opens, closes: None },
        }
    }
}

/// A budget field that does not read.
struct BudgetError {
    field: &'static str,
    message: String,
}

/// When a budget is active.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Active now.
    pub active: bool,
    /// Not active: when it opens next (`None`: the schedule never fires again).
    pub opens: Option<Time>,
    /// Active with a schedule: when this window closes.
    pub closes: Option<Time>,
}

/// Reads a cron expression: five fields (minute, hour, day of month, month, day of week), or
/// one of `@yearly`, `@annually`, `@monthly`, `@weekly`, `@daily`, `@midnight`, `@hourly`.
///
/// # Errors
/// Why it does not read.
pub fn parse_cron(expr: &str) -> Result<croner::Cron, String> {
    use std::str::FromStr;
    let expr = expr.trim();
    const MACROS: [&str; 7] = ["@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"];
    if expr.starts_with('@') {
        if !MACROS.contains(&expr) {
            return Err(format!("{expr:?} is not one of {}", MACROS.join(", ")));
        }
    } else if expr.split_whitespace().count() != 5 {
        return Err(format!(
            "{expr:?} must have five fields (minute hour day-of-month month day-of-week), like \"0 1 * * *\""
        ));
    }
    croner::Cron::from_str(expr).map_err(|e| format!("{expr:?} is not a cron expression: {e}"))
}

/// Reads a budget's duration in the project's one grammar (`1h`, `30m`, `1h30m`, `90s`:
/// [`driver_sdk_core::duration`], the flags' too), more than zero, at most a year.
///
/// # Errors
/// Why it does not read.
pub fn parse_duration(s: &str) -> Result<chrono::Duration, String> {
    let d = driver_sdk_core::duration::parse(s)?;
    if d.is_zero() {
        return Err(format!("{s:?} must be more than zero"));
    }
    if d > std::time::Duration::from_secs(366 * 24 * 3600) {
        return Err(format!("{s:?} must be at most a year"));
    }
    chrono::Duration::from_std(d).map_err(|_| format!("{s:?} must be at most a year"))
}

/// `spec.remediation`: how the owner replaces failed and unhealthy machines.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RemediationSpec {
    /// At most this many machines are being remediated at once: a number, or a percentage of
    /// `replicas` (rounded up, at least 1). Default 1 (meltdown protection).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_in_flight: Option<IntOrPercent>,
}

/// What the owner's status says of disruptions (`status.disruption`): what is down, which
/// budgets are active and what they allow, what is held back and why.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DisruptionStatus {
    /// Machines available (Running, Node Ready for `minReadySeconds`, not being disrupted).
    #[serde(default)]
    pub available: i64,
    /// Machines down now (being deleted, updating in place, failed, unhealthy, Node not Ready):
    /// what the budgets count.
    #[serde(default)]
    pub disrupted: i64,
    /// `replicas − maxUnavailable`: fewer available machines stop rollouts and in-place updates.
    #[serde(default)]
    pub min_available: i64,
    /// The budgets, in spec order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub budgets: Vec<BudgetStatus>,
    /// Disruptions held back at the last reconcile, by reason and what held them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held: Vec<HeldStatus>,
    /// Remediation: in flight, its limit, the machines waiting.
    #[serde(default, skip_serializing_if = "is_default")]
    pub remediation: RemediationStatus,
}

/// One budget as it stands.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BudgetStatus {
    /// Its `machines` resolved against `replicas`.
    #[serde(default)]
    pub machines: i64,
    /// The reasons it limits.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 7))]
    pub reasons: Vec<DisruptionReason>,
    /// Active now.
    #[serde(default)]
    pub active: bool,
    /// Active: disruptions it allows now (`machines` minus the machines down).
    #[serde(default)]
    pub allowed: i64,
    /// Not active: when its window opens next.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub opens: Option<Time>,
    /// Active with a schedule: when its window closes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub closes: Option<Time>,
    /// It cannot be read (a schedule, duration or time zone the controller refuses): it holds
    /// every disruption it would limit.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub invalid: String,
}

/// Disruptions of one reason held back by one brake.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HeldStatus {
    /// The disruption.
    pub reason: DisruptionReason,
    /// Machines it would have taken.
    pub machines: i64,
    /// What held them, in words (`budget 0 (1 machine, window closed until …)`).
    pub by: String,
}

/// The owner's remediation as it stands.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RemediationStatus {
    /// Machines being remediated (deleted for replacement, still going).
    #[serde(default, skip_serializing_if = "is_default")]
    pub in_flight: i64,
    /// `remediation.maxInFlight` resolved.
    #[serde(default, skip_serializing_if = "is_default")]
    pub max_in_flight: i64,
    /// Failed or unhealthy machines not yet remediated.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waiting: Vec<String>,
    /// Remediations in a row, pacing the next (it starts over once none is wanted).
    #[serde(default, skip_serializing_if = "is_default")]
    pub consecutive: u32,
    /// No remediation starts before this (exponential pacing between remediations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_before: Option<Time>,
}

/// The `Disruption:` section of `describe` for an owner's status: what is down, each budget
/// (active or when it opens, what it allows now), what is held back and by what, and the
/// remediation.
pub fn describe(status: &serde_json::Value) -> String {
    let Some(d) = status.get("disruption").and_then(|d| serde_json::from_value::<DisruptionStatus>(d.clone()).ok())
    else {
        return String::new();
    };
    let at = |t: &Time| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let mut out =
        format!("Disruption:   {} available ({} required), {} down\n", d.available, d.min_available, d.disrupted);
    if !d.budgets.is_empty() {
        out += "  Budgets:\n";
        for (i, b) in d.budgets.iter().enumerate() {
            let reasons: Vec<&str> = b.reasons.iter().map(|r| r.as_str()).collect();
            let state = if !b.invalid.is_empty() {
                format!("cannot be read ({}): holds what it limits", b.invalid)
            } else if b.active {
                let until = b.closes.as_ref().map(|t| format!(" until {}", at(t))).unwrap_or_default();
                format!("active{until}, allows {} now", b.allowed)
            } else {
                let opens = b.opens.as_ref().map_or("never opens again".to_string(), |t| format!("opens {}", at(t)));
                format!("not active, {opens}")
            };
            out += &format!("    [{i}] {} machine(s) for {}: {state}\n", b.machines, reasons.join(", "));
        }
    }
    if !d.held.is_empty() {
        out += "  Held back:\n";
        for h in &d.held {
            out += &format!("    {} {}: {}\n", h.machines, h.reason, h.by);
        }
    }
    let r = &d.remediation;
    if r.in_flight > 0 || !r.waiting.is_empty() || r.not_before.is_some() {
        out += &format!("  Remediation:  {} in flight, at most {}", r.in_flight, r.max_in_flight.max(1));
        if let Some(t) = &r.not_before {
            out += &format!("; the next not before {}", at(t));
        }
        out += "\n";
        if !r.waiting.is_empty() {
            out += &format!("    waiting: {}\n", r.waiting.join(", "));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> Time {
        chrono::DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&chrono::Utc)
    }

    fn budget(schedule: &str, duration: &str, zone: Option<&str>) -> DisruptionBudget {
        DisruptionBudget {
            machines: IntOrPercent::Int(1),
            schedule: Some(schedule.into()),
            duration: Some(duration.into()),
            time_zone: zone.map(Into::into),
            reasons: Vec::new(),
        }
    }

    #[test]
    fn durations_read_hours_minutes_and_seconds_largest_first() {
        let secs = |s: &str| parse_duration(s).map(|d| d.num_seconds());
        assert_eq!(secs("1h"), Ok(3600));
        assert_eq!(secs("30m"), Ok(1800));
        assert_eq!(secs("1h30m"), Ok(5400));
        assert_eq!(secs("90s"), Ok(90));
        assert_eq!(secs("2h0m5s"), Ok(7205));
        for bad in ["", "h", "1", "1d", "30m1h", "1h1h", "-1h", "1.5h", "0s", "9999h", " 1 h"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn cron_expressions_have_five_fields_or_a_macro() {
        assert!(parse_cron("0 1 * * *").is_ok());
        assert!(parse_cron("@daily").is_ok());
        assert!(parse_cron("*/15 9-17 * * 1-5").is_ok());
        for bad in ["0 1 * *", "0 0 1 * * *", "@sometimes", "61 * * * *", "nonsense here a b c"] {
            assert!(parse_cron(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_nightly_window_in_berlin_opens_at_one_local_time_in_winter_and_summer() {
        let b = budget("0 1 * * *", "4h", Some("Europe/Berlin"));
        // Winter (CET, UTC+1): 01:00 Berlin is 00:00 UTC.
        let w = b.window(at("2026-01-15T23:30:00Z")).unwrap();
        assert_eq!((w.active, w.opens), (false, Some(at("2026-01-16T00:00:00Z"))));
        let w = b.window(at("2026-01-16T02:00:00Z")).unwrap();
        assert_eq!((w.active, w.closes), (true, Some(at("2026-01-16T04:00:00Z"))));
        assert!(!b.window(at("2026-01-16T04:00:00Z")).unwrap().active, "the end is exclusive");
        // Summer (CEST, UTC+2): 01:00 Berlin is 23:00 UTC the day before.
        let w = b.window(at("2026-07-15T23:30:00Z")).unwrap();
        assert_eq!((w.active, w.closes), (true, Some(at("2026-07-16T03:00:00Z"))));
        // The same schedule in UTC (the default).
        let utc = budget("0 1 * * *", "4h", None);
        assert!(!utc.window(at("2026-07-15T23:30:00Z")).unwrap().active);
    }

    #[test]
    fn overlapping_windows_make_one() {
        // Every hour for 90 minutes: always active once it started.
        let b = budget("0 * * * *", "90m", None);
        let w = b.window(at("2026-03-01T10:10:00Z")).unwrap();
        assert!(w.active);
        assert!(w.closes.unwrap() > at("2026-03-01T12:00:00Z"), "{w:?}");
    }

    #[test]
    fn what_does_not_read_names_its_field() {
        let mut b = budget("0 1 * * *", "4h", Some("Mars/Olympus"));
        assert_eq!(b.check().unwrap_err().0, "timeZone");
        b.time_zone = None;
        b.duration = None;
        assert_eq!(b.check().unwrap_err().0, "duration");
        b.duration = Some("4 hours".into());
        assert_eq!(b.check().unwrap_err().0, "duration");
        b.duration = Some("4h".into());
        b.schedule = Some("every night".into());
        assert_eq!(b.check().unwrap_err().0, "schedule");
        b.schedule = None;
        assert_eq!(b.check().unwrap_err().0, "duration", "a duration needs a schedule");
        b.duration = None;
        assert!(b.check().is_ok());
        b.reasons = vec![DisruptionReason::Interruption];
        assert_eq!(b.check().unwrap_err().0, "reasons");
        b.reasons.clear();
        b.machines = IntOrPercent::Str("120%".into());
        assert_eq!(b.check().unwrap_err().0, "machines");
    }

    #[test]
    fn a_budget_without_reasons_limits_the_voluntary_disruptions() {
        let mut b = budget("@daily", "1h", None);
        use DisruptionReason::*;
        assert_eq!(b.limited(), [Rollout, InPlaceUpdate, Rebalance, Autoscaler]);
        b.reasons = vec![ScaleDown, Remediation];
        assert_eq!(b.limited(), [ScaleDown, Remediation]);
    }
}
