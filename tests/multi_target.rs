//! One controller for many clusters. A management cluster (etcd and kube-apiserver with the
//! CRDs: the controller's store, no Nodes of its own) holds MachineDeployments that name their
//! target cluster with `spec.targetCluster.kubeconfigSecretRef`; each target is a whole test
//! cluster (kube-apiserver, etcd, controller-manager, scheduler, kwok: real processes) with a
//! fake cloud of its own whose VMs join it by TLS bootstrap. The Secrets hold kubeconfigs of the
//! controller's ServiceAccount in each target, with exactly the RBAC of
//! `deploy/target-rbac.yaml`; the controller authenticates to the management cluster as the
//! ServiceAccount of `deploy/controller.yaml`.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use e2e_tests::kube_cluster::{pod_ready, Cluster};
use e2e_tests::world::{Driver, World};
use e2e_tests::{eventually, joining, Sidecar};
use fake_driver::pb as fake;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams};
use machine_controller::resources::*;
use serde_json::{json, Value};

const MINUTE: Duration = Duration::from_secs(60);
const FAST: &[&str] = &["--create-latency", "300ms", "--delete-latency", "200ms"];
const NAMES: [&str; 3] = ["a", "b", "c"];

/// One target cluster and the fake cloud whose VMs join it.
struct Target {
    name: &'static str,
    cluster: Cluster,
    /// The fake cloud's endpoint (its sidecar is the world's for `a`, else `sidecar`).
    endpoint: String,
    _sidecar: Option<Sidecar>,
}

/// The management cluster's world and the target clusters.
struct Fleet {
    w: World,
    targets: Vec<Target>,
}

fn fake_driver(name: &str, cluster: &Cluster) -> Driver {
    let mut args: Vec<String> = FAST.iter().map(|a| a.to_string()).collect();
    args.extend(["--join-cluster".to_string(), cluster.kubeconfig.to_string_lossy().into_owned()]);
    Driver::fake(&[]).named(&format!("fake-{name}")).args(args)
}

