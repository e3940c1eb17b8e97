//! AWS errors → [`DriverError`]: a table from the EC2 error code (and HTTP status) to the gRPC
//! code and stable reason. Every mapped error keeps the SDK error as its cause, the AWS error
//! code in ErrorInfo metadata (`awsErrorCode`) and the AWS request ID as a cloud request ID.
//!
//! | EC2 | gRPC code / reason |
//! |---|---|
//! | `InsufficientInstanceCapacity`, `InsufficientCapacity`, `InsufficientCapacityOnHost`, `InsufficientHostCapacity`, `InsufficientReservedInstanceCapacity`, `UnfulfillableCapacity` (the zone has no room for the type now) | RESOURCE_EXHAUSTED / INSUFFICIENT_CAPACITY |
//! | `*LimitExceeded` (`InstanceLimitExceeded`, `VcpuLimitExceeded`, …), `MaxSpotInstanceCountExceeded`, exhausted addresses (`InsufficientAddressCapacity`, `InsufficientFreeAddressesInSubnet`) | RESOURCE_EXHAUSTED / QUOTA_EXCEEDED |
//! | `Unsupported` (the type or configuration is not offered in the zone) | UNAVAILABLE / ZONE_UNAVAILABLE |
//! | `RequestLimitExceeded`, `Throttling`, …, HTTP 429 | UNAVAILABLE / THROTTLED + RetryInfo |
//! | `InternalError`, `Unavailable`, any 5xx, timeouts, transport failures | UNAVAILABLE / CLOUD_UNAVAILABLE + RetryInfo |
//! | `UnauthorizedOperation`, `AuthFailure`, …, no credentials | PERMISSION_DENIED / CLOUD_AUTH_FAILED |
//! | `IdempotentParameterMismatch` | ALREADY_EXISTS / MACHINE_SPEC_CONFLICT |
//! | `InvalidInstanceID.*` | NOT_FOUND / MACHINE_NOT_FOUND |
//! | `Invalid*`, `InvalidParameterValue`, `UnsupportedOperation`, … (on RunInstances) | INVALID_ARGUMENT / INVALID_PROVIDER_SPEC naming the spec field (FIELD_INVALID elsewhere) |

use std::error::Error as StdError;
use std::time::Duration;

use aws_sdk_ec2::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_ec2::operation::RequestId;
use aws_smithy_runtime_api::client::orchestrator::HttpResponse;
use driver_sdk::{reason, DriverError, RequestContext};

use crate::credentials::Source;
use crate::spec::field_for_code;

/// ErrorInfo metadata key holding the AWS error code.
pub const META_AWS_ERROR_CODE: &str = "awsErrorCode";
/// ErrorInfo metadata key saying whose credentials the call used: `chain`, `secretKeys` or
/// `assumedRole`.
pub const META_AWS_CREDENTIALS: &str = "awsCredentials";
/// ErrorInfo metadata key naming the EC2 API call that failed.
pub const META_AWS_OPERATION: &str = "awsOperation";

/// How long to tell callers to wait after throttling or a server error. EC2 sends no
/// Retry-After, so this is the driver's own hint (AWS recommends backing off from ~1 s).
pub const THROTTLE_RETRY_AFTER: Duration = Duration::from_secs(2);
/// RetryInfo for 5xx answers and transport failures.
pub const UNAVAILABLE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The EC2 call an error came from; it decides which spec field a bad parameter points at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// RunInstances: bad parameters are provider-spec errors.
    RunInstances,
    /// DescribeInstances.
    DescribeInstances,
    /// TerminateInstances.
    TerminateInstances,
    /// DescribeInstanceTypes (a class's machine capacity).
    DescribeInstanceTypes,
    /// DescribeInstanceStatus (the event source's poll).
    DescribeInstanceStatus,
    /// SQS ReceiveMessage (the interruption queue).
    ReceiveMessage,
    /// SQS DeleteMessage (an acknowledged event's message).
    DeleteMessage,
}

impl Call {
    fn name(self) -> &'static str {
        match self {
            Call::RunInstances => "RunInstances",
            Call::DescribeInstances => "DescribeInstances",
            Call::TerminateInstances => "TerminateInstances",
            Call::DescribeInstanceTypes => "DescribeInstanceTypes",
            Call::DescribeInstanceStatus => "DescribeInstanceStatus",
            Call::ReceiveMessage => "ReceiveMessage",
            Call::DeleteMessage => "DeleteMessage",
        }
    }
}

