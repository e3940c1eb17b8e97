//! The MachineDeployment planner: from the deployment and its machines to what to create,
//! replace, delete, and the status to write.
//!
//! - RollingUpdate: the Kubernetes Deployment arithmetic ([`Limits`]). Terminating machines
//!   still exist in the cloud, so they count toward `replicas + maxSurge`: the cloud never holds
//!   more than that.
//! - Every machine the deployment takes away or disrupts — an old one in a rollout, one updated
//!   in place, one removed by a scale-down, a failed or unhealthy one remediated — is asked of
//!   the disruption planner ([`super::disruption`]) with its reason: `maxUnavailable`, the
//!   disruption budgets and the remediation limits are decided there, once.
//! - Remediation: failed machines, machines a MachineHealthCheck marked (`OwnerRemediated=False`)
//!   and machines annotated `machine.driver.dev/remediate` are remediated, replace before remove
//!   where the surge allows: a remediated machine is marked (so it counts as in flight across
//!   restarts), its replacement created, and it goes once no replacement is still on its way.
//! - A rollout whose new machines fail `failureBudget` times is aborted: its revision is
//!   remembered as bad and never applied again (until the template changes), and the deployment
//!   rolls back to the last good revision. A failed machine of the revision counts once: while it
//!   waits, and from the moment it is marked for remediation, in the rollout's failures.
//! - Canary (`strategy.rollingUpdate.canary`, either strategy): a rollout of a new spec revision
//!   (not a first rollout, not a rollback) first makes at most `canary.machines` machines of it
//!   (created, or updated in place), and removes old machines only as far as the surge needs
//!   to make room for them. Once every canary machine is Running, Ready and healthy for
//!   `pauseSeconds` the canary has passed (remembered in `status.canary`) and the rollout goes
//!   on at its usual pace. Until then the failure budget is 1: a canary machine that fails for
//!   its revision aborts the rollout as a spent budget does, with only the canary touched.
//! - InPlace: old machines are converted (see [`super::in_place`]); only missing machines are
//!   created and only a scale-down removes machines.
//!
//! [`plan_deployment`] runs named steps in order (choose the target, classify, track the rollout, the
//! failure budget, remediation, scale up, the remediated machines that go, scale down old, in
//! place, remove the excess, status); each records in [`Plan::notes`] why it acted or held back
//! ([`Note`]), as Cluster API's rollout planner does, so tests can assert the reason as well as
//! the action.

use std::borrow::Cow;
use std::cmp::Reverse;
use std::time::Duration;

use super::disruption::{self, Candidate, Census, Hold, Planner, Report, Verdict};
use super::domains::{self, Spread};
use super::Limits;
use crate::events::EventReason;
use crate::policy::{self, ENVIRONMENT_CONDITIONS};
use crate::resources::*;

/// The annotation older controllers set on a failed Machine they deleted for replacement: read
/// as a remediation ([`ANNOTATION_DISRUPTION`] says so now).
pub const ANNOTATION_REPLACING: &str = "machine.driver.dev/replacing";
/// Revisions kept in `revisionHistory`.
pub const HISTORY: usize = 5;

/// The revision (template hash) of a template.
/// Node metadata is not part of it: a change of `nodeTemplate` alone is carried to the existing
/// machines in place.
pub fn revision(t: &MachineTemplate) -> String {
    if t.spec.node_template.is_none() {
        return short_hash(t);
    }
    let mut without = t.clone();
    without.spec.node_template = None;
    short_hash(&without)
}

/// A Machine as the planner reads it: what decides creates, deletes, replacements and status,
/// and nothing else. With 10,000 machines the planner holds one of these per machine on every
/// reconcile, so it is kept to about 200 bytes (a whole [`Machine`] parsed is about 1.6 KB).
#[derive(Debug, Clone, PartialEq)]
pub struct Member {
    /// The Machine's name.
    pub name: String,
    /// UID (orders the Random delete policy).
    pub uid: String,
    /// The resourceVersion it was read at (acting on it reads it again only if unchanged).
    pub resource_version: String,
    /// Its revision label.
    pub revision: String,
    /// When it was created.
    pub created: Option<Time>,
    /// It is being deleted.
    pub deleting: bool,
    /// The owner took it for remediation ([`ANNOTATION_DISRUPTION`] `Remediation`, or the older
    /// [`ANNOTATION_REPLACING`]): in flight until it is gone.
    pub remediating: bool,
    /// It carries the delete-machine annotation (deleted first on scale-down).
    pub marked_for_deletion: bool,
    /// The cluster-autoscaler asked for its removal ([`ANNOTATION_DISRUPTION`] `Autoscaler`, with
    /// the delete-machine annotation): its scale-down is an `Autoscaler` disruption.
    pub by_autoscaler: bool,
    /// Why it is to be remediated, if it is: Failed, marked by a MachineHealthCheck
    /// (`OwnerRemediated=False`), or annotated [`ANNOTATION_REMEDIATE`]; never with
    /// [`ANNOTATION_SKIP_REMEDIATION`].
    pub remediation: Option<Remediation>,
    /// A MachineHealthCheck marked it unhealthy (`HealthCheckSucceeded=False`), asking for its
    /// remediation or not (a short circuit, `mode: Observe`).
    pub marked_unhealthy: bool,
    /// Its phase.
    pub phase: Phase,
    /// Its permanent failure.
    pub failure: Option<Box<Failure>>,
    /// The hash of the node template and settings it carries ([`ANNOTATION_NODE_TEMPLATE`]).
    pub node_template: String,
    /// Since when it is Ready (its `Ready` condition's transition to True), if Running.
    pub ready_since: Option<Time>,
    /// Its Node is known not to be Ready (`NodeReady` False or Unknown; only with a target
    /// cluster).
    pub node_not_ready: bool,
    /// Why it is not available yet, when that is its environment's doing (an
    /// [`ENVIRONMENT_CONDITIONS`] reason: what [`lift_environment_conditions`] reports). A
    /// machine that is merely being created carries none: 10,000 of them would hold 10,000
    /// copies of the same message in every plan.
    pub waiting: Option<Box<Waiting>>,
    /// The failure domain it was put in (`spec.failureDomain`).
    pub domain: Option<String>,
    /// It was created to rebalance: the [`ANNOTATION_REBALANCE`] value (`from/replicas`).
    pub rebalance: Option<String>,
    /// Its create was refused for capacity or availability (RESOURCE_EXHAUSTED, or UNAVAILABLE
    /// with `ZONE_UNAVAILABLE`) and it never ran: its domain, not its revision, is to blame.
    pub refusal: Option<Box<Refusal>>,
}

/// A create refused for capacity or availability: the driver's reason (UpperCamel) and message.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    /// `InsufficientCapacity`, `ZoneUnavailable`, `QuotaExceeded`, ….
    pub reason: String,
    /// What the driver said.
    pub message: String,
}

/// Why a machine is to be remediated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Remediation {
    /// Its phase is Failed (the owner's own: a driver failure, a timeout, a Node that never
    /// joined).
    Failed,
    /// A MachineHealthCheck found it unhealthy and asks its owner to remediate it.
    Unhealthy,
    /// The [`ANNOTATION_REMEDIATE`] annotation asks for it.
    Requested,
}

impl std::fmt::Display for Remediation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Remediation::Failed => "failed",
            Remediation::Unhealthy => "unhealthy (a MachineHealthCheck asks for its remediation)",
            Remediation::Requested => "remediation requested (machine.driver.dev/remediate)",
        })
    }
}

/// Why a machine that is not available waits: what [`lift_environment_conditions`] reports.
#[derive(Debug, Clone, PartialEq)]
pub struct Waiting {
    /// Its Ready condition's reason.
    pub reason: Reason,
    /// Its Ready condition's message.
    pub message: String,
    /// The driver's reason of its last operation (empty if none).
    pub operation_reason: String,
}

impl Member {
    /// Whether it counts as available: Running (with a target cluster: its Node Ready), its
    /// Node not known to be NotReady since, and not being deleted.
    pub fn is_available(&self) -> bool {
        self.phase == Phase::Running && !self.deleting && !self.node_not_ready
    }

    /// [`Member::is_available`], and Ready for at least `min_ready` at `now`
    /// (`minReadySeconds`).
    pub fn is_available_at(&self, now: Time, min_ready: chrono::Duration) -> bool {
        self.is_available() && self.ready_since.is_none_or(|t| now - t >= min_ready)
    }

    /// Whether it is down: being deleted, updating in place, failed, unknown to the cloud, or
    /// Running with its Node not Ready. (A new machine on its way up is not down.)
    pub fn is_disrupted(&self) -> bool {
        self.deleting
            || matches!(self.phase, Phase::Updating | Phase::Failed | Phase::Unknown | Phase::Terminating)
            || (self.phase == Phase::Running && self.node_not_ready)
    }
}

/// The part of a stored Machine a [`Member`] comes from, parsed one machine at a time: spec,
/// addresses, request IDs, the other labels, annotations and conditions are skipped, and the
/// strings borrow from the text where they can (a deployment's reconcile reads every Machine it
/// owns, so each allocation and timestamp parse here is paid 10,000 times). The machines a plan
/// acts on in full (replace, in place) are read again by key.
#[derive(serde::Deserialize)]
pub struct StoredMember<'a> {
    #[serde(borrow)]
    metadata: ViewMeta<'a>,
    #[serde(default, borrow)]
    spec: ViewSpec<'a>,
    #[serde(default, borrow)]
    status: ViewStatus<'a>,
}

