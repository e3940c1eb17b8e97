//! The application's context: what the controller's reconcilers share beside the runtime's
//! part ([`crate::runtime::Ctx`]): the drivers, the target clusters, the orphans seen, the
//! safety checks, and what a class's users were last woken for. The runtime never reads it.

use machine_driver_util::lock;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::time::Instant;

use crate::resources::{Kind, Phase};
use crate::runtime::drivers::{self, DriverHandle};
use crate::runtime::keys::GiveBackRoom;
use crate::runtime::{self, Config};
use crate::store::{Key, Store};

/// The context the controller's reconcilers get: the runtime's part with [`App`].
pub type Ctx = runtime::Ctx<App>;

/// How often the phase and in-flight gauges are recounted, at most ...
const GAUGE_INTERVAL: Duration = Duration::from_secs(2);
/// ... and at least (a Prometheus scrape interval is typically 15–30 s).
const GAUGE_INTERVAL_MAX: Duration = Duration::from_secs(30);
/// A recount waits this many times as long as the last one took: with 100,000 Machines a count
/// takes about 0.3 s, and every 2 s it cost a ninth of the controller's CPU; this way it costs
/// at most 2 % of a core.
const GAUGE_COST_FACTOR: u32 = 50;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    phase: String,
}

/// The controller's own metrics, beside the runtime's ([`runtime::Metrics`]).
#[derive(Clone)]
pub struct Metrics {
    /// Machines by phase.
    phases: Family<PhaseLabels, Gauge>,
    /// Operations stored in status, not done yet.
    operations_in_flight: Gauge,
    /// Orphans deleted.
    pub orphans_deleted: Counter,
    /// Requests to the target clusters (`crate::nodes::calls`).
    pub target_calls: crate::nodes::calls::CallMetrics,
    /// The drivers' events and how interruptions went.
    pub interruptions: InterruptionMetrics,
    /// What the objects say: conditions, owners' replicas, disruptions ([`crate::state_metrics`]).
    pub state: crate::state_metrics::StateMetrics,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    kind: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MarginLabels {
    kind: String,
    milestone: String,
}

/// What a deadline is met by: the interrupted machine's node drained, or its replacement Ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Milestone {
    /// The interrupted machine's node is drained.
    Drained,
    /// A machine created to replace it is Ready.
    ReplacementReady,
}

/// The drivers' events received (by kind and outcome), and by how much each interruption's
/// deadline was met (`controller_interruption_margin_seconds`: `notBefore` minus the moment of
/// the milestone) or missed.
#[derive(Clone)]
pub struct InterruptionMetrics {
    events: Family<EventLabels, Counter>,
    margin: Family<MarginLabels, Histogram, fn() -> Histogram>,
    missed: Family<MarginLabels, Counter>,
}

impl Default for InterruptionMetrics {
    fn default() -> Self {
        Self {
            events: Family::default(),
            margin: Family::new_with_constructor(|| {
                Histogram::new([-60.0, -10.0, 0.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 900.0])
            }),
            missed: Family::default(),
        }
    }
}

impl InterruptionMetrics {
    fn register(&self, r: &mut Registry) {
        r.register(
            "controller_interruption_events",
            "Events the drivers streamed, by kind and what became of them",
            self.events.clone(),
        );
        r.register(
            "controller_interruption_margin_seconds",
            "How long before an interruption's deadline its node was drained or its replacement was Ready (negative: after)",
            self.margin.clone(),
        );
        r.register(
            "controller_interruption_deadlines_missed",
            "Interruptions whose node was drained, or whose replacement was Ready, after the deadline",
            self.missed.clone(),
        );
    }

    /// One event of `kind` received, with its outcome.
    pub fn received(&self, kind: &str, outcome: crate::reconcile::interruptions::Outcome) {
        let labels = EventLabels { kind: kind.into(), outcome: outcome.as_str().into() };
        self.events.get_or_create(&labels).inc();
    }

