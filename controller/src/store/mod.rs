//! Object storage behind one narrow trait ([`Backend`]), with a typed wrapper ([`Store`]).
//!
//! The embedded backend ([`sqlite::SqliteBackend`]) is the default: one SQLite file in WAL mode,
//! no server, durable across `kill -9`, optimistic concurrency by `resourceVersion`, and change
//! notifications (including changes other processes — e.g. `machine-controller apply` — make).
//! The Kubernetes backend ([`kubernetes::KubernetesBackend`]) implements the same trait with
//! custom resources on an API server; reconcilers never know which runs. [`StoreSpec`] is the
//! `--store` choice between them.

use machine_driver_util::lock;
use std::sync::Arc;

use serde_json::Value;
use tokio::sync::broadcast;

use crate::events::{EventReason, EventType};
use crate::resources::{Kind, ObjectMeta, Resource, Time};

// The contract's cases, for a backend's own tests: only with the `test-util` feature (and in
// this crate's tests), so the controller binary carries none of it.
#[cfg(any(test, feature = "test-util"))]
pub mod conformance;
pub mod kubernetes;
mod packed;
mod series;
pub mod sqlite;

/// Identifies an object.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    /// Each kind has its own names: a Machine and a MachineDeployment may share one.
    pub kind: Kind,
    /// `default` when a manifest names none.
    pub namespace: String,
    /// Unique per kind and namespace.
    pub name: String,
}

impl Key {
    /// The key of `kind` `namespace/name`; [`Key::of`] takes them from an object.
    pub fn new(kind: Kind, namespace: &str, name: &str) -> Self {
        Self { kind, namespace: namespace.into(), name: name.into() }
    }

    /// The key of a typed object.
    pub fn of<T: Resource>(obj: &T) -> Self {
        Self::new(T::KIND, &obj.meta().namespace, &obj.meta().name)
    }
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}/{}", self.kind, self.namespace, self.name)
    }
}

/// Something changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// The object that changed.
    pub key: Key,
    /// Its controlling owner, so the owner can be reconciled too.
    pub owner: Option<Key>,
    /// Whether it is gone.
    pub deleted: bool,
    /// Only its status changed (metadata other than `resourceVersion`, and spec, did not). Its
    /// own reconciler wrote that status and already said when to run next, so the runtime does
    /// not run it again for this change; its owner still hears of it.
    pub status_only: bool,
}

/// Whether `new` differs from `old` in its status alone (and its `resourceVersion`).
pub(crate) fn status_only_change(old: &Value, new: &Value) -> bool {
    /// Equal objects apart from the fields `skip` names (neither need have them).
    fn equal_but(a: &Value, b: &Value, skip: &[&str]) -> bool {
        let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else { return false };
        let kept = |o: &serde_json::Map<String, Value>| o.keys().filter(|k| !skip.contains(&k.as_str())).count();
        kept(a) == kept(b) && a.iter().all(|(k, v)| skip.contains(&k.as_str()) || b.get(k) == Some(v))
    }
    equal_but(old, new, &["status", "metadata"])
        && match (old.get("metadata"), new.get("metadata")) {
            (Some(a), Some(b)) => equal_but(a, b, &["resourceVersion"]),
            _ => false,
        }
}

/// An event recorded against an object (shown by `describe`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Event {
    /// The object.
    #[serde(skip)]
    pub key: Key,
    /// `Normal` or `Warning` ([`EventType::as_str`]).
    #[serde(rename = "type")]
    pub event_type: String,
    /// UpperCamel reason ([`EventReason::as_str`]; a String, as a backend reads it back).
    pub reason: String,
    /// For a person. Read back from a Kubernetes event series of N > 1 events, it ends in ` (xN)`.
    pub message: String,
    /// When it was recorded. Read back from a Kubernetes event series: its last occurrence.
    pub time: Time,
}

