//! A real Kubernetes control plane for tests: etcd and kube-apiserver, built from the Go module
//! proxy by `tests/tools/install-kube-cluster.sh` (which `cargo xtask e2e` runs), started in a
//! temporary folder, with the machine-driver CRDs installed. Stopped (apiserver first, then etcd)
//! when dropped.
//!
//! No port is picked for them to bind later: etcd serves its clients and its peer listener on
//! Unix sockets in the folder, and kube-apiserver's port is bound by the test first and kept
//! (with `SO_REUSEPORT`, never listening) while the apiserver shares it (`--permit-port-sharing`),
//! so no other process can take it in between.
//!
//! Authorization and admission as clusters run them: a cluster CA of its own (`ca.crt`, which
//! signs the apiserver's serving certificate for 127.0.0.1 and authenticates client
//! certificates), `--authorization-mode=Node,RBAC`, bootstrap token authentication, and the
//! `NodeRestriction` admission plugin. The admin kubeconfig verifies the serving certificate
//! (`certificate-authority-data`) and authenticates with a `system:masters` token.
//!
//! [`Cluster::start_full`] adds what makes it a whole cluster without kubelets:
//! kube-controller-manager (ReplicaSets, garbage collection, PodDisruptionBudget status, node
//! lifecycle and taints, and a kubelet's TLS bootstrap: `csrapproving`, `csrsigning` with the
//! cluster CA's key, `bootstrapsigner`, `tokencleaner`), the RBAC bindings and `cluster-info`
//! ConfigMap `kubeadm init` creates for joining nodes ([`KUBEADM_JOIN_OBJECTS`]), kube-scheduler,
//! and kwok, which plays the kubelet of every Node that carries [`kwok_node_annotation`] (Ready,
//! heartbeats, pods Running, pods deleted).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::GroupVersionKind;
use kube::discovery::Scope;
use tokio::process::{Child, Command};

/// How many clusters run at once is cargo-nextest's `kube-cluster` test group
/// (`.config/nextest.toml`), which names the suites that start them: each test runs in a process
/// of its own, so no limit inside one could hold. Under nextest, a test outside the group fails
/// here, before it starts a cluster, until its suite is added to the group's filter.
fn check_test_group() {
    if std::env::var_os("NEXTEST").is_some() {
        let group = std::env::var("NEXTEST_TEST_GROUP").unwrap_or_default();
        assert_eq!(
            group, "kube-cluster",
            "this test starts a test cluster but is not in the kube-cluster test group: add its suite \
             to that group's filter in .config/nextest.toml"
        );
    }
}

/// The kwok stages [`Cluster::start_full`] gives kwok, relative to `kwok-stages/` in the install
/// folder (kwok's own `kustomize/stage/`). `node-not-ready` only acts on Nodes labelled
/// `node-not-ready.stage.kwok.x-k8s.io=true` (NotReady after about 1-2 s, for good).
pub const KWOK_STAGES: [&str; 6] = [
    "node/fast/node-initialize.yaml",
    "node/heartbeat/node-heartbeat.yaml",
    "node/chaos/node-not-ready.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-complete.yaml",
    "pod/fast/pod-delete.yaml",
];

/// The apiserver's audit log in the cluster's folder ([`Cluster::audit_events`]).
pub const AUDIT_LOG: &str = "audit.log";

/// The controller's ServiceAccount as the API server names it (`deploy/controller.yaml`).
pub const CONTROLLER_USER: &str = "system:serviceaccount:machine-driver:machine-controller";

/// What the apiserver audits, at `Metadata` level (who, from which user agent, what, the
/// answer's code; no bodies): every request of the controller's ServiceAccount
/// ([`CONTROLLER_USER`]: a refused one is a `403` here), the writes to Nodes and pods, evictions,
/// reads of PodDisruptionBudgets — what a drain does — and the creation of
/// CertificateSigningRequests (a kubelet's TLS bootstrap). Status updates (kwok's heartbeats), and
/// the lists and watches of others are not audited, so the log stays small. Written before the
/// answer (`--audit-log-mode blocking`): a call answered is in the log.
pub const AUDIT_POLICY: &str = r#"apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: Metadata
  users: ["system:serviceaccount:machine-driver:machine-controller"]
- level: Metadata
  verbs: ["create", "update", "patch", "delete"]
  resources:
  - group: ""
    resources: ["nodes", "pods", "pods/eviction"]
- level: Metadata
  verbs: ["create"]
  resources:
  - group: "certificates.k8s.io"
    resources: ["certificatesigningrequests"]
- level: Metadata
  verbs: ["get"]
  resources:
  - group: "policy"
    resources: ["poddisruptionbudgets"]
- level: None
"#;

/// The cluster CA's certificate and key in the cluster's folder: it signs the apiserver's
/// serving certificate, authenticates client certificates (`--client-ca-file`), and signs the
/// kubelets' client certificates (kube-controller-manager's `csrsigning`).
pub const CA_CERT: &str = "ca.crt";
/// See [`CA_CERT`].
pub const CA_KEY: &str = "ca.key";

/// What `kubeadm init` creates for nodes that join with a bootstrap token of its default group
/// (`system:bootstrappers:kubeadm:default-node-token`, the controller's `--bootstrap-token-group`
/// default): its TLS bootstrap (create CSRs), their automatic approval, the renewal of a node's
/// own certificate, reading Nodes (kubeadm's pre-flight), and `kube-public/cluster-info` readable
/// by anyone (`kubeadm join --discovery-token-ca-cert-hash`; `bootstrapsigner` signs it). The
/// names are kubeadm's.
pub const KUBEADM_JOIN_OBJECTS: &str = r#"apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "kubeadm:kubelet-bootstrap"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:node-bootstrapper"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: Group, name: "system:bootstrappers:kubeadm:default-node-token"}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "kubeadm:node-autoapprove-bootstrap"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:certificates.k8s.io:certificatesigningrequests:nodeclient"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: Group, name: "system:bootstrappers:kubeadm:default-node-token"}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "kubeadm:node-autoapprove-certificate-rotation"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:certificates.k8s.io:certificatesigningrequests:selfnodeclient"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: Group, name: "system:nodes"}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "kubeadm:get-nodes"}
rules: [{apiGroups: [""], resources: ["nodes"], verbs: ["get"]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "kubeadm:get-nodes"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "kubeadm:get-nodes"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: Group, name: "system:bootstrappers:kubeadm:default-node-token"}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: "kubeadm:bootstrap-signer-clusterinfo", namespace: kube-public}
rules: [{apiGroups: [""], resources: ["configmaps"], resourceNames: ["cluster-info"], verbs: ["get"]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: "kubeadm:bootstrap-signer-clusterinfo", namespace: kube-public}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: "kubeadm:bootstrap-signer-clusterinfo"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:anonymous"}]
"#;

/// The controller's manifest, as users apply it.
pub fn controller_manifest() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join("deploy/controller.yaml")
}

