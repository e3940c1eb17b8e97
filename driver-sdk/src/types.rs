//! Plain Rust types a driver works with. The SDK converts them to and from the wire types.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use serde_json::Value;

use crate::error::{DriverError, Result};
pub use crate::secrets::Secrets;

/// Labels (owner tags), sorted by key.
pub type Labels = BTreeMap<String, String>;

/// What `GetDriverInfo` reports.
#[derive(Debug, Clone)]
pub struct DriverInfo {
    /// DNS-style name (≤ 63 characters); also the ErrorInfo domain.
    pub name: String,
    /// The driver's version.
    pub vendor_version: String,
    /// JSON Schema (draft 2020-12) of the provider spec; `examples` should hold at least one
    /// valid spec. Compiled when the server starts, which refuses a schema that would be weaker
    /// than it reads, e.g. one with an unknown keyword ([`crate::schema`]).
    pub provider_spec_schema: Value,
}

/// Optional RPC groups a driver implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Capability {
    /// CreateMachine, DeleteMachine, GetMachineStatus, ListMachines.
    Machines,
    /// ValidateMachineClass.
    ValidateMachineClass,
    /// CanUpdateMachine, UpdateMachine.
    InPlaceUpdate,
    /// The pool RPCs.
    Pools,
    /// CancelOperation really cancels.
    CancelOperation,
    /// WatchEvents, AckEvents: the driver reports the cloud's own moves ([`crate::Driver::watch_events`]).
    Events,
}

/// What `Probe` reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// false while starting.
    pub ready: bool,
    /// Detail for humans.
    pub message: String,
}

impl Probe {
    /// Ready to serve, with no message.
    pub fn ready() -> Self {
        Self { ready: true, message: String::new() }
    }

    /// Still starting, with the reason.
    pub fn starting(message: impl Into<String>) -> Self {
        Self { ready: false, message: message.into() }
    }
}

/// `CreateMachine` arguments, validated by the SDK (name well-formed, spec matches the schema).
#[derive(Debug, Clone)]
pub struct CreateMachine {
    /// The idempotency key.
    pub name: String,
    /// The provider spec (a JSON object).
    pub provider_spec: Value,
    /// The caller's credentials (the controller sends the MachineClass's Secret); may be empty.
    /// Errors the SDK encodes have their values redacted.
    pub secrets: Secrets,
    /// Owner labels, to apply as cloud tags.
    pub labels: Labels,
    /// The caller's identity of this incarnation (may be empty).
    pub uid: String,
}

/// Identifies one machine for Delete / GetStatus.
#[derive(Debug, Clone)]
pub struct MachineRef {
    /// The machine name.
    pub name: String,
    /// The provider ID, when the caller knows it.
    pub provider_id: Option<String>,
    /// The provider spec, when the caller sent it (`Value::Null` otherwise).
    pub provider_spec: Value,
    /// The caller's credentials (the controller sends the MachineClass's Secret); may be empty.
    /// Errors the SDK encodes have their values redacted.
    pub secrets: Secrets,
}

/// `ListMachines` arguments.
#[derive(Debug, Clone)]
pub struct ListMachines {
    /// Machines must carry all of these labels.
    pub label_selector: Labels,
    /// Page size (already defaulted to 100 and capped at 1000 by the SDK).
    pub page_size: usize,
    /// Opaque token from the previous page; empty for the first.
    pub page_token: String,
    /// The provider spec, when sent.
    pub provider_spec: Value,
    /// The caller's credentials (the controller sends the MachineClass's Secret); may be empty.
    /// Errors the SDK encodes have their values redacted.
    pub secrets: Secrets,
}

/// One page of machines.
#[derive(Debug, Clone, Default)]
pub struct Page<T> {
    /// At most the request's page size.
    pub items: Vec<T>,
    /// Empty on the last page.
    pub next_page_token: String,
}

/// `ValidateMachineClass` arguments.
#[derive(Debug, Clone)]
pub struct ValidateMachineClass {
    /// The provider spec, already checked against the schema.
    pub provider_spec: Value,
    /// The caller's credentials (the controller sends the MachineClass's Secret); may be empty.
    /// Errors the SDK encodes have their values redacted.
    pub secrets: Secrets,
}

/// `CanUpdateMachine` arguments: the SDK has already computed what changed.
#[derive(Debug, Clone)]
pub struct CanUpdateMachine {
    /// The machine.
    pub name: String,
    /// The spec it runs.
    pub current: Value,
    /// The spec wanted.
    pub desired: Value,
    /// JSON pointers of every leaf that differs between the two.
    pub changed_paths: Vec<String>,
    /// The caller's credentials (the controller sends the MachineClass's Secret); may be empty.
    /// Errors the SDK encodes have their values redacted.
    pub secrets: Secrets,
}

