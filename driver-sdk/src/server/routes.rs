//! What the server answers: the four protocol services, `grpc.health.v1` driven by the driver's
//! probe, server reflection (v1 and v1alpha) and the driver's extra services.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use machine_driver_proto::v1 as pb;
use tonic::service::RoutesBuilder;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use super::error::ServeError;
use crate::context::RequestContext;
use crate::driver::Driver;
use crate::service::DriverService;

/// The longest wait between probes while the driver is not ready, whatever `--probe-interval`
/// says: a starting driver is announced ready within half a second.
const NOT_READY_PROBE_INTERVAL: Duration = Duration::from_millis(500);

/// Adds a driver's extra service ([`DriverServer::add_service`](crate::DriverServer::add_service)).
pub(super) type RouteFn = Box<dyn FnOnce(&mut RoutesBuilder) + Send>;

/// The services a server answers, and the names of all of them (the layer labels their methods'
/// metrics; anything else is `other`).
pub(super) struct Routes {
    pub(super) routes: RoutesBuilder,
    pub(super) served: Vec<String>,
    pub(super) health: Health,
}

/// Builds the routes: each protocol service accepts messages up to `limit` bytes; reflection
/// also describes `descriptor_sets`; health starts NOT_SERVING for every protocol service.
///
/// # Errors
/// [`ServeError::Reflection`] when a descriptor set cannot be used.
pub(super) async fn build<D: Driver>(
    service: &DriverService<D>,
    descriptor_sets: &[&'static [u8]],
    extra: Vec<RouteFn>,
    extra_names: Vec<String>,
    limit: usize,
) -> Result<Routes, ServeError> {
    let (reporter, health_service) = tonic_health::server::health_reporter();
    let health = Health::not_serving(reporter).await;

    let reflection = |fds: &[&'static [u8]]| {
        let mut b = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(machine_driver_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            // google.rpc.ErrorInfo & co., so grpcurl can print error details.
            .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET);
        for f in fds {
            b = b.register_encoded_file_descriptor_set(f);
        }
        b
    };
    let reflection_v1 = reflection(descriptor_sets).build_v1().map_err(ServeError::Reflection)?;
    let reflection_v1alpha = reflection(descriptor_sets).build_v1alpha().map_err(ServeError::Reflection)?;

    let mut routes = RoutesBuilder::default();
    routes
        .add_service(pb::identity_server::IdentityServer::new(service.clone()).max_decoding_message_size(limit))
        .add_service(pb::machines_server::MachinesServer::new(service.clone()).max_decoding_message_size(limit))
        .add_service(pb::pools_server::PoolsServer::new(service.clone()).max_decoding_message_size(limit))
        .add_service(pb::events_server::EventsServer::new(service.clone()).max_decoding_message_size(limit))
        .add_service(pb::operations_server::OperationsServer::new(service.clone()).max_decoding_message_size(limit))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha);
    for add in extra {
        add(&mut routes);
    }

    let mut served: Vec<String> = machine_driver_proto::SERVICE_NAMES.iter().map(|n| n.to_string()).collect();
    served.extend(
        ["grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"]
            .map(String::from),
    );
    served.extend(extra_names);
    Ok(Routes { routes, served, health })
}

/// The server's health: what `grpc.health.v1` and `/readyz` answer.
#[derive(Clone)]
pub(super) struct Health {
    reporter: HealthReporter,
    /// `""` (the whole server) and the protocol services.
    names: Vec<String>,
    ready: Arc<AtomicBool>,
    draining: Arc<AtomicBool>,
}

impl Health {
    /// NOT_SERVING until the first successful ready probe.
    async fn not_serving(reporter: HealthReporter) -> Self {
        let mut names = vec![String::new()];
        names.extend(machine_driver_proto::SERVICE_NAMES.iter().map(|n| n.to_string()));
        let health = Self {
            reporter,
            names,
            ready: Arc::new(AtomicBool::new(false)),
            draining: Arc::new(AtomicBool::new(false)),
        };
        health.set(ServingStatus::NotServing).await;
        health
    }

    async fn set(&self, status: ServingStatus) {
        for n in &self.names {
            self.reporter.set_service_status(n.as_str(), status).await;
        }
    }

    /// Whether the last probe said ready and the server is not draining.
    pub(super) fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    /// Marks the server draining: not ready (`/readyz` answers 503), NOT_SERVING, and the probe
    /// loop stops changing that.
    pub(super) async fn drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
        self.ready.store(false, Ordering::SeqCst);
        self.set(ServingStatus::NotServing).await;
    }

    /// Probes the driver every `interval` (every 500 ms at most while it is not ready) and
    /// reports the result, until the server drains.
    pub(super) async fn probe_loop<D: Driver>(self, driver: Arc<D>, interval: Duration) {
        let mut last: Option<bool> = None;
        loop {
            let ctx = RequestContext::new(format!("probe-{}", uuid::Uuid::new_v4()));
            let now_ready = match driver.probe(&ctx).await {
                Ok(p) => {
                    if !p.ready && last != Some(false) {
                        tracing::info!("driver not ready yet: {}", p.message);
                    }
                    p.ready
                }
                Err(e) => {
                    tracing::warn!("probe failed: {e}");
                    false
                }
            };
            if self.draining.load(Ordering::SeqCst) {
                return;
            }
            if last != Some(now_ready) {
                self.set(if now_ready { ServingStatus::Serving } else { ServingStatus::NotServing }).await;
                self.ready.store(now_ready, Ordering::SeqCst);
                last = Some(now_ready);
            }
            // Deliberate periodic probe; re-probe faster while not ready.
            let wait = if now_ready { interval } else { interval.min(NOT_READY_PROBE_INTERVAL) };
            tokio::time::sleep(wait).await;
        }
    }
}
