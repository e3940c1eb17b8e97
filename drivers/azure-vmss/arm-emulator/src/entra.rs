//! The emulated Microsoft Entra ID token endpoint: the OAuth 2.0 client-credentials grant of
//! `POST /{tenant}/oauth2/v2.0/token`, the way `azure_identity` calls it (authority host
//! `http://127.0.0.1:PORT`), with a client secret or a client assertion (workload identity), for
//! the principals registered with `--principal` / `--federated-principal` or
//! `PUT /_emulator/principals`.
//!
//! | request | answer |
//! |---|---|
//! | right secret, or the registered federated token as `client_assertion` | 200 `{"token_type":"Bearer","expires_in":N,"ext_expires_in":N,"access_token":"<opaque>"}`, N = the token lifetime |
//! | `grant_type` other than `client_credentials` | 400 `unsupported_grant_type` (AADSTS70003) |
//! | no `client_id` / no `scope` | 400 `invalid_request` (AADSTS900144) |
//! | a scope that is not one `<resource>/.default` | 400 `invalid_scope` (AADSTS1002012) |
//! | a tenant no principal is in | 400 `invalid_request` (AADSTS90002) |
//! | a client ID unknown in the tenant | 400 `unauthorized_client` (AADSTS700016) |
//! | neither `client_secret` nor `client_assertion` | 401 `invalid_client` (AADSTS7000218) |
//! | both | 400 `invalid_request` (AADSTS9002313) |
//! | a `client_assertion_type` other than `…:jwt-bearer` | 400 `invalid_request` (AADSTS9002313) |
//! | a wrong secret | 401 `invalid_client` (AADSTS7000215) |
//! | an assertion that is not the principal's federated token | 400 `invalid_request` (AADSTS70021) |
//!
//! Errors have Entra's shape: `error`, `error_description` (starting with the AADSTS code),
//! `error_codes`, `timestamp`, `trace_id`, `correlation_id`, `error_uri`.
//!
//! ARM requests then present the token: one this endpoint issued is recorded with its principal
//! (`tenant/clientId`); once expired it is 401 `ExpiredAuthenticationToken`; one issued for a
//! resource other than this emulator's URL or the public ARM audiences is 401
//! `InvalidAuthenticationTokenAudience`; any other bearer token is accepted as before, with no
//! principal. `GET /_emulator/tokens` lists the issuances (never a token or a secret).

use std::collections::HashMap;
use std::fmt;
use std::time::{Instant, SystemTime};

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::{parse_query, rfc3339, Emulator};

/// `client_assertion_type` of a JWT client assertion.
pub(crate) const JWT_BEARER: &str = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer";
/// ARM audiences a token may be for, besides the emulator's own URL.
const ARM_AUDIENCES: &[&str] = &["https://management.azure.com", "https://management.core.windows.net"];

/// An application registration (service principal) the token endpoint knows.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Principal {
    /// Its tenant (directory).
    pub tenant_id: String,
    /// Its application (client) ID.
    pub client_id: String,
    /// The client secret it accepts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_secret: Option<String>,
    /// The client assertion it accepts (workload identity: the content of the federated token
    /// file, compared as is; the emulator does not validate JWTs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub federated_token: Option<String>,
}

impl fmt::Debug for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Principal")
            .field("tenant_id", &self.tenant_id)
            .field("client_id", &self.client_id)
            .field("client_secret", &self.client_secret.as_ref().map(|_| "<set>"))
            .field("federated_token", &self.federated_token.as_ref().map(|_| "<set>"))
            .finish()
    }
}

