//! What a drain does with each pod, what an eviction's refusal means, and one pass over a
//! node's pods ([`pass`]): decisions, tested without a cluster; the calls are
//! [`super::Target`]'s (through [`PodCalls`]).
//!
//! The rules (see `docs/src/operating/nodes.md`): mirror pods and DaemonSet pods are left alone (their
//! controllers would put them back), pods in a terminal phase are ignored, everything else is
//! evicted through the Eviction API so PodDisruptionBudgets are honoured, until the drain's
//! deadline: a pod still there at the deadline minus its own grace period is deleted with the
//! time left as grace (at least 1 s), so the node is empty by the deadline. On a node whose VM
//! is gone, nothing can be evicted gracefully: pods are deleted at once. Before the cloud's
//! deadline (an interruption: `clamp`), every pod is evicted — budgets honoured while time
//! allows — with its grace period clamped to the time left, and deleted only at the deadline.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use tokio::time::Instant;

/// Annotation the kubelet puts on mirror pods (static pods' API copies).
pub const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";
/// A pod's grace period when its spec gives none (the API server's default).
pub const DEFAULT_GRACE_SECONDS: i64 = 30;
/// The shortest grace a forced deletion gives (0 would delete without waiting for the kubelet).
pub const MIN_FORCED_GRACE_SECONDS: i64 = 1;
/// How long before the cloud's deadline (an interruption's `notBefore`) a drain ends: pods still
/// there are deleted then, so they are gone before the cloud stops the machine, with a few
/// seconds for the kubelet to report it.
pub const INTERRUPTION_DRAIN_MARGIN: Duration = Duration::from_secs(5);
/// How long one pass over a node's pods may go on asking: Cluster API evicts for at most 10 s
/// per reconcile and looks again later. A node of many pods (or a slow API server) then holds a
/// worker for a bounded time; the pods not reached are asked at the next look.
pub const PASS_BOUND: Duration = Duration::from_secs(10);

/// A pod's identity: its namespace and name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodKey {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

impl PodKey {
    /// The key of `pod` (namespace `default` when it has none).
    pub fn of(pod: &Pod) -> Self {
        Self {
            namespace: pod.metadata.namespace.clone().unwrap_or_else(|| "default".into()),
            name: pod.metadata.name.clone().unwrap_or_default(),
        }
    }
}

impl std::fmt::Display for PodKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

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
    /// Ask the Eviction API with this grace period (seconds): the pod's own, clamped to the
    /// time left before the cloud's deadline.
    EvictWithin {
        /// Grace period in seconds.
        grace_seconds: i64,
    },
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
    step_within(pod, now, deadline, dead_node, false)
}

/// [`step`], and with `clamp` (the deadline is the cloud's): a pod is evicted with its grace
/// clamped to the time left, and deleted (with the shortest grace) only at the deadline.
pub fn step_within(pod: &Pod, now: DateTime<Utc>, deadline: DateTime<Utc>, dead_node: bool, clamp: bool) -> PodStep {
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
    if clamp {
        return if left <= MIN_FORCED_GRACE_SECONDS {
            PodStep::Delete { grace_seconds: MIN_FORCED_GRACE_SECONDS }
        } else if left <= grace {
            PodStep::EvictWithin { grace_seconds: left }
        } else {
            PodStep::Evict
        };
    }
    if left <= grace {
        PodStep::Delete { grace_seconds: left.max(MIN_FORCED_GRACE_SECONDS) }
    } else {
        PodStep::Evict
    }
}

/// Whether nothing on the node holds a drain: every pod is one the drain leaves alone (mirror,
/// DaemonSet, terminal; one stuck terminating past the deadline).
pub fn nothing_to_evict(pods: &[Pod], now: DateTime<Utc>, deadline: DateTime<Utc>) -> bool {
    pods.iter().all(|p| !step(p, now, deadline, false).holds_drain())
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

/// What an eviction did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Evicted {
    /// Accepted: the pod is being deleted.
    Accepted,
    /// The pod is gone already (or was replaced by another of the same name).
    Gone,
    /// Refused for now (a PodDisruptionBudget, or several of them, or throttling).
    Refused(Refusal),
}

