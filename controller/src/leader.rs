//! Leader election with a `coordination.k8s.io/v1` Lease, the way client-go's leaderelection
//! package does it: only the holder of the Lease reconciles or calls drivers.
//!
//! - A candidate takes the Lease when it is absent, released, or expired: not renewed for
//!   `leaseDurationSeconds` after the holder's last `renewTime` (and, against clock skew, after
//!   this candidate last saw the record change). Takeover is a `replace` carrying the
//!   resourceVersion that was read, so of two candidates exactly one wins (the other gets 409).
//! - The leader renews every retry period; when it cannot renew for the renew deadline, or
//!   finds another holder, [`Elector::hold`] returns at once and the caller stops acting.
//! - On a clean shutdown the leader releases the Lease so a follower takes over without waiting.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use tokio::time::Instant;

/// The shortest wait of a follower before it tries again: a Lease that expires now (or a create
/// race just lost) is tried again soon, without a busy loop.
const MIN_RETRY_WAIT: Duration = Duration::from_millis(50);

/// Leader election settings (`run --leader-elect …`).
#[derive(Debug, Clone)]
pub struct Config {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Name of the Lease.
    pub name: String,
    /// This candidate (the pod name in a cluster).
    pub identity: String,
    /// How long a Lease is valid after its last renewal ([`defaults::LEASE_DURATION`](crate::defaults::LEASE_DURATION)).
    pub lease_duration: Duration,
    /// The leader gives up when it could not renew for this long
    /// ([`defaults::RENEW_DEADLINE`](crate::defaults::RENEW_DEADLINE)).
    pub renew_deadline: Duration,
    /// How often candidates try and the leader renews ([`defaults::RETRY_PERIOD`](crate::defaults::RETRY_PERIOD)).
    pub retry_period: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            namespace: "default".into(),
            name: crate::defaults::LEASE_NAME.into(),
            identity: "machine-controller".into(),
            lease_duration: crate::defaults::LEASE_DURATION,
            renew_deadline: crate::defaults::RENEW_DEADLINE,
            retry_period: crate::defaults::RETRY_PERIOD,
        }
    }
}

/// Why leadership ended.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Lost {
    /// Another candidate holds the Lease now.
    #[error("the lease is held by {0} now")]
    TakenBy(String),
    /// Renewals failed for longer than the renew deadline.
    #[error("could not renew the lease for {0:?}: {1}")]
    RenewFailed(Duration, String),
}

/// One candidate.
pub struct Elector {
    api: Api<Lease>,
    config: Config,
    /// The record last seen, and when it was first seen.
    observed: Option<(LeaseSpec, Instant)>,
}

enum Attempt {
    Leader,
    Follower { holder: String, expires_in: Duration },
}

impl Elector {
    /// A candidate.
    pub fn new(client: kube::Client, config: Config) -> Self {
        Self { api: Api::namespaced(client, &config.namespace), config, observed: None }
    }

    /// Waits until this candidate holds the Lease.
    pub async fn acquire(&mut self) {
        let mut logged_holder = String::new();
        loop {
            match self.try_acquire_or_renew().await {
                Ok(Attempt::Leader) => {
                    tracing::info!(identity = %self.config.identity, lease = %self.config.name, "became the leader");
                    return;
                }
                Ok(Attempt::Follower { holder, expires_in }) => {
                    if holder != logged_holder {
                        tracing::info!(leader = %holder, "following; the lease is held by another candidate");
                        logged_holder = holder;
                    }
                    // Deliberate: try again at the retry period, or right when the lease expires.
                    let wait = self.config.retry_period.min(expires_in.max(MIN_RETRY_WAIT));
                    tokio::time::sleep(wait).await;
                }
                Err(e) => {
                    tracing::warn!("leader election: {e}");
                    // Deliberate: the retry period between attempts.
                    tokio::time::sleep(self.config.retry_period).await;
                }
            }
        }
    }

