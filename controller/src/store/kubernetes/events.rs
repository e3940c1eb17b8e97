//! Events on the API server, aggregated into event series the way client-go's events broadcaster
//! (`k8s.io/client-go/tools/events`) does ([`crate::store::series`]): the first event about an
//! object with a given reason is created; the first repeat within the series window turns it
//! into a series (one PATCH at once, so `kubectl describe` shows that it repeats); later repeats
//! only count in memory and reach the server at most once per [`SERIES_REFRESH`]. A burst of one
//! warning on one object costs two requests, not one per occurrence.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event as KubeEvent, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use tokio::sync::mpsc;

use super::super::series::{Book, Seen, Series, SERIES_WINDOW};
use super::super::Event;
use crate::resources::Time;

/// Who reports events.
const REPORTING_CONTROLLER: &str = "machine.driver.dev/machine-controller";

/// The longest Event note the API server accepts (events.k8s.io/v1: 1 kB).
const MAX_EVENT_NOTE: usize = 1024;

/// How often a series' count reaches the server while it grows (client-go waits 30 minutes;
/// a minute keeps `describe` close to the truth at one request per growing series).
pub(super) const SERIES_REFRESH: Duration = Duration::from_secs(60);

/// A write to the API server.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Write {
    Create(Box<KubeEvent>),
    /// A merge patch of `series` on the named Event.
    Series {
        namespace: String,
        name: String,
        series: EventSeries,
    },
}

/// Decides the writes; holds no client, so it is tested without a server.
#[derive(Debug)]
pub(super) struct Recorder {
    instance: String,
    /// The open series, by the Event's namespace and name on the server.
    series: Book<(String, String)>,
}

impl Recorder {
    pub(super) fn new(instance: String) -> Self {
        Self { instance, series: Book::default() }
    }

    /// The write one event needs now, if any. `uid` is the object's (empty when unknown).
    pub(super) fn record(&mut self, e: &Event, uid: &str, now: Instant) -> Option<Write> {
        match self.series.see(e, now) {
            Seen::Repeated(s) => return Some(series_write(s)),
            Seen::Counted => return None,
            Seen::First => {}
        }
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        let name = format!("{}.{}", e.key.name, &suffix[..16]);
        let event = KubeEvent {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(e.key.namespace.clone()),
                ..Default::default()
            },
            event_time: Some(MicroTime(timestamp(e.time))),
            action: Some(e.reason.clone()),
            reason: Some(e.reason.clone()),
            note: Some(truncate(&e.message, MAX_EVENT_NOTE).to_string()),
            type_: Some(e.event_type.clone()),
            reporting_controller: Some(REPORTING_CONTROLLER.into()),
            reporting_instance: Some(self.instance.clone()),
            regarding: Some(ObjectReference {
                api_version: Some(e.key.kind.api_version().into()),
                kind: Some(e.key.kind.as_str().into()),
                name: Some(e.key.name.clone()),
                namespace: Some(e.key.namespace.clone()),
                uid: (!uid.is_empty()).then(|| uid.to_string()),
                ..Default::default()
            }),
            ..Default::default()
        };
        self.series.opened(e, (e.key.namespace.clone(), name), now);
        Some(Write::Create(Box::new(event)))
    }

    /// The counts that grew since they were written; forgets series that ended.
    pub(super) fn refresh(&mut self, now: Instant) -> Vec<Write> {
        self.series.refresh(now, series_write)
    }
}

/// An event's time as the API server's types hold it.
fn timestamp(t: Time) -> Timestamp {
    Timestamp::new(t.timestamp(), t.timestamp_subsec_nanos() as i32).unwrap_or_else(|_| Timestamp::now())
}

