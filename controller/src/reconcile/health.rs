//! MachineHealthCheck: checks the Machines its selector picks and **marks** them — the
//! decisions are [`crate::plan::health`]'s. An unhealthy Machine gets `HealthCheckSucceeded=False`
//! with the reason; one that a MachineDeployment or MachinePool owns also gets
//! `OwnerRemediated=False`, and its owner remediates it within its disruption planner's
//! allowance ([`crate::plan::disruption`]). Nothing is deleted here. While more Machines are
//! unhealthy than `maxUnhealthy` allows, or the target cluster cannot be reached, the check's
//! `RemediationAllowed` condition is False and the owners of its Machines hold remediation
//! (`halted`).

use std::collections::BTreeMap;
use std::time::Duration;

use super::timing::HEALTH_UNREACHABLE_RECHECK;
use super::write;
use crate::app::Ctx;
use crate::events::EventReason;
use crate::plan::health::{self, Assessment, Unhealthy};
use crate::resources::*;
use crate::runtime::{Action, ReconcileError};
use crate::store::{Key, ListParams};

/// Checks the Machines of one MachineHealthCheck and marks the unhealthy ones.
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
    let targets = targets_of(ctx, &machines);
    let unreachable = ctx.app.safety.unreachable().or_else(|| targets.iter().find_map(|(_, why, _)| why.clone()));
    if let Some(why) = unreachable {
        // Nothing observed now can be trusted: judge nothing, hold every remediation; the timers
        // start over once it is reachable again.
        let message = format!("{why}: no machine is judged or remediated until it is reachable again");
        let conditions = &mut after.status.conditions;
        set_condition(conditions, ConditionType::RemediationAllowed, false, Reason::TargetUnreachable, &message);
        write::status(ctx, &before, &after).await?;
        return Ok(Action::requeue(HEALTH_UNREACHABLE_RECHECK));
    }
    let now = chrono::Utc::now();
    let shortest = before.spec.unhealthy_conditions.iter().map(|c| c.timeout_seconds).min().unwrap_or(u64::MAX);
    let shortest = Duration::from_secs(shortest);
    // The latest outage of what these machines depend on: the store's API server, their target
    // clusters.
    let timers_since = targets
        .iter()
        .filter_map(|(_, _, safety)| safety.as_ref()?.timers_since(shortest))
        .chain(ctx.app.safety.timers_since(shortest))
        .max();
    let a = match health::assess(&before.spec, &machines, now, timers_since) {
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
        let message = short_circuit_message(&a);
        if set_condition(conditions, ConditionType::RemediationAllowed, false, Reason::TooManyUnhealthy, &message) {
            ctx.store
                .event(Kind::MachineHealthCheck, &after.metadata, EventReason::RemediationRestricted, message)
                .await;
        }
    } else if before.spec.mode == HealthCheckMode::Observe {
        let message = "mode Observe: unhealthy machines are marked, never remediated";
        set_condition(conditions, ConditionType::RemediationAllowed, false, Reason::Observing, message);
    } else {
        let message = if a.domain_outages.is_empty() {
            String::new()
        } else {
            format!("failure domains down as a whole, not counted: {}", a.domain_outages.join(", "))
        };
        set_condition(conditions, ConditionType::RemediationAllowed, true, Reason::WithinMaxUnhealthy, &message);
    }
    let by_name: BTreeMap<&str, &Machine> = machines.iter().map(|m| (m.metadata.name.as_str(), m)).collect();
    let mut retry = false;
    for u in &a.unhealthy {
        if let Some(m) = by_name.get(u.name.as_str()) {
            retry |= !mark(ctx, &key.name, &after.metadata, m, u).await?;
        }
    }
    for name in &a.recovered {
        if let Some(m) = by_name.get(name.as_str()) {
            retry |= !recover(ctx, &key.name, m).await?;
        }
    }
    write::status(ctx, &before, &after).await?;
    if retry {
        // A Machine changed under a mark: its change wakes the check again.
        return Ok(Action::requeue(super::MIN_REQUEUE));
    }
    Ok(a.recheck_after.map_or(Action::await_change(), Action::requeue))
}

/// The target clusters of `machines`, each with why it cannot be observed now (it does not
/// answer its probe, or it is not connected yet) and its safety state: one cluster's outage
/// freezes the checks of its own machines only.
fn targets_of(
    ctx: &Ctx,
    machines: &[Machine],
) -> Vec<(crate::targets::TargetId, Option<String>, Option<std::sync::Arc<crate::safety::Safety>>)> {
    let ids: std::collections::BTreeSet<crate::targets::TargetId> = machines
        .iter()
        .map(|m| crate::targets::TargetId::of(&m.metadata.namespace, m.spec.target_cluster.as_ref()))
        .collect();
    ids.into_iter()
        .map(|id| match ctx.app.targets.open(&id) {
            Some(c) => (id, c.unreachable(), Some(c.safety.clone())),
            None if id == crate::targets::TargetId::Default => (id, None, None),
            None => {
                let why =
                    format!("the target cluster {id} is not connected (see its owner's TargetReachable condition)");
                (id, Some(why), None)
            }
        })
        .collect()
}