/// A backend's own error, boxed: the store's API names no backend's crate.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Store errors. The semantic variants mean the same on every backend; what only one backend
/// can say travels as the source of [`Error::Backend`] or [`Error::Unavailable`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No such object.
    #[error("{0} not found")]
    NotFound(Key),
    /// Create of an existing object.
    #[error("{0} already exists")]
    AlreadyExists(Key),
    /// The object changed since it was read.
    #[error("{key} was modified (resourceVersion {actual}, not {expected}); read it again")]
    Conflict {
        /// Which.
        key: Key,
        /// The version the caller read.
        expected: String,
        /// The version stored.
        actual: String,
    },
    /// The object is malformed, or the backend refused it as invalid.
    #[error("invalid object: {0}")]
    Invalid(String),
    /// The store cannot serve now; the same call may succeed later: a busy database, an API
    /// server that is unreachable, throttling (429) or failing (5xx), an initial list that did
    /// not complete.
    #[error("store unavailable: {reason}")]
    Unavailable {
        /// What is unavailable (never a secret).
        reason: String,
        /// The backend's error, when there is one.
        #[source]
        source: Option<BoxError>,
    },
    /// A stored object's text does not parse as its kind: a store file edited by hand, a
    /// damaged restore, a custom resource written with a value its CRD's schema admits and its
    /// kind's type does not (a number beyond a `u32`'s range), an object written by another
    /// version of the controller. The source says why, after the path of the field at fault
    /// when there is one (`spec.failureBudget: invalid value: …`). What each read does with
    /// such an object is the rule under "Unreadable objects" on [`Backend`].
    #[error("{key}: the stored object cannot be read")]
    Unreadable {
        /// Which.
        key: Key,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// (De)serialization of an object failed.
    #[error("store data error")]
    Json(#[from] serde_json::Error),
    /// The backend failed in a way no other variant describes (not retried sooner than any
    /// other reconcile error).
    #[error("{backend} store error")]
    Backend {
        /// Which backend (`sqlite`, `kubernetes`).
        backend: &'static str,
        /// Its error.
        #[source]
        source: BoxError,
    },
}

impl Error {
    /// [`Error::Unavailable`] without an underlying error.
    pub fn unavailable(reason: impl Into<String>) -> Self {
        Error::Unavailable { reason: reason.into(), source: None }
    }

    /// [`Error::Backend`] of `backend`.
    pub fn backend(backend: &'static str, source: impl Into<BoxError>) -> Self {
        Error::Backend { backend, source: source.into() }
    }

    /// Whether the same call may succeed when made again later, unchanged ([`Error::Unavailable`]).
    /// A [`Error::Conflict`] is not: the caller must read the object again first.
    pub fn is_transient(&self) -> bool {
        matches!(self, Error::Unavailable { .. })
    }
}

/// Store result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The narrow storage interface. Objects travel as JSON; the store owns `uid`,
/// `resourceVersion`, `generation`, `creationTimestamp` and `deletionTimestamp`.
///
/// # Guarantees
///
/// Every backend keeps these promises; [`conformance`] checks each of them, against the SQLite
/// backend in the controller's unit tests and against a real API server in
/// `tests/store_conformance.rs`.
///
/// - **resourceVersion.** Every write that changes an object gives it a new
///   `metadata.resourceVersion`. Versions are decimal integers that increase with every write
///   anywhere in the store (SQLite: one counter per file; Kubernetes: etcd's revision — the
///   Kubernetes API calls resourceVersions opaque, but kube-apiserver's etcd storage makes them
///   so, and [`Store::watch`] relies on it). A write that changes nothing may keep the version (Kubernetes does; SQLite
///   gives a new one).
/// - **Read your writes.** Once a write returned, [`Backend::get`] and [`Backend::list`] on this
///   handle return that version of the object or a newer one, never an older one (and not the
///   object at all once a write or delete returned that it is gone).
/// - **Optimistic concurrency.** [`Backend::create`] of an existing object fails
///   [`Error::AlreadyExists`]. [`Backend::update`] and [`Backend::replace_status`] carry the
///   `resourceVersion` the caller read: a stale one fails [`Error::Conflict`], none at all
///   [`Error::Invalid`], an absent object [`Error::NotFound`].
/// - **Spec and status are written apart.** [`Backend::update`] writes metadata (labels,
///   annotations, finalizers, owner references) and spec; the status it is sent is ignored.
///   [`Backend::replace_status`] writes the status; everything else it is sent is ignored. A
///   change of the spec increments `metadata.generation`; status and metadata writes leave it as
///   it is (marking an object deleted may increment it: Kubernetes does, SQLite does not).
/// - **Finalizers.** [`Backend::delete`] of an object with finalizers sets its
///   `deletionTimestamp` (once: deleting again keeps it) and the object stays, readable and
///   writable; the write that removes its last finalizer removes the object and returns `None`.
///   Without finalizers, delete removes it at once. Deleting an absent object is not an error.
/// - **Notifications.** [`Backend::subscribe`] reports each write that changed an object once,
///   after the write is visible to [`Backend::get`], in commit order per kind (SQLite: across
///   kinds too, for writes through this handle). Writes through this handle are reported one by
///   one; writes by other processes or clients are reported at least as their latest state
///   (SQLite's poller and a Kubernetes relist coalesce). [`Change::status_only`] is `true` only for a write of the
///   status alone; a backend may report such a write as `false` (Kubernetes does when a newer
///   write of the object overtook the notification), never the reverse. A subscriber that falls
///   behind gets `Lagged` and must list again.
/// - **Watch from a resourceVersion.** [`Store::watch`] (built on `list` and `subscribe`, so the
///   same on every backend) lists the objects whose current version is newer than the one given,
///   then reports every change. It does not replay history: an object changed twice since is
///   listed once, as it is now, and one deleted since is not reported.
/// - **Events.** [`Backend::record_event`] records an event against an object; [`Backend::events`]
///   returns the newest `limit` of them, oldest first. Recording is best effort: Kubernetes posts
///   events in the background (they show up shortly after, and are dropped when the queue is
///   full); SQLite keeps the newest 50,000.
/// - **Unreadable objects.** An object stored whole but whose text does not parse as its kind
///   ([`Error::Unreadable`]) is neither hidden nor allowed to take the rest of its kind down.
///   The backend keeps serving it as text: [`Backend::keys`] lists it, [`Backend::get`] and
///   [`Backend::list`] return it, and [`Backend::scan_with`] names it — the object's key and the
///   parse error — when the visitor cannot read it. On that, [`Store`] reads alike on every
///   backend:
///   - [`Store::get`] fails [`Error::Unreadable`], naming the kind, namespace and name, and the
///     field at fault and why. The object's own reconcile fails with it, and is retried with
///     backoff until the object is repaired or deleted.
///   - A sweep of a whole kind ([`Store::list`]) and a [`Watch`] pass over it and go on: one bad
///     object does not fail every reconcile that lists its kind. A watch reports no event for a
///     change that leaves an object unreadable (it reports the next readable version).
///   - A selection decided about as a whole — what one owner owns ([`Store::list_owned`],
///     [`Store::list_owned_as`]: its text names the owner's uid), what a namespace and labels
///     select ([`Store::list_with`]: in the namespace, its text holds the label values) — fails
///     [`Error::Unreadable`] when the object may belong to it: the caller cannot tell, and acting
///     as if it did not exist could replace a machine a deployment or a pool has, or remediate
///     past a health check that would halt it. Only the callers it may belong to wait.
///   - Every pass-over and failure is reported, once per object and reason for as long as the
///     object stays unreadable: a warning in the log, a `Warning` event `Unreadable` on the
///     object, and [`Store::unreadable`] (the `controller_unreadable_objects{kind}` metric).
#[async_trait::async_trait]
pub trait Backend: Send + Sync + 'static {
    /// One object.
    async fn get(&self, key: &Key) -> Result<Option<Arc<str>>>;
    /// All objects of a kind.
    async fn list(&self, kind: Kind) -> Result<Vec<Arc<str>>>;
    /// Hands each object of a kind to `visit`, one at a time and in the order of
    /// [`Backend::list`], and stops at the first error `visit` returns. What a caller parses out
    /// of 10,000 objects this way never needs all their texts at once: the backends keep texts
    /// packed (`store/packed.rs`) and unpack one at a time. An object `visit` cannot read (it
    /// returns [`Error::Json`]) stops the scan too, named: the error is [`Error::Unreadable`].
    /// [`Backend::scan_with`] passes over such objects instead.
    async fn scan(&self, kind: Kind, visit: &mut (dyn for<'t> FnMut(&'t str) -> Result<()> + Send)) -> Result<()> {
        self.scan_with(kind, visit, &mut |key, source| Err(Error::Unreadable { key, source })).await
    }
    /// [`Backend::scan`], but an object `visit` cannot read (it returns [`Error::Json`]) is
    /// handed to `unreadable` with its key, and the scan goes on to the next object unless
    /// `unreadable` returns an error (which the scan then returns). Any other error of `visit`
    /// stops the scan. An object that changed or went while the scan ran is not handed over:
    /// the text `visit` saw is no longer stored.
    ///
    /// The default goes through [`Backend::list`] and names an unreadable object by the
    /// `metadata` of its text; a backend whose texts may not be JSON objects with a name (SQLite:
    /// a row edited by hand) overrides it.
    async fn scan_with(
        &self,
        kind: Kind,
        visit: &mut (dyn for<'t> FnMut(&'t str) -> Result<()> + Send),
        unreadable: &mut (dyn FnMut(Key, serde_json::Error) -> Result<()> + Send),
    ) -> Result<()> {
        for json in self.list(kind).await? {
            match visit(&json) {
                Err(Error::Json(source)) => match key_in_text(kind, &json) {
                    Some(key) => unreadable(key, source)?,
                    None => return Err(Error::Json(source)),
                },
                other => other?,
            }
        }
        Ok(())
    }
    /// How many objects of a kind there are, when the backend knows without reading them;
    /// `None` when it does not. Only a size hint for what a caller collects from
    /// [`Backend::scan`].
    async fn count(&self, _kind: Kind) -> Option<usize> {
        None
    }
    /// The client of the API server the objects live on, for a backend that has one (the
    /// controller probes it: [`crate::safety`]).
    fn api_client(&self) -> Option<kube::Client> {
        None
    }
    /// The keys of all objects of a kind (backends with an index answer without parsing).
    async fn keys(&self, kind: Kind) -> Result<Vec<Key>> {
        Ok(self.list(kind).await?.iter().filter_map(|j| key_in_text(kind, j)).collect())
    }
    /// Creates; `AlreadyExists` if present. Returns the stored object.
    async fn create(&self, kind: Kind, obj: Value) -> Result<Arc<str>>;
    /// Replaces metadata (labels, annotations, finalizers, owners) and spec (a Secret's data and
    /// type) if `metadata.resourceVersion` is still current; the status sent is ignored. Removes
    /// the object when it is being deleted and has no finalizers left. Returns the stored object,
    /// or `None` when it was removed.
    async fn update(&self, kind: Kind, obj: Value) -> Result<Option<Arc<str>>>;
    /// Replaces the status (only) of an object given as JSON text — its name, namespace,
    /// `resourceVersion` and `status` are read, the rest is ignored — if that `resourceVersion`
    /// is still current. Text, not a value: status writes are most of the store's writes, and a
    /// backend that can splice the status into what it stores need not parse the rest. Returns
    /// the stored object (`None`: removed, as for [`Backend::update`]). A kind without status
    /// ([`Kind::has_status`]: Secrets) is [`Error::Invalid`].
    async fn replace_status(&self, kind: Kind, json: String) -> Result<Option<Arc<str>>>;
    /// Deletes: marks `deletionTimestamp` while finalizers remain, else removes. Returns the
    /// object as it is afterwards (`None` when removed or absent).
    async fn delete(&self, key: &Key) -> Result<Option<Arc<str>>>;
    /// Change notifications.
    fn subscribe(&self) -> broadcast::Receiver<Change>;
    /// Records an event. The Kubernetes backend posts it in the background and aggregates
    /// repeats into event series, so an `Ok` does not mean it is readable yet.
    async fn record_event(&self, event: Event) -> Result<()>;
    /// The newest `limit` events of an object, oldest first.
    async fn events(&self, key: &Key, limit: usize) -> Result<Vec<Event>>;
}

