//! Driver calls: one [`DriverHandle`] per driver sidecar, its [`TokenBucket`] rate limit, and
//! [`Ctx::call`], the one way a reconciler calls a driver (rate-limited, measured, logged).

use machine_driver_util::lock;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use driver_sdk::{CallResult, DriverClient};
use tokio::time::Instant;

use super::metrics::CallLabels;
use super::{Config, Ctx};

/// A token bucket: `rate` per second, up to `burst` at once.
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    state: Mutex<(f64, Instant)>,
}

impl TokenBucket {
    /// A full bucket.
    pub fn new(rate: f64, burst: u32) -> Self {
        let burst = f64::from(burst.max(1));
        Self { rate: rate.max(0.001), burst, state: Mutex::new((burst, Instant::now())) }
    }

    /// Takes a token, waiting for one if needed.
    pub async fn acquire(&self) {
        loop {
            let wait = {
                let mut s = lock(&self.state);
                let now = Instant::now();
                s.0 = (s.0 + now.duration_since(s.1).as_secs_f64() * self.rate).min(self.burst);
                s.1 = now;
                if s.0 >= 1.0 {
                    s.0 -= 1.0;
                    return;
                }
                Duration::from_secs_f64((1.0 - s.0) / self.rate)
            };
            // Deliberate: the rate limit's wait for the next token.
            tokio::time::sleep(wait).await;
        }
    }
}

/// One driver sidecar.
pub struct DriverHandle {
    /// The name classes use.
    name: String,
    /// The client (short per-call deadline); [`Ctx::call`] hands it to a call.
    client: DriverClient,
    limiter: TokenBucket,
}

impl DriverHandle {
    /// The name classes use.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// Handles for `drivers` (names and endpoints), connected lazily.
///
/// # Errors
/// A malformed endpoint.
pub fn connect(
    drivers: &[(String, String)],
    config: &Config,
) -> Result<HashMap<String, DriverHandle>, driver_sdk::endpoint::EndpointError> {
    let mut map = HashMap::new();
    for (name, endpoint) in drivers {
        let client = DriverClient::connect_lazy(endpoint)?.with_call_timeout(config.call_timeout);
        map.insert(
            name.clone(),
            DriverHandle {
                name: name.clone(),
                client,
                limiter: TokenBucket::new(config.driver_qps, config.driver_burst),
            },
        );
    }
    Ok(map)
}

impl<A> Ctx<A> {
    /// Calls a driver: waits for the rate limit, records metrics, logs the request ID.
    pub async fn call<T, F, Fut>(&self, driver: &DriverHandle, method: &'static str, f: F) -> CallResult<T>
    where
        F: FnOnce(DriverClient) -> Fut,
        Fut: std::future::Future<Output = CallResult<T>>,
    {
        driver.limiter.acquire().await;
        let started = Instant::now();
        let result = f(driver.client.clone()).await;
        let (code, request_id) = match &result {
            Ok(r) => ("OK".to_string(), r.request_id.clone()),
            Err(e) => (format!("{:?}", e.code()), e.request_id().to_string()),
        };
        let labels = CallLabels { driver: driver.name.clone(), method: method.into(), code: code.clone() };
        self.metrics.calls.get_or_create(&labels).inc();
        self.metrics.call_seconds.get_or_create(&labels).observe(started.elapsed().as_secs_f64());
        match &result {
            Ok(_) => tracing::debug!("request.id" = %request_id, "driver call {method} ok"),
            Err(e) => tracing::info!("request.id" = %request_id, "driver call {method} failed: {}", e.report),
        }
        result
    }
}
