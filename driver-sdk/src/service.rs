//! The generated gRPC services, implemented once over any [`Driver`]: validation, capability
//! gating, conversion, operation tokens and error encoding live here, not in drivers.

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use machine_driver_proto::v1 as pb;
use serde_json::Value;
use tonic::{Request, Response, Status};

use crate::context::RequestContext;
use crate::convert;
use crate::driver::Driver;
use crate::error::{reason, DriverError, Result, Violation};
use crate::schema::{self, ProviderSchema, SchemaError};
use crate::token::TokenCodec;
use crate::types::*;

/// How long WaitOperation waits when neither a timeout nor a deadline bounds it.
const MAX_WAIT: Duration = Duration::from_secs(60);
/// Reserved before the caller's deadline so the answer arrives in time.
const DEADLINE_MARGIN: Duration = Duration::from_millis(100);
/// The shortest pause between polls inside WaitOperation, so a `poll_after` of zero cannot spin.
const MIN_WAIT_POLL: Duration = Duration::from_millis(10);

pub(crate) struct Shared<D> {
    pub(crate) driver: Arc<D>,
    pub(crate) info: DriverInfo,
    pub(crate) capabilities: Vec<Capability>,
    capability_set: HashSet<Capability>,
    /// `info.provider_spec_schema`, compiled once.
    spec_schema: ProviderSchema,
    pub(crate) codec: TokenCodec,
    /// What WatchEvents streams and AckEvents acknowledges.
    pub(crate) events: Arc<crate::events::EventHub>,
}

/// Implements the four `machinedriver.v1` services for one driver.
pub(crate) struct DriverService<D> {
    shared: Arc<Shared<D>>,
}

impl<D> Clone for DriverService<D> {
    fn clone(&self) -> Self {
        Self { shared: self.shared.clone() }
    }
}

impl<D: Driver> DriverService<D> {
    /// The service for `driver`, its provider-spec schema compiled.
    ///
    /// # Errors
    /// The driver's provider-spec schema is refused ([`ProviderSchema::compile`]).
    pub(crate) fn new(driver: Arc<D>, codec_key: crate::token::TokenKey) -> Result<Self, SchemaError> {
        let info = driver.info();
        let spec_schema = ProviderSchema::compile(&info.provider_spec_schema)?;
        let capabilities = driver.capabilities();
        let codec = TokenCodec::new(codec_key, info.name.clone());
        let capability_set = capabilities.iter().copied().collect();
        let events = crate::events::EventHub::new();
        Ok(Self { shared: Arc::new(Shared { driver, info, capabilities, capability_set, spec_schema, codec, events }) })
    }

    pub(crate) fn shared(&self) -> &Arc<Shared<D>> {
        &self.shared
    }

    fn driver(&self) -> &D {
        &self.shared.driver
    }

    fn require(&self, cap: Capability, rpc: &str) -> Result<()> {
        if self.shared.capability_set.contains(&cap) {
            Ok(())
        } else {
            let name = crate::convert::capability(cap).as_str_name();
            Err(DriverError::new(
                tonic::Code::Unimplemented,
                crate::error::reason::CAPABILITY_NOT_SUPPORTED,
                format!("this driver does not implement {rpc}: it does not advertise the {name} capability"),
            ))
        }
    }

    /// Runs one RPC body and encodes its error, redacting `secrets`.
    async fn run<T>(
        &self,
        ctx: &RequestContext,
        secrets: &Secrets,
        body: impl Future<Output = Result<T>>,
    ) -> std::result::Result<Response<T>, Status> {
        match body.await {
            Ok(v) => Ok(Response::new(v)),
            Err(err) => {
                let status = err.to_status(&self.shared.info.name, &ctx.request_id, Some(secrets));
                tracing::warn!(
                    "rpc.code" = ?err.code(),
                    "error.reason" = err.reason(),
                    "cloud.request_ids" = ?err.cloud_request_ids(),
                    "call failed: {}", status.message()
                );
                Err(status)
            }
        }
    }

    fn operation(&self, ctx: &RequestContext, op: Operation, secrets: &Secrets) -> pb::Operation {
        let token = self.shared.codec.seal(&op);
        let result = match &op.outcome {
            None => None,
            Some(Ok(out)) => Some(pb::operation::Result::Response(convert::operation_output(out))),
            Some(Err(err)) => Some(pb::operation::Result::Error(err.to_rpc_status(
                &self.shared.info.name,
                &ctx.request_id,
                Some(secrets),
            ))),
        };
        pb::Operation {
            name: op.name.clone(),
            kind: convert::operation_kind(op.kind) as i32,
            target: op.target.clone(),
            done: op.outcome.is_some(),
            result,
            progress_percent: i32::from(op.progress_percent),
            poll_after: Some(convert::duration(op.poll_after)),
            token,
            start_time: op.start_time.map(convert::timestamp),
            end_time: op.end_time.map(convert::timestamp),
            cloud_request_ids: op.cloud_request_ids.clone(),
        }
    }

