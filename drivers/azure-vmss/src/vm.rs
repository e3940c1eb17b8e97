//! Machines as VMs: the VM body `CreateMachine` sends, the protocol view of a VM, and the tag
//! bookkeeping that makes a VM findable by machine name and updatable in place.
//!
//! Tags on every machine VM (Azure tag names may not hold `/`, so label keys use `:`):
//!
//! | tag | value |
//! |---|---|
//! | `machinedriver.dev:machine-name` | the machine name (what `ListMachines` looks for) |
//! | `machinedriver.dev:spec-hash` | hash of the provider spec the VM runs |
//! | `machinedriver.dev:spec-tags` | comma-separated names of the provider spec's `tags` (so an in-place update can drop a removed one without touching the owner labels) |
//! | each owner label, each spec tag | its value |

use std::collections::BTreeMap;
use std::time::SystemTime;

use azure_mgmt_compute::package_2024_07_01::models::VirtualMachine;
use base64::Engine;
use driver_sdk::{
    reason, Address, DriverError, InPlaceDisruption, Labels, Machine, MachineState, ResourceStatus, Secrets, UpdatePlan,
};
use serde_json::{json, Map, Value};

use crate::model::{label_name, tag_name, vm_template, ProviderSpec, VmTemplate, SPEC_HASH_TAG};
use crate::ResourceId;

/// Tag holding the machine name.
pub const NAME_TAG: &str = "machinedriver.dev:machine-name";
/// Secret key whose value, when set, is the VM's custom data: the controller's rendered boot
/// data (MachineClass `spec.userData`, else its Secret's `userData`, with the variables filled
/// in; machine-controller-manager's convention for cloud-init user data). It takes precedence
/// over the provider spec's `customData`.
pub const USER_DATA_KEY: &str = "userData";
/// ARM's limit on `osProfile.customData`: 65535 characters of base64 (so at most 49149 bytes of
/// data).
pub const MAX_CUSTOM_DATA_BASE64: usize = 65535;
/// Tag listing the provider spec's tag names.
pub const SPEC_TAGS_TAG: &str = "machinedriver.dev:spec-tags";

/// Provider-spec fields ARM changes on a running VM (tags, size); anything else needs a new VM.
pub const IN_PLACE_FIELDS: &[&str] = &["/vmSize", "/tags"];

/// The ARM path of a VM.
pub fn path(r: &ResourceId) -> String {
    format!(
        "/subscriptions/{}/resourceGroups/{}/providers/Microsoft.Compute/virtualMachines/{}",
        r.subscription, r.resource_group, r.name
    )
}

/// `azure://` + the VM's resource ID, as Cluster API providers write it.
pub fn provider_id(r: &ResourceId) -> String {
    crate::model::provider_id(&path(r))
}

/// The VM a provider ID names (`azure:///subscriptions/…/virtualMachines/{name}`).
pub fn parse_provider_id(provider_id: &str) -> Option<ResourceId> {
    let id = provider_id.strip_prefix("azure://")?;
    let seg: Vec<&str> = id.trim_start_matches('/').split('/').collect();
    match seg.as_slice() {
        [s, sub, r, rg, p, ns, ty, name]
            if s.eq_ignore_ascii_case("subscriptions")
                && r.eq_ignore_ascii_case("resourceGroups")
                && p.eq_ignore_ascii_case("providers")
                && ns.eq_ignore_ascii_case("Microsoft.Compute")
                && ty.eq_ignore_ascii_case("virtualMachines")
                && !name.is_empty() =>
        {
            Some(ResourceId { subscription: sub.to_string(), resource_group: rg.to_string(), name: name.to_string() })
        }
        _ => None,
    }
}

/// The resource ID of the scale set a machine joins: the spec's (`id`, or `name` in the VM's
/// resource group), else the sidecar's default name, else none (a standalone VM).
pub fn scale_set_id(spec: &ProviderSpec, vm: &ResourceId, default_name: Option<&str>) -> Option<String> {
    let by_name = |name: &str| {
        format!(
            "/subscriptions/{}/resourceGroups/{}/providers/Microsoft.Compute/virtualMachineScaleSets/{name}",
            vm.subscription, vm.resource_group
        )
    };
    match &spec.virtual_machine_scale_set {
        Some(r) => r.id.clone().or_else(|| r.name.as_deref().map(by_name)),
        None => default_name.map(by_name),
    }
}

