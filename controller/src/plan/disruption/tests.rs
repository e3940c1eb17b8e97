//! The disruption planner over tables of situations: which brake holds which reason, and what
//! the report says.

use chrono::TimeZone;

use super::*;
use crate::plan::literals::{int, pct};
use DisruptionReason::*;

fn t0() -> Time {
    chrono::Utc.with_ymd_and_hms(2030, 6, 15, 12, 0, 0).single().expect("a valid time")
}

fn census(replicas: i64, available: i64, disrupted: i64) -> Census {
    Census { replicas, live: replicas, available, disrupted, new_unavailable: 0, remediating: 0 }
}

fn budget(machines: IntOrPercent) -> DisruptionBudget {
    DisruptionBudget { machines, schedule: None, duration: None, time_zone: None, reasons: Vec::new() }
}

fn only(mut b: DisruptionBudget, reasons: &[DisruptionReason]) -> DisruptionBudget {
    b.reasons = reasons.to_vec();
    b
}

fn scheduled(mut b: DisruptionBudget, cron: &str, duration: &str, zone: &str) -> DisruptionBudget {
    b.schedule = Some(cron.into());
    b.duration = Some(duration.into());
    b.time_zone = Some(zone.into());
    b
}

fn limits(max_unavailable: i64, budgets: &[DisruptionBudget]) -> Limits<'_> {
    Limits {
        max_unavailable,
        budgets,
        max_in_flight: 1,
        remediation_not_before: None,
        remediation_halted: None,
        now: t0(),
    }
}

const UP: Candidate = Candidate { available: true, disrupted: false };
const DOWN: Candidate = Candidate { available: false, disrupted: true };
const COMING: Candidate = Candidate { available: false, disrupted: false };

/// Asks `asks` in order and returns which were allowed.
fn answers(census: Census, limits: Limits<'_>, asks: &[(DisruptionReason, Candidate)]) -> (Vec<bool>, Report) {
    let mut p = Planner::new(census, limits);
    let got = asks.iter().map(|(r, c)| p.ask(*r, *c).allowed()).collect();
    (got, p.report())
}

#[test]
fn max_unavailable_holds_rollouts_and_in_place_updates_of_available_machines() {
    // 5 replicas, all available, maxUnavailable 1: one rollout removal, then held.
    let (got, report) = answers(census(5, 5, 0), limits(1, &[]), &[(Rollout, UP), (Rollout, UP), (InPlaceUpdate, UP)]);
    assert_eq!(got, [true, false, false]);
    assert_eq!(report.held.len(), 2, "{:?}", report.held);
    assert!(matches!(report.held[0].hold, Hold::MaxUnavailable { available: 5, min_available: 4, .. }));
    // A machine that is down already costs no availability: it may go.
    let (got, _) = answers(census(5, 4, 1), limits(1, &[]), &[(Rollout, DOWN), (InPlaceUpdate, UP)]);
    assert_eq!(got, [true, false], "the down machine leaves no room for an available one");
    // Scale-down, remediation and interruptions are not bound by maxUnavailable.
    let (got, _) =
        answers(census(5, 4, 1), limits(0, &[]), &[(ScaleDown, UP), (Remediation, DOWN), (Interruption, UP)]);
    assert_eq!(got, [true, true, true]);
}

#[test]
fn a_rollout_removes_old_machines_no_faster_than_new_ones_come_up() {
    // 3 replicas, surge 1 / unavailable 0: 3 old available + 1 new still coming (4 live).
    let c = Census { replicas: 3, live: 4, available: 3, disrupted: 0, new_unavailable: 1, remediating: 0 };
    let (got, _) = answers(c, limits(0, &[]), &[(Rollout, UP)]);
    assert_eq!(got, [false]);
    // The new one is up: one old one may go.
    let c = Census { new_unavailable: 0, available: 4, ..c };
    let (got, _) = answers(c, limits(0, &[]), &[(Rollout, UP), (Rollout, UP)]);
    assert_eq!(got, [true, false]);
}

