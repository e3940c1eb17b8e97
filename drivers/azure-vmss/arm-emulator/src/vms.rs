//! Virtual machines — standalone or members of a Flexible scale set — with the network interfaces
//! and OS disks ARM creates for them.
//!
//! - `PUT …/Microsoft.Compute/virtualMachines/{vm}` → 201 (new, `Creating`) / 200 (existing,
//!   `Updating`) with `Azure-AsyncOperation`, `Location` and `Retry-After`. A PUT of an existing
//!   VM may change only `tags` and `properties.hardwareProfile.vmSize` (anything else → 409
//!   `PropertyChangeNotAllowed`, target the first changed property; another `location` → 400
//!   `InvalidResourceLocation`). The same body again is a no-op update: 200 and an operation that
//!   has already succeeded — never a second VM. While the VM's create or update runs, the same
//!   body gets that operation back, a different one 409 `Conflict`.
//! - `PATCH` the same path: a JSON merge of the body into the VM (with `tags` replaced as a whole,
//!   as ARM does), under the same rules. A size change of a running VM is accepted whenever the
//!   size is valid (the emulator has no SKU availability); the VM stays `running`.
//! - `properties.virtualMachineScaleSet.id` makes the VM a member of that scale set: a scale set
//!   that does not exist → 400 `InvalidParameter` (target `properties.virtualMachineScaleSet.id`);
//!   a Uniform one → 409 `OperationNotAllowed`; one being deleted → 409 `Conflict`. Membership
//!   cannot change after creation (`PropertyChangeNotAllowed`). Deleting a Flexible scale set
//!   deletes its member VMs when the delete finishes.
//! - `networkProfile.networkInterfaceConfigurations` (requires `networkApiVersion`) creates one
//!   NIC per entry, `…/Microsoft.Network/networkInterfaces/{vm}-nic-{index}`, with a private IP
//!   from `10.0.0.4` up; `networkProfile.networkInterfaces` attaches existing NICs (unknown →
//!   400 `InvalidResourceReference`, attached elsewhere → 400 `NicInUse`). The OS disk is
//!   `…/Microsoft.Compute/disks/{vm}_OsDisk_1_{32 hex}` unless `storageProfile.osDisk.name` names
//!   it. Each carries a `deleteOption` (default `Detach`): on VM delete, `Delete` removes it and
//!   `Detach` leaves it unattached.
//! - `GET` the VM (`$expand=instanceView` adds `properties.instanceView`), `GET …/instanceView`
//!   (`ProvisioningState/…` and `PowerState/…` statuses), `DELETE` → 202 with the three headers
//!   (204 when missing; a delete while one runs gets the same operation).
//! - `GET …/resourceGroups/{rg}/providers/Microsoft.Compute/virtualMachines` and
//!   `GET /subscriptions/{s}/providers/Microsoft.Compute/virtualMachines`: pages of
//!   `page_size` with an absolute `nextLink` (`$skiptoken`), `$expand=instanceView` (or
//!   `statusOnly=true`), and `$filter=virtualMachineScaleSet/id eq '{id}'`.
//! - `GET`/`DELETE` `…/Microsoft.Network/networkInterfaces/{nic}` (any api-version) and
//!   `…/Microsoft.Compute/disks/{disk}` (`2024-03-02`, the disk API of the 2024-07-01 compute
//!   package, or `2024-07-01`), and `GET` of both collections in a resource group, so tests can
//!   look for leaks. Deleting them is synchronous (200; 204 when missing); an attached NIC → 400
//!   `NicInUse`, an attached disk → 409 `OperationNotAllowed`.
//!
//! - Spot: `properties.priority` (`Regular`, `Spot`, legacy `Low`), `evictionPolicy`
//!   (`Deallocate`, ARM's default for Spot VMs, or `Delete`) and `billingProfile.maxPrice` (-1 or
//!   above 0) are stored and returned. `evictionPolicy` on a VM that is not Spot → 400
//!   `EvictionPolicyCanBeSetOnlyOnAzureSpotVirtualMachines` (ARM's code); `maxPrice` on one, or a
//!   price that is neither -1 nor above 0 → 400 `InvalidParameter` (target
//!   `billingProfile.maxPrice`; the emulator's choice).
//! - `POST …/simulateEviction` → 204, and `Config::eviction_delay` later (default at once; ARM
//!   takes about 30 s) the VM is evicted: deallocated (`PowerState/deallocated`, still
//!   `Succeeded`) or deleted, by its eviction policy. Not a Spot VM, or not running → 409
//!   `OperationNotAllowed` (the emulator's choice of code). The instance view says nothing of an
//!   eviction (ARM's does not either); the `ProvisioningState/…` status carries the `time` of the
//!   last change.
//! - `POST …/deallocate` and `…/powerOff` → 202 with the operation headers; the VM ends
//!   `deallocated` / `stopped` after `Config::delete_duration` — a VM stopped out of band.
//! - A zone that refuses new VMs (`PUT /_emulator/zones`, see the crate docs): a VM in it is
//!   created `Failed` by an operation that ends `ZonalAllocationFailed` (and a `PUT` of that VM
//!   again fails the same way while the zone refuses), or refused at once with 409
//!   `SkuNotAvailable`. A failed operation's code shows in the instance view as
//!   `ProvisioningState/failed/{code}`, with its message.
//!
//! Creates and updates take `Config::operation_duration`, deletes `Config::delete_duration`; the
//! fault rules, request log, throttling and bearer-token check are the ones every ARM path goes
//! through.

use std::time::{Duration, Instant, SystemTime};

use axum::http::{Method, StatusCode};
use serde_json::{json, Value};

use super::{
    accepted, check_body, eq, finish as finish_op, instance_view_of, merge, method_not_allowed, op_urls,
    refuse_allocation, required_location, rfc3339, sku_not_available, start_op, zone_refusal, zones_of, Answer, Call,
    Cloud, Emulator, OpKind, ZoneRefusal, API_VERSION,
};

/// Api-version of the managed-disk endpoints in the 2024-07-01 compute package.
const DISK_API_VERSION: &str = "2024-03-02";

/// A NIC or disk as the VM holds it.
#[derive(Debug, Clone)]
struct Attachment {
    /// Key (lower-cased id) of the NIC or disk.
    key: String,
    /// `deleteOption: Delete`.
    delete: bool,
    /// Primary NIC.
    primary: bool,
}

