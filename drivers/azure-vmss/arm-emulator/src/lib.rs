//! # arm-emulator
//!
//! Test support: an in-memory emulator of the slice of Azure Resource Manager that the
//! `azure-vmss-driver` uses — Microsoft.Compute virtual machine scale sets (Uniform, and Flexible
//! ones that VMs join by reference) and virtual machines with their network interfaces and OS
//! disks (see the `vms` module) at `api-version=2024-07-01` — served at the root of a plain HTTP
//! listener, the way the ARM endpoint is (`--arm-endpoint http://127.0.0.1:PORT`).
//!
//! It follows the ARM async contract (the Azure VMSS chapter, `docs/src/operating/azure-vmss.md`,
//! sums it up under "Testing against the ARM emulator"):
//!
//! - `PUT` a scale set → 201 (new) / 200 (existing) with `provisioningState` `Creating` /
//!   `Updating` and an `Azure-AsyncOperation` header;
//! - `DELETE` a scale set, `POST …/delete` (`{"instanceIds":[…]}`), `POST …/manualupgrade` → 202
//!   with `Location`, `Azure-AsyncOperation` and `Retry-After`; `DELETE` of a missing scale set →
//!   204; a mutating call while another operation runs on the scale set → 409;
//! - the async-operation URL
//!   (`/subscriptions/{s}/providers/Microsoft.Compute/locations/{loc}/operations/{id}`) answers 200
//!   `{id, name, status, startTime, endTime, percentComplete, error}`; the Location URL (the same
//!   path with `monitor=true`) answers 202 until the operation is done;
//! - `GET` the scale set, the VM list (`$expand=instanceView`, absolute `nextLink`), one VM and its
//!   instance view;
//! - a scale set with `properties.orchestrationMode: Flexible` holds no instances of its own model
//!   (`sku.capacity` above 0 → 400 `InvalidParameter`); its `sku.capacity` counts the virtual
//!   machines whose `properties.virtualMachineScaleSet.id` names it, its `…/virtualMachines`,
//!   `…/delete` and `…/manualupgrade` paths answer 409 `OperationNotAllowed`, the mode cannot
//!   change (409 `PropertyChangeNotAllowed`), and deleting it deletes its VMs;
//! - virtual machines (`…/Microsoft.Compute/virtualMachines/{vm}`: PUT, PATCH, GET with
//!   `$expand=instanceView`, `…/instanceView`, DELETE, listings by resource group and by
//!   subscription), the NICs and OS disks they create, and `GET`/`DELETE` of those (see `vms`);
//! - every response carries `x-ms-request-id` and `x-ms-correlation-request-id`, echoes
//!   `x-ms-client-request-id`, and has `x-ms-ratelimit-remaining-*` headers; errors are
//!   `{"error":{"code","message","target"}}` plus the `x-ms-error-code` header;
//! - authentication: a missing bearer token is 401 `AuthenticationFailed`; a token from the
//!   emulated Entra token endpoint (below) is recorded with its principal (`tenant/clientId`),
//!   and is 401 `ExpiredAuthenticationToken` once expired (401
//!   `InvalidAuthenticationTokenAudience` when issued for another resource); any other bearer
//!   token is accepted with no principal (tests with a fixed token).
//!
//! **Microsoft Entra ID token endpoint** (see the `entra` module): the same listener serves
//! `POST /{tenant}/oauth2/v2.0/token`, the OAuth 2.0 client-credentials grant as
//! `azure_identity` sends it when its authority host is the emulator's URL
//! (`--authority-host http://127.0.0.1:PORT`): form-encoded `grant_type=client_credentials`,
//! `client_id`, `scope` (one `<resource>/.default`) and either `client_secret` or
//! `client_assertion_type=urn:ietf:params:oauth:client-assertion-type:jwt-bearer` +
//! `client_assertion` (workload identity). The principals it knows come from `--principal
//! TENANT:CLIENT_ID:SECRET` / `--federated-principal TENANT:CLIENT_ID:TOKEN` (repeatable;
//! [`Config::principals`]) and `PUT /_emulator/principals`. Success is `{"token_type":"Bearer",
//! "expires_in":N,"ext_expires_in":N,"access_token":"<opaque random>"}` with N from
//! `--token-lifetime` ([`Config::token_lifetime`], default 3600 s); a wrong secret is 401
//! `invalid_client` (AADSTS7000215), an unknown client 400 `unauthorized_client` (AADSTS700016),
//! an unknown tenant 400 (AADSTS90002), an assertion that is not the registered token 400
//! (AADSTS70021), all in Entra's JSON error shape (`error`, `error_description`, `error_codes`,
//! `trace_id`, `correlation_id`, `timestamp`).
//!
//! Operations take a configurable time and are advanced lazily on every request, so the
//! emulator is deterministic and keeps operation state across polls and across restarts of its
//! clients (the state lives here, not in the driver).
//!
//! Test hooks under `/_emulator/`: `GET requests` (every ARM request received, with its
//! `x-ms-client-request-id`), `DELETE requests`, `GET|PUT faults` (fault rules: immediate error
//! responses such as 429 with `Retry-After`, 500, 503, 409; operations that end `Failed` or
//! `Canceled`; or every operation in flight finished just before a matching request is answered,
//! so the cloud changes at an exact point of a client's request sequence, e.g. between two pages
//! of a listing), `GET scalesets` (the emulated cloud), `GET vms` (every VM with its scale set,
//! states, NICs and OS disk), `GET tokens` (every token issued: tenant, client ID, grant type,
//! credential kind, scope, issue and expiry time, whether expired — never a token or a secret),
//! `GET principals` (who is registered, without secrets) and `PUT principals` (replace them: a
//! JSON list of `{tenantId, clientId, clientSecret?, federatedToken?}`), and `GET|PUT zones`
//! (zones that refuse new VMs, a JSON list of [`ZoneRule`]s, also [`Config::zones`]).
//!
//! **Zones.** A zone refuses new VMs — a VM whose `zones` names it, or the instances a Uniform
//! scale set adds there (instance `n` of a scale set with zones `z` is in `z[n % len]`) — the way
//! ARM does:
//!
//! - `capacity`: the create is accepted (201, `Creating`) and its operation ends `Failed` with
//!   `ZonalAllocationFailed` ("Allocation failed. We do not have sufficient capacity for the
//!   requested VM size in this zone. …"); the VM stays, `Failed`, its instance view saying
//!   `ProvisioningState/failed/ZonalAllocationFailed`, and a `PUT` of it again fails the same way
//!   while the zone refuses. A scale set's instances in the zone end `Failed`, the others run.
//! - `sku`: 409 `SkuNotAvailable` at once ("The requested size for resource '…' is currently not
//!   available in location '…' zones '…' …"); nothing is created.

use machine_driver_util::lock;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use axum::body::{to_bytes, Body};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::response::Response;
use axum::Router;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

mod entra;
mod vms;

pub use entra::Principal;

/// The only api-version served.
pub const API_VERSION: &str = "2024-07-01";
/// The largest request body read; a larger one reads as empty.
const MAX_BODY: usize = 4 * 1024 * 1024;
/// Characters ARM refuses in tag names.
const BAD_TAG_CHARS: &[char] = &['<', '>', '%', '&', '\\', '?', '/'];

/// [`Config::operation_duration`] by default (`--operation-duration`): long enough that a driver
/// sees operations running and polls them, short enough for tests.
pub const DEFAULT_OPERATION_DURATION: Duration = Duration::from_secs(2);
/// [`Config::delete_duration`] by default (`--delete-duration`).
pub const DEFAULT_DELETE_DURATION: Duration = Duration::from_secs(1);
/// [`Config::upgrade_duration`] by default (`--upgrade-duration`).
pub const DEFAULT_UPGRADE_DURATION: Duration = Duration::from_secs(1);
/// [`Config::retry_after_secs`] by default (`--retry-after`): the smallest whole `Retry-After`.
pub const DEFAULT_RETRY_AFTER_SECS: u64 = 1;
/// [`Config::page_size`] by default (`--page-size`): small, so a few VMs already take several
/// pages and `nextLink` is followed.
pub const DEFAULT_PAGE_SIZE: usize = 2;
/// [`Config::eviction_delay`] by default (`--eviction-delay`): at once, so tests need not wait
/// the half minute ARM takes.
pub const DEFAULT_EVICTION_DELAY: Duration = Duration::ZERO;
/// [`Config::token_lifetime`] by default (`--token-lifetime`): an Entra token's usual lifetime.
pub const DEFAULT_TOKEN_LIFETIME: Duration = Duration::from_secs(3600);

