//! The controller's metrics ([`Metrics`]) and the task that keeps its gauges current.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tokio::time::Instant;

use super::Ctx;
use crate::resources::{Kind, Phase};

/// How often the phase and in-flight gauges are recounted, at most ...
const GAUGE_INTERVAL: Duration = Duration::from_secs(2);
/// ... and at least (a Prometheus scrape interval is typically 15–30 s).
const GAUGE_INTERVAL_MAX: Duration = Duration::from_secs(30);
/// A recount waits this many times as long as the last one took: with 100,000 Machines a count
/// takes about 0.3 s, and every 2 s it cost a ninth of the controller's CPU; this way it costs
/// at most 2 % of a core.
const GAUGE_COST_FACTOR: u32 = 50;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct CallLabels {
    pub(super) driver: String,
    pub(super) method: String,
    pub(super) code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct KindLabels {
    pub(super) kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    phase: String,
}

/// Controller metrics.
#[derive(Clone)]
pub struct Metrics {
    pub(super) calls: Family<CallLabels, Counter>,
    pub(super) call_seconds: Family<CallLabels, Histogram>,
    pub(super) reconciles: Family<KindLabels, Counter>,
    pub(super) reconcile_errors: Family<KindLabels, Counter>,
    pub(super) reconcile_seconds: Family<KindLabels, Histogram>,
    /// Machines by phase.
    phases: Family<PhaseLabels, Gauge>,
    /// Operations stored in status, not done yet.
    pub operations_in_flight: Gauge,
    /// Orphans deleted.
    pub orphans_deleted: Counter,
    /// Keys waiting in the work queue.
    pub queue_depth: Gauge,
    /// Requests to the target cluster (`crate::nodes::calls`).
    pub target_calls: crate::nodes::calls::CallMetrics,
    /// Stored objects that cannot be read as their kind, by kind ([`Store::unreadable`]).
    unreadable: Family<KindLabels, Gauge>,
}

impl Metrics {
    /// Registers the metrics.
    pub fn register(r: &mut Registry) -> Self {
        let hist = || Histogram::new(exponential_buckets(0.0005, 2.5, 14));
        let m = Self {
            calls: Family::default(),
            call_seconds: Family::new_with_constructor(hist),
            reconciles: Family::default(),
            reconcile_errors: Family::default(),
            reconcile_seconds: Family::new_with_constructor(hist),
            phases: Family::default(),
            operations_in_flight: Gauge::default(),
            orphans_deleted: Counter::default(),
            queue_depth: Gauge::default(),
            target_calls: crate::nodes::calls::CallMetrics::default(),
            unreadable: Family::default(),
        };
        r.register("controller_driver_calls", "Driver calls by driver, method and gRPC code", m.calls.clone());
        r.register("controller_driver_call_duration_seconds", "Driver call latency", m.call_seconds.clone());
        r.register("controller_reconciles", "Reconciles by kind", m.reconciles.clone());
        r.register("controller_reconcile_errors", "Reconciles that failed, by kind", m.reconcile_errors.clone());
        r.register("controller_reconcile_duration_seconds", "Reconcile duration by kind", m.reconcile_seconds.clone());
        r.register("controller_machines", "Machines by phase", m.phases.clone());
        r.register(
            "controller_operations_in_flight",
            "Operations kept in status, not done",
            m.operations_in_flight.clone(),
        );
        r.register("controller_orphans_deleted", "Cloud machines deleted as orphans", m.orphans_deleted.clone());
        r.register("controller_work_queue_depth", "Keys waiting in the work queue", m.queue_depth.clone());
        m.target_calls.register(r);
        r.register(
            "controller_unreadable_objects",
            "Stored objects that cannot be read as their kind, by kind",
            m.unreadable.clone(),
        );
        m
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

/// Keeps the phase and in-flight gauges current.
pub(super) async fn gauges<A>(ctx: Arc<Ctx<A>>) {
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
        }
        #[derive(serde::Deserialize, Default)]
        struct SlimStatus {
            #[serde(default)]
            phase: Phase,
            #[serde(default)]
            operations: Vec<serde::de::IgnoredAny>,
        }
        let mut counts: HashMap<Phase, i64> = HashMap::new();
        let mut in_flight = 0;
        let counted = ctx
            .store
            .backend()
            .scan(Kind::Machine, &mut |json| {
                if let Ok(m) = serde_json::from_str::<Slim>(json) {
                    *counts.entry(m.status.phase).or_default() += 1;
                    in_flight += m.status.operations.len() as i64;
                }
                Ok(())
            })
            .await;
        wait = (started.elapsed() * GAUGE_COST_FACTOR).clamp(GAUGE_INTERVAL, GAUGE_INTERVAL_MAX);
        if counted.is_err() {
            continue;
        }
        ctx.metrics.set_phases(&counts);
        ctx.metrics.operations_in_flight.set(in_flight);
        ctx.metrics.queue_depth.set(ctx.queue.depth() as i64);
        let unreadable = ctx.store.unreadable();
        for kind in Kind::ALL {
            let n = unreadable.iter().filter(|(key, _)| key.kind == kind).count();
            ctx.metrics.unreadable.get_or_create(&KindLabels { kind: kind.as_str().into() }).set(n as i64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
