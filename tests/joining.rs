//! Machines join with credentials minted for them alone: boot data rendered per machine from the
//! class's template, a bootstrap token per machine in the target cluster (docs/src/operating/
//! joining-nodes.md).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use e2e_tests::world::{Driver, World};
use fake_driver::pb as fake;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Secret};
use kube::api::{Api, DeleteParams, ListParams};
use kube::runtime::{watcher, WatchStreamExt};
use machine_controller::resources::*;

const MINUTE: Duration = Duration::from_secs(60);

fn class(user_data: &str) -> String {
    let indented: String = user_data.lines().map(|l| format!("    {l}\n")).collect();
    format!(
        "apiVersion: machine.driver.dev/v1alpha1\nkind: MachineClass\nmetadata: {{name: small}}\nspec:\n  driver: fake\n  providerSpec: {{machineType: small}}\n  userData: |\n{indented}"
    )
}

const DEPLOYMENT: &str = "apiVersion: machine.driver.dev/v1alpha1
kind: MachineDeployment
metadata: {name: web}
spec:
  replicas: 2
  template:
    spec:
      classRef: {name: small}
";

/// Without a target cluster there is no token to mint and no API server to name: nothing is
/// created, the machines and their deployment say why; a template that needs none creates them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_that_needs_a_target_cluster_creates_nothing_without_one_and_says_why() {
    let w = World::builder().driver(Driver::fake(&["--create-latency", "100ms"])).in_process().start().await;
    w.apply(&class("#!/bin/sh\nkubeadm join {{ .APIServerHost }} --token {{ .BootstrapToken }}")).await;
    w.apply(DEPLOYMENT).await;
    let md = w
        .wait_for("the deployment's BootDataUnrenderable condition", MINUTE, || async {
            let md = w.md("web").await;
            let c = condition(&md.status.conditions, ConditionType::BootDataUnrenderable)?;
            (c.status == ConditionStatus::True).then_some(md)
        })
        .await;
    let c = condition(&md.status.conditions, ConditionType::BootDataUnrenderable).unwrap();
    assert!(
        c.message.contains("{{ .APIServerHost }}") && c.message.contains("needs a target cluster"),
        "{}",
        c.message
    );
    for m in w.machines().await {
        let ready = condition(&m.status.conditions, ConditionType::Ready).unwrap();
        assert_eq!(ready.reason, Reason::BootDataUnrenderable, "{}", m.metadata.name);
        assert!(m.status.bootstrap_token.is_none(), "no token is minted without a target");
    }
    assert!(w.inspect().await.machines.is_empty(), "nothing half-rendered is created");

    // A template of the machine's own variables renders without a cluster.
    w.apply(&class("#!/bin/sh\nhostname {{ .MachineName }}\necho {{ v1.local_hostname }}")).await;
    w.wait_for("both machines created and the condition gone", MINUTE, || async {
        let md = w.md("web").await;
        let created = w.inspect().await.machines.iter().filter(|m| m.state == "RUNNING").count();
        (created == 2 && condition(&md.status.conditions, ConditionType::BootDataUnrenderable).is_none()).then_some(())
    })
    .await;
}

/// `machine-controller apply` of `yaml` in the world's namespace (the CLI's default is
/// `default`): each `metadata: {name: …}` gets the namespace.
async fn apply_here(w: &World, yaml: &str) {
    w.apply(&yaml.replace("metadata: {name: ", &format!("metadata: {{namespace: {}, name: ", w.ns()))).await;
}

fn joining_class(provider_spec: &str) -> String {
    e2e_tests::joining_class("small", provider_spec)
}

async fn nodes(w: &World) -> Vec<Node> {
    Api::<Node>::all(w.cluster().client.clone()).list(&ListParams::default()).await.map(|l| l.items).unwrap_or_default()
}

