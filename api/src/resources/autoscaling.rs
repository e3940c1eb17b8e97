//! `spec.autoscaling` of a MachineDeployment or MachinePool: the bounds within which the
//! cluster-autoscaler (through the controller's externalgrpc server) sizes it, and the
//! scale-down options the owner sets for its node group; the machine capacity a class declares
//! (`MachineClass.spec.capacity`), from which the autoscaler learns what a new node would hold
//! before one exists (scale from zero).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::checks::{self, Check};
use super::disruption::parse_duration;

/// Annotation on an autoscaled owner: the autoscaler's last size change, written in the same
/// write as `replicas` (`2026-11-28T10:00:00Z IncreaseSize 1 -> 3`).
pub const ANNOTATION_AUTOSCALER_LAST_CHANGE: &str = "machine.driver.dev/autoscaler-last-size-change";

/// `spec.autoscaling`: the owner is a node group of the cluster-autoscaler, which sets
/// `replicas` within `[minReplicas, maxReplicas]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Autoscaling {
    /// The autoscaler never goes below this many machines.
    #[schemars(range(min = 0))]
    pub min_replicas: i64,
    /// The autoscaler never goes above this many machines.
    #[schemars(range(min = 0))]
    pub max_replicas: i64,
    /// Scale-down options for this group; each one left out is the autoscaler's own flag.
    #[serde(default, skip_serializing_if = "super::is_default")]
    pub scale_down: ScaleDownOptions,
}

/// What the autoscaler weighs before removing a node of this group (its
/// `NodeGroupAutoscalingOptions`); each field left out takes the autoscaler's flag.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ScaleDownOptions {
    /// A node whose pods request less than this share of its allocatable CPU and memory is a
    /// candidate (`--scale-down-utilization-threshold`, 0 to 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub utilization_threshold: Option<f64>,
    /// The same for GPU nodes (`--scale-down-gpu-utilization-threshold`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub gpu_utilization_threshold: Option<f64>,
    /// How long a node must be unneeded before it goes (`10m`; `--scale-down-unneeded-time`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    pub unneeded_time: Option<String>,
    /// How long an unready node must be unneeded before it goes (`--scale-down-unready-time`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    pub unready_time: Option<String>,
    /// How long a new machine may take to register its Node before the autoscaler gives up on it
    /// (`--max-node-provision-time`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    pub max_node_provision_time: Option<String>,
    /// Count DaemonSet pods out of a node's utilization (`--ignore-daemonsets-utilization`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_daemon_sets_utilization: Option<bool>,
}

impl Autoscaling {
    /// `replicas` brought within the bounds.
    pub fn clamp(&self, replicas: i64) -> i64 {
        replicas.max(self.min_replicas).min(self.max_replicas.max(self.min_replicas))
    }

    /// Checks what the CRD schema and rules cannot: the durations read (the bounds, the
    /// thresholds and `replicas` within the bounds are the CRD's and `apply`'s rules).
    /// `Err((field below spec.autoscaling, message))`.
    ///
    /// # Errors
    /// The first duration that does not read, and why.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        let s = &self.scale_down;
        for (field, value) in [
            ("scaleDown.unneededTime", &s.unneeded_time),
            ("scaleDown.unreadyTime", &s.unready_time),
            ("scaleDown.maxNodeProvisionTime", &s.max_node_provision_time),
        ] {
            if let Some(v) = value {
                parse_duration(v).map_err(|why| (field, why))?;
            }
        }
        Ok(())
    }

    /// A duration option read (checked by [`Autoscaling::check`]; `None` when absent or unreadable).
    pub fn duration(value: Option<&String>) -> Option<std::time::Duration> {
        parse_duration(value?).ok()?.to_std().ok()
    }
}

/// Checks `spec.autoscaling`'s durations.
pub(crate) fn check(autoscaling: Option<&Autoscaling>) -> Check {
    let Some(a) = autoscaling else { return Ok(()) };
    a.check().map_err(|(field, why)| (format!("spec.autoscaling.{field}"), why))
}

