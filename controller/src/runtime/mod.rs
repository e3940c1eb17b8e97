//! The controller runtime, a library: it runs a [`Reconciler`] (the reconcile function, the
//! objects a change wakes, background tasks) with workers pulling keys from a
//! [`queue::WorkQueue`] fed by store change notifications (debounced), driver handles with a
//! token-bucket rate limit and per-call deadlines, the error policy ([`crate::policy`]; applied
//! by [`Ctx::error_policy`]: backoff with jitter, RetryInfo honoured, permanent errors not
//! retried), what it keeps per key in one place, and metrics. It names no reconciler.
//!
//! Reconcilers return [`Action`] or a [`ReconcileError`]; only the runtime schedules the next
//! run of a key.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use driver_sdk::{CallError, CallResult, DriverClient, ErrorReport};

use crate::policy::{self, Decision, Source};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tokio::time::Instant;
use tracing::Instrument;

use crate::resources::Kind;
use crate::store::{Change, Key, Store};

pub mod queue;

/// The longest an owner's wake-up by its objects' changes is put off ([`Ctx::owner_wake_delay`]).
pub const OWNER_WAKE_MAX: Duration = Duration::from_secs(5);
/// An owner's wake-up is put off this many times as long as its last reconcile took.
const OWNER_WAKE_FACTOR: u32 = 2;
/// How soon a key whose reconcile ran past [`Config::reconcile_timeout`] runs again.
const TIMED_OUT_RETRY: Duration = Duration::from_secs(1);
/// The shortest resync interval honoured, so `--resync-interval 0` cannot spin.
const MIN_RESYNC_INTERVAL: Duration = Duration::from_secs(1);
/// How often the phase and in-flight gauges are recounted, at most ...
const GAUGE_INTERVAL: Duration = Duration::from_secs(2);
/// ... and at least (a Prometheus scrape interval is typically 15–30 s).
const GAUGE_INTERVAL_MAX: Duration = Duration::from_secs(30);
/// A recount waits this many times as long as the last one took: with 100,000 Machines a count
/// takes about 0.3 s, and every 2 s it cost a ninth of the controller's CPU; this way it costs
/// at most 2 % of a core.
const GAUGE_COST_FACTOR: u32 = 50;

/// Runtime settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Concurrent reconciles.
    pub workers: usize,
    /// Deadline of one driver call.
    pub call_timeout: Duration,
    /// Deadline of one reconcile.
    pub reconcile_timeout: Duration,
    /// Changes within this window coalesce into one reconcile.
    pub debounce: Duration,
    /// Driver calls per second allowed per driver.
    pub driver_qps: f64,
    /// Burst of the per-driver rate limit.
    pub driver_burst: u32,
    /// How often a Running machine's status is checked.
    pub health_check_interval: Duration,
    /// How often each class is listed for orphans.
    pub orphan_interval: Duration,
    /// How long an orphan is left alone before it is deleted.
    pub orphan_grace: Duration,
    /// The tag value that marks cloud machines as this controller's.
    pub controller_id: String,
    /// Every object is reconciled again this often, even without a change notification.
    pub resync_interval: Duration,
    /// First retry delay.
    pub backoff_base: Duration,
    /// Longest retry delay.
    pub backoff_max: Duration,
    /// How often a drain looks at its node's pods again (and evicts those still there).
    pub drain_poll_interval: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            workers: crate::defaults::WORKERS,
            call_timeout: crate::defaults::CALL_TIMEOUT,
            reconcile_timeout: crate::defaults::RECONCILE_TIMEOUT,
            debounce: crate::defaults::DEBOUNCE,
            driver_qps: crate::defaults::DRIVER_QPS,
            driver_burst: crate::defaults::DRIVER_BURST,
            health_check_interval: crate::defaults::HEALTH_CHECK_INTERVAL,
            orphan_interval: crate::defaults::ORPHAN_INTERVAL,
            orphan_grace: crate::defaults::ORPHAN_GRACE,
            controller_id: crate::defaults::CONTROLLER_ID.into(),
            resync_interval: crate::defaults::RESYNC_INTERVAL,
            backoff_base: crate::defaults::BACKOFF_BASE,
            backoff_max: crate::defaults::BACKOFF_MAX,
            drain_poll_interval: crate::defaults::DRAIN_POLL_INTERVAL,
        }
    }
}

