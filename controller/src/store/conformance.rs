//! The store's contract as executable cases: one `async fn` per guarantee of
//! [`Backend`](super::Backend), written once and run against every backend — SQLite in the
//! controller's unit tests (`store::tests::conformance`), a real kube-apiserver + etcd in
//! `tests/store_conformance.rs`.
//!
//! A harness gives each case a [`Subject`] (a store, and a namespace no other case writes to) and
//! turns each case into a test of its own with [`store_conformance_cases!`](crate::store_conformance_cases),
//! so a failure names the case:
//!
//! ```no_run
//! use machine_controller::store::conformance::{self, Subject};
//! use machine_controller::store::Store;
//!
//! async fn subject() -> Subject {
//!     let path = std::env::temp_dir().join("conformance.db");
//!     Subject { store: Store::open(&path).unwrap(), namespace: "default".into() }
//! }
//!
//! macro_rules! tests {
//!     ($($case:ident),* $(,)?) => {$(
//!         #[tokio::test]
//!         async fn $case() {
//!             if let Err(why) = conformance::$case(&subject().await).await {
//!                 panic!("{}: {why}", stringify!($case));
//!             }
//!         }
//!     )*};
//! }
//! machine_controller::store_conformance_cases!(tests);
//! # fn main() {}
//! ```
//!
//! Cases never sleep to synchronise: every call and every awaited notification is bounded by
//! [`WITHIN`], and what arrives asynchronously (notifications, Kubernetes events) is awaited as a
//! condition with a deadline.

use std::collections::BTreeSet;
use std::future::Future;
use std::time::Duration;

use tokio::sync::broadcast;

use serde_json::Value;

use super::{Change, Error, Event, Key, ListParams, Result, Store, WatchEvent};
use crate::events::EventReason;
use crate::resources::{Kind, MachineClass, MachineClassSpec, MachineDeployment, ObjectMeta, FINALIZER};

/// Calls every case with `$then!` (a macro taking a comma-separated list of case names, each a
/// function of this module).
#[macro_export]
#[doc(hidden)]
macro_rules! store_conformance_cases {
    ($then:ident) => {
        $then! {
            create_update_conflicts_and_read_your_writes,
            resource_versions_increase_with_every_write,
            finalizers_hold_deletion_until_the_last_is_removed,
            status_and_spec_are_written_apart,
            notifications_one_per_write_in_commit_order,
            notifications_come_after_the_write_is_visible,
            watch_from_a_resource_version_lists_what_changed_since,
            events_newest_n_oldest_first,
            repeats_of_one_reason_read_back_as_one_event_with_its_count,
            scan_visits_what_list_returns_in_order_and_stops_at_an_error,
            an_unreadable_object_is_named_by_get_and_passed_over_by_listings,
        }
    };
}

/// What a case runs against.
pub struct Subject {
    /// The store under test.
    pub store: Store,
    /// A namespace only this case writes to (on a shared API server, cases run side by side).
    pub namespace: String,
}

/// A case's verdict: `Err` says which promise broke.
pub type Outcome = std::result::Result<(), String>;

/// How long one store call, or one awaited notification or event, may take.
pub const WITHIN: Duration = Duration::from_secs(30);

macro_rules! ensure {
    ($cond:expr, $($why:tt)+) => {
        if !$cond {
            return Err(format!($($why)+));
        }
    };
}

/// Runs a store call within [`WITHIN`]; the outer error is the timeout.
async fn call<T>(what: &str, f: impl Future<Output = Result<T>>) -> std::result::Result<Result<T>, String> {
    tokio::time::timeout(WITHIN, f).await.map_err(|_| format!("{what}: no answer within {WITHIN:?}"))
}

/// A store call that must succeed.
async fn ok<T>(what: &str, f: impl Future<Output = Result<T>>) -> std::result::Result<T, String> {
    call(what, f).await?.map_err(|e| format!("{what}: {}", machine_driver_util::error_chain(&e)))
}

/// A store call that must fail as `want` says.
async fn fails<T: std::fmt::Debug>(
    what: &str,
    f: impl Future<Output = Result<T>>,
    want: &str,
    matches: impl Fn(&Error) -> bool,
) -> Outcome {
    match call(what, f).await? {
        Err(e) if matches(&e) => Ok(()),
        Err(e) => Err(format!("{what}: expected {want}, got {}", machine_driver_util::error_chain(&e))),
        Ok(v) => Err(format!("{what}: expected {want}, got Ok({v:?})")),
    }
}

fn class(namespace: &str, name: &str) -> MachineClass {
    MachineClass::new(
        namespace,
        name,
        MachineClassSpec {
            driver: "fake".into(),
            provider_spec: serde_json::json!({"machineType": "small"}),
            secret_ref: None,
            capacity: None,
            user_data: None,
        },
    )
}

fn version(meta: &ObjectMeta) -> std::result::Result<u64, String> {
    meta.resource_version
        .parse()
        .map_err(|_| format!("{}: resourceVersion {:?} is not an integer", meta.name, meta.resource_version))
}

