//! The Kubernetes backend: MachineClass, MachineDeployment, MachinePool and Machine are custom
//! resources of `machine.driver.dev/v1alpha1` (see [`crate::crd`]); Secrets are core v1 Secrets.
//!
//! - Reads are served from a per-kind cache kept current by kube-runtime's watcher (a list, then a
//!   watch from the list's resourceVersion; re-listed after a watch error). A kind's cache starts
//!   on first use, and reads wait until its initial list is complete.
//! - Writes go to the API server (optimistic concurrency by `resourceVersion`: a stale write
//!   gets 409 → [`Error::Conflict`], and the cache is refreshed from the server so the retry sees
//!   the newest object). The object the server returns goes into the cache at once, so a
//!   reconciler reads its own writes.
//! - Status goes through the `status` subresource; deleting an object with finalizers sets its
//!   `deletionTimestamp`; removing the last finalizer lets the API server delete it.
//! - Metadata is trimmed to the fields the resource model knows: what a real API server adds
//!   (`managedFields`, …) never reaches parsing, nor the cache's memory.
//! - Events are posted as `events.k8s.io/v1` Events by a background task (a reconcile never
//!   waits for one), repeats aggregated into event series as client-go does (`kubernetes/events.rs`), and
//!   read back for `describe`.

use machine_driver_util::lock;
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::StreamExt;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::{watcher, WatchStreamExt};
use serde_json::{Map, Value};
use tokio::sync::{broadcast, mpsc, watch, OnceCell};

use super::packed::Packed;
use super::{Backend, Change, Error, Event, Key, Result};
use crate::resources::Kind;

mod events;

/// The `User-Agent` of every request the controller sends to an API server (the store's, leader
/// election's, the target cluster's): an audit log names the controller and its version.
pub const USER_AGENT: &str = concat!("machine-controller/", env!("CARGO_PKG_VERSION"));

/// Sends [`USER_AGENT`] with every request of clients built from `config` (kube's client sends
/// none of its own).
pub fn identify(config: &mut kube::Config) {
    config.headers.retain(|(name, _)| name != http::header::USER_AGENT);
    config.headers.push((http::header::USER_AGENT, http::HeaderValue::from_static(USER_AGENT)));
}

/// A client of the API server `config` names, identified by [`USER_AGENT`].
///
/// # Errors
/// A configuration the client refuses.
pub fn client(mut config: kube::Config) -> std::result::Result<kube::Client, kube::Error> {
    identify(&mut config);
    kube::Client::try_from(config)
}

/// How long a read waits for a kind's initial list.
const SYNC_TIMEOUT: Duration = Duration::from_secs(60);
/// Deletions remembered per kind (so a write's late echo cannot resurrect an object) before they
/// are forgotten at once; a relist clears them anyway.
const MAX_TOMBSTONES: usize = 100_000;
/// Change notifications buffered for a slow subscriber before it lags (and relists).
const CHANGES_BUFFERED: usize = 1 << 13;
/// Events waiting to be posted; beyond it new events are dropped, never the reconciles.
const EVENTS_BUFFERED: usize = 4096;

#[derive(Clone)]
struct Cached {
    rv: u64,
    /// The object's text, compressed (`store/packed.rs`).
    json: Packed,
    /// This process wrote this version through `/status`: its watch echo is a status-only change.
    status_write: bool,
}

struct KindCache {
    objects: RwLock<HashMap<Key, Cached>>,
    /// resourceVersions of deletions seen, so a write's late echo cannot resurrect an object.
    tombstones: RwLock<HashMap<Key, u64>>,
    synced: watch::Sender<bool>,
    /// Why the initial list cannot succeed (no CRD, not allowed): reads fail fast with it.
    refused: watch::Sender<Option<String>>,
    started: OnceCell<()>,
}

impl KindCache {
    fn new() -> Self {
        Self {
            objects: RwLock::new(HashMap::new()),
            tombstones: RwLock::new(HashMap::new()),
            synced: watch::channel(false).0,
            refused: watch::channel(None).0,
            started: OnceCell::new(),
        }
    }

    /// Stores `cached` unless the cache holds a newer version or saw a newer deletion.
    fn put(&self, key: &Key, cached: Cached) {
        let mut objects = lock_write(&self.objects);
        let newer_held = objects.get(key).is_some_and(|c| c.rv != u64::MAX && c.rv > cached.rv);
        let deleted_after = lock_read(&self.tombstones).get(key).is_some_and(|rv| *rv >= cached.rv);
        if !newer_held && !deleted_after {
            objects.insert(key.clone(), cached);
        }
    }

