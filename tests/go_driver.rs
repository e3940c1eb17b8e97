//! The Go driver (`examples/go-driver`): a driver written in Go from the `.proto` files alone,
//! with grpc-go and no Rust. It passes `driver-conformance` in full, the controller rolls out a
//! MachineDeployment on it, and the Rust `DriverClient` reads its request IDs and error details.
//! That is the proof that the protocol, not `driver-sdk`, is the contract.
//!
//! The binary comes from `tests/tools/build-go-driver.sh` through `GO_DRIVER_BIN` (`cargo xtask install`
//! sets it); without it these tests fail with the command to run, they never skip.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use driver_sdk::convert::json_to_struct;
use driver_sdk::proto as pb;
use driver_sdk::{reason, ErrorReport, OperationExt};
use e2e_tests::world::{go_driver, Driver, World};
use e2e_tests::{bin, eventually, run, Sidecar};
use machine_controller::resources::{Machine, Phase, LABEL_REVISION};
use serde_json::json;
use tokio::process::Command;
use tonic::Code;

const MINUTE: Duration = Duration::from_secs(60);
const DOMAIN: &str = "go.machinedriver.dev";
/// Every await on a single call is bounded by this.
const CALL: Duration = Duration::from_secs(10);

/// The Go driver on a temporary Unix socket, with a random (dev-mode) token key.
async fn start(args: &[&str]) -> Sidecar {
    Driver::go(args).start().await
}

/// Bounds one call.
async fn bounded<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(CALL, fut).await.unwrap_or_else(|_| panic!("{what} did not answer within {CALL:?}"))
}

/// SIGTERM: the Go driver drains, removes its socket and exits 0.
async fn stop(sidecar: Sidecar) {
    let socket = sidecar.socket.clone();
    let (status, _dir) = sidecar.terminate().await;
    stopped(status, &socket);
}

