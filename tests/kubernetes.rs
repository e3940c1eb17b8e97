//! The Kubernetes backend on a real kube-apiserver + etcd: CRDs, reconciling objects created
//! through the API, operations in `.status`, rolling updates, kill -9, leader election with two
//! replicas, deletion behind finalizers, the scale subresource, events, and the deploy/ manifests
//! under server-side dry-run. The fake-driver sidecar is a real process on a Unix socket; its
//! inspection API is the ground truth for what the cloud did.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e_tests::kube_cluster::Cluster;
use e2e_tests::world::{Driver, World};
use e2e_tests::{bin, eventually, http_get, run};
use fake_driver::pb as fake;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use machine_controller::resources::*;
use machine_controller::store::kubernetes::KubernetesBackend;
use machine_controller::store::Store;
use serde_json::{json, Value};
use tokio::process::Command;

const MINUTE: Duration = Duration::from_secs(60);

fn ar(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("machine.driver.dev", "v1alpha1", kind), plural)
}

/// One test's world: a control plane, a namespace, a fake sidecar; controllers are started by
/// the test. These tests are about the store; the node tests (tests/nodes.rs) run a whole cluster.
async fn world(fake_args: &[&str]) -> World {
    World::builder()
        .driver(Driver::fake(fake_args))
        .kubernetes(Cluster::start().await, "t")
        .controller_args(&["--no-target-cluster", "--resync-interval", "5s"])
        .metrics()
        .without_controller()
        .start()
        .await
}

/// The objects these tests apply.
trait Objects {
    async fn class(&self);
    async fn apply_md(&self, name: &str, replicas: i64, image: &str, surge: &str, unavailable: &str);
}

impl Objects for World {
    async fn class(&self) {
        self.apply_object(
            "MachineClass",
            "machineclasses",
            json!({"metadata": {"name": "small"},
            "spec": {"driver": "fake", "providerSpec": {"machineType": "small"}}}),
        )
        .await;
    }

