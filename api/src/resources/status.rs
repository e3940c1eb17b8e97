//! The parts of status that several kinds share: conditions (with the helpers that set and read
//! them), the operation handle kept while an operation is in flight, and the last driver call.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::meta::Time;
use super::state::{ConditionStatus, ConditionType, OperationKind, OperationState, OperationType, Reason};

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

/// Sets a condition (`True` when `holds`), keeping its transition time when the status does
/// not change. Returns whether anything changed.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    condition_type: ConditionType,
    holds: bool,
    reason: Reason,
    message: &str,
) -> bool {
    set_condition_status(conditions, condition_type, ConditionStatus::from(holds), reason, message)
}

/// [`set_condition`] with any status (`Unknown` too: a Node whose kubelet stopped reporting).
pub fn set_condition_status(
    conditions: &mut Vec<Condition>,
    condition_type: ConditionType,
    status: ConditionStatus,
    reason: Reason,
    message: &str,
) -> bool {
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

/// `get`'s cell for a condition: `Status/Reason`, or `-`.
pub(crate) fn condition_cell(object: &Value, condition_type: ConditionType) -> String {
    let conditions = object.pointer("/status/conditions").cloned().unwrap_or_default();
    let conditions: Vec<Condition> = serde_json::from_value(conditions).unwrap_or_default();
    condition(&conditions, condition_type).map_or("-".into(), |c| format!("{}/{}", c.status, c.reason))
}

#[cfg(test)]
mod tests {
    use super::*;

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
