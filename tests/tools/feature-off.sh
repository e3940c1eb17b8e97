#!/usr/bin/env bash
# Checks the builds users make with a feature off, which the workspace build (every feature of
# every member unified) never compiles. tests/run.sh runs it after clippy.
#   - fake-driver without `join-cluster` (checked): the workspace build turns it on (e2e-tests asks for
#     it); the fake-driver users build (`cargo build -p fake-driver`, the Docker image) has it off.
#   - machine-controller and driver-sdk without the SDK's `server` feature: the drivers turn it
#     on; the controller (a client only) builds driver-sdk without it, and so compiles none of
#     its server side or dependencies.
# Usage: bash tests/tools/feature-off.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

echo "==> fake-driver without the join-cluster feature (clippy)"
# Checked, tests included, not run again: the feature only adds code (src/kubelets/ and the
# tests of it), so these tests are a subset of the workspace run's, on the same code paths. Their
# build alone compiled about 60 crates (tokio, hyper, tonic, rustls, ring, ...) a third time.
cargo clippy -p fake-driver --all-targets -- -D warnings

echo "==> machine-controller and driver-sdk without the SDK's server feature (clippy)"
# The SDK's `server` feature, and the crates only it brings. (tonic-reflection is not among them:
# the controller's own cluster-autoscaler server serves reflection.)
if cargo tree -p machine-controller -e features --prefix none | grep -E '^driver-sdk feature "server"' ||
  cargo tree -p machine-controller -e normal --prefix none | grep -E '^(tonic-health|hmac|jsonschema) '; then
  echo "feature-off.sh: machine-controller pulls in the SDK's server side (above)" >&2
  exit 1
fi
# One pass for both (the controller has no default features to lose): their dependencies are
# checked once, not twice with different features.
cargo clippy -p machine-controller -p driver-sdk --no-default-features --all-targets -- -D warnings
