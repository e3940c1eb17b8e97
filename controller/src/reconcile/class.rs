//! MachineClass: validated with its driver once per generation (ValidateMachineClass); the
//! `Valid` condition says what the driver thought.

use driver_sdk::proto as pb;

use super::timing::CLASS_UNRESOLVED_RECHECK;
use super::{resolve, write};
use crate::app::Ctx;
use crate::events::EventReason;
use crate::policy::{self, Decision, Rpc, Source};
use crate::resources::*;
use crate::runtime::{Action, ReconcileError};
use crate::store::Key;

/// Validates a class with its driver once per generation (ValidateMachineClass).
///
/// # Errors
/// Store failures; driver failures other than a refusal of the class (which is status).
pub async fn reconcile(ctx: &Ctx, key: &Key) -> Result<Action, ReconcileError> {
    let Some(before) = ctx.store.get::<MachineClass>(&key.namespace, &key.name).await? else {
        return Ok(Action::await_change());
    };
    if before.status.validated_generation == before.metadata.generation {
        return Ok(Action::await_change());
    }
    // A retry waits out its backoff even when the class's own status write wakes it.
    let wait = ctx.wait_before_call(key);
    if !wait.is_zero() {
        return Ok(Action::wait(wait));
    }
    let r = match resolve(ctx, &key.namespace, &key.name, None).await? {
        Ok(r) => r,
        Err(why) => {
            return why
                .record_and_recheck(ctx, &before, |s| &mut s.conditions, ConditionType::Valid, CLASS_UNRESOLVED_RECHECK)
                .await;
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
    let secrets = match super::boot::sample(ctx, &r) {
        Ok(secrets) => secrets,
        // Only a Secret's `userData` gets here unparsed (`apply` and the CRD check the spec's).
        Err(why) => {
            let msg = format!("the boot data template does not parse: {why}");
            set_condition(&mut c.status.conditions, ConditionType::Valid, false, Reason::Invalid, &msg);
            if condition(&before.status.conditions, ConditionType::Valid).is_none_or(|v| v.message != msg) {
                ctx.store.event(Kind::MachineClass, &c.metadata, EventReason::Invalid, msg).await;
            }
            write::status(ctx, &before, &c).await?;
            return Ok(Action::await_change());
        }
    };
    if caps.contains(&(pb::Capability::ValidateMachineClass as i32)) {
        let req = pb::ValidateMachineClassRequest {
            provider_spec: Some(driver_sdk::convert::json_to_struct(&r.provider_spec)),
            secrets,
        };
        let reply =
            ctx.call(r.driver, "ValidateMachineClass", |cl| async move { cl.validate_machine_class(req).await }).await;
        let answer = match &reply {
            Ok(reply) => Ok(reply.value.warnings.as_slice()),
            Err(e) => Err((&e.report, e.request_id())),
        };
        match validation(answer) {
            Validation::Accepted(warnings) => {
                set_condition(&mut c.status.conditions, ConditionType::Valid, true, Reason::Validated, &warnings);
                if let Ok(reply) = &reply {
                    c.status.capacity = reply.value.capacity.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
                }
                let msg = format!("the driver accepted the class {warnings}");
                ctx.store.event(Kind::MachineClass, &c.metadata, EventReason::Validated, msg).await;
            }
            Validation::Refused(msg) => {
                set_condition(&mut c.status.conditions, ConditionType::Valid, false, Reason::Invalid, &msg);
                ctx.store.event(Kind::MachineClass, &c.metadata, EventReason::Invalid, msg).await;
            }
            Validation::Retry(credentials) => {
                if let Some(msg) = credentials {
                    let reason = Reason::CloudCredentialsRefused;
                    set_condition(&mut c.status.conditions, ConditionType::Valid, false, reason, &msg);
                }
                let Err(e) = &reply else { return Ok(Action::requeue_now()) };
                return write::status_then_fail(ctx, &before, &c, ReconcileError::call(e, Rpc::Read)).await;
            }
        }
    } else {
        c.status.capacity.clear();
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
    Ok(Action::await_change())
}

/// What a driver's answer to ValidateMachineClass makes of a class.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Validation {
    /// `Valid=True`, with the driver's warnings; this generation is done.
    Accepted(String),
    /// `Valid=False`, `Invalid`: the spec is wrong (each field and why, or the message); this
    /// generation is done until the class changes.
    Refused(String),
    /// Not the class's fault (the driver or cloud is unavailable, the credentials were refused):
    /// retried by the error policy. With credentials refused, `Valid=False`
    /// `CloudCredentialsRefused` says so (with the request ID), and a fixed Secret retries at once.
    Retry(Option<String>),
}

/// Decides [`Validation`] from the driver's warnings or its error (and the call's request ID).
fn validation(answer: Result<&[String], (&driver_sdk::ErrorReport, &str)>) -> Validation {
    let (report, request_id) = match answer {
        Ok(warnings) => return Validation::Accepted(warnings.join("; ")),
        Err(e) => e,
    };
    match policy::decide(report, Source::Call(Rpc::Read)) {
        Decision::Permanent(_) => {
            let fields: Vec<String> =
                report.violations.iter().map(|v| format!("{}: {}", v.field, v.description)).collect();
            Validation::Refused(if fields.is_empty() { report.message.clone() } else { fields.join("; ") })
        }
        decision if decision.cause() == Some(policy::Cause::Credentials) => {
            Validation::Retry(Some(format!("{report} (request {request_id})")))
        }
        _ => Validation::Retry(None),
    }
}

#[cfg(test)]
mod tests {
    use driver_sdk::{reason, ErrorReport, Violation};
    use tonic::Code;

    use super::*;

    fn report(code: Code, reason: &str, violations: &[(&str, &str)]) -> ErrorReport {
        ErrorReport {
            code,
            message: "the driver said no".into(),
            reason: reason.into(),
            domain: "fake".into(),
            metadata: Default::default(),
            retry_after: None,
            request_id: "req-1".into(),
            cloud_request_ids: Vec::new(),
            violations: violations
                .iter()
                .map(|(f, d)| Violation { field: (*f).into(), description: (*d).into() })
                .collect(),
            causes: Vec::new(),
        }
    }

    #[test]
    fn warnings_are_kept_on_an_accepted_class() {
        let warnings = ["zone is not set".to_string(), "image is old".to_string()];
        assert_eq!(validation(Ok(&warnings)), Validation::Accepted("zone is not set; image is old".into()));
        assert_eq!(validation(Ok(&[])), Validation::Accepted(String::new()));
    }

    #[test]
    fn a_refused_spec_names_each_field_or_else_gives_the_message() {
        let bad = report(
            Code::InvalidArgument,
            reason::INVALID_PROVIDER_SPEC,
            &[("provider_spec.machineType", "unknown type"), ("provider_spec.zone", "no such zone")],
        );
        assert_eq!(
            validation(Err((&bad, "req-1"))),
            Validation::Refused("provider_spec.machineType: unknown type; provider_spec.zone: no such zone".into())
        );
        let bare = report(Code::InvalidArgument, reason::INVALID_PROVIDER_SPEC, &[]);
        assert_eq!(validation(Err((&bare, "req-1"))), Validation::Refused("the driver said no".into()));
    }

    #[test]
    fn refused_credentials_and_an_unavailable_driver_are_retried_not_blamed_on_the_class() {
        let denied = report(Code::PermissionDenied, reason::CLOUD_AUTH_FAILED, &[]);
        match validation(Err((&denied, "req-9"))) {
            Validation::Retry(Some(msg)) => {
                assert!(msg.contains("req-9") && msg.contains("the driver said no"), "{msg}")
            }
            other => panic!("credentials: {other:?}"),
        }
        let down = report(Code::Unavailable, reason::CLOUD_UNAVAILABLE, &[]);
        assert_eq!(validation(Err((&down, "req-2"))), Validation::Retry(None));
    }
}
