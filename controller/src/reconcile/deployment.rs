//! MachineDeployment: keeps `replicas` machines of the target template revision. The decisions
//! are [`plan::deployment`](crate::plan::deployment)'s (rolling updates, remediation, failure
//! budget and rollback, deletion order; every disruption asked of
//! [`plan::disruption`](crate::plan::disruption)) and
//! [`steps::in_place`](crate::plan::steps::in_place)'s; this reconciler observes, plans, acts and
//! writes status once. A plan that marks machines for remediation acts on nothing else: the marks
//! are written, and only when every one of them is stored does the status follow.

use std::collections::HashMap;

use chrono::Utc;
use driver_sdk::proto as pb;

use super::timing::DEPLOYMENT_PROGRESS_RECHECK;
use super::write::{self, Finalizer};
use super::{resolve, slow_start};
use crate::app::Ctx;
use crate::events::EventReason;
use crate::plan::deployment::{self, InPlaceWork, Observed};
use crate::plan::domains;
use crate::plan::member::{Member, StoredMember};
use crate::plan::steps::in_place::{self, Verdict};
use crate::policy::{self, Decision, Permanent, Rpc, Source};
use crate::resources::*;
use crate::runtime::{Action, ReconcileError};
use crate::store::{Error as StoreError, Key};

type Result<T> = std::result::Result<T, ReconcileError>;

/// Reconciles one MachineDeployment.
///
/// # Errors
/// Store failures.
pub async fn reconcile(ctx: &Ctx, key: &Key) -> Result<Action> {
    let Some(md) = ctx.store.get::<MachineDeployment>(&key.namespace, &key.name).await? else {
        return Ok(Action::await_change());
    };
    let md = match write::finalizer(ctx, md).await? {
        Finalizer::Apply(md) => md,
        Finalizer::Cleanup(md) => return teardown(ctx, md).await,
        Finalizer::Done(action) => return Ok(action),
    };
    if let Some(action) =
        super::open_target(ctx, &md, md.spec.target_cluster.as_ref(), |s| &mut s.conditions, true).await?
    {
        return Ok(action);
    }
    let machines = observe(ctx, &md).await?;
    let mut labels = md.spec.template.metadata.labels.clone();
    labels.insert(LABEL_DEPLOYMENT.into(), md.metadata.name.clone());
    labels.insert(LABEL_REVISION.into(), deployment::revision(&md.spec.template));
    let halted = super::health::halted(ctx, &key.namespace, &labels).await?;

    let now = Utc::now();
    let plan = deployment::plan_deployment(Observed {
        deployment: &md,
        machines: &machines,
        remediation_halted: halted.as_deref(),
        pace: (ctx.config.backoff_base, ctx.config.backoff_max),
        now,
    });
    if !plan.notes.is_empty() {
        let notes: Vec<String> = plan.notes.iter().map(ToString::to_string).collect();
        tracing::debug!("plan.notes" = %notes.join("; "), "planned deployment");
    }
    let by_name: HashMap<&str, &Member> = machines.iter().map(|m| (m.name.as_str(), m)).collect();
    // What the cloud takes goes first, whatever else the plan does: its drain has a deadline.
    let interrupted: Vec<Key> = plan.interrupted.iter().map(|n| Key::new(Kind::Machine, &key.namespace, n)).collect();
    slow_start(interrupted, |key| async move { ctx.store.delete(&key).await.map(drop) }).await?;
    // The marks first, and alone: what depends on them runs from the next plan on, on what is
    // stored. A mark lost to a concurrent change leaves nothing of this plan done.
    let mut marked = true;
    for (name, why) in &plan.mark {
        let m = match by_name.get(name.as_str()) {
            Some(m) => machine_if_unchanged(ctx, &md, m).await?,
            None => None,
        };
        marked &= super::remediation::mark(ctx, m, *why).await?;
    }
    if !marked {
        tracing::debug!("a remediation mark did not land; planning again");
        return Ok(Action::requeue_now());
    }
    for e in &plan.events {
        ctx.store.event(Kind::MachineDeployment, &md.metadata, e.reason, e.message.clone()).await;
    }
    let mut next = md.clone();
    next.status = plan.status.clone();
    super::remediation::blocked_event(
        ctx,
        Kind::MachineDeployment,
        &md.metadata,
        &md.status.conditions,
        &next.status.conditions,
    )
    .await;
    if plan.aborted || !plan.mark.is_empty() {
        write::status(ctx, &md, &next).await?;
        return Ok(Action::requeue_now());
    }
    for name in &plan.remediate {
        super::remediation::remove(ctx, &Key::new(Kind::Machine, &key.namespace, name)).await?;
    }
    if let Some(template) = &plan.target {
        let placed =
            |i: usize| plan.placements.get(i).and_then(|n| md.spec.failure_domains.iter().find(|d| d.name == *n));
        // (`status.rebalance` names a move's machine from the next plan on, which its creation wakes.)
        slow_start(0..plan.create, |i| {
            let annotations = [
                (ANNOTATION_REBALANCE, plan.rebalance.as_deref()),
                (ANNOTATION_REPLACES_INTERRUPTION, plan.replaces.get(i).map(String::as_str)),
            ];
            create(ctx, &md, template, &plan.target_revision, placed(i), annotations)
        })
        .await?;
        if let Some(work) = &plan.in_place {
            in_place(ctx, &md, template, &plan.target_revision, work, &by_name, &mut next.status).await?;
        }
    }
    node_metadata(ctx, &md, &machines).await?;
    let doomed: Vec<Key> = plan
        .delete
        .iter()
        .filter(|n| by_name.contains_key(n.as_str()))
        .map(|n| Key::new(Kind::Machine, &key.namespace, n))
        .collect();
    slow_start(doomed, |key| async move { ctx.store.delete(&key).await.map(drop) }).await?;
    write::status(ctx, &md, &next).await?;
    // Come back when a budget's window opens or closes, or the next remediation may go.
    let due = plan.recheck_at.map(|t| (t - now).to_std().unwrap_or_default().max(super::MIN_REQUEUE));
    Ok(match (plan.settled, due) {
        (true, None) => Action::await_change(),
        (true, Some(due)) => Action::requeue(due),
        (false, due) => {
            Action::requeue(due.map_or(DEPLOYMENT_PROGRESS_RECHECK, |d| d.min(DEPLOYMENT_PROGRESS_RECHECK)))
        }
    })
}

