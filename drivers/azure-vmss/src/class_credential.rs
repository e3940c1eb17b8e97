//! Per-MachineClass credentials: what a request's `secrets` say about which Microsoft Entra
//! identity makes the ARM calls of that request, and in which subscription by default.
//!
//! | secret keys | credential |
//! |---|---|
//! | none of the keys below | the sidecar's default credential (whatever `--credential` built) |
//! | `tenantId` + `clientId` + `clientSecret` | that service principal (`azure_identity`'s `ClientSecretCredential`) |
//! | `tenantId` + `clientId` + `federatedTokenFile` | workload identity federation: the file (a path inside the sidecar, e.g. a projected service-account token) is the client assertion, re-read at every refresh ([`FederatedTokenFile`]) |
//! | `subscriptionId` (with any of the above, optional) | the class's default subscription ([`ClassCredential::subscription_id`]) |
//!
//! machine-controller-manager's spellings are accepted too: `azureTenantId`, `azureClientId`,
//! `azureClientSecret`, `azureSubscriptionId`, and Gardener's `tenantID`, `clientID`,
//! `subscriptionID` ([`ALIASES`]); two spellings of one key with different values are an error.
//! Other keys are ignored; an empty value counts as absent. `tenantId` is a GUID or a domain
//! name, `clientId` and `subscriptionId` are GUIDs, `federatedTokenFile` an absolute path
//! without `..`; anything else, and every partial combination (a `clientSecret` without
//! `clientId`, both `clientSecret` and `federatedTokenFile`, …), is INVALID_ARGUMENT with a
//! `secrets.<key>` violation per key. Values never appear in a message, a log line or a `Debug`
//! output: [`ClassCredential`]'s `Debug` prints the kind and a
//! [fingerprint](ClassCredential::fingerprint) only.
//!
//! **Caching.** [`ClassCredentials`] hands out one credential per secret content (its
//! fingerprint): the same content gets the same `Arc`, so its token is fetched once and reused,
//! and changed content (a rotated secret) gets a new credential. Each holds its tokens per scope
//! list and fetches a new one 5 minutes before `expires_on`; when that refresh fails while the
//! old token is still valid, the old one is used meanwhile. Entries unused for
//! [`IDLE_EVICTION`] are dropped, and at most [`MAX_CACHED`] are kept, so rotating secrets do
//! not grow the cache.
//!
//! **Failures at token time** are [`ClassTokenError`]s inside the `azure_core::Error`, carrying
//! the credential's [`Source`] and, when Entra answered, its `error` and `AADSTS…` code (never
//! `error_description`, which quotes client and tenant IDs); [`crate::errors`] turns them into
//! PERMISSION_DENIED / CLOUD_AUTH_FAILED (Entra refused) or UNAVAILABLE / CLOUD_UNAVAILABLE
//! (Entra unreachable or failing) naming the kind that failed.

use driver_sdk::lock;
use std::collections::HashMap;
use std::fmt;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use azure_core::auth::{AccessToken, TokenCredential};
use azure_core::error::ErrorKind;
use azure_core::{BytesStream, HttpClient, Request, Response, Url};
use azure_identity::ClientSecretCredential;
use driver_sdk::{reason, DriverError, Result, Secrets};
use sha2::{Digest, Sha256};
use time::OffsetDateTime;

use crate::credential::{FederatedTokenFile, REFRESH_MARGIN};

