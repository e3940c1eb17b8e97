//! Fault-injection rules: match an RPC and a target-name glob, then answer with an error, add
//! latency, fail the operation later, drop the connection, or exit the process.

use serde::{Deserialize, Serialize};

use crate::pb;

/// What a matching rule does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultAction {
    /// Answer the call with `code` / `reason` (and RetryInfo when `retry_after_ms` is set).
    Error,
    /// Only add `latency_ms`, then serve normally.
    Delay,
    /// Accept the call; the operation it starts ends with `code` / `reason`.
    FailOperation,
    /// Close the caller's connection.
    DropConnection,
    /// Exit the sidecar process at once (exit code 3), as a crash would.
    Exit,
}

/// One rule. In a `--faults` JSON file: `[{"rpc": "CreateMachine", "target": "web-*",
/// "action": "error", "code": "UNAVAILABLE", "times": 2}]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultRule {
    /// RPC name or `*`.
    #[serde(default = "star")]
    pub rpc: String,
    /// Glob over the machine / pool name (`*`, `?`).
    #[serde(default = "star")]
    pub target: String,
    /// What to do.
    pub action: FaultAction,
    /// gRPC code name (e.g. `UNAVAILABLE`) for `error` / `fail_operation`.
    #[serde(default)]
    pub code: Option<String>,
    /// ErrorInfo reason (default `FAULT_INJECTED`).
    #[serde(default)]
    pub reason: Option<String>,
    /// The error's message (default `injected fault on RPC TARGET`).
    #[serde(default)]
    pub message: Option<String>,
    /// RetryInfo delay.
    #[serde(default)]
    pub retry_after_ms: u32,
    /// Extra latency before acting.
    #[serde(default)]
    pub latency_ms: u32,
    /// Fire this many times; 0 = always.
    #[serde(default)]
    pub times: u32,
    /// How often it fired.
    #[serde(default)]
    pub fired: u32,
    /// Only calls that place something in this zone (the provider spec's `zone` of a
    /// CreateMachine or ApplyPool); `None`: any call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    /// Only calls that place something of this capacity type (`spot`, `on-demand`: the provider
    /// spec's `capacityType`, on-demand when absent); `None`: any call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_type: Option<String>,
}

/// Where a call places something: the provider spec's zone and capacity type.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Placement<'a> {
    pub(crate) zone: &'a str,
    pub(crate) capacity_type: &'a str,
}

impl<'a> Placement<'a> {
    /// The placement a provider spec asks for (zone-a and on-demand when absent).
    pub(crate) fn of(spec: &'a serde_json::Value) -> Self {
        let field = |k: &str, default| spec.get(k).and_then(serde_json::Value::as_str).unwrap_or(default);
        Self { zone: field("zone", "zone-a"), capacity_type: field("capacityType", "on-demand") }
    }
}

fn star() -> String {
    "*".into()
}

/// Parses a gRPC code name (`UNAVAILABLE`, `resource_exhausted`, ...).
pub fn parse_code(name: &str) -> Option<tonic::Code> {
    use tonic::Code::*;
    Some(match name.to_ascii_uppercase().as_str() {
        "OK" => Ok,
        "CANCELLED" => Cancelled,
        "UNKNOWN" => Unknown,
        "INVALID_ARGUMENT" => InvalidArgument,
        "DEADLINE_EXCEEDED" => DeadlineExceeded,
        "NOT_FOUND" => NotFound,
        "ALREADY_EXISTS" => AlreadyExists,
        "PERMISSION_DENIED" => PermissionDenied,
        "RESOURCE_EXHAUSTED" => ResourceExhausted,
        "FAILED_PRECONDITION" => FailedPrecondition,
        "ABORTED" => Aborted,
        "OUT_OF_RANGE" => OutOfRange,
        "UNIMPLEMENTED" => Unimplemented,
        "INTERNAL" => Internal,
        "UNAVAILABLE" => Unavailable,
        "DATA_LOSS" => DataLoss,
        "UNAUTHENTICATED" => Unauthenticated,
        _ => return None,
    })
}

