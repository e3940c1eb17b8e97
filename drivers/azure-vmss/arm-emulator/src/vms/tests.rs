//! VM, NIC and disk endpoints, driven through the router with the common request handling.

use std::time::Duration;

use axum::body::{to_bytes, Body};
use axum::http::{HeaderMap, Request, StatusCode};
use axum::Router;
use serde_json::{json, Value};
use tower::ServiceExt;

use crate::{Config, Emulator, API_VERSION};

const RG: &str = "/subscriptions/sub/resourceGroups/rg/providers";

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Value,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    fn statuses(&self) -> Vec<String> {
        let iv = if self.body["statuses"].is_array() { &self.body } else { &self.body["properties"]["instanceView"] };
        iv["statuses"].as_array().unwrap().iter().map(|s| s["code"].as_str().unwrap().to_string()).collect()
    }
}

async fn send(router: &Router, method: &str, uri: &str, body: Option<Value>) -> Reply {
    send_as(router, method, uri, body, Some("Bearer t")).await
}

async fn send_as(router: &Router, method: &str, uri: &str, body: Option<Value>, auth: Option<&str>) -> Reply {
    let uri = if uri.starts_with("http") { uri.to_string() } else { format!("http://arm.test{uri}") };
    let uri = if uri.contains("api-version=") {
        uri
    } else {
        format!("{uri}{}api-version={API_VERSION}", if uri.contains('?') { '&' } else { '?' })
    };
    let mut req = Request::builder()
        .method(method)
        .uri(&uri)
        .header("host", "arm.test")
        .header("x-ms-client-request-id", "client-1");
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    let req = req.body(body.map(|b| Body::from(b.to_string())).unwrap_or_else(Body::empty)).unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), router.clone().oneshot(req)).await.unwrap().unwrap();
    let (parts, body) = resp.into_parts();
    let bytes = tokio::time::timeout(Duration::from_secs(10), to_bytes(body, 1 << 20)).await.unwrap().unwrap();
    let body = if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).unwrap_or(Value::Null) };
    Reply { status: parts.status, headers: parts.headers, body }
}

fn emulator(duration: Duration) -> (Emulator, Router) {
    let emu = Emulator::new(Config {
        operation_duration: duration,
        delete_duration: duration,
        page_size: 2,
        ..Config::default()
    });
    let router = emu.router();
    (emu, router)
}

fn flex_set(name: &str) -> (String, Value) {
    (
        format!("{RG}/Microsoft.Compute/virtualMachineScaleSets/{name}"),
        json!({"location": "westeurope", "properties": {"orchestrationMode": "Flexible", "platformFaultDomainCount": 1}}),
    )
}

fn vm_uri(name: &str) -> String {
    format!("{RG}/Microsoft.Compute/virtualMachines/{name}")
}

fn vm_body(scale_set: Option<&str>, delete_option: Option<&str>) -> Value {
    let mut nic = json!({"name": "nic", "properties": {"primary": true, "ipConfigurations": [{"name": "ipconfig1",
        "properties": {"subnet": {"id": format!("{RG}/Microsoft.Network/virtualNetworks/v/subnets/s")}}}]}});
    let mut disk = json!({"createOption": "FromImage", "managedDisk": {"storageAccountType": "Premium_LRS"}});
    if let Some(d) = delete_option {
        nic["properties"]["deleteOption"] = json!(d);
        disk["deleteOption"] = json!(d);
    }
    let mut body = json!({
        "location": "westeurope",
        "tags": {"owner": "test"},
        "properties": {
            "hardwareProfile": {"vmSize": "Standard_D2s_v5"},
            "storageProfile": {"imageReference": {"publisher": "Canonical", "offer": "o", "sku": "s", "version": "latest"}, "osDisk": disk},
            "osProfile": {"computerName": "web", "adminUsername": "azureuser", "customData": "c2VjcmV0"},
            "networkProfile": {"networkApiVersion": "2020-11-01", "networkInterfaceConfigurations": [nic]},
        },
    });
    if let Some(ss) = scale_set {
        body["properties"]["virtualMachineScaleSet"] = json!({"id": ss});
    }
    body
}

