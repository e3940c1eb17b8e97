//! A real Kubernetes control plane for tests: etcd and kube-apiserver, built from the Go module
//! proxy by `tests/tools/install-kube-apiserver.sh` (which `tests/run.sh` runs), started on free
//! loopback ports in a temporary folder, with the machine-driver CRDs installed. Stopped
//! (apiserver first, then etcd) when dropped.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use tokio::process::{Child, Command};

use crate::free_port;

/// At most this many control planes run at once in one test binary (2 cores).
static SLOTS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);

/// The folder with `kube-apiserver` and `etcd`: `$KUBE_APISERVER_DIR`, set by `tests/run.sh`.
/// Never skipped: a missing install fails the test with what to run.
pub fn install_dir() -> PathBuf {
    let dir = std::env::var_os("KUBE_APISERVER_DIR").map(PathBuf::from).unwrap_or_else(|| {
        panic!(
            "KUBE_APISERVER_DIR is not set: run `bash tests/run.sh`, or \
             `export KUBE_APISERVER_DIR=$(bash tests/tools/install-kube-apiserver.sh)` before `cargo test`"
        )
    });
    for b in ["kube-apiserver", "etcd"] {
        assert!(
            dir.join(b).exists(),
            "{} is missing in {}: run tests/tools/install-kube-apiserver.sh",
            b,
            dir.display()
        );
    }
    dir
}

/// A running etcd + kube-apiserver with the CRDs installed.
pub struct Cluster {
    apiserver: Option<Child>,
    etcd: Option<Child>,
    /// Scratch folder (logs, certs, kubeconfig).
    pub dir: tempfile::TempDir,
    /// A kubeconfig for this cluster (admin token, loopback address).
    pub kubeconfig: PathBuf,
    /// An admin client.
    pub client: kube::Client,
    _slot: tokio::sync::SemaphorePermit<'static>,
}

fn log_file(dir: &Path, name: &str) -> std::fs::File {
    std::fs::File::create(dir.join(name)).expect("log file")
}

impl Cluster {
    /// Starts etcd and kube-apiserver and installs the CRDs (`machine-controller crds`).
    pub async fn start() -> Cluster {
        Self::start_with(true).await
    }

