//! The real Kubernetes cluster-autoscaler (release 1.36.1, built from source with only its
//! externalgrpc provider by `tests/tools/install-autoscaler.sh`) sizing MachineDeployments through
//! the controller's externalgrpc server (`run --autoscaler-listen`), on a whole test cluster
//! whose Nodes are the fake cloud's VMs joining as kwok Nodes with a real capacity (a `small`
//! machine: 2 CPUs, 4 Gi).
//!
//! Pending pods that do not fit make it call `NodeGroupIncreaseSize`; the machines are created,
//! join, and the pods run. Pods removed make it taint and drain idle nodes and call
//! `NodeGroupDeleteNodes`: exactly those machines and their VMs go, and their deletion does not
//! drain again. A group at zero grows through its template node (the class's `capacity`).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use e2e_tests::joining;
use e2e_tests::world::World;
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use kube::api::{Api, ListParams, Patch, PatchParams};
use machine_controller::resources::*;
use serde_json::{json, Value};
use tokio::process::{Child, Command};

const MINUTE: Duration = Duration::from_secs(60);
const FAST: &[&str] = &["--create-latency", "300ms", "--delete-latency", "200ms", "--update-latency", "200ms"];

/// The cluster-autoscaler binary: `$CLUSTER_AUTOSCALER_BIN` (`cargo xtask install` sets it), else what
/// `tests/tools/install-autoscaler.sh` prints (it builds once into a cache outside the clone). A
/// missing one fails the test.
fn autoscaler_bin() -> PathBuf {
    e2e_tests::installed_tool("CLUSTER_AUTOSCALER_BIN", "install-autoscaler.sh", &[])
}

/// A running cluster-autoscaler (killed on drop).
pub(crate) struct Autoscaler {
    _child: Child,
    log: PathBuf,
}

impl Autoscaler {
    /// Starts it against the world's cluster and the controller's server at `address`, with the
    /// short timings of the reference (`../shared/docs/autoscaler-reference.md`).
    fn start(w: &World, address: &str, extra_config: &str) -> Autoscaler {
        Self::start_with(w, address, extra_config, &[])
    }

    /// [`Autoscaler::start`] with more flags.
    fn start_with(w: &World, address: &str, extra_config: &str, flags: &[&str]) -> Autoscaler {
        Self::start_in(w.dir(), &w.cluster().kubeconfig, w.ns(), address, extra_config, flags)
    }

    /// Starts one against the cluster of `kubeconfig` (its status ConfigMap in `namespace`) and
    /// the controller's server at `address`, its config and log in `dir`.
    pub(crate) fn start_in(
        dir: &std::path::Path,
        kubeconfig: &std::path::Path,
        namespace: &str,
        address: &str,
        extra_config: &str,
        flags: &[&str],
    ) -> Autoscaler {
        let config = dir.join("cloud-config.yaml");
        std::fs::write(&config, format!("address: \"{address}\"\ngrpc_timeout: 10s\n{extra_config}"))
            .expect("cloud-config");
        let log = dir.join("cluster-autoscaler.log");
        let file = std::fs::File::create(&log).expect("autoscaler log");
        let child = Command::new(autoscaler_bin())
            .args([
                "--cloud-provider=externalgrpc",
                &format!("--cloud-config={}", config.display()),
                &format!("--kubeconfig={}", kubeconfig.display()),
                "--leader-elect=false",
                &format!("--namespace={namespace}"),
                "--address=127.0.0.1:0",
                "--scan-interval=2s",
                "--scale-down-unneeded-time=10s",
                "--scale-down-delay-after-add=10s",
                "--scale-down-delay-after-delete=0s",
                "--scale-down-delay-after-failure=10s",
                "--unremovable-node-recheck-timeout=10s",
                "--max-node-provision-time=2m",
                "--node-delete-delay-after-taint=2s",
                "--max-graceful-termination-sec=30",
                "--skip-nodes-with-local-storage=false",
                "--skip-nodes-with-system-pods=false",
                "--v=4",
            ])
            .args(flags)
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("log"))
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .expect("starting the cluster-autoscaler");
        Autoscaler { _child: child, log }
    }

    pub(crate) fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl.
struct Pki {
    dir: PathBuf,
}

