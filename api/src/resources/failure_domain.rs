//! Failure domains: one MachineDeployment spread over zones (`spec.failureDomains`), with
//! fail-over from a domain that refuses creates, surge-first rebalancing when it recovers
//! (`spec.rebalance`), and what the owner reports per domain (`status.failureDomains`).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::checks::{self, Check, Rule};
use super::meta::Time;
use crate::registry::Kind;

/// One failure domain: a zone (or any place that fails on its own) machines can be put in.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FailureDomain {
    /// The domain's name (recorded on each machine as `spec.failureDomain`).
    #[schemars(length(min = 1, max = 63))]
    pub name: String,
    /// Provider-spec fields that put a machine in this domain, merged over the template's (a
    /// JSON merge patch): `{zone: zone-a}` for the fake cloud, `{availabilityZone: eu-west-1a}`
    /// for AWS, `{zones: ["2"]}` for Azure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_spec: Option<Value>,
    /// Its share of the machines relative to the other domains' weights (default 1).
    #[serde(default = "one_u32")]
    #[schemars(range(min = 1, max = 1000))]
    pub weight: u32,
    /// Which domains are tried first (default 0; higher first): new machines go only to the
    /// open domains of the highest priority, lower ones take machines while every higher one is
    /// closed, and their machines move back surge-first once one opens again. Spot first with
    /// on-demand as the fallback is `priority: 1` on the spot domains.
    #[serde(default, skip_serializing_if = "is_zero_i32")]
    #[schemars(range(min = -1000, max = 1000))]
    pub priority: i32,
}

fn is_zero_i32(n: &i32) -> bool {
    *n == 0
}

fn one_u32() -> u32 {
    1
}

/// Moving machines back to a domain that has fewer than its share (after it recovered).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Rebalance {
    /// Rebalance at all (default true).
    #[serde(default = "yes")]
    pub enabled: bool,
    /// The largest difference in machines per unit of weight between two available domains
    /// that is left alone (default 1).
    #[serde(default = "one_u32")]
    #[schemars(range(min = 1))]
    pub max_skew: u32,
}

fn yes() -> bool {
    true
}

impl Default for Rebalance {
    fn default() -> Self {
        Self { enabled: true, max_skew: 1 }
    }
}

/// How long a domain that refused a create for capacity or availability gets no new machines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FailureDomainBackoff {
    /// The first time (default 60); each refusal after the domain was tried again doubles it.
    #[serde(default = "default_backoff_initial")]
    #[schemars(range(min = 1))]
    pub initial_seconds: u64,
    /// The longest (default 1800).
    #[serde(default = "default_backoff_max")]
    #[schemars(range(min = 1))]
    pub max_seconds: u64,
}

/// `failureDomainBackoff.initialSeconds` by default (Karpenter keeps an insufficient-capacity
/// offering out for 3 minutes; a minute retries a zone that recovered sooner).
pub const DEFAULT_BACKOFF_INITIAL_SECONDS: u64 = 60;
/// `failureDomainBackoff.maxSeconds` by default.
pub const DEFAULT_BACKOFF_MAX_SECONDS: u64 = 1800;

fn default_backoff_initial() -> u64 {
    DEFAULT_BACKOFF_INITIAL_SECONDS
}
fn default_backoff_max() -> u64 {
    DEFAULT_BACKOFF_MAX_SECONDS
}

impl Default for FailureDomainBackoff {
    fn default() -> Self {
        Self { initial_seconds: DEFAULT_BACKOFF_INITIAL_SECONDS, max_seconds: DEFAULT_BACKOFF_MAX_SECONDS }
    }
}

/// What an owner reports of one of its failure domains.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FailureDomainStatus {
    /// The domain.
    pub name: String,
    /// Its share of `replicas` (by weight, over the domains that take machines now).
    #[serde(default)]
    pub desired: i64,
    /// Machines in it (not being deleted).
    #[serde(default)]
    pub current: i64,
    /// Available machines in it.
    #[serde(default)]
    pub available: i64,
    /// It gets no new machines until then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unavailable_until: Option<Time>,
    /// Why (`InsufficientCapacity`, `ZoneUnavailable`, `QuotaExceeded`, `Degraded`,
    /// `CapacityReclaimed`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// The refusal's message (or what is unhealthy).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// The last backoff: the next refusal doubles it (up to `maxSeconds`); 0 once a machine in
    /// the domain becomes available again.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub backoff_seconds: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl FailureDomainStatus {
    /// Whether it gets no new machines at `now`.
    pub fn unavailable_at(&self, now: Time) -> bool {
        self.unavailable_until.is_some_and(|t| now < t)
    }
}

/// A rebalance in progress: a machine created in `to` before one in `from` goes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RebalanceStatus {
    /// The crowded domain a machine leaves.
    pub from: String,
    /// The domain it moves to.
    pub to: String,
    /// The new machine in `to`.
    pub machine: String,
}