#[derive(serde::Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct ViewSpec<'a> {
    #[serde(default, borrow)]
    failure_domain: Option<Cow<'a, str>>,
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct ViewMeta<'a> {
    #[serde(borrow)]
    name: Cow<'a, str>,
    #[serde(default, borrow)]
    namespace: Cow<'a, str>,
    #[serde(default, borrow)]
    uid: Cow<'a, str>,
    #[serde(default, borrow)]
    resource_version: Cow<'a, str>,
    #[serde(default)]
    creation_timestamp: Option<Time>,
    #[serde(default)]
    deletion_timestamp: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    generation: i64,
    #[serde(default, borrow)]
    labels: ViewLabels<'a>,
    #[serde(default, borrow)]
    annotations: ViewAnnotations<'a>,
    #[serde(default, borrow)]
    owner_references: Vec<ViewOwner<'a>>,
}

/// The one label the planner reads ([`LABEL_REVISION`]; a test holds the literal names equal to
/// the constants).
#[derive(serde::Deserialize, Default)]
struct ViewLabels<'a> {
    #[serde(rename = "machine.driver.dev/revision", default, borrow)]
    revision: Option<Cow<'a, str>>,
}

/// The annotations the planner reads ([`ANNOTATION_REPLACING`], [`ANNOTATION_DISRUPTION`],
/// [`ANNOTATION_DELETE`], [`ANNOTATION_NODE_TEMPLATE`], [`ANNOTATION_REMEDIATE`],
/// [`ANNOTATION_SKIP_REMEDIATION`]).
#[derive(serde::Deserialize, Default)]
struct ViewAnnotations<'a> {
    #[serde(rename = "machine.driver.dev/replacing", default)]
    replacing: Option<serde::de::IgnoredAny>,
    #[serde(rename = "machine.driver.dev/disruption-reason", default, borrow)]
    disruption: Option<Cow<'a, str>>,
    #[serde(rename = "machine.driver.dev/remediate", default, borrow)]
    remediate: Option<Cow<'a, str>>,
    #[serde(rename = "machine.driver.dev/skip-remediation", default, borrow)]
    skip_remediation: Option<Cow<'a, str>>,
    #[serde(rename = "machine.driver.dev/delete-machine", default, borrow)]
    delete: Option<Cow<'a, str>>,
    #[serde(rename = "machine.driver.dev/node-template-hash", default, borrow)]
    node_template: Option<Cow<'a, str>>,
    #[serde(rename = "machine.driver.dev/in-place-disruption", default)]
    in_place: Option<serde::de::IgnoredAny>,
    #[serde(rename = "machine.driver.dev/rebalance", default, borrow)]
    rebalance: Option<Cow<'a, str>>,
}

#[derive(serde::Deserialize)]
struct ViewOwner<'a> {
    #[serde(borrow)]
    uid: Cow<'a, str>,
    #[serde(default)]
    controller: bool,
}

#[derive(serde::Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct ViewStatus<'a> {
    #[serde(default)]
    phase: Phase,
    #[serde(default, borrow)]
    conditions: Vec<ViewCondition<'a>>,
    #[serde(default, borrow)]
    last_operation: Option<ViewOperation<'a>>,
    #[serde(default)]
    failure: Option<Failure>,
    #[serde(default)]
    observed_generation: i64,
}

/// A condition, its time left unparsed: only the Ready condition's is read.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct ViewCondition<'a> {
    #[serde(rename = "type")]
    condition_type: ConditionType,
    status: ConditionStatus,
    reason: Reason,
    #[serde(default, borrow)]
    message: Cow<'a, str>,
    #[serde(borrow)]
    last_transition_time: Cow<'a, str>,
}

#[derive(serde::Deserialize)]
struct ViewOperation<'a> {
    #[serde(default, borrow)]
    reason: Cow<'a, str>,
}

impl StoredMember<'_> {
    /// Whether `owner` controls it (same namespace, a controller reference with its uid).
    pub fn owned_by(&self, owner: &ObjectMeta) -> bool {
        self.metadata.namespace == owner.namespace.as_str()
            && self.metadata.owner_references.iter().any(|o| o.controller && o.uid == owner.uid.as_str())
    }

    /// The planner's view of it.
    ///
    /// # Errors
    /// A Ready condition whose transition time is not an RFC 3339 time.
    pub fn into_member(self) -> serde_json::Result<Member> {
        let m = self.metadata;
        let deleting = m.deletion_timestamp.is_some();
        let st = self.status;
        let find = |t: ConditionType| st.conditions.iter().find(|c| c.condition_type == t);
        let node_not_ready = find(ConditionType::NodeReady).is_some_and(|c| c.status != ConditionStatus::True);
        let owner_remediates = find(ConditionType::OwnerRemediated).is_some_and(|c| c.status == ConditionStatus::False);
        let marked_unhealthy =
            find(ConditionType::HealthCheckSucceeded).is_some_and(|c| c.status == ConditionStatus::False);
        let phase_failed = st.phase == Phase::Failed;
        let ready_since = match find(ConditionType::Ready) {
            Some(c) if st.phase == Phase::Running && c.status == ConditionStatus::True => Some(
                // The parse serde's `Time` uses, so the view reads what the whole Machine does.
                c.last_transition_time.parse::<Time>().map_err(|e| {
                    <serde_json::Error as serde::de::Error>::custom(format!(
                        "Ready condition's lastTransitionTime {:?}: {e}",
                        c.last_transition_time
                    ))
                })?,
            ),
            _ => None,
        };
        let refusal = refusal(&st);
        let waiting = if st.phase != Phase::Running || deleting || node_not_ready {
            let operation_reason = st.last_operation.map(|o| o.reason.into_owned()).unwrap_or_default();
            // A Running machine waits for its Node; any other for itself.
            let why =
                if st.phase == Phase::Running && !deleting { ConditionType::NodeReady } else { ConditionType::Ready };
            st.conditions
                .into_iter()
                .find(|c| c.condition_type == why)
                .filter(|c| ENVIRONMENT_CONDITIONS.into_iter().any(|kind| c.reason == Reason::from(kind)))
                .map(|ready| {
                    Box::new(Waiting { reason: ready.reason, message: ready.message.into_owned(), operation_reason })
                })
        } else {
            None
        };
        let a = m.annotations;
        // Moved to a new spec in place and not updated yet: its update counts from the patch on,
        // before its own reconcile says Updating (so the next plan does not start another).
        let update_pending =
            st.phase == Phase::Running && a.in_place.is_some() && st.observed_generation < m.generation;
        let on = |v: &Option<Cow<'_, str>>| v.as_deref().is_some_and(|v| v != "false");
        let remediation = if deleting || on(&a.skip_remediation) {
            None
        } else if phase_failed {
            Some(Remediation::Failed)
        } else if owner_remediates {
            Some(Remediation::Unhealthy)
        } else if on(&a.remediate) {
            Some(Remediation::Requested)
        } else {
            None
        };
        Ok(Member {
            name: m.name.into_owned(),
            uid: m.uid.into_owned(),
            resource_version: m.resource_version.into_owned(),
            revision: m.labels.revision.map(Cow::into_owned).unwrap_or_default(),
            created: m.creation_timestamp,
            deleting,
            remediating: a.replacing.is_some()
                || a.disruption.as_deref() == Some(DisruptionReason::Remediation.as_str()),
            marked_for_deletion: a.delete.is_some_and(|v| v != "false"),
            by_autoscaler: a.disruption.as_deref() == Some(DisruptionReason::Autoscaler.as_str()),
            remediation,
            marked_unhealthy: marked_unhealthy && !deleting,
            phase: if update_pending { Phase::Updating } else { st.phase },
            failure: st.failure.map(Box::new),
            node_template: a.node_template.map(Cow::into_owned).unwrap_or_default(),
            ready_since,
            node_not_ready,
            waiting,
            domain: self.spec.failure_domain.map(Cow::into_owned),
            rebalance: a.rebalance.map(Cow::into_owned),
            refusal: refusal.map(Box::new),
        })
    }
}

/// Whether a machine's create was refused for capacity or availability and it never ran: still
/// being created and waiting on `QuotaExceeded` (any RESOURCE_EXHAUSTED) or on `ZONE_UNAVAILABLE`,
/// or failed with one of those.
fn refusal(st: &ViewStatus<'_>) -> Option<Refusal> {
    let capacity = |code: &str, reason: &str| {
        code == "ResourceExhausted" || (code == "Unavailable" && reason == driver_sdk::reason::ZONE_UNAVAILABLE)
    };
    match st.phase {
        Phase::Pending | Phase::Creating => {
            let ready = st.conditions.iter().find(|c| c.condition_type == ConditionType::Ready)?;
            let reason = st.last_operation.as_ref().map(|o| o.reason.as_ref()).unwrap_or_default();
            let refused = ready.reason == Reason::QuotaExceeded
                || (ready.reason == Reason::CloudUnavailable && reason == driver_sdk::reason::ZONE_UNAVAILABLE);
            refused.then(|| Refusal {
                reason: if reason.is_empty() {
                    ready.reason.to_string()
                } else {
                    Reason::from_driver(reason).to_string()
                },
                message: ready.message.to_string(),
            })
        }
        Phase::Failed => {
            let f = st.failure.as_ref().filter(|f| capacity(&f.code, &f.reason))?;
            Some(Refusal { reason: Reason::from_driver(&f.reason).to_string(), message: f.message.clone() })
        }
        _ => None,
    }
}

