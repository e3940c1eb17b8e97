//! The cloud's own moves (the `Events` capability), seen after the fact from ARM: the driver
//! lists the VMs of every resource group it has machines in, one listing per resource group and
//! poll (`GET …/resourceGroups/{rg}/providers/Microsoft.Compute/virtualMachines?$expand=instanceView`,
//! following `nextLink`), every `--event-poll-interval`, and turns what nobody asked for into
//! events:
//!
//! | seen | event | `event_id` |
//! |---|---|---|
//! | a machine VM `Succeeded` and `PowerState/deallocated` or `…/stopped` | `STOPPED`, action stop | `{vmId}/stopped/{time of its ProvisioningState status}` |
//! | a machine VM `Deleting` that the driver did not delete, or gone from the listing | `TERMINATED`, action terminate | `{vmId}/terminated` |
//!
//! The driver knows its own moves: a VM whose `DeleteMachine` it sent is never reported (until
//! it is seen running again, when that delete failed); the driver stops no VM itself. A Spot VM
//! that stopped or vanished says so in the message ("most likely a spot eviction"): ARM's VM
//! and instance view have no field saying that a VM was evicted, so the driver cannot know it for
//! sure. Scheduled Events (the eviction notice of about 30 s, maintenance) are delivered inside
//! the VM only (IMDS), so the driver never reports `SPOT_INTERRUPTION` or
//! `SCHEDULED_MAINTENANCE`; the controller gets those from node-problem-detector's Node
//! conditions.
//!
//! What it cannot see: a resource group is polled once the driver has served a machine call
//! there (or it is the `--subscription-id`/`--resource-group` default), with that call's
//! credential; a VM created and deleted between two polls; a deletion that happened while the
//! sidecar was down (the VM is gone before this process ever listed it). A VM already stopped
//! when the sidecar starts is reported (the same `event_id` as before, which the controller
//! recorded); one found `Deleting` by the first listing of its resource group is not (it may be
//! a delete this driver sent before it restarted). A `TERMINATED` event is kept and yielded
//! again each poll until it is acknowledged; a `STOPPED` one is yielded while the VM stays
//! stopped (the SDK drops the repeats).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use azure_core::Method;
use driver_sdk::{lock, CapacityType, CloudAction, EventKind, MachineEvent, Offering, RequestContext};
use serde_json::Value;

use crate::arm::ArmClient;
use crate::vm::{self, NAME_TAG};
use crate::ResourceId;

/// `--event-poll-interval` by default: one listing per resource group every half minute.
pub const DEFAULT_EVENT_POLL_INTERVAL: Duration = Duration::from_secs(30);
/// Time limit of one listing call.
const LIST_TIMEOUT: Duration = Duration::from_secs(30);
/// Pages of one listing followed at most.
const MAX_PAGES: usize = 100;

/// A subscription and resource group, lower-cased (ARM names are case-insensitive).
type Scope = (String, String);

/// A machine VM as the last listing showed it.
#[derive(Debug, Clone)]
struct Known {
    scope: Scope,
    template: MachineEvent,
    vm_id: String,
    spot: bool,
    delete_on_eviction: bool,
    /// false when first seen `Deleting` by the first listing of its scope: maybe a delete of
    /// this driver from before a restart, so its end is not reported.
    origin_known: bool,
    /// Its `TERMINATED` was emitted already.
    reported: bool,
}

#[derive(Debug, Default)]
struct State {
    /// Where machines live, with the client (credential) of the last call there.
    scopes: BTreeMap<Scope, (ResourceId, ArmClient)>,
    /// Scopes listed successfully at least once.
    listed: HashSet<Scope>,
    known: HashMap<String, Known>,
    /// VMs (lower-cased IDs) whose delete this driver sent, and whether a listing showed them
    /// `Deleting` since.
    own_deletes: HashMap<String, bool>,
    /// `TERMINATED` events not acknowledged yet.
    gone: BTreeMap<String, MachineEvent>,
}

/// What the event poll knows: shared by the machine RPCs (which teach it resource groups and
/// the driver's own deletes) and the stream.
#[derive(Debug, Default, Clone)]
pub struct Watch {
    state: Arc<Mutex<State>>,
}

fn scope_of(r: &ResourceId) -> Scope {
    (r.subscription.to_ascii_lowercase(), r.resource_group.to_ascii_lowercase())
}

fn key_of(r: &ResourceId) -> String {
    vm::path(r).to_ascii_lowercase()
}

