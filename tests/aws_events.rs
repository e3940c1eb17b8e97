//! `aws-ec2-driver`'s event stream on moto's server: EventBridge `PutEvents` matched by a real
//! rule and delivered to a real SQS queue, read by the sidecar and streamed by `WatchEvents`.
//! moto raises no interruption of its own: the tests inject the events as EventBridge would
//! deliver AWS's.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use crate::aws_support::{start_driver, Moto};
use driver_sdk::convert::json_to_struct;
use driver_sdk::proto as pb;
use driver_sdk::OperationExt;
use e2e_tests::eventually;
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

/// PutEvents of one spot interruption warning for `instance` at [`EVENT_TIME`].
async fn put_spot_warning(moto: &Moto, region: &str, instance: &str) {
    let v = aws(
        moto,
        region,
        &format!(
            "import datetime\nr = events.put_events(Entries=[{{'Source': 'aws.ec2', \
             'DetailType': 'EC2 Spot Instance Interruption Warning', \
             'Detail': json.dumps({{'instance-id': '{instance}', 'instance-action': 'terminate'}}), \
             'Resources': ['arn:aws:ec2:{region}a:instance/{instance}'], \
             'Time': datetime.datetime.fromtimestamp({EVENT_TIME}, datetime.timezone.utc)}}])\n\
             print(json.dumps(r['FailedEntryCount']))"
        ),
    )
    .await;
    assert_eq!(v, 0, "PutEvents refused the event");
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

    put_spot_warning(&moto, region, &instance).await;
    put_spot_warning(&moto, region, &foreign).await;
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
