//! A minimal ARM REST client: one authenticated request, sent once, with the raw status,
//! headers and body handed back.
//!
//! Why not the `azure_mgmt_compute` operation builders: their long-running-operation futures
//! re-send the request and mis-read provisioning states (upstream #1525/#1656), their
//! `HttpError` drops the response headers we need (`Retry-After`, `x-ms-request-id`,
//! `x-ms-correlation-request-id`, `Azure-AsyncOperation`), and their pipeline builds a fresh
//! `Context` per call, so a per-call `x-ms-client-request-id` cannot be injected. So requests go
//! straight to `azure_core`'s HTTP transport (`HttpClient::execute_request`) with a bearer token
//! from the `azure_identity` credential, and bodies are typed with `azure_mgmt_compute`'s models.
//! Retries are ours and small: one retry of a request that failed before any response arrived;
//! every status code — 429 and 5xx included — goes back to the caller, who owns backoff.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use azure_core::auth::TokenCredential;
use azure_core::{HttpClient, Method, Request, Url};
use serde::de::DeserializeOwned;
use serde_json::Value;

/// The api-version of every Microsoft.Compute call.
pub const API_VERSION: &str = "2024-07-01";

/// The status, headers (lower-cased names) and body of one ARM response.
#[derive(Debug, Clone)]
pub struct ArmResponse {
    /// HTTP status.
    pub status: u16,
    /// Headers, names lower-cased.
    pub headers: BTreeMap<String, String>,
    /// The body.
    pub body: Vec<u8>,
}

impl ArmResponse {
    /// A header by (lower-case) name.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str).filter(|v| !v.is_empty())
    }

    /// ARM's `x-ms-request-id`.
    pub fn request_id(&self) -> Option<&str> {
        self.header("x-ms-request-id")
    }

    /// ARM's `x-ms-correlation-request-id`.
    pub fn correlation_id(&self) -> Option<&str> {
        self.header("x-ms-correlation-request-id")
    }

    /// When to come back: `retry-after-ms`, `x-ms-retry-after-ms` or `Retry-After` (seconds).
    pub fn retry_after(&self) -> Option<Duration> {
        let ms = |h: &str| self.header(h).and_then(|v| v.trim().parse::<u64>().ok()).map(Duration::from_millis);
        ms("retry-after-ms")
            .or_else(|| ms("x-ms-retry-after-ms"))
            .or_else(|| self.header("retry-after").and_then(|v| v.trim().parse::<u64>().ok()).map(Duration::from_secs))
    }

    /// Whether the status is 2xx.
    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }

    /// The body decoded as `T`.
    ///
    /// # Errors
    /// [`ArmError::Decode`] when it does not decode.
    pub fn json<T: DeserializeOwned>(&self, what: &'static str) -> Result<T, ArmError> {
        serde_json::from_slice(&self.body).map_err(|source| ArmError::Decode {
            what,
            request_id: self.request_id().map(str::to_string),
            source,
        })
    }

    /// The body as loose JSON (`Null` when empty or not JSON).
    pub fn value(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    /// This response as an error (for non-2xx statuses).
    pub fn into_error(self) -> ArmError {
        let body = self.value();
        let err = &body["error"];
        let text = |v: &Value| v.as_str().map(str::to_string);
        ArmError::Status(Box::new(StatusError {
            status: self.status,
            code: text(&err["code"]).or_else(|| self.header("x-ms-error-code").map(str::to_string)).unwrap_or_default(),
            message: text(&err["message"]).unwrap_or_else(|| String::from_utf8_lossy(&self.body).into_owned()),
            target: text(&err["target"]),
            retry_after: self.retry_after(),
            request_id: self.request_id().map(str::to_string),
            correlation_id: self.correlation_id().map(str::to_string),
        }))
    }
}

/// A non-2xx ARM answer: the CloudError body and the headers that matter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusError {
    /// HTTP status.
    pub status: u16,
    /// `error.code` (or the `x-ms-error-code` header).
    pub code: String,
    /// `error.message`.
    pub message: String,
    /// `error.target`.
    pub target: Option<String>,
    /// From `Retry-After`.
    pub retry_after: Option<Duration>,
    /// `x-ms-request-id`.
    pub request_id: Option<String>,
    /// `x-ms-correlation-request-id`.
    pub correlation_id: Option<String>,
}