async fn put_flex(router: &Router, name: &str) -> String {
    let (uri, body) = flex_set(name);
    let r = send(router, "PUT", &uri, Some(body)).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    uri.replace(RG, "/subscriptions/sub/resourceGroups/rg/providers")
}

fn resource(id: &Value) -> String {
    id.as_str().unwrap().to_string()
}

#[tokio::test]
async fn create_runs_and_delete_takes_nic_and_disk() {
    let (_emu, router) = emulator(Duration::ZERO);
    let ss = put_flex(&router, "flex").await;
    let created = send(&router, "PUT", &vm_uri("web-1"), Some(vm_body(Some(&ss), Some("Delete")))).await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    assert_eq!(created.body["properties"]["provisioningState"], "Creating");
    assert!(created.body["properties"]["osProfile"].get("customData").is_none(), "secrets are never shown");
    assert_eq!(created.header("x-ms-client-request-id"), Some("client-1"));
    assert!(created.header("x-ms-request-id").is_some_and(|id| !id.is_empty()));

    let got = send(&router, "GET", &format!("{}?$expand=instanceView", vm_uri("web-1")), None).await;
    assert_eq!(got.status, StatusCode::OK);
    assert_eq!(got.body["properties"]["provisioningState"], "Succeeded");
    assert_eq!(got.statuses(), ["ProvisioningState/succeeded", "PowerState/running"]);
    assert_eq!(got.body["properties"]["virtualMachineScaleSet"]["id"], json!(ss));
    let iv = send(&router, "GET", &format!("{}/instanceView", vm_uri("web-1")), None).await;
    assert_eq!(iv.statuses(), ["ProvisioningState/succeeded", "PowerState/running"]);
    assert_eq!(iv.body["computerName"], "web");

    let nic_id = resource(&got.body["properties"]["networkProfile"]["networkInterfaces"][0]["id"]);
    assert!(nic_id.ends_with("/Microsoft.Network/networkInterfaces/web-1-nic-0"), "{nic_id}");
    let disk_id = resource(&got.body["properties"]["storageProfile"]["osDisk"]["managedDisk"]["id"]);
    assert!(disk_id.contains("/Microsoft.Compute/disks/web-1_OsDisk_1_"), "{disk_id}");
    let nic = send(&router, "GET", &format!("{nic_id}?api-version=2024-05-01"), None).await;
    assert_eq!(nic.status, StatusCode::OK);
    assert_eq!(nic.body["properties"]["ipConfigurations"][0]["properties"]["privateIPAddress"], "10.0.0.4");
    assert_eq!(nic.body["properties"]["virtualMachine"]["id"], json!(vm_uri("web-1")));
    let disk = send(&router, "GET", &format!("{disk_id}?api-version=2024-03-02"), None).await;
    assert_eq!(disk.body["managedBy"], json!(vm_uri("web-1")));
    let set = send(&router, "GET", &ss, None).await;
    assert_eq!(set.body["properties"]["orchestrationMode"], "Flexible");
    assert_eq!(set.body["sku"]["capacity"], 1);

    let deleted = send(&router, "DELETE", &vm_uri("web-1"), None).await;
    assert_eq!(deleted.status, StatusCode::ACCEPTED);
    assert_eq!(send(&router, "GET", &vm_uri("web-1"), None).await.status, StatusCode::NOT_FOUND);
    assert_eq!(
        send(&router, "GET", &format!("{nic_id}?api-version=2024-05-01"), None).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        send(&router, "GET", &format!("{disk_id}?api-version=2024-03-02"), None).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(send(&router, "DELETE", &vm_uri("web-1"), None).await.status, StatusCode::NO_CONTENT);
}

#[tokio::test]
async fn detach_leaves_nic_and_disk_unattached() {
    let (_emu, router) = emulator(Duration::ZERO);
    assert_eq!(send(&router, "PUT", &vm_uri("solo"), Some(vm_body(None, None))).await.status, StatusCode::CREATED);
    assert_eq!(send(&router, "DELETE", &vm_uri("solo"), None).await.status, StatusCode::ACCEPTED);
    assert_eq!(send(&router, "GET", &vm_uri("solo"), None).await.status, StatusCode::NOT_FOUND);
    let nics =
        send(&router, "GET", &format!("{RG}/Microsoft.Network/networkInterfaces?api-version=2024-05-01"), None).await;
    let nics = nics.body["value"].as_array().unwrap().clone();
    assert_eq!(nics.len(), 1);
    assert!(nics[0]["properties"].get("virtualMachine").is_none());
    let disks = send(&router, "GET", &format!("{RG}/Microsoft.Compute/disks?api-version=2024-03-02"), None).await;
    let disks = disks.body["value"].as_array().unwrap().clone();
    assert_eq!(disks.len(), 1);
    assert_eq!(disks[0]["properties"]["diskState"], "Unattached");
    // Detached, they can be deleted; a leftover NIC joins a new VM by reference.
    let disk_id = resource(&disks[0]["id"]);
    assert_eq!(
        send(&router, "DELETE", &format!("{disk_id}?api-version=2024-03-02"), None).await.status,
        StatusCode::OK
    );
    let mut again = vm_body(None, None);
    again["properties"]["networkProfile"] =
        json!({"networkInterfaces": [{"id": nics[0]["id"], "properties": {"deleteOption": "Delete"}}]});
    assert_eq!(send(&router, "PUT", &vm_uri("solo2"), Some(again)).await.status, StatusCode::CREATED);
    let nic_uri = format!("{}?api-version=2024-05-01", resource(&nics[0]["id"]));
    assert_eq!(send(&router, "DELETE", &nic_uri, None).await.status, StatusCode::BAD_REQUEST, "attached: NicInUse");
    send(&router, "DELETE", &vm_uri("solo2"), None).await;
    assert_eq!(send(&router, "GET", &nic_uri, None).await.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn the_same_put_twice_is_one_vm_and_only_tags_and_size_change_in_place() {
    let (_emu, router) = emulator(Duration::ZERO);
    let body = vm_body(None, Some("Delete"));
    assert_eq!(send(&router, "PUT", &vm_uri("a"), Some(body.clone())).await.status, StatusCode::CREATED);
    let second = send(&router, "PUT", &vm_uri("a"), Some(body.clone())).await;
    assert_eq!(second.status, StatusCode::OK);
    assert_eq!(second.body["properties"]["provisioningState"], "Succeeded", "a no-op update");
    let op = send(&router, "GET", second.header("azure-asyncoperation").unwrap(), None).await;
    assert_eq!(op.body["status"], "Succeeded");
    let list = send(&router, "GET", &format!("{RG}/Microsoft.Compute/virtualMachines"), None).await;
    assert_eq!(list.body["value"].as_array().unwrap().len(), 1);
    let nics =
        send(&router, "GET", &format!("{RG}/Microsoft.Network/networkInterfaces?api-version=2024-05-01"), None).await;
    assert_eq!(nics.body["value"].as_array().unwrap().len(), 1);

    let mut resized = body.clone();
    resized["properties"]["hardwareProfile"]["vmSize"] = json!("Standard_D4s_v5");
    resized["tags"] = json!({"owner": "test", "hash": "2"});
    let r = send(&router, "PUT", &vm_uri("a"), Some(resized)).await;
    assert_eq!((r.status, r.body["properties"]["provisioningState"].as_str()), (StatusCode::OK, Some("Updating")));
    let patched = send(&router, "PATCH", &vm_uri("a"), Some(json!({"tags": {"only": "this"}}))).await;
    assert_eq!(patched.status, StatusCode::OK);
    assert_eq!(patched.body["tags"], json!({"only": "this"}), "PATCH replaces the tags");
    assert_eq!(patched.body["properties"]["hardwareProfile"]["vmSize"], "Standard_D4s_v5");

    let mut reimaged = body;
    reimaged["properties"]["storageProfile"]["imageReference"]["version"] = json!("1.2.3");
    let r = send(&router, "PUT", &vm_uri("a"), Some(reimaged)).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.body["error"]["code"], "PropertyChangeNotAllowed");
    assert_eq!(r.body["error"]["target"], "storageProfile.imageReference.version");
}

#[tokio::test]
async fn listings_page_with_absolute_next_links_and_filter_by_scale_set() {
    let (_emu, router) = emulator(Duration::ZERO);
    let ss = put_flex(&router, "flex").await;
    for i in 0..5 {
        let member = if i % 2 == 0 { Some(ss.as_str()) } else { None };
        let r = send(&router, "PUT", &vm_uri(&format!("vm-{i}")), Some(vm_body(member, None))).await;
        assert_eq!(r.status, StatusCode::CREATED);
    }
    async fn all(router: &Router, first: &str) -> (Vec<String>, usize) {
        let (mut names, mut pages, mut next) = (Vec::new(), 0, Some(first.to_string()));
        while let Some(uri) = next.take() {
            let page = send(router, "GET", &uri, None).await;
            assert_eq!(page.status, StatusCode::OK, "{}", page.body);
            pages += 1;
            for vm in page.body["value"].as_array().unwrap() {
                assert!(vm["properties"]["instanceView"].is_object() == uri.contains("xpand"));
                names.push(vm["name"].as_str().unwrap().to_string());
            }
            next = page.body["nextLink"].as_str().map(str::to_string);
            if let Some(n) = &next {
                assert!(n.starts_with("http://arm.test/"), "{n}");
            }
        }
        (names, pages)
    }
    let (names, pages) = all(&router, &format!("{RG}/Microsoft.Compute/virtualMachines?$expand=instanceView")).await;
    assert_eq!(
        (names, pages),
        (vec!["vm-0", "vm-1", "vm-2", "vm-3", "vm-4"].into_iter().map(String::from).collect(), 3)
    );
    let (names, _) = all(&router, "/subscriptions/sub/providers/Microsoft.Compute/virtualMachines").await;
    assert_eq!(names.len(), 5);
    let filter =
        format!("{RG}/Microsoft.Compute/virtualMachines?%24filter=virtualMachineScaleSet%2Fid%20eq%20%27{ss}%27");
    let (names, pages) = all(&router, &filter).await;
    assert_eq!((names, pages), (vec!["vm-0".to_string(), "vm-2".into(), "vm-4".into()], 2));
}

#[tokio::test]
async fn joining_a_missing_or_uniform_scale_set_is_refused() {
    let (emu, router) = emulator(Duration::ZERO);
    let missing = format!("{RG}/Microsoft.Compute/virtualMachineScaleSets/nope");
    let r = send(&router, "PUT", &vm_uri("x"), Some(vm_body(Some(&missing), None))).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.body["error"]["code"], "InvalidParameter");
    assert_eq!(r.body["error"]["target"], "properties.virtualMachineScaleSet.id");
    assert_eq!(r.header("x-ms-error-code"), Some("InvalidParameter"));

    let uniform = format!("{RG}/Microsoft.Compute/virtualMachineScaleSets/uni");
    let body = json!({"location": "westeurope", "sku": {"name": "Standard_D2s_v5", "capacity": 0},
        "properties": {"virtualMachineProfile": {"storageProfile": {"imageReference": {"publisher": "x"}}}}});
    assert_eq!(send(&router, "PUT", &uniform, Some(body)).await.status, StatusCode::CREATED);
    let r = send(&router, "PUT", &vm_uri("x"), Some(vm_body(Some(&uniform), None))).await;
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("OperationNotAllowed")));
    {
        let cloud = emu.lock();
        assert!(cloud.vms.is_empty() && cloud.nics.is_empty() && cloud.disks.is_empty(), "nothing left behind");
    }

    // A Flexible scale set creates no instances of its own and keeps its mode.
    let (flex, mut body) = flex_set("f");
    body["sku"] = json!({"name": "Standard_D2s_v5", "capacity": 2});
    assert_eq!(send(&router, "PUT", &flex, Some(body)).await.status, StatusCode::BAD_REQUEST);
    put_flex(&router, "f").await;
    let (_, mut uniform_again) = flex_set("f");
    uniform_again["properties"]["orchestrationMode"] = json!("Uniform");
    let r = send(&router, "PUT", &flex, Some(uniform_again)).await;
    assert_eq!(r.body["error"]["code"], "PropertyChangeNotAllowed");
    let r = send(&router, "GET", &format!("{flex}/virtualMachines"), None).await;
    assert_eq!(r.body["error"]["code"], "OperationNotAllowed");
}

