//! MachineDeployment: keeps `replicas` machines of the target template revision.
//!
//! - RollingUpdate: the Kubernetes Deployment arithmetic (surge rounds up, unavailable rounds
//!   down, both 0 → 1 unavailable). Terminating machines still exist in the cloud, so they count
//!   toward `replicas + maxSurge`: the cloud never holds more than that.
//! - Failed machines are replaced, at most `maxConcurrentReplacements` at once (meltdown
//!   protection).
//! - A rollout whose new machines fail `failureBudget` times is aborted: its revision is
//!   remembered as bad and never applied again (until the template changes), and the deployment
//!   rolls back to the last good revision.
//! - InPlace: CanUpdateMachine decides per machine; machines the driver can update are patched
//!   (their Machine reconciler calls UpdateMachine), the rest are replaced only when allowed.

use std::cmp::Reverse;
use std::collections::HashMap;
use std::time::Duration;

use chrono::Utc;
use driver_sdk::proto as pb;

use super::{machine, resolve};
use crate::resources::*;
use crate::runtime::policy::{self, Decision, Permanent, Rpc, Source, ENVIRONMENT_CONDITIONS};
use crate::runtime::{Action, Ctx, ReconcileError};
use crate::store::{Error as StoreError, Key};

type Result<T> = std::result::Result<T, ReconcileError>;

/// Annotation set on a failed Machine deleted for replacement (counts toward the cap).
pub const ANNOTATION_REPLACING: &str = "machine.driver.dev/replacing";
const HISTORY: usize = 5;

/// The revision (template hash) of a template.
pub fn revision(t: &MachineTemplate) -> String {
    short_hash(t)
}

fn is_available(m: &Machine) -> bool {
    m.status.phase == Phase::Running && !m.is_deleting()
}

/// Whether a failed machine's failure is its revision's doing (or its request's), and so counts
/// against the failure budget: [`policy::blame`]. Credentials, quota, an unavailable cloud and
/// transient errors never do.
pub fn attributable(m: &Machine) -> bool {
    m.status.failure.as_ref().is_none_or(|f| policy::blame(&f.code, &f.reason).counts())
}

/// Sets one condition per environment problem that keeps machines from running (with the
/// driver's reason, message and request ID from one of them), and removes the others.
/// Returns the first problem found.
pub fn lift_environment_conditions(conditions: &mut Vec<Condition>, machines: &[&Machine]) -> Option<&'static str> {
    let mut first = None;
    for kind in ENVIRONMENT_CONDITIONS {
        let waiting: Vec<&&Machine> = machines
            .iter()
            .filter(|m| m.status.conditions.iter().any(|c| c.condition_type == "Ready" && c.reason == kind))
            .collect();
        match waiting.first() {
            Some(m) => {
                first.get_or_insert(kind);
                let reason = m
                    .status
                    .last_operation
                    .as_ref()
                    .filter(|o| !o.reason.is_empty())
                    .map(|o| machine::upper_camel(&o.reason))
                    .unwrap_or_else(|| kind.to_string());
                let detail = m
                    .status
                    .conditions
                    .iter()
                    .find(|c| c.condition_type == "Ready")
                    .map(|c| c.message.clone())
                    .unwrap_or_default();
                let msg = format!("{} machine(s) waiting, e.g. {}: {detail}", waiting.len(), m.metadata.name);
                set_condition(conditions, kind, true, &reason, &msg);
            }
            None => conditions.retain(|c| c.condition_type != kind),
        }
    }
    first
}

fn rev_of(m: &Machine) -> &str {
    m.metadata.labels.get(LABEL_REVISION).map(String::as_str).unwrap_or("")
}

