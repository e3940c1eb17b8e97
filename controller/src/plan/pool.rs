//! The MachinePool planner. Rolling upgrades follow CAPZ: with maxSurge > 0 the pool grows to
//! `replicas + maxSurge` on the new model, then old-model instances are deleted in CAPZ's order
//! (failed, annotated, unready, then ready — ready ones within `ready − replicas +
//! maxUnavailable`); with maxSurge = 0 old instances are upgraded in place, maxUnavailable at a
//! time.
//!
//! **With nodes managed** (a target cluster, [`Observed::nodes_managed`]) every instance that
//! goes must have its Node drained first, so the pool never lets the cloud choose and never
//! reimages in place:
//! - the planner chooses the instances to remove and names their Machines
//!   ([`Step::DeleteMachines`]); each Machine's deletion runs the recorded sequence (hooks,
//!   cordon, drain, volumes, then DeletePoolInstances of exactly that instance, then its Node);
//! - a scale-down deletes `live − capacity` Machines in the deletion order shared with deployments
//!   ([`owner::deletion_order`]: annotated (`machine.driver.dev/delete-machine`), failed, down,
//!   coming up, updating, running; old model first; then the highest instance ID); it is not
//!   bounded by maxUnavailable (fewer replicas is what was asked);
//! - surge upgrades delete the same old instances they would delete without nodes, as Machines;
//! - maxSurge = 0 upgrades are **delete and replace** rather than in-place reimages (a reimage
//!   disrupts the Node's pods without a drain): old instances are deleted as Machines in CAPZ's
//!   order within `ready − replicas + maxUnavailable` (so one at a time with the defaults), and
//!   the pool refills on the latest model once each is gone;
//! - ApplyPool is never sent with a capacity below the instances the cloud still holds (live
//!   ones plus those whose Machines are being deleted): while a chosen Machine drains, a lower
//!   capacity would let the cloud pick another instance. A higher one (a scale-up, a template
//!   change's surge) goes ahead: it removes nothing.
//!
//! The instances are units of the owner view ([`super::owner`]) and the disruption steps are the
//! ones deployments run ([`super::steps`]): every instance the pool takes away or disrupts is
//! asked of the disruption planner ([`super::disruption`]) with its reason: `Rollout` (an upgrade
//! by deletion), `InPlaceUpdate` (a reimage, maxSurge 0 without nodes), `ScaleDown` (fewer
//! replicas), `Autoscaler` (an instance whose removal the cluster-autoscaler asked for) and
//! `Remediation` (a failed instance, or one whose Machine a MachineHealthCheck marked or that is
//! annotated `machine.driver.dev/remediate`). A remediated instance's Machine is marked by a plan
//! that makes no call; then it is replaced first where maxSurge allows (the capacity grows by one
//! for it, as for an upgrade), and its Machine deleted once no replacement is still coming (the
//! usual deletion: drain, then exactly that instance). The remediation pace is the plan's
//! ([`Plan::disruption_status`]).
//!
//! **Interruptions** (an instance's Machine records `status.interruption`, from the driver's
//! event stream or its Node's condition): the instance is asked as `Interruption` (never held)
//! and its Machine deleted at once — drained until a margin before the cloud's deadline with
//! nodes managed — while the capacity grows by one for it until its deletion is sent (the cloud's
//! capacity is one lower from then), at most `replicas` above: the deployments' hard cap.
//!
//! **Canary** (`strategy.canary`): when a new template upgrades a pool's instances (not its first
//! apply), at most `canary.machines` instances reach the new model first: a surge upgrade grows
//! the capacity by at most that many, and old instances go (deleted, deleted and replaced, or
//! reimaged) only while new-model instances, existing and coming, number fewer. Once every
//! canary instance is ready (its Node too, with nodes managed) and not to be remediated for
//! `pauseSeconds` the canary has passed and the upgrade goes on at its usual pace
//! (`status.canary` keeps where it stands across restarts). A pool has no failure budget,
//! revision history or bad revisions: a new-model instance that fails (its Machine Failed: the
//! instance's state, a Node that never joined) while the canary is under way fails it, and no
//! further old instance is taken until the template changes again (a new canary) or the canary
//! is removed from the strategy. Remediation goes on: the failed instance is replaced (by the
//! cloud, on the latest model).
//!
//! [`plan_pool`] projects the instances, runs the remediation and canary steps, chooses the one
//! call ([`Step`]) with or without nodes (the scale-down, rollout and in-place steps inside), and
//! the Ready condition and `status.disruption` to set; [`Plan::notes`] say why ([`Note`]). With nodes
//! managed an instance is ready only once its Node is ([`Observed::ready`]).

use std::collections::HashSet;
use std::time::Duration;

