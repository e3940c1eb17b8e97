use super::*;
use serde_json::json;

fn pod(extra: serde_json::Value) -> Pod {
    let mut base = json!({
        "metadata": {"name": "p", "namespace": "default"},
        "spec": {"containers": [{"name": "c"}], "terminationGracePeriodSeconds": 30},
        "status": {"phase": "Running"}
    });
    merge(&mut base, extra);
    serde_json::from_value(base).unwrap()
}

fn merge(a: &mut serde_json::Value, b: serde_json::Value) {
    match (a, b) {
        (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k).or_insert(serde_json::Value::Null), v);
            }
        }
        (a, b) => *a = b,
    }
}

fn at(s: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap()
}

#[test]
fn each_pod_is_evicted_skipped_or_deleted_in_time_for_the_deadline() {
    let deadline = at(3600);
    let ds = json!({"metadata": {"ownerReferences": [
        {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "agent", "uid": "u", "controller": true}]}});
    let rs = json!({"metadata": {"ownerReferences": [
        {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web", "uid": "u", "controller": true}]}});
    let cases = [
        ("a workload pod long before the deadline", pod(rs.clone()), at(0), false, PodStep::Evict),
        ("a DaemonSet pod", pod(ds.clone()), at(0), false, PodStep::Skip(Skip::DaemonSet)),
        (
            "a mirror pod",
            pod(json!({"metadata": {"annotations": {MIRROR_ANNOTATION: "x"}}})),
            at(0),
            false,
            PodStep::Skip(Skip::Mirror),
        ),
        (
            "a completed pod",
            pod(json!({"status": {"phase": "Succeeded"}})),
            at(0),
            false,
            PodStep::Skip(Skip::Terminal),
        ),
        ("a failed pod", pod(json!({"status": {"phase": "Failed"}})), at(0), false, PodStep::Skip(Skip::Terminal)),
        (
            "a terminating pod before the deadline",
            pod(json!({"metadata": {"deletionTimestamp": "2027-01-15T08:00:00Z"}})),
            at(0),
            false,
            PodStep::WaitGone,
        ),
        (
            "a terminating pod past the deadline",
            pod(json!({"metadata": {"deletionTimestamp": "2027-01-15T08:00:00Z"}})),
            at(3601),
            false,
            PodStep::Skip(Skip::StuckTerminating),
        ),
        ("31 s before the deadline (grace 30)", pod(rs.clone()), at(3569), false, PodStep::Evict),
        (
            "30 s before the deadline (grace 30)",
            pod(rs.clone()),
            at(3570),
            false,
            PodStep::Delete { grace_seconds: 30 },
        ),
        ("10 s before the deadline", pod(rs.clone()), at(3590), false, PodStep::Delete { grace_seconds: 10 }),
        ("at the deadline: at least 1 s", pod(rs.clone()), at(3600), false, PodStep::Delete { grace_seconds: 1 }),
        ("past the deadline", pod(rs.clone()), at(4000), false, PodStep::Delete { grace_seconds: 1 }),
        (
            "grace 0 deleted only at the deadline",
            pod(json!({"spec": {"terminationGracePeriodSeconds": 0}})),
            at(3599),
            false,
            PodStep::Evict,
        ),
        ("a dead node: deleted at once", pod(rs.clone()), at(0), true, PodStep::Delete { grace_seconds: 0 }),
        ("a dead node keeps DaemonSet pods", pod(ds), at(0), true, PodStep::Skip(Skip::DaemonSet)),
    ];
    for (what, p, now, dead, want) in cases {
        assert_eq!(step(&p, now, deadline, dead), want, "{what}");
    }
}

#[test]
fn the_next_forced_deletion_is_the_pod_with_the_longest_grace() {
    let pods = [
        pod(json!({"spec": {"terminationGracePeriodSeconds": 10}})),
        pod(json!({"spec": {"terminationGracePeriodSeconds": 120}})),
    ];
    assert_eq!(next_forced(&pods, at(3600)), Some(at(3480)));
    assert_eq!(next_forced(&[], at(3600)), None);
}

#[test]
fn a_refusal_names_the_disruption_budget() {
    let status: kube::core::Status = serde_json::from_value(json!({
        "status": "Failure", "code": 429, "reason": "TooManyRequests",
        "message": "Cannot evict pod as it would violate the pod's disruption budget.",
        "details": {"causes": [{"reason": "DisruptionBudget",
            "message": "The disruption budget web-pdb needs 3 healthy pods and has 3 currently"}]}
    }))
    .unwrap();
    let r = refusal(&status);
    assert_eq!(r.budget.as_deref(), Some("web-pdb"));
    assert!(r.message.contains("needs 3 healthy pods"), "{}", r.message);
    let plain: kube::core::Status =
        serde_json::from_value(json!({"code": 429, "message": "too many requests"})).unwrap();
    assert_eq!(refusal(&plain), Refusal { budget: None, message: "too many requests".into() });
}

#[test]
fn a_budget_that_can_never_allow_an_eviction_is_recognised() {
    let pdb = |generation: i64, observed: i64, expected: i32, healthy: i32, allowed: i32| -> PodDisruptionBudget {
        serde_json::from_value(json!({
            "metadata": {"name": "b", "generation": generation},
            "spec": {},
            "status": {"observedGeneration": observed, "expectedPods": expected, "currentHealthy": healthy,
                       "desiredHealthy": expected, "disruptionsAllowed": allowed}
        }))
        .unwrap()
    };
    assert!(never_allows_eviction(&pdb(1, 1, 3, 3, 0)), "all healthy, none allowed: minAvailable = replicas");
    assert!(!never_allows_eviction(&pdb(1, 1, 3, 2, 0)), "one unhealthy: waiting can help");
    assert!(!never_allows_eviction(&pdb(1, 1, 3, 3, 1)), "one allowed");
    assert!(!never_allows_eviction(&pdb(2, 1, 3, 3, 0)), "status not current");
    assert!(!never_allows_eviction(&pdb(1, 1, 0, 0, 0)), "no pods expected");
}
