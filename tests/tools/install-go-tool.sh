#!/usr/bin/env bash
# Builds one Go program from the Go module proxy into a version-keyed cache folder outside the
# clone, and prints the binary's path on stdout; progress goes to stderr. A filled cache takes no
# time. Used for the tools the tests run that no package registry ships as a binary:
#   helm   helm.sh/helm/v4/cmd/helm                     (the chart's lint and template, deploy/chart/)
#   jaeger github.com/jaegertracing/jaeger/cmd/jaeger   (the one-trace test, tests/tracing_jaeger.rs)
#   controller-gen sigs.k8s.io/controller-tools/cmd/controller-gen  (prometheus-operator's CRDs
#          from its API types, tests/tools/install-monitoring-crds.sh)
#
# Usage: bash tests/tools/install-go-tool.sh helm|jaeger|controller-gen
# Cache: ${MACHINE_DRIVER_CACHE:-$HOME/.cache/machine-driver}/<name>-<version>/<name>
# Anything missing fails loudly (non-zero exit); nothing is skipped.
set -euo pipefail

case "${1:-}" in
  # Helm 4, the current major; v4.3.2 is the newest approved release the proxy serves here.
  helm) name=helm package=helm.sh/helm/v4/cmd/helm version=v4.3.2
    # `helm version` reports what the release build stamps.
    ldflags="-X helm.sh/helm/v4/internal/version.version=$version" ;;
  # Jaeger v2 (the OpenTelemetry Collector based binary): its OTLP receiver and query API.
  # v1.75.0 is the release approved here; the proxy also serves v1.76.0 but marks it unapproved.
  jaeger) name=jaeger package=github.com/jaegertracing/jaeger/cmd/jaeger version=v1.75.0
    ldflags="" ;;
  controller-gen) name=controller-gen package=sigs.k8s.io/controller-tools/cmd/controller-gen version=v0.23.0
    ldflags="" ;;
  *) echo "usage: install-go-tool.sh helm|jaeger|controller-gen" >&2; exit 2 ;;
esac

cache="${MACHINE_DRIVER_CACHE:-$HOME/.cache/machine-driver}"
dest="$cache/$name-$version"
bin="$dest/$name"
if [ -x "$bin" ]; then
  echo "$bin"
  exit 0
fi
command -v go >/dev/null || { echo "install-go-tool: 'go' is required to build $name" >&2; exit 1; }
work="$cache/build/$name-$version"
rm -rf "$work" && mkdir -p "$work" "$dest"
cd "$work"
export CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local
go mod init "local/$name-build" >/dev/null 2>&1
echo "==> building $name $version ($package) from the Go module proxy" >&2
start=$SECONDS
go get "$package@$version" >&2
# Into a temporary name, then renamed: an interrupted build leaves no half binary behind.
go build -trimpath -ldflags="-s $ldflags" -o "$dest/.$name.partial" "$package" >&2
mv "$dest/.$name.partial" "$bin"
echo "==> built $name in $((SECONDS - start)) s" >&2
echo "$bin"
