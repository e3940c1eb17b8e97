//! The registry: one line per kind, in apply order (dependencies first; a full resync queues
//! them in this order too). Everything that lists kinds follows from it: [`Kind`] and its
//! names, [`AnyObject`](crate::dispatch::AnyObject) (the manifest parser's dispatch and
//! checks), the CRDs ([`crate::crd`]), the controller's CLI names and tables and its Kubernetes
//! backend's resources; and, with the kind's line in the controller's `reconcile::RECONCILERS`,
//! its runtime's dispatch and wakes.
//!
//! A line names the variant (the kind's name, which is also its store key and CRD kind — never
//! rename one) and the type, whose [`KindInfo`](crate::resources::KindInfo) holds its facts.
//!
//! The lines are the body of the `registry!` macro, which hands them to another macro: below to
//! `kind_enum!`, which declares [`Kind`] from the names alone, and in [`crate::dispatch`] to
//! `kinds!`, which answers each kind's facts from its type and declares `AnyObject`. So this
//! file names the types without using them, and the types, which name their own [`Kind`], take
//! it from here: the registry sits below the resources, not beside them in a circle.

/// The registry's lines, handed to the macro `$then` (which matches
/// `$( $(#[$doc:meta])* $variant:ident => $ty:ty ),+`). The types are resolved where `$then`
/// expands.
macro_rules! registry {
    ($then:ident) => {
        $then! {
            /// Credentials referenced by classes (Kubernetes `v1/Secret` shape).
            Secret => Secret,
            /// Driver + provider spec + secret reference.
            MachineClass => MachineClass,
            /// Replicated machines with rolling updates.
            MachineDeployment => MachineDeployment,
            /// Scale-set pools through the pool RPCs.
            MachinePool => MachinePool,
            /// One machine.
            Machine => Machine,
            /// Marks unhealthy Machines; their deployments and pools remediate them.
            MachineHealthCheck => MachineHealthCheck,
        }
    };
}

pub(crate) use registry;

/// Declares [`Kind`] from the registry's lines: their names and order (their types are not
/// used here).
macro_rules! kind_enum {
    ($( $(#[$doc:meta])* $variant:ident => $ty:ty ),+ $(,)?) => {
        /// The kinds this controller knows (the registry). The name is the manifests' `kind:`,
        /// the store's key and the CRD's kind, so it never changes. What each kind is — its
        /// plural, columns, checks, schemas — is answered by its type ([`crate::dispatch`]).
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
        }
    };
}

registry!(kind_enum);

impl Kind {
    /// The kind named exactly `name` (as in manifests and owner references).
    pub fn from_name(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.as_str() == name)
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
