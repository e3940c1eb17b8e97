//! Client stacks nobody here wrote, against our sidecars over the Unix socket and over TCP:
//! Python `grpcio`, Node `@grpc/grpc-js`, grpc-go (a `unix:///` target and the kubelet/CSI
//! `Dial(path)` + unix dialer) and grpcurl. `tests/tools/install-interop.sh` installs the first
//! three from their registries (pinned) and `cargo xtask install` exports `INTEROP_DIR`; the clients
//! live in `tests/interop/` and share one command-line contract (see any of them).
//!
//! Each client, on each transport: health → SERVING, `GetDriverInfo` → the driver's name,
//! `CreateMachine` with an `x-request-id` it chose and gets back in the response headers (fake
//! driver), and an invalid request (empty name) → `INVALID_ARGUMENT` whose
//! `grpc-status-details-bin` decodes to ErrorInfo + RequestInfo + BadRequest. One test per
//! (client, sidecar), so a failure names both; every transport runs before a test fails, and the
//! failure lists each one that failed.

use std::path::{Path, PathBuf};
use std::time::Duration;

use e2e_tests::{grpcurl, run, Driver, Emulator, Sidecar};
use fake_driver::pb as fake;
use serde_json::{json, Value};

const FAKE: &str = "fake.machinedriver.dev";
const AWS: &str = "aws-ec2.machinedriver.dev";
const AZURE: &str = "azure-vmss.machinedriver.dev";

#[derive(Clone, Copy, Debug)]
enum Client {
    Python,
    Node,
    Go,
    Grpcurl,
}

impl Client {
    fn name(self) -> &'static str {
        match self {
            Client::Python => "python-grpcio",
            Client::Node => "node-grpc-js",
            Client::Go => "go-grpc",
            Client::Grpcurl => "grpcurl",
        }
    }

    /// The launcher `install-interop.sh` made for this client.
    fn launcher(self) -> PathBuf {
        let file = match self {
            Client::Python => "python-client",
            Client::Node => "node-client",
            Client::Go => "go-client",
            Client::Grpcurl => unreachable!("grpcurl is driven from here"),
        };
        let how = "run `cargo xtask e2e`, or `export INTEROP_DIR=\"$(bash tests/tools/install-interop.sh)\"` \
                   before `cargo test -p e2e-tests --test e2e interop::`";
        let dir = std::env::var_os("INTEROP_DIR").unwrap_or_else(|| panic!("INTEROP_DIR is not set: {how}"));
        let p = Path::new(&dir).join(file);
        assert!(p.exists(), "{} is missing from INTEROP_DIR: {how}", p.display());
        p
    }
}

/// How a client reaches the sidecar: (label, client arguments).
#[derive(Clone, Debug)]
struct Transport {
    label: &'static str,
    args: Vec<String>,
}

/// The same driver served on a Unix socket and on TCP (two processes).
struct Sidecars {
    unix: Sidecar,
    tcp: Sidecar,
}

impl Sidecars {
    fn transports(&self, client: Client) -> Vec<Transport> {
        let socket = self.unix.socket.display().to_string();
        let addr = self.tcp.tcp.clone().expect("a TCP sidecar");
        let t = |label, args: &[&str]| Transport { label, args: args.iter().map(|s| s.to_string()).collect() };
        match client {
            Client::Python | Client::Node => {
                vec![t("unix:///", &["--target", &format!("unix://{socket}")]), t("tcp", &["--target", &addr])]
            }
            Client::Go => vec![
                t("unix:///", &["--target", &format!("unix://{socket}")]),
                t("Dial(path)+unix dialer", &["--dial-path", &socket]),
                t("tcp", &["--target", &addr]),
            ],
            Client::Grpcurl => vec![t("-unix", &["-unix", &socket]), t("tcp", &[&addr])],
        }
    }

    fn logs(&self) -> String {
        format!("--- unix sidecar log:\n{}\n--- tcp sidecar log:\n{}", self.unix.log_text(), self.tcp.log_text())
    }
}