/// The key a stored text names in its `metadata` (`None`: not a JSON object with a name).
fn key_in_text(kind: Kind, json: &str) -> Option<Key> {
    #[derive(serde::Deserialize)]
    struct Named {
        metadata: NameOnly,
    }
    #[derive(serde::Deserialize)]
    struct NameOnly {
        name: String,
        #[serde(default)]
        namespace: Option<String>,
    }
    let named = serde_json::from_str::<Named>(json).ok()?.metadata;
    Some(Key::new(kind, named.namespace.as_deref().unwrap_or("default"), &named.name))
}

/// `json` read as a `T`. The error of a text that does not fit names the field at fault
/// (`spec.failureBudget: invalid value: integer `4294967296`, expected u32`), where serde's
/// alone says `at line 1 column 321`: the store's texts are one line, and the column moves with
/// every unrelated change of the object. A text that is not JSON at all keeps its position.
pub(crate) fn parse<T: serde::de::DeserializeOwned>(json: &str) -> serde_json::Result<T> {
    serde_json::from_str(json).map_err(|e| {
        // Only for a text that does not parse: the path costs a second parse.
        let mut de = serde_json::Deserializer::from_str(json);
        match serde_path_to_error::deserialize::<_, T>(&mut de) {
            Err(at) if at.path().iter().next().is_some() && !e.is_syntax() && !e.is_eof() => {
                let message = e.to_string();
                let position = format!(" at line {} column {}", e.line(), e.column());
                let message = message.strip_suffix(&position).unwrap_or(&message);
                <serde_json::Error as serde::de::Error>::custom(format!("{}: {message}", at.path()))
            }
            _ => e,
        }
    })
}