/// Scale-down order: annotated, failed, unhealthy, not yet running, updating, running; then
/// by the deployment's policy.
pub fn deletion_order(machines: &mut [Machine], policy: DeletePolicy) {
    fn rank(m: &Machine) -> u8 {
        if m.metadata.annotations.get(ANNOTATION_DELETE).is_some_and(|v| v != "false") {
            return 0;
        }
        match m.status.phase {
            Phase::Failed => 1,
            Phase::Unknown => 2,
            Phase::Pending | Phase::Creating => 3,
            Phase::Updating => 4,
            Phase::Running | Phase::Terminating => 5,
        }
    }
    match policy {
        DeletePolicy::Oldest => {
            machines.sort_by_key(|m| (rank(m), m.metadata.creation_timestamp, m.metadata.name.clone()))
        }
        DeletePolicy::Newest => {
            machines.sort_by_key(|m| (rank(m), Reverse(m.metadata.creation_timestamp), m.metadata.name.clone()))
        }
        DeletePolicy::Random => machines.sort_by_key(|m| (rank(m), short_hash(&m.metadata.uid))),
    }
}

/// Reconciles one MachineDeployment.
///
/// # Errors
/// Store failures.
pub async fn reconcile(ctx: &Ctx, key: &Key) -> Result<Action> {
    let Some(md) = ctx.store.get::<MachineDeployment>(&key.namespace, &key.name).await? else {
        return Ok(Action::AwaitChange);
    };
    let machines: Vec<Machine> = ctx.store.list_owned(&md.metadata).await?;
    if md.metadata.deletion_timestamp.is_some() {
        return teardown(ctx, md, machines).await;
    }
    if !md.metadata.finalizers.iter().any(|f| f == FINALIZER) {
        let mut with = md.clone();
        with.metadata.finalizers.push(FINALIZER.into());
        return match ctx.store.update(&with).await {
            Ok(_) | Err(StoreError::Conflict { .. }) => Ok(Action::requeue_now()),
            Err(e) => Err(e.into()),
        };
    }
    let mut next = md.clone();
    let st = &mut next.status;
    let spec_rev = revision(&md.spec.template);
    let now = Utc::now();

    // Which revision to move to: the spec's, unless it failed before.
    let (target_rev, target) = if st.bad_revisions.iter().any(|b| b.revision == spec_rev) {
        match st.revision_history.last() {
            Some(good) => (good.revision.clone(), Some(good.template.clone())),
            None => (spec_rev.clone(), None),
        }
    } else {
        (spec_rev.clone(), Some(md.spec.template.clone()))
    };

    let desired = md.spec.replicas;
    let ru = &md.spec.strategy.rolling_update;
    let surge = ru.max_surge.resolve(desired, true).unwrap_or(1);
    let mut unavailable = ru.max_unavailable.resolve(desired, false).unwrap_or(0);
    if surge == 0 && unavailable == 0 {
        unavailable = 1;
    }
    if md.spec.strategy.strategy_type == StrategyType::InPlace {
        unavailable = md.spec.strategy.in_place.max_unavailable.resolve(desired, false).unwrap_or(1).max(1);
    }

    let live: Vec<&Machine> = machines.iter().filter(|m| !m.is_deleting()).collect();
    let total = machines.len() as i64;
    let new: Vec<&Machine> = live.iter().copied().filter(|m| rev_of(m) == target_rev).collect();
    let old: Vec<&Machine> = live.iter().copied().filter(|m| rev_of(m) != target_rev).collect();
    let new_available = new.iter().filter(|m| is_available(m)).count() as i64;
    let available = live.iter().filter(|m| is_available(m)).count() as i64;

    // Rollout bookkeeping.
    let rolling = target_rev != st.current_revision || !old.is_empty();
    if rolling && st.rollout.as_ref().is_none_or(|r| r.revision != target_rev) {
        st.rollout = Some(RolloutState { revision: target_rev.clone(), started: now, last_progress: now, failures: 0 });
        if !st.current_revision.is_empty() {
            ctx.store
                .event(
                    Kind::MachineDeployment,
                    &md.metadata,
                    false,
                    "RolloutStarted",
                    format!("rolling out revision {target_rev}"),
                )
                .await;
        }
    }
    if let Some(r) = st.rollout.as_mut() {
        if new_available > md.status.available_replicas {
            r.last_progress = now;
        }
    }

    // Failed machines: counted against the failure budget, replaced within the meltdown cap.
    let failed: Vec<&Machine> = live.iter().copied().filter(|m| m.status.phase == Phase::Failed).collect();
    let new_failed_now = failed.iter().filter(|m| rev_of(m) == target_rev && attributable(m)).count() as u32;
    let budget_used = st.rollout.as_ref().map_or(0, |r| r.failures) + new_failed_now;
    if target.is_some()
        && target_rev == spec_rev
        && st.rollout.is_some()
        && budget_used >= md.spec.failure_budget.max(1)
    {
        // Abort: remember the revision as bad and roll back (if there is anything to roll back to).
        let reason =
            format!("{budget_used} machines of revision {target_rev} failed (budget {})", md.spec.failure_budget);
        st.bad_revisions.push(BadRevision { revision: target_rev.clone(), reason: reason.clone(), time: now });
        st.rollout = None;
        let then = match st.revision_history.last() {
            Some(good) => format!("rolling back to the last good revision {}", good.revision),
            None => "no earlier revision to roll back to; change the template".to_string(),
        };
        set_condition(&mut st.conditions, "Progressing", false, "RolloutAborted", &format!("{reason}; {then}"));
        ctx.store
            .event(Kind::MachineDeployment, &md.metadata, true, "RolloutAborted", format!("{reason}; {then}"))
            .await;
        save(ctx, &md, next).await?;
        return Ok(Action::requeue_now());
    }

    let replacing = machines
        .iter()
        .filter(|m| m.is_deleting() && m.metadata.annotations.contains_key(ANNOTATION_REPLACING))
        .count() as i64;
    let mut room_for_replacements = i64::from(md.spec.max_concurrent_replacements) - replacing;
    let mut replaced: std::collections::HashSet<String> = std::collections::HashSet::new();
    // Replacements are paced by the error policy's backoff (per deployment), within the cap.
    let pace = ctx.replacement_wait(key);
    for m in &failed {
        if room_for_replacements <= 0 || !pace.is_zero() {
            break;
        }
        if rev_of(m) == target_rev && attributable(m) {
            if let Some(r) = st.rollout.as_mut() {
                r.failures += 1;
            }
        }
        replace(ctx, m).await?;
        room_for_replacements -= 1;
        replaced.insert(m.metadata.name.clone());
    }
    ctx.replaced(key, replaced.len() as u32);
    if failed.is_empty() {
        ctx.replacements_settled(key);
    }
    let in_place_mode = md.spec.strategy.strategy_type == StrategyType::InPlace;

    if !md.spec.paused {
        if let Some(template) = &target {
            // Scale up the target revision within replicas + maxSurge (terminating included).
            // In place, old machines are converted, so only missing machines are created.
            let room = desired + surge - total;
            let want = if in_place_mode { desired - live.len() as i64 } else { desired - new.len() as i64 };
            for _ in 0..want.min(room).max(0) {
                create(ctx, &md, template, &target_rev).await?;
            }
        }

        // In place: move old machines to the target template where the driver can.
        if in_place_mode && !old.is_empty() {
            if let Some(template) = &target {
                in_place(ctx, &md, template, &target_rev, &old, unavailable, &mut next.status).await?;
            }
        }

        // Scale down old machines without going below replicas − maxUnavailable.
        let min_available = desired - unavailable;
        let new_unavailable = new.len() as i64 - new_available;
        let mut budget = live.len() as i64 - min_available - new_unavailable;
        if in_place_mode {
            // Only a scale-down removes machines here; updates happen in place.
            budget = budget.min(live.len() as i64 - desired);
        }
        let mut old_sorted: Vec<Machine> =
            old.iter().filter(|m| !replaced.contains(&m.metadata.name)).map(|m| (*m).clone()).collect();
        deletion_order(&mut old_sorted, md.spec.delete_policy);
        let mut can_remove_available = available - min_available;
        for m in &old_sorted {
            if budget <= 0 {
                break;
            }
            if is_available(m) {
                if can_remove_available <= 0 {
                    continue;
                }
                can_remove_available -= 1;
            }
            ctx.store.delete(&Key::of(m)).await?;
            budget -= 1;
        }
    }

    // Scale down the target revision when there are too many (scale-down or leftover surge).
    let excess = new.len() as i64 - desired;
    if excess > 0 {
        let mut new_sorted: Vec<Machine> =
            new.iter().filter(|m| !replaced.contains(&m.metadata.name)).map(|m| (*m).clone()).collect();
        deletion_order(&mut new_sorted, md.spec.delete_policy);
        for m in new_sorted.iter().take(excess as usize) {
            ctx.store.delete(&Key::of(m)).await?;
        }
    }

    // Status.
    let st = &mut next.status;
    st.observed_generation = md.metadata.generation;
    st.replicas = total;
    st.updated_replicas = new.len() as i64;
    st.ready_replicas = available;
    st.available_replicas = new_available;
    st.failed_replicas = failed.len() as i64;
    st.target_revision = target_rev.clone();
    let complete = target.is_some() && new_available >= desired && old.is_empty() && new.len() as i64 == desired;
    if complete {
        if st.current_revision != target_rev {
            if !st.current_revision.is_empty() {
                ctx.store
                    .event(
                        Kind::MachineDeployment,
                        &md.metadata,
                        false,
                        "RolloutComplete",
                        format!("revision {target_rev} is rolled out"),
                    )
                    .await;
            }
            st.current_revision = target_rev.clone();
        }
        if let Some(template) = &target {
            st.revision_history.retain(|r| r.revision != target_rev);
            st.revision_history.push(RevisionRecord { revision: target_rev.clone(), template: template.clone() });
            let n = st.revision_history.len();
            if n > HISTORY {
                st.revision_history.drain(..n - HISTORY);
            }
        }
        st.rollout = None;
        let msg = if target_rev != spec_rev { "rolled back: the spec's revision failed before" } else { "" };
        set_condition(
            &mut st.conditions,
            "Progressing",
            true,
            if msg.is_empty() { "NewRevisionAvailable" } else { "RolledBack" },
            msg,
        );
    } else if target.is_none() {
        set_condition(
            &mut st.conditions,
            "Progressing",
            false,
            "NoGoodRevision",
            &format!(
                "revision {spec_rev} failed ({}) and there is no earlier revision to roll back to; change the template",
                st.bad_revisions.iter().rev().find(|b| b.revision == spec_rev).map_or("", |b| b.reason.as_str())
            ),
        );
    } else if let Some(r) = &st.rollout {
        let stalled = (now - r.last_progress).to_std().unwrap_or_default()
            > Duration::from_secs(md.spec.progress_deadline_seconds);
        if stalled {
            set_condition(
                &mut st.conditions,
                "Progressing",
                false,
                "ProgressDeadlineExceeded",
                &format!("no progress for {}s", md.spec.progress_deadline_seconds),
            );
        } else {
            set_condition(
                &mut st.conditions,
                "Progressing",
                true,
                "Rolling",
                &format!("{} of {desired} machines on revision {target_rev}", new_available),
            );
        }
    } else {
        set_condition(
            &mut st.conditions,
            "Progressing",
            true,
            "Scaling",
            &format!("{new_available} of {desired} running"),
        );
    }
    let waiting: Vec<&Machine> = live.iter().copied().filter(|m| !is_available(m)).collect();
    let environment = lift_environment_conditions(&mut st.conditions, &waiting);
    let min_available = desired - unavailable;
    let below_reason = environment.unwrap_or("BelowMinimum");
    set_condition(
        &mut st.conditions,
        "Available",
        available >= min_available,
        if available >= min_available { "MinimumAvailable" } else { below_reason },
        &format!("{available} running, {min_available} required"),
    );
    save(ctx, &md, next.clone()).await?;
    Ok(if complete && failed.is_empty() {
        Action::AwaitChange
    } else if !failed.is_empty() {
        // Come back when the next replacement may go.
        Action::requeue(ctx.replacement_wait(key).clamp(Duration::from_millis(100), Duration::from_secs(5)))
    } else {
        Action::requeue(Duration::from_secs(5))
    })
}

