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
//! - Remediation ([`super::steps::remediation`]): failed machines, machines a MachineHealthCheck
//!   marked (`OwnerRemediated=False`) and machines annotated `machine.driver.dev/remediate` are
//!   remediated, replace before remove where the surge allows: a remediated machine is marked by
//!   a plan that does nothing else (so it counts as in flight across restarts, and a mark that
//!   does not land leaves nothing behind), then its replacement created, and it goes once no
//!   replacement is still on its way.
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
//! - InPlace: old machines are converted (see [`super::steps::in_place`]); only missing machines
//!   are created and only a scale-down removes machines.
//!
//! The machines are units of the owner view ([`super::owner`], projected by
//! [`Member::unit`]) and every disruption step is the one pools run too ([`super::steps`]).
//! [`plan_deployment`] runs them in its order (choose the target, classify, track the rollout, the
//! canary, the failure budget, failure domains, remediation, scale up, the remediated machines
//! that go, the rollout of old machines, in place, remove the excess, rebalance, status); each
//! records in [`Plan::notes`] why it acted or held back ([`Note`]), as Cluster API's rollout
//! planner does, so tests can assert the reason as well as the action.

use std::time::Duration;

use super::disruption::{self, Hold, Planner, Report};
use super::domains::{self, Spread};
use super::member::{lift_environment_conditions, Member};
use super::owner::{self, disruption_conditions, holds, PlannedEvent, Remediation, Unit};
use super::steps::{canary, in_place, interruption, rebalance, remediation, rollout, scale_down};
use super::Limits;
use crate::events::EventReason;
use crate::policy;
use crate::resources::*;

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

