//! The machine RPCs: one VM per machine, joining a Flexible scale set.
//!
//! | RPC | ARM calls |
//! |---|---|
//! | `CreateMachine` | `GET` the VM (by machine name); absent or `Failed`: one `PUT` with the body of [`vm::body`]; present with the same spec hash: its state as the answer (never a second VM); another hash: ALREADY_EXISTS / MACHINE_SPEC_CONFLICT |
//! | `DeleteMachine` | `GET` the VM; ours: one `DELETE` (its NIC and OS disk go with it, `deleteOption: Delete`); absent (204/404): a done operation |
//! | `GetMachineStatus` | `GET` the VM with its instance view, then `GET` its primary NIC for the private IP |
//! | `ListMachines` | `GET …/virtualMachines?$expand=instanceView` of the resource group, keeping the VMs tagged with a machine name and the selector's labels; ARM's `nextLink` plus an offset is the page token |
//! | `CanUpdateMachine` | none: `vmSize` and `tags` change in place, anything else needs a new VM |
//! | `UpdateMachine` | `GET` the VM, then one `PATCH` of `tags` and `hardwareProfile.vmSize` |
//!
//! The VM is found by name in the subscription and resource group of its provider ID (when the
//! caller sends one), else of the provider spec, else the defaults. Operations are resumed from
//! their token exactly like the pool ones: `Azure-AsyncOperation`, else `Location`, else the VM's
//! provisioning state; a succeeded `PUT`/`PATCH` ends with a `GET` of the VM.

use azure_core::{Method, Url};
use base64::Engine;
use driver_sdk::{
    convert, reason, CanUpdateMachine, CreateMachine, DriverError, ListMachines, Machine, MachineRef, Operation,
    OperationKind, OperationOutput, Page, RequestContext, Result, UpdateMachine, UpdatePlan,
};
use serde_json::{json, Value};

use crate::arm::{ArmClient, ArmResponse};
use crate::errors::{operation_failed, to_driver_error};
use crate::model::{self, SPEC_HASH_TAG};
use crate::vm::{self, NAME_TAG};
use crate::{with_rid, AzureVmssDriver, OpState, PageToken, ResourceId, B64};

const NOT_FOUND: &str = reason::MACHINE_NOT_FOUND;

/// Api-version of the Microsoft.Network calls (reading a VM's NIC).
const NETWORK_API_VERSION: &str = "2024-05-01";

/// Whether an operation token belongs to a machine RPC.
pub(crate) fn is_machine_op(st: &OpState) -> bool {
    matches!(st.kind.as_str(), "CreateMachine" | "DeleteMachine" | "UpdateMachine")
}

fn err(e: crate::arm::ArmError) -> DriverError {
    to_driver_error(e, NOT_FOUND)
}

fn missing(r: &ResourceId) -> DriverError {
    DriverError::not_found(
        NOT_FOUND,
        format!("no machine VM {} in resource group {} of subscription {}", r.name, r.resource_group, r.subscription),
    )
}

impl AzureVmssDriver {
    /// Where a machine's VM lives: its provider ID's place when the caller knows it, else the
    /// spec's, the Secret's or the defaults.
    fn vm_resource(
        &self,
        name: &str,
        provider_id: Option<&str>,
        spec: &Value,
        secret_subscription: Option<&str>,
    ) -> Result<ResourceId> {
        match provider_id.filter(|p| !p.is_empty()).and_then(vm::parse_provider_id) {
            Some(r) => Ok(r),
            None => self.resource(name, spec, secret_subscription),
        }
    }

    fn vm_url(&self, r: &ResourceId, query: &[(&str, &str)]) -> Result<Url> {
        self.arm.url(&vm::path(r), query).map_err(err)
    }

    /// The VM with its instance view, or `None` when ARM says 404.
    async fn get_vm(
        &self,
        arm: &ArmClient,
        ctx: &RequestContext,
        r: &ResourceId,
    ) -> Result<Option<(Value, ArmResponse)>> {
        let url = self.vm_url(r, &[("$expand", "instanceView")])?;
        let resp = Self::call(arm, ctx, Method::Get, url, None).await.map_err(err)?;
        match resp.status {
            404 => Ok(None),
            s if (200..300).contains(&s) => Ok(Some((resp.value(), resp))),
            _ => Err(err(resp.into_error())),
        }
    }

    /// The machine's VM: like [`Self::get_vm`], but a VM of the same name that this driver did
    /// not create (no machine-name tag of this name) counts as absent, so it is never touched.
    async fn get_machine_vm(
        &self,
        arm: &ArmClient,
        ctx: &RequestContext,
        r: &ResourceId,
    ) -> Result<Option<(Value, ArmResponse)>> {
        Ok(self.get_vm(arm, ctx, r).await?.filter(|(v, _)| {
            let ours = vm::tags_of(v).get(NAME_TAG).map(String::as_str) == Some(r.name.as_str());
            if !ours {
                tracing::warn!(vm = %r.name, "a VM of this name exists without our machine-name tag; leaving it alone");
            }
            ours
        }))
    }

