//! The part of a protobuf Kubernetes `v1.Node` (`k8s.io/api/core/v1/generated.proto`) the
//! cluster-autoscaler reads of a node group's template: the field numbers are the real ones, so
//! the autoscaler's `Node.Unmarshal` decodes these bytes; everything else a Node has is left out
//! (an absent field is its zero value there).

use std::collections::BTreeMap;

/// `v1.Node`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Node {
    /// `metadata`.
    #[prost(message, optional, tag = "1")]
    pub metadata: Option<ObjectMeta>,
    /// `spec`.
    #[prost(message, optional, tag = "2")]
    pub spec: Option<NodeSpec>,
    /// `status`.
    #[prost(message, optional, tag = "3")]
    pub status: Option<NodeStatus>,
}

impl Node {
    /// Its protobuf bytes (the externalgrpc `nodeBytes`).
    pub fn encode(&self) -> Vec<u8> {
        prost::Message::encode_to_vec(self)
    }

    /// Reads protobuf bytes.
    ///
    /// # Errors
    /// Bytes that are not a Node.
    pub fn decode_bytes(bytes: &[u8]) -> Result<Self, prost::DecodeError> {
        prost::Message::decode(bytes)
    }
}

/// `metav1.ObjectMeta`: its name, labels and annotations.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ObjectMeta {
    /// `name`.
    #[prost(string, optional, tag = "1")]
    pub name: Option<String>,
    /// `labels`.
    #[prost(btree_map = "string, string", tag = "11")]
    pub labels: BTreeMap<String, String>,
    /// `annotations`.
    #[prost(btree_map = "string, string", tag = "12")]
    pub annotations: BTreeMap<String, String>,
}

/// `v1.NodeSpec`: its provider ID and taints.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NodeSpec {
    /// `providerID`.
    #[prost(string, optional, tag = "3")]
    pub provider_id: Option<String>,
    /// `taints`.
    #[prost(message, repeated, tag = "5")]
    pub taints: Vec<Taint>,
}

/// `v1.Taint`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Taint {
    /// `key`.
    #[prost(string, optional, tag = "1")]
    pub key: Option<String>,
    /// `value`.
    #[prost(string, optional, tag = "2")]
    pub value: Option<String>,
    /// `effect`: `NoSchedule`, `PreferNoSchedule` or `NoExecute`.
    #[prost(string, optional, tag = "3")]
    pub effect: Option<String>,
}

/// `v1.NodeStatus`: capacity, allocatable and conditions.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NodeStatus {
    /// `capacity`.
    #[prost(btree_map = "string, message", tag = "1")]
    pub capacity: BTreeMap<String, Quantity>,
    /// `allocatable`.
    #[prost(btree_map = "string, message", tag = "2")]
    pub allocatable: BTreeMap<String, Quantity>,
    /// `conditions`.
    #[prost(message, repeated, tag = "4")]
    pub conditions: Vec<NodeCondition>,
}

/// `resource.Quantity`: its string form.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Quantity {
    /// `string` (`4`, `16Gi`).
    #[prost(string, optional, tag = "1")]
    pub string: Option<String>,
}

/// `v1.NodeCondition`: its type and status.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NodeCondition {
    /// `type` (`Ready`).
    #[prost(string, optional, tag = "1")]
    pub r#type: Option<String>,
    /// `status` (`True`).
    #[prost(string, optional, tag = "2")]
    pub status: Option<String>,
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;

    /// The bytes of a Node with a label, a capacity and a taint, as the real `k8s.io/api`
    /// (`Node.Marshal`) writes them; the field numbers and wire types decode the same.
    #[test]
    fn a_node_round_trips_with_the_field_numbers_kubernetes_uses() {
        let node = Node {
            metadata: Some(ObjectMeta {
                name: Some("n".into()),
                labels: BTreeMap::from([("a".into(), "b".into())]),
                annotations: BTreeMap::new(),
            }),
            spec: Some(NodeSpec {
                provider_id: None,
                taints: vec![Taint { key: Some("k".into()), value: None, effect: Some("NoSchedule".into()) }],
            }),
            status: Some(NodeStatus {
                capacity: BTreeMap::from([("cpu".into(), Quantity { string: Some("4".into()) })]),
                allocatable: BTreeMap::new(),
                conditions: vec![],
            }),
        };
        let bytes = node.encode_to_vec();
        // metadata (1, length-delimited) → name (1) "n"; labels (11) map entry {1: "a", 2: "b"}.
        assert_eq!(&bytes[..2], &[0x0a, 11]);
        assert_eq!(&bytes[2..5], &[0x0a, 1, b'n']);
        assert_eq!(&bytes[5..13], &[0x5a, 6, 0x0a, 1, b'a', 0x12, 1, b'b']);
        assert_eq!(Node::decode(bytes.as_slice()).unwrap(), node);
    }
}
