//! Failure domains in the deployment planner: placement, the spread through a rolling update
//! and a scale-down, fail-over from a domain that refuses creates, surge-first rebalancing and
//! a domain outage.

use super::*;

/// A deployment of `replicas` on the spec's revision (rolled out) over zones a, b and c.
fn zoned(replicas: i64) -> MachineDeployment {
    let mut md = deployment(replicas);
    md.status.current_revision = new_rev();
    md.spec.failure_domains = ["a", "b", "c"]
        .map(|z| FailureDomain {
            name: z.into(),
            provider_spec: Some(serde_json::json!({ "zone": format!("zone-{z}") })),
            weight: 1,
            priority: 0,
        })
        .to_vec();
    md
}

/// A deployment of `replicas` over spot in zones a and b (priority 1) with on-demand in zone a
/// as the fallback (priority 0).
fn spot_first(replicas: i64) -> MachineDeployment {
    let mut md = deployment(replicas);
    md.status.current_revision = new_rev();
    md.spec.failure_domains =
        [("spot-a", "zone-a", "spot", 1), ("spot-b", "zone-b", "spot", 1), ("od", "zone-a", "on-demand", 0)]
            .map(|(name, zone, capacity, priority)| FailureDomain {
                name: name.into(),
                provider_spec: Some(serde_json::json!({ "zone": zone, "capacityType": capacity })),
                weight: 1,
                priority,
            })
            .to_vec();
    md
}

impl Fx {
    fn domain(mut self, d: &str) -> Self {
        self.0.spec.failure_domain = Some(d.into());
        self
    }
    /// Its create is refused for capacity (still being created, waiting on QuotaExceeded).
    fn refused(mut self) -> Self {
        self.0.status.phase = Phase::Creating;
        set_condition(
            &mut self.0.status.conditions,
            ConditionType::Ready,
            false,
            Reason::QuotaExceeded,
            "no capacity for small in zone-c",
        );
        self.0.status.last_operation = Some(LastOperation {
            op_type: OperationType::Create,
            state: OperationState::Failed,
            code: "ResourceExhausted".into(),
            reason: "INSUFFICIENT_CAPACITY".into(),
            message: "no capacity for small in zone-c".into(),
            request_id: "r".into(),
            time: t0(),
        });
        self
    }
    /// The cloud reclaims its spot capacity, heard now (the interruptions tests' fixture).
    fn reclaimed(self) -> Self {
        self.interrupted(InterruptionKind::SpotInterruption)
    }
    fn rebalancing(mut self, value: &str) -> Self {
        self.0.metadata.annotations.insert(ANNOTATION_REBALANCE.into(), value.into());
        self
    }
}

/// `n` Running machines named `{d}{i}` in domain `d`.
fn zone(d: &str, n: usize) -> Vec<Fx> {
    (0..n).map(|i| Fx::new(&format!("{d}{i}")).at(i as i64).domain(d)).collect()
}

fn per_domain(p: &Plan) -> Vec<(String, i64, i64, i64)> {
    p.status.failure_domains.iter().map(|d| (d.name.clone(), d.desired, d.current, d.available)).collect()
}

#[test]
fn nine_replicas_spread_three_per_zone_from_nothing() {
    let mut md = zoned(9);
    md.status.current_revision = String::new();
    let p = run(&md, vec![], true);
    assert_eq!(p.create, 9);
    assert_eq!(names(&p.placements), ["a", "b", "c", "a", "b", "c", "a", "b", "c"]);
    assert_eq!(per_domain(&p).iter().map(|d| d.1).collect::<Vec<_>>(), [3, 3, 3], "each domain's share");
}

#[test]
fn weights_share_the_machines() {
    let mut md = zoned(8);
    md.status.current_revision = String::new();
    md.spec.failure_domains[0].weight = 2;
    let p = run(&md, vec![], true);
    let count = |z: &str| p.placements.iter().filter(|d| *d == z).count();
    assert_eq!((count("a"), count("b"), count("c")), (4, 2, 2));
}

