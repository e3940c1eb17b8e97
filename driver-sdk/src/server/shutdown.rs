//! Stopping: SIGTERM / SIGINT or the caller's future stops accepting, health turns NOT_SERVING,
//! and in-flight calls drain for at most the drain timeout.

use std::future::Future;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::watch;

use super::error::ServeError;
use super::routes::Health;

/// The future that stops accepting connections, and a handle that tells when it fired.
///
/// The future resolves on SIGTERM / SIGINT or when `external` resolves; before resolving it
/// marks `health` draining.
pub(super) fn signal(
    external: Option<BoxFuture<'static, ()>>,
    health: Health,
) -> (impl Future<Output = ()> + Send + 'static, Stopped) {
    let (stop_tx, stop_rx) = watch::channel(false);
    let signal = async move {
        let why = match external {
            Some(f) => tokio::select! { w = os_signal() => w, () = f => "shutdown requested" },
            None => os_signal().await,
        };
        tracing::info!("{why}: draining in-flight calls");
        health.drain().await;
        let _ = stop_tx.send(true);
    };
    (signal, Stopped(stop_rx))
}

/// Tells when the [`signal`] fired.
#[derive(Clone)]
pub(super) struct Stopped(watch::Receiver<bool>);

impl Stopped {
    /// Resolves once the server stopped accepting.
    pub(super) async fn wait(mut self) {
        let _ = self.0.wait_for(|s| *s).await;
    }

    /// Runs `served` (the server, which ends once in-flight calls finished) but for at most
    /// `drain_timeout` after the signal: the calls still running then are closed.
    pub(super) async fn drain_bounded(
        self,
        served: impl Future<Output = Result<(), tonic::transport::Error>>,
        drain_timeout: Duration,
    ) -> Result<(), ServeError> {
        let deadline = async move {
            self.wait().await;
            tokio::time::sleep(drain_timeout).await;
        };
        tokio::select! {
            r = served => r.map_err(ServeError::Transport),
            () = deadline => {
                tracing::warn!("drain timeout passed; closing remaining calls");
                Ok(())
            }
        }
    }
}

async fn os_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(mut term), Ok(mut int)) => tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        },
        _ => {
            // Without signal handlers we can only wait for the other shutdown source.
            futures::future::pending::<()>().await;
            "unreachable"
        }
    }
}
