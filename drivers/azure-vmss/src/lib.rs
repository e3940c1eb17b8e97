//! # azure-vmss-driver
//!
//! Azure Virtual Machine Scale Sets behind the `machinedriver.v1` protocol.
//!
//! **What it implements.** Machines (one VM per machine in a Flexible scale set, see
//! [`machines`] and [`vm`]), in-place updates of their size and tags, pools on Uniform scale sets
//! with a manual upgrade policy, and `ValidateMachineClass` (which also proves a class's own
//! credential). Subscription and resource group come from the provider spec, else the class
//! Secret's subscription and the sidecar's defaults; the Flexible scale set from the spec, else
//! `--scale-set`.
//!
//! The pool RPCs:
//!
//! | RPC | ARM call |
//! |---|---|
//! | `ApplyPool` | `GET` the scale set; when it already has the spec (tag `machinedriver.dev:spec-hash`), capacity and labels, report it (or its in-flight change) — else `PUT` it (`create_or_update`) |
//! | `GetPool` | `GET` the scale set |
//! | `ListPoolInstances` | `GET …/virtualMachines?$expand=instanceView`; ARM's absolute `nextLink` (plus an offset within ARM's page) is the page token |
//! | `DeletePoolInstances` | `POST …/delete {"instanceIds":[…]}` (instances already gone are dropped from the request) |
//! | `UpgradePoolInstances` | `POST …/manualupgrade {"instanceIds":[…]}` |
//! | `DeletePool` | `DELETE` the scale set (204 = already gone = a done operation) |
//!
//! **Events** ([`events`]): `WatchEvents` reports machine VMs stopped, deallocated or deleted
//! behind the driver's back (`STOPPED`, `TERMINATED`), from one VM listing per resource group
//! every `--event-poll-interval`; Spot VMs (`priority: Spot`, `evictionPolicy`, `maxPrice` in the
//! provider spec, see [`model`]) are reported with capacity type spot.
//!
//! **Operations.** A mutating RPC sends its ARM request exactly once and returns. The operation
//! token (sealed by the SDK) holds the protocol kind, the HTTP method, the `Azure-AsyncOperation`
//! URL, the `Location` URL, the original URL and the scale set's identity (subscription, resource
//! group, name). `GetOperation` is one authenticated `GET` of the async-operation URL (else the
//! Location URL, else the resource itself), plus, for a `PUT` that `Succeeded`, a final `GET` of
//! the scale set; `poll_after` comes from `Retry-After`. The driver keeps no operation table, so
//! a restarted sidecar resumes any operation from its token. A 4xx/5xx while polling means the
//! status read failed (the RPC fails, the operation goes on); a `Failed` or `Canceled` operation
//! ends with its ARM error code in ErrorInfo metadata `armErrorCode` (see [`errors`]).
//!
//! **Why raw requests instead of the SDK's operation builders.** `azure_mgmt_compute` 0.21's
//! builders must not be `.await`ed (their LRO loop re-sends the request and mis-reads provisioning
//! states), their errors drop the response headers we need, and they give no way to set a
//! per-call `x-ms-client-request-id`. So every ARM call goes through `azure_core`'s HTTP
//! transport with a bearer token from an `azure_identity` credential ([`arm`]); request and
//! response bodies are the typed models of `azure_mgmt_compute` (`VirtualMachineScaleSet`,
//! `VirtualMachineScaleSetVmListResult`, `VirtualMachineScaleSetVmInstanceRequiredIDs`, …).
//! Retries inside the driver are limited to one retry of a request that got no response;
//! throttling and server errors go back to the controller, which owns backoff.
//!
//! **Correlation.** The call's request ID (`x-request-id`) is sent as `x-ms-client-request-id`
//! on every ARM request, polls included. ARM's `x-ms-request-id` is returned as the operation's
//! and error's cloud request ID, `x-ms-correlation-request-id` as ErrorInfo metadata
//! `correlationRequestId`, and both are logged next to ours.
//!
//! **Credentials.** The sidecar's own ([`credential`]): `DefaultAzureCredential`, client
//! secret, workload identity (the projected token file is re-read on refresh), system-assigned
//! managed identity, and a fixed token for tests against the ARM emulator. Per MachineClass
//! ([`class_credential`]): a service principal or workload identity from the class's Secret,
//! used for every call of that class and cached per Secret content. The ARM endpoint and token
//! scopes are configurable for sovereign clouds and the emulator.

use std::time::Duration;

use azure_core::{Method, Url};
use azure_mgmt_compute::package_2024_07_01::models::{
    VirtualMachineScaleSet, VirtualMachineScaleSetVmInstanceIDs, VirtualMachineScaleSetVmInstanceRequiredIDs,
    VirtualMachineScaleSetVmListResult,
};
use base64::Engine;
use driver_sdk::{
    async_trait, convert, reason, ApplyPool, CanUpdateMachine, Capability, CreateMachine, Driver, DriverError,
    DriverInfo, InstanceState, ListMachines, ListPoolInstances, Machine, MachineRef, Operation, OperationHandle,
    OperationKind, OperationOutput, Page, Pool, PoolInstance, PoolInstances, PoolRef, Probe, RequestContext, Result,
    Secrets, UpdateMachine, UpdatePlan, ValidateMachineClass,
};
use serde::{Deserialize, Serialize};

pub mod arm;
pub mod class_credential;
pub mod credential;
pub mod errors;
pub mod events;
pub mod machines;
pub mod model;
pub mod vm;

