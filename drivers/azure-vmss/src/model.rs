//! The provider spec, and conversions between it and the VMSS models of `azure_mgmt_compute`.

use std::collections::BTreeMap;
use std::time::SystemTime;

use azure_mgmt_compute::package_2024_07_01::models::{VirtualMachineScaleSet, VirtualMachineScaleSetVm};
use driver_sdk::{Address, DriverError, InstanceState, Labels, Pool, PoolInstance, PowerState, Violation};
use serde::Deserialize;
use serde_json::{json, Map, Value};

/// Tag holding the hash of the provider spec the scale set's model was built from.
pub const SPEC_HASH_TAG: &str = "machinedriver.dev:spec-hash";

/// The provider spec: the VM template of a scale set (pools) or of one VM (machines).
/// Subscription and resource group default to the class Secret's `subscriptionId` and the
/// sidecar's flags, so calls without a spec can still address their resource.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProviderSpec {
    /// Subscription of the resources (default: the class Secret's, then `--subscription-id`).
    #[serde(default)]
    pub subscription_id: Option<String>,
    /// Resource group of the resources (default: `--resource-group`).
    #[serde(default)]
    pub resource_group: Option<String>,
    /// Machines only: the Flexible scale set the VM joins (default: `--scale-set`; none: a
    /// standalone VM).
    #[serde(default)]
    pub virtual_machine_scale_set: Option<ScaleSetRef>,
    /// cloud-init user data (plain text; sent base64-encoded as `customData`; a pool's goes into
    /// its scale set's model, so every instance boots with it).
    /// A `userData` key in the class Secret takes precedence (see [`crate::vm::custom_data`]).
    #[serde(default)]
    pub custom_data: Option<CustomData>,
    /// Azure region, e.g. `westeurope`.
    pub location: String,
    /// VM size (the scale set's SKU), e.g. `Standard_D2s_v5`.
    pub vm_size: String,
    /// The image.
    pub image: Image,
    /// Admin user.
    #[serde(default)]
    pub admin_username: Option<String>,
    /// OpenSSH public key for the admin user.
    #[serde(default)]
    pub ssh_public_key: Option<String>,
    /// OS disk size in GiB.
    #[serde(default)]
    pub os_disk_size_gb: Option<i64>,
    /// OS disk storage account type.
    #[serde(default)]
    pub os_disk_type: Option<String>,
    /// Subnet resource ID for the NIC.
    #[serde(default)]
    pub subnet_id: Option<String>,
    /// Availability zones: a machine's VM goes to one of them ([`crate::vm::zone_for`]; a failure
    /// domain sets its one zone), a pool's scale set spreads over all of them.
    #[serde(default)]
    pub zones: Vec<String>,
    /// `Regular` (the default) or `Spot`. `Low`, the legacy name of Spot, is refused (it names
    /// no other capacity and would give one spec two spellings).
    #[serde(default)]
    pub priority: Option<String>,
    /// Spot only: what an eviction does, `Deallocate` or `Delete` (the driver's default: a
    /// deallocated machine still holds its disk and the controller replaces it anyway).
    #[serde(default)]
    pub eviction_policy: Option<String>,
    /// Spot only: the most to pay per hour in US dollars (up to five decimals), or -1: up to the
    /// on-demand price, never evicted for price (ARM's default).
    #[serde(default)]
    pub max_price: Option<f64>,
    /// Extra tags on the scale set.
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
}

/// Custom data (a boot script, often with a bootstrap token in it): the text itself, whose
/// `Debug` prints its size only, so no log line, span field or error built with `{:?}` carries
/// it.
#[derive(Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct CustomData(String);

impl CustomData {
    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<&str> for CustomData {
    fn from(s: &str) -> Self {
        Self(s.to_string())
    }
}

impl std::ops::Deref for CustomData {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for CustomData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CustomData({} bytes)", self.0.len())
    }
}

