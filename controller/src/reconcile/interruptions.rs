//! The cloud's own moves, as the drivers stream them (`machinedriver.v1.Events`): for each
//! driver that advertises `CAPABILITY_EVENTS`, the leader keeps one `WatchEvents` stream open,
//! records each event on its Machine (`status.interruption`) and acknowledges it only once that
//! is stored. The owner acts on what is stored (the interruption step,
//! [`crate::plan::steps::interruption`]), so an event that arrives just before a restart of
//! either side is delivered again (nothing was acknowledged) and handled once (its `event_id`
//! is already recorded).
//!
//! A driver without the capability is called as before; a driver whose stream fails is
//! reconnected with the last resume token, backing off from 1 s to 30 s.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use driver_sdk::proto as pb;
use futures::StreamExt;

use super::write::{self, Written};
use crate::app::Ctx;
use crate::events::EventReason;
use crate::nodes::scheduled::ScheduledEvent;
use crate::resources::*;
use crate::runtime::drivers::DriverHandle;
use crate::store::Error as StoreError;

/// The first wait before a stream is opened again, doubled up to [`RECONNECT_MAX`].
const RECONNECT_BASE: Duration = Duration::from_secs(1);
/// The longest wait before a stream is opened again.
const RECONNECT_MAX: Duration = Duration::from_secs(30);
/// How often a driver without the capability is asked again (it may be upgraded in place).
const CAPABILITY_RECHECK: Duration = Duration::from_secs(300);
/// Keepalives asked of the driver: a dead stream is noticed within about twice this.
const KEEPALIVE: Duration = Duration::from_secs(10);
/// How long the driver waits for an acknowledgement before it sends an event again.
const ACK_DEADLINE: Duration = Duration::from_secs(30);
/// Writes of one event that lost to a concurrent change are tried again this many times.
const CONFLICT_RETRIES: usize = 5;

/// What became of one event (the `outcome` label of `controller_interruption_events_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Recorded on its Machine.
    Recorded,
    /// Its Machine holds this event already (a delivery again, after a restart).
    Duplicate,
    /// Its Machine holds an interruption that weighs as much or more (a termination after its
    /// warning is recorded; a recommendation after a warning is not).
    Superseded,
    /// No Machine of that name (or of that provider ID) exists: nothing to act on.
    UnknownMachine,
    /// A kind this controller does not know (a newer driver's): acknowledged, not acted on.
    UnknownKind,
}

impl Outcome {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Recorded => "recorded",
            Outcome::Duplicate => "duplicate",
            Outcome::Superseded => "superseded",
            Outcome::UnknownMachine => "unknown_machine",
            Outcome::UnknownKind => "unknown_kind",
        }
    }
}

/// The controller's kind of a protocol event kind (`None`: unknown, or unset).
pub fn kind_of(kind: i32) -> Option<InterruptionKind> {
    use pb::MachineEventKind as K;
    Some(match K::try_from(kind).ok()? {
        K::Unspecified => return None,
        K::SpotInterruption => InterruptionKind::SpotInterruption,
        K::RebalanceRecommendation => InterruptionKind::RebalanceRecommendation,
        K::ScheduledMaintenance => InterruptionKind::ScheduledMaintenance,
        K::Stopping => InterruptionKind::Stopping,
        K::Stopped => InterruptionKind::Stopped,
        K::Terminated => InterruptionKind::Terminated,
        K::Impaired => InterruptionKind::Impaired,
        K::CapacityReservationInterruption => InterruptionKind::CapacityReservationInterruption,
    })
}

/// The status record of `e` (of `kind`), received at `now`.
pub fn interruption(e: &pb::MachineEvent, kind: InterruptionKind, now: Time) -> Interruption {
    let time = |t: &Option<driver_sdk::prost_types::Timestamp>| {
        t.as_ref().and_then(|t| Time::from_timestamp(t.seconds, u32::try_from(t.nanos).unwrap_or(0)))
    };
    let action = match pb::CloudAction::try_from(e.action).unwrap_or(pb::CloudAction::Unspecified) {
        pb::CloudAction::Unspecified => "",
        pb::CloudAction::Terminate => "Terminate",
        pb::CloudAction::Stop => "Stop",
        pb::CloudAction::Hibernate => "Hibernate",
        pb::CloudAction::Reboot => "Reboot",
    };
    let offering = e.offering.as_ref().map(|o| Offering {
        zone: o.zone.clone(),
        machine_type: o.machine_type.clone(),
        capacity_type: match pb::CapacityType::try_from(o.capacity_type).unwrap_or(pb::CapacityType::Unspecified) {
            pb::CapacityType::Unspecified => String::new(),
            pb::CapacityType::OnDemand => "on-demand".into(),
            pb::CapacityType::Spot => "spot".into(),
            pb::CapacityType::Reserved => "reserved".into(),
        },
    });
    Interruption {
        kind,
        event_id: e.event_id.clone(),
        not_before: time(&e.not_before),
        received_at: now,
        observed_at: time(&e.observed_at),
        action: action.into(),
        offering: offering.filter(|o| *o != Offering::default()),
        message: e.message.clone(),
    }
}

