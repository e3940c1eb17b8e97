//! The fake driver sidecar and the minimal example, as real processes on Unix sockets, driven
//! by `DriverClient`, `driver-conformance` and real grpcurl.

use std::collections::HashMap;
use std::time::Duration;

use driver_sdk::proto as pb;
use driver_sdk::{reason, OperationExt};
use e2e_tests::{bin, eventually, grpcurl, http_get, run, Sidecar};
use fake_driver::pb as fake;
use serde_json::{json, Value};
use tonic::Code;

const FAST: &[&str] =
    &["--create-latency", "300ms", "--delete-latency", "200ms", "--update-latency", "200ms", "--pool-latency", "300ms"];

fn spec(v: Value) -> Option<driver_sdk::prost_types::Struct> {
    Some(driver_sdk::convert::json_to_struct(&v))
}

fn create(name: &str) -> pb::CreateMachineRequest {
    pb::CreateMachineRequest {
        name: name.into(),
        provider_spec: spec(json!({"machineType": "small"})),
        labels: HashMap::from([("owner".to_string(), "e2e".to_string())]),
        ..Default::default()
    }
}

/// Polls GetOperation (at the driver's poll_after, at most 200 ms) until the operation is done.
async fn wait_done(client: &driver_sdk::DriverClient, op: pb::Operation) -> pb::Operation {
    e2e_tests::wait_done(client, op, None, Duration::from_secs(30), Duration::from_millis(200)).await
}

/// `--event-trigger` for the fake: grpcurl asks its cloud for a spot interruption on the
/// conformance suite's machine (as an operator would by hand).
fn event_trigger(sidecar: &Sidecar) -> String {
    format!(
        r#"'{}' -plaintext -unix -d "{{\"machine\":\"$MACHINE_NAME\",\"kind\":\"SPOT_INTERRUPTION\",\"notice\":\"20s\"}}" '{}' fakecloud.v1.FakeCloud/InjectEvent"#,
        grpcurl().display(),
        sidecar.socket.display()
    )
}

#[tokio::test]
async fn conformance_passes_against_the_fake_driver() {
    let sidecar = Sidecar::start("fake-driver", FAST).await;
    let trigger = event_trigger(&sidecar);
    let args = ["--endpoint", &sidecar.endpoint(), "--event-trigger", &trigger];
    let (code, out, err) = run(&bin("driver-conformance"), &args).await;
    assert_eq!(code, 0, "conformance failed:\n{out}\n{err}");
    assert!(out.lines().any(|l| l.ends_with(" passed, 0 failed, 0 skipped")), "{out}");
    // Every capability group ran: pools and in-place update included.
    for check in [
        "pools.delete_one_instance",
        "in_place.update_machine",
        "in_place.disruption",
        "machines.validate_machine_class",
        "events.keepalive_on_an_idle_stream_and_resume_after_cancel",
        "events.unknown_ack_reported_twice_alike",
        "events.redelivered_until_acked_resumed_and_acked_once",
    ] {
        assert!(out.contains(&format!("PASS  {check}")), "{check} did not pass:\n{out}");
    }
    let inspect = fake_client(&sidecar).await.inspect(fake::InspectRequest::default()).await.unwrap().into_inner();
    assert!(inspect.machines.is_empty() && inspect.pools.is_empty(), "conformance left things behind: {inspect:?}");
}

