//! The application's context: what the controller's reconcilers share beside the runtime's
//! part ([`crate::runtime::Ctx`]): the drivers, the target cluster, the orphans seen, the
//! safety checks, and what a class's users were last woken for. The runtime never reads it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::registry::Registry;
use tokio::time::Instant;

use crate::runtime::drivers::{self, DriverHandle};
use crate::runtime::keys::GiveBackRoom;
use crate::runtime::{self, Config};
use crate::store::{Key, Store};

/// The context the controller's reconcilers get: the runtime's part with [`App`].
pub type Ctx = runtime::Ctx<App>;

/// The controller's settings, beside the runtime's ([`Config`]).
#[derive(Debug, Clone)]
pub struct Settings {
    /// How often a Running machine's status is checked.
    pub health_check_interval: Duration,
    /// How often each class is listed for orphans.
    pub orphan_interval: Duration,
    /// How long an orphan is left alone before it is deleted.
    pub orphan_grace: Duration,
    /// The tag value that marks cloud machines as this controller's.
    pub controller_id: String,
    /// How often a drain looks at its node's pods again (and evicts those still there).
    pub drain_poll_interval: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            health_check_interval: crate::defaults::HEALTH_CHECK_INTERVAL,
            orphan_interval: crate::defaults::ORPHAN_INTERVAL,
            orphan_grace: crate::defaults::ORPHAN_GRACE,
            controller_id: crate::defaults::CONTROLLER_ID.into(),
            drain_poll_interval: crate::defaults::DRAIN_POLL_INTERVAL,
        }
    }
}

/// The application's part of the context ([`runtime::Ctx::app`]).
pub struct App {
    /// Settings.
    pub settings: Settings,
    /// Drivers by name ([`App::driver`]).
    drivers: HashMap<String, DriverHandle>,
    /// The cluster where the machines' Nodes live; `None`: nodes are not managed.
    pub target: Option<Arc<crate::nodes::Target>>,
    /// Cloud machines without a Machine, and when they were first seen.
    pub orphans: Mutex<HashMap<(String, String), Instant>>,
    /// Whether the API servers it depends on answer, and when health timers start.
    pub safety: Arc<crate::safety::Safety>,
    /// The generation at which the objects that depend on a key (a class's machines) were last
    /// woken: its own status writes must not wake them (that would undo their backoff in a
    /// loop). An entry goes when its object is deleted ([`App::forget`]).
    dependents_woken_at: Mutex<HashMap<Key, i64>>,
}

impl App {
    /// The controller's context; `drivers` maps names to endpoints (the runtime's settings,
    /// `config`, hold their rate limit and call deadline).
    ///
    /// # Errors
    /// A malformed endpoint.
    pub fn context(
        store: Store,
        drivers: &[(String, String)],
        config: Config,
        settings: Settings,
        registry: &mut Registry,
        target: Option<crate::nodes::Target>,
    ) -> Result<Arc<Ctx>, driver_sdk::endpoint::EndpointError> {
        let app = App {
            settings,
            drivers: drivers::connect(drivers, &config)?,
            target: target.map(Arc::new),
            orphans: Mutex::new(HashMap::new()),
            safety: Arc::default(),
            dependents_woken_at: Mutex::new(HashMap::new()),
        };
        let ctx = runtime::Ctx::new(store, config, registry, app);
        if let Some(target) = &ctx.app.target {
            target.report_to(ctx.metrics.target_calls.clone());
        }
        Ok(ctx)
    }

    /// The driver named `name` (as a class names it), if the controller runs with it.
    pub fn driver(&self, name: &str) -> Option<&DriverHandle> {
        self.drivers.get(name)
    }

    /// The names of the drivers the controller runs with, sorted.
    pub fn driver_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.drivers.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    /// Whether the objects that depend on `key` are to be woken for its `generation`: `true`
    /// the first time a generation is seen (a new spec), `false` for the same one again (the
    /// object's own status writes).
    pub fn dependents_due(&self, key: &Key, generation: i64) -> bool {
        let mut woken = self.dependents_woken_at.lock().unwrap_or_else(|p| p.into_inner());
        woken.insert(key.clone(), generation) != Some(generation)
    }

    /// Forgets what is kept for `key` (it was deleted; an object re-created under its name
    /// starts afresh).
    pub fn forget(&self, key: &Key) {
        let mut woken = self.dependents_woken_at.lock().unwrap_or_else(|p| p.into_inner());
        if woken.remove(key).is_some() {
            woken.give_back_room();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::Kind;

    #[tokio::test]
    async fn a_class_wakes_its_users_once_per_generation_and_afresh_once_re_created() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("s.db")).unwrap();
        let ctx =
            App::context(store, &[], Config::default(), Settings::default(), &mut Registry::default(), None).unwrap();
        let class = Key::new(Kind::MachineClass, "default", "small");
        assert!(ctx.app.dependents_due(&class, 1), "a new class wakes what uses it");
        assert!(!ctx.app.dependents_due(&class, 1), "its own status writes do not");
        assert!(ctx.app.dependents_due(&class, 2), "a new spec does");
        ctx.app.forget(&class);
        // Deleted and created again at generation 1: its users are woken again.
        assert!(ctx.app.dependents_due(&class, 1));
        ctx.app.forget(&class);
        assert!(ctx.app.dependents_woken_at.lock().unwrap().is_empty(), "nothing is kept for a forgotten key");
    }
}
