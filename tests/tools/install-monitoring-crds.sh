#!/usr/bin/env bash
# The CRDs of prometheus-operator's ServiceMonitor and PrometheusRule (monitoring.coreos.com/v1),
# so the chart's test can apply those objects to the test API server and have them validated.
# The Go module proxy serves prometheus-operator's API types
# (github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring) but not the module that
# holds its generated CRD files, so they are generated from the types with controller-gen, as
# prometheus-operator's own Makefile does (`controller-gen crd:crdVersions=v1 paths=./pkg/apis/monitoring/...`).
# Prints the folder holding the CRD files; progress goes to stderr. Cached by version.
#
# Usage: bash tests/tools/install-monitoring-crds.sh
set -euo pipefail

version=v0.95.2
root="$(cd "$(dirname "$0")/../.." && pwd)"
cache="${MACHINE_DRIVER_CACHE:-$HOME/.cache/machine-driver}"
dest="$cache/monitoring-crds-$version"
want=("$dest/monitoring.coreos.com_servicemonitors.yaml" "$dest/monitoring.coreos.com_prometheusrules.yaml")
complete() { local f; for f in "${want[@]}"; do [ -s "$f" ] || return 1; done; }
if complete; then
  echo "$dest"
  exit 0
fi
controller_gen="$(bash "$root/tests/tools/install-go-tool.sh" controller-gen)"
work="$cache/build/monitoring-crds-$version"
rm -rf "$work" && mkdir -p "$work" && cd "$work"
export GOFLAGS=-mod=mod GOTOOLCHAIN=local
go mod init local/monitoring-crds >/dev/null 2>&1
module=github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring
go get "$module@$version" >&2
dir="$(go list -m -f '{{.Dir}}' "$module")"
[ -d "$dir/v1" ] || { echo "install-monitoring-crds: no v1 types in $dir" >&2; exit 1; }
# controller-gen loads the packages as the module that holds them: a writable copy of it.
cp -r "$dir" "$work/monitoring" && chmod -R u+w "$work/monitoring"
tmp="$dest.partial"
rm -rf "$tmp" && mkdir -p "$tmp"
echo "==> generating the monitoring.coreos.com CRDs ($version) with controller-gen" >&2
(cd "$work/monitoring" && "$controller_gen" crd:crdVersions=v1,maxDescLen=0 paths=./v1/... "output:crd:dir=$tmp" >&2)
rm -rf "$dest" && mv "$tmp" "$dest"
complete || { echo "install-monitoring-crds: controller-gen wrote no ServiceMonitor or PrometheusRule CRD into $dest" >&2; ls "$dest" >&2; exit 1; }
echo "$dest"