/// Capacity codes: the zone (or region) has no room for the instance type right now; another
/// zone may have.
const CAPACITY: &[&str] = &[
    "InsufficientInstanceCapacity",
    "InsufficientCapacity",
    "InsufficientCapacityOnHost",
    "InsufficientHostCapacity",
    "InsufficientReservedInstanceCapacity",
    "UnfulfillableCapacity",
];
/// Quota codes besides every `*LimitExceeded`: account limits, and exhausted addresses.
const QUOTA: &[&str] = &[
    "MaxSpotInstanceCountExceeded",
    "InsufficientAddressCapacity",
    "InsufficientFreeAddressesInSubnet",
    "InsufficientDBInstanceCapacity",
];
/// The zone does not offer the instance type or configuration (e.g. "Your requested instance
/// type is not supported in your requested Availability Zone").
const ZONE_UNAVAILABLE: &[&str] = &["Unsupported"];
/// Throttling codes (EC2 and the generic AWS ones).
const THROTTLING: &[&str] = &[
    "RequestLimitExceeded",
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottled",
    "RequestThrottledException",
    "TooManyRequestsException",
    "SlowDown",
    "PriorRequestNotComplete",
    "EC2ThrottledException",
];
/// Server-side codes.
const SERVER: &[&str] =
    &["InternalError", "InternalFailure", "ServiceUnavailable", "Unavailable", "ServerInternal", "RequestTimeout"];
/// Credential and permission codes.
const AUTH: &[&str] = &[
    "UnauthorizedOperation",
    "AuthFailure",
    "InvalidClientTokenId",
    "SignatureDoesNotMatch",
    "OptInRequired",
    "Blocked",
    "AccessDenied",
    "AccessDeniedException",
    "ExpiredToken",
    "RequestExpired",
    "UnrecognizedClientException",
    "InvalidAccessKeyId",
    "MissingAuthenticationToken",
    "PendingVerification",
];
/// Bad-parameter codes without a field of their own.
const BAD_PARAMETER: &[&str] = &[
    "InvalidParameterValue",
    "InvalidParameterCombination",
    "InvalidParameter",
    "MissingParameter",
    "UnknownParameter",
    "UnsupportedOperation",
    "ValidationError",
    "InvalidInput",
];

/// What a service error is, from its code and HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// The zone has no capacity for the instance type now: RESOURCE_EXHAUSTED /
    /// INSUFFICIENT_CAPACITY.
    Capacity,
    /// Account or regional limits: RESOURCE_EXHAUSTED / QUOTA_EXCEEDED.
    Quota,
    /// The zone does not offer what was asked: UNAVAILABLE / ZONE_UNAVAILABLE.
    ZoneUnavailable,
    /// Throttled: UNAVAILABLE / THROTTLED + RetryInfo.
    Throttled,
    /// Server error: UNAVAILABLE / CLOUD_UNAVAILABLE + RetryInfo.
    Server,
    /// Credentials or permissions: PERMISSION_DENIED / CLOUD_AUTH_FAILED.
    Auth,
    /// The same ClientToken with other parameters: ALREADY_EXISTS / MACHINE_SPEC_CONFLICT.
    IdempotencyMismatch,
    /// An instance ID AWS does not know (yet): NOT_FOUND / MACHINE_NOT_FOUND.
    InstanceNotFound,
    /// A parameter AWS refused: INVALID_ARGUMENT.
    BadParameter,
    /// Anything else.
    Other,
}

/// Classifies an AWS error code (with the HTTP status as a fallback).
pub fn classify(code: &str, status: Option<u16>) -> Class {
    let limit = code.ends_with("LimitExceeded") && !THROTTLING.contains(&code);
    if CAPACITY.contains(&code) {
        Class::Capacity
    } else if QUOTA.contains(&code) || limit {
        Class::Quota
    } else if ZONE_UNAVAILABLE.contains(&code) {
        Class::ZoneUnavailable
    } else if THROTTLING.contains(&code) || status == Some(429) {
        Class::Throttled
    } else if AUTH.contains(&code) || (code.is_empty() && matches!(status, Some(401 | 403))) {
        Class::Auth
    } else if code == "IdempotentParameterMismatch" {
        Class::IdempotencyMismatch
    } else if code.starts_with("InvalidInstanceID") {
        Class::InstanceNotFound
    } else if SERVER.contains(&code) || status.is_some_and(|s| s >= 500) {
        Class::Server
    } else if BAD_PARAMETER.contains(&code) || (code.starts_with("Invalid") && code != "InvalidNextToken") {
        Class::BadParameter
    } else {
        Class::Other
    }
}

/// Whether an SDK error is `InvalidInstanceID.NotFound` (or `.Malformed`): the instance is not
/// (yet) visible to DescribeInstances / TerminateInstances.
pub fn is_instance_not_found<E: ProvideErrorMetadata>(err: &SdkError<E, HttpResponse>) -> bool {
    matches!(err, SdkError::ServiceError(e) if e.err().code().is_some_and(|c| c.starts_with("InvalidInstanceID")))
}