async fn get(s: &Subject, name: &str) -> std::result::Result<Option<MachineClass>, String> {
    ok(&format!("get {name}"), s.store.get::<MachineClass>(&s.namespace, name)).await
}

async fn must_get(s: &Subject, name: &str) -> std::result::Result<MachineClass, String> {
    get(s, name).await?.ok_or_else(|| format!("{name} is gone"))
}

fn key(s: &Subject, name: &str) -> Key {
    Key::new(Kind::MachineClass, &s.namespace, name)
}

/// The next change in this case's namespace.
async fn next_change(rx: &mut broadcast::Receiver<Change>, namespace: &str) -> std::result::Result<Change, String> {
    let deadline = tokio::time::Instant::now() + WITHIN;
    loop {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Err(_) => return Err(format!("no change notified within {WITHIN:?}")),
            Ok(Err(e)) => return Err(format!("notifications: {e}")),
            Ok(Ok(c)) if c.key.namespace == namespace => return Ok(c),
            Ok(Ok(_)) => {}
        }
    }
}

/// `create` of an existing object fails `AlreadyExists`; `update` and `replace_status` with a
/// stale resourceVersion fail `Conflict`, without one `Invalid`, of an absent object `NotFound`;
/// every read after a write returns that version or a newer one; delete without finalizers
/// removes at once, and deleting what is absent is not an error.
pub async fn create_update_conflicts_and_read_your_writes(s: &Subject) -> Outcome {
    let store = &s.store;
    let created = ok("create", store.create(&class(&s.namespace, "a"))).await?;
    let m = &created.metadata;
    ensure!(!m.uid.is_empty(), "create: no uid");
    ensure!(m.generation == 1, "create: generation {} (not 1)", m.generation);
    ensure!(m.creation_timestamp.is_some(), "create: no creationTimestamp");
    ensure!(m.deletion_timestamp.is_none(), "create: a deletionTimestamp");
    let v1 = version(m)?;
    let read = must_get(s, "a").await?;
    ensure!(version(&read.metadata)? >= v1, "read after create: version {} older than {v1}", version(&read.metadata)?);
    ensure!(read.metadata.uid == m.uid, "read after create: another uid");
    let listed = ok("list", store.list::<MachineClass>()).await?;
    ensure!(listed.iter().any(|c| c.metadata.uid == m.uid), "list after create: missing");
    let keys = ok("keys", store.keys(Kind::MachineClass)).await?;
    ensure!(keys.contains(&key(s, "a")), "keys after create: missing");

    fails(
        "create again",
        store.create(&class(&s.namespace, "a")),
        "AlreadyExists",
        |e| matches!(e, Error::AlreadyExists(k) if *k == key(s, "a")),
    )
    .await?;

    let mut changed = created.clone();
    changed.spec.provider_spec = serde_json::json!({"machineType": "large"});
    let updated = ok("update", store.update(&changed)).await?.ok_or("update: the object went")?;
    let v2 = version(&updated.metadata)?;
    ensure!(v2 > v1, "update: version {v2} not after {v1}");
    ensure!(updated.spec.provider_spec["machineType"] == "large", "update: spec not stored");
    let read = must_get(s, "a").await?;
    ensure!(version(&read.metadata)? >= v2, "read after update: version {} older than {v2}", version(&read.metadata)?);
    ensure!(read.spec.provider_spec["machineType"] == "large", "read after update: old spec");

    let is_conflict = |e: &Error| matches!(e, Error::Conflict { key: k, .. } if *k == key(s, "a"));
    fails("update with a stale resourceVersion", store.update(&changed), "Conflict", is_conflict).await?;
    fails("replace_status with a stale resourceVersion", store.replace_status(&created), "Conflict", is_conflict)
        .await?;
    let mut unversioned = updated.clone();
    unversioned.metadata.resource_version.clear();
    let is_invalid = |e: &Error| matches!(e, Error::Invalid(_));
    fails("update without a resourceVersion", store.update(&unversioned), "Invalid", is_invalid).await?;
    fails("replace_status without a resourceVersion", store.replace_status(&unversioned), "Invalid", is_invalid)
        .await?;
    let mut absent = updated.clone();
    absent.metadata.name = "absent".into();
    let is_not_found = |e: &Error| matches!(e, Error::NotFound(k) if *k == key(s, "absent"));
    fails("update of an absent object", store.update(&absent), "NotFound", is_not_found).await?;
    fails("replace_status of an absent object", store.replace_status(&absent), "NotFound", is_not_found).await?;
    let read = must_get(s, "a").await?;
    ensure!(read.metadata.resource_version == updated.metadata.resource_version, "a refused write changed the object");

    let gone = ok("delete", store.delete(&key(s, "a"))).await?;
    ensure!(gone.is_none(), "delete without finalizers: the object is still there");
    ensure!(get(s, "a").await?.is_none(), "read after delete: still there");
    let listed = ok("list", store.list::<MachineClass>()).await?;
    ensure!(listed.iter().all(|c| c.metadata.uid != m.uid), "list after delete: still there");
    let again = ok("delete again", store.delete(&key(s, "a"))).await?;
    ensure!(again.is_none(), "delete of an absent object returned one");
    Ok(())
}

