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
    assert_eq!(refusal(&plain), Refusal { budget: None, message: "too many requests".into(), retry_after: None });
    assert_eq!(r.retry_after, None, "a budget that refuses asks for no time");
    let stale: kube::core::Status = serde_json::from_value(json!({
        "code": 429, "message": "Cannot evict pod as it would violate the pod's disruption budget.",
        "details": {"retryAfterSeconds": 10, "causes": [{"reason": "DisruptionBudget",
            "message": "The disruption budget web-pdb is still being processed by the server."}]}
    }))
    .unwrap();
    let r = refusal(&stale);
    assert_eq!((r.budget.as_deref(), r.retry_after), (Some("web-pdb"), Some(Duration::from_secs(10))));
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

/// A target cluster for [`pass`]: evictions of pods labelled `app=web` in `shop` are refused by
/// the budget `web-pdb`; every call is recorded; each takes `latency` (of the paused test clock).
#[derive(Default)]
struct FakeCalls {
    latency: Duration,
    hold: Duration,
    fail_evictions: bool,
    evictions: std::sync::Mutex<Vec<PodKey>>,
    deletions: std::sync::Mutex<Vec<(PodKey, i64)>>,
    budget_reads: std::sync::Mutex<Vec<(String, String)>>,
}

fn api_error(code: u16) -> super::super::Error {
    kube::Error::Api(Box::new(serde_json::from_value(json!({"code": code, "message": "m"})).unwrap()))
}

#[async_trait::async_trait]
impl PodCalls for FakeCalls {
    async fn evict(&self, pod: &Pod, _grace: Option<i64>) -> Result<Evicted, super::super::Error> {
        tokio::time::sleep(self.latency).await;
        if self.fail_evictions {
            return Err(api_error(503));
        }
        let key = PodKey::of(pod);
        self.evictions.lock().unwrap().push(key.clone());
        let web = pod.metadata.labels.as_ref().and_then(|l| l.get("app")).is_some_and(|a| a == "web");
        if web && key.namespace == "shop" {
            return Ok(Evicted::Refused(Refusal {
                budget: Some("web-pdb".into()),
                message: "needs 3".into(),
                retry_after: Some(Duration::from_secs(3)),
            }));
        }
        Ok(Evicted::Accepted)
    }

    async fn delete_pod(&self, pod: &Pod, grace_seconds: i64) -> Result<(), super::super::Error> {
        tokio::time::sleep(self.latency).await;
        self.deletions.lock().unwrap().push((PodKey::of(pod), grace_seconds));
        Ok(())
    }

    async fn budget(&self, namespace: &str, name: &str) -> Result<Option<PodDisruptionBudget>, super::super::Error> {
        self.budget_reads.lock().unwrap().push((namespace.into(), name.into()));
        Ok(Some(
            serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": namespace, "generation": 1},
                "spec": {"selector": {"matchLabels": {"app": "web"}}, "minAvailable": 3},
                "status": {"observedGeneration": 1, "expectedPods": 3, "currentHealthy": 3,
                           "desiredHealthy": 3, "disruptionsAllowed": 0}
            }))
            .unwrap(),
        ))
    }

    fn hold_left(&self) -> Duration {
        self.hold
    }
}

fn named(namespace: &str, name: &str, app: &str) -> Pod {
    pod(json!({"metadata": {"namespace": namespace, "name": name, "labels": {"app": app}}}))
}

fn key(namespace: &str, name: &str) -> PodKey {
    PodKey { namespace: namespace.into(), name: name.into() }
}

#[tokio::test(start_paused = true)]
async fn a_budget_that_refused_is_read_once_and_not_asked_again_in_the_pass() {
    let mut pods: Vec<Pod> = (0..6).map(|i| named("shop", &format!("web-{i}"), "web")).collect();
    pods.push(named("shop", "db-0", "db"));
    pods.push(named("other", "web-0", "web"));
    pods.push(pod(json!({"metadata": {"name": "agent", "ownerReferences": [
        {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "agent", "uid": "u", "controller": true}]}})));
    let calls = FakeCalls::default();
    let out = pass(&calls, &pods, at(0), at(3600), false, false, PASS_BOUND).await.unwrap();

    assert_eq!(
        *calls.evictions.lock().unwrap(),
        [key("shop", "web-0"), key("shop", "db-0"), key("other", "web-0")],
        "one refused eviction for the budget's six pods"
    );
    assert_eq!(*calls.budget_reads.lock().unwrap(), [("shop".to_string(), "web-pdb".to_string())]);
    assert_eq!(out.evicted, [key("shop", "db-0"), key("other", "web-0")]);
    assert_eq!(out.refused.len(), 1);
    let (refused, refusal) = &out.refused[0];
    assert_eq!(*refused, key("shop", "web-0"));
    let budget = out.budget_of(refused, refusal).expect("the refusing budget, as read");
    assert!(budget.never_allows_eviction);
    let spared: Vec<&str> = out
        .spared
        .iter()
        .map(|(k, b)| (k.namespace == "shop" && b == "web-pdb").then_some(k.name.as_str()).unwrap())
        .collect();
    assert_eq!(spared, ["web-1", "web-2", "web-3", "web-4", "web-5"]);
    assert_eq!(out.left.len(), 8, "every pod but the DaemonSet's holds the drain: {:?}", out.left);
    assert!(!out.timed_out);
    assert!(out.deleted.is_empty());
    assert_eq!(out.retry_after(), Some(Duration::from_secs(3)), "the next pass waits as the refusal asked");
}