impl Watch {
    /// Polls `r`'s resource group from now on, with `arm`'s credential.
    pub(crate) fn learn(&self, r: &ResourceId, arm: &ArmClient) {
        let place = ResourceId { name: String::new(), ..r.clone() };
        lock(&self.state).scopes.insert(scope_of(r), (place, arm.clone()));
    }

    /// The driver sent the delete of VM `r`: not out of band.
    pub(crate) fn deleting(&self, r: &ResourceId) {
        lock(&self.state).own_deletes.insert(key_of(r), false);
    }

    /// A caller acknowledged `event_id`.
    pub(crate) fn acked(&self, event_id: &str) {
        lock(&self.state).gone.remove(event_id);
    }

    /// One poll: a listing per known resource group, and the events it shows.
    pub(crate) async fn poll(&self) -> Vec<MachineEvent> {
        let scopes: Vec<(Scope, ResourceId, ArmClient)> =
            lock(&self.state).scopes.iter().map(|(s, (r, a))| (s.clone(), r.clone(), a.clone())).collect();
        let mut stopped = Vec::new();
        for (scope, place, arm) in scopes {
            match list(&arm, &place).await {
                Ok(vms) => stopped.extend(self.observe(&scope, &vms)),
                // Nothing is concluded from a listing that failed: no VM of it counts as gone.
                Err(e) => tracing::warn!(
                    subscription = %place.subscription, resource_group = %place.resource_group, error = %e,
                    "listing VMs for events failed; trying again next poll"
                ),
            }
        }
        let st = lock(&self.state);
        stopped.extend(st.gone.values().cloned());
        stopped
    }

    /// Compares one scope's listing with what was known; returns the `STOPPED` events and
    /// records the `TERMINATED` ones in `gone`.
    fn observe(&self, scope: &Scope, vms: &[Value]) -> Vec<MachineEvent> {
        let mut st = lock(&self.state);
        let first = st.listed.insert(scope.clone());
        let now = SystemTime::now();
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        for v in vms.iter().filter(|v| vm::tags_of(v).contains_key(NAME_TAG)) {
            let Some(id) = v["id"].as_str() else { continue };
            let key = id.to_ascii_lowercase();
            seen.insert(key.clone());
            let provisioning = vm::provisioning_state(v).to_ascii_lowercase();
            let power = power_state(v);
            if let Some(seen_deleting) = st.own_deletes.get_mut(&key) {
                // Seen `Deleting`, and now no more: that delete failed, and the VM is watched as
                // any other. (Not before: a listing sent just before the delete still shows the
                // VM as it was.)
                if provisioning == "deleting" {
                    *seen_deleting = true;
                }
                if *seen_deleting && provisioning != "deleting" {
                    st.own_deletes.remove(&key);
                } else {
                    st.known.remove(&key);
                    continue;
                }
            }
            let fresh = known_of(scope, v, now, !(first && provisioning == "deleting"));
            let k = st.known.entry(key.clone()).or_insert(fresh.clone());
            k.template = fresh.template;
            k.spot = fresh.spot;
            k.delete_on_eviction = fresh.delete_on_eviction;
            if provisioning == "deleting" && k.origin_known && !k.reported {
                k.reported = true;
                let e = terminated(k, now, "being deleted");
                st.gone.insert(e.event_id.clone(), e);
                continue;
            }
            if provisioning == "succeeded" && matches!(power.as_deref(), Some("stopped" | "deallocated")) {
                let power = power.unwrap_or_default();
                let since = status_time(v).unwrap_or_else(|| "-".into());
                let mut e = k.template.clone();
                e.event_id = format!("{}/stopped/{since}", k.vm_id);
                e.kind = EventKind::Stopped;
                e.action = CloudAction::Stop;
                e.message = if k.spot {
                    format!("Spot VM {power} out of band (not by this driver): most likely a spot eviction")
                } else {
                    format!("VM {power} out of band (not by this driver)")
                };
                out.push(e);
            }
        }
        let vanished: Vec<String> = st
            .known
            .iter()
            .filter(|(key, k)| &k.scope == scope && !seen.contains(*key))
            .map(|(key, _)| key.clone())
            .collect();
        for key in vanished {
            let Some(k) = st.known.remove(&key) else { continue };
            if st.own_deletes.remove(&key).is_some() || !k.origin_known || k.reported {
                continue;
            }
            let e = terminated(&k, now, "deleted");
            st.gone.insert(e.event_id.clone(), e);
        }
        // Deletes of ours that finished: forgotten.
        let prefix = format!("/subscriptions/{}/resourcegroups/{}/", scope.0, scope.1);
        st.own_deletes.retain(|key, _| !key.starts_with(&prefix) || seen.contains(key));
        out
    }
}

