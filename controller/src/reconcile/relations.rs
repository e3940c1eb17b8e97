//! Which kinds have a reconciler, and which changes wake which objects, as the runtime asks
//! [`super::Controller`]: the reconciled kinds are those of [`super::RECONCILERS`], and the
//! relations are what each kind's type declares in
//! [`KindInfo::WOKEN_BY`](crate::resources::KindInfo::WOKEN_BY).

use std::sync::LazyLock;

use crate::app::Ctx;
use crate::resources::Kind;
pub use crate::resources::Via;
use crate::store::Key;

/// The kinds that have a reconciler, in the order a full resync queues them.
pub fn reconciled() -> &'static [Kind] {
    static RECONCILED: LazyLock<Vec<Kind>> = LazyLock::new(|| super::RECONCILERS.iter().map(|r| r.kind).collect());
    &RECONCILED
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

/// Every relation, as the kinds declare them ([`Kind::woken_by`]), in registry order. Each
/// object is also woken by its own changes (except Secrets, which have no reconciler); objects
/// woken through a class or Secret have their backoff forgotten, so a machine waiting out
/// refused credentials retries at once after the Secret is fixed.
pub fn relations() -> impl Iterator<Item = Relation> {
    Kind::ALL
        .into_iter()
        .flat_map(|wakes| wakes.woken_by().iter().map(move |&(changed, via)| Relation { changed, wakes, via }))
}

/// Whether a change of `changed` wakes its controlling owner of kind `owner`.
pub fn wakes_owner(changed: Kind, owner: Kind) -> bool {
    relations().any(|r| r.changed == changed && r.wakes == owner && r.via == Via::Owner)
}

/// Whether a change of `changed` wakes objects through a reference (class or Secret).
pub fn has_dependents(changed: Kind) -> bool {
    relations().any(|r| r.changed == changed && r.via != Via::Owner)
}

/// The kinds a class's change wakes through their `classRef`.
pub fn class_dependents() -> impl Iterator<Item = Kind> {
    relations().filter(|r| r.changed == Kind::MachineClass && r.via == Via::ClassRef).map(|r| r.wakes)
}

/// The objects a change of `changed` wakes through a reference or a selector (not its owner),
/// to run again with their backoff forgotten.
pub(crate) async fn dependents(ctx: &Ctx, changed: &Key) -> Vec<Key> {
    let mut keys = Vec::new();
    let rows: Vec<Relation> = relations().filter(|r| r.changed == changed.kind).collect();
    for r in rows.iter().filter(|r| r.via == Via::Selector) {
        keys.extend(selecting(ctx, changed, r.wakes).await);
    }
    if rows.iter().any(|r| matches!(r.via, Via::ClassRef | Via::SecretRef)) {
        keys.extend(class_users(ctx, changed).await);
    }
    keys
}

/// The objects of kind `kind` whose `spec.selector.matchLabels` pick `changed` (all of its
/// namespace when it is gone: what it was is not known any more).
async fn selecting(ctx: &Ctx, changed: &Key, kind: Kind) -> Vec<Key> {
    // Only names, namespaces, labels and selectors are read.
    #[derive(serde::Deserialize)]
    struct Meta {
        name: String,
        #[serde(default)]
        namespace: String,
        #[serde(default)]
        labels: std::collections::BTreeMap<String, String>,
    }
    #[derive(serde::Deserialize)]
    struct Selecting {
        metadata: Meta,
        spec: SelectingSpec,
    }
    #[derive(serde::Deserialize)]
    struct SelectingSpec {
        selector: crate::resources::LabelSelector,
    }
    #[derive(serde::Deserialize)]
    struct Labelled {
        metadata: Meta,
    }
    let mut selectors: Vec<Selecting> = Vec::new();
    let listed = ctx
        .store
        .backend()
        .scan(kind, &mut |json| {
            selectors.extend(
                serde_json::from_str::<Selecting>(json).ok().filter(|s| s.metadata.namespace == changed.namespace),
            );
            Ok(())
        })
        .await;
    if let Err(e) = listed {
        tracing::warn!("listing {kind} after a change of {changed}: {}", machine_driver_util::error_chain(&e));
        return Vec::new();
    }
    if selectors.is_empty() {
        return Vec::new();
    }
    let labels = match ctx.store.backend().get(changed).await {
        Ok(Some(json)) => serde_json::from_str::<Labelled>(&json).ok().map(|o| o.metadata.labels),
        Ok(None) => None,
        Err(e) => {
            tracing::warn!("reading {changed}: {}", machine_driver_util::error_chain(&e));
            None
        }
    };
    selectors
        .into_iter()
        .filter(|s| labels.as_ref().is_none_or(|l| s.spec.selector.matches(l)))
        .map(|s| Key::new(kind, &s.metadata.namespace, &s.metadata.name))
        .collect()
}

