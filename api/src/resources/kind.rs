//! What the controller knows about a kind, declared once on its type ([`KindInfo`]) and
//! gathered by one registration line in [`crate::registry`] (the [`kinds!`] macro), from which
//! [`Kind`], [`crate::manifest::AnyObject`], the CRDs, the manifest parser, the CLI tables and
//! the Kubernetes backend's resources all follow (kube's `Resource` trait is the model: the
//! facts a client needs about a type, as associated items of the type).

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

/// Declares the registry: one line per kind, `Variant => Type`, in apply order (dependencies
/// first). It defines [`Kind`] (the store's key, named as the variant), its per-kind accessors
/// (each answered by the type's [`KindInfo`]), and [`crate::manifest::AnyObject`] with its
/// parsing and validation dispatch; and it checks at compile time that each type's
/// [`Resource::KIND`] is its own variant.
macro_rules! kinds {
    ($( $(#[$doc:meta])* $variant:ident => $ty:ty ),+ $(,)?) => {
        /// The kinds this controller knows (the registry in [`crate::registry`]). The name is the
        /// manifests' `kind:`, the store's key and the CRD's kind, so it never changes.
        #[derive(
            Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord,
            serde::Serialize, serde::Deserialize, schemars::JsonSchema,
        )]
        pub enum Kind {
            $( $(#[$doc])* $variant, )+
        }

        impl Kind {
            /// How many kinds there are.
            pub const COUNT: usize = [$(stringify!($variant)),+].len();

            /// All kinds, in apply order (dependencies first).
            pub const ALL: [Kind; Kind::COUNT] = [$(Kind::$variant),+];

            /// The kind's name as in manifests.
            pub fn as_str(self) -> &'static str {
                match self { $( Kind::$variant => stringify!($variant), )+ }
            }

            /// The apiVersion manifests of this kind carry.
            pub fn api_version(self) -> &'static str {
                match self { $( Kind::$variant => <$ty as $crate::resources::KindInfo>::API_VERSION, )+ }
            }

            /// The plural resource name (`machines`).
            pub fn plural(self) -> &'static str {
                match self { $( Kind::$variant => <$ty as $crate::resources::KindInfo>::PLURAL, )+ }
            }

            /// The CRD's short names.
            pub fn short_names(self) -> &'static [&'static str] {
                match self { $( Kind::$variant => <$ty as $crate::resources::KindInfo>::SHORT_NAMES, )+ }
            }

            /// More names the CLI accepts.
            pub fn aliases(self) -> &'static [&'static str] {
                match self { $( Kind::$variant => <$ty as $crate::resources::KindInfo>::ALIASES, )+ }
            }

            /// The columns of its tables.
            pub fn columns(self) -> &'static [$crate::resources::Column] {
                match self { $( Kind::$variant => <$ty as $crate::resources::KindInfo>::COLUMNS, )+ }
            }

            /// Whether its CRD has the scale subresource.
            pub fn scale(self) -> bool {
                match self { $( Kind::$variant => <$ty as $crate::resources::KindInfo>::SCALE, )+ }
            }

            /// What wakes its objects.
            pub fn woken_by(self) -> &'static [(Kind, $crate::resources::Via)] {
                match self { $( Kind::$variant => <$ty as $crate::resources::KindInfo>::WOKEN_BY, )+ }
            }

            /// Its CRD's spec and status schemas, structural (`None`: no CRD).
            pub fn crd_schemas(self) -> Option<(serde_json::Value, serde_json::Value)> {
                match self {
                    $( Kind::$variant => <$ty as $crate::resources::KindInfo>::CRD.then(|| (
                        $crate::crd::schema_of::<<$ty as $crate::resources::KindInfo>::Spec>(),
                        $crate::crd::schema_of::<<$ty as $crate::resources::KindInfo>::Status>(),
                    )), )+
                }
            }

            /// Its shared validation rules.
            pub fn rules(self) -> Vec<$crate::resources::checks::Rule> {
                match self { $( Kind::$variant => <$ty as $crate::resources::KindInfo>::rules(), )+ }
            }

            /// Its extra `describe` lines: (after the phase, before the events).
            pub fn describe(self, status: &serde_json::Value) -> (String, String) {
                match self {
                    $( Kind::$variant => (
                        <$ty as $crate::resources::KindInfo>::describe_head(status),
                        <$ty as $crate::resources::KindInfo>::describe_tail(status),
                    ), )+
                }
            }

            /// `value` (stored JSON) read as its type and written back: every default filled in.
            ///
            /// # Errors
            /// JSON that is not an object of this kind.
            pub fn normalize(self, value: serde_json::Value) -> Result<serde_json::Value, serde_json::Error> {
                match self { $( Kind::$variant => serde_json::to_value(serde_json::from_value::<$ty>(value)?), )+ }
            }
        }

        /// Any object a manifest may hold.
        #[derive(Debug, Clone, PartialEq)]
        pub enum AnyObject {
            $( $(#[$doc])* $variant($ty), )+
        }

        impl AnyObject {
            /// The kind.
            pub fn kind(&self) -> Kind {
                match self { $( AnyObject::$variant(_) => Kind::$variant, )+ }
            }

            /// The metadata.
            pub fn meta(&self) -> &$crate::resources::ObjectMeta {
                match self { $( AnyObject::$variant(o) => $crate::resources::Resource::meta(o), )+ }
            }

            /// As JSON.
            pub fn to_json(&self) -> serde_json::Value {
                let v = match self { $( AnyObject::$variant(o) => serde_json::to_value(o), )+ };
                v.unwrap_or(serde_json::Value::Null)
            }

            /// The kind's own checks ([`KindInfo::validate`](crate::resources::KindInfo::validate)).
            ///
            /// # Errors
            /// The field and what is wrong with it.
            pub fn validate(&self) -> $crate::resources::checks::Check {
                match self { $( AnyObject::$variant(o) => $crate::resources::KindInfo::validate(o), )+ }
            }

            /// Reads `json` as an object of `kind`.
            ///
            /// # Errors
            /// The path of the field that does not fit, and why.
            pub fn from_json(
                kind: Kind,
                json: &serde_json::Value,
            ) -> Result<AnyObject, serde_path_to_error::Error<serde_json::Error>> {
                Ok(match kind { $( Kind::$variant => AnyObject::$variant(serde_path_to_error::deserialize(json)?), )+ })
            }
        }

        const _: () = {
            $( assert!(
                matches!(<$ty as $crate::resources::Resource>::KIND, Kind::$variant),
                concat!(stringify!($ty), "'s Resource::KIND is not Kind::", stringify!($variant)),
            ); )+
        };
    };
}

