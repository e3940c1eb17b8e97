#!/usr/bin/env python3
"""Writes tests/feature-pin/Cargo.toml, or with --check says whether it is up to date.

The feature-off builds (tests/tools/feature-off.sh) build fake-driver, the controller and the SDK
alone, with a feature off. Cargo resolves features per build, so alone they would compile many
dependencies with other features than the workspace build did (syn without `fold`, tokio without
`test-util`, ...), and then every crate above each of them again: about 400 crates, 7 CPU-min
from nothing. The `feature-pin` crate, a dev-dependency of fake-driver and the controller (so
nothing a user builds), asks for exactly the workspace build's features of those dependencies, so
the feature-off builds compile only the workspace's own crates and reuse every dependency (the
pattern of cargo-hakari's workspace-hack, for two builds).

How: the unit graphs (`cargo +nightly build --unit-graph`) of the workspace build and of each
feature-off build; every dependency unit of a feature-off build with no twin (same package,
target, mode, profile and features) in the workspace build gets a pin, on its side (a normal
dependency of the pin crate, or a build-dependency for the compiler's side: build scripts and
proc-macros), with the workspace build's features there; repeated until nothing differs.
Usage: python3 tests/tools/feature-pin.py [--check]
"""
import json, os, subprocess, sys

root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
pin_toml = os.path.join(root, "tests", "feature-pin", "Cargo.toml")
WORKSPACE = ["--workspace", "--all-targets"]
# The builds of tests/tools/feature-off.sh.
FEATURE_OFF = [
    ["-p", "fake-driver", "--all-targets"],
    ["-p", "machine-controller", "-p", "driver-sdk", "--no-default-features", "--all-targets"],
]

HEAD = """# Written by tests/tools/feature-pin.py: do not edit (run it again after a dependency change;
# tests/tools/feature-off.sh fails while it is out of date).
[package]
name = "feature-pin"
description = "Pins the feature-off builds' dependencies to the workspace build's features, so they compile only the workspace's crates (tests/tools/feature-pin.py)."
version = "0.0.0"
edition = "2021"
license = "Apache-2.0"
publish = false

[lib]
path = "src/lib.rs"
test = false
doctest = false

[lints]
workspace = true
"""


def unit_graph(args):
    cmd = ["cargo", "+nightly", "build", "--unit-graph", "-Z", "unstable-options", *args]
    run = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"feature-pin: {' '.join(cmd)} failed:\n{run.stderr}")
    return json.loads(run.stdout)["units"]


def sides(units):
    """(unit index, side) for every unit reachable from the workspace's own units: 'host' under
    a build script or a proc-macro, 'target' otherwise."""
    def host_kind(u):
        return "proc-macro" in u["target"]["kind"] or (
            "custom-build" in u["target"]["kind"] and u["mode"] == "build")
    seen = set()
    stack = [(i, "target") for i, u in enumerate(units)
             if u["pkg_id"].startswith("path+") and not host_kind(u)]
    while stack:
        i, side = stack.pop()
        if (i, side) in seen:
            continue
        seen.add((i, side))
        for d in units[i]["dependencies"]:
            j = d["index"]
            stack.append((j, "host" if side == "host" or host_kind(units[j]) else "target"))
    return seen


def key(u):
    return (u["pkg_id"], u["target"]["name"], u["mode"], u["profile"]["name"], tuple(u["features"]))


def libs_by_side(units):
    """{(pkg_id, side): features} of every dependency's library."""
    out = {}
    for i, side in sides(units):
        u = units[i]
        if u["pkg_id"].startswith("path+") or u["mode"] != "build":
            continue
        if not set(u["target"]["kind"]) & {"lib", "rlib", "proc-macro"}:
            continue
        out.setdefault((u["pkg_id"], side), set()).update(u["features"])
    return out


def name_version(pkg_id):
    # registry+https://github.com/rust-lang/crates.io-index#ahash@0.8.12
    frag = pkg_id.rsplit("#", 1)[1]
    name, _, version = frag.partition("@")
    return name, version


def render(pins):
    lines = [HEAD]
    names = []
    for section, side in (("dependencies", "target"), ("build-dependencies", "host")):
        lines.append(f"[{section}]")
        for (pkg_id, s), features in sorted(pins.items()):
            if s != side:
                continue
            name, version = name_version(pkg_id)
            dep = f"{name}-{version}".replace(".", "-").replace("+", "-")
            names.append(dep)
            feats = ", ".join(f'"{f}"' for f in sorted(features))
            lines.append(f'{dep} = {{ package = "{name}", version = "={version}", '
                         f'default-features = false, features = [{feats}] }}')
        lines.append("")
    lines.append("# Nothing here is used: each dependency is there for its features.")
    lines.append("[package.metadata.cargo-shear]")
    lines.append("ignored = [" + ", ".join(f'"{n}"' for n in sorted(set(names))) + "]")
    return "\n".join(lines) + "\n"


def main():
    check = "--check" in sys.argv[1:]
    current = open(pin_toml).read() if os.path.exists(pin_toml) else ""
    if not check:
        # From no pin at all, so that a pin no longer needed goes.
        open(pin_toml, "w").write(render({}))
    ws = unit_graph(WORKSPACE)
    ws_keys = {key(u) for u in ws}
    ws_libs = libs_by_side(ws)
    pins = {}
    for _ in range(6):
        missing = {}
        for args in FEATURE_OFF:
            off = unit_graph(args)
            for i, side in sides(off):
                u = off[i]
                if u["pkg_id"].startswith("path+") or key(u) in ws_keys:
                    continue
                if u["mode"] != "build" or not set(u["target"]["kind"]) & {"lib", "rlib", "proc-macro"}:
                    continue  # a build script run or compile follows its library's features
                want = ws_libs.get((u["pkg_id"], side))
                if want is None:
                    sys.exit(f"feature-pin: {u['pkg_id']} ({side}) is in `cargo build {' '.join(args)}` "
                             "but not in the workspace build")
                if pins.get((u["pkg_id"], side)) != want:
                    missing[(u["pkg_id"], side)] = want
        if not missing:
            break
        if check:
            for (pkg_id, side), want in sorted(missing.items()):
                print(f"feature-pin: {' '.join(name_version(pkg_id))} ({side}) would compile again: "
                      f"pin it to {sorted(want)}", file=sys.stderr)
            sys.exit("feature-pin: tests/feature-pin/Cargo.toml is out of date: "
                     "run python3 tests/tools/feature-pin.py")
        pins.update(missing)
        open(pin_toml, "w").write(render(pins))
    else:
        sys.exit("feature-pin: the pins did not settle in 6 rounds")
    if check:
        print("feature-pin: the feature-off builds reuse every dependency of the workspace build")
    else:
        changed = "changed" if open(pin_toml).read() != current else "unchanged"
        print(f"feature-pin: wrote {os.path.relpath(pin_toml, root)} ({len(pins)} pins, {changed})")


main()
