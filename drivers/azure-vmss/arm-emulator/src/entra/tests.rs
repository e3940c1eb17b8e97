//! The Entra token endpoint and how ARM requests present its tokens, through the router.

use std::time::Duration;

use axum::body::{to_bytes, Body};
use axum::http::{Request, StatusCode};
use axum::Router;
use serde_json::{json, Value};
use tower::ServiceExt;

use super::{Principal, JWT_BEARER};
use crate::{Config, Emulator, API_VERSION};

const TENANT: &str = "11111111-1111-1111-1111-111111111111";
const CLIENT: &str = "22222222-2222-2222-2222-222222222222";
const SECRET: &str = "right-secret~value";
const SCOPE: &str = "http://arm.test/.default";
const VMSS: &str = "/subscriptions/sub/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/p";

async fn send(router: &Router, method: &str, path: &str, body: Body, headers: &[(&str, &str)]) -> (StatusCode, Value) {
    let mut req = Request::builder().method(method).uri(format!("http://arm.test{path}")).header("host", "arm.test");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = tokio::time::timeout(Duration::from_secs(10), router.clone().oneshot(req.body(body).unwrap()))
        .await
        .unwrap()
        .unwrap();
    let status = resp.status();
    let bytes =
        tokio::time::timeout(Duration::from_secs(10), to_bytes(resp.into_body(), 1 << 20)).await.unwrap().unwrap();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

/// A token request with these form fields (values are form-encoded here).
async fn token(router: &Router, tenant: &str, form: &[(&str, &str)]) -> (StatusCode, Value) {
    let enc = |s: &str| {
        s.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
                b' ' => "+".to_string(),
                _ => format!("%{b:02X}"),
            })
            .collect::<String>()
    };
    let body: Vec<String> = form.iter().map(|(k, v)| format!("{}={}", enc(k), enc(v))).collect();
    send(
        router,
        "POST",
        &format!("/{tenant}/oauth2/v2.0/token"),
        Body::from(body.join("&")),
        &[("content-type", "application/x-www-form-urlencoded")],
    )
    .await
}

fn secret_form<'a>(client: &'a str, secret: &'a str) -> Vec<(&'static str, &'a str)> {
    vec![("grant_type", "client_credentials"), ("client_id", client), ("scope", SCOPE), ("client_secret", secret)]
}

async fn arm_get(router: &Router, bearer: &str) -> StatusCode {
    let auth = format!("Bearer {bearer}");
    send(router, "GET", &format!("{VMSS}?api-version={API_VERSION}"), Body::empty(), &[("authorization", &auth)])
        .await
        .0
}

async fn recorded(router: &Router) -> Vec<Value> {
    send(router, "GET", "/_emulator/requests", Body::empty(), &[]).await.1.as_array().cloned().unwrap_or_default()
}

fn emulator(lifetime: Duration) -> Router {
    Emulator::new(Config {
        principals: vec![Principal::parse(&format!("{TENANT}:{CLIENT}:{SECRET}"), false).unwrap()],
        token_lifetime: lifetime,
        ..Config::default()
    })
    .router()
}

