use super::*;
use crate::resources::*;
use std::time::Duration;

fn class(name: &str, size: &str) -> MachineClass {
    MachineClass::new(
        "default",
        name,
        MachineClassSpec {
            driver: "fake".into(),
            provider_spec: serde_json::json!({"machineType": size}),
            secret_ref: None,
            capacity: None,
            user_data: None,
        },
    )
}

/// A new store file in a folder of its own (gone with the folder): the folder, the file's path,
/// and the store open on it.
fn new_store() -> (tempfile::TempDir, std::path::PathBuf, Store) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.db");
    let store = Store::open(&path).unwrap();
    (dir, path, store)
}

#[tokio::test]
async fn survives_reopen_and_sees_other_processes_writes() {
    let (_dir, path, a) = new_store();
    let mut rx = a.subscribe();
    a.create(&class("one", "small")).await.unwrap();
    assert_eq!(rx.recv().await.unwrap().key.name, "one");

    // Another handle on the same file stands for another process (the CLI).
    let b = Store::open(&path).unwrap();
    assert!(b.get::<MachineClass>("default", "one").await.unwrap().is_some());
    b.create(&class("two", "small")).await.unwrap();
    let change = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap().unwrap();
    assert_eq!(change.key.name, "two");
    assert!(a.get::<MachineClass>("default", "two").await.unwrap().is_some());
    b.delete(&Key::new(Kind::MachineClass, "default", "one")).await.unwrap();
    let change = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap().unwrap();
    assert!(change.deleted && change.key.name == "one");
    drop((a, b));
    let c = Store::open(&path).unwrap();
    let names: Vec<String> = c.list::<MachineClass>().await.unwrap().into_iter().map(|m| m.metadata.name).collect();
    assert_eq!(names, vec!["two"]);
}

/// The poller learns of other processes' commits from the writing connection, whose
/// `data_version` this process's own commits do not move: a write by another process among a
/// stream of this process's own is still seen, once, and each own write is announced once.
#[tokio::test]
async fn another_processes_write_is_seen_among_a_stream_of_own_writes() {
    let (_dir, path, a) = new_store();
    a.create(&class("busy", "small")).await.unwrap();
    let mut rx = a.subscribe();
    let b = Store::open(&path).unwrap();
    let mut own = 0;
    let mut foreign = 0;
    for i in 0..300 {
        let mut current = a.get::<MachineClass>("default", "busy").await.unwrap().unwrap();
        current.status.validated_generation = i;
        a.replace_status(&current).await.unwrap();
        if i == 100 {
            b.create(&class("other", "small")).await.unwrap();
        }
        while let Ok(change) = rx.try_recv() {
            match change.key.name.as_str() {
                "busy" => own += 1,
                _ => foreign += 1,
            }
        }
    }
    // The other process's write may still be on its way (the poller looks every 200 ms).
    while foreign == 0 {
        let change = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap().unwrap();
        assert_eq!(change.key.name, "other", "own writes were all announced already");
        foreign += 1;
    }
    assert_eq!(own, 300, "each own write announced once");
    assert!(a.get::<MachineClass>("default", "other").await.unwrap().is_some());
    // Nothing announced twice: a look after the next poll finds nothing new.
    b.create(&class("marker", "small")).await.unwrap();
    let change = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap().unwrap();
    assert_eq!(change.key.name, "marker");
    assert_eq!(foreign, 1);
}

#[tokio::test]
async fn a_status_write_on_a_version_its_cache_has_not_seen_keeps_the_newer_spec() {
    let (_dir, path, a) = new_store();
    a.create(&class("x", "small")).await.unwrap();
    // Another process changes the spec; `a` writes a status on that version before its poller
    // has folded the change into its cache, so the status goes onto the row, not the cached text.
    let b = Store::open(&path).unwrap();
    b.apply(Kind::MachineClass, serde_json::to_value(class("x", "large")).unwrap()).await.unwrap();
    let mut newer = b.get::<MachineClass>("default", "x").await.unwrap().unwrap();
    newer.status.validated_generation = 2;
    a.replace_status(&newer).await.unwrap();
    let reopened = Store::open(&path).unwrap();
    let now = reopened.get::<MachineClass>("default", "x").await.unwrap().unwrap();
    assert_eq!(now.spec.provider_spec["machineType"], "large");
    assert_eq!(now.status.validated_generation, 2);
}