/// How `recorded` and a newer `incoming` interruption of one machine combine: `Some` the one to
/// store, `None` nothing to change (the same event, or one that weighs no more: a kind later in
/// [`InterruptionKind`]'s order weighs more — a termination after its warning).
pub fn merge(recorded: Option<&Interruption>, incoming: Interruption) -> Result<Interruption, Outcome> {
    match recorded {
        None => Ok(incoming),
        Some(r) if r.event_id == incoming.event_id => Err(Outcome::Duplicate),
        Some(r) if incoming.kind <= r.kind => Err(Outcome::Superseded),
        // The deadline does not move later: the earlier one still holds.
        Some(r) => {
            let not_before = match (r.not_before, incoming.not_before) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => b.or(a),
            };
            Ok(Interruption { not_before, ..incoming })
        }
    }
}

/// Watches every driver's event stream (a background task of the leader).
pub async fn run(ctx: Arc<Ctx>) {
    let names: Vec<String> = ctx.app.driver_names().into_iter().map(str::to_string).collect();
    futures::future::join_all(names.into_iter().map(|name| watch(ctx.clone(), name))).await;
}

/// One driver's stream, for as long as the controller leads.
async fn watch(ctx: Arc<Ctx>, name: String) {
    let Some(driver) = ctx.app.driver(&name) else { return };
    let mut resume_token = String::new();
    let mut wait = RECONNECT_BASE;
    let mut names = Names::default();
    loop {
        match events_capable(&ctx, driver).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::debug!(driver = %name, "the driver streams no events (no CAPABILITY_EVENTS)");
                // Deliberate: a driver without events is asked again much later.
                tokio::time::sleep(CAPABILITY_RECHECK).await;
                continue;
            }
            Err(e) => {
                tracing::debug!(driver = %name, "GetCapabilities for events: {e}");
                // Deliberate: the reconnect backoff.
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(RECONNECT_MAX);
                continue;
            }
        }
        match stream(&ctx, driver, &mut resume_token, &mut names).await {
            Ok(received) if received => wait = RECONNECT_BASE,
            Ok(_) => {}
            Err(e) => tracing::info!(driver = %name, "event stream: {e}; reconnecting in {}s", wait.as_secs()),
        }
        // Deliberate: the reconnect backoff (reset once a stream delivered anything).
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(RECONNECT_MAX);
    }
}

/// Whether the driver advertises `CAPABILITY_EVENTS`.
async fn events_capable(ctx: &Ctx, driver: &DriverHandle) -> Result<bool, driver_sdk::CallError> {
    let caps =
        ctx.call(driver, "GetCapabilities", |c| async move { c.get_capabilities(Default::default()).await }).await?;
    Ok(caps.value.capabilities.contains(&(pb::Capability::Events as i32)))
}