/// Secret key: the Microsoft Entra tenant (directory) ID, or its domain name.
pub const TENANT_ID: &str = "tenantId";
/// Secret key: the application (client) ID of the service principal or workload identity.
pub const CLIENT_ID: &str = "clientId";
/// Secret key: the service principal's client secret.
pub const CLIENT_SECRET: &str = "clientSecret";
/// Secret key: the path, inside the sidecar, of a federated token (workload identity).
pub const FEDERATED_TOKEN_FILE: &str = "federatedTokenFile";
/// Secret key: the class's default subscription (optional).
pub const SUBSCRIPTION_ID: &str = "subscriptionId";
/// Every key this driver reads, in its canonical spelling.
pub const KEYS: &[&str] = &[TENANT_ID, CLIENT_ID, CLIENT_SECRET, FEDERATED_TOKEN_FILE, SUBSCRIPTION_ID];
/// Other accepted spellings of the keys: machine-controller-manager's `azure…` keys and
/// Gardener's `…ID` keys.
pub const ALIASES: &[(&str, &[&str])] = &[
    (TENANT_ID, &["azureTenantId", "tenantID"]),
    (CLIENT_ID, &["azureClientId", "clientID"]),
    (CLIENT_SECRET, &["azureClientSecret"]),
    (FEDERATED_TOKEN_FILE, &[]),
    (SUBSCRIPTION_ID, &["azureSubscriptionId", "subscriptionID"]),
];
/// At most this many class credentials are cached (the least recently used one goes first).
pub const MAX_CACHED: usize = 256;
/// A cached class credential unused for this long is dropped.
pub const IDLE_EVICTION: Duration = Duration::from_secs(3600);
/// When a refresh fails, the previous token is still used if it stays valid this much longer.
const MIN_REMAINING: Duration = Duration::from_secs(30);

/// Which identity a class's calls use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// The sidecar's default credential (`--credential`).
    Default,
    /// A service principal with a client secret from the class's secret.
    ClientSecret,
    /// Workload identity federation with a token file named by the class's secret.
    WorkloadIdentity,
}

impl Source {
    /// Short name (logs, ErrorInfo metadata `azureCredential`).
    pub fn kind(self) -> &'static str {
        match self {
            Source::Default => "default",
            Source::ClientSecret => "clientSecret",
            Source::WorkloadIdentity => "workloadIdentity",
        }
    }

    /// For humans.
    pub fn describe(self) -> &'static str {
        match self {
            Source::Default => "the sidecar's default Azure credential (--credential)",
            Source::ClientSecret => "the client secret of the MachineClass secret (tenantId/clientId/clientSecret)",
            Source::WorkloadIdentity => {
                "the workload identity of the MachineClass secret (tenantId/clientId/federatedTokenFile)"
            }
        }
    }
}

/// How a class authenticates (the values stay in here).
#[derive(Clone, PartialEq, Eq)]
enum Auth {
    Default,
    ClientSecret { tenant_id: String, client_id: String, client_secret: String },
    WorkloadIdentity { tenant_id: String, client_id: String, token_file: PathBuf },
}

/// The credential a request's secrets name, and the class's default subscription.
#[derive(Clone, PartialEq, Eq)]
pub struct ClassCredential {
    auth: Auth,
    subscription_id: Option<String>,
}

impl fmt::Debug for ClassCredential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClassCredential")
            .field("kind", &self.source().kind())
            .field("fingerprint", &self.fingerprint())
            .field("subscription_id", &self.subscription_id.as_ref().map(|_| "<set>"))
            .finish()
    }
}

/// Problems found in the secrets: `(key, why)`, missing ones and malformed ones apart.
#[derive(Default)]
struct Problems {
    missing: Vec<(String, String)>,
    invalid: Vec<(String, String)>,
}

impl Problems {
    fn into_error(self) -> Option<DriverError> {
        if self.missing.is_empty() && self.invalid.is_empty() {
            return None;
        }
        let reason = if self.missing.is_empty() { reason::FIELD_INVALID } else { reason::FIELD_REQUIRED };
        let mut keys: Vec<String> = Vec::new();
        for (k, _) in self.missing.iter().chain(&self.invalid) {
            let field = format!("secrets.{k}");
            if !keys.contains(&field) {
                keys.push(field);
            }
        }
        let mut err = DriverError::invalid_argument(
            reason,
            format!("the MachineClass secret does not hold usable Azure credentials: check {}", keys.join(", ")),
        );
        for (key, why) in self.missing.into_iter().chain(self.invalid) {
            err = err.with_violation(format!("secrets.{key}"), why);
        }
        Some(err)
    }
}

