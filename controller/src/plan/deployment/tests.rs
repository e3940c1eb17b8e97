//! The rollout planner over tables of situations (Cluster API's rollout planner tests are the
//! model), then the maxSurge / maxUnavailable invariants over many random rollouts.

use std::collections::BTreeSet;

use chrono::TimeZone;

use super::*;
use crate::plan::literals::{int, pct};
use crate::plan::member::{StoredMember, ANNOTATION_REPLACING};
use crate::policy::{REASON_CREATION_TIMEOUT, REASON_RETRIES_EXHAUSTED};

fn t0() -> Time {
    chrono::Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0).single().expect("a valid time")
}

fn template(image: &str) -> MachineTemplate {
    let mut t = MachineTemplate::default();
    t.spec.class_ref.name = "small".into();
    t.spec.provider_spec = Some(serde_json::json!({ "image": image }));
    t
}

fn old_rev() -> String {
    revision(&template("os-1"))
}

fn new_rev() -> String {
    revision(&template("os-2"))
}

/// A deployment of `replicas` whose spec moved from `os-1` (rolled out, in the history) to
/// `os-2`.
fn deployment(replicas: i64) -> MachineDeployment {
    let spec = MachineDeploymentSpec {
        replicas,
        autoscaling: None,
        target_cluster: None,
        template: template("os-2"),
        strategy: Strategy::default(),
        delete_policy: DeletePolicy::Oldest,
        progress_deadline_seconds: 600,
        failure_budget: 3,
        max_concurrent_replacements: Some(2),
        remediation: RemediationSpec::default(),
        disruption: DisruptionSpec::default(),
        creation_timeout_seconds: 1200,
        health_timeout_seconds: 600,
        min_ready_seconds: 0,
        node_startup_timeout_seconds: 600,
        drain_timeout_seconds: 3600,
        volume_detach_timeout_seconds: 600,
        paused: false,
        failure_domains: Vec::new(),
        rebalance: Rebalance::default(),
        failure_domain_backoff: FailureDomainBackoff::default(),
    };
    let mut md = MachineDeployment {
        api_version: API_VERSION.into(),
        kind: "MachineDeployment".into(),
        metadata: ObjectMeta { name: "web".into(), namespace: "default".into(), generation: 2, ..Default::default() },
        spec,
        status: MachineDeploymentStatus::default(),
    };
    md.status.current_revision = old_rev();
    md.status.revision_history = vec![RevisionRecord { revision: old_rev(), template: template("os-1") }];
    md
}

fn surge(mut md: MachineDeployment, surge: IntOrPercent, unavailable: IntOrPercent) -> MachineDeployment {
    md.spec.strategy.rolling_update = RollingUpdate { max_surge: surge, max_unavailable: unavailable, canary: None };
    md
}

/// A fixture: `Fx::new("a")` is a Running machine of the new revision; chain to change it.
#[derive(Clone)]
struct Fx(Machine);

impl Fx {
    fn new(name: &str) -> Self {
        let mut m = Machine::new("default", name, MachineSpec::default());
        m.metadata.uid = format!("uid-{name}");
        m.metadata.labels.insert(LABEL_REVISION.into(), new_rev());
        m.status.phase = Phase::Running;
        m.metadata.creation_timestamp = Some(t0());
        Fx(m)
    }
    fn old(mut self) -> Self {
        self.0.metadata.labels.insert(LABEL_REVISION.into(), old_rev());
        self
    }
    fn phase(mut self, p: Phase) -> Self {
        self.0.status.phase = p;
        self
    }
    /// Created `secs` seconds after t0 (older machines have smaller values).
    fn at(mut self, secs: i64) -> Self {
        self.0.metadata.creation_timestamp = Some(t0() + chrono::Duration::seconds(secs));
        self
    }
    fn failed(mut self, code: &str, reason: &str) -> Self {
        self.0.status.phase = Phase::Failed;
        self.0.status.failure = Some(Failure {
            code: code.into(),
            reason: reason.into(),
            message: "it failed".into(),
            generation: 1,
            class_generation: 1,
        });
        self
    }
    fn terminating(mut self) -> Self {
        self.0.metadata.deletion_timestamp = Some(t0());
        self.0.status.phase = Phase::Terminating;
        self
    }
    fn replacing(mut self) -> Self {
        self.0.metadata.annotations.insert(ANNOTATION_REPLACING.into(), "true".into());
        self.terminating()
    }
    /// Taken for remediation by its owner (marked), still here.
    fn remediating(mut self) -> Self {
        self.0.metadata.annotations.insert(ANNOTATION_DISRUPTION.into(), "Remediation".into());
        self
    }
    /// A MachineHealthCheck asks its owner to remediate it.
    fn unhealthy(mut self) -> Self {
        set_condition(
            &mut self.0.status.conditions,
            ConditionType::OwnerRemediated,
            false,
            Reason::WaitingForRemediation,
            "",
        );
        self
    }
    fn annotated(mut self, key: &str) -> Self {
        self.0.metadata.annotations.insert(key.into(), "true".into());
        self
    }
    /// Ready since `secs` seconds after t0.
    fn ready_since(mut self, secs: i64) -> Self {
        set_condition(&mut self.0.status.conditions, ConditionType::Ready, true, Reason::Running, "");
        self.0.status.conditions[0].last_transition_time = t0() + chrono::Duration::seconds(secs);
        self
    }
    /// Running, but its Node is NotReady.
    fn node_not_ready(mut self) -> Self {
        set_condition(&mut self.0.status.conditions, ConditionType::NodeReady, false, Reason::NodeNotReady, "");
        self
    }
    fn marked_for_deletion(mut self) -> Self {
        self.0.metadata.annotations.insert(ANNOTATION_DELETE.into(), "true".into());
        self
    }
}

/// The moment plans are made.
fn now() -> Time {
    t0() + chrono::Duration::seconds(60)
}

/// The default pace of remediations: 1 s, doubling up to 5 minutes.
const PACE: (std::time::Duration, std::time::Duration) =
    (std::time::Duration::from_secs(1), std::time::Duration::from_secs(300));

fn run_halted(md: &MachineDeployment, machines: Vec<Fx>, halted: Option<&str>) -> Plan {
    let machines: Vec<Member> = machines.iter().map(|f| Member::from(&f.0)).collect();
    plan_deployment(Observed {
        deployment: md,
        machines: &machines,
        remediation_halted: halted,
        pace: PACE,
        now: now(),
    })
}

/// What a short-circuited health check says.
const HALTED: &str = "MachineHealthCheck web: 3 of 5 machines are unhealthy";

/// Plans with the remediation pace open (`may_remediate`) or closed (a remediation just went).
fn run(md: &MachineDeployment, machines: Vec<Fx>, may_remediate: bool) -> Plan {
    let mut md = md.clone();
    if !may_remediate {
        md.status.disruption.remediation.consecutive = 1;
        md.status.disruption.remediation.not_before = Some(now() + chrono::Duration::seconds(1));
    }
    run_halted(&md, machines, None)
}

fn names(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn condition<'a>(p: &'a Plan, kind: &str) -> (&'a str, &'a str) {
    p.status
        .conditions
        .iter()
        .find(|c| c.condition_type == kind)
        .map(|c| (c.status.as_str(), c.reason.as_str()))
        .unwrap_or(("", ""))
}

/// One row: the situation, then what the planner must do.
struct Row {
    name: &'static str,
    md: MachineDeployment,
    machines: Vec<Fx>,
    may_replace: bool,
    create: usize,
    delete: &'static [&'static str],
    replace: &'static [&'static str],
    /// Machines taken for remediation now (marked).
    mark: &'static [&'static str],
    /// A health check's short circuit halts remediation.
    halted: bool,
    /// Why: every note the planner gives, in order.
    notes: Vec<Note>,
}

fn row(name: &'static str, md: MachineDeployment, machines: Vec<Fx>) -> Row {
    Row {
        name,
        md,
        machines,
        may_replace: true,
        create: 0,
        delete: &[],
        replace: &[],
        mark: &[],
        halted: false,
        notes: Vec::new(),
    }
}

