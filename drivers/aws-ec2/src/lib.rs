//! # aws-ec2-driver
//!
//! A `machinedriver.v1` driver for AWS EC2, built on `driver-sdk` and `aws-sdk-ec2`. One machine
//! is one EC2 instance:
//!
//! - **CreateMachine** = `RunInstances` with a deterministic `ClientToken` (machine name + uid +
//!   spec hash) and the owner tags applied at launch (`TagSpecifications`): the request's labels,
//!   the spec's `tags`, `machinedriver.dev/name=<machine>` and `machinedriver.dev/spec-hash`.
//!   Before launching, the driver looks the machine up by its name tag, so a retried or resumed
//!   create never launches a second instance; the same name with another spec is
//!   ALREADY_EXISTS / MACHINE_SPEC_CONFLICT.
//! - **DeleteMachine** = `TerminateInstances`; absent = a done operation.
//! - **GetMachineStatus** and **ListMachines** read `DescribeInstances` filtered by tags, with
//!   pagination (the page token wraps EC2's `NextToken`).
//! - **Operations** are self-contained: the token holds region, instance IDs, target state and
//!   client token, and each `GetOperation` is exactly one `DescribeInstances` call (no waiters).
//!   `InvalidInstanceID.NotFound` right after a launch means "not visible yet"; for a delete it
//!   means done.
//! - **Zones**: the spec's `availabilityZone` is the launch's `Placement.AvailabilityZone` (the
//!   field a failure domain sets); without it the subnet's zone, else EC2's choice. The provider
//!   ID names the zone the instance is in: `aws:///<az>/<instance-id>`.
//! - **Errors** map per [`errors`]: no capacity in the zone → RESOURCE_EXHAUSTED /
//!   INSUFFICIENT_CAPACITY, limits → RESOURCE_EXHAUSTED / QUOTA_EXCEEDED, a type the zone does
//!   not offer → UNAVAILABLE / ZONE_UNAVAILABLE, throttling and 5xx → UNAVAILABLE with
//!   RetryInfo, auth → PERMISSION_DENIED, bad parameters → INVALID_ARGUMENT naming the
//!   provider-spec field; the AWS error code is in ErrorInfo metadata (`awsErrorCode`) and the
//!   AWS request ID is a cloud request ID.
//!
//! - **Credentials** come from the request's `secrets` when they hold any (per MachineClass: static
//!   keys, or a role assumed with STS; see [`credentials`]), else from the standard AWS chain
//!   (environment, profile, web identity / IRSA, instance metadata). EC2 clients are cached per
//!   region and credential fingerprint. Region comes from the spec, else the sidecar's default;
//!   `AWS_ENDPOINT_URL_EC2` / `AWS_ENDPOINT_URL` override the endpoint.
//! - **User data**: the request's `userData` secret (the controller's rendered boot data) when
//!   set, else the spec's `userData`; over EC2's 16384 bytes (before base64) it is
//!   INVALID_ARGUMENT naming the field, at CreateMachine and ValidateMachineClass, before any
//!   EC2 call. Its content is never logged nor put in an error (see [`spec::user_data`]).
//! - **Spot**: the spec's `instanceMarketOptions` (`marketType: spot`, one-time, terminate on
//!   interruption) is RunInstances' `InstanceMarketOptions`.
//! - **Events** (`CAPABILITY_EVENTS`, unless both sources are off): the interruption queue
//!   (EventBridge → SQS, `--interruption-queue-url`) and a DescribeInstanceStatus poll
//!   (`--instance-status-interval`); see [`events`].

#![warn(missing_docs)]

