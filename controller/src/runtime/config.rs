//! The runtime's settings ([`Config`]); the application's are its own ([`crate::app::Settings`]).

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
    /// Every object is reconciled again this often, even without a change notification.
    pub resync_interval: Duration,
    /// First retry delay.
    pub backoff_base: Duration,
    /// Longest retry delay.
    pub backoff_max: Duration,
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
            resync_interval: crate::defaults::RESYNC_INTERVAL,
            backoff_base: crate::defaults::BACKOFF_BASE,
            backoff_max: crate::defaults::BACKOFF_MAX,
        }
    }
}