/// A virtual machine.
#[derive(Debug, Clone)]
pub(crate) struct VirtualMachine {
    id: String,
    name: String,
    subscription: String,
    location: String,
    /// The resource as PUT (read-only properties removed); read-only ones are overlaid when shown.
    body: Value,
    provisioning_state: String,
    power_state: String,
    vm_id: String,
    time_created: SystemTime,
    /// Key of the scale set it belongs to.
    scale_set: Option<String>,
    nics: Vec<Attachment>,
    os_disk: Option<Attachment>,
    op: Option<String>,
    /// Code and message of the last operation that failed it (cleared when one succeeds).
    error: Option<(String, String)>,
    /// When the last operation (or eviction) ended: the `time` of its `ProvisioningState/…`
    /// status.
    state_time: SystemTime,
    /// When a simulated eviction takes effect.
    evict_at: Option<Instant>,
}

/// A network interface.
#[derive(Debug, Clone)]
pub(crate) struct Nic {
    id: String,
    name: String,
    location: String,
    ip_config: String,
    subnet: Value,
    private_ip: String,
    accelerated: bool,
    /// Id of the VM it is attached to.
    vm: Option<String>,
}

/// A managed disk.
#[derive(Debug, Clone)]
pub(crate) struct Disk {
    id: String,
    name: String,
    location: String,
    sku: String,
    size_gb: u64,
    zones: Value,
    image: Value,
    time_created: SystemTime,
    unique_id: String,
    /// Id of the VM it is attached to.
    vm: Option<String>,
}

/// Whether `version` is served for `path`: any for Microsoft.Network, the disk API version (or
/// the compute one) for disks, the compute one elsewhere.
pub(super) fn api_version_ok(path: &str, version: &str) -> bool {
    let p = path.to_ascii_lowercase();
    if p.contains("/providers/microsoft.network/") {
        return !version.is_empty();
    }
    if p.contains("/providers/microsoft.compute/disks") {
        return version == DISK_API_VERSION || version == API_VERSION;
    }
    version == API_VERSION
}

/// Serves the VM, NIC and disk paths; `None` for any other path.
pub(super) fn route(emu: &Emulator, cloud: &mut Cloud, call: &Call, seg: &[&str]) -> Option<Answer> {
    if seg.len() < 5 || !eq(seg[0], "subscriptions") {
        return None;
    }
    let sub = seg[1];
    if seg.len() == 5 && eq(seg[2], "providers") && eq(seg[3], "Microsoft.Compute") && eq(seg[4], "virtualMachines") {
        return Some(match call.method {
            Method::GET => list(emu, cloud, call, &format!("/subscriptions/{sub}/").to_ascii_lowercase()),
            ref m => method_not_allowed(m),
        });
    }
    if seg.len() < 7 || !eq(seg[2], "resourceGroups") || !eq(seg[4], "providers") {
        return None;
    }
    let rg = seg[3];
    let (ns, ty, rest) = (seg[5], seg[6], &seg[7..]);
    let m = call.method.as_str();
    let at = |name: &str, ns: &str, ty: &str| Names {
        sub: sub.to_string(),
        rg: rg.to_string(),
        name: name.to_string(),
        ty: format!("{ns}/{ty}"),
    };
    let prefix = |ns: &str, ty: &str| {
        format!("/subscriptions/{sub}/resourceGroups/{rg}/providers/{ns}/{ty}/").to_ascii_lowercase()
    };
    if eq(ns, "Microsoft.Compute") && eq(ty, "virtualMachines") {
        let vm = |n: &str| at(n, "Microsoft.Compute", "virtualMachines");
        return Some(match (m, rest) {
            ("GET", []) => list(emu, cloud, call, &prefix("Microsoft.Compute", "virtualMachines")),
            ("GET", [name]) => get(cloud, call, &vm(name), false),
            ("GET", [name, iv]) if eq(iv, "instanceView") => get(cloud, call, &vm(name), true),
            ("PUT", [name]) => put(emu, cloud, call, &vm(name), false),
            ("PATCH", [name]) => put(emu, cloud, call, &vm(name), true),
            ("DELETE", [name]) => delete(emu, cloud, call, &vm(name)),
            ("POST", [name, action]) if eq(action, "simulateEviction") => simulate_eviction(emu, cloud, &vm(name)),
            ("POST", [name, action]) if eq(action, "deallocate") => stop(emu, cloud, call, &vm(name), true),
            ("POST", [name, action]) if eq(action, "powerOff") => stop(emu, cloud, call, &vm(name), false),
            _ => unserved(call),
        });
    }
    if eq(ns, "Microsoft.Network") && eq(ty, "networkInterfaces") {
        let nic = |n: &str| at(n, "Microsoft.Network", "networkInterfaces");
        return Some(match (m, rest) {
            ("GET", []) => {
                let p = prefix("Microsoft.Network", "networkInterfaces");
                let value: Vec<Value> =
                    cloud.nics.iter().filter(|(k, _)| k.starts_with(&p)).map(|(_, n)| nic_view(n)).collect();
                Answer::json(StatusCode::OK, json!({ "value": value }))
            }
            ("GET", [name]) => match cloud.nics.get(&nic(name).key()) {
                Some(n) => Answer::json(StatusCode::OK, nic_view(n)),
                None => nic(name).not_found(),
            },
            ("DELETE", [name]) => {
                let key = nic(name).key();
                match cloud.nics.get(&key) {
                    None => Answer::empty(StatusCode::NO_CONTENT),
                    Some(n) if n.vm.is_some() => nic_in_use(n),
                    Some(_) => {
                        cloud.nics.remove(&key);
                        Answer::empty(StatusCode::OK)
                    }
                }
            }
            _ => unserved(call),
        });
    }
    if eq(ns, "Microsoft.Compute") && eq(ty, "disks") {
        let disk = |n: &str| at(n, "Microsoft.Compute", "disks");
        return Some(match (m, rest) {
            ("GET", []) => {
                let p = prefix("Microsoft.Compute", "disks");
                let value: Vec<Value> =
                    cloud.disks.iter().filter(|(k, _)| k.starts_with(&p)).map(|(_, d)| disk_view(d)).collect();
                Answer::json(StatusCode::OK, json!({ "value": value }))
            }
            ("GET", [name]) => match cloud.disks.get(&disk(name).key()) {
                Some(d) => Answer::json(StatusCode::OK, disk_view(d)),
                None => disk(name).not_found(),
            },
            ("DELETE", [name]) => {
                let key = disk(name).key();
                match cloud.disks.get(&key) {
                    None => Answer::empty(StatusCode::NO_CONTENT),
                    Some(d) if d.vm.is_some() => Answer::error(
                        StatusCode::CONFLICT,
                        "OperationNotAllowed",
                        format!("Disk {} is attached to VM {}.", d.name, d.vm.as_deref().unwrap_or_default()),
                    ),
                    Some(_) => {
                        cloud.disks.remove(&key);
                        Answer::empty(StatusCode::OK)
                    }
                }
            }
            _ => unserved(call),
        });
    }
    None
}