/// What a store handle found unreadable (see "Unreadable objects" on [`Backend`]): each
/// object, with why, until a read finds it readable again or gone.
#[derive(Default)]
struct Unreadables(std::sync::Mutex<std::collections::BTreeMap<Key, String>>);

impl Unreadables {
    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<Key, String>> {
        lock(&self.0)
    }

    /// Records `found` (`whole`: every unreadable object of `kind`, so the others of `kind`
    /// are readable now or gone); returns the ones not recorded before with that reason.
    fn found(&self, kind: Kind, found: Vec<(Key, String)>, whole: bool) -> Vec<(Key, String)> {
        let mut held = self.lock();
        if whole {
            held.retain(|k, _| k.kind != kind || found.iter().any(|(f, _)| f == k));
        }
        found.into_iter().filter(|(key, why)| held.insert(key.clone(), why.clone()).as_ref() != Some(why)).collect()
    }

    /// `key` read, or found gone.
    fn readable(&self, key: &Key) {
        let mut held = self.lock();
        if !held.is_empty() {
            held.remove(key);
        }
    }
}

/// Which backend to use (`--store`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreSpec {
    /// The embedded store in this file (`sqlite://PATH`, or just `PATH`).
    Sqlite(std::path::PathBuf),
    /// The Kubernetes API server of the kubeconfig or in-cluster config (`kubernetes`).
    Kubernetes {
        /// Watch only this namespace (`None`: all namespaces).
        namespace: Option<String>,
    },
}

