//! Reading manifests: YAML (multi-document) or JSON files into typed objects, with every field
//! validated. An error names the file, the document, the object and the field.

use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::resources::*;

/// Any object a manifest may hold.
#[derive(Debug, Clone, PartialEq)]
pub enum AnyObject {
    /// A Secret.
    Secret(Secret),
    /// A MachineClass.
    MachineClass(MachineClass),
    /// A MachineDeployment.
    MachineDeployment(MachineDeployment),
    /// A MachinePool.
    MachinePool(MachinePool),
    /// A Machine.
    Machine(Machine),
}

impl AnyObject {
    /// The kind.
    pub fn kind(&self) -> Kind {
        match self {
            AnyObject::Secret(_) => Kind::Secret,
            AnyObject::MachineClass(_) => Kind::MachineClass,
            AnyObject::MachineDeployment(_) => Kind::MachineDeployment,
            AnyObject::MachinePool(_) => Kind::MachinePool,
            AnyObject::Machine(_) => Kind::Machine,
        }
    }

    /// The metadata.
    pub fn meta(&self) -> &ObjectMeta {
        match self {
            AnyObject::Secret(o) => &o.metadata,
            AnyObject::MachineClass(o) => &o.metadata,
            AnyObject::MachineDeployment(o) => &o.metadata,
            AnyObject::MachinePool(o) => &o.metadata,
            AnyObject::Machine(o) => &o.metadata,
        }
    }

    /// As JSON.
    pub fn to_json(&self) -> Value {
        let v = match self {
            AnyObject::Secret(o) => serde_json::to_value(o),
            AnyObject::MachineClass(o) => serde_json::to_value(o),
            AnyObject::MachineDeployment(o) => serde_json::to_value(o),
            AnyObject::MachinePool(o) => serde_json::to_value(o),
            AnyObject::Machine(o) => serde_json::to_value(o),
        };
        v.unwrap_or(Value::Null)
    }
}

/// A manifest problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestError {
    /// The file.
    pub source: String,
    /// 1-based document number within the file.
    pub document: usize,
    /// `Kind/name` when known.
    pub object: Option<String>,
    /// The field path (`spec.strategy.rollingUpdate.maxSurge`), empty for syntax errors.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ManifestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: document {}", self.source, self.document)?;
        if let Some(o) = &self.object {
            write!(f, " ({o})")?;
        }
        if !self.field.is_empty() {
            write!(f, ": {}", self.field)?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for ManifestError {}

/// The `.yaml`, `.yml` and `.json` files of `path` (a file, or a folder read in name order).
///
/// # Errors
/// An unreadable path.
pub fn files(path: &Path) -> std::io::Result<Vec<PathBuf>> {
    if path.is_dir() {
        let mut out: Vec<PathBuf> = std::fs::read_dir(path)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().and_then(|e| e.to_str()).is_some_and(|e| matches!(e, "yaml" | "yml" | "json")))
            .collect();
        out.sort();
        Ok(out)
    } else {
        std::fs::metadata(path)?;
        Ok(vec![path.to_path_buf()])
    }
}

/// Parses and validates every document of `text`.
///
/// # Errors
/// Every problem found (all documents are checked).
pub fn parse(text: &str, source: &str) -> Result<Vec<AnyObject>, Vec<ManifestError>> {
    use serde::Deserialize;
    let mut out = Vec::new();
    let mut errors = Vec::new();
    for (i, doc) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let document = i + 1;
        let err = |object: Option<String>, field: &str, message: String| ManifestError {
            source: source.to_string(),
            document,
            object,
            field: field.to_string(),
            message,
        };
        let value = match serde_yaml_ng::Value::deserialize(doc) {
            Ok(v) => v,
            Err(e) => {
                errors.push(err(None, "", format!("not valid YAML: {e}")));
                // The parser cannot continue after a syntax error.
                break;
            }
        };
        if value.is_null() {
            continue;
        }
        let json: Value = match serde_json::to_value(&value) {
            Ok(v) => v,
            Err(e) => {
                errors.push(err(None, "", format!("cannot be read as JSON-compatible data: {e}")));
                continue;
            }
        };
        match parse_object(&json) {
            Ok(obj) => out.push(obj),
            Err((object, field, message)) => errors.push(err(object, &field, message)),
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors)
    }
}

