//! `aws-ec2-driver`'s event stream on moto's server: EventBridge `PutEvents` matched by a real
//! rule and delivered to a real SQS queue, read by the sidecar and streamed by `WatchEvents`;
//! and the whole way to the controller, which replaces the interrupted machine once.
//! moto raises no interruption of its own: the tests inject the events as EventBridge would
//! deliver AWS's.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use crate::aws_support::{start_driver, Moto};
use driver_sdk::convert::json_to_struct;
use driver_sdk::proto as pb;
use driver_sdk::OperationExt;
use e2e_tests::eventually;
use e2e_tests::world::World;
use machine_controller::resources::{
    InterruptionKind, Kind, Machine, MachineDeployment, Phase, ANNOTATION_REPLACES_INTERRUPTION,
};
use serde_json::{json, Value};

/// The AMI of the schema's examples; moto 5.2.5 ships it in every region.
const MOTO_AMI: &str = "ami-12c6146b";
/// The `time` of the injected events: 2024-05-01T10:00:00Z.
const EVENT_TIME: u64 = 1_714_557_600;
const MINUTE: Duration = Duration::from_secs(60);

/// Runs `body` in moto's Python with `ec2`, `sqs` and `events` clients of `region`.
async fn aws(moto: &Moto, region: &str, body: &str) -> Value {
    let clients = "kw = dict(region_name=sys.argv[2], endpoint_url=sys.argv[1], aws_access_key_id='testing', \
                   aws_secret_access_key='testing')\nsqs = boto3.client('sqs', **kw)\nevents = boto3.client('events', **kw)\n";
    moto.boto3(region, &format!("{clients}{body}")).await
}

/// A queue with a short visibility timeout (a message left alone comes back soon) and `rules`
/// EventBridge rules that each send the spot interruption warnings to it; its URL.
async fn queue_with_rules(moto: &Moto, region: &str, rules: usize) -> String {
    let v = aws(
        moto,
        region,
        &format!(
            "q = sqs.create_queue(QueueName='interruptions', Attributes={{'VisibilityTimeout': '2'}})['QueueUrl']\n\
             arn = sqs.get_queue_attributes(QueueUrl=q, AttributeNames=['QueueArn'])['Attributes']['QueueArn']\n\
             pattern = json.dumps({{'source': ['aws.ec2'], 'detail-type': ['EC2 Spot Instance Interruption Warning', \
             'EC2 Instance Rebalance Recommendation', 'EC2 Instance State-change Notification']}})\n\
             for n in range({rules}):\n  events.put_rule(Name=f'machine-driver-{{n}}', EventPattern=pattern)\n  \
             events.put_targets(Rule=f'machine-driver-{{n}}', Targets=[{{'Id': 'queue', 'Arn': arn}}])\n\
             print(json.dumps(q))"
        ),
    )
    .await;
    v.as_str().expect("the queue URL").to_string()
}

/// PutEvents of one spot interruption warning for `instance` at `time` (Unix seconds, as
/// EventBridge's `time` has them); the event's ID as EventBridge gave it (every rule's delivery
/// carries it as `id`).
async fn put_spot_warning(moto: &Moto, region: &str, instance: &str, time: u64) -> String {
    let v = aws(
        moto,
        region,
        &format!(
            "import datetime\nr = events.put_events(Entries=[{{'Source': 'aws.ec2', \
             'DetailType': 'EC2 Spot Instance Interruption Warning', \
             'Detail': json.dumps({{'instance-id': '{instance}', 'instance-action': 'terminate'}}), \
             'Resources': ['arn:aws:ec2:{region}a:instance/{instance}'], \
             'Time': datetime.datetime.fromtimestamp({time}, datetime.timezone.utc)}}])\n\
             print(json.dumps({{'failed': r['FailedEntryCount'], 'ids': [e.get('EventId') for e in r['Entries']]}}))"
        ),
    )
    .await;
    assert_eq!(v["failed"], 0, "PutEvents refused the event: {v}");
    v["ids"][0].as_str().expect("the event's ID").to_string()
}

/// The bodies of the queue's messages, visible or not (`ApproximateNumberOfMessages` +
/// `…NotVisible`), without receiving any.
async fn queue_depth(moto: &Moto, region: &str, url: &str) -> u64 {
    let v = aws(
        moto,
        region,
        &format!(
            "a = sqs.get_queue_attributes(QueueUrl='{url}', AttributeNames=['ApproximateNumberOfMessages', \
             'ApproximateNumberOfMessagesNotVisible'])['Attributes']\n\
             print(json.dumps(int(a['ApproximateNumberOfMessages']) + int(a['ApproximateNumberOfMessagesNotVisible'])))"
        ),
    )
    .await;
    v.as_u64().expect("a count")
}

