//! The fake cloud's "kubelets" (`fake-driver --join-cluster KUBECONFIG`): a background task that
//! makes the cloud's VMs join a Kubernetes cluster the way a kubelet registers, and lets their
//! Nodes go stale the way real ones do when a kubelet stops or a VM vanishes.
//!
//! Every [`TICK`] it compares the cloud with the Nodes it registered ([`plan`], a pure function):
//!
//! - a machine or pool instance that booted (RUNNING or UPDATING) and has no Node yet gets one
//!   (`node`): name = its `Hostname` address, `spec.providerID` = the provider ID the driver
//!   reports, the well-known labels, capacity by machine type, and the annotation
//!   `kwok.x-k8s.io/node: fake`, so that kwok makes it Ready and heart-beats it. A Node of that
//!   name with the same provider ID is kept (create only, never overwrite), except that it gets
//!   the kwok annotation back if it should have it and lacks it (the Node of a kubelet started
//!   again, below); one with another provider ID (a stale Node of an earlier VM of that name) is
//!   waited out;
//! - a VM that no longer exists (deleted, or `RemoveMachine`) or whose kubelet stopped
//!   (`StopKubelet`) keeps its Node — a cloud does not delete Nodes, the controller does — but
//!   the Node is marked the way kube-controller-manager marks a kubelet that stopped posting
//!   status: the kwok annotation is removed and its conditions turn `Unknown` /
//!   `NodeStatusUnknown` (through `nodes/status`);
//! - a kubelet started again (`StartKubelet`) registers like a new one: its Node, if still
//!   there, gets the kwok annotation back (kwok then sees it again and makes it Ready), else it is
//!   created anew; the Node is no longer watched to keep it marked (below);
//!
//!   kwok (0.8) does not let go of a Node when its annotation goes (its informer filters that
//!   update out, so it never hears of it) and its heartbeat stage re-arms itself from each
//!   heartbeat's result: a heartbeat already scheduled still turns the Node Ready once, within
//!   its stage's delay (20–45 s by default). The mark therefore also removes `status.phase`
//!   (kwok's `Running`, which no kubelet sets), so that after that last heartbeat no kwok stage
//!   matches and kwok stops; and the task watches the Nodes it marked for [`SETTLE`] after the
//!   mark and marks again at once whatever undoes it, unless the kubelet was started again;
//! - a VM that rebooted (an in-place update whose spec says `inPlaceDisruption: Reboot` or
//!   `Unset`) has a new boot ID ([`Vm::boot_id`]): its Node's `status.nodeInfo.bootID`, set at
//!   registration, is patched to it through `nodes/status`, as a kubelet posts its status after a
//!   reboot. The boot ID each Node was last seen with is kept (from the registration, the Node
//!   found, and every watch event of a registered Node), so one that something else overwrote is
//!   posted again. kwok (0.8) keeps it: its `node-initialize` stage renders `nodeInfo.bootID` from
//!   the Node's own (`or $nodeInfo.bootID ""`) and its heartbeat writes only the conditions;
//! - the provider spec field `kubelet` ([`KubeletMode`]): `NeverJoins` registers nothing,
//!   `JoinsNotReady` registers without the kwok annotation and with `Ready=False` /
//!   `KubeletNotReady`.
//!
//! Only Nodes whose provider ID starts with [`PROVIDER_PREFIX`] are ever changed. Registered
//! Nodes carry [`CLOUD_ANNOTATION`] (the cloud's ID, kept in the state file), so a restarted
//! sidecar finds its Nodes again and marks those whose VM vanished meanwhile. API errors are
//! logged (warn, at most every 30 s per subject) and retried on the next tick; a Node whose
//! registration or mark failed (it may have been half done), or which a restarted sidecar finds
//! without the kwok annotation, is "in doubt": marked (again) while its VM is gone or its kubelet
//! stopped, registered (again) while its kubelet reports. The cloud's lock is held only to copy
//! its VMs, so the gRPC server is not slowed. Memory: the names and provider IDs of the
//! registered Nodes (and their boot IDs), of those in doubt, and of those marked in the last
//! [`SETTLE`].
//!
//! The Kubernetes client behind all this (`node`, `config`, `spawn`: kube and
//! k8s-openapi, about a quarter of the executable's code) is compiled only with the cargo feature
//! `join-cluster`, which the test suite (`e2e-tests`) turns on; the sidecar without it is the
//! fake cloud alone. The rest of this module (the modes, [`plan`]) is always there.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde_json::Value;

#[cfg(feature = "join-cluster")]
mod cluster;
#[cfg(feature = "join-cluster")]
pub mod join;
#[cfg(feature = "join-cluster")]
pub use cluster::{
    boot_id, config, is_fake, node, node_with, reboot_status_patch, restart_patch, spawn, stopped_status_patch,
};

/// How often the kubelets compare the cloud with the cluster.
pub const TICK: Duration = Duration::from_millis(300);
/// The annotation kwok manages Nodes by (`--manage-nodes-with-annotation-selector`).
pub const KWOK_ANNOTATION: &str = "kwok.x-k8s.io/node";
/// The annotation naming the fake cloud that registered a Node.
pub const CLOUD_ANNOTATION: &str = "fake.machinedriver.dev/cloud";
/// Every provider ID the fake cloud issues starts with this.
pub const PROVIDER_PREFIX: &str = "fake:///";
/// Reason and message of a condition whose kubelet stopped posting status (as
/// kube-controller-manager's node lifecycle controller writes them).
pub const STOPPED_REASON: &str = "NodeStatusUnknown";
/// See [`STOPPED_REASON`].
pub const STOPPED_MESSAGE: &str = "Kubelet stopped posting node status.";
/// How long after its mark a Node is watched, and marked again if something (a kwok heartbeat
/// scheduled before the mark) undoes it: beyond kwok's default heartbeat delay (20 + 25 s).
pub const SETTLE: Duration = Duration::from_secs(75);

