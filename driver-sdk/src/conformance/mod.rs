//! The conformance suite: checks that a live driver keeps the protocol's promises.
//!
//! Run it as a library ([`run`]) or as the `driver-conformance --endpoint ENDPOINT` binary. It
//! only exercises what the driver's capabilities advertise (and checks that the rest answers
//! UNIMPLEMENTED), repeats idempotent calls, tags everything it creates with a per-run label and
//! deletes it again at the end, and reports one result per check.
//!
//! The provider specs come from the schema's `examples` (the first is the spec used throughout;
//! the second, when present, is the "different spec" for conflict and update checks), or from
//! [`Config::provider_spec`] / [`Config::alt_provider_spec`].

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::time::{Duration, Instant};

use machine_driver_proto::v1 as pb;
use serde_json::Value;
use tonic::Code;

use crate::client::{CallError, DriverClient, OperationExt};
use crate::convert::{json_to_struct, struct_to_json};

mod checks;

/// The label every machine and pool created by a run carries.
pub const RUN_LABEL: &str = "machinedriver.dev/conformance-run";
/// [`Config::repeat`] by default: a second and third call catch state an idempotent call keeps
/// by mistake.
pub const DEFAULT_REPEAT: usize = 3;
/// [`Config::operation_timeout`] by default: what a real cloud's VM create takes, with room.
pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(120);
/// The longest `poll_after` a running operation may ask for (`docs/src/reference/protocol.md`,
/// Polling).
const MAX_POLL_AFTER: Duration = Duration::from_secs(300);
/// The pace of the suite's own polling: the driver's `poll_after`, within these bounds.
const POLL_MIN: Duration = Duration::from_millis(20);
/// See [`POLL_MIN`].
const POLL_MAX: Duration = Duration::from_secs(2);

/// What to test against.
#[derive(Debug, Clone)]
pub struct Config {
    /// The driver's endpoint.
    pub endpoint: String,
    /// A valid provider spec (default: the schema's first example).
    pub provider_spec: Option<Value>,
    /// Another valid, different spec (default: the schema's second example).
    pub alt_provider_spec: Option<Value>,
    /// Secrets sent with every call.
    pub secrets: HashMap<String, String>,
    /// How many times idempotent calls are repeated.
    pub repeat: usize,
    /// How long one operation may take to finish.
    pub operation_timeout: Duration,
    /// Per-call deadline ([`DEFAULT_CALL_TIMEOUT`](crate::client::DEFAULT_CALL_TIMEOUT) by default).
    pub call_timeout: Duration,
    /// A shell command (`sh -c`) that makes the cloud report one event on the machine named by
    /// `$MACHINE_NAME` (provider ID `$PROVIDER_ID`, driver `$DRIVER_ENDPOINT`). With it, a driver
    /// with the EVENTS capability is checked on a real event: redelivery until acknowledged,
    /// resume, and an idempotent acknowledgement. Without it that check is skipped.
    pub event_trigger: Option<String>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            endpoint: crate::DEFAULT_ENDPOINT.to_string(),
            provider_spec: None,
            alt_provider_spec: None,
            secrets: HashMap::new(),
            repeat: DEFAULT_REPEAT,
            operation_timeout: DEFAULT_OPERATION_TIMEOUT,
            call_timeout: crate::client::DEFAULT_CALL_TIMEOUT,
            event_trigger: None,
        }
    }
}

/// The outcome of one check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// It held.
    Passed,
    /// It did not, and why.
    Failed(String),
    /// Not applicable (capability not advertised, no second example, ...), and why.
    Skipped(String),
    /// It held, as far as the protocol requires, but the driver does something a newer driver
    /// should not (say nothing of an in-place update's disruption, ...): what and why. Not a
    /// failure: the run still succeeds.
    Warned(String),
}

/// One check's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckResult {
    /// Dotted name, e.g. `machines.create_idempotent`.
    pub name: String,
    /// What happened.
    pub outcome: Outcome,
    /// How long it took.
    pub elapsed: Duration,
}