impl Pki {
    fn new(parent: &std::path::Path) -> Pki {
        let dir = parent.join("pki");
        std::fs::create_dir_all(&dir).unwrap();
        let openssl = |args: &[&str]| {
            let out = std::process::Command::new("openssl").args(args).current_dir(&dir).output().expect("openssl");
            assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        };
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
        openssl(
            &[
                &["req", "-x509"][..],
                &ec,
                &["-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=test-ca", "-days", "1"],
            ]
            .concat(),
        );
        for (name, ext) in [
            ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"),
            ("client", "extendedKeyUsage=clientAuth\n"),
        ] {
            std::fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
            let (key, csr, crt, ext) =
                (format!("{name}.key"), format!("{name}.csr"), format!("{name}.crt"), format!("{name}.ext"));
            openssl(&[&["req"][..], &ec, &["-keyout", &key, "-out", &csr, "-subj", &format!("/CN={name}")]].concat());
            openssl(&[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &crt,
                "-days",
                "1",
                "-extfile",
                &ext,
            ]);
        }
        Pki { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).to_string_lossy().into_owned()
    }

    fn read(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.dir.join(name)).unwrap()
    }
}

/// The address the controller's autoscaler server logged once bound.
async fn server_address(w: &World, c: usize) -> String {
    w.wait_for("the controller's autoscaler server address in its log", MINUTE, || async {
        e2e_tests::addr_after(&w.controller_log(c), "cloud provider (externalgrpc) on ").map(|a| a.to_string())
    })
    .await
}

/// A class of `small` machines (2 CPUs, 4 Gi: what the fake kubelets report) that says so.
async fn class(w: &World) {
    let spec = json!({
        "driver": "fake",
        "providerSpec": {"machineType": "small", "zone": "zone-a"},
        "capacity": {"cpu": "2", "memory": "4Gi", "pods": "110"},
    });
    w.apply_object("MachineClass", "machineclasses", json!({"metadata": {"name": "small"}, "spec": joining(spec)}))
        .await;
}

async fn autoscaled_md(w: &World, name: &str, replicas: i64, min: i64, max: i64, node_labels: Value) {
    autoscaled_md_of(w, name, "small", replicas, (min, max), node_labels).await;
}

async fn autoscaled_md_of(
    w: &World,
    name: &str,
    class: &str,
    replicas: i64,
    (min, max): (i64, i64),
    node_labels: Value,
) {
    let spec = json!({
        "replicas": replicas,
        "autoscaling": {"minReplicas": min, "maxReplicas": max},
        "template": {"spec": {"classRef": {"name": class}, "nodeTemplate": {"labels": node_labels}}},
        "strategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "drainTimeoutSeconds": 60,
    });
    w.apply_object("MachineDeployment", "machinedeployments", json!({"metadata": {"name": name}, "spec": spec})).await;
}

/// A Deployment of `replicas` pods each asking for 1.5 CPUs: one fits a small node.
async fn big_pods(w: &World, name: &str, replicas: i32, node_selector: Value) {
    w.cluster()
        .apply_json(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": w.ns()},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": {"app": name}},
                "template": {
                    "metadata": {"labels": {"app": name}},
                    "spec": {
                        "containers": [{"name": "app", "image": "registry.invalid/app:1",
                            "resources": {"requests": {"cpu": "1500m", "memory": "256Mi"}}}],
                        "terminationGracePeriodSeconds": 1,
                        "nodeSelector": node_selector,
                    }
                }
            }
        }))
        .await;
}

