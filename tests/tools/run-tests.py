#!/usr/bin/env python3
"""Runs the workspace's tests (what `cargo test --workspace` runs) with the test executables side by side.

The end-to-end tests spend most of their time waiting (for a cluster, a drain deadline, a
pause): with cargo's one executable at a time the machine was 80-90% idle through the test
step. This builds every test executable once (`cargo test --workspace --no-run`, so with the
workspace's features: a `cargo test -p PACKAGE` would resolve them per package and build
again), then runs the executables as cargo would (from their package's folder, with cargo's
CARGO_* variables), the end-to-end executable as one job per suite (its top-level modules: a
process each, as when every suite was an executable of its own), JOBS at a time, longest first (by the times of the last run, kept in the
target folder, else those committed in tests/tools/test-durations.json); the doc tests (`cargo test --workspace --doc`) are one more job. Each job's
output is printed whole when it ends, so logs never interleave; a table of the jobs' times and
the failures close the run.

Usage: run-tests.py [--jobs N] [--timeout SECONDS] [--executables FILE] [FILTER...] [-- HARNESS ARGS...]
The filter and the harness arguments (`--nocapture`, `--exact`) go to every executable.
Env: TEST_JOBS (the default of --jobs); GOMAXPROCS (default 1: the Go processes the tests start,
the test cluster's above all, get one P each).
Exit status: 0 when every job passed, 1 otherwise.
"""

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time


def workspace():
    """The workspace's packages by manifest path, and its target folder."""
    out = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps"], check=True, capture_output=True, text=True
    ).stdout
    meta = json.loads(out)
    return {p["manifest_path"]: p for p in meta["packages"]}, meta["target_directory"]


def read_durations(path):
    """A durations file (job label to seconds), or nothing when it is missing or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


class Job:
    def __init__(self, label, cmd, cwd=None, env=None):
        self.label, self.cmd, self.cwd, self.env = label, cmd, cwd, env


# Executables whose top-level modules are suites, run as one job each (package, target).
SPLIT_BY_MODULE = {("e2e-tests", "e2e")}


# libtest's options that take a value (as `--option VALUE` or `--option=VALUE`).
VALUE_OPTIONS = {"--test-threads", "--skip", "--format", "--color", "--logfile", "--shuffle-seed", "-Z"}


def harness_options(harness_args):
    """The options among `harness_args` (their values too), without the filters and `--exact`."""
    options, take_value = [], False
    for a in harness_args:
        if take_value:
            options.append(a)
            take_value = False
        elif a.startswith("-") and a != "--exact":
            options.append(a)
            take_value = a in VALUE_OPTIONS
    return options


def suites(executable, cwd, env, harness_args):
    """The tests of `executable` that `harness_args` select, by top-level module, in order."""
    listed = subprocess.run(
        [executable, "--list", "--format", "terse", *harness_args],
        cwd=cwd,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    by_module = {}
    for line in listed.splitlines():
        if line.endswith(": test"):
            name = line[: -len(": test")]
            by_module.setdefault(name.split("::")[0], []).append(name)
    return by_module


def build_messages(executables):
    """Cargo's JSON messages of the test build: read from `executables` if given (the output
    of `cargo build --workspace --all-targets --message-format=json-render-diagnostics`,
    as tests/run.sh builds, or of `cargo test --workspace --no-run` with that format), else built now."""
    if executables:
        with open(executables) as f:
            return f.read()
    build = subprocess.run(
        ["cargo", "test", "--workspace", "--no-run", "--message-format=json-render-diagnostics"],
        stdout=subprocess.PIPE,
        text=True,
    )
    if build.returncode != 0:
        sys.exit("run-tests: the test build failed (above)")
    return build.stdout


def test_jobs(packages, messages, harness_args):
    """A job per test executable of the build's `messages`, and one for the doc tests."""
    cargo = os.environ.get("CARGO", "cargo")
    jobs = []
    for line in messages.splitlines():
        msg = json.loads(line)
        if msg.get("reason") != "compiler-artifact" or not msg["profile"]["test"] or not msg.get("executable"):
            continue
        # Benches are built as tests are (for their lints) but, as in `cargo test`, not run.
        if "bench" in msg["target"]["kind"]:
            continue
        package = packages[msg["manifest_path"]]
        kind, name = msg["target"]["kind"][0], msg["target"]["name"]
        label = f"{package['name']} " + ("--lib" if kind == "lib" else f"--{kind} {name}")
        # What cargo test gives a test executable: its package's folder and variables.
        env = dict(os.environ)
        # The cluster's Go processes (kube-apiserver, etcd, the controller manager, ...) with one
        # P each, unless the caller says otherwise: the jobs run side by side on a machine whose
        # every core is busy, where a P per core buys nothing and costs CPU (spinning schedulers,
        # parallel GC). The `nodes` suite, alternating runs: 124-128 CPU-s against 141-148 with
        # Go's default, in the same wall time. (Benchmarks, run by `cargo bench`, keep Go's default.)
        env.setdefault("GOMAXPROCS", "1")
        env.update(
            CARGO=cargo,
            CARGO_MANIFEST_DIR=os.path.dirname(msg["manifest_path"]),
            CARGO_MANIFEST_PATH=msg["manifest_path"],
            CARGO_PKG_NAME=package["name"],
            CARGO_PKG_VERSION=package["version"],
            CARGO_CRATE_NAME=name.replace("-", "_"),
        )
        cwd = os.path.dirname(msg["manifest_path"])
        if (package["name"], name) in SPLIT_BY_MODULE:
            # The names exactly (the filters were applied by the listing), with the other options.
            options = harness_options(harness_args)
            for module, names in suites(msg["executable"], cwd, env, harness_args).items():
                jobs.append(Job(f"{label} {module}::", [msg["executable"], "--exact", *names, *options], cwd, env))
            continue
        jobs.append(Job(label, [msg["executable"], *harness_args], cwd, env))
    doc = ["cargo", "test", "--workspace", "--doc"]
    jobs.append(Job("--doc", doc + (["--", *harness_args] if harness_args else [])))
    return jobs