type Problem = (Option<String>, String, String);

fn parse_object(json: &Value) -> Result<AnyObject, Problem> {
    let Value::Object(map) = json else {
        return Err((None, String::new(), "a manifest document must be a mapping".into()));
    };
    let kind_str = map.get("kind").and_then(Value::as_str).ok_or((None, "kind".into(), "is required".into()))?;
    let name = map.get("metadata").and_then(|m| m.get("name")).and_then(Value::as_str).unwrap_or("");
    let label = Some(format!("{kind_str}/{name}"));
    let kind = match kind_str {
        "Secret" => Kind::Secret,
        "MachineClass" => Kind::MachineClass,
        "MachineDeployment" => Kind::MachineDeployment,
        "MachinePool" => Kind::MachinePool,
        "Machine" => Kind::Machine,
        other => {
            return Err((
                None,
                "kind".into(),
                format!(
                    "unknown kind {other:?}; expected Secret, MachineClass, MachineDeployment, MachinePool or Machine"
                ),
            ))
        }
    };
    match map.get("apiVersion").and_then(Value::as_str) {
        None => return Err((label, "apiVersion".into(), "is required".into())),
        Some(v) if v != kind.api_version() => {
            return Err((label, "apiVersion".into(), format!("{kind} is served as {}, not {v:?}", kind.api_version())))
        }
        Some(_) => {}
    }
    let obj = typed(kind, json).map_err(|(f, m)| (label.clone(), f, m))?;
    validate(&obj).map_err(|(f, m)| (label, f, m))?;
    Ok(obj)
}

fn typed(kind: Kind, json: &Value) -> Result<AnyObject, (String, String)> {
    fn de<T: serde::de::DeserializeOwned>(json: &Value) -> Result<T, (String, String)> {
        serde_path_to_error::deserialize(json).map_err(|e| {
            let path = e.path().to_string();
            let field = if path == "." { String::new() } else { path };
            (field, e.into_inner().to_string())
        })
    }
    Ok(match kind {
        Kind::Secret => AnyObject::Secret(de(json)?),
        Kind::MachineClass => AnyObject::MachineClass(de(json)?),
        Kind::MachineDeployment => AnyObject::MachineDeployment(de(json)?),
        Kind::MachinePool => AnyObject::MachinePool(de(json)?),
        Kind::Machine => AnyObject::Machine(de(json)?),
    })
}

type Check = Result<(), (String, String)>;

fn fail(field: &str, message: impl Into<String>) -> Check {
    Err((field.to_string(), message.into()))
}

fn name(field: &str, value: &str) -> Check {
    driver_sdk::schema::check_name(value).or_else(|why| fail(field, why))?;
    if value.len() > 63 {
        return fail(field, "must be at most 63 characters");
    }
    Ok(())
}

fn object_or_absent(field: &str, v: Option<&Value>) -> Check {
    match v {
        None | Some(Value::Object(_)) => Ok(()),
        Some(other) => fail(field, format!("must be a mapping, got {}", json_type(other))),
    }
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a mapping",
    }
}

fn meta(m: &ObjectMeta) -> Check {
    name("metadata.name", &m.name)?;
    name("metadata.namespace", &m.namespace)?;
    for (k, v) in &m.labels {
        if k.is_empty() || k.len() > 253 || v.len() > 63 {
            return fail(&format!("metadata.labels.{k}"), "label keys are 1..=253 and values at most 63 characters");
        }
    }
    Ok(())
}

fn template(t: &MachineTemplate) -> Check {
    name("spec.template.spec.classRef.name", &t.spec.class_ref.name)?;
    object_or_absent("spec.template.spec.providerSpec", t.spec.provider_spec.as_ref())?;
    if let Some(nt) = &t.spec.node_template {
        node_template("spec.template.spec.nodeTemplate", nt)?;
    }
    Ok(())
}