fn watch(ack_deadline: Duration) -> pb::WatchEventsRequest {
    pb::WatchEventsRequest {
        resume_token: String::new(),
        keepalive_interval: Some(driver_sdk::convert::duration(Duration::from_secs(1))),
        ack_deadline: Some(driver_sdk::convert::duration(ack_deadline)),
    }
}

/// The next event on `stream`, or `None` when a keepalive comes first; within 60 s.
async fn next_item(stream: &mut tonic::Streaming<pb::WatchEventsResponse>) -> Option<pb::MachineEvent> {
    let item = tokio::time::timeout(MINUTE, stream.message())
        .await
        .expect("a message on the stream within 60 s")
        .expect("the stream failed")
        .expect("the stream ended");
    match item.item {
        Some(pb::watch_events_response::Item::Event(e)) => Some(e),
        _ => None,
    }
}

/// The next event on `stream`, keepalives passed over, within 60 s.
async fn next_event(stream: &mut tonic::Streaming<pb::WatchEventsResponse>) -> pb::MachineEvent {
    let read = async {
        loop {
            if let Some(e) = next_item(stream).await {
                return e;
            }
        }
    };
    tokio::time::timeout(MINUTE, read).await.expect("an event within 60 s")
}

fn create_req(name: &str, spec: Value) -> pb::CreateMachineRequest {
    pb::CreateMachineRequest {
        name: name.into(),
        provider_spec: Some(json_to_struct(&spec)),
        labels: HashMap::from([("cluster".to_string(), "c1".to_string())]),
        uid: "uid-1".into(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spot_interruption_through_eventbridge_and_sqs_is_streamed_once_and_its_messages_deleted_on_ack_on_moto() {
    let region = "us-east-2";
    let moto = Moto::shared().await;
    // Two rules match the warning: EventBridge delivers the one event (one `id`) twice.
    let url = queue_with_rules(&moto, region, 2).await;

    // A spot machine, launched by a sidecar that reads no queue.
    let spot = json!({"imageId": MOTO_AMI, "instanceType": "t3.micro",
        "instanceMarketOptions": {"marketType": "spot", "spotOptions": {"maxPrice": "0.05",
            "spotInstanceType": "one-time", "instanceInterruptionBehavior": "terminate"}}});
    let machine = {
        let driver = start_driver(&moto.url(), region, &["--instance-status-interval", "0s"]).await;
        let c = driver.client().await;
        let caps = c.get_capabilities(pb::GetCapabilitiesRequest {}).await.unwrap().value;
        assert!(!caps.capabilities.contains(&(pb::Capability::Events as i32)), "no source, no events: {caps:?}");
        let op = c.create_machine(create_req("spot-0", spot)).await.unwrap().value;
        let op = crate::aws_ec2::wait_done(&c, op).await;
        op.machine().cloned().expect("the spot machine")
    };
    let instance = machine.provider_id.rsplit('/').next().unwrap().to_string();
    let lifecycle = aws(
        &moto,
        region,
        &format!(
            "i = ec2.describe_instances(InstanceIds=['{instance}'])['Reservations'][0]['Instances'][0]\n\
             print(json.dumps(i.get('InstanceLifecycle')))"
        ),
    )
    .await;
    assert_eq!(lifecycle, "spot", "RunInstances carried InstanceMarketOptions");
    // Another cluster's instance (no machinedriver.dev/name tag) in the same account and queue.
    let foreign = aws(
        &moto,
        region,
        &format!(
            "r = ec2.run_instances(ImageId='{MOTO_AMI}', InstanceType='t3.micro', MinCount=1, MaxCount=1)\n\
             print(json.dumps(r['Instances'][0]['InstanceId']))"
        ),
    )
    .await;
    let foreign = foreign.as_str().unwrap().to_string();

    put_spot_warning(&moto, region, &instance, EVENT_TIME).await;
    put_spot_warning(&moto, region, &foreign, EVENT_TIME).await;
    aws(&moto, region, &format!("sqs.send_message(QueueUrl='{url}', MessageBody='not an event {{')\nprint('0')")).await;
    // Two deliveries of ours, two of the foreign one, one message that is no event.
    assert_eq!(queue_depth(&moto, region, &url).await, 5);

    // Now the sidecar that reads the queue (and polls DescribeInstanceStatus, which moto always
    // answers `ok`: no event of its own).
    let driver =
        start_driver(&moto.url(), region, &["--interruption-queue-url", &url, "--instance-status-interval", "1s"])
            .await;
    let c = driver.client().await;
    let caps = c.get_capabilities(pb::GetCapabilitiesRequest {}).await.unwrap().value;
    assert!(caps.capabilities.contains(&(pb::Capability::Events as i32)), "{caps:?}");
    let mut stream = c.watch_events(watch(MINUTE)).await.unwrap().value;
    let e = next_event(&mut stream).await;
    assert_eq!(e.machine_name, "spot-0", "{e:?}\n{}", driver.log_text());
    assert_eq!(e.provider_id, machine.provider_id);
    assert_eq!(e.kind, pb::MachineEventKind::SpotInterruption as i32, "{e:?}");
    assert_eq!(e.action, pb::CloudAction::Terminate as i32, "{e:?}");
    let not_before = driver_sdk::convert::from_timestamp(e.not_before.as_ref().expect("a deadline"));
    assert_eq!(not_before, SystemTime::UNIX_EPOCH + Duration::from_secs(EVENT_TIME + 120), "time + 2 min");
    let offering = e.offering.clone().expect("an offering");
    assert_eq!(offering.capacity_type, pb::CapacityType::Spot as i32, "{offering:?}");
    assert_eq!(offering.machine_type, "t3.micro");
    assert!(offering.zone.starts_with(region), "{offering:?}");
    assert_eq!(e.delivery_attempt, 1);

    // The message that is no event goes at once; ours stay until the ack; the foreign ones stay.
    let depth = eventually(MINUTE, "the message that is no event deleted", || async {
        let d = queue_depth(&moto, region, &url).await;
        (d == 4).then_some(d)
    })
    .await;
    assert_eq!(depth, 4);
    let acked = c.ack_events(pb::AckEventsRequest { event_ids: vec![e.event_id.clone()] }).await.unwrap().value;
    assert_eq!(acked.acked_event_ids, std::slice::from_ref(&e.event_id), "{acked:?}");
    // Both deliveries of the acknowledged event are deleted (the second one was received with
    // the same event ID); the foreign instance's two are left for their owner.
    eventually(MINUTE, "both deliveries of the acked event deleted", || async {
        (queue_depth(&moto, region, &url).await == 2).then_some(())
    })
    .await;
    // Delivered once: the duplicate never came (the stream sends what it has before a keepalive).
    let after = next_item(&mut stream).await;
    assert!(after.is_none(), "a second event after the ack: {after:?}");
    // The foreign instance's messages are intact, and nothing of them reached the stream.
    let log = driver.log_text();
    assert!(!log.contains("not an event {"), "a message body was logged:\n{log}");
    drop(stream);
    drop(driver);
    let bodies = aws(
        &moto,
        region,
        &format!(
            "import time\nout = []\ndeadline = time.time() + 30\nwhile len(out) < 2 and time.time() < deadline:\n  \
             for m in sqs.receive_message(QueueUrl='{url}', MaxNumberOfMessages=10, WaitTimeSeconds=2, VisibilityTimeout=60).get('Messages', []):\n    \
             out.append(json.loads(m['Body'])['detail']['instance-id'])\nprint(json.dumps(out))"
        ),
    )
    .await;
    assert_eq!(bodies, json!([foreign, foreign]), "{log}");
}

// ----------------------------------------------------------------------- the controller on moto

/// The store's events of Machine `name` (they outlive the Machine).
async fn events_of(w: &World, name: &str) -> Vec<machine_controller::store::Event> {
    let key = machine_controller::store::Key::new(Kind::Machine, w.ns(), name);
    w.store().backend().events(&key, 100).await.unwrap()
}

/// `controller_interruption_events_total` of controller 0: `(labels, count)` per series.
async fn interruption_events(w: &World) -> Vec<(String, f64)> {
    let addr = w.metrics_addr(0).await;
    let body = eventually(MINUTE, "/metrics", || async {
        tokio::time::timeout(Duration::from_secs(10), e2e_tests::http_get(addr.port(), "/metrics"))
            .await
            .ok()
            .flatten()
            .filter(|(code, _)| *code == 200)
            .map(|(_, body)| body)
    })
    .await;
    body.lines()
        .filter_map(|l| l.strip_prefix("controller_interruption_events_total"))
        .filter_map(|l| {
            let (labels, value) = l.rsplit_once(' ')?;
            Some((labels.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// The whole way of a spot interruption on moto, with the controller on the embedded store: a
/// deployment of 2 spot machines (`instanceMarketOptions`) through the AWS driver sidecar, one
/// PutEvents of an `EC2 Spot Instance Interruption Warning` for one of its instances, which two
/// EventBridge rules deliver twice to the sidecar's SQS queue. The controller records the one
/// event on the Machine (EventBridge's ID, `time` + 2 min), deletes the machine and creates
/// exactly one replacement (moto launched 3 instances in all, the interrupted one terminated);
/// one `Interrupted` event, one event counted by the metric; both SQS messages deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spot_interruption_delivered_twice_through_eventbridge_replaces_its_machine_once_on_moto() {
    let region = "eu-west-3";
    let moto = Moto::shared().await;
    // Two rules match the warning: EventBridge delivers the one event (one `id`) twice.
    let url = queue_with_rules(&moto, region, 2).await;
    // The driver's debug log names each queue message it deletes.
    let driver = crate::aws_support::driver(&moto.url(), region, &["--interruption-queue-url", &url])
        .env([("RUST_LOG", "info,aws_ec2_driver=debug")]);
    let mut w =
        World::builder().driver(driver).controller_args(&["--controller-id", "e2e-aws-events"]).metrics().start().await;
    let manifest = format!(
        "apiVersion: machine.driver.dev/v1alpha1
kind: MachineClass
metadata: {{name: aws-spot}}
spec:
  driver: aws
  providerSpec: {{imageId: {MOTO_AMI}, instanceType: t3.micro, instanceMarketOptions: {{marketType: spot}}}}
---
apiVersion: machine.driver.dev/v1alpha1
kind: MachineDeployment
metadata: {{name: web}}
spec:
  replicas: 2
  template:
    spec:
      classRef: {{name: aws-spot}}
"
    );
    w.apply(&manifest).await;
    let running = |machines: &[Machine]| machines.iter().filter(|m| m.status.phase == Phase::Running).count();
    w.wait_for("2 machines Running", 2 * MINUTE, || async {
        let md = w.store().get::<MachineDeployment>(w.ns(), "web").await.ok()??;
        let machines = w.machines().await;
        (md.status.available_replicas == 2 && machines.len() == 2 && running(&machines) == 2).then_some(())
    })
    .await;
    let before = w.machines().await;
    let instance_of = |m: &Machine| m.status.provider_id.rsplit('/').next().unwrap_or_default().to_string();
    let lifecycles = aws(
        &moto,
        region,
        &format!(
            "out = {{}}\nfor r in ec2.describe_instances(InstanceIds={:?})['Reservations']:\n  for i in r['Instances']:\n    \
             out[i['InstanceId']] = i.get('InstanceLifecycle')\nprint(json.dumps(out))",
            before.iter().map(instance_of).collect::<Vec<_>>()
        ),
    )
    .await;
    let lifecycles = lifecycles.as_object().cloned().unwrap_or_default();
    assert!(lifecycles.len() == 2 && lifecycles.values().all(|l| l == "spot"), "{lifecycles:?}");
    let victim = before[0].metadata.name.clone();
    let survivor = before[1].metadata.name.clone();
    let instance = instance_of(&before[0]);

    // The event's `time`: now, in whole seconds as EventBridge writes it.
    let time = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs();
    // Watched from before the PutEvents: on the embedded store (no Node to drain) the machine
    // can be gone soon after its interruption is recorded.
    let recorded = w.wait_for("the interruption recorded on the victim", MINUTE, || async {
        let m = w.store().get::<Machine>(w.ns(), &victim).await.unwrap();
        let m =
            m.unwrap_or_else(|| panic!("{victim} is gone before its interruption was seen in the store\n{}", w.logs()));
        m.status.interruption.clone()
    });
    let (event_id, interruption) = tokio::join!(put_spot_warning(&moto, region, &instance, time), recorded);
    assert_eq!(interruption.kind, InterruptionKind::SpotInterruption, "{interruption:?}");
    assert_eq!(interruption.event_id, event_id, "EventBridge's ID is the event's: {interruption:?}");
    let not_before = chrono::DateTime::from_timestamp(time as i64 + 120, 0).unwrap();
    assert_eq!(interruption.not_before, Some(not_before), "time + 2 min: {interruption:?}");
    assert_eq!(interruption.action, "Terminate");
    let offering = interruption.offering.clone().expect("the offering");
    assert_eq!((offering.capacity_type.as_str(), offering.machine_type.as_str()), ("spot", "t3.micro"));

    // The victim deleted, its one replacement Running beside the untouched survivor.
    let after = w
        .wait_for("the victim gone and 2 machines Running", 2 * MINUTE, || async {
            let md = w.store().get::<MachineDeployment>(w.ns(), "web").await.ok()??;
            let machines = w.machines().await;
            let gone = !machines.iter().any(|m| m.metadata.name == victim);
            (gone && md.status.available_replicas == 2 && machines.len() == 2 && running(&machines) == 2)
                .then_some(machines)
        })
        .await;
    let replacing: Vec<&Machine> = after
        .iter()
        .filter(|m| {
            m.metadata.annotations.get(ANNOTATION_REPLACES_INTERRUPTION).is_some_and(|v| v.starts_with(&victim))
        })
        .collect();
    assert_eq!(replacing.len(), 1, "exactly one replacement: {after:?}");
    let replacement = replacing[0];
    let want = format!("{victim}/SpotInterruption/{}", not_before.to_rfc3339_opts(chrono::SecondsFormat::Millis, true));
    assert_eq!(replacement.metadata.annotations[ANNOTATION_REPLACES_INTERRUPTION], want);
    let mut names: Vec<&str> = after.iter().map(|m| m.metadata.name.as_str()).collect();
    names.sort_unstable();
    let mut want_names = vec![survivor.as_str(), replacement.metadata.name.as_str()];
    want_names.sort_unstable();
    assert_eq!(names, want_names);

    // moto, read with boto3: 3 instances ever launched (2 + 1), the victim's terminated.
    let instances = eventually(MINUTE, "the victim's instance terminated", || async {
        let all = moto.instances(region).await;
        all.iter().any(|i| i["id"] == instance.as_str() && i["state"] == "terminated").then_some(all)
    })
    .await;
    assert_eq!(instances.len(), 3, "one replacement launched: {instances:?}");
    let mut live: Vec<String> = instances
        .iter()
        .filter(|i| i["state"] == "running")
        .map(|i| i["tags"]["machinedriver.dev/name"].as_str().unwrap_or_default().to_string())
        .collect();
    live.sort();
    assert_eq!(live, want_names, "{instances:?}");

    // Handled once: one Interrupted event, one event counted (recorded), no second delivery.
    let events = events_of(&w, &victim).await;
    let interrupted: Vec<_> = events.iter().filter(|e| e.reason == "Interrupted").collect();
    assert_eq!(interrupted.len(), 1, "{events:?}");
    assert!(interrupted[0].message.contains(&event_id), "{}", interrupted[0].message);
    let counted = interruption_events(&w).await;
    let spot: Vec<_> = counted.iter().filter(|(labels, _)| labels.contains("kind=\"SpotInterruption\"")).collect();
    assert_eq!(spot.len(), 1, "{counted:?}");
    assert!(spot[0].0.contains("outcome=\"recorded\"") && spot[0].1 == 1.0, "{counted:?}");

    // Both deliveries deleted from the queue (two messages, each deleted once it was acked).
    eventually(MINUTE, "the queue empty", || async { (queue_depth(&moto, region, &url).await == 0).then_some(()) })
        .await;
    let log = w.sidecar().log_text();
    let mut deleted: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("deleted the queue message"))
        .filter_map(|l| l.split("message.id=").nth(1)?.split_whitespace().next())
        .collect();
    deleted.sort_unstable();
    deleted.dedup();
    assert_eq!(deleted.len(), 2, "two deliveries, each deleted: {deleted:?}\n{}", e2e_tests::world::tail(&log, 40));
    w.kill9().await;
    drop(w);
    // Nothing comes back after the queue's 2 s visibility timeout.
    let left = aws(
        &moto,
        region,
        &format!(
            "r = sqs.receive_message(QueueUrl='{url}', MaxNumberOfMessages=10, WaitTimeSeconds=4)\n\
             print(json.dumps(len(r.get('Messages', []))))"
        ),
    )
    .await;
    assert_eq!(left, 0, "a message left in the queue");
}