impl std::str::FromStr for StoreSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "" => Err("the store is empty; use sqlite://PATH or kubernetes".into()),
            "kubernetes" | "k8s" => Ok(StoreSpec::Kubernetes { namespace: None }),
            _ => match s.strip_prefix("sqlite://") {
                Some("") => Err(format!("{s:?}: sqlite:// needs a file path")),
                Some(path) => Ok(StoreSpec::Sqlite(path.into())),
                None if s.contains("://") => Err(format!("{s:?}: unknown store; use sqlite://PATH or kubernetes")),
                None => Ok(StoreSpec::Sqlite(s.into())),
            },
        }
    }
}

impl StoreSpec {
    /// The Kubernetes client a `kubernetes` store needs, from the kubeconfig (`KUBECONFIG`,
    /// `~/.kube/config`) or the in-cluster config; `None` for the embedded store. The caller
    /// builds it once and hands it to [`Store::connect`] and to whatever else talks to that API
    /// server (leader election).
    ///
    /// # Errors
    /// No usable Kubernetes configuration ([`Error::Backend`]).
    pub async fn kube_client(&self) -> Result<Option<kube::Client>> {
        match self {
            StoreSpec::Sqlite(_) => Ok(None),
            StoreSpec::Kubernetes { .. } => {
                let config = kube::Config::infer().await.map_err(|e| Error::backend("kubernetes", e))?;
                kubernetes::client(config).map(Some).map_err(|e| Error::backend("kubernetes", e))
            }
        }
    }
}

impl std::fmt::Display for StoreSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreSpec::Sqlite(p) => write!(f, "sqlite://{}", p.display()),
            StoreSpec::Kubernetes { namespace: None } => f.write_str("kubernetes (all namespaces)"),
            StoreSpec::Kubernetes { namespace: Some(ns) } => write!(f, "kubernetes (namespace {ns})"),
        }
    }
}

/// Which objects a [`Store::list_with`] returns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListParams {
    /// Only this namespace (`None`: all).
    pub namespace: Option<String>,
    /// Only objects with all of these labels (equality-based label selector).
    pub labels: std::collections::BTreeMap<String, String>,
}

impl ListParams {
    /// Objects in `namespace`.
    #[must_use]
    pub fn namespaced(namespace: &str) -> Self {
        Self { namespace: Some(namespace.into()), ..Self::default() }
    }

    /// Also requires label `key=value`.
    #[must_use]
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    fn matches(&self, meta: &ObjectMeta) -> bool {
        self.namespace.as_ref().is_none_or(|ns| *ns == meta.namespace)
            && self.labels.iter().all(|(k, v)| meta.labels.get(k) == Some(v))
    }
}

/// What a [`Watch`] reports, in the shape of kube-runtime's `watcher::Event`.
#[derive(Debug, Clone, PartialEq)]
pub enum WatchEvent<T> {
    /// A (re)list starts: the `InitApply` objects that follow replace what the caller knew.
    Init,
    /// An object of the initial list.
    InitApply(T),
    /// The initial list is complete.
    InitDone,
    /// An object was created or changed.
    Apply(T),
    /// An object is gone.
    Delete(Key),
}

/// A watch over one type: first the objects newer than a resourceVersion (all of them without
/// one), then `InitDone`, then every change. A watcher that falls too far behind starts over
/// with `Init` and a full list, so nothing is missed. An object that cannot be read as `T` is
/// passed over, and reported ("Unreadable objects" on [`Backend`]).
pub struct Watch<T> {
    store: Store,
    rx: broadcast::Receiver<Change>,
    since: u64,
    pending: std::collections::VecDeque<WatchEvent<T>>,
    listed: bool,
}

impl<T: Resource> Watch<T> {
    /// The next event.
    ///
    /// # Errors
    /// Backend errors; [`Error::Unavailable`] when the backend stopped.
    pub async fn next(&mut self) -> Result<WatchEvent<T>> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Ok(e);
            }
            if !self.listed {
                self.listed = true;
                self.pending.push_back(WatchEvent::Init);
                for obj in self.store.list::<T>().await? {
                    if rv_of(obj.meta()) > self.since {
                        self.pending.push_back(WatchEvent::InitApply(obj));
                    }
                }
                self.pending.push_back(WatchEvent::InitDone);
                continue;
            }
            match self.rx.recv().await {
                Ok(change) if change.key.kind == T::KIND => {
                    return Ok(match self.store.get::<T>(&change.key.namespace, &change.key.name).await {
                        Ok(Some(obj)) => WatchEvent::Apply(obj),
                        Ok(None) => WatchEvent::Delete(change.key),
                        // Passed over (`get` reported it): the next readable version is reported.
                        Err(Error::Unreadable { .. }) => continue,
                        Err(e) => return Err(e),
                    });
                }
                Ok(_) => {}
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    self.since = 0;
                    self.listed = false;
                }
                Err(broadcast::error::RecvError::Closed) => {
                    return Err(Error::unavailable("the store stopped sending changes"))
                }
            }
        }
    }
}

fn rv_of(meta: &ObjectMeta) -> u64 {
    meta.resource_version.parse().unwrap_or(u64::MAX)
}