    /// The VM as a machine, with the private IPs of its primary NIC (best effort: a NIC that
    /// cannot be read leaves the addresses without IPs, the status stands).
    async fn machine_with_ips(&self, arm: &ArmClient, ctx: &RequestContext, v: &Value) -> Machine {
        let mut ips = Vec::new();
        if let Some(nic) = vm::nic_ids(v).first() {
            // The NIC is Microsoft.Network's, with its own api-version.
            let url = self.arm.url_at_version(nic, NETWORK_API_VERSION, &[]);
            match url {
                Ok(url) => match Self::call(arm, ctx, Method::Get, url, None).await {
                    Ok(resp) if resp.is_success() => ips = vm::nic_ips(&resp.value()),
                    Ok(resp) => tracing::warn!(nic = %nic, status = resp.status, "reading the VM's NIC failed"),
                    Err(e) => {
                        tracing::warn!(nic = %nic, error = %driver_sdk::error_chain(&e), "reading the VM's NIC failed")
                    }
                },
                Err(e) => tracing::warn!(nic = %nic, error = %e, "the VM's NIC ID is no ARM path"),
            }
        }
        vm::machine_of(v, &ips)
    }

    pub(crate) async fn create_vm(&self, ctx: &RequestContext, req: CreateMachine) -> Result<Operation> {
        let spec = model::parse_spec(&req.provider_spec)?;
        let hash = convert::spec_hash(&req.provider_spec);
        let (arm, secret_sub) = self.arm_for(&req.secrets)?;
        let r = self.resource(&req.name, &req.provider_spec, secret_sub.as_deref())?;
        let url = self.vm_url(&r, &[])?;
        let kind = OperationKind::CreateMachine;
        // The body first: a spec no VM can be built from is refused before any ARM call.
        let custom_data = vm::custom_data(&spec, &req.secrets)?;
        let scale_set = vm::scale_set_id(&spec, &r, self.config.scale_set.as_deref());
        let tags = vm::tags_for(&req.name, &spec, &hash, &req.labels);
        let body = vm::body(&r, &spec, tags, scale_set.as_deref(), custom_data)?;
        self.watch.learn(&r, &arm);
        // Never a second VM: a VM of this name answers the create.
        if let Some((v, resp)) = self.get_vm(&arm, ctx, &r).await? {
            if vm::tags_of(&v).get(NAME_TAG) != Some(&req.name) {
                return Err(DriverError::new(
                    driver_sdk::tonic::Code::FailedPrecondition,
                    reason::FIELD_INVALID,
                    format!(
                        "VM {} in resource group {} exists but no machine of this driver is it (no {NAME_TAG} tag): \
                         choose another machine name or remove the VM",
                        r.name, r.resource_group
                    ),
                )
                .with_violation("name", "taken by a VM this driver does not manage"));
            }
            let existing = vm::tags_of(&v).get(SPEC_HASH_TAG).cloned().unwrap_or_default();
            if existing != hash {
                return Err(DriverError::already_exists(
                    reason::MACHINE_SPEC_CONFLICT,
                    format!(
                        "machine {} exists as VM {} with another provider spec (hash {existing}, requested {hash})",
                        req.name,
                        v["id"].as_str().unwrap_or_default()
                    ),
                )
                .with_metadata("vmId", v["id"].as_str().unwrap_or_default()));
            }
            let rid = resp.request_id();
            match vm::provisioning_state(&v) {
                "Succeeded" => {
                    let m = self.machine_with_ips(&arm, ctx, &v).await;
                    return Ok(self.done(kind, &r, &Method::Put, &url, rid, OperationOutput::Machine(m)));
                }
                // Being created or updated (a repeated call): follow the VM itself.
                "Creating" | "Updating" => {
                    let mut op = self.started(kind, &r, &Method::Put, &url, &resp, vec![]);
                    op.poll_after = self.poll_after(&resp);
                    return Ok(op);
                }
                "Deleting" => {
                    return Err(DriverError::operation_pending(format!(
                        "VM {} is being deleted; create the machine again once it is gone",
                        req.name
                    )))
                }
                _ => {} // Failed: PUT it again, ARM re-applies the model.
            }
        }
        let resp = Self::call(&arm, ctx, Method::Put, url.clone(), Some(&body)).await.map_err(err)?;
        if !resp.is_success() {
            return Err(err(resp.into_error()));
        }
        tracing::info!(
            "request.id" = %ctx.request_id(), "arm.request_id" = resp.request_id().unwrap_or(""),
            vm = %r.name, scale_set = scale_set.as_deref().unwrap_or(""), "creating VM"
        );
        Ok(self.started(kind, &r, &Method::Put, &url, &resp, vec![]))
    }

