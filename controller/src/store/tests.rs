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
        },
    )
}

#[tokio::test]
async fn create_get_update_with_optimistic_concurrency() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("s.db")).unwrap();
    let created = store.create(&class("a", "small")).await.unwrap();
    assert_eq!(created.metadata.generation, 1);
    assert!(!created.metadata.uid.is_empty());
    assert!(matches!(store.create(&class("a", "small")).await, Err(Error::AlreadyExists(_))));

    let mut changed = created.clone();
    changed.spec.provider_spec = serde_json::json!({"machineType": "large"});
    let updated = store.update(&changed).await.unwrap().unwrap();
    assert_eq!(updated.metadata.generation, 2, "a spec change bumps generation");
    // A stale write is refused.
    assert!(matches!(store.update(&changed).await, Err(Error::Conflict { .. })));

    let mut status = updated.clone();
    status.status.validated_generation = 2;
    store.update_status(&status).await.unwrap();
    let after = store.get::<MachineClass>("default", "a").await.unwrap().unwrap();
    assert_eq!(after.metadata.generation, 2, "a status write does not bump generation");
    assert_eq!(after.status.validated_generation, 2);
    assert_eq!((&after.spec, &after.metadata.uid), (&updated.spec, &updated.metadata.uid), "kept as stored");
    assert_ne!(after.metadata.resource_version, updated.metadata.resource_version);
    // A status write carries status only: other changes in the object written are not stored.
    let mut sneaky = after.clone();
    sneaky.spec.provider_spec = serde_json::json!({"machineType": "huge"});
    sneaky.metadata.labels.insert("sneaky".into(), "yes".into());
    sneaky.status.validated_generation = 3;
    store.update_status(&sneaky).await.unwrap();
    let stored = store.get::<MachineClass>("default", "a").await.unwrap().unwrap();
    assert_eq!((stored.spec, stored.metadata.labels), (after.spec, after.metadata.labels));
    assert_eq!(stored.status.validated_generation, 3);
    // A stale status write is refused too.
    assert!(matches!(store.update_status(&sneaky).await, Err(Error::Conflict { .. })));
}

#[tokio::test]
async fn finalizers_hold_a_delete_until_removed() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("s.db")).unwrap();
    let mut c = class("a", "small");
    c.metadata.finalizers = vec![FINALIZER.into()];
    let c = store.create(&c).await.unwrap();
    let key = Key::of(&c);
    assert!(store.delete(&key).await.unwrap().is_some(), "still there, marked");
    let marked: MachineClass = store.get("default", "a").await.unwrap().unwrap();
    assert!(marked.metadata.deletion_timestamp.is_some());
    let mut done = marked.clone();
    done.metadata.finalizers.clear();
    assert!(store.update(&done).await.unwrap().is_none(), "removing the last finalizer removes the object");
    assert!(store.get::<MachineClass>("default", "a").await.unwrap().is_none());
}

#[tokio::test]
async fn survives_reopen_and_sees_other_processes_writes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.db");
    let a = Store::open(&path).unwrap();
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

#[tokio::test]
async fn apply_creates_then_updates_spec_and_labels_only() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("s.db")).unwrap();
    let (created, _) =
        store.apply(Kind::MachineClass, serde_json::to_value(class("a", "small")).unwrap()).await.unwrap();
    assert!(created);
    let mut status = store.get::<MachineClass>("default", "a").await.unwrap().unwrap();
    status.status.validated_generation = 1;
    store.update_status(&status).await.unwrap();
    let (created, _) =
        store.apply(Kind::MachineClass, serde_json::to_value(class("a", "large")).unwrap()).await.unwrap();
    assert!(!created);
    let now = store.get::<MachineClass>("default", "a").await.unwrap().unwrap();
    assert_eq!(now.spec.provider_spec["machineType"], "large");
    assert_eq!(now.status.validated_generation, 1, "apply keeps status");
    assert_eq!(now.metadata.generation, 2);
}

