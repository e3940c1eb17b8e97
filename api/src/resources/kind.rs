//! What the controller knows about a kind, declared once on its type ([`KindInfo`]) and
//! gathered by one registration line in [`crate::registry`], from which [`Kind`],
//! [`AnyObject`](crate::dispatch::AnyObject), the CRDs, the manifest parser, the CLI tables and
//! the Kubernetes backend's resources all follow ([`crate::dispatch`] turns each line into the
//! kind's answers; kube's `Resource` trait is the model: the facts a client needs about a type,
//! as associated items of the type).

use serde_json::Value;

use super::checks::{Check, Rule};
use super::meta::{Resource, API_VERSION};
use crate::registry::Kind;

/// The facts about one kind, as associated items of its type.
///
/// Implement it next to the type, then add the type's line to [`crate::registry`]; everything
/// else is derived. See the book's "Adding a reconciled kind".
pub trait KindInfo: Resource {
    /// The `apiVersion` manifests of this kind carry.
    const API_VERSION: &'static str = API_VERSION;
    /// The resource name (`machines`): the CRD's plural, the Kubernetes API path, a CLI name.
    const PLURAL: &'static str;
    /// The CRD's `shortNames` (what `kubectl get` accepts); the CLI accepts them too.
    const SHORT_NAMES: &'static [&'static str] = &[];
    /// More names the CLI accepts (besides the kind, its plural and the short names).
    const ALIASES: &'static [&'static str] = &[];
    /// The columns of `get` (after NAME) and of the CRD's `additionalPrinterColumns`.
    const COLUMNS: &'static [Column] = &[];
    /// Whether the CRD has the `scale` subresource (`spec.replicas` / `status.replicas`).
    const SCALE: bool = false;
    /// The changes that wake objects of this kind (besides their own): `(changed kind, how)`.
    const WOKEN_BY: &'static [(Kind, Via)] = &[];

    /// How its objects are laid out: `spec` and `status`, or a Secret's data.
    const SHAPE: Shape = Shape::SpecAndStatus;
    /// Whether this controller serves it through a CRD (false for `Secret`, core v1).
    const CRD: bool = true;
    /// The type its CRD's `spec` schema is generated from.
    type Spec: schemars::JsonSchema;
    /// The type its CRD's `status` schema is generated from.
    type Status: schemars::JsonSchema;

    /// Rules that both `apply` and the API server check (CEL `x-kubernetes-validations`), in
    /// the order `apply` checks them.
    fn rules() -> Vec<Rule> {
        Vec::new()
    }

    /// Semantic checks `apply` makes beyond the schema and the [`KindInfo::rules`] (names,
    /// references, formats); the common metadata checks are made for every kind.
    ///
    /// # Errors
    /// The field and what is wrong with it.
    fn validate(&self) -> Check {
        Ok(())
    }

    /// Lines `describe` prints after the phase and provider ID, from the object's `status`.
    fn describe_head(_status: &Value) -> String {
        String::new()
    }

    /// Lines `describe` prints after the common status, before the events.
    fn describe_tail(_status: &Value) -> String {
        String::new()
    }
}

/// How the objects of a kind are laid out besides `apiVersion`, `kind` and `metadata`: what the
/// stores keep, what counts as the spec, whether there is a status, what is secret.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// `spec` (desired state; a change is a new `generation`) and `status` (observed state,
    /// written on its own: the status subresource).
    SpecAndStatus,
    /// A Kubernetes `v1/Secret`: `data`, `stringData` and `type` at the top, no `spec` and no
    /// `status` (a status write is refused). A change of `data` or `stringData` is a new
    /// `generation`; their values are secret.
    SecretData,
}

impl Shape {
    /// The fields an object keeps besides `apiVersion`, `kind` and `metadata`.
    pub fn fields(self) -> &'static [&'static str] {
        match self {
            Shape::SpecAndStatus => &["spec", "status"],
            Shape::SecretData => &["data", "stringData", "type"],
        }
    }

    /// The fields whose change is a new `generation` (the object's spec).
    pub fn spec_fields(self) -> &'static [&'static str] {
        match self {
            Shape::SpecAndStatus => &["spec"],
            Shape::SecretData => &["data", "stringData"],
        }
    }

    /// Whether objects have a `status`, written apart from the rest.
    pub fn has_status(self) -> bool {
        matches!(self, Shape::SpecAndStatus)
    }

    /// The fields whose values are secret: shown redacted.
    pub fn secret_fields(self) -> &'static [&'static str] {
        match self {
            Shape::SpecAndStatus => &[],
            Shape::SecretData => &["data", "stringData"],
        }
    }
}

/// How a changed object finds the objects it wakes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// Its controlling owner (`ownerReferences` with `controller: true`).
    Owner,
    /// The objects whose `spec.classRef` (or `spec.template.spec.classRef`) names it. Only a
    /// new generation wakes them: a class's own status writes do not (that would undo their
    /// backoff in a loop).
    ClassRef,
    /// The classes whose `secretRef` names it (and, through them, their objects).
    SecretRef,
    /// The objects whose `spec.selector.matchLabels` its labels match (all of the namespace
    /// when it is gone). Its own status writes wake them too: health is in status.
    Selector,
}

