#!/usr/bin/env bash
# Builds the Go driver (examples/go-driver, written from the .proto files alone) into a cache
# outside the clone and prints the binary's path on stdout; all progress goes to stderr.
#
# The cache key is a hash of the module's files, the protocol's .proto files, this script and
# `go version`, so any change rebuilds and an unchanged tree costs one hash. A rebuild first
# checks that the committed stubs in examples/go-driver/gen match the .proto files (regenerating
# them with the pinned tools of examples/go-driver/generate.sh into a temporary folder), that the
# Go code is gofmt'ed and `go vet` clean, and runs its unit tests. Modules come from the Go
# module proxy, pinned by go.mod / go.sum.
#
# Usage: GO_DRIVER_BIN="$(bash tests/tools/build-go-driver.sh)"
# Cache: ${MACHINE_DRIVER_CACHE:-$HOME/.cache/machine-driver}/go-driver/<key>/go-driver
# Anything missing fails loudly (non-zero exit); nothing is skipped.
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
src="$root/examples/go-driver"
cache="${MACHINE_DRIVER_CACHE:-$HOME/.cache/machine-driver}"

fail() { echo "build-go-driver: error: $*" >&2; exit 1; }
command -v go >/dev/null || fail "go is not installed: the Go driver needs Go 1.26 or newer"
command -v python3 >/dev/null || fail "python3 is not installed: generate.sh needs it for PyPI grpcio-tools"
[ -f "$src/go.mod" ] || fail "$src/go.mod not found"

key="$(
  cd "$root"
  {
    find examples/go-driver proto tests/tools/build-go-driver.sh -type f \
      \( -name '*.go' -o -name 'go.mod' -o -name 'go.sum' -o -name '*.proto' -o -name '*.sh' \) -print0 |
      LC_ALL=C sort -z | xargs -0 sha256sum
    go version
  } | sha256sum | cut -c1-16
)"
out="$cache/go-driver/$key"
bin="$out/go-driver"
if [ -x "$bin" ]; then
  echo "==> Go driver up to date: $bin" >&2
  echo "$bin"
  exit 0
fi

echo "==> building the Go driver (examples/go-driver) into $out" >&2
mkdir -p "$out"
tmp="$(mktemp -d "$out/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

echo "==> checking that examples/go-driver/gen matches proto/" >&2
bash "$src/generate.sh" "$tmp/regen"
diff -r "$src/gen" "$tmp/regen/gen" >&2 ||
  fail "examples/go-driver/gen is stale: run \`bash examples/go-driver/generate.sh\` and commit the result"

cd "$src"
unformatted="$(gofmt -l $(find . -name '*.go' -not -path './gen/*'))"
[ -z "$unformatted" ] || fail "not gofmt'ed: $unformatted (run gofmt -w)"
echo "==> go vet, go test" >&2
go vet ./... >&2
go test -count=1 ./... >&2
go build -trimpath -buildvcs=false -o "$tmp/go-driver" . >&2
mv "$tmp/go-driver" "$bin"
echo "==> built $bin" >&2
echo "$bin"
