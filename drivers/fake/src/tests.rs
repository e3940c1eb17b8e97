use super::*;
use driver_sdk::Secrets;
use std::collections::BTreeMap;

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

async fn settle(d: &FakeDriver, op: Operation) -> Operation {
    let t: TokenState = serde_json::from_value(op.state.clone()).unwrap();
    let Some(id) = t.op else { return op };
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let st = d.cloud();
        let view = FakeDriver::op_view(&st, &id);
        drop(st);
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
