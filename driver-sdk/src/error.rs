//! Typed driver errors and their wire form (google.rpc.Status with ErrorInfo, RetryInfo,
//! RequestInfo, BadRequest and DebugInfo details).
//!
//! A driver returns [`DriverError`]; the SDK sends it as a `tonic::Status` carrying the richer
//! error model. A caller decodes any status back into an [`ErrorReport`] — code, reason,
//! retry-after, request IDs, field violations and the cause chain as a list — without parsing
//! strings.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::time::Duration;

use prost::Message;
use tonic::Code;
use tonic_types::{ErrorDetails, FieldViolation, StatusExt};

use crate::secrets::Secrets;

/// The result type of driver methods.
pub type Result<T, E = DriverError> = std::result::Result<T, E>;

/// Stable `ErrorInfo.reason` values used by the SDK and the bundled drivers.
///
/// Drivers may add their own UPPER_SNAKE reasons; these are the ones callers match on.
pub mod reason {
    /// A required request field is empty.
    pub const FIELD_REQUIRED: &str = "FIELD_REQUIRED";
    /// A request field is present but malformed.
    pub const FIELD_INVALID: &str = "FIELD_INVALID";
    /// The provider spec does not match the driver's schema or the cloud rejected it.
    pub const INVALID_PROVIDER_SPEC: &str = "INVALID_PROVIDER_SPEC";
    /// A machine with this name exists with a different spec.
    pub const MACHINE_SPEC_CONFLICT: &str = "MACHINE_SPEC_CONFLICT";
    /// No machine has this name.
    pub const MACHINE_NOT_FOUND: &str = "MACHINE_NOT_FOUND";
    /// No pool has this name.
    pub const POOL_NOT_FOUND: &str = "POOL_NOT_FOUND";
    /// Another mutating operation is in flight on the same resource.
    pub const OPERATION_PENDING: &str = "OPERATION_PENDING";
    /// The operation token is corrupted, forged, from another driver or of an unknown version.
    pub const OPERATION_TOKEN_INVALID: &str = "OPERATION_TOKEN_INVALID";
    /// The cloud no longer knows the operation.
    pub const OPERATION_NOT_FOUND: &str = "OPERATION_NOT_FOUND";
    /// The operation was cancelled.
    pub const OPERATION_CANCELLED: &str = "OPERATION_CANCELLED";
    /// The cloud ran the operation and it failed.
    pub const CLOUD_OPERATION_FAILED: &str = "CLOUD_OPERATION_FAILED";
    /// An account or regional quota was hit (RESOURCE_EXHAUSTED).
    pub const QUOTA_EXCEEDED: &str = "QUOTA_EXCEEDED";
    /// The zone (or region) has no capacity for this machine type now (RESOURCE_EXHAUSTED): AWS
    /// `InsufficientInstanceCapacity`, Azure `AllocationFailed` / `ZonalAllocationFailed`. An owner
    /// with failure domains places the machine in another one.
    pub const INSUFFICIENT_CAPACITY: &str = "INSUFFICIENT_CAPACITY";
    /// The zone refuses requests (an outage, or the machine type is not offered there)
    /// (UNAVAILABLE). An owner with failure domains places the machine in another one.
    pub const ZONE_UNAVAILABLE: &str = "ZONE_UNAVAILABLE";
    /// The cloud throttled the call; come back after RetryInfo.retry_delay.
    pub const THROTTLED: &str = "THROTTLED";
    /// The cloud refused the credentials or the permission.
    pub const CLOUD_AUTH_FAILED: &str = "CLOUD_AUTH_FAILED";
    /// The cloud could not be reached or answered with a server error.
    pub const CLOUD_UNAVAILABLE: &str = "CLOUD_UNAVAILABLE";
    /// The driver does not implement this RPC (capability not advertised).
    pub const CAPABILITY_NOT_SUPPORTED: &str = "CAPABILITY_NOT_SUPPORTED";
    /// The driver is not ready yet (Probe says ready=false).
    pub const DRIVER_NOT_READY: &str = "DRIVER_NOT_READY";
    /// An unexpected failure inside the driver.
    pub const INTERNAL: &str = "INTERNAL";
    /// The caller's deadline (`grpc-timeout`) passed before the driver answered.
    pub const DEADLINE_EXCEEDED: &str = "DEADLINE_EXCEEDED";
}

pub use driver_sdk_core::Violation;

