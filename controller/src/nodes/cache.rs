//! The target cluster's Nodes, held in memory from one watch, indexed by name and by normalized
//! provider ID; and which Machine waits for which Node, so a Node's change wakes its Machine.
//!
//! Only what the controller decides on is kept of each Node ([`NodeView`]: identity, provider
//! ID, readiness, schedulability, labels, annotations, taints) — not images, capacity or
//! managed fields — and its resourceVersion, which guards the controller's writes of the
//! taints. A change of the resourceVersion alone (a status heartbeat) is kept but wakes no one.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};

use k8s_openapi::api::core::v1::{Node, Taint};

use super::provider_id::normalize;
use crate::store::Key;

/// A Node's `Ready` condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// `Ready=True`.
    Ready,
    /// `Ready=False`.
    NotReady,
    /// `Ready=Unknown` (the kubelet stopped reporting), or no `Ready` condition yet.
    Unknown,
}

/// What the controller keeps of a Node.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeView {
    /// What a Machine's `status.nodeRef.name` names.
    pub name: String,
    /// A Node re-created under the same name has another uid: it is another node.
    pub uid: String,
    /// `spec.providerID` as written.
    pub provider_id: String,
    /// Its `Ready` condition.
    pub readiness: Readiness,
    /// `spec.unschedulable`.
    pub unschedulable: bool,
    /// As on the Node, to compare with a machine template's `nodeTemplate.labels`.
    pub labels: BTreeMap<String, String>,
    /// As on the Node: deletion hooks' and the controller's own annotations, and a template's.
    pub annotations: BTreeMap<String, String>,
    /// As on the Node: a template's, the draining taint, anyone else's.
    pub taints: Vec<Taint>,
    /// Being deleted.
    pub deleting: bool,
    /// `status.nodeInfo.bootID`: a reboot changes it.
    pub boot_id: String,
    /// `metadata.resourceVersion` of the Node this view was taken from: a write that replaces a
    /// list (the taints) carries it, so it fails with a conflict if the Node changed since.
    pub resource_version: String,
    /// A True `PreemptionScheduled` or `VMEventScheduled` condition (node-problem-detector's
    /// reading of Azure's Scheduled Events): an interruption the Node announces.
    pub scheduled: Option<super::scheduled::ScheduledEvent>,
}

impl NodeView {
    /// The view of a Node; `None` for a Node without a name.
    pub fn of(node: &Node) -> Option<Self> {
        let name = node.metadata.name.clone()?;
        let name_for_events = name.clone();
        let spec = node.spec.as_ref();
        let readiness = node
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
            .map_or(Readiness::Unknown, |c| match c.status.as_str() {
                "True" => Readiness::Ready,
                "False" => Readiness::NotReady,
                _ => Readiness::Unknown,
            });
        Some(Self {
            name,
            uid: node.metadata.uid.clone().unwrap_or_default(),
            provider_id: spec.and_then(|s| s.provider_id.clone()).unwrap_or_default(),
            readiness,
            unschedulable: spec.and_then(|s| s.unschedulable).unwrap_or(false),
            labels: node.metadata.labels.clone().unwrap_or_default(),
            annotations: node.metadata.annotations.clone().unwrap_or_default(),
            taints: spec.and_then(|s| s.taints.clone()).unwrap_or_default(),
            deleting: node.metadata.deletion_timestamp.is_some(),
            boot_id: node
                .status
                .as_ref()
                .and_then(|s| s.node_info.as_ref())
                .map(|i| i.boot_id.clone())
                .unwrap_or_default(),
            resource_version: node.metadata.resource_version.clone().unwrap_or_default(),
            scheduled: node
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_deref())
                .and_then(|cs| super::scheduled::of(&name_for_events, cs)),
        })
    }

    /// Whether `other` says the same of the Node, whatever its resourceVersion: then nothing
    /// the controller decides on changed (a status heartbeat, say).
    pub fn same_as(&self, other: &NodeView) -> bool {
        // Every field by name, so a new one is compared too.
        let NodeView {
            name,
            uid,
            provider_id,
            readiness,
            unschedulable,
            labels,
            annotations,
            taints,
            deleting,
            boot_id,
            resource_version: _,
            scheduled,
        } = self;
        *name == other.name
            && *uid == other.uid
            && *provider_id == other.provider_id
            && *readiness == other.readiness
            && *unschedulable == other.unschedulable
            && *labels == other.labels
            && *annotations == other.annotations
            && *taints == other.taints
            && *deleting == other.deleting
            && *boot_id == other.boot_id
            && *scheduled == other.scheduled
    }

    /// Whether it is Ready.
    pub fn is_ready(&self) -> bool {
        self.readiness == Readiness::Ready
    }

    /// Whether it carries a taint with this key and effect.
    pub fn has_taint(&self, key: &str, effect: &str) -> bool {
        self.taints.iter().any(|t| t.key == key && t.effect == effect)
    }
}

