//! The MachineDeployment planner: from the deployment and its machines to what to create,
//! replace, delete, and the status to write.
//!
//! - RollingUpdate: the Kubernetes Deployment arithmetic ([`Limits`]). Terminating machines
//!   still exist in the cloud, so they count toward `replicas + maxSurge`: the cloud never holds
//!   more than that.
//! - Failed machines are replaced, at most `maxConcurrentReplacements` at once (meltdown
//!   protection), when the replacement pace allows.
//! - A rollout whose new machines fail `failureBudget` times is aborted: its revision is
//!   remembered as bad and never applied again (until the template changes), and the deployment
//!   rolls back to the last good revision.
//! - InPlace: old machines are converted (see [`super::in_place`]); only missing machines are
//!   created and only a scale-down removes machines.
//!
//! [`plan`] runs named steps in order (choose the target, classify, track the rollout, the
//! failure budget, replacements, scale up, scale down old, remove the excess, status); each
//! records in [`Plan::notes`] why it acted or held back ([`Note`]), as Cluster API's rollout
//! planner does, so tests can assert the reason as well as the action.

use std::borrow::Cow;
use std::cmp::Reverse;
use std::time::Duration;

use super::Limits;
use crate::events::EventReason;
use crate::policy::{self, ENVIRONMENT_CONDITIONS};
use crate::resources::*;

/// Annotation set on a failed Machine deleted for replacement (counts toward the cap).
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
    /// It carries [`ANNOTATION_REPLACING`].
    pub replacing: bool,
    /// It carries the delete-machine annotation (deleted first on scale-down).
    pub marked_for_deletion: bool,
    /// Its phase.
    pub phase: Phase,
    /// Its permanent failure.
    pub failure: Option<Box<Failure>>,
    /// The hash of the node template and settings it carries ([`ANNOTATION_NODE_TEMPLATE`]).
    pub node_template: String,
    /// Since when it is Ready (its `Ready` condition's transition to True), if Running.
    pub ready_since: Option<Time>,
    /// Its Node is known not to be Ready (`NodeReady=False`; only with a target cluster).
    pub node_not_ready: bool,
    /// Why it is not available yet, when that is its environment's doing (an
    /// [`ENVIRONMENT_CONDITIONS`] reason: what [`lift_environment_conditions`] reports). A
    /// machine that is merely being created carries none: 10,000 of them would hold 10,000
    /// copies of the same message in every plan.
    pub waiting: Option<Box<Waiting>>,
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
    status: ViewStatus<'a>,
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

/// The annotations the planner reads ([`ANNOTATION_REPLACING`], [`ANNOTATION_DELETE`],
/// [`ANNOTATION_NODE_TEMPLATE`]).
#[derive(serde::Deserialize, Default)]
struct ViewAnnotations<'a> {
    #[serde(rename = "machine.driver.dev/replacing", default)]
    replacing: Option<serde::de::IgnoredAny>,
    #[serde(rename = "machine.driver.dev/delete-machine", default, borrow)]
    delete: Option<Cow<'a, str>>,
    #[serde(rename = "machine.driver.dev/node-template-hash", default, borrow)]
    node_template: Option<Cow<'a, str>>,
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
        let node_not_ready = find(ConditionType::NodeReady).is_some_and(|c| c.status == ConditionStatus::False);
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
        Ok(Member {
            name: m.name.into_owned(),
            uid: m.uid.into_owned(),
            resource_version: m.resource_version.into_owned(),
            revision: m.labels.revision.map(Cow::into_owned).unwrap_or_default(),
            created: m.creation_timestamp,
            deleting,
            replacing: a.replacing.is_some(),
            marked_for_deletion: a.delete.is_some_and(|v| v != "false"),
            phase: st.phase,
            failure: st.failure.map(Box::new),
            node_template: a.node_template.map(Cow::into_owned).unwrap_or_default(),
            ready_since,
            node_not_ready,
            waiting,
        })
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
    /// Whether the replacement pace lets a failed machine be replaced now.
    pub may_replace: bool,
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
    /// Failed machines to mark with [`ANNOTATION_REPLACING`] and delete, in order.
    pub replace: Vec<String>,
    /// Machines of the target revision to create.
    pub create: usize,
    /// InPlace: old machines to try to update in place (in order), and how many may be
    /// unavailable at once; `None` when there is nothing to convert.
    pub in_place: Option<InPlaceWork>,
    /// Machines to delete (scale-down, old revisions, excess of the target revision), in order.
    pub delete: Vec<String>,
    /// The status to write (the in-place condition is added by whoever runs the in-place work).
    pub status: MachineDeploymentStatus,
    /// Events to record.
    pub events: Vec<PlannedEvent>,
    /// Every machine is on the target revision and running, and none failed.
    pub settled: bool,
    /// Failed machines remain (come back when the next replacement may go).
    pub has_failed: bool,
    /// Why it decided as it did, step by step.
    pub notes: Vec<Note>,
}

