//! `MachineHealthCheck`: deletes unhealthy Machines of deployments and pools, which replace them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::checks::{self, Check};
use super::kind::{Column, ColumnType, KindInfo, Shown, Via};
use super::meta::{is_default, KindOf, Object};
use super::state::{wire_enum, ConditionStatus};
use super::status::Condition;
use super::template::IntOrPercent;
use crate::registry::Kind;

/// Which objects something applies to: those carrying every one of these labels.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LabelSelector {
    /// Labels an object must all carry.
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

impl LabelSelector {
    /// Whether `labels` carry every label of the selector.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.match_labels.iter().all(|(k, v)| labels.get(k) == Some(v))
    }
}

/// A condition of a Machine's Node that makes the Machine unhealthy once it has held this long.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UnhealthyCondition {
    /// The Node condition: `Ready` (the controller follows a Node's Ready condition, which the
    /// Machine mirrors as its `NodeReady` condition).
    #[serde(rename = "type")]
    pub condition_type: NodeConditionType,
    /// `False` or `Unknown`.
    pub status: ConditionStatus,
    /// How long the condition must hold (seconds).
    #[schemars(range(min = 0))]
    pub timeout_seconds: u64,
}

wire_enum! {
    /// The Node conditions a health check can follow.
    pub enum NodeConditionType {
        /// The Node's `Ready` condition, which the Machine mirrors as its `NodeReady` condition.
        Ready,
    }
}

/// Desired state of a MachineHealthCheck.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MachineHealthCheckSpec {
    /// The Machines it checks (at least one label).
    pub selector: LabelSelector,
    /// Node conditions that make a Machine unhealthy. A Machine whose phase is `Failed` is
    /// unhealthy too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unhealthy_conditions: Vec<UnhealthyCondition>,
    /// Remediation stops while more Machines than this are unhealthy (default `100%`): a
    /// number or a percentage of the checked Machines (rounded down). A Machine whose Node
    /// condition is unhealthy counts from the moment it is, before its timeout runs out, so a
    /// zone going dark is seen whole before the first timeout.
    #[serde(default = "all_machines")]
    pub max_unhealthy: IntOrPercent,
    /// `Remediate` (default): unhealthy Machines are marked and their owners replace them.
    /// `Observe`: they are marked and reported, never remediated.
    #[serde(default, skip_serializing_if = "is_default")]
    pub mode: HealthCheckMode,
}

/// What a MachineHealthCheck does with the unhealthy Machines it finds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum HealthCheckMode {
    /// Mark them (`HealthCheckSucceeded=False`) and ask their owners to remediate them
    /// (`OwnerRemediated=False`).
    #[default]
    Remediate,
    /// Mark and report them only (Cluster API #11826).
    Observe,
}

fn all_machines() -> IntOrPercent {
    IntOrPercent::Str("100%".into())
}

impl Default for MachineHealthCheckSpec {
    fn default() -> Self {
        Self {
            selector: LabelSelector::default(),
            unhealthy_conditions: Vec::new(),
            max_unhealthy: all_machines(),
            mode: HealthCheckMode::default(),
        }
    }
}

/// What a MachineHealthCheck found.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineHealthCheckStatus {
    /// Machines it checks (its selector's, not being deleted).
    #[serde(default)]
    pub expected_machines: i64,
    /// Of those, the healthy ones.
    #[serde(default)]
    pub current_healthy: i64,
    /// How many more Machines may be remediated before `maxUnhealthy` stops it.
    #[serde(default)]
    pub remediations_allowed: i64,
    /// The unhealthy Machines, by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unhealthy: Vec<String>,
    /// The generation last checked.
    #[serde(default, skip_serializing_if = "is_default")]
    pub observed_generation: i64,
    /// Conditions (`RemediationAllowed`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// A MachineHealthCheck: marks unhealthy Machines, and asks the deployments and pools that own
/// them to remediate them (Cluster API's MachineHealthCheck, simplified): it deletes nothing
/// itself.
pub type MachineHealthCheck = Object<MachineHealthCheckSpec, MachineHealthCheckStatus>;

impl KindOf for MachineHealthCheck {
    const KIND: Kind = Kind::MachineHealthCheck;
}

impl KindInfo for MachineHealthCheck {
    const PLURAL: &'static str = "machinehealthchecks";
    const SHORT_NAMES: &'static [&'static str] = &["mhc"];
    const ALIASES: &'static [&'static str] = &["mhc", "healthcheck", "healthchecks"];
    type Spec = MachineHealthCheckSpec;
    type Status = MachineHealthCheckStatus;
    const COLUMNS: &'static [Column] = &[
        Column::new("Expected", ColumnType::Integer, ".status.expectedMachines"),
        Column::new("Healthy", ColumnType::Integer, ".status.currentHealthy"),
        Column::new("Remediations-Allowed", ColumnType::Integer, ".status.remediationsAllowed"),
        Column::new("Max-Unhealthy", ColumnType::String, ".spec.maxUnhealthy").shown(Shown::Wide),
        Column::age(),
    ];
    // A Machine's phase, conditions and labels change its health and whether it is checked.
    const WOKEN_BY: &'static [(Kind, Via)] = &[(Kind::Machine, Via::Selector)];

    fn describe_tail(status: &Value) -> String {
        let n = |k: &str| status.get(k).and_then(Value::as_i64).unwrap_or(0);
        let mut out = format!(
            "Machines:     {} checked, {} healthy, {} more may be remediated\n",
            n("expectedMachines"),
            n("currentHealthy"),
            n("remediationsAllowed")
        );
        if let Some(names) = status.get("unhealthy").and_then(Value::as_array) {
            let names: Vec<&str> = names.iter().filter_map(Value::as_str).collect();
            out += &format!("Unhealthy:    {}\n", names.join(", "));
        }
        out
    }

    fn validate(&self) -> Check {
        if self.spec.selector.match_labels.is_empty() {
            return checks::fail("spec.selector.matchLabels", "must name at least one label");
        }
        for (i, c) in self.spec.unhealthy_conditions.iter().enumerate() {
            if c.status == ConditionStatus::True {
                return checks::fail(&format!("spec.unhealthyConditions[{i}].status"), "must be False or Unknown");
            }
        }
        if let Err(why) = self.spec.max_unhealthy.resolve(100, false) {
            return checks::fail("spec.maxUnhealthy", why);
        }
        Ok(())
    }
}
