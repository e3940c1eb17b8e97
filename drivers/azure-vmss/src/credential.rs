//! Azure credentials for the sidecar: `azure_identity`'s chain and flows, a workload-identity
//! credential that re-reads the projected token file, and a fixed token for tests. The
//! per-MachineClass credentials built from a request's secrets are in
//! [`class_credential`](crate::class_credential).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use azure_core::auth::{AccessToken, Secret, TokenCredential};
use azure_core::error::{Error as AzError, ErrorKind};
use azure_core::{HttpClient, Url};
use azure_identity::{
    ClientSecretCredential, DefaultAzureCredential, TokenCredentialOptions, VirtualMachineManagedIdentityCredential,
    WorkloadIdentityCredential,
};
use time::OffsetDateTime;
use tokio::sync::Mutex;

/// Which credential the sidecar uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CredentialKind {
    /// `DefaultAzureCredential`: environment (client secret), workload identity, managed
    /// identity, Azure CLI — the first that works.
    Default,
    /// Service principal with a secret: `AZURE_TENANT_ID`, `AZURE_CLIENT_ID`, `AZURE_CLIENT_SECRET`.
    ClientSecret,
    /// Workload identity federation: `AZURE_TENANT_ID`, `AZURE_CLIENT_ID`,
    /// `AZURE_FEDERATED_TOKEN_FILE` (re-read on every token refresh).
    WorkloadIdentity,
    /// The VM's or pod's system-assigned managed identity (IMDS).
    ManagedIdentity,
    /// TEST ONLY: send a fixed bearer token (`--static-token`), e.g. to the ARM emulator.
    StaticToken,
}

/// Why a credential could not be built.
#[derive(Debug, thiserror::Error)]
pub enum CredentialError {
    /// A required environment variable is missing.
    #[error("credential {kind:?} needs the environment variable {var}")]
    MissingEnv {
        /// The credential.
        kind: CredentialKind,
        /// The variable.
        var: &'static str,
    },
    /// `--credential static-token` without `--static-token`.
    #[error("credential static-token needs --static-token (or AZURE_VMSS_STATIC_TOKEN)")]
    MissingStaticToken,
    /// The authority host is not a URL.
    #[error("invalid authority host {0}")]
    Authority(String),
    /// azure_identity refused the configuration.
    #[error("building the {0:?} credential")]
    Identity(CredentialKind, #[source] AzError),
}

fn env(kind: CredentialKind, var: &'static str) -> Result<String, CredentialError> {
    std::env::var(var).ok().filter(|v| !v.is_empty()).ok_or(CredentialError::MissingEnv { kind, var })
}

fn identity_options(authority_host: Option<&str>) -> Result<(TokenCredentialOptions, Url), CredentialError> {
    let mut options = TokenCredentialOptions::default();
    if let Some(host) = authority_host {
        options.set_authority_host(host.to_string());
    }
    let authority =
        options.authority_host().map_err(|_| CredentialError::Authority(authority_host.unwrap_or("").into()))?;
    Ok((options, authority))
}

/// The Microsoft Entra authority host: `authority_host` (the `--authority-host` flag) when
/// given, else `AZURE_AUTHORITY_HOST`, else `https://login.microsoftonline.com` — the one
/// [`build`] uses.
///
/// # Errors
/// [`CredentialError::Authority`] when it is not a URL.
pub fn authority_host(authority_host: Option<&str>) -> Result<Url, CredentialError> {
    identity_options(authority_host).map(|(_, url)| url)
}

/// Builds the credential of `kind`.
///
/// # Errors
/// Missing configuration.
pub fn build(
    kind: CredentialKind,
    static_token: Option<&str>,
    authority_host: Option<&str>,
) -> Result<Arc<dyn TokenCredential>, CredentialError> {
    let (options, authority) = identity_options(authority_host)?;
    Ok(match kind {
        CredentialKind::Default => {
            Arc::new(DefaultAzureCredential::create(options).map_err(|e| CredentialError::Identity(kind, e))?)
        }
        CredentialKind::ClientSecret => Arc::new(ClientSecretCredential::new(
            options.http_client(),
            authority,
            env(kind, "AZURE_TENANT_ID")?,
            env(kind, "AZURE_CLIENT_ID")?,
            env(kind, "AZURE_CLIENT_SECRET")?,
        )),
        CredentialKind::WorkloadIdentity => Arc::new(FederatedTokenFile::new(
            options.http_client(),
            authority,
            env(kind, "AZURE_TENANT_ID")?,
            env(kind, "AZURE_CLIENT_ID")?,
            PathBuf::from(env(kind, "AZURE_FEDERATED_TOKEN_FILE")?),
        )),
        CredentialKind::ManagedIdentity => Arc::new(VirtualMachineManagedIdentityCredential::new(options)),
        CredentialKind::StaticToken => {
            let token = static_token.filter(|t| !t.is_empty()).ok_or(CredentialError::MissingStaticToken)?;
            Arc::new(StaticToken(Secret::new(token.to_string())))
        }
    })
}

/// How long a [`StaticToken`] claims to be valid: an Entra token's usual lifetime.
const STATIC_TOKEN_LIFETIME: Duration = Duration::from_secs(3600);

/// TEST ONLY: a fixed bearer token (the ARM emulator accepts any).
#[derive(Debug)]
pub struct StaticToken(Secret);

#[async_trait::async_trait]
impl TokenCredential for StaticToken {
    async fn get_token(&self, _scopes: &[&str]) -> azure_core::Result<AccessToken> {
        Ok(AccessToken::new(self.0.clone(), OffsetDateTime::now_utc() + STATIC_TOKEN_LIFETIME))
    }

