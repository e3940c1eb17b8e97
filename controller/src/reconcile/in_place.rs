//! An in-place update that disrupts its machine, with a target cluster: the controller owns the
//! cordon, the drain and the uncordon. The driver said what the update does
//! (`CanUpdateMachine`'s `disruption`, which the owner wrote into
//! [`ANNOTATION_IN_PLACE_DISRUPTION`] with the new spec; without it, `Reboot`):
//!
//! - `None`: nothing restarts; `UpdateMachine` is asked at once and no pod is touched;
//! - `Drain`: `Draining` (cordon, then evict as a deletion does: PodDisruptionBudgets, the
//!   deadline, DaemonSet and mirror pods left) → `Updating` (`UpdateMachine`, polled) →
//!   `WaitingForNode` (Ready) → uncordoned;
//! - `Reboot` (and unset): the same, and the Node must be Ready with a new boot ID, or have gone
//!   NotReady and come back.
//!
//! Each step is written to `status.inPlace` before it acts, and the drain's deadline when the
//! update begins, so a restarted controller resumes the same step with the same deadline. The
//! machine is `Updating` from its cordon to its uncordon, so its owner's disruption planner
//! counts it unavailable (`InPlaceUpdate`). An update whose operation fails, or whose Node is not
//! back within `nodeStartupTimeoutSeconds`, fails the machine: its owner remediates it, and the
//! failure counts against the revision. Every step returns at once (no worker waits).

use std::time::Duration;

use chrono::Utc;

use super::node::{self, DrainState};
use super::record::fail;
use super::timing::{IN_PLACE_NODE_RECHECK, NODE_CONFLICT_RETRY, NOT_SYNCED_RETRY};
use super::write;
use super::Resolved;
use crate::app::Ctx;
use crate::events::EventReason;
use crate::nodes::{Lookup, NodeView, NodeWrite, Target};
use crate::policy;
use crate::resources::*;
use crate::runtime::{Action, ReconcileError};
use crate::store::Key;

type Result<T> = std::result::Result<T, ReconcileError>;

/// What the machine's pending in-place update does, as its owner recorded the driver's answer;
/// `Reboot` when nobody said (a spec edited by hand, an unknown value).
pub(crate) fn disruption(m: &Machine) -> InPlaceDisruption {
    m.metadata
        .annotations
        .get(ANNOTATION_IN_PLACE_DISRUPTION)
        .and_then(|v| v.parse().ok())
        .unwrap_or(InPlaceDisruption::Reboot)
}

/// Whether `m`'s update in progress ([`InPlaceProgress`]) is at an end on `node`: Ready again
/// and, after a reboot, with a new boot ID or after having gone NotReady.
fn back(p: &InPlaceProgress, node: &NodeView) -> bool {
    node.is_ready()
        && match p.disruption {
            InPlaceDisruption::Reboot => p.node_went_not_ready || (!p.boot_id.is_empty() && node.boot_id != p.boot_id),
            InPlaceDisruption::Drain | InPlaceDisruption::None => true,
        }
}

/// Begins a draining update of a Running machine: records the drain (its deadline, the Node's
/// boot ID, whether it was cordoned already) and `Updating`, and acts on the next turn. A machine
/// without a Node has nothing to drain: `Ok(None)`, and the update is asked at once.
///
/// # Errors
/// Store failures.
pub(crate) async fn begin(
    ctx: &Ctx,
    target: &Target,
    key: &Key,
    before: Machine,
    disruption: InPlaceDisruption,
) -> Result<Option<Action>> {
    let node = match node::lookup(target, key, &before) {
        Lookup::NotSynced => return Ok(Some(Action::requeue(NOT_SYNCED_RETRY))),
        Lookup::Missing => return Ok(None),
        Lookup::Found(node) => node,
    };
    let mut m = before.clone();
    let now = Utc::now();
    let drain_timeout = Duration::from_secs(m.node_settings().drain_timeout_seconds);
    m.status.in_place = Some(InPlaceProgress {
        disruption,
        phase: InPlacePhase::Draining,
        phase_started: now,
        drain_started: now,
        drain_deadline: now + chrono::Duration::from_std(drain_timeout).unwrap_or(chrono::Duration::hours(1)),
        pods_left: 0,
        blocked_by: String::new(),
        forced: false,
        boot_id: node.boot_id.clone(),
        node_went_not_ready: false,
        was_unschedulable: node.unschedulable && !node.has_taint(TAINT_DRAINING, "NoSchedule"),
    });
    m.status.phase = Phase::Updating;
    let message = format!("cordoning and draining node {} before an in-place update ({disruption})", node.name);
    set_condition(&mut m.status.conditions, ConditionType::UpToDate, false, Reason::Draining, &message);
    let (_, written) = tokio::join!(
        ctx.store.event(Kind::Machine, &m.metadata, EventReason::DrainingForUpdate, message.clone()),
        write::status(ctx, &before, &m)
    );
    written?;
    Ok(Some(Action::requeue_now()))
}