/// The zone of a machine: one of the spec's zones, chosen by the machine name (stable across
/// retries, spread across machines).
pub fn zone_for(name: &str, zones: &[String]) -> Option<String> {
    if zones.is_empty() {
        return None;
    }
    // FNV-1a: tiny, stable across releases (unlike std's hasher).
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    zones.get((h % zones.len() as u64) as usize).cloned()
}

fn spec_tags(spec: &ProviderSpec, spec_hash: &str) -> Map<String, Value> {
    let mut tags: Map<String, Value> = spec.tags.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
    let names: Vec<&str> = spec.tags.keys().map(String::as_str).collect();
    tags.insert(SPEC_TAGS_TAG.into(), json!(names.join(",")));
    tags.insert(SPEC_HASH_TAG.into(), json!(spec_hash));
    tags
}

/// Every tag of a new machine VM.
pub fn tags_for(name: &str, spec: &ProviderSpec, spec_hash: &str, labels: &Labels) -> Map<String, Value> {
    let mut tags: Map<String, Value> = labels.iter().map(|(k, v)| (tag_name(k), json!(v))).collect();
    tags.extend(spec_tags(spec, spec_hash));
    tags.insert(NAME_TAG.into(), json!(name));
    tags
}

/// The tags after an in-place update to `spec`: the owner labels and the name stay, the old
/// spec's tags (as recorded in [`SPEC_TAGS_TAG`]) give way to the new spec's.
pub fn updated_tags(current: &BTreeMap<String, String>, spec: &ProviderSpec, spec_hash: &str) -> Map<String, Value> {
    let old: Vec<&str> =
        current.get(SPEC_TAGS_TAG).map(|s| s.split(',').filter(|k| !k.is_empty()).collect()).unwrap_or_default();
    let mut tags: Map<String, Value> =
        current.iter().filter(|(k, _)| !old.contains(&k.as_str())).map(|(k, v)| (k.clone(), json!(v))).collect();
    tags.extend(spec_tags(spec, spec_hash));
    tags
}

/// The custom data of a machine's VM: the `userData` secret when it is set (not empty), else the
/// provider spec's `customData`; none when neither is.
///
/// # Errors
/// INVALID_ARGUMENT when its base64 is longer than ARM takes ([`MAX_CUSTOM_DATA_BASE64`]):
/// `FIELD_INVALID` naming `secrets.userData`, or `INVALID_PROVIDER_SPEC` naming
/// `provider_spec.customData`. The message gives the sizes and the limit, never the content.
pub fn custom_data<'a>(spec: &'a ProviderSpec, secrets: &'a Secrets) -> Result<Option<&'a str>, DriverError> {
    let (field, name, data) = match secrets.get(USER_DATA_KEY).filter(|d| !d.is_empty()) {
        Some(d) => ("secrets.userData", "userData", d),
        None => match spec.custom_data.as_deref() {
            Some(d) => ("provider_spec.customData", "customData", d),
            None => return Ok(None),
        },
    };
    let encoded = data.len().div_ceil(3) * 4;
    if encoded <= MAX_CUSTOM_DATA_BASE64 {
        return Ok(Some(data));
    }
    let why = format!(
        "{name} is {} bytes, {encoded} characters in base64; ARM takes at most {MAX_CUSTOM_DATA_BASE64} characters \
         of base64 customData ({} bytes)",
        data.len(),
        MAX_CUSTOM_DATA_BASE64 / 4 * 3
    );
    let reason = if field.starts_with("secrets.") { reason::FIELD_INVALID } else { reason::INVALID_PROVIDER_SPEC };
    Err(DriverError::invalid_argument(reason, format!("{field}: {why}")).with_violation(field, why))
}

