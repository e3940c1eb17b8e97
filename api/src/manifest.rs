//! Reading manifests: YAML (multi-document) or JSON files into typed objects, with every field
//! validated. An error names the file, the document, the object and the field.

use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::Value;

pub use crate::dispatch::AnyObject;
use crate::registry::Kind;
pub use crate::resources::checks::Rule;
use crate::resources::checks::{self, Check};
use crate::resources::one_of;

/// A manifest problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestError {
    /// The file.
    pub source: String,
    /// 1-based number of the document among the file's non-empty documents.
    pub document: usize,
    /// The line the document starts on, when known (not for YAML syntax errors: their message
    /// has the line and column of the error itself).
    pub line: Option<u64>,
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
        if let Some(line) = self.line {
            write!(f, " at line {line}")?;
        }
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

/// The most a manifest file may hold; larger files are refused before they are parsed.
pub const MAX_MANIFEST_BYTES: usize = 16 << 20;

/// What the YAML reader accepts, and the budget that keeps a hostile file (alias bombs, deep
/// nesting, document storms) from costing more than a few megabytes and milliseconds:
///
/// - duplicate keys are errors, as in Kubernetes' own strict field validation;
/// - YAML 1.2 core scalars: only `true`/`false` are booleans (`yes`, `on` stay strings), and
///   `0755` or `1_000` stay strings rather than numbers (what `serde_yaml` did);
/// - anchors and aliases work, but at most 100,000 events are replayed from aliases in a file,
///   and at most 1,000 aliases and 1,000 anchors are defined.
fn yaml_options() -> serde_saphyr::Options {
    serde_saphyr::options! {
        budget: serde_saphyr::budget! {
            max_reader_input_bytes: Some(MAX_MANIFEST_BYTES),
            max_events: 1_000_000,
            max_nodes: 250_000,
            max_depth: 64,
            max_aliases: 1_000,
            max_anchors: 1_000,
            max_documents: 10_000,
            max_total_scalar_bytes: MAX_MANIFEST_BYTES,
        },
        alias_limits: serde_saphyr::alias_limits! {
            max_total_replayed_events: 100_000,
            max_replay_stack_depth: 16,
        },
        duplicate_keys: serde_saphyr::DuplicateKeyPolicy::Error,
        strict_booleans: true,
        leading_zero_numbers_as_strings: true,
        underscored_numbers_as_strings: true,
        with_snippet: false,
    }
}

/// `not valid YAML: line L, column C: what` (where the reader stopped), in the words meant for
/// users (no hints about the library's options).
fn yaml_error(e: &serde_saphyr::Error) -> String {
    use serde_saphyr::MessageFormatter;
    let what = serde_saphyr::UserMessageFormatter.format_message(e.without_snippet());
    match e.location() {
        Some(at) if at.line() > 0 => format!("not valid YAML: line {}, column {}: {what}", at.line(), at.column()),
        _ => format!("not valid YAML: {what}"),
    }
}

/// Parses and validates every document of `text`.
///
/// Documents are numbered from 1 among the file's non-empty documents (an empty document
/// between two `---` is skipped, as `kubectl apply` skips it); each error also carries the line
/// its document starts on.
///
/// # Errors
/// Every problem found: every document is checked; after a YAML syntax error the rest of the
/// file cannot be read and is not.
pub fn parse(text: &str, source: &str) -> Result<Vec<AnyObject>, Vec<ManifestError>> {
    let mut out = Vec::new();
    let mut errors = Vec::new();
    let mut reader = text.as_bytes();
    let docs = serde_saphyr::read_with_options::<_, serde_saphyr::Spanned<Value>>(&mut reader, yaml_options());
    for (i, doc) in docs.enumerate() {
        let document = i + 1;
        let err = |line: Option<u64>, object: Option<String>, field: &str, message: String| ManifestError {
            source: source.to_string(),
            document,
            line,
            object,
            field: field.to_string(),
            message,
        };
        let doc = match doc {
            Ok(doc) => doc,
            Err(e) => {
                // The reader goes on at the next document when it can, and ends otherwise.
                errors.push(err(None, None, "", yaml_error(&e)));
                continue;
            }
        };
        let line = Some(doc.referenced.line()).filter(|l| *l > 0);
        match parse_object(&doc.value) {
            Ok(obj) => out.push(obj),
            Err(problems) => {
                errors.extend(problems.into_iter().map(|(object, field, message)| err(line, object, &field, message)))
            }
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors)
    }
}

