"""Grade one submitted notebook: one row of the gradebook.

1. Read it (a corrupt file is a row with the reason); find the distributed notebook of the
   same name (``notebooks/``).
2. Pair its check cells with the distributed ones (``labkit.notebooks.match_check_cells``) and
   put the distributed text back in each: an edited check cell is flagged and graded by the
   original, a deleted one fails its exercise.
3. Read the student's own cells for uses of the graders' internals (``integrity``).
4. Run it in a fresh kernel in a scratch folder (``execute``).
5. Each ``# CHECK exercise X.Y`` cell gives its exercise's result: *pass* (it ran), *not
   attempted* (the exercise's stub raised ``NotImplementedError``, in its own cell or inside
   the check that called it: the stub and its check count once), *fail* with the grader's hint (the first lines of its
   ``AssertionError``), or *not run* (the kernel died before it).
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from ..exercises.points import points
from ..notebooks import STUB_PREFIX, exercise_id, is_check_cell, match_check_cells, read
from .collect import Submission, exercises_of
from .execute import Execution, run_notebook
from .integrity import forbidden

PASS, FAIL, NOT_ATTEMPTED, NOT_RUN = "pass", "fail", "not attempted", "not run"
HINT_LINES, HINT_CHARS = 2, 300
ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


@dataclass(slots=True)
class Result:
    """One exercise of one submission."""
    exercise: str                 # "2.1"
    status: str                   # PASS, FAIL, NOT_ATTEMPTED or NOT_RUN
    max_points: int
    hint: str = ""                # why it failed: the grader's words

    @property
    def points(self) -> int:
        return self.max_points if self.status == PASS else 0


@dataclass(slots=True)
class Row:
    """One student's one notebook: results per exercise, integrity flags, and notes on
    anything that kept it from being graded in full."""
    student: str
    notebook: str
    file: str                     # the submitted file, relative to the submissions folder
    results: list[Result] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def points(self) -> int:
        return sum(r.points for r in self.results)

    @property
    def max_points(self) -> int:
        return sum(r.max_points for r in self.results)


def exercise_ids(nb) -> list[str]:
    """The exercises of a distributed notebook, in the order of its check cells."""
    for cell in nb.cells:
        if is_check_cell(cell) and exercise_id(cell) is None:
            raise ValueError(f"check cell {cell.source.splitlines()[0]!r} does not name its "
                             "exercise: write '# CHECK exercise X.Y'")
    return exercises_of(nb)


def _hint(text: str) -> str:
    """The first lines of a message, as plain text: a student's exception may carry ANSI
    colour codes or control characters, which no report should pass on."""
    text = CONTROL.sub("", ANSI.sub("", text))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    hint = " ".join(lines[:HINT_LINES])
    return hint if len(hint) <= HINT_CHARS else hint[:HINT_CHARS - 1] + "…"


def _said(error: tuple[str, str]) -> str:
    """An error as the student should read it: the grader's message, else 'Name: message'."""
    name, message = error
    return _hint(message) if name == "AssertionError" and message.strip() else _hint(f"{name}: {message}")


def _stub_lines(distributed, ids: list[str]) -> dict[str, set[str]]:
    """Per exercise, the stub lines the student notebook was given before its check cell."""
    stubs: dict[str, set[str]] = {i: set() for i in ids}
    checks = iter(ids)
    current: set[str] = set()
    for cell in distributed.cells:
        if is_check_cell(cell):
            stubs[next(checks)] = current
            current = set()
        elif cell.cell_type == "code":
            current |= {line.strip() for line in cell.source.splitlines() if line.strip().startswith(STUB_PREFIX)}
    return stubs