    async fn clear_cache(&self) -> azure_core::Result<()> {
        Ok(())
    }
}

/// Workload identity that reads the projected service-account token file on every refresh.
///
/// `azure_identity`'s `WorkloadIdentityCredential` reads the file once, at creation; the
/// kubelet rotates it (hourly), so a long-running sidecar would present an expired assertion.
/// This wrapper builds a fresh credential from the file whenever the cached AAD token is close
/// to expiry. Used for the sidecar's `--credential workload-identity` (environment variables)
/// and for a MachineClass secret's `federatedTokenFile`.
#[derive(Debug)]
pub struct FederatedTokenFile {
    http: Arc<dyn HttpClient>,
    authority: Url,
    tenant_id: String,
    client_id: String,
    token_file: PathBuf,
    cached: Mutex<Option<(Vec<String>, AccessToken)>>,
}

impl FederatedTokenFile {
    /// Workload identity of `client_id` in `tenant_id`, asserted with the content of
    /// `token_file` (read at each refresh, not now), against the Entra authority `authority`
    /// over `http`.
    pub fn new(
        http: Arc<dyn HttpClient>,
        authority: Url,
        tenant_id: String,
        client_id: String,
        token_file: PathBuf,
    ) -> Self {
        Self { http, authority, tenant_id, client_id, token_file, cached: Mutex::new(None) }
    }
}

/// Refresh an AAD token this long before it expires.
pub(crate) const REFRESH_MARGIN: Duration = Duration::from_secs(300);

#[async_trait::async_trait]
impl TokenCredential for FederatedTokenFile {
    async fn get_token(&self, scopes: &[&str]) -> azure_core::Result<AccessToken> {
        let wanted: Vec<String> = scopes.iter().map(|s| s.to_string()).collect();
        let mut cached = self.cached.lock().await;
        if let Some((s, tok)) = cached.as_ref() {
            if *s == wanted && tok.expires_on > OffsetDateTime::now_utc() + REFRESH_MARGIN {
                return Ok(tok.clone());
            }
        }
        let assertion = tokio::fs::read_to_string(&self.token_file).await.map_err(|e| {
            AzError::full(
                ErrorKind::Credential,
                e,
                format!("reading the federated token file {}", self.token_file.display()),
            )
        })?;
        let inner = WorkloadIdentityCredential::new(
            self.http.clone(),
            self.authority.clone(),
            self.tenant_id.clone(),
            self.client_id.clone(),
            assertion.trim().to_string(),
        );
        let tok = inner.get_token(scopes).await?;
        *cached = Some((wanted, tok.clone()));
        Ok(tok)
    }

    async fn clear_cache(&self) -> azure_core::Result<()> {
        *self.cached.lock().await = None;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn static_token_is_returned() {
        let c = build(CredentialKind::StaticToken, Some("abc"), None).unwrap();
        assert_eq!(c.get_token(&["s"]).await.unwrap().token.secret(), "abc");
        assert!(matches!(build(CredentialKind::StaticToken, None, None), Err(CredentialError::MissingStaticToken)));
    }

    #[tokio::test]
    async fn workload_identity_reads_the_file_on_refresh() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        let c = FederatedTokenFile::new(
            azure_core::new_http_client(),
            Url::parse("http://127.0.0.1:9/").unwrap(),
            "t".into(),
            "c".into(),
            file.clone(),
        );
        // No file yet: the error names it (proves the file is read at refresh, not at startup).
        let err = c.get_token(&["s"]).await.unwrap_err();
        assert!(err.to_string().contains("federated token file"), "{err}");
    }
}
