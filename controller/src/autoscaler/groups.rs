//! The node groups as the autoscaler sees them, read from the store in one pass: every
//! MachineDeployment and MachinePool with `spec.autoscaling`, its machines as instances, and an
//! index from a Node's provider ID to its group. The server builds a [`Snapshot`] on `Refresh`
//! (the autoscaler calls it before every loop) and answers the loop's many `NodeGroupForNode`,
//! `NodeGroupTargetSize` and `NodeGroupNodes` calls from it, never by scanning the store.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use autoscaler_proto::pb;
use autoscaler_proto::{ERROR_CLASS_OTHER, ERROR_CLASS_OUT_OF_RESOURCES};
use serde::Deserialize;

use crate::nodes::provider_id::normalize;
use crate::resources::*;
use crate::store::{Key, Store};

/// The instance ID of a machine that has no provider ID yet: never a real Node's.
pub const PLACEHOLDER_PREFIX: &str = "machine-driver://";

/// A node group's ID: `namespace/name` for a MachineDeployment, `MachinePool/namespace/name` for
/// a MachinePool (so a deployment and a pool of one name are two groups).
pub fn group_id(kind: Kind, namespace: &str, name: &str) -> String {
    match kind {
        Kind::MachinePool => format!("MachinePool/{namespace}/{name}"),
        _ => format!("{namespace}/{name}"),
    }
}

/// The owner a group ID names; `None` for an ID that is not one.
pub fn parse_group_id(id: &str) -> Option<Key> {
    let (kind, rest) = match id.strip_prefix("MachinePool/") {
        Some(rest) => (Kind::MachinePool, rest),
        None => (Kind::MachineDeployment, id),
    };
    let (namespace, name) = rest.split_once('/')?;
    (!namespace.is_empty() && !name.is_empty() && !name.contains('/')).then(|| Key::new(kind, namespace, name))
}

/// An autoscaled MachineDeployment's or MachinePool's spec and status, as both kinds spell them.
#[derive(Debug, Clone, Deserialize)]
pub struct Owner {
    /// Metadata.
    pub metadata: ObjectMeta,
    /// The parts of the spec a group needs.
    pub spec: OwnerSpec,
    /// The parts of the status a group needs.
    #[serde(default)]
    pub status: OwnerStatus,
}

/// See [`Owner`].
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OwnerSpec {
    /// `replicas`.
    pub replicas: i64,
    /// `autoscaling`.
    #[serde(default)]
    pub autoscaling: Option<Autoscaling>,
    /// The machine template.
    pub template: MachineTemplate,
    /// Disruption budgets.
    #[serde(default)]
    pub disruption: DisruptionSpec,
    /// A deployment's failure domains.
    #[serde(default)]
    pub failure_domains: Vec<FailureDomain>,
}

/// See [`Owner`].
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OwnerStatus {
    /// Machines (instances) it has.
    #[serde(default)]
    pub replicas: i64,
    /// Machines of its target revision (model).
    #[serde(default)]
    pub updated_replicas: i64,
    /// A deployment's rollout in progress.
    #[serde(default)]
    pub rollout: Option<serde_json::Value>,
    /// Machines down, as the last reconcile counted them.
    #[serde(default)]
    pub disruption: DisruptionStatus,
    /// A deployment's failure domains, as the last reconcile counted them.
    #[serde(default)]
    pub failure_domains: Vec<FailureDomainStatus>,
}

impl Owner {
    /// The template a new machine gets: with failure domains, in the domain the next one goes to
    /// (the open domain with the fewest machines per unit of weight, the first listed among
    /// equals), so the template node carries that domain's zone.
    pub fn next_template(&self) -> MachineTemplate {
        let domains = &self.spec.failure_domains;
        let now = chrono::Utc::now();
        let status = |d: &FailureDomain| self.status.failure_domains.iter().find(|s| s.name == d.name);
        let count = domains.iter().map(|d| status(d).map_or(0, |s| s.current)).collect();
        let open = domains.iter().map(|d| status(d).is_none_or(|s| !s.unavailable_at(now))).collect();
        // Where the deployment's planner would put it.
        let next = crate::plan::domains::Spread::from_counts(domains, count, open).place();
        let mut t = self.spec.template.clone();
        t.spec.provider_spec = crate::plan::domains::provider_spec(t.spec.provider_spec.as_ref(), next);
        t
    }

    /// Whether it is rolling out a new revision (a deployment) or model (a pool): the
    /// autoscaler's scale-down waits (autoscaler#8494).
    pub fn rolling_out(&self, kind: Kind) -> bool {
        match kind {
            // A deployment says so (`status.rollout`); its counts also move while a machine is
            // merely being deleted.
            Kind::MachineDeployment => self.status.rollout.is_some(),
            _ => self.status.updated_replicas < self.status.replicas,
        }
    }
}