    /// A milestone of an interruption of `kind` reached `margin_seconds` before its deadline.
    pub fn reached(&self, kind: crate::resources::InterruptionKind, milestone: Milestone, margin_seconds: f64) {
        let milestone = match milestone {
            Milestone::Drained => "drained",
            Milestone::ReplacementReady => "replacement_ready",
        };
        let labels = MarginLabels { kind: kind.as_str().into(), milestone: milestone.into() };
        self.margin.get_or_create(&labels).observe(margin_seconds);
        if margin_seconds < 0.0 {
            self.missed.get_or_create(&labels).inc();
        }
    }
}

impl Metrics {
    /// Registers the metrics.
    pub fn register(r: &mut Registry) -> Self {
        let m = Self {
            phases: Family::default(),
            operations_in_flight: Gauge::default(),
            orphans_deleted: Counter::default(),
            target_calls: crate::nodes::calls::CallMetrics::default(),
            interruptions: InterruptionMetrics::default(),
            state: crate::state_metrics::StateMetrics::default(),
        };
        r.register("controller_machines", "Machines by phase", m.phases.clone());
        r.register(
            "controller_operations_in_flight",
            "Operations kept in status, not done",
            m.operations_in_flight.clone(),
        );
        r.register("controller_orphans_deleted", "Cloud machines deleted as orphans", m.orphans_deleted.clone());
        m.target_calls.register(r);
        m.interruptions.register(r);
        let state = crate::state_metrics::StateMetrics::register(r);
        Metrics { state, ..m }
    }

    /// Sets the Machines-by-phase gauge: a series for every [`Phase`] (zero when none has it),
    /// so a phase added to the enum is counted without a change here.
    fn set_phases(&self, counts: &HashMap<Phase, i64>) {
        for phase in Phase::ALL {
            let n = counts.get(phase).copied().unwrap_or(0);
            self.phases.get_or_create(&PhaseLabels { phase: phase.as_str().into() }).set(n);
        }
    }
}

#[derive(serde::Deserialize, Default)]
struct SlimMeta {
    #[serde(default)]
    namespace: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    annotations: SlimAnnotations,
}

/// The one annotation the gauges read (the others are skipped, not allocated).
#[derive(serde::Deserialize, Default)]
struct SlimAnnotations {
    #[serde(default, rename = "machine.driver.dev/disruption-reason")]
    disruption: Option<String>,
}

/// Counts the conditions of the kinds other than Machine and each owner's replicas into
/// `state`, and adds the target clusters the owners name to `targets`; `false` if the store
/// could not be read (nothing is published or closed then).
async fn count_owners(
    ctx: &Ctx,
    state: &mut crate::state_metrics::Count,
    targets: &mut std::collections::HashSet<crate::targets::TargetId>,
    now: crate::resources::Time,
) -> bool {
    use crate::resources::{MachineClass, MachineDeployment, MachineHealthCheck, MachinePool};
    let (Ok(mds), Ok(pools), Ok(checks), Ok(classes)) = (
        ctx.store.list::<MachineDeployment>().await,
        ctx.store.list::<MachinePool>().await,
        ctx.store.list::<MachineHealthCheck>().await,
        ctx.store.list::<MachineClass>().await,
    ) else {
        return false;
    };
    use crate::targets::TargetId;
    let named = |ns: &str, t: Option<&crate::resources::TargetCluster>| t.map(|t| TargetId::of(ns, Some(t)));
    targets.extend(mds.iter().filter_map(|o| named(&o.metadata.namespace, o.spec.target_cluster.as_ref())));
    targets.extend(pools.iter().filter_map(|o| named(&o.metadata.namespace, o.spec.target_cluster.as_ref())));
    for md in &mds {
        state.conditions(object("MachineDeployment", &md.metadata), &md.status.conditions, now);
        let st = &md.status;
        let replicas = [
            ("desired", md.spec.replicas),
            ("current", st.replicas),
            ("available", st.available_replicas),
            ("updated", st.updated_replicas),
            ("ready", st.ready_replicas),
            ("failed", st.failed_replicas),
        ];
        state.owner("MachineDeployment", &md.metadata.namespace, &md.metadata.name, &replicas);
    }
    for p in &pools {
        state.conditions(object("MachinePool", &p.metadata), &p.status.conditions, now);
        let st = &p.status;
        let replicas = [
            ("desired", p.spec.replicas),
            ("current", st.replicas),
            ("ready", st.ready_replicas),
            ("updated", st.updated_replicas),
        ];
        state.owner("MachinePool", &p.metadata.namespace, &p.metadata.name, &replicas);
    }
    for c in &checks {
        state.conditions(object("MachineHealthCheck", &c.metadata), &c.status.conditions, now);
    }
    for c in &classes {
        state.conditions(object("MachineClass", &c.metadata), &c.status.conditions, now);
    }
    true
}