/// Where a resource lives.
struct Names {
    sub: String,
    rg: String,
    name: String,
    /// `Namespace/type`.
    ty: String,
}

impl Names {
    fn id(&self) -> String {
        format!("/subscriptions/{}/resourceGroups/{}/providers/{}/{}", self.sub, self.rg, self.ty, self.name)
    }

    fn key(&self) -> String {
        self.id().to_ascii_lowercase()
    }

    fn sibling(&self, ty: &str, name: &str) -> Names {
        Names { sub: self.sub.clone(), rg: self.rg.clone(), name: name.to_string(), ty: ty.to_string() }
    }

    fn not_found(&self) -> Answer {
        Answer::error(
            StatusCode::NOT_FOUND,
            "ResourceNotFound",
            format!("The Resource '{}/{}' under resource group '{}' was not found.", self.ty, self.name, self.rg),
        )
    }
}

fn unserved(call: &Call) -> Answer {
    Answer::error(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("The emulator does not serve {} {}", call.method, call.path),
    )
}

fn nic_in_use(n: &Nic) -> Answer {
    Answer::error(
        StatusCode::BAD_REQUEST,
        "NicInUse",
        format!(
            "Network Interface {} is used by existing resource {}. In order to delete the network interface, \
             it must be dissociated from the resource.",
            n.id,
            n.vm.as_deref().unwrap_or_default()
        ),
    )
}

fn bad(code: &str, message: impl Into<String>, target: &str) -> Answer {
    Answer::error_with_target(StatusCode::BAD_REQUEST, code, message, Some(target))
}

/// The request body without the read-only properties a client may send back.
fn strip(body: &Value) -> Value {
    let mut b = body.clone();
    if let Some(o) = b.as_object_mut() {
        for k in ["id", "name", "type", "etag", "resources"] {
            o.remove(k);
        }
        if let Some(p) = o.get_mut("properties").and_then(Value::as_object_mut) {
            for k in ["provisioningState", "vmId", "timeCreated", "instanceView"] {
                p.remove(k);
            }
        }
    }
    b
}

fn validate(body: &Value) -> Option<Answer> {
    if let Some(a) = check_body(body, body.is_object() && body["properties"].is_object()) {
        return Some(a);
    }
    let p = &body["properties"];
    let size = p["hardwareProfile"]["vmSize"].as_str().unwrap_or("");
    if !size.starts_with("Standard_") && !size.starts_with("Basic_") {
        return Some(bad(
            "InvalidParameter",
            format!("The value '{size}' provided for the VM size is not valid. Use a size such as Standard_D2s_v5."),
            "hardwareProfile.vmSize",
        ));
    }
    if let Some(a) = validate_priority(p) {
        return Some(a);
    }
    let storage = &p["storageProfile"];
    if !storage["imageReference"].is_object() {
        return Some(bad(
            "InvalidParameter",
            "Required parameter 'imageReference' is missing (null).",
            "storageProfile.imageReference",
        ));
    }
    if !storage["osDisk"].is_null() && !storage["osDisk"].is_object() {
        return Some(bad("InvalidParameter", "The value of parameter 'osDisk' is invalid.", "storageProfile.osDisk"));
    }
    if storage["imageReference"]["publisher"].as_str().is_some_and(|x| x.eq_ignore_ascii_case("NoSuchPublisher")) {
        return Some(Answer::error(
            StatusCode::NOT_FOUND,
            "PlatformImageNotFound",
            "The platform image 'NoSuchPublisher' is not available.",
        ));
    }
    let net = &p["networkProfile"];
    let configs = net["networkInterfaceConfigurations"].as_array().filter(|a| !a.is_empty());
    let refs = net["networkInterfaces"].as_array().filter(|a| !a.is_empty());
    match (configs, refs) {
        (None, None) => {
            return Some(bad(
                "InvalidParameter",
                "Required parameter 'networkProfile' is missing (null): give networkInterfaces or \
                 networkInterfaceConfigurations.",
                "networkProfile",
            ))
        }
        (Some(c), _) => {
            if net["networkApiVersion"].as_str().is_none_or(str::is_empty) {
                return Some(bad(
                    "InvalidParameter",
                    "networkApiVersion must be specified when networkInterfaceConfigurations are specified.",
                    "networkProfile.networkApiVersion",
                ));
            }
            if c.iter().any(|c| c["name"].as_str().is_none_or(str::is_empty)) {
                return Some(bad(
                    "InvalidParameter",
                    "Required parameter 'name' is missing (null).",
                    "networkProfile.networkInterfaceConfigurations.name",
                ));
            }
        }
        (None, Some(r)) => {
            if r.iter().any(|r| r["id"].as_str().is_none()) {
                return Some(bad(
                    "InvalidParameter",
                    "Required parameter 'id' is missing (null).",
                    "networkProfile.networkInterfaces.id",
                ));
            }
        }
    }
    None
}

