//! The error policy: what to do after a driver error, decided in one place.
//!
//! [`decide`] implements the caller retry table of `docs/src/reference/protocol.md` (section 5, "Caller retry
//! policy") row by row, and [`blame`] the table under it ("What the controller blames on a
//! revision"). Reconcilers consult [`decide`] to know what status to write (a permanent error
//! marks a machine `Failed`, an environment problem sets a condition); they return the error, and
//! the runtime's [`error_policy`](crate::runtime::Ctx::error_policy) turns the same decision into a delay
//! (RetryInfo, exponential backoff, the quota floor). No reconciler computes a delay itself.
//!
//! Decide on (code, reason), never on the message.

use std::time::Duration;

use driver_sdk::ErrorReport;
use tonic::Code;

use crate::resources::ConditionType;

/// Which kind of RPC an error answers: the table reads `NOT_FOUND` and `INVALID_ARGUMENT`
/// differently for each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rpc {
    /// A mutating call that creates or changes something: `CreateMachine`, `UpdateMachine`,
    /// `ApplyPool`, `UpgradePoolInstances`.
    Mutate,
    /// A delete: `DeleteMachine`, `DeletePool`, `DeletePoolInstances` (`NOT_FOUND` is done).
    Delete,
    /// A read: `GetMachineStatus`, `ListPoolInstances`, `GetCapabilities`,
    /// `ValidateMachineClass`, `CanUpdateMachine` (`NOT_FOUND` means the resource is absent).
    Read,
    /// `GetOperation` / `WaitOperation` on a stored token (`INVALID_ARGUMENT` is about the token).
    Poll,
}

/// Where an error came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The RPC itself failed: the request was not accepted.
    Call(Rpc),
    /// `Operation.error` of a done operation started by an RPC of this kind: the request was
    /// accepted, and the cloud work failed later.
    Operation(Rpc),
}

/// What keeps a retried call from succeeding, and so which condition surfaces it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cause {
    /// `UNAVAILABLE`: throttled, the cloud unreachable or failing, the sidecar restarting.
    Unavailable,
    /// `DEADLINE_EXCEEDED`, `ABORTED`, `CANCELLED`: the call may have taken effect or another
    /// operation must finish first; the same request is sent again.
    InProgress,
    /// `INTERNAL`, `UNKNOWN`: an unexpected failure in the driver; retried a bounded number of
    /// times ([`INTERNAL_RETRIES`]).
    Internal,
    /// `RESOURCE_EXHAUSTED`: quota or capacity; a long backoff, never a hot loop.
    Quota,
    /// `PERMISSION_DENIED`, `UNAUTHENTICATED`: the credentials; retried with backoff, and at
    /// once when the class or its Secret changes.
    Credentials,
}

impl Cause {
    /// The condition that surfaces an environment problem (on the Machine's `Ready` condition,
    /// lifted to its deployment or pool); `None` for transient causes, which say
    /// `{Op}Retrying` instead.
    pub fn environment_condition(self) -> Option<ConditionType> {
        match self {
            Cause::Unavailable => Some(CONDITION_UNAVAILABLE),
            Cause::Quota => Some(CONDITION_QUOTA),
            Cause::Credentials => Some(CONDITION_CREDENTIALS),
            Cause::InProgress | Cause::Internal => None,
        }
    }

    /// The shortest backoff for this cause (quota: 10 s, "not a hot loop").
    pub fn min_backoff(self) -> Duration {
        match self {
            Cause::Quota => QUOTA_MIN_BACKOFF,
            _ => Duration::ZERO,
        }
    }
}