/// One node group.
#[derive(Debug, Clone)]
pub struct Group {
    /// Its ID ([`group_id`]).
    pub id: String,
    /// Which owner.
    pub key: Key,
    /// Its bounds and options.
    pub autoscaling: Autoscaling,
    /// `spec.replicas`: the target size.
    pub replicas: i64,
    /// The template's class.
    pub class: String,
    /// The template (its node labels, taints, provider spec).
    pub template: MachineTemplate,
    /// Its machines.
    pub instances: Vec<pb::Instance>,
}

impl Group {
    /// The protocol's `NodeGroup`.
    pub fn to_pb(&self) -> pb::NodeGroup {
        let a = &self.autoscaling;
        pb::NodeGroup {
            id: self.id.clone(),
            min_size: clamp_i32(a.min_replicas),
            max_size: clamp_i32(a.max_replicas),
            debug: format!(
                "{} {} (class {}): replicas {} in [{}, {}], {} machine(s)",
                self.key.kind,
                self.key.name,
                self.class,
                self.replicas,
                a.min_replicas,
                a.max_replicas,
                self.instances.len()
            ),
        }
    }
}

/// `n` as the protocol's int32.
pub fn clamp_i32(n: i64) -> i32 {
    i32::try_from(n.clamp(0, i64::from(i32::MAX))).unwrap_or(i32::MAX)
}

/// The groups and the provider-ID index, as of one read of the store.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// Groups by ID.
    pub groups: BTreeMap<String, Group>,
    /// Normalized provider ID (or placeholder) → group ID.
    pub by_provider_id: HashMap<String, String>,
}

