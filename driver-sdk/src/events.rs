//! The event hub behind `WatchEvents` and `AckEvents`: at-least-once delivery of the events a
//! driver yields ([`Driver::watch_events`]), so a driver only says what the cloud did.
//!
//! - One pump per server pulls the driver's stream, started by the first watcher. It stops
//!   pulling while [`EVENT_BUFFER`] events wait for their acknowledgement (backpressure), drops an
//!   event whose ID it holds or saw acknowledged lately, and asks the driver again (after a
//!   pause) when the stream ends.
//! - Every watcher gets every pending event, and gets it again when it was not acknowledged
//!   within the stream's ack deadline. A resume token (`<epoch>.<sequence>`) tells a new stream
//!   which events its caller received already: those wait for the deadline before they are sent
//!   again. A token of another epoch (the sidecar restarted) is ignored.
//! - An acknowledgement calls [`Driver::ack_event`] first (the source lets the event go), then
//!   forgets the event; an ID not pending is reported as unknown, never refused.
//! - When the server drains, every stream ends with UNAVAILABLE, so the drain does not wait for
//!   callers that never hang up.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use futures::StreamExt;
use machine_driver_proto::v1 as pb;
use tokio::sync::{mpsc, watch, Notify};

use crate::context::RequestContext;
use crate::convert;
use crate::driver::Driver;
use crate::error::{reason, DriverError, Result};
use crate::lock;
use crate::types::{EventKind, MachineEvent};

/// How many events may wait for their acknowledgement before the hub stops pulling the driver's
/// stream: far more than a fleet's interruptions at once, little memory.
pub const EVENT_BUFFER: usize = 10_000;
/// How many acknowledged IDs the hub remembers, so a source that yields an event again (a queue
/// message seen before its deletion landed, a poll that sees the same state) is not redelivered.
const REMEMBERED_ACKS: usize = 10_000;
/// Keepalive interval when the caller does not ask for one.
pub(crate) const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(15);
/// Ack deadline when the caller does not ask for one.
pub(crate) const DEFAULT_ACK_DEADLINE: Duration = Duration::from_secs(30);
/// The bounds of both (a keepalive below a second would only be traffic; an ack deadline above an
/// hour would hide a lost event).
const MIN_INTERVAL: Duration = Duration::from_secs(1);
const MAX_KEEPALIVE: Duration = Duration::from_secs(300);
const MAX_ACK_DEADLINE: Duration = Duration::from_secs(3600);
/// The pause before asking the driver for its stream again, doubling up to the maximum.
const RESTART_PAUSE: Duration = Duration::from_secs(1);
const MAX_RESTART_PAUSE: Duration = Duration::from_secs(30);
/// Messages a stream buffers before its sender waits for the caller to read (backpressure per
/// stream).
const STREAM_BUFFER: usize = 16;

/// What the driver yields: events, or errors the SDK logs before it reads on.
pub type EventStream = futures::stream::BoxStream<'static, Result<MachineEvent>>;

struct Pending {
    event: MachineEvent,
}

#[derive(Default)]
struct State {
    next_seq: u64,
    pending: BTreeMap<u64, Pending>,
    by_id: HashMap<String, u64>,
    acked: HashSet<String>,
    acked_order: VecDeque<String>,
    pump_started: bool,
}

/// What one stream sent of one event: when (its ack deadline runs from then) and how often.
struct Sent {
    at: Instant,
    attempts: u32,
}

/// Clears `pump_started` when the pump ends, however it ends.
struct PumpGuard(Arc<EventHub>);

impl Drop for PumpGuard {
    fn drop(&mut self) {
        lock(&self.0.state).pump_started = false;
    }
}

/// Sends one message unless the drain begins first; false when it was not sent.
async fn send(
    tx: &mpsc::Sender<std::result::Result<pb::WatchEventsResponse, tonic::Status>>,
    item: pb::WatchEventsResponse,
    closed: &mut watch::Receiver<bool>,
) -> bool {
    tokio::select! {
        sent = tx.send(Ok(item)) => sent.is_ok(),
        _ = closed.wait_for(|c| *c) => false,
    }
}

