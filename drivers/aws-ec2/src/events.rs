//! The cloud's own moves ([`driver_sdk::Driver::watch_events`]): two sources merged into one
//! stream, each event for an instance this driver launched (tagged `machinedriver.dev/name`).
//!
//! - **The interruption queue** (`--interruption-queue-url`): an SQS queue that EventBridge rules
//!   feed, long-polled (`WaitTimeSeconds` 20, up to 10 messages). The message body is the event
//!   exactly as EventBridge delivers it ([`parse_message`]):
//!
//!   | `detail-type` | event |
//!   |---|---|
//!   | `EC2 Spot Instance Interruption Warning` | SPOT_INTERRUPTION, `not_before` = `time` + 2 min, action = `detail.instance-action` |
//!   | `EC2 Instance Rebalance Recommendation` | REBALANCE_RECOMMENDATION, no deadline |
//!   | `EC2 Instance State-change Notification` | `stopping` → STOPPING, `stopped` → STOPPED, `shutting-down` / `terminated` → TERMINATED (action terminate); other states: none |
//!   | `AWS Health Event`, category `scheduledChange`, service EC2 | SCHEDULED_MAINTENANCE per affected instance, `not_before` = `detail.startTime` |
//!
//!   `event_id` is the EventBridge event's `id` (`<id>/<instance-id>` when one message names
//!   several instances), so a message delivered twice (two rules, or SQS's at-least-once) is one
//!   event. A message is deleted only when the controller acknowledged every event in it
//!   ([`driver_sdk::Driver::ack_event`]); its latest receipt handle is kept, since a message
//!   received again gets a new one. A message naming an instance this driver does not own is
//!   left alone, not deleted and not made visible early: another cluster's driver may read the
//!   same queue, and the message comes back after the queue's visibility timeout (with the
//!   queue's redrive policy ending it). A message that is no event (not JSON, an unknown
//!   `detail-type`, fields missing) or an event with nothing to do for our instances is deleted
//!   at once, with a warning naming the message ID (never the body).
//! - **DescribeInstanceStatus** every `--instance-status-interval` over the driver's running
//!   instances ([`status_notices`]): `instanceStatus` or `systemStatus` `impaired` → IMPAIRED;
//!   each scheduled event not yet completed or canceled → SCHEDULED_MAINTENANCE with its
//!   `NotBefore` (action: reboot for `system-reboot` / `instance-reboot`, stop for
//!   `instance-stop`, stop or terminate for `instance-retirement` by the root device, none said
//!   for `system-maintenance`). IDs are stable across polls (the AWS `instance-event-…` ID; the
//!   instance, check and `impairedSince` for an impairment), so the SDK delivers each once.
//!
//! Both use the sidecar's own credentials (the standard chain) and region: a MachineClass's
//! secret is not known outside its calls. An instance ID is mapped to its machine by one
//! `DescribeInstances` (cached); an instance the driver terminated itself yields no STOPPED or
//! TERMINATED event.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use aws_config::timeout::TimeoutConfig;
use aws_config::{Region, SdkConfig};
use aws_sdk_ec2::primitives::{DateTime, DateTimeFormat};
use aws_sdk_ec2::types::{
    DeviceType, EventCode, Filter, Instance, InstanceLifecycleType, InstanceStatus, SummaryStatus,
};
use driver_sdk::{
    lock, CapacityType, CloudAction, DriverError, EventKind, EventStream, MachineEvent, Offering, RequestContext,
    Result,
};
use serde_json::Value;
use tokio::sync::mpsc;

use crate::credentials::Source;
use crate::errors::{map_sdk_error, Call};
use crate::instance::{self, provider_id, Ec2State};
use crate::spec::TAG_NAME;

