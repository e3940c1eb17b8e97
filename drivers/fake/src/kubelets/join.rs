//! A kubelet's TLS bootstrap, as a real one does it (cargo feature `join-cluster`): from a VM's
//! boot data only, never from a kubeconfig of the sidecar's.
//!
//! The boot data is cloud-init (`#cloud-config`) whose `write_files` holds the kubelet's
//! bootstrap kubeconfig (a file whose path ends in `bootstrap-kubeconfig`: the API server, its CA
//! and a bootstrap token), and whose kubelet command line may carry `--node-labels=` and
//! `--register-with-taints=` (docs/src/operating/joining-nodes.md). With the bootstrap token the
//! kubelet creates a `CertificateSigningRequest` for `system:node:<name>` in `system:nodes`
//! (signer `kubernetes.io/kube-apiserver-client-kubelet`, a new P-256 key), and once
//! kube-controller-manager approved and signed it, it has its own kubeconfig ([`Credentials`]) and
//! registers its Node with it. A wrong or expired token is refused by the API server: the kubelet
//! never joins (it tries again now and then, as a real one does).

use std::collections::BTreeMap;

use k8s_openapi::api::certificates::v1::{CertificateSigningRequest, CertificateSigningRequestSpec};
use k8s_openapi::api::core::v1::Taint;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::ByteString;
use kube::api::{Api, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde_json::{json, Value};

use super::Credentials;

/// The signer of kubelet client certificates.
pub const KUBELET_SIGNER: &str = "kubernetes.io/kube-apiserver-client-kubelet";

/// What a VM's boot data tells its kubelet. `Debug` leaves the bootstrap kubeconfig out.
#[derive(Default, PartialEq)]
pub struct BootData {
    /// The bootstrap kubeconfig cloud-init writes (YAML; it holds a token: never logged).
    pub bootstrap_kubeconfig: Option<String>,
    /// `--node-labels`: the labels the Node registers with.
    pub labels: BTreeMap<String, String>,
    /// `--register-with-taints`: the taints the Node registers with.
    pub taints: Vec<Taint>,
}

impl std::fmt::Debug for BootData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kubeconfig = self.bootstrap_kubeconfig.as_ref().map(|_| "[REDACTED]");
        f.debug_struct("BootData")
            .field("bootstrap_kubeconfig", &kubeconfig)
            .field("labels", &self.labels)
            .field("taints", &self.taints)
            .finish()
    }
}

impl BootData {
    /// Reads `text`, a VM's boot data. Errors name what is wrong, never the content.
    ///
    /// # Errors
    /// cloud-config that is not YAML, a `write_files` entry that is not a file, a malformed
    /// label or taint.
    pub fn parse(text: &str) -> Result<BootData, String> {
        let mut data = BootData::default();
        if text.trim_start().starts_with("#cloud-config") {
            let doc: Value =
                serde_saphyr::from_str(text).map_err(|_| "the boot data's #cloud-config is not YAML".to_string())?;
            for file in doc.get("write_files").and_then(Value::as_array).into_iter().flatten() {
                let path = file.get("path").and_then(Value::as_str).unwrap_or_default();
                if path.ends_with("bootstrap-kubeconfig") {
                    let content = file
                        .get("content")
                        .and_then(Value::as_str)
                        .ok_or_else(|| format!("write_files {path} has no content"))?;
                    let encoding = file.get("encoding").and_then(Value::as_str).unwrap_or_default();
                    data.bootstrap_kubeconfig = Some(match encoding {
                        "b64" | "base64" => {
                            use base64::Engine as _;
                            let raw = base64::engine::general_purpose::STANDARD
                                .decode(content.trim())
                                .map_err(|_| format!("write_files {path}: content is not base64"))?;
                            String::from_utf8(raw).map_err(|_| format!("write_files {path}: content is not text"))?
                        }
                        _ => content.to_string(),
                    });
                }
            }
        }
        for value in flag_values(text, "--node-labels=") {
            for pair in value.split(',').filter(|p| !p.is_empty()) {
                let (k, v) = pair.split_once('=').ok_or_else(|| format!("--node-labels: {pair:?} is not key=value"))?;
                data.labels.insert(k.to_string(), v.to_string());
            }
        }
        for value in flag_values(text, "--register-with-taints=") {
            for t in value.split(',').filter(|p| !p.is_empty()) {
                data.taints.push(taint(t)?);
            }
        }
        Ok(data)
    }
}