use arm::{ArmClient, ArmError, ArmResponse};
use errors::{operation_failed, to_driver_error};

/// The driver's name (and ErrorInfo domain).
pub const DRIVER_NAME: &str = "azure-vmss.machinedriver.dev";

/// The `poll_after` when ARM sends no `Retry-After` (`--default-poll-interval`): VM operations take
/// minutes, so a poll every 15 s costs little and still sees the end soon.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(15);
/// The shortest `poll_after` sent ([`Config::min_poll`] of the sidecar), so a `Retry-After: 0`
/// cannot make callers spin.
pub const MIN_POLL: Duration = Duration::from_millis(200);
/// Kept back from the caller's deadline for an ARM call, so the answer still reaches the caller.
const DEADLINE_MARGIN: Duration = Duration::from_millis(100);
/// How long Probe waits for a token from the credential before it answers "not ready".
const PROBE_TOKEN_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the driver's resources live by default and how it polls.
#[derive(Debug, Clone, Default)]
pub struct Config {
    /// Subscription when neither the provider spec nor the class Secret names one.
    pub subscription_id: Option<String>,
    /// Resource group when the provider spec names none.
    pub resource_group: Option<String>,
    /// Flexible scale set machines join when the provider spec names none.
    pub scale_set: Option<String>,
    /// `poll_after` when ARM sends no `Retry-After`.
    pub default_poll: Duration,
    /// Lower bound of `poll_after`, so a `Retry-After: 0` cannot make callers spin.
    pub min_poll: Duration,
    /// How often the event stream lists the VMs (`--event-poll-interval`; zero:
    /// [`events::DEFAULT_EVENT_POLL_INTERVAL`]).
    pub event_poll: Duration,
}

/// The scale set or VM an operation works on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceId {
    /// Subscription ID: the provider spec's, the class Secret's or [`Config::subscription_id`].
    pub subscription: String,
    /// The provider spec's, else [`Config::resource_group`].
    pub resource_group: String,
    /// Scale set or VM name.
    pub name: String,
}

/// Everything needed to resume an ARM operation: sealed into the operation token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpState {
    /// The protocol operation (`ApplyPool`, `DeletePool`, …).
    pub kind: String,
    /// The HTTP method that started it.
    pub method: String,
    /// `Azure-AsyncOperation` of the response.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub async_url: Option<String>,
    /// `Location` of the response.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub location_url: Option<String>,
    /// The URL the request went to (final GET of a PUT; resource polling when ARM gave no URL).
    pub original_url: String,
    /// The scale set (pool operations) or the VM (machine operations).
    pub resource: ResourceId,
    /// The instances of an instance operation.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub instance_ids: Vec<String>,
}

/// A page token: the ARM page's URL and how many of its VMs were already returned.
#[derive(Debug, Serialize, Deserialize)]
struct PageToken {
    l: String,
    o: usize,
}

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::URL_SAFE_NO_PAD;

/// The Azure VMSS driver.
#[derive(Debug)]
pub struct AzureVmssDriver {
    arm: ArmClient,
    credentials: class_credential::ClassCredentials,
    config: Config,
    watch: events::Watch,
}

fn kind_name(kind: OperationKind) -> &'static str {
    match kind {
        OperationKind::ApplyPool => "ApplyPool",
        OperationKind::DeletePool => "DeletePool",
        OperationKind::DeletePoolInstances => "DeletePoolInstances",
        OperationKind::UpgradePoolInstances => "UpgradePoolInstances",
        OperationKind::CreateMachine => "CreateMachine",
        OperationKind::DeleteMachine => "DeleteMachine",
        OperationKind::UpdateMachine => "UpdateMachine",
    }
}

impl AzureVmssDriver {
    /// A driver calling ARM through `arm`.
    /// A driver calling ARM through `arm`, with each MachineClass's credential from
    /// `credentials` (the sidecar's own when the class Secret names none).
    pub fn new(arm: ArmClient, credentials: class_credential::ClassCredentials, config: Config) -> Self {
        let watch = events::Watch::default();
        if let (Some(subscription), Some(resource_group)) = (&config.subscription_id, &config.resource_group) {
            let r = ResourceId {
                subscription: subscription.clone(),
                resource_group: resource_group.clone(),
                name: String::new(),
            };
            watch.learn(&r, &arm);
        }
        Self { arm, credentials, config, watch }
    }

    /// Where `name` lives: the provider spec's `subscriptionId` and `resourceGroup`, else the
    /// class Secret's subscription and the sidecar's defaults.
    ///
    /// # Errors
    /// INVALID_ARGUMENT naming the field when nothing gives a subscription or resource group.
    fn resource(&self, name: &str, spec: &serde_json::Value, secret_subscription: Option<&str>) -> Result<ResourceId> {
        let from_spec = |k: &str| spec[k].as_str().filter(|v| !v.is_empty()).map(str::to_string);
        let subscription = from_spec("subscriptionId")
            .or_else(|| secret_subscription.map(str::to_string))
            .or_else(|| self.config.subscription_id.clone());
        let resource_group = from_spec("resourceGroup").or_else(|| self.config.resource_group.clone());
        let missing = |field: &str, why: &str| {
            DriverError::invalid_argument(reason::FIELD_REQUIRED, format!("provider_spec.{field} is required: {why}"))
                .with_violation(format!("provider_spec.{field}"), why)
        };
        Ok(ResourceId {
            subscription: subscription.ok_or_else(|| {
                missing(
                    "subscriptionId",
                    "the class Secret has no subscriptionId and the sidecar no --subscription-id default",
                )
            })?,
            resource_group: resource_group
                .ok_or_else(|| missing("resourceGroup", "the sidecar has no --resource-group default"))?,
            name: name.to_string(),
        })
    }