    fn spec(&self, v: &mut Check, field: &str, spec: Option<&prost_types::Struct>) -> Value {
        match spec {
            None => {
                v.missing(field);
                Value::Null
            }
            Some(s) => {
                let json = convert::struct_to_json(s);
                v.schema(&self.shared.spec_schema, &json, field);
                json
            }
        }
    }

    fn page_size(v: &mut Check, size: i32) -> usize {
        match size {
            0 => DEFAULT_PAGE_SIZE,
            n if n < 0 => {
                v.invalid("page_size", "must not be negative");
                DEFAULT_PAGE_SIZE
            }
            n => (n as usize).min(MAX_PAGE_SIZE),
        }
    }
}

/// Collects request violations; the first one decides the reason.
#[derive(Default)]
struct Check {
    reason: Option<&'static str>,
    violations: Vec<Violation>,
}

impl Check {
    fn add(&mut self, reason: &'static str, field: impl Into<String>, description: impl Into<String>) {
        self.reason.get_or_insert(reason);
        self.violations.push(Violation::new(field, description));
    }

    fn missing(&mut self, field: &str) {
        self.add(reason::FIELD_REQUIRED, field, "is required");
    }

    fn invalid(&mut self, field: &str, description: &str) {
        self.add(reason::FIELD_INVALID, field, description);
    }

    fn name(&mut self, field: &str, name: &str) {
        match schema::check_name(name) {
            Ok(()) => {}
            Err(_) if name.is_empty() => self.missing(field),
            Err(why) => self.invalid(field, why),
        }
    }

    fn schema(&mut self, schema: &ProviderSchema, spec: &Value, field: &str) {
        for v in schema.validate(spec, field) {
            self.add(reason::INVALID_PROVIDER_SPEC, v.field, v.description);
        }
    }

    fn token(&mut self, token: &[u8]) {
        if token.is_empty() {
            self.missing("token");
        }
    }

    fn finish(self) -> Result<()> {
        let Some(reason) = self.reason else { return Ok(()) };
        let summary: Vec<String> = self.violations.iter().map(|v| format!("{}: {}", v.field, v.description)).collect();
        let mut err = DriverError::invalid_argument(reason, format!("invalid request: {}", summary.join("; ")));
        for v in self.violations {
            err = err.with_violation(v.field, v.description);
        }
        Err(err)
    }
}

pub(crate) fn context<T>(req: &Request<T>) -> RequestContext {
    req.extensions().get::<RequestContext>().cloned().unwrap_or_else(|| {
        // Without the SDK's layer (e.g. a service mounted elsewhere) still give a usable ID.
        RequestContext::new(uuid::Uuid::new_v4().to_string())
    })
}

/// The prologue every RPC handler shares, so that a handler states only what differs: its
/// capability gate (if any) and its body.
///
/// Binds `$ctx` (the call's [`RequestContext`]), `$r` (the request message) and `$secrets` (its
/// [`Secrets`]), checks the capability, runs the body — an expression of type `Result<T>` that
/// may use `?` and `return` — and encodes its error with the secrets redacted ([`DriverService::run`]).
///
/// - `rpc!(self, req, |ctx| body)`: a request without secrets (the Identity service);
/// - `rpc!(self, req, |ctx, r, secrets| body)`: no capability gate (the Operations service);
/// - `rpc!(self, req, Capability::Pools, "ApplyPool", |ctx, r, secrets| body)`: UNIMPLEMENTED
///   unless the driver advertises the capability.
macro_rules! rpc {
    ($svc:ident, $req:ident, |$ctx:ident| $body:expr) => {{
        let $ctx = context(&$req);
        $svc.run(&$ctx, &Secrets::default(), async { $body }).await
    }};
    ($svc:ident, $req:ident, |$ctx:ident, $r:ident, $secrets:ident| $body:expr) => {{
        let $ctx = context(&$req);
        let $r = $req.into_inner();
        let $secrets = convert::secrets($r.secrets.as_ref());
        $svc.run(&$ctx, &$secrets, async { $body }).await
    }};
    ($svc:ident, $req:ident, $cap:path, $rpc:literal, |$ctx:ident, $r:ident, $secrets:ident| $body:expr) => {
        rpc!($svc, $req, |$ctx, $r, $secrets| {
            $svc.require($cap, $rpc)?;
            $body
        })
    };
}