fn node_template(field: &str, t: &NodeTemplate) -> Check {
    for (i, taint) in t.taints.iter().enumerate() {
        if taint.key.is_empty() {
            return fail(&format!("{field}.taints[{i}].key"), "must not be empty");
        }
        if !matches!(taint.effect.as_str(), "NoSchedule" | "PreferNoSchedule" | "NoExecute") {
            return fail(
                &format!("{field}.taints[{i}].effect"),
                format!("must be NoSchedule, PreferNoSchedule or NoExecute, got {:?}", taint.effect),
            );
        }
    }
    for k in t.labels.keys().chain(t.annotations.keys()) {
        if k.is_empty() {
            return fail(field, "label and annotation keys must not be empty");
        }
    }
    Ok(())
}

/// The node settings a deployment or pool gives its machines.
fn node_settings(s: &NodeSettings) -> Check {
    if s.drain_timeout_seconds == 0 {
        return fail("spec.drainTimeoutSeconds", "must be at least 1 (a drain always has a deadline)");
    }
    Ok(())
}

fn int_or_percent(field: &str, v: &IntOrPercent, round_up: bool) -> Check {
    v.resolve(100, round_up).map(|_| ()).or_else(|m| fail(field, m))
}

fn replicas(n: i64) -> Check {
    if !(0..=100_000).contains(&n) {
        return fail("spec.replicas", format!("must be between 0 and 100000, got {n}"));
    }
    Ok(())
}

