//! The retry table of `docs/src/reference/protocol.md` section 5, row by row, then the blame table.

use std::time::Duration;

use driver_sdk::reason;
use driver_sdk::ErrorReport;
use tonic::Code;

use super::*;

fn report(code: Code, reason: &str) -> ErrorReport {
    ErrorReport {
        code,
        message: "m".into(),
        reason: reason.into(),
        domain: String::new(),
        metadata: Default::default(),
        retry_after: None,
        request_id: String::new(),
        cloud_request_ids: Vec::new(),
        violations: Vec::new(),
        causes: Vec::new(),
    }
}

fn with_retry(code: Code, reason: &str, delay: Duration) -> ErrorReport {
    ErrorReport { retry_after: Some(delay), ..report(code, reason) }
}

const ALL_CALLS: [Source; 4] =
    [Source::Call(Rpc::Mutate), Source::Call(Rpc::Delete), Source::Call(Rpc::Read), Source::Call(Rpc::Poll)];
const MUTATE: Source = Source::Call(Rpc::Mutate);

#[test]
fn unavailable_throttled_with_retry_info_waits_the_retry_delay() {
    let d = Duration::from_millis(1500);
    for source in ALL_CALLS {
        assert_eq!(
            decide(&with_retry(Code::Unavailable, reason::THROTTLED, d), source),
            Decision::RetryAfter { delay: d, cause: Cause::Unavailable },
            "{source:?}"
        );
    }
}

#[test]
fn unavailable_with_any_other_reason_or_none_backs_off() {
    for r in [reason::CLOUD_UNAVAILABLE, "", "FAULT_INJECTED", reason::THROTTLED] {
        assert_eq!(decide(&report(Code::Unavailable, r), MUTATE), Decision::Backoff(Cause::Unavailable), "{r}");
    }
}

#[test]
fn deadline_exceeded_retries_the_same_request_with_backoff() {
    for r in ["", reason::DEADLINE_EXCEEDED] {
        assert_eq!(decide(&report(Code::DeadlineExceeded, r), MUTATE), Decision::Backoff(Cause::InProgress));
    }
}

#[test]
fn aborted_operation_pending_retries_with_backoff() {
    assert_eq!(decide(&report(Code::Aborted, reason::OPERATION_PENDING), MUTATE), Decision::Backoff(Cause::InProgress));
}

#[test]
fn cancelled_retries_the_same_request() {
    assert_eq!(decide(&report(Code::Cancelled, ""), MUTATE), Decision::Backoff(Cause::InProgress));
    // In a done operation: OPERATION_CANCELLED, and the controller still wants the result.
    for code in [Code::Cancelled, Code::Aborted] {
        assert_eq!(
            decide(&report(code, reason::OPERATION_CANCELLED), Source::Operation(Rpc::Mutate)),
            Decision::Backoff(Cause::InProgress)
        );
    }
}

#[test]
fn any_code_with_retry_info_honours_the_retry_delay() {
    let d = Duration::from_secs(7);
    assert_eq!(
        decide(&with_retry(Code::ResourceExhausted, reason::QUOTA_EXCEEDED, d), MUTATE),
        Decision::RetryAfter { delay: d, cause: Cause::Quota },
        "quota keeps its cause (and condition) when the driver says when to come back"
    );
    assert_eq!(
        decide(&with_retry(Code::Internal, reason::INTERNAL, d), MUTATE),
        Decision::RetryAfter { delay: d, cause: Cause::Internal }
    );
    assert_eq!(
        decide(&with_retry(Code::FailedPrecondition, "FAULT_INJECTED", d), MUTATE),
        Decision::RetryAfter { delay: d, cause: Cause::InProgress }
    );
    // ... but a delete that finds nothing is done, and a refused token is dropped, regardless.
    assert_eq!(decide(&with_retry(Code::NotFound, "", d), Source::Call(Rpc::Delete)), Decision::Done);
    assert_eq!(
        decide(&with_retry(Code::InvalidArgument, reason::OPERATION_TOKEN_INVALID, d), Source::Call(Rpc::Poll)),
        Decision::DropToken
    );
}

