//! MachineHealthCheck decisions (Cluster API's, simplified): which checked Machines are
//! unhealthy, whether `maxUnhealthy` lets them be remediated, which are, and when to look again.
//!
//! A Machine is unhealthy when its phase is `Failed`, or when its Node's `Ready` condition (the
//! Machine's `NodeReady` condition) has had an `unhealthyConditions` status for at least its
//! timeout. Remediation deletes the Machine; only Machines owned by a MachineDeployment or a
//! MachinePool are remediated, since their owner replaces them (through the usual drain).
//! While more Machines are unhealthy than `maxUnhealthy` allows, none is (a short circuit: a
//! zone outage must not delete the whole fleet).

use std::time::Duration;

use crate::resources::{condition, ConditionType, Kind, Machine, MachineHealthCheckSpec, Phase, Time};

/// A checked Machine found unhealthy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unhealthy {
    /// The Machine's name.
    pub name: String,
    /// Why, in words.
    pub why: String,
    /// Whether an owner replaces it (a MachineDeployment or MachinePool controls it).
    pub replaceable: bool,
}

/// What a health check found and decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assessment {
    /// Machines checked (not being deleted).
    pub expected: i64,
    /// Of those, the healthy ones.
    pub healthy: i64,
    /// The unhealthy ones, in name order.
    pub unhealthy: Vec<Unhealthy>,
    /// `maxUnhealthy` resolved against `expected`.
    pub max_unhealthy: i64,
    /// `max_unhealthy` minus the unhealthy, at least 0.
    pub remediations_allowed: i64,
    /// More unhealthy than `max_unhealthy`: nothing is remediated.
    pub short_circuited: bool,
    /// The Machines to delete now, in name order.
    pub remediate: Vec<String>,
    /// When a healthy Machine's unhealthy condition times out, if one is running.
    pub recheck_after: Option<Duration>,
}

/// Assesses `machines` (the selector's, in the health check's namespace) at `now`.
///
/// # Errors
/// A `maxUnhealthy` that is neither an integer ≥ 0 nor a percentage.
pub fn assess(spec: &MachineHealthCheckSpec, machines: &[Machine], now: Time) -> Result<Assessment, String> {
    let mut checked: Vec<&Machine> = machines.iter().filter(|m| !m.is_deleting()).collect();
    checked.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let mut unhealthy = Vec::new();
    let mut recheck_after: Option<Duration> = None;
    for m in &checked {
        match health(spec, m, now) {
            Health::Healthy { recheck } => {
                recheck_after = match (recheck_after, recheck) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                }
            }
            Health::Unhealthy(why) => unhealthy.push(Unhealthy {
                name: m.metadata.name.clone(),
                why,
                replaceable: matches!(m.owner(), Some((Kind::MachineDeployment | Kind::MachinePool, _))),
            }),
        }
    }
    let expected = checked.len() as i64;
    let max_unhealthy = spec.max_unhealthy.resolve(expected, false).map_err(|why| format!("maxUnhealthy {why}"))?;
    let count = unhealthy.len() as i64;
    let short_circuited = count > max_unhealthy;
    let remediate = if short_circuited {
        Vec::new()
    } else {
        unhealthy.iter().filter(|u| u.replaceable).map(|u| u.name.clone()).collect()
    };
    Ok(Assessment {
        expected,
        healthy: expected - count,
        unhealthy,
        max_unhealthy,
        remediations_allowed: (max_unhealthy - count).max(0),
        short_circuited,
        remediate,
        recheck_after,
    })
}

enum Health {
    /// Healthy; `recheck`: when a condition that holds now would time out.
    Healthy {
        recheck: Option<Duration>,
    },
    Unhealthy(String),
}

