//! Per-MachineClass credentials: what the request's `secrets` say about which AWS identity makes
//! the EC2 calls of that request.
//!
//! | secret keys | credentials |
//! |---|---|
//! | none of the keys below | the sidecar's default AWS chain (environment, profile, web identity, instance metadata) |
//! | `accessKeyId` + `secretAccessKey` (+ `sessionToken`) | those static keys |
//! | `roleArn` (+ `externalId`, `roleSessionName`) | STS `AssumeRole`, signed by the default chain |
//! | `roleArn` + `accessKeyId` + `secretAccessKey` (+ `sessionToken`) | STS `AssumeRole`, signed by those keys |
//!
//! Other keys are ignored; an empty value counts as absent. Values never leave this module except
//! into the AWS SDK's credential types (whose `Debug` redacts them): [`ClassCredentials`]'s
//! `Debug` prints the kind and a [fingerprint](ClassCredentials::fingerprint) only.

use std::fmt;

use aws_config::sts::AssumeRoleProvider;
use aws_config::SdkConfig;
use aws_credential_types::provider::SharedCredentialsProvider;
use aws_credential_types::Credentials;
use driver_sdk::{reason, DriverError, Result, Secrets};
use sha2::{Digest, Sha256};

/// Secret key: the access key ID of static credentials.
pub const ACCESS_KEY_ID: &str = "accessKeyId";
/// Secret key: the secret access key of static credentials.
pub const SECRET_ACCESS_KEY: &str = "secretAccessKey";
/// Secret key: the session token of temporary static credentials (optional).
pub const SESSION_TOKEN: &str = "sessionToken";
/// Secret key: the ARN of an IAM role to assume with STS.
pub const ROLE_ARN: &str = "roleArn";
/// Secret key: the external ID the role's trust policy asks for (optional).
pub const EXTERNAL_ID: &str = "externalId";
/// Secret key: the role session name (optional; default [`DEFAULT_SESSION_NAME`]).
pub const ROLE_SESSION_NAME: &str = "roleSessionName";
/// Every secret key this driver reads.
pub const KEYS: &[&str] = &[ACCESS_KEY_ID, SECRET_ACCESS_KEY, SESSION_TOKEN, ROLE_ARN, EXTERNAL_ID, ROLE_SESSION_NAME];
/// The role session name when the secret gives none (visible in CloudTrail).
pub const DEFAULT_SESSION_NAME: &str = "machine-driver";

/// Static keys from a secret.
#[derive(Clone, PartialEq, Eq)]
pub struct StaticKeys {
    access_key_id: String,
    secret_access_key: String,
    session_token: Option<String>,
}

impl StaticKeys {
    fn credentials(&self) -> Credentials {
        Credentials::new(
            &self.access_key_id,
            &self.secret_access_key,
            self.session_token.clone(),
            None,
            "machineclass-secret",
        )
    }
}

/// Which identity the EC2 calls of one request use.
#[derive(Clone, PartialEq, Eq)]
pub enum ClassCredentials {
    /// The sidecar's default AWS chain.
    Chain,
    /// Static keys from the secret.
    Static(StaticKeys),
    /// A role assumed with STS, signed by `source` (or the default chain).
    AssumeRole {
        /// The role.
        role_arn: String,
        /// External ID for the trust policy.
        external_id: Option<String>,
        /// Role session name.
        session_name: Option<String>,
        /// Keys that sign AssumeRole; `None` = the default chain.
        source: Option<StaticKeys>,
    },
}

impl fmt::Debug for ClassCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClassCredentials")
            .field("kind", &self.kind())
            .field("fingerprint", &self.fingerprint())
            .finish_non_exhaustive()
    }
}

/// Where the credentials of a call came from, for error messages and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The default chain.
    Chain,
    /// Static keys of the class's secret.
    SecretKeys,
    /// A role named by the class's secret.
    SecretRole,
}

impl Source {
    /// Short name (logs, ErrorInfo metadata `awsCredentials`).
    pub fn kind(self) -> &'static str {
        match self {
            Source::Chain => "chain",
            Source::SecretKeys => "secretKeys",
            Source::SecretRole => "assumedRole",
        }
    }

    /// For humans.
    pub fn describe(self) -> &'static str {
        match self {
            Source::Chain => "the sidecar's default AWS credential chain",
            Source::SecretKeys => "the keys of the MachineClass secret (accessKeyId/secretAccessKey)",
            Source::SecretRole => "the role of the MachineClass secret (roleArn), assumed with STS",
        }
    }
}

fn get<'a>(s: &'a Secrets, key: &str) -> Option<&'a str> {
    s.get(key).map(str::trim).filter(|v| !v.is_empty())
}

/// Whether `v` looks like an IAM role ARN (`arn:<partition>:iam::<account>:role/<name>`).
fn is_role_arn(v: &str) -> bool {
    let parts: Vec<&str> = v.splitn(6, ':').collect();
    parts.len() == 6
        && parts[0] == "arn"
        && !parts[1].is_empty()
        && parts[2] == "iam"
        && parts[5].strip_prefix("role/").is_some_and(|n| !n.is_empty())
}