/// The Flexible scale set a machine joins: its resource ID, or its name in the VM's
/// subscription and resource group.
#[derive(Debug, Clone, Deserialize)]
pub struct ScaleSetRef {
    /// Full resource ID.
    #[serde(default)]
    pub id: Option<String>,
    /// Name in the VM's subscription and resource group.
    #[serde(default)]
    pub name: Option<String>,
}

/// A marketplace image (publisher/offer/sku/version) or an image resource ID.
#[derive(Debug, Clone, Deserialize)]
pub struct Image {
    /// Marketplace publisher.
    #[serde(default)]
    pub publisher: Option<String>,
    /// Marketplace offer.
    #[serde(default)]
    pub offer: Option<String>,
    /// Marketplace SKU.
    #[serde(default)]
    pub sku: Option<String>,
    /// Version (default `latest`).
    #[serde(default)]
    pub version: Option<String>,
    /// Image (or gallery image version) resource ID.
    #[serde(default)]
    pub id: Option<String>,
}

/// The provider-spec JSON Schema, with two valid examples (for the conformance suite).
pub fn schema() -> Value {
    let s = |d: &str| json!({"type": "string", "minLength": 1, "description": d});
    json!({
        "type": "object",
        "description": "An Azure VM template: a pool becomes a Uniform scale set with a manual upgrade policy, \
                        a machine one VM (joining a Flexible scale set when virtualMachineScaleSet or the sidecar's \
                        --scale-set names one). subscriptionId and resourceGroup default to the class Secret's \
                        subscriptionId and the sidecar's --subscription-id / --resource-group.",
        "required": ["location", "vmSize", "image"],
        "additionalProperties": false,
        "properties": {
            "subscriptionId": {
                "type": "string", "pattern": "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
                "description": "subscription of the VM or scale set (default: the class Secret's subscriptionId, then the sidecar's --subscription-id)",
                "examples": ["00000000-0000-0000-0000-000000000000"],
            },
            "resourceGroup": {
                "type": "string", "pattern": "^[-A-Za-z0-9._()]{1,90}$",
                "description": "resource group of the VM or scale set (default: the sidecar's --resource-group)",
                "examples": ["workers-westeurope"],
            },
            "virtualMachineScaleSet": {
                "type": "object", "additionalProperties": false,
                "description": "machines: the Flexible scale set the VM joins, by resource id or by name in the VM's \
                                resource group (default: the sidecar's --scale-set; neither: a standalone VM). \
                                Ignored by pools, which are scale sets themselves.",
                "properties": {
                    "id": {"type": "string", "pattern": "(?i)^/subscriptions/[^/]+/resourceGroups/[^/]+/providers/Microsoft\\.Compute/virtualMachineScaleSets/[^/]+$"},
                    "name": {"type": "string", "pattern": "^[A-Za-z0-9][-A-Za-z0-9._]{0,63}$"},
                },
                "examples": [
                    {"id": "/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/workers-westeurope/providers/Microsoft.Compute/virtualMachineScaleSets/workers-flex"},
                    {"name": "workers-flex"},
                ],
            },
            "customData": {
                "type": "string", "maxLength": 49152,
                "description": "cloud-init user data (a pool's in its scale set's model), plain text (sent base64-encoded); a userData secret (the MachineClass's rendered boot data) takes precedence. At most 65535 characters once base64-encoded (49149 bytes), ARM's limit",
            },
            "location": {"type": "string", "pattern": "^[a-z0-9]+$", "description": "Azure region, e.g. westeurope"},
            "vmSize": {"type": "string", "pattern": "^[A-Za-z0-9_]+$", "description": "VM size, e.g. Standard_D2s_v5"},
            "image": {
                "type": "object", "additionalProperties": false,
                "description": "marketplace image (publisher, offer, sku, version) or an image resource id",
                "properties": {
                    "publisher": s("marketplace publisher"), "offer": s("marketplace offer"),
                    "sku": s("marketplace SKU"), "version": s("image version (default latest)"),
                    "id": s("image or gallery image version resource ID"),
                },
            },
            "adminUsername": {"type": "string", "pattern": "^[a-z_][a-z0-9_-]{0,31}$"},
            "sshPublicKey": {"type": "string", "pattern": "^(ssh-|ecdsa-)", "description": "OpenSSH public key of the admin user"},
            "osDiskSizeGB": {"type": "integer", "minimum": 30, "maximum": 4095},
            "osDiskType": {"type": "string", "enum": ["Standard_LRS", "StandardSSD_LRS", "Premium_LRS", "PremiumV2_LRS"]},
            "subnetId": {"type": "string", "pattern": "^/subscriptions/"},
            "zones": {"type": "array", "items": {"type": "string", "enum": ["1", "2", "3"]}, "maxItems": 3,
                      "description": "availability zones: a machine's VM goes to one of them, chosen by the machine name (a failure domain sets its one zone, e.g. [\"2\"]); a pool's scale set spreads its instances over all of them; none: ARM places the VMs"},
            "priority": {"type": "string", "enum": ["Regular", "Spot", "Low"],
                         "description": "Regular (default) or Spot; Low, the legacy name of Spot, is refused with a message saying so"},
            "evictionPolicy": {"type": "string", "enum": ["Deallocate", "Delete"],
                               "description": "priority Spot only: what an eviction does (default Delete)"},
            "maxPrice": {"type": "number",
                         "description": "priority Spot only: the most to pay per hour in US dollars (above 0, up to five decimals), or -1: up to the on-demand price (default)"},
            "tags": {"type": "object", "additionalProperties": {"type": "string"}},
        },
        "examples": [
            {
                "location": "westeurope", "vmSize": "Standard_D2s_v5",
                "image": {"publisher": "Canonical", "offer": "ubuntu-24_04-lts", "sku": "server", "version": "latest"},
                "adminUsername": "azureuser", "osDiskSizeGB": 64, "osDiskType": "Premium_LRS",
                "sshPublicKey": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGV4YW1wbGUta2V5LW5vdC1mb3ItdXNlLWV4YW1wbGU example",
                "subnetId": "/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/network/providers/Microsoft.Network/virtualNetworks/vnet/subnets/workers",
                "tags": {"team": "platform"},
            },
            {
                "location": "westeurope", "vmSize": "Standard_D4s_v5",
                "image": {"publisher": "Canonical", "offer": "ubuntu-24_04-lts", "sku": "server", "version": "latest"},
                "adminUsername": "azureuser", "osDiskSizeGB": 64, "osDiskType": "Premium_LRS",
                "sshPublicKey": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGV4YW1wbGUta2V5LW5vdC1mb3ItdXNlLWV4YW1wbGU example",
                "subnetId": "/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/network/providers/Microsoft.Network/virtualNetworks/vnet/subnets/workers",
                "tags": {"team": "platform", "tier": "large"},
            },
        ],
    })
}

