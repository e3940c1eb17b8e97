#!/usr/bin/env bash
# Protocol compatibility of machinedriver.v1 (docs/src/reference/protocol.md, "Compatibility policy"):
#   buf lint       buf.yaml's STANDARD rules (with the released-v1 exceptions listed there)
#   buf breaking   FILE rules against proto/released/machinedriver-v1.binpb, the released v1
# buf comes from npm (@bufbuild/buf, pinned), installed into a version-keyed folder outside the
# clone: cold ~5 s, warm ~1 s. A failed install or check fails the run.
# Usage: bash tests/proto-compat.sh      Env: MACHINE_DRIVER_CACHE (default ~/.cache/machine-driver)
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
cache="${MACHINE_DRIVER_CACHE:-$HOME/.cache/machine-driver}"
buf_version=1.75.0

say() { echo "proto-compat: $*" >&2; }
die() { echo "proto-compat: error: $*" >&2; exit 1; }

dir="$cache/buf-$buf_version"
buf="$dir/node_modules/.bin/buf"
if [ "$("$buf" --version 2>/dev/null)" != "$buf_version" ]; then
  command -v npm >/dev/null || die "npm is required (Node.js 20 or later)"
  say "installing buf $buf_version (npm @bufbuild/buf) into $dir"
  rm -rf "$dir" && mkdir -p "$dir"
  # --ignore-scripts: the binary comes as the platform package (@bufbuild/buf-linux-x64 ...).
  npm install --prefix "$dir" --no-audit --no-fund --loglevel=error --ignore-scripts \
    "@bufbuild/buf@$buf_version" >&2 || die "npm install @bufbuild/buf@$buf_version failed"
  [ "$("$buf" --version)" = "$buf_version" ] || die "buf $buf_version did not install"
fi

cd "$root"
released=proto/released/machinedriver-v1.binpb
[ -f "$released" ] || die "$released (the released v1 schema) is missing"
say "buf lint"
"$buf" lint
say "buf breaking --against $released"
"$buf" breaking --against "$released"
say "ok"