/// The VM body of a machine, checked against the `azure_mgmt_compute` model (so a typo in a
/// field name fails here, not at ARM).
///
/// # Errors
/// INVALID_ARGUMENT when the spec lacks what a VM needs (a subnet); INTERNAL when the body does
/// not fit the model (a driver bug).
pub fn body(
    vm: &ResourceId,
    spec: &ProviderSpec,
    tags: Map<String, Value>,
    scale_set: Option<&str>,
    custom_data: Option<&str>,
) -> Result<Value, DriverError> {
    let Some(subnet) = &spec.subnet_id else {
        return Err(DriverError::invalid_provider_spec(vec![driver_sdk::Violation::new(
            "provider_spec.subnetId",
            "required for machines: a VM needs a network interface",
        )]));
    };
    let name = &vm.name;
    let VmTemplate { admin, image, linux, mut os_disk } = vm_template(spec);
    let mut os_profile = json!({"computerName": name, "adminUsername": admin, "linuxConfiguration": linux});
    if let Some(data) = custom_data {
        os_profile["customData"] = json!(base64::engine::general_purpose::STANDARD.encode(data));
    }
    // deleteOption Delete: the NIC and the OS disk go with the VM, so a deleted machine leaks
    // nothing.
    os_disk["deleteOption"] = json!("Delete");
    let mut properties = json!({
        "hardwareProfile": {"vmSize": spec.vm_size},
        "osProfile": os_profile,
        "storageProfile": {"imageReference": image, "osDisk": os_disk},
        "networkProfile": {
            "networkApiVersion": "2020-11-01",
            "networkInterfaceConfigurations": [{
                "name": format!("{name}-nic"),
                "properties": {
                    "primary": true, "deleteOption": "Delete",
                    "ipConfigurations": [{"name": "ipconfig1", "properties": {"primary": true, "subnet": {"id": subnet}}}],
                },
            }],
        },
    });
    if let Some(id) = scale_set {
        properties["virtualMachineScaleSet"] = json!({"id": id});
    }
    for (k, v) in crate::model::spot_fields(spec).unwrap_or_default() {
        properties[k.as_str()] = v;
    }
    let mut body = json!({"location": spec.location, "tags": tags, "properties": properties});
    if let Some(zone) = zone_for(name, &spec.zones) {
        body["zones"] = json!([zone]);
    }
    let typed: VirtualMachine = serde_json::from_value(body)
        .map_err(|e| DriverError::internal("the VM body does not fit the VM model").with_source(e))?;
    serde_json::to_value(&typed).map_err(|e| DriverError::internal("serializing the VM").with_source(e))
}

/// The tags of a VM (as ARM returns it).
pub fn tags_of(vm: &Value) -> BTreeMap<String, String> {
    vm["tags"]
        .as_object()
        .map(|o| o.iter().filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string()))).collect())
        .unwrap_or_default()
}

/// The VM's provisioning state.
pub fn provisioning_state(vm: &Value) -> &str {
    vm["properties"]["provisioningState"].as_str().unwrap_or_default()
}

/// The first instance-view status code with `prefix` (e.g. `PowerState/`), lower-cased.
fn status_code(vm: &Value, prefix: &str) -> Option<String> {
    vm["properties"]["instanceView"]["statuses"]
        .as_array()?
        .iter()
        .filter_map(|s| s["code"].as_str())
        .find_map(|c| c.strip_prefix(prefix))
        .map(str::to_ascii_lowercase)
}

/// The ARM error code and message of a failed VM, from its instance view
/// (`ProvisioningState/failed/{code}`, e.g. `ZonalAllocationFailed`), when ARM names one.
pub fn failure(vm: &Value) -> Option<(String, String)> {
    let status = vm["properties"]["instanceView"]["statuses"].as_array()?.iter().find(|s| {
        s["code"].as_str().is_some_and(|c| c.to_ascii_lowercase().starts_with("provisioningstate/failed/"))
    })?;
    let code = status["code"].as_str()?.splitn(3, '/').nth(2).filter(|c| !c.is_empty())?;
    Some((code.to_string(), status["message"].as_str().unwrap_or_default().to_string()))
}

/// Provisioning + power state → the protocol state.
pub fn state_of(provisioning: &str, power: Option<&str>) -> MachineState {
    match provisioning.to_ascii_lowercase().as_str() {
        "creating" => MachineState::Creating,
        "updating" | "migrating" => MachineState::Updating,
        "deleting" => MachineState::Deleting,
        "failed" | "canceled" => MachineState::Failed,
        "succeeded" => match power {
            Some("running") | None => MachineState::Running,
            Some("starting") => MachineState::Creating,
            Some("stopping" | "stopped" | "deallocating" | "deallocated") => MachineState::Stopped,
            Some(_) => MachineState::Unknown,
        },
        _ => MachineState::Unknown,
    }
}