async fn save(ctx: &Ctx, before: &MachineDeployment, after: MachineDeployment) -> Result<()> {
    if after.status == before.status {
        return Ok(());
    }
    match ctx.store.update_status(&after).await {
        Ok(_) | Err(StoreError::Conflict { .. }) | Err(StoreError::NotFound(_)) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

async fn create(ctx: &Ctx, md: &MachineDeployment, t: &MachineTemplate, rev: &str) -> Result<()> {
    let suffix: String = uuid::Uuid::new_v4().simple().to_string()[..5].to_string();
    let name = format!("{}-{}-{suffix}", md.metadata.name, &rev[..rev.len().min(5)]);
    let mut m = Machine::new(
        &md.metadata.namespace,
        &name,
        MachineSpec {
            class_ref: t.spec.class_ref.clone(),
            provider_spec: t.spec.provider_spec.clone(),
            pool_ref: None,
            creation_timeout_seconds: Some(md.spec.creation_timeout_seconds),
            health_timeout_seconds: Some(md.spec.health_timeout_seconds),
        },
    );
    m.metadata.labels = t.metadata.labels.clone();
    m.metadata.labels.insert(LABEL_DEPLOYMENT.into(), md.metadata.name.clone());
    m.metadata.labels.insert(LABEL_REVISION.into(), rev.into());
    m.metadata.annotations = t.metadata.annotations.clone();
    m.metadata.finalizers = vec![FINALIZER.into()];
    m.metadata.owner_references = vec![OwnerReference {
        api_version: API_VERSION.into(),
        kind: Kind::MachineDeployment.as_str().into(),
        name: md.metadata.name.clone(),
        uid: md.metadata.uid.clone(),
        controller: true,
    }];
    match ctx.store.create(&m).await {
        Ok(_) | Err(StoreError::AlreadyExists(_)) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Deletes a failed machine so it gets replaced, marking it as a replacement.
async fn replace(ctx: &Ctx, m: &Machine) -> Result<()> {
    let mut marked = m.clone();
    marked.metadata.annotations.insert(ANNOTATION_REPLACING.into(), "true".into());
    match ctx.store.update(&marked).await {
        Ok(_) => {}
        Err(StoreError::Conflict { .. }) | Err(StoreError::NotFound(_)) => return Ok(()),
        Err(e) => return Err(e.into()),
    }
    let why = m.status.failure.as_ref().map(|f| f.message.clone()).unwrap_or_default();
    ctx.store
        .event(
            Kind::Machine,
            &m.metadata,
            true,
            "Replacing",
            format!("{} failed ({why}); replacing it", m.metadata.name),
        )
        .await;
    ctx.store.delete(&Key::of(m)).await?;
    Ok(())
}

async fn in_place(
    ctx: &Ctx,
    md: &MachineDeployment,
    template: &MachineTemplate,
    rev: &str,
    old: &[&Machine],
    max_unavailable: i64,
    status: &mut MachineDeploymentStatus,
) -> Result<()> {
    let busy = old.iter().filter(|m| m.status.phase == Phase::Updating).count() as i64;
    let mut budget = max_unavailable - busy;
    let mut blocked: HashMap<String, Vec<String>> = HashMap::new();
    for m in old.iter().filter(|m| m.status.phase == Phase::Running) {
        if budget <= 0 {
            break;
        }
        let ns = &m.metadata.namespace;
        let current = match resolve(ctx, ns, &m.spec.class_ref.name, m.spec.provider_spec.as_ref()).await? {
            Ok(r) => r,
            Err(_) => continue,
        };
        let desired =
            match resolve(ctx, ns, &template.spec.class_ref.name, template.spec.provider_spec.as_ref()).await? {
                Ok(r) => r,
                Err(_) => continue,
            };
        let same_driver = current.class.spec.driver == desired.class.spec.driver;
        let plan = if same_driver {
            let req = pb::CanUpdateMachineRequest {
                name: m.metadata.name.clone(),
                current_provider_spec: Some(driver_sdk::convert::json_to_struct(&current.provider_spec)),
                desired_provider_spec: Some(driver_sdk::convert::json_to_struct(&desired.provider_spec)),
                secrets: desired.secrets.clone(),
            };
            match ctx.call(desired.driver, "CanUpdateMachine", |c| async move { c.can_update_machine(req).await }).await
            {
                Ok(reply) => Some(reply.value),
                Err(e)
                    if policy::decide(&e.report, Source::Call(Rpc::Read))
                        == Decision::Permanent(Permanent::Unsupported) =>
                {
                    None
                }
                Err(_) => continue,
            }
        } else {
            None
        };
        match plan {
            Some(p) if p.replace_paths.is_empty() => {
                let mut patched = (*m).clone();
                patched.spec.class_ref = template.spec.class_ref.clone();
                patched.spec.provider_spec = template.spec.provider_spec.clone();
                patched.metadata.labels.insert(LABEL_REVISION.into(), rev.into());
                match ctx.store.update(&patched).await {
                    Ok(_) | Err(StoreError::Conflict { .. }) | Err(StoreError::NotFound(_)) => {}
                    Err(e) => return Err(e.into()),
                }
                budget -= 1;
            }
            other => {
                let paths = other.map(|p| p.replace_paths).unwrap_or_else(|| vec!["(driver or class)".into()]);
                if md.spec.strategy.in_place.fallback_to_replace {
                    ctx.store
                        .event(
                            Kind::Machine,
                            &m.metadata,
                            false,
                            "ReplacingForUpdate",
                            format!("{} cannot change in place; replacing", paths.join(", ")),
                        )
                        .await;
                    ctx.store.delete(&Key::of(*m)).await?;
                    budget -= 1;
                } else {
                    blocked.insert(m.metadata.name.clone(), paths);
                }
            }
        }
    }
    if !blocked.is_empty() {
        let mut names: Vec<&String> = blocked.keys().collect();
        names.sort();
        set_condition(
            &mut status.conditions,
            "InPlaceUpdatePossible",
            false,
            "NeedsReplacement",
            &format!("{} machine(s) need replacement and fallbackToReplace is off: {:?}", blocked.len(), names),
        );
    } else {
        set_condition(&mut status.conditions, "InPlaceUpdatePossible", true, "Updatable", "");
    }
    Ok(())
}

/// A deleted deployment deletes its machines, then lets go.
async fn teardown(ctx: &Ctx, md: MachineDeployment, machines: Vec<Machine>) -> Result<Action> {
    if !machines.is_empty() {
        for m in machines.iter().filter(|m| !m.is_deleting()) {
            ctx.store.delete(&Key::of(m)).await?;
        }
        return Ok(Action::requeue(Duration::from_secs(2)));
    }
    let mut done = md.clone();
    done.metadata.finalizers.retain(|f| f != FINALIZER);
    match ctx.store.update(&done).await {
        Ok(_) | Err(StoreError::NotFound(_)) => Ok(Action::AwaitChange),
        Err(StoreError::Conflict { .. }) => Ok(Action::requeue_now()),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine(name: &str, phase: Phase, age: i64) -> Machine {
        let mut m = Machine::new("default", name, MachineSpec::default());
        m.status.phase = phase;
        m.metadata.creation_timestamp = Some(Utc::now() - chrono::Duration::seconds(age));
        m
    }

    #[test]
    fn deletion_order_prefers_annotated_failed_unhealthy_then_policy() {
        let mut annotated = machine("annotated", Phase::Running, 1);
        annotated.metadata.annotations.insert(ANNOTATION_DELETE.into(), "true".into());
        let mut ms = vec![
            machine("young", Phase::Running, 10),
            machine("old", Phase::Running, 100),
            machine("failed", Phase::Failed, 5),
            annotated,
            machine("unknown", Phase::Unknown, 5),
            machine("creating", Phase::Creating, 5),
        ];
        deletion_order(&mut ms, DeletePolicy::Oldest);
        let names: Vec<&str> = ms.iter().map(|m| m.metadata.name.as_str()).collect();
        assert_eq!(names, vec!["annotated", "failed", "unknown", "creating", "old", "young"]);
        deletion_order(&mut ms, DeletePolicy::Newest);
        assert_eq!(ms[4].metadata.name, "young");
    }

    #[test]
    fn revisions_follow_the_template() {
        let mut t = MachineTemplate::default();
        t.spec.class_ref.name = "a".into();
        let r1 = revision(&t);
        t.spec.class_ref.name = "b".into();
        assert_ne!(r1, revision(&t));
    }
}