/// STS's rule for role session names: 2–64 of `[A-Za-z0-9+=,.@_-]`.
fn is_session_name(v: &str) -> bool {
    (2..=64).contains(&v.len()) && v.chars().all(|c| c.is_ascii_alphanumeric() || "+=,.@_-".contains(c))
}

impl ClassCredentials {
    /// Reads the credentials of a request's secrets.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` / `FIELD_REQUIRED` or `FIELD_INVALID` with one `BadRequest` violation per
    /// offending key (`secrets.<key>`), never quoting a value: half a key pair, a `sessionToken`
    /// without keys, `externalId`/`roleSessionName` without `roleArn`, a malformed `roleArn` or
    /// `roleSessionName`.
    pub fn from_secrets(s: &Secrets) -> Result<Self> {
        let akid = get(s, ACCESS_KEY_ID);
        let secret = get(s, SECRET_ACCESS_KEY);
        let token = get(s, SESSION_TOKEN);
        let role = get(s, ROLE_ARN);
        let external_id = get(s, EXTERNAL_ID);
        let session_name = get(s, ROLE_SESSION_NAME);

        let mut missing: Vec<(&str, String)> = Vec::new();
        let mut invalid: Vec<(&str, String)> = Vec::new();
        match (akid, secret) {
            (Some(_), None) => missing.push((SECRET_ACCESS_KEY, format!("required when {ACCESS_KEY_ID} is set"))),
            (None, Some(_)) => missing.push((ACCESS_KEY_ID, format!("required when {SECRET_ACCESS_KEY} is set"))),
            _ => {}
        }
        if token.is_some() && akid.is_none() && secret.is_none() {
            missing.push((
                ACCESS_KEY_ID,
                format!("{SESSION_TOKEN} is set without {ACCESS_KEY_ID} and {SECRET_ACCESS_KEY}"),
            ));
        }
        if role.is_none() {
            for key in [EXTERNAL_ID, ROLE_SESSION_NAME] {
                if get(s, key).is_some() {
                    missing.push((ROLE_ARN, format!("required when {key} is set")));
                }
            }
        }
        if role.is_some_and(|r| !is_role_arn(r)) {
            invalid.push((ROLE_ARN, "not an IAM role ARN (arn:aws:iam::<account>:role/<name>)".to_string()));
        }
        if session_name.is_some_and(|n| !is_session_name(n)) {
            invalid.push((ROLE_SESSION_NAME, "2 to 64 characters of letters, digits and +=,.@_-".to_string()));
        }
        if !missing.is_empty() || !invalid.is_empty() {
            let reason = if missing.is_empty() { reason::FIELD_INVALID } else { reason::FIELD_REQUIRED };
            let keys: Vec<String> = missing.iter().chain(&invalid).map(|(k, _)| format!("secrets.{k}")).collect();
            let mut err = DriverError::invalid_argument(
                reason,
                format!("the MachineClass secret does not hold usable AWS credentials: check {}", keys.join(", ")),
            );
            for (key, why) in missing.into_iter().chain(invalid) {
                err = err.with_violation(format!("secrets.{key}"), why);
            }
            return Err(err);
        }

        let keys = match (akid, secret) {
            (Some(a), Some(s)) => Some(StaticKeys {
                access_key_id: a.to_string(),
                secret_access_key: s.to_string(),
                session_token: token.map(str::to_string),
            }),
            _ => None,
        };
        Ok(match (role, keys) {
            (Some(role), source) => ClassCredentials::AssumeRole {
                role_arn: role.to_string(),
                external_id: external_id.map(str::to_string),
                session_name: session_name.map(str::to_string),
                source,
            },
            (None, Some(keys)) => ClassCredentials::Static(keys),
            (None, None) => ClassCredentials::Chain,
        })
    }

    /// Where these credentials come from.
    pub fn source(&self) -> Source {
        match self {
            ClassCredentials::Chain => Source::Chain,
            ClassCredentials::Static(_) => Source::SecretKeys,
            ClassCredentials::AssumeRole { .. } => Source::SecretRole,
        }
    }