/// The type of a column (as in a CRD's `additionalPrinterColumns`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColumnType {
    /// Text; `-` when absent or empty.
    String,
    /// A number; `0` when absent.
    Integer,
    /// A timestamp, shown as an age (`5m`); `-` when absent.
    Date,
}

impl ColumnType {
    /// The CRD's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            ColumnType::String => "string",
            ColumnType::Integer => "integer",
            ColumnType::Date => "date",
        }
    }
}

/// Where a column is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shown {
    /// In `get`, `get -o wide` and the CRD.
    Everywhere,
    /// In `get -o wide` and the CRD.
    Wide,
    /// Only in the CRD (`kubectl get`).
    CrdOnly,
    /// Only in `get` (the value needs more than a JSON path).
    Table,
    /// Only in `get -o wide`.
    TableWide,
}

/// One column of a kind's tables: defined once for `machine-controller get` and the CRD's
/// `additionalPrinterColumns`. `get` lists its columns in order, the wide ones after the
/// others; the CRD lists those it shows in order.
#[derive(Debug, Clone, Copy)]
pub struct Column {
    /// The CRD's name (`Provider-ID`); `get` shows it in capitals.
    pub name: &'static str,
    /// Its type.
    pub ty: ColumnType,
    /// The JSON path of the value (`.status.addresses[0].address`).
    pub path: &'static str,
    /// Where it is shown.
    pub shown: Shown,
    /// How `get` computes the cell from the object (defaults filled in), when a path is not
    /// enough.
    pub cell: Option<fn(&Value) -> String>,
}

impl Column {
    /// A column at `path`, shown everywhere.
    pub const fn new(name: &'static str, ty: ColumnType, path: &'static str) -> Self {
        Column { name, ty, path, shown: Shown::Everywhere, cell: None }
    }

    /// A `get`-only column computed by `cell`.
    pub const fn computed(name: &'static str, cell: fn(&Value) -> String) -> Self {
        Column { name, ty: ColumnType::String, path: "", shown: Shown::Table, cell: Some(cell) }
    }

    /// The `Age` column (`.metadata.creationTimestamp`).
    pub const fn age() -> Self {
        Column::new("Age", ColumnType::Date, ".metadata.creationTimestamp")
    }

    /// Shown where `shown` says.
    #[must_use]
    pub const fn shown(mut self, shown: Shown) -> Self {
        self.shown = shown;
        self
    }

    /// Whether the CRD lists it.
    pub fn in_crd(&self) -> bool {
        matches!(self.shown, Shown::Everywhere | Shown::Wide | Shown::CrdOnly)
    }

    /// Whether `get` lists it (`wide`: `-o wide`).
    pub fn in_table(&self, wide: bool) -> bool {
        match self.shown {
            Shown::Everywhere | Shown::Table => true,
            Shown::Wide | Shown::TableWide => wide,
            Shown::CrdOnly => false,
        }
    }

    /// Whether it is one of the wide columns (listed after the others).
    pub fn is_wide(&self) -> bool {
        matches!(self.shown, Shown::Wide | Shown::TableWide)
    }

    /// The value at [`Column::path`] in `object` (`.a.b[0].c`), if any.
    pub fn lookup<'a>(&self, object: &'a Value) -> Option<&'a Value> {
        lookup(object, self.path)
    }
}

/// The value at a JSON path (`.a.b[0].c`) in `object`, if any.
pub fn lookup<'a>(object: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').filter(|s| !s.is_empty()).try_fold(object, |v, step| {
        let (key, index) = match step.split_once('[') {
            Some((key, rest)) => (key, Some(rest.strip_suffix(']')?.parse::<usize>().ok()?)),
            None => (step, None),
        };
        let v = if key.is_empty() { v } else { v.get(key)? };
        match index {
            Some(i) => v.get(i),
            None => Some(v),
        }
    })
}

/// `a, b, c or d` (for messages that list choices).
pub fn one_of(items: &[&str]) -> String {
    match items {
        [] => String::new(),
        [one] => (*one).to_string(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_paths_reach_into_lists() {
        let v = serde_json::json!({"status": {"addresses": [{"address": "10.0.0.1"}], "phase": "Running"}});
        assert_eq!(lookup(&v, ".status.addresses[0].address"), Some(&serde_json::json!("10.0.0.1")));
        assert_eq!(lookup(&v, ".status.phase"), Some(&serde_json::json!("Running")));
        assert_eq!(lookup(&v, ".status.addresses[1].address"), None);
        assert_eq!(lookup(&v, ".status.addresses[x]"), None);
        assert_eq!(one_of(&["a", "b", "c"]), "a, b or c");
    }
}