fn short_circuit_message(a: &Assessment) -> String {
    let count = a.unhealthy.len() as i64 + a.pending;
    let pending =
        if a.pending > 0 { format!(" ({} of them not yet past their timeout)", a.pending) } else { String::new() };
    let domains = if a.outside > 0 {
        format!(" (not counting failure domains down as a whole: {})", a.domain_outages.join(", "))
    } else {
        String::new()
    };
    format!(
        "{} of {} machines are unhealthy{pending}, more than maxUnhealthy allows ({}){domains}: none is remediated",
        count - a.outside,
        a.expected - a.outside,
        a.max_unhealthy
    )
}

/// Marks an unhealthy Machine: `HealthCheckSucceeded=False`, and `OwnerRemediated=False` when its
/// owner is to remediate it (removed again while remediation is held, unless the owner took it
/// already). `false` when another write came first.
async fn mark(
    ctx: &Ctx,
    check: &str,
    check_meta: &ObjectMeta,
    m: &Machine,
    u: &Unhealthy,
) -> Result<bool, ReconcileError> {
    let mut next = m.clone();
    let message = format!("MachineHealthCheck {check}: {}", u.why);
    let newly = condition(&m.status.conditions, ConditionType::HealthCheckSucceeded)
        .is_none_or(|c| c.status == ConditionStatus::True);
    set_condition(&mut next.status.conditions, ConditionType::HealthCheckSucceeded, false, u.reason.clone(), &message);
    let taken = m.disruption() == Some(DisruptionReason::Remediation);
    if u.remediate {
        let asks = format!("MachineHealthCheck {check} asks its owner to remediate it");
        set_condition(
            &mut next.status.conditions,
            ConditionType::OwnerRemediated,
            false,
            Reason::WaitingForRemediation,
            &asks,
        );
    } else if !taken {
        remove_condition(&mut next.status.conditions, ConditionType::OwnerRemediated);
    }
    match write::status(ctx, m, &next).await {
        Ok(_) => {}
        Err(e) if e.is_conflict() => return Ok(false),
        Err(e) => return Err(e),
    }
    if newly {
        let owner = match (m.owner(), u.remediate) {
            (Some((kind, name)), true) => format!("; its {kind} {name} remediates it"),
            (Some(_), false) => "; not remediated now".to_string(),
            (None, _) => "; it has no owner to remediate it".to_string(),
        };
        let message = format!("Machine {} is unhealthy: {}{owner}", m.metadata.name, u.why);
        tracing::info!(machine = %m.metadata.name, "machine health check {check}: {message}");
        ctx.store.event(Kind::MachineHealthCheck, check_meta, EventReason::MachineUnhealthy, message).await;
        ctx.store
            .event(Kind::Machine, &m.metadata, EventReason::Unhealthy, format!("MachineHealthCheck {check}: {}", u.why))
            .await;
    }
    Ok(true)
}

/// A Machine that was marked unhealthy and is healthy again: `HealthCheckSucceeded=True`, and
/// the owner is no longer asked (unless it took it already). `false` when another write came
/// first.
async fn recover(ctx: &Ctx, check: &str, m: &Machine) -> Result<bool, ReconcileError> {
    let mut next = m.clone();
    set_condition(
        &mut next.status.conditions,
        ConditionType::HealthCheckSucceeded,
        true,
        Reason::HealthCheckPassed,
        &format!("MachineHealthCheck {check}: healthy again"),
    );
    let taken = m.disruption() == Some(DisruptionReason::Remediation);
    if !taken {
        remove_condition(&mut next.status.conditions, ConditionType::OwnerRemediated);
    }
    match write::status(ctx, m, &next).await {
        Ok(_) => Ok(true),
        Err(e) if e.is_conflict() => Ok(false),
        Err(e) => Err(e),
    }
}

/// The status fields an assessment sets.
fn record(status: &mut MachineHealthCheckStatus, a: &Assessment) {
    status.expected_machines = a.expected;
    status.current_healthy = a.healthy;
    status.remediations_allowed = a.remediations_allowed;
    status.unhealthy = a.unhealthy.iter().map(|u| u.name.clone()).collect();
}

/// What halts the remediation of an owner's machines, in words: a MachineHealthCheck of the
/// namespace that selects machines with `labels` and whose `RemediationAllowed` is False for a
/// short circuit or an unreachable target cluster (an `Observe` check halts nothing: the owner's
/// own failed machines are still replaced).
///
/// # Errors
/// Store failures.
pub(crate) async fn halted(
    ctx: &Ctx,
    namespace: &str,
    labels: &BTreeMap<String, String>,
) -> Result<Option<String>, ReconcileError> {
    let checks = ctx.store.list_with::<MachineHealthCheck>(&ListParams::namespaced(namespace)).await?;
    Ok(checks.iter().filter(|c| !c.spec.selector.match_labels.is_empty() && c.spec.selector.matches(labels)).find_map(
        |c| {
            let cond = condition(&c.status.conditions, ConditionType::RemediationAllowed)?;
            let halts = cond.status == ConditionStatus::False
                && (cond.reason == Reason::TooManyUnhealthy || cond.reason == Reason::TargetUnreachable);
            halts.then(|| format!("MachineHealthCheck {}: {}", c.metadata.name, cond.message))
        },
    ))
}