fn terminated(k: &Known, now: SystemTime, what: &str) -> MachineEvent {
    let mut e = k.template.clone();
    e.event_id = format!("{}/terminated", k.vm_id);
    e.kind = EventKind::Terminated;
    e.action = CloudAction::Terminate;
    e.observed_at = now;
    e.message = if k.spot && k.delete_on_eviction {
        format!("Spot VM {what} out of band (not by this driver): most likely a spot eviction (evictionPolicy Delete)")
    } else {
        format!("VM {what} out of band (not by this driver)")
    };
    e
}

/// The power state of a VM read with its instance view, lower-cased.
fn power_state(v: &Value) -> Option<String> {
    v["properties"]["instanceView"]["statuses"]
        .as_array()?
        .iter()
        .filter_map(|s| s["code"].as_str())
        .find_map(|c| c.strip_prefix("PowerState/"))
        .map(str::to_ascii_lowercase)
}

/// The `time` of the VM's `ProvisioningState/…` status: when its last operation ended.
fn status_time(v: &Value) -> Option<String> {
    v["properties"]["instanceView"]["statuses"]
        .as_array()?
        .iter()
        .find(|s| s["code"].as_str().is_some_and(|c| c.starts_with("ProvisioningState/")))
        .and_then(|s| s["time"].as_str())
        .map(str::to_string)
}

fn known_of(scope: &Scope, v: &Value, now: SystemTime, origin_known: bool) -> Known {
    let tags = vm::tags_of(v);
    let id = v["id"].as_str().unwrap_or_default();
    let props = &v["properties"];
    let capacity_type = crate::model::capacity_type_of(v);
    let template = MachineEvent {
        event_id: String::new(),
        machine_name: tags.get(NAME_TAG).cloned().unwrap_or_default(),
        provider_id: crate::model::provider_id(id),
        pool_name: String::new(),
        kind: EventKind::Unspecified,
        not_before: None,
        observed_at: now,
        action: CloudAction::Unspecified,
        offering: Offering {
            zone: v["zones"][0].as_str().unwrap_or_default().to_string(),
            machine_type: props["hardwareProfile"]["vmSize"].as_str().unwrap_or_default().to_string(),
            capacity_type,
        },
        message: String::new(),
    };
    Known {
        scope: scope.clone(),
        template,
        vm_id: props["vmId"].as_str().filter(|s| !s.is_empty()).unwrap_or(id).to_string(),
        spot: capacity_type == CapacityType::Spot,
        delete_on_eviction: props["evictionPolicy"].as_str().is_some_and(|p| p.eq_ignore_ascii_case("Delete")),
        origin_known,
        reported: false,
    }
}

/// Every VM of a resource group, with instance views (following `nextLink`, bounded).
async fn list(arm: &ArmClient, place: &ResourceId) -> Result<Vec<Value>, String> {
    let path = format!(
        "/subscriptions/{}/resourceGroups/{}/providers/Microsoft.Compute/virtualMachines",
        place.subscription, place.resource_group
    );
    let mut url = arm.url(&path, &[("$expand", "instanceView")]).map_err(|e| e.to_string())?;
    let ctx = RequestContext::new(format!("events-poll-{}", now_ms()));
    let mut out = Vec::new();
    for _ in 0..MAX_PAGES {
        let resp = arm
            .send(Method::Get, url, None, ctx.request_id(), Some(LIST_TIMEOUT))
            .await
            .map_err(|e| driver_sdk::error_chain(&e))?;
        if !resp.is_success() {
            return Err(driver_sdk::error_chain(&resp.into_error()));
        }
        let page = resp.value();
        out.extend(page["value"].as_array().cloned().unwrap_or_default());
        match page["nextLink"].as_str().filter(|l| !l.is_empty()) {
            Some(link) => url = arm.trusted_url(link).map_err(|e| e.to_string())?,
            None => return Ok(out),
        }
    }
    Err(format!("more than {MAX_PAGES} pages of VMs"))
}

