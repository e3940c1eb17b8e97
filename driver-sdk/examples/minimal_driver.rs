//! A small, complete driver: machines live in memory and every operation finishes at once.
//! It passes the conformance suite:
//!
//! ```text
//! cargo run -p driver-sdk --example minimal_driver -- --endpoint unix:///tmp/minimal.sock --dev &
//! cargo run -p driver-sdk --bin driver-conformance -- --endpoint unix:///tmp/minimal.sock
//! ```

use driver_sdk::lock;
use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::SystemTime;

use clap::Parser;
use driver_sdk::{
    async_trait, convert, reason, telemetry, Capability, CreateMachine, Driver, DriverError, DriverInfo, DriverServer,
    ListMachines, Machine, MachineRef, MachineState, Operation, OperationHandle, OperationKind, OperationOutput, Page,
    RequestContext, Result, Secrets, ServeArgs,
};
use serde_json::json;

/// The in-memory "cloud": machine name → machine.
#[derive(Default)]
struct MinimalDriver {
    machines: Mutex<BTreeMap<String, Machine>>,
}

impl MinimalDriver {
    fn machines(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Machine>> {
        // A poisoned lock only means another call panicked; the map itself is still consistent.
        lock(&self.machines)
    }
}

#[async_trait]
impl Driver for MinimalDriver {
    fn info(&self) -> DriverInfo {
        DriverInfo {
            name: "minimal.machinedriver.dev".into(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            provider_spec_schema: json!({
                "type": "object",
                "required": ["size"],
                "additionalProperties": false,
                "properties": {"size": {"type": "string", "enum": ["small", "large"]}},
                "examples": [{"size": "small"}, {"size": "large"}]
            }),
        }
    }

    fn capabilities(&self) -> Vec<Capability> {
        vec![Capability::Machines]
    }

    async fn create_machine(&self, _ctx: &RequestContext, req: CreateMachine) -> Result<Operation> {
        let hash = convert::spec_hash(&req.provider_spec);
        let mut machines = self.machines();
        if let Some(existing) = machines.get(&req.name) {
            if existing.spec_hash != hash {
                return Err(DriverError::already_exists(
                    reason::MACHINE_SPEC_CONFLICT,
                    format!("machine {} exists with another provider spec", req.name),
                ));
            }
            return Ok(Operation::succeeded(
                OperationKind::CreateMachine,
                req.name,
                OperationOutput::Machine(existing.clone()),
            ));
        }
        let machine = Machine {
            name: req.name.clone(),
            provider_id: format!("minimal:///{}", uuid::Uuid::new_v4()),
            state: MachineState::Running,
            addresses: vec![],
            labels: req.labels,
            resources: vec![],
            cloud_error: None,
            create_time: Some(SystemTime::now()),
            spec_hash: hash,
        };
        machines.insert(req.name.clone(), machine.clone());
        Ok(Operation::succeeded(OperationKind::CreateMachine, req.name, OperationOutput::Machine(machine)))
    }

    async fn delete_machine(&self, _ctx: &RequestContext, req: MachineRef) -> Result<Operation> {
        self.machines().remove(&req.name);
        Ok(Operation::succeeded(OperationKind::DeleteMachine, req.name, OperationOutput::None))
    }

    async fn get_machine_status(&self, _ctx: &RequestContext, req: MachineRef) -> Result<Machine> {
        self.machines().get(&req.name).cloned().ok_or_else(|| {
            DriverError::not_found(reason::MACHINE_NOT_FOUND, format!("machine {} does not exist", req.name))
        })
    }

    async fn list_machines(&self, _ctx: &RequestContext, req: ListMachines) -> Result<Page<Machine>> {
        // The page token is the name to continue after.
        if !req.page_token.is_empty() && driver_sdk::schema::check_name(&req.page_token).is_err() {
            let err = DriverError::invalid_argument(reason::FIELD_INVALID, "page_token is not one this driver issued");
            return Err(err.with_violation("page_token", "unknown token"));
        }
        let machines = self.machines();
        let after = (std::ops::Bound::Excluded(&req.page_token), std::ops::Bound::Unbounded);
        let matching = machines.range::<String, _>(after).map(|(_, m)| m);
        let selected = matching.filter(|m| req.label_selector.iter().all(|(k, v)| m.labels.get(k) == Some(v)));
        let mut items: Vec<Machine> = selected.take(req.page_size + 1).cloned().collect();
        let more = items.len() > req.page_size;
        items.truncate(req.page_size);
        let next_page_token =
            if more { items.last().map(|m| m.name.clone()).unwrap_or_default() } else { String::new() };
        Ok(Page { items, next_page_token })
    }

    /// Operations finish at once, so a poll just reports the machine as it is now.
    async fn get_operation(&self, _: &RequestContext, handle: OperationHandle, _: Secrets) -> Result<Operation> {
        let output = match (handle.kind, self.machines().get(&handle.target).cloned()) {
            (OperationKind::CreateMachine, Some(m)) => Ok(OperationOutput::Machine(m)),
            (OperationKind::CreateMachine, None) => Err(DriverError::not_found(
                reason::MACHINE_NOT_FOUND,
                format!("machine {} no longer exists", handle.target),
            )),
            _ => Ok(OperationOutput::None),
        };
        Ok(handle.resume().finish(output))
    }
}

#[derive(Parser)]
#[command(about = "A minimal in-memory machine driver built with driver-sdk")]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let _telemetry = telemetry::init("minimal-driver", cli.serve.log_format);
    match DriverServer::new(MinimalDriver::default()).serve(&cli.serve).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("minimal-driver: {}", driver_sdk::error_chain(&e));
            ExitCode::FAILURE
        }
    }
}