/// IDs of the VM's network interfaces.
pub fn nic_ids(vm: &Value) -> Vec<String> {
    vm["properties"]["networkProfile"]["networkInterfaces"]
        .as_array()
        .map(|a| a.iter().filter_map(|n| n["id"].as_str().map(str::to_string)).collect())
        .unwrap_or_default()
}

/// The private IPs of a NIC (as ARM returns it).
pub fn nic_ips(nic: &Value) -> Vec<String> {
    nic["properties"]["ipConfigurations"]
        .as_array()
        .map(|a| a.iter().filter_map(|c| c["properties"]["privateIPAddress"].as_str().map(str::to_string)).collect())
        .unwrap_or_default()
}

/// A VM (read with `$expand=instanceView` for the power state) as a protocol machine;
/// `internal_ips` come from its NICs when the caller read them.
pub fn machine_of(vm: &Value, internal_ips: &[String]) -> Machine {
    let tags = tags_of(vm);
    let id = vm["id"].as_str().unwrap_or_default();
    let props = &vm["properties"];
    let provisioning = provisioning_state(vm);
    let power = status_code(vm, "PowerState/");
    let state = state_of(provisioning, power.as_deref());
    let mut addresses: Vec<Address> =
        internal_ips.iter().map(|ip| Address { kind: "InternalIP".into(), address: ip.clone() }).collect();
    if let Some(host) = props["osProfile"]["computerName"].as_str().or(props["instanceView"]["computerName"].as_str()) {
        addresses.push(Address { kind: "Hostname".into(), address: host.to_string() });
    }
    let mut resources = vec![ResourceStatus {
        kind: "vm".into(),
        id: id.to_string(),
        state: provisioning.to_string(),
        message: power.clone().map(|p| format!("power state {p}")).unwrap_or_default(),
    }];
    resources.extend(nic_ids(vm).into_iter().map(|id| ResourceStatus {
        kind: "nic".into(),
        id,
        state: "Attached".into(),
        message: String::new(),
    }));
    if let Some(disk) = props["storageProfile"]["osDisk"]["managedDisk"]["id"].as_str() {
        resources.push(ResourceStatus {
            kind: "disk".into(),
            id: disk.to_string(),
            state: "Attached".into(),
            message: String::new(),
        });
    }
    let cloud_error = (state == MachineState::Failed).then(|| {
        let message = props["instanceView"]["statuses"]
            .as_array()
            .and_then(|a| a.iter().find(|s| s["level"].as_str() == Some("Error")))
            .and_then(|s| s["message"].as_str().or(s["displayStatus"].as_str()))
            .unwrap_or("the VM's provisioning state is Failed")
            .to_string();
        // A VM that failed for want of capacity in its zone says so (INSUFFICIENT_CAPACITY, …).
        let e =
            crate::errors::operation_failed("Failed", &failure(vm).map(|(c, _)| c).unwrap_or_default(), &message, None);
        (e.code(), e.reason().to_string(), message)
    });
    let internal = [NAME_TAG, SPEC_HASH_TAG, SPEC_TAGS_TAG];
    Machine {
        name: tags.get(NAME_TAG).cloned().unwrap_or_else(|| vm["name"].as_str().unwrap_or_default().to_string()),
        provider_id: crate::model::provider_id(id),
        state,
        addresses,
        labels: tags
            .iter()
            .filter(|(k, _)| !internal.contains(&k.as_str()))
            .map(|(k, v)| (label_name(k), v.clone()))
            .collect(),
        resources,
        cloud_error,
        create_time: props["timeCreated"]
            .as_str()
            .and_then(|t| azure_core::date::parse_rfc3339(t).ok())
            .map(SystemTime::from),
        spec_hash: tags.get(SPEC_HASH_TAG).cloned().unwrap_or_default(),
    }
}

/// Whether a VM carries every label of `selector` (label keys as tag names).
pub fn has_labels(vm: &Value, selector: &Labels) -> bool {
    let tags = tags_of(vm);
    tags.contains_key(NAME_TAG) && selector.iter().all(|(k, v)| tags.get(&tag_name(k)) == Some(v))
}