impl Row {
    fn creates(mut self, n: usize) -> Self {
        self.create = n;
        self
    }
    fn deletes(mut self, d: &'static [&'static str]) -> Self {
        self.delete = d;
        self
    }
    fn replaces(mut self, r: &'static [&'static str]) -> Self {
        self.replace = r;
        self
    }
    fn marks(mut self, m: &'static [&'static str]) -> Self {
        self.mark = m;
        self
    }
    fn halted(mut self) -> Self {
        self.halted = true;
        self
    }
    fn paced(mut self) -> Self {
        self.may_replace = false;
        self
    }
    fn because(mut self, notes: Vec<Note>) -> Self {
        self.notes = notes;
        self
    }
}

/// A rollout of the new revision began.
fn started() -> Note {
    Note::RolloutStarted { revision: new_rev() }
}

fn surge_exhausted(limit: i64, current: i64, wanted: i64) -> Note {
    Note::SurgeExhausted { limit, current, wanted }
}

/// Old machines held by `maxUnavailable`.
fn waiting(held: i64, available: i64, min_available: i64, new_unavailable: i64) -> Note {
    Note::Held {
        reason: DisruptionReason::Rollout,
        machines: held,
        hold: Hold::MaxUnavailable { available, min_available, new_unavailable },
    }
}

/// Remediations held by the pace.
fn paced(machines: i64) -> Note {
    Note::Held {
        reason: DisruptionReason::Remediation,
        machines,
        hold: Hold::Paced { until: now() + chrono::Duration::seconds(1) },
    }
}

fn remediating(names: &[&str]) -> Note {
    Note::Remediating { machines: names.iter().map(|n| n.to_string()).collect() }
}

fn above(machines: i64, replicas: i64) -> Note {
    Note::AboveReplicas { machines, replicas }
}

fn paused(mut md: MachineDeployment) -> MachineDeployment {
    md.spec.paused = true;
    md
}

fn in_place(mut md: MachineDeployment, max_unavailable: i64) -> MachineDeployment {
    md.spec.strategy.strategy_type = StrategyType::InPlace;
    md.spec.strategy.in_place.max_unavailable = int(max_unavailable);
    md
}

/// The spec's revision (os-2) failed before.
fn bad_spec(mut md: MachineDeployment) -> MachineDeployment {
    md.status.bad_revisions.push(BadRevision { revision: new_rev(), reason: "3 failed".into(), time: t0() });
    md
}

fn settled(md: MachineDeployment) -> MachineDeployment {
    let mut md = md;
    md.status.current_revision = new_rev();
    md
}

