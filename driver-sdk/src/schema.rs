//! A small JSON Schema validator for provider specs.
//!
//! It covers the keywords drivers use to describe a provider spec: `type`, `properties`,
//! `required`, `additionalProperties`, `enum`, `const`, `minimum`, `maximum`, `minLength`,
//! `maxLength`, `pattern`, `items`, `minItems`, `maxItems`. Unknown keywords are ignored (as
//! JSON Schema requires). Violations name the field as `provider_spec.a.b[2]`.

use regex::Regex;
use serde_json::Value;

use crate::error::Violation;

/// Checks `value` against `schema`; returns every violation found (empty = valid).
pub fn validate(schema: &Value, value: &Value, root: &str) -> Vec<Violation> {
    let mut out = Vec::new();
    check(schema, value, root, &mut out);
    out
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn type_matches(expected: &str, v: &Value) -> bool {
    let actual = type_name(v);
    actual == expected || (expected == "number" && actual == "integer")
}

fn check(schema: &Value, value: &Value, path: &str, out: &mut Vec<Violation>) {
    let Value::Object(s) = schema else { return };
    if let Some(t) = s.get("type") {
        let ok = match t {
            Value::String(t) => type_matches(t, value),
            Value::Array(ts) => ts.iter().filter_map(Value::as_str).any(|t| type_matches(t, value)),
            _ => true,
        };
        if !ok {
            out.push(Violation::new(path, format!("must be of type {t}, got {}", type_name(value))));
            return;
        }
    }
    if let Some(Value::Array(allowed)) = s.get("enum") {
        if !allowed.contains(value) {
            out.push(Violation::new(path, format!("must be one of {}", Value::Array(allowed.clone()))));
        }
    }
    if let Some(c) = s.get("const") {
        if c != value {
            out.push(Violation::new(path, format!("must be {c}")));
        }
    }
    match value {
        Value::Object(obj) => {
            let props = s.get("properties").and_then(Value::as_object);
            if let Some(Value::Array(required)) = s.get("required") {
                for name in required.iter().filter_map(Value::as_str) {
                    if !obj.contains_key(name) {
                        out.push(Violation::new(format!("{path}.{name}"), "is required"));
                    }
                }
            }
            for (k, v) in obj {
                let child = format!("{path}.{k}");
                match props.and_then(|p| p.get(k)) {
                    Some(sub) => check(sub, v, &child, out),
                    None => match s.get("additionalProperties") {
                        Some(Value::Bool(false)) => out.push(Violation::new(child, "is not a known field")),
                        Some(sub @ Value::Object(_)) => check(sub, v, &child, out),
                        _ => {}
                    },
                }
            }
        }
        Value::Array(items) => {
            if let Some(min) = s.get("minItems").and_then(Value::as_u64) {
                if (items.len() as u64) < min {
                    out.push(Violation::new(path, format!("must have at least {min} items")));
                }
            }
            if let Some(max) = s.get("maxItems").and_then(Value::as_u64) {
                if items.len() as u64 > max {
                    out.push(Violation::new(path, format!("must have at most {max} items")));
                }
            }
            if let Some(sub) = s.get("items") {
                for (i, item) in items.iter().enumerate() {
                    check(sub, item, &format!("{path}[{i}]"), out);
                }
            }
        }
        Value::String(text) => {
            let len = text.chars().count() as u64;
            if let Some(min) = s.get("minLength").and_then(Value::as_u64) {
                if len < min {
                    out.push(Violation::new(path, format!("must be at least {min} characters")));
                }
            }
            if let Some(max) = s.get("maxLength").and_then(Value::as_u64) {
                if len > max {
                    out.push(Violation::new(path, format!("must be at most {max} characters")));
                }
            }
            if let Some(p) = s.get("pattern").and_then(Value::as_str) {
                match Regex::new(p) {
                    Ok(re) if !re.is_match(text) => out.push(Violation::new(path, format!("must match {p}"))),
                    _ => {}
                }
            }
        }
        Value::Number(n) => {
            let x = n.as_f64().unwrap_or(0.0);
            if let Some(min) = s.get("minimum").and_then(Value::as_f64) {
                if x < min {
                    out.push(Violation::new(path, format!("must be at least {min}")));
                }
            }
            if let Some(max) = s.get("maximum").and_then(Value::as_f64) {
                if x > max {
                    out.push(Violation::new(path, format!("must be at most {max}")));
                }
            }
        }
        _ => {}
    }
}

/// Checks the name rules of machines and pools: DNS-subdomain style, 1..=253 characters of
/// `[a-z0-9.-]`, starting and ending with an alphanumeric character.
pub fn check_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("is required");
    }
    if name.len() > 253 {
        return Err("must be at most 253 characters");
    }
    let ok_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.';
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    if !name.chars().all(ok_char) || !alnum(name.chars().next()) || !alnum(name.chars().last()) {
        return Err(
            "must consist of lower-case letters, digits, '-' and '.', and start and end with a letter or digit",
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema() -> Value {
        json!({
            "type": "object",
            "required": ["size"],
            "additionalProperties": false,
            "properties": {
                "size": {"type": "string", "enum": ["small", "large"]},
                "disk": {"type": "integer", "minimum": 10, "maximum": 100},
                "zone": {"type": "string", "pattern": "^zone-[a-z]$"},
                "tags": {"type": "object", "additionalProperties": {"type": "string"}},
                "nics": {"type": "array", "maxItems": 2, "items": {"type": "string", "minLength": 1}}
            }
        })
    }

    #[test]
    fn valid_spec_has_no_violations() {
        let spec = json!({"size": "small", "disk": 20, "zone": "zone-a", "tags": {"a": "b"}, "nics": ["x"]});
        assert!(validate(&schema(), &spec, "provider_spec").is_empty());
    }

    #[test]
    fn each_violation_names_its_field() {
        let spec = json!({"disk": 5, "zone": "z", "tags": {"a": 1}, "nics": ["", "b", "c"], "color": "red"});
        let fields: Vec<String> = validate(&schema(), &spec, "provider_spec").into_iter().map(|v| v.field).collect();
        for f in [
            "provider_spec.size",
            "provider_spec.disk",
            "provider_spec.zone",
            "provider_spec.tags.a",
            "provider_spec.nics",
            "provider_spec.nics[0]",
            "provider_spec.color",
        ] {
            assert!(fields.iter().any(|x| x == f), "{f} missing from {fields:?}");
        }
    }

    #[test]
    fn names_follow_dns_rules() {
        assert!(check_name("web-0.a").is_ok());
        for bad in ["", "-a", "a-", "Web", "a_b", &"a".repeat(254)] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }
}
