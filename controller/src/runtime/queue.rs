//! A work queue of object keys: deduplicated, delayed requeues, and never the same key on two
//! workers at once (a key changed while processing runs again afterwards). Each waiting key
//! keeps the [`Trigger`] it runs for: the first that queued it, or for a delayed one, the one
//! due soonest.

use machine_driver_util::lock;
use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::keys::GiveBackRoom;
use crate::store::Key;

/// Why a key runs: what queued it (carried by the reconcile's span).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Trigger {
    /// Queued when the runtime started.
    Start,
    /// Its own stored change (a watch event).
    Change,
    /// Another object's change woke it (its owner's, its class's, a selector's:
    /// [`super::Reconciler::woken_by`]).
    Related,
    /// A reconciler woke it ([`super::Ctx::wake`]).
    Wake,
    /// A watch of another source woke it ([`super::Ctx::waker`]: the target cluster's Nodes).
    Watch,
    /// Its last reconcile asked to run again ([`super::Action::requeue`], [`super::Action::wait`]).
    Requeue,
    /// Its driver sets the pace ([`super::Action::poll_after`]).
    Poll,
    /// Its last reconcile failed or timed out: a retry after the error policy's delay.
    Retry,
    /// The periodic resync (or a resync after missed change notifications).
    Resync,
}

impl Trigger {
    /// The name logs and traces carry.
    pub fn as_str(self) -> &'static str {
        match self {
            Trigger::Start => "start",
            Trigger::Change => "change",
            Trigger::Related => "related",
            Trigger::Wake => "wake",
            Trigger::Watch => "watch",
            Trigger::Requeue => "requeue",
            Trigger::Poll => "poll",
            Trigger::Retry => "retry",
            Trigger::Resync => "resync",
        }
    }
}

impl std::fmt::Display for Trigger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A waiting key is in two collections at once (ready and queued, or delayed and due): they
/// share one copy. With 10,000 Machines waiting on their operations that is about 1 MB less.
type Shared = Arc<Key>;

#[derive(Default)]
struct State {
    ready: VecDeque<(Shared, Trigger)>,
    queued: HashSet<Shared>,
    processing: HashSet<Key>,
    dirty: HashMap<Key, Trigger>,
    delayed: BTreeSet<(Instant, u64, Shared)>,
    due: HashMap<Shared, (Instant, u64, Trigger)>,
    seq: u64,
    closed: bool,
}

impl State {
    /// Queues `key` unless it is queued already; a key being processed is marked to run again
    /// once it is done instead.
    fn add(&mut self, key: Shared, why: Trigger) -> bool {
        if self.processing.contains(&*key) {
            self.dirty.entry(Arc::unwrap_or_clone(key)).or_insert(why);
            false
        } else if self.queued.contains(&*key) {
            false
        } else {
            self.queued.insert(key.clone());
            self.ready.push_back((key, why));
            true
        }
    }

    fn promote_due(&mut self, now: Instant) {
        while let Some((at, _, _)) = self.delayed.first() {
            if *at > now {
                break;
            }
            if let Some((_, _, key)) = self.delayed.pop_first() {
                let why = self.due.remove(&*key).map_or(Trigger::Requeue, |(_, _, why)| why);
                self.due.give_back_room();
                self.add(key, why);
            }
        }
    }
}

/// The queue.
#[derive(Default)]
pub struct WorkQueue {
    state: Mutex<State>,
    notify: Notify,
}

impl WorkQueue {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Queues `key` now, to run for `why`.
    pub fn add(&self, key: Key, why: Trigger) {
        if self.state().add(Arc::new(key), why) {
            self.notify.notify_one();
        }
    }

    /// Queues `key` after `delay`, unless it is already due sooner (so bursts of changes
    /// coalesce into one reconcile: the debounce).
    pub fn add_after(&self, key: Key, delay: Duration, why: Trigger) {
        if delay.is_zero() {
            return self.add(key, why);
        }
        let at = Instant::now() + delay;
        let mut s = self.state();
        if s.queued.contains(&key) {
            return;
        }
        let key = match s.due.get_key_value(&key).map(|(k, due)| (k.clone(), *due)) {
            Some((_, (current, _, _))) if current <= at => return,
            Some((shared, (current, seq, _))) => {
                s.delayed.remove(&(current, seq, shared.clone()));
                shared
            }
            None => Arc::new(key),
        };
        s.seq += 1;
        let seq = s.seq;
        s.delayed.insert((at, seq, key.clone()));
        s.due.insert(key, (at, seq, why));
        drop(s);
        // Wake a waiter so it re-computes its sleep.
        self.notify.notify_one();
    }

