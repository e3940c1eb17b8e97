//! ARM errors → protocol errors.
//!
//! | ARM | gRPC code / reason |
//! |---|---|
//! | 429 | UNAVAILABLE / THROTTLED, RetryInfo from `Retry-After` (10 s when absent) |
//! | capacity codes (`ZonalAllocationFailed`, `AllocationFailed`, `OverconstrainedAllocationRequest`, `OverconstrainedZonalAllocationRequest`): the zone (or region) has no room for the size now | RESOURCE_EXHAUSTED / INSUFFICIENT_CAPACITY |
//! | `SkuNotAvailable`: the size is not offered in the location or zone | UNAVAILABLE / ZONE_UNAVAILABLE |
//! | quota codes (`QuotaExceeded`, `ResourceQuotaExceeded`, `OperationNotAllowed` about quota, …) | RESOURCE_EXHAUSTED / QUOTA_EXCEEDED |
//! | 409 (other) | ABORTED / OPERATION_PENDING |
//! | 401 | UNAUTHENTICATED / CLOUD_AUTH_FAILED |
//! | 403 | PERMISSION_DENIED / CLOUD_AUTH_FAILED |
//! | 400 (and 404 image / SKU lookups) | INVALID_ARGUMENT / INVALID_PROVIDER_SPEC (or FIELD_INVALID), with a BadRequest violation on the field named by `error.target` |
//! | 404 | NOT_FOUND with the caller's reason (POOL_NOT_FOUND, OPERATION_NOT_FOUND) |
//! | 5xx, transport errors, timeouts | UNAVAILABLE / CLOUD_UNAVAILABLE (RetryInfo when `Retry-After` came) |
//! | no access token: Microsoft Entra ID refused the credential, or the default credential found none | PERMISSION_DENIED / CLOUD_AUTH_FAILED (as the AWS driver for refused credentials), naming the credential kind; Entra's `error` / `AADSTS…` code in ErrorInfo metadata `aadError` / `aadErrorCode`, its `trace_id` as the cloud request ID |
//! | no access token: Entra unreachable, throttling or failing (a MachineClass credential) | UNAVAILABLE / CLOUD_UNAVAILABLE |
//! | a failed async operation | its ARM code in ErrorInfo metadata `armErrorCode`; capacity, `SkuNotAvailable` and quota codes as above (ARM reports a zonal VM's `ZonalAllocationFailed` this way), else INTERNAL / CLOUD_OPERATION_FAILED; `Canceled` → CANCELLED / OPERATION_CANCELLED |
//!
//! Every error carries ARM's `x-ms-request-id` as a cloud request ID, and `armErrorCode`,
//! `httpStatus` and `correlationRequestId` as ErrorInfo metadata. Token failures carry
//! `azureCredential` (`default`, `clientSecret`, `workloadIdentity`: see
//! [`class_credential`](crate::class_credential)) and never a credential value.

use std::time::Duration;

use driver_sdk::tonic::Code;
use driver_sdk::{reason, DriverError};

use crate::arm::{ArmError, StatusError};
use crate::class_credential::{ClassTokenError, EntraAnswer, Source};

/// Throttling delay assumed when a 429 carries no `Retry-After`.
pub const DEFAULT_THROTTLE_DELAY: Duration = Duration::from_secs(10);

/// ARM error codes that mean the zone (or region) has no capacity for the size now.
const CAPACITY_CODES: &[&str] = &[
    "ZonalAllocationFailed",
    "AllocationFailed",
    "OverconstrainedAllocationRequest",
    "OverconstrainedZonalAllocationRequest",
];

/// ARM error codes that mean the location or zone does not offer the size.
const ZONE_UNAVAILABLE_CODES: &[&str] = &["SkuNotAvailable"];

/// ARM error codes that mean an account or regional quota.
const QUOTA_CODES: &[&str] = &["QuotaExceeded", "ResourceQuotaExceeded", "ResourceCountExceedsLimitDueToTemplate"];

/// ARM error codes about the request's content (the provider spec).
const SPEC_CODES: &[&str] = &[
    "InvalidParameter",
    "InvalidRequestContent",
    "InvalidRequestFormat",
    "InvalidTemplate",
    "PlatformImageNotFound",
    "ImageNotFound",
    "InvalidTagNameCharacters",
    "LocationRequired",
    "LocationNotAvailableForResourceType",
    "NoRegisteredProviderFound",
    "BadRequest",
];

/// Whether an ARM error code says the zone (or region) has no capacity for the size now.
pub fn is_capacity(code: &str) -> bool {
    CAPACITY_CODES.iter().any(|c| c.eq_ignore_ascii_case(code))
}

