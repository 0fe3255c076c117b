"""Shared test setup: GPU tests skip with a printed reason on machines without CUDA."""

from __future__ import annotations

import os

import pytest

# Before torch: labkit sets OpenMP's short spin for this process and for every notebook kernel
# and subprocess the tests start, which inherit it (labkit/openmp.py).
import labkit  # noqa: F401,E402

# Triton's interpreter must be chosen before any kernel is decorated: decide once, here,
# before a test module imports labkit.kernels.
try:
    import torch
    _HAS_CUDA = torch.cuda.is_available()
except ImportError:          # pragma: no cover - torch is a dependency
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (``make test`` runs one worker per core), each worker's torch gets its
# share of the cores: two workers each running two-thread matmuls on two cores would spend
# their time preempting each other's OpenMP threads.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
# The notebook kernels, servers and scripts the tests start get the same share (OMP_NUM_THREADS,
# which they inherit; a value already set is kept): measured on 2 cores, four notebook runs on
# two workers took 195 s with one thread each, 212 s with torch's default of two.
if _WORKERS > 1:
    _SHARE = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_SHARE)
    os.environ.setdefault("OMP_NUM_THREADS", str(_SHARE))

# The hostile class's attack cells are data for tests/test_grade_hostile.py, not tests: two of
# them are named *_test.py, which pytest would otherwise collect.
collect_ignore = ["grade_fixtures"]

NO_GPU_REASON = "no CUDA GPU on this machine: compiled Triton kernels need one (CPU runs the interpreter tests)"


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason=NO_GPU_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config):
    return f"labkit: CUDA {'available' if _HAS_CUDA else 'not available: gpu tests skip'}"


# LABKIT_TEST_TIMELINE=DIR (an empty folder: lines are appended): each worker writes
# DIR/<worker>.tsv, one line per test phase (worker, start, end, phase, test; seconds since the
# epoch): where a worker waits, and on what. `python tests/timeline.py DIR` sums each worker's
# busy and idle time and lists the longest gaps. (Absolute: some tests change directory.)
_TIMELINE = os.path.abspath(os.environ["LABKIT_TEST_TIMELINE"]) if os.environ.get("LABKIT_TEST_TIMELINE") else None
if _TIMELINE:
    import time

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(item):
        return (yield from _timed(item, "setup"))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(item):
        return (yield from _timed(item, "call"))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(item, nextitem):
        return (yield from _timed(item, "teardown"))

    def _timed(item, phase):
        start = time.time()
        try:
            return (yield)
        finally:
            worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
            os.makedirs(_TIMELINE, exist_ok=True)
            with open(os.path.join(_TIMELINE, f"{worker}.tsv"), "a") as out:
                out.write(f"{worker}\t{start:.3f}\t{time.time():.3f}\t{phase}\t{item.nodeid}\n")
