use super::*;
use driver_sdk::Secrets;
use std::collections::{BTreeMap, BTreeSet};

fn fast() -> Config {
    Config {
        create_latency: Duration::from_millis(30),
        delete_latency: Duration::from_millis(30),
        update_latency: Duration::from_millis(30),
        pool_latency: Duration::from_millis(30),
        ..Config::default()
    }
}

fn ctx(method: &str) -> RequestContext {
    let mut c = RequestContext::new("test");
    // Tests call the driver directly; the method name drives fault matching.
    c = with_method(c, method);
    c
}

fn with_method(c: RequestContext, method: &str) -> RequestContext {
    driver_sdk::RequestContext::for_method(c.request_id().to_string(), method)
}

fn create(name: &str, spec: Value) -> CreateMachine {
    CreateMachine {
        name: name.into(),
        provider_spec: spec,
        secrets: Secrets::default(),
        labels: BTreeMap::new(),
        uid: String::new(),
    }
}

fn spec() -> Value {
    json!({"machineType": "small"})
}

/// The fake cloud's ID of the operation `op` stands for (none when it was done at once).
fn op_id(op: &Operation) -> Option<String> {
    serde_json::from_value::<TokenState>(op.state.clone()).unwrap().op
}

async fn settle(d: &FakeDriver, op: Operation) -> Operation {
    let Some(id) = op_id(&op) else { return op };
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let view = FakeDriver::op_view(&d.cloud(), &id);
        if view.is_done() || Instant::now() > deadline {
            return view;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn create_is_idempotent_and_counts_once() {
    let d = FakeDriver::new(fast()).unwrap();
    let a = d.create_machine(&ctx("CreateMachine"), create("m1", spec())).await.unwrap();
    let b = d.create_machine(&ctx("CreateMachine"), create("m1", spec())).await.unwrap();
    assert_eq!(a.name, b.name, "a repeated create returns the in-flight operation");
    let done = settle(&d, a).await;
    assert!(matches!(done.outcome, Some(Ok(OperationOutput::Machine(ref m))) if m.state == MachineState::Running));
    let again = d.create_machine(&ctx("CreateMachine"), create("m1", spec())).await.unwrap();
    assert!(again.is_done());
    let conflict =
        d.create_machine(&ctx("CreateMachine"), create("m1", json!({"machineType": "large"}))).await.unwrap_err();
    assert_eq!(conflict.code(), tonic::Code::AlreadyExists);
    assert_eq!(d.inspect(false).counters.unwrap().machines_created, 1);
}

#[tokio::test]
async fn quota_refuses_with_resource_exhausted() {
    let d = FakeDriver::new(Config { max_machines: Some(1), ..fast() }).unwrap();
    d.create_machine(&ctx("CreateMachine"), create("m1", spec())).await.unwrap();
    let err = d.create_machine(&ctx("CreateMachine"), create("m2", spec())).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert_eq!(err.reason(), reason::QUOTA_EXCEEDED);
}

#[tokio::test]
async fn rate_limit_throttles_with_retry_after() {
    let d = FakeDriver::new(Config { rate_limit: Some(1.0), burst: 2, ..fast() }).unwrap();
    for n in ["a", "b"] {
        d.create_machine(&ctx("CreateMachine"), create(n, spec())).await.unwrap();
    }
    let err = d.create_machine(&ctx("CreateMachine"), create("c", spec())).await.unwrap_err();
    assert_eq!(err.reason(), reason::THROTTLED);
    assert!(err.retry_after().is_some_and(|d| d > Duration::ZERO && d <= Duration::from_secs(1)));
}

#[tokio::test]
async fn fault_rules_fire_the_given_number_of_times() {
    let rule: FaultRule = serde_json::from_value(json!({
        "rpc": "CreateMachine", "target": "web-*", "action": "error", "code": "UNAVAILABLE", "times": 2, "retry_after_ms": 500
    }))
    .unwrap();
    let d = FakeDriver::new(Config { faults: vec![rule], ..fast() }).unwrap();
    for _ in 0..2 {
        let e = d.create_machine(&ctx("CreateMachine"), create("web-1", spec())).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable);
        assert_eq!(e.retry_after(), Some(Duration::from_millis(500)));
    }
    d.create_machine(&ctx("CreateMachine"), create("web-1", spec())).await.unwrap();
    d.create_machine(&ctx("CreateMachine"), create("db-1", spec())).await.unwrap();
}

#[tokio::test]
async fn failed_provisioning_ends_the_operation_with_the_cloud_error() {
    let d = FakeDriver::new(fast()).unwrap();
    let op = d
        .create_machine(
            &ctx("CreateMachine"),
            create("bad", json!({"machineType": "small", "simulateFailure": "provisioning"})),
        )
        .await
        .unwrap();
    let done = settle(&d, op).await;
    let err = done.outcome.unwrap().unwrap_err();
    assert_eq!(err.reason(), reason::CLOUD_OPERATION_FAILED);
}

#[tokio::test]
async fn state_file_carries_in_flight_operations_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = Config {
        state_file: Some(dir.path().join("cloud.json")),
        create_latency: Duration::from_millis(100),
        ..fast()
    };
    let first = FakeDriver::new(cfg.clone()).unwrap();
    let op = first.create_machine(&ctx("CreateMachine"), create("m1", spec())).await.unwrap();
    assert!(!op.is_done());
    drop(first);
    let second = FakeDriver::new(cfg).unwrap();
    let done = settle(&second, op).await;
    assert!(matches!(done.outcome, Some(Ok(OperationOutput::Machine(_)))));
    assert_eq!(second.inspect(false).counters.unwrap().machines_created, 1);
}

