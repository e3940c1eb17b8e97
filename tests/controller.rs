//! The controller as a user runs it: `machine-controller run` and `fake-driver` as real
//! processes over a Unix socket, manifests applied with `machine-controller apply`, and the fake
//! cloud's inspection API as the ground truth.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use e2e_tests::world::{Builder, Driver, World};
use e2e_tests::{eventually, eventually_seen};
use fake_driver::pb as fake;
use machine_controller::resources::*;

const MINUTE: Duration = Duration::from_secs(60);

/// A world of the fake driver, the embedded store and a controller with the tests' timings.
fn world(fake_args: &[&str]) -> Builder {
    World::builder().driver(Driver::fake(fake_args)).controller_args(&["--resync-interval", "5s"])
}

fn class_yaml(spec: &str) -> String {
    format!(
        "apiVersion: machine.driver.dev/v1alpha1\nkind: MachineClass\nmetadata: {{name: small}}\nspec:\n  driver: fake\n  providerSpec: {spec}\n"
    )
}

fn md_yaml(name: &str, replicas: i64, image: &str, surge: &str, unavailable: &str, extra: &str) -> String {
    format!(
        "apiVersion: machine.driver.dev/v1alpha1
kind: MachineDeployment
metadata: {{name: {name}}}
spec:
  replicas: {replicas}
  template:
    spec:
      classRef: {{name: small}}
      providerSpec: {{image: {image}}}
  strategy:
    rollingUpdate: {{maxSurge: \"{surge}\", maxUnavailable: \"{unavailable}\"}}
{extra}"
    )
}

const FAST: &[&str] =
    &["--create-latency", "300ms", "--delete-latency", "200ms", "--update-latency", "200ms", "--pool-latency", "300ms"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_update_stays_within_max_surge_and_max_unavailable() {
    let w = world(FAST).in_process().start().await;
    w.apply(&class_yaml("{machineType: small}")).await;
    w.apply(&md_yaml("web", 10, "os-1", "30%", "20%", "")).await;
    w.converged("web", MINUTE).await;
    w.assert_consistent(10).await;

    // Watch the cloud while the rollout runs: the fake counts the peak itself (exact), and a
    // sampler records the fewest Running machines seen.
    let c = w.driver_client().await;
    let mut f = fake::fake_cloud_client::FakeCloudClient::new(c.channel());
    f.inspect(fake::InspectRequest { reset_peak: true }).await.unwrap();
    let min_running = Arc::new(AtomicI64::new(i64::MAX));
    let samples = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (min_running, samples, mut f) = (min_running.clone(), samples.clone(), f.clone());
        tokio::spawn(async move {
            loop {
                if let Ok(r) = f.inspect(fake::InspectRequest::default()).await {
                    let running = r.into_inner().machines.iter().filter(|m| m.state == "RUNNING").count() as i64;
                    min_running.fetch_min(running, Ordering::SeqCst);
                    samples.fetch_add(1, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    w.apply(&md_yaml("web", 10, "os-2", "30%", "20%", "")).await;
    let md = w.converged("web", MINUTE).await;
    sampler.abort();
    let peak = f.inspect(fake::InspectRequest::default()).await.unwrap().into_inner().counters.unwrap().peak_machines;
    // maxSurge 30% of 10 rounds up to 3; maxUnavailable 20% rounds down to 2.
    assert!(peak <= 13, "the cloud held {peak} machines, more than replicas + maxSurge = 13");
    assert!(peak >= 11, "the rollout never surged (peak {peak}); the check would prove nothing");
    let min = min_running.load(Ordering::SeqCst);
    assert!(samples.load(Ordering::SeqCst) > 10, "too few samples");
    assert!(min >= 8, "only {min} machines were running at one point, fewer than replicas − maxUnavailable = 8");
    assert_ne!(md.status.current_revision, "");
    assert!(w
        .machines()
        .await
        .iter()
        .all(|m| m.metadata.labels.get(LABEL_REVISION) == Some(&md.status.current_revision)));
    w.assert_consistent(10).await;
    let cloud = w.inspect().await;
    assert!(cloud.machines.iter().all(|m| m.state == "RUNNING"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_of_the_controller_mid_rollout_loses_and_duplicates_nothing() {
    let mut w = world(&["--create-latency", "1s", "--delete-latency", "500ms"]).start().await;
    w.apply(&class_yaml("{machineType: small}")).await;
    w.apply(&md_yaml("web", 8, "os-1", "50%", "25%", "")).await;
    // Kill it while creates are in flight.
    eventually(MINUTE, "creates in flight", || {
        let w = &w;
        async move { (w.inspect().await.machines.iter().filter(|m| m.state == "CREATING").count() >= 3).then_some(()) }
    })
    .await;
    w.kill9().await;
    w.start_controller(&[]);
    w.converged("web", MINUTE).await;
    w.assert_consistent(8).await;

    // And again in the middle of a rolling update.
    w.apply(&md_yaml("web", 8, "os-2", "50%", "25%", "")).await;
    eventually(MINUTE, "rollout under way", || {
        let w = &w;
        async move {
            let cloud = w.inspect().await;
            (cloud.machines.iter().any(|m| m.state == "CREATING") && cloud.machines.len() > 8).then_some(())
        }
    })
    .await;
    w.kill9().await;
    w.start_controller(&[]);
    let md = w.converged("web", MINUTE).await;
    w.assert_consistent(8).await;
    assert_eq!(md.status.replicas, 8);
    assert!(w.controller_log(2).contains("machine-controller running"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecar_restart_mid_operation_resumes_from_the_stored_token() {
    let dir_state = tempfile::tempdir().unwrap();
    let state = dir_state.path().join("cloud.json");
    let mut w = world(&["--create-latency", "2s", "--state-file", state.to_str().unwrap()]).start().await;
    w.apply(&class_yaml("{machineType: small}")).await;
    w.apply(&md_yaml("web", 3, "os-1", "1", "0", "")).await;
    // Wait until the three creates are stored in status, then crash the sidecar.
    let store = w.store();
    let ops: HashMap<String, String> = eventually(MINUTE, "operations stored in status", || {
        let store = store.clone();
        async move {
            let ms = store.list::<Machine>().await.ok()?;
            let ops: HashMap<String, String> = ms
                .iter()
                .filter_map(|m| m.status.operations.first().map(|o| (m.metadata.name.clone(), o.name.clone())))
                .collect();
            (ops.len() == 3).then_some(ops)
        }
    })
    .await;
    w.restart_driver().await;
    w.converged("web", MINUTE).await;
    w.assert_consistent(3).await;
    // The same operations finished: the request IDs of their final polls are in status, and the
    // cloud created each machine once.
    let cloud = w.inspect().await;
    assert_eq!(cloud.counters.unwrap().machines_created, 3);
    for m in w.machines().await {
        assert!(ops.contains_key(&m.metadata.name));
        assert_eq!(m.status.phase, Phase::Running);
        assert!(m.status.operations.is_empty());
    }
}

fn rule(rpc: &str, action: &str, code: &str, times: u32, retry_after_ms: u32) -> fake::FaultRule {
    fake::FaultRule {
        rpc: rpc.into(),
        target: "*".into(),
        action: action.into(),
        code: code.into(),
        times,
        retry_after_ms,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_errors_and_throttling_back_off_then_converge() {
    let w = world(&["--create-latency", "200ms", "--rate-limit", "8", "--burst", "3"]).in_process().start().await;
    w.set_faults(vec![rule("CreateMachine", "error", "UNAVAILABLE", 4, 0)]).await;
    w.apply(&class_yaml("{machineType: small}")).await;
    w.apply(&md_yaml("web", 6, "os-1", "1", "0", "")).await;
    w.converged("web", MINUTE).await;
    w.assert_consistent(6).await;
    let c = w.inspect().await.counters.unwrap();
    assert_eq!(c.faults_fired, 4, "every injected failure was retried");
    // Throttled calls came back with RetryInfo and were retried after it.
    assert!(c.throttled > 0, "the rate limit never bit; the test proves nothing");
    let retried = w.machines().await.iter().any(|m| m.status.request_ids.len() > 2);
    assert!(retried, "no machine shows more than one call");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_and_invalid_specs_become_conditions_without_a_hot_loop() {
    let w = world(&["--create-latency", "200ms", "--max-machines", "2"]).in_process().start().await;
    w.apply(&class_yaml("{machineType: small}")).await;
    w.apply(&md_yaml("web", 3, "os-1", "0", "1", "")).await;
    let store = w.store();
    let quota_blocked = eventually(MINUTE, "a machine blocked by quota", || {
        let store = store.clone();
        async move {
            let ms = store.list::<Machine>().await.ok()?;
            ms.into_iter().find(|m| {
                m.status
                    .last_operation
                    .as_ref()
                    .is_some_and(|l| l.reason == "QUOTA_EXCEEDED" && l.code == "ResourceExhausted")
                    && m.status.conditions.iter().any(|c| c.reason == "QuotaExceeded")
            })
        }
    })
    .await;
    assert_eq!(quota_blocked.status.phase, Phase::Pending, "quota is not a permanent failure");
    let running = w.machines().await.iter().filter(|m| m.status.phase == Phase::Running).count();
    assert!(running <= 2);

    // A provider spec the driver rejects: Failed with the reason, and no retries.
    w.apply(&class_yaml("{machineType: huge}").replace("name: small", "name: invalid")).await;
    w.apply("apiVersion: machine.driver.dev/v1alpha1\nkind: Machine\nmetadata: {name: lonely}\nspec:\n  classRef: {name: invalid}\n").await;
    let failed = eventually(MINUTE, "machine Failed with INVALID_PROVIDER_SPEC", || {
        let store = store.clone();
        async move {
            let m = store.get::<Machine>("default", "lonely").await.ok()??;
            (m.status.phase == Phase::Failed).then_some(vec![m])
        }
    })
    .await;
    let failure = failed[0].status.failure.as_ref().expect("failure recorded");
    assert_eq!(failure.reason, "INVALID_PROVIDER_SPEC", "{failure:?}");
    // No hot loop: over a 3 s window, the number of cloud API calls stays small. (Observing that
    // nothing happens needs a window of time; nothing is synchronised by it.)
    let before = w.inspect().await.counters.unwrap().api_calls;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = w.inspect().await.counters.unwrap().api_calls;
    assert!(after - before < 40, "{} cloud calls in 3 s: a hot loop", after - before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_rollout_is_aborted_rolled_back_and_not_retried() {
    let w = world(FAST).in_process().start().await;
    w.apply(&class_yaml("{machineType: small}")).await;
    w.apply(&md_yaml("web", 4, "os-1", "1", "0", "  failureBudget: 2\n  maxConcurrentReplacements: 1\n")).await;
    let good = w.converged("web", MINUTE).await.status.current_revision;
    let bad_md = md_yaml("web", 4, "os-bad", "1", "0", "  failureBudget: 2\n  maxConcurrentReplacements: 1\n")
        .replace("providerSpec: {image: os-bad}", "providerSpec: {image: os-bad, simulateFailure: provisioning}");
    w.apply(&bad_md).await;
    let md = eventually(MINUTE, "rollout aborted", || {
        let w = &w;
        async move {
            let md = w.md("web").await;
            (!md.status.bad_revisions.is_empty()).then_some(md)
        }
    })
    .await;
    let bad_rev = md.status.bad_revisions[0].revision.clone();
    assert_ne!(bad_rev, good);
    // Rolled back: every machine on the good revision, running.
    let md = w.converged("web", MINUTE).await;
    assert_eq!(md.status.current_revision, good);
    assert_eq!(md.status.target_revision, good);
    assert!(md.status.conditions.iter().any(|c| c.condition_type == "Progressing" && c.reason == "RolledBack"));
    w.assert_consistent(4).await;
    // The bad revision is not applied again.
    let created = w.inspect().await.counters.unwrap().machines_created;
    w.apply(&bad_md.replace("replicas: 4", "replicas: 4\n  paused: false")).await;
    let md = w.converged("web", MINUTE).await;
    assert_eq!(md.status.target_revision, good);
    assert_eq!(w.inspect().await.counters.unwrap().machines_created, created, "the bad revision was tried again");
    let (code, out, _) = w.cli(&["describe", "md", "web"]).await;
    assert_eq!(code, 0);
    assert!(out.contains("RolloutAborted") && out.contains(&bad_rev), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_yaml_and_invalid_fields_are_refused_and_change_nothing() {
    let w = world(FAST).in_process().start().await;
    w.apply(&class_yaml("{machineType: small}")).await;
    // What apply could change: the class's spec and generation (its status is the controller's).
    let class_state = |json: String| {
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        (v["spec"].clone(), v["metadata"]["generation"].clone())
    };
    let before = class_state(w.cli(&["get", "mc", "small", "-o", "json"]).await.1);
    let cases = [
        ("broken.yaml", "kind: MachineClass\nmetadata: {name: [oops\n", "not valid YAML"),
        ("field.yaml", &md_yaml("web", 3, "os-1", "lots", "0", ""), "spec.strategy.rollingUpdate.maxSurge"),
        ("unknown.yaml", &md_yaml("web", 3, "os-1", "1", "0", "  colour: blue\n"), "unknown field `colour`"),
        ("replicas.yaml", &md_yaml("web", -1, "os-1", "1", "0", ""), "spec.replicas"),
        ("kind.yaml", "apiVersion: machine.driver.dev/v1alpha1\nkind: Gizmo\nmetadata: {name: x}\n", "unknown kind"),
    ];
    for (file, text, needle) in cases {
        // A valid class change travels with the bad document: it must not be applied either.
        let path = w.dir().join(file);
        std::fs::write(&path, format!("{}---\n{text}", class_yaml("{machineType: large}"))).unwrap();
        let (code, out, err) = w.cli(&["apply", "-f", path.to_str().unwrap()]).await;
        assert_eq!(code, 1, "{file}: {out}{err}");
        assert!(err.contains(needle) && err.contains(file), "{file}: error does not name the problem: {err}");
        assert!(err.contains("nothing was applied"), "{err}");
    }
    let after = class_state(w.cli(&["get", "mc", "small", "-o", "json"]).await.1);
    assert_eq!(before, after, "the store changed");
    assert!(w.store().list::<MachineDeployment>().await.unwrap().is_empty());
    let (code, _, err) = w.cli(&["get", "machines", "nope"]).await;
    assert_eq!(code, 1);
    assert!(err.contains("not found"), "{err}");
    let (code, _, err) = w.cli(&["get", "gizmos"]).await;
    assert_eq!(code, 1);
    assert!(err.contains("unknown kind"), "{err}");
}

/// An object whose stored text no longer parses (a store file edited by hand, a damaged
/// restore) is named by `get` and `describe`, never passed over as if it were not there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_stored_object_is_named_not_hidden() {
    let w = world(FAST).without_controller().start().await;
    w.apply(&class_yaml("{machineType: small}")).await;
    let machine = |name: &str| {
        format!("apiVersion: machine.driver.dev/v1alpha1\nkind: Machine\nmetadata: {{name: {name}}}\nspec: {{classRef: {{name: small}}}}\n")
    };
    w.apply(&format!("{}---\n{}", machine("good"), machine("broken"))).await;
    let db = rusqlite::Connection::open(w.dir().join("store.db")).unwrap();
    let changed =
        db.execute("UPDATE objects SET body = '{not json' WHERE kind = 'Machine' AND name = 'broken'", []).unwrap();
    assert_eq!(changed, 1);
    drop(db);
    let named = |err: &str| err.contains("Machine/default/broken: the stored object cannot be read");
    // The list shows what it can read, names what it cannot, and does not exit 0.
    let (code, out, err) = w.cli(&["get", "machines"]).await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("good") && !out.contains("broken"), "{out}");
    assert!(named(&err) && err.contains("1 of 2 Machine objects could not be read"), "{err}");
    let (code, out, err) = w.cli(&["get", "machines", "-o", "json"]).await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("\"good\"") && named(&err), "{out}{err}");
    // Asked for by name, it is found, not "not found".
    let (code, _, err) = w.cli(&["get", "machine", "broken"]).await;
    assert_eq!(code, 1);
    assert!(named(&err) && !err.contains("not found"), "{err}");
    let (code, _, err) = w.cli(&["describe", "machine", "broken"]).await;
    assert_eq!(code, 1);
    assert!(named(&err), "{err}");
    // The readable one reads as before.
    let (code, out, err) = w.cli(&["get", "machine", "good"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("good"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_place_strategy_updates_machines_without_replacing_them() {
    let w = world(FAST).in_process().start().await;
    w.apply(&class_yaml("{machineType: small}")).await;
    let strategy = |ty: &str| {
        format!(
            "apiVersion: machine.driver.dev/v1alpha1
kind: MachineDeployment
metadata: {{name: web}}
spec:
  replicas: 3
  template:
    spec:
      classRef: {{name: small}}
      providerSpec: {{machineType: {ty}}}
  strategy:
    type: InPlace
    inPlace: {{maxUnavailable: 1, fallbackToReplace: true}}
"
        )
    };
    w.apply(&strategy("small")).await;
    w.converged("web", MINUTE).await;
    let ids: HashSet<String> = w.machines().await.iter().map(|m| m.status.provider_id.clone()).collect();
    w.apply(&strategy("medium")).await;
    let md = w.converged("web", MINUTE).await;
    let after: HashSet<String> = w.machines().await.iter().map(|m| m.status.provider_id.clone()).collect();
    assert_eq!(ids, after, "machines were replaced instead of updated in place");
    assert_eq!(w.inspect().await.counters.unwrap().machines_created, 3);
    assert!(w
        .machines()
        .await
        .iter()
        .all(|m| m.metadata.labels.get(LABEL_REVISION) == Some(&md.status.current_revision)));
    let hashes: HashSet<String> = w.inspect().await.machines.iter().map(|m| m.spec_hash.clone()).collect();
    assert_eq!(hashes.len(), 1, "all machines run the same spec");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machine_pool_scales_rolls_and_deletes_one_instance() {
    let w = world(FAST).in_process().start().await;
    w.apply(&class_yaml("{machineType: small}")).await;
    let pool = |ty: &str, replicas: i64| {
        format!(
            "apiVersion: machine.driver.dev/v1alpha1
kind: MachinePool
metadata: {{name: workers}}
spec:
  replicas: {replicas}
  template:
    spec:
      classRef: {{name: small}}
      providerSpec: {{machineType: {ty}}}
  strategy: {{maxSurge: 1, maxUnavailable: 0}}
"
        )
    };
    w.apply(&pool("small", 3)).await;
    let store = w.store();
    let ready = |n: usize| {
        let store = store.clone();
        move || {
            let store = store.clone();
            async move {
                let p = store.get::<MachinePool>("default", "workers").await.map_err(|e| e.to_string())?;
                let p = p.ok_or("no pool")?;
                let ms = store.list::<Machine>().await.map_err(|e| e.to_string())?;
                let live = ms.iter().filter(|m| !m.is_deleting() && m.status.phase == Phase::Running).count();
                let s = &p.status;
                if s.ready_replicas == n as i64 && s.updated_replicas == n as i64 && s.replicas == n as i64 && live == n
                {
                    return Ok(());
                }
                let machines: Vec<String> = ms
                    .iter()
                    .map(|m| format!("{} {:?} deleting={}", m.metadata.name, m.status.phase, m.is_deleting()))
                    .collect();
                Err(format!(
                    "pool replicas {} ready {} updated {} (conditions {:?}, operations {:?}); machines {machines:?}",
                    s.replicas, s.ready_replicas, s.updated_replicas, s.conditions, s.operations
                ))
            }
        }
    };
    eventually_seen(MINUTE, "pool scaled out to 3", ready(3)).await;
    w.apply(&pool("large", 3)).await;
    eventually_seen(MINUTE, "pool rolled to the new model", ready(3)).await;
    let cloud = w.inspect().await;
    let p = &cloud.pools[0];
    assert_eq!(p.instances.len(), 3);
    assert!(p.instances.iter().all(|i| i.latest_model_applied));

    // Delete exactly one pool machine: that instance goes, and the pool refills to 3.
    let victim = w.machines().await.into_iter().next().unwrap();
    let victim_id = victim.spec.pool_ref.clone().unwrap().instance_id;
    let (code, out, err) = w.cli(&["delete", "machine", &victim.metadata.name]).await;
    assert_eq!(code, 0, "{out}{err}");
    eventually(MINUTE, "the instance deleted and replaced", || {
        let w = &w;
        let victim_id = victim_id.clone();
        async move {
            let cloud = w.inspect().await;
            let p = cloud.pools.first()?;
            let ids: Vec<&str> = p.instances.iter().map(|i| i.instance_id.as_str()).collect();
            (!ids.contains(&victim_id.as_str()) && ids.len() == 3).then_some(())
        }
    })
    .await;
    eventually_seen(MINUTE, "pool ready again", ready(3)).await;
}

/// A pool of 3 with a canary of 1 and a short pause: the new model reaches one instance first,
/// which pauses (`status.canary` Pausing, shown by describe) while the other three stay on the old
/// model; then the upgrade finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_canary_upgrades_one_instance_first_pauses_then_finishes() {
    let w = world(FAST).in_process().start().await;
    w.apply(&class_yaml("{machineType: small}")).await;
    let pool = |ty: &str| {
        format!(
            "apiVersion: machine.driver.dev/v1alpha1
kind: MachinePool
metadata: {{name: workers}}
spec:
  replicas: 3
  template:
    spec:
      classRef: {{name: small}}
      providerSpec: {{machineType: {ty}}}
  strategy: {{maxSurge: 3, maxUnavailable: 0, canary: {{machines: 1, pauseSeconds: 4}}}}
"
        )
    };
    w.apply(&pool("small")).await;
    let store = w.store();
    let get = || {
        let store = store.clone();
        async move { store.get::<MachinePool>("default", "workers").await.ok().flatten() }
    };
    eventually(MINUTE, "pool of 3 ready", || async {
        let p = get().await?;
        (p.status.ready_replicas == 3 && p.status.updated_replicas == 3 && p.status.replicas == 3).then_some(())
    })
    .await;
    assert!(get().await.unwrap().status.canary.is_none(), "a pool's first apply has no canary");

    w.apply(&pool("large")).await;
    let canary = eventually(MINUTE, "the canary pausing", || async {
        get().await?.status.canary.filter(|k| k.phase == CanaryPhase::Pausing)
    })
    .await;
    // maxSurge 3, yet one instance of the new model only, and the old ones all there.
    let cloud = w.inspect().await;
    let instances = &cloud.pools[0].instances;
    let new: Vec<&str> = instances.iter().filter(|i| i.latest_model_applied).map(|i| i.instance_id.as_str()).collect();
    assert_eq!(new.len(), 1, "{instances:?}");
    assert_eq!(instances.len(), 4, "{instances:?}");
    assert_eq!((canary.wanted, canary.machines.len()), (1, 1));
    assert_eq!(canary.machines[0], format!("workers-{}", new[0]));
    assert!(canary.ready_since.is_some() && canary.pause_until.is_some(), "{canary:?}");
    let (code, described, err) = w.cli(&["describe", "machinepool", "workers"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(described.contains(&format!("Canary:       revision {} Pausing", canary.revision)), "{described}");
    assert!(described.contains("Pause until:"), "{described}");

    let done = eventually(MINUTE, "the upgrade finished after the canary", || async {
        let p = get().await?;
        let passed = p.status.canary.as_ref().is_some_and(|k| k.phase == CanaryPhase::Passed);
        (passed && p.status.ready_replicas == 3 && p.status.updated_replicas == 3 && p.status.replicas == 3)
            .then_some(p)
    })
    .await;
    let k = done.status.canary.unwrap();
    assert_eq!(k.revision, canary.revision);
    assert_eq!(k.ready_since, canary.ready_since, "the pause ran from when the canary was ready");
    assert_eq!(k.machines, canary.machines);
    let (_, described, _) = w.cli(&["describe", "machinepool", "workers"]).await;
    assert!(described.contains("CanaryPassed"), "{described}");
    let cloud = w.inspect().await;
    assert_eq!(cloud.pools[0].instances.len(), 3);
    assert!(cloud.pools[0].instances.iter().all(|i| i.latest_model_applied));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphans_tagged_by_this_controller_are_collected() {
    let w =
        world(FAST).controller_args(&["--orphan-interval", "300ms", "--orphan-grace", "1s"]).in_process().start().await;
    w.apply(&class_yaml("{machineType: small}")).await;
    w.apply(&md_yaml("web", 1, "os-1", "1", "0", "")).await;
    w.converged("web", MINUTE).await;
    // A machine in the cloud tagged as ours with no Machine, and one that is not ours.
    let client = w.driver_client().await;
    let spec = Some(driver_sdk::convert::json_to_struct(&serde_json::json!({"machineType": "small"})));
    for (name, tags) in [
        ("orphan-1", vec![(TAG_CONTROLLER, "machine-controller"), (TAG_MACHINE, "default.gone")]),
        ("foreign-1", vec![("owner", "someone-else")]),
    ] {
        let labels = tags.into_iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        client
            .create_machine(driver_sdk::proto::CreateMachineRequest {
                name: name.into(),
                provider_spec: spec.clone(),
                labels,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    eventually(MINUTE, "the orphan deleted", || {
        let w = &w;
        async move {
            let names: Vec<String> = w.inspect().await.machines.into_iter().map(|m| m.name).collect();
            (!names.iter().any(|n| n == "orphan-1")).then_some(names)
        }
    })
    .await;
    let names: Vec<String> = w.inspect().await.machines.into_iter().map(|m| m.name).collect();
    assert!(names.contains(&"foreign-1".to_string()), "a machine not tagged as ours was deleted");
    assert_eq!(names.len(), 2, "{names:?}");
    let (_, out, _) = w.cli(&["describe", "mc", "small"]).await;
    assert!(out.contains("OrphanDeleted") && out.contains("orphan-1"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_shows_status_request_ids_and_deletes_through_the_cloud() {
    let w = world(FAST).start().await;
    w.apply(&class_yaml("{machineType: small}")).await;
    w.apply(&md_yaml("web", 2, "os-1", "1", "0", "")).await;
    w.converged("web", MINUTE).await;
    let (code, out, _) = w.cli(&["get", "machines", "-o", "wide"]).await;
    assert_eq!(code, 0);
    assert!(out.contains("PROVIDER-ID") && out.contains("fake:///zone-a/") && out.contains("Running"), "{out}");
    let m = w.machines().await.remove(0);
    let (code, out, _) = w.cli(&["describe", "machine", &m.metadata.name]).await;
    assert_eq!(code, 0);
    let last = m.status.last_operation.unwrap();
    assert!(out.contains(&last.request_id) && out.contains("Ready"), "{out}");
    // That they run is told on their deployment, as a ReplicaSet tells of its pods: in one event
    // series, the first machine's message and the count, as on the API server.
    let (code, out, _) = w.cli(&["describe", "md", "web"]).await;
    assert_eq!(code, 0);
    let told = w.machines().await.iter().any(|m| out.contains(&format!("{} is running", m.metadata.name)));
    assert!(out.contains("Created") && told && out.contains(") (x2)"), "{out}");
    let created = out.lines().filter(|l| l.contains("Normal") && l.contains(" Created ")).count();
    assert_eq!(created, 1, "one event for both: {out}");
    // The request ID the controller recorded is in the sidecar's log for the same call.
    let rid = m.status.request_ids[0].clone();
    assert!(w.sidecar().log_text().contains(&rid), "request {rid} not in the sidecar log");
    let (code, out, _) = w.cli(&["rollout", "status", "web", "--timeout", "30s"]).await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("successfully rolled out"), "{out}");
    let (code, _, _) = w.cli(&["delete", "md", "web"]).await;
    assert_eq!(code, 0);
    eventually(MINUTE, "everything deleted", || {
        let w = &w;
        async move { (w.inspect().await.machines.is_empty() && w.machines().await.is_empty()).then_some(()) }
    })
    .await;
}

/// Secret `creds` with the fake's `apiKey`.
fn creds_yaml(key: &str) -> String {
    format!("apiVersion: v1\nkind: Secret\nmetadata: {{name: creds}}\nstringData: {{apiKey: {key}}}\n")
}

/// Class `small` that sends Secret `creds` with every call.
fn class_with_creds_yaml() -> String {
    class_yaml("{machineType: small}").replace("  providerSpec:", "  secretRef: {name: creds}\n  providerSpec:")
}

fn md_condition<'a>(md: &'a MachineDeployment, kind: &str) -> Option<&'a Condition> {
    md.status.conditions.iter().find(|c| c.condition_type == kind && c.status == "True")
}

/// A wrong API key in the class's Secret is the environment's fault, not the revision's: the
/// deployment says so in a condition, nothing is marked Failed or bad, and fixing the Secret
/// brings it to its replicas at once, with no template change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_recover_when_the_secret_is_fixed_without_a_template_change() {
    let w = world(&["--api-key", "the-right-key", "--create-latency", "300ms", "--delete-latency", "200ms"])
        .in_process()
        .start()
        .await;
    w.apply(&creds_yaml("a-wrong-key")).await;
    w.apply(&class_with_creds_yaml()).await;
    w.apply(&md_yaml("web", 2, "os-1", "1", "0", "  failureBudget: 1\n")).await;
    let store = w.store();
    // Let the refusals repeat until each machine's next retry is several seconds away.
    let md = eventually(MINUTE, "credential refusals with a grown backoff", || {
        let (w, store) = (&w, store.clone());
        async move {
            let md = w.md("web").await;
            let machines = store.list::<Machine>().await.ok()?;
            // Five refused attempts each: the next retry is 8–16 s away (1 s base, doubling, jitter).
            let retried = machines.len() == 2 && machines.iter().all(|m| m.status.request_ids.len() >= 5);
            (retried && md_condition(&md, "CloudCredentialsRefused").is_some()).then_some(md)
        }
    })
    .await;
    // Backoff, not a hot loop: over a 3 s window the refused calls stay few. (Observing that
    // nothing happens needs a window of time; nothing is synchronised by it.)
    let before = w.inspect().await.counters.unwrap().api_calls;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let calls = w.inspect().await.counters.unwrap().api_calls - before;
    assert!(calls <= 4, "{calls} cloud calls in 3 s while the credentials are refused: a hot loop");
    let c = md_condition(&md, "CloudCredentialsRefused").unwrap();
    assert_eq!(c.reason, "CloudAuthFailed", "{c:?}");
    assert!(c.message.contains("request "), "the condition names a request ID: {c:?}");
    let available = md.status.conditions.iter().find(|c| c.condition_type == "Available").unwrap();
    assert_eq!((available.status.as_str(), available.reason.as_str()), ("False", "CloudCredentialsRefused"));
    assert!(md.status.bad_revisions.is_empty(), "the revision was blamed: {:?}", md.status.bad_revisions);
    let machines = w.machines().await;
    assert_eq!(machines.len(), 2, "no replacements for a credential failure");
    assert!(
        machines.iter().all(|m| m.status.phase == Phase::Pending),
        "{:?}",
        machines.iter().map(|m| m.status.phase).collect::<Vec<_>>()
    );
    assert!(w.inspect().await.machines.is_empty());
    let (code, out, err) = w.cli(&["describe", "md", "web"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("CloudCredentialsRefused") && out.contains("CloudAuthFailed"), "{out}");

    // Fix the Secret: the machines retry at once (their backoff is forgotten), no template change.
    let fixed = std::time::Instant::now();
    w.apply(&creds_yaml("the-right-key")).await;
    let after = w.converged("web", MINUTE).await;
    let took = fixed.elapsed();
    // Without the wake-up the last machine to be refused would wait at least 8 s more.
    assert!(took < Duration::from_secs(7), "recovered {took:?} after the fix: it waited out the backoff");
    assert_eq!(after.metadata.generation, md.metadata.generation, "the template did not change");
    assert!(md_condition(&after, "CloudCredentialsRefused").is_none());
    assert!(after.status.bad_revisions.is_empty());
    w.assert_consistent(2).await;
}

/// Quota is the environment too: a condition while it lasts, then recovery when it is raised.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_refusals_set_a_condition_and_recover_when_the_quota_is_raised() {
    let w = world(FAST).in_process().start().await;
    let mut quota = rule("CreateMachine", "error", "RESOURCE_EXHAUSTED", 0, 0);
    quota.reason = "QUOTA_EXCEEDED".into();
    quota.message = "vCPU quota of the region reached".into();
    w.set_faults(vec![quota]).await;
    w.apply(&class_yaml("{machineType: small}")).await;
    w.apply(&md_yaml("web", 2, "os-1", "1", "0", "  failureBudget: 1\n")).await;
    let md = eventually(MINUTE, "QuotaExceeded on the deployment", || {
        let w = &w;
        async move {
            let md = w.md("web").await;
            md_condition(&md, "QuotaExceeded").is_some().then_some(md)
        }
    })
    .await;
    assert!(md_condition(&md, "QuotaExceeded").unwrap().message.contains("vCPU quota"), "{:?}", md.status.conditions);
    assert!(md.status.bad_revisions.is_empty());
    let (_, out, _) = w.cli(&["describe", "md", "web"]).await;
    assert!(out.contains("QuotaExceeded"), "{out}");
    // The quota is raised.
    w.set_faults(vec![]).await;
    let after = w.converged("web", MINUTE).await;
    assert!(md_condition(&after, "QuotaExceeded").is_none());
    assert!(after.status.bad_revisions.is_empty());
    w.assert_consistent(2).await;
}

/// A revision that genuinely fails (its machines fail provisioning) on a first rollout: aborted,
/// remembered as bad, and the deployment says there is no earlier revision to roll back to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_first_revision_is_aborted_with_nothing_to_roll_back_to() {
    let w = world(FAST).in_process().start().await;
    w.apply(&class_yaml("{machineType: small}")).await;
    w.set_faults(vec![rule("CreateMachine", "fail_operation", "INTERNAL", 0, 0)]).await;
    w.apply(&md_yaml("web", 2, "os-bad", "1", "0", "  failureBudget: 2\n  maxConcurrentReplacements: 1\n")).await;
    let md = eventually(MINUTE, "rollout aborted", || {
        let w = &w;
        async move {
            let md = w.md("web").await;
            (!md.status.bad_revisions.is_empty()).then_some(md)
        }
    })
    .await;
    let progressing = md.status.conditions.iter().find(|c| c.condition_type == "Progressing").unwrap();
    assert!(["RolloutAborted", "NoGoodRevision"].contains(&progressing.reason.as_str()), "{progressing:?}");
    assert!(progressing.message.contains("no earlier revision to roll back to"), "{progressing:?}");
    let available = md.status.conditions.iter().find(|c| c.condition_type == "Available").unwrap();
    assert_eq!(available.status, "False", "{available:?}");
    let (_, out, _) = w.cli(&["describe", "md", "web"]).await;
    assert!(out.contains("no earlier revision to roll back to"), "{out}");
    // Replacements were paced, not a burst: the budget of 2 took two failures, one replaced.
    let c = w.inspect().await.counters.unwrap();
    assert!(c.machines_created <= 4, "{} machines created for a budget of 2", c.machines_created);
}

/// The same for a MachinePool: a refused credential is a condition on the pool until the
/// Secret is fixed, then the pool fills without a template change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_with_refused_credentials_recovers_when_the_secret_is_fixed() {
    let w = world(&["--api-key", "the-right-key", "--pool-latency", "300ms", "--create-latency", "300ms"])
        .in_process()
        .start()
        .await;
    w.apply(&creds_yaml("a-wrong-key")).await;
    w.apply(&class_with_creds_yaml()).await;
    w.apply(
        "apiVersion: machine.driver.dev/v1alpha1
kind: MachinePool
metadata: {name: workers}
spec:
  replicas: 2
  template:
    spec:
      classRef: {name: small}
  strategy: {maxSurge: 1, maxUnavailable: 0}
",
    )
    .await;
    let store = w.store();
    let pool = eventually(MINUTE, "CloudCredentialsRefused on the pool", || {
        let store = store.clone();
        async move {
            let p = store.get::<MachinePool>("default", "workers").await.ok()??;
            p.status
                .conditions
                .iter()
                .any(|c| c.condition_type == "CloudCredentialsRefused" && c.reason == "CloudAuthFailed")
                .then_some(p)
        }
    })
    .await;
    let (_, out, _) = w.cli(&["describe", "mp", "workers"]).await;
    assert!(out.contains("CloudCredentialsRefused"), "{out}");
    w.apply(&creds_yaml("the-right-key")).await;
    let ready = eventually(MINUTE, "the pool filled", || {
        let store = store.clone();
        async move {
            let p = store.get::<MachinePool>("default", "workers").await.ok()??;
            (p.status.ready_replicas == 2).then_some(p)
        }
    })
    .await;
    assert_eq!(ready.metadata.generation, pool.metadata.generation);
    assert!(ready.status.conditions.iter().all(|c| c.condition_type != "CloudCredentialsRefused"));
}

/// Every kind of unusable stored operation token takes the same safe path: dropped, an event
/// says why, the driver is asked again by name, and each machine ends Running, created once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unusable_stored_tokens_are_dropped_and_each_machine_is_created_once() {
    use base64::Engine;
    use driver_sdk::{Operation, OperationKind, TokenCodec, TokenKey};
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut w = world(&["--create-latency", "3s", "--delete-latency", "200ms"]).start().await;
    w.apply(&class_yaml("{machineType: small}")).await;
    w.apply(&md_yaml("web", 6, "os-1", "1", "0", "")).await;
    eventually(MINUTE, "six creates in flight", || {
        let w = &w;
        async move {
            let ms = w.machines().await;
            (ms.len() == 6 && ms.iter().all(|m| !m.status.operations.is_empty())).then_some(())
        }
    })
    .await;
    w.kill9().await;
    let sealed_by = |key: TokenKey, driver: &str| {
        let op = Operation::running(OperationKind::CreateMachine, "x", serde_json::json!({"id": "op-1"}));
        b64.encode(TokenCodec::new(key, driver).seal(&op))
    };
    let other_key = TokenKey::try_new(b"a different key of enough length".to_vec()).unwrap();
    /// Turns a valid token into the broken one of a case.
    type Mangle<'a> = Box<dyn Fn(&str) -> String + 'a>;
    let cases: Vec<(&str, Mangle<'_>)> = vec![
        ("undecodable", Box::new(|_| "%%% not base64 %%%".to_string())),
        ("empty", Box::new(|_| String::new())),
        ("truncated", Box::new(|t: &str| b64.encode(&b64.decode(t).unwrap()[..10]))),
        (
            "unknown version",
            Box::new(|t: &str| {
                let mut bytes = b64.decode(t).unwrap();
                bytes[0] = 9;
                b64.encode(bytes)
            }),
        ),
        ("wrong key", Box::new(move |_| sealed_by(other_key.clone(), fake_driver::DRIVER_NAME))),
        ("foreign driver", Box::new(move |_| sealed_by(TokenKey::dev(), "someone-elses-driver.example.com"))),
    ];
    let store = w.store();
    let mut machines = w.machines().await;
    machines.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    for (m, (what, corrupt)) in machines.iter().zip(&cases) {
        let mut next = m.clone();
        next.status.operations[0].token = corrupt(&m.status.operations[0].token);
        store.replace_status(&next).await.unwrap_or_else(|e| panic!("planting the {what} token: {e}"));
    }
    w.start_controller(&[]);
    w.converged("web", MINUTE).await;
    w.assert_consistent(6).await;
    for (m, (what, _)) in machines.iter().zip(&cases) {
        let (code, out, err) = w.cli(&["describe", "machine", &m.metadata.name]).await;
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("OperationTokenUnusable"), "{what}: no event in\n{out}");
    }
}

#[tokio::test]
async fn rotating_the_token_key_mid_rollout_loses_no_operation() {
    use driver_sdk::{TokenCodec, TokenKey};
    let keys = tempfile::tempdir().unwrap();
    let key_file = keys.path().join("token-keys");
    let (old, new) = ("old-token-key-0123456789abcdef", "new-token-key-0123456789abcdef");
    std::fs::write(&key_file, format!("{old}\n")).unwrap();
    let file = key_file.to_str().unwrap();
    let w = world(&["--create-latency", "2s", "--token-key-file", file, "--token-key-reload-interval", "100ms"])
        .start()
        .await;
    w.apply(&class_yaml("{machineType: small}")).await;
    w.apply(&md_yaml("web", 4, "os-1", "1", "0", "")).await;
    let stored_tokens = |w: &World| {
        let store = w.store();
        async move {
            let ms = store.list::<Machine>().await.ok()?;
            let tokens: Vec<String> =
                ms.iter().filter_map(|m| m.status.operations.first()).map(|o| o.token.clone()).collect();
            Some(tokens)
        }
    };
    let world = &w;
    eventually(MINUTE, "four creates in flight, sealed with the old key", || async move {
        stored_tokens(world).await.filter(|t| t.len() == 4)
    })
    .await;
    // Step 1 of the rotation: the new key seals, the old one still verifies.
    std::fs::write(&key_file, format!("# rotating\n{new}\n{old}\n")).unwrap();
    let reloads = |w: &World| w.sidecar().log_text().matches("reloaded the operation token keys").count();
    eventually(MINUTE, "the sidecar reloads its keys", || async move { (reloads(world) >= 1).then_some(()) }).await;
    w.converged("web", MINUTE).await;
    w.assert_consistent(4).await;
    // Step 2: once no token sealed with the old key is stored any more, drop it.
    std::fs::write(&key_file, format!("{new}\n")).unwrap();
    eventually(MINUTE, "the sidecar reloads its keys again", || async move { (reloads(world) >= 2).then_some(()) })
        .await;
    w.apply(&md_yaml("web", 6, "os-1", "1", "0", "")).await;
    let only_new = TokenCodec::new(TokenKey::try_new(new.as_bytes().to_vec()).unwrap(), fake_driver::DRIVER_NAME);
    let token = eventually(MINUTE, "a create sealed after the rotation", || async move {
        stored_tokens(world).await.and_then(|t| t.into_iter().next())
    })
    .await;
    use base64::Engine;
    let raw = base64::engine::general_purpose::STANDARD.decode(token).unwrap();
    assert!(only_new.open(&raw).is_ok(), "a token stored after the rotation is not sealed with the new key");
    w.converged("web", MINUTE).await;
    w.assert_consistent(6).await;
    for m in w.machines().await {
        let (code, out, err) = w.cli(&["describe", "machine", &m.metadata.name]).await;
        assert_eq!(code, 0, "{err}");
        assert!(
            !out.contains("OperationTokenUnusable"),
            "{}: a token was lost in the rotation:\n{out}",
            m.metadata.name
        );
    }
    assert!(!w.sidecar().log_text().contains(old) && !w.sidecar().log_text().contains(new), "a key was logged");
}

/// A store layer that loses the first remediation mark written to a Machine, as a concurrent
/// writer would make it lose (a conflict), and records what the controller wrote to Machines:
/// `create NAME`, `mark lost NAME`, `mark NAME`, `delete NAME`.
struct LoseFirstMark {
    inner: Arc<dyn machine_controller::store::Backend>,
    lost: std::sync::atomic::AtomicBool,
    writes: Arc<std::sync::Mutex<Vec<String>>>,
}

mod lose_first_mark {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    use machine_controller::registry::Kind;
    use machine_controller::resources::ANNOTATION_DISRUPTION;
    use machine_controller::store::{Backend, Change, Error, Event, Key, Result};
    use serde_json::Value;
    use tokio::sync::broadcast;

    use super::LoseFirstMark;

    impl LoseFirstMark {
        fn note(&self, what: String) {
            self.writes.lock().unwrap_or_else(|p| p.into_inner()).push(what);
        }
    }

    fn name(obj: &Value) -> String {
        obj["metadata"]["name"].as_str().unwrap_or_default().to_string()
    }

    #[async_trait::async_trait]
    impl Backend for LoseFirstMark {
        async fn get(&self, key: &Key) -> Result<Option<Arc<str>>> {
            self.inner.get(key).await
        }
        async fn list(&self, kind: Kind) -> Result<Vec<Arc<str>>> {
            self.inner.list(kind).await
        }
        async fn scan_with(
            &self,
            kind: Kind,
            visit: &mut (dyn for<'t> FnMut(&'t str) -> Result<()> + Send),
            unreadable: &mut (dyn FnMut(Key, serde_json::Error) -> Result<()> + Send),
        ) -> Result<()> {
            self.inner.scan_with(kind, visit, unreadable).await
        }
        async fn count(&self, kind: Kind) -> Option<usize> {
            self.inner.count(kind).await
        }
        async fn keys(&self, kind: Kind) -> Result<Vec<Key>> {
            self.inner.keys(kind).await
        }
        async fn create(&self, kind: Kind, obj: Value) -> Result<Arc<str>> {
            let n = name(&obj);
            let created = self.inner.create(kind, obj).await?;
            if kind == Kind::Machine {
                self.note(format!("create {n}"));
            }
            Ok(created)
        }
        async fn update(&self, kind: Kind, obj: Value) -> Result<Option<Arc<str>>> {
            let n = name(&obj);
            let marks = obj["metadata"]["annotations"][ANNOTATION_DISRUPTION] == "Remediation";
            let key = Key::new(kind, obj["metadata"]["namespace"].as_str().unwrap_or("default"), &n);
            let stored = self.inner.get(&key).await?;
            let marked = stored.as_deref().is_some_and(|s| s.contains("\"machine.driver.dev/disruption-reason\""));
            if kind == Kind::Machine && marks && !marked {
                if !self.lost.swap(true, Ordering::SeqCst) {
                    self.note(format!("mark lost {n}"));
                    let expected = obj["metadata"]["resourceVersion"].as_str().unwrap_or_default().to_string();
                    return Err(Error::Conflict { key, expected, actual: "written by someone else".into() });
                }
                let written = self.inner.update(kind, obj).await?;
                self.note(format!("mark {n}"));
                return Ok(written);
            }
            self.inner.update(kind, obj).await
        }
        async fn replace_status(&self, kind: Kind, json: String) -> Result<Option<Arc<str>>> {
            self.inner.replace_status(kind, json).await
        }
        async fn delete(&self, key: &Key) -> Result<Option<Arc<str>>> {
            if key.kind == Kind::Machine {
                self.note(format!("delete {}", key.name));
            }
            self.inner.delete(key).await
        }
        fn subscribe(&self) -> broadcast::Receiver<Change> {
            self.inner.subscribe()
        }
        async fn record_event(&self, event: Event) -> Result<()> {
            self.inner.record_event(event).await
        }
        async fn events(&self, key: &Key, limit: usize) -> Result<Vec<Event>> {
            self.inner.events(key, limit).await
        }
    }
}

/// A remediation mark lost to a conflicting write leaves nothing behind: the plan that marks
/// does nothing else, so no replacement is created for the lost mark and no machine removed in
/// its place; the next plan marks again, and only then the replacement comes and the machine goes
/// — as a remediation (its event), not as a scale-down of one machine too many. The conflict is
/// injected at the store's trait (the controller's one seam for it): the first write of the mark
/// answers Conflict, as a concurrent writer would make it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remediation_mark_lost_to_a_conflict_creates_and_removes_nothing_until_it_lands() {
    let writes = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let log = writes.clone();
    let w = world(FAST)
        .in_process()
        .store_layer(move |inner| {
            Arc::new(LoseFirstMark { inner, lost: Default::default(), writes: log.clone() })
                as Arc<dyn machine_controller::store::Backend>
        })
        .start()
        .await;
    w.apply(&class_yaml("{machineType: small}")).await;
    w.apply(&md_yaml("web", 3, "os-1", "1", "0", "")).await;
    w.converged("web", MINUTE).await;
    let created = w.inspect().await.counters.unwrap().machines_created;
    let machines = w.machines().await;
    let victim = machines[0].metadata.name.clone();
    writes.lock().unwrap().clear();

    // Ask for the victim's remediation (as `kubectl annotate` would).
    let store = w.store();
    w.wait_for("the remediate annotation written", MINUTE, || {
        let (store, ns, victim) = (store.clone(), w.ns().to_string(), victim.clone());
        async move {
            let mut m = store.get::<Machine>(&ns, &victim).await.ok().flatten()?;
            m.metadata.annotations.insert(ANNOTATION_REMEDIATE.into(), "true".into());
            store.update(&m).await.ok()
        }
    })
    .await;
    let md = w
        .wait_for("the victim remediated", MINUTE, || async {
            let machines = w.machines().await;
            let md = w.md("web").await;
            let done = machines.len() == 3 && machines.iter().all(|m| m.metadata.name != victim);
            (done && e2e_tests::rolled_out(&md)).then_some(md)
        })
        .await;
    let seen = writes.lock().unwrap().clone();
    eprintln!("writes to Machines: {seen:?}");
    let at = |what: &str| seen.iter().position(|s| s == what).unwrap_or_else(|| panic!("no {what:?} in {seen:?}"));
    let (lost, marked, deleted) =
        (at(&format!("mark lost {victim}")), at(&format!("mark {victim}")), at(&format!("delete {victim}")));
    assert!(lost < marked && marked < deleted, "{seen:?}");
    assert!(
        seen[..marked].iter().all(|s| !s.starts_with("create ") && !s.starts_with("delete ")),
        "nothing was created or removed before the mark landed: {seen:?}"
    );
    let creates: Vec<&String> = seen.iter().filter(|s| s.starts_with("create ")).collect();
    assert_eq!(creates.len(), 1, "one replacement: {seen:?}");
    assert!(seen.iter().filter(|s| s.starts_with("delete ")).all(|s| *s == format!("delete {victim}")), "{seen:?}");
    assert_eq!(w.inspect().await.counters.unwrap().machines_created, created + 1);
    assert_eq!(md.status.disruption.remediation.in_flight, 0);
    let events = w
        .store()
        .backend()
        .events(&machine_controller::store::Key::new(Kind::Machine, w.ns(), &victim), 20)
        .await
        .unwrap();
    assert!(events.iter().any(|e| e.reason == "Remediating"), "{events:?}");
}

/// The controller's /metrics, with every family of a working deployment in it (phases, driver
/// calls, conditions, owners' replicas, transitions), passes `promtool check metrics`, the
/// Prometheus project's own lint of names, types, units and help. Its one complaint is
/// OpenMetrics' own convention: a counter's `# HELP` names the family without `_total`, which
/// promtool, reading it as the older text format, reports as "no help text".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_pass_promtool_check_metrics() {
    let w = world(FAST).metrics().start().await;
    w.apply(&class_yaml("{machineType: small}")).await;
    w.apply(&md_yaml("web", 2, "os-1", "1", "0", "")).await;
    w.converged("web", MINUTE).await;
    w.apply(&md_yaml("web", 2, "os-2", "1", "0", "")).await;
    w.converged("web", MINUTE).await;
    let port = w.metrics_addr(0).await.port();
    // The state metrics are recounted every few seconds: wait for a transition to be counted.
    let body = eventually(MINUTE, "the condition transitions counted", || async move {
        let (status, body) = e2e_tests::http_get(port, "/metrics").await?;
        (status == 200 && body.contains("controller_condition_transitions_total{")).then_some(body)
    })
    .await;
    for family in ["controller_conditions{", "controller_owner_replicas{", "controller_driver_calls_total{"] {
        assert!(body.contains(family), "no {family} in\n{body}");
    }
    let file = w.dir().join("metrics.txt");
    std::fs::write(&file, &body).unwrap();
    let out = std::process::Command::new("bash")
        .args(["-c", &format!("promtool check metrics < {}", file.display())])
        .output()
        .expect("promtool (cargo xtask install installs it)");
    let complaints = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    for line in complaints.lines().filter(|l| !l.trim().is_empty()) {
        let (name, problem) = line.split_once(' ').unwrap_or((line, ""));
        let family = name.strip_suffix("_total").unwrap_or(name);
        assert!(
            problem == "no help text" && name.ends_with("_total") && body.contains(&format!("# HELP {family} ")),
            "promtool check metrics: {line}\n{body}"
        );
    }
}
