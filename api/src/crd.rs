//! CustomResourceDefinitions for the controller's Kubernetes backend, generated from the
//! resource types in [`crate::resources`] (the same types the embedded store and the reconcilers
//! use): each kind's structural `spec` and `status` schemas ([`crate::schema`]), with its
//! [`Rule`](crate::resources::checks::Rule)s as CEL rules and its columns as printer columns.

use std::sync::OnceLock;

use serde_json::{json, Value};

use crate::registry::Kind;
use crate::resources::{Column, GROUP};

/// The served and stored version.
pub const VERSION: &str = "v1alpha1";

/// A kind's `additionalPrinterColumns`: its [`Column`]s the CRD shows.
fn printer_columns(columns: &[Column]) -> Value {
    let shown = columns.iter().filter(|c| c.in_crd());
    Value::Array(shown.map(|c| json!({ "name": c.name, "type": c.ty.as_str(), "jsonPath": c.path })).collect())
}

/// Adds the rules of `kind` ([`Kind::rules`]) to its spec schema as CEL rules, with the same
/// field path and message `apply` gives.
fn add_rules(kind: Kind, spec: &mut Value) {
    for rule in kind.rules() {
        let mut at = &mut *spec;
        for key in rule.at.split('.').skip(1) {
            at = match key.strip_suffix("[]") {
                // A rule on each item of a list.
                Some(list) => &mut at["properties"][list]["items"],
                None => &mut at["properties"][key],
            };
        }
        let mut v = json!({ "rule": rule.cel, "message": rule.message, "reason": "FieldValueInvalid" });
        if !rule.field.is_empty() {
            v["fieldPath"] = json!(format!(".{}", rule.field));
        }
        match at.get_mut("x-kubernetes-validations").and_then(Value::as_array_mut) {
            Some(list) => list.push(v),
            None => at["x-kubernetes-validations"] = json!([v]),
        }
    }
}

/// The message of a field that may be set, or removed, but not changed.
pub const IMMUTABLE: &str = "is immutable once set: the machines already made stay in the cluster they joined (remove it, or make another owner)";

/// `spec.targetCluster` may not change (a CEL transition rule; `apply` checks the same on the
/// embedded store).
fn add_immutable_target(spec: &mut Value) {
    if let Some(at) = spec.pointer_mut("/properties/targetCluster") {
        at["x-kubernetes-validations"] =
            json!([{ "rule": "self == oldSelf", "message": IMMUTABLE, "reason": "FieldValueInvalid" }]);
    }
}

/// The `openAPIV3Schema` of a kind's CRD (with its rules), built once.
pub fn schema(kind: Kind) -> Option<&'static Value> {
    static CRDS: OnceLock<Vec<Value>> = OnceLock::new();
    let crds = CRDS.get_or_init(crds);
    let crd = crds.iter().find(|c| c["spec"]["names"]["kind"] == kind.as_str())?;
    crd.pointer("/spec/versions/0/schema/openAPIV3Schema")
}

/// The CustomResourceDefinitions of every kind but `Secret` (core v1), as JSON objects.
pub fn crds() -> Vec<Value> {
    Kind::ALL
        .into_iter()
        .filter_map(|kind| {
            let (mut spec, status) = kind.crd_schemas()?;
            add_rules(kind, &mut spec);
            add_immutable_target(&mut spec);
            let plural = kind.plural();
            let mut subresources = json!({ "status": {} });
            if kind.scale() {
                subresources["scale"] =
                    json!({ "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas" });
            }
            Some(json!({
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": { "name": format!("{plural}.{GROUP}") },
                "spec": {
                    "group": GROUP,
                    "scope": "Namespaced",
                    "names": {
                        "kind": kind.as_str(),
                        "listKind": format!("{}List", kind.as_str()),
                        "plural": plural,
                        "singular": kind.as_str().to_ascii_lowercase(),
                        "shortNames": kind.short_names(),
                        "categories": ["machine-driver"],
                    },
                    "versions": [{
                        "name": VERSION,
                        "served": true,
                        "storage": true,
                        "subresources": subresources,
                        "additionalPrinterColumns": printer_columns(kind.columns()),
                        "schema": { "openAPIV3Schema": {
                            "type": "object",
                            "description": format!("A {} (machine-driver).", kind.as_str()),
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": { "type": "string" },
                                "kind": { "type": "string" },
                                "metadata": { "type": "object" },
                                "spec": spec,
                                "status": status,
                            }
                        }}
                    }]
                }
            }))
        })
        .collect()
}

