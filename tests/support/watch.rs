//! Invariants watched at every event: the namespace's Machines through a watch on the API
//! server, a number computed from the whole set after each event, and the most it ever was.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use kube::api::{Api, DynamicObject};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::watcher;
use machine_controller::resources::*;
use machine_controller::store::kubernetes::trimmed;

use crate::world::World;

/// Whether a Machine serves: Running, its Node Ready, not being deleted.
pub fn available(m: &Machine) -> bool {
    m.status.phase == Phase::Running
        && !m.is_deleting()
        && condition(&m.status.conditions, ConditionType::NodeReady).is_some_and(|c| c.status == ConditionStatus::True)
}

/// Watches the namespace's Machines and keeps the most `f` ever returned for them, computed
/// after every event (a relist counts once it is whole).
pub struct Most {
    most: Arc<Mutex<i64>>,
    task: tokio::task::JoinHandle<()>,
}

impl Most {
    /// Starts watching.
    pub fn watch(w: &World, f: impl Fn(&BTreeMap<String, Machine>) -> i64 + Send + 'static) -> Self {
        let gvk = GroupVersionKind::gvk("machine.driver.dev", "v1alpha1", "Machine");
        let ar = ApiResource::from_gvk_with_plural(&gvk, "machines");
        let api = Api::<DynamicObject>::namespaced_with(w.cluster().client.clone(), w.ns(), &ar);
        let most = Arc::new(Mutex::new(i64::MIN));
        let seen = most.clone();
        let task = tokio::spawn(async move {
            let mut machines: BTreeMap<String, Machine> = BTreeMap::new();
            let mut events = std::pin::pin!(watcher(api, watcher::Config::default()));
            while let Some(event) = events.next().await {
                let parse = |o: DynamicObject| {
                    let v = trimmed(Kind::Machine, serde_json::to_value(o).ok()?)?;
                    serde_json::from_value::<Machine>(v).ok()
                };
                match event {
                    Ok(watcher::Event::Init) => {
                        machines.clear();
                        continue;
                    }
                    Ok(watcher::Event::InitApply(o)) => {
                        if let Some(m) = parse(o) {
                            machines.insert(m.metadata.name.clone(), m);
                        }
                        continue;
                    }
                    Ok(watcher::Event::InitDone) => {}
                    Ok(watcher::Event::Apply(o)) => {
                        if let Some(m) = parse(o) {
                            machines.insert(m.metadata.name.clone(), m);
                        }
                    }
                    Ok(watcher::Event::Delete(o)) => {
                        if let Some(m) = parse(o) {
                            machines.remove(&m.metadata.name);
                        }
                    }
                    Err(_) => continue,
                }
                let value = f(&machines);
                let mut most = seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                *most = (*most).max(value);
            }
        });
        Most { most, task }
    }

    /// Machines unavailable at once: `replicas − available`, at most.
    pub fn unavailable(w: &World, replicas: i64) -> Self {
        Self::watch(w, move |machines| replicas - machines.values().filter(|m| available(m)).count() as i64)
    }

    /// The most so far (`i64::MIN` before the first whole list).
    pub fn most(&self) -> i64 {
        *self.most.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for Most {
    fn drop(&mut self) {
        self.task.abort();
    }
}