/// A token bucket: `rate` per second, up to `burst` at once.
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    state: Mutex<(f64, Instant)>,
}

impl TokenBucket {
    /// A full bucket.
    pub fn new(rate: f64, burst: u32) -> Self {
        let burst = f64::from(burst.max(1));
        Self { rate: rate.max(0.001), burst, state: Mutex::new((burst, Instant::now())) }
    }

    /// Takes a token, waiting for one if needed.
    pub async fn acquire(&self) {
        loop {
            let wait = {
                let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
                let now = Instant::now();
                s.0 = (s.0 + now.duration_since(s.1).as_secs_f64() * self.rate).min(self.burst);
                s.1 = now;
                if s.0 >= 1.0 {
                    s.0 -= 1.0;
                    return;
                }
                Duration::from_secs_f64((1.0 - s.0) / self.rate)
            };
            // Deliberate: the rate limit's wait for the next token.
            tokio::time::sleep(wait).await;
        }
    }
}

/// One driver sidecar.
pub struct DriverHandle {
    /// The name classes use.
    pub name: String,
    /// The client (short per-call deadline).
    pub client: DriverClient,
    limiter: TokenBucket,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    driver: String,
    method: String,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    phase: String,
}

/// Controller metrics.
#[derive(Clone)]
pub struct Metrics {
    calls: Family<CallLabels, Counter>,
    call_seconds: Family<CallLabels, Histogram>,
    reconciles: Family<KindLabels, Counter>,
    reconcile_errors: Family<KindLabels, Counter>,
    reconcile_seconds: Family<KindLabels, Histogram>,
    /// Machines by phase.
    phases: Family<PhaseLabels, Gauge>,
    /// Operations stored in status, not done yet.
    pub operations_in_flight: Gauge,
    /// Orphans deleted.
    pub orphans_deleted: Counter,
    /// Keys waiting in the work queue.
    pub queue_depth: Gauge,
    /// Requests to the target cluster (`crate::nodes::calls`).
    pub target_calls: crate::nodes::calls::CallMetrics,
}

impl Metrics {
    /// Registers the metrics.
    pub fn register(r: &mut Registry) -> Self {
        let hist = || Histogram::new(exponential_buckets(0.0005, 2.5, 14));
        let m = Self {
            calls: Family::default(),
            call_seconds: Family::new_with_constructor(hist),
            reconciles: Family::default(),
            reconcile_errors: Family::default(),
            reconcile_seconds: Family::new_with_constructor(hist),
            phases: Family::default(),
            operations_in_flight: Gauge::default(),
            orphans_deleted: Counter::default(),
            queue_depth: Gauge::default(),
            target_calls: crate::nodes::calls::CallMetrics::default(),
        };
        r.register("controller_driver_calls", "Driver calls by driver, method and gRPC code", m.calls.clone());
        r.register("controller_driver_call_duration_seconds", "Driver call latency", m.call_seconds.clone());
        r.register("controller_reconciles", "Reconciles by kind", m.reconciles.clone());
        r.register("controller_reconcile_errors", "Reconciles that failed, by kind", m.reconcile_errors.clone());
        r.register("controller_reconcile_duration_seconds", "Reconcile duration by kind", m.reconcile_seconds.clone());
        r.register("controller_machines", "Machines by phase", m.phases.clone());
        r.register(
            "controller_operations_in_flight",
            "Operations kept in status, not done",
            m.operations_in_flight.clone(),
        );
        r.register("controller_orphans_deleted", "Cloud machines deleted as orphans", m.orphans_deleted.clone());
        r.register("controller_work_queue_depth", "Keys waiting in the work queue", m.queue_depth.clone());
        m.target_calls.register(r);
        m
    }
}

/// Everything a reconciler needs.
pub struct Ctx {
    /// Where objects live: reconcilers read and write them only through it.
    pub store: Store,
    /// Drivers by name.
    pub drivers: HashMap<String, DriverHandle>,
    /// Settings.
    pub config: Config,
    /// The work queue.
    pub queue: Arc<queue::WorkQueue>,
    /// The controller's own metrics (served at `/metrics` with `run --metrics-addr`).
    pub metrics: Metrics,
    /// The cluster where the machines' Nodes live; `None`: nodes are not managed.
    pub target: Option<Arc<crate::nodes::Target>>,
    /// Cloud machines without a Machine, and when they were first seen.
    pub orphans: Mutex<HashMap<(String, String), Instant>>,
    /// Whether the API servers it depends on answer, and when health timers start.
    pub safety: Arc<crate::safety::Safety>,
    /// What is kept per object; an entry goes when it holds nothing.
    keys: Mutex<HashMap<Key, KeyState>>,
}