/// Decodes a spec the SDK has checked against [`schema`], plus the checks a schema cannot say.
///
/// # Errors
/// INVALID_ARGUMENT / INVALID_PROVIDER_SPEC with one violation per problem.
pub fn parse_spec(spec: &Value) -> Result<ProviderSpec, DriverError> {
    let parsed: ProviderSpec = serde_json::from_value(spec.clone()).map_err(|e| {
        DriverError::invalid_provider_spec(vec![Violation::new("provider_spec", e.to_string())]).with_source(e)
    })?;
    let img = &parsed.image;
    let marketplace = img.publisher.is_some() && img.offer.is_some() && img.sku.is_some();
    if marketplace == img.id.is_some() {
        return Err(DriverError::invalid_provider_spec(vec![Violation::new(
            "provider_spec.image",
            "give either publisher, offer and sku, or id (not both)",
        )]));
    }
    if let Some(ss) = &parsed.virtual_machine_scale_set {
        if ss.id.is_some() == ss.name.is_some() {
            return Err(DriverError::invalid_provider_spec(vec![Violation::new(
                "provider_spec.virtualMachineScaleSet",
                "give either id or name (not both)",
            )]));
        }
    }
    check_spot(&parsed)?;
    let tag_keys: usize = parsed.tags.keys().map(|k| k.len() + 1).sum();
    if tag_keys > 256 {
        return Err(DriverError::invalid_provider_spec(vec![Violation::new(
            "provider_spec.tags",
            "the tag names together may have at most 255 characters (they are recorded in one 256-character tag)",
        )]));
    }
    for k in parsed.tags.keys() {
        if k.contains(['<', '>', '%', '&', '\\', '?', '/']) {
            return Err(DriverError::invalid_provider_spec(vec![Violation::new(
                format!("provider_spec.tags.{k}"),
                "Azure tag names may not contain < > % & \\ ? /",
            )]));
        }
    }
    Ok(parsed)
}