/// The annotation on a machine created to rebalance: the domain it relieves and the replicas
/// the move is for (`zone-a/9`; a scale-down since then is not a rebalance).
pub const ANNOTATION_REBALANCE: &str = "machine.driver.dev/rebalance";

/// Checks `spec.failureDomains`, `spec.rebalance` and `spec.failureDomainBackoff`.
/// (Unique names and the backoff's bounds are [`rules`], CEL on the API server.)
pub(crate) fn check_domains(domains: &[FailureDomain]) -> Check {
    for (i, d) in domains.iter().enumerate() {
        checks::name(&format!("spec.failureDomains[{i}].name"), &d.name)?;
        checks::object_or_absent(&format!("spec.failureDomains[{i}].providerSpec"), d.provider_spec.as_ref())?;
        if !(-1000..=1000).contains(&d.priority) {
            return checks::fail(&format!("spec.failureDomains[{i}].priority"), "must be within -1000..=1000");
        }
    }
    Ok(())
}

/// The `Failure domains:` lines of `describe`.
pub(crate) fn describe_domains(status: &Value) -> String {
    let Some(domains) = status.get("failureDomains").and_then(Value::as_array).filter(|d| !d.is_empty()) else {
        return String::new();
    };
    let now = chrono::Utc::now();
    let mut out = String::from("Failure Domains:\n  Name            Desired  Current  Available  Unavailable\n");
    for d in domains {
        let Ok(d) = serde_json::from_value::<FailureDomainStatus>(d.clone()) else { continue };
        let until = match d.unavailable_until {
            Some(t) if now < t => {
                let left = (t - now).num_seconds();
                format!(
                    "until {} ({left}s): {}{}",
                    t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                    d.reason,
                    if d.message.is_empty() { String::new() } else { format!(": {}", d.message) }
                )
            }
            _ => "-".into(),
        };
        out += &format!("  {:<15} {:>7}  {:>7}  {:>9}  {until}\n", d.name, d.desired, d.current, d.available);
    }
    if let Some(r) = status.get("rebalance").and_then(|r| serde_json::from_value::<RebalanceStatus>(r.clone()).ok()) {
        out += &format!("  Rebalancing:  {} → {} (new machine {})\n", r.from, r.to, r.machine);
    }
    out
}

/// The `Domains` column: `zone-a:3/3 zone-b:3/3 zone-c:0/3!` (available/desired; `!` while a
/// domain takes no new machines).
pub(crate) fn domains_column(v: &Value) -> String {
    let domains = v.pointer("/status/failureDomains").and_then(Value::as_array);
    let now = chrono::Utc::now();
    let cells: Vec<String> = domains
        .into_iter()
        .flatten()
        .filter_map(|d| serde_json::from_value::<FailureDomainStatus>(d.clone()).ok())
        .map(|d| format!("{}:{}/{}{}", d.name, d.available, d.desired, if d.unavailable_at(now) { "!" } else { "" }))
        .collect();
    if cells.is_empty() {
        "-".into()
    } else {
        cells.join(" ")
    }
}

/// The rules of a MachineDeployment's failure domains that the CRD checks (CEL on the API
/// server, the same function in `apply`): unique names, and a backoff within its bounds.
pub(crate) fn rules() -> Vec<Rule> {
    let mut out = Vec::new();
    out.push(Rule::new(
        Kind::MachineDeployment,
        "spec.failureDomains",
        "self.all(d, self.exists_one(e, e.name == d.name))".into(),
        "",
        DOMAIN_NAMES_UNIQUE,
        |v| {
            let names: Vec<&str> = v.as_array().into_iter().flatten().filter_map(|d| d["name"].as_str()).collect();
            names.iter().enumerate().all(|(i, n)| !names[..i].contains(n))
        },
    ));
    out.push(Rule::new(
        Kind::MachineDeployment,
        "spec.failureDomainBackoff",
        format!(
            "(has(self.initialSeconds) ? self.initialSeconds : {DEFAULT_BACKOFF_INITIAL_SECONDS}) <= \
             (has(self.maxSeconds) ? self.maxSeconds : {DEFAULT_BACKOFF_MAX_SECONDS})"
        ),
        "initialSeconds",
        BACKOFF_WITHIN_MAX,
        |v| {
            let field = |k: &str, default: u64| v.get(k).map_or(Some(default), Value::as_u64);
            match (
                field("initialSeconds", DEFAULT_BACKOFF_INITIAL_SECONDS),
                field("maxSeconds", DEFAULT_BACKOFF_MAX_SECONDS),
            ) {
                (Some(initial), Some(max)) => initial <= max,
                _ => true,
            }
        },
    ));
    out
}

/// Message of the failure domains' unique-names rule.
pub(crate) const DOMAIN_NAMES_UNIQUE: &str = "every failure domain needs a name of its own";
/// Message of the failure-domain backoff rule.
pub(crate) const BACKOFF_WITHIN_MAX: &str = "must not be greater than maxSeconds";