#[tokio::test]
async fn long_running_calls_carry_async_headers_and_finish_on_their_time() {
    let (_emu, router) = emulator(Duration::from_secs(3600));
    let ss = put_flex(&router, "flex").await;
    let vm = vm_uri("slow");
    let created = send(&router, "PUT", &vm, Some(vm_body(Some(&ss), Some("Delete")))).await;
    let async_url = created.header("azure-asyncoperation").unwrap().to_string();
    let location = created.header("location").unwrap().to_string();
    assert!(async_url
        .starts_with("http://arm.test/subscriptions/sub/providers/Microsoft.Compute/locations/westeurope/operations/"));
    assert_eq!(created.header("retry-after"), Some("1"));
    assert_eq!(send(&router, "GET", &async_url, None).await.body["status"], "InProgress");
    assert_eq!(send(&router, "GET", &location, None).await.status, StatusCode::ACCEPTED);
    let iv = send(&router, "GET", &format!("{vm}/instanceView"), None).await;
    assert_eq!(iv.statuses(), ["ProvisioningState/creating", "PowerState/starting"]);
    // The same PUT again joins the running create; a different one conflicts; so does a delete.
    let again = send(&router, "PUT", &vm, Some(vm_body(Some(&ss), Some("Delete")))).await;
    assert_eq!((again.status, again.header("azure-asyncoperation")), (StatusCode::OK, Some(async_url.as_str())));
    let mut other = vm_body(Some(&ss), Some("Delete"));
    other["tags"] = json!({"x": "y"});
    assert_eq!(send(&router, "PUT", &vm, Some(other)).await.status, StatusCode::CONFLICT);
    assert_eq!(send(&router, "DELETE", &vm, None).await.status, StatusCode::CONFLICT);

    let finish = json!([{"action": "finishOperations", "pathContains": "/operations/", "times": 1}]);
    let r = send(&router, "PUT", "/_emulator/faults", Some(finish)).await;
    assert_eq!(r.status, StatusCode::OK);
    let done = send(&router, "GET", &location, None).await;
    assert_eq!(
        (done.status, done.body["properties"]["provisioningState"].as_str()),
        (StatusCode::OK, Some("Succeeded"))
    );

    let deleted = send(&router, "DELETE", &vm, None).await;
    assert_eq!(deleted.status, StatusCode::ACCEPTED);
    for h in ["azure-asyncoperation", "location", "retry-after"] {
        assert!(deleted.header(h).is_some(), "{h}");
    }
    let again = send(&router, "DELETE", &vm, None).await;
    assert_eq!(again.header("azure-asyncoperation"), deleted.header("azure-asyncoperation"), "same operation");
    assert_eq!(send(&router, "GET", &vm, None).await.body["properties"]["provisioningState"], "Deleting");
}