/// An error a driver returns: a gRPC code, a stable reason, a message and the cause chain.
///
/// ```
/// use driver_sdk::{DriverError, reason};
/// use std::time::Duration;
/// let err = DriverError::unavailable(reason::THROTTLED, "cloud API rate limit")
///     .with_retry_after(Duration::from_secs(2))
///     .with_cloud_request_id("req-1234");
/// assert_eq!(err.code(), tonic::Code::Unavailable);
/// ```
#[non_exhaustive]
pub struct DriverError(Box<Fields>);

/// The fields of a [`DriverError`], boxed so that `Result<T, DriverError>` stays small.
struct Fields {
    code: Code,
    reason: String,
    message: String,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
    retry_after: Option<Duration>,
    cloud_request_ids: Vec<String>,
    violations: Vec<Violation>,
    metadata: BTreeMap<String, String>,
}

impl DriverError {
    /// An error with the given code, reason (UPPER_SNAKE) and message.
    pub fn new(code: Code, reason: impl Into<String>, message: impl Into<String>) -> Self {
        Self(Box::new(Fields {
            code,
            reason: reason.into(),
            message: message.into(),
            source: None,
            retry_after: None,
            cloud_request_ids: Vec::new(),
            violations: Vec::new(),
            metadata: BTreeMap::new(),
        }))
    }