/// A whole Machine as the planner reads it: through its stored form, the one way a Member is made.
#[cfg(test)]
impl From<&Machine> for Member {
    fn from(m: &Machine) -> Self {
        let text = serde_json::to_string(m).unwrap_or_else(|e| panic!("{}: {e}", m.metadata.name));
        let stored = serde_json::from_str::<StoredMember<'_>>(&text).and_then(StoredMember::into_member);
        stored.unwrap_or_else(|e| panic!("{}: {e}", m.metadata.name))
    }
}

/// Whether a failed machine's failure is its revision's doing (or its request's), and so counts
/// against the failure budget: [`policy::blame`]. Credentials, quota, an unavailable cloud and
/// transient errors never do.
pub fn attributable(m: &Member) -> bool {
    m.failure.as_ref().is_none_or(|f| policy::blame(&f.code, &f.reason).counts())
}

/// Scale-down order: annotated, failed, unhealthy, not yet running, updating, running; then
/// by the deployment's policy.
pub fn deletion_order(machines: &mut [&Member], policy: DeletePolicy) {
    fn rank(m: &Member) -> u8 {
        if m.marked_for_deletion {
            return 0;
        }
        match m.phase {
            Phase::Failed => 1,
            Phase::Unknown => 2,
            Phase::Running if m.node_not_ready => 2,
            Phase::Pending | Phase::Creating | Phase::Provisioned => 3,
            Phase::Updating => 4,
            Phase::Running | Phase::Terminating => 5,
        }
    }
    match policy {
        DeletePolicy::Oldest => {
            machines.sort_by(|a, b| (rank(a), a.created, &a.name).cmp(&(rank(b), b.created, &b.name)))
        }
        DeletePolicy::Newest => {
            machines.sort_by(|a, b| (rank(a), Reverse(a.created), &a.name).cmp(&(rank(b), Reverse(b.created), &b.name)))
        }
        DeletePolicy::Random => machines.sort_by_cached_key(|m| (rank(m), short_hash(&m.uid))),
    }
}

/// Sets one condition per environment problem that keeps machines from running (with the
/// driver's reason, message and request ID from one of them), and removes the others.
/// Returns the first problem found.
pub fn lift_environment_conditions(conditions: &mut Vec<Condition>, machines: &[&Member]) -> Option<ConditionType> {
    let mut first = None;
    for kind in ENVIRONMENT_CONDITIONS {
        let waiting: Vec<(&str, &Waiting)> = machines
            .iter()
            .filter_map(|m| Some((m.name.as_str(), m.waiting.as_deref()?)))
            .filter(|(_, w)| w.reason == Reason::from(kind))
            .collect();
        match waiting.first() {
            Some((name, w)) => {
                first.get_or_insert(kind);
                let reason = if w.operation_reason.is_empty() {
                    Reason::from(kind)
                } else {
                    Reason::from_driver(&w.operation_reason)
                };
                let msg = format!("{} machine(s) waiting, e.g. {name}: {}", waiting.len(), w.message);
                set_condition(conditions, kind, true, reason, &msg);
            }
            None => remove_condition(conditions, kind),
        }
    }
    first
}

/// What the deployment reconciler observed.
#[derive(Debug, Clone, Copy)]
pub struct Observed<'a> {
    /// The deployment (spec, status and metadata as read).
    pub deployment: &'a MachineDeployment,
    /// Its machines, terminating ones included.
    pub machines: &'a [Member],
    /// What halts remediation now (a MachineHealthCheck's short circuit, in words), if anything.
    pub remediation_halted: Option<&'a str>,
    /// The pace of remediations in a row: the first delay and the longest.
    pub pace: (std::time::Duration, std::time::Duration),
    /// The time to stamp on rollout bookkeeping.
    pub now: Time,
}

/// An event to record on the deployment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedEvent {
    /// Why (its type with it).
    pub reason: EventReason,
    /// For a person: the Event's message.
    pub message: String,
}

/// What to do for one deployment.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The revision machines move to: the spec's, unless it failed before.
    pub target_revision: String,
    /// Its template (`None`: the spec's revision is bad and there is nothing to roll back to).
    pub target: Option<MachineTemplate>,
    /// The rollout was aborted now: write `status` and plan again at once; nothing else.
    pub aborted: bool,
    /// Machines the deployment takes for remediation now: marked with [`ANNOTATION_DISRUPTION`]
    /// (from then on they count as in flight), each with why.
    pub mark: Vec<(String, Remediation)>,
    /// Machines taken for remediation that go now (their replacements are not awaited: none is
    /// on its way, or the surge leaves no room for one first), in order.
    pub remediate: Vec<String>,
    /// Machines of the target revision to create.
    pub create: usize,
    /// With failure domains: the domain of each machine to create, in order.
    pub placements: Vec<String>,
    /// The created machines rebalance: their [`ANNOTATION_REBALANCE`] value.
    pub rebalance: Option<String>,
    /// InPlace: old machines to try to update in place (in order), and how many may start;
    /// `None` when there is nothing to convert.
    pub in_place: Option<InPlaceWork>,
    /// Machines to delete (old revisions, scale-down, excess of the target revision), in order.
    pub delete: Vec<String>,
    /// The status to write (the in-place condition is added by whoever runs the in-place work).
    pub status: MachineDeploymentStatus,
    /// Events to record.
    pub events: Vec<PlannedEvent>,
    /// Every machine is on the target revision and running, and nothing waits for remediation.
    pub settled: bool,
    /// When to plan again without being woken: a budget's window opens or closes, the
    /// remediation pace allows the next.
    pub recheck_at: Option<Time>,
    /// What the disruption planner decided (`None` when the rollout was aborted).
    pub disruption: Option<Report>,
    /// Why it decided as it did, step by step.
    pub notes: Vec<Note>,
}

/// The InPlace strategy's share of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InPlaceWork {
    /// Old Running machines, in the order they are tried.
    pub candidates: Vec<String>,
    /// How many may start updating now (the disruption planner's answer for the first
    /// candidates in order).
    pub allowed: usize,
}

/// Why the planner did, or did not, act: one entry per decision, in the order its steps ran
/// (Cluster API's rollout planner keeps such notes). Table tests assert them; the Progressing
/// condition's message carries those that hold the deployment back ([`Note::holds_back`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    /// The spec's revision failed before: the target is the last good revision.
    RollingBack {
        /// The spec's revision, remembered as bad.
        bad: String,
        /// The last good revision.
        to: String,
    },
    /// The spec's revision failed before and no earlier revision is known: nothing is created.
    NoGoodRevision {
        /// The spec's revision.
        revision: String,
    },
    /// A rollout of `revision` began (a first rollout too, though it records no event).
    RolloutStarted {
        /// The target revision.
        revision: String,
    },
    /// Machines of `revision` failed `failures` times, reaching the failure budget: the rollout
    /// is aborted and the revision remembered as bad.
    RevisionAborted {
        /// The aborted revision.
        revision: String,
        /// Attributable failures, this reconcile's included.
        failures: u32,
        /// `failureBudget`.
        budget: u32,
    },
    /// Machines are taken for remediation now.
    Remediating {
        /// Their names.
        machines: Vec<String>,
    },
    /// Machines taken for remediation wait for their replacements (replace before remove).
    AwaitingReplacement {
        /// How many.
        machines: usize,
    },
    /// The deployment is paused: nothing is created and no old machine is removed.
    Paused,
    /// Fewer machines are created than wanted: `replicas + maxSurge` bounds all machines,
    /// terminating ones included.
    SurgeExhausted {
        /// `replicas + maxSurge`.
        limit: i64,
        /// Machines that exist.
        current: i64,
        /// Machines the target revision lacks.
        wanted: i64,
    },
    /// The disruption planner held disruptions back.
    Held {
        /// The disruption.
        reason: DisruptionReason,
        /// Machines it would have taken.
        machines: i64,
        /// What held them.
        hold: Hold,
    },
    /// InPlace: old machines are converted rather than replaced.
    InPlace {
        /// Old Running machines to try.
        candidates: usize,
        /// How many may start now.
        allowed: usize,
    },
    /// More machines of the target revision than `replicas`: the excess is removed.
    AboveReplicas {
        /// Live machines of the target revision.
        machines: i64,
        /// `replicas`.
        replicas: i64,
    },
    /// The rollout made no progress within `progressDeadlineSeconds`.
    ProgressDeadlineExceeded {
        /// `progressDeadlineSeconds`.
        seconds: u64,
    },
    /// A canary holds the rollout: at most `wanted` machines of `revision` until it passes.
    Canary {
        /// The revision.
        revision: String,
        /// Progressing or Pausing.
        phase: CanaryPhase,
        /// Canary machines Running, Ready and healthy.
        ready: usize,
        /// Canary machines wanted.
        wanted: i64,
        /// When the pause ends (while Pausing).
        until: Option<Time>,
    },
    /// The canary of `revision` held through its pause: the rollout goes on.
    CanaryPassed {
        /// The revision.
        revision: String,
    },
    /// Fewer machines are created than wanted: no failure domain takes machines now.
    NoDomainOpen {
        /// Machines wanted.
        wanted: usize,
    },
    /// Machines whose create a failure domain refused are withdrawn (their replacements go
    /// elsewhere).
    Withdrawn {
        /// Their names.
        machines: Vec<String>,
    },
    /// A machine moves between failure domains: its replacement is created first.
    Rebalancing {
        /// The crowded domain (`-`: machines in no listed domain).
        from: String,
        /// The domain it moves to.
        to: String,
    },
    /// The spread is off, but a rebalance needs room for one machine above `replicas`
    /// (`maxSurge` is 0).
    RebalanceNeedsSurge,
    /// A rebalance waits for its new machine to be available before one goes.
    RebalanceWaiting {
        /// The new machine.
        machine: String,
    },
    /// Every machine is on `revision` and available.
    Complete {
        /// The target revision.
        revision: String,
    },
}

