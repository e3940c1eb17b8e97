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
use crate::plan::disruption::{self, Hold, Planner};
use crate::plan::member::Member;
use crate::plan::owner::{census, Unit};
use crate::plan::steps::scale_down;
use crate::resources::*;
use crate::store::{Key, Store};
use crate::targets::TargetId;

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

/// An owner the cluster-autoscaler sizes, typed: a MachineDeployment or a MachinePool with
/// `spec.autoscaling` (the shape of the autoscaler's Cluster API `scalableResource`: its size,
/// bounds and template; its machines are marked and unmarked through [`Machine::mark_disruption`]
/// and the delete-machine annotation).
pub trait NodeGroupOwner: Resource {
    /// The label its Machines carry with its name.
    const MACHINE_LABEL: &'static str;
    /// `spec.replicas`: the target size.
    fn replicas(&self) -> i64;
    /// Sets `spec.replicas`.
    fn set_replicas(&mut self, replicas: i64);
    /// `spec.autoscaling`: the bounds and options.
    fn autoscaling(&self) -> Option<&Autoscaling>;
    /// The machine template.
    fn template(&self) -> &MachineTemplate;
    /// The template a new machine gets (a deployment's next failure domain's zone in it).
    fn next_template(&self) -> MachineTemplate {
        self.template().clone()
    }
    /// It is rolling out a new revision (model): the autoscaler's scale-down waits
    /// (autoscaler#8494). `Some((updated, machines))` says how far it got.
    fn rolling_out(&self) -> Option<(i64, i64)>;
    /// The revision its machines move to (they are its new ones).
    fn target_revision(&self) -> String;
    /// How long a machine is Ready before it counts as available.
    fn min_ready(&self) -> chrono::Duration {
        chrono::Duration::zero()
    }
    /// The disruption planner's limits at `now`, as its own plan asks with them.
    fn disruption_limits(&self, now: Time) -> disruption::Limits<'_>;
    /// `spec.targetCluster`: the cluster its Nodes live in (`None`: the default one).
    fn target_cluster(&self) -> Option<&crate::resources::TargetCluster>;
}

impl NodeGroupOwner for MachineDeployment {
    const MACHINE_LABEL: &'static str = LABEL_DEPLOYMENT;

    fn replicas(&self) -> i64 {
        self.spec.replicas
    }

    fn set_replicas(&mut self, replicas: i64) {
        self.spec.replicas = replicas;
    }

    fn autoscaling(&self) -> Option<&Autoscaling> {
        self.spec.autoscaling.as_ref()
    }

    fn template(&self) -> &MachineTemplate {
        &self.spec.template
    }

    /// With failure domains, in the domain the next one goes to (the open domain with the
    /// fewest machines per unit of weight, the first listed among equals), so the template node
    /// carries that domain's zone.
    fn next_template(&self) -> MachineTemplate {
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

    /// It says so (`status.rollout`); its counts also move while a machine is merely being
    /// deleted.
    fn rolling_out(&self) -> Option<(i64, i64)> {
        self.status.rollout.is_some().then_some((self.status.updated_replicas, self.status.replicas))
    }

    fn target_revision(&self) -> String {
        if self.status.target_revision.is_empty() {
            crate::plan::deployment::revision(&self.spec.template)
        } else {
            self.status.target_revision.clone()
        }
    }

    fn min_ready(&self) -> chrono::Duration {
        chrono::Duration::seconds(i64::try_from(self.spec.min_ready_seconds).unwrap_or(i64::MAX / 2))
    }

    fn target_cluster(&self) -> Option<&crate::resources::TargetCluster> {
        self.spec.target_cluster.as_ref()
    }

    fn disruption_limits(&self, now: Time) -> disruption::Limits<'_> {
        crate::plan::deployment::disruption_limits(self, None, now)
    }
}

impl NodeGroupOwner for MachinePool {
    const MACHINE_LABEL: &'static str = LABEL_POOL;

    fn replicas(&self) -> i64 {
        self.spec.replicas
    }

    fn set_replicas(&mut self, replicas: i64) {
        self.spec.replicas = replicas;
    }

    fn autoscaling(&self) -> Option<&Autoscaling> {
        self.spec.autoscaling.as_ref()
    }

    fn template(&self) -> &MachineTemplate {
        &self.spec.template
    }

    fn rolling_out(&self) -> Option<(i64, i64)> {
        let st = &self.status;
        (st.updated_replicas < st.replicas).then_some((st.updated_replicas, st.replicas))
    }

    /// Pool Machines carry no revision: all are its own (the model is the cloud's to say).
    fn target_revision(&self) -> String {
        String::new()
    }

    fn target_cluster(&self) -> Option<&crate::resources::TargetCluster> {
        self.spec.target_cluster.as_ref()
    }

    fn disruption_limits(&self, now: Time) -> disruption::Limits<'_> {
        crate::plan::pool::disruption_limits(self, None, now)
    }
}