/// Whether a failed machine's failure is its revision's doing (or its request's), and so counts
/// against the failure budget: [`policy::blame`]. Credentials, quota, an unavailable cloud and
/// transient errors never do.
pub fn attributable(m: &Member) -> bool {
    m.failure.as_ref().is_none_or(|f| policy::blame(&f.code, &f.reason).counts())
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
    /// (from then on they count as in flight), each with why. A plan that marks does nothing
    /// else (it creates, removes and updates nothing): the reconciler writes the marks, then the
    /// status only when every mark landed, and plans again.
    pub mark: Vec<(String, Remediation)>,
    /// Machines taken for remediation that go now (their replacements are not awaited: none is
    /// on its way, or the surge leaves no room for one first), in order.
    pub remediate: Vec<String>,
    /// Machines the cloud takes (`status.interruption`): deleted now, whatever else the plan
    /// does (their drains end before the deadline); their replacements are among `create`.
    pub interrupted: Vec<String>,
    /// The first created machines replace interrupted ones: each one's
    /// [`ANNOTATION_REPLACES_INTERRUPTION`] value, in order.
    pub replaces: Vec<String>,
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
    /// Machines the cloud takes go now, and are replaced beside the surge.
    Interrupted {
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
            Note::Interrupted { machines } => {
                write!(f, "the cloud takes {}: replaced beside the surge", machines.join(", "))
            }
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

/// A machine of the deployment as the steps weigh it.
pub type U<'a> = Unit<'a, Member>;

/// How a deployment's canary events speak.
const WORDS: canary::Words = canary::Words {
    revision: "revision",
    unit: "machine",
    then: "rolling out the rest",
    stops: "the rollout is aborted",
};

/// The deployment's machines sorted by what the steps decide on, and the numbers they share.
struct Classes<'u, 'a> {
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
    all: &'u [U<'a>],
    /// Not being deleted.
    live: Vec<&'u U<'a>>,
    /// Live, of the target revision.
    new: Vec<&'u U<'a>>,
    /// Live, of another revision.
    old: Vec<&'u U<'a>>,
    /// Live and Failed.
    failed: Vec<&'u U<'a>>,
    /// Live and available.
    available: i64,
    /// Of the target revision and available.
    new_available: i64,
}

impl Classes<'_, '_> {
    /// Whether a machine is available now (Running, its Node Ready, for `minReadySeconds`).
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
pub fn plan_deployment(o: Observed<'_>) -> Plan {
    let md = o.deployment;
    let mut d = Draft { status: md.status.clone(), events: Vec::new(), notes: Vec::new() };
    let spec_rev = revision(&md.spec.template);
    let (target_rev, target) = choose_target(md, &spec_rev, &mut d.notes);
    let units = units(md, o.machines, &target_rev, o.now);
    let c = classify(&o, &units, spec_rev, target_rev, target);
    track_rollout(md, &c, &mut d);
    let canary = canary(md, &c, &mut d);
    if let Some(failures) = budget_spent(md, &c, &d, canary.is_some()) {
        return abort(md, c, d, failures);
    }
    let zones = failure_domains(md, &c, &mut d);
    let limits = disruption_limits(md, o.remediation_halted, o.now);
    let mut planner = Planner::new(owner::census(c.desired, c.all), limits);
    let interrupted = interruption::choose(c.all, &mut planner);
    interrupting(&c, &interrupted, &mut d);
    let halted = o.remediation_halted.is_some();
    let chosen = remediation::choose(c.all, halted, |u| holds(&zones.withdraw, u.key), &mut planner);
    remediating(&o, &c, &chosen, &mut d);
    let moves = moves(md, &c, &chosen.targets(), &interrupted, &zones, canary, &mut planner, &mut d);
    conclude(md, &o, c, chosen.marks(), zones, moves, canary, planner.report(), d)
}

/// What a plan does with its machines: creates (and where), the remediated machines that go,
/// deletions, in-place updates; and the spread they leave.
struct Moves<'d> {
    create: usize,
    placements: Vec<String>,
    replaces: Vec<String>,
    interrupted: Vec<String>,
    remediate: Vec<String>,
    delete: Vec<String>,
    in_place: Option<InPlaceWork>,
    spread: Spread<'d>,
}

/// The steps that move machines, in order: scale up (replacements of the machines leaving
/// included), placement in the failure domains, the remediated machines that go (replace before
/// remove), the rollout of old machines, in place, the excess over `replicas` (a rebalance's
/// too), the machines withdrawn from a domain that refused them.
#[allow(clippy::too_many_arguments)]
fn moves<'d>(
    md: &'d MachineDeployment,
    c: &Classes<'_, '_>,
    targets: &[&U<'_>],
    interrupted: &[&U<'_>],
    zones: &Zones<'_, '_>,
    canary: Option<i64>,
    planner: &mut Planner,
    d: &mut Draft,
) -> Moves<'d> {
    // Machines on their way out: taken for remediation, taken by the cloud, or withdrawn from a
    // domain that refused them. They do not count as the deployment's machines, so replacements
    // are made.
    let leaving: Vec<&U<'_>> = targets.iter().chain(interrupted).chain(&zones.withdraw).copied().collect();
    let staying = c.live.iter().filter(|u| !holds(&leaving, u.key)).map(|u| u.item);
    let mut spread = Spread::new(&md.spec.failure_domains, staying, &c.target_rev, zones.open.clone());
    // A canary not passed yet: no more machines of the revision than it wants.
    let canary_room = canary.map(|wanted| {
        let have = c.new.iter().filter(|u| !holds(targets, u.key)).count() as i64;
        (wanted - have).max(0) as usize
    });
    let mut create = 0;
    if md.spec.paused {
        d.notes.push(Note::Paused);
    } else {
        create = scale_up(c, &leaving, canary_room, d);
    }
    let placements = place(&mut spread, &mut create, d);
    // The first machines created replace the interrupted ones (their margin is measured).
    let replaces = interrupted.iter().take(create).map(|u| replaces_value(u)).collect();
    // Replacements of interrupted machines are not the remediated machines'.
    let coming =
        (remediation::coming(c.all, targets, |u| c.in_place || u.new) + create).saturating_sub(interrupted.len());
    let (remediate, waiting_for_replacement) = remediation::go_now(targets, coming);
    if waiting_for_replacement > 0 {
        d.notes.push(Note::AwaitingReplacement { machines: waiting_for_replacement });
    }
    let (mut delete, mut in_place) = (Vec::new(), None);
    if !md.spec.paused {
        let removals = canary_removals(c, &leaving, canary);
        delete = remove_old(md, c, &leaving, &spread, removals, planner);
        let room = canary_room.map(|r| r.saturating_sub(create));
        in_place = in_place_work(c, &leaving, &delete, room, planner, d);
    }
    delete.extend(remove_excess(md, c, &leaving, &spread, planner, d));
    delete.extend(zones.withdraw.iter().map(|u| u.key.to_string()));
    let interrupted = interrupted.iter().map(|u| u.key.to_string()).collect();
    Moves { create, placements, replaces, interrupted, remediate, delete, in_place, spread }
}

/// The [`ANNOTATION_REPLACES_INTERRUPTION`] value of a replacement of `u`: its name, the
/// interruption's kind and deadline (`-` when none was given).
fn replaces_value(u: &U<'_>) -> String {
    let (kind, not_before) = u.item.interrupted.unwrap_or((InterruptionKind::Terminated, None));
    let deadline = not_before.map_or("-".to_string(), |t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true));
    format!("{}/{}/{deadline}", u.key, kind.as_str())
}