/// The values of flag `flag` (`--name=`) in `text`: up to the next blank, quote, comma-bracket.
fn flag_values<'a>(text: &'a str, flag: &str) -> Vec<&'a str> {
    text.match_indices(flag)
        .map(|(at, _)| {
            let rest = &text[at + flag.len()..];
            let end = rest.find(|c: char| c.is_whitespace() || matches!(c, '"' | '\'' | ']')).unwrap_or(rest.len());
            &rest[..end]
        })
        .collect()
}

/// A taint as `--register-with-taints` takes it: `key[=value]:Effect`.
fn taint(text: &str) -> Result<Taint, String> {
    let (kv, effect) =
        text.rsplit_once(':').ok_or_else(|| format!("--register-with-taints: {text:?} has no :Effect"))?;
    if !matches!(effect, "NoSchedule" | "PreferNoSchedule" | "NoExecute") {
        return Err(format!("--register-with-taints: {text:?}: unknown effect {effect:?}"));
    }
    let (key, value) = match kv.split_once('=') {
        Some((k, v)) => (k, Some(v.to_string())),
        None => (kv, None),
    };
    Ok(Taint { key: key.to_string(), value, effect: effect.to_string(), time_added: None })
}

/// A kubelet's CSR waiting for its certificate.
pub struct Pending {
    /// The CSR's name.
    pub csr: String,
    key_pem: String,
    /// The bootstrap kubeconfig's cluster (server, CA), for the kubelet's own kubeconfig.
    cluster: Value,
    /// The bootstrap client.
    client: kube::Client,
}

/// A client from kubeconfig `text` (its current context), with the kubelets' user agent and
/// call timeouts.
///
/// # Errors
/// Not a usable kubeconfig (the message names no credential).
pub async fn client(text: &str) -> Result<kube::Client, String> {
    let kc = Kubeconfig::from_yaml(text).map_err(|e| format!("not a kubeconfig: {}", first_line(&e.to_string())))?;
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .map_err(|e| format!("not a usable kubeconfig: {}", first_line(&e.to_string())))?;
    super::cluster::call_client(config)
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or_default()
}

/// Starts the TLS bootstrap of the kubelet of Node `node_name`: a new key, and a CSR created
/// with the bootstrap kubeconfig `bootstrap`.
///
/// # Errors
/// An unusable kubeconfig, or the API server refused the CSR (a wrong or expired token: 401).
pub async fn request_certificate(bootstrap: &str, node_name: &str) -> Result<Pending, String> {
    let kc =
        Kubeconfig::from_yaml(bootstrap).map_err(|_| "the bootstrap kubeconfig is not a kubeconfig".to_string())?;
    let context = kc.current_context.as_deref().and_then(|c| kc.contexts.iter().find(|n| n.name == c));
    let cluster_name = context.and_then(|c| c.context.as_ref()).map(|c| c.cluster.clone());
    let cluster = kc
        .clusters
        .iter()
        .find(|c| Some(&c.name) == cluster_name.as_ref())
        .or(kc.clusters.first())
        .and_then(|c| c.cluster.as_ref())
        .ok_or_else(|| "the bootstrap kubeconfig names no cluster".to_string())?;
    let cluster = serde_json::to_value(cluster).map_err(|e| e.to_string())?;
    let client = client(bootstrap).await?;
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(|e| e.to_string())?;
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(|e| e.to_string())?;
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.distinguished_name.push(rcgen::DnType::OrganizationName, "system:nodes");
    params.distinguished_name.push(rcgen::DnType::CommonName, format!("system:node:{node_name}"));
    let request = params.serialize_request(&key).map_err(|e| e.to_string())?.pem().map_err(|e| e.to_string())?;
    let csr = CertificateSigningRequest {
        metadata: ObjectMeta { generate_name: Some("node-csr-".into()), ..ObjectMeta::default() },
        spec: CertificateSigningRequestSpec {
            request: ByteString(request.into_bytes()),
            signer_name: KUBELET_SIGNER.into(),
            usages: Some(vec!["digital signature".into(), "client auth".into()]),
            ..CertificateSigningRequestSpec::default()
        },
        status: None,
    };
    let api = Api::<CertificateSigningRequest>::all(client.clone());
    let created = api.create(&PostParams::default(), &csr).await.map_err(|e| refused(&e))?;
    let name = created.metadata.name.ok_or_else(|| "the CSR came back without a name".to_string())?;
    Ok(Pending { csr: name, key_pem: key.serialize_pem(), cluster, client })
}

