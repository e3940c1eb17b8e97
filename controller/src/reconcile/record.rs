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

/// The last operation: a call of `op_type` in `state`, with the driver's error if it failed.
pub(crate) fn last(
    op_type: OperationType,
    state: OperationState,
    request_id: &str,
    err: Option<&driver_sdk::ErrorReport>,
) -> LastOperation {
    LastOperation {
        op_type,
        state,
        code: err.map_or("OK".into(), |e| format!("{:?}", e.code)),
        reason: err.map(|e| e.reason.clone()).unwrap_or_default(),
        message: err.map(|e| e.message.clone()).unwrap_or_default(),
        request_id: request_id.into(),
        time: Utc::now(),
    }
}

/// The last operation of a call that went through.
pub(crate) fn last_ok(op_type: OperationType, state: OperationState, request_id: &str) -> LastOperation {
    last(op_type, state, request_id, None)
}

/// The last operation of a call (or its operation) that failed.
pub(crate) fn last_err(op_type: OperationType, e: &driver_sdk::ErrorReport) -> LastOperation {
    last(op_type, OperationState::Failed, &e.request_id, Some(e))
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