/// The driver's answer to `CanUpdateMachine`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UpdatePlan {
    /// Changes the driver applies in place.
    pub in_place_paths: Vec<String>,
    /// Changes that need a replacement machine.
    pub replace_paths: Vec<String>,
    /// What applying `in_place_paths` does to the running machine. Defaults to
    /// [`InPlaceDisruption::Reboot`], the safe answer: the controller drains the node first.
    pub disruption: InPlaceDisruption,
}

/// What an in-place update does to a running machine (`CanUpdateMachineResponse.disruption`):
/// whether the controller must cordon and drain its node first, and wait for it to come back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum InPlaceDisruption {
    /// Nothing restarts (tags, labels, metadata): no pod is touched.
    None,
    /// The machine keeps running but its workloads must move off first: drain, update, uncordon.
    Drain,
    /// The machine stops or restarts (image, kernel, size): drain, update, wait for the node to
    /// be Ready again with a new boot ID, uncordon. What an unset answer means.
    #[default]
    Reboot,
    /// Says nothing (`IN_PLACE_DISRUPTION_UNSPECIFIED`): what a driver older than the field
    /// sends, and the controller treats it as [`Reboot`](Self::Reboot). Not for new drivers
    /// (the conformance suite warns about it); it exists so that a test driver can play an old
    /// one. [`from_pb`](Self::from_pb) never returns it.
    Unspecified,
}

impl InPlaceDisruption {
    /// Reads the wire value as the controller must act on it: unset (or a value newer than this
    /// SDK) is `Reboot`, so the result is never [`Unspecified`](Self::Unspecified).
    pub fn from_pb(value: i32) -> Self {
        match crate::proto::InPlaceDisruption::try_from(value) {
            Ok(crate::proto::InPlaceDisruption::None) => Self::None,
            Ok(crate::proto::InPlaceDisruption::Drain) => Self::Drain,
            _ => Self::Reboot,
        }
    }

    /// The wire value.
    pub fn to_pb(self) -> crate::proto::InPlaceDisruption {
        match self {
            Self::None => crate::proto::InPlaceDisruption::None,
            Self::Drain => crate::proto::InPlaceDisruption::Drain,
            Self::Reboot => crate::proto::InPlaceDisruption::Reboot,
            Self::Unspecified => crate::proto::InPlaceDisruption::Unspecified,
        }
    }
}

/// `UpdateMachine` arguments.
#[derive(Debug, Clone)]
pub struct UpdateMachine {
    /// The machine.
    pub name: String,
    /// The desired spec.
    pub provider_spec: Value,
    /// The caller's credentials (the controller sends the MachineClass's Secret); may be empty.
    /// Errors the SDK encodes have their values redacted.
    pub secrets: Secrets,
}

/// State of a machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum MachineState {
    /// Accepted, not started.
    Pending,
    /// Being created.
    Creating,
    /// Up.
    Running,
    /// Being updated in place.
    Updating,
    /// Exists but does not run (the controller counts it unhealthy).
    Stopped,
    /// Being deleted.
    Deleting,
    /// The cloud gave up on it; `cloud_error` says why.
    Failed,
    /// The driver cannot map the cloud's state to another.
    Unknown,
}

/// A network address (Kubernetes NodeAddressType in `kind`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Address {
    /// InternalIP, ExternalIP, InternalDNS, ExternalDNS or Hostname.
    pub kind: String,
    /// An IP address or a DNS name, per `kind`.
    pub address: String,
}

/// State of one sub-resource (VM, NIC, disk, ...).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ResourceStatus {
    /// e.g. "vm", "nic", "disk".
    pub kind: String,
    /// The cloud's ID.
    pub id: String,
    /// The cloud's state.
    pub state: String,
    /// The cloud's explanation of `state`, for a person (may be empty).
    pub message: String,
}

/// A machine as the cloud sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Machine {
    /// The machine name.
    pub name: String,
    /// The cloud's ID in the form of a Node's `spec.providerID` (the fake driver's
    /// `fake:///<zone>/<vm-id>`): the controller finds the machine's Node by it.
    pub provider_id: String,
    /// Where it is in its life, mapped from the cloud's own states.
    pub state: MachineState,
    /// Known so far; a creating machine may have none yet.
    pub addresses: Vec<Address>,
    /// Labels (cloud tags).
    pub labels: Labels,
    /// Sub-resources.
    pub resources: Vec<ResourceStatus>,
    /// The cloud's last error for this machine: (code, reason, message).
    pub cloud_error: Option<(tonic::Code, String, String)>,
    /// When it was created.
    pub create_time: Option<SystemTime>,
    /// Hash of the spec it runs.
    pub spec_hash: String,
}