/// `scan` hands over the same texts as `list`, in the same order, each once, read-your-writes
/// included; an error from the visitor stops it and is returned as it is.
pub async fn scan_visits_what_list_returns_in_order_and_stops_at_an_error(s: &Subject) -> Outcome {
    let store = &s.store;
    for name in ["c", "a", "b"] {
        ok("create", store.create(&class(&s.namespace, name))).await?;
    }
    let mut last = must_get(s, "b").await?;
    last.spec.provider_spec = serde_json::json!({"machineType": "large"});
    ok("update", store.update(&last)).await?;
    let backend = store.backend();
    let listed: Vec<String> = ok("list", backend.list(Kind::MachineClass))
        .await?
        .iter()
        .filter(|j| j.contains(&format!("\"namespace\":\"{}\"", s.namespace)))
        .map(|j| j.to_string())
        .collect();
    ensure!(listed.len() == 3, "list: {} objects of this namespace, not 3", listed.len());
    // A size hint, of every namespace's objects (other cases may be writing theirs): at least
    // this namespace's.
    let count = call("count", async { Ok(backend.count(Kind::MachineClass).await) }).await?.unwrap_or(None);
    ensure!(count.is_none_or(|n| n >= listed.len()), "count: {count:?}, but this namespace alone has {}", listed.len());
    let mut scanned = Vec::new();
    ok(
        "scan",
        backend.scan(Kind::MachineClass, &mut |json| {
            if json.contains(&format!("\"namespace\":\"{}\"", s.namespace)) {
                scanned.push(json.to_string());
            }
            Ok(())
        }),
    )
    .await?;
    ensure!(scanned == listed, "scan handed over {scanned:?}, list returned {listed:?}");
    ensure!(scanned[1].contains("large"), "scan: not the updated text of b");
    let mut visits = 0;
    let stopped = call(
        "scan stopping at an error",
        backend.scan(Kind::MachineClass, &mut |_| {
            visits += 1;
            Err(Error::Invalid("stop here".into()))
        }),
    )
    .await?;
    ensure!(matches!(&stopped, Err(Error::Invalid(why)) if why == "stop here"), "scan returned {stopped:?}");
    ensure!(visits == 1, "scan went on after the visitor's error: {visits} visits");
    Ok(())
}

/// Every write that changes an object gives it a version newer than every earlier write in the
/// store, whatever the object.
pub async fn resource_versions_increase_with_every_write(s: &Subject) -> Outcome {
    let store = &s.store;
    let mut last = 0;
    let mut step = |what: &str, meta: &ObjectMeta| -> Outcome {
        let v = version(meta)?;
        ensure!(v > last, "{what}: version {v} not after the previous write's {last}");
        last = v;
        Ok(())
    };
    let a = ok("create a", store.create(&class(&s.namespace, "a"))).await?;
    step("create a", &a.metadata)?;
    let mut b = class(&s.namespace, "b");
    b.metadata.finalizers = vec![FINALIZER.into()];
    let b = ok("create b", store.create(&b)).await?;
    step("create b", &b.metadata)?;
    let mut labelled = a.clone();
    labelled.metadata.labels.insert("step".into(), "label".into());
    let a = ok("label a", store.update(&labelled)).await?.ok_or("label a: gone")?;
    step("label a", &a.metadata)?;
    let mut status = b.clone();
    status.status.validated_generation = 1;
    ok("status of b", store.replace_status(&status)).await?;
    let b = must_get(s, "b").await?;
    step("status of b", &b.metadata)?;
    let mut spec = a.clone();
    spec.spec.provider_spec = serde_json::json!({"machineType": "large"});
    let a = ok("spec of a", store.update(&spec)).await?.ok_or("spec of a: gone")?;
    step("spec of a", &a.metadata)?;
    ok("delete b", store.delete(&key(s, "b"))).await?;
    let b = must_get(s, "b").await?;
    step("delete b (marked)", &b.metadata)?;
    let mut a2 = a.clone();
    a2.metadata.labels.insert("step".into(), "again".into());
    let a = ok("label a again", store.update(&a2)).await?.ok_or("label a again: gone")?;
    step("label a again", &a.metadata)?;
    let mut done = b.clone();
    done.metadata.finalizers.clear();
    ensure!(ok("release b", store.update(&done)).await?.is_none(), "release b: still there");
    let c = ok("create c", store.create(&class(&s.namespace, "c"))).await?;
    step("create c after b went", &c.metadata)?;
    Ok(())
}

