//! Prometheus metrics of the driver's RPCs, and a small HTTP server that exposes them.
//!
//! The HTTP server and the text encoding live in [`machine_driver_util::metrics`], shared with
//! the controller; they are re-exported here unchanged. [`RpcMetrics`] is the server's.

pub use machine_driver_util::metrics::{bind, encode, serve_http, ReadyFn};
#[cfg(feature = "server")]
pub use rpc::RpcMetrics;

#[cfg(feature = "server")]
mod rpc {
    use std::time::Duration;

    use prometheus_client::encoding::EncodeLabelSet;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
    use prometheus_client::registry::Registry;

    #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
    struct RpcLabels {
        method: String,
        code: String,
    }

    #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
    struct MethodLabels {
        method: String,
    }

    /// RPC metrics: `driver_rpc_requests_total{method,code}`,
    /// `driver_rpc_duration_seconds{method}` and `driver_rpc_in_flight`.
    #[derive(Clone)]
    pub struct RpcMetrics {
        requests: Family<RpcLabels, Counter>,
        durations: Family<MethodLabels, Histogram>,
        in_flight: Gauge,
    }

    impl RpcMetrics {
        /// Registers the metrics in `registry`.
        pub fn register(registry: &mut Registry) -> Self {
            let requests = Family::<RpcLabels, Counter>::default();
            let durations = Family::<MethodLabels, Histogram>::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.0001, 2.5, 14))
            });
            let in_flight = Gauge::default();
            registry.register("driver_rpc_requests", "Driver RPCs by method and gRPC code", requests.clone());
            registry.register("driver_rpc_duration_seconds", "Driver RPC latency by method", durations.clone());
            registry.register("driver_rpc_in_flight", "Driver RPCs being served", in_flight.clone());
            Self { requests, durations, in_flight }
        }

        pub(crate) fn started(&self) {
            self.in_flight.inc();
        }

        pub(crate) fn finished(&self, method: &str, code: &str, elapsed: Duration) {
            self.in_flight.dec();
            self.requests.get_or_create(&RpcLabels { method: method.to_string(), code: code.to_string() }).inc();
            self.durations.get_or_create(&MethodLabels { method: method.to_string() }).observe(elapsed.as_secs_f64());
        }
    }
}