use super::disruption::{self, Candidate, Planner, Report};
use super::owner::{self, holds, PlannedEvent, Remediation, Standing, Unit};
use super::steps::{canary, in_place, interruption, remediation, rollout, scale_down};
use super::Limits;
use crate::resources::{
    CanaryPhase, CanaryStatus, DeletePolicy, DisruptionBudget, DisruptionReason, DisruptionStatus, MachinePool, Phase,
    Reason, RemediationStatus, RollingUpdate, Time,
};

/// An instance's lifecycle state: the protocol's, as the SDK types it.
pub use driver_sdk::InstanceState;

/// Reads the deprecated `PoolInstance.provisioning_state` of a driver older than the protocol's
/// `InstanceState` (it sends `INSTANCE_STATE_UNSPECIFIED`). Those drivers used Azure's words,
/// the only vocabulary the controller ever read.
pub fn legacy_instance_state(provisioning_state: &str) -> InstanceState {
    match provisioning_state {
        "Succeeded" => InstanceState::Running,
        "Failed" => InstanceState::Failed,
        "Deleting" => InstanceState::Deleting,
        "Updating" => InstanceState::Updating,
        _ => InstanceState::Creating,
    }
}

/// The phase of the Machine that mirrors an instance in `state`.
pub fn instance_phase(state: InstanceState) -> Phase {
    match state {
        InstanceState::Running => Phase::Running,
        InstanceState::Failed => Phase::Failed,
        InstanceState::Deleting => Phase::Terminating,
        InstanceState::Updating => Phase::Updating,
        InstanceState::Creating => Phase::Creating,
    }
}

/// The name of the Machine that mirrors instance `instance` of pool `pool`.
pub fn machine_name(pool: &str, instance: &str) -> String {
    format!("{pool}-{instance}")
}

/// One pool instance as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instance {
    /// The instance ID.
    pub id: String,
    /// Provisioning state.
    pub state: InstanceState,
    /// The power state is running.
    pub running: bool,
    /// The instance runs the pool's latest model.
    pub latest_model: bool,
    /// Its Machine says its Node is Ready (`NodeReady=True`); read only with nodes managed.
    pub node_ready: bool,
    /// Why its Machine is to be remediated, if it is (a failed instance is, whatever its
    /// Machine says).
    pub remediation: Option<Remediation>,
    /// A MachineHealthCheck marked its Machine unhealthy (`HealthCheckSucceeded=False`), asking
    /// for its remediation or not.
    pub marked_unhealthy: bool,
    /// The disruption its Machine was taken for (its mark): `Remediation` is in flight until it
    /// is gone; `Autoscaler` makes its removal the cluster-autoscaler's.
    pub taken: Option<DisruptionReason>,
    /// Why its Machine failed (`reason: message`), if the controller or the driver said.
    pub failure: Option<String>,
    /// The cloud takes it, or recommends moving off it (its Machine's `status.interruption`).
    pub interrupted: Option<crate::resources::InterruptionKind>,
}

impl Instance {
    /// An instance in `state` (running, on the latest model, its Node Ready, nothing to
    /// remediate).
    pub fn new(id: &str, state: InstanceState) -> Self {
        Instance {
            id: id.into(),
            state,
            running: true,
            latest_model: true,
            node_ready: true,
            remediation: None,
            marked_unhealthy: false,
            taken: None,
            failure: None,
            interrupted: None,
        }
    }

    /// Provisioned and running (its Node aside: see [`Observed::ready`]).
    pub fn ready(&self) -> bool {
        self.state == InstanceState::Running && self.running
    }

    /// Why it is to be remediated: its Machine's reason, or its own failure.
    fn wants_remediation(&self) -> Option<Remediation> {
        self.remediation.or((self.state == InstanceState::Failed).then_some(Remediation::Failed))
    }
}

/// What the pool reconciler observed.
#[derive(Debug, Clone, Copy)]
pub struct Observed<'a> {
    /// `spec.replicas`.
    pub replicas: i64,
    /// `spec.strategy`.
    pub strategy: &'a RollingUpdate,
    /// The revision (hash) of the pool's template.
    pub revision: &'a str,
    /// `status.appliedRevision`.
    pub applied_revision: &'a str,
    /// `status.appliedCapacity`.
    pub applied_capacity: i64,
    /// The instances listed.
    pub instances: &'a [Instance],
    /// Instances whose Machine is being deleted (their delete is in flight).
    pub deleting: &'a HashSet<String>,
    /// Instances whose Machine carries the delete-machine annotation.
    pub annotated: &'a HashSet<String>,
    /// The controller manages the instances' Nodes (it has a target cluster): instances are
    /// removed only by deleting their Machines, which drains their Nodes first.
    pub nodes_managed: bool,
    /// `spec.disruption.budgets`.
    pub budgets: &'a [DisruptionBudget],
    /// `remediation.maxInFlight`, resolved.
    pub max_in_flight: i64,
    /// `status.disruption.remediation`: the pace of remediations in a row (none starts before
    /// its `notBefore`).
    pub remediation: &'a RemediationStatus,
    /// The pace of remediations in a row: the first delay and the longest.
    pub pace: (Duration, Duration),
    /// What halts remediation now (a MachineHealthCheck's short circuit), if anything.
    pub remediation_halted: Option<&'a str>,
    /// The pool's name (its Machines are named after it and their instances).
    pub pool: &'a str,
    /// `status.canary`: where the canary of the latest model that had one stands.
    pub canary: Option<&'a CanaryStatus>,
    /// The moment of the plan.
    pub now: Time,
}

