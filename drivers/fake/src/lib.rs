//! # fake-driver
//!
//! An in-memory cloud behind the `machinedriver.v1` protocol, for tests, demos and benchmarks:
//!
//! - machines and scale-set pools whose operations really take time (configurable latency per
//!   kind), with progress and `poll_after`;
//! - a capacity quota (RESOURCE_EXHAUSTED / QUOTA_EXCEEDED) and an API rate limit (UNAVAILABLE /
//!   THROTTLED with RetryInfo);
//! - fault injection by RPC and target-name glob ([`FaultRule`]);
//! - an optional state file, so the cloud and its in-flight operations survive a sidecar restart;
//! - the `fakecloud.v1.FakeCloud` inspection API on the same socket (what exists, how many creates
//!   and deletes happened, peak machine count), to prove nothing leaked or was created twice, and
//!   test aids: `StopKubelet` (a machine's kubelet stops reporting), `StartKubelet` (it reports
//!   again) and `RemoveMachine` (a VM vanishes out of band, as if deleted in the cloud console);
//! - the provider spec field `inPlaceDisruption` (`None`, the default, `Drain`, `Reboot`, `Unset`),
//!   what `CanUpdateMachine` says an in-place update disrupts ([`in_place_disruption`]); with
//!   `Reboot` or `Unset` the update reboots the VM (a new boot ID, [`reboots`]);
//! - optionally (`--join-cluster KUBECONFIG`, [`kubelets`]) machines that join a Kubernetes
//!   cluster the way a kubelet registers: a Node per running machine and pool instance (name =
//!   its `Hostname` address, `spec.providerID` = the provider ID the driver reports), annotated
//!   for kwok to keep Ready; the Node of a VM that is gone or whose kubelet stopped turns
//!   `Ready=Unknown` and is left for the controller to delete (or, once the kubelet is started
//!   again, gets its kwok annotation back and turns Ready), and whose `status.nodeInfo.bootID`
//!   changes when an in-place update reboots the VM. The provider spec field `kubelet`
//!   (`Joins`, `NeverJoins`, `JoinsNotReady`) injects registration faults. Without the option no
//!   Kubernetes client exists and nothing of this runs; without the cargo feature `join-cluster`
//!   (off by default, on in the test suite) none is even compiled in, and the option is refused.

use driver_sdk::lock;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use driver_sdk::{
    async_trait, convert, reason, Address, ApplyPool, CanUpdateMachine, Capability, CreateMachine, Driver, DriverError,
    DriverInfo, InPlaceDisruption, InstanceState, ListMachines, ListPoolInstances, Machine, MachineRef, MachineState,
    Operation, OperationHandle, OperationKind, OperationOutput, Page, Pool, PoolInstance, PoolInstances, PoolRef,
    PowerState, RequestContext, ResourceStatus, Result, Secrets, UpdateMachine, UpdatePlan,
};
use serde_json::{json, Value};
use tracing::Instrument;

mod cloud;
pub mod connections;
mod events;
pub mod faults;
mod inspect;
pub mod kubelets;

use cloud::{now_ms, CloudError, FInstance, FMachine, FPool, MState, State, StateFile};
use faults::Placement;
pub use faults::{FaultAction, FaultRule};
pub use inspect::FakeCloudService;

/// Generated types of the `fakecloud.v1` inspection API.
pub mod pb {
    #![allow(missing_docs, unreachable_pub, clippy::all)]
    tonic::include_proto!("fakecloud.v1");
}

/// Encoded descriptor set of `fakecloud.v1` (for reflection).
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/fakecloud_descriptor.bin"));

/// The driver's name (and ErrorInfo domain).
pub const DRIVER_NAME: &str = "fake.machinedriver.dev";

/// The ErrorInfo reason of an injected fault (unless the rule names another).
pub const FAULT_INJECTED: &str = "FAULT_INJECTED";

/// [`Config::create_latency`] by default (`--create-latency`): long enough that operations are
/// seen running and polled, short enough for demos and tests.
pub const DEFAULT_CREATE_LATENCY: Duration = Duration::from_secs(2);
/// [`Config::delete_latency`] by default (`--delete-latency`).
pub const DEFAULT_DELETE_LATENCY: Duration = Duration::from_secs(1);
/// [`Config::update_latency`] by default (`--update-latency`).
pub const DEFAULT_UPDATE_LATENCY: Duration = Duration::from_secs(1);
/// [`Config::pool_latency`] by default (`--pool-latency`).
pub const DEFAULT_POOL_LATENCY: Duration = Duration::from_secs(2);
/// [`Config::burst`] by default (`--burst`): with a `--rate-limit`, this many calls pass at once
/// before the rate applies.
pub const DEFAULT_BURST: u32 = 50;
/// The `poll_after` of a running operation is the time it has left, within these bounds
/// (`docs/src/reference/protocol.md`, Operation): never a busy poll, never a long sleep past the end.
/// New events in flight to a stream before it falls behind (and starts over).
const EVENT_CHANNEL: usize = 1024;
const POLL_AFTER_MIN: Duration = Duration::from_millis(50);
/// See [`POLL_AFTER_MIN`].
const POLL_AFTER_MAX: Duration = Duration::from_secs(5);

/// How the fake cloud behaves.
#[derive(Debug, Clone)]
pub struct Config {
    /// How long a machine create takes.
    pub create_latency: Duration,
    /// How long a machine delete takes.
    pub delete_latency: Duration,
    /// How long an in-place update takes.
    pub update_latency: Duration,
    /// How long pool operations take.
    pub pool_latency: Duration,
    /// Most machines + pool instances that may exist at once.
    pub max_machines: Option<u32>,
    /// API calls per second allowed (token bucket), with `burst`.
    pub rate_limit: Option<f64>,
    /// Bucket size of the rate limit.
    pub burst: u32,
    /// Where the cloud is kept across restarts, rewritten (atomically) after every change; `None`:
    /// in memory only.
    pub state_file: Option<std::path::PathBuf>,
    /// When set, calls must carry secret `apiKey` with this value.
    pub api_key: Option<String>,
    /// Initial fault rules.
    pub faults: Vec<FaultRule>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            create_latency: DEFAULT_CREATE_LATENCY,
            delete_latency: DEFAULT_DELETE_LATENCY,
            update_latency: DEFAULT_UPDATE_LATENCY,
            pool_latency: DEFAULT_POOL_LATENCY,
            max_machines: None,
            rate_limit: None,
            burst: DEFAULT_BURST,
            state_file: None,
            api_key: None,
            faults: Vec::new(),
        }
    }
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

/// The fake driver.
pub struct FakeDriver {
    config: Config,
    state: Mutex<State>,
    file: Option<StateFile>,
    faults: Mutex<Vec<FaultRule>>,
    bucket: Mutex<Bucket>,
    /// New events, to the streams of [`Driver::watch_events`].
    event_tx: tokio::sync::broadcast::Sender<driver_sdk::MachineEvent>,
}

/// What a fake operation token holds: the cloud's operation ID, or none when the call found
/// its work already done (then a poll reports the target as it is now).
#[derive(serde::Serialize, serde::Deserialize)]
struct TokenState {
    #[serde(default)]
    op: Option<String>,
}

/// An operation that was already done when asked for.
fn done_now(kind: OperationKind, target: String, output: OperationOutput) -> Operation {
    let mut op = Operation::running(kind, target, json!({"op": null})).finish(Ok(output));
    op.progress_percent = 100;
    op
}

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