/// Delete of an object with finalizers sets its deletionTimestamp (once) and keeps it readable
/// and writable; the update that removes the last finalizer removes it; the name can be used
/// again afterwards.
pub async fn finalizers_hold_deletion_until_the_last_is_removed(s: &Subject) -> Outcome {
    let store = &s.store;
    let mut a = class(&s.namespace, "a");
    a.metadata.finalizers = vec![FINALIZER.into(), "example.com/second".into()];
    let created = ok("create", store.create(&a)).await?;
    let marked = ok("delete", store.delete(&key(s, "a"))).await?.ok_or("delete with finalizers removed it")?;
    let marked: MachineClass = serde_json::from_str(&marked).map_err(|e| format!("delete returned: {e}"))?;
    let when = marked.metadata.deletion_timestamp.ok_or("delete with finalizers: no deletionTimestamp")?;
    let read = must_get(s, "a").await?;
    ensure!(read.metadata.deletion_timestamp == Some(when), "read after delete: deletionTimestamp not kept");
    ensure!(read.metadata.finalizers == created.metadata.finalizers, "delete changed the finalizers");
    ensure!(read.metadata.uid == created.metadata.uid, "delete replaced the object");

    let again = ok("delete again", store.delete(&key(s, "a"))).await?.ok_or("delete again removed it")?;
    let again: MachineClass = serde_json::from_str(&again).map_err(|e| format!("delete again returned: {e}"))?;
    ensure!(again.metadata.deletion_timestamp == Some(when), "delete again moved the deletionTimestamp");

    let mut labelled = must_get(s, "a").await?;
    labelled.metadata.labels.insert("cleanup".into(), "started".into());
    let labelled = ok("label while deleting", store.update(&labelled)).await?.ok_or("a label write removed it")?;
    ensure!(labelled.metadata.deletion_timestamp == Some(when), "a label write moved the deletionTimestamp");
    let mut status = labelled.clone();
    status.status.validated_generation = 5;
    ok("status while deleting", store.replace_status(&status)).await?;
    let mut one_left = must_get(s, "a").await?;
    ensure!(one_left.status.validated_generation == 5, "status while deleting: not stored");
    one_left.metadata.finalizers.retain(|f| f != FINALIZER);
    let one_left =
        ok("remove a finalizer", store.update(&one_left)).await?.ok_or("removing one of two finalizers removed it")?;
    ensure!(
        one_left.metadata.finalizers == ["example.com/second"],
        "finalizers now {:?}",
        one_left.metadata.finalizers
    );

    let mut none_left = one_left.clone();
    none_left.metadata.finalizers.clear();
    let removed = ok("remove the last finalizer", store.update(&none_left)).await?;
    ensure!(removed.is_none(), "removing the last finalizer returned the object");
    ensure!(get(s, "a").await?.is_none(), "read after the last finalizer went: still there");

    let recreated = ok("create it again", store.create(&class(&s.namespace, "a"))).await?;
    ensure!(recreated.metadata.uid != created.metadata.uid, "the new object has the old uid");
    ensure!(recreated.metadata.deletion_timestamp.is_none(), "the new object is being deleted");
    ensure!(recreated.metadata.generation == 1, "the new object's generation is {}", recreated.metadata.generation);
    Ok(())
}

/// A status write stores the status only and keeps the generation; a spec write stores metadata
/// and spec only and increments the generation; a metadata-only write keeps it.
pub async fn status_and_spec_are_written_apart(s: &Subject) -> Outcome {
    let store = &s.store;
    let created = ok("create", store.create(&class(&s.namespace, "a"))).await?;

    let mut sneaky = created.clone();
    sneaky.spec.provider_spec = serde_json::json!({"machineType": "huge"});
    sneaky.metadata.labels.insert("sneaky".into(), "yes".into());
    sneaky.status.validated_generation = 1;
    ok("replace_status", store.replace_status(&sneaky)).await?;
    let after = must_get(s, "a").await?;
    ensure!(after.status.validated_generation == 1, "replace_status: status not stored");
    ensure!(after.spec == created.spec, "replace_status changed the spec");
    ensure!(after.metadata.labels == created.metadata.labels, "replace_status changed the labels");
    ensure!(after.metadata.generation == 1, "replace_status: generation {} (not 1)", after.metadata.generation);
    ensure!(version(&after.metadata)? > version(&created.metadata)?, "replace_status kept the resourceVersion");

    let mut spec = after.clone();
    spec.spec.provider_spec = serde_json::json!({"machineType": "large"});
    spec.status.validated_generation = 7;
    let updated = ok("update", store.update(&spec)).await?.ok_or("update: gone")?;
    ensure!(updated.spec.provider_spec["machineType"] == "large", "update: spec not stored");
    ensure!(updated.status.validated_generation == 1, "update changed the status");
    ensure!(updated.metadata.generation == 2, "a spec change: generation {} (not 2)", updated.metadata.generation);
    let read = must_get(s, "a").await?;
    ensure!(read.status.validated_generation == 1, "read after update: the status changed");

    let mut label = read.clone();
    label.metadata.labels.insert("team".into(), "x".into());
    label.metadata.annotations.insert("note".into(), "y".into());
    let labelled = ok("update labels", store.update(&label)).await?.ok_or("update labels: gone")?;
    ensure!(labelled.metadata.labels.get("team").map(String::as_str) == Some("x"), "labels not stored");
    ensure!(labelled.metadata.annotations.get("note").map(String::as_str) == Some("y"), "annotations not stored");
    ensure!(labelled.metadata.generation == 2, "a metadata change: generation {}", labelled.metadata.generation);

    let mut status = labelled.clone();
    status.status.validated_generation = 2;
    ok("replace_status again", store.replace_status(&status)).await?;
    let read = must_get(s, "a").await?;
    ensure!(read.status.validated_generation == 2, "second status not stored");
    ensure!(read.metadata.labels == labelled.metadata.labels, "the status write dropped the labels");
    ensure!(read.metadata.generation == 2, "a status write: generation {}", read.metadata.generation);
    Ok(())
}