    async fn apply_md(&self, name: &str, replicas: i64, image: &str, surge: &str, unavailable: &str) {
        self.apply_object(
            "MachineDeployment",
            "machinedeployments",
            json!({"metadata": {"name": name}, "spec": {
            "replicas": replicas,
            "template": {"spec": {"classRef": {"name": "small"}, "providerSpec": {"image": image}}},
            "strategy": {"rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}}}}),
        )
        .await;
    }
}

const FAST: &[&str] = &["--create-latency", "300ms", "--delete-latency", "200ms", "--update-latency", "200ms"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crds_install_and_the_api_server_rejects_invalid_objects() {
    let cluster = Cluster::start().await;
    let ns = cluster.namespace("crd").await;
    let api: Api<DynamicObject> =
        Api::namespaced_with(cluster.client.clone(), &ns, &ar("MachineDeployment", "machinedeployments"));
    let md = |spec: Value| -> DynamicObject {
        serde_json::from_value(json!({"apiVersion": "machine.driver.dev/v1alpha1", "kind": "MachineDeployment",
            "metadata": {"name": "web"}, "spec": spec}))
        .unwrap()
    };
    let template = json!({"spec": {"classRef": {"name": "small"}}});
    for (spec, field) in [
        (json!({"replicas": -1, "template": template}), "spec.replicas"),
        (json!({"replicas": "three", "template": template}), "spec.replicas"),
        (json!({"replicas": 1, "template": {"spec": {}}}), "spec.template.spec.classRef"),
        (json!({"replicas": 1, "template": template, "deletePolicy": "Sometimes"}), "spec.deletePolicy"),
    ] {
        let err = api.create(&PostParams::default(), &md(spec.clone())).await.expect_err(&format!("{spec} accepted"));
        match err {
            kube::Error::Api(s) => {
                assert_eq!(s.code, 422, "{spec}: {s:?}");
                assert!(s.message.contains(field), "{spec}: the message does not name {field}: {}", s.message);
            }
            e => panic!("{spec}: {e}"),
        }
    }
    // A valid one is stored with the printer columns' fields, and parses back despite the
    // fields a real API server adds (managedFields etc.).
    api.create(
        &PostParams::default(),
        &md(json!({"replicas": 2, "template": template, "strategy":
        {"rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0}}})),
    )
    .await
    .unwrap();
    let raw = api.get("web").await.unwrap();
    assert!(raw.metadata.managed_fields.is_some(), "the API server adds managedFields");
    let store = Store::new(Arc::new(KubernetesBackend::new(cluster.client.clone(), Some(ns.clone()))));
    let parsed = store.get::<MachineDeployment>(&ns, "web").await.unwrap().expect("parsed");
    assert_eq!(parsed.spec.replicas, 2);
    assert_eq!(parsed.spec.strategy.rolling_update.max_surge, IntOrPercent::Str("25%".into()));
    // `machine-controller crds` prints the same CRDs, and the table columns are served.
    let (code, out, err) = run(&bin("machine-controller"), &["crds"]).await;
    assert_eq!(code, 0, "{err}");
    for plural in ["machineclasses", "machinedeployments", "machinepools", "machines"] {
        assert!(out.contains(&format!("name: {plural}.machine.driver.dev")), "crds lacks {plural}");
    }
    let table = cluster
        .client
        .request_text(
            http::Request::get(format!("/apis/machine.driver.dev/v1alpha1/namespaces/{ns}/machinedeployments"))
                .header("Accept", "application/json;as=Table;g=meta.k8s.io;v=v1")
                .body(Vec::new())
                .unwrap(),
        )
        .await
        .unwrap();
    for column in ["Desired", "Ready", "Available", "Age"] {
        assert!(table.contains(&format!("\"name\":\"{column}\"")), "no {column} column: {table}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deployment_applied_through_the_api_reconciles_with_operations_in_status() {
    let mut w = world(&["--create-latency", "1500ms", "--delete-latency", "200ms"]).await;
    w.start_controller(&[]);
    w.class().await;
    w.apply_md("web", 3, "os-1", "1", "0").await;
    // While creates are in flight, each Machine's .status holds its operation token.
    let with_tokens = eventually(MINUTE, "operation tokens in .status", || {
        let api = w.api("Machine", "machines");
        async move {
            let list = api.list(&Default::default()).await.ok()?;
            let n = list
                .items
                .iter()
                .filter(|m| {
                    m.data["status"]["operations"]
                        .as_array()
                        .is_some_and(|ops| ops.iter().any(|o| o["token"].as_str().is_some_and(|t| !t.is_empty())))
                })
                .count();
            (n >= 1).then_some(n)
        }
    })
    .await;
    assert!(with_tokens >= 1);
    let md = w.converged("web", MINUTE).await;
    assert_eq!(md.status.ready_replicas, 3);
    w.assert_consistent(3).await;
    for m in w.machines().await {
        assert_eq!(m.status.phase, Phase::Running);
        assert!(m.status.operations.is_empty(), "{} still holds an operation", m.metadata.name);
        assert!(m.status.provider_id.starts_with("fake://"), "{}", m.status.provider_id);
        let last = m.status.last_operation.expect("last operation");
        assert!(!last.request_id.is_empty());
        assert_eq!(m.metadata.owner_references[0].uid, md.metadata.uid);
    }
    // The CLI reads the same objects through the API server.
    let (code, out, err) = w.cli(&["get", "machines", "-n", w.ns()]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.matches("Running").count(), 3, "{out}");
    // Events are posted as events.k8s.io/v1 and shown by describe. That the three machines run
    // is told on their deployment, and repeats of one reason there are one event series.
    let (code, out, err) = eventually(MINUTE, "a series of Created events in describe", || {
        let w = &w;
        async move {
            let r = w.cli(&["describe", "machinedeployment", "web", "-n", w.ns()]).await;
            (r.1.contains("Created") && r.1.contains("(x")).then_some(r)
        }
    })
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("Events"), "{out}");
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(w.cluster().client.clone(), w.ns());
    let list = events.list(&Default::default()).await.unwrap();
    let created: Vec<_> = list.items.iter().filter(|e| e.reason.as_deref() == Some("Created")).collect();
    assert_eq!(created.len(), 1, "one Event for the series: {created:?}");
    let regarding = created[0].regarding.as_ref().expect("regarding");
    assert_eq!((regarding.kind.as_deref(), regarding.name.as_deref()), (Some("MachineDeployment"), Some("web")));
    assert!(created[0].series.as_ref().is_some_and(|s| s.count >= 2), "{:?}", created[0].series);
    w.kill9_controller(0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_update_and_kill9_mid_rollout_lose_and_duplicate_nothing() {
    let mut w = world(&["--create-latency", "800ms", "--delete-latency", "300ms"]).await;
    w.start_controller(&[]);
    w.class().await;
    w.apply_md("web", 6, "os-1", "2", "1").await;
    w.converged("web", MINUTE).await;
    w.assert_consistent(6).await;
    let c = w.driver_client().await;
    let mut f = fake::fake_cloud_client::FakeCloudClient::new(c.channel());
    f.inspect(fake::InspectRequest { reset_peak: true }).await.unwrap();
    // Sample the cloud while the rollout runs: the fewest Running machines seen.
    let min_running = Arc::new(std::sync::atomic::AtomicI64::new(i64::MAX));
    let sampler = {
        let (min_running, mut f) = (min_running.clone(), f.clone());
        tokio::spawn(async move {
            loop {
                if let Ok(r) = f.inspect(fake::InspectRequest::default()).await {
                    let running = r.into_inner().machines.iter().filter(|m| m.state == "RUNNING").count() as i64;
                    min_running.fetch_min(running, std::sync::atomic::Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    w.apply_md("web", 6, "os-2", "2", "1").await;
    // Kill -9 the controller while the rollout's creates are in flight; start a new one.
    eventually(MINUTE, "rollout creates in flight", || {
        let w = &w;
        async move { (w.inspect().await.machines.iter().filter(|m| m.state == "CREATING").count() >= 1).then_some(()) }
    })
    .await;
    w.kill9_controller(0).await;
    w.start_controller(&[]);
    let md = w.converged("web", 2 * MINUTE).await;
    sampler.abort();
    let peak = f.inspect(fake::InspectRequest::default()).await.unwrap().into_inner().counters.unwrap().peak_machines;
    assert!(peak <= 8, "the cloud held {peak} machines, more than replicas + maxSurge = 8");
    assert!(peak >= 7, "the rollout never surged (peak {peak}); the check would prove nothing");
    let min = min_running.load(std::sync::atomic::Ordering::SeqCst);
    assert!(min >= 5, "only {min} machines were running at one point, fewer than replicas − maxUnavailable = 5");
    assert!(w
        .machines()
        .await
        .iter()
        .all(|m| m.metadata.labels.get(LABEL_REVISION) == Some(&md.status.current_revision)));
    w.assert_consistent(6).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_one_leader_and_the_follower_takes_over_after_kill9() {
    let mut w = world(&["--create-latency", "1s", "--delete-latency", "300ms"]).await;
    let lease_ns = w.ns().to_string();
    let a = w.start_controller(&[
        "--leader-elect",
        "--leader-elect-identity",
        "replica-a",
        "--leader-elect-namespace",
        &lease_ns,
    ]);
    let lease: Api<k8s_openapi::api::coordination::v1::Lease> = Api::namespaced(w.cluster().client.clone(), w.ns());
    let holder = || async {
        lease
            .get_opt("machine-controller")
            .await
            .ok()
            .flatten()
            .and_then(|l| l.spec?.holder_identity)
            .filter(|h| !h.is_empty())
    };
    eventually(MINUTE, "replica-a leads", || async { (holder().await.as_deref() == Some("replica-a")).then_some(()) })
        .await;
    let b = w.start_controller(&[
        "--leader-elect",
        "--leader-elect-identity",
        "replica-b",
        "--leader-elect-namespace",
        &lease_ns,
    ]);
    // /readyz: the leader is ready, the follower is not.
    let ports = [w.metrics_addr(a).await.port(), w.metrics_addr(b).await.port()];
    let port = |i: usize| ports[i];
    eventually(MINUTE, "leader ready", || async { (http_get(port(a), "/readyz").await?.0 == 200).then_some(()) }).await;
    eventually(MINUTE, "follower serving /readyz", || async { http_get(port(b), "/healthz").await.map(|_| ()) }).await;
    assert_eq!(http_get(port(b), "/readyz").await.unwrap().0, 503, "a follower must not be ready");

    w.class().await;
    w.apply_md("web", 4, "os-1", "1", "0").await;
    w.converged("web", MINUTE).await;
    // Only the leader called the driver.
    let b_log = w.controller_log(b);
    assert!(!b_log.contains("driver call"), "the follower called a driver:\n{b_log}");
    assert!(!b_log.contains("became the leader"), "{b_log}");

    // Roll, and kill -9 the leader mid-rollout.
    w.apply_md("web", 4, "os-2", "1", "0").await;
    eventually(MINUTE, "rollout in flight", || {
        let w = &w;
        async move { (w.inspect().await.machines.iter().filter(|m| m.state == "CREATING").count() >= 1).then_some(()) }
    })
    .await;
    let killed = Instant::now();
    w.kill9_controller(a).await;
    eventually(MINUTE, "replica-b leads", || async { (holder().await.as_deref() == Some("replica-b")).then_some(()) })
        .await;
    let takeover = killed.elapsed();
    // One lease duration (15 s) after the last renewal, which was at most one retry period
    // (2 s) before the kill; plus the poll granularity of this test.
    assert!(takeover <= Duration::from_secs(17), "takeover took {takeover:?}");
    eventually(MINUTE, "new leader ready", || async { (http_get(port(b), "/readyz").await?.0 == 200).then_some(()) })
        .await;
    let md = w.converged("web", 2 * MINUTE).await;
    assert!(w
        .machines()
        .await
        .iter()
        .all(|m| m.metadata.labels.get(LABEL_REVISION) == Some(&md.status.current_revision)));
    w.assert_consistent(4).await;
    eprintln!("leader takeover after kill -9: {takeover:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_loses_its_lease_stops_at_once() {
    let mut w = world(FAST).await;
    let ns = w.ns().to_string();
    let a = w.start_controller(&[
        "--leader-elect",
        "--leader-elect-identity",
        "replica-a",
        "--leader-elect-namespace",
        &ns,
    ]);
    let lease: Api<k8s_openapi::api::coordination::v1::Lease> = Api::namespaced(w.cluster().client.clone(), w.ns());
    let l = eventually(MINUTE, "a lease", || {
        let lease = lease.clone();
        async move { lease.get_opt("machine-controller").await.ok().flatten() }
    })
    .await;
    // Someone else takes the lease (as an operator or a partitioned peer would).
    let mut stolen = l.clone();
    let spec = stolen.spec.as_mut().unwrap();
    spec.holder_identity = Some("intruder".into());
    spec.renew_time =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(k8s_openapi::jiff::Timestamp::now()));
    spec.lease_duration_seconds = Some(3600);
    eventually(MINUTE, "lease taken", || {
        let (lease, stolen) = (lease.clone(), stolen.clone());
        async move {
            let mut s = stolen;
            s.metadata.resource_version = lease.get("machine-controller").await.ok()?.metadata.resource_version;
            lease.replace("machine-controller", &PostParams::default(), &s).await.ok()
        }
    })
    .await;
    let status = w.wait_controller_exit(a, MINUTE).await;
    assert!(!status.success());
    let text = w.controller_log(a);
    assert!(text.contains("leader election lost"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_deployment_deletes_every_cloud_machine_before_the_finalizers_go() {
    let mut w = world(FAST).await;
    w.start_controller(&[]);
    w.class().await;
    w.apply_md("web", 3, "os-1", "1", "0").await;
    w.converged("web", MINUTE).await;
    let api = w.api("MachineDeployment", "machinedeployments");
    api.delete("web", &DeleteParams::background()).await.unwrap();
    // When the deployment is gone from the API server, the cloud is already empty.
    eventually(MINUTE, "deployment gone", || {
        let api = api.clone();
        async move { api.get_opt("web").await.ok().flatten().is_none().then_some(()) }
    })
    .await;
    let cloud = w.inspect().await;
    assert!(cloud.machines.is_empty(), "cloud machines left after the deployment went: {:?}", cloud.machines);
    let machines = w.api("Machine", "machines").list(&Default::default()).await.unwrap();
    assert!(machines.items.is_empty(), "Machines left: {}", machines.items.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_scale_through_the_scale_subresource() {
    let mut w = world(FAST).await;
    w.start_controller(&[]);
    w.class().await;
    w.apply_md("web", 2, "os-1", "1", "0").await;
    w.converged("web", MINUTE).await;
    let api = w.api("MachineDeployment", "machinedeployments");
    // What `kubectl scale md/web --replicas=4` sends.
    api.patch_scale("web", &PatchParams::default(), &Patch::Merge(json!({"spec": {"replicas": 4}}))).await.unwrap();
    eventually(MINUTE, "the scale seen", || {
        let w = &w;
        async move {
            let md = w.store().get::<MachineDeployment>(w.ns(), "web").await.ok()??;
            (md.spec.replicas == 4).then_some(())
        }
    })
    .await;
    w.converged("web", MINUTE).await;
    w.assert_consistent(4).await;
    let scale = api.get_scale("web").await.unwrap();
    assert_eq!(scale.spec.and_then(|s| s.replicas), Some(4));
    assert_eq!(scale.status.map(|s| s.replicas), Some(4));
}

/// Every document in deploy/ passes the API server's validation (server-side dry-run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deploy_manifests_pass_server_side_dry_run() {
    let cluster = Cluster::start().await;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join("deploy");
    let discovery = kube::Discovery::new(cluster.client.clone()).run().await.unwrap();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no manifests in {}", root.display());
    let mut checked = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        if file.ends_with("crds.yaml") {
            // Generated: it must be what `machine-controller crds` prints today.
            let (code, out, err) = run(&bin("machine-controller"), &["crds"]).await;
            assert_eq!(code, 0, "{err}");
            assert_eq!(text, out, "deploy/crds.yaml is stale: run `machine-controller crds > deploy/crds.yaml`");
        }
        let docs: Vec<Value> = serde_saphyr::from_multiple(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        for v in docs {
            let obj: DynamicObject = serde_json::from_value(v.clone()).unwrap();
            let tm = obj.types.clone().expect("apiVersion/kind");
            let gvk = GroupVersionKind::try_from(&tm).unwrap();
            let (ar, caps) =
                discovery.resolve_gvk(&gvk).unwrap_or_else(|| panic!("{}: unknown kind {gvk:?}", file.display()));
            let api: Api<DynamicObject> = if caps.scope == kube::discovery::Scope::Namespaced {
                let ns = obj.metadata.namespace.clone().expect("namespaced objects name their namespace");
                Api::namespaced_with(cluster.client.clone(), &ns, &ar)
            } else {
                Api::all_with(cluster.client.clone(), &ar)
            };
            let name = obj.metadata.name.clone().expect("name");
            if tm.kind == "Namespace" {
                // Namespaced dry-runs need the namespace to exist: create it for real.
                api.patch(&name, &PatchParams::apply("dry-run-test"), &Patch::Apply(&v)).await.unwrap();
            } else {
                // Server-side apply with dryRun=All: full validation and admission, nothing stored.
                api.patch(&name, &PatchParams::apply("dry-run-test").dry_run(), &Patch::Apply(&v))
                    .await
                    .unwrap_or_else(|e| panic!("{} {} {name}: {e}", file.display(), tm.kind));
            }
            checked.push(tm.kind.clone());
        }
    }
    for kind in ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "CustomResourceDefinition"] {
        assert!(checked.iter().any(|k| k == kind), "deploy/ has no {kind}: {checked:?}");
    }
}

/// Without the CRDs, or without a usable kubeconfig, the CLI says what is wrong at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_crds_and_a_bad_kubeconfig_are_clear_errors() {
    let cluster = Cluster::start_with(false).await;
    let started = Instant::now();
    let out = tokio::time::timeout(
        MINUTE,
        Command::new(bin("machine-controller"))
            .args(["--store", "kubernetes", "get", "machines"])
            .env("KUBECONFIG", &cluster.kubeconfig)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .unwrap()
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("are the CRDs installed?"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());

    let out = Command::new(bin("machine-controller"))
        .args(["--store", "kubernetes", "get", "machines"])
        .env("KUBECONFIG", cluster.dir.path().join("no-such-kubeconfig"))
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .await
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("opening store kubernetes"), "{err}");
    let (code, _, err) = run(&bin("machine-controller"), &["--store", "mysql://x", "get", "machines"]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("unknown store; use sqlite://PATH or kubernetes"), "{err}");
}
