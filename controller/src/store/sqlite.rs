//! The embedded store: one SQLite file in WAL mode.
//!
//! - Durability: WAL with `synchronous=NORMAL` — a committed write survives the process being
//!   killed at any moment (`kill -9`); only an OS crash may lose the last commits.
//! - Concurrency: every write checks the caller's `resourceVersion` against the stored row and
//!   takes the next global version, inside an immediate transaction.
//! - Group commit: writes that arrive together share one transaction (each in its own savepoint,
//!   so a refused write undoes only itself). A write returns once its transaction is committed,
//!   and only then do the cache and the change notifications show it — as before, one commit per
//!   write, but a commit writes each page once for the whole group.
//! - Reads come from an in-memory cache of the JSON text, each object's text compressed
//!   (`store/packed.rs`) and parsed on demand, so 10,000 objects cost little memory.
//! - Changes made through this handle are broadcast at once; changes by other processes (the CLI
//!   applying a manifest while `run` is running) are found by a poller watching SQLite's
//!   `data_version` and broadcast too.
//! - Events go to the `events` table, repeats aggregated into series as on the API server
//!   (`store/series.rs`): one row per series, its `count` written by the poller while it grows.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use rusqlite::{params, Connection, OptionalExtension};
use serde_json::value::RawValue;
use serde_json::Value;
use tokio::sync::broadcast;

use super::packed::Packed;
use super::series::{Book, Seen};
use super::{Backend, Change, Error, Event, Key, Result};
use crate::resources::Kind;

#[derive(Clone)]
struct Entry {
    rv: u64,
    json: Packed,
}

type Cache = HashMap<Kind, BTreeMap<(String, String), Entry>>;

/// Change notifications buffered for a slow subscriber before it lags (and relists). Tokio
/// allocates every slot up front, and a slot keeps the last change it carried: at 1 << 16 the
/// buffer alone held about 10 MB. The runtime's watcher only queues keys, so it keeps up.
const CHANGES_BUFFERED: usize = 1 << 12;

/// Writes at most this many per transaction; the write that fills a group commits it.
const GROUP_MAX: usize = 256;

/// How long a connection waits for another process's lock (SQLite's busy timeout) before a
/// write fails as [`Error::Unavailable`]: far longer than any write transaction holds it.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);
/// Attempts at opening a new file while another process switches it to WAL, and the pause
/// between them: 100 × 50 ms, five seconds in all.
const OPEN_ATTEMPTS: u32 = 100;
/// See [`OPEN_ATTEMPTS`].
const OPEN_RETRY: Duration = Duration::from_millis(50);
/// How often the poller checks the file for other processes' writes (`PRAGMA data_version`),
/// and how soon it retries opening its connection.
const POLL_INTERVAL: Duration = Duration::from_millis(200);

/// Each connection's page cache, as SQLite's `cache_size` takes it (negative: KiB). Reads come
/// from the in-memory cache of texts, so SQLite's pages serve only writes and the poller, and a
/// page missing here is read from the OS's page cache. SQLite's default, 2 MB, was 2–4 MB of
/// the controller's peak at 10,000 machines, and 256 KiB costs no measurable CPU at 10,000 or
/// 100,000 (`docs/src/reference/benchmarks-history.md`, "Fourth round").
const CONNECTION_CACHE_KIB: i64 = -256;

/// How often a growing event series' count is written (by the poller). An UPDATE of one row a
/// second, where every repeat was a row before.
const SERIES_REFRESH: Duration = Duration::from_secs(1);

/// Event series by the id of their row.
type Series = Mutex<Book<i64>>;

/// What one write changes, applied to the cache and announced once its group commits.
struct Effect {
    key: Key,
    rv: u64,
    /// The object as stored; `None` when it was removed.
    json: Option<Arc<str>>,
    owner: Option<Key>,
    /// Only the status changed.
    status_only: bool,
}