impl Observed<'_> {
    /// Whether an instance counts as ready: provisioned and running, and with nodes managed,
    /// its Node Ready.
    pub fn ready(&self, i: &Instance) -> bool {
        i.ready() && (!self.nodes_managed || i.node_ready)
    }

    /// Whether it is down: failed, updating, stopped, its Node not Ready, or going.
    fn disrupted(&self, i: &Instance) -> bool {
        match i.state {
            InstanceState::Creating => false,
            InstanceState::Failed | InstanceState::Updating | InstanceState::Deleting => true,
            InstanceState::Running => self.deleting.contains(&i.id) || !self.ready(i),
        }
    }

    /// An instance as a unit: of the latest model of the current template or not.
    fn unit<'a>(&self, i: &'a Instance, template_changed: bool) -> Unit<'a, Instance> {
        let ready = self.ready(i);
        let standing = match i.state {
            InstanceState::Failed => Standing::Failed,
            InstanceState::Creating => Standing::Coming,
            InstanceState::Updating => Standing::Updating,
            InstanceState::Running if !ready => Standing::Down,
            InstanceState::Running | InstanceState::Deleting => Standing::Running,
        };
        Unit {
            item: i,
            key: &i.id,
            uid: &i.id,
            age: number(i),
            going: i.state == InstanceState::Deleting || self.deleting.contains(&i.id),
            new: i.latest_model && !template_changed,
            available: ready,
            disrupted: self.disrupted(i),
            standing,
            taken: i.taken,
            marked_for_deletion: self.annotated.contains(&i.id),
            remediation: i.wants_remediation(),
            marked_unhealthy: i.marked_unhealthy,
            interrupted: i.interrupted,
        }
    }
}

/// The one call a pool reconcile makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// ApplyPool with this capacity and the template (recording the revision and capacity).
    Apply {
        /// Instances wanted.
        capacity: i64,
    },
    /// DeletePoolInstances of these (surge upgrades, in CAPZ's order). Only without nodes.
    Delete(Vec<String>),
    /// UpgradePoolInstances of these (maxSurge 0). Only without nodes.
    Upgrade(Vec<String>),
    /// Delete the Machines of these instances (nodes managed: scale-down and upgrades by
    /// deletion; always: remediation). Each Machine's deletion drains its Node (with nodes),
    /// then deletes exactly its instance.
    DeleteMachines(Vec<String>),
    /// Nothing to call; write status.
    Wait,
}

/// Why the pool planner chose its step, or held back: in the order it decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    /// The template changed since it was last applied: applied with room for the surge.
    TemplateChanged {
        /// The capacity applied (`replicas + maxSurge` while old instances remain).
        capacity: i64,
    },
    /// The capacity to apply differs from the one applied (a scale, or the surge given back).
    CapacityChanged {
        /// `status.appliedCapacity`.
        from: i64,
        /// The capacity now.
        to: i64,
    },
    /// Fewer live instances than the capacity: the pool is refilled.
    Missing {
        /// Live instances.
        live: i64,
        /// The capacity.
        capacity: i64,
    },
    /// Instances are missing, but Machines are being deleted: no refill until they are gone.
    RefillHeld {
        /// Machines being deleted.
        deleting: usize,
    },
    /// ApplyPool waits, as a capacity below the instances the cloud still holds would let it
    /// pick one.
    ApplyHeld {
        /// The capacity to apply.
        capacity: i64,
        /// Instances the cloud holds (draining ones included).
        held: i64,
    },
    /// More live instances than the capacity; the excess goes (as Machines with nodes managed,
    /// by a lower capacity without).
    AboveCapacity {
        /// Live instances.
        live: i64,
        /// The capacity.
        capacity: i64,
    },
    /// The cloud takes these instances (`status.interruption` on their Machines): their Machines
    /// are deleted at once, never held, and the capacity grows by one for each while the cloud
    /// still holds it (the hard cap of the deployments' interruption step).
    Interrupted {
        /// Their IDs.
        instances: Vec<String>,
    },
    /// Instances are taken for remediation now.
    Remediating {
        /// Their IDs.
        instances: Vec<String>,
    },
    /// Instances taken for remediation wait for their replacements (replace before remove).
    AwaitingReplacement {
        /// How many.
        instances: usize,
    },
    /// Old-model instances are upgraded (by deletion, or in place with maxSurge 0 and no
    /// nodes): these many go now.
    Upgrading {
        /// Old-model instances.
        old: usize,
        /// Those taken now.
        taken: usize,
    },
    /// The disruption planner held disruptions back.
    Held {
        /// The disruption.
        reason: DisruptionReason,
        /// Instances it would have taken.
        instances: i64,
        /// What held them.
        hold: disruption::Hold,
    },
    /// A canary holds the upgrade: at most `wanted` instances of the new model until it passes.
    Canary {
        /// The model (template hash).
        revision: String,
        /// Where it stands.
        phase: CanaryPhase,
        /// Canary instances ready.
        ready: usize,
        /// Canary instances wanted.
        wanted: i64,
    },
    /// The canary of `revision` held through its pause: the upgrade goes on.
    CanaryPassed {
        /// The model.
        revision: String,
    },
    /// The canary of `revision` failed: no old instance is taken until the template changes.
    CanaryFailed {
        /// The model.
        revision: String,
        /// Which instance, and why.
        message: String,
    },
    /// `replicas` instances, all ready, on the latest model.
    Done,
}