/// A MachineClass or a Secret changed: every class that uses it, and every deployment, pool and
/// machine of those classes, is to run again with its backoff forgotten — a machine waiting
/// out a refused credential retries at once after the Secret is fixed.
async fn class_users(ctx: &Ctx, changed: &Key) -> Vec<Key> {
    use crate::resources::MachineClass;
    let classes: Vec<String> = match changed.kind {
        Kind::MachineClass => {
            // Only a new generation (spec) wakes; the class's status writes do not.
            let Ok(Some(class)) = ctx.store.get::<MachineClass>(&changed.namespace, &changed.name).await else {
                return Vec::new();
            };
            if !ctx.app.dependents_due(changed, class.metadata.generation) {
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
                tracing::warn!("listing classes after a change of {changed}: {}", machine_driver_util::error_chain(&e));
                return Vec::new();
            }
        },
    };
    if classes.is_empty() {
        return Vec::new();
    }
    let uses = |ns: &str, class: &str| ns == changed.namespace && classes.iter().any(|c| c == class);
    let mut keys: Vec<Key> = classes.iter().map(|c| Key::new(Kind::MachineClass, &changed.namespace, c)).collect();
    // Objects may be many: only their name, namespace and class are read.
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
        class_ref: Option<crate::resources::NameRef>,
        template: Option<Box<UserTemplate>>,
    }
    #[derive(serde::Deserialize)]
    struct UserTemplate {
        spec: UserSpec,
    }
    impl UserSpec {
        /// `classRef`, or the template's.
        fn class(&self) -> Option<&str> {
            let template = self.template.as_ref().and_then(|t| t.spec.class());
            self.class_ref.as_ref().map(|r| r.name.as_str()).or(template)
        }
    }
    for kind in class_dependents() {
        let mut found = Vec::new();
        let listed = ctx
            .store
            .backend()
            .scan(kind, &mut |json| {
                if let Ok(o) = serde_json::from_str::<ClassUser>(json) {
                    if o.spec.class().is_some_and(|class| uses(&o.metadata.namespace, class)) {
                        found.push(Key::new(kind, &o.metadata.namespace, &o.metadata.name));
                    }
                }
                Ok(())
            })
            .await;
        match listed {
            Ok(()) => keys.extend(found),
            Err(e) => {
                tracing::warn!("listing {kind} after a change of {changed}: {}", machine_driver_util::error_chain(&e))
            }
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
        assert!(has_dependents(Kind::Machine), "machines wake the health checks that select them");
        assert!(!has_dependents(Kind::MachineDeployment));
        assert_eq!(class_dependents().collect::<Vec<_>>(), [Kind::MachineDeployment, Kind::MachinePool, Kind::Machine]);
    }

    #[test]
    fn every_woken_kind_has_a_reconciler() {
        for r in relations() {
            assert!(reconciled().contains(&r.wakes), "{r:?}");
        }
        assert!(!reconciled().contains(&Kind::Secret));
        assert_eq!(
            reconciled(),
            [Kind::MachineClass, Kind::MachineDeployment, Kind::MachinePool, Kind::Machine, Kind::MachineHealthCheck]
        );
    }

    #[test]
    fn the_relations_are_the_declared_ones() {
        let got: Vec<(Kind, Kind, Via)> = relations().map(|r| (r.changed, r.wakes, r.via)).collect();
        let mut want = vec![
            (Kind::Machine, Kind::MachineDeployment, Via::Owner),
            (Kind::Machine, Kind::MachinePool, Via::Owner),
            (Kind::MachineClass, Kind::MachineDeployment, Via::ClassRef),
            (Kind::MachineClass, Kind::MachinePool, Via::ClassRef),
            (Kind::MachineClass, Kind::Machine, Via::ClassRef),
            (Kind::Secret, Kind::MachineClass, Via::SecretRef),
            (Kind::Machine, Kind::MachineHealthCheck, Via::Selector),
        ];
        let mut got_sorted = got.clone();
        got_sorted.sort_by_key(|(c, w, _)| (*c, *w));
        want.sort_by_key(|(c, w, _)| (*c, *w));
        assert_eq!(got_sorted, want);
    }
}
