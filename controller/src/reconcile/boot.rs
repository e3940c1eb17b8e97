//! Boot data rendered per machine (or pool): the class's `spec.userData` template (else its
//! Secret's `userData` key) with its variables filled in, sent to the driver as the secret
//! `userData` — and the bootstrap token the template's `{{ .BootstrapToken }}` asks for, minted
//! in the target cluster before the machine is created.
//!
//! A token's ID is recorded in the owner's status (and written) before its Secret is created,
//! so a controller killed at any point finds it again and never mints a second one; its secret
//! is read back from the Secret whenever boot data is rendered and goes nowhere but the boot
//! data. Nothing half-rendered is ever sent: a template that cannot be rendered is a condition.

use chrono::{DateTime, Utc};
use driver_sdk::proto as pb;

use super::Resolved;
use crate::app::Ctx;
use crate::nodes::bootstrap::{self, Ensured, Token};
use crate::nodes::Target;
use crate::resources::boot_data::{self, Template, Variable};
use crate::resources::*;
use crate::runtime::ReconcileError;

/// The secrets key drivers take boot data from.
pub(crate) const USER_DATA_KEY: &str = "userData";

/// What rendering the boot data of one machine or pool came to.
pub(crate) enum Boot {
    /// The secrets to send (with `userData` rendered, if the class has boot data).
    Rendered(Option<pb::Secrets>),
    /// A token ID was recorded in the status passed in: write it, then render again.
    TokenRecorded,
    /// The template cannot be rendered: the message says why (a condition, nothing created).
    Unrenderable(String),
}

/// Who boot data is rendered for.
pub(crate) struct Holder<'a> {
    /// The Machine's name; empty for a pool (the cloud names its instances).
    pub(crate) machine_name: &'a str,
    pub(crate) namespace: &'a str,
    /// The [`bootstrap::LABEL_TOKEN_FOR`] value and the token's description.
    pub(crate) label: String,
    pub(crate) description: String,
    pub(crate) node_template: Option<&'a NodeTemplate>,
    /// Its target cluster, when not the default.
    pub(crate) target_cluster: Option<&'a crate::resources::TargetCluster>,
}

impl<'a> Holder<'a> {
    pub(crate) fn machine(m: &'a Machine) -> Self {
        Holder {
            machine_name: &m.metadata.name,
            namespace: &m.metadata.namespace,
            label: format!("{}.{}", m.metadata.namespace, m.metadata.name),
            description: format!("machine-driver: Machine {}/{}", m.metadata.namespace, m.metadata.name),
            node_template: m.spec.node_template.as_ref(),
            target_cluster: m.spec.target_cluster.as_ref(),
        }
    }

    pub(crate) fn pool(p: &'a MachinePool) -> Self {
        Holder {
            machine_name: "",
            namespace: &p.metadata.namespace,
            label: format!("pool.{}.{}", p.metadata.namespace, p.metadata.name),
            description: format!("machine-driver: MachinePool {}/{}", p.metadata.namespace, p.metadata.name),
            node_template: p.spec.template.spec.node_template.as_ref(),
            target_cluster: p.spec.target_cluster.as_ref(),
        }
    }
}

/// The boot data template of a resolved class: `spec.userData`, else the Secret's `userData`.
fn template_text<'r>(r: &'r Resolved<'_>) -> Option<(&'static str, &'r str)> {
    if let Some(t) = &r.class.spec.user_data {
        return Some(("spec.userData", t));
    }
    let t = r.secrets.as_ref()?.data.get(USER_DATA_KEY)?;
    Some(("the userData key of its Secret", t))
}