/// The deployment's machines as the planner reads them.
async fn observe(ctx: &Ctx, md: &MachineDeployment) -> Result<Vec<Member>> {
    let owner = &md.metadata;
    ctx.store
        .list_owned_as(Kind::Machine, owner, |json| {
            let v: StoredMember<'_> = serde_json::from_str(json)?;
            v.owned_by(owner).then(|| v.into_member()).transpose()
        })
        .await
        .map_err(Into::into)
}

/// Reads the Machine behind a [`Member`] again, in full: `None` when it is gone or has changed
/// since it was listed (another resourceVersion), so a write based on it would conflict.
async fn machine_if_unchanged(ctx: &Ctx, md: &MachineDeployment, member: &Member) -> Result<Option<Machine>> {
    let m = ctx.store.get::<Machine>(&md.metadata.namespace, &member.name).await?;
    Ok(m.filter(|m| m.metadata.resource_version == member.resource_version))
}

/// Attempts at a free name for a new machine.
const NAME_ATTEMPTS: usize = 5;

/// Creates one machine of the template under a generated name (`{deployment}-{rev}-{5 hex}`,
/// like Kubernetes' `generateName`): a name that is taken (about 50 collisions among 10,000
/// machines) is generated again rather than counted as created, so the deployment is not left
/// short until its next reconcile.
/// With failure domains, the machine goes to `domain`; a rebalance's carries
/// [`ANNOTATION_REBALANCE`].
async fn create(
    ctx: &Ctx,
    md: &MachineDeployment,
    t: &MachineTemplate,
    rev: &str,
    domain: Option<&FailureDomain>,
    annotations: [(&str, Option<&str>); 2],
) -> Result<()> {
    let mut last = None;
    for _ in 0..NAME_ATTEMPTS {
        let suffix: String = uuid::Uuid::new_v4().simple().to_string()[..5].to_string();
        let name = format!("{}-{}-{suffix}", md.metadata.name, &rev[..rev.len().min(5)]);
        let mut m = new_machine(md, t, rev, &name);
        if let Some(fd) = domain {
            m.spec.provider_spec = domains::provider_spec(t.spec.provider_spec.as_ref(), Some(fd));
            m.spec.failure_domain = Some(fd.name.clone());
        }
        for (key, value) in annotations {
            if let Some(value) = value {
                m.metadata.annotations.insert(key.into(), value.into());
            }
        }
        match ctx.store.create(&m).await {
            Ok(_) => return Ok(()),
            Err(StoreError::AlreadyExists(key)) => last = Some(key),
            Err(e) => return Err(e.into()),
        }
    }
    // Taken every time: the plan runs again and tries new names.
    tracing::warn!("no free machine name after {NAME_ATTEMPTS} attempts (the last: {last:?})");
    Ok(())
}

