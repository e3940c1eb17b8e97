//! What a drain does with each pod, and what an eviction's refusal means: pure decisions,
//! table-tested; the calls are [`super::Target`]'s.
//!
//! The rules (see `docs/src/operating/nodes.md`): mirror pods and DaemonSet pods are left alone (their
//! controllers would put them back), pods in a terminal phase are ignored, everything else is
//! evicted through the Eviction API so PodDisruptionBudgets are honoured, until the drain's
//! deadline: a pod still there at the deadline minus its own grace period is deleted with the
//! time left as grace (at least 1 s), so the node is empty by the deadline. On a node whose VM
//! is gone, nothing can be evicted gracefully: pods are deleted at once.

use chrono::{DateTime, Utc};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;

/// Annotation the kubelet puts on mirror pods (static pods' API copies).
pub const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";
/// A pod's grace period when its spec gives none (the API server's default).
pub const DEFAULT_GRACE_SECONDS: i64 = 30;
/// The shortest grace a forced deletion gives (0 would delete without waiting for the kubelet).
pub const MIN_FORCED_GRACE_SECONDS: i64 = 1;

/// Why a pod is left on the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    /// A mirror pod: the kubelet owns it.
    Mirror,
    /// Run by a DaemonSet, which tolerates the cordon and would put it back.
    DaemonSet,
    /// Succeeded or Failed: nothing runs.
    Terminal,
    /// Already being deleted, and the deadline has passed: not waited for.
    StuckTerminating,
}

/// What the drain does with one pod now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodStep {
    /// Leave it.
    Skip(Skip),
    /// Ask the Eviction API.
    Evict,
    /// Delete it with this grace period (seconds): the deadline is near, or the node is dead.
    Delete {
        /// Grace period in seconds.
        grace_seconds: i64,
    },
    /// It is terminating: wait for it to go.
    WaitGone,
}

impl PodStep {
    /// Whether the pod still holds the drain.
    pub fn holds_drain(self) -> bool {
        !matches!(self, PodStep::Skip(_))
    }
}

/// The drain's step for `pod` at `now`, with the drain ending at `deadline`; `dead_node`: the
/// node's VM is gone or stopped (no eviction can complete).
pub fn step(pod: &Pod, now: DateTime<Utc>, deadline: DateTime<Utc>, dead_node: bool) -> PodStep {
    let meta = &pod.metadata;
    if meta.annotations.as_ref().is_some_and(|a| a.contains_key(MIRROR_ANNOTATION)) {
        return PodStep::Skip(Skip::Mirror);
    }
    let by_daemon_set = meta
        .owner_references
        .as_ref()
        .is_some_and(|refs| refs.iter().any(|o| o.controller == Some(true) && o.kind == "DaemonSet"));
    if by_daemon_set {
        return PodStep::Skip(Skip::DaemonSet);
    }
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or("");
    if phase == "Succeeded" || phase == "Failed" {
        return PodStep::Skip(Skip::Terminal);
    }
    if dead_node {
        return PodStep::Delete { grace_seconds: 0 };
    }
    if meta.deletion_timestamp.is_some() {
        return if now >= deadline { PodStep::Skip(Skip::StuckTerminating) } else { PodStep::WaitGone };
    }
    let grace =
        pod.spec.as_ref().and_then(|s| s.termination_grace_period_seconds).unwrap_or(DEFAULT_GRACE_SECONDS).max(0);
    let left = (deadline - now).num_seconds();
    if left <= grace {
        PodStep::Delete { grace_seconds: left.max(MIN_FORCED_GRACE_SECONDS) }
    } else {
        PodStep::Evict
    }
}

/// When the next pod of `pods` comes due for a forced deletion (to requeue no later).
pub fn next_forced(pods: &[Pod], deadline: DateTime<Utc>) -> Option<DateTime<Utc>> {
    pods.iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .map(|p| {
            let grace = p
                .spec
                .as_ref()
                .and_then(|s| s.termination_grace_period_seconds)
                .unwrap_or(DEFAULT_GRACE_SECONDS)
                .max(0);
            deadline - chrono::Duration::seconds(grace)
        })
        .min()
}

/// What an eviction's refusal says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The PodDisruptionBudget that refuses, when the API server named it.
    pub budget: Option<String>,
    /// The API server's words.
    pub message: String,
}

/// Reads a 429 or 500 eviction answer: the budget named in its causes
/// (`The disruption budget NAME needs 3 healthy pods and has 3 currently`), and the message.
pub fn refusal(status: &kube::core::Status) -> Refusal {
    let causes = status.details.as_ref().map(|d| d.causes.as_slice()).unwrap_or_default();
    let cause = causes.iter().find(|c| c.reason == "DisruptionBudget");
    let budget = cause.and_then(|c| {
        let rest = c.message.strip_prefix("The disruption budget ")?;
        rest.split_whitespace().next().map(str::to_string)
    });
    let message = match cause {
        Some(c) if !c.message.is_empty() => format!("{} ({})", status.message, c.message),
        _ => status.message.clone(),
    };
    Refusal { budget, message }
}

/// Whether a PodDisruptionBudget can never allow an eviction as things stand: its status is
/// current, every expected pod is healthy, none is being disrupted, and still no disruption is
/// allowed (`minAvailable` equal to the replicas, `maxUnavailable: 0`) — machine-controller-
/// manager's "misconfigured PDB" test. Waiting cannot help; the drain deadline will.
pub fn never_allows_eviction(pdb: &PodDisruptionBudget) -> bool {
    let Some(status) = &pdb.status else { return false };
    let current = status.observed_generation.is_some() && status.observed_generation == pdb.metadata.generation;
    let expected = status.expected_pods.unwrap_or(0);
    current
        && expected > 0
        && status.current_healthy.unwrap_or(0) >= expected
        && status.disrupted_pods.as_ref().is_none_or(|d| d.is_empty())
        && status.disruptions_allowed.unwrap_or(0) == 0
}

#[cfg(test)]
mod tests {
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
}
