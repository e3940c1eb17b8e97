//! Repeated events aggregated into event series, the way client-go's events broadcaster does
//! (`k8s.io/client-go/tools/events`): the bookkeeping both backends share, so `describe` reads
//! the same on either.
//!
//! The first event about an object with a given reason is stored as it is. A repeat within
//! [`SERIES_WINDOW`] of the last one makes it a series: the first repeat is written at once (so
//! a reader sees that it repeats), later ones only count in memory and reach storage when the
//! backend next calls [`Book::refresh`]. The stored event keeps its first message; the series
//! adds its count and the time of its last occurrence. A rollout of 10,000 machines tells of
//! them on its deployment in one event, "… is running (x10000)", not in 10,000.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::Event;
use crate::resources::Time;

/// A repeat later than this after the last one starts a new event (client-go: 6 minutes).
pub(crate) const SERIES_WINDOW: Duration = Duration::from_secs(6 * 60);

/// What makes two events the same series: the object and the reason (client-go's key, whose
/// action and reporting controller are fixed here).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct SeriesKey {
    kind: &'static str,
    namespace: String,
    name: String,
    reason: String,
}

impl SeriesKey {
    fn of(e: &Event) -> Self {
        Self {
            kind: e.key.kind.as_str(),
            namespace: e.key.namespace.clone(),
            name: e.key.name.clone(),
            reason: e.reason.clone(),
        }
    }
}

/// A series being counted.
#[derive(Debug)]
pub(crate) struct Series<H> {
    /// Where its event is stored: the Event's name on the API server, the row's id in SQLite.
    pub(crate) stored: H,
    /// Events in it, the first included.
    pub(crate) count: i32,
    /// When the last of them happened.
    pub(crate) last_observed: Time,
    last_seen: Instant,
    /// The count grew since it was last written.
    dirty: bool,
}

/// What to do with one event.
#[derive(Debug)]
pub(crate) enum Seen<'a, H> {
    /// It starts a series: store it as an event, then tell [`Book::opened`] where.
    First,
    /// The first repeat: write the series' count now.
    Repeated(&'a Series<H>),
    /// A later repeat: counted, written by the next [`Book::refresh`].
    Counted,
}

/// The open series, by object and reason. Holds no storage, so it is tested without one.
#[derive(Debug)]
pub(crate) struct Book<H> {
    series: HashMap<SeriesKey, Series<H>>,
}

impl<H> Default for Book<H> {
    fn default() -> Self {
        Self { series: HashMap::new() }
    }
}

impl<H> Book<H> {
    /// What `e`, happening at `now`, needs.
    pub(crate) fn see(&mut self, e: &Event, now: Instant) -> Seen<'_, H> {
        let key = SeriesKey::of(e);
        match self.series.get_mut(&key) {
            Some(s) if now.saturating_duration_since(s.last_seen) <= SERIES_WINDOW => {
                s.count += 1;
                s.last_seen = now;
                s.last_observed = e.time;
                if s.count == 2 {
                    s.dirty = false;
                    Seen::Repeated(s)
                } else {
                    s.dirty = true;
                    Seen::Counted
                }
            }
            _ => Seen::First,
        }
    }

    /// `e` started a series, stored at `stored`.
    pub(crate) fn opened(&mut self, e: &Event, stored: H, now: Instant) {
        let series = Series { stored, count: 1, last_observed: e.time, last_seen: now, dirty: false };
        self.series.insert(SeriesKey::of(e), series);
    }

    /// The series `e` belongs to, as it stands, for a backend about to write it (so it no longer
    /// counts as grown since written); `None` when there is none.
    pub(crate) fn writing(&mut self, e: &Event) -> Option<&Series<H>> {
        let s = self.series.get_mut(&SeriesKey::of(e))?;
        s.dirty = false;
        Some(s)
    }

    /// The series whose count grew since it was written, each once (`write` makes the write a
    /// backend needs); then forgets the series that ended (no repeat for [`SERIES_WINDOW`]).
    pub(crate) fn refresh<W>(&mut self, now: Instant, mut write: impl FnMut(&Series<H>) -> W) -> Vec<W> {
        let mut writes = Vec::new();
        for s in self.series.values_mut().filter(|s| s.dirty) {
            s.dirty = false;
            writes.push(write(s));
        }
        self.series.retain(|_, s| now.saturating_duration_since(s.last_seen) <= SERIES_WINDOW);
        writes
    }

    /// Forgets the series stored at `stored` (its event is gone): the next repeat starts anew.
    pub(crate) fn forget(&mut self, stored: &H)
    where
        H: PartialEq,
    {
        self.series.retain(|_, s| s.stored != *stored);
    }

    /// Open series.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.series.len()
    }
}

/// A Warning event about Machine `ns/name`, now, for the tests of both backends' series.
#[cfg(test)]
pub(crate) fn event(name: &str, reason: &str) -> Event {
    Event {
        key: super::Key::new(crate::resources::Kind::Machine, "ns", name),
        event_type: "Warning".into(),
        reason: reason.into(),
        message: format!("{name} {reason}"),
        time: chrono::Utc::now(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeats_are_written_at_the_first_repeat_and_then_once_per_refresh() {
        let mut book = Book::default();
        let t0 = Instant::now();
        let e = event("m", "OperationFailed");
        assert!(matches!(book.see(&e, t0), Seen::First));
        book.opened(&e, 7, t0);
        match book.see(&e, t0 + Duration::from_secs(1)) {
            Seen::Repeated(s) => assert_eq!((s.stored, s.count), (7, 2)),
            other => panic!("the first repeat is written at once: {other:?}"),
        }
        for i in 0..98 {
            assert!(matches!(book.see(&e, t0 + Duration::from_secs(2 + i)), Seen::Counted));
        }
        // A backend writing the series now writes what it stands at, and the refresh does not
        // write it again.
        assert_eq!(book.writing(&e).map(|s| s.count), Some(100));
        assert!(book.refresh(t0 + Duration::from_secs(100), |s| s.count).is_empty());
        book.see(&e, t0 + Duration::from_secs(101));
        let writes = book.refresh(t0 + Duration::from_secs(102), |s| (s.stored, s.count));
        assert_eq!(writes, vec![(7, 101)]);
        assert!(book.refresh(t0 + Duration::from_secs(160), |s| s.count).is_empty(), "nothing new, nothing written");
    }

    #[test]
    fn other_objects_and_reasons_are_other_series_and_a_quiet_series_ends() {
        let mut book = Book::default();
        let t0 = Instant::now();
        for (i, (name, reason)) in [("a", "X"), ("b", "X"), ("a", "Y")].into_iter().enumerate() {
            assert!(matches!(book.see(&event(name, reason), t0), Seen::First));
            book.opened(&event(name, reason), i, t0);
        }
        // After the window a repeat is a new event, and the old series is forgotten.
        let late = t0 + SERIES_WINDOW + Duration::from_secs(1);
        assert!(matches!(book.see(&event("a", "X"), late), Seen::First));
        book.opened(&event("a", "X"), 3, late);
        book.refresh(late, |_| ());
        assert_eq!(book.len(), 1, "only the live series is kept");
        // A series whose event is gone starts again.
        book.forget(&3);
        assert!(matches!(book.see(&event("a", "X"), late), Seen::First));
    }
}
