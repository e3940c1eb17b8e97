//! A Machine as the deployment's planner reads it ([`Member`]), parsed from its stored text one
//! machine at a time ([`StoredMember`]): what decides creates, deletes, replacements and status,
//! and nothing else.

use std::borrow::Cow;

use super::owner::{Remediation, Standing, Unit};
use crate::policy::ENVIRONMENT_CONDITIONS;
use crate::resources::*;

/// The annotation older controllers set on a failed Machine they deleted for replacement: read
/// as a remediation ([`ANNOTATION_DISRUPTION`] says so now).
pub const ANNOTATION_REPLACING: &str = "machine.driver.dev/replacing";

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
    /// The disruption it was taken for ([`ANNOTATION_DISRUPTION`]; the older
    /// [`ANNOTATION_REPLACING`] reads as `Remediation`): `Remediation` counts as in flight until
    /// it is gone; `Autoscaler` (with the delete-machine annotation) makes its scale-down the
    /// cluster-autoscaler's.
    pub taken: Option<DisruptionReason>,
    /// It carries the delete-machine annotation (deleted first on scale-down).
    pub marked_for_deletion: bool,
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
    /// The cloud takes it, or recommends moving off it (`status.interruption`): the kind, and
    /// the deadline when the cloud gave one.
    pub interrupted: Option<(InterruptionKind, Option<Time>)>,
    /// The cloud reclaimed its capacity (a spot or capacity-reservation interruption): when the
    /// controller heard of it. Its failure domain is short of capacity from then, for a backoff.
    pub reclaimed: Option<Time>,
}

/// A create refused for capacity or availability: the driver's reason (UpperCamel) and message.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    /// `InsufficientCapacity`, `ZoneUnavailable`, `QuotaExceeded`, ….
    pub reason: String,
    /// What the driver said.
    pub message: String,
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
    /// Reads a whole Machine as the planner does: through its stored form, the one way a Member
    /// is made.
    ///
    /// # Errors
    /// What [`StoredMember::into_member`] refuses.
    pub fn read(m: &Machine) -> serde_json::Result<Member> {
        let text = serde_json::to_string(m)?;
        serde_json::from_str::<StoredMember<'_>>(&text).and_then(StoredMember::into_member)
    }

    /// It as a unit of its owner ([`super::owner`]): of the revision `target_rev` or not,
    /// available at `now` once Ready for `min_ready`.
    pub fn unit(&self, target_rev: &str, now: Time, min_ready: chrono::Duration) -> Unit<'_, Member> {
        let standing = match self.phase {
            Phase::Failed => Standing::Failed,
            Phase::Unknown => Standing::Down,
            Phase::Running if self.node_not_ready => Standing::Down,
            Phase::Pending | Phase::Creating | Phase::Provisioned => Standing::Coming,
            Phase::Updating => Standing::Updating,
            Phase::Running | Phase::Terminating => Standing::Running,
        };
        Unit {
            item: self,
            key: &self.name,
            uid: &self.uid,
            age: self.created.map_or(i64::MIN, |t| t.timestamp_micros()),
            going: self.deleting,
            new: self.revision == target_rev,
            available: self.is_available_at(now, min_ready),
            disrupted: self.is_disrupted(),
            standing,
            taken: self.taken,
            marked_for_deletion: self.marked_for_deletion,
            remediation: self.remediation,
            marked_unhealthy: self.marked_unhealthy,
            interrupted: self.interrupted.map(|(k, _)| k),
        }
    }

    /// Whether its owner took it for remediation (marked): in flight until it is gone.
    pub fn remediating(&self) -> bool {
        self.taken == Some(DisruptionReason::Remediation)
    }

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
    #[serde(default, borrow)]
    interruption: Option<ViewInterruption<'a>>,
}

/// The interruption's kind (left unparsed: a kind a newer controller wrote reads as none) and
/// deadline.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct ViewInterruption<'a> {
    #[serde(borrow)]
    kind: Cow<'a, str>,
    #[serde(default)]
    not_before: Option<Time>,
    #[serde(default)]
    received_at: Option<Time>,
    #[serde(default)]
    offering: Option<ViewOffering<'a>>,
}

/// Where the interrupted machine ran: only the capacity type is read.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct ViewOffering<'a> {
    #[serde(borrow, default)]
    capacity_type: Cow<'a, str>,
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
        let interrupted =
            st.interruption.as_ref().and_then(|i| Some((i.kind.parse::<InterruptionKind>().ok()?, i.not_before)));
        // A spot machine stopped or terminated counts too: Azure reports an eviction only after the
        // fact, and AWS's termination can supersede its warning before a plan saw it.
        let reclaimed = st
            .interruption
            .as_ref()
            .filter(|i| {
                let spot = i.offering.as_ref().is_some_and(|o| o.capacity_type == "spot");
                interrupted
                    .is_some_and(|(k, _)| k.reclaims() || (spot && k.involuntary() && k >= InterruptionKind::Stopping))
            })
            .and_then(|i| i.received_at);
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
            taken: a
                .disruption
                .as_deref()
                .and_then(|r| r.parse().ok())
                .or(a.replacing.is_some().then_some(DisruptionReason::Remediation)),
            marked_for_deletion: a.delete.is_some_and(|v| v != "false"),
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
            interrupted,
            reclaimed,
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

/// A whole Machine as the planner reads it ([`Member::read`]).
#[cfg(test)]
impl From<&Machine> for Member {
    fn from(m: &Machine) -> Self {
        Member::read(m).unwrap_or_else(|e| panic!("{}: {e}", m.metadata.name))
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
