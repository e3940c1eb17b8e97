//! The validation rules `machine-controller apply` checks and the CRDs carry as CEL rules
//! (`x-kubernetes-validations`) and schema bounds: one table of objects, each applied with the
//! real CLI to an embedded store and with the real kubectl to a real kube-apiserver holding the
//! CRDs. Both refuse the invalid ones naming the same field with the same message, and both
//! accept the valid ones.

use e2e_tests::kube_cluster::Cluster;
use e2e_tests::{bin, run};
use machine_controller::manifest;
use serde_json::{json, Value};

/// One row: a kind, the spec fields laid over a valid spec, and the refusal expected
/// (`field`, `message`), or `None` when both must accept it.
type Row = (&'static str, Value, Option<(&'static str, &'static str)>);

const USER_DATA: &str = machine_controller::resources::boot_data::RULE_MESSAGE;
const AT_LEAST_0: &str = "should be greater than or equal to 0";
const INT_OR_PERCENT: &str = "must be an integer of at least 0 or a percentage like \"25%\"";
const AT_MOST_100: &str = "must not be more than 100%";
const NOT_BOTH_ZERO: &str = "must not be 0 when maxSurge is 0";
const AT_LEAST_1: &str = "must be at least 1";
const WITHIN_BOUNDS: &str =
    "must lie within spec.autoscaling's [minReplicas, maxReplicas] (the cluster-autoscaler sizes it there)";

fn table() -> Vec<Row> {
    const MD: &str = "MachineDeployment";
    const MP: &str = "MachinePool";
    const MC: &str = "MachineClass";
    let rolling = |surge: Value, unavailable: Value| json!({"strategy": {"rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}}});
    let pool =
        |surge: Value, unavailable: Value| json!({"strategy": {"maxSurge": surge, "maxUnavailable": unavailable}});
    let surge = "spec.strategy.rollingUpdate.maxSurge";
    let unavailable = "spec.strategy.rollingUpdate.maxUnavailable";
    vec![
        // Valid: both accept.
        (MD, rolling(json!("25%"), json!(0)), None),
        (MD, rolling(json!(0), json!("10%")), None),
        (MD, rolling(json!("100%"), json!("1")), None),
        (MD, json!({"minReadySeconds": 30, "progressDeadlineSeconds": 31, "nodeStartupTimeoutSeconds": 0}), None),
        (
            MD,
            json!({"replicas": 100000, "volumeDetachTimeoutSeconds": 0, "strategy": {"inPlace": {"maxUnavailable": 0}}}),
            None,
        ),
        (MP, pool(json!(0), json!(1)), None),
        (MP, pool(json!("0%"), json!("100%")), None),
        // Replicas.
        (MD, json!({"replicas": -1}), Some(("spec.replicas", AT_LEAST_0))),
        (MD, json!({"replicas": 100001}), Some(("spec.replicas", "must be at most 100000"))),
        (MP, json!({"replicas": -3}), Some(("spec.replicas", AT_LEAST_0))),
        (MP, json!({"replicas": 200000}), Some(("spec.replicas", "must be at most 100000"))),
        // Autoscaling bounds: min ≤ max, and replicas within them (so `kubectl scale` stays there).
        (
            MD,
            json!({"replicas": 3, "autoscaling": {"minReplicas": 1, "maxReplicas": 5,
                   "scaleDown": {"utilizationThreshold": 0.4, "unneededTime": "5m"}}}),
            None,
        ),
        (MP, json!({"replicas": 0, "autoscaling": {"minReplicas": 0, "maxReplicas": 3}}), None),
        (
            MD,
            json!({"replicas": 3, "autoscaling": {"minReplicas": 4, "maxReplicas": 2}}),
            Some(("spec.autoscaling.maxReplicas", "must be at least minReplicas")),
        ),
        (
            MP,
            json!({"replicas": 3, "autoscaling": {"minReplicas": 4, "maxReplicas": 2}}),
            Some(("spec.autoscaling.maxReplicas", "must be at least minReplicas")),
        ),
        (
            MD,
            json!({"replicas": 9, "autoscaling": {"minReplicas": 1, "maxReplicas": 5}}),
            Some(("spec.replicas", WITHIN_BOUNDS)),
        ),
        (
            MP,
            json!({"replicas": 0, "autoscaling": {"minReplicas": 1, "maxReplicas": 5}}),
            Some(("spec.replicas", WITHIN_BOUNDS)),
        ),
        (
            MD,
            json!({"autoscaling": {"minReplicas": 1, "maxReplicas": 5, "scaleDown": {"utilizationThreshold": 1.5}}}),
            Some(("spec.autoscaling.scaleDown.utilizationThreshold", "should be less than or equal to 1")),
        ),
        // Failure domains: unique names, a backoff within its maximum, weights and skew of at least 1.
        (
            MD,
            json!({"failureDomains": [{"name": "a", "providerSpec": {"zone": "zone-a"}}, {"name": "b", "weight": 2}],
                   "rebalance": {"maxSkew": 2}, "failureDomainBackoff": {"initialSeconds": 10, "maxSeconds": 20}}),
            None,
        ),
        (
            MD,
            json!({"failureDomains": [{"name": "a"}, {"name": "b"}, {"name": "a"}]}),
            Some(("spec.failureDomains", "every failure domain needs a name of its own")),
        ),
        (
            MD,
            json!({"failureDomainBackoff": {"initialSeconds": 100, "maxSeconds": 10}}),
            Some(("spec.failureDomainBackoff.initialSeconds", "must not be greater than maxSeconds")),
        ),
        (
            MD,
            json!({"failureDomainBackoff": {"initialSeconds": 3600}}),
            Some(("spec.failureDomainBackoff.initialSeconds", "must not be greater than maxSeconds")),
        ),
        (
            MD,
            json!({"rebalance": {"maxSkew": 0}}),
            Some(("spec.rebalance.maxSkew", "should be greater than or equal to 1")),
        ),
        (
            MD,
            json!({"failureDomains": [{"name": "a", "weight": 0}]}),
            Some(("spec.failureDomains[0].weight", "should be greater than or equal to 1")),
        ),
        // Int-or-percent format and range.
        (MD, rolling(json!("lots"), json!(0)), Some((surge, INT_OR_PERCENT))),
        (MD, rolling(json!(-1), json!(1)), Some((surge, INT_OR_PERCENT))),
        (MD, rolling(json!(" 25%"), json!(0)), Some((surge, INT_OR_PERCENT))),
        (MD, rolling(json!("101%"), json!(0)), Some((surge, AT_MOST_100))),
        (MD, rolling(json!(1), json!("-10%")), Some((unavailable, INT_OR_PERCENT))),
        (MD, rolling(json!(1), json!("150%")), Some((unavailable, AT_MOST_100))),
        (
            MD,
            json!({"strategy": {"inPlace": {"maxUnavailable": "x"}}}),
            Some(("spec.strategy.inPlace.maxUnavailable", INT_OR_PERCENT)),
        ),
        (
            MD,
            json!({"strategy": {"inPlace": {"maxUnavailable": "0200%"}}}),
            Some(("spec.strategy.inPlace.maxUnavailable", AT_MOST_100)),
        ),
        (MP, pool(json!("1.5"), json!(0)), Some(("spec.strategy.maxSurge", INT_OR_PERCENT))),
        (MP, pool(json!("1000%"), json!(0)), Some(("spec.strategy.maxSurge", AT_MOST_100))),
        (MP, pool(json!(1), json!("abc")), Some(("spec.strategy.maxUnavailable", INT_OR_PERCENT))),
        (MP, pool(json!(1), json!("110%")), Some(("spec.strategy.maxUnavailable", AT_MOST_100))),
        // maxSurge and maxUnavailable not both 0 (maxUnavailable defaults to 0).
        (MD, rolling(json!(0), json!(0)), Some((unavailable, NOT_BOTH_ZERO))),
        (MD, json!({"strategy": {"rollingUpdate": {"maxSurge": "0%"}}}), Some((unavailable, NOT_BOTH_ZERO))),
        (MP, pool(json!("0"), json!("0%")), Some(("spec.strategy.maxUnavailable", NOT_BOTH_ZERO))),
        // Durations and counts.
        (
            MD,
            json!({"drainTimeoutSeconds": 0}),
            Some(("spec.drainTimeoutSeconds", "must be at least 1 (a drain always has a deadline)")),
        ),
        (
            MP,
            json!({"drainTimeoutSeconds": 0}),
            Some(("spec.drainTimeoutSeconds", "must be at least 1 (a drain always has a deadline)")),
        ),
        (
            MD,
            json!({"progressDeadlineSeconds": 0, "minReadySeconds": 0}),
            Some(("spec.progressDeadlineSeconds", AT_LEAST_1)),
        ),
        (MD, json!({"creationTimeoutSeconds": 0}), Some(("spec.creationTimeoutSeconds", AT_LEAST_1))),
        (MD, json!({"healthTimeoutSeconds": 0}), Some(("spec.healthTimeoutSeconds", AT_LEAST_1))),
        (MD, json!({"maxConcurrentReplacements": 0}), Some(("spec.maxConcurrentReplacements", AT_LEAST_1))),
        (
            MD,
            json!({"minReadySeconds": 600}),
            Some(("spec.progressDeadlineSeconds", "must be greater than minReadySeconds")),
        ),
        (
            MD,
            json!({"minReadySeconds": 60, "progressDeadlineSeconds": 30}),
            Some(("spec.progressDeadlineSeconds", "must be greater than minReadySeconds")),
        ),
        (MD, json!({"volumeDetachTimeoutSeconds": -5}), Some(("spec.volumeDetachTimeoutSeconds", AT_LEAST_0))),
        (MD, json!({"minReadySeconds": -1}), Some(("spec.minReadySeconds", AT_LEAST_0))),
        (MP, json!({"nodeStartupTimeoutSeconds": -1}), Some(("spec.nodeStartupTimeoutSeconds", AT_LEAST_0))),
        // Canaries: at least 1 machine, at most 100%; none on a MachinePool.
        (MD, canary(json!(1)), None),
        (MD, canary(json!("25%")), None),
        (MD, canary(json!(-1)), Some((CANARY, CANARY_MACHINES))),
        (MD, canary(json!(0)), Some((CANARY, CANARY_MACHINES))),
        (MD, canary(json!("few")), Some((CANARY, CANARY_MACHINES))),
        (MD, canary(json!("0%")), Some((CANARY, CANARY_NOT_ZERO))),
        (MD, canary(json!("150%")), Some((CANARY, AT_MOST_100))),
        (
            MD,
            json!({"strategy": {"rollingUpdate": {"canary": {"machines": 1, "pauseSeconds": -5}}}}),
            Some(("spec.strategy.rollingUpdate.canary.pauseSeconds", AT_LEAST_0)),
        ),
        // A MachinePool's canary: the same rules, under `spec.strategy.canary`.
        (MP, pool_canary(json!(1)), None),
        (MP, pool_canary(json!("34%")), None),
        (MP, pool_canary(json!(0)), Some((POOL_CANARY, CANARY_MACHINES))),
        (MP, pool_canary(json!("few")), Some((POOL_CANARY, CANARY_MACHINES))),
        (MP, pool_canary(json!("0%")), Some((POOL_CANARY, CANARY_NOT_ZERO))),
        (MP, pool_canary(json!("150%")), Some((POOL_CANARY, AT_MOST_100))),
        (
            MP,
            json!({"strategy": {"canary": {"machines": 1, "pauseSeconds": -5}}}),
            Some(("spec.strategy.canary.pauseSeconds", AT_LEAST_0)),
        ),
        // Remediation and disruption budgets.
        (MD, budgets(json!([{"machines": "10%"}, night()]), json!("20%")), None),
        (MP, budgets(json!([{"machines": 1}, night()]), json!(2)), None),
        (MD, json!({"remediation": {"maxInFlight": "many"}}), Some(("spec.remediation.maxInFlight", INT_OR_PERCENT))),
        (MD, json!({"remediation": {"maxInFlight": "101%"}}), Some(("spec.remediation.maxInFlight", AT_MOST_100))),
        (MP, json!({"remediation": {"maxInFlight": -1}}), Some(("spec.remediation.maxInFlight", INT_OR_PERCENT))),
        (MP, json!({"remediation": {"maxInFlight": "200%"}}), Some(("spec.remediation.maxInFlight", AT_MOST_100))),
        (
            MD,
            budgets(json!([{"machines": "x"}]), json!(1)),
            Some(("spec.disruption.budgets[0].machines", INT_OR_PERCENT)),
        ),
        (
            MD,
            budgets(json!([{"machines": 1}, {"machines": "150%"}]), json!(1)),
            Some(("spec.disruption.budgets[1].machines", AT_MOST_100)),
        ),
        (
            MP,
            budgets(json!([{"machines": -2}]), json!(1)),
            Some(("spec.disruption.budgets[0].machines", INT_OR_PERCENT)),
        ),
        (
            MP,
            budgets(json!([{"machines": "101%"}]), json!(1)),
            Some(("spec.disruption.budgets[0].machines", AT_MOST_100)),
        ),
        (
            MD,
            budgets(json!([{"machines": 1, "schedule": "@daily"}]), json!(1)),
            Some(("spec.disruption.budgets[0].duration", BUDGET_SCHEDULE)),
        ),
        (
            MP,
            budgets(json!([{"machines": 1, "duration": "1h"}]), json!(1)),
            Some(("spec.disruption.budgets[0].duration", BUDGET_SCHEDULE)),
        ),
        (
            MD,
            budgets(json!([{"machines": 1, "schedule": "@daily", "duration": "1 hour"}]), json!(1)),
            Some(("spec.disruption.budgets[0].duration", BUDGET_DURATION)),
        ),
        (
            MP,
            budgets(json!([night(), {"machines": 0, "schedule": "@hourly", "duration": ""}]), json!(1)),
            Some(("spec.disruption.budgets[1].duration", BUDGET_DURATION)),
        ),
        // A class's boot data template: known variables, closed; other braces are text.
        (
            MC,
            json!({"userData": "#!/bin/sh\nkubeadm join {{ .APIServerHost }} --token {{.BootstrapToken}} --discovery-token-ca-cert-hash {{ .CACertHash }}\necho {{ v1.local_hostname }}\n"}),
            None,
        ),
        (MC, json!({"userData": "no variables"}), None),
        (MC, json!({"userData": "token={{ .Token }}"}), Some(("spec.userData", USER_DATA))),
        (MC, json!({"userData": "name={{ .MachineName"}), Some(("spec.userData", USER_DATA))),
        (MC, json!({"userData": "{{{ .Nope }}"}), Some(("spec.userData", USER_DATA))),
    ]
}

const BUDGET_SCHEDULE: &str = "is required with a schedule, and needs one";
const BUDGET_DURATION: &str = "must be like 1h, 30m, 1h30m or 90s";

/// `spec.disruption.budgets` and `spec.remediation.maxInFlight`.
const CANARY: &str = "spec.strategy.rollingUpdate.canary.machines";
const CANARY_MACHINES: &str = "must be an integer of at least 1 or a percentage like \"25%\"";
const CANARY_NOT_ZERO: &str = "must be at least 1 (or 1%): a canary of no machines is none; leave canary out";
const POOL_CANARY: &str = "spec.strategy.canary.machines";

/// A MachineDeployment's canary of `machines`, paused 30 s.
fn canary(machines: Value) -> Value {
    json!({"strategy": {"rollingUpdate": {"canary": {"machines": machines, "pauseSeconds": 30}}}})
}

fn budgets(budgets: Value, max_in_flight: Value) -> Value {
    json!({"disruption": {"budgets": budgets}, "remediation": {"maxInFlight": max_in_flight}})
}

/// A MachinePool's canary of `machines`, paused 30 s.
fn pool_canary(machines: Value) -> Value {
    json!({"strategy": {"canary": {"machines": machines, "pauseSeconds": 30}}})
}

/// A budget for a night window in Berlin.
fn night() -> Value {
    json!({"machines": 0, "schedule": "0 1 * * *", "duration": "4h", "timeZone": "Europe/Berlin", "reasons": ["Rollout", "ScaleDown"]})
}

/// A field path with its list indices dropped (`budgets[1].machines` → `budgets[].machines`),
/// as a rule names the field it sits on.
fn without_indices(field: &str) -> String {
    let mut out = String::new();
    let mut skipping = false;
    for c in field.chars() {
        match c {
            '[' => {
                skipping = true;
                out.push(c);
            }
            ']' => {
                skipping = false;
                out.push(c);
            }
            _ if skipping => {}
            _ => out.push(c),
        }
    }
    out
}

/// The object of row `i`: a valid spec with the row's fields laid over it.
fn object(i: usize, kind: &str, fields: &Value) -> Value {
    let mut spec = if kind == "MachineClass" {
        json!({"driver": "fake", "providerSpec": {}})
    } else {
        json!({"replicas": 2, "template": {"spec": {"classRef": {"name": "small"}}}})
    };
    for (k, v) in fields.as_object().expect("a mapping") {
        spec[k] = v.clone();
    }
    json!({"apiVersion": "machine.driver.dev/v1alpha1", "kind": kind, "metadata": {"name": format!("row-{i}")}, "spec": spec})
}

/// The (field, message) pairs of `apply`'s errors (`error: FILE: document 1 at line 1 (KIND/NAME):
/// FIELD: MESSAGE`).
fn apply_errors(stderr: &str) -> Vec<(String, String)> {
    stderr
        .lines()
        .filter_map(|l| l.strip_prefix("error: "))
        .filter_map(|l| l.split_once("): ").map(|(_, rest)| rest))
        .filter_map(|l| l.split_once(": ").map(|(f, m)| (f.to_string(), m.to_string())))
        .collect()
}

/// kubectl's causes: `The X "n" is invalid: FIELD: Invalid value: ...` for one, else one `* ...`
/// line each. Left out: the scale subresource's own check of its replicas path
/// (`.spec.replicas: ... should be a non-negative integer`), which repeats the schema's minimum.
fn kubectl_causes(stderr: &str) -> Vec<&str> {
    let mut causes: Vec<&str> = stderr.lines().filter_map(|l| l.strip_prefix("* ")).collect();
    if causes.is_empty() {
        causes = stderr.lines().filter_map(|l| l.split_once(" is invalid: ").map(|(_, c)| c)).collect();
    }
    causes.retain(|c| !c.starts_with(".spec.replicas: "));
    causes
}

/// Whether both refuse with the same causes, `expected` among them: as many causes each, and
/// each of `apply`'s (field, message) a kubectl cause naming that field and ending with that
/// message.
fn same_refusal(cli: &[(String, String)], kube: &[&str], expected: (&str, &str)) -> bool {
    let has_expected = cli.iter().any(|(f, m)| (f.as_str(), m.as_str()) == expected);
    let all_match = cli.iter().all(|(field, message)| {
        kube.iter().any(|c| c.starts_with(&format!("{field}: ")) && c.ends_with(message.as_str()))
    });
    has_expected && all_match && cli.len() == kube.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_and_the_api_server_refuse_the_same_objects_with_the_same_words() {
    let table = table();
    // Every rule of the CLI is in the table.
    for rule in manifest::rules() {
        let path = rule.path();
        let covered = table.iter().any(|(kind, _, e)| {
            *kind == rule.kind.as_str() && e.is_some_and(|(f, m)| without_indices(f) == path && m == rule.message)
        });
        assert!(covered, "no row for {} {}: {}", rule.kind.as_str(), rule.path(), rule.message);
    }

    let cluster = Cluster::start().await;
    let ns = cluster.namespace("rules").await;
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("store.db").display());
    let mut failures = Vec::new();
    for (i, (kind, fields, expected)) in table.iter().enumerate() {
        let obj = object(i, kind, fields);
        let file = dir.path().join(format!("row-{i}.yaml"));
        std::fs::write(&file, serde_saphyr::to_string(&obj).unwrap()).unwrap();
        let path = file.to_str().unwrap();
        let (cli_code, cli_out, cli_err) =
            run(&bin("machine-controller"), &["--store", &store, "apply", "-f", path]).await;
        let (kube_code, kube_out, kube_err) = cluster.kubectl(&["apply", "-n", &ns, "-f", path]).await;
        let row = format!("row {i}: {kind} {fields}");
        match expected {
            None => {
                if cli_code != 0 || kube_code != 0 {
                    failures.push(format!(
                        "{row}: not accepted by both\n  apply ({cli_code}): {cli_out}{cli_err}\n  kubectl ({kube_code}): {kube_out}{kube_err}"
                    ));
                }
            }
            Some((field, message)) => {
                let (cli, kube) = (apply_errors(&cli_err), kubectl_causes(&kube_err));
                let refused = cli_code != 0 && kube_code != 0;
                if !refused || !same_refusal(&cli, &kube, (field, message)) {
                    failures.push(format!(
                        "{row}: expected {field}: {message}\n  apply ({cli_code}): {cli_err}\n  kubectl ({kube_code}): {kube_err}"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} of {} rows differ:\n{}", failures.len(), table.len(), failures.join("\n"));
    // The valid rows are stored in both places.
    let (code, out, err) =
        run(&bin("machine-controller"), &["--store", &store, "get", "machinedeployments", "-o", "json"]).await;
    assert_eq!(code, 0, "{err}");
    let stored: Value = serde_json::from_str(&out).unwrap();
    let (code, out, err) = cluster.kubectl(&["get", "machinedeployments,machinepools", "-n", &ns, "-o", "name"]).await;
    assert_eq!(code, 0, "{err}");
    let valid = table.iter().filter(|(k, _, e)| e.is_none() && *k != "MachineClass").count();
    assert_eq!(out.lines().count(), valid, "{out}");
    let md_valid = table.iter().filter(|(k, _, e)| e.is_none() && *k == "MachineDeployment").count();
    assert_eq!(stored["items"].as_array().map(Vec::len), Some(md_valid), "{stored}");
}