fn health(spec: &MachineHealthCheckSpec, m: &Machine, now: Time) -> Health {
    if m.status.phase == Phase::Failed {
        return Health::Unhealthy("its phase is Failed".into());
    }
    let mut recheck: Option<Duration> = None;
    let Some(ready) = condition(&m.status.conditions, ConditionType::NodeReady) else {
        return Health::Healthy { recheck };
    };
    for u in spec.unhealthy_conditions.iter().filter(|u| u.condition_type == "Ready") {
        if ready.status != u.status {
            continue;
        }
        let held = (now - ready.last_transition_time).to_std().unwrap_or_default();
        let timeout = Duration::from_secs(u.timeout_seconds);
        if held >= timeout {
            return Health::Unhealthy(format!(
                "its Node's Ready condition has been {} for {}s (timeout {}s)",
                u.status,
                held.as_secs(),
                u.timeout_seconds
            ));
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
            m.metadata.owner_references.push(OwnerReference {
                api_version: API_VERSION.into(),
                kind: kind.as_str().into(),
                name: "web".into(),
                uid: "u".into(),
                controller: true,
            });
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
        }
    }

    const MD: Option<Kind> = Some(Kind::MachineDeployment);

    #[test]
    fn decisions_over_situations() {
        use IntOrPercent::{Int, Str};
        struct Row {
            what: &'static str,
            max: Option<IntOrPercent>,
            machines: Vec<Machine>,
            unhealthy: &'static [&'static str],
            remediate: &'static [&'static str],
            allowed: i64,
            short: bool,
            recheck: Option<u64>,
        }
        let rows = vec![
            Row {
                what: "all healthy: nothing to do, nothing to wait for",
                max: None,
                machines: vec![machine("a", MD), node_ready(machine("b", MD), ConditionStatus::True, 9999)],
                unhealthy: &[],
                remediate: &[],
                allowed: 2,
                short: false,
                recheck: None,
            },
            Row {
                what: "not ready for less than the timeout: healthy, look again when it runs out",
                max: None,
                machines: vec![node_ready(machine("a", MD), ConditionStatus::False, 200)],
                unhealthy: &[],
                remediate: &[],
                allowed: 1,
                short: false,
                recheck: Some(100),
            },
            Row {
                what: "not ready past the timeout, and a failed machine: both remediated",
                max: None,
                machines: vec![
                    node_ready(machine("a", MD), ConditionStatus::False, 300),
                    failed(machine("b", Some(Kind::MachinePool))),
                    machine("c", MD),
                ],
                unhealthy: &["a", "b"],
                remediate: &["a", "b"],
                allowed: 1,
                short: false,
                recheck: None,
            },
            Row {
                what: "Unknown has its own timeout",
                max: None,
                machines: vec![
                    node_ready(machine("a", MD), ConditionStatus::Unknown, 400),
                    node_ready(machine("b", MD), ConditionStatus::Unknown, 601),
                ],
                unhealthy: &["b"],
                remediate: &["b"],
                allowed: 1,
                short: false,
                recheck: Some(200),
            },
            Row {
                what: "a machine nobody replaces is reported, not deleted",
                max: None,
                machines: vec![failed(machine("lone", None)), machine("b", MD)],
                unhealthy: &["lone"],
                remediate: &[],
                allowed: 1,
                short: false,
                recheck: None,
            },
            Row {
                what: "40% of 5 is 2: two unhealthy may be remediated, none more",
                max: Some(Str("40%".into())),
                machines: vec![
                    failed(machine("a", MD)),
                    failed(machine("b", MD)),
                    machine("c", MD),
                    machine("d", MD),
                    machine("e", MD),
                ],
                unhealthy: &["a", "b"],
                remediate: &["a", "b"],
                allowed: 0,
                short: false,
                recheck: None,
            },
            Row {
                what: "40% of 4 rounds down to 1: two unhealthy is too many",
                max: Some(Str("40%".into())),
                machines: vec![failed(machine("a", MD)), failed(machine("b", MD)), machine("c", MD), machine("d", MD)],
                unhealthy: &["a", "b"],
                remediate: &[],
                allowed: 0,
                short: true,
                recheck: None,
            },
            Row {
                what: "maxUnhealthy 0 stops every remediation",
                max: Some(Int(0)),
                machines: vec![failed(machine("a", MD)), machine("b", MD)],
                unhealthy: &["a"],
                remediate: &[],
                allowed: 0,
                short: true,
                recheck: None,
            },
            Row {
                what: "machines being deleted are not checked",
                max: Some(Int(1)),
                machines: vec![deleting(failed(machine("a", MD))), failed(machine("b", MD)), machine("c", MD)],
                unhealthy: &["b"],
                remediate: &["b"],
                allowed: 0,
                short: false,
                recheck: None,
            },
        ];
        for r in rows {
            let a = assess(&spec(r.max), &r.machines, now()).unwrap();
            let names: Vec<&str> = a.unhealthy.iter().map(|u| u.name.as_str()).collect();
            assert_eq!(names, r.unhealthy, "{}", r.what);
            assert_eq!(a.remediate, r.remediate, "{}", r.what);
            assert_eq!(a.remediations_allowed, r.allowed, "{}", r.what);
            assert_eq!(a.short_circuited, r.short, "{}", r.what);
            assert_eq!(a.recheck_after, r.recheck.map(Duration::from_secs), "{}", r.what);
            assert_eq!(a.healthy + a.unhealthy.len() as i64, a.expected, "{}", r.what);
        }
    }

    #[test]
    fn a_bad_max_unhealthy_is_an_error_not_a_panic() {
        let e = assess(&spec(Some(IntOrPercent::Str("lots".into()))), &[machine("a", MD)], now()).unwrap_err();
        assert!(e.starts_with("maxUnhealthy "), "{e}");
    }
}