/// Typed access over a backend. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    backend: Arc<dyn Backend>,
    /// Shared by the handle's clones.
    unreadable: Arc<Unreadables>,
}

impl Store {
    /// A store over `backend`.
    pub fn new(backend: Arc<dyn Backend>) -> Self {
        Self { backend, unreadable: Arc::default() }
    }

    /// The embedded store in `path`.
    ///
    /// # Errors
    /// The file cannot be opened or is not a store.
    pub fn open(path: &std::path::Path) -> Result<Self> {
        Ok(Self::new(Arc::new(sqlite::SqliteBackend::open(path)?)))
    }

    /// The backend `spec` names. A Kubernetes store uses `client`, which the caller built (from
    /// the kubeconfig or the in-cluster config: [`StoreSpec::kube_client`]) and may share, e.g.
    /// with leader election.
    ///
    /// # Errors
    /// The file cannot be opened; `--store kubernetes` without a client.
    pub fn connect(spec: &StoreSpec, client: Option<kube::Client>) -> Result<Self> {
        match (spec, client) {
            (StoreSpec::Sqlite(path), _) => Self::open(path),
            (StoreSpec::Kubernetes { namespace }, Some(client)) => {
                Ok(Self::new(Arc::new(kubernetes::KubernetesBackend::new(client, namespace.clone()))))
            }
            (StoreSpec::Kubernetes { .. }, None) => {
                Err(Error::Invalid("a Kubernetes store needs a Kubernetes client".into()))
            }
        }
    }

    /// The backend, for what the store's typed API does not cover (raw JSON, events).
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// One object.
    ///
    /// # Errors
    /// Backend errors; [`Error::Unreadable`], naming it, for an object that does not parse as
    /// `T` (reported: "Unreadable objects" on [`Backend`]).
    pub async fn get<T: Resource>(&self, namespace: &str, name: &str) -> Result<Option<T>> {
        let key = Key::new(T::KIND, namespace, name);
        let Some(json) = self.backend.get(&key).await? else {
            self.unreadable.readable(&key);
            return Ok(None);
        };
        match parse(&json) {
            Ok(obj) => {
                self.unreadable.readable(&key);
                Ok(Some(obj))
            }
            Err(source) => {
                self.report(T::KIND, vec![(key.clone(), source.to_string())], false).await;
                Err(Error::Unreadable { key, source })
            }
        }
    }

    /// All objects of a kind. One that does not parse as `T` is passed over and reported
    /// ("Unreadable objects" on [`Backend`]).
    ///
    /// # Errors
    /// Backend errors.
    pub async fn list<T: Resource>(&self) -> Result<Vec<T>> {
        let mut out = Vec::new();
        let mut unreadable = Vec::new();
        self.backend
            .scan_with(
                T::KIND,
                &mut |json| {
                    out.push(parse(json)?);
                    Ok(())
                },
                &mut |key, source| {
                    unreadable.push((key, source.to_string()));
                    Ok(())
                },
            )
            .await?;
        self.report(T::KIND, unreadable, true).await;
        Ok(out)
    }

    /// The objects of type `T` that `params` selects. Only objects whose text contains every
    /// selected label value are parsed.
    ///
    /// # Errors
    /// Backend errors; [`Error::Unreadable`], naming it, for an object that does not parse as
    /// `T` and may be selected: in the selected namespace, its text holding every selected label
    /// value (reported: "Unreadable objects" on [`Backend`]). A selection — even of everything —
    /// is decided about as a whole; [`Store::list`] sweeps a kind and passes over such objects.
    pub async fn list_with<T: Resource>(&self, params: &ListParams) -> Result<Vec<T>> {
        let mut out = Vec::new();
        let mut unreadable = Vec::new();
        let scanned = self
            .backend
            .scan_with(
                T::KIND,
                &mut |json| {
                    if params.labels.values().all(|v| json.contains(v.as_str())) {
                        let obj: T = parse(json)?;
                        if params.matches(obj.meta()) {
                            out.push(obj);
                        }
                    }
                    Ok(())
                },
                // Only a text with every selected label value is parsed: in the namespace, it
                // may be selected.
                &mut |key, source| {
                    unreadable.push((key.clone(), source.to_string()));
                    match &params.namespace {
                        Some(ns) if *ns != key.namespace => Ok(()),
                        _ => Err(Error::Unreadable { key, source }),
                    }
                },
            )
            .await;
        self.report(T::KIND, unreadable, false).await;
        scanned?;
        Ok(out)
    }

    /// The objects this handle's reads last found unreadable ("Unreadable objects" on
    /// [`Backend`]), in key order, each with why; an object leaves the list when a read finds
    /// it readable again or gone (a listing of its whole kind, or a `get` of it).
    pub fn unreadable(&self) -> Vec<(Key, String)> {
        self.unreadable.lock().iter().map(|(k, why)| (k.clone(), why.clone())).collect()
    }