    pub(crate) async fn delete_vm(&self, ctx: &RequestContext, req: MachineRef) -> Result<Operation> {
        let (arm, secret_sub) = self.arm_for(&req.secrets)?;
        let r = self.vm_resource(&req.name, req.provider_id.as_deref(), &req.provider_spec, secret_sub.as_deref())?;
        let kind = OperationKind::DeleteMachine;
        let url = self.vm_url(&r, &[])?;
        self.watch.learn(&r, &arm);
        let Some((v, resp)) = self.get_machine_vm(&arm, ctx, &r).await? else {
            return Ok(self.done(kind, &r, &Method::Delete, &url, None, OperationOutput::None));
        };
        // Ours from here on: the event poll does not report this VM going away.
        self.watch.deleting(&r);
        if vm::provisioning_state(&v) == "Deleting" {
            // A repeated delete: follow the one under way.
            let mut op = self.started(kind, &r, &Method::Delete, &url, &resp, vec![]);
            op.poll_after = self.poll_after(&resp);
            return Ok(op);
        }
        let resp = Self::call(&arm, ctx, Method::Delete, url.clone(), None).await.map_err(err)?;
        match resp.status {
            204 | 404 => Ok(self.done(kind, &r, &Method::Delete, &url, resp.request_id(), OperationOutput::None)),
            s if (200..300).contains(&s) => Ok(self.started(kind, &r, &Method::Delete, &url, &resp, vec![])),
            _ => Err(err(resp.into_error())),
        }
    }

    pub(crate) async fn vm_status(&self, ctx: &RequestContext, req: MachineRef) -> Result<Machine> {
        let (arm, secret_sub) = self.arm_for(&req.secrets)?;
        let r = self.vm_resource(&req.name, req.provider_id.as_deref(), &req.provider_spec, secret_sub.as_deref())?;
        self.watch.learn(&r, &arm);
        match self.get_machine_vm(&arm, ctx, &r).await? {
            Some((v, _)) => Ok(self.machine_with_ips(&arm, ctx, &v).await),
            None => Err(missing(&r)),
        }
    }