/// Why a request will not succeed as sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Permanent {
    /// `INVALID_ARGUMENT` (`FIELD_REQUIRED`, `FIELD_INVALID`, `INVALID_PROVIDER_SPEC`, …): the
    /// spec is wrong.
    InvalidSpec,
    /// `ALREADY_EXISTS` (`MACHINE_SPEC_CONFLICT`): update or replace instead.
    SpecConflict,
    /// `FAILED_PRECONDITION` (e.g. `UPDATE_NEEDS_REPLACEMENT`): take the other path (replace).
    Precondition,
    /// `UNIMPLEMENTED` (`CAPABILITY_NOT_SUPPORTED`): the capability is missing.
    Unsupported,
    /// `OUT_OF_RANGE`: the request is too large.
    TooLarge,
    /// A done operation failed in the cloud (`CLOUD_OPERATION_FAILED`, …): the machine was
    /// accepted and then failed; its owner replaces it.
    CloudFailed,
    /// `INTERNAL` / `UNKNOWN` came back more than [`INTERNAL_RETRIES`] times in a row.
    RetriesExhausted,
}

/// What to do after a driver error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Wait `delay` (the driver's `RetryInfo`), then send the same request again.
    RetryAfter {
        /// The driver's `retry_delay`.
        delay: Duration,
        /// What the code says about the problem.
        cause: Cause,
    },
    /// Send the same request again after the exponential backoff (with jitter).
    Backoff(Cause),
    /// It will not succeed unchanged: mark it failed, retry only when the spec changes. (A
    /// delete keeps trying slowly, see [`PERMANENT_RETRY`]: a machine must not leak.)
    Permanent(Permanent),
    /// `NOT_FOUND` on a read or update: the resource is absent; recreate it if it should exist.
    Absent,
    /// `OPERATION_TOKEN_INVALID`: drop the stored token and send the original mutating call again.
    DropToken,
    /// `NOT_FOUND` on a delete: the goal is reached.
    Done,
}

impl Decision {
    /// The cause of a retried error; `None` for the other decisions.
    pub fn cause(self) -> Option<Cause> {
        match self {
            Decision::RetryAfter { cause, .. } | Decision::Backoff(cause) => Some(cause),
            _ => None,
        }
    }

    /// Whether the same request is to be sent again.
    pub fn is_retry(self) -> bool {
        self.cause().is_some()
    }
}

/// Condition (and Ready-condition reason of a machine) when the cloud refuses the credentials.
pub const CONDITION_CREDENTIALS: ConditionType = ConditionType::CloudCredentialsRefused;
/// Condition (and Ready-condition reason of a machine) when the cloud is unavailable.
pub const CONDITION_UNAVAILABLE: ConditionType = ConditionType::CloudUnavailable;
/// Condition (and Ready-condition reason of a machine) on a quota or capacity refusal.
pub const CONDITION_QUOTA: ConditionType = ConditionType::QuotaExceeded;
/// The conditions a deployment or pool lifts from its machines (environment problems).
pub const ENVIRONMENT_CONDITIONS: [ConditionType; 4] =
    [CONDITION_CREDENTIALS, CONDITION_QUOTA, CONDITION_UNAVAILABLE, ConditionType::BootDataUnrenderable];

/// How many `INTERNAL` / `UNKNOWN` answers in a row a mutating call gets before the error is
/// final ([`Permanent::RetriesExhausted`]); with the default backoff that is about 8 minutes.
pub const INTERNAL_RETRIES: u32 = 10;
/// The shortest backoff after a quota refusal.
pub const QUOTA_MIN_BACKOFF: Duration = Duration::from_secs(10);
/// How often a call that must eventually succeed (a delete, a pool's own calls) is tried again
/// after a permanent error (capped by the runtime's longest backoff).
pub const PERMANENT_RETRY: Duration = Duration::from_secs(60);

/// Controller-made failure reason: no Running within `creationTimeoutSeconds`.
pub const REASON_CREATION_TIMEOUT: &str = "CREATION_TIMEOUT";
/// Controller-made failure reason: unhealthy or missing past `healthTimeoutSeconds`.
pub const REASON_HEALTH_TIMEOUT: &str = "HEALTH_TIMEOUT";
/// The reason of a machine failed because its Node did not become Ready in time.
pub const REASON_NODE_NOT_JOINED: &str = "NODE_NOT_JOINED";
/// A machine updated in place whose Node was not Ready again within `nodeStartupTimeoutSeconds`
/// (the controller's own failure reason; it blames the revision).
pub const REASON_NODE_NOT_BACK: &str = "NODE_NOT_BACK_AFTER_UPDATE";
/// Controller-made failure reason: `INTERNAL` more than [`INTERNAL_RETRIES`] times in a row.
pub const REASON_RETRIES_EXHAUSTED: &str = "RETRIES_EXHAUSTED";