impl Note {
    /// Whether it says what keeps the deployment from moving on (what a user waits for).
    pub fn holds_back(&self) -> bool {
        matches!(
            self,
            Note::SurgeExhausted { .. }
                | Note::Held { .. }
                | Note::Paused
                | Note::AwaitingReplacement { .. }
                | Note::Canary { .. }
                | Note::NoDomainOpen { .. }
                | Note::RebalanceWaiting { .. }
                | Note::RebalanceNeedsSurge
        )
    }
}

impl std::fmt::Display for Note {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Note::RollingBack { bad, to } => write!(f, "revision {bad} failed before; holding revision {to}"),
            Note::NoGoodRevision { revision } => {
                write!(f, "revision {revision} failed before and there is no earlier revision")
            }
            Note::RolloutStarted { revision } => write!(f, "rolling out revision {revision}"),
            Note::RevisionAborted { revision, failures, budget } => {
                write!(f, "{failures} machines of revision {revision} failed (budget {budget})")
            }
            Note::Remediating { machines } => write!(f, "remediating {}", machines.join(", ")),
            Note::AwaitingReplacement { machines } => {
                write!(f, "{machines} machine(s) being remediated wait for their replacements")
            }
            Note::Paused => write!(f, "paused"),
            Note::SurgeExhausted { limit, current, wanted } => {
                write!(f, "{wanted} machine(s) wanted, {current} of {limit} (replicas + maxSurge) exist")
            }
            Note::Held { reason, machines, hold } => write!(f, "{machines} {reason} held: {hold}"),
            Note::InPlace { candidates, allowed } => {
                write!(f, "{candidates} old machine(s) to update in place, {allowed} may start")
            }
            Note::AboveReplicas { machines, replicas } => {
                write!(f, "{machines} machines of the target revision for {replicas} replicas")
            }
            Note::ProgressDeadlineExceeded { seconds } => write!(f, "no progress for {seconds}s"),
            Note::Canary { revision, phase, ready, wanted, until } => {
                write!(f, "canary of revision {revision} {}: {ready} of {wanted} machine(s) ready", phase.as_str())?;
                match until {
                    Some(t) => write!(f, ", pausing until {}", t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)),
                    None => Ok(()),
                }
            }
            Note::CanaryPassed { revision } => write!(f, "the canary of revision {revision} passed"),
            Note::NoDomainOpen { wanted } => {
                write!(f, "{wanted} machine(s) wanted, and no failure domain takes machines now")
            }
            Note::Withdrawn { machines } => {
                write!(f, "withdrawn after their domain refused the create: {}", machines.join(", "))
            }
            Note::Rebalancing { from, to } => write!(f, "moving a machine from {from} to {to}"),
            Note::RebalanceWaiting { machine } => write!(f, "the rebalance waits for {machine} to be available"),
            Note::RebalanceNeedsSurge => {
                write!(f, "the failure domains are uneven, and rebalancing needs maxSurge of at least 1")
            }
            Note::Complete { revision } => write!(f, "revision {revision} is rolled out"),
        }
    }
}

/// What the steps of a plan write as they go: the status, events and notes.
struct Draft {
    status: MachineDeploymentStatus,
    events: Vec<PlannedEvent>,
    notes: Vec<Note>,
}

/// The deployment's machines sorted by what the steps decide on, and the numbers they share.
struct Classes<'a> {
    /// The spec's revision.
    spec_rev: String,
    /// The revision machines move to, and its template ([`Plan::target`]).
    target_rev: String,
    target: Option<MachineTemplate>,
    /// `spec.replicas`.
    desired: i64,
    /// The InPlace strategy.
    in_place: bool,
    limits: Limits,
    now: Time,
    min_ready: chrono::Duration,
    /// Every machine, terminating ones included.
    all: &'a [Member],
    /// Not being deleted.
    live: Vec<&'a Member>,
    /// Live, of the target revision.
    new: Vec<&'a Member>,
    /// Live, of another revision.
    old: Vec<&'a Member>,
    /// Live and Failed.
    failed: Vec<&'a Member>,
    /// Live and available.
    available: i64,
    /// Of the target revision and available.
    new_available: i64,
}

impl Classes<'_> {
    fn is_available(&self, m: &Member) -> bool {
        m.is_available_at(self.now, self.min_ready)
    }

    /// `replicas − maxUnavailable`.
    fn min_available(&self) -> i64 {
        self.desired - self.limits.max_unavailable
    }

    /// How the disruption planner weighs `m`.
    fn candidate(&self, m: &Member) -> Candidate {
        Candidate { available: self.is_available(m), disrupted: m.is_disrupted() }
    }

    /// The machines as the disruption planner counts them.
    fn census(&self) -> Census {
        Census {
            replicas: self.desired,
            live: self.live.len() as i64,
            available: self.available,
            disrupted: self.all.iter().filter(|m| m.is_disrupted()).count() as i64,
            new_unavailable: self.new.len() as i64 - self.new_available,
            remediating: self.all.iter().filter(|m| m.remediating).count() as i64,
        }
    }
}

/// Plans one reconcile of a deployment: the steps below, in order, each noting why it acted or
/// held back.
pub fn plan_deployment(o: Observed<'_>) -> Plan {
    let md = o.deployment;
    let mut d = Draft { status: md.status.clone(), events: Vec::new(), notes: Vec::new() };
    let c = classify(&o, &mut d);
    track_rollout(md, &c, &mut d);
    let canary = canary(md, &c, &mut d);
    if let Some(failures) = budget_spent(md, &c, &d, canary.is_some()) {
        return abort(md, c, d, failures);
    }
    let zones = failure_domains(md, &c, &mut d);
    let mut planner = Planner::new(c.census(), limits(&o, &c));
    let (mark, targets) = remediation(&o, &c, &zones.withdraw, &mut planner, &mut d);
    // Machines on their way out: taken for remediation, or withdrawn from a domain that refused
    // them. They do not count as the deployment's machines, so replacements are made.
    let leaving: Vec<&Member> = targets.iter().chain(&zones.withdraw).copied().collect();
    let staying = c.live.iter().copied().filter(|m| !leaving.iter().any(|t| t.name == m.name));
    let mut spread = Spread::new(&md.spec.failure_domains, staying, &c.target_rev, zones.open);
    let (mut create, mut in_place, mut delete) = (0, None, Vec::new());
    // A canary not passed yet: no more machines of the revision than it wants.
    let canary_room = canary.map(|wanted| {
        let have = c.new.iter().filter(|m| !targets.iter().any(|t| t.name == m.name)).count() as i64;
        (wanted - have).max(0) as usize
    });
    if md.spec.paused {
        d.notes.push(Note::Paused);
    } else {
        create = scale_up(&c, &leaving, canary_room, &mut d);
    }
    let mut placements = place(&mut spread, &mut create, &mut d);
    let remediate = remediated_now(&c, &targets, create, &mut d);
    if !md.spec.paused {
        let removals = canary_removals(&c, &leaving, canary);
        delete = scale_down_old(md, &c, &leaving, &spread, removals, &mut planner);
        in_place = in_place_work(&c, &leaving, &delete, &mut planner, &mut d);
        if let (Some(work), Some(room)) = (in_place.as_mut(), canary_room) {
            work.allowed = work.allowed.min(room.saturating_sub(create));
        }
    }
    delete.extend(scale_down_excess(md, &c, &leaving, &spread, &mut planner, &mut d));
    delete.extend(zones.withdraw.iter().map(|m| m.name.clone()));
    let report = planner.report();
    d.notes.extend(report.held.iter().map(|h| Note::Held {
        reason: h.reason,
        machines: h.machines,
        hold: h.hold.clone(),
    }));
    let halted = o.remediation_halted.is_some();
    let waiting: Vec<String> = c
        .live
        .iter()
        .filter(|m| m.remediation.is_some() || (halted && m.marked_unhealthy))
        .filter(|m| !m.remediating && !mark.iter().any(|(n, _)| *n == m.name))
        .filter(|m| !zones.withdraw.iter().any(|w| w.name == m.name))
        .map(|m| m.name.clone())
        .collect();
    let quiet = create == 0
        && delete.is_empty()
        && targets.is_empty()
        && waiting.is_empty()
        && in_place.as_ref().is_none_or(|w| w.allowed == 0);
    let rebalance = if quiet { rebalance(md, &c, &spread, &mut d) } else { None };
    if let Some((_, to)) = &rebalance {
        create = 1;
        placements = vec![to.clone()];
    }
    let complete = write_status(md, &c, &report, &mark, waiting.clone(), &mut d);
    domain_status(&c, &spread, &mut d.status);
    let recheck_at = [report.recheck_at, pause_until(&d.status, canary), zones.reopens].into_iter().flatten().min();
    let remediation_left = !waiting.is_empty() || c.live.iter().any(|m| m.remediating);
    Plan {
        settled: complete && c.failed.is_empty() && !remediation_left && rebalance.is_none(),
        target_revision: c.target_rev,
        target: c.target,
        aborted: false,
        mark,
        remediate,
        create,
        placements,
        rebalance: rebalance.map(|(value, _)| value),
        in_place,
        delete,
        status: d.status,
        events: d.events,
        recheck_at,
        disruption: Some(report),
        notes: d.notes,
    }
}