#[test]
fn the_planner_decides_creates_deletes_and_replacements() {
    let rows = vec![
        // ---- scale up / down (nothing to roll out)
        row("scale up from zero", settled(deployment(3)), vec![]).creates(3),
        row(
            "scale up by two",
            settled(deployment(5)),
            vec![Fx::new("a").at(1), Fx::new("b").at(2), Fx::new("c").at(3)],
        )
        .creates(2),
        row(
            "scale down removes the oldest",
            settled(deployment(2)),
            vec![Fx::new("a").at(3), Fx::new("b").at(1), Fx::new("c").at(2), Fx::new("d").at(4)],
        )
        .deletes(&["b", "c"])
        .because(vec![above(4, 2)]),
        row("scale down to zero", settled(deployment(0)), vec![Fx::new("a").at(1), Fx::new("b").at(2)])
            .deletes(&["a", "b"])
            .because(vec![above(2, 0)]),
        row("steady: nothing to do", settled(deployment(2)), vec![Fx::new("a"), Fx::new("b")])
            .because(vec![Note::Complete { revision: new_rev() }]),
        row(
            "machines being created are not created again",
            settled(deployment(3)),
            vec![Fx::new("a").phase(Phase::Creating), Fx::new("b").phase(Phase::Pending), Fx::new("c")],
        ),
        // ---- rolling update, ints
        row(
            "surge 1 / unavailable 0: one new machine first, no old one goes yet",
            surge(deployment(3), int(1), int(0)),
            vec![Fx::new("o1").old().at(1), Fx::new("o2").old().at(2), Fx::new("o3").old().at(3)],
        )
        .creates(1)
        .because(vec![started(), surge_exhausted(4, 3, 3), waiting(3, 3, 3, 0)]),
        row(
            "surge 1 / unavailable 0: the new machine runs, the oldest old one goes",
            surge(deployment(3), int(1), int(0)),
            vec![Fx::new("o1").old().at(1), Fx::new("o2").old().at(2), Fx::new("o3").old().at(3), Fx::new("n1")],
        )
        .deletes(&["o1"])
        .because(vec![started(), surge_exhausted(4, 4, 2), waiting(2, 4, 3, 0)]),
        row(
            "surge 1 / unavailable 0: an unready new machine holds the old ones",
            surge(deployment(3), int(1), int(0)),
            vec![Fx::new("o1").old(), Fx::new("o2").old(), Fx::new("o3").old(), Fx::new("n1").phase(Phase::Creating)],
        )
        .because(vec![started(), surge_exhausted(4, 4, 2), waiting(3, 3, 3, 1)]),
        row(
            "surge 0 / unavailable 1: delete first, then create",
            surge(deployment(3), int(0), int(1)),
            vec![Fx::new("o1").old().at(1), Fx::new("o2").old().at(2), Fx::new("o3").old().at(3)],
        )
        .deletes(&["o1"])
        .because(vec![started(), surge_exhausted(3, 3, 3), waiting(2, 3, 2, 0)]),
        row(
            "surge 0 / unavailable 1: the terminating machine still counts toward the surge",
            surge(deployment(3), int(0), int(1)),
            vec![Fx::new("o1").old().terminating(), Fx::new("o2").old(), Fx::new("o3").old()],
        )
        .because(vec![started(), surge_exhausted(3, 3, 3), waiting(2, 2, 2, 0)]),
        row(
            "surge 0 / unavailable 1: once it is gone, its replacement is created",
            surge(deployment(3), int(0), int(1)),
            vec![Fx::new("o2").old(), Fx::new("o3").old()],
        )
        .creates(1)
        .because(vec![started(), surge_exhausted(3, 2, 3), waiting(2, 2, 2, 0)]),
        row(
            "surge 2 / unavailable 2",
            surge(deployment(4), int(2), int(2)),
            vec![
                Fx::new("o1").old().at(1),
                Fx::new("o2").old().at(2),
                Fx::new("o3").old().at(3),
                Fx::new("o4").old().at(4),
            ],
        )
        .creates(2)
        .deletes(&["o1", "o2"])
        .because(vec![started(), surge_exhausted(6, 4, 4), waiting(2, 4, 2, 0)]),
        // ---- rolling update, percents (surge rounds up, unavailable down; both 0 → 1)
        row(
            "25% / 25% of 10 is 3 up and 2 down",
            surge(deployment(10), pct("25%"), pct("25%")),
            (0..10).map(|i| Fx::new(&format!("o{i}")).old().at(i)).collect(),
        )
        .creates(3)
        .deletes(&["o0", "o1"])
        .because(vec![started(), surge_exhausted(13, 10, 10), waiting(8, 10, 8, 0)]),
        row(
            "10% / 10% of 4 is 1 up and 0 down",
            surge(deployment(4), pct("10%"), pct("10%")),
            (0..4).map(|i| Fx::new(&format!("o{i}")).old().at(i)).collect(),
        )
        .creates(1)
        .because(vec![started(), surge_exhausted(5, 4, 4), waiting(4, 4, 4, 0)]),
        row(
            "0% / 0% means one unavailable",
            surge(deployment(4), pct("0%"), pct("0%")),
            (0..4).map(|i| Fx::new(&format!("o{i}")).old().at(i)).collect(),
        )
        .deletes(&["o0"])
        .because(vec![started(), surge_exhausted(4, 4, 4), waiting(3, 4, 3, 0)]),
        row(
            "50% / 0 of 3 rounds the surge up to 2",
            surge(deployment(3), pct("50%"), int(0)),
            (0..3).map(|i| Fx::new(&format!("o{i}")).old().at(i)).collect(),
        )
        .creates(2)
        .because(vec![started(), surge_exhausted(5, 3, 3), waiting(3, 3, 3, 0)]),
        // ---- rollouts with failing machines
        row(
            "a failed new machine is replaced, within the surge",
            surge(deployment(3), int(1), int(0)),
            vec![
                Fx::new("o1").old(),
                Fx::new("o2").old(),
                Fx::new("o3").old(),
                Fx::new("n1").failed("Internal", "CLOUD_OPERATION_FAILED"),
            ],
        )
        .marks(&["n1"])
        .replaces(&["n1"])
        .because(vec![started(), remediating(&["n1"]), surge_exhausted(4, 4, 3), waiting(3, 3, 3, 1)]),
        row(
            "replacements wait for the pace",
            surge(deployment(3), int(1), int(0)),
            vec![
                Fx::new("o1").old(),
                Fx::new("o2").old(),
                Fx::new("o3").old(),
                Fx::new("n1").failed("Internal", "CLOUD_OPERATION_FAILED"),
            ],
        )
        .paced()
        .because(vec![started(), surge_exhausted(4, 4, 2), paced(1), waiting(3, 3, 3, 1)]),
        row(
            "remediations are capped by maxConcurrentReplacements (2, one in flight); the surge lets the replacement come first",
            settled(deployment(4)),
            vec![
                Fx::new("a").failed("Internal", "CLOUD_OPERATION_FAILED").at(1),
                Fx::new("b").failed("Internal", "CLOUD_OPERATION_FAILED").at(2),
                Fx::new("c").failed("InvalidArgument", "INVALID_PROVIDER_SPEC").at(3),
                Fx::new("d").replacing(),
            ],
        )
        .creates(1)
        .marks(&["a"])
        .because(vec![
            remediating(&["a"]),
            surge_exhausted(5, 4, 2),
            Note::AwaitingReplacement { machines: 1 },
            Note::Held {
                reason: DisruptionReason::Remediation,
                machines: 2,
                hold: Hold::MaxInFlight { in_flight: 2, max: 2 },
            },
        ]),
        row(
            "a failed old machine is remediated too: its replacement first, within the surge",
            surge(deployment(2), int(1), int(0)),
            vec![Fx::new("o1").old().failed("Unavailable", "HEALTH_TIMEOUT"), Fx::new("o2").old()],
        )
        .creates(1)
        .marks(&["o1"])
        .because(vec![
            started(),
            remediating(&["o1"]),
            surge_exhausted(3, 2, 2),
            Note::AwaitingReplacement { machines: 1 },
            waiting(1, 1, 2, 0),
        ]),
        row(
            "its replacement is up: it goes, and is not deleted twice",
            surge(deployment(2), int(1), int(0)),
            vec![Fx::new("o1").old().failed("Unavailable", "HEALTH_TIMEOUT").remediating(), Fx::new("o2").old(), Fx::new("n1")],
        )
        .replaces(&["o1"])
        .because(vec![started(), surge_exhausted(3, 3, 1), waiting(1, 2, 2, 0)]),
        row(
            "a machine a health check marked is remediated like a failed one",
            settled(deployment(2)),
            vec![Fx::new("a").at(1), Fx::new("u").node_not_ready().unhealthy().at(2)],
        )
        .creates(1)
        .marks(&["u"])
        .because(vec![remediating(&["u"]), Note::AwaitingReplacement { machines: 1 }]),
        row(
            "skip-remediation keeps a failed machine; remediate asks for a healthy one",
            settled(deployment(2)),
            vec![
                Fx::new("kept").failed("Internal", "CLOUD_OPERATION_FAILED").annotated(ANNOTATION_SKIP_REMEDIATION).at(1),
                Fx::new("asked").annotated(ANNOTATION_REMEDIATE).at(2),
            ],
        )
        .creates(1)
        .marks(&["asked"])
        .because(vec![remediating(&["asked"]), Note::AwaitingReplacement { machines: 1 }]),
        row(
            "a health check's short circuit halts remediation, failed machines included",
            settled(deployment(2)),
            vec![Fx::new("a").at(1), Fx::new("f").failed("Internal", "CLOUD_OPERATION_FAILED").at(2)],
        )
        .halted()
        .because(vec![Note::Held {
            reason: DisruptionReason::Remediation,
            machines: 1,
            hold: Hold::ShortCircuit { by: HALTED.into() },
        }]),
        row(
            "a failed machine goes first when scaling down",
            settled(deployment(2)),
            vec![
                Fx::new("a").at(1),
                Fx::new("b").at(2),
                Fx::new("f").failed("Internal", "CLOUD_OPERATION_FAILED").at(3),
            ],
        )
        .paced()
        .deletes(&["f"])
        .because(vec![above(3, 2), paced(1)]),
        // ---- deletion priority
        row(
            "deletion priority: annotated, failed, unknown, creating, updating, then the oldest",
            settled(deployment(1)),
            vec![
                Fx::new("running-old").at(1),
                Fx::new("running-young").at(9),
                Fx::new("updating").phase(Phase::Updating).at(2),
                Fx::new("creating").phase(Phase::Creating).at(3),
                Fx::new("unknown").phase(Phase::Unknown).at(4),
                Fx::new("annotated").marked_for_deletion().at(5),
            ],
        )
        .deletes(&["annotated", "unknown", "creating", "updating", "running-old"])
        .because(vec![above(6, 1)]),
        row(
            "old machines go by the same priority, within maxUnavailable",
            surge(deployment(3), int(0), int(1)),
            vec![
                Fx::new("o-running").old().at(1),
                Fx::new("o-unknown").old().phase(Phase::Unknown).at(5),
                Fx::new("o-creating").old().phase(Phase::Creating).at(6),
            ],
        )
        .deletes(&["o-unknown"])
        .because(vec![started(), surge_exhausted(3, 3, 3), waiting(2, 1, 2, 0)]),
        // ---- decisions the rows above do not reach
        row(
            "minReadySeconds: a new machine Ready for too short a time holds the old ones",
            {
                let mut md = surge(deployment(2), int(1), int(0));
                md.spec.min_ready_seconds = 30;
                md
            },
            vec![Fx::new("o1").old(), Fx::new("o2").old(), Fx::new("n1").ready_since(50)],
        )
        .because(vec![started(), surge_exhausted(3, 3, 1), waiting(2, 2, 2, 1)]),
        row(
            "paused: nothing is created and no old machine goes",
            paused(surge(deployment(2), int(1), int(0))),
            vec![Fx::new("o1").old(), Fx::new("o2").old()],
        )
        .because(vec![started(), Note::Paused]),
        row(
            "paused: the excess of the target revision still goes",
            paused(settled(deployment(1))),
            vec![Fx::new("a").at(1), Fx::new("b").at(2)],
        )
        .deletes(&["a"])
        .because(vec![Note::Paused, above(2, 1)]),
        row(
            "in place: old machines are converted, only missing ones created; the missing one is unavailable too",
            in_place(deployment(3), 2),
            vec![Fx::new("o1").old(), Fx::new("o2").old().phase(Phase::Updating)],
        )
        .creates(1)
        .because(vec![
            started(),
            Note::InPlace { candidates: 1, allowed: 0 },
            Note::Held {
                reason: DisruptionReason::InPlaceUpdate,
                machines: 1,
                hold: Hold::MaxUnavailable { available: 1, min_available: 1, new_unavailable: 0 },
            },
        ]),
        row(
            "in place: a scale-down removes old machines, nothing waits for availability",
            in_place(deployment(1), 1),
            vec![Fx::new("o1").old().at(1), Fx::new("o2").old().at(2)],
        )
        .deletes(&["o1"])
        .because(vec![started(), Note::InPlace { candidates: 1, allowed: 1 }]),
        row(
            "a bad spec revision: the last good one is rolled back to",
            bad_spec(surge(deployment(2), int(1), int(0))),
            vec![Fx::new("o1").old(), Fx::new("n1")],
        )
        .creates(1)
        .because(vec![
            Note::RollingBack { bad: new_rev(), to: old_rev() },
            Note::RolloutStarted { revision: old_rev() },
            waiting(1, 2, 2, 0),
        ]),
        row(
            "a bad spec revision and no good one: nothing is created, the excess goes",
            {
                let mut md = bad_spec(deployment(1));
                md.status.revision_history.clear();
                md
            },
            vec![Fx::new("n1").at(1), Fx::new("n2").at(2)],
        )
        .deletes(&["n1"])
        .because(vec![Note::NoGoodRevision { revision: new_rev() }, started(), above(2, 1)]),
    ];
    for r in rows {
        let plan = |md: &MachineDeployment, machines: Vec<Fx>| {
            if r.halted {
                run_halted(md, machines, Some(HALTED))
            } else {
                run(md, machines, r.may_replace)
            }
        };
        let stored: Vec<Fx> = r
            .machines
            .iter()
            .map(|f| {
                if r.mark.contains(&f.0.metadata.name.as_str()) {
                    Fx(f.0.clone()).remediating()
                } else {
                    Fx(f.0.clone())
                }
            })
            .collect();
        let p = plan(&r.md, r.machines);
        assert!(!p.aborted, "{}", r.name);
        let marked: Vec<&str> = p.mark.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(marked, r.mark, "{}: marked for remediation", r.name);
        assert_eq!(p.notes, r.notes, "{}: notes", r.name);
        // A plan that marks does nothing else; the next one, on the stored marks, acts.
        let acted = if p.mark.is_empty() {
            p
        } else {
            let acts = (p.create, p.delete.len(), p.remediate.len(), p.in_place.is_some());
            assert_eq!(acts, (0, 0, 0, false), "{}: a plan that marks does nothing else", r.name);
            let mut md = r.md.clone();
            md.status = p.status;
            let next = plan(&md, stored);
            assert!(next.mark.is_empty(), "{}: marked once: {:?}", r.name, next.mark);
            next
        };
        assert_eq!(acted.create, r.create, "{}: creates", r.name);
        assert_eq!(names(&acted.delete), r.delete, "{}: deletes", r.name);
        assert_eq!(names(&acted.remediate), r.replace, "{}: replacements", r.name);
    }
}

