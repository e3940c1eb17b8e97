//! Machines join with credentials minted for them alone: boot data rendered per machine from the
//! class's template, a bootstrap token per machine in the target cluster (docs/src/operating/
//! joining-nodes.md).

use std::time::Duration;

use e2e_tests::eventually;
use e2e_tests::world::{Driver, World};
use machine_controller::resources::*;

const MINUTE: Duration = Duration::from_secs(60);

fn class(user_data: &str) -> String {
    let indented: String = user_data.lines().map(|l| format!("    {l}\n")).collect();
    format!(
        "apiVersion: machine.driver.dev/v1alpha1\nkind: MachineClass\nmetadata: {{name: small}}\nspec:\n  driver: fake\n  providerSpec: {{machineType: small}}\n  userData: |\n{indented}"
    )
}

const DEPLOYMENT: &str = "apiVersion: machine.driver.dev/v1alpha1
kind: MachineDeployment
metadata: {name: web}
spec:
  replicas: 2
  template:
    spec:
      classRef: {name: small}
";

/// Without a target cluster there is no token to mint and no API server to name: nothing is
/// created, the machines and their deployment say why; a template that needs none creates them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_that_needs_a_target_cluster_creates_nothing_without_one_and_says_why() {
    let w = World::builder().driver(Driver::fake(&["--create-latency", "100ms"])).in_process().start().await;
    w.apply(&class("#!/bin/sh\nkubeadm join {{ .APIServerHost }} --token {{ .BootstrapToken }}")).await;
    w.apply(DEPLOYMENT).await;
    let md = eventually(MINUTE, "the deployment's BootDataUnrenderable condition", || async {
        let md = w.md("web").await;
        let c = condition(&md.status.conditions, ConditionType::BootDataUnrenderable)?;
        (c.status == ConditionStatus::True).then_some(md)
    })
    .await;
    let c = condition(&md.status.conditions, ConditionType::BootDataUnrenderable).unwrap();
    assert!(
        c.message.contains("{{ .APIServerHost }}") && c.message.contains("needs a target cluster"),
        "{}",
        c.message
    );
    for m in w.machines().await {
        let ready = condition(&m.status.conditions, ConditionType::Ready).unwrap();
        assert_eq!(ready.reason, Reason::BootDataUnrenderable, "{}", m.metadata.name);
        assert!(m.status.bootstrap_token.is_none(), "no token is minted without a target");
    }
    assert!(w.inspect().await.machines.is_empty(), "nothing half-rendered is created");

    // A template of the machine's own variables renders without a cluster.
    w.apply(&class("#!/bin/sh\nhostname {{ .MachineName }}\necho {{ v1.local_hostname }}")).await;
    eventually(MINUTE, "both machines created and the condition gone", || async {
        let md = w.md("web").await;
        let created = w.inspect().await.machines.iter().filter(|m| m.state == "RUNNING").count();
        (created == 2 && condition(&md.status.conditions, ConditionType::BootDataUnrenderable).is_none()).then_some(())
    })
    .await;
}
