//! The Machine lifecycle: create through the driver, keep the operation in status before
//! anything else, poll it at `poll_after`, health-check Running machines, update in place;
//! behind a finalizer, the one deletion flow (`reconcile::deletion`). Pool Machines go to
//! [`super::pool::reconcile_machine`].

use std::time::Duration;

use chrono::Utc;
use driver_sdk::proto as pb;
use driver_sdk::{CallError, OperationExt};

use super::boot::{Boot, Kept};
use super::deletion::{self, Instance};
use super::in_place;
use super::record::{fail, remember, LastOperationExt, StoredOperationExt};
use super::timing::PROGRESS_SHOWN_AFTER;
use super::write::{self, Finalizer};
use super::{poll_stored, resolve, Polled, Resolved};
use crate::app::Ctx;
use crate::events::EventReason;
use crate::policy::{self, Decision, Permanent, Rpc, Source};
use crate::resources::*;
use crate::runtime::{Action, ReconcileError};
use crate::store::Key;

type Result<T> = std::result::Result<T, ReconcileError>;

/// Reconciles one Machine.
///
/// # Errors
/// Store failures (driver failures become status).
pub async fn reconcile(ctx: &Ctx, key: &Key) -> Result<Action> {
    let Some(m) = ctx.store.get::<Machine>(&key.namespace, &key.name).await? else {
        return Ok(Action::await_change());
    };
    if let Some(action) = open_target(ctx, &m).await? {
        return Ok(action);
    }
    if m.spec.pool_ref.is_some() {
        return super::pool::reconcile_machine(ctx, key, m).await;
    }
    let m = match write::finalizer(ctx, m).await? {
        Finalizer::Apply(m) => m,
        Finalizer::Cleanup(m) => {
            let r = resolve(ctx, &m.metadata.namespace, &m.spec.class_ref.name, m.spec.provider_spec.as_ref()).await?;
            return deletion::run(ctx, key, m, Instance::Vm(r)).await;
        }
        Finalizer::Done(action) => return Ok(action),
    };
    let r = match resolve(ctx, &m.metadata.namespace, &m.spec.class_ref.name, m.spec.provider_spec.as_ref()).await? {
        Ok(r) => r,
        Err(why) => {
            return why
                .record_and_recheck(ctx, &m, |s| &mut s.conditions, ConditionType::Ready, super::UNRESOLVED_RECHECK)
                .await;
        }
    };
    // The driver is called at most when it asked (poll_after, RetryInfo, backoff, the health
    // interval) — except that a new spec for a running machine is acted on at once. Steps that
    // only look at the Node call no driver and are not held back.
    let target = ctx.app.machine_target(&m);
    // A bootstrap token is kept from expiring until the Node joins.
    if let (Some(target), Some(mut token)) = (target.as_deref(), m.status.bootstrap_token.clone()) {
        match super::boot::keep(target, &mut token).await? {
            Kept::Fresh => {}
            Kept::Refreshed => {
                let mut next = m.clone();
                next.status.bootstrap_token = Some(token);
                write::status(ctx, &m, &next).await?;
                return Ok(Action::requeue_now());
            }
            Kept::Gone => return super::node::token_gone(ctx, m, r.class.metadata.generation).await,
        }
    }
    let spec_changed = spec_changed(&m, &driver_sdk::convert::spec_hash(&r.provider_spec));
    let step = next_step(&m, r.class.metadata.generation, spec_changed);
    if let (Step::Join, Some(target)) = (&step, target.as_deref()) {
        return super::node::join(ctx, target, key, m, r.class.metadata.generation).await;
    }
    let wait = ctx.wait_before_call(key);
    // A draining in-place update's steps act on the Node at once (its UpdateMachine call comes
    // right after the drain, as for a new spec).
    if !wait.is_zero() && !spec_changed && step != Step::InPlace {
        return watch_node(ctx, key, m, wait).await;
    }
    match step {
        Step::Poll(op) => poll(ctx, m, &r, op).await,
        Step::Hold => Ok(Action::await_change()),
        Step::Update => {
            // With a target cluster, an update that disrupts the machine drains its Node first.
            let disruption = in_place::disruption(&m);
            if let (Some(target), true) = (target.as_deref(), disruption != InPlaceDisruption::None) {
                if let Some(action) = in_place::begin(ctx, target, key, m.clone(), disruption).await? {
                    return Ok(action);
                }
            }
            update(ctx, key, m, &r).await
        }
        Step::InPlace => match in_place::step(ctx, key, m.clone(), &r).await? {
            Some(action) => Ok(action),
            None => update(ctx, key, m, &r).await,
        },
        Step::Health => health(ctx, key, m, &r).await,
        Step::Create => create(ctx, key, m, &r).await,
        // Without a target cluster a Provisioned machine (the controller ran with one before)
        // is Running.
        Step::Join => health(ctx, key, m, &r).await,
    }
}