impl fmt::Display for CheckResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.elapsed.as_millis();
        match &self.outcome {
            Outcome::Passed => write!(f, "PASS  {} ({ms} ms)", self.name),
            Outcome::Failed(why) => write!(f, "FAIL  {} ({ms} ms): {why}", self.name),
            Outcome::Skipped(why) => write!(f, "SKIP  {}: {why}", self.name),
            Outcome::Warned(why) => write!(f, "WARN  {} ({ms} ms): {why}", self.name),
        }
    }
}

/// All results of a run.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// In the order they ran.
    pub results: Vec<CheckResult>,
}

impl Report {
    fn count(&self, f: impl Fn(&Outcome) -> bool) -> usize {
        self.results.iter().filter(|r| f(&r.outcome)).count()
    }

    /// Checks that held.
    pub fn passed(&self) -> usize {
        self.count(|o| matches!(o, Outcome::Passed))
    }

    /// Checks that failed.
    pub fn failed(&self) -> usize {
        self.count(|o| matches!(o, Outcome::Failed(_)))
    }

    /// Checks skipped.
    pub fn skipped(&self) -> usize {
        self.count(|o| matches!(o, Outcome::Skipped(_)))
    }

    /// Checks that held with a warning.
    pub fn warned(&self) -> usize {
        self.count(|o| matches!(o, Outcome::Warned(_)))
    }

    /// The closing line: `N passed, N failed, N skipped`, and `, N warned` when any did.
    pub fn summary(&self) -> String {
        let mut line = format!("{} passed, {} failed, {} skipped", self.passed(), self.failed(), self.skipped());
        if self.warned() > 0 {
            line.push_str(&format!(", {} warned", self.warned()));
        }
        line
    }
}

/// A check's verdict: `Ok(())` passed, `Err(Skip)` skipped, `Err(Fail)` failed, `Err(Warn)`
/// held with a warning.
#[derive(Debug)]
pub(crate) enum NotPassed {
    Skip(String),
    Fail(String),
    Warn(String),
}

impl From<CallError> for NotPassed {
    fn from(e: CallError) -> Self {
        NotPassed::Fail(format!("unexpected error: {e}"))
    }
}

impl From<&str> for NotPassed {
    fn from(s: &str) -> Self {
        NotPassed::Fail(s.to_string())
    }
}

impl From<String> for NotPassed {
    fn from(s: String) -> Self {
        NotPassed::Fail(s)
    }
}

pub(crate) type Verdict = Result<(), NotPassed>;

macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err($crate::conformance::NotPassed::Fail(format!($($msg)+)));
        }
    };
}
pub(crate) use ensure;

/// Runs one check body (an async block over `$s`), bounded by the suite's budget, and records it.
macro_rules! check {
    ($suite:expr, $on:expr, $name:expr, |$s:ident| $body:block) => {{
        let started = std::time::Instant::now();
        let budget = $suite.budget();
        #[allow(unused_variables)]
        let verdict = {
            let $s = &mut *$suite;
            tokio::time::timeout(budget, async move { let v: $crate::conformance::Verdict = (async move $body).await; v }).await
        };
        $suite.record($name, started, verdict, $on);
    }};
}
pub(crate) use check;

/// Runs the suite; `on_result` sees each result as it happens.
///
/// # Errors
/// Only when the driver cannot be reached at all; everything else is a check result.
pub async fn run(
    config: &Config,
    mut on_result: impl FnMut(&CheckResult),
) -> Result<Report, crate::client::ConnectError> {
    let client = DriverClient::connect(&config.endpoint).await?.with_call_timeout(config.call_timeout);
    let mut suite = Suite::new(client, config.clone());
    suite.run_all(&mut on_result).await;
    Ok(suite.report)
}

