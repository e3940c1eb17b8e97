//! The trait a driver implements.

use crate::context::RequestContext;
use crate::error::{DriverError, Result};
use crate::types::*;

/// A machine driver. Implement the methods of the capabilities you advertise; the SDK answers
/// UNIMPLEMENTED for the rest without calling you.
///
/// Every method receives input the SDK has already validated: names are well-formed, required
/// fields are present, and provider specs match [`DriverInfo::provider_spec_schema`].
///
/// Mutating methods return an [`Operation`] quickly — never wait for the cloud inside them. Put
/// what you need to poll again in [`Operation::state`]; the SDK seals it into the token and gives
/// it back to [`Driver::get_operation`], even after a restart.
#[async_trait::async_trait]
pub trait Driver: Send + Sync + 'static {
    /// Name, version and provider-spec schema. Called once at startup.
    fn info(&self) -> DriverInfo;

    /// The optional RPC groups implemented. Called once at startup.
    fn capabilities(&self) -> Vec<Capability>;

    /// Readiness. `Err` = unhealthy; `Probe::starting` = not ready yet.
    async fn probe(&self, _ctx: &RequestContext) -> Result<Probe> {
        Ok(Probe::ready())
    }

    /// Starts creating a machine. Same name + same spec: the existing machine or the in-flight
    /// operation; same name + different spec: ALREADY_EXISTS / MACHINE_SPEC_CONFLICT.
    async fn create_machine(&self, _ctx: &RequestContext, _req: CreateMachine) -> Result<Operation> {
        Err(DriverError::unimplemented("CreateMachine"))
    }

    /// Starts deleting a machine; absent = a done operation.
    async fn delete_machine(&self, _ctx: &RequestContext, _req: MachineRef) -> Result<Operation> {
        Err(DriverError::unimplemented("DeleteMachine"))
    }

    /// The machine's status; absent = NOT_FOUND / MACHINE_NOT_FOUND.
    async fn get_machine_status(&self, _ctx: &RequestContext, _req: MachineRef) -> Result<Machine> {
        Err(DriverError::unimplemented("GetMachineStatus"))
    }

    /// One page of machines matching the label selector.
    async fn list_machines(&self, _ctx: &RequestContext, _req: ListMachines) -> Result<Page<Machine>> {
        Err(DriverError::unimplemented("ListMachines"))
    }

    /// Checks a provider spec beyond its schema (and the secrets). The SDK has checked the
    /// schema already; the default accepts.
    async fn validate_machine_class(&self, _ctx: &RequestContext, _req: ValidateMachineClass) -> Result<Vec<String>> {
        Ok(Vec::new())
    }

    /// What one machine of a class offers the scheduler, as its Node's `status.capacity` will say
    /// it (`cpu`, `memory`, `pods`, `nvidia.com/gpu`, …), answered with ValidateMachineClass
    /// after [`Driver::validate_machine_class`] accepted the class. The controller keeps it in
    /// the class's status, and the cluster-autoscaler builds the node a group would add from it.
    /// The default knows nothing (empty); an error becomes a warning, never a refusal.
    async fn machine_capacity(
        &self,
        _ctx: &RequestContext,
        _req: &ValidateMachineClass,
    ) -> Result<std::collections::BTreeMap<String, String>> {
        Ok(std::collections::BTreeMap::new())
    }

    /// Splits `changed_paths` into those applied in place and those needing a replacement.
    async fn can_update_machine(&self, _ctx: &RequestContext, _req: CanUpdateMachine) -> Result<UpdatePlan> {
        Err(DriverError::unimplemented("CanUpdateMachine"))
    }

    /// Starts an in-place update to the desired spec.
    async fn update_machine(&self, _ctx: &RequestContext, _req: UpdateMachine) -> Result<Operation> {
        Err(DriverError::unimplemented("UpdateMachine"))
    }

    /// Creates or updates a pool.
    async fn apply_pool(&self, _ctx: &RequestContext, _req: ApplyPool) -> Result<Operation> {
        Err(DriverError::unimplemented("ApplyPool"))
    }

    /// The pool; absent = NOT_FOUND / POOL_NOT_FOUND.
    async fn get_pool(&self, _ctx: &RequestContext, _req: PoolRef) -> Result<Pool> {
        Err(DriverError::unimplemented("GetPool"))
    }

    /// One page of a pool's instances.
    async fn list_pool_instances(&self, _ctx: &RequestContext, _req: ListPoolInstances) -> Result<Page<PoolInstance>> {
        Err(DriverError::unimplemented("ListPoolInstances"))
    }

    /// Deletes exactly these instances.
    async fn delete_pool_instances(&self, _ctx: &RequestContext, _req: PoolInstances) -> Result<Operation> {
        Err(DriverError::unimplemented("DeletePoolInstances"))
    }

    /// Upgrades these instances to the latest model.
    async fn upgrade_pool_instances(&self, _ctx: &RequestContext, _req: PoolInstances) -> Result<Operation> {
        Err(DriverError::unimplemented("UpgradePoolInstances"))
    }

    /// Deletes a pool; absent = a done operation.
    async fn delete_pool(&self, _ctx: &RequestContext, _req: PoolRef) -> Result<Operation> {
        Err(DriverError::unimplemented("DeletePool"))
    }

    /// The cloud's own moves (the `Events` capability): spot interruptions, maintenances, VMs
    /// stopped, terminated or impaired behind the controller's back. Called when the first
    /// caller watches, and again after a pause whenever the returned stream ends; yield each
    /// event as the cloud reports it (an `Err` item is logged and reading goes on).
    ///
    /// The SDK owns delivery ([`crate::events`]): it keeps every event until a caller
    /// acknowledges it, sends it again when unacknowledged, stops reading while
    /// [`EVENT_BUFFER`](crate::events::EVENT_BUFFER) events wait (backpressure), drops an event
    /// whose ID it holds or saw acknowledged lately, and calls [`Driver::ack_event`] on the
    /// acknowledgement. What it holds lives in this process only: after a restart, yield again
    /// what the cloud has not had acknowledged (a queue message not deleted, a state still seen),
    /// with the same `event_id`.
    async fn watch_events(&self, _ctx: &RequestContext) -> Result<crate::events::EventStream> {
        Err(DriverError::unimplemented("WatchEvents"))
    }

    /// A caller acknowledged `event`: let its source go (for example, delete the queue message).
    /// An error keeps the event pending and fails the AckEvents call, which its caller retries.
    /// The default does nothing.
    async fn ack_event(&self, _ctx: &RequestContext, _event: &MachineEvent) -> Result<()> {
        Ok(())
    }

    /// One poll of an operation, resumed from its verified handle. Must work after a restart.
    async fn get_operation(&self, ctx: &RequestContext, handle: OperationHandle, secrets: Secrets)
        -> Result<Operation>;

    /// Best-effort cancel. The default reports the operation unchanged.
    async fn cancel_operation(
        &self,
        ctx: &RequestContext,
        handle: OperationHandle,
        secrets: Secrets,
    ) -> Result<Operation> {
        self.get_operation(ctx, handle, secrets).await
    }
}