/// Semantic checks beyond the shape: names, ranges, formats.
fn validate(obj: &AnyObject) -> Check {
    meta(obj.meta())?;
    match obj {
        AnyObject::Secret(s) => {
            if s.secret_type.as_deref().is_some_and(|t| t != "Opaque") {
                return fail("type", "only Opaque secrets are supported");
            }
            use base64::Engine;
            for (k, v) in &s.data {
                if base64::engine::general_purpose::STANDARD.decode(v).is_err() {
                    return fail(&format!("data.{k}"), "is not valid base64 (use stringData for plain text)");
                }
            }
            Ok(())
        }
        AnyObject::MachineClass(c) => {
            if c.spec.driver.is_empty() {
                return fail("spec.driver", "is required (the name given to `run --driver NAME=ENDPOINT`)");
            }
            if !c.spec.provider_spec.is_object() {
                return fail(
                    "spec.providerSpec",
                    format!("must be a mapping, got {}", json_type(&c.spec.provider_spec)),
                );
            }
            if let Some(r) = &c.spec.secret_ref {
                name("spec.secretRef.name", &r.name)?;
            }
            Ok(())
        }
        AnyObject::MachineDeployment(d) => {
            replicas(d.spec.replicas)?;
            template(&d.spec.template)?;
            let s = &d.spec.strategy;
            int_or_percent("spec.strategy.rollingUpdate.maxSurge", &s.rolling_update.max_surge, true)?;
            int_or_percent("spec.strategy.rollingUpdate.maxUnavailable", &s.rolling_update.max_unavailable, false)?;
            int_or_percent("spec.strategy.inPlace.maxUnavailable", &s.in_place.max_unavailable, false)?;
            if d.spec.progress_deadline_seconds == 0 {
                return fail("spec.progressDeadlineSeconds", "must be at least 1");
            }
            if d.spec.creation_timeout_seconds == 0 {
                return fail("spec.creationTimeoutSeconds", "must be at least 1");
            }
            if d.spec.health_timeout_seconds == 0 {
                return fail("spec.healthTimeoutSeconds", "must be at least 1");
            }
            if d.spec.max_concurrent_replacements == 0 {
                return fail("spec.maxConcurrentReplacements", "must be at least 1");
            }
            node_settings(&d.spec.node_settings())
        }
        AnyObject::MachinePool(p) => {
            replicas(p.spec.replicas)?;
            template(&p.spec.template)?;
            int_or_percent("spec.strategy.maxSurge", &p.spec.strategy.max_surge, true)?;
            int_or_percent("spec.strategy.maxUnavailable", &p.spec.strategy.max_unavailable, false)?;
            node_settings(&p.spec.node_settings())
        }
        AnyObject::Machine(m) => {
            name("spec.classRef.name", &m.spec.class_ref.name)?;
            object_or_absent("spec.providerSpec", m.spec.provider_spec.as_ref())?;
            if let Some(p) = &m.spec.pool_ref {
                name("spec.poolRef.name", &p.name)?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
apiVersion: machine.driver.dev/v1alpha1
kind: MachineClass
metadata: {name: small}
spec:
  driver: fake
  providerSpec: {machineType: small}
---
apiVersion: machine.driver.dev/v1alpha1
kind: MachineDeployment
metadata: {name: web}
spec:
  replicas: 3
  template:
    spec:
      classRef: {name: small}
  strategy:
    rollingUpdate: {maxSurge: "25%", maxUnavailable: 0}
"#;

    #[test]
    fn parses_a_multi_document_manifest() {
        let objs = parse(GOOD, "good.yaml").unwrap();
        assert_eq!(objs.len(), 2);
        assert_eq!(objs[1].kind(), Kind::MachineDeployment);
        assert_eq!(objs[1].meta().namespace, "default");
    }

    fn first_error(text: &str) -> String {
        parse(text, "bad.yaml").unwrap_err()[0].to_string()
    }

    #[test]
    fn errors_name_the_field() {
        let e = first_error(&GOOD.replace("maxSurge: \"25%\"", "maxSurge: \"lots\""));
        assert!(e.contains("MachineDeployment/web") && e.contains("spec.strategy.rollingUpdate.maxSurge"), "{e}");
        let e = first_error(&GOOD.replace("replicas: 3", "replicas: three"));
        assert!(e.contains("spec.replicas"), "{e}");
        let e = first_error(&GOOD.replace("replicas: 3", "replicas: 3\n  colour: blue"));
        assert!(e.contains("unknown field `colour`"), "{e}");
        let e = first_error(&GOOD.replace("driver: fake", "driver: \"\""));
        assert!(e.contains("spec.driver"), "{e}");
        let e = first_error(&GOOD.replace("name: web", "name: Web_1"));
        assert!(e.contains("metadata.name"), "{e}");
        let e = first_error(&GOOD.replace("kind: MachineClass", "kind: Gadget"));
        assert!(e.contains("unknown kind \"Gadget\""), "{e}");
        let e = first_error(&GOOD.replace(
            "apiVersion: machine.driver.dev/v1alpha1\nkind: MachineClass",
            "apiVersion: v2\nkind: MachineClass",
        ));
        assert!(e.contains("apiVersion"), "{e}");
        let e = first_error(&GOOD.replace("classRef: {name: small}", "classRef: {}"));
        assert!(e.contains("spec.template.spec.classRef"), "{e}");
        let e = first_error(&GOOD.replace("replicas: 3", "replicas: 3\n  drainTimeoutSeconds: 0"));
        assert!(e.contains("spec.drainTimeoutSeconds") && e.contains("deadline"), "{e}");
        let e = first_error(&GOOD.replace(
            "classRef: {name: small}",
            "classRef: {name: small}\n      nodeTemplate: {taints: [{key: dedicated, effect: Sometimes}]}",
        ));
        assert!(e.contains("spec.template.spec.nodeTemplate.taints[0].effect"), "{e}");
        assert!(parse(
            &GOOD.replace(
                "classRef: {name: small}",
                "classRef: {name: small}\n      nodeTemplate: {labels: {tier: web}, taints: [{key: d, effect: NoSchedule}]}",
            ),
            "x.yaml"
        )
        .is_ok());
    }

    #[test]
    fn broken_yaml_is_reported_with_its_location() {
        let e = first_error("kind: MachineClass\nmetadata: {name: [unclosed\n");
        assert!(e.contains("not valid YAML") && e.contains("line"), "{e}");
    }

    #[test]
    fn every_bad_document_is_reported() {
        let text = format!(
            "{GOOD}\n---\nkind: Nope\n---\napiVersion: v1\nkind: Secret\nmetadata: {{name: s}}\ndata: {{k: '***'}}\n"
        );
        let errors = parse(&text, "x.yaml").unwrap_err();
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(errors[1].to_string().contains("data.k"));
    }
}