/// Renders the boot data for `holder`, minting its bootstrap token in `token` (the holder's
/// status field) if the template asks for one.
///
/// # Errors
/// The target cluster's refusals (retried by the caller's error policy).
pub(crate) async fn render(
    ctx: &Ctx,
    r: &Resolved<'_>,
    holder: &Holder<'_>,
    token: &mut Option<BootstrapTokenRef>,
) -> Result<Boot, ReconcileError> {
    let Some((source, text)) = template_text(r) else { return Ok(Boot::Rendered(r.secrets.clone())) };
    let class = &r.class.metadata.name;
    let template = match Template::parse(text) {
        Ok(t) => t,
        Err(e) => return Ok(Boot::Unrenderable(format!("MachineClass {class}: {source}: {e}"))),
    };
    let target = ctx.app.target_of(holder.namespace, holder.target_cluster);
    let target = target.as_deref();
    let needs_target = template.variables().into_iter().find(|v| {
        matches!(
            v,
            Variable::ApiServerUrl
                | Variable::ApiServerHost
                | Variable::CaCertificate
                | Variable::CaCertificateBase64
                | Variable::CaCertHash
                | Variable::BootstrapToken
        )
    });
    if let (Some(v), None) = (needs_target, target) {
        return Ok(Boot::Unrenderable(format!(
            "MachineClass {class}: {source} uses {{{{ {v} }}}}, which needs a target cluster (run --target-kubeconfig, or --store kubernetes)"
        )));
    }
    let token_value = match (target, template.uses(Variable::BootstrapToken)) {
        (Some(target), true) => match ensure(target, holder, token).await? {
            Some(t) => Some(t),
            None => return Ok(Boot::TokenRecorded),
        },
        _ => None,
    };
    let join = target.map(|t| &t.join);
    let ca = join.and_then(|j| j.ca.as_deref());
    let rendered = template.render(|v| -> Result<String, String> {
        let no_ca = || {
            format!("{{{{ {v} }}}} needs the target cluster's CA, and its kubeconfig names none (certificate-authority-data)")
        };
        Ok(match v {
            Variable::MachineName => holder.machine_name.to_string(),
            Variable::MachineNamespace => holder.namespace.to_string(),
            // `needs_target` made sure there is one.
            Variable::ApiServerUrl => join.map(|j| j.api_server_url.clone()).unwrap_or_default(),
            Variable::ApiServerHost => join.map(bootstrap::JoinSettings::api_server_host).unwrap_or_default(),
            Variable::CaCertificate => boot_data::pem(ca.ok_or_else(no_ca)?),
            Variable::CaCertificateBase64 => {
                use base64::Engine;
                base64::engine::general_purpose::STANDARD.encode(boot_data::pem(ca.ok_or_else(no_ca)?))
            }
            Variable::CaCertHash => boot_data::ca_cert_hash(ca.ok_or_else(no_ca)?)?,
            Variable::BootstrapToken => token_value.as_ref().map(Token::value).unwrap_or_default(),
            Variable::NodeLabels => {
                holder.node_template.map(|t| boot_data::node_labels_flag(&t.labels)).unwrap_or_default()
            }
            Variable::NodeTaints => {
                holder.node_template.map(|t| boot_data::node_taints_flag(&t.taints)).unwrap_or_default()
            }
        })
    });
    let rendered = match rendered {
        Ok(text) => text,
        Err(why) => return Ok(Boot::Unrenderable(format!("MachineClass {class}: {source}: {why}"))),
    };
    let mut secrets = r.secrets.clone().unwrap_or_default();
    secrets.data.insert(USER_DATA_KEY.into(), rendered);
    Ok(Boot::Rendered(Some(secrets)))
}

