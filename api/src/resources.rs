//! The resource model: Kubernetes-shaped objects (`apiVersion`, `kind`, `metadata`, `spec`,
//! `status`) in the `machine.driver.dev/v1alpha1` API group, so the same YAML works with the
//! embedded store and, later, as CRDs.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub mod checks;
mod kind;
mod state;
pub use kind::*;
pub use state::*;

pub use crate::registry::Kind;
use checks::Check;

/// The API group and version of every kind but `Secret`.
pub const API_VERSION: &str = "machine.driver.dev/v1alpha1";
/// Label / annotation / finalizer prefix.
pub const GROUP: &str = "machine.driver.dev";
/// Finalizer that guards a Machine until its cloud machine is gone.
pub const FINALIZER: &str = "machine.driver.dev/cloud-machine";
/// Label naming the MachineDeployment a Machine belongs to.
pub const LABEL_DEPLOYMENT: &str = "machine.driver.dev/deployment";
/// Label naming the MachinePool a Machine belongs to.
pub const LABEL_POOL: &str = "machine.driver.dev/pool";
/// Label with the template revision a Machine was made from.
pub const LABEL_REVISION: &str = "machine.driver.dev/revision";
/// Annotation that marks a Machine to be deleted first on scale-down.
pub const ANNOTATION_DELETE: &str = "machine.driver.dev/delete-machine";
/// Cloud tag naming the controller instance that owns a cloud machine (orphan collection).
pub const TAG_CONTROLLER: &str = "machine.driver.dev/controller";
/// Cloud tag with the namespace/name of the owning Machine.
pub const TAG_MACHINE: &str = "machine.driver.dev/machine";
/// Annotation on a Machine: the hash of the node template and node settings its spec carries
/// from its deployment (changed in place, not by a rollout).
pub const ANNOTATION_NODE_TEMPLATE: &str = "machine.driver.dev/node-template-hash";
/// Annotation on a Node naming its Machine as `namespace/name`.
pub const ANNOTATION_NODE_MACHINE: &str = "machine.driver.dev/machine";
/// Annotations starting with this hold a Machine's deletion before its node is drained, until
/// they are removed (one per hook owner: `pre-drain.delete.hook.machine.driver.dev/NAME`).
pub const PRE_DRAIN_HOOK_PREFIX: &str = "pre-drain.delete.hook.machine.driver.dev";
/// Annotations starting with this hold a Machine's deletion after its node is drained and
/// before its VM is deleted, until they are removed.
pub const PRE_TERMINATE_HOOK_PREFIX: &str = "pre-terminate.delete.hook.machine.driver.dev";
/// The `NoSchedule` taint a draining node carries (besides `spec.unschedulable`).
pub const TAINT_DRAINING: &str = "machine.driver.dev/draining";
/// Node annotation listing the label, annotation and taint keys this controller put there from
/// the machine template (so a key removed from the template is removed from the Node, while
/// keys others added stay).
pub const ANNOTATION_OWNED_NODE_METADATA: &str = "machine.driver.dev/owned-node-metadata";

/// Timestamps are RFC 3339, UTC.
pub type Time = chrono::DateTime<chrono::Utc>;

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

fn default_namespace() -> String {
    "default".into()
}

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

/// Standard object metadata (a subset of Kubernetes `ObjectMeta`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ObjectMeta {
    /// Name, unique per kind and namespace.
    pub name: String,
    /// Namespace (default `default`).
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// Assigned by the store.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub uid: String,
    /// Assigned by the store on every write; updates must carry the one they read.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub resource_version: String,
    /// Incremented by the store when `spec` changes.
    #[serde(default, skip_serializing_if = "is_default")]
    pub generation: i64,
    /// Set by the store on create.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_timestamp: Option<Time>,
    /// Set by the store when a delete waits for finalizers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deletion_timestamp: Option<Time>,
    /// A Machine's labels are also its cloud machine's: sent to the driver on create, with
    /// [`TAG_CONTROLLER`] and [`TAG_MACHINE`] added.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Never sent to the driver. The controller reads its own on Machines
    /// ([`ANNOTATION_DELETE`], the deletion hooks' [`PRE_DRAIN_HOOK_PREFIX`] and
    /// [`PRE_TERMINATE_HOOK_PREFIX`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Finalizers: the object stays until they are removed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub finalizers: Vec<String>,
    /// Owners (the controller sets them on Machines).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub owner_references: Vec<OwnerReference>,
}

/// A reference to an owning object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OwnerReference {
    /// [`API_VERSION`] for the owners the controller sets.
    pub api_version: String,
    /// `MachineDeployment` or `MachinePool` on the Machines the controller makes (a [`Kind`]'s
    /// name; another kind is not an owner the controller knows).
    pub kind: String,
    /// The owner's name, in the object's namespace.
    pub name: String,
    /// The owner's uid: on the Kubernetes store, the garbage collector deletes the object once
    /// no owner with this uid exists.
    pub uid: String,
    /// Whether the owner manages this object; the controller acts on the one that does.
    #[serde(default)]
    pub controller: bool,
}

/// A typed object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Object<S, T> {
    /// `machine.driver.dev/v1alpha1`.
    pub api_version: String,
    /// The kind's name (`Machine`, …), as manifests spell it; [`Object::new`] sets it from the
    /// type.
    pub kind: String,
    /// Name and namespace, and what the store keeps about the object.
    pub metadata: ObjectMeta,
    /// Desired state.
    pub spec: S,
    /// Observed state (written by the controller).
    #[serde(default)]
    pub status: T,
}

