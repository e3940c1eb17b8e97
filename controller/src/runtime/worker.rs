//! The workers and the tasks that feed them: [`run`] queues every object at start, follows the
//! store's change notifications (debounced, waking what a change affects), resyncs
//! periodically, and runs reconciles, scheduling each key's next run from its
//! [`Action`](super::Action) or error, each in a `reconcile` span that names the object and
//! why it ran ([`Trigger`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use super::metrics::KindLabels;
use super::queue::Trigger;
use super::{Ctx, Next, ReconcileError, Reconciler};
use crate::resources::Kind;
use crate::store::{Key, Store};

/// How soon a key whose reconcile ran past [`Config::reconcile_timeout`] runs again.
const TIMED_OUT_RETRY: Duration = Duration::from_secs(1);
/// The shortest resync interval honoured, so `--resync-interval 0` cannot spin.
const MIN_RESYNC_INTERVAL: Duration = Duration::from_secs(1);

impl<A> Ctx<A> {
    /// Runs `key` as soon as a worker is free (or again after its reconcile in progress): for an
    /// object another object's reconcile affected, beyond what [`Reconciler::woken_by`] wakes.
    pub fn wake(&self, key: Key) {
        self.queue.add(key, Trigger::Wake);
    }

    /// A function that wakes a key as [`Ctx::wake`] does, for a task that outlives a borrow of
    /// the context (a watch of another source).
    pub fn waker(&self) -> impl Fn(Key) + Send + Sync + 'static {
        let queue = self.queue.clone();
        move |key| queue.add(key, Trigger::Watch)
    }
}

/// Runs the workers, the change watcher and `reconciler`'s background tasks until `shutdown`
/// resolves.
pub async fn run<R: Reconciler>(
    ctx: Arc<Ctx<R::App>>,
    reconciler: Arc<R>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    // Everything is reconciled once at start: in-flight operations resume from status.
    for kind in reconciler.kinds() {
        for key in keys_of(&ctx.store, *kind).await {
            ctx.queue.add(key, Trigger::Start);
        }
    }
    let mut tasks = vec![tokio::spawn(watch(ctx.clone(), reconciler.clone()))];
    tasks.extend(reconciler.background(&ctx).into_iter().map(tokio::spawn));
    tasks.push(tokio::spawn(super::metrics::gauges(ctx.clone())));
    tasks.push(tokio::spawn(resync(ctx.clone(), reconciler.clone())));
    let mut workers = Vec::new();
    for i in 0..ctx.config.workers.max(1) {
        workers.push(tokio::spawn(worker(ctx.clone(), reconciler.clone(), i)));
    }
    shutdown.await;
    tracing::info!("stopping: finishing reconciles in progress");
    ctx.queue.close();
    for t in tasks {
        t.abort();
    }
    for w in workers {
        let _ = w.await;
    }
}

async fn keys_of(store: &Store, kind: Kind) -> Vec<Key> {
    match store.keys(kind).await {
        Ok(keys) => keys,
        Err(e) => {
            tracing::warn!("listing {kind}: {}", machine_driver_util::error_chain(&e));
            Vec::new()
        }
    }
}

async fn watch<R: Reconciler>(ctx: Arc<Ctx<R::App>>, reconciler: Arc<R>) {
    let mut rx = ctx.store.subscribe();
    loop {
        match rx.recv().await {
            Ok(change) => {
                // A status-only change was written by the object's own reconciler, which
                // already said when it runs next (controller-runtime's GenerationChanged
                // predicate, made exact: label, annotation and finalizer changes still wake).
                if reconciler.kinds().contains(&change.key.kind) && !change.status_only {
                    ctx.queue.add_after(change.key.clone(), ctx.config.debounce, Trigger::Change);
                }
                if change.deleted {
                    ctx.forget(&change.key);
                }
                for wake in reconciler.woken_by(&ctx, &change).await {
                    if wake.retry_now {
                        ctx.forget_backoff(&wake.key);
                    }
                    ctx.queue.add_after(wake.key, wake.after, Trigger::Related);
                }
            }
            Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                tracing::warn!("missed {n} change notifications; resyncing everything");
                for kind in reconciler.kinds() {
                    for key in keys_of(&ctx.store, *kind).await {
                        ctx.queue.add(key, Trigger::Resync);
                    }
                }
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
        }
    }
}

async fn worker<R: Reconciler>(ctx: Arc<Ctx<R::App>>, reconciler: Arc<R>, id: usize) {
    while let Some((key, why)) = ctx.queue.next().await {
        let span = tracing::info_span!(
            "reconcile",
            worker = id,
            "object.namespace" = %key.namespace,
            kind = %key.kind,
            "object.name" = %key.name,
            trigger = %why,
        );
        let started = Instant::now();
        let result = tokio::time::timeout(ctx.config.reconcile_timeout, reconciler.reconcile(&ctx, &key))
            .instrument(span.clone())
            .await;
        let labels = KindLabels { kind: key.kind.as_str().into() };
        ctx.metrics.reconciles.get_or_create(&labels).inc();
        ctx.metrics.reconcile_seconds.get_or_create(&labels).observe(started.elapsed().as_secs_f64());
        ctx.reconciled_in(&key, started.elapsed());
        match result {
            Ok(Ok(action)) => {
                match action.0 {
                    Next::Wait(_) => {}
                    _ => ctx.succeeded(&key),
                }
                match action.0 {
                    Next::Requeue(d) | Next::Wait(d) => ctx.queue.add_after(key.clone(), d, Trigger::Requeue),
                    Next::Poll(d) => {
                        ctx.hold(&key, d);
                        ctx.queue.add_after(key.clone(), d, Trigger::Poll);
                    }
                    Next::AwaitChange => {}
                }
            }
            Ok(Err(e)) => {
                ctx.metrics.reconcile_errors.get_or_create(&labels).inc();
                let delay = ctx.error_policy(&key, &e);
                span.in_scope(|| match &e {
                    e if e.is_conflict() => tracing::debug!("{}; reading again", machine_driver_util::error_chain(e)),
                    ReconcileError::Driver { .. } => {
                        tracing::info!("{}; retrying in {delay:?}", machine_driver_util::error_chain(&e))
                    }
                    _ => tracing::warn!(
                        "reconcile failed, retrying in {delay:?}: {}",
                        machine_driver_util::error_chain(&e)
                    ),
                });
                ctx.queue.add_after(key.clone(), delay, Trigger::Retry);
            }
            Err(_) => {
                ctx.metrics.reconcile_errors.get_or_create(&labels).inc();
                span.in_scope(|| {
                    tracing::warn!("reconcile took longer than {:?}; retrying", ctx.config.reconcile_timeout)
                });
                ctx.queue.add_after(key.clone(), TIMED_OUT_RETRY, Trigger::Retry);
            }
        }
        ctx.queue.done(&key);
    }
}

/// Reconciles everything again every `resync_interval`: a missed notification (or a store
/// written by a process whose change went unseen) delays a reconcile, never loses it.
async fn resync<R: Reconciler>(ctx: Arc<Ctx<R::App>>, reconciler: Arc<R>) {
    let mut tick = tokio::time::interval(ctx.config.resync_interval.max(MIN_RESYNC_INTERVAL));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        for kind in reconciler.kinds() {
            for key in keys_of(&ctx.store, *kind).await {
                ctx.queue.add_after(key, ctx.config.debounce, Trigger::Resync);
            }
        }
    }
}
