//! One trace from the controller's reconcile through the driver call to the fake cloud, in a real
//! Jaeger (v2, its OTLP receiver and its query API): the controller and the fake-driver sidecar
//! each export their spans over OTLP, and W3C `traceparent` in the gRPC metadata joins them.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use e2e_tests::world::{Driver, World};
use e2e_tests::{eventually_seen, installed_tool};
use serde_json::Value;

const MINUTE: Duration = Duration::from_secs(60);
const FAST: &[&str] = &["--create-latency", "300ms", "--delete-latency", "200ms"];

/// A Jaeger all-in-one (in-memory storage) on loopback ports of its own; killed on drop.
struct Jaeger {
    _child: tokio::process::Child,
    otlp: String,
    query: String,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

impl Jaeger {
    async fn start() -> Jaeger {
        let bin = installed_tool("JAEGER_BIN", "install-go-tool.sh", &["jaeger"]);
        let dir = tempfile::tempdir().unwrap();
        let (otlp, http, grpc) = (free_port(), free_port(), free_port());
        let config = format!(
            "service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces: {{receivers: [otlp], processors: [batch], exporters: [jaeger_storage_exporter]}}
  telemetry:
    metrics: {{level: none}}
extensions:
  jaeger_query:
    storage: {{traces: memory}}
    http: {{endpoint: 127.0.0.1:{http}}}
    grpc: {{endpoint: 127.0.0.1:{grpc}}}
  jaeger_storage:
    backends: {{memory: {{memory: {{max_traces: 10000}}}}}}
receivers:
  otlp:
    protocols:
      grpc: {{endpoint: 127.0.0.1:{otlp}}}
processors:
  batch: {{timeout: 100ms}}
exporters:
  jaeger_storage_exporter: {{trace_storage: memory}}
"
        );
        let path = dir.path().join("jaeger.yaml");
        std::fs::write(&path, config).unwrap();
        let log = dir.path().join("jaeger.log");
        let out = std::fs::File::create(&log).unwrap();
        let child = tokio::process::Command::new(bin)
            .arg(format!("--config=file:{}", path.display()))
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .kill_on_drop(true)
            .spawn()
            .expect("start jaeger");
        let jaeger = Jaeger {
            _child: child,
            otlp: format!("http://127.0.0.1:{otlp}"),
            query: format!("http://127.0.0.1:{http}"),
            log,
            _dir: dir,
        };
        let url = format!("{}/api/services", jaeger.query);
        eventually_seen(MINUTE, "Jaeger's query API answering", || {
            let url = url.clone();
            let log = jaeger.log.clone();
            async move {
                get_json(&url).await.map_err(|e| format!("{e}\n{}", std::fs::read_to_string(&log).unwrap_or_default()))
            }
        })
        .await;
        jaeger
    }

    /// The traces Jaeger's query API (`/api/traces`) holds for `service` and `operation`.
    async fn traces(&self, service: &str, operation: &str) -> Result<Vec<Trace>, String> {
        let url = format!(
            "{}/api/traces?service={service}&operation={}&lookback=1h&limit=100",
            self.query,
            operation.replace('/', "%2F").replace(' ', "%20")
        );
        let body = get_json(&url).await?;
        Ok(body["data"].as_array().cloned().unwrap_or_default().iter().map(Trace::of).collect())
    }
}

/// GET a JSON document over plain HTTP/1.1 (Go's server sends a large body chunked).
async fn get_json(url: &str) -> Result<Value, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.strip_prefix("http://").ok_or("not an http:// URL")?;
    let (host, path) = rest.split_once('/').map_or((rest, "/".to_string()), |(h, p)| (h, format!("/{p}")));
    let mut s = tokio::net::TcpStream::connect(host).await.map_err(|e| format!("{url}: {e}"))?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut raw))
        .await
        .map_err(|_| format!("{url}: no answer in 10 s"))?
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(|| format!("{url}: no HTTP response"))?;
    if head.split_whitespace().nth(1) != Some("200") {
        return Err(format!("{url}: {}", head.lines().next().unwrap_or_default()));
    }
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        dechunk(body)?
    } else {
        body.to_string()
    };
    serde_json::from_str(&body).map_err(|e| format!("{url}: {e}"))
}