#[tokio::test]
async fn corrupt_state_file_is_a_clear_startup_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cloud.json");
    std::fs::write(&path, "{not json").unwrap();
    let err = FakeDriver::new(Config { state_file: Some(path), ..fast() }).err().unwrap();
    assert!(err.contains("cloud.json") && err.contains("not valid"), "{err}");
}

#[tokio::test]
async fn delete_during_create_aborts_the_create_and_removes_the_machine() {
    let d = FakeDriver::new(fast()).unwrap();
    let c = d.create_machine(&ctx("CreateMachine"), create("m1", spec())).await.unwrap();
    let del = d
        .delete_machine(
            &ctx("DeleteMachine"),
            MachineRef {
                name: "m1".into(),
                provider_id: None,
                provider_spec: Value::Null,
                secrets: Secrets::default(),
            },
        )
        .await
        .unwrap();
    let c = settle(&d, c).await;
    assert!(c.outcome.unwrap().is_err());
    let del = settle(&d, del).await;
    assert!(matches!(del.outcome, Some(Ok(OperationOutput::None))));
    let inspect = d.inspect(false);
    assert!(inspect.machines.is_empty());
    assert_eq!(inspect.counters.unwrap().machines_deleted, 1);
}

#[tokio::test]
async fn pools_scale_upgrade_and_delete_instances() {
    let d = FakeDriver::new(fast()).unwrap();
    let apply = |cap, spec: Value| ApplyPool {
        name: "p".into(),
        provider_spec: spec,
        capacity: cap,
        labels: BTreeMap::new(),
        secrets: Secrets::default(),
    };
    let op = d.apply_pool(&ctx("ApplyPool"), apply(3, spec())).await.unwrap();
    settle(&d, op).await;
    let op = d.apply_pool(&ctx("ApplyPool"), apply(3, json!({"machineType": "large"}))).await.unwrap();
    settle(&d, op).await;
    let pool = PoolRef { name: "p".into(), provider_spec: Value::Null, secrets: Secrets::default() };
    let op = d
        .upgrade_pool_instances(
            &ctx("UpgradePoolInstances"),
            PoolInstances { pool: pool.clone(), instance_ids: vec!["1".into()] },
        )
        .await
        .unwrap();
    settle(&d, op).await;
    let op = d
        .delete_pool_instances(
            &ctx("DeletePoolInstances"),
            PoolInstances { pool: pool.clone(), instance_ids: vec!["0".into()] },
        )
        .await
        .unwrap();
    settle(&d, op).await;
    let view = d.inspect(false);
    let p = &view.pools[0];
    assert_eq!(p.capacity, 2);
    let ids: Vec<(&str, bool)> = p.instances.iter().map(|i| (i.instance_id.as_str(), i.latest_model_applied)).collect();
    assert_eq!(ids, vec![("1", true), ("2", false)]);
}

// ------------------------------------------------------------------ kubelets (--join-cluster)

fn vm(name: &str, pid: &str) -> kubelets::Vm {
    kubelets::Vm {
        hostname: name.into(),
        provider_id: pid.into(),
        ip: "10.0.0.1".into(),
        machine_type: "medium".into(),
        zone: "zone-b".into(),
        booted: true,
        kubelet: kubelets::KubeletMode::Joins,
        stopped: false,
        boot_id: format!("boot-of-{name}"),
    }
}

fn registered(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(n, p)| (n.to_string(), p.to_string())).collect()
}

#[test]
fn kubelet_plan_registers_booted_machines_once() {
    let booting = kubelets::Vm { booted: false, ..vm("booting", "fake:///zone-b/vm-0") };
    let never = kubelets::Vm { kubelet: kubelets::KubeletMode::NeverJoins, ..vm("never", "fake:///zone-b/vm-1") };
    let not_ready =
        kubelets::Vm { kubelet: kubelets::KubeletMode::JoinsNotReady, ..vm("not-ready", "fake:///zone-b/vm-2") };
    let vms =
        vec![booting, never, not_ready.clone(), vm("new", "fake:///zone-b/vm-3"), vm("old", "fake:///zone-b/vm-4")];
    let plan = kubelets::plan(&vms, &registered(&[("old", "fake:///zone-b/vm-4")]), &BTreeSet::new(), &BTreeMap::new());
    let names: Vec<&str> = plan.register.iter().map(|v| v.hostname.as_str()).collect();
    assert_eq!(names, ["not-ready", "new"], "booted, joining and not registered yet");
    assert_eq!(plan.register[0], not_ready);
    assert!(plan.mark_gone.is_empty());
}