/// Opens the machine's target cluster when it names one (see [`super::connect_target`]); a
/// Machine of its own (no owner) shows `TargetReachable`, an owned one leaves that to its owner.
/// `Some`: what to do instead of reconciling now (its Secret is missing or unusable).
///
/// # Errors
/// Store failures.
async fn open_target(ctx: &Ctx, m: &Machine) -> Result<Option<Action>> {
    let standalone = m.metadata.owner_references.is_empty();
    super::open_target(ctx, m, m.spec.target_cluster.as_ref(), |s| &mut s.conditions, standalone).await
}

/// Between driver calls, a Running machine's Node is still watched: its readiness is kept in
/// `NodeReady` (a Node change wakes the machine).
async fn watch_node(ctx: &Ctx, key: &Key, before: Machine, wait: Duration) -> Result<Action> {
    let target = ctx.app.machine_target(&before);
    let Some(target) = target.as_deref() else { return Ok(Action::wait(wait)) };
    if before.status.phase != Phase::Running || before.status.provider_id.is_empty() {
        return Ok(Action::wait(wait));
    }
    let mut m = before.clone();
    super::node::observe(ctx, target, key, &mut m).await?;
    write::status(ctx, &before, &m).await?;
    Ok(Action::wait(wait))
}

/// What a reconcile of a live Machine does, decided from its status alone.
#[derive(Debug, Clone, PartialEq)]
enum Step {
    /// Poll the stored operation.
    Poll(StoredOperation),
    /// Nothing until the spec or class changes (a permanent failure), or the owner replaces it.
    Hold,
    /// UpdateMachine: a running machine's spec changed (with a target cluster, a disruptive
    /// update drains its Node first: [`in_place::begin`]).
    Update,
    /// A draining in-place update is in progress ([`in_place::step`]).
    InPlace,
    /// GetMachineStatus: a running machine's health check.
    Health,
    /// CreateMachine (again: creates are idempotent by name).
    Create,
    /// The VM runs: wait for its Node to be Ready (no driver call).
    Join,
}

/// A running machine's spec changed: its generation is newer than the one the cloud machine
/// was made from and the provider spec hashes differently (class edits alone are not applied
/// in place).
fn spec_changed(m: &Machine, desired_hash: &str) -> bool {
    m.status.operations.is_empty()
        && m.metadata.generation > m.status.observed_generation
        && !m.status.spec_hash.is_empty()
        && m.status.spec_hash != desired_hash
}

fn next_step(m: &Machine, class_generation: i64, spec_changed: bool) -> Step {
    if let Some(op) = m.status.operations.first() {
        return Step::Poll(op.clone());
    }
    if let Some(f) = &m.status.failure {
        if f.generation == m.metadata.generation && f.class_generation == class_generation {
            // Permanent failure for this spec: no retries until the spec or class changes.
            return Step::Hold;
        }
    }
    match m.status.phase {
        Phase::Failed if m.status.failure.is_none() => Step::Hold,
        _ if m.status.in_place.is_some() => Step::InPlace,
        Phase::Provisioned if !m.status.provider_id.is_empty() => Step::Join,
        Phase::Running | Phase::Unknown | Phase::Updating if !m.status.provider_id.is_empty() => {
            if spec_changed {
                Step::Update
            } else {
                Step::Health
            }
        }
        _ => Step::Create,
    }
}

