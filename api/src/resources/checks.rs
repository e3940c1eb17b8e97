//! Checks shared by `apply` and the CRDs: the helpers kinds use in
//! [`KindInfo::validate`](super::KindInfo::validate), and the [`Rule`]s they return from
//! [`KindInfo::rules`](super::KindInfo::rules) (CEL on the API server, the same function here).

use serde_json::Value;

use super::disruption::DisruptionSpec;
use super::meta::ObjectMeta;
use super::template::{MachineTemplate, NodeTemplate};
use crate::registry::Kind;

/// A check's result: the field and what is wrong with it.
pub type Check = Result<(), (String, String)>;

pub(crate) fn fail(field: &str, message: impl Into<String>) -> Check {
    Err((field.to_string(), message.into()))
}

/// The name rules of objects: the SDK's (DNS-subdomain style, `[a-z0-9.-]`, alphanumeric at
/// both ends, with the SDK's words), at most 63 characters.
pub(crate) fn name(field: &str, value: &str) -> Check {
    driver_sdk_core::check_name(value).or_else(|why| fail(field, why))?;
    if value.len() > 63 {
        return fail(field, "must be at most 63 characters");
    }
    Ok(())
}

pub(crate) fn object_or_absent(field: &str, v: Option<&Value>) -> Check {
    match v {
        None | Some(Value::Object(_)) => Ok(()),
        Some(other) => fail(field, format!("must be a mapping, got {}", json_type(other))),
    }
}

pub(crate) fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a mapping",
    }
}

pub(crate) fn meta(m: &ObjectMeta) -> Check {
    name("metadata.name", &m.name)?;
    name("metadata.namespace", &m.namespace)?;
    for (k, v) in &m.labels {
        if k.is_empty() || k.len() > 253 || v.len() > 63 {
            return fail(&format!("metadata.labels.{k}"), "label keys are 1..=253 and values at most 63 characters");
        }
    }
    Ok(())
}

pub(crate) fn template(t: &MachineTemplate) -> Check {
    name("spec.template.spec.classRef.name", &t.spec.class_ref.name)?;
    object_or_absent("spec.template.spec.providerSpec", t.spec.provider_spec.as_ref())?;
    if let Some(nt) = &t.spec.node_template {
        node_template("spec.template.spec.nodeTemplate", nt)?;
    }
    Ok(())
}

pub(crate) fn node_template(field: &str, t: &NodeTemplate) -> Check {
    for (i, taint) in t.taints.iter().enumerate() {
        if taint.key.is_empty() {
            return fail(&format!("{field}.taints[{i}].key"), "must not be empty");
        }
    }
    for k in t.labels.keys().chain(t.annotations.keys()) {
        if k.is_empty() {
            return fail(field, "label and annotation keys must not be empty");
        }
    }
    Ok(())
}

/// A rule that `apply` checks and the CRDs carry as a CEL rule (`x-kubernetes-validations`), so
/// that `machine-controller apply` and `kubectl apply` refuse the same objects, naming the same
/// field with the same message.
///
/// Besides these, both check the bounds of the CRD schema (`minimum`/`maximum`, such as
/// `replicas` ≥ 0 and every duration ≥ 0), with the API server's message ("should be greater than
/// or equal to 0").
#[derive(Debug, Clone)]
pub struct Rule {
    /// The kind the rule is about.
    pub kind: Kind,
    /// The field the rule sits on (`spec.strategy.rollingUpdate`). Like a CEL rule, it is only
    /// checked when that field is present (a default is always valid).
    pub at: &'static str,
    /// The CEL expression, with `self` the field at `at`; true when the value is valid.
    pub cel: String,
    /// The field an error names, below `at` (the CEL `fieldPath`), or empty for `at` itself.
    pub field: &'static str,
    /// The error message.
    pub message: &'static str,
    holds: fn(&Value) -> bool,
}

impl Rule {
    /// A rule of `kind` on the field `at`: `cel` for the API server, `holds` for `apply`, both
    /// true when the value is valid; an error names `at.field` (or `at`) with `message`.
    pub fn new(
        kind: Kind,
        at: &'static str,
        cel: String,
        field: &'static str,
        message: &'static str,
        holds: fn(&Value) -> bool,
    ) -> Rule {
        Rule { kind, at, cel, field, message, holds }
    }

    /// The path an error names (`spec.strategy.rollingUpdate.maxUnavailable`).
    pub fn path(&self) -> String {
        if self.field.is_empty() {
            self.at.to_string()
        } else {
            format!("{}.{}", self.at, self.field)
        }
    }

