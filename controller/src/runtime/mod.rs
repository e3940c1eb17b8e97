//! The controller runtime, a library: it runs a [`Reconciler`] (the reconcile function, the
//! objects a change wakes, background tasks) with workers pulling keys from a
//! [`queue::WorkQueue`] fed by store change notifications (debounced), driver handles with a
//! token-bucket rate limit and per-call deadlines, the error policy ([`crate::policy`]; applied
//! by [`Ctx::error_policy`]: backoff with jitter, RetryInfo honoured, permanent errors not
//! retried), what it keeps per key in one place, and metrics. It names no reconciler.
//!
//! Reconcilers return [`Action`] or a [`ReconcileError`]; only the runtime schedules the next
//! run of a key. Each reconcile runs in a `reconcile` span naming the object (namespace, kind,
//! name) and why it ran ([`Trigger`]: its own change, a related object's, a requeue, a poll, a
//! retry, the periodic resync, ...).
//!
//! The runtime is generic over the application: [`Ctx<A>`](Ctx) holds the runtime's state (the
//! queue, what is kept per key, settings, metrics) apart from the application's context `A`
//! ([`Ctx::app`]; the controller's is [`crate::app::App`]), and a [`Reconciler`] names its `A`.
//!
//! The parts, by concern:
//! - [`config`]: the settings ([`Config`]);
//! - [`drivers`]: driver handles, their rate limit, and [`Ctx::call`];
//! - [`keys`]: what is kept per key, and the error policy built on it ([`Ctx::error_policy`]);
//! - [`metrics`]: the runtime's metrics (driver calls, reconciles, the queue, unreadable
//!   objects) and the task that keeps its gauges current;
//! - [`queue`]: the work queue;
//! - [`worker`]: [`run`], the workers, the change watcher and the periodic resync.
//!
//! This module holds the public surface: the context [`Ctx`], the [`Reconciler`] trait, what a
//! reconcile returns ([`Action`], [`ReconcileError`]) and what a change wakes ([`Wake`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use driver_sdk::{CallError, ErrorReport};
use prometheus_client::registry::Registry;

use crate::policy::{self, Source};
use crate::resources::Kind;
use crate::store::{Change, Key, Store};

pub mod config;
pub mod drivers;
pub mod keys;
pub mod metrics;
pub mod queue;
pub mod worker;

pub use config::Config;
pub use drivers::{DriverHandle, TokenBucket};
pub use keys::OWNER_WAKE_MAX;
pub use metrics::Metrics;
pub use queue::Trigger;
pub use worker::run;

use keys::KeyState;

/// What a reconciler gets: the runtime's part (the work queue, what is kept per key, settings,
/// metrics) and the application's, `A` (kube-runtime's `Controller<K>` with its `Arc<Ctx>`):
/// the runtime never reads `app`, and the application reaches the runtime's part only through
/// methods ([`Ctx::wake`], [`Ctx::call`], [`Ctx::error_policy`], ...).
pub struct Ctx<A> {
    /// Where objects live: the runtime watches it, reconcilers read and write objects only
    /// through it.
    pub store: Store,
    /// Settings.
    pub config: Config,
    /// The runtime's metrics (served at `/metrics` with `run --metrics-addr`, beside the
    /// application's).
    pub metrics: Metrics,
    /// The application's context: what its reconcilers share.
    pub app: A,
    /// The work queue: the runtime's own; reconcilers wake keys through [`Ctx::wake`].
    queue: Arc<queue::WorkQueue>,
    /// What is kept per object; an entry goes when it holds nothing.
    keys: Mutex<HashMap<Key, KeyState>>,
}

/// What to do after a reconcile (the reconciler's answer; the runtime schedules it). Opaque:
/// a reconciler builds it only with the named constructors, which say when each applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Action(Next);

/// What an [`Action`] asks of the runtime; only the runtime reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// Run again after this long; a change runs it sooner.
    Requeue(Duration),
    /// Run again after this long, and make no driver call for this object before then.
    Poll(Duration),
    /// Run again after this long, keeping the count of failed attempts.
    Wait(Duration),
    /// Run again when something changes.
    AwaitChange,
}

impl Action {
    /// Run again after `d`; a change runs it sooner. For waits the controller paces itself
    /// (hooks, a missing class or Secret, a Node that has not joined yet).
    pub fn requeue(d: Duration) -> Self {
        Action(Next::Requeue(d))
    }

    /// Run again now (after a write conflict, or to take the next step at once).
    pub fn requeue_now() -> Self {
        Action(Next::Requeue(Duration::ZERO))
    }

