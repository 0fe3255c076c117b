"""Grade a class: every submission in a sandboxed kernel of its own, ``jobs`` at a time.

Before the first kernel starts: the lab's notebooks are read (their check cells, graders and
stubs), every grader is imported into this process (where grades are decided), the sandbox
is chosen by trying each kind for real (``sandbox.detect``), the model and the C++ kernels a
chapter needs are prepared once (thirty kernels must not race to build them, and a sandbox
could not write them anyway), and the installation's files are fingerprinted.

Each notebook is then graded by ``notebook.grade`` in a worker thread of this process; its
kernel runs in its own sandbox, under job ``k``'s uid where the grader is root, watched by
one ``guard``. Whatever a notebook does (loop, exit, crash, flood, fork, delete) ends in its
own row; a failure of the grading itself becomes that row's note. After the last one, the
fingerprint is taken again: a change (impossible from a sandbox) is reported loudly.
"""

from __future__ import annotations

import hashlib
import os
import queue
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..notebooks import Paths, find_root, needs_model
from .collect import Submission, collect, exercises_of
from .formats import load
from .guard import Guard
from .notebook import Distributed, Row, grade, one_line
from .sandbox import Limits, Sandbox, detect, make_plan


@dataclass(slots=True)
class Gradebook:
    """Every row of a grading run, the exercise columns in the lab's order, and how the
    kernels were isolated (``sandbox``: the kind and what ``detect`` found)."""
    rows: list[Row]
    exercises: list[str]
    seconds: float
    jobs: int
    sandbox: str = ""
    warnings: list[str] = field(default_factory=list)


def fingerprint(paths: list[Path]) -> dict[str, str]:
    """sha256 of every file under ``paths`` (caches aside)."""
    out = {}
    for base in paths:
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for p in files:
            if "__pycache__" in p.parts or p.suffix == ".pyc":
                continue
            try:
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
            except OSError:
                out[str(p)] = "unreadable"
    return out


def installation(paths: Paths) -> list[Path]:
    """What no notebook may change: labkit's package folders, the lab's notebooks and solutions,
    and the import hooks of this Python (``.pth`` files, ``sitecustomize``)."""
    import site

    import labkit
    import labkit.kernels
    found = [Path(p) for p in (*labkit.__path__, *labkit.kernels.__path__)] + [paths.solutions, paths.notebooks]
    for folder in {*site.getsitepackages(), site.getusersitepackages()}:
        folder = Path(folder)
        if folder.is_dir():
            found += [p for p in folder.iterdir() if p.suffix == ".pth" or p.stem in ("sitecustomize", "usercustomize")]
    return [p for p in found if p.exists()]