impl Fleet {
    /// A management cluster and `n` target clusters, each with a fake cloud (`fake-a`, …), a
    /// Secret `target-X` with the controller's kubeconfig for it (bound to `binding-1`), and a
    /// class `small-X` of its cloud whose machines join it; no controller yet.
    async fn start(n: usize) -> Fleet {
        let started = Instant::now();
        let (management, clusters) =
            tokio::join!(Cluster::start(), futures::future::join_all((0..n).map(|_| Cluster::start_full())));
        println!("{n} target clusters and the management cluster started in {:?}", started.elapsed());
        let mut targets = Vec::new();
        let mut driver_args = Vec::new();
        let mut first = None;
        for (i, cluster) in clusters.into_iter().enumerate() {
            let name = NAMES[i];
            let driver = fake_driver(name, &cluster);
            let (endpoint, sidecar) = if i == 0 {
                first = Some(driver);
                (String::new(), None)
            } else {
                let s = driver.start().await;
                driver_args.extend(["--driver".to_string(), format!("fake-{name}={}", s.endpoint())]);
                (s.endpoint(), Some(s))
            };
            targets.push(Target { name, cluster, endpoint, _sidecar: sidecar });
        }
        let mut args: Vec<&str> =
            vec!["--resync-interval", "5s", "--drain-poll-interval", "500ms", "--no-target-cluster"];
        args.extend(driver_args.iter().map(String::as_str));
        let w = World::builder()
            .driver(first.expect("at least one target"))
            .kubernetes(management, "fleet")
            .as_service_account()
            .metrics()
            .controller_args(&args)
            .without_controller()
            .start()
            .await;
        targets[0].endpoint = w.endpoint();
        let fleet = Fleet { w, targets };
        for t in &fleet.targets {
            fleet.connect(t.name, "binding-1").await;
            fleet.class(t.name).await;
            t.cluster.apply_json(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}})).await;
        }
        fleet
    }

    fn target(&self, name: &str) -> &Target {
        self.targets.iter().find(|t| t.name == name).expect("a target of that name")
    }

    /// Writes Secret `target-NAME` with a kubeconfig of the controller in target `name`, its
    /// token bound to (and revoked with) `binding` there.
    async fn connect(&self, name: &str, binding: &str) -> String {
        let kubeconfig = self.target(name).cluster.target_kubeconfig(binding).await;
        self.secret(&format!("target-{name}"), &kubeconfig).await;
        kubeconfig
    }

    async fn secret(&self, name: &str, kubeconfig: &str) {
        self.w
            .cluster()
            .apply_json(json!({
                "apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": name, "namespace": self.w.ns()},
                "stringData": {"value": kubeconfig},
            }))
            .await;
    }

    async fn class(&self, name: &str) {
        let spec = json!({
            "driver": format!("fake-{name}"),
            "providerSpec": {"machineType": "small"},
            "capacity": {"cpu": "2", "memory": "4Gi", "pods": "110"},
        });
        let meta = json!({"name": format!("small-{name}")});
        self.w.apply_object("MachineClass", "machineclasses", json!({"metadata": meta, "spec": joining(spec)})).await;
    }

    /// MachineDeployment `web-NAME` of `replicas` machines of `image` in target `name` (whose
    /// Secret is `secret`), with `extra` merged into its spec.
    async fn apply_md_in(&self, name: &str, secret: &str, replicas: i64, image: &str, extra: Value) {
        let mut spec = json!({
            "replicas": replicas,
            "targetCluster": {"kubeconfigSecretRef": {"name": secret}},
            "template": {"spec": {"classRef": {"name": format!("small-{name}")}, "providerSpec": {"image": image}}},
            "strategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "drainTimeoutSeconds": 120,
        });
        for (k, v) in extra.as_object().cloned().unwrap_or_default() {
            spec[k] = v;
        }
        let meta = json!({"name": format!("web-{name}")});
        self.w.apply_object("MachineDeployment", "machinedeployments", json!({"metadata": meta, "spec": spec})).await;
    }

    async fn apply_md(&self, name: &str, replicas: i64, image: &str) {
        self.apply_md_in(name, &format!("target-{name}"), replicas, image, json!({})).await;
    }

    async fn md(&self, name: &str) -> Option<MachineDeployment> {
        self.w.store().get::<MachineDeployment>(self.w.ns(), &format!("web-{name}")).await.ok().flatten()
    }

    /// Waits until `web-NAME` rolled out `replicas` machines of `image`.
    async fn rolled_out_n(&self, name: &str, replicas: i64, image: &str, within: Duration) -> MachineDeployment {
        self.w
            .wait_for(&format!("web-{name} rolled out with {replicas} machines of {image}"), within, || async {
                let md = self.md(name).await?;
                let spec_image = md.spec.template.spec.provider_spec.as_ref()?["image"].as_str()?.to_string();
                let done = e2e_tests::rolled_out(&md) && md.spec.replicas == replicas && spec_image == image;
                (done && self.machines(name).await.len() as i64 == replicas).then_some(md)
            })
            .await
    }

    /// Waits until `web-NAME` rolled out its 2 machines of `image`.
    async fn rolled_out(&self, name: &str, image: &str, within: Duration) -> MachineDeployment {
        self.rolled_out_n(name, 2, image, within).await
    }

    /// The machines of `web-NAME`.
    async fn machines(&self, name: &str) -> Vec<Machine> {
        let md = format!("web-{name}");
        let all = self.w.machines().await;
        all.into_iter().filter(|m| m.metadata.labels.get(LABEL_DEPLOYMENT) == Some(&md)).collect()
    }

    /// The names of the Nodes of target `name`.
    async fn nodes(&self, name: &str) -> BTreeSet<String> {
        let nodes = Api::<Node>::all(self.target(name).cluster.client.clone()).list(&ListParams::default()).await;
        nodes.unwrap().items.into_iter().filter_map(|n| n.metadata.name).collect()
    }

    /// The names of the Nodes the machines of `web-NAME` are linked to.
    async fn linked_nodes(&self, name: &str) -> BTreeSet<String> {
        self.machines(name).await.iter().filter_map(|m| Some(m.status.node_ref.as_ref()?.name.clone())).collect()
    }

    /// What target `name`'s fake cloud holds.
    async fn cloud(&self, name: &str) -> fake::InspectResponse {
        let endpoint = self.target(name).endpoint.clone();
        let call = async move {
            let channel = driver_sdk::DriverClient::connect(&endpoint).await.expect("connect").channel();
            fake::fake_cloud_client::FakeCloudClient::new(channel).inspect(fake::InspectRequest::default()).await
        };
        tokio::time::timeout(MINUTE, call).await.expect("Inspect in time").expect("Inspect").into_inner()
    }

    /// A Deployment `app` of `replicas` pods spread over the Nodes of target `name` (namespace
    /// `shop`) under a PodDisruptionBudget of one disruption at a time, once they are Ready.
    async fn workload(&self, name: &str, replicas: i32) {
        let budget = json!({"maxUnavailable": 1});
        self.target(name).cluster.workload("shop", "app", replicas, Some(budget)).await;
    }

    async fn ready_pods(&self, name: &str) -> Vec<Pod> {
        let api = Api::<Pod>::namespaced(self.target(name).cluster.client.clone(), "shop");
        let pods = api.list(&ListParams::default().labels("app=app")).await.map(|l| l.items).unwrap_or_default();
        pods.into_iter().filter(pod_ready).collect()
    }

    /// The machine events of the namespace with this reason.
    async fn events_with(&self, machines: &[Machine], reason: &str) -> usize {
        let mut n = 0;
        for m in machines {
            let key = machine_controller::store::Key::new(Kind::Machine, self.w.ns(), &m.metadata.name);
            let events = self.w.store().backend().events(&key, 100).await.unwrap_or_default();
            n += events.iter().filter(|e| e.reason == reason).count();
        }
        n
    }

    async fn metrics(&self, c: usize) -> String {
        let addr = self.w.metrics_addr(c).await;
        let (status, body) = e2e_tests::http_get(addr.port(), "/metrics").await.expect("/metrics answers");
        assert_eq!(status, 200);
        body
    }
}

