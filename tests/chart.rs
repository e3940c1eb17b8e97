//! The Helm charts (deploy/chart/): `helm lint`, `helm template` with each driver's values, and
//! the real `helm install` (Helm 4: server-side apply) into a test cluster with a controller
//! manager, a scheduler and kwok, whose pods of the controller's Deployment then run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use e2e_tests::kube_cluster::Cluster;
use e2e_tests::{eventually_seen, installed_tool, run};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, ListParams};
use serde_json::Value;

const DRIVERS: [&str; 3] = ["fake", "aws", "azure"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn chart() -> String {
    root().join("deploy/chart/machine-controller").to_string_lossy().into_owned()
}

fn crd_chart() -> String {
    root().join("deploy/chart/machine-controller-crds").to_string_lossy().into_owned()
}

fn values(driver: &str) -> String {
    root().join(format!("deploy/chart/machine-controller/ci/{driver}-values.yaml")).to_string_lossy().into_owned()
}

fn helm_bin() -> PathBuf {
    installed_tool("HELM_BIN", "install-go-tool.sh", &["helm"])
}

/// Runs helm with its state (repositories, cache, config) in `home`, never the user's.
async fn helm(home: &Path, args: &[&str]) -> (i32, String, String) {
    let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    for (flag, dir) in [
        ("--repository-cache", "cache"),
        ("--repository-config", "repositories.yaml"),
        ("--registry-config", "registry.json"),
    ] {
        all.push(format!("{flag}={}", home.join(dir).display()));
    }
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    run(&helm_bin(), &all).await
}

/// `helm template` of the controller's chart; its objects by `Kind/name`.
async fn render(home: &Path, release: &str, namespace: &str, extra: &[&str]) -> BTreeMap<String, Value> {
    let chart = chart();
    let mut args = vec!["template", release, &chart, "--namespace", namespace];
    args.extend(extra);
    let (code, out, err) = helm(home, &args).await;
    assert_eq!(code, 0, "helm {args:?}: {err}");
    objects(&out)
}

fn objects(yaml: &str) -> BTreeMap<String, Value> {
    let docs: Vec<Value> = serde_saphyr::from_multiple(yaml).unwrap_or_else(|e| panic!("rendered YAML: {e}\n{yaml}"));
    docs.into_iter()
        .filter(|d| !d.is_null())
        .map(|d| (format!("{}/{}", d["kind"].as_str().unwrap(), d["metadata"]["name"].as_str().unwrap()), d))
        .collect()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array().map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_string)).collect()).unwrap_or_default()
}