/// The other way round: `a` writes a status on the version its cache holds while another process
/// has already moved the row on. The write is a conflict, and the other process's spec stays.
#[tokio::test]
async fn a_status_write_on_a_version_another_process_moved_on_from_is_a_conflict() {
    let (_dir, path, a) = new_store();
    a.create(&class("x", "small")).await.unwrap();
    let mut stale = a.get::<MachineClass>("default", "x").await.unwrap().unwrap();
    let b = Store::open(&path).unwrap();
    b.apply(Kind::MachineClass, serde_json::to_value(class("x", "large")).unwrap()).await.unwrap();
    stale.status.validated_generation = 7;
    let err = a.replace_status(&stale).await.unwrap_err();
    assert!(matches!(err, Error::Conflict { .. }), "{err:?}");
    let now = Store::open(&path).unwrap().get::<MachineClass>("default", "x").await.unwrap().unwrap();
    assert_eq!(now.spec.provider_spec["machineType"], "large");
    assert_eq!(now.status.validated_generation, 0);
    // A status write on a version that is gone altogether is not found.
    b.delete(&Key::new(Kind::MachineClass, "default", "x")).await.unwrap();
    let err = a.replace_status(&stale).await.unwrap_err();
    assert!(matches!(err, Error::NotFound(_)), "{err:?}");
}

/// An object whose stored text is not even JSON (a row edited by hand) is treated as the
/// conformance case treats one that does not fit its kind: a read by key names it, with its
/// position; a listing of the kind passes over it and reports it; a listing of what an owner owns
/// fails naming it when its text names the owner, and only then.
#[tokio::test]
async fn an_unreadable_row_is_named_by_reads_and_passed_over_by_listings() {
    let (_dir, path, store) = new_store();
    store.create(&class("good", "small")).await.unwrap();
    store.create(&class("bad", "small")).await.unwrap();
    drop(store);
    let db = rusqlite::Connection::open(&path).unwrap();
    assert_eq!(db.execute("UPDATE objects SET body = '{not json, owner-uid' WHERE name = 'bad'", []).unwrap(), 1);
    drop(db);
    let store = Store::open(&path).unwrap();
    let bad = Key::new(Kind::MachineClass, "default", "bad");
    let err = store.get::<MachineClass>("default", "bad").await.unwrap_err();
    assert!(matches!(&err, Error::Unreadable { key, .. } if *key == bad), "{err:?}");
    let chain = machine_driver_util::error_chain(&err);
    assert_eq!(
        chain,
        "MachineClass/default/bad: the stored object cannot be read: key must be a string at line 1 column 2"
    );
    let names: Vec<String> = store.list::<MachineClass>().await.unwrap().into_iter().map(|c| c.metadata.name).collect();
    assert_eq!(names, ["good"]);
    assert_eq!(store.unreadable(), [(bad.clone(), "key must be a string at line 1 column 2".to_string())]);
    let err = store.backend().scan(Kind::MachineClass, &mut |json| Ok(parse::<MachineClass>(json).map(drop)?)).await;
    assert!(matches!(&err, Err(Error::Unreadable { key, .. }) if *key == bad), "{err:?}");
    // Its text names this owner: the owner cannot tell whether it owns it.
    let owner = ObjectMeta { namespace: "default".into(), uid: "owner-uid".into(), ..Default::default() };
    let err = store.list_owned::<MachineClass>(&owner).await.unwrap_err();
    assert!(matches!(&err, Error::Unreadable { key, .. } if *key == bad), "{err:?}");
    let other = ObjectMeta { uid: "another-uid".into(), ..owner };
    assert!(store.list_owned::<MachineClass>(&other).await.unwrap().is_empty());
    // Reported once, as a Warning event on it.
    let events = store.backend().events(&bad, 10).await.unwrap();
    let reasons: Vec<&str> = events.iter().map(|e| e.reason.as_str()).collect();
    assert_eq!(reasons, ["Unreadable"], "{events:?}");
    assert!(events[0].message.contains("key must be a string"), "{events:?}");
    assert!(store.get::<MachineClass>("default", "good").await.unwrap().is_some());
    // Deleted, it is no longer reported.
    store.delete(&bad).await.unwrap();
    assert!(store.get::<MachineClass>("default", "bad").await.unwrap().is_none());
    assert!(store.unreadable().is_empty());
}