#[tokio::test(start_paused = true)]
async fn a_pass_stops_at_its_bound_and_reports_every_pod_left() {
    let pods: Vec<Pod> = (0..6).map(|i| named("shop", &format!("db-{i}"), "db")).collect();
    let calls = FakeCalls { latency: Duration::from_secs(4), ..Default::default() };
    let out = pass(&calls, &pods, at(0), at(3600), false, false, PASS_BOUND).await.unwrap();
    assert_eq!(out.evicted, [key("shop", "db-0"), key("shop", "db-1"), key("shop", "db-2")], "at 0, 4 and 8 s");
    assert!(out.timed_out);
    assert_eq!(out.left.len(), 6, "the pods not asked still hold the drain");
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_hold_longer_than_the_bound_stops_the_pass_before_a_call() {
    let pods = [named("shop", "db-0", "db")];
    let calls = FakeCalls { hold: PASS_BOUND, ..Default::default() };
    let out = pass(&calls, &pods, at(0), at(3600), false, false, PASS_BOUND).await.unwrap();
    assert!(calls.evictions.lock().unwrap().is_empty());
    assert!(out.timed_out);
    assert_eq!(out.left, [key("shop", "db-0")]);
}

#[tokio::test(start_paused = true)]
async fn a_dead_node_pass_deletes_at_once_and_the_deadline_forces_deletions() {
    let pods = [named("shop", "web-0", "web"), named("shop", "db-0", "db")];
    let calls = FakeCalls::default();
    let out = pass(&calls, &pods, at(0), at(3600), true, false, PASS_BOUND).await.unwrap();
    assert!(calls.evictions.lock().unwrap().is_empty());
    assert_eq!(
        out.deleted,
        [
            Deleted { pod: key("shop", "web-0"), grace_seconds: 0 },
            Deleted { pod: key("shop", "db-0"), grace_seconds: 0 }
        ]
    );

    let calls = FakeCalls::default();
    let out = pass(&calls, &pods, at(3590), at(3600), false, false, PASS_BOUND).await.unwrap();
    assert_eq!(*calls.deletions.lock().unwrap(), [(key("shop", "web-0"), 10), (key("shop", "db-0"), 10)]);
    assert!(out.refused.is_empty() && out.evicted.is_empty());
    assert_eq!(out.left.len(), 2, "deleted pods still terminate");
}

#[tokio::test(start_paused = true)]
async fn a_failed_call_ends_the_pass_with_its_error() {
    let pods = [named("shop", "db-0", "db")];
    let calls = FakeCalls { fail_evictions: true, ..Default::default() };
    let err = pass(&calls, &pods, at(0), at(3600), false, false, PASS_BOUND).await.unwrap_err();
    assert!(matches!(&err, kube::Error::Api(s) if s.code == 503), "{err}");
}

/// Before the cloud's deadline every pod is evicted (its budget honoured), its grace clamped to
/// the time left once that is shorter; deleted only at the deadline.
#[test]
fn before_the_clouds_deadline_pods_are_evicted_with_their_grace_clamped_and_deleted_only_at_it() {
    let p = pod(json!({"metadata": {"ownerReferences": [
        {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web", "uid": "u", "controller": true}]}}));
    // 60 s left, grace 30: evicted with its own grace.
    assert_eq!(step_within(&p, at(3540), at(3600), false, true), PodStep::Evict);
    // 15 s left: evicted (not deleted, as a drain timeout would), within 15 s.
    assert_eq!(step_within(&p, at(3585), at(3600), false, true), PodStep::EvictWithin { grace_seconds: 15 });
    assert_eq!(step(&p, at(3585), at(3600), false), PodStep::Delete { grace_seconds: 15 });
    // At the deadline: deleted with the shortest grace.
    assert_eq!(
        step_within(&p, at(3600), at(3600), false, true),
        PodStep::Delete { grace_seconds: MIN_FORCED_GRACE_SECONDS }
    );
    // A dead node's pods go at once either way.
    assert_eq!(step_within(&p, at(0), at(3600), true, true), PodStep::Delete { grace_seconds: 0 });
}
