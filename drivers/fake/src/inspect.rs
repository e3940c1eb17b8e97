//! The `fakecloud.v1.FakeCloud` service: inspection, runtime fault rules, and the test aids
//! `StopKubelet`, `StartKubelet` and `RemoveMachine`.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::faults::FaultRule;
use crate::pb;
use crate::FakeDriver;

/// Serves inspection and fault-injection calls for one [`FakeDriver`].
#[derive(Clone)]
pub struct FakeCloudService {
    pub(crate) driver: Arc<FakeDriver>,
}

impl FakeCloudService {
    /// The service for `driver`, ready to mount with `DriverServer::add_service`.
    pub fn server(driver: Arc<FakeDriver>) -> pb::fake_cloud_server::FakeCloudServer<Self> {
        pb::fake_cloud_server::FakeCloudServer::new(Self { driver })
    }
}

#[tonic::async_trait]
impl pb::fake_cloud_server::FakeCloud for FakeCloudService {
    async fn inspect(&self, req: Request<pb::InspectRequest>) -> Result<Response<pb::InspectResponse>, Status> {
        Ok(Response::new(self.driver.inspect(req.into_inner().reset_peak)))
    }

    async fn set_faults(&self, req: Request<pb::SetFaultsRequest>) -> Result<Response<pb::SetFaultsResponse>, Status> {
        let mut rules = Vec::new();
        for (i, r) in req.into_inner().rules.into_iter().enumerate() {
            let rule = FaultRule::from_proto(r).map_err(|e| Status::invalid_argument(format!("rules[{i}].{e}")))?;
            rules.push(rule);
        }
        tracing::info!(count = rules.len(), "fault rules replaced");
        self.driver.set_faults(rules);
        Ok(Response::new(pb::SetFaultsResponse {}))
    }

    async fn get_faults(&self, _req: Request<pb::GetFaultsRequest>) -> Result<Response<pb::GetFaultsResponse>, Status> {
        Ok(Response::new(pb::GetFaultsResponse {
            rules: self.driver.faults().iter().map(FaultRule::to_proto).collect(),
        }))
    }

    async fn stop_kubelet(
        &self,
        req: Request<pb::StopKubeletRequest>,
    ) -> Result<Response<pb::StopKubeletResponse>, Status> {
        self.driver.stop_kubelet(&req.into_inner().machine)?;
        Ok(Response::new(pb::StopKubeletResponse {}))
    }

    async fn start_kubelet(
        &self,
        req: Request<pb::StartKubeletRequest>,
    ) -> Result<Response<pb::StartKubeletResponse>, Status> {
        self.driver.start_kubelet(&req.into_inner().machine)?;
        Ok(Response::new(pb::StartKubeletResponse {}))
    }

    async fn remove_machine(
        &self,
        req: Request<pb::RemoveMachineRequest>,
    ) -> Result<Response<pb::RemoveMachineResponse>, Status> {
        self.driver.remove_machine(&req.into_inner().machine)?;
        Ok(Response::new(pb::RemoveMachineResponse {}))
    }

    async fn inject_event(
        &self,
        req: Request<pb::InjectEventRequest>,
    ) -> Result<Response<pb::InjectEventResponse>, Status> {
        let r = req.into_inner();
        let notice = match r.notice {
            None => None,
            Some(d) if d.seconds < 0 || d.nanos < 0 => {
                return Err(Status::invalid_argument("notice: must not be negative"))
            }
            Some(d) => Some(std::time::Duration::new(d.seconds as u64, d.nanos as u32)),
        };
        let event_id = self.driver.inject_event(&r.machine, &r.kind, notice, r.message)?;
        Ok(Response::new(pb::InjectEventResponse { event_id }))
    }
}
