"""What the tests compute once per run, across pytest-xdist workers."""

from __future__ import annotations

import os


def computed_once(tmp_path_factory, name: str, compute):
    """``compute()``'s result (JSON), computed once per test run however many pytest-xdist workers
    ask: the first computes it under a lock on a file in the run's shared temporary folder, the
    others wait for it and read what it wrote. (A module-scoped fixture is set up in every
    worker that runs one of its tests: the SmolLM2 references would be computed twice.)"""
    import fcntl
    import json
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = shared / f"{name}.json"
    with open(shared / f"{name}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if path.exists():
                return json.loads(path.read_text())
            value = compute()
            path.write_text(json.dumps(value))
            return value
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