// ------------------------------------------------------------------------------------ Identity

#[tonic::async_trait]
impl<D: Driver> pb::identity_server::Identity for DriverService<D> {
    async fn get_driver_info(
        &self,
        req: Request<pb::GetDriverInfoRequest>,
    ) -> std::result::Result<Response<pb::GetDriverInfoResponse>, Status> {
        let info = &self.shared.info;
        rpc!(self, req, |ctx| {
            Ok(pb::GetDriverInfoResponse {
                name: info.name.clone(),
                vendor_version: info.vendor_version.clone(),
                protocol_version: PROTOCOL_VERSION.to_string(),
                provider_spec_schema: Some(convert::json_to_struct(&info.provider_spec_schema)),
            })
        })
    }

    async fn get_capabilities(
        &self,
        req: Request<pb::GetCapabilitiesRequest>,
    ) -> std::result::Result<Response<pb::GetCapabilitiesResponse>, Status> {
        rpc!(self, req, |ctx| {
            Ok(pb::GetCapabilitiesResponse {
                capabilities: self.shared.capabilities.iter().map(|c| convert::capability(*c) as i32).collect(),
            })
        })
    }

    async fn probe(&self, req: Request<pb::ProbeRequest>) -> std::result::Result<Response<pb::ProbeResponse>, Status> {
        rpc!(self, req, |ctx| {
            let p = self.driver().probe(&ctx).await?;
            Ok(pb::ProbeResponse { ready: p.ready, message: p.message })
        })
    }
}

// ------------------------------------------------------------------------------------ Machines

#[tonic::async_trait]
impl<D: Driver> pb::machines_server::Machines for DriverService<D> {
    async fn create_machine(
        &self,
        req: Request<pb::CreateMachineRequest>,
    ) -> std::result::Result<Response<pb::Operation>, Status> {
        rpc!(self, req, Capability::Machines, "CreateMachine", |ctx, r, secrets| {
            let mut v = Check::default();
            v.name("name", &r.name);
            let spec = self.spec(&mut v, "provider_spec", r.provider_spec.as_ref());
            v.finish()?;
            let op = self
                .driver()
                .create_machine(
                    &ctx,
                    CreateMachine {
                        name: r.name,
                        provider_spec: spec,
                        secrets: secrets.clone(),
                        labels: convert::labels(&r.labels),
                        uid: r.uid,
                    },
                )
                .await?;
            Ok(self.operation(&ctx, op, &secrets))
        })
    }

    async fn delete_machine(
        &self,
        req: Request<pb::DeleteMachineRequest>,
    ) -> std::result::Result<Response<pb::Operation>, Status> {
        rpc!(self, req, Capability::Machines, "DeleteMachine", |ctx, r, secrets| {
            let mut v = Check::default();
            v.name("name", &r.name);
            v.finish()?;
            let op = self
                .driver()
                .delete_machine(&ctx, machine_ref(r.name, r.provider_id, r.provider_spec.as_ref(), secrets.clone()))
                .await?;
            Ok(self.operation(&ctx, op, &secrets))
        })
    }

    async fn get_machine_status(
        &self,
        req: Request<pb::GetMachineStatusRequest>,
    ) -> std::result::Result<Response<pb::Machine>, Status> {
        rpc!(self, req, Capability::Machines, "GetMachineStatus", |ctx, r, secrets| {
            let mut v = Check::default();
            v.name("name", &r.name);
            v.finish()?;
            let m = self
                .driver()
                .get_machine_status(&ctx, machine_ref(r.name, r.provider_id, r.provider_spec.as_ref(), secrets.clone()))
                .await?;
            Ok(convert::machine(&m))
        })
    }

    async fn list_machines(
        &self,
        req: Request<pb::ListMachinesRequest>,
    ) -> std::result::Result<Response<pb::ListMachinesResponse>, Status> {
        rpc!(self, req, Capability::Machines, "ListMachines", |ctx, r, secrets| {
            let mut v = Check::default();
            let page_size = Self::page_size(&mut v, r.page_size);
            v.finish()?;
            let page = self
                .driver()
                .list_machines(
                    &ctx,
                    ListMachines {
                        label_selector: convert::labels(&r.label_selector),
                        page_size,
                        page_token: r.page_token,
                        provider_spec: convert::opt_struct_to_json(r.provider_spec.as_ref()),
                        secrets: secrets.clone(),
                    },
                )
                .await?;
            Ok(pb::ListMachinesResponse {
                machines: page.items.iter().map(convert::machine).collect(),
                next_page_token: page.next_page_token,
            })
        })
    }