/// One stream, until it ends: each event recorded, then acknowledged. Returns whether anything
/// arrived (then the next reconnect starts from the shortest wait).
async fn stream(
    ctx: &Ctx,
    driver: &DriverHandle,
    resume_token: &mut String,
    names: &mut Names,
) -> Result<bool, String> {
    let req = pb::WatchEventsRequest {
        resume_token: resume_token.clone(),
        keepalive_interval: Some(duration(KEEPALIVE)),
        ack_deadline: Some(duration(ACK_DEADLINE)),
    };
    let opened = ctx.call(driver, "WatchEvents", |c| async move { c.watch_events(req).await }).await;
    let mut items = match opened {
        Ok(reply) => {
            tracing::info!("request.id" = %reply.request_id, driver = %driver.name(), "watching the driver's events");
            reply.value
        }
        // A token the driver refuses is forgotten: the next stream starts from what is pending.
        Err(e) if e.code() == tonic::Code::InvalidArgument => {
            resume_token.clear();
            return Err(e.report.to_string());
        }
        Err(e) => return Err(e.report.to_string()),
    };
    let mut received = false;
    loop {
        // Two keepalives missed: the stream is dead, whatever the transport says.
        let next = tokio::time::timeout(KEEPALIVE * 3, items.next()).await;
        let item = match next {
            Err(_) => return Err("no keepalive for 30s".into()),
            Ok(None) => return Ok(received),
            Ok(Some(Err(status))) => return Err(format!("{:?}: {}", status.code(), status.message())),
            Ok(Some(Ok(item))) => item,
        };
        received = true;
        match item.item {
            Some(pb::watch_events_response::Item::Keepalive(k)) => *resume_token = k.resume_token,
            Some(pb::watch_events_response::Item::Event(e)) => {
                let outcome = match record(ctx, names, &e).await {
                    Ok(outcome) => outcome,
                    // Not recorded, so not acknowledged: the driver sends it again.
                    Err(err) => {
                        tracing::warn!(event.id = %e.event_id, machine = %e.machine_name, "recording an event: {err}");
                        continue;
                    }
                };
                let kind = kind_of(e.kind).map_or("Unknown", InterruptionKind::as_str);
                ctx.app.metrics.interruptions.received(kind, outcome);
                tracing::info!(
                    event.id = %e.event_id, machine = %e.machine_name, kind, outcome = outcome.as_str(),
                    delivery = e.delivery_attempt, "driver event"
                );
                let req = pb::AckEventsRequest { event_ids: vec![e.event_id.clone()] };
                if let Err(err) = ctx.call(driver, "AckEvents", |c| async move { c.ack_events(req).await }).await {
                    // Recorded already: the delivery again is a duplicate.
                    tracing::info!(event.id = %e.event_id, "acknowledging an event: {}", err.report);
                }
                *resume_token = e.resume_token;
            }
            None => {}
        }
    }
}

fn duration(d: Duration) -> driver_sdk::prost_types::Duration {
    driver_sdk::prost_types::Duration { seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX), nanos: 0 }
}

/// Machine names to their namespaces, looked up again when a name is not known (an event names
/// the machine as CreateMachine did: by name alone).
#[derive(Default)]
struct Names(HashMap<String, Vec<String>>);

impl Names {
    async fn namespaces(&mut self, ctx: &Ctx, name: &str) -> Result<Vec<String>, StoreError> {
        if !self.0.contains_key(name) {
            self.0.clear();
            for k in ctx.store.keys(Kind::Machine).await? {
                self.0.entry(k.name).or_default().push(k.namespace);
            }
        }
        Ok(self.0.get(name).cloned().unwrap_or_default())
    }
}

/// Records `e` on its Machine (idempotent by `event_id`), with an event and, for a new one, the
/// owner woken by the status write. A machine whose provider ID differs is another VM of the
/// same name (the event is for one gone before): nothing is recorded.
async fn record(ctx: &Ctx, names: &mut Names, e: &pb::MachineEvent) -> Result<Outcome, crate::runtime::ReconcileError> {
    let Some(kind) = kind_of(e.kind) else { return Ok(Outcome::UnknownKind) };
    let mut conflicts = 0;
    loop {
        let mut found = None;
        for ns in names.namespaces(ctx, &e.machine_name).await? {
            if let Some(m) = ctx.store.get::<Machine>(&ns, &e.machine_name).await? {
                let same_vm = e.provider_id.is_empty()
                    || m.status.provider_id.is_empty()
                    || m.status.provider_id == e.provider_id;
                if same_vm {
                    found = Some(m);
                    break;
                }
            }
        }
        let Some(before) = found else { return Ok(Outcome::UnknownMachine) };
        let incoming = interruption(e, kind, Utc::now());
        let merged = match merge(before.status.interruption.as_ref(), incoming) {
            Ok(i) => i,
            Err(outcome) => return Ok(outcome),
        };
        let mut next = before.clone();
        next.status.interruption = Some(merged.clone());
        match write::status(ctx, &before, &next).await {
            Ok(Written::Gone) => return Ok(Outcome::UnknownMachine),
            Ok(_) => {
                announce(ctx, &next, &merged).await;
                return Ok(Outcome::Recorded);
            }
            Err(crate::runtime::ReconcileError::Store(StoreError::Conflict { .. })) if conflicts < CONFLICT_RETRIES => {
                conflicts += 1;
            }
            Err(err) => return Err(err),
        }
    }
}