/// Lets generic code know each type's kind.
pub trait Resource: Serialize + serde::de::DeserializeOwned + Clone + Send + Sync + 'static {
    /// The kind of every object of this type (its `kind` field says the same).
    const KIND: Kind;
    /// The object's `metadata`: what the store keys, versions and guards it by.
    fn meta(&self) -> &ObjectMeta;
    /// The object's `metadata`, to set finalizers, labels or the `resourceVersion` to write.
    fn meta_mut(&mut self) -> &mut ObjectMeta;
}

impl<S, T> Resource for Object<S, T>
where
    Object<S, T>: KindOf,
    S: Serialize + serde::de::DeserializeOwned + Clone + Send + Sync + 'static,
    T: Serialize + serde::de::DeserializeOwned + Clone + Send + Sync + Default + 'static,
{
    const KIND: Kind = <Self as KindOf>::KIND;

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// Maps an object type to its kind.
pub trait KindOf {
    /// The kind of every object of this type: what [`Object::new`] writes into `kind`.
    const KIND: Kind;
}

impl<S: Default, T: Default> Object<S, T>
where
    Object<S, T>: KindOf,
{
    /// A new object of this kind.
    pub fn new(namespace: &str, name: &str, spec: S) -> Self {
        let kind = <Self as KindOf>::KIND;
        Self {
            api_version: kind.api_version().into(),
            kind: kind.as_str().into(),
            metadata: ObjectMeta { name: name.into(), namespace: namespace.into(), ..Default::default() },
            spec,
            status: T::default(),
        }
    }
}

// ----------------------------------------------------------------------------------------- Secret

/// Credentials, in the shape of a Kubernetes `v1/Secret` (`stringData`, or base64 `data`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Secret {
    /// `v1`.
    pub api_version: String,
    /// `Secret`.
    pub kind: String,
    /// Name and namespace: a MachineClass's `secretRef` names it, in its own namespace.
    pub metadata: ObjectMeta,
    /// Plain values.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub string_data: BTreeMap<String, String>,
    /// Base64 values.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub data: BTreeMap<String, String>,
    /// `Opaque`.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub secret_type: Option<String>,
}

impl Secret {
    /// All values, decoded.
    pub fn values(&self) -> BTreeMap<String, String> {
        use base64::Engine;
        let mut out: BTreeMap<String, String> = self
            .data
            .iter()
            .filter_map(|(k, v)| {
                let bytes = base64::engine::general_purpose::STANDARD.decode(v).ok()?;
                Some((k.clone(), String::from_utf8(bytes).ok()?))
            })
            .collect();
        out.extend(self.string_data.clone());
        out
    }
}

impl Resource for Secret {
    const KIND: Kind = Kind::Secret;

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl KindInfo for Secret {
    const API_VERSION: &'static str = "v1";
    const PLURAL: &'static str = "secrets";
    const CRD: bool = false;
    type Spec = ();
    type Status = ();
    const COLUMNS: &'static [Column] = &[
        Column::computed("Keys", |v| {
            let keys: usize =
                ["data", "stringData"].iter().filter_map(|f| v.get(*f)?.as_object()).map(|o| o.len()).sum();
            keys.to_string()
        }),
        Column::age(),
    ];

    fn validate(&self) -> Check {
        if self.secret_type.as_deref().is_some_and(|t| t != "Opaque") {
            return checks::fail("type", "only Opaque secrets are supported");
        }
        use base64::Engine;
        for (k, v) in &self.data {
            if base64::engine::general_purpose::STANDARD.decode(v).is_err() {
                return checks::fail(&format!("data.{k}"), "is not valid base64 (use stringData for plain text)");
            }
        }
        Ok(())
    }
}

// ----------------------------------------------------------------------------------- MachineClass

/// A reference by name (same namespace).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NameRef {
    /// The referenced object's name.
    #[schemars(length(min = 1))]
    pub name: String,
}

/// Which driver, with which provider spec and credentials.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MachineClassSpec {
    /// Driver name, as registered with `run --driver NAME=ENDPOINT`.
    #[schemars(length(min = 1))]
    pub driver: String,
    /// Cloud-specific spec (checked by the driver's schema).
    pub provider_spec: Value,
    /// Secret with the cloud credentials, sent to the driver as secrets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<NameRef>,
}

/// What the controller found out about a class.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineClassStatus {
    /// The generation last validated by the driver.
    #[serde(default, skip_serializing_if = "is_default")]
    pub validated_generation: i64,
    /// Conditions (`Valid`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// A MachineClass: the driver, provider spec and credentials its machines are created with.
pub type MachineClass = Object<MachineClassSpec, MachineClassStatus>;

impl KindOf for MachineClass {
    const KIND: Kind = Kind::MachineClass;
}

impl KindInfo for MachineClass {
    const PLURAL: &'static str = "machineclasses";
    const SHORT_NAMES: &'static [&'static str] = &["mcl"];
    const ALIASES: &'static [&'static str] = &["mc", "class", "classes"];
    type Spec = MachineClassSpec;
    type Status = MachineClassStatus;
    const COLUMNS: &'static [Column] = &[
        Column::new("Driver", ColumnType::String, ".spec.driver"),
        Column::computed("Valid", |v| condition_cell(v, ConditionType::Valid)),
        Column::age(),
    ];
    // A Secret changes the classes that use it, and so their objects.
    const WOKEN_BY: &'static [(Kind, Via)] = &[(Kind::Secret, Via::SecretRef)];

    fn validate(&self) -> Check {
        if self.spec.driver.is_empty() {
            return checks::fail("spec.driver", "is required (the name given to `run --driver NAME=ENDPOINT`)");
        }
        if !self.spec.provider_spec.is_object() {
            return checks::fail(
                "spec.providerSpec",
                format!("must be a mapping, got {}", checks::json_type(&self.spec.provider_spec)),
            );
        }
        if let Some(r) = &self.spec.secret_ref {
            checks::name("spec.secretRef.name", &r.name)?;
        }
        Ok(())
    }
}

