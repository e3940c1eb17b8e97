//! What a deployment's or pool's machines are made from, and the small types several kinds
//! share: a reference by name, an integer or a percentage, the rolling-update parameters, the
//! node settings; and the JSON merge and hash that turn templates into machines and revisions.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::state::wire_enum;

/// A reference by name (same namespace).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NameRef {
    /// The referenced object's name.
    #[schemars(length(min = 1))]
    pub name: String,
}

/// The cluster where a deployment's, pool's or machine's Nodes live, when it is not the
/// controller's default target (`run --target-kubeconfig`, or the store's cluster): a Secret in
/// the object's own namespace whose key `value` holds a kubeconfig (Cluster API's convention).
/// Kubeconfigs that run commands (`exec`, `auth-provider`) are refused.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TargetCluster {
    /// The Secret holding the kubeconfig (key `value`), in the same namespace.
    pub kubeconfig_secret_ref: NameRef,
}

/// An integer or a percentage (`3`, `"25%"`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(untagged)]
pub enum IntOrPercent {
    /// An absolute number.
    Int(i64),
    /// A percentage like `"25%"` (or a number in a string).
    Str(String),
}

impl IntOrPercent {
    /// Resolves against `total`: percentages round up when `round_up`, else down (Kubernetes).
    ///
    /// # Errors
    /// A message when the value is neither an integer ≥ 0 nor a percentage.
    pub fn resolve(&self, total: i64, round_up: bool) -> Result<i64, String> {
        match self {
            IntOrPercent::Int(n) if *n >= 0 => Ok(*n),
            IntOrPercent::Int(n) => Err(format!("must not be negative, got {n}")),
            IntOrPercent::Str(s) => {
                if let Some(p) = s.strip_suffix('%') {
                    let p: i64 = p.trim().parse().map_err(|_| format!("{s:?} is not a percentage like \"25%\""))?;
                    if !(0..=100).contains(&p) {
                        return Err(format!("{s:?} must be between 0% and 100%"));
                    }
                    let scaled = total * p;
                    Ok(if round_up { (scaled + 99) / 100 } else { scaled / 100 })
                } else {
                    s.trim()
                        .parse::<i64>()
                        .ok()
                        .filter(|n| *n >= 0)
                        .ok_or_else(|| format!("{s:?} must be an integer or a percentage like \"25%\""))
                }
            }
        }
    }
}

/// Labels and annotations given to machines made from a template.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TemplateMeta {
    /// Labels of each Machine a MachineDeployment makes, also sent to the driver as its cloud
    /// machine's labels. A change is a new revision, which the deployment rolls out.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Annotations of each Machine a MachineDeployment makes (not sent to the driver). A change
    /// is a new revision, which the deployment rolls out.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// The machine part of a template.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MachineTemplateSpec {
    /// The MachineClass.
    pub class_ref: NameRef,
    /// Fields merged over the class's provider spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_spec: Option<Value>,
    /// Labels, annotations and taints kept on each machine's Node (with a target cluster). A
    /// change updates the Nodes in place: it is not a new revision and replaces nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_template: Option<NodeTemplate>,
}

/// What a machine's Node carries from its template.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeTemplate {
    /// Labels set on the Node. One removed from here is removed from the Node; labels others
    /// set stay.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Annotations set on the Node. One removed from here is removed from the Node;
    /// annotations others set stay.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Taints set on the Node. One removed from here is removed from the Node; taints others
    /// set stay.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub taints: Vec<NodeTaint>,
}

/// A taint on a Node.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeTaint {
    /// A label-style key, e.g. `dedicated` or `example.com/gpu`.
    pub key: String,
    /// May be empty; a toleration with `operator: Equal` must name it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub value: String,
    /// `NoSchedule`, `PreferNoSchedule` or `NoExecute`.
    pub effect: TaintEffect,
}

wire_enum! {
    /// What a taint does to pods that do not tolerate it (Kubernetes' taint effects).
    pub enum TaintEffect {
        /// No new pod is scheduled onto the Node.
        NoSchedule,
        /// The scheduler avoids the Node when it can.
        PreferNoSchedule,
        /// No new pod is scheduled, and pods already there are evicted.
        NoExecute,
    }
}

/// What a deployment's or pool's machines are made from; its hash is the revision (a
/// deployment's leaves `nodeTemplate` out).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MachineTemplate {
    /// Labels and annotations.
    #[serde(default)]
    pub metadata: TemplateMeta,
    /// The machine spec.
    pub spec: MachineTemplateSpec,
}

/// RollingUpdate parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RollingUpdate {
    /// Machines above `replicas` allowed during a rollout (default 1; percentages round up).
    #[serde(default = "one")]
    pub max_surge: IntOrPercent,
    /// Machines below `replicas` allowed to be unavailable (default 0; percentages round down).
    #[serde(default = "zero")]
    pub max_unavailable: IntOrPercent,
    /// The new revision (a MachineDeployment's, either strategy type) or model (a MachinePool's)
    /// first reaches this many machines, which must stay Running, Ready and healthy for
    /// `pauseSeconds` before the rollout goes on. A pool's failed canary stops its upgrade until
    /// the template changes again (a pool does not roll back).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<Canary>,
}

/// A canary: the first machines of a new revision, watched before the rest follow.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Canary {
    /// Machines of the new revision first (new, or updated in place): a count of at least 1 or
    /// a percentage of `replicas` (rounded up, at least 1 machine).
    pub machines: IntOrPercent,
    /// How long every canary machine must be Running, Ready and healthy before the rollout goes
    /// on at its usual pace (default 0: as soon as they are).
    #[serde(default)]
    pub pause_seconds: u64,
}

