"""Grade a class: every submission in a fresh kernel of its own, ``jobs`` at a time.

Each notebook is graded by ``notebook.grade`` in a worker thread of this process; what the
student's code does happens in the kernel, a separate process started for that notebook alone
and shut down after it, in a scratch folder of its own. Whatever a notebook does (loop, exit,
crash, delete files) ends in its own row; a failure of the grading itself becomes that row's
note. (Threads, not processes: the kernels already isolate the students, and a process per
notebook would import Jupyter's client libraries thirty times over.)
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..notebooks import Paths, find_root, needs_model, read
from .collect import Submission, exercises_of, collect
from .execute import kernel_env
from .notebook import Row, exercise_ids, grade


@dataclass(slots=True)
class Gradebook:
    """Every row of a grading run and the exercise columns, in the lab's order."""
    rows: list[Row]
    exercises: list[str]
    seconds: float
    jobs: int


def grade_class(submissions: Path, *, root: Path | None = None, jobs: int = 1, timeout: float = 300,
                only: set[str] | None = None,
                on_row: Callable[[Row, int, int], None] | None = None) -> Gradebook:
    """Grade every notebook under ``submissions`` (see ``collect`` for the layouts) against
    the distributed notebooks of the checkout ``root``; ``on_row(row, done, total)`` is
    called as each row is ready."""
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    start = time.monotonic()
    paths = Paths(Path(root).resolve() if root else find_root())
    lab = {p.name: exercises_of(read(p)) for p in sorted(paths.notebooks.glob("*.ipynb"))}
    if only is not None and only - set(lab):
        raise ValueError(f"not notebooks of the lab: {', '.join(sorted(only - set(lab)))}")
    submissions = Path(submissions).resolve()
    subs = collect(submissions, lab, only)
    if not subs:
        raise FileNotFoundError(f"{submissions}: no .ipynb files found")
    graded = sorted({s.notebook for s in subs if s.known})
    _ensure_model(paths, graded)
    env = kernel_env(jobs)
    rows: list[Row] = []
    pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="grade")
    try:
        futures = [pool.submit(_grade_one, s, paths, submissions, timeout, env) for s in subs]
        for future in as_completed(futures):
            rows.append(future.result())
            if on_row:
                on_row(rows[-1], len(rows), len(subs))
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)      # start no other notebook
        raise
    pool.shutdown()
    rows.sort(key=lambda r: (r.student, r.notebook, r.file))
    twice = Counter((r.student, r.notebook) for r in rows if r.file)
    for row in rows:
        if twice[row.student, row.notebook] > 1:
            row.flags.append(f"{twice[row.student, row.notebook]} files of this notebook handed in: each graded")
    exercises = [e for name in graded for e in exercise_ids(read(paths.notebooks / name))]
    return Gradebook(rows, exercises, time.monotonic() - start, jobs)


def _ensure_model(paths: Paths, graded: list[str]) -> None:
    """Fetch the default model once, before the kernels start, if a graded notebook loads
    it: thirty kernels must read it from the cache, not race to download it."""
    if not any(needs_model((paths.notebooks / n).read_text(encoding="utf-8")) for n in graded):
        return
    try:
        from ..model.loader import fetch_default_model
        fetch_default_model()
    except Exception as e:   # noqa: BLE001 - the notebooks that need it will fail and say so
        print(f"warning: the default model is not available ({type(e).__name__}); "
              "notebooks that load it will fail", file=sys.stderr)


def _grade_one(sub: Submission, paths: Paths, submissions: Path, timeout: float,
               env: dict[str, str]) -> Row:
    """``grade(sub)``, or a row saying why grading it failed: one notebook never stops the class."""
    try:
        return grade(sub, paths.notebooks, submissions, timeout, env=env)
    except Exception as e:   # noqa: BLE001 - reported in the row, the run goes on
        file = str(sub.path.relative_to(submissions)) if sub.path else ""
        return Row(sub.student, sub.notebook, file, notes=[f"grading failed: {type(e).__name__}: {e}"[:300]])
