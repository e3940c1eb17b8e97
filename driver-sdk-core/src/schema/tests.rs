use serde_json::json;

use super::*;

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

/// The violations of `spec` against `schema`, as sorted `field: description` lines.
fn check(schema: &Value, spec: Value) -> Vec<String> {
    let compiled = ProviderSchema::compile(schema).expect("the schema compiles");
    let mut out: Vec<String> = compiled
        .validate(&spec, "provider_spec")
        .into_iter()
        .map(|v| format!("{}: {}", v.field, v.description))
        .collect();
    out.sort();
    out
}

/// The fields `spec` violates, sorted.
fn fields(schema: &Value, spec: Value) -> Vec<String> {
    check(schema, spec).into_iter().map(|line| line.split(": ").next().unwrap_or_default().to_string()).collect()
}

/// Why `schema` is refused.
fn refused(schema: Value) -> SchemaError {
    ProviderSchema::compile(&schema).expect_err("the schema is refused")
}

#[test]
fn valid_spec_has_no_violations() {
    let spec = json!({"size": "small", "disk": 20, "zone": "zone-a", "tags": {"a": "b"}, "nics": ["x"]});
    assert!(validate(&schema(), &spec, "provider_spec").is_empty());
}

#[test]
fn each_violation_names_its_field() {
    let spec = json!({"disk": 5, "zone": "z", "tags": {"a": 1}, "nics": ["", "b", "c"], "color": "red"});
    assert_eq!(
        check(&schema(), spec),
        [
            "provider_spec.color: is not a known field",
            "provider_spec.disk: must be at least 10",
            "provider_spec.nics: must have at most 2 items",
            "provider_spec.nics[0]: must be at least 1 characters",
            "provider_spec.size: is required",
            "provider_spec.tags.a: must be of type string, got integer",
            "provider_spec.zone: must match ^zone-[a-z]$",
        ]
    );
}

#[test]
fn the_free_function_reports_a_refused_schema_at_the_root() {
    let v = validate(&json!({"type": "object", "requried": ["a"]}), &json!({}), "provider_spec");
    assert_eq!(v.len(), 1);
    assert_eq!(v[0].field, "provider_spec");
    assert!(v[0].description.contains("\"requried\""), "{}", v[0].description);
}

#[test]
fn one_of_is_enforced() {
    let s = json!({
        "type": "object",
        "properties": {"network": {"oneOf": [
            {"type": "object", "required": ["id"], "properties": {"id": {"type": "string"}}},
            {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}
        ]}}
    });
    assert!(check(&s, json!({"network": {"id": "n-1"}})).is_empty());
    assert!(check(&s, json!({"network": {"name": "default"}})).is_empty());
    assert_eq!(
        check(&s, json!({"network": {}})),
        [
            "provider_spec.network: must match exactly one of the oneOf alternatives but matches none; \
          alternative 1: provider_spec.network.id: is required; alternative 2: provider_spec.network.name: is required"
        ]
    );
    assert_eq!(
        check(&s, json!({"network": {"id": "n-1", "name": "default"}})),
        ["provider_spec.network: must match exactly one of the oneOf alternatives but matches more than one"]
    );
}

#[test]
fn any_of_is_enforced() {
    let s = json!({"properties": {"port": {"anyOf": [
        {"type": "integer", "minimum": 1, "maximum": 65535},
        {"type": "string", "enum": ["http", "https"]}
    ]}}});
    assert!(check(&s, json!({"port": 8080})).is_empty());
    assert!(check(&s, json!({"port": "https"})).is_empty());
    assert_eq!(
        check(&s, json!({"port": 0})),
        ["provider_spec.port: must match at least one of the anyOf alternatives; \
          alternative 1: provider_spec.port: must be at least 1; \
          alternative 2: provider_spec.port: must be of type string, got integer"]
    );
    assert_eq!(fields(&s, json!({"port": "ftp"})), ["provider_spec.port"]);
}

#[test]
fn refs_to_defs_are_enforced_where_they_are_used() {
    let s = json!({
        "$defs": {
            "disk": {
                "type": "object",
                "required": ["sizeGiB"],
                "additionalProperties": false,
                "properties": {"sizeGiB": {"type": "integer", "minimum": 1}, "type": {"$ref": "#/$defs/diskType"}}
            },
            "diskType": {"enum": ["ssd", "hdd"]}
        },
        "type": "object",
        "properties": {"bootDisk": {"$ref": "#/$defs/disk"}, "dataDisks": {"type": "array", "items": {"$ref": "#/$defs/disk"}}}
    });
    assert!(check(&s, json!({"bootDisk": {"sizeGiB": 10}, "dataDisks": [{"sizeGiB": 1, "type": "ssd"}]})).is_empty());
    assert_eq!(
        check(
            &s,
            json!({"bootDisk": {"sizeGiB": 0}, "dataDisks": [{"sizeGiB": 5}, {"type": "tape"}, {"sizeGiB": 1, "x": 1}]})
        ),
        [
            "provider_spec.bootDisk.sizeGiB: must be at least 1",
            "provider_spec.dataDisks[1].sizeGiB: is required",
            "provider_spec.dataDisks[1].type: must be one of [\"ssd\",\"hdd\"]",
            "provider_spec.dataDisks[2].x: is not a known field",
        ]
    );
}

