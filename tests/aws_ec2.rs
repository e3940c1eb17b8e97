//! `aws-ec2-driver` as a user runs it: a real sidecar process with the real AWS SDK, against
//! moto's EC2 server (conformance suite, the controller end to end) and against a loopback EC2
//! stub for what moto cannot emulate (ClientToken dedupe, pending → running, eventual
//! consistency, capacity / throttling / auth / parameter-mismatch errors, lost responses).

use std::collections::HashMap;
use std::process::Stdio;
use std::time::Duration;

use crate::aws_support::{start_driver, Ec2Stub, Fault, Moto};
use driver_sdk::convert::json_to_struct;
use driver_sdk::proto as pb;
use driver_sdk::{reason, DriverClient, OperationExt};
use e2e_tests::world::World;
use e2e_tests::{bin, eventually, run, Driver};
use machine_controller::resources::{Machine, MachineClass, MachineDeployment, Phase};
use serde_json::json;
use tokio::process::Command;
use tonic::Code;

const MINUTE: Duration = Duration::from_secs(60);
/// The AMI of the schema's examples; moto 5.2.5 ships it in every region.
const MOTO_AMI: &str = "ami-12c6146b";

fn spec() -> serde_json::Value {
    json!({"imageId": MOTO_AMI, "instanceType": "t3.micro"})
}

fn create_req(name: &str, spec: serde_json::Value) -> pb::CreateMachineRequest {
    pb::CreateMachineRequest {
        name: name.into(),
        provider_spec: Some(json_to_struct(&spec)),
        labels: HashMap::from([("cluster".to_string(), "c1".to_string())]),
        uid: "uid-1".into(),
        ..Default::default()
    }
}

/// Polls GetOperation until done (bounded).
pub(crate) async fn wait_done(c: &DriverClient, op: pb::Operation) -> pb::Operation {
    wait_done_with(c, op, &None).await
}