/// The controller's RBAC in a target cluster, as users apply it there.
pub fn target_rbac_manifest() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join("deploy/target-rbac.yaml")
}

/// Makes the cluster CA ([`CA_CERT`], [`CA_KEY`]) and the apiserver's serving certificate
/// (`apiserver.crt`, for 127.0.0.1 and localhost) in `d`, with openssl.
fn make_certificates(d: &Path) {
    let openssl = |args: &[&str]| {
        let out = std::process::Command::new("openssl").current_dir(d).args(args).output().expect("openssl");
        assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    let mut ca = vec!["req", "-x509"];
    ca.extend(ec);
    ca.extend(["-keyout", CA_KEY, "-out", CA_CERT, "-days", "30", "-subj", "/CN=test-cluster-ca"]);
    ca.extend(["-addext", "basicConstraints=critical,CA:TRUE"]);
    ca.extend(["-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature"]);
    openssl(&ca);
    let mut serving = vec!["req", "-x509", "-CA", CA_CERT, "-CAkey", CA_KEY];
    serving.extend(ec);
    serving.extend(["-keyout", "apiserver.key", "-out", "apiserver.crt", "-days", "30", "-subj", "/CN=kube-apiserver"]);
    serving.extend(["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc"]);
    serving.extend(["-addext", "basicConstraints=critical,CA:FALSE", "-addext", "extendedKeyUsage=serverAuth"]);
    openssl(&serving);
}

/// The cluster CA's certificate in `d`, base64-encoded (a kubeconfig's `certificate-authority-data`).
fn ca_data(d: &Path) -> String {
    use base64::Engine as _;
    let pem = std::fs::read(d.join(CA_CERT)).expect("the cluster CA");
    base64::engine::general_purpose::STANDARD.encode(pem)
}

/// A kubeconfig for `server` that verifies it with the CA `ca_data` and authenticates `user`
/// with `token`; namespace `default`.
fn token_kubeconfig(server: &str, ca_data: &str, user: &str, token: &str) -> String {
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: test
  cluster: {{server: \"{server}\", certificate-authority-data: \"{ca_data}\"}}
users:
- name: {user}
  user: {{token: \"{token}\"}}
contexts:
- name: test
  context: {{cluster: test, user: {user}, namespace: default}}
current-context: test
"
    )
}

/// The binaries [`Cluster::start_full`] runs besides kube-apiserver and etcd.
const FULL_BINARIES: [&str; 4] = ["kube-controller-manager", "kube-scheduler", "kwok", "kubectl"];

/// The folder `tests/tools/install-kube-cluster.sh` filled: `$KUBE_CLUSTER_DIR`, else
/// `$KUBE_APISERVER_DIR` (its older name). Never skipped: a missing
/// install fails the test with what to run.
fn cluster_dir() -> PathBuf {
    std::env::var_os("KUBE_CLUSTER_DIR")
        .or_else(|| std::env::var_os("KUBE_APISERVER_DIR"))
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            panic!(
                "KUBE_CLUSTER_DIR (or KUBE_APISERVER_DIR) is not set: run `cargo xtask e2e`, or \
                 `export KUBE_CLUSTER_DIR=$(bash tests/tools/install-kube-cluster.sh)` before `cargo test`"
            )
        })
}

fn assert_installed(dir: &Path, files: impl IntoIterator<Item = String>) {
    for f in files {
        assert!(
            dir.join(&f).exists(),
            "{f} is missing in {}: run `bash tests/tools/install-kube-cluster.sh` and point \
             KUBE_CLUSTER_DIR at the folder it prints",
            dir.display()
        );
    }
}

/// The folder with `kube-apiserver` and `etcd` (all that [`Cluster::start`] needs).
pub fn install_dir() -> PathBuf {
    let dir = cluster_dir();
    assert_installed(&dir, ["kube-apiserver", "etcd"].map(String::from));
    dir
}

/// The folder with everything [`Cluster::start_full`] needs: also kube-controller-manager,
/// kube-scheduler, kwok and its stages, and kubectl.
pub fn full_install_dir() -> PathBuf {
    let dir = install_dir();
    assert_installed(&dir, FULL_BINARIES.map(String::from));
    assert_installed(&dir, KWOK_STAGES.map(|s| format!("kwok-stages/{s}")));
    dir
}

/// The kubectl built with the cluster (same version as the apiserver).
pub fn kubectl() -> PathBuf {
    let dir = cluster_dir();
    assert_installed(&dir, ["kubectl".to_string()]);
    dir.join("kubectl")
}

/// The annotation that hands a Node to kwok in a [`Cluster::start_full`] cluster: kwok then plays
/// its kubelet (Ready, heartbeats, the pods bound to it Running). Nodes without it stay as created.
pub fn kwok_node_annotation() -> (&'static str, &'static str) {
    ("kwok.x-k8s.io/node", "fake")
}

/// A running etcd + kube-apiserver with the CRDs installed; from [`Cluster::start_full`] also
/// kube-controller-manager, kube-scheduler and kwok.
pub struct Cluster {
    /// kube-controller-manager, kube-scheduler and kwok (full clusters), with their log's name.
    parts: Vec<(&'static str, Child)>,
    apiserver: Option<Child>,
    etcd: Option<Child>,
    /// Scratch folder (logs, certs, kubeconfig).
    pub dir: tempfile::TempDir,
    /// A kubeconfig for this cluster (admin token, loopback address).
    pub kubeconfig: PathBuf,
    /// The apiserver's URL (`https://127.0.0.1:PORT`).
    pub server: String,
    /// An admin client.
    pub client: kube::Client,
    /// The apiserver's port, held for it ([`reserve_port`]).
    _api_port: tokio::net::TcpSocket,
}

/// A loopback port bound with `SO_REUSEPORT` and never listened on: no other process can bind it
/// (nor be handed it for port 0), a process of this user that binds it with `SO_REUSEPORT` too
/// (kube-apiserver `--permit-port-sharing`) can, and connections go to that one, the only
/// listener.
fn reserve_port() -> (tokio::net::TcpSocket, u16) {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_reuseport(true).expect("SO_REUSEPORT");
    socket.bind(([127, 0, 0, 1], 0).into()).expect("bind a loopback port");
    let port = socket.local_addr().expect("the reserved port").port();
    (socket, port)
}

/// kube-apiserver of the cluster in `d` on etcd `etcd_socket` and `api_port` (reserved:
/// [`reserve_port`]), logging to `apiserver.log` there (appended to when `append`: a restart).
fn apiserver_command(bins: &Path, d: &Path, etcd_socket: &str, api_port: u16, append: bool) -> Command {
    let apiserver_log = if append {
        std::fs::OpenOptions::new().append(true).create(true).open(d.join("apiserver.log")).expect("apiserver.log")
    } else {
        log_file(d, "apiserver.log")
    };
    let key = d.join("sa.key");
    let mut cmd = Command::new(bins.join("kube-apiserver"));
    cmd.args(["--etcd-servers", etcd_socket])
        .args(["--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1"])
        .args(["--secure-port", &api_port.to_string(), "--permit-port-sharing"])
        .args(["--endpoint-reconciler-type", "none"])
        .args(["--tls-cert-file", d.join("apiserver.crt").to_str().unwrap()])
        .args(["--tls-private-key-file", d.join("apiserver.key").to_str().unwrap()])
        .args(["--client-ca-file", d.join(CA_CERT).to_str().unwrap()])
        .args(["--token-auth-file", d.join("tokens.csv").to_str().unwrap()])
        .args(["--authorization-mode", "Node,RBAC", "--enable-bootstrap-token-auth"])
        .args(["--enable-admission-plugins", "NodeRestriction"])
        .args(["--service-account-issuer", "https://kubernetes.default.svc"])
        .args(["--service-account-key-file", key.to_str().unwrap()])
        .args(["--service-account-signing-key-file", key.to_str().unwrap()])
        .args(["--service-cluster-ip-range", "10.96.0.0/16"])
        .args(["--enable-priority-and-fairness=false", "--v", "0"])
        .args(["--audit-policy-file", d.join("audit-policy.yaml").to_str().unwrap()])
        .args(["--audit-log-path", d.join(AUDIT_LOG).to_str().unwrap(), "--audit-log-mode", "blocking"])
        .stdin(Stdio::null())
        .stdout(apiserver_log.try_clone().expect("apiserver.log"))
        .stderr(apiserver_log)
        .kill_on_drop(true);
    cmd
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
    ///
    /// With them, etcd starts from a copy of the data of a cluster that started once and got the
    /// CRDs (`etcd_template` below): kube-apiserver then finds its bootstrap objects (namespaces, RBAC
    /// roles, priority classes) and the CRDs in place instead of writing them, a quarter less CPU
    /// per start (docs/src/reference/benchmarks-history.md, "Time from nothing").
    pub async fn start_with(crds: bool) -> Cluster {
        let template = if crds { etcd_template().await } else { None };
        let cluster = Self::launch(template.as_deref()).await;
        if crds {
            if template.is_none() {
                cluster.create_crds().await;
            }
            cluster.wait_crds_served().await;
        }
        cluster
    }

    /// Starts etcd (on a copy of `etcd_data`, if given) and kube-apiserver, and waits until the
    /// apiserver is ready.
    async fn launch(etcd_data: Option<&Path>) -> Cluster {
        check_test_group();
        let bins = install_dir();
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        if let Some(from) = etcd_data {
            copy_dir(from, &d.join("etcd"));
        }
        // etcd's clients (the apiserver) on a Unix socket; its peer listener, which a single
        // member never uses, on one too (`unix://NAME` is relative to etcd's folder).
        let etcd_socket = format!("unix://{}", d.join("etcd.sock").display());
        let peer = "unix://etcd-peer.sock";
        let etcd_log = log_file(d, "etcd.log");
        let etcd = Command::new(bins.join("etcd"))
            .current_dir(d)
            .args(["--data-dir", d.join("etcd").to_str().unwrap()])
            .args(["--listen-client-urls", &etcd_socket, "--advertise-client-urls", &etcd_socket])
            .args(["--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer])
            .args(["--initial-cluster", &format!("default={peer}")])
            .args(["--unsafe-no-fsync", "--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(etcd_log.try_clone().expect("etcd.log"))
            .stderr(etcd_log)
            .kill_on_drop(true)
            .spawn()
            .expect("start etcd");
        let key = d.join("sa.key");
        let out = std::process::Command::new("openssl")
            .args(["ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", key.to_str().unwrap()])
            .output()
            .expect("openssl (a service-account signing key)");
        assert!(out.status.success(), "openssl: {}", String::from_utf8_lossy(&out.stderr));
        make_certificates(d);
        let token = uuid::Uuid::new_v4().simple().to_string();
        std::fs::write(d.join("tokens.csv"), format!("{token},admin,admin,\"system:masters\"\n")).unwrap();
        let (api_port_socket, api_port) = reserve_port();
        std::fs::write(d.join("audit-policy.yaml"), AUDIT_POLICY).unwrap();
        let apiserver =
            apiserver_command(&bins, d, &etcd_socket, api_port, false).spawn().expect("start kube-apiserver");
        let kubeconfig = d.join("kubeconfig");
        let server = format!("https://127.0.0.1:{api_port}");
        std::fs::write(&kubeconfig, token_kubeconfig(&server, &ca_data(d), "admin", &token)).unwrap();
        let client = client_for(&kubeconfig).await;
        let mut cluster = Cluster {
            parts: Vec::new(),
            apiserver: Some(apiserver),
            etcd: Some(etcd),
            dir,
            kubeconfig,
            server,
            client,
            _api_port: api_port_socket,
        };
        cluster.wait_ready().await;
        cluster
    }

    /// Stops kube-apiserver, then etcd, with SIGTERM (as an operator would: etcd closes its
    /// database), and waits for both.
    async fn stop(&mut self) {
        for mut child in [self.apiserver.take(), self.etcd.take()].into_iter().flatten() {
            if let Some(pid) = child.id() {
                let _ = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
            }
            match tokio::time::timeout(Duration::from_secs(30), child.wait()).await {
                Ok(status) => {
                    status.expect("wait for a stopped control-plane process");
                }
                Err(_) => {
                    let _ = child.start_kill();
                    panic!("a control-plane process did not stop in 30 s after SIGTERM");
                }
            }
        }
    }

    /// Starts a whole cluster without kubelets: etcd, kube-apiserver (with the CRDs), then
    /// kube-controller-manager, kube-scheduler and kwok, and returns once it runs pods: the
    /// `default` ServiceAccount exists (the controller manager works), and a probe Node carrying
    /// [`kwok_node_annotation`] went Ready (kwok works) and ran a probe Pod that the scheduler
    /// placed on it; both probes are deleted again (and gone) before this returns.
    pub async fn start_full() -> Cluster {
        let bins = full_install_dir();
        let mut cluster = Self::start_with(true).await;
        cluster.create_join_objects().await;
        cluster.start_parts(&bins);
        cluster.wait_full_ready().await;
        cluster
    }

    fn start_parts(&mut self, bins: &Path) {
        let d = self.dir.path().to_path_buf();
        let kubeconfig = self.kubeconfig.to_str().unwrap().to_string();
        // The cluster CA: the controller manager publishes it (kube-root-ca.crt) and signs the
        // client certificates of approved kubelet CSRs with its key.
        let ca = d.join(CA_CERT);
        let spawn = |binary: &str, args: Vec<String>, log: &'static str| {
            let child = Command::new(bins.join(binary))
                .args(args)
                // kwok reads ~/.kwok/kwok.yaml unless its work folder is elsewhere.
                .env("KWOK_WORKDIR", d.join("kwok"))
                .stdin(Stdio::null())
                .stdout(log_file(&d, log))
                .stderr(log_file(&d, log))
                .kill_on_drop(true)
                .spawn()
                .unwrap_or_else(|e| panic!("start {binary}: {e}"));
            (log, child)
        };
        let s = |v: &[&str]| v.iter().map(|a| a.to_string()).collect::<Vec<_>>();
        let mut kcm = s(&["--kubeconfig", &kubeconfig, "--leader-elect=false"]);
        // `*` has csrapproving, csrsigning and csrcleaner; bootstrapsigner and tokencleaner are
        // off by default (kubeadm turns them on).
        let controllers = "--controllers=*,bootstrapsigner,tokencleaner,-serviceaccount-token";
        kcm.extend(s(&["--use-service-account-credentials=false", controllers]));
        kcm.extend(s(&["--cluster-signing-cert-file", ca.to_str().unwrap()]));
        kcm.extend(s(&["--cluster-signing-key-file", d.join(CA_KEY).to_str().unwrap()]));
        kcm.extend(s(&["--service-account-private-key-file", d.join("sa.key").to_str().unwrap()]));
        // kwok posts node status at most every 20 s: a 20 s grace period would let the node
        // lifecycle controller mark healthy Nodes Unknown (and their pods not Ready) now and then.
        kcm.extend(s(&["--root-ca-file", ca.to_str().unwrap(), "--node-monitor-grace-period=60s"]));
        kcm.extend(s(&["--bind-address", "127.0.0.1", "--secure-port", "0"]));
        self.parts.push(spawn("kube-controller-manager", kcm, "controller-manager.log"));
        let scheduler = s(&[
            "--kubeconfig",
            &kubeconfig,
            "--leader-elect=false",
            "--bind-address",
            "127.0.0.1",
            "--secure-port",
            "0",
        ]);
        self.parts.push(spawn("kube-scheduler", scheduler, "scheduler.log"));
        let (key, value) = kwok_node_annotation();
        let mut kwok = s(&["--kubeconfig", &kubeconfig, "--manage-all-nodes=false"]);
        kwok.push(format!("--manage-nodes-with-annotation-selector={key}={value}"));
        for stage in KWOK_STAGES {
            kwok.extend(s(&["--config", bins.join("kwok-stages").join(stage).to_str().unwrap()]));
        }
        self.parts.push(spawn("kwok", kwok, "kwok.log"));
    }

    /// Creates what `kubeadm init` creates for joining nodes ([`KUBEADM_JOIN_OBJECTS`]) and the
    /// `kube-public/cluster-info` ConfigMap (this cluster's address and CA).
    async fn create_join_objects(&self) {
        let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(KUBEADM_JOIN_OBJECTS).expect("kubeadm objects");
        for doc in docs {
            self.apply_json(doc).await;
        }
        let server = &self.server;
        let info = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: \"\"\n  cluster:\n    server: {server}\n    \
             certificate-authority-data: {}\n",
            ca_data(self.dir.path())
        );
        self.apply_json(serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "cluster-info", "namespace": "kube-public"},
            "data": {"kubeconfig": info},
        }))
        .await;
    }

    /// A kubeconfig (in the cluster's folder) that authenticates as the controller's
    /// ServiceAccount with the RBAC of the manifest users apply: every object of
    /// `deploy/controller.yaml` but its Deployment (the namespace, the ServiceAccount, the
    /// ClusterRole, the Roles and their bindings) is applied as it is, and the token comes from
    /// the TokenRequest API (valid for a day). Calls it makes are audited ([`CONTROLLER_USER`]).
    pub async fn controller_kubeconfig(&self) -> PathBuf {
        let manifest = controller_manifest();
        let text = std::fs::read_to_string(&manifest).expect("deploy/controller.yaml");
        let docs: Vec<serde_json::Value> =
            serde_saphyr::from_multiple(&text).unwrap_or_else(|e| panic!("{}: {e}", manifest.display()));
        for doc in docs.into_iter().filter(|d| d["kind"] != "Deployment") {
            self.apply_json(doc).await;
        }
        let token = self.controller_token(serde_json::json!({"expirationSeconds": 86400})).await;
        let path = self.dir.path().join("controller.kubeconfig");
        std::fs::write(&path, token_kubeconfig(&self.server, &ca_data(self.dir.path()), "machine-controller", &token))
            .unwrap();
        path
    }

    /// A token of the ServiceAccount `machine-driver/machine-controller` from the TokenRequest
    /// API, with `spec` as the request's (retried until the account exists).
    async fn controller_token(&self, spec: serde_json::Value) -> String {
        let request: k8s_openapi::api::authentication::v1::TokenRequest =
            serde_json::from_value(serde_json::json!({ "spec": spec })).expect("a TokenRequest");
        let accounts = Api::<ServiceAccount>::namespaced(self.client.clone(), "machine-driver");
        crate::eventually(Duration::from_secs(30), "a token of the controller's ServiceAccount", || {
            let accounts = accounts.clone();
            let request = request.clone();
            async move {
                let r: kube::Result<k8s_openapi::api::authentication::v1::TokenRequest> =
                    accounts.create_subresource("token", "machine-controller", &PostParams::default(), &request).await;
                r.ok()?.status?.token
            }
        })
        .await
    }

    /// A Deployment of `replicas` pods labelled `app=NAME` in `namespace`, spread over the
    /// Nodes, and optionally a PodDisruptionBudget `NAME-budget` with `budget` as its spec's rule;
    /// returns once every pod is Ready.
    pub async fn workload(&self, namespace: &str, name: &str, replicas: i32, budget: Option<serde_json::Value>) {
        self.apply_json(serde_json::json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": {"app": name}},
                "template": {
                    "metadata": {"labels": {"app": name}},
                    "spec": {
                        "containers": [{"name": "app", "image": "registry.invalid/app:1"}],
                        "terminationGracePeriodSeconds": 5,
                        "topologySpreadConstraints": [{
                            "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                            "whenUnsatisfiable": "ScheduleAnyway",
                            "labelSelector": {"matchLabels": {"app": name}}
                        }]
                    }
                }
            }
        }))
        .await;
        if let Some(rule) = budget {
            let mut spec = serde_json::json!({"selector": {"matchLabels": {"app": name}}});
            for (k, v) in rule.as_object().cloned().unwrap_or_default() {
                spec[k] = v;
            }
            self.apply_json(serde_json::json!({
                "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                "metadata": {"name": format!("{name}-budget"), "namespace": namespace},
                "spec": spec
            }))
            .await;
        }
        let want = replicas as usize;
        let pods = Api::<Pod>::namespaced(self.client.clone(), namespace);
        let what = format!("{replicas} pods of {name} Ready");
        crate::eventually(Duration::from_secs(120), &what, || {
            let pods = pods.clone();
            async move {
                let list = pods.list(&ListParams::default().labels(&format!("app={name}"))).await.ok()?;
                (list.items.iter().filter(|p| pod_ready(p)).count() == want).then_some(())
            }
        })
        .await;
    }

    /// A bootstrap token Secret `bootstrap-token-<id>` of kubeadm's group, expiring at
    /// `expiration` (RFC 3339), as `kubeadm token create` makes one.
    pub async fn bootstrap_token(&self, id: &str, secret: &str, expiration: &str) {
        self.apply_json(serde_json::json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": format!("bootstrap-token-{id}"), "namespace": "kube-system"},
            "type": "bootstrap.kubernetes.io/token",
            "stringData": {
                "token-id": id, "token-secret": secret, "expiration": expiration,
                "usage-bootstrap-authentication": "true",
                "auth-extra-groups": "system:bootstrappers:kubeadm:default-node-token",
            },
        }))
        .await;
    }

    /// [`crate::JOIN_USER_DATA`] rendered by hand for this cluster with the bootstrap token
    /// `token` (`id.secret`; no labels, no taints): boot data a fake VM joins with, for a test
    /// that creates machines through the driver itself.
    pub fn boot_data(&self, token: &str) -> String {
        crate::JOIN_USER_DATA
            .replace("{{ .APIServerURL }}", &self.server)
            .replace("{{ .CACertificateBase64 }}", &ca_data(self.dir.path()))
            .replace("{{ .BootstrapToken }}", token)
            .replace("{{ .NodeLabels }}", "")
            .replace("{{ .NodeTaints }}", "")
    }

    /// Boot data with a new bootstrap token valid for an hour ([`Cluster::boot_data`]).
    pub async fn boot_data_with_a_new_token(&self) -> String {
        let id: String = uuid::Uuid::new_v4().simple().to_string()[..6].to_string();
        let secret: String = uuid::Uuid::new_v4().simple().to_string()[..16].to_string();
        let expiration =
            (chrono::Utc::now() + chrono::Duration::hours(1)).to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        self.bootstrap_token(&id, &secret, &expiration).await;
        self.boot_data(&format!("{id}.{secret}"))
    }

    /// The audited requests of the controller's ServiceAccount that the API server refused
    /// (`403`), each as `verb resource/subresource namespace/name: reason`.
    pub fn controller_forbidden(&self) -> Vec<String> {
        self.audit_events()
            .iter()
            .filter(|e| e["user"]["username"] == CONTROLLER_USER && e["responseStatus"]["code"] == 403)
            .map(|e| {
                let o = &e["objectRef"];
                let s = |v: &serde_json::Value| v.as_str().unwrap_or("").to_string();
                format!(
                    "{} {}/{}/{} {}/{}: {}",
                    s(&e["verb"]),
                    s(&o["apiGroup"]),
                    s(&o["resource"]),
                    s(&o["subresource"]),
                    s(&o["namespace"]),
                    s(&o["name"]),
                    s(&e["responseStatus"]["message"]),
                )
            })
            .collect()
    }

    /// How many audited requests the controller's ServiceAccount made.
    pub fn controller_requests(&self) -> usize {
        self.audit_events().iter().filter(|e| e["user"]["username"] == CONTROLLER_USER).count()
    }

    /// Polls `f` with the admin client until it returns `Some`; fails with the logs if a process
    /// of the cluster exits or `within` passes.
    async fn until<T, F, Fut>(&mut self, what: &str, within: Duration, mut f: F) -> T
    where
        F: FnMut(kube::Client) -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let deadline = Instant::now() + within;
        loop {
            if let Some(v) = f(self.client.clone()).await {
                return v;
            }
            let exited = self.parts.iter_mut().find_map(|(log, c)| Some((*log, c.try_wait().ok()??)));
            if let Some((log, status)) = exited {
                panic!("{what}: {} exited ({status}):\n{}", log.trim_end_matches(".log"), self.log(log));
            }
            if Instant::now() >= deadline {
                let logs: Vec<String> =
                    self.parts.iter().map(|(log, _)| format!("--- {log}:\n{}", self.log(log))).collect();
                panic!("timed out after {within:?} waiting for {what}\n{}", logs.join("\n"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn wait_full_ready(&mut self) {
        const WITHIN: Duration = Duration::from_secs(90);
        self.until("the default ServiceAccount (kube-controller-manager)", WITHIN, |c| async move {
            Api::<ServiceAccount>::namespaced(c, "default").get_opt("default").await.ok().flatten()
        })
        .await;
        let name = format!("probe-{}", &uuid::Uuid::new_v4().simple().to_string()[..6]);
        let (key, value) = kwok_node_annotation();
        let node: Node =
            serde_json::from_value(serde_json::json!({"metadata": {"name": name, "annotations": {key: value}}}))
                .unwrap();
        let nodes = Api::<Node>::all(self.client.clone());
        nodes.create(&PostParams::default(), &node).await.expect("create the probe node");
        let n = name.clone();
        self.until("a probe node Ready (kwok)", WITHIN, |c| {
            let n = n.clone();
            async move { Api::<Node>::all(c).get(&n).await.ok().filter(node_ready) }
        })
        .await;
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "spec": {
                "containers": [{"name": "c", "image": "registry.invalid/pause:1"}],
                "tolerations": [{"operator": "Exists"}],
            },
        }))
        .unwrap();
        let pods = Api::<Pod>::namespaced(self.client.clone(), "default");
        pods.create(&PostParams::default(), &pod).await.expect("create the probe pod");
        let n = name.clone();
        self.until("a probe pod scheduled (kube-scheduler) and Running (kwok)", WITHIN, |c| {
            let n = n.clone();
            async move {
                let pod = Api::<Pod>::namespaced(c, "default").get(&n).await.ok()?;
                let on_node = pod.spec.as_ref()?.node_name.as_deref() == Some(n.as_str());
                let running = pod.status.as_ref()?.phase.as_deref() == Some("Running");
                (on_node && running).then_some(())
            }
        })
        .await;
        // Deleted gracefully, as a kubelet would see it: kwok finishes the deletion.
        pods.delete(&name, &DeleteParams::default()).await.expect("delete the probe pod");
        let n = name.clone();
        self.until("the probe pod gone (kwok)", WITHIN, |c| {
            let n = n.clone();
            async move { Api::<Pod>::namespaced(c, "default").get_opt(&n).await.ok().filter(Option::is_none) }
        })
        .await;
        nodes.delete(&name, &DeleteParams::default()).await.expect("delete the probe node");
        self.until("the probe node gone", WITHIN, |c| {
            let n = name.clone();
            async move { Api::<Node>::all(c).get_opt(&n).await.ok().filter(Option::is_none) }
        })
        .await;
    }

    /// An admin client that hands back 429, 503 and 504 answers as they come. kube's default
    /// client (like [`Cluster::client`]) retries those itself, up to 15 times with a backoff
    /// growing to 1000 s: an eviction that a PodDisruptionBudget refuses then hangs for minutes
    /// instead of failing with 429.
    pub async fn client_without_retries(&self) -> kube::Client {
        client_with_retries(&self.kubeconfig, false).await
    }

    /// Runs the built kubectl against this cluster; returns (exit code, stdout, stderr).
    pub async fn kubectl(&self, args: &[&str]) -> (i32, String, String) {
        let d = self.dir.path();
        let mut all = vec!["--kubeconfig", self.kubeconfig.to_str().unwrap()];
        let cache = d.join("kubectl-cache");
        all.extend(["--cache-dir", cache.to_str().unwrap()]);
        all.extend(args);
        crate::run(&kubectl(), &all).await
    }

    /// Creates or updates any object (server-side apply, field manager `e2e-tests`, forced), found
    /// by its `apiVersion` and `kind` through discovery; a namespaced object without
    /// `metadata.namespace` goes to `default`. Panics on an error.
    pub async fn apply_json(&self, obj: serde_json::Value) -> DynamicObject {
        let field = |f: &str| obj.get(f).and_then(|v| v.as_str()).unwrap_or_else(|| panic!("no {f} in {obj}"));
        let (api_version, kind) = (field("apiVersion"), field("kind"));
        let meta = &obj["metadata"];
        let name = meta["name"].as_str().unwrap_or_else(|| panic!("no metadata.name in {obj}"));
        let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
        let gvk = GroupVersionKind::gvk(group, version, kind);
        let (ar, caps) = kube::discovery::pinned_kind(&self.client, &gvk)
            .await
            .unwrap_or_else(|e| panic!("no {api_version} {kind} in the cluster: {e}"));
        let api: Api<DynamicObject> = match caps.scope {
            Scope::Namespaced => {
                Api::namespaced_with(self.client.clone(), meta["namespace"].as_str().unwrap_or("default"), &ar)
            }
            Scope::Cluster => Api::all_with(self.client.clone(), &ar),
        };
        api.patch(name, &PatchParams::apply("e2e-tests").force(), &Patch::Apply(&obj))
            .await
            .unwrap_or_else(|e| panic!("applying {kind} {name}: {e}"))
    }

    /// Waits until the apiserver is ready; panics if it exits or is not ready in 90 s.
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
                panic!("kube-apiserver exited ({status}):\n{}", self.start_logs());
            }
            assert!(Instant::now() < deadline, "kube-apiserver not ready in 90 s:\n{}", self.start_logs());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// What explains a failed start: the apiserver's log, and etcd's state and log (a failed
    /// etcd, say on a full disk, only shows in the apiserver's log as "connection refused").
    fn start_logs(&mut self) -> String {
        let etcd = match self.etcd.as_mut().map(|c| c.try_wait()) {
            Some(Ok(Some(status))) => format!("exited ({status})"),
            Some(Ok(None)) => "running".to_string(),
            other => format!("{other:?}"),
        };
        let free = std::process::Command::new("df")
            .args(["-h", self.dir.path().to_str().unwrap_or("/tmp")])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        format!("{}\n--- etcd: {etcd}\n{}\n--- free disk\n{free}", self.log("apiserver.log"), self.log("etcd.log"))
    }

    /// The apiserver's audit events so far (see [`AUDIT_POLICY`] for which calls), oldest
    /// first; each as the apiserver wrote it (`verb`, `objectRef`, `userAgent`,
    /// `responseStatus.code`, …). A line being written is left out.
    pub fn audit_events(&self) -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(self.dir.path().join(AUDIT_LOG)).unwrap_or_default();
        text.lines().filter_map(|line| serde_json::from_str(line).ok()).collect()
    }

    /// The tail of one of the cluster's logs.
    pub fn log(&self, name: &str) -> String {
        let text = std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    async fn create_crds(&self) {
        let api: Api<CustomResourceDefinition> = Api::all(self.client.clone());
        for crd in machine_controller::crd::crds() {
            let crd: CustomResourceDefinition = serde_json::from_value(crd).unwrap();
            api.create(&PostParams::default(), &crd).await.unwrap_or_else(|e| panic!("installing CRD: {e}"));
        }
    }

    /// Waits until every CRD is established and served (right after Established a list may 404
    /// once; after a start from the template, the apiserver sets the stored CRDs up in the
    /// background): every kind the controller registers, so a test never races a CRD that is
    /// still being set up.
    async fn wait_crds_served(&self) {
        let plurals = machine_controller::crd::crds().into_iter().map(|crd| {
            let crd: CustomResourceDefinition = serde_json::from_value(crd).unwrap();
            crd.spec.names.plural
        });
        for kind in plurals {
            let ar = kube::core::ApiResource::from_gvk_with_plural(
                &kube::core::GroupVersionKind::gvk("machine.driver.dev", "v1alpha1", "x"),
                &kind,
            );
            let api: Api<DynamicObject> = Api::all_with(self.client.clone(), &ar);
            crate::eventually(Duration::from_secs(30), &format!("{kind} served"), || {
                let api = api.clone();
                async move { api.list(&ListParams::default().limit(1)).await.ok() }
            })
            .await;
        }
    }

    /// Creates a namespace for one test. In a full cluster, also waits for its `default`
    /// ServiceAccount (pods are refused until the controller manager made it).
    pub async fn namespace(&self, prefix: &str) -> String {
        let name = format!("{prefix}-{}", &uuid::Uuid::new_v4().simple().to_string()[..6]);
        let ns: Namespace = serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap();
        Api::<Namespace>::all(self.client.clone()).create(&PostParams::default(), &ns).await.expect("namespace");
        if !self.parts.is_empty() {
            let api = Api::<ServiceAccount>::namespaced(self.client.clone(), &name);
            crate::eventually(Duration::from_secs(60), &format!("the default ServiceAccount in {name}"), || {
                let api = api.clone();
                async move { api.get_opt("default").await.ok().flatten() }
            })
            .await;
        }
        name
    }
}