    /// The ARM client for a request: the class Secret's credential, else the sidecar's; and the
    /// Secret's subscription, if it names one.
    ///
    /// # Errors
    /// INVALID_ARGUMENT when the Secret holds an unusable combination of keys.
    fn arm_for(&self, secrets: &Secrets) -> Result<(ArmClient, Option<String>)> {
        let (credential, subscription) = self.credentials.credential_for(secrets)?;
        Ok((self.arm.with_credential(credential), subscription))
    }

    fn path(r: &ResourceId) -> String {
        format!(
            "/subscriptions/{}/resourceGroups/{}/providers/Microsoft.Compute/virtualMachineScaleSets/{}",
            r.subscription, r.resource_group, r.name
        )
    }

    fn url(&self, r: &ResourceId, suffix: &str, query: &[(&str, &str)]) -> Result<Url> {
        let path = format!("{}{suffix}", Self::path(r));
        self.arm.url(&path, query).map_err(|e| to_driver_error(e, reason::POOL_NOT_FOUND))
    }

    /// One ARM call on behalf of `ctx` with `arm`'s credential, bounded by the caller's deadline.
    async fn call(
        arm: &ArmClient,
        ctx: &RequestContext,
        method: Method,
        url: Url,
        body: Option<&serde_json::Value>,
    ) -> Result<ArmResponse, ArmError> {
        // Leave a little of the caller's deadline for answering.
        let budget = ctx.remaining().map(|d| d.saturating_sub(DEADLINE_MARGIN));
        arm.send(method, url, body, ctx.request_id(), budget).await
    }

    fn poll_after(&self, resp: &ArmResponse) -> Duration {
        resp.retry_after().unwrap_or(self.config.default_poll).max(self.config.min_poll)
    }

    /// The scale set, or `None` when ARM says 404.
    async fn get_scale_set(
        &self,
        arm: &ArmClient,
        ctx: &RequestContext,
        r: &ResourceId,
    ) -> Result<Option<(VirtualMachineScaleSet, ArmResponse)>> {
        let url = self.url(r, "", &[])?;
        let resp = Self::call(arm, ctx, Method::Get, url, None)
            .await
            .map_err(|e| to_driver_error(e, reason::POOL_NOT_FOUND))?;
        match resp.status {
            404 => Ok(None),
            s if (200..300).contains(&s) => {
                let v = resp.json("scale set").map_err(|e| to_driver_error(e, reason::POOL_NOT_FOUND))?;
                Ok(Some((v, resp)))
            }
            _ => Err(to_driver_error(resp.into_error(), reason::POOL_NOT_FOUND)),
        }
    }

    /// A running operation for an accepted ARM request.
    fn started(
        &self,
        kind: OperationKind,
        resource: &ResourceId,
        method: &Method,
        original_url: &Url,
        resp: &ArmResponse,
        instance_ids: Vec<String>,
    ) -> Operation {
        // Only URLs on our ARM endpoint are kept: a token never sends credentials elsewhere.
        let trusted = |h: &str| {
            resp.header(h).and_then(|u| match self.arm.trusted_url(u) {
                Ok(u) => Some(u.to_string()),
                Err(e) => {
                    tracing::warn!(header = h, error = %e, "ignoring an operation URL");
                    None
                }
            })
        };
        let state = OpState {
            kind: kind_name(kind).into(),
            method: method.to_string(),
            async_url: trusted("azure-asyncoperation"),
            location_url: trusted("location"),
            original_url: original_url.to_string(),
            resource: resource.clone(),
            instance_ids,
        };
        let mut op = Operation::running(kind, &resource.name, serde_json::to_value(&state).unwrap_or_default())
            .with_poll_after(self.poll_after(resp));
        if let Some(id) = resp.request_id() {
            op = op.with_cloud_request_id(id);
        }
        // The ARM operation ID (last segment of the async URL) names the operation in logs.
        if let Some(id) = state
            .async_url
            .as_deref()
            .and_then(|u| Url::parse(u).ok())
            .and_then(|u| u.path_segments().and_then(|mut s| s.next_back().map(str::to_string)))
        {
            op = op.named(format!("{}-{id}", kind_name(kind).to_ascii_lowercase()));
        }
        op
    }

    /// An operation that is over as it starts (nothing to do, or the resource is already as
    /// asked). Its token still holds the resource, so `GetOperation` and `WaitOperation` on it
    /// answer again from the resource's state.
    #[allow(clippy::too_many_arguments)]
    fn done(
        &self,
        kind: OperationKind,
        resource: &ResourceId,
        method: &Method,
        url: &Url,
        rid: Option<&str>,
        output: OperationOutput,
    ) -> Operation {
        let state = OpState {
            kind: kind_name(kind).into(),
            method: method.to_string(),
            async_url: None,
            location_url: None,
            original_url: url.to_string(),
            resource: resource.clone(),
            instance_ids: vec![],
        };
        let op = Operation::running(kind, &resource.name, serde_json::to_value(&state).unwrap_or_default());
        with_rid(op.finish(Ok(output)), rid)
    }

