use serde_json::Value;

use super::show::table;
use super::*;

fn samples() -> Vec<(Kind, Vec<Value>)> {
    use serde_json::json;
    let meta = |name: &str| json!({"name": name, "namespace": "default"});
    vec![
        (
            Kind::Secret,
            vec![
                json!({"apiVersion": "v1", "kind": "Secret", "metadata": meta("s"), "stringData": {"a": "b"}, "data": {"c": "ZA=="}}),
                json!({"apiVersion": "v1", "kind": "Secret", "metadata": meta("t")}),
            ],
        ),
        (
            Kind::MachineClass,
            vec![
                json!({"apiVersion": API_VERSION, "kind": "MachineClass", "metadata": meta("c"), "spec": {"driver": "fake", "providerSpec": {}}}),
                json!({"apiVersion": API_VERSION, "kind": "MachineClass", "metadata": meta("d"), "spec": {"driver": "fake", "providerSpec": {}},
                "status": {"conditions": [{"type": "Valid", "status": "False", "reason": "Invalid", "message": "m", "lastTransitionTime": "2024-01-01T00:00:00Z"}]}}),
            ],
        ),
        (
            Kind::MachineDeployment,
            vec![
                json!({"apiVersion": API_VERSION, "kind": "MachineDeployment", "metadata": meta("web"), "spec": {"replicas": 3, "template": {"spec": {"classRef": {"name": "c"}}}}}),
                json!({"apiVersion": API_VERSION, "kind": "MachineDeployment", "metadata": meta("api"),
                "spec": {"replicas": 2, "template": {"spec": {"classRef": {"name": "c"}}}, "strategy": {"type": "InPlace"}},
                "status": {"replicas": 2, "updatedReplicas": 1, "readyReplicas": 1, "availableReplicas": 1, "targetRevision": "abc",
                    "badRevisions": [{"revision": "0123456789abcdef0123", "reason": "r", "time": "2024-01-01T00:00:00Z"}, {"revision": "fedcba98765432100000", "reason": "r", "time": "2024-01-01T00:00:00Z"}],
                    "conditions": [{"type": "Progressing", "status": "True", "reason": "NewRevisionAvailable", "message": "", "lastTransitionTime": "2024-01-01T00:00:00Z"}]}}),
            ],
        ),
        (
            Kind::MachinePool,
            vec![
                json!({"apiVersion": API_VERSION, "kind": "MachinePool", "metadata": meta("p"), "spec": {"replicas": 4, "template": {"spec": {"classRef": {"name": "c"}}}},
                "status": {"replicas": 3, "readyReplicas": 2, "updatedReplicas": 1, "providerId": "pool-1"}}),
            ],
        ),
        (
            Kind::Machine,
            vec![
                json!({"apiVersion": API_VERSION, "kind": "Machine", "metadata": meta("m"), "spec": {"classRef": {"name": "c"}}}),
                json!({"apiVersion": API_VERSION, "kind": "Machine", "metadata": {"name": "n", "namespace": "default", "labels": {LABEL_REVISION: "r1"}},
                "spec": {"classRef": {"name": "c"}},
                "status": {"phase": "Running", "providerId": "fake:///a/1", "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}],
                    "nodeRef": {"name": "node-1"},
                    "lastOperation": {"type": "Create", "state": "Succeeded", "code": "OK", "requestId": "req-1", "time": "2024-01-01T00:00:00Z"}}}),
            ],
        ),
        (
            Kind::MachineHealthCheck,
            vec![
                json!({"apiVersion": API_VERSION, "kind": "MachineHealthCheck", "metadata": meta("web"), "spec": {"selector": {"matchLabels": {"a": "b"}}}}),
                json!({"apiVersion": API_VERSION, "kind": "MachineHealthCheck", "metadata": meta("api"),
                "spec": {"selector": {"matchLabels": {"a": "b"}}, "maxUnhealthy": "40%"},
                "status": {"expectedMachines": 5, "currentHealthy": 4, "remediationsAllowed": 1}}),
            ],
        ),
    ]
}

