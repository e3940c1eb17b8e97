#!/usr/bin/env bash
# Regenerates the Go stubs in gen/ from the protocol's .proto files (../../proto), with pinned
# tools installed into a cache outside the clone:
#   - protoc from PyPI grpcio-tools (it ships the well-known types, so no system protoc)
#   - protoc-gen-go and protoc-gen-go-grpc from the Go module proxy
# Usage: bash examples/go-driver/generate.sh [OUT_DIR]   (default: this folder)
# With OUT_DIR the stubs are written there instead (tests/tools/build-go-driver.sh uses that to
# check that the committed stubs are current). Progress goes to stderr.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-$here}"

# Pins. protoc-gen-go comes from the same module (and version) as the protobuf runtime in go.mod.
GRPCIO_TOOLS_VERSION=1.85.1
PROTOBUF_PY_VERSION=7.36.2
PROTOC_GEN_GO_VERSION=v1.36.12
PROTOC_GEN_GO_GRPC_VERSION=v1.6.2

module="machinedriver.dev/go-driver"
gopkg="$module/gen/machinedriver/v1;machinedriverv1"

cache="${MACHINE_DRIVER_CACHE:-$HOME/.cache/machine-driver}"
tools="$cache/go-driver-tools/grpcio-tools-$GRPCIO_TOOLS_VERSION-go-$PROTOC_GEN_GO_VERSION-grpc-$PROTOC_GEN_GO_GRPC_VERSION"

if [ ! -x "$tools/venv/bin/python" ] || ! "$tools/venv/bin/python" -c 'import grpc_tools.protoc' 2>/dev/null; then
  echo "==> installing grpcio-tools $GRPCIO_TOOLS_VERSION (PyPI) into $tools/venv" >&2
  rm -rf "$tools/venv"
  python3 -m venv "$tools/venv" >&2
  "$tools/venv/bin/pip" install --quiet --disable-pip-version-check \
    "grpcio-tools==$GRPCIO_TOOLS_VERSION" "grpcio==$GRPCIO_TOOLS_VERSION" "protobuf==$PROTOBUF_PY_VERSION" >&2
fi
for plugin in protoc-gen-go protoc-gen-go-grpc; do
  if [ ! -x "$tools/bin/$plugin" ]; then
    echo "==> installing $plugin (Go module proxy) into $tools/bin" >&2
    case $plugin in
      protoc-gen-go) pkg="google.golang.org/protobuf/cmd/protoc-gen-go@$PROTOC_GEN_GO_VERSION" ;;
      protoc-gen-go-grpc) pkg="google.golang.org/grpc/cmd/protoc-gen-go-grpc@$PROTOC_GEN_GO_GRPC_VERSION" ;;
    esac
    GOBIN="$tools/bin" go install "$pkg" >&2
  fi
done

mkdir -p "$out"
rm -rf "$out/gen/machinedriver"
# grpc_tools.protoc adds its bundled include dir (google/protobuf/*.proto) by itself.
# google/rpc/status.proto is not generated: its go_package is genproto's, which go.mod pins.
# The M option moves the protocol's package from the proto's placeholder go_package
# (example.invalid/...) to this module, and module= strips the module prefix from output paths.
"$tools/venv/bin/python" -m grpc_tools.protoc \
  -I "$root/proto" \
  --plugin=protoc-gen-go="$tools/bin/protoc-gen-go" \
  --plugin=protoc-gen-go-grpc="$tools/bin/protoc-gen-go-grpc" \
  --go_out="$out" --go_opt=module="$module" --go_opt=Mmachinedriver/v1/driver.proto="$gopkg" \
  --go-grpc_out="$out" --go-grpc_opt=module="$module" --go-grpc_opt=Mmachinedriver/v1/driver.proto="$gopkg" \
  machinedriver/v1/driver.proto
echo "==> generated $out/gen/machinedriver/v1" >&2