/// `priority`, `evictionPolicy` and `billingProfile.maxPrice`, as ARM checks them.
fn validate_priority(p: &Value) -> Option<Answer> {
    let priority = p["priority"].as_str().unwrap_or("Regular");
    if !["Regular", "Spot", "Low"].iter().any(|k| eq(k, priority)) {
        return Some(bad(
            "InvalidParameter",
            format!("The value '{priority}' of parameter 'priority' is not valid. Allowed values: Regular, Spot."),
            "priority",
        ));
    }
    let spot = eq(priority, "Spot") || eq(priority, "Low");
    if let Some(policy) = p.get("evictionPolicy").filter(|v| !v.is_null()) {
        if !spot {
            return Some(bad(
                "EvictionPolicyCanBeSetOnlyOnAzureSpotVirtualMachines",
                "Eviction policy can be set only on Azure Spot Virtual Machines.",
                "evictionPolicy",
            ));
        }
        let policy = policy.as_str().unwrap_or_default();
        if !eq(policy, "Deallocate") && !eq(policy, "Delete") {
            return Some(bad(
                "InvalidParameter",
                format!("The value '{policy}' of parameter 'evictionPolicy' is not valid. Allowed values: Deallocate, Delete."),
                "evictionPolicy",
            ));
        }
    }
    if let Some(max) = p["billingProfile"].get("maxPrice").filter(|v| !v.is_null()) {
        if !spot {
            return Some(bad(
                "InvalidParameter",
                "Max price can be set only on Azure Spot Virtual Machines.",
                "billingProfile.maxPrice",
            ));
        }
        let ok = max.as_f64().is_some_and(|m| m == -1.0 || m > 0.0);
        if !ok {
            return Some(bad(
                "InvalidParameter",
                format!("The value '{max}' of parameter 'billingProfile.maxPrice' is not valid: give -1 or a price above 0."),
                "billingProfile.maxPrice",
            ));
        }
    }
    None
}

/// Whether the VM was created with Spot priority (`Low` is the legacy name).
fn is_spot(vm: &VirtualMachine) -> bool {
    vm.body["properties"]["priority"].as_str().is_some_and(|p| eq(p, "Spot") || eq(p, "Low"))
}

/// The VM's eviction policy: ARM's default for Spot VMs is `Deallocate`.
fn eviction_policy(vm: &VirtualMachine) -> &str {
    match vm.body["properties"]["evictionPolicy"].as_str() {
        Some(p) if eq(p, "Delete") => "Delete",
        _ => "Deallocate",
    }
}

/// `POST …/simulateEviction`: 204, and the Spot VM is evicted `Config::eviction_delay` later
/// (deallocated or deleted by its eviction policy). Not Spot: 409 `OperationNotAllowed`.
fn simulate_eviction(emu: &Emulator, cloud: &mut Cloud, at: &Names) -> Answer {
    let key = at.key();
    let Some(vm) = cloud.vms.get_mut(&key) else { return at.not_found() };
    if !is_spot(vm) {
        return Answer::error(
            StatusCode::CONFLICT,
            "OperationNotAllowed",
            format!("Simulate eviction is supported only for Azure Spot Virtual Machines; '{}' is not one.", vm.name),
        );
    }
    if vm.provisioning_state != "Succeeded" || vm.power_state != "running" {
        return Answer::error(
            StatusCode::CONFLICT,
            "OperationNotAllowed",
            format!(
                "Virtual Machine '{}' cannot be evicted: its provisioning state is {} and its power state {}.",
                vm.name, vm.provisioning_state, vm.power_state
            ),
        );
    }
    vm.evict_at = Some(Instant::now() + emu.config.eviction_delay);
    evict_due(cloud, Instant::now());
    Answer::empty(StatusCode::NO_CONTENT)
}

/// Evicts the Spot VMs whose simulated eviction is due: `Deallocate` leaves them deallocated,
/// `Delete` removes them (their NICs and disks by their delete options).
pub(super) fn evict_due(cloud: &mut Cloud, now: Instant) {
    let due: Vec<String> =
        cloud.vms.iter().filter(|(_, vm)| vm.evict_at.is_some_and(|t| t <= now)).map(|(k, _)| k.clone()).collect();
    for key in due {
        let delete = match cloud.vms.get_mut(&key) {
            Some(vm) => {
                vm.evict_at = None;
                eviction_policy(vm) == "Delete"
            }
            None => continue,
        };
        if delete {
            remove_vm(cloud, &key);
        } else if let Some(vm) = cloud.vms.get_mut(&key) {
            vm.power_state = "deallocated".into();
            vm.state_time = SystemTime::now();
        }
    }
}

/// `POST …/deallocate` / `…/powerOff`: 202 with the operation headers; the VM ends
/// `deallocated` / `stopped`, `Succeeded`.
fn stop(emu: &Emulator, cloud: &mut Cloud, call: &Call, at: &Names, deallocate: bool) -> Answer {
    let key = at.key();
    let Some(vm) = cloud.vms.get(&key).cloned() else { return at.not_found() };
    if vm.op.is_some() || vm.provisioning_state == "Deleting" {
        return conflict(&vm, &call.method);
    }
    let kind = OpKind::StopVm { deallocate };
    let op_id = start_op(emu, cloud, call, &vm.subscription, &vm.location, &key, kind, emu.config.delete_duration);
    if let Some(v) = cloud.vms.get_mut(&key) {
        v.provisioning_state = "Updating".into();
        v.power_state = if deallocate { "deallocating" } else { "stopping" }.into();
        v.op = Some(op_id.clone());
    }
    accepted(emu, call, cloud, &op_id)
}

fn delete_option(v: &Value) -> bool {
    v.as_str().is_some_and(|d| d.eq_ignore_ascii_case("Delete"))
}

/// The first property that differs between two VM bodies, other than the ones ARM updates in
/// place (`tags`, `properties.hardwareProfile.vmSize`).
fn first_change(old: &Value, new: &Value, path: &str) -> Option<String> {
    const IN_PLACE: [&str; 3] = ["tags", "location", "properties.hardwareProfile.vmSize"];
    if IN_PLACE.contains(&path) {
        return None;
    }
    match (old, new) {
        (Value::Object(a), Value::Object(b)) => {
            let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            keys.into_iter().find_map(|k| {
                let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                first_change(a.get(k).unwrap_or(&Value::Null), b.get(k).unwrap_or(&Value::Null), &p)
            })
        }
        (a, b) if a == b => None,
        _ => Some(path.strip_prefix("properties.").unwrap_or(path).to_string()),
    }
}

