//! MachinePool: a scale set driven through the pool RPCs, mirrored as one Machine per instance.
//!
//! The decisions (capacity, CAPZ-style surge upgrades by deletion, maxSurge-0 upgrades in place)
//! are [`plan::pool`](crate::plan::pool)'s; this reconciler lists, mirrors, plans and makes the
//! one call the plan names. Deleting one pool Machine deletes exactly that instance; the pool
//! then refills to `replicas`.
//!
//! With a target cluster (nodes managed) the pool removes no instance itself: a scale-down or
//! an upgrade by deletion (maxSurge 0 included: delete and replace, never a reimage in place)
//! deletes the chosen instances' Machines, and each Machine's deletion drains its Node before
//! DeletePoolInstances of exactly that instance ([`reconcile_machine`], through the one
//! deletion flow of `reconcile::deletion`). Remediation (failed instances, and those a
//! MachineHealthCheck marked) always goes that way, with or without nodes.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::Utc;
use driver_sdk::proto as pb;
use driver_sdk::OperationExt;

use super::deletion;
use super::record::{LastOperationExt, StoredOperationExt};
use super::timing::{POOL_DONE_RECHECK, POOL_PROGRESS_RECHECK, POOL_SETTLED_RECHECK};
use super::write::{self, Finalizer};
use super::{poll_stored, pool_instances as instances, resolve, Polled, Resolved};
use crate::app::Ctx;
use crate::events::EventReason;
use crate::plan::owner::{disruption_conditions, Remediation};
use crate::plan::pool::{
    instance_phase, legacy_instance_state, machine_name, plan_pool, Instance, InstanceState, Observed, Plan, Step,
};
use crate::policy::{self, Decision, Rpc, Source, ENVIRONMENT_CONDITIONS};
use crate::resources::*;
use crate::runtime::{Action, ReconcileError};
use crate::store::{Error as StoreError, Key, ListParams};

type Result<T> = std::result::Result<T, ReconcileError>;

/// An instance's state: the protocol's `InstanceState`, or, from a driver older than it
/// (`UNSPECIFIED`), the deprecated provisioning string.
fn state_of(i: &pb::PoolInstance) -> InstanceState {
    match i.state() {
        pb::InstanceState::Creating => InstanceState::Creating,
        pb::InstanceState::Running => InstanceState::Running,
        pb::InstanceState::Updating => InstanceState::Updating,
        pb::InstanceState::Deleting => InstanceState::Deleting,
        pb::InstanceState::Failed => InstanceState::Failed,
        #[allow(deprecated)] // The fallback for old drivers.
        pb::InstanceState::Unspecified => legacy_instance_state(&i.provisioning_state),
    }
}

/// A listed instance as the planner sees it, what its Machine says aside.
fn instance(i: &pb::PoolInstance) -> Instance {
    Instance {
        running: i.power_state == pb::PowerState::Running as i32,
        latest_model: i.latest_model_applied,
        node_ready: false,
        ..Instance::new(&i.instance_id, state_of(i))
    }
}

/// Whether a pool Machine's Node is Ready (`NodeReady=True`).
fn node_ready(m: &Machine) -> bool {
    condition(&m.status.conditions, ConditionType::NodeReady).is_some_and(|c| c.status == ConditionStatus::True)
}

/// Reconciles one MachinePool: an operation in flight is polled, a pool being deleted is torn
/// down; otherwise it observes (instances, Machines, Nodes), plans ([`plan_pool`]) and acts.
///
/// # Errors
/// Store failures.
pub async fn reconcile(ctx: &Ctx, key: &Key) -> Result<Action> {
    let Some(pool) = ctx.store.get::<MachinePool>(&key.namespace, &key.name).await? else {
        return Ok(Action::await_change());
    };
    let pool = match write::finalizer(ctx, pool).await? {
        // A pool being deleted is reconciled below (poll, then DeletePool).
        Finalizer::Apply(pool) | Finalizer::Cleanup(pool) => pool,
        Finalizer::Done(action) => return Ok(action),
    };
    if let Some(action) =
        super::open_target(ctx, &pool, pool.spec.target_cluster.as_ref(), |s| &mut s.conditions, true).await?
    {
        return Ok(action);
    }
    let wait = ctx.wait_before_call(key);
    if !wait.is_zero() {
        return Ok(Action::wait(wait));
    }
    let t = &pool.spec.template.spec;
    let r = match resolve(ctx, &key.namespace, &t.class_ref.name, t.provider_spec.as_ref()).await? {
        Ok(r) => r,
        Err(why) => {
            return why
                .record_and_recheck(ctx, &pool, |s| &mut s.conditions, ConditionType::Ready, super::UNRESOLVED_RECHECK)
                .await;
        }
    };
    if let Some(action) = keep_token(ctx, &pool).await? {
        return Ok(action);
    }
    if let Some(op) = pool.status.operations.first().cloned() {
        return poll(ctx, &pool, &r, op).await;
    }
    if pool.metadata.deletion_timestamp.is_some() {
        return delete_pool(ctx, &pool, &r).await;
    }
    let halted = super::health::halted(ctx, &key.namespace, &pool_labels(&pool)).await?;
    let seen = match observe(ctx, &pool, &r).await? {
        Ok(seen) => seen,
        Err(e) => return failed(ctx, &pool, OperationType::ListPoolInstances, Rpc::Read, &e).await,
    };
    let pace = (ctx.config.backoff_base, ctx.config.backoff_max);
    let plan = plan_pool(seen.input(&pool, halted.as_deref(), pace));
    if !plan.notes.is_empty() {
        let notes: Vec<String> = plan.notes.iter().map(ToString::to_string).collect();
        tracing::debug!("plan.notes" = %notes.join("; "), "planned pool");
    }
    act(ctx, &pool, &r, &seen, plan).await
}

