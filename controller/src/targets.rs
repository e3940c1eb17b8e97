//! The target clusters: where the machines' Nodes live. One controller serves many: an owner
//! (MachineDeployment, MachinePool, or a Machine of its own) names its cluster with
//! `spec.targetCluster.kubeconfigSecretRef` — a Secret in its own namespace whose key
//! [`KUBECONFIG_KEY`] holds a kubeconfig (Cluster API's convention) — and one without keeps the
//! controller's default target (`run --target-kubeconfig`, the store's cluster, or none).
//!
//! Each target is a [`Connection`] of its own: its client and rate limit (`--target-qps`,
//! `--target-burst` apply per target), its Node watch and cache, its measured calls (the
//! `target` label of `controller_target_calls_total`), its health probe and [`Safety`]: while
//! it does not answer, its calls fail at once (no shared worker waits on it) and only its own
//! machines' health checks freeze. A connection is built on first use, built again when its
//! Secret changes or its credentials are refused (401), and closed — its tasks stopped, its
//! metrics series removed — once nothing uses it ([`Targets::retain`]).
//!
//! A kubeconfig that would run a command on the controller's host (an `exec` or
//! `auth-provider` plugin) is refused (reason `ExecPluginRefused`), and so is one that names a
//! file on it (`tokenFile`, certificate paths): every credential must be in the Secret.

use machine_driver_util::lock;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::nodes::calls::{CallMetrics, Limits};
use crate::nodes::Target;
use crate::resources::{Reason, Secret, TargetCluster};
use crate::safety::Safety;
use crate::store::{Key, Store};

/// The key of a target cluster's Secret that holds its kubeconfig (Cluster API's).
pub const KUBECONFIG_KEY: &str = "value";
/// The `target` label of the default target's metrics.
pub const DEFAULT_LABEL: &str = "default";
/// After a 401, a connection is built again from its Secret at most this often.
const REBUILD_AFTER_REFUSAL: Duration = Duration::from_secs(10);

/// Which target cluster: the controller's default, or the one a kubeconfig Secret names.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TargetId {
    /// `run --target-kubeconfig`, or the store's cluster.
    Default,
    /// `spec.targetCluster.kubeconfigSecretRef` of an object in `namespace`.
    Secret {
        /// The Secret's (and its users') namespace.
        namespace: String,
        /// The Secret's name.
        name: String,
    },
}

impl TargetId {
    /// The target of an object in `namespace` with this `spec.targetCluster`.
    pub fn of(namespace: &str, target: Option<&TargetCluster>) -> Self {
        match target {
            None => TargetId::Default,
            Some(t) => TargetId::Secret { namespace: namespace.into(), name: t.kubeconfig_secret_ref.name.clone() },
        }
    }

    /// Its `target` label: `default`, or the Secret's `namespace/name`.
    pub fn label(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for TargetId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TargetId::Default => f.write_str(DEFAULT_LABEL),
            TargetId::Secret { namespace, name } => write!(f, "{namespace}/{name}"),
        }
    }
}

/// One target cluster's connection and what runs for it.
pub struct Connection {
    /// Which target it is.
    pub id: TargetId,
    /// Its calls and Node cache.
    pub target: Arc<Target>,
    /// Whether it answers, and when its machines' health timers start.
    pub safety: Arc<Safety>,
    /// A hash of the kubeconfig it was built from (0: the default target).
    fingerprint: u64,
    built: Instant,
    /// Its probe and Node watch, stopped with it.
    tasks: Mutex<Vec<AbortHandle>>,
}

impl Connection {
    fn new(id: TargetId, target: Target, fingerprint: u64) -> Self {
        Self {
            id,
            target: Arc::new(target),
            safety: Arc::default(),
            fingerprint,
            built: Instant::now(),
            tasks: Mutex::new(Vec::new()),
        }
    }

    /// Why its machines' health cannot be judged now (it does not answer its probe), if so.
    pub fn unreachable(&self) -> Option<String> {
        self.safety.unreachable()
    }

    /// Starts its probe and Node watch (waking the Machines its Nodes concern with `wake`).
    fn start(&self, wake: Option<Waker>) {
        let what = match &self.id {
            TargetId::Default => "the target cluster".to_string(),
            id => format!("the target cluster {id}"),
        };
        let probe =
            crate::safety::probe(self.safety.clone(), what, self.target.client(), Some(self.target.calls().clone()));
        let watch = crate::nodes::watch(self.target.clone(), move |key| {
            if let Some(wake) = &wake {
                wake(key);
            }
        });
        let mut tasks = lock(&self.tasks);
        tasks.push(tokio::spawn(probe).abort_handle());
        tasks.push(tokio::spawn(watch).abort_handle());
    }

