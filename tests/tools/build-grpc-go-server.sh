#!/usr/bin/env bash
# Builds the grpc-go peer of the SDK overhead benchmark (tests/benches/grpc-go-server: the
# machinedriver.v1 Machines service on grpc-go's defaults) into a cache outside the clone and
# prints the binary's path on stdout; progress goes to stderr. tests/benches/sdk_overhead.rs runs
# it; it is also usable by hand.
#
# The stubs are the Go driver's committed ones (examples/go-driver/gen, generated from proto/ by
# examples/go-driver/generate.sh and checked against proto/ by tests/tools/build-go-driver.sh),
# reached through a replace directive in go.mod. grpc-go and protobuf come from the Go module
# proxy, pinned by go.mod / go.sum. The cache key is a hash of those sources, the stubs, this
# script and `go version`, so an unchanged tree costs one hash.
#
# Usage: GRPC_GO_SERVER="$(bash tests/tools/build-grpc-go-server.sh)"
# Cache: ${MACHINE_DRIVER_CACHE:-$HOME/.cache/machine-driver}/grpc-go-server/<key>/grpc-go-server
# Anything missing (Go above all) fails loudly with a non-zero exit; nothing is skipped.
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
src="$root/tests/benches/grpc-go-server"
cache="${MACHINE_DRIVER_CACHE:-$HOME/.cache/machine-driver}"

fail() { echo "build-grpc-go-server: error: $*" >&2; exit 1; }
command -v go >/dev/null || fail "go is not installed: the grpc-go peer of the SDK overhead benchmark needs Go 1.26 or newer"
[ -f "$src/go.mod" ] || fail "$src/go.mod not found"
[ -d "$root/examples/go-driver/gen" ] || fail "examples/go-driver/gen (the Go stubs the server uses) is missing"

key="$(
  cd "$root"
  {
    find tests/benches/grpc-go-server examples/go-driver/gen examples/go-driver/go.mod examples/go-driver/go.sum \
      tests/tools/build-grpc-go-server.sh -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
    go version
  } | sha256sum | cut -c1-16
)"
out="$cache/grpc-go-server/$key"
bin="$out/grpc-go-server"
if [ -x "$bin" ]; then
  echo "build-grpc-go-server: up to date: $bin" >&2
  echo "$bin"
  exit 0
fi

echo "build-grpc-go-server: building tests/benches/grpc-go-server into $out" >&2
# Only the current build stays in the cache.
rm -rf "$cache/grpc-go-server" && mkdir -p "$out"
(
  cd "$src"
  export GOFLAGS=-mod=readonly GOTOOLCHAIN=local CGO_ENABLED=0
  unformatted="$(gofmt -l .)"
  [ -z "$unformatted" ] || fail "not gofmt'ed: $unformatted (run gofmt -w)"
  go vet . >&2
  go build -trimpath -buildvcs=false -o "$out/grpc-go-server.tmp" . >&2
) || fail "building tests/benches/grpc-go-server failed (see above)"
mv "$out/grpc-go-server.tmp" "$bin"
echo "build-grpc-go-server: built $bin ($("$bin" --version))" >&2
echo "$bin"