fn put(emu: &Emulator, cloud: &mut Cloud, call: &Call, at: &Names, patch: bool) -> Answer {
    let key = at.key();
    let existing = cloud.vms.get(&key).cloned();
    let desired = match (&existing, patch) {
        (None, true) => return at.not_found(),
        (Some(vm), true) => {
            let mut b = vm.body.clone();
            let change = strip(&call.body);
            merge(&mut b, &change);
            if let Some(tags) = change.get("tags") {
                b["tags"] = tags.clone();
            }
            b
        }
        (_, false) => strip(&call.body),
    };
    if let Some(a) = validate(&desired) {
        return a;
    }
    let location = match required_location(&desired) {
        Ok(l) => l,
        Err(a) => return a,
    };
    match existing {
        Some(vm) => update(emu, cloud, call, vm, desired, &location),
        None => create(emu, cloud, call, at, desired, location),
    }
}

fn conflict(vm: &VirtualMachine, method: &Method) -> Answer {
    Answer::error(
        StatusCode::CONFLICT,
        "Conflict",
        format!(
            "Operation '{method}' is not allowed on VM '{}' since operation '{}' is in progress.",
            vm.name,
            vm.op.as_deref().unwrap_or("Delete")
        ),
    )
}

/// A 200/201 with the VM and the operation's three headers.
fn started(emu: &Emulator, call: &Call, cloud: &Cloud, status: StatusCode, key: &str, op_id: &str) -> Answer {
    let body = cloud.vms.get(key).map(|vm| view(cloud, vm, false)).unwrap_or(Value::Null);
    let mut a = Answer::json(status, body);
    if let Some(op) = cloud.ops.get(op_id) {
        let (async_url, location) = op_urls(emu, call, op);
        a = a
            .header("azure-asyncoperation", async_url)
            .header("location", location)
            .header("retry-after", emu.config.retry_after_secs.to_string());
    }
    a
}

fn update(
    emu: &Emulator,
    cloud: &mut Cloud,
    call: &Call,
    vm: VirtualMachine,
    desired: Value,
    location: &str,
) -> Answer {
    let key = vm.id.to_ascii_lowercase();
    if vm.provisioning_state == "Deleting" {
        return conflict(&vm, &call.method);
    }
    if let Some(op) = vm.op.as_ref().and_then(|id| cloud.ops.get(id)) {
        // A retried PUT of what is being applied joins the running operation.
        if op.kind != OpKind::DeleteVm && desired == vm.body {
            let id = op.id.clone();
            return started(emu, call, cloud, StatusCode::OK, &key, &id);
        }
        return conflict(&vm, &call.method);
    }
    if !location.eq_ignore_ascii_case(&vm.location) {
        return Answer::error(
            StatusCode::BAD_REQUEST,
            "InvalidResourceLocation",
            format!(
                "The resource '{}' already exists in location '{}'. A resource with the same name cannot be \
                 created in location '{location}'.",
                vm.name, vm.location
            ),
        );
    }
    if let Some(path) = first_change(&vm.body, &desired, "") {
        return Answer::error_with_target(
            StatusCode::CONFLICT,
            "PropertyChangeNotAllowed",
            format!("Changing property '{path}' is not allowed."),
            Some(&path),
        );
    }
    // A VM whose create failed has no place yet: applying it again allocates it, in its zone.
    let unallocated = vm.provisioning_state == "Failed" && vm.power_state != "running";
    let size = desired["properties"]["hardwareProfile"]["vmSize"].as_str().unwrap_or_default();
    let no_capacity = unallocated
        && zone_refusal(cloud, &zones_of(&desired), size).is_some_and(|r| r.refuse == ZoneRefusal::Capacity);
    let unchanged = desired == vm.body && !no_capacity;
    let duration = if unchanged { Duration::ZERO } else { emu.config.operation_duration };
    let op_id = start_op(emu, cloud, call, &vm.subscription, &vm.location, &key, OpKind::UpdateVm, duration);
    if no_capacity {
        refuse_allocation(cloud, &op_id);
    }
    if let Some(v) = cloud.vms.get_mut(&key) {
        v.body = desired;
        v.provisioning_state = "Updating".into();
        v.op = Some(op_id.clone());
    }
    if unchanged {
        // Nothing to do: the operation is over before the answer leaves.
        finish_op(cloud, &op_id);
    }
    started(emu, call, cloud, StatusCode::OK, &key, &op_id)
}

/// The `n`-th private IP address handed out: `10.0.0.4` and up (ARM keeps .0–.3 of a subnet).
fn private_ip(n: u32) -> String {
    format!("10.0.{}.{}", n / 250, 4 + n % 250)
}

/// What a create will attach, checked before anything changes.
struct Plan {
    /// New NICs.
    new_nics: Vec<Nic>,
    /// NICs to attach (new ones included), in order.
    nics: Vec<Attachment>,
    disk: Disk,
    disk_delete: bool,
}