/// What an eviction's refusal says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The PodDisruptionBudget that refuses, when the API server named it.
    pub budget: Option<String>,
    /// The API server's words.
    pub message: String,
    /// How long the API server asks to wait before asking again (`retryAfterSeconds`: 10 s while
    /// a budget's status is behind its spec); `None` when it gave no time.
    pub retry_after: Option<Duration>,
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
    let retry_after = status
        .details
        .as_ref()
        .map(|d| d.retry_after_seconds)
        .filter(|s| *s > 0)
        .map(|s| Duration::from_secs(u64::from(s)));
    Refusal { budget, message, retry_after }
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

/// Whether `selector` selects a pod with `labels` (`matchLabels` and `matchExpressions`, all of
/// them). A PodDisruptionBudget's empty selector selects every pod of its namespace.
pub fn selects(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let by_labels = selector.match_labels.iter().flatten().all(|(k, v)| labels.get(k).is_some_and(|have| have == v));
    let by_expressions = selector.match_expressions.iter().flatten().all(|e| {
        let values = e.values.as_deref().unwrap_or_default();
        let have = labels.get(&e.key);
        match e.operator.as_str() {
            "In" => have.is_some_and(|v| values.contains(v)),
            "NotIn" => have.is_none_or(|v| !values.contains(v)),
            "Exists" => have.is_some(),
            "DoesNotExist" => have.is_none(),
            // Unknown: it cannot be said to select the pod.
            _ => false,
        }
    });
    by_labels && by_expressions
}

/// A PodDisruptionBudget that refused an eviction in a pass, as read once after its refusal.
#[derive(Debug, Clone, PartialEq)]
pub struct RefusingBudget {
    /// Its namespace (the refused pod's).
    pub namespace: String,
    /// Its name, as the refusal named it.
    pub name: String,
    /// It can never allow an eviction as configured ([`never_allows_eviction`]).
    pub never_allows_eviction: bool,
    /// Its selector; `None` when it is gone or selects nothing.
    selector: Option<LabelSelector>,
}

impl RefusingBudget {
    /// The budget `namespace/name` as read (`None`: not found).
    pub fn new(namespace: &str, name: &str, pdb: Option<&PodDisruptionBudget>) -> Self {
        Self {
            namespace: namespace.to_string(),
            name: name.to_string(),
            never_allows_eviction: pdb.is_some_and(never_allows_eviction),
            selector: pdb.and_then(|p| p.spec.as_ref()).and_then(|s| s.selector.clone()),
        }
    }

    /// Whether it covers `pod` (same namespace, selected by its selector).
    pub fn covers(&self, pod: &Pod) -> bool {
        let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
        let empty = BTreeMap::new();
        let labels = pod.metadata.labels.as_ref().unwrap_or(&empty);
        namespace == self.namespace && self.selector.as_ref().is_some_and(|s| selects(s, labels))
    }
}

/// A pod deleted by a pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deleted {
    /// The pod.
    pub pod: PodKey,
    /// The grace period it was given, in seconds.
    pub grace_seconds: i64,
}

/// What one pass over a node's pods did ([`pass`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DrainPass {
    /// Evictions accepted.
    pub evicted: Vec<PodKey>,
    /// Pods deleted (the drain's deadline, or a dead node).
    pub deleted: Vec<Deleted>,
    /// Evictions refused, with what the API server said.
    pub refused: Vec<(PodKey, Refusal)>,
    /// Pods not asked: a budget that covers them refused earlier in this pass (its name).
    pub spared: Vec<(PodKey, String)>,
    /// The budgets that refused, each read once.
    pub budgets: Vec<RefusingBudget>,
    /// Every pod that still holds the drain (including those evicted or deleted now: they are
    /// still terminating); the drain is done when a pass finds none.
    pub left: Vec<PodKey>,
    /// The pass stopped at [`PASS_BOUND`] (or before a `Retry-After` hold that would outlast it):
    /// some pods were not looked at.
    pub timed_out: bool,
}

