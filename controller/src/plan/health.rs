//! MachineHealthCheck decisions (Cluster API's, simplified): which checked Machines are
//! unhealthy, whether `maxUnhealthy` short-circuits remediation, and which Machines to mark.
//!
//! A Machine is unhealthy when its phase is `Failed`, when its Node's `Ready` condition (the
//! Machine's `NodeReady` condition) has had an `unhealthyConditions` status for at least its
//! timeout, or when it carries `machine.driver.dev/remediate`. A Machine whose Node has not
//! joined yet (`NodeReady` False, `WaitingForNode`) is not judged by the Node's conditions: the
//! owner's `nodeStartupTimeoutSeconds` judges it, failing it `NODE_NOT_JOINED` (a failure of its
//! revision). The health check only **marks**:
//! `HealthCheckSucceeded=False` on every unhealthy Machine, and `OwnerRemediated=False` on those
//! an owner (MachineDeployment, MachinePool) is to remediate — unless the check only observes,
//! the Machine carries `machine.driver.dev/skip-remediation`, or more Machines are unhealthy than
//! `maxUnhealthy` allows (a short circuit: a zone outage must not take the whole fleet). The
//! owners remediate ([`super::deployment`], [`super::pool`]) within their disruption planner's
//! allowance.
//!
//! Timers start over after an outage: a condition's time counts from the later of its
//! transition and `timers_since` (the end of the last outage of the API server or the target
//! cluster, as the controller saw it), since nothing could be observed meanwhile.

use std::time::Duration;

use crate::resources::{
    condition, ConditionStatus, ConditionType, HealthCheckMode, Kind, Machine, MachineHealthCheckSpec, Phase, Reason,
    Time, ANNOTATION_REMEDIATE, ANNOTATION_SKIP_REMEDIATION,
};

/// A checked Machine found unhealthy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unhealthy {
    /// The Machine's name.
    pub name: String,
    /// Why, as a condition reason.
    pub reason: Reason,
    /// Why, in words.
    pub why: String,
    /// Whether its owner is asked to remediate it (`OwnerRemediated=False`).
    pub remediate: bool,
}

/// What a health check found and decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assessment {
    /// Machines checked (not being deleted, not skipped).
    pub expected: i64,
    /// Of those, the healthy ones.
    pub healthy: i64,
    /// The unhealthy ones, in name order.
    pub unhealthy: Vec<Unhealthy>,
    /// Machines whose Node condition is unhealthy but whose timeout has not run out: they count
    /// toward `maxUnhealthy` already.
    pub pending: i64,
    /// `maxUnhealthy` resolved against `expected`.
    pub max_unhealthy: i64,
    /// `max_unhealthy` minus the unhealthy and pending, at least 0.
    pub remediations_allowed: i64,
    /// More unhealthy (or pending) than `max_unhealthy`: nothing is remediated.
    pub short_circuited: bool,
    /// Healthy Machines that were marked unhealthy before: marked healthy again.
    pub recovered: Vec<String>,
    /// When a healthy Machine's unhealthy condition times out, if one is running.
    pub recheck_after: Option<Duration>,
    /// Failure domains down as a whole (`owner/domain: N machine(s)`): an owner's domain whose
    /// checked machines are all unhealthy while another of its domains has a healthy one. A zone
    /// outage is not a node outage: its machines count toward `maxUnhealthy` neither as unhealthy
    /// nor as expected.
    pub domain_outages: Vec<String>,
    /// The machines of those domains.
    pub outside: i64,
}