use driver_sdk::lock;
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_config::{BehaviorVersion, Region, SdkConfig};
use aws_sdk_ec2::operation::RequestId;
use aws_sdk_ec2::types::{Filter, Instance};
use aws_sdk_ec2::Client;
use base64::Engine;
use driver_sdk::{
    async_trait, convert, reason, Capability, CreateMachine, Driver, DriverError, DriverInfo, ListMachines, Machine,
    MachineRef, Operation, OperationHandle, OperationKind, OperationOutput, Page, RequestContext, Result, Secrets,
    ValidateMachineClass,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

pub mod credentials;
pub mod errors;
pub mod events;
pub mod instance;
pub mod spec;

use credentials::{ClassCredentials, Source};
use errors::{is_instance_not_found, map_sdk_error, Call};
use instance::{instance_id_of, to_machine, Ec2State};
use spec::{ProviderSpec, TAG_NAME, TAG_SPEC_HASH};

/// The driver's name (and ErrorInfo domain).
pub const DRIVER_NAME: &str = "aws-ec2.machinedriver.dev";

/// How many times a ClientToken that replays a terminated instance is re-derived before giving
/// up (see [`next_client_token`]).
const MAX_TOKEN_GENERATIONS: usize = 4;
/// Most DescribeInstances pages one RPC reads.
const MAX_PAGES_PER_CALL: usize = 10;
/// Most EC2 clients (region × credentials) kept at once.
const MAX_CACHED_CLIENTS: usize = 256;

/// One request's EC2 client: its region and where its credentials come from.
#[derive(Debug, Clone)]
struct Ec2 {
    client: Client,
    region: String,
    source: Source,
}

/// [`Config::poll_interval`] by default (`--poll-interval`): instances start in tens of seconds;
/// DescribeInstances every 3 s sees it soon without eating into the account's API rate.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(3);
/// [`Config::max_attempts`] by default (`--max-attempts`): one retry of a call that failed on the
/// way; the controller owns backoff.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 2;
/// [`Config::call_timeout`] by default (`--call-timeout`): a slow EC2 answer still arrives; the
/// caller's deadline ends the wait sooner when it is shorter.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// [`Config::visibility_timeout`] by default (`--visibility-timeout`): EC2's eventual consistency
/// hides a new instance from DescribeInstances for seconds, rarely minutes.
pub const DEFAULT_VISIBILITY_TIMEOUT: Duration = Duration::from_secs(300);
/// The connect timeout of EC2 calls (at most the call timeout).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// How the driver behaves.
#[derive(Debug, Clone)]
pub struct Config {
    /// Region used when a provider spec names none; `None` = the standard chain.
    pub region: Option<String>,
    /// `poll_after` of running operations.
    pub poll_interval: Duration,
    /// Attempts per EC2 call, including the first (the SDK's standard retry mode). Keep it small:
    /// the caller (controller) owns backoff.
    pub max_attempts: u32,
    /// Bound on one EC2 call, all attempts included.
    pub call_timeout: Duration,
    /// How long a launched instance may stay invisible to DescribeInstances before its create
    /// operation fails with OPERATION_NOT_FOUND.
    pub visibility_timeout: Duration,
    /// Where events come from (the interruption queue, the status poll).
    pub events: events::EventConfig,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            region: None,
            poll_interval: DEFAULT_POLL_INTERVAL,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            call_timeout: DEFAULT_CALL_TIMEOUT,
            visibility_timeout: DEFAULT_VISIBILITY_TIMEOUT,
            events: events::EventConfig::default(),
        }
    }
}

/// Why the driver could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartupError {
    /// No region from the flag, the environment, the profile or instance metadata.
    #[error(
        "no AWS region configured: pass --region, set AWS_REGION (or AWS_DEFAULT_REGION), or set a region in the AWS profile"
    )]
    NoRegion,
    /// A configuration value is out of range.
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// The AWS EC2 driver.
pub struct AwsEc2Driver {
    sdk: SdkConfig,
    default_region: String,
    clients: Mutex<HashMap<(String, String), Client>>,
    config: Config,
    events: std::sync::Arc<events::EventSource>,
}

impl std::fmt::Debug for AwsEc2Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AwsEc2Driver").field("region", &self.default_region).field("config", &self.config).finish()
    }
}

/// Resume data sealed into operation tokens.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
struct OpState {
    /// Region of the instances.
    #[serde(rename = "r")]
    region: String,
    /// Instance IDs.
    #[serde(rename = "i")]
    instance_ids: Vec<String>,
    /// What the operation waits for.
    #[serde(rename = "w")]
    target: Target,
    /// The RunInstances ClientToken (creates only).
    #[serde(rename = "ct", default, skip_serializing_if = "String::is_empty")]
    client_token: String,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum Target {
    Running,
    Terminated,
}

/// The page token of ListMachines: where in EC2's pagination the next page starts.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
struct PageToken {
    /// EC2 NextToken of the page to read (empty = the first).
    #[serde(rename = "t", default)]
    next: String,
    /// Instances of that page already returned.
    #[serde(rename = "s", default)]
    skip: usize,
    /// MaxResults used for the chain (EC2 pages must not change size mid-way).
    #[serde(rename = "m")]
    max_results: i32,
}

impl PageToken {
    fn encode(&self) -> String {
        let json = serde_json::to_vec(self).unwrap_or_default();
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json)
    }

    fn decode(s: &str) -> Result<Self> {
        let invalid = || {
            DriverError::invalid_argument(reason::FIELD_INVALID, "page_token is not one this driver issued")
                .with_violation("page_token", "unknown token; restart from an empty one")
        };
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(s).map_err(|_| invalid())?;
        let t: PageToken = serde_json::from_slice(&bytes).map_err(|_| invalid())?;
        if !(5..=1000).contains(&t.max_results) || t.skip > 1000 {
            return Err(invalid());
        }
        Ok(t)
    }
}

