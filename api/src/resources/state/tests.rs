use serde_json::json;

use super::*;
use crate::resources::{Machine, MachineDeployment, MachinePool, Phase};

#[test]
fn closed_enums_serialize_to_their_names_and_back() {
    for s in ConditionStatus::ALL {
        assert_eq!(serde_json::to_value(s).unwrap(), json!(s.as_str()));
        assert_eq!(s.as_str().parse::<ConditionStatus>(), Ok(*s));
    }
    for t in ConditionType::ALL {
        assert_eq!(serde_json::to_value(t).unwrap(), json!(t.as_str()));
        assert_eq!(serde_json::from_value::<ConditionType>(json!(t.as_str())).unwrap(), *t);
    }
    for k in OperationKind::ALL {
        assert_eq!(serde_json::to_value(k).unwrap(), json!(k.as_str()));
    }
    // That the protocol's enum names the same RPCs is checked where both are known: the
    // controller's unit tests.
    for o in OperationType::ALL {
        assert_eq!(serde_json::to_value(o).unwrap(), json!(o.as_str()));
    }
    for o in OperationState::ALL {
        assert_eq!(serde_json::to_value(o).unwrap(), json!(o.as_str()));
    }
    assert!("Maybe".parse::<ConditionStatus>().is_err());
    assert!(serde_json::from_value::<ConditionStatus>(json!("true")).is_err(), "statuses are case-sensitive");
}

#[test]
fn reasons_are_open_but_canonical() {
    assert_eq!(Reason::parse("QuotaExceeded"), Reason::QuotaExceeded);
    assert_eq!(Reason::from_driver("QUOTA_EXCEEDED"), Reason::QuotaExceeded);
    assert_eq!(Reason::from_driver("CLOUD_AUTH_FAILED"), Reason::Other("CloudAuthFailed".into()));
    assert_eq!(Reason::from_driver("INVALID_PROVIDER_SPEC"), "InvalidProviderSpec");
    assert_eq!(Reason::from(ConditionType::CloudUnavailable), Reason::CloudUnavailable);
    assert_eq!(Reason::from(Phase::Terminating), Reason::Terminating);
    assert_eq!(Reason::retrying(OperationType::Create), "CreateRetrying");
    assert_eq!(Reason::retrying(OperationType::ApplyPool), "ApplyPoolRetrying");
    for r in [Reason::Rolling, Reason::Other("UpdateNeedsReplacement".into())] {
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v, json!(r.as_str()));
        assert_eq!(serde_json::from_value::<Reason>(v).unwrap(), r);
    }
}

#[test]
fn upper_camel_reasons() {
    assert_eq!(upper_camel("QUOTA_EXCEEDED"), "QuotaExceeded");
    assert_eq!(upper_camel("INVALID_PROVIDER_SPEC"), "InvalidProviderSpec");
    assert_eq!(upper_camel("_A__B_"), "AB");
}