/// A key's value under any of its spellings: `(spelling found, value)`. Two spellings with
/// different values are a problem.
fn lookup<'a>(s: &'a Secrets, key: &'static str, problems: &mut Problems) -> Option<(&'static str, &'a str)> {
    let aliases = ALIASES.iter().find(|(k, _)| *k == key).map_or(&[][..], |(_, a)| *a);
    let mut found: Option<(&'static str, &'a str)> = None;
    for name in std::iter::once(&key).chain(aliases) {
        let Some(value) = s.get(name).map(str::trim).filter(|v| !v.is_empty()) else { continue };
        match found {
            None => found = Some((name, value)),
            Some((first, v)) if v != value => problems
                .invalid
                .push((name.to_string(), format!("{first} and {name} are both set, to different values"))),
            Some(_) => {}
        }
    }
    found
}

/// `8-4-4-4-12` hexadecimal digits.
fn is_guid(v: &str) -> bool {
    let parts: Vec<&str> = v.split('-').collect();
    parts.len() == 5
        && parts.iter().zip([8, 4, 4, 4, 12]).all(|(p, n)| p.len() == n && p.chars().all(|c| c.is_ascii_hexdigit()))
}

/// A tenant: its GUID or a domain name (`contoso.onmicrosoft.com`).
fn is_tenant(v: &str) -> bool {
    is_guid(v)
        || (v.len() <= 253
            && v.contains('.')
            && v.split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && !l.starts_with('-')
                    && !l.ends_with('-')
                    && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            }))
}

fn is_token_path(v: &str) -> bool {
    let p = Path::new(v);
    p.is_absolute() && !p.components().any(|c| c == Component::ParentDir)
}

impl ClassCredential {
    /// The credential of the sidecar, with no subscription of its own.
    pub fn default_credential() -> Self {
        Self { auth: Auth::Default, subscription_id: None }
    }

