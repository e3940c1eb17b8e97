//! `DriverClient`: calls a driver sidecar over a Unix socket or TCP with a fresh request ID and
//! a deadline on every call, and returns typed errors.

use std::future::Future;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use machine_driver_proto::v1 as pb;
use tonic::transport::{Channel, Uri};
use tonic::{Request, Response, Status};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::endpoint::{Endpoint, EndpointError};
use crate::error::ErrorReport;
use crate::types::REQUEST_ID_HEADER;

/// The default per-call deadline (CSI's external-provisioner uses 15 s).
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(15);
/// How long establishing a connection may take; a call's own deadline bounds it further.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The HTTP/2 keepalive ping interval: 5 minutes, the least the default ping policy of grpc-go
/// and C-core servers accepts.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(300);
/// How much longer than the call timeout the client waits itself (beyond the `grpc-timeout` the
/// server enforces), so a connect that never completes still ends.
const CLIENT_DEADLINE_SLACK: Duration = Duration::from_secs(1);

/// A successful reply and the request ID it was sent with.
#[derive(Debug, Clone)]
pub struct Reply<T> {
    /// The response message.
    pub value: T,
    /// The request ID of the call (as echoed by the driver).
    pub request_id: String,
}

impl<T> Reply<T> {
    /// The response message.
    pub fn into_inner(self) -> T {
        self.value
    }
}

/// A failed call: which RPC, and the decoded status (its `request_id` is always set).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{method}: {report}")]
pub struct CallError {
    /// The RPC.
    pub method: &'static str,
    /// Code, reason, retry-after, request IDs, violations, causes.
    pub report: ErrorReport,
}

impl CallError {
    fn new(method: &'static str, status: &Status, request_id: &str) -> Self {
        let mut report = ErrorReport::from_status(status);
        // tonic reports a broken connection as UNKNOWN with the transport error as its source;
        // for callers that is the retryable UNAVAILABLE (the driver never answered).
        if report.code == tonic::Code::Unknown
            && report.reason.is_empty()
            && std::error::Error::source(status).is_some()
        {
            report.code = tonic::Code::Unavailable;
        }
        if report.request_id.is_empty() {
            report.request_id = request_id.to_string();
        }
        Self { method, report }
    }

    /// The gRPC code.
    pub fn code(&self) -> tonic::Code {
        self.report.code
    }

    /// The ErrorInfo reason (empty if none).
    pub fn reason(&self) -> &str {
        &self.report.reason
    }

    /// The delay the driver asked for.
    pub fn retry_after(&self) -> Option<Duration> {
        self.report.retry_after
    }

    /// The request ID of the failed call.
    pub fn request_id(&self) -> &str {
        &self.report.request_id
    }
}

/// The result of a client call.
pub type CallResult<T> = Result<Reply<T>, CallError>;

/// Why a client could not be created.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The endpoint string is malformed.
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    /// Connecting failed.
    #[error("connecting to {endpoint}")]
    Connect {
        /// The endpoint.
        endpoint: String,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
}

/// A client of one driver sidecar. Cheap to clone; reconnects by itself after the sidecar
/// restarts.
#[derive(Debug, Clone)]
pub struct DriverClient {
    identity: pb::identity_client::IdentityClient<Channel>,
    machines: pb::machines_client::MachinesClient<Channel>,
    pools: pb::pools_client::PoolsClient<Channel>,
    events: pb::events_client::EventsClient<Channel>,
    operations: pb::operations_client::OperationsClient<Channel>,
    call_timeout: Duration,
    endpoint: String,
    channel: Channel,
}

fn builder(endpoint: &Endpoint) -> tonic::transport::Endpoint {
    let uri = match endpoint {
        // The authority is ignored: the connector dials the socket.
        Endpoint::Unix(_) => "http://driver.sock".to_string(),
        Endpoint::Tcp(addr) => format!("http://{addr}"),
    };
    // Both forms are valid URIs by construction.
    tonic::transport::Endpoint::from_shared(uri)
        .unwrap_or_else(|_| tonic::transport::Endpoint::from_static("http://driver.sock"))
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        // Pings only during calls and at most every 5 minutes: the default ping policy of
        // grpc-go and C-core servers (a third party's driver) answers more frequent pings, or any
        // ping without a call, with GOAWAY "too_many_pings". Call deadlines bound every wait.
        .http2_keep_alive_interval(KEEP_ALIVE_INTERVAL)
        .keep_alive_while_idle(false)
}