/// [`EventConfig::instance_status_interval`] by default (`--instance-status-interval`).
pub const DEFAULT_INSTANCE_STATUS_INTERVAL: Duration = Duration::from_secs(60);
/// The notice of a spot interruption: AWS sends the warning two minutes before it acts.
pub const SPOT_NOTICE: Duration = Duration::from_secs(120);
/// SQS's longest long poll.
const RECEIVE_WAIT: Duration = Duration::from_secs(20);
/// SQS's most messages per ReceiveMessage.
const RECEIVE_MAX: i32 = 10;
/// Most instance IDs per DescribeInstances / DescribeInstanceStatus call.
const IDS_PER_CALL: usize = 100;
/// Most DescribeInstances pages one poll reads.
const MAX_PAGES: usize = 20;
/// How long "not ours" is believed for an instance ID before it is looked up again.
const FOREIGN_TTL: Duration = Duration::from_secs(300);
/// Bounds of what the source remembers (instances, acknowledged IDs, own terminations).
const REMEMBERED: usize = 10_000;
/// Events waiting for the SDK to read them.
const CHANNEL: usize = 64;
/// The pause after a failed call of a source, doubling up to the maximum.
const RETRY_PAUSE: Duration = Duration::from_secs(1);
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(60);

/// Where the events come from.
#[derive(Debug, Clone)]
pub struct EventConfig {
    /// The SQS queue EventBridge feeds; `None`: no queue is read.
    pub queue_url: Option<String>,
    /// How often DescribeInstanceStatus runs; zero: never.
    pub instance_status_interval: Duration,
}

impl Default for EventConfig {
    fn default() -> Self {
        Self { queue_url: None, instance_status_interval: DEFAULT_INSTANCE_STATUS_INTERVAL }
    }
}

impl EventConfig {
    /// Whether any source runs (the driver advertises `CAPABILITY_EVENTS` then).
    pub fn enabled(&self) -> bool {
        self.queue_url.is_some() || !self.instance_status_interval.is_zero()
    }
}

// ------------------------------------------------------------------------------------ parsing

/// One thing the cloud says about one instance, before it is known whose instance it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// The event's ID (see the module docs).
    pub event_id: String,
    /// `i-…`.
    pub instance_id: String,
    /// What it means; `None`: nothing to do (a state change to `running`).
    pub kind: Option<EventKind>,
    /// What the cloud will do.
    pub action: CloudAction,
    /// The deadline.
    pub not_before: Option<SystemTime>,
    /// When the cloud saw it.
    pub observed_at: SystemTime,
    /// For people.
    pub message: String,
}

/// Why a message is no event this driver understands.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NotAnEvent(String);

fn parse_time(s: &str) -> Option<SystemTime> {
    [DateTimeFormat::DateTime, DateTimeFormat::HttpDate]
        .into_iter()
        .find_map(|f| DateTime::from_str(s.trim(), f).ok())
        .and_then(|t| SystemTime::try_from(t).ok())
}

fn action_of(s: &str) -> CloudAction {
    match s {
        "terminate" => CloudAction::Terminate,
        "stop" => CloudAction::Stop,
        "hibernate" => CloudAction::Hibernate,
        _ => CloudAction::Unspecified,
    }
}

