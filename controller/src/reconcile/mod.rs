//! Reconcilers, one per kind, plus orphan collection.

use driver_sdk::proto as pb;
use futures::future::BoxFuture;
use serde_json::Value;

use crate::app::Ctx;
use crate::policy::{self, Decision, Rpc, Source};
use crate::resources::*;
use crate::runtime::{Action, DriverHandle, ReconcileError};
use crate::store::Key;

pub(crate) mod boot;
pub mod class;
pub(crate) mod deletion;
pub mod deployment;
pub mod health;
pub(crate) mod in_place;
pub mod interruptions;
pub mod machine;
pub mod node;
pub mod orphans;
pub mod pool;
pub(crate) mod record;
pub mod relations;
pub(crate) mod remediation;
pub(crate) mod timing;
pub(crate) mod write;

/// What polling a stored operation found.
pub(crate) enum Polled {
    /// The driver answered with the operation.
    Operation(Box<driver_sdk::Reply<pb::Operation>>),
    /// The stored handle cannot be used — not base64, empty, or refused by the driver (truncated,
    /// altered, sealed with another key, by another driver, or of an unknown version). The
    /// caller drops it and asks the driver again by name: creates and deletes are idempotent.
    Unusable(String),
    /// The call failed otherwise: back off and poll again.
    Failed(Box<driver_sdk::CallError>),
}

/// Polls a stored operation: the one way every reconciler reads a stored token.
pub(crate) async fn poll_stored(
    ctx: &Ctx,
    driver: &DriverHandle,
    secrets: Option<pb::Secrets>,
    op: &StoredOperation,
) -> Polled {
    use base64::Engine;
    let token = match base64::engine::general_purpose::STANDARD.decode(op.token.trim()) {
        Ok(t) if !t.is_empty() => t,
        Ok(_) => return Polled::Unusable("the stored operation token is empty".into()),
        Err(e) => return Polled::Unusable(format!("the stored operation token is not base64 ({e})")),
    };
    match ctx
        .call(
            driver,
            "GetOperation",
            |c| async move { c.get_operation(pb::GetOperationRequest { token, secrets }).await },
        )
        .await
    {
        Ok(reply) => Polled::Operation(Box::new(reply)),
        // The token is the only argument GetOperation checks: INVALID_ARGUMENT is about it.
        Err(e) if policy::decide(&e.report, Source::Call(Rpc::Poll)) == Decision::DropToken => Polled::Unusable(
            format!("the driver refused the stored operation token: {} (request {})", e.report, e.request_id()),
        ),
        Err(e) => Polled::Failed(Box::new(e)),
    }
}

/// Every instance of a pool, page by page (a pool the driver does not know has none).
///
/// # Errors
/// A failed listing.
pub(crate) async fn pool_instances(
    ctx: &Ctx,
    r: &Resolved<'_>,
    pool: &str,
) -> std::result::Result<Vec<pb::PoolInstance>, driver_sdk::CallError> {
    let mut out = Vec::new();
    let mut token = String::new();
    loop {
        let req = pb::ListPoolInstancesRequest {
            pool_name: pool.into(),
            page_size: 500,
            page_token: token,
            provider_spec: Some(driver_sdk::convert::json_to_struct(&r.provider_spec)),
            secrets: r.secrets.clone(),
        };
        match ctx.call(r.driver, "ListPoolInstances", |c| async move { c.list_pool_instances(req).await }).await {
            Ok(reply) => {
                out.extend(reply.value.instances);
                if reply.value.next_page_token.is_empty() {
                    return Ok(out);
                }
                token = reply.value.next_page_token;
            }
            Err(e) if policy::decide(&e.report, Source::Call(Rpc::Read)) == Decision::Absent => return Ok(out),
            Err(e) => return Err(e),
        }
    }
}

/// The largest batch [`slow_start`] runs at once.
const SLOW_START_MAX: usize = 256;