/// The state of a call that started an operation.
fn accepted(op: &pb::Operation) -> OperationState {
    if op.done {
        OperationState::Succeeded
    } else {
        OperationState::Processing
    }
}

fn labels_for(ctx: &Ctx, m: &Machine) -> std::collections::HashMap<String, String> {
    let mut labels: std::collections::HashMap<String, String> =
        m.metadata.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    labels.insert(TAG_CONTROLLER.into(), ctx.app.settings.controller_id.clone());
    labels.insert(TAG_MACHINE.into(), format!("{}.{}", m.metadata.namespace, m.metadata.name));
    labels
}

fn creation_timeout(m: &Machine) -> Duration {
    Duration::from_secs(m.spec.creation_timeout_seconds.unwrap_or(DEFAULT_CREATION_TIMEOUT_SECONDS))
}

fn health_timeout(m: &Machine) -> Duration {
    Duration::from_secs(m.spec.health_timeout_seconds.unwrap_or(DEFAULT_HEALTH_TIMEOUT_SECONDS))
}

fn elapsed_since(t: Option<Time>) -> Duration {
    t.and_then(|t| (Utc::now() - t).to_std().ok()).unwrap_or_default()
}

/// The condition reason a retried error sets on `Ready`: the environment problem it reports
/// (credentials, quota, an unavailable cloud), else `{op_type}Retrying`.
fn retrying_reason(decision: Decision, op_type: OperationType) -> Reason {
    decision
        .cause()
        .and_then(policy::Cause::environment_condition)
        .map_or_else(|| Reason::retrying(op_type), Reason::from)
}

/// The event of a failed create or update (refused, or its operation ended with an error): the
/// only calls whose failure this reconcile reports (a delete's is a condition).
fn failed_event(op_type: OperationType) -> EventReason {
    if op_type == OperationType::Create {
        EventReason::CreateFailed
    } else {
        EventReason::UpdateFailed
    }
}

/// Reacts to a failed mutating call (create / update): a permanent error marks the machine
/// Failed; anything else is retried by the runtime's error policy, with the reason in `Ready`.
async fn call_failed(
    ctx: &Ctx,
    key: &Key,
    before: &Machine,
    mut m: Machine,
    r: &Resolved<'_>,
    op_type: OperationType,
    e: &CallError,
) -> Result<Action> {
    m.status.last_operation = Some(LastOperation::failed(op_type, e.request_id(), &e.report));
    remember(&mut m.status, e.request_id());
    let code = format!("{:?}", e.code());
    match ctx.decide(key, &e.report, Source::Call(Rpc::Mutate)) {
        Decision::Permanent(why) => {
            let reason = match why {
                Permanent::RetriesExhausted => policy::REASON_RETRIES_EXHAUSTED,
                _ => e.report.reason.as_str(),
            };
            let message = match why {
                Permanent::RetriesExhausted => {
                    format!("{} failures in a row, the last: {}", policy::INTERNAL_RETRIES, e.report)
                }
                _ => e.report.message.clone(),
            };
            fail(&mut m, r.class.metadata.generation, &code, reason, &message);
            ctx.store.event(Kind::Machine, &m.metadata, failed_event(op_type), e.report.to_string()).await;
            write::status(ctx, before, &m).await?;
            Ok(Action::await_change())
        }
        decision => {
            // The environment (quota, credentials, an unavailable cloud), not the spec: retried
            // with the policy's backoff, and the Ready condition says why, which the owning
            // deployment or pool lifts into a condition of its own.
            let reason = retrying_reason(decision, op_type);
            let message = format!("{} (request {})", e.report, e.request_id());
            let newly = condition(&before.status.conditions, ConditionType::Ready).is_none_or(|c| c.reason != reason);
            set_condition(&mut m.status.conditions, ConditionType::Ready, false, reason.clone(), &message);
            if newly && reason == Reason::CloudCredentialsRefused {
                ctx.store.event(Kind::Machine, &m.metadata, EventReason::CloudCredentialsRefused, message).await;
            }
            write::status_then_fail(ctx, before, &m, ReconcileError::call(e, Rpc::Mutate)).await
        }
    }
}

