#!/usr/bin/env python3
"""Prints the packed-cache dictionary (dictionary.json) from an embedded store file: one stored
object of each kind, as the controller wrote it. See README.md beside this file.

Usage: python3 make-dictionary.py STORE.db > dictionary.json
"""
import json
import sqlite3
import sys


def pick(db, kind, want=lambda o: True):
    for (body,) in db.execute("SELECT body FROM objects WHERE kind = ? ORDER BY name", (kind,)):
        obj = json.loads(body)
        if want(obj):
            return body
    sys.exit(f"the store holds no {kind} to take")


def main():
    db = sqlite3.connect(f"file:{sys.argv[1]}?mode=ro", uri=True)
    lines = [
        pick(db, "MachineClass"),
        pick(db, "MachinePool"),
        pick(db, "MachineHealthCheck"),
        pick(db, "MachineDeployment"),
        # A pool's Machine, then a deployment's Running Machine last: Machines are most of the
        # cache, and zstd reaches the end of a dictionary with the shortest offsets.
        pick(db, "Machine", lambda o: "poolRef" in o.get("spec", {})),
        pick(db, "Machine", lambda o: o.get("status", {}).get("phase") == "Running"
             and "poolRef" not in o.get("spec", {})),
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