/// Why an ARM call did not produce a usable response.
#[derive(Debug, thiserror::Error)]
pub enum ArmError {
    /// The credential could not produce a token.
    #[error("getting an ARM access token")]
    Credential(#[source] azure_core::Error),
    /// The request could not be sent or its response not read.
    #[error("calling ARM")]
    Transport(#[source] azure_core::Error),
    /// No response within the time allowed.
    #[error("ARM did not answer within {0:?}")]
    Timeout(Duration),
    /// ARM answered with an error status.
    #[error("ARM answered {} {}: {}", .0.status, .0.code, .0.message)]
    Status(Box<StatusError>),
    /// A 2xx body did not decode.
    #[error("decoding the {what} ARM returned")]
    Decode {
        /// What was being decoded.
        what: &'static str,
        /// `x-ms-request-id` of the response.
        request_id: Option<String>,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// A URL (next link, operation URL) that is not on the configured ARM endpoint.
    #[error("refusing to send credentials to {0}: not on the configured ARM endpoint")]
    ForeignUrl(String),
    /// A URL could not be built.
    #[error("building the ARM URL {0}")]
    Url(String),
}

/// [`ArmConfig::endpoint`] by default (`--arm-endpoint`): the public Azure cloud.
pub const DEFAULT_ENDPOINT: &str = "https://management.azure.com";
/// [`ArmConfig::request_timeout`] by default (`--request-timeout`): a long-running ARM call
/// answers 201/202 at once and is polled, so only a stuck request waits this long.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// [`ArmConfig::max_retries`] by default (`--max-retries`): one retry of a request that got no
/// response; the controller owns backoff.
pub const DEFAULT_MAX_RETRIES: u32 = 1;
/// The pause before such a retry.
const RETRY_DELAY: Duration = Duration::from_millis(200);

/// Where the ARM API is, and how to authenticate.
#[derive(Debug, Clone)]
pub struct ArmConfig {
    /// The ARM endpoint (e.g. `https://management.azure.com`; the emulator's URL in tests).
    pub endpoint: Url,
    /// Token scopes (default: `{endpoint}/.default`).
    pub scopes: Vec<String>,
    /// Per-request time limit (further bounded by the caller's deadline).
    pub request_timeout: Duration,
    /// Retries of a request that got no response at all (connection errors).
    pub max_retries: u32,
}

/// Sends ARM requests with a bearer token, `x-ms-client-request-id` and the api-version.
///
/// Cloning is cheap (three `Arc`s), and so is [`with_credential`](Self::with_credential).
#[derive(Debug, Clone)]
pub struct ArmClient {
    http: Arc<dyn HttpClient>,
    credential: Arc<dyn TokenCredential>,
    config: Arc<ArmConfig>,
}

impl ArmClient {
    /// A client over `azure_core`'s default HTTP transport (reqwest with rustls).
    pub fn new(config: ArmConfig, credential: Arc<dyn TokenCredential>) -> Self {
        Self { http: azure_core::new_http_client(), credential, config: Arc::new(config) }
    }

    /// The same client (transport, endpoint, scopes, limits) authenticating with `credential`,
    /// e.g. a MachineClass's credential from
    /// [`ClassCredentials::credential_for`](crate::class_credential::ClassCredentials::credential_for)
    /// for the calls of one request. Shares the connection pool; the token cache is the
    /// credential's own.
    #[must_use]
    pub fn with_credential(&self, credential: Arc<dyn TokenCredential>) -> ArmClient {
        Self { http: self.http.clone(), credential, config: self.config.clone() }
    }

    /// The configuration.
    pub fn config(&self) -> &ArmConfig {
        &self.config
    }

    /// An absolute URL for an ARM path (which starts with `/subscriptions/`), with the
    /// api-version and the extra query pairs.
    ///
    /// # Errors
    /// [`ArmError::Url`] when the result does not parse.
    pub fn url(&self, path: &str, query: &[(&str, &str)]) -> Result<Url, ArmError> {
        self.url_at_version(path, API_VERSION, query)
    }

    /// Like [`ArmClient::url`], for another resource provider's `api_version` (e.g.
    /// Microsoft.Network's).
    ///
    /// # Errors
    /// [`ArmError::Url`] when the result does not parse.
    pub fn url_at_version(&self, path: &str, api_version: &str, query: &[(&str, &str)]) -> Result<Url, ArmError> {
        let base = self.config.endpoint.as_str().trim_end_matches('/');
        let mut url = Url::parse(&format!("{base}{path}")).map_err(|_| ArmError::Url(format!("{base}{path}")))?;
        {
            let mut q = url.query_pairs_mut();
            q.append_pair("api-version", api_version);
            for (k, v) in query {
                q.append_pair(k, v);
            }
        }
        Ok(url)
    }

    /// Parses a URL ARM handed us (operation URL, next link) and checks that it is on the
    /// configured endpoint, so a bearer token never goes anywhere else.
    ///
    /// # Errors
    /// [`ArmError::ForeignUrl`] for another origin or an unparsable URL.
    pub fn trusted_url(&self, raw: &str) -> Result<Url, ArmError> {
        let url = Url::parse(raw).map_err(|_| ArmError::ForeignUrl(raw.to_string()))?;
        let ours = &self.config.endpoint;
        if url.scheme() == ours.scheme()
            && url.host_str() == ours.host_str()
            && url.port_or_known_default() == ours.port_or_known_default()
        {
            Ok(url)
        } else {
            Err(ArmError::ForeignUrl(raw.to_string()))
        }
    }

    /// Gets a token now (health probe).
    ///
    /// # Errors
    /// [`ArmError::Credential`].
    pub async fn check_credential(&self) -> Result<(), ArmError> {
        let scopes: Vec<&str> = self.config.scopes.iter().map(String::as_str).collect();
        self.credential.get_token(&scopes).await.map(|_| ()).map_err(ArmError::Credential)
    }

    /// Sends one request and returns the response whatever its status.
    ///
    /// `client_request_id` goes out as `x-ms-client-request-id`; `budget` bounds the whole call
    /// (token, request and body), on top of the configured per-request timeout.
    ///
    /// # Errors
    /// Credential, transport and timeout failures; never a status code.
    pub async fn send(
        &self,
        method: Method,
        url: Url,
        body: Option<&Value>,
        client_request_id: &str,
        budget: Option<Duration>,
    ) -> Result<ArmResponse, ArmError> {
        let limit = budget.map_or(self.config.request_timeout, |b| b.min(self.config.request_timeout));
        let started = tokio::time::Instant::now();
        let mut attempt = 0;
        loop {
            let left = limit.saturating_sub(started.elapsed());
            let result =
                match tokio::time::timeout(left, self.send_once(method, url.clone(), body, client_request_id)).await {
                    Ok(r) => r,
                    Err(_) => Err(ArmError::Timeout(limit)),
                };
            match result {
                // Only a request that got no answer at all is retried here, and only briefly:
                // statuses (429, 5xx) go back so the controller's backoff stays in charge.
                Err(ArmError::Transport(e))
                    if attempt < self.config.max_retries && started.elapsed() + RETRY_DELAY < limit =>
                {
                    attempt += 1;
                    tracing::debug!(error = %e, attempt, "ARM request failed without a response; retrying once");
                    tokio::time::sleep(RETRY_DELAY).await;
                }
                other => return other,
            }
        }
    }

    async fn send_once(
        &self,
        method: Method,
        url: Url,
        body: Option<&Value>,
        client_request_id: &str,
    ) -> Result<ArmResponse, ArmError> {
        let scopes: Vec<&str> = self.config.scopes.iter().map(String::as_str).collect();
        let token = self.credential.get_token(&scopes).await.map_err(ArmError::Credential)?;
        let mut req = Request::new(url.clone(), method);
        req.insert_header("authorization", format!("Bearer {}", token.token.secret()));
        req.insert_header("x-ms-client-request-id", client_request_id.to_string());
        req.insert_header("accept", "application/json");
        req.insert_header("user-agent", concat!("azure-vmss-driver/", env!("CARGO_PKG_VERSION")));
        if let Some(b) = body {
            let bytes = azure_core::to_json(b).map_err(ArmError::Transport)?;
            req.insert_header("content-type", "application/json");
            req.set_body(bytes);
        }
        let resp = self.http.execute_request(&req).await.map_err(ArmError::Transport)?;
        let (status, headers, body) = resp.deconstruct();
        let body = body.collect().await.map_err(ArmError::Transport)?.to_vec();
        let headers: BTreeMap<String, String> =
            headers.iter().map(|(k, v)| (k.as_str().to_ascii_lowercase(), v.as_str().to_string())).collect();
        let out = ArmResponse { status: status as u16, headers, body };
        tracing::info!(
            arm.method = %method,
            arm.path = url.path(),
            arm.status = out.status,
            arm.request_id = out.request_id().unwrap_or(""),
            arm.correlation_id = out.correlation_id().unwrap_or(""),
            client_request_id,
            "ARM call"
        );
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resp(status: u16, headers: &[(&str, &str)], body: &str) -> ArmResponse {
        ArmResponse {
            status,
            headers: headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            body: body.as_bytes().to_vec(),
        }
    }

    #[test]
    fn retry_after_prefers_milliseconds() {
        assert_eq!(resp(429, &[("retry-after", "7")], "").retry_after(), Some(Duration::from_secs(7)));
        assert_eq!(
            resp(429, &[("retry-after", "7"), ("retry-after-ms", "250")], "").retry_after(),
            Some(Duration::from_millis(250))
        );
        assert_eq!(resp(429, &[], "").retry_after(), None);
    }

    #[test]
    fn cloud_error_is_read_from_body_and_headers() {
        let r = resp(
            400,
            &[("x-ms-request-id", "rid"), ("x-ms-correlation-request-id", "cid")],
            r#"{"error":{"code":"InvalidParameter","message":"bad size","target":"sku.name"}}"#,
        );
        let ArmError::Status(e) = r.into_error() else { panic!("not a status error") };
        assert_eq!((e.status, e.code.as_str(), e.target.as_deref()), (400, "InvalidParameter", Some("sku.name")));
        assert_eq!((e.request_id.as_deref(), e.correlation_id.as_deref()), (Some("rid"), Some("cid")));
        let r = resp(500, &[("x-ms-error-code", "InternalError")], "oops");
        let ArmError::Status(e) = r.into_error() else { panic!("not a status error") };
        assert_eq!((e.code.as_str(), e.message.as_str()), ("InternalError", "oops"));
    }
}