async fn create(ctx: &Ctx, key: &Key, before: Machine, r: &Resolved<'_>) -> Result<Action> {
    let mut m = before.clone();
    if let Some(started) = m.status.create_started {
        if elapsed_since(Some(started)) > creation_timeout(&m) {
            let msg = format!("not Running {}s after its create started", creation_timeout(&m).as_secs());
            fail(&mut m, r.class.metadata.generation, "DeadlineExceeded", policy::REASON_CREATION_TIMEOUT, &msg);
            ctx.store.event(Kind::Machine, &m.metadata, EventReason::CreationTimeout, msg).await;
            write::status(ctx, &before, &m).await?;
            return Ok(Action::await_change());
        }
    }
    m.status.failure = None;
    let mut token = m.status.bootstrap_token.take();
    let boot = super::boot::render(ctx, r, &super::boot::Holder::machine(&m), &mut token).await;
    m.status.bootstrap_token = token;
    let secrets = match boot? {
        Boot::Rendered(secrets) => secrets,
        // The token's ID is written before its Secret is created: a controller killed between
        // the two finds it again.
        Boot::TokenRecorded => {
            write::status(ctx, &before, &m).await?;
            return Ok(Action::requeue_now());
        }
        Boot::Unrenderable(why) => {
            let newly = condition(&before.status.conditions, ConditionType::Ready)
                .is_none_or(|c| c.reason != Reason::BootDataUnrenderable);
            set_condition(&mut m.status.conditions, ConditionType::Ready, false, Reason::BootDataUnrenderable, &why);
            if newly {
                ctx.store.event(Kind::Machine, &m.metadata, EventReason::BootDataUnrenderable, why).await;
            }
            write::status(ctx, &before, &m).await?;
            return Ok(Action::requeue(super::UNRESOLVED_RECHECK));
        }
    };
    let req = pb::CreateMachineRequest {
        name: m.metadata.name.clone(),
        provider_spec: Some(driver_sdk::convert::json_to_struct(&r.provider_spec)),
        secrets,
        labels: labels_for(ctx, &m),
        uid: m.metadata.uid.clone(),
    };
    let reply = match ctx.call(r.driver, "CreateMachine", |c| async move { c.create_machine(req).await }).await {
        Ok(reply) => reply,
        Err(e) => return call_failed(ctx, key, &before, m, r, OperationType::Create, &e).await,
    };
    let op = reply.value;
    m.status.create_started.get_or_insert_with(Utc::now);
    m.status.last_operation = Some(LastOperation::ok(OperationType::Create, accepted(&op), &reply.request_id));
    remember(&mut m.status, &reply.request_id);
    if op.done {
        return finished(ctx, &before, m, r, OperationKind::CreateMachine, op).await;
    }
    // The operation is stored before anything else happens.
    m.status.operations = vec![StoredOperation::from_pb(OperationKind::CreateMachine, &op, &reply.request_id)];
    // A new handle replaces one that was dropped as unusable (the event keeps the history).
    remove_condition(&mut m.status.conditions, ConditionType::OperationTokenUnusable);
    m.status.phase = Phase::Creating;
    set_condition(
        &mut m.status.conditions,
        ConditionType::Ready,
        false,
        Reason::Creating,
        "the cloud is creating the machine",
    );
    write::status(ctx, &before, &m).await?;
    Ok(Action::poll_after(op.poll_after()))
}