/// What the failure-domain step found: which domains take machines, the machines withdrawn from
/// a domain that refused them, and when the next closed domain opens again.
struct Zones<'a> {
    open: Vec<bool>,
    withdraw: Vec<&'a Member>,
    reopens: Option<Time>,
}

/// Failure domains ([`super::domains`]): a backoff that ended opens its domain again; a refused
/// create closes its domain for a backoff and withdraws the machine (when another domain can take
/// its replacement); a domain whose machines are all unhealthy while others are fine is degraded
/// (closed, and the `FailureDomainDegraded` condition says so).
fn failure_domains<'a>(md: &MachineDeployment, c: &Classes<'a>, d: &mut Draft) -> Zones<'a> {
    let domains = &md.spec.failure_domains;
    let (now, backoff) = (c.now, &md.spec.failure_domain_backoff);
    if domains.is_empty() {
        d.status.failure_domains.clear();
        d.status.rebalance = None;
        remove_condition(&mut d.status.conditions, ConditionType::FailureDomainDegraded);
        return Zones { open: Vec::new(), withdraw: Vec::new(), reopens: None };
    }
    let mut next: Vec<FailureDomainStatus> = domains
        .iter()
        .map(|fd| {
            let old = d.status.failure_domains.iter().find(|s| s.name == fd.name).cloned();
            old.unwrap_or_else(|| FailureDomainStatus { name: fd.name.clone(), ..Default::default() })
        })
        .collect();
    let event = |d: &mut Draft, reason, message| d.events.push(PlannedEvent { reason, message });
    for s in &mut next {
        if !s.reason.is_empty() && !s.unavailable_at(now) {
            let message = format!("{} takes machines again ({} for {}s is over)", s.name, s.reason, s.backoff_seconds);
            event(d, EventReason::FailureDomainAvailable, message);
            (s.reason, s.message) = (String::new(), String::new());
        }
        // A machine created there since the backoff ended runs: the next refusal starts over.
        if s.backoff_seconds > 0 && !s.unavailable_at(now) {
            let since = s.unavailable_until;
            let ran = c
                .live
                .iter()
                .any(|m| m.domain.as_deref() == Some(s.name.as_str()) && c.is_available(m) && m.created > since);
            if ran {
                (s.backoff_seconds, s.unavailable_until) = (0, None);
            }
        }
    }
    let mut withdraw = Vec::new();
    for m in &c.live {
        let (Some(r), Some(i)) = (&m.refusal, domains::index(domains, m.domain.as_deref())) else { continue };
        let s = &mut next[i];
        if !s.unavailable_at(now) {
            let seconds = domains::mark(s, backoff, now, &r.reason, &r.message);
            let message = format!(
                "{} refused the create of {} ({}: {}): no new machines there for {seconds}s",
                s.name, m.name, r.reason, r.message
            );
            event(d, EventReason::FailureDomainUnavailable, message);
        }
        withdraw.push(*m);
    }
    let degraded = domains::degraded(domains, &c.live, |m| c.is_available(m));
    let mut outages = Vec::new();
    for &(i, bad) in &degraded {
        let s = &mut next[i];
        let was = s.reason == domains::DEGRADED && s.unavailable_at(now);
        let message = format!("all {bad} machine(s) unhealthy while other domains are healthy");
        s.unavailable_until =
            Some(now + chrono::Duration::seconds(i64::try_from(backoff.initial_seconds).unwrap_or(i64::MAX / 2)));
        (s.reason, s.message) = (domains::DEGRADED.to_string(), message);
        if !was {
            let message = format!(
                "{}: all {bad} machine(s) unhealthy while other domains are healthy: no new machines go \
                 there, and they do not count toward a health check's maxUnhealthy",
                s.name
            );
            event(d, EventReason::FailureDomainUnavailable, message);
        }
        outages.push(format!("{}: {bad} machine(s) unhealthy", s.name));
    }
    let conditions = &mut d.status.conditions;
    if !outages.is_empty() {
        let message = format!("{}; no new machines go there", outages.join(", "));
        set_condition(conditions, ConditionType::FailureDomainDegraded, true, Reason::DomainOutage, &message);
    } else if condition(conditions, ConditionType::FailureDomainDegraded).is_some() {
        set_condition(conditions, ConditionType::FailureDomainDegraded, false, Reason::DomainsHealthy, "");
    }
    let open: Vec<bool> = next.iter().map(|s| !s.unavailable_at(now)).collect();
    // With no domain to take their replacements, refused machines keep trying where they are.
    if !open.contains(&true) {
        withdraw.clear();
    }
    if !withdraw.is_empty() {
        d.notes.push(Note::Withdrawn { machines: withdraw.iter().map(|m| m.name.clone()).collect() });
    }
    let reopens = next.iter().filter_map(|s| s.unavailable_until.filter(|t| now < *t)).min();
    d.status.failure_domains = next;
    Zones { open, withdraw, reopens }
}

/// The domain of each machine to create; fewer are created when no domain takes machines.
fn place(spread: &mut Spread<'_>, create: &mut usize, d: &mut Draft) -> Vec<String> {
    if !spread.active() {
        return Vec::new();
    }
    let placements: Vec<String> = (0..*create).map_while(|_| spread.place().map(|fd| fd.name.clone())).collect();
    if placements.len() < *create {
        d.notes.push(Note::NoDomainOpen { wanted: *create });
        *create = placements.len();
    }
    placements
}

/// Whether a machine goes before the spread is considered: marked for deletion, failed, unknown
/// to the cloud or its Node not Ready.
fn broken(m: &Member) -> bool {
    m.marked_for_deletion
        || matches!(m.phase, Phase::Failed | Phase::Unknown)
        || (m.phase == Phase::Running && m.node_not_ready)
}

/// A rebalance, when everything is settled and the spread is off by more than `maxSkew`: the
/// created machine's annotation value and its domain.
fn rebalance(md: &MachineDeployment, c: &Classes<'_>, spread: &Spread<'_>, d: &mut Draft) -> Option<(String, String)> {
    let settled = c.old.is_empty()
        && d.status.rollout.is_none()
        && c.live.len() as i64 == c.desired
        && c.available == c.desired
        && !c.live.iter().any(|m| m.remediation.is_some() || m.refusal.is_some());
    if !spread.active() || !md.spec.rebalance.enabled || md.spec.paused || !settled || c.target.is_none() {
        return None;
    }
    let unlisted =
        c.live.iter().filter(|m| domains::index(&md.spec.failure_domains, m.domain.as_deref()).is_none()).count();
    let (from, to) = spread.imbalance(unlisted as i64, md.spec.rebalance.max_skew)?;
    // Surge-first: the new machine needs room above `replicas`.
    if c.limits.max_surge < 1 {
        d.notes.push(Note::RebalanceNeedsSurge);
        return None;
    }
    if c.all.len() as i64 >= c.desired + c.limits.max_surge {
        return None;
    }
    let from_name = from.map_or("machines in no listed domain".to_string(), |f| f.name.clone());
    d.notes.push(Note::Rebalancing { from: from_name.clone(), to: to.name.clone() });
    let message = format!("moving a machine from {from_name} to {}: its replacement is created there first", to.name);
    d.events.push(PlannedEvent { reason: EventReason::Rebalancing, message });
    Some((domains::rebalance_value(from, c.desired), to.name.clone()))
}

/// Each domain's share, machines and available machines, and the rebalance in progress.
fn domain_status(c: &Classes<'_>, spread: &Spread<'_>, st: &mut MachineDeploymentStatus) {
    if !spread.active() {
        return;
    }
    let shares = spread.shares(c.desired);
    for (i, s) in st.failure_domains.iter_mut().enumerate() {
        let here: Vec<&&Member> = c.live.iter().filter(|m| m.domain.as_deref() == Some(s.name.as_str())).collect();
        s.desired = shares.get(i).copied().unwrap_or(0);
        s.current = here.len() as i64;
        s.available = here.iter().filter(|m| c.is_available(m)).count() as i64;
    }
    // The move under way: the newest machine created to rebalance, while there is an excess.
    let mover = c
        .live
        .iter()
        .filter(|m| domains::rebalance_from(m, c.desired).is_some())
        .max_by_key(|m| (m.created, &m.name))
        .filter(|_| c.live.len() as i64 > c.desired);
    st.rebalance = mover.and_then(|m| {
        let from = domains::rebalance_from(m, c.desired)?.to_string();
        Some(Box::new(RebalanceStatus { from, to: m.domain.clone().unwrap_or_default(), machine: m.name.clone() }))
    });
}