/// How the emulated cloud behaves.
#[derive(Debug, Clone)]
pub struct Config {
    /// How long a scale-set create or update takes.
    pub operation_duration: Duration,
    /// How long deletes (scale set or instances) take.
    pub delete_duration: Duration,
    /// How long a manual upgrade takes.
    pub upgrade_duration: Duration,
    /// `Retry-After` (seconds) sent with accepted operations and in-progress polls.
    pub retry_after_secs: u64,
    /// VMs per page of the VM list (the rest follows through `nextLink`).
    pub page_size: usize,
    /// Most VMs in the subscription; a PUT beyond it fails with a quota error (409).
    pub max_instances: Option<u64>,
    /// Fault rules active from the start.
    pub faults: Vec<Fault>,
    /// Principals the Entra token endpoint knows from the start.
    pub principals: Vec<Principal>,
    /// Lifetime of the access tokens it issues (`expires_in`, in whole seconds).
    pub token_lifetime: Duration,
    /// Zones that refuse new VMs from the start.
    pub zones: Vec<ZoneRule>,
    /// How long after `simulateEviction` a Spot VM is evicted (ARM: about 30 s).
    pub eviction_delay: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            operation_duration: DEFAULT_OPERATION_DURATION,
            delete_duration: DEFAULT_DELETE_DURATION,
            upgrade_duration: DEFAULT_UPGRADE_DURATION,
            retry_after_secs: DEFAULT_RETRY_AFTER_SECS,
            page_size: DEFAULT_PAGE_SIZE,
            max_instances: None,
            faults: Vec::new(),
            principals: Vec::new(),
            token_lifetime: DEFAULT_TOKEN_LIFETIME,
            zones: Vec::new(),
            eviction_delay: DEFAULT_EVICTION_DELAY,
        }
    }
}

/// What a fault rule does to a matching request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum FaultAction {
    /// Answer at once with `status` and a CloudError (429 adds `Retry-After` and
    /// `x-ms-ratelimit-*` headers).
    Respond,
    /// Accept the mutating request; its operation ends `Failed` with `code` / `message`.
    FailOperation,
    /// Accept the mutating request; its operation ends `Canceled`.
    CancelOperation,
    /// Before answering the matching request (any method), finish every operation in flight
    /// now, as if its time had come; the request is then served normally. Makes the cloud
    /// change at an exact point of a client's sequence of requests, e.g. an instance delete
    /// completing between two pages of a VM listing.
    FinishOperations,
}

/// A fault-injection rule. Matches by HTTP method and a substring of the lower-cased path.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Fault {
    /// HTTP method to match (any when absent).
    #[serde(default)]
    pub method: Option<String>,
    /// Substring of the lower-cased request path (any when absent).
    #[serde(default)]
    pub path_contains: Option<String>,
    /// Substring of the percent-decoded query string, compared case-insensitively (any when
    /// absent), e.g. `$skiptoken` for the pages after the first of a listing.
    #[serde(default)]
    pub query_contains: Option<String>,
    /// What to do.
    pub action: FaultAction,
    /// HTTP status for `respond` (default 500).
    #[serde(default)]
    pub status: Option<u16>,
    /// ARM error code (defaults by status).
    #[serde(default)]
    pub code: Option<String>,
    /// Error message.
    #[serde(default)]
    pub message: Option<String>,
    /// Error target.
    #[serde(default)]
    pub target: Option<String>,
    /// `Retry-After` seconds for `respond` (429 defaults to 1).
    #[serde(default)]
    pub retry_after: Option<u64>,
    /// How often the rule fires (forever when absent).
    #[serde(default)]
    pub times: Option<u32>,
    /// How often it fired (reported by `GET /_emulator/faults`).
    #[serde(default)]
    pub fired: u32,
}

/// How a zone refuses new VMs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ZoneRefusal {
    /// No capacity: the create is accepted and its operation ends `Failed` with
    /// `ZonalAllocationFailed`; the VM stays, `Failed`.
    Capacity,
    /// The size is not offered in the zone: 409 `SkuNotAvailable` at once, nothing is created.
    Sku,
}

/// A zone that refuses new VMs (`PUT /_emulator/zones`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ZoneRule {
    /// The zone, e.g. `"2"`.
    pub zone: String,
    /// How it refuses.
    pub refuse: ZoneRefusal,
    /// Only VMs of this size, compared case-insensitively (any size when absent).
    #[serde(default)]
    pub vm_size: Option<String>,
}

/// ARM's error code of a zonal VM that found no capacity.
const ZONAL_ALLOCATION_FAILED: &str = "ZonalAllocationFailed";

/// The rule by which one of `zones` refuses a new VM of `size`, if any.
fn zone_refusal(cloud: &Cloud, zones: &[String], size: &str) -> Option<ZoneRule> {
    cloud
        .zones
        .iter()
        .find(|r| zones.contains(&r.zone) && r.vm_size.as_deref().is_none_or(|s| s.eq_ignore_ascii_case(size)))
        .cloned()
}

/// The zones a resource body names (`zones`).
fn zones_of(body: &Value) -> Vec<String> {
    body["zones"]
        .as_array()
        .map(|z| z.iter().filter_map(|z| z.as_str().map(str::to_string)).collect())
        .unwrap_or_default()
}

/// ARM's answer to a size the zone does not offer.
fn sku_not_available(id: &str, location: &str, zone: &str, subscription: &str) -> Answer {
    Answer::error(
        StatusCode::CONFLICT,
        "SkuNotAvailable",
        format!(
            "The requested size for resource '{id}' is currently not available in location '{location}' zones \
             '{zone}' for subscription '{subscription}'. Please try another size or deploy to a different location \
             or zones. See https://aka.ms/azureskunotavailable for details."
        ),
    )
}

/// Makes a just-started operation end `Failed` with `ZonalAllocationFailed`, unless a fault rule
/// already decided how it ends; returns whether it did.
fn refuse_allocation(cloud: &mut Cloud, op_id: &str) -> bool {
    let Some(op) = cloud.ops.get_mut(op_id).filter(|o| o.outcome == Outcome::Succeed) else { return false };
    op.outcome = Outcome::Fail;
    op.error = (
        ZONAL_ALLOCATION_FAILED.into(),
        "Allocation failed. We do not have sufficient capacity for the requested VM size in this zone. Read more \
         about improving likelihood of allocation success at http://aka.ms/allocation-guidance"
            .into(),
    );
    true
}

/// One ARM request as the emulator received it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RecordedRequest {
    /// HTTP method.
    pub method: String,
    /// Path.
    pub path: String,
    /// Query string.
    pub query: String,
    /// `x-ms-client-request-id` sent by the client.
    pub client_request_id: Option<String>,
    /// `x-ms-request-id` the emulator issued.
    pub request_id: String,
    /// `x-ms-correlation-request-id` of the response.
    pub correlation_request_id: String,
    /// Whether a bearer token was sent.
    pub authorized: bool,
    /// Who the bearer token was issued to by the emulated Entra token endpoint
    /// (`tenant/clientId`); `None` for any other token.
    #[serde(default)]
    pub principal: Option<String>,
    /// Response status.
    pub status: u16,
    /// The request body, when JSON.
    #[serde(default)]
    pub body: Value,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Succeed,
    Fail,
    Cancel,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum OpKind {
    Apply {
        created: Vec<u64>,
        removed: Vec<u64>,
        /// Created instances whose zone found no capacity: when the operation fails for them,
        /// only they end `Failed`.
        refused: Vec<u64>,
    },
    DeleteScaleSet,
    DeleteInstances(Vec<u64>),
    Upgrade(Vec<u64>),
    /// A virtual machine PUT that created it.
    CreateVm,
    /// A virtual machine PUT or PATCH on an existing one.
    UpdateVm,
    /// A virtual machine DELETE.
    DeleteVm,
    /// `POST …/deallocate` (`true`) or `…/powerOff` (`false`) of a virtual machine.
    StopVm {
        deallocate: bool,
    },
}

