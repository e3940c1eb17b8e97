//! The checks, grouped by capability.

use std::collections::HashSet;
use std::time::Duration;

use futures::StreamExt;
use machine_driver_proto::v1 as pb;
use tonic::Code;

use super::{
    check, ensure, expect_error, schema_examples, spec_of, without_required, CheckResult, NotPassed, Suite, Verdict,
};
use crate::client::OperationExt;
use crate::convert::{json_to_struct, struct_to_json};
use crate::error::{reason, ErrorReport};
use crate::layer::REQUEST_ID_HEADER;

type On<'a> = &'a mut dyn FnMut(&CheckResult);

/// How long a driver may take to become ready (Probe) before the suite gives up on it.
const READY_WITHIN: Duration = Duration::from_secs(30);
/// How often Probe is called while the driver is not ready.
const PROBE_RETRY: Duration = Duration::from_millis(200);
/// The `timeout` of the WaitOperation check: the finished operation must come back at once, long
/// before it.
const WAIT_TIMEOUT: Duration = Duration::from_secs(5);
/// The call deadline of the WaitOperation check: beyond [`WAIT_TIMEOUT`], so the wait, not the
/// deadline, bounds the call.
const WAIT_CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The service of the EVENTS capability.
const EVENTS_SERVICE: &str = "machinedriver.v1.Events";
/// The keepalive interval the event checks ask for, and how long they wait for one.
const EVENT_KEEPALIVE: Duration = Duration::from_secs(1);
const KEEPALIVE_WITHIN: Duration = Duration::from_secs(10);

fn skip(why: &str) -> Verdict {
    Err(NotPassed::Skip(why.to_string()))
}

pub(super) async fn identity(s: &mut Suite, on: &mut impl FnMut(&CheckResult)) {
    let on: On<'_> = on;
    check!(s, on, "identity.driver_info", |s| {
        let info = s.client.get_driver_info(pb::GetDriverInfoRequest {}).await?.value;
        ensure!(!info.name.is_empty() && info.name.len() <= 63, "name {:?} must be 1..=63 characters", info.name);
        ensure!(
            info.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.'),
            "name {:?} must be DNS-style",
            info.name
        );
        ensure!(!info.vendor_version.is_empty(), "vendor_version is empty");
        ensure!(
            info.protocol_version == crate::PROTOCOL_VERSION,
            "protocol_version is {:?}, want v1",
            info.protocol_version
        );
        let schema = info.provider_spec_schema.as_ref().map(struct_to_json).unwrap_or_default();
        ensure!(schema.is_object(), "provider_spec_schema is missing");
        let examples = schema_examples(&schema);
        s.spec = s.config.provider_spec.clone().or_else(|| examples.first().cloned());
        s.alt_spec = s.config.alt_provider_spec.clone().or_else(|| examples.get(1).cloned());
        s.schema = schema;
        Ok(())
    });
    check!(s, on, "identity.capabilities", |s| {
        let caps = s.client.get_capabilities(pb::GetCapabilitiesRequest {}).await?.value.capabilities;
        ensure!(!caps.contains(&(pb::Capability::Unspecified as i32)), "CAPABILITY_UNSPECIFIED advertised");
        s.caps = caps.into_iter().collect();
        Ok(())
    });
    check!(s, on, "identity.probe_ready", |s| {
        let deadline = tokio::time::Instant::now() + READY_WITHIN;
        loop {
            let p = s.client.probe(pb::ProbeRequest {}).await?.value;
            if p.ready {
                return Ok(());
            }
            ensure!(
                tokio::time::Instant::now() < deadline,
                "Probe still not ready after {} s: {}",
                READY_WITHIN.as_secs(),
                p.message
            );
            tokio::time::sleep(PROBE_RETRY).await;
        }
    });
    check!(s, on, "health.serving", |s| {
        let mut health = tonic_health::pb::health_client::HealthClient::new(s.client.channel());
        for service in ["", "machinedriver.v1.Machines"] {
            let resp = health
                .check(tonic_health::pb::HealthCheckRequest { service: service.into() })
                .await
                .map_err(|e| format!("Health/Check({service:?}): {e}"))?
                .into_inner();
            ensure!(
                resp.status == tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
                "health of {service:?} is {}, want SERVING once Probe is ready",
                resp.status
            );
        }
        Ok(())
    });
}