def grade(sub: Submission, notebooks: Path, submissions: Path, timeout: float,
          env: dict[str, str] | None = None) -> Row:
    """The gradebook row of ``sub``; ``notebooks`` holds the distributed notebooks."""
    start = time.monotonic()
    row = Row(sub.student, sub.notebook, str(sub.path.relative_to(submissions)) if sub.path else "")
    if not sub.known:
        row.flags.append(sub.problem)
        return row
    distributed = read(notebooks / sub.notebook)
    ids = exercise_ids(distributed)
    row.results = [Result(i, NOT_RUN, points(i)) for i in ids]
    if sub.renamed:
        row.notes.append(f"graded as {sub.notebook}: {sub.renamed} holds its check cells")
    if sub.path is None:
        row.notes.append("missing: not handed in")
        return row
    try:
        submitted = read(sub.path)
        for cell in submitted.cells:           # what it stored is not graded; only its code runs
            if cell.get("cell_type") == "code":
                cell.outputs, cell.execution_count = [], None
        nbformat.validate(submitted, relax_add_props=True)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError,
            nbformat.ValidationError) as e:
        row.notes.append(f"corrupt: not a readable notebook ({type(e).__name__}: {_hint(str(e))[:120]})")
        return row

    matches, extra = match_check_cells(submitted, distributed)
    checks = {m.found for m in matches if m.found is not None}
    for exercise, m in zip(ids, matches):
        if m.found is None:
            row.flags.append(f"check cell {exercise} deleted")
        else:
            if m.edited:
                row.flags.append(f"edited check cell {exercise} (graded with the distributed one)")
            cell = submitted.cells[m.found]
            submitted.cells[m.found] = nbformat.v4.new_code_cell(m.source, id=cell.get("id") or None)
    row.flags += [f"cell {i + 1}: a check cell that is not the lab's" for i in extra]
    mine = [(i, c.source) for i, c in enumerate(submitted.cells) if c.cell_type == "code" and i not in checks]
    theirs = [c.source for c in distributed.cells if c.cell_type == "code" and not is_check_cell(c)]
    for use in forbidden(mine, theirs):
        row.flags.append(f"cell {use.cell + 1} {use.how} {_hint(use.what)}")

    workdir = Path(tempfile.mkdtemp(prefix="labkit-grade-"))
    try:
        nbformat.write(submitted, workdir / sub.notebook)
        run = run_notebook(submitted, workdir, timeout, env=env)
    except Exception as e:   # noqa: BLE001 - a kernel that cannot start: this row says so, the run goes on
        row.notes.append(f"could not run: {type(e).__name__}: {_hint(str(e))}")
        return row
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    _verdicts(row, submitted, matches, _stub_lines(distributed, ids), run, timeout)
    row.seconds = round(time.monotonic() - start, 1)
    return row


def _verdicts(row: Row, nb, matches, stubs: dict[str, set[str]], run: Execution, timeout: float) -> None:
    """Fill ``row`` from what ran."""
    checks = sorted(m.found for m in matches if m.found is not None)
    explained: set[int] = set()
    for result, m in zip(row.results, matches):
        if m.found is None:
            result.status, result.hint = FAIL, "its check cell was deleted"
            continue
        before = max((c for c in checks if c < m.found), default=-1)
        region = [i for i in range(before + 1, m.found) if i in run.cells]
        check = run.cells.get(m.found)
        if check is None or (m.found == run.stopped_at and not check.timed_out):
            continue                                          # NOT_RUN: the run stopped before it
        if check.error is None:
            result.status = PASS
            continue
        stub_left = any(line.strip() in stubs[result.exercise]
                        for i in range(before + 1, m.found) if nb.cells[i].cell_type == "code"
                        for line in nb.cells[i].source.splitlines())
        raised = [run.cells[i] for i in region if run.cells[i].error]
        # Not attempted: a stub raised, in its own cell (a value) or inside the check (a function
        # the grader called, which graders report as "still raises NotImplementedError").
        if any(r.error[0] == "NotImplementedError" for r in [*raised, check]) or (
                stub_left and "NotImplementedError" in check.error[1]):
            result.status = NOT_ATTEMPTED
            continue
        result.status = FAIL
        late = [r for r in [*raised, check] if r.timed_out]
        if late:
            result.hint = f"cell {late[0].index + 1} ran past the {timeout:g} s timeout"
        elif check.error[0] == "NameError" and raised:
            result.hint = f"cell {raised[-1].index + 1} raised {_said(raised[-1].error)}"
            explained.add(raised[-1].index)                   # said here, not again in the notes
        else:
            result.hint = _said(check.error)
    for cell in run.cells.values():
        if cell.timed_out:
            row.flags.append(f"cell {cell.index + 1} ran past the {timeout:g} s timeout")
        elif cell.error and cell.index not in explained and cell.index not in checks \
                and cell.error[0] != "NotImplementedError" and cell.index != run.stopped_at:
            row.notes.append(f"cell {cell.index + 1} raised {_said(cell.error)}")
    if run.stopped:
        row.notes.append(run.stopped)