#[test]
fn kubelet_plan_marks_nodes_of_vanished_or_stopped_machines() {
    let stopped = kubelets::Vm { stopped: true, ..vm("stopped", "fake:///zone-b/vm-1") };
    // "again" was deleted and created anew under the same name: a new VM, a new provider ID.
    let vms = vec![stopped, vm("again", "fake:///zone-b/vm-new"), vm("alive", "fake:///zone-b/vm-3")];
    let reg = registered(&[
        ("alive", "fake:///zone-b/vm-3"),
        ("again", "fake:///zone-b/vm-old"),
        ("gone", "fake:///zone-b/vm-2"),
        ("stopped", "fake:///zone-b/vm-1"),
    ]);
    let plan = kubelets::plan(&vms, &reg, &BTreeSet::new(), &BTreeMap::new());
    let gone: Vec<(&str, &str)> = plan.mark_gone.iter().map(|(n, p)| (n.as_str(), p.as_str())).collect();
    assert_eq!(
        gone,
        [("again", "fake:///zone-b/vm-old"), ("gone", "fake:///zone-b/vm-2"), ("stopped", "fake:///zone-b/vm-1")]
    );
    let names: Vec<&str> = plan.register.iter().map(|v| v.hostname.as_str()).collect();
    assert_eq!(names, ["again"], "a stopped kubelet never registers again; the new VM does");
    // Once marked (no longer registered), a stopped machine needs nothing more.
    let reg = registered(&[("alive", "fake:///zone-b/vm-3"), ("again", "fake:///zone-b/vm-new")]);
    let plan = kubelets::plan(&vms, &reg, &BTreeSet::new(), &BTreeMap::new());
    assert_eq!(plan, kubelets::Plan::default());
}

#[test]
fn kubelet_plan_registers_a_started_kubelet_again() {
    // StopKubelet, the Node marked (no longer registered), then StartKubelet: the VM registers
    // again like a new one (registering finds its Node and puts the kwok annotation back).
    let vms = vec![vm("web-1", "fake:///zone-b/vm-1"), vm("alive", "fake:///zone-b/vm-3")];
    let reg = registered(&[("alive", "fake:///zone-b/vm-3")]);
    let plan = kubelets::plan(&vms, &reg, &BTreeSet::new(), &BTreeMap::new());
    assert_eq!(plan.register, [vms[0].clone()]);
    assert!(plan.mark_gone.is_empty());
    // Started again before its Node was marked (still registered): nothing to do.
    let reg = registered(&[("alive", "fake:///zone-b/vm-3"), ("web-1", "fake:///zone-b/vm-1")]);
    assert_eq!(kubelets::plan(&vms, &reg, &BTreeSet::new(), &BTreeMap::new()), kubelets::Plan::default());
    // Started again while the VM is not running (being deleted): it does not report.
    let deleting = kubelets::Vm { booted: false, ..vms[0].clone() };
    assert!(!deleting.reports());
    assert_eq!(
        kubelets::plan(&[deleting], &BTreeMap::new(), &BTreeSet::new(), &BTreeMap::new()),
        kubelets::Plan::default()
    );
    for (v, reports) in [
        (vm("a", "fake:///zone-b/vm-1"), true),
        (kubelets::Vm { stopped: true, ..vm("a", "fake:///zone-b/vm-1") }, false),
        (kubelets::Vm { kubelet: kubelets::KubeletMode::NeverJoins, ..vm("a", "fake:///zone-b/vm-1") }, false),
        (kubelets::Vm { kubelet: kubelets::KubeletMode::JoinsNotReady, ..vm("a", "fake:///zone-b/vm-1") }, true),
    ] {
        assert_eq!(v.reports(), reports, "{v:?}");
    }
}

#[test]
fn kubelet_plan_marks_or_registers_nodes_in_doubt() {
    // Nodes whose registration or mark failed (or found unannotated after a restart): marked
    // while the VM is gone or its kubelet stopped, registered again while its kubelet reports.
    let vms = vec![
        vm("back", "fake:///zone-b/vm-1"),
        kubelets::Vm { stopped: true, ..vm("stopped", "fake:///zone-b/vm-2") },
        vm("again", "fake:///zone-b/vm-new"),
        kubelets::Vm { booted: false, ..vm("deleting", "fake:///zone-b/vm-4") },
    ];
    let doubt: BTreeSet<(String, String)> = [
        ("back", "fake:///zone-b/vm-1"),
        ("stopped", "fake:///zone-b/vm-2"),
        ("gone", "fake:///zone-b/vm-3"),
        ("again", "fake:///zone-b/vm-old"),
        ("deleting", "fake:///zone-b/vm-4"),
    ]
    .iter()
    .map(|(n, p)| (n.to_string(), p.to_string()))
    .collect();
    let reg = registered(&[("again", "fake:///zone-b/vm-new"), ("gone", "fake:///zone-b/vm-3")]);
    let plan = kubelets::plan(&vms, &reg, &doubt, &BTreeMap::new());
    let gone: Vec<(&str, &str)> = plan.mark_gone.iter().map(|(n, p)| (n.as_str(), p.as_str())).collect();
    assert_eq!(
        gone,
        [("again", "fake:///zone-b/vm-old"), ("gone", "fake:///zone-b/vm-3"), ("stopped", "fake:///zone-b/vm-2")],
        "once each, in name order; the new VM named \"again\" stays registered"
    );
    let names: Vec<&str> = plan.register.iter().map(|v| v.hostname.as_str()).collect();
    assert_eq!(names, ["back"], "a VM not booted keeps its doubtful Node until it reports or is gone");
}