/// The pool's bootstrap token (its instances share one, as they share their boot data): kept
/// from expiring while the pool lives, deleted once it is being deleted; one deleted behind the
/// controller's back is forgotten, and the next ApplyPool mints another. `Some` after a write.
async fn keep_token(ctx: &Ctx, pool: &MachinePool) -> Result<Option<Action>> {
    let target = ctx.app.target_of(&pool.metadata.namespace, pool.spec.target_cluster.as_ref());
    let (Some(target), Some(mut token)) = (target.as_deref(), pool.status.bootstrap_token.clone()) else {
        return Ok(None);
    };
    let mut next = pool.clone();
    if pool.metadata.deletion_timestamp.is_some() {
        super::boot::retire(target, &mut next.status.bootstrap_token).await?;
    } else {
        match super::boot::keep(target, &mut token).await? {
            super::boot::Kept::Fresh => return Ok(None),
            super::boot::Kept::Refreshed => next.status.bootstrap_token = Some(token),
            super::boot::Kept::Gone => next.status.bootstrap_token = None,
        }
    }
    write::status(ctx, pool, &next).await?;
    Ok(Some(Action::requeue_now()))
}

/// An operation in flight: polled; once done its outcome is recorded (and a pool being deleted
/// goes once DeletePool succeeded).
async fn poll(ctx: &Ctx, pool: &MachinePool, r: &Resolved<'_>, op: StoredOperation) -> Result<Action> {
    let mut next = pool.clone();
    let reply = match poll_stored(ctx, r.driver, r.secrets.clone(), &op).await {
        Polled::Operation(reply) => *reply,
        Polled::Unusable(why) => {
            // ApplyPool / DeletePool are idempotent: drop the handle and reconcile again.
            next.status.operations.clear();
            set_condition(
                &mut next.status.conditions,
                ConditionType::OperationTokenUnusable,
                true,
                Reason::Dropped,
                &why,
            );
            let message = format!("{why}; asking the driver again");
            ctx.store.event(Kind::MachinePool, &pool.metadata, EventReason::OperationTokenUnusable, message).await;
            write::status(ctx, pool, &next).await?;
            return Ok(Action::requeue_now());
        }
        Polled::Failed(e) => return Err(ReconcileError::call(&e, Rpc::Poll)),
    };
    if !reply.value.done {
        return Ok(Action::poll_after(reply.value.poll_after()));
    }
    next.status.operations.clear();
    let err = reply.value.error_report();
    next.status.last_operation = Some(match &err {
        Some(e) => LastOperation::failed(op.kind.into(), &reply.request_id, e),
        None => LastOperation::ok(op.kind.into(), OperationState::Succeeded, &reply.request_id),
    });
    if let Some(e) = &err {
        set_condition(
            &mut next.status.conditions,
            ConditionType::Ready,
            false,
            Reason::OperationFailed,
            &e.to_string(),
        );
        let message = format!("{}: {e}", op.kind);
        ctx.store.event(Kind::MachinePool, &pool.metadata, EventReason::OperationFailed, message).await;
    }
    write::status(ctx, pool, &next).await?;
    if pool.metadata.deletion_timestamp.is_some() && err.is_none() && op.kind == OperationKind::DeletePool {
        return finish_delete(ctx, pool).await;
    }
    Ok(Action::requeue_now())
}

/// A pool being deleted: with a target cluster every instance's Node is drained first (its
/// Machine's deletion drains it and deletes that instance); the pool goes once none is left.
async fn delete_pool(ctx: &Ctx, pool: &MachinePool, r: &Resolved<'_>) -> Result<Action> {
    if ctx.app.target_of(&pool.metadata.namespace, pool.spec.target_cluster.as_ref()).is_some() {
        let machines = owned_machines(ctx, pool).await?;
        if !machines.is_empty() {
            let doomed: Vec<Key> = machines.iter().filter(|m| !m.is_deleting()).map(Key::of).collect();
            super::slow_start(doomed, |key| async move { ctx.store.delete(&key).await.map(drop) }).await?;
            return Ok(Action::requeue(super::DELETION_RECHECK));
        }
    }
    let req =
        pb::DeletePoolRequest { name: pool.metadata.name.clone(), provider_spec: None, secrets: r.secrets.clone() };
    match ctx.call(r.driver, "DeletePool", |c| async move { c.delete_pool(req).await }).await {
        Ok(reply) if reply.value.done => finish_delete(ctx, pool).await,
        Ok(reply) => start(ctx, pool, OperationKind::DeletePool, reply).await,
        Err(e) if policy::decide(&e.report, Source::Call(Rpc::Delete)) == Decision::Done => {
            finish_delete(ctx, pool).await
        }
        Err(e) => Err(ReconcileError::call(&e, Rpc::Delete)),
    }
}