    async fn validate_machine_class(
        &self,
        req: Request<pb::ValidateMachineClassRequest>,
    ) -> std::result::Result<Response<pb::ValidateMachineClassResponse>, Status> {
        rpc!(self, req, Capability::ValidateMachineClass, "ValidateMachineClass", |ctx, r, secrets| {
            let mut v = Check::default();
            let spec = self.spec(&mut v, "provider_spec", r.provider_spec.as_ref());
            v.finish()?;
            let req = ValidateMachineClass { provider_spec: spec, secrets: secrets.clone() };
            let mut warnings = self.driver().validate_machine_class(&ctx, req.clone()).await?;
            let capacity = match self.driver().machine_capacity(&ctx, &req).await {
                Ok(capacity) => capacity.into_iter().collect(),
                Err(e) => {
                    warnings.push(format!("the machine capacity is not known: {}", e.message()));
                    Default::default()
                }
            };
            Ok(pb::ValidateMachineClassResponse { warnings, capacity })
        })
    }

    async fn can_update_machine(
        &self,
        req: Request<pb::CanUpdateMachineRequest>,
    ) -> std::result::Result<Response<pb::CanUpdateMachineResponse>, Status> {
        rpc!(self, req, Capability::InPlaceUpdate, "CanUpdateMachine", |ctx, r, secrets| {
            let mut v = Check::default();
            v.name("name", &r.name);
            let current = match r.current_provider_spec.as_ref() {
                Some(s) => convert::struct_to_json(s),
                None => {
                    v.missing("current_provider_spec");
                    Value::Null
                }
            };
            let desired = self.spec(&mut v, "desired_provider_spec", r.desired_provider_spec.as_ref());
            v.finish()?;
            let changed_paths = convert::changed_paths(&current, &desired);
            if changed_paths.is_empty() {
                // Nothing changes, so nothing is disrupted.
                return Ok(pb::CanUpdateMachineResponse {
                    disruption: pb::InPlaceDisruption::None as i32,
                    ..Default::default()
                });
            }
            let plan = self
                .driver()
                .can_update_machine(
                    &ctx,
                    CanUpdateMachine { name: r.name, current, desired, changed_paths, secrets: secrets.clone() },
                )
                .await?;
            Ok(pb::CanUpdateMachineResponse {
                in_place_paths: plan.in_place_paths,
                replace_paths: plan.replace_paths,
                disruption: plan.disruption.to_pb() as i32,
            })
        })
    }

    async fn update_machine(
        &self,
        req: Request<pb::UpdateMachineRequest>,
    ) -> std::result::Result<Response<pb::Operation>, Status> {
        rpc!(self, req, Capability::InPlaceUpdate, "UpdateMachine", |ctx, r, secrets| {
            let mut v = Check::default();
            v.name("name", &r.name);
            let spec = self.spec(&mut v, "provider_spec", r.provider_spec.as_ref());
            v.finish()?;
            let op = self
                .driver()
                .update_machine(&ctx, UpdateMachine { name: r.name, provider_spec: spec, secrets: secrets.clone() })
                .await?;
            Ok(self.operation(&ctx, op, &secrets))
        })
    }
}

fn machine_ref(name: String, provider_id: String, spec: Option<&prost_types::Struct>, secrets: Secrets) -> MachineRef {
    MachineRef {
        name,
        provider_id: Some(provider_id).filter(|p| !p.is_empty()),
        provider_spec: convert::opt_struct_to_json(spec),
        secrets,
    }
}

fn pool_ref(name: String, spec: Option<&prost_types::Struct>, secrets: Secrets) -> PoolRef {
    PoolRef { name, provider_spec: convert::opt_struct_to_json(spec), secrets }
}

// --------------------------------------------------------------------------------------- Pools

