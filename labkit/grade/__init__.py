"""Grade a class's notebooks into a gradebook: ``python -m labkit.grade SUBMISSIONS``.

Every submitted notebook runs top to bottom in a fresh kernel in a sandbox of its own
(bubblewrap, or ``unshare``; said loudly where neither works), with limits on time, memory
and output. Each ``# CHECK exercise X.Y`` cell hands that exercise's answers out of the kernel
as plain data, and the exercise's grader judges them here, in the grading process, where the
student's code cannot reach; weights come from ``labkit.exercises.points``. What a notebook
did to reach the grading machinery becomes a flag. The result is one row per student and
notebook, as CSV, HTML and a summary on the terminal. See docs/grading.md (the threat model
included).

Modules, in the order a submission meets them: ``collect`` (who handed in what), ``formats``
(every nbformat a student can hand in), ``notebook`` (one submission), ``checks`` (check cells
read, answer cells written), ``integrity`` (static flags), ``sandbox``, ``jail`` and ``guard``
(isolation and limits), ``execute`` (the kernel), ``probe`` (the kernel's side of an answer
cell), ``judge`` (the verdict, outside the kernel), ``run`` (the class), ``report`` (CSV, HTML,
terminal).

This package's attributes load lazily: a kernel that imports ``labkit.grade.probe`` loads
that module and ``collect`` (which shares its function's name), not the grading machinery.
"""

import importlib

from .collect import Submission, collect

_EXPORTS = {
    "grade_class": "run", "Gradebook": "run", "Row": "notebook", "Result": "notebook",
    "PASS": "notebook", "FAIL": "notebook", "NOT_ATTEMPTED": "notebook", "NOT_RUN": "notebook",
    "csv_text": "report", "html_text": "report",
    "summary": "report", "Limits": "sandbox",
}
__all__ = [*_EXPORTS, "Submission", "collect"]     # a plain list, so linters see the re-exports as public
__all__.sort()


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