/// `get`'s cell for a condition: `Status/Reason`, or `-`.
fn condition_cell(object: &Value, condition_type: ConditionType) -> String {
    let conditions = object.pointer("/status/conditions").cloned().unwrap_or_default();
    let conditions: Vec<Condition> = serde_json::from_value(conditions).unwrap_or_default();
    condition(&conditions, condition_type).map_or("-".into(), |c| format!("{}/{}", c.status, c.reason))
}

// ------------------------------------------------------------------------------------- templates

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
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeTaint {
    /// A label-style key, e.g. `dedicated` or `example.com/gpu`.
    pub key: String,
    /// May be empty; a toleration with `operator: Equal` must name it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub value: String,
    /// `NoSchedule`, `PreferNoSchedule` or `NoExecute`.
    pub effect: String,
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

// ------------------------------------------------------------------------------ MachineDeployment

/// How a deployment moves machines to a new template.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum StrategyType {
    /// Replace machines, within maxSurge / maxUnavailable.
    #[default]
    RollingUpdate,
    /// Update machines in place where the driver can (CanUpdateMachine / UpdateMachine).
    InPlace,
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
}

fn one() -> IntOrPercent {
    IntOrPercent::Int(1)
}

fn zero() -> IntOrPercent {
    IntOrPercent::Int(0)
}

impl Default for RollingUpdate {
    fn default() -> Self {
        Self { max_surge: one(), max_unavailable: zero() }
    }
}

/// InPlace parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InPlaceUpdate {
    /// Machines updated at once (they count as unavailable; default 1).
    #[serde(default = "one")]
    pub max_unavailable: IntOrPercent,
    /// Replace a machine when the driver cannot apply every change in place.
    #[serde(default)]
    pub fallback_to_replace: bool,
}

impl Default for InPlaceUpdate {
    fn default() -> Self {
        Self { max_unavailable: one(), fallback_to_replace: false }
    }
}

/// Update strategy.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Strategy {
    /// RollingUpdate (default) or InPlace.
    #[serde(default, rename = "type")]
    pub strategy_type: StrategyType,
    /// RollingUpdate parameters.
    #[serde(default)]
    pub rolling_update: RollingUpdate,
    /// InPlace parameters.
    #[serde(default)]
    pub in_place: InPlaceUpdate,
}

/// Which machines go first on scale-down (after annotated, failed and unhealthy ones).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum DeletePolicy {
    /// Oldest first.
    #[default]
    Oldest,
    /// Newest first.
    Newest,
    /// Any.
    Random,
}

/// Desired state of a MachineDeployment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MachineDeploymentSpec {
    /// Number of machines.
    #[schemars(range(min = 0))]
    pub replicas: i64,
    /// The machine template; a change starts a rollout.
    pub template: MachineTemplate,
    /// How to roll out a new template.
    #[serde(default)]
    pub strategy: Strategy,
    /// Scale-down order.
    #[serde(default)]
    pub delete_policy: DeletePolicy,
    /// A rollout without progress for this long gets a ProgressDeadlineExceeded condition.
    #[serde(default = "default_progress_deadline")]
    pub progress_deadline_seconds: u64,
    /// Machines of a new revision that may fail before the rollout is aborted and rolled back.
    #[serde(default = "default_failure_budget")]
    pub failure_budget: u32,
    /// At most this many failed machines are replaced at once (meltdown protection).
    #[serde(default = "default_max_replacements")]
    pub max_concurrent_replacements: u32,
    /// A machine not Running this long after its create started is Failed.
    #[serde(default = "default_creation_timeout")]
    pub creation_timeout_seconds: u64,
    /// A Running machine reported unhealthy or missing this long is Failed.
    #[serde(default = "default_health_timeout")]
    pub health_timeout_seconds: u64,
    /// A machine counts as available only once it has been Ready this long (default 0).
    #[serde(default)]
    pub min_ready_seconds: u64,
    /// A machine whose VM runs but whose Node is not Ready this long after the VM came up fails
    /// with reason `NodeNotJoined` and is replaced (default 600; 0 waits forever; with a target
    /// cluster).
    #[serde(default = "default_node_startup_timeout")]
    pub node_startup_timeout_seconds: u64,
    /// The drain before a machine's deletion ends by this deadline: pods still there at the
    /// deadline minus their grace period are deleted with that grace (default 3600).
    #[serde(default = "default_drain_timeout")]
    pub drain_timeout_seconds: u64,
    /// After the drain, a deletion waits at most this long for the node's VolumeAttachments to
    /// go (default 600).
    #[serde(default = "default_volume_detach_timeout")]
    pub volume_detach_timeout_seconds: u64,
    /// Stop rolling out (scaling still happens).
    #[serde(default)]
    pub paused: bool,
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
/// `progressDeadlineSeconds` by default: a Deployment's default.
pub const DEFAULT_PROGRESS_DEADLINE_SECONDS: u64 = 600;
/// `failureBudget` by default: a few failed machines of a new revision may be bad luck, more
/// are the revision.
pub const DEFAULT_FAILURE_BUDGET: u32 = 3;
/// `maxConcurrentReplacements` by default: failed machines are replaced one at a time.
pub const DEFAULT_MAX_CONCURRENT_REPLACEMENTS: u32 = 1;
/// `creationTimeoutSeconds` by default: a VM create that has not led to a Running machine in 20
/// minutes will not.
pub const DEFAULT_CREATION_TIMEOUT_SECONDS: u64 = 1200;
/// `healthTimeoutSeconds` by default.
pub const DEFAULT_HEALTH_TIMEOUT_SECONDS: u64 = 600;

