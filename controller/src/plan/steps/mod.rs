//! The disruption steps, each written once over the owner view ([`super::owner::Unit`]) and run
//! by both kinds' planners in their order: a step chooses units and asks the disruption planner
//! ([`super::disruption`]) for each with its reason; the owner acts on the units it returns.
//!
//! - [`interruption`]: units the cloud takes (`Interruption`, never held) go at once, replaced
//!   beside the surge within a hard cap;
//! - [`remediation`]: failed and unhealthy units replaced, replace before remove, paced (and
//!   units the cloud recommends moving off, asked as `Rebalance`);
//! - [`canary`]: the first units of a new revision watched before the rest follow;
//! - [`scale_down`]: the excess over `replicas` (`ScaleDown`, or the autoscaler's);
//! - [`rollout`]: units of an older revision replaced (`Rollout`);
//! - [`in_place`]: units of an older revision updated in place (`InPlaceUpdate`), and the
//!   per-machine decisions on the driver's answers;
//! - [`rebalance`]: a deployment's machines moved between failure domains, surge-first
//!   (`Rebalance`).
//!
//! A new disruption is a new file here: name its reason, choose its units, ask, return them
//! (the book's Disruptions page).

pub mod canary;
pub mod in_place;
pub mod interruption;
pub mod rebalance;
pub mod remediation;
pub mod rollout;
pub mod scale_down;
