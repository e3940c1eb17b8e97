//! The runtime's settings ([`Config`]).

use std::time::Duration;

/// Runtime settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Concurrent reconciles.
    pub workers: usize,
    /// Deadline of one driver call.
    pub call_timeout: Duration,
    /// Deadline of one reconcile.
    pub reconcile_timeout: Duration,
    /// Changes within this window coalesce into one reconcile.
    pub debounce: Duration,
    /// Driver calls per second allowed per driver.
    pub driver_qps: f64,
    /// Burst of the per-driver rate limit.
    pub driver_burst: u32,
    /// How often a Running machine's status is checked.
    pub health_check_interval: Duration,
    /// How often each class is listed for orphans.
    pub orphan_interval: Duration,
    /// How long an orphan is left alone before it is deleted.
    pub orphan_grace: Duration,
    /// The tag value that marks cloud machines as this controller's.
    pub controller_id: String,
    /// Every object is reconciled again this often, even without a change notification.
    pub resync_interval: Duration,
    /// First retry delay.
    pub backoff_base: Duration,
    /// Longest retry delay.
    pub backoff_max: Duration,
    /// How often a drain looks at its node's pods again (and evicts those still there).
    pub drain_poll_interval: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            workers: crate::defaults::WORKERS,
            call_timeout: crate::defaults::CALL_TIMEOUT,
            reconcile_timeout: crate::defaults::RECONCILE_TIMEOUT,
            debounce: crate::defaults::DEBOUNCE,
            driver_qps: crate::defaults::DRIVER_QPS,
            driver_burst: crate::defaults::DRIVER_BURST,
            health_check_interval: crate::defaults::HEALTH_CHECK_INTERVAL,
            orphan_interval: crate::defaults::ORPHAN_INTERVAL,
            orphan_grace: crate::defaults::ORPHAN_GRACE,
            controller_id: crate::defaults::CONTROLLER_ID.into(),
            resync_interval: crate::defaults::RESYNC_INTERVAL,
            backoff_base: crate::defaults::BACKOFF_BASE,
            backoff_max: crate::defaults::BACKOFF_MAX,
            drain_poll_interval: crate::defaults::DRAIN_POLL_INTERVAL,
        }
    }
}