fn default_node_startup_timeout() -> u64 {
    DEFAULT_NODE_STARTUP_TIMEOUT_SECONDS
}
fn default_drain_timeout() -> u64 {
    DEFAULT_DRAIN_TIMEOUT_SECONDS
}
fn default_volume_detach_timeout() -> u64 {
    DEFAULT_VOLUME_DETACH_TIMEOUT_SECONDS
}

fn default_progress_deadline() -> u64 {
    DEFAULT_PROGRESS_DEADLINE_SECONDS
}
fn default_failure_budget() -> u32 {
    DEFAULT_FAILURE_BUDGET
}
fn default_max_replacements() -> u32 {
    DEFAULT_MAX_CONCURRENT_REPLACEMENTS
}
fn default_creation_timeout() -> u64 {
    DEFAULT_CREATION_TIMEOUT_SECONDS
}
fn default_health_timeout() -> u64 {
    DEFAULT_HEALTH_TIMEOUT_SECONDS
}

/// A revision that failed and is not applied again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BadRevision {
    /// The template hash.
    pub revision: String,
    /// Why it was abandoned.
    pub reason: String,
    /// When it was abandoned.
    pub time: Time,
}

/// A template that was fully rolled out once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RevisionRecord {
    /// The template hash.
    pub revision: String,
    /// That revision's template, applied again by a rollback.
    pub template: MachineTemplate,
}

/// The rollout in progress.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutState {
    /// Revision being rolled out.
    pub revision: String,
    /// When it started.
    pub started: Time,
    /// When it last made progress (a new machine became Running).
    pub last_progress: Time,
    /// New-revision machines that failed.
    pub failures: u32,
}

/// Observed state of a MachineDeployment.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineDeploymentStatus {
    /// Generation the status describes.
    #[serde(default)]
    pub observed_generation: i64,
    /// All machines (any revision, any phase, terminating included).
    #[serde(default)]
    pub replicas: i64,
    /// Machines of the target revision.
    #[serde(default)]
    pub updated_replicas: i64,
    /// Running machines (any revision).
    #[serde(default)]
    pub ready_replicas: i64,
    /// Running machines of the target revision.
    #[serde(default)]
    pub available_replicas: i64,
    /// Failed machines.
    #[serde(default)]
    pub failed_replicas: i64,
    /// The revision machines are being moved to (the spec's, unless it was bad).
    #[serde(default)]
    pub target_revision: String,
    /// The last revision fully rolled out.
    #[serde(default)]
    pub current_revision: String,
    /// Rollout in progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutState>,
    /// Revisions that failed and are not applied again (until the template changes).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bad_revisions: Vec<BadRevision>,
    /// Good revisions, newest last (for rollback).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub revision_history: Vec<RevisionRecord>,
    /// Conditions: Available, Progressing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// A MachineDeployment: `replicas` Machines of a template, rolled out revision by revision.
pub type MachineDeployment = Object<MachineDeploymentSpec, MachineDeploymentStatus>;

impl KindOf for MachineDeployment {
    const KIND: Kind = Kind::MachineDeployment;
}

impl KindInfo for MachineDeployment {
    const PLURAL: &'static str = "machinedeployments";
    const SHORT_NAMES: &'static [&'static str] = &["md", "mcd"];
    const ALIASES: &'static [&'static str] = &["md", "mds", "deployment", "deployments"];
    type Spec = MachineDeploymentSpec;
    type Status = MachineDeploymentStatus;
    const COLUMNS: &'static [Column] = &[
        Column::new("Desired", ColumnType::Integer, ".spec.replicas"),
        Column::new("Current", ColumnType::Integer, ".status.replicas"),
        Column::new("Updated", ColumnType::Integer, ".status.updatedReplicas"),
        Column::new("Ready", ColumnType::Integer, ".status.readyReplicas"),
        Column::new("Available", ColumnType::Integer, ".status.availableReplicas"),
        Column::new("Revision", ColumnType::String, ".status.targetRevision").shown(Shown::Table),
        Column::age(),
        Column::new("Strategy", ColumnType::String, ".spec.strategy.type").shown(Shown::TableWide),
        Column::computed("Progressing", |v| condition_cell(v, ConditionType::Progressing)).shown(Shown::TableWide),
        Column::computed("Bad-Revisions", |v| {
            let bad = v.pointer("/status/badRevisions").and_then(Value::as_array);
            let names: Vec<&str> = bad.into_iter().flatten().filter_map(|b| b.get("revision")?.as_str()).collect();
            names.join(",").chars().take(40).collect()
        })
        .shown(Shown::TableWide),
    ];
    const SCALE: bool = true;
    const WOKEN_BY: &'static [(Kind, Via)] = &[
        // A machine's phase changes what its owner plans.
        (Kind::Machine, Via::Owner),
        // A class's spec (its driver, provider spec, credentials) changes every call made with it.
        (Kind::MachineClass, Via::ClassRef),
    ];

    fn rules() -> Vec<checks::Rule> {
        let mut out = checks::replicated_rules(Kind::MachineDeployment);
        out.extend(checks::deployment_rules());
        out
    }

    fn validate(&self) -> Check {
        checks::template(&self.spec.template)
    }

    fn describe_tail(status: &Value) -> String {
        let other: serde_json::Map<String, Value> = status
            .as_object()
            .map(|o| {
                o.iter()
                    .filter(|(k, _)| !matches!(k.as_str(), "conditions" | "revisionHistory"))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect()
            })
            .unwrap_or_default();
        let yaml = serde_saphyr::to_string(&Value::Object(other)).unwrap_or_default();
        let mut out = String::from("Status:\n");
        out.extend(yaml.lines().map(|l| format!("  {l}\n")));
        out
    }
}

// ------------------------------------------------------------------------------------ MachinePool

