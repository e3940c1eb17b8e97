//! The controller's view of the API servers it depends on (machine-controller-manager's safety
//! controller): each target cluster where Nodes live (one [`Safety`] per target:
//! [`crate::targets`], so one cluster's outage freezes its own machines' health only), and the
//! store's API server with `--store kubernetes` (the controller's own [`Safety`]). Each is probed every [`PROBE_INTERVAL`]; while one cannot be reached,
//! MachineHealthChecks judge nothing and owners remediate nothing ([`Safety::unreachable`]); once
//! it is back after an outage as long as a health check's timeout, or [`OUTAGE`], that check's
//! timers start over ([`Safety::timers_since`]): what the controller could not observe must not
//! count as a Node being down, or every machine would be remediated at once when the control
//! plane returns.

use machine_driver_util::lock;
use std::sync::Mutex;
use std::time::Duration;

use crate::resources::Time;

/// How often each API server is probed (a `GET /version` with this as its deadline).
pub const PROBE_INTERVAL: Duration = Duration::from_secs(5);
/// An outage at least this long restarts every health check's timers, whatever its timeout
/// (machine-controller-manager uses the same figure).
pub const OUTAGE: Duration = Duration::from_secs(30);

/// What the probes found.
#[derive(Debug, Default)]
pub struct Safety {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// What cannot be reached now, and since when.
    down: Vec<(String, Time)>,
    /// The longest outage that ended last: when it ended, and how long it lasted.
    last: Option<(Time, Duration)>,
}

impl Safety {
    /// Records a probe of `what` at `now`: `ok` or not. Returns how long the outage that just
    /// ended lasted, if one did.
    pub fn probed(&self, what: &str, ok: bool, now: Time) -> Option<Duration> {
        let mut s = lock(&self.state);
        let at = s.down.iter().position(|(w, _)| *w == what);
        match (ok, at) {
            (false, None) => {
                s.down.push((what.to_string(), now));
                None
            }
            (true, Some(i)) => {
                let (_, since) = s.down.remove(i);
                let lasted = (now - since).to_std().unwrap_or_default();
                s.last = Some((now, lasted));
                Some(lasted)
            }
            _ => None,
        }
    }

    /// What cannot be reached now (for at least one probe interval), in words.
    pub fn unreachable(&self) -> Option<String> {
        let s = lock(&self.state);
        s.down.first().map(|(what, since)| {
            format!("{what} unreachable since {}", since.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
        })
    }

    /// Health timers of a check whose shortest timeout is `timeout` count from here at the
    /// earliest: the end of the last outage, if it lasted as long as that timeout or [`OUTAGE`].
    pub fn timers_since(&self, timeout: Duration) -> Option<Time> {
        let s = lock(&self.state);
        s.last.filter(|(_, lasted)| *lasted >= timeout.min(OUTAGE)).map(|(end, _)| end)
    }
}

/// Probes `client`'s API server as `what` every [`PROBE_INTERVAL`] until dropped, recording in
/// `safety` (and in `calls`, for a target cluster: its calls fail at once while it is down).
pub async fn probe(
    safety: std::sync::Arc<Safety>,
    what: String,
    client: kube::Client,
    calls: Option<std::sync::Arc<crate::nodes::calls::Calls>>,
) {
    let what = what.as_str();
    loop {
        let ok = matches!(tokio::time::timeout(PROBE_INTERVAL, client.apiserver_version()).await, Ok(Ok(_)));
        if let Some(calls) = &calls {
            calls.set_down(!ok);
        }
        if let Some(lasted) = safety.probed(what, ok, chrono::Utc::now()) {
            tracing::warn!(
                "{what} was unreachable for {}s: the timers of health checks with a timeout up to that \
                 (any, past {}s) start over",
                lasted.as_secs(),
                OUTAGE.as_secs()
            );
        } else if !ok {
            tracing::debug!("{what} did not answer a probe");
        }
        tokio::time::sleep(PROBE_INTERVAL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_as_long_as_a_timeout_restarts_that_checks_timers() {
        let s = Safety::default();
        let t = chrono::Utc::now();
        let at = |secs: i64| t + chrono::Duration::seconds(secs);
        let secs = Duration::from_secs;
        assert!(s.probed("the target cluster", true, at(0)).is_none());
        assert!(s.unreachable().is_none());
        assert!(s.probed("the target cluster", false, at(5)).is_none());
        assert!(s.unreachable().unwrap().starts_with("the target cluster unreachable since"));
        assert!(s.probed("the target cluster", false, at(10)).is_none(), "still down: the first failure counts");
        assert_eq!(s.probed("the target cluster", true, at(20)), Some(secs(15)));
        assert_eq!(s.timers_since(secs(10)), Some(at(20)), "15 s is longer than a 10 s timeout");
        assert_eq!(s.timers_since(secs(300)), None, "but shorter than a 300 s one, and than 30 s");
        s.probed("the store's API server", false, at(30));
        assert_eq!(s.probed("the store's API server", true, at(65)), Some(secs(35)));
        assert_eq!(s.timers_since(secs(600)), Some(at(65)), "30 s or more restarts every timer");
        assert!(s.unreachable().is_none());
    }
}