    /// Records what a read of `kind` found unreadable (`whole`: a listing of all of `kind`), and
    /// reports each object not reported before with that reason: a warning in the log and a
    /// `Warning` event `Unreadable` on the object.
    async fn report(&self, kind: Kind, found: Vec<(Key, String)>, whole: bool) {
        if found.is_empty() && (!whole || self.unreadable.lock().is_empty()) {
            return;
        }
        for (key, why) in self.unreadable.found(kind, found, whole) {
            tracing::warn!(
                object = %key,
                "{key}: the stored object cannot be read as a {kind}: {why}; reads of it and selections it \
                 may belong to fail, sweeps of its kind pass over it, until it is repaired or deleted"
            );
            let event = Event {
                key,
                event_type: EventReason::Unreadable.event_type().as_str().into(),
                reason: EventReason::Unreadable.as_str().into(),
                message: format!("the stored object cannot be read as a {kind}: {why}"),
                time: chrono::Utc::now(),
            };
            if let Err(e) = self.backend.record_event(event).await {
                tracing::warn!("recording event: {}", machine_driver_util::error_chain(&e));
            }
        }
    }

    /// Watches objects of type `T` changed after `resource_version` (every object when `None`):
    /// the initial list, `InitDone`, then each change. Subscribes before it lists, so no change
    /// falls between the two.
    pub fn watch<T: Resource>(&self, resource_version: Option<&str>) -> Watch<T> {
        Watch {
            store: self.clone(),
            rx: self.backend.subscribe(),
            since: resource_version.and_then(|v| v.parse().ok()).unwrap_or(0),
            pending: Default::default(),
            listed: false,
        }
    }

    /// The keys of all objects of a kind.
    ///
    /// # Errors
    /// Backend errors.
    pub async fn keys(&self, kind: Kind) -> Result<Vec<Key>> {
        self.backend.keys(kind).await
    }

    /// The objects of type `T` in `owner`'s namespace whose controlling owner is `owner` (by uid).
    /// Only objects whose text names the uid are parsed, so a deployment's reconcile does not
    /// parse every Machine of every other deployment.
    ///
    /// # Errors
    /// Backend errors; [`Error::Unreadable`], naming it, for an object whose text names the
    /// owner's uid but does not parse as `T` (the owner cannot tell whether it owns it).
    pub async fn list_owned<T: Resource>(&self, owner: &ObjectMeta) -> Result<Vec<T>> {
        self.list_owned_as(T::KIND, owner, |json| {
            let obj: T = parse(json)?;
            let meta = obj.meta();
            let owned = meta.namespace == owner.namespace
                && meta.owner_references.iter().any(|o| o.controller && o.uid == owner.uid);
            Ok(owned.then_some(obj))
        })
        .await
    }

    /// Like [`Store::list_owned`], but each object whose text names `owner`'s uid goes to
    /// `parse`, which reads what the caller holds out of it — a view with only the fields the
    /// caller reads (borrowing from the text, so it costs a fraction of the whole object with
    /// 10,000 of them), confirms the owner and returns `None` for another's (one at a time, so
    /// the views never all exist at once).
    ///
    /// # Errors
    /// Backend errors; [`Error::Unreadable`], naming it, for an object whose text names the
    /// owner's uid and that `parse` cannot read (reported: "Unreadable objects" on [`Backend`]).
    pub async fn list_owned_as<U: Send>(
        &self,
        kind: Kind,
        owner: &ObjectMeta,
        parse: impl Fn(&str) -> serde_json::Result<Option<U>> + Sync,
    ) -> Result<Vec<U>> {
        if owner.uid.is_empty() {
            return Ok(Vec::new());
        }
        // Room for every object of the kind, so the list never grows by copying: grown by
        // doubling, a plan's list of 100,000 members held room for 196,608 at once during its
        // last growth, 33 MB where 17 MB are needed. Room no view is written into is address
        // space, not memory.
        let mut out = Vec::with_capacity(self.backend.count(kind).await.unwrap_or(0));
        let mut unreadable = None;
        let scanned = self
            .backend
            .scan_with(
                kind,
                &mut |json| {
                    if json.contains(owner.uid.as_str()) {
                        out.extend(parse(json)?);
                    }
                    Ok(())
                },
                // Only a text that names the uid is parsed: this one may be the owner's.
                &mut |key, source| {
                    let why = source.to_string();
                    unreadable = Some((key.clone(), why));
                    Err(Error::Unreadable { key, source })
                },
            )
            .await;
        if let Some(found) = unreadable {
            self.report(kind, vec![found], false).await;
        }
        scanned?;
        Ok(out)
    }