    /// Starts etcd and kube-apiserver, with or without the CRDs.
    pub async fn start_with(crds: bool) -> Cluster {
        let slot = SLOTS.acquire().await.expect("semaphore");
        let bins = install_dir();
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        let (etcd_port, peer_port, api_port) = (free_port(), free_port(), free_port());
        let etcd = Command::new(bins.join("etcd"))
            .args(["--data-dir", d.join("etcd").to_str().unwrap()])
            .args(["--listen-client-urls", &format!("http://127.0.0.1:{etcd_port}")])
            .args(["--advertise-client-urls", &format!("http://127.0.0.1:{etcd_port}")])
            .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer_port}")])
            .args(["--initial-advertise-peer-urls", &format!("http://127.0.0.1:{peer_port}")])
            .args(["--initial-cluster", &format!("default=http://127.0.0.1:{peer_port}")])
            .args(["--unsafe-no-fsync", "--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(log_file(d, "etcd.log"))
            .stderr(log_file(d, "etcd.log"))
            .kill_on_drop(true)
            .spawn()
            .expect("start etcd");
        let key = d.join("sa.key");
        let out = std::process::Command::new("openssl")
            .args(["ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", key.to_str().unwrap()])
            .output()
            .expect("openssl (a service-account signing key)");
        assert!(out.status.success(), "openssl: {}", String::from_utf8_lossy(&out.stderr));
        let token = uuid::Uuid::new_v4().simple().to_string();
        std::fs::write(d.join("tokens.csv"), format!("{token},admin,admin,\"system:masters\"\n")).unwrap();
        let apiserver = Command::new(bins.join("kube-apiserver"))
            .args(["--etcd-servers", &format!("http://127.0.0.1:{etcd_port}")])
            .args(["--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1"])
            .args(["--secure-port", &api_port.to_string()])
            .args(["--endpoint-reconciler-type", "none"])
            .args(["--cert-dir", d.join("certs").to_str().unwrap()])
            .args(["--token-auth-file", d.join("tokens.csv").to_str().unwrap()])
            .args(["--authorization-mode", "RBAC"])
            .args(["--service-account-issuer", "https://kubernetes.default.svc"])
            .args(["--service-account-key-file", key.to_str().unwrap()])
            .args(["--service-account-signing-key-file", key.to_str().unwrap()])
            .args(["--service-cluster-ip-range", "10.96.0.0/16"])
            .args(["--enable-priority-and-fairness=false", "--v", "0"])
            .stdin(Stdio::null())
            .stdout(log_file(d, "apiserver.log"))
            .stderr(log_file(d, "apiserver.log"))
            .kill_on_drop(true)
            .spawn()
            .expect("start kube-apiserver");
        let kubeconfig = d.join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1
kind: Config
clusters:
- name: test
  cluster: {{server: \"https://127.0.0.1:{api_port}\", insecure-skip-tls-verify: true}}
users:
- name: admin
  user: {{token: \"{token}\"}}
contexts:
- name: test
  context: {{cluster: test, user: admin, namespace: default}}
current-context: test
"
            ),
        )
        .unwrap();
        let client = client_for(&kubeconfig).await;
        let mut cluster =
            Cluster { apiserver: Some(apiserver), etcd: Some(etcd), dir, kubeconfig, client, _slot: slot };
        cluster.wait_ready().await;
        if crds {
            cluster.install_crds().await;
        }
        cluster
    }

    async fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let req = http::Request::get("/readyz").body(Vec::new()).unwrap();
            if let Ok(body) = self.client.request_text(req).await {
                if body.trim() == "ok" {
                    return;
                }
            }
            if let Some(Ok(Some(status))) = self.apiserver.as_mut().map(|c| c.try_wait()) {
                panic!("kube-apiserver exited ({status}):\n{}", self.log("apiserver.log"));
            }
            assert!(Instant::now() < deadline, "kube-apiserver not ready in 90 s:\n{}", self.log("apiserver.log"));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The tail of one of the cluster's logs.
    pub fn log(&self, name: &str) -> String {
        let text = std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    async fn install_crds(&self) {
        let api: Api<CustomResourceDefinition> = Api::all(self.client.clone());
        for crd in machine_controller::crd::crds() {
            let crd: CustomResourceDefinition = serde_json::from_value(crd).unwrap();
            api.create(&PostParams::default(), &crd).await.unwrap_or_else(|e| panic!("installing CRD: {e}"));
        }
        // Established, and served (right after Established a list may 404 once).
        for kind in ["machineclasses", "machinedeployments", "machinepools", "machines"] {
            let ar = kube::core::ApiResource::from_gvk_with_plural(
                &kube::core::GroupVersionKind::gvk("machine.driver.dev", "v1alpha1", "x"),
                kind,
            );
            let api: Api<DynamicObject> = Api::all_with(self.client.clone(), &ar);
            crate::eventually(Duration::from_secs(30), &format!("{kind} served"), || {
                let api = api.clone();
                async move { api.list(&ListParams::default().limit(1)).await.ok() }
            })
            .await;
        }
    }

    /// Creates a namespace for one test.
    pub async fn namespace(&self, prefix: &str) -> String {
        let name = format!("{prefix}-{}", &uuid::Uuid::new_v4().simple().to_string()[..6]);
        let ns: Namespace = serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap();
        Api::<Namespace>::all(self.client.clone()).create(&PostParams::default(), &ns).await.expect("namespace");
        name
    }
}

/// A client from a kubeconfig file (no process-wide KUBECONFIG: tests run side by side).
pub async fn client_for(kubeconfig: &Path) -> kube::Client {
    let kc = Kubeconfig::read_from(kubeconfig).expect("kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await.expect("config");
    kube::Client::try_from(config).expect("client")
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // The apiserver first: stopping both at once makes the apiserver wait for etcd.
        for child in [self.apiserver.take(), self.etcd.take()].into_iter().flatten() {
            let mut child = child;
            let _ = child.start_kill();
            if let Some(pid) = child.id() {
                // Reap synchronously so no process outlives the test.
                let deadline = Instant::now() + Duration::from_secs(10);
                while Instant::now() < deadline && Path::new(&format!("/proc/{pid}")).exists() {
                    if let Ok(Some(_)) = child.try_wait() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }
}
