//! One deletion flow for a Machine, whether it stands for a VM or for a pool instance:
//!
//! `PreDrainHooks → Draining (cordon, evict) → VolumesDetaching → PreTerminateHooks →
//! InstanceDeleting (the cloud delete, polled) → the Node deleted → the finalizer released`.
//!
//! [`next`] decides the step from the Machine's status and what was observed — pure, and
//! table-tested; [`run`] does it. The node steps run only with a target cluster
//! ([`super::node`] does them); each step is written to `status.deletion` before it acts, and
//! the drain's deadline when the drain begins, so a restarted or newly elected controller
//! resumes the same step with the same deadline. The instance kind sits behind one type,
//! [`Instance`]: DeleteMachine or DeletePoolInstances of exactly this instance, polled the same
//! way, and asked the same question when its Node is not Ready — is the VM gone or stopped (then
//! the Node is taken out of service instead of drained).

use driver_sdk::proto as pb;
use driver_sdk::OperationExt;

use super::node::{self, NodeSeen};
use super::record::{remember, LastOperationExt, StoredOperationExt};
use super::timing::{DELETE_UNRESOLVED_RECHECK, NOT_SYNCED_RETRY};
use super::write::{self, Written};
use super::{poll_stored, Polled, Resolved, Unresolved};
use crate::app::Ctx;
use crate::events::EventReason;
use crate::policy::{self, Decision, Rpc, Source};
use crate::resources::*;
use crate::runtime::{Action, ReconcileError};
use crate::store::Key;

type Result<T> = std::result::Result<T, ReconcileError>;

/// What a Machine's cloud side is: a VM of its own, or an instance of a pool.
pub(crate) enum Instance<'a> {
    /// A VM created through CreateMachine.
    Vm(std::result::Result<Resolved<'a>, Unresolved>),
    /// An instance of a MachinePool.
    Pool {
        /// The pool's name.
        pool: String,
        /// The instance ID.
        id: String,
        /// The pool's class, resolved.
        resolved: std::result::Result<Resolved<'a>, Unresolved>,
    },
}

impl<'a> Instance<'a> {
    fn resolved(&self) -> std::result::Result<&Resolved<'a>, &Unresolved> {
        match self {
            Instance::Vm(r) | Instance::Pool { resolved: r, .. } => r.as_ref(),
        }
    }

    /// Whether the cloud may hold something for `m`: a VM once its create was asked; a pool
    /// instance always (the Machine mirrors a listed instance).
    fn may_exist(&self, m: &Machine) -> bool {
        match self {
            Instance::Vm(_) => vm_asked_for(m),
            Instance::Pool { .. } => true,
        }
    }

    /// The delete's operation kind.
    fn kind(&self) -> OperationKind {
        match self {
            Instance::Vm(_) => OperationKind::DeleteMachine,
            Instance::Pool { .. } => OperationKind::DeletePoolInstances,
        }
    }

    /// Deletes exactly this instance (by name: idempotent).
    async fn delete(&self, ctx: &Ctx, r: &Resolved<'_>, m: &Machine) -> driver_sdk::CallResult<pb::Operation> {
        let secrets = r.secrets.clone();
        match self {
            Instance::Vm(_) => {
                let req = pb::DeleteMachineRequest {
                    name: m.metadata.name.clone(),
                    provider_id: m.status.provider_id.clone(),
                    provider_spec: Some(driver_sdk::convert::json_to_struct(&r.provider_spec)),
                    secrets,
                };
                ctx.call(r.driver, "DeleteMachine", |c| async move { c.delete_machine(req).await }).await
            }
            Instance::Pool { pool, id, .. } => {
                let req = pb::DeletePoolInstancesRequest {
                    pool_name: pool.clone(),
                    instance_ids: vec![id.clone()],
                    provider_spec: None,
                    secrets,
                };
                ctx.call(r.driver, "DeletePoolInstances", |c| async move { c.delete_pool_instances(req).await }).await
            }
        }
    }

    /// Whether the driver reports the VM gone or stopped (asked only of a Node that is not
    /// Ready: a Ready Node's VM runs).
    ///
    /// # Errors
    /// A failed call (retried).
    pub(crate) async fn gone_or_stopped(&self, ctx: &Ctx, m: &Machine) -> Result<bool> {
        let Ok(r) = self.resolved() else { return Ok(false) };
        match self {
            Instance::Vm(_) => {
                let req = pb::GetMachineStatusRequest {
                    name: m.metadata.name.clone(),
                    provider_id: m.status.provider_id.clone(),
                    provider_spec: Some(driver_sdk::convert::json_to_struct(&r.provider_spec)),
                    secrets: r.secrets.clone(),
                };
                match ctx.call(r.driver, "GetMachineStatus", |c| async move { c.get_machine_status(req).await }).await {
                    Ok(reply) => {
                        let state = pb::MachineState::try_from(reply.value.state).unwrap_or(pb::MachineState::Unknown);
                        Ok(matches!(
                            state,
                            pb::MachineState::Stopped | pb::MachineState::Deleting | pb::MachineState::Failed
                        ))
                    }
                    Err(e) => match policy::decide(&e.report, Source::Call(Rpc::Read)) {
                        Decision::Absent => Ok(true),
                        _ => Err(ReconcileError::call(&e, Rpc::Read)),
                    },
                }
            }
            Instance::Pool { pool, id, .. } => {
                let listed = match super::pool_instances(ctx, r, pool).await {
                    Ok(listed) => listed,
                    Err(e) => return Err(ReconcileError::call(&e, Rpc::Read)),
                };
                Ok(match listed.iter().find(|i| i.instance_id == *id) {
                    None => true,
                    Some(i) => {
                        i.power_state != pb::PowerState::Running as i32
                            || matches!(i.state(), pb::InstanceState::Failed | pb::InstanceState::Deleting)
                    }
                })
            }
        }
    }
}