    /// Removes `key`; `rv` is the deletion's resourceVersion when a watch reported it.
    fn remove(&self, key: &Key, rv: Option<u64>) {
        lock_write(&self.objects).remove(key);
        if let Some(rv) = rv {
            let mut t = lock_write(&self.tombstones);
            // Bounded: a relist (InitDone) clears them anyway.
            if t.len() >= MAX_TOMBSTONES {
                t.clear();
            }
            t.insert(key.clone(), rv);
        }
    }
}

/// Objects on a Kubernetes API server.
pub struct KubernetesBackend {
    client: kube::Client,
    namespace: Option<String>,
    caches: HashMap<Kind, Arc<KindCache>>,
    tx: broadcast::Sender<Change>,
    events: mpsc::Sender<(Event, String)>,
    /// The kinds' watch tasks, stopped when the backend goes.
    watches: std::sync::Mutex<Vec<tokio::task::AbortHandle>>,
    /// Secrets are read one by one, by name, as classes name them (never listed or watched:
    /// the controller needs only `get`, and holds only the Secrets its classes use), each
    /// answer kept for [`SECRET_FRESH`].
    secrets: std::sync::Mutex<HashMap<Key, ReadSecret>>,
}

/// A Secret read by name: when, and what it was (`None`: not found).
type ReadSecret = (std::time::Instant, Option<Arc<str>>);

/// How long a Secret read by name is used before it is read again: a rotated credential is
/// used within this long.
const SECRET_FRESH: std::time::Duration = std::time::Duration::from_secs(10);

impl Drop for KubernetesBackend {
    fn drop(&mut self) {
        for task in self.watches.get_mut().unwrap_or_else(|p| p.into_inner()).drain(..) {
            task.abort();
        }
    }
}

fn api_resource(kind: Kind) -> ApiResource {
    let (group, version) = kind.api_version().rsplit_once('/').unwrap_or(("", kind.api_version()));
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind.as_str()), kind.plural())
}

fn lock_read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|p| p.into_inner())
}

fn lock_write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|p| p.into_inner())
}

/// A resourceVersion as a number, for "is this newer" checks (etcd revisions are numbers;
/// anything else counts as newest so it is never ignored).
fn rv_number(rv: Option<&str>) -> u64 {
    rv.and_then(|s| s.parse().ok()).unwrap_or(u64::MAX)
}

/// Keeps the fields of the resource model and drops what the API server adds.
fn normalize(kind: Kind, obj: Value) -> Option<(Key, Cached, Value)> {
    let (key, rv, text, out) = normalize_text(kind, obj)?;
    Some((key, Cached { rv, json: Packed::new(&text), status_write: false }, out))
}

/// An object as the API server returns it (a watch event's, a `kubectl get -o json`'s), trimmed
/// to what the resource model reads: what the store keeps of it, ready to parse as `kind`.
pub fn trimmed(kind: Kind, obj: Value) -> Option<Value> {
    normalize_text(kind, obj).map(|(_, _, _, value)| value)
}

/// [`normalize`]'s object as its key, resourceVersion, text and value, before it is packed.
fn normalize_text(kind: Kind, obj: Value) -> Option<(Key, u64, String, Value)> {
    let Value::Object(mut o) = obj else { return None };
    let meta = match o.remove("metadata") {
        Some(Value::Object(m)) => m,
        _ => return None,
    };
    let mut m = Map::new();
    for field in [
        "name",
        "namespace",
        "uid",
        "resourceVersion",
        "generation",
        "creationTimestamp",
        "deletionTimestamp",
        "labels",
        "annotations",
        "finalizers",
    ] {
        if let Some(v) = meta.get(field) {
            if !v.is_null() {
                m.insert(field.into(), v.clone());
            }
        }
    }
    if let Some(Value::Array(refs)) = meta.get("ownerReferences") {
        let refs: Vec<Value> = refs
            .iter()
            .map(|r| {
                let mut keep = Map::new();
                for f in ["apiVersion", "kind", "name", "uid", "controller"] {
                    if let Some(v) = r.get(f) {
                        keep.insert(f.into(), v.clone());
                    }
                }
                Value::Object(keep)
            })
            .collect();
        m.insert("ownerReferences".into(), Value::Array(refs));
    }
    let name = m.get("name")?.as_str()?.to_string();
    let namespace = m.get("namespace").and_then(Value::as_str).unwrap_or("default").to_string();
    let rv = rv_number(m.get("resourceVersion").and_then(Value::as_str));
    let mut out = Map::new();
    out.insert("apiVersion".into(), Value::String(kind.api_version().into()));
    out.insert("kind".into(), Value::String(kind.as_str().into()));
    out.insert("metadata".into(), Value::Object(m));
    for f in kind.shape().fields() {
        if let Some(v) = o.remove(*f) {
            if !v.is_null() {
                out.insert((*f).into(), v);
            }
        }
    }
    let out = Value::Object(out);
    let text = serde_json::to_string(&out).ok()?;
    Some((Key::new(kind, &namespace, &name), rv, text, out))
}