    /// Finishes a succeeded operation: PUT/PATCH end with a GET of the scale set or VM.
    async fn succeeded(
        &self,
        arm: &ArmClient,
        ctx: &RequestContext,
        handle: &OperationHandle,
        st: &OpState,
        op: Operation,
    ) -> Result<Operation> {
        if st.method != "PUT" && st.method != "PATCH" {
            return Ok(op.finish(Ok(OperationOutput::None)));
        }
        if machines::is_machine_op(st) {
            return self.machine_succeeded(arm, ctx, st, op).await;
        }
        let url = self.arm.trusted_url(&st.original_url).map_err(|e| to_driver_error(e, reason::POOL_NOT_FOUND))?;
        let resp = Self::call(arm, ctx, Method::Get, url, None)
            .await
            .map_err(|e| to_driver_error(e, reason::POOL_NOT_FOUND))?;
        let op = match resp.request_id() {
            Some(id) => op.with_cloud_request_id(id),
            None => op,
        };
        if resp.status == 404 {
            let err =
                DriverError::not_found(reason::POOL_NOT_FOUND, format!("scale set {} no longer exists", handle.target));
            return Ok(op.finish(Err(err)));
        }
        if !resp.is_success() {
            return Err(to_driver_error(resp.into_error(), reason::POOL_NOT_FOUND));
        }
        let vmss: VirtualMachineScaleSet =
            resp.json("scale set").map_err(|e| to_driver_error(e, reason::POOL_NOT_FOUND))?;
        Ok(op.finish(Ok(OperationOutput::Pool(model::pool_of(&vmss)))))
    }

    /// Every instance of a pool (following `nextLink`, bounded).
    async fn all_instances(&self, arm: &ArmClient, ctx: &RequestContext, r: &ResourceId) -> Result<Vec<PoolInstance>> {
        let mut out = Vec::new();
        let mut url = self.url(r, "/virtualMachines", &[("$expand", "instanceView")])?;
        for _ in 0..100 {
            let page = self.vm_page(arm, ctx, url).await?;
            out.extend(page.value.iter().map(model::instance_of));
            match page.next_link.filter(|l| !l.is_empty()) {
                Some(next) => {
                    url = self.arm.trusted_url(&next).map_err(|e| to_driver_error(e, reason::POOL_NOT_FOUND))?
                }
                None => break,
            }
        }
        Ok(out)
    }

    async fn vm_page(
        &self,
        arm: &ArmClient,
        ctx: &RequestContext,
        url: Url,
    ) -> Result<VirtualMachineScaleSetVmListResult> {
        let resp = Self::call(arm, ctx, Method::Get, url, None)
            .await
            .map_err(|e| to_driver_error(e, reason::POOL_NOT_FOUND))?;
        if !resp.is_success() {
            return Err(to_driver_error(resp.into_error(), reason::POOL_NOT_FOUND));
        }
        resp.json("VM list").map_err(|e| to_driver_error(e, reason::POOL_NOT_FOUND))
    }

    /// POSTs an instance action; the response must be an accepted operation.
    async fn instance_action(
        &self,
        arm: &ArmClient,
        ctx: &RequestContext,
        r: &ResourceId,
        action: &str,
        kind: OperationKind,
        ids: Vec<String>,
    ) -> Result<std::result::Result<Operation, ArmResponse>> {
        let url = self.url(r, &format!("/{action}"), &[])?;
        let body = if kind == OperationKind::DeletePoolInstances {
            serde_json::to_value(VirtualMachineScaleSetVmInstanceRequiredIDs::new(ids.clone()))
        } else {
            let mut b = VirtualMachineScaleSetVmInstanceIDs::new();
            b.instance_ids = ids.clone();
            serde_json::to_value(b)
        }
        .map_err(|e| DriverError::internal("serializing instance IDs").with_source(e))?;
        let resp = Self::call(arm, ctx, Method::Post, url.clone(), Some(&body))
            .await
            .map_err(|e| to_driver_error(e, reason::POOL_NOT_FOUND))?;
        if resp.is_success() {
            return Ok(Ok(self.started(kind, r, &Method::Post, &url, &resp, ids)));
        }
        Ok(Err(resp))
    }
}

/// Records ARM's request ID on an operation, when ARM sent one.
fn with_rid(op: Operation, rid: Option<&str>) -> Operation {
    match rid {
        Some(id) => op.with_cloud_request_id(id),
        None => op,
    }
}

fn instance_target(resp: &ArmResponse) -> bool {
    let v = resp.value();
    resp.status == 400 && v["error"]["target"].as_str().is_some_and(|t| t.eq_ignore_ascii_case("instanceIds"))
}