pub(crate) struct Suite {
    pub(crate) client: DriverClient,
    pub(crate) config: Config,
    pub(crate) run_id: String,
    pub(crate) caps: BTreeSet<i32>,
    pub(crate) spec: Option<Value>,
    pub(crate) alt_spec: Option<Value>,
    pub(crate) schema: Value,
    report: Report,
}

impl Suite {
    fn new(client: DriverClient, config: Config) -> Self {
        let run_id = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
        Self {
            client,
            config,
            run_id,
            caps: BTreeSet::new(),
            spec: None,
            alt_spec: None,
            schema: Value::Null,
            report: Report::default(),
        }
    }

    /// How long one check may take in all, so one hung call cannot hang the suite.
    pub(crate) fn budget(&self) -> Duration {
        self.config.operation_timeout * 3 + self.config.call_timeout * 4
    }

    pub(crate) fn record(
        &mut self,
        name: &str,
        started: Instant,
        verdict: Result<Verdict, tokio::time::error::Elapsed>,
        on_result: &mut dyn FnMut(&CheckResult),
    ) {
        let outcome = match verdict {
            Ok(Ok(())) => Outcome::Passed,
            Ok(Err(NotPassed::Skip(why))) => Outcome::Skipped(why),
            Ok(Err(NotPassed::Fail(why))) => Outcome::Failed(why),
            Ok(Err(NotPassed::Warn(why))) => Outcome::Warned(why),
            Err(_) => Outcome::Failed(format!("did not finish within {:?}", self.budget())),
        };
        let result = CheckResult { name: name.to_string(), outcome, elapsed: started.elapsed() };
        on_result(&result);
        self.report.results.push(result);
    }

    pub(crate) fn has(&self, cap: pb::Capability) -> bool {
        self.caps.contains(&(cap as i32))
    }

    pub(crate) fn secrets(&self) -> Option<pb::Secrets> {
        (!self.config.secrets.is_empty()).then(|| pb::Secrets { data: self.config.secrets.clone() })
    }

    pub(crate) fn name(&self, what: &str) -> String {
        format!("conformance-{}-{what}", self.run_id)
    }

    pub(crate) fn labels(&self) -> HashMap<String, String> {
        HashMap::from([(RUN_LABEL.to_string(), self.run_id.clone())])
    }

    pub(crate) fn spec_struct(&self) -> Result<prost_types::Struct, NotPassed> {
        self.spec.as_ref().map(json_to_struct).ok_or_else(|| {
            NotPassed::Skip("no valid provider spec: pass --provider-spec or add `examples` to the schema".into())
        })
    }

    pub(crate) fn alt_spec_struct(&self) -> Result<prost_types::Struct, NotPassed> {
        self.alt_spec.as_ref().map(json_to_struct).ok_or_else(|| {
            NotPassed::Skip("no second provider spec: pass --alt-provider-spec or add a second schema example".into())
        })
    }

    pub(crate) fn create_request(&self, name: &str, spec: prost_types::Struct) -> pb::CreateMachineRequest {
        pb::CreateMachineRequest {
            name: name.to_string(),
            provider_spec: Some(spec),
            secrets: self.secrets(),
            labels: self.labels(),
            uid: String::new(),
        }
    }

    /// Polls GetOperation until the operation is done.
    pub(crate) async fn wait_done(&self, op: pb::Operation) -> Result<pb::Operation, NotPassed> {
        let deadline = Instant::now() + self.config.operation_timeout;
        let mut op = op;
        loop {
            if op.done {
                return Ok(op);
            }
            if Instant::now() >= deadline {
                return Err(NotPassed::Fail(format!(
                    "operation {} ({}) not done after {:?}",
                    op.name, op.target, self.config.operation_timeout
                )));
            }
            ensure!(!op.token.is_empty(), "running operation {} has no token", op.name);
            // A running operation says when to poll again, within reason (protocol.md, Polling).
            let poll_after = op.poll_after.as_ref().map(|d| (d.seconds, d.nanos));
            ensure!(
                matches!(poll_after, Some((s, n)) if (s > 0 || n > 0) && s >= 0 && n >= 0 && s <= MAX_POLL_AFTER.as_secs() as i64),
                "running operation {} has poll_after {poll_after:?}; it must be set, positive and at most 5 min",
                op.name
            );
            // Deliberate poll interval from the driver's poll_after, kept within sane bounds.
            tokio::time::sleep(op.poll_after().clamp(POLL_MIN, POLL_MAX)).await;
            op = self
                .client
                .get_operation(pb::GetOperationRequest { token: op.token.clone(), secrets: self.secrets() })
                .await?
                .value;
        }
    }