/// What one run checks, beyond what every client checks by itself.
struct Expect {
    driver: &'static str,
    /// A valid CreateMachineRequest (protobuf JSON, `name` filled in per run), if the driver
    /// creates machines without a cloud.
    create: Option<Value>,
    /// The RPC sent with an empty name: `CreateMachine`, or `ApplyPool` for pool-only drivers.
    invalid_rpc: &'static str,
}

/// Runs `client` over every transport; returns the machine names it created.
async fn exercise(client: Client, sidecars: &Sidecars, expect: &Expect) -> Vec<String> {
    let mut failures = Vec::new();
    let mut created = Vec::new();
    for (i, transport) in sidecars.transports(client).into_iter().enumerate() {
        let request_id = format!("interop-{}-{i}-{}", client.name(), uuid::Uuid::new_v4().simple());
        let name = format!("interop-{}-{i}", client.name());
        let create = expect.create.clone().map(|mut c| {
            c["name"] = json!(name);
            c
        });
        let result = match client {
            Client::Grpcurl => grpcurl_client(&transport, &request_id, create.as_ref(), expect.invalid_rpc).await,
            _ => run_client(client, &transport, &request_id, create.as_ref(), expect.invalid_rpc).await,
        };
        match result.and_then(|s| check_summary(&s, expect, &request_id, create.is_some())) {
            Ok(()) => {
                if create.is_some() {
                    created.push(name);
                }
            }
            Err(e) => failures.push(format!("{} over {}: {e}", client.name(), transport.label)),
        }
    }
    assert!(failures.is_empty(), "{}\n{}", failures.join("\n"), sidecars.logs());
    created
}

/// The checks on a client's JSON summary that need to know the driver.
fn check_summary(s: &Value, expect: &Expect, request_id: &str, created: bool) -> Result<(), String> {
    let want = |ok: bool, what: String| if ok { Ok(()) } else { Err(format!("{what}; summary: {s}")) };
    want(s["health"] == "SERVING", "health is not SERVING".into())?;
    want(s["driver"] == expect.driver, format!("GetDriverInfo name is not {}", expect.driver))?;
    if created {
        want(s["create"]["echoed_request_id"] == request_id, "x-request-id not echoed".into())?;
    }
    let invalid = &s["invalid"];
    want(invalid["code"] == "INVALID_ARGUMENT", "invalid request: not INVALID_ARGUMENT".into())?;
    want(invalid["reason"] == "FIELD_REQUIRED", "ErrorInfo.reason is not FIELD_REQUIRED".into())?;
    want(invalid["domain"] == expect.driver, format!("ErrorInfo.domain is not {}", expect.driver))?;
    want(
        invalid["request_id"] == format!("{request_id}-invalid"),
        "RequestInfo.request_id is not the one sent".into(),
    )?;
    let names_field = invalid["fields"].as_array().is_some_and(|f| f.iter().any(|f| f == "name"));
    want(names_field, "BadRequest does not name the field `name`".into())
}