/// Assesses `machines` (the selector's, in the health check's namespace) at `now`; conditions
/// count from `timers_since` at the earliest.
///
/// # Errors
/// A `maxUnhealthy` that is neither an integer ≥ 0 nor a percentage.
pub fn assess(
    spec: &MachineHealthCheckSpec,
    machines: &[Machine],
    now: Time,
    timers_since: Option<Time>,
) -> Result<Assessment, String> {
    let on = |m: &Machine, key: &str| m.metadata.annotations.get(key).is_some_and(|v| v != "false");
    let mut checked: Vec<&Machine> =
        machines.iter().filter(|m| !m.is_deleting() && !on(m, ANNOTATION_SKIP_REMEDIATION)).collect();
    checked.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let mut unhealthy = Vec::new();
    let mut recovered = Vec::new();
    let mut pending = 0;
    let mut pending_names = Vec::new();
    let mut recheck_after: Option<Duration> = None;
    for m in &checked {
        let verdict = if on(m, ANNOTATION_REMEDIATE) {
            Health::Unhealthy(
                Reason::RemediationRequested,
                "remediation requested (machine.driver.dev/remediate)".into(),
            )
        } else {
            health(spec, m, now, timers_since)
        };
        match verdict {
            Health::Healthy { recheck } => {
                if recheck.is_some() {
                    pending += 1;
                    pending_names.push(m.metadata.name.as_str());
                }
                recheck_after = match (recheck_after, recheck) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                let was_marked = condition(&m.status.conditions, ConditionType::HealthCheckSucceeded)
                    .is_some_and(|c| c.status != ConditionStatus::True);
                if was_marked {
                    recovered.push(m.metadata.name.clone());
                }
            }
            Health::Unhealthy(reason, why) => unhealthy.push(Unhealthy {
                name: m.metadata.name.clone(),
                reason,
                why,
                remediate: matches!(m.owner(), Some((Kind::MachineDeployment | Kind::MachinePool, _))),
            }),
        }
    }
    let expected = checked.len() as i64;
    let bad = |m: &Machine| {
        let name = m.metadata.name.as_str();
        unhealthy.iter().any(|u| u.name == name) || pending_names.contains(&name)
    };
    let (domain_outages, outside) = domain_outages(&checked, bad);
    let judged = expected - outside;
    let max_unhealthy = spec.max_unhealthy.resolve(judged, false).map_err(|why| format!("maxUnhealthy {why}"))?;
    let count = unhealthy.len() as i64 + pending - outside;
    let short_circuited = count > max_unhealthy;
    if short_circuited || spec.mode == HealthCheckMode::Observe {
        for u in &mut unhealthy {
            u.remediate = false;
        }
    }
    Ok(Assessment {
        expected,
        healthy: expected - unhealthy.len() as i64,
        unhealthy,
        pending,
        max_unhealthy,
        remediations_allowed: (max_unhealthy - count).max(0),
        short_circuited,
        recovered,
        recheck_after,
        domain_outages,
        outside,
    })
}

/// The failure domains down as a whole among the checked machines (grouped by owner and
/// `spec.failureDomain`; [`super::domains::down_as_a_whole`], `bad` machines against the others),
/// in words, and how many machines they hold.
fn domain_outages(checked: &[&Machine], bad: impl Fn(&Machine) -> bool) -> (Vec<String>, i64) {
    let seen = checked.iter().filter_map(|m| {
        let (_, owner) = m.owner()?;
        let domain = m.spec.failure_domain.as_deref()?;
        let bad = bad(m);
        Some((owner, domain, super::domains::Seen { counted: true, bad, serving: !bad }))
    });
    let down = super::domains::down_as_a_whole(seen);
    let words = down.iter().map(|(owner, domain, n)| format!("{owner}/{domain}: {n} machine(s)")).collect();
    (words, down.iter().map(|(_, _, n)| n).sum())
}

enum Health {
    /// Healthy; `recheck`: when a condition that holds now would time out.
    Healthy {
        recheck: Option<Duration>,
    },
    Unhealthy(Reason, String),
}