/// What one pool reconcile observed: the driver's instances, the pool's Machines, and what the
/// planner reads of them (their Nodes' readiness through the Machines' `NodeReady`).
struct Observation {
    /// The instances listed (two listings merged when the first lacked a Machine's instance).
    list: Vec<pb::PoolInstance>,
    /// The pool's Machines.
    machines: Vec<Machine>,
    /// The instances as the planner sees them.
    instances: Vec<Instance>,
    /// Instances whose Machine is being deleted.
    deleting: HashSet<String>,
    /// Instances whose Machine carries the delete-machine annotation.
    annotated: HashSet<String>,
    /// A target cluster: the instances' Nodes are managed.
    nodes_managed: bool,
    /// The revision of the pool's template.
    revision: String,
    /// The moment it was observed.
    now: chrono::DateTime<Utc>,
}

impl Observation {
    /// The planner's input.
    fn input<'a>(&'a self, pool: &'a MachinePool, halted: Option<&'a str>, pace: (Duration, Duration)) -> Observed<'a> {
        Observed {
            replicas: pool.spec.replicas,
            strategy: &pool.spec.strategy,
            revision: &self.revision,
            applied_revision: &pool.status.applied_revision,
            applied_capacity: pool.status.applied_capacity,
            instances: &self.instances,
            deleting: &self.deleting,
            annotated: &self.annotated,
            nodes_managed: self.nodes_managed,
            budgets: &pool.spec.disruption.budgets,
            max_in_flight: crate::plan::pool::max_in_flight(pool),
            remediation: &pool.status.disruption.remediation,
            pace,
            remediation_halted: halted,
            pool: &pool.metadata.name,
            canary: pool.status.canary.as_ref(),
            now: self.now,
        }
    }
}

/// The labels of a pool's Machines (what a MachineHealthCheck selects them by).
fn pool_labels(pool: &MachinePool) -> std::collections::BTreeMap<String, String> {
    [(LABEL_POOL.to_string(), pool.metadata.name.clone())].into()
}

/// Why a pool Machine is to be remediated, if it is: failed (its instance, or its Node never
/// joined), marked by a MachineHealthCheck for its owner, or annotated; never with
/// skip-remediation. (While a short circuit halts remediation, the machines the check marked
/// unhealthy are what waits: the planner holds them.)
fn remediation_of(m: &Machine) -> Option<Remediation> {
    let on = |key: &str| m.metadata.annotations.get(key).is_some_and(|v| v != "false");
    if m.is_deleting() || on(ANNOTATION_SKIP_REMEDIATION) {
        return None;
    }
    if m.status.phase == Phase::Failed {
        return Some(Remediation::Failed);
    }
    if is_false(m, ConditionType::OwnerRemediated) {
        return Some(Remediation::Unhealthy);
    }
    on(ANNOTATION_REMEDIATE).then_some(Remediation::Requested)
}

/// Whether a Machine's condition `t` is False.
fn is_false(m: &Machine, t: ConditionType) -> bool {
    condition(&m.status.conditions, t).is_some_and(|c| c.status == ConditionStatus::False)
}

/// Lists the instances and the pool's Machines. A listing of several pages is no snapshot: when
/// an instance goes while the pages are read (a delete finishing), the later pages shift and a
/// live instance can be missing from it. So an instance counts as gone only when a second
/// listing lacks it too.
///
/// # Errors
/// Store failures; a failed listing is the inner error.
async fn observe(
    ctx: &Ctx,
    pool: &MachinePool,
    r: &Resolved<'_>,
) -> Result<std::result::Result<Observation, driver_sdk::CallError>> {
    let mut list = match instances(ctx, r, &pool.metadata.name).await {
        Ok(l) => l,
        Err(e) => return Ok(Err(e)),
    };
    let machines = owned_machines(ctx, pool).await?;
    if !unlisted(&list, &machines).is_empty() {
        match instances(ctx, r, &pool.metadata.name).await {
            Ok(again) => list = union(again, list),
            Err(e) => return Ok(Err(e)),
        }
    }
    let instance_of = |m: &Machine| m.spec.pool_ref.as_ref().map(|p| p.instance_id.clone());
    let deleting = machines.iter().filter(|m| m.is_deleting()).filter_map(instance_of).collect();
    let annotated = machines
        .iter()
        .filter(|m| m.metadata.annotations.get(ANNOTATION_DELETE).is_some_and(|v| v != "false"))
        .filter_map(instance_of)
        .collect();
    let by_instance: HashMap<&str, &Machine> =
        machines.iter().filter_map(|m| Some((m.spec.pool_ref.as_ref()?.instance_id.as_str(), m))).collect();
    let instances = list
        .iter()
        .map(|i| {
            let m = by_instance.get(i.instance_id.as_str());
            Instance {
                node_ready: m.is_some_and(|m| node_ready(m)),
                remediation: m.and_then(|m| remediation_of(m)),
                marked_unhealthy: m
                    .is_some_and(|m| !m.is_deleting() && is_false(m, ConditionType::HealthCheckSucceeded)),
                taken: m.and_then(|m| m.disruption()),
                failure: m.and_then(|m| m.status.failure.as_ref()).map(|f| format!("{}: {}", f.reason, f.message)),
                interrupted: m.and_then(|m| Some(m.status.interruption.as_ref()?.kind)),
                ..instance(i)
            }
        })
        .collect();
    let nodes_managed = ctx.app.target_of(&pool.metadata.namespace, pool.spec.target_cluster.as_ref()).is_some();
    let revision = short_hash(&pool.spec.template);
    let now = Utc::now();
    Ok(Ok(Observation { list, machines, instances, deleting, annotated, nodes_managed, revision, now }))
}