// ------------------------------------------------------------------------------------------ moto

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_passes_against_moto() {
    let region = "eu-west-1";
    let moto = Moto::shared().await;
    assert!(
        moto.has_image(region, MOTO_AMI).await,
        "moto has no {MOTO_AMI} in {region}: the schema examples are stale"
    );
    // The events group runs on a real event: the trigger sends the machine's instance a
    // rebalance recommendation, as EventBridge delivers it, into the sidecar's queue.
    let queue = moto
        .boto3(
            region,
            "sqs = boto3.client('sqs', region_name=sys.argv[2], endpoint_url=sys.argv[1], \
             aws_access_key_id='testing', aws_secret_access_key='testing')\n\
             print(json.dumps(sqs.create_queue(QueueName='conformance-events')['QueueUrl']))",
        )
        .await;
    let queue = queue.as_str().expect("a queue URL").to_string();
    let scripts = tempfile::tempdir().unwrap();
    let trigger = scripts.path().join("trigger.py");
    std::fs::write(
        &trigger,
        format!(
            "import boto3, json, os, uuid\n\
             sqs = boto3.client('sqs', region_name='{region}', endpoint_url='{url}', aws_access_key_id='testing', \
             aws_secret_access_key='testing')\n\
             instance = os.environ['PROVIDER_ID'].rsplit('/', 1)[-1]\n\
             sqs.send_message(QueueUrl='{queue}', MessageBody=json.dumps({{'version': '0', 'id': str(uuid.uuid4()), \
             'detail-type': 'EC2 Instance Rebalance Recommendation', 'source': 'aws.ec2', 'account': '123456789012', \
             'time': '2024-05-01T10:00:00Z', 'region': '{region}', 'resources': [], 'detail': {{'instance-id': instance}}}}))\n",
            url = moto.url()
        ),
    )
    .unwrap();
    let trigger = format!("{} {}", crate::aws_support::moto_python().display(), trigger.display());
    let driver = start_driver(&moto.url(), region, &["--interruption-queue-url", &queue]).await;
    let (code, out, err) = run(
        &bin("driver-conformance"),
        &["--endpoint", &driver.endpoint(), "--operation-timeout", "60s", "--repeat", "2", "--event-trigger", &trigger],
    )
    .await;
    assert_eq!(code, 0, "conformance failed:\n{out}\n{err}\ndriver log:\n{}", driver.log_text());
    assert!(out.contains(" 0 failed"), "{out}");
    // In full: only the groups the driver does not advertise (pools) are skipped.
    for line in out.lines().filter(|l| l.starts_with("SKIP")) {
        assert!(line.ends_with("not advertised"), "a check was skipped: {line}\n{out}");
    }
    // It cleaned up after itself: nothing of it is left running in moto.
    let live: Vec<_> = moto
        .instances(region)
        .await
        .into_iter()
        .filter(|i| i["state"] != "terminated" && i["tags"]["machinedriver.dev/conformance-run"].is_string())
        .collect();
    assert!(live.is_empty(), "conformance left instances behind: {live:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_tags_at_launch_and_a_repeated_create_reuses_the_instance_on_moto() {
    let region = "eu-central-1";
    let moto = Moto::shared().await;
    let driver = start_driver(&moto.url(), region, &[]).await;
    let c = driver.client().await;
    let spec = json!({"imageId": MOTO_AMI, "instanceType": "t3.micro", "tags": {"team": "platform"}});
    let op = c.create_machine(create_req("web-0", spec.clone())).await.unwrap().value;
    let m = wait_done(&c, op).await.machine().cloned().expect("machine");
    assert!(m.provider_id.starts_with(&format!("aws:///{region}")), "{}", m.provider_id);
    let again = wait_done(&c, c.create_machine(create_req("web-0", spec.clone())).await.unwrap().value).await;
    assert_eq!(again.machine().unwrap().provider_id, m.provider_id);
    let instances = moto.instances(region).await;
    assert_eq!(instances.len(), 1, "{instances:?}");
    let tags = &instances[0]["tags"];
    assert_eq!(tags["machinedriver.dev/name"], "web-0");
    assert_eq!(tags["cluster"], "c1");
    assert_eq!(tags["team"], "platform");
    assert!(tags["machinedriver.dev/spec-hash"].is_string());
    // Another spec under the same name is a conflict, not a second instance.
    let other = json!({"imageId": MOTO_AMI, "instanceType": "t3.large"});
    let e = c.create_machine(create_req("web-0", other)).await.unwrap_err();
    assert_eq!((e.code(), e.reason()), (Code::AlreadyExists, reason::MACHINE_SPEC_CONFLICT), "{e}");
    assert_eq!(moto.instances(region).await.len(), 1);
    // Status by name and by provider ID; delete; gone.
    let st = c
        .get_machine_status(pb::GetMachineStatusRequest { name: "web-0".into(), ..Default::default() })
        .await
        .unwrap()
        .value;
    assert_eq!(st.state, pb::MachineState::Running as i32);
    let del = c.delete_machine(pb::DeleteMachineRequest { name: "web-0".into(), ..Default::default() }).await.unwrap();
    assert!(wait_done(&c, del.value).await.error_report().is_none());
    assert!(moto.instances(region).await.iter().all(|i| i["state"] == "terminated"));
    let e = c
        .get_machine_status(pb::GetMachineStatusRequest { name: "web-0".into(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launch_template_spec_launches_on_moto() {
    let region = "ap-northeast-1";
    let moto = Moto::shared().await;
    moto.boto3(
        region,
        &format!(
            "ec2.create_launch_template(LaunchTemplateName='web-lt', LaunchTemplateData={{'ImageId': '{MOTO_AMI}'}})\nprint('{{}}')"
        ),
    )
    .await;
    let driver = start_driver(&moto.url(), region, &[]).await;
    let c = driver.client().await;
    let spec = json!({"instanceType": "t3.micro", "launchTemplate": {"name": "web-lt", "version": "$Latest"}});
    let answer = c
        .validate_machine_class(pb::ValidateMachineClassRequest {
            provider_spec: Some(json_to_struct(&spec)),
            secrets: None,
        })
        .await
        .unwrap();
    // The machine capacity comes from EC2's DescribeInstanceTypes (moto's instance-type data):
    // a t3.micro has 2 vCPUs and 1 GiB.
    let capacity = &answer.value.capacity;
    assert_eq!(
        (capacity.get("cpu").map(String::as_str), capacity.get("memory").map(String::as_str)),
        (Some("2"), Some("1024Mi"))
    );
    let op = wait_done(&c, c.create_machine(create_req("lt-0", spec)).await.unwrap().value).await;
    assert!(op.error_report().is_none(), "{:?}", op.error_report());
    let instances = moto.instances(region).await;
    assert_eq!(instances.len(), 1, "{instances:?}");
    assert_eq!(instances[0]["tags"]["machinedriver.dev/name"], "lt-0");
    // Neither an AMI nor a template: refused before any EC2 call.
    let e = c.create_machine(create_req("lt-1", json!({"instanceType": "t3.micro"}))).await.unwrap_err();
    assert_eq!(e.reason(), reason::INVALID_PROVIDER_SPEC);
    assert_eq!(e.report.violations[0].field, "provider_spec.imageId");
}

/// The rendered boot data (the `userData` secret the controller sends) is the instance's user
/// data, over the spec's `userData`, as EC2 (moto's DescribeInstanceAttribute) keeps it; the
/// spec's applies without the secret. Too large, it is refused by name at create and at
/// validation, with nothing launched and its content in no error and no log line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_user_data_secret_wins_over_the_spec_and_too_large_launches_nothing_on_moto() {
    let region = "ap-south-1";
    let moto = Moto::shared().await;
    let driver = start_driver(&moto.url(), region, &[]).await;
    let c = driver.client().await;
    let spec = json!({"imageId": MOTO_AMI, "instanceType": "t3.micro", "userData": "#!/bin/sh\necho from-the-spec\n"});
    let user_data_of = |m: pb::Machine| {
        let id = m.provider_id.rsplit('/').next().unwrap_or_default().to_string();
        let moto = &moto;
        async move {
            moto.boto3(
                region,
                &format!(
                    "import base64\nv = ec2.describe_instance_attribute(InstanceId='{id}', Attribute='userData')\
                     ['UserData']['Value']\nprint(json.dumps(base64.b64decode(v).decode()))"
                ),
            )
            .await
        }
    };
    let rendered = "#!/bin/sh\necho rendered-boot-data\n";
    let req =
        pb::CreateMachineRequest { secrets: secrets(&[("userData", rendered)]), ..create_req("boot-0", spec.clone()) };
    let op = wait_done(&c, c.create_machine(req).await.unwrap().value).await;
    let m = op.machine().cloned().unwrap_or_else(|| panic!("{:?}", op.error_report()));
    assert_eq!(user_data_of(m).await, rendered);
    let op = wait_done(&c, c.create_machine(create_req("boot-1", spec.clone())).await.unwrap().value).await;
    let m = op.machine().cloned().unwrap_or_else(|| panic!("{:?}", op.error_report()));
    assert_eq!(user_data_of(m).await, "#!/bin/sh\necho from-the-spec\n");

    let launched = moto.instances(region).await.len();
    let big = format!("#!/bin/sh\n{}", "too-large-boot-data\n".repeat(1000));
    let e = c
        .create_machine(pb::CreateMachineRequest {
            secrets: secrets(&[("userData", &big)]),
            ..create_req("boot-2", spec.clone())
        })
        .await
        .unwrap_err();
    let e2 = c
        .validate_machine_class(pb::ValidateMachineClassRequest {
            provider_spec: Some(json_to_struct(&spec)),
            secrets: secrets(&[("userData", &big)]),
        })
        .await
        .unwrap_err();
    for e in [e, e2] {
        assert_eq!((e.code(), e.reason()), (Code::InvalidArgument, reason::FIELD_INVALID), "{e}");
        assert_eq!(e.report.violations[0].field, "secrets.userData", "{e}");
        let text = format!("{e} {:?}", e.report);
        assert!(text.contains(&big.len().to_string()) && text.contains("16384"), "{text}");
        assert!(!text.contains("too-large-boot-data"), "{text}");
    }
    assert_eq!(moto.instances(region).await.len(), launched, "a refused create launched an instance");
    let log = driver.log_text();
    assert!(!log.contains("rendered-boot-data") && !log.contains("too-large-boot-data"), "{log}");
}

/// What a failure domain sets: `availabilityZone` places the instance in that zone (moto's
/// default would be the region's first zone), as the provider ID, the status and moto say.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_lands_in_the_availability_zone_of_its_spec_on_moto() {
    let region = "eu-north-1";
    let moto = Moto::shared().await;
    let driver = start_driver(&moto.url(), region, &[]).await;
    let c = driver.client().await;
    let zones = [("zone-b", "eu-north-1b"), ("zone-c", "eu-north-1c")];
    for (name, zone) in zones {
        let spec = json!({"imageId": MOTO_AMI, "instanceType": "t3.micro", "availabilityZone": zone});
        let op = wait_done(&c, c.create_machine(create_req(name, spec)).await.unwrap().value).await;
        let m = op.machine().cloned().unwrap_or_else(|| panic!("{name}: {:?}", op.error_report()));
        assert!(m.provider_id.starts_with(&format!("aws:///{zone}/i-")), "{name}: {}", m.provider_id);
        let st = c
            .get_machine_status(pb::GetMachineStatusRequest { name: name.into(), ..Default::default() })
            .await
            .unwrap()
            .value;
        assert_eq!(st.provider_id, m.provider_id);
    }
    // RunInstances carried the zone as Placement.AvailabilityZone, and moto put them there.
    let placements: Vec<String> = moto
        .signed_calls_in("ec2", region)
        .into_iter()
        .filter(|call| call.action == "RunInstances")
        .filter_map(|call| call.params.get("Placement.AvailabilityZone").cloned())
        .collect();
    assert_eq!(placements, ["eu-north-1b", "eu-north-1c"]);
    let placed = moto
        .boto3(
            region,
            "print(json.dumps({t['Value']: i['Placement']['AvailabilityZone'] for r in ec2.describe_instances()['Reservations'] \
             for i in r['Instances'] for t in i.get('Tags', []) if t['Key'] == 'machinedriver.dev/name'}))",
        )
        .await;
    assert_eq!(placed, json!({"zone-b": "eu-north-1b", "zone-c": "eu-north-1c"}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_without_a_region_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = tokio::time::timeout(
        MINUTE,
        Command::new(bin("aws-ec2-driver"))
            .args(["--dev", "--endpoint", &format!("unix://{}/d.sock", dir.path().display())])
            .env_remove("AWS_REGION")
            .env_remove("AWS_DEFAULT_REGION")
            .env_remove("AWS_EC2_DRIVER_REGION")
            .env_remove("AWS_PROFILE")
            .env("AWS_CONFIG_FILE", "/nonexistent/aws-config")
            .env("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("exits")
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("no AWS region configured") && stderr.contains("--region"), "{stderr}");
}

// ------------------------------------------------------------------------------ controller on moto

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_runs_a_deployment_through_aws_ec2_driver_on_moto() {
    let region = "us-west-2";
    let moto = Moto::shared().await;
    let w = World::builder()
        .driver(crate::aws_support::driver(&moto.url(), region, &[]))
        .controller_args(&["--controller-id", "e2e-aws"])
        .start()
        .await;
    let manifest = format!(
        "apiVersion: machine.driver.dev/v1alpha1
kind: MachineClass
metadata: {{name: aws-small}}
spec:
  driver: aws
  providerSpec: {{imageId: {MOTO_AMI}, instanceType: t3.micro, tags: {{team: platform}}}}
---
apiVersion: machine.driver.dev/v1alpha1
kind: MachineDeployment
metadata: {{name: web}}
spec:
  replicas: 3
  template:
    spec:
      classRef: {{name: aws-small}}
  failureDomains:
  - {{name: a, providerSpec: {{availabilityZone: us-west-2a}}}}
  - {{name: b, providerSpec: {{availabilityZone: us-west-2b}}}}
  - {{name: c, providerSpec: {{availabilityZone: us-west-2c}}}}
"
    );
    w.apply(&manifest).await;

    let store = w.store();
    let controller_log = || w.controller_log(0);
    w.wait_for("3 machines Running", 2 * MINUTE, || {
        let store = store.clone();
        async move {
            let md = store.get::<MachineDeployment>("default", "web").await.ok()??;
            (md.status.available_replicas == 3 && md.status.replicas == 3).then_some(())
        }
    })
    .await;
    let machines = store.list::<Machine>().await.unwrap();
    assert_eq!(machines.len(), 3, "log:\n{}", controller_log());
    for m in &machines {
        assert_eq!(m.status.phase, Phase::Running, "{}: {:?}", m.metadata.name, m.status);
        // One per failure domain, each in its domain's availability zone.
        let zone = format!("us-west-2{}", m.spec.failure_domain.as_deref().unwrap_or("?"));
        assert!(m.status.provider_id.starts_with(&format!("aws:///{zone}/")), "{}", m.status.provider_id);
    }
    let mut domains: Vec<_> = machines.iter().filter_map(|m| m.spec.failure_domain.clone()).collect();
    domains.sort();
    assert_eq!(domains, ["a", "b", "c"]);

    // moto, read with boto3, is the ground truth: 3 running instances with the owner tags.
    let instances = moto.instances(region).await;
    let running: Vec<_> = instances.iter().filter(|i| i["state"] == "running").collect();
    assert_eq!(running.len(), 3, "{instances:?}");
    let mut names: Vec<String> =
        running.iter().map(|i| i["tags"]["machinedriver.dev/name"].as_str().unwrap_or_default().to_string()).collect();
    names.sort();
    let mut want: Vec<String> = machines.iter().map(|m| m.metadata.name.clone()).collect();
    want.sort();
    assert_eq!(names, want);
    for i in &running {
        assert_eq!(i["tags"]["machine.driver.dev/deployment"], "web", "{i}");
        assert_eq!(i["tags"]["machine.driver.dev/controller"], "e2e-aws", "{i}");
        assert_eq!(i["tags"]["team"], "platform", "{i}");
    }
    for m in &machines {
        let id = m.status.provider_id.rsplit('/').next().unwrap_or_default().to_string();
        assert!(
            running.iter().any(|i| i["id"] == id.as_str()),
            "{} has provider ID {:?}",
            m.metadata.name,
            m.status.provider_id
        );
    }

    let (code, out, err) = w.cli(&["delete", "md", "web"]).await;
    assert_eq!(code, 0, "delete failed:\n{out}\n{err}");
    w.wait_for("machines gone from the store", 2 * MINUTE, || {
        let store = store.clone();
        async move { store.list::<Machine>().await.ok().filter(|m| m.is_empty()).map(|_| ()) }
    })
    .await;
    let instances = moto.instances(region).await;
    assert_eq!(instances.len(), 3, "{instances:?}");
    assert!(instances.iter().all(|i| i["state"] == "terminated"), "{instances:?}\nlog:\n{}", controller_log());
}

// ----------------------------------------------------------------------- per-class credentials

/// Class A's keys: 20 characters like a real access key ID, a secret that must never show up.
const KEY_A: (&str, &str) = ("AKIACLASSAAAAAAAAAAA", "class-a-secret-0123456789abcdef");
const KEY_B: (&str, &str) = ("AKIACLASSBBBBBBBBBBB", "class-b-secret-0123456789abcdef");
/// The access key ID of the default chain in the sidecar's environment (`aws_env`).
const CHAIN_KEY: &str = "testing";

fn secrets(kv: &[(&str, &str)]) -> Option<pb::Secrets> {
    Some(pb::Secrets { data: kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect() })
}

fn keys(k: (&str, &str)) -> Option<pb::Secrets> {
    secrets(&[("accessKeyId", k.0), ("secretAccessKey", k.1)])
}

/// Polls GetOperation, sending `secrets` with every poll, until done (bounded).
async fn wait_done_with(c: &DriverClient, op: pb::Operation, secrets: &Option<pb::Secrets>) -> pb::Operation {
    e2e_tests::wait_done(c, op, secrets.clone(), MINUTE, Duration::from_millis(500)).await
}

/// Create (and poll), status, delete (and poll) of one machine, every call with `secrets`.
async fn lifecycle(c: &DriverClient, name: &str, secrets: Option<pb::Secrets>) {
    let op = c
        .create_machine(pb::CreateMachineRequest { secrets: secrets.clone(), ..create_req(name, spec()) })
        .await
        .unwrap()
        .value;
    let op = wait_done_with(c, op, &secrets).await;
    assert!(op.error_report().is_none(), "{name}: {:?}", op.error_report());
    let m = c
        .get_machine_status(pb::GetMachineStatusRequest {
            name: name.into(),
            secrets: secrets.clone(),
            provider_spec: Some(json_to_struct(&spec())),
            ..Default::default()
        })
        .await
        .unwrap()
        .value;
    let op = c
        .delete_machine(pb::DeleteMachineRequest {
            name: name.into(),
            provider_id: m.provider_id,
            provider_spec: Some(json_to_struct(&spec())),
            secrets: secrets.clone(),
        })
        .await
        .unwrap()
        .value;
    let op = wait_done_with(c, op, &secrets).await;
    assert!(op.error_report().is_none(), "{name}: {:?}", op.error_report());
}

/// (action, access key ID) of the EC2 calls moto saw in `region`, from `from` on.
fn ec2_keys(moto: &Moto, region: &str, from: usize) -> Vec<(String, String)> {
    moto.signed_calls_in("ec2", region).into_iter().skip(from).map(|c| (c.action, c.access_key_id)).collect()
}

/// Which access key signed each EC2 call, read from the SigV4 `Authorization` header that moto's
/// recorder keeps: a class's keys sign every call of its requests (creates, polls, status,
/// deletes), no secret means the chain's key, and half a key pair is refused before any call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_ec2_call_signs_with_the_class_secret_or_the_chain_on_moto() {
    let region = "ca-central-1";
    let moto = Moto::shared().await;
    let driver = start_driver(&moto.url(), region, &[]).await;
    let c = driver.client().await;

    lifecycle(&c, "web-a", keys(KEY_A)).await;
    let seen = ec2_keys(&moto, region, 0);
    for action in ["RunInstances", "DescribeInstances", "TerminateInstances"] {
        assert!(seen.iter().any(|(a, _)| a == action), "no {action} in {seen:?}");
    }
    assert!(seen.iter().all(|(_, k)| k == KEY_A.0), "{seen:?}");

    let from = seen.len();
    lifecycle(&c, "web-b", keys(KEY_B)).await;
    lifecycle(&c, "web-chain", None).await;
    let seen = ec2_keys(&moto, region, from);
    let b: Vec<_> = seen.iter().take_while(|(_, k)| k == KEY_B.0).collect();
    assert!(b.iter().any(|(a, _)| a == "RunInstances") && b.iter().any(|(a, _)| a == "TerminateInstances"), "{seen:?}");
    assert!(seen[b.len()..].iter().all(|(_, k)| k == CHAIN_KEY), "{seen:?}");
    assert!(seen[b.len()..].iter().any(|(a, _)| a == "RunInstances"), "{seen:?}");

    // Half a key pair: refused with the missing key named, no value echoed, no EC2 call.
    let from = moto.signed_calls_in("ec2", region).len();
    let half = secrets(&[("accessKeyId", "AKIAHALFAPAIRAAAAAAA")]);
    let e = c
        .create_machine(pb::CreateMachineRequest { secrets: half.clone(), ..create_req("web-bad", spec()) })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert_eq!(e.report.violations[0].field, "secrets.secretAccessKey", "{e}");
    assert!(!format!("{e} {e:?}").contains("AKIAHALFAPAIR"), "{e:?}");
    let e = c
        .validate_machine_class(pb::ValidateMachineClassRequest {
            provider_spec: Some(json_to_struct(&spec())),
            secrets: half,
        })
        .await
        .unwrap_err();
    assert_eq!(e.report.violations[0].field, "secrets.secretAccessKey", "{e}");
    assert_eq!(moto.signed_calls_in("ec2", region).len(), from, "a refused secret reached EC2");
    let instances = moto.instances(region).await;
    assert!(instances.iter().all(|i| i["tags"]["machinedriver.dev/name"] != "web-bad"), "{instances:?}");
    assert_eq!(instances.len(), 3, "{instances:?}");
}

/// `roleArn` (+ `externalId`, `roleSessionName`): one STS AssumeRole, signed by the secret's keys
/// or by the chain, whose temporary `ASIA…` keys then sign every EC2 call of the class (the
/// cached client does not assume the role again per call).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_arn_is_assumed_with_sts_and_signs_the_ec2_calls_on_moto() {
    let region = "sa-east-1";
    // Its own moto: on the shared one, under the other tests' load, the first AssumeRole was
    // refused a connection in 2 of 5 full runs.
    let moto = Moto::private().await;
    let driver = start_driver(&moto.url(), region, &[]).await;
    let c = driver.client().await;
    let role = "arn:aws:iam::123456789012:role/machines";

    let with_keys = secrets(&[
        ("roleArn", role),
        ("externalId", "ext-0042"),
        ("roleSessionName", "md-test"),
        ("accessKeyId", KEY_A.0),
        ("secretAccessKey", KEY_A.1),
    ]);
    lifecycle(&c, "web-role", with_keys).await;
    let sts = moto.signed_calls_in("sts", region);
    assert_eq!(sts.len(), 1, "{sts:?}");
    assert_eq!((sts[0].action.as_str(), sts[0].access_key_id.as_str()), ("AssumeRole", KEY_A.0));
    assert_eq!(sts[0].params.get("RoleArn").map(String::as_str), Some(role));
    assert_eq!(sts[0].params.get("ExternalId").map(String::as_str), Some("ext-0042"));
    assert_eq!(sts[0].params.get("RoleSessionName").map(String::as_str), Some("md-test"));
    let seen = ec2_keys(&moto, region, 0);
    assert!(seen.iter().any(|(a, _)| a == "RunInstances"), "{seen:?}");
    let assumed = &seen[0].1;
    assert!(assumed.starts_with("ASIA"), "{seen:?}");
    assert!(seen.iter().all(|(_, k)| k == assumed), "{seen:?}");

    // The role alone: the chain signs AssumeRole.
    let from = seen.len();
    lifecycle(&c, "web-role-chain", secrets(&[("roleArn", role)])).await;
    let sts = moto.signed_calls_in("sts", region);
    assert_eq!(sts.len(), 2, "{sts:?}");
    assert_eq!(sts[1].access_key_id, CHAIN_KEY);
    assert_eq!(sts[1].params.get("RoleSessionName").map(String::as_str), Some("machine-driver"));
    let seen = ec2_keys(&moto, region, from);
    assert!(seen.iter().all(|(_, k)| k.starts_with("ASIA") && k != assumed), "{seen:?}");
}

/// The controller end to end: two classes with their own Secrets in one run, each deployment's
/// instances launched, polled, listed and terminated with its class's key; a class whose Secret
/// holds half a key pair is marked invalid with the key named, and launches nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_drives_aws_with_each_class_secret_on_moto() {
    let region = "ap-southeast-2";
    let moto = Moto::shared().await;
    let w = World::builder()
        // No DescribeInstanceStatus poll: the event source signs with the sidecar's chain (a
        // class Secret is not known outside its calls), and this test proves no call does.
        .driver(crate::aws_support::driver(&moto.url(), region, &["--instance-status-interval", "0s"]))
        .controller_args(&["--controller-id", "e2e-aws-creds", "--orphan-interval", "1s"])
        .start()
        .await;
    let class = |name: &str, secret: &str| {
        format!(
            "apiVersion: machine.driver.dev/v1alpha1\nkind: MachineClass\nmetadata: {{name: {name}}}\nspec:\n  driver: aws\n  \
             secretRef: {{name: {secret}}}\n  providerSpec: {{imageId: {MOTO_AMI}, instanceType: t3.micro}}\n"
        )
    };
    let md = |name: &str, class: &str| {
        format!(
            "apiVersion: machine.driver.dev/v1alpha1\nkind: MachineDeployment\nmetadata: {{name: {name}}}\nspec:\n  \
             replicas: 1\n  template:\n    spec:\n      classRef: {{name: {class}}}\n"
        )
    };
    let secret = |name: &str, data: &str| {
        format!("apiVersion: v1\nkind: Secret\nmetadata: {{name: {name}}}\nstringData: {{{data}}}\n")
    };
    let manifest = [
        secret("creds-a", &format!("accessKeyId: {}, secretAccessKey: {}", KEY_A.0, KEY_A.1)),
        secret("creds-b", &format!("accessKeyId: {}, secretAccessKey: {}", KEY_B.0, KEY_B.1)),
        secret("creds-half", "accessKeyId: AKIAHALFAPAIRAAAAAAA"),
        class("aws-a", "creds-a"),
        class("aws-b", "creds-b"),
        class("aws-half", "creds-half"),
        md("web-a", "aws-a"),
        md("web-b", "aws-b"),
        md("web-half", "aws-half"),
    ]
    .join("---\n");
    w.apply(&manifest).await;

    let store = w.store();
    let controller_log = || w.controller_log(0);
    for name in ["web-a", "web-b"] {
        w.wait_for(&format!("{name} available"), 2 * MINUTE, || {
            let store = store.clone();
            async move {
                let md = store.get::<MachineDeployment>("default", name).await.ok()??;
                (md.status.available_replicas == 1).then_some(())
            }
        })
        .await;
    }
    let invalid = w
        .wait_for("class aws-half invalid", MINUTE, || {
            let store = store.clone();
            async move {
                let c = store.get::<MachineClass>("default", "aws-half").await.ok()??;
                c.status.conditions.into_iter().find(|c| c.condition_type == "Valid" && c.status == "False")
            }
        })
        .await;
    assert!(invalid.message.contains("secrets.secretAccessKey"), "{invalid:?}");
    assert!(!invalid.message.contains("AKIAHALFAPAIR"), "{invalid:?}");

    // Each deployment's launch was signed by its class's key, and every EC2 call of the run by
    // one of the two (none fell back to the chain).
    let calls = moto.signed_calls_in("ec2", region);
    let launched_by = |md: &str| -> Vec<String> {
        calls
            .iter()
            .filter(|c| c.action == "RunInstances")
            .filter(|c| {
                (1..).map_while(|k| c.params.get(&format!("TagSpecification.1.Tag.{k}.Key")).map(|v| (k, v))).any(
                    |(k, key)| {
                        key == "machine.driver.dev/deployment"
                            && c.params.get(&format!("TagSpecification.1.Tag.{k}.Value")).map(String::as_str)
                                == Some(md)
                    },
                )
            })
            .map(|c| c.access_key_id.clone())
            .collect()
    };
    assert_eq!(launched_by("web-a"), vec![KEY_A.0.to_string()], "log:\n{}", controller_log());
    assert_eq!(launched_by("web-b"), vec![KEY_B.0.to_string()]);
    assert!(launched_by("web-half").is_empty());
    // Every call uses a class's key, the orphan sweep's listings included (one per class
    // Secret); none falls back to the sidecar's chain.
    assert!(calls.iter().all(|c| c.access_key_id == KEY_A.0 || c.access_key_id == KEY_B.0), "{calls:?}");
    // The orphan sweep (every second here) lists once per class Secret, with that Secret.
    let sweep_keys = || {
        let calls = moto.signed_calls_in("ec2", region);
        let keys: std::collections::BTreeSet<String> = calls
            .iter()
            .filter(|c| c.params.values().any(|v| v == "tag:machine.driver.dev/controller"))
            .map(|c| c.access_key_id.clone())
            .collect();
        (keys.contains(KEY_A.0) && keys.contains(KEY_B.0)).then_some(keys)
    };
    let keys =
        eventually(Duration::from_secs(30), "the orphan sweep with each class's key", || async { sweep_keys() }).await;
    assert_eq!(keys, [KEY_A.0.to_string(), KEY_B.0.to_string()].into(), "the sweep fell back to the chain");
    let instances = moto.instances(region).await;
    assert_eq!(instances.len(), 2, "{instances:?}");

    // Deleting terminates each instance with its class's key.
    let ids: HashMap<String, String> = instances
        .iter()
        .map(|i| {
            (
                i["tags"]["machine.driver.dev/deployment"].as_str().unwrap_or_default().to_string(),
                i["id"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    for name in ["web-a", "web-b", "web-half"] {
        let (code, out, err) = w.cli(&["delete", "md", name]).await;
        assert_eq!(code, 0, "delete failed:\n{out}\n{err}");
    }
    w.wait_for("machines gone from the store", 2 * MINUTE, || {
        let store = store.clone();
        async move { store.list::<Machine>().await.ok().filter(|m| m.is_empty()).map(|_| ()) }
    })
    .await;
    let calls = moto.signed_calls_in("ec2", region);
    for (md, key) in [("web-a", KEY_A.0), ("web-b", KEY_B.0)] {
        let id = &ids[md];
        let terminated: Vec<&str> = calls
            .iter()
            .filter(|c| c.action == "TerminateInstances" && c.params.get("InstanceId.1") == Some(id))
            .map(|c| c.access_key_id.as_str())
            .collect();
        assert!(!terminated.is_empty() && terminated.iter().all(|k| *k == key), "{md}: {terminated:?}");
    }
    assert!(!controller_log().contains(KEY_A.1) && !controller_log().contains(KEY_B.1));
}

// ------------------------------------------------------------------------------------------ stub

async fn stub_driver(stub: &Ec2Stub) -> e2e_tests::Sidecar {
    start_driver(&stub.url(), "us-stub-1", &["--max-attempts", "1", "--poll-interval", "50ms"]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aws_errors_map_to_typed_errors_with_the_aws_code_and_request_id() {
    let stub = Ec2Stub::start().await;
    let driver = stub_driver(&stub).await;
    let c = driver.client().await;
    // (status, AWS code, gRPC code, reason, RetryInfo?, violation field)
    type Case = (u16, &'static str, Code, &'static str, bool, Option<&'static str>);
    let cases: &[Case] = &[
        // The zone has no room for the type now: another zone may have.
        (500, "InsufficientInstanceCapacity", Code::ResourceExhausted, reason::INSUFFICIENT_CAPACITY, false, None),
        (500, "InsufficientHostCapacity", Code::ResourceExhausted, reason::INSUFFICIENT_CAPACITY, false, None),
        // The zone does not offer the type.
        (400, "Unsupported", Code::Unavailable, reason::ZONE_UNAVAILABLE, false, None),
        // Account limits.
        (400, "InstanceLimitExceeded", Code::ResourceExhausted, reason::QUOTA_EXCEEDED, false, None),
        (400, "VcpuLimitExceeded", Code::ResourceExhausted, reason::QUOTA_EXCEEDED, false, None),
        (400, "MaxSpotInstanceCountExceeded", Code::ResourceExhausted, reason::QUOTA_EXCEEDED, false, None),
        (503, "RequestLimitExceeded", Code::Unavailable, reason::THROTTLED, true, None),
        (400, "Throttling", Code::Unavailable, reason::THROTTLED, true, None),
        (500, "InternalError", Code::Unavailable, reason::CLOUD_UNAVAILABLE, true, None),
        (503, "Unavailable", Code::Unavailable, reason::CLOUD_UNAVAILABLE, true, None),
        (403, "UnauthorizedOperation", Code::PermissionDenied, reason::CLOUD_AUTH_FAILED, false, None),
        (401, "AuthFailure", Code::PermissionDenied, reason::CLOUD_AUTH_FAILED, false, None),
        (400, "IdempotentParameterMismatch", Code::AlreadyExists, reason::MACHINE_SPEC_CONFLICT, false, None),
        (
            400,
            "InvalidAMIID.NotFound",
            Code::InvalidArgument,
            reason::INVALID_PROVIDER_SPEC,
            false,
            Some("provider_spec.imageId"),
        ),
        (
            400,
            "InvalidAMIID.Malformed",
            Code::InvalidArgument,
            reason::INVALID_PROVIDER_SPEC,
            false,
            Some("provider_spec.imageId"),
        ),
        (
            400,
            "InvalidSubnetID.NotFound",
            Code::InvalidArgument,
            reason::INVALID_PROVIDER_SPEC,
            false,
            Some("provider_spec.subnetId"),
        ),
        (
            400,
            "InvalidKeyPair.NotFound",
            Code::InvalidArgument,
            reason::INVALID_PROVIDER_SPEC,
            false,
            Some("provider_spec.keyName"),
        ),
    ];
    for (i, (status, aws_code, code, why, retry, field)) in cases.iter().enumerate() {
        let aws_request_id = format!("aws-req-{i}-{aws_code}");
        stub.fail_next("RunInstances", Fault::error(*status, aws_code, &aws_request_id));
        let e = c.create_machine(create_req(&format!("m-{i}"), spec())).await.unwrap_err();
        let r = &e.report;
        assert_eq!((r.code, r.reason.as_str()), (*code, *why), "{aws_code}: {e}");
        assert_eq!(r.domain, "aws-ec2.machinedriver.dev");
        assert_eq!(r.metadata.get("awsErrorCode").map(String::as_str), Some(*aws_code), "{aws_code}: {r:?}");
        assert_eq!(r.metadata.get("awsOperation").map(String::as_str), Some("RunInstances"));
        assert_eq!(r.cloud_request_ids, vec![aws_request_id.clone()], "{aws_code}");
        assert!(!r.request_id.is_empty());
        assert_eq!(r.retry_after.is_some(), *retry, "{aws_code}: RetryInfo {:?}", r.retry_after);
        if let Some(f) = field {
            assert!(r.violations.iter().any(|v| v.field == *f), "{aws_code}: {:?}", r.violations);
        }
        assert!(r.causes.iter().any(|c| c.contains(aws_code)) || r.message.contains(aws_code), "{aws_code}: {r:?}");
        // Our request ID and AWS's on one log line.
        let log = driver.log_text();
        assert!(
            log.lines().any(|l| l.contains(&r.request_id) && l.contains(&aws_request_id) && l.contains(aws_code)),
            "no log line with request {} and AWS request {aws_request_id}:\n{log}",
            r.request_id
        );
    }
    // A generic bad parameter names the spec field from EC2's message.
    stub.fail_next(
        "RunInstances",
        Fault::Error {
            status: 400,
            code: "InvalidParameterValue".into(),
            message: "Invalid value 'x9.huge' for InstanceType.".into(),
            request_id: "aws-req-param".into(),
            header: true,
        },
    );
    let e = c.create_machine(create_req("m-param", spec())).await.unwrap_err();
    assert_eq!(e.reason(), reason::INVALID_PROVIDER_SPEC);
    assert_eq!(e.report.violations[0].field, "provider_spec.instanceType", "{:?}", e.report.violations);
    // Some endpoints put the request ID only in the XML body; it is still found.
    stub.fail_next(
        "RunInstances",
        Fault::Error {
            status: 503,
            code: "RequestLimitExceeded".into(),
            message: "Request limit exceeded.".into(),
            request_id: "aws-req-body-only".into(),
            header: false,
        },
    );
    let e = c.create_machine(create_req("m-body", spec())).await.unwrap_err();
    assert_eq!(e.report.cloud_request_ids, vec!["aws-req-body-only".to_string()]);
    // Errors of the reads map the same way.
    stub.fail_next("DescribeInstances", Fault::error(503, "RequestLimitExceeded", "aws-req-describe"));
    let e = c
        .get_machine_status(pb::GetMachineStatusRequest { name: "m-0".into(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!((e.code(), e.reason()), (Code::Unavailable, reason::THROTTLED));
    assert_eq!(e.report.metadata.get("awsOperation").map(String::as_str), Some("DescribeInstances"));
    assert_eq!(e.report.cloud_request_ids, vec!["aws-req-describe".to_string()]);
    stub.fail_next("DescribeInstances", Fault::error(403, "UnauthorizedOperation", "aws-req-list"));
    let e = c.list_machines(pb::ListMachinesRequest::default()).await.unwrap_err();
    assert_eq!((e.code(), e.reason()), (Code::PermissionDenied, reason::CLOUD_AUTH_FAILED));
    // No instance was launched by any of this.
    assert!(stub.instances().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_credentials_are_permission_denied_without_calling_ec2() {
    let stub = Ec2Stub::start().await;
    let mut env = crate::aws_support::aws_env(&stub.url(), "us-stub-1");
    env.retain(|(k, _)| k != "AWS_ACCESS_KEY_ID" && k != "AWS_SECRET_ACCESS_KEY");
    // Empty keys count as none; the profile files do not exist and instance metadata is off.
    env.push(("AWS_ACCESS_KEY_ID".into(), String::new()));
    env.push(("AWS_SECRET_ACCESS_KEY".into(), String::new()));
    let driver = Driver::binary("aws-ec2-driver").args(["--dev", "--max-attempts", "1"]).env(env).start().await;
    let c = driver.client().await;
    let e = c.create_machine(create_req("web-0", spec())).await.unwrap_err();
    assert_eq!((e.code(), e.reason()), (Code::PermissionDenied, reason::CLOUD_AUTH_FAILED), "{e}");
    assert!(stub.requests("DescribeInstances").is_empty() && stub.requests("RunInstances").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_and_not_yet_visible_instances_keep_the_operation_running() {
    let stub = Ec2Stub::start().await;
    stub.with(|s| {
        s.new_invisible_by_id = 2; // InvalidInstanceID.NotFound twice right after launch
        s.new_pending_polls = 2; // then pending twice, then running
    });
    let driver = stub_driver(&stub).await;
    let c = driver.client().await;
    let op = c.create_machine(create_req("web-0", spec())).await.unwrap().value;
    assert!(!op.done, "a pending instance is not done");
    let mut seen_running_polls = 0;
    let mut op = op;
    let deadline = tokio::time::Instant::now() + MINUTE;
    while !op.done {
        assert!(tokio::time::Instant::now() < deadline);
        let before = stub.requests("DescribeInstances").len();
        op = c.get_operation(pb::GetOperationRequest { token: op.token.clone(), secrets: None }).await.unwrap().value;
        assert_eq!(stub.requests("DescribeInstances").len(), before + 1, "one GetOperation = one DescribeInstances");
        if !op.done {
            seen_running_polls += 1;
            assert!(op.error_report().is_none());
        }
    }
    assert!(seen_running_polls >= 4, "NotFound ×2 and pending ×2 must each poll as running ({seen_running_polls})");
    let m = op.machine().expect("machine");
    let id = &stub.instances()[0].id;
    assert_eq!(m.provider_id, format!("aws:///us-stub-1a/{id}"));
    assert_eq!(m.state, pb::MachineState::Running as i32);
    assert_eq!(stub.requests("RunInstances").len(), 1);
    // The operation resumes from its token alone in a restarted sidecar.
    let token = op.token.clone();
    drop(c);
    let (_, _) = driver.terminate().await;
    let driver = stub_driver(&stub).await;
    let c = driver.client().await;
    let again = c.get_operation(pb::GetOperationRequest { token, secrets: None }).await.unwrap().value;
    assert!(again.done);
    assert_eq!(again.machine().unwrap().provider_id, m.provider_id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_retried_after_a_lost_response_does_not_launch_twice() {
    let stub = Ec2Stub::start().await;
    // EC2 is eventually consistent: the new instance is missing from the next tag query.
    stub.with(|s| s.new_invisible_by_filter = 1);
    let driver = stub_driver(&stub).await;
    let c = driver.client().await;
    stub.fail_next("RunInstances", Fault::DropAfterApply);
    let e = c.create_machine(create_req("web-0", spec())).await.unwrap_err();
    assert_eq!((e.code(), e.reason()), (Code::Unavailable, reason::CLOUD_UNAVAILABLE), "{e}");
    assert_eq!(stub.instances().len(), 1, "the launch happened; only its answer was lost");

    // The caller retries: the tag lookup misses the instance, so RunInstances goes out again with
    // the same ClientToken and EC2 answers with the original launch.
    let op = c.create_machine(create_req("web-0", spec())).await.unwrap().value;
    let runs = stub.requests("RunInstances");
    assert_eq!(runs.len(), 2);
    let token = runs[0].get("ClientToken").expect("ClientToken sent").to_string();
    assert_eq!(runs[1].get("ClientToken"), Some(token.as_str()), "the retry must reuse the ClientToken");
    assert!(token.len() <= 64 && token.is_ascii());
    let op = wait_done(&c, op).await;
    let instances = stub.instances();
    assert_eq!(instances.len(), 1, "launched twice: {instances:?}");
    assert!(op.machine().unwrap().provider_id.ends_with(&instances[0].id));

    // Once visible, a create finds it by tag and does not call RunInstances at all.
    let again = c.create_machine(create_req("web-0", spec())).await.unwrap().value;
    assert!(again.done);
    assert_eq!(stub.requests("RunInstances").len(), 2);
    assert_eq!(stub.instances().len(), 1);
    // Owner tags went out with the launch.
    let tags = &instances[0].tags;
    assert_eq!(tags.get("machinedriver.dev/name").map(String::as_str), Some("web-0"));
    assert_eq!(tags.get("cluster").map(String::as_str), Some("c1"));
    assert!(tags.contains_key("machinedriver.dev/spec-hash"));

    // A different incarnation (uid) gets a different token.
    let other = stub.requests("RunInstances").len();
    let mut req = create_req("web-1", spec());
    req.uid = "uid-2".into();
    wait_done(&c, c.create_machine(req).await.unwrap().value).await;
    assert_ne!(stub.requests("RunInstances")[other].get("ClientToken"), Some(token.as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_retry_of_a_lost_response_reuses_the_client_token() {
    let stub = Ec2Stub::start().await;
    let driver = start_driver(&stub.url(), "us-stub-1", &["--max-attempts", "2", "--poll-interval", "50ms"]).await;
    let c = driver.client().await;
    stub.fail_next("RunInstances", Fault::DropAfterApply);
    let op = c.create_machine(create_req("web-0", spec())).await.unwrap().value;
    let runs = stub.requests("RunInstances");
    assert_eq!(runs.len(), 2, "the SDK retried once");
    assert_eq!(runs[0].get("ClientToken"), runs[1].get("ClientToken"));
    wait_done(&c, op).await;
    assert_eq!(stub.instances().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_waits_for_terminated_and_a_missing_instance_is_done() {
    let stub = Ec2Stub::start().await;
    let driver = stub_driver(&stub).await;
    let c = driver.client().await;
    wait_done(&c, c.create_machine(create_req("web-0", spec())).await.unwrap().value).await;
    let op =
        c.delete_machine(pb::DeleteMachineRequest { name: "web-0".into(), ..Default::default() }).await.unwrap().value;
    assert!(!op.done, "shutting-down is not done");
    assert_eq!(stub.requests("TerminateInstances").len(), 1);
    let op = wait_done(&c, op).await;
    assert!(op.error_report().is_none());
    assert_eq!(stub.instances()[0].code, 48);
    // Absent machine: a done operation, no TerminateInstances.
    let op =
        c.delete_machine(pb::DeleteMachineRequest { name: "web-0".into(), ..Default::default() }).await.unwrap().value;
    assert!(op.done && op.error_report().is_none());
    assert_eq!(stub.requests("TerminateInstances").len(), 1);
    // The instance vanished between lookup and terminate (InvalidInstanceID.NotFound): done.
    wait_done(&c, c.create_machine(create_req("web-1", spec())).await.unwrap().value).await;
    stub.fail_next("TerminateInstances", Fault::error(400, "InvalidInstanceID.NotFound", "aws-req-gone"));
    let op =
        c.delete_machine(pb::DeleteMachineRequest { name: "web-1".into(), ..Default::default() }).await.unwrap().value;
    assert!(op.done && op.error_report().is_none());
    // A poll of a delete whose instance is no longer known is done too.
    let op =
        c.delete_machine(pb::DeleteMachineRequest { name: "web-1".into(), ..Default::default() }).await.unwrap().value;
    assert!(!op.done);
    stub.fail_next("DescribeInstances", Fault::error(400, "InvalidInstanceID.NotFound", "aws-req-gone-2"));
    let op = c.get_operation(pb::GetOperationRequest { token: op.token, secrets: None }).await.unwrap().value;
    assert!(op.done && op.error_report().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recreating_a_deleted_machine_does_not_get_the_terminated_instance_back() {
    let stub = Ec2Stub::start().await;
    let driver = stub_driver(&stub).await;
    let c = driver.client().await;
    let first = wait_done(&c, c.create_machine(create_req("web-0", spec())).await.unwrap().value).await;
    let del = c.delete_machine(pb::DeleteMachineRequest { name: "web-0".into(), ..Default::default() }).await.unwrap();
    wait_done(&c, del.value).await;
    // Same name, uid and spec: the first ClientToken replays the terminated launch (EC2 keeps
    // tokens for at least 24 h), so the driver moves on to the next token of its chain.
    let second = wait_done(&c, c.create_machine(create_req("web-0", spec())).await.unwrap().value).await;
    let m = second.machine().expect("machine");
    assert_ne!(m.provider_id, first.machine().unwrap().provider_id);
    assert_eq!(m.state, pb::MachineState::Running as i32);
    let runs = stub.requests("RunInstances");
    assert_eq!(runs.len(), 3, "launch, replay of the terminated launch, relaunch");
    assert_eq!(runs[0].get("ClientToken"), runs[1].get("ClientToken"));
    assert_ne!(runs[1].get("ClientToken"), runs[2].get("ClientToken"));
    assert_eq!(stub.instances().len(), 2);
}