#[test]
fn a_rolling_update_keeps_the_spread_surge_in_one_zone_and_the_old_machine_from_it() {
    let md = zoned(9);
    let old: Vec<Fx> = ["a", "b", "c"].iter().flat_map(|z| zone(z, 3)).map(Fx::old).collect();
    // The surge machine goes to the first least-populated zone.
    let p = run(&md, old, true);
    assert_eq!((p.create, names(&p.placements)), (1, vec!["a"]));
    assert!(p.delete.is_empty(), "maxUnavailable 0: nothing goes before the new machine runs");
    // Once it runs, the old machine that goes is from the zone it crowds.
    let mut machines: Vec<Fx> = ["a", "b", "c"].iter().flat_map(|z| zone(z, 3)).map(Fx::old).collect();
    machines.push(Fx::new("new-a").domain("a").at(100));
    let p = run(&md, machines, true);
    assert_eq!(names(&p.delete), ["a0"], "the oldest in the most-populated zone");
    // It is gone (3/3/3 again, counting the new one): the next surge machine goes to a zone
    // with the most old machines, where the next old machine leaves.
    let mut machines: Vec<Fx> = ["a", "b", "c"].iter().flat_map(|z| zone(z, 3)).map(Fx::old).collect();
    machines.remove(0);
    machines.push(Fx::new("new-a").domain("a").at(100));
    let p = run(&md, machines, true);
    assert_eq!(names(&p.placements), ["b"]);
    // Zone a is all new: the last old machines go from b and c, never leaving a zone short.
    let mut machines: Vec<Fx> = ["b", "c"].iter().flat_map(|z| zone(z, 3)).map(Fx::old).collect();
    machines.extend((0..3).map(|i| Fx::new(&format!("new-a{i}")).domain("a").at(100)));
    let p = run(&md, machines, true);
    assert_eq!(names(&p.placements), ["b"]);
}

#[test]
fn a_scale_down_takes_from_the_most_populated_zones_first() {
    let md = zoned(6);
    let mut machines: Vec<Fx> = zone("a", 4);
    machines.extend(zone("b", 3));
    machines.extend(zone("c", 2));
    let p = run(&md, machines, true);
    let mut gone: Vec<&str> = names(&p.delete);
    gone.sort();
    assert_eq!(gone, ["a0", "a1", "b0"], "4/3/2 → 2/2/2");
}

#[test]
fn broken_machines_go_before_the_spread_is_considered() {
    let md = zoned(5);
    let mut machines: Vec<Fx> = zone("a", 3);
    machines.extend(zone("b", 2));
    machines.push(Fx::new("c0").domain("c").marked_for_deletion());
    let p = run(&md, machines, true);
    assert_eq!(names(&p.delete), ["c0"]);
}

#[test]
fn a_zone_that_refuses_creates_is_closed_and_its_machines_go_elsewhere_without_touching_the_budget() {
    let mut md = zoned(9);
    md.status.rollout = Some(RolloutState { revision: new_rev(), started: t0(), last_progress: t0(), failures: 0 });
    let mut machines: Vec<Fx> = zone("a", 3);
    machines.extend(zone("b", 3));
    machines.extend((0..3).map(|i| Fx::new(&format!("c{i}")).domain("c").refused()));
    let p = run(&md, machines, true);
    let c = &p.status.failure_domains[2];
    assert_eq!((c.reason.as_str(), c.backoff_seconds), ("InsufficientCapacity", 60));
    assert_eq!(c.unavailable_until, Some(now() + chrono::Duration::seconds(60)));
    assert!(p.events.iter().any(|e| e.reason == EventReason::FailureDomainUnavailable && e.message.contains("c0")));
    let mut gone = names(&p.delete);
    gone.sort();
    assert_eq!(gone, ["c0", "c1", "c2"], "withdrawn");
    assert!(p.mark.is_empty(), "a withdrawal is no remediation");
    assert_eq!(names(&p.placements), ["a"], "the surge room allows one now; never zone c");
    assert_eq!(p.status.rollout.as_ref().map(|r| r.failures), Some(0), "the failure budget is untouched");
    assert_eq!(p.recheck_at, Some(now() + chrono::Duration::seconds(60)), "planned again when it opens");
}

#[test]
fn a_refusal_after_the_backoff_doubles_it_up_to_the_maximum() {
    let mut md = zoned(3);
    md.spec.failure_domain_backoff = FailureDomainBackoff { initial_seconds: 60, max_seconds: 100 };
    md.status.failure_domains =
        ["a", "b", "c"].map(|z| FailureDomainStatus { name: z.into(), ..Default::default() }).to_vec();
    md.status.failure_domains[2].backoff_seconds = 60;
    md.status.failure_domains[2].unavailable_until = Some(now() - chrono::Duration::seconds(1));
    md.status.failure_domains[2].reason = "InsufficientCapacity".into();
    let machines = vec![Fx::new("a0").domain("a"), Fx::new("b0").domain("b"), Fx::new("c9").domain("c").refused()];
    let p = run(&md, machines, true);
    assert!(p.events.iter().any(|e| e.reason == EventReason::FailureDomainAvailable), "{:?}", p.events);
    assert_eq!(p.status.failure_domains[2].backoff_seconds, 100, "60 doubled, capped at 100");
}