/// Carries out a plan: mirrors the instances as Machines, then makes its one call (or deletes
/// its Machines) and writes the status.
async fn act(ctx: &Ctx, pool: &MachinePool, r: &Resolved<'_>, seen: &Observation, plan: Plan) -> Result<Action> {
    mirror(ctx, pool, &seen.list, &seen.machines).await?;
    let by_instance: HashMap<&str, &Machine> =
        seen.machines.iter().filter_map(|m| Some((m.spec.pool_ref.as_ref()?.instance_id.as_str(), m))).collect();
    // The marks first, and alone (the plan's step is Wait): what depends on them runs from the
    // next plan on, on what is stored. A mark lost to a concurrent change leaves nothing done.
    let mut marked = true;
    for (id, why) in &plan.mark {
        let Some(m) = by_instance.get(id.as_str()) else {
            marked = false;
            continue;
        };
        let fresh = ctx.store.get::<Machine>(&m.metadata.namespace, &m.metadata.name).await?;
        let unchanged = fresh.filter(|f| f.metadata.resource_version == m.metadata.resource_version);
        marked &= super::remediation::mark(ctx, unchanged, *why).await?;
    }
    if !marked {
        tracing::debug!("a remediation mark did not land; planning again");
        return Ok(Action::requeue_now());
    }
    let mut next = pool.clone();
    next.status.replicas = plan.replicas;
    next.status.ready_replicas = plan.ready_replicas;
    next.status.updated_replicas = plan.updated_replicas;
    next.status.disruption = plan.disruption_status.clone();
    disruption_conditions(&mut next.status.conditions, &plan.disruption);
    super::remediation::blocked_event(
        ctx,
        Kind::MachinePool,
        &pool.metadata,
        &pool.status.conditions,
        &next.status.conditions,
    )
    .await;
    if let Some(ready) = &plan.ready {
        set_condition(
            &mut next.status.conditions,
            ConditionType::Ready,
            ready.holds,
            ready.reason.clone(),
            &ready.message,
        );
    }
    next.status.canary = plan.canary.clone();
    for e in &plan.events {
        ctx.store.event(Kind::MachinePool, &pool.metadata, e.reason, e.message.clone()).await;
    }
    match plan.step {
        Step::Apply { capacity } => {
            next.status.applied_revision = seen.revision.clone();
            next.status.applied_capacity = capacity;
            apply(ctx, pool, r, &next, capacity).await
        }
        Step::Delete(ids) => instances_step(ctx, pool, r, &next, OperationKind::DeletePoolInstances, ids).await,
        Step::Upgrade(ids) => instances_step(ctx, pool, r, &next, OperationKind::UpgradePoolInstances, ids).await,
        Step::DeleteMachines(ids) => {
            delete_machines(ctx, pool, &seen.machines, &ids).await?;
            write::status(ctx, pool, &next).await?;
            // The Machines' changes wake the pool; this is a safety net.
            Ok(Action::requeue(super::DELETION_RECHECK))
        }
        Step::Wait => {
            // The driver answered: whatever the environment refused before is over.
            next.status.conditions.retain(|c| !ENVIRONMENT_CONDITIONS.contains(&c.condition_type));
            write::status(ctx, pool, &next).await?;
            if !plan.mark.is_empty() {
                // The marks are stored: the next plan acts on them.
                return Ok(Action::requeue_now());
            }
            let mut after = if plan.done { POOL_SETTLED_RECHECK } else { POOL_PROGRESS_RECHECK };
            // A budget's window opens or closes, or the remediation pace allows the next.
            if let Some(at) = plan.disruption.recheck_at {
                after = after.min((at - seen.now).to_std().unwrap_or_default().max(super::MIN_REQUEUE));
            }
            Ok(Action::requeue(after))
        }
    }
}