pub(crate) use kinds;

impl Kind {
    /// The kind named exactly `name` (as in manifests and owner references).
    pub fn from_name(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.as_str() == name)
    }

    /// Parses a kind as typed on the command line: its name, plural, short names or aliases, in
    /// any case (`machines`, `md`, `MachineDeployment`, ...).
    pub fn parse(s: &str) -> Option<Kind> {
        let s = s.to_ascii_lowercase();
        Kind::ALL.into_iter().find(|k| {
            k.as_str().eq_ignore_ascii_case(&s)
                || k.plural() == s
                || k.short_names().contains(&s.as_str())
                || k.aliases().contains(&s.as_str())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_name_the_cli_accepts_names_two_kinds() {
        let mut seen = std::collections::BTreeMap::new();
        for kind in Kind::ALL {
            let mut names: Vec<String> = [kind.as_str(), kind.plural()]
                .iter()
                .chain(kind.short_names())
                .chain(kind.aliases())
                .map(|n| n.to_ascii_lowercase())
                .collect();
            names.sort();
            names.dedup();
            for name in names {
                if let Some(other) = seen.insert(name.clone(), kind) {
                    panic!("{name:?} names both {other} and {kind}");
                }
            }
            assert_eq!(Kind::from_name(kind.as_str()), Some(kind));
        }
    }

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