#[async_trait::async_trait]
impl node::VmProbe for Instance<'_> {
    async fn gone_or_stopped(&self, ctx: &Ctx, m: &Machine) -> Result<bool> {
        Instance::gone_or_stopped(self, ctx, m).await
    }
}

/// Whether a VM was ever asked of the cloud for `m` (its create was made, or it has an ID).
pub(crate) fn vm_asked_for(m: &Machine) -> bool {
    !m.status.provider_id.is_empty() || m.status.create_started.is_some()
}

/// What a Machine's deletion does next.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Next {
    /// Nothing was ever asked of the cloud: let the object go without a call.
    Release,
    /// The first list of Nodes has not arrived: look again shortly.
    WaitForNodes,
    /// A node step of the sequence (hooks, drain, volumes), recorded in `status.deletion`.
    Node(DeletionPhase),
    /// The Node went before its drain or volumes were done: on to the pre-terminate hooks.
    NodeGone,
    /// Delete the instance (also while a create is in flight or after its handle was lost:
    /// whatever the cloud made under that name goes).
    DeleteInstance,
    /// Poll the stored delete.
    PollInstance(StoredOperation),
}

/// The next step of `m`'s deletion, from its status and what was seen: whether the cloud may
/// hold an instance, and its Node.
pub(crate) fn next(m: &Machine, may_exist: bool, delete_kind: OperationKind, node: NodeSeen) -> Next {
    if let Some(op) = m.status.operations.first().filter(|op| op.kind == delete_kind) {
        return Next::PollInstance(op.clone());
    }
    if !may_exist && m.status.operations.is_empty() {
        return Next::Release;
    }
    let phase = m.status.deletion.as_ref().map(|d| d.phase);
    if phase.is_some_and(|p| p >= DeletionPhase::InstanceDeleting) {
        return Next::DeleteInstance;
    }
    let hooks = m
        .metadata
        .annotations
        .keys()
        .any(|k| k.starts_with(PRE_DRAIN_HOOK_PREFIX) || k.starts_with(PRE_TERMINATE_HOOK_PREFIX));
    match node {
        NodeSeen::NoTarget => Next::DeleteInstance,
        NodeSeen::NotSynced => Next::WaitForNodes,
        // Never joined, or gone: nothing to drain, but hooks still hold the deletion.
        NodeSeen::Missing if !hooks && phase.is_none() => Next::DeleteInstance,
        seen => match phase.unwrap_or(DeletionPhase::PreDrainHooks) {
            DeletionPhase::Draining | DeletionPhase::VolumesDetaching if seen == NodeSeen::Missing => Next::NodeGone,
            p => Next::Node(p),
        },
    }
}