/// What the runtime keeps for one object, in one place: forgetting the key forgets all of it.
#[derive(Debug, Default, Clone, PartialEq)]
struct KeyState {
    /// Failed attempts in a row.
    attempts: u32,
    /// No driver call for the object before this.
    not_before: Option<Instant>,
    /// How long its last reconcile took, when longer than the debounce (owners of thousands of
    /// machines): see [`Ctx::owner_wake_delay`].
    costly: Option<Duration>,
    /// The generation at which the objects that depend on it were last woken: its own status
    /// writes must not wake them (that would undo their backoff in a loop).
    dependents_woken_at: Option<i64>,
}

impl KeyState {
    fn is_empty(&self) -> bool {
        *self == KeyState::default()
    }
}

/// Below this many slots a table keeps the room it grew to.
const ROOM_KEPT: usize = 1024;

/// A hash table keeps the room it grew to: after a burst (10,000 machines created at once) that
/// is room for all of them, long after most entries went. [`GiveBackRoom::give_back_room`]
/// returns it once three quarters stand empty; called after a removal, its cost is amortised.
trait GiveBackRoom {
    fn give_back_room(&mut self);
}

impl<K: Eq + std::hash::Hash, V> GiveBackRoom for HashMap<K, V> {
    fn give_back_room(&mut self) {
        if self.capacity() > ROOM_KEPT && self.len() < self.capacity() / 4 {
            self.shrink_to(self.len() * 2);
        }
    }
}

impl<K: Eq + std::hash::Hash> GiveBackRoom for std::collections::HashSet<K> {
    fn give_back_room(&mut self) {
        if self.capacity() > ROOM_KEPT && self.len() < self.capacity() / 4 {
            self.shrink_to(self.len() * 2);
        }
    }
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

impl Ctx {
    /// A context; `drivers` maps names to endpoints.
    ///
    /// # Errors
    /// A malformed endpoint.
    pub fn new(
        store: Store,
        drivers: &[(String, String)],
        config: Config,
        registry: &mut Registry,
        target: Option<crate::nodes::Target>,
    ) -> Result<Arc<Self>, driver_sdk::endpoint::EndpointError> {
        let mut map = HashMap::new();
        for (name, endpoint) in drivers {
            let client = DriverClient::connect_lazy(endpoint)?.with_call_timeout(config.call_timeout);
            map.insert(
                name.clone(),
                DriverHandle {
                    name: name.clone(),
                    client,
                    limiter: TokenBucket::new(config.driver_qps, config.driver_burst),
                },
            );
        }
        let metrics = Metrics::register(registry);
        if let Some(target) = &target {
            target.report_to(metrics.target_calls.clone());
        }
        Ok(Arc::new(Self {
            store,
            drivers: map,
            queue: Arc::new(queue::WorkQueue::default()),
            metrics,
            target: target.map(Arc::new),
            config,
            orphans: Mutex::new(HashMap::new()),
            safety: Arc::default(),
            keys: Mutex::new(HashMap::new()),
        }))
    }

    /// How long after a change of one of its objects an owner runs: the debounce, or twice as
    /// long as its last reconcile took if that is longer. A deployment of 100,000 machines
    /// plans for about 1 s, of 10,000 for about 0.1 s; woken by every machine change, it would
    /// plan back to back and take a core for itself. The delay counts from the first change,
    /// which comes while the plan still runs, so the next plan starts about two plans after the
    /// last one started: re-planning gets at most half a worker's time, and its status trails
    /// its machines by about two reconciles (at most [`OWNER_WAKE_MAX`]: a reconcile that
    /// waited on a slow driver call says little about the next). With a delay of one plan, as
    /// before, the change came due while the plan ran and the next one followed at once.
    pub fn owner_wake_delay(&self, owner: &Key) -> Duration {
        let took = self.read_key(owner, |s| s.costly).unwrap_or_default();
        (took * OWNER_WAKE_FACTOR).clamp(self.config.debounce, OWNER_WAKE_MAX.max(self.config.debounce))
    }