/// Objects as the controller stored them before the status vocabulary was typed read the same
/// and write back byte for byte.
#[test]
fn stored_objects_of_the_string_era_round_trip() {
    let machine = json!({
        "apiVersion": "machine.driver.dev/v1alpha1",
        "kind": "Machine",
        "metadata": {"name": "web-1", "namespace": "default", "uid": "u1", "resourceVersion": "7",
            "finalizers": ["machine.driver.dev/cloud-machine"]},
        "spec": {"classRef": {"name": "small"}},
        "status": {
            "phase": "Failed",
            "providerId": "fake://m-1",
            "conditions": [
                {"type": "Ready", "status": "False", "reason": "Failed", "message": "boom",
                 "lastTransitionTime": "2026-01-01T00:00:00Z"},
                {"type": "Failed", "status": "True", "reason": "CloudOperationFailed", "message": "boom",
                 "lastTransitionTime": "2026-01-01T00:00:00Z"},
                {"type": "UpToDate", "status": "Unknown", "reason": "SpecApplied", "message": "",
                 "lastTransitionTime": "2026-01-01T00:00:00Z"}
            ],
            "operations": [{"kind": "DeleteMachine", "name": "op-1", "token": "dG9r",
                "started": "2026-01-01T00:00:00Z", "requestId": "r-1", "progress": 50}],
            "lastOperation": {"type": "Create", "state": "Failed", "code": "Internal",
                "reason": "CLOUD_OPERATION_FAILED", "message": "boom", "requestId": "r-0",
                "time": "2026-01-01T00:00:00Z"},
            "requestIds": ["r-0", "r-1"]
        }
    });
    let m: Machine = serde_json::from_value(machine.clone()).unwrap();
    assert_eq!(m.status.phase, Phase::Failed);
    let failed = crate::resources::condition(&m.status.conditions, ConditionType::Failed).unwrap();
    assert_eq!((failed.status, &failed.reason), (ConditionStatus::True, &Reason::Other("CloudOperationFailed".into())));
    assert_eq!(m.status.conditions[0].reason, Reason::Failed);
    assert_eq!(m.status.conditions[2].status, ConditionStatus::Unknown);
    assert_eq!(m.status.operations[0].kind, OperationKind::DeleteMachine);
    let last = m.status.last_operation.as_ref().unwrap();
    assert_eq!((last.op_type, last.state), (OperationType::Create, OperationState::Failed));
    assert_eq!(serde_json::to_value(&m).unwrap(), machine);

    let deployment = json!({
        "apiVersion": "machine.driver.dev/v1alpha1",
        "kind": "MachineDeployment",
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"replicas": 2, "template": {"spec": {"classRef": {"name": "small"}}}},
        "status": {
            "conditions": [
                {"type": "Progressing", "status": "False", "reason": "RolloutAborted", "message": "m",
                 "lastTransitionTime": "2026-01-01T00:00:00Z"},
                {"type": "CloudCredentialsRefused", "status": "True", "reason": "CloudAuthFailed", "message": "m",
                 "lastTransitionTime": "2026-01-01T00:00:00Z"},
                {"type": "Available", "status": "False", "reason": "CloudCredentialsRefused", "message": "m",
                 "lastTransitionTime": "2026-01-01T00:00:00Z"}
            ]
        }
    });
    let md: MachineDeployment = serde_json::from_value(deployment).unwrap();
    assert_eq!(md.status.conditions[0].condition_type, ConditionType::Progressing);
    assert_eq!(md.status.conditions[0].reason, Reason::RolloutAborted);
    assert_eq!(md.status.conditions[2].reason, Reason::CloudCredentialsRefused);

    // A pool's refused ApplyPool call was recorded as `Apply`; it reads as ApplyPool.
    let pool = json!({
        "apiVersion": "machine.driver.dev/v1alpha1",
        "kind": "MachinePool",
        "metadata": {"name": "workers", "namespace": "default"},
        "spec": {"replicas": 1, "template": {"spec": {"classRef": {"name": "small"}}}},
        "status": {
            "operations": [{"kind": "UpgradePoolInstances", "name": "op", "token": "dA==",
                "started": "2026-01-01T00:00:00Z", "requestId": "r"}],
            "lastOperation": {"type": "Apply", "state": "Failed", "code": "Unavailable", "requestId": "r",
                "time": "2026-01-01T00:00:00Z"}
        }
    });
    let p: MachinePool = serde_json::from_value(pool).unwrap();
    assert_eq!(p.status.last_operation.unwrap().op_type, OperationType::ApplyPool);
    assert_eq!(p.status.operations[0].kind, OperationKind::UpgradePoolInstances);
}

#[test]
fn the_crd_schema_lists_closed_values_and_leaves_reasons_open() {
    let crds = crate::crd::crds();
    let machine = crds.iter().find(|c| c["spec"]["names"]["kind"] == "Machine").unwrap();
    let status = &machine["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"];
    let condition = &status["conditions"]["items"]["properties"];
    assert_eq!(condition["status"]["enum"], json!(["True", "False", "Unknown"]));
    assert_eq!(condition["type"]["type"], json!("string"));
    assert!(condition["type"]["enum"].as_array().unwrap().contains(&json!("Ready")));
    assert_eq!(condition["reason"]["type"], json!("string"));
    assert!(condition["reason"].get("enum").is_none(), "drivers add reasons");
    assert!(status["operations"]["items"]["properties"]["kind"]["enum"]
        .as_array()
        .unwrap()
        .contains(&json!("CreateMachine")));
    assert!(status["lastOperation"]["properties"]["state"]["enum"].as_array().unwrap().contains(&json!("Processing")));
}