fn owner_of(v: &Value, namespace: &str) -> Option<Key> {
    let refs = v.get("metadata")?.get("ownerReferences")?.as_array()?;
    let owner = refs.iter().find(|r| r.get("controller").and_then(Value::as_bool) == Some(true))?;
    let kind = Kind::from_name(owner.get("kind")?.as_str()?)?;
    Some(Key::new(kind, namespace, owner.get("name")?.as_str()?))
}

fn is_gone(v: &Value) -> bool {
    let meta = &v["metadata"];
    !meta["deletionTimestamp"].is_null() && meta["finalizers"].as_array().is_none_or(|f| f.is_empty())
}

/// The API server's answer as a store error: 404, 409 (AlreadyExists or Conflict), 400 and 422
/// by meaning; 429, 5xx, 410 (a watch or list too old: read again) and failed connections as
/// [`Error::Unavailable`]; anything else (401, 403, a bad configuration) as [`Error::Backend`]. The
/// kube error stays the source, so the cause chain keeps the server's message.
fn map_err(e: kube::Error, key: &Key, expected: &str) -> Error {
    match &e {
        kube::Error::Api(s) if s.is_not_found() => Error::NotFound(key.clone()),
        kube::Error::Api(s) if s.is_already_exists() => Error::AlreadyExists(key.clone()),
        kube::Error::Api(s) if s.is_conflict() => {
            Error::Conflict { key: key.clone(), expected: expected.to_string(), actual: "a newer one".into() }
        }
        kube::Error::Api(s) if s.is_invalid() || s.code == 400 => Error::Invalid(s.message.clone()),
        kube::Error::Api(s) if s.code == 429 || s.code == 410 || s.code >= 500 => Error::Unavailable {
            reason: format!("the API server answered {} for {key}", s.code),
            source: Some(e.into()),
        },
        kube::Error::HyperError(_) | kube::Error::Service(_) => Error::Unavailable {
            reason: format!("the API server could not be reached for {key}"),
            source: Some(e.into()),
        },
        _ => Error::backend("kubernetes", e),
    }
}

impl KubernetesBackend {
    /// A Secret by name ([`SECRET_FRESH`]).
    async fn secret(&self, key: &Key) -> Result<Option<Arc<str>>> {
        if let Some((at, text)) = lock(&self.secrets).get(key) {
            if at.elapsed() < SECRET_FRESH {
                return Ok(text.clone());
            }
        }
        let found = self.api(Kind::Secret, &key.namespace).get_opt(&key.name).await.map_err(|e| map_err(e, key, ""))?;
        let text = match found.as_ref().and_then(|o| to_value(Kind::Secret, o)) {
            Some((_, cached, _)) => Some(cached.json.text()?),
            None => None,
        };
        let mut held = lock(&self.secrets);
        // Only the Secrets in use are held: those not asked for in a while are dropped.
        held.retain(|_, (at, _)| at.elapsed() < SECRET_FRESH * 6);
        held.insert(key.clone(), (std::time::Instant::now(), text.clone()));
        Ok(text)
    }

