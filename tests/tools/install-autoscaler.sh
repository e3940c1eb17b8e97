#!/usr/bin/env bash
# Builds the real Kubernetes cluster-autoscaler, release 1.36.1, with only its externalgrpc cloud
# provider (build tag `externalgrpc`), into a version-keyed cache folder outside the clone, and
# prints the binary's path on stdout; progress goes to stderr.
#
# The Go module proxy refuses k8s.io/autoscaler/cluster-autoscaler itself but serves its
# dependencies, so the source comes from the release tarball (tag cluster-autoscaler-1.36.1,
# Apache-2.0): AUTOSCALER_SOURCE, else the workplace's shared copy
# (../shared/vendor/cluster-autoscaler-1.36.1.tar.gz beside the clone). Elsewhere the same tarball is
# https://github.com/kubernetes/autoscaler/archive/refs/tags/cluster-autoscaler-1.36.1.tar.gz
# (repack its cluster-autoscaler/ folder). Its sha256 is checked. The build takes about 2 minutes
# with warm Go caches, under 5 with empty ones.
#
# Usage: CLUSTER_AUTOSCALER_BIN="$(bash tests/tools/install-autoscaler.sh)"
# Cache: ${MACHINE_DRIVER_CACHE:-$HOME/.cache/machine-driver}/cluster-autoscaler-1.36.1/cluster-autoscaler
# Anything missing fails loudly (non-zero exit); nothing is skipped.
set -euo pipefail

version=1.36.1
sha256=b092e23618475f6836d8c9607bff9e1b67cfbd8ccfa0956beff68b1c0ff7dcaa
root="$(cd "$(dirname "$0")/../.." && pwd)"
cache="${MACHINE_DRIVER_CACHE:-$HOME/.cache/machine-driver}"
dest="$cache/cluster-autoscaler-$version"
bin="$dest/cluster-autoscaler"

fail() { echo "install-autoscaler: error: $*" >&2; exit 1; }
if [ -x "$bin" ]; then
  echo "$bin"
  exit 0
fi
command -v go >/dev/null || fail "'go' is required to build the cluster-autoscaler"
source="${AUTOSCALER_SOURCE:-$root/../shared/vendor/cluster-autoscaler-$version.tar.gz}"
[ -f "$source" ] || fail "no source tarball at $source (set AUTOSCALER_SOURCE; see the header of this script)"
echo "$sha256  $source" | sha256sum -c --status || fail "$source does not have sha256 $sha256"

work="$(mktemp -d "${TMPDIR:-/tmp}/autoscaler-build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
tar -xzf "$source" -C "$work"
mkdir -p "$dest"
echo "==> building cluster-autoscaler $version (externalgrpc only)" >&2
start=$SECONDS
# No -mod=mod: the release's go.sum pins every module; GOTOOLCHAIN=local uses the Go installed.
(cd "$work/cluster-autoscaler" && CGO_ENABLED=0 GOTOOLCHAIN=local \
  go build -tags externalgrpc -trimpath -ldflags=-s -o "$dest/.cluster-autoscaler.partial" . >&2)
mv "$dest/.cluster-autoscaler.partial" "$bin"
cp "$work/LICENSE" "$dest/LICENSE"
echo "==> built cluster-autoscaler in $((SECONDS - start)) s" >&2
echo "$bin"
