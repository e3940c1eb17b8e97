//! What reconcilers record in a Machine's or a pool's status after a driver call: the handle of
//! an operation in flight, the last operation, the recent request IDs, a permanent failure. One
//! place, so every path writes them the same way.

use chrono::Utc;
use driver_sdk::proto as pb;

use crate::resources::*;

/// [`StoredOperation`] made from what a driver answered (the API crate knows no protocol types).
pub(crate) trait StoredOperationExt {
    /// The handle of `op`, an operation of `kind` started by request `request_id`, as status
    /// keeps it (the token base64-encoded, started now); stored before anything else.
    fn from_pb(kind: OperationKind, op: &pb::Operation, request_id: &str) -> Self;
}

impl StoredOperationExt for StoredOperation {
    fn from_pb(kind: OperationKind, op: &pb::Operation, request_id: &str) -> Self {
        use base64::Engine;
        StoredOperation {
            kind,
            name: op.name.clone(),
            token: base64::engine::general_purpose::STANDARD.encode(&op.token),
            started: Utc::now(),
            request_id: request_id.into(),
            progress: op.progress_percent,
        }
    }
}

/// Request IDs kept in a Machine's status, newest last.
const KEEP_REQUEST_IDS: usize = 5;

/// Keeps `request_id` among the recent ones.
pub(crate) fn remember(status: &mut MachineStatus, request_id: &str) {
    status.request_ids.push(request_id.to_string());
    let n = status.request_ids.len();
    if n > KEEP_REQUEST_IDS {
        status.request_ids.drain(..n - KEEP_REQUEST_IDS);
    }
}

/// [`LastOperation`] made from a driver call's outcome: [`ok`](Self::ok) when the call (or its
/// operation) went through, [`failed`](Self::failed) when it failed.
pub(crate) trait LastOperationExt {
    /// A call of `op_type` (request `request_id`) that went through, its operation in `state`
    /// (code `OK`).
    fn ok(op_type: OperationType, state: OperationState, request_id: &str) -> Self;
    /// A call of `op_type` (request `request_id`), or its operation, that failed with `err`.
    fn failed(op_type: OperationType, request_id: &str, err: &driver_sdk::ErrorReport) -> Self;
}

impl LastOperationExt for LastOperation {
    fn ok(op_type: OperationType, state: OperationState, request_id: &str) -> Self {
        LastOperation {
            op_type,
            state,
            code: "OK".into(),
            reason: String::new(),
            message: String::new(),
            request_id: request_id.into(),
            time: Utc::now(),
        }
    }

    fn failed(op_type: OperationType, request_id: &str, err: &driver_sdk::ErrorReport) -> Self {
        LastOperation {
            op_type,
            state: OperationState::Failed,
            code: format!("{:?}", err.code),
            reason: err.reason.clone(),
            message: err.message.clone(),
            request_id: request_id.into(),
            time: Utc::now(),
        }
    }
}

/// Marks a Machine Failed for good (until its spec or class changes): its owner remediates it.
pub(crate) fn fail(m: &mut Machine, class_generation: i64, code: &str, reason: &str, message: &str) {
    m.status.phase = Phase::Failed;
    m.status.failure = Some(Failure {
        code: code.into(),
        reason: reason.into(),
        message: message.into(),
        generation: m.metadata.generation,
        class_generation,
    });
    set_condition(&mut m.status.conditions, ConditionType::Ready, false, Reason::Failed, message);
    set_condition(&mut m.status.conditions, ConditionType::Failed, true, Reason::from_driver(reason), message);
}