    fn stop(&self) {
        for task in lock(&self.tasks).drain(..) {
            task.abort();
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Why an object's target cluster cannot be used, as its `TargetReachable` condition says.
#[derive(Debug, Clone, PartialEq)]
pub struct Unusable {
    /// `TargetSecretNotFound`, `TargetKubeconfigInvalid` or `ExecPluginRefused`.
    pub reason: Reason,
    /// What is wrong, naming the Secret (never its content).
    pub message: String,
}

/// What a Node change wakes (the runtime's queue).
pub type Waker = Arc<dyn Fn(Key) + Send + Sync>;

/// How every target's connection is made.
#[derive(Debug, Clone)]
pub struct TargetSettings {
    /// Each target's rate limit.
    pub limits: Limits,
    /// How long bootstrap tokens live (`--bootstrap-token-ttl`).
    pub token_ttl: Duration,
    /// Their group (`--bootstrap-token-group`).
    pub token_group: String,
}

impl Default for TargetSettings {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            token_ttl: crate::nodes::bootstrap::DEFAULT_TOKEN_TTL,
            token_group: crate::nodes::bootstrap::DEFAULT_TOKEN_GROUP.into(),
        }
    }
}

/// Every target cluster the controller talks to.
pub struct Targets {
    default: Option<Arc<Connection>>,
    named: Mutex<HashMap<TargetId, Arc<Connection>>>,
    /// One build at a time, so two reconciles do not both build the same target.
    building: tokio::sync::Mutex<()>,
    settings: TargetSettings,
    metrics: OnceLock<CallMetrics>,
    waker: OnceLock<Waker>,
}

impl Targets {
    /// The targets, with `default` (if any) for objects that name none.
    pub fn new(default: Option<Target>, settings: TargetSettings) -> Self {
        Self {
            default: default.map(|t| Arc::new(Connection::new(TargetId::Default, t, 0))),
            named: Mutex::new(HashMap::new()),
            building: tokio::sync::Mutex::new(()),
            settings,
            metrics: OnceLock::new(),
            waker: OnceLock::new(),
        }
    }

    /// Measures every target's calls in `metrics` (the controller's registry).
    pub fn report_to(&self, metrics: CallMetrics) {
        if let Some(d) = &self.default {
            d.target.report_to(metrics.clone());
        }
        let _ = self.metrics.set(metrics);
    }

    /// Starts the default target's probe and watch, and lets every target's Node changes wake
    /// Machines through `wake` (the controller's background, once it runs).
    pub fn start(&self, wake: Waker) {
        let _ = self.waker.set(wake.clone());
        if let Some(d) = &self.default {
            d.start(Some(wake));
        }
    }

    /// The default target (objects without `spec.targetCluster`).
    pub fn default_target(&self) -> Option<&Arc<Connection>> {
        self.default.as_ref()
    }

    /// Every open connection: the default first, then the named ones by name.
    pub fn connections(&self) -> Vec<Arc<Connection>> {
        let mut all: Vec<Arc<Connection>> = self.default.iter().cloned().collect();
        let mut named: Vec<Arc<Connection>> = lock(&self.named).values().cloned().collect();
        named.sort_by(|a, b| a.id.cmp(&b.id));
        all.extend(named);
        all
    }

    /// The connection of an object in `namespace` with this `spec.targetCluster`: the default
    /// one without it (`None` when the controller has none), else the one its Secret names,
    /// built on first use and again when the Secret changed or the credentials were refused.
    ///
    /// # Errors
    /// Store failures; a Secret that is missing or unusable is `Ok(Err(..))`.
    pub async fn get(
        &self,
        store: &Store,
        namespace: &str,
        target: Option<&TargetCluster>,
    ) -> crate::store::Result<Result<Option<Arc<Connection>>, Unusable>> {
        let id = TargetId::of(namespace, target);
        let TargetId::Secret { name, .. } = &id else { return Ok(Ok(self.default.clone())) };
        let Some(secret) = store.get::<Secret>(namespace, name).await? else {
            return Ok(Err(Unusable {
                reason: Reason::TargetSecretNotFound,
                message: format!("Secret {name} (spec.targetCluster.kubeconfigSecretRef) does not exist"),
            }));
        };
        let Some(kubeconfig) = secret.values().remove(KUBECONFIG_KEY) else {
            return Ok(Err(Unusable {
                reason: Reason::TargetKubeconfigInvalid,
                message: format!("Secret {name} has no key {KUBECONFIG_KEY:?} (the kubeconfig)"),
            }));
        };
        let fingerprint = fingerprint(&kubeconfig);
        if let Some(c) = self.current(&id, fingerprint) {
            return Ok(Ok(Some(c)));
        }
        let _building = self.building.lock().await;
        if let Some(c) = self.current(&id, fingerprint) {
            return Ok(Ok(Some(c)));
        }
        if let Err(why) = check_kubeconfig(&kubeconfig) {
            return Ok(Err(Unusable { reason: why.reason, message: format!("Secret {name}: {}", why.message) }));
        }
        let target = match Target::from_kubeconfig_text(&kubeconfig, self.settings.limits, &id.label()).await {
            Ok(t) => t,
            Err(e) => {
                return Ok(Err(Unusable {
                    reason: Reason::TargetKubeconfigInvalid,
                    message: format!("Secret {name}: the kubeconfig is unusable: {}", redact(&e, &kubeconfig)),
                }))
            }
        };
        let mut join = target.join.clone();
        join.token_ttl = self.settings.token_ttl;
        join.token_group.clone_from(&self.settings.token_group);
        let target = target.with_join(join);
        if let Some(m) = self.metrics.get() {
            target.report_to(m.clone());
        }
        let connection = Arc::new(Connection::new(id.clone(), target, fingerprint));
        connection.start(self.waker.get().cloned());
        let replaced = lock(&self.named).insert(id.clone(), connection.clone());
        match replaced {
            Some(_) => {
                tracing::info!(target_cluster = %id, "target cluster connection built again (its Secret changed or its credentials were refused)")
            }
            None => tracing::info!(target_cluster = %id, "target cluster connected"),
        }
        Ok(Ok(Some(connection)))
    }