    /// A backend over `client`, which the caller built (see [`super::StoreSpec::kube_client`]) and
    /// may share. `namespace` restricts watches to one namespace (`None`: all namespaces). Must
    /// be called within a Tokio runtime (it spawns the event poster; watches start on first use).
    /// Dropping the backend stops its watches.
    pub fn new(client: kube::Client, namespace: Option<String>) -> Self {
        let caches = Kind::ALL.iter().map(|k| (*k, Arc::new(KindCache::new()))).collect();
        // Bounded: a subscriber that falls behind gets `Lagged` and resyncs everything, so the
        // ring only needs to absorb bursts (each slot is preallocated and keeps its last value).
        let (tx, _) = broadcast::channel(CHANGES_BUFFERED);
        let (events, rx) = mpsc::channel(EVENTS_BUFFERED);
        let backend =
            Self { client, namespace, caches, tx, events, watches: Default::default(), secrets: Default::default() };
        tokio::spawn(events::post(backend.client.clone(), rx));
        backend
    }

    fn api(&self, kind: Kind, namespace: &str) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), namespace, &api_resource(kind))
    }

    /// A kind's cached objects (shared, not copied), in key order.
    fn sorted(cache: &KindCache) -> Vec<Packed> {
        let objects = lock_read(&cache.objects);
        let mut keyed: Vec<(&Key, &Cached)> = objects.iter().collect();
        keyed.sort_by(|a, b| a.0.cmp(b.0));
        keyed.into_iter().map(|(_, c)| c.json.clone()).collect()
    }

    fn cache(&self, kind: Kind) -> &Arc<KindCache> {
        // Every kind has a cache (built from Kind::ALL in `new`).
        &self.caches[&kind]
    }

    /// The kind's cache, started on first use and fully listed.
    async fn synced(&self, kind: Kind) -> Result<&Arc<KindCache>> {
        let cache = self.cache(kind);
        cache
            .started
            .get_or_init(|| async {
                let api: Api<DynamicObject> = match &self.namespace {
                    Some(ns) => Api::namespaced_with(self.client.clone(), ns, &api_resource(kind)),
                    None => Api::all_with(self.client.clone(), &api_resource(kind)),
                };
                let task = tokio::spawn(watch_kind(api, kind, cache.clone(), self.tx.clone()));
                lock(&self.watches).push(task.abort_handle());
            })
            .await;
        let (mut synced, mut refused) = (cache.synced.subscribe(), cache.refused.subscribe());
        let outcome = tokio::time::timeout(SYNC_TIMEOUT, async {
            tokio::select! {
                _ = synced.wait_for(|s| *s) => None,
                r = refused.wait_for(|r| r.is_some()) => r.ok().and_then(|r| r.clone()),
            }
        })
        .await;
        let plural = kind.plural();
        match outcome {
            Ok(None) if *cache.synced.borrow() => Ok(cache),
            Ok(Some(why)) => Err(Error::unavailable(format!("listing {plural}: {why}"))),
            _ => Err(Error::unavailable(format!(
                "the initial list of {plural} did not complete within {SYNC_TIMEOUT:?} (is the API server reachable?)"
            ))),
        }
    }

    /// Puts an object the server returned into the cache (unless the cache already has a newer
    /// one) and returns its JSON.
    fn remember(&self, kind: Kind, obj: &DynamicObject) -> Result<(Key, Arc<str>)> {
        self.remember_write(kind, obj, false)
    }

    /// Caches what a write returned; `status_write` when it went through `/status`.
    fn remember_write(&self, kind: Kind, obj: &DynamicObject, status_write: bool) -> Result<(Key, Arc<str>)> {
        let v = serde_json::to_value(obj)?;
        let (key, rv, text, _) = normalize_text(kind, v)
            .ok_or_else(|| Error::Invalid("the API server returned an object without a name".into()))?;
        self.cache(kind).put(&key, Cached { rv, json: Packed::new(&text), status_write });
        Ok((key, text.into()))
    }

    /// Drops an object this handle learnt is gone; late echoes of the versions it held cannot
    /// bring it back.
    fn forget(&self, key: &Key) {
        let cache = self.cache(key.kind);
        let held = lock_read(&cache.objects).get(key).map(|c| c.rv).filter(|rv| *rv != u64::MAX);
        cache.remove(key, held);
    }

    /// `PUT`s the object, or its `/status` when `status`; see [`Backend::update`].
    async fn replace(&self, kind: Kind, obj: Value, status: bool) -> Result<Option<Arc<str>>> {
        let key = key_of(kind, &obj)?;
        let rv = obj["metadata"]["resourceVersion"].as_str().unwrap_or_default().to_string();
        if rv.is_empty() {
            return Err(Error::Invalid(format!("{key}: an update must carry the resourceVersion it read")));
        }
        self.synced(kind).await?;
        let api = self.api(kind, &key.namespace);
        let dynamic = to_dynamic(kind, obj)?;
        let result = if status {
            api.replace_status(&key.name, &PostParams::default(), &dynamic).await
        } else {
            api.replace(&key.name, &PostParams::default(), &dynamic).await
        };
        match result {
            Ok(o) => {
                let (_, json) = self.remember_write(kind, &o, status)?;
                if is_gone(&serde_json::to_value(&o)?) {
                    // The last finalizer went: the API server deletes the object now. Echoes of
                    // this version or older must not bring it back into the cache.
                    let gone_at = rv_number(o.metadata.resource_version.as_deref());
                    self.cache(kind).remove(&key, Some(gone_at));
                    return Ok(None);
                }
                Ok(Some(json))
            }
            Err(e) => {
                let err = map_err(e, &key, &rv);
                match err {
                    Error::Conflict { .. } => self.refresh(&key).await,
                    Error::NotFound(_) => self.forget(&key),
                    _ => {}
                }
                Err(err)
            }
        }
    }

    /// Reads the object from the server into the cache (after a conflict: the retry then starts
    /// from the newest version instead of waiting for the watch).
    async fn refresh(&self, key: &Key) {
        match self.api(key.kind, &key.namespace).get_opt(&key.name).await {
            Ok(Some(o)) => {
                let _ = self.remember(key.kind, &o);
            }
            Ok(None) => self.forget(key),
            Err(e) => tracing::debug!(object = %key, "refreshing after a conflict: {e}"),
        }
    }
}