/// The writing connection and the group of writes in its open transaction.
struct Writer {
    conn: Connection,
    /// The last resourceVersion given out in the open group (read from the `counter` row when
    /// the group begins, written back once when it commits).
    rv: u64,
    /// The group the open transaction belongs to (0: none open).
    open: u64,
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

/// The SQLite-backed store.
pub struct SqliteBackend {
    writer: Arc<Mutex<Writer>>,
    cache: Arc<RwLock<Cache>>,
    tx: broadcast::Sender<Change>,
    events_written: Mutex<u64>,
    series: Arc<Series>,
}

fn kind_from(s: &str) -> Option<Kind> {
    Kind::from_name(s)
}

fn owner_of(json: &Value, namespace: &str) -> Option<Key> {
    let refs = json.get("metadata")?.get("ownerReferences")?.as_array()?;
    let owner = refs.iter().find(|r| r.get("controller").and_then(Value::as_bool) == Some(true))?;
    let kind = kind_from(owner.get("kind")?.as_str()?)?;
    Some(Key::new(kind, namespace, owner.get("name")?.as_str()?))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A SQLite error as a store error: a busy or locked database is [`Error::Unavailable`] (another
/// process holds the lock longer than the busy timeout); anything else is [`Error::Backend`].
fn db_error(e: rusqlite::Error) -> Error {
    match e.sqlite_error_code() {
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked) => {
            Error::Unavailable { reason: "the store file is locked by another writer".into(), source: Some(e.into()) }
        }
        _ => Error::backend("sqlite", e),
    }
}

/// `?` on SQLite results in store code.
trait Db<T> {
    fn db(self) -> Result<T>;
}

impl<T> Db<T> for rusqlite::Result<T> {
    fn db(self) -> Result<T> {
        self.map_err(db_error)
    }
}

fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

impl SqliteBackend {
    /// Opens (or creates) the store file.
    ///
    /// # Errors
    /// The file cannot be opened, is not SQLite, or holds unreadable rows.
    pub fn open(path: &Path) -> Result<Self> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .map_err(|e| Error::Invalid(format!("creating {}: {e}", parent.display())))?;
        }
        // Two processes opening a new file at once (`run` starting while `apply` writes) race
        // for the exclusive lock that switching to WAL needs; SQLite's busy handler does not
        // cover that, so the loser retries for a while.
        let mut attempt = 0;
        let conn = loop {
            match Self::connect(path) {
                Err(e)
                    if attempt < OPEN_ATTEMPTS
                        && matches!(
                            e.sqlite_error_code(),
                            Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
                        ) =>
                {
                    attempt += 1;
                    // Deliberate: a short backoff before trying the lock again (open is synchronous).
                    std::thread::sleep(OPEN_RETRY);
                }
                other => break other.db()?,
            }
        };
        Self::from_connection(path, conn)
    }