    /// The connection of `id` built from this kubeconfig, unless its credentials were refused
    /// a while ago (then it is built again: the Secret may have rotated since).
    fn current(&self, id: &TargetId, fingerprint: u64) -> Option<Arc<Connection>> {
        let named = lock(&self.named);
        let c = named.get(id)?;
        let refused = c.target.calls().refused_credentials() && c.built.elapsed() >= REBUILD_AFTER_REFUSAL;
        (c.fingerprint == fingerprint && !refused).then(|| c.clone())
    }

    /// The connection of `id` if it is open (no Secret is read).
    pub fn open(&self, id: &TargetId) -> Option<Arc<Connection>> {
        match id {
            TargetId::Default => self.default.clone(),
            id => lock(&self.named).get(id).cloned(),
        }
    }

    /// Closes the named targets not in `in_use` that were built before `since` (a scan of the
    /// objects that started then): their probe and watch stop and their metrics series go.
    pub fn retain(&self, in_use: &HashSet<TargetId>, since: Instant) {
        let closed: Vec<Arc<Connection>> = {
            let mut named = lock(&self.named);
            let gone: Vec<TargetId> = named
                .iter()
                .filter(|(id, c)| !in_use.contains(*id) && c.built < since)
                .map(|(id, _)| id.clone())
                .collect();
            gone.into_iter().filter_map(|id| named.remove(&id)).collect()
        };
        for c in closed {
            c.stop();
            c.target.calls().forget_series();
            tracing::info!(target_cluster = %c.id, "target cluster closed: no object uses it any more");
        }
    }
}

fn fingerprint(text: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    text.hash(&mut h);
    h.finish()
}

/// An error message with any part of the kubeconfig taken out (kube's parse errors may quote
/// the input).
fn redact(message: &str, kubeconfig: &str) -> String {
    let quoted = kubeconfig.lines().map(str::trim).filter(|l| l.len() >= 8).any(|l| message.contains(l));
    if quoted {
        "it does not parse as a kubeconfig".into()
    } else {
        message.into()
    }
}

/// Refuses a kubeconfig that would run a command or read a file on the controller's host.
///
/// # Errors
/// `ExecPluginRefused` for `exec` and `auth-provider` users, `TargetKubeconfigInvalid` for one
/// that does not parse, has no current context, or names files.
pub fn check_kubeconfig(yaml: &str) -> Result<(), Unusable> {
    let invalid = |message: String| Unusable { reason: Reason::TargetKubeconfigInvalid, message };
    let kc = kube::config::Kubeconfig::from_yaml(yaml)
        .map_err(|e| invalid(format!("the kubeconfig does not parse: {}", redact(&e.to_string(), yaml))))?;
    for named in &kc.auth_infos {
        let Some(user) = &named.auth_info else { continue };
        let plugin = if user.exec.is_some() {
            Some("an exec plugin")
        } else if user.auth_provider.is_some() {
            Some("an auth-provider plugin")
        } else {
            None
        };
        if let Some(plugin) = plugin {
            return Err(Unusable {
                reason: Reason::ExecPluginRefused,
                message: format!(
                    "user {:?} of the kubeconfig authenticates with {plugin}, which would run a command on the \
                     controller's host: refused (put a token or a client certificate in the kubeconfig)",
                    named.name
                ),
            });
        }
        let files = [
            ("tokenFile", user.token_file.is_some()),
            ("client-certificate", user.client_certificate.is_some()),
            ("client-key", user.client_key.is_some()),
        ];
        if let Some((field, _)) = files.iter().find(|(_, set)| *set) {
            return Err(invalid(format!(
                "user {:?} of the kubeconfig names a file ({field}) on the controller's host: put the data in the kubeconfig",
                named.name
            )));
        }
    }
    for named in &kc.clusters {
        if named.cluster.as_ref().is_some_and(|c| c.certificate_authority.is_some()) {
            return Err(invalid(format!(
                "cluster {:?} of the kubeconfig names a file (certificate-authority) on the controller's host: use \
                 certificate-authority-data",
                named.name
            )));
        }
    }
    if kc.current_context.as_deref().is_none_or(str::is_empty) && kc.contexts.len() != 1 {
        return Err(invalid("the kubeconfig has no current-context".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kubeconfig(user: serde_json::Value) -> String {
        serde_json::json!({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:6443"}}],
            "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
            "users": [{"name": "u", "user": user}],
        })
        .to_string()
    }

    #[test]
    fn a_kubeconfig_that_runs_a_command_or_reads_a_file_is_refused() {
        assert_eq!(check_kubeconfig(&kubeconfig(serde_json::json!({"token": "abc"}))), Ok(()));
        let exec = kubeconfig(serde_json::json!({"exec": {
            "apiVersion": "client.authentication.k8s.io/v1", "command": "/bin/sh", "args": ["-c", "touch /tmp/pwned"],
            "interactiveMode": "Never",
        }}));
        let e = check_kubeconfig(&exec).unwrap_err();
        assert_eq!(e.reason, Reason::ExecPluginRefused);
        assert!(e.message.contains("exec plugin") && e.message.contains("\"u\""), "{}", e.message);
        let provider = kubeconfig(serde_json::json!({"auth-provider": {"name": "gcp"}}));
        assert_eq!(check_kubeconfig(&provider).unwrap_err().reason, Reason::ExecPluginRefused);
        let file = kubeconfig(serde_json::json!({"tokenFile": "/var/run/secrets/token"}));
        let e = check_kubeconfig(&file).unwrap_err();
        assert_eq!(e.reason, Reason::TargetKubeconfigInvalid);
        assert!(e.message.contains("tokenFile"), "{}", e.message);
        let e = check_kubeconfig("{not: [yaml").unwrap_err();
        assert_eq!(e.reason, Reason::TargetKubeconfigInvalid);
    }

    #[test]
    fn a_target_is_labelled_by_its_secret() {
        let t = TargetCluster { kubeconfig_secret_ref: crate::resources::NameRef { name: "east".into() } };
        assert_eq!(TargetId::of("fleet", Some(&t)).label(), "fleet/east");
        assert_eq!(TargetId::of("fleet", None).label(), "default");
    }

    #[tokio::test]
    async fn a_secret_is_read_per_use_and_a_connection_built_once_per_content() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("s.db")).unwrap();
        let targets = Targets::new(None, TargetSettings::default());
        let t = TargetCluster { kubeconfig_secret_ref: crate::resources::NameRef { name: "east".into() } };
        let e = targets.get(&store, "fleet", Some(&t)).await.unwrap().err().unwrap();
        assert_eq!(e.reason, Reason::TargetSecretNotFound);
        assert!(targets.get(&store, "fleet", None).await.unwrap().unwrap().is_none(), "no default target");
        let secret = |text: &str| {
            serde_json::from_value::<Secret>(serde_json::json!({
                "apiVersion": "v1", "kind": "Secret",
                "metadata": {"namespace": "fleet", "name": "east"},
                "stringData": {KUBECONFIG_KEY: text},
            }))
            .unwrap()
        };
        store.create(&secret(&kubeconfig(serde_json::json!({"token": "one"})))).await.unwrap();
        let a = targets.get(&store, "fleet", Some(&t)).await.unwrap().unwrap().unwrap();
        let b = targets.get(&store, "fleet", Some(&t)).await.unwrap().unwrap().unwrap();
        assert!(Arc::ptr_eq(&a, &b), "one connection per content");
        let mut rotated = store.get::<Secret>("fleet", "east").await.unwrap().unwrap();
        rotated.string_data.insert(KUBECONFIG_KEY.into(), kubeconfig(serde_json::json!({"token": "two"})));
        store.update(&rotated).await.unwrap();
        let c = targets.get(&store, "fleet", Some(&t)).await.unwrap().unwrap().unwrap();
        assert!(!Arc::ptr_eq(&a, &c), "a rotated Secret builds the connection again");
        targets.retain(&HashSet::new(), Instant::now());
        assert!(targets.open(&TargetId::of("fleet", Some(&t))).is_none(), "unused: closed");
    }
}