/// The notices of one message body, exactly as EventBridge delivers an event to SQS.
///
/// # Errors
/// [`NotAnEvent`] for a body that is not an EventBridge event of a `detail-type` above, or
/// lacks the fields it needs (say which, never the body).
pub fn parse_message(body: &str) -> std::result::Result<Vec<Notice>, NotAnEvent> {
    let v: Value = serde_json::from_str(body).map_err(|e| NotAnEvent(format!("not JSON: {e}")))?;
    let text = |p: &str| v.pointer(p).and_then(Value::as_str).filter(|s| !s.is_empty());
    let need = |p: &str| text(p).ok_or_else(|| NotAnEvent(format!("no {p}")));
    let id = need("/id")?;
    let detail_type = need("/detail-type")?;
    let time = need("/time")?;
    let observed_at = parse_time(time).ok_or_else(|| NotAnEvent(format!("/time {time:?} is not a time")))?;
    let one = |instance: &str, kind: Option<EventKind>, action, not_before, message: String| Notice {
        event_id: id.to_string(),
        instance_id: instance.to_string(),
        kind,
        action,
        not_before,
        observed_at,
        message,
    };
    match detail_type {
        "EC2 Spot Instance Interruption Warning" => {
            let instance = need("/detail/instance-id")?;
            let action = text("/detail/instance-action").unwrap_or("terminate");
            Ok(vec![one(
                instance,
                Some(EventKind::SpotInterruption),
                action_of(action),
                Some(observed_at + SPOT_NOTICE),
                format!("EC2 spot instance interruption warning: the instance is reclaimed ({action}) 2 minutes after {time}"),
            )])
        }
        "EC2 Instance Rebalance Recommendation" => {
            let instance = need("/detail/instance-id")?;
            Ok(vec![one(
                instance,
                Some(EventKind::RebalanceRecommendation),
                CloudAction::Unspecified,
                None,
                "EC2 instance rebalance recommendation: the spot instance is at an elevated risk of interruption"
                    .into(),
            )])
        }
        "EC2 Instance State-change Notification" => {
            let instance = need("/detail/instance-id")?;
            let state = need("/detail/state")?;
            let (kind, action) = match state {
                "stopping" => (Some(EventKind::Stopping), CloudAction::Stop),
                "stopped" => (Some(EventKind::Stopped), CloudAction::Stop),
                "shutting-down" | "terminated" => (Some(EventKind::Terminated), CloudAction::Terminate),
                _ => (None, CloudAction::Unspecified),
            };
            Ok(vec![one(instance, kind, action, None, format!("EC2 instance state changed to {state}"))])
        }
        "AWS Health Event" => {
            let category = need("/detail/eventTypeCategory")?;
            let code = text("/detail/eventTypeCode").unwrap_or("an EC2 scheduled change");
            let instances: Vec<&str> = v
                .pointer("/detail/affectedEntities")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|e| e.get("entityValue").and_then(Value::as_str))
                        .filter(|s| instance::instance_id_of(s) == Some(*s))
                        .collect()
                })
                .unwrap_or_default();
            if category != "scheduledChange" || text("/detail/service").is_some_and(|s| s != "EC2") {
                return Err(NotAnEvent(format!(
                    "an AWS Health event of category {category:?}, not an EC2 scheduledChange"
                )));
            }
            if instances.is_empty() {
                return Err(NotAnEvent("an AWS Health scheduledChange that names no instance".into()));
            }
            let not_before = match text("/detail/startTime") {
                Some(t) => {
                    Some(parse_time(t).ok_or_else(|| NotAnEvent(format!("/detail/startTime {t:?} is not a time")))?)
                }
                None => None,
            };
            let action = if code.contains("REBOOT") {
                CloudAction::Reboot
            } else if code.contains("STOP") || code.contains("RETIREMENT") {
                CloudAction::Stop
            } else if code.contains("TERMINATION") {
                CloudAction::Terminate
            } else {
                CloudAction::Unspecified
            };
            let several = instances.len() > 1;
            Ok(instances
                .iter()
                .map(|i| {
                    let mut n = one(
                        i,
                        Some(EventKind::ScheduledMaintenance),
                        action,
                        not_before,
                        format!("AWS Health scheduled change {code}"),
                    );
                    if several {
                        n.event_id = format!("{id}/{i}");
                    }
                    n
                })
                .collect())
        }
        other => Err(NotAnEvent(format!("unknown detail-type {other:?}"))),
    }
}