/// One poll of the stored operation.
async fn poll(ctx: &Ctx, before: Machine, r: &Resolved<'_>, stored_op: StoredOperation) -> Result<Action> {
    let mut m = before.clone();
    let reply = match poll_stored(ctx, r.driver, r.secrets.clone(), &stored_op).await {
        Polled::Operation(reply) => *reply,
        Polled::Unusable(why) => {
            // Drivers are idempotent by name: dropping an unusable token and asking again is safe.
            m.status.operations.clear();
            set_condition(&mut m.status.conditions, ConditionType::OperationTokenUnusable, true, Reason::Dropped, &why);
            ctx.store
                .event(
                    Kind::Machine,
                    &m.metadata,
                    EventReason::OperationTokenUnusable,
                    format!("{why}; asking the driver again"),
                )
                .await;
            write::status(ctx, &before, &m).await?;
            return Ok(Action::requeue_now());
        }
        Polled::Failed(e) => {
            m.status.last_operation = Some(LastOperation::failed(OperationType::Poll, e.request_id(), &e.report));
            return write::status_then_fail(ctx, &before, &m, ReconcileError::call(&e, Rpc::Poll)).await;
        }
    };
    let op = reply.value;
    if !op.done {
        // Progress is written in coarse steps only, and not while the operation is young: a
        // short one goes from Creating to Running in two status writes.
        if let Some(s) = m.status.operations.first_mut() {
            if elapsed_since(Some(s.started)) >= PROGRESS_SHOWN_AFTER && op.progress_percent / 25 != s.progress / 25 {
                s.progress = op.progress_percent;
            }
        }
        write::status(ctx, &before, &m).await?;
        return Ok(Action::poll_after(op.poll_after()));
    }
    m.status.operations.clear();
    remember(&mut m.status, &reply.request_id);
    finished(ctx, &before, m, r, stored_op.kind, op).await
}