/// `ApplyPool` arguments.
#[derive(Debug, Clone)]
pub struct ApplyPool {
    /// The pool name.
    pub name: String,
    /// The instance template.
    pub provider_spec: Value,
    /// Desired instance count.
    pub capacity: u32,
    /// Owner labels, to apply as cloud tags of the pool.
    pub labels: Labels,
    /// The caller's credentials (the controller sends the MachineClass's Secret); may be empty.
    /// Errors the SDK encodes have their values redacted.
    pub secrets: Secrets,
}

/// Identifies a pool.
#[derive(Debug, Clone)]
pub struct PoolRef {
    /// The pool name.
    pub name: String,
    /// The provider spec, when sent.
    pub provider_spec: Value,
    /// The caller's credentials (the controller sends the MachineClass's Secret); may be empty.
    /// Errors the SDK encodes have their values redacted.
    pub secrets: Secrets,
}

/// `ListPoolInstances` arguments.
#[derive(Debug, Clone)]
pub struct ListPoolInstances {
    /// Which pool, with the spec and credentials the call carried.
    pub pool: PoolRef,
    /// Page size (defaulted and capped by the SDK).
    pub page_size: usize,
    /// From the previous page.
    pub page_token: String,
}

/// `DeletePoolInstances` / `UpgradePoolInstances` arguments.
#[derive(Debug, Clone)]
pub struct PoolInstances {
    /// Which pool, with the spec and credentials the call carried.
    pub pool: PoolRef,
    /// Instance IDs (at least one).
    pub instance_ids: Vec<String>,
}

/// A pool as the cloud sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Pool {
    /// The pool name.
    pub name: String,
    /// The cloud's ID of the pool itself (instances have their own).
    pub provider_id: String,
    /// Current capacity.
    pub capacity: u32,
    /// Identifies the latest model.
    pub model_version: String,
    /// The cloud's own word for the pool's provisioning state, for display.
    pub provisioning_state: String,
    /// The pool's cloud tags.
    pub labels: Labels,
}

/// Power state of a pool instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[allow(missing_docs)]
pub enum PowerState {
    Unknown,
    Starting,
    Running,
    Stopping,
    Stopped,
    Deallocating,
    Deallocated,
}

/// Lifecycle state of a pool instance, in the protocol's vocabulary (`InstanceState`). Every
/// pool driver maps its cloud's states to it; whether the instance is powered on is
/// [`PowerState`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum InstanceState {
    /// Being created; also any cloud state the driver cannot map.
    Creating,
    /// Provisioned: the cloud finished creating or updating it.
    Running,
    /// Being moved to the pool's latest model (or otherwise changed).
    Updating,
    /// Being deleted.
    Deleting,
    /// Provisioning failed.
    Failed,
}

/// One instance of a pool.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolInstance {
    /// Pool-scoped instance ID.
    pub instance_id: String,
    /// Name (e.g. computer name).
    pub name: String,
    /// The instance's ID in the form of a Node's `spec.providerID`: the controller finds the
    /// instance's Node by it.
    pub provider_id: String,
    /// Lifecycle state (what callers decide on).
    pub state: InstanceState,
    /// The cloud's own word for the provisioning state, for display (sent as the deprecated
    /// `provisioning_state`, which callers older than `state` read).
    pub provisioning_state: String,
    /// Whether it is powered on, apart from `state`.
    pub power_state: PowerState,
    /// Whether it runs the pool's latest model.
    pub latest_model_applied: bool,
    /// Known so far; a creating instance may have none yet.
    pub addresses: Vec<Address>,
    /// When it was created.
    pub create_time: Option<SystemTime>,
}

pub use driver_sdk_core::OperationKind;

/// What a finished operation produced.
#[derive(Debug, Clone, PartialEq)]
pub enum OperationOutput {
    /// Nothing (deletes).
    None,
    /// The machine as created or updated (CreateMachine, UpdateMachine).
    Machine(Machine),
    /// The pool as it is afterwards (pool operations).
    Pool(Pool),
}

/// The `poll_after` of a running operation whose driver sets none ([`Operation::running`]), and
/// what [`OperationExt::poll_after`](crate::OperationExt::poll_after) assumes when an operation
/// carries none: soon enough for a fast cloud, one cheap `GetOperation` a second for a slow one.
pub const DEFAULT_POLL_AFTER: Duration = Duration::from_secs(1);