/// The escape of a mark lost to a conflicting write: a plan that marks does nothing else, so a
/// mark that does not land leaves no replacement behind (and no machine one too many for the
/// next plan to remove as a scale-down). The next plan over the same machines decides again; once
/// the mark is stored, the replacement comes, and the machine goes as a remediation.
#[test]
fn a_plan_that_marks_does_nothing_else_so_a_lost_mark_leaves_nothing_behind() {
    let md = settled(surge(deployment(3), int(1), int(0)));
    let machines = || vec![Fx::new("a").at(1), Fx::new("b").at(2), Fx::new("f").failed("Internal", "X").at(3)];
    let p = run(&md, machines(), true);
    assert_eq!(p.mark, [("f".to_string(), Remediation::Failed)]);
    assert_eq!((p.create, p.delete.len(), p.remediate.len()), (0, 0, 0));
    assert!(!p.settled);
    assert_eq!(p.status.disruption.remediation.in_flight, 1, "counted in flight from the mark on");
    // The mark lost (nothing of that plan written): the same machines, the same decision.
    let again = run(&md, machines(), true);
    assert_eq!((again.mark, again.create, again.delete), (p.mark.clone(), 0, Vec::new()));
    // The mark stored: its replacement is created, nothing removed yet (replace before remove).
    let mut md = md;
    md.status = p.status;
    let marked =
        || vec![Fx::new("a").at(1), Fx::new("b").at(2), Fx::new("f").failed("Internal", "X").at(3).remediating()];
    let p = run(&md, marked(), true);
    assert!(p.mark.is_empty());
    assert_eq!((p.create, p.delete.len(), p.remediate.len()), (1, 0, 0));
    // Its replacement up: the machine goes, as the remediation it is.
    md.status = p.status;
    let mut with_replacement = marked();
    with_replacement.push(Fx::new("r").at(4));
    let p = run(&md, with_replacement, true);
    assert_eq!((names(&p.remediate), p.create, p.delete.len()), (vec!["f"], 0, 0));
}

#[test]
fn newest_and_random_policies_order_the_rest() {
    let mut md = settled(deployment(1));
    md.spec.delete_policy = DeletePolicy::Newest;
    let p = run(&md, vec![Fx::new("a").at(1), Fx::new("b").at(3), Fx::new("c").at(2)], true);
    assert_eq!(names(&p.delete), ["b", "c"]);
    // Random is stable for the same machines (a hash of their UIDs), failed ones still first.
    md.spec.delete_policy = DeletePolicy::Random;
    let machines = || vec![Fx::new("a"), Fx::new("b"), Fx::new("c"), Fx::new("f").failed("Internal", "X")];
    let first = run(&md, machines(), false);
    assert_eq!(first.delete.len(), 3);
    assert_eq!(first.delete[0], "f");
    assert_eq!(first.delete, run(&md, machines(), false).delete);
}

#[test]
fn attributable_failures_spend_the_budget_and_abort_with_a_rollback() {
    let mut md = surge(deployment(3), int(1), int(0));
    md.spec.failure_budget = 2;
    let machines = || {
        vec![
            Fx::new("o1").old(),
            Fx::new("o2").old(),
            Fx::new("o3").old(),
            Fx::new("n1").failed("Internal", "CLOUD_OPERATION_FAILED"),
        ]
    };
    // First failure: taken for remediation and counted.
    let p = run(&md, machines(), true);
    assert_eq!(p.mark, [("n1".to_string(), Remediation::Failed)]);
    assert!(p.remediate.is_empty(), "the mark first, alone");
    assert_eq!(p.status.rollout.as_ref().map(|r| r.failures), Some(1));
    assert_eq!(p.events.first().map(|e| e.reason), Some(EventReason::RolloutStarted));
    // Still there, marked: counted once, not again; it goes (no room to replace it first).
    md.status = p.status;
    let marked = || {
        let mut m = machines();
        m[3] = Fx::new("n1").failed("Internal", "CLOUD_OPERATION_FAILED").remediating();
        m
    };
    let p = run(&md, marked(), true);
    assert!(!p.aborted);
    assert_eq!(names(&p.remediate), ["n1"]);
    assert_eq!(p.status.rollout.as_ref().map(|r| r.failures), Some(1));
    // The second reaches the budget: aborted, the revision remembered as bad, nothing else done.
    md.status = p.status;
    let mut two = marked();
    two.push(Fx::new("n2").failed("Internal", "CLOUD_OPERATION_FAILED"));
    let p = run(&md, two, true);
    assert!(p.aborted);
    assert!(p.remediate.is_empty() && p.delete.is_empty() && p.create == 0);
    assert_eq!(p.status.bad_revisions.iter().map(|b| b.revision.clone()).collect::<Vec<_>>(), [new_rev()]);
    assert_eq!(condition(&p, "Progressing"), ("False", "RolloutAborted"));
    assert_eq!(p.events.last().map(|e| e.reason), Some(EventReason::RolloutAborted));
    assert_eq!(p.notes, [Note::RevisionAborted { revision: new_rev(), failures: 2, budget: 2 }]);
    // Then the deployment rolls back: the last good revision is the target, the bad machine goes.
    md.status = p.status;
    let p = run(&md, marked(), true);
    assert!(!p.aborted);
    assert_eq!(p.target_revision, old_rev());
    assert_eq!(names(&p.remediate), ["n1"]);
    assert_eq!(p.notes.first(), Some(&Note::RollingBack { bad: new_rev(), to: old_rev() }));
    // Back on the good revision everywhere: rolled back.
    md.status = p.status;
    let p = run(&md, vec![Fx::new("o1").old(), Fx::new("o2").old(), Fx::new("o3").old()], true);
    assert!(p.settled);
    assert_eq!(condition(&p, "Progressing"), ("True", "RolledBack"));
    assert_eq!(p.status.current_revision, old_rev());
}

#[test]
fn the_environment_and_transient_errors_never_spend_the_budget() {
    let mut md = surge(deployment(3), int(1), int(0));
    md.spec.failure_budget = 1;
    for (code, reason) in [
        ("ResourceExhausted", "QUOTA_EXCEEDED"),
        ("PermissionDenied", "CLOUD_AUTH_FAILED"),
        ("Unavailable", "CLOUD_UNAVAILABLE"),
        ("Internal", REASON_RETRIES_EXHAUSTED),
    ] {
        let p = run(&md, vec![Fx::new("o1").old(), Fx::new("n1").failed(code, reason)], true);
        assert!(!p.aborted, "{code} {reason}");
        assert_eq!(p.mark, [("n1".to_string(), Remediation::Failed)], "{code} {reason}: remediated all the same");
        assert_eq!(p.status.rollout.as_ref().map(|r| r.failures), Some(0), "{code} {reason}");
    }
    for (code, reason) in [("DeadlineExceeded", REASON_CREATION_TIMEOUT), ("InvalidArgument", "FIELD_INVALID")] {
        let p = run(&md, vec![Fx::new("o1").old(), Fx::new("n1").failed(code, reason)], true);
        assert!(p.aborted, "{code} {reason} is the revision's");
    }
}