def grade_class(submissions: Path, *, root: Path | None = None, jobs: int = 1, timeout: float = 300,
                only: set[str] | None = None, sandbox: str = "auto", limits: Limits = Limits(),
                on_row: Callable[[Row, int, int], None] | None = None,
                on_sandbox: Callable[[Sandbox, list[str]], None] | None = None) -> Gradebook:
    """Grade every notebook under ``submissions`` (see ``collect`` for the layouts) against
    the distributed notebooks of the checkout ``root``. ``sandbox``: "auto" or a kind of
    ``sandbox.KINDS``; ``on_sandbox(box, tried)`` is told what was chosen before the first
    kernel starts, ``on_row(row, done, total)`` as each row is ready."""
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    start = time.monotonic()
    paths = Paths(Path(root).resolve() if root else find_root())
    lab = {p.name: exercises_of(load(p)) for p in sorted(paths.notebooks.glob("*.ipynb"))}
    if only is not None and only - set(lab):
        raise ValueError(f"not notebooks of the lab: {', '.join(sorted(only - set(lab)))}")
    submissions = Path(submissions).resolve()
    subs = collect(submissions, lab, only)
    if not subs:
        raise FileNotFoundError(f"{submissions}: no .ipynb files found")
    graded = sorted({s.notebook for s in subs if s.known})
    chapters = {name: Distributed.read(paths.notebooks / name) for name in graded}
    for chapter in chapters.values():               # every grader imported here, before any kernel runs
        for check in chapter.checks:
            check.function()
    workroot = Path(tempfile.mkdtemp(prefix="labkit-grade-"))
    hidden = [paths.solutions, paths.root / ".git", submissions, workroot]
    uses_engine = any(needs_model((paths.notebooks / n).read_text(encoding="utf-8")) for n in graded)
    extension = _prepare(uses_engine)
    import labkit
    try:
        box, tried = detect(sandbox, plan=make_plan(hidden, extension, paths.root), limits=limits,
                            forbidden=[str(paths.solutions), str(submissions)], readonly=labkit.__path__[0])
        if box.drop_uid:
            os.chmod(workroot, 0o711)              # the jobs' uids reach their own folders in it, and list none
        if on_sandbox:
            on_sandbox(box, tried)                 # (which may refuse it: nothing has run yet)
    except BaseException:
        shutil.rmtree(workroot, ignore_errors=True)
        raise
    before = fingerprint(installation(paths))
    guard = Guard()
    slots: queue.Queue[int] = queue.Queue()
    for k in range(jobs):
        slots.put(k)
    rows: list[Row] = []

    def one(sub: Submission) -> Row:
        job = slots.get()
        try:
            return _grade_one(sub, chapters, submissions, timeout, box, guard, job, workroot)
        finally:
            slots.put(job)

    pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="grade")
    try:
        futures = [pool.submit(one, s) for s in subs]
        for future in as_completed(futures):
            rows.append(future.result())
            if on_row:
                on_row(rows[-1], len(rows), len(subs))
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)      # start no other notebook
        raise
    finally:
        pool.shutdown()
        guard.close()
        shutil.rmtree(workroot, ignore_errors=True)
    rows.sort(key=lambda r: (r.student, r.notebook, r.file))
    after = fingerprint(installation(paths))
    warnings = []
    if box.kind == "none":
        warnings.append(f"NO SANDBOX: students' code ran with your permissions ({box.detail})")
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    if changed:
        warnings.append(f"files of the installation changed while grading: {', '.join(changed[:10])}"
                        + (f" and {len(changed) - 10} more" if len(changed) > 10 else ""))
    exercises = [e for name in graded for e in chapters[name].exercises]
    return Gradebook(rows, exercises, time.monotonic() - start, jobs, f"{box.kind} ({box.detail})", warnings)


def _prepare(uses_engine: bool) -> str | None:
    """Fetch the default model and build the C++ CPU kernels once, if a graded notebook runs
    the engine; returns the kernels' build folder to copy into each sandbox (or None)."""
    if not uses_engine:
        return None
    try:
        from ..model.loader import fetch_default_model
        fetch_default_model()
    except Exception as e:   # noqa: BLE001 - the notebooks that need it will fail and say so
        print(f"warning: the default model is not available ({type(e).__name__}); "
              "notebooks that load it will fail", file=sys.stderr)
    try:
        from torch.utils.cpp_extension import _get_build_directory

        from ..kernels import cpu_extension
        if cpu_extension.load() is None:
            return None
        build = Path(_get_build_directory(cpu_extension.build_name(), verbose=False))
        return str(build) if any(build.glob("*.so")) else None
    except Exception:   # noqa: BLE001 - without them the kernels use the Numba ones
        return None


def _grade_one(sub: Submission, chapters: dict[str, Distributed], submissions: Path, timeout: float,
               box: Sandbox, guard: Guard, job: int, workroot: Path) -> Row:
    """``grade(sub)``, or a row saying why grading it failed: one notebook never stops the class."""
    try:
        lab = chapters.get(sub.notebook)
        if lab is None:                         # an unknown notebook: grade() only records why
            return grade(sub, Distributed(sub.notebook, [], {}, [], None), submissions, timeout, box=box,
                         guard=guard, job=job, workroot=workroot)
        return grade(sub, lab, submissions, timeout, box=box, guard=guard, job=job, workroot=workroot)
    except Exception as e:   # noqa: BLE001 - reported in the row, the run goes on
        file = str(sub.path.relative_to(submissions)) if sub.path else ""
        return Row(sub.student, sub.notebook, file, notes=[one_line(f"grading failed: {type(e).__name__}: {e}")],
                   sandbox=box.kind)
