#!/usr/bin/env python3
"""Runs `cargo test --workspace` with its test executables in parallel.

The end-to-end tests spend most of their time waiting (for a cluster, a drain deadline, a
pause): with cargo's one executable at a time the machine was 80-90% idle through the test
step. This builds every test executable once (`cargo test --workspace --no-run`), then runs
one `cargo test -p PACKAGE --lib|--bin NAME|--test NAME` per executable (and one for the doc
tests), JOBS at a time, longest first (by the durations of the last run, kept in the target
folder). Each job's output is printed whole when it ends, so logs never interleave; a table
of the jobs' times and the failures close the run.

Usage: run-tests.py [--jobs N] [--timeout SECONDS] [CARGO TEST ARGS...]
The cargo test arguments (a filter, `-- --nocapture`) go to every job.
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
    return {p["manifest_path"]: p["name"] for p in meta["packages"]}, meta["target_directory"]


def test_jobs(packages, extra):
    """Builds the test executables; returns one cargo test command per executable, and the doc tests."""
    build = subprocess.run(
        ["cargo", "test", "--workspace", "--no-run", "--message-format=json-render-diagnostics"],
        stdout=subprocess.PIPE,
        text=True,
    )
    if build.returncode != 0:
        sys.exit("run-tests: the test build failed (above)")
    jobs = []
    for line in build.stdout.splitlines():
        msg = json.loads(line)
        if msg.get("reason") != "compiler-artifact" or not msg["profile"]["test"] or not msg.get("executable"):
            continue
        package = packages[msg["manifest_path"]]
        kind = msg["target"]["kind"][0]
        name = msg["target"]["name"]
        selector = {"lib": ["--lib"], "bin": ["--bin", name], "test": ["--test", name]}.get(kind)
        if selector is None:
            sys.exit(f"run-tests: a test executable of an unknown kind: {kind} {name} of {package}")
        jobs.append(["cargo", "test", "-p", package, *selector, *extra])
    jobs.append(["cargo", "test", "--workspace", "--doc", *extra])
    return jobs


def main():
    parser = argparse.ArgumentParser(add_help=True, description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("TEST_JOBS", "3")))
    # Every await of a test is bounded; this bounds a job that hangs outside them.
    parser.add_argument("--timeout", type=int, default=1800)
    args, extra = parser.parse_known_args()
    packages, target = workspace()
    jobs = test_jobs(packages, extra)
    history_file = os.path.join(target, "test-durations.json")
    try:
        with open(history_file) as f:
            history = json.load(f)
    except (OSError, ValueError):
        history = {}
    key = lambda cmd: " ".join(cmd[2:len(cmd) - len(extra)])  # noqa: E731
    # Longest first; a job never timed (a new test file) counts as long.
    jobs.sort(key=lambda cmd: -history.get(key(cmd), 600))

    print_lock = threading.Lock()
    started = time.monotonic()

    def run(cmd):
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=args.timeout)
            output, code = p.stdout.decode(errors="replace"), p.returncode
        except subprocess.TimeoutExpired as e:
            output = (e.stdout or b"").decode(errors="replace") + f"\nrun-tests: killed after {args.timeout} s\n"
            code = -1
        took = time.monotonic() - t0
        with print_lock:
            status = "ok" if code == 0 else f"FAILED (exit {code})"
            print(f"==> [{time.monotonic() - started:.0f}s] {' '.join(cmd)}: {status} in {took:.0f} s", flush=True)
            sys.stdout.write(output)
            sys.stdout.flush()
        return cmd, code, took

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(run, jobs))

    history.update({key(cmd): took for cmd, code, took in results if code == 0})
    try:
        with open(history_file, "w") as f:
            json.dump(history, f, indent=1, sort_keys=True)
    except OSError:
        pass
    total = time.monotonic() - started
    print(f"==> {len(results)} test jobs, {args.jobs} at a time, in {total:.0f} s (the longest first):")
    for cmd, code, took in sorted(results, key=lambda r: -r[2]):
        print(f"{took:7.0f} s  {'ok    ' if code == 0 else 'FAILED'}  {' '.join(cmd)}")
    failed = [" ".join(cmd) for cmd, code, _ in results if code != 0]
    if failed:
        print("run-tests: failed:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