/// The deployment's share of the interruption step ([`interruption::choose`] chose): a note
/// and an event for the machines the cloud takes.
fn interrupting(c: &Classes<'_, '_>, interrupted: &[&U<'_>], d: &mut Draft) {
    if interrupted.is_empty() {
        return;
    }
    let machines: Vec<String> = interrupted.iter().map(|u| u.key.to_string()).collect();
    let extra = interruption::extra_surge(c.all, c.desired);
    let message = format!(
        "the cloud takes {}: deleted now (drained until a margin before the deadline), replaced beside the \
         surge (up to {extra} above replicas + maxSurge)",
        machines.join(", ")
    );
    d.events.push(PlannedEvent { reason: EventReason::ReplacingInterrupted, message });
    d.notes.push(Note::Interrupted { machines });
}

/// The end of a plan: what holds it back, what waits for remediation, a rebalance when nothing
/// else moves, the status; and nothing done but the marks when the plan marks.
#[allow(clippy::too_many_arguments)]
fn conclude(
    md: &MachineDeployment,
    o: &Observed<'_>,
    c: Classes<'_, '_>,
    mark: Vec<(String, Remediation)>,
    zones: Zones<'_, '_>,
    mut m: Moves<'_>,
    canary: Option<i64>,
    report: Report,
    mut d: Draft,
) -> Plan {
    d.notes.extend(report.held.iter().map(|h| Note::Held {
        reason: h.reason,
        machines: h.machines,
        hold: h.hold.clone(),
    }));
    let halted = o.remediation_halted.is_some();
    let waiting: Vec<String> = c
        .live
        .iter()
        .filter(|u| remediation::wants(u, halted).is_some())
        .filter(|u| !mark.iter().any(|(n, _)| n == u.key) && !holds(&zones.withdraw, u.key))
        .map(|u| u.key.to_string())
        .collect();
    let remediation_left = !waiting.is_empty() || c.live.iter().any(|u| u.remediating());
    let quiet = m.create == 0
        && m.delete.is_empty()
        && mark.is_empty()
        && !remediation_left
        && m.in_place.as_ref().is_none_or(|w| w.allowed == 0);
    let quiet = quiet && m.interrupted.is_empty();
    let rebalance = if quiet { rebalance(md, &c, &m.spread, &mut d) } else { None };
    if let Some((_, to)) = &rebalance {
        (m.create, m.placements) = (1, vec![to.clone()]);
    }
    let complete = write_status(md, &c, &report, &mark, waiting, &mut d);
    domain_status(&c, &m.spread, &mut d.status);
    let recheck_at = [report.recheck_at, pause_until(&d.status, canary), zones.reopens].into_iter().flatten().min();
    if !mark.is_empty() {
        // A plan that marks does nothing else: the marks are written first, and the next plan acts
        // on what is stored. A mark that did not land (a conflicting write) then leaves no
        // replacement behind and no machine removed in its place.
        (m.create, m.remediate, m.delete, m.in_place) = (0, Vec::new(), Vec::new(), None);
        m.placements.clear();
        m.replaces.clear();
    }
    Plan {
        settled: complete
            && c.failed.is_empty()
            && !remediation_left
            && rebalance.is_none()
            && mark.is_empty()
            && m.interrupted.is_empty(),
        target_revision: c.target_rev,
        target: c.target,
        aborted: false,
        mark,
        remediate: m.remediate,
        interrupted: m.interrupted,
        replaces: m.replaces,
        create: m.create,
        placements: m.placements,
        rebalance: rebalance.map(|(value, _)| value),
        in_place: m.in_place,
        delete: m.delete,
        status: d.status,
        events: d.events,
        recheck_at,
        disruption: Some(report),
        notes: d.notes,
    }
}

/// What the failure-domain step found: which domains take machines, the machines withdrawn from
/// a domain that refused them, and when the next closed domain opens again.
struct Zones<'u, 'a> {
    open: Vec<bool>,
    withdraw: Vec<&'u U<'a>>,
    reopens: Option<Time>,
}

/// Failure domains ([`super::domains`]): a backoff that ended opens its domain again; a refused
/// create closes its domain for a backoff and withdraws the machine (when another domain can take
/// its replacement); a domain whose machines are all unhealthy while others are fine is degraded
/// (closed, and the `FailureDomainDegraded` condition says so).
fn failure_domains<'u, 'a>(md: &MachineDeployment, c: &Classes<'u, 'a>, d: &mut Draft) -> Zones<'u, 'a> {
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
                .any(|u| u.item.domain.as_deref() == Some(s.name.as_str()) && u.available && u.item.created > since);
            if ran {
                (s.backoff_seconds, s.unavailable_until) = (0, None);
            }
        }
    }
    let mut withdraw = Vec::new();
    for u in &c.live {
        let m = u.item;
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
        withdraw.push(*u);
    }
    // A reclaimed offering (spot capacity taken back) is short of capacity: the interrupted
    // machine's replacement, and the next machines, go elsewhere for a backoff. Marked once per
    // interruption: one heard before the domain's last mark began, or longer ago than the first
    // backoff, is spent.
    let first = chrono::Duration::seconds(i64::try_from(backoff.initial_seconds).unwrap_or(i64::MAX / 2));
    for u in c.all {
        let m = u.item;
        let (Some(at), Some(i)) = (m.reclaimed, domains::index(domains, m.domain.as_deref())) else { continue };
        let s = &next[i];
        let last_mark =
            s.unavailable_until.map(|t| t - chrono::Duration::seconds(i64::try_from(s.backoff_seconds).unwrap_or(0)));
        if s.unavailable_at(now) || last_mark.is_some_and(|t| at <= t) || at + first <= now {
            continue;
        }
        // The last open domain stays open: the replacement must go somewhere (as refused machines
        // keep trying where they are when no other domain is open).
        if !next.iter().enumerate().any(|(j, o)| j != i && !o.unavailable_at(now)) {
            continue;
        }
        let s = &mut next[i];
        let message = format!("the cloud reclaimed {}", m.name);
        let seconds = domains::mark(s, backoff, now, domains::RECLAIMED, &message);
        let message =
            format!("{}: the cloud reclaimed the capacity of {}: no new machines there for {seconds}s", s.name, m.name);
        event(d, EventReason::FailureDomainUnavailable, message);
    }
    let members: Vec<&Member> = c.live.iter().map(|u| u.item).collect();
    let degraded = domains::degraded(domains, &members, |m| c.is_available(m));
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
        d.notes.push(Note::Withdrawn { machines: withdraw.iter().map(|u| u.key.to_string()).collect() });
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
fn broken(u: &U<'_>) -> bool {
    let m = u.item;
    m.marked_for_deletion
        || matches!(m.phase, Phase::Failed | Phase::Unknown)
        || (m.phase == Phase::Running && m.node_not_ready)
}