/// The hub of one server.
pub(crate) struct EventHub {
    /// Random per process: resume tokens of an earlier process do not apply.
    epoch: String,
    state: Mutex<State>,
    /// The newest sequence number: watchers wake when it moves.
    newest: watch::Sender<u64>,
    /// Room in the buffer again: the pump reads on.
    room: Notify,
    /// true once the server drains.
    closed: watch::Sender<bool>,
}

/// The settings of one stream, from its request.
pub(crate) struct StreamSettings {
    pub(crate) resume_after: Option<u64>,
    pub(crate) keepalive: Duration,
    pub(crate) ack_deadline: Duration,
}

impl EventHub {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            epoch: uuid::Uuid::new_v4().simple().to_string()[..12].to_string(),
            state: Mutex::new(State { next_seq: 1, ..Default::default() }),
            newest: watch::channel(0).0,
            room: Notify::new(),
            closed: watch::channel(false).0,
        })
    }

    /// Ends every stream (the server drains).
    pub(crate) fn close(&self) {
        self.closed.send_replace(true);
    }

    fn token(&self, seq: u64) -> String {
        format!("{}.{seq}", self.epoch)
    }

    /// A stream's settings from its request.
    ///
    /// # Errors
    /// INVALID_ARGUMENT / FIELD_INVALID for a malformed resume token or a negative duration.
    pub(crate) fn settings(&self, r: &pb::WatchEventsRequest) -> Result<StreamSettings> {
        let resume_after = if r.resume_token.is_empty() {
            None
        } else {
            let parsed =
                r.resume_token.split_once('.').and_then(|(epoch, seq)| Some((epoch, seq.parse::<u64>().ok()?)));
            match parsed {
                Some((epoch, seq)) if epoch == self.epoch => Some(seq),
                // A token of the process before a restart: everything pending is new to the caller.
                Some(_) => None,
                None => {
                    return Err(DriverError::invalid_argument(
                        reason::FIELD_INVALID,
                        "invalid request: resume_token: is not a token this driver sent (want the resume_token of an event or keepalive)",
                    )
                    .with_violation("resume_token", "is not a token this driver sent"))
                }
            }
        };
        let duration = |field: &str, d: Option<&prost_types::Duration>, default: Duration, max: Duration| match d {
            None => Ok(default),
            Some(d) if d.seconds < 0 || d.nanos < 0 => Err(DriverError::invalid_argument(
                reason::FIELD_INVALID,
                format!("invalid request: {field}: must not be negative"),
            )
            .with_violation(field, "must not be negative")),
            Some(d) => Ok(convert::from_duration(d).clamp(MIN_INTERVAL, max)),
        };
        Ok(StreamSettings {
            resume_after,
            keepalive: duration("keepalive_interval", r.keepalive_interval.as_ref(), DEFAULT_KEEPALIVE, MAX_KEEPALIVE)?,
            ack_deadline: duration("ack_deadline", r.ack_deadline.as_ref(), DEFAULT_ACK_DEADLINE, MAX_ACK_DEADLINE)?,
        })
    }

    /// Starts the pump once: the driver's stream is read from the first watcher on.
    pub(crate) fn ensure_pump<D: Driver>(self: &Arc<Self>, driver: Arc<D>) {
        {
            let mut st = lock(&self.state);
            if st.pump_started {
                return;
            }
            st.pump_started = true;
        }
        let hub = self.clone();
        tokio::spawn(async move {
            // Whatever ends the pump (a panic in the driver's stream included), the next watcher
            // starts another.
            let _restart = PumpGuard(hub.clone());
            hub.pump(driver).await
        });
    }

    async fn pump<D: Driver>(self: Arc<Self>, driver: Arc<D>) {
        let mut closed = self.closed.subscribe();
        let mut pause = RESTART_PAUSE;
        loop {
            let ctx = RequestContext::new(format!("events-{}", uuid::Uuid::new_v4()));
            match driver.watch_events(&ctx).await {
                Ok(mut events) => loop {
                    self.wait_for_room().await;
                    let next = tokio::select! {
                        next = events.next() => next,
                        _ = closed.wait_for(|c| *c) => return,
                    };
                    match next {
                        Some(Ok(event)) => {
                            pause = RESTART_PAUSE;
                            self.offer(event);
                        }
                        Some(Err(e)) => {
                            tracing::warn!("the driver's event source failed: {e}; reading on in {pause:?}");
                            tokio::select! {
                                // Deliberate backoff: a source failing on every read must not spin.
                                () = tokio::time::sleep(pause) => {}
                                _ = closed.wait_for(|c| *c) => return,
                            }
                            pause = (pause * 2).min(MAX_RESTART_PAUSE);
                        }
                        None => {
                            tracing::info!("the driver's event stream ended; asking for it again");
                            break;
                        }
                    }
                },
                Err(e) => tracing::warn!("the driver's event stream could not start: {e}"),
            }
            tokio::select! {
                // Deliberate backoff before asking the driver again.
                () = tokio::time::sleep(pause) => {}
                _ = closed.wait_for(|c| *c) => return,
            }
            pause = (pause * 2).min(MAX_RESTART_PAUSE);
        }
    }

    async fn wait_for_room(&self) {
        loop {
            let notified = self.room.notified();
            if lock(&self.state).pending.len() < EVENT_BUFFER {
                return;
            }
            notified.await;
        }
    }

    /// Takes one event from the driver: kept until acknowledged, unless it is malformed or a
    /// duplicate. Returns whether it was kept.
    pub(crate) fn offer(&self, event: MachineEvent) -> bool {
        if event.event_id.is_empty() || event.machine_name.is_empty() || event.kind == EventKind::Unspecified {
            tracing::warn!(
                event.id = %event.event_id,
                machine = %event.machine_name,
                "the driver yielded an event without an ID, a machine or a kind; dropped"
            );
            return false;
        }
        let seq = {
            let mut st = lock(&self.state);
            if st.by_id.contains_key(&event.event_id) || st.acked.contains(&event.event_id) {
                return false;
            }
            let seq = st.next_seq;
            st.next_seq += 1;
            st.by_id.insert(event.event_id.clone(), seq);
            st.pending.insert(seq, Pending { event });
            seq
        };
        self.newest.send_replace(seq);
        true
    }

    /// The events a stream sends now: those it has not sent, and those it sent more than
    /// `ack_deadline` ago that are still pending, each with its sequence number and this
    /// stream's delivery count. Forgets in `sent` what is no longer pending, and returns when
    /// the next one falls due.
    fn due(
        &self,
        sent: &mut HashMap<u64, Sent>,
        now: Instant,
        ack_deadline: Duration,
    ) -> (Vec<(u64, MachineEvent, u32)>, Option<Instant>) {
        let st = lock(&self.state);
        sent.retain(|seq, _| st.pending.contains_key(seq));
        let mut out = Vec::new();
        let mut next_due: Option<Instant> = None;
        for (seq, p) in &st.pending {
            let at = match sent.get_mut(seq) {
                Some(s) if s.at + ack_deadline > now => s.at,
                Some(s) => {
                    s.attempts += 1;
                    out.push((*seq, p.event.clone(), s.attempts));
                    now
                }
                None => {
                    sent.insert(*seq, Sent { at: now, attempts: 1 });
                    out.push((*seq, p.event.clone(), 1));
                    now
                }
            };
            let due = at + ack_deadline;
            next_due = Some(next_due.map_or(due, |d| d.min(due)));
        }
        (out, next_due)
    }

    /// One stream: pending events, new ones, redeliveries and keepalives until the caller hangs
    /// up or the server drains.
    pub(crate) fn stream(
        self: &Arc<Self>,
        settings: StreamSettings,
    ) -> mpsc::Receiver<std::result::Result<pb::WatchEventsResponse, tonic::Status>> {
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let hub = self.clone();
        tokio::spawn(async move {
            let start = Instant::now();
            let mut sent: HashMap<u64, Sent> = HashMap::new();
            // The highest sequence number this stream's caller has: what its resume token says.
            let mut high = 0;
            if let Some(after) = settings.resume_after {
                // Received on the caller's earlier stream: due again one ack deadline from now.
                let st = lock(&hub.state);
                sent.extend(st.pending.range(..=after).map(|(seq, _)| (*seq, Sent { at: start, attempts: 1 })));
                high = after;
            }
            let mut newest = hub.newest.subscribe();
            let mut closed = hub.closed.subscribe();
            let mut last_sent = start;
            loop {
                if *closed.borrow() {
                    let unavailable =
                        tonic::Status::unavailable("the driver is shutting down; reconnect with the last resume_token");
                    // A caller that stopped reading does not hold the drain up.
                    let _ = tx.try_send(Err(unavailable));
                    return;
                }
                newest.borrow_and_update();
                let (events, next_due) = hub.due(&mut sent, Instant::now(), settings.ack_deadline);
                for (seq, event, attempts) in events {
                    high = high.max(seq);
                    let event = convert::machine_event(&event, hub.token(high), attempts);
                    let item = pb::WatchEventsResponse { item: Some(pb::watch_events_response::Item::Event(event)) };
                    if !send(&tx, item, &mut closed).await {
                        break; // the caller hung up, or the drain began: the loop's top decides
                    }
                    // The ack deadline runs from when the caller could have the event.
                    last_sent = Instant::now();
                    if let Some(s) = sent.get_mut(&seq) {
                        s.at = last_sent;
                    }
                }
                if tx.is_closed() {
                    return;
                }
                let keepalive_at = last_sent + settings.keepalive;
                let wake = next_due.map_or(keepalive_at, |d| d.min(keepalive_at));
                tokio::select! {
                    _ = newest.changed() => {}
                    _ = closed.changed() => {}
                    () = tx.closed() => return,
                    () = tokio::time::sleep_until(wake.into()) => {
                        if Instant::now() >= keepalive_at {
                            let item = pb::WatchEventsResponse {
                                item: Some(pb::watch_events_response::Item::Keepalive(pb::Keepalive {
                                    time: Some(convert::timestamp(SystemTime::now())),
                                    resume_token: hub.token(high),
                                })),
                            };
                            if send(&tx, item, &mut closed).await {
                                last_sent = Instant::now();
                            }
                        }
                    }
                }
            }
        });
        rx
    }

    /// The pending event with this ID.
    pub(crate) fn pending(&self, event_id: &str) -> Option<MachineEvent> {
        let st = lock(&self.state);
        st.by_id.get(event_id).and_then(|seq| st.pending.get(seq)).map(|p| p.event.clone())
    }

    /// Forgets a pending event (its acknowledgement reached the source) and remembers its ID.
    pub(crate) fn forget(&self, event_id: &str) {
        {
            let mut st = lock(&self.state);
            if let Some(seq) = st.by_id.remove(event_id) {
                st.pending.remove(&seq);
            }
            if st.acked.insert(event_id.to_string()) {
                st.acked_order.push_back(event_id.to_string());
                while st.acked_order.len() > REMEMBERED_ACKS {
                    if let Some(old) = st.acked_order.pop_front() {
                        st.acked.remove(&old);
                    }
                }
            }
        }
        self.room.notify_waiters();
    }

    /// How many events wait for their acknowledgement.
    #[cfg(test)]
    pub(crate) fn pending_len(&self) -> usize {
        lock(&self.state).pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{CloudAction, Offering};

    fn event(id: &str) -> MachineEvent {
        MachineEvent {
            event_id: id.into(),
            machine_name: "m-1".into(),
            provider_id: "fake:///z1/m-1".into(),
            pool_name: String::new(),
            kind: EventKind::SpotInterruption,
            not_before: None,
            observed_at: SystemTime::now(),
            action: CloudAction::Terminate,
            offering: Offering::default(),
            message: String::new(),
        }
    }

    fn ids(events: &[(u64, MachineEvent, u32)]) -> Vec<(&str, u32)> {
        events.iter().map(|(_, e, attempts)| (e.event_id.as_str(), *attempts)).collect()
    }

    #[test]
    fn an_event_is_sent_once_then_again_after_the_ack_deadline_until_it_is_acked() {
        let hub = EventHub::new();
        assert!(hub.offer(event("e1")));
        let deadline = Duration::from_secs(30);
        let mut sent = HashMap::new();
        let t0 = Instant::now();
        let (first, next) = hub.due(&mut sent, t0, deadline);
        assert_eq!(ids(&first), [("e1", 1)]);
        assert_eq!(next, Some(t0 + deadline));
        assert!(hub.due(&mut sent, t0 + Duration::from_secs(29), deadline).0.is_empty());
        let (again, _) = hub.due(&mut sent, t0 + deadline, deadline);
        assert_eq!(ids(&again), [("e1", 2)]);
        hub.forget("e1");
        assert!(hub.due(&mut sent, t0 + deadline * 3, deadline).0.is_empty());
        assert_eq!(hub.pending_len(), 0);
    }

    #[test]
    fn a_duplicate_or_an_acknowledged_id_is_not_taken_again_nor_a_malformed_event() {
        let hub = EventHub::new();
        assert!(hub.offer(event("e1")));
        assert!(!hub.offer(event("e1")), "pending already");
        hub.forget("e1");
        assert!(!hub.offer(event("e1")), "acknowledged lately");
        assert!(!hub.offer(event("")), "no ID");
        let mut unknown = event("e2");
        unknown.kind = EventKind::Unspecified;
        assert!(!hub.offer(unknown), "no kind");
        assert_eq!(hub.pending_len(), 0);
    }

    #[test]
    fn a_resume_token_of_this_process_is_read_one_of_another_is_ignored_garbage_is_refused() {
        let hub = EventHub::new();
        let req = |t: &str| pb::WatchEventsRequest { resume_token: t.into(), ..Default::default() };
        assert_eq!(hub.settings(&req(&hub.token(7))).unwrap().resume_after, Some(7));
        assert_eq!(hub.settings(&req("0123456789ab.7")).unwrap().resume_after, None);
        let err = hub.settings(&req("not-a-token")).err().unwrap();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert_eq!(err.reason(), reason::FIELD_INVALID);
        let s = hub.settings(&req("")).unwrap();
        assert_eq!((s.keepalive, s.ack_deadline), (DEFAULT_KEEPALIVE, DEFAULT_ACK_DEADLINE));
        let short = pb::WatchEventsRequest {
            keepalive_interval: Some(prost_types::Duration { seconds: 0, nanos: 1 }),
            ack_deadline: Some(prost_types::Duration { seconds: -1, nanos: 0 }),
            ..Default::default()
        };
        assert_eq!(hub.settings(&short).err().unwrap().code(), tonic::Code::InvalidArgument);
    }

    async fn bounded<T>(rx: &mut mpsc::Receiver<T>) -> Option<T> {
        tokio::time::timeout(Duration::from_secs(10), rx.recv()).await.expect("a message in time")
    }

    #[tokio::test]
    async fn a_stream_sends_pending_events_then_new_ones_and_ends_with_unavailable_when_the_server_drains() {
        let hub = EventHub::new();
        hub.offer(event("e0"));
        hub.offer(event("e1"));
        let settings = StreamSettings {
            resume_after: None,
            keepalive: Duration::from_secs(60),
            ack_deadline: Duration::from_secs(60),
        };
        let mut rx = hub.stream(settings);
        // Each event's resume token says "up to this one", not "up to the newest".
        for (id, seq) in [("e0", 1), ("e1", 2)] {
            let m = bounded(&mut rx).await.unwrap().unwrap();
            let Some(pb::watch_events_response::Item::Event(e)) = m.item else { panic!("{m:?}") };
            assert_eq!(e.event_id, id);
            assert_eq!(e.resume_token, hub.token(seq));
            assert_eq!(e.delivery_attempt, 1);
        }
        hub.offer(event("e2"));
        let second = bounded(&mut rx).await.unwrap().unwrap();
        let Some(pb::watch_events_response::Item::Event(e)) = second.item else { panic!("{second:?}") };
        assert_eq!(e.event_id, "e2");
        hub.close();
        let end = bounded(&mut rx).await.unwrap();
        assert_eq!(end.err().unwrap().code(), tonic::Code::Unavailable);
    }
}