/// The shortest requeue of a wait computed from a deadline or a backoff: what is due now is
/// looked at again shortly, not in a busy loop.
const MIN_REQUEUE: std::time::Duration = std::time::Duration::from_millis(100);
/// How soon an object whose class (its driver, its Secret) does not resolve looks again; a
/// change of the class wakes it sooner.
const UNRESOLVED_RECHECK: std::time::Duration = std::time::Duration::from_secs(10);
/// How often an owner looks again while the machines it deleted are going; their changes wake
/// it too (this is a safety net).
const DELETION_RECHECK: std::time::Duration = std::time::Duration::from_secs(2);

/// Runs `f` on `items` in batches of 1, 2, 4, … (at most [`SLOW_START_MAX`]), each batch at
/// once, and stops after the first batch in which one fails, returning that error (Kubernetes'
/// ReplicaSet slow start: thousands of store writes share commits instead of waiting one by one,
/// while an object every create refuses fails once, not thousands of times).
///
/// # Errors
/// The first error of the first batch that had one.
pub(crate) async fn slow_start<I, F, Fut, E>(items: impl IntoIterator<Item = I>, f: F) -> Result<(), E>
where
    F: Fn(I) -> Fut,
    Fut: std::future::Future<Output = Result<(), E>>,
{
    let mut items = items.into_iter().peekable();
    let mut size = 1;
    while items.peek().is_some() {
        let batch: Vec<Fut> = items.by_ref().take(size).map(&f).collect();
        futures::future::join_all(batch).await.into_iter().collect::<Result<(), E>>()?;
        size = (size * 2).min(SLOW_START_MAX);
    }
    Ok(())
}

/// The controller's reconcilers, as the runtime runs them ([`crate::runtime::run`]): the
/// dispatch by kind, the relations that wake objects, and the background tasks (orphan
/// collection; with a target cluster, the watch of its Nodes).
#[derive(Debug, Default, Clone, Copy)]
pub struct Controller;

#[async_trait::async_trait]
impl crate::runtime::Reconciler for Controller {
    type App = crate::app::App;

    fn kinds(&self) -> &[Kind] {
        relations::reconciled()
    }

    async fn reconcile(&self, ctx: &Ctx, key: &Key) -> Result<Action, ReconcileError> {
        reconcile(ctx, key).await
    }

    async fn woken_by(&self, ctx: &Ctx, change: &crate::store::Change) -> Vec<crate::runtime::Wake> {
        use crate::runtime::Wake;
        if change.deleted {
            // What the application keeps for the object goes with it (the runtime forgets its own).
            ctx.app.forget(&change.key);
        }
        let mut wakes = Vec::new();
        if let Some(owner) = change.owner.clone().filter(|o| relations::wakes_owner(change.key.kind, o.kind)) {
            wakes.push(Wake { after: ctx.owner_wake_delay(&owner), key: owner, retry_now: false });
        }
        if relations::has_dependents(change.key.kind) {
            let after = ctx.config.debounce;
            wakes.extend(relations::dependents(ctx, &change.key).await.into_iter().map(|key| Wake {
                key,
                after,
                retry_now: true,
            }));
        }
        wakes
    }

    fn background(&self, ctx: &std::sync::Arc<Ctx>) -> Vec<futures::future::BoxFuture<'static, ()>> {
        use futures::FutureExt;
        let mut tasks = vec![
            orphans::run(ctx.clone()).boxed(),
            crate::app::gauges(ctx.clone()).boxed(),
            interruptions::run(ctx.clone()).boxed(),
        ];
        // Each target cluster's probe and Node watch run as tasks of its own connection.
        ctx.app.targets.start(std::sync::Arc::new(ctx.waker()));
        if let Some(client) = ctx.store.backend().api_client() {
            let what = "the store's API server".to_string();
            tasks.push(crate::safety::probe(ctx.app.safety.clone(), what, client, None).boxed());
        }
        tasks
    }
}