fn plan(cloud: &Cloud, at: &Names, desired: &Value, location: &str) -> Result<Plan, Answer> {
    let vm_id = at.id();
    let net = &desired["properties"]["networkProfile"];
    let mut new_nics = Vec::new();
    let mut nics = Vec::new();
    for (i, c) in net["networkInterfaceConfigurations"].as_array().into_iter().flatten().enumerate() {
        let names = at.sibling("Microsoft.Network/networkInterfaces", &format!("{}-nic-{i}", at.name));
        let key = names.key();
        if let Some(n) = cloud.nics.get(&key) {
            if n.vm.is_some() {
                return Err(nic_in_use(n));
            }
        }
        let ip = &c["properties"]["ipConfigurations"][0];
        let primary = c["properties"]["primary"].as_bool().unwrap_or(i == 0);
        new_nics.push(Nic {
            id: names.id(),
            name: names.name.clone(),
            location: location.to_string(),
            ip_config: ip["name"].as_str().unwrap_or("ipconfig1").to_string(),
            subnet: ip["properties"]["subnet"].clone(),
            private_ip: private_ip(cloud.next_ip + new_nics.len() as u32),
            accelerated: c["properties"]["enableAcceleratedNetworking"].as_bool().unwrap_or(false),
            vm: Some(vm_id.clone()),
        });
        nics.push(Attachment { key, delete: delete_option(&c["properties"]["deleteOption"]), primary });
    }
    for (i, r) in net["networkInterfaces"].as_array().into_iter().flatten().enumerate() {
        let id = r["id"].as_str().unwrap_or_default();
        let key = id.to_ascii_lowercase();
        match cloud.nics.get(&key) {
            None => {
                return Err(bad(
                    "InvalidResourceReference",
                    format!("Resource {id} referenced by resource {vm_id} was not found."),
                    "networkProfile.networkInterfaces.id",
                ))
            }
            Some(n) if n.vm.is_some() => return Err(nic_in_use(n)),
            Some(_) => {}
        }
        let primary = r["properties"]["primary"].as_bool().unwrap_or(nics.is_empty() && i == 0);
        nics.push(Attachment { key, delete: delete_option(&r["properties"]["deleteOption"]), primary });
    }
    let storage = &desired["properties"]["storageProfile"];
    let os = &storage["osDisk"];
    let disk_name = os["name"]
        .as_str()
        .map(str::to_string)
        .unwrap_or_else(|| format!("{}_OsDisk_1_{}", at.name, uuid::Uuid::new_v4().simple()));
    let names = at.sibling("Microsoft.Compute/disks", &disk_name);
    if cloud.disks.contains_key(&names.key()) {
        return Err(Answer::error_with_target(
            StatusCode::CONFLICT,
            "ConflictingUserInput",
            format!(
                "Disk {disk_name} already exists in resource group {}. Only CreateOption.Attach is supported.",
                at.rg
            ),
            Some("storageProfile.osDisk.name"),
        ));
    }
    let disk = Disk {
        id: names.id(),
        name: disk_name,
        location: location.to_string(),
        sku: os["managedDisk"]["storageAccountType"].as_str().unwrap_or("Premium_LRS").to_string(),
        size_gb: os["diskSizeGB"].as_u64().unwrap_or(30),
        zones: desired.get("zones").cloned().unwrap_or(Value::Null),
        image: storage["imageReference"].clone(),
        time_created: SystemTime::now(),
        unique_id: uuid::Uuid::new_v4().to_string(),
        vm: Some(vm_id),
    };
    Ok(Plan { new_nics, nics, disk, disk_delete: delete_option(&os["deleteOption"]) })
}

fn create(emu: &Emulator, cloud: &mut Cloud, call: &Call, at: &Names, desired: Value, location: String) -> Answer {
    let scale_set = match desired["properties"]["virtualMachineScaleSet"]["id"].as_str() {
        None => None,
        Some(ss) => {
            let k = ss.to_ascii_lowercase();
            match cloud.scale_sets.get(&k) {
                None => {
                    return bad(
                        "InvalidParameter",
                        format!(
                            "The Virtual Machine Scale Set '{ss}' referenced by Virtual Machine '{}' was not found.",
                            at.name
                        ),
                        "properties.virtualMachineScaleSet.id",
                    )
                }
                Some(s) if !super::is_flexible(&s.body) => {
                    return Answer::error_with_target(
                        StatusCode::CONFLICT,
                        "OperationNotAllowed",
                        format!(
                            "Virtual Machine '{}' cannot be added to Virtual Machine Scale Set '{}': only scale sets \
                             with orchestration mode 'Flexible' accept virtual machines, and its mode is 'Uniform'.",
                            at.name, s.name
                        ),
                        Some("properties.virtualMachineScaleSet.id"),
                    )
                }
                Some(s) if s.provisioning_state == "Deleting" => {
                    return Answer::error(
                        StatusCode::CONFLICT,
                        "Conflict",
                        format!("Virtual Machine Scale Set '{}' is being deleted.", s.name),
                    )
                }
                Some(_) => Some(k),
            }
        }
    };
    if let Some(max) = emu.config.max_instances {
        let used = cloud.scale_sets.values().map(|s| s.vms.len() as u64).sum::<u64>() + cloud.vms.len() as u64;
        if used + 1 > max {
            return Answer::error(
                StatusCode::CONFLICT,
                "OperationNotAllowed",
                format!(
                    "Operation could not be completed as it results in exceeding approved Total Regional Cores quota. \
                     Location: {location}, Current Limit: {max} instances, Current Usage: {used}, Additional Required: 1."
                ),
            );
        }
    }
    let size = desired["properties"]["hardwareProfile"]["vmSize"].as_str().unwrap_or_default();
    let refusal = zone_refusal(cloud, &zones_of(&desired), size);
    if let Some(r) = refusal.as_ref().filter(|r| r.refuse == ZoneRefusal::Sku) {
        return sku_not_available(&at.id(), &location, &r.zone, &at.sub);
    }
    let plan = match plan(cloud, at, &desired, &location) {
        Ok(p) => p,
        Err(a) => return a,
    };
    let id = at.id();
    let key = at.key();
    cloud.next_ip += plan.new_nics.len() as u32;
    for n in plan.new_nics {
        cloud.nics.insert(n.id.to_ascii_lowercase(), n);
    }
    for a in &plan.nics {
        if let Some(n) = cloud.nics.get_mut(&a.key) {
            n.vm = Some(id.clone());
        }
    }
    let disk_key = plan.disk.id.to_ascii_lowercase();
    cloud.disks.insert(disk_key.clone(), plan.disk);
    let op_id = start_op(emu, cloud, call, &at.sub, &location, &key, OpKind::CreateVm, emu.config.operation_duration);
    if refusal.is_some() {
        // The only other refusal, Sku, answered above.
        refuse_allocation(cloud, &op_id);
    }
    cloud.vms.insert(
        key.clone(),
        VirtualMachine {
            id,
            name: at.name.clone(),
            subscription: at.sub.clone(),
            location,
            body: desired,
            provisioning_state: "Creating".into(),
            power_state: "starting".into(),
            vm_id: uuid::Uuid::new_v4().to_string(),
            time_created: SystemTime::now(),
            scale_set,
            nics: plan.nics,
            os_disk: Some(Attachment { key: disk_key, delete: plan.disk_delete, primary: true }),
            op: Some(op_id.clone()),
            error: None,
            state_time: SystemTime::now(),
            evict_at: None,
        },
    );
    started(emu, call, cloud, StatusCode::CREATED, &key, &op_id)
}

