//! Shared by the AWS tests: moto (the real EC2 emulator) and the loopback EC2 stub.

#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use e2e_tests::{eventually, http_get, Driver, Emulator, Sidecar};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

// ------------------------------------------------------------------------------------------ moto

/// `moto_server`: `$MOTO_SERVER`, else the one `cargo xtask install` installs in `.tools/moto`. A
/// missing moto fails the test; it is never skipped.
pub fn moto_server() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root");
    let p =
        std::env::var_os("MOTO_SERVER").map(PathBuf::from).unwrap_or_else(|| root.join(".tools/moto/bin/moto_server"));
    assert!(
        p.exists(),
        "moto_server not found at {} (from $MOTO_SERVER, else .tools/moto): run `cargo xtask install`, which \
         installs moto[server]==5.2.5 from PyPI into .tools/moto",
        p.display()
    );
    p
}

/// The Python of moto's virtual environment (it has boto3, a second, independent EC2 client).
pub fn moto_python() -> PathBuf {
    if let Some(p) = std::env::var_os("MOTO_PYTHON") {
        return PathBuf::from(p);
    }
    let p = moto_server().parent().expect("bin dir").join("python");
    assert!(p.exists(), "{} not found: set MOTO_PYTHON to a Python with boto3", p.display());
    p
}

/// A `moto_server` on a loopback port it picked itself (port 0; it logs the port it bound, so no
/// other process can take it first), shared by the tests of this binary that run at the same
/// time. Tests isolate themselves by region (moto keeps one backend per region), so nobody
/// resets global state while others run. Killed when the last user drops it.
pub struct Moto {
    server: Emulator,
    pub port: u16,
    recording: PathBuf,
}

/// One request moto received, as its recorder wrote it down.
#[derive(Debug, Clone)]
pub struct SignedCall {
    /// Service of the SigV4 credential scope (`ec2`, `sts`).
    pub service: String,
    /// Region of the credential scope.
    pub region: String,
    /// The access key ID that signed the request.
    pub access_key_id: String,
    /// The Query API action.
    pub action: String,
    /// The form parameters.
    pub params: BTreeMap<String, String>,
}

/// The shared moto while anyone holds it. An async lock: held across a start, so two tests do
/// not start two servers and nobody gets one that is not answering yet.
static SHARED: tokio::sync::Mutex<Weak<Moto>> = tokio::sync::Mutex::const_new(Weak::new());

impl Moto {
    /// The running shared moto, or a new one.
    pub async fn shared() -> Arc<Moto> {
        let server = moto_server();
        let mut shared = SHARED.lock().await;
        if let Some(m) = shared.upgrade() {
            return m;
        }
        let m = Arc::new(Moto::start(&server).await);
        *shared = Arc::downgrade(&m);
        m
    }

    /// A moto of its own, for a test whose calls must not compete with the other tests'.
    pub async fn private() -> Moto {
        Moto::start(&moto_server()).await
    }

    async fn start(server: &Path) -> Moto {
        let dir = tempfile::tempdir().unwrap();
        // moto's recorder appends every request (headers and body) to a file: the tests read
        // which access key signed each call from its SigV4 Authorization header.
        let recording = dir.path().join("recording.jsonl");
        let file = recording.to_string_lossy().into_owned();
        let env = [("MOTO_ENABLE_RECORDING", "True"), ("MOTO_RECORDER_FILEPATH", file.as_str())];
        // Port 0: werkzeug logs the address it bound (" * Running on http://127.0.0.1:PORT").
        let args = ["-H", "127.0.0.1", "-p", "0"];
        let server = Emulator::start_in(dir, server, &args, &env, "Running on http://").await;
        let port = server.addr.port();
        eventually(Duration::from_secs(60), "moto_server answering", || async move {
            http_get(port, "/moto-api/").await.filter(|(status, _)| *status == 200).map(|_| ())
        })
        .await;
        Moto { server, port, recording }
    }

    pub fn url(&self) -> String {
        self.server.url()
    }

    /// The environment that points an AWS SDK at this moto in `region`.
    pub fn env(&self, region: &str) -> Vec<(String, String)> {
        aws_env(&self.url(), region)
    }