#[tokio::test]
async fn fault_rules_throttling_and_auth_apply_to_vm_calls() {
    let (emu, router) = emulator(Duration::ZERO);
    let rules = json!([
        {"method": "PUT", "pathContains": "/virtualmachines/", "action": "respond", "status": 429, "retryAfter": 7, "times": 1},
        {"method": "PUT", "pathContains": "/virtualmachines/", "action": "failOperation", "code": "AllocationFailed", "times": 1},
    ]);
    assert_eq!(send(&router, "PUT", "/_emulator/faults", Some(rules)).await.status, StatusCode::OK);
    let throttled = send(&router, "PUT", &vm_uri("f"), Some(vm_body(None, None))).await;
    assert_eq!(throttled.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(throttled.header("retry-after"), Some("7"));
    assert!(emu.lock().vms.is_empty(), "a throttled PUT creates nothing");
    let created = send(&router, "PUT", &vm_uri("f"), Some(vm_body(None, None))).await;
    assert_eq!(created.status, StatusCode::CREATED);
    let op = send(&router, "GET", created.header("azure-asyncoperation").unwrap(), None).await;
    assert_eq!(
        (op.body["status"].as_str(), op.body["error"]["code"].as_str()),
        (Some("Failed"), Some("AllocationFailed"))
    );
    let iv = send(&router, "GET", &format!("{}/instanceView", vm_uri("f")), None).await;
    assert_eq!(iv.statuses(), ["ProvisioningState/failed/AllocationFailed", "PowerState/stopped"]);
    let faults = send(&router, "GET", "/_emulator/faults", None).await;
    assert!(faults.body.as_array().unwrap().iter().all(|f| f["fired"] == 1));

    let anonymous = send_as(&router, "GET", &vm_uri("f"), None, None).await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);
    assert_eq!(anonymous.header("x-ms-client-request-id"), Some("client-1"));
    let log = send(&router, "GET", "/_emulator/requests", None).await;
    let log = log.body.as_array().unwrap().clone();
    assert!(log.iter().all(|r| r["clientRequestId"] == "client-1"));
    assert_eq!(log.iter().filter(|r| r["method"] == "PUT" && r["path"] == vm_uri("f")).count(), 2);
}

