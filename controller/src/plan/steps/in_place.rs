//! In-place updates, for both kinds (a deployment's InPlace strategy, a pool's maxSurge-0
//! reimages without nodes): [`allowed`] says how many units of an older revision may start
//! updating now, each asked of the disruption planner as an `InPlaceUpdate` until one is held.
//!
//! Then a deployment's per-machine decisions: the driver's `CanUpdateMachine` answer is I/O,
//! asked machine by machine while there is room; [`Budget`] turns each answer into a [`Step`]
//! and keeps count, so the reconciler's loop is "ask, then do what the planner says".

use std::collections::BTreeMap;

use super::scale_down::take;
use crate::plan::disruption::Planner;
use crate::plan::owner::Unit;
use crate::resources::{set_condition, Condition, ConditionType, DisruptionReason, InPlaceDisruption, Reason};

/// How many of `candidates` (in order) may start an in-place update now: asked as
/// `InPlaceUpdate` one after another until one is held, at most `room` of them.
pub fn allowed<T>(candidates: &[&Unit<'_, T>], room: Option<usize>, planner: &mut Planner) -> usize {
    let limit = room.unwrap_or(usize::MAX);
    take(candidates.iter().copied(), limit, true, |_| DisruptionReason::InPlaceUpdate, planner).len()
}

/// What is known about updating one machine in place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The driver can apply every change in place, disrupting the machine this much.
    Updatable(InPlaceDisruption),
    /// These paths cannot change in place (or the driver or class changes, or the driver has no
    /// in-place updates).
    NeedsReplacement(Vec<String>),
    /// Nothing known this time (the class did not resolve, the driver did not answer): skip it.
    Unknown,
}

/// What to do with one machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Move its spec to the target template, saying what the update disrupts; its Machine
    /// reconciler drains it if need be and calls UpdateMachine.
    Patch(InPlaceDisruption),
    /// Delete it: its replacement is created on the target revision (fallbackToReplace).
    Replace(Vec<String>),
    /// Leave it: it needs replacement and fallbackToReplace is off.
    Blocked,
    /// Leave it for now.
    Skip,
}

/// The in-place budget of one reconcile: how many machines may start updating (or be replaced),
/// as the disruption planner allowed ([`crate::plan::disruption`]: `maxUnavailable`, the budgets).
#[derive(Debug, Clone)]
pub struct Budget {
    left: i64,
    fallback_to_replace: bool,
    blocked: BTreeMap<String, Vec<String>>,
}

impl Budget {
    /// `allowed` machines may start now.
    pub fn new(allowed: usize, fallback_to_replace: bool) -> Self {
        Self { left: allowed as i64, fallback_to_replace, blocked: BTreeMap::new() }
    }

    /// Whether another machine may start now.
    pub fn has_room(&self) -> bool {
        self.left > 0
    }

    /// The step for machine `name` given what is known about it.
    pub fn step(&mut self, name: &str, verdict: Verdict) -> Step {
        if !self.has_room() {
            return Step::Skip;
        }
        match verdict {
            Verdict::Unknown => Step::Skip,
            Verdict::Updatable(disruption) => {
                self.left -= 1;
                Step::Patch(disruption)
            }
            Verdict::NeedsReplacement(paths) if self.fallback_to_replace => {
                self.left -= 1;
                Step::Replace(paths)
            }
            Verdict::NeedsReplacement(paths) => {
                self.blocked.insert(name.to_string(), paths);
                Step::Blocked
            }
        }
    }

    /// Sets `InPlaceUpdatePossible`: false, naming the blocked machines, when any was blocked.
    pub fn finish(self, conditions: &mut Vec<Condition>) {
        if self.blocked.is_empty() {
            set_condition(conditions, ConditionType::InPlaceUpdatePossible, true, Reason::Updatable, "");
        } else {
            let names: Vec<&String> = self.blocked.keys().collect();
            let msg =
                format!("{} machine(s) need replacement and fallbackToReplace is off: {names:?}", self.blocked.len());
            set_condition(conditions, ConditionType::InPlaceUpdatePossible, false, Reason::NeedsReplacement, &msg);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UPDATABLE: Verdict = Verdict::Updatable(InPlaceDisruption::Reboot);
    const PATCH: Step = Step::Patch(InPlaceDisruption::Reboot);

    fn needs(path: &str) -> Verdict {
        Verdict::NeedsReplacement(vec![path.into()])
    }

    /// (allowed, fallbackToReplace, verdicts in order) → steps, and the condition.
    #[test]
    fn in_place_steps_follow_the_budget_and_the_fallback() {
        use Step::*;
        type Row = (usize, bool, Vec<Verdict>, Vec<Step>, (&'static str, &'static str));
        let rows: Vec<Row> = vec![
            // One at a time: the first updatable machine is patched, the rest wait.
            (1, false, vec![UPDATABLE, UPDATABLE], vec![PATCH, Skip], ("True", "Updatable")),
            // One more may start: one is patched.
            (1, false, vec![UPDATABLE, UPDATABLE], vec![PATCH, Skip], ("True", "Updatable")),
            // None may start (the planner held them): nothing starts.
            (0, false, vec![UPDATABLE], vec![Skip], ("True", "Updatable")),
            // Unknown answers are skipped without using budget.
            (1, false, vec![Verdict::Unknown, UPDATABLE], vec![Skip, PATCH], ("True", "Updatable")),
            // Blocked machines use no budget, and the condition names them.
            (
                1,
                false,
                vec![needs("provider_spec.zone"), UPDATABLE],
                vec![Blocked, PATCH],
                ("False", "NeedsReplacement"),
            ),
            // With fallbackToReplace they are replaced, within the budget.
            (
                1,
                true,
                vec![needs("provider_spec.zone"), UPDATABLE],
                vec![Replace(vec!["provider_spec.zone".into()]), Skip],
                ("True", "Updatable"),
            ),
            (
                3,
                true,
                vec![needs("(driver or class)"), UPDATABLE, needs("a")],
                vec![Replace(vec!["(driver or class)".into()]), PATCH, Replace(vec!["a".into()])],
                ("True", "Updatable"),
            ),
        ];
        for (i, (allowed, fallback, verdicts, want, (status, reason))) in rows.into_iter().enumerate() {
            let mut budget = Budget::new(allowed, fallback);
            let steps: Vec<Step> =
                verdicts.into_iter().enumerate().map(|(n, v)| budget.step(&format!("m{n}"), v)).collect();
            assert_eq!(steps, want, "row {i}");
            let mut conditions = Vec::new();
            budget.finish(&mut conditions);
            assert_eq!((conditions[0].status.as_str(), conditions[0].reason.as_str()), (status, reason), "row {i}");
        }
    }

    #[test]
    fn the_blocked_condition_lists_the_machines_sorted() {
        let mut budget = Budget::new(1, false);
        budget.step("web-b", needs("x"));
        budget.step("web-a", needs("y"));
        let mut conditions = Vec::new();
        budget.finish(&mut conditions);
        assert!(conditions[0].message.starts_with("2 machine(s) need replacement"), "{}", conditions[0].message);
        assert!(conditions[0].message.ends_with(r#"["web-a", "web-b"]"#), "{}", conditions[0].message);
    }
}