/// Runs `m`'s deletion one step: the cloud delete comes after the node steps, the Node's delete
/// and the release after the cloud delete.
///
/// # Errors
/// Store failures and the target cluster's refusals (retried).
pub(crate) async fn run(ctx: &Ctx, key: &Key, before: Machine, instance: Instance<'_>) -> Result<Action> {
    let seen = match ctx.app.machine_target(&before).as_deref() {
        None => NodeSeen::NoTarget,
        Some(target) => node::seen(target, key, &before),
    };
    match next(&before, instance.may_exist(&before), instance.kind(), seen) {
        Next::Release => release(ctx, key, before).await,
        Next::WaitForNodes => Ok(Action::requeue(NOT_SYNCED_RETRY)),
        Next::Node(phase) => node::deletion_step(ctx, key, before, phase, &instance).await,
        Next::NodeGone => {
            let mut m = before.clone();
            m.status.phase = Phase::Terminating;
            node::advance(&mut m, DeletionPhase::PreTerminateHooks);
            write::status(ctx, &before, &m).await?;
            Ok(Action::requeue_now())
        }
        Next::PollInstance(op) => poll(ctx, key, before, &instance, op).await,
        Next::DeleteInstance => delete_instance(ctx, key, before, &instance).await,
    }
}

/// A class that does not resolve (so the driver cannot be called): the deletion waits, saying
/// why.
async fn unresolved(ctx: &Ctx, before: &Machine, why: &Unresolved) -> Result<Action> {
    let mut m = before.clone();
    m.status.phase = Phase::Terminating;
    set_condition(&mut m.status.conditions, ConditionType::DeletionFailed, true, why.reason.clone(), &why.message);
    write::status(ctx, before, &m).await?;
    Ok(Action::requeue(DELETE_UNRESOLVED_RECHECK))
}

/// Polls the instance's stored delete: done is released, a failure recorded and retried, an
/// unusable handle dropped (the delete is asked again by name).
async fn poll(ctx: &Ctx, key: &Key, before: Machine, instance: &Instance<'_>, op: StoredOperation) -> Result<Action> {
    let wait = ctx.wait_before_call(key);
    if !wait.is_zero() {
        return Ok(Action::wait(wait));
    }
    let r = match instance.resolved() {
        Ok(r) => r,
        Err(why) => return unresolved(ctx, &before, why).await,
    };
    match poll_stored(ctx, r.driver, r.secrets.clone(), &op).await {
        Polled::Operation(reply) if reply.value.done => match reply.value.error_report() {
            Some(err) if policy::decide(&err, Source::Operation(Rpc::Delete)) != Decision::Done => {
                let mut m = before.clone();
                m.status.operations.clear();
                m.status.last_operation = Some(LastOperation::failed(OperationType::Delete, &err.request_id, &err));
                set_condition(
                    &mut m.status.conditions,
                    ConditionType::DeletionFailed,
                    true,
                    Reason::from_driver(&err.reason),
                    &err.message,
                );
                let e = ReconcileError::operation(op.kind.method(), err, Rpc::Delete);
                write::status_then_fail(ctx, &before, &m, e).await
            }
            _ => release(ctx, key, before).await,
        },
        Polled::Operation(reply) => Ok(Action::poll_after(reply.value.poll_after())),
        Polled::Unusable(why) => {
            // Deletes are idempotent by name: drop the handle and delete again.
            let mut m = before.clone();
            m.status.operations.clear();
            write::status(ctx, &before, &m).await?;
            let message = format!("{why}; deleting again");
            ctx.store.event(Kind::Machine, &before.metadata, EventReason::OperationTokenUnusable, message).await;
            Ok(Action::requeue_now())
        }
        Polled::Failed(e) => Err(ReconcileError::call(&e, Rpc::Poll)),
    }
}