/// The body of a chunked HTTP/1.1 response.
fn dechunk(mut body: &str) -> Result<String, String> {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n").ok_or("a truncated chunk")?;
        let size =
            usize::from_str_radix(size.split(';').next().unwrap_or_default().trim(), 16).map_err(|e| e.to_string())?;
        if size == 0 {
            return Ok(out);
        }
        out.push_str(rest.get(..size).ok_or("a truncated chunk")?);
        body = rest.get(size + 2..).ok_or("a truncated chunk")?;
    }
}

/// A span as Jaeger's API returns it, with its service and tags flattened.
#[derive(Debug, Clone)]
struct SpanView {
    id: String,
    parent: Option<String>,
    service: String,
    name: String,
    tags: BTreeMap<String, String>,
}

#[derive(Debug, Clone)]
struct Trace {
    spans: Vec<SpanView>,
}

impl Trace {
    fn of(t: &Value) -> Trace {
        let processes = &t["processes"];
        let spans = t["spans"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|s| SpanView {
                id: s["spanID"].as_str().unwrap_or_default().to_string(),
                parent: s["references"]
                    .as_array()
                    .and_then(|r| r.iter().find(|r| r["refType"] == "CHILD_OF"))
                    .and_then(|r| r["spanID"].as_str())
                    .map(str::to_string),
                service: processes[s["processID"].as_str().unwrap_or_default()]["serviceName"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                name: s["operationName"].as_str().unwrap_or_default().to_string(),
                tags: s["tags"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
                    .iter()
                    .map(|t| {
                        let v = match &t["value"] {
                            Value::String(s) => s.clone(),
                            other => other.to_string(),
                        };
                        (t["key"].as_str().unwrap_or_default().to_string(), v)
                    })
                    .collect(),
            })
            .collect();
        Trace { spans }
    }

    fn span(&self, id: &str) -> Option<&SpanView> {
        self.spans.iter().find(|s| s.id == id)
    }

    fn children(&self, id: &str) -> Vec<&SpanView> {
        self.spans.iter().filter(|s| s.parent.as_deref() == Some(id)).collect()
    }

    /// The trace as a tree, one span a line (for the test's output and the book).
    fn tree(&self) -> String {
        fn walk(t: &Trace, s: &SpanView, depth: usize, out: &mut String) {
            let keys = ["request.id", "rpc.system.name", "rpc.response.status_code", "server.address", "span.kind"];
            let tags: Vec<String> = keys.iter().filter_map(|k| s.tags.get(*k).map(|v| format!("{k}={v}"))).collect();
            out.push_str(&format!("{}{} [{}] {}\n", "  ".repeat(depth), s.name, s.service, tags.join(" ")));
            for c in t.children(&s.id) {
                walk(t, c, depth + 1, out);
            }
        }
        let mut out = String::new();
        for root in self.spans.iter().filter(|s| s.parent.as_ref().is_none_or(|p| self.span(p).is_none())) {
            walk(self, root, 0, &mut out);
        }
        out
    }
}

/// The driver call `method` whose request ID is one of `request_ids`, joined end to end in one
/// trace: the controller's reconcile span, its client span of the call, the sidecar's server span
/// (a child of the client span, with the same request ID and the RPC semantic conventions) and,
/// under that, the fake cloud's call.
async fn joined_trace(jaeger: &Jaeger, method: &str, request_ids: &[String], socket: &str) -> Trace {
    let full = format!("machinedriver.v1.Machines/{method}");
    let what = format!("a {method} trace from the controller to the fake cloud in Jaeger");
    eventually_seen(MINUTE, &what, || {
        let full = full.clone();
        async move {
            let traces = jaeger.traces("machine-controller", &full).await?;
            let mut seen = Vec::new();
            for t in traces {
                let Some(client) = t
                    .spans
                    .iter()
                    .find(|s| s.name == full && s.tags.get("span.kind").map(String::as_str) == Some("client"))
                else {
                    continue;
                };
                let request_id = client.tags.get("request.id").cloned().unwrap_or_default();
                if !request_ids.contains(&request_id) {
                    seen.push(format!("another call ({request_id})"));
                    continue;
                }
                let parent = client.parent.as_deref().and_then(|p| t.span(p));
                let server = t.children(&client.id).into_iter().find(|s| s.service == "fake-driver");
                let cloud = server
                    .and_then(|s| t.children(&s.id).into_iter().find(|c| c.name == format!("fake-cloud {method}")));
                match (parent, server, cloud) {
                    (Some(p), Some(s), Some(_)) => {
                        assert_eq!(
                            (p.service.as_str(), p.name.as_str()),
                            ("machine-controller", "reconcile"),
                            "{}",
                            t.tree()
                        );
                        assert_eq!(s.name, full, "{}", t.tree());
                        let tag = |k: &str| s.tags.get(k).map(String::as_str);
                        assert_eq!(tag("request.id"), Some(request_id.as_str()), "the same request ID on both sides");
                        assert_eq!(tag("span.kind"), Some("server"));
                        assert_eq!(tag("rpc.system.name"), Some("grpc"));
                        assert_eq!(tag("rpc.method"), Some(full.as_str()));
                        assert_eq!(tag("rpc.response.status_code"), Some("OK"));
                        assert_eq!(tag("server.address"), Some(socket), "the Unix socket's path");
                        assert_eq!(client.tags.get("server.address").map(String::as_str), Some(socket));
                        assert_eq!(client.tags.get("rpc.response.status_code").map(String::as_str), Some("OK"));
                        return Ok(t);
                    }
                    _ => seen.push(format!("a partial trace:\n{}", t.tree())),
                }
            }
            Err(format!("{seen:?}"))
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_and_a_rollout_are_one_trace_each_from_controller_to_cloud_in_jaeger() {
    let jaeger = Jaeger::start().await;
    let otel = [("OTEL_EXPORTER_OTLP_ENDPOINT", jaeger.otlp.as_str()), ("OTEL_BSP_SCHEDULE_DELAY", "100")];
    let w = World::builder()
        .driver(Driver::fake(FAST).env(otel))
        .controller_env(otel)
        .controller_args(&["--resync-interval", "5s"])
        .start()
        .await;
    let socket = w.sidecar().socket.to_string_lossy().into_owned();
    w.apply(
        "apiVersion: machine.driver.dev/v1alpha1\nkind: MachineClass\nmetadata: {name: small}\nspec:\n  driver: fake\n  providerSpec: {machineType: small}\n",
    )
    .await;
    let md = |image: &str| {
        format!(
            "apiVersion: machine.driver.dev/v1alpha1\nkind: MachineDeployment\nmetadata: {{name: web}}\nspec:\n  replicas: 1\n  template:\n    spec:\n      classRef: {{name: small}}\n      providerSpec: {{image: {image}}}\n"
        )
    };
    w.apply(&md("os-1")).await;
    w.converged("web", MINUTE).await;
    let first = w.machines().await;
    let ids: Vec<String> = first.iter().flat_map(|m| m.status.request_ids.clone()).collect();
    let created = joined_trace(&jaeger, "CreateMachine", &ids, &socket).await;
    eprintln!("the create, as Jaeger's API returns it:\n{}", created.tree());

    // The rollout: a new machine, then the old one deleted, each call its own joined trace.
    w.apply(&md("os-2")).await;
    w.converged("web", MINUTE).await;
    let old: Vec<String> = first.iter().map(|m| m.metadata.name.clone()).collect();
    let second = w.machines().await;
    assert!(second.iter().all(|m| !old.contains(&m.metadata.name)), "the rollout replaced the machine");
    let ids: Vec<String> = second.iter().flat_map(|m| m.status.request_ids.clone()).collect();
    let replacement = joined_trace(&jaeger, "CreateMachine", &ids, &socket).await;
    eprintln!("the rollout's create:\n{}", replacement.tree());
    // The old Machine is gone with its status: its delete call is found by the old machine's name.
    let traces = jaeger.traces("machine-controller", "machinedriver.v1.Machines/DeleteMachine").await.unwrap();
    let delete = traces
        .iter()
        .find(|t| {
            t.spans.iter().any(|s| s.name == "reconcile" && s.tags.get("object.name").is_some_and(|n| old.contains(n)))
        })
        .unwrap_or_else(|| panic!("no DeleteMachine trace of {old:?}: {traces:?}"));
    let client =
        delete.spans.iter().find(|s| s.name.ends_with("/DeleteMachine") && s.service == "machine-controller").unwrap();
    let server =
        delete.children(&client.id).into_iter().find(|s| s.service == "fake-driver").expect("the sidecar's span");
    assert_eq!(server.tags.get("request.id"), client.tags.get("request.id"));
    eprintln!("the rollout's delete:\n{}", delete.tree());
}
