#!/usr/bin/env bash
# Builds the parts of a whole test Kubernetes cluster without kubelets from the Go module proxy
# into a version-keyed cache folder outside the clone, and prints that folder:
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubectl  (k8s.io/kubernetes)
#   etcd                                                              (go.etcd.io/etcd/server/v3)
#   kwok + its default stages in kwok-stages/                          (sigs.k8s.io/kwok)
# Each part already in the folder is skipped, so reruns with a filled cache take no time.
#
# No package registry ships these. k8s.io/kubernetes cannot be `go install`ed (its go.mod replaces
# its staging modules with local paths), so a tiny local main module requires it and replaces
# every `./staging/src/k8s.io/X` with the published `k8s.io/X v0.<minor>.<patch>`; the four
# Kubernetes binaries build from that one module and share its downloads. kwok builds in its own
# module; its default stages (which it refuses to start without) ship inside its module.
#
# Usage: bash tests/tools/install-kube-cluster.sh   (prints the folder holding the binaries)
# Env:   KUBE_VERSION (default 1.37.2), ETCD_VERSION (default 3.7.3), KWOK_VERSION (default 0.8.0),
#        MACHINE_DRIVER_CACHE (default ~/.cache/machine-driver)
set -euo pipefail

kube_version="${KUBE_VERSION:-1.37.2}"
etcd_version="${ETCD_VERSION:-3.7.3}"
kwok_version="${KWOK_VERSION:-0.8.0}"
cache="${MACHINE_DRIVER_CACHE:-$HOME/.cache/machine-driver}"
# Every version is in the name: a folder from an older layout is never taken for a complete one.
dest="$cache/kube-$kube_version-etcd-$etcd_version-kwok-$kwok_version"

kube_bins=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
# The kwok stages the tests use, relative to kwok's kustomize/stage/ (copied as kwok-stages/).
stages=(
  node/fast/node-initialize.yaml
  node/heartbeat/node-heartbeat.yaml
  node/chaos/node-not-ready.yaml
  pod/fast/pod-ready.yaml
  pod/fast/pod-complete.yaml
  pod/fast/pod-delete.yaml
)

complete() {
  local b s
  for b in "${kube_bins[@]}" etcd kwok; do [ -x "$dest/$b" ] || return 1; done
  for s in "${stages[@]}"; do [ -f "$dest/kwok-stages/$s" ] || return 1; done
}

if complete; then
  echo "$dest"
  exit 0
fi
command -v go >/dev/null || { echo "install-kube-cluster: 'go' is required" >&2; exit 1; }

work="$cache/build"
mkdir -p "$dest" "$work"
export CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local

# go build into a temporary name, then rename: an interrupted build leaves no half binary behind.
build() { # build <name> <package> [extra -ldflags]
  echo "==> building $1 ($2)" >&2
  local start=$SECONDS
  go build -trimpath -ldflags="-s ${3:-}" -o "$dest/.$1.partial" "$2" >&2
  mv "$dest/.$1.partial" "$dest/$1"
  echo "==> built $1 in $((SECONDS - start)) s" >&2
}

build_kube() {
  local missing=() b
  for b in "${kube_bins[@]}"; do [ -x "$dest/$b" ] || missing+=("$b"); done
  [ ${#missing[@]} -gt 0 ] || return 0
  local mod="$work/kubernetes-$kube_version"
  rm -rf "$mod" && mkdir -p "$mod" && cd "$mod"
  go mod init local/kubernetes-build >/dev/null 2>&1
  # The staging modules, read from the published k8s.io/kubernetes go.mod.
  local gomod
  gomod=$(go mod download -json "k8s.io/kubernetes@v$kube_version" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
  [ -f "$gomod" ] || { echo "install-kube-cluster: no go.mod for k8s.io/kubernetes v$kube_version" >&2; return 1; }
  local staging
  staging=$(sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9./-]*\)[[:space:]]*=>[[:space:]]*\./staging/.*#\1#p' "$gomod")
  [ -n "$staging" ] || { echo "install-kube-cluster: no staging replaces in $gomod" >&2; return 1; }
  local args=() m pkgs=()
  for m in $staging; do args+=("-replace=$m=$m@v0.${kube_version#1.}"); done
  go mod edit "${args[@]}" "-require=k8s.io/kubernetes@v$kube_version"
  for b in "${missing[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b@v$kube_version"); done
  go get "${pkgs[@]}" >&2
  # The version they report (`--version`, the apiserver's /version), as Kubernetes' own build
  # stamps it; a plain go build says v0.0.0-master.
  local major="${kube_version%%.*}" minor="${kube_version#*.}" stamp="" pkg
  minor="${minor%%.*}"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    stamp+=" -X $pkg.gitVersion=v$kube_version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
    stamp+=" -X $pkg.gitTreeState=clean"
  done
  for b in "${missing[@]}"; do build "$b" "k8s.io/kubernetes/cmd/$b" "$stamp"; done
}

build_etcd() {
  [ -x "$dest/etcd" ] && return 0
  local mod="$work/etcd-$etcd_version"
  rm -rf "$mod" && mkdir -p "$mod" && cd "$mod"
  go mod init local/etcd-build >/dev/null 2>&1
  go get "go.etcd.io/etcd/server/v3@v$etcd_version" >&2
  build etcd go.etcd.io/etcd/server/v3
}

build_kwok() {
  if [ ! -x "$dest/kwok" ]; then
    local mod="$work/kwok-$kwok_version"
    rm -rf "$mod" && mkdir -p "$mod" && cd "$mod"
    go mod init local/kwok-build >/dev/null 2>&1
    go get "sigs.k8s.io/kwok/cmd/kwok@v$kwok_version" >&2
    build kwok sigs.k8s.io/kwok/cmd/kwok
  fi
  local dir s
  cd "$work"
  dir=$(go mod download -json "sigs.k8s.io/kwok@v$kwok_version" | sed -n 's/.*"Dir": "\(.*\)",*/\1/p')
  [ -d "$dir/kustomize/stage" ] || { echo "install-kube-cluster: no kustomize/stage in the kwok module ($dir)" >&2; return 1; }
  for s in "${stages[@]}"; do
    [ -f "$dir/kustomize/stage/$s" ] || { echo "install-kube-cluster: kwok v$kwok_version has no stage $s" >&2; return 1; }
  done
  # All of kwok's stage files (small YAML files; not their kustomizations and test data).
  local tmp="$dest/.kwok-stages.partial" f
  rm -rf "$dest/kwok-stages" "$tmp"
  (cd "$dir/kustomize/stage" && find . -name '*.yaml' ! -name kustomization.yaml ! -path '*/testdata/*') |
    while read -r f; do
      mkdir -p "$tmp/$(dirname "$f")"
      cp "$dir/kustomize/stage/$f" "$tmp/$f"
    done
  mv "$tmp" "$dest/kwok-stages"
}

echo "==> building kube-apiserver, kube-controller-manager, kube-scheduler, kubectl v$kube_version," \
  "etcd v$etcd_version and kwok v$kwok_version from the Go module proxy into $dest" >&2
build_etcd
build_kube
build_kwok
rm -rf "$work"
complete || { echo "install-kube-cluster: $dest is still incomplete" >&2; exit 1; }
echo "$dest"