/// Desired state of a MachinePool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MachinePoolSpec {
    /// Number of instances.
    #[schemars(range(min = 0))]
    pub replicas: i64,
    /// The instance template.
    pub template: MachineTemplate,
    /// Rolling instance upgrades (maxSurge / maxUnavailable).
    #[serde(default)]
    pub strategy: RollingUpdate,
    /// A machine whose VM runs but whose Node is not Ready this long after the VM came up fails
    /// with reason `NodeNotJoined` and is replaced (default 600; 0 waits forever; with a target
    /// cluster).
    #[serde(default = "default_node_startup_timeout")]
    pub node_startup_timeout_seconds: u64,
    /// The drain before a machine's deletion ends by this deadline: pods still there at the
    /// deadline minus their grace period are deleted with that grace (default 3600).
    #[serde(default = "default_drain_timeout")]
    pub drain_timeout_seconds: u64,
    /// After the drain, a deletion waits at most this long for the node's VolumeAttachments to
    /// go (default 600).
    #[serde(default = "default_volume_detach_timeout")]
    pub volume_detach_timeout_seconds: u64,
}

/// Observed state of a MachinePool.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachinePoolStatus {
    /// Instances in the pool.
    #[serde(default)]
    pub replicas: i64,
    /// Instances provisioned and running.
    #[serde(default)]
    pub ready_replicas: i64,
    /// Instances on the latest model.
    #[serde(default)]
    pub updated_replicas: i64,
    /// The pool's provider ID.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub provider_id: String,
    /// Hash of the template last applied.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub applied_revision: String,
    /// Capacity last applied.
    #[serde(default)]
    pub applied_capacity: i64,
    /// The operation in flight.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub operations: Vec<StoredOperation>,
    /// The last driver call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_operation: Option<LastOperation>,
    /// `Ready` (every instance ready on the latest model), `OperationTokenUnusable`, and the
    /// environment's (`QuotaExceeded`, `CloudCredentialsRefused`, `CloudUnavailable`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// A MachinePool: a cloud-side group of instances (a driver's `Pools` capability), each
/// mirrored as a Machine.
pub type MachinePool = Object<MachinePoolSpec, MachinePoolStatus>;

impl KindOf for MachinePool {
    const KIND: Kind = Kind::MachinePool;
}

impl KindInfo for MachinePool {
    const PLURAL: &'static str = "machinepools";
    const SHORT_NAMES: &'static [&'static str] = &["mp"];
    const ALIASES: &'static [&'static str] = &["mp", "pool", "pools"];
    type Spec = MachinePoolSpec;
    type Status = MachinePoolStatus;
    const COLUMNS: &'static [Column] = &[
        Column::new("Desired", ColumnType::Integer, ".spec.replicas"),
        Column::new("Current", ColumnType::Integer, ".status.replicas").shown(Shown::Table),
        Column::new("Ready", ColumnType::Integer, ".status.readyReplicas"),
        Column::new("Updated", ColumnType::Integer, ".status.updatedReplicas"),
        Column::new("Provider-ID", ColumnType::String, ".status.providerId").shown(Shown::CrdOnly),
        Column::age(),
    ];
    const SCALE: bool = true;
    const WOKEN_BY: &'static [(Kind, Via)] = &[(Kind::Machine, Via::Owner), (Kind::MachineClass, Via::ClassRef)];

    fn rules() -> Vec<checks::Rule> {
        checks::replicated_rules(Kind::MachinePool)
    }

    fn validate(&self) -> Check {
        checks::template(&self.spec.template)
    }
}

// ---------------------------------------------------------------------------------------- Machine

/// Which pool instance a pool Machine stands for.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolInstanceRef {
    /// The MachinePool.
    pub name: String,
    /// The instance ID in the pool.
    pub instance_id: String,
}

/// Desired state of a Machine.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MachineSpec {
    /// The MachineClass.
    pub class_ref: NameRef,
    /// Fields merged over the class's provider spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_spec: Option<Value>,
    /// Set for pool Machines: the instance this Machine mirrors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_ref: Option<PoolInstanceRef>,
    /// Not Running this long after create started → Failed (default 1200).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_timeout_seconds: Option<u64>,
    /// Unhealthy or missing this long → Failed (default 600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_timeout_seconds: Option<u64>,
    /// Node lifecycle settings (copied from the owning deployment or pool; defaults otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<NodeSettings>,
    /// Labels, annotations and taints kept on the Node (from the template).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_template: Option<NodeTemplate>,
}

/// Lifecycle phase of a Machine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum Phase {
    /// Accepted; nothing asked of the cloud yet.
    #[default]
    Pending,
    /// A create operation is in flight.
    Creating,
    /// The VM runs; its Node has not joined or is not Ready yet (only with a target cluster).
    Provisioned,
    /// Up (with a target cluster: its Node is Ready).
    Running,
    /// An in-place update is in flight.
    Updating,
    /// Being deleted.
    Terminating,
    /// Failed; the owner replaces it.
    Failed,
    /// The cloud reports it unhealthy or cannot find it.
    Unknown,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// A condition (Kubernetes shape).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// Type, e.g. `Ready`, `Progressing`, `Failed`.
    #[serde(rename = "type")]
    pub condition_type: ConditionType,
    /// `True`, `False` or `Unknown`.
    pub status: ConditionStatus,
    /// UpperCamel reason.
    pub reason: Reason,
    /// What a person needs to know beyond `reason` (may be empty).
    #[serde(default)]
    pub message: String,
    /// When status last changed.
    pub last_transition_time: Time,
}

/// An operation handle kept in status until the operation is done.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StoredOperation {
    /// Operation kind (`CreateMachine`, ...).
    pub kind: OperationKind,
    /// The driver's operation name.
    pub name: String,
    /// The opaque token, base64.
    pub token: String,
    /// When it started.
    pub started: Time,
    /// Request ID of the call that started it.
    pub request_id: String,
    /// Last progress reported.
    #[serde(default)]
    pub progress: i32,
}

