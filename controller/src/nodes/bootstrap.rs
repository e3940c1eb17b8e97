//! How machines join the target cluster: where its API server is and which CA it presents (the
//! boot data's `.APIServerURL`, `.CACertificate`, `.CACertHash`), and the bootstrap tokens
//! minted per machine (Secrets `kube-system/bootstrap-token-<id>` of type
//! `bootstrap.kubernetes.io/token`, as `kubeadm token create` makes them).
//!
//! A token's secret is read from its Secret when boot data is rendered and is never kept,
//! logged or written anywhere else: the Machine records only its ID.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use rand::Rng;

use super::{Error, Target};

/// Where bootstrap tokens live (the API server's bootstrap token authenticator reads only there).
pub const TOKEN_NAMESPACE: &str = "kube-system";
/// The Secret type of a bootstrap token.
pub const TOKEN_TYPE: &str = "bootstrap.kubernetes.io/token";
/// The label naming the Machine (or pool) a token was minted for: `<namespace>.<name>` (or
/// `pool.<namespace>.<name>`).
pub const LABEL_TOKEN_FOR: &str = "machine.driver.dev/bootstrap-token-for";
/// kubeadm's group for node bootstrap tokens: a kubeadm cluster's own bindings (TLS bootstrap,
/// CSR auto-approval) admit it.
pub const DEFAULT_TOKEN_GROUP: &str = "system:bootstrappers:kubeadm:default-node-token";
/// How long a token lives unless refreshed (Cluster API's kubeadm bootstrap provider: 15 min).
pub const DEFAULT_TOKEN_TTL: Duration = Duration::from_secs(15 * 60);

/// The target cluster's endpoint as machines reach it, and its bootstrap token settings.
#[derive(Clone)]
pub struct JoinSettings {
    /// `https://host:port` (the kubeconfig's server, or `--target-api-server-url`).
    pub api_server_url: String,
    /// The CA certificate (DER) the API server's serving certificate chains to, when the
    /// kubeconfig names one.
    pub ca: Option<Vec<u8>>,
    /// Tokens live this long unless refreshed (refreshed once half of it is gone).
    pub token_ttl: Duration,
    /// The token's `auth-extra-groups`.
    pub token_group: String,
}

impl std::fmt::Debug for JoinSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JoinSettings")
            .field("api_server_url", &self.api_server_url)
            .field("ca", &self.ca.as_ref().map(|c| c.len()))
            .field("token_ttl", &self.token_ttl)
            .field("token_group", &self.token_group)
            .finish()
    }
}

impl JoinSettings {
    /// From a client configuration: its server and first root certificate.
    pub fn of(config: &kube::Config) -> Self {
        Self {
            api_server_url: config.cluster_url.to_string().trim_end_matches('/').to_string(),
            ca: config.root_cert.as_ref().and_then(|certs| certs.first().cloned()),
            token_ttl: DEFAULT_TOKEN_TTL,
            token_group: DEFAULT_TOKEN_GROUP.to_string(),
        }
    }

    /// `host:port` of the API server URL.
    pub fn api_server_host(&self) -> String {
        let rest = self.api_server_url.split_once("://").map_or(self.api_server_url.as_str(), |(_, r)| r);
        let host = rest.split('/').next().unwrap_or(rest);
        if host.contains(':') && !host.ends_with(']') {
            host.to_string()
        } else {
            format!("{host}:443")
        }
    }
}

/// A bootstrap token: ID and secret (`<id>.<secret>` is what a kubelet presents). Its Debug
/// shows the ID only.
#[derive(Clone, PartialEq, Eq)]
pub struct Token {
    /// Six characters `[a-z0-9]`: public, names the Secret.
    pub id: String,
    secret: String,
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Token({}.<redacted>)", self.id)
    }
}

impl Token {
    /// `<id>.<secret>`, for the boot data only.
    pub fn value(&self) -> String {
        format!("{}.{}", self.id, self.secret)
    }
}

const TOKEN_CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";

fn random_chars(n: usize) -> String {
    let mut rng = rand::rng();
    (0..n).map(|_| char::from(TOKEN_CHARS[rng.random_range(0..TOKEN_CHARS.len())])).collect()
}

/// A new token ID (the secret is drawn when its Secret is created).
pub fn new_token_id() -> String {
    random_chars(6)
}

/// The name of a token's Secret.
pub fn secret_name(id: &str) -> String {
    format!("bootstrap-token-{id}")
}

/// What [`Target::ensure_token`] found.
#[derive(Debug)]
pub enum Ensured {
    /// The token, usable until at least the given time.
    Token(Token, DateTime<Utc>),
    /// A Secret of that name exists but was not minted for this holder (an ID collision):
    /// draw another ID.
    Taken,
}

impl Target {
    fn tokens(&self) -> Api<Secret> {
        Api::namespaced(self.client.clone(), TOKEN_NAMESPACE)
    }