/// What a lookup of a Machine's Node found.
#[derive(Debug, Clone, PartialEq)]
pub enum Lookup {
    /// The first list of Nodes has not arrived: nothing can be said yet.
    NotSynced,
    /// No such Node.
    Missing,
    /// The Node.
    Found(Arc<NodeView>),
}

#[derive(Default)]
struct Inner {
    synced: bool,
    nodes: HashMap<String, Arc<NodeView>>,
    /// Normalized provider ID → node name.
    by_provider: HashMap<String, String>,
    /// Nodes of a list in progress (a watch that restarts lists everything again).
    relist: Option<HashMap<String, Arc<NodeView>>>,
    /// Normalized provider ID → the Machine whose VM it is.
    machine_by_provider: HashMap<String, Key>,
    /// Node name the driver reported → the Machine.
    machine_by_name: HashMap<String, Key>,
    /// Machine → what it is linked by (to unlink).
    links: HashMap<Key, (String, String)>,
}

impl Inner {
    fn index(&mut self, view: Arc<NodeView>) {
        let pid = normalize(&view.provider_id);
        if let Some(old) = self.nodes.get(&view.name) {
            let old_pid = normalize(&old.provider_id);
            if old_pid != pid {
                self.by_provider.remove(&old_pid);
            }
        }
        if !pid.is_empty() {
            self.by_provider.insert(pid, view.name.clone());
        }
        self.nodes.insert(view.name.clone(), view);
    }

    fn unindex(&mut self, name: &str) -> Option<Arc<NodeView>> {
        let old = self.nodes.remove(name)?;
        let pid = normalize(&old.provider_id);
        if self.by_provider.get(&pid).is_some_and(|n| n == name) {
            self.by_provider.remove(&pid);
        }
        Some(old)
    }

    /// The Machines a change of this Node concerns.
    fn machines_of(&self, view: &NodeView) -> Vec<Key> {
        let mut keys = Vec::new();
        if let Some(k) = self.machine_by_provider.get(&normalize(&view.provider_id)) {
            keys.push(k.clone());
        }
        if let Some(k) = self.machine_by_name.get(&view.name) {
            if !keys.contains(k) {
                keys.push(k.clone());
            }
        }
        keys
    }
}

/// The Nodes of the target cluster, kept current by [`super::watch`].
#[derive(Default)]
pub struct NodeCache {
    inner: RwLock<Inner>,
}

impl NodeCache {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        self.inner.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        self.inner.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The Node of a machine: by provider ID; else by the node name the driver reported, if
    /// that Node has no provider ID yet or the same one (a Node named alike that is another
    /// VM's is never taken).
    pub fn find(&self, provider_id: &str, node_name: &str) -> Lookup {
        let inner = self.read();
        if !inner.synced {
            return Lookup::NotSynced;
        }
        let pid = normalize(provider_id);
        if let Some(view) = inner.by_provider.get(&pid).and_then(|n| inner.nodes.get(n)).filter(|_| !pid.is_empty()) {
            return Lookup::Found(view.clone());
        }
        match inner.nodes.get(node_name) {
            Some(view) if view.provider_id.is_empty() || normalize(&view.provider_id) == pid => {
                Lookup::Found(view.clone())
            }
            _ => Lookup::Missing,
        }
    }

    /// The Node of this name.
    pub fn get(&self, name: &str) -> Option<Arc<NodeView>> {
        self.read().nodes.get(name).cloned()
    }

    /// Every Node (for tests and the CLI).
    pub fn len(&self) -> usize {
        self.read().nodes.len()
    }