const JOINING_DEPLOYMENT: &str = "apiVersion: machine.driver.dev/v1alpha1
kind: MachineDeployment
metadata: {name: web}
spec:
  replicas: 3
  template:
    spec:
      classRef: {name: small}
      nodeTemplate:
        labels: {role: web, node-role.kubernetes.io/web: \"\"}
        taints: [{key: dedicated, value: web, effect: NoSchedule}]
";

/// The bootstrap token Secrets the controller minted (and the label naming their holder).
async fn tokens(w: &World) -> Vec<Secret> {
    let api = Api::<Secret>::namespaced(w.cluster().client.clone(), "kube-system");
    let lp = ListParams::default().labels("machine.driver.dev/bootstrap-token-for");
    api.list(&lp).await.map(|l| l.items).unwrap_or_default()
}

/// Every token Secret created while `f` runs, with its values, as a watch saw them.
fn watch_tokens(w: &World) -> (Arc<Mutex<BTreeMap<String, Secret>>>, tokio::task::JoinHandle<()>) {
    let seen: Arc<Mutex<BTreeMap<String, Secret>>> = Arc::default();
    let api = Api::<Secret>::namespaced(w.cluster().client.clone(), "kube-system");
    let config = watcher::Config::default().labels("machine.driver.dev/bootstrap-token-for");
    let into = seen.clone();
    let task = tokio::spawn(async move {
        let mut events = std::pin::pin!(watcher(api, config).default_backoff());
        while let Some(e) = events.next().await {
            if let Ok(watcher::Event::Apply(s) | watcher::Event::InitApply(s)) = e {
                into.lock().unwrap().insert(s.metadata.name.clone().unwrap_or_default(), s);
            }
        }
    });
    (seen, task)
}

fn token_value(s: &Secret) -> String {
    let data = s.data.clone().unwrap_or_default();
    let text = |k: &str| data.get(k).map(|b| String::from_utf8_lossy(&b.0).into_owned()).unwrap_or_default();
    format!("{}.{}", text("token-id"), text("token-secret"))
}

/// A deployment's machines join by TLS bootstrap from boot data rendered for each: a token of
/// its own each, gone once its Node joined; each Node registered by `system:node:<name>`, and no
/// token secret anywhere the controller writes or logs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machines_join_by_tls_bootstrap_each_with_a_token_of_its_own_deleted_once_joined() {
    let state = tempfile::tempdir().unwrap();
    let state_file = state.path().join("cloud.json");
    let fake = ["--create-latency", "300ms", "--state-file", state_file.to_str().unwrap()];
    let mut w = World::on_full_cluster(&fake, "join").await;
    let (seen, watch) = watch_tokens(&w);
    w.start_controller_env(&[], &[("RUST_LOG", "machine_controller=trace,kube=trace,info")]);
    apply_here(&w, &joining_class("{machineType: small}")).await;
    apply_here(&w, JOINING_DEPLOYMENT).await;
    w.converged("web", 3 * MINUTE).await;
    w.wait_for("every token deleted once its Node joined", MINUTE, || async {
        let left = tokens(&w).await;
        let recorded = w.machines().await.iter().filter(|m| m.status.bootstrap_token.is_some()).count();
        (left.is_empty() && recorded == 0).then_some(())
    })
    .await;
    watch.abort();
    let seen = seen.lock().unwrap().clone();
    let machines = w.machines().await;
    // One token per machine, never a second.
    let holders: BTreeSet<String> = seen
        .values()
        .filter_map(|s| s.metadata.labels.as_ref()?.get("machine.driver.dev/bootstrap-token-for").cloned())
        .collect();
    let expected: BTreeSet<String> = machines.iter().map(|m| format!("{}.{}", w.ns(), m.metadata.name)).collect();
    assert_eq!(holders, expected, "each machine had a token");
    assert_eq!(seen.len(), 3, "one token per machine: {:?}", seen.keys());
    for s in seen.values() {
        assert_eq!(s.type_.as_deref(), Some("bootstrap.kubernetes.io/token"));
        let data = s.data.clone().unwrap_or_default();
        assert!(data.contains_key("expiration"), "every token expires");
    }
    // Each Node registered by its own kubelet's identity, as the Node authorizer sees it.
    let nodes = nodes(&w).await;
    assert_eq!(nodes.len(), 3);
    let audit = w.cluster().audit_events();
    for n in &nodes {
        let name = n.metadata.name.clone().unwrap();
        let by = audit
            .iter()
            .find(|e| {
                e["verb"] == "create"
                    && e["objectRef"]["resource"] == "nodes"
                    && e["objectRef"]["name"] == name.as_str()
            })
            .map(|e| e["user"]["username"].as_str().unwrap_or_default().to_string());
        assert_eq!(by.as_deref(), Some(format!("system:node:{name}").as_str()), "who created Node {name}");
        let labels = n.metadata.labels.clone().unwrap_or_default();
        assert_eq!(labels.get("role").map(String::as_str), Some("web"), "registered with the template's labels");
        assert!(labels.contains_key("node-role.kubernetes.io/web"), "the controller set what a kubelet may not");
        let taints = n.spec.as_ref().and_then(|s| s.taints.clone()).unwrap_or_default();
        assert!(taints.iter().any(|t| t.key == "dedicated" && t.effect == "NoSchedule"), "{taints:?}");
    }
    // A node's own credentials (the kubeconfig its kubelet got, kept in the cloud's state) may
    // change its own Node, not another's: NodeRestriction.
    let cloud: serde_json::Value = serde_json::from_slice(&std::fs::read(&state_file).unwrap()).unwrap();
    let (me, other) = (machines[0].metadata.name.clone(), machines[1].metadata.name.clone());
    let kubeconfig = cloud["machines"][&me]["kubelet"]["kubeconfig"].as_str().expect("the kubelet's kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::from_yaml(kubeconfig).unwrap(),
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .unwrap();
    let as_node = Api::<Node>::all(kube::Client::try_from(config).unwrap());
    let patch = serde_json::json!({"metadata": {"annotations": {"e2e.example/touched": "yes"}}});
    let pp = kube::api::PatchParams::default();
    as_node.patch(&me, &pp, &kube::api::Patch::Merge(&patch)).await.expect("a node patches its own Node");
    match as_node.patch(&other, &pp, &kube::api::Patch::Merge(&patch)).await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 403, "{s:?}"),
        r => panic!("{me}'s credentials patched Node {other}: {r:?}"),
    }
    // No token's secret in the controller's log (at trace level), its events, the Machines'
    // status or `describe`.
    let mut describe = String::new();
    for m in &machines {
        let (code, out, err) = w.cli(&["describe", "machine", &m.metadata.name, "-n", w.ns()]).await;
        assert_eq!(code, 0, "{err}");
        describe += &out;
    }
    let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(w.cluster().client.clone(), w.ns())
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    let events = serde_json::to_string(&events).unwrap();
    let status = serde_json::to_string(&machines).unwrap();
    let log = w.controller_log(0);
    assert!(log.contains("TRACE") || log.contains("trace"), "the controller logged at trace level");
    for s in seen.values() {
        let value = token_value(s);
        let secret = value.split_once('.').map(|(_, s)| s.to_string()).unwrap_or_default();
        assert_eq!(secret.len(), 16, "{}", s.metadata.name.as_deref().unwrap_or_default());
        for (what, text) in [("log", &log), ("events", &events), ("status", &status), ("describe", &describe)] {
            assert!(!text.contains(&secret), "a token secret in the controller's {what}");
        }
    }
    w.assert_controller_never_forbidden();
    w.kill9().await;
}

