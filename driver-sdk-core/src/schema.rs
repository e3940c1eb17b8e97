//! Provider-spec schemas: JSON Schema draft 2020-12, enforced as written.
//!
//! A driver's `DriverInfo::provider_spec_schema` (in `driver-sdk`) is
//! compiled once, when the server starts, into a [`ProviderSchema`]; every provider spec a call
//! carries is checked against it by the [`jsonschema`] crate before the driver sees it.
//! Violations name the field as `provider_spec.a.b[2]`.
//!
//! # Dialect
//!
//! Schemas are [JSON Schema draft 2020-12](https://json-schema.org/draft/2020-12) — the whole
//! draft: `$ref` to `$defs`, `oneOf` / `anyOf` / `allOf` / `not`, `if` / `then` / `else`,
//! `prefixItems`, `patternProperties`, `dependentRequired`, `unevaluatedProperties` and the rest.
//! `$schema` may be left out; if present it must name draft 2020-12 ([`DIALECT`]). Two points go
//! beyond the draft's defaults, so that a schema means what it reads:
//!
//! - `format` is **asserted**, not just an annotation: `"format": "ipv4"` refuses `"1.2.3"`.
//!   The formats are `date`, `date-time`, `time`, `duration`, `email`, `hostname`, `ipv4`,
//!   `ipv6`, `uri`, `uri-reference`, `iri`, `iri-reference`, `uri-template`, `uuid`,
//!   `json-pointer`, `relative-json-pointer` and `regex`; any other name (including `idn-email`
//!   and `idn-hostname`) is refused.
//! - `pattern` (and `patternProperties`) use the linear-time `regex` engine after the usual
//!   ECMA-262 translation: no look-around or back-references, and no catastrophic backtracking on
//!   a caller's input. A pattern it cannot compile is refused.
//!
//! # Refused at start
//!
//! [`ProviderSchema::compile`] refuses, with the keyword and its place in the schema as a JSON
//! pointer (`#/properties/size`), a schema that
//!
//! - is not a valid draft 2020-12 schema (checked against the meta-schema), e.g.
//!   `"minimum": "5"`;
//! - has a `pattern` that does not compile, or a `format` that is not known;
//! - has a `$ref` (or `$dynamicRef`) that does not start with `#` — only references within the
//!   schema are allowed, nothing is fetched — or that does not resolve;
//! - uses a keyword the validator would silently ignore: a typo (`requried`), a word of another
//!   draft (`definitions`, `dependencies`, `additionalItems`, `id`, `$recursiveRef`) or of
//!   OpenAPI (`nullable`), an extension (`x-kubernetes-...`), or one of the content keywords
//!   (`contentEncoding`, `contentMediaType`, `contentSchema`) and `$vocabulary`, which draft
//!   2020-12 defines but does not assert.
//!
//! The meta-data annotations `title`, `description`, `default`, `examples`, `deprecated`,
//! `readOnly`, `writeOnly` and `$comment` are allowed: they document and constrain nothing
//! (`default` is not applied, `readOnly` is not enforced). Keywords are looked for only where a
//! schema is: the values of `enum`, `const`, `default` and `examples` are data, not schemas.

use std::fmt;

use jsonschema::error::{TypeKind, ValidationErrorKind};
use jsonschema::{PatternOptions, ValidationError, Validator};
use serde_json::Value;

use crate::Violation;

/// The `$schema` of the one dialect provider-spec schemas are written in (draft 2020-12).
pub const DIALECT: &str = "https://json-schema.org/draft/2020-12/schema";

/// A provider-spec schema, checked and compiled once; [`validate`](Self::validate) is cheap.
///
/// See the [module docs](self) for the dialect and what is refused.
pub struct ProviderSchema {
    validator: Validator,
}

impl fmt::Debug for ProviderSchema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProviderSchema").finish_non_exhaustive()
    }
}

