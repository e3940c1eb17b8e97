//! From a [`Kind`] to its type: each kind's facts as [`Kind`] methods, answered by the type's
//! [`KindInfo`], and [`AnyObject`], an object of any registered kind, with the parsing and
//! validation that dispatch on its kind. Both are generated from the registry's lines
//! ([`crate::registry`]) by the `kinds!` macro below.

use crate::registry::{registry, Kind};
// All of them: the registry's lines name the types, which resolve here.
use crate::resources::*;

/// Turns the registry's lines into [`Kind`]'s per-kind answers (each from the type's
/// [`KindInfo`]) and [`AnyObject`] with its parsing and validation dispatch; and checks at
/// compile time that each type's [`Resource::KIND`] is its own variant.
macro_rules! kinds {
    ($( $(#[$doc:meta])* $variant:ident => $ty:ty ),+ $(,)?) => {
        impl Kind {
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

            /// How its objects are laid out (`spec` and `status`, or a Secret's data).
            pub fn shape(self) -> $crate::resources::Shape {
                match self { $( Kind::$variant => <$ty as $crate::resources::KindInfo>::SHAPE, )+ }
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
                        $crate::schema::schema_of::<<$ty as $crate::resources::KindInfo>::Spec>(),
                        $crate::schema::schema_of::<<$ty as $crate::resources::KindInfo>::Status>(),
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

            /// The kind's own checks ([`KindInfo::validate`]).
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

registry!(kinds);

impl Kind {
    /// Whether its objects have a `status` (written on its own); a Secret has none
    /// ([`Shape::has_status`]).
    pub fn has_status(self) -> bool {
        self.shape().has_status()
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
    fn a_secret_is_the_one_kind_without_status() {
        let without: Vec<Kind> = Kind::ALL.into_iter().filter(|k| !k.has_status()).collect();
        assert_eq!(without, [Kind::Secret]);
        assert_eq!(Kind::Secret.shape().fields(), ["data", "stringData", "type"]);
        assert_eq!(Kind::Machine.shape().spec_fields(), ["spec"]);
    }
}