#[test]
fn no_open_zone_keeps_the_refused_machines_trying_where_they_are() {
    let mut md = zoned(2);
    md.spec.failure_domains.truncate(1);
    let machines = vec![Fx::new("a0").domain("a").refused(), Fx::new("a1").domain("a").refused()];
    let p = run(&md, machines, true);
    assert!(p.delete.is_empty());
    assert_eq!(p.create, 0);
}

#[test]
fn a_recovered_zone_is_rebalanced_surge_first_one_machine_at_a_time() {
    let md = zoned(9);
    let mut machines: Vec<Fx> = zone("a", 5);
    machines.extend(zone("b", 4));
    let p = run(&md, machines, true);
    assert_eq!((p.create, names(&p.placements), p.rebalance.as_deref()), (1, vec!["c"], Some("a/9")));
    assert!(p.delete.is_empty(), "nothing goes before its replacement runs");
    assert!(!p.settled);
    // The new machine is on its way: nothing goes.
    let mut machines: Vec<Fx> = zone("a", 5);
    machines.extend(zone("b", 4));
    machines.push(Fx::new("c-new").domain("c").phase(Phase::Creating).rebalancing("a/9"));
    let p = run(&md, machines, true);
    assert!(p.delete.is_empty() && p.create == 0, "{:?}", p.notes);
    assert!(p.notes.contains(&Note::RebalanceWaiting { machine: "c-new".into() }));
    let r = p.status.rebalance.as_ref().map(|r| (r.from.as_str(), r.to.as_str(), r.machine.as_str()));
    assert_eq!(r, Some(("a", "c", "c-new")));
    // It runs: one in the crowded zone goes, as a Rebalance.
    let mut machines: Vec<Fx> = zone("a", 5);
    machines.extend(zone("b", 4));
    machines.push(Fx::new("c-new").domain("c").rebalancing("a/9"));
    let p = run(&md, machines, true);
    assert_eq!(names(&p.delete), ["a0"]);
    assert!(p.events.iter().any(|e| e.reason == EventReason::Rebalanced));
    let asked = p.disruption.as_ref().map(|r| r.allowed.get(&DisruptionReason::Rebalance).copied());
    assert!(asked.flatten().is_some(), "asked as a Rebalance: {:?}", p.disruption);
}

#[test]
fn the_next_move_waits_for_its_own_machine_not_the_last_ones() {
    let md = zoned(9);
    // The first move is done (its machine still annotated); the second one's is on its way.
    let mut machines: Vec<Fx> = zone("a", 4);
    machines.extend(zone("b", 4));
    machines.push(Fx::new("c-first").domain("c").rebalancing("a/9").at(50));
    machines.push(Fx::new("c-second").domain("c").phase(Phase::Creating).rebalancing("b/9").at(90));
    let p = run(&md, machines, true);
    assert!(p.delete.is_empty(), "nothing goes before c-second runs: {:?}", p.delete);
    assert!(p.notes.contains(&Note::RebalanceWaiting { machine: "c-second".into() }));
    assert_eq!(p.status.rebalance.as_ref().map(|r| r.machine.as_str()), Some("c-second"));
}

#[test]
fn a_rebalance_within_skew_or_disabled_does_nothing() {
    let md = zoned(8);
    let mut machines: Vec<Fx> = zone("a", 3);
    machines.extend(zone("b", 3));
    machines.extend(zone("c", 2));
    let p = run(&md, machines, true);
    assert_eq!((p.create, p.rebalance.clone()), (0, None), "3/3/2 is within skew 1");
    let mut md = zoned(9);
    md.spec.rebalance.enabled = false;
    let mut machines: Vec<Fx> = zone("a", 5);
    machines.extend(zone("b", 4));
    let p = run(&md, machines, true);
    assert_eq!((p.create, p.rebalance), (0, None));
    // No surge room at all: the plan says why nothing moves.
    let md = surge(zoned(9), int(0), int(1));
    let mut machines: Vec<Fx> = zone("a", 5);
    machines.extend(zone("b", 4));
    let p = run(&md, machines, true);
    assert_eq!((p.create, p.rebalance.clone()), (0, None));
    assert!(p.notes.contains(&Note::RebalanceNeedsSurge), "{:?}", p.notes);
}