#[derive(Debug, Clone)]
struct Op {
    id: String,
    subscription: String,
    location: String,
    /// Key (lower-cased id) of the resource the operation acts on.
    target: String,
    method: String,
    kind: OpKind,
    started: Instant,
    start_time: SystemTime,
    duration: Duration,
    outcome: Outcome,
    error: (String, String),
    /// Set once finished: the final status and when.
    done: Option<(&'static str, SystemTime)>,
}

#[derive(Debug, Clone)]
struct Vm {
    model_version: u64,
    provisioning_state: String,
    power_state: String,
    time_created: SystemTime,
    vm_id: String,
}

#[derive(Debug, Clone)]
struct ScaleSet {
    id: String,
    name: String,
    subscription: String,
    location: String,
    /// The stored resource as PUT (read-only properties are overlaid when shown).
    body: Value,
    capacity: u64,
    model: Value,
    model_version: u64,
    provisioning_state: String,
    vms: BTreeMap<u64, Vm>,
    next_instance: u64,
    unique_id: String,
    time_created: SystemTime,
    etag: u64,
    op: Option<String>,
}

#[derive(Default)]
struct Cloud {
    scale_sets: BTreeMap<String, ScaleSet>,
    /// Virtual machines by key (lower-cased id).
    vms: BTreeMap<String, vms::VirtualMachine>,
    /// Network interfaces by key.
    nics: BTreeMap<String, vms::Nic>,
    /// Managed disks by key.
    disks: BTreeMap<String, vms::Disk>,
    /// Private IP addresses handed out so far.
    next_ip: u32,
    ops: BTreeMap<String, Op>,
    faults: Vec<Fault>,
    requests: Vec<RecordedRequest>,
    /// The Entra token endpoint's principals and the tokens it issued.
    tokens: entra::Tokens,
    /// Zones that refuse new VMs.
    zones: Vec<ZoneRule>,
}

/// The emulator: shared state behind the router.
#[derive(Clone)]
pub struct Emulator {
    config: Arc<Config>,
    cloud: Arc<Mutex<Cloud>>,
}

/// Errors serving the emulator.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Binding the listener failed.
    #[error("binding {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Serving failed.
    #[error("serving HTTP")]
    Serve(#[source] std::io::Error),
}

impl Emulator {
    /// An emulator with `config`.
    pub fn new(config: Config) -> Self {
        let cloud = Cloud {
            faults: config.faults.clone(),
            tokens: entra::Tokens::new(config.principals.clone()),
            zones: config.zones.clone(),
            ..Cloud::default()
        };
        Self { config: Arc::new(config), cloud: Arc::new(Mutex::new(cloud)) }
    }

    /// The HTTP router (ARM paths and the Entra token endpoint at the root, test hooks under
    /// `/_emulator/`).
    pub fn router(&self) -> Router {
        Router::new().fallback(handle).with_state(self.clone())
    }

    /// Binds `addr` and returns the bound address and the server future.
    ///
    /// # Errors
    /// Binding failures.
    pub async fn bind(
        &self,
        addr: SocketAddr,
    ) -> Result<(SocketAddr, impl std::future::Future<Output = Result<(), Error>>), Error> {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|source| Error::Bind { addr, source })?;
        let local = listener.local_addr().map_err(|source| Error::Bind { addr, source })?;
        let router = self.router();
        Ok((local, async move { axum::serve(listener, router).await.map_err(Error::Serve) }))
    }

    fn lock(&self) -> MutexGuard<'_, Cloud> {
        // A panic while holding the lock would be a bug in the emulator; keep serving anyway.
        lock(&self.cloud)
    }
}

/// Everything a handler needs to know about the request.
struct Call {
    method: Method,
    path: String,
    query: BTreeMap<String, String>,
    /// The percent-decoded query string, for fault rules.
    decoded_query: String,
    base: String,
    body: Value,
}

/// An ARM answer before the common headers are added.
struct Answer {
    status: StatusCode,
    headers: Vec<(String, String)>,
    body: Option<Value>,
}

impl Answer {
    fn json(status: StatusCode, body: Value) -> Self {
        Self { status, headers: Vec::new(), body: Some(body) }
    }

    fn empty(status: StatusCode) -> Self {
        Self { status, headers: Vec::new(), body: None }
    }

    fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Self {
        Self::error_with_target(status, code, message, None)
    }

    fn error_with_target(status: StatusCode, code: &str, message: impl Into<String>, target: Option<&str>) -> Self {
        let mut err = json!({"code": code, "message": message.into()});
        if let Some(t) = target {
            err["target"] = json!(t);
        }
        Self { status, headers: vec![("x-ms-error-code".into(), code.into())], body: Some(json!({ "error": err })) }
    }

    fn header(mut self, name: &str, value: impl Into<String>) -> Self {
        self.headers.push((name.to_string(), value.into()));
        self
    }
}

async fn handle(State(emu): State<Emulator>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let bytes = to_bytes(body, MAX_BODY).await.unwrap_or_default();
    if parts.method == Method::POST {
        if let Some(tenant) = entra::token_path(parts.uri.path()) {
            return entra::token(&emu, tenant, &bytes);
        }
    }
    let body: Value =
        if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).unwrap_or(Value::Null) };
    let path = parts.uri.path().to_string();
    let raw_query = parts.uri.query().unwrap_or("").to_string();
    let host = parts.headers.get("host").and_then(|h| h.to_str().ok()).unwrap_or("127.0.0.1").to_string();
    let call = Call {
        method: parts.method.clone(),
        path,
        query: parse_query(&raw_query),
        decoded_query: percent_decode(&raw_query),
        base: format!("http://{host}"),
        body,
    };

    if call.path.starts_with("/_emulator/") {
        return admin(&emu, &call);
    }

    let header = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
    let client_request_id = header("x-ms-client-request-id");
    let correlation = header("x-ms-correlation-request-id").unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    let request_id = uuid::Uuid::new_v4().to_string();
    let bearer = header("authorization").and_then(|a| {
        let token = a.get("Bearer ".len()..)?.trim();
        (a[.."Bearer ".len()].eq_ignore_ascii_case("bearer ") && !token.is_empty()).then(|| token.to_string())
    });
    let authorized = bearer.is_some();

    // The token check releases the lock before `serve` takes it.
    let checked = bearer.map(|t| emu.lock().tokens.check(&t, &call.base));
    let (answer, principal) = match checked {
        None => (
            Answer::error(
                StatusCode::UNAUTHORIZED,
                "AuthenticationFailed",
                "Authentication failed. The 'Authorization' header is missing or is not a bearer token.",
            ),
            None,
        ),
        Some(entra::Bearer::Foreign) => (serve(&emu, &call), None),
        Some(entra::Bearer::Valid(p)) => (serve(&emu, &call), Some(p)),
        Some(entra::Bearer::Refused(p, status, code, message)) => (
            Answer::error(status, code, message).header(
                "www-authenticate",
                format!(
                    "Bearer authorization_uri=\"https://login.microsoftonline.com/common\", error=\"invalid_token\", error_description=\"{code}\""
                ),
            ),
            Some(p),
        ),
    };

    let status = answer.status;
    emu.lock().requests.push(RecordedRequest {
        method: call.method.to_string(),
        path: call.path.clone(),
        query: raw_query,
        client_request_id: client_request_id.clone(),
        request_id: request_id.clone(),
        correlation_request_id: correlation.clone(),
        authorized,
        principal,
        status: status.as_u16(),
        body: call.body.clone(),
    });

    let mut headers = HeaderMap::new();
    let mut put = |k: &str, v: &str| {
        if let (Ok(k), Ok(v)) = (HeaderName::from_bytes(k.as_bytes()), HeaderValue::from_str(v)) {
            headers.insert(k, v);
        }
    };
    put("x-ms-request-id", &request_id);
    put("x-ms-correlation-request-id", &correlation);
    if let Some(id) = &client_request_id {
        put("x-ms-client-request-id", id);
    }
    if call.method == Method::GET {
        put("x-ms-ratelimit-remaining-subscription-reads", "11999");
    } else {
        put("x-ms-ratelimit-remaining-subscription-writes", "1199");
    }
    for (k, v) in &answer.headers {
        put(k, v);
    }
    let body = match &answer.body {
        Some(v) => {
            put("content-type", "application/json; charset=utf-8");
            Body::from(serde_json::to_vec(v).unwrap_or_default())
        }
        None => Body::empty(),
    };
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    *resp.headers_mut() = headers;
    resp
}