impl Note {
    /// Whether it says what keeps the pool from moving on.
    pub fn holds_back(&self) -> bool {
        matches!(
            self,
            Note::RefillHeld { .. }
                | Note::ApplyHeld { .. }
                | Note::Held { .. }
                | Note::AwaitingReplacement { .. }
                | Note::Canary { .. }
                | Note::CanaryFailed { .. }
        )
    }
}

impl std::fmt::Display for Note {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Note::TemplateChanged { capacity } => write!(f, "new template applied with capacity {capacity}"),
            Note::CapacityChanged { from, to } => write!(f, "capacity {from} → {to}"),
            Note::Missing { live, capacity } => write!(f, "{live} of {capacity} instances: refilling"),
            Note::RefillHeld { deleting } => write!(f, "no refill while {deleting} Machine(s) are being deleted"),
            Note::ApplyHeld { capacity, held } => {
                write!(f, "capacity {capacity} waits: the cloud still holds {held} instances")
            }
            Note::AboveCapacity { live, capacity } => write!(f, "{live} instances for capacity {capacity}"),
            Note::Interrupted { instances } => {
                write!(
                    f,
                    "the cloud takes instance(s) {}: deleted at once, replaced beside the surge",
                    instances.join(", ")
                )
            }
            Note::Remediating { instances } => write!(f, "remediating instance(s) {}", instances.join(", ")),
            Note::AwaitingReplacement { instances } => {
                write!(f, "{instances} instance(s) being remediated wait for their replacements")
            }
            Note::Upgrading { old, taken } => write!(f, "{old} old instance(s); {taken} taken now"),
            Note::Held { reason, instances, hold } => write!(f, "{instances} {reason} held: {hold}"),
            Note::Canary { revision, phase, ready, wanted } => {
                write!(f, "canary of model {revision} {}: {ready} of {wanted} instance(s) ready", phase.as_str())
            }
            Note::CanaryPassed { revision } => write!(f, "the canary of model {revision} passed"),
            Note::CanaryFailed { message, .. } => f.write_str(message),
            Note::Done => write!(f, "every instance ready on the latest model"),
        }
    }
}

/// The pool's Ready condition as a plan sets it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ready {
    /// Its status.
    pub holds: bool,
    /// Its reason.
    pub reason: Reason,
    /// Its message.
    pub message: String,
}

/// The plan for one pool reconcile.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The call to make.
    pub step: Step,
    /// Instances whose Machines are taken for remediation now (they count as in flight from
    /// then on). A plan that marks makes no call ([`Step::Wait`]): the marks are written, and the
    /// next plan acts on what is stored.
    pub mark: Vec<(String, Remediation)>,
    /// Instances not being deleted.
    pub replicas: i64,
    /// Of those, ready.
    pub ready_replicas: i64,
    /// Of those, on the latest model of the current template.
    pub updated_replicas: i64,
    /// `replicas` instances, all ready, all on the latest model.
    pub done: bool,
    /// The Ready condition to set with [`Step::DeleteMachines`] and [`Step::Wait`] (after a
    /// call, its outcome sets it).
    pub ready: Option<Ready>,
    /// What the disruption planner decided.
    pub disruption: Report,
    /// `status.disruption` to write: the report, the remediation pace and what waits for it.
    pub disruption_status: DisruptionStatus,
    /// Instances that want remediation and are not taken (held).
    pub waiting: Vec<String>,
    /// `status.canary` to write.
    pub canary: Option<CanaryStatus>,
    /// Events to record (a canary passed or failed).
    pub events: Vec<PlannedEvent>,
    /// Why, in the order decided.
    pub notes: Vec<Note>,
}

