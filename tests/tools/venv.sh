#!/usr/bin/env bash
# Installs Python packages from PyPI into a venv of their own, creating it if it does not exist:
#   bash tests/tools/venv.sh DIR PIP-INSTALL-ARGS...    (e.g. venv.sh .tools/moto "moto[server]==5.2.5")
# The venv gets no pip of its own: Python's pip installs into it (`pip --python`, pip 22.3 or
# later). `python3 -m venv` with pip copies pip into every venv and compiles its ~1,000 modules:
# 5 CPU-s each, and a run from nothing made seven venvs. Without a recent enough pip beside
# Python, the venv gets its own pip as before.
set -euo pipefail
dir="${1:?usage: venv.sh DIR PIP-INSTALL-ARGS...}"
shift
die() { echo "venv.sh: error: $*" >&2; exit 1; }
pip_args=(install --quiet --disable-pip-version-check --no-input "$@")

# pip 22.3 or later beside python3 (`--python` came in 22.3).
if python3 -c 'import sys, pip; sys.exit(tuple(map(int, pip.__version__.split(".")[:2])) < (22, 3))' 2>/dev/null; then
  [ -x "$dir/bin/python" ] || python3 -m venv --without-pip "$dir" || die "python3 -m venv failed (Debian: python3-venv)"
  python3 -m pip --python "$dir/bin/python" "${pip_args[@]}" >&2 || die "pip install $* into $dir failed"
else
  [ -x "$dir/bin/pip" ] || python3 -m venv "$dir" || die "python3 -m venv failed (Debian: python3-venv)"
  "$dir/bin/pip" "${pip_args[@]}" >&2 || die "pip install $* into $dir failed"
fi
