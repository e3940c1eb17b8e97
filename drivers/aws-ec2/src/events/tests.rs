use std::time::{Duration, SystemTime};

use aws_sdk_ec2::primitives::DateTime;
use aws_sdk_ec2::types::{
    EventCode, InstanceStatus, InstanceStatusDetails, InstanceStatusEvent, InstanceStatusSummary, StatusName,
    StatusType, SummaryStatus,
};
use driver_sdk::{CloudAction, EventKind};
use serde_json::json;

use super::*;

const ID: &str = "i-1234567890abcdef0";

fn at(secs: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
}

/// 2024-05-01T10:00:00Z.
const T: u64 = 1_714_557_600;

/// An event as EventBridge delivers it to an SQS target (AWS's documented examples).
fn eventbridge(detail_type: &str, source: &str, detail: serde_json::Value) -> String {
    json!({
        "version": "0",
        "id": "12345678-1234-1234-1234-123456789012",
        "detail-type": detail_type,
        "source": source,
        "account": "123456789012",
        "time": "2024-05-01T10:00:00Z",
        "region": "us-east-2",
        "resources": [format!("arn:aws:ec2:us-east-2a:instance/{ID}")],
        "detail": detail
    })
    .to_string()
}

#[test]
fn a_spot_interruption_warning_has_a_deadline_two_minutes_after_its_time() {
    let body = eventbridge(
        "EC2 Spot Instance Interruption Warning",
        "aws.ec2",
        json!({"instance-id": ID, "instance-action": "terminate"}),
    );
    let n = parse_message(&body).unwrap();
    assert_eq!(n.len(), 1);
    assert_eq!(n[0].event_id, "12345678-1234-1234-1234-123456789012");
    assert_eq!(n[0].instance_id, ID);
    assert_eq!(n[0].kind, Some(EventKind::SpotInterruption));
    assert_eq!(n[0].action, CloudAction::Terminate);
    assert_eq!(n[0].observed_at, at(T));
    assert_eq!(n[0].not_before, Some(at(T + 120)));
    let stop = eventbridge(
        "EC2 Spot Instance Interruption Warning",
        "aws.ec2",
        json!({"instance-id": ID, "instance-action": "hibernate"}),
    );
    assert_eq!(parse_message(&stop).unwrap()[0].action, CloudAction::Hibernate);
}

#[test]
fn rebalance_and_state_changes_map_to_their_kinds() {
    let body = eventbridge("EC2 Instance Rebalance Recommendation", "aws.ec2", json!({"instance-id": ID}));
    let n = parse_message(&body).unwrap();
    assert_eq!((n[0].kind, n[0].not_before), (Some(EventKind::RebalanceRecommendation), None));
    for (state, kind, action) in [
        ("stopping", Some(EventKind::Stopping), CloudAction::Stop),
        ("stopped", Some(EventKind::Stopped), CloudAction::Stop),
        ("shutting-down", Some(EventKind::Terminated), CloudAction::Terminate),
        ("terminated", Some(EventKind::Terminated), CloudAction::Terminate),
        ("running", None, CloudAction::Unspecified),
        ("pending", None, CloudAction::Unspecified),
    ] {
        let body = eventbridge(
            "EC2 Instance State-change Notification",
            "aws.ec2",
            json!({"instance-id": ID, "state": state}),
        );
        let n = parse_message(&body).unwrap();
        assert_eq!((n[0].kind, n[0].action), (kind, action), "{state}");
    }
}

#[test]
fn a_health_scheduled_change_is_maintenance_per_instance_at_its_start_time() {
    let detail = |entities: serde_json::Value| {
        json!({
            "eventArn": "arn:aws:health:us-east-2::event/EC2/AWS_EC2_INSTANCE_STOP_SCHEDULED/AWS_EC2_INSTANCE_STOP_SCHEDULED_ELE_1",
            "service": "EC2",
            "eventTypeCode": "AWS_EC2_INSTANCE_STOP_SCHEDULED",
            "eventTypeCategory": "scheduledChange",
            "startTime": "Wed, 01 May 2024 12:00:00 GMT",
            "endTime": "Wed, 01 May 2024 13:00:00 GMT",
            "eventDescription": [{"language": "en_US", "latestDescription": "The instance is scheduled to stop"}],
            "affectedEntities": entities
        })
    };
    let one = eventbridge("AWS Health Event", "aws.health", detail(json!([{"entityValue": ID}])));
    let n = parse_message(&one).unwrap();
    assert_eq!(n.len(), 1);
    assert_eq!(n[0].event_id, "12345678-1234-1234-1234-123456789012", "one instance: the event's own ID");
    assert_eq!((n[0].kind, n[0].action), (Some(EventKind::ScheduledMaintenance), CloudAction::Stop));
    assert_eq!(n[0].not_before, Some(at(T + 7200)));
    let two = eventbridge(
        "AWS Health Event",
        "aws.health",
        detail(json!([{"entityValue": ID}, {"entityValue": "i-0fedcba9876543210"}])),
    );
    let n = parse_message(&two).unwrap();
    let ids: Vec<&str> = n.iter().map(|n| n.event_id.as_str()).collect();
    assert_eq!(
        ids,
        [
            format!("12345678-1234-1234-1234-123456789012/{ID}"),
            "12345678-1234-1234-1234-123456789012/i-0fedcba9876543210".to_string()
        ]
    );
    // An RFC 3339 start time works too.
    let mut d = detail(json!([{"entityValue": ID}]));
    d["startTime"] = json!("2024-05-01T12:00:00Z");
    assert_eq!(
        parse_message(&eventbridge("AWS Health Event", "aws.health", d)).unwrap()[0].not_before,
        Some(at(T + 7200))
    );
}