/// Both charts lint clean (strict) with every values file; each driver's rendering is the pod
/// operators expect: the driver a native sidecar that starts first, one socket on a shared
/// emptyDir, probes on both containers, two replicas with leader election and a budget; each
/// driver's own image, name, credentials and identity; bad values are refused with a message
/// naming what is wrong. The plain manifest and the charts' CRDs are what they are generated from.
#[tokio::test]
async fn the_charts_lint_and_render_what_each_driver_needs() {
    let home = tempfile::tempdir().unwrap();
    let home = home.path();
    for (chart, values) in
        [(crd_chart(), None)].into_iter().chain(DRIVERS.map(|d| (chart(), Some(values(d))))).chain([(chart(), None)])
    {
        let mut args = vec!["lint", "--strict", chart.as_str()];
        if let Some(v) = &values {
            args.extend(["--values", v.as_str()]);
        }
        let (code, out, err) = helm(home, &args).await;
        assert_eq!(code, 0, "helm {args:?}:\n{out}{err}");
        assert!(out.contains("0 chart(s) failed"), "{out}");
    }

    let rules: Value = serde_saphyr::from_str(
        &std::fs::read_to_string(root().join("deploy/chart/machine-controller/files/machine-driver.rules.yaml"))
            .unwrap(),
    )
    .unwrap();
    let dashboard =
        std::fs::read_to_string(root().join("deploy/chart/machine-controller/files/machine-driver.dashboard.json"))
            .unwrap();
    for driver in DRIVERS {
        let v = values(driver);
        let objs = render(home, "machine-controller", "machine-driver", &["--values", &v]).await;
        let deploy = &objs["Deployment/machine-controller"];
        let spec = &deploy["spec"]["template"]["spec"];
        assert_eq!(deploy["spec"]["replicas"], 2, "{driver}");
        assert_eq!(spec["priorityClassName"], "system-cluster-critical");
        assert_eq!(spec["serviceAccountName"], "machine-controller");
        let sidecar = &spec["initContainers"][0];
        assert_eq!(sidecar["name"], "driver", "{driver}: the driver is the first init container");
        assert_eq!(sidecar["restartPolicy"], "Always", "{driver}: a native sidecar");
        let image = sidecar["image"].as_str().unwrap();
        let expected_image = match driver {
            "fake" => "machine-driver/fake-driver:0.1.0",
            "aws" => "machine-driver/aws-ec2-driver:0.1.0",
            _ => "machine-driver/azure-vmss-driver:0.1.0",
        };
        assert_eq!(image, expected_image);
        let controller = &spec["containers"][0];
        let args = strings(&controller["args"]);
        assert!(args.contains(&"--leader-elect".to_string()), "{args:?}");
        let at = args.iter().position(|a| a == "--driver").expect("--driver");
        assert_eq!(args[at + 1], format!("{driver}=unix:///run/machine-driver/driver.sock"));
        let env: BTreeMap<String, Value> = sidecar["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e["name"].as_str().unwrap().to_string(), e["value"].clone()))
            .collect();
        assert_eq!(env["DRIVER_ENDPOINT"], "unix:///run/machine-driver/driver.sock");
        for c in [sidecar, controller] {
            let mounts = c["volumeMounts"].as_array().unwrap();
            assert!(
                mounts.iter().any(|m| m["name"] == "driver-socket" && m["mountPath"] == "/run/machine-driver"),
                "{}: {mounts:?}",
                c["name"]
            );
            for probe in ["livenessProbe", "readinessProbe"] {
                assert!(c[probe]["httpGet"]["path"].is_string(), "{} has no {probe}", c["name"]);
            }
        }
        assert_eq!(
            sidecar["startupProbe"]["httpGet"]["path"], "/healthz",
            "the controller starts once the driver serves"
        );
        let volumes = spec["volumes"].as_array().unwrap();
        assert!(volumes.iter().any(|v| v["name"] == "driver-socket" && v["emptyDir"].is_object()));
        assert!(volumes.iter().any(|v| v["name"] == "token-key" && v["secret"]["secretName"] == "driver-token-key"));
        let pdb = &objs["PodDisruptionBudget/machine-controller"];
        assert_eq!(pdb["spec"]["maxUnavailable"], 1);
        assert_eq!(pdb["spec"]["selector"]["matchLabels"], deploy["spec"]["selector"]["matchLabels"]);
        for rbac in [
            "ClusterRole/machine-controller",
            "ClusterRoleBinding/machine-controller",
            "Role/machine-controller-leader-election",
            "Role/machine-controller-bootstrap-tokens",
        ] {
            assert!(objs.contains_key(rbac), "{driver}: no {rbac}");
        }
        match driver {
            "aws" => {
                assert_eq!(sidecar["envFrom"][0]["secretRef"]["name"], "aws-credentials");
                assert_eq!(env["AWS_REGION"], "eu-west-1");
                let sa = &objs["ServiceAccount/machine-controller"];
                assert!(sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].is_string());
                let monitor = &objs["ServiceMonitor/machine-controller"];
                let ports: Vec<&str> = monitor["spec"]["endpoints"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|e| e["port"].as_str().unwrap())
                    .collect();
                assert_eq!(ports, ["metrics", "driver-metrics"]);
                let service = &objs["Service/machine-controller-metrics"];
                assert_eq!(service["spec"]["selector"], deploy["spec"]["selector"]["matchLabels"]);
                // The PrometheusRule is the plain rules file, rule for rule.
                assert_eq!(objs["PrometheusRule/machine-controller"]["spec"]["groups"], rules["groups"]);
            }
            "azure" => {
                assert_eq!(deploy["spec"]["template"]["metadata"]["labels"]["azure.workload.identity/use"], "true");
                assert_eq!(strings(&sidecar["args"]), ["--credential", "workload-identity"]);
                let at = args.iter().position(|a| a == "--namespace").expect("--namespace");
                assert_eq!(args[at + 1], "machines");
                let map = &objs["ConfigMap/machine-controller-dashboard"];
                assert_eq!(map["data"]["machine-driver.json"].as_str().unwrap().trim(), dashboard.trim());
            }
            _ => {
                assert_eq!(strings(&sidecar["args"]), ["--production"]);
                assert!(!objs.keys().any(|k| k.starts_with("ServiceMonitor/") || k.starts_with("PrometheusRule/")));
            }
        }
    }

    // A release of another name names everything after itself, the Lease too.
    let objs = render(home, "edge", "machines", &[]).await;
    let args =
        strings(&objs["Deployment/edge-machine-controller"]["spec"]["template"]["spec"]["containers"][0]["args"]);
    let at = args.iter().position(|a| a == "--leader-elect-lease-name").unwrap();
    assert_eq!(args[at + 1], "edge-machine-controller");
    assert_eq!(objs["ClusterRoleBinding/edge-machine-controller"]["subjects"][0]["namespace"], "machines");

    // Bad values: refused, naming what is wrong.
    let chart = chart();
    for (set, says) in [
        ("driver.nmae=aws", "additional properties 'nmae' not allowed"),
        ("controller.leaderElection=false", "replicas > 1 needs controller.leaderElection: true"),
        ("driver.name=Not_A_Name", "/driver/name"),
        ("serviceMonitor.interval=soon", "/serviceMonitor/interval"),
        ("driver.tokenKeySecret=", "/driver/tokenKeySecret"),
    ] {
        let (code, out, err) = helm(home, &["template", "x", &chart, "--set", set]).await;
        assert_ne!(code, 0, "--set {set} was accepted:\n{out}");
        assert!(err.contains(says), "--set {set}: {err}");
    }

    // deploy/controller.yaml is this chart rendered with its defaults, below its header.
    let (code, rendered, err) =
        helm(home, &["template", "machine-controller", &chart, "--namespace", "machine-driver"]).await;
    assert_eq!(code, 0, "{err}");
    let plain = std::fs::read_to_string(root().join("deploy/controller.yaml")).unwrap();
    let at = plain.find("---\n# Source: ").expect("deploy/controller.yaml has a rendered part");
    assert!(plain[at..].trim() == rendered.trim(), "deploy/controller.yaml is stale: run `cargo xtask manifests`");
    let crds = std::fs::read_to_string(root().join("deploy/crds.yaml")).unwrap();
    for copy in
        ["deploy/chart/machine-controller/crds/crds.yaml", "deploy/chart/machine-controller-crds/templates/crds.yaml"]
    {
        let text = std::fs::read_to_string(root().join(copy)).unwrap();
        assert!(text == crds, "{copy} is not deploy/crds.yaml: run `cargo xtask manifests`");
    }
}

