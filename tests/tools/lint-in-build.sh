#!/usr/bin/env bash
# A RUSTC_WORKSPACE_WRAPPER for tests/run.sh's build: every workspace crate is compiled by
# clippy-driver with `-D warnings`, and documented by rustdoc with `-D warnings`, as part of the
# build (cargo calls a workspace wrapper for the workspace's own crates only; their dependencies
# go to rustc unchanged).
#
# Why: `cargo clippy` and `cargo doc` compile every dependency a second time, in check mode (about
# 500 crates; aws-sdk-ec2, 88 MB of generated source, took 4-5 minutes of one core alone), and the
# build compiles them all again. Linted and documented here, the dependencies are compiled once.
# The checks are the same as `cargo clippy --all-targets -- -D warnings` (clippy on every target
# the build compiles: libraries, binaries, examples, tests, benches, build scripts) and
# `RUSTDOCFLAGS="-D warnings" cargo doc --lib --bins --examples` (rustdoc on every library,
# binary and example, the binaries and examples with their private items, as cargo doc
# documents them), into
# $CARGO_TARGET_DIR/doc-in-build/<crate>.<lib|bin>/ (a package's library and binary share a
# crate name).
# LINT_IN_BUILD: the crate names to check (space-separated), or * (the default) for all.
# LINT_IN_BUILD_CHECK=leaves: executables (binaries, examples, tests) checked, not built (below).
# LINT_IN_BUILD_DOCS=0: clippy only (tests/tools/feature-off.sh: docs are read with the default
# features, and a link to a module a feature leaves out is not broken there).
# Usage (cargo calls it): RUSTC_WORKSPACE_WRAPPER=tests/tools/lint-in-build.sh cargo build ...
set -euo pipefail
rustc="$1"
shift

crate="" kind="" test=false probe=false unrun=false prev=""
for arg in "$@"; do
  case "$prev" in
    --crate-name) crate="$arg" ;;
    --crate-type) kind="$arg" ;;
  esac
  # Test harnesses (--test) and benches (built as tests are: --cfg test).
  [ "$prev $arg" = "--cfg test" ] && test=true
  case "$arg" in
    --test) test=true ;;
    # cargo asking the compiler what it can do (`-vV`, `--print=cfg`, ...): rustc answers.
    -vV | --print | --print=*) probe=true ;;
    # Executables nothing in the run starts: benches (cargo's layout: benches/NAME.rs) and the
    # end-to-end crate's examples (tests/examples/: tools for a developer, like dev_cluster).
    benches/*.rs | */benches/*.rs | tests/examples/*.rs) unrun=true ;;
  esac
  prev="$arg"
done
if $probe || [ -z "$crate" ]; then exec "$rustc" "$@"; fi
case " ${LINT_IN_BUILD:-*} " in
  " * " | *" $crate "*) ;;
  *) exec "$rustc" "$@" ;;
esac

# clippy-driver takes the rustc path first, as `cargo clippy` calls it; it compiles as rustc would.
clippy_driver="$(dirname "$rustc")/clippy-driver"
[ -x "$clippy_driver" ] || clippy_driver="$(rustup which clippy-driver)"
# Benches are only checked, as `cargo clippy --all-targets` checks every target: nothing runs them
# here (`cargo bench` builds its own, optimized), and code generation and linking were 51 of their
# 55 CPU-s (six executables) in every run from nothing. So is dev_cluster (about 9 CPU-s built;
# `cargo run --example dev_cluster` builds it when a developer wants it; it is still documented).
# With LINT_IN_BUILD_CHECK=leaves (tests/tools/feature-off.sh), so are all executables (binaries,
# examples, tests; not build scripts, which run): `cargo hack --feature-powerset check` checks
# feature sets so too. Cargo copies a binary up to target/debug/ only if it was written, so the
# workspace build's binaries stay in place.
leaf=false
if [ "$kind" = bin ] || { $test && [ "$kind" != lib ]; }; then leaf=true; fi
if $unrun || { [ "${LINT_IN_BUILD_CHECK:-}" = leaves ] && $leaf && [ "$crate" != build_script_build ]; }; then
  check=() skip=false
  for arg in "$@"; do
    if $skip; then skip=false; continue; fi
    case "$arg" in
      --emit) skip=true ;;
      --emit=*) ;;
      *) check+=("$arg") ;;
    esac
  done
  "$clippy_driver" "$rustc" "${check[@]}" --emit=dep-info,metadata -D warnings
else
  "$clippy_driver" "$rustc" "$@" -D warnings
fi

# The docs, from the same arguments minus what only the compiler takes (outputs, codegen options,
# the JSON diagnostics cargo reads from rustc), against the dependencies this build just compiled.
# Not for tests, benches or build scripts, which cargo doc does not document either.
$test && exit 0
[ "$crate" != build_script_build ] || exit 0
[ "${LINT_IN_BUILD_DOCS:-1}" != 0 ] || exit 0
args=() skip=false
for arg in "$@"; do
  if $skip; then skip=false; continue; fi
  case "$arg" in
    --out-dir | -C | --error-format | --json | --emit) skip=true ;;
    --out-dir=* | -C* | --error-format=* | --json=* | --emit=*) ;;
    *) args+=("$arg") ;;
  esac
done
[ "$kind" != bin ] || args+=(--document-private-items)
"$(dirname "$rustc")/rustdoc" "${args[@]}" -o "${CARGO_TARGET_DIR:-target}/doc-in-build/$crate.$kind" -D warnings