/// One step of the update in progress: drain, or wait for the Node; `None` once the drain is
/// done and the UpdateMachine call is due, which the machine reconciler makes as for any update
/// (so this module needs nothing of it).
///
/// # Errors
/// Store failures and the target cluster's refusals (retried).
pub(crate) async fn step(ctx: &Ctx, key: &Key, before: Machine, r: &Resolved<'_>) -> Result<Option<Action>> {
    let Some(progress) = before.status.in_place.clone() else { return Ok(Some(Action::requeue_now())) };
    let Some(target) = ctx.app.machine_target(&before) else {
        // The controller runs without its target cluster now: nothing to drain or wait for.
        let mut m = before.clone();
        m.status.in_place = None;
        write::status(ctx, &before, &m).await?;
        return Ok(Some(Action::requeue_now()));
    };
    match progress.phase {
        InPlacePhase::Draining => drain(ctx, &target, key, before, progress).await.map(Some),
        InPlacePhase::Updating => Ok(None),
        InPlacePhase::WaitingForNode => wait_for_node(ctx, &target, key, before, progress, r).await.map(Some),
    }
}

/// Moves the update to `phase` (written before the step acts).
fn advance(m: &mut Machine, phase: InPlacePhase) {
    if let Some(p) = m.status.in_place.as_mut() {
        p.phase = phase;
        p.phase_started = Utc::now();
        p.blocked_by.clear();
    }
}

/// The UpdateMachine operation is done: on to the wait for the Node (the machine stays
/// `Updating`). Returns false when no draining update is in progress.
pub(crate) fn updated(m: &mut Machine) -> bool {
    let Some(p) = m.status.in_place.as_ref() else { return false };
    let message = match p.disruption {
        InPlaceDisruption::Reboot => "updated; waiting for the Node to be Ready again after its reboot",
        _ => "updated; waiting for the Node to be Ready",
    };
    advance(m, InPlacePhase::WaitingForNode);
    set_condition(&mut m.status.conditions, ConditionType::UpToDate, false, Reason::WaitingForNodeAfterUpdate, message);
    true
}

/// One look at the drain: cordon, one pass over the pods ([`node::drain_pass`]), then the update
/// or a report of what holds it (in `UpToDate` and `status.inPlace.blockedBy`).
async fn drain(ctx: &Ctx, target: &Target, key: &Key, before: Machine, p: InPlaceProgress) -> Result<Action> {
    let mut m = before.clone();
    let node = match node::lookup(target, key, &m) {
        Lookup::NotSynced => return Ok(Action::requeue(NOT_SYNCED_RETRY)),
        Lookup::Found(node) => node,
        Lookup::Missing => {
            // Nothing left to drain.
            advance(&mut m, InPlacePhase::Updating);
            write::status(ctx, &before, &m).await?;
            return Ok(Action::requeue_now());
        }
    };
    if target.cordon(&node).await? == NodeWrite::Conflict {
        return Ok(Action::requeue(NODE_CONFLICT_RETRY));
    }
    let mut state = DrainState {
        deadline: p.drain_deadline,
        pods_left: p.pods_left,
        blocked_by: p.blocked_by,
        forced: p.forced,
        clamp: false,
    };
    let held = node::drain_pass(ctx, target, &mut m, &node, false, &mut state, (ConditionType::UpToDate, false)).await;
    if let Some(p) = m.status.in_place.as_mut() {
        (p.pods_left, p.blocked_by, p.forced) = (state.pods_left, state.blocked_by, state.forced);
    }
    if let Some(action) = held? {
        write::status(ctx, &before, &m).await?;
        return Ok(action);
    }
    let how = if state.forced { "forced at the deadline" } else { "every pod evicted" };
    let message = format!("node {} drained for an in-place update ({how})", node.name);
    advance(&mut m, InPlacePhase::Updating);
    set_condition(&mut m.status.conditions, ConditionType::UpToDate, false, Reason::Updating, &message);
    let (_, written) = tokio::join!(
        ctx.store.event(Kind::Machine, &m.metadata, EventReason::Drained, message.clone()),
        write::status(ctx, &before, &m)
    );
    written?;
    Ok(Action::requeue_now())
}