#[test]
fn resource_exhausted_quota_exceeded_backs_off_long_and_surfaces_a_condition() {
    let d = decide(&report(Code::ResourceExhausted, reason::QUOTA_EXCEEDED), MUTATE);
    assert_eq!(d, Decision::Backoff(Cause::Quota));
    assert_eq!(Cause::Quota.min_backoff(), Duration::from_secs(10));
    assert_eq!(Cause::Quota.environment_condition(), Some(ConditionType::QuotaExceeded));
    // Also inside a done operation: back off, not a failed machine.
    assert_eq!(
        decide(&report(Code::ResourceExhausted, reason::QUOTA_EXCEEDED), Source::Operation(Rpc::Mutate)),
        Decision::Backoff(Cause::Quota)
    );
}

#[test]
fn invalid_argument_validation_reasons_are_permanent_until_the_spec_changes() {
    for r in [reason::FIELD_REQUIRED, reason::FIELD_INVALID, reason::INVALID_PROVIDER_SPEC, ""] {
        assert_eq!(decide(&report(Code::InvalidArgument, r), MUTATE), Decision::Permanent(Permanent::InvalidSpec));
        assert_eq!(
            decide(&report(Code::InvalidArgument, r), Source::Call(Rpc::Read)),
            Decision::Permanent(Permanent::InvalidSpec)
        );
    }
}

#[test]
fn invalid_argument_operation_token_invalid_drops_the_token() {
    for source in ALL_CALLS {
        assert_eq!(
            decide(&report(Code::InvalidArgument, reason::OPERATION_TOKEN_INVALID), source),
            Decision::DropToken
        );
    }
    // GetOperation checks only the token: any INVALID_ARGUMENT there is about it.
    assert_eq!(
        decide(&report(Code::InvalidArgument, reason::FIELD_REQUIRED), Source::Call(Rpc::Poll)),
        Decision::DropToken
    );
}

#[test]
fn already_exists_machine_spec_conflict_is_permanent_for_this_spec() {
    assert_eq!(
        decide(&report(Code::AlreadyExists, reason::MACHINE_SPEC_CONFLICT), MUTATE),
        Decision::Permanent(Permanent::SpecConflict)
    );
}

#[test]
fn permission_denied_and_unauthenticated_are_the_environment() {
    for code in [Code::PermissionDenied, Code::Unauthenticated] {
        for source in [MUTATE, Source::Call(Rpc::Delete), Source::Call(Rpc::Read), Source::Operation(Rpc::Mutate)] {
            assert_eq!(
                decide(&report(code, reason::CLOUD_AUTH_FAILED), source),
                Decision::Backoff(Cause::Credentials),
                "{code:?} {source:?}"
            );
        }
    }
    assert_eq!(Cause::Credentials.environment_condition(), Some(ConditionType::CloudCredentialsRefused));
}

#[test]
fn failed_precondition_is_permanent_for_this_request() {
    assert_eq!(
        decide(&report(Code::FailedPrecondition, "UPDATE_NEEDS_REPLACEMENT"), MUTATE),
        Decision::Permanent(Permanent::Precondition)
    );
}

#[test]
fn not_found_on_a_delete_is_done() {
    for r in [reason::MACHINE_NOT_FOUND, reason::POOL_NOT_FOUND, ""] {
        assert_eq!(decide(&report(Code::NotFound, r), Source::Call(Rpc::Delete)), Decision::Done);
        assert_eq!(decide(&report(Code::NotFound, r), Source::Operation(Rpc::Delete)), Decision::Done);
    }
}

#[test]
fn not_found_on_reads_and_updates_means_absent() {
    assert_eq!(decide(&report(Code::NotFound, reason::MACHINE_NOT_FOUND), Source::Call(Rpc::Read)), Decision::Absent);
    assert_eq!(decide(&report(Code::NotFound, reason::POOL_NOT_FOUND), Source::Call(Rpc::Read)), Decision::Absent);
    assert_eq!(decide(&report(Code::NotFound, reason::MACHINE_NOT_FOUND), MUTATE), Decision::Absent);
    // A done operation the cloud no longer knows: send the original call again.
    assert_eq!(
        decide(&report(Code::NotFound, reason::OPERATION_NOT_FOUND), Source::Operation(Rpc::Mutate)),
        Decision::Backoff(Cause::InProgress)
    );
}