/// DeletePoolInstances or UpgradePoolInstances; a canary that just changed (passed: the upgrade
/// goes on) is recorded first.
async fn instances_step(
    ctx: &Ctx,
    pool: &MachinePool,
    r: &Resolved<'_>,
    next: &MachinePool,
    kind: OperationKind,
    ids: Vec<String>,
) -> Result<Action> {
    if next.status.canary == pool.status.canary {
        return pool_instances_call(ctx, pool, r, kind, ids).await;
    }
    write::status(ctx, pool, next).await?;
    let Some(fresh) = ctx.store.get::<MachinePool>(&pool.metadata.namespace, &pool.metadata.name).await? else {
        return Ok(Action::await_change());
    };
    pool_instances_call(ctx, &fresh, r, kind, ids).await
}

/// ApplyPool: the revision and capacity are recorded first (`next`), then the call made.
async fn apply(ctx: &Ctx, pool: &MachinePool, r: &Resolved<'_>, next: &MachinePool, capacity: i64) -> Result<Action> {
    let mut token = pool.status.bootstrap_token.clone();
    let secrets = match super::boot::render(ctx, r, &super::boot::Holder::pool(pool), &mut token).await? {
        super::boot::Boot::Rendered(secrets) => secrets,
        super::boot::Boot::TokenRecorded => {
            // Only the token: the revision and capacity are recorded with the call.
            let mut with_token = pool.clone();
            with_token.status.bootstrap_token = token;
            write::status(ctx, pool, &with_token).await?;
            return Ok(Action::requeue_now());
        }
        super::boot::Boot::Unrenderable(why) => {
            let mut held = pool.clone();
            let newly = condition(&pool.status.conditions, ConditionType::Ready)
                .is_none_or(|c| c.reason != Reason::BootDataUnrenderable);
            set_condition(&mut held.status.conditions, ConditionType::Ready, false, Reason::BootDataUnrenderable, &why);
            if newly {
                ctx.store.event(Kind::MachinePool, &pool.metadata, EventReason::BootDataUnrenderable, why).await;
            }
            write::status(ctx, pool, &held).await?;
            return Ok(Action::requeue(super::UNRESOLVED_RECHECK));
        }
    };
    let mut next = next.clone();
    next.status.bootstrap_token = token;
    let next = &next;
    let req = pb::ApplyPoolRequest {
        name: pool.metadata.name.clone(),
        provider_spec: Some(driver_sdk::convert::json_to_struct(&r.provider_spec)),
        capacity: capacity as i32,
        secrets,
        labels: [(TAG_CONTROLLER.to_string(), ctx.app.settings.controller_id.clone())].into(),
    };
    write::status(ctx, pool, next).await?;
    let Some(fresh) = ctx.store.get::<MachinePool>(&pool.metadata.namespace, &pool.metadata.name).await? else {
        return Ok(Action::await_change());
    };
    match ctx.call(r.driver, "ApplyPool", |c| async move { c.apply_pool(req).await }).await {
        Ok(reply) if reply.value.done => Ok(Action::requeue(POOL_DONE_RECHECK)),
        Ok(reply) => start(ctx, &fresh, OperationKind::ApplyPool, reply).await,
        Err(e) => failed(ctx, &fresh, OperationType::ApplyPool, Rpc::Mutate, &e).await,
    }
}