/// The last driver call made for an object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LastOperation {
    /// `Create`, `Delete`, `Update`, `Poll`, `ApplyPool`, ...
    #[serde(rename = "type")]
    pub op_type: OperationType,
    /// `Processing`, `Succeeded`, `Failed`.
    pub state: OperationState,
    /// gRPC code name.
    pub code: String,
    /// ErrorInfo reason.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// The error's message (empty when the call succeeded).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// The request ID of the call.
    pub request_id: String,
    /// When the controller recorded the answer (or the end of its operation).
    pub time: Time,
}

/// A network address.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Address {
    /// InternalIP, ExternalIP, Hostname, ...
    #[serde(rename = "type")]
    pub address_type: String,
    /// An IP address or a host name, per `type`.
    pub address: String,
}

/// A permanent failure, remembered so it is not retried until the spec changes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Failure {
    /// gRPC code name.
    pub code: String,
    /// UPPER_SNAKE: the driver's ErrorInfo reason, or the controller's own
    /// (`CREATION_TIMEOUT`, `HEALTH_TIMEOUT`, `NODE_NOT_JOINED`, `RETRIES_EXHAUSTED`).
    pub reason: String,
    /// The driver's message, or the controller's for its own reasons.
    pub message: String,
    /// The Machine generation it applies to.
    pub generation: i64,
    /// The class generation it applies to.
    #[serde(default)]
    pub class_generation: i64,
}

/// Observed state of a Machine.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineStatus {
    /// Where the machine is in its life: Pending, Creating, Provisioned, Running, Updating,
    /// Terminating, Failed or Unknown.
    #[serde(default)]
    pub phase: Phase,
    /// The cloud's ID.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub provider_id: String,
    /// The cloud machine's addresses, as its driver last reported them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<Address>,
    /// `Ready`, `UpToDate`, `Failed`, `NodeReady`, `Deleting`, `DeletionFailed`,
    /// `OperationTokenUnusable`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The operation in flight (at most one).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub operations: Vec<StoredOperation>,
    /// The last driver call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_operation: Option<LastOperation>,
    /// Request IDs of recent driver calls, newest last.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub request_ids: Vec<String>,
    /// Hash of the provider spec the cloud machine runs.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub spec_hash: String,
    /// The Machine generation the cloud machine was last created or updated from. A newer
    /// generation with a different spec is applied in place (class edits alone are not: they
    /// reach new machines, as in MCM).
    #[serde(default, skip_serializing_if = "is_default")]
    pub observed_generation: i64,
    /// When the first create call was made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub create_started: Option<Time>,
    /// Since when the machine is unhealthy or missing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unhealthy_since: Option<Time>,
    /// A permanent failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<Failure>,
    /// The Node this machine's VM became (with a target cluster).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_ref: Option<NodeRef>,
    /// When the VM came up and the wait for its Node began (`nodeStartupTimeoutSeconds`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioned: Option<Time>,
    /// Where the deletion sequence stands (drain, hooks, VM, Node), so a restarted or newly
    /// elected controller resumes it with the same deadlines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deletion: Option<Deletion>,
}

/// A Node, by name and uid.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeRef {
    /// The Node's name.
    pub name: String,
    /// The Node's uid (a Node re-created under the same name is another node).
    #[serde(default)]
    pub uid: String,
}

/// The steps of a Machine's deletion, in order. Each is recorded with its start time before it
/// acts, so a restart resumes the same step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum DeletionPhase {
    /// Waiting while `pre-drain.delete.hook…` annotations are present.
    PreDrainHooks,
    /// Cordoned and tainted; pods evicted (PodDisruptionBudgets respected) until the deadline.
    Draining,
    /// Waiting for the node's VolumeAttachments to go.
    VolumesDetaching,
    /// Waiting while `pre-terminate.delete.hook…` annotations are present.
    PreTerminateHooks,
    /// The VM is being deleted through the driver; once it is gone, its Node is deleted and the
    /// Machine released (a restart polls the VM's delete again, then does both).
    InstanceDeleting,
}

impl fmt::Display for DeletionPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// Where a Machine's deletion stands.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Deletion {
    /// The current step.
    pub phase: DeletionPhase,
    /// When the current step began.
    pub phase_started: Time,
    /// When the drain began (its deadline is this plus `drainTimeoutSeconds`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_started: Option<Time>,
    /// The drain's deadline: pods still there are deleted so that they are gone by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_deadline: Option<Time>,
    /// Pods still to leave the node at the last look.
    #[serde(default, skip_serializing_if = "is_default")]
    pub pods_left: u32,
    /// What holds the step (a PodDisruptionBudget and the pod it protects, a hook annotation…).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub blocked_by: String,
    /// The node's VM was reported gone or stopped while the node was not Ready: pods were
    /// deleted without eviction (`node.kubernetes.io/out-of-service`).
    #[serde(default, skip_serializing_if = "is_default")]
    pub out_of_service: bool,
    /// Pods were deleted at the drain deadline instead of evicted.
    #[serde(default, skip_serializing_if = "is_default")]
    pub forced: bool,
}

/// A Machine: one cloud machine, created, polled, health-checked and deleted through its
/// class's driver.
pub type Machine = Object<MachineSpec, MachineStatus>;

impl KindOf for Machine {
    const KIND: Kind = Kind::Machine;
}