#[tokio::test]
async fn conformance_warns_but_passes_when_an_in_place_plan_states_no_disruption() {
    // The fake playing a driver older than CanUpdateMachineResponse.disruption: legal, so the
    // run succeeds, with one WARN line.
    let sidecar = Sidecar::start("fake-driver", FAST).await;
    // The schema's second example, saying Unset.
    let alt = r#"{"machineType": "medium", "zone": "zone-a", "image": "fake-os-1", "tags": {"tier": "web"},
                  "inPlaceDisruption": "Unset"}"#;
    let trigger = event_trigger(&sidecar);
    let args = ["--endpoint", &sidecar.endpoint(), "--alt-provider-spec", alt, "--event-trigger", &trigger];
    let (code, out, err) = run(&bin("driver-conformance"), &args).await;
    assert_eq!(
        code, 0,
        "a warning is no failure:
{out}
{err}"
    );
    let warned: Vec<&str> = out.lines().filter(|l| l.starts_with("WARN")).collect();
    assert_eq!(warned.len(), 1, "{out}");
    assert!(warned[0].starts_with("WARN  in_place.disruption") && warned[0].contains("REBOOT"), "{out}");
    assert!(out.contains("PASS  in_place.update_machine"), "{out}");
    assert!(out.lines().any(|l| l.ends_with(" passed, 0 failed, 0 skipped, 1 warned")), "{out}");
}

#[tokio::test]
async fn conformance_passes_against_the_minimal_example() {
    let sidecar = Sidecar::start("minimal_driver", &["--dev"]).await;
    let (code, out, err) = run(&bin("driver-conformance"), &["--endpoint", &sidecar.endpoint()]).await;
    assert_eq!(code, 0, "conformance failed:\n{out}\n{err}");
    assert!(out.contains(" passed, 0 failed"), "{out}");
}

#[tokio::test]
async fn conformance_reports_failures_and_exits_non_zero() {
    // Against a driver that rejects every call (wrong API key), checks fail and the exit code says so.
    let sidecar = Sidecar::start("fake-driver", &["--api-key", "the-right-key"]).await;
    let (code, out, _) = run(&bin("driver-conformance"), &["--endpoint", &sidecar.endpoint()]).await;
    assert_ne!(code, 0, "{out}");
    let last = out.lines().last().unwrap_or_default();
    assert!(last.contains(" passed, ") && !last.contains(" 0 failed"), "{out}");
}

async fn fake_client(s: &Sidecar) -> fake::fake_cloud_client::FakeCloudClient<tonic::transport::Channel> {
    fake::fake_cloud_client::FakeCloudClient::new(s.client().await.channel())
}