/// How a machine's kubelet behaves: provider spec field `kubelet` (a test aid).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KubeletMode {
    /// Registers the Node with the kwok annotation: kwok makes it Ready (the default).
    #[default]
    Joins,
    /// The VM runs but no Node is ever registered.
    NeverJoins,
    /// Registers the Node without the kwok annotation and with `Ready=False`: never Ready.
    JoinsNotReady,
}

impl KubeletMode {
    /// The mode a provider spec asks for (absent or unknown: [`KubeletMode::Joins`]; the schema
    /// refuses unknown values).
    pub fn of(spec: &Value) -> Self {
        match spec.get("kubelet").and_then(Value::as_str) {
            Some("NeverJoins") => Self::NeverJoins,
            Some("JoinsNotReady") => Self::JoinsNotReady,
            _ => Self::Joins,
        }
    }
}

/// A VM (machine or pool instance) as its kubelet sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vm {
    /// Its `Hostname` address: the Node's name.
    pub hostname: String,
    /// The provider ID the driver reports.
    pub provider_id: String,
    /// Its `InternalIP` address.
    pub ip: String,
    /// `small`, `medium` or `large`.
    pub machine_type: String,
    /// Its zone (`topology.kubernetes.io/zone`).
    pub zone: String,
    /// Running or updating: its kubelet is up.
    pub booted: bool,
    /// Provider spec field `kubelet`.
    pub kubelet: KubeletMode,
    /// `StopKubelet` was called (and no `StartKubelet` since).
    pub stopped: bool,
    /// The ID of its current boot: its Node's `status.nodeInfo.bootID`. A reboot (an in-place
    /// update that says `Reboot` or `Unset`) changes it.
    pub boot_id: String,
}

impl Vm {
    /// Whether its kubelet is up and registers a Node: booted, not stopped, and not
    /// [`KubeletMode::NeverJoins`].
    pub fn reports(&self) -> bool {
        self.booted && !self.stopped && self.kubelet != KubeletMode::NeverJoins
    }
}

/// A kubelet's credentials once it joined by TLS bootstrap: the kubeconfig it writes to
/// `/var/lib/kubelet/kubeconfig` (the API server and its CA from the bootstrap kubeconfig, the
/// signed client certificate `system:node:<name>` and its key inline). Kept with the VM in the
/// cloud's state. `Debug` shows none of it.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Credentials {
    /// The kubeconfig (YAML).
    pub kubeconfig: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Credentials([REDACTED])")
    }
}

/// What one pass does.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// VMs whose Node to register.
    pub register: Vec<Vm>,
    /// Registered Nodes (name, provider ID) to mark as no longer reporting.
    pub mark_gone: Vec<(String, String)>,
    /// VMs whose registered Node shows another boot ID than theirs (they rebooted): their
    /// kubelet posts the new one.
    pub reboot: Vec<Vm>,
}

/// Compares the cloud's VMs with the Nodes registered so far (name → provider ID), those in
/// doubt ((name, provider ID): a registration or mark that failed, an unannotated Node found after
/// a restart) and the boot IDs their Nodes were last seen with (name → boot ID). Registered and
/// doubtful Nodes whose VM is gone or whose kubelet stopped are marked; VMs whose kubelet reports
/// ([`Vm::reports`]) and whose Node is not registered (a doubtful one included, or one whose
/// kubelet was started again) are registered; those whose registered Node was seen with another
/// boot ID (the VM rebooted) post theirs. A Node whose boot ID was not seen is left as it is.
pub fn plan(
    vms: &[Vm],
    registered: &BTreeMap<String, String>,
    in_doubt: &BTreeSet<(String, String)>,
    boots: &BTreeMap<String, String>,
) -> Plan {
    let alive: BTreeSet<(&str, &str)> =
        vms.iter().filter(|v| !v.stopped).map(|v| (v.hostname.as_str(), v.provider_id.as_str())).collect();
    let mark_gone: BTreeSet<(&String, &String)> = registered
        .iter()
        .chain(in_doubt.iter().map(|(name, pid)| (name, pid)))
        .filter(|(name, pid)| !alive.contains(&(name.as_str(), pid.as_str())))
        .collect();
    let (register, known): (Vec<&Vm>, Vec<&Vm>) =
        vms.iter().filter(|v| v.reports()).partition(|v| registered.get(&v.hostname) != Some(&v.provider_id));
    let reboot =
        known.into_iter().filter(|v| boots.get(&v.hostname).is_some_and(|seen| *seen != v.boot_id)).cloned().collect();
    Plan {
        register: register.into_iter().cloned().collect(),
        mark_gone: mark_gone.into_iter().map(|(name, pid)| (name.clone(), pid.clone())).collect(),
        reboot,
    }
}

/// The pod capacity a registered Node reports: the kubelet's default `--max-pods`.
pub const MAX_PODS: &str = "110";

/// CPUs and memory of a machine type.
pub fn capacity(machine_type: &str) -> (&'static str, &'static str) {
    match machine_type {
        "medium" => ("4", "8Gi"),
        "large" => ("8", "16Gi"),
        _ => ("2", "4Gi"),
    }
}