fn delete(emu: &Emulator, cloud: &mut Cloud, call: &Call, at: &Names) -> Answer {
    let key = at.key();
    let Some(vm) = cloud.vms.get(&key).cloned() else { return Answer::empty(StatusCode::NO_CONTENT) };
    if let Some(op) = vm.op.as_ref().and_then(|id| cloud.ops.get(id)) {
        if op.kind == OpKind::DeleteVm {
            let id = op.id.clone();
            return accepted(emu, call, cloud, &id);
        }
        return conflict(&vm, &call.method);
    }
    let op_id =
        start_op(emu, cloud, call, &vm.subscription, &vm.location, &key, OpKind::DeleteVm, emu.config.delete_duration);
    if let Some(v) = cloud.vms.get_mut(&key) {
        v.provisioning_state = "Deleting".into();
        v.power_state = "stopping".into();
        v.op = Some(op_id.clone());
    }
    accepted(emu, call, cloud, &op_id)
}

fn get(cloud: &Cloud, call: &Call, at: &Names, instance_view_only: bool) -> Answer {
    let Some(vm) = cloud.vms.get(&at.key()) else { return at.not_found() };
    if instance_view_only {
        return Answer::json(StatusCode::OK, instance_view(vm));
    }
    let expand = call.query.get("$expand").is_some_and(|e| e.eq_ignore_ascii_case("instanceView"));
    Answer::json(StatusCode::OK, view(cloud, vm, expand))
}

