//! Conversion between the wire types (`machine_driver_proto::v1`) and the SDK's plain types.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use machine_driver_proto::v1 as pb;
use prost_types::value::Kind;
use serde_json::{Map, Number, Value};

use crate::types::{
    Address, Capability, CapacityType, CloudAction, EventKind, InstanceState, Machine, MachineEvent, MachineState,
    Offering, OperationKind, OperationOutput, Pool, PoolInstance, PowerState, ResourceStatus, Secrets,
};

// ------------------------------------------------------------------------------------------ JSON

/// A protobuf `Struct` as a JSON object.
pub fn struct_to_json(s: &prost_types::Struct) -> Value {
    Value::Object(s.fields.iter().map(|(k, v)| (k.clone(), value_to_json(v))).collect())
}

/// A protobuf `Value` as JSON. Whole numbers come back as integers.
pub fn value_to_json(v: &prost_types::Value) -> Value {
    match &v.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::BoolValue(b)) => Value::Bool(*b),
        Some(Kind::NumberValue(n)) => {
            if n.fract() == 0.0 && n.abs() < 9.0e15 {
                Value::Number(Number::from(*n as i64))
            } else {
                Number::from_f64(*n).map_or(Value::Null, Value::Number)
            }
        }
        Some(Kind::StringValue(s)) => Value::String(s.clone()),
        Some(Kind::ListValue(l)) => Value::Array(l.values.iter().map(value_to_json).collect()),
        Some(Kind::StructValue(s)) => struct_to_json(s),
    }
}

/// A JSON value as a protobuf `Value`.
pub fn json_to_value(v: &Value) -> prost_types::Value {
    let kind = match v {
        Value::Null => Kind::NullValue(0),
        Value::Bool(b) => Kind::BoolValue(*b),
        Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        Value::String(s) => Kind::StringValue(s.clone()),
        Value::Array(a) => Kind::ListValue(prost_types::ListValue { values: a.iter().map(json_to_value).collect() }),
        Value::Object(o) => Kind::StructValue(map_to_struct(o)),
    };
    prost_types::Value { kind: Some(kind) }
}

fn map_to_struct(o: &Map<String, Value>) -> prost_types::Struct {
    prost_types::Struct { fields: o.iter().map(|(k, v)| (k.clone(), json_to_value(v))).collect() }
}

/// A JSON object as a protobuf `Struct`; anything else becomes an empty struct.
pub fn json_to_struct(v: &Value) -> prost_types::Struct {
    match v {
        Value::Object(o) => map_to_struct(o),
        _ => prost_types::Struct::default(),
    }
}

/// An optional `Struct` as JSON (`Value::Null` when absent).
pub fn opt_struct_to_json(s: Option<&prost_types::Struct>) -> Value {
    s.map_or(Value::Null, struct_to_json)
}