/// `priority`, `evictionPolicy` and `maxPrice`: the checks ARM would make later, and the
/// legacy `Low`.
fn check_spot(spec: &ProviderSpec) -> Result<(), DriverError> {
    let refuse = |field: &str, why: String| {
        Err(DriverError::invalid_provider_spec(vec![Violation::new(format!("provider_spec.{field}"), why)]))
    };
    let priority = spec.priority.as_deref().unwrap_or("Regular");
    if priority == "Low" {
        return refuse("priority", "Low is the legacy name of Spot: write priority: Spot".into());
    }
    if priority != "Spot" {
        if let Some(p) = &spec.eviction_policy {
            return refuse(
                "evictionPolicy",
                format!(
                    "evictionPolicy {p} needs priority: Spot (priority is {priority}); ARM refuses it on other VMs"
                ),
            );
        }
        if spec.max_price.is_some() {
            return refuse("maxPrice", format!("maxPrice needs priority: Spot (priority is {priority})"));
        }
    }
    if let Some(p) = spec.max_price {
        let scaled = p * 100_000.0;
        if !(p == -1.0 || p > 0.0) || !p.is_finite() {
            return refuse(
                "maxPrice",
                format!("{p} is no price: give -1 (up to the on-demand price) or a price above 0"),
            );
        }
        if (scaled - scaled.round()).abs() > 1e-6 {
            return refuse("maxPrice", format!("{p} has more than five decimals, which ARM refuses"));
        }
    }
    Ok(())
}

/// The capacity type of a VM (as ARM returns it): spot for `Spot` (or `Low`) priority.
pub fn capacity_type_of(vm: &Value) -> driver_sdk::CapacityType {
    match vm["properties"]["priority"].as_str() {
        Some(p) if p.eq_ignore_ascii_case("Spot") || p.eq_ignore_ascii_case("Low") => driver_sdk::CapacityType::Spot,
        _ => driver_sdk::CapacityType::OnDemand,
    }
}

/// The `priority`, `evictionPolicy` and `billingProfile` of a Spot spec (nothing for Regular),
/// for a VM's `properties` or a scale set's `virtualMachineProfile`.
pub(crate) fn spot_fields(spec: &ProviderSpec) -> Option<Map<String, Value>> {
    if spec.priority.as_deref() != Some("Spot") {
        return None;
    }
    let mut m = Map::new();
    m.insert("priority".into(), json!("Spot"));
    m.insert("evictionPolicy".into(), json!(spec.eviction_policy.as_deref().unwrap_or("Delete")));
    if let Some(p) = spec.max_price {
        m.insert("billingProfile".into(), json!({"maxPrice": p}));
    }
    Some(m)
}

/// Label key → tag name: Azure refuses `/` in tag names, Kubernetes-style keys never hold `:`.
pub fn tag_name(label: &str) -> String {
    label.replace('/', ":")
}

/// Tag name → label key.
pub fn label_name(tag: &str) -> String {
    tag.replace(':', "/")
}

/// What a scale set's model and a single VM build alike from the spec.
pub(crate) struct VmTemplate {
    /// The admin user (default `azureuser`).
    pub admin: String,
    /// `storageProfile.imageReference`.
    pub image: Value,
    /// `osProfile.linuxConfiguration`: SSH key only, no password login.
    pub linux: Value,
    /// `storageProfile.osDisk`.
    pub os_disk: Value,
}