/// Applies a done create or update operation's outcome. A delete never ends here: a Machine being
/// deleted is reconciled by [`deletion::run`] (a pool's Machine through
/// `pool::reconcile_machine`).
async fn finished(
    ctx: &Ctx,
    before: &Machine,
    mut m: Machine,
    r: &Resolved<'_>,
    kind: OperationKind,
    op: pb::Operation,
) -> Result<Action> {
    let op_type = OperationType::from(kind);
    if let Some(err) = op.error_report() {
        m.status.last_operation = Some(LastOperation::failed(op_type, &err.request_id, &err));
        ctx.store.event(Kind::Machine, &m.metadata, failed_event(op_type), err.to_string()).await;
        // An operation that ran and failed in the cloud is final for this machine (its owner
        // replaces it); a lost, cancelled or transiently failed one is asked again (idempotent).
        let decision = policy::decide(&err, Source::Operation(Rpc::Mutate));
        if decision.is_retry() || decision == Decision::DropToken {
            let reason = retrying_reason(decision, op_type);
            set_condition(&mut m.status.conditions, ConditionType::Ready, false, reason, &err.to_string());
            return write::status_then_fail(
                ctx,
                before,
                &m,
                ReconcileError::operation(kind.method(), err, Rpc::Mutate),
            )
            .await;
        }
        if op_type == OperationType::Update {
            set_condition(
                &mut m.status.conditions,
                ConditionType::UpToDate,
                false,
                Reason::UpdateFailed,
                &err.to_string(),
            );
            m.status.phase = Phase::Running;
        }
        fail(&mut m, r.class.metadata.generation, &format!("{:?}", err.code), &err.reason, &err.message);
        write::status(ctx, before, &m).await?;
        return Ok(Action::await_change());
    }
    m.status.last_operation = Some(LastOperation::ok(op_type, OperationState::Succeeded, &op_request_id(&m)));
    if let Some(machine) = op.machine() {
        apply_cloud_view(&mut m, machine);
    }
    if op_type == OperationType::Update && in_place::updated(&mut m) {
        // A drained update: the machine stays Updating until its Node is back.
        m.status.observed_generation = m.metadata.generation;
        m.status.failure = None;
        write::status(ctx, before, &m).await?;
        return Ok(Action::requeue_now());
    }
    // With a target cluster a new VM is Provisioned until its Node is Ready; an in-place update
    // keeps a Running machine Running.
    let joining = ctx.app.machine_target(before).is_some()
        && before.status.phase != Phase::Running
        && before.status.phase != Phase::Updating;
    m.status.phase = if joining { Phase::Provisioned } else { Phase::Running };
    m.status.observed_generation = m.metadata.generation;
    m.status.failure = None;
    m.status.unhealthy_since = None;
    if joining {
        m.status.provisioned = Some(Utc::now());
        let message = "the VM runs; waiting for its Node to join";
        set_condition(&mut m.status.conditions, ConditionType::Ready, false, Reason::WaitingForNode, message);
    } else {
        set_condition(&mut m.status.conditions, ConditionType::Ready, true, Reason::Running, "");
        if before.status.phase != Phase::Running && before.status.phase != Phase::Updating {
            super::interruptions::replacement_ready(ctx, &m).await;
        }
    }
    set_condition(&mut m.status.conditions, ConditionType::UpToDate, true, Reason::SpecApplied, "");
    let reason = if op_type == OperationType::Create { EventReason::Created } else { EventReason::Updated };
    let message = format!("{} is running ({})", m.metadata.name, m.status.provider_id);
    // On the owner when there is one, as a ReplicaSet reports the pods it creates: the Machine's
    // own status says the same, and on the API server the owner's events of one reason are one
    // event series, not one Event per machine.
    let (kind, about) = match m.owner() {
        Some((kind, owner)) => {
            (kind, ObjectMeta { namespace: m.metadata.namespace.clone(), name: owner.into(), ..Default::default() })
        }
        None => (Kind::Machine, m.metadata.clone()),
    };
    // The event goes first into the store's open group and the status joins it: one commit to
    // wait for, not two, and the event is never stored after the status it announces.
    let (_, written) = tokio::join!(ctx.store.event(kind, &about, reason, message), write::status(ctx, before, &m));
    written?;
    if joining {
        // The Node may be Ready already: look at once (no driver call).
        return Ok(Action::requeue_now());
    }
    Ok(Action::poll_after(ctx.app.settings.health_check_interval))
}

fn op_request_id(m: &Machine) -> String {
    m.status.request_ids.last().cloned().unwrap_or_default()
}