impl Canary {
    /// The number of canary machines of a deployment of `replicas`: at least 1, at most
    /// `replicas` (0 when `replicas` is 0).
    pub fn machines_of(&self, replicas: i64) -> i64 {
        self.machines.resolve(replicas, true).unwrap_or(1).max(1).min(replicas.max(0))
    }
}

pub(crate) fn one() -> IntOrPercent {
    IntOrPercent::Int(1)
}

pub(crate) fn zero() -> IntOrPercent {
    IntOrPercent::Int(0)
}

impl Default for RollingUpdate {
    fn default() -> Self {
        Self { max_surge: one(), max_unavailable: zero(), canary: None }
    }
}

/// How a deployment's or pool's machines live as Kubernetes Nodes (used when the controller has
/// a target cluster; see the `nodes` module).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeSettings {
    /// A machine whose VM runs but whose Node is not Ready this long after the VM came up fails
    /// with reason `NodeNotJoined` and is replaced (default 600; 0 waits forever).
    #[serde(default = "default_node_startup_timeout")]
    pub node_startup_timeout_seconds: u64,
    /// The drain before a machine's deletion ends by this deadline: pods still there at the
    /// deadline minus their grace period are deleted with that grace (default 3600).
    #[serde(default = "default_drain_timeout")]
    pub drain_timeout_seconds: u64,
    /// After the drain, the deletion waits this long at most for the node's VolumeAttachments to
    /// go (default 600).
    #[serde(default = "default_volume_detach_timeout")]
    pub volume_detach_timeout_seconds: u64,
}

impl Default for NodeSettings {
    fn default() -> Self {
        Self {
            node_startup_timeout_seconds: default_node_startup_timeout(),
            drain_timeout_seconds: default_drain_timeout(),
            volume_detach_timeout_seconds: default_volume_detach_timeout(),
        }
    }
}

/// `nodeStartupTimeoutSeconds` by default: a VM boots and its kubelet registers well within 10
/// minutes (Cluster API's MachineHealthCheck uses the same).
pub const DEFAULT_NODE_STARTUP_TIMEOUT_SECONDS: u64 = 600;
/// `drainTimeoutSeconds` by default: a drain always ends, after an hour at most.
pub const DEFAULT_DRAIN_TIMEOUT_SECONDS: u64 = 3600;
/// `volumeDetachTimeoutSeconds` by default.
pub const DEFAULT_VOLUME_DETACH_TIMEOUT_SECONDS: u64 = 600;

pub(crate) fn default_node_startup_timeout() -> u64 {
    DEFAULT_NODE_STARTUP_TIMEOUT_SECONDS
}
pub(crate) fn default_drain_timeout() -> u64 {
    DEFAULT_DRAIN_TIMEOUT_SECONDS
}
pub(crate) fn default_volume_detach_timeout() -> u64 {
    DEFAULT_VOLUME_DETACH_TIMEOUT_SECONDS
}

/// Merges `patch` over `base` (JSON merge patch, RFC 7396: objects merge, anything else replaces,
/// null removes).
pub fn merge(base: &Value, patch: &Value) -> Value {
    match (base, patch) {
        (Value::Object(b), Value::Object(p)) => {
            let mut out = b.clone();
            for (k, v) in p {
                if v.is_null() {
                    out.remove(k);
                } else {
                    let merged = merge(b.get(k).unwrap_or(&Value::Null), v);
                    out.insert(k.clone(), merged);
                }
            }
            Value::Object(out)
        }
        (_, p) => p.clone(),
    }
}

/// A short stable hash of any serializable value (hex, 10 characters).
pub fn short_hash<T: Serialize>(v: &T) -> String {
    use sha2::{Digest, Sha256};
    let json = serde_json::to_vec(v).unwrap_or_default();
    hex::encode(&Sha256::digest(json)[..5])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentages_round_like_kubernetes() {
        let p = IntOrPercent::Str("25%".into());
        assert_eq!(p.resolve(10, true), Ok(3));
        assert_eq!(p.resolve(10, false), Ok(2));
        assert_eq!(IntOrPercent::Int(2).resolve(10, true), Ok(2));
        assert!(IntOrPercent::Str("x%".into()).resolve(10, true).is_err());
        assert!(IntOrPercent::Str("150%".into()).resolve(10, true).is_err());
        assert!(IntOrPercent::Int(-1).resolve(10, true).is_err());
        assert_eq!(IntOrPercent::Str("10%".into()).resolve(1000, true), Ok(100));
    }

    #[test]
    fn merge_patch_overrides_and_removes() {
        let base = serde_json::json!({"a": 1, "b": {"c": 2, "d": 3}});
        let patch = serde_json::json!({"b": {"c": 9, "d": null}, "e": 5});
        assert_eq!(merge(&base, &patch), serde_json::json!({"a": 1, "b": {"c": 9}, "e": 5}));
    }

    #[test]
    fn a_canary_is_at_least_one_machine_and_at_most_replicas() {
        let canary = |m: IntOrPercent| Canary { machines: m, pause_seconds: 0 };
        let rows = [
            (IntOrPercent::Int(1), 10, 1),
            (IntOrPercent::Int(3), 2, 2),
            (IntOrPercent::Str("25%".into()), 10, 3),
            (IntOrPercent::Str("1%".into()), 10, 1),
            (IntOrPercent::Str("100%".into()), 7, 7),
            (IntOrPercent::Int(0), 10, 1),
            (IntOrPercent::Str("bogus".into()), 10, 1),
            (IntOrPercent::Int(2), 0, 0),
        ];
        for (m, replicas, want) in rows {
            assert_eq!(canary(m.clone()).machines_of(replicas), want, "{m:?} of {replicas}");
        }
    }
}