/// Maps an SDK error of `call`, made with credentials from `source`, to a driver error, and logs
/// it with both request IDs.
pub fn map_sdk_error<E>(ctx: &RequestContext, call: Call, source: Source, err: SdkError<E, HttpResponse>) -> DriverError
where
    E: ProvideErrorMetadata + StdError + Send + Sync + 'static,
{
    let (mapped, code, aws_request_id) = match &err {
        SdkError::ServiceError(service) => {
            let raw = service.raw();
            let code = service.err().code().unwrap_or_default().to_string();
            let message = service.err().message().unwrap_or_default().to_string();
            let status = raw.status().as_u16();
            // The SDK reads `x-amzn-requestid`; EC2's XML error body has <RequestID> too, which is
            // all some endpoints send.
            let request_id = err
                .request_id()
                .map(str::to_string)
                .or_else(|| raw.body().bytes().and_then(request_id_from_body))
                .unwrap_or_default();
            (from_code(call, &code, &message, Some(status)), code, request_id)
        }
        SdkError::TimeoutError(_) => (
            DriverError::unavailable(reason::CLOUD_UNAVAILABLE, format!("{} timed out", call.name()))
                .with_retry_after(UNAVAILABLE_RETRY_AFTER),
            String::new(),
            String::new(),
        ),
        SdkError::DispatchFailure(_) | SdkError::ResponseError(_) | SdkError::ConstructionFailure(_)
            if credentials_error(&err) =>
        {
            (
                DriverError::auth_failed(match source {
                    Source::Chain => format!(
                        "{}: no usable AWS credentials (environment, profile, web identity or instance metadata)",
                        call.name()
                    ),
                    _ => format!("{}: no usable AWS credentials from {}", call.name(), source.describe()),
                }),
                String::new(),
                err.request_id().unwrap_or_default().to_string(),
            )
        }
        SdkError::DispatchFailure(_) | SdkError::ResponseError(_) => (
            DriverError::unavailable(reason::CLOUD_UNAVAILABLE, format!("{}: EC2 could not be reached", call.name()))
                .with_retry_after(UNAVAILABLE_RETRY_AFTER),
            String::new(),
            err.request_id().unwrap_or_default().to_string(),
        ),
        _ => (
            DriverError::internal(format!("{}: building the request failed", call.name())),
            String::new(),
            String::new(),
        ),
    };
    let mut mapped = if mapped.code() == driver_sdk::tonic::Code::PermissionDenied
        && !mapped.message().contains("no usable AWS credentials")
    {
        // Say whose credentials were refused: the class's secret or the sidecar's chain.
        DriverError::auth_failed(format!("{} (credentials: {})", mapped.message(), source.describe()))
    } else {
        mapped
    };
    mapped = mapped.with_metadata(META_AWS_OPERATION, call.name()).with_metadata(META_AWS_CREDENTIALS, source.kind());
    if !code.is_empty() {
        mapped = mapped.with_metadata(META_AWS_ERROR_CODE, code.clone());
    }
    mapped = mapped.with_cloud_request_id(aws_request_id.clone());
    tracing::warn!(
        "request.id" = %ctx.request_id(),
        "aws.request_id" = %aws_request_id,
        "aws.error_code" = %code,
        "aws.operation" = call.name(),
        error = %driver_sdk::error_chain(&err),
        "EC2 call failed"
    );
    mapped.with_source(err)
}

fn from_code(call: Call, code: &str, message: &str, status: Option<u16>) -> DriverError {
    let what = format!("{} failed: {code}: {message}", call.name());
    match classify(code, status) {
        Class::Capacity => DriverError::insufficient_capacity(what),
        Class::Quota => DriverError::quota_exceeded(what),
        Class::ZoneUnavailable => DriverError::zone_unavailable(what),
        Class::Throttled => DriverError::throttled(what, THROTTLE_RETRY_AFTER),
        Class::Server => {
            DriverError::unavailable(reason::CLOUD_UNAVAILABLE, what).with_retry_after(UNAVAILABLE_RETRY_AFTER)
        }
        Class::Auth => DriverError::auth_failed(what),
        Class::IdempotencyMismatch => DriverError::already_exists(
            reason::MACHINE_SPEC_CONFLICT,
            format!("{what} (an instance was launched for this machine with other parameters)"),
        ),
        Class::InstanceNotFound => DriverError::not_found(reason::MACHINE_NOT_FOUND, what),
        Class::BadParameter if call == Call::RunInstances => {
            let field = match field_for_code(code, message) {
                "" => "provider_spec".to_string(),
                f => format!("provider_spec.{f}"),
            };
            DriverError::invalid_provider_spec(vec![driver_sdk::Violation::new(field, format!("{code}: {message}"))])
        }
        Class::BadParameter => DriverError::invalid_argument(reason::FIELD_INVALID, what),
        Class::Other if status.is_some_and(|s| (400..500).contains(&s)) && call == Call::RunInstances => {
            DriverError::invalid_provider_spec(vec![driver_sdk::Violation::new(
                "provider_spec",
                format!("{code}: {message}"),
            )])
        }
        Class::Other => DriverError::internal(what),
    }
}