/// The image, Linux configuration and OS disk of the spec.
pub(crate) fn vm_template(spec: &ProviderSpec) -> VmTemplate {
    let admin = spec.admin_username.clone().unwrap_or_else(|| "azureuser".into());
    let image = match &spec.image.id {
        Some(id) => json!({"id": id}),
        None => json!({
            "publisher": spec.image.publisher, "offer": spec.image.offer, "sku": spec.image.sku,
            "version": spec.image.version.clone().unwrap_or_else(|| "latest".into()),
        }),
    };
    let mut linux = json!({"disablePasswordAuthentication": true});
    if let Some(key) = &spec.ssh_public_key {
        linux["ssh"] = json!({"publicKeys": [{"path": format!("/home/{admin}/.ssh/authorized_keys"), "keyData": key}]});
    }
    let mut os_disk = json!({
        "createOption": "FromImage", "caching": "ReadWrite",
        "managedDisk": {"storageAccountType": spec.os_disk_type.clone().unwrap_or_else(|| "StandardSSD_LRS".into())},
    });
    if let Some(gb) = spec.os_disk_size_gb {
        os_disk["diskSizeGB"] = json!(gb);
    }
    VmTemplate { admin, image, linux, os_disk }
}

/// The scale set for `name` with `capacity` instances, checked against the
/// `azure_mgmt_compute` model (so a typo in a field name fails here, not at ARM).
///
/// # Errors
/// INTERNAL when the body does not fit the model (a driver bug).
pub fn scale_set_body(
    name: &str,
    spec: &ProviderSpec,
    spec_hash: &str,
    capacity: u32,
    labels: &Labels,
    custom_data: Option<&str>,
) -> Result<Value, DriverError> {
    let mut tags: Map<String, Value> = spec.tags.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
    for (k, v) in labels {
        tags.insert(tag_name(k), json!(v));
    }
    tags.insert(SPEC_HASH_TAG.into(), json!(spec_hash));
    let VmTemplate { admin, image, linux, os_disk } = vm_template(spec);
    // Linux computer names may be 64 characters; the prefix leaves room for the 6-character suffix.
    let prefix: String = name.chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-').take(58).collect();
    let mut profile = json!({
        "osProfile": {"computerNamePrefix": prefix, "adminUsername": admin, "linuxConfiguration": linux},
        "storageProfile": {"imageReference": image, "osDisk": os_disk},
    });
    if let Some(data) = custom_data {
        use base64::Engine as _;
        profile["osProfile"]["customData"] = json!(base64::engine::general_purpose::STANDARD.encode(data));
    }
    if let Some(subnet) = &spec.subnet_id {
        profile["networkProfile"] = json!({"networkInterfaceConfigurations": [{
            "name": format!("{name}-nic"),
            "properties": {"primary": true, "ipConfigurations": [{"name": "ipconfig1", "properties": {"subnet": {"id": subnet}}}]},
        }]});
    }
    for (k, v) in spot_fields(spec).unwrap_or_default() {
        profile[k.as_str()] = v;
    }
    let mut body = json!({
        "location": spec.location,
        "tags": tags,
        "sku": {"name": spec.vm_size, "tier": "Standard", "capacity": capacity},
        "properties": {
            "orchestrationMode": "Uniform",
            // Manual: a model change marks instances not-latest; the controller upgrades them.
            "upgradePolicy": {"mode": "Manual"},
            "overprovision": false,
            "singlePlacementGroup": false,
            "virtualMachineProfile": profile,
        },
    });
    if !spec.zones.is_empty() {
        body["zones"] = json!(spec.zones);
    }
    let typed: VirtualMachineScaleSet = serde_json::from_value(body)
        .map_err(|e| DriverError::internal("the scale set body does not fit the VMSS model").with_source(e))?;
    serde_json::to_value(&typed).map_err(|e| DriverError::internal("serializing the scale set").with_source(e))
}

/// `azure://` + the resource ID, as Cluster API providers write it.
pub fn provider_id(resource_id: &str) -> String {
    format!("azure://{resource_id}")
}

/// The tags of a scale set.
pub fn tags_of(vmss: &VirtualMachineScaleSet) -> BTreeMap<String, String> {
    vmss.resource
        .tags
        .as_ref()
        .and_then(Value::as_object)
        .map(|o| o.iter().filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string()))).collect())
        .unwrap_or_default()
}

