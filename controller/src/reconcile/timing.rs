//! How soon each reconciler looks again on its own: the recheck and retry intervals in one place,
//! so their balance (API calls against how late a change is seen) is read and tuned together. A
//! change of what a reconciler watches wakes it sooner; these are the safety nets.

use std::time::Duration;

// Nodes (reconcile/node.rs, in_place.rs, deletion.rs).
/// How soon a lookup is tried again while the first list of Nodes has not arrived.
pub(crate) const NOT_SYNCED_RETRY: Duration = Duration::from_secs(1);
/// How soon a drain looks again after its cordon found the Node changed since it was seen (409):
/// the Node watch has the newer version by then, and a watch that lags costs one patch a second,
/// never a loop.
pub(crate) const NODE_CONFLICT_RETRY: Duration = Duration::from_secs(1);
/// How often a machine waiting for its Node looks again without being woken (a safety net: the
/// Node's changes wake it).
pub(crate) const JOIN_RECHECK: Duration = Duration::from_secs(30);
/// How often a deletion held by hook annotations looks again (their removal wakes it too).
pub(crate) const HOOK_RECHECK: Duration = Duration::from_secs(30);
/// How often a deletion waiting for its node's VolumeAttachments to go looks again.
pub(crate) const VOLUME_RECHECK: Duration = Duration::from_secs(2);
/// How often a machine waiting for its Node after an update looks again without being woken (the
/// Node's changes wake it).
pub(crate) const IN_PLACE_NODE_RECHECK: Duration = Duration::from_secs(30);

// Machines.
/// An operation's progress reaches status only once it has run this long: most creates finish
/// sooner, and each progress step would be one more write through the API server.
pub(crate) const PROGRESS_SHOWN_AFTER: Duration = Duration::from_secs(30);
/// How soon a deletion whose class does not resolve (so its driver cannot be called) tries
/// again; a change of the class wakes it sooner.
pub(crate) const DELETE_UNRESOLVED_RECHECK: Duration = Duration::from_secs(30);

// Owners and classes.
/// How soon a class that does not resolve (its driver is not registered, its Secret is missing)
/// is tried again; a change of the class or its Secret wakes it sooner.
pub(crate) const CLASS_UNRESOLVED_RECHECK: Duration = Duration::from_secs(30);
/// How often a deployment whose rollout or remediations are under way looks again without being
/// woken (its machines' changes wake it: a safety net).
pub(crate) const DEPLOYMENT_PROGRESS_RECHECK: Duration = Duration::from_secs(5);
/// How often a pool whose instances are all ready and up to date looks at them again without
/// being woken.
pub(crate) const POOL_SETTLED_RECHECK: Duration = Duration::from_secs(30);
/// How often a pool waiting for its instances (to become ready, or up to date) looks again.
pub(crate) const POOL_PROGRESS_RECHECK: Duration = Duration::from_secs(1);
/// How soon a pool looks again after a pool call the driver finished at once: its next step
/// follows shortly.
pub(crate) const POOL_DONE_RECHECK: Duration = Duration::from_millis(200);

// Health checks.
/// How soon a health check looks again while the target cluster cannot be reached.
pub(crate) const HEALTH_UNREACHABLE_RECHECK: Duration = Duration::from_secs(5);
