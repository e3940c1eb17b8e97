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

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use super::Limits;
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
    /// Name.
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
    /// Why it is not available yet: of a machine that is not available only.
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
/// addresses, request IDs and the other conditions are skipped. The machines a plan acts on in
/// full (replace, in place) are read again by key.
#[derive(serde::Deserialize)]
pub struct StoredMember {
    metadata: ViewMeta,
    #[serde(default)]
    status: ViewStatus,
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct ViewMeta {
    name: String,
    #[serde(default)]
    namespace: String,
    #[serde(default)]
    uid: String,
    #[serde(default)]
    resource_version: String,
    #[serde(default)]
    creation_timestamp: Option<Time>,
    #[serde(default)]
    deletion_timestamp: Option<Time>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
    #[serde(default)]
    owner_references: Vec<OwnerReference>,
}

#[derive(serde::Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct ViewStatus {
    #[serde(default)]
    phase: Phase,
    #[serde(default)]
    conditions: Vec<Condition>,
    #[serde(default)]
    last_operation: Option<LastOperation>,
    #[serde(default)]
    failure: Option<Failure>,
}

impl StoredMember {
    /// Whether `owner` controls it (same namespace, a controller reference with its uid).
    pub fn owned_by(&self, owner: &ObjectMeta) -> bool {
        self.metadata.namespace == owner.namespace
            && self.metadata.owner_references.iter().any(|o| o.controller && o.uid == owner.uid)
    }

    /// The planner's view of it.
    pub fn into_member(self) -> Member {
        let m = self.metadata;
        let deleting = m.deletion_timestamp.is_some();
        let st = self.status;
        let node_not_ready =
            condition(&st.conditions, ConditionType::NodeReady).is_some_and(|c| c.status == ConditionStatus::False);
        let ready_since = condition(&st.conditions, ConditionType::Ready)
            .filter(|c| st.phase == Phase::Running && c.status == ConditionStatus::True)
            .map(|c| c.last_transition_time);
        let waiting = if st.phase != Phase::Running || deleting || node_not_ready {
            let operation_reason = st.last_operation.map(|o| o.reason).unwrap_or_default();
            // A Running machine waits for its Node; any other for itself.
            let why =
                if st.phase == Phase::Running && !deleting { ConditionType::NodeReady } else { ConditionType::Ready };
            st.conditions
                .into_iter()
                .find(|c| c.condition_type == why)
                .map(|ready| Box::new(Waiting { reason: ready.reason, message: ready.message, operation_reason }))
        } else {
            None
        };
        let mut labels = m.labels;
        Member {
            name: m.name,
            uid: m.uid,
            resource_version: m.resource_version,
            revision: labels.remove(LABEL_REVISION).unwrap_or_default(),
            created: m.creation_timestamp,
            deleting,
            replacing: m.annotations.contains_key(ANNOTATION_REPLACING),
            marked_for_deletion: m.annotations.get(ANNOTATION_DELETE).is_some_and(|v| v != "false"),
            phase: st.phase,
            failure: st.failure.map(Box::new),
            node_template: m.annotations.get(ANNOTATION_NODE_TEMPLATE).cloned().unwrap_or_default(),
            ready_since,
            node_not_ready,
            waiting,
        }
    }
}