/// The caller retry table (`docs/src/reference/protocol.md` section 5), one match arm per row.
///
/// Rows are tried in this order: a delete that finds nothing is done; a refused token is
/// dropped; `RetryInfo` sets the delay of any retry (and makes any other code retried after it,
/// "any code with `RetryInfo` → honour `retry_delay`"); then the code (and reason) decides.
/// Errors inside a done operation read the same table, except that `INTERNAL` / `UNKNOWN` there
/// means the cloud ran the work and it failed (`CLOUD_OPERATION_FAILED`), and
/// `OPERATION_NOT_FOUND` (the cloud lost the operation) sends the original call again.
pub fn decide(e: &ErrorReport, source: Source) -> Decision {
    use driver_sdk::reason;
    let (rpc, in_operation) = match source {
        Source::Call(rpc) => (rpc, false),
        Source::Operation(rpc) => (rpc, true),
    };
    match (e.code, e.reason.as_str()) {
        // NOT_FOUND on DeleteMachine / DeletePool / DeletePoolInstances: done.
        (Code::NotFound, _) if rpc == Rpc::Delete => return Decision::Done,
        // INVALID_ARGUMENT / OPERATION_TOKEN_INVALID: drop the token; re-send the original call.
        // (On GetOperation the token is the only argument checked, whatever the reason.)
        (Code::InvalidArgument, reason::OPERATION_TOKEN_INVALID) => return Decision::DropToken,
        (Code::InvalidArgument, _) if rpc == Rpc::Poll && !in_operation => return Decision::DropToken,
        _ => {}
    }
    let decision = match (e.code, e.reason.as_str()) {
        // UNAVAILABLE (THROTTLED with RetryInfo, CLOUD_UNAVAILABLE, transport, sidecar restarting).
        (Code::Unavailable, _) => Decision::Backoff(Cause::Unavailable),
        // DEADLINE_EXCEEDED: the earlier call may have taken effect; idempotency makes this safe.
        (Code::DeadlineExceeded, _) => Decision::Backoff(Cause::InProgress),
        // ABORTED (OPERATION_PENDING, or OPERATION_CANCELLED in an operation): retry the same
        // request. CANCELLED: retry the same request.
        (Code::Aborted | Code::Cancelled, _) => Decision::Backoff(Cause::InProgress),
        // RESOURCE_EXHAUSTED / QUOTA_EXCEEDED: long backoff, surface a condition.
        (Code::ResourceExhausted, _) => Decision::Backoff(Cause::Quota),
        // PERMISSION_DENIED, UNAUTHENTICATED / CLOUD_AUTH_FAILED: the environment.
        (Code::PermissionDenied | Code::Unauthenticated, _) => Decision::Backoff(Cause::Credentials),
        // INVALID_ARGUMENT / FIELD_REQUIRED, FIELD_INVALID, INVALID_PROVIDER_SPEC (and any
        // other validation reason): permanent until the spec changes.
        (Code::InvalidArgument, _) => Decision::Permanent(Permanent::InvalidSpec),
        // ALREADY_EXISTS / MACHINE_SPEC_CONFLICT: permanent for this spec.
        (Code::AlreadyExists, _) => Decision::Permanent(Permanent::SpecConflict),
        // FAILED_PRECONDITION (e.g. UPDATE_NEEDS_REPLACEMENT): permanent for this request.
        (Code::FailedPrecondition, _) => Decision::Permanent(Permanent::Precondition),
        // NOT_FOUND / OPERATION_NOT_FOUND in an operation: the cloud lost it; ask again.
        (Code::NotFound, reason::OPERATION_NOT_FOUND) if in_operation => Decision::Backoff(Cause::InProgress),
        // NOT_FOUND / MACHINE_NOT_FOUND, POOL_NOT_FOUND on reads and updates: absent.
        (Code::NotFound, _) => Decision::Absent,
        // UNIMPLEMENTED / CAPABILITY_NOT_SUPPORTED: never retry.
        (Code::Unimplemented, _) => Decision::Permanent(Permanent::Unsupported),
        // OUT_OF_RANGE: permanent, the request is too large.
        (Code::OutOfRange, _) => Decision::Permanent(Permanent::TooLarge),
        // INTERNAL, UNKNOWN in a done operation: the cloud ran it and it failed.
        (Code::Internal | Code::Unknown, _) if in_operation => Decision::Permanent(Permanent::CloudFailed),
        // INTERNAL, UNKNOWN / INTERNAL or none: retry with backoff a bounded number of times.
        (Code::Internal | Code::Unknown, _) => Decision::Backoff(Cause::Internal),
        // Codes the table does not list (DATA_LOSS; OK never arrives as an error).
        _ => Decision::Backoff(Cause::Internal),
    };
    // Any code with RetryInfo: honour retry_delay before retrying.
    match (e.retry_after, decision) {
        (Some(delay), Decision::Backoff(cause)) => Decision::RetryAfter { delay, cause },
        (Some(delay), _) => Decision::RetryAfter { delay, cause: Cause::InProgress },
        (None, d) => d,
    }
}