/// Why a provider-spec schema is refused. Each names the place in the schema as a JSON pointer
/// fragment (`#` is the root, `#/properties/size` a property's schema).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SchemaError {
    /// `$schema` names a dialect other than draft 2020-12.
    #[error("$schema at {path} is {found}: provider-spec schemas are JSON Schema draft 2020-12; set $schema to \"{DIALECT}\" or leave it out")]
    Dialect {
        /// Where the `$schema` is.
        path: String,
        /// What it says.
        found: Value,
    },
    /// A keyword draft 2020-12 does not define: a validator would silently ignore it.
    #[error("unknown keyword {keyword:?} at {path}: JSON Schema draft 2020-12 does not define it, so it would be silently ignored{}", hint.as_deref().map(|h| format!(" ({h})")).unwrap_or_default())]
    UnknownKeyword {
        /// The keyword.
        keyword: String,
        /// The schema holding it.
        path: String,
        /// What was probably meant.
        hint: Option<String>,
    },
    /// A keyword draft 2020-12 defines as an annotation only, which would read as a constraint
    /// nobody enforces.
    #[error("keyword {keyword:?} at {path} would not be enforced: {reason}")]
    UnenforcedKeyword {
        /// The keyword.
        keyword: String,
        /// The schema holding it.
        path: String,
        /// Why, and what to do instead.
        reason: &'static str,
    },
    /// A `$ref` or `$dynamicRef` that points outside the schema document.
    #[error("{keyword} {reference:?} at {path} points outside the schema: only references within it, such as \"#/$defs/name\", are allowed")]
    ExternalRef {
        /// `$ref` or `$dynamicRef`.
        keyword: &'static str,
        /// The reference.
        reference: String,
        /// The schema holding it.
        path: String,
    },
    /// A `$ref` within the schema that points at nothing.
    #[error("$ref {reference:?} at {path} points at nothing in the schema")]
    UnresolvedRef {
        /// The reference.
        reference: String,
        /// The schema holding it.
        path: String,
    },
    /// A `format` the SDK cannot check.
    #[error("format {format:?} at {path} is not known: formats are checked, and the known ones are {}", FORMATS.join(", "))]
    UnknownFormat {
        /// The format.
        format: String,
        /// The schema holding it.
        path: String,
    },
    /// The schema does not compile: it breaks the draft 2020-12 meta-schema, a pattern is not a
    /// regular expression the SDK can use, or a reference does not resolve.
    #[error("invalid schema at {path}: {message}")]
    Invalid {
        /// Where in the schema, as far as the validator says.
        path: String,
        /// What is wrong.
        message: String,
    },
}

impl ProviderSchema {
    /// Checks `schema` and compiles it.
    ///
    /// # Errors
    /// The schema is not a valid draft 2020-12 schema, or uses a keyword, a reference or a
    /// dialect that would make it weaker than it reads (see the [module docs](self)).
    pub fn compile(schema: &Value) -> Result<Self, SchemaError> {
        Walk { root: schema }.schema(schema, &mut String::from("#"), false)?;
        let validator = jsonschema::draft202012::options()
            .should_validate_formats(true)
            .should_ignore_unknown_formats(false)
            .with_pattern_options(PatternOptions::regex())
            .offline()
            .build(schema)
            .map_err(|e| SchemaError::Invalid {
                path: format!("#{}", e.instance_path()),
                message: schema_message(&e),
            })?;
        Ok(Self { validator })
    }

    /// Checks `value` against the schema; returns every violation found (empty = valid). Fields
    /// are named from `root`: `root.a.b[2]`.
    pub fn validate(&self, value: &Value, root: &str) -> Vec<Violation> {
        let mut out = Vec::new();
        for e in self.validator.iter_errors(value) {
            violations(&e, value, root, &mut out);
        }
        out
    }
}

/// Compiles `schema` and checks `value` against it; returns every violation found (empty =
/// valid). A schema that [`ProviderSchema::compile`] refuses gives one violation at `root`.
///
/// Servers compile once ([`ProviderSchema`]); this is for tests and one-off checks.
pub fn validate(schema: &Value, value: &Value, root: &str) -> Vec<Violation> {
    match ProviderSchema::compile(schema) {
        Ok(s) => s.validate(value, root),
        Err(e) => vec![Violation::new(root, format!("cannot be checked: the schema is refused: {e}"))],
    }
}

// ------------------------------------------------------------------------ keywords of the schema

/// Keywords whose value is one schema.
const SCHEMA_KEYWORDS: &[&str] = &[
    "additionalProperties",
    "propertyNames",
    "items",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedItems",
    "unevaluatedProperties",
];
/// Keywords whose value maps names to schemas.
const SCHEMA_MAP_KEYWORDS: &[&str] = &["properties", "patternProperties", "$defs", "dependentSchemas"];
/// Keywords whose value is an array of schemas.
const SCHEMA_ARRAY_KEYWORDS: &[&str] = &["prefixItems", "allOf", "anyOf", "oneOf"];
/// The other keywords of draft 2020-12 that are enforced or are plain documentation. Their values
/// are not schemas and are not looked into.
const VALUE_KEYWORDS: &[&str] = &[
    // core
    "$schema",
    "$id",
    "$ref",
    "$anchor",
    "$dynamicRef",
    "$dynamicAnchor",
    "$comment",
    // validation
    "type",
    "const",
    "enum",
    "multipleOf",
    "maximum",
    "exclusiveMaximum",
    "minimum",
    "exclusiveMinimum",
    "maxLength",
    "minLength",
    "pattern",
    "maxItems",
    "minItems",
    "uniqueItems",
    "maxContains",
    "minContains",
    "maxProperties",
    "minProperties",
    "required",
    "dependentRequired",
    // format (asserted here)
    "format",
    // meta-data annotations
    "title",
    "description",
    "default",
    "deprecated",
    "readOnly",
    "writeOnly",
    "examples",
];