#[test]
fn a_zone_whose_nodes_are_all_not_ready_is_degraded_and_gets_no_replacements() {
    let md = zoned(9);
    let mut machines: Vec<Fx> = zone("a", 3);
    machines.extend(zone("b", 3));
    machines.extend(zone("c", 3).into_iter().map(Fx::node_not_ready));
    // A health check asks for one of them to be remediated.
    machines[6] = Fx::new("c0").domain("c").node_not_ready().unhealthy();
    let stored: Vec<Fx> = machines
        .iter()
        .map(|f| if f.0.metadata.name == "c0" { Fx(f.0.clone()).remediating() } else { Fx(f.0.clone()) })
        .collect();
    let p = run(&md, machines, true);
    assert_eq!(condition(&p, "FailureDomainDegraded"), ("True", "DomainOutage"));
    assert_eq!(p.status.failure_domains[2].reason, "Degraded");
    assert_eq!(p.mark.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["c0"]);
    // Once the mark is stored: its replacement goes to a healthy zone.
    let mut md = md;
    md.status = p.status;
    let p = run(&md, stored, true);
    assert_eq!(names(&p.placements), ["a"], "its replacement goes to a healthy zone");
    // One node down in a zone is a node outage, not a zone outage.
    let mut machines: Vec<Fx> = zone("a", 3);
    machines.extend(zone("b", 3));
    machines.extend(zone("c", 3));
    machines[6] = Fx::new("c0").domain("c").node_not_ready();
    let p = run(&zoned(9), machines, true);
    assert_eq!(condition(&p, "FailureDomainDegraded"), ("", ""));
}

#[test]
fn machines_in_no_listed_domain_move_into_the_domains() {
    let md = zoned(3);
    let machines = vec![Fx::new("x0"), Fx::new("x1"), Fx::new("x2")];
    let p = run(&md, machines, true);
    assert_eq!((p.create, names(&p.placements), p.rebalance.as_deref()), (1, vec!["a"], Some("-/3")));
}

#[test]
fn spot_first_fills_the_highest_priority_and_leaves_the_fallback_empty() {
    let mut md = spot_first(4);
    md.status.current_revision = String::new();
    let p = run(&md, vec![], true);
    assert_eq!(names(&p.placements), ["spot-a", "spot-b", "spot-a", "spot-b"]);
    assert_eq!(per_domain(&p).iter().map(|d| d.1).collect::<Vec<_>>(), [2, 2, 0], "the fallback's share is 0");
}

#[test]
fn spot_refused_for_capacity_falls_back_to_on_demand() {
    let md = spot_first(4);
    let mut machines = zone("spot-a", 2);
    machines.push(Fx::new("spot-b0").domain("spot-b").refused());
    machines.push(Fx::new("spot-b1").domain("spot-b").refused());
    let p = run(&md, machines, true);
    assert_eq!(p.status.failure_domains[1].reason, "InsufficientCapacity");
    let mut gone = names(&p.delete);
    gone.sort();
    assert_eq!(gone, ["spot-b0", "spot-b1"], "withdrawn");
    // spot-a is still open: it takes the replacements, the fallback only once every spot domain
    // is closed.
    assert!(p.placements.iter().all(|d| d == "spot-a"), "{:?}", p.placements);
    // Both spot domains closed: on-demand takes them.
    let mut md = spot_first(4);
    md.status.failure_domains =
        ["spot-a", "spot-b", "od"].map(|z| FailureDomainStatus { name: z.into(), ..Default::default() }).to_vec();
    md.status.failure_domains[0].unavailable_until = Some(now() + chrono::Duration::seconds(30));
    md.status.failure_domains[0].reason = "InsufficientCapacity".into();
    md.status.failure_domains[0].backoff_seconds = 60;
    let machines = vec![Fx::new("spot-b0").domain("spot-b").refused(), Fx::new("spot-b1").domain("spot-b").refused()];
    let p = run(&md, machines, true);
    assert!(!p.placements.is_empty() && p.placements.iter().all(|d| d == "od"), "{:?}", p.placements);
    assert_eq!(per_domain(&p).iter().map(|d| d.1).collect::<Vec<_>>(), [0, 0, 4]);
}