fn target_condition(md: &MachineDeployment) -> Option<&Condition> {
    condition(&md.status.conditions, ConditionType::TargetReachable)
}

/// Three deployments on three target clusters: each one's Nodes join its own cluster (and no
/// other), each rolls out a new image draining its old Nodes by eviction under a
/// PodDisruptionBudget in its own cluster, every call measured under its own target, and the
/// controller is never refused by the RBAC of `deploy/target-rbac.yaml`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_targets_each_get_their_own_nodes_and_roll_out_under_their_own_budgets() {
    let mut f = Fleet::start(3).await;
    let c = f.w.start_controller(&[]);
    for t in NAMES {
        f.apply_md(t, 2, "os-1").await;
    }
    for t in NAMES {
        let md = f.rolled_out(t, "os-1", 3 * MINUTE).await;
        let reachable = target_condition(&md).expect("TargetReachable");
        assert_eq!(reachable.status, ConditionStatus::True, "{reachable:?}");
    }
    // Each deployment's Nodes are in its own cluster, and only there.
    for t in NAMES {
        let linked = f.linked_nodes(t).await;
        assert_eq!(linked.len(), 2, "web-{t}: {linked:?}");
        for other in NAMES {
            let nodes = f.nodes(other).await;
            assert_eq!(linked.is_subset(&nodes), t == other, "web-{t}'s Nodes {linked:?} vs target {other}: {nodes:?}");
        }
    }
    for t in NAMES {
        f.workload(t, 4).await;
    }
    let old: Vec<BTreeSet<String>> = futures::future::join_all(NAMES.iter().map(|t| f.linked_nodes(t))).await;
    for t in NAMES {
        f.apply_md(t, 2, "os-2").await;
    }
    for (i, t) in NAMES.iter().enumerate() {
        f.rolled_out(t, "os-2", 4 * MINUTE).await;
        let nodes = eventually(MINUTE, &format!("target {t}'s old Nodes gone"), || async {
            let nodes = f.nodes(t).await;
            old[i].is_disjoint(&nodes).then_some(nodes)
        })
        .await;
        let linked = f.linked_nodes(t).await;
        assert!(linked.is_subset(&nodes), "target {t}: {linked:?} not in {nodes:?}");
        eventually(2 * MINUTE, &format!("4 pods Ready on target {t}'s new Nodes"), || async {
            let pods = f.ready_pods(t).await;
            let on_new = pods
                .iter()
                .all(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some_and(|n| linked.contains(n)));
            (pods.len() == 4 && on_new).then_some(())
        })
        .await;
    }
    // Every pod left by eviction: nothing was forced.
    let all = f.w.machines().await;
    assert_eq!(f.events_with(&all, "DrainForced").await, 0);
    // Each cloud made its own four machines, and holds two.
    for t in NAMES {
        let cloud = f.cloud(t).await;
        assert_eq!(cloud.machines.len(), 2, "target {t}'s cloud");
        assert_eq!(cloud.counters.expect("counters").machines_created, 4, "target {t}'s cloud");
    }
    let metrics = f.metrics(c).await;
    for t in NAMES {
        let label = format!("target=\"{}/target-{t}\"", f.w.ns());
        let evictions = metrics
            .lines()
            .filter(|l| l.starts_with("controller_target_calls_total{") && l.contains(&label))
            .filter(|l| l.contains("resource=\"pods/eviction\""))
            .count();
        assert!(evictions > 0, "no evictions measured under {label}:\n{metrics}");
    }
    for t in &f.targets {
        let forbidden = t.cluster.controller_forbidden();
        assert!(forbidden.is_empty(), "target {}: the controller was refused {forbidden:?}", t.name);
        assert!(t.cluster.controller_requests() > 0, "target {}: no request of the controller audited", t.name);
    }
    f.w.assert_controller_never_forbidden();
    f.w.kill9().await;
}