    fn connect(path: &Path) -> rusqlite::Result<Connection> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(BUSY_TIMEOUT)?;
        // Switching to WAL needs an exclusive lock; only do it when the file is not WAL yet, so a
        // second process (the CLI) can open the store while `run` writes to it.
        let mode: String = conn.query_row("PRAGMA journal_mode", [], |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            conn.pragma_update(None, "journal_mode", "WAL")?;
        }
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.pragma_update(None, "cache_size", CONNECTION_CACHE_KIB)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS objects(
                kind TEXT NOT NULL, namespace TEXT NOT NULL, name TEXT NOT NULL,
                rv INTEGER NOT NULL, body TEXT NOT NULL, PRIMARY KEY(kind, namespace, name));
             CREATE INDEX IF NOT EXISTS objects_rv ON objects(rv);
             CREATE TABLE IF NOT EXISTS tombstones(
                kind TEXT NOT NULL, namespace TEXT NOT NULL, name TEXT NOT NULL,
                rv INTEGER NOT NULL, owner TEXT, PRIMARY KEY(kind, namespace, name));
             CREATE TABLE IF NOT EXISTS counter(id INTEGER PRIMARY KEY CHECK (id = 0), rv INTEGER NOT NULL);
             INSERT OR IGNORE INTO counter(id, rv) VALUES (0, 0);
             CREATE TABLE IF NOT EXISTS events(
                id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT, namespace TEXT, name TEXT,
                type TEXT, reason TEXT, message TEXT, time TEXT, count INTEGER NOT NULL DEFAULT 1);
             CREATE INDEX IF NOT EXISTS events_object ON events(kind, namespace, name);",
        )?;
        Self::add_event_counts(&conn)?;
        Ok(conn)
    }

    /// Gives a store made before event series its `count` column (each old row one event).
    fn add_event_counts(conn: &Connection) -> rusqlite::Result<()> {
        let has: bool =
            conn.query_row("SELECT COUNT(*) > 0 FROM pragma_table_info('events') WHERE name = 'count'", [], |r| {
                r.get(0)
            })?;
        if has {
            return Ok(());
        }
        match conn.execute_batch("ALTER TABLE events ADD COLUMN count INTEGER NOT NULL DEFAULT 1") {
            // Another process opening the file at the same moment added it first.
            Err(e) if e.to_string().contains("duplicate column") => Ok(()),
            other => other,
        }
    }

    fn from_connection(path: &Path, conn: Connection) -> Result<Self> {
        let mut cache: Cache = HashMap::new();
        let mut synced = 0;
        {
            let mut stmt = conn.prepare("SELECT kind, namespace, name, rv, body FROM objects").db()?;
            let rows = stmt
                .query_map([], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, String>(2)?,
                        r.get::<_, i64>(3)?,
                        r.get::<_, String>(4)?,
                    ))
                })
                .db()?;
            for row in rows {
                let (kind, ns, name, rv, body) = row.db()?;
                let Some(kind) = kind_from(&kind) else { continue };
                synced = synced.max(rv as u64);
                cache.entry(kind).or_default().insert((ns, name), Entry { rv: rv as u64, json: Packed::new(&body) });
            }
        }
        let synced_rv: i64 = conn.query_row("SELECT rv FROM counter WHERE id = 0", [], |r| r.get(0)).db()?;
        let (tx, _) = broadcast::channel(CHANGES_BUFFERED);
        let backend = Self {
            writer: Arc::new(Mutex::new(Writer {
                conn,
                rv: 0,
                open: 0,
                numbered: 0,
                ended: 0,
                failed: None,
                effects: Vec::new(),
                writes: 0,
            })),
            cache: Arc::new(RwLock::new(cache)),
            tx,
            events_written: Mutex::new(0),
            series: Arc::default(),
        };
        backend.spawn_poller(path, synced_rv.max(synced as i64) as u64);
        Ok(backend)
    }

    /// Watches for commits by other processes and folds them into the cache.
    ///
    /// It asks the writing connection, not its own, whether anything was committed: a
    /// connection's `data_version` moves only with other connections' commits, so the writer's
    /// moves only with other processes' writes, while the poller's own would move with every
    /// group this process commits (thousands of rows a second, each looked up again only to find
    /// it cached). It reads the rows through its own connection, so a long read never holds up
    /// the writer.
    fn spawn_poller(&self, path: &Path, mut synced: u64) {
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
                match sync_from(&conn, &cache, &tx, synced) {
                    Ok(rv) => synced = rv,
                    Err(e) => tracing::warn!("store poller: {}", machine_driver_util::error_chain(&e)),
                }
            }
        });
    }

    /// Runs `f` in the open group's transaction (opening one if none is), in a savepoint of its
    /// own, and returns once that transaction is committed. While this write yields, others join
    /// the group; whichever comes back first commits for all.
    async fn batched<T>(&self, f: impl FnOnce(&Connection, &mut u64) -> Result<(T, Option<Effect>)>) -> Result<T> {
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

    /// The cached text of `key` if the cache holds exactly version `rv`.
    fn cached_at(&self, key: &Key, rv: u64) -> Option<Packed> {
        let c = self.cache.read().unwrap_or_else(|p| p.into_inner());
        let e = c.get(&key.kind)?.get(&(key.namespace.clone(), key.name.clone()))?;
        (e.rv == rv).then(|| e.json.clone())
    }

    /// The key of the cached object `packed` of `kind`, if the cache still holds it.
    fn key_of(&self, kind: Kind, packed: &Packed) -> Option<Key> {
        let c = self.cache.read().unwrap_or_else(|p| p.into_inner());
        let ((ns, name), _) = c.get(&kind)?.iter().find(|(_, e)| e.json.same(packed))?;
        Some(Key::new(kind, ns, name))
    }

    /// The cached objects of `kind` (shared, not copied), in key order.
    fn cached(&self, kind: Kind) -> Vec<Packed> {
        let c = self.cache.read().unwrap_or_else(|p| p.into_inner());
        c.get(&kind).map(|m| m.values().map(|e| e.json.clone()).collect()).unwrap_or_default()
    }

    /// Replaces the status of `key` if it is still at `expected`.
    async fn write_status(&self, key: Key, expected: String, status: &RawValue) -> Result<Option<Arc<str>>> {
        self.write(|tx, rv| {
            // A version names one text (versions come from one counter in the file, for every
            // process). So when the cache holds the expected version, its text is the row's
            // whenever the row is still at that version, and an UPDATE that checks the version
            // writes without reading the row first: one B-tree lookup per status write, not two.
            // Anything else (the row moved on or is gone, the cache is behind, the object goes)
            // takes the path below, which reads the row.
            let cached = expected.parse::<u64>().ok().and_then(|at| Some((at, self.cached_at(&key, at)?)));
            if let Some((at, packed)) = cached {
                let written = packed.read(|body| with_status(body, status, rv, &key.namespace))??;
                if !written.remove && replace_row_at(tx, &key, at, rv, &written.body)? {
                    let json: Arc<str> = written.body.into();
                    let effect = Effect {
                        key: key.clone(),
                        rv,
                        json: Some(json.clone()),
                        owner: written.owner,
                        status_only: true,
                    };
                    return Ok((Some(json), Some(effect)));
                }
            }
            let current_rv = read_version(tx, &key)?.ok_or_else(|| Error::NotFound(key.clone()))?;
            if expected != current_rv.to_string() {
                return Err(conflict(&key, &expected, current_rv));
            }
            // The cache holds committed versions only: if it has this one, it has this text, and
            // the row need not be copied out of SQLite again (a write earlier in the open group,
            // or another process's, leaves the cache behind and the row is read).
            let written = match self.cached_at(&key, current_rv) {
                Some(packed) => packed.read(|body| with_status(body, status, rv, &key.namespace))??,
                None => {
                    let (_, body) = read_text(tx, &key)?.ok_or_else(|| Error::NotFound(key.clone()))?;
                    with_status(&body, status, rv, &key.namespace)?
                }
            };
            let owner = written.owner;
            if written.remove {
                remove_row(tx, &key, rv, owner.as_ref())?;
                return Ok((None, Some(Effect { key: key.clone(), rv, json: None, owner, status_only: false })));
            }
            replace_row(tx, &key, rv, &written.body)?;
            let json: Arc<str> = written.body.into();
            Ok((Some(json.clone()), Some(Effect { key: key.clone(), rv, json: Some(json), owner, status_only: true })))
        })
        .await
    }

    /// A write of one object: `f` gets the next resource version.
    async fn write<T>(&self, f: impl FnOnce(&Connection, u64) -> Result<(T, Option<Effect>)>) -> Result<T> {
        self.batched(|conn, rv| {
            *rv += 1;
            f(conn, *rv)
        })
        .await
    }
}