/// `units` in the order they go: the deletion policy's, then the spread's
/// ([`Spread::order`]).
fn removal_order<'u, 'a>(md: &MachineDeployment, spread: &Spread<'_>, mut units: Vec<&'u U<'a>>) -> Vec<&'u U<'a>> {
    owner::deletion_order(&mut units, md.spec.delete_policy);
    spread.order(units, |u| u.item.domain.as_deref(), broken)
}

/// A rebalance, when everything is settled and the spread is off by more than `maxSkew`
/// ([`rebalance::start`]): the created machine's annotation value and its domain.
fn rebalance(
    md: &MachineDeployment,
    c: &Classes<'_, '_>,
    spread: &Spread<'_>,
    d: &mut Draft,
) -> Option<(String, String)> {
    if !md.spec.rebalance.enabled || md.spec.paused || c.target.is_none() {
        return None;
    }
    let settled = c.old.is_empty()
        && d.status.rollout.is_none()
        && c.live.len() as i64 == c.desired
        && c.available == c.desired
        && !c.live.iter().any(|u| u.remediation.is_some() || u.item.refusal.is_some());
    let unlisted =
        c.live.iter().filter(|u| domains::index(&md.spec.failure_domains, u.item.domain.as_deref()).is_none()).count();
    let room = c.desired + c.limits.max_surge - c.all.len() as i64;
    let max_skew = md.spec.rebalance.max_skew;
    let (from, to) = match rebalance::start(spread, settled, unlisted as i64, max_skew, c.limits.max_surge, room) {
        Ok(moving) => moving,
        Err(rebalance::NotNow::NeedsSurge) => {
            d.notes.push(Note::RebalanceNeedsSurge);
            return None;
        }
        Err(_) => return None,
    };
    let from_name = from.map_or("machines in no listed domain".to_string(), |f| f.name.clone());
    d.notes.push(Note::Rebalancing { from: from_name.clone(), to: to.name.clone() });
    let message = format!("moving a machine from {from_name} to {}: its replacement is created there first", to.name);
    d.events.push(PlannedEvent { reason: EventReason::Rebalancing, message });
    Some((domains::rebalance_value(from, c.desired), to.name.clone()))
}

