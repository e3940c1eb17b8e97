//! The pool planner over tables of situations.

use std::collections::HashSet;

use super::disruption::Hold;
use super::*;
use crate::events::EventReason;
use crate::plan::literals::{int, pct};
use crate::resources::{CanaryPhase, CanaryStatus, IntOrPercent, Reason, RemediationStatus};

fn i(id: &str) -> Instance {
    Instance::new(id, InstanceState::Running)
}

fn old(id: &str) -> Instance {
    Instance { latest_model: false, ..i(id) }
}

fn state(mut inst: Instance, s: InstanceState) -> Instance {
    inst.state = s;
    inst
}

#[derive(Clone)]
struct Case {
    replicas: i64,
    strategy: RollingUpdate,
    applied_revision: &'static str,
    applied_capacity: i64,
    instances: Vec<Instance>,
    deleting: HashSet<String>,
    annotated: HashSet<String>,
    nodes_managed: bool,
    budgets: Vec<crate::resources::DisruptionBudget>,
    canary: Option<CanaryStatus>,
    /// Seconds after the planner's epoch ([`at`]).
    now: i64,
}

fn case(replicas: i64, surge: IntOrPercent, unavailable: IntOrPercent, instances: Vec<Instance>) -> Case {
    Case {
        replicas,
        strategy: RollingUpdate { max_surge: surge, max_unavailable: unavailable, canary: None },
        applied_revision: "rev",
        applied_capacity: replicas,
        instances,
        deleting: HashSet::new(),
        annotated: HashSet::new(),
        nodes_managed: false,
        budgets: Vec::new(),
        canary: None,
        now: 0,
    }
}

/// The tests' clock: `secs` after 2030-01-01T00:00:00Z.
fn at(secs: i64) -> Time {
    chrono::DateTime::parse_from_rfc3339("2030-01-01T00:00:00Z").unwrap().with_timezone(&chrono::Utc)
        + chrono::Duration::seconds(secs)
}

impl Case {
    fn applied(mut self, revision: &'static str, capacity: i64) -> Self {
        self.applied_revision = revision;
        self.applied_capacity = capacity;
        self
    }
    fn deleting(mut self, id: &str) -> Self {
        self.deleting.insert(id.into());
        self
    }
    fn annotated(mut self, id: &str) -> Self {
        self.annotated.insert(id.into());
        self
    }
    fn managed(mut self) -> Self {
        self.nodes_managed = true;
        self
    }
    fn plan(&self) -> Plan {
        plan_pool(Observed {
            replicas: self.replicas,
            strategy: &self.strategy,
            revision: "rev",
            applied_revision: self.applied_revision,
            applied_capacity: self.applied_capacity,
            instances: &self.instances,
            deleting: &self.deleting,
            annotated: &self.annotated,
            nodes_managed: self.nodes_managed,
            budgets: &self.budgets,
            max_in_flight: 1,
            remediation: &RemediationStatus::default(),
            pace: (std::time::Duration::from_secs(1), std::time::Duration::from_secs(300)),
            remediation_halted: None,
            pool: "p",
            canary: self.canary.as_ref(),
            now: at(self.now),
        })
    }
}

impl Case {
    /// `p` (this case's plan) when it marks nothing; else — it makes no call then — the next
    /// plan, once its marks and `status.canary` are stored.
    fn acted(&self, p: &Plan) -> Plan {
        if p.mark.is_empty() {
            return p.clone();
        }
        assert_eq!(p.step, Step::Wait, "a plan that marks makes no call: {:?}", p.notes);
        let mut next = self.clone();
        for i in &mut next.instances {
            if p.mark.iter().any(|(id, _)| *id == i.id) {
                i.taken = Some(DisruptionReason::Remediation);
            }
        }
        next.canary = p.canary.clone();
        let again = next.plan();
        assert!(again.mark.is_empty(), "marked once: {:?}", again.mark);
        again
    }
}