/// A text that is JSON but does not fit its kind is named with the path of the field at fault,
/// without serde's position (which moves with every unrelated change of the object).
#[test]
fn parse_errors_name_the_field_at_fault() {
    let mut md = serde_json::to_value(class("c", "small")).unwrap();
    md["spec"]["driver"] = 5.into();
    let err = parse::<MachineClass>(&md.to_string()).unwrap_err();
    assert_eq!(err.to_string(), "spec.driver: invalid type: integer `5`, expected a string");
    let err = parse::<MachineClass>("[").unwrap_err();
    assert_eq!(err.to_string(), "EOF while parsing a list at line 1 column 1");
}

#[tokio::test]
async fn apply_creates_then_updates_spec_and_labels_only() {
    let (_dir, _, store) = new_store();
    let (created, _) =
        store.apply(Kind::MachineClass, serde_json::to_value(class("a", "small")).unwrap()).await.unwrap();
    assert!(created);
    let mut status = store.get::<MachineClass>("default", "a").await.unwrap().unwrap();
    status.status.validated_generation = 1;
    store.replace_status(&status).await.unwrap();
    let (created, _) =
        store.apply(Kind::MachineClass, serde_json::to_value(class("a", "large")).unwrap()).await.unwrap();
    assert!(!created);
    let now = store.get::<MachineClass>("default", "a").await.unwrap().unwrap();
    assert_eq!(now.spec.provider_spec["machineType"], "large");
    assert_eq!(now.status.validated_generation, 1, "apply keeps status");
    assert_eq!(now.metadata.generation, 2);
}

#[test]
fn concurrent_opens_of_a_new_store_all_succeed() {
    // `run` starting while `apply` creates the file: each opener has its own connection, as
    // separate processes do.
    for round in 0..5 {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(format!("s{round}.db"));
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(6));
        let handles: Vec<_> = (0..6)
            .map(|_| {
                let (path, barrier) = (path.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    sqlite::SqliteBackend::open(&path).map(|_| ()).map_err(|e| e.to_string())
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), Ok(()));
        }
    }
}

#[tokio::test]
async fn list_with_selects_by_namespace_and_labels() {
    let (_dir, _, store) = new_store();
    for (ns, name, pool) in [("default", "m1", "p"), ("default", "m2", "q"), ("other", "m3", "p")] {
        let mut c = class(name, "small");
        c.metadata.namespace = ns.into();
        c.metadata.labels.insert(LABEL_POOL.into(), pool.into());
        store.create(&c).await.unwrap();
    }
    let names = |v: Vec<MachineClass>| v.into_iter().map(|c| c.metadata.name).collect::<Vec<_>>();
    let sel = ListParams::namespaced("default").label(LABEL_POOL, "p");
    assert_eq!(names(store.list_with(&sel).await.unwrap()), ["m1"]);
    let all_p = ListParams::default().label(LABEL_POOL, "p");
    let mut got = names(store.list_with(&all_p).await.unwrap());
    got.sort();
    assert_eq!(got, ["m1", "m3"]);
}

