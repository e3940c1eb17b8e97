//! The registry: one line per kind, in apply order (dependencies first; a full resync queues
//! them in this order too). Everything that lists kinds follows from it: [`Kind`] and its
//! names, [`AnyObject`] (the manifest parser's dispatch and checks), the CRDs
//! ([`crate::crd`]), the CLI's names and tables, the Kubernetes backend's resources; and, with
//! the kind's line in [`crate::reconcile::RECONCILERS`], the runtime's dispatch and wakes.
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
    /// Marks unhealthy Machines; their deployments and pools remediate them.
    MachineHealthCheck => MachineHealthCheck,
}