/// Deletes the instance: done at once is released; an operation is stored before anything else;
/// a refusal is recorded and retried (a machine must not leak).
async fn delete_instance(ctx: &Ctx, key: &Key, before: Machine, instance: &Instance<'_>) -> Result<Action> {
    let r = match instance.resolved() {
        Ok(r) => r,
        Err(why) => return unresolved(ctx, &before, why).await,
    };
    let mut m = before.clone();
    match instance.delete(ctx, r, &m).await {
        Ok(reply) => {
            let op = reply.value;
            remember(&mut m.status, &reply.request_id);
            let state = if op.done { OperationState::Succeeded } else { OperationState::Processing };
            m.status.last_operation = Some(LastOperation::ok(OperationType::Delete, state, &reply.request_id));
            if op.done && op.error_report().is_none() {
                write::status(ctx, &before, &m).await?;
                let Some(fresh) = ctx.store.get::<Machine>(&key.namespace, &key.name).await? else {
                    return Ok(Action::await_change());
                };
                return release(ctx, key, fresh).await;
            }
            m.status.operations = vec![StoredOperation::from_pb(instance.kind(), &op, &reply.request_id)];
            m.status.phase = Phase::Terminating;
            node::instance_deleting(&mut m);
            set_condition(
                &mut m.status.conditions,
                ConditionType::Ready,
                false,
                Reason::Deleting,
                "the cloud is deleting the machine",
            );
            if write::status(ctx, &before, &m).await? == Written::Gone {
                return Ok(Action::await_change());
            }
            if let Instance::Pool { pool, id, .. } = instance {
                let message = format!("deleting instance {id} of pool {pool}");
                ctx.store.event(Kind::Machine, &m.metadata, EventReason::DeletingInstance, message).await;
            }
            Ok(Action::poll_after(op.poll_after()))
        }
        Err(e) if policy::decide(&e.report, Source::Call(Rpc::Delete)) == Decision::Done => {
            release(ctx, key, before).await
        }
        Err(e) => {
            m.status.last_operation = Some(LastOperation::failed(OperationType::Delete, e.request_id(), &e.report));
            remember(&mut m.status, e.request_id());
            m.status.phase = Phase::Terminating;
            set_condition(
                &mut m.status.conditions,
                ConditionType::DeletionFailed,
                true,
                Reason::from_driver(&e.report.reason),
                &e.report.message,
            );
            // Deletion keeps trying (the policy retries permanent errors slowly): a machine must
            // not leak.
            write::status_then_fail(ctx, &before, &m, ReconcileError::call(&e, Rpc::Delete)).await
        }
    }
}