#[test]
fn recursive_refs_follow_the_data() {
    let s = json!({
        "$defs": {"rule": {
            "type": "object",
            "required": ["port"],
            "properties": {"port": {"type": "integer"}, "then": {"type": "array", "items": {"$ref": "#/$defs/rule"}}}
        }},
        "properties": {"rules": {"type": "array", "items": {"$ref": "#/$defs/rule"}}, "loop": {"$ref": "#"}}
    });
    let spec = json!({"rules": [{"port": 1, "then": [{"port": 2, "then": [{"then": []}]}]}], "loop": {"loop": {"rules": [{}]}}});
    assert_eq!(
        fields(&s, spec),
        ["provider_spec.loop.loop.rules[0].port", "provider_spec.rules[0].then[0].then[0].port"]
    );
}

#[test]
fn formats_are_asserted() {
    let s = json!({"properties": {
        "address": {"type": "string", "format": "ipv4"},
        "endpoint": {"type": "string", "format": "uri"},
        "notAfter": {"type": "string", "format": "date-time"},
        "id": {"type": "string", "format": "uuid"}
    }});
    let good = json!({
        "address": "10.0.0.1",
        "endpoint": "https://example.com/x",
        "notAfter": "2026-01-02T03:04:05Z",
        "id": "00000000-0000-4000-8000-000000000000"
    });
    assert!(check(&s, good).is_empty());
    assert_eq!(
        check(&s, json!({"address": "10.0.0.256", "endpoint": "not a uri", "notAfter": "tomorrow", "id": "1"})),
        [
            "provider_spec.address: must be a valid \"ipv4\" (format)",
            "provider_spec.endpoint: must be a valid \"uri\" (format)",
            "provider_spec.id: must be a valid \"uuid\" (format)",
            "provider_spec.notAfter: must be a valid \"date-time\" (format)",
        ]
    );
}

#[test]
fn patterns_are_enforced_and_use_ecma_classes() {
    let s = json!({"properties": {
        "zone": {"type": "string", "pattern": "^zone-[a-z]$"},
        "count": {"type": "string", "pattern": "^\\d+$"}
    }, "patternProperties": {"^x-": {"type": "string"}}});
    assert!(check(&s, json!({"zone": "zone-b", "count": "12", "x-team": "a"})).is_empty());
    assert_eq!(
        check(&s, json!({"zone": "zone-bb", "count": "1a", "x-team": 1})),
        [
            "provider_spec.count: must match ^\\d+$",
            "provider_spec.x-team: must be of type string, got integer",
            "provider_spec.zone: must match ^zone-[a-z]$",
        ]
    );
}

#[test]
fn patterns_run_in_linear_time() {
    // A backtracking engine gives up on this (and would report no mismatch); the linear-time
    // engine answers.
    let s = json!({"properties": {"name": {"type": "string", "pattern": "^(a+)+$"}}});
    let name = format!("{}!", "a".repeat(5000));
    assert_eq!(check(&s, json!({"name": name})), ["provider_spec.name: must match ^(a+)+$"]);
}

#[test]
fn nested_arrays_name_each_index() {
    let s = json!({"properties": {
        "matrix": {"type": "array", "items": {"type": "array", "maxItems": 2, "items": {"type": "integer"}}},
        "pair": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": false}
    }});
    assert!(check(&s, json!({"matrix": [[1, 2], []], "pair": ["a", 1]})).is_empty());
    assert_eq!(
        check(&s, json!({"matrix": [[1], ["a", 2, 3]], "pair": [1, 2, 3]})),
        [
            "provider_spec.matrix[1]: must have at most 2 items",
            "provider_spec.matrix[1][0]: must be of type integer, got string",
            "provider_spec.pair[0]: must be of type string, got integer",
            "provider_spec.pair[2]: is not allowed",
        ]
    );
}