/// The InPlace strategy's share of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InPlaceWork {
    /// Old Running machines, in the order they are tried.
    pub candidates: Vec<String>,
    /// maxUnavailable of the InPlace strategy.
    pub max_unavailable: i64,
    /// Old machines already updating (they use up maxUnavailable).
    pub busy: i64,
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
    /// Failed machines wait for the replacement pace.
    ReplacementsPaced {
        /// Failed machines not replaced.
        waiting: usize,
    },
    /// Failed machines wait: `maxConcurrentReplacements` are under way.
    ReplacementsCapped {
        /// `maxConcurrentReplacements`.
        limit: u32,
        /// Replacements under way (machines deleted for replacement, still terminating).
        in_flight: i64,
        /// Failed machines not replaced.
        waiting: usize,
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
    /// Old machines are kept so that `replicas − maxUnavailable` stay available.
    WaitingForAvailable {
        /// Old machines kept.
        held: usize,
        /// Available machines.
        available: i64,
        /// `replicas − maxUnavailable`.
        min_available: i64,
        /// Machines of the target revision not available yet.
        new_unavailable: i64,
    },
    /// InPlace: old machines are converted rather than replaced.
    InPlace {
        /// Old Running machines to try.
        candidates: usize,
        /// Old machines updating.
        busy: i64,
        /// The strategy's maxUnavailable.
        max_unavailable: i64,
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
            Note::ReplacementsPaced { .. }
                | Note::ReplacementsCapped { .. }
                | Note::SurgeExhausted { .. }
                | Note::WaitingForAvailable { .. }
                | Note::Paused
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
            Note::ReplacementsPaced { waiting } => {
                write!(f, "{waiting} failed machine(s) wait for the replacement pace")
            }
            Note::ReplacementsCapped { limit, in_flight, waiting } => write!(
                f,
                "{waiting} failed machine(s) wait: {in_flight} replacement(s) under way, \
                 maxConcurrentReplacements {limit}"
            ),
            Note::Paused => write!(f, "paused"),
            Note::SurgeExhausted { limit, current, wanted } => {
                write!(f, "{wanted} machine(s) wanted, {current} of {limit} (replicas + maxSurge) exist")
            }
            Note::WaitingForAvailable { held, available, min_available, new_unavailable } => write!(
                f,
                "{held} old machine(s) kept: {available} available, {min_available} required, \
                 {new_unavailable} new not available yet"
            ),
            Note::InPlace { candidates, busy, max_unavailable } => write!(
                f,
                "{candidates} old machine(s) to update in place, {busy} updating (maxUnavailable {max_unavailable})"
            ),
            Note::AboveReplicas { machines, replicas } => {
                write!(f, "{machines} machines of the target revision for {replicas} replicas")
            }
            Note::ProgressDeadlineExceeded { seconds } => write!(f, "no progress for {seconds}s"),
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
}

/// Plans one reconcile of a deployment: the steps below, in order, each noting why it acted or
/// held back.
pub fn plan(o: Observed<'_>) -> Plan {
    let md = o.deployment;
    let mut d = Draft { status: md.status.clone(), events: Vec::new(), notes: Vec::new() };
    let c = classify(&o, &mut d);
    track_rollout(md, &c, &mut d);
    if let Some(failures) = budget_spent(md, &c, &d) {
        return abort(md, c, d, failures);
    }
    let replace = replacements(&o, &c, &mut d);
    let (mut create, mut in_place, mut delete) = (0, None, Vec::new());
    if md.spec.paused {
        d.notes.push(Note::Paused);
    } else {
        (create, in_place) = scale_up(&c, &mut d);
        delete = scale_down_old(md, &c, &replace, &mut d);
    }
    delete.extend(scale_down_excess(md, &c, &replace, &mut d));
    let complete = write_status(md, &c, &mut d);
    Plan {
        settled: complete && c.failed.is_empty(),
        has_failed: !c.failed.is_empty(),
        target_revision: c.target_rev,
        target: c.target,
        aborted: false,
        replace,
        create,
        in_place,
        delete,
        status: d.status,
        events: d.events,
        notes: d.notes,
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

/// The failures of the spec's revision under way, if they reach the failure budget (failed
/// machines of the target revision count when their failure is the revision's doing).
fn budget_spent(md: &MachineDeployment, c: &Classes<'_>, d: &Draft) -> Option<u32> {
    let rollout = d.status.rollout.as_ref()?;
    let failed_now = c.failed.iter().filter(|m| m.revision == c.target_rev && attributable(m)).count() as u32;
    let used = rollout.failures + failed_now;
    let spent = c.target.is_some() && c.target_rev == c.spec_rev && used >= md.spec.failure_budget.max(1);
    spent.then_some(used)
}

/// Aborts the rollout: the revision is remembered as bad and the deployment rolls back (if there
/// is anything to roll back to). Nothing else is done this time.
fn abort(md: &MachineDeployment, c: Classes<'_>, mut d: Draft, failures: u32) -> Plan {
    let (st, rev) = (&mut d.status, &c.target_rev);
    let reason = format!("{failures} machines of revision {rev} failed (budget {})", md.spec.failure_budget);
    st.bad_revisions.push(BadRevision { revision: rev.clone(), reason: reason.clone(), time: c.now });
    st.rollout = None;
    let then = match st.revision_history.last() {
        Some(good) => format!("rolling back to the last good revision {}", good.revision),
        None => "no earlier revision to roll back to; change the template".to_string(),
    };
    let message = format!("{reason}; {then}");
    set_condition(&mut st.conditions, ConditionType::Progressing, false, Reason::RolloutAborted, &message);
    d.events.push(PlannedEvent { reason: EventReason::RolloutAborted, message });
    d.notes.push(Note::RevisionAborted { revision: rev.clone(), failures, budget: md.spec.failure_budget });
    Plan {
        target_revision: c.target_rev,
        target: c.target,
        aborted: true,
        replace: Vec::new(),
        create: 0,
        in_place: None,
        delete: Vec::new(),
        status: d.status,
        events: d.events,
        notes: d.notes,
        settled: false,
        has_failed: true,
    }
}

/// Failed machines to replace: when the pace allows, within `maxConcurrentReplacements` (those
/// still terminating count). Each one of the target revision counts against the failure budget
/// when its failure is the revision's doing.
fn replacements(o: &Observed<'_>, c: &Classes<'_>, d: &mut Draft) -> Vec<String> {
    if c.failed.is_empty() {
        return Vec::new();
    }
    if !o.may_replace {
        d.notes.push(Note::ReplacementsPaced { waiting: c.failed.len() });
        return Vec::new();
    }
    let limit = o.deployment.spec.max_concurrent_replacements;
    let in_flight = o.machines.iter().filter(|m| m.deleting && m.replacing).count() as i64;
    let room = (i64::from(limit) - in_flight).max(0) as usize;
    let mut replace = Vec::new();
    for m in c.failed.iter().take(room) {
        if m.revision == c.target_rev && attributable(m) {
            if let Some(r) = d.status.rollout.as_mut() {
                r.failures += 1;
            }
        }
        replace.push(m.name.clone());
    }
    if replace.len() < c.failed.len() {
        d.notes.push(Note::ReplacementsCapped { limit, in_flight, waiting: c.failed.len() - replace.len() });
    }
    replace
}

/// Scales up the target revision within `replicas + maxSurge` (terminating machines included).
/// In place, old machines are converted, so only missing machines are created.
fn scale_up(c: &Classes<'_>, d: &mut Draft) -> (usize, Option<InPlaceWork>) {
    if c.target.is_none() {
        return (0, None);
    }
    let limit = c.desired + c.limits.max_surge;
    let current = c.all.len() as i64;
    let have = if c.in_place { c.live.len() } else { c.new.len() } as i64;
    let wanted = c.desired - have;
    let create = wanted.min(limit - current).max(0) as usize;
    if wanted > 0 && (create as i64) < wanted {
        d.notes.push(Note::SurgeExhausted { limit, current, wanted });
    }
    if !c.in_place || c.old.is_empty() {
        return (create, None);
    }
    let work = InPlaceWork {
        candidates: c.old.iter().filter(|m| m.phase == Phase::Running).map(|m| m.name.clone()).collect(),
        max_unavailable: c.limits.max_unavailable,
        busy: c.old.iter().filter(|m| m.phase == Phase::Updating).count() as i64,
    };
    let (candidates, busy, max_unavailable) = (work.candidates.len(), work.busy, work.max_unavailable);
    d.notes.push(Note::InPlace { candidates, busy, max_unavailable });
    (create, Some(work))
}

/// Scales down old machines (not being replaced) in deletion order without going below
/// `replicas − maxUnavailable` available; in place, only a scale-down removes them.
fn scale_down_old(md: &MachineDeployment, c: &Classes<'_>, replace: &[String], d: &mut Draft) -> Vec<String> {
    let min_available = c.min_available();
    let new_unavailable = c.new.len() as i64 - c.new_available;
    let live = c.live.len() as i64;
    let mut budget = live - min_available - new_unavailable;
    if c.in_place {
        // Only a scale-down removes machines here; updates happen in place.
        budget = budget.min(live - c.desired);
    }
    let mut order: Vec<&Member> = c.old.iter().copied().filter(|m| !replace.contains(&m.name)).collect();
    deletion_order(&mut order, md.spec.delete_policy);
    let mut can_remove_available = c.available - min_available;
    let mut delete = Vec::new();
    for m in &order {
        if budget <= 0 {
            break;
        }
        if c.is_available(m) {
            if can_remove_available <= 0 {
                continue;
            }
            can_remove_available -= 1;
        }
        delete.push(m.name.clone());
        budget -= 1;
    }
    let held = order.len() - delete.len();
    if held > 0 && !c.in_place {
        let available = c.available;
        d.notes.push(Note::WaitingForAvailable { held, available, min_available, new_unavailable });
    }
    delete
}

/// Scales down the target revision when there are too many (a scale-down, or leftover surge).
fn scale_down_excess(md: &MachineDeployment, c: &Classes<'_>, replace: &[String], d: &mut Draft) -> Vec<String> {
    let excess = c.new.len() as i64 - c.desired;
    if excess <= 0 {
        return Vec::new();
    }
    d.notes.push(Note::AboveReplicas { machines: c.new.len() as i64, replicas: c.desired });
    let mut order: Vec<&Member> = c.new.iter().copied().filter(|m| !replace.contains(&m.name)).collect();
    deletion_order(&mut order, md.spec.delete_policy);
    order.iter().take(excess as usize).map(|m| m.name.clone()).collect()
}

/// The status: counts, then the Progressing and Available conditions. Returns whether the
/// rollout is complete (every machine on the target revision, `replicas` of them available).
fn write_status(md: &MachineDeployment, c: &Classes<'_>, d: &mut Draft) -> bool {
    let st = &mut d.status;
    st.observed_generation = md.metadata.generation;
    st.replicas = c.all.len() as i64;
    st.updated_replicas = c.new.len() as i64;
    st.ready_replicas = c.available;
    st.available_replicas = c.new_available;
    st.failed_replicas = c.failed.len() as i64;
    st.target_revision = c.target_rev.clone();
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
