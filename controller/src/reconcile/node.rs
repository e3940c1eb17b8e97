//! A Machine's life as a Kubernetes Node, when the controller has a target cluster
//! ([`crate::nodes`]): joining (the VM runs, the Node must become Ready within
//! `nodeStartupTimeoutSeconds`: `node_not_joined`, for VMs and pool instances alike),
//! watching its readiness while Running, and the node steps of the deletion sequence
//! (`reconcile::deletion` decides which runs):
//!
//! `PreDrainHooks → Draining → VolumesDetaching → PreTerminateHooks → InstanceDeleting`, then
//! the Node is deleted once the instance is gone (`delete_node`).
//!
//! Each step is written to `status.deletion` with its start time before it acts, and the
//! drain's deadline is written once, when the drain begins: a restarted or newly elected
//! controller resumes the same step with the same deadline. Every step returns at once and is
//! reconciled again (no worker waits on a drain).

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;

use super::write;

use super::timing::{HOOK_RECHECK, JOIN_RECHECK, NODE_CONFLICT_RETRY, NOT_SYNCED_RETRY, VOLUME_RECHECK};
use crate::app::Ctx;
use crate::events::EventReason;
use crate::nodes::{drain, Lookup, NodeView, NodeWrite, Readiness, Target};
use crate::policy;
use crate::resources::*;
use crate::runtime::{Action, ReconcileError};
use crate::store::Key;

type Result<T> = std::result::Result<T, ReconcileError>;

/// The name the Node of `m` registers under when the driver says so: its `Hostname` address.
pub(crate) fn reported_node_name(m: &Machine) -> &str {
    m.status.addresses.iter().find(|a| a.address_type == "Hostname").map_or("", |a| a.address.as_str())
}

/// Finds `m`'s Node and records that its changes wake `key`.
pub(crate) fn lookup(target: &Target, key: &Key, m: &Machine) -> Lookup {
    target.cache.link(key, &m.status.provider_id, reported_node_name(m));
    if let Some(r) = &m.status.node_ref {
        if let Some(view) = target.cache.get(&r.name).filter(|v| r.uid.is_empty() || v.uid == r.uid) {
            return Lookup::Found(view);
        }
    }
    target.cache.find(&m.status.provider_id, reported_node_name(m))
}

/// A Machine's Node as a deletion sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NodeSeen {
    /// No target cluster: nodes are not managed.
    NoTarget,
    /// The first list of Nodes has not arrived.
    NotSynced,
    /// Its Node exists.
    Found,
    /// It has no Node (never joined, or gone).
    Missing,
}

/// How `m`'s Node is seen now (recording that its changes wake `key`).
pub(crate) fn seen(target: &Target, key: &Key, m: &Machine) -> NodeSeen {
    match lookup(target, key, m) {
        Lookup::NotSynced => NodeSeen::NotSynced,
        Lookup::Found(_) => NodeSeen::Found,
        Lookup::Missing => NodeSeen::Missing,
    }
}

/// What the drain asks the cloud about a Node that is not Ready: whether the machine's VM is
/// gone or stopped (then the Node is taken out of service instead of drained). The deletion's
/// instance kind answers ([`super::deletion::Instance`]).
#[async_trait::async_trait]
pub(crate) trait VmProbe: Sync {
    /// Whether the VM is gone or stopped.
    async fn gone_or_stopped(&self, ctx: &Ctx, m: &Machine) -> Result<bool>;
}

fn node_ref(view: &NodeView) -> NodeRef {
    NodeRef { name: view.name.clone(), uid: view.uid.clone() }
}

fn elapsed_since(t: Option<Time>) -> Duration {
    t.and_then(|t| (Utc::now() - t).to_std().ok()).unwrap_or_default()
}

/// Links a found Node: `nodeRef`, the Node annotated with its Machine, and the template's
/// labels, annotations and taints kept on it (a Node of a machine being deleted is left as is).
async fn link(ctx: &Ctx, target: &Target, m: &mut Machine, node: &NodeView) -> Result<()> {
    target.annotate(node, &m.metadata.namespace, &m.metadata.name).await?;
    // Joined: its bootstrap token has done its work.
    super::boot::retire(target, &mut m.status.bootstrap_token).await?;
    m.status.node_ref = Some(node_ref(node));
    if !m.is_deleting() && !node.deleting {
        let desired = m.spec.node_template.clone().unwrap_or_default();
        if target.sync_metadata(node, &desired).await? {
            let message = format!("node {} carries the template's labels, annotations and taints", node.name);
            ctx.store.event(Kind::Machine, &m.metadata, EventReason::NodeMetadataApplied, message).await;
        }
    }
    Ok(())
}