/// Opens the target cluster of an object in `namespace` with this `spec.targetCluster` (the
/// default one without it: `None` when the controller has none) and, for an object that names
/// one, sets its `TargetReachable` condition in `conditions`: False with the reason when its
/// Secret is missing or unusable (`Err`: the object waits, nothing of it is done) or its API
/// server does not answer (`Ok`: calls to it fail at once meanwhile), else True.
///
/// # Errors
/// Store failures.
pub(crate) async fn connect_target(
    ctx: &Ctx,
    namespace: &str,
    target: Option<&TargetCluster>,
    conditions: &mut Vec<Condition>,
) -> Result<Result<Option<std::sync::Arc<crate::targets::Connection>>, crate::targets::Unusable>, ReconcileError> {
    let found = ctx.app.targets.get(&ctx.store, namespace, target).await?;
    if target.is_some() {
        let (ok, reason, message) = match &found {
            Err(why) => (false, why.reason.clone(), why.message.clone()),
            Ok(Some(c)) => match c.unreachable() {
                Some(why) => (false, Reason::TargetUnreachable, why),
                None => (true, Reason::TargetReachable, String::new()),
            },
            Ok(None) => (true, Reason::TargetReachable, String::new()),
        };
        set_condition(conditions, ConditionType::TargetReachable, ok, reason, &message);
    }
    Ok(found)
}

/// [`connect_target`] for a reconcile of `before`: with `show`, its `TargetReachable` condition
/// (in `conditions`) is written when it changed. `Some`: what to do instead of reconciling now
/// (a condition was written, or the target's Secret is missing or unusable).
///
/// # Errors
/// A conflict and store failures.
pub(crate) async fn open_target<S, T>(
    ctx: &Ctx,
    before: &Object<S, T>,
    target: Option<&TargetCluster>,
    conditions: fn(&mut T) -> &mut Vec<Condition>,
    show: bool,
) -> Result<Option<crate::runtime::Action>, ReconcileError>
where
    Object<S, T>: Resource + Clone,
    T: PartialEq,
{
    if target.is_none() {
        return Ok(None);
    }
    let mut next = before.clone();
    let found = connect_target(ctx, &before.metadata.namespace, target, conditions(&mut next.status)).await?;
    if show && write::status(ctx, before, &next).await? == write::Written::Saved {
        return Ok(Some(crate::runtime::Action::requeue_now()));
    }
    Ok(found.err().map(|_| crate::runtime::Action::requeue(TARGET_UNUSABLE_RECHECK)))
}

/// How soon an object whose target cluster's Secret is missing or unusable looks again (a fix
/// of the Secret is read within this long).
pub(crate) const TARGET_UNUSABLE_RECHECK: std::time::Duration = std::time::Duration::from_secs(10);

/// A kind's reconcile function (kube-runtime's `reconcile`, by key).
pub type ReconcileFn = for<'a> fn(&'a Ctx, &'a Key) -> BoxFuture<'a, Result<Action, ReconcileError>>;

/// A kind's reconciler, as [`RECONCILERS`] lists it.
#[derive(Clone, Copy)]
pub struct Registered {
    /// The kind it reconciles.
    pub kind: Kind,
    /// Its reconcile function.
    pub reconcile: ReconcileFn,
}

/// The reconcilers, one line per reconciled kind, in the order a full resync queues them: the
/// runtime's dispatch. What wakes each kind is declared on its type
/// ([`KindInfo::WOKEN_BY`]).
pub const RECONCILERS: &[Registered] = &[
    Registered { kind: Kind::MachineClass, reconcile: |ctx, key| Box::pin(class::reconcile(ctx, key)) },
    Registered { kind: Kind::MachineDeployment, reconcile: |ctx, key| Box::pin(deployment::reconcile(ctx, key)) },
    Registered { kind: Kind::MachinePool, reconcile: |ctx, key| Box::pin(pool::reconcile(ctx, key)) },
    Registered { kind: Kind::Machine, reconcile: |ctx, key| Box::pin(machine::reconcile(ctx, key)) },
    Registered { kind: Kind::MachineHealthCheck, reconcile: |ctx, key| Box::pin(health::reconcile(ctx, key)) },
];