#[tokio::test]
async fn deleting_a_flexible_scale_set_takes_its_vms() {
    let (emu, router) = emulator(Duration::ZERO);
    let ss = put_flex(&router, "flex").await;
    send(&router, "PUT", &vm_uri("m"), Some(vm_body(Some(&ss), Some("Delete")))).await;
    send(&router, "PUT", &vm_uri("keep"), Some(vm_body(None, Some("Delete")))).await;
    assert_eq!(send(&router, "DELETE", &ss, None).await.status, StatusCode::ACCEPTED);
    assert_eq!(send(&router, "GET", &ss, None).await.status, StatusCode::NOT_FOUND);
    assert_eq!(send(&router, "GET", &vm_uri("m"), None).await.status, StatusCode::NOT_FOUND);
    assert_eq!(send(&router, "GET", &vm_uri("keep"), None).await.status, StatusCode::OK);
    assert_eq!(emu.lock().nics.len(), 1);
    let inventory = send(&router, "GET", "/_emulator/vms", None).await;
    assert_eq!(inventory.body.as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn a_zone_without_capacity_fails_its_vms_and_one_without_the_size_refuses_them() {
    let (emu, router) = emulator(Duration::ZERO);
    let zoned = |zone: &str| {
        let mut b = vm_body(None, Some("Delete"));
        b["zones"] = json!([zone]);
        b
    };
    let rules =
        json!([{"zone": "2", "refuse": "capacity"}, {"zone": "3", "refuse": "sku", "vmSize": "standard_d2s_v5"}]);
    assert_eq!(send(&router, "PUT", "/_emulator/zones", Some(rules.clone())).await.status, StatusCode::OK);
    assert_eq!(send(&router, "GET", "/_emulator/zones", None).await.body[0]["refuse"], "capacity");

    // Zone 2: accepted, then the operation fails with ARM's code; the VM stays, Failed.
    let created = send(&router, "PUT", &vm_uri("z2"), Some(zoned("2"))).await;
    assert_eq!(created.status, StatusCode::CREATED);
    let op = send(&router, "GET", created.header("azure-asyncoperation").unwrap(), None).await;
    assert_eq!(
        (op.body["status"].as_str(), op.body["error"]["code"].as_str()),
        (Some("Failed"), Some("ZonalAllocationFailed"))
    );
    assert!(op.body["error"]["message"].as_str().unwrap().contains("sufficient capacity"), "{}", op.body);
    let monitor = send(&router, "GET", created.header("location").unwrap(), None).await;
    assert_eq!(monitor.body["error"]["code"], "ZonalAllocationFailed");
    let iv = send(&router, "GET", &format!("{}/instanceView", vm_uri("z2")), None).await;
    assert_eq!(iv.statuses(), ["ProvisioningState/failed/ZonalAllocationFailed", "PowerState/stopped"]);
    // Applying it again tries the zone again: it still has no room.
    let again = send(&router, "PUT", &vm_uri("z2"), Some(zoned("2"))).await;
    assert_eq!(again.status, StatusCode::OK);
    let op = send(&router, "GET", again.header("azure-asyncoperation").unwrap(), None).await;
    assert_eq!(op.body["error"]["code"], "ZonalAllocationFailed");
    // Zone 3 does not offer the size: 409 at once, nothing created; another size is fine.
    let refused = send(&router, "PUT", &vm_uri("z3"), Some(zoned("3"))).await;
    assert_eq!(
        (refused.status, refused.body["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("SkuNotAvailable"))
    );
    assert!(refused.body["error"]["message"].as_str().unwrap().contains("zones '3'"), "{}", refused.body);
    assert!(emu.lock().vms.keys().all(|k| !k.ends_with("/z3")));
    let mut other = zoned("3");
    other["properties"]["hardwareProfile"]["vmSize"] = json!("Standard_D4s_v5");
    assert_eq!(send(&router, "PUT", &vm_uri("z3"), Some(other)).await.status, StatusCode::CREATED);
    // Zone 1 takes it; the inventory shows the zones.
    let created = send(&router, "PUT", &vm_uri("z1"), Some(zoned("1"))).await;
    let op = send(&router, "GET", created.header("azure-asyncoperation").unwrap(), None).await;
    assert_eq!(op.body["status"], "Succeeded");
    let inventory = send(&router, "GET", "/_emulator/vms", None).await;
    let zone_of = |name: &str| {
        let vms = inventory.body.as_array().unwrap();
        let vm = vms.iter().find(|v| v["id"].as_str().unwrap().ends_with(&format!("/{name}"))).unwrap();
        (vm["zones"].clone(), vm["provisioningState"].as_str().unwrap().to_string())
    };
    assert_eq!(zone_of("z1"), (json!(["1"]), "Succeeded".to_string()));
    assert_eq!(zone_of("z2"), (json!(["2"]), "Failed".to_string()));
    // Once zone 2 has room again, the failed VM is created by the same PUT.
    assert_eq!(send(&router, "PUT", "/_emulator/zones", Some(json!([]))).await.status, StatusCode::OK);
    let again = send(&router, "PUT", &vm_uri("z2"), Some(zoned("2"))).await;
    let op = send(&router, "GET", again.header("azure-asyncoperation").unwrap(), None).await;
    assert_eq!(op.body["status"], "Succeeded");
    let bad = send(&router, "PUT", "/_emulator/zones", Some(json!([{"zone": "1", "refuse": "everything"}]))).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn a_zone_without_capacity_fails_only_the_scale_set_instances_placed_in_it() {
    let (emu, router) = emulator(Duration::ZERO);
    let rules = json!([{"zone": "2", "refuse": "capacity"}]);
    assert_eq!(send(&router, "PUT", "/_emulator/zones", Some(rules)).await.status, StatusCode::OK);
    let uri = format!("{RG}/Microsoft.Compute/virtualMachineScaleSets/pool");
    let body = json!({"location": "westeurope", "zones": ["1", "2"], "sku": {"name": "Standard_D2s_v5", "capacity": 4},
        "properties": {"virtualMachineProfile": {"storageProfile": {"imageReference": {"publisher": "x"}}}}});
    let put = send(&router, "PUT", &uri, Some(body)).await;
    assert_eq!(put.status, StatusCode::CREATED);
    let op = send(&router, "GET", put.header("azure-asyncoperation").unwrap(), None).await;
    assert_eq!(op.body["error"]["code"], "ZonalAllocationFailed");
    let list = send(&router, "GET", &format!("{uri}/virtualMachines?$skiptoken=0"), None).await;
    let mut states: Vec<(String, String)> = Vec::new();
    for page in [list.body.clone(), send(&router, "GET", list.body["nextLink"].as_str().unwrap(), None).await.body] {
        for vm in page["value"].as_array().unwrap() {
            states.push((
                vm["zones"][0].as_str().unwrap().into(),
                vm["properties"]["provisioningState"].as_str().unwrap().into(),
            ));
        }
    }
    let want = [("1", "Succeeded"), ("2", "Failed"), ("1", "Succeeded"), ("2", "Failed")];
    assert_eq!(states, want.map(|(z, s)| (z.to_string(), s.to_string())));
    // A size the zone does not offer refuses the scale-out at once.
    let rules = json!([{"zone": "2", "refuse": "sku"}]);
    assert_eq!(send(&router, "PUT", "/_emulator/zones", Some(rules)).await.status, StatusCode::OK);
    let body = json!({"location": "westeurope", "zones": ["1", "2"], "sku": {"name": "Standard_D2s_v5", "capacity": 6},
        "properties": {"virtualMachineProfile": {"storageProfile": {"imageReference": {"publisher": "x"}}}}});
    let put = send(&router, "PUT", &uri, Some(body)).await;
    assert_eq!((put.status, put.body["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("SkuNotAvailable")));
    assert_eq!(emu.lock().scale_sets.values().next().map(|s| s.vms.len()), Some(4));
}

#[tokio::test]
async fn spot_fields_are_checked_stored_and_simulated_evictions_deallocate_or_delete() {
    let (_emu, router) = emulator(Duration::ZERO);
    let with = |priority: Option<&str>, policy: Option<&str>, max: Option<Value>| {
        let mut b = vm_body(None, Some("Delete"));
        if let Some(p) = priority {
            b["properties"]["priority"] = json!(p);
        }
        if let Some(p) = policy {
            b["properties"]["evictionPolicy"] = json!(p);
        }
        if let Some(m) = max {
            b["properties"]["billingProfile"] = json!({"maxPrice": m});
        }
        b
    };
    // What ARM refuses on a Regular VM, and a bad price.
    let r = send(&router, "PUT", &vm_uri("bad"), Some(with(Some("Regular"), Some("Delete"), None))).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.body["error"]["code"], "EvictionPolicyCanBeSetOnlyOnAzureSpotVirtualMachines", "{}", r.body);
    let r = send(&router, "PUT", &vm_uri("bad"), Some(with(None, None, Some(json!(0.5))))).await;
    assert_eq!((r.status, &r.body["error"]["target"]), (StatusCode::BAD_REQUEST, &json!("billingProfile.maxPrice")));
    let r = send(&router, "PUT", &vm_uri("bad"), Some(with(Some("Spot"), None, Some(json!(0))))).await;
    assert_eq!((r.status, &r.body["error"]["target"]), (StatusCode::BAD_REQUEST, &json!("billingProfile.maxPrice")));

    // A Spot VM keeps its fields; ARM's default eviction policy is Deallocate.
    let r = send(&router, "PUT", &vm_uri("spot-d"), Some(with(Some("Spot"), None, Some(json!(-1))))).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    let got = send(&router, "GET", &vm_uri("spot-d"), None).await.body;
    assert_eq!(got["properties"]["priority"], "Spot");
    assert_eq!(got["properties"]["evictionPolicy"], "Deallocate");
    assert_eq!(got["properties"]["billingProfile"]["maxPrice"], -1);
    let r = send(&router, "PUT", &vm_uri("spot-x"), Some(with(Some("Spot"), Some("Delete"), None))).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    let r = send(&router, "PUT", &vm_uri("regular"), Some(with(None, None, None))).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);

    // Only Spot VMs are evicted.
    let r = send(&router, "POST", &format!("{}/simulateEviction", vm_uri("regular")), None).await;
    assert_eq!((r.status, &r.body["error"]["code"]), (StatusCode::CONFLICT, &json!("OperationNotAllowed")));
    let r = send(&router, "POST", &format!("{}/simulateEviction", vm_uri("nope")), None).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = send(&router, "POST", &format!("{}/simulateEviction", vm_uri("spot-d")), None).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT, "{}", r.body);
    let iv = send(&router, "GET", &format!("{}/instanceView", vm_uri("spot-d")), None).await;
    assert_eq!(iv.statuses(), ["ProvisioningState/succeeded", "PowerState/deallocated"]);
    assert!(iv.body["statuses"][0]["time"].is_string(), "{}", iv.body);
    // Evicted already: not again.
    let r = send(&router, "POST", &format!("{}/simulateEviction", vm_uri("spot-d")), None).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    let r = send(&router, "POST", &format!("{}/simulateEviction", vm_uri("spot-x")), None).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert_eq!(send(&router, "GET", &vm_uri("spot-x"), None).await.status, StatusCode::NOT_FOUND);

    // Deallocate and power off, as the portal does behind a driver's back.
    let r = send(&router, "POST", &format!("{}/deallocate", vm_uri("regular")), None).await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.body);
    let iv = send(&router, "GET", &format!("{}/instanceView", vm_uri("regular")), None).await;
    assert_eq!(iv.statuses(), ["ProvisioningState/succeeded", "PowerState/deallocated"]);
}