impl Principal {
    /// Parses `TENANT:CLIENT_ID:VALUE` (the value may contain `:`): a client secret, or with
    /// `federated` the federated token.
    ///
    /// # Errors
    /// A missing part.
    pub fn parse(s: &str, federated: bool) -> Result<Self, String> {
        let mut parts = s.splitn(3, ':');
        let (Some(tenant), Some(client), Some(value)) = (parts.next(), parts.next(), parts.next()) else {
            return Err("expected TENANT:CLIENT_ID:VALUE".to_string());
        };
        if tenant.is_empty() || client.is_empty() || value.is_empty() {
            return Err("expected TENANT:CLIENT_ID:VALUE, none of them empty".to_string());
        }
        let (secret, token) = if federated { (None, Some(value)) } else { (Some(value), None) };
        Ok(Self {
            tenant_id: tenant.to_string(),
            client_id: client.to_string(),
            client_secret: secret.map(str::to_string),
            federated_token: token.map(str::to_string),
        })
    }

    /// `tenant/clientId`, as requests are recorded.
    pub fn name(&self) -> String {
        format!("{}/{}", self.tenant_id, self.client_id)
    }

    fn valid(&self) -> bool {
        !self.tenant_id.is_empty()
            && !self.client_id.is_empty()
            && (self.client_secret.as_deref().is_some_and(|s| !s.is_empty())
                || self.federated_token.as_deref().is_some_and(|s| !s.is_empty()))
    }
}

/// One token the endpoint issued.
#[derive(Debug, Clone)]
pub(crate) struct Issued {
    tenant_id: String,
    client_id: String,
    /// `clientSecret` or `clientAssertion`.
    credential: &'static str,
    scope: String,
    issued_at: SystemTime,
    expires_at: SystemTime,
    deadline: Instant,
}

/// The token state of the emulated cloud.
#[derive(Default)]
pub(crate) struct Tokens {
    pub(crate) principals: Vec<Principal>,
    issued: Vec<Issued>,
    /// Access token → index in `issued`.
    by_token: HashMap<String, usize>,
}

/// What an ARM request's bearer token is.
pub(crate) enum Bearer {
    /// Not issued here (a fixed test token): accepted, no principal.
    Foreign,
    /// Issued here and valid.
    Valid(String),
    /// Issued here, refused: the principal and ARM's answer (status, code, message).
    Refused(String, StatusCode, &'static str, String),
}

impl Tokens {
    pub(crate) fn new(principals: Vec<Principal>) -> Self {
        Self { principals, ..Self::default() }
    }

    /// Checks a bearer token presented to ARM at `base` (the emulator's URL as the client sees
    /// it).
    pub(crate) fn check(&self, token: &str, base: &str) -> Bearer {
        let Some(t) = self.by_token.get(token).and_then(|i| self.issued.get(*i)) else { return Bearer::Foreign };
        let principal = format!("{}/{}", t.tenant_id, t.client_id);
        if Instant::now() >= t.deadline {
            let message = format!(
                "The access token expiry UTC time '{}' is earlier than current UTC time '{}'.",
                rfc3339(t.expires_at),
                rfc3339(SystemTime::now())
            );
            return Bearer::Refused(principal, StatusCode::UNAUTHORIZED, "ExpiredAuthenticationToken", message);
        }
        let resource = t.scope.trim_end_matches("/.default").trim_end_matches('/');
        let ours = base.trim_end_matches('/');
        if !resource.eq_ignore_ascii_case(ours) && !ARM_AUDIENCES.iter().any(|a| resource.eq_ignore_ascii_case(a)) {
            let message = format!(
                "The access token has been obtained for wrong audience or resource '{resource}'. It should exactly match one of the allowed audiences '{ours}/', 'https://management.core.windows.net/', 'https://management.azure.com/'."
            );
            return Bearer::Refused(principal, StatusCode::UNAUTHORIZED, "InvalidAuthenticationTokenAudience", message);
        }
        Bearer::Valid(principal)
    }