/// A `Provisioned` machine (its VM runs): Running once its Node is Ready; Failed with
/// `NodeNotJoined` when that takes longer than `nodeStartupTimeoutSeconds`.
pub(crate) async fn join(
    ctx: &Ctx,
    target: &Target,
    key: &Key,
    before: Machine,
    class_generation: i64,
) -> Result<Action> {
    let mut m = before.clone();
    let provisioned = *m.status.provisioned.get_or_insert_with(Utc::now);
    match lookup(target, key, &m) {
        Lookup::NotSynced => return Ok(Action::requeue(NOT_SYNCED_RETRY)),
        Lookup::Found(node) => {
            link(ctx, target, &mut m, &node).await?;
            if node.is_ready() {
                m.status.phase = Phase::Running;
                set_condition(&mut m.status.conditions, ConditionType::NodeReady, true, Reason::NodeReady, "");
                set_condition(&mut m.status.conditions, ConditionType::Ready, true, Reason::Running, "");
                let message = format!("node {} is Ready", node.name);
                let (_, written) = tokio::join!(
                    ctx.store.event(Kind::Machine, &m.metadata, EventReason::NodeReady, message),
                    write::status(ctx, &before, &m)
                );
                written?;
                super::interruptions::replacement_ready(ctx, &m).await;
                return Ok(Action::poll_after(ctx.app.settings.health_check_interval));
            }
            let message = format!("node {} has joined but is not Ready", node.name);
            set_condition(&mut m.status.conditions, ConditionType::NodeReady, false, Reason::NodeNotReady, &message);
            set_condition(&mut m.status.conditions, ConditionType::Ready, false, Reason::NodeNotReady, &message);
        }
        Lookup::Missing => {
            if let Some(t) = &m.status.bootstrap_token {
                if !target.token_exists(&t.id).await? {
                    return token_gone(ctx, before, class_generation).await;
                }
            }
            let message = format!("the VM runs; waiting for its Node ({}) to join", m.status.provider_id);
            set_condition(&mut m.status.conditions, ConditionType::NodeReady, false, Reason::WaitingForNode, &message);
            set_condition(&mut m.status.conditions, ConditionType::Ready, false, Reason::WaitingForNode, &message);
        }
    }
    if let Some(message) = node_not_joined(&mut m, class_generation) {
        ctx.store.event(Kind::Machine, &m.metadata, EventReason::NodeNotJoined, message).await;
        write::status(ctx, &before, &m).await?;
        return Ok(Action::await_change());
    }
    write::status(ctx, &before, &m).await?;
    let timeout = Duration::from_secs(m.node_settings().node_startup_timeout_seconds);
    let left = if timeout.is_zero() { JOIN_RECHECK } else { timeout.saturating_sub(elapsed_since(Some(provisioned))) };
    Ok(Action::requeue(left.min(JOIN_RECHECK).max(super::MIN_REQUEUE)))
}

/// Whether a machine whose VM (or pool instance) runs has waited longer than
/// `nodeStartupTimeoutSeconds` for a Ready Node — then it is marked Failed (`NODE_NOT_JOINED`),
/// its owner remediates it, and the message is returned. The wait starts when it is first seen
/// running without one (`status.provisioned`). The one place either kind fails for its Node.
pub(crate) fn node_not_joined(m: &mut Machine, class_generation: i64) -> Option<String> {
    let since = *m.status.provisioned.get_or_insert_with(Utc::now);
    let timeout = m.node_settings().node_startup_timeout_seconds;
    let waited = elapsed_since(Some(since)).as_secs();
    if timeout == 0 || waited < timeout {
        return None;
    }
    let message = format!("no Ready Node {timeout}s after the VM came up ({})", m.status.provider_id);
    super::record::fail(m, class_generation, "DeadlineExceeded", policy::REASON_NODE_NOT_JOINED, &message);
    set_condition(&mut m.status.conditions, ConditionType::NodeReady, false, Reason::NodeNotJoined, &message);
    set_condition(&mut m.status.conditions, ConditionType::Ready, false, Reason::NodeNotJoined, &message);
    Some(message)
}