    /// Whether no Node is known.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records that `machine`'s VM has this provider ID and node name, so the Node's changes
    /// wake it.
    pub fn link(&self, machine: &Key, provider_id: &str, node_name: &str) {
        let pid = normalize(provider_id);
        {
            let inner = self.read();
            if inner.links.get(machine).is_some_and(|(p, n)| *p == pid && n == node_name) {
                return;
            }
        }
        let mut inner = self.write();
        if let Some((p, n)) = inner.links.remove(machine) {
            inner.machine_by_provider.remove(&p);
            inner.machine_by_name.remove(&n);
        }
        if !pid.is_empty() {
            inner.machine_by_provider.insert(pid.clone(), machine.clone());
        }
        if !node_name.is_empty() {
            inner.machine_by_name.insert(node_name.to_string(), machine.clone());
        }
        inner.links.insert(machine.clone(), (pid, node_name.to_string()));
    }

    /// Forgets `machine`'s link (it is gone).
    pub fn unlink(&self, machine: &Key) {
        let mut inner = self.write();
        if let Some((p, n)) = inner.links.remove(machine) {
            if inner.machine_by_provider.get(&p) == Some(machine) {
                inner.machine_by_provider.remove(&p);
            }
            if inner.machine_by_name.get(&n) == Some(machine) {
                inner.machine_by_name.remove(&n);
            }
        }
    }

    /// A Node was added or changed: the Machines to wake (none when only its resourceVersion
    /// changed; the view still takes the new one).
    pub fn apply(&self, node: &Node) -> Vec<Key> {
        let Some(view) = NodeView::of(node) else { return Vec::new() };
        let mut inner = self.write();
        let old = inner.nodes.get(&view.name);
        if old.is_some_and(|old| **old == view) {
            return Vec::new();
        }
        let keys = if old.is_some_and(|old| old.same_as(&view)) { Vec::new() } else { inner.machines_of(&view) };
        inner.index(Arc::new(view));
        keys
    }

    /// A Node was deleted: the Machines to wake.
    pub fn delete(&self, node: &Node) -> Vec<Key> {
        let Some(name) = node.metadata.name.as_deref() else { return Vec::new() };
        let mut inner = self.write();
        match inner.unindex(name) {
            Some(old) => inner.machines_of(&old),
            None => Vec::new(),
        }
    }

    /// A (re)list begins.
    pub fn relist_begin(&self) {
        self.write().relist = Some(HashMap::new());
    }

    /// A Node of the list in progress.
    pub fn relist_apply(&self, node: &Node) {
        if let Some(view) = NodeView::of(node) {
            let mut inner = self.write();
            inner.relist.get_or_insert_with(HashMap::new).insert(view.name.clone(), Arc::new(view));
        }
    }