/// The instance is gone: deletes its Node (if it had one), then removes the finalizer, and the
/// store removes the object.
///
/// # Errors
/// Store failures and the target cluster's refusal (retried).
pub(crate) async fn release(ctx: &Ctx, key: &Key, mut m: Machine) -> Result<Action> {
    if let Some(action) = node::delete_node(ctx, key, &m).await? {
        return Ok(action);
    }
    // A machine deleted before its Node joined: its bootstrap token goes with it.
    if let Some(target) = ctx.app.machine_target(&m).as_deref() {
        super::boot::retire(target, &mut m.status.bootstrap_token).await?;
    }
    if write::release(ctx, &m).await? {
        let message = format!("{} is gone from the cloud", m.metadata.name);
        ctx.store.event(Kind::Machine, &m.metadata, EventReason::Deleted, message).await;
    }
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine() -> Machine {
        let mut m = Machine::new("default", "m", MachineSpec::default());
        m.metadata.deletion_timestamp = Some(chrono::Utc::now());
        m
    }

    fn created(mut m: Machine) -> Machine {
        m.status.provider_id = "fake:///m".into();
        m
    }

    fn at(mut m: Machine, phase: DeletionPhase) -> Machine {
        m.status.deletion = Some(Deletion {
            phase,
            phase_started: chrono::Utc::now(),
            drain_started: None,
            drain_deadline: None,
            pods_left: 0,
            blocked_by: String::new(),
            out_of_service: false,
            forced: false,
        });
        m
    }

    fn op(kind: OperationKind) -> StoredOperation {
        StoredOperation {
            kind,
            name: "op".into(),
            token: "dG9rZW4=".into(),
            started: chrono::DateTime::UNIX_EPOCH,
            request_id: "r".into(),
            progress: 0,
        }
    }

    fn with_op(mut m: Machine, kind: OperationKind) -> Machine {
        m.status.operations = vec![op(kind)];
        m
    }

    fn hooked(mut m: Machine, prefix: &str) -> Machine {
        m.metadata.annotations.insert(format!("{prefix}/backup"), "".into());
        m
    }

    /// (what, machine, may the cloud hold it, the Node as seen) → the next step, for a VM and a
    /// pool instance alike.
    #[test]
    fn the_deletion_sequence_over_situations() {
        use DeletionPhase::*;
        use NodeSeen::*;
        const VM: OperationKind = OperationKind::DeleteMachine;
        const POOL: OperationKind = OperationKind::DeletePoolInstances;
        let rows: Vec<(&str, Machine, bool, OperationKind, NodeSeen, Next)> = vec![
            ("never created: released without a call", machine(), false, VM, Found, Next::Release),
            ("created, no target cluster: the VM goes", created(machine()), true, VM, NoTarget, Next::DeleteInstance),
            (
                "a create in flight: deleted by name",
                with_op(machine(), OperationKind::CreateMachine),
                false,
                VM,
                NoTarget,
                Next::DeleteInstance,
            ),
            ("the Node list not in yet: wait", created(machine()), true, VM, NotSynced, Next::WaitForNodes),
            ("a Node: the pre-drain hooks come first", created(machine()), true, VM, Found, Next::Node(PreDrainHooks)),
            ("no Node and nothing begun: the VM goes", created(machine()), true, VM, Missing, Next::DeleteInstance),
            (
                "no Node, but hooks hold it",
                hooked(created(machine()), PRE_TERMINATE_HOOK_PREFIX),
                true,
                VM,
                Missing,
                Next::Node(PreDrainHooks),
            ),
            ("draining", at(created(machine()), Draining), true, VM, Found, Next::Node(Draining)),
            (
                "the Node went mid-drain: on to the pre-terminate hooks",
                at(created(machine()), Draining),
                true,
                VM,
                Missing,
                Next::NodeGone,
            ),
            (
                "the Node went while volumes detach",
                at(created(machine()), VolumesDetaching),
                true,
                VM,
                Missing,
                Next::NodeGone,
            ),
            ("volumes", at(created(machine()), VolumesDetaching), true, VM, Found, Next::Node(VolumesDetaching)),
            (
                "pre-terminate hooks, Node or not",
                at(created(machine()), PreTerminateHooks),
                true,
                VM,
                Missing,
                Next::Node(PreTerminateHooks),
            ),
            (
                "after the hooks the instance goes",
                at(created(machine()), InstanceDeleting),
                true,
                VM,
                Found,
                Next::DeleteInstance,
            ),
            (
                "a delete in flight is polled, whatever the Node",
                with_op(at(created(machine()), InstanceDeleting), VM),
                true,
                VM,
                NotSynced,
                Next::PollInstance(op(VM)),
            ),
            ("a pool instance: always in the cloud", machine(), true, POOL, NoTarget, Next::DeleteInstance),
            ("a pool instance with a Node: drained first", machine(), true, POOL, Found, Next::Node(PreDrainHooks)),
            (
                "a pool instance's delete in flight is polled",
                with_op(machine(), POOL),
                true,
                POOL,
                Found,
                Next::PollInstance(op(POOL)),
            ),
        ];
        for (what, m, may_exist, kind, seen, want) in rows {
            assert_eq!(next(&m, may_exist, kind, seen), want, "{what}");
        }
    }
}