#[test]
fn a_bad_first_revision_has_nothing_to_roll_back_to() {
    let mut md = deployment(2);
    md.status = MachineDeploymentStatus::default();
    md.spec.failure_budget = 1;
    let p = run(&md, vec![Fx::new("n1").failed("Internal", "CLOUD_OPERATION_FAILED"), Fx::new("n2")], true);
    assert!(p.aborted);
    let message = &p.status.conditions.iter().find(|c| c.reason == "RolloutAborted").expect("aborted").message;
    assert!(message.contains("no earlier revision to roll back to"), "{message}");
    assert!(p.events.iter().all(|e| e.reason != EventReason::RolloutStarted), "a first rollout is no event");
    md.status = p.status;
    let p = run(&md, vec![Fx::new("n2")], true);
    assert!(p.target.is_none());
    assert_eq!(p.create, 0, "nothing is created from a bad revision");
    assert_eq!(condition(&p, "Progressing"), ("False", "NoGoodRevision"));
    assert_eq!(p.notes.first(), Some(&Note::NoGoodRevision { revision: new_rev() }));
    assert_eq!(condition(&p, "Available"), ("False", "BelowMinimum"));
}

#[test]
fn a_complete_rollout_records_the_revision() {
    let md = surge(deployment(2), int(1), int(0));
    let p = run(&md, vec![Fx::new("n1"), Fx::new("n2")], true);
    assert!(p.settled);
    assert_eq!(p.status.current_revision, new_rev());
    assert_eq!(p.status.revision_history.last().map(|r| r.revision.clone()), Some(new_rev()));
    assert_eq!(p.status.revision_history.len(), 2);
    assert_eq!(
        p.events.iter().map(|e| e.reason).collect::<Vec<_>>(),
        [EventReason::RolloutStarted, EventReason::RolloutComplete]
    );
    assert_eq!(condition(&p, "Progressing"), ("True", "NewRevisionAvailable"));
    assert_eq!(p.notes, [started(), Note::Complete { revision: new_rev() }]);
    assert_eq!(condition(&p, "Available"), ("True", "MinimumAvailable"));
    assert_eq!((p.status.replicas, p.status.updated_replicas, p.status.available_replicas), (2, 2, 2));
}

#[test]
fn progress_stalls_past_the_deadline() {
    let mut md = surge(deployment(2), int(1), int(0));
    md.spec.progress_deadline_seconds = 30;
    md.status.rollout = Some(RolloutState { revision: new_rev(), started: t0(), last_progress: t0(), failures: 0 });
    let p = run(&md, vec![Fx::new("o1").old(), Fx::new("o2").old(), Fx::new("n1").phase(Phase::Creating)], true);
    assert_eq!(condition(&p, "Progressing"), ("False", "ProgressDeadlineExceeded"));
    assert_eq!(p.notes.last(), Some(&Note::ProgressDeadlineExceeded { seconds: 30 }));
    md.spec.progress_deadline_seconds = 600;
    let p = run(&md, vec![Fx::new("o1").old(), Fx::new("o2").old(), Fx::new("n1").phase(Phase::Creating)], true);
    assert_eq!(condition(&p, "Progressing"), ("True", "Rolling"));
    assert!(!p.notes.iter().any(|n| matches!(n, Note::ProgressDeadlineExceeded { .. })));
}

#[test]
fn the_progressing_message_says_what_holds_the_deployment_back() {
    let message = |p: &Plan| {
        let c = p.status.conditions.iter().find(|c| c.condition_type == "Progressing").expect("Progressing");
        c.message.clone()
    };
    let md = surge(deployment(2), int(1), int(0));
    let p = run(&md, vec![Fx::new("o1").old(), Fx::new("o2").old(), Fx::new("n1").phase(Phase::Creating)], true);
    assert_eq!(
        message(&p),
        format!(
            "0 of 2 machines on revision {}; 1 machine(s) wanted, 3 of 3 (replicas + maxSurge) exist; \
             2 Rollout held: maxUnavailable: 2 available, 2 required, 1 new not available yet",
            new_rev()
        )
    );
    let p = run(&settled(deployment(2)), vec![Fx::new("a"), Fx::new("b").failed("Internal", "X")], false);
    assert_eq!(
        message(&p),
        "1 of 2 running; 1 Remediation held: remediations are paced: the next at 2030-01-01T00:01:01Z"
    );
    let p = run(&settled(deployment(3)), vec![Fx::new("a"), Fx::new("b")], true);
    assert_eq!(message(&p), "2 of 3 running", "creating within the surge holds nothing back");
}

#[test]
fn a_paused_deployment_creates_and_deletes_nothing_but_its_excess() {
    let mut md = surge(deployment(2), int(1), int(0));
    md.spec.paused = true;
    let p = run(&md, vec![Fx::new("o1").old(), Fx::new("o2").old()], true);
    assert_eq!((p.create, p.delete.len()), (0, 0));
    let p = run(&md, vec![Fx::new("n1").at(1), Fx::new("n2").at(2), Fx::new("n3").at(3)], true);
    assert_eq!(names(&p.delete), ["n1"]);
}

#[test]
fn environment_problems_of_waiting_machines_are_lifted() {
    let md = settled(deployment(2));
    let mut waiting = Fx::new("b").phase(Phase::Pending);
    set_condition(
        &mut waiting.0.status.conditions,
        ConditionType::Ready,
        false,
        Reason::QuotaExceeded,
        "no room (request r-1)",
    );
    let p = run(&md, vec![Fx::new("a"), waiting], true);
    assert_eq!(condition(&p, "QuotaExceeded"), ("True", "QuotaExceeded"));
    assert_eq!(condition(&p, "Available"), ("False", "QuotaExceeded"), "below the minimum, and why");
    let p = run(&md, vec![Fx::new("a"), Fx::new("b")], true);
    assert_eq!(condition(&p, "QuotaExceeded"), ("", ""), "gone once nobody waits");
}

#[test]
fn in_place_converts_old_machines_and_creates_only_missing_ones() {
    let mut md = deployment(3);
    md.spec.strategy.strategy_type = StrategyType::InPlace;
    md.spec.strategy.in_place.max_unavailable = int(2);
    let p = run(
        &md,
        vec![Fx::new("o1").old(), Fx::new("o2").old().phase(Phase::Updating), Fx::new("o3").old().phase(Phase::Failed)],
        false,
    );
    assert_eq!(p.create, 0, "old machines are converted, not replaced: 3 live");
    assert!(p.delete.is_empty());
    let work = p.in_place.expect("in-place work");
    assert_eq!(work.candidates, ["o1"], "only Running old machines are candidates");
    assert_eq!(work.allowed, 0, "one updating and one failed leave 1 of 3 available, and 1 is required");
    // A missing machine is created; a scale-down removes machines, updates never do.
    let p = run(&md, vec![Fx::new("o1").old(), Fx::new("o2").old()], true);
    assert_eq!(p.create, 1);
    let mut smaller = md.clone();
    smaller.spec.replicas = 2;
    let p = run(&smaller, vec![Fx::new("o1").old().at(1), Fx::new("o2").old().at(2), Fx::new("o3").old().at(3)], true);
    assert_eq!(names(&p.delete), ["o1"]);
    assert_eq!(p.in_place.map(|w| w.candidates), Some(vec!["o2".to_string(), "o3".to_string()]), "not the one removed");
    // Nothing old: no in-place work.
    assert!(run(&md, vec![Fx::new("n1"), Fx::new("n2"), Fx::new("n3")], true).in_place.is_none());
}

// ---------------------------------------------------------------------------------------- canary

/// A deployment of `replicas` rolling from os-1 to os-2 with a canary of `machines` and a pause of
/// 30 s (maxSurge 1, maxUnavailable 0 unless changed).
fn with_canary(replicas: i64, machines: IntOrPercent) -> MachineDeployment {
    let mut md = surge(deployment(replicas), int(1), int(0));
    md.spec.strategy.rolling_update.canary = Some(Canary { machines, pause_seconds: 30 });
    md
}