/// The bootstrap token a machine's boot data carries is gone (deleted, or expired and cleaned
/// up) before its Node joined. A machine not created yet forgets it (a new one is minted at the
/// create); a created one cannot join any more, since no driver changes a created machine's boot
/// data: it fails with `NodeNotJoined` and its owner replaces it.
pub(crate) async fn token_gone(ctx: &Ctx, before: Machine, class_generation: i64) -> Result<Action> {
    let mut m = before.clone();
    let id = m.status.bootstrap_token.take().map(|t| t.id).unwrap_or_default();
    if m.status.provider_id.is_empty() && m.status.operations.is_empty() {
        write::status(ctx, &before, &m).await?;
        return Ok(Action::requeue_now());
    }
    let message = format!(
        "its bootstrap token ({}) is gone before its Node joined, and a created machine's boot data cannot change",
        crate::nodes::bootstrap::secret_name(&id)
    );
    super::record::fail(&mut m, class_generation, "FailedPrecondition", policy::REASON_NODE_NOT_JOINED, &message);
    set_condition(&mut m.status.conditions, ConditionType::NodeReady, false, Reason::NodeNotJoined, &message);
    set_condition(&mut m.status.conditions, ConditionType::Ready, false, Reason::NodeNotJoined, &message);
    ctx.store.event(Kind::Machine, &m.metadata, EventReason::NodeNotJoined, message).await;
    write::status(ctx, &before, &m).await?;
    Ok(Action::await_change())
}

/// A Running machine's Node, as seen now: `NodeReady` follows the Node's `Ready`; a Node that
/// disappears while the VM runs is recorded (condition and event). Nothing is said while the
/// first list of Nodes has not arrived.
pub(crate) async fn observe(ctx: &Ctx, target: &Target, key: &Key, m: &mut Machine) -> Result<()> {
    match lookup(target, key, m) {
        Lookup::NotSynced => Ok(()),
        Lookup::Found(node) => {
            link(ctx, target, m, &node).await?;
            if let Some(s) = &node.scheduled {
                super::interruptions::from_node(ctx, m, s).await;
            }
            if node.is_ready() {
                set_condition(&mut m.status.conditions, ConditionType::NodeReady, true, Reason::NodeReady, "");
            } else {
                // The Node's own status: Unknown when its kubelet stopped reporting, so a
                // health check can tell the two apart.
                let status = if node.readiness == Readiness::Unknown {
                    ConditionStatus::Unknown
                } else {
                    ConditionStatus::False
                };
                let message = format!("node {} is not Ready ({:?})", node.name, node.readiness);
                set_condition_status(
                    &mut m.status.conditions,
                    ConditionType::NodeReady,
                    status,
                    Reason::NodeNotReady,
                    &message,
                );
            }
            Ok(())
        }
        Lookup::Missing => {
            let Some(r) = &m.status.node_ref else { return Ok(()) };
            let message = format!("node {} is gone while the VM still runs", r.name);
            let newly = condition(&m.status.conditions, ConditionType::NodeReady)
                .is_none_or(|c| c.reason != Reason::NodeMissing);
            set_condition(&mut m.status.conditions, ConditionType::NodeReady, false, Reason::NodeMissing, &message);
            if newly {
                ctx.store.event(Kind::Machine, &m.metadata, EventReason::NodeMissing, message).await;
            }
            Ok(())
        }
    }
}

/// One node step of a deletion (the step [`super::deletion::next`] chose), written to
/// `status.deletion` before it acts.
///
/// # Errors
/// Store failures and the target cluster's refusals (retried).
pub(crate) async fn deletion_step(
    ctx: &Ctx,
    key: &Key,
    before: Machine,
    phase: DeletionPhase,
    probe: &dyn VmProbe,
) -> Result<Action> {
    let Some(target) = ctx.app.machine_target(&before) else { return Ok(Action::requeue_now()) };
    let node = match lookup(&target, key, &before) {
        Lookup::Found(node) => Some(node),
        Lookup::NotSynced | Lookup::Missing => None,
    };
    let mut m = before.clone();
    m.status.phase = Phase::Terminating;
    let action = match (phase, node) {
        (DeletionPhase::PreDrainHooks, _) => hooks(ctx, &mut m, PRE_DRAIN_HOOK_PREFIX, DeletionPhase::Draining).await,
        (DeletionPhase::Draining, Some(node)) => drain(ctx, &target, &mut m, &node, probe).await?,
        (DeletionPhase::VolumesDetaching, Some(node)) => volumes(&target, &mut m, &node).await?,
        (DeletionPhase::Draining | DeletionPhase::VolumesDetaching, None) => {
            advance(&mut m, DeletionPhase::PreTerminateHooks);
            Action::requeue_now()
        }
        (DeletionPhase::PreTerminateHooks, _) => {
            hooks(ctx, &mut m, PRE_TERMINATE_HOOK_PREFIX, DeletionPhase::InstanceDeleting).await
        }
        (DeletionPhase::InstanceDeleting, _) => Action::requeue_now(),
    };
    write::status(ctx, &before, &m).await?;
    Ok(action)
}

