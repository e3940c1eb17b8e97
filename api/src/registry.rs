//! The registry: one line per kind, in apply order (dependencies first; a full resync queues
//! them in this order too). Everything that lists kinds follows from it: [`Kind`] and its
//! names, [`AnyObject`] (the manifest parser's dispatch and checks), the CRDs
//! ([`crate::crd`]), the controller's CLI names and tables and its Kubernetes backend's
//! resources; and, with the kind's line in the controller's `reconcile::RECONCILERS`, its
//! runtime's dispatch and wakes.
//!
//! A line names the variant (the kind's name, which is also its store key and CRD kind — never
//! rename one) and the type, whose [`KindInfo`] holds its facts.

use crate::resources::*;

kinds! {
    /// Credentials referenced by classes (Kubernetes `v1/Secret` shape).
    Secret => Secret,
    /// Driver + provider spec + secret reference.
    MachineClass => MachineClass,
    /// Replicated machines with rolling updates.
    MachineDeployment => MachineDeployment,
    /// Scale-set pools through the pool RPCs.
    MachinePool => MachinePool,
    /// One machine.
    Machine => Machine,
    /// Deletes unhealthy Machines of deployments and pools (which replace them).
    MachineHealthCheck => MachineHealthCheck,
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