#[cfg(feature = "join-cluster")]
#[test]
fn kubelet_node_is_shaped_like_a_kubelet_registration() {
    let n = kubelets::node(&vm("web-1", "fake:///zone-b/vm-1"), "cloud-1");
    assert_eq!(n.metadata.name.as_deref(), Some("web-1"));
    assert_eq!(n.spec.as_ref().unwrap().provider_id.as_deref(), Some("fake:///zone-b/vm-1"));
    let labels = n.metadata.labels.clone().unwrap();
    let want = [
        ("kubernetes.io/hostname", "web-1"),
        ("kubernetes.io/os", "linux"),
        ("kubernetes.io/arch", "amd64"),
        ("node.kubernetes.io/instance-type", "medium"),
        ("topology.kubernetes.io/zone", "zone-b"),
    ];
    assert_eq!(labels, want.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
    let annotations = n.metadata.annotations.clone().unwrap();
    assert_eq!(annotations.get(kubelets::KWOK_ANNOTATION).map(String::as_str), Some("fake"));
    assert_eq!(annotations.get(kubelets::CLOUD_ANNOTATION).map(String::as_str), Some("cloud-1"));
    let status = n.status.clone().unwrap();
    let q = |m: &Option<BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>, k: &str| {
        m.as_ref().unwrap()[k].0.clone()
    };
    for m in [&status.capacity, &status.allocatable] {
        assert_eq!((q(m, "cpu"), q(m, "memory"), q(m, "pods")), ("4".into(), "8Gi".into(), "110".into()));
    }
    let addresses: Vec<(&str, &str)> =
        status.addresses.as_ref().unwrap().iter().map(|a| (a.type_.as_str(), a.address.as_str())).collect();
    assert_eq!(addresses, [("InternalIP", "10.0.0.1"), ("Hostname", "web-1")]);
    assert!(status.conditions.is_none(), "kwok's node-initialize stage sets the conditions");
    for (t, cpu, mem) in [("small", "2", "4Gi"), ("medium", "4", "8Gi"), ("large", "8", "16Gi")] {
        assert_eq!(kubelets::capacity(t), (cpu, mem));
    }

    let not_ready = kubelets::Vm { kubelet: kubelets::KubeletMode::JoinsNotReady, ..vm("db-1", "fake:///zone-b/vm-2") };
    let n = kubelets::node(&not_ready, "cloud-1");
    assert!(!n.metadata.annotations.as_ref().unwrap().contains_key(kubelets::KWOK_ANNOTATION), "kwok leaves it be");
    let ready = &n.status.as_ref().unwrap().conditions.as_ref().unwrap()[0];
    assert_eq!((ready.type_.as_str(), ready.status.as_str()), ("Ready", "False"));
    assert_eq!(ready.reason.as_deref(), Some("KubeletNotReady"));
}

#[cfg(feature = "join-cluster")]
#[test]
fn kubelet_stopped_patch_turns_conditions_unknown_once() {
    let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now());
    let mut n = kubelets::node(&vm("web-1", "fake:///zone-b/vm-1"), "c");
    assert!(kubelets::is_fake(&n));
    let cond = |t: &str, s: &str| k8s_openapi::api::core::v1::NodeCondition {
        type_: t.into(),
        status: s.into(),
        reason: Some("KubeletReady".into()),
        ..Default::default()
    };
    n.status.as_mut().unwrap().conditions = Some(vec![cond("Ready", "True"), cond("MemoryPressure", "False")]);
    n.status.as_mut().unwrap().phase = Some("Running".into());
    let patch = kubelets::stopped_status_patch(&n, &now).unwrap();
    assert_eq!(patch["status"]["phase"], Value::Null, "kwok's phase goes, so that no kwok stage matches");
    assert!(patch["status"].as_object().unwrap().contains_key("phase"));
    let conditions = patch["status"]["conditions"].as_array().unwrap();
    assert_eq!(conditions.len(), 2);
    for c in conditions {
        assert_eq!(c["status"], "Unknown");
        assert_eq!(c["reason"], kubelets::STOPPED_REASON);
        assert_eq!(c["message"], "Kubelet stopped posting node status.");
        assert!(c["lastTransitionTime"].is_string());
        assert!(c.get("lastHeartbeatTime").is_none(), "the last heartbeat stays what it was");
    }
    assert_eq!(conditions[0]["type"], "Ready");
    // Applied: nothing more to patch.
    let applied: Vec<k8s_openapi::api::core::v1::NodeCondition> =
        serde_json::from_value(patch["status"]["conditions"].clone()).unwrap();
    n.status.as_mut().unwrap().conditions = Some(applied);
    n.status.as_mut().unwrap().phase = None;
    assert_eq!(kubelets::stopped_status_patch(&n, &now), None);
    // A Node that never posted a condition gets Ready=Unknown.
    let bare = kubelets::node(&vm("web-2", "fake:///zone-b/vm-2"), "c");
    let patch = kubelets::stopped_status_patch(&bare, &now).unwrap();
    assert_eq!(patch["status"]["conditions"][0]["type"], "Ready");
    assert!(!patch["status"].as_object().unwrap().contains_key("phase"));
    // Not a fake cloud's Node.
    let mut other = bare;
    other.spec.as_mut().unwrap().provider_id = Some("aws:///us-east-1a/i-1".into());
    assert!(!kubelets::is_fake(&other));
}

