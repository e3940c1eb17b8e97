//! The owner's side of remediation, shared by deployments and pools (the MachineHealthCheck
//! only marks, [`super::health`]): a machine the owner's plan takes for remediation is marked
//! first ([`ANNOTATION_DISRUPTION`] `Remediation`: it counts as in flight from then on, across
//! restarts) by a plan that does nothing else; from the next plan on its replacement is created
//! and it is deleted when the plan says it goes — its replacement is up, or the surge leaves no
//! room to wait. The deletion is the usual one (drain, VM, Node).

use crate::app::Ctx;
use crate::events::EventReason;
use crate::plan::owner::Remediation;
use crate::resources::*;
use crate::runtime::ReconcileError;
use crate::store::{Error as StoreError, Key};

type Result<T> = std::result::Result<T, ReconcileError>;

/// Marks `m` as taken for remediation, with an event saying why. Returns whether the mark is
/// stored: `false` when the machine changed since it was listed (`None`), went, or the write lost
/// to a concurrent one — then nothing that depends on the mark may run (the next plan decides
/// again).
///
/// # Errors
/// Store failures.
pub(crate) async fn mark(ctx: &Ctx, m: Option<Machine>, why: Remediation) -> Result<bool> {
    let Some(m) = m else { return Ok(false) };
    let mut marked = m.clone();
    if !marked.mark_disruption(DisruptionReason::Remediation) {
        return Ok(true);
    }
    match ctx.store.update(&marked).await {
        Ok(_) => {}
        Err(StoreError::Conflict { .. }) | Err(StoreError::NotFound(_)) => return Ok(false),
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
    Ok(true)
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