    /// The token `id` minted for `holder` (the [`LABEL_TOKEN_FOR`] value): read if its Secret
    /// exists, created (expiring at `expires`) if not.
    ///
    /// # Errors
    /// The API server's refusal.
    pub async fn ensure_token(
        &self,
        id: &str,
        holder: &str,
        description: &str,
        expires: DateTime<Utc>,
    ) -> Result<Ensured, Error> {
        self.guard()?;
        if let Some(found) = self.tokens().get_opt(&secret_name(id)).await? {
            return Ok(read_token(&found, holder).map_or(Ensured::Taken, |(t, e)| Ensured::Token(t, e)));
        }
        let token = Token { id: id.to_string(), secret: random_chars(16) };
        let secret = token_secret(&token, holder, description, expires, &self.join.token_group);
        match self.tokens().create(&PostParams::default(), &secret).await {
            Ok(_) => Ok(Ensured::Token(token, expires)),
            // Created meanwhile (by a controller that was replaced): read it.
            Err(kube::Error::Api(s)) if s.code == 409 => {
                let found = self.tokens().get_opt(&secret_name(id)).await?;
                Ok(found
                    .as_ref()
                    .and_then(|s| read_token(s, holder))
                    .map_or(Ensured::Taken, |(t, e)| Ensured::Token(t, e)))
            }
            Err(e) => Err(e),
        }
    }

    /// Whether the token `id` still exists.
    ///
    /// # Errors
    /// The API server's refusal.
    pub async fn token_exists(&self, id: &str) -> Result<bool, Error> {
        self.guard()?;
        Ok(self.tokens().get_metadata_opt(&secret_name(id)).await?.is_some())
    }

    /// Moves the token's expiration to `expires`; `false` if it is gone.
    ///
    /// # Errors
    /// The API server's refusal.
    pub async fn refresh_token(&self, id: &str, expires: DateTime<Utc>) -> Result<bool, Error> {
        self.guard()?;
        let patch = serde_json::json!({"stringData": {"expiration": rfc3339(expires)}});
        match self.tokens().patch(&secret_name(id), &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Deletes the token `id` (done if it is gone).
    ///
    /// # Errors
    /// The API server's refusal.
    pub async fn delete_token(&self, id: &str) -> Result<(), Error> {
        self.guard()?;
        match self.tokens().delete(&secret_name(id), &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(e),
        }
    }
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// The Secret of a token, as `kubeadm token create` writes it (usages for a kubelet's TLS
/// bootstrap and for `kubeadm join`'s discovery of the cluster-info ConfigMap).
fn token_secret(token: &Token, holder: &str, description: &str, expires: DateTime<Utc>, group: &str) -> Secret {
    let data: BTreeMap<String, String> = [
        ("token-id", token.id.clone()),
        ("token-secret", token.secret.clone()),
        ("expiration", rfc3339(expires)),
        ("usage-bootstrap-authentication", "true".into()),
        ("usage-bootstrap-signing", "true".into()),
        ("auth-extra-groups", group.to_string()),
        ("description", description.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(secret_name(&token.id)),
            namespace: Some(TOKEN_NAMESPACE.into()),
            labels: Some([(LABEL_TOKEN_FOR.to_string(), holder.to_string())].into()),
            ..Default::default()
        },
        type_: Some(TOKEN_TYPE.into()),
        string_data: Some(data),
        ..Default::default()
    }
}

/// The token and expiration a Secret holds, if it is a token minted for `holder`.
fn read_token(s: &Secret, holder: &str) -> Option<(Token, DateTime<Utc>)> {
    if s.type_.as_deref() != Some(TOKEN_TYPE) {
        return None;
    }
    if s.metadata.labels.as_ref().and_then(|l| l.get(LABEL_TOKEN_FOR)).map(String::as_str) != Some(holder) {
        return None;
    }
    let data = s.data.as_ref()?;
    let text = |k: &str| data.get(k).and_then(|b| String::from_utf8(b.0.clone()).ok());
    let expires = text("expiration")
        .and_then(|e| DateTime::parse_from_rfc3339(&e).ok())
        .map_or(DateTime::<Utc>::MAX_UTC, |e| e.with_timezone(&Utc));
    Some((Token { id: text("token-id")?, secret: text("token-secret")? }, expires))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_look_like_kubeadms_and_hide_their_secret() {
        let id = new_token_id();
        assert!(id.len() == 6 && id.bytes().all(|b| TOKEN_CHARS.contains(&b)), "{id}");
        let t = Token { id: id.clone(), secret: random_chars(16) };
        assert_eq!(t.value().len(), 23);
        assert!(!format!("{t:?}").contains(&t.secret));
        let s = token_secret(&t, "ns.m", "for ns/m", Utc::now(), DEFAULT_TOKEN_GROUP);
        assert_eq!(s.metadata.name.as_deref(), Some(format!("bootstrap-token-{id}").as_str()));
        let data = s.string_data.unwrap();
        assert_eq!(data["usage-bootstrap-authentication"], "true");
        assert_eq!(data["auth-extra-groups"], DEFAULT_TOKEN_GROUP);
    }

    #[test]
    fn the_host_is_what_kubeadm_join_takes() {
        let mut s = JoinSettings {
            api_server_url: "https://10.0.0.1:6443".into(),
            ca: None,
            token_ttl: DEFAULT_TOKEN_TTL,
            token_group: DEFAULT_TOKEN_GROUP.into(),
        };
        assert_eq!(s.api_server_host(), "10.0.0.1:6443");
        s.api_server_url = "https://api.example.com".into();
        assert_eq!(s.api_server_host(), "api.example.com:443");
    }
}