/// Each domain's share, machines and available machines, and the rebalance in progress.
fn domain_status(c: &Classes<'_, '_>, spread: &Spread<'_>, st: &mut MachineDeploymentStatus) {
    if !spread.active() {
        return;
    }
    let shares = spread.shares(c.desired);
    for (i, s) in st.failure_domains.iter_mut().enumerate() {
        let here: Vec<&&U<'_>> = c.live.iter().filter(|u| u.item.domain.as_deref() == Some(s.name.as_str())).collect();
        s.desired = shares.get(i).copied().unwrap_or(0);
        s.current = here.len() as i64;
        s.available = here.iter().filter(|u| u.available).count() as i64;
    }
    // The move under way: the newest machine created to rebalance, while there is an excess.
    let mover = c
        .live
        .iter()
        .filter(|u| domains::rebalance_from(u.item, c.desired).is_some())
        .max_by_key(|u| (u.age, u.key))
        .filter(|_| c.live.len() as i64 > c.desired);
    st.rebalance = mover.and_then(|u| {
        let m = u.item;
        let from = domains::rebalance_from(m, c.desired)?.to_string();
        Some(Box::new(RebalanceStatus { from, to: m.domain.clone().unwrap_or_default(), machine: m.name.clone() }))
    });
}

/// How far a rollout of `md` may leave `replicas`: the RollingUpdate arithmetic, or the InPlace
/// strategy's own `maxUnavailable`.
pub fn strategy_limits(md: &MachineDeployment) -> Limits {
    let (desired, strategy) = (md.spec.replicas, &md.spec.strategy);
    if strategy.strategy_type == StrategyType::InPlace {
        Limits::in_place(desired, &strategy.rolling_update, &strategy.in_place.max_unavailable)
    } else {
        Limits::resolve(desired, &strategy.rolling_update)
    }
}

/// The disruption planner's limits for `md` at `now`, remediation halted by `halted` (a health
/// check's short circuit, in words): what its plan asks with, and what the cluster-autoscaler's
/// removals are asked with.
pub fn disruption_limits<'a>(md: &'a MachineDeployment, halted: Option<&'a str>, now: Time) -> disruption::Limits<'a> {
    let max = md
        .spec
        .remediation
        .max_in_flight
        .clone()
        .or(md.spec.max_concurrent_replacements.map(|n| IntOrPercent::Int(n.into())));
    disruption::Limits {
        max_unavailable: strategy_limits(md).max_unavailable,
        budgets: &md.spec.disruption.budgets,
        max_in_flight: disruption::max_in_flight(max.as_ref(), md.spec.replicas),
        remediation_not_before: md.status.disruption.remediation.not_before,
        remediation_halted: halted,
        now,
    }
}

