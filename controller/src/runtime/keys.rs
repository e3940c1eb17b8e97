//! What the runtime keeps per key (`KeyState`, in one place: forgetting the key forgets all
//! of it) and the error policy built on it: backoff with jitter, holds on driver calls, the
//! owner wake-up delay.

use machine_driver_util::lock;
use std::collections::HashMap;
use std::time::Duration;

use driver_sdk::ErrorReport;
use tokio::time::Instant;

use super::{Ctx, ReconcileError};
use crate::policy::{self, Decision, Source};
use crate::store::Key;

/// The longest an owner's wake-up by its objects' changes is put off ([`Ctx::owner_wake_delay`]).
pub const OWNER_WAKE_MAX: Duration = Duration::from_secs(5);
/// An owner's wake-up is put off this many times as long as its last reconcile took.
const OWNER_WAKE_FACTOR: u32 = 2;

/// What the runtime keeps for one object, in one place: forgetting the key forgets all of it.
#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct KeyState {
    /// Failed attempts in a row.
    attempts: u32,
    /// No driver call for the object before this.
    not_before: Option<Instant>,
    /// How long its last reconcile took, when longer than the debounce (owners of thousands of
    /// machines): see [`Ctx::owner_wake_delay`].
    costly: Option<Duration>,
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
pub(crate) trait GiveBackRoom {
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

impl<A> Ctx<A> {
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

    pub(super) fn reconciled_in(&self, key: &Key, took: Duration) {
        let costly = (took * OWNER_WAKE_FACTOR > self.config.debounce).then_some(took);
        if costly.is_some() || self.read_key(key, |s| s.costly).is_some() {
            self.with_key(key, |s| s.costly = costly);
        }
    }

    /// Reads what is kept for `key` (the default when nothing is).
    fn read_key<R>(&self, key: &Key, f: impl FnOnce(&KeyState) -> R) -> R {
        let keys = lock(&self.keys);
        match keys.get(key) {
            Some(s) => f(s),
            None => f(&KeyState::default()),
        }
    }

    /// Changes what is kept for `key`; an entry left empty goes.
    fn with_key<R>(&self, key: &Key, f: impl FnOnce(&mut KeyState) -> R) -> R {
        let mut keys = lock(&self.keys);
        let state = keys.entry(key.clone()).or_default();
        let out = f(state);
        if state.is_empty() {
            keys.remove(key);
            keys.give_back_room();
        }
        out
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
    pub(super) fn succeeded(&self, key: &Key) {
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
    pub(super) fn hold(&self, key: &Key, delay: Duration) {
        self.with_key(key, |s| s.not_before = Some(Instant::now() + delay));
    }

    /// Forgets everything kept for `key` (it was deleted; an object re-created under its name
    /// starts afresh).
    pub fn forget(&self, key: &Key) {
        let mut keys = lock(&self.keys);
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use prometheus_client::registry::Registry;

    use super::*;
    use crate::resources::Kind;
    use crate::runtime::Config;
    use crate::store::Store;

    fn ctx() -> (Arc<Ctx<()>>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("s.db")).unwrap();
        let ctx = Ctx::new(store, Config::default(), &mut Registry::default(), ());
        (ctx, dir)
    }

    #[tokio::test]
    async fn the_state_kept_per_key_gives_its_room_back_after_a_burst() {
        let (ctx, _dir) = ctx();
        let keys: Vec<Key> = (0..10_000).map(|i| Key::new(Kind::Machine, "default", &format!("m-{i}"))).collect();
        for k in &keys {
            ctx.hold(k, Duration::from_secs(60));
        }
        let room = |ctx: &Ctx<()>| ctx.keys.lock().unwrap().capacity();
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
        let md = Key::new(Kind::MachineDeployment, "default", "big");
        ctx.reconciled_in(&md, Duration::from_secs(2));
        ctx.exponential(&md);
        ctx.hold(&md, Duration::from_secs(60));
        ctx.forget(&md);
        // Deleted and created again: nothing of the old one is left.
        assert_eq!(ctx.owner_wake_delay(&md), ctx.config.debounce);
        assert!(ctx.wait_before_call(&md).is_zero());
        assert_eq!(ctx.read_key(&md, |s| s.attempts), 0);
        // Forgetting only the backoff keeps the rest.
        ctx.reconciled_in(&md, Duration::from_secs(3));
        ctx.exponential(&md);
        ctx.hold(&md, Duration::from_secs(60));
        ctx.forget_backoff(&md);
        assert!(ctx.wait_before_call(&md).is_zero());
        assert_eq!(ctx.read_key(&md, |s| s.attempts), 0);
        assert_eq!(ctx.owner_wake_delay(&md), OWNER_WAKE_MAX, "its pacing is kept");
        ctx.forget(&md);
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