impl DrainPass {
    /// The budget that refused `pod`'s eviction, as read in this pass.
    pub fn budget_of(&self, pod: &PodKey, refusal: &Refusal) -> Option<&RefusingBudget> {
        let name = refusal.budget.as_deref()?;
        self.budgets.iter().find(|b| b.namespace == pod.namespace && b.name == name)
    }

    /// The longest wait a refusal of this pass asked for (its `Retry-After`): the next pass is
    /// no sooner.
    pub fn retry_after(&self) -> Option<Duration> {
        self.refused.iter().filter_map(|(_, r)| r.retry_after).max()
    }
}

/// The target cluster's calls a pass makes ([`super::Target`] in the controller).
#[async_trait::async_trait]
pub trait PodCalls: Sync {
    /// Evicts a pod through the Eviction API (with this grace period instead of its own).
    async fn evict(&self, pod: &Pod, grace_seconds: Option<i64>) -> Result<Evicted, super::Error>;
    /// Deletes a pod with this grace period.
    async fn delete_pod(&self, pod: &Pod, grace_seconds: i64) -> Result<(), super::Error>;
    /// Reads a PodDisruptionBudget (`None`: not found).
    async fn budget(&self, namespace: &str, name: &str) -> Result<Option<PodDisruptionBudget>, super::Error>;
    /// How long until the next call may go (a 429's `Retry-After` being waited out).
    fn hold_left(&self) -> Duration {
        Duration::ZERO
    }
}

/// One pass over a node's `pods` at `now`, the drain ending at `deadline` (`dead`: the node's VM
/// is gone): each pod's [`step`] is taken, in order, for at most `bound`.
///
/// A budget that refuses an eviction is read once (its selector, and whether it can ever allow
/// one), and the pods it covers are not asked again in this pass: they are [`DrainPass::spared`]
/// and asked at the next look. Before it starts a call, the pass stops if `bound` would be
/// reached first, counting a `Retry-After` hold the call would wait out.
///
/// # Errors
/// The target cluster's failures other than the answers [`Evicted`] names (the pass stops at the
/// first).
#[allow(clippy::too_many_arguments)]
pub async fn pass(
    calls: &impl PodCalls,
    pods: &[Pod],
    now: DateTime<Utc>,
    deadline: DateTime<Utc>,
    dead: bool,
    clamp: bool,
    bound: Duration,
) -> Result<DrainPass, super::Error> {
    let started = Instant::now();
    let mut out = DrainPass::default();
    for pod in pods {
        let step = step_within(pod, now, deadline, dead, clamp);
        if !step.holds_drain() {
            continue;
        }
        let key = PodKey::of(pod);
        out.left.push(key.clone());
        if !matches!(step, PodStep::Evict | PodStep::EvictWithin { .. } | PodStep::Delete { .. }) {
            continue;
        }
        if out.timed_out || started.elapsed() + calls.hold_left() >= bound {
            out.timed_out = true;
            continue;
        }
        match step {
            PodStep::Evict | PodStep::EvictWithin { .. } => {
                if let Some(b) = out.budgets.iter().find(|b| b.covers(pod)) {
                    out.spared.push((key, b.name.clone()));
                    continue;
                }
                let grace = match step {
                    PodStep::EvictWithin { grace_seconds } => Some(grace_seconds),
                    _ => None,
                };
                match calls.evict(pod, grace).await? {
                    Evicted::Accepted => out.evicted.push(key),
                    Evicted::Gone => {}
                    Evicted::Refused(refusal) => {
                        if let Some(name) = refusal.budget.as_deref() {
                            if !out.budgets.iter().any(|b| b.namespace == key.namespace && b.name == name) {
                                let pdb = calls.budget(&key.namespace, name).await?;
                                out.budgets.push(RefusingBudget::new(&key.namespace, name, pdb.as_ref()));
                            }
                        }
                        out.refused.push((key, refusal));
                    }
                }
            }
            PodStep::Delete { grace_seconds } => {
                calls.delete_pod(pod, grace_seconds).await?;
                out.deleted.push(Deleted { pod: key, grace_seconds });
            }
            PodStep::Skip(_) | PodStep::WaitGone => {}
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