impl KindInfo for Machine {
    const PLURAL: &'static str = "machines";
    const SHORT_NAMES: &'static [&'static str] = &["ma"];
    const ALIASES: &'static [&'static str] = &["m"];
    type Spec = MachineSpec;
    type Status = MachineStatus;
    const COLUMNS: &'static [Column] = &[
        Column::new("Phase", ColumnType::String, ".status.phase"),
        Column::new("Node", ColumnType::String, ".status.nodeRef.name"),
        Column::new("Provider-ID", ColumnType::String, ".status.providerId"),
        Column::new("Class", ColumnType::String, ".spec.classRef.name").shown(Shown::TableWide),
        Column::computed("Revision", |v| {
            let revision = v.pointer("/metadata/labels").and_then(|l| l.get(LABEL_REVISION)?.as_str());
            revision.unwrap_or("-").to_string()
        })
        .shown(Shown::TableWide),
        Column::new("Address", ColumnType::String, ".status.addresses[0].address").shown(Shown::Wide),
        Column::age(),
        Column::computed("Last-Op", |v| match v.pointer("/status/lastOperation") {
            Some(l) if l.is_object() => {
                let field = |k: &str| l.get(k).and_then(Value::as_str).unwrap_or("").to_string();
                format!("{}/{}/{}", field("type"), field("state"), field("code"))
            }
            _ => "-".into(),
        })
        .shown(Shown::TableWide),
        Column::new("Request-ID", ColumnType::String, ".status.lastOperation.requestId").shown(Shown::Wide),
    ];
    const WOKEN_BY: &'static [(Kind, Via)] = &[(Kind::MachineClass, Via::ClassRef)];

    fn validate(&self) -> Check {
        checks::name("spec.classRef.name", &self.spec.class_ref.name)?;
        checks::object_or_absent("spec.providerSpec", self.spec.provider_spec.as_ref())?;
        if let Some(p) = &self.spec.pool_ref {
            checks::name("spec.poolRef.name", &p.name)?;
        }
        Ok(())
    }

    fn describe_head(status: &Value) -> String {
        let mut out = String::new();
        match status["nodeRef"]["name"].as_str() {
            Some(node) => out += &format!("Node:         {node}\n"),
            None => {
                out += "Node:         <none> (nodes are managed when the controller runs with a target cluster: \
                        run --target-kubeconfig, or --store kubernetes)\n"
            }
        }
        if let Some(d) = status.get("deletion").filter(|d| !d.is_null()) {
            out += &format!(
                "Deletion:     {} since {}\n",
                d["phase"].as_str().unwrap_or(""),
                d["phaseStarted"].as_str().unwrap_or("")
            );
            if let Some(deadline) = d["drainDeadline"].as_str() {
                out += &format!(
                    "  drain:      started {}, deadline {deadline}\n",
                    d["drainStarted"].as_str().unwrap_or("-")
                );
            }
            if let Some(n) = d["podsLeft"].as_u64() {
                out += &format!("  pods left:  {n}\n");
            }
            if let Some(b) = d["blockedBy"].as_str() {
                out += &format!("  blocked by: {b}\n");
            }
            if d["forced"].as_bool() == Some(true) {
                out += "  forced:     pods were deleted at the drain deadline\n";
            }
            if d["outOfService"].as_bool() == Some(true) {
                out += "  out of service: the VM was gone; pods deleted without eviction\n";
            }
        }
        out
    }
}

// ----------------------------------------------------------------------------- MachineHealthCheck

/// Which objects something applies to: those carrying every one of these labels.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LabelSelector {
    /// Labels an object must all carry.
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

impl LabelSelector {
    /// Whether `labels` carry every label of the selector.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.match_labels.iter().all(|(k, v)| labels.get(k) == Some(v))
    }
}

/// A condition of a Machine's Node that makes the Machine unhealthy once it has held this long.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UnhealthyCondition {
    /// The Node condition: `Ready` (the controller follows a Node's Ready condition, which the
    /// Machine mirrors as its `NodeReady` condition).
    #[serde(rename = "type")]
    pub condition_type: String,
    /// `False` or `Unknown`.
    pub status: ConditionStatus,
    /// How long the condition must hold (seconds).
    #[schemars(range(min = 0))]
    pub timeout_seconds: u64,
}

/// Desired state of a MachineHealthCheck.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MachineHealthCheckSpec {
    /// The Machines it checks (at least one label).
    pub selector: LabelSelector,
    /// Node conditions that make a Machine unhealthy. A Machine whose phase is `Failed` is
    /// unhealthy too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unhealthy_conditions: Vec<UnhealthyCondition>,
    /// Remediation stops while more Machines than this are unhealthy (default `100%`): a
    /// number or a percentage of the checked Machines (rounded down).
    #[serde(default = "all_machines")]
    pub max_unhealthy: IntOrPercent,
}

fn all_machines() -> IntOrPercent {
    IntOrPercent::Str("100%".into())
}

impl Default for MachineHealthCheckSpec {
    fn default() -> Self {
        Self { selector: LabelSelector::default(), unhealthy_conditions: Vec::new(), max_unhealthy: all_machines() }
    }
}

/// What a MachineHealthCheck found.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineHealthCheckStatus {
    /// Machines it checks (its selector's, not being deleted).
    #[serde(default)]
    pub expected_machines: i64,
    /// Of those, the healthy ones.
    #[serde(default)]
    pub current_healthy: i64,
    /// How many more Machines may be remediated before `maxUnhealthy` stops it.
    #[serde(default)]
    pub remediations_allowed: i64,
    /// The unhealthy Machines, by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unhealthy: Vec<String>,
    /// The generation last checked.
    #[serde(default, skip_serializing_if = "is_default")]
    pub observed_generation: i64,
    /// Conditions (`RemediationAllowed`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// A MachineHealthCheck: deletes unhealthy Machines of deployments and pools, which replace
/// them (Cluster API's MachineHealthCheck, simplified).
pub type MachineHealthCheck = Object<MachineHealthCheckSpec, MachineHealthCheckStatus>;