    /// Short name of the kind.
    pub fn kind(&self) -> &'static str {
        self.source().kind()
    }

    /// A stable digest of the credential content (the client cache key, safe to log): `chain`
    /// for the default chain, else 16 hex digits of a SHA-256 over the values.
    pub fn fingerprint(&self) -> String {
        let fields: Vec<&str> = match self {
            ClassCredentials::Chain => return "chain".to_string(),
            ClassCredentials::Static(k) => {
                vec!["static", &k.access_key_id, &k.secret_access_key, k.session_token.as_deref().unwrap_or("")]
            }
            ClassCredentials::AssumeRole { role_arn, external_id, session_name, source } => {
                let (a, s, t) = match source {
                    Some(k) => (k.access_key_id.as_str(), k.secret_access_key.as_str(), k.session_token.as_deref()),
                    None => ("", "", None),
                };
                vec![
                    "role",
                    role_arn,
                    external_id.as_deref().unwrap_or(""),
                    session_name.as_deref().unwrap_or(""),
                    a,
                    s,
                    t.unwrap_or(""),
                ]
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

    /// The credentials provider of an EC2 client, `None` for the chain (the client keeps the
    /// SDK configuration's). The EC2 client's identity cache holds what it resolves and
    /// refreshes assumed-role credentials before they expire.
    pub async fn provider(&self, sdk: &SdkConfig) -> Option<SharedCredentialsProvider> {
        match self {
            ClassCredentials::Chain => None,
            ClassCredentials::Static(k) => Some(SharedCredentialsProvider::new(k.credentials())),
            ClassCredentials::AssumeRole { role_arn, external_id, session_name, source } => {
                let mut b = AssumeRoleProvider::builder(role_arn.clone())
                    .configure(sdk)
                    .session_name(session_name.clone().unwrap_or_else(|| DEFAULT_SESSION_NAME.to_string()));
                if let Some(id) = external_id {
                    b = b.external_id(id.clone());
                }
                let provider = match source {
                    Some(k) => b.build_from_provider(k.credentials()).await,
                    None => b.build().await,
                };
                Some(SharedCredentialsProvider::new(provider))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use driver_sdk::tonic::Code;

    fn secrets(kv: &[(&str, &str)]) -> Secrets {
        kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    const ROLE: &str = "arn:aws:iam::123456789012:role/nodes";

    #[test]
    fn the_kinds_follow_the_keys() {
        assert_eq!(ClassCredentials::from_secrets(&Secrets::default()).unwrap(), ClassCredentials::Chain);
        assert_eq!(
            ClassCredentials::from_secrets(&secrets(&[("apiKey", "x"), ("accessKeyId", "")])).unwrap().kind(),
            "chain"
        );
        let c =
            ClassCredentials::from_secrets(&secrets(&[("accessKeyId", "AKIA1"), ("secretAccessKey", "s3cr3t-value")]))
                .unwrap();
        assert_eq!(c.source(), Source::SecretKeys);
        let c = ClassCredentials::from_secrets(&secrets(&[("roleArn", ROLE), ("externalId", "ext-1")])).unwrap();
        assert!(matches!(&c, ClassCredentials::AssumeRole { source: None, external_id: Some(_), .. }));
        let c = ClassCredentials::from_secrets(&secrets(&[
            ("roleArn", ROLE),
            ("accessKeyId", "AKIA1"),
            ("secretAccessKey", "s3cr3t-value"),
            ("roleSessionName", "nodes@eu"),
        ]))
        .unwrap();
        assert!(matches!(&c, ClassCredentials::AssumeRole { source: Some(_), .. }));
    }

    #[test]
    fn bad_combinations_name_the_key_and_never_the_value() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("accessKeyId", "AKIAVALUE")], "secrets.secretAccessKey"),
            (&[("secretAccessKey", "s3cr3t-value")], "secrets.accessKeyId"),
            (&[("sessionToken", "tok-value")], "secrets.accessKeyId"),
            (&[("externalId", "ext-value")], "secrets.roleArn"),
            (&[("roleArn", "not-an-arn-value")], "secrets.roleArn"),
            (&[("roleArn", ROLE), ("roleSessionName", "no spaces value")], "secrets.roleSessionName"),
        ];
        for (kv, field) in cases {
            let err = ClassCredentials::from_secrets(&secrets(kv)).unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument, "{kv:?}");
            assert_eq!(err.violations()[0].field, *field, "{kv:?}");
            let text = format!("{} {:?} {:?}", err.message(), err.violations(), err);
            for (_, v) in kv.iter() {
                assert!(!text.contains(v), "{v} leaked: {text}");
            }
        }
    }

    #[test]
    fn fingerprints_follow_the_content_and_debug_hides_it() {
        let a = secrets(&[("accessKeyId", "AKIAAAAA"), ("secretAccessKey", "s3cr3t-a")]);
        let b = secrets(&[("accessKeyId", "AKIAAAAA"), ("secretAccessKey", "s3cr3t-b")]);
        let ca = ClassCredentials::from_secrets(&a).unwrap();
        let cb = ClassCredentials::from_secrets(&b).unwrap();
        assert_eq!(ca.fingerprint(), ClassCredentials::from_secrets(&a).unwrap().fingerprint());
        assert_ne!(ca.fingerprint(), cb.fingerprint());
        assert_eq!(ca.fingerprint().len(), 16);
        let debug = format!("{ca:?}");
        assert!(!debug.contains("AKIAAAAA") && !debug.contains("s3cr3t"), "{debug}");
    }
}