/// The notices of one DescribeInstanceStatus entry; `ebs_root`: the instance's root device is
/// EBS (a retirement stops it; else it terminates).
pub fn status_notices(s: &InstanceStatus, ebs_root: bool, now: SystemTime) -> Vec<Notice> {
    let Some(iid) = s.instance_id() else { return Vec::new() };
    let mut out = Vec::new();
    let checks = [("instance", s.instance_status()), ("system", s.system_status())];
    for (check, summary) in checks {
        let Some(summary) = summary.filter(|x| x.status() == Some(&SummaryStatus::Impaired)) else { continue };
        let since = summary.details().iter().find_map(|d| d.impaired_since()).map(|t| t.secs()).unwrap_or_default();
        let failed: Vec<&str> = summary
            .details()
            .iter()
            .filter(|d| d.status().map(|x| x.as_str()) == Some("failed"))
            .filter_map(|d| d.name().map(|n| n.as_str()))
            .collect();
        out.push(Notice {
            event_id: format!("{iid}/{check}-impaired/{since}"),
            instance_id: iid.to_string(),
            kind: Some(EventKind::Impaired),
            action: CloudAction::Unspecified,
            not_before: None,
            observed_at: now,
            message: format!("EC2 {check} status check impaired (failed: {})", failed.join(", ")),
        });
    }
    for ev in s.events() {
        let description = ev.description().unwrap_or_default();
        if description.starts_with("[Completed]") || description.starts_with("[Canceled]") {
            continue;
        }
        let Some(code) = ev.code() else { continue };
        let action = match code {
            EventCode::SystemReboot | EventCode::InstanceReboot => CloudAction::Reboot,
            EventCode::InstanceStop => CloudAction::Stop,
            EventCode::InstanceRetirement if ebs_root => CloudAction::Stop,
            EventCode::InstanceRetirement => CloudAction::Terminate,
            _ => CloudAction::Unspecified,
        };
        let not_before = ev.not_before().and_then(|t| SystemTime::try_from(*t).ok());
        let event_id = match ev.instance_event_id().filter(|i| !i.is_empty()) {
            Some(id) => format!("{iid}/{id}"),
            None => format!("{iid}/{}/{}", code.as_str(), ev.not_before().map(|t| t.secs()).unwrap_or_default()),
        };
        out.push(Notice {
            event_id,
            instance_id: iid.to_string(),
            kind: Some(EventKind::ScheduledMaintenance),
            action,
            not_before,
            observed_at: now,
            message: format!("EC2 scheduled event {}: {description}", code.as_str()),
        });
    }
    out
}

// ----------------------------------------------------------------------------- bookkeeping

/// An instance of this driver, as events name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Owned {
    machine: String,
    provider_id: String,
    offering: Offering,
    ebs_root: bool,
}

impl Owned {
    /// The instance's owner data, when it carries the driver's name tag.
    fn of(i: &Instance) -> Option<Self> {
        let machine = instance::tag(i, TAG_NAME).filter(|n| !n.is_empty())?.to_string();
        let capacity_type = match i.instance_lifecycle() {
            Some(InstanceLifecycleType::Spot) => CapacityType::Spot,
            _ if i.capacity_reservation_id().is_some_and(|r| !r.is_empty()) => CapacityType::Reserved,
            _ => CapacityType::OnDemand,
        };
        Some(Owned {
            machine,
            provider_id: provider_id(i),
            offering: Offering {
                zone: i.placement().and_then(|p| p.availability_zone()).unwrap_or_default().to_string(),
                machine_type: i.instance_type().map(|t| t.as_str().to_string()).unwrap_or_default(),
                capacity_type,
            },
            ebs_root: i.root_device_type() != Some(&DeviceType::InstanceStore),
        })
    }

    fn event(&self, n: Notice, kind: EventKind) -> MachineEvent {
        MachineEvent {
            event_id: n.event_id,
            machine_name: self.machine.clone(),
            provider_id: self.provider_id.clone(),
            pool_name: String::new(),
            kind,
            not_before: n.not_before,
            observed_at: n.observed_at,
            action: n.action,
            offering: self.offering.clone(),
            message: n.message,
        }
    }
}

/// A message waiting for the acknowledgements of its events.
#[derive(Debug)]
struct Held {
    /// The newest receipt handle (each receive issues a new one; only the newest deletes).
    receipt: String,
    /// Its events not acknowledged yet.
    waiting: HashSet<String>,
}

/// What the source remembers: owners, held messages, acknowledged IDs.
#[derive(Debug, Default)]
pub(crate) struct Book {
    owners: HashMap<String, Owned>,
    foreign: HashMap<String, Instant>,
    held: HashMap<String, Held>,
    by_event: HashMap<String, HashSet<String>>,
    acked: HashSet<String>,
    acked_order: VecDeque<String>,
    terminated_by_us: HashSet<String>,
}

impl Book {
    /// Holds message `id` (received with `receipt`) for `events`. Returns whether every one of
    /// them is acknowledged already (then the message is to be deleted now).
    fn hold(&mut self, id: &str, receipt: &str, events: &[String]) -> bool {
        let waiting: HashSet<String> = events.iter().filter(|e| !self.acked.contains(*e)).cloned().collect();
        for e in &waiting {
            self.by_event.entry(e.clone()).or_default().insert(id.to_string());
        }
        let done = waiting.is_empty();
        self.held.insert(id.to_string(), Held { receipt: receipt.to_string(), waiting });
        done
    }