/// A token deleted behind the controller's back before its machine's Node joined: the machine
/// cannot join any more (its boot data cannot change), so it fails as `NodeNotJoined` and its
/// deployment replaces it, with a token of its own; at any time one token per unjoined machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_deleted_before_its_node_joined_fails_the_machine_and_it_is_replaced() {
    let mut w = World::on_full_cluster(&["--create-latency", "300ms"], "join-gone").await;
    w.start_controller(&[]);
    // Kubelets that never start: the machines wait for their Nodes with their tokens.
    apply_here(&w, &joining_class("{machineType: small, kubelet: NeverJoins}")).await;
    apply_here(&w, &JOINING_DEPLOYMENT.replace("replicas: 3", "replicas: 2")).await;
    let victim = w
        .wait_for("two created machines, each with its token", MINUTE, || async {
            let machines = w.machines().await;
            let waiting: Vec<&Machine> = machines
                .iter()
                .filter(|m| m.status.phase == Phase::Provisioned && m.status.bootstrap_token.is_some())
                .collect();
            (waiting.len() == 2 && tokens(&w).await.len() == 2).then(|| waiting[0].clone())
        })
        .await;
    let id = victim.status.bootstrap_token.clone().unwrap().id;
    let api = Api::<Secret>::namespaced(w.cluster().client.clone(), "kube-system");
    api.delete(&format!("bootstrap-token-{id}"), &DeleteParams::default()).await.unwrap();
    let failed = w
        .wait_for("the victim failed as NodeNotJoined", MINUTE, || async {
            let m = w.machines().await.into_iter().find(|m| m.metadata.uid == victim.metadata.uid)?;
            let f = m.status.failure.clone()?;
            (f.reason == "NODE_NOT_JOINED").then_some(f)
        })
        .await;
    assert!(failed.message.contains(&format!("bootstrap-token-{id}")), "{}", failed.message);
    // Replaced: a new machine comes with a token of its own (the failed one stays until its
    // replacement is available, which a kubelet that never starts never is); one token per
    // machine waiting for its Node, none for the failed one.
    w.wait_seen("a replacement, one token per waiting machine", 2 * MINUTE, || async {
        let machines = w.machines().await;
        let waiting: Vec<&Machine> =
            machines.iter().filter(|m| !m.is_deleting() && m.status.failure.is_none()).collect();
        let replaced = machines.iter().any(|m| m.metadata.uid == victim.metadata.uid) && waiting.len() == 2;
        let ids: BTreeSet<String> = waiting.iter().filter_map(|m| Some(m.status.bootstrap_token.clone()?.id)).collect();
        let secrets: BTreeSet<String> = tokens(&w)
            .await
            .iter()
            .filter_map(|s| Some(s.metadata.name.clone()?.trim_start_matches("bootstrap-token-").to_string()))
            .collect();
        let seen = format!("{} waiting, their tokens {ids:?}, token Secrets {secrets:?}", waiting.len());
        (replaced && ids.len() == 2 && ids == secrets && !ids.contains(&id)).then_some(()).ok_or(seen)
    })
    .await;
    // Deleting the deployment takes the tokens of machines that never joined with it.
    let (code, _, err) = w.cli(&["delete", "machinedeployment", "web", "-n", w.ns()]).await;
    assert_eq!(code, 0, "{err}");
    w.wait_for("no machine and no token left", 2 * MINUTE, || async {
        (w.machines().await.is_empty() && tokens(&w).await.is_empty()).then_some(())
    })
    .await;
    w.assert_controller_never_forbidden();
    w.kill9().await;
}