/// Each write through this handle is notified once, in commit order; a status write's
/// notification may say `status_only`, any other write's never does.
pub async fn notifications_one_per_write_in_commit_order(s: &Subject) -> Outcome {
    let store = &s.store;
    let ns = &s.namespace;
    let mut rx = store.subscribe();

    // One at a time: each write's own notification, with what it was.
    let a = ok("create a", store.create(&class(ns, "a"))).await?;
    let c = next_change(&mut rx, ns).await?;
    ensure!(c.key == key(s, "a") && !c.deleted && !c.status_only, "create a notified as {c:?}");
    let mut status = a.clone();
    status.status.validated_generation = 1;
    ok("status of a", store.replace_status(&status)).await?;
    let c = next_change(&mut rx, ns).await?;
    ensure!(c.key == key(s, "a") && !c.deleted && c.status_only, "a status write notified as {c:?}");
    let mut labelled = must_get(s, "a").await?;
    labelled.metadata.labels.insert("team".into(), "x".into());
    let a = ok("label a", store.update(&labelled)).await?.ok_or("label a: gone")?;
    let c = next_change(&mut rx, ns).await?;
    ensure!(c.key == key(s, "a") && !c.deleted && !c.status_only, "a label write notified as {c:?}");

    // A burst, then a last write: everything before the last write's notification is the burst,
    // one notification per write, in order.
    let mut spec = a.clone();
    spec.spec.provider_spec = serde_json::json!({"machineType": "large"});
    ok("spec of a", store.update(&spec)).await?;
    let b = ok("create b", store.create(&class(ns, "b"))).await?;
    let mut b_status = b.clone();
    b_status.status.validated_generation = 3;
    ok("status of b", store.replace_status(&b_status)).await?;
    let mut relabel = must_get(s, "a").await?;
    relabel.metadata.labels.insert("team".into(), "y".into());
    ok("relabel a", store.update(&relabel)).await?;
    ok("delete b", store.delete(&key(s, "b"))).await?;
    ok("delete a", store.delete(&key(s, "a"))).await?;
    ok("create z", store.create(&class(ns, "z"))).await?;
    // (name, deleted, may be status_only)
    let expected = [
        ("a", false, false),
        ("b", false, false),
        ("b", false, true),
        ("a", false, false),
        ("b", true, false),
        ("a", true, false),
    ];
    let mut seen = Vec::new();
    loop {
        let c = next_change(&mut rx, ns).await?;
        if c.key == key(s, "z") {
            break;
        }
        seen.push(c);
    }
    let names: Vec<(&str, bool)> = seen.iter().map(|c| (c.key.name.as_str(), c.deleted)).collect();
    let want: Vec<(&str, bool)> = expected.iter().map(|(n, d, _)| (*n, *d)).collect();
    ensure!(names == want, "notified {names:?}, written {want:?} (name, deleted)");
    for (c, (_, _, may)) in seen.iter().zip(expected) {
        ensure!(may || !c.status_only, "{c:?} says status_only for a write that was not one");
    }
    Ok(())
}

/// A notification comes after its write is visible: a subscriber that reads the object as soon
/// as it hears of it finds it.
pub async fn notifications_come_after_the_write_is_visible(s: &Subject) -> Outcome {
    const WRITES: usize = 20;
    let mut rx = s.store.subscribe();
    let (store, ns) = (s.store.clone(), s.namespace.clone());
    let reader = tokio::spawn(async move {
        let mut invisible = Vec::new();
        for _ in 0..WRITES {
            let c = next_change(&mut rx, &ns).await?;
            let found = ok("get on notification", store.get::<MachineClass>(&ns, &c.key.name)).await?;
            if found.is_none() {
                invisible.push(c.key.name);
            }
        }
        Ok::<_, String>(invisible)
    });
    for i in 0..WRITES {
        ok("create", s.store.create(&class(&s.namespace, &format!("v{i}")))).await?;
    }
    let invisible = tokio::time::timeout(WITHIN, reader)
        .await
        .map_err(|_| "the reader did not finish".to_string())?
        .map_err(|e| format!("the reader: {e}"))??;
    ensure!(invisible.is_empty(), "notified before visible: {invisible:?}");
    Ok(())
}