type Problem = (Option<String>, String, String);

/// The object of one document, or its problems: every bound and [`rules`] violation (as the API
/// server lists them all), else the first shape or semantic problem.
fn parse_object(json: &Value) -> Result<AnyObject, Vec<Problem>> {
    parse_kind(json).map_err(|p| vec![p]).and_then(|(kind, label)| {
        let broken: Vec<Problem> = bounds(kind, json)
            .into_iter()
            .chain(broken_rules(kind, json))
            .map(|(f, m)| (label.clone(), f, m))
            .collect();
        if !broken.is_empty() {
            return Err(broken);
        }
        let obj = typed(kind, json).map_err(|(f, m)| vec![(label.clone(), f, m)])?;
        validate(&obj).map_err(|(f, m)| vec![(label, f, m)])?;
        Ok(obj)
    })
}

/// The kind and `Kind/name` of a document, checking `kind` and `apiVersion`.
fn parse_kind(json: &Value) -> Result<(Kind, Option<String>), Problem> {
    let Value::Object(map) = json else {
        return Err((None, String::new(), "a manifest document must be a mapping".into()));
    };
    let kind_str = map.get("kind").and_then(Value::as_str).ok_or((None, "kind".into(), "is required".into()))?;
    let name = map.get("metadata").and_then(|m| m.get("name")).and_then(Value::as_str).unwrap_or("");
    let label = Some(format!("{kind_str}/{name}"));
    let Some(kind) = Kind::from_name(kind_str) else {
        let names: Vec<&str> = Kind::ALL.iter().map(|k| k.as_str()).collect();
        return Err((None, "kind".into(), format!("unknown kind {kind_str:?}; expected {}", one_of(&names))));
    };
    match map.get("apiVersion").and_then(Value::as_str) {
        None => return Err((label, "apiVersion".into(), "is required".into())),
        Some(v) if v != kind.api_version() => {
            return Err((label, "apiVersion".into(), format!("{kind} is served as {}, not {v:?}", kind.api_version())))
        }
        Some(_) => {}
    }
    Ok((kind, label))
}

fn typed(kind: Kind, json: &Value) -> Result<AnyObject, (String, String)> {
    AnyObject::from_json(kind, json).map_err(|e| {
        let path = e.path().to_string();
        let field = if path == "." { String::new() } else { path };
        (field, e.into_inner().to_string())
    })
}

/// Semantic checks beyond the shape and the [`rules`]: the common metadata, then the kind's own
/// ([`KindInfo::validate`](crate::resources::KindInfo::validate)).
fn validate(obj: &AnyObject) -> Check {
    checks::meta(obj.meta())?;
    obj.validate()
}

/// Every [`Rule`] of every kind, in the order `apply` checks them.
pub fn rules() -> Vec<Rule> {
    Kind::ALL.into_iter().flat_map(Kind::rules).collect()
}

/// The (field, message) of every rule of `kind` that `json` breaks.
fn broken_rules(kind: Kind, json: &Value) -> Vec<(String, String)> {
    rules()
        .into_iter()
        .filter(|r| r.kind == kind)
        .filter_map(|r| Some((r.violation(json)?, r.message.into())))
        .collect()
}