fn machine_not_found(name: &str) -> DriverError {
    DriverError::not_found(reason::MACHINE_NOT_FOUND, format!("machine {name} does not exist"))
}

fn pool_not_found(name: &str) -> DriverError {
    DriverError::not_found(reason::POOL_NOT_FOUND, format!("pool {name} does not exist"))
}

/// Parses a page token issued as "the last key of the previous page".
fn page_token(token: &str) -> Result<Option<&str>> {
    if token.is_empty() {
        return Ok(None);
    }
    if driver_sdk::schema::check_name(token).is_err() && token.parse::<u32>().is_err() {
        return Err(DriverError::invalid_argument(reason::FIELD_INVALID, "page_token was not issued by this driver")
            .with_violation("page_token", "unknown token"));
    }
    Ok(Some(token))
}

impl FakeDriver {
    /// A fake cloud with `config`, loading the state file when one is set.
    ///
    /// # Errors
    /// An unreadable or corrupt state file, or an invalid fault rule.
    pub fn new(config: Config) -> Result<Self, String> {
        for (i, r) in config.faults.iter().enumerate() {
            r.validate().map_err(|e| format!("fault rule {i}: {e}"))?;
        }
        let file = config.state_file.as_deref().map(StateFile::new);
        let mut state = match &file {
            Some(f) => f.load()?,
            None => State::default(),
        };
        if state.cloud_id.is_empty() {
            // Kept at once: the Nodes registered from now on name this cloud.
            state.cloud_id = uuid::Uuid::new_v4().simple().to_string();
            if let Some(f) = &file {
                f.save(&state).map_err(|e| e.to_string())?;
            }
        }
        let burst = f64::from(config.burst.max(1));
        Ok(Self {
            faults: Mutex::new(config.faults.clone()),
            bucket: Mutex::new(Bucket { tokens: burst, at: Instant::now() }),
            config,
            state: Mutex::new(state),
            file,
            event_tx: tokio::sync::broadcast::channel(EVENT_CHANNEL).0,
        })
    }