/// The deletion's record, begun at its first step when there is none yet.
fn deletion(m: &mut Machine) -> &mut Deletion {
    m.status.deletion.get_or_insert_with(|| Deletion {
        phase: DeletionPhase::PreDrainHooks,
        phase_started: Utc::now(),
        drain_started: None,
        drain_deadline: None,
        pods_left: 0,
        blocked_by: String::new(),
        out_of_service: false,
        forced: false,
    })
}

/// Moves the deletion to its next step (written before the step acts).
pub(crate) fn advance(m: &mut Machine, next: DeletionPhase) {
    let now = Utc::now();
    let drain_timeout = Duration::from_secs(m.node_settings().drain_timeout_seconds);
    let d = deletion(m);
    d.phase = next;
    d.phase_started = now;
    d.blocked_by.clear();
    if next == DeletionPhase::Draining && d.drain_started.is_none() {
        d.drain_started = Some(now);
        let timeout = now + chrono::Duration::from_std(drain_timeout).unwrap_or(chrono::Duration::hours(1));
        // The cloud's deadline comes first: the drain ends a margin before it.
        let cloud = interruption_deadline(m).map(|t| t.max(now));
        deletion(m).drain_deadline = Some(cloud.map_or(timeout, |t| t.min(timeout)));
    }
    let (reason, message) = match next {
        DeletionPhase::PreDrainHooks => (Reason::WaitingForPreDrainHooks, String::new()),
        DeletionPhase::Draining => (Reason::Draining, "cordoned; evicting pods".to_string()),
        DeletionPhase::VolumesDetaching => {
            (Reason::WaitingForVolumeDetach, "drained; waiting for volumes to detach".into())
        }
        DeletionPhase::PreTerminateHooks => (Reason::WaitingForPreTerminateHooks, String::new()),
        DeletionPhase::InstanceDeleting => (Reason::DeletingInstance, "deleting the VM".into()),
    };
    set_condition(&mut m.status.conditions, ConditionType::Deleting, true, reason, &message);
}

/// The end of the drain an interruption leaves: [`drain::INTERRUPTION_DRAIN_MARGIN`] before the cloud
/// acts, when the cloud takes the machine and said when.
pub(crate) fn interruption_deadline(m: &Machine) -> Option<Time> {
    let i = m.status.interruption.as_ref().filter(|i| i.kind.involuntary())?;
    let margin = chrono::Duration::from_std(drain::INTERRUPTION_DRAIN_MARGIN).unwrap_or_default();
    Some(i.not_before? - margin)
}

/// Waits while annotations with `prefix` are on the Machine, then moves to `next`.
async fn hooks(ctx: &Ctx, m: &mut Machine, prefix: &str, next: DeletionPhase) -> Action {
    let held: Vec<&String> = m.metadata.annotations.keys().filter(|k| k.starts_with(prefix)).collect();
    if held.is_empty() {
        advance(m, next);
        return Action::requeue_now();
    }
    let names = held.iter().map(|k| k.as_str()).collect::<Vec<_>>().join(", ");
    let (reason, event) = if prefix == PRE_DRAIN_HOOK_PREFIX {
        (Reason::WaitingForPreDrainHooks, EventReason::WaitingForPreDrainHooks)
    } else {
        (Reason::WaitingForPreTerminateHooks, EventReason::WaitingForPreTerminateHooks)
    };
    let message = format!("held by {names} (the deletion goes on when removed)");
    let d = deletion(m);
    if d.blocked_by != names {
        d.blocked_by = names;
        ctx.store.event(Kind::Machine, &m.metadata, event, message.clone()).await;
    }
    set_condition(&mut m.status.conditions, ConditionType::Deleting, true, reason, &message);
    Action::requeue(HOOK_RECHECK)
}