#[tonic::async_trait]
impl<D: Driver> pb::pools_server::Pools for DriverService<D> {
    async fn apply_pool(
        &self,
        req: Request<pb::ApplyPoolRequest>,
    ) -> std::result::Result<Response<pb::Operation>, Status> {
        rpc!(self, req, Capability::Pools, "ApplyPool", |ctx, r, secrets| {
            let mut v = Check::default();
            v.name("name", &r.name);
            let spec = self.spec(&mut v, "provider_spec", r.provider_spec.as_ref());
            if r.capacity < 0 {
                v.invalid("capacity", "must not be negative");
            }
            v.finish()?;
            let op = self
                .driver()
                .apply_pool(
                    &ctx,
                    ApplyPool {
                        name: r.name,
                        provider_spec: spec,
                        capacity: r.capacity as u32,
                        labels: convert::labels(&r.labels),
                        secrets: secrets.clone(),
                    },
                )
                .await?;
            Ok(self.operation(&ctx, op, &secrets))
        })
    }

    async fn get_pool(&self, req: Request<pb::GetPoolRequest>) -> std::result::Result<Response<pb::Pool>, Status> {
        rpc!(self, req, Capability::Pools, "GetPool", |ctx, r, secrets| {
            let mut v = Check::default();
            v.name("name", &r.name);
            v.finish()?;
            let p = self.driver().get_pool(&ctx, pool_ref(r.name, r.provider_spec.as_ref(), secrets.clone())).await?;
            Ok(convert::pool(&p))
        })
    }

    async fn list_pool_instances(
        &self,
        req: Request<pb::ListPoolInstancesRequest>,
    ) -> std::result::Result<Response<pb::ListPoolInstancesResponse>, Status> {
        rpc!(self, req, Capability::Pools, "ListPoolInstances", |ctx, r, secrets| {
            let mut v = Check::default();
            v.name("pool_name", &r.pool_name);
            let page_size = Self::page_size(&mut v, r.page_size);
            v.finish()?;
            let page = self
                .driver()
                .list_pool_instances(
                    &ctx,
                    ListPoolInstances {
                        pool: pool_ref(r.pool_name, r.provider_spec.as_ref(), secrets.clone()),
                        page_size,
                        page_token: r.page_token,
                    },
                )
                .await?;
            Ok(pb::ListPoolInstancesResponse {
                instances: page.items.iter().map(convert::pool_instance).collect(),
                next_page_token: page.next_page_token,
            })
        })
    }

    async fn delete_pool_instances(
        &self,
        req: Request<pb::DeletePoolInstancesRequest>,
    ) -> std::result::Result<Response<pb::Operation>, Status> {
        rpc!(self, req, Capability::Pools, "DeletePoolInstances", |ctx, r, secrets| {
            let instances = pool_instances(r.pool_name, r.instance_ids, r.provider_spec.as_ref(), &secrets)?;
            let op = self.driver().delete_pool_instances(&ctx, instances).await?;
            Ok(self.operation(&ctx, op, &secrets))
        })
    }

    async fn upgrade_pool_instances(
        &self,
        req: Request<pb::UpgradePoolInstancesRequest>,
    ) -> std::result::Result<Response<pb::Operation>, Status> {
        rpc!(self, req, Capability::Pools, "UpgradePoolInstances", |ctx, r, secrets| {
            let instances = pool_instances(r.pool_name, r.instance_ids, r.provider_spec.as_ref(), &secrets)?;
            let op = self.driver().upgrade_pool_instances(&ctx, instances).await?;
            Ok(self.operation(&ctx, op, &secrets))
        })
    }

    async fn delete_pool(
        &self,
        req: Request<pb::DeletePoolRequest>,
    ) -> std::result::Result<Response<pb::Operation>, Status> {
        rpc!(self, req, Capability::Pools, "DeletePool", |ctx, r, secrets| {
            let mut v = Check::default();
            v.name("name", &r.name);
            v.finish()?;
            let op =
                self.driver().delete_pool(&ctx, pool_ref(r.name, r.provider_spec.as_ref(), secrets.clone())).await?;
            Ok(self.operation(&ctx, op, &secrets))
        })
    }
}

fn pool_instances(
    pool_name: String,
    instance_ids: Vec<String>,
    spec: Option<&prost_types::Struct>,
    secrets: &Secrets,
) -> Result<PoolInstances> {
    let mut v = Check::default();
    v.name("pool_name", &pool_name);
    if instance_ids.is_empty() {
        v.missing("instance_ids");
    }
    for (i, id) in instance_ids.iter().enumerate() {
        if id.is_empty() {
            v.invalid(&format!("instance_ids[{i}]"), "must not be empty");
        }
    }
    v.finish()?;
    Ok(PoolInstances { pool: pool_ref(pool_name, spec, secrets.clone()), instance_ids })
}

