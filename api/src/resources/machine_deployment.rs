//! `MachineDeployment`: `replicas` Machines of a template, rolled out revision by revision.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::checks::{self, Check};
use super::disruption::{self, DisruptionSpec, DisruptionStatus, RemediationSpec};
use super::failure_domain::{
    self, FailureDomain, FailureDomainBackoff, FailureDomainStatus, Rebalance, RebalanceStatus,
};
use super::kind::{Column, ColumnType, KindInfo, Shown, Via};
use super::meta::{is_default, KindOf, Object, Time};
use super::state::ConditionType;
use super::status::{condition_cell, Condition};
use super::template::{
    default_drain_timeout, default_node_startup_timeout, default_volume_detach_timeout, one, IntOrPercent,
    MachineTemplate, NodeSettings, RollingUpdate, TargetCluster,
};
use crate::registry::Kind;

/// How a deployment moves machines to a new template.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum StrategyType {
    /// Replace machines, within maxSurge / maxUnavailable.
    #[default]
    RollingUpdate,
    /// Update machines in place where the driver can (CanUpdateMachine / UpdateMachine).
    InPlace,
}

/// InPlace parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InPlaceUpdate {
    /// Machines updated at once (they count as unavailable; default 1).
    #[serde(default = "one")]
    pub max_unavailable: IntOrPercent,
    /// Replace a machine when the driver cannot apply every change in place.
    #[serde(default)]
    pub fallback_to_replace: bool,
}

impl Default for InPlaceUpdate {
    fn default() -> Self {
        Self { max_unavailable: one(), fallback_to_replace: false }
    }
}

/// Update strategy.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Strategy {
    /// RollingUpdate (default) or InPlace.
    #[serde(default, rename = "type")]
    pub strategy_type: StrategyType,
    /// RollingUpdate parameters.
    #[serde(default)]
    pub rolling_update: RollingUpdate,
    /// InPlace parameters.
    #[serde(default)]
    pub in_place: InPlaceUpdate,
}

/// Which machines go first on scale-down (after annotated, failed and unhealthy ones).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum DeletePolicy {
    /// Oldest first.
    #[default]
    Oldest,
    /// Newest first.
    Newest,
    /// Any.
    Random,
}

/// Desired state of a MachineDeployment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MachineDeploymentSpec {
    /// Number of machines.
    #[schemars(range(min = 0))]
    pub replicas: i64,
    /// The cluster-autoscaler sizes it within these bounds (it is then a node group of the
    /// controller's externalgrpc server, and `apply` leaves `replicas` to the autoscaler).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<super::autoscaling::Autoscaling>,
    /// The cluster its Nodes live in, when not the controller's default target: a kubeconfig
    /// Secret in this namespace (see the book's "Many target clusters"). Fixed once set: the
    /// machines already made stay in the cluster they joined.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_cluster: Option<TargetCluster>,
    /// The machine template; a change starts a rollout.
    pub template: MachineTemplate,
    /// How to roll out a new template.
    #[serde(default)]
    pub strategy: Strategy,
    /// Scale-down order.
    #[serde(default)]
    pub delete_policy: DeletePolicy,
    /// A rollout without progress for this long gets a ProgressDeadlineExceeded condition.
    #[serde(default = "default_progress_deadline")]
    pub progress_deadline_seconds: u64,
    /// Machines of a new revision that may fail before the rollout is aborted and rolled back.
    #[serde(default = "default_failure_budget")]
    pub failure_budget: u32,
    /// Deprecated: `remediation.maxInFlight` says the same (and wins when both are set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrent_replacements: Option<u32>,
    /// How failed and unhealthy machines are replaced.
    #[serde(default, skip_serializing_if = "is_default")]
    pub remediation: RemediationSpec,
    /// Disruption budgets: how many machines voluntary disruptions may take at once, and when.
    #[serde(default, skip_serializing_if = "is_default")]
    pub disruption: DisruptionSpec,
    /// A machine not Running this long after its create started is Failed.
    #[serde(default = "default_creation_timeout")]
    pub creation_timeout_seconds: u64,
    /// A Running machine reported unhealthy or missing this long is Failed.
    #[serde(default = "default_health_timeout")]
    pub health_timeout_seconds: u64,
    /// A machine counts as available only once it has been Ready this long (default 0).
    #[serde(default)]
    pub min_ready_seconds: u64,
    /// A machine whose VM runs but whose Node is not Ready this long after the VM came up fails
    /// with reason `NodeNotJoined` and is replaced (default 600; 0 waits forever; with a target
    /// cluster).
    #[serde(default = "default_node_startup_timeout")]
    pub node_startup_timeout_seconds: u64,
    /// The drain before a machine's deletion ends by this deadline: pods still there at the
    /// deadline minus their grace period are deleted with that grace (default 3600).
    #[serde(default = "default_drain_timeout")]
    pub drain_timeout_seconds: u64,
    /// After the drain, a deletion waits at most this long for the node's VolumeAttachments to
    /// go (default 600).
    #[serde(default = "default_volume_detach_timeout")]
    pub volume_detach_timeout_seconds: u64,
    /// Stop rolling out (scaling still happens).
    #[serde(default)]
    pub paused: bool,
    /// Spread the machines over these domains (zones): new machines go to the least-populated
    /// domain that takes machines (by weight), removals take from the most-populated.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub failure_domains: Vec<FailureDomain>,
    /// Move machines back to a domain below its share, surge-first (with failure domains).
    #[serde(default, skip_serializing_if = "is_default")]
    pub rebalance: Rebalance,
    /// How long a domain that refused a create gets no new machines.
    #[serde(default, skip_serializing_if = "is_default")]
    pub failure_domain_backoff: FailureDomainBackoff,
}

