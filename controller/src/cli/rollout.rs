//! `rollout status`, `rollout pause` and `rollout resume`.

use std::time::Duration;

use crate::exit::Exit;
use crate::resources::*;
use crate::store::{Store, WatchEvent};

use super::fail;

/// `rollout pause` / `rollout resume`: sets `spec.paused` (read again and retried on a
/// conflict with the controller or another writer).
pub(super) async fn set_paused(store: &Store, namespace: &str, name: &str, paused: bool) -> Result<(), Exit> {
    let what = if paused { "paused" } else { "resumed" };
    for _ in 0..5 {
        let Some(mut md) = store.get::<MachineDeployment>(namespace, name).await? else {
            return Err(fail(format!("MachineDeployment {name} not found in namespace {namespace}")));
        };
        if md.spec.paused == paused {
            println!("machinedeployment {name} already {what}");
            return Ok(());
        }
        md.spec.paused = paused;
        match store.update(&md).await {
            Ok(_) => {
                println!("machinedeployment {name} {what}");
                return Ok(());
            }
            Err(crate::store::Error::Conflict { .. }) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(fail(format!("MachineDeployment {name} kept changing; try again")))
}

/// The canary and pause lines of `rollout status`, if there are any.
fn rollout_lines(md: &MachineDeployment, now: Time) -> Vec<String> {
    let mut out = Vec::new();
    // The latest canary, whether it is under way, passed or failed (and its revision was rolled back).
    if let Some(k) = &md.status.canary {
        out.push(k.summary(now));
    }
    if md.spec.paused {
        out.push(format!(
            "paused: no machine of the new revision is made and no old one removed (machine-controller rollout resume {})",
            md.metadata.name
        ));
    }
    out
}

pub(super) async fn rollout_status(
    store: &Store,
    namespace: &str,
    name: &str,
    timeout: Duration,
    watch: bool,
) -> Result<(), Exit> {
    use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
    let deadline = tokio::time::Instant::now() + timeout;
    let bars = MultiProgress::new();
    let style = ProgressStyle::with_template("{prefix:>10} [{bar:40}] {pos}/{len} {msg}")
        .map_err(|e| fail(e.to_string()))?
        .progress_chars("=> ");
    let updated = bars.add(ProgressBar::new(0).with_style(style.clone()).with_prefix("updated"));
    let available = bars.add(ProgressBar::new(0).with_style(style).with_prefix("available"));
    // Subscribed before the first read: every status change after it wakes this loop.
    let mut changes = store.watch::<MachineDeployment>(None);
    // The canary and pause lines last printed (watching: printed again when they change, the
    // seconds of pause left aside).
    let mut shown = String::new();
    loop {
        let Some(md) = store.get::<MachineDeployment>(namespace, name).await? else {
            return Err(fail(format!("MachineDeployment {name} not found in namespace {namespace}")));
        };
        let desired = md.spec.replicas.max(0) as u64;
        updated.set_length(desired);
        available.set_length(desired);
        updated.set_position((md.status.updated_replicas.max(0) as u64).min(desired));
        available.set_position((md.status.available_replicas.max(0) as u64).min(desired));
        let progressing = condition(&md.status.conditions, ConditionType::Progressing);
        let msg = progressing.map(|c| format!("{}: {}", c.reason, c.message)).unwrap_or_default();
        available.set_message(msg.clone());
        updated.set_message(format!("revision {} ({} machines total)", md.status.target_revision, md.status.replicas));
        let observed = md.status.observed_generation >= md.metadata.generation;
        let lines = rollout_lines(&md, chrono::Utc::now());
        let key = {
            let mut k = md.status.canary.clone();
            if let Some(k) = k.as_mut() {
                k.pause_until = None;
            }
            format!("{k:?} {}", md.spec.paused)
        };
        if watch && key != shown && !lines.is_empty() {
            bars.suspend(|| lines.iter().for_each(|l| println!("{l}")));
        }
        shown = key;
        // The spec's revision failed (the rollout was aborted, and rolled back if it could): the
        // same answer whenever it is asked, watching or not, and however far the rollback got.
        let spec_rev = crate::plan::deployment::revision(&md.spec.template);
        let failed = md.status.bad_revisions.iter().rev().find(|b| b.revision == spec_rev);
        let aborted = progressing.is_some_and(|c| matches!(c.reason, Reason::RolloutAborted | Reason::NoGoodRevision));
        if observed && (aborted || failed.is_some()) {
            bars.clear().ok();
            if !watch {
                lines.iter().for_each(|l| println!("{l}"));
            }
            let why = match failed {
                Some(b) if !msg.contains(&b.reason) => format!("revision {spec_rev} failed ({}); {msg}", b.reason),
                _ => msg,
            };
            return Err(Exit { message: format!("rollout of {name} aborted: {why}"), code: 1 });
        }
        let done = observed
            && md.status.available_replicas == md.spec.replicas
            && md.status.replicas == md.spec.replicas
            && md.status.updated_replicas == md.spec.replicas;
        if done {
            updated.finish();
            available.finish();
            if !watch {
                lines.iter().for_each(|l| println!("{l}"));
            }
            println!("machinedeployment {name} successfully rolled out (revision {})", md.status.target_revision);
            return Ok(());
        }
        if !watch {
            bars.clear().ok();
            println!(
                "waiting for rollout of {name}: {} of {} updated machines available",
                md.status.available_replicas, md.spec.replicas
            );
            lines.iter().for_each(|l| println!("{l}"));
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            bars.clear().ok();
            return Err(Exit { message: format!("rollout of {name} not finished after {timeout:?}"), code: 2 });
        }
        // Wait for a change of this deployment (or the deadline).
        loop {
            match tokio::time::timeout_at(deadline, changes.next()).await {
                Err(_) => break,
                Ok(Ok(WatchEvent::Apply(m))) if m.metadata.name == name && m.metadata.namespace == namespace => break,
                Ok(Ok(WatchEvent::Delete(k))) if k.name == name && k.namespace == namespace => break,
                Ok(Ok(WatchEvent::InitDone)) => break,
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(e.into()),
            }
        }
    }
}