/// What an API error says, with a word on the usual cause of a 401.
fn refused(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) if s.code == 401 => {
            "the API server refused the bootstrap token (401: wrong, expired or deleted)".to_string()
        }
        e => e.to_string(),
    }
}

/// Looks at `pending`'s CSR: its certificate, once signed, as the kubelet's kubeconfig; `None`
/// while it is not signed yet.
///
/// # Errors
/// The CSR was denied or failed, is gone, or the API server refused the bootstrap token.
pub async fn poll(pending: &Pending) -> Result<Option<Credentials>, String> {
    let api = Api::<CertificateSigningRequest>::all(pending.client.clone());
    let csr = api
        .get_opt(&pending.csr)
        .await
        .map_err(|e| refused(&e))?
        .ok_or_else(|| format!("CSR {} is gone", pending.csr))?;
    let status = csr.status.unwrap_or_default();
    for c in status.conditions.iter().flatten() {
        if (c.type_ == "Denied" || c.type_ == "Failed") && c.status == "True" {
            return Err(format!("CSR {} {}: {}", pending.csr, c.type_, c.message.as_deref().unwrap_or_default()));
        }
    }
    let Some(cert) = status.certificate.filter(|c| !c.0.is_empty()) else { return Ok(None) };
    use base64::Engine as _;
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let kubeconfig = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "default-cluster", "cluster": pending.cluster}],
        "users": [{"name": "default-auth", "user": {
            "client-certificate-data": b64(&cert.0),
            "client-key-data": b64(pending.key_pem.as_bytes()),
        }}],
        "contexts": [{"name": "default-context", "context": {"cluster": "default-cluster", "user": "default-auth"}}],
        "current-context": "default-context",
    });
    Ok(Some(Credentials { kubeconfig: serde_json::to_string_pretty(&kubeconfig).map_err(|e| e.to_string())? }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLOUD_INIT: &str = r#"#cloud-config
write_files:
- path: /var/lib/kubelet/bootstrap-kubeconfig
  permissions: "0600"
  content: |
    apiVersion: v1
    kind: Config
    clusters:
    - name: cluster
      cluster: {server: "https://127.0.0.1:6443", certificate-authority-data: Zm9v}
    users:
    - name: kubelet-bootstrap
      user: {token: abcdef.0123456789abcdef}
    contexts:
    - name: bootstrap
      context: {cluster: cluster, user: kubelet-bootstrap}
    current-context: bootstrap
runcmd:
- [kubelet, --bootstrap-kubeconfig=/var/lib/kubelet/bootstrap-kubeconfig, "--node-labels=a.example/x=1,role=web", "--register-with-taints=dedicated=web:NoSchedule,spot:NoExecute"]
"#;

    #[test]
    fn cloud_init_gives_the_bootstrap_kubeconfig_labels_and_taints() {
        let d = BootData::parse(CLOUD_INIT).unwrap();
        let kc = d.bootstrap_kubeconfig.unwrap();
        assert!(kc.contains("token: abcdef.0123456789abcdef") && kc.starts_with("apiVersion: v1\n"), "{kc}");
        assert_eq!(d.labels, BTreeMap::from([("a.example/x".into(), "1".into()), ("role".into(), "web".into())]));
        assert_eq!(d.taints.len(), 2);
        assert_eq!((d.taints[0].key.as_str(), d.taints[0].value.as_deref()), ("dedicated", Some("web")));
        assert_eq!((d.taints[1].key.as_str(), d.taints[1].effect.as_str()), ("spot", "NoExecute"));
    }

    #[test]
    fn empty_flags_and_plain_scripts_register_nothing_extra() {
        let d = BootData::parse("#!/bin/sh\nkubelet --node-labels= --register-with-taints=\n").unwrap();
        assert_eq!(d, BootData::default());
    }

    #[test]
    fn bad_boot_data_is_named_without_its_content() {
        let e = BootData::parse("#cloud-config\nwrite_files: [\n  token: s3cr3t-token\n").unwrap_err();
        assert!(!e.contains("s3cr3t"), "{e}");
        let e = BootData::parse("kubelet --register-with-taints=a=b:Sometimes").unwrap_err();
        assert!(e.contains("unknown effect"), "{e}");
    }
}