/// `progressDeadlineSeconds` by default: a Deployment's default.
pub const DEFAULT_PROGRESS_DEADLINE_SECONDS: u64 = 600;
/// `failureBudget` by default: a few failed machines of a new revision may be bad luck, more
/// are the revision.
pub const DEFAULT_FAILURE_BUDGET: u32 = 3;
/// `creationTimeoutSeconds` by default: a VM create that has not led to a Running machine in 20
/// minutes will not.
pub const DEFAULT_CREATION_TIMEOUT_SECONDS: u64 = 1200;
/// `healthTimeoutSeconds` by default.
pub const DEFAULT_HEALTH_TIMEOUT_SECONDS: u64 = 600;

fn default_progress_deadline() -> u64 {
    DEFAULT_PROGRESS_DEADLINE_SECONDS
}
fn default_failure_budget() -> u32 {
    DEFAULT_FAILURE_BUDGET
}
fn default_creation_timeout() -> u64 {
    DEFAULT_CREATION_TIMEOUT_SECONDS
}
fn default_health_timeout() -> u64 {
    DEFAULT_HEALTH_TIMEOUT_SECONDS
}

/// A revision that failed and is not applied again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BadRevision {
    /// The template hash.
    pub revision: String,
    /// Why it was abandoned.
    pub reason: String,
    /// When it was abandoned.
    pub time: Time,
}

/// A template that was fully rolled out once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RevisionRecord {
    /// The template hash.
    pub revision: String,
    /// That revision's template, applied again by a rollback.
    pub template: MachineTemplate,
}

/// The rollout in progress.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutState {
    /// Revision being rolled out.
    pub revision: String,
    /// When it started.
    pub started: Time,
    /// When it last made progress (a new machine became Running).
    pub last_progress: Time,
    /// New-revision machines that failed.
    pub failures: u32,
}

/// Where a canary stands.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum CanaryPhase {
    /// The canary machines are being made (created, or updated in place) or are not all Running,
    /// Ready and healthy yet.
    #[default]
    Progressing,
    /// Every canary machine is Running, Ready and healthy: the pause runs until `pauseUntil`.
    Pausing,
    /// The canary held through its pause: the rollout goes on at its usual pace.
    Passed,
    /// A canary machine failed for a reason that blames the revision: the rollout was aborted.
    Failed,
}

impl CanaryPhase {
    /// Its name, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            CanaryPhase::Progressing => "Progressing",
            CanaryPhase::Pausing => "Pausing",
            CanaryPhase::Passed => "Passed",
            CanaryPhase::Failed => "Failed",
        }
    }
}

/// The canary of the latest revision that had one (kept after it passed or failed, until the
/// next revision's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CanaryStatus {
    /// The revision it tests.
    pub revision: String,
    /// Where it stands.
    pub phase: CanaryPhase,
    /// Canary machines wanted (`strategy.rollingUpdate.canary.machines` resolved).
    pub wanted: i64,
    /// The canary machines (new, or updated in place, of the revision).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub machines: Vec<String>,
    /// Since when every canary machine is Running, Ready and healthy (the pause's start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_since: Option<Time>,
    /// When the pause ends (`readySince + pauseSeconds`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_until: Option<Time>,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