#[tokio::test]
async fn grpcurl_lists_describes_and_drives_an_operation() {
    let sidecar = Sidecar::start("fake-driver", FAST).await;
    let g = grpcurl();
    let sock = sidecar.socket.to_str().unwrap().to_string();
    let grpc = |args: Vec<String>| {
        let g = g.clone();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            run(&g, &args).await
        }
    };
    let base = |rest: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ["-plaintext", "-unix"].iter().map(|s| s.to_string()).collect();
        v.extend(rest.iter().map(|s| s.to_string()));
        v
    };

    let (code, out, err) = grpc(base(&[&sock, "list"])).await;
    assert_eq!(code, 0, "{err}");
    for svc in [
        "machinedriver.v1.Identity",
        "machinedriver.v1.Machines",
        "machinedriver.v1.Pools",
        "machinedriver.v1.Events",
        "machinedriver.v1.Operations",
        "grpc.health.v1.Health",
    ] {
        assert!(out.lines().any(|l| l == svc), "{svc} not listed:\n{out}");
    }

    let (code, out, err) = grpc(base(&[&sock, "describe", "machinedriver.v1.Machines.CreateMachine"])).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("rpc CreateMachine"), "{out}");

    let (code, out, err) = grpc(base(&[&sock, "machinedriver.v1.Identity/GetDriverInfo"])).await;
    assert_eq!(code, 0, "{err}");
    let info: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(info["name"], "fake.machinedriver.dev");
    assert_eq!(info["protocolVersion"], "v1");

    // CreateMachine, then GetOperation with the returned token until done.
    let body = r#"{"name":"grpcurl-1","provider_spec":{"machineType":"small"}}"#;
    let (code, out, err) = grpc(base(&[
        "-H",
        "x-request-id: e2e-grpcurl-1",
        "-v",
        "-d",
        body,
        &sock,
        "machinedriver.v1.Machines/CreateMachine",
    ]))
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("x-request-id: e2e-grpcurl-1"), "request ID not echoed:\n{out}");
    let json_start = out.find("Response contents:").map(|i| i + "Response contents:".len()).unwrap();
    let json_end = out.find("Response trailers received:").unwrap();
    let op: Value = serde_json::from_str(out[json_start..json_end].trim()).unwrap();
    let token = op["token"].as_str().unwrap().to_string();
    let done: Value = eventually(Duration::from_secs(20), "grpcurl GetOperation done", || {
        let args =
            base(&["-d", &format!(r#"{{"token":"{token}"}}"#), &sock, "machinedriver.v1.Operations/GetOperation"]);
        async move {
            let (code, out, _) = grpc(args).await;
            let v: Value = serde_json::from_str(&out).ok()?;
            (code == 0 && v["done"] == true).then_some(v)
        }
    })
    .await;
    assert_eq!(done["response"]["machine"]["name"], "grpcurl-1");
    assert_eq!(done["response"]["machine"]["state"], "MACHINE_STATE_RUNNING");

    // An invalid request shows its error details.
    let bad = r#"{"name":"Bad_Name","provider_spec":{"machineType":"huge"}}"#;
    let (code, out, err) = grpc(base(&["-d", bad, &sock, "machinedriver.v1.Machines/CreateMachine"])).await;
    assert_ne!(code, 0);
    let text = format!("{out}{err}");
    for needle in [
        "InvalidArgument",
        "google.rpc.ErrorInfo",
        "FIELD_INVALID",
        "google.rpc.BadRequest",
        "provider_spec.machineType",
        "google.rpc.RequestInfo",
    ] {
        assert!(text.contains(needle), "{needle} missing from grpcurl's error output:\n{text}");
    }

    // Health through the standard service.
    let (code, out, err) = grpc(base(&[&sock, "grpc.health.v1.Health/Check"])).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("SERVING"), "{out}");
}

#[tokio::test]
async fn client_creates_and_polls_with_request_ids_and_typed_errors() {
    let sidecar = Sidecar::start("fake-driver", FAST).await;
    let client = sidecar.client().await;
    let reply = client.create_machine(create("client-1")).await.unwrap();
    assert!(!reply.request_id.is_empty());
    assert!(!reply.value.done, "the fake create takes 300 ms");
    let done = wait_done(&client, reply.value).await;
    let m = done.machine().expect("machine");
    assert_eq!(m.state, pb::MachineState::Running as i32);
    assert!(m.provider_id.starts_with("fake:///zone-a/"));
    assert!(m.addresses.iter().any(|a| a.r#type == "InternalIP"));
    assert!(m.resources.iter().any(|r| r.kind == "nic"));

    let err = client
        .get_machine_status(pb::GetMachineStatusRequest { name: "nope".into(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    assert_eq!(err.reason(), reason::MACHINE_NOT_FOUND);
    assert_eq!(err.report.domain, "fake.machinedriver.dev");
    assert!(!err.request_id().is_empty());
    // The request ID is in the sidecar's log line for that call.
    let id = err.request_id().to_string();
    eventually(Duration::from_secs(5), "request ID in the sidecar log", || {
        let found = sidecar.log_text().contains(&id);
        async move { found.then_some(()) }
    })
    .await;
}

#[tokio::test]
async fn sidecar_restart_mid_operation_resumes_from_the_stored_token() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("cloud.json");
    let state_arg = state.to_str().unwrap().to_string();
    let args = ["--create-latency", "1500ms", "--state-file", state_arg.as_str()];
    let sidecar = Sidecar::start_in(dir, "fake-driver", &args).await;
    let op = sidecar.client().await.create_machine(create("survivor")).await.unwrap().value;
    assert!(!op.done);
    let stored_token = op.token.clone();

    // Crash the sidecar mid-operation, then start a new one on the same socket and state.
    let dir = sidecar.kill9().await;
    let sidecar = Sidecar::start_in(dir, "fake-driver", &args).await;
    let client = sidecar.client().await;
    let resumed = client
        .get_operation(pb::GetOperationRequest { token: stored_token.clone(), secrets: None })
        .await
        .unwrap()
        .value;
    assert_eq!(resumed.name, op.name, "the restarted driver found the same operation");
    let done = wait_done(&client, resumed).await;
    assert_eq!(done.machine().map(|m| m.name.as_str()), Some("survivor"));
    assert!(done.error_report().is_none());

    let inspect = fake_client(&sidecar).await.inspect(fake::InspectRequest::default()).await.unwrap().into_inner();
    assert_eq!(inspect.counters.unwrap().machines_created, 1, "created exactly once");
    assert_eq!(inspect.machines.len(), 1);
    assert_eq!(inspect.machines[0].times_created, 1);
}

#[tokio::test]
async fn forged_foreign_and_tampered_tokens_are_refused() {
    let fake_sidecar = Sidecar::start("fake-driver", FAST).await;
    let minimal = Sidecar::start("minimal_driver", &["--dev"]).await;
    let fake_client = fake_sidecar.client().await;
    let minimal_client = minimal.client().await;
    let foreign = minimal_client
        .create_machine(pb::CreateMachineRequest {
            name: "m".into(),
            provider_spec: spec(json!({"size": "small"})),
            ..Default::default()
        })
        .await
        .unwrap()
        .value
        .token;
    let mut tampered = fake_client.create_machine(create("t-1")).await.unwrap().value.token;
    let last = tampered.len() - 1;
    tampered[last] ^= 0x40;
    for token in [foreign, tampered, b"forged".to_vec()] {
        let err = fake_client.get_operation(pb::GetOperationRequest { token, secrets: None }).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert_eq!(err.reason(), reason::OPERATION_TOKEN_INVALID);
    }
}

#[tokio::test]
async fn sigterm_drains_and_removes_the_socket() {
    let sidecar = Sidecar::start("fake-driver", FAST).await;
    let socket = sidecar.socket.clone();
    let (status, _dir) = sidecar.terminate().await;
    assert!(status.success(), "exit status after SIGTERM: {status}");
    assert!(!socket.exists(), "socket left behind");
}

#[tokio::test]
async fn stale_socket_is_replaced_and_a_live_one_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("driver.sock");
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    assert!(path.exists(), "a stale socket file is left by a dead listener");
    let sidecar = Sidecar::start_in(dir, "fake-driver", FAST).await;
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&sidecar.socket).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o660);

    let (code, _, err) = run(&bin("fake-driver"), &["--endpoint", &sidecar.endpoint()]).await;
    assert_ne!(code, 0);
    assert!(err.contains("already serving"), "{err}");
}

#[tokio::test]
async fn startup_errors_are_clear() {
    let dir = tempfile::tempdir().unwrap();
    let sock = format!("unix://{}/d.sock", dir.path().display());
    let (code, _, err) = run(&bin("fake-driver"), &["--endpoint", &sock, "--production"]).await;
    assert_ne!(code, 0);
    assert!(err.contains("no operation token key") && err.contains("--token-key-file"), "{err}");
    let (code, _, err) = run(&bin("fake-driver"), &["--endpoint", "http://x:1"]).await;
    assert_ne!(code, 0);
    assert!(err.contains("invalid endpoint") && err.contains("unix:///"), "{err}");
    let key = dir.path().join("key");
    std::fs::write(&key, "short").unwrap();
    let (code, _, err) =
        run(&bin("fake-driver"), &["--endpoint", &sock, "--production", "--token-key-file", key.to_str().unwrap()])
            .await;
    assert_ne!(code, 0);
    assert!(err.contains("at least 16"), "{err}");
}

#[tokio::test]
async fn faults_quota_and_throttling_come_back_typed() {
    let sidecar =
        Sidecar::start("fake-driver", &["--max-machines", "1", "--rate-limit", "1000", "--burst", "1000"]).await;
    let client = sidecar.client().await;
    client.create_machine(create("q-1")).await.unwrap();
    let err = client.create_machine(create("q-2")).await.unwrap_err();
    assert_eq!((err.code(), err.reason()), (Code::ResourceExhausted, reason::QUOTA_EXCEEDED));

    let mut fc = fake_client(&sidecar).await;
    let rule = |action: &str, code: &str, times| fake::FaultRule {
        rpc: "GetMachineStatus".into(),
        target: "q-*".into(),
        action: action.into(),
        code: code.into(),
        retry_after_ms: 750,
        times,
        ..Default::default()
    };
    fc.set_faults(fake::SetFaultsRequest { rules: vec![rule("error", "UNAVAILABLE", 1)] }).await.unwrap();
    let status = |name: &str| pb::GetMachineStatusRequest { name: name.into(), ..Default::default() };
    let err = client.get_machine_status(status("q-1")).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    assert_eq!(err.reason(), fake_driver::FAULT_INJECTED);
    assert_eq!(err.retry_after(), Some(Duration::from_millis(750)));
    client.get_machine_status(status("q-1")).await.expect("the rule fired its one time");

    // A bad rule is refused with the field named.
    let bad = fc.set_faults(fake::SetFaultsRequest { rules: vec![rule("explode", "", 0)] }).await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);
    assert!(bad.message().contains("rules[0].action"), "{}", bad.message());

    // Dropping the connection: the call fails as a transport error, the next call reconnects.
    fc.set_faults(fake::SetFaultsRequest { rules: vec![rule("drop_connection", "", 1)] }).await.unwrap();
    let err = client.get_machine_status(status("q-1")).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    eventually(Duration::from_secs(10), "reconnect after a dropped connection", || {
        let client = client.clone();
        async move { client.get_machine_status(status("q-1")).await.ok() }
    })
    .await;

    // Exit: the sidecar dies, as a crash would.
    fc.set_faults(fake::SetFaultsRequest { rules: vec![rule("exit", "", 1)] }).await.unwrap();
    let _ = client.get_machine_status(status("q-1")).await;
    let mut sidecar = sidecar;
    let exit = tokio::time::timeout(Duration::from_secs(10), sidecar.child.wait()).await.unwrap().unwrap();
    assert_eq!(exit.code(), Some(3));
}

#[tokio::test]
async fn throttling_carries_retry_info() {
    let sidecar = Sidecar::start("fake-driver", &["--rate-limit", "0.5", "--burst", "2"]).await;
    let client = sidecar.client().await;
    let mut throttled = None;
    for i in 0..5 {
        if let Err(e) = client
            .get_machine_status(pb::GetMachineStatusRequest { name: format!("x-{i}"), ..Default::default() })
            .await
        {
            if e.reason() == reason::THROTTLED {
                throttled = Some(e);
                break;
            }
        }
    }
    let e = throttled.expect("a throttled call");
    assert_eq!(e.code(), Code::Unavailable);
    assert!(e.retry_after().is_some_and(|d| d > Duration::ZERO));
}

#[tokio::test]
async fn secrets_never_reach_logs_or_errors() {
    let sidecar = Sidecar::start("fake-driver", &["--api-key", "correct-horse-battery"]).await;
    let client = sidecar.client().await;
    let secret = "wrong-but-secret-value-42";
    let mut req = create("s-1");
    req.secrets = Some(pb::Secrets { data: HashMap::from([("apiKey".to_string(), secret.to_string())]) });
    let err = client.create_machine(req.clone()).await.unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied);
    assert_eq!(err.reason(), reason::CLOUD_AUTH_FAILED);
    assert!(!format!("{err:?} {err}").contains(secret));
    assert!(!format!("{req:?}").contains(secret), "Debug of a request shows the secret");
    req.secrets =
        Some(pb::Secrets { data: HashMap::from([("apiKey".to_string(), "correct-horse-battery".to_string())]) });
    client.create_machine(req).await.expect("the right key is accepted");
    let log = sidecar.log_text();
    assert!(!log.contains(secret) && !log.contains("correct-horse-battery"), "secret in the sidecar log:\n{log}");
}