    fn reconciled_in(&self, key: &Key, took: Duration) {
        let costly = (took * OWNER_WAKE_FACTOR > self.config.debounce).then_some(took);
        if costly.is_some() || self.read_key(key, |s| s.costly).is_some() {
            self.with_key(key, |s| s.costly = costly);
        }
    }

    /// Reads what is kept for `key` (the default when nothing is).
    fn read_key<R>(&self, key: &Key, f: impl FnOnce(&KeyState) -> R) -> R {
        let keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        match keys.get(key) {
            Some(s) => f(s),
            None => f(&KeyState::default()),
        }
    }

    /// Changes what is kept for `key`; an entry left empty goes.
    fn with_key<R>(&self, key: &Key, f: impl FnOnce(&mut KeyState) -> R) -> R {
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        let state = keys.entry(key.clone()).or_default();
        let out = f(state);
        if state.is_empty() {
            keys.remove(key);
            keys.give_back_room();
        }
        out
    }

    /// Whether the objects that depend on `key` are to be woken for its `generation`: `true`
    /// the first time a generation is seen (a new spec), `false` for the same one again (the
    /// object's own status writes).
    pub fn dependents_due(&self, key: &Key, generation: i64) -> bool {
        self.with_key(key, |s| s.dependents_woken_at.replace(generation) != Some(generation))
    }