impl Cluster {
    /// Freezes kube-apiserver (SIGSTOP): every client's calls hang, as in a control-plane outage
    /// or a network partition, until [`Cluster::resume_apiserver`].
    pub fn pause_apiserver(&self) {
        self.signal_apiserver("-STOP");
    }

    /// Lets a paused kube-apiserver go on (SIGCONT).
    pub fn resume_apiserver(&self) {
        self.signal_apiserver("-CONT");
    }

    /// kill -9 of kube-apiserver (etcd and the other parts go on), once it is gone.
    pub async fn kill9_apiserver(&mut self) {
        let child = self.apiserver.as_mut().expect("kube-apiserver runs");
        child.start_kill().expect("kill -9 kube-apiserver");
        tokio::time::timeout(Duration::from_secs(30), child.wait())
            .await
            .expect("kube-apiserver gone within 30 s of kill -9")
            .expect("wait for kube-apiserver");
        self.apiserver = None;
    }

    /// Starts kube-apiserver again after [`Cluster::kill9_apiserver`]: the same flags, port and
    /// certificates (its log goes on in the same file); returns once it is ready.
    pub async fn restart_apiserver(&mut self) {
        assert!(self.apiserver.is_none(), "kube-apiserver still runs");
        let d = self.dir.path().to_path_buf();
        let etcd_socket = format!("unix://{}", d.join("etcd.sock").display());
        let port: u16 = self.server.rsplit(':').next().and_then(|p| p.parse().ok()).expect("the apiserver's port");
        let child =
            apiserver_command(&install_dir(), &d, &etcd_socket, port, true).spawn().expect("start kube-apiserver");
        self.apiserver = Some(child);
        self.wait_ready().await;
    }

