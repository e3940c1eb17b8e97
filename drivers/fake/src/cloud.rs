//! The simulated cloud: machines, pools and operations whose effects land when their time
//! comes. Time is wall-clock milliseconds so that a state file carries in-flight operations
//! across a sidecar restart: whoever looks first after an operation's end time applies it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use driver_sdk::{reason, DriverError, OperationKind};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Milliseconds since the epoch.
pub(crate) fn now_ms() -> u64 {
    driver_sdk::token::unix_millis(std::time::SystemTime::now())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum MState {
    Creating,
    Running,
    Updating,
    Deleting,
    Failed,
}

impl MState {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            MState::Creating => "CREATING",
            MState::Running => "RUNNING",
            MState::Updating => "UPDATING",
            MState::Deleting => "DELETING",
            MState::Failed => "FAILED",
        }
    }
}

/// An error the cloud reports (for an operation or a machine).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct CloudError {
    pub(crate) code: i32,
    pub(crate) reason: String,
    pub(crate) message: String,
}

impl CloudError {
    pub(crate) fn new(code: tonic::Code, reason: &str, message: impl Into<String>) -> Self {
        Self { code: code as i32, reason: reason.to_string(), message: message.into() }
    }

    pub(crate) fn to_driver_error(&self) -> DriverError {
        DriverError::new(tonic::Code::from_i32(self.code), self.reason.clone(), self.message.clone())
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct FMachine {
    pub(crate) name: String,
    pub(crate) id: String,
    pub(crate) zone: String,
    pub(crate) spec: Value,
    pub(crate) hash: String,
    pub(crate) labels: BTreeMap<String, String>,
    pub(crate) state: MState,
    pub(crate) created_ms: u64,
    pub(crate) ip: String,
    /// The operation in flight on this machine.
    pub(crate) op: Option<String>,
    /// The spec an in-flight update will apply.
    pub(crate) pending_spec: Option<Value>,
    /// Why the machine is Failed.
    pub(crate) failure: Option<CloudError>,
    /// `StopKubelet` was called (and no `StartKubelet` since): its Node is marked as not
    /// reporting and not registered again.
    #[serde(default)]
    pub(crate) kubelet_stopped: bool,
    /// The boot ID of its current boot (its Node's `status.nodeInfo.bootID`): new at create and
    /// after every in-place update that reboots it ([`crate::reboots`]). Empty in a state file
    /// older than the field: the VM's ID stands in.
    #[serde(default)]
    pub(crate) boot_id: String,
    /// Its boot data (the request's secret `userData`, else the provider spec's): what its
    /// kubelet joins the cluster with ([`crate::kubelets`]). A cloud keeps a VM's user data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) boot_data: Option<String>,
    /// The credentials its kubelet got by TLS bootstrap (once it joined).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) kubelet: Option<crate::kubelets::Credentials>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct FInstance {
    pub(crate) id: u32,
    pub(crate) model: String,
    /// Creating, Succeeded, Updating, Deleting.
    pub(crate) state: String,
    pub(crate) created_ms: u64,
    pub(crate) ip: String,
    /// The credentials its kubelet got by TLS bootstrap (once it joined).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) kubelet: Option<crate::kubelets::Credentials>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct FPool {
    pub(crate) name: String,
    pub(crate) id: String,
    pub(crate) zone: String,
    pub(crate) spec: Value,
    pub(crate) model: String,
    pub(crate) capacity: u32,
    pub(crate) labels: BTreeMap<String, String>,
    /// Creating, Updating, Succeeded, Deleting.
    pub(crate) state: String,
    pub(crate) next_instance: u32,
    pub(crate) instances: BTreeMap<u32, FInstance>,
    pub(crate) op: Option<String>,
    /// The boot data of its instances (as [`FMachine::boot_data`]), from the last ApplyPool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) boot_data: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct FOp {
    pub(crate) id: String,
    pub(crate) kind: OperationKind,
    pub(crate) target: String,
    pub(crate) started_ms: u64,
    pub(crate) done_ms: u64,
    pub(crate) finished: bool,
    /// Set when the operation ends (or will end) in failure.
    pub(crate) error: Option<CloudError>,
    /// Pool instances the operation acts on.
    #[serde(default)]
    pub(crate) instances: Vec<u32>,
    /// For ApplyPool: the capacity and template asked for (to recognise a repeat).
    #[serde(default)]
    pub(crate) spec_hash: String,
    #[serde(default)]
    pub(crate) capacity: u32,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct Counters {
    pub(crate) machines_created: u64,
    pub(crate) machines_deleted: u64,
    pub(crate) instances_created: u64,
    pub(crate) instances_deleted: u64,
    pub(crate) api_calls: u64,
    pub(crate) throttled: u64,
    pub(crate) quota_refusals: u64,
    pub(crate) faults_fired: u64,
    pub(crate) peak_machines: u64,
    /// Machines that vanished through `RemoveMachine`.
    #[serde(default)]
    pub(crate) machines_removed_out_of_band: u64,
    /// Machines taken at an injected event's deadline, still there then.
    #[serde(default)]
    pub(crate) machines_reclaimed: u64,
}

/// Everything the cloud knows; persisted as one JSON document when a state file is set.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct State {
    pub(crate) machines: BTreeMap<String, FMachine>,
    pub(crate) pools: BTreeMap<String, FPool>,
    pub(crate) ops: BTreeMap<String, FOp>,
    /// Unfinished operations by due time: an index over `ops` (rebuilt after loading), so an
    /// API call does not scan every operation.
    #[serde(skip)]
    due: std::collections::BTreeSet<(u64, String)>,
    #[serde(skip)]
    indexed: bool,
    /// When finished operations were last swept out.
    #[serde(skip)]
    swept_ms: u64,
    pub(crate) times_created: BTreeMap<String, u32>,
    pub(crate) counters: Counters,
    pub(crate) next_ip: u32,
    /// Which cloud this is (set when first created, kept in the state file): the Nodes its
    /// kubelets register carry it, so after a restart they are recognised as this cloud's.
    #[serde(default)]
    pub(crate) cloud_id: String,
    /// The cloud's events not acknowledged yet, by ID: streamed again after a restart.
    #[serde(default)]
    pub(crate) events: BTreeMap<String, crate::events::FEvent>,
    /// Machines the cloud takes at a deadline (an injected spot interruption): machine name to
    /// (its VM's ID, the deadline in ms). A machine deleted before then, or re-created under
    /// its name, is not taken.
    #[serde(default)]
    pub(crate) reclaims: BTreeMap<String, (String, u64)>,
}

/// Finished operations are kept this long so their tokens still resolve.
const KEEP_FINISHED_MS: u64 = 15 * 60 * 1000;
/// Expired operations are swept out this often (not on every call: that scanned them all).
const SWEEP_MS: u64 = 10 * 1000;

impl State {
    pub(crate) fn next_ip(&mut self) -> String {
        self.next_ip += 1;
        let n = self.next_ip;
        format!("10.{}.{}.{}", (n >> 16) & 0xff, (n >> 8) & 0xff, n & 0xff)
    }

    pub(crate) fn note_peak(&mut self) {
        self.counters.peak_machines = self.counters.peak_machines.max(self.machines.len() as u64);
    }

    pub(crate) fn instance_count(&self) -> usize {
        self.pools.values().map(|p| p.instances.len()).sum()
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.ops.values().filter(|o| !o.finished).count()
    }

    /// Applies every operation whose time has come, oldest first.
    pub(crate) fn advance(&mut self, now: u64) {
        if !self.indexed {
            self.due = self.ops.values().filter(|o| !o.finished).map(|o| (o.done_ms, o.id.clone())).collect();
            self.indexed = true;
        }
        let mut due = Vec::new();
        while self.due.first().is_some_and(|(at, _)| *at <= now) {
            let Some((_, id)) = self.due.pop_first() else { break };
            // Finished early (cancelled) or gone: nothing to do.
            if let Some(op) = self.ops.get(&id).filter(|o| !o.finished) {
                due.push((op.done_ms, id));
            }
        }
        due.sort();
        for (_, id) in due {
            self.finish(&id);
        }
        let due: Vec<String> = self.reclaims.iter().filter(|(_, (_, at))| *at <= now).map(|(n, _)| n.clone()).collect();
        for name in due {
            let Some((id, _)) = self.reclaims.remove(&name) else { continue };
            if self.machines.get(&name).is_some_and(|m| m.id == id) {
                self.machines.remove(&name);
                self.counters.machines_reclaimed += 1;
                tracing::warn!(machine = %name, "the cloud took the machine at its deadline");
            }
        }
        if now.saturating_sub(self.swept_ms) >= SWEEP_MS {
            self.swept_ms = now;
            self.ops.retain(|_, o| !o.finished || now.saturating_sub(o.done_ms) < KEEP_FINISHED_MS);
        }
    }

    fn finish(&mut self, id: &str) {
        let Some(op) = self.ops.get_mut(id) else { return };
        op.finished = true;
        let op = op.clone();
        match op.kind {
            OperationKind::CreateMachine => {
                if let Some(m) = self.machines.get_mut(&op.target).filter(|m| m.op.as_deref() == Some(id)) {
                    m.op = None;
                    let unhealthy = m.spec.get("simulateFailure").and_then(Value::as_str) == Some("unhealthy");
                    match &op.error {
                        Some(err) => {
                            m.state = MState::Failed;
                            m.failure = Some(err.clone());
                        }
                        None if unhealthy => {
                            m.state = MState::Failed;
                            m.failure = Some(CloudError::new(
                                tonic::Code::Unavailable,
                                "MACHINE_UNHEALTHY",
                                "the machine booted but fails its health checks",
                            ));
                        }
                        None => m.state = MState::Running,
                    }
                }
            }
            OperationKind::DeleteMachine => {
                if self.machines.get(&op.target).is_some_and(|m| m.op.as_deref() == Some(id)) {
                    self.machines.remove(&op.target);
                    self.counters.machines_deleted += 1;
                }
            }
            OperationKind::UpdateMachine => {
                if let Some(m) = self.machines.get_mut(&op.target).filter(|m| m.op.as_deref() == Some(id)) {
                    m.op = None;
                    if let Some(spec) = m.pending_spec.take() {
                        if op.error.is_none() {
                            if crate::reboots(&spec) {
                                // From the operation, so that a restarted sidecar that
                                // applies it again (its end not yet saved) gives the same.
                                m.boot_id = crate::boot_id_after(&op.id);
                            }
                            m.hash = driver_sdk::convert::spec_hash(&spec);
                            m.spec = spec;
                        }
                    }
                    m.state = MState::Running;
                }
            }
            OperationKind::ApplyPool | OperationKind::DeletePoolInstances | OperationKind::UpgradePoolInstances => {
                let mut deleted = 0;
                if let Some(p) = self.pools.get_mut(&op.target) {
                    let model = p.model.clone();
                    p.instances.retain(|_, i| {
                        let keep = i.state != "Deleting";
                        if !keep {
                            deleted += 1;
                        }
                        keep
                    });
                    for i in p.instances.values_mut() {
                        if i.state == "Updating" {
                            i.model = model.clone();
                        }
                        i.state = "Succeeded".into();
                    }
                    p.state = "Succeeded".into();
                    if p.op.as_deref() == Some(id) {
                        p.op = None;
                    }
                }
                self.counters.instances_deleted += deleted;
            }
            OperationKind::DeletePool => {
                if let Some(p) = self.pools.remove(&op.target) {
                    self.counters.instances_deleted += p.instances.len() as u64;
                }
            }
        }
    }

    /// A new operation on `target`, due `latency_ms` from now.
    pub(crate) fn start_op(&mut self, kind: OperationKind, target: &str, now: u64, latency_ms: u64) -> String {
        let id = format!("op-{}", uuid::Uuid::new_v4().simple());
        self.ops.insert(
            id.clone(),
            FOp {
                id: id.clone(),
                kind,
                target: target.to_string(),
                started_ms: now,
                done_ms: now + latency_ms,
                finished: false,
                error: None,
                instances: Vec::new(),
                spec_hash: String::new(),
                capacity: 0,
            },
        );
        self.due.insert((now + latency_ms, id.clone()));
        id
    }
}

/// Reads and writes the state file (atomically: write a temporary file, then rename).
#[derive(Debug, Clone)]
pub(crate) struct StateFile {
    path: PathBuf,
}

impl StateFile {
    pub(crate) fn new(path: &Path) -> Self {
        Self { path: path.to_path_buf() }
    }

    pub(crate) fn load(&self) -> Result<State, String> {
        match std::fs::read(&self.path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| format!("state file {} is not valid: {e}", self.path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(State::default()),
            Err(e) => Err(format!("reading state file {}: {e}", self.path.display())),
        }
    }

    pub(crate) fn save(&self, state: &State) -> Result<(), DriverError> {
        let write = || -> std::io::Result<()> {
            let tmp = self.path.with_extension("tmp");
            let bytes = serde_json::to_vec(state).map_err(std::io::Error::other)?;
            std::fs::write(&tmp, bytes)?;
            std::fs::rename(&tmp, &self.path)
        };
        write().map_err(|e| {
            DriverError::new(
                tonic::Code::Internal,
                reason::INTERNAL,
                format!("the fake cloud could not save its state to {}", self.path.display()),
            )
            .with_source(e)
        })
    }
}