/// A burst of one event on one object, recorded from many tasks at once (a rollout telling of
/// each machine on its deployment), is one row: the first message, and the count the poller
/// writes within a second or two. Another process reads it so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_one_event_is_one_row_whose_count_the_poller_writes() {
    let (_dir, path, store) = new_store();
    let owner = store.create(&class("md", "small")).await.unwrap();
    let tasks: Vec<_> = (0..500)
        .map(|i| {
            let (store, meta) = (store.clone(), owner.metadata.clone());
            tokio::spawn(async move {
                store.event(Kind::MachineClass, &meta, crate::events::EventReason::Created, format!("m{i}")).await
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    store.event(Kind::MachineClass, &owner.metadata, crate::events::EventReason::Deleted, "other").await;
    let key = Key::new(Kind::MachineClass, "default", "md");
    let reader = Store::open(&path).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let events = reader.backend().events(&key, 10).await.unwrap();
        let got: Vec<(&str, &str)> = events.iter().map(|e| (e.reason.as_str(), e.message.as_str())).collect();
        assert_eq!(got.len(), 2, "one row per series: {got:?}");
        assert_eq!(got[1], ("Deleted", "other"));
        assert!(got[0].0 == "Created" && got[0].1.starts_with('m'), "{got:?}");
        if got[0].1.ends_with(" (x500)") {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the count was not written: {got:?}");
        // Deliberate: the interval between polls of a condition with a deadline.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rows: i64 =
        rusqlite::Connection::open(&path).unwrap().query_row("SELECT COUNT(*) FROM events", [], |r| r.get(0)).unwrap();
    assert_eq!(rows, 2);
}

/// A store file from before event series gets the `count` column, each old row one event, and
/// reads and records as any other.
#[tokio::test]
async fn a_store_from_before_event_series_is_upgraded_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.db");
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(
            "CREATE TABLE events(id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT, namespace TEXT, name TEXT,
                type TEXT, reason TEXT, message TEXT, time TEXT);
             INSERT INTO events(kind, namespace, name, type, reason, message, time)
                VALUES ('MachineClass', 'default', 'c', 'Normal', 'Validated', 'old', '2026-01-01T00:00:00.000Z');",
        )
        .unwrap();
    }
    let store = Store::open(&path).unwrap();
    let c = store.create(&class("c", "small")).await.unwrap();
    store.event(Kind::MachineClass, &c.metadata, crate::events::EventReason::Invalid, "new").await;
    let events = store.backend().events(&Key::new(Kind::MachineClass, "default", "c"), 10).await.unwrap();
    let got: Vec<&str> = events.iter().map(|e| e.message.as_str()).collect();
    assert_eq!(got, ["old", "new"]);
    // A second process opening it finds the column there.
    drop(Store::open(&path).unwrap());
}

#[test]
fn status_only_change_compares_everything_but_status_and_resource_version() {
    let old = serde_json::json!({
        "kind": "Machine",
        "metadata": {"name": "m", "resourceVersion": "1", "labels": {"a": "1"}},
        "spec": {"classRef": {"name": "c"}}
    });
    let mut status = old.clone();
    status["metadata"]["resourceVersion"] = "2".into();
    status["status"] = serde_json::json!({"phase": "Running"});
    assert!(status_only_change(&old, &status), "a first status");
    let mut label = status.clone();
    label["metadata"]["labels"]["a"] = "2".into();
    assert!(!status_only_change(&status, &label), "a label");
    let mut finalizer = status.clone();
    finalizer["metadata"]["finalizers"] = serde_json::json!(["x"]);
    assert!(!status_only_change(&status, &finalizer), "a finalizer added");
    let mut spec = status.clone();
    spec["spec"]["classRef"]["name"] = "d".into();
    assert!(!status_only_change(&status, &spec), "the spec");
    let mut no_spec = status.clone();
    no_spec.as_object_mut().unwrap().remove("spec");
    assert!(!status_only_change(&status, &no_spec), "a field removed");
}

/// The store conformance suite ([`super::conformance`]) against SQLite: each case on a store file
/// of its own.
mod conformance {
    use super::super::conformance::{self as suite, Subject};
    use super::Store;

    macro_rules! cases {
        ($($case:ident),* $(,)?) => {$(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let dir = tempfile::tempdir().unwrap();
                let store = Store::open(&dir.path().join("s.db")).unwrap();
                let subject = Subject { store, namespace: "conformance".into() };
                if let Err(why) = suite::$case(&subject).await {
                    panic!("{}: {why}", stringify!($case));
                }
            }
        )*};
    }

    crate::store_conformance_cases!(cases);
}

#[tokio::test]
async fn an_owners_target_cluster_cannot_change_once_set() {
    let (_dir, _path, store) = new_store();
    let md = |target: Option<&str>| {
        let mut v = serde_json::json!({
            "apiVersion": "machine.driver.dev/v1alpha1", "kind": "MachineDeployment",
            "metadata": {"name": "web", "namespace": "fleet"},
            "spec": {"replicas": 1, "template": {"spec": {"classRef": {"name": "small"}}}},
        });
        if let Some(t) = target {
            v["spec"]["targetCluster"] = serde_json::json!({"kubeconfigSecretRef": {"name": t}});
        }
        v
    };
    store.apply(Kind::MachineDeployment, md(Some("east"))).await.unwrap();
    store.apply(Kind::MachineDeployment, md(Some("east"))).await.unwrap();
    let e = store.apply(Kind::MachineDeployment, md(Some("west"))).await.unwrap_err();
    assert!(e.to_string().contains("spec.targetCluster: is immutable"), "{e}");
    let stored = store.get::<MachineDeployment>("fleet", "web").await.unwrap().unwrap();
    assert_eq!(stored.spec.target_cluster.unwrap().kubeconfig_secret_ref.name, "east", "nothing was written");
}