pub(super) async fn transport(s: &mut Suite, on: &mut impl FnMut(&CheckResult)) {
    let on: On<'_> = on;
    check!(s, on, "reflection.lists_services", |s| {
        use tonic_reflection::pb::v1alpha::{
            server_reflection_client::ServerReflectionClient, server_reflection_request::MessageRequest,
            server_reflection_response::MessageResponse, ServerReflectionRequest,
        };
        let mut client = ServerReflectionClient::new(s.client.channel());
        let req = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut stream = client
            .server_reflection_info(futures::stream::iter([req]))
            .await
            .map_err(|e| format!("reflection v1alpha: {e}"))?
            .into_inner();
        let resp =
            stream.next().await.ok_or("reflection stream ended without an answer")?.map_err(|e| e.to_string())?;
        let Some(MessageResponse::ListServicesResponse(list)) = resp.message_response else {
            return Err(NotPassed::Fail("reflection did not answer ListServices".into()));
        };
        let names: HashSet<String> = list.service.into_iter().map(|s| s.name).collect();
        for want in machine_driver_proto::SERVICE_NAMES.iter().chain(&["grpc.health.v1.Health"]) {
            // A driver of an older protocol revision, or one without events, serves no Events.
            if *want == EVENTS_SERVICE && !s.has(pb::Capability::Events) {
                continue;
            }
            ensure!(names.contains(*want), "reflection does not list {want} (got {names:?})");
        }
        Ok(())
    });
    check!(s, on, "request_id.echoed", |s| {
        let mut raw = pb::identity_client::IdentityClient::new(s.client.channel());
        let sent = format!("conformance-{}", uuid::Uuid::new_v4());
        let mut req = tonic::Request::new(pb::GetDriverInfoRequest {});
        req.metadata_mut().insert(REQUEST_ID_HEADER, sent.parse().map_err(|_| "bad header".to_string())?);
        let resp = raw.get_driver_info(req).await.map_err(|e| e.to_string())?;
        let got = resp.metadata().get(REQUEST_ID_HEADER).and_then(|v| v.to_str().ok()).unwrap_or_default();
        ensure!(got == sent, "sent x-request-id {sent}, got back {got:?}");
        Ok(())
    });
    check!(s, on, "request_id.generated_when_absent", |s| {
        let mut raw = pb::identity_client::IdentityClient::new(s.client.channel());
        let resp = raw.get_driver_info(pb::GetDriverInfoRequest {}).await.map_err(|e| e.to_string())?;
        let got = resp.metadata().get(REQUEST_ID_HEADER).and_then(|v| v.to_str().ok()).unwrap_or_default();
        ensure!(!got.is_empty(), "no x-request-id in the response metadata");
        Ok(())
    });
    check!(s, on, "errors.request_info_and_bad_request", |s| {
        let mut raw = pb::operations_client::OperationsClient::new(s.client.channel());
        let sent = format!("conformance-{}", uuid::Uuid::new_v4());
        let mut req = tonic::Request::new(pb::GetOperationRequest { token: Vec::new(), secrets: None });
        req.metadata_mut().insert(REQUEST_ID_HEADER, sent.parse().map_err(|_| "bad header".to_string())?);
        let status = match raw.get_operation(req).await {
            Ok(_) => return Err(NotPassed::Fail("GetOperation without a token succeeded".into())),
            Err(status) => status,
        };
        let report = ErrorReport::from_status(&status);
        ensure!(report.code == Code::InvalidArgument, "want INVALID_ARGUMENT, got {report}");
        ensure!(report.reason == reason::FIELD_REQUIRED, "want reason FIELD_REQUIRED, got {report}");
        ensure!(report.request_id == sent, "RequestInfo.request_id is {:?}, want {sent}", report.request_id);
        ensure!(
            report.violations.iter().any(|v| v.field == "token"),
            "no BadRequest violation for `token`: {report:?}"
        );
        Ok(())
    });
    check!(s, on, "operations.tampered_token_refused", |s| {
        // A forged token: structurally plausible (version 1, JSON, 32-byte tag) but not sealed
        // by this driver.
        let mut forged = vec![1u8];
        forged.extend_from_slice(br#"{"d":"forged","n":"op","k":"CreateMachine","t":"m","st":null}"#);
        forged.extend_from_slice(&[0u8; 32]);
        for token in [forged, b"not a token at all".to_vec(), vec![9u8; 64]] {
            let r = s.client.get_operation(pb::GetOperationRequest { token, secrets: s.secrets() }).await;
            expect_error(r, Code::InvalidArgument, Some(reason::OPERATION_TOKEN_INVALID))?;
        }
        Ok(())
    });
}

pub(super) async fn machines(s: &mut Suite, on: &mut impl FnMut(&CheckResult)) {
    let on: On<'_> = on;
    if !s.has(pb::Capability::Machines) {
        check!(s, on, "machines", |_s| { skip("CAPABILITY_MACHINES not advertised") });
        return;
    }
    check!(s, on, "machines.create_missing_fields", |s| {
        let r = s.client.create_machine(pb::CreateMachineRequest::default()).await;
        let e = expect_error(r, Code::InvalidArgument, Some(reason::FIELD_REQUIRED))?;
        let fields: HashSet<&str> = e.report.violations.iter().map(|v| v.field.as_str()).collect();
        ensure!(
            fields.contains("name") && fields.contains("provider_spec"),
            "violations should name `name` and `provider_spec`: {fields:?}"
        );
        Ok(())
    });
    check!(s, on, "machines.create_invalid_name", |s| {
        let req = s.create_request("Not_A_Valid_Name", s.spec_struct()?);
        let e = expect_error(s.client.create_machine(req).await, Code::InvalidArgument, Some(reason::FIELD_INVALID))?;
        ensure!(
            e.report.violations.iter().any(|v| v.field == "name"),
            "no violation for `name`: {:?}",
            e.report.violations
        );
        Ok(())
    });
    check!(s, on, "machines.create_invalid_provider_spec", |s| {
        let spec = s.spec.clone().ok_or_else(|| NotPassed::Skip("no valid provider spec".into()))?;
        let Some((field, bad)) = without_required(&s.schema, &spec) else {
            return skip("the schema requires no field, so no invalid spec can be derived");
        };
        let req = s.create_request(&s.name("invalid"), json_to_struct(&bad));
        let e = expect_error(
            s.client.create_machine(req).await,
            Code::InvalidArgument,
            Some(reason::INVALID_PROVIDER_SPEC),
        )?;
        ensure!(
            e.report.violations.iter().any(|v| v.field.ends_with(&field)),
            "no violation naming {field}: {:?}",
            e.report.violations
        );
        Ok(())
    });
    check!(s, on, "machines.create_idempotent", |s| {
        let name = s.name("m0");
        let spec = s.spec_struct()?;
        let mut first: Option<pb::Operation> = None;
        for i in 0..s.config.repeat.max(2) {
            let op = s.client.create_machine(s.create_request(&name, spec.clone())).await?.value;
            ensure!(op.target == name, "operation target {:?}, want {name}", op.target);
            ensure!(
                op.kind == pb::OperationKind::CreateMachine as i32,
                "operation kind {}, want CREATE_MACHINE",
                op.kind
            );
            if let Some(err) = op.error_report() {
                return Err(NotPassed::Fail(format!("create #{i} failed: {err}")));
            }
            first.get_or_insert(op);
        }
        let op = s.wait_ok(first.ok_or("no operation")?).await?;
        let m = op.machine().ok_or("done create operation carries no machine")?;
        ensure!(m.name == name, "machine name {:?}, want {name}", m.name);
        ensure!(!m.provider_id.is_empty(), "machine has no provider_id");
        // After completion, a repeated create returns the existing machine.
        for _ in 0..s.config.repeat {
            let again = s.client.create_machine(s.create_request(&name, spec.clone())).await?.value;
            let again = s.wait_ok(again).await?;
            let m2 = again.machine().ok_or("repeated create carries no machine")?;
            ensure!(
                m2.provider_id == m.provider_id,
                "repeated create returned another machine: {} vs {}",
                m2.provider_id,
                m.provider_id
            );
        }
        Ok(())
    });
    check!(s, on, "machines.get_status", |s| {
        let name = s.name("m0");
        let m = s
            .client
            .get_machine_status(pb::GetMachineStatusRequest {
                name: name.clone(),
                secrets: s.secrets(),
                ..Default::default()
            })
            .await?
            .value;
        ensure!(m.name == name, "name {:?}, want {name}", m.name);
        ensure!(!m.provider_id.is_empty(), "no provider_id");
        ensure!(m.state != pb::MachineState::Unspecified as i32, "state is UNSPECIFIED");
        Ok(())
    });
    check!(s, on, "machines.create_conflicting_spec", |s| {
        let req = s.create_request(&s.name("m0"), s.alt_spec_struct()?);
        expect_error(s.client.create_machine(req).await, Code::AlreadyExists, Some(reason::MACHINE_SPEC_CONFLICT))?;
        Ok(())
    });
    check!(s, on, "machines.get_missing", |s| {
        let r = s
            .client
            .get_machine_status(pb::GetMachineStatusRequest {
                name: s.name("never-created"),
                secrets: s.secrets(),
                ..Default::default()
            })
            .await;
        expect_error(r, Code::NotFound, Some(reason::MACHINE_NOT_FOUND))?;
        Ok(())
    });
    check!(s, on, "machines.list_paginated_and_filtered", |s| {
        let spec = s.spec_struct()?;
        let mut ops = Vec::new();
        for n in ["m1", "m2"] {
            ops.push(s.client.create_machine(s.create_request(&s.name(n), spec.clone())).await?.value);
        }
        for op in ops {
            s.wait_ok(op).await?;
        }
        let mut seen = Vec::new();
        let mut token = String::new();
        for _ in 0..10 {
            let page = s
                .client
                .list_machines(pb::ListMachinesRequest {
                    label_selector: s.labels(),
                    page_size: 1,
                    page_token: token,
                    secrets: s.secrets(),
                    ..Default::default()
                })
                .await?
                .value;
            ensure!(page.machines.len() <= 1, "page_size 1 returned {} machines", page.machines.len());
            seen.extend(page.machines.into_iter().map(|m| m.name));
            token = page.next_page_token;
            if token.is_empty() {
                break;
            }
        }
        seen.sort();
        let want: Vec<String> = ["m0", "m1", "m2"].iter().map(|n| s.name(n)).collect();
        ensure!(seen == want, "paged listing returned {seen:?}, want {want:?}");
        let other = s
            .client
            .list_machines(pb::ListMachinesRequest {
                label_selector: [(super::RUN_LABEL.to_string(), "no-such-run".to_string())].into(),
                secrets: s.secrets(),
                ..Default::default()
            })
            .await?
            .value;
        ensure!(
            other.machines.is_empty(),
            "label filter ignored: {} machines for an unknown run",
            other.machines.len()
        );
        let bad = s
            .client
            .list_machines(pb::ListMachinesRequest {
                page_token: "%%garbage%%".into(),
                secrets: s.secrets(),
                ..Default::default()
            })
            .await;
        expect_error(bad, Code::InvalidArgument, None)?;
        Ok(())
    });
    check!(s, on, "operations.wait_operation", |s| {
        let op = s.client.create_machine(s.create_request(&s.name("m0"), s.spec_struct()?)).await?.value;
        let waiter = s.client.clone().with_call_timeout(WAIT_CALL_TIMEOUT);
        let waited = waiter
            .wait_operation(pb::WaitOperationRequest {
                token: op.token.clone(),
                timeout: Some(crate::convert::duration(WAIT_TIMEOUT)),
                secrets: s.secrets(),
            })
            .await?
            .value;
        ensure!(waited.done, "WaitOperation on a finished create returned a running operation");
        Ok(())
    });
    check!(s, on, "operations.tampered_real_token_refused", |s| {
        let op = s.client.create_machine(s.create_request(&s.name("m0"), s.spec_struct()?)).await?.value;
        ensure!(!op.token.is_empty(), "operation has no token");
        for i in [0, op.token.len() / 2, op.token.len() - 1] {
            let mut bad = op.token.clone();
            bad[i] ^= 0x01;
            let r = s.client.get_operation(pb::GetOperationRequest { token: bad, secrets: s.secrets() }).await;
            expect_error(r, Code::InvalidArgument, Some(reason::OPERATION_TOKEN_INVALID))?;
        }
        Ok(())
    });
    if s.has(pb::Capability::ValidateMachineClass) {
        check!(s, on, "machines.validate_machine_class", |s| {
            let ok = pb::ValidateMachineClassRequest { provider_spec: Some(s.spec_struct()?), secrets: s.secrets() };
            s.client.validate_machine_class(ok).await?;
            let missing = pb::ValidateMachineClassRequest { provider_spec: None, secrets: s.secrets() };
            expect_error(
                s.client.validate_machine_class(missing).await,
                Code::InvalidArgument,
                Some(reason::FIELD_REQUIRED),
            )?;
            if let Some((_, bad)) = s.spec.as_ref().and_then(|spec| without_required(&s.schema, spec)) {
                let bad =
                    pb::ValidateMachineClassRequest { provider_spec: Some(json_to_struct(&bad)), secrets: s.secrets() };
                expect_error(
                    s.client.validate_machine_class(bad).await,
                    Code::InvalidArgument,
                    Some(reason::INVALID_PROVIDER_SPEC),
                )?;
            }
            Ok(())
        });
    }
    check!(s, on, "machines.delete_idempotent", |s| {
        let name = s.name("m1");
        let mut first = None;
        for _ in 0..s.config.repeat.max(2) {
            let op = s
                .client
                .delete_machine(pb::DeleteMachineRequest {
                    name: name.clone(),
                    secrets: s.secrets(),
                    ..Default::default()
                })
                .await?
                .value;
            ensure!(
                op.kind == pb::OperationKind::DeleteMachine as i32,
                "operation kind {}, want DELETE_MACHINE",
                op.kind
            );
            first.get_or_insert(op);
        }
        s.wait_ok(first.ok_or("no operation")?).await?;
        let gone = s
            .client
            .get_machine_status(pb::GetMachineStatusRequest {
                name: name.clone(),
                secrets: s.secrets(),
                ..Default::default()
            })
            .await;
        expect_error(gone, Code::NotFound, Some(reason::MACHINE_NOT_FOUND))?;
        let again = s
            .client
            .delete_machine(pb::DeleteMachineRequest { name, secrets: s.secrets(), ..Default::default() })
            .await?
            .value;
        s.wait_ok(again).await?;
        Ok(())
    });
    check!(s, on, "machines.delete_missing_is_ok", |s| {
        let op = s
            .client
            .delete_machine(pb::DeleteMachineRequest {
                name: s.name("never-created"),
                secrets: s.secrets(),
                ..Default::default()
            })
            .await?
            .value;
        s.wait_ok(op).await?;
        Ok(())
    });
}

pub(super) async fn in_place(s: &mut Suite, on: &mut impl FnMut(&CheckResult)) {
    let on: On<'_> = on;
    if !s.has(pb::Capability::InPlaceUpdate) {
        check!(s, on, "in_place", |_s| { skip("CAPABILITY_IN_PLACE_UPDATE not advertised") });
        return;
    }
    check!(s, on, "in_place.can_update_negotiation", |s| {
        let (spec, alt) = (s.spec_struct()?, s.alt_spec_struct()?);
        let same = s
            .client
            .can_update_machine(pb::CanUpdateMachineRequest {
                name: s.name("m0"),
                current_provider_spec: Some(spec.clone()),
                desired_provider_spec: Some(spec.clone()),
                secrets: s.secrets(),
            })
            .await?
            .value;
        ensure!(
            same.in_place_paths.is_empty() && same.replace_paths.is_empty(),
            "identical specs reported changes: {same:?}"
        );
        let diff = s
            .client
            .can_update_machine(pb::CanUpdateMachineRequest {
                name: s.name("m0"),
                current_provider_spec: Some(spec.clone()),
                desired_provider_spec: Some(alt.clone()),
                secrets: s.secrets(),
            })
            .await?
            .value;
        let mut got: Vec<String> = diff.in_place_paths.iter().chain(&diff.replace_paths).cloned().collect();
        got.sort();
        let want = crate::convert::changed_paths(&spec_of(&spec), &spec_of(&alt));
        ensure!(got == want, "the plan covers {got:?}, but the changed fields are {want:?}");
        Ok(())
    });
    check!(s, on, "in_place.disruption", |s| {
        let (spec, alt) = (s.spec_struct()?, s.alt_spec_struct()?);
        let plan = s
            .client
            .can_update_machine(pb::CanUpdateMachineRequest {
                name: s.name("m0"),
                current_provider_spec: Some(spec),
                desired_provider_spec: Some(alt),
                secrets: s.secrets(),
            })
            .await?
            .value;
        disruption_verdict(&plan)
    });
    check!(s, on, "in_place.update_machine", |s| {
        let (spec, alt) = (s.spec_struct()?, s.alt_spec_struct()?);
        let name = s.name("m2");
        let plan = s
            .client
            .can_update_machine(pb::CanUpdateMachineRequest {
                name: name.clone(),
                current_provider_spec: Some(spec.clone()),
                desired_provider_spec: Some(alt.clone()),
                secrets: s.secrets(),
            })
            .await?
            .value;
        if !plan.replace_paths.is_empty() {
            return skip("the second example needs a replacement, so no in-place update can be tested");
        }
        let before = s
            .client
            .get_machine_status(pb::GetMachineStatusRequest {
                name: name.clone(),
                secrets: s.secrets(),
                ..Default::default()
            })
            .await?
            .value;
        let mut first = None;
        for _ in 0..s.config.repeat.max(2) {
            let op = s
                .client
                .update_machine(pb::UpdateMachineRequest {
                    name: name.clone(),
                    provider_spec: Some(alt.clone()),
                    secrets: s.secrets(),
                })
                .await?
                .value;
            first.get_or_insert(op);
        }
        s.wait_ok(first.ok_or("no operation")?).await?;
        let after = s
            .client
            .get_machine_status(pb::GetMachineStatusRequest { name, secrets: s.secrets(), ..Default::default() })
            .await?
            .value;
        ensure!(after.provider_id == before.provider_id, "in-place update replaced the machine");
        ensure!(after.spec_hash != before.spec_hash, "spec_hash unchanged after update ({})", after.spec_hash);
        Ok(())
    });
}

/// Whether a plan with in-place changes says what applying them disrupts. Unset is legal (a
/// driver older than the field; the controller treats it as REBOOT, so it drains the node even
/// for a tag change) and only warned about; a value this suite does not know fails.
fn disruption_verdict(plan: &pb::CanUpdateMachineResponse) -> Verdict {
    if plan.in_place_paths.is_empty() {
        return skip("the second example changes nothing in place, so no disruption is stated");
    }
    match pb::InPlaceDisruption::try_from(plan.disruption) {
        Ok(pb::InPlaceDisruption::Unspecified) => Err(NotPassed::Warn(format!(
            "CanUpdateMachine leaves disruption unset for in-place changes {:?}: the controller treats that as \
             REBOOT (cordon, drain, wait for a new boot ID); say NONE, DRAIN or REBOOT",
            plan.in_place_paths
        ))),
        Ok(_) => Ok(()),
        Err(_) => Err(NotPassed::Fail(format!(
            "CanUpdateMachine answers disruption {}, which is no InPlaceDisruption value",
            plan.disruption
        ))),
    }
}

async fn pool_instances(s: &Suite, pool: &str) -> Result<Vec<pb::PoolInstance>, NotPassed> {
    let mut out = Vec::new();
    let mut token = String::new();
    for _ in 0..1000 {
        let page = s
            .client
            .list_pool_instances(pb::ListPoolInstancesRequest {
                pool_name: pool.to_string(),
                page_size: 1,
                page_token: token,
                secrets: s.secrets(),
                ..Default::default()
            })
            .await?
            .value;
        ensure!(page.instances.len() <= 1, "page_size 1 returned {} instances", page.instances.len());
        out.extend(page.instances);
        token = page.next_page_token;
        if token.is_empty() {
            break;
        }
    }
    Ok(out)
}

pub(super) async fn pools(s: &mut Suite, on: &mut impl FnMut(&CheckResult)) {
    let on: On<'_> = on;
    if !s.has(pb::Capability::Pools) {
        check!(s, on, "pools", |_s| { skip("CAPABILITY_POOLS not advertised") });
        return;
    }
    check!(s, on, "pools.apply_idempotent", |s| {
        let name = s.name("pool");
        let mut first = None;
        for _ in 0..s.config.repeat.max(2) {
            let op = s
                .client
                .apply_pool(pb::ApplyPoolRequest {
                    name: name.clone(),
                    provider_spec: Some(s.spec_struct()?),
                    capacity: 2,
                    secrets: s.secrets(),
                    labels: s.labels(),
                })
                .await?
                .value;
            first.get_or_insert(op);
        }
        s.wait_ok(first.ok_or("no operation")?).await?;
        let pool = s
            .client
            .get_pool(pb::GetPoolRequest { name: name.clone(), secrets: s.secrets(), ..Default::default() })
            .await?
            .value;
        ensure!(pool.capacity == 2, "capacity {}, want 2", pool.capacity);
        let instances = pool_instances(s, &name).await?;
        ensure!(instances.len() == 2, "{} instances, want 2", instances.len());
        let ids: HashSet<&str> = instances.iter().map(|i| i.instance_id.as_str()).collect();
        ensure!(ids.len() == 2, "instance IDs repeat across pages: {ids:?}");
        ensure!(instances.iter().all(|i| i.latest_model_applied), "fresh instances should run the latest model");
        ensure!(
            instances.iter().all(|i| i.state() != pb::InstanceState::Unspecified),
            "every instance should carry a state (InstanceState), not only the cloud's provisioning_state"
        );
        Ok(())
    });
    check!(s, on, "pools.get_missing", |s| {
        let r = s
            .client
            .get_pool(pb::GetPoolRequest { name: s.name("no-pool"), secrets: s.secrets(), ..Default::default() })
            .await;
        expect_error(r, Code::NotFound, Some(reason::POOL_NOT_FOUND))?;
        Ok(())
    });
    check!(s, on, "pools.upgrade_instances", |s| {
        let name = s.name("pool");
        let op = s
            .client
            .apply_pool(pb::ApplyPoolRequest {
                name: name.clone(),
                provider_spec: Some(s.alt_spec_struct()?),
                capacity: 2,
                secrets: s.secrets(),
                labels: s.labels(),
            })
            .await?
            .value;
        s.wait_ok(op).await?;
        let instances = pool_instances(s, &name).await?;
        ensure!(
            instances.iter().all(|i| !i.latest_model_applied),
            "after a template change no instance should run the latest model yet"
        );
        let target = instances.first().ok_or("no instances")?.instance_id.clone();
        let op = s
            .client
            .upgrade_pool_instances(pb::UpgradePoolInstancesRequest {
                pool_name: name.clone(),
                instance_ids: vec![target.clone()],
                secrets: s.secrets(),
                ..Default::default()
            })
            .await?
            .value;
        s.wait_ok(op).await?;
        let instances = pool_instances(s, &name).await?;
        for i in &instances {
            ensure!(
                i.latest_model_applied == (i.instance_id == target),
                "instance {} latest_model_applied={}",
                i.instance_id,
                i.latest_model_applied
            );
        }
        Ok(())
    });
    check!(s, on, "pools.delete_one_instance", |s| {
        let name = s.name("pool");
        let before = pool_instances(s, &name).await?;
        let victim = before.first().ok_or("no instances")?.instance_id.clone();
        let op = s
            .client
            .delete_pool_instances(pb::DeletePoolInstancesRequest {
                pool_name: name.clone(),
                instance_ids: vec![victim.clone()],
                secrets: s.secrets(),
                ..Default::default()
            })
            .await?
            .value;
        s.wait_ok(op).await?;
        let after = pool_instances(s, &name).await?;
        let want: Vec<&str> = before.iter().map(|i| i.instance_id.as_str()).filter(|id| *id != victim).collect();
        let got: Vec<&str> = after.iter().map(|i| i.instance_id.as_str()).collect();
        ensure!(got == want, "after deleting {victim}: {got:?}, want {want:?}");
        let pool =
            s.client.get_pool(pb::GetPoolRequest { name, secrets: s.secrets(), ..Default::default() }).await?.value;
        ensure!(pool.capacity == 1, "capacity {} after deleting one of 2 instances", pool.capacity);
        let empty = s
            .client
            .delete_pool_instances(pb::DeletePoolInstancesRequest {
                pool_name: s.name("pool"),
                instance_ids: vec![],
                ..Default::default()
            })
            .await;
        expect_error(empty, Code::InvalidArgument, Some(reason::FIELD_REQUIRED))?;
        Ok(())
    });
    check!(s, on, "pools.delete_pool", |s| {
        let name = s.name("pool");
        for _ in 0..2 {
            let op = s
                .client
                .delete_pool(pb::DeletePoolRequest { name: name.clone(), secrets: s.secrets(), ..Default::default() })
                .await?
                .value;
            s.wait_ok(op).await?;
        }
        let r = s.client.get_pool(pb::GetPoolRequest { name, secrets: s.secrets(), ..Default::default() }).await;
        expect_error(r, Code::NotFound, Some(reason::POOL_NOT_FOUND))?;
        Ok(())
    });
}

/// Reads a stream until `pick` takes a message (the others are passed over), within `within`.
async fn read_until<T>(
    stream: &mut tonic::Streaming<pb::WatchEventsResponse>,
    within: Duration,
    waiting_for: &str,
    mut pick: impl FnMut(pb::watch_events_response::Item) -> Option<T>,
) -> Result<T, NotPassed> {
    let read = async {
        loop {
            match stream.message().await {
                Ok(Some(pb::WatchEventsResponse { item: Some(item) })) => {
                    if let Some(found) = pick(item) {
                        return Ok(found);
                    }
                }
                Ok(Some(_)) => {}
                Ok(None) => return Err(NotPassed::Fail("the event stream ended".into())),
                Err(status) => return Err(NotPassed::Fail(format!("the event stream failed: {status}"))),
            }
        }
    };
    tokio::time::timeout(within, read)
        .await
        .map_err(|_| NotPassed::Fail(format!("no {waiting_for} within {within:?}")))?
}

/// The next keepalive's resume token, within [`KEEPALIVE_WITHIN`].
async fn next_keepalive(stream: &mut tonic::Streaming<pb::WatchEventsResponse>) -> Result<String, NotPassed> {
    let what = format!("keepalive on a stream that asked for one every {EVENT_KEEPALIVE:?}");
    read_until(stream, KEEPALIVE_WITHIN, &what, |item| match item {
        pb::watch_events_response::Item::Keepalive(k) => Some(k.resume_token),
        pb::watch_events_response::Item::Event(_) => None,
    })
    .await
}

/// The next event on `stream` for `machine`, within `within`.
async fn next_event_for(
    stream: &mut tonic::Streaming<pb::WatchEventsResponse>,
    machine: &str,
    within: Duration,
) -> Result<pb::MachineEvent, NotPassed> {
    read_until(stream, within, &format!("event for {machine}"), |item| match item {
        pb::watch_events_response::Item::Event(e) if e.machine_name == machine => Some(e),
        _ => None,
    })
    .await
}

/// A stream with keepalives every [`EVENT_KEEPALIVE`] and the given ack deadline (the driver's
/// default when `None`).
fn watch_request(resume_token: String, ack_deadline: Option<Duration>) -> pb::WatchEventsRequest {
    pb::WatchEventsRequest {
        resume_token,
        keepalive_interval: Some(crate::convert::duration(EVENT_KEEPALIVE)),
        ack_deadline: ack_deadline.map(crate::convert::duration),
    }
}

pub(super) async fn events(s: &mut Suite, on: &mut impl FnMut(&CheckResult)) {
    let on: On<'_> = on;
    if !s.has(pb::Capability::Events) {
        return;
    }
    check!(s, on, "events.keepalive_on_an_idle_stream_and_resume_after_cancel", |s| {
        let mut first =
            s.client.watch_events(watch_request(String::new(), None)).await.map_err(|e| e.to_string())?.value;
        let token = next_keepalive(&mut first).await?;
        ensure!(!token.is_empty(), "the keepalive carries no resume_token");
        // Cancelling a stream (dropping it) leaves the driver serving the next one, resumed.
        drop(first);
        let mut second = s.client.watch_events(watch_request(token, None)).await.map_err(|e| e.to_string())?.value;
        next_keepalive(&mut second).await?;
        Ok(())
    });
    check!(s, on, "events.malformed_resume_token_refused", |s| {
        // gRPC lets the refusal come when the stream opens or as its first message; a caller
        // reads both.
        let report = match s.client.watch_events(watch_request("not a resume token".into(), None)).await {
            Err(e) => e.report,
            Ok(reply) => {
                let mut stream = reply.value;
                match tokio::time::timeout(KEEPALIVE_WITHIN, stream.message()).await {
                    Ok(Err(status)) => ErrorReport::from_status(&status),
                    Ok(Ok(m)) => return Err(NotPassed::Fail(format!("want INVALID_ARGUMENT, the stream sent {m:?}"))),
                    Err(_) => return Err(NotPassed::Fail(format!("no answer within {KEEPALIVE_WITHIN:?}"))),
                }
            }
        };
        ensure!(report.code == Code::InvalidArgument, "want INVALID_ARGUMENT, got {report}");
        ensure!(report.reason == reason::FIELD_INVALID, "want reason FIELD_INVALID, got {report}");
        ensure!(!report.domain.is_empty(), "the error carries no ErrorInfo domain: {report}");
        Ok(())
    });
    check!(s, on, "events.ack_without_ids_refused", |s| {
        let r = s.client.ack_events(pb::AckEventsRequest { event_ids: vec![] }).await;
        expect_error(r, Code::InvalidArgument, Some(reason::FIELD_REQUIRED))?;
        let r = s.client.ack_events(pb::AckEventsRequest { event_ids: vec![String::new()] }).await;
        expect_error(r, Code::InvalidArgument, Some(reason::FIELD_INVALID))?;
        Ok(())
    });
    check!(s, on, "events.unknown_ack_reported_twice_alike", |s| {
        let id = format!("conformance-unknown-{}", uuid::Uuid::new_v4());
        for _ in 0..s.config.repeat.max(2) {
            let r = s.client.ack_events(pb::AckEventsRequest { event_ids: vec![id.clone()] }).await;
            let r = r.map_err(|e| format!("acknowledging an unknown ID must succeed: {e}"))?.value;
            ensure!(r.unknown_event_ids == [id.clone()], "want {id} in unknown_event_ids, got {r:?}");
            ensure!(r.acked_event_ids.is_empty(), "an unknown ID was reported acknowledged: {r:?}");
        }
        Ok(())
    });
}

/// Runs the `--event-trigger` command for one machine.
async fn trigger_event(s: &Suite, command: &str, machine: &str, provider_id: &str) -> Result<(), NotPassed> {
    let run = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(command)
        .env("MACHINE_NAME", machine)
        .env("PROVIDER_ID", provider_id)
        .env("DRIVER_ENDPOINT", &s.config.endpoint)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(s.config.call_timeout, run)
        .await
        .map_err(|_| NotPassed::Fail(format!("--event-trigger did not finish within {:?}", s.config.call_timeout)))?
        .map_err(|e| NotPassed::Fail(format!("--event-trigger could not run: {e}")))?;
    ensure!(
        out.status.success(),
        "--event-trigger failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// The ack deadline of the real-event check: short, so a redelivery comes quickly.
const EVENT_ACK_DEADLINE: Duration = Duration::from_secs(1);

pub(super) async fn events_delivered(s: &mut Suite, on: &mut impl FnMut(&CheckResult)) {
    let on: On<'_> = on;
    if !s.has(pb::Capability::Events) || !s.has(pb::Capability::Machines) {
        return;
    }
    check!(s, on, "events.redelivered_until_acked_resumed_and_acked_once", |s| {
        let Some(command) = s.config.event_trigger.clone() else {
            return skip("pass --event-trigger to check delivery on a real event");
        };
        let name = s.name("events");
        let op = s.client.create_machine(s.create_request(&name, s.spec_struct()?)).await?.value;
        let op = s.wait_ok(op).await?;
        let provider_id = op.machine().map(|m| m.provider_id.clone()).unwrap_or_default();
        let mut stream = s.client.watch_events(watch_request(String::new(), Some(EVENT_ACK_DEADLINE))).await?.value;
        trigger_event(s, &command, &name, &provider_id).await?;
        let within = s.config.call_timeout * 2;
        let first = next_event_for(&mut stream, &name, within).await?;
        ensure!(!first.event_id.is_empty(), "the event has no event_id: {first:?}");
        ensure!(first.kind != pb::MachineEventKind::Unspecified as i32, "the event has no kind: {first:?}");
        ensure!(
            first.provider_id == provider_id,
            "the event names provider ID {:?}, the machine is {provider_id:?}",
            first.provider_id
        );
        ensure!(first.delivery_attempt >= 1, "delivery_attempt starts at 1: {first:?}");
        // Not acknowledged: sent again after the ack deadline, counted.
        let again = next_event_for(&mut stream, &name, within).await?;
        ensure!(
            again.event_id == first.event_id && again.delivery_attempt > first.delivery_attempt,
            "want {} again with a higher delivery_attempt, got {again:?}",
            first.event_id
        );
        // A new stream, resumed: the unacknowledged event still comes.
        drop(stream);
        let mut stream =
            s.client.watch_events(watch_request(again.resume_token.clone(), Some(EVENT_ACK_DEADLINE))).await?.value;
        let resumed = next_event_for(&mut stream, &name, within).await?;
        ensure!(resumed.event_id == first.event_id, "after resume want {}, got {resumed:?}", first.event_id);
        // Acknowledged once: acked, then unknown, and never sent again.
        let ids = vec![first.event_id.clone()];
        let acked = s.client.ack_events(pb::AckEventsRequest { event_ids: ids.clone() }).await?.value;
        ensure!(acked.acked_event_ids == ids, "the first ack did not acknowledge {}: {acked:?}", first.event_id);
        let twice = s.client.ack_events(pb::AckEventsRequest { event_ids: ids.clone() }).await?.value;
        ensure!(twice.unknown_event_ids == ids, "the second ack did not report {} unknown: {twice:?}", first.event_id);
        match next_event_for(&mut stream, &name, EVENT_ACK_DEADLINE * 3).await {
            Ok(e) if e.event_id == first.event_id => {
                return Err(NotPassed::Fail(format!("{} was sent again after its acknowledgement", e.event_id)))
            }
            _ => {}
        }
        // The machine goes with the run's others in `cleanup`.
        Ok(())
    });
}

pub(super) async fn unadvertised(s: &mut Suite, on: &mut impl FnMut(&CheckResult)) {
    let on: On<'_> = on;
    check!(s, on, "capabilities.unadvertised_are_unimplemented", |s| {
        if !s.has(pb::Capability::Pools) {
            let r = s.client.get_pool(pb::GetPoolRequest { name: "p".into(), ..Default::default() }).await;
            expect_error(r, Code::Unimplemented, None)?;
        }
        if !s.has(pb::Capability::InPlaceUpdate) {
            let r = s.client.update_machine(pb::UpdateMachineRequest { name: "m".into(), ..Default::default() }).await;
            expect_error(r, Code::Unimplemented, None)?;
        }
        if !s.has(pb::Capability::Machines) {
            let r = s.client.list_machines(pb::ListMachinesRequest::default()).await;
            expect_error(r, Code::Unimplemented, None)?;
        }
        if !s.has(pb::Capability::Events) {
            // A driver of an older revision serves no Events service at all: its gRPC stack
            // answers UNIMPLEMENTED without the protocol's error details, which is enough.
            let r = s.client.ack_events(pb::AckEventsRequest { event_ids: vec!["e".into()] }).await;
            match r {
                Err(e) if e.code() == Code::Unimplemented => {}
                other => {
                    return Err(NotPassed::Fail(format!(
                        "AckEvents without the EVENTS capability: want UNIMPLEMENTED, got {other:?}"
                    )))
                }
            }
        }
        Ok(())
    });
}

pub(super) async fn cleanup(s: &mut Suite, on: &mut impl FnMut(&CheckResult)) {
    let on: On<'_> = on;
    check!(s, on, "cleanup.nothing_left_behind", |s| {
        if s.has(pb::Capability::Pools) {
            let op = s
                .client
                .delete_pool(pb::DeletePoolRequest { name: s.name("pool"), secrets: s.secrets(), ..Default::default() })
                .await?
                .value;
            s.wait_ok(op).await?;
        }
        if !s.has(pb::Capability::Machines) {
            return Ok(());
        }
        let left = s.client.list_all_machines(s.labels(), 100, s.secrets()).await?;
        let mut ops = Vec::new();
        for m in &left {
            ops.push(
                s.client
                    .delete_machine(pb::DeleteMachineRequest {
                        name: m.name.clone(),
                        secrets: s.secrets(),
                        ..Default::default()
                    })
                    .await?
                    .value,
            );
        }
        for op in ops {
            s.wait_ok(op).await?;
        }
        let still = s.client.list_all_machines(s.labels(), 100, s.secrets()).await?;
        ensure!(
            still.is_empty(),
            "machines left after cleanup: {:?}",
            still.iter().map(|m| &m.name).collect::<Vec<_>>()
        );
        Ok(())
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(in_place: &[&str], disruption: i32) -> pb::CanUpdateMachineResponse {
        pb::CanUpdateMachineResponse {
            in_place_paths: in_place.iter().map(|p| p.to_string()).collect(),
            replace_paths: Vec::new(),
            disruption,
        }
    }

    #[test]
    fn an_unset_disruption_is_a_warning_an_unknown_one_a_failure() {
        for d in [pb::InPlaceDisruption::None, pb::InPlaceDisruption::Drain, pb::InPlaceDisruption::Reboot] {
            assert!(disruption_verdict(&plan(&["/tags/a"], d as i32)).is_ok(), "{d:?}");
        }
        let unset = disruption_verdict(&plan(&["/tags/a"], 0));
        assert!(matches!(unset, Err(NotPassed::Warn(ref w)) if w.contains("REBOOT")), "{unset:?}");
        assert!(matches!(disruption_verdict(&plan(&["/tags/a"], 42)), Err(NotPassed::Fail(_))));
        // Nothing in place: nothing to say.
        assert!(matches!(disruption_verdict(&plan(&[], 0)), Err(NotPassed::Skip(_))));
    }
}
