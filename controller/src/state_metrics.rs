//! What the objects say, as metrics (Karpenter's way: from the controller itself, not from
//! kube-state-metrics): per kind, how many objects have each condition type in each status and
//! the longest any of them has held it; per owner, its replicas desired, available, updated,
//! ready and failed; machines taken for a disruption, by reason; owners whose disruptions are
//! held, by the reason of their `DisruptionBlocked` condition; and the transitions of conditions
//! into each status, counted between two passes (a changed status or transition time). No
//! machine name is a label: a series is a kind, a condition, a reason, or an owner.
//!
//! Recounted by the controller's gauges task ([`crate::app::gauges`]) from one pass over the
//! store; an owner that went has its series removed.

use machine_driver_util::lock;
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::resources::{Condition, ConditionStatus, ConditionType};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ConditionLabels {
    kind: String,
    r#type: String,
    status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OwnerLabels {
    kind: String,
    namespace: String,
    name: String,
    replicas: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReasonLabels {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct HeldLabels {
    kind: String,
    reason: String,
}

/// The metrics of what the objects say.
#[derive(Clone, Default)]
pub struct StateMetrics {
    conditions: Family<ConditionLabels, Gauge>,
    held_seconds: Family<ConditionLabels, Gauge>,
    owner_replicas: Family<OwnerLabels, Gauge>,
    disruptions: Family<ReasonLabels, Gauge>,
    held: Family<HeldLabels, Gauge>,
    transitions: Family<ConditionLabels, Counter>,
    /// The series set at the last count, so those gone since are removed.
    last: std::sync::Arc<Mutex<Last>>,
}

#[derive(Default)]
struct Last {
    conditions: HashSet<ConditionLabels>,
    owners: HashSet<OwnerLabels>,
    disruptions: HashSet<ReasonLabels>,
    held: HashSet<HeldLabels>,
    /// Each object's conditions at the last count, by a hash of (kind, namespace, name, type):
    /// status and transition time. `None` before the first count, which only sets them (a
    /// restarted controller does not count every condition as a transition).
    seen: Option<HashMap<u64, (ConditionStatus, i64)>>,
}

/// One count, built over a pass and then published whole ([`StateMetrics::publish`]).
#[derive(Default)]
pub struct Count {
    conditions: HashMap<ConditionLabels, (i64, i64)>,
    owners: HashMap<OwnerLabels, i64>,
    disruptions: HashMap<ReasonLabels, i64>,
    held: HashMap<HeldLabels, i64>,
    /// Each condition seen, by its key's hash: what it is and (status, transition time in ms).
    /// No labels are built here: only a transition needs them.
    seen: HashMap<u64, (&'static str, ConditionType, ConditionStatus, i64)>,
}

/// The object `namespace/name` of `kind`: which condition of it `condition_type` is.
pub struct Object<'a> {
    /// Its kind.
    pub kind: &'static str,
    /// Its namespace.
    pub namespace: &'a str,
    /// Its name.
    pub name: &'a str,
}

impl Count {
    /// An object with these conditions, at `now`.
    pub fn conditions(&mut self, object: Object<'_>, conditions: &[Condition], now: crate::resources::Time) {
        let kind = object.kind;
        for c in conditions {
            self.condition(&object, c.condition_type, c.status, c.last_transition_time, now);
            if c.condition_type == ConditionType::DisruptionBlocked && c.status == ConditionStatus::True {
                *self.held.entry(HeldLabels { kind: kind.into(), reason: c.reason.to_string() }).or_default() += 1;
            }
        }
    }

    /// One condition of an object, in `status` since `since`.
    pub fn condition(
        &mut self,
        object: &Object<'_>,
        condition_type: ConditionType,
        status: ConditionStatus,
        since: crate::resources::Time,
        now: crate::resources::Time,
    ) {
        let labels = ConditionLabels {
            kind: object.kind.into(),
            r#type: condition_type.as_str().into(),
            status: status.as_str().into(),
        };
        let key = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (object.kind, object.namespace, object.name, condition_type.as_str()).hash(&mut h);
            h.finish()
        };
        self.seen.insert(key, (object.kind, condition_type, status, since.timestamp_millis()));
        let held = (now - since).num_seconds().max(0);
        let entry = self.conditions.entry(labels).or_default();
        entry.0 += 1;
        entry.1 = entry.1.max(held);
    }

    /// An owner's replicas: `(state, count)` pairs (`desired`, `available`, …).
    pub fn owner(&mut self, kind: &str, namespace: &str, name: &str, replicas: &[(&str, i64)]) {
        for (state, n) in replicas {
            let labels = OwnerLabels {
                kind: kind.into(),
                namespace: namespace.into(),
                name: name.into(),
                replicas: (*state).into(),
            };
            self.owners.insert(labels, *n);
        }
    }

    /// A machine taken for a disruption of this reason.
    pub fn disruption(&mut self, reason: &str) {
        *self.disruptions.entry(ReasonLabels { reason: reason.into() }).or_default() += 1;
    }
}

impl StateMetrics {
    /// Registers them.
    pub fn register(r: &mut Registry) -> Self {
        let m = Self::default();
        r.register("controller_conditions", "Objects by kind, condition type and status", m.conditions.clone());
        r.register(
            "controller_condition_held_seconds_max",
            "The longest any object of the kind has had the condition in this status, in seconds",
            m.held_seconds.clone(),
        );
        r.register(
            "controller_owner_replicas",
            "A MachineDeployment's or MachinePool's replicas: desired, available, updated, ready, failed",
            m.owner_replicas.clone(),
        );
        r.register(
            "controller_disruptions_in_flight",
            "Machines taken for a disruption (a rollout, a remediation, an interruption...), by reason",
            m.disruptions.clone(),
        );
        r.register(
            "controller_disruptions_held",
            "Owners whose disruptions are held (DisruptionBlocked=True), by kind and the reason that holds them",
            m.held.clone(),
        );
        r.register(
            "controller_condition_transitions",
            "Conditions that changed into this status (by kind and type), seen between two counts",
            m.transitions.clone(),
        );
        m
    }

    /// Publishes `count`: its series set, those of the last count that it lacks removed.
    pub fn publish(&self, count: Count) {
        let mut last = lock(&self.last);
        let mut next = Last::default();
        for (labels, (n, held)) in count.conditions {
            self.conditions.get_or_create(&labels).set(n);
            self.held_seconds.get_or_create(&labels).set(held);
            next.conditions.insert(labels);
        }
        for (labels, n) in count.owners {
            self.owner_replicas.get_or_create(&labels).set(n);
            next.owners.insert(labels);
        }
        for (labels, n) in count.disruptions {
            self.disruptions.get_or_create(&labels).set(n);
            next.disruptions.insert(labels);
        }
        for (labels, n) in count.held {
            self.held.get_or_create(&labels).set(n);
            next.held.insert(labels);
        }
        for gone in last.conditions.difference(&next.conditions) {
            self.conditions.remove(gone);
            self.held_seconds.remove(gone);
        }
        for gone in last.owners.difference(&next.owners) {
            self.owner_replicas.remove(gone);
        }
        for gone in last.disruptions.difference(&next.disruptions) {
            self.disruptions.remove(gone);
        }
        for gone in last.held.difference(&next.held) {
            self.held.remove(gone);
        }
        let mut seen = HashMap::with_capacity(count.seen.len());
        for (key, (kind, condition_type, status, since)) in count.seen {
            if let Some(before) = &last.seen {
                // Changed since the last count, or new since then: one transition into `status`.
                if before.get(&key) != Some(&(status, since)) {
                    let labels = ConditionLabels {
                        kind: kind.into(),
                        r#type: condition_type.as_str().into(),
                        status: status.as_str().into(),
                    };
                    self.transitions.get_or_create(&labels).inc();
                }
            }
            seen.insert(key, (status, since));
        }
        next.seen = Some(seen);
        *last = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::Reason;

    fn condition(t: ConditionType, status: ConditionStatus, reason: Reason, ago: i64) -> Condition {
        Condition {
            condition_type: t,
            status,
            reason,
            message: String::new(),
            last_transition_time: chrono::Utc::now() - chrono::Duration::seconds(ago),
        }
    }

    fn text(r: &Registry) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, r).unwrap();
        out
    }

    #[test]
    fn conditions_and_owners_are_counted_and_what_went_is_removed() {
        let mut r = Registry::default();
        let m = StateMetrics::register(&mut r);
        let now = chrono::Utc::now();
        let mut count = Count::default();
        let blocked = condition(ConditionType::DisruptionBlocked, ConditionStatus::True, Reason::BudgetExhausted, 90);
        let available = condition(ConditionType::Available, ConditionStatus::False, Reason::BelowMinimum, 30);
        let web = || Object { kind: "MachineDeployment", namespace: "shop", name: "web" };
        let api = || Object { kind: "MachineDeployment", namespace: "shop", name: "api" };
        count.conditions(web(), &[blocked.clone(), available.clone()], now);
        count.conditions(api(), std::slice::from_ref(&available), now);
        count.owner("MachineDeployment", "shop", "web", &[("desired", 3), ("available", 1)]);
        count.disruption("Rollout");
        m.publish(count);
        let out = text(&r);
        for line in [
            r#"controller_conditions{kind="MachineDeployment",type="Available",status="False"} 2"#,
            r#"controller_conditions{kind="MachineDeployment",type="DisruptionBlocked",status="True"} 1"#,
            r#"controller_owner_replicas{kind="MachineDeployment",namespace="shop",name="web",replicas="desired"} 3"#,
            r#"controller_disruptions_in_flight{reason="Rollout"} 1"#,
            r#"controller_disruptions_held{kind="MachineDeployment",reason="BudgetExhausted"} 1"#,
        ] {
            assert!(out.contains(line), "no {line} in\n{out}");
        }
        let held = out
            .lines()
            .find(|l| {
                l.starts_with(
                    "controller_condition_held_seconds_max{kind=\"MachineDeployment\",type=\"DisruptionBlocked\"",
                )
            })
            .unwrap();
        let secs: i64 = held.rsplit(' ').next().unwrap().parse().unwrap();
        assert!((89..=91).contains(&secs), "{held}");
        // The first count only notes the conditions: no transition yet.
        assert!(!out.contains("controller_condition_transitions_total{"), "{out}");
        // Next count: web's Available turned True, api's is as it was, api got Ready.
        let mut count = Count::default();
        let now_available = condition(ConditionType::Available, ConditionStatus::True, Reason::MinimumAvailable, 1);
        count.conditions(web(), &[blocked, now_available], now);
        let ready = condition(ConditionType::Ready, ConditionStatus::True, Reason::MinimumAvailable, 1);
        count.conditions(api(), &[available, ready], now);
        m.publish(count);
        let out = text(&r);
        for line in [
            r#"controller_condition_transitions_total{kind="MachineDeployment",type="Available",status="True"} 1"#,
            r#"controller_condition_transitions_total{kind="MachineDeployment",type="Ready",status="True"} 1"#,
        ] {
            assert!(out.contains(line), "no {line} in\n{out}");
        }
        assert!(
            !out.contains(r#"transitions_total{kind="MachineDeployment",type="Available",status="False"}"#),
            "{out}"
        );
        assert!(!out.contains(r#"transitions_total{kind="MachineDeployment",type="DisruptionBlocked""#), "{out}");
        // The owner went, and the disruption ended: their series go.
        m.publish(Count::default());
        let out = text(&r);
        assert!(!out.contains("name=\"web\"") && !out.contains("reason=\"Rollout\""), "{out}");
    }
}