/// An instance of the pool as the steps weigh it.
type U<'a> = Unit<'a, Instance>;

/// How a pool's canary events speak.
const WORDS: canary::Words = canary::Words {
    revision: "model",
    unit: "instance",
    then: "upgrading the rest",
    stops: "the upgrade stops until the template changes",
};

/// The instances sorted by what the steps decide on, and the numbers they share.
struct Classes<'u, 'a> {
    template_changed: bool,
    /// Not being deleted.
    live: Vec<&'u U<'a>>,
    /// Live, not on the latest model of the current template, not being remediated.
    old: Vec<&'u U<'a>>,
    /// Live and being remediated (marked before, or allowed now), in remediation order.
    targets: Vec<&'u U<'a>>,
    /// maxSurge, at most one per old instance or remediated one that waits for its replacement.
    surge: i64,
    /// The capacity wanted: `replicas`, plus the surge while old or remediated instances
    /// remain.
    capacity: i64,
    /// Live and ready.
    ready: i64,
    /// Live and on the latest model of the current template.
    updated: i64,
}

impl Classes<'_, '_> {
    fn is_target(&self, u: &U<'_>) -> bool {
        holds(&self.targets, u.key)
    }
}

/// An instance ID as a number, so that "9" comes before "10" (IDs that are not numbers last).
fn number(i: &Instance) -> i64 {
    i.id.parse::<i64>().unwrap_or(i64::MAX)
}

/// Plans one reconcile of a pool: the instances as units, remediation, the canary, the one step
/// (with or without nodes), then the Ready condition and `status.disruption`.
pub fn plan_pool(o: Observed<'_>) -> Plan {
    let mut notes = Vec::new();
    let template_changed = o.applied_revision != o.revision;
    let units: Vec<U<'_>> = o.instances.iter().map(|i| o.unit(i, template_changed)).collect();
    let limits = Limits::resolve(o.replicas, o.strategy);
    let mut planner = Planner::new(owner::census(o.replicas, &units), limits_of(&o, &limits));
    // What the cloud takes goes first, never held; its replacement comes beside the surge while
    // the cloud still holds the instance (once its deletion is sent, the cloud's capacity is one
    // lower already).
    let interrupted: Vec<String> =
        interruption::choose(&units, &mut planner).iter().map(|u| u.key.to_string()).collect();
    let held_interrupted = units.iter().filter(|u| u.interrupted() && u.item.state != InstanceState::Deleting);
    let extra = (held_interrupted.count() as i64).min(o.replicas.max(1));
    let halted = o.remediation_halted.is_some();
    let chosen = remediation::choose(&units, halted, |_| false, &mut planner);
    let mark = chosen.marks();
    if !mark.is_empty() {
        notes.push(Note::Remediating { instances: mark.iter().map(|(id, _)| id.clone()).collect() });
    }
    let mut c = classify(&o, &units, chosen.targets(), limits);
    let mut events = Vec::new();
    let (canary_status, hold) = canary(&o, &c, &mut notes, &mut events);
    if let Some(h) = hold {
        // The surge makes no more new-model instances than the canary wants.
        c.surge = c.surge.min(h.wanted);
        c.capacity = o.replicas + c.surge;
    }
    let coming = remediation::coming(&units, &c.targets, |u| u.new) as i64;
    let to_create = (c.capacity - c.live.len() as i64).max(0);
    let (go, waiting) = remediation::go_now(&c.targets, (coming + to_create) as usize);
    if waiting > 0 {
        notes.push(Note::AwaitingReplacement { instances: waiting });
    }
    // Only the remediated instances that wait for a replacement keep room for one.
    c.surge = limits.max_surge.min((c.old.len() + waiting) as i64);
    if let Some(h) = hold {
        c.surge = c.surge.min(h.wanted);
    }
    c.capacity = o.replicas + c.surge + extra;
    let room = hold.map(|h| canary_room(&c, h));
    let mut step = if o.nodes_managed {
        step_with_nodes(&o, &c, &go, room, &mut planner, &mut notes)
    } else {
        step_without_nodes(&o, &c, &go, room, &mut planner, &mut notes)
    };
    if !interrupted.is_empty() && mark.is_empty() {
        notes.push(Note::Interrupted { instances: interrupted.clone() });
        let mut ids = interrupted;
        if let Step::DeleteMachines(more) = &step {
            ids.extend(more.iter().filter(|id| !ids.contains(id)).cloned().collect::<Vec<_>>());
        }
        step = Step::DeleteMachines(ids);
    }
    if !mark.is_empty() {
        // A plan that marks makes no call: the marks are written first, and the next plan acts on
        // what is stored (a mark that did not land leaves nothing behind).
        step = Step::Wait;
    }
    let done = c.old.is_empty() && c.targets.is_empty() && c.live.len() as i64 == o.replicas && c.ready == o.replicas;
    let report = planner.report();
    notes.extend(report.held.iter().map(|h| Note::Held {
        reason: h.reason,
        instances: h.machines,
        hold: h.hold.clone(),
    }));
    if done {
        notes.push(Note::Done);
    }
    let waiting: Vec<String> = c
        .live
        .iter()
        .filter(|u| remediation::wants(u, halted).is_some() && !c.is_target(u))
        .map(|u| u.key.to_string())
        .collect();
    let (consecutive, not_before) = remediation::pace(o.remediation, &units, mark.len(), halted, o.now, o.pace);
    let mut disruption_status =
        report.status(RemediationStatus { waiting: waiting.clone(), consecutive, not_before, ..Default::default() });
    disruption_status.remediation.in_flight += mark.len() as i64;
    let mut ready = ready_condition(&o, &c, &step, done, &notes);
    // A failed canary holds old instances back: the pool is not ready on the latest model.
    let stopped = canary_status.as_ref().filter(|_| hold.is_some_and(|h| h.stopped));
    if let (Some(r), Some(k)) = (ready.as_mut().filter(|r| !r.holds), stopped) {
        r.reason = Reason::CanaryFailed;
        if !r.message.contains(&k.message) {
            r.message = format!("{}; {}", r.message, k.message);
        }
    }
    Plan {
        ready,
        step,
        mark,
        replicas: c.live.len() as i64,
        ready_replicas: c.ready,
        updated_replicas: c.updated,
        done,
        disruption: report,
        disruption_status,
        waiting,
        canary: canary_status,
        events,
        notes,
    }
}