// -------------------------------------------------------------------------------------- Events

#[tonic::async_trait]
impl<D: Driver> pb::events_server::Events for DriverService<D> {
    type WatchEventsStream =
        tokio_stream::wrappers::ReceiverStream<std::result::Result<pb::WatchEventsResponse, Status>>;

    async fn watch_events(
        &self,
        req: Request<pb::WatchEventsRequest>,
    ) -> std::result::Result<Response<Self::WatchEventsStream>, Status> {
        rpc!(self, req, |ctx| {
            self.require(Capability::Events, "WatchEvents")?;
            let settings = self.shared.events.settings(req.get_ref())?;
            self.shared.events.ensure_pump(self.shared.driver.clone());
            tracing::info!(
                keepalive = ?settings.keepalive,
                ack_deadline = ?settings.ack_deadline,
                resumed = settings.resume_after.is_some(),
                "event stream opened"
            );
            Ok(tokio_stream::wrappers::ReceiverStream::new(self.shared.events.stream(settings)))
        })
    }

    async fn ack_events(
        &self,
        req: Request<pb::AckEventsRequest>,
    ) -> std::result::Result<Response<pb::AckEventsResponse>, Status> {
        rpc!(self, req, |ctx| {
            self.require(Capability::Events, "AckEvents")?;
            let r = req.get_ref();
            let mut v = Check::default();
            if r.event_ids.is_empty() {
                v.missing("event_ids");
            }
            for (i, id) in r.event_ids.iter().enumerate() {
                if id.is_empty() {
                    v.invalid(&format!("event_ids[{i}]"), "must not be empty");
                }
            }
            v.finish()?;
            let mut out = pb::AckEventsResponse::default();
            for id in &r.event_ids {
                match self.shared.events.pending(id) {
                    Some(event) => {
                        // The source first: an event whose source still holds it stays pending.
                        self.driver().ack_event(&ctx, &event).await?;
                        self.shared.events.forget(id);
                        out.acked_event_ids.push(id.clone());
                    }
                    None => out.unknown_event_ids.push(id.clone()),
                }
            }
            Ok(out)
        })
    }
}

// ---------------------------------------------------------------------------------- Operations

#[tonic::async_trait]
impl<D: Driver> pb::operations_server::Operations for DriverService<D> {
    async fn get_operation(
        &self,
        req: Request<pb::GetOperationRequest>,
    ) -> std::result::Result<Response<pb::Operation>, Status> {
        rpc!(self, req, |ctx, r, secrets| {
            let mut v = Check::default();
            v.token(&r.token);
            v.finish()?;
            let handle = self.shared.codec.open(&r.token)?;
            let op = self.driver().get_operation(&ctx, handle, secrets.clone()).await?;
            Ok(self.operation(&ctx, op, &secrets))
        })
    }

    async fn wait_operation(
        &self,
        req: Request<pb::WaitOperationRequest>,
    ) -> std::result::Result<Response<pb::Operation>, Status> {
        rpc!(self, req, |ctx, r, secrets| {
            let mut v = Check::default();
            v.token(&r.token);
            v.finish()?;
            let handle = self.shared.codec.open(&r.token)?;
            let now = Instant::now();
            let mut until = now + r.timeout.as_ref().map(convert::from_duration).unwrap_or(MAX_WAIT).min(MAX_WAIT);
            if let Some(deadline) = ctx.deadline {
                until = until.min(deadline.checked_sub(DEADLINE_MARGIN).unwrap_or(now));
            }
            loop {
                let op = self.driver().get_operation(&ctx, handle.clone(), secrets.clone()).await?;
                let left = until.saturating_duration_since(Instant::now());
                if op.is_done() || left.is_zero() {
                    return Ok(self.operation(&ctx, op, &secrets));
                }
                // Deliberate poll interval: the cloud told us when to come back.
                tokio::time::sleep(op.poll_after.max(MIN_WAIT_POLL).min(left)).await;
            }
        })
    }

    async fn cancel_operation(
        &self,
        req: Request<pb::CancelOperationRequest>,
    ) -> std::result::Result<Response<pb::Operation>, Status> {
        rpc!(self, req, |ctx, r, secrets| {
            let mut v = Check::default();
            v.token(&r.token);
            v.finish()?;
            let handle = self.shared.codec.open(&r.token)?;
            let op = self.driver().cancel_operation(&ctx, handle, secrets.clone()).await?;
            Ok(self.operation(&ctx, op, &secrets))
        })
    }
}