fn key_of(kind: Kind, v: &Value) -> Result<Key> {
    let meta = v.get("metadata").ok_or_else(|| Error::Invalid("metadata is missing".into()))?;
    let name = meta.get("name").and_then(Value::as_str).filter(|n| !n.is_empty());
    let name = name.ok_or_else(|| Error::Invalid("metadata.name is missing".into()))?;
    let namespace = meta.get("namespace").and_then(Value::as_str).unwrap_or("default");
    Ok(Key::new(kind, namespace, name))
}

fn to_dynamic(kind: Kind, mut v: Value) -> Result<DynamicObject> {
    v["apiVersion"] = Value::String(kind.api_version().into());
    v["kind"] = Value::String(kind.as_str().into());
    Ok(serde_json::from_value(v)?)
}

#[async_trait::async_trait]
impl Backend for KubernetesBackend {
    fn api_client(&self) -> Option<kube::Client> {
        Some(self.client.clone())
    }

    async fn get(&self, key: &Key) -> Result<Option<Arc<str>>> {
        if key.kind == Kind::Secret {
            return self.secret(key).await;
        }
        let cache = self.synced(key.kind).await?;
        let packed = lock_read(&cache.objects).get(key).map(|c| c.json.clone());
        packed.map(|p| p.text()).transpose()
    }

    async fn list(&self, kind: Kind) -> Result<Vec<Arc<str>>> {
        let cache = self.synced(kind).await?;
        Self::sorted(cache).iter().map(Packed::text).collect()
    }