/// The formats checked (`jsonschema`'s for draft 2020-12, without the `idna` feature).
const FORMATS: &[&str] = &[
    "date",
    "date-time",
    "time",
    "duration",
    "email",
    "hostname",
    "ipv4",
    "ipv6",
    "uri",
    "uri-reference",
    "iri",
    "iri-reference",
    "uri-template",
    "uuid",
    "json-pointer",
    "relative-json-pointer",
    "regex",
];

/// Keywords of draft 2020-12 that only annotate, and would read as constraints.
fn unenforced(keyword: &str) -> Option<&'static str> {
    Some(match keyword {
        "contentEncoding" | "contentMediaType" | "contentSchema" => {
            "draft 2020-12 makes the content keywords annotations only, so nothing would check the content; use pattern, or check it in Driver::validate_machine_class"
        }
        "$vocabulary" => "it only means something in a meta-schema",
        _ => return None,
    })
}

/// What an unknown keyword was probably meant to be.
fn hint(keyword: &str) -> Option<String> {
    let known = match keyword {
        "definitions" => return Some("draft 2020-12 calls it \"$defs\"".into()),
        "dependencies" => return Some("draft 2020-12 has \"dependentRequired\" and \"dependentSchemas\"".into()),
        "additionalItems" => return Some("draft 2020-12 uses \"prefixItems\" with \"items\"".into()),
        "id" => return Some("draft 2020-12 calls it \"$id\"".into()),
        "$recursiveRef" | "$recursiveAnchor" => {
            return Some("draft 2020-12 has \"$dynamicRef\" and \"$dynamicAnchor\"".into())
        }
        "nullable" => return Some("that is OpenAPI; write \"type\": [\"...\", \"null\"]".into()),
        _ => SCHEMA_KEYWORDS.iter().chain(SCHEMA_MAP_KEYWORDS).chain(SCHEMA_ARRAY_KEYWORDS).chain(VALUE_KEYWORDS),
    };
    let lower = keyword.to_ascii_lowercase();
    known
        .map(|k| (edit_distance(&lower, &k.to_ascii_lowercase()), k))
        .filter(|(d, _)| *d <= 2)
        .min()
        .map(|(_, k)| format!("did you mean {k:?}?"))
}

/// Levenshtein distance, for suggestions.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != *cb)).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// Walks every schema position of a schema document and refuses what the validator would
/// ignore or cannot check: unknown and annotation-only keywords, other dialects, references
/// leaving the document or pointing at nothing, unknown formats. Values that are not schemas
/// (`enum`, `examples`, …) are not entered; wrongly shaped values are left to the meta-schema.
struct Walk<'a> {
    root: &'a Value,
}