    /// The state, with every due operation applied.
    fn cloud(&self) -> MutexGuard<'_, State> {
        let mut st = lock(&self.state);
        st.advance(now_ms());
        st
    }

    fn save(&self, st: &State) -> Result<()> {
        match &self.file {
            Some(f) => f.save(st),
            None => Ok(()),
        }
    }

    /// Admission of one cloud API call: auth, rate limit, fault rules. Returns a failure to
    /// attach to the operation (action `fail_operation`).
    async fn admit(&self, ctx: &RequestContext, secrets: &Secrets, target: &str) -> Result<Option<CloudError>> {
        self.admit_in(ctx, secrets, target, None).await
    }

    /// [`Self::admit`] for a call that places something `at` a zone and capacity type (fault
    /// rules may name them).
    async fn admit_in(
        &self,
        ctx: &RequestContext,
        secrets: &Secrets,
        target: &str,
        at: Option<Placement<'_>>,
    ) -> Result<Option<CloudError>> {
        // The fake cloud's API call, as a real driver's HTTP call to its cloud would be: a client
        // span under the RPC's, so a trace shows controller, sidecar and cloud.
        let span = tracing::info_span!(
            "cloud_call",
            "otel.name" = %format!("fake-cloud {}", ctx.method()),
            "otel.kind" = "client",
            "cloud.operation" = %ctx.method(),
            "cloud.target" = %target,
        );
        self.admit_call(ctx, secrets, target, at).instrument(span).await
    }

    async fn admit_call(
        &self,
        ctx: &RequestContext,
        secrets: &Secrets,
        target: &str,
        at: Option<Placement<'_>>,
    ) -> Result<Option<CloudError>> {
        lock(&self.state).counters.api_calls += 1;
        if let Some(key) = &self.config.api_key {
            if secrets.get("apiKey") != Some(key.as_str()) {
                let why = if secrets.get("apiKey").is_some() { "was refused" } else { "is missing (secret apiKey)" };
                return Err(DriverError::auth_failed(format!("the fake cloud API key {why}")));
            }
        }
        if let Some(rate) = self.config.rate_limit {
            let mut b = lock(&self.bucket);
            let now = Instant::now();
            let burst = f64::from(self.config.burst.max(1));
            b.tokens = (b.tokens + now.duration_since(b.at).as_secs_f64() * rate).min(burst);
            b.at = now;
            if b.tokens < 1.0 {
                let wait = Duration::from_secs_f64((1.0 - b.tokens) / rate.max(0.001));
                drop(b);
                lock(&self.state).counters.throttled += 1;
                return Err(DriverError::throttled(format!("the fake cloud allows {rate} calls per second"), wait)
                    .with_metadata("rateLimit", rate.to_string()));
            }
            b.tokens -= 1.0;
        }
        self.fault(ctx, target, at).await
    }

    /// The fault rules' part of [`Self::admit_in`]: the first rule matching this call fires.
    async fn fault(&self, ctx: &RequestContext, target: &str, at: Option<Placement<'_>>) -> Result<Option<CloudError>> {
        let rpc = ctx.method().to_string();
        let rule = {
            let mut rules = lock(&self.faults);
            rules.iter_mut().find(|r| r.matches(&rpc, target, at)).map(|r| {
                r.fired += 1;
                r.clone()
            })
        };
        let Some(rule) = rule else { return Ok(None) };
        lock(&self.state).counters.faults_fired += 1;
        tracing::info!(rpc, target, action = ?rule.action, "fault injected");
        if rule.latency_ms > 0 {
            // Deliberate: the injected latency is the fault.
            tokio::time::sleep(Duration::from_millis(u64::from(rule.latency_ms))).await;
        }
        let err = || {
            let mut e = DriverError::new(rule.code(), rule.reason(), rule.message(&rpc, target));
            if rule.retry_after_ms > 0 {
                e = e.with_retry_after(Duration::from_millis(u64::from(rule.retry_after_ms)));
            }
            e
        };
        match rule.action {
            FaultAction::Delay => Ok(None),
            FaultAction::Error => Err(err()),
            FaultAction::FailOperation => Ok(Some(CloudError {
                code: rule.code() as i32,
                reason: rule.reason(),
                message: rule.message(&rpc, target),
            })),
            FaultAction::DropConnection => {
                if let Some(cut) = ctx.connection::<connections::Cut>() {
                    cut.cut();
                }
                Err(DriverError::unavailable(FAULT_INJECTED, "connection dropped by fault injection"))
            }
            FaultAction::Exit => {
                tracing::warn!("fault rule says exit: exiting now");
                std::process::exit(3);
            }
        }
    }

    fn machine_view(m: &FMachine) -> Machine {
        let state = match m.state {
            MState::Creating => MachineState::Creating,
            MState::Running => MachineState::Running,
            MState::Updating => MachineState::Updating,
            MState::Deleting => MachineState::Deleting,
            MState::Failed => MachineState::Failed,
        };
        let vm_state = match m.state {
            MState::Creating => "Creating",
            MState::Running => "Succeeded",
            MState::Updating => "Updating",
            MState::Deleting => "Deleting",
            MState::Failed => "Failed",
        };
        let short = &m.id[..8.min(m.id.len())];
        Machine {
            name: m.name.clone(),
            provider_id: machine_provider_id(m),
            state,
            addresses: vec![
                Address { kind: "InternalIP".into(), address: m.ip.clone() },
                Address { kind: "Hostname".into(), address: m.name.clone() },
            ],
            labels: m.labels.clone(),
            resources: vec![
                ResourceStatus { kind: "vm".into(), id: m.id.clone(), state: vm_state.into(), message: String::new() },
                ResourceStatus {
                    kind: "nic".into(),
                    id: format!("nic-{short}"),
                    state: "Attached".into(),
                    message: String::new(),
                },
                ResourceStatus {
                    kind: "disk".into(),
                    id: format!("disk-{short}"),
                    state: "Attached".into(),
                    message: String::new(),
                },
            ],
            cloud_error: m
                .failure
                .as_ref()
                .map(|f| (tonic::Code::from_i32(f.code), f.reason.clone(), f.message.clone())),
            create_time: Some(std::time::UNIX_EPOCH + Duration::from_millis(m.created_ms)),
            spec_hash: m.hash.clone(),
        }
    }

    fn pool_view(p: &FPool) -> Pool {
        Pool {
            name: p.name.clone(),
            provider_id: format!("fake:///{}/pools/{}", p.zone, p.id),
            capacity: p.capacity,
            model_version: p.model.clone(),
            provisioning_state: p.state.clone(),
            labels: p.labels.clone(),
        }
    }

    /// The operation `id` as the protocol reports it.
    fn op_view(st: &State, id: &str) -> Operation {
        let Some(op) = st.ops.get(id) else {
            let err = DriverError::not_found(
                reason::OPERATION_NOT_FOUND,
                format!("the fake cloud has no operation {id}: it expired or the cloud lost its state"),
            );
            return Operation::failed(OperationKind::CreateMachine, "", err).named(id);
        };
        let now = now_ms();
        let base = Operation::running(op.kind, op.target.clone(), json!({"op": op.id}))
            .named(op.id.clone())
            .started_at(std::time::UNIX_EPOCH + Duration::from_millis(op.started_ms));
        if !op.finished {
            let total = op.done_ms.saturating_sub(op.started_ms).max(1);
            let elapsed = now.saturating_sub(op.started_ms).min(total);
            let left = Duration::from_millis(op.done_ms.saturating_sub(now));
            return base
                .with_progress((elapsed * 100 / total) as u8)
                .with_poll_after(left.clamp(POLL_AFTER_MIN, POLL_AFTER_MAX));
        }
        let mut done = base;
        done.end_time = Some(std::time::UNIX_EPOCH + Duration::from_millis(op.done_ms));
        if let Some(err) = &op.error {
            return done.finish(Err(err.to_driver_error()));
        }
        let output = match op.kind {
            OperationKind::CreateMachine | OperationKind::UpdateMachine => match st.machines.get(&op.target) {
                Some(m) => OperationOutput::Machine(Self::machine_view(m)),
                None => return done.finish(Err(machine_not_found(&op.target))),
            },
            OperationKind::DeleteMachine | OperationKind::DeletePool => OperationOutput::None,
            _ => match st.pools.get(&op.target) {
                Some(p) => OperationOutput::Pool(Self::pool_view(p)),
                None => OperationOutput::None,
            },
        };
        done.finish(Ok(output))
    }

    /// A poll of an operation that was done when it was returned: the target as it is now.
    fn current_view(st: &State, handle: &OperationHandle) -> Operation {
        let target = handle.target.clone();
        let output = match handle.kind {
            OperationKind::CreateMachine | OperationKind::UpdateMachine => match st.machines.get(&target) {
                Some(m) => OperationOutput::Machine(Self::machine_view(m)),
                None => return handle.resume().finish(Err(machine_not_found(&target))),
            },
            OperationKind::DeleteMachine | OperationKind::DeletePool => OperationOutput::None,
            _ => st.pools.get(&target).map_or(OperationOutput::None, |p| OperationOutput::Pool(Self::pool_view(p))),
        };
        handle.resume().finish(Ok(output))
    }

    fn schema() -> Value {
        json!({
            "type": "object",
            "required": ["machineType"],
            "additionalProperties": false,
            "properties": {
                "machineType": {"type": "string", "enum": ["small", "medium", "large"],
                                 "description": "size of the machine; changed in place"},
                "zone": {"type": "string", "pattern": "^zone-[a-z]$", "description": "where it runs; changing it replaces the machine"},
                "image": {"type": "string", "minLength": 1, "description": "boot image; changing it replaces the machine"},
                "diskGiB": {"type": "integer", "minimum": 10, "maximum": 4096, "description": "disk size; grown in place"},
                "tags": {"type": "object", "additionalProperties": {"type": "string"}, "description": "cloud tags; changed in place"},
                "userData": {"type": "string", "description": "boot script; changing it replaces the machine"},
                "capacityType": {"type": "string", "enum": ["on-demand", "spot"],
                                 "description": "how the capacity is bought (on-demand when absent); a spot machine's events say so; changing it replaces the machine"},
                "simulateFailure": {"type": "string", "enum": ["", "provisioning", "unhealthy"],
                                     "description": "test aid: creates fail (provisioning) or machines turn Failed after boot (unhealthy)"},
                "kubelet": {"type": "string", "enum": ["Joins", "NeverJoins", "JoinsNotReady"],
                            "description": "test aid for a sidecar started with --join-cluster: the machine's Node registers and kwok makes it Ready (Joins, the default), is never registered (NeverJoins), or registers but never turns Ready (JoinsNotReady); like any other field but machineType, tags, diskGiB and inPlaceDisruption, changing it replaces the machine"},
                "inPlaceDisruption": {"type": "string", "enum": ["None", "Drain", "Reboot", "Unset"],
                                      "description": "test aid: what CanUpdateMachine says an in-place update to this spec disrupts (None when absent); Unset leaves the answer unset, as a driver older than the field does (read as Reboot). With Reboot or Unset the update reboots the VM: under --join-cluster its Node gets a new status.nodeInfo.bootID. Changed in place"}
            },
            "examples": [
                {"machineType": "small", "zone": "zone-a", "image": "fake-os-1"},
                {"machineType": "medium", "zone": "zone-a", "image": "fake-os-1", "tags": {"tier": "web"}}
            ]
        })
    }

    fn quota_check(&self, st: &mut State, adding: usize) -> Result<()> {
        if let Some(max) = self.config.max_machines {
            let used = st.machines.len() + st.instance_count();
            if used + adding > max as usize {
                st.counters.quota_refusals += 1;
                return Err(DriverError::quota_exceeded(format!(
                    "the fake cloud's quota of {max} machines is used up ({used} exist, {adding} more asked)"
                ))
                .with_metadata("quota", max.to_string()));
            }
        }
        Ok(())
    }

    /// Counters and contents for the inspection API.
    pub(crate) fn inspect(&self, reset_peak: bool) -> pb::InspectResponse {
        let mut st = self.cloud();
        let c = &st.counters;
        let counters = pb::Counters {
            machines_created: c.machines_created,
            machines_deleted: c.machines_deleted,
            instances_created: c.instances_created,
            instances_deleted: c.instances_deleted,
            api_calls: c.api_calls,
            throttled: c.throttled,
            quota_refusals: c.quota_refusals,
            faults_fired: c.faults_fired,
            peak_machines: c.peak_machines,
            machines_now: st.machines.len() as u64,
            machines_removed_out_of_band: c.machines_removed_out_of_band,
            machines_reclaimed: c.machines_reclaimed,
        };
        let resp = pb::InspectResponse {
            machines: st
                .machines
                .values()
                .map(|m| pb::MachineView {
                    name: m.name.clone(),
                    provider_id: machine_provider_id(m),
                    state: m.state.as_str().into(),
                    spec_hash: m.hash.clone(),
                    labels: m.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
                    times_created: st.times_created.get(&m.name).copied().unwrap_or(0),
                    kubelet_stopped: m.kubelet_stopped,
                })
                .collect(),
            pools: st
                .pools
                .values()
                .map(|p| pb::PoolView {
                    name: p.name.clone(),
                    capacity: p.capacity as i32,
                    model_version: p.model.clone(),
                    provisioning_state: p.state.clone(),
                    instances: p
                        .instances
                        .values()
                        .map(|i| pb::InstanceView {
                            instance_id: i.id.to_string(),
                            provisioning_state: i.state.clone(),
                            latest_model_applied: i.model == p.model,
                        })
                        .collect(),
                })
                .collect(),
            counters: Some(counters),
            operations_in_flight: st.in_flight() as i32,
            events_pending: st.events.len() as i32,
        };
        if reset_peak {
            st.counters.peak_machines = st.machines.len() as u64;
        }
        resp
    }

    /// `StopKubelet`: the machine's kubelet stops reporting; its VM keeps running.
    pub(crate) fn stop_kubelet(&self, name: &str) -> std::result::Result<(), tonic::Status> {
        let mut st = self.cloud();
        let m = st.machines.get_mut(name).ok_or_else(|| inspect_not_found(name))?;
        if m.kubelet_stopped {
            return Ok(());
        }
        m.kubelet_stopped = true;
        self.save(&st).map_err(|e| tonic::Status::internal(e.to_string()))?;
        tracing::info!(machine = %name, "kubelet stopped (test aid)");
        Ok(())
    }

    /// `StartKubelet`: the machine's kubelet reports again (the inverse of `StopKubelet`).
    pub(crate) fn start_kubelet(&self, name: &str) -> std::result::Result<(), tonic::Status> {
        let mut st = self.cloud();
        let m = st.machines.get_mut(name).ok_or_else(|| inspect_not_found(name))?;
        if !m.kubelet_stopped {
            return Ok(());
        }
        m.kubelet_stopped = false;
        self.save(&st).map_err(|e| tonic::Status::internal(e.to_string()))?;
        tracing::info!(machine = %name, "kubelet started again (test aid)");
        Ok(())
    }

    /// `InjectEvent`: the cloud reports an event on the machine; kept until acknowledged.
    pub(crate) fn inject_event(
        &self,
        name: &str,
        kind: &str,
        notice: Option<Duration>,
        message: String,
    ) -> std::result::Result<String, tonic::Status> {
        let kind = events::parse_kind(kind).map_err(tonic::Status::invalid_argument)?;
        let mut st = self.cloud();
        let m = st.machines.get(name).ok_or_else(|| inspect_not_found(name))?;
        let event = events::FEvent::new(m, machine_provider_id(m), kind, notice, message, now_ms());
        let id = event.id.clone();
        let streamed = event.to_event();
        // What the cloud does: a termination now, a stop now, a reclaim at the deadline.
        let vm = m.id.clone();
        match (kind, event.not_before_ms) {
            ("TERMINATED", _) => {
                st.machines.remove(name);
                st.counters.machines_removed_out_of_band += 1;
            }
            ("STOPPED", _) => {
                if let Some(m) = st.machines.get_mut(name) {
                    m.kubelet_stopped = true;
                }
            }
            ("SPOT_INTERRUPTION" | "CAPACITY_RESERVATION_INTERRUPTION", Some(at)) => {
                st.reclaims.insert(name.to_string(), (vm, at));
            }
            _ => {}
        }
        st.events.insert(id.clone(), event);
        self.save(&st).map_err(|e| tonic::Status::internal(e.to_string()))?;
        drop(st);
        // No stream open yet is fine: a stream starts with every event not acknowledged.
        let _ = self.event_tx.send(streamed);
        tracing::info!(machine = %name, event.id = %id, event.kind = kind, "event injected (test aid)");
        Ok(id)
    }

    /// The events not acknowledged yet, oldest first.
    fn pending_events(&self) -> Vec<driver_sdk::MachineEvent> {
        let st = lock(&self.state);
        let mut events: Vec<&events::FEvent> = st.events.values().collect();
        events.sort_by_key(|e| (e.observed_ms, e.id.clone()));
        events.into_iter().map(events::FEvent::to_event).collect()
    }

    /// `RemoveMachine`: the machine vanishes from the cloud, with no `DeleteMachine`.
    pub(crate) fn remove_machine(&self, name: &str) -> std::result::Result<(), tonic::Status> {
        let mut st = self.cloud();
        st.machines.remove(name).ok_or_else(|| inspect_not_found(name))?;
        st.counters.machines_removed_out_of_band += 1;
        self.save(&st).map_err(|e| tonic::Status::internal(e.to_string()))?;
        tracing::info!(machine = %name, "machine removed out of band (test aid)");
        Ok(())
    }

    /// The cloud's ID and every VM as its kubelet sees it (machines, then pool instances), for
    /// the [`kubelets`] task. The lock is held only while copying.
    #[cfg_attr(not(feature = "join-cluster"), allow(dead_code))]
    pub(crate) fn kubelet_view(&self) -> (String, Vec<kubelets::Vm>) {
        let st = self.cloud();
        let mut vms = Vec::with_capacity(st.machines.len() + st.instance_count());
        vms.extend(st.machines.values().map(machine_vm));
        for p in st.pools.values() {
            let kubelet = kubelets::KubeletMode::of(&p.spec);
            for i in p.instances.values() {
                vms.push(kubelets::Vm {
                    hostname: instance_hostname(p, i),
                    provider_id: instance_provider_id(p, i),
                    ip: i.ip.clone(),
                    machine_type: machine_type(&p.spec),
                    zone: p.zone.clone(),
                    booted: matches!(instance_state(&i.state), InstanceState::Running | InstanceState::Updating),
                    kubelet,
                    stopped: false,
                    // Pool instances are never rebooted in place: one boot, from their creation.
                    boot_id: format!("{}-{}-{}", p.id, i.id, i.created_ms),
                });
            }
        }
        (st.cloud_id.clone(), vms)
    }

    /// The boot data and kubelet credentials of the VM `hostname` of provider ID `provider_id`
    /// (a machine or a pool instance), for the [`kubelets`] task; `None` when it is gone.
    #[cfg_attr(not(feature = "join-cluster"), allow(dead_code))]
    pub(crate) fn kubelet_identity(
        &self,
        hostname: &str,
        provider_id: &str,
    ) -> Option<(Option<String>, Option<kubelets::Credentials>)> {
        let st = lock(&self.state);
        if let Some(m) = st.machines.get(hostname).filter(|m| machine_provider_id(m) == provider_id) {
            return Some((m.boot_data.clone(), m.kubelet.clone()));
        }
        st.pools.values().find_map(|p| {
            let i = p.instances.values().find(|i| instance_provider_id(p, i) == provider_id)?;
            Some((p.boot_data.clone(), i.kubelet.clone()))
        })
    }

    /// Keeps the credentials the kubelet of the VM `hostname` (provider ID `provider_id`) got by
    /// TLS bootstrap, in the state file too (a restarted sidecar's kubelets still have them).
    ///
    /// # Errors
    /// The state file could not be written.
    #[cfg_attr(not(feature = "join-cluster"), allow(dead_code))]
    pub(crate) fn kubelet_joined(
        &self,
        hostname: &str,
        provider_id: &str,
        credentials: kubelets::Credentials,
    ) -> Result<()> {
        let mut guard = lock(&self.state);
        let st = &mut *guard;
        let instance = st.pools.iter().find_map(|(name, p)| {
            p.instances.values().find(|i| instance_provider_id(p, i) == provider_id).map(|i| (name.clone(), i.id))
        });
        let slot = match st.machines.get_mut(hostname) {
            Some(m) if machine_provider_id(m) == provider_id => Some(&mut m.kubelet),
            _ => {
                instance.and_then(|(pool, id)| st.pools.get_mut(&pool)?.instances.get_mut(&id)).map(|i| &mut i.kubelet)
            }
        };
        match slot {
            Some(slot) => *slot = Some(credentials),
            None => return Ok(()),
        }
        self.save(st)
    }

    /// Whether the machine `name` exists with provider ID `provider_id` and its kubelet reports
    /// ([`kubelets::Vm::reports`]), for the [`kubelets`] task: the lock is held for one lookup.
    #[cfg_attr(not(feature = "join-cluster"), allow(dead_code))]
    pub(crate) fn kubelet_reports(&self, name: &str, provider_id: &str) -> bool {
        let st = self.cloud();
        st.machines.get(name).map(machine_vm).is_some_and(|v| v.provider_id == provider_id && v.reports())
    }

    pub(crate) fn set_faults(&self, rules: Vec<FaultRule>) {
        *lock(&self.faults) = rules;
    }

    pub(crate) fn faults(&self) -> Vec<FaultRule> {
        lock(&self.faults).clone()
    }

    fn instance_view(p: &FPool, i: &FInstance) -> PoolInstance {
        PoolInstance {
            instance_id: i.id.to_string(),
            name: format!("{}_{}", p.name, i.id),
            provider_id: instance_provider_id(p, i),
            state: instance_state(&i.state),
            provisioning_state: i.state.clone(),
            power_state: if i.state == "Creating" { PowerState::Starting } else { PowerState::Running },
            latest_model_applied: i.model == p.model,
            addresses: vec![
                Address { kind: "InternalIP".into(), address: i.ip.clone() },
                Address { kind: "Hostname".into(), address: instance_hostname(p, i) },
            ],
            create_time: Some(std::time::UNIX_EPOCH + Duration::from_millis(i.created_ms)),
        }
    }

    fn pool_mut<'a>(st: &'a mut State, name: &str) -> Result<&'a mut FPool> {
        st.pools.get_mut(name).ok_or_else(|| pool_not_found(name))
    }
}