    /// Calls a driver: waits for the rate limit, records metrics, logs the request ID.
    pub async fn call<T, F, Fut>(&self, driver: &DriverHandle, method: &'static str, f: F) -> CallResult<T>
    where
        F: FnOnce(DriverClient) -> Fut,
        Fut: std::future::Future<Output = CallResult<T>>,
    {
        driver.limiter.acquire().await;
        let started = Instant::now();
        let result = f(driver.client.clone()).await;
        let (code, request_id) = match &result {
            Ok(r) => ("OK".to_string(), r.request_id.clone()),
            Err(e) => (format!("{:?}", e.code()), e.request_id().to_string()),
        };
        let labels = CallLabels { driver: driver.name.clone(), method: method.into(), code: code.clone() };
        self.metrics.calls.get_or_create(&labels).inc();
        self.metrics.call_seconds.get_or_create(&labels).observe(started.elapsed().as_secs_f64());
        match &result {
            Ok(_) => tracing::debug!("request.id" = %request_id, "driver call {method} ok"),
            Err(e) => tracing::info!("request.id" = %request_id, "driver call {method} failed: {}", e.report),
        }
        result
    }

    /// The error policy (kube-runtime's `error_policy`): the delay before `key` runs again after
    /// `e`, with the attempt counted. Driver errors are decided by [`policy::decide`] and
    /// also hold the key's driver calls back until then ([`Ctx::wait_before_call`]).
    pub fn error_policy(&self, key: &Key, e: &ReconcileError) -> Duration {
        match e {
            // Someone wrote since the read: run again at once with a fresh read; not a failure.
            e if e.is_conflict() => Duration::ZERO,
            ReconcileError::Store(_) | ReconcileError::Target(_) => self.exponential(key),
            ReconcileError::Driver { report, origin, .. } => {
                let delay = self.delay(key, policy::decide(report, *origin));
                self.hold(key, delay);
                delay
            }
        }
    }

    /// [`policy::decide_bounded`] with the failures `key` has had in a row: what a reconciler
    /// asks to know which status to write.
    pub fn decide(&self, key: &Key, report: &ErrorReport, source: Source) -> Decision {
        let failures = self.read_key(key, |s| s.attempts);
        policy::decide_bounded(report, source, failures)
    }

    /// The delay a decision asks for (and counts the attempt).
    fn delay(&self, key: &Key, decision: Decision) -> Duration {
        match decision {
            Decision::RetryAfter { delay, .. } => {
                self.bump(key);
                delay + jitter(delay / 10)
            }
            Decision::Backoff(cause) => self.exponential(key).max(cause.min_backoff().min(self.config.backoff_max)),
            // Only calls that must go on reach the runtime with a permanent error (a delete must
            // not leak a machine): slowly.
            Decision::Permanent(_) => {
                self.bump(key);
                self.config.backoff_max.min(policy::PERMANENT_RETRY)
            }
            Decision::Absent | Decision::DropToken | Decision::Done => self.exponential(key),
        }
    }

    fn bump(&self, key: &Key) -> u32 {
        self.with_key(key, |s| {
            s.attempts = s.attempts.saturating_add(1);
            s.attempts
        })
    }

    /// Exponential backoff with jitter for the next attempt on `key`.
    fn exponential(&self, key: &Key) -> Duration {
        let n = self.bump(key).min(20);
        let base = self.config.backoff_base.as_secs_f64() * 2f64.powi(n as i32 - 1);
        let d = Duration::from_secs_f64(base.min(self.config.backoff_max.as_secs_f64()));
        // Jitter: 50–100 % of the delay.
        d / 2 + jitter(d / 2)
    }

    /// Forgets the retry count of `key` after a success, and a hold on its driver calls that has
    /// run out: a Machine that polled its create keeps nothing here once it runs (with 10,000
    /// Running Machines the stale holds were 2.2 MB of the controller's heap).
    fn succeeded(&self, key: &Key) {
        let now = Instant::now();
        let stale = |s: &KeyState| s.attempts > 0 || s.not_before.is_some_and(|at| at <= now);
        if self.read_key(key, stale) {
            self.with_key(key, |s| {
                s.attempts = 0;
                s.not_before = s.not_before.filter(|at| *at > now);
            });
        }
    }

    /// How long until `key` may call its driver again (zero = now).
    pub fn wait_before_call(&self, key: &Key) -> Duration {
        self.read_key(key, |s| s.not_before).map(|at| at.saturating_duration_since(Instant::now())).unwrap_or_default()
    }

    /// `key` must not call its driver before `delay` passes.
    fn hold(&self, key: &Key, delay: Duration) {
        self.with_key(key, |s| s.not_before = Some(Instant::now() + delay));
    }

    /// Forgets everything kept for `key` (it was deleted; an object re-created under its name
    /// starts afresh).
    pub fn forget(&self, key: &Key) {
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        keys.remove(key);
        keys.give_back_room();
    }

    /// Forgets `key`'s backoff (its attempts and driver-call hold), keeping the rest: an object
    /// woken because what it depends on changed retries at once.
    pub fn forget_backoff(&self, key: &Key) {
        if self.read_key(key, |s| s.attempts > 0 || s.not_before.is_some()) {
            self.with_key(key, |s| {
                s.attempts = 0;
                s.not_before = None;
            });
        }
    }
}

fn jitter(max: Duration) -> Duration {
    if max.is_zero() {
        return max;
    }
    max.mul_f64(rand::random::<f64>())
}

/// What the runtime runs: the reconcilers of some kinds, and which objects a stored change
/// wakes. The runtime owns the queue, the workers, backoff, holds and metrics, and names no
/// reconciler (kube-runtime's `Controller::run(reconcile, error_policy, context)` is the
/// model; the error policy is [`Ctx::error_policy`]).
#[async_trait::async_trait]
pub trait Reconciler: Send + Sync + 'static {
    /// The kinds reconciled: every object of them is queued at start and at every resync, and
    /// woken by its own changes (except status-only ones, which its own reconcile wrote).
    fn kinds(&self) -> &[Kind];

    /// Reconciles one object of one of [`Reconciler::kinds`].
    ///
    /// # Errors
    /// What [`Ctx::error_policy`] turns into the delay before the next try.
    async fn reconcile(&self, ctx: &Ctx, key: &Key) -> Result<Action, ReconcileError>;

    /// The other objects a stored change wakes (its owner, the objects that use it).
    async fn woken_by(&self, ctx: &Ctx, change: &Change) -> Vec<Wake>;

    /// Tasks that run beside the workers until the runtime stops: watches of other sources
    /// (the target cluster's Nodes), periodic sweeps (orphan collection).
    fn background(&self, ctx: &Arc<Ctx>) -> Vec<futures::future::BoxFuture<'static, ()>>;
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

/// Runs the workers, the change watcher and `reconciler`'s background tasks until `shutdown`
/// resolves.
pub async fn run<R: Reconciler>(ctx: Arc<Ctx>, reconciler: Arc<R>, shutdown: impl std::future::Future<Output = ()>) {
    // Everything is reconciled once at start: in-flight operations resume from status.
    for kind in reconciler.kinds() {
        for key in keys_of(&ctx.store, *kind).await {
            ctx.queue.add(key);
        }
    }
    let mut tasks = vec![tokio::spawn(watch(ctx.clone(), reconciler.clone()))];
    tasks.extend(reconciler.background(&ctx).into_iter().map(tokio::spawn));
    tasks.push(tokio::spawn(gauges(ctx.clone())));
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
            tracing::warn!("listing {kind}: {}", driver_sdk::error_chain(&e));
            Vec::new()
        }
    }
}