fn health(spec: &MachineHealthCheckSpec, m: &Machine, now: Time, timers_since: Option<Time>) -> Health {
    if m.status.phase == Phase::Failed {
        let why = m.status.failure.as_ref().map_or_else(
            || "its phase is Failed".to_string(),
            |f| format!("its phase is Failed ({}: {})", f.reason, f.message),
        );
        return Health::Unhealthy(Reason::MachineFailed, why);
    }
    let mut recheck: Option<Duration> = None;
    if m.status.in_place.is_some() {
        // Drained for an in-place update: its Node may go NotReady while it reboots, and the
        // update's own deadline (`nodeStartupTimeoutSeconds`) fails the machine if it does not
        // come back.
        return Health::Healthy { recheck };
    }
    let Some(ready) = condition(&m.status.conditions, ConditionType::NodeReady) else {
        return Health::Healthy { recheck };
    };
    if ready.reason == Reason::WaitingForNode {
        // Its Node has not joined: not unhealthy. Its own clock judges it, the owner's
        // `nodeStartupTimeoutSeconds` from the moment its VM came up: past it the machine fails
        // (NODE_NOT_JOINED), which counts against its revision — so a revision whose Nodes
        // never join is aborted, not churned (Cluster API judges it by the node-startup timeout
        // only).
        return Health::Healthy { recheck };
    }
    for u in spec.unhealthy_conditions.iter().filter(|u| u.condition_type == "Ready") {
        if ready.status != u.status {
            continue;
        }
        let since = timers_since.map_or(ready.last_transition_time, |t| t.max(ready.last_transition_time));
        let held = (now - since).to_std().unwrap_or_default();
        let timeout = Duration::from_secs(u.timeout_seconds);
        if held >= timeout {
            return Health::Unhealthy(
                Reason::NodeNotReady,
                format!(
                    "its Node's Ready condition has been {} for {}s (timeout {}s)",
                    u.status,
                    held.as_secs(),
                    u.timeout_seconds
                ),
            );
        }
        let left = timeout - held;
        recheck = Some(recheck.map_or(left, |r| r.min(left)));
    }
    Health::Healthy { recheck }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::resources::*;

    fn now() -> Time {
        chrono::DateTime::parse_from_rfc3339("2026-01-01T12:00:00Z").unwrap().with_timezone(&chrono::Utc)
    }

    /// A machine named `name` owned by `owner` (a MachineDeployment unless `None`).
    fn machine(name: &str, owner: Option<Kind>) -> Machine {
        let mut m = Machine::new("default", name, MachineSpec::default());
        m.status.phase = Phase::Running;
        if let Some(kind) = owner {
            m.metadata.owner_references.push(OwnerReference::controller_of(kind, "web", "u"));
        }
        m
    }

    fn node_ready(mut m: Machine, status: ConditionStatus, for_secs: i64) -> Machine {
        m.status.conditions.push(Condition {
            condition_type: ConditionType::NodeReady,
            status,
            reason: Reason::NodeNotReady,
            message: String::new(),
            last_transition_time: now() - chrono::Duration::seconds(for_secs),
        });
        m
    }

    fn failed(mut m: Machine) -> Machine {
        m.status.phase = Phase::Failed;
        m
    }

    fn deleting(mut m: Machine) -> Machine {
        m.metadata.deletion_timestamp = Some(now());
        m
    }

    fn annotated(mut m: Machine, key: &str) -> Machine {
        m.metadata.annotations.insert(key.into(), "true".into());
        m
    }

    fn was_marked(mut m: Machine) -> Machine {
        set_condition(&mut m.status.conditions, ConditionType::HealthCheckSucceeded, false, Reason::NodeNotReady, "");
        m
    }

    fn spec(max_unhealthy: Option<IntOrPercent>) -> MachineHealthCheckSpec {
        let max_unhealthy = max_unhealthy.unwrap_or(IntOrPercent::Str("100%".into()));
        MachineHealthCheckSpec {
            selector: LabelSelector { match_labels: BTreeMap::from([("app".into(), "web".into())]) },
            unhealthy_conditions: vec![
                UnhealthyCondition {
                    condition_type: NodeConditionType::Ready,
                    status: ConditionStatus::False,
                    timeout_seconds: 300,
                },
                UnhealthyCondition {
                    condition_type: NodeConditionType::Ready,
                    status: ConditionStatus::Unknown,
                    timeout_seconds: 600,
                },
            ],
            max_unhealthy,
            mode: HealthCheckMode::Remediate,
        }
    }

    const MD: Option<Kind> = Some(Kind::MachineDeployment);

    struct Row {
        what: &'static str,
        spec: MachineHealthCheckSpec,
        machines: Vec<Machine>,
        timers_since: Option<Time>,
        unhealthy: &'static [&'static str],
        remediate: &'static [&'static str],
        allowed: i64,
        short: bool,
        recheck: Option<u64>,
    }

    fn row(what: &'static str, spec: MachineHealthCheckSpec, machines: Vec<Machine>) -> Row {
        Row {
            what,
            spec,
            machines,
            timers_since: None,
            unhealthy: &[],
            remediate: &[],
            allowed: 0,
            short: false,
            recheck: None,
        }
    }

    #[test]
    fn decisions_over_situations() {
        use IntOrPercent::{Int, Str};
        let observe = MachineHealthCheckSpec { mode: HealthCheckMode::Observe, ..spec(None) };
        let not_joined = |name: &str| {
            let mut m = node_ready(machine(name, MD), ConditionStatus::False, 9999);
            m.status.conditions[0].reason = Reason::WaitingForNode;
            m.status.phase = Phase::Provisioned;
            m
        };
        let rows = vec![
            Row {
                unhealthy: &["b"],
                remediate: &["b"],
                allowed: 0,
                ..row(
                    "a Node that never joined is not unhealthy however long it waits (the node-startup timeout \
                     judges it, failing it NODE_NOT_JOINED); once failed it is",
                    spec(Some(Int(1))),
                    vec![not_joined("a"), failed(not_joined("b"))],
                )
            },
            Row {
                allowed: 2,
                ..row(
                    "all healthy: nothing to do, nothing to wait for",
                    spec(None),
                    vec![machine("a", MD), node_ready(machine("b", MD), ConditionStatus::True, 9999)],
                )
            },
            Row {
                allowed: 0,
                recheck: Some(100),
                ..row(
                    "not ready for less than the timeout: healthy, but it counts toward maxUnhealthy; look again when it runs out",
                    spec(None),
                    vec![node_ready(machine("a", MD), ConditionStatus::False, 200)],
                )
            },
            Row {
                unhealthy: &["a", "b"],
                remediate: &["a", "b"],
                allowed: 1,
                ..row(
                    "not ready past the timeout, and a failed machine: both marked for their owners",
                    spec(None),
                    vec![
                        node_ready(machine("a", MD), ConditionStatus::False, 300),
                        failed(machine("b", Some(Kind::MachinePool))),
                        machine("c", MD),
                    ],
                )
            },
            Row {
                unhealthy: &["b"],
                remediate: &["b"],
                allowed: 0,
                recheck: Some(200),
                ..row(
                    "Unknown has its own timeout",
                    spec(None),
                    vec![
                        node_ready(machine("a", MD), ConditionStatus::Unknown, 400),
                        node_ready(machine("b", MD), ConditionStatus::Unknown, 601),
                    ],
                )
            },
            Row {
                unhealthy: &["lone"],
                allowed: 1,
                ..row(
                    "a machine nobody replaces is marked, never remediated",
                    spec(None),
                    vec![failed(machine("lone", None)), machine("b", MD)],
                )
            },
            Row {
                unhealthy: &["a", "b"],
                remediate: &["a", "b"],
                ..row(
                    "40% of 5 is 2: two unhealthy may be remediated, none more",
                    spec(Some(Str("40%".into()))),
                    vec![
                        failed(machine("a", MD)),
                        failed(machine("b", MD)),
                        machine("c", MD),
                        machine("d", MD),
                        machine("e", MD),
                    ],
                )
            },
            Row {
                unhealthy: &["a", "b"],
                short: true,
                ..row(
                    "40% of 4 rounds down to 1: two unhealthy is too many",
                    spec(Some(Str("40%".into()))),
                    vec![failed(machine("a", MD)), failed(machine("b", MD)), machine("c", MD), machine("d", MD)],
                )
            },
            Row {
                unhealthy: &["a"],
                short: true,
                recheck: Some(299),
                ..row(
                    "3 of 5 Nodes down at once, one of them just past its timeout: the short circuit holds before the others' timeouts run out",
                    spec(Some(Str("40%".into()))),
                    vec![
                        node_ready(machine("a", MD), ConditionStatus::False, 300),
                        node_ready(machine("b", MD), ConditionStatus::False, 1),
                        node_ready(machine("c", MD), ConditionStatus::False, 1),
                        machine("d", MD),
                        machine("e", MD),
                    ],
                )
            },
            Row {
                unhealthy: &["a"],
                short: true,
                ..row("maxUnhealthy 0 stops every remediation", spec(Some(Int(0))), vec![failed(machine("a", MD)), machine("b", MD)])
            },
            Row {
                unhealthy: &["b"],
                remediate: &["b"],
                ..row(
                    "machines being deleted are not checked",
                    spec(Some(Int(1))),
                    vec![deleting(failed(machine("a", MD))), failed(machine("b", MD)), machine("c", MD)],
                )
            },
            Row {
                unhealthy: &["a"],
                allowed: 1,
                ..row("Observe: marked, never remediated", observe, vec![failed(machine("a", MD)), machine("b", MD)])
            },
            Row {
                allowed: 1,
                ..row(
                    "skip-remediation: not checked at all",
                    spec(None),
                    vec![annotated(failed(machine("a", MD)), ANNOTATION_SKIP_REMEDIATION), machine("b", MD)],
                )
            },
            Row {
                unhealthy: &["a"],
                remediate: &["a"],
                allowed: 1,
                ..row(
                    "remediate annotation: unhealthy whatever its Node says",
                    spec(None),
                    vec![annotated(machine("a", MD), ANNOTATION_REMEDIATE), machine("b", MD)],
                )
            },
            Row {
                timers_since: Some(now() - chrono::Duration::seconds(60)),
                allowed: 0,
                recheck: Some(240),
                ..row(
                    "after an outage the timer starts over: 500 s NotReady, but only 60 s observed since",
                    spec(None),
                    vec![node_ready(machine("a", MD), ConditionStatus::False, 500)],
                )
            },
        ];
        for r in rows {
            let a = assess(&r.spec, &r.machines, now(), r.timers_since).unwrap();
            let names: Vec<&str> = a.unhealthy.iter().map(|u| u.name.as_str()).collect();
            assert_eq!(names, r.unhealthy, "{}", r.what);
            let remediate: Vec<&str> = a.unhealthy.iter().filter(|u| u.remediate).map(|u| u.name.as_str()).collect();
            assert_eq!(remediate, r.remediate, "{}", r.what);
            assert_eq!(a.remediations_allowed, r.allowed, "{}", r.what);
            assert_eq!(a.short_circuited, r.short, "{}", r.what);
            assert_eq!(a.recheck_after, r.recheck.map(Duration::from_secs), "{}", r.what);
            assert_eq!(a.healthy + a.unhealthy.len() as i64, a.expected, "{}", r.what);
        }
    }

    #[test]
    fn a_machine_that_was_marked_and_is_healthy_again_is_recovered() {
        let machines = vec![was_marked(node_ready(machine("a", MD), ConditionStatus::True, 10)), machine("b", MD)];
        let a = assess(&spec(None), &machines, now(), None).unwrap();
        assert_eq!(a.recovered, ["a"]);
        assert!(a.unhealthy.is_empty());
    }

    #[test]
    fn a_bad_max_unhealthy_is_an_error_not_a_panic() {
        let e = assess(&spec(Some(IntOrPercent::Str("lots".into()))), &[machine("a", MD)], now(), None).unwrap_err();
        assert!(e.starts_with("maxUnhealthy "), "{e}");
    }

    #[test]
    fn a_failure_domain_down_as_a_whole_does_not_count_toward_max_unhealthy() {
        let zoned = |name: &str, zone: &str| {
            let mut m = machine(name, MD);
            m.spec.failure_domain = Some(zone.into());
            m
        };
        let mut machines: Vec<Machine> =
            ["a", "b", "c"].iter().flat_map(|z| (0..3).map(move |i| zoned(&format!("{z}{i}"), z))).collect();
        for m in &mut machines[6..] {
            *m = node_ready(m.clone(), ConditionStatus::Unknown, 700);
        }
        let a = assess(&spec(Some(IntOrPercent::Int(1))), &machines, now(), None).unwrap();
        assert!(!a.short_circuited, "{a:?}");
        assert_eq!((a.domain_outages.clone(), a.outside), (vec!["web/c: 3 machine(s)".to_string()], 3));
        assert!(a.unhealthy.iter().all(|u| u.remediate), "the owner may replace them elsewhere");
        // One more down in another zone: a node outage on top, within maxUnhealthy 1.
        machines[0] = node_ready(machines[0].clone(), ConditionStatus::Unknown, 700);
        let a = assess(&spec(Some(IntOrPercent::Int(1))), &machines, now(), None).unwrap();
        assert!(!a.short_circuited);
        // Without failure domains the same machines trip the short circuit.
        for m in &mut machines {
            m.spec.failure_domain = None;
        }
        let a = assess(&spec(Some(IntOrPercent::Int(1))), &machines, now(), None).unwrap();
        assert!(a.short_circuited);
        assert!(a.domain_outages.is_empty());
    }
}