    /// Reads the credential of a request's secrets.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` / `FIELD_REQUIRED` (something missing) or `FIELD_INVALID` (something
    /// malformed or contradictory), with one `BadRequest` violation per offending key
    /// (`secrets.<key>`), never quoting a value: a `clientSecret` or `federatedTokenFile`
    /// without `tenantId` or `clientId`, a `tenantId` or `clientId` with neither, both
    /// `clientSecret` and `federatedTokenFile`, two spellings of a key that disagree, a
    /// malformed `tenantId`, `clientId`, `subscriptionId` or `federatedTokenFile`.
    pub fn from_secrets(s: &Secrets) -> Result<Self> {
        let mut p = Problems::default();
        let tenant = lookup(s, TENANT_ID, &mut p);
        let client = lookup(s, CLIENT_ID, &mut p);
        let secret = lookup(s, CLIENT_SECRET, &mut p);
        let file = lookup(s, FEDERATED_TOKEN_FILE, &mut p);
        let subscription = lookup(s, SUBSCRIPTION_ID, &mut p);

        let set = |v: Option<(&'static str, &str)>| v.map(|(k, _)| k);
        // What makes the identity: the first key found names the requirement in messages.
        let given: Vec<&str> = [set(tenant), set(client), set(secret), set(file)].into_iter().flatten().collect();
        if let Some(first) = given.first() {
            if tenant.is_none() {
                p.missing.push((TENANT_ID.to_string(), format!("required when {first} is set")));
            }
            if client.is_none() {
                p.missing.push((CLIENT_ID.to_string(), format!("required when {first} is set")));
            }
            match (secret, file) {
                (None, None) => p.missing.push((
                    CLIENT_SECRET.to_string(),
                    format!("{CLIENT_SECRET} or {FEDERATED_TOKEN_FILE} is required when {first} is set"),
                )),
                (Some((sk, _)), Some((fk, _))) => {
                    for k in [sk, fk] {
                        p.invalid.push((
                            k.to_string(),
                            format!("set only one of {CLIENT_SECRET} (a service principal) and {FEDERATED_TOKEN_FILE} (workload identity)"),
                        ));
                    }
                }
                _ => {}
            }
        }
        if let Some((k, _)) = tenant.filter(|(_, v)| !is_tenant(v)) {
            p.invalid.push((k.to_string(), "not a tenant ID (a GUID) or a tenant domain name".to_string()));
        }
        if let Some((k, _)) = client.filter(|(_, v)| !is_guid(v)) {
            p.invalid.push((k.to_string(), "not an application (client) ID: a GUID".to_string()));
        }
        if let Some((k, _)) = subscription.filter(|(_, v)| !is_guid(v)) {
            p.invalid.push((k.to_string(), "not a subscription ID: a GUID".to_string()));
        }
        if let Some((k, _)) = file.filter(|(_, v)| !is_token_path(v)) {
            p.invalid.push((k.to_string(), "not an absolute path without `..` (inside the sidecar)".to_string()));
        }
        if let Some(err) = p.into_error() {
            return Err(err);
        }

        let value = |v: Option<(&'static str, &str)>| v.map(|(_, v)| v.to_string()).unwrap_or_default();
        let auth = match (secret, file) {
            (Some((_, s)), None) => {
                Auth::ClientSecret { tenant_id: value(tenant), client_id: value(client), client_secret: s.to_string() }
            }
            (None, Some((_, f))) => Auth::WorkloadIdentity {
                tenant_id: value(tenant),
                client_id: value(client),
                token_file: PathBuf::from(f),
            },
            _ => Auth::Default,
        };
        Ok(Self { auth, subscription_id: subscription.map(|(_, v)| v.to_string()) })
    }

    /// Which identity this is.
    pub fn source(&self) -> Source {
        match self.auth {
            Auth::Default => Source::Default,
            Auth::ClientSecret { .. } => Source::ClientSecret,
            Auth::WorkloadIdentity { .. } => Source::WorkloadIdentity,
        }
    }

    /// Short name of the kind (`default`, `clientSecret`, `workloadIdentity`).
    pub fn kind(&self) -> &'static str {
        self.source().kind()
    }

    /// Whether this is the sidecar's default credential (the secret names no identity).
    pub fn is_default(&self) -> bool {
        self.auth == Auth::Default
    }

    /// The class's default subscription (`subscriptionId`), if the secret gives one. A provider
    /// spec's subscription wins over it; it wins over the sidecar's `--subscription-id`.
    pub fn subscription_id(&self) -> Option<&str> {
        self.subscription_id.as_deref()
    }

    /// A stable digest of the identity (the cache key; safe to log): `default` for the sidecar's
    /// credential, else 16 hex digits of a SHA-256 over the kind and values. The subscription
    /// is not part of it: classes that differ only by subscription share tokens.
    pub fn fingerprint(&self) -> String {
        let path;
        let fields: [&str; 4] = match &self.auth {
            Auth::Default => return "default".to_string(),
            Auth::ClientSecret { tenant_id, client_id, client_secret } => {
                ["clientSecret", tenant_id, client_id, client_secret]
            }
            Auth::WorkloadIdentity { tenant_id, client_id, token_file } => {
                path = token_file.to_string_lossy();
                ["workloadIdentity", tenant_id, client_id, &path]
            }
        };
        let mut h = Sha256::new();
        for f in fields {
            // Length-prefixed, so no two field lists hash alike by shifting a boundary.
            h.update((f.len() as u64).to_be_bytes());
            h.update(f.as_bytes());
        }
        hex::encode(h.finalize())[..16].to_string()
    }
}

/// One cached class credential.
struct Entry {
    credential: Arc<dyn TokenCredential>,
    last_used: Instant,
}

/// The credentials of every MachineClass, cached per secret content.
///
/// ```no_run
/// # use std::sync::Arc;
/// # use azure_vmss_driver::arm::ArmClient;
/// # use azure_vmss_driver::class_credential::ClassCredentials;
/// # fn call(arm: &ArmClient, creds: &ClassCredentials, secrets: &driver_sdk::Secrets) -> driver_sdk::Result<()> {
/// let (credential, subscription) = creds.credential_for(secrets)?;
/// let arm = arm.with_credential(credential);
/// # let _ = (arm, subscription); Ok(()) }
/// ```
pub struct ClassCredentials {
    default: Arc<dyn TokenCredential>,
    authority_host: Url,
    http: Arc<dyn HttpClient>,
    entries: Mutex<HashMap<String, Entry>>,
}

impl fmt::Debug for ClassCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClassCredentials")
            .field("authority_host", &self.authority_host.as_str())
            .field("cached", &self.cached())
            .finish_non_exhaustive()
    }
}