impl CanaryStatus {
    /// Every canary machine is ready at `now`: the pause runs from when they first all were
    /// (`readySince`, kept across reconciles and restarts) for `pause_seconds`; `Passed` once
    /// it is over, else `Pausing`. Returns whether it passed.
    pub fn pause(&mut self, now: Time, pause_seconds: u64) -> bool {
        let since = *self.ready_since.get_or_insert(now);
        let until = since + chrono::Duration::seconds(i64::try_from(pause_seconds).unwrap_or(i64::MAX / 2));
        self.pause_until = Some(until);
        self.phase = if now >= until { CanaryPhase::Passed } else { CanaryPhase::Pausing };
        self.phase == CanaryPhase::Passed
    }

    /// One of the canary machines is not (or no longer) ready: the pause starts over.
    pub fn not_ready(&mut self) {
        (self.phase, self.ready_since, self.pause_until) = (CanaryPhase::Progressing, None, None);
    }

    /// Seconds of the pause left at `now` (while Pausing).
    pub fn pause_left(&self, now: Time) -> Option<i64> {
        let until = self.pause_until.filter(|_| self.phase == CanaryPhase::Pausing)?;
        Some((until - now).num_seconds().max(0))
    }

    /// One line for a person: `revision 5f2c1 canary Pausing: 1 of 1 machine(s) (web-5f2c1-a1b2c),
    /// 20s of pause left`.
    pub fn summary(&self, now: Time) -> String {
        let names = if self.machines.is_empty() { String::new() } else { format!(" ({})", self.machines.join(", ")) };
        let mut out = format!(
            "canary of revision {}: {}, {} of {} machine(s){names}",
            self.revision,
            self.phase.as_str(),
            self.machines.len(),
            self.wanted
        );
        if let Some(left) = self.pause_left(now) {
            out += &format!(", {left}s of pause left");
        }
        if !self.message.is_empty() {
            out += &format!(": {}", self.message);
        }
        out
    }
}

/// Observed state of a MachineDeployment.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineDeploymentStatus {
    /// Generation the status describes.
    #[serde(default)]
    pub observed_generation: i64,
    /// All machines (any revision, any phase, terminating included).
    #[serde(default)]
    pub replicas: i64,
    /// Machines of the target revision.
    #[serde(default)]
    pub updated_replicas: i64,
    /// Running machines (any revision).
    #[serde(default)]
    pub ready_replicas: i64,
    /// Running machines of the target revision.
    #[serde(default)]
    pub available_replicas: i64,
    /// Failed machines.
    #[serde(default)]
    pub failed_replicas: i64,
    /// The revision machines are being moved to (the spec's, unless it was bad).
    #[serde(default)]
    pub target_revision: String,
    /// The last revision fully rolled out.
    #[serde(default)]
    pub current_revision: String,
    /// Rollout in progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutState>,
    /// The canary of the revision rolling out (or of the last one that had one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<CanaryStatus>,
    /// Revisions that failed and are not applied again (until the template changes).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bad_revisions: Vec<BadRevision>,
    /// Good revisions, newest last (for rollback).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub revision_history: Vec<RevisionRecord>,
    /// What is down, what the disruption budgets allow and what they hold back.
    #[serde(default, skip_serializing_if = "is_default")]
    pub disruption: DisruptionStatus,
    /// Each failure domain: its share, its machines, and whether it takes new ones.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failure_domains: Vec<FailureDomainStatus>,
    /// A rebalance in progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebalance: Option<Box<RebalanceStatus>>,
    /// Conditions: Available, Progressing, DisruptionBlocked, FailureDomainDegraded, Valid.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// A MachineDeployment: `replicas` Machines of a template, rolled out revision by revision.
pub type MachineDeployment = Object<MachineDeploymentSpec, MachineDeploymentStatus>;

impl KindOf for MachineDeployment {
    const KIND: Kind = Kind::MachineDeployment;
}