fn unix_connector(
    path: std::path::PathBuf,
) -> impl tower::Service<
    Uri,
    Response = TokioIo<tokio::net::UnixStream>,
    Error = std::io::Error,
    Future = impl Future<Output = std::io::Result<TokioIo<tokio::net::UnixStream>>> + Send,
> + Clone
       + Send
       + 'static {
    tower::service_fn(move |_: Uri| {
        let path = path.clone();
        async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
    })
}

impl DriverClient {
    /// Connects now; fails if the sidecar is not there.
    ///
    /// # Errors
    /// A malformed endpoint or a failed connection.
    pub async fn connect(endpoint: &str) -> Result<Self, ConnectError> {
        let ep: Endpoint = endpoint.parse()?;
        let b = builder(&ep);
        let channel = match &ep {
            Endpoint::Unix(path) => b.connect_with_connector(unix_connector(path.clone())).await,
            Endpoint::Tcp(_) => b.connect().await,
        }
        .map_err(|source| ConnectError::Connect { endpoint: endpoint.to_string(), source })?;
        Ok(Self::from_channel(channel, endpoint))
    }

    /// A client that connects on first use (and again after failures).
    ///
    /// # Errors
    /// A malformed endpoint.
    pub fn connect_lazy(endpoint: &str) -> Result<Self, EndpointError> {
        let ep: Endpoint = endpoint.parse()?;
        let b = builder(&ep);
        let channel = match &ep {
            Endpoint::Unix(path) => b.connect_with_connector_lazy(unix_connector(path.clone())),
            Endpoint::Tcp(_) => b.connect_lazy(),
        };
        Ok(Self::from_channel(channel, endpoint))
    }

    fn from_channel(channel: Channel, endpoint: &str) -> Self {
        Self {
            identity: pb::identity_client::IdentityClient::new(channel.clone()),
            machines: pb::machines_client::MachinesClient::new(channel.clone()),
            pools: pb::pools_client::PoolsClient::new(channel.clone()),
            events: pb::events_client::EventsClient::new(channel.clone()),
            operations: pb::operations_client::OperationsClient::new(channel.clone()),
            call_timeout: DEFAULT_CALL_TIMEOUT,
            endpoint: endpoint.to_string(),
            channel,
        }
    }

    /// The same client with another per-call deadline.
    #[must_use]
    pub fn with_call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// The underlying channel, for other services on the same sidecar (health, reflection).
    pub fn channel(&self) -> Channel {
        self.channel.clone()
    }

    /// The endpoint this client calls.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// A request with a fresh request ID and the current trace context, and that ID.
    fn request<Req>(message: Req) -> (Request<Req>, String) {
        let request_id = uuid::Uuid::new_v4().to_string();
        let mut req = Request::new(message);
        if let Ok(v) = request_id.parse() {
            req.metadata_mut().insert(REQUEST_ID_HEADER, v);
        }
        let cx = tracing::Span::current().context();
        opentelemetry::global::get_text_map_propagator(|p| {
            p.inject_context(&cx, &mut MetadataInjector(req.metadata_mut()))
        });
        (req, request_id)
    }

    /// Sends one call with a fresh request ID, the trace context of its own client span (a child
    /// of the current span) and the deadline. `full_method` is `package.Service/Method`, the
    /// span's name; `method` names the call in its error.
    async fn call<Req, Resp, Fut>(
        &self,
        full_method: &'static str,
        method: &'static str,
        message: Req,
        send: impl FnOnce(Request<Req>) -> Fut,
    ) -> CallResult<Resp>
    where
        Fut: Future<Output = Result<Response<Resp>, Status>>,
    {
        let span = tracing::info_span!(
            "driver_call",
            "otel.name" = %full_method,
            "otel.kind" = "client",
            "rpc.method" = %full_method,
            "request.id" = tracing::field::Empty,
        );
        machine_driver_util::telemetry::rpc::start(&span, &self.endpoint);
        let sent = async {
            let (mut req, request_id) = Self::request(message);
            tracing::Span::current().record("request.id", request_id.as_str());
            req.set_timeout(self.call_timeout);
            // The client-side bound covers a connect that never completes, too.
            match tokio::time::timeout(self.call_timeout + CLIENT_DEADLINE_SLACK, send(req)).await {
                Ok(Ok(resp)) => {
                    let echoed =
                        resp.metadata().get(REQUEST_ID_HEADER).and_then(|v| v.to_str().ok()).map(str::to_string);
                    Ok(Reply { value: resp.into_inner(), request_id: echoed.unwrap_or(request_id) })
                }
                Ok(Err(status)) => Err(CallError::new(method, &status, &request_id)),
                Err(_) => Err(CallError::new(
                    method,
                    &Status::deadline_exceeded("the driver did not answer in time"),
                    &request_id,
                )),
            }
        };
        let result = sent.instrument(span.clone()).await;
        let code = result.as_ref().map_or_else(|e| e.report.code, |_| tonic::Code::Ok);
        machine_driver_util::telemetry::rpc::finish(&span, crate::types::code_name(code));
        result
    }
}