impl ClassCredentials {
    /// Class credentials falling back to `default` (the sidecar's `--credential`), getting
    /// tokens from the Entra authority `authority_host` (e.g.
    /// [`credential::authority_host`](crate::credential::authority_host) of the
    /// `--authority-host` flag) over `azure_core`'s default HTTP transport.
    pub fn new(default: Arc<dyn TokenCredential>, authority_host: Url) -> Self {
        Self { default, authority_host, http: azure_core::new_http_client(), entries: Mutex::new(HashMap::new()) }
    }

    /// The sidecar's default credential.
    pub fn default_credential(&self) -> &Arc<dyn TokenCredential> {
        &self.default
    }

    /// The credential and the class's default subscription of a request's secrets: the same
    /// `Arc` for the same secret content (so its token is reused), a new one when the content
    /// changed, the default credential when the secrets name no identity.
    ///
    /// # Errors
    /// INVALID_ARGUMENT from [`ClassCredential::from_secrets`].
    pub fn credential_for(&self, secrets: &Secrets) -> Result<(Arc<dyn TokenCredential>, Option<String>)> {
        let class = ClassCredential::from_secrets(secrets)?;
        Ok((self.credential(&class), class.subscription_id))
    }

    /// The credential of an already parsed [`ClassCredential`] (see
    /// [`credential_for`](Self::credential_for)).
    pub fn credential(&self, class: &ClassCredential) -> Arc<dyn TokenCredential> {
        self.credential_at(class, Instant::now())
    }

    /// How many class credentials are cached.
    pub fn cached(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        lock(&self.entries)
    }

    fn credential_at(&self, class: &ClassCredential, now: Instant) -> Arc<dyn TokenCredential> {
        let (tenant_id, client_id) = match &class.auth {
            Auth::Default => return self.default.clone(),
            Auth::ClientSecret { tenant_id, client_id, .. } | Auth::WorkloadIdentity { tenant_id, client_id, .. } => {
                (tenant_id, client_id)
            }
        };
        let key = class.fingerprint();
        let mut entries = self.lock();
        entries.retain(|_, e| now.saturating_duration_since(e.last_used) < IDLE_EVICTION);
        if let Some(e) = entries.get_mut(&key) {
            e.last_used = now;
            return e.credential.clone();
        }
        let recorder = Arc::new(EntraRecorder::new(self.http.clone()));
        let http: Arc<dyn HttpClient> = recorder.clone();
        let inner: Arc<dyn TokenCredential> = match &class.auth {
            Auth::ClientSecret { client_secret, .. } => Arc::new(ClientSecretCredential::new(
                http,
                self.authority_host.clone(),
                tenant_id.clone(),
                client_id.clone(),
                client_secret.clone(),
            )),
            Auth::WorkloadIdentity { token_file, .. } => Arc::new(FederatedTokenFile::new(
                http,
                self.authority_host.clone(),
                tenant_id.clone(),
                client_id.clone(),
                token_file.clone(),
            )),
            Auth::Default => return self.default.clone(),
        };
        tracing::info!(
            "credentials.kind" = class.kind(), "credentials.fingerprint" = %key,
            "new MachineClass credential"
        );
        let credential: Arc<dyn TokenCredential> =
            Arc::new(ClassToken::new(class.source(), key.clone(), inner, recorder));
        if entries.len() >= MAX_CACHED {
            // Rotated secrets leave stale entries behind: the least recently used one goes.
            if let Some(oldest) = entries.iter().min_by_key(|(_, e)| e.last_used).map(|(k, _)| k.clone()) {
                entries.remove(&oldest);
            }
        }
        entries.insert(key, Entry { credential: credential.clone(), last_used: now });
        credential
    }
}

/// What Microsoft Entra ID answered to the last token request of one class credential.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntraAnswer {
    /// A 4xx other than 429: the credential was refused.
    Refused(EntraRefusal),
    /// 429 or a 5xx.
    Failed {
        /// HTTP status.
        status: u16,
    },
    /// No answer (connection refused, reset, timed out).
    NoAnswer,
}