    /// Whether the rule holds for `object` (true when its field is absent).
    pub fn holds(&self, object: &Value) -> bool {
        self.violation(object).is_none()
    }

    /// The path of the first value the rule does not hold for, as the API server names it: an
    /// `at` segment `name[]` is every item of the list `name` (`spec.disruption.budgets[1]`).
    pub fn violation(&self, object: &Value) -> Option<String> {
        let segments: Vec<&str> = self.at.split('.').collect();
        let at = self.first_failing(object, &segments, String::new())?;
        Some(if self.field.is_empty() { at } else { format!("{at}.{}", self.field) })
    }

    fn first_failing(&self, v: &Value, segments: &[&str], path: String) -> Option<String> {
        let Some((key, rest)) = segments.split_first() else {
            return (!(self.holds)(v)).then_some(path);
        };
        let join = |k: &str| if path.is_empty() { k.to_string() } else { format!("{path}.{k}") };
        match key.strip_suffix("[]") {
            Some(list) => v.get(list).and_then(Value::as_array).and_then(|items| {
                items
                    .iter()
                    .enumerate()
                    .find_map(|(i, item)| self.first_failing(item, rest, join(&format!("{list}[{i}]"))))
            }),
            None => self.first_failing(v.get(*key)?, rest, join(key)),
        }
    }
}

/// Message of the int-or-percent format rule.
pub(crate) const INT_OR_PERCENT: &str = "must be an integer of at least 0 or a percentage like \"25%\"";
/// Message of the percentage range rule.
pub(crate) const PERCENT_AT_MOST_100: &str = "must not be more than 100%";
/// Message of the maxSurge/maxUnavailable rule (Kubernetes Deployments say the same).
pub(crate) const NOT_BOTH_ZERO: &str = "must not be 0 when maxSurge is 0";
/// Message of the positive-duration rules.
pub(crate) const AT_LEAST_1: &str = "must be at least 1";
/// The most machines one deployment or pool may ask for.
pub const MAX_REPLICAS: i64 = 100_000;
/// `progressDeadlineSeconds` when absent (a unit test checks it against the type's default).
pub(crate) const DEFAULT_PROGRESS_DEADLINE: u64 = 600;

/// An int-or-percent value: an integer ≥ 0, or digits with an optional `%`.
pub(crate) fn int_or_percent_ok(v: &Value) -> bool {
    match v {
        Value::Number(n) => n.as_i64().is_none_or(|n| n >= 0),
        Value::String(s) => {
            let digits = s.strip_suffix('%').unwrap_or(s);
            !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
        }
        _ => true,
    }
}

pub(crate) fn percent_at_most_100(v: &Value) -> bool {
    let Some(digits) = v.as_str().and_then(|s| s.strip_suffix('%')) else { return true };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return true;
    }
    let significant = digits.trim_start_matches('0');
    significant.len() < 3 || significant == "100"
}

/// An int-or-percent that is literally zero (`0`, `"0"`, `"0%"`).
pub(crate) fn is_zero(v: &Value) -> bool {
    match v {
        Value::Number(n) => n.as_i64() == Some(0),
        Value::String(s) => {
            let digits = s.strip_suffix('%').unwrap_or(s);
            !digits.is_empty() && digits.bytes().all(|b| b == b'0')
        }
        _ => false,
    }
}

/// CEL for [`is_zero`] of `x`.
pub(crate) fn cel_is_zero(x: &str) -> String {
    format!("(type({x}) == int ? {x} == 0 : {x}.matches('^0+%?$'))")
}

/// maxSurge (default 1) and maxUnavailable (default 0) are not both zero.
pub(crate) fn surge_or_unavailable(v: &Value) -> bool {
    !v.get("maxSurge").is_some_and(is_zero) || v.get("maxUnavailable").is_some_and(|u| !is_zero(u))
}

pub(crate) fn at_least_1(v: &Value) -> bool {
    v.as_i64().is_none_or(|n| n >= 1)
}

pub(crate) fn deadline_after_min_ready(v: &Value) -> bool {
    let field = |k: &str, default: u64| v.get(k).map_or(Some(default), Value::as_u64);
    match (field("progressDeadlineSeconds", DEFAULT_PROGRESS_DEADLINE), field("minReadySeconds", 0)) {
        (Some(deadline), Some(min_ready)) => deadline > min_ready,
        _ => true,
    }
}

