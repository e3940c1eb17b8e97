package main

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"slices"
	"sort"

	"google.golang.org/protobuf/types/known/structpb"
)

// The provider spec's JSON Schema, served by GetDriverInfo. Its `examples` are valid specs; the
// conformance suite uses the first as "the" spec and the second as "a different one".
// checkSpec below enforces exactly this schema: keep the two together.
var sizes = []string{"small", "medium", "large"}

func providerSpecSchema() map[string]any {
	return map[string]any{
		"$schema":              "https://json-schema.org/draft/2020-12/schema",
		"type":                 "object",
		"required":             []any{"size"},
		"additionalProperties": false,
		"properties": map[string]any{
			"size":  map[string]any{"type": "string", "enum": []any{"small", "medium", "large"}},
			"image": map[string]any{"type": "string", "minLength": 1, "maxLength": 128},
			"tags": map[string]any{
				"type":                 "object",
				"additionalProperties": map[string]any{"type": "string", "maxLength": 256},
			},
		},
		"examples": []any{
			map[string]any{"size": "small", "image": "go-os-1"},
			map[string]any{"size": "large", "image": "go-os-2"},
		},
	}
}

// checkName applies the protocol's name rules (docs/src/reference/protocol.md §4): 1–253 characters of
// [a-z0-9.-], starting and ending with a letter or digit.
func checkName(v *invalidRequest, field, name string) {
	if name == "" {
		v.add(reasonFieldRequired, field, "required")
		return
	}
	if msg := nameProblem(name); msg != "" {
		v.add(reasonFieldInvalid, field, msg)
	}
}

func nameProblem(name string) string {
	if len(name) > 253 {
		return "must be at most 253 characters"
	}
	alnum := func(c byte) bool { return c >= 'a' && c <= 'z' || c >= '0' && c <= '9' }
	for i := 0; i < len(name); i++ {
		if c := name[i]; !alnum(c) && c != '-' && c != '.' {
			return "must consist of lower-case letters, digits, '-' and '.', and start and end with a letter or digit"
		}
	}
	if !alnum(name[0]) || !alnum(name[len(name)-1]) {
		return "must consist of lower-case letters, digits, '-' and '.', and start and end with a letter or digit"
	}
	return ""
}

// checkSpec checks a provider spec against the schema above; every mismatch is a violation
// with reason INVALID_PROVIDER_SPEC and a `provider_spec.<path>` field.
func checkSpec(v *invalidRequest, field string, spec *structpb.Struct) {
	if spec == nil {
		v.add(reasonFieldRequired, field, "required")
		return
	}
	bad := func(path, msg string) { v.add(reasonInvalidProviderSpec, field+"."+path, msg) }
	f := spec.GetFields()
	size, ok := f["size"]
	switch {
	case !ok:
		bad("size", "required")
	case !slices.Contains(sizes, size.GetStringValue()):
		bad("size", `must be one of ["small","medium","large"]`)
	}
	if image, ok := f["image"]; ok {
		s, isString := image.GetKind().(*structpb.Value_StringValue)
		if !isString || len(s.StringValue) == 0 || len(s.StringValue) > 128 {
			bad("image", "must be a string of 1 to 128 characters")
		}
	}
	if tags, ok := f["tags"]; ok {
		if obj := tags.GetStructValue(); obj == nil {
			bad("tags", "must be an object of strings")
		} else {
			for _, k := range sortedKeys(obj.GetFields()) {
				s, isString := obj.GetFields()[k].GetKind().(*structpb.Value_StringValue)
				if !isString || len(s.StringValue) > 256 {
					bad("tags."+k, "must be a string of at most 256 characters")
				}
			}
		}
	}
	for _, k := range sortedKeys(f) {
		if k != "size" && k != "image" && k != "tags" {
			bad(k, "unknown field")
		}
	}
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// specHash identifies a spec: two specs with the same content hash the same (encoding/json
// writes map keys sorted, so the encoding is canonical).
func specHash(spec *structpb.Struct) string {
	b, _ := json.Marshal(spec.AsMap()) // a Struct holds only JSON values: cannot fail
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:8])
}