/// The boot data as the driver validates the class with (its size, its form): rendered for a
/// machine whose name and namespace are as long as names go, with a placeholder token of a real
/// token's length and the target's endpoint and CA (a placeholder CA without one); the labels
/// and taints are empty (they are the machines'). `Err` if the template does not parse.
pub(crate) fn sample(ctx: &Ctx, r: &Resolved<'_>) -> Result<Option<pb::Secrets>, String> {
    let Some((source, text)) = template_text(r) else { return Ok(r.secrets.clone()) };
    let template = Template::parse(text).map_err(|e| format!("{source}: {e}"))?;
    // A class serves machines of any target: the default one's endpoint and CA stand for all.
    let default = ctx.app.targets.default_target().map(|c| c.target.clone());
    let join = default.as_deref().map(|t| &t.join);
    // A certificate's PEM is about 1.1 KiB.
    let placeholder_ca = vec![0u8; 800];
    let ca = join.and_then(|j| j.ca.clone()).unwrap_or(placeholder_ca);
    let longest = "x".repeat(63);
    let rendered = template
        .render(|v| -> Result<String, std::convert::Infallible> {
            use base64::Engine;
            Ok(match v {
                Variable::MachineName | Variable::MachineNamespace => longest.clone(),
                Variable::ApiServerUrl => {
                    join.map_or_else(|| "https://api.example.invalid:6443".into(), |j| j.api_server_url.clone())
                }
                Variable::ApiServerHost => {
                    join.map_or_else(|| "api.example.invalid:6443".into(), bootstrap::JoinSettings::api_server_host)
                }
                Variable::CaCertificate => boot_data::pem(&ca),
                Variable::CaCertificateBase64 => base64::engine::general_purpose::STANDARD.encode(boot_data::pem(&ca)),
                Variable::CaCertHash => format!("sha256:{}", "0".repeat(64)),
                Variable::BootstrapToken => "abcdef.0123456789abcdef".into(),
                Variable::NodeLabels | Variable::NodeTaints => String::new(),
            })
        })
        .unwrap_or_else(|never| match never {});
    let mut secrets = r.secrets.clone().unwrap_or_default();
    secrets.data.insert(USER_DATA_KEY.into(), rendered);
    Ok(Some(secrets))
}

/// The holder's token: `None` after recording a new ID in `recorded` (to be written before the
/// token is created).
async fn ensure(
    target: &Target,
    holder: &Holder<'_>,
    recorded: &mut Option<BootstrapTokenRef>,
) -> Result<Option<Token>, ReconcileError> {
    let ttl = chrono::Duration::from_std(target.join.token_ttl).unwrap_or(chrono::Duration::minutes(15));
    let Some(r) = recorded.as_mut() else {
        *recorded = Some(BootstrapTokenRef { id: bootstrap::new_token_id(), expires: Utc::now() + ttl });
        return Ok(None);
    };
    match target.ensure_token(&r.id, &holder.label, &holder.description, Utc::now() + ttl).await? {
        Ensured::Token(token, expires) => {
            r.expires = expires;
            if refresh_due(expires, target) {
                let next = Utc::now() + ttl;
                if target.refresh_token(&r.id, next).await? {
                    r.expires = next;
                }
            }
            Ok(Some(token))
        }
        Ensured::Taken => {
            // Another holder's ID (or not a token): draw another.
            r.id = bootstrap::new_token_id();
            r.expires = Utc::now() + ttl;
            Ok(None)
        }
    }
}

/// Whether a token expiring at `expires` is refreshed now: once half its life is gone.
pub(crate) fn refresh_due(expires: DateTime<Utc>, target: &Target) -> bool {
    let half = chrono::Duration::from_std(target.join.token_ttl / 2).unwrap_or(chrono::Duration::minutes(7));
    expires - Utc::now() < half
}

/// What keeping a recorded token alive found.
pub(crate) enum Kept {
    /// Nothing to do yet.
    Fresh,
    /// Refreshed: `expires` moved (write the status).
    Refreshed,
    /// Its Secret is gone.
    Gone,
}

/// Refreshes a recorded token once half its life is gone.
///
/// # Errors
/// The target cluster's refusal.
pub(crate) async fn keep(target: &Target, token: &mut BootstrapTokenRef) -> Result<Kept, ReconcileError> {
    if !refresh_due(token.expires, target) {
        return Ok(Kept::Fresh);
    }
    let ttl = chrono::Duration::from_std(target.join.token_ttl).unwrap_or(chrono::Duration::minutes(15));
    let next = Utc::now() + ttl;
    if target.refresh_token(&token.id, next).await? {
        token.expires = next;
        Ok(Kept::Refreshed)
    } else {
        Ok(Kept::Gone)
    }
}

/// Deletes a recorded token and forgets it (its Node joined, or its holder is deleted).
///
/// # Errors
/// The target cluster's refusal.
pub(crate) async fn retire(target: &Target, token: &mut Option<BootstrapTokenRef>) -> Result<(), ReconcileError> {
    if let Some(t) = token.as_ref() {
        target.delete_token(&t.id).await?;
        *token = None;
    }
    Ok(())
}
