//! # autoscaler-proto
//!
//! The Kubernetes cluster-autoscaler's externalgrpc cloud-provider protocol
//! (`clusterautoscaler.cloudprovider.v1.externalgrpc`, release 1.36.1), generated with tonic and
//! prost from the release's `.proto` (in `protos/`, unchanged): the [`CloudProvider`] server the
//! controller serves, its client (tests and benchmarks call it), and [`FILE_DESCRIPTOR_SET`] for
//! reflection. [`node`] is the subset of a protobuf Kubernetes `v1.Node` the autoscaler reads of
//! a node group's template (`nodeBytes`), with the real field numbers.
//!
//! [`CloudProvider`]: pb::cloud_provider_server::CloudProvider

pub mod node;

pub use prost_types;

/// The generated types, server and client.
#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    rustdoc::invalid_html_tags,
    rustdoc::bare_urls,
    rustdoc::broken_intra_doc_links
)]
pub mod pb {
    tonic::include_proto!("clusterautoscaler.cloudprovider.v1.externalgrpc");
}

/// Encoded `FileDescriptorSet` of the protocol and its imports (for reflection).
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/externalgrpc_descriptor.bin"));

/// The full name of the service.
pub const SERVICE: &str = "clusterautoscaler.cloudprovider.v1.externalgrpc.CloudProvider";

/// `InstanceErrorInfo.instanceErrorClass` of a create refused for quota or capacity: the
/// autoscaler backs off the group and tries another.
pub const ERROR_CLASS_OUT_OF_RESOURCES: i32 = 1;
/// `InstanceErrorInfo.instanceErrorClass` of any other create failure.
pub const ERROR_CLASS_OTHER: i32 = 99;