/// The (field, message) of every `minimum`/`maximum` of the CRD schema that `json` breaks, in the
/// API server's words.
fn bounds(kind: Kind, json: &Value) -> Vec<(String, String)> {
    // A bound as the API server prints it (Go's `%v` of a float64: `1`, not `1.0`).
    fn bound(b: f64) -> String {
        if b.fract() == 0.0 && b.abs() < 1e15 {
            format!("{}", b as i64)
        } else {
            format!("{b}")
        }
    }
    fn walk(schema: &Value, v: &Value, path: &str, out: &mut Vec<(String, String)>) {
        if let Some(n) = v.as_f64() {
            if let Some(min) = schema.get("minimum").and_then(Value::as_f64).filter(|min| n < *min) {
                out.push((path.into(), format!("should be greater than or equal to {}", bound(min))));
            }
            if let Some(max) = schema.get("maximum").and_then(Value::as_f64).filter(|max| n > *max) {
                out.push((path.into(), format!("should be less than or equal to {}", bound(max))));
            }
        }
        match v {
            Value::Object(o) => {
                for (k, child) in o {
                    let properties = schema.get("properties").and_then(|p| p.get(k));
                    if let Some(sub) = properties.or_else(|| schema.get("additionalProperties")) {
                        walk(sub, child, &if path.is_empty() { k.clone() } else { format!("{path}.{k}") }, out);
                    }
                }
            }
            Value::Array(items) => {
                if let Some(sub) = schema.get("items") {
                    for (i, child) in items.iter().enumerate() {
                        walk(sub, child, &format!("{path}[{i}]"), out);
                    }
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    if let Some(schema) = crate::crd::schema(kind) {
        walk(schema, json, "", &mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::resources::checks::{int_or_percent_ok, is_zero, percent_at_most_100, DEFAULT_PROGRESS_DEADLINE};
    use crate::resources::{IntOrPercent, MachineDeploymentSpec, MachinePoolSpec};

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
        assert!(
            e.contains("unknown variant `Sometimes`, expected one of `NoSchedule`, `PreferNoSchedule`, `NoExecute`"),
            "{e}"
        );
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
    fn a_syntax_error_names_its_line_and_column() {
        let errors = parse("kind: MachineClass\nmetadata:\n  name: a\n   bad: indent\n", "bad.yaml").unwrap_err();
        assert_eq!(errors.len(), 1, "{errors:?}");
        let e = errors[0].to_string();
        assert!(e.starts_with("bad.yaml: document 1: not valid YAML: line 4, column"), "{e}");
    }

    #[test]
    fn a_wrong_type_names_the_field_path_and_the_document_line() {
        let e = first_error(&GOOD.replace("maxUnavailable: 0", "maxUnavailable: [0]"));
        assert!(e.starts_with("bad.yaml: document 2 at line 9 (MachineDeployment/web): "), "{e}");
        assert!(e.contains("spec.strategy.rollingUpdate.maxUnavailable"), "{e}");
        let e = first_error(&GOOD.replace("replicas: 3", "replicas: {n: 3}"));
        assert!(e.contains(": spec.replicas: invalid type: map, expected i64"), "{e}");
    }

    #[test]
    fn a_broken_second_document_keeps_the_first_documents_error() {
        // Document 1 is refused by validation, document 2 is not YAML: both are reported.
        let text = "apiVersion: v1\nkind: Secret\nmetadata: {name: s}\ndata: {k: '***'}\n---\nkind: [\n";
        let errors = parse(text, "x.yaml").unwrap_err();
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert_eq!((errors[0].document, errors[0].field.as_str()), (1, "data.k"));
        assert_eq!(errors[1].document, 2);
        assert!(errors[1].message.starts_with("not valid YAML: line 6, column 7: "), "{errors:?}");
        // A bad value in document 2 of 3 does not hide document 3's.
        let text = format!("{GOOD}---\n{}", GOOD.replace("replicas: 3", "replicas: -1"));
        let errors = parse(&text.replace("driver: fake", "driver: \"\""), "x.yaml").unwrap_err();
        let fields: Vec<(usize, &str)> = errors.iter().map(|e| (e.document, e.field.as_str())).collect();
        assert_eq!(fields, [(1, "spec.driver"), (3, "spec.driver"), (4, "spec.replicas")], "{errors:?}");
    }

    #[test]
    fn duplicate_keys_are_refused() {
        let errors = parse(&GOOD.replace("replicas: 3", "replicas: 3\n  replicas: 30"), "x.yaml").unwrap_err();
        assert_eq!(errors.len(), 1, "{errors:?}");
        let e = errors[0].to_string();
        assert!(e.contains("document 2: not valid YAML: line 14, column 3: duplicate mapping key `replicas`"), "{e}");
        let e = first_error(&GOOD.replace("metadata: {name: small}", "metadata: {name: small, name: big}"));
        assert!(e.contains("document 1") && e.contains("duplicate"), "{e}");
    }

    #[test]
    fn yaml_1_1_booleans_and_octals_stay_strings() {
        let text = GOOD.replace("metadata: {name: web}", "metadata: {name: web, labels: {on: yes, mode: 0755}}");
        let objs = parse(&text, "x.yaml").unwrap();
        let labels = &objs[1].meta().labels;
        assert_eq!(labels.get("on").map(String::as_str), Some("yes"), "{labels:?}");
        assert_eq!(labels.get("mode").map(String::as_str), Some("0755"), "{labels:?}");
    }

    #[test]
    fn anchors_work_and_an_alias_bomb_is_refused_cheaply() {
        let text = GOOD.replace("providerSpec: {machineType: small}", "providerSpec: &p {machineType: small}\n  x: *p");
        assert!(first_error(&text).contains("unknown field `x`"));
        // A billion laughs: 9 levels of 10 aliases each would expand to 10^9 strings.
        let mut bomb = String::from("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
        for i in 1..10 {
            let refs = vec![format!("*a{}", i - 1); 10].join(", ");
            bomb += &format!("a{i}: &a{i} [{refs}]\n");
        }
        let started = std::time::Instant::now();
        let errors = parse(&bomb, "bomb.yaml").unwrap_err();
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].message.contains("too large or too complex: total_replayed_events"), "{errors:?}");
        assert!(started.elapsed() < std::time::Duration::from_secs(5), "{:?}", started.elapsed());
    }

    #[test]
    fn hostile_input_is_an_error_not_a_panic() {
        for text in [
            "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
            "*x",
            "!!binary x",
            "\u{feff}",
            "? [a]\n: b",
        ] {
            let _ = parse(text, "x.yaml");
        }
        let deep = format!("{}1{}", "[".repeat(100_000), "]".repeat(100_000));
        assert!(parse(&deep, "x.yaml").is_err());
    }

    #[test]
    fn int_or_percent_rules() {
        for (v, format_ok, range_ok, zero) in [
            (json!(0), true, true, true),
            (json!(3), true, true, false),
            (json!(-1), false, true, false),
            (json!("0"), true, true, true),
            (json!("00%"), true, true, true),
            (json!("7"), true, true, false),
            (json!("100%"), true, true, false),
            (json!("007%"), true, true, false),
            (json!("101%"), true, false, false),
            (json!("0200%"), true, false, false),
            (json!("99999999999999999999%"), true, false, false),
            (json!("%"), false, true, false),
            (json!(""), false, true, false),
            (json!(" 5%"), false, true, false),
            (json!("5 %"), false, true, false),
            (json!("-5%"), false, true, false),
            (json!("1.5"), false, true, false),
        ] {
            assert_eq!(int_or_percent_ok(&v), format_ok, "{v}");
            assert_eq!(percent_at_most_100(&v), range_ok, "{v}");
            assert_eq!(is_zero(&v), zero, "{v}");
        }
    }

    #[test]
    fn every_broken_rule_and_bound_of_a_document_is_reported() {
        let text = GOOD.replace(
            "replicas: 3",
            "replicas: -2\n  minReadySeconds: 900\n  drainTimeoutSeconds: 0\n  volumeDetachTimeoutSeconds: -1",
        );
        let errors = parse(&text.replace("maxSurge: \"25%\"", "maxSurge: 0"), "x.yaml").unwrap_err();
        let got: Vec<(&str, &str)> = errors.iter().map(|e| (e.field.as_str(), e.message.as_str())).collect();
        assert_eq!(
            got,
            [
                ("spec.replicas", "should be greater than or equal to 0"),
                ("spec.volumeDetachTimeoutSeconds", "should be greater than or equal to 0"),
                ("spec.strategy.rollingUpdate.maxUnavailable", "must not be 0 when maxSurge is 0"),
                ("spec.drainTimeoutSeconds", "must be at least 1 (a drain always has a deadline)"),
                ("spec.progressDeadlineSeconds", "must be greater than minReadySeconds"),
            ],
            "{errors:?}"
        );
    }

    #[test]
    fn the_rules_know_the_types_defaults() {
        let md: MachineDeploymentSpec =
            serde_json::from_value(json!({"replicas": 1, "template": {"spec": {"classRef": {"name": "c"}}}})).unwrap();
        assert_eq!(md.progress_deadline_seconds, DEFAULT_PROGRESS_DEADLINE);
        assert_eq!(md.min_ready_seconds, 0);
        assert_eq!(md.strategy.rolling_update.max_surge, IntOrPercent::Int(1), "the not-both-0 rule's default");
        assert_eq!(md.strategy.rolling_update.max_unavailable, IntOrPercent::Int(0));
        let pool: MachinePoolSpec =
            serde_json::from_value(json!({"replicas": 1, "template": {"spec": {"classRef": {"name": "c"}}}})).unwrap();
        assert_eq!(pool.strategy, md.strategy.rolling_update);
        // Every default passes every rule.
        let spec = serde_json::to_value(&md).unwrap();
        for rule in rules().iter().filter(|r| r.kind == Kind::MachineDeployment) {
            assert!(rule.holds(&json!({ "spec": spec })), "{}", rule.path());
        }
    }

    #[test]
    fn a_health_check_is_checked_by_its_kinds_validate() {
        let good = "apiVersion: machine.driver.dev/v1alpha1\nkind: MachineHealthCheck\nmetadata: {name: web}\nspec:\n  \
                    selector: {matchLabels: {app: web}}\n  unhealthyConditions: [{type: Ready, status: Unknown, timeoutSeconds: 60}]\n";
        let objs = parse(good, "x.yaml").unwrap();
        let AnyObject::MachineHealthCheck(h) = &objs[0] else { panic!("{objs:?}") };
        assert_eq!(h.spec.max_unhealthy, IntOrPercent::Str("100%".into()), "the default");
        let errors = parse(&good.replace("type: Ready", "type: MemoryPressure"), "x.yaml").unwrap_err();
        let e = errors[0].to_string();
        assert!(
            e.ends_with("spec.unhealthyConditions[0].type: unknown variant `MemoryPressure`, expected `Ready`"),
            "{e}"
        );
        for (from, to, field) in [
            ("{matchLabels: {app: web}}", "{}", "spec.selector.matchLabels"),
            ("type: Ready", "type: MemoryPressure", "spec.unhealthyConditions[0].type"),
            ("status: Unknown", "status: \"True\"", "spec.unhealthyConditions[0].status"),
            ("  selector:", "  maxUnhealthy: 120%\n  selector:", "spec.maxUnhealthy"),
            ("timeoutSeconds: 60", "timeoutSeconds: -1", "spec.unhealthyConditions[0].timeoutSeconds"),
        ] {
            let errors = parse(&good.replace(from, to), "x.yaml").unwrap_err();
            assert_eq!(errors[0].field, field, "{errors:?}");
        }
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