/// Whether the cluster-autoscaler may remove the machines `named` (by name) of `owner` now: each
/// asked of the disruption planner as an `Autoscaler` removal, over the owner's `machines` (all of
/// them, terminating ones included) as its own plan counts them — so the same budget holds the
/// same removal here and in the owner's plan. `Err` is the planner's hold.
pub fn delete_nodes_verdict<O: NodeGroupOwner>(
    owner: &O,
    machines: &[Member],
    named: &[&str],
    now: Time,
) -> Result<(), Hold> {
    let (rev, min_ready) = (owner.target_revision(), owner.min_ready());
    let units: Vec<Unit<'_, Member>> = machines.iter().map(|m| m.unit(&rev, now, min_ready)).collect();
    let mut planner = Planner::new(census(owner.replicas(), &units), owner.disruption_limits(now));
    scale_down::autoscaler(&units, named, &mut planner)
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

/// The autoscaled owners of one kind, not being deleted (one that does not read is its
/// reconciler's to report: not a group).
async fn owners<O: NodeGroupOwner>(store: &Store, scope: &TargetId) -> crate::store::Result<Vec<O>> {
    let all = store.list::<O>().await?;
    Ok(all
        .into_iter()
        .filter(|o| o.autoscaling().is_some() && o.meta().deletion_timestamp.is_none())
        .filter(|o| TargetId::of(&o.meta().namespace, o.target_cluster()) == *scope)
        .collect())
}

/// Adds `owners`' groups to `snap`, and to `member_of` the (label, namespace, owner) of their
/// machines.
fn add_groups<O: NodeGroupOwner>(
    snap: &mut Snapshot,
    member_of: &mut HashMap<(&'static str, String, String), String>,
    owners: Vec<O>,
) {
    for o in owners {
        let Some(autoscaling) = o.autoscaling().cloned() else { continue };
        let (namespace, name) = (o.meta().namespace.clone(), o.meta().name.clone());
        let id = group_id(O::KIND, &namespace, &name);
        member_of.insert((O::MACHINE_LABEL, namespace.clone(), name.clone()), id.clone());
        snap.groups.insert(
            id.clone(),
            Group {
                id,
                key: Key::new(O::KIND, &namespace, &name),
                autoscaling,
                replicas: o.replicas(),
                class: o.template().spec.class_ref.name.clone(),
                template: o.next_template(),
                instances: Vec::new(),
            },
        );
    }
}

impl Snapshot {
    /// Reads every autoscaled owner whose Nodes live in the target cluster `scope`, and its
    /// machines. `node_provider_id` gives the provider ID of a Node by name, as the Node spells
    /// it (from that cluster's cache).
    ///
    /// # Errors
    /// Store failures.
    pub async fn read(
        store: &Store,
        scope: &TargetId,
        node_provider_id: &(dyn Fn(&str) -> Option<String> + Sync),
    ) -> crate::store::Result<Snapshot> {
        let mut snap = Snapshot::default();
        // (label, namespace, owner name) → group ID.
        let mut member_of: HashMap<(&'static str, String, String), String> = HashMap::new();
        add_groups(&mut snap, &mut member_of, owners::<MachineDeployment>(store, scope).await?);
        add_groups(&mut snap, &mut member_of, owners::<MachinePool>(store, scope).await?);
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
        let owner = |status: serde_json::Value| -> MachineDeployment {
            serde_json::from_value(serde_json::json!({
                "apiVersion": API_VERSION, "kind": "MachineDeployment",
                "metadata": {"name": "web", "namespace": "default"},
                "spec": {"replicas": 3, "template": {"spec": {"classRef": {"name": "small"}, "providerSpec": {"image": "os-1"}}},
                         "failureDomains": [{"name": "a", "providerSpec": {"zone": "zone-a"}},
                                            {"name": "b", "providerSpec": {"zone": "zone-b"}}]},
                "status": status,
            }))
            .expect("a deployment")
        };
        let zone = |o: &MachineDeployment| {
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

    /// The owners a budget test uses: `replicas`, one budget limiting `Autoscaler` removals.
    fn budgeted(machines: IntOrPercent) -> Vec<DisruptionBudget> {
        vec![DisruptionBudget {
            machines,
            schedule: None,
            duration: None,
            time_zone: None,
            reasons: vec![DisruptionReason::Autoscaler],
        }]
    }

    /// A Running, Ready machine `name` of `owner` (a deployment's of `revision`, or a pool's),
    /// marked by the autoscaler's DeleteNodes when `marked`.
    fn machine(owner: &OwnerReference, name: &str, revision: &str, marked: bool) -> Machine {
        let mut m = Machine::new("default", name, MachineSpec::default());
        m.metadata.uid = format!("uid-{name}");
        m.metadata.owner_references = vec![owner.clone()];
        m.metadata.creation_timestamp = Some(chrono::Utc::now() - chrono::Duration::hours(1));
        if !revision.is_empty() {
            m.metadata.labels.insert(LABEL_REVISION.into(), revision.into());
        }
        m.status.phase = Phase::Running;
        set_condition(&mut m.status.conditions, ConditionType::Ready, true, Reason::Running, "");
        if marked {
            m.metadata.annotations.insert(ANNOTATION_DELETE.into(), "true".into());
            m.mark_disruption(DisruptionReason::Autoscaler);
        }
        m
    }

    /// One budget, three answers: the same `Autoscaler` removal held by the same budget in a
    /// deployment's plan, in a pool's plan and through DeleteNodes for either; and a budget that
    /// does not read holds all of them too (it must not fail open).
    #[test]
    fn one_budget_holds_the_autoscalers_removal_on_both_kinds_and_through_delete_nodes() {
        use crate::plan::{deployment, pool};
        let now = chrono::Utc::now();
        let pace = (std::time::Duration::from_secs(1), std::time::Duration::from_secs(300));
        for (limit, invalid) in [(IntOrPercent::Int(0), false), (IntOrPercent::Str("many".into()), true)] {
            let budgets = budgeted(limit);
            // A settled deployment of 3; the autoscaler asks for web-c's removal.
            let mut md: MachineDeployment = serde_json::from_value(serde_json::json!({
                "apiVersion": API_VERSION, "kind": "MachineDeployment",
                "metadata": {"name": "web", "namespace": "default", "uid": "web-uid"},
                "spec": {"replicas": 3, "template": {"spec": {"classRef": {"name": "small"}}},
                         "autoscaling": {"minReplicas": 1, "maxReplicas": 5}},
            }))
            .expect("a deployment");
            md.spec.disruption.budgets = budgets.clone();
            let rev = deployment::revision(&md.spec.template);
            md.status.current_revision = rev.clone();
            let owner = OwnerReference::controller_of(Kind::MachineDeployment, "web", "web-uid");
            let ms = [("web-a", false), ("web-b", false), ("web-c", true)]
                .map(|(n, marked)| machine(&owner, n, &rev, marked));
            let members: Vec<Member> = ms.iter().map(|m| Member::read(m).expect("a member")).collect();
            let delete_nodes = delete_nodes_verdict(&md, &members, &["web-c"], now).expect_err("held");
            // The deployment's own plan once the autoscaler's size is written.
            let mut lowered = md.clone();
            lowered.spec.replicas = 2;
            let plan = deployment::plan_deployment(deployment::Observed {
                deployment: &lowered,
                machines: &members,
                remediation_halted: None,
                pace,
                now,
            });
            let report = plan.disruption.expect("a report");
            let by_deployment = report.held.iter().find(|h| h.reason == DisruptionReason::Autoscaler);
            assert_eq!(by_deployment.map(|h| &h.hold), Some(&delete_nodes), "{:?}", report.held);
            assert!(!plan.delete.iter().any(|n| n == "web-c"), "{:?}", plan.delete);
            // A pool of 3 with its Nodes managed; the autoscaler asks for instance 2's removal.
            let mut mp: MachinePool = serde_json::from_value(serde_json::json!({
                "apiVersion": API_VERSION, "kind": "MachinePool",
                "metadata": {"name": "p", "namespace": "default", "uid": "p-uid"},
                "spec": {"replicas": 3, "template": {"spec": {"classRef": {"name": "small"}}},
                         "autoscaling": {"minReplicas": 1, "maxReplicas": 5}},
            }))
            .expect("a pool");
            mp.spec.disruption.budgets = budgets.clone();
            let owner = OwnerReference::controller_of(Kind::MachinePool, "p", "p-uid");
            let ms = [("p-0", false), ("p-1", false), ("p-2", true)].map(|(n, marked)| machine(&owner, n, "", marked));
            let members: Vec<Member> = ms.iter().map(|m| Member::read(m).expect("a member")).collect();
            assert_eq!(delete_nodes_verdict(&mp, &members, &["p-2"], now), Err(delete_nodes.clone()));
            let instances: Vec<pool::Instance> = (0..3)
                .map(|i| pool::Instance {
                    taken: (i == 2).then_some(DisruptionReason::Autoscaler),
                    ..pool::Instance::new(&i.to_string(), pool::InstanceState::Running)
                })
                .collect();
            let annotated = std::collections::HashSet::from(["2".to_string()]);
            let plan = pool::plan_pool(pool::Observed {
                replicas: 2,
                strategy: &mp.spec.strategy,
                revision: "rev",
                applied_revision: "rev",
                applied_capacity: 3,
                instances: &instances,
                deleting: &Default::default(),
                annotated: &annotated,
                nodes_managed: true,
                budgets: &budgets,
                max_in_flight: 1,
                remediation: &Default::default(),
                pace,
                remediation_halted: None,
                pool: "p",
                canary: None,
                now,
            });
            let by_pool = plan.disruption.held.iter().find(|h| h.reason == DisruptionReason::Autoscaler);
            assert_eq!(by_pool.map(|h| &h.hold), Some(&delete_nodes), "{:?}", plan.disruption.held);
            assert!(
                !matches!(&plan.step, pool::Step::DeleteMachines(ids) if ids.iter().any(|i| i == "2")),
                "{:?}",
                plan.step
            );
            match (&delete_nodes, invalid) {
                (Hold::BudgetInvalid { index: 0, field: "machines", .. }, true) => {}
                (Hold::Budget { index: 0, machines: 0, disrupted: 0, planned: 0, until: None }, false) => {}
                (other, _) => panic!("held by {other:?}"),
            }
        }
    }
}
