//! EC2 instances as machines: states, provider IDs, addresses, tags.

use std::collections::BTreeMap;
use std::time::SystemTime;

use aws_sdk_ec2::types::Instance;
use driver_sdk::{Address, Labels, Machine, MachineState, ResourceStatus};

use crate::spec::{TAG_NAME, TAG_SPEC_HASH};

/// EC2 instance state codes (`code & 0xFF`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ec2State {
    /// 0
    Pending,
    /// 16
    Running,
    /// 32
    ShuttingDown,
    /// 48
    Terminated,
    /// 64
    Stopping,
    /// 80
    Stopped,
    /// Anything else (or no state).
    Unknown,
}

impl Ec2State {
    /// The state of an instance.
    pub fn of(i: &Instance) -> Self {
        match i.state().and_then(|s| s.code()).map(|c| c & 0xFF) {
            Some(0) => Self::Pending,
            Some(16) => Self::Running,
            Some(32) => Self::ShuttingDown,
            Some(48) => Self::Terminated,
            Some(64) => Self::Stopping,
            Some(80) => Self::Stopped,
            _ => Self::Unknown,
        }
    }

    /// Whether the instance is gone or going (never a create's answer).
    pub fn is_gone(self) -> bool {
        matches!(self, Self::ShuttingDown | Self::Terminated)
    }

    /// The state names DescribeInstances filters on for instances that are not going away.
    pub const LIVE: [&'static str; 4] = ["pending", "running", "stopping", "stopped"];
}

/// A tag's value.
pub fn tag<'a>(i: &'a Instance, key: &str) -> Option<&'a str> {
    i.tags().iter().find(|t| t.key() == Some(key)).and_then(|t| t.value())
}

/// `aws:///<availability-zone>/<instance-id>`, the Kubernetes AWS provider ID form.
pub fn provider_id(i: &Instance) -> String {
    let az = i.placement().and_then(|p| p.availability_zone()).unwrap_or_default();
    format!("aws:///{az}/{}", i.instance_id().unwrap_or_default())
}

/// The instance ID of a provider ID (`aws:///<az>/<id>` or a bare `i-…`).
pub fn instance_id_of(provider_id: &str) -> Option<&str> {
    let id = provider_id.rsplit('/').next()?;
    (id.starts_with("i-") && id.len() > 2 && id[2..].chars().all(|c| c.is_ascii_hexdigit())).then_some(id)
}

/// The machine an instance is.
pub fn to_machine(i: &Instance) -> Machine {
    let state = match Ec2State::of(i) {
        Ec2State::Pending => MachineState::Creating,
        Ec2State::Running => MachineState::Running,
        Ec2State::ShuttingDown | Ec2State::Terminated => MachineState::Deleting,
        Ec2State::Stopping | Ec2State::Stopped => MachineState::Stopped,
        Ec2State::Unknown => MachineState::Unknown,
    };
    let mut addresses = Vec::new();
    let mut add = |kind: &str, v: Option<&str>| {
        if let Some(v) = v.filter(|v| !v.is_empty()) {
            addresses.push(Address { kind: kind.into(), address: v.into() });
        }
    };
    add("InternalIP", i.private_ip_address());
    add("ExternalIP", i.public_ip_address());
    add("InternalDNS", i.private_dns_name());
    add("ExternalDNS", i.public_dns_name());
    let labels: Labels = i
        .tags()
        .iter()
        .filter_map(|t| Some((t.key()?.to_string(), t.value().unwrap_or_default().to_string())))
        .filter(|(k, _)| k != TAG_NAME && k != TAG_SPEC_HASH)
        .collect::<BTreeMap<_, _>>();
    let state_name = i.state().and_then(|s| s.name()).map(|n| n.as_str().to_string()).unwrap_or_default();
    let mut resources = vec![ResourceStatus {
        kind: "instance".into(),
        id: i.instance_id().unwrap_or_default().into(),
        state: state_name,
        message: i.state_reason().and_then(|r| r.message()).unwrap_or_default().into(),
    }];
    for d in i.block_device_mappings() {
        if let Some(ebs) = d.ebs() {
            resources.push(ResourceStatus {
                kind: "volume".into(),
                id: ebs.volume_id().unwrap_or_default().into(),
                state: ebs.status().map(|s| s.as_str().to_string()).unwrap_or_default(),
                message: d.device_name().unwrap_or_default().into(),
            });
        }
    }
    Machine {
        name: tag(i, TAG_NAME).unwrap_or_default().to_string(),
        provider_id: provider_id(i),
        state,
        addresses,
        labels,
        resources,
        cloud_error: None,
        create_time: i.launch_time().and_then(|t| SystemTime::try_from(*t).ok()),
        spec_hash: tag(i, TAG_SPEC_HASH).unwrap_or_default().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_sdk_ec2::types::{InstanceState, Placement, Tag};

    #[test]
    fn instances_become_machines() {
        let i = Instance::builder()
            .instance_id("i-0123456789abcdef0")
            .placement(Placement::builder().availability_zone("eu-west-1a").build())
            .state(InstanceState::builder().code(256 + 16).build())
            .private_ip_address("10.0.0.5")
            .tags(Tag::builder().key(TAG_NAME).value("web-0").build())
            .tags(Tag::builder().key(TAG_SPEC_HASH).value("abc").build())
            .tags(Tag::builder().key("cluster").value("c1").build())
            .build();
        let m = to_machine(&i);
        assert_eq!(m.name, "web-0");
        assert_eq!(m.provider_id, "aws:///eu-west-1a/i-0123456789abcdef0");
        assert_eq!(m.state, MachineState::Running);
        assert_eq!(m.spec_hash, "abc");
        assert_eq!(m.labels, [("cluster".to_string(), "c1".to_string())].into());
        assert_eq!(m.addresses[0].address, "10.0.0.5");
        assert_eq!(instance_id_of(&m.provider_id), Some("i-0123456789abcdef0"));
        assert_eq!(instance_id_of("aws:///x/vol-1"), None);
    }
}