macro_rules! rpcs {
    ($($(#[$doc:meta])* $name:ident, $field:ident, $service:literal, $method:literal, $req:ty => $resp:ty;)*) => {
        impl DriverClient {
            $(
                $(#[$doc])*
                ///
                /// # Errors
                /// The driver's error, decoded ([`CallError`]).
                pub async fn $name(&self, req: $req) -> CallResult<$resp> {
                    let mut c = self.$field.clone();
                    self.call(concat!("machinedriver.v1.", $service, "/", $method), $method, req, |r| async move { c.$name(r).await }).await
                }
            )*
        }
    };
}

rpcs! {
    /// GetDriverInfo.
    get_driver_info, identity, "Identity", "GetDriverInfo", pb::GetDriverInfoRequest => pb::GetDriverInfoResponse;
    /// GetCapabilities.
    get_capabilities, identity, "Identity", "GetCapabilities", pb::GetCapabilitiesRequest => pb::GetCapabilitiesResponse;
    /// Probe.
    probe, identity, "Identity", "Probe", pb::ProbeRequest => pb::ProbeResponse;
    /// CreateMachine.
    create_machine, machines, "Machines", "CreateMachine", pb::CreateMachineRequest => pb::Operation;
    /// DeleteMachine.
    delete_machine, machines, "Machines", "DeleteMachine", pb::DeleteMachineRequest => pb::Operation;
    /// GetMachineStatus.
    get_machine_status, machines, "Machines", "GetMachineStatus", pb::GetMachineStatusRequest => pb::Machine;
    /// ListMachines (one page).
    list_machines, machines, "Machines", "ListMachines", pb::ListMachinesRequest => pb::ListMachinesResponse;
    /// ValidateMachineClass.
    validate_machine_class, machines, "Machines", "ValidateMachineClass", pb::ValidateMachineClassRequest => pb::ValidateMachineClassResponse;
    /// CanUpdateMachine.
    can_update_machine, machines, "Machines", "CanUpdateMachine", pb::CanUpdateMachineRequest => pb::CanUpdateMachineResponse;
    /// UpdateMachine.
    update_machine, machines, "Machines", "UpdateMachine", pb::UpdateMachineRequest => pb::Operation;
    /// ApplyPool.
    apply_pool, pools, "Pools", "ApplyPool", pb::ApplyPoolRequest => pb::Operation;
    /// GetPool.
    get_pool, pools, "Pools", "GetPool", pb::GetPoolRequest => pb::Pool;
    /// ListPoolInstances (one page).
    list_pool_instances, pools, "Pools", "ListPoolInstances", pb::ListPoolInstancesRequest => pb::ListPoolInstancesResponse;
    /// DeletePoolInstances.
    delete_pool_instances, pools, "Pools", "DeletePoolInstances", pb::DeletePoolInstancesRequest => pb::Operation;
    /// UpgradePoolInstances.
    upgrade_pool_instances, pools, "Pools", "UpgradePoolInstances", pb::UpgradePoolInstancesRequest => pb::Operation;
    /// DeletePool.
    delete_pool, pools, "Pools", "DeletePool", pb::DeletePoolRequest => pb::Operation;
    /// AckEvents.
    ack_events, events, "Events", "AckEvents", pb::AckEventsRequest => pb::AckEventsResponse;
    /// GetOperation.
    get_operation, operations, "Operations", "GetOperation", pb::GetOperationRequest => pb::Operation;
    /// WaitOperation (use a client whose call timeout exceeds the wait).
    wait_operation, operations, "Operations", "WaitOperation", pb::WaitOperationRequest => pb::Operation;
    /// CancelOperation.
    cancel_operation, operations, "Operations", "CancelOperation", pb::CancelOperationRequest => pb::Operation;
}

impl DriverClient {
    /// WatchEvents: the stream of the driver's events. The call timeout bounds opening the
    /// stream (its response headers), not the stream, which lasts until it is dropped or the
    /// driver drains; the driver's keepalives say it is alive.
    ///
    /// # Errors
    /// The driver's error, decoded ([`CallError`]), when the stream cannot be opened.
    pub async fn watch_events(
        &self,
        req: pb::WatchEventsRequest,
    ) -> CallResult<tonic::Streaming<pb::WatchEventsResponse>> {
        // No grpc-timeout: it would end the stream, not only its opening.
        let (r, request_id) = Self::request(req);
        let mut c = self.events.clone();
        match tokio::time::timeout(self.call_timeout + CLIENT_DEADLINE_SLACK, c.watch_events(r)).await {
            Ok(Ok(resp)) => {
                let echoed = resp.metadata().get(REQUEST_ID_HEADER).and_then(|v| v.to_str().ok()).map(str::to_string);
                Ok(Reply { value: resp.into_inner(), request_id: echoed.unwrap_or(request_id) })
            }
            Ok(Err(status)) => Err(CallError::new("WatchEvents", &status, &request_id)),
            Err(_) => Err(CallError::new(
                "WatchEvents",
                &Status::deadline_exceeded("the driver did not open the event stream in time"),
                &request_id,
            )),
        }
    }

    /// Every machine matching `labels`, following pagination, each page sent with `secrets` (the
    /// credentials of the class whose machines are listed).
    ///
    /// # Errors
    /// The first failing page's error.
    pub async fn list_all_machines(
        &self,
        labels: std::collections::HashMap<String, String>,
        page_size: i32,
        secrets: Option<pb::Secrets>,
    ) -> Result<Vec<pb::Machine>, CallError> {
        self.list_all_machines_in(labels, page_size, secrets, None).await
    }

    /// Like [`DriverClient::list_all_machines`], where a class's `provider_spec` says (the
    /// region, subscription or resource group a driver lists in).
    ///
    /// # Errors
    /// The first failed page.
    pub async fn list_all_machines_in(
        &self,
        labels: std::collections::HashMap<String, String>,
        page_size: i32,
        secrets: Option<pb::Secrets>,
        provider_spec: Option<prost_types::Struct>,
    ) -> Result<Vec<pb::Machine>, CallError> {
        let mut out = Vec::new();
        let mut page_token = String::new();
        loop {
            let page = self
                .list_machines(pb::ListMachinesRequest {
                    label_selector: labels.clone(),
                    page_size,
                    page_token,
                    secrets: secrets.clone(),
                    provider_spec: provider_spec.clone(),
                })
                .await?
                .value;
            out.extend(page.machines);
            if page.next_page_token.is_empty() {
                return Ok(out);
            }
            page_token = page.next_page_token;
        }
    }
}

/// Helpers on a received [`pb::Operation`].
pub trait OperationExt {
    /// The failure of a done operation, decoded.
    fn error_report(&self) -> Option<ErrorReport>;
    /// When to poll next ([`DEFAULT_POLL_AFTER`](crate::DEFAULT_POLL_AFTER) when the driver did not say).
    fn poll_after(&self) -> Duration;
    /// The machine a done operation produced.
    fn machine(&self) -> Option<&pb::Machine>;
}

impl OperationExt for pb::Operation {
    fn error_report(&self) -> Option<ErrorReport> {
        match &self.result {
            Some(pb::operation::Result::Error(s)) => Some(ErrorReport::from_rpc_status(s)),
            _ => None,
        }
    }

    fn poll_after(&self) -> Duration {
        self.poll_after.as_ref().map(crate::convert::from_duration).unwrap_or(crate::types::DEFAULT_POLL_AFTER)
    }

    fn machine(&self) -> Option<&pb::Machine> {
        match &self.result {
            Some(pb::operation::Result::Response(r)) => r.machine.as_ref(),
            _ => None,
        }
    }
}

struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl opentelemetry::propagation::Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            tonic::metadata::MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(k, v);
        }
    }
}