    /// Runs a boto3 snippet against moto in `region` (`ec2` is the client); returns its JSON.
    pub async fn boto3(&self, region: &str, body: &str) -> Value {
        let script = format!(
            "import boto3, json, sys\nec2 = boto3.client('ec2', region_name=sys.argv[2], endpoint_url=sys.argv[1], \
             aws_access_key_id='testing', aws_secret_access_key='testing')\n{body}\n"
        );
        let out = tokio::time::timeout(
            Duration::from_secs(60),
            tokio::process::Command::new(moto_python())
                .args(["-c", &script, &self.url(), region])
                .stdin(Stdio::null())
                .kill_on_drop(true)
                .output(),
        )
        .await
        .expect("boto3 within 60 s")
        .expect("run python");
        assert!(out.status.success(), "boto3 failed: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("boto3 output is not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
    }

    /// Every instance in `region`: `[{id, state, tags: {k: v}}]`.
    pub async fn instances(&self, region: &str) -> Vec<Value> {
        let v = self
            .boto3(
                region,
                "out = []\nfor page in ec2.get_paginator('describe_instances').paginate():\n  for r in page['Reservations']:\n    \
                 for i in r['Instances']:\n      out.append({'id': i['InstanceId'], 'state': i['State']['Name'], \
                 'tags': {t['Key']: t['Value'] for t in i.get('Tags', [])}})\nprint(json.dumps(out))",
            )
            .await;
        v.as_array().cloned().unwrap_or_default()
    }

    /// Every signed request moto has received so far, in order (all tests and regions: filter by
    /// `region` and `service`). moto writes a request down before it answers it.
    pub fn signed_calls(&self) -> Vec<SignedCall> {
        use base64::Engine;
        let text = std::fs::read_to_string(&self.recording).unwrap_or_default();
        text.lines()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .filter_map(|entry| {
                let auth = entry["headers"]["Authorization"].as_str()?;
                // AWS4-HMAC-SHA256 Credential=AKID/20240101/eu-west-1/ec2/aws4_request, SignedHeaders=…
                let scope = auth.split("Credential=").nth(1)?.split(',').next()?;
                let parts: Vec<&str> = scope.split('/').collect();
                let [akid, _date, region, service, ..] = parts.as_slice() else { return None };
                let body = entry["body"].as_str().unwrap_or_default();
                let body = if entry["body_encoded"].as_bool() == Some(true) {
                    let bytes = base64::engine::general_purpose::STANDARD.decode(body).ok()?;
                    String::from_utf8_lossy(&bytes).into_owned()
                } else {
                    body.to_string()
                };
                let params = parse_form(&body);
                Some(SignedCall {
                    service: service.to_string(),
                    region: region.to_string(),
                    access_key_id: akid.to_string(),
                    action: params.get("Action").cloned().unwrap_or_default(),
                    params,
                })
            })
            .collect()
    }

    /// The signed calls of `service` in `region`.
    pub fn signed_calls_in(&self, service: &str, region: &str) -> Vec<SignedCall> {
        self.signed_calls().into_iter().filter(|c| c.service == service && c.region == region).collect()
    }

    /// Whether moto knows this AMI in `region`.
    pub async fn has_image(&self, region: &str, ami: &str) -> bool {
        let v = self
            .boto3(
                region,
                &format!(
                    "print(json.dumps([i['ImageId'] for i in ec2.describe_images(ImageIds=['{ami}'])['Images']]))"
                ),
            )
            .await;
        v.as_array().is_some_and(|a| a.iter().any(|i| i == ami))
    }
}

/// The environment of an `aws-ec2-driver` talking to `endpoint` in `region` with test keys, and
/// nothing from the host's AWS configuration.
pub fn aws_env(endpoint: &str, region: &str) -> Vec<(String, String)> {
    [
        ("AWS_ENDPOINT_URL", endpoint),
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_REGION", region),
        ("AWS_EC2_METADATA_DISABLED", "true"),
        ("AWS_CONFIG_FILE", "/nonexistent/aws-config"),
        ("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

/// `aws-ec2-driver` (dev token key) against `endpoint` in `region`, polling every 200 ms and
/// bounding an EC2 call at 60 s unless `extra` says otherwise, named `aws` (the classes'
/// `spec.driver`).
///
/// Why 60 s and not the 10 s default: moto builds a region's backend (AMIs, instance types,
/// offerings) on the first call into it, and each test process starts its own moto; on a loaded
/// 2-core machine that first DescribeInstances took more than 10 s, and the driver's own bound,
/// right for real EC2, failed the test.
pub fn driver(endpoint: &str, region: &str, extra: &[&str]) -> Driver {
    let poll: &[&str] = if extra.contains(&"--poll-interval") { &[] } else { &["--poll-interval", "200ms"] };
    let timeout: &[&str] = if extra.contains(&"--call-timeout") { &[] } else { &["--call-timeout", "60s"] };
    Driver::binary("aws-ec2-driver")
        .named("aws")
        .args(["--dev"])
        .args(poll)
        .args(timeout)
        .args(extra)
        .env(aws_env(endpoint, region))
}

/// Starts [`driver`].
pub async fn start_driver(endpoint: &str, region: &str, extra: &[&str]) -> Sidecar {
    driver(endpoint, region, extra).start().await
}

// ------------------------------------------------------------------------------------------ stub

/// One request the stub received: the EC2 Query action and its form parameters.
#[derive(Debug, Clone)]
pub struct StubRequest {
    pub action: String,
    pub params: BTreeMap<String, String>,
}

impl StubRequest {
    pub fn get(&self, k: &str) -> Option<&str> {
        self.params.get(k).map(String::as_str)
    }
}

/// What the stub does with the next request of an action.
#[derive(Debug, Clone)]
pub enum Fault {
    /// Answer with EC2's XML error format.
    Error { status: u16, code: String, message: String, request_id: String, header: bool },
    /// Do the work, then close the connection without an answer (a lost response).
    DropAfterApply,
}

impl Fault {
    /// An error with the request ID in both the `x-amzn-requestid` header and the body, as EC2
    /// sends it.
    pub fn error(status: u16, code: &str, request_id: &str) -> Fault {
        Fault::Error {
            status,
            code: code.into(),
            message: format!("stub says {code}"),
            request_id: request_id.into(),
            header: true,
        }
    }
}

#[derive(Debug, Clone)]
pub struct StubInstance {
    pub id: String,
    pub client_token: String,
    pub image_id: String,
    pub instance_type: String,
    pub tags: BTreeMap<String, String>,
    /// 0 pending, 16 running, 32 shutting-down, 48 terminated.
    pub code: i32,
    /// DescribeInstances calls (by ID) still answered InvalidInstanceID.NotFound.
    pub invisible_by_id: u32,
    /// DescribeInstances calls (by filter) that still leave it out.
    pub invisible_by_filter: u32,
    /// DescribeInstances calls that still show it pending.
    pub pending_polls: u32,
}

#[derive(Debug, Default)]
pub struct StubState {
    pub requests: Vec<StubRequest>,
    pub faults: Vec<(String, Fault)>,
    pub instances: Vec<StubInstance>,
    /// Applied to each new instance.
    pub new_invisible_by_id: u32,
    pub new_invisible_by_filter: u32,
    pub new_pending_polls: u32,
}

/// A loopback HTTP/1.1 server that speaks just enough of EC2's Query API (RunInstances,
/// DescribeInstances, TerminateInstances, XML errors) to drive the real AWS SDK through what moto
/// cannot emulate: ClientToken dedupe, pending → running, eventual consistency, and the error
/// codes of capacity, throttling, auth and parameter mismatches.
pub struct Ec2Stub {
    pub port: u16,
    pub state: Arc<Mutex<StubState>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Ec2Stub {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Ec2Stub {
    pub async fn start() -> Ec2Stub {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(Mutex::new(StubState::default()));
        let st = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(serve_conn(conn, st.clone()));
            }
        });
        Ec2Stub { port, state, task }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The next request of `action` gets `fault` (faults of one action fire in order).
    pub fn fail_next(&self, action: &str, fault: Fault) {
        self.state.lock().unwrap().faults.push((action.to_string(), fault));
    }

    pub fn requests(&self, action: &str) -> Vec<StubRequest> {
        self.state.lock().unwrap().requests.iter().filter(|r| r.action == action).cloned().collect()
    }

    pub fn instances(&self) -> Vec<StubInstance> {
        self.state.lock().unwrap().instances.clone()
    }

    pub fn with(&self, f: impl FnOnce(&mut StubState)) {
        f(&mut self.state.lock().unwrap())
    }
}

async fn serve_conn(mut conn: TcpStream, state: Arc<Mutex<StubState>>) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    // Read the head, then Content-Length bytes of body (bounded: a test stub, not a server).
    let (head_end, content_length) = loop {
        let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut chunk)).await else { return };
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(pos) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..pos]).to_ascii_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:").map(|v| v.trim().parse::<usize>().unwrap_or(0)))
                .unwrap_or(0);
            break (pos + 4, len);
        }
    };
    while buf.len() < head_end + content_length {
        let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut chunk)).await else { return };
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let body = String::from_utf8_lossy(&buf[head_end..head_end + content_length]).into_owned();
    let params = parse_form(&body);
    let req = StubRequest { action: params.get("Action").cloned().unwrap_or_default(), params };
    let (status, xml, request_id, drop_conn) = handle(&state, req);
    if drop_conn {
        return; // the connection closes without an answer
    }
    let mut resp = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: text/xml;charset=UTF-8\r\nContent-Length: {}\r\nConnection: close\r\n",
        if status == 200 { "OK" } else { "Error" },
        xml.len()
    );
    if let Some(id) = request_id {
        resp.push_str(&format!("x-amzn-requestid: {id}\r\n"));
    }
    resp.push_str("\r\n");
    resp.push_str(&xml);
    let _ = conn.write_all(resp.as_bytes()).await;
    let _ = conn.shutdown().await;
}