/// The safe part of an Entra error answer: its `error`, `AADSTS…` code and IDs, never
/// `error_description` (which quotes client and tenant IDs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntraRefusal {
    /// HTTP status.
    pub status: u16,
    /// The OAuth `error` (`invalid_client`, `unauthorized_client`, `invalid_request`, …).
    pub error: String,
    /// The first of `error_codes` as `AADSTS<n>`, if any.
    pub code: Option<String>,
    /// `trace_id`, for Microsoft support.
    pub trace_id: Option<String>,
    /// `correlation_id`.
    pub correlation_id: Option<String>,
}

impl EntraRefusal {
    /// Reads an Entra error body (`{"error", "error_codes", "trace_id", "correlation_id", …}`).
    fn from_body(status: u16, body: &[u8]) -> Self {
        let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
        let text = |k: &str| v[k].as_str().filter(|s| !s.is_empty()).map(str::to_string);
        let code =
            v["error_codes"].as_array().and_then(|c| c.first()).and_then(|c| c.as_u64()).map(|n| format!("AADSTS{n}"));
        Self {
            status,
            error: text("error").unwrap_or_default(),
            code,
            trace_id: text("trace_id"),
            correlation_id: text("correlation_id"),
        }
    }

    /// What a known `AADSTS…` code means (fixed text, no values).
    pub fn hint(&self) -> Option<&'static str> {
        Some(match self.code.as_deref()? {
            "AADSTS7000215" => "invalid client secret",
            "AADSTS7000222" => "the client secret has expired",
            "AADSTS700016" => "no application with this client ID in the tenant",
            "AADSTS90002" | "AADSTS900023" => "no such tenant",
            "AADSTS70021" => "no federated identity credential of the application matches the token",
            "AADSTS700024" => "the federated token is expired or not yet valid",
            "AADSTS700027" => "the client assertion's signature is invalid",
            "AADSTS7000216" | "AADSTS7000218" => "neither a client secret nor a client assertion was sent",
            "AADSTS1002012" | "AADSTS70011" => "invalid scope (client credentials need `<resource>/.default`)",
            _ => return None,
        })
    }
}

impl fmt::Display for EntraRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.status, if self.error.is_empty() { "(no error code)" } else { &self.error })?;
        if let Some(code) = &self.code {
            write!(f, " {code}")?;
        }
        if let Some(hint) = self.hint() {
            write!(f, " ({hint})")?;
        }
        Ok(())
    }
}

/// The HTTP transport of one class credential's token requests: passes everything through and
/// keeps what Entra answered to the last failed one (the token flows of `azure_identity` 0.21
/// drop the error body).
#[derive(Debug)]
struct EntraRecorder {
    inner: Arc<dyn HttpClient>,
    last: Mutex<Option<EntraAnswer>>,
}

impl EntraRecorder {
    fn new(inner: Arc<dyn HttpClient>) -> Self {
        Self { inner, last: Mutex::new(None) }
    }

    fn set(&self, answer: Option<EntraAnswer>) {
        *lock(&self.last) = answer;
    }

    fn take(&self) -> Option<EntraAnswer> {
        lock(&self.last).take()
    }
}

#[async_trait::async_trait]
impl HttpClient for EntraRecorder {
    async fn execute_request(&self, request: &Request) -> azure_core::Result<Response> {
        let resp = match self.inner.execute_request(request).await {
            Ok(r) => r,
            Err(e) => {
                self.set(Some(EntraAnswer::NoAnswer));
                return Err(e);
            }
        };
        let status = resp.status() as u16;
        if (200..300).contains(&status) {
            self.set(None);
            return Ok(resp);
        }
        let (code, headers, body) = resp.deconstruct();
        let bytes = match body.collect().await {
            Ok(b) => b,
            Err(e) => {
                self.set(Some(EntraAnswer::NoAnswer));
                return Err(e);
            }
        };
        self.set(Some(if status == 429 || status >= 500 {
            EntraAnswer::Failed { status }
        } else {
            EntraAnswer::Refused(EntraRefusal::from_body(status, &bytes))
        }));
        Ok(Response::new(code, headers, Box::pin(BytesStream::new(bytes))))
    }
}

/// A class credential could not get a token.
#[derive(Debug, thiserror::Error)]
#[error("{}", self.summary())]
pub struct ClassTokenError {
    source_kind: Source,
    fingerprint: String,
    answer: Option<EntraAnswer>,
    #[source]
    cause: azure_core::Error,
}