/// The machines of `md` as units (terminating ones included), at `now`.
pub fn units<'a>(md: &MachineDeployment, machines: &'a [Member], target_rev: &str, now: Time) -> Vec<U<'a>> {
    let min_ready = chrono::Duration::seconds(i64::try_from(md.spec.min_ready_seconds).unwrap_or(i64::MAX / 2));
    machines.iter().map(|m| m.unit(target_rev, now, min_ready)).collect()
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
fn classify<'u, 'a>(
    o: &Observed<'a>,
    all: &'u [U<'a>],
    spec_rev: String,
    target_rev: String,
    target: Option<MachineTemplate>,
) -> Classes<'u, 'a> {
    let md = o.deployment;
    let desired = md.spec.replicas;
    let in_place = md.spec.strategy.strategy_type == StrategyType::InPlace;
    let limits = strategy_limits(md);
    let min_ready = chrono::Duration::seconds(i64::try_from(md.spec.min_ready_seconds).unwrap_or(i64::MAX / 2));
    let live: Vec<&U<'a>> = all.iter().filter(|u| u.live()).collect();
    let (new, old): (Vec<&U<'a>>, Vec<&U<'a>>) = live.iter().partition(|u| u.new);
    let failed = live.iter().copied().filter(|u| u.item.phase == Phase::Failed).collect();
    let available = live.iter().filter(|u| u.available).count() as i64;
    let new_available = new.iter().filter(|u| u.available).count() as i64;
    Classes {
        spec_rev,
        target_rev,
        target,
        desired,
        in_place,
        limits,
        now: o.now,
        min_ready,
        all,
        live,
        new,
        old,
        failed,
        available,
        new_available,
    }
}