/// Which object a count's conditions are of.
fn object<'a>(kind: &'static str, m: &'a crate::resources::ObjectMeta) -> crate::state_metrics::Object<'a> {
    crate::state_metrics::Object { kind, namespace: &m.namespace, name: &m.name }
}

#[derive(serde::Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct SlimSpec {
    #[serde(default)]
    target_cluster: Option<crate::resources::TargetCluster>,
}

fn target_id(meta: &SlimMeta, spec: &SlimSpec) -> Option<crate::targets::TargetId> {
    let t = spec.target_cluster.as_ref()?;
    Some(crate::targets::TargetId::of(&meta.namespace, Some(t)))
}

/// Keeps the phase and in-flight gauges current, and closes the target clusters no object
/// names any more (a background task of the controller).
pub async fn gauges(ctx: Arc<Ctx>) {
    let mut wait = Duration::ZERO;
    loop {
        // Deliberate: the pause between recounts, paced by what the last one cost.
        tokio::time::sleep(wait).await;
        let started = Instant::now();
        // Only the phase and the operation count are read, not whole objects: with 10,000
        // Machines this runs without allocating them all.
        #[derive(serde::Deserialize)]
        struct Slim {
            #[serde(default)]
            status: SlimStatus,
            #[serde(default)]
            metadata: SlimMeta,
            #[serde(default)]
            spec: SlimSpec,
        }
        #[derive(serde::Deserialize, Default)]
        struct SlimStatus {
            #[serde(default)]
            phase: Phase,
            #[serde(default)]
            operations: Vec<serde::de::IgnoredAny>,
            #[serde(default)]
            conditions: Vec<SlimCondition>,
        }
        #[derive(serde::Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct SlimCondition {
            #[serde(rename = "type")]
            condition_type: crate::resources::ConditionType,
            status: crate::resources::ConditionStatus,
            last_transition_time: crate::resources::Time,
        }
        let now = chrono::Utc::now();
        let mut state = crate::state_metrics::Count::default();
        let mut counts: HashMap<Phase, i64> = HashMap::new();
        let mut in_flight = 0;
        let mut targets = std::collections::HashSet::new();
        let counted = ctx
            .store
            .backend()
            .scan(Kind::Machine, &mut |json| {
                if let Ok(m) = serde_json::from_str::<Slim>(json) {
                    *counts.entry(m.status.phase).or_default() += 1;
                    in_flight += m.status.operations.len() as i64;
                    targets.extend(target_id(&m.metadata, &m.spec));
                    for c in &m.status.conditions {
                        let object = crate::state_metrics::Object {
                            kind: "Machine",
                            namespace: &m.metadata.namespace,
                            name: &m.metadata.name,
                        };
                        state.condition(&object, c.condition_type, c.status, c.last_transition_time, now);
                    }
                    if let Some(reason) = &m.metadata.annotations.disruption {
                        state.disruption(reason);
                    }
                }
                Ok(())
            })
            .await;
        if counted.is_err() {
            wait = (started.elapsed() * GAUGE_COST_FACTOR).clamp(GAUGE_INTERVAL, GAUGE_INTERVAL_MAX);
            continue;
        }
        let owners_counted = count_owners(&ctx, &mut state, &mut targets, now).await;
        // The pause is paced by the whole pass: the Machines' scan and the owners' lists.
        wait = (started.elapsed() * GAUGE_COST_FACTOR).clamp(GAUGE_INTERVAL, GAUGE_INTERVAL_MAX);
        if owners_counted {
            ctx.app.targets.retain(&targets, started);
            ctx.app.metrics.state.publish(state);
        }
        ctx.app.metrics.set_phases(&counts);
        ctx.app.metrics.operations_in_flight.set(in_flight);
    }
}

