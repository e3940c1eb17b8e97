//! The owner's side of remediation, shared by deployments and pools (the MachineHealthCheck
//! only marks, [`super::health`]): a machine the owner's plan takes for remediation is marked
//! first ([`ANNOTATION_DISRUPTION`] `Remediation`: it counts as in flight from then on, across
//! restarts), then deleted when the plan says it goes — its replacement is up, or the surge
//! leaves no room to wait. The deletion is the usual one (drain, VM, Node).

use crate::app::Ctx;
use crate::events::EventReason;
use crate::plan::rollout::Remediation;
use crate::resources::*;
use crate::runtime::ReconcileError;
use crate::store::{Error as StoreError, Key};

type Result<T> = std::result::Result<T, ReconcileError>;

/// Marks `m` as taken for remediation, with an event saying why. `None` (the machine changed
/// since it was listed) and a conflicting write do nothing: the next plan decides again.
///
/// # Errors
/// Store failures.
pub(crate) async fn mark(ctx: &Ctx, m: &Option<Machine>, why: Remediation) -> Result<()> {
    let Some(m) = m else { return Ok(()) };
    if m.metadata.annotations.get(ANNOTATION_DISRUPTION).map(String::as_str)
        == Some(DisruptionReason::Remediation.as_str())
    {
        return Ok(());
    }
    let mut marked = m.clone();
    marked.metadata.annotations.insert(ANNOTATION_DISRUPTION.into(), DisruptionReason::Remediation.as_str().into());
    match ctx.store.update(&marked).await {
        Ok(_) => {}
        Err(StoreError::Conflict { .. }) | Err(StoreError::NotFound(_)) => return Ok(()),
        Err(e) => return Err(e.into()),
    }
    let detail = match (why, &m.status.failure) {
        (Remediation::Failed, Some(f)) => format!("failed ({}: {})", f.reason, f.message),
        (Remediation::Unhealthy, _) => {
            let because = condition(&m.status.conditions, ConditionType::HealthCheckSucceeded)
                .map(|c| c.message.clone())
                .filter(|m| !m.is_empty());
            format!("unhealthy ({})", because.as_deref().unwrap_or("a MachineHealthCheck asks for its remediation"))
        }
        (why, _) => why.to_string(),
    };
    let message = format!("{} is {detail}; its owner replaces it", m.metadata.name);
    tracing::info!(machine = %m.metadata.name, "{message}");
    ctx.store.event(Kind::Machine, &m.metadata, EventReason::Remediating, message).await;
    Ok(())
}

/// Deletes a machine taken for remediation (gone already is done).
///
/// # Errors
/// Store failures.
pub(crate) async fn remove(ctx: &Ctx, key: &Key) -> Result<()> {
    match ctx.store.delete(key).await {
        Ok(_) | Err(StoreError::NotFound(_)) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Records `DisruptionBlocked` on the owner when its condition turns True (or says something
/// else holds now).
pub(crate) async fn blocked_event(
    ctx: &Ctx,
    kind: Kind,
    owner: &ObjectMeta,
    before: &[Condition],
    after: &[Condition],
) {
    let now = condition(after, ConditionType::DisruptionBlocked).filter(|c| c.status == ConditionStatus::True);
    let was = condition(before, ConditionType::DisruptionBlocked).filter(|c| c.status == ConditionStatus::True);
    if let Some(c) = now.filter(|c| was.is_none_or(|w| w.reason != c.reason)) {
        ctx.store.event(kind, owner, EventReason::DisruptionBlocked, c.message.clone()).await;
    }
}
