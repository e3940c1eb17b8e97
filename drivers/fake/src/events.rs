//! The fake cloud's own events (the `Events` capability): what `InjectEvent` makes happen,
//! kept in the cloud (and its state file) until the controller acknowledges it, so a restarted
//! sidecar streams it again, as a cloud's queue keeps a message until it is deleted.

use std::time::{Duration, UNIX_EPOCH};

use driver_sdk::{CapacityType, CloudAction, EventKind, MachineEvent, Offering};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::cloud::FMachine;

/// An event not acknowledged yet, as the state file keeps it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct FEvent {
    pub(crate) id: String,
    pub(crate) machine: String,
    pub(crate) provider_id: String,
    /// The wire name without its prefix: `SPOT_INTERRUPTION`.
    pub(crate) kind: String,
    pub(crate) not_before_ms: Option<u64>,
    pub(crate) observed_ms: u64,
    pub(crate) zone: String,
    pub(crate) machine_type: String,
    pub(crate) spot: bool,
    pub(crate) message: String,
}

/// Every kind by its wire name without the `MACHINE_EVENT_KIND_` prefix.
const KINDS: [(&str, EventKind); 8] = [
    ("SPOT_INTERRUPTION", EventKind::SpotInterruption),
    ("REBALANCE_RECOMMENDATION", EventKind::RebalanceRecommendation),
    ("SCHEDULED_MAINTENANCE", EventKind::ScheduledMaintenance),
    ("STOPPING", EventKind::Stopping),
    ("STOPPED", EventKind::Stopped),
    ("TERMINATED", EventKind::Terminated),
    ("IMPAIRED", EventKind::Impaired),
    ("CAPACITY_RESERVATION_INTERRUPTION", EventKind::CapacityReservationInterruption),
];

/// The kind a name says, with or without the `MACHINE_EVENT_KIND_` prefix.
pub(crate) fn parse_kind(name: &str) -> Result<&'static str, String> {
    let bare = name.strip_prefix("MACHINE_EVENT_KIND_").unwrap_or(name);
    KINDS.iter().map(|(n, _)| *n).find(|n| *n == bare).ok_or_else(|| {
        let known: Vec<&str> = KINDS.iter().map(|(n, _)| *n).collect();
        format!("kind: {name:?} is not an event kind (one of {})", known.join(", "))
    })
}

/// What the cloud does when the event's time comes, by kind.
fn action(kind: EventKind) -> CloudAction {
    match kind {
        EventKind::SpotInterruption | EventKind::CapacityReservationInterruption | EventKind::Terminated => {
            CloudAction::Terminate
        }
        EventKind::Stopping | EventKind::Stopped => CloudAction::Stop,
        EventKind::ScheduledMaintenance => CloudAction::Reboot,
        _ => CloudAction::Unspecified,
    }
}

/// Whether a spec asks for spot capacity.
pub(crate) fn is_spot(spec: &Value) -> bool {
    spec.get("capacityType").and_then(Value::as_str) == Some("spot")
}

impl FEvent {
    /// A new event of `kind` (already parsed) on `m`, due `notice` from now.
    pub(crate) fn new(
        m: &FMachine,
        provider_id: String,
        kind: &'static str,
        notice: Option<Duration>,
        message: String,
        now_ms: u64,
    ) -> Self {
        Self {
            id: format!("fake-{}", uuid::Uuid::new_v4().simple()),
            machine: m.name.clone(),
            provider_id,
            kind: kind.to_string(),
            not_before_ms: notice.map(|d| now_ms + d.as_millis() as u64),
            observed_ms: now_ms,
            zone: m.zone.clone(),
            machine_type: crate::machine_type(&m.spec),
            spot: is_spot(&m.spec),
            message,
        }
    }

    /// The event as the SDK streams it.
    pub(crate) fn to_event(&self) -> MachineEvent {
        let kind = KINDS.iter().find(|(n, _)| *n == self.kind).map_or(EventKind::Unspecified, |(_, k)| *k);
        let at = |ms: u64| UNIX_EPOCH + Duration::from_millis(ms);
        MachineEvent {
            event_id: self.id.clone(),
            machine_name: self.machine.clone(),
            provider_id: self.provider_id.clone(),
            pool_name: String::new(),
            kind,
            not_before: self.not_before_ms.map(at),
            observed_at: at(self.observed_ms),
            action: action(kind),
            offering: Offering {
                zone: self.zone.clone(),
                machine_type: self.machine_type.clone(),
                capacity_type: if self.spot { CapacityType::Spot } else { CapacityType::OnDemand },
            },
            message: self.message.clone(),
        }
    }
}