/// The failure domain a machine is in, as the deployment lists it now.
fn domain_of<'a>(md: &'a MachineDeployment, m: &Machine) -> Option<&'a FailureDomain> {
    let name = m.spec.failure_domain.as_deref()?;
    md.spec.failure_domains.iter().find(|d| d.name == name)
}

/// A machine of the template, owned by the deployment.
fn new_machine(md: &MachineDeployment, t: &MachineTemplate, rev: &str, name: &str) -> Machine {
    let mut m = Machine::new(
        &md.metadata.namespace,
        name,
        MachineSpec {
            class_ref: t.spec.class_ref.clone(),
            provider_spec: t.spec.provider_spec.clone(),
            pool_ref: None,
            creation_timeout_seconds: Some(md.spec.creation_timeout_seconds),
            health_timeout_seconds: Some(md.spec.health_timeout_seconds),
            node: None,
            node_template: None,
            failure_domain: None,
            target_cluster: md.spec.target_cluster.clone(),
        },
    );
    let (node_template, node_settings, node_hash) = node_spec(md);
    m.spec.node = Some(node_settings);
    m.spec.node_template = node_template;
    m.metadata.labels = t.metadata.labels.clone();
    m.metadata.labels.insert(LABEL_DEPLOYMENT.into(), md.metadata.name.clone());
    m.metadata.labels.insert(LABEL_REVISION.into(), rev.into());
    m.metadata.annotations = t.metadata.annotations.clone();
    m.metadata.annotations.insert(ANNOTATION_NODE_TEMPLATE.into(), node_hash);
    m.metadata.finalizers = vec![FINALIZER.into()];
    m.metadata.owner_references =
        vec![OwnerReference::controller_of(Kind::MachineDeployment, &md.metadata.name, &md.metadata.uid)];
    m
}

/// What a deployment's machines carry for their Nodes and change in place (neither is part of
/// the revision): the spec's node template and node settings, and a hash of both, recorded on
/// each machine as [`ANNOTATION_NODE_TEMPLATE`].
fn node_spec(md: &MachineDeployment) -> (Option<NodeTemplate>, NodeSettings, String) {
    let template = md.spec.template.spec.node_template.clone().filter(|t| *t != NodeTemplate::default());
    let settings = md.spec.node_settings();
    let hash = short_hash(&(&template, &settings));
    (template, settings, hash)
}

