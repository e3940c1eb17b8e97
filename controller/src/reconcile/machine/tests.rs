//! The machine reconciler's decisions, without a store, a driver or a process.

use super::*;

/// A Machine fixture: `machine().running("h1").generation(2)` and so on.
fn machine() -> Machine {
    let mut m =
        Machine::new("default", "m", MachineSpec { class_ref: NameRef { name: "c".into() }, ..Default::default() });
    m.metadata.generation = 1;
    m.metadata.finalizers = vec![FINALIZER.into()];
    m
}

trait Fixture {
    fn running(self, hash: &str) -> Self;
    fn phase(self, phase: Phase) -> Self;
    fn generation(self, g: i64) -> Self;
    fn operation(self, kind: OperationKind) -> Self;
    fn failed_for(self, generation: i64, class_generation: i64) -> Self;
}

impl Fixture for Machine {
    fn running(mut self, hash: &str) -> Self {
        self.status.phase = Phase::Running;
        self.status.provider_id = "fake://m".into();
        self.status.spec_hash = hash.into();
        self.status.observed_generation = self.metadata.generation;
        self
    }

    fn phase(mut self, phase: Phase) -> Self {
        self.status.phase = phase;
        self
    }

    fn generation(mut self, g: i64) -> Self {
        self.metadata.generation = g;
        self
    }

    fn operation(mut self, kind: OperationKind) -> Self {
        self.status.operations = vec![StoredOperation {
            kind,
            name: "op".into(),
            token: "dA==".into(),
            started: Utc::now(),
            request_id: "r".into(),
            progress: 0,
        }];
        self
    }

    fn failed_for(mut self, generation: i64, class_generation: i64) -> Self {
        fail(&mut self, class_generation, "InvalidArgument", "INVALID_PROVIDER_SPEC", "no");
        if let Some(f) = &mut self.status.failure {
            f.generation = generation;
        }
        self
    }
}

#[test]
fn next_steps_follow_status() {
    let class = 1;
    let creating = machine().phase(Phase::Creating).operation(OperationKind::CreateMachine);
    let rows: Vec<(&str, Machine, bool, Step)> = vec![
        ("new machine", machine(), false, Step::Create),
        ("pending", machine().phase(Phase::Pending), false, Step::Create),
        ("create in flight", creating.clone(), false, Step::Poll(creating.status.operations[0].clone())),
        ("running: health check", machine().running("h1"), false, Step::Health),
        ("running, spec changed: update", machine().running("h1").generation(2), true, Step::Update),
        ("unknown (unhealthy): health check", machine().running("h1").phase(Phase::Unknown), false, Step::Health),
        ("updating without an operation: health", machine().running("h1").phase(Phase::Updating), false, Step::Health),
        ("running without a provider ID: create", machine().phase(Phase::Running), false, Step::Create),
        ("failed for this spec and class: hold", machine().failed_for(1, class), false, Step::Hold),
        ("failed for an older spec: create again", machine().generation(2).failed_for(1, class), false, Step::Create),
        ("failed for an older class: create again", machine().failed_for(1, class - 1), false, Step::Create),
        ("failed, replaced by its owner: hold", machine().phase(Phase::Failed), false, Step::Hold),
    ];
    for (name, m, changed, want) in rows {
        assert_eq!(next_step(&m, class, changed), want, "{name}");
    }
}

#[test]
fn deleting_calls_the_cloud_unless_nothing_was_ever_asked_of_it() {
    use super::super::deletion::{next, vm_asked_for, Next};
    use super::super::node::NodeSeen;
    let deleting = machine().running("h1").operation(OperationKind::DeleteMachine);
    let mut create_lost = machine().phase(Phase::Creating);
    create_lost.status.create_started = Some(Utc::now());
    let rows: Vec<(&str, Machine, Next)> = vec![
        ("never created: released without a call", machine(), Next::Release),
        ("pending: released without a call", machine().phase(Phase::Pending), Next::Release),
        ("running: deleted", machine().running("h1"), Next::DeleteInstance),
        ("create in flight: deleted by name", machine().operation(OperationKind::CreateMachine), Next::DeleteInstance),
        ("create started, handle lost: deleted by name", create_lost, Next::DeleteInstance),
        (
            "update in flight: deleted",
            machine().running("h1").operation(OperationKind::UpdateMachine),
            Next::DeleteInstance,
        ),
        ("failed after a create: deleted", machine().running("h1").failed_for(1, 1), Next::DeleteInstance),
        ("delete in flight: polled", deleting.clone(), Next::PollInstance(deleting.status.operations[0].clone())),
    ];
    for (name, m, want) in rows {
        assert_eq!(next(&m, vm_asked_for(&m), OperationKind::DeleteMachine, NodeSeen::NoTarget), want, "{name}");
    }
}

#[test]
fn only_a_newer_generation_with_another_hash_is_a_spec_change() {
    assert!(spec_changed(&machine().running("h1").generation(2), "h2"));
    assert!(!spec_changed(&machine().running("h1").generation(2), "h1"), "same provider spec");
    assert!(!spec_changed(&machine().running("h1"), "h2"), "a class edit alone (same generation)");
    assert!(!spec_changed(&machine().generation(2), "h2"), "never created: no hash to compare");
    let updating = machine().running("h1").generation(2).operation(OperationKind::UpdateMachine);
    assert!(!spec_changed(&updating, "h2"), "an operation in flight is polled first");
}

#[test]
fn a_failure_marks_the_machine_and_names_the_drivers_reason() {
    let m = machine().failed_for(1, 1);
    assert_eq!(m.status.phase, Phase::Failed);
    let ready = condition(&m.status.conditions, ConditionType::Ready).unwrap();
    assert_eq!((ready.status, &ready.reason), (ConditionStatus::False, &Reason::Failed));
    let failed = condition(&m.status.conditions, ConditionType::Failed).unwrap();
    assert_eq!((failed.status, failed.reason.as_str()), (ConditionStatus::True, "InvalidProviderSpec"));
    assert_eq!(m.status.failure.as_ref().map(|f| f.code.as_str()), Some("InvalidArgument"));
}

#[test]
fn retried_calls_name_the_environment_or_the_operation() {
    use policy::Cause;
    let cases = [
        (Decision::Backoff(Cause::Quota), OperationType::Create, Reason::QuotaExceeded),
        (Decision::Backoff(Cause::Credentials), OperationType::Update, Reason::CloudCredentialsRefused),
        (Decision::Backoff(Cause::Unavailable), OperationType::Create, Reason::CloudUnavailable),
        (Decision::Backoff(Cause::Internal), OperationType::Create, Reason::CreateRetrying),
        (Decision::Backoff(Cause::InProgress), OperationType::Update, Reason::UpdateRetrying),
        (Decision::DropToken, OperationType::Create, Reason::CreateRetrying),
    ];
    for (decision, op, want) in cases {
        assert_eq!(retrying_reason(decision, op), want, "{decision:?} {op}");
    }
}

#[test]
fn request_ids_keep_the_newest_five() {
    let mut status = MachineStatus::default();
    for i in 0..7 {
        remember(&mut status, &format!("r-{i}"));
    }
    assert_eq!(status.request_ids, ["r-2", "r-3", "r-4", "r-5", "r-6"]);
}

#[test]
fn a_started_operation_is_processing_until_done() {
    let mut op = pb::Operation::default();
    assert_eq!(accepted(&op), OperationState::Processing);
    op.done = true;
    assert_eq!(accepted(&op), OperationState::Succeeded);
}
