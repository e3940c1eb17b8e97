//! What a node group's next node would look like (`NodeGroupTemplateNodeInfo`), from its class's
//! `spec.capacity` and its template, and the group's scale-down options
//! (`NodeGroupGetOptions`).

use std::collections::BTreeMap;

use autoscaler_proto::node::{self, Quantity};
use autoscaler_proto::pb;
use serde_json::Value;
use tonic::Status;

use super::groups::Group;
use crate::resources::*;

/// The label a GPU node carries (the answer to `GPULabel`; the template node of a class with
/// GPUs carries it).
pub const GPU_LABEL: &str = "machine.driver.dev/accelerator";

/// A string field of the provider spec: the template's, else the class's.
fn provider_field<'a>(template: Option<&'a Value>, class: Option<&'a Value>, names: &[&str]) -> Option<&'a str> {
    [template, class].into_iter().flatten().find_map(|spec| names.iter().find_map(|n| spec.get(*n)?.as_str()))
}

/// The protobuf `v1.Node` a new machine of the group would register: the class's capacity, the
/// template's node labels and taints, the zone and machine type of the provider spec.
///
/// # Errors
/// `UNIMPLEMENTED` when the class declares no capacity (the autoscaler then uses a live node of
/// the group as the template), `NOT_FOUND` when the class is missing.
pub fn node_bytes(g: &Group, class: Option<&MachineClass>) -> Result<Vec<u8>, Status> {
    let class = class.ok_or_else(|| {
        Status::not_found(format!("MachineClass {}/{} of node group {} not found", g.key.namespace, g.class, g.id))
    })?;
    // The class's own word, else its driver's (reported when it validated the class).
    let resources = match &class.spec.capacity {
        Some(c) => c.resources(),
        None if !class.status.capacity.is_empty() => class.status.capacity.clone(),
        None => {
            return Err(Status::unimplemented(format!(
                "MachineClass {} has no spec.capacity and its driver reported none: the autoscaler takes a live \
                 node of {} as the template (and cannot scale it from zero)",
                g.class, g.id
            )))
        }
    };
    let tspec = &g.template.spec;
    let node_template = tspec.node_template.clone().unwrap_or_default();
    let mut labels: BTreeMap<String, String> =
        BTreeMap::from([("kubernetes.io/os".into(), "linux".into()), ("kubernetes.io/arch".into(), "amd64".into())]);
    let (t, c) = (tspec.provider_spec.as_ref(), Some(&class.spec.provider_spec));
    if let Some(zone) = provider_field(t, c, &["zone", "availabilityZone", "location"]) {
        labels.insert("topology.kubernetes.io/zone".into(), zone.into());
    }
    if let Some(kind) = provider_field(t, c, &["machineType", "instanceType", "vmSize", "sku"]) {
        labels.insert("node.kubernetes.io/instance-type".into(), kind.into());
    }
    let mut resources = resources;
    // A node without a pod count would fit no pod: the kubelet's default.
    resources.entry("pods".into()).or_insert_with(|| DEFAULT_MAX_PODS.into());
    if resources.get(GPU_RESOURCE).is_some_and(|n| n != "0") {
        labels.insert(GPU_LABEL.into(), "true".into());
    }
    labels.extend(node_template.labels.clone());
    let resources: BTreeMap<String, Quantity> =
        resources.into_iter().map(|(k, v)| (k, Quantity { string: Some(v) })).collect();
    let name = format!("template-node-for-{}", g.id.replace('/', "-").to_ascii_lowercase());
    let node = node::Node {
        metadata: Some(node::ObjectMeta { name: Some(name), labels, annotations: node_template.annotations.clone() }),
        spec: Some(node::NodeSpec {
            provider_id: None,
            taints: node_template
                .taints
                .iter()
                .map(|t| node::Taint {
                    key: Some(t.key.clone()),
                    value: (!t.value.is_empty()).then(|| t.value.clone()),
                    effect: Some(t.effect.as_str().to_string()),
                })
                .collect(),
        }),
        status: Some(node::NodeStatus {
            capacity: resources.clone(),
            allocatable: resources,
            conditions: vec![node::NodeCondition { r#type: Some("Ready".into()), status: Some("True".into()) }],
        }),
    };
    Ok(node.encode())
}

fn duration(value: Option<&String>) -> Option<autoscaler_proto::prost_types::Duration> {
    let d = Autoscaling::duration(value)?;
    Some(autoscaler_proto::prost_types::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    })
}

/// The group's options: what it sets over the autoscaler's `defaults` (which it sends, and which
/// must come back for what the group leaves alone: a missing duration would be read as 0).
pub fn options(s: &ScaleDownOptions, defaults: pb::NodeGroupAutoscalingOptions) -> pb::NodeGroupAutoscalingOptions {
    let mut o = defaults;
    if let Some(v) = s.utilization_threshold {
        o.scale_down_utilization_threshold = v;
    }
    if let Some(v) = s.gpu_utilization_threshold {
        o.scale_down_gpu_utilization_threshold = v;
    }
    if let Some(v) = s.ignore_daemon_sets_utilization {
        o.ignore_daemon_sets_utilization = v;
    }
    if let Some(d) = duration(s.unneeded_time.as_ref()) {
        o.scale_down_unneeded_duration = Some(d);
    }
    if let Some(d) = duration(s.unready_time.as_ref()) {
        o.scale_down_unready_duration = Some(d);
    }
    if let Some(d) = duration(s.max_node_provision_time.as_ref()) {
        o.max_node_provision_duration = Some(d);
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Key;

    fn group(template: MachineTemplate) -> Group {
        Group {
            id: "default/web".into(),
            key: Key::new(Kind::MachineDeployment, "default", "web"),
            autoscaling: Autoscaling { min_replicas: 0, max_replicas: 5, ..Default::default() },
            replicas: 0,
            class: "small".into(),
            template,
            instances: Vec::new(),
        }
    }

    fn template() -> MachineTemplate {
        serde_json::from_value(serde_json::json!({
            "spec": {
                "classRef": {"name": "small"},
                "providerSpec": {"zone": "zone-b"},
                "nodeTemplate": {"labels": {"tier": "web"}, "taints": [{"key": "dedicated", "value": "web", "effect": "NoSchedule"}]}
            }
        }))
        .unwrap()
    }

    #[test]
    fn the_template_node_has_the_class_capacity_and_the_template_labels_taints_and_zone() {
        use autoscaler_proto::node::Node;
        let mut class = MachineClass::new(
            "default",
            "small",
            MachineClassSpec {
                driver: "fake".into(),
                provider_spec: serde_json::json!({"machineType": "small", "zone": "zone-a"}),
                ..Default::default()
            },
        );
        let g = group(template());
        assert_eq!(node_bytes(&g, Some(&class)).unwrap_err().code(), tonic::Code::Unimplemented);
        assert_eq!(node_bytes(&g, None).unwrap_err().code(), tonic::Code::NotFound);
        class.status.capacity = BTreeMap::from([("cpu".into(), "8".into()), ("memory".into(), "16Gi".into())]);
        let reported = Node::decode_bytes(&node_bytes(&g, Some(&class)).unwrap()).unwrap();
        assert_eq!(reported.status.unwrap().capacity["cpu"].string.as_deref(), Some("8"), "the driver's word");
        class.spec.capacity = Some(Capacity { cpu: "2".into(), memory: "4Gi".into(), ..Default::default() });
        let node = Node::decode_bytes(&node_bytes(&g, Some(&class)).unwrap()).unwrap();
        let meta = node.metadata.unwrap();
        assert_eq!(meta.labels["tier"], "web");
        assert_eq!(meta.labels["topology.kubernetes.io/zone"], "zone-b", "the template's zone wins");
        assert_eq!(meta.labels["node.kubernetes.io/instance-type"], "small");
        let status = node.status.unwrap();
        assert_eq!(status.allocatable["cpu"].string.as_deref(), Some("2"));
        assert_eq!(status.capacity["pods"].string.as_deref(), Some("110"));
        let taint = &node.spec.unwrap().taints[0];
        assert_eq!((taint.key.as_deref(), taint.effect.as_deref()), (Some("dedicated"), Some("NoSchedule")));
    }

    #[test]
    fn options_override_only_what_the_group_sets() {
        let defaults = pb::NodeGroupAutoscalingOptions {
            scale_down_utilization_threshold: 0.5,
            scale_down_unneeded_duration: Some(autoscaler_proto::prost_types::Duration { seconds: 600, nanos: 0 }),
            max_node_provision_duration: Some(autoscaler_proto::prost_types::Duration { seconds: 900, nanos: 0 }),
            ..Default::default()
        };
        let set = ScaleDownOptions {
            utilization_threshold: Some(0.3),
            unneeded_time: Some("2m".into()),
            ..Default::default()
        };
        let o = options(&set, defaults);
        assert_eq!(o.scale_down_utilization_threshold, 0.3);
        assert_eq!(o.scale_down_unneeded_duration.unwrap().seconds, 120);
        assert_eq!(o.max_node_provision_duration, defaults.max_node_provision_duration);
        assert_eq!(options(&ScaleDownOptions::default(), defaults), defaults);
    }
}