impl Walk<'_> {
    /// Checks the schema `schema` at JSON pointer `path`; `embedded` once inside a subschema
    /// with its own `$id` (where `#/...` is relative to that subschema).
    fn schema(&self, schema: &Value, path: &mut String, embedded: bool) -> Result<(), SchemaError> {
        let Value::Object(map) = schema else { return Ok(()) };
        let embedded = embedded || (path.len() > 1 && map.contains_key("$id"));
        for (keyword, value) in map {
            let k = keyword.as_str();
            let len = path.len();
            if SCHEMA_KEYWORDS.contains(&k) {
                push_segment(path, k);
                self.schema(value, path, embedded)?;
            } else if SCHEMA_MAP_KEYWORDS.contains(&k) {
                push_segment(path, k);
                for (name, sub) in value.as_object().into_iter().flatten() {
                    let len = path.len();
                    push_segment(path, name);
                    self.schema(sub, path, embedded)?;
                    path.truncate(len);
                }
            } else if SCHEMA_ARRAY_KEYWORDS.contains(&k) {
                push_segment(path, k);
                for (i, sub) in value.as_array().into_iter().flatten().enumerate() {
                    let len = path.len();
                    push_segment(path, &i.to_string());
                    self.schema(sub, path, embedded)?;
                    path.truncate(len);
                }
            } else if VALUE_KEYWORDS.contains(&k) {
                self.value_keyword(k, value, path, embedded)?;
            } else if let Some(reason) = unenforced(k) {
                return Err(SchemaError::UnenforcedKeyword { keyword: keyword.clone(), path: path.clone(), reason });
            } else {
                return Err(SchemaError::UnknownKeyword {
                    keyword: keyword.clone(),
                    path: path.clone(),
                    hint: hint(k),
                });
            }
            path.truncate(len);
        }
        Ok(())
    }

    fn value_keyword(&self, keyword: &str, value: &Value, path: &str, embedded: bool) -> Result<(), SchemaError> {
        let path = || path.to_string();
        match (keyword, value) {
            ("$schema", v) if v.as_str().map(|s| s.trim_end_matches('#')) != Some(DIALECT) => {
                Err(SchemaError::Dialect { path: path(), found: v.clone() })
            }
            ("$ref" | "$dynamicRef", Value::String(r)) if !r.starts_with('#') => Err(SchemaError::ExternalRef {
                keyword: if keyword == "$ref" { "$ref" } else { "$dynamicRef" },
                reference: r.clone(),
                path: path(),
            }),
            // A JSON pointer into this document (not an anchor, not percent-encoded, not inside
            // an embedded resource, where the validator resolves it).
            ("$ref", Value::String(r)) if !embedded && !r.contains('%') && (r == "#" || r.starts_with("#/")) => {
                match self.root.pointer(&r[1..]) {
                    Some(_) => Ok(()),
                    None => Err(SchemaError::UnresolvedRef { reference: r.clone(), path: path() }),
                }
            }
            ("format", Value::String(f)) if !FORMATS.contains(&f.as_str()) => {
                Err(SchemaError::UnknownFormat { format: f.clone(), path: path() })
            }
            _ => Ok(()),
        }
    }
}

/// Appends one JSON pointer segment, escaped.
fn push_segment(path: &mut String, segment: &str) {
    path.push('/');
    path.push_str(&segment.replace('~', "~0").replace('/', "~1"));
}

/// The validator's message for a schema it refuses, in the SDK's words where they help.
fn schema_message(e: &ValidationError<'_>) -> String {
    let last = e.instance_path().as_str().rsplit('/').next().unwrap_or_default();
    match e.kind() {
        ValidationErrorKind::Format { format } if format == "regex" => format!(
            "{} is not a regular expression the SDK can use (ECMA-262 syntax, without look-around or back-references)",
            e.instance()
        ),
        _ if last == "type" && matches!(e.instance().as_ref(), Value::String(_)) => format!(
            "{} is not a JSON Schema type (array, boolean, integer, null, number, object, string)",
            e.instance()
        ),
        _ => {
            let full = e.to_string();
            match full.char_indices().nth(300) {
                Some((cut, _)) => format!("{}…", &full[..cut]),
                None => full,
            }
        }
    }
}

// ------------------------------------------------------------------------------------ violations

/// Turns one validator error into violations named the SDK's way.
fn violations(e: &ValidationError<'_>, instance: &Value, root: &str, out: &mut Vec<Violation>) {
    let at = field_path(root, instance, e.instance_path().as_str());
    match e.kind() {
        ValidationErrorKind::Required { property } => {
            let name = property.as_str().map_or_else(|| property.to_string(), str::to_string);
            out.push(Violation::new(format!("{at}.{name}"), "is required"));
        }
        ValidationErrorKind::AdditionalProperties { unexpected }
        | ValidationErrorKind::UnevaluatedProperties { unexpected } => {
            for name in unexpected {
                out.push(Violation::new(format!("{at}.{name}"), "is not a known field"));
            }
        }
        ValidationErrorKind::PropertyNames { error } => match error.instance().as_str() {
            Some(name) => out.push(Violation::new(
                format!("{at}.{name}"),
                format!("is not an allowed field name: it {}", describe(error, instance, root)),
            )),
            None => out.push(Violation::new(at, "has a field name that is not allowed")),
        },
        _ => out.push(Violation::new(at, describe(e, instance, root))),
    }
}