/// The longest prefix of `s` within `max` bytes that ends on a character boundary.
fn truncate(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn series_write(s: &Series<(String, String)>) -> Write {
    let (namespace, name) = s.stored.clone();
    Write::Series {
        namespace,
        name,
        series: EventSeries { count: s.count, last_observed_time: MicroTime(timestamp(s.last_observed)) },
    }
}

/// Posts events off the reconcile path, one write at a time.
pub(super) async fn post(client: kube::Client, mut rx: mpsc::Receiver<(Event, String)>) {
    let instance = std::env::var("POD_NAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok().map(|h| h.trim().to_string()))
        .unwrap_or_else(|| "machine-controller".into());
    let mut recorder = Recorder::new(instance);
    let mut refresh = tokio::time::interval(SERIES_REFRESH);
    refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let writes = tokio::select! {
            got = rx.recv() => match got {
                Some((e, uid)) => recorder.record(&e, &uid, Instant::now()).into_iter().collect(),
                None => recorder.refresh(Instant::now() + SERIES_WINDOW * 2),
            },
            _ = refresh.tick() => recorder.refresh(Instant::now()),
        };
        let closed = rx.is_closed() && rx.is_empty();
        for w in writes {
            send(&client, w).await;
        }
        if closed {
            return;
        }
    }
}

async fn send(client: &kube::Client, write: Write) {
    match write {
        Write::Create(event) => {
            let namespace = event.metadata.namespace.clone().unwrap_or_default();
            let api: Api<KubeEvent> = Api::namespaced(client.clone(), &namespace);
            if let Err(err) = api.create(&PostParams::default(), &event).await {
                tracing::debug!("posting event {:?}: {err}", event.reason);
            }
        }
        Write::Series { namespace, name, series } => {
            let api: Api<KubeEvent> = Api::namespaced(client.clone(), &namespace);
            let patch = serde_json::json!({ "series": series });
            if let Err(err) = api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
                tracing::debug!("updating event series {name}: {err}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::series::event;

    fn count(w: &Write) -> i32 {
        match w {
            Write::Series { series, .. } => series.count,
            Write::Create(_) => 1,
        }
    }

    #[test]
    fn repeats_become_one_series_written_at_the_first_repeat_and_then_once_per_refresh() {
        let mut r = Recorder::new("test".into());
        let t0 = Instant::now();
        let e = event("m", "OperationFailed");
        let Some(Write::Create(created)) = r.record(&e, "uid-1", t0) else { panic!("first is created") };
        assert_eq!(created.regarding.as_ref().and_then(|o| o.uid.as_deref()), Some("uid-1"));
        assert_eq!(created.note.as_deref(), Some("m OperationFailed"));
        assert_eq!(created.event_time.as_ref().map(|t| t.0), Some(timestamp(e.time)));
        let name = created.metadata.name.clone().unwrap();
        // The first repeat is written at once, as a series of two on the same Event.
        let second = r.record(&e, "uid-1", t0 + Duration::from_secs(1)).expect("series starts");
        assert!(matches!(&second, Write::Series { name: n, namespace, .. } if *n == name && namespace == "ns"));
        assert_eq!(count(&second), 2);
        // Later repeats only count...
        for i in 0..98 {
            assert_eq!(r.record(&e, "uid-1", t0 + Duration::from_secs(2 + i)), None);
        }
        // ...until the refresh writes the count once.
        let writes = r.refresh(t0 + Duration::from_secs(100));
        assert_eq!(writes.iter().map(count).collect::<Vec<_>>(), vec![100]);
        assert!(r.refresh(t0 + Duration::from_secs(160)).is_empty(), "nothing new, nothing written");
    }

    #[test]
    fn notes_are_cut_to_the_servers_byte_limit_on_a_character_boundary() {
        let long = "é".repeat(MAX_EVENT_NOTE); // 2 bytes each
        assert_eq!(truncate(&long, MAX_EVENT_NOTE).len(), MAX_EVENT_NOTE);
        assert_eq!(truncate("aé", 2), "a");
        assert_eq!(truncate("short", MAX_EVENT_NOTE), "short");
    }

    #[test]
    fn other_objects_and_reasons_are_other_events_and_a_late_repeat_is_a_new_one() {
        let mut r = Recorder::new("test".into());
        let t0 = Instant::now();
        assert!(matches!(r.record(&event("a", "X"), "", t0), Some(Write::Create(_))));
        assert!(matches!(r.record(&event("b", "X"), "", t0), Some(Write::Create(_))));
        assert!(matches!(r.record(&event("a", "Y"), "", t0), Some(Write::Create(_))));
        let late = t0 + SERIES_WINDOW + Duration::from_secs(1);
        assert!(matches!(r.record(&event("a", "X"), "", late), Some(Write::Create(_))));
    }
}