/// Runs the reconciler of `key`'s kind (a kind without one waits for changes).
///
/// # Errors
/// Store failures.
pub async fn reconcile(ctx: &Ctx, key: &Key) -> Result<Action, ReconcileError> {
    match RECONCILERS.iter().find(|r| r.kind == key.kind) {
        Some(r) => (r.reconcile)(ctx, key).await,
        None => Ok(Action::await_change()),
    }
}

/// A class resolved for a call: its driver, secrets and the merged provider spec.
pub struct Resolved<'a> {
    /// The MachineClass the object names, as read for this reconcile.
    pub class: MachineClass,
    /// The connection to the driver the class's `spec.driver` names.
    pub driver: &'a DriverHandle,
    /// Secrets from its secretRef.
    pub secrets: Option<pb::Secrets>,
    /// Class provider spec with the object's overrides merged in.
    pub provider_spec: Value,
}

/// Why a class could not be resolved, as a condition says it.
#[derive(Debug, Clone, PartialEq)]
pub struct Unresolved {
    /// The condition's reason: `ClassNotFound`, `DriverNotConfigured` or `SecretNotFound`.
    pub reason: Reason,
    /// What is missing, by name.
    pub message: String,
}

impl Unresolved {
    /// What an object whose class does not resolve does: its `condition` (one of `conditions`
    /// in its status) turns False saying why, that status is written, and it looks again after
    /// `recheck` (a change of the class or its Secret wakes it sooner).
    ///
    /// # Errors
    /// A conflict and store failures.
    pub(crate) async fn record_and_recheck<S, T>(
        self,
        ctx: &Ctx,
        before: &Object<S, T>,
        conditions: fn(&mut T) -> &mut Vec<Condition>,
        condition: ConditionType,
        recheck: std::time::Duration,
    ) -> Result<Action, ReconcileError>
    where
        Object<S, T>: Resource,
        T: PartialEq,
    {
        let mut next = before.clone();
        set_condition(conditions(&mut next.status), condition, false, self.reason, &self.message);
        write::status(ctx, before, &next).await?;
        Ok(Action::requeue(recheck))
    }
}

/// Resolves `class_name` in `namespace` with `overrides` merged over its provider spec.
///
/// # Errors
/// Store failures; an unresolvable class is `Ok(Err(..))`.
pub async fn resolve<'a>(
    ctx: &'a Ctx,
    namespace: &str,
    class_name: &str,
    overrides: Option<&Value>,
) -> Result<Result<Resolved<'a>, Unresolved>, ReconcileError> {
    let Some(class) = ctx.store.get::<MachineClass>(namespace, class_name).await? else {
        return Ok(Err(Unresolved {
            reason: Reason::ClassNotFound,
            message: format!("MachineClass {class_name} does not exist"),
        }));
    };
    let Some(driver) = ctx.app.driver(&class.spec.driver) else {
        let known = ctx.app.driver_names();
        return Ok(Err(Unresolved {
            reason: Reason::DriverNotConfigured,
            message: format!("MachineClass {class_name} uses driver {:?}, but the controller runs with {known:?} (run --driver NAME=ENDPOINT)", class.spec.driver),
        }));
    };
    let secrets = match &class.spec.secret_ref {
        None => None,
        Some(r) => match ctx.store.get::<Secret>(namespace, &r.name).await? {
            Some(s) => Some(pb::Secrets { data: s.values().into_iter().collect() }),
            None => {
                return Ok(Err(Unresolved {
                    reason: Reason::SecretNotFound,
                    message: format!("Secret {} (of MachineClass {class_name}) does not exist", r.name),
                }))
            }
        },
    };
    let provider_spec = match overrides {
        Some(o) => merge(&class.spec.provider_spec, o),
        None => class.spec.provider_spec.clone(),
    };
    Ok(Ok(Resolved { class, driver, secrets, provider_spec }))
}