#[test]
fn a_field_named_like_a_number_stays_a_field() {
    let s = json!({"properties": {"tags": {"type": "object", "additionalProperties": {"type": "string"}}}});
    assert_eq!(fields(&s, json!({"tags": {"0": 1, "a/b": 2}})), ["provider_spec.tags.0", "provider_spec.tags.a/b"]);
}

#[test]
fn conditionals_and_dependent_keywords_are_enforced() {
    let s = json!({
        "type": "object",
        "properties": {"priority": {"enum": ["Regular", "Spot"]}, "maxPrice": {"type": "number"}},
        "if": {"properties": {"priority": {"const": "Spot"}}, "required": ["priority"]},
        "then": {"required": ["maxPrice"]},
        "else": {"not": {"required": ["maxPrice"]}},
        "dependentRequired": {"keyName": ["sshUser"]},
        "propertyNames": {"pattern": "^[a-zA-Z]+$"}
    });
    assert!(check(&s, json!({"priority": "Spot", "maxPrice": 0.1})).is_empty());
    assert_eq!(check(&s, json!({"priority": "Spot"})), ["provider_spec.maxPrice: is required"]);
    assert_eq!(
        check(&s, json!({"priority": "Regular", "maxPrice": 1})),
        ["provider_spec: must not match the schema under \"not\""]
    );
    assert_eq!(check(&s, json!({"keyName": "k"})), ["provider_spec.sshUser: is required"]);
    assert_eq!(
        check(&s, json!({"bad_name": 1})),
        ["provider_spec.bad_name: is not an allowed field name: it must match ^[a-zA-Z]+$"]
    );
}

#[test]
fn annotations_and_data_values_are_not_keywords() {
    // Keywords are looked for in schemas only: the values of enum, const, default and examples
    // are data, and may hold anything.
    let s = json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://machinedriver.dev/schemas/test",
        "$comment": "test",
        "title": "A machine",
        "description": "One machine",
        "type": "object",
        "properties": {
            "size": {"enum": [{"requried": 1}], "default": {"minimun": 1}, "deprecated": true, "readOnly": true, "writeOnly": false},
            "mode": {"const": {"nullable": true}, "examples": [{"x-kubernetes": 1}]}
        },
        "examples": [{"size": {"requried": 1}}]
    });
    ProviderSchema::compile(&s).expect("annotations are allowed");
}

#[test]
fn unknown_keywords_are_refused_with_their_place() {
    let e = refused(json!({"type": "object", "properties": {"size": {"type": "string", "minLenght": 1}}}));
    assert_eq!(
        e,
        SchemaError::UnknownKeyword {
            keyword: "minLenght".into(),
            path: "#/properties/size".into(),
            hint: Some("did you mean \"minLength\"?".into())
        }
    );
    assert_eq!(
        e.to_string(),
        "unknown keyword \"minLenght\" at #/properties/size: JSON Schema draft 2020-12 does not define it, \
         so it would be silently ignored (did you mean \"minLength\"?)"
    );
    let in_items = refused(json!({"properties": {"disks": {"items": {"oneOf": [{}, {"requried": ["a"]}]}}}}));
    assert!(
        matches!(&in_items, SchemaError::UnknownKeyword { keyword, path, .. }
            if keyword == "requried" && path == "#/properties/disks/items/oneOf/1"),
        "{in_items:?}"
    );
    let in_defs = refused(json!({"$defs": {"a/b": {"x-kubernetes-int-or-string": true}}}));
    assert!(
        matches!(&in_defs, SchemaError::UnknownKeyword { path, hint: None, .. } if path == "#/$defs/a~1b"),
        "{in_defs:?}"
    );
}

#[test]
fn words_of_other_drafts_are_refused_with_the_2020_12_word() {
    for (schema, keyword, hint) in [
        (json!({"definitions": {}}), "definitions", "$defs"),
        (json!({"dependencies": {"a": ["b"]}}), "dependencies", "dependentRequired"),
        (json!({"items": {"type": "array", "additionalItems": false}}), "additionalItems", "prefixItems"),
        (json!({"id": "x"}), "id", "$id"),
        (json!({"properties": {"a": {"nullable": true}}}), "nullable", "null"),
    ] {
        let e = refused(schema);
        let text = e.to_string();
        assert!(
            matches!(&e, SchemaError::UnknownKeyword { keyword: k, .. } if k == keyword) && text.contains(hint),
            "{text}"
        );
    }
    // A draft-4 style boolean exclusiveMinimum breaks the 2020-12 meta-schema.
    let e = refused(json!({"properties": {"n": {"minimum": 1, "exclusiveMinimum": true}}}));
    assert!(matches!(&e, SchemaError::Invalid { path, .. } if path == "#/properties/n/exclusiveMinimum"), "{e}");
}