/// The parts of a Machine a group reads.
#[derive(Deserialize)]
struct MachineView {
    metadata: MachineMeta,
    #[serde(default)]
    status: MachineStatusView,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct MachineMeta {
    name: String,
    #[serde(default)]
    namespace: String,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    deletion_timestamp: Option<serde_json::Value>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct MachineStatusView {
    #[serde(default)]
    phase: Phase,
    #[serde(default)]
    provider_id: String,
    #[serde(default)]
    failure: Option<Failure>,
    #[serde(default)]
    last_operation: Option<LastOperation>,
    #[serde(default)]
    node_ref: Option<NodeRef>,
}

/// What an instance's create failure means to the autoscaler: quota and capacity refusals are
/// `OutOfResources` (it backs off the group and tries another), anything else `Other`.
pub fn error_class(code: &str, reason: &str) -> i32 {
    let capacity = matches!(
        reason,
        "QUOTA_EXCEEDED"
            | "INSUFFICIENT_CAPACITY"
            | "ZONE_UNAVAILABLE"
            | "CAPACITY_UNAVAILABLE"
            | "InsufficientInstanceCapacity"
            | "SkuNotAvailable"
    );
    if code == "ResourceExhausted" || capacity {
        ERROR_CLASS_OUT_OF_RESOURCES
    } else {
        ERROR_CLASS_OTHER
    }
}

/// The instance a machine is to the autoscaler: its ID (the provider ID its Node carries, spelled
/// as on the Node when `node_provider_id` knows it; a placeholder before the driver reported one)
/// and its state — deleting, running, or creating with the error of a failed create.
fn instance(m: &MachineView, node_provider_id: &dyn Fn(&str) -> Option<String>) -> pb::Instance {
    let st = &m.status;
    let id = st
        .node_ref
        .as_ref()
        .and_then(|n| node_provider_id(&n.name))
        .filter(|p| !p.is_empty())
        .or_else(|| (!st.provider_id.is_empty()).then(|| st.provider_id.clone()))
        .unwrap_or_else(|| placeholder(&m.metadata.namespace, &m.metadata.name));
    use pb::instance_status::InstanceState;
    let deleting = m.metadata.deletion_timestamp.is_some() || st.phase == Phase::Terminating;
    let state = if deleting {
        InstanceState::InstanceDeleting
    } else if st.phase == Phase::Running {
        InstanceState::InstanceRunning
    } else {
        InstanceState::InstanceCreating
    };
    // A failed create, or one the cloud keeps refusing (quota, capacity): the autoscaler's only
    // way to learn of it before its provision timeout.
    let error = if deleting || st.phase == Phase::Running {
        None
    } else if let Some(f) = &st.failure {
        Some((f.code.clone(), f.reason.clone(), f.message.clone()))
    } else {
        st.last_operation
            .as_ref()
            .filter(|op| op.op_type == OperationType::Create && op.state == OperationState::Failed)
            .map(|op| (op.code.clone(), op.reason.clone(), op.message.clone()))
    };
    let error_info = error.map(|(code, reason, message)| pb::InstanceErrorInfo {
        instance_error_class: error_class(&code, &reason),
        error_code: if reason.is_empty() { code } else { reason },
        error_message: message,
    });
    pb::Instance { id, status: Some(pb::InstanceStatus { instance_state: state as i32, error_info }) }
}

/// The placeholder ID of a machine without a provider ID.
pub fn placeholder(namespace: &str, name: &str) -> String {
    format!("{PLACEHOLDER_PREFIX}{namespace}/{name}")
}

/// The autoscaled owners of one kind.
async fn owners(store: &Store, kind: Kind) -> crate::store::Result<Vec<Owner>> {
    let mut out = Vec::new();
    store
        .backend()
        .scan(kind, &mut |json| {
            // An owner that does not read is its reconciler's to report (Unreadable); not a group.
            if let Ok(o) = serde_json::from_str::<Owner>(json) {
                if o.spec.autoscaling.is_some() && o.metadata.deletion_timestamp.is_none() {
                    out.push(o);
                }
            }
            Ok(())
        })
        .await?;
    Ok(out)
}

impl Snapshot {
    /// Reads every autoscaled owner and its machines. `node_provider_id` gives the provider ID
    /// of a Node by name, as the Node spells it (from the target cluster's cache).
    ///
    /// # Errors
    /// Store failures.
    pub async fn read(
        store: &Store,
        node_provider_id: &(dyn Fn(&str) -> Option<String> + Sync),
    ) -> crate::store::Result<Snapshot> {
        let mut snap = Snapshot::default();
        // (label, namespace, owner name) → group ID.
        let mut member_of: HashMap<(&'static str, String, String), String> = HashMap::new();
        for (kind, label) in [(Kind::MachineDeployment, LABEL_DEPLOYMENT), (Kind::MachinePool, LABEL_POOL)] {
            for o in owners(store, kind).await? {
                let (namespace, name) = (o.metadata.namespace.clone(), o.metadata.name.clone());
                let id = group_id(kind, &namespace, &name);
                member_of.insert((label, namespace.clone(), name.clone()), id.clone());
                let Some(autoscaling) = o.spec.autoscaling.clone() else { continue };
                let template = o.next_template();
                snap.groups.insert(
                    id.clone(),
                    Group {
                        id,
                        key: Key::new(kind, &namespace, &name),
                        autoscaling,
                        replicas: o.spec.replicas,
                        class: o.spec.template.spec.class_ref.name.clone(),
                        template,
                        instances: Vec::new(),
                    },
                );
            }
        }
        if snap.groups.is_empty() {
            return Ok(snap);
        }
        let mut found: Vec<(String, pb::Instance)> = Vec::new();
        store
            .backend()
            .scan(Kind::Machine, &mut |json| {
                let Ok(m) = serde_json::from_str::<MachineView>(json) else { return Ok(()) };
                let ns = &m.metadata.namespace;
                let group = [LABEL_DEPLOYMENT, LABEL_POOL].into_iter().find_map(|label| {
                    let owner = m.metadata.labels.get(label)?;
                    member_of.get(&(label, ns.clone(), owner.clone()))
                });
                if let Some(group) = group {
                    found.push((group.clone(), instance(&m, node_provider_id)));
                }
                Ok(())
            })
            .await?;
        for (group, inst) in found {
            snap.by_provider_id.insert(normalize(&inst.id), group.clone());
            if let Some(g) = snap.groups.get_mut(&group) {
                g.instances.push(inst);
            }
        }
        Ok(snap)
    }

    /// The group of a Node, by its provider ID; `None` for a Node that is not ours.
    pub fn group_of(&self, provider_id: &str) -> Option<&Group> {
        let pid = normalize(provider_id);
        if pid.is_empty() {
            return None;
        }
        self.groups.get(self.by_provider_id.get(&pid)?)
    }
}

/// A shared snapshot: replaced whole, read without copying.
pub type Shared = Arc<Snapshot>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_template_of_a_spread_group_is_in_the_zone_the_next_machine_goes_to() {
        let owner = |status: serde_json::Value| -> Owner {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "web", "namespace": "default"},
                "spec": {"replicas": 3, "template": {"spec": {"classRef": {"name": "small"}, "providerSpec": {"image": "os-1"}}},
                         "failureDomains": [{"name": "a", "providerSpec": {"zone": "zone-a"}},
                                            {"name": "b", "providerSpec": {"zone": "zone-b"}}]},
                "status": status,
            }))
            .expect("an owner")
        };
        let zone = |o: &Owner| {
            let t = o.next_template();
            let spec = t.spec.provider_spec.expect("a provider spec");
            (spec["zone"].as_str().unwrap_or("").to_string(), spec["image"].as_str().unwrap_or("").to_string())
        };
        let fresh = owner(serde_json::json!({}));
        assert_eq!(zone(&fresh), ("zone-a".to_string(), "os-1".to_string()), "the first listed among equals");
        let a_fuller =
            owner(serde_json::json!({"failureDomains": [{"name": "a", "current": 2}, {"name": "b", "current": 1}]}));
        assert_eq!(zone(&a_fuller).0, "zone-b");
        let until = (chrono::Utc::now() + chrono::Duration::minutes(5)).to_rfc3339();
        let b_closed = owner(serde_json::json!({"failureDomains": [
            {"name": "a", "current": 2}, {"name": "b", "current": 1, "unavailableUntil": until, "reason": "InsufficientCapacity"}]}));
        assert_eq!(zone(&b_closed).0, "zone-a", "not a domain that takes no machines now");
    }

    #[test]
    fn group_ids_name_their_owner_and_nothing_else_reads_as_one() {
        assert_eq!(group_id(Kind::MachineDeployment, "default", "web"), "default/web");
        assert_eq!(group_id(Kind::MachinePool, "default", "web"), "MachinePool/default/web");
        assert_eq!(parse_group_id("default/web"), Some(Key::new(Kind::MachineDeployment, "default", "web")));
        assert_eq!(parse_group_id("MachinePool/ns/p"), Some(Key::new(Kind::MachinePool, "ns", "p")));
        for bad in ["", "web", "/web", "default/", "a/b/c", "MachinePool/x"] {
            assert_eq!(parse_group_id(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn quota_and_capacity_refusals_are_out_of_resources_and_the_rest_other() {
        assert_eq!(error_class("ResourceExhausted", "QUOTA_EXCEEDED"), ERROR_CLASS_OUT_OF_RESOURCES);
        assert_eq!(error_class("Unavailable", "INSUFFICIENT_CAPACITY"), ERROR_CLASS_OUT_OF_RESOURCES);
        assert_eq!(error_class("InvalidArgument", "INVALID_PROVIDER_SPEC"), ERROR_CLASS_OTHER);
        assert_eq!(error_class("DeadlineExceeded", "CREATION_TIMEOUT"), ERROR_CLASS_OTHER);
    }

    fn view(json: serde_json::Value) -> MachineView {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn a_machine_is_an_instance_in_its_state_with_its_create_error() {
        use pb::instance_status::InstanceState::*;
        let none = |_: &str| None;
        let state = |i: &pb::Instance| i.status.as_ref().unwrap().instance_state;
        let running = view(serde_json::json!({
            "metadata": {"name": "m1", "namespace": "ns"},
            "status": {"phase": "Running", "providerId": "fake:///zone-a/m1"}
        }));
        let i = instance(&running, &none);
        assert_eq!((i.id.as_str(), state(&i)), ("fake:///zone-a/m1", InstanceRunning as i32));
        // The Node's spelling of the provider ID wins (the kubelet's, byte for byte).
        let linked = view(serde_json::json!({
            "metadata": {"name": "m1", "namespace": "ns"},
            "status": {"phase": "Running", "providerId": "AZURE:///x", "nodeRef": {"name": "n1"}}
        }));
        assert_eq!(instance(&linked, &|n: &str| (n == "n1").then(|| "azure:///x".to_string())).id, "azure:///x");
        let quota = view(serde_json::json!({
            "metadata": {"name": "m2", "namespace": "ns"},
            "status": {"phase": "Pending", "lastOperation": {
                "type": "Create", "state": "Failed", "code": "ResourceExhausted", "reason": "QUOTA_EXCEEDED",
                "message": "quota used up", "requestId": "r", "time": "2026-11-28T10:00:00Z"}}
        }));
        let i = instance(&quota, &none);
        assert_eq!(i.id, "machine-driver://ns/m2");
        let e = i.status.as_ref().unwrap().error_info.clone().unwrap();
        assert_eq!(state(&i), InstanceCreating as i32);
        assert_eq!((e.error_code.as_str(), e.instance_error_class), ("QUOTA_EXCEEDED", ERROR_CLASS_OUT_OF_RESOURCES));
        let deleting = view(serde_json::json!({
            "metadata": {"name": "m3", "namespace": "ns", "deletionTimestamp": "2026-11-28T10:00:00Z"},
            "status": {"phase": "Running", "providerId": "fake:///zone-a/m3"}
        }));
        assert_eq!(state(&instance(&deleting, &none)), InstanceDeleting as i32);
    }
}