    /// A kubeconfig (its text) of the controller's identity in this cluster used as a target
    /// cluster: the ServiceAccount `machine-driver/machine-controller` with exactly the RBAC of
    /// `deploy/target-rbac.yaml` (applied here), its token from the TokenRequest API bound to a
    /// Secret `binding` in `machine-driver` — [`Cluster::revoke_target_token`] deletes that
    /// Secret, and the API server refuses the token from then on (once its cache of
    /// authenticated tokens lets go of it: about 10 s for a token in use).
    pub async fn target_kubeconfig(&self, binding: &str) -> String {
        let manifest = target_rbac_manifest();
        let text = std::fs::read_to_string(&manifest).expect("deploy/target-rbac.yaml");
        let docs: Vec<serde_json::Value> =
            serde_saphyr::from_multiple(&text).unwrap_or_else(|e| panic!("{}: {e}", manifest.display()));
        for doc in docs {
            self.apply_json(doc).await;
        }
        let secret = self
            .apply_json(serde_json::json!({
                "apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": binding, "namespace": "machine-driver"},
                "stringData": {"purpose": "binds a token of the controller (revoked with this Secret)"},
            }))
            .await;
        let uid = secret.metadata.uid.clone().expect("the binding Secret's uid");
        let bound = serde_json::json!({"kind": "Secret", "apiVersion": "v1", "name": binding, "uid": uid});
        let token =
            self.controller_token(serde_json::json!({"expirationSeconds": 86400, "boundObjectRef": bound})).await;
        token_kubeconfig(&self.server, &ca_data(self.dir.path()), "machine-controller", &token)
    }

    /// Revokes the tokens [`Cluster::target_kubeconfig`] bound to `binding` (deletes that Secret,
    /// once it is gone).
    pub async fn revoke_target_token(&self, binding: &str) {
        let secrets = Api::<k8s_openapi::api::core::v1::Secret>::namespaced(self.client.clone(), "machine-driver");
        secrets.delete(binding, &DeleteParams::default()).await.expect("deleting the binding Secret");
        crate::eventually(Duration::from_secs(30), "the binding Secret gone", || async {
            secrets.get_opt(binding).await.ok()?.is_none().then_some(())
        })
        .await;
    }

    fn signal_apiserver(&self, signal: &str) {
        let pid = self.apiserver.as_ref().and_then(Child::id).expect("kube-apiserver runs");
        let status = std::process::Command::new("kill").args([signal, &pid.to_string()]).status().expect("kill");
        assert!(status.success(), "kill {signal} {pid}: {status}");
    }
}

