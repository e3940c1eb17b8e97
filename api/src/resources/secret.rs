//! `Secret`: credentials that classes reference, in the shape of a Kubernetes `v1/Secret`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::checks::{self, Check};
use super::kind::{Column, KindInfo, Shape};
use super::meta::{ObjectMeta, Resource};
use crate::registry::Kind;

/// Credentials, in the shape of a Kubernetes `v1/Secret` (`stringData`, or base64 `data`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Secret {
    /// `v1`.
    pub api_version: String,
    /// `Secret`.
    pub kind: String,
    /// Name and namespace: a MachineClass's `secretRef` names it, in its own namespace.
    pub metadata: ObjectMeta,
    /// Plain values.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub string_data: BTreeMap<String, String>,
    /// Base64 values.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub data: BTreeMap<String, String>,
    /// `Opaque`.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub secret_type: Option<String>,
}

impl Secret {
    /// All values, decoded.
    pub fn values(&self) -> BTreeMap<String, String> {
        use base64::Engine;
        let mut out: BTreeMap<String, String> = self
            .data
            .iter()
            .filter_map(|(k, v)| {
                let bytes = base64::engine::general_purpose::STANDARD.decode(v).ok()?;
                Some((k.clone(), String::from_utf8(bytes).ok()?))
            })
            .collect();
        out.extend(self.string_data.clone());
        out
    }
}

impl Resource for Secret {
    const KIND: Kind = Kind::Secret;

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl KindInfo for Secret {
    const API_VERSION: &'static str = "v1";
    const PLURAL: &'static str = "secrets";
    const SHAPE: Shape = Shape::SecretData;
    const CRD: bool = false;
    type Spec = ();
    type Status = ();
    const COLUMNS: &'static [Column] = &[
        Column::computed("Keys", |v| {
            let keys: usize =
                ["data", "stringData"].iter().filter_map(|f| v.get(*f)?.as_object()).map(|o| o.len()).sum();
            keys.to_string()
        }),
        Column::age(),
    ];

    fn validate(&self) -> Check {
        if self.secret_type.as_deref().is_some_and(|t| t != "Opaque") {
            return checks::fail("type", "only Opaque secrets are supported");
        }
        use base64::Engine;
        for (k, v) in &self.data {
            if base64::engine::general_purpose::STANDARD.decode(v).is_err() {
                return checks::fail(&format!("data.{k}"), "is not valid base64 (use stringData for plain text)");
            }
        }
        Ok(())
    }
}