/// The real `helm install` of both charts, as an operator moving from `kubectl apply` to GitOps
/// runs it: the CRD chart takes over the CRDs already there (`--take-ownership --force-conflicts`), and the controller's chart installs
/// with each driver's values (ServiceMonitor and PrometheusRule included: prometheus-operator's
/// CRDs are installed first) in a namespace of its own. The API server accepts every object; the
/// ReplicaSet's pods are created (so the pod spec, the native sidecar and the priority class pass
/// admission) and run on a kwok Node; the budget then allows one disruption, not two; and the
/// ServiceAccount may do what the controller does and no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_installs_the_charts_into_a_cluster_and_their_pods_run() {
    let cluster = Cluster::start_full().await;
    let home = tempfile::tempdir().unwrap();
    let home = home.path();
    let kubeconfig = cluster.kubeconfig.to_string_lossy().into_owned();
    // Two Nodes kwok plays the kubelet of, for the replicas to run on.
    let (key, value) = e2e_tests::kube_cluster::kwok_node_annotation();
    for node in ["system-1", "system-2"] {
        cluster.apply_json(serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "annotations": {key: value}}})).await;
    }
    let crds_dir = installed_tool("MONITORING_CRDS_DIR", "install-monitoring-crds.sh", &[]);
    for file in ["monitoring.coreos.com_servicemonitors.yaml", "monitoring.coreos.com_prometheusrules.yaml"] {
        let (code, _, err) =
            cluster.kubectl(&["apply", "--server-side", "-f", crds_dir.join(file).to_str().unwrap()]).await;
        assert_eq!(code, 0, "{file}: {err}");
    }
    let (code, _, err) = cluster
        .kubectl(&[
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/servicemonitors.monitoring.coreos.com",
            "crd/prometheusrules.monitoring.coreos.com",
        ])
        .await;
    assert_eq!(code, 0, "{err}");

    let (code, out, err) = helm(
        home,
        &[
            "install",
            "machine-controller-crds",
            &crd_chart(),
            "--kubeconfig",
            &kubeconfig,
            "--take-ownership",
            "--force-conflicts",
            "--wait",
            "--timeout",
            "2m",
        ],
    )
    .await;
    assert_eq!(code, 0, "helm install of the CRD chart:\n{out}{err}");
    let (code, out, _) = cluster
        .kubectl(&[
            "get",
            "crd",
            "machinedeployments.machine.driver.dev",
            "-o",
            "jsonpath={.metadata.labels.app\\.kubernetes\\.io/managed-by}",
        ])
        .await;
    assert_eq!((code, out.as_str()), (0, "Helm"), "the CRD chart owns the CRDs");

    for driver in DRIVERS {
        let namespace = format!("md-{driver}");
        let release = format!("machine-controller-{driver}");
        let (code, _, err) = cluster.kubectl(&["create", "namespace", &namespace]).await;
        assert_eq!(code, 0, "{err}");
        let (code, _, err) = cluster
            .kubectl(&[
                "-n",
                &namespace,
                "create",
                "secret",
                "generic",
                "driver-token-key",
                "--from-literal=key=00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff",
            ])
            .await;
        assert_eq!(code, 0, "{err}");
        let v = values(driver);
        let (code, out, err) = helm(
            home,
            &["install", &release, &chart(), "--namespace", &namespace, "--values", &v, "--kubeconfig", &kubeconfig],
        )
        .await;
        assert_eq!(code, 0, "helm install {release}:\n{out}{err}");
        assert!(out.contains("STATUS: deployed"), "{out}");
        assert!(out.contains("create secret generic driver-token-key"), "the notes say how to make the key:\n{out}");

        // The ReplicaSet's pods exist (admission took the pod spec) and kwok runs them.
        let pods = Api::<Pod>::namespaced(cluster.client.clone(), &namespace);
        let selector = format!("app.kubernetes.io/instance={release}");
        let what = format!("both pods of {release} Ready");
        eventually_seen(Duration::from_secs(120), &what, || {
            let pods = pods.clone();
            let selector = selector.clone();
            async move {
                let list = pods.list(&ListParams::default().labels(&selector)).await.map_err(|e| e.to_string())?;
                let ready = list.items.iter().filter(|p| e2e_tests::kube_cluster::pod_ready(p)).count();
                if ready == 2 {
                    Ok(())
                } else {
                    let phases: Vec<_> =
                        list.items.iter().map(|p| p.status.as_ref().and_then(|s| s.phase.clone())).collect();
                    Err(format!("{} pods, {ready} ready: {phases:?}", list.items.len()))
                }
            }
        })
        .await;
        let deploys = Api::<Deployment>::namespaced(cluster.client.clone(), &namespace);
        let d = deploys.get(&release).await.unwrap();
        let init = &d.spec.template.spec.unwrap().init_containers.unwrap()[0];
        assert_eq!(init.restart_policy.as_deref(), Some("Always"), "the API server kept the native sidecar");
        let budgets = Api::<PodDisruptionBudget>::namespaced(cluster.client.clone(), &namespace);
        let what = format!("{release}'s budget allowing one disruption");
        eventually_seen(Duration::from_secs(60), &what, || {
            let budgets = budgets.clone();
            let release = release.clone();
            async move {
                let b = budgets.get(&release).await.map_err(|e| e.to_string())?;
                let status = b.status.unwrap_or_default();
                (status.current_healthy == Some(2) && status.disruptions_allowed == Some(1))
                    .then_some(())
                    .ok_or_else(|| format!("{status:?}"))
            }
        })
        .await;
        for kind in ["servicemonitor", "prometheusrule"] {
            let (code, out, _) = cluster.kubectl(&["-n", &namespace, "get", kind, "-o", "name"]).await;
            assert_eq!(code, 0);
            assert_eq!(!out.trim().is_empty(), driver == "aws", "{driver}: {kind}: {out}");
        }

        // What the ServiceAccount may do: the controller's work, not more.
        let who = format!("--as=system:serviceaccount:{namespace}:{release}");
        for (can, args) in [
            (true, vec!["create", "machines.machine.driver.dev", "-n", "default"]),
            (true, vec!["update", "machinedeployments.machine.driver.dev", "--subresource=status", "-n", "default"]),
            (true, vec!["create", "pods", "--subresource=eviction", "-n", "default"]),
            (true, vec!["patch", "nodes"]),
            (true, vec!["get", "secrets", "-n", "default"]),
            (true, vec!["create", "secrets", "-n", "kube-system"]),
            (true, vec!["update", "leases.coordination.k8s.io", "-n", namespace.as_str()]),
            (false, vec!["list", "secrets", "-n", "default"]),
            (false, vec!["watch", "secrets", "-n", "default"]),
            (false, vec!["create", "secrets", "-n", "default"]),
            (false, vec!["update", "machineclasses.machine.driver.dev", "-n", "default"]),
            (false, vec!["update", "leases.coordination.k8s.io", "-n", "default"]),
            (false, vec!["create", "pods", "-n", "default"]),
        ] {
            let mut all = vec!["auth", "can-i", who.as_str()];
            all.extend(args.iter().copied());
            let (_, out, err) = cluster.kubectl(&all).await;
            assert_eq!(out.trim(), if can { "yes" } else { "no" }, "{driver}: can-i {args:?}: {out}{err}");
        }
    }

    // An upgrade with other values rolls the Deployment; an uninstall removes what it made
    // (the CRDs stay: they belong to the CRD chart).
    let (code, out, err) = helm(
        home,
        &[
            "upgrade",
            "machine-controller-fake",
            &chart(),
            "--namespace",
            "md-fake",
            "--kubeconfig",
            &kubeconfig,
            "--set",
            "replicas=3",
        ],
    )
    .await;
    assert_eq!(code, 0, "helm upgrade:\n{out}{err}");
    let deploys = Api::<Deployment>::namespaced(cluster.client.clone(), "md-fake");
    assert_eq!(deploys.get("machine-controller-fake").await.unwrap().spec.replicas, Some(3));
    let (code, out, err) = helm(
        home,
        &["uninstall", "machine-controller-fake", "--namespace", "md-fake", "--kubeconfig", &kubeconfig, "--wait"],
    )
    .await;
    assert_eq!(code, 0, "helm uninstall:\n{out}{err}");
    assert!(deploys.get_opt("machine-controller-fake").await.unwrap().is_none());
    let (code, out, _) =
        cluster.kubectl(&["get", "clusterrole", "machine-controller-fake", "--ignore-not-found", "-o", "name"]).await;
    assert_eq!((code, out.trim()), (0, ""));
    let (code, _, _) = cluster.kubectl(&["get", "crd", "machines.machine.driver.dev"]).await;
    assert_eq!(code, 0, "the CRDs stay");
}