    /// The next key to work on, and why it runs; `None` once closed.
    pub async fn next(&self) -> Option<(Key, Trigger)> {
        loop {
            let next_due = {
                let mut s = self.state();
                if s.closed {
                    return None;
                }
                s.promote_due(Instant::now());
                if let Some((key, why)) = s.ready.pop_front() {
                    s.queued.remove(&*key);
                    s.queued.give_back_room();
                    // A pending delayed run is superseded: the reconcile decides the next one.
                    if let Some((at, seq, _)) = s.due.remove(&*key) {
                        s.delayed.remove(&(at, seq, key.clone()));
                        s.due.give_back_room();
                    }
                    let key = Arc::unwrap_or_clone(key);
                    s.processing.insert(key.clone());
                    if !s.ready.is_empty() {
                        self.notify.notify_one();
                    }
                    return Some((key, why));
                }
                s.delayed.first().map(|(at, _, _)| *at)
            };
            match next_due {
                Some(at) => {
                    tokio::select! {
                        () = self.notify.notified() => {}
                        () = tokio::time::sleep_until(at) => {}
                    }
                }
                None => self.notify.notified().await,
            }
        }
    }

    /// Marks `key` finished; it runs again if it changed meanwhile.
    pub fn done(&self, key: &Key) {
        let mut s = self.state();
        s.processing.remove(key);
        let Some(why) = s.dirty.remove(key) else { return };
        s.dirty.give_back_room();
        if s.add(Arc::new(key.clone()), why) {
            drop(s);
            self.notify.notify_one();
        }
    }

    /// Stops handing out keys.
    pub fn close(&self) {
        self.state().closed = true;
        self.notify.notify_waiters();
    }