/// Waits for the Node to be back ([`back`]), then uncordons it and the machine is Running; fails
/// the machine when that takes longer than `nodeStartupTimeoutSeconds`.
async fn wait_for_node(
    ctx: &Ctx,
    target: &Target,
    key: &Key,
    before: Machine,
    p: InPlaceProgress,
    r: &Resolved<'_>,
) -> Result<Action> {
    let mut m = before.clone();
    let node = match node::lookup(target, key, &m) {
        Lookup::NotSynced => return Ok(Action::requeue(NOT_SYNCED_RETRY)),
        Lookup::Found(node) => Some(node),
        Lookup::Missing => None,
    };
    if let Some(node) = node.as_deref().filter(|n| back(&p, n)) {
        if target.uncordon(node, p.was_unschedulable).await? == NodeWrite::Conflict {
            return Ok(Action::requeue(NODE_CONFLICT_RETRY));
        }
        m.status.in_place = None;
        m.status.phase = Phase::Running;
        set_condition(&mut m.status.conditions, ConditionType::NodeReady, true, Reason::NodeReady, "");
        set_condition(&mut m.status.conditions, ConditionType::Ready, true, Reason::Running, "");
        set_condition(&mut m.status.conditions, ConditionType::UpToDate, true, Reason::SpecApplied, "");
        let message =
            format!("node {} is Ready again after its in-place update ({}); uncordoned", node.name, p.disruption);
        let (_, written) = tokio::join!(
            ctx.store.event(Kind::Machine, &m.metadata, EventReason::Uncordoned, message),
            write::status(ctx, &before, &m)
        );
        written?;
        return Ok(Action::poll_after(ctx.app.settings.health_check_interval));
    }
    // A NotReady or missing Node (a rebooting kubelet may register it again) is a reboot seen.
    if node.as_deref().is_none_or(|n| !n.is_ready()) {
        if let Some(p) = m.status.in_place.as_mut() {
            p.node_went_not_ready = true;
        }
    }
    let timeout = Duration::from_secs(m.node_settings().node_startup_timeout_seconds);
    let waited = (Utc::now() - p.phase_started).to_std().unwrap_or_default();
    if !timeout.is_zero() && waited >= timeout {
        let message =
            format!("the Node was not Ready again {}s after the in-place update ({})", timeout.as_secs(), p.disruption);
        fail(&mut m, r.class.metadata.generation, "DeadlineExceeded", policy::REASON_NODE_NOT_BACK, &message);
        set_condition(
            &mut m.status.conditions,
            ConditionType::UpToDate,
            false,
            Reason::NodeNotBackAfterUpdate,
            &message,
        );
        let (_, written) = tokio::join!(
            ctx.store.event(Kind::Machine, &m.metadata, EventReason::NodeNotBackAfterUpdate, message),
            write::status(ctx, &before, &m)
        );
        written?;
        return Ok(Action::await_change());
    }
    write::status(ctx, &before, &m).await?;
    let left = if timeout.is_zero() { IN_PLACE_NODE_RECHECK } else { timeout.saturating_sub(waited) };
    Ok(Action::requeue(left.min(IN_PLACE_NODE_RECHECK).max(super::MIN_REQUEUE)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nodes::Readiness;

    fn progress(disruption: InPlaceDisruption, boot_id: &str, went_not_ready: bool) -> InPlaceProgress {
        let now = Utc::now();
        InPlaceProgress {
            disruption,
            phase: InPlacePhase::WaitingForNode,
            phase_started: now,
            drain_started: now,
            drain_deadline: now,
            pods_left: 0,
            blocked_by: String::new(),
            forced: false,
            boot_id: boot_id.into(),
            node_went_not_ready: went_not_ready,
            was_unschedulable: false,
        }
    }

    fn node(readiness: Readiness, boot_id: &str) -> NodeView {
        NodeView {
            name: "n".into(),
            uid: "u".into(),
            provider_id: "fake:///n".into(),
            readiness,
            unschedulable: true,
            labels: Default::default(),
            annotations: Default::default(),
            taints: Vec::new(),
            deleting: false,
            boot_id: boot_id.into(),
            resource_version: "1".into(),
            scheduled: None,
        }
    }

    /// (what, the update, the Node now) → whether it is back.
    #[test]
    fn a_node_is_back_when_ready_and_after_a_reboot_rebooted() {
        use InPlaceDisruption::*;
        use Readiness::*;
        let rows = [
            ("drain: Ready is enough", progress(Drain, "b1", false), node(Ready, "b1"), true),
            ("drain: not Ready", progress(Drain, "b1", false), node(NotReady, "b1"), false),
            (
                "reboot: the same boot ID, never NotReady: not yet",
                progress(Reboot, "b1", false),
                node(Ready, "b1"),
                false,
            ),
            ("reboot: a new boot ID", progress(Reboot, "b1", false), node(Ready, "b2"), true),
            ("reboot: a new boot ID, not Ready yet", progress(Reboot, "b1", false), node(Unknown, "b2"), false),
            ("reboot: went NotReady and came back", progress(Reboot, "b1", true), node(Ready, "b1"), true),
            (
                "reboot: no boot ID known: only NotReady and back tells",
                progress(Reboot, "", false),
                node(Ready, ""),
                false,
            ),
        ];
        for (what, p, n, want) in rows {
            assert_eq!(back(&p, &n), want, "{what}");
        }
    }

    #[test]
    fn the_disruption_comes_from_the_owners_annotation_and_defaults_to_reboot() {
        let mut m = Machine::new("default", "m", MachineSpec::default());
        assert_eq!(disruption(&m), InPlaceDisruption::Reboot, "nobody said");
        for (value, want) in [
            ("None", InPlaceDisruption::None),
            ("Drain", InPlaceDisruption::Drain),
            ("Reboot", InPlaceDisruption::Reboot),
            ("Sometimes", InPlaceDisruption::Reboot),
        ] {
            m.metadata.annotations.insert(ANNOTATION_IN_PLACE_DISRUPTION.into(), value.into());
            assert_eq!(disruption(&m), want, "{value}");
        }
    }
}
