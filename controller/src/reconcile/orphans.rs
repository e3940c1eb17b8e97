//! Orphan collection: cloud machines tagged as this controller's but with no Machine object are
//! deleted after a grace period, with an event and a metric.

use machine_driver_util::lock;
use std::collections::HashSet;
use std::sync::Arc;

use driver_sdk::proto as pb;
use tokio::time::Instant;

use super::resolve;
use crate::app::Ctx;
use crate::events::EventReason;
use crate::policy::{self, Decision, Permanent, Rpc, Source};
use crate::resources::*;

/// Runs collection every `orphan_interval` until aborted.
pub async fn run(ctx: Arc<Ctx>) {
    let mut tick = tokio::time::interval(ctx.app.settings.orphan_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Err(e) = collect(&ctx).await {
            tracing::warn!("orphan collection: {}", machine_driver_util::error_chain(&e));
        }
    }
}

/// The cloud machines the driver lists with this selector that `keep` picks, page by page, each
/// page through the runtime's one call path (rate limit, deadline, metrics, request IDs in the
/// log). Only what `keep` returns outlives its page: with 100,000 machines in the cloud, holding
/// every listed machine at once was the controller's largest allocation (about 150 MB).
async fn list_picked<T>(
    ctx: &Ctx,
    r: &super::Resolved<'_>,
    selector: std::collections::HashMap<String, String>,
    spec: Option<driver_sdk::prost_types::Struct>,
    mut keep: impl FnMut(pb::Machine) -> Option<T>,
) -> Result<Vec<T>, driver_sdk::CallError> {
    let mut out = Vec::new();
    let mut page_token = String::new();
    loop {
        let req = pb::ListMachinesRequest {
            label_selector: selector.clone(),
            page_size: LIST_PAGE_SIZE,
            page_token,
            secrets: r.secrets.clone(),
            provider_spec: spec.clone(),
        };
        let page = ctx.call(r.driver, "ListMachines", |c| async move { c.list_machines(req).await }).await?.value;
        out.extend(page.machines.into_iter().filter_map(&mut keep));
        if page.next_page_token.is_empty() {
            return Ok(out);
        }
        page_token = page.next_page_token;
    }
}

/// Machines asked for per ListMachines page.
const LIST_PAGE_SIZE: i32 = 500;

/// One pass over every class.
///
/// # Errors
/// Store failures.
pub async fn collect(ctx: &Ctx) -> Result<usize, crate::runtime::ReconcileError> {
    let classes = ctx.store.list::<MachineClass>().await?;
    let known: HashSet<String> =
        ctx.store.keys(Kind::Machine).await?.into_iter().map(|k| format!("{}.{}", k.namespace, k.name)).collect();
    let mut deleted = 0;
    let mut seen_drivers = HashSet::new();
    for class in classes {
        // One listing per driver, credentials and provider spec (which may name the region,
        // subscription or resource group the driver lists in) is enough.
        let spec_hash = driver_sdk::convert::spec_hash(&class.spec.provider_spec);
        if !seen_drivers.insert((class.spec.driver.clone(), class.spec.secret_ref.clone().map(|s| s.name), spec_hash)) {
            continue;
        }
        let Ok(r) = resolve(ctx, &class.metadata.namespace, &class.metadata.name, None).await? else { continue };
        let selector = [(TAG_CONTROLLER.to_string(), ctx.app.settings.controller_id.clone())].into();
        let spec = Some(driver_sdk::convert::json_to_struct(&r.provider_spec));
        // Cloud machines of this controller's that name a Machine the store does not have.
        let unknown =
            |cm: pb::Machine| cm.labels.get(TAG_MACHINE).is_some_and(|owner| !known.contains(owner)).then_some(cm);
        let cloud = match list_picked(ctx, &r, selector, spec, unknown).await {
            Ok(list) => list,
            // No ListMachines (a pools-only driver): nothing to collect.
            Err(e)
                if policy::decide(&e.report, Source::Call(Rpc::Read))
                    == Decision::Permanent(Permanent::Unsupported) =>
            {
                continue
            }
            Err(e) => {
                tracing::info!("listing machines of driver {}: {e}", r.driver.name());
                continue;
            }
        };
        let now = Instant::now();
        let mut still: HashSet<(String, String)> = HashSet::new();
        for cm in cloud {
            let k = (r.driver.name().to_string(), cm.name.clone());
            still.insert(k.clone());
            let first = *lock(&ctx.app.orphans).entry(k.clone()).or_insert(now);
            if now.duration_since(first) < ctx.app.settings.orphan_grace {
                continue;
            }
            let req = pb::DeleteMachineRequest {
                name: cm.name.clone(),
                provider_id: cm.provider_id.clone(),
                provider_spec: None,
                secrets: r.secrets.clone(),
            };
            match ctx.call(r.driver, "DeleteMachine", |c| async move { c.delete_machine(req).await }).await {
                Ok(reply) => {
                    deleted += 1;
                    ctx.app.metrics.orphans_deleted.inc();
                    lock(&ctx.app.orphans).remove(&k);
                    ctx.store
                        .event(
                            Kind::MachineClass,
                            &class.metadata,
                            EventReason::OrphanDeleted,
                            format!(
                                "deleted cloud machine {} ({}) that has no Machine (request {})",
                                cm.name, cm.provider_id, reply.request_id
                            ),
                        )
                        .await;
                }
                Err(e) => tracing::info!("deleting orphan {}: {e}", cm.name),
            }
        }
        // Forget candidates that disappeared or got a Machine meanwhile.
        ctx.app
            .orphans
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|k, _| k.0 != r.driver.name() || still.contains(k));
    }
    Ok(deleted)
}
