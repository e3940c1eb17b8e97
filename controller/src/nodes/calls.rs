//! Every request to the target cluster goes one way: [`Measure`], a tower layer under the
//! [`super::Target`]'s client, so the calls of [`super::Target`], the Node watch and the safety
//! probe alike
//!
//! - wait for one token bucket (`run --target-qps`, `--target-burst`),
//! - wait out a 429's `Retry-After` before the next request of that target cluster, at most
//!   [`MAX_RETRY_AFTER`] (but for an eviction's 429: a disruption budget's answer about one pod,
//!   which the drain waits out for that budget's pods alone),
//! - are counted in `controller_target_calls_total{target,verb,resource,code}` and timed in
//!   `controller_target_call_duration_seconds{target,verb,resource}` (registered with the
//!   controller's other metrics: [`crate::app::Metrics`]; `target` is `default` or the
//!   `namespace/name` of the kubeconfig Secret: [`crate::targets`]); a target closed removes
//!   its series ([`Calls::forget_series`]),
//! - and are logged: each at debug level, failures (no answer, a server error, throttling, a
//!   refused identity) as warnings — as driver calls are ([`crate::runtime::Ctx::call`]).
//!
//! Verbs and resources are the API server's own words (its audit log's): `get`, `list`,
//! `watch`, `create`, `update`, `patch`, `delete`; `nodes`, `pods`, `pods/eviction`; the code is
//! the HTTP status, or `error` when no answer came. Other 4xx answers (a Node gone, a conflict,
//! a disruption budget's refusal) are answers the caller acts on: they are logged at debug level
//! here, and by the caller as it sees fit.

use machine_driver_util::lock;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderMap, Method, Request, Response, StatusCode, Uri};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use tokio::time::Instant;

use crate::runtime::TokenBucket;

/// The longest a 429's `Retry-After` holds the target cluster's next request: what API
/// priority and fairness asks (1 s) and the Eviction API while a budget's status is stale (10 s)
/// fit, and one reconcile (30 s) still has room for a drain pass ([`super::drain::PASS_BOUND`])
/// after it.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(10);

/// The code of a request that got no answer (refused connection, timeout, TLS).
pub const NO_ANSWER: &str = "error";

/// The rate limit of one target cluster.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// Requests per second.
    pub qps: f64,
    /// Requests that pass at once before [`Limits::qps`] applies.
    pub burst: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self { qps: crate::defaults::TARGET_QPS, burst: crate::defaults::TARGET_BURST }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    target: String,
    verb: String,
    resource: String,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LatencyLabels {
    target: String,
    verb: String,
    resource: String,
}

/// The target cluster's call metrics; [`crate::app::Metrics`] registers them.
#[derive(Clone)]
pub struct CallMetrics {
    /// `controller_target_calls_total{target,verb,resource,code}`.
    calls: Family<CallLabels, Counter>,
    /// `controller_target_call_duration_seconds{target,verb,resource}`.
    seconds: Family<LatencyLabels, Histogram>,
    /// Each target's label sets, whichever connection to it made them: removed when the target
    /// is closed ([`CallMetrics::forget_target`]).
    by_target: Arc<Mutex<std::collections::HashMap<String, std::collections::HashSet<CallLabels>>>>,
}

impl Default for CallMetrics {
    fn default() -> Self {
        // The driver calls' buckets: 0.5 ms to about 12 minutes.
        let hist = || Histogram::new(exponential_buckets(0.0005, 2.5, 14));
        Self { calls: Family::default(), seconds: Family::new_with_constructor(hist), by_target: Arc::default() }
    }
}

impl CallMetrics {
    /// Registers the counter and the histogram (names without `_total`: the registry adds it).
    pub fn register(&self, r: &mut prometheus_client::registry::Registry) {
        r.register(
            "controller_target_calls",
            "Requests to the target clusters by target, verb, resource and HTTP code",
            self.calls.clone(),
        );
        r.register(
            "controller_target_call_duration_seconds",
            "Target cluster request latency by target, verb and resource",
            self.seconds.clone(),
        );
    }

