#!/usr/bin/env bash
# A RUSTC_WORKSPACE_WRAPPER for tests/run.sh's build: the workspace crates named in
# $LINT_IN_BUILD (crate names, space-separated) are compiled by clippy-driver with `-D warnings`,
# and their libraries documented by rustdoc with `-D warnings`, as part of the build; every other
# crate goes to rustc unchanged.
#
# Why: `cargo clippy` and `cargo doc` compile every dependency in check mode, and the build
# compiles it again. For aws-sdk-ec2 (88 MB of generated source; its only user is the AWS driver)
# that second compile cost 4-5 minutes of one core from nothing. Linted and documented here, the
# AWS driver needs aws-sdk-ec2 built once; tests/run.sh's clippy and tests/docs.sh's cargo doc
# leave it out (--exclude aws-ec2-driver). The checks are the same: clippy on every target of the
# crate (library, binary, tests), rustdoc on its library, warnings denied.
# Usage (cargo calls it): RUSTC_WORKSPACE_WRAPPER=tests/tools/lint-in-build.sh LINT_IN_BUILD=... cargo build ...
set -euo pipefail
rustc="$1"
shift

crate="" lib=false test=false prev=""
for arg in "$@"; do
  case "$prev" in
    --crate-name) crate="$arg" ;;
    --crate-type) [ "$arg" = lib ] && lib=true ;;
  esac
  [ "$arg" = --test ] && test=true
  prev="$arg"
done
case " ${LINT_IN_BUILD:-} " in
  *" $crate "*) ;;
  *) exec "$rustc" "$@" ;;
esac

# clippy-driver takes the rustc path first, as `cargo clippy` calls it; it compiles as rustc would.
clippy_driver="$(dirname "$rustc")/clippy-driver"
[ -x "$clippy_driver" ] || clippy_driver="$(rustup which clippy-driver)"
"$clippy_driver" "$rustc" "$@" -D warnings

# The library's docs, from the same arguments minus what only the compiler takes (outputs,
# codegen options, the JSON diagnostics cargo reads from rustc), against the dependencies this
# build just compiled.
if $lib && ! $test; then
  args=() skip=false
  for arg in "$@"; do
    if $skip; then skip=false; continue; fi
    case "$arg" in
      --out-dir | -C | --error-format | --json | --emit) skip=true ;;
      --out-dir=* | -C* | --error-format=* | --json=* | --emit=*) ;;
      *) args+=("$arg") ;;
    esac
  done
  "$(dirname "$rustc")/rustdoc" "${args[@]}" -o "${CARGO_TARGET_DIR:-target}/doc-in-build" -D warnings
fi