fn apply_cloud_view(m: &mut Machine, machine: &pb::Machine) {
    m.status.provider_id = machine.provider_id.clone();
    m.status.addresses = machine
        .addresses
        .iter()
        .map(|a| Address { address_type: a.r#type.clone(), address: a.address.clone() })
        .collect();
    if !machine.spec_hash.is_empty() {
        m.status.spec_hash = machine.spec_hash.clone();
    }
}

/// Checks a Running machine: missing or unhealthy for longer than the health timeout → Failed.
async fn health(ctx: &Ctx, key: &Key, before: Machine, r: &Resolved<'_>) -> Result<Action> {
    let req = pb::GetMachineStatusRequest {
        name: before.metadata.name.clone(),
        provider_id: before.status.provider_id.clone(),
        provider_spec: Some(driver_sdk::convert::json_to_struct(&r.provider_spec)),
        secrets: r.secrets.clone(),
    };
    let mut m = before.clone();
    let interval = ctx.app.settings.health_check_interval;
    let healthy = match ctx.call(r.driver, "GetMachineStatus", |c| async move { c.get_machine_status(req).await }).await
    {
        Ok(reply) => {
            let cloud = reply.value;
            apply_cloud_view(&mut m, &cloud);
            let state = pb::MachineState::try_from(cloud.state).unwrap_or(pb::MachineState::Unknown);
            match state {
                pb::MachineState::Running | pb::MachineState::Updating | pb::MachineState::Creating => Ok(()),
                other => Err((Reason::MachineUnhealthy, format!("the cloud reports the machine {other:?}"))),
            }
        }
        Err(e) => match policy::decide(&e.report, Source::Call(Rpc::Read)) {
            Decision::Absent => Err((Reason::MachineMissing, "the cloud no longer has this machine".to_string())),
            // Cannot tell: keep the phase, look again later.
            _ => return Err(ReconcileError::call(&e, Rpc::Read)),
        },
    };
    if let Some(target) = ctx.app.machine_target(&m).as_deref() {
        super::node::observe(ctx, target, key, &mut m).await?;
    }
    if m.status.spec_hash == driver_sdk::convert::spec_hash(&r.provider_spec) {
        // The cloud machine runs this generation's spec (a change that did not touch the
        // provider spec, such as the node template, asks nothing of the cloud).
        m.status.observed_generation = m.metadata.generation;
    }
    match healthy {
        Ok(()) => {
            m.status.phase = Phase::Running;
            m.status.unhealthy_since = None;
            set_condition(&mut m.status.conditions, ConditionType::Ready, true, Reason::Running, "");
        }
        Err((reason, message)) => {
            let since = *m.status.unhealthy_since.get_or_insert_with(Utc::now);
            if elapsed_since(Some(since)) >= health_timeout(&m) {
                let msg = format!("{message} for more than {}s", health_timeout(&m).as_secs());
                fail(&mut m, r.class.metadata.generation, "Unavailable", policy::REASON_HEALTH_TIMEOUT, &msg);
                ctx.store.event(Kind::Machine, &m.metadata, EventReason::HealthTimeout, msg).await;
                write::status(ctx, &before, &m).await?;
                return Ok(Action::await_change());
            }
            m.status.phase = Phase::Unknown;
            set_condition(&mut m.status.conditions, ConditionType::Ready, false, reason, &message);
            let left = health_timeout(&m).saturating_sub(elapsed_since(Some(since)));
            write::status(ctx, &before, &m).await?;
            return Ok(Action::poll_after(interval.min(left).max(super::MIN_REQUEUE)));
        }
    }
    write::status(ctx, &before, &m).await?;
    Ok(Action::poll_after(interval))
}

/// Asks the driver to apply the machine's spec in place (its operation stored before anything
/// else).
async fn update(ctx: &Ctx, key: &Key, before: Machine, r: &Resolved<'_>) -> Result<Action> {
    let mut m = before.clone();
    let req = pb::UpdateMachineRequest {
        name: m.metadata.name.clone(),
        provider_spec: Some(driver_sdk::convert::json_to_struct(&r.provider_spec)),
        secrets: r.secrets.clone(),
    };
    let reply = match ctx.call(r.driver, "UpdateMachine", |c| async move { c.update_machine(req).await }).await {
        Ok(reply) => reply,
        Err(e) => return call_failed(ctx, key, &before, m, r, OperationType::Update, &e).await,
    };
    let op = reply.value;
    m.status.last_operation = Some(LastOperation::ok(OperationType::Update, accepted(&op), &reply.request_id));
    remember(&mut m.status, &reply.request_id);
    if op.done {
        return finished(ctx, &before, m, r, OperationKind::UpdateMachine, op).await;
    }
    m.status.operations = vec![StoredOperation::from_pb(OperationKind::UpdateMachine, &op, &reply.request_id)];
    m.status.phase = Phase::Updating;
    set_condition(&mut m.status.conditions, ConditionType::UpToDate, false, Reason::Updating, "updating in place");
    write::status(ctx, &before, &m).await?;
    Ok(Action::poll_after(op.poll_after()))
}

#[cfg(test)]
mod tests;