#[cfg(feature = "join-cluster")]
#[test]
fn kubelet_restart_patch_puts_the_kwok_annotation_back() {
    let web = vm("web-1", "fake:///zone-b/vm-1");
    let mut n = kubelets::node(&web, "cloud-1");
    assert_eq!(kubelets::restart_patch(&n, &web), None, "registered as it is");
    // Marked: the annotation is gone (and Ready is Unknown, which kwok's node-initialize stage
    // turns True once it sees the Node again).
    n.metadata.annotations.as_mut().unwrap().remove(kubelets::KWOK_ANNOTATION);
    let patch = kubelets::restart_patch(&n, &web).unwrap();
    assert_eq!(patch, json!({"metadata": {"annotations": {"kwok.x-k8s.io/node": "fake"}}}));
    // The annotation of a fresh registration, the cloud's annotation untouched.
    let fresh = kubelets::node(&web, "cloud-1");
    assert_eq!(
        patch["metadata"]["annotations"][kubelets::KWOK_ANNOTATION].as_str(),
        fresh.metadata.annotations.as_ref().unwrap().get(kubelets::KWOK_ANNOTATION).map(String::as_str)
    );
    n.metadata.annotations = None;
    assert!(kubelets::restart_patch(&n, &web).is_some());
    // A JoinsNotReady kubelet never had it: nothing to put back.
    let not_ready = kubelets::Vm { kubelet: kubelets::KubeletMode::JoinsNotReady, ..web };
    let n = kubelets::node(&not_ready, "cloud-1");
    assert_eq!(kubelets::restart_patch(&n, &not_ready), None);
}

#[test]
fn kubelet_spec_field_is_in_the_schema_and_replaces_like_simulate_failure() {
    let schema = FakeDriver::schema();
    driver_sdk::schema::ProviderSchema::compile(&schema).expect("the SDK accepts the schema at start");
    let check = |spec: Value| driver_sdk::schema::validate(&schema, &spec, "provider_spec");
    for mode in ["Joins", "NeverJoins", "JoinsNotReady"] {
        assert!(check(json!({"machineType": "small", "kubelet": mode})).is_empty(), "{mode}");
        assert_eq!(format!("{:?}", kubelets::KubeletMode::of(&json!({"kubelet": mode}))), mode);
    }
    assert_eq!(kubelets::KubeletMode::of(&json!({})), kubelets::KubeletMode::Joins);
    for bad in [json!("Sometimes"), json!(true), json!("joins")] {
        let v = check(json!({"machineType": "small", "kubelet": bad}));
        assert!(!v.is_empty(), "{bad} is refused");
    }
    assert!(schema["properties"]["kubelet"]["description"].as_str().unwrap().contains("test aid"));
    // Like simulateFailure (and unlike machineType), a change is a replacement.
    let current = json!({"machineType": "small"});
    for field in ["kubelet", "simulateFailure"] {
        let desired =
            json!({"machineType": "small", field: if field == "kubelet" { "NeverJoins" } else { "unhealthy" }});
        let plan = plan_update(&current, &desired, convert::changed_paths(&current, &desired));
        assert_eq!(plan.replace_paths, [format!("/{field}")]);
    }
}

async fn running(d: &FakeDriver, name: &str, spec: Value) {
    let op = d.create_machine(&ctx("CreateMachine"), create(name, spec)).await.unwrap();
    settle(d, op).await;
}

#[tokio::test]
async fn kubelet_view_reports_the_driver_s_provider_ids_and_hostnames() {
    let d = FakeDriver::new(fast()).unwrap();
    running(&d, "m1", json!({"machineType": "large", "zone": "zone-c", "kubelet": "JoinsNotReady"})).await;
    let apply = ApplyPool {
        name: "p".into(),
        provider_spec: json!({"machineType": "medium", "kubelet": "NeverJoins"}),
        capacity: 1,
        labels: BTreeMap::new(),
        secrets: Secrets::default(),
    };
    let op = d.apply_pool(&ctx("ApplyPool"), apply).await.unwrap();
    settle(&d, op).await;

    let (cloud_id, vms) = d.kubelet_view();
    assert!(!cloud_id.is_empty());
    let m1 = d.get_machine_status(&ctx("GetMachineStatus"), machine_ref("m1")).await.unwrap();
    let hostname = m1.addresses.iter().find(|a| a.kind == "Hostname").unwrap().address.clone();
    let v = &vms[0];
    assert_eq!((v.hostname.as_str(), v.provider_id.as_str()), (hostname.as_str(), m1.provider_id.as_str()));
    assert_eq!((v.machine_type.as_str(), v.zone.as_str(), v.booted), ("large", "zone-c", true));
    assert_eq!(v.kubelet, kubelets::KubeletMode::JoinsNotReady);
    let slow = FakeDriver::new(Config::default()).unwrap();
    slow.create_machine(&ctx("CreateMachine"), create("m2", spec())).await.unwrap();
    assert!(!slow.kubelet_view().1[0].booted, "m2 is still being created");

    let pool = PoolRef { name: "p".into(), provider_spec: Value::Null, secrets: Secrets::default() };
    let page = d
        .list_pool_instances(
            &ctx("ListPoolInstances"),
            ListPoolInstances { pool, page_size: 10, page_token: String::new() },
        )
        .await
        .unwrap();
    let i = &page.items[0];
    let v = &vms[1];
    let host = i.addresses.iter().find(|a| a.kind == "Hostname").unwrap();
    assert_eq!((v.hostname.as_str(), v.provider_id.as_str()), (host.address.as_str(), i.provider_id.as_str()));
    assert_eq!(v.hostname, "p-0");
    assert_eq!((v.machine_type.as_str(), v.kubelet, v.booted), ("medium", kubelets::KubeletMode::NeverJoins, true));
}