/// The controller's settings, beside the runtime's ([`Config`]).
#[derive(Debug, Clone)]
pub struct Settings {
    /// How often a Running machine's status is checked.
    pub health_check_interval: Duration,
    /// How often each class is listed for orphans.
    pub orphan_interval: Duration,
    /// How long an orphan is left alone before it is deleted.
    pub orphan_grace: Duration,
    /// The tag value that marks cloud machines as this controller's.
    pub controller_id: String,
    /// How often a drain looks at its node's pods again (and evicts those still there).
    pub drain_poll_interval: Duration,
    /// How each target cluster is connected (rate limit, bootstrap tokens).
    pub targets: crate::targets::TargetSettings,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            health_check_interval: crate::defaults::HEALTH_CHECK_INTERVAL,
            orphan_interval: crate::defaults::ORPHAN_INTERVAL,
            orphan_grace: crate::defaults::ORPHAN_GRACE,
            controller_id: crate::defaults::CONTROLLER_ID.into(),
            drain_poll_interval: crate::defaults::DRAIN_POLL_INTERVAL,
            targets: crate::targets::TargetSettings::default(),
        }
    }
}

/// The application's part of the context ([`runtime::Ctx::app`]).
pub struct App {
    /// Settings.
    pub settings: Settings,
    /// Its metrics.
    pub metrics: Metrics,
    /// Drivers by name ([`App::driver`]).
    drivers: HashMap<String, DriverHandle>,
    /// The clusters where the machines' Nodes live: the default one (`None`: the Nodes of
    /// objects that name no target cluster are not managed) and those objects name.
    pub targets: crate::targets::Targets,
    /// Cloud machines without a Machine, and when they were first seen.
    pub orphans: Mutex<HashMap<(String, String), Instant>>,
    /// Whether the API servers it depends on answer, and when health timers start.
    pub safety: Arc<crate::safety::Safety>,
    /// The generation at which the objects that depend on a key (a class's machines) were last
    /// woken: its own status writes must not wake them (that would undo their backoff in a
    /// loop). An entry goes when its object is deleted ([`App::forget`]).
    dependents_woken_at: Mutex<HashMap<Key, i64>>,
}

impl App {
    /// The controller's context; `drivers` maps names to endpoints (the runtime's settings,
    /// `config`, hold their rate limit and call deadline).
    ///
    /// # Errors
    /// A malformed endpoint.
    pub fn context(
        store: Store,
        drivers: &[(String, String)],
        config: Config,
        settings: Settings,
        registry: &mut Registry,
        target: Option<crate::nodes::Target>,
    ) -> Result<Arc<Ctx>, driver_sdk::endpoint::EndpointError> {
        let targets = crate::targets::Targets::new(target, settings.targets.clone());
        let app = App {
            settings,
            metrics: Metrics::register(registry),
            drivers: drivers::connect(drivers, &config)?,
            targets,
            orphans: Mutex::new(HashMap::new()),
            safety: Arc::default(),
            dependents_woken_at: Mutex::new(HashMap::new()),
        };
        let ctx = runtime::Ctx::new(store, config, registry, app);
        ctx.app.targets.report_to(ctx.app.metrics.target_calls.clone());
        Ok(ctx)
    }

    /// The open target cluster of an object in `namespace` with this `spec.targetCluster` (the
    /// default one without it). A reconcile opens a named one first
    /// (`reconcile::connect_target`); this only looks it up.
    pub fn target_of(
        &self,
        namespace: &str,
        target: Option<&crate::resources::TargetCluster>,
    ) -> Option<Arc<crate::nodes::Target>> {
        let id = crate::targets::TargetId::of(namespace, target);
        self.targets.open(&id).map(|c| c.target.clone())
    }

    /// [`App::target_of`] a Machine.
    pub fn machine_target(&self, m: &crate::resources::Machine) -> Option<Arc<crate::nodes::Target>> {
        self.target_of(&m.metadata.namespace, m.spec.target_cluster.as_ref())
    }

