//! The one way reconcilers write: status through [`status`], finalizers through [`finalizer`]
//! and [`release`] (kube-runtime's `finalizer` shape: Apply while the object lives, Cleanup
//! once it is being deleted, each safe to run twice).
//!
//! The rules are the same everywhere:
//! - a **conflict** (someone wrote since the read) is `Err(ReconcileError::Store(Conflict))`,
//!   which the runtime answers by running the key again at once with a fresh read, without
//!   counting a failure ([`crate::runtime::Ctx::error_policy`]);
//! - **not found** (deleted meanwhile) is done: nothing is left to write to;
//! - status that did not change is not written.

use crate::app::Ctx;
use crate::resources::{Object, Resource, FINALIZER};
use crate::runtime::{Action, ReconcileError};
use crate::store::Error as StoreError;

type Result<T> = std::result::Result<T, ReconcileError>;

/// What a status write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Written {
    /// The status was written.
    Saved,
    /// Nothing changed, nothing was written.
    Unchanged,
    /// The object is gone.
    Gone,
}

/// Writes `after`'s status when it differs from `before`'s.
///
/// # Errors
/// A conflict (the runtime runs the key again at once) and store failures.
pub(crate) async fn status<S, T>(ctx: &Ctx, before: &Object<S, T>, after: &Object<S, T>) -> Result<Written>
where
    Object<S, T>: Resource,
    T: PartialEq,
{
    if after.status == before.status {
        return Ok(Written::Unchanged);
    }
    match ctx.store.replace_status(after).await {
        Ok(_) => Ok(Written::Saved),
        Err(StoreError::NotFound(_)) => Ok(Written::Gone),
        Err(e) => Err(e.into()),
    }
}

/// Writes status, then fails with `e`: the driver's error decides the retry, so a conflict on
/// this write (the next reconcile reads again anyway) does not replace it.
///
/// # Errors
/// `e`, or a store failure other than a conflict.
pub(crate) async fn status_then_fail<S, T>(
    ctx: &Ctx,
    before: &Object<S, T>,
    after: &Object<S, T>,
    e: ReconcileError,
) -> Result<Action>
where
    Object<S, T>: Resource,
    T: PartialEq,
{
    match status(ctx, before, after).await {
        Ok(_) | Err(ReconcileError::Store(StoreError::Conflict { .. })) => Err(e),
        Err(other) => Err(other),
    }
}

/// Where an object stands with the controller's finalizer.
#[derive(Debug)]
pub(crate) enum Finalizer<T> {
    /// It lives and carries the finalizer: reconcile it.
    Apply(T),
    /// It is being deleted and still carries the finalizer: clean up, then [`release`] it.
    Cleanup(T),
    /// Nothing to do now: the finalizer was just added (the write wakes the object again), or
    /// the object is being deleted without it.
    Done(Action),
}

/// Whether the object is being deleted and still carries the finalizer: cleanup is due.
pub(crate) fn cleanup_due<T: Resource>(obj: &T) -> bool {
    obj.meta().deletion_timestamp.is_some() && obj.meta().finalizers.iter().any(|f| f == FINALIZER)
}

/// Adds the finalizer to a live object that lacks it (before any cloud call, so a delete can
/// never skip cleanup) and says which branch to run.
///
/// # Errors
/// A conflict and store failures.
pub(crate) async fn finalizer<T: Resource>(ctx: &Ctx, obj: T) -> Result<Finalizer<T>> {
    let has = obj.meta().finalizers.iter().any(|f| f == FINALIZER);
    let deleting = obj.meta().deletion_timestamp.is_some();
    Ok(match (deleting, has) {
        (false, true) => Finalizer::Apply(obj),
        (true, true) => Finalizer::Cleanup(obj),
        (true, false) => Finalizer::Done(Action::await_change()),
        (false, false) => {
            let mut with = obj;
            with.meta_mut().finalizers.push(FINALIZER.into());
            match ctx.store.update(&with).await {
                Ok(_) => Finalizer::Done(Action::requeue_now()),
                Err(StoreError::NotFound(_)) => Finalizer::Done(Action::await_change()),
                Err(e) => return Err(e.into()),
            }
        }
    })
}

/// Removes the finalizer after cleanup: the store then removes the object. `Ok(true)` when it
/// was removed now, `Ok(false)` when it was gone already.
///
/// # Errors
/// A conflict and store failures.
pub(crate) async fn release<T: Resource>(ctx: &Ctx, obj: &T) -> Result<bool> {
    let mut done = obj.clone();
    done.meta_mut().finalizers.retain(|f| f != FINALIZER);
    match ctx.store.update(&done).await {
        Ok(_) => Ok(true),
        Err(StoreError::NotFound(_)) => Ok(false),
        Err(e) => Err(e.into()),
    }
}