fn parse_form(body: &str) -> BTreeMap<String, String> {
    fn decode(s: &str) -> String {
        let bytes = s.as_bytes();
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
            match (bytes[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
                (b'+', _) => out.push(b' '),
                (b'%', Some(b)) => {
                    out.push(b);
                    i += 2;
                }
                (b, _) => out.push(b),
            }
            i += 1;
        }
        String::from_utf8_lossy(&out).into_owned()
    }
    body.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

const NS: &str = "http://ec2.amazonaws.com/doc/2016-11-15/";

fn error_xml(code: &str, message: &str, request_id: &str) -> String {
    format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Response><Errors><Error><Code>{code}</Code><Message>{message}</Message></Error></Errors><RequestID>{request_id}</RequestID></Response>"
    )
}

fn state_name(code: i32) -> &'static str {
    match code {
        0 => "pending",
        16 => "running",
        32 => "shutting-down",
        48 => "terminated",
        64 => "stopping",
        _ => "stopped",
    }
}

fn instance_xml(i: &StubInstance) -> String {
    let tags: String =
        i.tags.iter().map(|(k, v)| format!("<item><key>{}</key><value>{}</value></item>", esc(k), esc(v))).collect();
    format!(
        "<item><instanceId>{id}</instanceId><imageId>{img}</imageId><instanceState><code>{code}</code><name>{name}</name></instanceState>\
         <privateDnsName>ip-10-0-0-7.ec2.internal</privateDnsName><instanceType>{it}</instanceType>\
         <launchTime>2024-05-01T10:00:00.000Z</launchTime><placement><availabilityZone>us-stub-1a</availabilityZone></placement>\
         <privateIpAddress>10.0.0.7</privateIpAddress><clientToken>{ct}</clientToken><tagSet>{tags}</tagSet></item>",
        id = i.id,
        img = esc(&i.image_id),
        code = i.code,
        name = state_name(i.code),
        it = esc(&i.instance_type),
        ct = esc(&i.client_token),
    )
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// Values of the indexed parameters `prefix.1`, `prefix.2`, ...
fn indexed(p: &BTreeMap<String, String>, prefix: &str) -> Vec<String> {
    (1..).map_while(|n| p.get(&format!("{prefix}.{n}")).cloned()).collect()
}

/// (status, body, request id header, drop the connection)
fn handle(state: &Mutex<StubState>, req: StubRequest) -> (u16, String, Option<String>, bool) {
    let mut st = state.lock().unwrap();
    st.requests.push(req.clone());
    let n = st.requests.len();
    let rid = format!("stub-req-{n}");
    let fault = st.faults.iter().position(|(a, _)| *a == req.action).map(|i| st.faults.remove(i).1);
    let mut drop_conn = false;
    match fault {
        Some(Fault::Error { status, code, message, request_id, header }) => {
            let xml = error_xml(&code, &message, &request_id);
            return (status, xml, header.then_some(request_id), false);
        }
        Some(Fault::DropAfterApply) => drop_conn = true,
        None => {}
    }
    let p = &req.params;
    let (status, xml) = match req.action.as_str() {
        "RunInstances" => {
            let token = p.get("ClientToken").cloned().unwrap_or_default();
            let image = p.get("ImageId").cloned().unwrap_or_default();
            let itype = p.get("InstanceType").cloned().unwrap_or_default();
            let existing = st.instances.iter().find(|i| !token.is_empty() && i.client_token == token).cloned();
            let inst = match existing {
                // EC2's idempotency: same token + same parameters = the original launch.
                Some(i) if i.image_id == image && i.instance_type == itype => i,
                Some(_) => {
                    let xml = error_xml(
                        "IdempotentParameterMismatch",
                        "The client token you have provided is associated with a resource that is already deleted or has different parameters.",
                        &rid,
                    );
                    return (400, xml, Some(rid), drop_conn);
                }
                None => {
                    let mut tags = BTreeMap::new();
                    for k in 1.. {
                        let Some(key) = p.get(&format!("TagSpecification.1.Tag.{k}.Key")) else { break };
                        let v = p.get(&format!("TagSpecification.1.Tag.{k}.Value")).cloned().unwrap_or_default();
                        tags.insert(key.clone(), v);
                    }
                    let i = StubInstance {
                        id: format!("i-{:017x}", 0xabc000 + st.instances.len()),
                        client_token: token,
                        image_id: image,
                        instance_type: itype,
                        tags,
                        code: 0,
                        invisible_by_id: st.new_invisible_by_id,
                        invisible_by_filter: st.new_invisible_by_filter,
                        pending_polls: st.new_pending_polls,
                    };
                    st.instances.push(i.clone());
                    i
                }
            };
            (
                200,
                format!(
                    "<RunInstancesResponse xmlns=\"{NS}\"><requestId>{rid}</requestId><reservationId>r-0001</reservationId>\
                     <ownerId>123456789012</ownerId><groupSet/><instancesSet>{}</instancesSet></RunInstancesResponse>",
                    instance_xml(&inst)
                ),
            )
        }
        "DescribeInstances" => {
            let ids = indexed(p, "InstanceId");
            let mut filters: Vec<(String, Vec<String>)> = Vec::new();
            for k in 1.. {
                let Some(name) = p.get(&format!("Filter.{k}.Name")) else { break };
                filters.push((name.clone(), indexed(p, &format!("Filter.{k}.Value"))));
            }
            let mut out = Vec::new();
            if !ids.is_empty() {
                for id in &ids {
                    let Some(i) = st.instances.iter_mut().find(|i| &i.id == id) else {
                        let xml = error_xml(
                            "InvalidInstanceID.NotFound",
                            &format!("The instance ID '{id}' does not exist"),
                            &rid,
                        );
                        return (400, xml, Some(rid), drop_conn);
                    };
                    if i.invisible_by_id > 0 {
                        i.invisible_by_id -= 1;
                        let xml = error_xml(
                            "InvalidInstanceID.NotFound",
                            &format!("The instance ID '{id}' does not exist"),
                            &rid,
                        );
                        return (400, xml, Some(rid), drop_conn);
                    }
                    out.push(i.id.clone());
                }
            } else {
                for i in st.instances.iter_mut() {
                    if i.invisible_by_filter > 0 {
                        i.invisible_by_filter -= 1;
                        continue;
                    }
                    let ok = filters.iter().all(|(name, values)| match name.as_str() {
                        "instance-state-name" => values.iter().any(|v| v == state_name(i.code)),
                        "tag-key" => values.iter().any(|v| i.tags.contains_key(v)),
                        n => match n.strip_prefix("tag:") {
                            Some(k) => i.tags.get(k).is_some_and(|v| values.contains(v)),
                            None => true,
                        },
                    });
                    if ok {
                        out.push(i.id.clone());
                    }
                }
            }
            // Each describe moves time forward: pending → running, shutting-down → terminated.
            let mut items = String::new();
            for id in out {
                let i = st.instances.iter_mut().find(|i| i.id == id).unwrap();
                items.push_str(&instance_xml(i));
                match i.code {
                    0 if i.pending_polls > 0 => i.pending_polls -= 1,
                    0 => i.code = 16,
                    32 => i.code = 48,
                    _ => {}
                }
            }
            let set = if items.is_empty() {
                String::new()
            } else {
                format!("<item><reservationId>r-0001</reservationId><ownerId>123456789012</ownerId><groupSet/><instancesSet>{items}</instancesSet></item>")
            };
            (200, format!("<DescribeInstancesResponse xmlns=\"{NS}\"><requestId>{rid}</requestId><reservationSet>{set}</reservationSet></DescribeInstancesResponse>"))
        }
        "TerminateInstances" => {
            let mut items = String::new();
            for id in indexed(p, "InstanceId") {
                let Some(i) = st.instances.iter_mut().find(|i| i.id == id) else {
                    let xml = error_xml(
                        "InvalidInstanceID.NotFound",
                        &format!("The instance ID '{id}' does not exist"),
                        &rid,
                    );
                    return (400, xml, Some(rid), drop_conn);
                };
                let prev = i.code;
                if i.code != 48 {
                    i.code = 32;
                }
                items.push_str(&format!(
                    "<item><instanceId>{id}</instanceId><currentState><code>{}</code><name>{}</name></currentState>\
                     <previousState><code>{prev}</code><name>{}</name></previousState></item>",
                    i.code,
                    state_name(i.code),
                    state_name(prev)
                ));
            }
            (200, format!("<TerminateInstancesResponse xmlns=\"{NS}\"><requestId>{rid}</requestId><instancesSet>{items}</instancesSet></TerminateInstancesResponse>"))
        }
        other => (400, error_xml("InvalidAction", &format!("stub does not implement {other}"), &rid)),
    };
    (status, xml, Some(rid), drop_conn)
}
