//! The Node condition source of interruptions: Azure delivers Scheduled Events inside the VM
//! only, and node-problem-detector (AKS's build of it) turns them into Node conditions —
//! `PreemptionScheduled` (reason `SpotEvictionIncoming`) for a spot eviction, `VMEventScheduled`
//! for a reboot, redeploy, freeze or termination — with the event's `NotBefore` and `EventId`
//! in the message (`Preempt Scheduled: Mon, 19 Sep 2016 18:29:47 GMT. … EventId: <guid>`).
//! The controller reads them as it reads the stream's events, and keeps the deadline the message
//! gives (Karpenter's Azure provider throws it away: its PR #1829).

use chrono::{DateTime, Utc};
use k8s_openapi::api::core::v1::NodeCondition;

/// The condition of a spot eviction to come.
pub const PREEMPTION_SCHEDULED: &str = "PreemptionScheduled";
/// The condition of any other Scheduled Event to come.
pub const VM_EVENT_SCHEDULED: &str = "VMEventScheduled";

/// A True `PreemptionScheduled` or `VMEventScheduled` condition of a Node, as parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledEvent {
    /// The condition's type.
    pub condition: String,
    /// The Scheduled Event's type: `Preempt`, `Reboot`, `Redeploy`, `Freeze`, `Terminate`
    /// (`Preempt` for `PreemptionScheduled` whatever the message says).
    pub event_type: String,
    /// The deadline the message gives, if it gives one the parser reads.
    pub not_before: Option<DateTime<Utc>>,
    /// The Scheduled Event's ID from the message, else the condition's type and transition time:
    /// stable while the condition stands, so handling it is idempotent.
    pub event_id: String,
    /// The condition's message.
    pub message: String,
}

/// The first True scheduled-event condition among a Node's, `PreemptionScheduled` first.
pub fn of(node_name: &str, conditions: &[NodeCondition]) -> Option<ScheduledEvent> {
    [PREEMPTION_SCHEDULED, VM_EVENT_SCHEDULED].iter().find_map(|t| {
        let c = conditions.iter().find(|c| c.type_ == *t && c.status == "True")?;
        Some(parse(node_name, c))
    })
}

fn parse(node_name: &str, c: &NodeCondition) -> ScheduledEvent {
    let message = c.message.clone().unwrap_or_default();
    let event_type =
        if c.type_ == PREEMPTION_SCHEDULED { "Preempt".to_string() } else { event_type(&message).unwrap_or_default() };
    let since = c.last_transition_time.as_ref().map(|t| t.0.as_second()).unwrap_or_default();
    let event_id = match event_id(&message) {
        Some(id) => format!("node/{node_name}/{id}"),
        None => format!("node/{node_name}/{}/{since}", c.type_),
    };
    ScheduledEvent { condition: c.type_.clone(), event_type, not_before: deadline(&message), event_id, message }
}

/// The word before ` Scheduled` (`Reboot Scheduled: …`), or the first of the known types named.
fn event_type(message: &str) -> Option<String> {
    const KNOWN: [&str; 5] = ["Preempt", "Terminate", "Redeploy", "Reboot", "Freeze"];
    if let Some(at) = message.find(" Scheduled") {
        let word = message[..at].rsplit(|c: char| !c.is_ascii_alphanumeric()).next().unwrap_or("");
        if let Some(k) = KNOWN.iter().find(|k| k.eq_ignore_ascii_case(word)) {
            return Some((*k).to_string());
        }
    }
    KNOWN.iter().find(|k| message.contains(*k)).map(|k| (*k).to_string())
}

