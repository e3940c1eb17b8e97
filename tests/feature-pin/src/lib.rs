//! Empty: this crate exists for its dependencies' features. It pins the dependencies of the
//! feature-off builds (`tests/tools/feature-off.sh`) to the features the workspace build gives
//! them, so those builds compile only the workspace's own crates. Written by
//! `tests/tools/feature-pin.py`; a dev-dependency only, so no user's build includes it.