    /// INVALID_ARGUMENT: the request is wrong; retrying it unchanged will fail again.
    pub fn invalid_argument(reason: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, reason, message)
    }

    /// INVALID_ARGUMENT / INVALID_PROVIDER_SPEC with one field violation per problem.
    pub fn invalid_provider_spec(violations: Vec<Violation>) -> Self {
        let fields: Vec<&str> = violations.iter().map(|v| v.field.as_str()).collect();
        let message = format!("invalid provider spec: {}", fields.join(", "));
        let mut err = Self::invalid_argument(reason::INVALID_PROVIDER_SPEC, message);
        err.0.violations = violations;
        err
    }

    /// NOT_FOUND: the named machine, pool or operation does not exist (e.g.
    /// [`reason::MACHINE_NOT_FOUND`]); a delete treats it as done.
    pub fn not_found(reason: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, reason, message)
    }

    /// ALREADY_EXISTS: the name is taken by something else, e.g.
    /// [`reason::MACHINE_SPEC_CONFLICT`] (a machine of this name with another spec); permanent for
    /// this request.
    pub fn already_exists(reason: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(Code::AlreadyExists, reason, message)
    }

    /// ABORTED / OPERATION_PENDING: another operation is in flight on the resource.
    pub fn operation_pending(message: impl Into<String>) -> Self {
        Self::new(Code::Aborted, reason::OPERATION_PENDING, message)
    }

    /// RESOURCE_EXHAUSTED / QUOTA_EXCEEDED.
    pub fn quota_exceeded(message: impl Into<String>) -> Self {
        Self::new(Code::ResourceExhausted, reason::QUOTA_EXCEEDED, message)
    }

    /// RESOURCE_EXHAUSTED / INSUFFICIENT_CAPACITY: the zone has no capacity for the machine now.
    pub fn insufficient_capacity(message: impl Into<String>) -> Self {
        Self::new(Code::ResourceExhausted, reason::INSUFFICIENT_CAPACITY, message)
    }

    /// UNAVAILABLE / ZONE_UNAVAILABLE: the zone refuses requests.
    pub fn zone_unavailable(message: impl Into<String>) -> Self {
        Self::new(Code::Unavailable, reason::ZONE_UNAVAILABLE, message)
    }

    /// UNAVAILABLE / THROTTLED with the delay the cloud asked for.
    pub fn throttled(message: impl Into<String>, retry_after: Duration) -> Self {
        Self::new(Code::Unavailable, reason::THROTTLED, message).with_retry_after(retry_after)
    }

    /// UNAVAILABLE: transient, retry with backoff.
    pub fn unavailable(reason: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(Code::Unavailable, reason, message)
    }

    /// PERMISSION_DENIED / CLOUD_AUTH_FAILED.
    pub fn auth_failed(message: impl Into<String>) -> Self {
        Self::new(Code::PermissionDenied, reason::CLOUD_AUTH_FAILED, message)
    }

    /// INTERNAL, reason INTERNAL: a bug or an unexpected answer inside the driver; the caller retries
    /// with backoff.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, reason::INTERNAL, message)
    }

    /// UNIMPLEMENTED / CAPABILITY_NOT_SUPPORTED for the named RPC.
    pub fn unimplemented(rpc: &str) -> Self {
        Self::new(
            Code::Unimplemented,
            reason::CAPABILITY_NOT_SUPPORTED,
            format!("this driver does not implement {rpc}"),
        )
    }

    /// INVALID_ARGUMENT / OPERATION_TOKEN_INVALID.
    pub fn token_invalid(message: impl Into<String>) -> Self {
        Self::invalid_argument(reason::OPERATION_TOKEN_INVALID, message)
    }

    /// Keeps `source` as the cause of this error.
    #[must_use]
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.0.source = Some(Box::new(source));
        self
    }

    /// Keeps a boxed cause.
    #[must_use]
    pub fn with_boxed_source(mut self, source: Box<dyn std::error::Error + Send + Sync>) -> Self {
        self.0.source = Some(source);
        self
    }

    /// Tells the caller to come back after `delay` (sent as RetryInfo).
    #[must_use]
    pub fn with_retry_after(mut self, delay: Duration) -> Self {
        self.0.retry_after = Some(delay);
        self
    }

    /// Records a request ID the cloud assigned to a call behind this error.
    #[must_use]
    pub fn with_cloud_request_id(mut self, id: impl Into<String>) -> Self {
        let id = id.into();
        if !id.is_empty() && !self.0.cloud_request_ids.contains(&id) {
            self.0.cloud_request_ids.push(id);
        }
        self
    }

    /// Adds a BadRequest field violation.
    #[must_use]
    pub fn with_violation(mut self, field: impl Into<String>, description: impl Into<String>) -> Self {
        self.0.violations.push(Violation::new(field, description));
        self
    }

    /// Adds ErrorInfo metadata, e.g. the cloud's own error code.
    #[must_use]
    pub fn with_metadata(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.0.metadata.insert(key.into(), value.into());
        self
    }

    /// The gRPC code.
    pub fn code(&self) -> Code {
        self.0.code
    }

    /// The stable reason.
    pub fn reason(&self) -> &str {
        &self.0.reason
    }

    /// The message of this layer (causes not included).
    pub fn message(&self) -> &str {
        &self.0.message
    }

    /// When the caller should retry, if the cloud said.
    pub fn retry_after(&self) -> Option<Duration> {
        self.0.retry_after
    }

    /// The request IDs the cloud gave the calls behind this error, for the cloud provider's
    /// support (sent as ErrorInfo metadata `cloudRequestIds` and `RequestInfo.serving_data`).
    pub fn cloud_request_ids(&self) -> &[String] {
        &self.0.cloud_request_ids
    }

    /// Field violations.
    pub fn violations(&self) -> &[Violation] {
        &self.0.violations
    }

    /// ErrorInfo metadata.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.0.metadata
    }

    /// The messages of the cause chain, outermost first (this error's own message excluded).
    pub fn causes(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut next: Option<&(dyn std::error::Error + 'static)> =
            self.0.source.as_deref().map(|e| e as &(dyn std::error::Error + 'static));
        while let Some(err) = next {
            out.push(err.to_string());
            next = err.source();
        }
        out
    }

    /// The wire form: a `tonic::Status` with ErrorInfo (domain = driver name), RetryInfo,
    /// RequestInfo, BadRequest and the cause chain as DebugInfo stack entries. Values of
    /// `secrets` are replaced by `[REDACTED]` wherever they appear.
    pub fn to_status(&self, domain: &str, request_id: &str, secrets: Option<&Secrets>) -> tonic::Status {
        let rpc = self.to_rpc_status(domain, request_id, secrets);
        tonic::Status::with_details(self.0.code, rpc.message.clone(), rpc.encode_to_vec().into())
    }

    /// The error as a `google.rpc.Status` message (for `Operation.error`).
    pub fn to_rpc_status(&self, domain: &str, request_id: &str, secrets: Option<&Secrets>) -> tonic_types::pb::Status {
        let redact = |s: &str| match secrets {
            Some(secrets) => secrets.redact(s),
            None => s.to_string(),
        };
        let mut metadata: HashMap<String, String> =
            self.0.metadata.iter().map(|(k, v)| (k.clone(), redact(v))).collect();
        if !self.0.cloud_request_ids.is_empty() {
            metadata.insert("cloudRequestIds".into(), self.0.cloud_request_ids.join(","));
        }
        let mut details = ErrorDetails::new();
        details.set_error_info(self.0.reason.clone(), domain.to_string(), metadata);
        if let Some(delay) = self.0.retry_after {
            details.set_retry_info(Some(delay));
        }
        details.set_request_info(request_id.to_string(), self.0.cloud_request_ids.join(","));
        for v in &self.0.violations {
            details.add_bad_request_violation(v.field.clone(), redact(&v.description));
        }
        let causes: Vec<String> = self.causes().iter().map(|c| redact(c)).collect();
        if !causes.is_empty() {
            details.set_debug_info(causes, "cause chain, outermost first");
        }
        let status = tonic::Status::with_error_details(self.0.code, redact(&self.0.message), details);
        // The details bytes of a tonic::Status are exactly an encoded google.rpc.Status.
        tonic_types::pb::Status::decode(status.details()).unwrap_or_else(|_| tonic_types::pb::Status {
            code: self.0.code as i32,
            message: redact(&self.0.message),
            details: Vec::new(),
        })
    }
}

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.0.message, self.0.reason)
    }
}