/// The interruption a Node's scheduled-event condition announces ([`crate::nodes::scheduled`]):
/// a preemption is a spot interruption, a reboot, redeploy or termination a scheduled
/// maintenance; a freeze (the VM paused for seconds, kept) is none.
pub fn node_interruption(s: &ScheduledEvent, now: Time) -> Option<Interruption> {
    let (kind, action) = match s.event_type.as_str() {
        "Preempt" => (InterruptionKind::SpotInterruption, "Terminate"),
        "Terminate" => (InterruptionKind::ScheduledMaintenance, "Terminate"),
        "Freeze" => return None,
        _ => (InterruptionKind::ScheduledMaintenance, "Reboot"),
    };
    let message = format!("Node condition {}: {}", s.condition, s.message);
    Some(Interruption {
        kind,
        event_id: s.event_id.clone(),
        not_before: s.not_before,
        received_at: now,
        observed_at: None,
        action: action.into(),
        offering: None,
        message: message.chars().take(1024).collect(),
    })
}

/// Records on `m` what its Node's scheduled-event condition announces, as a stream's event is
/// recorded (the same merge: idempotent by event ID, a heavier kind keeps the earlier deadline).
/// The caller writes `m`. The condition stands while the event is pending, so only a change is
/// counted and announced.
pub(crate) async fn from_node(ctx: &Ctx, m: &mut Machine, s: &ScheduledEvent) {
    let Some(incoming) = node_interruption(s, Utc::now()) else { return };
    let Ok(merged) = merge(m.status.interruption.as_ref(), incoming) else { return };
    ctx.app.metrics.interruptions.received(merged.kind.as_str(), Outcome::Recorded);
    tracing::info!(machine = %m.metadata.name, event.id = %merged.event_id, kind = merged.kind.as_str(), "node condition");
    m.status.interruption = Some(merged.clone());
    announce(ctx, m, &merged).await;
}

