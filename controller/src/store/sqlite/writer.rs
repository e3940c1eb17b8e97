//! The group-commit writer: the writing connection, behind one lock, and the group of writes in
//! its open transaction. Writes that arrive together share one transaction, each in a savepoint
//! of its own; the first to come back commits for all, and only then do the cache and the
//! change notifications show the group.

use std::sync::Arc;

use rusqlite::Connection;

use super::{db_error, lock, Db, Entry, SqliteBackend};
use crate::store::packed::Packed;
use crate::store::{Change, Error, Key, Result};

/// Writes at most this many per transaction; the write that fills a group commits it.
const GROUP_MAX: usize = 256;

/// What one write changes, applied to the cache and announced once its group commits.
pub(super) struct Effect {
    pub(super) key: Key,
    pub(super) rv: u64,
    /// The object as stored; `None` when it was removed.
    pub(super) json: Option<Arc<str>>,
    pub(super) owner: Option<Key>,
    /// Only the status changed.
    pub(super) status_only: bool,
}

/// The writing connection and the group of writes in its open transaction.
pub(super) struct Writer {
    pub(super) conn: Connection,
    /// The last resourceVersion given out in the open group (read from the `counter` row when
    /// the group begins, written back once when it commits).
    rv: u64,
    /// The group the open transaction belongs to (0: none open).
    pub(super) open: u64,
    /// Groups numbered so far.
    numbered: u64,
    /// Every group up to this one has ended (committed or failed).
    ended: u64,
    /// The last group whose commit failed, and why.
    failed: Option<(u64, String)>,
    /// The open group's effects, in write order.
    effects: Vec<Effect>,
    /// Writes in the open group.
    writes: usize,
}

impl Writer {
    /// The writer of `conn`, no group open.
    pub(super) fn new(conn: Connection) -> Self {
        Self { conn, rv: 0, open: 0, numbered: 0, ended: 0, failed: None, effects: Vec::new(), writes: 0 }
    }
}

impl SqliteBackend {
    /// Runs `f` in the open group's transaction (opening one if none is), in a savepoint of its
    /// own, and returns once that transaction is committed. While this write yields, others join
    /// the group; whichever comes back first commits for all.
    pub(super) async fn batched<T>(
        &self,
        f: impl FnOnce(&Connection, &mut u64) -> Result<(T, Option<Effect>)>,
    ) -> Result<T> {
        let group = {
            let mut guard = lock(&self.writer);
            let w = &mut *guard;
            if w.open == 0 {
                w.conn.prepare_cached("BEGIN IMMEDIATE").db()?.execute([]).db()?;
                match w
                    .conn
                    .prepare_cached("SELECT rv FROM counter WHERE id = 0")
                    .db()?
                    .query_row([], |r| r.get::<_, i64>(0))
                {
                    Ok(rv) => w.rv = rv as u64,
                    Err(e) => {
                        let _ = w.conn.execute_batch("ROLLBACK");
                        return Err(db_error(e));
                    }
                }
                w.numbered += 1;
                w.open = w.numbered;
            }
            // Cached statements: execute_batch would parse the SQL again for every write.
            w.conn.prepare_cached("SAVEPOINT write").db()?.execute([]).db()?;
            let rv_before = w.rv;
            match f(&w.conn, &mut w.rv) {
                Ok((out, effect)) => {
                    w.conn.prepare_cached("RELEASE write").db()?.execute([]).db()?;
                    w.effects.extend(effect);
                    w.writes += 1;
                    let group = w.open;
                    if w.writes >= GROUP_MAX {
                        self.commit(w);
                    }
                    (out, group)
                }
                Err(e) => {
                    w.rv = rv_before;
                    let _ = w.conn.execute_batch("ROLLBACK TO write; RELEASE write");
                    if w.writes == 0 {
                        // Nothing else in the group: end it here.
                        let _ = w.conn.execute_batch("ROLLBACK");
                        w.ended = w.open;
                        w.open = 0;
                    }
                    return Err(e);
                }
            }
        };
        let (out, group) = group;
        let mut pending = Pending { backend: self, group, waiting: true };
        tokio::task::yield_now().await;
        pending.finish()?;
        Ok(out)
    }

    /// Commits the open group, then applies its effects in order (cache, notifications).
    fn commit(&self, w: &mut Writer) {
        let group = w.open;
        if group == 0 {
            return;
        }
        let effects = std::mem::take(&mut w.effects);
        w.open = 0;
        w.writes = 0;
        w.ended = group;
        // Packed before the commit, outside the cache's lock.
        let packed: Vec<Option<Packed>> = effects.iter().map(|e| e.json.as_deref().map(Packed::new)).collect();
        // The cache stays locked from before the commit until it holds the group: the poller,
        // which finds rows by version, must not see them committed and not yet cached (it would
        // take them for another process's writes and announce them a second time, as not
        // status-only).
        let mut cache = self.cache.write().unwrap_or_else(|p| p.into_inner());
        let committed = w
            .conn
            .prepare_cached("UPDATE counter SET rv = ?1 WHERE id = 0 AND rv < ?1")
            .and_then(|mut c| c.execute([w.rv as i64]))
            .and_then(|_| w.conn.prepare_cached("COMMIT")?.execute([]));
        if let Err(e) = committed {
            drop(cache);
            let _ = w.conn.execute_batch("ROLLBACK");
            tracing::warn!("store: committing {} writes failed: {e}", effects.len());
            w.failed = Some((group, e.to_string()));
            return;
        }
        for (e, json) in effects.iter().zip(packed) {
            let slot = cache.entry(e.key.kind).or_default();
            let k = (e.key.namespace.clone(), e.key.name.clone());
            match json {
                Some(json) => {
                    slot.insert(k, Entry { rv: e.rv, json });
                }
                None => {
                    slot.remove(&k);
                }
            }
        }
        drop(cache);
        for e in effects {
            let (deleted, status_only) = (e.json.is_none(), e.json.is_some() && e.status_only);
            let _ = self.tx.send(Change { key: e.key, owner: e.owner, deleted, status_only });
        }
    }

    /// A write of one object: `f` gets the next resource version.
    pub(super) async fn write<T>(&self, f: impl FnOnce(&Connection, u64) -> Result<(T, Option<Effect>)>) -> Result<T> {
        self.batched(|conn, rv| {
            *rv += 1;
            f(conn, *rv)
        })
        .await
    }
}

/// A write waiting for its group to commit. Dropped before that (the caller gave up), it commits
/// the group at once, so no transaction is left open.
struct Pending<'a> {
    backend: &'a SqliteBackend,
    group: u64,
    waiting: bool,
}

impl Pending<'_> {
    fn finish(&mut self) -> Result<()> {
        self.waiting = false;
        let mut w = lock(&self.backend.writer);
        if w.ended < self.group {
            self.backend.commit(&mut w);
        }
        match &w.failed {
            Some((g, why)) if *g == self.group => Err(Error::unavailable(format!("the store did not commit: {why}"))),
            _ => Ok(()),
        }
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if self.waiting {
            let _ = self.finish();
        }
    }
}
