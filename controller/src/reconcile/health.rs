//! MachineHealthCheck: checks the Machines its selector picks, deletes the unhealthy ones that a
//! MachineDeployment or MachinePool replaces (unless more are unhealthy than `maxUnhealthy`),
//! and reports what it found in status. The decisions are [`crate::plan::health`]'s.

use super::write;
use crate::events::EventReason;
use crate::plan::health::{self, Assessment};
use crate::resources::*;
use crate::runtime::{Action, Ctx, ReconcileError};
use crate::store::{Key, ListParams};

/// Checks the Machines of one MachineHealthCheck and remediates the unhealthy ones.
///
/// # Errors
/// Store failures.
pub async fn reconcile(ctx: &Ctx, key: &Key) -> Result<Action, ReconcileError> {
    let Some(before) = ctx.store.get::<MachineHealthCheck>(&key.namespace, &key.name).await? else {
        return Ok(Action::await_change());
    };
    if before.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let params = before
        .spec
        .selector
        .match_labels
        .iter()
        .fold(ListParams::namespaced(&key.namespace), |p, (k, v)| p.label(k, v));
    // An empty selector is refused by `apply`; one written otherwise checks nothing.
    let machines = if params.labels.is_empty() { Vec::new() } else { ctx.store.list_with::<Machine>(&params).await? };
    let mut after = before.clone();
    after.status.observed_generation = before.metadata.generation;
    let a = match health::assess(&before.spec, &machines, chrono::Utc::now()) {
        Ok(a) => a,
        Err(why) => {
            let conditions = &mut after.status.conditions;
            if set_condition(conditions, ConditionType::RemediationAllowed, false, Reason::Invalid, &why) {
                ctx.store.event(Kind::MachineHealthCheck, &after.metadata, EventReason::Invalid, why).await;
            }
            write::status(ctx, &before, &after).await?;
            return Ok(Action::await_change());
        }
    };
    record(&mut after.status, &a);
    let conditions = &mut after.status.conditions;
    if a.short_circuited {
        let message = format!(
            "{} of {} machines are unhealthy, more than maxUnhealthy allows ({}): none is remediated",
            a.unhealthy.len(),
            a.expected,
            a.max_unhealthy
        );
        if set_condition(conditions, ConditionType::RemediationAllowed, false, Reason::TooManyUnhealthy, &message) {
            ctx.store
                .event(Kind::MachineHealthCheck, &after.metadata, EventReason::RemediationRestricted, message)
                .await;
        }
    } else {
        set_condition(conditions, ConditionType::RemediationAllowed, true, Reason::WithinMaxUnhealthy, "");
    }
    for u in a.unhealthy.iter().filter(|u| a.remediate.contains(&u.name)) {
        let machine = Key::new(Kind::Machine, &key.namespace, &u.name);
        // Removed at once, or marked for its finalizer (the drain and the VM's deletion).
        ctx.store.delete(&machine).await?;
        let message = format!("deleted Machine {} ({}); its owner replaces it", u.name, u.why);
        tracing::info!(machine = %machine, "machine health check: {message}");
        ctx.store.event(Kind::MachineHealthCheck, &after.metadata, EventReason::MachineRemediated, message).await;
        if let Some(m) = machines.iter().find(|m| m.metadata.name == u.name) {
            let message = format!("deleted by MachineHealthCheck {}: {}", key.name, u.why);
            ctx.store.event(Kind::Machine, &m.metadata, EventReason::Remediated, message).await;
        }
    }
    write::status(ctx, &before, &after).await?;
    Ok(a.recheck_after.map_or(Action::await_change(), Action::requeue))
}

/// The status fields an assessment sets.
fn record(status: &mut MachineHealthCheckStatus, a: &Assessment) {
    status.expected_machines = a.expected;
    status.current_healthy = a.healthy;
    status.remediations_allowed = a.remediations_allowed;
    status.unhealthy = a.unhealthy.iter().map(|u| u.name.clone()).collect();
}