/// kill -9 of the controller after it minted the tokens and before its creates succeed (the
/// cloud refuses them): the controller that comes back reuses each machine's token, mints no
/// second one, and once the machines joined none is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_killed_between_minting_and_create_reuses_the_tokens() {
    let mut w = World::on_full_cluster(&["--create-latency", "300ms"], "join-kill").await;
    let refuse = fake::FaultRule {
        rpc: "CreateMachine".into(),
        target: "*".into(),
        action: "error".into(),
        code: "UNAVAILABLE".into(),
        ..Default::default()
    };
    w.set_faults(vec![refuse]).await;
    let first = w.start_controller(&[]);
    apply_here(&w, &joining_class("{machineType: small}")).await;
    apply_here(&w, JOINING_DEPLOYMENT).await;
    let minted = w
        .wait_for("three machines with a token each and their creates refused", MINUTE, || async {
            let machines = w.machines().await;
            let ids: BTreeSet<String> =
                machines.iter().filter_map(|m| Some(m.status.bootstrap_token.clone()?.id)).collect();
            // The cloud refused creates (at least one per machine) and holds no machine.
            let cloud = w.inspect().await;
            let refused = cloud.counters.is_some_and(|c| c.faults_fired >= 3) && cloud.machines.is_empty();
            (machines.len() == 3 && ids.len() == 3 && refused && tokens(&w).await.len() == 3).then_some(ids)
        })
        .await;
    w.kill9_controller(first).await;
    w.start_controller(&[]);
    w.set_faults(Vec::new()).await;
    w.converged("web", 3 * MINUTE).await;
    w.wait_for("no token left once the Nodes joined", MINUTE, || async { tokens(&w).await.is_empty().then_some(()) })
        .await;
    // The tokens the Nodes joined with were the first controller's: the audit log shows every
    // CSR made by one of them.
    let audit = w.cluster().audit_events();
    let csr_by: BTreeSet<String> = audit
        .iter()
        .filter(|e| e["verb"] == "create" && e["objectRef"]["resource"] == "certificatesigningrequests")
        .filter_map(|e| e["user"]["username"].as_str()?.strip_prefix("system:bootstrap:").map(str::to_string))
        .collect();
    assert!(!csr_by.is_empty() && csr_by.is_subset(&minted), "CSRs by {csr_by:?}, minted {minted:?}");
    w.assert_controller_never_forbidden();
    w.kill9().await;
}