#[tokio::test]
async fn events_are_kept_per_object() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("s.db")).unwrap();
    let c = store.create(&class("a", "small")).await.unwrap();
    store.event(Kind::MachineClass, &c.metadata, false, "Validated", "ok").await;
    store.event(Kind::MachineClass, &c.metadata, true, "Invalid", "bad").await;
    let ev = store.backend().events(&Key::of(&c), 10).await.unwrap();
    assert_eq!(ev.iter().map(|e| e.reason.as_str()).collect::<Vec<_>>(), vec!["Validated", "Invalid"]);
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
async fn watch_lists_then_reports_changes_and_starts_from_a_resource_version() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("s.db")).unwrap();
    let a = store.create(&class("a", "small")).await.unwrap();
    store.create(&class("b", "small")).await.unwrap();
    let within = Duration::from_secs(5);

    let mut w = store.watch::<MachineClass>(None);
    let mut initial = Vec::new();
    loop {
        match tokio::time::timeout(within, w.next()).await.unwrap().unwrap() {
            WatchEvent::Init => {}
            WatchEvent::InitApply(c) => initial.push(c.metadata.name),
            WatchEvent::InitDone => break,
            e => panic!("unexpected {e:?} before InitDone"),
        }
    }
    initial.sort();
    assert_eq!(initial, ["a", "b"]);
    let mut changed = a.clone();
    changed.spec.provider_spec = serde_json::json!({"machineType": "large"});
    store.update(&changed).await.unwrap();
    match tokio::time::timeout(within, w.next()).await.unwrap().unwrap() {
        WatchEvent::Apply(c) => assert_eq!(c.spec.provider_spec["machineType"], "large"),
        e => panic!("expected Apply, got {e:?}"),
    }
    store.delete(&Key::of(&a)).await.unwrap();
    assert_eq!(
        tokio::time::timeout(within, w.next()).await.unwrap().unwrap(),
        WatchEvent::Delete(Key::new(Kind::MachineClass, "default", "a"))
    );

    // From a resourceVersion: only what changed after it is listed.
    let b = store.get::<MachineClass>("default", "b").await.unwrap().unwrap();
    store.create(&class("c", "small")).await.unwrap();
    let mut w = store.watch::<MachineClass>(Some(&b.metadata.resource_version));
    let mut listed = Vec::new();
    loop {
        match tokio::time::timeout(within, w.next()).await.unwrap().unwrap() {
            WatchEvent::InitApply(c) => listed.push(c.metadata.name),
            WatchEvent::InitDone => break,
            _ => {}
        }
    }
    assert_eq!(listed, ["c"]);
}

#[tokio::test]
async fn list_with_selects_by_namespace_and_labels() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("s.db")).unwrap();
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

#[tokio::test]
async fn changes_say_whether_only_the_status_changed() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("s.db")).unwrap();
    let mut rx = store.subscribe();
    let within = Duration::from_secs(5);
    let c = store.create(&class("a", "small")).await.unwrap();
    assert!(!tokio::time::timeout(within, rx.recv()).await.unwrap().unwrap().status_only, "a create");
    let mut s = c.clone();
    s.status.validated_generation = 1;
    store.update_status(&s).await.unwrap();
    assert!(tokio::time::timeout(within, rx.recv()).await.unwrap().unwrap().status_only, "a status write");
    let mut labelled = store.get::<MachineClass>("default", "a").await.unwrap().unwrap();
    labelled.metadata.labels.insert("team".into(), "x".into());
    store.update(&labelled).await.unwrap();
    assert!(
        !tokio::time::timeout(within, rx.recv()).await.unwrap().unwrap().status_only,
        "a label change wakes the object's own reconciler"
    );
    store.delete(&Key::of(&c)).await.unwrap();
    let gone = tokio::time::timeout(within, rx.recv()).await.unwrap().unwrap();
    assert!(gone.deleted && !gone.status_only);
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