#[test]
fn messages_that_are_no_event_say_why_without_the_body() {
    let mut issue = serde_json::from_str::<serde_json::Value>(&eventbridge(
        "AWS Health Event",
        "aws.health",
        json!({"service": "EC2", "eventTypeCategory": "issue", "affectedEntities": [{"entityValue": ID}]}),
    ))
    .unwrap();
    let no_instance = eventbridge(
        "AWS Health Event",
        "aws.health",
        json!({"service": "EC2", "eventTypeCategory": "scheduledChange", "affectedEntities": [{"entityValue": "vol-1"}]}),
    );
    issue["detail"]["secret"] = json!("hunter2");
    for body in [
        "not json {".to_string(),
        "{}".to_string(),
        eventbridge("EC2 AMI State Change", "aws.ec2", json!({"secret": "hunter2"})),
        eventbridge("EC2 Spot Instance Interruption Warning", "aws.ec2", json!({})),
        eventbridge("EC2 Instance State-change Notification", "aws.ec2", json!({"instance-id": ID})),
        issue.to_string(),
        no_instance,
        json!({"id": "x", "detail-type": "EC2 Instance Rebalance Recommendation", "time": "yesterday",
               "detail": {"instance-id": ID}})
        .to_string(),
    ] {
        let why = parse_message(&body).unwrap_err().to_string();
        assert!(!why.contains("hunter2"), "{why}");
        assert!(!why.is_empty());
    }
}

fn summary(status: SummaryStatus, since: Option<u64>) -> InstanceStatusSummary {
    let mut d = InstanceStatusDetails::builder().name(StatusName::Reachability).status(StatusType::Failed);
    if let Some(s) = since {
        d = d.impaired_since(DateTime::from_secs(s as i64));
    }
    InstanceStatusSummary::builder().status(status).details(d.build()).build()
}

#[test]
fn impaired_checks_and_scheduled_events_become_events_with_stable_ids() {
    let ok = summary(SummaryStatus::Ok, None);
    let s = InstanceStatus::builder()
        .instance_id(ID)
        .instance_status(summary(SummaryStatus::Impaired, Some(T)))
        .system_status(ok.clone())
        .events(
            InstanceStatusEvent::builder()
                .instance_event_id("instance-event-0d59937288b749b32")
                .code(EventCode::SystemReboot)
                .description("scheduled reboot")
                .not_before(DateTime::from_secs(T as i64 + 3600))
                .build(),
        )
        .events(
            InstanceStatusEvent::builder()
                .code(EventCode::InstanceRetirement)
                .description("retiring")
                .not_before(DateTime::from_secs(T as i64 + 7200))
                .build(),
        )
        .events(
            InstanceStatusEvent::builder()
                .instance_event_id("instance-event-1")
                .code(EventCode::InstanceStop)
                .description("[Completed] stopped")
                .build(),
        )
        .build();
    let n = status_notices(&s, true, at(T + 10));
    let got: Vec<(&str, Option<EventKind>, CloudAction, Option<SystemTime>)> =
        n.iter().map(|n| (n.event_id.as_str(), n.kind, n.action, n.not_before)).collect();
    let impaired = format!("{ID}/instance-impaired/{T}");
    let reboot = format!("{ID}/instance-event-0d59937288b749b32");
    let retire = format!("{ID}/instance-retirement/{}", T + 7200);
    assert_eq!(
        got,
        [
            (impaired.as_str(), Some(EventKind::Impaired), CloudAction::Unspecified, None),
            (reboot.as_str(), Some(EventKind::ScheduledMaintenance), CloudAction::Reboot, Some(at(T + 3600))),
            (retire.as_str(), Some(EventKind::ScheduledMaintenance), CloudAction::Stop, Some(at(T + 7200))),
        ]
    );
    assert!(n[0].message.contains("reachability"), "{}", n[0].message);
    // The same status a minute later: the same IDs (the SDK delivers each once).
    let again: Vec<String> = status_notices(&s, true, at(T + 70)).into_iter().map(|n| n.event_id).collect();
    assert_eq!(again, [impaired, reboot, retire]);
    // Instance store: a retirement terminates.
    assert_eq!(status_notices(&s, false, at(T))[2].action, CloudAction::Terminate);
    // Healthy, nothing scheduled: nothing.
    let healthy = InstanceStatus::builder().instance_id(ID).instance_status(ok.clone()).system_status(ok).build();
    assert!(status_notices(&healthy, true, at(T)).is_empty());
}