/// The first date in the message: RFC 1123 (`Mon, 19 Sep 2016 18:29:47 GMT`, as Scheduled
/// Events write `NotBefore`) or RFC 3339.
fn deadline(message: &str) -> Option<DateTime<Utc>> {
    const DAYS: [&str; 7] = ["Mon, ", "Tue, ", "Wed, ", "Thu, ", "Fri, ", "Sat, ", "Sun, "];
    // The date comes early in the message: a long one is read no further than this (each
    // position may scan on to the next delimiter).
    let end = message.char_indices().map(|(i, _)| i).find(|&i| i >= 2048).unwrap_or(message.len());
    let message = &message[..end];
    for (i, _) in message.char_indices() {
        let rest = &message[i..];
        if DAYS.iter().any(|d| rest.starts_with(d)) {
            // "Mon, 19 Sep 2016 18:29:47 GMT" is 29 characters; a one-digit day is 28.
            for len in [29, 28] {
                if let Some(t) = rest.get(..len).and_then(|s| DateTime::parse_from_rfc2822(s).ok()) {
                    return Some(t.with_timezone(&Utc));
                }
            }
        }
        if rest.len() >= 20 && rest.as_bytes()[0].is_ascii_digit() {
            let token = rest.split(|c: char| c.is_whitespace() || c == ',' || c == ';').next().unwrap_or("");
            let token = token.trim_end_matches('.');
            if let Ok(t) = DateTime::parse_from_rfc3339(token) {
                return Some(t.with_timezone(&Utc));
            }
        }
    }
    None
}

/// The ID after `EventId:` (a GUID).
fn event_id(message: &str) -> Option<&str> {
    let at = message.find("EventId:")? + "EventId:".len();
    let id = message[at..].trim_start();
    let end = id.find(|c: char| !(c.is_ascii_hexdigit() || c == '-')).unwrap_or(id.len());
    Some(&id[..end]).filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn condition(t: &str, status: &str, message: &str) -> NodeCondition {
        NodeCondition {
            type_: t.into(),
            status: status.into(),
            reason: Some("SpotEvictionIncoming".into()),
            message: Some(message.into()),
            last_transition_time: Some(Time(k8s_openapi::jiff::Timestamp::from_second(1_800_000_000).unwrap())),
            ..Default::default()
        }
    }

    #[test]
    fn a_preemption_keeps_its_deadline_and_event_id() {
        let c = condition(
            PREEMPTION_SCHEDULED,
            "True",
            "Preempt Scheduled: Mon, 19 Sep 2016 18:29:47 GMT. Resources: vm-1. EventId: 602d9444-d2cd-49c7-8624-8643e7171297",
        );
        let e = of("node-1", &[condition("Ready", "True", ""), c]).expect("read");
        assert_eq!(e.event_type, "Preempt");
        assert_eq!(
            e.not_before,
            DateTime::parse_from_rfc2822("Mon, 19 Sep 2016 18:29:47 GMT").ok().map(|t| t.to_utc())
        );
        assert_eq!(e.event_id, "node/node-1/602d9444-d2cd-49c7-8624-8643e7171297");
    }

    #[test]
    fn a_vm_event_names_its_type_and_without_an_id_uses_the_transition() {
        let c = condition(VM_EVENT_SCHEDULED, "True", "Reboot Scheduled: Tue, 1 Dec 2026 10:00:00 GMT");
        let e = of("n", &[c]).expect("read");
        assert_eq!(e.event_type, "Reboot");
        assert_eq!(e.not_before.map(|t| t.to_rfc3339()), Some("2026-12-01T10:00:00+00:00".into()));
        assert_eq!(e.event_id, "node/n/VMEventScheduled/1800000000");
        let c = condition(VM_EVENT_SCHEDULED, "True", "Redeploy at 2026-12-01T10:00:00Z.");
        assert_eq!(of("n", &[c]).and_then(|e| e.not_before).map(|t| t.timestamp()), Some(1_796_119_200));
    }

    #[test]
    fn a_false_condition_or_an_unreadable_message_is_no_deadline() {
        assert!(of("n", &[condition(PREEMPTION_SCHEDULED, "False", "")]).is_none());
        let e = of("n", &[condition(PREEMPTION_SCHEDULED, "True", "soon, Mon, 99 Foo")]).expect("read");
        assert_eq!(e.not_before, None);
    }
}