/// The etcd data of a cluster that started once and got the CRDs, stopped: [`Cluster::start`]
/// copies it for each cluster. Made once per Kubernetes install and set of CRDs, in
/// `etcd-templates/` of the install folder (about 65 MB each; those over a day old go when a new
/// one is made); `None` (each cluster then starts empty, as before) if that folder is not writable.
/// One process makes it (under a file lock); the test processes started beside it wait for it.
async fn etcd_template() -> Option<PathBuf> {
    static TEMPLATE: tokio::sync::OnceCell<Option<PathBuf>> = tokio::sync::OnceCell::const_new();
    TEMPLATE
        .get_or_init(|| async {
            use std::hash::{Hash, Hasher};
            let crds = serde_json::to_string(&machine_controller::crd::crds()).unwrap();
            let mut key = std::collections::hash_map::DefaultHasher::new();
            (cluster_dir(), crds).hash(&mut key);
            let root = cluster_dir().join("etcd-templates");
            let key = format!("{:016x}", key.finish());
            let path = root.join(&key);
            if path.join("member").is_dir() {
                return Some(path);
            }
            let lock =
                std::fs::create_dir_all(&root).and_then(|()| std::fs::File::create(root.join(format!("{key}.lock"))));
            let lock = match lock {
                Ok(lock) => lock,
                Err(e) => {
                    eprintln!("kube_cluster: no etcd template ({}: {e}): clusters start empty", root.display());
                    return None;
                }
            };
            let lock = tokio::task::spawn_blocking(move || lock.lock().map(|()| lock))
                .await
                .expect("lock task")
                .expect("lock the etcd template");
            if !path.join("member").is_dir() {
                let mut cluster = Cluster::launch(None).await;
                cluster.create_crds().await;
                cluster.wait_crds_served().await;
                cluster.stop().await;
                let staging = root.join(format!("{key}.tmp"));
                let _ = std::fs::remove_dir_all(&staging);
                copy_dir(&cluster.dir.path().join("etcd"), &staging);
                // A template without its `member` folder (cut short by hand) is replaced.
                let _ = std::fs::remove_dir_all(&path);
                std::fs::rename(&staging, &path).expect("move the etcd template in place");
                let day_ago = std::time::SystemTime::now() - Duration::from_secs(24 * 3600);
                for entry in std::fs::read_dir(&root).into_iter().flatten().flatten() {
                    let old = entry.metadata().and_then(|m| m.modified()).is_ok_and(|t| t < day_ago);
                    if old && !entry.file_name().to_string_lossy().starts_with(&key) {
                        let _ = std::fs::remove_dir_all(entry.path()).or_else(|_| std::fs::remove_file(entry.path()));
                    }
                }
            }
            drop(lock);
            Some(path)
        })
        .await
        .clone()
}