/// One target's API server killed (kill -9) for longer than its health check's timeout while
/// another target rolls out: the other's rollout goes at its usual pace (measured against the
/// same rollout before the outage), the dead target's machines are judged by nobody and none is
/// remediated; once it is back its timers start over and its own rollout carries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_target_freezes_only_its_own_machines_and_holds_up_no_other() {
    let mut f = Fleet::start(2).await;
    f.w.start_controller(&[]);
    f.apply_md("a", 2, "os-1").await;
    f.apply_md("b", 2, "os-1").await;
    f.rolled_out("a", "os-1", 3 * MINUTE).await;
    f.rolled_out("b", "os-1", 3 * MINUTE).await;
    let spec = json!({
        "selector": {"matchLabels": {LABEL_DEPLOYMENT: "web-a"}},
        "unhealthyConditions": [
            {"type": "Ready", "status": "False", "timeoutSeconds": 10},
            {"type": "Ready", "status": "Unknown", "timeoutSeconds": 10},
        ],
        "maxUnhealthy": "100%",
    });
    f.w.apply_object("MachineHealthCheck", "machinehealthchecks", json!({"metadata": {"name": "web-a"}, "spec": spec}))
        .await;

    // The same rollout of b, without an outage and then with one: the test's own baseline.
    let started = Instant::now();
    f.apply_md("b", 2, "os-2").await;
    f.rolled_out("b", "os-2", 3 * MINUTE).await;
    let baseline = started.elapsed();

    let a_machines: BTreeSet<String> = f.machines("a").await.iter().map(|m| m.metadata.name.clone()).collect();
    let a_created = f.cloud("a").await.counters.expect("counters").machines_created;
    f.targets[0].cluster.kill9_apiserver().await;
    let killed = Instant::now();
    let started = Instant::now();
    f.apply_md("b", 2, "os-3").await;
    f.rolled_out("b", "os-3", 3 * MINUTE).await;
    let during = started.elapsed();
    println!(
        "web-b's rollout: {:.1} s without an outage, {:.1} s while target a was dead ({:.2}x)",
        baseline.as_secs_f64(),
        during.as_secs_f64(),
        during.as_secs_f64() / baseline.as_secs_f64()
    );
    // Target a's owner says so, and its health check judges nothing.
    f.w.wait_for("web-a's TargetReachable False (TargetUnreachable)", MINUTE, || async {
        let md = f.md("a").await?;
        let c = target_condition(&md)?;
        (c.status == ConditionStatus::False && c.reason == "TargetUnreachable").then_some(())
    })
    .await;
    f.w.wait_for("the health check of web-a holding (TargetUnreachable)", MINUTE, || async {
        let mhc = f.w.store().get::<MachineHealthCheck>(f.w.ns(), "web-a").await.ok().flatten()?;
        let c = condition(&mhc.status.conditions, ConditionType::RemediationAllowed)?;
        (c.status == ConditionStatus::False && c.reason == "TargetUnreachable").then_some(())
    })
    .await;
    // Deliberate: the outage lasts longer than the health check's 10 s timeout.
    tokio::time::sleep_until((killed + Duration::from_secs(15)).into()).await;
    let outage = killed.elapsed();
    f.targets[0].cluster.restart_apiserver().await;
    f.w.wait_for("web-a's TargetReachable True again", MINUTE, || async {
        let md = f.md("a").await?;
        (target_condition(&md)?.status == ConditionStatus::True).then_some(())
    })
    .await;
    // Its timers start over: nothing of it was remediated, then or since.
    f.w.wait_for("the health check of web-a allowing remediation again", MINUTE, || async {
        let mhc = f.w.store().get::<MachineHealthCheck>(f.w.ns(), "web-a").await.ok().flatten()?;
        let c = condition(&mhc.status.conditions, ConditionType::RemediationAllowed)?;
        (c.status == ConditionStatus::True).then_some(())
    })
    .await;
    let now: BTreeSet<String> = f.machines("a").await.iter().map(|m| m.metadata.name.clone()).collect();
    assert_eq!(now, a_machines, "a machine of the dead target was replaced ({outage:?} outage)");
    assert_eq!(f.cloud("a").await.counters.expect("counters").machines_created, a_created);
    for m in f.machines("a").await {
        let hc = condition(&m.status.conditions, ConditionType::HealthCheckSucceeded);
        assert!(hc.is_none_or(|c| c.status == ConditionStatus::True), "{}: {hc:?}", m.metadata.name);
        assert!(!m.is_deleting(), "{} is being deleted", m.metadata.name);
    }
    // Its own rollout carries on.
    f.apply_md("a", 2, "os-2").await;
    f.rolled_out("a", "os-2", 4 * MINUTE).await;
    f.w.kill9().await;
}