#[test]
fn budgets_count_every_machine_down_and_the_most_restrictive_active_one_wins() {
    let budgets = [budget(int(2)), budget(pct("20%"))];
    // 10 replicas: 20% is 2; one machine is down already, so one more may go.
    let (got, report) = answers(census(10, 9, 1), limits(5, &budgets), &[(Rollout, UP), (Rollout, UP)]);
    assert_eq!(got, [true, false]);
    assert_eq!(report.budgets.iter().map(|b| (b.machines, b.allowed)).collect::<Vec<_>>(), [(2, 1), (2, 1)]);
    assert!(matches!(report.held[0].hold, Hold::Budget { index: 0, machines: 2, disrupted: 1, .. }));
    // A machine that is down already adds nothing: it goes whatever the budget.
    let (got, _) = answers(census(10, 8, 2), limits(5, &budgets), &[(Rollout, DOWN), (Rollout, UP)]);
    assert_eq!(got, [true, false]);
    // 15% of 10 rounds up to 2.
    let (got, _) =
        answers(census(10, 10, 0), limits(5, &[budget(pct("15%"))]), &[(Rollout, UP), (Rollout, UP), (Rollout, UP)]);
    assert_eq!(got, [true, true, false]);
}

#[test]
fn a_budget_of_zero_freezes_only_the_reasons_it_names() {
    let freeze = [budget(int(0))];
    let asks = [(Rollout, UP), (InPlaceUpdate, UP), (ScaleDown, UP), (Remediation, DOWN), (Interruption, UP)];
    let (got, report) = answers(census(5, 5, 0), limits(5, &freeze), &asks);
    assert_eq!(got, [false, false, true, true, true], "without reasons: the voluntary ones");
    assert!(report.blocking().is_some());
    let remediation_only = [only(budget(int(0)), &[Remediation])];
    let (got, _) = answers(census(5, 4, 1), limits(5, &remediation_only), &[(Rollout, UP), (Remediation, COMING)]);
    assert_eq!(got, [true, false], "a budget naming only Remediation does not hold a rollout");
    let scale_down = [only(budget(int(0)), &[ScaleDown])];
    let (got, _) = answers(census(5, 5, 0), limits(5, &scale_down), &[(ScaleDown, UP), (Rollout, UP)]);
    assert_eq!(got, [false, true], "a budget naming ScaleDown holds a scale-down");
}

#[test]
fn a_scheduled_budget_limits_only_while_its_window_is_open() {
    // 12:00 UTC on 15 June is 14:00 in Berlin. A freeze from 13:00 to 17:00 Berlin time is
    // active; one from 01:00 for 4 hours is not, and opens at 23:00 UTC.
    let day_freeze = [scheduled(budget(int(0)), "0 13 * * *", "4h", "Europe/Berlin")];
    let (got, report) = answers(census(5, 5, 0), limits(5, &day_freeze), &[(Rollout, UP)]);
    assert_eq!(got, [false]);
    let until = chrono::Utc.with_ymd_and_hms(2030, 6, 15, 15, 0, 0).single();
    assert!(matches!(report.held[0].hold, Hold::Budget { until: u, .. } if u == until), "{:?}", report.held);
    assert_eq!(report.recheck_at, until, "look again when the freeze ends");
    let night = [scheduled(budget(int(0)), "0 1 * * *", "4h", "Europe/Berlin")];
    let (got, report) = answers(census(5, 5, 0), limits(5, &night), &[(Rollout, UP)]);
    assert_eq!(got, [true], "a window that is closed does not limit");
    assert_eq!(report.budgets[0].opens, chrono::Utc.with_ymd_and_hms(2030, 6, 15, 23, 0, 0).single());
    assert!(!report.budgets[0].active);
}

#[test]
fn a_budget_that_cannot_be_read_holds_what_it_would_limit() {
    let broken = [scheduled(budget(int(3)), "0 1 * * *", "4h", "Atlantis/Capital")];
    let (got, report) =
        answers(census(5, 5, 0), limits(5, &broken), &[(Rollout, UP), (ScaleDown, UP), (Rollout, DOWN)]);
    assert_eq!(got, [false, true, false], "it fails closed, even for a machine already down");
    assert!(matches!(&report.held[0].hold, Hold::BudgetInvalid { index: 0, field: "timeZone", .. }));
    assert_eq!(report.budgets[0].invalid.as_ref().map(|(f, _)| *f), Some("timeZone"));
}