    /// Renews while leading; returns as soon as leadership is lost.
    pub async fn hold(&mut self) -> Lost {
        let mut last_renewal = Instant::now();
        loop {
            // Deliberate: the leader renews once per retry period.
            tokio::time::sleep(self.config.retry_period).await;
            let remaining = self.config.renew_deadline.saturating_sub(last_renewal.elapsed());
            match tokio::time::timeout(remaining, self.try_acquire_or_renew()).await {
                Ok(Ok(Attempt::Leader)) => last_renewal = Instant::now(),
                Ok(Ok(Attempt::Follower { holder, .. })) => return Lost::TakenBy(holder),
                Ok(Err(e)) => {
                    tracing::warn!("renewing the lease: {e}");
                    if last_renewal.elapsed() >= self.config.renew_deadline {
                        return Lost::RenewFailed(self.config.renew_deadline, e.to_string());
                    }
                }
                Err(_) => {
                    return Lost::RenewFailed(self.config.renew_deadline, "timed out".into());
                }
            }
        }
    }

    /// Gives the Lease up (clean shutdown) so a follower takes over at once.
    pub async fn release(&mut self) {
        let Ok(Some(mut lease)) = self.api.get_opt(&self.config.name).await else { return };
        let spec = lease.spec.get_or_insert_with(Default::default);
        if spec.holder_identity.as_deref() != Some(self.config.identity.as_str()) {
            return;
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        match self.api.replace(&self.config.name, &PostParams::default(), &lease).await {
            Ok(_) => tracing::info!("released the lease"),
            Err(e) => tracing::warn!("releasing the lease: {e}"),
        }
    }

    async fn try_acquire_or_renew(&mut self) -> Result<Attempt, kube::Error> {
        let now = Timestamp::now();
        let lease_secs = i32::try_from(self.config.lease_duration.as_secs()).unwrap_or(i32::MAX);
        let Some(mut lease) = self.api.get_opt(&self.config.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.config.name.clone()),
                    namespace: Some(self.config.namespace.clone()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.config.identity.clone()),
                    lease_duration_seconds: Some(lease_secs),
                    acquire_time: Some(MicroTime(now)),
                    renew_time: Some(MicroTime(now)),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(Attempt::Leader),
                Err(kube::Error::Api(s)) if s.is_already_exists() => {
                    Ok(Attempt::Follower { holder: "another candidate".into(), expires_in: Duration::ZERO })
                }
                Err(e) => Err(e),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        if self.observed.as_ref().is_none_or(|(seen, _)| *seen != spec) {
            self.observed = Some((spec.clone(), Instant::now()));
        }
        let holder = spec.holder_identity.clone().unwrap_or_default();
        let me = self.config.identity.as_str();
        if !holder.is_empty() && holder != me {
            let duration = Duration::from_secs(u64::try_from(spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0));
            // Time since the holder's last renewal by its renewTime, but never more than one
            // retry period beyond when this candidate first saw that record: a holder whose
            // clock runs behind cannot make its lease look expired early.
            let since_renewal = spec
                .renew_time
                .as_ref()
                .and_then(|t| Duration::try_from(now.duration_since(t.0)).ok())
                .unwrap_or(Duration::ZERO);
            let since_observed = self.observed.as_ref().map(|(_, at)| at.elapsed()).unwrap_or_default();
            let elapsed = since_renewal.min(since_observed + self.config.retry_period);
            if elapsed < duration {
                return Ok(Attempt::Follower { holder, expires_in: duration - elapsed });
            }
        }
        let next = lease.spec.get_or_insert_with(Default::default);
        if holder != me {
            next.acquire_time = Some(MicroTime(now));
            next.lease_transitions = Some(next.lease_transitions.unwrap_or(0) + 1);
            next.holder_identity = Some(me.to_string());
        }
        next.renew_time = Some(MicroTime(now));
        next.lease_duration_seconds = Some(lease_secs);
        match self.api.replace(&self.config.name, &PostParams::default(), &lease).await {
            Ok(_) => Ok(Attempt::Leader),
            Err(kube::Error::Api(s)) if s.is_conflict() => {
                // Someone else wrote first; the next attempt reads who.
                Ok(Attempt::Follower { holder: "another candidate".into(), expires_in: Duration::ZERO })
            }
            Err(e) => Err(e),
        }
    }
}