/// A kubeconfig Secret rotated to a new token and the old one revoked: the controller reconnects
/// without a restart (a new machine joins with the new credentials). A kubeconfig that runs a
/// command is refused with a condition and nothing is run; a missing Secret says so; neither
/// makes a machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_kubeconfig_reconnects_and_one_that_runs_a_command_is_refused() {
    let mut f = Fleet::start(1).await;
    let c = f.w.start_controller(&[]);
    f.apply_md("a", 1, "os-1").await;
    f.rolled_out_n("a", 1, "os-1", 3 * MINUTE).await;

    // Rotation: a new token in the Secret, the old one revoked (the API server refuses it).
    let old = f.target("a").cluster.target_kubeconfig("binding-1").await;
    f.connect("a", "binding-2").await;
    f.targets[0].cluster.revoke_target_token("binding-1").await;
    let config = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::from_yaml(&old).unwrap(),
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .unwrap();
    let old_client = kube::Client::try_from(config).unwrap();
    eventually(MINUTE, "the old token refused (401)", || async {
        let r = Api::<Node>::all(old_client.clone()).list(&ListParams::default()).await;
        matches!(r, Err(kube::Error::Api(s)) if s.code == 401).then_some(())
    })
    .await;
    // The controller reads the changed Secret (within the store's 10 s Secret cache) and
    // connects again, without a restart.
    f.w.wait_for("the reconnect in the controller's log", MINUTE, || async {
        f.w.controller_log(c).contains("connection built again").then_some(())
    })
    .await;
    f.apply_md("a", 2, "os-1").await;
    let md = f.rolled_out_n("a", 2, "os-1", 3 * MINUTE).await;
    assert_eq!(target_condition(&md).expect("TargetReachable").status, ConditionStatus::True);
    let linked = f.linked_nodes("a").await;
    assert_eq!(linked.len(), 2);
    assert!(linked.is_subset(&f.nodes("a").await));
    // Calls go on with the new credentials: a Node change still reaches the controller.
    let metrics = f.metrics(c).await;
    assert!(metrics.contains(&format!("target=\"{}/target-a\"", f.w.ns())), "{metrics}");

    // A kubeconfig with an exec plugin.
    let pwned = f.w.dir().join("pwned");
    let exec = json!({
        "apiVersion": "v1", "kind": "Config", "current-context": "x",
        "clusters": [{"name": "x", "cluster": {"server": f.targets[0].cluster.server}}],
        "contexts": [{"name": "x", "context": {"cluster": "x", "user": "x"}}],
        "users": [{"name": "x", "user": {"exec": {
            "apiVersion": "client.authentication.k8s.io/v1", "command": "/bin/sh",
            "args": ["-c", format!("touch {}", pwned.display())], "interactiveMode": "Never",
        }}}],
    });
    f.secret("target-exec", &exec.to_string()).await;
    for (md, secret) in [("web-x", "target-exec"), ("web-y", "no-such-secret")] {
        let spec = json!({
            "replicas": 1,
            "targetCluster": {"kubeconfigSecretRef": {"name": secret}},
            "template": {"spec": {"classRef": {"name": "small-a"}}},
        });
        f.w.apply_object("MachineDeployment", "machinedeployments", json!({"metadata": {"name": md}, "spec": spec}))
            .await;
    }
    for (md, reason) in [("web-x", "ExecPluginRefused"), ("web-y", "TargetSecretNotFound")] {
        let c =
            f.w.wait_for(&format!("{md}'s TargetReachable False ({reason})"), MINUTE, || async {
                let md = f.w.store().get::<MachineDeployment>(f.w.ns(), md).await.ok().flatten()?;
                let c = target_condition(&md)?.clone();
                (c.status == ConditionStatus::False && c.reason == reason).then_some(c)
            })
            .await;
        assert!(!c.message.contains("touch"), "the condition quotes the kubeconfig: {}", c.message);
        let (code, out, err) = f.w.cluster().kubectl(&["describe", "machinedeployment", md, "-n", f.w.ns()]).await;
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("TargetReachable") && out.contains(reason), "{out}");
    }
    assert!(!pwned.exists(), "the exec plugin ran");
    let made: Vec<String> = f
        .w
        .machines()
        .await
        .into_iter()
        .filter(|m| {
            ["web-x", "web-y"].iter().any(|md| m.metadata.labels.get(LABEL_DEPLOYMENT).map(String::as_str) == Some(md))
        })
        .map(|m| m.metadata.name)
        .collect();
    assert!(made.is_empty(), "machines made for an unusable target: {made:?}");

    // The target of an owner does not change: its machines joined that cluster.
    let patch = r#"{"spec":{"targetCluster":{"kubeconfigSecretRef":{"name":"target-exec"}}}}"#;
    let (code, _, err) =
        f.w.cluster()
            .kubectl(&["patch", "machinedeployment", "web-a", "-n", f.w.ns(), "--type=merge", "-p", patch])
            .await;
    assert_ne!(code, 0, "the API server took a new spec.targetCluster");
    assert!(err.contains("spec.targetCluster") && err.contains("is immutable"), "{err}");

    // A target no object uses any more is closed: its series go from the metrics.
    for md in ["web-a", "web-x", "web-y"] {
        let (code, _, err) =
            f.w.cluster().kubectl(&["delete", "machinedeployment", md, "-n", f.w.ns(), "--wait=false"]).await;
        assert_eq!(code, 0, "{err}");
    }
    f.w.wait_for("every machine gone", 2 * MINUTE, || async { f.w.machines().await.is_empty().then_some(()) }).await;
    assert!(f.nodes("a").await.is_empty(), "target a's Nodes go with their machines");
    let label = format!("target=\"{}/target-a\"", f.w.ns());
    f.w.wait_for("target a's metrics series removed", MINUTE, || async {
        (!f.metrics(c).await.contains(&label)).then_some(())
    })
    .await;
    assert!(f.w.controller_log(c).contains("target cluster closed"), "no close logged");

    f.w.kill9().await;
}