fn canary_of(p: &Plan) -> CanaryStatus {
    p.status.canary.clone().expect("a canary in the status")
}

fn olds(n: usize) -> Vec<Fx> {
    (1..=n).map(|i| Fx::new(&format!("o{i}")).old()).collect()
}

#[test]
fn a_canary_holds_the_rollout_until_its_machines_held_through_the_pause() {
    let md = with_canary(3, int(1));
    // The canary machine is made first; no old machine goes (the surge has room for it).
    let p = run(&md, olds(3), true);
    assert_eq!((p.create, p.delete.len()), (1, 0));
    let k = canary_of(&p);
    assert_eq!((k.revision.as_str(), k.phase, k.wanted), (new_rev().as_str(), CanaryPhase::Progressing, 1));
    assert!(p.notes.contains(&Note::Canary {
        revision: new_rev(),
        phase: CanaryPhase::Progressing,
        ready: 0,
        wanted: 1,
        until: None
    }));
    // Coming up: nothing more is made, nothing old goes.
    let mut md = md;
    md.status = p.status;
    let coming = || {
        let mut m = olds(3);
        m.push(Fx::new("n1").at(10).phase(Phase::Creating));
        m
    };
    let p = run(&md, coming(), true);
    assert_eq!((p.create, p.delete.len()), (0, 0));
    assert_eq!(canary_of(&p).machines, ["n1"]);
    // Running, Ready and healthy: the pause starts; without a canary an old machine would go now.
    let up = || {
        let mut m = olds(3);
        m.push(Fx::new("n1").at(10).ready_since(20));
        m
    };
    let p = run(&md, up(), true);
    assert_eq!((p.create, p.delete.len()), (0, 0), "{:?}", p.notes);
    let k = canary_of(&p);
    assert_eq!(k.phase, CanaryPhase::Pausing);
    assert_eq!(k.ready_since, Some(now()));
    assert_eq!(k.pause_until, Some(now() + chrono::Duration::seconds(30)));
    assert_eq!(p.recheck_at, k.pause_until, "planned again when the pause ends");
    let (status, reason) = condition(&p, "Progressing");
    assert_eq!((status, reason), ("True", "Rolling"));
    let message = &p.status.conditions.iter().find(|c| c.condition_type == "Progressing").unwrap().message;
    assert!(message.contains("canary of revision") && message.contains("Pausing"), "{message}");
    assert!(!message.contains("maxSurge"), "the canary holds, not the surge: {message}");
    // Still pausing (the same start, kept in the status: a restarted controller resumes it).
    md.status = p.status;
    let p = run(&md, up(), true);
    assert_eq!(canary_of(&p).ready_since, Some(now()));
    assert!(p.delete.is_empty());
    // A canary machine's Node NotReady: the pause starts over once it is back.
    let mut sick = up();
    sick[3] = Fx::new("n1").at(10).ready_since(20).node_not_ready();
    let p = run(&md, sick, true);
    let k = canary_of(&p);
    assert_eq!((k.phase, k.ready_since, k.pause_until), (CanaryPhase::Progressing, None, None));
    // The pause over: passed (remembered), and the rollout goes on at its usual pace.
    let k = md.status.canary.as_mut().unwrap();
    k.ready_since = Some(now() - chrono::Duration::seconds(31));
    let p = run(&md, up(), true);
    assert_eq!(canary_of(&p).phase, CanaryPhase::Passed);
    assert!(p.events.iter().any(|e| e.reason == EventReason::CanaryPassed));
    assert_eq!(names(&p.delete), ["o1"], "{:?}", p.notes);
    assert!(p.notes.contains(&Note::CanaryPassed { revision: new_rev() }));
    // Passed stays passed, whatever the canary machines do next.
    md.status = p.status;
    let mut later = up();
    later[3] = Fx::new("n1").at(10).phase(Phase::Creating);
    let p = run(&md, later, true);
    assert_eq!(canary_of(&p).phase, CanaryPhase::Passed);
    assert!(!p.notes.iter().any(|n| matches!(n, Note::Canary { .. })), "{:?}", p.notes);
}

#[test]
fn a_failed_canary_machine_aborts_at_once_touching_only_the_canary() {
    let md = with_canary(3, int(1));
    let p = run(&md, olds(3), true);
    let mut md = md;
    md.status = p.status;
    assert_eq!(md.spec.failure_budget, 3);
    let failed = || {
        let mut m = olds(3);
        m.push(Fx::new("n1").at(10).failed("FailedPrecondition", crate::policy::REASON_NODE_NOT_JOINED));
        m
    };
    // One failure is enough during the canary (the budget is 3 otherwise).
    let p = run(&md, failed(), true);
    assert!(p.aborted);
    assert_eq!(p.status.bad_revisions.iter().map(|b| b.revision.clone()).collect::<Vec<_>>(), [new_rev()]);
    let k = canary_of(&p);
    assert_eq!(k.phase, CanaryPhase::Failed);
    assert!(k.message.contains("canary machine n1") && k.message.contains("NODE_NOT_JOINED"), "{}", k.message);
    assert_eq!(condition(&p, "Progressing"), ("False", "RolloutAborted"));
    assert_eq!(p.notes.last(), Some(&Note::RevisionAborted { revision: new_rev(), failures: 1, budget: 1 }));
    // The rollback: only the canary machine goes (marked first); the old ones stay, nothing is
    // made.
    md.status = p.status;
    let p = run(&md, failed(), true);
    assert_eq!(p.target_revision, old_rev());
    assert_eq!(p.mark, [("n1".to_string(), Remediation::Failed)]);
    md.status = p.status;
    let mut marked = olds(3);
    marked.push(Fx::new("n1").at(10).failed("FailedPrecondition", crate::policy::REASON_NODE_NOT_JOINED).remediating());
    let p = run(&md, marked, true);
    assert_eq!(p.target_revision, old_rev());
    assert_eq!(p.create, 0);
    let touched: Vec<&str> = p.delete.iter().chain(&p.remediate).map(String::as_str).collect();
    assert_eq!(touched, ["n1"]);
    assert_eq!(canary_of(&p).phase, CanaryPhase::Failed, "remembered");
    // A failure that is not the revision's (quota) is replaced, not an abort.
    let md = {
        let mut md = with_canary(3, int(1));
        md.status = run(&md, olds(3), true).status;
        md
    };
    let mut quota = olds(3);
    quota.push(Fx::new("n1").at(10).failed("ResourceExhausted", "QUOTA_EXCEEDED"));
    let p = run(&md, quota, true);
    assert!(!p.aborted);
    assert_eq!(p.mark, [("n1".to_string(), Remediation::Failed)]);
    let mut md = md;
    md.status = p.status;
    let mut quota = olds(3);
    quota.push(Fx::new("n1").at(10).failed("ResourceExhausted", "QUOTA_EXCEEDED").remediating());
    let p = run(&md, quota, true);
    assert!(!p.aborted);
    assert_eq!(names(&p.remediate), ["n1"]);
}

#[test]
fn a_canary_sizes_by_percent_surges_only_as_far_as_it_needs_and_counts_in_place_updates() {
    // 50% of 3 rounds up to 2; with a surge of 1, one old machine makes room for the second.
    let md = with_canary(3, pct("50%"));
    let p = run(&md, olds(3), true);
    assert_eq!(canary_of(&p).wanted, 2);
    assert_eq!(p.create, 1);
    let mut md = md;
    md.status = p.status;
    let mut m = olds(3);
    m.push(Fx::new("n1").at(10).ready_since(20));
    let p = run(&md, m, true);
    assert_eq!((p.create, p.delete.len()), (0, 1), "{:?}", p.notes);
    // maxSurge 0: one old machine goes for the one canary machine, then nothing more.
    let mut md = with_canary(3, int(1));
    md.spec.strategy.rolling_update.max_surge = int(0);
    md.spec.strategy.rolling_update.max_unavailable = int(1);
    let p = run(&md, olds(3), true);
    assert_eq!(p.delete.len(), 1);
    md.status = p.status;
    let mut m = olds(2);
    m.push(Fx::new("n1").at(10).ready_since(20));
    let p = run(&md, m, true);
    assert_eq!((p.create, p.delete.len()), (0, 0), "{:?}", p.notes);
    // InPlace: one machine updated in place is the canary.
    let mut md = in_place(with_canary(3, int(1)), 2);
    let p = run(&md, olds(3), true);
    assert_eq!(p.in_place.as_ref().map(|w| w.allowed), Some(1));
    md.status = p.status;
    let mut m = olds(2);
    m.push(Fx::new("o3").phase(Phase::Updating));
    let p = run(&md, m, true);
    assert_eq!(p.in_place.as_ref().map(|w| w.allowed), Some(0));
    assert_eq!(canary_of(&p).machines, ["o3"]);
}