    /// Waits for an operation and requires it to have succeeded.
    pub(crate) async fn wait_ok(&self, op: pb::Operation) -> Result<pb::Operation, NotPassed> {
        let op = self.wait_done(op).await?;
        if let Some(err) = op.error_report() {
            return Err(NotPassed::Fail(format!("operation {} on {} failed: {err}", op.name, op.target)));
        }
        Ok(op)
    }

    async fn run_all(&mut self, on: &mut impl FnMut(&CheckResult)) {
        checks::identity(self, on).await;
        checks::transport(self, on).await;
        checks::machines(self, on).await;
        checks::in_place(self, on).await;
        checks::pools(self, on).await;
        checks::events(self, on).await;
        checks::events_delivered(self, on).await;
        checks::unadvertised(self, on).await;
        checks::cleanup(self, on).await;
    }
}

/// Requires `result` to be an error with this code (and reason, when given).
pub(crate) fn expect_error<T: fmt::Debug>(
    result: Result<crate::client::Reply<T>, CallError>,
    code: Code,
    want_reason: Option<&str>,
) -> Result<CallError, NotPassed> {
    match result {
        Ok(r) => Err(NotPassed::Fail(format!("expected {code:?}, got success: {:?}", r.value))),
        Err(e) => {
            ensure!(e.code() == code, "expected {code:?}, got {e}");
            if let Some(want) = want_reason {
                ensure!(e.reason() == want, "expected reason {want}, got {e}");
            }
            ensure!(!e.report.domain.is_empty(), "error carries no ErrorInfo domain: {e}");
            Ok(e)
        }
    }
}

/// The schema's `examples`, as specs.
pub(crate) fn schema_examples(schema: &Value) -> Vec<Value> {
    schema.get("examples").and_then(Value::as_array).cloned().unwrap_or_default()
}

/// A copy of `spec` without the first property the schema requires (an invalid spec).
pub(crate) fn without_required(schema: &Value, spec: &Value) -> Option<(String, Value)> {
    let required = schema.get("required")?.as_array()?;
    let field = required.iter().filter_map(Value::as_str).next()?.to_string();
    let mut spec = spec.clone();
    spec.as_object_mut()?.remove(&field);
    Some((field, spec))
}

pub(crate) fn spec_of(s: &prost_types::Struct) -> Value {
    struct_to_json(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(name: &str, outcome: Outcome) -> CheckResult {
        CheckResult { name: name.into(), outcome, elapsed: Duration::from_millis(3) }
    }

    #[test]
    fn a_warning_is_printed_and_counted_but_is_no_failure() {
        let mut report =
            Report { results: vec![result("a", Outcome::Passed), result("b", Outcome::Skipped("x".into()))] };
        assert_eq!(report.summary(), "1 passed, 0 failed, 1 skipped", "no warning: the line as before");
        let warned = result("in_place.disruption", Outcome::Warned("unset".into()));
        assert_eq!(warned.to_string(), "WARN  in_place.disruption (3 ms): unset");
        report.results.push(warned);
        assert_eq!((report.passed(), report.failed(), report.warned()), (1, 0, 1));
        assert_eq!(report.summary(), "1 passed, 0 failed, 1 skipped, 1 warned");
    }
}