#[tokio::test]
async fn issued_tokens_name_their_principal_and_other_tokens_are_still_accepted() {
    let router = emulator(Duration::from_secs(3600));
    let (status, body) = token(&router, TENANT, &secret_form(CLIENT, SECRET)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!((body["token_type"].as_str(), body["expires_in"].as_u64()), (Some("Bearer"), Some(3600)));
    assert_eq!(body["ext_expires_in"].as_u64(), Some(3600));
    let access = body["access_token"].as_str().unwrap().to_string();

    assert_eq!(arm_get(&router, &access).await, StatusCode::NOT_FOUND);
    assert_eq!(arm_get(&router, "fixed-test-token").await, StatusCode::NOT_FOUND);
    let log = recorded(&router).await;
    assert_eq!(log[0]["principal"], json!(format!("{TENANT}/{CLIENT}")));
    assert_eq!(log[1]["principal"], Value::Null);
    assert_eq!(log[1]["authorized"], json!(true));

    let (_, issued) = send(&router, "GET", "/_emulator/tokens", Body::empty(), &[]).await;
    assert_eq!(issued.as_array().unwrap().len(), 1);
    let t = &issued[0];
    assert_eq!((t["tenantId"].as_str(), t["clientId"].as_str()), (Some(TENANT), Some(CLIENT)));
    assert_eq!((t["grantType"].as_str(), t["credential"].as_str()), (Some("client_credentials"), Some("clientSecret")));
    assert_eq!((t["scope"].as_str(), t["expired"].as_bool()), (Some(SCOPE), Some(false)));
    assert!(t["issuedAt"].is_string() && t["expiresOn"].is_string(), "{t}");
    let text = issued.to_string();
    assert!(!text.contains(&access) && !text.contains(SECRET), "{text}");
}

#[tokio::test]
async fn refusals_have_entras_shape_and_codes() {
    let router = emulator(Duration::from_secs(3600));
    // (tenant, form, status, error, AADSTS code)
    type Case<'a> = (&'a str, Vec<(&'a str, &'a str)>, StatusCode, &'a str, u64);
    let cases: Vec<Case> = vec![
        (TENANT, secret_form(CLIENT, "wrong-secret"), StatusCode::UNAUTHORIZED, "invalid_client", 7000215),
        (
            TENANT,
            secret_form("33333333-3333-3333-3333-333333333333", SECRET),
            StatusCode::BAD_REQUEST,
            "unauthorized_client",
            700016,
        ),
        (
            "44444444-4444-4444-4444-444444444444",
            secret_form(CLIENT, SECRET),
            StatusCode::BAD_REQUEST,
            "invalid_request",
            90002,
        ),
        (
            TENANT,
            vec![("grant_type", "client_credentials"), ("client_id", CLIENT), ("scope", SCOPE)],
            StatusCode::UNAUTHORIZED,
            "invalid_client",
            7000218,
        ),
        (
            TENANT,
            vec![("grant_type", "password"), ("client_id", CLIENT), ("scope", SCOPE)],
            StatusCode::BAD_REQUEST,
            "unsupported_grant_type",
            70003,
        ),
        (
            TENANT,
            vec![
                ("grant_type", "client_credentials"),
                ("client_id", CLIENT),
                ("scope", "user.read"),
                ("client_secret", SECRET),
            ],
            StatusCode::BAD_REQUEST,
            "invalid_scope",
            1002012,
        ),
        (
            TENANT,
            vec![
                ("grant_type", "client_credentials"),
                ("client_id", CLIENT),
                ("scope", SCOPE),
                ("client_assertion_type", JWT_BEARER),
                ("client_assertion", "eyJ.not-registered.sig"),
            ],
            StatusCode::BAD_REQUEST,
            "invalid_request",
            70021,
        ),
    ];
    for (tenant, form, status, error, code) in cases {
        let (got, body) = token(&router, tenant, &form).await;
        assert_eq!((got, body["error"].as_str()), (status, Some(error)), "{form:?}: {body}");
        assert_eq!(body["error_codes"], json!([code]), "{body}");
        let description = body["error_description"].as_str().unwrap();
        assert!(description.starts_with(&format!("AADSTS{code}: ")), "{description}");
        assert!(body["trace_id"].is_string() && body["correlation_id"].is_string() && body["timestamp"].is_string());
    }
    let (_, issued) = send(&router, "GET", "/_emulator/tokens", Body::empty(), &[]).await;
    assert_eq!(issued, json!([]));
}

#[tokio::test]
async fn expired_tokens_are_refused_by_arm() {
    // Zero lifetime: the token is expired as soon as it is issued, no waiting needed.
    let router = emulator(Duration::ZERO);
    let (status, body) = token(&router, TENANT, &secret_form(CLIENT, SECRET)).await;
    assert_eq!((status, body["expires_in"].as_u64()), (StatusCode::OK, Some(0)));
    let access = body["access_token"].as_str().unwrap();
    let (status, body) = send(
        &router,
        "GET",
        &format!("{VMSS}?api-version={API_VERSION}"),
        Body::empty(),
        &[("authorization", &format!("Bearer {access}"))],
    )
    .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::UNAUTHORIZED, Some("ExpiredAuthenticationToken"))
    );
    let log = recorded(&router).await;
    assert_eq!((log[0]["status"].as_u64(), &log[0]["principal"]), (Some(401), &json!(format!("{TENANT}/{CLIENT}"))));
    let (_, issued) = send(&router, "GET", "/_emulator/tokens", Body::empty(), &[]).await;
    assert_eq!(issued[0]["expired"], json!(true));
}