/// Writes the counts of the event series that grew since they were last written, in a
/// transaction of its own. Skipped while a group of writes is open (the next call writes them).
fn write_series(writer: &Mutex<Writer>, series: &Series, now: std::time::Instant) -> Result<()> {
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

impl Drop for SqliteBackend {
    fn drop(&mut self) {
        // The counts that grew since the poller last wrote them.
        let after_all = std::time::Instant::now() + super::series::SERIES_WINDOW * 2;
        if let Err(e) = write_series(&self.writer, &self.series, after_all) {
            tracing::warn!("store: writing event series counts: {}", machine_driver_util::error_chain(&e));
        }
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

fn sync_from(conn: &Connection, cache: &RwLock<Cache>, tx: &broadcast::Sender<Change>, synced: u64) -> Result<u64> {
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
        // Read again with its version: the row may have moved on since the first query.
        let Some((rv, body)) = conn
            .prepare_cached("SELECT rv, body FROM objects WHERE kind = ?1 AND namespace = ?2 AND name = ?3")
            .db()?
            .query_row(params![kind_name, ns, name], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)))
            .optional()
            .db()?
        else {
            continue;
        };
        // `max` stays at the first query's versions: a newer row read here is found again next
        // time, and then skipped as cached.
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

fn meta_str<'a>(v: &'a Value, field: &str) -> Option<&'a str> {
    v.get("metadata")?.get(field)?.as_str()
}