/// The disruption planner's limits for this deployment.
fn limits<'a>(o: &Observed<'a>, c: &Classes<'_>) -> disruption::Limits<'a> {
    let md = o.deployment;
    let max = md
        .spec
        .remediation
        .max_in_flight
        .clone()
        .or(md.spec.max_concurrent_replacements.map(|n| IntOrPercent::Int(n.into())));
    disruption::Limits {
        max_unavailable: c.limits.max_unavailable,
        budgets: &md.spec.disruption.budgets,
        max_in_flight: disruption::max_in_flight(max.as_ref(), c.desired),
        remediation_not_before: md.status.disruption.remediation.not_before,
        remediation_halted: o.remediation_halted,
        now: o.now,
    }
}

/// Which revision to move to: the spec's, unless it failed before (then the last good one, or
/// none).
fn choose_target(md: &MachineDeployment, spec_rev: &str, notes: &mut Vec<Note>) -> (String, Option<MachineTemplate>) {
    let st = &md.status;
    if !st.bad_revisions.iter().any(|b| b.revision == spec_rev) {
        return (spec_rev.to_string(), Some(md.spec.template.clone()));
    }
    match st.revision_history.last() {
        Some(good) => {
            notes.push(Note::RollingBack { bad: spec_rev.to_string(), to: good.revision.clone() });
            (good.revision.clone(), Some(good.template.clone()))
        }
        None => {
            notes.push(Note::NoGoodRevision { revision: spec_rev.to_string() });
            (spec_rev.to_string(), None)
        }
    }
}

/// Sorts the machines into live, new, old and failed against the target revision, and counts
/// the available ones.
fn classify<'a>(o: &Observed<'a>, d: &mut Draft) -> Classes<'a> {
    let md = o.deployment;
    let spec_rev = revision(&md.spec.template);
    let (target_rev, target) = choose_target(md, &spec_rev, &mut d.notes);
    let desired = md.spec.replicas;
    let in_place = md.spec.strategy.strategy_type == StrategyType::InPlace;
    let limits = if in_place {
        Limits::in_place(desired, &md.spec.strategy.rolling_update, &md.spec.strategy.in_place.max_unavailable)
    } else {
        Limits::resolve(desired, &md.spec.strategy.rolling_update)
    };
    let min_ready = chrono::Duration::seconds(i64::try_from(md.spec.min_ready_seconds).unwrap_or(i64::MAX / 2));
    let live: Vec<&Member> = o.machines.iter().filter(|m| !m.deleting).collect();
    let (new, old): (Vec<&Member>, Vec<&Member>) = live.iter().partition(|m| m.revision == target_rev);
    let failed = live.iter().copied().filter(|m| m.phase == Phase::Failed).collect();
    let mut c = Classes {
        spec_rev,
        target_rev,
        target,
        desired,
        in_place,
        limits,
        now: o.now,
        min_ready,
        all: o.machines,
        live,
        new,
        old,
        failed,
        available: 0,
        new_available: 0,
    };
    c.available = c.live.iter().filter(|m| c.is_available(m)).count() as i64;
    c.new_available = c.new.iter().filter(|m| c.is_available(m)).count() as i64;
    c
}

/// Rollout bookkeeping: a rollout starts when machines are to move to a new target revision;
/// it progresses when more new machines are available than last time.
fn track_rollout(md: &MachineDeployment, c: &Classes<'_>, d: &mut Draft) {
    let st = &mut d.status;
    let rolling = c.target_rev != st.current_revision || !c.old.is_empty();
    if rolling && st.rollout.as_ref().is_none_or(|r| r.revision != c.target_rev) {
        let revision = c.target_rev.clone();
        st.rollout =
            Some(RolloutState { revision: revision.clone(), started: c.now, last_progress: c.now, failures: 0 });
        if !st.current_revision.is_empty() {
            let message = format!("rolling out revision {revision}");
            d.events.push(PlannedEvent { reason: EventReason::RolloutStarted, message });
        }
        d.notes.push(Note::RolloutStarted { revision });
    }
    if let Some(r) = st.rollout.as_mut() {
        if c.new_available > md.status.available_replicas {
            r.last_progress = c.now;
        }
    }
}

/// The canary step: whether the rollout of the spec's revision is held by a canary, and how many
/// machines of the revision it wants (`None`: no canary, or it passed). Only a rollout of the
/// spec's revision from an earlier one has a canary (a first rollout has nothing to compare
/// with, a rollback goes to a revision that ran before). `status.canary` records where it
/// stands, so a restarted controller goes on with the same pause; a canary that passed or failed
/// stays recorded until the next revision's.
fn canary(md: &MachineDeployment, c: &Classes<'_>, d: &mut Draft) -> Option<i64> {
    let st = &mut d.status;
    let under_way = |k: &CanaryStatus| matches!(k.phase, CanaryPhase::Progressing | CanaryPhase::Pausing);
    let Some(spec) = md.spec.strategy.rolling_update.canary.as_ref() else {
        // No canary asked (any more): one under way is dropped; one that passed or failed stays.
        if st.canary.as_ref().is_some_and(under_way) {
            st.canary = None;
        }
        return None;
    };
    let rolling = st.rollout.as_ref().is_some_and(|r| r.revision == c.target_rev);
    let applies = rolling && c.target.is_some() && c.target_rev == c.spec_rev && !st.current_revision.is_empty();
    let wanted = spec.machines_of(c.desired);
    if !applies || wanted == 0 {
        if st.canary.as_ref().is_some_and(|k| under_way(k) && k.revision != c.target_rev) {
            st.canary = None;
        }
        return None;
    }
    let mut k = match st.canary.take() {
        Some(k) if k.revision == c.target_rev => k,
        _ => CanaryStatus {
            revision: c.target_rev.clone(),
            phase: CanaryPhase::Progressing,
            wanted,
            machines: Vec::new(),
            ready_since: None,
            pause_until: None,
            message: String::new(),
        },
    };
    if !under_way(&k) {
        st.canary = Some(k);
        return None;
    }
    // The canary machines: the revision's live machines, oldest first (a replacement of one
    // that went takes its place).
    let mut members: Vec<&Member> = c.new.clone();
    members.sort_by(|a, b| (a.created, &a.name).cmp(&(b.created, &b.name)));
    members.truncate(usize::try_from(wanted).unwrap_or(usize::MAX));
    k.wanted = wanted;
    k.machines = members.iter().map(|m| m.name.clone()).collect();
    let ready = members.iter().filter(|m| m.is_available() && !m.marked_unhealthy).count();
    if ready as i64 >= wanted {
        if k.pause(c.now, spec.pause_seconds) {
            let message = format!(
                "the canary of revision {} ({}) held {}s: rolling out the rest",
                k.revision,
                k.machines.join(", "),
                spec.pause_seconds
            );
            d.events.push(PlannedEvent { reason: EventReason::CanaryPassed, message });
            d.notes.push(Note::CanaryPassed { revision: k.revision.clone() });
            st.canary = Some(k);
            return None;
        }
    } else {
        // One of them is not (or no longer) Running, Ready and healthy.
        k.not_ready();
    }
    d.notes.push(Note::Canary { revision: k.revision.clone(), phase: k.phase, ready, wanted, until: k.pause_until });
    st.canary = Some(k);
    Some(wanted)
}

/// While a canary holds a rolling update, old machines go only as far as the surge needs to
/// make room for the canary machines (none with a surge as large as the canary): the rest stay
/// untouched until it passes. `None`: no limit.
fn canary_removals(c: &Classes<'_>, targets: &[&Member], canary: Option<i64>) -> Option<usize> {
    let wanted = canary?;
    if c.in_place {
        return None;
    }
    let old = c.old.iter().filter(|m| !targets.iter().any(|t| t.name == m.name)).count() as i64;
    Some((old + wanted - (c.desired + c.limits.max_surge)).max(0) as usize)
}

/// When a canary's pause ends (to plan again then).
fn pause_until(st: &MachineDeploymentStatus, canary: Option<i64>) -> Option<Time> {
    canary?;
    st.canary.as_ref().filter(|k| k.phase == CanaryPhase::Pausing)?.pause_until
}

/// Whether a failed machine counts against the target revision's failure budget: of that
/// revision, and its failure the revision's doing.
fn counts_against(c: &Classes<'_>, m: &Member) -> bool {
    m.phase == Phase::Failed && m.revision == c.target_rev && attributable(m)
}

/// The failures of the spec's revision under way, if they reach the failure budget: those
/// counted when their machines were taken for remediation, and the failed machines not taken
/// yet (each failed machine counts once).
/// While a canary runs the budget is 1: one canary machine failing for its revision is enough.
fn budget_spent(md: &MachineDeployment, c: &Classes<'_>, d: &Draft, canary: bool) -> Option<u32> {
    let rollout = d.status.rollout.as_ref()?;
    let failed_now = c.failed.iter().filter(|m| !m.remediating && counts_against(c, m)).count() as u32;
    let used = rollout.failures + failed_now;
    let budget = if canary { 1 } else { md.spec.failure_budget.max(1) };
    let spent = c.target.is_some() && c.target_rev == c.spec_rev && used >= budget;
    spent.then_some(used)
}

