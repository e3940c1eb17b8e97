//! `MachineClass`: which driver, with which provider spec and credentials, machines are created
//! with.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::checks::{self, Check};
use super::kind::{Column, ColumnType, KindInfo, Via};
use super::meta::{is_default, KindOf, Object};
use super::state::ConditionType;
use super::status::{condition_cell, Condition};
use super::template::NameRef;
use crate::registry::Kind;

/// Which driver, with which provider spec and credentials.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MachineClassSpec {
    /// Driver name, as registered with `run --driver NAME=ENDPOINT`.
    #[schemars(length(min = 1))]
    pub driver: String,
    /// Cloud-specific spec (checked by the driver's schema).
    pub provider_spec: Value,
    /// Secret with the cloud credentials, sent to the driver as secrets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<NameRef>,
    /// What one machine of the class offers the scheduler (cpu, memory, pods, …): the node the
    /// cluster-autoscaler expects a new machine to bring, so an autoscaled group can grow from
    /// zero.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<super::autoscaling::Capacity>,
    /// The machines' boot data (cloud-init, a shell script, …), rendered per machine and sent to
    /// the driver as the secret `userData`: a template whose `{{ .Variable }}`s are filled in
    /// (the machine's name, the target cluster's API server and CA, a bootstrap token minted
    /// for the machine, the Node's labels and taints). Without it, a `userData` key of the
    /// Secret is rendered the same way. See the book's "Joining nodes". At most 48 KiB: what
    /// Azure's 64 KiB of base64 holds (AWS takes 16 KiB; the driver checks the rendered size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 49152))]
    pub user_data: Option<String>,
}

/// What the controller found out about a class.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineClassStatus {
    /// The generation last validated by the driver.
    #[serde(default, skip_serializing_if = "is_default")]
    pub validated_generation: i64,
    /// Conditions (`Valid`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// What one machine of the class offers, as the driver reported it when it validated the
    /// class (resource name → quantity); `spec.capacity`, when set, wins.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub capacity: std::collections::BTreeMap<String, String>,
}

/// A MachineClass: the driver, provider spec and credentials its machines are created with.
pub type MachineClass = Object<MachineClassSpec, MachineClassStatus>;

impl KindOf for MachineClass {
    const KIND: Kind = Kind::MachineClass;
}

impl KindInfo for MachineClass {
    const PLURAL: &'static str = "machineclasses";
    const SHORT_NAMES: &'static [&'static str] = &["mcl"];
    const ALIASES: &'static [&'static str] = &["mc", "class", "classes"];
    type Spec = MachineClassSpec;
    type Status = MachineClassStatus;
    const COLUMNS: &'static [Column] = &[
        Column::new("Driver", ColumnType::String, ".spec.driver"),
        Column::computed("Valid", |v| condition_cell(v, ConditionType::Valid)),
        Column::age(),
    ];
    // A Secret changes the classes that use it, and so their objects.
    const WOKEN_BY: &'static [(Kind, Via)] = &[(Kind::Secret, Via::SecretRef)];

    fn rules() -> Vec<checks::Rule> {
        vec![checks::Rule::new(
            Kind::MachineClass,
            "spec.userData",
            super::boot_data::cel_rule(),
            "",
            super::boot_data::RULE_MESSAGE,
            |v| v.as_str().is_none_or(|t| super::boot_data::Template::parse(t).is_ok()),
        )]
    }

    fn describe_tail(status: &Value) -> String {
        let Some(capacity) = status.get("capacity").and_then(Value::as_object).filter(|c| !c.is_empty()) else {
            return String::new();
        };
        let items: Vec<String> =
            capacity.iter().map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default())).collect();
        format!("Capacity:     {} (reported by the driver)\n", items.join(", "))
    }

    fn validate(&self) -> Check {
        if self.spec.driver.is_empty() {
            return checks::fail("spec.driver", "is required (the name given to `run --driver NAME=ENDPOINT`)");
        }
        if !self.spec.provider_spec.is_object() {
            return checks::fail(
                "spec.providerSpec",
                format!("must be a mapping, got {}", checks::json_type(&self.spec.provider_spec)),
            );
        }
        if let Some(r) = &self.spec.secret_ref {
            checks::name("spec.secretRef.name", &r.name)?;
        }
        if let Some(c) = &self.spec.capacity {
            c.check()?;
        }
        if let Some(t) = &self.spec.user_data {
            if let Err(e) = super::boot_data::Template::parse(t) {
                return checks::fail("spec.userData", e.to_string());
            }
        }
        Ok(())
    }
}