    /// `GET /_emulator/tokens`.
    pub(crate) fn issuances(&self) -> Value {
        let now = Instant::now();
        let list: Vec<Value> = self
            .issued
            .iter()
            .map(|t| {
                json!({
                    "tenantId": t.tenant_id,
                    "clientId": t.client_id,
                    "grantType": "client_credentials",
                    "credential": t.credential,
                    "scope": t.scope,
                    "issuedAt": rfc3339(t.issued_at),
                    "expiresOn": rfc3339(t.expires_at),
                    "expired": now >= t.deadline,
                })
            })
            .collect();
        json!(list)
    }

    /// `GET /_emulator/principals`: who is registered, and with what kind of credential.
    pub(crate) fn principals_view(&self) -> Value {
        let list: Vec<Value> = self
            .principals
            .iter()
            .map(|p| {
                let mut kinds = Vec::new();
                if p.client_secret.is_some() {
                    kinds.push("clientSecret");
                }
                if p.federated_token.is_some() {
                    kinds.push("federatedToken");
                }
                json!({"tenantId": p.tenant_id, "clientId": p.client_id, "credentials": kinds})
            })
            .collect();
        json!(list)
    }

    /// `PUT /_emulator/principals`: replaces the registered principals.
    pub(crate) fn set_principals(&mut self, body: &Value) -> Result<(), String> {
        let list: Vec<Principal> = serde_json::from_value(body.clone()).map_err(|e| format!("bad principals: {e}"))?;
        if let Some(bad) = list.iter().find(|p| !p.valid()) {
            return Err(format!(
                "bad principal {}: needs tenantId, clientId and a clientSecret or a federatedToken",
                bad.name()
            ));
        }
        self.principals = list;
        Ok(())
    }
}

/// The tenant of a token-endpoint path (`/{tenant}/oauth2/v2.0/token`).
pub(crate) fn token_path(path: &str) -> Option<&str> {
    let seg: Vec<&str> = path.trim_matches('/').split('/').collect();
    match seg.as_slice() {
        [tenant, oauth2, version, token]
            if !tenant.is_empty()
                && *tenant != "_emulator"
                && oauth2.eq_ignore_ascii_case("oauth2")
                && version.eq_ignore_ascii_case("v2.0")
                && token.eq_ignore_ascii_case("token") =>
        {
            Some(tenant)
        }
        _ => None,
    }
}

/// An Entra error answer.
fn refuse(status: StatusCode, error: &str, code: u32, description: &str) -> Response {
    let trace = uuid::Uuid::new_v4().to_string();
    let correlation = uuid::Uuid::new_v4().to_string();
    let now = SystemTime::now();
    let body = json!({
        "error": error,
        "error_description": format!(
            "AADSTS{code}: {description} Trace ID: {trace} Correlation ID: {correlation} Timestamp: {}",
            rfc3339(now)
        ),
        "error_codes": [code],
        "timestamp": rfc3339(now),
        "trace_id": trace,
        "correlation_id": correlation,
        "error_uri": format!("https://login.microsoftonline.com/error?code={code}"),
    });
    json_response(status, &body)
}

fn json_response(status: StatusCode, body: &Value) -> Response {
    let mut r = Response::new(Body::from(serde_json::to_vec(body).unwrap_or_default()));
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert("content-type", HeaderValue::from_static("application/json; charset=utf-8"));
    h.insert("cache-control", HeaderValue::from_static("no-store, no-cache"));
    r
}

/// `POST /{tenant}/oauth2/v2.0/token` with a form-encoded body.
pub(crate) fn token(emu: &Emulator, tenant: &str, body: &[u8]) -> Response {
    let form = parse_query(&String::from_utf8_lossy(body));
    let field = |k: &str| form.get(k).map(String::as_str).filter(|v| !v.is_empty());
    let bad = StatusCode::BAD_REQUEST;
    match field("grant_type") {
        Some("client_credentials") => {}
        Some(other) => {
            return refuse(
                bad,
                "unsupported_grant_type",
                70003,
                &format!("The app requested an unsupported grant type '{other}'."),
            )
        }
        None => {
            return refuse(
                bad,
                "invalid_request",
                900144,
                "The request body must contain the following parameter: 'grant_type'.",
            )
        }
    }
    let Some(client_id) = field("client_id") else {
        return refuse(
            bad,
            "invalid_request",
            900144,
            "The request body must contain the following parameter: 'client_id'.",
        );
    };
    let Some(scope) = field("scope") else {
        return refuse(
            bad,
            "invalid_request",
            900144,
            "The request body must contain the following parameter: 'scope'.",
        );
    };
    if scope.split_whitespace().count() != 1 || !scope.ends_with("/.default") {
        return refuse(
            bad,
            "invalid_scope",
            1002012,
            &format!("The provided value for scope {scope} is not valid. Client credential flows must have a scope value with /.default suffixed to the resource identifier (application ID URI)."),
        );
    }
    let secret = field("client_secret");
    let assertion = field("client_assertion");

    let mut cloud = emu.lock();
    let lifetime = emu.config.token_lifetime;
    let tokens = &mut cloud.tokens;
    if !tokens.principals.iter().any(|p| p.tenant_id.eq_ignore_ascii_case(tenant)) {
        return refuse(
            bad,
            "invalid_request",
            90002,
            &format!("Tenant '{tenant}' not found. Check to make sure you have the correct tenant ID and are signing into the correct cloud."),
        );
    }
    let Some(principal) = tokens
        .principals
        .iter()
        .find(|p| p.tenant_id.eq_ignore_ascii_case(tenant) && p.client_id == client_id)
        .cloned()
    else {
        return refuse(
            bad,
            "unauthorized_client",
            700016,
            &format!("Application with identifier '{client_id}' was not found in the directory '{tenant}'. This can happen if the application has not been installed by the administrator of the tenant or consented to by any user in the tenant. You may have sent your authentication request to the wrong tenant."),
        );
    };
    let credential = match (secret, assertion) {
        (None, None) => {
            return refuse(
                StatusCode::UNAUTHORIZED,
                "invalid_client",
                7000218,
                "The request body must contain the following parameter: 'client_assertion' or 'client_secret'.",
            )
        }
        (Some(_), Some(_)) => return refuse(
            bad,
            "invalid_request",
            9002313,
            "Invalid request. Request is malformed or invalid: both 'client_secret' and 'client_assertion' were sent.",
        ),
        (Some(s), None) => {
            if principal.client_secret.as_deref() != Some(s) {
                return refuse(
                    StatusCode::UNAUTHORIZED,
                    "invalid_client",
                    7000215,
                    &format!("Invalid client secret provided. Ensure the secret being sent in the request is the client secret value, not the client secret ID, for a secret added to app '{client_id}'."),
                );
            }
            "clientSecret"
        }
        (None, Some(a)) => {
            if field("client_assertion_type") != Some(JWT_BEARER) {
                return refuse(
                    bad,
                    "invalid_request",
                    9002313,
                    &format!("Invalid request. Request is malformed or invalid: 'client_assertion_type' must be '{JWT_BEARER}'."),
                );
            }
            if principal.federated_token.as_deref().map(str::trim) != Some(a.trim()) {
                return refuse(
                    bad,
                    "invalid_request",
                    70021,
                    "No matching federated identity record found for presented assertion.",
                );
            }
            "clientAssertion"
        }
    };
    let access_token = format!("emu.{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple());
    let issued_at = SystemTime::now();
    tokens.by_token.insert(access_token.clone(), tokens.issued.len());
    tokens.issued.push(Issued {
        tenant_id: principal.tenant_id.clone(),
        client_id: principal.client_id.clone(),
        credential,
        scope: scope.to_string(),
        issued_at,
        expires_at: issued_at + lifetime,
        deadline: Instant::now() + lifetime,
    });
    let n = lifetime.as_secs();
    json_response(
        StatusCode::OK,
        &json!({"token_type": "Bearer", "expires_in": n, "ext_expires_in": n, "access_token": access_token}),
    )
}

#[cfg(test)]
mod tests;