/// Aborts the rollout: the revision is remembered as bad and the deployment rolls back (if there
/// is anything to roll back to). Nothing else is done this time.
fn abort(md: &MachineDeployment, c: Classes<'_>, mut d: Draft, failures: u32) -> Plan {
    let (st, rev) = (&mut d.status, &c.target_rev);
    let mut reason = format!("{failures} machines of revision {rev} failed (budget {})", md.spec.failure_budget);
    if let Some(k) = st.canary.as_mut().filter(|k| k.revision == *rev && k.phase != CanaryPhase::Passed) {
        let culprit = c.failed.iter().find(|m| counts_against(&c, m));
        let why = culprit.map(|m| {
            let f = m.failure.as_deref();
            let cause = f.map(|f| format!("{}: {}", f.reason, f.message)).unwrap_or_else(|| "Failed".into());
            format!("canary machine {} of revision {rev} failed ({cause})", m.name)
        });
        reason = why.unwrap_or_else(|| format!("a canary machine of revision {rev} failed"));
        k.phase = CanaryPhase::Failed;
        (k.ready_since, k.pause_until) = (None, None);
        k.message = reason.clone();
    }
    st.bad_revisions.push(BadRevision { revision: rev.clone(), reason: reason.clone(), time: c.now });
    st.rollout = None;
    let then = match st.revision_history.last() {
        Some(good) => format!("rolling back to the last good revision {}", good.revision),
        None => "no earlier revision to roll back to; change the template".to_string(),
    };
    let message = format!("{reason}; {then}");
    set_condition(&mut st.conditions, ConditionType::Progressing, false, Reason::RolloutAborted, &message);
    d.events.push(PlannedEvent { reason: EventReason::RolloutAborted, message });
    // During a canary the budget is 1.
    let canary = d.status.canary.as_ref().is_some_and(|k| k.revision == *rev && k.phase == CanaryPhase::Failed);
    let budget = if canary { 1 } else { md.spec.failure_budget };
    d.notes.push(Note::RevisionAborted { revision: rev.clone(), failures, budget });
    Plan {
        target_revision: c.target_rev,
        target: c.target,
        aborted: true,
        mark: Vec::new(),
        remediate: Vec::new(),
        create: 0,
        placements: Vec::new(),
        rebalance: None,
        in_place: None,
        delete: Vec::new(),
        status: d.status,
        events: d.events,
        notes: d.notes,
        settled: false,
        recheck_at: None,
        disruption: None,
    }
}

/// Remediation: machines already taken (marked, still here) go on; each other machine that wants
/// it is asked of the disruption planner (failed first, then unhealthy, then requested; oldest
/// first), and those allowed are marked. A failed machine of the target revision marked now
/// counts against the failure budget. Returns the machines to mark, and every machine being
/// remediated that is still here (marked before or now).
fn remediation<'a>(
    o: &Observed<'_>,
    c: &Classes<'a>,
    withdrawn: &[&Member],
    planner: &mut Planner,
    d: &mut Draft,
) -> (Vec<(String, Remediation)>, Vec<&'a Member>) {
    let mut targets: Vec<&Member> = c.live.iter().copied().filter(|m| m.remediating).collect();
    // While a health check's short circuit halts remediation, the machines it marked unhealthy
    // are what waits (it asks for none of them): the planner holds them, and says so.
    let halted = o.remediation_halted.is_some();
    // A machine withdrawn from a domain that refused it goes without a remediation.
    let wants = |m: &Member| {
        m.remediation
            .or((halted && m.marked_unhealthy).then_some(Remediation::Unhealthy))
            .filter(|_| !m.remediating && !withdrawn.iter().any(|w| w.name == m.name))
    };
    let mut wanting: Vec<(&Member, Remediation)> = c.live.iter().filter_map(|m| Some((*m, wants(m)?))).collect();
    wanting.sort_by(|(a, x), (b, y)| (x, a.created, &a.name).cmp(&(y, b.created, &b.name)));
    let mut mark = Vec::new();
    for (m, why) in wanting {
        if planner.ask(DisruptionReason::Remediation, c.candidate(m)) != Verdict::Allowed {
            continue;
        }
        if counts_against(c, m) {
            if let Some(r) = d.status.rollout.as_mut() {
                r.failures += 1;
            }
        }
        mark.push((m.name.clone(), why));
        targets.push(m);
    }
    if !mark.is_empty() {
        d.notes.push(Note::Remediating { machines: mark.iter().map(|(n, _)| n.clone()).collect() });
    }
    let pace = &mut d.status.disruption.remediation;
    let idle = targets.is_empty() && !c.live.iter().any(|m| m.remediation.is_some());
    (pace.consecutive, pace.not_before) = disruption::next_pace(pace, mark.len(), idle, o.now, o.pace.0, o.pace.1);
    (mark, targets)
}

/// Scales up the target revision within `replicas + maxSurge` (terminating machines included);
/// machines being remediated do not count, so their replacements are created (first, where the
/// surge has room). In place, old machines are converted, so only missing machines are created.
/// A canary under way wants no more than `canary_room` more.
fn scale_up(c: &Classes<'_>, targets: &[&Member], canary_room: Option<usize>, d: &mut Draft) -> usize {
    if c.target.is_none() {
        return 0;
    }
    let limit = c.desired + c.limits.max_surge;
    let current = c.all.len() as i64;
    let kept = |m: &&&Member| !targets.iter().any(|t| t.name == m.name);
    let have = if c.in_place { c.live.iter().filter(kept).count() } else { c.new.iter().filter(kept).count() } as i64;
    let wanted = (c.desired - have).min(canary_room.map_or(i64::MAX, |r| r as i64));
    let create = wanted.min(limit - current).max(0) as usize;
    if wanted > 0 && (create as i64) < wanted {
        d.notes.push(Note::SurgeExhausted { limit, current, wanted });
    }
    create
}

/// The machines being remediated that go now. A replacement is on its way for as many of them
/// as there are machines coming up (live, of the target revision, not available yet, not down,
/// not being remediated) plus the ones this plan creates: that many wait for them (replace
/// before remove); the others go now — the first in remediation order (remove, then replace,
/// when the surge leaves no room).
fn remediated_now(c: &Classes<'_>, targets: &[&Member], create: usize, d: &mut Draft) -> Vec<String> {
    if targets.is_empty() {
        return Vec::new();
    }
    let pool = if c.in_place { &c.live } else { &c.new };
    let coming = pool
        .iter()
        .filter(|m| !c.is_available(m) && !m.is_disrupted() && !targets.iter().any(|t| t.name == m.name))
        .count()
        + create;
    let go = targets.len().saturating_sub(coming);
    if go < targets.len() {
        d.notes.push(Note::AwaitingReplacement { machines: targets.len() - go });
    }
    targets[..go].iter().map(|m| m.name.clone()).collect()
}

/// Removes old machines (not being remediated) in deletion order, each asked of the disruption
/// planner as a `Rollout` (within `maxUnavailable` and the budgets); in place, old machines are
/// converted, and only a scale-down removes them (`ScaleDown`, the excess over `replicas`).
fn scale_down_old(
    md: &MachineDeployment,
    c: &Classes<'_>,
    targets: &[&Member],
    spread: &Spread<'_>,
    limit: Option<usize>,
    planner: &mut Planner,
) -> Vec<String> {
    let mut order: Vec<&Member> = c.old.iter().copied().filter(|m| !targets.iter().any(|t| t.name == m.name)).collect();
    deletion_order(&mut order, md.spec.delete_policy);
    let order = spread.order(order, broken);
    if c.in_place {
        let excess = (c.live.len() as i64 - targets.len() as i64 - c.desired).max(0) as usize;
        return order
            .into_iter()
            .filter(|m| planner.ask(DisruptionReason::ScaleDown, c.candidate(m)).allowed())
            .take(excess)
            .map(|m| m.name.clone())
            .collect();
    }
    order
        .into_iter()
        .filter(|m| planner.ask(DisruptionReason::Rollout, c.candidate(m)).allowed())
        .take(limit.unwrap_or(usize::MAX))
        .map(|m| m.name.clone())
        .collect()
}

/// InPlace: the old Running machines to convert, and how many may start (asked of the
/// disruption planner as `InPlaceUpdate`, candidate by candidate, until one is held).
fn in_place_work(
    c: &Classes<'_>,
    targets: &[&Member],
    deleted: &[String],
    planner: &mut Planner,
    d: &mut Draft,
) -> Option<InPlaceWork> {
    if !c.in_place || c.old.is_empty() || c.target.is_none() {
        return None;
    }
    let candidates: Vec<&Member> = c
        .old
        .iter()
        .copied()
        .filter(|m| m.phase == Phase::Running && !targets.iter().any(|t| t.name == m.name))
        .filter(|m| !deleted.contains(&m.name))
        .collect();
    let allowed = candidates
        .iter()
        .take_while(|m| planner.ask(DisruptionReason::InPlaceUpdate, c.candidate(m)).allowed())
        .count();
    d.notes.push(Note::InPlace { candidates: candidates.len(), allowed });
    Some(InPlaceWork { candidates: candidates.iter().map(|m| m.name.clone()).collect(), allowed })
}

