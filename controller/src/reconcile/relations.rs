//! Which kinds have a reconciler, and which changes wake which objects: declared here once, read
//! by the runtime's change watcher. A new reconciler adds its file, its line in
//! [`super::reconcile`]'s dispatch and [`RECONCILED`], and its rows in [`RELATIONS`].

use crate::resources::Kind;

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