#[test]
fn annotation_only_keywords_are_refused() {
    let e = refused(json!({"properties": {"userData": {"type": "string", "contentEncoding": "base64"}}}));
    assert!(
        matches!(&e, SchemaError::UnenforcedKeyword { keyword, path, .. }
            if keyword == "contentEncoding" && path == "#/properties/userData"),
        "{e:?}"
    );
    assert!(e.to_string().contains("annotations only"), "{e}");
}

#[test]
fn other_dialects_are_refused() {
    let e = refused(json!({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object"}));
    assert!(matches!(&e, SchemaError::Dialect { path, .. } if path == "#"), "{e:?}");
    assert!(e.to_string().contains(DIALECT), "{e}");
    ProviderSchema::compile(&json!({"$schema": "https://json-schema.org/draft/2020-12/schema#"}))
        .expect("the 2020-12 URI with an empty fragment is the same dialect");
}

#[test]
fn invalid_patterns_are_refused() {
    let e = refused(json!({"properties": {"zone": {"type": "string", "pattern": "^(zone"}}}));
    assert_eq!(
        e.to_string(),
        "invalid schema at #/properties/zone/pattern: \"^(zone\" is not a regular expression the SDK can use \
         (ECMA-262 syntax, without look-around or back-references)"
    );
    // Look-behind needs backtracking, which the linear-time engine does not do.
    refused(json!({"patternProperties": {"(?<=a)b": {}}}));
}

#[test]
fn unknown_formats_are_refused() {
    let e = refused(json!({"properties": {"ip": {"type": "string", "format": "ipv5"}}}));
    assert_eq!(e, SchemaError::UnknownFormat { format: "ipv5".into(), path: "#/properties/ip".into() });
    assert!(e.to_string().contains("ipv4, ipv6"), "{e}");
    // Internationalised names need the idna tables, which the SDK leaves out.
    refused(json!({"format": "idn-hostname"}));
}

#[test]
fn references_outside_the_schema_are_refused() {
    for reference in ["https://example.com/machine.json", "machine.json#/$defs/a", DIALECT] {
        let e = refused(json!({"properties": {"a": {"$ref": reference}}}));
        assert_eq!(
            e,
            SchemaError::ExternalRef { keyword: "$ref", reference: reference.into(), path: "#/properties/a".into() }
        );
        assert!(e.to_string().contains("points outside the schema"), "{e}");
    }
    let e = refused(json!({"$dynamicRef": "https://example.com/x#meta"}));
    assert!(matches!(e, SchemaError::ExternalRef { keyword: "$dynamicRef", .. }), "{e:?}");
}

#[test]
fn unresolvable_references_are_refused() {
    let e = refused(json!({"$defs": {"b": {}}, "properties": {"a": {"$ref": "#/$defs/missing"}}}));
    assert_eq!(e, SchemaError::UnresolvedRef { reference: "#/$defs/missing".into(), path: "#/properties/a".into() });
    assert_eq!(e.to_string(), "$ref \"#/$defs/missing\" at #/properties/a points at nothing in the schema");
    let e = refused(json!({"properties": {"a": {"$ref": "#nowhere"}}}));
    assert!(matches!(e, SchemaError::Invalid { .. }), "an unknown anchor: {e:?}");
    // Inside an embedded resource `#/...` is relative to it; the validator resolves it.
    let s = json!({"properties": {"a": {
        "$id": "https://machinedriver.dev/schemas/a",
        "$defs": {"n": {"type": "integer"}},
        "$ref": "#/$defs/n"
    }}});
    assert_eq!(check(&s, json!({"a": "x"})), ["provider_spec.a: must be of type integer, got string"]);
}

#[test]
fn schemas_that_break_the_meta_schema_are_refused() {
    let e = refused(json!({"properties": {"disk": {"type": "integer", "minimum": "10"}}}));
    assert!(matches!(&e, SchemaError::Invalid { path, .. } if path == "#/properties/disk/minimum"), "{e:?}");
    let e = refused(json!({"properties": {"disk": {"type": "int"}}}));
    assert_eq!(
        e.to_string(),
        "invalid schema at #/properties/disk/type: \"int\" is not a JSON Schema type \
         (array, boolean, integer, null, number, object, string)"
    );
    refused(json!({"required": "size"}));
    refused(json!(42));
}

#[test]
fn names_follow_dns_rules() {
    assert!(check_name("web-0.a").is_ok());
    for bad in ["", "-a", "a-", "Web", "a_b", &"a".repeat(254)] {
        assert!(check_name(bad).is_err(), "{bad}");
    }
}