impl KindOf for MachineHealthCheck {
    const KIND: Kind = Kind::MachineHealthCheck;
}

impl KindInfo for MachineHealthCheck {
    const PLURAL: &'static str = "machinehealthchecks";
    const SHORT_NAMES: &'static [&'static str] = &["mhc"];
    const ALIASES: &'static [&'static str] = &["mhc", "healthcheck", "healthchecks"];
    type Spec = MachineHealthCheckSpec;
    type Status = MachineHealthCheckStatus;
    const COLUMNS: &'static [Column] = &[
        Column::new("Expected", ColumnType::Integer, ".status.expectedMachines"),
        Column::new("Healthy", ColumnType::Integer, ".status.currentHealthy"),
        Column::new("Remediations-Allowed", ColumnType::Integer, ".status.remediationsAllowed"),
        Column::new("Max-Unhealthy", ColumnType::String, ".spec.maxUnhealthy").shown(Shown::Wide),
        Column::age(),
    ];
    // A Machine's phase, conditions and labels change its health and whether it is checked.
    const WOKEN_BY: &'static [(Kind, Via)] = &[(Kind::Machine, Via::Selector)];

    fn describe_tail(status: &Value) -> String {
        let n = |k: &str| status.get(k).and_then(Value::as_i64).unwrap_or(0);
        let mut out = format!(
            "Machines:     {} checked, {} healthy, {} more may be remediated\n",
            n("expectedMachines"),
            n("currentHealthy"),
            n("remediationsAllowed")
        );
        if let Some(names) = status.get("unhealthy").and_then(Value::as_array) {
            let names: Vec<&str> = names.iter().filter_map(Value::as_str).collect();
            out += &format!("Unhealthy:    {}\n", names.join(", "));
        }
        out
    }

    fn validate(&self) -> Check {
        if self.spec.selector.match_labels.is_empty() {
            return checks::fail("spec.selector.matchLabels", "must name at least one label");
        }
        for (i, c) in self.spec.unhealthy_conditions.iter().enumerate() {
            if c.condition_type != "Ready" {
                let why =
                    format!("must be Ready (the Node condition the controller follows), got {:?}", c.condition_type);
                return checks::fail(&format!("spec.unhealthyConditions[{i}].type"), why);
            }
            if c.status == ConditionStatus::True {
                return checks::fail(&format!("spec.unhealthyConditions[{i}].status"), "must be False or Unknown");
            }
        }
        if let Err(why) = self.spec.max_unhealthy.resolve(100, false) {
            return checks::fail("spec.maxUnhealthy", why);
        }
        Ok(())
    }
}

impl MachineDeploymentSpec {
    /// The node settings its machines get.
    pub fn node_settings(&self) -> NodeSettings {
        NodeSettings {
            node_startup_timeout_seconds: self.node_startup_timeout_seconds,
            drain_timeout_seconds: self.drain_timeout_seconds,
            volume_detach_timeout_seconds: self.volume_detach_timeout_seconds,
        }
    }
}

impl MachinePoolSpec {
    /// The node settings its instances' machines get.
    pub fn node_settings(&self) -> NodeSettings {
        NodeSettings {
            node_startup_timeout_seconds: self.node_startup_timeout_seconds,
            drain_timeout_seconds: self.drain_timeout_seconds,
            volume_detach_timeout_seconds: self.volume_detach_timeout_seconds,
        }
    }
}

impl Machine {
    /// Its node settings: the spec's, else the defaults.
    pub fn node_settings(&self) -> NodeSettings {
        self.spec.node.unwrap_or_default()
    }

    /// The deployment or pool that owns this machine, if any.
    pub fn owner(&self) -> Option<(Kind, &str)> {
        self.metadata.owner_references.iter().find(|o| o.controller).and_then(|o| {
            let kind = Kind::from_name(&o.kind)?;
            Some((kind, o.name.as_str()))
        })
    }

    /// Whether a delete was asked for.
    pub fn is_deleting(&self) -> bool {
        self.metadata.deletion_timestamp.is_some()
    }
}

// ---------------------------------------------------------------------------------------- helpers

/// Sets a condition (`True` when `holds`), keeping its transition time when the status does
/// not change. Returns whether anything changed.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    condition_type: ConditionType,
    holds: bool,
    reason: Reason,
    message: &str,
) -> bool {
    let status = ConditionStatus::from(holds);
    match conditions.iter_mut().find(|c| c.condition_type == condition_type) {
        Some(c) if c.status == status && c.reason == reason && c.message == message => false,
        Some(c) => {
            if c.status != status {
                c.last_transition_time = chrono::Utc::now();
            }
            c.status = status;
            c.reason = reason;
            c.message = message.into();
            true
        }
        None => {
            conditions.push(Condition {
                condition_type,
                status,
                reason,
                message: message.into(),
                last_transition_time: chrono::Utc::now(),
            });
            true
        }
    }
}

/// The condition of this type, if set.
pub fn condition(conditions: &[Condition], condition_type: ConditionType) -> Option<&Condition> {
    conditions.iter().find(|c| c.condition_type == condition_type)
}

/// Removes the condition of this type.
pub fn remove_condition(conditions: &mut Vec<Condition>, condition_type: ConditionType) {
    conditions.retain(|c| c.condition_type != condition_type);
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
    fn conditions_keep_transition_time_unless_status_changes() {
        let mut c = Vec::new();
        assert!(set_condition(&mut c, ConditionType::Ready, false, Reason::Creating, ""));
        let t = c[0].last_transition_time;
        assert!(!set_condition(&mut c, ConditionType::Ready, false, Reason::Creating, ""));
        assert!(set_condition(&mut c, ConditionType::Ready, false, Reason::Pending, "x"));
        assert_eq!(c[0].last_transition_time, t);
    }
}