#[async_trait]
impl Driver for AzureVmssDriver {
    fn info(&self) -> DriverInfo {
        DriverInfo {
            name: DRIVER_NAME.into(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            provider_spec_schema: model::schema(),
        }
    }

    fn capabilities(&self) -> Vec<Capability> {
        vec![
            Capability::Machines,
            Capability::InPlaceUpdate,
            Capability::Pools,
            Capability::ValidateMachineClass,
            Capability::Events,
        ]
    }

    async fn watch_events(&self, _ctx: &RequestContext) -> Result<driver_sdk::EventStream> {
        // One poll at once, then one every interval, for as long as the SDK reads (it stops
        // reading while its buffer is full: backpressure reaches the polling).
        let watch = self.watch.clone();
        let every =
            if self.config.event_poll.is_zero() { events::DEFAULT_EVENT_POLL_INTERVAL } else { self.config.event_poll };
        let start = (std::collections::VecDeque::new(), true);
        let stream = futures::stream::unfold(start, move |(mut buffer, mut first)| {
            let watch = watch.clone();
            async move {
                loop {
                    if let Some(e) = buffer.pop_front() {
                        return Some((Ok(e), (buffer, first)));
                    }
                    if !first {
                        // The poll's interval (a schedule, not a synchronisation).
                        tokio::time::sleep(every).await;
                    }
                    first = false;
                    buffer.extend(watch.poll().await);
                }
            }
        });
        Ok(Box::pin(stream))
    }

    async fn ack_event(&self, _ctx: &RequestContext, event: &driver_sdk::MachineEvent) -> Result<()> {
        self.watch.acked(&event.event_id);
        Ok(())
    }

    async fn probe(&self, _ctx: &RequestContext) -> Result<Probe> {
        // Ready once the credential yields a token: without one every call would fail.
        match tokio::time::timeout(PROBE_TOKEN_TIMEOUT, self.arm.check_credential()).await {
            Ok(Ok(())) => Ok(Probe::ready()),
            Ok(Err(e)) => Ok(Probe::starting(format!("no ARM token yet: {}", driver_sdk::error_chain(&e)))),
            Err(_) => Ok(Probe::starting(format!(
                "no ARM token yet: the credential did not answer within {}s",
                PROBE_TOKEN_TIMEOUT.as_secs()
            ))),
        }
    }

    async fn create_machine(&self, ctx: &RequestContext, req: CreateMachine) -> Result<Operation> {
        self.create_vm(ctx, req).await
    }

    async fn delete_machine(&self, ctx: &RequestContext, req: MachineRef) -> Result<Operation> {
        self.delete_vm(ctx, req).await
    }

    async fn get_machine_status(&self, ctx: &RequestContext, req: MachineRef) -> Result<Machine> {
        self.vm_status(ctx, req).await
    }

    async fn list_machines(&self, ctx: &RequestContext, req: ListMachines) -> Result<Page<Machine>> {
        self.list_vms(ctx, req).await
    }

    async fn can_update_machine(&self, _ctx: &RequestContext, req: CanUpdateMachine) -> Result<UpdatePlan> {
        self.plan_vm_update(&req)
    }

    async fn update_machine(&self, ctx: &RequestContext, req: UpdateMachine) -> Result<Operation> {
        self.update_vm(ctx, req).await
    }

    async fn validate_machine_class(&self, _ctx: &RequestContext, req: ValidateMachineClass) -> Result<Vec<String>> {
        let spec = model::parse_spec(&req.provider_spec)?;
        // The controller sends a sample rendering of the class's boot data as the `userData`
        // secret: custom data ARM would refuse fails the class here, before any VM is created.
        vm::custom_data(&spec, &req.secrets)?;
        let mut warnings = Vec::new();
        if spec.ssh_public_key.is_none() {
            warnings.push("no sshPublicKey: password login is disabled, so nobody can log in to the VMs".into());
        }
        if spec.subnet_id.is_none() {
            warnings.push(
                "no subnetId: machines cannot be created (a VM needs a network interface) and pool instances get none"
                    .into(),
            );
        }
        // The class must say where its resources go, and a credential of its own must work:
        // caught here, before any machine is created.
        let class = class_credential::ClassCredential::from_secrets(&req.secrets)?;
        self.resource("validate", &req.provider_spec, class.subscription_id())?;
        if !class.is_default() {
            let arm = self.arm.with_credential(self.credentials.credential(&class));
            arm.check_credential().await.map_err(|e| {
                to_driver_error(e, reason::FIELD_INVALID).with_metadata("azureCredential", class.kind())
            })?;
        }
        Ok(warnings)
    }

    async fn machine_capacity(
        &self,
        _ctx: &RequestContext,
        req: &ValidateMachineClass,
    ) -> Result<std::collections::BTreeMap<String, String>> {
        // The published sizes of the common VM families (the ARM emulator has no resource-SKU
        // API to ask); an unknown size reports nothing, and the class's spec.capacity says it.
        let spec = model::parse_spec(&req.provider_spec)?;
        let Some((cpu, memory_gib, gpus)) = model::vm_size_capacity(&spec.vm_size) else {
            return Ok(Default::default());
        };
        let mut out = std::collections::BTreeMap::from([
            ("cpu".to_string(), cpu.to_string()),
            ("memory".to_string(), format!("{memory_gib}Gi")),
        ]);
        if gpus > 0 {
            out.insert("nvidia.com/gpu".to_string(), gpus.to_string());
        }
        Ok(out)
    }

    async fn apply_pool(&self, ctx: &RequestContext, req: ApplyPool) -> Result<Operation> {
        let spec = model::parse_spec(&req.provider_spec)?;
        let hash = convert::spec_hash(&req.provider_spec);
        // Checked before any call: too large is refused, nothing applied.
        let custom_data = vm::custom_data(&spec, &req.secrets)?;
        let (arm, secret_sub) = self.arm_for(&req.secrets)?;
        let r = self.resource(&req.name, &req.provider_spec, secret_sub.as_deref())?;
        let url = self.url(&r, "", &[])?;
        if let Some((vmss, resp)) = self.get_scale_set(&arm, ctx, &r).await? {
            if model::matches(&vmss, &hash, req.capacity, &req.labels) {
                let rid = resp.request_id();
                match model::provisioning_state(&vmss).as_str() {
                    "Succeeded" => {
                        let out = OperationOutput::Pool(model::pool_of(&vmss));
                        return Ok(self.done(OperationKind::ApplyPool, &r, &Method::Put, &url, rid, out));
                    }
                    // Already being applied (a repeated call): follow the resource itself.
                    "Creating" | "Updating" => {
                        let mut op = self.started(OperationKind::ApplyPool, &r, &Method::Put, &url, &resp, vec![]);
                        op.poll_after = self.poll_after(&resp);
                        return Ok(op);
                    }
                    "Deleting" => {
                        return Err(DriverError::operation_pending(format!("scale set {} is being deleted", req.name)))
                    }
                    _ => {} // Failed: apply again.
                }
            }
        }
        let body = model::scale_set_body(&req.name, &spec, &hash, req.capacity, &req.labels, custom_data)?;
        let resp = Self::call(&arm, ctx, Method::Put, url.clone(), Some(&body))
            .await
            .map_err(|e| to_driver_error(e, reason::POOL_NOT_FOUND))?;
        if !resp.is_success() {
            return Err(to_driver_error(resp.into_error(), reason::POOL_NOT_FOUND));
        }
        let vmss: VirtualMachineScaleSet =
            resp.json("scale set").map_err(|e| to_driver_error(e, reason::POOL_NOT_FOUND))?;
        let no_urls = resp.header("azure-asyncoperation").is_none() && resp.header("location").is_none();
        if no_urls && model::provisioning_state(&vmss) == "Succeeded" {
            let out = OperationOutput::Pool(model::pool_of(&vmss));
            let rid = resp.request_id();
            return Ok(self.done(OperationKind::ApplyPool, &r, &Method::Put, &url, rid, out));
        }
        Ok(self.started(OperationKind::ApplyPool, &r, &Method::Put, &url, &resp, vec![]))
    }

    async fn get_pool(&self, ctx: &RequestContext, req: PoolRef) -> Result<Pool> {
        let (arm, secret_sub) = self.arm_for(&req.secrets)?;
        let r = self.resource(&req.name, &req.provider_spec, secret_sub.as_deref())?;
        match self.get_scale_set(&arm, ctx, &r).await? {
            Some((vmss, _)) => Ok(model::pool_of(&vmss)),
            None => {
                Err(DriverError::not_found(reason::POOL_NOT_FOUND, format!("scale set {} does not exist", req.name)))
            }
        }
    }

    async fn list_pool_instances(&self, ctx: &RequestContext, req: ListPoolInstances) -> Result<Page<PoolInstance>> {
        let bad_token = || {
            DriverError::invalid_argument(reason::FIELD_INVALID, "page_token is not one this driver issued")
                .with_violation("page_token", "unknown token")
        };
        let (arm, secret_sub) = self.arm_for(&req.pool.secrets)?;
        let (mut url, mut offset) = if req.page_token.is_empty() {
            let r = self.resource(&req.pool.name, &req.pool.provider_spec, secret_sub.as_deref())?;
            (self.url(&r, "/virtualMachines", &[("$expand", "instanceView")])?, 0)
        } else {
            let bytes = B64.decode(&req.page_token).map_err(|_| bad_token())?;
            let t: PageToken = serde_json::from_slice(&bytes).map_err(|_| bad_token())?;
            (self.arm.trusted_url(&t.l).map_err(|_| bad_token())?, t.o)
        };
        // Skip ARM pages with nothing left on them (bounded).
        for _ in 0..20 {
            let page = self.vm_page(&arm, ctx, url.clone()).await?;
            let rest: Vec<PoolInstance> = page.value.iter().skip(offset).map(model::instance_of).collect();
            if rest.len() > req.page_size {
                let token = PageToken { l: url.to_string(), o: offset + req.page_size };
                let next = B64.encode(serde_json::to_vec(&token).unwrap_or_default());
                return Ok(Page { items: rest.into_iter().take(req.page_size).collect(), next_page_token: next });
            }
            let next_link = page.next_link.filter(|l| !l.is_empty());
            match next_link {
                Some(link) if rest.is_empty() => {
                    url = self.arm.trusted_url(&link).map_err(|e| to_driver_error(e, reason::POOL_NOT_FOUND))?;
                    offset = 0;
                }
                Some(link) => {
                    self.arm.trusted_url(&link).map_err(|e| to_driver_error(e, reason::POOL_NOT_FOUND))?;
                    let next = B64.encode(serde_json::to_vec(&PageToken { l: link, o: 0 }).unwrap_or_default());
                    return Ok(Page { items: rest, next_page_token: next });
                }
                None => return Ok(Page { items: rest, next_page_token: String::new() }),
            }
        }
        Ok(Page { items: Vec::new(), next_page_token: String::new() })
    }

    async fn delete_pool_instances(&self, ctx: &RequestContext, req: PoolInstances) -> Result<Operation> {
        let kind = OperationKind::DeletePoolInstances;
        let (arm, secret_sub) = self.arm_for(&req.pool.secrets)?;
        let r = self.resource(&req.pool.name, &req.pool.provider_spec, secret_sub.as_deref())?;
        let resp = match self.instance_action(&arm, ctx, &r, "delete", kind, req.instance_ids.clone()).await? {
            Ok(op) => return Ok(op),
            Err(resp) => resp,
        };
        if !instance_target(&resp) {
            return Err(to_driver_error(resp.into_error(), reason::POOL_NOT_FOUND));
        }
        // Some instances are gone already (a repeated delete): delete the rest, if any.
        let live: Vec<String> = self
            .all_instances(&arm, ctx, &r)
            .await?
            .into_iter()
            .filter(|i| i.state != InstanceState::Deleting && req.instance_ids.contains(&i.instance_id))
            .map(|i| i.instance_id)
            .collect();
        if live.is_empty() {
            let url = self.url(&r, "", &[])?;
            return Ok(self.done(kind, &r, &Method::Post, &url, resp.request_id(), OperationOutput::None));
        }
        match self.instance_action(&arm, ctx, &r, "delete", kind, live).await? {
            Ok(op) => Ok(op),
            Err(resp) => Err(to_driver_error(resp.into_error(), reason::POOL_NOT_FOUND)),
        }
    }

    async fn upgrade_pool_instances(&self, ctx: &RequestContext, req: PoolInstances) -> Result<Operation> {
        let kind = OperationKind::UpgradePoolInstances;
        let (arm, secret_sub) = self.arm_for(&req.pool.secrets)?;
        let r = self.resource(&req.pool.name, &req.pool.provider_spec, secret_sub.as_deref())?;
        match self.instance_action(&arm, ctx, &r, "manualupgrade", kind, req.instance_ids.clone()).await? {
            Ok(op) => Ok(op),
            Err(resp) => Err(to_driver_error(resp.into_error(), reason::POOL_NOT_FOUND)),
        }
    }

    async fn delete_pool(&self, ctx: &RequestContext, req: PoolRef) -> Result<Operation> {
        let (arm, secret_sub) = self.arm_for(&req.secrets)?;
        let r = self.resource(&req.name, &req.provider_spec, secret_sub.as_deref())?;
        let url = self.url(&r, "", &[])?;
        let resp = Self::call(&arm, ctx, Method::Delete, url.clone(), None)
            .await
            .map_err(|e| to_driver_error(e, reason::POOL_NOT_FOUND))?;
        match resp.status {
            // Gone already: delete is idempotent.
            204 | 404 => {
                let rid = resp.request_id();
                Ok(self.done(OperationKind::DeletePool, &r, &Method::Delete, &url, rid, OperationOutput::None))
            }
            s if (200..300).contains(&s) => {
                Ok(self.started(OperationKind::DeletePool, &r, &Method::Delete, &url, &resp, vec![]))
            }
            _ => Err(to_driver_error(resp.into_error(), reason::POOL_NOT_FOUND)),
        }
    }

    async fn get_operation(
        &self,
        ctx: &RequestContext,
        handle: OperationHandle,
        secrets: Secrets,
    ) -> Result<Operation> {
        let st: OpState = handle.state_as()?;
        let (arm, _) = self.arm_for(&secrets)?;
        let not_found = reason::OPERATION_NOT_FOUND;
        let op = handle.resume();
        if let Some(u) = &st.async_url {
            let url = self.arm.trusted_url(u).map_err(|e| to_driver_error(e, not_found))?;
            let resp =
                Self::call(&arm, ctx, Method::Get, url, None).await.map_err(|e| to_driver_error(e, not_found))?;
            // A failed read of the status is not a failed operation: the RPC fails, the
            // operation goes on, the caller polls again.
            if !resp.is_success() {
                return Err(to_driver_error(resp.into_error(), not_found));
            }
            let op = match resp.request_id() {
                Some(id) => op.with_cloud_request_id(id),
                None => op,
            };
            let body = resp.value();
            let status = body["status"].as_str().unwrap_or("InProgress");
            return match status {
                s if s.eq_ignore_ascii_case("Succeeded") => self.succeeded(&arm, ctx, &handle, &st, op).await,
                s if s.eq_ignore_ascii_case("Failed") || s.eq_ignore_ascii_case("Canceled") => {
                    let code = body["error"]["code"].as_str().unwrap_or_default();
                    let message = body["error"]["message"].as_str().unwrap_or_default();
                    tracing::warn!(
                        arm.status = s,
                        arm.error_code = code,
                        arm.request_id = resp.request_id().unwrap_or(""),
                        "ARM operation ended unsuccessfully"
                    );
                    Ok(op.finish(Err(operation_failed(s, code, message, resp.request_id()))))
                }
                _ => {
                    let pct = body["percentComplete"].as_f64().unwrap_or(0.0).clamp(0.0, 99.0) as u8;
                    Ok(op.with_progress(pct).with_poll_after(self.poll_after(&resp)))
                }
            };
        }
        if let Some(u) = &st.location_url {
            let url = self.arm.trusted_url(u).map_err(|e| to_driver_error(e, not_found))?;
            let resp =
                Self::call(&arm, ctx, Method::Get, url, None).await.map_err(|e| to_driver_error(e, not_found))?;
            let op = match resp.request_id() {
                Some(id) => op.with_cloud_request_id(id),
                None => op,
            };
            return match resp.status {
                202 => Ok(op.with_poll_after(self.poll_after(&resp))),
                s if (200..300).contains(&s) => self.succeeded(&arm, ctx, &handle, &st, op).await,
                s if s == 429 || s >= 500 || s == 401 || s == 403 => Err(to_driver_error(resp.into_error(), not_found)),
                _ => {
                    let rid = resp.request_id().map(str::to_string);
                    let v = resp.value();
                    let code = v["error"]["code"].as_str().unwrap_or_default();
                    let message = v["error"]["message"].as_str().unwrap_or_default();
                    Ok(op.finish(Err(operation_failed("Failed", code, message, rid.as_deref()))))
                }
            };
        }
        // No operation URL: follow the resource's provisioning state.
        if machines::is_machine_op(&st) {
            return self.follow_vm(&arm, ctx, &st, op).await;
        }
        let url = self.arm.trusted_url(&st.original_url).map_err(|e| to_driver_error(e, not_found))?;
        let resp = Self::call(&arm, ctx, Method::Get, url, None).await.map_err(|e| to_driver_error(e, not_found))?;
        let op = match resp.request_id() {
            Some(id) => op.with_cloud_request_id(id),
            None => op,
        };
        if resp.status == 404 {
            return Ok(if st.method == "DELETE" {
                op.finish(Ok(OperationOutput::None))
            } else {
                op.finish(Err(DriverError::not_found(
                    reason::POOL_NOT_FOUND,
                    format!("scale set {} does not exist", handle.target),
                )))
            });
        }
        if !resp.is_success() {
            return Err(to_driver_error(resp.into_error(), not_found));
        }
        let vmss: VirtualMachineScaleSet = resp.json("scale set").map_err(|e| to_driver_error(e, not_found))?;
        match model::provisioning_state(&vmss).as_str() {
            "Succeeded" if st.method == "PUT" || st.method == "PATCH" => {
                Ok(op.finish(Ok(OperationOutput::Pool(model::pool_of(&vmss)))))
            }
            "Succeeded" if st.method != "DELETE" => Ok(op.finish(Ok(OperationOutput::None))),
            s @ ("Failed" | "Canceled") => Ok(op.finish(Err(operation_failed(
                s,
                "ProvisioningStateFailed",
                "the scale set's provisioning state is Failed",
                resp.request_id(),
            )))),
            _ => Ok(op.with_poll_after(self.poll_after(&resp))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A driver whose ARM endpoint answers nothing: a call that reached it would fail with
    /// UNAVAILABLE, not with the refusal the tests expect.
    fn offline_driver() -> AzureVmssDriver {
        let token = || credential::build(credential::CredentialKind::StaticToken, Some("test-token"), None).unwrap();
        let arm = ArmClient::new(
            arm::ArmConfig {
                endpoint: Url::parse("http://127.0.0.1:9").unwrap(),
                scopes: vec!["http://127.0.0.1:9/.default".into()],
                request_timeout: Duration::from_secs(5),
                max_retries: 0,
            },
            token(),
        );
        let credentials = class_credential::ClassCredentials::new(token(), Url::parse("http://127.0.0.1:9").unwrap());
        let config = Config {
            subscription_id: Some("00000000-0000-0000-0000-000000000000".into()),
            resource_group: Some("rg".into()),
            ..Config::default()
        };
        AzureVmssDriver::new(arm, credentials, config)
    }

    #[tokio::test]
    async fn too_large_rendered_user_data_is_refused_at_create_and_validate_before_any_arm_call() {
        let d = offline_driver();
        let marker = "bootstrap-token-abcdef.0123456789abcdef";
        let big = format!("#cloud-config\n{}", marker.repeat(vm::MAX_CUSTOM_DATA_BASE64 / 4 * 3 / marker.len() + 1));
        let secrets: Secrets = [(vm::USER_DATA_KEY, big.as_str())].into_iter().collect();
        let mut provider_spec = model::schema()["examples"][0].clone();
        provider_spec["customData"] = serde_json::json!("small");
        let check = |err: DriverError| {
            assert_eq!((err.code(), err.reason()), (driver_sdk::tonic::Code::InvalidArgument, reason::FIELD_INVALID));
            assert_eq!(err.violations()[0].field, "secrets.userData", "{err}");
            assert!(err.message().contains(&big.len().to_string()), "{err}");
            assert!(!format!("{err:?} {:?}", err.violations()).contains(marker));
        };
        let ctx = RequestContext::for_method("test", "CreateMachine");
        let req = CreateMachine {
            name: "web-0".into(),
            provider_spec: provider_spec.clone(),
            secrets: secrets.clone(),
            labels: Default::default(),
            uid: "uid-1".into(),
        };
        check(d.create_machine(&ctx, req).await.unwrap_err());
        let ctx = RequestContext::for_method("test", "ValidateMachineClass");
        check(d.validate_machine_class(&ctx, ValidateMachineClass { provider_spec, secrets }).await.unwrap_err());
        // A small one validates (no ARM call either: the sidecar's own credential).
        let small: Secrets = [(vm::USER_DATA_KEY, "#cloud-config\n")].into_iter().collect();
        let ok = ValidateMachineClass { provider_spec: model::schema()["examples"][0].clone(), secrets: small };
        d.validate_machine_class(&ctx, ok).await.unwrap();
    }

    #[test]
    fn op_state_round_trips_and_stays_small() {
        let st = OpState {
            kind: "ApplyPool".into(),
            method: "PUT".into(),
            async_url: Some("https://management.azure.com/subscriptions/s/providers/Microsoft.Compute/locations/westeurope/operations/1?api-version=2024-07-01".into()),
            location_url: None,
            original_url: "https://management.azure.com/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/p?api-version=2024-07-01".into(),
            resource: ResourceId { subscription: "s".into(), resource_group: "rg".into(), name: "p".into() },
            instance_ids: vec![],
        };
        let v = serde_json::to_value(&st).unwrap();
        assert!(v.get("location_url").is_none() && v.get("instance_ids").is_none());
        assert_eq!(serde_json::from_value::<OpState>(v).unwrap(), st);
    }
}