    /// The driver sets the pace (its `poll_after`, the health-check interval): run again after
    /// `d`, and make no driver call for this object before then, even when a change runs the
    /// reconcile sooner ([`Ctx::wait_before_call`]).
    pub fn poll_after(d: Duration) -> Self {
        Action(Next::Poll(d))
    }

    /// Nothing was done: the object is still waiting out its backoff or poll interval, `d` more
    /// ([`Ctx::wait_before_call`]). Unlike the other actions, this keeps the count of failed
    /// attempts, so the next backoff still grows.
    pub fn wait(d: Duration) -> Self {
        Action(Next::Wait(d))
    }

    /// Run again only when something changes: the object is settled, gone, or held until its
    /// spec changes (a permanent failure).
    pub fn await_change() -> Self {
        Action(Next::AwaitChange)
    }
}

impl<A> Ctx<A> {
    /// A context for the application's `app`, its metrics registered in `registry`.
    pub fn new(store: Store, config: Config, registry: &mut Registry, app: A) -> Arc<Self> {
        Arc::new(Self {
            store,
            config,
            metrics: Metrics::register(registry),
            app,
            queue: Arc::new(queue::WorkQueue::default()),
            keys: Mutex::new(HashMap::new()),
        })
    }
}

/// What the runtime runs: the reconcilers of some kinds, and which objects a stored change
/// wakes. The runtime owns the queue, the workers, backoff, holds and metrics, and names no
/// reconciler (kube-runtime's `Controller::run(reconcile, error_policy, context)` is the
/// model; the error policy is [`Ctx::error_policy`]).
#[async_trait::async_trait]
pub trait Reconciler: Send + Sync + 'static {
    /// The application's context ([`Ctx::app`]).
    type App: Send + Sync + 'static;

    /// The kinds reconciled: every object of them is queued at start and at every resync, and
    /// woken by its own changes (except status-only ones, which its own reconcile wrote).
    fn kinds(&self) -> &[Kind];

    /// Reconciles one object of one of [`Reconciler::kinds`].
    ///
    /// # Errors
    /// What [`Ctx::error_policy`] turns into the delay before the next try.
    async fn reconcile(&self, ctx: &Ctx<Self::App>, key: &Key) -> Result<Action, ReconcileError>;

    /// The other objects a stored change wakes (its owner, the objects that use it).
    async fn woken_by(&self, ctx: &Ctx<Self::App>, change: &Change) -> Vec<Wake>;

    /// Tasks that run beside the workers until the runtime stops: watches of other sources
    /// (the target cluster's Nodes), periodic sweeps (orphan collection).
    fn background(&self, ctx: &Arc<Ctx<Self::App>>) -> Vec<futures::future::BoxFuture<'static, ()>>;
}

/// An object to run because another changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wake {
    /// The object.
    pub key: Key,
    /// After this long (coalescing several changes into one reconcile).
    pub after: Duration,
    /// Its backoff is forgotten (what it waited out may be fixed).
    pub retry_now: bool,
}

/// Errors a reconcile returns; the runtime's [`Ctx::error_policy`] decides when to run again.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReconcileError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] crate::store::Error),
    /// A call to the target cluster (where the Nodes live) failed.
    #[error("target cluster")]
    Target(#[source] Box<kube::Error>),
    /// A driver call failed, or a done operation ended with an error that is retried.
    #[error("{method}: {report}")]
    Driver {
        /// The RPC (or the operation's kind).
        method: &'static str,
        /// Whether the RPC failed or the operation it started.
        origin: Source,
        /// The decoded error.
        report: Box<ErrorReport>,
    },
}

impl From<kube::Error> for ReconcileError {
    fn from(e: kube::Error) -> Self {
        ReconcileError::Target(Box::new(e))
    }
}

impl ReconcileError {
    /// A failed driver call of this kind.
    pub fn call(e: &CallError, rpc: policy::Rpc) -> Self {
        ReconcileError::Driver { method: e.method, origin: Source::Call(rpc), report: Box::new(e.report.clone()) }
    }

    /// A write found the object changed since it was read (the key runs again at once).
    pub fn is_conflict(&self) -> bool {
        matches!(self, ReconcileError::Store(crate::store::Error::Conflict { .. }))
    }

    /// A done operation's error (retried: the original call is sent again).
    pub fn operation(method: &'static str, report: ErrorReport, rpc: policy::Rpc) -> Self {
        ReconcileError::Driver { method, origin: Source::Operation(rpc), report: Box::new(report) }
    }
}