/// One look at a deletion's drain: cordon (or, for a dead VM's node, mark it out of service),
/// one pass over the pods ([`drain_pass`]), then either the next step or a report of what holds
/// it.
async fn drain(
    ctx: &Ctx,
    target: &Target,
    m: &mut Machine,
    node: &Arc<NodeView>,
    probe: &dyn VmProbe,
) -> Result<Action> {
    if deletion(m).drain_deadline.is_none() {
        advance(m, DeletionPhase::Draining);
    }
    if m.disruption() == Some(DisruptionReason::Autoscaler)
        && node.taints.iter().any(|t| t.key == TAINT_AUTOSCALER_DELETING)
    {
        // A removal the cluster-autoscaler asked for (DeleteNodes marked the machine): it
        // cordons and drains before it asks, honouring the pods' budgets, so once nothing this
        // drain would evict is left, it is not drained twice. The taint alone proves nothing (it
        // goes on before the autoscaler evicts, and anyone who may patch Nodes can set it): any
        // other removal, or pods still there, drain as always (an eviction the autoscaler also
        // makes is harmless).
        let deadline = deletion(m).drain_deadline.unwrap_or_else(Utc::now);
        if drain::nothing_to_evict(&target.pods_on(&node.name).await?, Utc::now(), deadline) {
            let message = format!("node {} drained by the cluster-autoscaler ({TAINT_AUTOSCALER_DELETING})", node.name);
            ctx.store.event(Kind::Machine, &m.metadata, EventReason::Drained, message).await;
            advance(m, DeletionPhase::VolumesDetaching);
            return Ok(Action::requeue_now());
        }
    }
    let dead = match prepare(ctx, target, m, node, probe).await? {
        Prepared::Cordoned => false,
        Prepared::OutOfService => true,
        Prepared::Conflict => {
            tracing::debug!("node {} changed since it was seen; cordoning again from a fresh view", node.name);
            return Ok(Action::requeue(NODE_CONFLICT_RETRY));
        }
    };
    let clamp = interruption_deadline(m).is_some();
    let d = deletion(m);
    let mut state = DrainState {
        deadline: d.drain_deadline.unwrap_or_else(Utc::now),
        pods_left: d.pods_left,
        blocked_by: std::mem::take(&mut d.blocked_by),
        forced: d.forced,
        clamp,
    };
    let held = drain_pass(ctx, target, m, node, dead, &mut state, (ConditionType::Deleting, true)).await;
    let d = deletion(m);
    (d.pods_left, d.blocked_by, d.forced) = (state.pods_left, state.blocked_by, state.forced);
    if let Some(action) = held? {
        return Ok(action);
    }
    let how = match (d.out_of_service, d.forced) {
        (true, _) => "out of service",
        (false, true) => "forced at the deadline",
        (false, false) => "every pod evicted",
    };
    let mut message = format!("node {} drained ({how})", node.name);
    if let Some(i) = m.status.interruption.as_ref().filter(|i| i.kind.involuntary()) {
        if let Some(t) = i.not_before {
            let margin = (t - Utc::now()).num_milliseconds() as f64 / 1000.0;
            ctx.app.metrics.interruptions.reached(i.kind, crate::app::Milestone::Drained, margin);
            message += &format!(", {margin:.1}s before the {} deadline", i.kind);
        }
    }
    ctx.store.event(Kind::Machine, &m.metadata, EventReason::Drained, message).await;
    advance(m, DeletionPhase::VolumesDetaching);
    Ok(Action::requeue_now())
}

/// What a drain keeps between passes: a deletion's (`status.deletion`) or an in-place update's
/// (`status.inPlace`).
pub(crate) struct DrainState {
    /// Pods still there are deleted so that they are gone by then.
    pub deadline: Time,
    /// Pods left at the last look.
    pub pods_left: u32,
    /// What holds it (a budget and the pod it protects).
    pub blocked_by: String,
    /// Pods were deleted at the deadline.
    pub forced: bool,
    /// The deadline is the cloud's (an interruption): pods are evicted with their grace clamped
    /// to the time left, and deleted only at it.
    pub clamp: bool,
}