/// What SIGTERM must leave: exit 0 and no socket.
fn stopped(status: std::process::ExitStatus, socket: &Path) {
    assert!(status.success(), "go-driver exited with {status} after SIGTERM");
    assert!(!socket.exists(), "go-driver left its socket {} behind", socket.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_passes_in_full_against_the_go_driver() {
    // With its event source: a folder where a file <machine>.<KIND> is that machine's event.
    let events = tempfile::tempdir().unwrap();
    let event_dir = events.path().to_str().unwrap().to_string();
    let sidecar = start(&["--event-dir", &event_dir]).await;
    let trigger = format!(r#"touch '{event_dir}'/"$MACHINE_NAME".SPOT_INTERRUPTION"#);
    let args = ["--endpoint", &sidecar.endpoint(), "--event-trigger", &trigger];
    let (code, out, err) = run(&bin("driver-conformance"), &args).await;
    assert_eq!(code, 0, "conformance failed against the Go driver:\n{out}\n{err}\ndriver log:\n{}", sidecar.log_text());
    let summary = out.lines().last().unwrap_or_default();
    assert!(summary.contains(" 0 failed"), "{out}");
    // In full: a check may only be skipped for a group the Go driver does not advertise
    // (pools, in-place updates: those checks do not run at all, and their RPCs are checked to
    // answer UNIMPLEMENTED by `capabilities.unadvertised_are_unimplemented`).
    for line in out.lines().filter(|l| l.starts_with("SKIP")) {
        assert!(line.contains("not advertised"), "a check was skipped: {line}\n{out}");
    }
    for check in [
        "machines.create_idempotent",
        "operations.wait_operation",
        "capabilities.unadvertised_are_unimplemented",
        "events.keepalive_on_an_idle_stream_and_resume_after_cancel",
        "events.redelivered_until_acked_resumed_and_acked_once",
    ] {
        assert!(out.lines().any(|l| l.starts_with("PASS") && l.contains(check)), "{check} did not pass:\n{out}");
    }
    // The suite cleaned up after itself.
    let client = sidecar.client().await;
    let left = bounded("ListMachines", client.list_all_machines(HashMap::new(), 100, None)).await.unwrap();
    assert!(left.is_empty(), "machines left behind: {left:?}");
    let files: Vec<_> = std::fs::read_dir(events.path()).unwrap().collect();
    assert!(files.is_empty(), "an acknowledged event's file is left: {files:?}");
    stop(sidecar).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_passes_over_tcp_too() {
    // Port 0: the Go driver logs the address it bound (`address=127.0.0.1:PORT`), so no other
    // process can take the port between choosing and binding it.
    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("go-driver.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut child = Command::new(go_driver())
        .args(["--endpoint", "127.0.0.1:0", "--dev"])
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let addr = eventually(MINUTE, "the Go driver serving on TCP", || {
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        let addr = text
            .lines()
            .filter(|l| l.contains("msg=\"go-driver serving\""))
            .find_map(|l| l.split_whitespace().find_map(|f| f.strip_prefix("address=")).map(str::to_string));
        async move { addr }
    })
    .await;
    let endpoint = format!("tcp://{addr}");
    let (code, out, err) = run(&bin("driver-conformance"), &["--endpoint", &endpoint]).await;
    assert_eq!(code, 0, "conformance failed over TCP:\n{out}\n{err}");
    assert!(out.lines().last().unwrap_or_default().contains(" 0 failed"), "{out}");
    let pid = child.id().expect("pid").to_string();
    let _ = std::process::Command::new("kill").args(["-TERM", &pid]).status();
    let status = tokio::time::timeout(MINUTE, child.wait()).await.expect("exit after SIGTERM").unwrap();
    assert!(status.success(), "go-driver exited with {status} after SIGTERM");
}

/// The names the Go driver logged `creating machine` for, with how often: its ground truth of
/// real creates (an idempotent replay logs nothing).
fn creates_in_log(log: &str) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for line in log.lines().filter(|l| l.contains("msg=\"creating machine\"")) {
        let name = line.split_whitespace().find_map(|f| f.strip_prefix("machine=")).expect("machine= field");
        *out.entry(name.to_string()).or_insert(0) += 1;
    }
    out
}

fn md_yaml(replicas: i64, image: &str) -> String {
    format!(
        "apiVersion: machine.driver.dev/v1alpha1
kind: MachineDeployment
metadata: {{name: web}}
spec:
  replicas: {replicas}
  template:
    spec:
      classRef: {{name: go-small}}
      providerSpec: {{image: {image}}}
  strategy:
    rollingUpdate: {{maxSurge: 1, maxUnavailable: 0}}
"
    )
}

const CLASS_YAML: &str = "apiVersion: machine.driver.dev/v1alpha1
kind: MachineClass
metadata: {name: go-small}
spec:
  driver: go
  providerSpec: {size: small}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_rolls_out_a_machine_deployment_on_the_go_driver() {
    let mut w = World::builder()
        .driver(Driver::go(&["--create-latency", "300ms", "--delete-latency", "100ms"]))
        .controller_args(&["--resync-interval", "5s"])
        .start()
        .await;
    let client = w.driver_client().await;
    w.apply(CLASS_YAML).await;
    w.apply(&md_yaml(3, "go-os-1")).await;
    let first = w.converged("web", MINUTE).await;

    // Then a new image: a rolling update replaces every machine.
    w.apply(&md_yaml(3, "go-os-2")).await;
    let md = w.converged("web", MINUTE).await;
    assert_ne!(md.status.current_revision, first.status.current_revision, "the image change made no new revision");

    // The store and the Go driver's cloud agree: 3 Running machines of the new revision.
    let machines = w.store().list::<Machine>().await.unwrap();
    assert_eq!(machines.len(), 3, "{machines:?}");
    for m in &machines {
        assert_eq!(m.status.phase, Phase::Running, "{} is {:?}", m.metadata.name, m.status.phase);
        assert_eq!(m.metadata.labels.get(LABEL_REVISION), Some(&md.status.current_revision));
        assert!(m.status.provider_id.starts_with("go:///"), "{}", m.status.provider_id);
    }
    let cloud = eventually(MINUTE, "the replaced machines deleted in the cloud", || {
        let client = client.clone();
        async move {
            let cloud = bounded("ListMachines", client.list_all_machines(HashMap::new(), 100, None)).await.ok()?;
            (cloud.len() == 3).then_some(cloud)
        }
    })
    .await;
    let names: HashSet<&str> = machines.iter().map(|m| m.metadata.name.as_str()).collect();
    let cloud_names: HashSet<&str> = cloud.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, cloud_names, "store and cloud disagree");
    assert!(cloud.iter().all(|m| m.state == pb::MachineState::Running as i32), "{cloud:?}");
    for m in &machines {
        let c = cloud.iter().find(|c| c.name == m.metadata.name).unwrap();
        assert_eq!(c.provider_id, m.status.provider_id, "{}", m.metadata.name);
    }

    // Each machine was created once: 3, then 3 replacements, no name twice.
    let log = w.sidecar().log_text();
    let creates = creates_in_log(&log);
    assert_eq!(creates.len(), 6, "6 machines should have been created: {creates:?}");
    assert!(creates.values().all(|n| *n == 1), "a machine was created twice: {creates:?}");
    assert!(names.iter().all(|n| creates.contains_key(*n)));
    // Creates were long-running: the controller polled each at least twice.
    let polls = log.lines().filter(|l| l.contains("method=/machinedriver.v1.Operations/GetOperation")).count();
    assert!(polls >= 2 * 6, "only {polls} GetOperation calls for 6 creates");
    // The controller's request IDs reached the Go driver (it logs the one it was sent).
    let rid = machines[0].status.request_ids.last().cloned().unwrap_or_default();
    assert!(
        !rid.is_empty() && log.contains(&format!("request.id={rid}")),
        "request {rid:?} not in the Go driver's log"
    );

    w.kill9().await;
    let (status, socket) = w.terminate_driver().await;
    stopped(status, &socket);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_are_echoed_and_error_details_decode_through_the_rust_client() {
    let sidecar = start(&["--create-latency", "10s"]).await;
    let client = sidecar.client().await;
    let header = "x-request-id";

    // The caller's request ID comes back in the response headers; one is made when absent.
    let mut identity = pb::identity_client::IdentityClient::new(client.channel());
    let sent = format!("go-driver-test-{}", uuid::Uuid::new_v4());
    let mut req = tonic::Request::new(pb::GetDriverInfoRequest {});
    req.metadata_mut().insert(header, sent.parse().unwrap());
    let resp = bounded("GetDriverInfo", identity.get_driver_info(req)).await.unwrap();
    assert_eq!(resp.metadata().get(header).and_then(|v| v.to_str().ok()), Some(sent.as_str()));
    assert_eq!(resp.get_ref().name, DOMAIN);
    let resp = bounded("GetDriverInfo", identity.get_driver_info(pb::GetDriverInfoRequest {})).await.unwrap();
    let made = resp.metadata().get(header).and_then(|v| v.to_str().ok()).unwrap_or_default();
    assert!(uuid::Uuid::parse_str(made).is_ok(), "no generated request ID: {made:?}");

    // An invalid create through DriverClient: ErrorInfo + RequestInfo + BadRequest, every
    // violation collected, the first deciding the reason.
    let bad = pb::CreateMachineRequest {
        name: "Not_A_Name".into(),
        provider_spec: Some(json_to_struct(&json!({"size": "huge", "colour": "red"}))),
        ..Default::default()
    };
    let e = bounded("CreateMachine", client.create_machine(bad)).await.unwrap_err();
    assert_eq!((e.code(), e.reason()), (Code::InvalidArgument, reason::FIELD_INVALID), "{e}");
    assert_eq!(e.report.domain, DOMAIN);
    let fields: Vec<&str> = e.report.violations.iter().map(|v| v.field.as_str()).collect();
    assert_eq!(fields, ["name", "provider_spec.size", "provider_spec.colour"]);
    assert!(sidecar.log_text().contains(&format!("request.id={}", e.request_id())), "{e}");

    // The same through a raw client with a chosen request ID: echoed in the headers of the
    // error response and in its RequestInfo.
    let mut machines = pb::machines_client::MachinesClient::new(client.channel());
    let sent = format!("go-driver-err-{}", uuid::Uuid::new_v4());
    let mut req = tonic::Request::new(pb::CreateMachineRequest::default());
    req.metadata_mut().insert(header, sent.parse().unwrap());
    let status = bounded("CreateMachine", machines.create_machine(req)).await.unwrap_err();
    assert_eq!(status.metadata().get(header).and_then(|v| v.to_str().ok()), Some(sent.as_str()));
    let report = ErrorReport::from_status(&status);
    assert_eq!((report.code, report.reason.as_str()), (Code::InvalidArgument, reason::FIELD_REQUIRED));
    assert_eq!(report.request_id, sent);
    assert_eq!(report.domain, DOMAIN);
    let fields: Vec<&str> = report.violations.iter().map(|v| v.field.as_str()).collect();
    assert_eq!(fields, ["name", "provider_spec"]);

    // The protocol's codes and reasons for the rest.
    let e = bounded("GetPool", client.get_pool(pb::GetPoolRequest { name: "p".into(), ..Default::default() }))
        .await
        .unwrap_err();
    assert_eq!((e.code(), e.reason()), (Code::Unimplemented, reason::CAPABILITY_NOT_SUPPORTED), "{e}");
    let missing = pb::GetMachineStatusRequest { name: "nobody".into(), ..Default::default() };
    let e = bounded("GetMachineStatus", client.get_machine_status(missing)).await.unwrap_err();
    assert_eq!((e.code(), e.reason()), (Code::NotFound, reason::MACHINE_NOT_FOUND), "{e}");

    // A running create (10 s latency) and its token: tampered, it is refused with BadRequest.
    let create = pb::CreateMachineRequest {
        name: "m1".into(),
        provider_spec: Some(json_to_struct(&json!({"size": "small"}))),
        ..Default::default()
    };
    let op = bounded("CreateMachine", client.create_machine(create.clone())).await.unwrap().value;
    assert!(!op.done && !op.token.is_empty(), "{op:?}");
    let again = bounded("CreateMachine", client.create_machine(create)).await.unwrap().value;
    assert_eq!(again.name, op.name, "a repeated create did not return the operation in flight");
    let mut tampered = op.token.clone();
    let last = tampered.len() - 1;
    tampered[last] ^= 1;
    let e = bounded("GetOperation", client.get_operation(pb::GetOperationRequest { token: tampered, secrets: None }))
        .await
        .unwrap_err();
    assert_eq!((e.code(), e.reason()), (Code::InvalidArgument, reason::OPERATION_TOKEN_INVALID), "{e}");
    assert!(e.report.violations.iter().any(|v| v.field == "token"), "{e}");

    // A delete overtakes the create: the create's next poll is done with Operation.error,
    // whose details name the poll's request ID.
    let del = pb::DeleteMachineRequest { name: "m1".into(), ..Default::default() };
    let del = bounded("DeleteMachine", client.delete_machine(del)).await.unwrap().value;
    let poll =
        bounded("GetOperation", client.get_operation(pb::GetOperationRequest { token: op.token, secrets: None }))
            .await
            .unwrap();
    assert!(poll.value.done, "{:?}", poll.value);
    let err = poll.value.error_report().expect("Operation.error");
    assert_eq!((err.code, err.reason.as_str()), (Code::Cancelled, reason::OPERATION_CANCELLED), "{err}");
    assert_eq!(err.domain, DOMAIN);
    assert_eq!(err.request_id, poll.request_id);
    // The delete finishes after its poll.
    let deleted = eventually(MINUTE, "the delete done", || {
        let (client, token) = (client.clone(), del.token.clone());
        async move {
            let op = bounded("GetOperation", client.get_operation(pb::GetOperationRequest { token, secrets: None }))
                .await
                .ok()?
                .value;
            op.done.then_some(op)
        }
    })
    .await;
    assert!(deleted.error_report().is_none(), "{deleted:?}");
    stop(sidecar).await;
}