/// What is wrong, in the words of today's messages (`must be at least 10`, `is required`).
fn describe(e: &ValidationError<'_>, instance: &Value, root: &str) -> String {
    use ValidationErrorKind as K;
    match e.kind() {
        K::Required { property } => format!("must have the field {property}"),
        K::AdditionalProperties { unexpected } | K::UnevaluatedProperties { unexpected } => {
            format!("has fields that are not known: {}", unexpected.join(", "))
        }
        K::PropertyNames { error } => {
            format!("has a field name that is not allowed: {}", describe(error, instance, root))
        }
        K::Type { kind } => {
            let expected = match kind {
                TypeKind::Single(t) => t.to_string(),
                TypeKind::Multiple(ts) => ts.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(" or "),
            };
            format!("must be of type {expected}, got {}", type_name(e.instance()))
        }
        K::Enum { options } => format!("must be one of {options}"),
        K::Constant { expected_value } => format!("must be {expected_value}"),
        K::Format { format } => format!("must be a valid {format:?} (format)"),
        K::Pattern { pattern } => format!("must match {pattern}"),
        K::BacktrackLimitExceeded { .. } | K::RegexEngineFailure { .. } => {
            "could not be matched against its pattern".to_string()
        }
        K::Minimum { limit } => format!("must be at least {limit}"),
        K::Maximum { limit } => format!("must be at most {limit}"),
        K::ExclusiveMinimum { limit } => format!("must be greater than {limit}"),
        K::ExclusiveMaximum { limit } => format!("must be less than {limit}"),
        K::MultipleOf { multiple_of } => format!("must be a multiple of {multiple_of}"),
        K::MinLength { limit } => format!("must be at least {limit} characters"),
        K::MaxLength { limit } => format!("must be at most {limit} characters"),
        K::MinItems { limit } => format!("must have at least {limit} items"),
        K::MaxItems { limit } => format!("must have at most {limit} items"),
        K::AdditionalItems { limit } => format!("must have at most {limit} items"),
        K::MinProperties { limit } => format!("must have at least {limit} fields"),
        K::MaxProperties { limit } => format!("must have at most {limit} fields"),
        K::UniqueItems => "must not contain the same item twice".to_string(),
        K::Contains => "must contain an item matching the schema's \"contains\" (as many as it asks)".to_string(),
        K::UnevaluatedItems { unexpected } => format!("has items the schema does not allow: {}", unexpected.join(", ")),
        K::FalseSchema => "is not allowed".to_string(),
        K::Not { .. } => "must not match the schema under \"not\"".to_string(),
        K::AnyOf { context } => {
            format!("must match at least one of the anyOf alternatives; {}", alternatives(context, instance, root))
        }
        K::OneOfNotValid { context } => {
            format!(
                "must match exactly one of the oneOf alternatives but matches none; {}",
                alternatives(context, instance, root)
            )
        }
        K::OneOfMultipleValid { .. } => {
            "must match exactly one of the oneOf alternatives but matches more than one".to_string()
        }
        K::ContentEncoding { content_encoding } => format!("must be {content_encoding}-encoded"),
        K::ContentMediaType { content_media_type } => format!("must be {content_media_type}"),
        K::FromUtf8 { .. } => "must decode to UTF-8 text".to_string(),
        K::Custom { message, .. } => message.clone(),
        K::Referencing(err) => format!("cannot be checked: {err}"),
    }
}

/// Why each alternative of an `anyOf` / `oneOf` failed (its first reason), e.g.
/// `alternative 1: provider_spec.id: is required; alternative 2: ...`.
fn alternatives(context: &[Vec<ValidationError<'static>>], instance: &Value, root: &str) -> String {
    let parts: Vec<String> = context
        .iter()
        .enumerate()
        .filter_map(|(i, errors)| {
            let mut vs = Vec::new();
            violations(errors.first()?, instance, root, &mut vs);
            let v = vs.into_iter().next()?;
            Some(format!("alternative {}: {}: {}", i + 1, v.field, v.description))
        })
        .collect();
    parts.join("; ")
}

/// `root.a.b[2]` for the JSON pointer `/a/b/2`, looking at `instance` to tell an array index
/// from a field named like a number.
fn field_path(root: &str, instance: &Value, pointer: &str) -> String {
    let mut out = root.to_string();
    let mut at = Some(instance);
    for raw in pointer.split('/').skip(1) {
        let segment = raw.replace("~1", "/").replace("~0", "~");
        let index = segment.parse::<usize>().ok();
        match (at, index) {
            (Some(Value::Array(items)), Some(i)) => {
                out.push_str(&format!("[{i}]"));
                at = items.get(i);
            }
            (Some(Value::Object(fields)), _) => {
                at = fields.get(&segment);
                out.push('.');
                out.push_str(&segment);
            }
            (_, Some(i)) => {
                at = None;
                out.push_str(&format!("[{i}]"));
            }
            (_, None) => {
                at = None;
                out.push('.');
                out.push_str(&segment);
            }
        }
    }
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

/// Checks the name rules of machines and pools (the crate root's [`check_name`], here where the
/// SDK's request checks have always found it).
pub use crate::check_name;

#[cfg(test)]
mod tests;