#[async_trait]
impl Driver for FakeDriver {
    fn info(&self) -> DriverInfo {
        DriverInfo {
            name: DRIVER_NAME.into(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            provider_spec_schema: Self::schema(),
        }
    }

    fn capabilities(&self) -> Vec<Capability> {
        vec![
            Capability::Machines,
            Capability::ValidateMachineClass,
            Capability::InPlaceUpdate,
            Capability::Pools,
            Capability::CancelOperation,
            Capability::Events,
        ]
    }

    async fn watch_events(&self, _ctx: &RequestContext) -> Result<driver_sdk::EventStream> {
        // Subscribed before the pending ones are read: an event injected in between comes
        // twice, which the SDK drops, rather than never.
        let mut new = self.event_tx.subscribe();
        let pending = self.pending_events();
        let (tx, rx) = tokio::sync::mpsc::channel(EVENT_CHANNEL);
        tokio::spawn(async move {
            for e in pending {
                if tx.send(Ok(e)).await.is_err() {
                    return;
                }
            }
            // Until this stream fell behind (then it ends, and the SDK's next call starts with
            // everything pending again) or the caller went away.
            while let Ok(e) = new.recv().await {
                if tx.send(Ok(e)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Box::pin(futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) })))
    }

    async fn ack_event(&self, ctx: &RequestContext, event: &driver_sdk::MachineEvent) -> Result<()> {
        // A cloud call (a queue's message deleted): fault rules on AckEvents hold it back, so the
        // event stays pending and is delivered again.
        self.fault(ctx, &event.machine_name, None).await?;
        let mut st = lock(&self.state);
        if st.events.remove(&event.event_id).is_some() {
            self.save(&st)?;
        }
        Ok(())
    }

    async fn create_machine(&self, ctx: &RequestContext, req: CreateMachine) -> Result<Operation> {
        let fail = self.admit_in(ctx, &req.secrets, &req.name, Some(Placement::of(&req.provider_spec))).await?;
        let hash = convert::spec_hash(&req.provider_spec);
        let now = now_ms();
        let mut st = self.cloud();
        if let Some(m) = st.machines.get(&req.name) {
            let pending = m.pending_spec.as_ref().map(convert::spec_hash);
            if m.hash != hash && pending.as_ref() != Some(&hash) {
                return Err(DriverError::already_exists(
                    reason::MACHINE_SPEC_CONFLICT,
                    format!("machine {} exists with another provider spec", req.name),
                ));
            }
            return match (m.state, &m.op) {
                (MState::Deleting, _) => {
                    Err(DriverError::operation_pending(format!("machine {} is being deleted", req.name)))
                }
                (MState::Creating, Some(op)) => Ok(Self::op_view(&st, op)),
                (MState::Failed, _) => {
                    let err = m.failure.as_ref().map(CloudError::to_driver_error).unwrap_or_else(|| {
                        DriverError::new(tonic::Code::Internal, reason::CLOUD_OPERATION_FAILED, "the machine failed")
                    });
                    let failed =
                        Operation::running(OperationKind::CreateMachine, req.name.clone(), json!({"op": null}));
                    Ok(failed.finish(Err(err)))
                }
                _ => Ok(done_now(
                    OperationKind::CreateMachine,
                    req.name,
                    OperationOutput::Machine(Self::machine_view(m)),
                )),
            };
        }
        self.quota_check(&mut st, 1)?;
        let op_id = st.start_op(OperationKind::CreateMachine, &req.name, now, ms(self.config.create_latency));
        let provisioning_fails =
            req.provider_spec.get("simulateFailure").and_then(Value::as_str) == Some("provisioning");
        let failure = fail.or_else(|| {
            provisioning_fails.then(|| {
                CloudError::new(
                    tonic::Code::Internal,
                    reason::CLOUD_OPERATION_FAILED,
                    "provisioning failed: the image did not boot",
                )
            })
        });
        if let Some(op) = st.ops.get_mut(&op_id) {
            op.error = failure;
        }
        let ip = st.next_ip();
        let zone = req.provider_spec.get("zone").and_then(Value::as_str).unwrap_or("zone-a").to_string();
        let boot_data = boot_data(&req.secrets, &req.provider_spec);
        st.machines.insert(
            req.name.clone(),
            FMachine {
                name: req.name.clone(),
                id: format!("vm-{}", uuid::Uuid::new_v4().simple()),
                zone,
                spec: req.provider_spec,
                hash,
                labels: req.labels,
                state: MState::Creating,
                created_ms: now,
                ip,
                op: Some(op_id.clone()),
                pending_spec: None,
                failure: None,
                kubelet_stopped: false,
                boot_id: new_boot_id(),
                boot_data,
                kubelet: None,
            },
        );
        st.counters.machines_created += 1;
        *st.times_created.entry(req.name.clone()).or_default() += 1;
        st.note_peak();
        self.save(&st)?;
        tracing::info!(machine = %req.name, operation = %op_id, "create started");
        Ok(Self::op_view(&st, &op_id))
    }

    async fn delete_machine(&self, ctx: &RequestContext, req: MachineRef) -> Result<Operation> {
        self.admit(ctx, &req.secrets, &req.name).await?;
        let now = now_ms();
        let mut st = self.cloud();
        let Some(m) = st.machines.get(&req.name) else {
            return Ok(done_now(OperationKind::DeleteMachine, req.name, OperationOutput::None));
        };
        if let (MState::Deleting, Some(op)) = (m.state, &m.op) {
            return Ok(Self::op_view(&st, op));
        }
        // A delete overrides a create or update in flight: that operation ends aborted.
        if let Some(previous) = m.op.clone() {
            if let Some(op) = st.ops.get_mut(&previous) {
                op.finished = true;
                op.done_ms = now;
                op.error = Some(CloudError::new(
                    tonic::Code::Aborted,
                    reason::OPERATION_CANCELLED,
                    "the machine was deleted before the operation finished",
                ));
            }
        }
        let op_id = st.start_op(OperationKind::DeleteMachine, &req.name, now, ms(self.config.delete_latency));
        if let Some(m) = st.machines.get_mut(&req.name) {
            m.state = MState::Deleting;
            m.op = Some(op_id.clone());
        }
        self.save(&st)?;
        tracing::info!(machine = %req.name, operation = %op_id, "delete started");
        Ok(Self::op_view(&st, &op_id))
    }

    async fn get_machine_status(&self, ctx: &RequestContext, req: MachineRef) -> Result<Machine> {
        self.admit(ctx, &req.secrets, &req.name).await?;
        let st = self.cloud();
        st.machines.get(&req.name).map(Self::machine_view).ok_or_else(|| machine_not_found(&req.name))
    }

    async fn list_machines(&self, ctx: &RequestContext, req: ListMachines) -> Result<Page<Machine>> {
        self.admit(ctx, &req.secrets, "").await?;
        let after = page_token(&req.page_token)?.map(str::to_string);
        let st = self.cloud();
        let start = match &after {
            Some(a) => std::ops::Bound::Excluded(a.clone()),
            None => std::ops::Bound::Unbounded,
        };
        let mut items: Vec<Machine> = st
            .machines
            .range((start, std::ops::Bound::Unbounded))
            .map(|(_, m)| m)
            .filter(|m| req.label_selector.iter().all(|(k, v)| m.labels.get(k) == Some(v)))
            .take(req.page_size + 1)
            .map(Self::machine_view)
            .collect();
        let mut next_page_token = String::new();
        if items.len() > req.page_size {
            items.truncate(req.page_size);
            next_page_token = items.last().map(|m| m.name.clone()).unwrap_or_default();
        }
        Ok(Page { items, next_page_token })
    }

    async fn validate_machine_class(
        &self,
        ctx: &RequestContext,
        req: driver_sdk::ValidateMachineClass,
    ) -> Result<Vec<String>> {
        self.admit(ctx, &req.secrets, "").await?;
        let mut warnings = Vec::new();
        if req.provider_spec.get("zone").is_none() {
            warnings.push("zone is not set; machines go to zone-a".to_string());
        }
        Ok(warnings)
    }

    async fn machine_capacity(
        &self,
        _ctx: &RequestContext,
        req: &driver_sdk::ValidateMachineClass,
    ) -> Result<std::collections::BTreeMap<String, String>> {
        // What its kubelets register (kubelets::node): the machine type's CPUs and memory.
        let machine_type = req.provider_spec.get("machineType").and_then(|t| t.as_str()).unwrap_or("small");
        let (cpu, memory) = kubelets::capacity(machine_type);
        Ok([("cpu", cpu), ("memory", memory), ("pods", kubelets::MAX_PODS)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect())
    }

    async fn can_update_machine(&self, _ctx: &RequestContext, req: CanUpdateMachine) -> Result<UpdatePlan> {
        Ok(plan_update(&req.current, &req.desired, req.changed_paths))
    }

    async fn update_machine(&self, ctx: &RequestContext, req: UpdateMachine) -> Result<Operation> {
        let fail = self.admit_in(ctx, &req.secrets, &req.name, Some(Placement::of(&req.provider_spec))).await?;
        let hash = convert::spec_hash(&req.provider_spec);
        let now = now_ms();
        let mut st = self.cloud();
        let m = st.machines.get(&req.name).ok_or_else(|| machine_not_found(&req.name))?;
        if m.hash == hash && m.pending_spec.is_none() {
            return Ok(done_now(
                OperationKind::UpdateMachine,
                req.name,
                OperationOutput::Machine(Self::machine_view(m)),
            ));
        }
        if let Some(op) = &m.op {
            if m.state == MState::Updating && m.pending_spec.as_ref().map(convert::spec_hash) == Some(hash.clone()) {
                return Ok(Self::op_view(&st, op));
            }
            return Err(DriverError::operation_pending(format!("machine {} has an operation in flight", req.name)));
        }
        let changed = convert::changed_paths(&m.spec, &req.provider_spec);
        let plan = plan_update(&m.spec, &req.provider_spec, changed);
        if !plan.replace_paths.is_empty() {
            let mut e = DriverError::new(
                tonic::Code::FailedPrecondition,
                "UPDATE_NEEDS_REPLACEMENT",
                format!("these changes cannot be applied in place: {}", plan.replace_paths.join(", ")),
            );
            for p in &plan.replace_paths {
                e = e.with_violation(format!("provider_spec{}", p.replace('/', ".")), "cannot change in place");
            }
            return Err(e);
        }
        let op_id = st.start_op(OperationKind::UpdateMachine, &req.name, now, ms(self.config.update_latency));
        if let Some(op) = st.ops.get_mut(&op_id) {
            op.error = fail;
        }
        if let Some(m) = st.machines.get_mut(&req.name) {
            m.state = MState::Updating;
            m.op = Some(op_id.clone());
            m.pending_spec = Some(req.provider_spec);
        }
        self.save(&st)?;
        Ok(Self::op_view(&st, &op_id))
    }

    async fn apply_pool(&self, ctx: &RequestContext, req: ApplyPool) -> Result<Operation> {
        let fail = self.admit_in(ctx, &req.secrets, &req.name, Some(Placement::of(&req.provider_spec))).await?;
        let hash = convert::spec_hash(&req.provider_spec);
        let now = now_ms();
        let mut st = self.cloud();
        if let Some(p) = st.pools.get(&req.name) {
            if let Some(op) = &p.op {
                let same = st.ops.get(op).is_some_and(|o| {
                    o.kind == OperationKind::ApplyPool && o.spec_hash == hash && o.capacity == req.capacity
                });
                if same {
                    return Ok(Self::op_view(&st, op));
                }
                return Err(DriverError::operation_pending(format!("pool {} has an operation in flight", req.name)));
            }
            if p.model == hash && p.capacity == req.capacity && p.labels == req.labels {
                return Ok(done_now(OperationKind::ApplyPool, req.name, OperationOutput::Pool(Self::pool_view(p))));
            }
        }
        let existing = st.pools.get(&req.name).map_or(0, |p| p.instances.len());
        if req.capacity as usize > existing {
            self.quota_check(&mut st, req.capacity as usize - existing)?;
        }
        let zone = req.provider_spec.get("zone").and_then(Value::as_str).unwrap_or("zone-a").to_string();
        let op_id = st.start_op(OperationKind::ApplyPool, &req.name, now, ms(self.config.pool_latency));
        let ips: Vec<String> = (existing..req.capacity as usize).map(|_| st.next_ip()).collect();
        let pool = st.pools.entry(req.name.clone()).or_insert_with(|| FPool {
            name: req.name.clone(),
            id: format!("pool-{}", uuid::Uuid::new_v4().simple()),
            zone,
            spec: Value::Null,
            model: String::new(),
            capacity: 0,
            labels: BTreeMap::new(),
            state: "Creating".into(),
            next_instance: 0,
            instances: BTreeMap::new(),
            op: None,
            boot_data: None,
        });
        if pool.state != "Creating" {
            pool.state = "Updating".into();
        }
        pool.boot_data = boot_data(&req.secrets, &req.provider_spec);
        pool.spec = req.provider_spec;
        pool.model = hash.clone();
        pool.labels = req.labels;
        pool.capacity = req.capacity;
        pool.op = Some(op_id.clone());
        let mut created = 0;
        for ip in ips {
            let id = pool.next_instance;
            pool.next_instance += 1;
            pool.instances.insert(
                id,
                FInstance { id, model: hash.clone(), state: "Creating".into(), created_ms: now, ip, kubelet: None },
            );
            created += 1;
        }
        // Scale in: the newest instances go first.
        let live: Vec<u32> = pool.instances.values().filter(|i| i.state != "Deleting").map(|i| i.id).collect();
        for id in live.iter().rev().take(live.len().saturating_sub(req.capacity as usize)) {
            if let Some(i) = pool.instances.get_mut(id) {
                i.state = "Deleting".into();
            }
        }
        st.counters.instances_created += created;
        if let Some(op) = st.ops.get_mut(&op_id) {
            op.error = fail;
            op.spec_hash = hash;
            op.capacity = req.capacity;
        }
        self.save(&st)?;
        Ok(Self::op_view(&st, &op_id))
    }

    async fn get_pool(&self, ctx: &RequestContext, req: PoolRef) -> Result<Pool> {
        self.admit(ctx, &req.secrets, &req.name).await?;
        let st = self.cloud();
        st.pools.get(&req.name).map(Self::pool_view).ok_or_else(|| pool_not_found(&req.name))
    }

    async fn list_pool_instances(&self, ctx: &RequestContext, req: ListPoolInstances) -> Result<Page<PoolInstance>> {
        self.admit(ctx, &req.pool.secrets, &req.pool.name).await?;
        let after = match page_token(&req.page_token)? {
            None => None,
            Some(t) => Some(t.parse::<u32>().map_err(|_| {
                DriverError::invalid_argument(reason::FIELD_INVALID, "page_token was not issued by this driver")
                    .with_violation("page_token", "unknown token")
            })?),
        };
        let st = self.cloud();
        let p = st.pools.get(&req.pool.name).ok_or_else(|| pool_not_found(&req.pool.name))?;
        let start = after.map_or(std::ops::Bound::Unbounded, std::ops::Bound::Excluded);
        let mut items: Vec<PoolInstance> = p
            .instances
            .range((start, std::ops::Bound::Unbounded))
            .take(req.page_size + 1)
            .map(|(_, i)| Self::instance_view(p, i))
            .collect();
        let mut next_page_token = String::new();
        if items.len() > req.page_size {
            items.truncate(req.page_size);
            next_page_token = items.last().map(|i| i.instance_id.clone()).unwrap_or_default();
        }
        Ok(Page { items, next_page_token })
    }

    async fn delete_pool_instances(&self, ctx: &RequestContext, req: PoolInstances) -> Result<Operation> {
        let fail = self.admit(ctx, &req.pool.secrets, &req.pool.name).await?;
        self.pool_instances_op(req, OperationKind::DeletePoolInstances, fail)
    }

    async fn upgrade_pool_instances(&self, ctx: &RequestContext, req: PoolInstances) -> Result<Operation> {
        let fail = self.admit(ctx, &req.pool.secrets, &req.pool.name).await?;
        self.pool_instances_op(req, OperationKind::UpgradePoolInstances, fail)
    }

    async fn delete_pool(&self, ctx: &RequestContext, req: PoolRef) -> Result<Operation> {
        self.admit(ctx, &req.secrets, &req.name).await?;
        let now = now_ms();
        let mut st = self.cloud();
        let Some(p) = st.pools.get(&req.name) else {
            return Ok(done_now(OperationKind::DeletePool, req.name, OperationOutput::None));
        };
        if let Some(op) = &p.op {
            if st.ops.get(op).is_some_and(|o| o.kind == OperationKind::DeletePool) {
                return Ok(Self::op_view(&st, op));
            }
        }
        let op_id = st.start_op(OperationKind::DeletePool, &req.name, now, ms(self.config.pool_latency));
        let p = Self::pool_mut(&mut st, &req.name)?;
        p.state = "Deleting".into();
        p.op = Some(op_id.clone());
        for i in p.instances.values_mut() {
            i.state = "Deleting".into();
        }
        self.save(&st)?;
        Ok(Self::op_view(&st, &op_id))
    }

    async fn get_operation(
        &self,
        ctx: &RequestContext,
        handle: OperationHandle,
        secrets: Secrets,
    ) -> Result<Operation> {
        self.admit(ctx, &secrets, &handle.target).await?;
        let t: TokenState = handle.state_as()?;
        let st = self.cloud();
        Ok(match &t.op {
            Some(op) if st.ops.contains_key(op) => Self::op_view(&st, op),
            Some(op) => {
                // The cloud lost the operation (no state file, or it expired): say so, for the
                // operation the token names.
                let err = DriverError::not_found(
                    reason::OPERATION_NOT_FOUND,
                    format!("the fake cloud has no operation {op}: it expired or the cloud lost its state"),
                );
                handle.resume().finish(Err(err))
            }
            None => Self::current_view(&st, &handle),
        })
    }

    async fn cancel_operation(
        &self,
        ctx: &RequestContext,
        handle: OperationHandle,
        secrets: Secrets,
    ) -> Result<Operation> {
        self.admit(ctx, &secrets, &handle.target).await?;
        let t: TokenState = handle.state_as()?;
        let now = now_ms();
        let mut st = self.cloud();
        let Some(op_id) = t.op else { return Ok(Self::current_view(&st, &handle)) };
        let cancellable = st.ops.get(&op_id).is_some_and(|o| !o.finished && o.kind == OperationKind::CreateMachine);
        if cancellable {
            // Cancelling a create removes the half-built machine, as a cloud would roll it back.
            if let Some(op) = st.ops.get_mut(&op_id) {
                op.finished = true;
                op.done_ms = now;
                op.error = Some(CloudError::new(
                    tonic::Code::Cancelled,
                    reason::OPERATION_CANCELLED,
                    "the operation was cancelled",
                ));
            }
            if st.machines.get(&handle.target).is_some_and(|m| m.op.as_deref() == Some(op_id.as_str())) {
                st.machines.remove(&handle.target);
                st.counters.machines_deleted += 1;
            }
            self.save(&st)?;
        }
        Ok(Self::op_view(&st, &op_id))
    }
}

impl FakeDriver {
    fn pool_instances_op(
        &self,
        req: PoolInstances,
        kind: OperationKind,
        fail: Option<CloudError>,
    ) -> Result<Operation> {
        let now = now_ms();
        let mut st = self.cloud();
        let p = st.pools.get(&req.pool.name).ok_or_else(|| pool_not_found(&req.pool.name))?;
        if let Some(op) = &p.op {
            let same = st.ops.get(op).is_some_and(|o| {
                o.kind == kind && o.instances.iter().map(u32::to_string).collect::<Vec<_>>() == req.instance_ids
            });
            if same {
                return Ok(Self::op_view(&st, op));
            }
            return Err(DriverError::operation_pending(format!("pool {} has an operation in flight", req.pool.name)));
        }
        let mut ids = Vec::new();
        for (i, id) in req.instance_ids.iter().enumerate() {
            let n = id.parse::<u32>().map_err(|_| {
                DriverError::invalid_argument(
                    reason::FIELD_INVALID,
                    format!("instance ID {id:?} is not an instance of this pool"),
                )
                .with_violation(format!("instance_ids[{i}]"), "not an instance ID of this driver")
            })?;
            if p.instances.contains_key(&n) {
                ids.push(n);
            }
        }
        if ids.is_empty() {
            let pool = Self::pool_view(p);
            return Ok(done_now(kind, req.pool.name, OperationOutput::Pool(pool)));
        }
        let op_id = st.start_op(kind, &req.pool.name, now, ms(self.config.pool_latency));
        let p = Self::pool_mut(&mut st, &req.pool.name)?;
        p.op = Some(op_id.clone());
        p.state = "Updating".into();
        for id in &ids {
            if let Some(i) = p.instances.get_mut(id) {
                i.state = if kind == OperationKind::DeletePoolInstances { "Deleting" } else { "Updating" }.into();
            }
        }
        if kind == OperationKind::DeletePoolInstances {
            p.capacity = p.capacity.saturating_sub(ids.len() as u32);
        }
        if let Some(op) = st.ops.get_mut(&op_id) {
            op.instances = ids;
            op.error = fail;
        }
        self.save(&st)?;
        Ok(Self::op_view(&st, &op_id))
    }
}

/// The provider ID the driver reports for a machine.
fn machine_provider_id(m: &FMachine) -> String {
    format!("fake:///{}/{}", m.zone, m.id)
}

/// A machine as its kubelet sees it.
fn machine_vm(m: &FMachine) -> kubelets::Vm {
    kubelets::Vm {
        hostname: m.name.clone(),
        provider_id: machine_provider_id(m),
        ip: m.ip.clone(),
        machine_type: machine_type(&m.spec),
        zone: m.zone.clone(),
        booted: matches!(m.state, MState::Running | MState::Updating),
        kubelet: kubelets::KubeletMode::of(&m.spec),
        stopped: m.kubelet_stopped,
        boot_id: if m.boot_id.is_empty() { m.id.clone() } else { m.boot_id.clone() },
    }
}

/// The secret a machine's rendered boot data comes in (the controller's, from its class's
/// template); it wins over the provider spec's `userData`.
pub const USER_DATA_SECRET: &str = "userData";

/// A VM's boot data: the secret [`USER_DATA_SECRET`], else the provider spec's `userData`.
fn boot_data(secrets: &Secrets, spec: &Value) -> Option<String> {
    secrets.get(USER_DATA_SECRET).or_else(|| spec.get("userData").and_then(Value::as_str)).map(String::from)
}

/// The provider spec's machine type (`small` when absent).
pub(crate) fn machine_type(spec: &Value) -> String {
    spec.get("machineType").and_then(Value::as_str).unwrap_or("small").to_string()
}

/// The provider ID the driver reports for a pool instance.
fn instance_provider_id(p: &FPool, i: &FInstance) -> String {
    format!("fake:///{}/pools/{}/instances/{}", p.zone, p.id, i.id)
}

/// A pool instance's host name (its `Hostname` address, and its Node's name): `<pool>-<id>`, as
/// a scale set names its instances' computers after a prefix.
fn instance_hostname(p: &FPool, i: &FInstance) -> String {
    format!("{}-{}", p.name, i.id)
}

fn inspect_not_found(name: &str) -> tonic::Status {
    tonic::Status::not_found(format!("machine {name} does not exist"))
}

/// Machine type, tags, disk growth and the test knob `inPlaceDisruption` apply in place;
/// everything else needs a new machine. What the in-place changes disrupt is what the desired
/// spec's `inPlaceDisruption` says ([`in_place_disruption`]), so that tests choose.
fn plan_update(current: &Value, desired: &Value, changed_paths: Vec<String>) -> UpdatePlan {
    let mut plan = UpdatePlan { disruption: in_place_disruption(desired), ..UpdatePlan::default() };
    for path in changed_paths {
        let disk = |v: &Value| v.get("diskGiB").and_then(Value::as_i64);
        let in_place = path == "/machineType"
            || path == "/tags"
            || path.starts_with("/tags/")
            || path == "/inPlaceDisruption"
            || (path == "/diskGiB" && disk(desired) >= disk(current));
        if in_place {
            plan.in_place_paths.push(path);
        } else {
            plan.replace_paths.push(path);
        }
    }
    plan
}

/// The provider spec field `inPlaceDisruption` (a test aid): what `CanUpdateMachine` answers for
/// an in-place update to `spec`. Absent: [`InPlaceDisruption::None`] (the fake's in-place
/// changes restart nothing); `Unset`: [`InPlaceDisruption::Unspecified`], the wire field left
/// unset as by a driver older than it. The schema refuses other values.
pub fn in_place_disruption(spec: &Value) -> InPlaceDisruption {
    match spec.get("inPlaceDisruption").and_then(Value::as_str) {
        Some("Drain") => InPlaceDisruption::Drain,
        Some("Reboot") => InPlaceDisruption::Reboot,
        Some("Unset") => InPlaceDisruption::Unspecified,
        _ => InPlaceDisruption::None,
    }
}

/// Whether an in-place update to `spec` reboots the VM: when it says `Reboot`, or `Unset`
/// (which the controller reads as a reboot, so the fake makes it one).
pub fn reboots(spec: &Value) -> bool {
    matches!(in_place_disruption(spec), InPlaceDisruption::Reboot | InPlaceDisruption::Unspecified)
}

/// A fresh boot ID (a kubelet reads its own from `/proc/sys/kernel/random/boot_id`: a UUID).
pub(crate) fn new_boot_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// The boot ID after the reboot of the in-place update `op_id` (`op-<uuid>`): that UUID, so
/// each reboot has its own and applying the operation again gives the same.
pub(crate) fn boot_id_after(op_id: &str) -> String {
    let id = op_id.trim_start_matches("op-");
    uuid::Uuid::try_parse(id).map_or_else(|_| id.to_string(), |u| u.to_string())
}

/// Shares one driver between the protocol services and the inspection API.
pub fn shared(driver: FakeDriver) -> Arc<FakeDriver> {
    Arc::new(driver)
}

/// The fake cloud's word for an instance's provisioning state, in the protocol's vocabulary.
fn instance_state(provisioning: &str) -> InstanceState {
    match provisioning {
        "Succeeded" => InstanceState::Running,
        "Updating" => InstanceState::Updating,
        "Deleting" => InstanceState::Deleting,
        "Failed" => InstanceState::Failed,
        _ => InstanceState::Creating,
    }
}

#[cfg(test)]
mod tests;