/// Whether an ARM error code says the location or zone does not offer the size.
pub fn is_zone_unavailable(code: &str) -> bool {
    ZONE_UNAVAILABLE_CODES.iter().any(|c| c.eq_ignore_ascii_case(code))
}

/// Whether an ARM error (code + message) is about an account or regional quota.
pub fn is_quota(code: &str, message: &str) -> bool {
    QUOTA_CODES.iter().any(|c| c.eq_ignore_ascii_case(code))
        || (code.eq_ignore_ascii_case("OperationNotAllowed") && message.to_ascii_lowercase().contains("quota"))
}

/// The error of a refusal for capacity, zone or quota (`code` + `message` from ARM), with the
/// text `msg`; `None` for any other code.
fn refused(code: &str, message: &str, msg: String) -> Option<DriverError> {
    if is_capacity(code) {
        Some(DriverError::insufficient_capacity(msg))
    } else if is_zone_unavailable(code) {
        Some(DriverError::zone_unavailable(msg))
    } else if is_quota(code, message) {
        Some(DriverError::quota_exceeded(msg))
    } else {
        None
    }
}

/// Maps an ARM `error.target` to the request field it came from.
pub fn field_of(target: &str) -> String {
    let t = target.trim();
    let lower = t.to_ascii_lowercase();
    let spec = |f: &str| format!("provider_spec.{f}");
    if lower == "instanceids" || lower.ends_with(".instanceids") {
        "instance_ids".into()
    } else if lower == "sku.name" || lower.ends_with("vmsize") {
        spec("vmSize")
    } else if lower.contains("virtualmachinescaleset") {
        spec("virtualMachineScaleSet")
    } else if lower.contains("networkprofile") || lower.contains("networkinterface") {
        spec("subnetId")
    } else if lower.contains("imagereference") {
        spec("image")
    } else if lower == "location" {
        spec("location")
    } else if lower.contains("zones") {
        spec("zones")
    } else if lower.contains("osdisk") {
        spec("osDiskType")
    } else if lower.contains("subnet") {
        spec("subnetId")
    } else if lower.contains("ssh") || lower.contains("publickeys") {
        spec("sshPublicKey")
    } else if lower.contains("adminusername") {
        spec("adminUsername")
    } else if lower.starts_with("tags") {
        "labels".into()
    } else if lower == "sku.capacity" {
        "capacity".into()
    } else {
        spec(t)
    }
}

fn annotate(mut err: DriverError, e: &StatusError) -> DriverError {
    if let Some(id) = &e.request_id {
        err = err.with_cloud_request_id(id.clone());
    }
    if let Some(id) = &e.correlation_id {
        err = err.with_metadata("correlationRequestId", id.clone());
    }
    if !e.code.is_empty() {
        err = err.with_metadata("armErrorCode", e.code.clone());
    }
    err.with_metadata("httpStatus", e.status.to_string())
}

/// Maps a failed ARM call to a protocol error; `not_found` is the reason for a 404.
pub fn to_driver_error(err: ArmError, not_found: &str) -> DriverError {
    match err {
        ArmError::Status(e) => {
            let msg = if e.code.is_empty() { e.message.clone() } else { format!("{}: {}", e.code, e.message) };
            let refusal = if e.status == 429 { None } else { refused(&e.code, &e.message, msg.clone()) };
            let mapped = if e.status == 429 {
                DriverError::throttled(
                    format!("ARM throttled the call: {msg}"),
                    e.retry_after.unwrap_or(DEFAULT_THROTTLE_DELAY),
                )
            } else if let Some(d) = refusal {
                d
            } else if e.status == 401 {
                DriverError::new(Code::Unauthenticated, reason::CLOUD_AUTH_FAILED, msg)
            } else if e.status == 403 {
                DriverError::auth_failed(msg)
            } else if e.status == 409 {
                DriverError::operation_pending(msg)
            } else if e.status == 400 || (e.status == 404 && SPEC_CODES.iter().any(|c| c.eq_ignore_ascii_case(&e.code)))
            {
                let field = e.target.as_deref().map(field_of);
                let reason = match &field {
                    Some(f) if !f.starts_with("provider_spec") => reason::FIELD_INVALID,
                    _ => reason::INVALID_PROVIDER_SPEC,
                };
                let mut d = DriverError::invalid_argument(reason, msg);
                if let Some(f) = field {
                    d = d.with_violation(f, e.message.clone());
                } else if e.code.eq_ignore_ascii_case("PlatformImageNotFound")
                    || e.code.eq_ignore_ascii_case("ImageNotFound")
                {
                    d = d.with_violation("provider_spec.image", e.message.clone());
                }
                d
            } else if e.status == 404 {
                DriverError::not_found(not_found, msg)
            } else if e.status >= 500 {
                let mut d = DriverError::unavailable(reason::CLOUD_UNAVAILABLE, format!("ARM server error: {msg}"));
                if let Some(r) = e.retry_after {
                    d = d.with_retry_after(r);
                }
                d
            } else {
                DriverError::new(Code::FailedPrecondition, reason::CLOUD_OPERATION_FAILED, msg)
            };
            annotate(mapped, &e)
        }
        ArmError::Credential(source) => credential_error(source),
        e @ (ArmError::Transport(_) | ArmError::Timeout(_)) => {
            DriverError::unavailable(reason::CLOUD_UNAVAILABLE, "ARM could not be reached").with_source(e)
        }
        ArmError::Decode { what, request_id, source } => {
            let mut d =
                DriverError::internal(format!("ARM returned a {what} this driver cannot read")).with_source(source);
            if let Some(id) = request_id {
                d = d.with_cloud_request_id(id);
            }
            d
        }
        e @ (ArmError::ForeignUrl(_) | ArmError::Url(_)) => DriverError::internal(e.to_string()),
    }
}

