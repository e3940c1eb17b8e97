//! What other processes wrote: a poller that watches the store file's `data_version` and folds
//! the rows and tombstones other processes committed into the cache, announcing each; it also
//! writes the counts of growing event series.

use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rusqlite::{params, Connection, OptionalExtension};
use serde_json::Value;
use tokio::sync::broadcast;

use super::events::write_series;
use super::rows::{kind_from, owner_of};
use super::schema::{BUSY_TIMEOUT, CONNECTION_CACHE_KIB};
use super::{lock, Cache, Db, Entry, SqliteBackend};
use crate::store::packed::Packed;
use crate::store::{Change, Key, Result};

/// How often the poller checks the file for other processes' writes (`PRAGMA data_version`),
/// and how soon it retries opening its connection.
const POLL_INTERVAL: Duration = Duration::from_millis(200);

/// How often a growing event series' count is written (by the poller). An UPDATE of one row a
/// second, where every repeat was a row before.
const SERIES_REFRESH: Duration = Duration::from_secs(1);

impl SqliteBackend {
    /// Watches for commits by other processes and folds them into the cache.
    ///
    /// It asks the writing connection, not its own, whether anything was committed: a
    /// connection's `data_version` moves only with other connections' commits, so the writer's
    /// moves only with other processes' writes, while the poller's own would move with every
    /// group this process commits (thousands of rows a second, each looked up again only to find
    /// it cached). It reads the rows through its own connection, so a long read never holds up
    /// the writer.
    pub(super) fn spawn_poller(&self, path: &Path, mut synced: u64) {
        let Ok(handle) = tokio::runtime::Handle::try_current() else { return };
        let path = path.to_path_buf();
        let cache = Arc::downgrade(&self.cache);
        let writer = Arc::downgrade(&self.writer);
        let series = Arc::downgrade(&self.series);
        let tx = self.tx.clone();
        handle.spawn(async move {
            // Keep trying to open the watching connection: without it, other processes' writes
            // would only be seen at the next resync.
            let conn = loop {
                match Connection::open(&path) {
                    Ok(c) => break c,
                    Err(e) => {
                        tracing::warn!("store poller: opening {}: {e}; retrying", path.display());
                        tokio::time::sleep(POLL_INTERVAL).await;
                    }
                }
            };
            let _ = conn.busy_timeout(BUSY_TIMEOUT);
            let _ = conn.pragma_update(None, "cache_size", CONNECTION_CACHE_KIB);
            let mut last_version: i64 = -1;
            let mut last_refresh = std::time::Instant::now();
            let mut tick = tokio::time::interval(POLL_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let (Some(cache), Some(writer), Some(series)) = (cache.upgrade(), writer.upgrade(), series.upgrade())
                else {
                    return;
                };
                if last_refresh.elapsed() >= SERIES_REFRESH {
                    last_refresh = std::time::Instant::now();
                    if let Err(e) = write_series(&writer, &series, last_refresh) {
                        tracing::warn!("store: writing event series counts: {}", machine_driver_util::error_chain(&e));
                    }
                }
                let version = lock(&writer)
                    .conn
                    .prepare_cached("PRAGMA data_version")
                    .and_then(|mut s| s.query_row([], |r| r.get::<_, i64>(0)));
                drop(writer);
                let version = match version {
                    Ok(v) => v,
                    Err(e) => {
                        tracing::warn!("store poller: {e}");
                        // Unknown: look at the rows anyway.
                        last_version - 1
                    }
                };
                if version == last_version {
                    continue;
                }
                last_version = version;
                match sync_from(&conn, &cache, &tx, synced, || {}) {
                    Ok(rv) => synced = rv,
                    Err(e) => tracing::warn!("store poller: {}", machine_driver_util::error_chain(&e)),
                }
            }
        });
    }
}