fn now_ms() -> u128 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn scope() -> Scope {
        ("s".into(), "rg".into())
    }

    fn vm(name: &str, provisioning: &str, power: &str, spot: bool) -> Value {
        let mut v = json!({
            "id": format!("/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/{name}"),
            "name": name, "zones": ["2"], "tags": {NAME_TAG: name},
            "properties": {
                "vmId": format!("id-{name}"), "provisioningState": provisioning,
                "hardwareProfile": {"vmSize": "Standard_D2s_v5"},
                "instanceView": {"statuses": [
                    {"code": format!("ProvisioningState/{}", provisioning.to_ascii_lowercase()), "time": "2025-01-01T00:00:00Z"},
                    {"code": format!("PowerState/{power}")},
                ]},
            },
        });
        if spot {
            v["properties"]["priority"] = json!("Spot");
            v["properties"]["evictionPolicy"] = json!("Deallocate");
        }
        v
    }

    fn r(name: &str) -> ResourceId {
        ResourceId { subscription: "s".into(), resource_group: "rg".into(), name: name.into() }
    }

    #[test]
    fn stopped_and_vanished_vms_are_events_own_deletes_and_foreign_vms_are_not() {
        let w = Watch::default();
        let foreign = json!({"id": "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/x",
                             "properties": {"provisioningState": "Succeeded"}});
        let all = [
            vm("a", "Succeeded", "running", false),
            vm("b", "Succeeded", "running", false),
            vm("spot", "Succeeded", "deallocated", true),
            foreign.clone(),
        ];
        let events = w.observe(&scope(), &all);
        assert_eq!(events.len(), 1, "{events:?}");
        let e = &events[0];
        assert_eq!((e.kind, e.action, e.machine_name.as_str()), (EventKind::Stopped, CloudAction::Stop, "spot"));
        assert_eq!(e.event_id, "id-spot/stopped/2025-01-01T00:00:00Z");
        assert_eq!(e.offering.capacity_type, CapacityType::Spot);
        assert_eq!((e.offering.zone.as_str(), e.offering.machine_type.as_str()), ("2", "Standard_D2s_v5"));
        assert!(e.message.contains("spot eviction"), "{e:?}");
        assert!(e.provider_id.ends_with("/virtualMachines/spot"), "{e:?}");
        // The same state: the same ID.
        assert_eq!(w.observe(&scope(), &all)[0].event_id, e.event_id);

        // `a` deleted by the driver, `b` behind its back.
        w.deleting(&r("a"));
        let listing = [all[2].clone(), vm("a", "Deleting", "stopping", false), vm("b", "Deleting", "stopping", false)];
        let events = w.observe(&scope(), &listing);
        assert_eq!(events.len(), 1, "only the spot VM's STOPPED: {events:?}");
        let gone: Vec<MachineEvent> = lock(&w.state).gone.values().cloned().collect();
        assert_eq!(gone.len(), 1, "{gone:?}");
        assert_eq!((gone[0].kind, gone[0].machine_name.as_str()), (EventKind::Terminated, "b"));
        assert_eq!(gone[0].event_id, "id-b/terminated");
        // Both vanish: still the one event, until it is acknowledged.
        w.observe(&scope(), &all[2..3]);
        assert_eq!(lock(&w.state).gone.len(), 1);
        w.acked("id-b/terminated");
        assert!(lock(&w.state).gone.is_empty());
        assert!(lock(&w.state).own_deletes.is_empty());
    }

    #[test]
    fn a_vm_the_first_listing_finds_deleting_is_not_reported_but_one_that_vanishes_later_is() {
        let w = Watch::default();
        w.observe(&scope(), &[vm("old", "Deleting", "stopping", false), vm("c", "Succeeded", "running", false)]);
        w.observe(&scope(), &[]);
        let gone: Vec<String> = lock(&w.state).gone.keys().cloned().collect();
        assert_eq!(gone, ["id-c/terminated"]);
    }

    #[test]
    fn a_failed_delete_of_ours_is_watched_again_once_running() {
        let w = Watch::default();
        w.observe(&scope(), &[vm("d", "Succeeded", "running", false)]);
        w.deleting(&r("d"));
        // A listing sent before the delete: still ours.
        w.observe(&scope(), &[vm("d", "Succeeded", "running", false)]);
        w.observe(&scope(), &[vm("d", "Deleting", "stopping", false)]);
        assert!(lock(&w.state).gone.is_empty());
        w.observe(&scope(), &[vm("d", "Failed", "running", false)]);
        w.observe(&scope(), &[]);
        assert_eq!(lock(&w.state).gone.keys().cloned().collect::<Vec<_>>(), ["id-d/terminated"]);
    }
}
