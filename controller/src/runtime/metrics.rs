//! The runtime's metrics ([`Metrics`]: driver calls, reconciles, the work queue, unreadable
//! objects) and the task that keeps its gauges current. The application registers its own
//! (the controller's: [`crate::app::Metrics`]).

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::Ctx;
use crate::resources::Kind;

/// How often the queue depth and the unreadable objects are recounted (both are in memory).
const GAUGE_INTERVAL: Duration = Duration::from_secs(2);

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

/// The runtime's metrics.
#[derive(Clone)]
pub struct Metrics {
    pub(super) calls: Family<CallLabels, Counter>,
    pub(super) call_seconds: Family<CallLabels, Histogram>,
    pub(super) reconciles: Family<KindLabels, Counter>,
    pub(super) reconcile_errors: Family<KindLabels, Counter>,
    pub(super) reconcile_seconds: Family<KindLabels, Histogram>,
    /// Keys waiting in the work queue.
    queue_depth: Gauge,
    /// Stored objects that cannot be read as their kind, by kind ([`crate::store::Store::unreadable`]).
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
            queue_depth: Gauge::default(),
            unreadable: Family::default(),
        };
        r.register("controller_driver_calls", "Driver calls by driver, method and gRPC code", m.calls.clone());
        r.register("controller_driver_call_duration_seconds", "Driver call latency", m.call_seconds.clone());
        r.register("controller_reconciles", "Reconciles by kind", m.reconciles.clone());
        r.register("controller_reconcile_errors", "Reconciles that failed, by kind", m.reconcile_errors.clone());
        r.register("controller_reconcile_duration_seconds", "Reconcile duration by kind", m.reconcile_seconds.clone());
        r.register("controller_work_queue_depth", "Keys waiting in the work queue", m.queue_depth.clone());
        r.register(
            "controller_unreadable_objects",
            "Stored objects that cannot be read as their kind, by kind",
            m.unreadable.clone(),
        );
        m
    }
}

/// Keeps the queue-depth and unreadable-object gauges current.
pub(super) async fn gauges<A>(ctx: Arc<Ctx<A>>) {
    let mut tick = tokio::time::interval(GAUGE_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        ctx.metrics.queue_depth.set(ctx.queue.depth() as i64);
        let unreadable = ctx.store.unreadable();
        for kind in Kind::ALL {
            let n = unreadable.iter().filter(|(key, _)| key.kind == kind).count();
            ctx.metrics.unreadable.get_or_create(&KindLabels { kind: kind.as_str().into() }).set(n as i64);
        }
    }
}