/// `MachineClass.spec.capacity`: what one machine of the class offers the scheduler, as a Node's
/// `status.capacity` says it (quantities like `4`, `16Gi`, `110`). The autoscaler builds the node
/// a group would add from it (scale from zero).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Capacity {
    /// CPUs (`4`, `3500m`).
    pub cpu: String,
    /// Memory (`16Gi`).
    pub memory: String,
    /// Pods (default 110, the kubelet's `--max-pods`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<String>,
    /// Ephemeral storage (`100Gi`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ephemeral_storage: Option<String>,
    /// GPUs (`nvidia.com/gpu` on the node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus: Option<u32>,
    /// Further extended resources by name (`example.com/fpga: "1"`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub extended: BTreeMap<String, String>,
}

/// The resource name GPUs are counted under.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// The kubelet's default `--max-pods`.
pub const DEFAULT_MAX_PODS: &str = "110";

impl Capacity {
    /// The Node's `status.capacity`: resource name → quantity.
    pub fn resources(&self) -> BTreeMap<String, String> {
        let mut out = BTreeMap::from([
            ("cpu".to_string(), self.cpu.clone()),
            ("memory".to_string(), self.memory.clone()),
            ("pods".to_string(), self.pods.clone().unwrap_or_else(|| DEFAULT_MAX_PODS.into())),
        ]);
        if let Some(s) = &self.ephemeral_storage {
            out.insert("ephemeral-storage".into(), s.clone());
        }
        if let Some(g) = self.gpus.filter(|g| *g > 0) {
            out.insert(GPU_RESOURCE.into(), g.to_string());
        }
        out.extend(self.extended.iter().map(|(k, v)| (k.clone(), v.clone())));
        out
    }

    /// Checks each quantity reads as a Kubernetes quantity.
    pub(crate) fn check(&self) -> Check {
        let mut fields = vec![("spec.capacity.cpu", self.cpu.as_str()), ("spec.capacity.memory", self.memory.as_str())];
        fields.extend(self.pods.as_deref().map(|p| ("spec.capacity.pods", p)));
        fields.extend(self.ephemeral_storage.as_deref().map(|p| ("spec.capacity.ephemeralStorage", p)));
        for (field, q) in fields {
            if !is_quantity(q) {
                return checks::fail(field, format!("{q:?} is not a quantity (like 4, 500m, 16Gi)"));
            }
        }
        for (name, q) in &self.extended {
            if !is_quantity(q) {
                return Err((format!("spec.capacity.extended.{name}"), format!("{q:?} is not a quantity (like 1, 2)")));
            }
        }
        Ok(())
    }
}

/// Whether `s` reads as a Kubernetes quantity: a decimal number and an optional suffix.
fn is_quantity(s: &str) -> bool {
    const SUFFIXES: [&str; 14] = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "n", "u", "m", "k", "M", "G", "T", "P"];
    let number = SUFFIXES.iter().find_map(|x| s.strip_suffix(x)).unwrap_or(s);
    let number = number.strip_suffix('E').unwrap_or(number);
    !number.is_empty()
        && number.chars().filter(|c| *c == '.').count() <= 1
        && number.chars().all(|c| c.is_ascii_digit() || c == '.')
        && number.chars().any(|c| c.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_clamp_and_durations_are_checked() {
        let ok = Autoscaling { min_replicas: 1, max_replicas: 5, ..Default::default() };
        assert_eq!(ok.check(), Ok(()));
        assert_eq!((ok.clamp(0), ok.clamp(3), ok.clamp(9)), (1, 3, 5));
        let mut bad = ok.clone();
        bad.scale_down.unneeded_time = Some("ten minutes".into());
        assert_eq!(check(Some(&bad)).unwrap_err().0, "spec.autoscaling.scaleDown.unneededTime");
        assert_eq!(check(None), Ok(()));
    }

    #[test]
    fn capacity_becomes_node_resources_and_rejects_what_is_not_a_quantity() {
        let c = Capacity { cpu: "4".into(), memory: "16Gi".into(), gpus: Some(1), ..Default::default() };
        assert_eq!(c.check(), Ok(()));
        let r = c.resources();
        assert_eq!(r["pods"], "110");
        assert_eq!(r[GPU_RESOURCE], "1");
        for good in ["4", "500m", "16Gi", "1.5", "2E"] {
            assert!(is_quantity(good), "{good}");
        }
        for bad in ["", "four", "16GB", "1.2.3", "-1", "Gi"] {
            assert!(!is_quantity(bad), "{bad}");
        }
        let bad = Capacity { cpu: "lots".into(), memory: "1Gi".into(), ..Default::default() };
        assert_eq!(bad.check().unwrap_err().0, "spec.capacity.cpu");
    }
}
