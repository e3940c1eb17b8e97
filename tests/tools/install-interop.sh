#!/usr/bin/env bash
# Installs the interop clients of tests/interop.rs from their registries, pinned, and prints the
# folder holding one launcher per client (python-client, node-client, go-client). Progress goes
# to stderr. Reruns reuse what is installed and take about a second.
#
#   python-client  PyPI grpcio + grpcio-tools/-status/-health-checking + googleapis-common-protos
#                  (tests/interop/python/requirements.txt) in .tools/interop-py; stubs generated
#                  from proto/ by grpcio-tools into .tools/interop-py/gen (redone when proto/ changes)
#   node-client    npm @grpc/grpc-js + @grpc/proto-loader + google-proto-files + grpc-health-check
#                  (tests/interop/node/package-lock.json) in tests/interop/node/node_modules
#   go-client      google.golang.org/grpc from the Go module proxy (tests/interop/go/go.mod, with the
#                  Go driver's stubs in examples/go-driver/gen), built into
#                  $MACHINE_DRIVER_CACHE/interop-go/<hash of its sources and those stubs>
#
# Usage: bash tests/tools/install-interop.sh   (prints the launcher folder, .tools/interop)
# Env:   MACHINE_DRIVER_CACHE (default ~/.cache/machine-driver)
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
cache="${MACHINE_DRIVER_CACHE:-$HOME/.cache/machine-driver}"
interop="$root/tests/interop"
out="$root/.tools/interop"

say() { echo "install-interop: $*" >&2; }
die() { echo "install-interop: error: $*" >&2; exit 1; }
need() { command -v "$1" >/dev/null || die "'$1' is required: $2"; }
# A short content hash of files (sorted, names included), to key installs by their inputs.
hash_of() { (cd "$root" && sha256sum "$@" | sha256sum | cut -c1-16); }

need python3 "Python 3 with venv (Debian: python3-venv)"
need node "Node.js 20 or later"
need npm "npm (comes with Node.js)"
need go "Go 1.22 or later"
mkdir -p "$out"

# ------------------------------------------------------------------------------------ Python
py="$root/.tools/interop-py"
req_hash=$(hash_of tests/interop/python/requirements.txt)
if [ "$(cat "$py/.installed" 2>/dev/null)" != "$req_hash" ]; then
  say "installing the Python client's stack (PyPI, pinned) into $py"
  rm -rf "$py"
  bash "$root/tests/tools/venv.sh" "$py" -r "$interop/python/requirements.txt" \
    || die "pip install -r tests/interop/python/requirements.txt failed"
  echo "$req_hash" >"$py/.installed"
fi
mapfile -t protos < <(cd "$root" && find proto -name '*.proto' | sort)
gen_hash=$(hash_of tests/interop/python/requirements.txt "${protos[@]}")
if [ "$(cat "$py/gen/.generated" 2>/dev/null)" != "$gen_hash" ]; then
  say "generating Python stubs from proto/ with grpcio-tools"
  rm -rf "$py/gen" && mkdir -p "$py/gen"
  # Only our own proto: google/rpc/status.proto comes from googleapis-common-protos.
  "$py/bin/python" -m grpc_tools.protoc -I "$root/proto" --python_out="$py/gen" --grpc_python_out="$py/gen" \
    machinedriver/v1/driver.proto >&2 || die "grpcio-tools could not compile proto/machinedriver/v1/driver.proto"
  echo "$gen_hash" >"$py/gen/.generated"
fi
cat >"$out/python-client" <<EOF
#!/bin/sh
PYTHONPATH="$py/gen" exec "$py/bin/python" "$interop/python/client.py" "\$@"
EOF

# -------------------------------------------------------------------------------------- Node
node_dir="$interop/node"
lock_hash=$(hash_of tests/interop/node/package.json tests/interop/node/package-lock.json)
if [ "$(cat "$node_dir/node_modules/.installed" 2>/dev/null)" != "$lock_hash" ]; then
  say "installing the Node client's packages (npm ci, pinned by package-lock.json) into $node_dir/node_modules"
  # --ignore-scripts: nothing here needs an install script (protobufjs's only checks versions).
  (cd "$node_dir" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >&2) \
    || die "npm ci in tests/interop/node failed"
  echo "$lock_hash" >"$node_dir/node_modules/.installed"
fi
cat >"$out/node-client" <<EOF
#!/bin/sh
exec node "$node_dir/client.js" "\$@"
EOF

# ---------------------------------------------------------------------------------------- Go
# The machinedriver.v1 stubs are the Go driver's committed ones (examples/go-driver/gen), reached
# through a replace directive in tests/interop/go/go.mod, so they are part of the key.
mapfile -t go_inputs < <(cd "$root" && { ls tests/interop/go/go.mod tests/interop/go/go.sum tests/interop/go/*.go \
  examples/go-driver/go.mod examples/go-driver/go.sum; find examples/go-driver/gen -name '*.go'; } | sort)
[ -d "$root/examples/go-driver/gen" ] || die "examples/go-driver/gen (the Go stubs the Go client uses) is missing"
go_dest="$cache/interop-go/$(hash_of "${go_inputs[@]}")-$(go env GOVERSION)"
if [ ! -x "$go_dest/go-client" ]; then
  say "building the Go client (google.golang.org/grpc from the Go module proxy, pinned by go.sum) into $go_dest"
  # Only the current build stays in the cache.
  rm -rf "$cache/interop-go" && mkdir -p "$go_dest"
  (
    cd "$interop/go"
    export GOFLAGS=-mod=readonly GOTOOLCHAIN=local CGO_ENABLED=0
    go vet . >&2
    go build -trimpath -o "$go_dest/go-client.tmp" . >&2
  ) || die "building the Go client in tests/interop/go failed (see above)"
  mv "$go_dest/go-client.tmp" "$go_dest/go-client"
fi
ln -sfn "$go_dest/go-client" "$out/go-client"

chmod +x "$out/python-client" "$out/node-client"
for c in python-client node-client go-client; do
  v=$("$out/$c" --version) || die "$out/$c --version failed"
  say "$c: $v"
done
echo "$out"
