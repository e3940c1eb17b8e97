//! Events: the `events` table, repeats of one reason on one object aggregated into series as on
//! the API server (`store/series.rs`): one row per series, its `count` written by the poller
//! while it grows.

use std::sync::Mutex;

use rusqlite::{params, Connection};

use super::writer::Writer;
use super::{lock, Db, SqliteBackend};
use crate::store::series::{Book, Seen};
use crate::store::{Event, Key, Result};

/// Event series by the id of their row.
pub(super) type Series = Mutex<Book<i64>>;

impl SqliteBackend {
    /// Records `e`: a first event is a row; a repeat in a series is counted, and written at once
    /// only when it is the first repeat (the poller writes later counts).
    pub(super) async fn record(&self, e: Event) -> Result<()> {
        let now = std::time::Instant::now();
        // A later repeat in a series is only counted; the poller writes the count.
        let repeated = match lock(&self.series).see(&e, now) {
            Seen::Counted => return Ok(()),
            Seen::Repeated(_) => true,
            Seen::First => false,
        };
        let trim = !repeated && {
            let mut n = lock(&self.events_written);
            *n += 1;
            (*n).is_multiple_of(1000)
        };
        self.batched(|conn, _| {
            // Under the writer's lock, which the poller's writes of counts take too: the count
            // written is the series' count now, never one the poller has already passed.
            let mut book = lock(&self.series);
            let repeat = if repeated {
                book.writing(&e).map(|s| (s.stored, s.count, s.last_observed))
            } else {
                // Decided again: a write of the same series may have started it since.
                match book.see(&e, now) {
                    Seen::Counted => return Ok(((), None)),
                    Seen::Repeated(s) => Some((s.stored, s.count, s.last_observed)),
                    Seen::First => None,
                }
            };
            if let Some((id, count, time)) = repeat {
                if update_series(conn, id, count, time)? == 0 {
                    book.forget(&id);
                }
                return Ok(((), None));
            }
            conn.prepare_cached("INSERT INTO events(kind, namespace, name, type, reason, message, time) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)").db()?
            .execute(params![
                e.key.kind.as_str(),
                e.key.namespace,
                e.key.name,
                e.event_type,
                e.reason,
                e.message,
                e.time.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
            ]).db()?;
            book.opened(&e, conn.last_insert_rowid(), now);
            if trim {
                // Keep the newest 50,000 events.
                conn.prepare_cached("DELETE FROM events WHERE id < (SELECT MAX(id) - 50000 FROM events)").db()?.execute([]).db()?;
            }
            Ok(((), None))
        })
        .await
    }

    /// The newest `limit` events of `key`, oldest first.
    pub(super) fn read_events(&self, key: &Key, limit: usize) -> Result<Vec<Event>> {
        let w = lock(&self.writer);
        let mut stmt = w
            .conn
            .prepare_cached(
                "SELECT type, reason, message, time, count FROM events WHERE kind = ?1 AND namespace = ?2 AND name = ?3
             ORDER BY id DESC LIMIT ?4",
            )
            .db()?;
        let mut out: Vec<Event> = stmt
            .query_map(params![key.kind.as_str(), key.namespace, key.name, limit as i64], |r| {
                let time: String = r.get(3)?;
                let mut message: String = r.get(2)?;
                // A series is one row standing for many, read as the Kubernetes backend reads one.
                let count: i64 = r.get(4)?;
                if count > 1 {
                    message.push_str(&format!(" (x{count})"));
                }
                Ok(Event {
                    key: key.clone(),
                    event_type: r.get(0)?,
                    reason: r.get(1)?,
                    message,
                    time: chrono::DateTime::parse_from_rfc3339(&time)
                        .map(|t| t.with_timezone(&chrono::Utc))
                        .unwrap_or_default(),
                })
            })
            .db()?
            .collect::<rusqlite::Result<_>>()
            .db()?;
        out.reverse();
        Ok(out)
    }
}

/// Writes the counts of the event series that grew since they were last written, in a
/// transaction of its own. Skipped while a group of writes is open (the next call writes them).
pub(super) fn write_series(writer: &Mutex<Writer>, series: &Series, now: std::time::Instant) -> Result<()> {
    let w = lock(writer);
    if w.open != 0 {
        return Ok(());
    }
    let writes = lock(series).refresh(now, |s| (s.stored, s.count, s.last_observed));
    if writes.is_empty() {
        return Ok(());
    }
    let tx = w.conn.unchecked_transaction().db()?;
    let mut gone = Vec::new();
    for (id, count, time) in writes {
        if update_series(&tx, id, count, time)? == 0 {
            gone.push(id);
        }
    }
    tx.commit().db()?;
    let mut book = lock(series);
    for id in gone {
        book.forget(&id);
    }
    Ok(())
}

/// Sets the count and last time of the series in row `id`; the rows changed (0: the row is gone,
/// trimmed away or never committed).
fn update_series(conn: &Connection, id: i64, count: i32, time: crate::resources::Time) -> Result<usize> {
    conn.prepare_cached("UPDATE events SET count = ?2, time = ?3 WHERE id = ?1")
        .db()?
        .execute(params![id, count, time.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)])
        .db()
}