    pub(crate) async fn list_vms(&self, ctx: &RequestContext, req: ListMachines) -> Result<Page<Machine>> {
        let bad_token = || {
            DriverError::invalid_argument(reason::FIELD_INVALID, "page_token is not one this driver issued")
                .with_violation("page_token", "unknown token")
        };
        let (arm, secret_sub) = self.arm_for(&req.secrets)?;
        let (mut url, mut offset) = if req.page_token.is_empty() {
            let r = self.resource("", &req.provider_spec, secret_sub.as_deref())?;
            self.watch.learn(&r, &arm);
            let path = format!(
                "/subscriptions/{}/resourceGroups/{}/providers/Microsoft.Compute/virtualMachines",
                r.subscription, r.resource_group
            );
            (self.arm.url(&path, &[("$expand", "instanceView")]).map_err(err)?, 0)
        } else {
            let bytes = B64.decode(&req.page_token).map_err(|_| bad_token())?;
            let t: PageToken = serde_json::from_slice(&bytes).map_err(|_| bad_token())?;
            (self.arm.trusted_url(&t.l).map_err(|_| bad_token())?, t.o)
        };
        let token =
            |l: &str, o: usize| B64.encode(serde_json::to_vec(&PageToken { l: l.to_string(), o }).unwrap_or_default());
        // Skip ARM pages with none of our VMs (bounded).
        for _ in 0..20 {
            let resp = Self::call(&arm, ctx, Method::Get, url.clone(), None).await.map_err(err)?;
            if !resp.is_success() {
                return Err(err(resp.into_error()));
            }
            let page = resp.value();
            let rest: Vec<Machine> = page["value"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default()
                .iter()
                .filter(|v| vm::has_labels(v, &req.label_selector))
                .skip(offset)
                .map(|v| vm::machine_of(v, &[]))
                .collect();
            if rest.len() > req.page_size {
                let next = token(url.as_str(), offset + req.page_size);
                return Ok(Page { items: rest.into_iter().take(req.page_size).collect(), next_page_token: next });
            }
            match page["nextLink"].as_str().filter(|l| !l.is_empty()) {
                Some(link) if rest.is_empty() => {
                    url = self.arm.trusted_url(link).map_err(err)?;
                    offset = 0;
                }
                Some(link) => {
                    self.arm.trusted_url(link).map_err(err)?;
                    return Ok(Page { items: rest, next_page_token: token(link, 0) });
                }
                None => return Ok(Page { items: rest, next_page_token: String::new() }),
            }
        }
        Ok(Page { items: Vec::new(), next_page_token: token(url.as_str(), 0) })
    }

    pub(crate) fn plan_vm_update(&self, req: &CanUpdateMachine) -> Result<UpdatePlan> {
        model::parse_spec(&req.desired)?;
        Ok(vm::plan_update(&req.changed_paths))
    }

    pub(crate) async fn update_vm(&self, ctx: &RequestContext, req: UpdateMachine) -> Result<Operation> {
        let spec = model::parse_spec(&req.provider_spec)?;
        let hash = convert::spec_hash(&req.provider_spec);
        let (arm, secret_sub) = self.arm_for(&req.secrets)?;
        let r = self.resource(&req.name, &req.provider_spec, secret_sub.as_deref())?;
        let kind = OperationKind::UpdateMachine;
        let url = self.vm_url(&r, &[])?;
        self.watch.learn(&r, &arm);
        let Some((v, resp)) = self.get_machine_vm(&arm, ctx, &r).await? else { return Err(missing(&r)) };
        let current = vm::tags_of(&v);
        let state = vm::provisioning_state(&v);
        if current.get(SPEC_HASH_TAG) == Some(&hash) {
            return match state {
                "Succeeded" => {
                    let m = self.machine_with_ips(&arm, ctx, &v).await;
                    Ok(self.done(kind, &r, &Method::Patch, &url, resp.request_id(), OperationOutput::Machine(m)))
                }
                // This update is under way (a repeated call): follow the VM.
                "Updating" => {
                    let mut op = self.started(kind, &r, &Method::Patch, &url, &resp, vec![]);
                    op.poll_after = self.poll_after(&resp);
                    Ok(op)
                }
                _ => Err(DriverError::operation_pending(format!("VM {} is {state}", req.name))),
            };
        }
        if matches!(state, "Creating" | "Updating" | "Deleting") {
            return Err(DriverError::operation_pending(format!(
                "VM {} is {state}; update it once that is over",
                req.name
            )));
        }
        let body = json!({
            "tags": vm::updated_tags(&current, &spec, &hash),
            "properties": {"hardwareProfile": {"vmSize": spec.vm_size}},
        });
        let resp = Self::call(&arm, ctx, Method::Patch, url.clone(), Some(&body)).await.map_err(err)?;
        if !resp.is_success() {
            return Err(err(resp.into_error()));
        }
        Ok(self.started(kind, &r, &Method::Patch, &url, &resp, vec![]))
    }

    /// A succeeded machine `PUT`/`PATCH`: the VM as it is now.
    pub(crate) async fn machine_succeeded(
        &self,
        arm: &ArmClient,
        ctx: &RequestContext,
        st: &OpState,
        op: Operation,
    ) -> Result<Operation> {
        match self.get_machine_vm(arm, ctx, &st.resource).await? {
            Some((v, resp)) => {
                let m = self.machine_with_ips(arm, ctx, &v).await;
                Ok(with_rid(op, resp.request_id()).finish(Ok(OperationOutput::Machine(m))))
            }
            None => Ok(op.finish(Err(missing(&st.resource)))),
        }
    }

    /// An operation ARM gave no URL for: the VM's provisioning state says how it goes.
    pub(crate) async fn follow_vm(
        &self,
        arm: &ArmClient,
        ctx: &RequestContext,
        st: &OpState,
        op: Operation,
    ) -> Result<Operation> {
        let url = self.vm_url(&st.resource, &[("$expand", "instanceView")])?;
        let resp = Self::call(arm, ctx, Method::Get, url, None).await.map_err(err)?;
        let op = with_rid(op, resp.request_id());
        // A VM of this name that is no machine's counts as absent (as in every machine RPC).
        let foreign = resp.is_success()
            && vm::tags_of(&resp.value()).get(NAME_TAG).map(String::as_str) != Some(st.resource.name.as_str());
        if resp.status == 404 || foreign {
            return Ok(if st.method == "DELETE" {
                op.finish(Ok(OperationOutput::None))
            } else {
                op.finish(Err(missing(&st.resource)))
            });
        }
        if !resp.is_success() {
            return Err(err(resp.into_error()));
        }
        let v = resp.value();
        match vm::provisioning_state(&v) {
            "Succeeded" if st.method != "DELETE" => {
                let m = self.machine_with_ips(arm, ctx, &v).await;
                Ok(op.finish(Ok(OperationOutput::Machine(m))))
            }
            s @ ("Failed" | "Canceled") => {
                // ARM names the failure in the instance view (e.g. ZonalAllocationFailed).
                let (code, message) = vm::failure(&v).unwrap_or_else(|| {
                    ("ProvisioningStateFailed".into(), format!("VM {}'s provisioning state is {s}", st.resource.name))
                });
                Ok(op.finish(Err(operation_failed(s, &code, &message, resp.request_id()))))
            }
            _ => Ok(op.with_poll_after(self.poll_after(&resp))),
        }
    }
}