#[test]
fn unimplemented_capability_not_supported_is_never_retried() {
    assert_eq!(
        decide(&report(Code::Unimplemented, reason::CAPABILITY_NOT_SUPPORTED), Source::Call(Rpc::Read)),
        Decision::Permanent(Permanent::Unsupported)
    );
}

#[test]
fn out_of_range_is_permanent() {
    assert_eq!(decide(&report(Code::OutOfRange, ""), MUTATE), Decision::Permanent(Permanent::TooLarge));
}

#[test]
fn internal_and_unknown_retry_a_bounded_number_of_times() {
    for (code, r) in [(Code::Internal, reason::INTERNAL), (Code::Unknown, ""), (Code::Internal, "")] {
        let e = report(code, r);
        assert_eq!(decide(&e, MUTATE), Decision::Backoff(Cause::Internal));
        assert_eq!(decide_bounded(&e, MUTATE, 0), Decision::Backoff(Cause::Internal));
        assert_eq!(decide_bounded(&e, MUTATE, INTERNAL_RETRIES - 2), Decision::Backoff(Cause::Internal));
        assert_eq!(decide_bounded(&e, MUTATE, INTERNAL_RETRIES - 1), Decision::Permanent(Permanent::RetriesExhausted));
    }
    // The bound is INTERNAL's only: other retries go on.
    assert_eq!(decide_bounded(&report(Code::Unavailable, ""), MUTATE, 1000), Decision::Backoff(Cause::Unavailable));
}

#[test]
fn internal_inside_a_done_operation_is_the_cloud_failing_the_work() {
    for r in [reason::CLOUD_OPERATION_FAILED, "FAULT_INJECTED", reason::INTERNAL] {
        assert_eq!(
            decide(&report(Code::Internal, r), Source::Operation(Rpc::Mutate)),
            Decision::Permanent(Permanent::CloudFailed),
            "{r}"
        );
    }
}

#[test]
fn only_environment_causes_surface_a_condition() {
    assert_eq!(Cause::Unavailable.environment_condition(), Some(ConditionType::CloudUnavailable));
    assert_eq!(Cause::InProgress.environment_condition(), None);
    assert_eq!(Cause::Internal.environment_condition(), None);
    assert!(Decision::Backoff(Cause::Internal).is_retry());
    assert!(!Decision::Permanent(Permanent::InvalidSpec).is_retry());
    assert!(!Decision::Done.is_retry());
}

// ------------------------------------------------------------------------------- the blame table

#[test]
fn blame_follows_the_table() {
    let rows = [
        ("InvalidArgument", reason::INVALID_PROVIDER_SPEC, Blame::Revision),
        ("InvalidArgument", reason::FIELD_INVALID, Blame::Revision),
        ("Internal", reason::CLOUD_OPERATION_FAILED, Blame::Revision),
        ("Internal", "FAULT_INJECTED", Blame::Revision),
        ("DeadlineExceeded", REASON_CREATION_TIMEOUT, Blame::Revision),
        ("Unavailable", REASON_HEALTH_TIMEOUT, Blame::Revision),
        ("AlreadyExists", reason::MACHINE_SPEC_CONFLICT, Blame::Request),
        ("FailedPrecondition", "UPDATE_NEEDS_REPLACEMENT", Blame::Request),
        ("OutOfRange", "", Blame::Request),
        ("PermissionDenied", reason::CLOUD_AUTH_FAILED, Blame::Environment),
        ("Unauthenticated", reason::CLOUD_AUTH_FAILED, Blame::Environment),
        ("ResourceExhausted", reason::QUOTA_EXCEEDED, Blame::Environment),
        ("Unavailable", reason::CLOUD_UNAVAILABLE, Blame::Environment),
        ("Unavailable", reason::THROTTLED, Blame::Environment),
        ("DeadlineExceeded", "", Blame::Transient),
        ("Aborted", reason::OPERATION_PENDING, Blame::Transient),
        ("Cancelled", reason::OPERATION_CANCELLED, Blame::Transient),
        ("Internal", REASON_RETRIES_EXHAUSTED, Blame::Transient),
    ];
    for (code, r, want) in rows {
        assert_eq!(blame(code, r), want, "{code} {r}");
    }
    assert!(Blame::Revision.counts() && Blame::Request.counts());
    assert!(!Blame::Environment.counts() && !Blame::Transient.counts());
}