/// The scale set's provisioning state (`Creating`, `Updating`, `Succeeded`, `Failed`, `Deleting`).
pub fn provisioning_state(vmss: &VirtualMachineScaleSet) -> String {
    vmss.properties.as_ref().and_then(|p| p.provisioning_state.clone()).unwrap_or_default()
}

/// The scale set as a protocol pool.
pub fn pool_of(vmss: &VirtualMachineScaleSet) -> Pool {
    let tags = tags_of(vmss);
    let model_version = tags.get(SPEC_HASH_TAG).cloned().unwrap_or_default();
    Pool {
        name: vmss.resource.name.clone().unwrap_or_default(),
        provider_id: provider_id(vmss.resource.id.as_deref().unwrap_or_default()),
        capacity: vmss.sku.as_ref().and_then(|s| s.capacity).map_or(0, |c| c.max(0) as u32),
        model_version,
        provisioning_state: provisioning_state(vmss),
        labels: tags
            .iter()
            .filter(|(k, _)| k.as_str() != SPEC_HASH_TAG)
            .map(|(k, v)| (label_name(k), v.clone()))
            .collect(),
    }
}

/// Whether the scale set already is what `ApplyPool` asks for.
pub fn matches(vmss: &VirtualMachineScaleSet, spec_hash: &str, capacity: u32, labels: &Labels) -> bool {
    let tags = tags_of(vmss);
    let cap = vmss.sku.as_ref().and_then(|s| s.capacity).unwrap_or(-1);
    tags.get(SPEC_HASH_TAG).map(String::as_str) == Some(spec_hash)
        && cap == i64::from(capacity)
        && labels.iter().all(|(k, v)| tags.get(&tag_name(k)) == Some(v))
}

/// An ARM `provisioningState` of a scale-set VM in the protocol's vocabulary. `Migrating` is
/// a change in place; `Canceled` and anything unknown count as still being created (the next
/// listing tells more), as before the protocol had `InstanceState`.
pub fn instance_state(provisioning_state: &str) -> InstanceState {
    match provisioning_state {
        "Succeeded" => InstanceState::Running,
        "Updating" | "Migrating" => InstanceState::Updating,
        "Deleting" => InstanceState::Deleting,
        "Failed" => InstanceState::Failed,
        _ => InstanceState::Creating,
    }
}