    /// The driver named `name` (as a class names it), if the controller runs with it.
    pub fn driver(&self, name: &str) -> Option<&DriverHandle> {
        self.drivers.get(name)
    }

    /// The names of the drivers the controller runs with, sorted.
    pub fn driver_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.drivers.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    /// Whether the objects that depend on `key` are to be woken for its `generation`: `true`
    /// the first time a generation is seen (a new spec), `false` for the same one again (the
    /// object's own status writes).
    pub fn dependents_due(&self, key: &Key, generation: i64) -> bool {
        let mut woken = lock(&self.dependents_woken_at);
        woken.insert(key.clone(), generation) != Some(generation)
    }

    /// Forgets what is kept for `key` (it was deleted; an object re-created under its name
    /// starts afresh).
    pub fn forget(&self, key: &Key) {
        let mut woken = lock(&self.dependents_woken_at);
        if woken.remove(key).is_some() {
            woken.give_back_room();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `controller_…` metric the shipped alert rules and Grafana dashboard name is one the
    /// controller registers (`register("NAME", …)` in its sources; with a counter's `_total`, a
    /// histogram's `_bucket`/`_sum`/`_count`).
    #[test]
    fn the_alert_rules_and_the_dashboard_name_only_exported_metrics() {
        fn sources(dir: &std::path::Path, out: &mut Vec<String>) {
            for entry in std::fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    sources(&path, out);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    out.push(std::fs::read_to_string(&path).unwrap());
                }
            }
        }
        let mut texts = Vec::new();
        sources(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &mut texts);
        let mut exported = std::collections::HashSet::new();
        for text in &texts {
            for (i, _) in text.match_indices("register(") {
                let rest = text[i + "register(".len()..].trim_start();
                let Some(name) = rest.strip_prefix('"').and_then(|r| r.split('"').next()) else { continue };
                for suffix in ["", "_total", "_bucket", "_sum", "_count"] {
                    exported.insert(format!("{name}{suffix}"));
                }
            }
        }
        assert!(exported.contains("controller_conditions") && exported.contains("controller_driver_calls_total"));
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        for file in [
            "deploy/chart/machine-controller/files/machine-driver.rules.yaml",
            "deploy/chart/machine-controller/files/machine-driver.dashboard.json",
        ] {
            let body = std::fs::read_to_string(root.join(file)).unwrap();
            let named: std::collections::BTreeSet<&str> = body
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("controller_"))
                .collect();
            assert!(named.len() > 3, "{file} names hardly any metric: {named:?}");
            let unknown: Vec<&&str> = named.iter().filter(|n| !exported.contains(**n)).collect();
            assert!(unknown.is_empty(), "{file} names metrics the controller does not export: {unknown:?}");
        }
    }

    #[test]
    fn every_phase_has_a_series_in_the_machines_gauge() {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        metrics.set_phases(&HashMap::from([(Phase::Running, 3)]));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for phase in Phase::ALL {
            let n = if *phase == Phase::Running { 3 } else { 0 };
            let line = format!("controller_machines{{phase=\"{phase}\"}} {n}");
            assert!(text.lines().any(|l| l == line), "no `{line}` in:\n{text}");
        }
    }

    #[tokio::test]
    async fn a_class_wakes_its_users_once_per_generation_and_afresh_once_re_created() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("s.db")).unwrap();
        let ctx =
            App::context(store, &[], Config::default(), Settings::default(), &mut Registry::default(), None).unwrap();
        let class = Key::new(Kind::MachineClass, "default", "small");
        assert!(ctx.app.dependents_due(&class, 1), "a new class wakes what uses it");
        assert!(!ctx.app.dependents_due(&class, 1), "its own status writes do not");
        assert!(ctx.app.dependents_due(&class, 2), "a new spec does");
        ctx.app.forget(&class);
        // Deleted and created again at generation 1: its users are woken again.
        assert!(ctx.app.dependents_due(&class, 1));
        ctx.app.forget(&class);
        assert!(ctx.app.dependents_woken_at.lock().unwrap().is_empty(), "nothing is kept for a forgotten key");
    }
}