/// One pass over a cordoned (or, `dead`, out-of-service) node's pods ([`drain::pass`], at most
/// [`drain::PASS_BOUND`]): `None` once none is left, else when to look again, with what holds
/// the drain reported in the condition `report` (its type and status) and in `state`.
pub(crate) async fn drain_pass(
    ctx: &Ctx,
    target: &Target,
    m: &mut Machine,
    node: &NodeView,
    dead: bool,
    state: &mut DrainState,
    report: (ConditionType, bool),
) -> Result<Option<Action>> {
    let now = Utc::now();
    let deadline = state.deadline;
    let pods = target.pods_on(&node.name).await?;
    let pass = drain::pass(target, &pods, now, deadline, dead, state.clamp, drain::PASS_BOUND).await?;
    if !pass.deleted.is_empty() && !dead {
        state.forced = true;
        let pods: Vec<String> =
            pass.deleted.iter().map(|d| format!("{} (grace {}s)", d.pod, d.grace_seconds)).collect();
        let message = format!(
            "drain deadline {} reached on node {}: deleted {} pod(s) instead of evicting them: {}",
            deadline.to_rfc3339(),
            node.name,
            pods.len(),
            pods.join(", ")
        );
        ctx.store.event(Kind::Machine, &m.metadata, EventReason::DrainForced, message).await;
    }
    state.pods_left = u32::try_from(pass.left.len()).unwrap_or(u32::MAX);
    if state.pods_left == 0 {
        return Ok(None);
    }
    report_held(ctx, m, &node.name, &pass, state, report).await;
    if pass.timed_out {
        // The pass stopped at its bound with pods not yet asked: go on at once (other keys had
        // their turn meanwhile).
        return Ok(Some(Action::requeue(super::MIN_REQUEUE)));
    }
    // Look again soon (no sooner than a refusal's Retry-After asks); no later than the next
    // forced deletion comes due.
    let mut next = ctx.app.settings.drain_poll_interval.max(pass.retry_after().unwrap_or_default());
    let forced = if state.clamp { Some(deadline) } else { drain::next_forced(&pods, deadline) };
    if let Some(due) = forced {
        next = next.min((due - now).to_std().unwrap_or_default().max(super::MIN_REQUEUE));
    }
    Ok(Some(Action::requeue(next)))
}

/// What the node was made ready for a pass with.
enum Prepared {
    /// Cordoned: its pods are evicted.
    Cordoned,
    /// A dead VM's node, out of service: its pods are deleted.
    OutOfService,
    /// The Node changed since it was seen: nothing was written, look again.
    Conflict,
}

/// Cordons the node, or — when it is a dead VM's (not Ready, and the driver reports the VM gone
/// or stopped) — marks it out of service. Once found dead, it stays so.
async fn prepare(
    ctx: &Ctx,
    target: &Target,
    m: &mut Machine,
    node: &NodeView,
    probe: &dyn VmProbe,
) -> Result<Prepared> {
    // Stopped or terminated, as the cloud's own event says: out of service at once, not after
    // the Node is seen NotReady.
    let gone = m.status.interruption.as_ref().is_some_and(|i| i.kind.gone());
    let mut dead = deletion(m).out_of_service || gone;
    if !dead && !node.is_ready() {
        dead = probe.gone_or_stopped(ctx, m).await?;
    }
    if !dead {
        return Ok(match target.cordon(node).await? {
            NodeWrite::Done => Prepared::Cordoned,
            NodeWrite::Conflict => Prepared::Conflict,
        });
    }
    if !deletion(m).out_of_service {
        deletion(m).out_of_service = true;
        let message = match m.status.interruption.as_ref().filter(|i| i.kind.gone()) {
            Some(i) => format!(
                "the cloud reports the VM of node {} {} (event {}): deleting its pods without eviction",
                node.name,
                i.kind.as_str().to_lowercase(),
                i.event_id
            ),
            None => format!("node {} is not Ready and its VM is gone: deleting its pods without eviction", node.name),
        };
        ctx.store.event(Kind::Machine, &m.metadata, EventReason::OutOfService, message).await;
    }
    Ok(match target.mark_out_of_service(node).await? {
        NodeWrite::Done => Prepared::OutOfService,
        NodeWrite::Conflict => Prepared::Conflict,
    })
}