/// A canary under way: how many new-model instances it wants, and whether it failed (then no old
/// instance is taken).
#[derive(Debug, Clone, Copy)]
struct CanaryHold {
    wanted: i64,
    stopped: bool,
}

/// The canary step ([`canary::step`]): `status.canary` to write, and the hold on the upgrade
/// (`None`: no canary, or it passed). A canary starts when a template (a model) with
/// `strategy.canary` upgrades instances of an earlier one (not the pool's first apply); it is
/// kept across reconciles (and restarts) by its revision, the template's hash. A new-model
/// instance that fails (its Machine Failed) while it is under way fails it.
fn canary(
    o: &Observed<'_>,
    c: &Classes<'_, '_>,
    notes: &mut Vec<Note>,
    events: &mut Vec<PlannedEvent>,
) -> (Option<CanaryStatus>, Option<CanaryHold>) {
    let mut new: Vec<&U<'_>> = c.live.iter().copied().filter(|u| u.new).collect();
    new.sort_by_key(|u| (u.age, u.key));
    let failed =
        new.iter().find(|u| u.item.state == InstanceState::Failed || u.item.remediation == Some(Remediation::Failed));
    let failed = failed.map(|u| {
        let why = u.item.failure.clone().unwrap_or_else(|| format!("the cloud reports it {:?}", u.item.state));
        (u.key.to_string(), why)
    });
    let input = canary::Input {
        spec: o.strategy.canary.as_ref(),
        revision: o.revision,
        replicas: o.replicas,
        starts: !o.applied_revision.is_empty() && !c.old.is_empty(),
        recorded: o.canary.cloned(),
        failed,
        now: o.now,
        words: WORDS,
    };
    let decision = canary::step(input, &new, |u| machine_name(o.pool, u.key));
    events.extend(decision.events);
    let Some(k) = decision.status.as_ref() else { return (None, None) };
    if decision.passed {
        notes.push(Note::CanaryPassed { revision: k.revision.clone() });
    }
    let hold = match decision.outcome {
        canary::Outcome::Free => None,
        canary::Outcome::Holds { wanted } => {
            notes.push(Note::Canary { revision: k.revision.clone(), phase: k.phase, ready: decision.ready, wanted });
            Some(CanaryHold { wanted, stopped: false })
        }
        canary::Outcome::Failed { wanted } => {
            notes.push(Note::CanaryFailed { revision: k.revision.clone(), message: k.message.clone() });
            Some(CanaryHold { wanted, stopped: true })
        }
    };
    (decision.status, hold)
}

/// How many old instances a canary lets go now: none once it failed; else as many as keep the
/// new-model instances (live, being reimaged, and those the cloud is still to create) within
/// what it wants.
fn canary_room(c: &Classes<'_, '_>, h: CanaryHold) -> usize {
    if h.stopped {
        return 0;
    }
    let new = c.live.iter().filter(|u| u.new).count() as i64;
    let reimaging = c.old.iter().filter(|u| u.item.state == InstanceState::Updating).count() as i64;
    let coming = (c.capacity - c.live.len() as i64).max(0);
    (h.wanted - new - reimaging - coming).max(0) as usize
}