fn machine_ref(name: &str) -> MachineRef {
    MachineRef { name: name.into(), provider_id: None, provider_spec: Value::Null, secrets: Secrets::default() }
}

#[tokio::test]
async fn stop_kubelet_marks_the_machine_and_survives_a_restart() {
    use pb::fake_cloud_server::FakeCloud;
    let dir = tempfile::tempdir().unwrap();
    let cfg = Config { state_file: Some(dir.path().join("cloud.json")), ..fast() };
    let d = Arc::new(FakeDriver::new(cfg.clone()).unwrap());
    running(&d, "m1", spec()).await;
    let svc = FakeCloudService { driver: d.clone() };
    let err =
        svc.stop_kubelet(tonic::Request::new(pb::StopKubeletRequest { machine: "nope".into() })).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    for _ in 0..2 {
        svc.stop_kubelet(tonic::Request::new(pb::StopKubeletRequest { machine: "m1".into() })).await.unwrap();
    }
    let (cloud_id, vms) = d.kubelet_view();
    assert!(vms[0].stopped && vms[0].booted, "the VM keeps running");
    assert!(d.inspect(false).machines[0].kubelet_stopped);
    drop((svc, d));
    let again = FakeDriver::new(cfg).unwrap();
    let (same_id, vms) = again.kubelet_view();
    assert_eq!(same_id, cloud_id, "the cloud keeps its ID in the state file");
    assert!(vms[0].stopped, "the mark is kept in the state file");
    assert!(kubelets::plan(&vms, &BTreeMap::new(), &BTreeSet::new(), &BTreeMap::new()).register.is_empty());
}

#[tokio::test]
async fn start_kubelet_clears_the_mark_and_survives_a_restart() {
    use pb::fake_cloud_server::FakeCloud;
    let dir = tempfile::tempdir().unwrap();
    let cfg = Config { state_file: Some(dir.path().join("cloud.json")), ..fast() };
    let d = Arc::new(FakeDriver::new(cfg.clone()).unwrap());
    running(&d, "m1", spec()).await;
    let svc = FakeCloudService { driver: d.clone() };
    let start = |name: &str| pb::StartKubeletRequest { machine: name.into() };
    let stop = |name: &str| pb::StopKubeletRequest { machine: name.into() };
    let err = svc.start_kubelet(tonic::Request::new(start("nope"))).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    // Never stopped: nothing to do.
    svc.start_kubelet(tonic::Request::new(start("m1"))).await.unwrap();
    assert!(!d.inspect(false).machines[0].kubelet_stopped);
    let pid = d.kubelet_view().1[0].provider_id.clone();
    assert!(d.kubelet_reports("m1", &pid));
    svc.stop_kubelet(tonic::Request::new(stop("m1"))).await.unwrap();
    assert!(!d.kubelet_reports("m1", &pid));
    for _ in 0..2 {
        svc.start_kubelet(tonic::Request::new(start("m1"))).await.unwrap();
    }
    assert!(!d.inspect(false).machines[0].kubelet_stopped);
    let (_, vms) = d.kubelet_view();
    assert!(!vms[0].stopped && vms[0].reports());
    assert!(d.kubelet_reports("m1", &pid));
    assert!(!d.kubelet_reports("m1", "fake:///zone-a/other"), "another VM of that name");
    assert!(!d.kubelet_reports("nope", &pid));
    // Its Node (marked, so no longer registered) registers again.
    assert_eq!(kubelets::plan(&vms, &BTreeMap::new(), &BTreeSet::new(), &BTreeMap::new()).register, vms);
    // Persisted: a restarted sidecar sees the kubelet running.
    drop((svc, d));
    let d = Arc::new(FakeDriver::new(cfg.clone()).unwrap());
    assert!(!d.kubelet_view().1[0].stopped, "the start is kept in the state file");
    // Stopped again: the stop is kept too.
    let svc = FakeCloudService { driver: d.clone() };
    svc.stop_kubelet(tonic::Request::new(stop("m1"))).await.unwrap();
    drop((svc, d));
    let d = Arc::new(FakeDriver::new(cfg.clone()).unwrap());
    assert!(d.kubelet_view().1[0].stopped);
    assert!(d.inspect(false).machines[0].kubelet_stopped);
    let svc = FakeCloudService { driver: d.clone() };
    svc.start_kubelet(tonic::Request::new(start("m1"))).await.unwrap();
    drop((svc, d));
    let d = Arc::new(FakeDriver::new(cfg).unwrap());
    assert!(!d.kubelet_view().1[0].stopped);
    // A removed machine cannot be started.
    let svc = FakeCloudService { driver: d.clone() };
    svc.remove_machine(tonic::Request::new(pb::RemoveMachineRequest { machine: "m1".into() })).await.unwrap();
    let err = svc.start_kubelet(tonic::Request::new(start("m1"))).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
}