/// The rules of a replicated kind (MachineDeployment, MachinePool): replicas, strategy, drain.
pub(crate) fn replicated_rules(kind: Kind) -> Vec<Rule> {
    use Kind::MachineDeployment as Md;
    let rule = Rule::new;
    let int_or_percent = "type(self) == int ? self >= 0 : self.matches('^[0-9]+%?$')".to_string();
    let percent = "type(self) == int || !self.matches('^[0-9]+%$') || self.matches('^0*(100|[0-9]?[0-9])%$')";
    let not_both_zero = format!(
        "!has(self.maxSurge) || !{} || (has(self.maxUnavailable) && !{})",
        cel_is_zero("self.maxSurge"),
        cel_is_zero("self.maxUnavailable")
    );
    let mut out = Vec::new();
    {
        out.push(rule(kind, "spec.replicas", format!("self <= {MAX_REPLICAS}"), "", "must be at most 100000", |v| {
            v.as_i64().is_none_or(|n| n <= MAX_REPLICAS)
        }));
        let (strategy, fields): (&str, &[&str]) = match kind {
            Md => (
                "spec.strategy.rollingUpdate",
                &[
                    "spec.strategy.rollingUpdate.maxSurge",
                    "spec.strategy.rollingUpdate.maxUnavailable",
                    "spec.strategy.inPlace.maxUnavailable",
                ],
            ),
            _ => ("spec.strategy", &["spec.strategy.maxSurge", "spec.strategy.maxUnavailable"]),
        };
        for &at in fields {
            out.push(rule(kind, at, int_or_percent.clone(), "", INT_OR_PERCENT, int_or_percent_ok));
            out.push(rule(kind, at, percent.to_string(), "", PERCENT_AT_MOST_100, percent_at_most_100));
        }
        out.push(rule(kind, strategy, not_both_zero.clone(), "maxUnavailable", NOT_BOTH_ZERO, surge_or_unavailable));
        let at = "spec.remediation.maxInFlight";
        out.push(rule(kind, at, int_or_percent.clone(), "", INT_OR_PERCENT, int_or_percent_ok));
        out.push(rule(kind, at, percent.to_string(), "", PERCENT_AT_MOST_100, percent_at_most_100));
        out.extend(budget_rules(kind));
        out.push(rule(
            kind,
            "spec.autoscaling",
            "self.minReplicas <= self.maxReplicas".into(),
            "maxReplicas",
            AUTOSCALING_BOUNDS,
            |v| !matches!((v["minReplicas"].as_i64(), v["maxReplicas"].as_i64()), (Some(min), Some(max)) if min > max),
        ));
        out.push(rule(
            kind,
            "spec",
            "!has(self.autoscaling) || (self.replicas >= self.autoscaling.minReplicas && \
             self.replicas <= self.autoscaling.maxReplicas)"
                .into(),
            "replicas",
            REPLICAS_WITHIN_BOUNDS,
            |v| {
                let (Some(n), Some(min), Some(max)) = (
                    v["replicas"].as_i64(),
                    v.pointer("/autoscaling/minReplicas").and_then(Value::as_i64),
                    v.pointer("/autoscaling/maxReplicas").and_then(Value::as_i64),
                ) else {
                    return true;
                };
                (min..=max).contains(&n)
            },
        ));
        out.push(rule(
            kind,
            "spec.drainTimeoutSeconds",
            "self >= 1".into(),
            "",
            "must be at least 1 (a drain always has a deadline)",
            at_least_1,
        ));
        // A canary: at least 1 machine, at most 100% (a MachineDeployment's and a MachinePool's).
        let at = match kind {
            Md => "spec.strategy.rollingUpdate.canary.machines",
            _ => "spec.strategy.canary.machines",
        };
        let format = "type(self) == int ? self >= 1 : self.matches('^[0-9]+%?$')";
        out.push(rule(kind, at, format.into(), "", CANARY_MACHINES, |v| {
            int_or_percent_ok(v) && !(v.is_number() && is_zero(v))
        }));
        out.push(rule(kind, at, percent.to_string(), "", PERCENT_AT_MOST_100, percent_at_most_100));
        let not_zero = "type(self) == int || !self.matches('^0+%?$')";
        out.push(rule(kind, at, not_zero.into(), "", CANARY_NOT_ZERO, |v| !(v.is_string() && is_zero(v))));
    }
    out
}

/// Message of the autoscaling bounds rule.
pub(crate) const AUTOSCALING_BOUNDS: &str = "must be at least minReplicas";
/// Message of the rule that keeps `replicas` within the autoscaling bounds.
pub(crate) const REPLICAS_WITHIN_BOUNDS: &str =
    "must lie within spec.autoscaling's [minReplicas, maxReplicas] (the cluster-autoscaler sizes it there)";