#[test]
fn a_message_is_deleted_once_every_event_in_it_is_acked_with_its_newest_receipt() {
    let mut b = Book::default();
    let e = |s: &str| s.to_string();
    // Two messages (a duplicate delivery) carry event A; a third carries A and B.
    assert!(!b.hold("m1", "r1", &[e("A")]));
    assert!(!b.hold("m2", "r2", &[e("A")]));
    assert!(!b.hold("m3", "r3", &[e("A"), e("B")]));
    // m1 is received again: the newest receipt handle is the one that deletes.
    assert!(!b.hold("m1", "r1b", &[e("A")]));
    let mut due = b.ack("A");
    due.sort();
    assert_eq!(due, [(e("m1"), e("r1b")), (e("m2"), e("r2"))]);
    b.deleted("m1");
    // A failed delete is tried again on the next acknowledgement.
    b.retry("A", "m2");
    assert_eq!(b.ack("A"), [(e("m2"), e("r2"))]);
    b.deleted("m2");
    assert_eq!(b.ack("B"), [(e("m3"), e("r3"))]);
    // A duplicate received after the ack: nothing to wait for, deleted at once.
    assert!(b.hold("m4", "r4", &[e("A")]));
    // Nothing at all to wait for: deleted at once.
    assert!(b.hold("m5", "r5", &[]));
}

#[test]
fn owners_and_foreign_instances_are_remembered() {
    let mut b = Book::default();
    let now = std::time::Instant::now();
    assert_eq!(b.owner(ID, now), None);
    b.remember_foreign(ID.into(), now);
    assert_eq!(b.owner(ID, now), Some(None));
    assert_eq!(b.owner(ID, now + FOREIGN_TTL), None, "looked up again after a while");
    let owned = Owned {
        machine: "web-0".into(),
        provider_id: format!("aws:///us-east-2a/{ID}"),
        offering: driver_sdk::Offering::default(),
        ebs_root: true,
    };
    b.remember_owner(ID.into(), owned.clone());
    assert_eq!(b.owner(ID, now), Some(Some(owned)));
}

#[test]
fn queue_urls_name_their_region() {
    assert_eq!(queue_region("https://sqs.eu-west-1.amazonaws.com/123456789012/interruptions"), Some("eu-west-1"));
    assert_eq!(queue_region("https://sqs.cn-north-1.amazonaws.com.cn/123456789012/q"), Some("cn-north-1"));
    assert_eq!(queue_region("http://127.0.0.1:5000/123456789012/q"), None);
}

#[test]
fn instances_report_their_capacity_type() {
    use aws_sdk_ec2::types::{Instance, InstanceLifecycleType, InstanceType, Placement, Tag};
    let base = || {
        Instance::builder()
            .instance_id(ID)
            .instance_type(InstanceType::from("m5.large"))
            .placement(Placement::builder().availability_zone("us-east-2a").build())
            .tags(Tag::builder().key(TAG_NAME).value("web-0").build())
    };
    let spot = Owned::of(&base().instance_lifecycle(InstanceLifecycleType::Spot).build()).unwrap();
    assert_eq!(
        spot.offering,
        driver_sdk::Offering {
            zone: "us-east-2a".into(),
            machine_type: "m5.large".into(),
            capacity_type: driver_sdk::CapacityType::Spot
        }
    );
    assert_eq!(spot.machine, "web-0");
    assert_eq!(Owned::of(&base().build()).unwrap().offering.capacity_type, driver_sdk::CapacityType::OnDemand);
    assert_eq!(
        Owned::of(&base().capacity_reservation_id("cr-1").build()).unwrap().offering.capacity_type,
        driver_sdk::CapacityType::Reserved
    );
    assert!(Owned::of(&Instance::builder().instance_id(ID).build()).is_none(), "no name tag: not ours");
}