/// The protocol version this SDK speaks.
pub const PROTOCOL_VERSION: &str = "v1";
/// Page size when the caller sends 0.
pub const DEFAULT_PAGE_SIZE: usize = 100;
/// Largest page size honoured.
pub const MAX_PAGE_SIZE: usize = 1000;
/// The metadata key carrying the request ID (sent by [`DriverClient`](crate::DriverClient),
/// read or generated and echoed by the server).
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// The state of a long-running operation, as a driver reports it.
///
/// `state` is the driver's own resume data (any JSON): the SDK seals it into the operation
/// token, and hands it back, verified, to [`crate::Driver::get_operation`]. Keep in it everything
/// needed to poll the cloud again after a restart.
#[derive(Debug)]
pub struct Operation {
    /// Unique name, for logs.
    pub name: String,
    /// The RPC that started it; sealed into the token and handed back as
    /// [`OperationHandle::kind`].
    pub kind: OperationKind,
    /// Machine or pool name.
    pub target: String,
    /// `None` while running; the outcome once done.
    pub outcome: Option<Result<OperationOutput>>,
    /// 0..=100.
    pub progress_percent: u8,
    /// When to poll next ([`DEFAULT_POLL_AFTER`] unless the driver says).
    pub poll_after: Duration,
    /// When it started.
    pub start_time: Option<SystemTime>,
    /// When it ended.
    pub end_time: Option<SystemTime>,
    /// The cloud's request IDs.
    pub cloud_request_ids: Vec<String>,
    /// Resume data sealed into the token.
    pub state: Value,
}

impl Operation {
    /// A running operation that resumes from `state`.
    pub fn running(kind: OperationKind, target: impl Into<String>, state: Value) -> Self {
        let target = target.into();
        Self {
            name: format!("{}-{}", kind_slug(kind), uuid::Uuid::new_v4()),
            kind,
            target,
            outcome: None,
            progress_percent: 0,
            poll_after: DEFAULT_POLL_AFTER,
            start_time: Some(SystemTime::now()),
            end_time: None,
            cloud_request_ids: Vec::new(),
            state,
        }
    }

    /// An operation that finished successfully.
    pub fn succeeded(kind: OperationKind, target: impl Into<String>, output: OperationOutput) -> Self {
        Self::running(kind, target, Value::Null).finish(Ok(output))
    }

    /// An operation that finished with an error.
    pub fn failed(kind: OperationKind, target: impl Into<String>, error: DriverError) -> Self {
        Self::running(kind, target, Value::Null).finish(Err(error))
    }

    /// Marks the operation done with `outcome`.
    #[must_use]
    pub fn finish(mut self, outcome: Result<OperationOutput>) -> Self {
        self.outcome = Some(outcome);
        self.progress_percent = 100;
        self.end_time.get_or_insert_with(SystemTime::now);
        self
    }

    /// Sets the operation's name (e.g. the cloud's operation ID).
    #[must_use]
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Sets progress.
    #[must_use]
    pub fn with_progress(mut self, percent: u8) -> Self {
        self.progress_percent = percent.min(100);
        self
    }

    /// Sets when to poll next.
    #[must_use]
    pub fn with_poll_after(mut self, delay: Duration) -> Self {
        self.poll_after = delay;
        self
    }

    /// Sets the start time.
    #[must_use]
    pub fn started_at(mut self, time: SystemTime) -> Self {
        self.start_time = Some(time);
        self
    }

    /// Records a cloud request ID.
    #[must_use]
    pub fn with_cloud_request_id(mut self, id: impl Into<String>) -> Self {
        self.cloud_request_ids.push(id.into());
        self
    }

    /// Whether the operation has finished.
    pub fn is_done(&self) -> bool {
        self.outcome.is_some()
    }
}

/// An operation handed back to the driver from a verified token.
#[derive(Debug, Clone, PartialEq)]
pub struct OperationHandle {
    /// The operation's name.
    pub name: String,
    /// As the driver set it in [`Operation::kind`].
    pub kind: OperationKind,
    /// The machine or pool name, as in [`Operation::target`].
    pub target: String,
    /// When it started.
    pub start_time: Option<SystemTime>,
    /// The resume data the driver put in [`Operation::state`].
    pub state: Value,
}

impl OperationHandle {
    /// A running operation continuing this handle (same name, kind, target, start, state).
    pub fn resume(&self) -> Operation {
        let mut op = Operation::running(self.kind, self.target.clone(), self.state.clone()).named(self.name.clone());
        op.start_time = self.start_time;
        op
    }

