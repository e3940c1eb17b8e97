#!/usr/bin/env bash
# Runs the driver-conformance suite against azure-vmss-driver on arm-emulator, both real
# processes on a temporary port and socket, tears them down, and exits with the suite's status.
#
# Needs the binaries in target/debug (the README's test command, `cargo xtask ci`, builds them;
# or `cargo build -p arm-emulator -p azure-vmss-driver -p driver-sdk --bins`). BIN_DIR overrides.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="${BIN_DIR:-$root/target/debug}"
for b in arm-emulator azure-vmss-driver driver-conformance; do
  if [ ! -x "$bin/$b" ]; then
    echo "conformance.sh: $bin/$b is not built; run: cargo build -p arm-emulator -p azure-vmss-driver -p driver-sdk --bins" >&2
    exit 2
  fi
done

work="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

dump_logs() {
  echo "---- arm-emulator log ----" >&2; tail -n 50 "$work/arm.log" >&2 || true
  echo "---- azure-vmss-driver log ----" >&2; tail -n 80 "$work/driver.log" >&2 || true
}

# Waits up to 30 s for a condition (polling, not a fixed sleep).
wait_for() {
  local what="$1"; shift
  for _ in $(seq 1 300); do
    if "$@"; then return 0; fi
    sleep 0.1
  done
  echo "conformance.sh: timed out waiting for $what" >&2
  dump_logs
  exit 1
}

"$bin/arm-emulator" --listen 127.0.0.1:0 --addr-file "$work/arm.addr" \
  --operation-duration 500ms --delete-duration 300ms --upgrade-duration 300ms --retry-after 1 \
  >"$work/arm.log" 2>&1 &
pids+=("$!")
wait_for "arm-emulator to listen" test -s "$work/arm.addr"
addr="$(cat "$work/arm.addr")"

# Machines join a Flexible scale set, which operators create beforehand (like the subnet).
sub=00000000-0000-0000-0000-00000000c0fe
curl -fsS -X PUT -H 'authorization: Bearer conformance-test-token' -H 'content-type: application/json' \
  "http://$addr/subscriptions/$sub/resourceGroups/conformance/providers/Microsoft.Compute/virtualMachineScaleSets/conformance-flex?api-version=2024-07-01" \
  -d '{"location":"westeurope","properties":{"orchestrationMode":"Flexible","platformFaultDomainCount":1}}' >/dev/null

sock="$work/driver.sock"
# --credential static-token: test only; the emulator accepts any bearer token.
"$bin/azure-vmss-driver" --endpoint "unix://$sock" --dev \
  --arm-endpoint "http://$addr" \
  --subscription-id "$sub" --resource-group conformance --scale-set conformance-flex \
  --credential static-token --static-token conformance-test-token --event-poll-interval 1s \
  >"$work/driver.log" 2>&1 &
pids+=("$!")
wait_for "azure-vmss-driver to listen" test -S "$sock"

echo "==> driver-conformance against azure-vmss-driver (unix://$sock) on arm-emulator (http://$addr)"
set +e
# The event check's trigger: the machine's VM deallocated on the emulator behind the driver's back
# ($PROVIDER_ID is azure:// + the VM's resource ID); the driver's poll reports it STOPPED.
trigger="curl -fsS -X POST -H 'authorization: Bearer conformance-test-token' \"http://$addr\${PROVIDER_ID#azure://}/deallocate?api-version=2024-07-01\""
"$bin/driver-conformance" --endpoint "unix://$sock" --operation-timeout 60s --event-trigger "$trigger"
status=$?
set -e
if [ "$status" -ne 0 ]; then dump_logs; fi
exit "$status"