#[test]
fn no_canary_on_a_first_rollout_a_rollback_or_once_it_is_dropped_and_a_pause_holds_it() {
    // First rollout: nothing to compare with.
    let mut md = with_canary(3, int(1));
    md.status = MachineDeploymentStatus::default();
    let p = run(&md, vec![], true);
    assert_eq!(p.create, 4 - 1, "replicas, within the surge");
    assert!(p.status.canary.is_none());
    // A rollback to the last good revision.
    let md = bad_spec(with_canary(3, int(1)));
    let p = run(&md, vec![Fx::new("o1").old(), Fx::new("o2").old()], true);
    assert_eq!(p.create, 1);
    assert!(p.status.canary.is_none());
    // Paused during the canary: nothing made, the canary recorded.
    let md = paused(with_canary(3, int(1)));
    let p = run(&md, olds(3), true);
    assert_eq!(p.create, 0);
    assert_eq!(canary_of(&p).phase, CanaryPhase::Progressing);
    // The canary taken out of the spec mid-way: dropped, the rollout at its usual pace.
    let mut md = with_canary(3, int(1));
    md.status = run(&md, olds(3), true).status;
    md.spec.strategy.rolling_update.canary = None;
    let mut m = olds(3);
    m.push(Fx::new("n1").at(10).ready_since(20));
    let p = run(&md, m, true);
    assert!(p.status.canary.is_none());
    assert_eq!(names(&p.delete), ["o1"]);
}

// ------------------------------------------------------------------------- invariants (property)

/// A small deterministic generator (xorshift64*): the same seeds give the same cases.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    fn limit(&mut self) -> IntOrPercent {
        match self.below(3) {
            0 => IntOrPercent::Int(self.below(4) as i64),
            1 => IntOrPercent::Str(format!("{}%", self.below(101))),
            _ => IntOrPercent::Str(format!("{}%", [0, 10, 25, 33, 50][self.below(5) as usize])),
        }
    }
}

/// Runs random rollouts to the end: the cloud creates, fails and deletes machines at random
/// between reconciles. Every plan must keep the machines (terminating ones included) within
/// `replicas + maxSurge` once they are, and never take the available machines below
/// `replicas − maxUnavailable` (nor below what there was, when there were fewer).
#[test]
fn rollouts_keep_within_max_surge_and_max_unavailable() {
    for seed in 1..=400u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let replicas = rng.below(12) as i64;
        let mut md = surge(deployment(replicas), rng.limit(), rng.limit());
        md.spec.failure_budget = 1000;
        md.spec.delete_policy =
            [DeletePolicy::Oldest, DeletePolicy::Newest, DeletePolicy::Random][rng.below(3) as usize];
        // A third with a canary (of any size, even one validation refuses; pausing 0-2 s).
        if rng.chance(33) {
            md.spec.strategy.rolling_update.canary =
                Some(Canary { machines: rng.limit(), pause_seconds: rng.below(3) });
        }
        let limits = Limits::resolve(replicas, &md.spec.strategy.rolling_update);
        let start = rng.below(12) as i64;
        let fail_percent = [0, 0, 10, 30][rng.below(4) as usize];
        // Old machines, mostly running; some not (yet, or any more), some already on the new
        // revision.
        let mut machines: Vec<Machine> = (0..start)
            .map(|i| {
                let fx = Fx::new(&format!("o{i}")).at(i);
                let fx = if rng.chance(80) { fx.old() } else { fx };
                match rng.below(10) {
                    0 => fx.phase(Phase::Creating),
                    1 => fx.phase(Phase::Unknown),
                    2 => fx.failed("Internal", "CLOUD_OPERATION_FAILED"),
                    _ => fx,
                }
                .0
            })
            .collect();
        let mut next_name = 0;
        let (mut finished, mut aborted) = (false, false);
        for step in 0..200 {
            let now = t0() + chrono::Duration::seconds(60 + step);
            let members: Vec<Member> = machines.iter().map(Member::from).collect();
            let p = plan_deployment(Observed {
                deployment: &md,
                machines: &members,
                remediation_halted: None,
                pace: PACE,
                now,
            });
            let case = format!("seed {seed} step {step}: replicas {replicas}, {limits:?}, {} machines", machines.len());
            if p.aborted {
                // During a canary the budget is 1.
                assert!(md.spec.strategy.rolling_update.canary.is_some(), "{case}: aborted with an unlimited budget");
                aborted = true;
                break;
            }
            // A canary under way: no more machines of the revision than it wants.
            let under_way = |k: &&CanaryStatus| matches!(k.phase, CanaryPhase::Progressing | CanaryPhase::Pausing);
            if let Some(k) = p.status.canary.as_ref().filter(under_way) {
                let new = members.iter().filter(|m| !m.deleting && m.revision == p.target_revision).count() as i64;
                let after = new + p.create as i64 + p.in_place.as_ref().map_or(0, |w| w.allowed as i64);
                assert!(after <= new.max(k.wanted), "{case}: {new} → {after} machines of a canary of {}", k.wanted);
            }
            let total = machines.len() as i64;
            let cap = replicas + limits.max_surge;
            assert!(total + p.create as i64 <= total.max(cap), "{case}: creates {} over the surge", p.create);
            let gone: BTreeSet<&str> = p.delete.iter().chain(&p.remediate).map(String::as_str).collect();
            assert_eq!(gone.len(), p.delete.len() + p.remediate.len(), "{case}: a machine deleted twice");
            let available_before = members.iter().filter(|m| m.is_available()).count() as i64;
            let available_after =
                members.iter().filter(|m| m.is_available() && !gone.contains(m.name.as_str())).count() as i64;
            let floor = (replicas - limits.max_unavailable).min(available_before);
            assert!(
                available_after >= floor,
                "{case}: {available_before} → {available_after} available, floor {floor}"
            );
            if p.settled && machines.len() as i64 == replicas {
                finished = true;
                break;
            }
            // Act on the plan.
            md.status = p.status;
            for m in machines.iter_mut().filter(|m| p.mark.iter().any(|(n, _)| *n == m.metadata.name)) {
                m.metadata.annotations.insert(ANNOTATION_DISRUPTION.into(), "Remediation".into());
            }
            for m in machines.iter_mut().filter(|m| gone.contains(m.metadata.name.as_str())) {
                m.metadata.deletion_timestamp = Some(now);
            }
            for _ in 0..p.create {
                next_name += 1;
                let mut m = Fx::new(&format!("n{next_name}")).phase(Phase::Pending).at(100 + next_name).0;
                m.metadata.labels.insert(LABEL_REVISION.into(), p.target_revision.clone());
                machines.push(m);
            }
            // The cloud moves on.
            machines.retain(|m| !(m.is_deleting() && rng.chance(60)));
            for m in machines.iter_mut().filter(|m| !m.is_deleting()) {
                if matches!(m.status.phase, Phase::Pending | Phase::Creating | Phase::Unknown) && rng.chance(50) {
                    m.status.phase = if rng.chance(fail_percent) { Phase::Failed } else { Phase::Running };
                    if m.status.phase == Phase::Failed {
                        m.status.failure = Some(Failure {
                            code: "Internal".into(),
                            reason: "CLOUD_OPERATION_FAILED".into(),
                            message: "boom".into(),
                            generation: 1,
                            class_generation: 1,
                        });
                    }
                }
            }
        }
        if fail_percent == 0 && !aborted {
            assert!(finished, "seed {seed}: replicas {replicas}, {limits:?}, start {start}: no convergence");
        }
    }
}

#[test]
fn revisions_follow_the_template() {
    assert_ne!(revision(&template("os-1")), revision(&template("os-2")));
    assert_eq!(revision(&template("os-1")), old_rev());
}