impl fmt::Debug for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DriverError")
            .field("code", &self.0.code)
            .field("reason", &self.0.reason)
            .field("message", &self.0.message)
            .field("retry_after", &self.0.retry_after)
            .field("cloud_request_ids", &self.0.cloud_request_ids)
            .field("violations", &self.0.violations)
            .field("causes", &self.causes())
            .finish()
    }
}

impl std::error::Error for DriverError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source.as_deref().map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// Any status decoded into its parts: what a caller needs to decide what to do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorReport {
    /// The gRPC code.
    pub code: Code,
    /// The status message.
    pub message: String,
    /// ErrorInfo.reason (empty when the status carried no ErrorInfo, e.g. transport errors).
    pub reason: String,
    /// ErrorInfo.domain (the driver name).
    pub domain: String,
    /// ErrorInfo.metadata.
    pub metadata: BTreeMap<String, String>,
    /// RetryInfo.retry_delay.
    pub retry_after: Option<Duration>,
    /// RequestInfo.request_id (our request ID, echoed by the driver).
    pub request_id: String,
    /// ErrorInfo.metadata `cloudRequestIds`, split at commas: the request IDs the cloud gave the
    /// calls behind the error.
    pub cloud_request_ids: Vec<String>,
    /// BadRequest field violations.
    pub violations: Vec<Violation>,
    /// The cause chain, outermost first.
    pub causes: Vec<String>,
}

impl ErrorReport {
    /// Decodes a status received from a driver.
    pub fn from_status(status: &tonic::Status) -> Self {
        Self::from_details(status.code(), status.message(), status.get_error_details())
    }

    /// Decodes a `google.rpc.Status` (e.g. `Operation.error`).
    pub fn from_rpc_status(status: &tonic_types::pb::Status) -> Self {
        use tonic_types::RpcStatusExt;
        Self::from_details(Code::from_i32(status.code), &status.message, status.get_error_details())
    }

    fn from_details(code: Code, message: &str, details: ErrorDetails) -> Self {
        let (reason, domain, mut metadata) = match details.error_info() {
            Some(info) => (
                info.reason.clone(),
                info.domain.clone(),
                info.metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect::<BTreeMap<_, _>>(),
            ),
            None => (String::new(), String::new(), BTreeMap::new()),
        };
        let cloud_request_ids = metadata
            .remove("cloudRequestIds")
            .map(|ids| ids.split(',').filter(|s| !s.is_empty()).map(str::to_string).collect())
            .unwrap_or_default();
        Self {
            code,
            message: message.to_string(),
            reason,
            domain,
            metadata,
            retry_after: details.retry_info().and_then(|r| r.retry_delay),
            request_id: details.request_info().map(|r| r.request_id.clone()).unwrap_or_default(),
            cloud_request_ids,
            violations: details
                .bad_request()
                .map(|b| {
                    b.field_violations
                        .iter()
                        .map(|FieldViolation { field, description, .. }| Violation::new(field, description))
                        .collect()
                })
                .unwrap_or_default(),
            causes: details.debug_info().map(|d| d.stack_entries.clone()).unwrap_or_default(),
        }
    }
}

impl fmt::Display for ErrorReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.code)?;
        if !self.reason.is_empty() {
            write!(f, "/{}", self.reason)?;
        }
        write!(f, ": {}", self.message)?;
        for cause in &self.causes {
            write!(f, ": {cause}")?;
        }
        if !self.request_id.is_empty() {
            write!(f, " (request {})", self.request_id)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