/// The Machine's event for a recorded interruption.
async fn announce(ctx: &Ctx, m: &Machine, i: &Interruption) {
    let deadline = match i.not_before {
        Some(t) => {
            let left = (t - i.received_at).num_seconds();
            format!("not before {} ({left}s from now)", t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
        }
        None => "no deadline given".into(),
    };
    let detail = if i.message.is_empty() { String::new() } else { format!(": {}", i.message) };
    let (reason, then) = if i.kind.involuntary() {
        let then = if i.kind.gone() {
            "its Node goes out of service and it is replaced"
        } else {
            "it is drained before the deadline and replaced"
        };
        (EventReason::Interrupted, then)
    } else {
        (EventReason::RebalanceRecommended, "it is replaced within the owner's budgets")
    };
    let message = format!("{} (event {}), {deadline}{detail}; {then}", i.kind, i.event_id);
    ctx.store.event(Kind::Machine, &m.metadata, reason, message).await;
}

/// A machine created to replace an interrupted one is Ready (its Node is): the margin by which
/// that came before the deadline is measured, and said in an event.
pub(crate) async fn replacement_ready(ctx: &Ctx, m: &Machine) {
    let Some(value) = m.metadata.annotations.get(ANNOTATION_REPLACES_INTERRUPTION) else { return };
    let Some(r) = Replaces::parse(value) else { return };
    let when = match r.not_before {
        Some(t) => {
            let margin = (t - Utc::now()).num_milliseconds() as f64 / 1000.0;
            ctx.app.metrics.interruptions.reached(r.kind, crate::app::Milestone::ReplacementReady, margin);
            if margin >= 0.0 {
                format!("{margin:.1}s before the deadline")
            } else {
                format!("{:.1}s after the deadline", -margin)
            }
        }
        None => "the cloud gave no deadline".into(),
    };
    let message = format!("{} replaces {} ({}) and is Ready, {when}", m.metadata.name, r.machine, r.kind);
    ctx.store.event(Kind::Machine, &m.metadata, EventReason::InterruptionReplaced, message).await;
}

/// An [`ANNOTATION_REPLACES_INTERRUPTION`] value: `<machine>/<kind>/<notBefore or ->`.
#[derive(Debug, PartialEq)]
pub struct Replaces {
    /// The interrupted machine.
    pub machine: String,
    /// Its interruption's kind.
    pub kind: InterruptionKind,
    /// Its deadline.
    pub not_before: Option<Time>,
}

impl Replaces {
    /// Reads a value (`None`: not one this version wrote).
    pub fn parse(value: &str) -> Option<Replaces> {
        let mut parts = value.splitn(3, '/');
        let machine = parts.next()?.to_string();
        let kind = parts.next()?.parse().ok()?;
        let not_before = match parts.next()? {
            "-" => None,
            t => Some(t.parse().ok()?),
        };
        Some(Replaces { machine, kind, not_before })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> Time {
        s.parse().unwrap()
    }

    fn rec(kind: InterruptionKind, id: &str, not_before: Option<&str>) -> Interruption {
        Interruption {
            kind,
            event_id: id.into(),
            not_before: not_before.map(at),
            received_at: at("2026-12-01T10:00:00Z"),
            observed_at: None,
            action: String::new(),
            offering: None,
            message: String::new(),
        }
    }

    #[test]
    fn the_same_event_again_changes_nothing_and_a_heavier_one_keeps_the_earlier_deadline() {
        use InterruptionKind::*;
        let warning = rec(SpotInterruption, "e1", Some("2026-12-01T10:02:00Z"));
        assert_eq!(merge(None, warning.clone()), Ok(warning.clone()));
        assert_eq!(merge(Some(&warning), warning.clone()), Err(Outcome::Duplicate));
        // A recommendation after the warning weighs less.
        assert_eq!(merge(Some(&warning), rec(RebalanceRecommendation, "e2", None)), Err(Outcome::Superseded));
        // The termination weighs more; the warning's deadline still holds.
        let gone = merge(Some(&warning), rec(Terminated, "e3", None)).unwrap();
        assert_eq!((gone.kind, gone.event_id.as_str()), (Terminated, "e3"));
        assert_eq!(gone.not_before, warning.not_before);
        // A later deadline does not move it.
        let later = merge(
            Some(&rec(Stopping, "a", Some("2026-12-01T10:01:00Z"))),
            rec(Stopped, "b", Some("2026-12-01T11:00:00Z")),
        );
        assert_eq!(later.unwrap().not_before, Some(at("2026-12-01T10:01:00Z")));
    }

    #[test]
    fn a_replacements_annotation_reads_back() {
        let r = Replaces::parse("web-1/SpotInterruption/2026-12-01T10:02:00.000Z").unwrap();
        assert_eq!(r.machine, "web-1");
        assert_eq!(r.kind, InterruptionKind::SpotInterruption);
        assert_eq!(r.not_before, Some(at("2026-12-01T10:02:00Z")));
        assert_eq!(Replaces::parse("web-1/Terminated/-").unwrap().not_before, None);
        assert_eq!(Replaces::parse("web-1/NoSuchKind/-"), None);
        assert_eq!(Replaces::parse("garbage"), None);
    }

    #[test]
    fn every_protocol_kind_is_known_and_an_unknown_one_is_none() {
        let known: Vec<InterruptionKind> = (1..=8).filter_map(kind_of).collect();
        assert_eq!(known.len(), InterruptionKind::ALL.len());
        assert_eq!(kind_of(0), None);
        assert_eq!(kind_of(99), None);
    }

    #[test]
    fn an_event_reads_into_status_with_its_deadline_action_and_offering() {
        let e = pb::MachineEvent {
            event_id: "i-1".into(),
            machine_name: "m".into(),
            kind: pb::MachineEventKind::SpotInterruption as i32,
            not_before: Some(driver_sdk::prost_types::Timestamp { seconds: 1_800_000_000, nanos: 0 }),
            action: pb::CloudAction::Terminate as i32,
            offering: Some(pb::Offering {
                zone: "z1".into(),
                machine_type: "m5.large".into(),
                capacity_type: pb::CapacityType::Spot as i32,
            }),
            ..Default::default()
        };
        let i = interruption(&e, InterruptionKind::SpotInterruption, at("2026-12-01T10:00:00Z"));
        assert_eq!(i.not_before, Time::from_timestamp(1_800_000_000, 0));
        assert_eq!(i.action, "Terminate");
        let o = i.offering.unwrap();
        assert_eq!((o.zone.as_str(), o.machine_type.as_str(), o.capacity_type.as_str()), ("z1", "m5.large", "spot"));
    }
}