/// The CRDs as one multi-document YAML stream (`machine-controller crds`).
///
/// # Errors
/// Serialization failures (not expected).
pub fn crds_yaml() -> Result<String, serde_saphyr::SerializeError> {
    let mut out = String::new();
    for crd in crds() {
        out.push_str("---\n");
        out.push_str(&serde_saphyr::to_string(&crd)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use serde_json::Map;

    use super::*;

    fn walk(v: &Value, path: &str, f: &mut impl FnMut(&str, &Map<String, Value>)) {
        if let Value::Object(o) = v {
            f(path, o);
            for (k, child) in o {
                walk(child, &format!("{path}.{k}"), f);
            }
        } else if let Value::Array(a) = v {
            for (i, child) in a.iter().enumerate() {
                walk(child, &format!("{path}[{i}]"), f);
            }
        }
    }

    #[test]
    fn schemas_are_structural() {
        for crd in crds() {
            let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
            walk(schema, "", &mut |path, o| {
                for banned in ["$ref", "anyOf", "oneOf", "allOf", "$schema", "const"] {
                    assert!(!o.contains_key(banned), "{path} has {banned}: {o:?}");
                }
                let is_schema = o.contains_key("type")
                    || o.contains_key("x-kubernetes-int-or-string")
                    || o.contains_key("x-kubernetes-preserve-unknown-fields");
                let is_container = path.ends_with(".properties") || path.ends_with(".subresources");
                if o.contains_key("description") && !is_container {
                    assert!(is_schema, "{path} has no type: {o:?}");
                }
            });
        }
    }

    #[test]
    fn the_yaml_reads_back_as_the_same_crds() {
        let yaml = crds_yaml().unwrap();
        let back: Vec<Value> = serde_saphyr::from_multiple(&yaml).unwrap();
        assert_eq!(back, crds());
    }

    #[test]
    fn the_rules_are_cel_rules_on_their_fields() {
        let crds = crds();
        let md = &crds[1]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        let rolling = &md["properties"]["strategy"]["properties"]["rollingUpdate"];
        let rules = rolling["x-kubernetes-validations"].as_array().unwrap();
        assert_eq!(rules.len(), 1, "{rules:?}");
        assert_eq!(rules[0]["fieldPath"], json!(".maxUnavailable"));
        assert_eq!(rules[0]["message"], json!("must not be 0 when maxSurge is 0"));
        let surge = &rolling["properties"]["maxSurge"]["x-kubernetes-validations"];
        assert_eq!(surge.as_array().map(Vec::len), Some(2), "{surge}");
        let pool = &crds[2]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        assert!(pool["properties"]["strategy"]["x-kubernetes-validations"].is_array());
        let total: usize = crds
            .iter()
            .map(|c| {
                let mut n = 0;
                walk(&c["spec"]["versions"][0]["schema"], "", &mut |_, o| {
                    n += o.get("x-kubernetes-validations").and_then(Value::as_array).map_or(0, Vec::len)
                });
                n
            })
            .sum();
        // Every rule, and the target cluster's transition rule on each kind that has the field.
        let targeted = crds
            .iter()
            .filter(|c| {
                c.pointer("/spec/versions/0/schema/openAPIV3Schema/properties/spec/properties/targetCluster").is_some()
            })
            .count();
        assert_eq!(targeted, 3, "MachineDeployment, MachinePool, Machine");
        assert_eq!(total, Kind::ALL.into_iter().map(|k| k.rules().len()).sum::<usize>() + targeted);
    }

    #[test]
    fn closed_fields_are_enums() {
        let crds = crds();
        let spec = |kind: Kind| {
            let crd = crds.iter().find(|c| c["spec"]["names"]["kind"] == kind.as_str()).unwrap();
            &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        };
        let condition = &spec(Kind::MachineHealthCheck)["unhealthyConditions"]["items"]["properties"]["type"];
        assert_eq!((&condition["type"], &condition["enum"]), (&json!("string"), &json!(["Ready"])), "{condition}");
        let taints = &spec(Kind::MachineDeployment)["template"]["properties"]["spec"]["properties"]["nodeTemplate"]
            ["properties"]["taints"];
        let effect = &taints["items"]["properties"]["effect"];
        assert_eq!(effect["enum"], json!(["NoSchedule", "PreferNoSchedule", "NoExecute"]), "{effect}");
    }

    #[test]
    fn int_or_percent_and_provider_spec() {
        let crds = crds();
        let md = &crds[1]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        let surge = &md["properties"]["strategy"]["properties"]["rollingUpdate"]["properties"]["maxSurge"];
        assert_eq!(surge["x-kubernetes-int-or-string"], json!(true), "{surge}");
        assert_eq!(md["properties"]["replicas"]["minimum"], json!(0));
        let class = &crds[0]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        assert_eq!(class["properties"]["providerSpec"]["x-kubernetes-preserve-unknown-fields"], json!(true));
        assert_eq!(class["required"], json!(["driver", "providerSpec"]));
    }
}