/// `virtualMachineScaleSet/id eq '<id>'` → the id.
fn parse_filter(f: &str) -> Option<&str> {
    let f = f.trim();
    let (field, rest) = f.split_once(char::is_whitespace)?;
    let (op, value) = rest.trim_start().split_once(char::is_whitespace)?;
    if !field.eq_ignore_ascii_case("virtualMachineScaleSet/id") || !op.eq_ignore_ascii_case("eq") {
        return None;
    }
    value.trim().strip_prefix('\'')?.strip_suffix('\'')
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn list(emu: &Emulator, cloud: &Cloud, call: &Call, prefix: &str) -> Answer {
    let expand = call.query.get("$expand").is_some_and(|e| e.eq_ignore_ascii_case("instanceView"));
    let status_only = call.query.get("statusOnly").is_some_and(|v| v.eq_ignore_ascii_case("true"));
    let filter = match call.query.get("$filter") {
        None => None,
        Some(f) => match parse_filter(f) {
            Some(id) => Some(id.to_ascii_lowercase()),
            None => {
                return bad(
                    "InvalidParameter",
                    format!("The $filter '{f}' is not supported; use virtualMachineScaleSet/id eq '<scale set id>'."),
                    "$filter",
                )
            }
        },
    };
    let all: Vec<&VirtualMachine> = cloud
        .vms
        .iter()
        .filter(|(k, _)| k.starts_with(prefix))
        .map(|(_, vm)| vm)
        .filter(|vm| filter.as_deref().is_none_or(|f| vm.scale_set.as_deref() == Some(f)))
        .collect();
    let skip: usize = call.query.get("$skiptoken").and_then(|t| t.parse().ok()).unwrap_or(0);
    let page = emu.config.page_size.max(1);
    let value: Vec<Value> = all.iter().skip(skip).take(page).map(|vm| view(cloud, vm, expand || status_only)).collect();
    let mut body = json!({ "value": value });
    if skip + page < all.len() {
        let mut link = format!("{}{}?api-version={API_VERSION}", call.base, call.path);
        if expand {
            link.push_str("&%24expand=instanceView");
        }
        if status_only {
            link.push_str("&statusOnly=true");
        }
        if let Some(f) = call.query.get("$filter") {
            link.push_str(&format!("&%24filter={}", percent_encode(f)));
        }
        link.push_str(&format!("&%24skiptoken={}", skip + page));
        body["nextLink"] = json!(link);
    }
    Answer::json(StatusCode::OK, body)
}

fn instance_view(vm: &VirtualMachine) -> Value {
    let mut iv = instance_view_of(&vm.provisioning_state, &vm.power_state);
    iv["statuses"][0]["time"] = json!(rfc3339(vm.state_time));
    if let (Some((code, message)), "Failed") = (&vm.error, vm.provisioning_state.as_str()) {
        // ARM names the failure in the provisioning status: `ProvisioningState/failed/{code}`.
        iv["statuses"][0]["code"] = json!(format!("ProvisioningState/failed/{code}"));
        iv["statuses"][0]["message"] = json!(message);
    }
    if let Some(name) = vm.body["properties"]["osProfile"]["computerName"].as_str() {
        iv["computerName"] = json!(name);
    }
    iv
}

/// The VM as ARM shows it: the stored body with the read-only properties overlaid and secrets
/// (`adminPassword`, `customData`) left out.
pub(super) fn view(cloud: &Cloud, vm: &VirtualMachine, expand: bool) -> Value {
    let mut v = vm.body.clone();
    v["id"] = json!(vm.id);
    v["name"] = json!(vm.name);
    v["type"] = json!("Microsoft.Compute/virtualMachines");
    v["location"] = json!(vm.location);
    let p = &mut v["properties"];
    p["provisioningState"] = json!(vm.provisioning_state);
    p["vmId"] = json!(vm.vm_id);
    p["timeCreated"] = json!(rfc3339(vm.time_created));
    if is_spot(vm) && p["evictionPolicy"].is_null() {
        p["evictionPolicy"] = json!("Deallocate");
    }
    if let Some(os) = p.get_mut("osProfile").and_then(Value::as_object_mut) {
        os.remove("adminPassword");
        os.remove("customData");
    }
    if let (Some(a), Some(os)) = (&vm.os_disk, p.get_mut("storageProfile").and_then(Value::as_object_mut)) {
        let disk = os.entry("osDisk").or_insert_with(|| json!({}));
        if let (Some(d), Some(o)) = (cloud.disks.get(&a.key), disk.as_object_mut()) {
            o.insert("name".into(), json!(d.name));
            o.entry("createOption").or_insert_with(|| json!("FromImage"));
            o.entry("osType").or_insert_with(|| json!("Linux"));
            o.insert("diskSizeGB".into(), json!(d.size_gb));
            o.insert("deleteOption".into(), json!(if a.delete { "Delete" } else { "Detach" }));
            o.insert("managedDisk".into(), json!({"id": d.id, "storageAccountType": d.sku}));
        }
    }
    let nics: Vec<Value> = vm
        .nics
        .iter()
        .filter_map(|a| cloud.nics.get(&a.key).map(|n| (a, n)))
        .map(|(a, n)| {
            json!({"id": n.id, "properties": {"primary": a.primary, "deleteOption": if a.delete { "Delete" } else { "Detach" }}})
        })
        .collect();
    if let Some(net) = p.get_mut("networkProfile").and_then(Value::as_object_mut) {
        net.insert("networkInterfaces".into(), json!(nics));
    }
    if expand {
        p["instanceView"] = instance_view(vm);
    }
    v
}

fn nic_view(n: &Nic) -> Value {
    let mut v = json!({
        "id": n.id,
        "name": n.name,
        "type": "Microsoft.Network/networkInterfaces",
        "location": n.location,
        "properties": {
            "provisioningState": "Succeeded",
            "enableAcceleratedNetworking": n.accelerated,
            "ipConfigurations": [{
                "id": format!("{}/ipConfigurations/{}", n.id, n.ip_config),
                "name": n.ip_config,
                "properties": {
                    "provisioningState": "Succeeded",
                    "privateIPAddress": n.private_ip,
                    "privateIPAllocationMethod": "Dynamic",
                    "privateIPAddressVersion": "IPv4",
                    "primary": true,
                    "subnet": n.subnet,
                },
            }],
        },
    });
    if let Some(vm) = &n.vm {
        v["properties"]["virtualMachine"] = json!({ "id": vm });
    }
    v
}

fn disk_view(d: &Disk) -> Value {
    let tier = d.sku.split('_').next().unwrap_or("Premium");
    let mut v = json!({
        "id": d.id,
        "name": d.name,
        "type": "Microsoft.Compute/disks",
        "location": d.location,
        "sku": {"name": d.sku, "tier": tier},
        "properties": {
            "osType": "Linux",
            "creationData": {"createOption": "FromImage", "imageReference": d.image},
            "diskSizeGB": d.size_gb,
            "provisioningState": "Succeeded",
            "diskState": if d.vm.is_some() { "Attached" } else { "Unattached" },
            "timeCreated": rfc3339(d.time_created),
            "uniqueId": d.unique_id,
        },
    });
    if let Some(vm) = &d.vm {
        v["managedBy"] = json!(vm);
    }
    if d.zones.is_array() {
        v["zones"] = d.zones.clone();
    }
    v
}

/// Ends a VM operation: `ok` says whether it succeeded.
pub(super) fn finish(cloud: &mut Cloud, op: &super::Op, ok: bool) {
    if op.kind == OpKind::DeleteVm && ok {
        remove_vm(cloud, &op.target);
        return;
    }
    let Some(vm) = cloud.vms.get_mut(&op.target) else { return };
    if vm.op.as_deref() == Some(op.id.as_str()) {
        vm.op = None;
    }
    vm.provisioning_state = if ok { "Succeeded" } else { "Failed" }.into();
    vm.error = (!ok).then(|| op.error.clone());
    vm.state_time = SystemTime::now();
    match (&op.kind, ok) {
        (OpKind::StopVm { deallocate }, true) => {
            vm.power_state = if *deallocate { "deallocated" } else { "stopped" }.into()
        }
        (OpKind::StopVm { .. }, false) => vm.power_state = "running".into(),
        (_, true) => vm.power_state = "running".into(),
        (OpKind::CreateVm, false) => vm.power_state = "stopped".into(),
        _ => {}
    }
}

/// Removes a VM; its NICs and OS disk go with it (`deleteOption: Delete`) or stay, detached.
fn remove_vm(cloud: &mut Cloud, key: &str) {
    let Some(vm) = cloud.vms.remove(key) else { return };
    for a in &vm.nics {
        if a.delete {
            cloud.nics.remove(&a.key);
        } else if let Some(n) = cloud.nics.get_mut(&a.key) {
            n.vm = None;
        }
    }
    if let Some(a) = &vm.os_disk {
        if a.delete {
            cloud.disks.remove(&a.key);
        } else if let Some(d) = cloud.disks.get_mut(&a.key) {
            d.vm = None;
        }
    }
}

/// VMs that joined the scale set with key `scale_set`.
pub(super) fn member_count(cloud: &Cloud, scale_set: &str) -> u64 {
    cloud.vms.values().filter(|vm| vm.scale_set.as_deref() == Some(scale_set)).count() as u64
}

/// Marks the members of a scale set being deleted.
pub(super) fn mark_members_deleting(cloud: &mut Cloud, scale_set: &str) {
    for vm in cloud.vms.values_mut().filter(|vm| vm.scale_set.as_deref() == Some(scale_set)) {
        vm.provisioning_state = "Deleting".into();
        vm.power_state = "stopping".into();
    }
}

/// Removes the members of a deleted scale set.
pub(super) fn remove_members(cloud: &mut Cloud, scale_set: &str) {
    let keys: Vec<String> =
        cloud.vms.iter().filter(|(_, vm)| vm.scale_set.as_deref() == Some(scale_set)).map(|(k, _)| k.clone()).collect();
    for k in keys {
        remove_vm(cloud, &k);
    }
}

/// `GET /_emulator/vms`: every VM with its scale set, states, NICs and OS disk.
pub(super) fn inventory(cloud: &Cloud) -> Value {
    let vms: Vec<Value> = cloud
        .vms
        .values()
        .map(|vm| {
            json!({
                "id": vm.id,
                "zones": vm.body.get("zones"),
                "scaleSet": vm.scale_set,
                "provisioningState": vm.provisioning_state,
                "powerState": vm.power_state,
                "priority": vm.body["properties"]["priority"].as_str().unwrap_or("Regular"),
                "evictionPolicy": is_spot(vm).then(|| eviction_policy(vm)),
                "operation": vm.op,
                "nics": vm.nics.iter().filter_map(|a| cloud.nics.get(&a.key).map(|n| n.id.clone())).collect::<Vec<_>>(),
                "osDisk": vm.os_disk.as_ref().and_then(|a| cloud.disks.get(&a.key).map(|d| d.id.clone())),
            })
        })
        .collect();
    json!(vms)
}

#[cfg(test)]
mod tests;