fn limits_of<'a>(o: &Observed<'a>, limits: &Limits) -> disruption::Limits<'a> {
    disruption::Limits {
        max_unavailable: limits.max_unavailable,
        budgets: o.budgets,
        max_in_flight: o.max_in_flight,
        remediation_not_before: o.remediation.not_before,
        remediation_halted: o.remediation_halted,
        now: o.now,
    }
}

/// The disruption planner's limits for `pool` at `now`, remediation halted by `halted`: what its
/// plan asks with ([`Observed`] carries the same), and what the cluster-autoscaler's removals are
/// asked with.
pub fn disruption_limits<'a>(pool: &'a MachinePool, halted: Option<&'a str>, now: Time) -> disruption::Limits<'a> {
    disruption::Limits {
        max_unavailable: Limits::resolve(pool.spec.replicas, &pool.spec.strategy).max_unavailable,
        budgets: &pool.spec.disruption.budgets,
        max_in_flight: max_in_flight(pool),
        remediation_not_before: pool.status.disruption.remediation.not_before,
        remediation_halted: halted,
        now,
    }
}

/// `remediation.maxInFlight` of `pool`, resolved.
pub fn max_in_flight(pool: &MachinePool) -> i64 {
    disruption::max_in_flight(pool.spec.remediation.max_in_flight.as_ref(), pool.spec.replicas)
}