    async fn scan_with(
        &self,
        kind: Kind,
        visit: &mut (dyn for<'t> FnMut(&'t str) -> Result<()> + Send),
        unreadable: &mut (dyn FnMut(Key, serde_json::Error) -> Result<()> + Send),
    ) -> Result<()> {
        let cache = self.synced(kind).await?;
        for packed in Self::sorted(cache) {
            match packed.read(|json| visit(json))? {
                // An object the visitor cannot parse is named (looked up only now, as SQLite
                // does). Not in the cache any more, it changed or went since the listing.
                Err(Error::Json(source)) => {
                    let key =
                        lock_read(&cache.objects).iter().find(|(_, c)| c.json.same(&packed)).map(|(k, _)| k.clone());
                    if let Some(key) = key {
                        unreadable(key, source)?;
                    }
                }
                other => other?,
            }
        }
        Ok(())
    }

    async fn count(&self, kind: Kind) -> Option<usize> {
        let cache = self.synced(kind).await.ok()?;
        Some(lock_read(&cache.objects).len())
    }

    async fn keys(&self, kind: Kind) -> Result<Vec<Key>> {
        let cache = self.synced(kind).await?;
        let mut keys: Vec<Key> = lock_read(&cache.objects).keys().cloned().collect();
        keys.sort();
        Ok(keys)
    }

    async fn create(&self, kind: Kind, mut obj: Value) -> Result<Arc<str>> {
        let key = key_of(kind, &obj)?;
        self.synced(kind).await?;
        if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
            for f in ["uid", "resourceVersion", "generation", "creationTimestamp", "deletionTimestamp"] {
                meta.remove(f);
            }
            meta.insert("namespace".into(), Value::String(key.namespace.clone()));
        }
        // The status subresource ignores status on create: write it separately.
        let status = match obj.as_object_mut().and_then(|o| o.remove("status")) {
            Some(Value::Object(s)) if !s.is_empty() && kind.has_status() => Some(Value::Object(s)),
            _ => None,
        };
        let api = self.api(kind, &key.namespace);
        let created =
            api.create(&PostParams::default(), &to_dynamic(kind, obj)?).await.map_err(|e| map_err(e, &key, ""))?;
        let (_, mut json) = self.remember(kind, &created)?;
        if let Some(status) = status {
            let mut with: Value = serde_json::from_str(&json)?;
            with["status"] = status;
            let rv = with["metadata"]["resourceVersion"].as_str().unwrap_or_default().to_string();
            let updated = api
                .replace_status(&key.name, &PostParams::default(), &to_dynamic(kind, with)?)
                .await
                .map_err(|e| map_err(e, &key, &rv))?;
            json = self.remember(kind, &updated)?.1;
        }
        Ok(json)
    }

    async fn update(&self, kind: Kind, obj: Value) -> Result<Option<Arc<str>>> {
        self.replace(kind, obj, false).await
    }

    async fn replace_status(&self, kind: Kind, json: String) -> Result<Option<Arc<str>>> {
        if !kind.has_status() {
            return Err(Error::Invalid(format!("{kind}s have no status")));
        }
        self.replace(kind, serde_json::from_str(&json)?, true).await
    }

    async fn delete(&self, key: &Key) -> Result<Option<Arc<str>>> {
        self.synced(key.kind).await?;
        match self.api(key.kind, &key.namespace).delete(&key.name, &DeleteParams::background()).await {
            Ok(either::Either::Left(o)) => {
                let (_, json) = self.remember(key.kind, &o)?;
                Ok(Some(json))
            }
            Ok(either::Either::Right(_)) => {
                self.forget(key);
                Ok(None)
            }
            Err(kube::Error::Api(s)) if s.is_not_found() => {
                self.forget(key);
                Ok(None)
            }
            Err(e) => Err(map_err(e, key, "")),
        }
    }

    fn subscribe(&self) -> broadcast::Receiver<Change> {
        self.tx.subscribe()
    }

    async fn record_event(&self, event: Event) -> Result<()> {
        // The uid lets `kubectl describe` find the event; the cache has it without a request.
        let mut uid = String::new();
        let packed = lock_read(&self.cache(event.key.kind).objects).get(&event.key).map(|c| c.json.clone());
        if let Some(packed) = packed {
            let v: Value = serde_json::from_str(&packed.text()?)?;
            uid = v["metadata"]["uid"].as_str().unwrap_or_default().to_string();
        }
        if self.events.try_send((event, uid)).is_err() {
            tracing::debug!("event queue full; an event was dropped");
        }
        Ok(())
    }

    async fn events(&self, key: &Key, limit: usize) -> Result<Vec<Event>> {
        // events.k8s.io/v1 and core/v1 Events are one resource; core/v1 has the field selectors.
        let api: Api<DynamicObject> = Api::namespaced_with(
            self.client.clone(),
            &key.namespace,
            &ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("", "v1", "Event"), "events"),
        );
        let selector = format!("involvedObject.kind={},involvedObject.name={}", key.kind.as_str(), key.name);
        let list = api.list(&ListParams::default().fields(&selector)).await.map_err(|e| map_err(e, key, ""))?;
        let mut out: Vec<Event> = list
            .items
            .iter()
            .filter_map(|e| {
                let d = &e.data;
                let series = d.get("series");
                let time = series
                    .and_then(|s| s.get("lastObservedTime"))
                    .into_iter()
                    .chain(["eventTime", "lastTimestamp", "firstTimestamp"].iter().filter_map(|f| d.get(*f)))
                    .find_map(|t| t.as_str().and_then(|s| s.parse().ok()))
                    .or(e.metadata.creation_timestamp.as_ref().and_then(|t| t.0.to_string().parse().ok()))?;
                let mut message: String = d.get("message").and_then(Value::as_str).unwrap_or_default().into();
                // A series is one Event standing for many (kubectl shows "x5 over 3m").
                if let Some(n) = series.and_then(|s| s.get("count")).and_then(Value::as_u64).filter(|n| *n > 1) {
                    message.push_str(&format!(" (x{n})"));
                }
                Some(Event {
                    key: key.clone(),
                    event_type: d.get("type").and_then(Value::as_str).unwrap_or("Normal").into(),
                    reason: d.get("reason").and_then(Value::as_str).unwrap_or_default().into(),
                    message,
                    time,
                })
            })
            .collect();
        out.sort_by_key(|e| e.time);
        let skip = out.len().saturating_sub(limit);
        Ok(out.split_off(skip))
    }
}