/// `Store::watch(None)` lists everything; `Store::watch(Some(rv))` lists the objects whose current
/// version is newer than `rv` (deleted ones are not replayed), then reports each change.
pub async fn watch_from_a_resource_version_lists_what_changed_since(s: &Subject) -> Outcome {
    let store = &s.store;
    let ns = &s.namespace;
    let mut rx = store.subscribe();
    let a = ok("create a", store.create(&class(ns, "a"))).await?;
    let b = ok("create b", store.create(&class(ns, "b"))).await?;
    let mark = b.metadata.resource_version.clone();
    ok("create c", store.create(&class(ns, "c"))).await?;
    let mut spec = a.clone();
    spec.spec.provider_spec = serde_json::json!({"machineType": "large"});
    ok("spec of a", store.update(&spec)).await?;
    ok("create d", store.create(&class(ns, "d"))).await?;
    ok("delete d", store.delete(&key(s, "d"))).await?;
    // Every notification of the writes above is in before a watch starts: it then reports only
    // what follows.
    loop {
        let c = next_change(&mut rx, ns).await?;
        if c.key == key(s, "d") && c.deleted {
            break;
        }
    }

    async fn initial(w: &mut super::Watch<MachineClass>, ns: &str) -> std::result::Result<BTreeSet<String>, String> {
        let mut names = BTreeSet::new();
        loop {
            match ok("watch", w.next()).await? {
                WatchEvent::Init => names.clear(),
                WatchEvent::InitApply(c) if c.metadata.namespace == ns => {
                    names.insert(c.metadata.name);
                }
                WatchEvent::InitApply(_) => {}
                WatchEvent::InitDone => return Ok(names),
                e => return Err(format!("{e:?} before InitDone")),
            }
        }
    }
    let mut all = store.watch::<MachineClass>(None);
    let names = initial(&mut all, ns).await?;
    ensure!(names == BTreeSet::from(["a".into(), "b".into(), "c".into()]), "watch(None) listed {names:?}");

    let mut since = store.watch::<MachineClass>(Some(&mark));
    let names = initial(&mut since, ns).await?;
    ensure!(names == BTreeSet::from(["a".into(), "c".into()]), "watch({mark}) listed {names:?}, not a and c");

    let mut relabel = must_get(s, "b").await?;
    relabel.metadata.labels.insert("team".into(), "x".into());
    let b = ok("label b", store.update(&relabel)).await?.ok_or("label b: gone")?;
    for w in [&mut all, &mut since] {
        match ok("watch", w.next()).await? {
            WatchEvent::Apply(c) if c.metadata.name == "b" => {
                ensure!(version(&c.metadata)? >= version(&b.metadata)?, "watch: Apply of an older b")
            }
            e => return Err(format!("after label b: {e:?}, not Apply(b)")),
        }
    }
    ok("delete c", store.delete(&key(s, "c"))).await?;
    for w in [&mut all, &mut since] {
        match ok("watch", w.next()).await? {
            WatchEvent::Delete(k) if k == key(s, "c") => {}
            e => return Err(format!("after delete c: {e:?}, not Delete(c)")),
        }
    }
    Ok(())
}