impl ClassTokenError {
    /// Which credential failed.
    pub fn credential_source(&self) -> Source {
        self.source_kind
    }

    /// The credential's [fingerprint](ClassCredential::fingerprint).
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// What Entra answered, if the failure was its answer (`None`: e.g. the token file could
    /// not be read).
    pub fn answer(&self) -> Option<&EntraAnswer> {
        self.answer.as_ref()
    }

    /// Entra's refusal, if it refused.
    pub fn refusal(&self) -> Option<&EntraRefusal> {
        match &self.answer {
            Some(EntraAnswer::Refused(r)) => Some(r),
            _ => None,
        }
    }

    /// The underlying `azure_identity` error.
    pub fn into_cause(self) -> azure_core::Error {
        self.cause
    }

    fn summary(&self) -> String {
        let who = self.source_kind.describe();
        match &self.answer {
            Some(EntraAnswer::Refused(r)) => format!("Microsoft Entra ID refused {who}: {r}"),
            Some(EntraAnswer::Failed { status }) => {
                format!("Microsoft Entra ID answered {status} to a token request of {who}")
            }
            Some(EntraAnswer::NoAnswer) => {
                format!("Microsoft Entra ID could not be reached for a token of {who}")
            }
            None => format!("{who} could not get an Azure access token"),
        }
    }
}

/// A class credential: the `azure_identity` flow, its tokens per scope list (refreshed
/// [`REFRESH_MARGIN`] before they expire), and failures as [`ClassTokenError`].
struct ClassToken {
    source: Source,
    fingerprint: String,
    inner: Arc<dyn TokenCredential>,
    recorder: Arc<EntraRecorder>,
    tokens: tokio::sync::Mutex<HashMap<Vec<String>, AccessToken>>,
}

impl fmt::Debug for ClassToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClassToken")
            .field("kind", &self.source.kind())
            .field("fingerprint", &self.fingerprint)
            .finish_non_exhaustive()
    }
}

impl ClassToken {
    fn new(source: Source, fingerprint: String, inner: Arc<dyn TokenCredential>, recorder: Arc<EntraRecorder>) -> Self {
        Self { source, fingerprint, inner, recorder, tokens: tokio::sync::Mutex::new(HashMap::new()) }
    }
}

#[async_trait::async_trait]
impl TokenCredential for ClassToken {
    async fn get_token(&self, scopes: &[&str]) -> azure_core::Result<AccessToken> {
        let key: Vec<String> = scopes.iter().map(|s| s.to_string()).collect();
        // Held across the refresh: concurrent callers wait for one token request.
        let mut tokens = self.tokens.lock().await;
        let now = OffsetDateTime::now_utc();
        if let Some(t) = tokens.get(&key) {
            if t.expires_on > now + REFRESH_MARGIN {
                return Ok(t.clone());
            }
        }
        // The inner flow caches too, but refreshes only 20 s before expiry (azure_identity
        // 0.21): make it ask Entra now.
        let _ = self.inner.clear_cache().await;
        self.recorder.set(None);
        match self.inner.get_token(scopes).await {
            Ok(t) => {
                tokens.insert(key, t.clone());
                Ok(t)
            }
            Err(cause) => {
                let err = ClassTokenError {
                    source_kind: self.source,
                    fingerprint: self.fingerprint.clone(),
                    answer: self.recorder.take(),
                    cause,
                };
                match tokens.get(&key) {
                    Some(old) if old.expires_on > OffsetDateTime::now_utc() + MIN_REMAINING => {
                        tracing::warn!(
                            "credentials.kind" = self.source.kind(), "credentials.fingerprint" = %self.fingerprint,
                            error = %driver_sdk::error_chain(&err),
                            "token refresh failed; using the current token until it expires"
                        );
                        Ok(old.clone())
                    }
                    _ => {
                        tokens.remove(&key);
                        Err(azure_core::Error::new(ErrorKind::Credential, err))
                    }
                }
            }
        }
    }

    async fn clear_cache(&self) -> azure_core::Result<()> {
        self.tokens.lock().await.clear();
        self.inner.clear_cache().await
    }
}

#[cfg(test)]
mod tests;