    fn observe(&self, labels: CallLabels, took: Duration) {
        {
            let mut by_target = lock(&self.by_target);
            let series = by_target.entry(labels.target.clone()).or_default();
            if !series.contains(&labels) {
                series.insert(labels.clone());
            }
        }
        self.calls.get_or_create(&labels).inc();
        let CallLabels { target, verb, resource, .. } = labels;
        self.seconds.get_or_create(&LatencyLabels { target, verb, resource }).observe(took.as_secs_f64());
    }

    /// Removes every series of `target` (it was closed).
    pub fn forget_target(&self, target: &str) {
        let gone = lock(&self.by_target).remove(target).unwrap_or_default();
        for labels in gone {
            self.calls.remove(&labels);
            let CallLabels { target, verb, resource, .. } = labels;
            self.seconds.remove(&LatencyLabels { target, verb, resource });
        }
    }
}

/// What one target cluster's requests share: the rate limit, the `Retry-After` hold, the metrics,
/// whether its probe finds it down and whether it refused the credentials.
pub struct Calls {
    /// The `target` label of its metrics.
    label: String,
    limiter: TokenBucket,
    /// No request before this (a 429's `Retry-After`).
    not_before: Mutex<Option<Instant>>,
    /// Set once the controller's metrics are registered ([`Calls::report_to`]).
    metrics: OnceLock<CallMetrics>,
    /// Its probe failed last ([`crate::safety::probe`]): calls fail at once instead of waiting
    /// for an answer that does not come (a dead cluster must not hold the shared workers).
    down: AtomicBool,
    /// It answered 401: the credentials are revoked or rotated; the connection is built again
    /// from its Secret ([`crate::targets`]).
    unauthorized: AtomicBool,
}

impl Calls {
    /// Requests within `limits`, measured as `target` (`default` or `namespace/name`).
    pub fn new(limits: Limits, target: &str) -> Self {
        Self {
            label: target.to_string(),
            limiter: TokenBucket::new(limits.qps, limits.burst),
            not_before: Mutex::new(None),
            metrics: OnceLock::new(),
            down: AtomicBool::new(false),
            unauthorized: AtomicBool::new(false),
        }
    }

    /// Removes its target's series from the metrics (the target is closed), those of earlier
    /// connections to it too.
    pub fn forget_series(&self) {
        if let Some(m) = self.metrics.get() {
            m.forget_target(&self.label);
        }
    }

    /// Records what its probe found: while down, calls fail at once.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::Relaxed);
    }

    /// Whether its probe failed last.
    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::Relaxed)
    }

    /// Whether it answered 401 since the connection was built.
    pub fn refused_credentials(&self) -> bool {
        self.unauthorized.load(Ordering::Relaxed)
    }

    /// Counts and times every request from now on in `metrics` (the first call wins).
    pub fn report_to(&self, metrics: CallMetrics) {
        let _ = self.metrics.set(metrics);
    }

    /// How long until the next request may go: what is left of a 429's `Retry-After`.
    pub fn hold_left(&self) -> Duration {
        let at = *lock(&self.not_before);
        at.map(|at| at.saturating_duration_since(Instant::now())).unwrap_or_default()
    }

    /// Holds every request for `d` (at most [`MAX_RETRY_AFTER`]); a longer hold already there
    /// stays.
    fn hold(&self, d: Duration) {
        let until = Instant::now() + d.min(MAX_RETRY_AFTER);
        let mut at = lock(&self.not_before);
        if at.is_none_or(|at| at < until) {
            *at = Some(until);
        }
    }

    /// Waits out the hold, then for a token.
    async fn admit(self: Arc<Self>) {
        loop {
            let wait = self.hold_left();
            if wait.is_zero() {
                break;
            }
            // Deliberate: the server asked for this pause (Retry-After).
            tokio::time::sleep(wait).await;
        }
        self.limiter.acquire().await;
    }

    /// Records an answer: metrics, the log, and the hold a 429 asks for.
    fn answered(&self, call: &Call, status: StatusCode, headers: &HeaderMap, took: Duration) {
        let code = status.as_u16().to_string();
        self.observe(call, &code, took);
        if status == StatusCode::UNAUTHORIZED {
            self.unauthorized.store(true, Ordering::Relaxed);
        }
        let ms = took.as_secs_f64() * 1000.0;
        let (verb, resource, path) = (call.verb, &call.resource, &call.path);
        let retry_after = (status == StatusCode::TOO_MANY_REQUESTS).then(|| retry_after(headers)).flatten();
        // An eviction's 429 is a disruption budget's answer about that pod (its Retry-After: the
        // budget's status is behind), not the server's load: the drain waits it out for the
        // pods of that budget ([`super::drain::Refusal::retry_after`]); other calls go on.
        let retry_after = retry_after.filter(|_| !call.is_eviction());
        if call.is_eviction() && status == StatusCode::TOO_MANY_REQUESTS {
            tracing::debug!("http.path" = %path, "target call {verb} {resource}: {code} (a disruption budget) in {ms:.1} ms");
        } else if let Some(d) = retry_after {
            self.hold(d);
            let held = d.min(MAX_RETRY_AFTER);
            tracing::warn!(
                "http.path" = %path,
                "target call {verb} {resource} throttled ({code}): no request to the target cluster for {held:?}"
            );
        } else if status.is_server_error() || status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
            tracing::warn!("http.path" = %path, "target call {verb} {resource} failed: {code} after {ms:.1} ms");
        } else {
            tracing::debug!("http.path" = %path, "target call {verb} {resource}: {code} in {ms:.1} ms");
        }
    }

    /// Records a request that got no answer.
    fn failed(&self, call: &Call, error: &dyn std::fmt::Display, took: Duration) {
        self.observe(call, NO_ANSWER, took);
        let (verb, resource, path) = (call.verb, &call.resource, &call.path);
        tracing::warn!("http.path" = %path, "target call {verb} {resource} failed: {error}");
    }

    fn observe(&self, call: &Call, code: &str, took: Duration) {
        if let Some(m) = self.metrics.get() {
            let labels = CallLabels {
                target: self.label.clone(),
                verb: call.verb.to_string(),
                resource: call.resource.clone(),
                code: code.to_string(),
            };
            m.observe(labels, took);
        }
    }
}