/// Repeats of one reason on one object read back as one event series (client-go's): the first
/// message with ` (xN)` after it. The first repeat is written at once on every backend; later
/// ones may wait for the backend's next refresh, so this case repeats once.
pub async fn repeats_of_one_reason_read_back_as_one_event_with_its_count(s: &Subject) -> Outcome {
    let store = &s.store;
    let a = ok("create a", store.create(&class(&s.namespace, "a"))).await?;
    store.event(Kind::MachineClass, &a.metadata, EventReason::Invalid, "first").await;
    store.event(Kind::MachineClass, &a.metadata, EventReason::Invalid, "second").await;
    store.event(Kind::MachineClass, &a.metadata, EventReason::Validated, "other").await;
    let deadline = tokio::time::Instant::now() + WITHIN;
    let want = [("Invalid", "first (x2)"), ("Validated", "other")];
    loop {
        let events = ok("events", store.backend().events(&key(s, "a"), 10)).await?;
        let got: Vec<(&str, &str)> = events.iter().map(|e| (e.reason.as_str(), e.message.as_str())).collect();
        if got == want {
            return Ok(());
        }
        ensure!(tokio::time::Instant::now() < deadline, "events of a: {got:?}, want {want:?}");
        // Deliberate: the interval between polls of a condition with a deadline.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Recorded events read back as the newest `limit` of the object's, oldest first, with their
/// type, reason and message; other objects' events are not among them.
pub async fn events_newest_n_oldest_first(s: &Subject) -> Outcome {
    let store = &s.store;
    let a = ok("create a", store.create(&class(&s.namespace, "a"))).await?;
    let b = ok("create b", store.create(&class(&s.namespace, "b"))).await?;
    store.event(Kind::MachineClass, &a.metadata, EventReason::Validated, "one").await;
    store.event(Kind::MachineClass, &b.metadata, EventReason::OrphanDeleted, "of b").await;
    store.event(Kind::MachineClass, &a.metadata, EventReason::Invalid, "two").await;
    store.event(Kind::MachineClass, &a.metadata, EventReason::Deleted, "three").await;
    // Recording may be asynchronous (Kubernetes posts in the background): wait for all three.
    let deadline = tokio::time::Instant::now() + WITHIN;
    let all = loop {
        let events = ok("events", store.backend().events(&key(s, "a"), 10)).await?;
        if events.len() >= 3 || tokio::time::Instant::now() >= deadline {
            break events;
        }
        // Deliberate: the interval between polls of a condition with a deadline.
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let summary = |events: &[Event]| -> Vec<(String, String, String)> {
        events.iter().map(|e| (e.event_type.clone(), e.reason.clone(), e.message.clone())).collect()
    };
    let t = |ty: &str, reason: &str, message: &str| (ty.to_string(), reason.to_string(), message.to_string());
    let want = vec![t("Normal", "Validated", "one"), t("Warning", "Invalid", "two"), t("Normal", "Deleted", "three")];
    ensure!(summary(&all) == want, "events of a: {:?}, recorded {want:?}", summary(&all));
    ensure!(all.iter().all(|e| e.key == key(s, "a")), "events of a name another object");
    let newest = ok("newest 2 events", store.backend().events(&key(s, "a"), 2)).await?;
    ensure!(summary(&newest) == want[1..], "newest 2 events of a: {:?}", summary(&newest));
    Ok(())
}

/// A MachineDeployment as JSON with `failureBudget` as given. The CRD's schema says only "an
/// integer of at least 0" where the type holds a `u32`, so `1 << 32` is stored on every backend
/// and read by none: the way a value the controller cannot read gets into a real cluster (a
/// `kubectl apply`, another version of the controller). Should the schema ever bound it, this
/// case needs another such value: the create of it fails, saying so.
fn deployment(namespace: &str, name: &str, failure_budget: u64) -> Value {
    serde_json::json!({
        "apiVersion": Kind::MachineDeployment.api_version(),
        "kind": "MachineDeployment",
        "metadata": { "name": name, "namespace": namespace },
        "spec": {
            "replicas": 0,
            "template": { "spec": { "classRef": { "name": "small" }, "providerSpec": {} } },
            "failureBudget": failure_budget,
        },
    })
}

/// The stored text of `key`, with `change` made to it, written back with the version it was read at.
async fn rewrite(s: &Subject, key: &Key, change: impl FnOnce(&mut Value)) -> Outcome {
    let backend = s.store.backend();
    let text = ok(&format!("get {key}"), backend.get(key)).await?.ok_or_else(|| format!("{key} is gone"))?;
    let mut v: Value =
        serde_json::from_str(&text).map_err(|e| format!("{key}: the backend's text is not JSON: {e}"))?;
    change(&mut v);
    ok(&format!("update {key}"), backend.update(key.kind, v)).await?.ok_or_else(|| format!("update {key}: it went"))?;
    Ok(())
}

/// The names in `namespace` among `objects`, in order.
fn names_in(namespace: &str, objects: &[MachineDeployment]) -> Vec<String> {
    objects.iter().filter(|o| o.metadata.namespace == namespace).map(|o| o.metadata.name.clone()).collect()
}

/// An object stored whole whose text does not parse as its kind (the rule under "Unreadable
/// objects" on [`Backend`](super::Backend)): the backend serves it as text and names it; `get`
/// fails `Unreadable` naming it and the field at fault; a sweep of the kind and a watch pass
/// over it and go on, a selection it may belong to fails naming it; it is reported
/// (`Store::unreadable`, a `Warning` event `Unreadable` on it); repaired, it reads again
/// everywhere.
pub async fn an_unreadable_object_is_named_by_get_and_passed_over_by_listings(s: &Subject) -> Outcome {
    let (store, ns) = (&s.store, s.namespace.as_str());
    let backend = store.backend();
    let md = |name: &str| Key::new(Kind::MachineDeployment, ns, name);
    let bad = md("bad");
    let mut rx = store.subscribe();
    ok("create good", backend.create(Kind::MachineDeployment, deployment(ns, "good", 3))).await?;
    ok("create bad (failureBudget 2^32)", backend.create(Kind::MachineDeployment, deployment(ns, "bad", 1 << 32)))
        .await
        .map_err(|e| format!("{e}: the store refuses the value this case stores as unreadable; pick another"))?;
    // Both creates are notified before the watch starts: it then reports only what follows.
    let mut created = BTreeSet::new();
    while created.len() < 2 {
        created.insert(next_change(&mut rx, ns).await?.key.name);
    }
    let mut w = store.watch::<MachineDeployment>(None);

    // The backend serves it as text.
    let keys = ok("keys", store.keys(Kind::MachineDeployment)).await?;
    ensure!(keys.contains(&bad), "keys: {bad} missing from {keys:?}");
    let text = ok("backend get", backend.get(&bad)).await?.ok_or("backend get: the unreadable object is not served")?;
    ensure!(text.contains("4294967296"), "backend get: {text}");

    // `get` names it, and the field at fault.
    let want =
        format!("{bad}: the stored object cannot be read: spec.failureBudget: invalid value: integer `4294967296`");
    match call("get bad", store.get::<MachineDeployment>(ns, "bad")).await? {
        Err(e @ Error::Unreadable { .. }) => {
            let chain = machine_driver_util::error_chain(&e);
            ensure!(chain.starts_with(&want), "get bad: {chain:?}, not {want:?}…");
        }
        other => return Err(format!("get bad: expected Unreadable, got {other:?}")),
    }
    // Its neighbour reads as ever.
    ensure!(ok("get good", store.get::<MachineDeployment>(ns, "good")).await?.is_some(), "get good: gone");

    // A sweep of the kind passes over it; a selection it may belong to fails naming it, one it
    // cannot belong to does not.
    let listed = ok("list", store.list::<MachineDeployment>()).await?;
    ensure!(names_in(ns, &listed) == ["good"], "list: {:?}, not [good]", names_in(ns, &listed));
    let is_bad = |e: &Error| matches!(e, Error::Unreadable { key, .. } if *key == bad);
    let selection = ListParams::namespaced(ns);
    fails("list_with its namespace", store.list_with::<MachineDeployment>(&selection), "Unreadable naming bad", is_bad)
        .await?;
    let elsewhere = ListParams::namespaced(&format!("{ns}-elsewhere"));
    let selected = ok("list_with another namespace", store.list_with::<MachineDeployment>(&elsewhere)).await?;
    ensure!(selected.is_empty(), "list_with another namespace: {:?}", names_in(ns, &selected));
    let labelled = ListParams::namespaced(ns).label("team", "absent");
    ok("list_with a label it does not have", store.list_with::<MachineDeployment>(&labelled)).await?;

    // A scan names it: `scan` stops there, `scan_with` hands it over and goes on.
    let read = |json: &str| super::parse::<MachineDeployment>(json).map(|_| ()).map_err(Error::Json);
    let stopped = call("scan", backend.scan(Kind::MachineDeployment, &mut |json| read(json))).await?;
    ensure!(
        matches!(&stopped, Err(Error::Unreadable { key, .. }) if *key == bad),
        "scan: {stopped:?}, not Unreadable naming {bad}"
    );
    let (mut visited, mut handed) = (0, Vec::new());
    ok(
        "scan_with",
        backend.scan_with(
            Kind::MachineDeployment,
            &mut |json| {
                read(json)?;
                visited += 1;
                Ok(())
            },
            &mut |key, _| {
                handed.push(key);
                Ok(())
            },
        ),
    )
    .await?;
    ensure!(handed == [bad.clone()], "scan_with handed over {handed:?}, not [{bad}]");
    ensure!(visited >= 1, "scan_with did not go on to the readable object");

    // Reported: in `Store::unreadable`, and as a Warning event on it.
    let reported = store.unreadable();
    ensure!(
        reported.iter().any(|(k, why)| *k == bad && why.starts_with("spec.failureBudget: ")),
        "Store::unreadable: {reported:?}"
    );
    let deadline = tokio::time::Instant::now() + WITHIN;
    loop {
        let events = ok("events of bad", backend.events(&bad, 10)).await?;
        let found = events.iter().any(|e| {
            e.reason == EventReason::Unreadable.as_str()
                && e.event_type == "Warning"
                && e.message.contains("spec.failureBudget: invalid value")
        });
        if found {
            break;
        }
        ensure!(tokio::time::Instant::now() < deadline, "no Unreadable event on {bad}: {events:?}");
        // Deliberate: the interval between polls of a condition with a deadline.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A watch lists the rest, and passes over a change that leaves it unreadable.
    let mut initial = BTreeSet::new();
    loop {
        match ok("watch", w.next()).await? {
            WatchEvent::Init => initial.clear(),
            WatchEvent::InitApply(o) if o.metadata.namespace == ns => {
                initial.insert(o.metadata.name);
            }
            WatchEvent::InitApply(_) => {}
            WatchEvent::InitDone => break,
            e => return Err(format!("watch: {e:?} before InitDone")),
        }
    }
    ensure!(initial == BTreeSet::from(["good".to_string()]), "watch listed {initial:?}, not [good]");
    rewrite(s, &bad, |v| v["metadata"]["labels"] = serde_json::json!({"still": "unreadable"})).await?;
    rewrite(s, &md("good"), |v| v["metadata"]["labels"] = serde_json::json!({"after": "bad"})).await?;
    match ok("watch", w.next()).await? {
        WatchEvent::Apply(o) if o.metadata.name == "good" && o.metadata.labels.contains_key("after") => {}
        e => return Err(format!("watch after a change of bad, then of good: {e:?}, not Apply(good)")),
    }

    // Repaired, it reads again everywhere, and is no longer reported.
    rewrite(s, &bad, |v| v["spec"]["failureBudget"] = 3.into()).await?;
    match ok("watch", w.next()).await? {
        WatchEvent::Apply(o) if o.metadata.name == "bad" && o.spec.failure_budget == 3 => {}
        e => return Err(format!("watch after bad was repaired: {e:?}, not Apply(bad)")),
    }
    let listed = ok("list after the repair", store.list::<MachineDeployment>()).await?;
    ensure!(names_in(ns, &listed) == ["bad", "good"], "list after the repair: {:?}", names_in(ns, &listed));
    ensure!(ok("get bad after the repair", store.get::<MachineDeployment>(ns, "bad")).await?.is_some(), "bad: gone");
    let reported = store.unreadable();
    ensure!(reported.iter().all(|(k, _)| *k != bad), "still reported after the repair: {reported:?}");
    Ok(())
}