/// Nodes managed: the chosen instances go by deleting their Machines (each drains its Node,
/// then deletes exactly its instance). A Machine not found is already gone.
async fn delete_machines(ctx: &Ctx, pool: &MachinePool, machines: &[Machine], ids: &[String]) -> Result<()> {
    let mut names = Vec::new();
    for id in ids {
        let key = machines
            .iter()
            .find(|m| m.spec.pool_ref.as_ref().is_some_and(|p| &p.instance_id == id))
            .map(Key::of)
            .unwrap_or_else(|| {
                Key::new(Kind::Machine, &pool.metadata.namespace, &machine_name(&pool.metadata.name, id))
            });
        match ctx.store.delete(&key).await {
            Ok(Some(_)) => names.push(key.name),
            Ok(None) | Err(StoreError::NotFound(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
    if !names.is_empty() {
        let message =
            format!("deleting Machine(s) {} (each Node is drained before its instance goes)", names.join(", "));
        ctx.store.event(Kind::MachinePool, &pool.metadata, EventReason::DeletingMachines, message).await;
    }
    Ok(())
}

/// DeletePoolInstances (`kind` [`OperationKind::DeletePoolInstances`]) or UpgradePoolInstances
/// of the instances `ids`, each request built once; an operation it starts is stored.
async fn pool_instances_call(
    ctx: &Ctx,
    pool: &MachinePool,
    r: &Resolved<'_>,
    kind: OperationKind,
    ids: Vec<String>,
) -> Result<Action> {
    let (pool_name, secrets, method) = (pool.metadata.name.clone(), r.secrets.clone(), kind.method());
    let (rpc, result) = if kind == OperationKind::DeletePoolInstances {
        let req = pb::DeletePoolInstancesRequest { pool_name, instance_ids: ids, provider_spec: None, secrets };
        (Rpc::Delete, ctx.call(r.driver, method, |c| async move { c.delete_pool_instances(req).await }).await)
    } else {
        let req = pb::UpgradePoolInstancesRequest { pool_name, instance_ids: ids, provider_spec: None, secrets };
        (Rpc::Mutate, ctx.call(r.driver, method, |c| async move { c.upgrade_pool_instances(req).await }).await)
    };
    match result {
        Ok(reply) if reply.value.done => Ok(Action::requeue(POOL_DONE_RECHECK)),
        Ok(reply) => start(ctx, pool, kind, reply).await,
        Err(e) => failed(ctx, pool, kind.into(), rpc, &e).await,
    }
}

/// Stores a started operation before anything else.
async fn start(
    ctx: &Ctx,
    pool: &MachinePool,
    kind: OperationKind,
    reply: driver_sdk::Reply<pb::Operation>,
) -> Result<Action> {
    let mut next = pool.clone();
    next.status.operations = vec![StoredOperation::from_pb(kind, &reply.value, &reply.request_id)];
    next.status.last_operation = Some(LastOperation::ok(kind.into(), OperationState::Processing, &reply.request_id));
    write::status(ctx, pool, &next).await?;
    Ok(Action::poll_after(reply.value.poll_after()))
}

/// A failed pool call: the Ready condition (and an environment condition) say why; the runtime
/// retries per the error policy (a permanent error slowly: the pool must converge).
async fn failed(
    ctx: &Ctx,
    pool: &MachinePool,
    op_type: OperationType,
    rpc: Rpc,
    e: &driver_sdk::CallError,
) -> Result<Action> {
    let mut next = pool.clone();
    next.status.last_operation = Some(LastOperation::failed(op_type, e.request_id(), &e.report));
    set_condition(&mut next.status.conditions, ConditionType::Ready, false, Reason::CallFailed, &e.report.to_string());
    let decision = policy::decide(&e.report, Source::Call(rpc));
    if let Some(kind) = decision.cause().and_then(policy::Cause::environment_condition) {
        let reason =
            if e.report.reason.is_empty() { Reason::from(kind) } else { Reason::from_driver(&e.report.reason) };
        let message = format!("{} (request {})", e.report, e.request_id());
        set_condition(&mut next.status.conditions, kind, true, reason, &message);
    }
    write::status_then_fail(ctx, pool, &next, ReconcileError::call(e, rpc)).await
}

/// One Machine per instance: created for new instances, removed for gone ones, status mirrored.
/// A Machine the controller failed itself (its Node never joined) stays Failed until its owner
/// remediates it.
async fn mirror(ctx: &Ctx, pool: &MachinePool, list: &[pb::PoolInstance], machines: &[Machine]) -> Result<()> {
    let by_instance: HashMap<&str, &Machine> =
        machines.iter().filter_map(|m| m.spec.pool_ref.as_ref().map(|p| (p.instance_id.as_str(), m))).collect();
    for i in list {
        let phase = instance_phase(state_of(i));
        match by_instance.get(i.instance_id.as_str()) {
            None => {
                let mut m = Machine::new(
                    &pool.metadata.namespace,
                    &machine_name(&pool.metadata.name, &i.instance_id),
                    MachineSpec {
                        class_ref: pool.spec.template.spec.class_ref.clone(),
                        provider_spec: pool.spec.template.spec.provider_spec.clone(),
                        pool_ref: Some(PoolInstanceRef {
                            name: pool.metadata.name.clone(),
                            instance_id: i.instance_id.clone(),
                        }),
                        creation_timeout_seconds: None,
                        health_timeout_seconds: None,
                        node: Some(pool.spec.node_settings()),
                        node_template: pool.spec.template.spec.node_template.clone(),
                        failure_domain: None,
                        target_cluster: pool.spec.target_cluster.clone(),
                    },
                );
                m.metadata.labels.insert(LABEL_POOL.into(), pool.metadata.name.clone());
                m.metadata.finalizers = vec![FINALIZER.into()];
                m.metadata.owner_references =
                    vec![OwnerReference::controller_of(Kind::MachinePool, &pool.metadata.name, &pool.metadata.uid)];
                match ctx.store.create(&m).await {
                    Ok(_) | Err(StoreError::AlreadyExists(_)) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            Some(m) if !m.is_deleting() && m.status.failure.is_none() => {
                let mut next = (*m).clone();
                // With a target cluster a running instance is Provisioned until its Node is Ready.
                let joining = ctx.app.machine_target(m).is_some() && phase == Phase::Running && !node_ready(m);
                let phase = if joining { Phase::Provisioned } else { phase };
                next.status.phase = phase;
                next.status.provider_id = i.provider_id.clone();
                next.status.addresses = i
                    .addresses
                    .iter()
                    .map(|a| Address { address_type: a.r#type.clone(), address: a.address.clone() })
                    .collect();
                let reason = if joining { Reason::WaitingForNode } else { Reason::from(phase) };
                set_condition(&mut next.status.conditions, ConditionType::Ready, phase == Phase::Running, reason, "");
                if joining {
                    if let Some(message) = super::node::node_not_joined(&mut next, 0) {
                        // Remediated by the pool like any failed instance: its Machine's
                        // deletion removes exactly this instance, and the pool refills.
                        ctx.store.event(Kind::Machine, &next.metadata, EventReason::NodeNotJoined, message).await;
                        match write::status(ctx, *m, &next).await {
                            Err(e) if e.is_conflict() => {}
                            Err(e) => return Err(e),
                            Ok(_) => {}
                        }
                        continue;
                    }
                }
                set_condition(
                    &mut next.status.conditions,
                    ConditionType::UpToDate,
                    i.latest_model_applied,
                    if i.latest_model_applied { Reason::LatestModel } else { Reason::OldModel },
                    "",
                );
                match write::status(ctx, *m, &next).await {
                    // Changed meanwhile: the next pass mirrors it.
                    Err(e) if e.is_conflict() => {}
                    Err(e) => return Err(e),
                    Ok(_) => {}
                }
                if joining {
                    // A status write does not wake the Machine itself: its Node is looked for
                    // (and its changes watched) from now on.
                    ctx.wake(Key::of(*m));
                }
            }
            Some(_) => {}
        }
    }
    // Instances gone from the cloud (scale-in, upgrades by deletion, deleted out of band): their
    // Machines go too, released without a call. Deleting a pool Machine the usual way deletes its
    // instance; here there is nothing left to delete, and if the listing was wrong that call
    // would delete a live instance.
    for m in unlisted(list, machines) {
        match write::release(ctx, m).await {
            Ok(true) => {}
            // Changed meanwhile (e.g. deleted by a user): the next reconcile looks again.
            Ok(false) => continue,
            Err(e) if e.is_conflict() => continue,
            Err(e) => return Err(e),
        }
        ctx.store.delete(&Key::of(m)).await?;
    }
    Ok(())
}

/// The pool's Machines, not being deleted, whose instances `list` lacks.
fn unlisted<'a>(list: &[pb::PoolInstance], machines: &'a [Machine]) -> Vec<&'a Machine> {
    let present: HashSet<&str> = list.iter().map(|i| i.instance_id.as_str()).collect();
    machines
        .iter()
        .filter(|m| !m.is_deleting())
        .filter(|m| m.spec.pool_ref.as_ref().is_some_and(|p| !present.contains(p.instance_id.as_str())))
        .collect()
}

/// Two listings as one: every instance of `newer`, then those only `older` has (gone meanwhile,
/// or missed by `newer`; either way not yet proven gone).
fn union(newer: Vec<pb::PoolInstance>, older: Vec<pb::PoolInstance>) -> Vec<pb::PoolInstance> {
    let seen: HashSet<String> = newer.iter().map(|i| i.instance_id.clone()).collect();
    let mut out = newer;
    out.extend(older.into_iter().filter(|i| !seen.contains(&i.instance_id)));
    out
}

/// The Machines of a pool carry its name as a label.
fn pool_machines(pool: &MachinePool) -> ListParams {
    ListParams::namespaced(&pool.metadata.namespace).label(LABEL_POOL, &pool.metadata.name)
}

/// The pool's Machines (by its label, checked against their pool reference).
async fn owned_machines(ctx: &Ctx, pool: &MachinePool) -> Result<Vec<Machine>> {
    Ok(ctx
        .store
        .list_with::<Machine>(&pool_machines(pool))
        .await?
        .into_iter()
        .filter(|m| m.spec.pool_ref.as_ref().is_some_and(|p| p.name == pool.metadata.name))
        .collect())
}

async fn finish_delete(ctx: &Ctx, pool: &MachinePool) -> Result<Action> {
    let machines = owned_machines(ctx, pool).await?;
    for m in &machines {
        ctx.store.delete(&Key::of(m)).await?;
    }
    write::release(ctx, pool).await?;
    Ok(Action::await_change())
}

/// A pool Machine: deleting it deletes exactly its instance.
///
/// # Errors
/// Store failures.
pub async fn reconcile_machine(ctx: &Ctx, key: &Key, m: Machine) -> Result<Action> {
    // Pool Machines are made with the finalizer (never added here: a Machine released for an
    // instance gone from the cloud must go without a call). The pool mirrors their instances;
    // here only their Node (with a target cluster) and their deletion are reconciled.
    if !write::cleanup_due(&m) {
        let target = ctx.app.machine_target(&m);
        let Some(target) = target.as_deref() else { return Ok(Action::await_change()) };
        if m.is_deleting() || m.status.provider_id.is_empty() {
            return Ok(Action::await_change());
        }
        let mut next = m.clone();
        super::node::observe(ctx, target, key, &mut next).await?;
        if node_ready(&next) != node_ready(&m) {
            // The pool counts it ready (or not) on its next pass.
            if let Some(owner) = m.spec.pool_ref.as_ref() {
                ctx.wake(Key::new(Kind::MachinePool, &key.namespace, &owner.name));
            }
        }
        write::status(ctx, &m, &next).await?;
        return Ok(Action::await_change());
    }
    let Some(pref) = m.spec.pool_ref.clone() else { return Ok(Action::await_change()) };
    let Some(pool) = ctx.store.get::<MachinePool>(&key.namespace, &pref.name).await? else {
        // The pool is gone, and its instances with it.
        return deletion::release(ctx, key, m).await;
    };
    let t = &pool.spec.template.spec;
    let resolved = resolve(ctx, &key.namespace, &t.class_ref.name, t.provider_spec.as_ref()).await?;
    let instance = deletion::Instance::Pool { pool: pref.name.clone(), id: pref.instance_id.clone(), resolved };
    deletion::run(ctx, key, m, instance).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn instance(id: &str) -> pb::PoolInstance {
        pb::PoolInstance { instance_id: id.into(), state: pb::InstanceState::Running as i32, ..Default::default() }
    }

    fn machine(id: &str, deleting: bool) -> Machine {
        let mut m = Machine::new(
            "default",
            &machine_name("workers", id),
            MachineSpec {
                class_ref: NameRef { name: "c".into() },
                provider_spec: None,
                pool_ref: Some(PoolInstanceRef { name: "workers".into(), instance_id: id.into() }),
                creation_timeout_seconds: None,
                health_timeout_seconds: None,
                node: None,
                node_template: None,
                failure_domain: None,
                target_cluster: None,
            },
        );
        if deleting {
            m.metadata.deletion_timestamp = Some(Utc::now());
        }
        m
    }

    #[test]
    fn an_instance_whose_node_never_becomes_ready_fails_after_the_node_startup_timeout() {
        let mut m = machine("0", false);
        m.spec.node = Some(NodeSettings { node_startup_timeout_seconds: 600, ..Default::default() });
        let node_not_joined = |m: &mut Machine| crate::reconcile::node::node_not_joined(m, 0).is_some();
        assert!(!node_not_joined(&mut m), "the wait starts now");
        assert!(m.status.provisioned.is_some());
        m.status.provisioned = Some(Utc::now() - chrono::Duration::seconds(599));
        assert!(!node_not_joined(&mut m));
        m.status.provisioned = Some(Utc::now() - chrono::Duration::seconds(601));
        assert!(node_not_joined(&mut m));
        assert_eq!(m.status.phase, Phase::Failed);
        let f = m.status.failure.clone().unwrap();
        assert_eq!(f.reason, crate::policy::REASON_NODE_NOT_JOINED);
        assert!(f.message.contains("no Ready Node 600s"), "{}", f.message);
        let mut forever = machine("1", false);
        forever.spec.node = Some(NodeSettings { node_startup_timeout_seconds: 0, ..Default::default() });
        forever.status.provisioned = Some(Utc::now() - chrono::Duration::days(1));
        assert!(!node_not_joined(&mut forever), "0 waits forever");
    }

    fn ids(list: &[pb::PoolInstance]) -> Vec<&str> {
        list.iter().map(|i| i.instance_id.as_str()).collect()
    }

    #[test]
    fn unlisted_names_the_machines_a_listing_lacks_except_those_being_deleted() {
        let machines = [machine("0", true), machine("1", false), machine("2", false)];
        // The listing torn by instance 0 going between its pages: [0, 1] then nothing.
        let torn = [instance("0"), instance("1")];
        let names: Vec<&str> = unlisted(&torn, &machines).iter().map(|m| m.metadata.name.as_str()).collect();
        assert_eq!(names, ["workers-2"]);
        assert!(unlisted(&[instance("1"), instance("2")], &machines).is_empty());
    }

    #[test]
    fn an_instance_is_gone_only_when_both_listings_lack_it() {
        // The second listing lacks 0 (gone meanwhile); the first lacked 2 (missed).
        let merged = union(vec![instance("1"), instance("2")], vec![instance("0"), instance("1")]);
        assert_eq!(ids(&merged), ["1", "2", "0"]);
        let machines = [machine("0", false), machine("1", false), machine("2", false), machine("3", false)];
        let names: Vec<&str> = unlisted(&merged, &machines).iter().map(|m| m.metadata.name.as_str()).collect();
        assert_eq!(names, ["workers-3"]);
    }

    #[test]
    fn the_newer_listing_gives_an_instance_its_state() {
        let mut deleting = instance("1");
        deleting.set_state(pb::InstanceState::Deleting);
        let merged = union(vec![deleting], vec![instance("1")]);
        assert_eq!(merged.len(), 1);
        assert_eq!(state_of(&merged[0]), InstanceState::Deleting);
    }

    #[test]
    fn the_typed_state_decides_and_old_drivers_fall_back_to_the_string() {
        use InstanceState as S;
        #[allow(deprecated)]
        let with = |state: pb::InstanceState, legacy: &str| pb::PoolInstance {
            state: state as i32,
            provisioning_state: legacy.into(),
            ..Default::default()
        };
        // A driver's own words never matter when the state is set.
        assert_eq!(state_of(&with(pb::InstanceState::Running, "Provisioned")), S::Running);
        assert_eq!(state_of(&with(pb::InstanceState::Failed, "Succeeded")), S::Failed);
        assert_eq!(state_of(&with(pb::InstanceState::Updating, "")), S::Updating);
        // A driver older than InstanceState.
        assert_eq!(state_of(&with(pb::InstanceState::Unspecified, "Succeeded")), S::Running);
        assert_eq!(state_of(&with(pb::InstanceState::Unspecified, "Deleting")), S::Deleting);
        assert_eq!(state_of(&with(pb::InstanceState::Unspecified, "")), S::Creating);
    }
}
