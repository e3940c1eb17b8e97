//! The pool planner over tables of situations.

use std::collections::HashSet;

use super::*;
use crate::resources::IntOrPercent;

fn i(id: &str) -> Instance {
    Instance { id: id.into(), state: InstanceState::Running, running: true, latest_model: true }
}

fn old(id: &str) -> Instance {
    Instance { latest_model: false, ..i(id) }
}

fn state(mut inst: Instance, s: InstanceState) -> Instance {
    inst.state = s;
    inst
}

struct Case {
    replicas: i64,
    strategy: RollingUpdate,
    applied_revision: &'static str,
    applied_capacity: i64,
    instances: Vec<Instance>,
    deleting: HashSet<String>,
    annotated: HashSet<String>,
}

fn case(replicas: i64, surge: IntOrPercent, unavailable: IntOrPercent, instances: Vec<Instance>) -> Case {
    Case {
        replicas,
        strategy: RollingUpdate { max_surge: surge, max_unavailable: unavailable },
        applied_revision: "rev",
        applied_capacity: replicas,
        instances,
        deleting: HashSet::new(),
        annotated: HashSet::new(),
    }
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
    fn plan(&self) -> Plan {
        plan(Observed {
            replicas: self.replicas,
            strategy: &self.strategy,
            revision: "rev",
            applied_revision: self.applied_revision,
            applied_capacity: self.applied_capacity,
            instances: &self.instances,
            deleting: &self.deleting,
            annotated: &self.annotated,
        })
    }
}

fn int(n: i64) -> IntOrPercent {
    IntOrPercent::Int(n)
}

fn pct(s: &str) -> IntOrPercent {
    IntOrPercent::Str(s.into())
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
            "failed, annotated, unready old instances go first; unready ones cost no availability",
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
            Delete(ids(&["5", "1", "4"])),
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
        assert_eq!(c.plan().step, want, "{name}");
    }
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
/// upgrades never delete ready instances below `replicas − maxUnavailable`.
#[test]
fn pool_upgrades_keep_within_max_unavailable() {
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
                        let p = c.plan();
                        let limits = Limits::resolve(replicas, &c.strategy);
                        let ready = c.instances.iter().filter(|i| i.ready()).count() as i64;
                        let label = format!("replicas {replicas} surge {surge} unavailable {unavailable} old {old_count} unready {unready}");
                        match &p.step {
                            Step::Upgrade(ids) => {
                                let not_ready = c.instances.len() as i64 - ready;
                                assert!(ids.len() as i64 + not_ready <= limits.max_unavailable, "{label}: {ids:?}");
                            }
                            Step::Delete(ids) => {
                                let ready_deleted =
                                    c.instances.iter().filter(|i| i.ready() && ids.contains(&i.id)).count() as i64;
                                assert!(
                                    ready - ready_deleted >= (replicas - limits.max_unavailable).min(ready),
                                    "{label}: {ids:?}"
                                );
                                assert!(ids
                                    .iter()
                                    .all(|id| c.instances.iter().any(|i| &i.id == id && !i.latest_model)));
                            }
                            Step::Apply { capacity } => assert!(*capacity <= replicas + limits.max_surge, "{label}"),
                            Step::Wait => {}
                        }
                    }
                }
            }
        }
    }
}
