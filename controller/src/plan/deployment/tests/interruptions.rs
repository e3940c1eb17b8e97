//! Interruptions in the deployment planner: what the cloud takes goes at once and is replaced
//! beside the surge, whatever the budgets; a rebalance recommendation is a voluntary
//! replacement within them.

use super::*;

/// A deployment of `replicas` on the spec's revision (rolled out), with a budget of `machines`
/// for every reason a budget may name.
fn budgeted(replicas: i64, machines: i64) -> MachineDeployment {
    let mut md = deployment(replicas);
    md.status.current_revision = new_rev();
    md.spec.disruption.budgets = vec![DisruptionBudget {
        machines: int(machines),
        schedule: None,
        duration: None,
        time_zone: None,
        reasons: vec![
            DisruptionReason::Rollout,
            DisruptionReason::ScaleDown,
            DisruptionReason::Remediation,
            DisruptionReason::Rebalance,
        ],
    }];
    md
}

impl Fx {
    /// The cloud takes it (`kind`), 20 s after the plan.
    pub(super) fn interrupted(mut self, kind: InterruptionKind) -> Self {
        self.0.status.interruption = Some(Interruption {
            kind,
            event_id: format!("ev-{}", self.0.metadata.name),
            not_before: Some(now() + chrono::Duration::seconds(20)),
            received_at: now(),
            observed_at: None,
            action: "Terminate".into(),
            offering: None,
            message: String::new(),
        });
        self
    }
}

fn six() -> Vec<Fx> {
    ["a", "b", "c", "d", "e", "f"].iter().enumerate().map(|(i, n)| Fx::new(n).at(i as i64)).collect()
}

#[test]
fn three_of_six_interrupted_under_a_budget_of_zero_all_go_at_once_and_are_replaced_beside_the_surge() {
    let md = budgeted(6, 0);
    let mut machines = six();
    for i in [0, 2, 4] {
        let m = std::mem::replace(&mut machines[i], Fx::new("x"));
        machines[i] = m.interrupted(InterruptionKind::SpotInterruption);
    }
    let p = run(&md, machines, true);
    assert_eq!(names(&p.interrupted), ["a", "c", "e"]);
    // maxSurge 1 alone would allow one; the interruptions add three.
    assert_eq!(p.create, 3, "{:?}", p.notes);
    assert_eq!(p.replaces.len(), 3);
    assert!(p.replaces[0].starts_with("a/SpotInterruption/"), "{:?}", p.replaces);
    assert!(p.delete.is_empty() && p.mark.is_empty());
    assert!(!p.settled);
    assert!(p.notes.contains(&Note::Interrupted { machines: vec!["a".into(), "c".into(), "e".into()] }));
    let report = p.disruption.as_ref().unwrap();
    assert!(report.held.iter().all(|h| h.reason != DisruptionReason::Interruption), "{:?}", report.held);
    assert!(p.events.iter().any(|e| e.reason == EventReason::ReplacingInterrupted));
}

#[test]
fn interrupted_machines_being_deleted_keep_their_replacements_room_and_no_more() {
    let md = budgeted(3, 0);
    // a was interrupted and is being deleted; its replacement d is on its way.
    let machines = vec![
        Fx::new("a").interrupted(InterruptionKind::Terminated).terminating(),
        Fx::new("b"),
        Fx::new("c"),
        Fx::new("d").phase(Phase::Creating),
    ];
    let p = run(&md, machines, true);
    assert!(p.interrupted.is_empty());
    assert_eq!(p.create, 0, "the replacement exists: nothing more ({:?})", p.notes);
    assert!(p.delete.is_empty(), "d is not an excess: a is still being deleted");
}

#[test]
fn the_hard_cap_is_replicas() {
    let md = budgeted(2, 0);
    let machines = vec![
        Fx::new("a").interrupted(InterruptionKind::SpotInterruption),
        Fx::new("b").interrupted(InterruptionKind::SpotInterruption),
        // Two machines of an earlier interruption still being deleted.
        Fx::new("e").interrupted(InterruptionKind::Terminated).terminating(),
        Fx::new("f").interrupted(InterruptionKind::Terminated).terminating(),
    ];
    let p = run(&md, machines, true);
    assert_eq!(names(&p.interrupted), ["a", "b"]);
    // Four interrupted, but the cap is replicas: 2 + maxSurge 1 + 2 = 5, and 4 exist.
    assert_eq!(p.create, 1);
    assert!(p.notes.contains(&surge_exhausted(5, 4, 2)), "{:?}", p.notes);
}

#[test]
fn a_rebalance_recommendation_is_a_voluntary_replacement_within_the_budgets() {
    // Budget 0: held.
    let md = budgeted(3, 0);
    let machines =
        vec![Fx::new("a").interrupted(InterruptionKind::RebalanceRecommendation), Fx::new("b"), Fx::new("c")];
    let p = run(&md, machines, true);
    assert!(p.interrupted.is_empty() && p.mark.is_empty(), "{:?}", p.notes);
    assert!(
        p.notes.iter().any(|n| matches!(n, Note::Held { reason: DisruptionReason::Rebalance, .. })),
        "{:?}",
        p.notes
    );
    // Budget 1: marked for a replace-before-remove.
    let md = budgeted(3, 1);
    let machines =
        vec![Fx::new("a").interrupted(InterruptionKind::RebalanceRecommendation), Fx::new("b"), Fx::new("c")];
    let p = run(&md, machines, true);
    assert_eq!(p.mark, vec![("a".to_string(), Remediation::Recommended)]);
    // Marked: its replacement first, then it goes.
    let machines = vec![
        Fx::new("a").interrupted(InterruptionKind::RebalanceRecommendation).remediating(),
        Fx::new("b"),
        Fx::new("c"),
    ];
    let p = run(&md, machines, true);
    assert_eq!(p.create, 1, "{:?}", p.notes);
    assert!(p.remediate.is_empty(), "it waits for its replacement");
}