/// JSON pointers (RFC 6901) of every leaf that differs between `a` and `b`, sorted.
pub fn changed_paths(a: &Value, b: &Value) -> Vec<String> {
    fn escape(k: &str) -> String {
        k.replace('~', "~0").replace('/', "~1")
    }
    fn walk(prefix: &str, a: Option<&Value>, b: Option<&Value>, out: &mut Vec<String>) {
        match (a, b) {
            (Some(Value::Object(x)), Some(Value::Object(y))) => {
                let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
                for k in keys {
                    walk(&format!("{prefix}/{}", escape(k)), x.get(k), y.get(k), out);
                }
            }
            (x, y) if x != y => out.push(if prefix.is_empty() { "/".into() } else { prefix.to_string() }),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk("", Some(a), Some(b), &mut out);
    out
}

/// A stable hash of a provider spec (hex SHA-256 of its canonical JSON, first 16 characters).
pub fn spec_hash(spec: &Value) -> String {
    use sha2::{Digest, Sha256};
    // serde_json's Map is ordered by key (BTreeMap), so the encoding is canonical.
    let bytes = serde_json::to_vec(spec).unwrap_or_default();
    hex::encode(&Sha256::digest(bytes)[..8])
}

// ----------------------------------------------------------------------------------- time, maps

/// A system time as a protobuf timestamp.
pub fn timestamp(t: SystemTime) -> prost_types::Timestamp {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    prost_types::Timestamp { seconds: d.as_secs() as i64, nanos: d.subsec_nanos() as i32 }
}

/// A protobuf timestamp as a system time.
pub fn from_timestamp(t: &prost_types::Timestamp) -> SystemTime {
    UNIX_EPOCH + Duration::new(t.seconds.max(0) as u64, t.nanos.clamp(0, 999_999_999) as u32)
}

/// A duration as a protobuf duration.
pub fn duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration { seconds: d.as_secs() as i64, nanos: d.subsec_nanos() as i32 }
}

/// A protobuf duration as a duration (negative → zero).
pub fn from_duration(d: &prost_types::Duration) -> Duration {
    if d.seconds < 0 || d.nanos < 0 {
        return Duration::ZERO;
    }
    Duration::new(d.seconds as u64, d.nanos as u32)
}

/// Wire secrets as SDK secrets.
pub fn secrets(s: Option<&pb::Secrets>) -> Secrets {
    s.map(|s| s.data.iter().map(|(k, v)| (k.clone(), v.clone())).collect()).unwrap_or_default()
}

/// SDK secrets as wire secrets.
pub fn secrets_to_proto(s: &Secrets) -> pb::Secrets {
    pb::Secrets { data: s.expose().iter().map(|(k, v)| (k.clone(), v.clone())).collect() }
}

#[cfg(feature = "server")]
pub(crate) fn labels(m: &std::collections::HashMap<String, String>) -> std::collections::BTreeMap<String, String> {
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

// ------------------------------------------------------------------------------------- enums

/// Capability to wire.
pub fn capability(c: Capability) -> pb::Capability {
    match c {
        Capability::Machines => pb::Capability::Machines,
        Capability::ValidateMachineClass => pb::Capability::ValidateMachineClass,
        Capability::InPlaceUpdate => pb::Capability::InPlaceUpdate,
        Capability::Pools => pb::Capability::Pools,
        Capability::CancelOperation => pb::Capability::CancelOperation,
        Capability::Events => pb::Capability::Events,
    }
}

/// Wire capability to SDK (None for unknown values).
pub fn capability_from_proto(c: pb::Capability) -> Option<Capability> {
    Some(match c {
        pb::Capability::Machines => Capability::Machines,
        pb::Capability::ValidateMachineClass => Capability::ValidateMachineClass,
        pb::Capability::InPlaceUpdate => Capability::InPlaceUpdate,
        pb::Capability::Pools => Capability::Pools,
        pb::Capability::CancelOperation => Capability::CancelOperation,
        pb::Capability::Events => Capability::Events,
        pb::Capability::Unspecified => return None,
    })
}

/// Machine state to wire.
pub fn machine_state(s: MachineState) -> pb::MachineState {
    match s {
        MachineState::Pending => pb::MachineState::Pending,
        MachineState::Creating => pb::MachineState::Creating,
        MachineState::Running => pb::MachineState::Running,
        MachineState::Updating => pb::MachineState::Updating,
        MachineState::Stopped => pb::MachineState::Stopped,
        MachineState::Deleting => pb::MachineState::Deleting,
        MachineState::Failed => pb::MachineState::Failed,
        MachineState::Unknown => pb::MachineState::Unknown,
    }
}

/// Operation kind to wire.
pub fn operation_kind(k: OperationKind) -> pb::OperationKind {
    match k {
        OperationKind::CreateMachine => pb::OperationKind::CreateMachine,
        OperationKind::DeleteMachine => pb::OperationKind::DeleteMachine,
        OperationKind::UpdateMachine => pb::OperationKind::UpdateMachine,
        OperationKind::ApplyPool => pb::OperationKind::ApplyPool,
        OperationKind::DeletePoolInstances => pb::OperationKind::DeletePoolInstances,
        OperationKind::UpgradePoolInstances => pb::OperationKind::UpgradePoolInstances,
        OperationKind::DeletePool => pb::OperationKind::DeletePool,
    }
}

fn power_state(p: PowerState) -> pb::PowerState {
    match p {
        PowerState::Unknown => pb::PowerState::Unspecified,
        PowerState::Starting => pb::PowerState::Starting,
        PowerState::Running => pb::PowerState::Running,
        PowerState::Stopping => pb::PowerState::Stopping,
        PowerState::Stopped => pb::PowerState::Stopped,
        PowerState::Deallocating => pb::PowerState::Deallocating,
        PowerState::Deallocated => pb::PowerState::Deallocated,
    }
}

/// Instance state to wire.
pub fn instance_state(s: InstanceState) -> pb::InstanceState {
    match s {
        InstanceState::Creating => pb::InstanceState::Creating,
        InstanceState::Running => pb::InstanceState::Running,
        InstanceState::Updating => pb::InstanceState::Updating,
        InstanceState::Deleting => pb::InstanceState::Deleting,
        InstanceState::Failed => pb::InstanceState::Failed,
    }
}

// ----------------------------------------------------------------------------------- messages

fn addresses(a: &[Address]) -> Vec<pb::Address> {
    a.iter().map(|a| pb::Address { r#type: a.kind.clone(), address: a.address.clone() }).collect()
}

/// Machine to wire.
pub fn machine(m: &Machine) -> pb::Machine {
    pb::Machine {
        name: m.name.clone(),
        provider_id: m.provider_id.clone(),
        state: machine_state(m.state) as i32,
        addresses: addresses(&m.addresses),
        labels: m.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        resources: m
            .resources
            .iter()
            .map(|r: &ResourceStatus| pb::ResourceStatus {
                kind: r.kind.clone(),
                id: r.id.clone(),
                state: r.state.clone(),
                message: r.message.clone(),
            })
            .collect(),
        cloud_error: m.cloud_error.as_ref().map(|(code, reason, message)| {
            crate::error::DriverError::new(*code, reason.clone(), message.clone()).to_rpc_status("", "", None)
        }),
        create_time: m.create_time.map(timestamp),
        spec_hash: m.spec_hash.clone(),
    }
}

/// Pool to wire.
pub fn pool(p: &Pool) -> pb::Pool {
    pb::Pool {
        name: p.name.clone(),
        provider_id: p.provider_id.clone(),
        capacity: p.capacity as i32,
        model_version: p.model_version.clone(),
        provisioning_state: p.provisioning_state.clone(),
        labels: p.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
    }
}

/// Pool instance to wire.
pub fn pool_instance(i: &PoolInstance) -> pb::PoolInstance {
    pb::PoolInstance {
        instance_id: i.instance_id.clone(),
        name: i.name.clone(),
        provider_id: i.provider_id.clone(),
        #[allow(deprecated)] // Still filled, for callers older than `state`.
        provisioning_state: i.provisioning_state.clone(),
        state: instance_state(i.state) as i32,
        power_state: power_state(i.power_state) as i32,
        latest_model_applied: i.latest_model_applied,
        addresses: addresses(&i.addresses),
        create_time: i.create_time.map(timestamp),
    }
}

/// Operation output to wire.
pub fn operation_output(o: &OperationOutput) -> pb::OperationResult {
    match o {
        OperationOutput::None => pb::OperationResult::default(),
        OperationOutput::Machine(m) => pb::OperationResult { machine: Some(machine(m)), pool: None },
        OperationOutput::Pool(p) => pb::OperationResult { machine: None, pool: Some(pool(p)) },
    }
}

// ------------------------------------------------------------------------------------ events

/// Event kind to wire.
pub fn event_kind(k: EventKind) -> pb::MachineEventKind {
    match k {
        EventKind::Unspecified => pb::MachineEventKind::Unspecified,
        EventKind::SpotInterruption => pb::MachineEventKind::SpotInterruption,
        EventKind::RebalanceRecommendation => pb::MachineEventKind::RebalanceRecommendation,
        EventKind::ScheduledMaintenance => pb::MachineEventKind::ScheduledMaintenance,
        EventKind::Stopping => pb::MachineEventKind::Stopping,
        EventKind::Stopped => pb::MachineEventKind::Stopped,
        EventKind::Terminated => pb::MachineEventKind::Terminated,
        EventKind::Impaired => pb::MachineEventKind::Impaired,
        EventKind::CapacityReservationInterruption => pb::MachineEventKind::CapacityReservationInterruption,
    }
}

/// Wire event kind to SDK; a number this side does not know is [`EventKind::Unspecified`].
pub fn event_kind_from_proto(k: i32) -> EventKind {
    match pb::MachineEventKind::try_from(k).unwrap_or(pb::MachineEventKind::Unspecified) {
        pb::MachineEventKind::Unspecified => EventKind::Unspecified,
        pb::MachineEventKind::SpotInterruption => EventKind::SpotInterruption,
        pb::MachineEventKind::RebalanceRecommendation => EventKind::RebalanceRecommendation,
        pb::MachineEventKind::ScheduledMaintenance => EventKind::ScheduledMaintenance,
        pb::MachineEventKind::Stopping => EventKind::Stopping,
        pb::MachineEventKind::Stopped => EventKind::Stopped,
        pb::MachineEventKind::Terminated => EventKind::Terminated,
        pb::MachineEventKind::Impaired => EventKind::Impaired,
        pb::MachineEventKind::CapacityReservationInterruption => EventKind::CapacityReservationInterruption,
    }
}

fn cloud_action(a: CloudAction) -> pb::CloudAction {
    match a {
        CloudAction::Unspecified => pb::CloudAction::Unspecified,
        CloudAction::Terminate => pb::CloudAction::Terminate,
        CloudAction::Stop => pb::CloudAction::Stop,
        CloudAction::Hibernate => pb::CloudAction::Hibernate,
        CloudAction::Reboot => pb::CloudAction::Reboot,
    }
}

fn cloud_action_from_proto(a: i32) -> CloudAction {
    match pb::CloudAction::try_from(a).unwrap_or(pb::CloudAction::Unspecified) {
        pb::CloudAction::Unspecified => CloudAction::Unspecified,
        pb::CloudAction::Terminate => CloudAction::Terminate,
        pb::CloudAction::Stop => CloudAction::Stop,
        pb::CloudAction::Hibernate => CloudAction::Hibernate,
        pb::CloudAction::Reboot => CloudAction::Reboot,
    }
}

fn capacity_type(c: CapacityType) -> pb::CapacityType {
    match c {
        CapacityType::Unspecified => pb::CapacityType::Unspecified,
        CapacityType::OnDemand => pb::CapacityType::OnDemand,
        CapacityType::Spot => pb::CapacityType::Spot,
        CapacityType::Reserved => pb::CapacityType::Reserved,
    }
}

fn capacity_type_from_proto(c: i32) -> CapacityType {
    match pb::CapacityType::try_from(c).unwrap_or(pb::CapacityType::Unspecified) {
        pb::CapacityType::Unspecified => CapacityType::Unspecified,
        pb::CapacityType::OnDemand => CapacityType::OnDemand,
        pb::CapacityType::Spot => CapacityType::Spot,
        pb::CapacityType::Reserved => CapacityType::Reserved,
    }
}

/// An event as sent on a stream: `resume_token` says where the stream stands after it, and
/// `delivery_attempt` counts from 1.
pub fn machine_event(e: &MachineEvent, resume_token: String, delivery_attempt: u32) -> pb::MachineEvent {
    pb::MachineEvent {
        event_id: e.event_id.clone(),
        machine_name: e.machine_name.clone(),
        provider_id: e.provider_id.clone(),
        pool_name: e.pool_name.clone(),
        kind: event_kind(e.kind) as i32,
        not_before: e.not_before.map(timestamp),
        observed_at: Some(timestamp(e.observed_at)),
        action: cloud_action(e.action) as i32,
        offering: Some(pb::Offering {
            zone: e.offering.zone.clone(),
            machine_type: e.offering.machine_type.clone(),
            capacity_type: capacity_type(e.offering.capacity_type) as i32,
        }),
        resume_token,
        message: e.message.clone(),
        delivery_attempt,
    }
}

/// A streamed event as the SDK's type (what a caller records); unknown enum numbers become
/// `Unspecified`, a missing `observed_at` the epoch.
pub fn machine_event_from_proto(e: &pb::MachineEvent) -> MachineEvent {
    let offering = e.offering.clone().unwrap_or_default();
    MachineEvent {
        event_id: e.event_id.clone(),
        machine_name: e.machine_name.clone(),
        provider_id: e.provider_id.clone(),
        pool_name: e.pool_name.clone(),
        kind: event_kind_from_proto(e.kind),
        not_before: e.not_before.as_ref().map(from_timestamp),
        observed_at: e.observed_at.as_ref().map_or(UNIX_EPOCH, from_timestamp),
        action: cloud_action_from_proto(e.action),
        offering: Offering {
            zone: offering.zone,
            machine_type: offering.machine_type,
            capacity_type: capacity_type_from_proto(offering.capacity_type),
        },
        message: e.message.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn json_struct_round_trip_keeps_integers_and_nesting() {
        let v = json!({"a": 1, "b": 2.5, "c": "x", "d": [true, null, {"e": -3}], "f": {}});
        assert_eq!(struct_to_json(&json_to_struct(&v)), v);
    }

    #[test]
    fn changed_paths_lists_leaves_with_escaping() {
        let a = json!({"size": "small", "tags": {"a/b": "1", "keep": "x"}, "disk": 10});
        let b = json!({"size": "large", "tags": {"a/b": "2", "keep": "x"}, "zone": "z"});
        assert_eq!(changed_paths(&a, &b), vec!["/disk", "/size", "/tags/a~1b", "/zone"]);
        assert!(changed_paths(&a, &a).is_empty());
    }

    #[test]
    fn spec_hash_is_order_independent() {
        assert_eq!(spec_hash(&json!({"a": 1, "b": 2})), spec_hash(&json!({"b": 2, "a": 1})));
        assert_ne!(spec_hash(&json!({"a": 1})), spec_hash(&json!({"a": 2})));
    }

    #[test]
    fn an_event_survives_the_wire_and_an_unknown_kind_reads_as_unspecified() {
        use crate::types::{CapacityType, CloudAction, EventKind, MachineEvent, Offering};
        let e = MachineEvent {
            event_id: "e-1".into(),
            machine_name: "m".into(),
            provider_id: "fake:///zone-a/1".into(),
            pool_name: String::new(),
            kind: EventKind::SpotInterruption,
            not_before: Some(UNIX_EPOCH + Duration::from_secs(120)),
            observed_at: UNIX_EPOCH + Duration::from_secs(1),
            action: CloudAction::Terminate,
            offering: Offering {
                zone: "zone-a".into(),
                machine_type: "small".into(),
                capacity_type: CapacityType::Spot,
            },
            message: "reclaimed".into(),
        };
        let mut wire = machine_event(&e, "t.1".into(), 2);
        assert_eq!((wire.resume_token.as_str(), wire.delivery_attempt), ("t.1", 2));
        assert_eq!(machine_event_from_proto(&wire), e);
        wire.kind = 99;
        assert_eq!(machine_event_from_proto(&wire).kind, EventKind::Unspecified);
    }
}
