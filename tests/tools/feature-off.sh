#!/usr/bin/env bash
# Checks the builds users make with a feature off, which the workspace build (every feature of
# every member unified) never compiles. tests/run.sh runs it after its build, in the same mode and
# through the same wrapper (tests/tools/lint-in-build.sh: clippy -D warnings on the workspace's
# crates). Alone, these builds would give many dependencies other features than
# the workspace build did, and so compile about 400 crates again (7 CPU-min from nothing, in check
# mode); the feature-pin crate (tests/tools/feature-pin.py, a dev-dependency of fake-driver and the
# controller) holds their features at the workspace build's, so only the workspace's own crates
# compile. The script first checks that the pins are up to date.
#   - fake-driver without `join-cluster`: the workspace build turns it on (e2e-tests asks for
#     it); the fake-driver users build (`cargo build -p fake-driver`, the Docker image) has it off.
#   - machine-controller and driver-sdk without the SDK's `server` feature: the drivers turn it
#     on; the controller (a client only) builds driver-sdk without it, and so compiles none of
#     its server side or dependencies.
# The libraries are built (their dependents need them); the executables (binaries, examples,
# tests) are only checked (LINT_IN_BUILD_CHECK=leaves), as `cargo hack --feature-powerset check`
# checks feature sets: code generation and linking were most of this step's CPU, and the workspace
# build's binaries (target/debug/fake-driver with join-cluster, which the end-to-end tests start)
# stay where they are.
# Usage: bash tests/tools/feature-off.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
# Clippy only: the docs are built (and read) with the default features.
export RUSTC_WORKSPACE_WRAPPER="$PWD/tests/tools/lint-in-build.sh" LINT_IN_BUILD_DOCS=0 LINT_IN_BUILD_CHECK=leaves

python3 tests/tools/feature-pin.py --check

echo "==> fake-driver without the join-cluster feature (clippy)"
# Every target, tests included, not run again: the feature only adds code (src/kubelets/ and
# the tests of it), so these tests are a subset of the workspace run's, on the same code paths.
cargo build -p fake-driver --all-targets

echo "==> machine-controller and driver-sdk without the SDK's server feature (clippy)"
# The SDK's `server` feature, and the crates only it brings. (tonic-reflection is not among them:
# the controller's own cluster-autoscaler server serves reflection.)
if cargo tree -p machine-controller -e features --prefix none | grep -E '^driver-sdk feature "server"' ||
  cargo tree -p machine-controller -e normal --prefix none | grep -E '^(tonic-health|hmac|jsonschema) '; then
  echo "feature-off.sh: machine-controller pulls in the SDK's server side (above)" >&2
  exit 1
fi
# One pass for both (the controller has no default features to lose).
# Every target but the libraries' unit-test executables: the controller's (55 CPU-s, the largest
# unit here) would only show that its tests compile without the feature, and nobody runs them so.
# (Not `--benches`: it means the libraries' test executables too. The example and the bench keep
# the dev-dependencies, and so the feature pin, in the build.)
cargo build -p machine-controller -p driver-sdk --no-default-features --lib --bins --examples --bench plan_domains