fn parse_query(q: &str) -> BTreeMap<String, String> {
    q.split('&')
        .filter(|s| !s.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 3 <= bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(b) => {
                        out.push(b);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn admin(emu: &Emulator, call: &Call) -> Response {
    let ok = |v: Value| {
        let mut r = Response::new(Body::from(serde_json::to_vec(&v).unwrap_or_default()));
        r.headers_mut().insert("content-type", HeaderValue::from_static("application/json"));
        r
    };
    let status = |s: StatusCode, msg: &str| {
        let mut r = Response::new(Body::from(msg.to_string()));
        *r.status_mut() = s;
        r
    };
    let mut cloud = emu.lock();
    advance(&mut cloud);
    match (call.method.as_str(), call.path.as_str()) {
        ("GET", "/_emulator/requests") => ok(serde_json::to_value(&cloud.requests).unwrap_or_default()),
        ("DELETE", "/_emulator/requests") => {
            cloud.requests.clear();
            ok(json!({}))
        }
        ("GET", "/_emulator/faults") => ok(serde_json::to_value(&cloud.faults).unwrap_or_default()),
        ("PUT", "/_emulator/faults") => match serde_json::from_value::<Vec<Fault>>(call.body.clone()) {
            Ok(rules) => {
                cloud.faults = rules;
                ok(json!({}))
            }
            Err(e) => status(StatusCode::BAD_REQUEST, &format!("bad fault rules: {e}")),
        },
        ("GET", "/_emulator/scalesets") => {
            let sets: Vec<Value> = cloud
                .scale_sets
                .values()
                .map(|s| {
                    json!({
                        "id": s.id, "name": s.name, "capacity": s.capacity, "modelVersion": s.model_version,
                        "provisioningState": s.provisioning_state, "operation": s.op,
                        "vms": s.vms.iter().map(|(id, vm)| json!({
                            "instanceId": id.to_string(), "modelVersion": vm.model_version,
                            "latestModelApplied": vm.model_version == s.model_version,
                            "provisioningState": vm.provisioning_state, "powerState": vm.power_state,
                        })).collect::<Vec<_>>(),
                    })
                })
                .collect();
            ok(json!(sets))
        }
        ("GET", "/_emulator/vms") => ok(vms::inventory(&cloud)),
        ("GET", "/_emulator/zones") => ok(serde_json::to_value(&cloud.zones).unwrap_or_default()),
        ("PUT", "/_emulator/zones") => match serde_json::from_value::<Vec<ZoneRule>>(call.body.clone()) {
            Ok(rules) => {
                cloud.zones = rules;
                ok(json!({}))
            }
            Err(e) => status(StatusCode::BAD_REQUEST, &format!("bad zone rules: {e}")),
        },
        ("GET", "/_emulator/tokens") => ok(cloud.tokens.issuances()),
        ("GET", "/_emulator/principals") => ok(cloud.tokens.principals_view()),
        ("PUT", "/_emulator/principals") => match cloud.tokens.set_principals(&call.body) {
            Ok(()) => ok(json!({})),
            Err(e) => status(StatusCode::BAD_REQUEST, &e),
        },
        _ => status(StatusCode::NOT_FOUND, "unknown emulator endpoint"),
    }
}

/// Finishes every operation whose time has come, and evicts the Spot VMs whose eviction is due.
fn advance(cloud: &mut Cloud) {
    let now = Instant::now();
    vms::evict_due(cloud, now);
    let due: Vec<String> = cloud
        .ops
        .values()
        .filter(|o| o.done.is_none() && now >= o.started + o.duration)
        .map(|o| o.id.clone())
        .collect();
    for id in due {
        finish(cloud, &id);
    }
}

fn finish(cloud: &mut Cloud, id: &str) {
    let Some(op) = cloud.ops.get(id).cloned() else { return };
    let status = match op.outcome {
        Outcome::Succeed => "Succeeded",
        Outcome::Fail => "Failed",
        Outcome::Cancel => "Canceled",
    };
    if matches!(op.kind, OpKind::CreateVm | OpKind::UpdateVm | OpKind::DeleteVm | OpKind::StopVm { .. }) {
        vms::finish(cloud, &op, op.outcome == Outcome::Succeed);
        if let Some(o) = cloud.ops.get_mut(id) {
            o.done = Some((status, SystemTime::now()));
        }
        return;
    }
    let mut remove_set = false;
    if let Some(s) = cloud.scale_sets.get_mut(&op.target) {
        if s.op.as_deref() == Some(id) {
            s.op = None;
        }
        let ok = op.outcome == Outcome::Succeed;
        match &op.kind {
            OpKind::Apply { created, removed, refused } => {
                for i in created {
                    // A failure for want of zonal capacity fails only the instances in that zone.
                    let up = ok || (!refused.is_empty() && !refused.contains(i));
                    if let Some(vm) = s.vms.get_mut(i) {
                        vm.provisioning_state = if up { "Succeeded" } else { "Failed" }.into();
                        vm.power_state = if up { "running" } else { "stopped" }.into();
                    }
                }
                for i in removed {
                    s.vms.remove(i);
                }
                s.provisioning_state = status.into();
            }
            OpKind::DeleteScaleSet => {
                if ok {
                    remove_set = true;
                } else {
                    s.provisioning_state = "Failed".into();
                }
            }
            OpKind::DeleteInstances(ids) => {
                for i in ids {
                    if ok {
                        s.vms.remove(i);
                    } else if let Some(vm) = s.vms.get_mut(i) {
                        vm.provisioning_state = "Failed".into();
                    }
                }
                s.provisioning_state = if ok { "Succeeded" } else { "Failed" }.into();
            }
            OpKind::Upgrade(ids) => {
                let latest = s.model_version;
                for i in ids {
                    if let Some(vm) = s.vms.get_mut(i) {
                        if ok {
                            vm.model_version = latest;
                            vm.provisioning_state = "Succeeded".into();
                            vm.power_state = "running".into();
                        } else {
                            vm.provisioning_state = "Failed".into();
                        }
                    }
                }
                s.provisioning_state = if ok { "Succeeded" } else { "Failed" }.into();
            }
            OpKind::CreateVm | OpKind::UpdateVm | OpKind::DeleteVm | OpKind::StopVm { .. } => {}
        }
    }
    if remove_set {
        cloud.scale_sets.remove(&op.target);
        // A Flexible scale set takes its member VMs (and what they delete with them) along.
        vms::remove_members(cloud, &op.target);
    }
    if let Some(o) = cloud.ops.get_mut(id) {
        o.done = Some((status, SystemTime::now()));
    }
}

fn rfc3339(t: SystemTime) -> String {
    time::OffsetDateTime::from(t).format(&time::format_description::well_known::Rfc3339).unwrap_or_default()
}

/// ARM path segments, with the fixed ones lower-cased for matching.
fn segments(path: &str) -> Vec<&str> {
    path.trim_matches('/').split('/').filter(|s| !s.is_empty()).collect()
}

fn eq(a: &str, b: &str) -> bool {
    a.eq_ignore_ascii_case(b)
}

fn serve(emu: &Emulator, call: &Call) -> Answer {
    let mut cloud = emu.lock();
    advance(&mut cloud);
    match call.query.get("api-version").map(String::as_str) {
        None => {
            return Answer::error(
                StatusCode::BAD_REQUEST,
                "MissingApiVersionParameter",
                "The api-version query parameter (?api-version=) is required for all requests.",
            )
        }
        Some(v) if !vms::api_version_ok(&call.path, v) => {
            return Answer::error(
                StatusCode::BAD_REQUEST,
                "InvalidApiVersionParameter",
                format!("The api-version '{v}' is invalid. This emulator supports '{API_VERSION}'."),
            )
        }
        Some(_) => {}
    }
    if take_fault(&mut cloud, call, FaultAction::FinishOperations).is_some() {
        let running: Vec<String> = cloud.ops.values().filter(|o| o.done.is_none()).map(|o| o.id.clone()).collect();
        for id in running {
            finish(&mut cloud, &id);
        }
    }
    if let Some(answer) = injected(&mut cloud, call, FaultAction::Respond) {
        return answer;
    }
    let seg = segments(&call.path);
    let m = &call.method;
    // /subscriptions/{s}/providers/Microsoft.Compute/locations/{loc}/operations/{id}
    if seg.len() == 8
        && eq(seg[0], "subscriptions")
        && eq(seg[2], "providers")
        && eq(seg[3], "Microsoft.Compute")
        && eq(seg[4], "locations")
        && eq(seg[6], "operations")
    {
        if m != Method::GET {
            return method_not_allowed(m);
        }
        let monitor = call.query.get("monitor").is_some_and(|v| v == "true");
        return poll(emu, &cloud, seg[7], monitor, &call.base);
    }
    if let Some(answer) = vms::route(emu, &mut cloud, call, &seg) {
        return answer;
    }
    // /subscriptions/{s}/resourceGroups/{rg}/providers/Microsoft.Compute/virtualMachineScaleSets/{name}[/...]
    if seg.len() >= 8
        && eq(seg[0], "subscriptions")
        && eq(seg[2], "resourceGroups")
        && eq(seg[4], "providers")
        && eq(seg[5], "Microsoft.Compute")
        && eq(seg[6], "virtualMachineScaleSets")
    {
        let (sub, rg, name) = (seg[1], seg[3], seg[7]);
        let id = format!(
            "/subscriptions/{sub}/resourceGroups/{rg}/providers/Microsoft.Compute/virtualMachineScaleSets/{name}"
        );
        let key = id.to_ascii_lowercase();
        let rest: Vec<&str> = seg[8..].to_vec();
        if !rest.is_empty() {
            if let Some(s) = cloud.scale_sets.get(&key).filter(|s| is_flexible(&s.body)) {
                return Answer::error(
                    StatusCode::CONFLICT,
                    "OperationNotAllowed",
                    format!(
                        "Operation '{} {}' is not allowed on Virtual Machine Scale Set '{}' with orchestration mode \
                         'Flexible': its VMs are virtual machines (Microsoft.Compute/virtualMachines).",
                        m,
                        rest.join("/"),
                        s.name
                    ),
                );
            }
        }
        return match (m.as_str(), rest.as_slice()) {
            ("GET", []) => match cloud.scale_sets.get(&key) {
                Some(s) => Answer::json(StatusCode::OK, view(&cloud, s)),
                None => not_found(rg, name),
            },
            ("PUT", []) => put_scale_set(emu, &mut cloud, call, &key, &id, sub, name, false),
            ("PATCH", []) => put_scale_set(emu, &mut cloud, call, &key, &id, sub, name, true),
            ("DELETE", []) => delete_scale_set(emu, &mut cloud, call, &key, name),
            ("POST", [action]) if eq(action, "delete") || eq(action, "manualupgrade") => {
                instances_action(emu, &mut cloud, call, &key, rg, name, eq(action, "delete"))
            }
            ("GET", [vms]) if eq(vms, "virtualMachines") => list_vms(emu, &cloud, call, &key, rg, name),
            ("GET", [vms, iid]) if eq(vms, "virtualMachines") => get_vm(&cloud, call, &key, rg, name, iid, false),
            ("GET", [vms, iid, iv]) if eq(vms, "virtualMachines") && eq(iv, "instanceView") => {
                get_vm(&cloud, call, &key, rg, name, iid, true)
            }
            _ => Answer::error(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("The emulator does not serve {} {}", call.method, call.path),
            ),
        };
    }
    Answer::error(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("The emulator does not serve {} {}", call.method, call.path),
    )
}

fn method_not_allowed(m: &Method) -> Answer {
    Answer::error(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", format!("The method {m} is not allowed here."))
}

fn not_found(rg: &str, name: &str) -> Answer {
    Answer::error(
        StatusCode::NOT_FOUND,
        "ResourceNotFound",
        format!(
            "The Resource 'Microsoft.Compute/virtualMachineScaleSets/{name}' under resource group '{rg}' was not found."
        ),
    )
}

/// The first matching fault rule of `action`, consumed.
fn take_fault(cloud: &mut Cloud, call: &Call, action: FaultAction) -> Option<Fault> {
    let path = call.path.to_ascii_lowercase();
    let query = call.decoded_query.to_ascii_lowercase();
    let rule = cloud.faults.iter_mut().find(|f| {
        f.action == action
            && f.method.as_deref().is_none_or(|m| m.eq_ignore_ascii_case(call.method.as_str()))
            && f.path_contains.as_deref().is_none_or(|p| path.contains(&p.to_ascii_lowercase()))
            && f.query_contains.as_deref().is_none_or(|q| query.contains(&q.to_ascii_lowercase()))
            && f.times.is_none_or(|t| f.fired < t)
    })?;
    rule.fired += 1;
    Some(rule.clone())
}

fn injected(cloud: &mut Cloud, call: &Call, action: FaultAction) -> Option<Answer> {
    let f = take_fault(cloud, call, action)?;
    let status = StatusCode::from_u16(f.status.unwrap_or(500)).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let code = f.code.clone().unwrap_or_else(|| {
        match status.as_u16() {
            429 => "TooManyRequests",
            409 => "Conflict",
            500 => "InternalServerError",
            503 => "ServiceUnavailable",
            _ => "FaultInjected",
        }
        .to_string()
    });
    let message = f.message.clone().unwrap_or_else(|| format!("injected fault: {code}"));
    let mut a = Answer::error_with_target(status, &code, message, f.target.as_deref());
    if status == StatusCode::TOO_MANY_REQUESTS {
        let reads_or_writes = if call.method == Method::GET { "reads" } else { "writes" };
        a = a
            .header("retry-after", f.retry_after.unwrap_or(1).to_string())
            .header(&format!("x-ms-ratelimit-remaining-subscription-{reads_or_writes}"), "0")
            .header("x-ms-ratelimit-remaining-resource", "Microsoft.Compute/HighCostGet3Min;0");
    } else if let Some(s) = f.retry_after {
        a = a.header("retry-after", s.to_string());
    }
    Some(a)
}

fn view(cloud: &Cloud, s: &ScaleSet) -> Value {
    let flexible = is_flexible(&s.body);
    let mut v = s.body.clone();
    v["id"] = json!(s.id);
    v["name"] = json!(s.name);
    v["type"] = json!("Microsoft.Compute/virtualMachineScaleSets");
    v["location"] = json!(s.location);
    v["etag"] = json!(format!("\"{}\"", s.etag));
    if !v["sku"].is_object() {
        v["sku"] = json!({});
    }
    // A Flexible scale set counts the VMs that joined it.
    let capacity = if flexible { vms::member_count(cloud, &s.id.to_ascii_lowercase()) } else { s.capacity };
    v["sku"]["capacity"] = json!(capacity);
    if v["sku"].get("tier").is_none() {
        v["sku"]["tier"] = json!("Standard");
    }
    if !v["properties"].is_object() {
        v["properties"] = json!({});
    }
    let p = &mut v["properties"];
    p["provisioningState"] = json!(s.provisioning_state);
    p["uniqueId"] = json!(s.unique_id);
    p["timeCreated"] = json!(rfc3339(s.time_created));
    if p.get("orchestrationMode").is_none() {
        p["orchestrationMode"] = json!("Uniform");
    }
    v
}

fn vm_view(s: &ScaleSet, id: u64, vm: &Vm, expand: bool) -> Value {
    let mut v = json!({
        "name": format!("{}_{id}", s.name),
        "id": format!("{}/virtualMachines/{id}", s.id),
        "type": "Microsoft.Compute/virtualMachineScaleSets/virtualMachines",
        "location": s.location,
        "instanceId": id.to_string(),
        "sku": {"name": s.body["sku"]["name"], "tier": "Standard"},
        "properties": {
            "latestModelApplied": vm.model_version == s.model_version,
            "vmId": vm.vm_id,
            "provisioningState": vm.provisioning_state,
            "timeCreated": rfc3339(vm.time_created),
            "osProfile": {"computerName": format!("{}{:06x}", computer_prefix(s), id)},
            "hardwareProfile": {"vmSize": s.body["sku"]["name"]},
        },
    });
    if let Some(zones) = s.body.get("zones").and_then(Value::as_array).filter(|z| !z.is_empty()) {
        v["zones"] = json!([zones[(id as usize) % zones.len()]]);
    }
    if expand {
        v["properties"]["instanceView"] = instance_view(vm);
    }
    v
}

fn computer_prefix(s: &ScaleSet) -> String {
    s.body["properties"]["virtualMachineProfile"]["osProfile"]["computerNamePrefix"]
        .as_str()
        .map(str::to_string)
        .unwrap_or_else(|| s.name.chars().take(9).collect())
}

fn instance_view(vm: &Vm) -> Value {
    instance_view_of(&vm.provisioning_state, &vm.power_state)
}

/// An instance view with the provisioning-state and power-state statuses, as ARM writes them.
fn instance_view_of(provisioning_state: &str, power_state: &str) -> Value {
    let prov = provisioning_state.to_ascii_lowercase();
    json!({
        "statuses": [
            {"code": format!("ProvisioningState/{prov}"), "level": if prov == "failed" { "Error" } else { "Info" },
             "displayStatus": format!("Provisioning {prov}")},
            {"code": format!("PowerState/{power_state}"), "level": "Info",
             "displayStatus": format!("VM {power_state}")},
        ]
    })
}

fn new_vm(model_version: u64) -> Vm {
    Vm {
        model_version,
        provisioning_state: "Creating".into(),
        power_state: "starting".into(),
        time_created: SystemTime::now(),
        vm_id: uuid::Uuid::new_v4().to_string(),
    }
}

fn conflict(s: &ScaleSet, method: &Method) -> Answer {
    Answer::error(
        StatusCode::CONFLICT,
        "Conflict",
        format!(
            "Operation '{method}' is not allowed on virtual machine scale set '{}' since operation '{}' is in progress.",
            s.name,
            s.op.as_deref().unwrap_or("?")
        ),
    )
}

/// Starts an operation; returns its id.
#[allow(clippy::too_many_arguments)]
fn start_op(
    emu: &Emulator,
    cloud: &mut Cloud,
    call: &Call,
    subscription: &str,
    location: &str,
    target: &str,
    kind: OpKind,
    duration: Duration,
) -> String {
    let (outcome, error) = if let Some(f) = take_fault(cloud, call, FaultAction::FailOperation) {
        (
            Outcome::Fail,
            (
                f.code.unwrap_or_else(|| "InternalOperationError".into()),
                f.message.unwrap_or_else(|| "The operation failed (injected).".into()),
            ),
        )
    } else if let Some(f) = take_fault(cloud, call, FaultAction::CancelOperation) {
        (
            Outcome::Cancel,
            (
                f.code.unwrap_or_else(|| "OperationCanceled".into()),
                f.message.unwrap_or_else(|| "The operation was canceled (injected).".into()),
            ),
        )
    } else {
        (Outcome::Succeed, (String::new(), String::new()))
    };
    let id = uuid::Uuid::new_v4().to_string();
    let _ = emu;
    cloud.ops.insert(
        id.clone(),
        Op {
            id: id.clone(),
            subscription: subscription.to_string(),
            location: location.to_string(),
            target: target.to_string(),
            method: call.method.to_string(),
            kind,
            started: Instant::now(),
            start_time: SystemTime::now(),
            duration,
            outcome,
            error,
            done: None,
        },
    );
    id
}

fn op_urls(emu: &Emulator, call: &Call, op: &Op) -> (String, String) {
    let _ = emu;
    let base = format!(
        "{}/subscriptions/{}/providers/Microsoft.Compute/locations/{}/operations/{}",
        call.base, op.subscription, op.location, op.id
    );
    (format!("{base}?api-version={API_VERSION}"), format!("{base}?monitor=true&api-version={API_VERSION}"))
}

/// The checks every PUT body gets first (`shape_ok`: the body's shape is right): ARM's answers to
/// undeserializable content and reserved characters in tag names.
pub(crate) fn check_body(body: &Value, shape_ok: bool) -> Option<Answer> {
    if !shape_ok {
        return Some(Answer::error(
            StatusCode::BAD_REQUEST,
            "InvalidRequestContent",
            "The request content was invalid and could not be deserialized.",
        ));
    }
    let bad_tag =
        body.get("tags").and_then(Value::as_object).and_then(|t| t.keys().find(|k| k.contains(BAD_TAG_CHARS)));
    bad_tag.map(|k| {
        Answer::error(
            StatusCode::BAD_REQUEST,
            "InvalidTagNameCharacters",
            format!("The tag names '{k}' have reserved characters '<,>,%,&,\\,?,/' or control characters."),
        )
    })
}

/// The body's `location`, or ARM's answer to a body without one.
pub(crate) fn required_location(body: &Value) -> Result<String, Answer> {
    body["location"].as_str().map(str::to_string).ok_or_else(|| {
        Answer::error(
            StatusCode::BAD_REQUEST,
            "LocationRequired",
            "The location property is required for this definition.",
        )
    })
}

fn validate_put(body: &Value) -> Option<Answer> {
    let bad = |code: &str, msg: &str, target: &str| {
        Some(Answer::error_with_target(StatusCode::BAD_REQUEST, code, msg.to_string(), Some(target)))
    };
    if let Some(a) = check_body(body, body.is_object()) {
        return Some(a);
    }
    let sku = body["sku"]["name"].as_str().unwrap_or("");
    if !sku.starts_with("Standard_") && !sku.starts_with("Basic_") {
        return bad(
            "InvalidParameter",
            &format!("The value '{sku}' provided for the VM size is not valid. Use a size such as Standard_D2s_v5."),
            "sku.name",
        );
    }
    let image = &body["properties"]["virtualMachineProfile"]["storageProfile"]["imageReference"];
    if !image.is_object() {
        return bad(
            "InvalidParameter",
            "Required parameter 'imageReference' is missing (null).",
            "properties.virtualMachineProfile.storageProfile.imageReference",
        );
    }
    if image["publisher"].as_str().is_some_and(|p| p.eq_ignore_ascii_case("NoSuchPublisher")) {
        return Some(Answer::error(
            StatusCode::NOT_FOUND,
            "PlatformImageNotFound",
            "The platform image 'NoSuchPublisher' is not available.",
        ));
    }
    None
}

/// Whether a scale set body asks for Flexible orchestration.
fn is_flexible(body: &Value) -> bool {
    body["properties"]["orchestrationMode"].as_str().is_some_and(|m| m.eq_ignore_ascii_case("Flexible"))
}

/// Checks a Flexible scale set: VMs join it by reference, so it needs no model, and the emulator
/// creates no instances of one (a capacity above 0 is refused).
fn validate_flexible(body: &Value) -> Option<Answer> {
    if let Some(a) = check_body(body, body.is_object()) {
        return Some(a);
    }
    if body["sku"]["capacity"].as_u64().is_some_and(|c| c > 0) {
        return Some(Answer::error_with_target(
            StatusCode::BAD_REQUEST,
            "InvalidParameter",
            "The emulator creates no instances of a Flexible scale set's model: send sku.capacity 0 (or none) \
             and create virtual machines that reference the scale set in properties.virtualMachineScaleSet.id.",
            Some("sku.capacity"),
        ));
    }
    None
}

#[allow(clippy::too_many_arguments)]
fn put_scale_set(
    emu: &Emulator,
    cloud: &mut Cloud,
    call: &Call,
    key: &str,
    id: &str,
    sub: &str,
    name: &str,
    patch: bool,
) -> Answer {
    let existing = cloud.scale_sets.get(key).cloned();
    if let Some(s) = &existing {
        if s.op.is_some() {
            return conflict(s, &call.method);
        }
        if s.provisioning_state == "Deleting" {
            return conflict(s, &call.method);
        }
    }
    let desired = match (&existing, patch) {
        (None, true) => {
            let rg = segments(&call.path).get(3).copied().unwrap_or("").to_string();
            return not_found(&rg, name);
        }
        (Some(s), true) => {
            let mut merged = s.body.clone();
            merge(&mut merged, &call.body);
            merged
        }
        (_, false) => {
            let mut b = call.body.clone();
            if let Some(o) = b.as_object_mut() {
                for k in ["id", "name", "type", "etag"] {
                    o.remove(k);
                }
                if let Some(p) = o.get_mut("properties").and_then(Value::as_object_mut) {
                    for k in ["provisioningState", "uniqueId", "timeCreated"] {
                        p.remove(k);
                    }
                }
            }
            b
        }
    };
    if let Some(s) = &existing {
        let mode = |b: &Value| if is_flexible(b) { "Flexible" } else { "Uniform" };
        if mode(&s.body) != mode(&desired) {
            return Answer::error_with_target(
                StatusCode::CONFLICT,
                "PropertyChangeNotAllowed",
                "Changing property 'orchestrationMode' is not allowed.",
                Some("orchestrationMode"),
            );
        }
    }
    let validation = if is_flexible(&desired) { validate_flexible(&desired) } else { validate_put(&desired) };
    if let Some(a) = validation {
        return a;
    }
    let location = match required_location(&desired) {
        Ok(l) => l,
        Err(a) => return a,
    };
    let capacity = desired["sku"]["capacity"].as_u64().unwrap_or(0);
    if let Some(max) = emu.config.max_instances {
        let others: u64 =
            cloud.scale_sets.iter().filter(|(k, _)| k.as_str() != key).map(|(_, s)| s.vms.len() as u64).sum::<u64>()
                + cloud.vms.len() as u64;
        if others + capacity > max {
            return Answer::error(
                StatusCode::CONFLICT,
                "OperationNotAllowed",
                format!(
                    "Operation could not be completed as it results in exceeding approved Total Regional Cores quota. \
                     Location: {location}, Current Limit: {max} instances, Current Usage: {others}, Additional Required: {capacity}."
                ),
            );
        }
    }
    let model = json!({"sku": desired["sku"]["name"], "profile": desired["properties"]["virtualMachineProfile"]});
    let is_new = existing.is_none();
    let mut s = existing.unwrap_or_else(|| ScaleSet {
        id: id.to_string(),
        name: name.to_string(),
        subscription: sub.to_string(),
        location: location.clone(),
        body: Value::Null,
        capacity: 0,
        model: model.clone(),
        model_version: 1,
        provisioning_state: "Creating".into(),
        vms: BTreeMap::new(),
        next_instance: 0,
        unique_id: uuid::Uuid::new_v4().to_string(),
        time_created: SystemTime::now(),
        etag: 0,
        op: None,
    });
    if !is_new && s.model != model {
        s.model = model;
        s.model_version += 1;
    }
    s.body = desired;
    s.etag += 1;
    s.provisioning_state = if is_new { "Creating" } else { "Updating" }.into();
    // Scale out with the latest model; scale in removes the highest instance IDs (after the
    // ones already on their way out).
    let live: Vec<u64> = s.vms.iter().filter(|(_, v)| v.provisioning_state != "Deleting").map(|(i, _)| *i).collect();
    let mut created = Vec::new();
    let mut removed = Vec::new();
    if capacity > live.len() as u64 {
        for _ in live.len() as u64..capacity {
            let i = s.next_instance;
            s.next_instance += 1;
            s.vms.insert(i, new_vm(s.model_version));
            created.push(i);
        }
    } else {
        for i in live.iter().rev().take((live.len() as u64 - capacity) as usize) {
            if let Some(vm) = s.vms.get_mut(i) {
                vm.provisioning_state = "Deleting".into();
                vm.power_state = "stopping".into();
            }
            removed.push(*i);
        }
    }
    s.capacity = capacity;
    // Zones that refuse the new instances: a size not offered refuses the whole PUT, no capacity
    // fails the instances placed there.
    let zones = zones_of(&s.body);
    let size = s.body["sku"]["name"].as_str().unwrap_or_default().to_string();
    let mut refused = Vec::new();
    for i in &created {
        let Some(zone) = (!zones.is_empty()).then(|| zones[(*i as usize) % zones.len()].clone()) else { continue };
        match zone_refusal(cloud, std::slice::from_ref(&zone), &size).map(|r| r.refuse) {
            Some(ZoneRefusal::Sku) => return sku_not_available(id, &location, &zone, sub),
            Some(ZoneRefusal::Capacity) => refused.push(*i),
            None => {}
        }
    }
    let op_id = start_op(
        emu,
        cloud,
        call,
        sub,
        &location,
        key,
        OpKind::Apply { created, removed, refused: Vec::new() },
        emu.config.operation_duration,
    );
    if !refused.is_empty() && refuse_allocation(cloud, &op_id) {
        if let Some(OpKind::Apply { refused: r, .. }) = cloud.ops.get_mut(&op_id).map(|o| &mut o.kind) {
            *r = refused;
        }
    }
    s.op = Some(op_id.clone());
    let body = view(cloud, &s);
    cloud.scale_sets.insert(key.to_string(), s);
    let op = cloud.ops.get(&op_id).cloned();
    let mut a = Answer::json(if is_new { StatusCode::CREATED } else { StatusCode::OK }, body);
    if let Some(op) = op {
        let (async_url, _) = op_urls(emu, call, &op);
        a = a.header("azure-asyncoperation", async_url);
    }
    a
}

fn merge(into: &mut Value, patch: &Value) {
    match (into, patch) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (slot, v) => *slot = v.clone(),
    }
}

fn accepted(emu: &Emulator, call: &Call, cloud: &Cloud, op_id: &str) -> Answer {
    let Some(op) = cloud.ops.get(op_id) else { return Answer::empty(StatusCode::ACCEPTED) };
    let (async_url, location) = op_urls(emu, call, op);
    Answer::empty(StatusCode::ACCEPTED)
        .header("azure-asyncoperation", async_url)
        .header("location", location)
        .header("retry-after", emu.config.retry_after_secs.to_string())
}

fn delete_scale_set(emu: &Emulator, cloud: &mut Cloud, call: &Call, key: &str, name: &str) -> Answer {
    let Some(s) = cloud.scale_sets.get(key).cloned() else { return Answer::empty(StatusCode::NO_CONTENT) };
    let _ = name;
    if let Some(op) = s.op.as_ref().and_then(|id| cloud.ops.get(id)) {
        // A delete already running: hand out the same operation (ARM is idempotent here).
        if op.kind == OpKind::DeleteScaleSet {
            let id = op.id.clone();
            return accepted(emu, call, cloud, &id);
        }
        return conflict(&s, &call.method);
    }
    let op_id = start_op(
        emu,
        cloud,
        call,
        &s.subscription,
        &s.location,
        key,
        OpKind::DeleteScaleSet,
        emu.config.delete_duration,
    );
    if let Some(s) = cloud.scale_sets.get_mut(key) {
        s.provisioning_state = "Deleting".into();
        s.op = Some(op_id.clone());
        for vm in s.vms.values_mut() {
            vm.provisioning_state = "Deleting".into();
        }
    }
    vms::mark_members_deleting(cloud, key);
    accepted(emu, call, cloud, &op_id)
}

fn instances_action(
    emu: &Emulator,
    cloud: &mut Cloud,
    call: &Call,
    key: &str,
    rg: &str,
    name: &str,
    delete: bool,
) -> Answer {
    let Some(s) = cloud.scale_sets.get(key).cloned() else { return not_found(rg, name) };
    if s.op.is_some() {
        return conflict(&s, &call.method);
    }
    let ids: Vec<String> = call.body["instanceIds"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_string)).collect())
        .unwrap_or_default();
    if ids.is_empty() {
        return Answer::error_with_target(
            StatusCode::BAD_REQUEST,
            "InvalidParameter",
            "Required parameter 'instanceIds' is missing (null).",
            Some("instanceIds"),
        );
    }
    let mut parsed = Vec::new();
    for id in &ids {
        match id.parse::<u64>().ok().filter(|i| s.vms.get(i).is_some_and(|v| v.provisioning_state != "Deleting")) {
            Some(i) => parsed.push(i),
            None => {
                return Answer::error_with_target(
                    StatusCode::BAD_REQUEST,
                    "InvalidParameter",
                    format!("The provided instanceId {id} is not an active Virtual Machine Scale Set VM instanceId."),
                    Some("instanceIds"),
                )
            }
        }
    }
    parsed.sort_unstable();
    parsed.dedup();
    let (kind, duration) = if delete {
        (OpKind::DeleteInstances(parsed.clone()), emu.config.delete_duration)
    } else {
        (OpKind::Upgrade(parsed.clone()), emu.config.upgrade_duration)
    };
    let op_id = start_op(emu, cloud, call, &s.subscription, &s.location, key, kind, duration);
    if let Some(s) = cloud.scale_sets.get_mut(key) {
        s.op = Some(op_id.clone());
        s.provisioning_state = "Updating".into();
        for i in &parsed {
            if let Some(vm) = s.vms.get_mut(i) {
                if delete {
                    vm.provisioning_state = "Deleting".into();
                    vm.power_state = "stopping".into();
                } else {
                    vm.provisioning_state = "Updating".into();
                }
            }
        }
        if delete {
            // Deleting instances lowers the capacity (unlike a scale-in, the caller chose them).
            s.capacity = s.capacity.saturating_sub(parsed.len() as u64);
            s.etag += 1;
        }
    }
    accepted(emu, call, cloud, &op_id)
}

fn list_vms(emu: &Emulator, cloud: &Cloud, call: &Call, key: &str, rg: &str, name: &str) -> Answer {
    let Some(s) = cloud.scale_sets.get(key) else {
        return Answer::error(
            StatusCode::NOT_FOUND,
            "ParentResourceNotFound",
            format!("Can not perform requested operation on nested resource. Parent resource '{name}' not found."),
        );
    };
    let _ = rg;
    let expand = call.query.get("$expand").is_some_and(|e| e.eq_ignore_ascii_case("instanceView"));
    let skip: usize = call.query.get("$skiptoken").and_then(|t| t.parse().ok()).unwrap_or(0);
    let page = emu.config.page_size.max(1);
    let all: Vec<(&u64, &Vm)> = s.vms.iter().collect();
    let value: Vec<Value> = all.iter().skip(skip).take(page).map(|(i, vm)| vm_view(s, **i, vm, expand)).collect();
    let mut body = json!({ "value": value });
    if skip + page < all.len() {
        let mut link = format!("{}{}?api-version={API_VERSION}", call.base, call.path);
        if expand {
            link.push_str("&$expand=instanceView");
        }
        link.push_str(&format!("&$skiptoken={}", skip + page));
        body["nextLink"] = json!(link);
    }
    Answer::json(StatusCode::OK, body)
        .header("x-ms-ratelimit-remaining-resource", "Microsoft.Compute/HighCostGet3Min;159")
}

fn get_vm(cloud: &Cloud, call: &Call, key: &str, rg: &str, name: &str, iid: &str, instance_view_only: bool) -> Answer {
    let Some(s) = cloud.scale_sets.get(key) else { return not_found(rg, name) };
    let found = iid.parse::<u64>().ok().and_then(|i| s.vms.get(&i).map(|vm| (i, vm)));
    let Some((i, vm)) = found else {
        return Answer::error(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("The entity was not found in this Azure location. Instance '{iid}' of scale set '{name}'."),
        );
    };
    if instance_view_only {
        return Answer::json(StatusCode::OK, instance_view(vm));
    }
    let expand = call.query.get("$expand").is_some_and(|e| e.eq_ignore_ascii_case("instanceView"));
    Answer::json(StatusCode::OK, vm_view(s, i, vm, expand))
}

fn poll(emu: &Emulator, cloud: &Cloud, id: &str, monitor: bool, base: &str) -> Answer {
    let Some(op) = cloud.ops.get(id) else {
        return Answer::error(StatusCode::NOT_FOUND, "NotFound", format!("Operation '{id}' was not found."));
    };
    let elapsed = op.started.elapsed();
    let percent = if op.done.is_some() {
        100.0
    } else {
        (elapsed.as_secs_f64() / op.duration.as_secs_f64().max(0.001) * 100.0).min(99.0).floor()
    };
    let status = op.done.map(|(s, _)| s).unwrap_or("InProgress");
    let retry_after = emu.config.retry_after_secs.to_string();
    if monitor {
        let location =
            format!("{base}/subscriptions/{}/providers/Microsoft.Compute/locations/{}/operations/{}?monitor=true&api-version={API_VERSION}", op.subscription, op.location, op.id);
        return match status {
            "InProgress" => {
                Answer::empty(StatusCode::ACCEPTED).header("location", location).header("retry-after", retry_after)
            }
            "Succeeded" => {
                if op.method == "PUT" || op.method == "PATCH" {
                    if let Some(vm) = cloud.vms.get(&op.target) {
                        return Answer::json(StatusCode::OK, vms::view(cloud, vm, false));
                    }
                    match cloud.scale_sets.get(&op.target) {
                        Some(s) => Answer::json(StatusCode::OK, view(cloud, s)),
                        None => Answer::empty(StatusCode::OK),
                    }
                } else {
                    Answer::empty(StatusCode::OK)
                }
            }
            _ => Answer::error(StatusCode::BAD_REQUEST, &op.error.0, op.error.1.clone()),
        };
    }
    let mut body = json!({
        "id": format!("/subscriptions/{}/providers/Microsoft.Compute/locations/{}/operations/{}", op.subscription, op.location, op.id),
        "name": op.id,
        "status": status,
        "startTime": rfc3339(op.start_time),
        "percentComplete": percent,
    });
    if let Some((_, end)) = op.done {
        body["endTime"] = json!(rfc3339(end));
    }
    if status == "Failed" || status == "Canceled" {
        body["error"] = json!({"code": op.error.0, "message": op.error.1});
    }
    let mut a = Answer::json(StatusCode::OK, body);
    if status == "InProgress" {
        a = a.header("retry-after", retry_after);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_query_strings() {
        let q = parse_query("api-version=2024-07-01&%24expand=instanceView&$skiptoken=2");
        assert_eq!(q.get("api-version").map(String::as_str), Some("2024-07-01"));
        assert_eq!(q.get("$expand").map(String::as_str), Some("instanceView"));
        assert_eq!(q.get("$skiptoken").map(String::as_str), Some("2"));
    }

    fn call(method: Method, path: &str, query: &str, body: Value) -> Call {
        Call {
            method,
            path: path.into(),
            query: parse_query(query),
            decoded_query: percent_decode(query),
            base: "http://127.0.0.1".into(),
            body,
        }
    }

    #[test]
    fn a_finish_operations_rule_finishes_a_delete_between_two_pages() {
        let emu = Emulator::new(Config {
            operation_duration: Duration::ZERO,
            delete_duration: Duration::from_secs(3600),
            faults: vec![Fault {
                method: Some("GET".into()),
                path_contains: Some("/virtualmachines".into()),
                query_contains: Some("$SkipToken".into()),
                action: FaultAction::FinishOperations,
                status: None,
                code: None,
                message: None,
                target: None,
                retry_after: None,
                times: Some(1),
                fired: 0,
            }],
            ..Config::default()
        });
        let vmss = "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/p";
        let q = format!("api-version={API_VERSION}");
        let body = json!({"location": "westeurope", "sku": {"name": "Standard_D2s_v5", "capacity": 3},
            "properties": {"virtualMachineProfile": {"storageProfile": {"imageReference": {"publisher": "x"}}}}});
        assert_eq!(serve(&emu, &call(Method::PUT, vmss, &q, body)).status, StatusCode::CREATED);
        let delete = call(Method::POST, &format!("{vmss}/delete"), &q, json!({"instanceIds": ["0"]}));
        assert_eq!(serve(&emu, &delete).status, StatusCode::ACCEPTED);
        let ids = |a: Answer| -> Vec<String> {
            a.body.unwrap_or_default()["value"]
                .as_array()
                .map(|v| v.iter().map(|vm| vm["instanceId"].as_str().unwrap_or("").to_string()).collect())
                .unwrap_or_default()
        };
        let list = format!("{vmss}/virtualMachines");
        // Page 1 still holds the instance being deleted; the rule finishes the delete before
        // page 2 is cut, so the pages shift and instance 2 is on neither.
        assert_eq!(ids(serve(&emu, &call(Method::GET, &list, &q, Value::Null))), ["0", "1"]);
        let page2 = format!("{q}&%24skiptoken=2");
        assert!(ids(serve(&emu, &call(Method::GET, &list, &page2, Value::Null))).is_empty());
        assert_eq!(emu.lock().faults[0].fired, 1);
        // Spent: the next delete runs its hour, even across a second page.
        let delete = call(Method::POST, &format!("{vmss}/delete"), &q, json!({"instanceIds": ["1"]}));
        assert_eq!(serve(&emu, &delete).status, StatusCode::ACCEPTED);
        serve(&emu, &call(Method::GET, &list, &page2, Value::Null));
        assert_eq!(ids(serve(&emu, &call(Method::GET, &list, &q, Value::Null))), ["1", "2"]);
    }

    #[test]
    fn merges_patches() {
        let mut a = json!({"sku": {"name": "x", "capacity": 1}, "tags": {"a": "1"}});
        merge(&mut a, &json!({"sku": {"capacity": 3}, "tags": {"b": "2"}}));
        assert_eq!(a, json!({"sku": {"name": "x", "capacity": 3}, "tags": {"a": "1", "b": "2"}}));
    }
}