/// Sorts the live units into old and resolves the capacity: room for the surge while old or
/// remediated instances remain.
fn classify<'u, 'a>(o: &Observed<'_>, units: &'u [U<'a>], targets: Vec<&'u U<'a>>, limits: Limits) -> Classes<'u, 'a> {
    let template_changed = o.applied_revision != o.revision;
    let live: Vec<&U<'a>> = units.iter().filter(|u| u.live()).collect();
    let old: Vec<&U<'a>> = live.iter().copied().filter(|u| !u.new && !holds(&targets, u.key)).collect();
    let surge = limits.max_surge.min((old.len() + targets.len()) as i64);
    let capacity = o.replicas + surge;
    let ready = live.iter().filter(|u| u.available).count() as i64;
    let updated = live.iter().filter(|u| u.new).count() as i64;
    Classes { template_changed, live, old, targets, surge, capacity, ready, updated }
}

/// Whether ApplyPool is due: a new template, another capacity, or instances missing (unless
/// Machines are being deleted: then the cloud refills once they are gone).
fn wants_apply(o: &Observed<'_>, c: &Classes<'_, '_>, capacity: i64, notes: &mut Vec<Note>) -> bool {
    let live = c.live.len() as i64;
    if c.template_changed {
        notes.push(Note::TemplateChanged { capacity });
    } else if o.applied_capacity != capacity {
        notes.push(Note::CapacityChanged { from: o.applied_capacity, to: capacity });
    } else if live < capacity && o.deleting.is_empty() {
        notes.push(Note::Missing { live, capacity });
    } else {
        if live < capacity {
            notes.push(Note::RefillHeld { deleting: o.deleting.len() });
        }
        return false;
    }
    true
}

/// ApplyPool with `capacity`, unless it is below the instances the cloud still holds (live ones
/// and those whose Machines are being deleted) when that would let the cloud pick which go: with
/// nodes managed always (only drained instances may go), without while Machines are being
/// deleted (the cloud could take another instance than theirs).
fn apply(o: &Observed<'_>, capacity: i64, notes: &mut Vec<Note>) -> Step {
    let held =
        o.instances.iter().filter(|i| i.state != InstanceState::Deleting || o.deleting.contains(&i.id)).count() as i64;
    let guarded = o.nodes_managed || !o.deleting.is_empty();
    if capacity >= held || !guarded {
        return Step::Apply { capacity };
    }
    notes.push(Note::ApplyHeld { capacity, held });
    Step::Wait
}

/// Without nodes: apply (a lower capacity only as far as the disruption planner allows a
/// `ScaleDown`), remediate, or upgrade old instances, by deletion with a surge (CAPZ) or in place
/// without.
fn step_without_nodes(
    o: &Observed<'_>,
    c: &Classes<'_, '_>,
    go: &[String],
    room: Option<usize>,
    planner: &mut Planner,
    notes: &mut Vec<Note>,
) -> Step {
    let live = c.live.len() as i64;
    let mut capacity = c.capacity;
    let above = o.applied_capacity.min(live) - capacity;
    if above > 0 {
        // A lower capacity lets the cloud pick which instances go (a pool-only step): each is
        // asked of the planner as a scale-down of an instance that is up, and the capacity comes
        // down only as far as it allows.
        notes.push(Note::AboveCapacity { live, capacity });
        let any = Candidate { available: true, disrupted: false };
        let allowed = (0..above).filter(|_| planner.ask(DisruptionReason::ScaleDown, any).allowed()).count() as i64;
        capacity += above - allowed;
    }
    if wants_apply(o, c, capacity, notes) {
        return apply(o, capacity, notes);
    }
    if !go.is_empty() {
        return Step::DeleteMachines(go.to_vec());
    }
    if c.old.is_empty() {
        return Step::Wait;
    }
    if c.surge > 0 {
        // CAPZ: delete old-model instances.
        return upgrade_by_deletion(c, room, planner, notes).map_or(Step::Wait, Step::Delete);
    }
    // maxSurge 0: reimage old instances in place, through the in-place step.
    let candidates: Vec<&U<'_>> = c.old.iter().copied().filter(|u| u.available).collect();
    let allowed = in_place::allowed(&candidates, room, planner);
    if allowed == 0 {
        return Step::Wait;
    }
    notes.push(Note::Upgrading { old: c.old.len(), taken: allowed });
    Step::Upgrade(candidates[..allowed].iter().map(|u| u.key.to_string()).collect())
}

/// Nodes managed: the pool chooses what goes, and it goes as Machines (drained first); ApplyPool
/// never lets the cloud pick an instance.
fn step_with_nodes(
    o: &Observed<'_>,
    c: &Classes<'_, '_>,
    go: &[String],
    room: Option<usize>,
    planner: &mut Planner,
    notes: &mut Vec<Note>,
) -> Step {
    let (live, capacity) = (c.live.len() as i64, c.capacity);
    // Remediated instances go with whatever else goes as Machines.
    let mut ids = go.to_vec();
    if live > capacity {
        notes.push(Note::AboveCapacity { live, capacity });
        let excess = (live - capacity - go.len() as i64).max(0) as usize;
        // The scale-down step, newest first (the highest instance ID).
        let mut order: Vec<&U<'_>> = c.live.iter().copied().filter(|u| !c.is_target(u)).collect();
        owner::deletion_order(&mut order, DeletePolicy::Newest);
        ids.extend(scale_down::scale_down(order, excess, planner).iter().map(|u| u.key.to_string()));
        if !ids.is_empty() {
            return Step::DeleteMachines(ids);
        }
    }
    if wants_apply(o, c, capacity, notes) {
        return apply(o, capacity, notes);
    }
    if !c.old.is_empty() {
        // Upgrades by deletion, with or without surge.
        ids.extend(upgrade_by_deletion(c, room, planner, notes).unwrap_or_default());
    }
    if ids.is_empty() {
        Step::Wait
    } else {
        Step::DeleteMachines(ids)
    }
}

/// CAPZ's upgrade by deletion, through the rollout step: old instances in the deletion order,
/// oldest (the lowest ID) first, each a `Rollout` (unready ones cost no availability, ready ones
/// go only within `maxUnavailable`); at most `room` of them while a canary holds.
fn upgrade_by_deletion(
    c: &Classes<'_, '_>,
    room: Option<usize>,
    planner: &mut Planner,
    notes: &mut Vec<Note>,
) -> Option<Vec<String>> {
    let mut order: Vec<&U<'_>> = c.old.clone();
    owner::deletion_order(&mut order, DeletePolicy::Oldest);
    let victims: Vec<String> = rollout::replace_old(order, room, planner).iter().map(|u| u.key.to_string()).collect();
    if victims.is_empty() {
        return None;
    }
    notes.push(Note::Upgrading { old: c.old.len(), taken: victims.len() });
    Some(victims)
}

/// The Ready condition after [`Step::DeleteMachines`] (rolling, naming the Nodes drained) or
/// [`Step::Wait`] (ready once done; what holds the pool back follows the message).
fn ready_condition(o: &Observed<'_>, c: &Classes<'_, '_>, step: &Step, done: bool, notes: &[Note]) -> Option<Ready> {
    let (ready, replicas) = (c.ready, o.replicas);
    match step {
        Step::DeleteMachines(ids) => Some(Ready {
            holds: false,
            reason: Reason::Rolling,
            message: if o.nodes_managed {
                format!("{ready} of {replicas} ready; draining the Nodes of {}", ids.join(", "))
            } else {
                format!("{ready} of {replicas} ready; deleting the Machines of {}", ids.join(", "))
            },
        }),
        Step::Wait => {
            let message = format!("{ready} of {replicas} ready, {} on the latest model", c.updated);
            Some(Ready {
                holds: done,
                reason: if done { Reason::Ready } else { Reason::Rolling },
                message: notes.iter().filter(|n| n.holds_back()).fold(message, |m, n| format!("{m}; {n}")),
            })
        }
        Step::Apply { .. } | Step::Delete(_) | Step::Upgrade(_) => None,
    }
}

#[cfg(test)]
mod tests;