/// Keeps one kind's cache current and turns what the watch sees into change notifications.
async fn watch_kind(api: Api<DynamicObject>, kind: Kind, cache: Arc<KindCache>, tx: broadcast::Sender<Change>) {
    let mut stream = watcher(api, watcher::Config::default()).default_backoff().boxed();
    let mut buffer: Option<HashMap<Key, (Cached, Option<Key>)>> = None;
    while let Some(event) = stream.next().await {
        match event {
            Ok(watcher::Event::Init) => buffer = Some(HashMap::new()),
            Ok(watcher::Event::InitApply(o)) => {
                if let (Some(b), Some((key, cached, v))) = (buffer.as_mut(), to_value(kind, &o)) {
                    let owner = owner_of(&v, &key.namespace);
                    b.insert(key, (cached, owner));
                }
            }
            Ok(watcher::Event::InitDone) => {
                let fresh = buffer.take().unwrap_or_default();
                let mut changes = Vec::new();
                {
                    let mut objects = lock_write(&cache.objects);
                    for (key, c) in objects.iter() {
                        if !fresh.contains_key(key) {
                            changes.push(Change { key: key.clone(), owner: None, deleted: true, status_only: false });
                        } else if fresh[key].0.rv != c.rv {
                            let owner = fresh[key].1.clone();
                            changes.push(Change { key: key.clone(), owner, deleted: false, status_only: false });
                        }
                    }
                    for (key, (_, owner)) in &fresh {
                        if !objects.contains_key(key) {
                            let owner = owner.clone();
                            changes.push(Change { key: key.clone(), owner, deleted: false, status_only: false });
                        }
                    }
                    *objects = fresh.into_iter().map(|(k, (c, _))| (k, c)).collect();
                    lock_write(&cache.tombstones).clear();
                }
                cache.synced.send_replace(true);
                cache.refused.send_replace(None);
                for c in changes {
                    let _ = tx.send(c);
                }
            }
            Ok(watcher::Event::Apply(o)) => {
                if let Some((key, cached, v)) = to_value(kind, &o) {
                    let owner = owner_of(&v, &key.namespace);
                    // The echo of this process's own write says what that write was; a newer
                    // version is compared with the one held.
                    let status_only = match lock_read(&cache.objects).get(&key) {
                        Some(held) if held.rv == cached.rv => held.status_write,
                        Some(held) if held.rv < cached.rv => matches!(
                            held.json.read(|held| serde_json::from_str::<Value>(held)),
                            Ok(Ok(held)) if super::status_only_change(&held, &v)
                        ),
                        _ => false,
                    };
                    cache.put(&key, cached);
                    let _ = tx.send(Change { key, owner, deleted: false, status_only });
                }
            }
            Ok(watcher::Event::Delete(o)) => {
                if let Some((key, cached, v)) = to_value(kind, &o) {
                    let owner = owner_of(&v, &key.namespace);
                    cache.remove(&key, Some(cached.rv));
                    let _ = tx.send(Change { key, owner, deleted: true, status_only: false });
                }
            }
            Err(e) => {
                tracing::warn!(kind = %kind, "watching {}: {e}", kind.plural());
                if let watcher::Error::InitialListFailed(kube::Error::Api(s)) = &e {
                    let why = match s.code {
                        404 => Some(format!(
                            "the API server does not serve them (are the CRDs installed? \
                             `machine-controller crds | kubectl apply -f -`): {}",
                            s.message
                        )),
                        401 | 403 => Some(format!("not allowed: {}", s.message)),
                        _ => None,
                    };
                    if why.is_some() && !*cache.synced.borrow() {
                        cache.refused.send_replace(why);
                    }
                }
            }
        }
    }
}