async fn watch<R: Reconciler>(ctx: Arc<Ctx>, reconciler: Arc<R>) {
    let mut rx = ctx.store.subscribe();
    loop {
        match rx.recv().await {
            Ok(change) => {
                // A status-only change was written by the object's own reconciler, which
                // already said when it runs next (controller-runtime's GenerationChanged
                // predicate, made exact: label, annotation and finalizer changes still wake).
                if reconciler.kinds().contains(&change.key.kind) && !change.status_only {
                    ctx.queue.add_after(change.key.clone(), ctx.config.debounce);
                }
                if change.deleted {
                    ctx.forget(&change.key);
                }
                for wake in reconciler.woken_by(&ctx, &change).await {
                    if wake.retry_now {
                        ctx.forget_backoff(&wake.key);
                    }
                    ctx.queue.add_after(wake.key, wake.after);
                }
            }
            Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                tracing::warn!("missed {n} change notifications; resyncing everything");
                for kind in reconciler.kinds() {
                    for key in keys_of(&ctx.store, *kind).await {
                        ctx.queue.add(key);
                    }
                }
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
        }
    }
}

async fn worker<R: Reconciler>(ctx: Arc<Ctx>, reconciler: Arc<R>, id: usize) {
    while let Some(key) = ctx.queue.next().await {
        let span = tracing::info_span!("reconcile", worker = id, kind = %key.kind, "object.name" = %key.name);
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
                    Next::Requeue(d) | Next::Wait(d) => ctx.queue.add_after(key.clone(), d),
                    Next::Poll(d) => {
                        ctx.hold(&key, d);
                        ctx.queue.add_after(key.clone(), d);
                    }
                    Next::AwaitChange => {}
                }
            }
            Ok(Err(e)) => {
                ctx.metrics.reconcile_errors.get_or_create(&labels).inc();
                let delay = ctx.error_policy(&key, &e);
                span.in_scope(|| match &e {
                    e if e.is_conflict() => tracing::debug!("{}; reading again", driver_sdk::error_chain(e)),
                    ReconcileError::Driver { .. } => {
                        tracing::info!("{}; retrying in {delay:?}", driver_sdk::error_chain(&e))
                    }
                    _ => tracing::warn!("reconcile failed, retrying in {delay:?}: {}", driver_sdk::error_chain(&e)),
                });
                ctx.queue.add_after(key.clone(), delay);
            }
            Err(_) => {
                ctx.metrics.reconcile_errors.get_or_create(&labels).inc();
                span.in_scope(|| {
                    tracing::warn!("reconcile took longer than {:?}; retrying", ctx.config.reconcile_timeout)
                });
                ctx.queue.add_after(key.clone(), TIMED_OUT_RETRY);
            }
        }
        ctx.queue.done(&key);
    }
}

/// Reconciles everything again every `resync_interval`: a missed notification (or a store
/// written by a process whose change went unseen) delays a reconcile, never loses it.
async fn resync<R: Reconciler>(ctx: Arc<Ctx>, reconciler: Arc<R>) {
    let mut tick = tokio::time::interval(ctx.config.resync_interval.max(MIN_RESYNC_INTERVAL));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        for kind in reconciler.kinds() {
            for key in keys_of(&ctx.store, *kind).await {
                ctx.queue.add_after(key, ctx.config.debounce);
            }
        }
    }
}

