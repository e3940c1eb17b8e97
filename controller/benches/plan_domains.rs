//! What failure domains cost the deployment planner: one plan of a 10,000-machine deployment in
//! the middle of a rolling update (5,000 machines of the old revision, 5,000 of the new; every
//! removal ordered), without failure domains and over three, side by side in one run.
//!
//! `cargo bench -p machine-controller --bench plan_domains` (the release profile).

use std::time::{Duration, Instant};

use machine_controller::plan::deployment::{plan_deployment, revision, Observed};
use machine_controller::plan::member::Member;
use machine_controller::resources::*;

const MACHINES: usize = 10_000;
const ROUNDS: usize = 20;

fn template(image: &str) -> MachineTemplate {
    let mut t = MachineTemplate::default();
    t.spec.class_ref.name = "small".into();
    t.spec.provider_spec = Some(serde_json::json!({ "image": image }));
    t
}

fn deployment(domains: bool) -> MachineDeployment {
    let manifest = serde_json::json!({
        "apiVersion": API_VERSION, "kind": "MachineDeployment",
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"replicas": MACHINES, "template": template("os-2"),
                 "strategy": {"rollingUpdate": {"maxSurge": "10%", "maxUnavailable": "10%"}}},
    });
    let mut md: MachineDeployment = serde_json::from_value(manifest).expect("a deployment");
    if domains {
        md.spec.failure_domains = ["a", "b", "c"]
            .map(|z| FailureDomain { name: z.into(), provider_spec: None, weight: 1, priority: 0 })
            .to_vec();
    }
    md.status.current_revision = revision(&template("os-1"));
    md
}

fn machines(domains: bool) -> Vec<Member> {
    let (old, new) = (revision(&template("os-1")), revision(&template("os-2")));
    let t0 = chrono::Utc::now() - chrono::Duration::hours(1);
    (0..MACHINES)
        .map(|i| Member {
            name: format!("web-{i:05}"),
            uid: format!("uid-{i}"),
            resource_version: "1".into(),
            revision: if i % 2 == 0 { old.clone() } else { new.clone() },
            created: Some(t0 + chrono::Duration::seconds(i as i64)),
            deleting: false,
            taken: None,
            marked_for_deletion: false,
            remediation: None,
            marked_unhealthy: false,
            phase: Phase::Running,
            failure: None,
            node_template: String::new(),
            ready_since: Some(t0),
            node_not_ready: false,
            waiting: None,
            domain: domains.then(|| ["a", "b", "c"][i % 3].to_string()),
            rebalance: None,
            refusal: None,
            interrupted: None,
            reclaimed: None,
        })
        .collect()
}

fn time(domains: bool) -> Duration {
    let (md, ms) = (deployment(domains), machines(domains));
    let mut best = Duration::MAX;
    for _ in 0..ROUNDS {
        let start = Instant::now();
        let plan = plan_deployment(Observed {
            deployment: &md,
            machines: &ms,
            remediation_halted: None,
            pace: (Duration::from_secs(1), Duration::from_secs(300)),
            now: chrono::Utc::now(),
        });
        best = best.min(start.elapsed());
        assert!(!plan.delete.is_empty() || plan.create > 0, "the plan acts");
    }
    best
}

fn main() {
    // Interleaved, best of each: the machine's noise hits both alike.
    let (mut without, mut with) = (Duration::MAX, Duration::MAX);
    for _ in 0..3 {
        without = without.min(time(false));
        with = with.min(time(true));
    }
    println!("plan of {MACHINES} machines mid-rollout, best of {}:", 3 * ROUNDS);
    println!("  without failure domains: {:>8.2} ms", without.as_secs_f64() * 1e3);
    println!("  over 3 failure domains:  {:>8.2} ms", with.as_secs_f64() * 1e3);
    println!("  ratio: {:.2}×", with.as_secs_f64() / without.as_secs_f64());
}