#[tokio::test]
async fn remove_machine_vanishes_without_counting_a_delete() {
    use pb::fake_cloud_server::FakeCloud;
    let d = Arc::new(FakeDriver::new(fast()).unwrap());
    running(&d, "m1", spec()).await;
    let creating = d.create_machine(&ctx("CreateMachine"), create("m2", spec())).await.unwrap();
    let svc = FakeCloudService { driver: d.clone() };
    let err =
        svc.remove_machine(tonic::Request::new(pb::RemoveMachineRequest { machine: "nope".into() })).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    for name in ["m1", "m2"] {
        svc.remove_machine(tonic::Request::new(pb::RemoveMachineRequest { machine: name.into() })).await.unwrap();
    }
    let err =
        svc.remove_machine(tonic::Request::new(pb::RemoveMachineRequest { machine: "m1".into() })).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "gone is gone");
    let view = d.inspect(false);
    assert!(view.machines.is_empty());
    let c = view.counters.unwrap();
    assert_eq!((c.machines_deleted, c.machines_removed_out_of_band, c.machines_created), (0, 2, 2));
    let err = d.get_machine_status(&ctx("GetMachineStatus"), machine_ref("m1")).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    // The create in flight ends as a create of a machine that vanished.
    let done = settle(&d, creating).await;
    assert_eq!(done.outcome.unwrap().unwrap_err().reason(), reason::MACHINE_NOT_FOUND);
    assert_eq!(d.inspect(false).counters.unwrap().machines_deleted, 0);
    // Its kubelet is gone with it: a Node registered for it is marked.
    let plan = kubelets::plan(
        &d.kubelet_view().1,
        &registered(&[("m1", "fake:///zone-a/vm-x")]),
        &BTreeSet::new(),
        &BTreeMap::new(),
    );
    assert_eq!(plan.mark_gone.len(), 1);
}

// ------------------------------------------------------------------ in-place disruption

#[test]
fn kubelet_plan_posts_the_boot_id_of_a_rebooted_vm() {
    let same = vm("same", "fake:///zone-b/vm-1");
    let rebooted = kubelets::Vm { boot_id: "second-boot".into(), ..vm("rebooted", "fake:///zone-b/vm-2") };
    let unseen = vm("unseen", "fake:///zone-b/vm-3");
    let stopped = kubelets::Vm { stopped: true, boot_id: "second-boot".into(), ..vm("stopped", "fake:///zone-b/vm-4") };
    let vms = vec![same.clone(), rebooted.clone(), unseen.clone(), stopped.clone()];
    let reg = registered(&[
        ("same", "fake:///zone-b/vm-1"),
        ("rebooted", "fake:///zone-b/vm-2"),
        ("unseen", "fake:///zone-b/vm-3"),
        ("stopped", "fake:///zone-b/vm-4"),
    ]);
    // The boot IDs the Nodes were last seen with; "unseen"'s is not known (left as it is).
    let boots: BTreeMap<String, String> = [
        ("same", "boot-of-same"),
        ("rebooted", "boot-of-rebooted"),
        ("stopped", "boot-of-stopped"),
        ("gone", "boot-of-gone"),
    ]
    .into_iter()
    .map(|(n, b)| (n.to_string(), b.to_string()))
    .collect();
    let plan = kubelets::plan(&vms, &reg, &BTreeSet::new(), &boots);
    assert_eq!(plan.reboot, vec![rebooted.clone()], "only a reporting VM with a new boot posts it");
    assert!(plan.register.is_empty());
    assert_eq!(plan.mark_gone, vec![("stopped".to_string(), "fake:///zone-b/vm-4".to_string())]);
    // Posted (or seen posted): nothing more to do.
    let mut boots = boots;
    boots.insert("rebooted".into(), "second-boot".into());
    assert!(kubelets::plan(&vms, &reg, &BTreeSet::new(), &boots).reboot.is_empty());
    // A Node not registered (yet) is registered with the VM's boot ID, not rebooted.
    let plan = kubelets::plan(std::slice::from_ref(&rebooted), &BTreeMap::new(), &BTreeSet::new(), &BTreeMap::new());
    assert_eq!((plan.register, plan.reboot), (vec![rebooted.clone()], Vec::new()));
    // Another VM of that name (another provider ID) registers once the stale Node goes.
    let newer = kubelets::Vm { provider_id: "fake:///zone-b/vm-9".into(), ..rebooted };
    let plan = kubelets::plan(&[newer], &reg, &BTreeSet::new(), &boots);
    assert!(plan.reboot.is_empty());
}