/// The fake cloud's kubelets join from the boot data alone: a machine whose token the API
/// server does not know, or whose token expired, never gets a Node (its kubelet says why); one
/// with a valid token joins by TLS bootstrap under its own name. The sidecar, logging at trace
/// level, never shows a token's secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_joins_with_a_valid_token_only() {
    let cluster = e2e_tests::kube_cluster::Cluster::start_full().await;
    let kubeconfig = cluster.kubeconfig.to_string_lossy().into_owned();
    let driver =
        Driver::fake(&["--create-latency", "100ms", "--join-cluster", &kubeconfig]).env([("RUST_LOG", "trace")]);
    let w = World::builder().driver(driver).kubernetes(cluster, "join-fake").without_controller().start().await;
    let in_an_hour =
        (chrono::Utc::now() + chrono::Duration::hours(1)).to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let an_hour_ago =
        (chrono::Utc::now() - chrono::Duration::hours(1)).to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    w.cluster().bootstrap_token("good01", "0123456789abcdef", &in_an_hour).await;
    w.cluster().bootstrap_token("past01", "fedcba9876543210", &an_hour_ago).await;
    let machines = [
        ("m-wrong", "wrong1.aaaaaaaaaaaaaaaa"),
        ("m-expired", "past01.fedcba9876543210"),
        ("m-good", "good01.0123456789abcdef"),
    ];
    let c = w.driver_client().await;
    for (name, token) in machines {
        let secrets =
            driver_sdk::proto::Secrets { data: [("userData".to_string(), w.cluster().boot_data(token))].into() };
        let req = driver_sdk::proto::CreateMachineRequest {
            name: name.into(),
            provider_spec: Some(driver_sdk::convert::json_to_struct(&serde_json::json!({"machineType": "small"}))),
            secrets: Some(secrets),
            ..Default::default()
        };
        c.create_machine(req).await.unwrap_or_else(|e| panic!("CreateMachine {name}: {e}"));
    }
    let node = w
        .wait_for("m-good's Node", MINUTE, || async {
            Api::<Node>::all(w.cluster().client.clone()).get_opt("m-good").await.ok().flatten()
        })
        .await;
    assert_eq!(node.spec.and_then(|s| s.provider_id).map(|p| p.starts_with("fake:///")), Some(true));
    // The two others were refused, and say so.
    w.wait_for("both refused kubelets logged why", MINUTE, || async {
        let log = w.sidecar().log_text();
        let refused = |m: &str| log.lines().any(|l| l.contains(m) && l.contains("refused the bootstrap token"));
        (refused("m-wrong") && refused("m-expired")).then_some(())
    })
    .await;
    let names: BTreeSet<String> = nodes(&w).await.into_iter().filter_map(|n| n.metadata.name).collect();
    assert_eq!(names, BTreeSet::from(["m-good".to_string()]));
    let audit = w.cluster().audit_events();
    let created_by = audit
        .iter()
        .find(|e| e["verb"] == "create" && e["objectRef"]["resource"] == "nodes" && e["objectRef"]["name"] == "m-good")
        .map(|e| e["user"]["username"].clone());
    assert_eq!(created_by, Some("system:node:m-good".into()));
    let log = w.sidecar().log_text();
    assert!(log.contains("TRACE"), "the sidecar logged at trace level");
    for secret in ["aaaaaaaaaaaaaaaa", "fedcba9876543210", "0123456789abcdef"] {
        assert!(!log.contains(secret), "a token secret in the sidecar's log");
    }
}