impl KindInfo for MachineDeployment {
    const PLURAL: &'static str = "machinedeployments";
    const SHORT_NAMES: &'static [&'static str] = &["md", "mcd"];
    const ALIASES: &'static [&'static str] = &["md", "mds", "deployment", "deployments"];
    type Spec = MachineDeploymentSpec;
    type Status = MachineDeploymentStatus;
    const COLUMNS: &'static [Column] = &[
        Column::new("Desired", ColumnType::Integer, ".spec.replicas"),
        Column::new("Current", ColumnType::Integer, ".status.replicas"),
        Column::new("Updated", ColumnType::Integer, ".status.updatedReplicas"),
        Column::new("Ready", ColumnType::Integer, ".status.readyReplicas"),
        Column::new("Available", ColumnType::Integer, ".status.availableReplicas"),
        Column::new("Revision", ColumnType::String, ".status.targetRevision").shown(Shown::Table),
        Column::age(),
        Column::new("Strategy", ColumnType::String, ".spec.strategy.type").shown(Shown::TableWide),
        Column::computed("Domains", failure_domain::domains_column).shown(Shown::TableWide),
        Column::computed("Progressing", |v| condition_cell(v, ConditionType::Progressing)).shown(Shown::TableWide),
        Column::computed("Bad-Revisions", |v| {
            let bad = v.pointer("/status/badRevisions").and_then(Value::as_array);
            let names: Vec<&str> = bad.into_iter().flatten().filter_map(|b| b.get("revision")?.as_str()).collect();
            names.join(",").chars().take(40).collect()
        })
        .shown(Shown::TableWide),
    ];
    const SCALE: bool = true;
    const WOKEN_BY: &'static [(Kind, Via)] = &[
        // A machine's phase changes what its owner plans.
        (Kind::Machine, Via::Owner),
        // A class's spec (its driver, provider spec, credentials) changes every call made with it.
        (Kind::MachineClass, Via::ClassRef),
    ];

    fn rules() -> Vec<checks::Rule> {
        let mut out = checks::replicated_rules(Kind::MachineDeployment);
        out.extend(checks::deployment_rules());
        out.extend(super::failure_domain::rules());
        out
    }

    fn validate(&self) -> Check {
        checks::template(&self.spec.template)?;
        super::autoscaling::check(self.spec.autoscaling.as_ref())?;
        failure_domain::check_domains(&self.spec.failure_domains)?;
        checks::disruption(&self.spec.disruption)
    }

    fn describe_head(status: &Value) -> String {
        describe_canary(status)
    }

    fn describe_tail(status: &Value) -> String {
        let other: serde_json::Map<String, Value> = status
            .as_object()
            .map(|o| {
                o.iter()
                    .filter(|(k, _)| {
                        !matches!(
                            k.as_str(),
                            "conditions" | "revisionHistory" | "disruption" | "canary" | "failureDomains" | "rebalance"
                        )
                    })
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect()
            })
            .unwrap_or_default();
        let yaml = serde_saphyr::to_string(&Value::Object(other)).unwrap_or_default();
        let mut out = String::from("Status:\n");
        out.extend(yaml.lines().map(|l| format!("  {l}\n")));
        out + &failure_domain::describe_domains(status) + &disruption::describe(status)
    }
}

impl MachineDeploymentSpec {
    /// The node settings its machines get.
    pub fn node_settings(&self) -> NodeSettings {
        NodeSettings {
            node_startup_timeout_seconds: self.node_startup_timeout_seconds,
            drain_timeout_seconds: self.drain_timeout_seconds,
            volume_detach_timeout_seconds: self.volume_detach_timeout_seconds,
        }
    }
}

/// The `Canary:` lines of `describe` (a MachineDeployment's or a MachinePool's `status.canary`).
pub(crate) fn describe_canary(status: &Value) -> String {
    let Some(canary) = status.get("canary").and_then(|c| serde_json::from_value::<CanaryStatus>(c.clone()).ok()) else {
        return String::new();
    };
    let mut out = format!("Canary:       revision {} {}\n", canary.revision, canary.phase.as_str());
    let time = |t: Time| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    out += &format!("  Machines:     {} of {}", canary.machines.len(), canary.wanted);
    if !canary.machines.is_empty() {
        out += &format!(" ({})", canary.machines.join(", "));
    }
    out += "\n";
    if let Some(t) = canary.ready_since {
        out += &format!("  Ready since:  {}\n", time(t));
    }
    if let Some(t) = canary.pause_until {
        let left = canary.pause_left(chrono::Utc::now()).map(|s| format!(" ({s}s left)")).unwrap_or_default();
        out += &format!("  Pause until:  {}{left}\n", time(t));
    }
    if !canary.message.is_empty() {
        out += &format!("  Message:      {}\n", canary.message);
    }
    out
}