def main():
    parser = argparse.ArgumentParser(add_help=True, description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("TEST_JOBS", "3")))
    # Every await of a test is bounded; this bounds a job that hangs outside them.
    parser.add_argument("--timeout", type=int, default=1800)
    # The test build's messages, when tests/run.sh built the tests already.
    parser.add_argument("--executables", metavar="FILE")
    args, extra = parser.parse_known_args()
    packages, target = workspace()
    harness_args = [a for a in extra if a != "--"]
    jobs = test_jobs(packages, build_messages(args.executables), harness_args)
    history_file = os.path.join(target, "test-durations.json")
    history = read_durations(history_file)
    # From nothing (an empty target folder) the times of a whole run on the 2-core CI machine,
    # committed beside this script, order the jobs: run last in the order found, the longest
    # (nodes, 211 s of a 366 s step) started third and ended the step alone.
    committed = read_durations(os.path.join(os.path.dirname(os.path.abspath(__file__)), "test-durations.json"))
    # Longest first; a job never timed (a new test file) counts as long.
    jobs.sort(key=lambda job: -history.get(job.label, committed.get(job.label, 600)))

    print_lock = threading.Lock()
    started = time.monotonic()

    def run(job):
        t0 = time.monotonic()
        try:
            p = subprocess.run(
                job.cmd, cwd=job.cwd, env=job.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=args.timeout
            )
            output, code = p.stdout.decode(errors="replace"), p.returncode
        except subprocess.TimeoutExpired as e:
            output = (e.stdout or b"").decode(errors="replace") + f"\nrun-tests: killed after {args.timeout} s\n"
            code = -1
        took = time.monotonic() - t0
        with print_lock:
            status = "ok" if code == 0 else f"FAILED (exit {code})"
            print(f"==> [{time.monotonic() - started:.0f}s] {job.label}: {status} in {took:.0f} s", flush=True)
            sys.stdout.write(output)
            sys.stdout.flush()
        return job, code, took

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(run, jobs))

    if not harness_args:  # a filtered run's times say nothing of the next whole run's
        history.update({job.label: took for job, code, took in results if code == 0})
        try:
            with open(history_file, "w") as f:
                json.dump(history, f, indent=1, sort_keys=True)
        except OSError:
            pass
    total = time.monotonic() - started
    print(f"==> {len(results)} test jobs, {args.jobs} at a time, in {total:.0f} s (the longest first):")
    for job, code, took in sorted(results, key=lambda r: -r[2]):
        print(f"{took:7.0f} s  {'ok    ' if code == 0 else 'FAILED'}  {job.label}")
    failed = [job.label for job, code, _ in results if code != 0]
    if failed:
        print("run-tests: failed:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