    /// The resume data decoded into the driver's own type.
    ///
    /// # Errors
    /// OPERATION_TOKEN_INVALID when it does not decode (a token from another driver version).
    pub fn state_as<T: serde::de::DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_value(self.state.clone())
            .map_err(|e| DriverError::token_invalid("operation token state does not match this driver").with_source(e))
    }
}

pub(crate) fn kind_slug(kind: OperationKind) -> &'static str {
    match kind {
        OperationKind::CreateMachine => "create",
        OperationKind::DeleteMachine => "delete",
        OperationKind::UpdateMachine => "update",
        OperationKind::ApplyPool => "apply-pool",
        OperationKind::DeletePoolInstances => "delete-instances",
        OperationKind::UpgradePoolInstances => "upgrade-instances",
        OperationKind::DeletePool => "delete-pool",
    }
}

#[cfg(test)]
mod tests {
    use super::InPlaceDisruption as D;
    use crate::proto::InPlaceDisruption as Pb;

    #[test]
    fn disruption_round_trips_and_unset_reads_as_reboot() {
        for d in [D::None, D::Drain, D::Reboot] {
            assert_eq!(D::from_pb(d.to_pb() as i32), d);
        }
        assert_eq!(D::default(), D::Reboot);
        // An old driver (or one playing it) says nothing: the reader acts as for a reboot.
        assert_eq!(D::Unspecified.to_pb(), Pb::Unspecified);
        assert_eq!(D::from_pb(Pb::Unspecified as i32), D::Reboot);
        assert_eq!(D::from_pb(99), D::Reboot, "a value newer than this SDK");
    }
}

// ------------------------------------------------------------------------------------ events

/// Something the cloud did, or will do, to one machine on its own: what
/// [`crate::Driver::watch_events`] yields and `WatchEvents` streams.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MachineEvent {
    /// Unique per event and stable across deliveries: the cloud's own ID where it has one. The
    /// SDK delivers each ID once until it is acknowledged, and not again for a while after.
    pub event_id: String,
    /// The machine's name (as in CreateMachine), or the pool instance's name.
    pub machine_name: String,
    /// The machine's provider ID.
    pub provider_id: String,
    /// The pool, for an instance of a pool; empty for a machine.
    pub pool_name: String,
    /// What happened.
    pub kind: EventKind,
    /// When the cloud will act; `None` when it gives no deadline or has acted already.
    pub not_before: Option<SystemTime>,
    /// When the driver or the cloud first saw it.
    pub observed_at: SystemTime,
    /// What the cloud will do at `not_before`.
    pub action: CloudAction,
    /// Where the machine runs.
    pub offering: Offering,
    /// Human-readable detail. Never a secret.
    pub message: String,
}

/// What a [`MachineEvent`] says happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum EventKind {
    /// A kind this side does not know (a newer peer's): recorded, acted on as nothing.
    Unspecified,
    /// Spot capacity is reclaimed at `not_before`.
    SpotInterruption,
    /// A higher risk of a spot interruption; no deadline.
    RebalanceRecommendation,
    /// A maintenance is scheduled for `not_before`.
    ScheduledMaintenance,
    /// Stopping, not asked by the caller.
    Stopping,
    /// Stopped or deallocated, not asked by the caller.
    Stopped,
    /// Gone, not deleted by the caller.
    Terminated,
    /// Hardware or reachability impaired.
    Impaired,
    /// The capacity reservation ends at `not_before`.
    CapacityReservationInterruption,
}

/// What the cloud will do to the machine at an event's `not_before`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum CloudAction {
    /// Not said.
    #[default]
    Unspecified,
    /// The VM is deleted.
    Terminate,
    /// The VM is stopped (or deallocated).
    Stop,
    /// The VM is hibernated.
    Hibernate,
    /// The VM is rebooted.
    Reboot,
}

/// Where a machine runs: zone, machine type and capacity type.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Offering {
    /// e.g. `us-east-1a`, `westeurope-1`.
    pub zone: String,
    /// e.g. `m5.large`, `Standard_D2s_v5`.
    pub machine_type: String,
    /// On-demand, spot or reserved.
    pub capacity_type: CapacityType,
}

/// How a machine's capacity is bought.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum CapacityType {
    /// Not said.
    #[default]
    Unspecified,
    /// Regular, on-demand capacity.
    OnDemand,
    /// Spot (AWS) or Spot priority (Azure): cheaper, reclaimed with a short notice.
    Spot,
    /// A capacity reservation.
    Reserved,
}

/// A gRPC code's name as the protocol spells it (`OK`, `NOT_FOUND`): metrics labels, and spans'
/// `rpc.response.status_code`.
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}