/// A VMSS VM (listed with `$expand=instanceView`) as a protocol pool instance.
pub fn instance_of(vm: &VirtualMachineScaleSetVm) -> PoolInstance {
    let props = vm.properties.as_ref();
    let statuses = props.and_then(|p| p.instance_view.as_ref()).map(|iv| iv.statuses.as_slice()).unwrap_or_default();
    let code = |prefix: &str| {
        statuses
            .iter()
            .filter_map(|s| s.code.as_deref())
            .find_map(|c| c.strip_prefix(prefix))
            .map(str::to_ascii_lowercase)
    };
    let power_state = match code("PowerState/").as_deref() {
        Some("starting") => PowerState::Starting,
        Some("running") => PowerState::Running,
        Some("stopping") => PowerState::Stopping,
        Some("stopped") => PowerState::Stopped,
        Some("deallocating") => PowerState::Deallocating,
        Some("deallocated") => PowerState::Deallocated,
        _ => PowerState::Unknown,
    };
    let computer_name = props.and_then(|p| p.os_profile.as_ref()).and_then(|o| o.computer_name.clone());
    PoolInstance {
        instance_id: vm.instance_id.clone().unwrap_or_default(),
        name: computer_name.clone().or_else(|| vm.resource.name.clone()).unwrap_or_default(),
        provider_id: provider_id(vm.resource.id.as_deref().unwrap_or_default()),
        state: instance_state(props.and_then(|p| p.provisioning_state.as_deref()).unwrap_or_default()),
        provisioning_state: props.and_then(|p| p.provisioning_state.clone()).unwrap_or_default(),
        power_state,
        latest_model_applied: props.and_then(|p| p.latest_model_applied).unwrap_or(false),
        addresses: computer_name.map(|n| vec![Address { kind: "Hostname".into(), address: n }]).unwrap_or_default(),
        create_time: props.and_then(|p| p.time_created).map(SystemTime::from),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spot_fields_are_checked_and_reach_the_vm_model() {
        let base = schema()["examples"][0].clone();
        let with = |extra: Value| {
            let mut s = base.clone();
            for (k, v) in extra.as_object().unwrap() {
                s[k] = v.clone();
            }
            s
        };
        let field = |spec: Value| {
            let e = parse_spec(&spec).unwrap_err();
            assert_eq!(e.reason(), driver_sdk::reason::INVALID_PROVIDER_SPEC, "{e}");
            e.violations().iter().map(|v| v.field.clone()).collect::<Vec<_>>()
        };
        assert_eq!(field(with(json!({"priority": "Low"}))), ["provider_spec.priority"]);
        assert_eq!(field(with(json!({"evictionPolicy": "Delete"}))), ["provider_spec.evictionPolicy"]);
        assert_eq!(field(with(json!({"priority": "Regular", "maxPrice": 0.5}))), ["provider_spec.maxPrice"]);
        assert_eq!(field(with(json!({"priority": "Spot", "maxPrice": 0}))), ["provider_spec.maxPrice"]);
        assert_eq!(field(with(json!({"priority": "Spot", "maxPrice": 0.123456}))), ["provider_spec.maxPrice"]);
        let spec =
            parse_spec(&with(json!({"priority": "Spot", "evictionPolicy": "Deallocate", "maxPrice": -1}))).unwrap();
        let body = scale_set_body("p", &spec, "h", 1, &Labels::new(), Some("#cloud-config\n")).unwrap();
        let profile = &body["properties"]["virtualMachineProfile"];
        assert_eq!((&profile["priority"], &profile["evictionPolicy"]), (&json!("Spot"), &json!("Deallocate")));
        // A pool's boot data is in its model, base64-encoded, as a VM's.
        assert_eq!(profile["osProfile"]["customData"], "I2Nsb3VkLWNvbmZpZwo=");
        assert_eq!(profile["billingProfile"]["maxPrice"], -1.0);
        let spec = parse_spec(&with(json!({"priority": "Spot", "maxPrice": 0.01538}))).unwrap();
        assert_eq!(spot_fields(&spec).unwrap()["evictionPolicy"], "Delete");
        assert!(spot_fields(&parse_spec(&base).unwrap()).is_none());
    }

    #[test]
    fn examples_are_valid_and_build_a_scale_set() {
        let schema = schema();
        driver_sdk::schema::ProviderSchema::compile(&schema).expect("the SDK accepts the schema at start");
        let examples = schema["examples"].as_array().unwrap();
        assert_eq!(examples.len(), 2);
        for ex in examples {
            assert!(driver_sdk::schema::validate(&schema, ex, "provider_spec").is_empty(), "{ex}");
            let spec = parse_spec(ex).unwrap();
            let labels: Labels = [("machinedriver.dev/run".to_string(), "x".to_string())].into();
            let body = scale_set_body("pool-a", &spec, "h1", 3, &labels, None).unwrap();
            assert_eq!(body["sku"]["capacity"], 3);
            assert_eq!(body["tags"]["machinedriver.dev:run"], "x");
            assert_eq!(body["properties"]["upgradePolicy"]["mode"], "Manual");
            let typed: VirtualMachineScaleSet = serde_json::from_value(body).unwrap();
            assert!(matches(&typed, "h1", 3, &labels));
            assert!(!matches(&typed, "h2", 3, &labels));
            assert!(!matches(&typed, "h1", 4, &labels));
            assert_eq!(pool_of(&typed).labels.get("machinedriver.dev/run").map(String::as_str), Some("x"));
        }
    }

    #[test]
    fn image_needs_marketplace_or_id() {
        let bad = json!({"location": "westeurope", "vmSize": "Standard_D2s_v5", "image": {"publisher": "Canonical"}});
        let err = parse_spec(&bad).unwrap_err();
        assert_eq!(err.violations()[0].field, "provider_spec.image");
    }

    #[test]
    fn instance_view_maps_to_states() {
        let vm: VirtualMachineScaleSetVm = serde_json::from_value(json!({
            "location": "westeurope", "instanceId": "3", "name": "p_3", "id": "/subscriptions/s/x/virtualMachines/3",
            "properties": {"provisioningState": "Succeeded", "latestModelApplied": true,
                "timeCreated": "2026-01-01T00:00:00Z", "osProfile": {"computerName": "p000003"},
                "instanceView": {"statuses": [
                    {"code": "ProvisioningState/succeeded", "level": "Info"},
                    {"code": "PowerState/running", "level": "Info"}]}}
        }))
        .unwrap();
        let i = instance_of(&vm);
        assert_eq!((i.instance_id.as_str(), i.power_state, i.latest_model_applied), ("3", PowerState::Running, true));
        assert_eq!(i.provider_id, "azure:///subscriptions/s/x/virtualMachines/3");
        assert!(i.create_time.is_some());
        assert_eq!((i.state, i.provisioning_state.as_str()), (InstanceState::Running, "Succeeded"));
    }

    #[test]
    fn arm_provisioning_states_map_to_instance_states() {
        for (arm, state) in [
            ("Creating", InstanceState::Creating),
            ("Succeeded", InstanceState::Running),
            ("Updating", InstanceState::Updating),
            ("Migrating", InstanceState::Updating),
            ("Deleting", InstanceState::Deleting),
            ("Failed", InstanceState::Failed),
            ("Canceled", InstanceState::Creating),
            ("", InstanceState::Creating),
        ] {
            assert_eq!(instance_state(arm), state, "{arm:?}");
        }
    }
}

/// vCPUs, memory (GiB) and GPUs of common Azure VM sizes, as Microsoft publishes them
/// (case-insensitive names); `None` for a size not in the table.
pub fn vm_size_capacity(vm_size: &str) -> Option<(u32, u32, u32)> {
    const SIZES: &[(&str, u32, u32, u32)] = &[
        ("Standard_B1s", 1, 1, 0),
        ("Standard_B1ms", 1, 2, 0),
        ("Standard_B2s", 2, 4, 0),
        ("Standard_B2ms", 2, 8, 0),
        ("Standard_B4ms", 4, 16, 0),
        ("Standard_D2s_v3", 2, 8, 0),
        ("Standard_D4s_v3", 4, 16, 0),
        ("Standard_D8s_v3", 8, 32, 0),
        ("Standard_D2s_v5", 2, 8, 0),
        ("Standard_D4s_v5", 4, 16, 0),
        ("Standard_D8s_v5", 8, 32, 0),
        ("Standard_D2ds_v5", 2, 8, 0),
        ("Standard_D4ds_v5", 4, 16, 0),
        ("Standard_E2s_v5", 2, 16, 0),
        ("Standard_E4s_v5", 4, 32, 0),
        ("Standard_F2s_v2", 2, 4, 0),
        ("Standard_F4s_v2", 4, 8, 0),
        ("Standard_DS1_v2", 1, 3, 0),
        ("Standard_DS2_v2", 2, 7, 0),
        ("Standard_NC6s_v3", 6, 112, 1),
        ("Standard_NC4as_T4_v3", 4, 28, 1),
    ];
    SIZES.iter().find(|(name, ..)| name.eq_ignore_ascii_case(vm_size)).map(|&(_, c, m, g)| (c, m, g))
}

#[cfg(test)]
mod size_tests {
    #[test]
    fn known_sizes_have_their_published_capacity_and_unknown_ones_none() {
        assert_eq!(super::vm_size_capacity("standard_d2s_v3"), Some((2, 8, 0)));
        assert_eq!(super::vm_size_capacity("Standard_NC6s_v3"), Some((6, 112, 1)));
        assert_eq!(super::vm_size_capacity("Standard_Unheard_of"), None);
    }
}