async fn scale_pods(w: &World, name: &str, replicas: i32) {
    let api: Api<k8s_openapi::api::apps::v1::Deployment> = Api::namespaced(w.cluster().client.clone(), w.ns());
    let patch = json!({"spec": {"replicas": replicas}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("scaling the pods");
}

/// The deployment's live machines (not being deleted), by name.
async fn live_machines(w: &World, md: &str) -> BTreeSet<String> {
    w.machines()
        .await
        .into_iter()
        .filter(|m| m.metadata.labels.get(LABEL_DEPLOYMENT).map(String::as_str) == Some(md))
        .filter(|m| m.metadata.deletion_timestamp.is_none())
        .map(|m| m.metadata.name)
        .collect()
}

/// Nodes carrying the autoscaler's deletion taint.
async fn tainted_nodes(w: &World) -> BTreeSet<String> {
    let nodes: Api<Node> = Api::all(w.cluster().client.clone());
    let list = nodes.list(&ListParams::default()).await.map(|l| l.items).unwrap_or_default();
    list.into_iter()
        .filter(|n| {
            let taints = n.spec.as_ref().and_then(|s| s.taints.as_ref());
            taints.is_some_and(|ts| ts.iter().any(|t| t.key == TAINT_AUTOSCALER_DELETING))
        })
        .filter_map(|n| n.metadata.name)
        .collect()
}

/// The autoscaler's scale-up decisions, for failure messages.
fn scale_up_lines(ca: &Autoscaler) -> String {
    let log = ca.log_text();
    log.lines().filter(|l| l.contains("Final scale-up plan") || l.contains("rror")).collect::<Vec<_>>().join("\n")
}

/// Waits until the controller has seen the deployment's latest spec (the CLI writes the embedded
/// store from another process; the controller learns of it by polling).
async fn observed(w: &World) {
    w.wait_for("the controller to see the latest spec", MINUTE, || async {
        let md = w.md("web").await;
        (md.status.observed_generation == md.metadata.generation).then_some(())
    })
    .await;
}

/// The messages of a deployment's events.
async fn md_events(w: &World, md: &str) -> Vec<String> {
    let key = machine_controller::store::Key::new(Kind::MachineDeployment, w.ns(), md);
    let events = w.store().backend().events(&key, 100).await.unwrap_or_default();
    events.into_iter().map(|e| e.message).collect()
}

/// Waits until the deployment has `replicas` and that many live machines.
async fn settled(w: &World, md: &str, replicas: i64) -> MachineDeployment {
    w.wait_for(&format!("{md} settled at {replicas} machines"), 2 * MINUTE, || async {
        let d = w.md(md).await;
        (d.spec.replicas == replicas && live_machines(w, md).await.len() as i64 == replicas).then_some(d)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pending_pods_scale_a_deployment_up_and_idle_nodes_go_exactly_without_a_second_drain() {
    let mut w = World::on_full_cluster(FAST, "autoscale").await;
    let c = w.start_controller(&["--autoscaler-listen", "127.0.0.1:0"]);
    let address = server_address(&w, c).await;
    class(&w).await;
    autoscaled_md(&w, "web", 1, 1, 4, json!({})).await;
    w.converged("web", 2 * MINUTE).await;
    let ca = Autoscaler::start(&w, &address, "");

    // Three pods of 1.5 CPUs: one fits the node there is, two stay Pending.
    big_pods(&w, "big", 3, json!({})).await;
    let what = "3 pods Running on 3 machines the autoscaler asked for";
    w.wait_for(what, 4 * MINUTE, || async { (w.ready_pods("big").await.len() == 3).then_some(()) }).await;
    assert!(ca.log_text().contains("web 1->3 (max: 4)"), "{}", scale_up_lines(&ca));
    let md = settled(&w, "web", 3).await;
    let note = md.metadata.annotations.get(ANNOTATION_AUTOSCALER_LAST_CHANGE).cloned().unwrap_or_default();
    assert!(note.contains("IncreaseSize") || note.contains("DeleteNodes"), "last size change: {note:?}");
    let said = md_events(&w, "web").await;
    assert!(said.iter().any(|e| e.contains("IncreaseSize: replicas 1 -> 3")), "{said:?}");
    // (An autoscaler loop that started before the pods ran may still add a fourth, idle node:
    // it goes with the others below.)
    let before = live_machines(&w, "web").await;
    assert!(before.len() >= 3, "{before:?}");

    // The status ConfigMap shows the group, healthy.
    let configmaps: Api<ConfigMap> = Api::namespaced(w.cluster().client.clone(), w.ns());
    let status = w
        .wait_for("the autoscaler's status ConfigMap", MINUTE, || async {
            let cm = configmaps.get_opt("cluster-autoscaler-status").await.ok().flatten()?;
            let text = cm.data?.get("status")?.clone();
            text.contains(&format!("{}/web", w.ns())).then_some(text)
        })
        .await;
    assert!(status.contains("Healthy"), "{status}");

    // Two pods go: two nodes are idle; the autoscaler drains and removes them, naming them.
    scale_pods(&w, "big", 1).await;
    // Every node the autoscaler tainted on the way (the taint goes with the Node).
    let tainted = std::sync::Mutex::new(BTreeSet::new());
    let seen = std::sync::Mutex::new(before.clone());
    w.wait_for("the deployment back at 1 machine", 4 * MINUTE, || async {
        let now_tainted = tainted_nodes(&w).await;
        tainted.lock().unwrap().extend(now_tainted);
        let live = live_machines(&w, "web").await;
        let n = live.len();
        seen.lock().unwrap().extend(live);
        (n == 1 && w.md("web").await.spec.replicas == 1).then_some(())
    })
    .await;
    let (tainted, seen) = (tainted.into_inner().unwrap(), seen.into_inner().unwrap());
    let after = live_machines(&w, "web").await;
    let gone: BTreeSet<String> = seen.difference(&after).cloned().collect();
    assert_eq!(gone.len(), seen.len() - 1, "{seen:?} -> {after:?}");
    // Exactly the machines whose nodes the autoscaler tainted (the fake cloud names a machine's
    // node as the machine), and none drained a second time.
    let store = w.store();
    let ns = w.ns().to_string();
    // Events are written after the fact: wait until a removed machine's drain is told.
    w.wait_for("a removed machine's Drained event", MINUTE, || async {
        for name in &gone {
            let key = machine_controller::store::Key::new(Kind::Machine, &ns, name);
            let events = store.backend().events(&key, 50).await.unwrap_or_default();
            if events.iter().any(|e| e.reason == "Drained") {
                return Some(());
            }
        }
        None
    })
    .await;
    let mut said = Vec::new();
    for name in &gone {
        let key = machine_controller::store::Key::new(Kind::Machine, &ns, name);
        let events = store.backend().events(&key, 50).await.unwrap_or_default();
        let ours: Vec<&str> = events
            .iter()
            .filter(|e| e.reason == "Drained" && !e.message.contains("drained by the cluster-autoscaler"))
            .map(|e| e.message.as_str())
            .collect();
        assert!(ours.is_empty(), "{name} was drained a second time: {ours:?}");
        said.push(format!(
            "{name}: {:?}",
            events.iter().map(|e| format!("{} {}", e.reason, e.message)).collect::<Vec<_>>()
        ));
    }
    assert!(said.iter().any(|s| s.contains("drained by the cluster-autoscaler")), "{said:?}");
    assert!(
        gone.is_subset(&tainted),
        "removed {gone:?}, tainted {tainted:?}\n{}\n{}",
        said.join("\n"),
        ca.log_text().lines().filter(|l| l.contains("cale") && !l.contains("reflector")).collect::<Vec<_>>().join("\n")
    );
    // Their VMs are gone from the cloud; the one left still runs the pod.
    w.wait_for("the fake cloud down to the machine left", MINUTE, || async {
        let vms = w.inspect().await.machines;
        (vms.len() == 1).then_some(())
    })
    .await;
    assert_eq!(w.ready_pods("big").await.len(), 1);
    let md = w.md("web").await;
    let note = md.metadata.annotations.get(ANNOTATION_AUTOSCALER_LAST_CHANGE).cloned().unwrap_or_default();
    assert!(note.contains("DeleteNodes"), "last size change: {note:?}");

    // kubectl: describe shows the bounds and the last size change; scale stays within the bounds.
    let ns = w.ns().to_string();
    let (code, out, err) = w.cluster().kubectl(&["describe", "machinedeployment", "web", "-n", &ns]).await;
    assert_eq!(code, 0, "{err}");
    let max = out.lines().find(|l| l.trim_start().starts_with("Max Replicas:")).map(|l| l.split_whitespace().last());
    assert!(out.contains("Autoscaling:") && max == Some(Some("4")), "{out}");
    assert!(out.contains(ANNOTATION_AUTOSCALER_LAST_CHANGE), "{out}");
    let (code, _, err) = w.cluster().kubectl(&["scale", "machinedeployment", "web", "-n", &ns, "--replicas=9"]).await;
    assert_ne!(code, 0, "kubectl scale above maxReplicas was accepted");
    assert!(err.contains("minReplicas, maxReplicas"), "{err}");
    let (code, _, err) = w.cluster().kubectl(&["scale", "machinedeployment", "web", "-n", &ns, "--replicas=2"]).await;
    assert_eq!(code, 0, "{err}");
    settled(&w, "web", 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_group_at_zero_grows_through_its_template_node_over_mutual_tls() {
    let mut w = World::on_full_cluster(FAST, "autoscale-zero").await;
    let pki = Pki::new(w.dir());
    let c = w.start_controller(&[
        "--autoscaler-listen",
        "127.0.0.1:0",
        "--autoscaler-tls-cert",
        &pki.path("server.crt"),
        "--autoscaler-tls-key",
        &pki.path("server.key"),
        "--autoscaler-client-ca",
        &pki.path("ca.crt"),
    ]);
    let address = server_address(&w, c).await;
    assert!(w.controller_log(c).contains("(mutual TLS)"), "{}", w.controller_log(c));
    // Without a client certificate, no call gets through.
    let plaintext = tonic::transport::Endpoint::from_shared(format!("http://{address}")).unwrap();
    if let Ok(channel) = plaintext.connect_timeout(Duration::from_secs(5)).connect().await {
        let mut c = CloudProviderClient::new(channel);
        assert!(c.node_groups(pb::NodeGroupsRequest {}).await.is_err(), "a plaintext call was answered");
    }
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(pki.read("ca.crt")))
        .domain_name("127.0.0.1");
    let no_cert =
        tonic::transport::Endpoint::from_shared(format!("https://{address}")).unwrap().tls_config(tls).unwrap();
    if let Ok(channel) = no_cert.connect_timeout(Duration::from_secs(5)).connect().await {
        let mut c = CloudProviderClient::new(channel);
        assert!(
            c.node_groups(pb::NodeGroupsRequest {}).await.is_err(),
            "a call without a client certificate was answered"
        );
    }
    // A class that declares no capacity: the fake driver reports its machine type's when it
    // validates the class, and the template node is built from that.
    let spec = json!({"driver": "fake", "providerSpec": {"machineType": "small", "zone": "zone-a"}});
    w.apply_object("MachineClass", "machineclasses", json!({"metadata": {"name": "small"}, "spec": joining(spec)}))
        .await;
    autoscaled_md(&w, "batch", 0, 0, 3, json!({"pool": "batch"})).await;
    let config = format!(
        "cert: \"{}\"\nkey: \"{}\"\ncacert: \"{}\"\n",
        pki.path("client.crt"),
        pki.path("client.key"),
        pki.path("ca.crt")
    );
    let ca = Autoscaler::start(&w, &address, &config);
    // Pods that only run on the group's nodes (its template's node label): none exists, so only
    // the template node (from the class's capacity) tells the autoscaler they would fit.
    big_pods(&w, "jobs", 2, json!({"pool": "batch"})).await;
    w.wait_for("2 pods Running on machines made from zero", 4 * MINUTE, || async {
        (w.ready_pods("jobs").await.len() == 2).then_some(())
    })
    .await;
    // The template node (2 CPUs) made it ask for exactly the two nodes the two pods need.
    assert!(ca.log_text().contains("batch 0->2 (max: 3)"), "{}", scale_up_lines(&ca));
    // A new Node carries the API server's not-ready taint for a moment after it turns Ready; an
    // autoscaler loop that falls in it can ask for one node more. It removes it again once idle.
    settled(&w, "batch", 2).await;
    assert_eq!(live_machines(&w, "batch").await.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_group_whose_creates_fail_for_quota_is_out_of_resources_and_the_autoscaler_takes_another() {
    let mut w = World::on_full_cluster(FAST, "autoscale-quota").await;
    let c = w.start_controller(&["--autoscaler-listen", "127.0.0.1:0"]);
    let address = server_address(&w, c).await;
    class(&w).await;
    let medium = json!({
        "driver": "fake",
        "providerSpec": {"machineType": "medium", "zone": "zone-a"},
        "capacity": {"cpu": "4", "memory": "8Gi"},
    });
    w.apply_object("MachineClass", "machineclasses", json!({"metadata": {"name": "medium"}, "spec": joining(medium)}))
        .await;
    // The cloud refuses every machine of `cheap` for quota, as a cloud whose quota is used up.
    w.set_faults(vec![fake_driver::pb::FaultRule {
        rpc: "CreateMachine".into(),
        target: "cheap-*".into(),
        action: "error".into(),
        code: "RESOURCE_EXHAUSTED".into(),
        reason: "QUOTA_EXCEEDED".into(),
        message: "the quota of small machines is used up".into(),
        ..Default::default()
    }])
    .await;
    autoscaled_md_of(&w, "cheap", "small", 0, (0, 3), json!({"tier": "any"})).await;
    autoscaled_md_of(&w, "roomy", "medium", 0, (0, 3), json!({"tier": "any"})).await;
    // least-waste prefers `cheap` (2 CPUs for a 1.5-CPU pod) over `roomy` (4 CPUs).
    let ca = Autoscaler::start_with(&w, &address, "", &["--expander=least-waste"]);
    big_pods(&w, "work", 1, json!({"tier": "any"})).await;
    w.wait_for("the pod Running on a machine of the second group", 4 * MINUTE, || async {
        (w.ready_pods("work").await.len() == 1 && !live_machines(&w, "roomy").await.is_empty()).then_some(())
    })
    .await;
    let log = ca.log_text();
    assert!(log.contains("cheap 0->1"), "it tried the cheaper group first: {}", scale_up_lines(&ca));
    assert!(log.contains("OutOfResources") || log.contains("QUOTA_EXCEEDED"), "{}", scale_up_lines(&ca));
    // The refused machine is removed again, and the cheap group is back at zero.
    settled(&w, "cheap", 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_of_the_controller_after_the_autoscalers_increase_creates_each_machine_once() {
    // The fake cloud creates slowly, so the kill lands between the size write and the machines.
    let mut w =
        World::on_full_cluster(&["--create-latency", "2s", "--delete-latency", "200ms"], "autoscale-kill").await;
    // One address for both controllers: the autoscaler's cloud-config names it.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let address = format!("127.0.0.1:{port}");
    let first = w.start_controller(&["--autoscaler-listen", &address]);
    server_address(&w, first).await;
    class(&w).await;
    autoscaled_md(&w, "web", 1, 1, 4, json!({})).await;
    w.converged("web", 2 * MINUTE).await;
    let ca = Autoscaler::start(&w, &address, "");
    big_pods(&w, "big", 3, json!({})).await;
    // The autoscaler's IncreaseSize is written: kill -9 before the machines are made.
    w.wait_for("the autoscaler's IncreaseSize", 2 * MINUTE, || async {
        (w.md("web").await.spec.replicas > 1).then_some(())
    })
    .await;
    w.kill9_controller(first).await;
    let second = w.start_controller(&["--autoscaler-listen", &address]);
    server_address(&w, second).await;
    w.wait_for("3 pods Running", 4 * MINUTE, || async { (w.ready_pods("big").await.len() == 3).then_some(()) }).await;
    // The store and the cloud agree (a node the autoscaler asked for too many may be on its
    // way out meanwhile), and no machine was created twice.
    w.wait_for("the store and the cloud in agreement", 2 * MINUTE, || async {
        let md = w.converged("web", 2 * MINUTE).await;
        let cloud = w.inspect().await;
        let vms: BTreeSet<String> = cloud.machines.iter().map(|m| m.name.clone()).collect();
        let live = live_machines(&w, "web").await;
        (live == vms && live.len() as i64 == md.spec.replicas).then_some(())
    })
    .await;
    for m in &w.inspect().await.machines {
        assert_eq!(m.times_created, 1, "{} was created {} times\n{}", m.name, m.times_created, scale_up_lines(&ca));
    }
    let c = w.inspect().await.counters.expect("counters");
    assert_eq!(c.machines_created - c.machines_deleted, live_machines(&w, "web").await.len() as u64);
}

// ----- the calls, made as the autoscaler makes them, on the embedded store -----

use autoscaler_proto::pb;
use autoscaler_proto::pb::cloud_provider_client::CloudProviderClient;
use e2e_tests::world::Driver;
use tonic::Code;

type Client = CloudProviderClient<tonic::transport::Channel>;

async fn client(address: &str) -> Client {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
        .expect("endpoint")
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .expect("connecting to the autoscaler server");
    CloudProviderClient::new(channel)
}

fn md_yaml(replicas: i64, image: &str, extra: &str) -> String {
    let class = "apiVersion: machine.driver.dev/v1alpha1\nkind: MachineClass\nmetadata: {name: small}\n\
                 spec: {driver: fake, providerSpec: {machineType: small}}\n";
    let md = [
        "apiVersion: machine.driver.dev/v1alpha1",
        "kind: MachineDeployment",
        "metadata: {name: web}",
        "spec:",
        &format!("  replicas: {replicas}"),
        "  autoscaling: {minReplicas: 2, maxReplicas: 5}",
        &format!("  template: {{spec: {{classRef: {{name: small}}, providerSpec: {{image: {image}}}}}}}"),
    ]
    .join("\n");
    format!("{class}---\n{md}\n{extra}")
}

fn node(provider_id: &str) -> pb::ExternalGrpcNode {
    pb::ExternalGrpcNode {
        provider_id: provider_id.into(),
        name: provider_id.rsplit('/').next().unwrap_or("").into(),
        ..Default::default()
    }
}

async fn delete_nodes(c: &mut Client, ids: &[&str]) -> Result<(), tonic::Status> {
    let nodes = ids.iter().map(|id| node(id)).collect();
    c.node_group_delete_nodes(pb::NodeGroupDeleteNodesRequest { nodes, id: "default/web".into() }).await.map(drop)
}

async fn provider_ids(w: &World) -> Vec<String> {
    let mut ids: Vec<String> = w.machines().await.into_iter().map(|m| m.status.provider_id).collect();
    ids.sort();
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn size_calls_refuse_what_they_must_with_a_reason_and_remove_exactly_the_named_machine() {
    let w = World::builder()
        .driver(Driver::fake(&["--create-latency", "200ms", "--delete-latency", "100ms"]))
        .controller_args(&["--resync-interval", "5s", "--autoscaler-listen", "127.0.0.1:0"])
        .start()
        .await;
    w.apply(&md_yaml(3, "os-1", "")).await;
    w.converged("web", MINUTE).await;
    let address = server_address(&w, 0).await;
    let mut c = client(&address).await;
    // By hand, with grpcurl 1.8.6 through reflection (v1alpha), as the README shows.
    let method = "clusterautoscaler.cloudprovider.v1.externalgrpc.CloudProvider/NodeGroupTargetSize";
    let (code, out, err) =
        e2e_tests::run(&e2e_tests::grpcurl(), &["-plaintext", "-d", r#"{"id":"default/web"}"#, &address, method]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(r#""targetSize": 3"#), "{out}");
    let groups = c.node_groups(pb::NodeGroupsRequest {}).await.unwrap().into_inner().node_groups;
    assert_eq!(groups.len(), 1);
    assert_eq!((groups[0].id.as_str(), groups[0].min_size, groups[0].max_size), ("default/web", 2, 5));
    let ids = provider_ids(&w).await;

    // Nodes: ours by provider ID, others the empty group (not an error).
    let ours = c.node_group_for_node(pb::NodeGroupForNodeRequest { node: Some(node(&ids[0])) }).await.unwrap();
    assert_eq!(ours.into_inner().node_group.unwrap().id, "default/web");
    let foreign = c.node_group_for_node(pb::NodeGroupForNodeRequest { node: Some(node("aws:///x/i-1")) }).await;
    assert_eq!(foreign.unwrap().into_inner().node_group.unwrap().id, "");
    let instances = c.node_group_nodes(pb::NodeGroupNodesRequest { id: "default/web".into() }).await.unwrap();
    let mut listed: Vec<String> = instances.into_inner().instances.into_iter().map(|i| i.id).collect();
    listed.sort();
    assert_eq!(listed, ids);

    // Refusals name what is wrong and change nothing.
    let unknown = c.node_group_target_size(pb::NodeGroupTargetSizeRequest { id: "default/nope".into() }).await;
    assert_eq!(unknown.unwrap_err().code(), Code::NotFound);
    let too_big =
        c.node_group_increase_size(pb::NodeGroupIncreaseSizeRequest { delta: 3, id: "default/web".into() }).await;
    let e = too_big.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.message().contains("above maxReplicas 5"), "{}", e.message());
    let e = delete_nodes(&mut c, &["fake:///zone-a/not-ours"]).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("is not a machine of node group default/web"), "{}", e.message());
    let e = delete_nodes(&mut c, &[&ids[0], &ids[1]]).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.message().contains("below minReplicas 2"), "{}", e.message());
    let e = c
        .node_group_decrease_target_size(pb::NodeGroupDecreaseTargetSizeRequest { delta: -1, id: "default/web".into() })
        .await
        .unwrap_err();
    assert!(e.message().contains("attempt to delete existing nodes"), "{}", e.message());
    // The class declares no capacity; the fake driver reported its machine type's.
    let template = c.node_group_template_node_info(pb::NodeGroupTemplateNodeInfoRequest { id: "default/web".into() });
    let bytes = template.await.expect("a template node").into_inner().node_bytes;
    let node = autoscaler_proto::node::Node::decode_bytes(&bytes).unwrap();
    let capacity = node.status.unwrap().capacity;
    assert_eq!(capacity["cpu"].string.as_deref(), Some("2"));
    assert_eq!(capacity["memory"].string.as_deref(), Some("4Gi"));

    // A budget that names Autoscaler refuses the removal.
    let budget = "  disruption: {budgets: [{machines: 0, reasons: [Autoscaler]}]}\n";
    w.apply(&md_yaml(3, "os-1", budget)).await;
    observed(&w).await;
    let e = delete_nodes(&mut c, &[&ids[0]]).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{}\n{}", e.message(), w.logs());
    assert!(e.message().contains("disruption budget 0 allows 0"), "{}", e.message());

    // A rollout in progress refuses scale-down (autoscaler#8494).
    w.apply(&md_yaml(3, "os-2", "")).await;
    w.wait_for("the rollout under way", MINUTE, || async { w.md("web").await.status.rollout.map(drop) }).await;
    let e = delete_nodes(&mut c, &[&ids[0]]).await.unwrap_err();
    assert!(e.message().contains("is rolling out"), "{}", e.message());
    assert_eq!(w.md("web").await.spec.replicas, 3, "no refusal changed the size");
    let md = w.converged("web", 2 * MINUTE).await;
    let refused = md_events(&w, "web").await;
    // (The store folds repeated events of one reason into the first, counting them.)
    assert!(refused.iter().any(|m| m.starts_with("refused IncreaseSize from the cluster-autoscaler")), "{refused:?}");

    // Now it goes: exactly the named machine, its VM, and replicas down by one in one write.
    let _ = md;
    let ids = provider_ids(&w).await;
    delete_nodes(&mut c, &[&ids[1]]).await.expect("DeleteNodes");
    assert_eq!(w.md("web").await.spec.replicas, 2, "lowered before the call returned");
    w.converged("web", MINUTE).await;
    let left = provider_ids(&w).await;
    assert_eq!(left, vec![ids[0].clone(), ids[2].clone()]);
    w.assert_consistent(2).await;

    // `apply` of the manifest (replicas: 3) leaves the autoscaler's size; --force-replicas sets it.
    w.apply(&md_yaml(3, "os-2", "")).await;
    assert_eq!(w.md("web").await.spec.replicas, 2, "apply kept the autoscaler's replicas");
    let file = w.dir().join("web.yaml");
    std::fs::write(&file, md_yaml(4, "os-2", "")).unwrap();
    let (code, _, err) = w.cli(&["apply", "-f", file.to_str().unwrap(), "--force-replicas"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(w.md("web").await.spec.replicas, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_the_controller_right_after_increase_size_creates_each_machine_once() {
    let mut w = World::builder()
        .driver(Driver::fake(&["--create-latency", "1s", "--delete-latency", "100ms"]))
        .controller_args(&["--resync-interval", "5s", "--autoscaler-listen", "127.0.0.1:0"])
        .start()
        .await;
    w.apply(&md_yaml(2, "os-1", "")).await;
    w.converged("web", MINUTE).await;
    let mut c = client(&server_address(&w, 0).await).await;
    c.node_group_increase_size(pb::NodeGroupIncreaseSizeRequest { delta: 3, id: "default/web".into() })
        .await
        .expect("IncreaseSize");
    // The size is written when the call returns; the creates are the reconciler's, under way.
    w.kill9_controller(0).await;
    assert_eq!(w.md("web").await.spec.replicas, 5);
    w.start_controller(&[]);
    w.converged("web", 2 * MINUTE).await;
    w.assert_consistent(5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_leader_answers_and_a_follower_says_unavailable() {
    let cluster = e2e_tests::kube_cluster::Cluster::start().await;
    let mut w = World::builder().kubernetes(cluster, "autoscale-leader").without_controller().start().await;
    let args = ["--leader-elect", "--autoscaler-listen", "127.0.0.1:0", "--no-target-cluster"];
    let a = w.start_controller(&[&args[..], &["--leader-elect-identity", "a"]].concat());
    w.wait_for("controller a leading", MINUTE, || async {
        w.controller_log(a).contains("running (leader)").then_some(())
    })
    .await;
    let b = w.start_controller(&[&args[..], &["--leader-elect-identity", "b"]].concat());
    let (leader, follower) = (server_address(&w, a).await, server_address(&w, b).await);
    let e = client(&follower).await.node_groups(pb::NodeGroupsRequest {}).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable);
    assert!(e.message().contains("not the leader"), "{}", e.message());
    client(&leader).await.node_groups(pb::NodeGroupsRequest {}).await.expect("the leader answers");
}

#[tokio::test]
async fn plaintext_off_loopback_is_refused_unless_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store.db");
    // `machine-controller run` with `extra`: its exit code and stderr.
    let run = |extra: &'static [&'static str]| {
        let store = store.to_string_lossy().into_owned();
        async move {
            let mut args = vec!["--store", &store, "run", "--driver", "fake=unix:///nonexistent.sock"];
            args.extend(extra);
            let (code, _, err) = e2e_tests::run(&e2e_tests::bin("machine-controller"), &args).await;
            (code, err)
        }
    };
    let (code, err) = run(&["--autoscaler-listen", "0.0.0.0:0"]).await;
    assert_ne!(code, 0);
    assert!(err.contains("is not a loopback address") && err.contains("--autoscaler-allow-plaintext"), "{err}");
    let (code, err) = run(&["--autoscaler-tls-cert", "c.pem"]).await;
    assert_ne!(code, 0);
    assert!(err.contains("--autoscaler-tls-key") && err.contains("--autoscaler-client-ca"), "{err}");
}