/// A credential that produced no token: PERMISSION_DENIED / CLOUD_AUTH_FAILED when Entra refused
/// it (or the default credential found none), UNAVAILABLE / CLOUD_UNAVAILABLE when Entra failed
/// or was not reached; the message names the credential's kind, never a value.
pub fn credential_error(err: azure_core::Error) -> DriverError {
    let class = match err.into_downcast::<ClassTokenError>() {
        Ok(class) => class,
        Err(err) => {
            return DriverError::auth_failed(format!(
                "{} could not get an Azure access token",
                Source::Default.describe()
            ))
            .with_metadata("azureCredential", Source::Default.kind())
            .with_source(err)
        }
    };
    let message = class.to_string();
    let mut mapped = match class.answer() {
        Some(EntraAnswer::Failed { .. } | EntraAnswer::NoAnswer) => {
            DriverError::unavailable(reason::CLOUD_UNAVAILABLE, message)
        }
        _ => DriverError::auth_failed(message),
    };
    mapped = mapped
        .with_metadata("azureCredential", class.credential_source().kind())
        .with_metadata("azureCredentialFingerprint", class.fingerprint());
    if let Some(r) = class.refusal() {
        if !r.error.is_empty() {
            mapped = mapped.with_metadata("aadError", r.error.clone());
        }
        if let Some(code) = &r.code {
            mapped = mapped.with_metadata("aadErrorCode", code.clone());
        }
        if let Some(id) = &r.trace_id {
            mapped = mapped.with_cloud_request_id(id.clone());
        }
        if let Some(id) = &r.correlation_id {
            mapped = mapped.with_metadata("correlationRequestId", id.clone());
        }
    }
    mapped.with_source(class.into_cause())
}

