#!/usr/bin/env bash
# Builds a real kube-apiserver and etcd from the Go module proxy into a version-keyed cache
# folder outside the clone, and prints that folder. Reruns with a filled cache take no time.
#
# No package registry ships kube-apiserver. k8s.io/kubernetes cannot be `go install`ed (its go.mod
# replaces its staging modules with local paths), so a tiny local main module requires it and
# replaces every `./staging/src/k8s.io/X` with the published `k8s.io/X v0.<minor>.<patch>`.
#
# Usage: bash tests/tools/install-kube-apiserver.sh   (prints the folder holding both binaries)
# Env:   KUBE_VERSION (default 1.37.2), ETCD_VERSION (default 3.7.3),
#        MACHINE_DRIVER_CACHE (default ~/.cache/machine-driver)
set -euo pipefail

kube_version="${KUBE_VERSION:-1.37.2}"
etcd_version="${ETCD_VERSION:-3.7.3}"
cache="${MACHINE_DRIVER_CACHE:-$HOME/.cache/machine-driver}"
dest="$cache/kube-$kube_version-etcd-$etcd_version"

if [ -x "$dest/kube-apiserver" ] && [ -x "$dest/etcd" ]; then
  echo "$dest"
  exit 0
fi
command -v go >/dev/null || { echo "install-kube-apiserver: 'go' is required" >&2; exit 1; }

work="$cache/build"
mkdir -p "$dest" "$work"
export CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local

build_apiserver() {
  local mod="$work/apiserver-$kube_version"
  rm -rf "$mod" && mkdir -p "$mod" && cd "$mod"
  go mod init local/kube-apiserver-build >/dev/null 2>&1
  # The staging modules, read from the published k8s.io/kubernetes go.mod.
  local gomod
  gomod=$(go mod download -json "k8s.io/kubernetes@v$kube_version" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
  [ -f "$gomod" ] || { echo "install-kube-apiserver: no go.mod for k8s.io/kubernetes v$kube_version" >&2; return 1; }
  local staging
  staging=$(sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9./-]*\)[[:space:]]*=>[[:space:]]*\./staging/.*#\1#p' "$gomod")
  [ -n "$staging" ] || { echo "install-kube-apiserver: no staging replaces in $gomod" >&2; return 1; }
  local args=()
  for m in $staging; do args+=("-replace=$m=$m@v0.${kube_version#1.}"); done
  go mod edit "${args[@]}" "-require=k8s.io/kubernetes@v$kube_version"
  go get "k8s.io/kubernetes/cmd/kube-apiserver@v$kube_version" >&2
  go build -trimpath -ldflags=-s -o "$dest/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver >&2
}

build_etcd() {
  local mod="$work/etcd-$etcd_version"
  rm -rf "$mod" && mkdir -p "$mod" && cd "$mod"
  go mod init local/etcd-build >/dev/null 2>&1
  go get "go.etcd.io/etcd/server/v3@v$etcd_version" >&2
  go build -trimpath -ldflags=-s -o "$dest/etcd" go.etcd.io/etcd/server/v3 >&2
}

echo "==> building kube-apiserver v$kube_version and etcd v$etcd_version from the Go module proxy into $dest" >&2
[ -x "$dest/etcd" ] || build_etcd
[ -x "$dest/kube-apiserver" ] || build_apiserver
rm -rf "$work"
echo "$dest"