/// Folds the rows and tombstones committed after version `synced` into the cache, announcing
/// each, and returns the version synced up to. `between` runs between the reads of rows and of
/// tombstones (a test commits there, as another process may).
fn sync_from(
    conn: &Connection,
    cache: &RwLock<Cache>,
    tx: &broadcast::Sender<Change>,
    synced: u64,
    between: impl FnOnce(),
) -> Result<u64> {
    // One read transaction, so every read sees one snapshot and `max` covers exactly the commits
    // read. Two statements on their own could straddle a commit: a group holding a row at
    // version N and a tombstone at N+1 landing between them put N+1 into `max` while the row was
    // never read, and the next look (`rv > N+1`) would never find it.
    let snapshot = conn.unchecked_transaction().db()?;
    let conn: &Connection = &snapshot;
    let mut max = synced;
    // Versions first: most rows found are this process's own writes, already cached, and their
    // text need not be copied out again.
    let mut stmt = conn.prepare_cached("SELECT kind, namespace, name, rv FROM objects WHERE rv > ?1").db()?;
    let rows: Vec<(String, String, String, i64)> = stmt
        .query_map([synced as i64], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
        .db()?
        .collect::<rusqlite::Result<_>>()
        .db()?;
    for (kind_name, ns, name, rv) in rows {
        max = max.max(rv as u64);
        let Some(kind) = kind_from(&kind_name) else { continue };
        let cached = {
            let c = cache.read().unwrap_or_else(|p| p.into_inner());
            c.get(&kind).and_then(|m| m.get(&(ns.clone(), name.clone()))).is_some_and(|e| e.rv >= rv as u64)
        };
        if cached {
            continue;
        }
        // Its text (the snapshot's version of the row).
        let Some((rv, body)) = conn
            .prepare_cached("SELECT rv, body FROM objects WHERE kind = ?1 AND namespace = ?2 AND name = ?3")
            .db()?
            .query_row(params![kind_name, ns, name], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)))
            .optional()
            .db()?
        else {
            continue;
        };
        let rv = rv as u64;
        let key = Key::new(kind, &ns, &name);
        let fresh = {
            let mut c = cache.write().unwrap_or_else(|p| p.into_inner());
            let slot = c.entry(kind).or_default();
            let k = (ns.clone(), name.clone());
            if slot.get(&k).is_some_and(|e| e.rv >= rv) {
                false
            } else {
                slot.insert(k, Entry { rv, json: Packed::new(&body) });
                true
            }
        };
        if fresh {
            let owner = serde_json::from_str::<Value>(&body).ok().and_then(|v| owner_of(&v, &ns));
            let _ = tx.send(Change { key, owner, deleted: false, status_only: false });
        }
    }
    between();
    let mut stmt = conn.prepare_cached("SELECT kind, namespace, name, rv, owner FROM tombstones WHERE rv > ?1").db()?;
    let gone: Vec<(String, String, String, i64, Option<String>)> = stmt
        .query_map([synced as i64], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)))
        .db()?
        .collect::<rusqlite::Result<_>>()
        .db()?;
    for (kind, ns, name, rv, owner) in gone {
        max = max.max(rv as u64);
        let Some(kind) = kind_from(&kind) else { continue };
        let removed = {
            let mut c = cache.write().unwrap_or_else(|p| p.into_inner());
            c.get_mut(&kind).and_then(|m| {
                let k = (ns.clone(), name.clone());
                if m.get(&k).is_some_and(|e| e.rv < rv as u64) {
                    m.remove(&k)
                } else {
                    None
                }
            })
        };
        if removed.is_some() {
            let owner = owner.and_then(|o| {
                let (k, n) = o.split_once('/')?;
                Some(Key::new(kind_from(k)?, &ns, n))
            });
            let _ = tx.send(Change { key: Key::new(kind, &ns, &name), owner, deleted: true, status_only: false });
        }
    }
    Ok(max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::*;
    use crate::store::Store;

    fn class(name: &str) -> MachineClass {
        let spec = MachineClassSpec {
            driver: "fake".into(),
            provider_spec: serde_json::json!({"machineType": "small"}),
            secret_ref: None,
            capacity: None,
            user_data: None,
        };
        MachineClass::new("default", name, spec)
    }

    fn names(cache: &RwLock<Cache>) -> Vec<String> {
        let c = cache.read().unwrap();
        c.get(&Kind::MachineClass).map(|m| m.keys().map(|(_, n)| n.clone()).collect()).unwrap_or_default()
    }

    /// Another process commits between the poller's read of rows and its read of tombstones: it
    /// creates one class, then deletes another, so the tombstone's version is above the new
    /// row's. That look sees neither; the next sees both. (Read outside one snapshot, the first
    /// look took the tombstone's version as synced, and the new class was never seen.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_commit_between_the_reads_of_rows_and_tombstones_is_found_by_the_next_look() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.db");
        let other = Store::open(&path).unwrap();
        other.create(&class("old")).await.unwrap();
        let conn = Connection::open(&path).unwrap();
        let (cache, synced) = super::super::rows::load(&conn).unwrap();
        let cache = RwLock::new(cache);
        let (tx, mut rx) = broadcast::channel(16);
        let commit = || {
            tokio::task::block_in_place(|| {
                tokio::runtime::Handle::current().block_on(async {
                    other.create(&class("new")).await.unwrap();
                    other.delete(&Key::new(Kind::MachineClass, "default", "old")).await.unwrap();
                })
            });
        };
        let synced = sync_from(&conn, &cache, &tx, synced, commit).unwrap();
        assert_eq!(names(&cache), ["old"], "the look saw its snapshot only");
        assert!(rx.try_recv().is_err(), "nothing announced from outside the snapshot");

        sync_from(&conn, &cache, &tx, synced, || {}).unwrap();
        assert_eq!(names(&cache), ["new"]);
        let mut changes: Vec<(String, bool)> =
            std::iter::from_fn(|| rx.try_recv().ok()).map(|c| (c.key.name, c.deleted)).collect();
        changes.sort();
        assert_eq!(changes, [("new".to_string(), false), ("old".to_string(), true)]);
    }
}