/// Runs one installed client; its JSON summary, or why it failed.
async fn run_client(
    client: Client,
    transport: &Transport,
    request_id: &str,
    create: Option<&Value>,
    invalid_rpc: &str,
) -> Result<Value, String> {
    let mut args: Vec<String> = transport.args.clone();
    args.extend(["--request-id".into(), request_id.into(), "--invalid-rpc".into(), invalid_rpc.into()]);
    if let Some(c) = create {
        args.extend(["--create-json".into(), c.to_string()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, out, err) = run(&client.launcher(), &args).await;
    if code != 0 {
        return Err(format!("exit {code}: {}", err.trim()));
    }
    let line = out.lines().last().unwrap_or_default();
    serde_json::from_str(line).map_err(|e| format!("summary is not JSON ({e}): {out}\n{err}"))
}

/// The same contract, with grpcurl (server reflection, no proto files) as the client.
async fn grpcurl_client(
    transport: &Transport,
    request_id: &str,
    create: Option<&Value>,
    invalid_rpc: &str,
) -> Result<Value, String> {
    let g = grpcurl();
    let call = |extra: &[&str], method: &str| {
        let mut args: Vec<String> = vec!["-plaintext".into()];
        args.extend(extra.iter().map(|s| s.to_string()));
        args.extend(transport.args.iter().cloned());
        args.push(method.into());
        let g = g.clone();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            run(&g, &args).await
        }
    };
    let ok = |what: &str, (code, out, err): (i32, String, String)| {
        if code == 0 {
            Ok(out)
        } else {
            Err(format!("{what}: grpcurl exit {code}: {}{}", out.trim(), err.trim()))
        }
    };
    let json = |what: &str, text: &str| -> Result<Value, String> {
        serde_json::from_str(text.trim()).map_err(|e| format!("{what}: not JSON ({e}): {text}"))
    };

    let health = json("health", &ok("health", call(&[], "grpc.health.v1.Health/Check").await)?)?;
    if health["status"] != "SERVING" {
        return Err(format!("health: {health}, want SERVING"));
    }
    let info =
        json("GetDriverInfo", &ok("GetDriverInfo", call(&[], "machinedriver.v1.Identity/GetDriverInfo").await)?)?;

    let mut created = Value::Null;
    if let Some(c) = create {
        let header = format!("x-request-id: {request_id}");
        let out = ok(
            "CreateMachine",
            call(&["-v", "-H", &header, "-d", &c.to_string()], "machinedriver.v1.Machines/CreateMachine").await,
        )?;
        // -v prints "Response headers received:" then one "key: value" line per header.
        let headers = out
            .split("Response headers received:")
            .nth(1)
            .and_then(|rest| rest.split("Response contents:").next())
            .ok_or_else(|| format!("CreateMachine: no response headers in grpcurl -v output:\n{out}"))?;
        let echoed = headers.lines().find_map(|l| l.strip_prefix("x-request-id: ")).map(str::trim);
        created = json!({ "echoed_request_id": echoed });
    }

    let invalid_id = format!("{request_id}-invalid");
    let method = match invalid_rpc {
        "ApplyPool" => "machinedriver.v1.Pools/ApplyPool",
        _ => "machinedriver.v1.Machines/CreateMachine",
    };
    let header = format!("x-request-id: {invalid_id}");
    let (code, out, err) = call(&["-format-error", "-H", &header, "-d", r#"{"name":""}"#], method).await;
    if code == 0 {
        return Err(format!("{invalid_rpc} with an empty name succeeded: {out}"));
    }
    // -format-error prints the google.rpc.Status as JSON on stderr, details decoded through
    // the sidecar's reflection service.
    let status = json(invalid_rpc, &err).map_err(|e| format!("{e} (grpcurl exit {code}; stdout: {out})"))?;
    let detail = |ty: &str| {
        status["details"]
            .as_array()
            .and_then(|d| d.iter().find(|d| d["@type"] == format!("type.googleapis.com/google.rpc.{ty}")))
            .cloned()
            .ok_or_else(|| format!("{invalid_rpc}: no google.rpc.{ty} in {status}"))
    };
    let (error_info, request_info, bad_request) = (detail("ErrorInfo")?, detail("RequestInfo")?, detail("BadRequest")?);
    let fields: Vec<Value> = bad_request["fieldViolations"]
        .as_array()
        .map(|v| v.iter().map(|v| v["field"].clone()).collect())
        .unwrap_or_default();
    // grpcurl prints the numeric code; 3 is INVALID_ARGUMENT.
    let code = if status["code"] == 3 { "INVALID_ARGUMENT".to_string() } else { format!("code {}", status["code"]) };
    Ok(json!({
        "client": "grpcurl",
        "health": health["status"],
        "driver": info["name"],
        "create": created,
        "invalid": {
            "code": code,
            "reason": error_info["reason"],
            "domain": error_info["domain"],
            "request_id": request_info["requestId"],
            "fields": fields,
            "message": status["message"],
        },
    }))
}

// ------------------------------------------------------------------------------------ sidecars

async fn fake_sidecars() -> Sidecars {
    let driver = Driver::fake(&[]);
    Sidecars { unix: driver.start().await, tcp: driver.start_tcp().await }
}

fn fake_expect() -> Expect {
    Expect {
        driver: FAKE,
        create: Some(json!({ "providerSpec": { "machineType": "small" } })),
        invalid_rpc: "CreateMachine",
    }
}

/// The fake cloud holds exactly the machines the client created, on whichever sidecar.
async fn assert_created(sidecars: &Sidecars, names: &[String]) {
    let mut seen = Vec::new();
    for s in [&sidecars.unix, &sidecars.tcp] {
        let channel = s.client().await.channel();
        let mut fake_cloud = fake::fake_cloud_client::FakeCloudClient::new(channel);
        let inspect =
            tokio::time::timeout(Duration::from_secs(15), fake_cloud.inspect(fake::InspectRequest::default()))
                .await
                .expect("Inspect within 15 s")
                .expect("Inspect")
                .into_inner();
        seen.extend(inspect.machines.into_iter().map(|m| m.name));
    }
    seen.sort();
    let mut want = names.to_vec();
    want.sort();
    assert_eq!(seen, want, "machines in the fake clouds");
}

async fn against_fake(client: Client) {
    let sidecars = fake_sidecars().await;
    let created = exercise(client, &sidecars, &fake_expect()).await;
    assert_created(&sidecars, &created).await;
}

async fn aws_sidecars() -> (std::sync::Arc<crate::aws_support::Moto>, Sidecars) {
    let moto = crate::aws_support::Moto::shared().await;
    // Nothing here reaches EC2 (health, driver info, a request the SDK refuses): any region does.
    let driver = Driver::binary("aws-ec2-driver").args(["--dev"]).env(moto.env("sa-east-1"));
    let sidecars = Sidecars { unix: driver.start().await, tcp: driver.start_tcp().await };
    (moto, sidecars)
}

async fn against_aws(client: Client) {
    let (_moto, sidecars) = aws_sidecars().await;
    exercise(client, &sidecars, &Expect { driver: AWS, create: None, invalid_rpc: "CreateMachine" }).await;
}

async fn against_azure(client: Client) {
    let arm = Emulator::arm(&[]).await;
    let endpoint = arm.url();
    let args = [
        "--dev",
        "--arm-endpoint",
        &endpoint,
        "--subscription-id",
        "00000000-0000-0000-0000-0000000000e2",
        "--resource-group",
        "interop",
        "--credential",
        "static-token",
        "--static-token",
        "interop-test-token",
    ];
    let driver = Driver::azure(&args);
    let sidecars = Sidecars { unix: driver.start().await, tcp: driver.start_tcp().await };
    // The Azure driver serves pools only: the invalid request is an ApplyPool.
    exercise(client, &sidecars, &Expect { driver: AZURE, create: None, invalid_rpc: "ApplyPool" }).await;
}

// --------------------------------------------------------------------------------------- tests

#[tokio::test]
async fn python_grpcio_against_the_fake_driver() {
    against_fake(Client::Python).await;
}

#[tokio::test]
async fn node_grpc_js_against_the_fake_driver() {
    against_fake(Client::Node).await;
}

#[tokio::test]
async fn grpc_go_against_the_fake_driver() {
    against_fake(Client::Go).await;
}

#[tokio::test]
async fn grpcurl_against_the_fake_driver() {
    against_fake(Client::Grpcurl).await;
}

#[tokio::test]
async fn python_grpcio_against_aws_ec2_driver() {
    against_aws(Client::Python).await;
}

#[tokio::test]
async fn node_grpc_js_against_aws_ec2_driver() {
    against_aws(Client::Node).await;
}

#[tokio::test]
async fn grpc_go_against_aws_ec2_driver() {
    against_aws(Client::Go).await;
}

#[tokio::test]
async fn grpcurl_against_aws_ec2_driver() {
    against_aws(Client::Grpcurl).await;
}

#[tokio::test]
async fn python_grpcio_against_azure_vmss_driver() {
    against_azure(Client::Python).await;
}

#[tokio::test]
async fn node_grpc_js_against_azure_vmss_driver() {
    against_azure(Client::Node).await;
}

#[tokio::test]
async fn grpc_go_against_azure_vmss_driver() {
    against_azure(Client::Go).await;
}

#[tokio::test]
async fn grpcurl_against_azure_vmss_driver() {
    against_azure(Client::Grpcurl).await;
}