fn key_of(kind: Kind, v: &Value) -> Result<Key> {
    let name = meta_str(v, "name")
        .filter(|n| !n.is_empty())
        .ok_or_else(|| Error::Invalid("metadata.name is required".into()))?;
    Ok(Key::new(kind, meta_str(v, "namespace").unwrap_or("default"), name))
}

/// The `resourceVersion` a write must carry (the one its caller read).
fn required_version(key: &Key, rv: Option<&str>) -> Result<String> {
    match rv {
        Some(rv) if !rv.is_empty() => Ok(rv.to_string()),
        _ => Err(Error::Invalid(format!("{key}: an update must carry the resourceVersion it read"))),
    }
}

/// The caller read `expected`; the store holds `actual`.
fn conflict(key: &Key, expected: &str, actual: u64) -> Error {
    Error::Conflict { key: key.clone(), expected: expected.into(), actual: actual.to_string() }
}

fn read_text(tx: &Connection, key: &Key) -> Result<Option<(u64, String)>> {
    let row: Option<(i64, String)> = tx
        .prepare_cached("SELECT rv, body FROM objects WHERE kind = ?1 AND namespace = ?2 AND name = ?3")
        .db()?
        .query_row(params![key.kind.as_str(), key.namespace, key.name], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()
        .db()?;
    Ok(row.map(|(rv, body)| (rv as u64, body)))
}

/// Only the stored version of `key` (the text stays in SQLite).
fn read_version(tx: &Connection, key: &Key) -> Result<Option<u64>> {
    let rv: Option<i64> = tx
        .prepare_cached("SELECT rv FROM objects WHERE kind = ?1 AND namespace = ?2 AND name = ?3")
        .db()?
        .query_row(params![key.kind.as_str(), key.namespace, key.name], |r| r.get(0))
        .optional()
        .db()?;
    Ok(rv.map(|rv| rv as u64))
}

fn read_row(tx: &Connection, key: &Key) -> Result<Option<(u64, Value)>> {
    match read_text(tx, key)? {
        Some((rv, body)) => Ok(Some((rv, serde_json::from_str(&body)?))),
        None => Ok(None),
    }
}

/// A stored object with a new status and resourceVersion.
struct StatusWritten {
    body: String,
    owner: Option<Key>,
    /// Being deleted with no finalizers left: the object goes.
    remove: bool,
}

/// Puts `status` and `rv` into the stored `body`. The rest of the object is copied as the text
/// it was stored as, never parsed into values and printed again: status writes are most of the
/// store's writes, and that was most of their cost.
fn with_status(body: &str, status: &RawValue, rv: u64, namespace: &str) -> Result<StatusWritten> {
    let mut top: BTreeMap<String, &RawValue> = serde_json::from_str(body)?;
    let mut meta: BTreeMap<String, &RawValue> = match top.get("metadata") {
        Some(m) => serde_json::from_str(m.get())?,
        None => BTreeMap::new(),
    };
    let field = |name: &str| -> Value {
        meta.get(name).and_then(|raw| serde_json::from_str(raw.get()).ok()).unwrap_or(Value::Null)
    };
    let remove = !field("deletionTimestamp").is_null() && field("finalizers").as_array().is_none_or(Vec::is_empty);
    let owner =
        owner_of(&serde_json::json!({ "metadata": { "ownerReferences": field("ownerReferences") } }), namespace);
    let version = serde_json::value::to_raw_value(&rv.to_string())?;
    meta.insert("resourceVersion".into(), &version);
    let meta = serde_json::value::to_raw_value(&meta)?;
    top.insert("metadata".into(), &meta);
    top.insert("status".into(), status);
    Ok(StatusWritten { body: serde_json::to_string(&top)?, owner, remove })
}

/// Stores a new object (a tombstone of an earlier one by that name goes).
fn insert_row(tx: &Connection, key: &Key, rv: u64, body: &str) -> Result<()> {
    tx.prepare_cached(
        "INSERT INTO objects(kind, namespace, name, rv, body) VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT(kind, namespace, name) DO UPDATE SET rv = excluded.rv, body = excluded.body",
    )
    .db()?
    .execute(params![key.kind.as_str(), key.namespace, key.name, rv as i64, body])
    .db()?;
    tx.prepare_cached("DELETE FROM tombstones WHERE kind = ?1 AND namespace = ?2 AND name = ?3")
        .db()?
        .execute(params![key.kind.as_str(), key.namespace, key.name])
        .db()?;
    Ok(())
}

/// Stores a new version of an object that exists (so it has no tombstone).
fn replace_row(tx: &Connection, key: &Key, rv: u64, body: &str) -> Result<()> {
    tx.prepare_cached("UPDATE objects SET rv = ?4, body = ?5 WHERE kind = ?1 AND namespace = ?2 AND name = ?3")
        .db()?
        .execute(params![key.kind.as_str(), key.namespace, key.name, rv as i64, body])
        .db()?;
    Ok(())
}

/// Stores a new version of an object if it is still at version `at`; whether it was.
fn replace_row_at(tx: &Connection, key: &Key, at: u64, rv: u64, body: &str) -> Result<bool> {
    let changed = tx
        .prepare_cached(
            "UPDATE objects SET rv = ?5, body = ?6 WHERE kind = ?1 AND namespace = ?2 AND name = ?3 AND rv = ?4",
        )
        .db()?
        .execute(params![key.kind.as_str(), key.namespace, key.name, at as i64, rv as i64, body])
        .db()?;
    Ok(changed == 1)
}

fn remove_row(tx: &Connection, key: &Key, rv: u64, owner: Option<&Key>) -> Result<()> {
    tx.prepare_cached("DELETE FROM objects WHERE kind = ?1 AND namespace = ?2 AND name = ?3")
        .db()?
        .execute(params![key.kind.as_str(), key.namespace, key.name])
        .db()?;
    let owner = owner.map(|o| format!("{}/{}", o.kind.as_str(), o.name));
    tx.prepare_cached(
        "INSERT INTO tombstones(kind, namespace, name, rv, owner) VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT(kind, namespace, name) DO UPDATE SET rv = excluded.rv, owner = excluded.owner",
    )
    .db()?
    .execute(params![key.kind.as_str(), key.namespace, key.name, rv as i64, owner])
    .db()?;
    Ok(())
}

/// The part of an object that counts as its spec (bumps `generation` when it changes): its
/// kind's [`Shape::spec_fields`](crate::resources::Shape::spec_fields).
fn spec_of(kind: Kind, v: &Value) -> Value {
    kind.shape().spec_fields().iter().map(|f| v.get(*f).cloned().unwrap_or(Value::Null)).collect()
}

fn finalizers_empty(v: &Value) -> bool {
    v.get("metadata").and_then(|m| m.get("finalizers")).and_then(Value::as_array).is_none_or(Vec::is_empty)
}

#[async_trait::async_trait]
impl Backend for SqliteBackend {
    async fn get(&self, key: &Key) -> Result<Option<Arc<str>>> {
        let packed = {
            let c = self.cache.read().unwrap_or_else(|p| p.into_inner());
            c.get(&key.kind).and_then(|m| m.get(&(key.namespace.clone(), key.name.clone()))).map(|e| e.json.clone())
        };
        packed.map(|p| p.text()).transpose()
    }

    async fn list(&self, kind: Kind) -> Result<Vec<Arc<str>>> {
        self.cached(kind).iter().map(Packed::text).collect()
    }

    async fn scan(&self, kind: Kind, visit: &mut (dyn for<'t> FnMut(&'t str) -> Result<()> + Send)) -> Result<()> {
        for packed in self.cached(kind) {
            match packed.read(|json| visit(json))? {
                // An object the visitor cannot parse is named (looked up only now: the listing
                // carries no keys, so that 10,000 of them are not copied for every scan).
                Err(Error::Json(source)) => match self.key_of(kind, &packed) {
                    Some(key) => return Err(Error::Unreadable { key, source }),
                    None => return Err(Error::Json(source)),
                },
                other => other?,
            }
        }
        Ok(())
    }

    async fn count(&self, kind: Kind) -> Option<usize> {
        let c = self.cache.read().unwrap_or_else(|p| p.into_inner());
        Some(c.get(&kind).map_or(0, BTreeMap::len))
    }

    async fn keys(&self, kind: Kind) -> Result<Vec<Key>> {
        let c = self.cache.read().unwrap_or_else(|p| p.into_inner());
        Ok(c.get(&kind).map(|m| m.keys().map(|(ns, name)| Key::new(kind, ns, name)).collect()).unwrap_or_default())
    }

    async fn create(&self, kind: Kind, mut obj: Value) -> Result<Arc<str>> {
        let key = key_of(kind, &obj)?;
        let owner = owner_of(&obj, &key.namespace);
        self.write(|tx, rv| {
            if read_row(tx, &key)?.is_some() {
                return Err(Error::AlreadyExists(key.clone()));
            }
            let meta = obj
                .get_mut("metadata")
                .and_then(Value::as_object_mut)
                .ok_or_else(|| Error::Invalid("metadata is missing".into()))?;
            meta.insert("namespace".into(), key.namespace.clone().into());
            meta.insert("uid".into(), uuid::Uuid::new_v4().to_string().into());
            meta.insert("resourceVersion".into(), rv.to_string().into());
            meta.insert("generation".into(), 1.into());
            meta.insert("creationTimestamp".into(), now().into());
            meta.remove("deletionTimestamp");
            let body = serde_json::to_string(&obj)?;
            insert_row(tx, &key, rv, &body)?;
            let json: Arc<str> = body.into();
            Ok((json.clone(), Some(Effect { key: key.clone(), rv, json: Some(json), owner, status_only: false })))
        })
        .await
    }

    async fn update(&self, kind: Kind, obj: Value) -> Result<Option<Arc<str>>> {
        let key = key_of(kind, &obj)?;
        let expected = required_version(&key, meta_str(&obj, "resourceVersion"))?;
        self.write(|tx, rv| {
            let (current_rv, mut current) = read_row(tx, &key)?.ok_or_else(|| Error::NotFound(key.clone()))?;
            if expected != current_rv.to_string() {
                return Err(conflict(&key, &expected, current_rv));
            }
            let spec_changed = spec_of(kind, &current) != spec_of(kind, &obj);
            for field in ["spec", "data", "stringData", "type"] {
                match obj.get(field) {
                    Some(v) => current[field] = v.clone(),
                    None => {
                        if let Some(o) = current.as_object_mut() {
                            o.remove(field);
                        }
                    }
                }
            }
            for field in ["labels", "annotations", "finalizers", "ownerReferences"] {
                current["metadata"][field] = obj["metadata"].get(field).cloned().unwrap_or(Value::Null);
                if current["metadata"][field].is_null() {
                    if let Some(m) = current["metadata"].as_object_mut() {
                        m.remove(field);
                    }
                }
            }
            if spec_changed {
                let g = current["metadata"]["generation"].as_i64().unwrap_or(1);
                current["metadata"]["generation"] = (g + 1).into();
            }
            current["metadata"]["resourceVersion"] = rv.to_string().into();
            let owner = owner_of(&current, &key.namespace);
            if current["metadata"].get("deletionTimestamp").is_some_and(|d| !d.is_null()) && finalizers_empty(&current)
            {
                remove_row(tx, &key, rv, owner.as_ref())?;
                return Ok((None, Some(Effect { key: key.clone(), rv, json: None, owner, status_only: false })));
            }
            let body = serde_json::to_string(&current)?;
            replace_row(tx, &key, rv, &body)?;
            let json: Arc<str> = body.into();
            Ok((Some(json.clone()), Some(Effect { key: key.clone(), rv, json: Some(json), owner, status_only: false })))
        })
        .await
    }

    async fn replace_status(&self, kind: Kind, json: String) -> Result<Option<Arc<str>>> {
        use std::borrow::Cow;
        #[derive(serde::Deserialize)]
        struct Sent<'a> {
            #[serde(borrow)]
            metadata: SentMeta<'a>,
            #[serde(borrow, default)]
            status: Option<&'a RawValue>,
        }
        #[derive(serde::Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct SentMeta<'a> {
            #[serde(borrow)]
            name: Cow<'a, str>,
            #[serde(borrow, default)]
            namespace: Option<Cow<'a, str>>,
            #[serde(borrow, default)]
            resource_version: Option<Cow<'a, str>>,
        }
        // Only the name, version and status are read; the rest of what was sent is skipped.
        let sent: Sent<'_> = serde_json::from_str(&json)?;
        if sent.metadata.name.is_empty() {
            return Err(Error::Invalid("metadata.name is required".into()));
        }
        let key = Key::new(kind, sent.metadata.namespace.as_deref().unwrap_or("default"), &sent.metadata.name);
        if !kind.has_status() {
            return Err(Error::Invalid(format!("{key}: {kind}s have no status")));
        }
        let expected = required_version(&key, sent.metadata.resource_version.as_deref())?;
        let null = serde_json::value::to_raw_value(&Value::Null)?;
        self.write_status(key, expected, sent.status.unwrap_or(&null)).await
    }

    async fn delete(&self, key: &Key) -> Result<Option<Arc<str>>> {
        self.write(|tx, rv| {
            let Some((_, mut current)) = read_row(tx, key)? else { return Ok((None, None)) };
            let owner = owner_of(&current, &key.namespace);
            if finalizers_empty(&current) {
                remove_row(tx, key, rv, owner.as_ref())?;
                return Ok((None, Some(Effect { key: key.clone(), rv, json: None, owner, status_only: false })));
            }
            if current["metadata"].get("deletionTimestamp").is_none_or(Value::is_null) {
                current["metadata"]["deletionTimestamp"] = now().into();
            }
            current["metadata"]["resourceVersion"] = rv.to_string().into();
            let body = serde_json::to_string(&current)?;
            replace_row(tx, key, rv, &body)?;
            let json: Arc<str> = body.into();
            Ok((Some(json.clone()), Some(Effect { key: key.clone(), rv, json: Some(json), owner, status_only: false })))
        })
        .await
    }

    fn subscribe(&self) -> broadcast::Receiver<Change> {
        self.tx.subscribe()
    }

    async fn record_event(&self, e: Event) -> Result<()> {
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

    async fn events(&self, key: &Key, limit: usize) -> Result<Vec<Event>> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(code: std::ffi::c_int, message: &str) -> rusqlite::Error {
        rusqlite::Error::SqliteFailure(rusqlite::ffi::Error::new(code), Some(message.into()))
    }

    #[test]
    fn a_locked_database_is_unavailable_and_keeps_its_cause() {
        for (code, message) in
            [(rusqlite::ffi::SQLITE_BUSY, "database is locked"), (rusqlite::ffi::SQLITE_LOCKED, "table locked")]
        {
            let err = db_error(failure(code, message));
            assert!(err.is_transient(), "{err:?}");
            let chain = machine_driver_util::error_chain(&err);
            assert!(chain.starts_with("store unavailable: the store file is locked"), "{chain}");
            assert!(
                chain.contains(&format!("locked by another writer: {message}")),
                "the SQLite cause is kept: {chain}"
            );
        }
    }

    #[test]
    fn other_database_errors_are_backend_errors_with_their_cause() {
        let err = db_error(failure(rusqlite::ffi::SQLITE_CORRUPT, "database disk image is malformed"));
        assert!(matches!(err, Error::Backend { backend: "sqlite", .. }), "{err:?}");
        assert!(!err.is_transient());
        let chain = machine_driver_util::error_chain(&err);
        assert!(chain.starts_with("sqlite store error: database disk image is malformed"), "{chain}");
    }
}