/// Carries the spec's node metadata and node settings to every live machine that has others
/// (in place: the machine's reconciler updates its Node; no driver call, no replacement). A
/// drain under way keeps the deadline it recorded when it began.
async fn node_metadata(ctx: &Ctx, md: &MachineDeployment, machines: &[Member]) -> Result<()> {
    let (template, settings, want) = node_spec(md);
    for member in machines.iter().filter(|m| !m.deleting && m.node_template != want) {
        let Some(m) = machine_if_unchanged(ctx, md, member).await? else { continue };
        let mut next = m.clone();
        next.spec.node_template = template.clone();
        next.spec.node = Some(settings);
        next.metadata.annotations.insert(ANNOTATION_NODE_TEMPLATE.into(), want.clone());
        match ctx.store.update(&next).await {
            Ok(_) | Err(StoreError::Conflict { .. }) | Err(StoreError::NotFound(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Moves old machines to the target template where the driver can, as [`in_place::Budget`]
/// decides from each machine's `CanUpdateMachine` answer.
async fn in_place(
    ctx: &Ctx,
    md: &MachineDeployment,
    template: &MachineTemplate,
    rev: &str,
    work: &InPlaceWork,
    machines: &HashMap<&str, &Member>,
    status: &mut MachineDeploymentStatus,
) -> Result<()> {
    let mut budget = in_place::Budget::new(work.allowed, md.spec.strategy.in_place.fallback_to_replace);
    for name in &work.candidates {
        if !budget.has_room() {
            break;
        }
        let Some(member) = machines.get(name.as_str()) else { continue };
        // Changed since listed: the patch would conflict; the change runs this again.
        let Some(m) = machine_if_unchanged(ctx, md, member).await? else { continue };
        let m = &m;
        match budget.step(name, can_update(ctx, m, template, domain_of(md, m)).await?) {
            in_place::Step::Patch(disruption) => {
                let mut patched = (*m).clone();
                patched.spec.class_ref = template.spec.class_ref.clone();
                // The machine stays in its failure domain.
                patched.spec.provider_spec =
                    domains::provider_spec(template.spec.provider_spec.as_ref(), domain_of(md, m));
                patched.metadata.labels.insert(LABEL_REVISION.into(), rev.into());
                // What the driver said the update does, for the Machine's reconciler (drain or
                // not) and for the planner (it counts as updating from now on).
                patched.metadata.annotations.insert(ANNOTATION_IN_PLACE_DISRUPTION.into(), disruption.to_string());
                match ctx.store.update(&patched).await {
                    Ok(_) | Err(StoreError::Conflict { .. }) | Err(StoreError::NotFound(_)) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            in_place::Step::Replace(paths) => {
                ctx.store
                    .event(
                        Kind::Machine,
                        &m.metadata,
                        EventReason::ReplacingForUpdate,
                        format!("{} cannot change in place; replacing", paths.join(", ")),
                    )
                    .await;
                ctx.store.delete(&Key::of(m)).await?;
            }
            in_place::Step::Blocked | in_place::Step::Skip => {}
        }
    }
    budget.finish(&mut status.conditions);
    Ok(())
}

/// Asks the driver whether `m` can move to `template` in place.
async fn can_update(
    ctx: &Ctx,
    m: &Machine,
    template: &MachineTemplate,
    domain: Option<&FailureDomain>,
) -> Result<Verdict> {
    let ns = &m.metadata.namespace;
    let Ok(current) = resolve(ctx, ns, &m.spec.class_ref.name, m.spec.provider_spec.as_ref()).await? else {
        return Ok(Verdict::Unknown);
    };
    let spec = domains::provider_spec(template.spec.provider_spec.as_ref(), domain);
    let Ok(desired) = resolve(ctx, ns, &template.spec.class_ref.name, spec.as_ref()).await? else {
        return Ok(Verdict::Unknown);
    };
    let replace_all = || Verdict::NeedsReplacement(vec!["(driver or class)".into()]);
    if current.class.spec.driver != desired.class.spec.driver {
        return Ok(replace_all());
    }
    let req = pb::CanUpdateMachineRequest {
        name: m.metadata.name.clone(),
        current_provider_spec: Some(driver_sdk::convert::json_to_struct(&current.provider_spec)),
        desired_provider_spec: Some(driver_sdk::convert::json_to_struct(&desired.provider_spec)),
        secrets: desired.secrets.clone(),
    };
    Ok(match ctx.call(desired.driver, "CanUpdateMachine", |c| async move { c.can_update_machine(req).await }).await {
        Ok(reply) if reply.value.replace_paths.is_empty() => {
            Verdict::Updatable(match driver_sdk::InPlaceDisruption::from_pb(reply.value.disruption) {
                driver_sdk::InPlaceDisruption::None => InPlaceDisruption::None,
                driver_sdk::InPlaceDisruption::Drain => InPlaceDisruption::Drain,
                driver_sdk::InPlaceDisruption::Reboot | driver_sdk::InPlaceDisruption::Unspecified => {
                    InPlaceDisruption::Reboot
                }
            })
        }
        Ok(reply) => Verdict::NeedsReplacement(reply.value.replace_paths),
        Err(e) => match policy::decide(&e.report, Source::Call(Rpc::Read)) {
            Decision::Permanent(Permanent::Unsupported) => replace_all(),
            _ => Verdict::Unknown,
        },
    })
}

/// A deleted deployment deletes its machines, then lets go.
async fn teardown(ctx: &Ctx, md: MachineDeployment) -> Result<Action> {
    let machines: Vec<Machine> = ctx.store.list_owned(&md.metadata).await?;
    if !machines.is_empty() {
        let doomed: Vec<Key> = machines.iter().filter(|m| !m.is_deleting()).map(Key::of).collect();
        slow_start(doomed, |key| async move { ctx.store.delete(&key).await.map(drop) }).await?;
        return Ok(Action::requeue(super::DELETION_RECHECK));
    }
    write::release(ctx, &md).await?;
    Ok(Action::await_change())
}