/// One request, as the metrics and the log name it.
struct Call {
    verb: &'static str,
    resource: String,
    path: String,
}

impl Call {
    /// A `POST …/pods/NAME/eviction`.
    fn is_eviction(&self) -> bool {
        self.verb == "create" && self.resource == "pods/eviction"
    }
}

/// The `Retry-After` of an answer, in seconds (the form the API server writes); `None` without
/// one, or for 0.
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let seconds: u64 = headers.get(http::header::RETRY_AFTER)?.to_str().ok()?.trim().parse().ok()?;
    (seconds > 0).then(|| Duration::from_secs(seconds))
}

/// A request's verb and resource as the API server names them: `GET /api/v1/nodes?watch=true`
/// is (`watch`, `nodes`), `POST /api/v1/namespaces/NS/pods/NAME/eviction` is (`create`,
/// `pods/eviction`), `GET /version` is (`get`, `version`).
pub fn classify(method: &Method, uri: &Uri) -> (&'static str, String) {
    let segments: Vec<&str> = uri.path().split('/').filter(|s| !s.is_empty()).collect();
    let rest = match segments.as_slice() {
        ["api", _, rest @ ..] | ["apis", _, _, rest @ ..] => rest,
        // Discovery and the server's own paths (`/version`, `/readyz`): one resource each.
        other => {
            let verb = if *method == Method::GET { "get" } else { verb_of(method, true, false) };
            return (verb, other.join("/"));
        }
    };
    let rest = match rest {
        ["namespaces", _namespace, inner @ ..] if !inner.is_empty() => inner,
        rest => rest,
    };
    let (resource, item) = match rest {
        [] => ("discovery".to_string(), false),
        [resource] => (resource.to_string(), false),
        [resource, _name] => (resource.to_string(), true),
        [resource, _name, sub, ..] => (format!("{resource}/{sub}"), true),
    };
    let watch = uri.query().is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"));
    (verb_of(method, item, watch), resource)
}

fn verb_of(method: &Method, item: bool, watch: bool) -> &'static str {
    match *method {
        Method::GET if watch => "watch",
        Method::GET if item => "get",
        Method::GET => "list",
        Method::POST => "create",
        Method::PUT => "update",
        Method::PATCH => "patch",
        Method::DELETE if item => "delete",
        Method::DELETE => "deletecollection",
        _ => "other",
    }
}

/// The layer that sends a client's requests through [`Calls`].
#[derive(Clone)]
pub struct Measure(pub Arc<Calls>);

impl<S> tower::Layer<S> for Measure {
    type Service = Measured<S>;

