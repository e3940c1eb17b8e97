//! Which kinds have a reconciler, and which changes wake which objects: declared here once and
//! answered to the runtime by [`super::Controller`]. A new reconciler adds its file, its line in
//! [`super::reconcile`]'s dispatch and [`RECONCILED`], and its rows in [`RELATIONS`].

use crate::resources::Kind;
use crate::runtime::Ctx;
use crate::store::Key;

/// The kinds that have a reconciler, in the order a full resync queues them.
pub const RECONCILED: [Kind; 4] = [Kind::MachineClass, Kind::MachineDeployment, Kind::MachinePool, Kind::Machine];

/// How a changed object finds the objects it wakes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// Its controlling owner (`ownerReferences` with `controller: true`).
    Owner,
    /// The objects whose `classRef` (or template's) names it. Only a new generation wakes
    /// them: a class's own status writes do not (that would undo their backoff in a loop).
    ClassRef,
    /// The classes whose `secretRef` names it (and, through them, their objects).
    SecretRef,
}

/// One row: a change of `changed` wakes related objects of kind `wakes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Relation {
    /// The kind that changed.
    pub changed: Kind,
    /// The kind woken.
    pub wakes: Kind,
    /// How the woken objects are found.
    pub via: Via,
}

const fn row(changed: Kind, wakes: Kind, via: Via) -> Relation {
    Relation { changed, wakes, via }
}

/// Every relation. Each object is also woken by its own changes (except Secrets, which have no
/// reconciler); objects woken through a class or Secret have their backoff forgotten, so a
/// machine waiting out refused credentials retries at once after the Secret is fixed.
pub const RELATIONS: &[Relation] = &[
    // A machine's phase changes what its owner plans.
    row(Kind::Machine, Kind::MachineDeployment, Via::Owner),
    row(Kind::Machine, Kind::MachinePool, Via::Owner),
    // A class's spec (its driver, provider spec, credentials) changes every call made with it.
    row(Kind::MachineClass, Kind::MachineDeployment, Via::ClassRef),
    row(Kind::MachineClass, Kind::MachinePool, Via::ClassRef),
    row(Kind::MachineClass, Kind::Machine, Via::ClassRef),
    // A Secret changes the classes that use it, and so their objects.
    row(Kind::Secret, Kind::MachineClass, Via::SecretRef),
];

/// Whether a change of `changed` wakes its controlling owner of kind `owner`.
pub fn wakes_owner(changed: Kind, owner: Kind) -> bool {
    RELATIONS.iter().any(|r| r.changed == changed && r.wakes == owner && r.via == Via::Owner)
}

/// Whether a change of `changed` wakes objects through a reference (class or Secret).
pub fn has_dependents(changed: Kind) -> bool {
    RELATIONS.iter().any(|r| r.changed == changed && r.via != Via::Owner)
}

/// The kinds a class's change wakes through their `classRef`.
pub fn class_dependents() -> impl Iterator<Item = Kind> {
    RELATIONS.iter().filter(|r| r.changed == Kind::MachineClass && r.via == Via::ClassRef).map(|r| r.wakes)
}

/// A MachineClass or a Secret changed: every class that uses it, and every deployment, pool and
/// machine of those classes, is to run again with its backoff forgotten — a machine waiting
/// out a refused credential retries at once after the Secret is fixed.
pub(crate) async fn dependents(ctx: &Ctx, changed: &Key) -> Vec<Key> {
    use crate::resources::{MachineClass, MachineDeployment, MachinePool};
    let classes: Vec<String> = match changed.kind {
        Kind::MachineClass => {
            // Only a new generation (spec) wakes; the class's status writes do not.
            let Ok(Some(class)) = ctx.store.get::<MachineClass>(&changed.namespace, &changed.name).await else {
                return Vec::new();
            };
            if !ctx.dependents_due(changed, class.metadata.generation) {
                return Vec::new();
            }
            vec![changed.name.clone()]
        }
        _ => match ctx.store.list::<MachineClass>().await {
            Ok(all) => all
                .into_iter()
                .filter(|c| {
                    c.metadata.namespace == changed.namespace
                        && c.spec.secret_ref.as_ref().is_some_and(|r| r.name == changed.name)
                })
                .map(|c| c.metadata.name)
                .collect(),
            Err(e) => {
                tracing::warn!("listing classes after a change of {changed}: {}", driver_sdk::error_chain(&e));
                return Vec::new();
            }
        },
    };
    if classes.is_empty() {
        return Vec::new();
    }
    let uses = |ns: &str, class: &str| ns == changed.namespace && classes.iter().any(|c| c == class);
    let mut keys: Vec<Key> = classes.iter().map(|c| Key::new(Kind::MachineClass, &changed.namespace, c)).collect();
    #[derive(serde::Deserialize)]
    struct ClassUser {
        metadata: UserMeta,
        spec: UserSpec,
    }
    #[derive(serde::Deserialize)]
    struct UserMeta {
        name: String,
        #[serde(default)]
        namespace: String,
    }
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct UserSpec {
        class_ref: crate::resources::NameRef,
    }
    for kind in class_dependents() {
        // The class each object of the kind names.
        let found = match kind {
            Kind::MachineDeployment => ctx.store.list::<MachineDeployment>().await.map(|all| {
                all.iter()
                    .filter(|d| uses(&d.metadata.namespace, &d.spec.template.spec.class_ref.name))
                    .map(Key::of)
                    .collect()
            }),
            Kind::MachinePool => ctx.store.list::<MachinePool>().await.map(|all| {
                all.iter()
                    .filter(|p| uses(&p.metadata.namespace, &p.spec.template.spec.class_ref.name))
                    .map(Key::of)
                    .collect()
            }),
            // Machines are many: only their name, namespace and class are read.
            Kind::Machine => ctx.store.backend().list(Kind::Machine).await.map(|all| {
                all.iter()
                    .filter_map(|json| serde_json::from_str::<ClassUser>(json).ok())
                    .filter(|m| uses(&m.metadata.namespace, &m.spec.class_ref.name))
                    .map(|m| Key::new(Kind::Machine, &m.metadata.namespace, &m.metadata.name))
                    .collect()
            }),
            Kind::MachineClass | Kind::Secret => Ok(Vec::new()),
        };
        match found {
            Ok(found) => keys.extend(found),
            Err(e) => tracing::warn!("listing {kind} after a change of {changed}: {}", driver_sdk::error_chain(&e)),
        }
    }
    tracing::debug!(changed = %changed, objects = keys.len(), "waking the objects that use it");
    keys
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_says_who_wakes_whom() {
        assert!(wakes_owner(Kind::Machine, Kind::MachineDeployment));
        assert!(wakes_owner(Kind::Machine, Kind::MachinePool));
        assert!(!wakes_owner(Kind::MachineDeployment, Kind::MachineClass), "owners are only woken as declared");
        assert!(has_dependents(Kind::Secret) && has_dependents(Kind::MachineClass));
        assert!(!has_dependents(Kind::Machine) && !has_dependents(Kind::MachineDeployment));
        assert_eq!(class_dependents().collect::<Vec<_>>(), [Kind::MachineDeployment, Kind::MachinePool, Kind::Machine]);
    }

    #[test]
    fn every_woken_kind_has_a_reconciler() {
        for r in RELATIONS {
            assert!(RECONCILED.contains(&r.wakes), "{r:?}");
        }
        assert!(!RECONCILED.contains(&Kind::Secret));
    }
}