#[tokio::test]
async fn metrics_and_health_endpoints_report_rpcs() {
    let sidecar = Sidecar::start("fake-driver", &["--metrics-addr", "127.0.0.1:0"]).await;
    let port = sidecar.metrics_addr().await.port();
    let client = sidecar.client().await;
    client.get_driver_info(pb::GetDriverInfoRequest {}).await.unwrap();
    let _ = client.get_machine_status(pb::GetMachineStatusRequest { name: "none".into(), ..Default::default() }).await;
    let (status, body) = eventually(Duration::from_secs(10), "metrics", || http_get(port, "/metrics")).await;
    assert_eq!(status, 200);
    assert!(body.contains(r#"driver_rpc_requests_total{method="GetDriverInfo",code="OK"}"#), "{body}");
    assert!(body.contains(r#"driver_rpc_requests_total{method="GetMachineStatus",code="NOT_FOUND"}"#), "{body}");
    assert!(body.contains("driver_rpc_duration_seconds_bucket"), "{body}");
    let (status, _) = http_get(port, "/readyz").await.unwrap();
    assert_eq!(status, 200);
    let (status, _) = http_get(port, "/healthz").await.unwrap();
    assert_eq!(status, 200);
}

/// Calls `path` with `grpc-timeout: 300m` over raw HTTP/2, with no deadline of the caller's own
/// (tonic's Channel and every gRPC stack would also give up locally), so the answer is the
/// server's. Returns the status and how long the answer took.
async fn call_with_server_deadline(
    socket: &std::path::Path,
    path: &str,
    message: &impl driver_sdk::prost::Message,
    request_id: &str,
) -> (tonic::Status, Duration) {
    use http_body_util::{BodyExt, Full};
    let stream = tokio::net::UnixStream::connect(socket).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    let connection = tokio::spawn(conn);
    let bytes = message.encode_to_vec();
    let mut frame = vec![0u8];
    frame.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    frame.extend_from_slice(&bytes);
    let req = http::Request::post(format!("http://localhost{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("grpc-timeout", "300m")
        .header("x-request-id", request_id)
        .body(Full::new(hyper::body::Bytes::from(frame)))
        .unwrap();
    let started = std::time::Instant::now();
    let answer = async {
        let resp = send.send_request(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        let collected = body.collect().await.unwrap();
        let trailers = collected.trailers().cloned().unwrap_or_default();
        // Errors come trailers-only: the status is in the headers.
        let status = tonic::Status::from_header_map(&parts.headers)
            .or_else(|| tonic::Status::from_header_map(&trailers))
            .expect("a grpc-status");
        (status, started.elapsed())
    };
    let out = tokio::time::timeout(Duration::from_secs(5), answer).await.expect("the server answered at the deadline");
    connection.abort();
    out
}

#[tokio::test]
async fn every_rpc_stops_at_the_callers_deadline_with_details() {
    let sidecar = Sidecar::start("fake-driver", &["--metrics-addr", "127.0.0.1:0"]).await;
    let port = sidecar.metrics_addr().await.port();
    let mut fc = fake_client(&sidecar).await;
    let delay = |rpc: &str| fake::FaultRule {
        rpc: rpc.into(),
        target: "*".into(),
        action: "delay".into(),
        latency_ms: 10_000,
        ..Default::default()
    };
    fc.set_faults(fake::SetFaultsRequest { rules: vec![delay("GetMachineStatus"), delay("CreateMachine")] })
        .await
        .unwrap();
    let socket = sidecar.endpoint().trim_start_matches("unix://").to_string();
    let socket = std::path::Path::new(&socket);
    let status_req = pb::GetMachineStatusRequest { name: "slow".into(), ..Default::default() };
    for (n, (path, status_and_time)) in [
        (
            "/machinedriver.v1.Machines/GetMachineStatus",
            call_with_server_deadline(socket, "/machinedriver.v1.Machines/GetMachineStatus", &status_req, "deadline-0")
                .await,
        ),
        (
            "/machinedriver.v1.Machines/CreateMachine",
            call_with_server_deadline(
                socket,
                "/machinedriver.v1.Machines/CreateMachine",
                &create("slow"),
                "deadline-1",
            )
            .await,
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let (status, took) = status_and_time;
        assert_eq!(status.code(), Code::DeadlineExceeded, "{path}: {status:?}");
        assert!(took >= Duration::from_millis(250) && took < Duration::from_secs(3), "{path}: answered after {took:?}");
        let report = driver_sdk::ErrorReport::from_status(&status);
        assert_eq!(report.reason, reason::DEADLINE_EXCEEDED, "{path}");
        assert_eq!(report.domain, fake_driver::DRIVER_NAME, "{path}");
        assert_eq!(report.request_id, format!("deadline-{n}"), "{path}");
        assert!(report.message.contains("300 ms"), "{path}: {}", report.message);
    }
    let log = sidecar.log_text();
    for n in 0..2 {
        assert!(log.lines().any(|l| l.contains(&format!("deadline-{n}")) && l.contains("DeadlineExceeded")), "{log}");
    }
    // The calls are over on the server too: nothing in flight, both counted as DEADLINE_EXCEEDED.
    let body = eventually(Duration::from_secs(10), "metrics after the deadlines", || async {
        let (_, body) = http_get(port, "/metrics").await?;
        (body.contains("driver_rpc_in_flight 0")
            && body.contains(r#"driver_rpc_requests_total{method="CreateMachine",code="DEADLINE_EXCEEDED"} 1"#))
        .then_some(body)
    })
    .await;
    assert!(
        body.contains(r#"driver_rpc_requests_total{method="GetMachineStatus",code="DEADLINE_EXCEEDED"} 1"#),
        "{body}"
    );
    // Nothing was created behind the caller's back.
    let inspect = fc.inspect(fake::InspectRequest::default()).await.unwrap().into_inner();
    assert!(inspect.machines.is_empty(), "{inspect:?}");
}

/// The next event on a stream (keepalives passed over), within 20 s.
async fn next_event(stream: &mut tonic::Streaming<pb::WatchEventsResponse>) -> pb::MachineEvent {
    let read = async {
        loop {
            match stream.message().await.expect("the stream failed").expect("the stream ended") {
                pb::WatchEventsResponse { item: Some(pb::watch_events_response::Item::Event(e)) } => return e,
                _ => continue,
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(20), read).await.expect("an event within 20 s")
}

fn watch(resume_token: &str, ack_deadline: Duration) -> pb::WatchEventsRequest {
    pb::WatchEventsRequest {
        resume_token: resume_token.into(),
        keepalive_interval: Some(driver_sdk::convert::duration(Duration::from_secs(1))),
        ack_deadline: Some(driver_sdk::convert::duration(ack_deadline)),
    }
}

#[tokio::test]
async fn an_event_is_redelivered_until_acked_and_replayed_after_a_kill_9_of_the_sidecar() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("cloud.json");
    let state_arg = state.to_str().unwrap().to_string();
    let args = ["--create-latency", "50ms", "--state-file", state_arg.as_str()];
    let sidecar = Sidecar::start_in(dir, "fake-driver", &args).await;
    let client = sidecar.client().await;
    let caps = client.get_capabilities(pb::GetCapabilitiesRequest {}).await.unwrap().value;
    assert!(caps.capabilities.contains(&(pb::Capability::Events as i32)), "{caps:?}");
    let mut spot = create("spot-0");
    spot.provider_spec = spec(json!({"machineType": "small", "zone": "zone-b", "capacityType": "spot"}));
    let op = client.create_machine(spot).await.unwrap().value;
    let machine = wait_done(&client, op).await.machine().cloned().expect("a machine");

    let mut stream = client.watch_events(watch("", Duration::from_secs(1))).await.unwrap().value;
    let notice = driver_sdk::prost_types::Duration { seconds: 20, nanos: 0 };
    let injected = fake_client(&sidecar)
        .await
        .inject_event(fake::InjectEventRequest {
            machine: "spot-0".into(),
            kind: "SPOT_INTERRUPTION".into(),
            notice: Some(notice),
            message: "capacity reclaimed".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .event_id;
    let first = next_event(&mut stream).await;
    assert_eq!(first.event_id, injected);
    assert_eq!((first.machine_name.as_str(), first.provider_id.as_str()), ("spot-0", machine.provider_id.as_str()));
    assert_eq!(first.kind, pb::MachineEventKind::SpotInterruption as i32);
    assert_eq!(first.action, pb::CloudAction::Terminate as i32);
    assert_eq!(first.delivery_attempt, 1);
    let offering = first.offering.clone().unwrap();
    assert_eq!(
        (offering.zone.as_str(), offering.machine_type.as_str(), offering.capacity_type),
        ("zone-b", "small", pb::CapacityType::Spot as i32)
    );
    let (not_before, observed) = (first.not_before.unwrap(), first.observed_at.unwrap());
    assert!((19..=21).contains(&(not_before.seconds - observed.seconds)), "{first:?}");

    // Not acknowledged: the same event again after the ack deadline (1 s).
    let again = next_event(&mut stream).await;
    assert_eq!((again.event_id.as_str(), again.delivery_attempt), (injected.as_str(), 2));

    // kill -9 before the ack: the restarted sidecar streams it again, from its state file.
    drop(stream);
    let dir = sidecar.kill9().await;
    let sidecar = Sidecar::start_in(dir, "fake-driver", &args).await;
    let client = sidecar.client().await;
    // The old process's resume token means nothing to the new one: everything pending comes.
    let mut stream = client.watch_events(watch(&again.resume_token, Duration::from_secs(60))).await.unwrap().value;
    let replayed = next_event(&mut stream).await;
    assert_eq!((replayed.event_id.as_str(), replayed.delivery_attempt), (injected.as_str(), 1));

    // Acknowledged: gone from the cloud, and a second ack reports it unknown.
    let acked = client.ack_events(pb::AckEventsRequest { event_ids: vec![injected.clone()] }).await.unwrap().value;
    assert_eq!(acked.acked_event_ids, std::slice::from_ref(&injected));
    let twice = client.ack_events(pb::AckEventsRequest { event_ids: vec![injected.clone()] }).await.unwrap().value;
    assert_eq!((twice.acked_event_ids.len(), twice.unknown_event_ids), (0, vec![injected.clone()]));
    let saved: Value = serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
    assert_eq!(saved["events"], json!({}), "the acknowledged event is still in the cloud: {saved}");

    // A second event on the same stream comes next: the acknowledged one never again.
    let second = fake_client(&sidecar)
        .await
        .inject_event(fake::InjectEventRequest {
            machine: "spot-0".into(),
            kind: "MACHINE_EVENT_KIND_TERMINATED".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .event_id;
    let next = next_event(&mut stream).await;
    assert_eq!(next.event_id, second);
    assert_eq!(next.not_before, None, "an event without notice has no deadline");

    // Bad input is named.
    let err = fake_client(&sidecar)
        .await
        .inject_event(fake::InjectEventRequest {
            machine: "spot-0".into(),
            kind: "EVICTED".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("EVICTED") && err.message().contains("SPOT_INTERRUPTION"), "{err:?}");
    let err = fake_client(&sidecar)
        .await
        .inject_event(fake::InjectEventRequest { machine: "nope".into(), kind: "STOPPED".into(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
}