fn ids(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn the_pool_planner_decides_the_one_call() {
    use Step::*;
    let rows: Vec<(&str, Case, Step)> = vec![
        // ---- capacity
        ("a new pool is applied", case(3, int(1), int(0), vec![]).applied("", 0), Apply { capacity: 3 }),
        ("scale up", case(5, int(1), int(0), vec![i("0"), i("1"), i("2")]).applied("rev", 3), Apply { capacity: 5 }),
        ("scale down", case(1, int(1), int(0), vec![i("0"), i("1"), i("2")]).applied("rev", 3), Apply { capacity: 1 }),
        ("a missing instance is refilled", case(3, int(1), int(0), vec![i("0"), i("1")]), Apply { capacity: 3 }),
        (
            "but not while one of its Machines is being deleted",
            case(3, int(1), int(0), vec![i("0"), i("1"), i("2")]).deleting("2"),
            Wait,
        ),
        ("steady", case(2, int(1), int(0), vec![i("0"), i("1")]), Wait),
        // ---- a template change: apply with room for the surge
        (
            "a new template grows the pool by maxSurge",
            case(3, int(1), int(0), vec![i("0"), i("1"), i("2")]).applied("old", 3),
            Apply { capacity: 4 },
        ),
        (
            "maxSurge as a percent rounds up",
            case(4, pct("30%"), int(0), vec![i("0"), i("1"), i("2"), i("3")]).applied("old", 4),
            Apply { capacity: 6 },
        ),
        (
            "maxSurge 0 keeps the capacity",
            case(3, int(0), int(1), vec![i("0"), i("1"), i("2")]).applied("old", 3),
            Apply { capacity: 3 },
        ),
        // ---- surge upgrades: delete old-model instances in CAPZ's order
        (
            "the surge instance runs: one old instance goes (ready − replicas + maxUnavailable = 1)",
            case(3, int(1), int(0), vec![old("0"), old("1"), old("2"), i("3")]).applied("rev", 4),
            Delete(ids(&["0"])),
        ),
        (
            "the surge instance is not ready yet: nothing ready goes",
            case(3, int(1), int(0), vec![old("0"), old("1"), old("2"), state(i("3"), InstanceState::Creating)])
                .applied("rev", 4),
            Wait,
        ),
        (
            "a failed instance is remediated first: its Machine is marked and deleted",
            case(
                3,
                int(1),
                int(0),
                vec![
                    old("0"),
                    old("1"),
                    state(old("5"), InstanceState::Failed),
                    Instance { running: false, ..old("4") },
                    i("6"),
                    i("7"),
                ],
            )
            .annotated("1")
            .applied("rev", 4),
            DeleteMachines(ids(&["5"])),
        ),
        (
            "then annotated and unready old instances go first; unready ones cost no availability",
            case(3, int(1), int(0), vec![old("0"), old("1"), Instance { running: false, ..old("4") }, i("6"), i("7")])
                .annotated("1")
                .deleting("5")
                .applied("rev", 4),
            Delete(ids(&["1", "4"])),
        ),
        (
            "instances order by number, not text",
            case(2, int(2), int(0), vec![old("10"), old("9"), i("11"), i("12")]).applied("rev", 4),
            Delete(ids(&["9", "10"])),
        ),
        // ---- maxSurge 0: upgrade in place, maxUnavailable at a time
        (
            "maxSurge 0 upgrades maxUnavailable instances in place",
            case(3, int(0), int(1), vec![old("0"), old("1"), old("2")]),
            Upgrade(ids(&["0"])),
        ),
        (
            "maxSurge 0, maxUnavailable 2",
            case(3, int(0), int(2), vec![old("0"), old("1"), old("2")]),
            Upgrade(ids(&["0", "1"])),
        ),
        (
            "maxSurge 0, maxUnavailable as a percent rounds down",
            case(4, int(0), pct("60%"), vec![old("0"), old("1"), old("2"), old("3")]),
            Upgrade(ids(&["0", "1"])),
        ),
        (
            "maxSurge 0: both 0 means one at a time",
            case(3, int(0), int(0), vec![old("0"), old("1"), old("2")]),
            Upgrade(ids(&["0"])),
        ),
        (
            "maxSurge 0: an instance updating uses the budget",
            case(3, int(0), int(1), vec![state(old("0"), InstanceState::Updating), old("1"), old("2")]),
            Wait,
        ),
        (
            "maxSurge 0: the last old instance",
            case(3, int(0), int(1), vec![i("0"), i("1"), old("2")]),
            Upgrade(ids(&["2"])),
        ),
    ];
    for (name, c, want) in rows {
        assert_eq!(c.acted(&c.plan()).step, want, "{name}");
    }
}

fn not_running(inst: Instance) -> Instance {
    Instance { running: false, ..inst }
}

fn node_not_ready(inst: Instance) -> Instance {
    Instance { node_ready: false, ..inst }
}

/// Old instances held by `maxUnavailable` (as a rollout).
fn held(instances: i64, available: i64, min_available: i64, new_unavailable: i64) -> Note {
    Note::Held {
        reason: DisruptionReason::Rollout,
        instances,
        hold: Hold::MaxUnavailable { available, min_available, new_unavailable },
    }
}

/// Why the planner chose each step, or held back.
#[test]
fn the_pool_planner_says_why() {
    use Note::*;
    use Step::*;
    let rows: Vec<(&str, Case, Step, Vec<Note>)> = vec![
        (
            "a new pool",
            case(3, int(1), int(0), vec![]).applied("", 0),
            Apply { capacity: 3 },
            vec![TemplateChanged { capacity: 3 }],
        ),
        (
            "scale up",
            case(5, int(1), int(0), vec![i("0"), i("1"), i("2")]).applied("rev", 3),
            Apply { capacity: 5 },
            vec![CapacityChanged { from: 3, to: 5 }],
        ),
        (
            "a missing instance",
            case(3, int(1), int(0), vec![i("0"), i("1")]),
            Apply { capacity: 3 },
            vec![Missing { live: 2, capacity: 3 }],
        ),
        (
            "no refill while a Machine is being deleted",
            case(3, int(1), int(0), vec![i("0"), i("1"), i("2")]).deleting("2"),
            Wait,
            vec![RefillHeld { deleting: 1 }],
        ),
        ("steady", case(2, int(1), int(0), vec![i("0"), i("1")]), Wait, vec![Done]),
        (
            "a new template grows the pool by maxSurge",
            case(3, int(1), int(0), vec![i("0"), i("1"), i("2")]).applied("old", 3),
            Apply { capacity: 4 },
            vec![TemplateChanged { capacity: 4 }],
        ),
        (
            "a surge upgrade deletes within ready − replicas + maxUnavailable",
            case(3, int(1), int(0), vec![old("0"), old("1"), old("2"), i("3")]).applied("rev", 4),
            Delete(ids(&["0"])),
            vec![Upgrading { old: 3, taken: 1 }, held(2, 4, 3, 0)],
        ),
        (
            "the surge instance is not ready: the old ones wait",
            case(3, int(1), int(0), vec![old("0"), old("1"), old("2"), state(i("3"), InstanceState::Creating)])
                .applied("rev", 4),
            Wait,
            vec![held(3, 3, 3, 1)],
        ),
        (
            "maxSurge 0 upgrades in place",
            case(3, int(0), int(1), vec![old("0"), old("1"), old("2")]),
            Upgrade(ids(&["0"])),
            vec![
                Upgrading { old: 3, taken: 1 },
                Held {
                    reason: DisruptionReason::InPlaceUpdate,
                    instances: 1,
                    hold: Hold::MaxUnavailable { available: 3, min_available: 2, new_unavailable: 0 },
                },
            ],
        ),
        (
            "maxSurge 0: an updating instance uses maxUnavailable",
            case(3, int(0), int(1), vec![state(old("0"), InstanceState::Updating), old("1"), old("2")]),
            Wait,
            vec![Held {
                reason: DisruptionReason::InPlaceUpdate,
                instances: 1,
                hold: Hold::MaxUnavailable { available: 2, min_available: 2, new_unavailable: 0 },
            }],
        ),
        (
            "nodes managed: a scale-down deletes the excess as Machines",
            case(1, int(1), int(0), vec![i("0"), i("1"), i("2")]).applied("rev", 3).managed(),
            DeleteMachines(ids(&["2", "1"])),
            vec![AboveCapacity { live: 3, capacity: 1 }],
        ),
        (
            "nodes managed: the surge is not given back while the last old instance drains",
            case(3, int(1), int(0), vec![old("2"), i("3"), i("4"), i("5")]).applied("rev", 4).deleting("2").managed(),
            Wait,
            vec![CapacityChanged { from: 4, to: 3 }, ApplyHeld { capacity: 3, held: 4 }, Done],
        ),
        (
            "nodes managed: an instance whose Node is not Ready is not ready",
            case(3, int(1), int(0), vec![old("0"), old("1"), old("2"), node_not_ready(i("3"))])
                .applied("rev", 4)
                .managed(),
            Wait,
            vec![held(3, 3, 3, 1)],
        ),
        (
            "without nodes its Node is not read",
            case(3, int(1), int(0), vec![old("0"), old("1"), old("2"), node_not_ready(i("3"))]).applied("rev", 4),
            Delete(ids(&["0"])),
            vec![Upgrading { old: 3, taken: 1 }, held(2, 4, 3, 0)],
        ),
    ];
    for (name, c, step, notes) in rows {
        let p = c.plan();
        assert_eq!(p.step, step, "{name}");
        assert_eq!(p.notes, notes, "{name}");
    }
}

#[test]
fn the_ready_condition_says_how_far_the_pool_is() {
    let ready = |c: Case| c.plan().ready.map(|r| (r.holds, r.reason, r.message));
    assert_eq!(
        ready(case(2, int(1), int(0), vec![i("0"), i("1")])),
        Some((true, Reason::Ready, "2 of 2 ready, 2 on the latest model".to_string()))
    );
    assert_eq!(
        ready(case(3, int(0), int(1), vec![state(old("0"), InstanceState::Updating), old("1"), old("2")])),
        Some((
            false,
            Reason::Rolling,
            "2 of 3 ready, 0 on the latest model; 1 InPlaceUpdate held: maxUnavailable: 2 available, 2 required, \
             0 new not available yet"
                .to_string()
        ))
    );
    assert_eq!(
        ready(case(1, int(1), int(0), vec![i("0"), i("1"), i("2")]).applied("rev", 3).managed()),
        Some((false, Reason::Rolling, "3 of 1 ready; draining the Nodes of 2, 1".to_string()))
    );
    assert_eq!(ready(case(3, int(1), int(0), vec![]).applied("", 0)), None, "a call's outcome sets it");
    assert_eq!(ready(case(3, int(1), int(0), vec![old("0"), old("1"), old("2"), i("3")]).applied("rev", 4)), None);
}

/// With nodes managed (a target cluster), instances go only as Machines (drained first), and
/// the cloud is never given a capacity that lets it choose.
#[test]
fn with_nodes_managed_the_pool_deletes_machines_and_never_lets_the_cloud_choose() {
    use Step::*;
    let rows: Vec<(&str, Case, Step)> = vec![
        // ---- scale-down: the planner chooses
        (
            "a scale-down deletes the Machines of the newest instances",
            case(1, int(1), int(0), vec![i("0"), i("1"), i("2")]).applied("rev", 3).managed(),
            DeleteMachines(ids(&["2", "1"])),
        ),
        (
            "newest by number, not text",
            case(2, int(1), int(0), vec![i("9"), i("10"), i("2")]).applied("rev", 3).managed(),
            DeleteMachines(ids(&["10"])),
        ),
        (
            "the annotated instance goes first",
            case(2, int(1), int(0), vec![i("0"), i("1"), i("2")]).applied("rev", 3).annotated("0").managed(),
            DeleteMachines(ids(&["0"])),
        ),
        (
            "failed, annotated, unready, then the newest",
            case(
                1,
                int(1),
                int(0),
                vec![i("0"), i("1"), state(i("2"), InstanceState::Failed), not_running(i("3")), i("4")],
            )
            .applied("rev", 5)
            .annotated("1")
            .managed(),
            DeleteMachines(ids(&["2", "1", "3", "4"])),
        ),
        (
            "a scale-down mid-upgrade takes old instances first",
            case(2, int(1), int(0), vec![old("0"), i("1"), i("2"), i("3")]).applied("rev", 3).managed(),
            DeleteMachines(ids(&["0"])),
        ),
        (
            "a scale-down with a template change: the excess over replicas + maxSurge goes first",
            case(1, int(1), int(0), vec![i("0"), i("1"), i("2")]).applied("old", 3).managed(),
            DeleteMachines(ids(&["2"])),
        ),
        (
            "nothing is applied while the chosen Machine drains (the cloud would pick)",
            case(1, int(1), int(0), vec![i("0"), i("1")]).applied("rev", 2).deleting("1").managed(),
            Wait,
        ),
        (
            "nor while its instance is being deleted",
            case(1, int(1), int(0), vec![i("0"), state(i("1"), InstanceState::Deleting)])
                .applied("rev", 2)
                .deleting("1")
                .managed(),
            Wait,
        ),
        (
            "once it is gone the lower capacity is applied: the cloud has nothing left to pick",
            case(1, int(1), int(0), vec![i("0")]).applied("rev", 2).managed(),
            Apply { capacity: 1 },
        ),
        (
            "a scale-up goes ahead while a Machine drains: it removes nothing",
            case(3, int(1), int(0), vec![i("0"), i("1")]).applied("rev", 2).deleting("1").managed(),
            Apply { capacity: 3 },
        ),
        (
            "a deleted Machine's instance is refilled only once it is gone",
            case(2, int(1), int(0), vec![i("0"), i("1")]).deleting("1").managed(),
            Wait,
        ),
        (
            "a missing instance is refilled",
            case(3, int(1), int(0), vec![i("0"), i("1")]).managed(),
            Apply { capacity: 3 },
        ),
        ("steady", case(2, int(1), int(0), vec![i("0"), i("1")]).managed(), Wait),
        // ---- surge upgrades: the same victims, as Machines
        (
            "a new template grows the pool by maxSurge",
            case(3, int(1), int(0), vec![i("0"), i("1"), i("2")]).applied("old", 3).managed(),
            Apply { capacity: 4 },
        ),
        (
            "the surge instance runs: one old instance's Machine goes",
            case(3, int(1), int(0), vec![old("0"), old("1"), old("2"), i("3")]).applied("rev", 4).managed(),
            DeleteMachines(ids(&["0"])),
        ),
        (
            "failed, annotated, unready old instances go first; unready ones cost no availability",
            case(
                4,
                int(2),
                int(1),
                vec![old("0"), old("1"), state(old("5"), InstanceState::Failed), not_running(old("4")), i("6"), i("7")],
            )
            .annotated("1")
            .applied("rev", 6)
            .managed(),
            DeleteMachines(ids(&["5", "1", "4"])),
        ),
        (
            "more instances than replicas + maxSurge mid-upgrade: the excess goes first, failed and annotated",
            case(
                3,
                int(1),
                int(0),
                vec![old("0"), old("1"), state(old("5"), InstanceState::Failed), not_running(old("4")), i("6"), i("7")],
            )
            .annotated("1")
            .applied("rev", 4)
            .managed(),
            DeleteMachines(ids(&["5", "1"])),
        ),
        (
            "while the old instance drains, no ready one goes and nothing is refilled",
            case(3, int(1), int(0), vec![old("0"), old("1"), old("2"), i("3")])
                .applied("rev", 4)
                .deleting("0")
                .managed(),
            Wait,
        ),
        (
            "the last old instance drains: the surge is not given back yet",
            case(3, int(1), int(0), vec![old("2"), i("3"), i("4"), i("5")]).applied("rev", 4).deleting("2").managed(),
            Wait,
        ),
        (
            "it is gone: the surge is given back",
            case(3, int(1), int(0), vec![i("3"), i("4"), i("5")]).applied("rev", 4).managed(),
            Apply { capacity: 3 },
        ),
        // ---- maxSurge 0: delete and replace, within maxUnavailable, never reimage in place
        (
            "maxSurge 0 deletes maxUnavailable old Machines",
            case(3, int(0), int(1), vec![old("0"), old("1"), old("2")]).managed(),
            DeleteMachines(ids(&["0"])),
        ),
        (
            "maxSurge 0, maxUnavailable 2",
            case(3, int(0), int(2), vec![old("0"), old("1"), old("2")]).managed(),
            DeleteMachines(ids(&["0", "1"])),
        ),
        (
            "maxSurge 0: both 0 means one at a time",
            case(3, int(0), int(0), vec![old("0"), old("1"), old("2")]).managed(),
            DeleteMachines(ids(&["0"])),
        ),
        (
            "maxSurge 0: the draining Machine uses the budget",
            case(3, int(0), int(1), vec![old("0"), old("1"), old("2")]).deleting("0").managed(),
            Wait,
        ),
        (
            "maxSurge 0: gone, so refilled on the latest model",
            case(3, int(0), int(1), vec![old("1"), old("2")]).managed(),
            Apply { capacity: 3 },
        ),
        (
            "maxSurge 0: the replacement is not ready yet",
            case(3, int(0), int(1), vec![old("1"), old("2"), state(i("3"), InstanceState::Creating)]).managed(),
            Wait,
        ),
        (
            "maxSurge 0: an unready old instance costs no availability",
            case(3, int(0), int(1), vec![not_running(old("0")), old("1"), old("2")]).managed(),
            DeleteMachines(ids(&["0"])),
        ),
        (
            "maxSurge 0: a new template is applied first (same capacity: nothing removed)",
            case(3, int(0), int(1), vec![i("0"), i("1"), i("2")]).applied("old", 3).managed(),
            Apply { capacity: 3 },
        ),
    ];
    for (name, c, want) in rows {
        assert_eq!(c.acted(&c.plan()).step, want, "{name}");
    }
}

/// Without nodes the same situations plan what they always did: the cloud picks the scale-down,
/// upgrades call DeletePoolInstances and UpgradePoolInstances.
#[test]
fn without_nodes_the_old_steps_are_unchanged() {
    use Step::*;
    let rows: Vec<(&str, Case, Step)> = vec![
        (
            "a scale-down is applied",
            case(2, int(1), int(0), vec![i("0"), i("1"), i("2")]).applied("rev", 3).annotated("0"),
            Apply { capacity: 2 },
        ),
        (
            "a lower capacity waits while a Machine's instance is being deleted (the cloud must not pick another)",
            case(1, int(1), int(0), vec![i("0"), i("1")]).applied("rev", 2).deleting("1"),
            Wait,
        ),
        (
            "the surge is given back while the last old instance goes",
            case(3, int(1), int(0), vec![state(old("2"), InstanceState::Deleting), i("3"), i("4"), i("5")])
                .applied("rev", 4),
            Apply { capacity: 3 },
        ),
        (
            "surge upgrades call DeletePoolInstances",
            case(3, int(1), int(0), vec![old("0"), old("1"), old("2"), i("3")]).applied("rev", 4),
            Delete(ids(&["0"])),
        ),
        (
            "maxSurge 0 upgrades in place",
            case(3, int(0), int(1), vec![old("0"), old("1"), old("2")]),
            Upgrade(ids(&["0"])),
        ),
        (
            "maxSurge 0 ignores an unready old instance",
            case(3, int(0), int(2), vec![not_running(old("0")), old("1"), old("2")]),
            Upgrade(ids(&["1"])),
        ),
    ];
    for (name, c, want) in rows {
        assert_eq!(c.acted(&c.plan()).step, want, "{name}");
    }
}

/// A pool run to convergence against a cloud that behaves like the fake driver and Azure
/// (ApplyPool removes the newest live instances when the capacity drops; DeletePoolInstances
/// lowers the capacity), with nodes managed: the cloud never picks an instance, and nothing is
/// created or deleted beyond what the change needs.
#[test]
fn with_nodes_managed_a_pool_converges_without_the_cloud_choosing_or_churn() {
    struct Sim {
        c: Case,
        capacity: i64,
        next: u64,
        /// Machines being deleted, with the turns their drains still take.
        draining: Vec<(String, u32)>,
        created: usize,
        deleted: Vec<String>,
        min_ready: i64,
    }
    impl Sim {
        fn new(c: Case) -> Sim {
            let next = c.instances.iter().map(|i| i.id.parse::<u64>().unwrap() + 1).max().unwrap_or(0);
            Sim {
                capacity: c.applied_capacity,
                c,
                next,
                draining: Vec::new(),
                created: 0,
                deleted: Vec::new(),
                min_ready: i64::MAX,
            }
        }
        /// Runs until the plan says done. Each turn new instances come up, and drains advance;
        /// a drained Machine's instance is deleted (DeletePoolInstances lowers the capacity).
        fn run(&mut self) {
            for _ in 0..200 {
                for inst in self.c.instances.iter_mut() {
                    inst.state = InstanceState::Running;
                }
                for d in self.draining.iter_mut() {
                    d.1 = d.1.saturating_sub(1);
                }
                let gone: Vec<String> = self.draining.iter().filter(|d| d.1 == 0).map(|d| d.0.clone()).collect();
                self.draining.retain(|d| d.1 > 0);
                self.c.instances.retain(|i| !gone.contains(&i.id));
                self.capacity -= gone.len() as i64;
                self.deleted.extend(gone);
                self.c.deleting = self.draining.iter().map(|d| d.0.clone()).collect();
                let p = self.c.plan();
                self.min_ready = self.min_ready.min(p.ready_replicas);
                match p.step {
                    Step::Apply { capacity } => {
                        self.c.applied_revision = "rev";
                        self.c.applied_capacity = capacity;
                        self.capacity = capacity;
                        // Every listed instance is the cloud's to pick, draining or not.
                        let held = self.c.instances.len() as i64;
                        assert!(held <= capacity, "the cloud would pick among {:?}", self.c.instances);
                        for _ in held..capacity {
                            self.c.instances.push(state(i(&self.next.to_string()), InstanceState::Creating));
                            self.next += 1;
                            self.created += 1;
                        }
                    }
                    Step::DeleteMachines(ids) => {
                        assert!(!ids.is_empty());
                        assert!(ids.iter().all(|id| !self.c.deleting.contains(id)), "{ids:?} deleted twice");
                        self.draining.extend(ids.into_iter().map(|id| (id, 3)));
                    }
                    Step::Wait if p.done && self.draining.is_empty() => return,
                    Step::Wait => {}
                    other => panic!("{other:?} with nodes managed"),
                }
            }
            panic!("no convergence: {:?}", self.c.instances);
        }
    }
    // Scale-down 3 → 1: the two newest go, nothing is created.
    let mut s = Sim::new(case(1, int(1), int(0), vec![i("0"), i("1"), i("2")]).applied("rev", 3).managed());
    s.run();
    assert_eq!((s.created, sorted(s.deleted.clone())), (0, ids(&["1", "2"])));
    assert_eq!(s.c.instances, vec![i("0")]);
    assert_eq!(s.capacity, 1);
    // Scale-down with an annotated instance.
    let mut s =
        Sim::new(case(2, int(1), int(0), vec![i("0"), i("1"), i("2")]).applied("rev", 3).annotated("1").managed());
    s.run();
    assert_eq!((s.created, s.deleted.clone()), (0, ids(&["1"])));
    // A surge upgrade: each old instance replaced once; never below replicas ready.
    let mut s = Sim::new(case(3, int(1), int(0), vec![old("0"), old("1"), old("2")]).applied("old", 3).managed());
    s.run();
    assert_eq!((s.created, sorted(s.deleted.clone())), (3, ids(&["0", "1", "2"])));
    assert_eq!(s.min_ready, 3);
    assert_eq!(s.capacity, 3);
    // maxSurge 0: delete and replace, one at a time (maxUnavailable 1).
    let mut s = Sim::new(case(3, int(0), int(1), vec![old("0"), old("1"), old("2")]).applied("old", 3).managed());
    s.run();
    assert_eq!((s.created, sorted(s.deleted.clone())), (3, ids(&["0", "1", "2"])));
    assert_eq!(s.min_ready, 2);
    assert!(s.c.instances.iter().all(|i| i.latest_model));
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

#[test]
fn counts_and_done() {
    let p = case(3, int(1), int(0), vec![i("0"), i("1"), state(i("2"), InstanceState::Deleting), i("3")]).plan();
    assert_eq!((p.replicas, p.ready_replicas, p.updated_replicas), (3, 3, 3));
    assert!(p.done);
    let p = case(3, int(0), int(1), vec![i("0"), i("1"), old("2")]).plan();
    assert_eq!((p.replicas, p.ready_replicas, p.updated_replicas), (3, 3, 2));
    assert!(!p.done);
    // A new template: nothing is on its latest model yet.
    let p = case(2, int(1), int(0), vec![i("0"), i("1")]).applied("old", 2).plan();
    assert_eq!(p.updated_replicas, 0);
    assert!(!p.done);
}

#[test]
fn legacy_provisioning_states_are_read_in_one_place() {
    let rows = [
        ("Succeeded", InstanceState::Running, Phase::Running),
        ("Failed", InstanceState::Failed, Phase::Failed),
        ("Deleting", InstanceState::Deleting, Phase::Terminating),
        ("Updating", InstanceState::Updating, Phase::Updating),
        ("Creating", InstanceState::Creating, Phase::Creating),
        ("", InstanceState::Creating, Phase::Creating),
        ("Migrating", InstanceState::Creating, Phase::Creating),
    ];
    for (text, state, phase) in rows {
        assert_eq!(legacy_instance_state(text), state, "{text}");
        assert_eq!(instance_phase(state), phase, "{text}");
    }
}

/// maxSurge 0 upgrades never take more than maxUnavailable instances out at once, and surge
/// upgrades never delete ready instances below `replicas − maxUnavailable`; with nodes managed
/// the same holds for the Machines deleted, and nothing is ever upgraded in place or deleted
/// without its Machine.
#[test]
fn pool_upgrades_keep_within_max_unavailable() {
    for managed in [false, true] {
        for replicas in 1..8i64 {
            for unavailable in 0..4i64 {
                for surge in 0..3i64 {
                    for old_count in 0..=replicas {
                        for unready in 0..=replicas.min(2) {
                            let mut instances: Vec<Instance> = (0..replicas + surge.min(old_count))
                                .map(|n| if n < old_count { old(&n.to_string()) } else { i(&n.to_string()) })
                                .collect();
                            for inst in instances.iter_mut().rev().take(unready as usize) {
                                inst.running = false;
                            }
                            let mut c = case(replicas, int(surge), int(unavailable), instances);
                            c.applied_capacity = replicas + surge.min(old_count);
                            c.nodes_managed = managed;
                            let p = c.plan();
                            let limits = Limits::resolve(replicas, &c.strategy);
                            let ready = c.instances.iter().filter(|i| i.ready()).count() as i64;
                            let label = format!(
                                "managed {managed} replicas {replicas} surge {surge} unavailable {unavailable} old \
                                 {old_count} unready {unready}"
                            );
                            let within_budget = |ids: &Vec<String>| {
                                let ready_deleted =
                                    c.instances.iter().filter(|i| i.ready() && ids.contains(&i.id)).count() as i64;
                                assert!(
                                    ready - ready_deleted >= (replicas - limits.max_unavailable).min(ready),
                                    "{label}: {ids:?}"
                                );
                                assert!(ids
                                    .iter()
                                    .all(|id| c.instances.iter().any(|i| &i.id == id && !i.latest_model)));
                            };
                            match &p.step {
                                Step::Upgrade(ids) => {
                                    assert!(!managed, "{label}: upgraded in place with nodes managed");
                                    let not_ready = c.instances.len() as i64 - ready;
                                    assert!(ids.len() as i64 + not_ready <= limits.max_unavailable, "{label}: {ids:?}");
                                }
                                Step::Delete(ids) => {
                                    assert!(!managed, "{label}: deleted without draining");
                                    within_budget(ids);
                                }
                                Step::DeleteMachines(ids) => {
                                    assert!(managed, "{label}: Machines deleted without nodes");
                                    within_budget(ids);
                                }
                                Step::Apply { capacity } => {
                                    assert!(*capacity <= replicas + limits.max_surge, "{label}");
                                    if managed {
                                        assert!(*capacity >= c.instances.len() as i64, "{label}: the cloud picks");
                                    }
                                }
                                Step::Wait => {}
                            }
                        }
                    }
                }
            }
        }
    }
}

// ---- canaries

/// A canary of `machines` instances paused `pause` seconds.
fn with_canary(mut c: Case, machines: i64, pause: u64) -> Case {
    c.strategy.canary = Some(crate::resources::Canary { machines: int(machines), pause_seconds: pause });
    c
}

/// `status.canary` of model "rev" in `phase`, ready since `since` (seconds on the tests' clock).
fn canary_status(phase: CanaryPhase, wanted: i64, since: Option<i64>, pause: i64) -> CanaryStatus {
    CanaryStatus {
        revision: "rev".into(),
        phase,
        wanted,
        machines: Vec::new(),
        ready_since: since.map(at),
        pause_until: since.map(|s| at(s + pause)),
        message: String::new(),
    }
}

impl Case {
    fn canary(mut self, k: CanaryStatus) -> Self {
        self.canary = Some(k);
        self
    }
    fn at(mut self, secs: i64) -> Self {
        self.now = secs;
        self
    }
}

fn failed_machine(inst: Instance, why: &str) -> Instance {
    Instance { remediation: Some(Remediation::Failed), failure: Some(why.into()), ..inst }
}

#[test]
fn a_canary_caps_the_new_model_instances_until_its_pause_is_over() {
    use CanaryPhase::*;
    use Step::*;
    let three_old = || vec![old("0"), old("1"), old("2")];
    let progressing = || canary_status(Progressing, 1, None, 30);
    // (what, case, step, canary phase after, canary instances)
    type Row = (&'static str, Case, Step, Option<CanaryPhase>, Vec<&'static str>);
    let rows: Vec<Row> = vec![
        (
            "no canary: a new template grows the pool by maxSurge (3)",
            case(3, int(3), int(0), three_old()).applied("old", 3),
            Apply { capacity: 6 },
            None,
            vec![],
        ),
        (
            "a canary of 1: the surge grows the pool by 1 only",
            with_canary(case(3, int(3), int(0), three_old()).applied("old", 3), 1, 30),
            Apply { capacity: 4 },
            Some(Progressing),
            vec![],
        ),
        (
            "a pool's first apply has no canary",
            with_canary(case(3, int(1), int(0), vec![]).applied("", 0), 1, 30),
            Apply { capacity: 3 },
            None,
            vec![],
        ),
        (
            "the canary instance is created but not ready: nothing else moves",
            with_canary(
                case(3, int(3), int(0), vec![old("0"), old("1"), old("2"), state(i("3"), InstanceState::Creating)]),
                1,
                30,
            )
            .applied("rev", 4)
            .canary(progressing()),
            Wait,
            Some(Progressing),
            vec!["3"],
        ),
        (
            "the canary instance is ready: the pause starts, no old instance goes",
            with_canary(case(3, int(3), int(0), vec![old("0"), old("1"), old("2"), i("3")]), 1, 30)
                .applied("rev", 4)
                .canary(progressing()),
            Wait,
            Some(Pausing),
            vec!["3"],
        ),
        (
            "without a canary (maxSurge 1) old instances go as soon as the surge instance is ready",
            case(3, int(1), int(0), vec![old("0"), old("1"), old("2"), i("3")]).applied("rev", 4),
            Delete(ids(&["0"])),
            None,
            vec![],
        ),
        (
            "still pausing 29s later",
            with_canary(case(3, int(3), int(0), vec![old("0"), old("1"), old("2"), i("3")]), 1, 30)
                .applied("rev", 4)
                .canary(canary_status(Pausing, 1, Some(0), 30))
                .at(29),
            Wait,
            Some(Pausing),
            vec!["3"],
        ),
        (
            "the pause is over: passed, and the upgrade goes on at its usual pace",
            with_canary(case(3, int(3), int(0), vec![old("0"), old("1"), old("2"), i("3")]), 1, 30)
                .applied("rev", 4)
                .canary(canary_status(Pausing, 1, Some(0), 30))
                .at(30),
            Apply { capacity: 6 },
            Some(Passed),
            vec!["3"],
        ),
        (
            "a canary instance not ready any more: the pause starts over",
            with_canary(case(3, int(3), int(0), vec![old("0"), old("1"), old("2"), not_running(i("3"))]), 1, 30)
                .applied("rev", 4)
                .canary(canary_status(Pausing, 1, Some(0), 30))
                .at(29),
            Wait,
            Some(Progressing),
            vec!["3"],
        ),
        (
            "a canary instance its MachineHealthCheck marked is not ready for the canary",
            with_canary(
                case(
                    3,
                    int(1),
                    int(0),
                    vec![
                        old("0"),
                        old("1"),
                        old("2"),
                        Instance { remediation: Some(Remediation::Unhealthy), ..i("3") },
                    ],
                ),
                1,
                30,
            )
            .applied("rev", 4)
            .canary(progressing()),
            DeleteMachines(ids(&["3"])),
            Some(Progressing),
            vec!["3"],
        ),
        (
            "a canary of 2 with maxSurge 1: one old instance goes to make room for the second",
            with_canary(case(3, int(1), int(0), vec![old("0"), old("1"), old("2"), i("3")]), 2, 30)
                .applied("rev", 4)
                .canary(canary_status(Progressing, 2, None, 30)),
            Delete(ids(&["0"])),
            Some(Progressing),
            vec!["3"],
        ),
        (
            "… but not a second one while its replacement is coming",
            with_canary(case(3, int(1), int(0), vec![old("1"), old("2"), i("3")]), 2, 30)
                .applied("rev", 4)
                .canary(canary_status(Progressing, 2, None, 30)),
            Apply { capacity: 4 },
            Some(Progressing),
            vec!["3"],
        ),
        (
            "maxSurge 0 without nodes: one old instance is reimaged, not more",
            with_canary(case(3, int(0), int(3), three_old()), 1, 30).applied("rev", 3),
            Upgrade(ids(&["0"])),
            Some(Progressing),
            vec![],
        ),
        (
            "maxSurge 0 without nodes: none while the canary is reimaging",
            with_canary(
                case(3, int(0), int(3), vec![state(old("0"), InstanceState::Updating), old("1"), old("2")]),
                1,
                30,
            )
            .applied("rev", 3)
            .canary(progressing()),
            Wait,
            Some(Progressing),
            vec![],
        ),
        (
            "maxSurge 0 with nodes: one old instance is deleted and replaced, not more",
            with_canary(case(3, int(0), int(3), three_old()), 1, 30).applied("rev", 3).managed(),
            DeleteMachines(ids(&["0"])),
            Some(Progressing),
            vec![],
        ),
        (
            "maxSurge 0 with nodes: none while its replacement is coming",
            with_canary(case(3, int(0), int(3), vec![old("1"), old("2")]), 1, 30)
                .applied("rev", 3)
                .managed()
                .canary(progressing()),
            Apply { capacity: 3 },
            Some(Progressing),
            vec![],
        ),
        (
            "with nodes an instance is ready for the canary only once its Node is",
            with_canary(case(3, int(1), int(0), vec![old("0"), old("1"), old("2"), node_not_ready(i("3"))]), 1, 30)
                .applied("rev", 4)
                .managed()
                .canary(progressing()),
            Wait,
            Some(Progressing),
            vec!["3"],
        ),
        (
            "a canary that passed is kept, and the upgrade goes on",
            with_canary(case(3, int(1), int(0), vec![old("1"), old("2"), i("3"), i("4")]), 1, 30)
                .applied("rev", 4)
                .canary(canary_status(Passed, 1, Some(0), 30)),
            Delete(ids(&["1"])),
            Some(Passed),
            vec![],
        ),
    ];
    for (what, c, step, phase, members) in rows {
        let p = c.plan();
        assert_eq!(c.acted(&p).step, step, "{what}: {:?}", p.notes);
        assert_eq!(p.canary.as_ref().map(|k| k.phase), phase, "{what}");
        if phase.is_some_and(|ph| ph != Passed) {
            let names: Vec<String> = members.iter().map(|id| machine_name("p", id)).collect();
            assert_eq!(p.canary.as_ref().unwrap().machines, names, "{what}");
        }
    }
}

#[test]
fn the_pause_runs_from_when_every_canary_instance_was_ready() {
    let c = with_canary(case(3, int(1), int(0), vec![old("0"), old("1"), old("2"), i("3")]), 1, 30)
        .applied("rev", 4)
        .canary(canary_status(CanaryPhase::Progressing, 1, None, 30))
        .at(100);
    let p = c.plan();
    let k = p.canary.clone().unwrap();
    assert_eq!((k.phase, k.ready_since, k.pause_until), (CanaryPhase::Pausing, Some(at(100)), Some(at(130))));
    assert!(p.notes.contains(&Note::Canary {
        revision: "rev".into(),
        phase: CanaryPhase::Pausing,
        ready: 1,
        wanted: 1
    }));
    let ready = p.ready.unwrap();
    assert!(!ready.holds);
    assert!(ready.message.contains("canary of model rev Pausing"), "{}", ready.message);
    // A restarted controller reads the same readySince back: the pause is not restarted.
    let again = c.canary(k).at(120).plan().canary.unwrap();
    assert_eq!((again.phase, again.ready_since), (CanaryPhase::Pausing, Some(at(100))));
    // It passes once and says so.
    let passed = with_canary(case(3, int(1), int(0), vec![old("0"), old("1"), old("2"), i("3")]), 1, 30)
        .applied("rev", 4)
        .canary(again)
        .at(130)
        .plan();
    let k = passed.canary.clone().unwrap();
    assert_eq!((k.phase, k.machines.clone()), (CanaryPhase::Passed, vec!["p-3".to_string()]));
    assert!(passed.events.iter().any(|e| e.reason == EventReason::CanaryPassed));
    assert!(passed.notes.contains(&Note::CanaryPassed { revision: "rev".into() }));
    // Read back, a canary that passed is kept as it is.
    let kept = with_canary(case(3, int(1), int(0), vec![old("1"), old("2"), i("3"), i("4")]), 1, 30)
        .applied("rev", 4)
        .canary(k.clone())
        .at(200)
        .plan();
    assert_eq!(kept.canary, Some(k));
    assert!(kept.events.is_empty());
}

#[test]
fn a_failed_canary_instance_stops_the_upgrade_and_is_still_replaced() {
    use Step::*;
    let progressing = || canary_status(CanaryPhase::Progressing, 1, None, 30);
    // (what, case, step)
    let rows: Vec<(&str, Case, Step, &str)> = vec![
        (
            "its instance fails (a failed create): remediated, no old instance goes",
            with_canary(
                case(3, int(1), int(0), vec![old("0"), old("1"), old("2"), state(i("3"), InstanceState::Failed)]),
                1,
                30,
            )
            .applied("rev", 4)
            .canary(progressing()),
            DeleteMachines(ids(&["3"])),
            "canary instance 3 of model rev failed (the cloud reports it Failed)",
        ),
        (
            "its Node never joined (nodes managed)",
            with_canary(
                case(
                    3,
                    int(1),
                    int(0),
                    vec![
                        old("0"),
                        old("1"),
                        old("2"),
                        failed_machine(node_not_ready(i("3")), "NODE_NOT_JOINED: no Ready Node 600s"),
                    ],
                ),
                1,
                30,
            )
            .applied("rev", 4)
            .managed()
            .canary(progressing()),
            DeleteMachines(ids(&["3"])),
            "canary instance 3 of model rev failed (NODE_NOT_JOINED: no Ready Node 600s)",
        ),
        (
            "maxSurge 0 without nodes: the reimaged canary failed; nothing else is reimaged",
            with_canary(case(3, int(0), int(3), vec![state(i("0"), InstanceState::Failed), old("1"), old("2")]), 1, 30)
                .applied("rev", 3)
                .canary(progressing()),
            DeleteMachines(ids(&["0"])),
            "canary instance 0 of model rev failed",
        ),
    ];
    for (what, c, step, message) in rows {
        let p = c.plan();
        assert_eq!(c.acted(&p).step, step, "{what}: {:?}", p.notes);
        let k = p.canary.clone().unwrap();
        assert_eq!(k.phase, CanaryPhase::Failed, "{what}");
        assert!(k.message.contains(message), "{what}: {}", k.message);
        assert!(k.message.contains("the upgrade stops until the template changes"), "{what}");
        assert!(p.events.iter().any(|e| e.reason == EventReason::CanaryFailed), "{what}");
        let ready = p.ready.clone().unwrap();
        assert_eq!((ready.holds, ready.reason), (false, Reason::CanaryFailed), "{what}");
        // Once failed (read back from status), no old instance goes, whatever is ready.
        let mut after = c;
        after.instances.retain(|i| !matches!(i.state, InstanceState::Failed) && i.remediation.is_none());
        after.instances.push(i("5"));
        let replaced = after.canary(k).plan();
        assert_eq!(replaced.step, Wait, "{what} (its replacement ready): {:?}", replaced.notes);
        assert_eq!(replaced.canary.as_ref().unwrap().phase, CanaryPhase::Failed, "{what}");
        assert!(replaced.events.is_empty(), "{what}: one event");
        let ready = replaced.ready.unwrap();
        assert_eq!(ready.reason, Reason::CanaryFailed, "{what}");
        assert!(ready.message.contains("failed"), "{what}: {}", ready.message);
    }
}

#[test]
fn a_new_template_after_a_failed_canary_starts_a_new_one() {
    let failed = CanaryStatus { revision: "bad".into(), ..canary_status(CanaryPhase::Failed, 1, None, 30) };
    let c = with_canary(case(3, int(1), int(0), vec![old("0"), old("1"), old("2"), old("3")]), 1, 30)
        .applied("bad", 4)
        .canary(failed);
    let p = c.plan();
    assert_eq!(p.step, Step::Apply { capacity: 4 });
    let k = p.canary.unwrap();
    assert_eq!((k.revision.as_str(), k.phase), ("rev", CanaryPhase::Progressing));
    // The canary taken out of the strategy: the upgrade goes on, the failed record stays.
    let mut c = case(3, int(1), int(0), vec![old("0"), old("1"), old("2"), i("3")]).applied("rev", 4);
    c.canary = Some(canary_status(CanaryPhase::Failed, 1, None, 30));
    let p = c.plan();
    assert_eq!(p.step, Step::Delete(ids(&["0"])));
    assert_eq!(p.canary.unwrap().phase, CanaryPhase::Failed);
    // Every instance on the latest model (the old ones replaced after failing): Ready, whatever
    // the failed canary says.
    let all_new = with_canary(case(2, int(1), int(0), vec![i("3"), i("4")]), 1, 30)
        .canary(canary_status(CanaryPhase::Failed, 1, None, 30))
        .plan();
    let ready = all_new.ready.unwrap();
    assert_eq!((all_new.step, ready.holds, ready.reason), (Step::Wait, true, Reason::Ready));
}

fn interrupted(mut inst: Instance, kind: crate::resources::InterruptionKind) -> Instance {
    inst.interrupted = Some(kind);
    inst
}

#[test]
fn an_interrupted_instance_goes_at_once_under_a_budget_of_zero_and_is_replaced_beside_the_surge() {
    use crate::resources::{DisruptionBudget, DisruptionReason, InterruptionKind};
    let spot = |id| interrupted(i(id), InterruptionKind::SpotInterruption);
    let zero = DisruptionBudget {
        machines: int(0),
        schedule: None,
        duration: None,
        time_zone: None,
        reasons: vec![DisruptionReason::Remediation, DisruptionReason::ScaleDown, DisruptionReason::Rollout],
    };
    for managed in [false, true] {
        let mut c = case(3, int(0), int(0), vec![i("0"), spot("1"), i("2")]);
        c.budgets = vec![zero.clone()];
        c.nodes_managed = managed;
        // First its Machine is deleted (drained before the deadline with nodes), never held.
        let p = c.plan();
        assert_eq!(p.step, Step::DeleteMachines(ids(&["1"])), "managed {managed}: {:?}", p.notes);
        assert!(p.notes.contains(&Note::Interrupted { instances: ids(&["1"]) }));
        // While the cloud still holds it the pool grows by one for its replacement, beside
        // maxSurge 0.
        let p = c.clone().deleting("1").plan();
        assert_eq!(p.step, Step::Apply { capacity: 4 }, "managed {managed}: {:?}", p.notes);
        // Its deletion sent (the cloud's capacity one lower), the capacity is replicas again,
        // applied once the instance is gone (never below what the cloud holds).
        let mut c = c.clone().deleting("1").applied("rev", 4);
        c.instances = vec![i("0"), state(spot("1"), InstanceState::Deleting), i("2"), i("3")];
        let p = c.plan();
        assert_eq!(p.step, Step::Wait, "managed {managed}: {:?}", p.notes);
        assert!(p.notes.contains(&Note::ApplyHeld { capacity: 3, held: 4 }), "{:?}", p.notes);
        c.instances.remove(1);
        c.deleting.clear();
        let p = c.plan();
        assert_eq!(p.step, Step::Apply { capacity: 3 }, "managed {managed}: {:?}", p.notes);
    }
    // A rebalance recommendation is no interruption here: it is a remediation, held by the budget.
    let mut c = case(3, int(1), int(0), vec![i("0"), interrupted(i("1"), InterruptionKind::RebalanceRecommendation)]);
    c.budgets = vec![zero];
    assert!(c.plan().notes.iter().all(|n| !matches!(n, Note::Interrupted { .. })));
}