/// Keeps the phase and in-flight gauges current.
async fn gauges(ctx: Arc<Ctx>) {
    let mut wait = Duration::ZERO;
    loop {
        // Deliberate: the pause between recounts, paced by what the last one cost.
        tokio::time::sleep(wait).await;
        let started = Instant::now();
        // Only the phase and the operation count are read, not whole objects: with 10,000
        // Machines this runs without allocating them all.
        #[derive(serde::Deserialize)]
        struct Slim {
            #[serde(default)]
            status: SlimStatus,
        }
        #[derive(serde::Deserialize, Default)]
        struct SlimStatus {
            #[serde(default)]
            phase: crate::resources::Phase,
            #[serde(default)]
            operations: Vec<serde::de::IgnoredAny>,
        }
        let mut counts: HashMap<String, i64> = HashMap::new();
        let mut in_flight = 0;
        let counted = ctx
            .store
            .backend()
            .scan(Kind::Machine, &mut |json| {
                if let Ok(m) = serde_json::from_str::<Slim>(json) {
                    *counts.entry(m.status.phase.to_string()).or_default() += 1;
                    in_flight += m.status.operations.len() as i64;
                }
                Ok(())
            })
            .await;
        wait = (started.elapsed() * GAUGE_COST_FACTOR).clamp(GAUGE_INTERVAL, GAUGE_INTERVAL_MAX);
        if counted.is_err() {
            continue;
        }
        for phase in ["Pending", "Creating", "Provisioned", "Running", "Updating", "Terminating", "Failed", "Unknown"] {
            ctx.metrics
                .phases
                .get_or_create(&PhaseLabels { phase: phase.into() })
                .set(counts.get(phase).copied().unwrap_or(0));
        }
        ctx.metrics.operations_in_flight.set(in_flight);
        ctx.metrics.queue_depth.set(ctx.queue.depth() as i64);
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> (Arc<Ctx>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("s.db")).unwrap();
        let ctx = Ctx::new(store, &[], Config::default(), &mut Registry::default(), None).unwrap();
        (ctx, dir)
    }

    #[tokio::test]
    async fn the_state_kept_per_key_gives_its_room_back_after_a_burst() {
        let (ctx, _dir) = ctx();
        let keys: Vec<Key> = (0..10_000).map(|i| Key::new(Kind::Machine, "default", &format!("m-{i}"))).collect();
        for k in &keys {
            ctx.hold(k, Duration::from_secs(60));
        }
        let room = |ctx: &Ctx| ctx.keys.lock().unwrap().capacity();
        assert!(room(&ctx) >= 10_000);
        for k in &keys[100..] {
            ctx.forget_backoff(k);
        }
        let left = ctx.keys.lock().unwrap().len();
        assert_eq!(left, 100, "only the held keys are kept");
        assert!(room(&ctx) <= 4 * ROOM_KEPT, "room for {} entries kept for {left}", room(&ctx));
        assert!(!ctx.wait_before_call(&keys[0]).is_zero(), "what is kept survives the shrinking");
    }

    #[tokio::test]
    async fn an_owner_that_plans_slowly_is_woken_at_most_once_per_plan() {
        let (ctx, _dir) = ctx();
        let md = Key::new(Kind::MachineDeployment, "default", "big");
        let debounce = ctx.config.debounce;
        assert_eq!(ctx.owner_wake_delay(&md), debounce, "never reconciled");
        ctx.reconciled_in(&md, Duration::from_millis(1800));
        assert_eq!(ctx.owner_wake_delay(&md), Duration::from_millis(3600), "twice the plan");
        ctx.reconciled_in(&md, Duration::from_secs(29));
        assert_eq!(ctx.owner_wake_delay(&md), OWNER_WAKE_MAX, "a reconcile stuck on a call is capped");
        ctx.reconciled_in(&md, debounce * 3 / 4);
        assert_eq!(ctx.owner_wake_delay(&md), debounce * 3 / 2, "twice a plan a little under the debounce");
        ctx.reconciled_in(&md, debounce / 4);
        assert_eq!(ctx.owner_wake_delay(&md), debounce, "fast again");
        ctx.reconciled_in(&md, Duration::from_secs(1));
        ctx.forget(&md);
        assert_eq!(ctx.owner_wake_delay(&md), debounce, "forgotten when deleted");
    }

    #[tokio::test]
    async fn the_error_policy_honours_retry_info_floors_quota_and_holds_driver_calls() {
        let (ctx, _dir) = ctx();
        let key = Key::new(Kind::Machine, "default", "m");
        let call = |code, retry: Option<Duration>| {
            let mut report = ErrorReport::from_status(&tonic::Status::new(code, "refused"));
            report.retry_after = retry;
            ReconcileError::Driver {
                method: "CreateMachine",
                origin: Source::Call(policy::Rpc::Mutate),
                report: Box::new(report),
            }
        };
        let d = ctx.error_policy(&key, &call(tonic::Code::Unavailable, Some(Duration::from_secs(3))));
        assert!(d >= Duration::from_secs(3) && d <= Duration::from_millis(3300), "{d:?}");
        assert!(ctx.wait_before_call(&key) > Duration::from_secs(2), "driver calls wait it out");
        let d = ctx.error_policy(&key, &call(tonic::Code::ResourceExhausted, None));
        assert!(d >= Duration::from_secs(10), "quota waits at least 10 s: {d:?}");
        let d = ctx.error_policy(&key, &call(tonic::Code::InvalidArgument, None));
        assert_eq!(d, Duration::from_secs(60), "permanent errors that reach the runtime go slowly");
        let conflict = ReconcileError::Store(crate::store::Error::Conflict {
            key: key.clone(),
            expected: "1".into(),
            actual: "2".into(),
        });
        assert_eq!(ctx.error_policy(&key, &conflict), Duration::ZERO, "a conflict reads again at once");
        let store = ReconcileError::Store(crate::store::Error::NotFound(key.clone()));
        ctx.forget(&key);
        let d = ctx.error_policy(&key, &store);
        assert!(d <= Duration::from_secs(1), "{d:?}");
        assert!(ctx.wait_before_call(&key).is_zero(), "store errors hold nothing");
    }

    #[tokio::test]
    async fn forgetting_a_deleted_object_forgets_everything_so_a_re_created_one_starts_afresh() {
        let (ctx, _dir) = ctx();
        let class = Key::new(Kind::MachineClass, "default", "small");
        assert!(ctx.dependents_due(&class, 1), "a new class wakes what uses it");
        assert!(!ctx.dependents_due(&class, 1), "its own status writes do not");
        assert!(ctx.dependents_due(&class, 2), "a new spec does");
        ctx.exponential(&class);
        ctx.hold(&class, Duration::from_secs(60));
        ctx.forget(&class);
        // Deleted and created again at generation 1: its users are woken again.
        assert!(ctx.dependents_due(&class, 1));
        assert!(ctx.wait_before_call(&class).is_zero());
        assert_eq!(ctx.read_key(&class, |s| s.attempts), 0);
        // Forgetting only the backoff keeps the rest.
        ctx.exponential(&class);
        ctx.hold(&class, Duration::from_secs(60));
        ctx.forget_backoff(&class);
        assert!(ctx.wait_before_call(&class).is_zero());
        assert!(!ctx.dependents_due(&class, 1), "still known at generation 1");
        ctx.forget(&class);
        assert!(ctx.keys.lock().unwrap().is_empty(), "nothing is kept for a forgotten key");
    }

    #[tokio::test]
    async fn a_success_drops_a_hold_that_ran_out_and_keeps_one_that_did_not() {
        let (ctx, _dir) = ctx();
        let (done, polling) =
            (Key::new(Kind::Machine, "default", "done"), Key::new(Kind::Machine, "default", "polling"));
        ctx.hold(&done, Duration::ZERO);
        ctx.hold(&polling, Duration::from_secs(60));
        ctx.succeeded(&done);
        ctx.succeeded(&polling);
        assert!(!ctx.wait_before_call(&polling).is_zero(), "a hold still running stays");
        let keys = ctx.keys.lock().unwrap();
        assert!(!keys.contains_key(&done), "nothing is kept for a key whose hold ran out");
        assert!(keys.contains_key(&polling));
    }

    #[test]
    fn internal_errors_become_final_after_the_bound() {
        let (ctx, _dir) = ctx();
        let key = Key::new(Kind::Machine, "default", "m");
        let report = ErrorReport::from_status(&tonic::Status::new(tonic::Code::Internal, "boom"));
        let source = Source::Call(policy::Rpc::Mutate);
        assert_eq!(ctx.decide(&key, &report, source), Decision::Backoff(policy::Cause::Internal));
        for _ in 0..policy::INTERNAL_RETRIES - 1 {
            ctx.exponential(&key);
        }
        assert_eq!(ctx.decide(&key, &report, source), Decision::Permanent(policy::Permanent::RetriesExhausted));
        ctx.succeeded(&key);
        assert_eq!(ctx.decide(&key, &report, source), Decision::Backoff(policy::Cause::Internal));
    }
}