    /// `event` is acknowledged: the messages (ID, receipt) none of whose events wait any more.
    fn ack(&mut self, event: &str) -> Vec<(String, String)> {
        if self.acked.insert(event.to_string()) {
            self.acked_order.push_back(event.to_string());
            while self.acked_order.len() > REMEMBERED {
                if let Some(old) = self.acked_order.pop_front() {
                    self.acked.remove(&old);
                }
            }
        }
        let mut due = Vec::new();
        for m in self.by_event.remove(event).unwrap_or_default() {
            if let Some(h) = self.held.get_mut(&m) {
                h.waiting.remove(event);
                if h.waiting.is_empty() {
                    due.push((m, h.receipt.clone()));
                }
            }
        }
        due
    }

    /// A delete of message `id` failed: the next acknowledgement of `event` tries it again.
    fn retry(&mut self, event: &str, id: &str) {
        self.by_event.entry(event.to_string()).or_default().insert(id.to_string());
    }

    fn deleted(&mut self, id: &str) {
        self.held.remove(id);
    }

    fn remember_owner(&mut self, instance: String, owned: Owned) {
        if self.owners.len() >= REMEMBERED && !self.owners.contains_key(&instance) {
            self.owners.clear();
        }
        self.foreign.remove(&instance);
        self.owners.insert(instance, owned);
    }

    fn remember_foreign(&mut self, instance: String, now: Instant) {
        if self.foreign.len() >= REMEMBERED {
            self.foreign.retain(|_, at| now.duration_since(*at) < FOREIGN_TTL);
            if self.foreign.len() >= REMEMBERED {
                self.foreign.clear();
            }
        }
        self.foreign.insert(instance, now);
    }

    /// What is known of `instance`: `Some(Some)` ours, `Some(None)` foreign, `None` unknown.
    fn owner(&self, instance: &str, now: Instant) -> Option<Option<Owned>> {
        if let Some(o) = self.owners.get(instance) {
            return Some(Some(o.clone()));
        }
        match self.foreign.get(instance) {
            Some(at) if now.duration_since(*at) < FOREIGN_TTL => Some(None),
            _ => None,
        }
    }
}

// ----------------------------------------------------------------------------------- source

/// The event source of one driver: its clients and its [`Book`].
pub(crate) struct EventSource {
    config: EventConfig,
    region: String,
    ec2: aws_sdk_ec2::Client,
    sqs: Option<(aws_sdk_sqs::Client, String)>,
    book: Mutex<Book>,
}

/// The region of an SQS queue URL (`https://sqs.<region>.amazonaws.com/<account>/<name>`);
/// `None` for another form (a custom endpoint such as an emulator).
pub fn queue_region(url: &str) -> Option<&str> {
    let host = url.split("://").nth(1)?.split('/').next()?;
    let rest = host.strip_prefix("sqs.")?;
    let region = rest.split('.').next()?;
    (!region.is_empty() && region.contains('-')).then_some(region)
}

impl EventSource {
    /// The source on the sidecar's SDK configuration (its chain credentials and endpoint
    /// overrides: `AWS_ENDPOINT_URL_SQS`, `AWS_ENDPOINT_URL`).
    pub(crate) fn new(sdk: &SdkConfig, region: &str, config: EventConfig, call_timeout: Duration) -> Arc<Self> {
        let ec2 = aws_sdk_ec2::Client::from_conf(
            aws_sdk_ec2::config::Builder::from(sdk).region(Region::new(region.to_string())).build(),
        );
        let sqs = config.queue_url.clone().map(|url| {
            let queue_region = queue_region(&url).unwrap_or(region).to_string();
            // A long poll takes up to 20 s: the call bound is on top of it.
            let timeouts = TimeoutConfig::builder()
                .connect_timeout(call_timeout.min(Duration::from_secs(3)))
                .operation_timeout(RECEIVE_WAIT + call_timeout)
                .build();
            let conf =
                aws_sdk_sqs::config::Builder::from(sdk).region(Region::new(queue_region)).timeout_config(timeouts);
            (aws_sdk_sqs::Client::from_conf(conf.build()), url)
        });
        Arc::new(Self { config, region: region.to_string(), ec2, sqs, book: Mutex::new(Book::default()) })
    }