/// Message of the canary size format rule.
pub(crate) const CANARY_MACHINES: &str = "must be an integer of at least 1 or a percentage like \"25%\"";
/// Message of the canary size rule.
pub(crate) const CANARY_NOT_ZERO: &str =
    "must be at least 1 (or 1%): a canary of no machines is none; leave canary out";
/// The rules of a MachineDeployment only (after [`replicated_rules`]).
pub(crate) fn deployment_rules() -> Vec<Rule> {
    use Kind::MachineDeployment as Md;
    let rule = Rule::new;
    let mut out = Vec::new();
    for at in ["spec.progressDeadlineSeconds", "spec.creationTimeoutSeconds", "spec.healthTimeoutSeconds"] {
        out.push(rule(Md, at, "self >= 1".into(), "", AT_LEAST_1, at_least_1));
    }
    out.push(rule(Md, "spec.maxConcurrentReplacements", "self >= 1".into(), "", AT_LEAST_1, at_least_1));
    out.push(rule(
        Md,
        "spec",
        format!(
            "(has(self.progressDeadlineSeconds) ? self.progressDeadlineSeconds : {DEFAULT_PROGRESS_DEADLINE}) > \
             (has(self.minReadySeconds) ? self.minReadySeconds : 0)"
        ),
        "progressDeadlineSeconds",
        "must be greater than minReadySeconds",
        deadline_after_min_ready,
    ));
    out
}

/// Message of the budgets' schedule/duration rule.
pub(crate) const BUDGET_SCHEDULE: &str = "is required with a schedule, and needs one";
/// Message of the budgets' duration rule.
pub(crate) const BUDGET_DURATION: &str = "must be like 1h, 30m, 1h30m or 90s";

/// The rules the CRD can check of `spec.disruption.budgets`, on each item (the schedule's cron
/// expression and the time zone are checked by [`disruption`] and, on objects `apply` did not
/// check, reported by the controller as a `Valid=False` condition that holds what the budget
/// limits).
fn budget_rules(kind: Kind) -> Vec<Rule> {
    let int_or_percent = "type(self) == int ? self >= 0 : self.matches('^[0-9]+%?$')".to_string();
    let percent = "type(self) == int || !self.matches('^[0-9]+%$') || self.matches('^0*(100|[0-9]?[0-9])%$')";
    let machines = "spec.disruption.budgets[].machines";
    let together = "has(self.schedule) == has(self.duration)";
    vec![
        Rule::new(kind, machines, int_or_percent, "", INT_OR_PERCENT, int_or_percent_ok),
        Rule::new(kind, machines, percent.into(), "", PERCENT_AT_MOST_100, percent_at_most_100),
        Rule::new(kind, "spec.disruption.budgets[]", together.into(), "duration", BUDGET_SCHEDULE, |b| {
            b.get("schedule").is_some() == b.get("duration").is_some()
        }),
        Rule::new(
            kind,
            "spec.disruption.budgets[].duration",
            "self != '' && self.matches('^([0-9]+h)?([0-9]+m)?([0-9]+s)?([0-9]+ms)?$')".into(),
            "",
            BUDGET_DURATION,
            |d| d.as_str().is_none_or(duration_shape),
        ),
    ]
}

/// `^([0-9]+h)?([0-9]+m)?([0-9]+s)?([0-9]+ms)?$`, not empty: the CEL rule's shape of the one
/// duration grammar (`driver_sdk_core::duration`), whose values the controller checks.
fn duration_shape(d: &str) -> bool {
    let mut rest = d;
    for unit in ["h", "m", "s", "ms"] {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        let after = &rest[digits..];
        // `5ms` is not `5m` followed by something.
        let other_unit = unit == "m" && after.starts_with("ms");
        if digits > 0 && after.starts_with(unit) && !other_unit {
            rest = &after[unit.len()..];
        }
    }
    !d.is_empty() && rest.is_empty()
}

/// What a CRD cannot check of the budgets: each one's schedule, duration and time zone read.
pub(crate) fn disruption(spec: &DisruptionSpec) -> Check {
    for (i, b) in spec.budgets.iter().enumerate() {
        if let Err((field, why)) = b.check() {
            return fail(&format!("spec.disruption.budgets[{i}].{field}"), why);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_dns_rules() {
        assert!(name("metadata.name", "web-0.a").is_ok());
        for bad in ["", "-a", "a-", "Web", "a_b"] {
            assert!(name("metadata.name", bad).is_err(), "{bad}");
        }
        assert_eq!(name("metadata.name", &"a".repeat(64)), fail("metadata.name", "must be at most 63 characters"));
        assert_eq!(name("spec.classRef.name", ""), fail("spec.classRef.name", "is required"));
    }
}