/// kill -9 of the controller while two targets roll out: the next controller resumes both, and
/// each cloud made exactly the machines it was asked for, none twice, none left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_the_controller_mid_rollout_on_two_targets_resumes_both() {
    let mut f = Fleet::start(2).await;
    f.w.start_controller(&[]);
    for t in ["a", "b"] {
        f.apply_md(t, 2, "os-1").await;
    }
    for t in ["a", "b"] {
        f.rolled_out(t, "os-1", 3 * MINUTE).await;
    }
    for t in ["a", "b"] {
        f.apply_md(t, 2, "os-2").await;
    }
    // Both in the middle: each has a machine of the new image created.
    eventually(2 * MINUTE, "both rollouts under way", || async {
        for t in ["a", "b"] {
            if f.cloud(t).await.counters?.machines_created < 3 {
                return None;
            }
        }
        Some(())
    })
    .await;
    f.w.kill9().await;
    f.w.start_controller(&[]);
    for t in ["a", "b"] {
        f.rolled_out(t, "os-2", 4 * MINUTE).await;
        let cloud = eventually(MINUTE, &format!("target {t}'s cloud down to 2 machines"), || async {
            let cloud = f.cloud(t).await;
            (cloud.machines.len() == 2).then_some(cloud)
        })
        .await;
        assert_eq!(cloud.counters.expect("counters").machines_created, 4, "target {t}: a machine made twice");
        let nodes = eventually(MINUTE, &format!("target {t} with 2 Nodes"), || async {
            let nodes = f.nodes(t).await;
            (nodes.len() == 2).then_some(nodes)
        })
        .await;
        assert_eq!(f.linked_nodes(t).await, nodes, "target {t}");
    }
    f.w.kill9().await;
}