fn to_value(kind: Kind, o: &DynamicObject) -> Option<(Key, Cached, Value)> {
    normalize(kind, serde_json::to_value(o).ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_never_goes_back_in_time() {
        let cache = KindCache::new();
        let key = Key::new(Kind::Machine, "ns", "m");
        let v = |rv: u64| Cached { rv, json: Packed::new(&format!("{rv}")), status_write: false };
        let held = |cache: &KindCache| lock_read(&cache.objects)[&key].json.text().unwrap();
        cache.put(&key, v(5));
        cache.put(&key, v(4)); // a late echo of an older write
        assert_eq!(&*held(&cache), "5");
        cache.remove(&key, Some(7)); // deleted at 7
        cache.put(&key, v(6)); // an older write's echo arriving after the deletion
        assert!(lock_read(&cache.objects).get(&key).is_none());
        cache.put(&key, v(9)); // re-created under the same name
        assert_eq!(&*held(&cache), "9");
    }

    #[test]
    fn api_answers_map_to_store_errors_by_meaning() {
        let key = Key::new(Kind::Machine, "ns", "m");
        let api = |code: u16, reason: &str| {
            kube::Error::Api(
                kube::core::Status::failure(&format!("the server says {code}"), reason).with_code(code).boxed(),
            )
        };
        assert!(matches!(map_err(api(404, "NotFound"), &key, "1"), Error::NotFound(k) if k == key));
        assert!(matches!(map_err(api(409, "AlreadyExists"), &key, "1"), Error::AlreadyExists(_)));
        assert!(
            matches!(map_err(api(409, "Conflict"), &key, "1"), Error::Conflict { expected, .. } if expected == "1")
        );
        assert!(matches!(map_err(api(422, "Invalid"), &key, "1"), Error::Invalid(m) if m == "the server says 422"));
        for code in [410, 429, 500, 503, 504] {
            let err = map_err(api(code, "ServiceUnavailable"), &key, "1");
            assert!(err.is_transient(), "{code}: {err:?}");
            let chain = machine_driver_util::error_chain(&err);
            assert!(chain.starts_with(&format!("store unavailable: the API server answered {code} for")), "{chain}");
            assert!(chain.contains(&format!("the server says {code}")), "the server's message is kept: {chain}");
        }
        for code in [401, 403] {
            let err = map_err(api(code, "Forbidden"), &key, "1");
            assert!(matches!(err, Error::Backend { backend: "kubernetes", .. }), "{code}: {err:?}");
            assert!(!err.is_transient());
            assert!(machine_driver_util::error_chain(&err).contains(&format!("the server says {code}")));
        }
    }

    #[test]
    fn normalize_drops_server_fields() {
        let v = serde_json::json!({
            "apiVersion": "machine.driver.dev/v1alpha1", "kind": "Machine",
            "metadata": {
                "name": "m", "namespace": "ns", "uid": "u", "resourceVersion": "42", "generation": 2,
                "managedFields": [{"manager": "kubectl"}], "selfLink": "x",
                "ownerReferences": [{"apiVersion": "a", "kind": "MachineDeployment", "name": "md", "uid": "1",
                                     "controller": true, "blockOwnerDeletion": true}]
            },
            "spec": {"classRef": {"name": "c"}},
            "status": {"phase": "Running"},
            "extra": 1
        });
        let (key, cached, out) = normalize(Kind::Machine, v).unwrap();
        assert_eq!(key, Key::new(Kind::Machine, "ns", "m"));
        assert_eq!(cached.rv, 42);
        assert!(out["metadata"].get("managedFields").is_none());
        assert!(out.get("extra").is_none());
        assert!(out["metadata"]["ownerReferences"][0].get("blockOwnerDeletion").is_none());
        assert_eq!(owner_of(&out, "ns"), Some(Key::new(Kind::MachineDeployment, "ns", "md")));
        let m: crate::resources::Machine = serde_json::from_str(&cached.json.text().unwrap()).unwrap();
        assert_eq!(m.status.phase, crate::resources::Phase::Running);
    }
}