/// The error a failed or canceled async operation ends with.
pub fn operation_failed(status: &str, code: &str, message: &str, request_id: Option<&str>) -> DriverError {
    let msg = if code.is_empty() {
        format!("ARM operation {status}")
    } else {
        format!("ARM operation {status}: {code}: {message}")
    };
    let mut err = if status.eq_ignore_ascii_case("Canceled") {
        DriverError::new(Code::Cancelled, reason::OPERATION_CANCELLED, msg)
    } else {
        refused(code, message, msg.clone())
            .unwrap_or_else(|| DriverError::new(Code::Internal, reason::CLOUD_OPERATION_FAILED, msg))
    };
    if !code.is_empty() {
        err = err.with_metadata("armErrorCode", code);
    }
    if let Some(id) = request_id {
        err = err.with_cloud_request_id(id);
    }
    err.with_metadata("armStatus", status)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(status: u16, code: &str, message: &str, target: Option<&str>) -> ArmError {
        ArmError::Status(Box::new(StatusError {
            status,
            code: code.into(),
            message: message.into(),
            target: target.map(str::to_string),
            retry_after: (status == 429).then(|| Duration::from_secs(3)),
            request_id: Some("req-1".into()),
            correlation_id: Some("corr-1".into()),
        }))
    }

    #[test]
    fn maps_status_codes() {
        let cases = [
            (status(429, "TooManyRequests", "slow down", None), Code::Unavailable, reason::THROTTLED),
            (
                status(409, "OperationNotAllowed", "exceeding approved Total Regional Cores quota", None),
                Code::ResourceExhausted,
                reason::QUOTA_EXCEEDED,
            ),
            (status(409, "QuotaExceeded", "no cores", None), Code::ResourceExhausted, reason::QUOTA_EXCEEDED),
            (status(409, "SkuNotAvailable", "not in zone 2", None), Code::Unavailable, reason::ZONE_UNAVAILABLE),
            (
                status(409, "ZonalAllocationFailed", "no room", None),
                Code::ResourceExhausted,
                reason::INSUFFICIENT_CAPACITY,
            ),
            (status(409, "AllocationFailed", "no room", None), Code::ResourceExhausted, reason::INSUFFICIENT_CAPACITY),
            (
                status(409, "OverconstrainedAllocationRequest", "too narrow", None),
                Code::ResourceExhausted,
                reason::INSUFFICIENT_CAPACITY,
            ),
            (
                status(409, "OverconstrainedZonalAllocationRequest", "too narrow", None),
                Code::ResourceExhausted,
                reason::INSUFFICIENT_CAPACITY,
            ),
            (status(409, "Conflict", "another operation", None), Code::Aborted, reason::OPERATION_PENDING),
            (status(401, "AuthenticationFailed", "no", None), Code::Unauthenticated, reason::CLOUD_AUTH_FAILED),
            (status(403, "AuthorizationFailed", "no", None), Code::PermissionDenied, reason::CLOUD_AUTH_FAILED),
            (status(503, "ServiceUnavailable", "later", None), Code::Unavailable, reason::CLOUD_UNAVAILABLE),
            (status(404, "ResourceNotFound", "gone", None), Code::NotFound, reason::POOL_NOT_FOUND),
        ];
        for (err, code, why) in cases {
            let d = to_driver_error(err, reason::POOL_NOT_FOUND);
            assert_eq!((d.code(), d.reason()), (code, why), "{d:?}");
            assert_eq!(d.cloud_request_ids(), ["req-1"]);
            assert_eq!(d.metadata().get("correlationRequestId").map(String::as_str), Some("corr-1"));
        }
        let throttled = to_driver_error(status(429, "TooManyRequests", "x", None), "");
        assert_eq!(throttled.retry_after(), Some(Duration::from_secs(3)));
    }

    #[test]
    fn bad_requests_name_the_field() {
        let d = to_driver_error(status(400, "InvalidParameter", "bad size", Some("sku.name")), "");
        assert_eq!((d.code(), d.reason()), (Code::InvalidArgument, reason::INVALID_PROVIDER_SPEC));
        assert_eq!(d.violations()[0].field, "provider_spec.vmSize");
        assert_eq!(d.metadata().get("armErrorCode").map(String::as_str), Some("InvalidParameter"));
        let d = to_driver_error(status(400, "InvalidParameter", "no such instance", Some("instanceIds")), "");
        assert_eq!((d.reason(), d.violations()[0].field.as_str()), (reason::FIELD_INVALID, "instance_ids"));
        let d = to_driver_error(status(404, "PlatformImageNotFound", "no image", None), "");
        assert_eq!((d.code(), d.violations()[0].field.as_str()), (Code::InvalidArgument, "provider_spec.image"));
    }

    #[test]
    fn failed_operations_keep_the_arm_code() {
        let d = operation_failed("Failed", "AllocationFailed", "no capacity", Some("r"));
        assert_eq!(
            (d.code(), d.metadata().get("armErrorCode").map(String::as_str)),
            (Code::ResourceExhausted, Some("AllocationFailed"))
        );
        let cases = [
            ("ZonalAllocationFailed", Code::ResourceExhausted, reason::INSUFFICIENT_CAPACITY),
            ("AllocationFailed", Code::ResourceExhausted, reason::INSUFFICIENT_CAPACITY),
            ("OverconstrainedAllocationRequest", Code::ResourceExhausted, reason::INSUFFICIENT_CAPACITY),
            ("OverconstrainedZonalAllocationRequest", Code::ResourceExhausted, reason::INSUFFICIENT_CAPACITY),
            ("SkuNotAvailable", Code::Unavailable, reason::ZONE_UNAVAILABLE),
            ("QuotaExceeded", Code::ResourceExhausted, reason::QUOTA_EXCEEDED),
        ];
        for (code, want, why) in cases {
            let d = operation_failed("Failed", code, "m", Some("r"));
            assert_eq!((d.code(), d.reason()), (want, why), "{code}");
            assert_eq!(d.metadata().get("armErrorCode").map(String::as_str), Some(code));
            assert_eq!(d.cloud_request_ids(), ["r"]);
        }
        let d = operation_failed("Failed", "InternalOperationError", "boom", None);
        assert_eq!((d.code(), d.reason()), (Code::Internal, reason::CLOUD_OPERATION_FAILED));
        let d = operation_failed("Canceled", "OperationCanceled", "stop", None);
        assert_eq!(d.code(), Code::Cancelled);
    }
}