impl AwsEc2Driver {
    /// Loads credentials, region and endpoint from the standard AWS chain.
    ///
    /// # Errors
    /// [`StartupError::NoRegion`] when neither `config.region` nor the chain names a region.
    pub async fn from_env(config: Config) -> Result<Self, StartupError> {
        if config.max_attempts == 0 {
            return Err(StartupError::Invalid("max attempts must be at least 1".into()));
        }
        // rustls + ring: ring is already in the workspace (tonic), aws-lc would add a C build.
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
                aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
            ))
            .build_https();
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .http_client(http)
            .retry_config(RetryConfig::standard().with_max_attempts(config.max_attempts))
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(CONNECT_TIMEOUT.min(config.call_timeout))
                    .operation_timeout(config.call_timeout)
                    .build(),
            );
        if let Some(r) = &config.region {
            loader = loader.region(Region::new(r.clone()));
        }
        Self::from_sdk_config(loader.load().await, config)
    }

    /// A driver on an already loaded SDK configuration (tests, embedding).
    ///
    /// # Errors
    /// [`StartupError::NoRegion`] when `sdk` has no region.
    pub fn from_sdk_config(sdk: SdkConfig, config: Config) -> Result<Self, StartupError> {
        let default_region =
            sdk.region().map(|r| r.to_string()).filter(|r| !r.is_empty()).ok_or(StartupError::NoRegion)?;
        if config.events.queue_url.as_deref().is_some_and(|u| !u.starts_with("https://") && !u.starts_with("http://")) {
            return Err(StartupError::Invalid("the interruption queue URL must be an http(s) SQS queue URL".into()));
        }
        let events = events::EventSource::new(&sdk, &default_region, config.events.clone(), config.call_timeout);
        Ok(Self { sdk, default_region, clients: Mutex::new(HashMap::new()), config, events })
    }

    /// The region used when a spec names none.
    pub fn default_region(&self) -> &str {
        &self.default_region
    }

    /// The EC2 client of `region` (the default one when `None`) signing with `creds`. Clients are
    /// cached per region and credential [fingerprint](ClassCredentials::fingerprint), so the
    /// identity cache inside each keeps (and refreshes before expiry) what it resolved, e.g. an
    /// assumed role's temporary keys.
    async fn ec2(&self, region: Option<&str>, creds: &ClassCredentials) -> Ec2 {
        let region = region.filter(|r| !r.is_empty()).unwrap_or(&self.default_region).to_string();
        let key = (region.clone(), creds.fingerprint());
        let source = creds.source();
        let cached = lock(&self.clients).get(&key).cloned();
        if let Some(client) = cached {
            return Ec2 { client, region, source };
        }
        let mut conf = aws_sdk_ec2::config::Builder::from(&self.sdk).region(Region::new(region.clone()));
        if let Some(provider) = creds.provider(&self.sdk).await {
            conf = conf.credentials_provider(provider);
        }
        let client = Client::from_conf(conf.build());
        tracing::info!(
            region = %region, "credentials.kind" = source.kind(), "credentials.fingerprint" = %key.1,
            "new EC2 client"
        );
        let mut clients = lock(&self.clients);
        if clients.len() >= MAX_CACHED_CLIENTS && !clients.contains_key(&key) {
            // Rotated secrets leave stale entries behind: start over rather than grow forever.
            clients.clear();
        }
        let client = clients.entry(key).or_insert(client).clone();
        Ec2 { client, region, source }
    }

    /// Instances tagged with this machine name, excluding terminated ones (and shutting-down
    /// ones unless `with_shutting_down`). Reads every page (bounded).
    async fn find_by_name(
        &self,
        ctx: &RequestContext,
        ec2: &Ec2,
        name: &str,
        with_shutting_down: bool,
    ) -> Result<Vec<Instance>> {
        let mut states: Vec<String> = Ec2State::LIVE.iter().map(|s| s.to_string()).collect();
        if with_shutting_down {
            states.push("shutting-down".into());
        }
        let mut out = Vec::new();
        let mut next: Option<String> = None;
        for _ in 0..MAX_PAGES_PER_CALL {
            let page = ec2
                .client
                .describe_instances()
                .filters(Filter::builder().name(format!("tag:{TAG_NAME}")).values(name).build())
                .filters(Filter::builder().name("instance-state-name").set_values(Some(states.clone())).build())
                .set_next_token(next.take())
                .send()
                .await
                .map_err(|e| map_sdk_error(ctx, Call::DescribeInstances, ec2.source, e))?;
            out.extend(page.reservations().iter().flat_map(|r| r.instances().iter().cloned()));
            match page.next_token().filter(|t| !t.is_empty()) {
                Some(t) => next = Some(t.to_string()),
                None => break,
            }
        }
        // Defence in depth: an endpoint that ignores a filter must not make us act on others.
        out.retain(|i| {
            let state = Ec2State::of(i);
            instance::tag(i, TAG_NAME) == Some(name)
                && state != Ec2State::Terminated
                && (with_shutting_down || state != Ec2State::ShuttingDown)
        });
        Ok(out)
    }

    /// The instance with this ID if it exists, is not terminated and carries this machine's
    /// name tag.
    async fn find_by_id(&self, ctx: &RequestContext, ec2: &Ec2, id: &str, name: &str) -> Result<Option<Instance>> {
        match ec2.client.describe_instances().instance_ids(id).send().await {
            Ok(out) => Ok(out
                .reservations()
                .iter()
                .flat_map(|r| r.instances().iter())
                .find(|i| instance::tag(i, TAG_NAME) == Some(name) && Ec2State::of(i) != Ec2State::Terminated)
                .cloned()),
            Err(e) if is_instance_not_found(&e) => Ok(None),
            Err(e) => Err(map_sdk_error(ctx, Call::DescribeInstances, ec2.source, e)),
        }
    }

    /// The machine's instances: by name tag, else by the provider ID the caller knows (an
    /// instance may be visible by ID before its tags are).
    async fn lookup(&self, ctx: &RequestContext, ec2: &Ec2, m: &MachineRef) -> Result<Vec<Instance>> {
        let found = self.find_by_name(ctx, ec2, &m.name, true).await?;
        if !found.is_empty() {
            return Ok(found);
        }
        match m.provider_id.as_deref().and_then(instance_id_of) {
            Some(id) => Ok(self.find_by_id(ctx, ec2, id, &m.name).await?.into_iter().collect()),
            None => Ok(Vec::new()),
        }
    }

    fn running_op(&self, kind: OperationKind, target: &str, state: &OpState) -> Operation {
        let verb = if kind == OperationKind::CreateMachine { "launch" } else { "terminate" };
        Operation::running(kind, target, serde_json::to_value(state).unwrap_or(Value::Null))
            .named(format!("{verb}-{}", state.instance_ids.first().map(String::as_str).unwrap_or("none")))
            .with_poll_after(self.config.poll_interval)
    }

    /// The answer to a create whose instance exists: done when it is up, else a running
    /// operation on it.
    fn create_answer(&self, name: &str, region: &str, i: &Instance, client_token: &str) -> Operation {
        let state = OpState {
            region: region.to_string(),
            instance_ids: vec![i.instance_id().unwrap_or_default().to_string()],
            target: Target::Running,
            client_token: client_token.to_string(),
        };
        let op = self.running_op(OperationKind::CreateMachine, name, &state);
        match Ec2State::of(i) {
            Ec2State::Pending | Ec2State::Unknown => op.with_progress(10),
            _ => op.finish(Ok(OperationOutput::Machine(to_machine(i)))),
        }
    }
}