/// Scales down the target revision when there are too many (a scale-down, or leftover surge),
/// each asked of the disruption planner as a `ScaleDown` (the autoscaler's as `Autoscaler`). A
/// rebalance's excess goes once its new machine is available, as a `Rebalance`, and only while
/// more machines than `replicas` are available (surge-first).
fn scale_down_excess(
    md: &MachineDeployment,
    c: &Classes<'_>,
    targets: &[&Member],
    spread: &Spread<'_>,
    planner: &mut Planner,
    d: &mut Draft,
) -> Vec<String> {
    let kept: Vec<&Member> = c.new.iter().copied().filter(|m| !targets.iter().any(|t| t.name == m.name)).collect();
    let excess = kept.len() as i64 - c.desired;
    if excess <= 0 {
        return Vec::new();
    }
    d.notes.push(Note::AboveReplicas { machines: kept.len() as i64, replicas: c.desired });
    // Machines created to rebalance (for these replicas): until each is available nothing goes;
    // then the excess leaves the crowded domains, surge-first.
    let movers: Vec<&Member> = if spread.active() {
        kept.iter().copied().filter(|m| domains::rebalance_from(m, c.desired).is_some()).collect()
    } else {
        Vec::new()
    };
    let mut order: Vec<&Member> = kept.iter().copied().filter(|m| !movers.iter().any(|n| n.name == m.name)).collect();
    deletion_order(&mut order, md.spec.delete_policy);
    let order = spread.order(order, broken);
    let mut delete = Vec::new();
    if let Some(new) = movers.iter().max_by_key(|m| (m.created, &m.name)) {
        if let Some(waiting) = movers.iter().find(|m| !c.is_available(m)) {
            d.notes.push(Note::RebalanceWaiting { machine: waiting.name.clone() });
            return delete;
        }
        let mut available = c.available;
        for m in order {
            if delete.len() as i64 >= excess {
                break;
            }
            let cand = c.candidate(m);
            // Surge-first: never fewer than `replicas` available.
            if cand.available && available <= c.desired {
                break;
            }
            if !planner.ask(DisruptionReason::Rebalance, cand).allowed() {
                break;
            }
            available -= i64::from(cand.available);
            let (from, to) = (m.domain.as_deref().unwrap_or("-"), new.domain.as_deref().unwrap_or("-"));
            let message = format!("{} leaves {from}: {} runs in {to}", m.name, new.name);
            d.events.push(PlannedEvent { reason: EventReason::Rebalanced, message });
            delete.push(m.name.clone());
        }
        return delete;
    }
    for m in order {
        if delete.len() as i64 >= excess {
            break;
        }
        // The autoscaler's removals are its own reason: a budget naming `Autoscaler` holds them.
        let reason = if m.by_autoscaler { DisruptionReason::Autoscaler } else { DisruptionReason::ScaleDown };
        if planner.ask(reason, c.candidate(m)).allowed() {
            delete.push(m.name.clone());
        }
    }
    delete
}

/// The status: counts, the disruption report, then the Progressing, Available, DisruptionBlocked
/// and Valid conditions. Returns whether the rollout is complete (every machine on the target
/// revision, `replicas` of them available).
fn write_status(
    md: &MachineDeployment,
    c: &Classes<'_>,
    report: &Report,
    mark: &[(String, Remediation)],
    waiting: Vec<String>,
    d: &mut Draft,
) -> bool {
    let st = &mut d.status;
    st.observed_generation = md.metadata.generation;
    st.replicas = c.all.len() as i64;
    st.updated_replicas = c.new.len() as i64;
    st.ready_replicas = c.available;
    st.available_replicas = c.new_available;
    st.failed_replicas = c.failed.len() as i64;
    st.target_revision = c.target_rev.clone();
    // The pace is the remediation step's; in flight and its limit, the report's (plus the
    // machines marked now).
    st.disruption = report.status(RemediationStatus { waiting, ..st.disruption.remediation.clone() });
    st.disruption.remediation.in_flight += mark.len() as i64;
    disruption_conditions(&mut st.conditions, report);
    let complete =
        c.target.is_some() && c.new_available >= c.desired && c.old.is_empty() && c.new.len() as i64 == c.desired;
    if complete {
        complete_rollout(c, d);
    } else {
        progressing(md, c, d);
    }
    available(c, &mut d.status);
    complete
}

/// The owner's `DisruptionBlocked` condition (a budget or a short circuit holds something back)
/// and its `Valid` condition (every budget reads). Shared by deployments and pools.
pub fn disruption_conditions(conditions: &mut Vec<Condition>, report: &Report) {
    match report.blocking() {
        Some(h) => {
            let reason = match &h.hold {
                Hold::BudgetInvalid { .. } => Reason::BudgetInvalid,
                Hold::ShortCircuit { .. } => Reason::TooManyUnhealthy,
                _ => Reason::BudgetExhausted,
            };
            let others: i64 =
                report.held.iter().filter(|x| x.hold.blocks()).map(|x| x.machines).sum::<i64>() - h.machines;
            let mut message = format!("{} {} held: {}", h.machines, h.reason, h.hold);
            if others > 0 {
                message += &format!(" (and {others} more held)");
            }
            set_condition(conditions, ConditionType::DisruptionBlocked, true, reason, &message);
        }
        None => {
            if condition(conditions, ConditionType::DisruptionBlocked).is_some() {
                set_condition(conditions, ConditionType::DisruptionBlocked, false, Reason::NothingHeld, "");
            }
        }
    }
    let invalid: Vec<String> = report
        .budgets
        .iter()
        .filter_map(|b| b.invalid.as_ref().map(|(f, m)| format!("spec.disruption.budgets[{}].{f}: {m}", b.index)))
        .collect();
    if invalid.is_empty() {
        if condition(conditions, ConditionType::Valid).is_some() {
            set_condition(conditions, ConditionType::Valid, true, Reason::Validated, "");
        }
    } else {
        set_condition(conditions, ConditionType::Valid, false, Reason::Invalid, &invalid.join("; "));
    }
}

/// A complete rollout: the target becomes the current revision and joins the history.
fn complete_rollout(c: &Classes<'_>, d: &mut Draft) {
    let (st, rev) = (&mut d.status, &c.target_rev);
    if st.current_revision != *rev {
        if !st.current_revision.is_empty() {
            let message = format!("revision {rev} is rolled out");
            d.events.push(PlannedEvent { reason: EventReason::RolloutComplete, message });
        }
        st.current_revision = rev.clone();
    }
    if let Some(template) = &c.target {
        st.revision_history.retain(|r| r.revision != *rev);
        st.revision_history.push(RevisionRecord { revision: rev.clone(), template: template.clone() });
        let n = st.revision_history.len();
        if n > HISTORY {
            st.revision_history.drain(..n - HISTORY);
        }
    }
    st.rollout = None;
    let (reason, msg) = if *rev != c.spec_rev {
        (Reason::RolledBack, "rolled back: the spec's revision failed before")
    } else {
        (Reason::NewRevisionAvailable, "")
    };
    set_condition(&mut st.conditions, ConditionType::Progressing, true, reason, msg);
    d.notes.push(Note::Complete { revision: rev.clone() });
}

/// The Progressing condition of a deployment not (yet) complete: no good revision, a stalled or
/// rolling rollout, or scaling; the notes that hold it back follow the message.
fn progressing(md: &MachineDeployment, c: &Classes<'_>, d: &mut Draft) {
    let (st, rev, spec_rev) = (&mut d.status, &c.target_rev, &c.spec_rev);
    let (desired, new_available) = (c.desired, c.new_available);
    let (holds, reason, msg) = if c.target.is_none() {
        let why = st.bad_revisions.iter().rev().find(|b| b.revision == *spec_rev).map_or("", |b| b.reason.as_str());
        let msg = format!(
            "revision {spec_rev} failed ({why}) and there is no earlier revision to roll back to; change the template"
        );
        (false, Reason::NoGoodRevision, msg)
    } else if let Some(r) = &st.rollout {
        let seconds = md.spec.progress_deadline_seconds;
        let stalled = (c.now - r.last_progress).to_std().unwrap_or_default() > Duration::from_secs(seconds);
        if stalled {
            d.notes.push(Note::ProgressDeadlineExceeded { seconds });
            (false, Reason::ProgressDeadlineExceeded, format!("no progress for {seconds}s"))
        } else {
            let msg = format!("{new_available} of {desired} machines on revision {rev}");
            (true, Reason::Rolling, with_holds(msg, &d.notes))
        }
    } else {
        (true, Reason::Scaling, with_holds(format!("{new_available} of {desired} running"), &d.notes))
    };
    set_condition(&mut st.conditions, ConditionType::Progressing, holds, reason, &msg);
}

/// `message`, then the notes that hold the deployment back.
fn with_holds(message: String, notes: &[Note]) -> String {
    notes.iter().filter(|n| n.holds_back()).fold(message, |m, n| format!("{m}; {n}"))
}

/// The Available condition (with the environment problems of the machines that wait lifted
/// onto the deployment).
fn available(c: &Classes<'_>, st: &mut MachineDeploymentStatus) {
    let waiting: Vec<&Member> = c.live.iter().copied().filter(|m| !c.is_available(m)).collect();
    let environment = lift_environment_conditions(&mut st.conditions, &waiting);
    let (available, min_available) = (c.available, c.min_available());
    let reason = if available >= min_available {
        Reason::MinimumAvailable
    } else {
        environment.map_or(Reason::BelowMinimum, Reason::from)
    };
    let message = format!("{available} running, {min_available} required");
    set_condition(&mut st.conditions, ConditionType::Available, available >= min_available, reason, &message);
}

#[cfg(test)]
mod tests;