/// The address the controller's autoscaler listener for `target` logged once bound.
async fn listener_of(f: &Fleet, c: usize, target: &str) -> String {
    let what = format!("the autoscaler listener of target {target} in the controller's log");
    f.w.wait_for(&what, MINUTE, || async {
        let log = f.w.controller_log(c);
        let line = log.lines().find(|l| l.contains(&format!("for the node groups of target {target}")))?;
        e2e_tests::addr_after(line, "cloud provider (externalgrpc) on ").map(|a| a.to_string())
    })
    .await
}

/// The real cluster-autoscaler against two target clusters, one per target, each pointed at the
/// controller's listener for its target: pending pods in one cluster grow only that cluster's
/// group, and each autoscaler's status lists its own group alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_autoscaler_per_target_scales_only_its_own_groups() {
    let mut f = Fleet::start(2).await;
    let ns = f.w.ns().to_string();
    let listen = |t: &str| format!("{ns}/target-{t}=127.0.0.1:0");
    let (la, lb) = (listen("a"), listen("b"));
    let c = f.w.start_controller(&["--autoscaler-listen", &la, "--autoscaler-listen", &lb]);
    for t in ["a", "b"] {
        let extra = json!({"autoscaling": {"minReplicas": 1, "maxReplicas": 3}, "drainTimeoutSeconds": 60});
        f.apply_md_in(t, &format!("target-{t}"), 1, "os-1", extra).await;
    }
    for t in ["a", "b"] {
        f.rolled_out_n(t, 1, "os-1", 3 * MINUTE).await;
    }
    let mut autoscalers = Vec::new();
    for t in ["a", "b"] {
        let address = listener_of(&f, c, &format!("{ns}/target-{t}")).await;
        let dir = f.w.dir().join(format!("autoscaler-{t}"));
        std::fs::create_dir_all(&dir).unwrap();
        let kubeconfig = f.target(t).cluster.kubeconfig.clone();
        autoscalers.push(crate::autoscaler::Autoscaler::start_in(&dir, &kubeconfig, "shop", &address, "", &[]));
    }
    // Three pods of 1.5 CPUs in target a: one fits its node, two are Pending there.
    f.target("a")
        .cluster
        .apply_json(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "big", "namespace": "shop"},
            "spec": {
                "replicas": 3,
                "selector": {"matchLabels": {"app": "app"}},
                "template": {
                    "metadata": {"labels": {"app": "app"}},
                    "spec": {
                        "containers": [{"name": "app", "image": "registry.invalid/app:1",
                            "resources": {"requests": {"cpu": "1500m", "memory": "256Mi"}}}],
                        "terminationGracePeriodSeconds": 1,
                    }
                }
            }
        }))
        .await;
    f.w.wait_for("3 big pods Running in target a on the machines its autoscaler asked for", 4 * MINUTE, || async {
        (f.ready_pods("a").await.len() == 3).then_some(())
    })
    .await;
    let a = f.md("a").await.expect("web-a");
    assert_eq!(a.spec.replicas, 3, "web-a grew for its pending pods");
    assert!(autoscalers[0].log_text().contains("web-a 1->3 (max: 3)"), "{}", autoscalers[0].log_text());
    // Target b's autoscaler saw only its own group, which stayed at 1.
    let configmaps =
        Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(f.target("b").cluster.client.clone(), "shop");
    let status =
        f.w.wait_for("target b's autoscaler status", MINUTE, || async {
            let cm = configmaps.get_opt("cluster-autoscaler-status").await.ok().flatten()?;
            let text = cm.data?.get("status")?.clone();
            text.contains(&format!("{ns}/web-b")).then_some(text)
        })
        .await;
    assert!(!status.contains("web-a"), "target b's autoscaler sees web-a:\n{status}");
    assert_eq!(f.md("b").await.expect("web-b").spec.replicas, 1, "web-b was resized");
    assert_eq!(f.machines("b").await.len(), 1);
    assert!(!autoscalers[1].log_text().contains("web-a"), "target b's autoscaler named web-a");
    drop(autoscalers);
    f.w.kill9().await;
}