#[tokio::test]
async fn tokens_for_another_resource_are_refused_by_arm() {
    let router = emulator(Duration::from_secs(3600));
    let mut form = secret_form(CLIENT, SECRET);
    form[2] = ("scope", "https://vault.azure.net/.default");
    let (_, body) = token(&router, TENANT, &form).await;
    let access = body["access_token"].as_str().unwrap();
    assert_eq!(arm_get(&router, access).await, StatusCode::UNAUTHORIZED);
    let mut form = secret_form(CLIENT, SECRET);
    form[2] = ("scope", "https://management.azure.com//.default");
    let (_, body) = token(&router, TENANT, &form).await;
    assert_eq!(arm_get(&router, body["access_token"].as_str().unwrap()).await, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn principals_are_replaced_by_the_admin_endpoint_and_never_shown_with_secrets() {
    let router = emulator(Duration::from_secs(3600));
    let federated = "eyJhbGciOiJSUzI1NiJ9.projected-sa-token.sig";
    let list = json!([{"tenantId": TENANT, "clientId": CLIENT, "federatedToken": federated}]);
    let (status, _) = send(
        &router,
        "PUT",
        "/_emulator/principals",
        Body::from(list.to_string()),
        &[("content-type", "application/json")],
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (_, view) = send(&router, "GET", "/_emulator/principals", Body::empty(), &[]).await;
    assert_eq!(view, json!([{"tenantId": TENANT, "clientId": CLIENT, "credentials": ["federatedToken"]}]));

    // The secret of the replaced registration no longer works; the federated token does.
    let (status, _) = token(&router, TENANT, &secret_form(CLIENT, SECRET)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let assertion = [
        ("grant_type", "client_credentials"),
        ("client_id", CLIENT),
        ("scope", SCOPE),
        ("client_assertion_type", JWT_BEARER),
        ("client_assertion", federated),
    ];
    let (status, body) = token(&router, TENANT, &assertion).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (_, issued) = send(&router, "GET", "/_emulator/tokens", Body::empty(), &[]).await;
    assert_eq!(issued[0]["credential"], json!("clientAssertion"));

    let bad = json!([{"tenantId": TENANT, "clientId": CLIENT}]);
    let (status, _) = send(&router, "PUT", "/_emulator/principals", Body::from(bad.to_string()), &[]).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[test]
fn principal_flags_parse_and_debug_hides_secrets() {
    let p = Principal::parse("t:c:se:cr:et", false).unwrap();
    assert_eq!((p.tenant_id.as_str(), p.client_id.as_str(), p.client_secret.as_deref()), ("t", "c", Some("se:cr:et")));
    assert!(!format!("{p:?}").contains("se:cr:et"));
    let p = Principal::parse("t:c:jwt", true).unwrap();
    assert_eq!((p.client_secret, p.federated_token.as_deref()), (None, Some("jwt")));
    assert!(Principal::parse("t:c", false).is_err());
    assert!(Principal::parse("t::s", false).is_err());
}