#[test]
fn once_spot_takes_machines_again_the_fallback_moves_back_surge_first() {
    let md = spot_first(4);
    let mut machines = zone("spot-a", 2);
    machines.extend(zone("od", 2));
    let p = run(&md, machines, true);
    assert_eq!((p.create, names(&p.placements), p.rebalance.as_deref()), (1, vec!["spot-b"], Some("od/4")));
    assert!(p.delete.is_empty(), "nothing goes before its replacement runs");
    // The new spot machine runs: an on-demand one goes, never a spot one.
    let mut machines = zone("spot-a", 2);
    machines.extend(zone("od", 2));
    machines.push(Fx::new("spot-b-new").domain("spot-b").rebalancing("od/4"));
    let p = run(&md, machines, true);
    assert_eq!(names(&p.delete), ["od0"]);
    // A scale-down takes the fallback's machines first too.
    let md = spot_first(2);
    let mut machines = zone("spot-a", 1);
    machines.extend(zone("spot-b", 1));
    machines.extend(zone("od", 1));
    let p = run(&md, machines, true);
    assert_eq!(names(&p.delete), ["od0"]);
}

#[test]
fn a_reclaimed_spot_machine_closes_its_domain_once_and_its_replacement_goes_elsewhere() {
    let md = spot_first(4);
    let mut machines = zone("spot-a", 2);
    machines.extend(zone("spot-b", 1));
    machines.push(Fx::new("spot-b1").domain("spot-b").at(1).reclaimed());
    let machines = &mut machines;
    let p = run(&md, machines.clone(), true);
    let b = &p.status.failure_domains[1];
    assert_eq!((b.reason.as_str(), b.backoff_seconds), ("CapacityReclaimed", 60), "{b:?}");
    assert_eq!(names(&p.interrupted), ["spot-b1"]);
    assert_eq!(names(&p.placements), ["spot-a"], "not back into the reclaimed offering");
    assert!(p
        .events
        .iter()
        .any(|e| e.reason == EventReason::FailureDomainUnavailable && e.message.contains("reclaimed")));
    // Planned again with that status: the same interruption does not mark it again.
    let mut md2 = md.clone();
    md2.status.failure_domains = p.status.failure_domains.clone();
    let p2 = run(&md2, machines.clone(), true);
    assert_eq!(p2.status.failure_domains[1].backoff_seconds, 60, "marked once");
    assert!(!p2.events.iter().any(|e| e.reason == EventReason::FailureDomainUnavailable));
    // 61 s later its backoff is over: the old interruption (still draining) does not close it
    // again.
    let mut md3 = md.clone();
    md3.status.failure_domains = p.status.failure_domains.clone();
    md3.status.failure_domains[1].unavailable_until = Some(now() - chrono::Duration::seconds(1));
    for m in machines.iter_mut() {
        if let Some(i) = m.0.status.interruption.as_mut() {
            i.received_at = now() - chrono::Duration::seconds(61);
        }
    }
    let p3 = run(&md3, machines.clone(), true);
    assert_ne!(p3.status.failure_domains[1].reason, "CapacityReclaimed", "{:?}", p3.status.failure_domains);
}

#[test]
fn a_reclaim_never_closes_the_last_open_domain_and_a_spot_termination_is_a_reclaim() {
    // Only spot-b is open (spot-a and the fallback closed): its reclaim leaves it open, and the
    // replacement is created there.
    let mut md = spot_first(2);
    md.status.failure_domains =
        ["spot-a", "spot-b", "od"].map(|z| FailureDomainStatus { name: z.into(), ..Default::default() }).to_vec();
    for i in [0, 2] {
        md.status.failure_domains[i].unavailable_until = Some(now() + chrono::Duration::seconds(30));
        md.status.failure_domains[i].reason = "InsufficientCapacity".into();
    }
    let machines = vec![Fx::new("spot-b0").domain("spot-b"), Fx::new("spot-b1").domain("spot-b").at(1).reclaimed()];
    let p = run(&md, machines, true);
    assert!(p.status.failure_domains[1].reason.is_empty(), "{:?}", p.status.failure_domains);
    assert_eq!(names(&p.placements), ["spot-b"], "the replacement still goes somewhere");
    // A spot machine stopped or terminated by the cloud (Azure's eviction, after the fact).
    let md = spot_first(4);
    let mut gone = Fx::new("spot-b1").domain("spot-b").at(1).reclaimed();
    if let Some(i) = gone.0.status.interruption.as_mut() {
        i.kind = InterruptionKind::Terminated;
        i.offering = Some(Offering { capacity_type: "spot".into(), ..Default::default() });
    }
    let mut machines = zone("spot-a", 2);
    machines.extend(zone("spot-b", 1));
    machines.push(gone);
    let p = run(&md, machines, true);
    assert_eq!(p.status.failure_domains[1].reason, "CapacityReclaimed", "{:?}", p.status.failure_domains);
}
