//! What every object has: `apiVersion`, `kind` and `metadata` ([`ObjectMeta`]); the typed
//! [`Object`] of a kind with a spec and a status; the [`Resource`] and [`KindOf`] traits that tie
//! a type to its [`Kind`]; and the names this API gives its labels, annotations, finalizers,
//! taints and cloud tags.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::registry::Kind;

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
/// Annotation that asks the owner to remediate (replace) this machine whatever its health
/// (Cluster API's `remediate-machine`).
pub const ANNOTATION_REMEDIATE: &str = "machine.driver.dev/remediate";
/// Annotation that keeps this machine from being remediated (a failed machine kept for
/// inspection): neither a health check nor its owner replaces it.
pub const ANNOTATION_SKIP_REMEDIATION: &str = "machine.driver.dev/skip-remediation";
/// Annotation the owner sets on a machine it took for a disruption, before it acts (value: the
/// [`DisruptionReason`](super::DisruptionReason)): a machine being remediated counts against
/// `remediation.maxInFlight` until it is gone, across restarts.
pub const ANNOTATION_DISRUPTION: &str = "machine.driver.dev/disruption-reason";
/// Annotation the owner writes with a new spec it moves a machine to in place: what the driver
/// said the update does ([`InPlaceDisruption`](super::InPlaceDisruption): `None`, `Drain`,
/// `Reboot`). A Machine whose spec changes without it is treated as `Reboot`.
pub const ANNOTATION_IN_PLACE_DISRUPTION: &str = "machine.driver.dev/in-place-disruption";
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
/// The taint the cluster-autoscaler puts on a node it is about to drain and remove (value: a
/// unix time). A Machine whose removal the autoscaler asked for (`DeleteNodes`: disruption
/// `Autoscaler`) is not drained again once nothing is left to evict; any other removal drains as
/// always, taint or not.
pub const TAINT_AUTOSCALER_DELETING: &str = "ToBeDeletedByClusterAutoscaler";
/// The `NoSchedule` taint a draining node carries (besides `spec.unschedulable`).
pub const TAINT_DRAINING: &str = "machine.driver.dev/draining";
/// Node annotation listing the label, annotation and taint keys this controller put there from
/// the machine template (so a key removed from the template is removed from the Node, while
/// keys others added stay).
pub const ANNOTATION_OWNED_NODE_METADATA: &str = "machine.driver.dev/owned-node-metadata";

/// Timestamps are RFC 3339, UTC.
pub type Time = chrono::DateTime<chrono::Utc>;

fn default_namespace() -> String {
    "default".into()
}

pub(crate) fn is_default<T: Default + PartialEq>(v: &T) -> bool {
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

impl OwnerReference {
    /// The reference to the owner that manages the object (`controller: true`): the `kind`
    /// object `name` with uid `uid`, of this API ([`API_VERSION`]). What the controller sets on
    /// the Machines a MachineDeployment or a MachinePool makes.
    pub fn controller_of(kind: Kind, name: &str, uid: &str) -> Self {
        OwnerReference {
            api_version: API_VERSION.into(),
            kind: kind.as_str().into(),
            name: name.into(),
            uid: uid.into(),
            controller: true,
        }
    }
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