/// Rollout bookkeeping: a rollout starts when machines are to move to a new target revision;
/// it progresses when more new machines are available than last time.
fn track_rollout(md: &MachineDeployment, c: &Classes<'_, '_>, d: &mut Draft) {
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

/// The canary step ([`canary::step`]): whether the rollout is held by a canary, and how many
/// machines of the revision it wants (`None`: no canary, or it passed). A canary starts only
/// for a rollout of the spec's revision from an earlier one (a first rollout has nothing to
/// compare with, a rollback goes to a revision that ran before). A canary machine that fails
/// for its revision spends the failure budget (1 while a canary runs: [`budget_spent`]).
fn canary(md: &MachineDeployment, c: &Classes<'_, '_>, d: &mut Draft) -> Option<i64> {
    let st = &mut d.status;
    let rolling = st.rollout.as_ref().is_some_and(|r| r.revision == c.target_rev);
    let starts = rolling && c.target.is_some() && c.target_rev == c.spec_rev && !st.current_revision.is_empty();
    let input = canary::Input {
        spec: md.spec.strategy.rolling_update.canary.as_ref(),
        revision: &c.target_rev,
        replicas: c.desired,
        starts,
        recorded: st.canary.take(),
        failed: None,
        now: c.now,
        words: WORDS,
    };
    let decision = canary::step(input, &c.new, |u| u.key.to_string());
    st.canary = decision.status;
    d.events.extend(decision.events);
    let k = d.status.canary.as_ref()?;
    if decision.passed {
        d.notes.push(Note::CanaryPassed { revision: k.revision.clone() });
    }
    let canary::Outcome::Holds { wanted } = decision.outcome else { return None };
    let note = Note::Canary {
        revision: k.revision.clone(),
        phase: k.phase,
        ready: decision.ready,
        wanted,
        until: k.pause_until,
    };
    d.notes.push(note);
    Some(wanted)
}

/// While a canary holds a rolling update, old machines go only as far as the surge needs to
/// make room for the canary machines (none with a surge as large as the canary): the rest stay
/// untouched until it passes. `None`: no limit.
fn canary_removals(c: &Classes<'_, '_>, leaving: &[&U<'_>], canary: Option<i64>) -> Option<usize> {
    let wanted = canary?;
    if c.in_place {
        return None;
    }
    let old = c.old.iter().filter(|u| !holds(leaving, u.key)).count() as i64;
    Some((old + wanted - (c.desired + c.limits.max_surge)).max(0) as usize)
}

/// When a canary's pause ends (to plan again then).
fn pause_until(st: &MachineDeploymentStatus, canary: Option<i64>) -> Option<Time> {
    canary?;
    st.canary.as_ref().filter(|k| k.phase == CanaryPhase::Pausing)?.pause_until
}

/// Whether a failed machine counts against the target revision's failure budget: of that
/// revision, and its failure the revision's doing.
fn counts_against(c: &Classes<'_, '_>, m: &Member) -> bool {
    m.phase == Phase::Failed && m.revision == c.target_rev && attributable(m)
}

/// The failures of the spec's revision under way, if they reach the failure budget: those
/// counted when their machines were taken for remediation, and the failed machines not taken
/// yet (each failed machine counts once).
/// While a canary runs the budget is 1: one canary machine failing for its revision is enough.
fn budget_spent(md: &MachineDeployment, c: &Classes<'_, '_>, d: &Draft, canary: bool) -> Option<u32> {
    let rollout = d.status.rollout.as_ref()?;
    let failed_now = c.failed.iter().filter(|u| !u.remediating() && counts_against(c, u.item)).count() as u32;
    let used = rollout.failures + failed_now;
    let budget = if canary { 1 } else { md.spec.failure_budget.max(1) };
    let spent = c.target.is_some() && c.target_rev == c.spec_rev && used >= budget;
    spent.then_some(used)
}

/// Aborts the rollout: the revision is remembered as bad and the deployment rolls back (if there
/// is anything to roll back to). Nothing else is done this time.
fn abort(md: &MachineDeployment, c: Classes<'_, '_>, mut d: Draft, failures: u32) -> Plan {
    let (st, rev) = (&mut d.status, &c.target_rev);
    let mut reason = format!("{failures} machines of revision {rev} failed (budget {})", md.spec.failure_budget);
    if let Some(k) = st.canary.as_mut().filter(|k| k.revision == *rev && k.phase != CanaryPhase::Passed) {
        let culprit = c.failed.iter().find(|u| counts_against(&c, u.item));
        let why = culprit.map(|u| {
            let f = u.item.failure.as_deref();
            let cause = f.map(|f| format!("{}: {}", f.reason, f.message)).unwrap_or_else(|| "Failed".into());
            format!("canary machine {} of revision {rev} failed ({cause})", u.key)
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
        interrupted: Vec::new(),
        replaces: Vec::new(),
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

/// The deployment's share of remediation ([`remediation::choose`] chose): a failed machine of
/// the target revision marked now counts against the failure budget; the pace is recorded.
fn remediating(o: &Observed<'_>, c: &Classes<'_, '_>, chosen: &remediation::Chosen<'_, '_, Member>, d: &mut Draft) {
    for (u, _) in &chosen.mark {
        if counts_against(c, u.item) {
            if let Some(r) = d.status.rollout.as_mut() {
                r.failures += 1;
            }
        }
    }
    if !chosen.mark.is_empty() {
        d.notes.push(Note::Remediating { machines: chosen.mark.iter().map(|(u, _)| u.key.to_string()).collect() });
    }
    let halted = o.remediation_halted.is_some();
    let pace = &mut d.status.disruption.remediation;
    (pace.consecutive, pace.not_before) = remediation::pace(pace, c.all, chosen.mark.len(), halted, o.now, o.pace);
}

/// Scales up the target revision within `replicas + maxSurge` (terminating machines included);
/// machines leaving do not count, so their replacements are created (first, where the surge has
/// room). In place, old machines are converted, so only missing machines are created. A canary
/// under way wants no more than `canary_room` more.
fn scale_up(c: &Classes<'_, '_>, leaving: &[&U<'_>], canary_room: Option<usize>, d: &mut Draft) -> usize {
    if c.target.is_none() {
        return 0;
    }
    // Replacements of machines the cloud takes go beside the surge, within its hard cap.
    let limit = c.desired + c.limits.max_surge + interruption::extra_surge(c.all, c.desired);
    let current = c.all.len() as i64;
    let kept = |u: &&&U<'_>| !holds(leaving, u.key);
    let have = if c.in_place { c.live.iter().filter(kept).count() } else { c.new.iter().filter(kept).count() } as i64;
    let wanted = (c.desired - have).min(canary_room.map_or(i64::MAX, |r| r as i64));
    let create = wanted.min(limit - current).max(0) as usize;
    if wanted > 0 && (create as i64) < wanted {
        d.notes.push(Note::SurgeExhausted { limit, current, wanted });
    }
    create
}

/// Removes old machines (not leaving) in the removal order, through the rollout step (each a
/// `Rollout`, within `maxUnavailable` and the budgets; at most `limit` while a canary holds); in
/// place, old machines are converted, and only a scale-down removes them (the excess over
/// `replicas`).
fn remove_old(
    md: &MachineDeployment,
    c: &Classes<'_, '_>,
    leaving: &[&U<'_>],
    spread: &Spread<'_>,
    limit: Option<usize>,
    planner: &mut Planner,
) -> Vec<String> {
    let candidates = c.old.iter().copied().filter(|u| !holds(leaving, u.key)).collect();
    let order = removal_order(md, spread, candidates);
    let going = if c.in_place {
        let excess = (c.live.len() as i64 - leaving.len() as i64 - c.desired).max(0) as usize;
        scale_down::scale_down(order, excess, planner)
    } else {
        rollout::replace_old(order, limit, planner)
    };
    going.iter().map(|u| u.key.to_string()).collect()
}

/// InPlace: the old Running machines to convert, and how many may start (the in-place step, at
/// most `room` while a canary holds).
fn in_place_work(
    c: &Classes<'_, '_>,
    leaving: &[&U<'_>],
    deleted: &[String],
    room: Option<usize>,
    planner: &mut Planner,
    d: &mut Draft,
) -> Option<InPlaceWork> {
    if !c.in_place || c.old.is_empty() || c.target.is_none() {
        return None;
    }
    let candidates: Vec<&U<'_>> = c
        .old
        .iter()
        .copied()
        .filter(|u| u.item.phase == Phase::Running && !holds(leaving, u.key))
        .filter(|u| !deleted.iter().any(|n| n == u.key))
        .collect();
    let allowed = in_place::allowed(&candidates, room, planner);
    d.notes.push(Note::InPlace { candidates: candidates.len(), allowed });
    Some(InPlaceWork { candidates: candidates.iter().map(|u| u.key.to_string()).collect(), allowed })
}

/// Removes the excess of the target revision (a scale-down, or leftover surge) through the
/// scale-down step. A rebalance's excess goes through the rebalance step instead: once its new
/// machine is available, surge-first.
fn remove_excess(
    md: &MachineDeployment,
    c: &Classes<'_, '_>,
    leaving: &[&U<'_>],
    spread: &Spread<'_>,
    planner: &mut Planner,
    d: &mut Draft,
) -> Vec<String> {
    let kept: Vec<&U<'_>> = c.new.iter().copied().filter(|u| !holds(leaving, u.key)).collect();
    let excess = kept.len() as i64 - c.desired;
    if excess <= 0 {
        return Vec::new();
    }
    d.notes.push(Note::AboveReplicas { machines: kept.len() as i64, replicas: c.desired });
    // Machines created to rebalance (for these replicas): until each is available nothing goes;
    // then the excess leaves the crowded domains, surge-first.
    let movers: Vec<&U<'_>> = if spread.active() {
        kept.iter().copied().filter(|u| domains::rebalance_from(u.item, c.desired).is_some()).collect()
    } else {
        Vec::new()
    };
    let order = removal_order(md, spread, kept.iter().copied().filter(|u| !holds(&movers, u.key)).collect());
    let Some(new) = movers.iter().max_by_key(|u| (u.age, u.key)) else {
        return scale_down::scale_down(order, excess as usize, planner).iter().map(|u| u.key.to_string()).collect();
    };
    match rebalance::excess(&movers, order, excess as usize, c.available, c.desired, planner) {
        Err(waiting) => {
            d.notes.push(Note::RebalanceWaiting { machine: waiting.key.to_string() });
            Vec::new()
        }
        Ok(going) => going
            .iter()
            .map(|u| {
                let (from, to) = (u.item.domain.as_deref().unwrap_or("-"), new.item.domain.as_deref().unwrap_or("-"));
                let message = format!("{} leaves {from}: {} runs in {to}", u.key, new.key);
                d.events.push(PlannedEvent { reason: EventReason::Rebalanced, message });
                u.key.to_string()
            })
            .collect(),
    }
}

/// The status: counts, the disruption report, then the Progressing, Available, DisruptionBlocked
/// and Valid conditions. Returns whether the rollout is complete (every machine on the target
/// revision, `replicas` of them available).
fn write_status(
    md: &MachineDeployment,
    c: &Classes<'_, '_>,
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

/// A complete rollout: the target becomes the current revision and joins the history.
fn complete_rollout(c: &Classes<'_, '_>, d: &mut Draft) {
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
fn progressing(md: &MachineDeployment, c: &Classes<'_, '_>, d: &mut Draft) {
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
fn available(c: &Classes<'_, '_>, st: &mut MachineDeploymentStatus) {
    let waiting: Vec<&Member> = c.live.iter().filter(|u| !u.available).map(|u| u.item).collect();
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
