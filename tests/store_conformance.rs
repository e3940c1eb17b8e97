//! The store conformance suite (`machine_controller::store::conformance`) against the Kubernetes
//! backend on a real kube-apiserver + etcd with the CRDs installed: the same cases the controller's
//! unit tests run against SQLite, each a test of its own, each in a namespace of its own.
//!
//! The cases share one API server: they run on one Tokio runtime (the server's client and
//! processes belong to it), and the server runs while any case does; the last case to finish
//! stops it (as `aws_support::Moto::shared` does).

use std::sync::{Arc, LazyLock, Weak};
use std::time::Duration;

use e2e_tests::kube_cluster::Cluster;
use machine_controller::store::conformance::{self, Subject};
use machine_controller::store::kubernetes::KubernetesBackend;
use machine_controller::store::Store;

static RUNTIME: LazyLock<tokio::runtime::Runtime> = LazyLock::new(|| {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("a Tokio runtime")
});

static SHARED: tokio::sync::Mutex<Weak<Cluster>> = tokio::sync::Mutex::const_new(Weak::new());

/// The running shared API server, or a new one.
async fn cluster() -> Arc<Cluster> {
    // Held across the start, so two cases do not start two servers.
    let mut shared = SHARED.lock().await;
    if let Some(cluster) = shared.upgrade() {
        return cluster;
    }
    let cluster = Arc::new(Cluster::start().await);
    *shared = Arc::downgrade(&cluster);
    cluster
}

/// Runs one case against a Kubernetes store watching a fresh namespace.
fn run(name: &str, case: impl AsyncFnOnce(&Subject) -> conformance::Outcome) {
    let cluster = RUNTIME.block_on(cluster());
    let outcome = RUNTIME.block_on(async {
        let namespace = tokio::time::timeout(Duration::from_secs(60), cluster.namespace("store"))
            .await
            .expect("a namespace within 60 s");
        let backend = KubernetesBackend::new(cluster.client.clone(), Some(namespace.clone()));
        // The backend (and its watches) goes within the runtime.
        case(&Subject { store: Store::new(Arc::new(backend)), namespace }).await
    });
    {
        let _runtime = RUNTIME.enter();
        drop(cluster);
    }
    if let Err(why) = outcome {
        panic!("{name}: {why}");
    }
}

macro_rules! cases {
    ($($case:ident),* $(,)?) => {$(
        #[test]
        fn $case() {
            run(stringify!($case), conformance::$case);
        }
    )*};
}

machine_controller::store_conformance_cases!(cases);

/// Only on the API server: repeats of one event on one object are one Event whose series count
/// grows (as client-go's recorder does), not one Event each.
#[test]
fn repeated_events_are_one_series_on_the_api_server() {
    use machine_controller::resources::Kind;
    use machine_controller::store::{Event, Key};
    run("repeated_events_are_one_series_on_the_api_server", async |s: &Subject| {
        let key = Key::new(Kind::MachineClass, &s.namespace, "flaky");
        let event = || Event {
            key: key.clone(),
            event_type: "Warning".into(),
            reason: "OperationFailed".into(),
            message: "the cloud said no".into(),
            time: chrono::Utc::now(),
        };
        for _ in 0..2 {
            s.store.backend().record_event(event()).await.map_err(|e| format!("record: {e}"))?;
        }
        // Posted in the background: wait (bounded) for the series to show.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let events = s.store.backend().events(&key, 10).await.map_err(|e| format!("events: {e}"))?;
            let messages: Vec<&str> = events.iter().map(|e| e.message.as_str()).collect();
            if messages == ["the cloud said no (x2)"] {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(format!("events after two repeats: {messages:?}, want one series of 2"));
            }
            // Deliberate: the interval between polls of a condition with a deadline.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}