/// Says what holds the drain: in the condition `report` (the deletion's `Deleting`, an
/// in-place update's `UpToDate`), `state.blocked_by`, and an event when the blocking budget or
/// pod changes. A budget that can never allow an eviction as configured is named so (the pass
/// read it once, after its refusal).
async fn report_held(
    ctx: &Ctx,
    m: &mut Machine,
    node: &str,
    pass: &drain::DrainPass,
    state: &mut DrainState,
    report: (ConditionType, bool),
) {
    let left = pass.left.len();
    let deadline = state.deadline;
    // `event` is set when something blocks the drain (then `blocked` says what).
    let (reason, event, message, blocked) = match pass.refused.first() {
        Some((pod, refusal)) => {
            let (reason, event, by) = match &refusal.budget {
                Some(b) => {
                    let ns = &pod.namespace;
                    if pass.budget_of(pod, refusal).is_some_and(|b| b.never_allows_eviction) {
                        let by = format!("PodDisruptionBudget {ns}/{b} (it can never allow an eviction as configured)");
                        (Reason::DisruptionBudgetUnsatisfiable, EventReason::DisruptionBudgetUnsatisfiable, by)
                    } else {
                        let by = format!("PodDisruptionBudget {ns}/{b}");
                        (Reason::EvictionBlocked, EventReason::EvictionBlocked, by)
                    }
                }
                None => (Reason::EvictionBlocked, EventReason::EvictionBlocked, "the API server".to_string()),
            };
            let blocked = format!("{by} blocks the eviction of pod {pod}");
            let message = format!(
                "{left} pod(s) left on node {node}; {blocked}: {}; pods are deleted at the drain deadline {}",
                refusal.message,
                deadline.to_rfc3339()
            );
            (reason, Some(event), message, blocked)
        }
        None => {
            let message = format!(
                "{left} pod(s) left on node {node} ({} evicted now); deadline {}",
                pass.evicted.len(),
                deadline.to_rfc3339()
            );
            (Reason::Draining, None, message, String::new())
        }
    };
    if let Some(event) = event.filter(|_| state.blocked_by != blocked) {
        ctx.store.event(Kind::Machine, &m.metadata, event, message.clone()).await;
    }
    state.blocked_by = blocked;
    set_condition(&mut m.status.conditions, report.0, report.1, reason, &message);
}

/// Waits for the node's VolumeAttachments to go, at most `volumeDetachTimeoutSeconds`.
async fn volumes(target: &Target, m: &mut Machine, node: &NodeView) -> Result<Action> {
    let attached = target.volume_attachments(&node.name).await?;
    let timeout = Duration::from_secs(m.node_settings().volume_detach_timeout_seconds);
    let waited = elapsed_since(Some(deletion(m).phase_started));
    if attached == 0 || waited >= timeout {
        advance(m, DeletionPhase::PreTerminateHooks);
        return Ok(Action::requeue_now());
    }
    let message = format!("{attached} volume(s) still attached to node {}", node.name);
    set_condition(&mut m.status.conditions, ConditionType::Deleting, true, Reason::WaitingForVolumeDetach, &message);
    Ok(Action::requeue(VOLUME_RECHECK))
}

/// Records that the VM's delete begins (the step after the hooks).
pub(crate) fn instance_deleting(m: &mut Machine) {
    if m.status.deletion.as_ref().is_some_and(|d| d.phase < DeletionPhase::InstanceDeleting) {
        advance(m, DeletionPhase::InstanceDeleting);
    }
}

/// The VM is gone: deletes its Node (if it had one) before the Machine is let go.
///
/// # Errors
/// The target cluster's refusal (retried).
pub(crate) async fn delete_node(ctx: &Ctx, key: &Key, m: &Machine) -> Result<Option<Action>> {
    let Some(target) = ctx.app.machine_target(m) else { return Ok(None) };
    let node = match lookup(&target, key, m) {
        Lookup::NotSynced => return Ok(Some(Action::requeue(NOT_SYNCED_RETRY))),
        Lookup::Missing => None,
        Lookup::Found(node) => Some(node),
    };
    if let Some(node) = node {
        target.delete_node(&node.name, &node.uid).await?;
        let message = format!("deleted node {} after its VM", node.name);
        ctx.store.event(Kind::Machine, &m.metadata, EventReason::NodeDeleted, message).await;
    }
    target.cache.unlink(key);
    Ok(None)
}