#[cfg(feature = "join-cluster")]
#[test]
fn kubelet_node_carries_the_boot_id_and_a_reboot_posts_the_new_one() {
    let web = vm("web-1", "fake:///zone-b/vm-1");
    let n = kubelets::node(&web, "c");
    assert_eq!(kubelets::boot_id(&n), "boot-of-web-1");
    let info = n.status.as_ref().unwrap().node_info.as_ref().unwrap();
    assert_eq!((info.architecture.as_str(), info.operating_system.as_str()), ("amd64", "linux"));
    assert!(info.kubelet_version.is_empty(), "left for kwok to fill in");
    let again = kubelets::Vm { boot_id: "b2".into(), ..web };
    assert_eq!(kubelets::reboot_status_patch(&again), json!({"status": {"nodeInfo": {"bootID": "b2"}}}));
    assert_eq!(kubelets::boot_id(&k8s_openapi::api::core::v1::Node::default()), "");
}

#[test]
fn in_place_disruption_is_the_spec_s_choice_none_when_absent() {
    let schema = FakeDriver::schema();
    let check = |spec: Value| driver_sdk::schema::validate(&schema, &spec, "provider_spec");
    let current = json!({"machineType": "small"});
    for (knob, want, reboot) in [
        (None, InPlaceDisruption::None, false),
        (Some("None"), InPlaceDisruption::None, false),
        (Some("Drain"), InPlaceDisruption::Drain, false),
        (Some("Reboot"), InPlaceDisruption::Reboot, true),
        (Some("Unset"), InPlaceDisruption::Unspecified, true),
    ] {
        let mut desired = json!({"machineType": "large", "tags": {"a": "b"}});
        if let Some(k) = knob {
            desired["inPlaceDisruption"] = json!(k);
        }
        assert!(check(desired.clone()).is_empty(), "{knob:?}");
        let plan = plan_update(&current, &desired, convert::changed_paths(&current, &desired));
        assert!(plan.replace_paths.is_empty(), "{knob:?}: {plan:?}");
        assert_eq!(plan.disruption, want, "{knob:?}");
        assert_eq!(reboots(&desired), reboot, "{knob:?}");
    }
    // Unset is what an old driver sends: nothing on the wire.
    assert_eq!(in_place_disruption(&json!({"inPlaceDisruption": "Unset"})).to_pb() as i32, 0);
    // The knob itself changes in place.
    let desired = json!({"machineType": "small", "inPlaceDisruption": "Reboot"});
    let plan = plan_update(&current, &desired, convert::changed_paths(&current, &desired));
    assert_eq!((plan.in_place_paths, plan.replace_paths), (vec!["/inPlaceDisruption".to_string()], Vec::new()));
    // Anything else is refused, naming the field.
    for bad in [json!("reboot"), json!("Sometimes"), json!(3)] {
        let v = check(json!({"machineType": "small", "inPlaceDisruption": bad}));
        assert!(!v.is_empty() && v.iter().all(|v| v.field == "provider_spec.inPlaceDisruption"), "{bad}: {v:?}");
    }
    assert!(schema["properties"]["inPlaceDisruption"]["description"].as_str().unwrap().contains("test aid"));
}

#[tokio::test]
async fn an_in_place_update_that_reboots_changes_the_boot_id_and_others_do_not() {
    let dir = tempfile::tempdir().unwrap();
    // Updates take 300 ms: the boot ID is read while the update runs (checked below).
    let cfg = Config {
        state_file: Some(dir.path().join("cloud.json")),
        update_latency: Duration::from_millis(300),
        ..fast()
    };
    let d = FakeDriver::new(cfg.clone()).unwrap();
    running(&d, "m1", spec()).await;
    let boot = |d: &FakeDriver| d.kubelet_view().1[0].boot_id.clone();
    let running_op =
        |d: &FakeDriver, op: &Operation| op_id(op).is_some_and(|id| !FakeDriver::op_view(&d.cloud(), &id).is_done());
    let first = boot(&d);
    assert!(!first.is_empty());
    let update = |knob: &str, machine_type: &str| UpdateMachine {
        name: "m1".into(),
        provider_spec: json!({"machineType": machine_type, "inPlaceDisruption": knob}),
        secrets: Secrets::default(),
    };
    for (knob, machine_type, rebooted) in
        [("None", "medium", false), ("Drain", "large", false), ("Reboot", "small", true), ("Unset", "medium", true)]
    {
        let before = boot(&d);
        let op = d.update_machine(&ctx("UpdateMachine"), update(knob, machine_type)).await.unwrap();
        // Read first, then asked whether the update still ran: if it did, the read was before
        // its end (a loaded machine can take longer than the update between the two).
        let during = boot(&d);
        if running_op(&d, &op) {
            assert_eq!(during, before, "{knob}: not before the update ends");
        }
        let done = settle(&d, op).await;
        assert!(matches!(done.outcome, Some(Ok(_))), "{knob}: {done:?}");
        assert_eq!(boot(&d) != before, rebooted, "{knob}");
        assert_eq!(d.kubelet_view().1[0].machine_type, machine_type);
    }
    assert_ne!(boot(&d), first);
    // Kept in the state file.
    let last = boot(&d);
    drop(d);
    assert_eq!(boot(&FakeDriver::new(cfg).unwrap()), last);
}