    fn layer(&self, inner: S) -> Measured<S> {
        Measured { inner, calls: self.0.clone(), admission: Admission::Idle }
    }
}

/// A service whose requests wait for [`Calls`]' rate limit and hold, and are measured.
pub struct Measured<S> {
    inner: S,
    calls: Arc<Calls>,
    admission: Admission,
}

/// Where the next request stands with the rate limit: `poll_ready` waits for it, so requests
/// queue in the client's buffer, in order, while in-flight ones go on.
enum Admission {
    Idle,
    Waiting(Pin<Box<dyn Future<Output = ()> + Send>>),
    Admitted,
}

impl<S, B, RB> tower::Service<Request<B>> for Measured<S>
where
    S: tower::Service<Request<B>, Response = Response<RB>>,
    S::Future: Send + 'static,
    S::Error: std::fmt::Display + Send + 'static,
    RB: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        loop {
            match &mut self.admission {
                Admission::Idle => self.admission = Admission::Waiting(Box::pin(self.calls.clone().admit())),
                Admission::Waiting(admit) => {
                    std::task::ready!(admit.as_mut().poll(cx));
                    self.admission = Admission::Admitted;
                }
                Admission::Admitted => return self.inner.poll_ready(cx),
            }
        }
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        self.admission = Admission::Idle;
        let (verb, resource) = classify(req.method(), req.uri());
        let call = Call { verb, resource, path: req.uri().path().to_string() };
        let calls = self.calls.clone();
        let started = Instant::now();
        let answer = self.inner.call(req);
        Box::pin(async move {
            let result = answer.await;
            let took = started.elapsed();
            match &result {
                Ok(response) => calls.answered(&call, response.status(), response.headers(), took),
                Err(e) => calls.failed(&call, e, took),
            }
            result
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::registry::Registry;
    use tower::{Layer, Service, ServiceExt};

    #[test]
    fn requests_are_named_as_the_api_server_names_them() {
        let cases = [
            ("GET", "/api/v1/nodes?watch=true&resourceVersion=5", ("watch", "nodes")),
            ("GET", "/api/v1/nodes?&watch=1", ("watch", "nodes")),
            ("GET", "/api/v1/nodes", ("list", "nodes")),
            ("GET", "/api/v1/pods?fieldSelector=spec.nodeName%3Dn1", ("list", "pods")),
            ("GET", "/api/v1/nodes/n1", ("get", "nodes")),
            ("PATCH", "/api/v1/nodes/n1", ("patch", "nodes")),
            ("DELETE", "/api/v1/nodes/n1", ("delete", "nodes")),
            ("POST", "/api/v1/namespaces/shop/pods/web-1/eviction", ("create", "pods/eviction")),
            ("DELETE", "/api/v1/namespaces/shop/pods/web-1", ("delete", "pods")),
            ("GET", "/apis/policy/v1/namespaces/shop/poddisruptionbudgets/web", ("get", "poddisruptionbudgets")),
            ("GET", "/apis/storage.k8s.io/v1/volumeattachments", ("list", "volumeattachments")),
            ("PUT", "/apis/machine.driver.dev/v1alpha1/namespaces/a/machines/m/status", ("update", "machines/status")),
            ("DELETE", "/api/v1/namespaces/shop/pods", ("deletecollection", "pods")),
            ("GET", "/api/v1/namespaces/shop", ("get", "namespaces")),
            ("GET", "/api/v1/namespaces", ("list", "namespaces")),
            ("GET", "/version", ("get", "version")),
            ("GET", "/apis/policy/v1", ("list", "discovery")),
        ];
        for (method, uri, (verb, resource)) in cases {
            let got = classify(&method.parse().unwrap(), &uri.parse().unwrap());
            assert_eq!(got, (verb, resource.to_string()), "{method} {uri}");
        }
    }

    #[test]
    fn retry_after_is_read_in_seconds() {
        let headers = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(http::header::RETRY_AFTER, v.parse().unwrap());
            h
        };
        assert_eq!(retry_after(&headers("3")), Some(Duration::from_secs(3)));
        assert_eq!(retry_after(&headers("0")), None);
        assert_eq!(
            retry_after(&headers("Wed, 21 Oct 2015 07:28:00 GMT")),
            None,
            "dates are not sent by the API server"
        );
        assert_eq!(retry_after(&HeaderMap::new()), None);
    }

    type Server = tower::util::BoxService<Request<()>, Response<()>, std::convert::Infallible>;

    /// A service answering each request with the next status of `answers` (and `Retry-After: 2`
    /// on a 429), recording when each request reached it.
    fn server(answers: Vec<u16>) -> (Server, Arc<Mutex<Vec<Instant>>>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let answers = Arc::new(Mutex::new(answers.into_iter()));
        let log = seen.clone();
        let service = tower::service_fn(move |_req: Request<()>| {
            log.lock().unwrap().push(Instant::now());
            let status = answers.lock().unwrap().next().unwrap_or(200);
            let mut builder = Response::builder().status(status);
            if status == 429 {
                builder = builder.header("retry-after", "2");
            }
            std::future::ready(Ok(builder.body(()).unwrap()))
        });
        (tower::util::BoxService::new(service), seen)
    }

    fn request(method: &str, uri: &str) -> Request<()> {
        Request::builder().method(method).uri(uri).body(()).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn every_request_is_counted_and_a_429_holds_the_next_for_its_retry_after() {
        let calls = Arc::new(Calls::new(Limits { qps: 1000.0, burst: 1000 }, "default"));
        let metrics = CallMetrics::default();
        calls.report_to(metrics.clone());
        let (inner, seen) = server(vec![201, 429, 429, 200]);
        let mut svc = Measure(calls.clone()).layer(inner);
        let evict = || request("POST", "/api/v1/namespaces/shop/pods/web-1/eviction");
        let patch = || request("PATCH", "/api/v1/nodes/n1");
        svc.ready().await.unwrap().call(evict()).await.unwrap();
        svc.ready().await.unwrap().call(evict()).await.unwrap();
        assert_eq!(calls.hold_left(), Duration::ZERO, "an eviction's 429 is its budget's answer, not throttling");
        svc.ready().await.unwrap().call(patch()).await.unwrap();
        assert!(calls.hold_left() > Duration::from_millis(1900), "{:?}", calls.hold_left());
        svc.ready().await.unwrap().call(patch()).await.unwrap();
        let seen = seen.lock().unwrap().clone();
        assert!(seen[2] - seen[1] < Duration::from_millis(1), "no hold after the eviction's 429");
        assert!(seen[3] - seen[2] >= Duration::from_secs(2), "the next request waited out Retry-After");

        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            r#"controller_target_calls_total{target="default",verb="create",resource="pods/eviction",code="201"} 1"#,
            r#"controller_target_calls_total{target="default",verb="create",resource="pods/eviction",code="429"} 1"#,
            r#"controller_target_calls_total{target="default",verb="patch",resource="nodes",code="429"} 1"#,
            r#"controller_target_calls_total{target="default",verb="patch",resource="nodes",code="200"} 1"#,
            r#"controller_target_call_duration_seconds_count{target="default",verb="create",resource="pods/eviction"} 2"#,
        ] {
            assert!(text.contains(line), "no {line} in\n{text}");
        }
        // The target closed: its series go.
        calls.forget_series();
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(!text.contains("target=\"default\""), "series left behind:\n{text}");
    }

    #[tokio::test(start_paused = true)]
    async fn requests_wait_for_the_rate_limit() {
        let calls = Arc::new(Calls::new(Limits { qps: 10.0, burst: 2 }, "default"));
        let (inner, seen) = server(vec![]);
        let mut svc = Measure(calls).layer(inner);
        for _ in 0..4 {
            svc.ready().await.unwrap().call(request("GET", "/api/v1/nodes")).await.unwrap();
        }
        let seen = seen.lock().unwrap().clone();
        assert!(seen[1] - seen[0] < Duration::from_millis(1), "the burst passes at once");
        assert!(seen[3] - seen[1] >= Duration::from_millis(190), "then 10 per second: {:?}", seen[3] - seen[1]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_retry_after_is_bounded() {
        let calls = Calls::new(Limits::default(), "default");
        calls.hold(Duration::from_secs(3600));
        assert!(calls.hold_left() <= MAX_RETRY_AFTER);
        calls.hold(Duration::from_secs(1));
        assert!(calls.hold_left() > Duration::from_secs(9), "a shorter hold does not shorten a longer one");
    }
}