/// [`decide`], with the bound on `INTERNAL`: after `failures` failed attempts in a row (this one
/// not counted), an `INTERNAL` / `UNKNOWN` answer is final.
pub fn decide_bounded(e: &ErrorReport, source: Source, failures: u32) -> Decision {
    match decide(e, source) {
        Decision::Backoff(Cause::Internal) if failures + 1 >= INTERNAL_RETRIES => {
            Decision::Permanent(Permanent::RetriesExhausted)
        }
        d => d,
    }
}

/// Whose failure a failed Machine is (`docs/src/reference/protocol.md`, "What the controller blames on a
/// revision"): only the revision's and the request's count against a `failureBudget`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blame {
    /// The revision: the spec was refused, or the machine was created and then failed.
    Revision,
    /// The request (`ALREADY_EXISTS`, `FAILED_PRECONDITION`, `OUT_OF_RANGE`).
    Request,
    /// The environment (credentials, quota, an unavailable cloud).
    Environment,
    /// Transient (`DEADLINE_EXCEEDED`, `ABORTED`, `CANCELLED`, `INTERNAL`, `UNKNOWN`).
    Transient,
}

impl Blame {
    /// Whether the failure counts against the revision's `failureBudget`.
    pub fn counts(self) -> bool {
        matches!(self, Blame::Revision | Blame::Request)
    }
}

/// Blames a recorded failure, given its gRPC code name (as `Failure.code` keeps it, e.g.
/// `InvalidArgument`) and its reason. Controller-made reasons decide first (creation and health
/// timeouts are the revision's; exhausted retries are transient), then a done operation's cloud
/// failure, then the code.
pub fn blame(code: &str, reason: &str) -> Blame {
    match reason {
        REASON_CREATION_TIMEOUT | REASON_HEALTH_TIMEOUT | REASON_NODE_NOT_JOINED | REASON_NODE_NOT_BACK => {
            return Blame::Revision
        }
        REASON_RETRIES_EXHAUSTED => return Blame::Transient,
        driver_sdk::reason::CLOUD_OPERATION_FAILED => return Blame::Revision,
        _ => {}
    }
    match code {
        "InvalidArgument" => Blame::Revision,
        "AlreadyExists" | "FailedPrecondition" | "OutOfRange" | "Unimplemented" => Blame::Request,
        "PermissionDenied" | "Unauthenticated" | "ResourceExhausted" | "Unavailable" => Blame::Environment,
        "DeadlineExceeded" | "Aborted" | "Cancelled" => Blame::Transient,
        // INTERNAL / UNKNOWN reach a Failure only from a done operation (the machine was created,
        // then failed: the revision's) or through RETRIES_EXHAUSTED (above).
        _ => Blame::Revision,
    }
}

#[cfg(test)]
mod tests;
