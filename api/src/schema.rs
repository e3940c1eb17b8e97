//! Kubernetes *structural* schemas from Rust types: schemars describes a type (OpenAPI 3,
//! inlined), and [`structural`] rewrites that description the way the API server wants it (no
//! `anyOf` for optional fields, one `enum` for a unit enum, int-or-string for `IntOrPercent`,
//! `x-kubernetes-preserve-unknown-fields` for free-form provider specs). The CRDs
//! ([`crate::crd`]) are made of these.

use schemars::JsonSchema;
use serde_json::{json, Map, Value};

/// The structural schema of `T` (inlined).
pub fn schema_of<T: JsonSchema>() -> Value {
    let mut settings = schemars::generate::SchemaSettings::openapi3();
    settings.inline_subschemas = true;
    structural(settings.into_generator().into_root_schema_for::<T>().to_value())
}

/// Rewrites a schemars (OpenAPI 3) schema into a Kubernetes structural schema.
pub fn structural(schema: Value) -> Value {
    let Value::Object(mut o) = schema else {
        // `true` / `{}`: anything goes (serde_json::Value fields).
        return json!({ "x-kubernetes-preserve-unknown-fields": true });
    };
    for k in ["$schema", "title", "default", "examples", "example", "deprecated", "readOnly", "writeOnly", "$defs"] {
        o.remove(k);
    }
    if o.get("additionalProperties") == Some(&Value::Bool(false)) {
        o.remove("additionalProperties");
    }
    // An optional field whose type is itself a combination (`Option<IntOrPercent>`): schemars
    // says `anyOf: [T, null]`; absent is what optional means in a structural schema, so it is T.
    if let Some(Value::Array(variants)) = o.get("anyOf") {
        let is_null = |v: &Value| v.get("enum") == Some(&json!([null])) || v.get("type") == Some(&json!("null"));
        if variants.len() == 2 && variants.iter().any(is_null) {
            let inner = variants.iter().find(|v| !is_null(v)).cloned();
            o.remove("anyOf");
            if let Some(Value::Object(inner)) = inner {
                for (k, v) in inner {
                    o.entry(k).or_insert(v);
                }
            }
            return structural(Value::Object(o));
        }
    }
    for combinator in ["anyOf", "oneOf"] {
        // A documented unit enum: one string `enum` per variant → one `enum`.
        if let Some(Value::Array(variants)) = o.get(combinator) {
            let values: Option<Vec<Value>> = variants
                .iter()
                .map(|v| match (v.get("type").and_then(Value::as_str), v.get("enum")) {
                    (Some("string"), Some(Value::Array(e))) => Some(e.clone()),
                    _ => None,
                })
                .collect::<Option<Vec<Vec<Value>>>>()
                .map(|e| e.concat());
            if let Some(values) = values {
                o.remove(combinator);
                o.insert("type".into(), json!("string"));
                o.insert("enum".into(), Value::Array(values));
                continue;
            }
        }
        // An untagged integer-or-string enum (IntOrPercent).
        if let Some(Value::Array(variants)) = o.get(combinator) {
            let types: Vec<&str> = variants.iter().filter_map(|v| v.get("type").and_then(Value::as_str)).collect();
            if types.len() == 2 && types.contains(&"integer") && types.contains(&"string") {
                o.remove(combinator);
                o.insert("x-kubernetes-int-or-string".into(), Value::Bool(true));
                // A number or a percentage is short; the bound keeps the CEL rules on it cheap
                // (the API server estimates a rule's cost from the longest string it may see).
                o.insert("maxLength".into(), json!(16));
            }
        }
    }
    if let Some(Value::String(f)) = o.get("format") {
        if f.starts_with("uint") || f == "int" {
            o.insert("format".into(), json!("int64"));
        }
    }
    if let Some(Value::Object(props)) = o.remove("properties") {
        let props: Map<String, Value> = props.into_iter().map(|(k, v)| (k, structural(v))).collect();
        o.insert("properties".into(), Value::Object(props));
    }
    for k in ["items", "additionalProperties"] {
        if let Some(v) = o.remove(k) {
            o.insert(k.into(), structural(v));
        }
    }
    if o.is_empty() || (o.len() == 1 && o.contains_key("description")) {
        o.insert("x-kubernetes-preserve-unknown-fields".into(), Value::Bool(true));
    }
    if o.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true)) && !o.contains_key("type") {
        // Provider specs are JSON objects.
        o.insert("type".into(), json!("object"));
    }
    Value::Object(o)
}