/// `CanUpdateMachine`: size and tags change in place, everything else needs a new VM. New tags
/// alone disrupt nothing ([`InPlaceDisruption::None`]); a new size is a resize, which Azure does
/// by restarting the VM (deallocating it first when the size is not on its current hardware
/// cluster): [`InPlaceDisruption::Reboot`].
pub fn plan_update(changed_paths: &[String]) -> UpdatePlan {
    let mut plan = UpdatePlan { disruption: InPlaceDisruption::None, ..UpdatePlan::default() };
    for p in changed_paths {
        let in_place = IN_PLACE_FIELDS.iter().any(|f| p == f || p.starts_with(&format!("{f}/")));
        if in_place {
            if !(p == "/tags" || p.starts_with("/tags/")) {
                plan.disruption = InPlaceDisruption::Reboot;
            }
            plan.in_place_paths.push(p.clone());
        } else {
            plan.replace_paths.push(p.clone());
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{parse_spec, schema};
    use driver_sdk::reason;
    use driver_sdk::tonic::Code;

    fn vm_ref(name: &str) -> ResourceId {
        ResourceId { subscription: "sub".into(), resource_group: "rg".into(), name: name.into() }
    }

    fn example(i: usize) -> ProviderSpec {
        parse_spec(&schema()["examples"][i]).unwrap()
    }

    #[test]
    fn the_body_fits_the_model_and_deletes_its_nic_and_disk_with_the_vm() {
        let spec = example(0);
        let labels: Labels = [("machine.driver.dev/machine".to_string(), "ns.web-0".to_string())].into();
        let tags = tags_for("web-0", &spec, "h1", &labels);
        let ss = "/subscriptions/sub/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/flex";
        let b = body(&vm_ref("web-0"), &spec, tags, Some(ss), Some("#cloud-config\n")).unwrap();
        let p = &b["properties"];
        assert_eq!(p["virtualMachineScaleSet"]["id"], ss);
        assert_eq!(p["storageProfile"]["osDisk"]["deleteOption"], "Delete");
        assert_eq!(p["networkProfile"]["networkInterfaceConfigurations"][0]["properties"]["deleteOption"], "Delete");
        assert_eq!(p["osProfile"]["customData"], "I2Nsb3VkLWNvbmZpZwo=");
        assert_eq!(b["tags"][NAME_TAG], "web-0");
        assert_eq!(b["tags"]["machine.driver.dev:machine"], "ns.web-0");
        assert_eq!(b["tags"][SPEC_TAGS_TAG], "team");
        assert_eq!(b["tags"]["team"], "platform");
    }

    #[test]
    fn the_user_data_secret_wins_over_custom_data_and_both_are_held_to_arms_limit() {
        let mut spec = example(0);
        spec.custom_data = Some("#cloud-config\n# from the spec\n".into());
        let none = Secrets::default();
        assert_eq!(custom_data(&spec, &none).unwrap(), Some("#cloud-config\n# from the spec\n"));
        let rendered: Secrets = [(USER_DATA_KEY, "#cloud-config\n# rendered\n")].into_iter().collect();
        assert_eq!(custom_data(&spec, &rendered).unwrap(), Some("#cloud-config\n# rendered\n"));
        // An empty secret counts as absent, as every other secret key does.
        let empty: Secrets = [(USER_DATA_KEY, "")].into_iter().collect();
        assert_eq!(custom_data(&spec, &empty).unwrap(), Some("#cloud-config\n# from the spec\n"));
        assert_eq!(custom_data(&example(0), &none).unwrap(), None);
        // The limit is on the base64: 49149 bytes are 65532 characters, 49150 are 65536.
        let largest = "a".repeat(49149);
        let at_limit: Secrets = [(USER_DATA_KEY, largest.as_str())].into_iter().collect();
        assert_eq!(custom_data(&spec, &at_limit).unwrap().map(str::len), Some(49149));
        let b = body(&vm_ref("web-0"), &spec, Map::new(), None, Some(&largest)).unwrap();
        assert!(b["properties"]["osProfile"]["customData"].as_str().unwrap().len() <= MAX_CUSTOM_DATA_BASE64);
        // From the spec, the field is the spec's; multi-byte characters count by their bytes.
        spec.custom_data = Some("é".repeat(24575).as_str().into());
        let err = custom_data(&spec, &none).unwrap_err();
        assert_eq!((err.code(), err.reason()), (Code::InvalidArgument, reason::INVALID_PROVIDER_SPEC));
        assert_eq!(err.violations()[0].field, "provider_spec.customData");
        let m = err.message();
        assert!(m.contains("customData is 49150 bytes, 65536 characters in base64") && m.contains("65535"), "{m}");
        // Its Debug (and so the spec's) says how big it is, not what it says.
        let debug = format!("{spec:?}");
        assert!(debug.contains("CustomData(49150 bytes)") && !debug.contains('é'), "{debug}");
    }

    #[test]
    fn a_too_large_user_data_secret_is_refused_by_name_without_its_content() {
        let marker = "SECRET-BOOTSTRAP-TOKEN-abcdef.0123456789abcdef";
        let big = format!("#cloud-config\n{}", marker.repeat(49149 / marker.len() + 1));
        let secrets: Secrets = [(USER_DATA_KEY, big.as_str())].into_iter().collect();
        let mut spec = example(0);
        spec.custom_data = Some("small".into());
        let err = custom_data(&spec, &secrets).unwrap_err();
        assert_eq!((err.code(), err.reason()), (Code::InvalidArgument, reason::FIELD_INVALID));
        assert_eq!(err.violations().len(), 1);
        assert_eq!(err.violations()[0].field, "secrets.userData");
        let size = big.len().to_string();
        for text in [err.message(), err.violations()[0].description.as_str()] {
            assert!(text.contains("userData") && text.contains(&size) && text.contains("65535"), "{text}");
        }
        let everything = format!("{} {:?} {:?} {:?}", err, err, err.violations(), err.causes());
        assert!(!everything.contains("SECRET-BOOTSTRAP") && !everything.contains("#cloud-config"), "{everything}");
        let status = err.to_status(crate::DRIVER_NAME, "req-1", None);
        assert!(!format!("{status:?}").contains("SECRET-BOOTSTRAP"));
    }

    #[test]
    fn a_machine_needs_a_subnet() {
        let mut spec = example(0);
        spec.subnet_id = None;
        let err = body(&vm_ref("web-0"), &spec, Map::new(), None, None).unwrap_err();
        assert_eq!(err.violations()[0].field, "provider_spec.subnetId");
    }

    #[test]
    fn scale_set_comes_from_the_spec_then_the_default() {
        let mut spec = example(0);
        assert_eq!(scale_set_id(&spec, &vm_ref("m"), None), None);
        let by_default = scale_set_id(&spec, &vm_ref("m"), Some("flex")).unwrap();
        assert!(by_default.ends_with("/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/flex"));
        spec.virtual_machine_scale_set = Some(crate::model::ScaleSetRef { id: Some("/x".into()), name: None });
        assert_eq!(scale_set_id(&spec, &vm_ref("m"), Some("flex")).as_deref(), Some("/x"));
    }

    #[test]
    fn zones_are_stable_and_spread() {
        let zones: Vec<String> = ["1", "2", "3"].map(String::from).to_vec();
        assert_eq!(zone_for("web-0", &zones), zone_for("web-0", &zones));
        let used: std::collections::BTreeSet<String> =
            (0..30).filter_map(|i| zone_for(&format!("web-{i}"), &zones)).collect();
        assert_eq!(used.len(), 3);
        assert_eq!(zone_for("web-0", &[]), None);
    }

    #[test]
    fn an_update_replaces_the_spec_tags_and_keeps_the_labels() {
        let old = example(1);
        let labels: Labels = [("owner".to_string(), "me".to_string())].into();
        let current: BTreeMap<String, String> =
            tags_for("m", &old, "h1", &labels).into_iter().map(|(k, v)| (k, v.as_str().unwrap().to_string())).collect();
        assert_eq!(current.get("tier").map(String::as_str), Some("large"));
        let new = example(0);
        let t = updated_tags(&current, &new, "h2");
        assert!(t.get("tier").is_none(), "a removed spec tag must go: {t:?}");
        assert_eq!((t["owner"].as_str(), t[NAME_TAG].as_str()), (Some("me"), Some("m")));
        assert_eq!((t[SPEC_HASH_TAG].as_str(), t["team"].as_str()), (Some("h2"), Some("platform")));
    }

    #[test]
    fn provider_ids_round_trip() {
        let r = vm_ref("web-0");
        assert_eq!(parse_provider_id(&provider_id(&r)), Some(r));
        assert_eq!(parse_provider_id("aws:///i-1"), None);
        assert_eq!(
            parse_provider_id(
                "azure:///subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/p"
            ),
            None
        );
    }

    #[test]
    fn states_and_addresses_come_from_the_instance_view() {
        let vm = json!({
            "id": "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/web-0",
            "name": "web-0",
            "tags": {NAME_TAG: "web-0", SPEC_HASH_TAG: "h1", SPEC_TAGS_TAG: "", "machine.driver.dev:machine": "ns.web-0"},
            "properties": {
                "provisioningState": "Succeeded", "timeCreated": "2026-01-01T00:00:00Z",
                "osProfile": {"computerName": "web-0"},
                "networkProfile": {"networkInterfaces": [{"id": "/nic"}]},
                "storageProfile": {"osDisk": {"managedDisk": {"id": "/disk"}}},
                "instanceView": {"statuses": [{"code": "ProvisioningState/succeeded"}, {"code": "PowerState/running"}]},
            },
        });
        let m = machine_of(&vm, &["10.0.0.4".to_string()]);
        assert_eq!((m.name.as_str(), m.state, m.spec_hash.as_str()), ("web-0", MachineState::Running, "h1"));
        assert_eq!(m.addresses[0].address, "10.0.0.4");
        assert_eq!(m.labels.get("machine.driver.dev/machine").map(String::as_str), Some("ns.web-0"));
        assert_eq!(m.labels.len(), 1);
        assert_eq!(m.resources.iter().map(|r| r.kind.as_str()).collect::<Vec<_>>(), ["vm", "nic", "disk"]);
        assert!(m.create_time.is_some());
        assert_eq!(state_of("Succeeded", Some("deallocated")), MachineState::Stopped);
        assert_eq!(state_of("Creating", Some("starting")), MachineState::Creating);
        assert_eq!(state_of("Failed", None), MachineState::Failed);
    }

    #[test]
    fn a_vm_failed_for_want_of_zonal_capacity_says_so() {
        let failed = |code: &str| {
            json!({
                "id": "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/web-0",
                "name": "web-0", "zones": ["2"],
                "properties": {"provisioningState": "Failed", "instanceView": {"statuses": [
                    {"code": code, "level": "Error", "displayStatus": "Provisioning failed", "message": "no room in zone 2"},
                    {"code": "PowerState/stopped"},
                ]}},
            })
        };
        let vm = failed("ProvisioningState/failed/ZonalAllocationFailed");
        assert_eq!(failure(&vm), Some(("ZonalAllocationFailed".to_string(), "no room in zone 2".to_string())));
        let m = machine_of(&vm, &[]);
        assert_eq!(m.state, MachineState::Failed);
        assert_eq!(
            m.cloud_error,
            Some((Code::ResourceExhausted, reason::INSUFFICIENT_CAPACITY.to_string(), "no room in zone 2".to_string()))
        );
        let vm = failed("ProvisioningState/failed");
        assert_eq!(failure(&vm), None);
        assert_eq!(machine_of(&vm, &[]).cloud_error.map(|e| e.0), Some(Code::Internal));
    }

    #[test]
    fn size_and_tags_update_in_place_everything_else_replaces() {
        let paths: Vec<String> = ["/vmSize", "/tags/tier", "/osDiskSizeGB", "/image/sku"].map(String::from).to_vec();
        let plan = plan_update(&paths);
        assert_eq!(plan.in_place_paths, ["/vmSize", "/tags/tier"]);
        assert_eq!(plan.replace_paths, ["/osDiskSizeGB", "/image/sku"]);
    }

    #[test]
    fn new_tags_disrupt_nothing_a_new_size_reboots() {
        let plan = |paths: &[&str]| plan_update(&paths.iter().map(|p| p.to_string()).collect::<Vec<_>>());
        assert_eq!(plan(&["/tags/tier", "/tags/team"]).disruption, InPlaceDisruption::None);
        assert_eq!(plan(&["/tags"]).disruption, InPlaceDisruption::None);
        assert_eq!(plan(&["/vmSize"]).disruption, InPlaceDisruption::Reboot);
        assert_eq!(plan(&["/tags/tier", "/vmSize"]).disruption, InPlaceDisruption::Reboot);
        // Said in so many words on the wire (never left unset).
        assert_eq!(plan(&["/tags/tier"]).disruption.to_pb(), driver_sdk::proto::InPlaceDisruption::None);
        // Only replacements: nothing is done in place, so nothing in place restarts.
        let replace = plan(&["/image/sku"]);
        assert!(replace.in_place_paths.is_empty());
        assert_eq!(replace.disruption, InPlaceDisruption::None);
    }
}