/// What `get` printed before the columns were declared on the types (checked against that
/// code when they moved), and the tables of kinds added since.
fn golden(kind: Kind, wide: bool) -> Vec<Vec<&'static str>> {
    match (kind, wide) {
        (Kind::Secret, _) => vec![vec!["NAME", "KEYS", "AGE"], vec!["s", "2", "-"], vec!["t", "0", "-"]],
        (Kind::MachineClass, _) => vec![
            vec!["NAME", "DRIVER", "VALID", "AGE"],
            vec!["c", "fake", "-", "-"],
            vec!["d", "fake", "False/Invalid", "-"],
        ],
        (Kind::MachineDeployment, false) => vec![
            vec!["NAME", "DESIRED", "CURRENT", "UPDATED", "READY", "AVAILABLE", "REVISION", "AGE"],
            vec!["web", "3", "0", "0", "0", "0", "-", "-"],
            vec!["api", "2", "2", "1", "1", "1", "abc", "-"],
        ],
        (Kind::MachineDeployment, true) => vec![
            vec![
                "NAME",
                "DESIRED",
                "CURRENT",
                "UPDATED",
                "READY",
                "AVAILABLE",
                "REVISION",
                "AGE",
                "STRATEGY",
                "DOMAINS",
                "PROGRESSING",
                "BAD-REVISIONS",
            ],
            vec!["web", "3", "0", "0", "0", "0", "-", "-", "RollingUpdate", "-", "-", ""],
            vec![
                "api",
                "2",
                "2",
                "1",
                "1",
                "1",
                "abc",
                "-",
                "InPlace",
                "-",
                "True/NewRevisionAvailable",
                "0123456789abcdef0123,fedcba9876543210000",
            ],
        ],
        (Kind::MachinePool, _) => {
            vec![vec!["NAME", "DESIRED", "CURRENT", "READY", "UPDATED", "AGE"], vec!["p", "4", "3", "2", "1", "-"]]
        }
        (Kind::Machine, false) => vec![
            vec!["NAME", "PHASE", "NODE", "PROVIDER-ID", "AGE"],
            vec!["m", "Pending", "-", "-", "-"],
            vec!["n", "Running", "node-1", "fake:///a/1", "-"],
        ],
        (Kind::Machine, true) => vec![
            vec![
                "NAME",
                "PHASE",
                "NODE",
                "PROVIDER-ID",
                "AGE",
                "CLASS",
                "DOMAIN",
                "REVISION",
                "ADDRESS",
                "LAST-OP",
                "REQUEST-ID",
            ],
            vec!["m", "Pending", "-", "-", "-", "c", "-", "-", "-", "-", "-"],
            vec![
                "n",
                "Running",
                "node-1",
                "fake:///a/1",
                "-",
                "c",
                "-",
                "r1",
                "10.0.0.1",
                "Create/Succeeded/OK",
                "req-1",
            ],
        ],
        (Kind::MachineHealthCheck, false) => vec![
            vec!["NAME", "EXPECTED", "HEALTHY", "REMEDIATIONS-ALLOWED", "AGE"],
            vec!["web", "0", "0", "0", "-"],
            vec!["api", "5", "4", "1", "-"],
        ],
        (Kind::MachineHealthCheck, true) => vec![
            vec!["NAME", "EXPECTED", "HEALTHY", "REMEDIATIONS-ALLOWED", "AGE", "MAX-UNHEALTHY"],
            vec!["web", "0", "0", "0", "-", "100%"],
            vec!["api", "5", "4", "1", "-", "40%"],
        ],
    }
}

#[test]
fn get_prints_each_kinds_declared_columns() {
    for (kind, raw) in samples() {
        for wide in [false, true] {
            assert_eq!(table(kind, raw.clone(), wide).unwrap(), golden(kind, wide), "{kind} wide={wide}");
        }
    }
    let kinds: Vec<Kind> = samples().into_iter().map(|(k, _)| k).collect();
    assert_eq!(kinds, Kind::ALL, "a sample of every kind");
}

#[test]
fn every_kind_is_named_by_its_plural_short_names_and_aliases() {
    for kind in Kind::ALL {
        for name in [kind.as_str(), kind.plural()].iter().chain(kind.short_names()).chain(kind.aliases()) {
            assert_eq!(Kind::parse(name), Some(kind), "{name}");
            assert_eq!(Kind::parse(&name.to_uppercase()), Some(kind), "{name}");
        }
    }
    let e = kind_arg("gizmos").unwrap_err().message;
    assert!(e.starts_with("unknown kind \"gizmos\"; use ") && e.contains("machines (m), "), "{e}");
}
