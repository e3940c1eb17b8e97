use super::*;
use crate::types::Secrets;

#[derive(Debug, thiserror::Error)]
#[error("connection refused by api.cloud.test")]
struct Inner;

#[derive(Debug, thiserror::Error)]
#[error("sending RunInstances")]
struct Outer(#[source] Inner);

#[test]
fn round_trips_every_detail_through_the_wire_form() {
    let err = DriverError::throttled("rate limited", Duration::from_millis(1500))
        .with_cloud_request_id("aws-1")
        .with_cloud_request_id("aws-2")
        .with_metadata("awsErrorCode", "RequestLimitExceeded")
        .with_violation("provider_spec.ami", "must start with ami-")
        .with_source(Outer(Inner));
    let status = err.to_status("fake.machinedriver.dev", "req-42", None);
    let report = ErrorReport::from_status(&status);
    assert_eq!(report.code, Code::Unavailable);
    assert_eq!(report.reason, reason::THROTTLED);
    assert_eq!(report.domain, "fake.machinedriver.dev");
    assert_eq!(report.retry_after, Some(Duration::from_millis(1500)));
    assert_eq!(report.request_id, "req-42");
    assert_eq!(report.cloud_request_ids, vec!["aws-1", "aws-2"]);
    assert_eq!(report.metadata.get("awsErrorCode").map(String::as_str), Some("RequestLimitExceeded"));
    assert_eq!(report.violations, vec![Violation::new("provider_spec.ami", "must start with ami-")]);
    assert_eq!(report.causes, vec!["sending RunInstances", "connection refused by api.cloud.test"]);
}

#[test]
fn secrets_are_redacted_from_message_causes_and_metadata() {
    let secrets = Secrets::from_iter([("password", "s3cr3t-value")]);
    let err = DriverError::auth_failed("login with s3cr3t-value refused")
        .with_metadata("hint", "s3cr3t-value")
        .with_source(std::io::Error::other("bad s3cr3t-value"));
    let status = err.to_status("d", "r", Some(&secrets));
    let report = ErrorReport::from_status(&status);
    let printed = format!("{report:?} {status:?}");
    assert!(!printed.contains("s3cr3t-value"), "{printed}");
    assert!(report.message.contains("[REDACTED]"));
}

#[test]
fn a_plain_status_decodes_without_details() {
    let report = ErrorReport::from_status(&tonic::Status::unavailable("transport closed"));
    assert_eq!(report.code, Code::Unavailable);
    assert_eq!(report.reason, "");
}
