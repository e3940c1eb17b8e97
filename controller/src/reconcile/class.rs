//! MachineClass: validated with its driver once per generation (ValidateMachineClass); the
//! `Valid` condition says what the driver thought.

use std::time::Duration;

use driver_sdk::proto as pb;

use super::{resolve, write};
use crate::resources::*;
use crate::runtime::policy::{self, Decision, Rpc, Source};
use crate::runtime::{Action, Ctx, ReconcileError};
use crate::store::Key;

/// Validates a class with its driver once per generation (ValidateMachineClass).
///
/// # Errors
/// Store failures; driver failures other than a refusal of the class (which is status).
pub async fn reconcile(ctx: &Ctx, key: &Key) -> Result<Action, ReconcileError> {
    let Some(before) = ctx.store.get::<MachineClass>(&key.namespace, &key.name).await? else {
        return Ok(Action::AwaitChange);
    };
    if before.status.validated_generation == before.metadata.generation {
        return Ok(Action::AwaitChange);
    }
    // A retry waits out its backoff even when the class's own status write wakes it.
    let wait = ctx.wait_before_call(key);
    if !wait.is_zero() {
        return Ok(Action::Wait(wait));
    }
    let r = match resolve(ctx, &key.namespace, &key.name, None).await? {
        Ok(r) => r,
        Err((reason, message)) => {
            let mut c = before.clone();
            set_condition(&mut c.status.conditions, ConditionType::Valid, false, reason, &message);
            write::status(ctx, &before, &c).await?;
            return Ok(Action::requeue(Duration::from_secs(30)));
        }
    };
    let caps = match ctx
        .call(r.driver, "GetCapabilities", |c| async move { c.get_capabilities(Default::default()).await })
        .await
    {
        Ok(reply) => reply.value.capabilities,
        Err(e) => return Err(ReconcileError::call(&e, Rpc::Read)),
    };
    let mut c = before.clone();
    if caps.contains(&(pb::Capability::ValidateMachineClass as i32)) {
        let req = pb::ValidateMachineClassRequest {
            provider_spec: Some(driver_sdk::convert::json_to_struct(&r.provider_spec)),
            secrets: r.secrets.clone(),
        };
        match ctx.call(r.driver, "ValidateMachineClass", |cl| async move { cl.validate_machine_class(req).await }).await
        {
            Ok(reply) => {
                let warnings = reply.value.warnings.join("; ");
                set_condition(&mut c.status.conditions, ConditionType::Valid, true, Reason::Validated, &warnings);
                ctx.store
                    .event(
                        Kind::MachineClass,
                        &c.metadata,
                        false,
                        "Validated",
                        format!("the driver accepted the class {warnings}"),
                    )
                    .await;
            }
            Err(e) => match policy::decide(&e.report, Source::Call(Rpc::Read)) {
                Decision::Permanent(_) => {
                    let fields: Vec<String> =
                        e.report.violations.iter().map(|v| format!("{}: {}", v.field, v.description)).collect();
                    let msg = if fields.is_empty() { e.report.message.clone() } else { fields.join("; ") };
                    set_condition(&mut c.status.conditions, ConditionType::Valid, false, Reason::Invalid, &msg);
                    ctx.store.event(Kind::MachineClass, &c.metadata, true, "Invalid", msg).await;
                }
                decision => {
                    if decision.cause() == Some(policy::Cause::Credentials) {
                        // Not the class's fault: retried with backoff, and at once when its Secret
                        // changes.
                        let msg = format!("{} (request {})", e.report, e.request_id());
                        let reason = Reason::CloudCredentialsRefused;
                        set_condition(&mut c.status.conditions, ConditionType::Valid, false, reason, &msg);
                    }
                    return write::status_then_fail(ctx, &before, &c, ReconcileError::call(&e, Rpc::Read)).await;
                }
            },
        }
    } else {
        set_condition(
            &mut c.status.conditions,
            ConditionType::Valid,
            true,
            Reason::NotValidated,
            "the driver does not validate classes",
        );
    }
    c.status.validated_generation = c.metadata.generation;
    write::status(ctx, &before, &c).await?;
    Ok(Action::AwaitChange)
}