    /// Creates `obj`.
    ///
    /// # Errors
    /// `AlreadyExists`, database errors.
    pub async fn create<T: Resource>(&self, obj: &T) -> Result<T> {
        let mut value = serde_json::to_value(obj)?;
        // A status that says nothing (what an object without one reads as) is not stored: on the
        // API server, which ignores status on create, it would cost a second write.
        if let Some(status) = value.get("status") {
            let mut bare = value.clone();
            if let Some(o) = bare.as_object_mut() {
                o.remove("status");
            }
            let read_back = serde_json::to_value(serde_json::from_value::<T>(bare)?)?;
            if read_back.get("status") == Some(status) {
                if let Some(o) = value.as_object_mut() {
                    o.remove("status");
                }
            }
        }
        let json = self.backend.create(T::KIND, value).await?;
        Ok(serde_json::from_str(&json)?)
    }

    /// Updates metadata and spec.
    ///
    /// # Errors
    /// `Conflict` when it changed since read; `NotFound`.
    pub async fn update<T: Resource>(&self, obj: &T) -> Result<Option<T>> {
        match self.backend.update(T::KIND, serde_json::to_value(obj)?).await? {
            Some(json) => Ok(Some(serde_json::from_str(&json)?)),
            None => Ok(None),
        }
    }

    /// Replaces the status only.
    ///
    /// # Errors
    /// `Conflict` when it changed since read; `NotFound`.
    pub async fn replace_status<T: Resource>(&self, obj: &T) -> Result<()> {
        match self.backend.replace_status(T::KIND, serde_json::to_string(obj)?).await? {
            Some(_) => Ok(()),
            None => Err(Error::NotFound(Key::of(obj))),
        }
    }

    /// Deletes (or marks for deletion).
    ///
    /// # Errors
    /// Database errors.
    pub async fn delete(&self, key: &Key) -> Result<Option<Arc<str>>> {
        self.backend.delete(key).await
    }

    /// Records an event against an object, its type the reason's; failures are logged, not
    /// returned.
    pub async fn event(&self, kind: Kind, meta: &ObjectMeta, reason: EventReason, message: impl Into<String>) {
        let event_type = reason.event_type();
        let event = Event {
            key: Key::new(kind, &meta.namespace, &meta.name),
            event_type: event_type.as_str().into(),
            reason: reason.as_str().into(),
            message: message.into(),
            time: chrono::Utc::now(),
        };
        let reason = reason.as_str();
        match event_type {
            EventType::Warning => tracing::warn!(object = %event.key, reason, "{}", event.message),
            EventType::Normal => tracing::info!(object = %event.key, reason, "{}", event.message),
        }
        if let Err(e) = self.backend.record_event(event).await {
            tracing::warn!("recording event: {}", machine_driver_util::error_chain(&e));
        }
    }

    /// Change notifications.
    pub fn subscribe(&self) -> broadcast::Receiver<Change> {
        self.backend.subscribe()
    }

    /// Creates the object, or updates its spec, labels and annotations to the given ones
    /// (retrying on conflicts). Returns whether it was created, and the stored object.
    ///
    /// # Errors
    /// Database errors; conflicts that persist after retries.
    pub async fn apply(&self, kind: Kind, desired: Value) -> Result<(bool, Arc<str>)> {
        let meta = desired.get("metadata").ok_or_else(|| Error::Invalid("metadata is missing".into()))?;
        let name = meta.get("name").and_then(Value::as_str).unwrap_or_default().to_string();
        let namespace = meta.get("namespace").and_then(Value::as_str).unwrap_or("default").to_string();
        let key = Key::new(kind, &namespace, &name);
        for _ in 0..5 {
            let Some(current) = self.backend.get(&key).await? else {
                match self.backend.create(kind, desired.clone()).await {
                    Ok(j) => return Ok((true, j)),
                    Err(Error::AlreadyExists(_)) => continue,
                    Err(e) => return Err(e),
                }
            };
            let mut merged: Value =
                serde_json::from_str(&current).map_err(|source| Error::Unreadable { key: key.clone(), source })?;
            // As the CRD's transition rule says (`crate::crd`): the machines made stay in the
            // cluster they joined.
            let (was, now) = (merged.pointer("/spec/targetCluster"), desired.pointer("/spec/targetCluster"));
            if let (Some(was), Some(now)) = (was, now) {
                if was != now {
                    return Err(Error::Invalid(format!("{key}: spec.targetCluster: {}", crate::crd::IMMUTABLE)));
                }
            }
            for field in ["spec", "stringData", "data", "type"] {
                match desired.get(field) {
                    Some(v) => merged[field] = v.clone(),
                    None if field != "spec" => {
                        if let Some(o) = merged.as_object_mut() {
                            o.remove(field);
                        }
                    }
                    None => {}
                }
            }
            for field in ["labels", "annotations"] {
                merged["metadata"][field] = meta.get(field).cloned().unwrap_or(Value::Object(Default::default()));
            }
            match self.backend.update(kind, merged).await {
                Ok(Some(j)) => return Ok((false, j)),
                Ok(None) => continue,
                Err(Error::Conflict { .. }) => continue,
                Err(e) => return Err(e),
            }
        }
        Err(Error::Conflict { key, expected: "latest".into(), actual: "changing".into() })
    }
}

#[cfg(test)]
mod tests;