/// The RunInstances ClientToken of a machine incarnation: machine name + uid + spec hash.
/// Deterministic (a retried create sends the same token, so EC2 launches at most once), at most
/// 64 ASCII characters, never derived from the per-call request ID.
pub fn client_token(name: &str, uid: &str, spec_hash: &str) -> String {
    let digest = Sha256::digest(format!("{name}\0{uid}\0{spec_hash}").as_bytes());
    format!("md-{}", &hex::encode(digest)[..40])
}

/// The token to use when `token` replays an instance that is already terminated (the machine
/// was deleted and is being created again with the same identity and spec: EC2 keeps tokens for
/// at least 24 h). Derived from the stale instance, so a retry follows the same chain.
pub fn next_client_token(token: &str, stale_instance_id: &str) -> String {
    let digest = Sha256::digest(format!("{token}\0{stale_instance_id}").as_bytes());
    format!("md-{}", &hex::encode(digest)[..40])
}

fn spec_region(spec: &Value) -> Option<&str> {
    spec.get("region").and_then(Value::as_str)
}

/// The live instance to report for a machine: running before pending before the rest, newest
/// first.
fn best(mut found: Vec<Instance>) -> Option<Instance> {
    let rank = |i: &Instance| match Ec2State::of(i) {
        Ec2State::Running => 0,
        Ec2State::Pending => 1,
        Ec2State::Stopping | Ec2State::Stopped => 2,
        Ec2State::Unknown => 3,
        Ec2State::ShuttingDown | Ec2State::Terminated => 4,
    };
    found.sort_by(|a, b| rank(a).cmp(&rank(b)).then_with(|| b.launch_time().cmp(&a.launch_time())));
    found.into_iter().next()
}