/// `cp -a from to`: etcd's data folder, with its preallocated write-ahead log.
fn copy_dir(from: &Path, to: &Path) {
    let out = std::process::Command::new("cp").arg("-a").args([from, to]).output().expect("cp");
    assert!(
        out.status.success(),
        "cp -a {} {}: {}",
        from.display(),
        to.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Whether a pod is Ready and not being deleted.
pub fn pod_ready(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_none()
        && p.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Whether a Node's Ready condition is True.
pub fn node_ready(node: &Node) -> bool {
    let conditions = node.status.as_ref().and_then(|s| s.conditions.as_ref());
    conditions.is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// A client from a kubeconfig file (no process-wide KUBECONFIG: tests run side by side).
pub async fn client_for(kubeconfig: &Path) -> kube::Client {
    client_with_retries(kubeconfig, true).await
}

async fn client_with_retries(kubeconfig: &Path, retries: bool) -> kube::Client {
    let kc = Kubeconfig::read_from(kubeconfig).expect("kubeconfig");
    let mut config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await.expect("config");
    config.default_retry = retries;
    kube::Client::try_from(config).expect("client")
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // kwok, the scheduler and the controller manager first (they only talk to the apiserver),
        // then the apiserver: stopping it and etcd at once makes the apiserver wait for etcd.
        let parts = std::mem::take(&mut self.parts).into_iter().rev().map(|(_, c)| c);
        for mut child in parts.chain([self.apiserver.take(), self.etcd.take()].into_iter().flatten()) {
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
