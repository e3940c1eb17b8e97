//! Key parsing, caching and refresh, and real token flows against the ARM emulator's Entra
//! token endpoint.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use arm_emulator::{Config as EmuConfig, Emulator, Principal};
use azure_core::auth::Secret;
use azure_core::Method;
use driver_sdk::tonic::Code;
use serde_json::Value;
use tokio::sync::oneshot;
use tokio::time::timeout;

use super::*;
use crate::arm::{ArmClient, ArmConfig, ArmError};
use crate::credential::{self, CredentialKind};
use crate::errors::to_driver_error;

const TENANT: &str = "72f988bf-86f1-41af-91ab-2d7cd011db47";
const CLIENT: &str = "0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0";
const SUB: &str = "00000000-0000-0000-0000-0000000000c1";
const SECRET: &str = "Q~s3cr3t-value.of-the-class";
const VMSS: &str = "/subscriptions/00000000-0000-0000-0000-0000000000c1/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/pool";
const LIMIT: Duration = Duration::from_secs(10);

fn secrets(kv: &[(&str, &str)]) -> Secrets {
    kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn sp() -> Vec<(&'static str, &'static str)> {
    vec![("tenantId", TENANT), ("clientId", CLIENT), ("clientSecret", SECRET)]
}

fn static_default() -> Arc<dyn TokenCredential> {
    credential::build(CredentialKind::StaticToken, Some("sidecar-default-token"), None).unwrap()
}

// ---- key parsing -------------------------------------------------------------------------

#[test]
fn the_kinds_follow_the_keys() {
    let parse = |kv: &[(&str, &str)]| ClassCredential::from_secrets(&secrets(kv)).unwrap();
    assert_eq!(parse(&[]), ClassCredential::default_credential());
    let c = parse(&[("apiKey", "x"), ("clientSecret", " "), ("tenantId", "")]);
    assert!(c.is_default() && c.subscription_id().is_none(), "empty values count as absent");
    let c = parse(&[("subscriptionId", SUB)]);
    assert_eq!((c.source(), c.subscription_id()), (Source::Default, Some(SUB)));

    let c = parse(&sp());
    assert_eq!((c.source(), c.kind(), c.subscription_id()), (Source::ClientSecret, "clientSecret", None));
    let c = parse(&[
        ("tenantId", "contoso.onmicrosoft.com"),
        ("clientId", CLIENT),
        ("federatedTokenFile", "/var/run/secrets/azure/tokens/azure-identity-token"),
        ("subscriptionId", SUB),
    ]);
    assert_eq!((c.source(), c.subscription_id()), (Source::WorkloadIdentity, Some(SUB)));
    // An empty clientSecret next to a token file is no conflict.
    let c = parse(&[("tenantId", TENANT), ("clientId", CLIENT), ("clientSecret", ""), ("federatedTokenFile", "/t")]);
    assert_eq!(c.source(), Source::WorkloadIdentity);
}

#[test]
fn machine_controller_manager_and_gardener_spellings_are_aliases() {
    let canonical = ClassCredential::from_secrets(&secrets(&[
        ("tenantId", TENANT),
        ("clientId", CLIENT),
        ("clientSecret", SECRET),
        ("subscriptionId", SUB),
    ]))
    .unwrap();
    let mcm = ClassCredential::from_secrets(&secrets(&[
        ("azureTenantId", TENANT),
        ("azureClientId", CLIENT),
        ("azureClientSecret", SECRET),
        ("azureSubscriptionId", SUB),
    ]))
    .unwrap();
    let gardener = ClassCredential::from_secrets(&secrets(&[
        ("tenantID", TENANT),
        ("clientID", CLIENT),
        ("clientSecret", SECRET),
        ("subscriptionID", SUB),
    ]))
    .unwrap();
    assert_eq!(canonical, mcm);
    assert_eq!(canonical, gardener);
    assert_eq!(canonical.fingerprint(), mcm.fingerprint());
    // Two spellings with the same value are fine.
    let both = ClassCredential::from_secrets(&secrets(&[
        ("tenantId", TENANT),
        ("azureTenantId", TENANT),
        ("clientId", CLIENT),
        ("clientSecret", SECRET),
    ]))
    .unwrap();
    assert_eq!(both.source(), Source::ClientSecret);
}

/// Secrets, the reason they are refused with, and keys the violations must name.
type BadCase = (Vec<(&'static str, &'static str)>, &'static str, &'static [&'static str]);

#[test]
fn bad_combinations_name_the_keys_and_never_the_values() {
    let file = "/var/run/secrets/tok";
    let other_guid = "99999999-9999-9999-9999-999999999999";
    let cases: Vec<BadCase> = vec![
        (vec![("clientSecret", SECRET)], reason::FIELD_REQUIRED, &["secrets.tenantId", "secrets.clientId"]),
        (vec![("tenantId", TENANT), ("clientSecret", SECRET)], reason::FIELD_REQUIRED, &["secrets.clientId"]),
        (vec![("azureClientSecret", SECRET), ("azureClientId", CLIENT)], reason::FIELD_REQUIRED, &["secrets.tenantId"]),
        (vec![("tenantId", TENANT), ("clientId", CLIENT)], reason::FIELD_REQUIRED, &["secrets.clientSecret"]),
        (vec![("clientId", CLIENT)], reason::FIELD_REQUIRED, &["secrets.tenantId", "secrets.clientSecret"]),
        (vec![("federatedTokenFile", file)], reason::FIELD_REQUIRED, &["secrets.tenantId", "secrets.clientId"]),
        (
            vec![("tenantId", TENANT), ("clientId", CLIENT), ("clientSecret", SECRET), ("federatedTokenFile", file)],
            reason::FIELD_INVALID,
            &["secrets.clientSecret", "secrets.federatedTokenFile"],
        ),
        (
            vec![
                ("tenantId", TENANT),
                ("clientId", CLIENT),
                ("clientSecret", SECRET),
                ("azureClientSecret", "other-s3cr3t"),
            ],
            reason::FIELD_INVALID,
            &["secrets.azureClientSecret"],
        ),
        (
            vec![("tenantId", TENANT), ("clientId", "not-a-guid-value"), ("clientSecret", SECRET)],
            reason::FIELD_INVALID,
            &["secrets.clientId"],
        ),
        (
            vec![("tenantId", "bad/tenant/../value"), ("clientId", CLIENT), ("clientSecret", SECRET)],
            reason::FIELD_INVALID,
            &["secrets.tenantId"],
        ),
        (vec![("subscriptionId", "my-subscription-value")], reason::FIELD_INVALID, &["secrets.subscriptionId"]),
        (
            vec![("tenantId", TENANT), ("clientId", CLIENT), ("federatedTokenFile", "relative/token-path")],
            reason::FIELD_INVALID,
            &["secrets.federatedTokenFile"],
        ),
        (
            vec![("tenantId", TENANT), ("clientId", CLIENT), ("federatedTokenFile", "/var/run/../../etc/shadow")],
            reason::FIELD_INVALID,
            &["secrets.federatedTokenFile"],
        ),
        (
            vec![("subscriptionId", SUB), ("azureSubscriptionId", other_guid)],
            reason::FIELD_INVALID,
            &["secrets.azureSubscriptionId"],
        ),
    ];
    for (kv, why, fields) in cases {
        let err = ClassCredential::from_secrets(&secrets(&kv)).unwrap_err();
        assert_eq!((err.code(), err.reason()), (Code::InvalidArgument, why), "{kv:?}: {err:?}");
        let got: Vec<&str> = err.violations().iter().map(|v| v.field.as_str()).collect();
        for f in fields {
            assert!(got.contains(f), "{kv:?}: {f} not in {got:?}");
            assert!(err.message().contains(f), "{kv:?}: {f} not in {}", err.message());
        }
        let text = format!("{} {:?} {:?}", err.message(), err.violations(), err);
        for (_, v) in &kv {
            assert!(!text.contains(v), "{v} leaked: {text}");
        }
    }
}

#[test]
fn fingerprints_follow_the_content_and_debug_hides_it() {
    let a = ClassCredential::from_secrets(&secrets(&sp())).unwrap();
    let mut changed = sp();
    changed[2].1 = "another-s3cr3t";
    let b = ClassCredential::from_secrets(&secrets(&changed)).unwrap();
    assert_eq!(a.fingerprint(), ClassCredential::from_secrets(&secrets(&sp())).unwrap().fingerprint());
    assert_ne!(a.fingerprint(), b.fingerprint());
    assert_eq!(a.fingerprint().len(), 16);
    assert_eq!(ClassCredential::default_credential().fingerprint(), "default");
    // The subscription is not part of the identity.
    let mut with_sub = sp();
    with_sub.push(("subscriptionId", SUB));
    assert_eq!(ClassCredential::from_secrets(&secrets(&with_sub)).unwrap().fingerprint(), a.fingerprint());

    let debug = format!("{a:?} {:?}", ClassCredential::from_secrets(&secrets(&with_sub)).unwrap());
    for v in [TENANT, CLIENT, SECRET, SUB] {
        assert!(!debug.contains(v), "{v} in {debug}");
    }
    assert!(debug.contains("clientSecret") && debug.contains(&a.fingerprint()), "{debug}");
}

// ---- the cache ---------------------------------------------------------------------------

fn creds() -> ClassCredentials {
    ClassCredentials::new(static_default(), Url::parse("http://127.0.0.1:9").unwrap())
}

#[test]
fn the_same_content_gets_the_same_credential_and_new_content_a_new_one() {
    let c = creds();
    let (default, sub) = c.credential_for(&secrets(&[("subscriptionId", SUB)])).unwrap();
    assert!(Arc::ptr_eq(&default, c.default_credential()));
    assert_eq!(sub.as_deref(), Some(SUB));

    let (a, sub) = c.credential_for(&secrets(&sp())).unwrap();
    assert_eq!(sub, None);
    let (again, _) = c.credential_for(&secrets(&sp())).unwrap();
    assert!(Arc::ptr_eq(&a, &again));
    // Same identity in MCM spelling, other subscription: still the same credential (and tokens).
    let (mcm, sub) = c
        .credential_for(&secrets(&[
            ("azureTenantId", TENANT),
            ("azureClientId", CLIENT),
            ("azureClientSecret", SECRET),
            ("azureSubscriptionId", SUB),
        ]))
        .unwrap();
    assert!(Arc::ptr_eq(&a, &mcm));
    assert_eq!(sub.as_deref(), Some(SUB));

    let mut rotated = sp();
    rotated[2].1 = "rotated-s3cr3t";
    let (b, _) = c.credential_for(&secrets(&rotated)).unwrap();
    assert!(!Arc::ptr_eq(&a, &b));
    assert_eq!(c.cached(), 2);
    assert!(c.credential_for(&secrets(&[("clientSecret", SECRET)])).is_err());
    let debug = format!("{c:?} {a:?}");
    assert!(!debug.contains(SECRET) && !debug.contains(CLIENT), "{debug}");
}

#[test]
fn idle_and_excess_entries_are_dropped() {
    let c = creds();
    let class = |n: usize| {
        ClassCredential::from_secrets(&secrets(&[
            ("tenantId", TENANT),
            ("clientId", CLIENT),
            ("clientSecret", &format!("secret-{n}")),
        ]))
        .unwrap()
    };
    let start = Instant::now();
    let first = c.credential_at(&class(0), start);
    // Used again within the hour: kept.
    let later = start + IDLE_EVICTION / 2;
    assert!(Arc::ptr_eq(&first, &c.credential_at(&class(0), later)));
    // Unused for an hour: gone at the next lookup, and rebuilt when asked for.
    let idle = later + IDLE_EVICTION;
    let other = c.credential_at(&class(1), idle);
    assert_eq!(c.cached(), 1);
    assert!(!Arc::ptr_eq(&first, &c.credential_at(&class(0), idle)));
    assert_eq!(c.cached(), 2);

    // Never more than MAX_CACHED: the least recently used goes first.
    for n in 2..MAX_CACHED + 10 {
        c.credential_at(&class(n), idle + Duration::from_millis(n as u64));
    }
    assert_eq!(c.cached(), MAX_CACHED);
    let newest = c.credential_at(&class(MAX_CACHED + 9), idle + Duration::from_secs(60));
    assert_eq!(c.cached(), MAX_CACHED);
    assert!(Arc::ptr_eq(&newest, &c.credential_at(&class(MAX_CACHED + 9), idle + Duration::from_secs(61))));
    assert!(!Arc::ptr_eq(&other, &c.credential_at(&class(1), idle + Duration::from_secs(62))));
}

// ---- token refresh -------------------------------------------------------------------------

/// Hands out tokens valid for `lifetime`, or fails when `fail` is set; counts requests.
#[derive(Debug)]
struct Counting {
    lifetime: Duration,
    fail: std::sync::atomic::AtomicBool,
    calls: AtomicUsize,
}

#[async_trait::async_trait]
impl TokenCredential for Counting {
    async fn get_token(&self, _scopes: &[&str]) -> azure_core::Result<AccessToken> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if self.fail.load(Ordering::SeqCst) {
            return Err(azure_core::Error::message(ErrorKind::Credential, "refused"));
        }
        Ok(AccessToken::new(Secret::new(format!("token-{n}")), OffsetDateTime::now_utc() + self.lifetime))
    }

    async fn clear_cache(&self) -> azure_core::Result<()> {
        Ok(())
    }
}

fn counting(lifetime: Duration) -> (Arc<Counting>, ClassToken) {
    let inner = Arc::new(Counting { lifetime, fail: false.into(), calls: AtomicUsize::new(0) });
    let recorder = Arc::new(EntraRecorder::new(azure_core::new_http_client()));
    (inner.clone(), ClassToken::new(Source::ClientSecret, "fp".into(), inner, recorder))
}

async fn token_of(c: &ClassToken) -> azure_core::Result<String> {
    timeout(LIMIT, c.get_token(&["s/.default"])).await.unwrap().map(|t| t.token.secret().to_string())
}

#[tokio::test]
async fn tokens_are_reused_until_five_minutes_before_they_expire() {
    let (inner, c) = counting(Duration::from_secs(3600));
    assert_eq!(token_of(&c).await.unwrap(), "token-1");
    assert_eq!(token_of(&c).await.unwrap(), "token-1");
    assert_eq!(inner.calls.load(Ordering::SeqCst), 1);

    // A token with less than 5 minutes left is replaced at every use.
    let (inner, c) = counting(Duration::from_secs(240));
    assert_eq!(token_of(&c).await.unwrap(), "token-1");
    assert_eq!(token_of(&c).await.unwrap(), "token-2");
    assert_eq!(inner.calls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_failed_refresh_keeps_a_still_valid_token_and_fails_without_one() {
    // 4 minutes: due for refresh, still valid.
    let (inner, c) = counting(Duration::from_secs(240));
    assert_eq!(token_of(&c).await.unwrap(), "token-1");
    inner.fail.store(true, Ordering::SeqCst);
    assert_eq!(token_of(&c).await.unwrap(), "token-1");
    assert_eq!(inner.calls.load(Ordering::SeqCst), 2, "the refresh was attempted");

    // Already expired: the failure is the caller's, as a ClassTokenError.
    let (inner, c) = counting(Duration::ZERO);
    assert_eq!(token_of(&c).await.unwrap(), "token-1");
    inner.fail.store(true, Ordering::SeqCst);
    let err = token_of(&c).await.unwrap_err();
    let class = err.downcast_ref::<ClassTokenError>().expect("a ClassTokenError");
    assert_eq!(class.credential_source(), Source::ClientSecret);
    assert!(class.answer().is_none());
}

// ---- against the emulator's Entra token endpoint -----------------------------------------------

/// An ARM emulator on 127.0.0.1, stopped when dropped.
struct Emu {
    url: String,
    _stop: oneshot::Sender<()>,
}

async fn emulator(principals: Vec<Principal>, token_lifetime: Duration) -> Emu {
    let emu = Emulator::new(EmuConfig { principals, token_lifetime, ..EmuConfig::default() });
    let (addr, server) = timeout(LIMIT, emu.bind("127.0.0.1:0".parse().unwrap())).await.unwrap().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        tokio::select! {
            _ = server => {}
            _ = stopped => {}
        }
    });
    Emu { url: format!("http://{addr}"), _stop: stop }
}

impl Emu {
    /// Class credentials whose authority host is this emulator.
    fn creds(&self) -> ClassCredentials {
        ClassCredentials::new(static_default(), Url::parse(&self.url).unwrap())
    }

    /// An ARM client on this emulator, with the sidecar's (fixed-token) default credential.
    fn arm(&self) -> ArmClient {
        ArmClient::new(
            ArmConfig {
                endpoint: Url::parse(&self.url).unwrap(),
                scopes: vec![format!("{}/.default", self.url)],
                request_timeout: LIMIT,
                max_retries: 0,
            },
            static_default(),
        )
    }

    async fn admin(&self, path: &str) -> Value {
        let req = azure_core::Request::new(Url::parse(&format!("{}{path}", self.url)).unwrap(), Method::Get);
        let http = azure_core::new_http_client();
        let resp = timeout(LIMIT, http.execute_request(&req)).await.unwrap().unwrap();
        let body = timeout(LIMIT, resp.into_body().collect()).await.unwrap().unwrap();
        serde_json::from_slice(&body).unwrap()
    }

    async fn put_principals(&self, list: Value) {
        let mut req =
            azure_core::Request::new(Url::parse(&format!("{}/_emulator/principals", self.url)).unwrap(), Method::Put);
        req.insert_header("content-type", "application/json");
        req.set_body(list.to_string());
        let resp = timeout(LIMIT, azure_core::new_http_client().execute_request(&req)).await.unwrap().unwrap();
        assert_eq!(resp.status() as u16, 200);
    }

    /// `GET` of a scale set through `arm` (404: the emulated cloud is empty).
    async fn get(&self, arm: &ArmClient) -> Result<u16, ArmError> {
        let url = arm.url(VMSS, &[]).unwrap();
        timeout(LIMIT, arm.send(Method::Get, url, None, "class-credential-test", Some(LIMIT)))
            .await
            .unwrap()
            .map(|r| r.status)
    }

    async fn principals_seen(&self) -> Vec<(u64, Value)> {
        let log = self.admin("/_emulator/requests").await;
        log.as_array().unwrap().iter().map(|r| (r["status"].as_u64().unwrap(), r["principal"].clone())).collect()
    }
}

fn principal(secret: &str) -> Principal {
    Principal::parse(&format!("{TENANT}:{CLIENT}:{secret}"), false).unwrap()
}

#[tokio::test]
async fn a_client_secret_gets_a_token_from_entra_and_arm_sees_its_principal() {
    let emu = emulator(vec![principal(SECRET)], Duration::from_secs(3600)).await;
    let creds = emu.creds();
    let (cred, _) = creds.credential_for(&secrets(&sp())).unwrap();
    let arm = emu.arm().with_credential(cred);
    assert_eq!(emu.get(&arm).await.unwrap(), 404);
    // The same secret content, another call: the same credential and its cached token.
    let (again, _) = creds.credential_for(&secrets(&sp())).unwrap();
    assert_eq!(emu.get(&emu.arm().with_credential(again)).await.unwrap(), 404);
    // The sidecar's client is untouched: its fixed token, no principal.
    assert_eq!(emu.get(&emu.arm()).await.unwrap(), 404);

    let me = Value::from(format!("{TENANT}/{CLIENT}"));
    assert_eq!(emu.principals_seen().await, [(404, me.clone()), (404, me), (404, Value::Null)]);
    let issued = emu.admin("/_emulator/tokens").await;
    assert_eq!(issued.as_array().unwrap().len(), 1, "{issued}");
    assert_eq!(issued[0]["credential"], "clientSecret");
}

#[tokio::test]
async fn a_wrong_secret_is_permission_denied_naming_the_kind_never_the_value() {
    let emu = emulator(vec![principal("the-registered-secret")], Duration::from_secs(3600)).await;
    let (cred, _) = emu.creds().credential_for(&secrets(&sp())).unwrap();
    let err = emu.get(&emu.arm().with_credential(cred)).await.unwrap_err();
    assert!(matches!(err, ArmError::Credential(_)), "{err:?}");
    let d = to_driver_error(err, reason::POOL_NOT_FOUND);
    assert_eq!((d.code(), d.reason()), (Code::PermissionDenied, reason::CLOUD_AUTH_FAILED), "{d:?}");
    let m = d.message();
    assert!(m.contains("client secret of the MachineClass secret"), "{m}");
    assert!(m.contains("invalid_client") && m.contains("AADSTS7000215") && m.contains("invalid client secret"), "{m}");
    assert!(!m.contains(TENANT) && !m.contains(CLIENT), "{m}");
    let meta = d.metadata();
    assert_eq!(meta.get("azureCredential").map(String::as_str), Some("clientSecret"));
    assert_eq!(meta.get("aadError").map(String::as_str), Some("invalid_client"));
    assert_eq!(meta.get("aadErrorCode").map(String::as_str), Some("AADSTS7000215"));
    assert_eq!(d.cloud_request_ids().len(), 1, "Entra's trace ID: {d:?}");
    let everything = format!("{d:?} {:?}", d.causes());
    assert!(!everything.contains(SECRET), "{everything}");
    // Refused before ARM: nothing reached it.
    assert!(emu.principals_seen().await.is_empty());

    // An unknown application: refused too, with its own code.
    emu.put_principals(serde_json::json!([{"tenantId": TENANT, "clientId": "11111111-2222-3333-4444-555555555555", "clientSecret": SECRET}])).await;
    let (cred, _) = emu.creds().credential_for(&secrets(&sp())).unwrap();
    let d = to_driver_error(emu.get(&emu.arm().with_credential(cred)).await.unwrap_err(), "");
    assert_eq!(
        (d.code(), d.metadata().get("aadErrorCode").map(String::as_str)),
        (Code::PermissionDenied, Some("AADSTS700016"))
    );
}

#[tokio::test]
async fn an_unreachable_entra_is_unavailable_and_the_default_credential_is_named() {
    // A port nobody listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let emu = emulator(vec![], Duration::from_secs(3600)).await;
    let creds = ClassCredentials::new(static_default(), Url::parse(&format!("http://{closed}")).unwrap());
    let (cred, _) = creds.credential_for(&secrets(&sp())).unwrap();
    let d = to_driver_error(emu.get(&emu.arm().with_credential(cred)).await.unwrap_err(), "");
    assert_eq!((d.code(), d.reason()), (Code::Unavailable, reason::CLOUD_UNAVAILABLE), "{d:?}");
    assert!(d.message().contains("could not be reached") && d.message().contains("client secret"), "{d:?}");

    // Any other credential failure is the sidecar's default credential's.
    let d = crate::errors::credential_error(azure_core::Error::message(ErrorKind::Credential, "no identity"));
    assert_eq!((d.code(), d.reason()), (Code::PermissionDenied, reason::CLOUD_AUTH_FAILED));
    assert!(d.message().contains("default Azure credential"), "{}", d.message());
    assert_eq!(d.metadata().get("azureCredential").map(String::as_str), Some("default"));
}

#[tokio::test]
async fn an_expired_token_is_replaced_not_sent() {
    let emu = emulator(vec![principal(SECRET)], Duration::from_secs(2)).await;
    let (cred, _) = emu.creds().credential_for(&secrets(&sp())).unwrap();
    let arm = emu.arm().with_credential(cred);
    assert_eq!(emu.get(&arm).await.unwrap(), 404);

    // Wait until the emulator says the first token has expired.
    let deadline = tokio::time::Instant::now() + LIMIT;
    while emu.admin("/_emulator/tokens").await[0]["expired"] != Value::Bool(true) {
        assert!(tokio::time::Instant::now() < deadline, "the token never expired");
        // Deliberate: the token's lifetime has to pass on the emulator's clock; polled, bounded.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(emu.get(&arm).await.unwrap(), 404, "a fresh token, not the expired one");
    let issued = emu.admin("/_emulator/tokens").await;
    assert_eq!(issued.as_array().unwrap().len(), 2, "{issued}");
    let me = Value::from(format!("{TENANT}/{CLIENT}"));
    assert_eq!(emu.principals_seen().await, [(404, me.clone()), (404, me)]);
}

#[tokio::test]
async fn workload_identity_presents_the_token_file_read_at_each_refresh() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("azure-identity-token");
    std::fs::write(&file, "eyJhbGciOiJSUzI1NiJ9.first-projection.sig\n").unwrap();
    let federated =
        |token: &str| serde_json::json!([{"tenantId": TENANT, "clientId": CLIENT, "federatedToken": token}]);
    // Tokens shorter than the 5-minute margin: every call asks Entra, so rereads the file; and
    // shorter than the 30 s a refused refresh may still use the current token for.
    let emu = emulator(vec![], Duration::from_secs(20)).await;
    emu.put_principals(federated("eyJhbGciOiJSUzI1NiJ9.first-projection.sig")).await;
    let path = file.to_str().unwrap();
    let kv = [("tenantId", TENANT), ("clientId", CLIENT), ("federatedTokenFile", path)];
    let (cred, _) = emu.creds().credential_for(&secrets(&kv)).unwrap();
    let arm = emu.arm().with_credential(cred);
    assert_eq!(emu.get(&arm).await.unwrap(), 404);

    // The kubelet rotates the projected token; Entra now trusts only the new one.
    std::fs::write(&file, "eyJhbGciOiJSUzI1NiJ9.second-projection.sig").unwrap();
    emu.put_principals(federated("eyJhbGciOiJSUzI1NiJ9.second-projection.sig")).await;
    assert_eq!(emu.get(&arm).await.unwrap(), 404);
    let issued = emu.admin("/_emulator/tokens").await;
    assert_eq!(issued.as_array().unwrap().len(), 2, "{issued}");
    assert_eq!(issued[1]["credential"], "clientAssertion");

    // A token Entra does not trust: refused, naming workload identity.
    std::fs::write(&file, "eyJhbGciOiJSUzI1NiJ9.forged.sig").unwrap();
    let d = to_driver_error(emu.get(&arm).await.unwrap_err(), "");
    assert_eq!(
        (d.code(), d.metadata().get("aadErrorCode").map(String::as_str)),
        (Code::PermissionDenied, Some("AADSTS70021"))
    );
    assert!(d.message().contains("workload identity"), "{}", d.message());
    // No file: refused too, and the message names the kind without the path.
    std::fs::remove_file(&file).unwrap();
    let d = to_driver_error(emu.get(&arm).await.unwrap_err(), "");
    assert_eq!(d.code(), Code::PermissionDenied);
    assert!(d.message().contains("workload identity") && !d.message().contains(path), "{}", d.message());
    assert!(d.causes().iter().any(|c| c.contains("federated token file")), "{:?}", d.causes());
}
