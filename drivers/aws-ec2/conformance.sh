#!/usr/bin/env bash
# Runs the driver-conformance suite against aws-ec2-driver on moto's EC2 server.
#
# Starts moto_server on a free loopback port and the driver on a temporary Unix socket, runs
# driver-conformance against it, tears both down (also on failure or Ctrl-C) and exits with the
# suite's status.
#
# Assumes the README's test command has run (`cargo xtask ci`, or `cargo xtask e2e`): the binaries are in
# target/debug and moto is in .tools/moto. Override with MOTO_SERVER, TARGET_DIR, AWS_REGION.
# Extra arguments go to driver-conformance (e.g. --repeat 5).
set -euo pipefail
cd "$(dirname "$0")/../.."

target=${TARGET_DIR:-target/debug}
moto_server=${MOTO_SERVER:-.tools/moto/bin/moto_server}
region=${AWS_REGION:-us-east-1}
for f in "$target/aws-ec2-driver" "$target/driver-conformance"; do
  [ -x "$f" ] || { echo "conformance.sh: $f is missing: run \`cargo xtask e2e\` (or cargo build -p aws-ec2-driver -p driver-sdk --bins)" >&2; exit 2; }
done
[ -x "$moto_server" ] || { echo "conformance.sh: $moto_server is missing: run \`cargo xtask install\` (it installs moto[server]==5.2.5 into .tools/moto)" >&2; exit 2; }

work=$(mktemp -d)
moto_pid=""
driver_pid=""
cleanup() {
  [ -n "$driver_pid" ] && kill "$driver_pid" 2>/dev/null && wait "$driver_pid" 2>/dev/null
  [ -n "$moto_pid" ] && kill "$moto_pid" 2>/dev/null && wait "$moto_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# A free port: bind port 0, read the port, release it.
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')
"$moto_server" -H 127.0.0.1 -p "$port" >"$work/moto.log" 2>&1 &
moto_pid=$!
echo "==> moto_server on 127.0.0.1:$port (pid $moto_pid, log $work/moto.log)"
for _ in $(seq 1 300); do
  if python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$port/moto-api/', timeout=1)" 2>/dev/null; then
    break
  fi
  kill -0 "$moto_pid" 2>/dev/null || { echo "moto_server exited:" >&2; cat "$work/moto.log" >&2; exit 1; }
  sleep 0.2
done

socket="$work/driver.sock"
AWS_ENDPOINT_URL="http://127.0.0.1:$port" \
AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_REGION="$region" \
AWS_EC2_METADATA_DISABLED=true AWS_CONFIG_FILE=/nonexistent AWS_SHARED_CREDENTIALS_FILE=/nonexistent \
  "$target/aws-ec2-driver" --endpoint "unix://$socket" --dev --poll-interval 200ms >"$work/driver.log" 2>&1 &
driver_pid=$!
echo "==> aws-ec2-driver on unix://$socket (pid $driver_pid, region $region)"
for _ in $(seq 1 150); do
  [ -S "$socket" ] && break
  kill -0 "$driver_pid" 2>/dev/null || { echo "aws-ec2-driver exited:" >&2; cat "$work/driver.log" >&2; exit 1; }
  sleep 0.2
done

echo "==> driver-conformance"
status=0
"$target/driver-conformance" --endpoint "unix://$socket" --operation-timeout 60s "$@" || status=$?
if [ "$status" -ne 0 ]; then
  echo "==> driver log" >&2
  tail -n 50 "$work/driver.log" >&2
fi
exit "$status"