    /// The list is complete: it replaces what was known; the Machines of every Node that
    /// changed, appeared or disappeared are woken.
    pub fn relist_done(&self) -> Vec<Key> {
        let mut inner = self.write();
        let fresh = inner.relist.take().unwrap_or_default();
        let mut keys = Vec::new();
        let gone: Vec<String> = inner.nodes.keys().filter(|n| !fresh.contains_key(*n)).cloned().collect();
        for name in gone {
            if let Some(old) = inner.unindex(&name) {
                keys.extend(inner.machines_of(&old));
            }
        }
        for (name, view) in fresh {
            let old = inner.nodes.get(&name);
            if old.is_some_and(|old| *old == view) {
                continue;
            }
            if !old.is_some_and(|old| old.same_as(&view)) {
                keys.extend(inner.machines_of(&view));
            }
            inner.index(view);
        }
        inner.synced = true;
        keys.sort();
        keys.dedup();
        keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::Kind;

    fn node(name: &str, provider_id: &str, ready: &str) -> Node {
        node_at(name, provider_id, ready, "1")
    }

    fn node_at(name: &str, provider_id: &str, ready: &str, resource_version: &str) -> Node {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "uid": format!("uid-{name}"), "resourceVersion": resource_version},
            "spec": {"providerID": provider_id},
            "status": {"conditions": [{"type": "Ready", "status": ready}]}
        }))
        .unwrap()
    }

    fn key(name: &str) -> Key {
        Key::new(Kind::Machine, "default", name)
    }

    #[test]
    fn nothing_is_missing_before_the_first_list() {
        let cache = NodeCache::default();
        assert_eq!(cache.find("fake:///zone-a/1", "m1"), Lookup::NotSynced);
        cache.relist_begin();
        cache.relist_apply(&node("m1", "fake:///zone-a/1", "True"));
        assert_eq!(cache.find("fake:///zone-a/1", "m1"), Lookup::NotSynced, "the list is not complete");
        cache.relist_done();
        assert!(matches!(cache.find("fake:///zone-a/1", "x"), Lookup::Found(v) if v.is_ready()));
        assert_eq!(cache.find("fake:///zone-a/2", "m2"), Lookup::Missing);
    }

    #[test]
    fn a_node_is_found_by_provider_id_or_by_name_but_never_another_vms() {
        let cache = NodeCache::default();
        cache.relist_begin();
        cache.relist_apply(&node("by-pid", "azure:///subscriptions/s/resourcegroups/rg/providers/x/vm1", "True"));
        cache.relist_apply(&node("no-pid-yet", "", "False"));
        cache.relist_apply(&node("other", "fake:///zone-a/other", "True"));
        cache.relist_done();
        let found = |pid, name| match cache.find(pid, name) {
            Lookup::Found(v) => Some(v.name.clone()),
            _ => None,
        };
        assert_eq!(found("azure:///subscriptions/s/resourceGroups/RG/providers/x/vm1", ""), Some("by-pid".into()));
        assert_eq!(found("fake:///zone-a/7", "no-pid-yet"), Some("no-pid-yet".into()));
        assert_eq!(found("fake:///zone-a/7", "other"), None, "named alike, but another VM's node");
    }

    #[test]
    fn a_node_change_wakes_the_machine_linked_to_it() {
        let cache = NodeCache::default();
        cache.relist_begin();
        assert!(cache.relist_done().is_empty());
        cache.link(&key("m1"), "fake:///zone-a/1", "m1");
        cache.link(&key("m2"), "fake:///zone-a/2", "m2");
        assert_eq!(cache.apply(&node("m1", "fake:///zone-a/1", "False")), vec![key("m1")]);
        assert!(cache.apply(&node("m1", "fake:///zone-a/1", "False")).is_empty(), "no change, no wake");
        assert_eq!(cache.apply(&node("m1", "fake:///zone-a/1", "True")), vec![key("m1")]);
        // Registered under the reported name before its provider ID was set.
        assert_eq!(cache.apply(&node("m2", "", "Unknown")), vec![key("m2")]);
        assert_eq!(cache.delete(&node("m1", "fake:///zone-a/1", "True")), vec![key("m1")]);
        cache.unlink(&key("m2"));
        assert!(cache.apply(&node("m2", "fake:///zone-a/2", "True")).is_empty());
    }

    #[test]
    fn a_heartbeat_refreshes_the_resource_version_and_wakes_no_one() {
        let cache = NodeCache::default();
        cache.relist_begin();
        cache.relist_apply(&node_at("m1", "fake:///zone-a/1", "True", "10"));
        cache.relist_done();
        cache.link(&key("m1"), "fake:///zone-a/1", "m1");
        assert!(cache.apply(&node_at("m1", "fake:///zone-a/1", "True", "11")).is_empty(), "only the version changed");
        assert_eq!(cache.get("m1").unwrap().resource_version, "11", "the view carries the newest version");
        assert_eq!(cache.apply(&node_at("m1", "fake:///zone-a/1", "False", "12")), vec![key("m1")]);
        cache.relist_begin();
        cache.relist_apply(&node_at("m1", "fake:///zone-a/1", "False", "13"));
        assert!(cache.relist_done().is_empty(), "a relist with only a new version wakes no one");
        assert_eq!(cache.get("m1").unwrap().resource_version, "13");
    }

    #[test]
    fn a_relist_wakes_the_machines_of_nodes_that_changed_or_went() {
        let cache = NodeCache::default();
        cache.link(&key("m1"), "fake:///zone-a/1", "m1");
        cache.link(&key("m2"), "fake:///zone-a/2", "m2");
        cache.link(&key("m3"), "fake:///zone-a/3", "m3");
        cache.relist_begin();
        cache.relist_apply(&node("m1", "fake:///zone-a/1", "True"));
        cache.relist_apply(&node("m2", "fake:///zone-a/2", "True"));
        assert_eq!(cache.relist_done(), vec![key("m1"), key("m2")]);
        cache.relist_begin();
        cache.relist_apply(&node("m1", "fake:///zone-a/1", "True"));
        cache.relist_apply(&node("m3", "fake:///zone-a/3", "True"));
        assert_eq!(cache.relist_done(), vec![key("m2"), key("m3")], "m2 went, m3 came, m1 is unchanged");
        assert_eq!(cache.len(), 2);
    }
}