#[test]
fn remediation_is_held_by_the_short_circuit_the_pace_and_max_in_flight() {
    let base = limits(1, &[]);
    // maxInFlight 2, one under way: one more.
    let c = Census { remediating: 1, ..census(5, 3, 2) };
    let (got, report) = answers(c, Limits { max_in_flight: 2, ..base }, &[(Remediation, DOWN), (Remediation, DOWN)]);
    assert_eq!(got, [true, false]);
    assert_eq!(report.held[0].hold, Hold::MaxInFlight { in_flight: 2, max: 2 });
    // Paced.
    let until = t0() + chrono::Duration::seconds(4);
    let (got, report) =
        answers(census(5, 4, 1), Limits { remediation_not_before: Some(until), ..base }, &[(Remediation, DOWN)]);
    assert_eq!(got, [false]);
    assert_eq!(report.recheck_at, Some(until));
    // A pace that ran out holds nothing.
    let past = t0() - chrono::Duration::seconds(4);
    let (got, _) =
        answers(census(5, 4, 1), Limits { remediation_not_before: Some(past), ..base }, &[(Remediation, DOWN)]);
    assert_eq!(got, [true]);
    // The short circuit comes first, and blocks.
    let why = "MachineHealthCheck web: 3 of 5 machines are unhealthy";
    let (got, report) = answers(
        census(5, 2, 3),
        Limits { remediation_halted: Some(why), ..base },
        &[(Remediation, DOWN), (Rollout, DOWN)],
    );
    assert_eq!(got, [false, true], "only remediation is halted");
    assert_eq!(report.blocking().map(|h| h.hold.to_string()), Some(why.to_string()));
}

#[test]
fn allowed_disruptions_are_counted_across_reasons() {
    // maxUnavailable 3, a budget of 2: a remediation of an available machine (requested by
    // annotation) and a rollout use the budget; the next rollout is held by it.
    let b = [budget(int(2))];
    let (got, report) = answers(
        census(6, 6, 0),
        Limits { max_in_flight: 5, ..limits(3, &b) },
        &[(Remediation, UP), (Rollout, UP), (Rollout, UP)],
    );
    assert_eq!(got, [true, true, false]);
    assert_eq!(report.allowed(Remediation), 1);
    assert_eq!(report.allowed(Rollout), 1);
    // The status says the same.
    let status = report.status(RemediationStatus::default());
    assert_eq!((status.available, status.disrupted, status.min_available), (6, 0, 3));
    assert_eq!(status.held.len(), 1);
    assert!(
        status.held[0]
            .by
            .starts_with("disruption budget 0 allows 2 machine(s) down and 0 are, 2 more going now: none left"),
        "{}",
        status.held[0].by
    );
}

#[test]
fn max_in_flight_resolves_percentages_up_and_is_at_least_one() {
    assert_eq!(max_in_flight(None, 10), 1);
    assert_eq!(max_in_flight(Some(&int(3)), 10), 3);
    assert_eq!(max_in_flight(Some(&pct("25%")), 10), 3);
    assert_eq!(max_in_flight(Some(&int(0)), 10), 1);
    assert_eq!(max_in_flight(Some(&pct("bad")), 10), 1);
}

#[test]
fn remediations_in_a_row_are_paced_exponentially_and_start_over_when_idle() {
    let (base, max) = (std::time::Duration::from_secs(1), std::time::Duration::from_secs(10));
    let mut pace = RemediationStatus::default();
    let mut delays = Vec::new();
    for _ in 0..5 {
        (pace.consecutive, pace.not_before) = next_pace(&pace, 1, false, t0(), base, max);
        delays.push((pace.not_before.unwrap() - t0()).num_seconds());
    }
    assert_eq!(delays, [1, 2, 4, 8, 10]);
    assert_eq!(next_pace(&pace, 0, false, t0(), base, max), (5, pace.not_before), "still busy: kept");
    assert_eq!(next_pace(&pace, 0, true, t0(), base, max), (0, None), "idle: starts over");
}