/// A whole Machine as the planner reads it: through its stored form, the one way a Member is made.
#[cfg(test)]
impl From<&Machine> for Member {
    fn from(m: &Machine) -> Self {
        let stored = serde_json::to_value(m).and_then(serde_json::from_value::<StoredMember>);
        stored.map(StoredMember::into_member).unwrap_or_else(|e| panic!("{}: {e}", m.metadata.name))
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
    /// A warning (else normal).
    pub warning: bool,
    /// UpperCamel reason.
    pub reason: &'static str,
    /// Message.
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

/// Plans one reconcile of a deployment.
pub fn plan(o: Observed<'_>) -> Plan {
    let md = o.deployment;
    let machines = o.machines;
    let now = o.now;
    let mut st = md.status.clone();
    let mut events = Vec::new();
    let spec_rev = revision(&md.spec.template);

    // Which revision to move to: the spec's, unless it failed before.
    let (target_rev, target) = if st.bad_revisions.iter().any(|b| b.revision == spec_rev) {
        match st.revision_history.last() {
            Some(good) => (good.revision.clone(), Some(good.template.clone())),
            None => (spec_rev.clone(), None),
        }
    } else {
        (spec_rev.clone(), Some(md.spec.template.clone()))
    };

    let desired = md.spec.replicas;
    let in_place_mode = md.spec.strategy.strategy_type == StrategyType::InPlace;
    let limits = if in_place_mode {
        Limits::in_place(desired, &md.spec.strategy.rolling_update, &md.spec.strategy.in_place.max_unavailable)
    } else {
        Limits::resolve(desired, &md.spec.strategy.rolling_update)
    };
    let (surge, unavailable) = (limits.max_surge, limits.max_unavailable);

    let min_ready = chrono::Duration::seconds(i64::try_from(md.spec.min_ready_seconds).unwrap_or(i64::MAX / 2));
    let is_available = |m: &Member| m.is_available_at(now, min_ready);
    let live: Vec<&Member> = machines.iter().filter(|m| !m.deleting).collect();
    let total = machines.len() as i64;
    let new: Vec<&Member> = live.iter().copied().filter(|m| m.revision == target_rev).collect();
    let old: Vec<&Member> = live.iter().copied().filter(|m| m.revision != target_rev).collect();
    let new_available = new.iter().filter(|m| is_available(m)).count() as i64;
    let available = live.iter().filter(|m| is_available(m)).count() as i64;

    // Rollout bookkeeping.
    let rolling = target_rev != st.current_revision || !old.is_empty();
    if rolling && st.rollout.as_ref().is_none_or(|r| r.revision != target_rev) {
        st.rollout = Some(RolloutState { revision: target_rev.clone(), started: now, last_progress: now, failures: 0 });
        if !st.current_revision.is_empty() {
            events.push(PlannedEvent {
                warning: false,
                reason: "RolloutStarted",
                message: format!("rolling out revision {target_rev}"),
            });
        }
    }
    if let Some(r) = st.rollout.as_mut() {
        if new_available > md.status.available_replicas {
            r.last_progress = now;
        }
    }

    // Failed machines: counted against the failure budget, replaced within the meltdown cap.
    let failed: Vec<&Member> = live.iter().copied().filter(|m| m.phase == Phase::Failed).collect();
    let new_failed_now = failed.iter().filter(|m| m.revision == target_rev && attributable(m)).count() as u32;
    let budget_used = st.rollout.as_ref().map_or(0, |r| r.failures) + new_failed_now;
    if target.is_some()
        && target_rev == spec_rev
        && st.rollout.is_some()
        && budget_used >= md.spec.failure_budget.max(1)
    {
        // Abort: remember the revision as bad and roll back (if there is anything to roll back to).
        let reason =
            format!("{budget_used} machines of revision {target_rev} failed (budget {})", md.spec.failure_budget);
        st.bad_revisions.push(BadRevision { revision: target_rev.clone(), reason: reason.clone(), time: now });
        st.rollout = None;
        let then = match st.revision_history.last() {
            Some(good) => format!("rolling back to the last good revision {}", good.revision),
            None => "no earlier revision to roll back to; change the template".to_string(),
        };
        set_condition(
            &mut st.conditions,
            ConditionType::Progressing,
            false,
            Reason::RolloutAborted,
            &format!("{reason}; {then}"),
        );
        events.push(PlannedEvent { warning: true, reason: "RolloutAborted", message: format!("{reason}; {then}") });
        return Plan {
            target_revision: target_rev,
            target,
            aborted: true,
            replace: Vec::new(),
            create: 0,
            in_place: None,
            delete: Vec::new(),
            status: st,
            events,
            settled: false,
            has_failed: true,
        };
    }

    let replacing = machines.iter().filter(|m| m.deleting && m.replacing).count() as i64;
    let room_for_replacements = (i64::from(md.spec.max_concurrent_replacements) - replacing).max(0) as usize;
    let mut replace = Vec::new();
    if o.may_replace {
        for m in failed.iter().take(room_for_replacements) {
            if m.revision == target_rev && attributable(m) {
                if let Some(r) = st.rollout.as_mut() {
                    r.failures += 1;
                }
            }
            replace.push(m.name.clone());
        }
    }
    let replaced: HashSet<&str> = replace.iter().map(String::as_str).collect();

    let mut create = 0;
    let mut in_place = None;
    let mut delete = Vec::new();
    if !md.spec.paused {
        if target.is_some() {
            // Scale up the target revision within replicas + maxSurge (terminating included).
            // In place, old machines are converted, so only missing machines are created.
            let room = desired + surge - total;
            let want = if in_place_mode { desired - live.len() as i64 } else { desired - new.len() as i64 };
            create = want.min(room).max(0) as usize;
            if in_place_mode && !old.is_empty() {
                in_place = Some(InPlaceWork {
                    candidates: old.iter().filter(|m| m.phase == Phase::Running).map(|m| m.name.clone()).collect(),
                    max_unavailable: unavailable,
                    busy: old.iter().filter(|m| m.phase == Phase::Updating).count() as i64,
                });
            }
        }

        // Scale down old machines without going below replicas − maxUnavailable.
        let min_available = desired - unavailable;
        let new_unavailable = new.len() as i64 - new_available;
        let mut budget = live.len() as i64 - min_available - new_unavailable;
        if in_place_mode {
            // Only a scale-down removes machines here; updates happen in place.
            budget = budget.min(live.len() as i64 - desired);
        }
        let mut old_sorted: Vec<&Member> =
            old.iter().copied().filter(|m| !replaced.contains(m.name.as_str())).collect();
        deletion_order(&mut old_sorted, md.spec.delete_policy);
        let mut can_remove_available = available - min_available;
        for m in old_sorted {
            if budget <= 0 {
                break;
            }
            if is_available(m) {
                if can_remove_available <= 0 {
                    continue;
                }
                can_remove_available -= 1;
            }
            delete.push(m.name.clone());
            budget -= 1;
        }
    }

    // Scale down the target revision when there are too many (scale-down or leftover surge).
    let excess = new.len() as i64 - desired;
    if excess > 0 {
        let mut new_sorted: Vec<&Member> =
            new.iter().copied().filter(|m| !replaced.contains(m.name.as_str())).collect();
        deletion_order(&mut new_sorted, md.spec.delete_policy);
        delete.extend(new_sorted.iter().take(excess as usize).map(|m| m.name.clone()));
    }

    // Status.
    st.observed_generation = md.metadata.generation;
    st.replicas = total;
    st.updated_replicas = new.len() as i64;
    st.ready_replicas = available;
    st.available_replicas = new_available;
    st.failed_replicas = failed.len() as i64;
    st.target_revision = target_rev.clone();
    let complete = target.is_some() && new_available >= desired && old.is_empty() && new.len() as i64 == desired;
    if complete {
        if st.current_revision != target_rev {
            if !st.current_revision.is_empty() {
                events.push(PlannedEvent {
                    warning: false,
                    reason: "RolloutComplete",
                    message: format!("revision {target_rev} is rolled out"),
                });
            }
            st.current_revision = target_rev.clone();
        }
        if let Some(template) = &target {
            st.revision_history.retain(|r| r.revision != target_rev);
            st.revision_history.push(RevisionRecord { revision: target_rev.clone(), template: template.clone() });
            let n = st.revision_history.len();
            if n > HISTORY {
                st.revision_history.drain(..n - HISTORY);
            }
        }
        st.rollout = None;
        let msg = if target_rev != spec_rev { "rolled back: the spec's revision failed before" } else { "" };
        set_condition(
            &mut st.conditions,
            ConditionType::Progressing,
            true,
            if msg.is_empty() { Reason::NewRevisionAvailable } else { Reason::RolledBack },
            msg,
        );
    } else if target.is_none() {
        let why = st.bad_revisions.iter().rev().find(|b| b.revision == spec_rev).map_or("", |b| b.reason.as_str());
        let msg = format!(
            "revision {spec_rev} failed ({why}) and there is no earlier revision to roll back to; change the template"
        );
        set_condition(&mut st.conditions, ConditionType::Progressing, false, Reason::NoGoodRevision, &msg);
    } else if let Some(r) = &st.rollout {
        let stalled = (now - r.last_progress).to_std().unwrap_or_default()
            > Duration::from_secs(md.spec.progress_deadline_seconds);
        if stalled {
            let msg = format!("no progress for {}s", md.spec.progress_deadline_seconds);
            set_condition(
                &mut st.conditions,
                ConditionType::Progressing,
                false,
                Reason::ProgressDeadlineExceeded,
                &msg,
            );
        } else {
            let msg = format!("{new_available} of {desired} machines on revision {target_rev}");
            set_condition(&mut st.conditions, ConditionType::Progressing, true, Reason::Rolling, &msg);
        }
    } else {
        let msg = format!("{new_available} of {desired} running");
        set_condition(&mut st.conditions, ConditionType::Progressing, true, Reason::Scaling, &msg);
    }
    let waiting: Vec<&Member> = live.iter().copied().filter(|m| !is_available(m)).collect();
    let environment = lift_environment_conditions(&mut st.conditions, &waiting);
    let min_available = desired - unavailable;
    let below_reason = environment.map_or(Reason::BelowMinimum, Reason::from);
    set_condition(
        &mut st.conditions,
        ConditionType::Available,
        available >= min_available,
        if available >= min_available { Reason::MinimumAvailable } else { below_reason },
        &format!("{available} running, {min_available} required"),
    );
    Plan {
        target_revision: target_rev,
        target,
        aborted: false,
        replace,
        create,
        in_place,
        delete,
        status: st,
        events,
        settled: complete && failed.is_empty(),
        has_failed: !failed.is_empty(),
    }
}

#[cfg(test)]
mod tests;