/// `<RequestID>…</RequestID>` (or `<RequestId>`) of an EC2 XML error body.
fn request_id_from_body(body: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(body).ok()?;
    ["RequestID", "RequestId", "requestId"].iter().find_map(|tag| {
        let start = text.find(&format!("<{tag}>"))? + tag.len() + 2;
        let end = text[start..].find("</")? + start;
        Some(text[start..end].trim().to_string()).filter(|s| !s.is_empty())
    })
}

/// Whether the failure was resolving credentials (not reaching EC2).
fn credentials_error(err: &(dyn StdError + 'static)) -> bool {
    let mut next: Option<&(dyn StdError + 'static)> = Some(err);
    while let Some(e) = next {
        if e.is::<aws_credential_types::provider::error::CredentialsError>() {
            return true;
        }
        next = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use driver_sdk::tonic::Code;

    #[test]
    fn codes_map_per_the_table() {
        let cases = [
            ("InsufficientInstanceCapacity", 500, Code::ResourceExhausted, reason::INSUFFICIENT_CAPACITY),
            ("InsufficientCapacity", 500, Code::ResourceExhausted, reason::INSUFFICIENT_CAPACITY),
            ("InsufficientCapacityOnHost", 500, Code::ResourceExhausted, reason::INSUFFICIENT_CAPACITY),
            ("InsufficientHostCapacity", 500, Code::ResourceExhausted, reason::INSUFFICIENT_CAPACITY),
            ("InsufficientReservedInstanceCapacity", 500, Code::ResourceExhausted, reason::INSUFFICIENT_CAPACITY),
            ("InstanceLimitExceeded", 400, Code::ResourceExhausted, reason::QUOTA_EXCEEDED),
            ("VcpuLimitExceeded", 400, Code::ResourceExhausted, reason::QUOTA_EXCEEDED),
            ("MaxSpotInstanceCountExceeded", 400, Code::ResourceExhausted, reason::QUOTA_EXCEEDED),
            ("InsufficientFreeAddressesInSubnet", 400, Code::ResourceExhausted, reason::QUOTA_EXCEEDED),
            ("Unsupported", 400, Code::Unavailable, reason::ZONE_UNAVAILABLE),
            ("UnsupportedOperation", 400, Code::InvalidArgument, reason::INVALID_PROVIDER_SPEC),
            ("RequestLimitExceeded", 503, Code::Unavailable, reason::THROTTLED),
            ("Throttling", 400, Code::Unavailable, reason::THROTTLED),
            ("InternalError", 500, Code::Unavailable, reason::CLOUD_UNAVAILABLE),
            ("Whatever", 503, Code::Unavailable, reason::CLOUD_UNAVAILABLE),
            ("UnauthorizedOperation", 403, Code::PermissionDenied, reason::CLOUD_AUTH_FAILED),
            ("AuthFailure", 401, Code::PermissionDenied, reason::CLOUD_AUTH_FAILED),
            ("IdempotentParameterMismatch", 400, Code::AlreadyExists, reason::MACHINE_SPEC_CONFLICT),
            ("InvalidAMIID.NotFound", 400, Code::InvalidArgument, reason::INVALID_PROVIDER_SPEC),
            ("InvalidParameterValue", 400, Code::InvalidArgument, reason::INVALID_PROVIDER_SPEC),
        ];
        for (code, status, want, want_reason) in cases {
            let e = from_code(Call::RunInstances, code, "m", Some(status));
            assert_eq!((e.code(), e.reason()), (want, want_reason), "{code}");
        }
        let e = from_code(Call::RunInstances, "InvalidAMIID.NotFound", "no such AMI", Some(400));
        assert_eq!(e.violations()[0].field, "provider_spec.imageId");
        assert!(from_code(Call::RunInstances, "RequestLimitExceeded", "m", Some(503)).retry_after().is_some());
        assert_eq!(
            from_code(Call::DescribeInstances, "InvalidParameterValue", "m", Some(400)).reason(),
            reason::FIELD_INVALID
        );
    }

    #[test]
    fn request_id_is_read_from_the_xml_body() {
        let body = b"<Response><Errors><Error><Code>X</Code></Error></Errors><RequestID>abc-1</RequestID></Response>";
        assert_eq!(request_id_from_body(body).as_deref(), Some("abc-1"));
        assert_eq!(request_id_from_body(b"<Response/>"), None);
    }
}
