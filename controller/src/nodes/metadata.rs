//! Node metadata from the machine template: the labels, annotations and taints a template
//! declares are kept on the Node; the keys the controller put there are recorded on the Node
//! (annotation [`ANNOTATION_OWNED_NODE_METADATA`]), so a key removed from the template is
//! removed from the Node while keys that others added stay (Cluster API's
//! `labels-from-machine`, MCM's last-applied annotation). A Node may register with
//! [`TAINT_UNINITIALIZED`]; it is lifted once the metadata is applied.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Taint;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::NodeView;
use crate::resources::{NodeTemplate, ANNOTATION_OWNED_NODE_METADATA};

/// The startup taint a Node may register with (kubelet `--register-with-taints`); the controller
/// removes it once the template's metadata is on the Node.
pub const TAINT_UNINITIALIZED: &str = "machine.driver.dev/uninitialized";

/// The keys the controller owns on a Node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owned {
    /// Label keys.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub labels: BTreeSet<String>,
    /// Annotation keys.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub annotations: BTreeSet<String>,
    /// Taints, as `key:effect`.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub taints: BTreeSet<String>,
}

fn taint_id(key: &str, effect: &str) -> String {
    format!("{key}:{effect}")
}

/// The JSON merge patch that brings `node` to `desired` (`None` when it is there already):
/// template keys set, keys owned before but no longer in the template removed, others' keys and
/// taints untouched, the startup taint lifted, and the owned keys recorded.
pub fn patch(node: &NodeView, desired: &NodeTemplate) -> Option<Value> {
    let before: Owned = node
        .annotations
        .get(ANNOTATION_OWNED_NODE_METADATA)
        .and_then(|s| serde_json::from_str(s).ok())
        .unwrap_or_default();
    let owned = Owned {
        labels: desired.labels.keys().cloned().collect(),
        annotations: desired.annotations.keys().cloned().collect(),
        taints: desired.taints.iter().map(|t| taint_id(&t.key, t.effect.as_str())).collect(),
    };
    let mut labels = serde_json::Map::new();
    for (k, v) in &desired.labels {
        if node.labels.get(k) != Some(v) {
            labels.insert(k.clone(), json!(v));
        }
    }
    for k in before.labels.difference(&owned.labels) {
        if node.labels.contains_key(k) {
            labels.insert(k.clone(), Value::Null);
        }
    }
    let mut annotations = serde_json::Map::new();
    for (k, v) in &desired.annotations {
        if node.annotations.get(k) != Some(v) {
            annotations.insert(k.clone(), json!(v));
        }
    }
    for k in before.annotations.difference(&owned.annotations) {
        if node.annotations.contains_key(k) {
            annotations.insert(k.clone(), Value::Null);
        }
    }
    let record = serde_json::to_string(&owned).unwrap_or_default();
    let recorded = node.annotations.get(ANNOTATION_OWNED_NODE_METADATA);
    // Nothing owned, nothing recorded: no record needed.
    if recorded != Some(&record) && !(recorded.is_none() && owned == Owned::default()) {
        annotations.insert(ANNOTATION_OWNED_NODE_METADATA.into(), json!(record));
    }
    // Taints: others' kept in place; ours replaced by the template's; the startup taint lifted.
    let mut taints: Vec<Taint> = node
        .taints
        .iter()
        .filter(|t| t.key != TAINT_UNINITIALIZED && !before.taints.contains(&taint_id(&t.key, &t.effect)))
        .filter(|t| !owned.taints.contains(&taint_id(&t.key, &t.effect)))
        .cloned()
        .collect();
    for t in &desired.taints {
        taints.push(Taint {
            key: t.key.clone(),
            value: (!t.value.is_empty()).then(|| t.value.clone()),
            effect: t.effect.to_string(),
            time_added: None,
        });
    }
    let same_taints = {
        let ids = |ts: &[Taint]| -> BTreeMap<String, Option<String>> {
            ts.iter().map(|t| (taint_id(&t.key, &t.effect), t.value.clone())).collect()
        };
        ids(&taints) == ids(&node.taints)
    };
    if labels.is_empty() && annotations.is_empty() && same_taints {
        return None;
    }
    let mut metadata = serde_json::Map::new();
    if !labels.is_empty() {
        metadata.insert("labels".into(), Value::Object(labels));
    }
    if !annotations.is_empty() {
        metadata.insert("annotations".into(), Value::Object(annotations));
    }
    // The node's uid guards against a Node re-created under the same name meanwhile.
    metadata.insert("uid".into(), json!(node.uid));
    if !same_taints && !node.resource_version.is_empty() {
        // The taints are a list the API replaces whole: a taint someone added since `node` was
        // seen would be lost, so the API server answers 409 instead if the Node changed.
        metadata.insert("resourceVersion".into(), json!(node.resource_version));
    }
    let mut patch = json!({ "metadata": metadata });
    if !same_taints {
        patch["spec"] = json!({ "taints": taints });
    }
    Some(patch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::NodeTaint;

    fn node(labels: &[(&str, &str)], annotations: &[(&str, &str)], taints: &[(&str, &str)]) -> NodeView {
        let map = |kv: &[(&str, &str)]| kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        NodeView {
            name: "n1".into(),
            uid: "u1".into(),
            provider_id: "fake:///zone-a/1".into(),
            readiness: super::super::Readiness::Ready,
            unschedulable: false,
            labels: map(labels),
            annotations: map(annotations),
            taints: taints
                .iter()
                .map(|(k, e)| Taint { key: k.to_string(), effect: e.to_string(), ..Default::default() })
                .collect(),
            deleting: false,
            boot_id: String::new(),
            resource_version: "1".into(),
            scheduled: None,
        }
    }

    fn template(labels: &[(&str, &str)], taints: &[(&str, &str)]) -> NodeTemplate {
        NodeTemplate {
            labels: labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            annotations: BTreeMap::new(),
            taints: taints
                .iter()
                .map(|(k, e)| NodeTaint { key: k.to_string(), value: String::new(), effect: e.parse().unwrap() })
                .collect(),
        }
    }

    /// Applies a merge patch to a view, as the API server would.
    fn applied(mut n: NodeView, p: &Value) -> NodeView {
        for (field, map) in [("labels", &mut n.labels), ("annotations", &mut n.annotations)] {
            if let Some(o) = p["metadata"][field].as_object() {
                for (k, v) in o {
                    match v.as_str() {
                        Some(v) => map.insert(k.clone(), v.to_string()),
                        None => map.remove(k),
                    };
                }
            }
        }
        if let Some(ts) = p["spec"]["taints"].as_array() {
            n.taints = serde_json::from_value(Value::Array(ts.clone())).unwrap();
        }
        n
    }

    #[test]
    fn template_keys_are_applied_and_recorded_and_a_second_look_changes_nothing() {
        let n = node(&[("kubernetes.io/hostname", "n1")], &[], &[(TAINT_UNINITIALIZED, "NoSchedule")]);
        let t = template(&[("tier", "web")], &[("dedicated", "NoSchedule")]);
        let p = patch(&n, &t).expect("a patch");
        assert_eq!(p["metadata"]["labels"]["tier"], "web");
        assert_eq!(p["metadata"]["uid"], "u1");
        assert_eq!(p["metadata"]["resourceVersion"], "1", "a taint list written is guarded by the Node's version");
        let n = applied(n, &p);
        assert!(n.taints.iter().all(|t| t.key != TAINT_UNINITIALIZED), "the startup taint is lifted");
        assert!(n.has_taint("dedicated", "NoSchedule"));
        assert_eq!(patch(&n, &t), None, "in sync");
    }

    #[test]
    fn a_patch_of_labels_alone_is_not_guarded_by_the_nodes_version() {
        let n = node(&[], &[], &[]);
        let p = patch(&n, &template(&[("tier", "web")], &[])).expect("a patch");
        assert!(p["metadata"].get("resourceVersion").is_none(), "{p}");
        assert!(p.get("spec").is_none(), "{p}");
    }

    #[test]
    fn a_key_removed_from_the_template_leaves_the_node_and_others_keys_stay() {
        let t1 = template(&[("tier", "web"), ("team", "a")], &[("dedicated", "NoSchedule")]);
        let n = applied(node(&[], &[], &[]), &patch(&node(&[], &[], &[]), &t1).unwrap());
        // Someone else adds a label and a taint.
        let mut n = n;
        n.labels.insert("ops/owner".into(), "me".into());
        n.taints.push(Taint { key: "ops/maintenance".into(), effect: "NoSchedule".into(), ..Default::default() });
        let t2 = template(&[("tier", "api")], &[]);
        let p = patch(&n, &t2).unwrap();
        let n = applied(n, &p);
        assert_eq!(n.labels.get("tier").map(String::as_str), Some("api"));
        assert!(!n.labels.contains_key("team"), "removed from the template: removed from the Node");
        assert_eq!(n.labels.get("ops/owner").map(String::as_str), Some("me"), "others' labels stay");
        assert!(!n.has_taint("dedicated", "NoSchedule"), "our taint removed");
        assert!(n.has_taint("ops/maintenance", "NoSchedule"), "others' taints stay");
        assert_eq!(patch(&n, &t2), None);
    }

    #[test]
    fn a_label_the_node_had_before_is_not_taken_over_unless_declared() {
        let n = node(&[("zone", "a")], &[], &[]);
        assert_eq!(patch(&n, &template(&[], &[])), None, "an empty template touches nothing");
        let p = patch(&n, &template(&[("tier", "web")], &[])).unwrap();
        let n = applied(n, &p);
        let p = patch(&n, &template(&[], &[])).unwrap();
        let n = applied(n, &p);
        assert_eq!(n.labels.get("zone").map(String::as_str), Some("a"), "never ours: kept");
        assert!(!n.labels.contains_key("tier"), "ours: removed");
    }
}