    /// The driver terminated this instance itself: its state changes are no event.
    pub(crate) fn terminating(&self, ids: &[String]) {
        let mut book = lock(&self.book);
        if book.terminated_by_us.len() >= REMEMBERED {
            book.terminated_by_us.clear();
        }
        book.terminated_by_us.extend(ids.iter().cloned());
    }

    /// The stream: one task per source, both ending when the SDK drops the stream.
    pub(crate) fn stream(self: &Arc<Self>) -> EventStream {
        let (tx, rx) = mpsc::channel::<Result<MachineEvent>>(CHANNEL);
        if self.sqs.is_some() {
            let (me, tx) = (self.clone(), tx.clone());
            tokio::spawn(async move { me.read_queue(tx).await });
        }
        if !self.config.instance_status_interval.is_zero() {
            let (me, tx) = (self.clone(), tx.clone());
            tokio::spawn(async move { me.poll_status(tx).await });
        }
        drop(tx);
        Box::pin(futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) }))
    }

    /// The owners of `instances` (each `None` when foreign), looked up once per unknown ID.
    async fn owners(&self, ctx: &RequestContext, instances: &[&str]) -> Result<HashMap<String, Option<Owned>>> {
        let now = Instant::now();
        let mut out = HashMap::new();
        let mut unknown = Vec::new();
        {
            let book = lock(&self.book);
            for i in instances {
                match book.owner(i, now) {
                    Some(o) => {
                        out.insert(i.to_string(), o);
                    }
                    None => unknown.push(i.to_string()),
                }
            }
        }
        for chunk in unknown.chunks(IDS_PER_CALL) {
            // A filter, not InstanceIds: an ID EC2 does not know (another account's, long gone)
            // is no error, just not ours.
            let page = self
                .ec2
                .describe_instances()
                .filters(Filter::builder().name("instance-id").set_values(Some(chunk.to_vec())).build())
                .send()
                .await
                .map_err(|e| map_sdk_error(ctx, Call::DescribeInstances, Source::Chain, e))?;
            let found: Vec<&Instance> = page.reservations().iter().flat_map(|r| r.instances()).collect();
            let mut book = lock(&self.book);
            for id in chunk {
                let owned = found.iter().find(|i| i.instance_id() == Some(id.as_str())).and_then(|i| Owned::of(i));
                match &owned {
                    Some(o) => book.remember_owner(id.clone(), o.clone()),
                    None => book.remember_foreign(id.clone(), now),
                }
                out.insert(id.clone(), owned);
            }
        }
        Ok(out)
    }

    // ------------------------------------------------------------------------------ the queue

    async fn read_queue(self: Arc<Self>, tx: mpsc::Sender<Result<MachineEvent>>) {
        let Some((sqs, url)) = self.sqs.clone() else { return };
        tracing::info!(queue = %url, "reading the interruption queue");
        let mut pause = RETRY_PAUSE;
        loop {
            let ctx = RequestContext::new(format!("events-sqs-{}", uuid_like()));
            let received = tokio::select! {
                r = sqs
                    .receive_message()
                    .queue_url(&url)
                    .max_number_of_messages(RECEIVE_MAX)
                    .wait_time_seconds(RECEIVE_WAIT.as_secs() as i32)
                    .send() => r,
                () = tx.closed() => return,
            };
            let out = match received {
                Ok(out) => out,
                Err(e) => {
                    let err = map_sdk_error(&ctx, Call::ReceiveMessage, Source::Chain, e);
                    tracing::warn!(queue = %url, "ReceiveMessage failed: {err}; again in {pause:?}");
                    if !backoff(&tx, &mut pause).await {
                        return;
                    }
                    continue;
                }
            };
            let mut failed = false;
            for m in out.messages() {
                match self.take_message(&ctx, &sqs, &url, m).await {
                    Ok(events) => {
                        for e in events {
                            if tx.send(Ok(e)).await.is_err() {
                                return;
                            }
                        }
                    }
                    Err(err) => {
                        // Left in the queue: it is received again after its visibility timeout.
                        tracing::warn!(
                            "message.id" = m.message_id().unwrap_or_default(),
                            "could not look the message's instances up: {err}"
                        );
                        failed = true;
                    }
                }
            }
            if failed {
                if !backoff(&tx, &mut pause).await {
                    return;
                }
            } else {
                pause = RETRY_PAUSE;
            }
        }
    }

    /// One message: the events to yield; deleted now when it is none of ours to wait for.
    async fn take_message(
        &self,
        ctx: &RequestContext,
        sqs: &aws_sdk_sqs::Client,
        url: &str,
        m: &aws_sdk_sqs::types::Message,
    ) -> Result<Vec<MachineEvent>> {
        let id = m.message_id().unwrap_or_default();
        let receipt = m.receipt_handle().unwrap_or_default();
        let notices = match parse_message(m.body().unwrap_or_default()) {
            Ok(n) => n,
            Err(why) => {
                tracing::warn!("message.id" = %id, "deleting a queue message that is no event this driver reads: {why}");
                self.delete(ctx, sqs, url, id, receipt).await;
                return Ok(Vec::new());
            }
        };
        let instances: Vec<&str> = {
            let mut v: Vec<&str> = notices.iter().map(|n| n.instance_id.as_str()).collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        let owners = self.owners(ctx, &instances).await?;
        if let Some(foreign) = instances.iter().find(|i| owners.get(**i).is_none_or(Option::is_none)) {
            tracing::debug!(
                "message.id" = %id, "instance.id" = %foreign,
                "a queue message names an instance this driver does not own; left for its owner"
            );
            return Ok(Vec::new());
        }
        let mut events = Vec::new();
        {
            let book = lock(&self.book);
            for n in notices {
                let Some(kind) = n.kind else { continue };
                if matches!(kind, EventKind::Stopped | EventKind::Terminated | EventKind::Stopping)
                    && book.terminated_by_us.contains(&n.instance_id)
                {
                    continue; // the driver's own DeleteMachine
                }
                let Some(Some(owned)) = owners.get(&n.instance_id) else { continue };
                events.push(owned.event(n, kind));
            }
        }
        let ids: Vec<String> = events.iter().map(|e| e.event_id.clone()).collect();
        let done = lock(&self.book).hold(id, receipt, &ids);
        if done {
            // Nothing to wait for: an event with nothing to do, or every event in it was
            // acknowledged already (a duplicate delivery received after the ack).
            self.delete(ctx, sqs, url, id, receipt).await;
            return Ok(Vec::new());
        }
        let acked = lock(&self.book).acked.clone();
        events.retain(|e| !acked.contains(&e.event_id));
        Ok(events)
    }

    /// Deletes a message; a failure is logged (the message comes back and is judged again).
    async fn delete(&self, ctx: &RequestContext, sqs: &aws_sdk_sqs::Client, url: &str, id: &str, receipt: &str) {
        if let Err(err) = self.try_delete(ctx, sqs, url, id, receipt).await {
            tracing::warn!("message.id" = %id, "DeleteMessage failed: {err}");
        }
    }

    async fn try_delete(
        &self,
        ctx: &RequestContext,
        sqs: &aws_sdk_sqs::Client,
        url: &str,
        id: &str,
        receipt: &str,
    ) -> Result<()> {
        match sqs.delete_message().queue_url(url).receipt_handle(receipt).send().await {
            Ok(_) => {}
            // Deleted already (or the receipt expired with the message): nothing left to do.
            Err(e) if e.as_service_error().is_some_and(|s| s.is_receipt_handle_is_invalid()) => {}
            Err(e) => return Err(map_sdk_error(ctx, Call::DeleteMessage, Source::Chain, e)),
        }
        tracing::debug!("message.id" = %id, "deleted the queue message");
        lock(&self.book).deleted(id);
        Ok(())
    }

    /// The controller acknowledged `event`: delete the messages that held only acknowledged
    /// events.
    ///
    /// # Errors
    /// A failed DeleteMessage (the event stays pending; the next acknowledgement tries again).
    pub(crate) async fn ack(&self, ctx: &RequestContext, event: &MachineEvent) -> Result<()> {
        let due = lock(&self.book).ack(&event.event_id);
        let Some((sqs, url)) = &self.sqs else { return Ok(()) };
        let mut first_err: Option<DriverError> = None;
        for (id, receipt) in due {
            if let Err(e) = self.try_delete(ctx, sqs, url, &id, &receipt).await {
                lock(&self.book).retry(&event.event_id, &id);
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    // ----------------------------------------------------------------------------- the poll

    async fn poll_status(self: Arc<Self>, tx: mpsc::Sender<Result<MachineEvent>>) {
        loop {
            let ctx = RequestContext::new(format!("events-status-{}", uuid_like()));
            match self.poll_once(&ctx).await {
                Ok(events) => {
                    for e in events {
                        if tx.send(Ok(e)).await.is_err() {
                            return;
                        }
                    }
                }
                Err(err) => tracing::warn!(region = %self.region, "DescribeInstanceStatus poll failed: {err}"),
            }
            tokio::select! {
                // The poll's interval (a schedule, not a synchronisation).
                () = tokio::time::sleep(self.config.instance_status_interval) => {}
                () = tx.closed() => return,
            }
        }
    }

    /// One poll: the driver's running instances (DescribeInstances by tag), then their status.
    pub(crate) async fn poll_once(&self, ctx: &RequestContext) -> Result<Vec<MachineEvent>> {
        let mut owned: HashMap<String, Owned> = HashMap::new();
        let mut next: Option<String> = None;
        for _ in 0..MAX_PAGES {
            let page = self
                .ec2
                .describe_instances()
                .filters(Filter::builder().name("tag-key").values(TAG_NAME).build())
                .filters(Filter::builder().name("instance-state-name").values("running").build())
                .set_next_token(next.take())
                .send()
                .await
                .map_err(|e| map_sdk_error(ctx, Call::DescribeInstances, Source::Chain, e))?;
            for i in page.reservations().iter().flat_map(|r| r.instances()) {
                if let (Some(id), Some(o)) = (i.instance_id(), Owned::of(i)) {
                    if Ec2State::of(i) == Ec2State::Running {
                        owned.insert(id.to_string(), o);
                    }
                }
            }
            match page.next_token().filter(|t| !t.is_empty()) {
                Some(t) => next = Some(t.to_string()),
                None => break,
            }
        }
        {
            let mut book = lock(&self.book);
            for (id, o) in &owned {
                book.remember_owner(id.clone(), o.clone());
            }
        }
        let ids: Vec<String> = owned.keys().cloned().collect();
        let now = SystemTime::now();
        let mut out = Vec::new();
        for chunk in ids.chunks(IDS_PER_CALL) {
            let answer = self
                .ec2
                .describe_instance_status()
                .set_instance_ids(Some(chunk.to_vec()))
                .send()
                .await
                .map_err(|e| map_sdk_error(ctx, Call::DescribeInstanceStatus, Source::Chain, e))?;
            for s in answer.instance_statuses() {
                let Some(o) = s.instance_id().and_then(|i| owned.get(i)) else { continue };
                for n in status_notices(s, o.ebs_root, now) {
                    if let Some(kind) = n.kind {
                        out.push(o.event(n, kind));
                    }
                }
            }
        }
        let book = lock(&self.book);
        out.retain(|e| !book.acked.contains(&e.event_id));
        Ok(out)
    }
}

/// Waits `pause` (doubling it) unless the stream is dropped first; false when it was.
async fn backoff(tx: &mpsc::Sender<Result<MachineEvent>>, pause: &mut Duration) -> bool {
    let wait = *pause;
    *pause = (*pause * 2).min(MAX_RETRY_PAUSE);
    tokio::select! {
        // Deliberate backoff after a failed call.
        () = tokio::time::sleep(wait) => true,
        () = tx.closed() => false,
    }
}

/// A short request ID for the source's own calls.
fn uuid_like() -> String {
    let n = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_nanos();
    format!("{n:x}")
}

#[cfg(test)]
mod tests;