#[test]
fn a_member_keeps_what_the_planner_decides_on_and_why_a_machine_waits() {
    let mut waiting = Fx::new("m1").phase(Phase::Creating).marked_for_deletion().0;
    waiting.metadata.resource_version = "7".into();
    waiting.metadata.labels.insert("team".into(), "x".into());
    set_condition(&mut waiting.status.conditions, ConditionType::UpToDate, false, Reason::Creating, "");
    set_condition(&mut waiting.status.conditions, ConditionType::Ready, false, Reason::QuotaExceeded, "no cores");
    waiting.status.last_operation = Some(LastOperation {
        op_type: OperationType::Create,
        state: OperationState::Failed,
        code: "ResourceExhausted".into(),
        reason: "QUOTA_EXCEEDED".into(),
        message: "quota".into(),
        request_id: "r1".into(),
        time: t0(),
    });
    let m = Member::from(&waiting);
    assert_eq!((m.name.as_str(), m.uid.as_str(), m.resource_version.as_str()), ("m1", "uid-m1", "7"));
    assert_eq!((m.revision, m.created, m.phase), (new_rev(), Some(t0()), Phase::Creating));
    assert!(m.marked_for_deletion && !m.deleting && m.taken.is_none() && m.failure.is_none());
    let w = m.waiting.expect("a creating machine says why it waits");
    assert_eq!(
        (w.reason, w.message.as_str(), w.operation_reason.as_str()),
        (Reason::QuotaExceeded, "no cores", "QUOTA_EXCEEDED")
    );

    let mut creating = Fx::new("m4").phase(Phase::Creating).0;
    set_condition(&mut creating.status.conditions, ConditionType::Ready, false, Reason::Creating, "creating");
    assert!(Member::from(&creating).waiting.is_none(), "a machine being created waits for nothing to report");

    let failed = Member::from(&Fx::new("m2").failed("Internal", "X").replacing().0);
    assert!(failed.deleting && failed.remediating());
    assert_eq!(failed.failure.map(|f| (f.code, f.reason)), Some(("Internal".into(), "X".into())));

    let mut running = Fx::new("m3").0;
    set_condition(&mut running.status.conditions, ConditionType::Ready, true, Reason::Running, "");
    running.metadata.annotations.insert(ANNOTATION_NODE_TEMPLATE.into(), "abc".into());
    running.metadata.annotations.insert(ANNOTATION_DELETE.into(), "false".into());
    let ready_at = running.status.conditions.iter().find(|c| c.condition_type == ConditionType::Ready);
    let ready_at = ready_at.map(|c| c.last_transition_time);
    let m = Member::from(&running);
    assert!(m.waiting.is_none(), "an available machine carries no wait reason");
    assert_eq!((m.ready_since, m.node_template.as_str(), m.marked_for_deletion), (ready_at, "abc", false));
}

#[test]
fn the_member_view_reads_the_label_and_annotations_by_their_constants() {
    // The view names them as literals (serde's renames cannot take a constant).
    let text = serde_json::json!({"metadata": {
        "name": "m",
        "labels": {LABEL_REVISION: "r1"},
        "annotations": {ANNOTATION_REPLACING: "", ANNOTATION_DELETE: "yes", ANNOTATION_NODE_TEMPLATE: "h"},
    }})
    .to_string();
    let m = serde_json::from_str::<StoredMember<'_>>(&text).and_then(StoredMember::into_member).unwrap();
    assert_eq!((m.revision.as_str(), m.node_template.as_str()), ("r1", "h"));
    assert!(m.remediating() && m.marked_for_deletion);
    // The reason is typed: the autoscaler's mark reads as its own, an unknown one as none.
    let taken = |value: &str| {
        let text = serde_json::json!({"metadata": {"name": "m", "annotations": {ANNOTATION_DISRUPTION: value}}});
        let text = text.to_string();
        serde_json::from_str::<StoredMember<'_>>(&text).and_then(StoredMember::into_member).unwrap().taken
    };
    assert_eq!(taken("Autoscaler"), Some(DisruptionReason::Autoscaler));
    assert_eq!(taken("Remediation"), Some(DisruptionReason::Remediation));
    assert_eq!(taken("SomethingNewer"), None);
}

#[test]
fn a_machine_moved_in_place_counts_as_updating_until_its_update_is_applied() {
    let text = |generation: i64, observed: i64, annotated: bool| {
        let annotations = if annotated {
            serde_json::json!({ANNOTATION_IN_PLACE_DISRUPTION: "Reboot"})
        } else {
            serde_json::json!({})
        };
        serde_json::json!({
            "metadata": {"name": "m", "generation": generation, "annotations": annotations},
            "status": {"phase": "Running", "observedGeneration": observed},
        })
        .to_string()
    };
    let phase =
        |t: String| serde_json::from_str::<StoredMember<'_>>(&t).and_then(StoredMember::into_member).unwrap().phase;
    // Patched by its owner, its reconcile not yet begun: already down for the planner.
    assert_eq!(phase(text(3, 2, true)), Phase::Updating);
    // Applied.
    assert_eq!(phase(text(3, 3, true)), Phase::Running);
    // A spec change of another kind (no annotation): not an in-place update.
    assert_eq!(phase(text(3, 2, false)), Phase::Running);
}

#[test]
fn a_member_reads_escaped_text_and_refuses_a_bad_ready_time() {
    // Strings with escapes cannot borrow from the text: they are unescaped into their own.
    let text = r#"{"metadata":{"name":"m\u0031","uid":"u\"1","resourceVersion":"3",
        "labels":{"machine.driver.dev/revision":"r\n1"}},
        "status":{"phase":"Running","conditions":[{"type":"Ready","status":"True","reason":"Running",
        "message":"","lastTransitionTime":"2026-01-02T03:04:05Z"}]}}"#;
    let m = serde_json::from_str::<StoredMember<'_>>(text).and_then(StoredMember::into_member).unwrap();
    assert_eq!((m.name.as_str(), m.uid.as_str(), m.revision.as_str()), ("m1", "u\"1", "r\n1"));
    assert_eq!(m.ready_since.map(|t| t.to_rfc3339()).as_deref(), Some("2026-01-02T03:04:05+00:00"));

    let bad = text.replace("2026-01-02T03:04:05Z", "yesterday");
    let e = serde_json::from_str::<StoredMember<'_>>(&bad).and_then(StoredMember::into_member).unwrap_err();
    assert!(e.to_string().contains("lastTransitionTime \"yesterday\""), "{e}");
}

#[test]
fn node_metadata_is_not_part_of_the_revision() {
    let mut t = MachineTemplate::default();
    t.spec.class_ref.name = "small".into();
    let plain = revision(&t);
    t.spec.node_template = Some(NodeTemplate { labels: [("tier".into(), "web".into())].into(), ..Default::default() });
    assert_eq!(revision(&t), plain, "a node metadata change is carried in place, not rolled out");
    t.spec.provider_spec = Some(serde_json::json!({"image": "os-2"}));
    assert_ne!(revision(&t), plain);
}

#[test]
fn a_machine_counts_as_available_only_with_its_node_ready_and_after_min_ready_seconds() {
    // maxSurge 1, maxUnavailable 0: an old machine goes only when the new one is available.
    let mut md = deployment(2);
    md.spec.min_ready_seconds = 30;
    let old = || vec![Fx::new("a").old(), Fx::new("b").old()];
    let with = |c: Fx| {
        let mut v = old();
        v.push(c);
        v
    };
    // now = t0 + 60 s.
    let p = run(&md, with(Fx::new("c").ready_since(50)), true);
    assert!(p.delete.is_empty(), "Ready for 10 s of 30: not available yet: {:?}", p.delete);
    assert_eq!(p.status.available_replicas, 0);
    let p = run(&md, with(Fx::new("c").ready_since(20)), true);
    assert_eq!(names(&p.delete), ["a"], "Ready for 40 s: available");
    let p = run(&md, with(Fx::new("c").ready_since(0).node_not_ready()), true);
    assert!(p.delete.is_empty(), "its Node is NotReady: not available: {:?}", p.delete);
    let p = run(&md, with(Fx::new("c").phase(Phase::Provisioned)), true);
    assert!(p.delete.is_empty(), "Provisioned (the Node has not joined): not available");
    assert_eq!(p.create, 0, "and it counts toward maxSurge");
}

mod domains;
mod interruptions;