#[async_trait]
impl Driver for AwsEc2Driver {
    fn info(&self) -> DriverInfo {
        DriverInfo {
            name: DRIVER_NAME.into(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            provider_spec_schema: spec::schema(),
        }
    }

    fn capabilities(&self) -> Vec<Capability> {
        let mut out = vec![Capability::Machines, Capability::ValidateMachineClass];
        if self.config.events.enabled() {
            out.push(Capability::Events);
        }
        out
    }

    async fn watch_events(&self, _ctx: &RequestContext) -> Result<driver_sdk::EventStream> {
        if !self.config.events.enabled() {
            return Err(DriverError::unimplemented("WatchEvents"));
        }
        Ok(self.events.stream())
    }

    async fn ack_event(&self, ctx: &RequestContext, event: &driver_sdk::MachineEvent) -> Result<()> {
        self.events.ack(ctx, event).await
    }

    async fn create_machine(&self, ctx: &RequestContext, req: CreateMachine) -> Result<Operation> {
        let spec = ProviderSpec::parse(&req.provider_spec)?;
        // Before any EC2 call: user data EC2 would refuse launches nothing.
        let user_data = spec::user_data(&spec, &req.secrets)?;
        let hash = convert::spec_hash(&req.provider_spec);
        let creds = ClassCredentials::from_secrets(&req.secrets)?;
        let ec2 = self.ec2(spec.region.as_deref(), &creds).await;
        let region = ec2.region.clone();

        // Never launch twice: an instance tagged with this name answers the create.
        if let Some(i) = best(self.find_by_name(ctx, &ec2, &req.name, false).await?) {
            let existing_hash = instance::tag(&i, TAG_SPEC_HASH).unwrap_or_default();
            if existing_hash != hash {
                return Err(DriverError::already_exists(
                    reason::MACHINE_SPEC_CONFLICT,
                    format!(
                        "machine {} exists as instance {} with another provider spec (hash {existing_hash}, requested {hash})",
                        req.name,
                        i.instance_id().unwrap_or_default()
                    ),
                )
                .with_metadata("instanceId", i.instance_id().unwrap_or_default()));
            }
            let token = i.client_token().unwrap_or_default().to_string();
            return Ok(self.create_answer(&req.name, &region, &i, &token));
        }

        let mut tags: BTreeMap<String, String> = spec.tags.clone();
        tags.extend(req.labels.clone());
        tags.insert(TAG_NAME.into(), req.name.clone());
        tags.insert(TAG_SPEC_HASH.into(), hash.clone());
        let mut token = client_token(&req.name, &req.uid, &hash);
        for _ in 0..MAX_TOKEN_GENERATIONS {
            let out = spec
                .apply(ec2.client.run_instances(), &tags, user_data)
                .client_token(&token)
                .send()
                .await
                .map_err(|e| map_sdk_error(ctx, Call::RunInstances, ec2.source, e))?;
            let aws_request_id = out.request_id().unwrap_or_default().to_string();
            let Some(i) = out.instances().first() else {
                return Err(
                    DriverError::internal("RunInstances returned no instance").with_cloud_request_id(aws_request_id)
                );
            };
            let id = i.instance_id().unwrap_or_default().to_string();
            if Ec2State::of(i).is_gone() {
                // EC2 replayed an earlier launch with this token whose instance is gone.
                tracing::info!(
                    "request.id" = %ctx.request_id(), "aws.request_id" = %aws_request_id, "instance.id" = %id,
                    "client token replayed a terminated instance; deriving the next token"
                );
                token = next_client_token(&token, &id);
                continue;
            }
            tracing::info!(
                "request.id" = %ctx.request_id(), "aws.request_id" = %aws_request_id, "instance.id" = %id,
                "client_token" = %token, region = %region, "launched instance"
            );
            return Ok(self.create_answer(&req.name, &region, i, &token).with_cloud_request_id(aws_request_id));
        }
        Err(DriverError::internal(format!(
            "ClientToken replays for {} kept returning terminated instances; retry later",
            req.name
        )))
    }

    async fn delete_machine(&self, ctx: &RequestContext, req: MachineRef) -> Result<Operation> {
        let creds = ClassCredentials::from_secrets(&req.secrets)?;
        let ec2 = self.ec2(spec_region(&req.provider_spec), &creds).await;
        let region = ec2.region.clone();
        let ids: Vec<String> =
            self.lookup(ctx, &ec2, &req).await?.iter().filter_map(|i| i.instance_id().map(str::to_string)).collect();
        let state = OpState { region, instance_ids: ids, target: Target::Terminated, client_token: String::new() };
        if state.instance_ids.is_empty() {
            return Ok(self
                .running_op(OperationKind::DeleteMachine, &req.name, &state)
                .finish(Ok(OperationOutput::None)));
        }
        let out = match ec2.client.terminate_instances().set_instance_ids(Some(state.instance_ids.clone())).send().await
        {
            Ok(out) => out,
            Err(e) if is_instance_not_found(&e) => {
                return Ok(self
                    .running_op(OperationKind::DeleteMachine, &req.name, &state)
                    .finish(Ok(OperationOutput::None)))
            }
            Err(e) => return Err(map_sdk_error(ctx, Call::TerminateInstances, ec2.source, e)),
        };
        let aws_request_id = out.request_id().unwrap_or_default().to_string();
        self.events.terminating(&state.instance_ids);
        tracing::info!(
            "request.id" = %ctx.request_id(), "aws.request_id" = %aws_request_id,
            "instance.ids" = ?state.instance_ids, "terminating instances"
        );
        let all_done = out
            .terminating_instances()
            .iter()
            .all(|c| c.current_state().and_then(|s| s.code()).map(|c| c & 0xFF) == Some(48));
        let op = self.running_op(OperationKind::DeleteMachine, &req.name, &state).with_cloud_request_id(aws_request_id);
        Ok(if all_done { op.finish(Ok(OperationOutput::None)) } else { op.with_progress(10) })
    }

    async fn get_machine_status(&self, ctx: &RequestContext, req: MachineRef) -> Result<Machine> {
        let creds = ClassCredentials::from_secrets(&req.secrets)?;
        let ec2 = self.ec2(spec_region(&req.provider_spec), &creds).await;
        best(self.lookup(ctx, &ec2, &req).await?).map(|i| to_machine(&i)).ok_or_else(|| {
            DriverError::not_found(
                reason::MACHINE_NOT_FOUND,
                format!("no EC2 instance is tagged {TAG_NAME}={}", req.name),
            )
        })
    }

    async fn list_machines(&self, ctx: &RequestContext, req: ListMachines) -> Result<Page<Machine>> {
        let mut pos = if req.page_token.is_empty() {
            PageToken { max_results: (req.page_size as i32).clamp(5, 1000), ..Default::default() }
        } else {
            PageToken::decode(&req.page_token)?
        };
        let creds = ClassCredentials::from_secrets(&req.secrets)?;
        let ec2 = self.ec2(spec_region(&req.provider_spec), &creds).await;
        let mut items = Vec::new();
        for _ in 0..MAX_PAGES_PER_CALL {
            let mut call = ec2
                .client
                .describe_instances()
                .filters(Filter::builder().name("tag-key").values(TAG_NAME).build())
                .filters(
                    Filter::builder()
                        .name("instance-state-name")
                        .set_values(Some(Ec2State::LIVE.iter().map(|s| s.to_string()).collect()))
                        .build(),
                )
                .max_results(pos.max_results);
            for (k, v) in &req.label_selector {
                call = call.filters(Filter::builder().name(format!("tag:{k}")).values(v).build());
            }
            if !pos.next.is_empty() {
                call = call.next_token(&pos.next);
            }
            let page = call.send().await.map_err(|e| {
                let err = map_sdk_error(ctx, Call::DescribeInstances, ec2.source, e);
                if err.code() == driver_sdk::tonic::Code::InvalidArgument {
                    err.with_violation("page_token", "EC2 refused the continuation token")
                } else {
                    err
                }
            })?;
            let instances: Vec<&Instance> = page
                .reservations()
                .iter()
                .flat_map(|r| r.instances())
                .filter(|i| req.label_selector.iter().all(|(k, v)| instance::tag(i, k) == Some(v.as_str())))
                .collect();
            let rest = instances.len().saturating_sub(pos.skip);
            let want = req.page_size - items.len();
            items.extend(instances.iter().skip(pos.skip).take(want).map(|i| to_machine(i)));
            let aws_next = page.next_token().filter(|t| !t.is_empty());
            if rest > want {
                // This EC2 page has more: continue inside it.
                pos.skip += want;
                return Ok(Page { items, next_page_token: pos.encode() });
            }
            match aws_next {
                Some(t) => pos = PageToken { next: t.to_string(), skip: 0, max_results: pos.max_results },
                None => return Ok(Page { items, next_page_token: String::new() }),
            }
            if items.len() == req.page_size {
                return Ok(Page { items, next_page_token: pos.encode() });
            }
        }
        Ok(Page { items, next_page_token: pos.encode() })
    }

    async fn validate_machine_class(&self, ctx: &RequestContext, req: ValidateMachineClass) -> Result<Vec<String>> {
        let spec = ProviderSpec::parse(&req.provider_spec)?;
        // The controller sends a sample rendering of the class's boot data as the `userData`
        // secret: one EC2 would refuse fails the class here, before any machine is created.
        spec::user_data(&spec, &req.secrets)?;
        let mut warnings = Vec::new();
        if spec.subnet_id.is_none() && spec.launch_template.is_none() {
            warnings.push("no subnetId: EC2 launches into the default VPC of the region".to_string());
        }
        if spec.security_group_ids.is_empty() && spec.launch_template.is_none() {
            warnings.push("no securityGroupIds: EC2 uses the VPC's default security group".to_string());
        }
        let creds = ClassCredentials::from_secrets(&req.secrets)?;
        if creds == ClassCredentials::Chain {
            // The boot data is no credential: a secret holding only it is not worth a warning.
            if req.secrets.keys().any(|k| k != spec::USER_DATA_KEY) {
                warnings.push(format!(
                    "the secret holds none of {}: the sidecar's default AWS credential chain is used",
                    credentials::KEYS.join(", ")
                ));
            }
        } else {
            // One cheap read proves the class's credentials work (and, for a role, that STS lets
            // us assume it): refused ones are PERMISSION_DENIED / CLOUD_AUTH_FAILED here, before
            // any machine is created.
            let ec2 = self.ec2(spec.region.as_deref(), &creds).await;
            ec2.client
                .describe_instances()
                .filters(Filter::builder().name("tag-key").values(TAG_NAME).build())
                .max_results(5)
                .send()
                .await
                .map_err(|e| map_sdk_error(ctx, Call::DescribeInstances, ec2.source, e))?;
        }
        Ok(warnings)
    }

    async fn machine_capacity(
        &self,
        ctx: &RequestContext,
        req: &ValidateMachineClass,
    ) -> Result<std::collections::BTreeMap<String, String>> {
        // EC2 says what an instance type has (DescribeInstanceTypes): vCPUs, memory, GPUs.
        let spec = ProviderSpec::parse(&req.provider_spec)?;
        let creds = ClassCredentials::from_secrets(&req.secrets)?;
        let ec2 = self.ec2(spec.region.as_deref(), &creds).await;
        let answer = ec2
            .client
            .describe_instance_types()
            .instance_types(aws_sdk_ec2::types::InstanceType::from(spec.instance_type.as_str()))
            .send()
            .await
            .map_err(|e| map_sdk_error(ctx, Call::DescribeInstanceTypes, ec2.source, e))?;
        let mut out = std::collections::BTreeMap::new();
        let Some(t) = answer.instance_types().first() else { return Ok(out) };
        if let Some(n) = t.v_cpu_info().and_then(|v| v.default_v_cpus()) {
            out.insert("cpu".to_string(), n.to_string());
        }
        if let Some(mib) = t.memory_info().and_then(|m| m.size_in_mib()) {
            out.insert("memory".to_string(), format!("{mib}Mi"));
        }
        let gpus: i32 = t.gpu_info().map(|g| g.gpus().iter().filter_map(|g| g.count()).sum()).unwrap_or(0);
        if gpus > 0 {
            out.insert("nvidia.com/gpu".to_string(), gpus.to_string());
        }
        Ok(out)
    }

    async fn get_operation(&self, ctx: &RequestContext, h: OperationHandle, secrets: Secrets) -> Result<Operation> {
        let st: OpState = h.state_as()?;
        let creds = ClassCredentials::from_secrets(&secrets)?;
        let op = h.resume().with_poll_after(self.config.poll_interval);
        if st.instance_ids.is_empty() {
            // A delete of a machine that did not exist.
            return Ok(op.finish(Ok(OperationOutput::None)));
        }
        let ec2 = self.ec2(Some(&st.region), &creds).await;
        // Exactly one DescribeInstances per poll.
        let out = match ec2.client.describe_instances().set_instance_ids(Some(st.instance_ids.clone())).send().await {
            Ok(out) => out,
            Err(e) if is_instance_not_found(&e) => {
                return Ok(match st.target {
                    Target::Terminated => op.finish(Ok(OperationOutput::None)),
                    Target::Running => {
                        let age =
                            h.start_time.and_then(|t| SystemTime::now().duration_since(t).ok()).unwrap_or_default();
                        if age > self.config.visibility_timeout {
                            op.finish(Err(DriverError::not_found(
                                reason::OPERATION_NOT_FOUND,
                                format!("instance {:?} never became visible in EC2", st.instance_ids),
                            )))
                        } else {
                            // Eventual consistency: launched, not visible yet.
                            op.with_progress(5)
                        }
                    }
                });
            }
            Err(e) => return Err(map_sdk_error(ctx, Call::DescribeInstances, ec2.source, e)),
        };
        let aws_request_id = out.request_id().unwrap_or_default().to_string();
        let op = op.with_cloud_request_id(aws_request_id.clone());
        let instances: Vec<&Instance> = out.reservations().iter().flat_map(|r| r.instances()).collect();
        match st.target {
            Target::Terminated => {
                let left = instances.iter().filter(|i| Ec2State::of(i) != Ec2State::Terminated).count();
                Ok(if left == 0 { op.finish(Ok(OperationOutput::None)) } else { op.with_progress(50) })
            }
            Target::Running => {
                let Some(i) = instances.first() else {
                    return Ok(op.with_progress(5));
                };
                Ok(match Ec2State::of(i) {
                    Ec2State::Pending | Ec2State::Unknown => op.with_progress(50),
                    Ec2State::ShuttingDown | Ec2State::Terminated => {
                        op.finish(Err(launch_failed(i).with_cloud_request_id(aws_request_id)))
                    }
                    _ => op.finish(Ok(OperationOutput::Machine(to_machine(i)))),
                })
            }
        }
    }
}

/// The error of a launch whose instance went away before it ran (EC2's state reason says why,
/// e.g. `Server.InsufficientInstanceCapacity`).
fn launch_failed(i: &Instance) -> DriverError {
    let code = i.state_reason().and_then(|r| r.code()).unwrap_or_default();
    let message = i.state_reason().and_then(|r| r.message()).unwrap_or("terminated before it ran");
    let what = format!("instance {} was terminated during launch: {message}", i.instance_id().unwrap_or_default());
    // State reason codes are `Server.<code>` / `Client.<code>`.
    let bare = code.strip_prefix("Server.").or_else(|| code.strip_prefix("Client.")).unwrap_or(code);
    let err = match errors::classify(bare, None) {
        errors::Class::Capacity => DriverError::insufficient_capacity(what),
        errors::Class::Quota => DriverError::quota_exceeded(what),
        _ => DriverError::new(driver_sdk::tonic::Code::Internal, reason::CLOUD_OPERATION_FAILED, what),
    };
    if code.is_empty() {
        err
    } else {
        err.with_metadata(errors::META_AWS_ERROR_CODE, code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_tokens_are_deterministic_short_and_per_incarnation() {
        let t = client_token("web-0", "uid-1", "abcd");
        assert_eq!(t, client_token("web-0", "uid-1", "abcd"));
        assert!(t.len() <= 64 && t.is_ascii());
        assert_ne!(t, client_token("web-0", "uid-2", "abcd"));
        assert_ne!(t, client_token("web-0", "uid-1", "abce"));
        assert_ne!(t, client_token("web-1", "uid-1", "abcd"));
        let n = next_client_token(&t, "i-0123");
        assert_eq!(n, next_client_token(&t, "i-0123"));
        assert_ne!(n, t);
    }

    #[test]
    fn page_tokens_round_trip_and_garbage_is_refused() {
        let t = PageToken { next: "abc".into(), skip: 3, max_results: 5 };
        assert_eq!(PageToken::decode(&t.encode()).unwrap(), t);
        for bad in ["%%garbage%%", "e30", "bm90LWpzb24"] {
            let err = PageToken::decode(bad).unwrap_err();
            assert_eq!(err.reason(), reason::FIELD_INVALID, "{bad}");
            assert_eq!(err.violations()[0].field, "page_token");
        }
    }

    /// EC2 changes nothing of an instance in place here: every spec change replaces the machine
    /// (the controller drains the old one first), so there is no in-place disruption to state.
    #[tokio::test]
    async fn every_change_replaces_so_no_in_place_disruption_is_stated() {
        let sdk =
            SdkConfig::builder().region(Region::new("eu-west-1")).behavior_version(BehaviorVersion::latest()).build();
        let d = AwsEc2Driver::from_sdk_config(sdk, Config::default()).unwrap();
        assert!(!d.capabilities().contains(&Capability::InPlaceUpdate));
        let ctx = RequestContext::for_method("test", "CanUpdateMachine");
        let spec = serde_json::json!({"instanceType": "t3.micro", "tags": {"tier": "web"}});
        let req = driver_sdk::CanUpdateMachine {
            name: "web-0".into(),
            current: spec.clone(),
            desired: serde_json::json!({"instanceType": "t3.micro", "tags": {"tier": "api"}}),
            changed_paths: vec!["/tags/tier".into()],
            secrets: Secrets::default(),
        };
        let err = d.can_update_machine(&ctx, req).await.unwrap_err();
        assert_eq!(err.code(), driver_sdk::tonic::Code::Unimplemented, "{err}");
    }

    /// A driver whose EC2 endpoint answers nothing: a call that reached it would fail with
    /// UNAVAILABLE, not with the refusal the tests expect.
    fn offline_driver() -> AwsEc2Driver {
        let sdk = SdkConfig::builder()
            .region(Region::new("eu-west-1"))
            .endpoint_url("http://127.0.0.1:9")
            .behavior_version(BehaviorVersion::latest())
            .build();
        AwsEc2Driver::from_sdk_config(sdk, Config::default()).unwrap()
    }

    #[tokio::test]
    async fn too_large_rendered_user_data_is_refused_at_create_and_validate_before_any_ec2_call() {
        let d = offline_driver();
        let marker = "bootstrap-token-abcdef.0123456789abcdef";
        let big = format!("#!/bin/sh\n{}", marker.repeat(spec::MAX_USER_DATA_BYTES / marker.len() + 1));
        let secrets: Secrets = [
            (spec::USER_DATA_KEY, big.as_str()),
            (credentials::ACCESS_KEY_ID, "AKIAEXAMPLE"),
            (credentials::SECRET_ACCESS_KEY, "example-secret"),
        ]
        .into_iter()
        .collect();
        let provider_spec = serde_json::json!({"instanceType": "t3.micro", "imageId": "ami-12345678", "userData": "x"});
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
    }

    #[tokio::test]
    async fn a_secret_holding_only_boot_data_is_no_credential_warning() {
        let d = offline_driver();
        let ctx = RequestContext::for_method("test", "ValidateMachineClass");
        let provider_spec = serde_json::json!({"instanceType": "t3.micro", "imageId": "ami-12345678",
            "subnetId": "subnet-12345678", "securityGroupIds": ["sg-12345678"]});
        let only_boot: Secrets = [(spec::USER_DATA_KEY, "#!/bin/sh\n")].into_iter().collect();
        let req = ValidateMachineClass { provider_spec: provider_spec.clone(), secrets: only_boot };
        assert_eq!(d.validate_machine_class(&ctx, req).await.unwrap(), Vec::<String>::new());
        let other: Secrets = [("somethingElse", "v")].into_iter().collect();
        let warnings =
            d.validate_machine_class(&ctx, ValidateMachineClass { provider_spec, secrets: other }).await.unwrap();
        assert!(warnings.iter().any(|w| w.contains("default AWS credential chain")), "{warnings:?}");
    }

    #[test]
    fn a_launch_ended_by_ec2_says_why() {
        use aws_sdk_ec2::types::StateReason;
        let ended = |code: &str| {
            let i = Instance::builder()
                .instance_id("i-0123456789abcdef0")
                .state_reason(StateReason::builder().code(code).message("m").build())
                .build();
            let e = launch_failed(&i);
            (e.code(), e.reason().to_string())
        };
        let exhausted = driver_sdk::tonic::Code::ResourceExhausted;
        assert_eq!(ended("Server.InsufficientInstanceCapacity"), (exhausted, reason::INSUFFICIENT_CAPACITY.into()));
        assert_eq!(ended("Client.VolumeLimitExceeded"), (exhausted, reason::QUOTA_EXCEEDED.into()));
        assert_eq!(
            ended("Server.InternalError"),
            (driver_sdk::tonic::Code::Internal, reason::CLOUD_OPERATION_FAILED.into())
        );
    }

    #[test]
    fn op_state_is_compact_json() {
        let st = OpState {
            region: "eu-west-1".into(),
            instance_ids: vec!["i-1".into()],
            target: Target::Running,
            client_token: "md-x".into(),
        };
        let v = serde_json::to_value(&st).unwrap();
        assert_eq!(v, serde_json::json!({"r": "eu-west-1", "i": ["i-1"], "w": "running", "ct": "md-x"}));
        assert_eq!(serde_json::from_value::<OpState>(v).unwrap(), st);
    }
}
