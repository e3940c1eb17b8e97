//! Rows and objects: an object's row (and the tombstone a removed one leaves) read and written,
//! what the store reads out of an object's JSON (its key, owner, spec and finalizers), a status
//! spliced into a stored text, and the rows packed into the cache when the file is opened.

use std::collections::{BTreeMap, HashMap};

use rusqlite::{params, Connection, OptionalExtension};
use serde_json::value::RawValue;
use serde_json::Value;

use super::{Cache, Db, Entry};
use crate::resources::Kind;
use crate::store::packed::Packed;
use crate::store::{Error, Key, Result};

/// The objects of the store file, packed for the cache, and the highest version among them.
pub(super) fn load(conn: &Connection) -> Result<(Cache, u64)> {
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
    Ok((cache, synced))
}

pub(super) fn kind_from(s: &str) -> Option<Kind> {
    Kind::from_name(s)
}

pub(super) fn owner_of(json: &Value, namespace: &str) -> Option<Key> {
    let refs = json.get("metadata")?.get("ownerReferences")?.as_array()?;
    let owner = refs.iter().find(|r| r.get("controller").and_then(Value::as_bool) == Some(true))?;
    let kind = kind_from(owner.get("kind")?.as_str()?)?;
    Some(Key::new(kind, namespace, owner.get("name")?.as_str()?))
}

pub(super) fn meta_str<'a>(v: &'a Value, field: &str) -> Option<&'a str> {
    v.get("metadata")?.get(field)?.as_str()
}

pub(super) fn key_of(kind: Kind, v: &Value) -> Result<Key> {
    let name = meta_str(v, "name")
        .filter(|n| !n.is_empty())
        .ok_or_else(|| Error::Invalid("metadata.name is required".into()))?;
    Ok(Key::new(kind, meta_str(v, "namespace").unwrap_or("default"), name))
}

pub(super) fn read_text(tx: &Connection, key: &Key) -> Result<Option<(u64, String)>> {
    let row: Option<(i64, String)> = tx
        .prepare_cached("SELECT rv, body FROM objects WHERE kind = ?1 AND namespace = ?2 AND name = ?3")
        .db()?
        .query_row(params![key.kind.as_str(), key.namespace, key.name], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()
        .db()?;
    Ok(row.map(|(rv, body)| (rv as u64, body)))
}

/// Only the stored version of `key` (the text stays in SQLite).
pub(super) fn read_version(tx: &Connection, key: &Key) -> Result<Option<u64>> {
    let rv: Option<i64> = tx
        .prepare_cached("SELECT rv FROM objects WHERE kind = ?1 AND namespace = ?2 AND name = ?3")
        .db()?
        .query_row(params![key.kind.as_str(), key.namespace, key.name], |r| r.get(0))
        .optional()
        .db()?;
    Ok(rv.map(|rv| rv as u64))
}

/// The stored version and object of `key`; [`Error::Unreadable`] when its text is not JSON (a
/// row edited by hand).
pub(super) fn read_row(tx: &Connection, key: &Key) -> Result<Option<(u64, Value)>> {
    match read_text(tx, key)? {
        Some((rv, body)) => match serde_json::from_str(&body) {
            Ok(v) => Ok(Some((rv, v))),
            Err(source) => Err(Error::Unreadable { key: key.clone(), source }),
        },
        None => Ok(None),
    }
}

/// A stored object with a new status and resourceVersion.
pub(super) struct StatusWritten {
    pub(super) body: String,
    pub(super) owner: Option<Key>,
    /// Being deleted with no finalizers left: the object goes.
    pub(super) remove: bool,
}

/// Puts `status` and `rv` into the stored `body`. The rest of the object is copied as the text
/// it was stored as, never parsed into values and printed again: status writes are most of the
/// store's writes, and that was most of their cost.
pub(super) fn with_status(body: &str, status: &RawValue, rv: u64, namespace: &str) -> Result<StatusWritten> {
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
pub(super) fn insert_row(tx: &Connection, key: &Key, rv: u64, body: &str) -> Result<()> {
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
pub(super) fn replace_row(tx: &Connection, key: &Key, rv: u64, body: &str) -> Result<()> {
    tx.prepare_cached("UPDATE objects SET rv = ?4, body = ?5 WHERE kind = ?1 AND namespace = ?2 AND name = ?3")
        .db()?
        .execute(params![key.kind.as_str(), key.namespace, key.name, rv as i64, body])
        .db()?;
    Ok(())
}

/// Stores a new version of an object if it is still at version `at`; whether it was.
pub(super) fn replace_row_at(tx: &Connection, key: &Key, at: u64, rv: u64, body: &str) -> Result<bool> {
    let changed = tx
        .prepare_cached(
            "UPDATE objects SET rv = ?5, body = ?6 WHERE kind = ?1 AND namespace = ?2 AND name = ?3 AND rv = ?4",
        )
        .db()?
        .execute(params![key.kind.as_str(), key.namespace, key.name, at as i64, rv as i64, body])
        .db()?;
    Ok(changed == 1)
}

pub(super) fn remove_row(tx: &Connection, key: &Key, rv: u64, owner: Option<&Key>) -> Result<()> {
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
pub(super) fn spec_of(kind: Kind, v: &Value) -> Value {
    kind.shape().spec_fields().iter().map(|f| v.get(*f).cloned().unwrap_or(Value::Null)).collect()
}

pub(super) fn finalizers_empty(v: &Value) -> bool {
    v.get("metadata").and_then(|m| m.get("finalizers")).and_then(Value::as_array).is_none_or(Vec::is_empty)
}