    /// Keys waiting (ready or delayed).
    pub fn depth(&self) -> usize {
        let s = self.state();
        s.ready.len() + s.delayed.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::Kind;

    fn k(n: &str) -> Key {
        Key::new(Kind::Machine, "default", n)
    }

    #[tokio::test]
    async fn dedups_and_never_hands_out_a_key_twice_at_once() {
        let q = WorkQueue::default();
        q.add(k("a"), Trigger::Change);
        q.add(k("a"), Trigger::Change);
        q.add(k("b"), Trigger::Change);
        assert_eq!(q.next().await.map(|(key, _)| key), Some(k("a")));
        assert_eq!(q.next().await.map(|(key, _)| key), Some(k("b")));
        q.add(k("a"), Trigger::Change); // changed while processing
        assert_eq!(q.depth(), 0);
        q.done(&k("a"));
        assert_eq!(q.next().await.map(|(key, _)| key), Some(k("a")));
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_runs_for_what_queued_it_first_or_for_its_soonest_delay() {
        let q = WorkQueue::default();
        q.add(k("a"), Trigger::Change);
        q.add(k("a"), Trigger::Wake);
        assert_eq!(q.next().await, Some((k("a"), Trigger::Change)));
        q.add(k("a"), Trigger::Related); // while processing
        q.add(k("a"), Trigger::Watch);
        q.done(&k("a"));
        assert_eq!(q.next().await, Some((k("a"), Trigger::Related)), "changed while processing");
        q.done(&k("a"));
        q.add_after(k("b"), Duration::from_secs(5), Trigger::Resync);
        q.add_after(k("b"), Duration::from_secs(1), Trigger::Poll);
        q.add_after(k("b"), Duration::from_secs(3), Trigger::Retry);
        assert_eq!(q.next().await, Some((k("b"), Trigger::Poll)), "the soonest delay's");
    }

    #[tokio::test(start_paused = true)]
    async fn delays_coalesce_to_the_earliest() {
        let q = WorkQueue::default();
        q.add_after(k("a"), Duration::from_secs(5), Trigger::Requeue);
        q.add_after(k("a"), Duration::from_secs(10), Trigger::Requeue);
        q.add_after(k("a"), Duration::from_secs(1), Trigger::Requeue);
        let started = Instant::now();
        assert_eq!(q.next().await.map(|(key, _)| key), Some(k("a")));
        assert_eq!(started.elapsed(), Duration::from_secs(1));
        q.done(&k("a"));
        assert_eq!(q.depth(), 0, "the superseded delays are gone");
    }

    #[tokio::test(start_paused = true)]
    async fn a_delay_that_comes_due_while_its_key_is_processing_runs_it_after() {
        let q = WorkQueue::default();
        q.add(k("a"), Trigger::Change);
        assert_eq!(q.next().await.map(|(key, _)| key), Some(k("a")));
        q.add_after(k("a"), Duration::from_secs(1), Trigger::Requeue);
        q.add_after(k("b"), Duration::from_secs(2), Trigger::Requeue);
        let started = Instant::now();
        assert_eq!(q.next().await.map(|(key, _)| key), Some(k("b")), "a is still processing when its delay is due");
        assert_eq!(started.elapsed(), Duration::from_secs(2));
        q.done(&k("a"));
        assert_eq!(q.next().await.map(|(key, _)| key), Some(k("a")), "and runs once it is done");
        assert_eq!(q.depth(), 0);
    }

    /// Changes arrive at random while three workers process five keys for random times, some
    /// asking to run again after a delay (as a reconcile's requeue does): every key runs after
    /// its last change (no wake-up is lost), and never on two workers at once.
    #[tokio::test(start_paused = true)]
    async fn under_random_changes_no_wake_up_is_lost_and_no_key_runs_twice_at_once() {
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::sync::Mutex as StdMutex;
        const KEYS: usize = 5;
        // A small deterministic generator: the test is the same on every run.
        fn next_rand(state: &mut u64) -> u64 {
            *state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            *state >> 33
        }
        let q = Arc::new(WorkQueue::default());
        let keys: Arc<Vec<Key>> = Arc::new((0..KEYS).map(|i| k(&format!("m-{i}"))).collect());
        let changes: Arc<Vec<AtomicU64>> = Arc::new((0..KEYS).map(|_| AtomicU64::new(0)).collect());
        let seen: Arc<Vec<AtomicU64>> = Arc::new((0..KEYS).map(|_| AtomicU64::new(0)).collect());
        let running: Arc<StdMutex<HashSet<Key>>> = Arc::default();
        // Told after every run, so the end waits on runs, not on a clock.
        let ran = Arc::new(Notify::new());
        let mut workers = Vec::new();
        for w in 0..3_u64 {
            let (q, keys, changes, seen, running, ran) =
                (q.clone(), keys.clone(), changes.clone(), seen.clone(), running.clone(), ran.clone());
            workers.push(tokio::spawn(async move {
                let mut rand = 7 + w;
                while let Some((key, _)) = q.next().await {
                    assert!(running.lock().unwrap().insert(key.clone()), "{key:?} on two workers at once");
                    let i = keys.iter().position(|k| *k == key).unwrap();
                    // What the reconcile reads: every change made before it started.
                    seen[i].store(changes[i].load(Ordering::SeqCst), Ordering::SeqCst);
                    // Deliberate: the run's simulated work, on the paused clock.
                    tokio::time::sleep(Duration::from_millis(next_rand(&mut rand) % 30)).await;
                    if next_rand(&mut rand).is_multiple_of(3) {
                        q.add_after(
                            key.clone(),
                            Duration::from_millis(1 + next_rand(&mut rand) % 100),
                            Trigger::Requeue,
                        );
                    }
                    running.lock().unwrap().remove(&key);
                    q.done(&key);
                    ran.notify_one();
                }
            }));
        }
        let mut rand = 1;
        for _ in 0..5_000 {
            let i = (next_rand(&mut rand) as usize) % KEYS;
            changes[i].fetch_add(1, Ordering::SeqCst);
            match next_rand(&mut rand) % 3 {
                0 => q.add(keys[i].clone(), Trigger::Change),
                _ => {
                    q.add_after(keys[i].clone(), Duration::from_millis(1 + next_rand(&mut rand) % 50), Trigger::Requeue)
                }
            }
            // Deliberate: the spacing of the changes, on the paused clock.
            tokio::time::sleep(Duration::from_millis(next_rand(&mut rand) % 5)).await;
        }
        // Every key is run again after its last change, within the longest delay and run.
        let caught_up = async {
            while (0..KEYS).any(|i| seen[i].load(Ordering::SeqCst) != changes[i].load(Ordering::SeqCst)) {
                ran.notified().await;
            }
        };
        let waited = tokio::time::timeout(Duration::from_secs(5), caught_up).await;
        let behind: Vec<(u64, u64)> =
            (0..KEYS).map(|i| (seen[i].load(Ordering::SeqCst), changes[i].load(Ordering::SeqCst))).collect();
        assert!(waited.is_ok(), "a key did not run after its last change (seen, changes): {behind:?}");
        q.close();
        for w in workers {
            tokio::time::timeout(Duration::from_secs(5), w).await.unwrap().unwrap();
        }
    }

    #[tokio::test]
    async fn close_ends_next() {
        let q = std::sync::Arc::new(WorkQueue::default());
        let q2 = q.clone();
        let waiter = tokio::spawn(async move { q2.next().await });
        tokio::task::yield_now().await;
        q.close();
        assert_eq!(tokio::time::timeout(Duration::from_secs(5), waiter).await.unwrap().unwrap(), None);
    }
}