impl FaultRule {
    /// Checks the rule; the error names the field.
    ///
    /// # Errors
    /// A description of the first problem.
    pub fn validate(&self) -> Result<(), String> {
        if matches!(self.action, FaultAction::Error | FaultAction::FailOperation) {
            match &self.code {
                None => return Err("code: required for action error / fail_operation".into()),
                Some(c) if parse_code(c).is_none_or(|c| c == tonic::Code::Ok) => {
                    return Err(format!("code: {c:?} is not a gRPC error code name such as UNAVAILABLE"))
                }
                Some(_) => {}
            }
        }
        if let Some(r) = &self.reason {
            if r.is_empty() || !r.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_') {
                return Err(format!("reason: {r:?} must be UPPER_SNAKE_CASE"));
            }
        }
        Ok(())
    }

    pub(crate) fn matches(&self, rpc: &str, target: &str, at: Option<Placement<'_>>) -> bool {
        (self.rpc == "*" || self.rpc == rpc)
            && glob(&self.target, target)
            && self.zone.as_deref().is_none_or(|z| at.is_some_and(|p| p.zone == z))
            && self.capacity_type.as_deref().is_none_or(|c| at.is_some_and(|p| p.capacity_type == c))
            && (self.times == 0 || self.fired < self.times)
    }

    pub(crate) fn code(&self) -> tonic::Code {
        self.code.as_deref().and_then(parse_code).unwrap_or(tonic::Code::Unavailable)
    }

    pub(crate) fn reason(&self) -> String {
        self.reason.clone().unwrap_or_else(|| crate::FAULT_INJECTED.to_string())
    }

    pub(crate) fn message(&self, rpc: &str, target: &str) -> String {
        self.message.clone().unwrap_or_else(|| format!("injected fault on {rpc} {target}"))
    }

    pub(crate) fn from_proto(r: pb::FaultRule) -> Result<Self, String> {
        let action = match r.action.as_str() {
            "error" => FaultAction::Error,
            "delay" => FaultAction::Delay,
            "fail_operation" => FaultAction::FailOperation,
            "drop_connection" => FaultAction::DropConnection,
            "exit" => FaultAction::Exit,
            other => {
                return Err(format!(
                    "action: {other:?} is not one of error, delay, fail_operation, drop_connection, exit"
                ))
            }
        };
        let rule = FaultRule {
            rpc: if r.rpc.is_empty() { star() } else { r.rpc },
            target: if r.target.is_empty() { star() } else { r.target },
            action,
            code: Some(r.code).filter(|c| !c.is_empty()),
            reason: Some(r.reason).filter(|c| !c.is_empty()),
            message: Some(r.message).filter(|c| !c.is_empty()),
            retry_after_ms: r.retry_after_ms,
            latency_ms: r.latency_ms,
            times: r.times,
            fired: 0,
            zone: Some(r.zone).filter(|z| !z.is_empty()),
            capacity_type: Some(r.capacity_type).filter(|c| !c.is_empty()),
        };
        rule.validate()?;
        Ok(rule)
    }

    pub(crate) fn to_proto(&self) -> pb::FaultRule {
        pb::FaultRule {
            rpc: self.rpc.clone(),
            target: self.target.clone(),
            action: serde_json::to_value(self.action)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default(),
            code: self.code.clone().unwrap_or_default(),
            reason: self.reason.clone().unwrap_or_default(),
            message: self.message.clone().unwrap_or_default(),
            retry_after_ms: self.retry_after_ms,
            latency_ms: self.latency_ms,
            times: self.times,
            fired: self.fired,
            zone: self.zone.clone().unwrap_or_default(),
            capacity_type: self.capacity_type.clone().unwrap_or_default(),
        }
    }
}

/// Glob match with `*` (any run) and `?` (one character).
pub(crate) fn glob(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut pi, mut ti, mut star, mut mark) = (0, 0, None, 0);
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ti;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ti = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob("*", "anything"));
        assert!(glob("web-*", "web-12"));
        assert!(glob("w?b-*-x", "wab-1-x"));
        assert!(!glob("web-*", "db-1"));
        assert!(glob("", ""));
        assert!(!glob("", "a"));
    }

    #[test]
    fn rules_parse_from_json_and_validate() {
        let rules: Vec<FaultRule> = serde_json::from_str(
            r#"[{"rpc":"CreateMachine","target":"web-*","action":"error","code":"UNAVAILABLE","times":2}]"#,
        )
        .unwrap();
        assert!(rules[0].validate().is_ok());
        assert!(rules[0].matches("CreateMachine", "web-1", None));
        assert!(!rules[0].matches("DeleteMachine", "web-1", None));
        let bad: FaultRule = serde_json::from_str(r#"{"action":"error","code":"NOPE"}"#).unwrap();
        assert!(bad.validate().unwrap_err().starts_with("code:"));
        assert!(serde_json::from_str::<FaultRule>(r#"{"action":"error","typo":1}"#).is_err());
    }
}
