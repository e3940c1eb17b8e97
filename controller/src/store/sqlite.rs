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
//!
//! The parts, each in a file of its own: the tables and the migration of older files
//! (`sqlite/schema.rs`), the group-commit writer (`sqlite/writer.rs`), the poller that finds
//! other processes' writes (`sqlite/poller.rs`), rows read and written as objects
//! (`sqlite/rows.rs`), and events (`sqlite/events.rs`). This file holds the backend, its cache
//! and the [`Backend`] methods.

use machine_driver_util::lock;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use rusqlite::Connection;
use serde_json::value::RawValue;
use serde_json::Value;
use tokio::sync::broadcast;

use super::packed::Packed;
use super::{Backend, Change, Error, Event, Key, Result};
use crate::resources::Kind;

mod events;
mod poller;
mod rows;
mod schema;
mod writer;

use events::Series;
use rows::{
    finalizers_empty, insert_row, key_of, meta_str, owner_of, read_row, read_text, read_version, remove_row,
    replace_row, replace_row_at, spec_of, with_status,
};
use writer::{Effect, Writer};

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

/// Attempts at opening a new file while another process switches it to WAL, and the pause
/// between them: 100 × 50 ms, five seconds in all.
const OPEN_ATTEMPTS: u32 = 100;
/// See [`OPEN_ATTEMPTS`].
const OPEN_RETRY: Duration = Duration::from_millis(50);

/// The SQLite-backed store.
pub struct SqliteBackend {
    writer: Arc<Mutex<Writer>>,
    cache: Arc<RwLock<Cache>>,
    tx: broadcast::Sender<Change>,
    events_written: Mutex<u64>,
    series: Arc<Series>,
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
            match schema::connect(path) {
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

    fn from_connection(path: &Path, conn: Connection) -> Result<Self> {
        // One snapshot for both reads: another process's commit between them would count as
        // synced without being in the cache, and the poller, which looks above that version,
        // would never find it.
        let (cache, synced, synced_rv) = {
            let snapshot = conn.unchecked_transaction().db()?;
            let (cache, synced) = rows::load(&snapshot)?;
            let counter: i64 = snapshot.query_row("SELECT rv FROM counter WHERE id = 0", [], |r| r.get(0)).db()?;
            (cache, synced, counter)
        };
        let (tx, _) = broadcast::channel(CHANGES_BUFFERED);
        let backend = Self {
            writer: Arc::new(Mutex::new(Writer::new(conn))),
            cache: Arc::new(RwLock::new(cache)),
            tx,
            events_written: Mutex::new(0),
            series: Arc::default(),
        };
        backend.spawn_poller(path, synced_rv.max(synced as i64) as u64);
        Ok(backend)
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
}

impl Drop for SqliteBackend {
    fn drop(&mut self) {
        // The counts that grew since the poller last wrote them.
        let after_all = std::time::Instant::now() + super::series::SERIES_WINDOW * 2;
        if let Err(e) = events::write_series(&self.writer, &self.series, after_all) {
            tracing::warn!("store: writing event series counts: {}", machine_driver_util::error_chain(&e));
        }
    }
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

    async fn scan_with(
        &self,
        kind: Kind,
        visit: &mut (dyn for<'t> FnMut(&'t str) -> Result<()> + Send),
        unreadable: &mut (dyn FnMut(Key, serde_json::Error) -> Result<()> + Send),
    ) -> Result<()> {
        for packed in self.cached(kind) {
            match packed.read(|json| visit(json))? {
                // An object the visitor cannot parse is named (looked up only now: the listing
                // carries no keys, so that 10,000 of them are not copied for every scan). Not
                // in the cache any more, it changed or went since the listing.
                Err(Error::Json(source)) => {
                    if let Some(key) = self.key_of(kind, &packed) {
                        unreadable(key, source)?;
                    }
                }
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
            let mut current = match read_row(tx, key) {
                Ok(Some((_, current))) => current,
                Ok(None) => return Ok((None, None)),
                // A text that is not JSON has no finalizers anyone can read or remove: deleting
                // it is how it is repaired (then applied again).
                Err(Error::Unreadable { .. }) => {
                    remove_row(tx, key, rv, None)?;
                    return Ok((
                        None,
                        Some(Effect { key: key.clone(), rv, json: None, owner: None, status_only: false }),
                    ));
                }
                Err(e) => return Err(e),
            };
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
        self.record(e).await
    }

    async fn events(&self, key: &Key, limit: usize) -> Result<Vec<Event>> {
        self.read_events(key, limit)
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
