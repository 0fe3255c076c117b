"""Grade one submitted notebook: one row of the gradebook.

1. Read it, whatever Jupyter wrote it (``formats``; an unreadable file is a row with the reason).
2. Pair its check cells with the distributed ones (``labkit.notebooks.match_check_cells``):
   by cell id, else by the ``# CHECK`` line. A check cell copied to run it again is graded
   where it last appears; a deleted one is graded where it was; what a student changed in one
   is honoured or flagged (``checks.compare``).
3. Read the student's own cells for what reaches the grading machinery (``integrity``).
4. Run it in a sandboxed kernel (``execute``, ``sandbox``), each check cell replaced by an
   answer cell that hands the answers out as plain data (``checks.answer_cell``, ``probe``).
5. Judge each exercise in this process (``judge``): *pass*, *fail* with the grader's hint,
   *not attempted* (the exercise's stub is still there, or raised ``NotImplementedError``),
   or *not run* (the run stopped before its check). A bug-hunt test that passes is run again
   on its own, from its source, in a clean sandbox, and judged on that run (``rerun``).
"""

from __future__ import annotations

import hashlib
import random
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..exercises.points import points
from ..notebooks import STUB_PREFIX, is_check_cell, match_check_cells
from .checks import Check, answer, compare, read_checks
from .collect import Submission
from .execute import Cell, Execution, run_cells
from .formats import Unreadable, load
from .guard import Guard
from .integrity import forbidden
from .judge import PASS as JUDGED_PASS
from .judge import UNANSWERED, judge
from .rerun import Runner, again, run_source
from .sandbox import Sandbox, kernel_env

PASS, FAIL, NOT_ATTEMPTED, NOT_RUN = "pass", "fail", "not attempted", "not run"
HINT_LINES, HINT_CHARS = 2, 300
ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u2028\u2029]")


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
    sandbox: str = ""             # how its kernel was isolated: "bwrap", "unshare", "none"
    peak_mb: float = 0.0          # the most memory its sandbox held at once (as the guard saw it)

    @property
    def points(self) -> int:
        return sum(r.points for r in self.results)

    @property
    def max_points(self) -> int:
        return sum(r.max_points for r in self.results)


@dataclass(slots=True)
class Distributed:
    """A lab notebook as distributed (``notebooks/NAME``), read once for the class."""
    name: str
    checks: list[Check]
    stubs: dict[str, set[str]]    # per exercise, the stub lines before its check cell
    code: list[str]               # its code cells (what a student's own cells may do too)
    nb: object

    @classmethod
    def read(cls, path: Path) -> "Distributed":
        nb = load(path)
        checks = read_checks(nb)
        stubs: dict[str, set[str]] = {c.exercise: set() for c in checks}
        pending: set[str] = set()
        order = iter(checks)
        for cell in nb.cells:
            if is_check_cell(cell):
                stubs[next(order).exercise] = pending
                pending = set()
            elif cell.cell_type == "code":
                pending |= {ln.strip() for ln in cell.source.splitlines() if ln.strip().startswith(STUB_PREFIX)}
        return cls(path.name, checks, stubs, [c.source for c in nb.cells if c.cell_type == "code"], nb)

    @property
    def exercises(self) -> list[str]:
        return [c.exercise for c in self.checks]

    @property
    def graders(self) -> set[str]:
        return {c.name for c in self.checks} | {c.grader.split(":")[1] for c in self.checks}


def one_line(text: str, limit: int = HINT_CHARS, lines: int = HINT_LINES) -> str:
    """The first lines of a message as one plain line: a student's exception may carry ANSI
    colour codes, control characters or line breaks, which no report should pass on."""
    text = CONTROL.sub(" ", ANSI.sub("", text))
    kept = [line.strip() for line in text.splitlines() if line.strip()]
    hint = re.sub(r"\s+", " ", " ".join(kept[:lines]))
    return hint if len(hint) <= limit else hint[:limit - 1] + "…"


def _said(error: tuple[str, str]) -> str:
    """An error as the student should read it: the grader's message, else 'Name: message'."""
    name, message = error
    return one_line(message) if name == "AssertionError" and message.strip() else one_line(f"{name}: {message}")


@dataclass(slots=True)
class _Place:
    """Where an exercise is graded in the submission, and what its check cell became."""
    check: Check
    at: float                     # the submission's cell it stands for (x.5: a deleted one, before cell x+1)
    cells: list[Cell]             # the cells that stand for the check in the run
    plan: dict


def _plan(check: Check, seed: str) -> dict:
    """The inputs a code answer runs on, drawn for this submission (same file, same plan)."""
    make = getattr(check.function(), "plan", None)
    if not callable(make):
        return {}
    digest = hashlib.sha256(f"{check.exercise}\0{seed}".encode()).digest()
    return make(random.Random(int.from_bytes(digest[:8], "big")))


def _places(row: Row, submitted, lab: Distributed, seed: str) -> tuple[dict[str, _Place], set[int], list[int]]:
    """Where each exercise is graded (module docstring, step 2), the check cells not to run
    (earlier copies), and the extra check cells; flags and notes go to ``row``."""
    matches, extra = match_check_cells(submitted, lab.nb)
    positions = [i for i, c in enumerate(submitted.cells) if is_check_cell(c)]
    paired = {m.found for m in matches if m.found is not None}
    places: dict[str, _Place] = {}
    skipped: set[int] = set()
    for check, m in zip(lab.checks, matches):
        copies = [i for i in positions if i not in paired and i not in extra
                  and submitted.cells[i].source.lstrip("\n").splitlines()[0].strip() == m.title]
        found = ([m.found] if m.found is not None else []) + copies
        if not found:
            continue
        at = max(found)
        skipped |= set(found) - {at}
        edit = compare(submitted.cells[at].source, check)
        where = f"check cell {check.exercise}"
        if edit.kind == "call":
            row.flags.append(f"edited {where}: its grader call was changed (graded with the answers it passes)")
        elif edit.kind == "removed":
            row.flags.append(f"edited {where}: its grader call was removed (graded with the distributed one)")
        elif edit.kind == "unreadable":
            row.flags.append(f"edited {where}: not valid Python (graded with the distributed one)")
        elif edit.kind == "added":
            row.notes.append(f"{where} holds code of the student's: it ran just before the check")
        plan = _plan(check, seed)
        cells = [Cell(at, edit.prelude)] if edit.prelude.strip() else []
        comment, expression = answer(check, *((edit.args, edit.kwargs) if edit.kind == "call" else ()), plan=plan)
        cells.append(Cell(at, comment, check.exercise, expression))
        places[check.exercise] = _Place(check, at, cells, plan)
    for k, check in enumerate(lab.checks):                        # deleted: graded where it was
        if check.exercise in places:
            continue
        later = [places[c.exercise].at for c in lab.checks[k + 1:] if c.exercise in places]
        at = min(later) - 0.5 if later else len(submitted.cells)
        row.flags.append(f"check cell {check.exercise} deleted (graded where it was)")
        plan = _plan(check, seed)
        comment, expression = answer(check, plan=plan)
        places[check.exercise] = _Place(check, at, [Cell(int(at), comment, check.exercise, expression)], plan)
    return places, skipped, extra


def prepare(row: Row, submitted, lab: Distributed) -> tuple[list[Cell], dict[str, _Place]]:
    """The cells to run for ``submitted`` (steps 2 and 4 of the module docstring: each check cell
    replaced by its answer cell, at the place it is graded) and the places; what was seen on
    the way (edited check cells, the static reading) goes to ``row``."""
    seed = "\0".join(c.source for c in submitted.cells if c.cell_type == "code")
    places, skipped, extra = _places(row, submitted, lab, seed)
    row.flags += [f"cell {i + 1}: a check cell that is not the lab's" for i in extra]
    answer_at = {p.at: p for p in places.values()}
    cells: list[Cell] = []
    for index, cell in enumerate(submitted.cells):
        for place in sorted((p for p in places.values() if index - 1 < p.at < index), key=lambda p: p.at):
            cells += place.cells                                 # a deleted check, graded where it was
        if index in answer_at:
            cells += answer_at[index].cells
        elif cell.cell_type == "code" and cell.source.strip() and index not in skipped:
            cells.append(Cell(index, cell.source))
    cells += [c for p in places.values() if p.at >= len(submitted.cells) for c in p.cells]
    mine = [(c.index, c.source) for c in cells if c.exercise is None]
    row.flags += [one_line(u.text()) for u in forbidden(mine, lab.code, lab.graders)]
    return cells, places


def grade(sub: Submission, lab: Distributed, submissions: Path, timeout: float, *, box: Sandbox,
          guard: Guard, job: int = 0, workroot: Path | None = None) -> Row:
    """The gradebook row of ``sub``, graded against ``lab`` in ``box``."""
    start = time.monotonic()
    row = Row(sub.student, sub.notebook, str(sub.path.relative_to(submissions)) if sub.path else "",
              sandbox=box.kind)
    if not sub.known:
        row.flags.append(sub.problem)
        return row
    row.results = [Result(e, NOT_RUN, points(e)) for e in lab.exercises]
    if sub.renamed:
        row.notes.append(f"graded as {sub.notebook}: {sub.renamed} holds its check cells")
    if sub.ignored:
        row.notes.append(f"ignored older files of this notebook: {', '.join(sub.ignored)}")
    if sub.path is None:
        row.notes.append("missing: not handed in")
        return row
    try:
        submitted = load(sub.path)
    except Unreadable as e:
        row.notes.append(f"corrupt: {one_line(str(e), 200)}")
        return row

    cells, places = prepare(row, submitted, lab)
    workdir = Path(tempfile.mkdtemp(prefix=f"{job}-", dir=workroot))
    try:
        env = kernel_env(box.plan) if box.kind != "none" else kernel_env(box.plan, home=str(workdir / "home"))
        if box.kind == "none":
            (workdir / "home" / "notebook").mkdir(parents=True)
        run = run_cells(cells, box, workdir, timeout, guard=guard, job=job, env=env)
    except Exception as e:   # noqa: BLE001 - a kernel that cannot start: this row says so, the run goes on
        row.notes.append(f"could not run: {type(e).__name__}: {one_line(str(e))}")
        return row
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def run_again(grader: str, source: str, name: str, plan: dict):
        return run_source(box, guard, workroot, job, timeout, grader, source, name, plan)

    _verdicts(row, cells, places, lab, run, timeout, run_again)
    row.seconds, row.peak_mb = round(time.monotonic() - start, 1), round(run.peak_mb)
    return row


def _verdicts(row: Row, cells: list[Cell], places: dict[str, _Place], lab: Distributed, run: Execution,
              timeout: float, run_again: Runner | None = None) -> None:
    """Fill ``row`` from what ran and what the answer cells handed in."""
    slot = {c.exercise: k for k, c in enumerate(cells) if c.exercise}
    answers = sorted(slot.values())
    explained: set[int] = set()
    for result in row.results:
        k = slot[result.exercise]
        place = places[result.exercise]
        start = max((a for a in answers if a < k), default=-1) + 1
        region = [j for j in range(start, k) if cells[j].exercise is None]   # the exercise's own cells
        answer = run.cells.get(k)
        if answer is None or (k == run.stopped_at and not answer.timed_out):
            continue                                          # NOT_RUN: the run stopped before it
        if answer.timed_out:
            result.status, result.hint = FAIL, f"cell {answer.index + 1} ran past the {timeout:g} s timeout"
            continue
        handed = run.answers.get(result.exercise, [])
        verdict = again(place.check, judge(place.check, handed, place.plan), handed, place.plan, lab.code,
                        lab.graders, run_again)
        row.flags += [one_line(f"check {result.exercise}: {s}") for s in verdict.seen]
        stub_left = any(line.strip() in lab.stubs[result.exercise] for j in region
                        for line in cells[j].source.splitlines())
        raised = [run.cells[j] for j in region if j in run.cells and run.cells[j].error]
        not_implemented = any(r.error[0] == "NotImplementedError" for r in raised)
        if verdict.status == JUDGED_PASS:
            result.status = PASS
        elif verdict.status == UNANSWERED and (stub_left or not_implemented):
            result.status = NOT_ATTEMPTED
        elif verdict.status == UNANSWERED:
            result.status = FAIL
            late = [r for r in raised if r.timed_out]
            if late:
                result.hint = f"cell {late[0].index + 1} ran past the {timeout:g} s timeout"
            elif raised:
                result.hint = f"cell {raised[-1].index + 1} raised {_said(raised[-1].error)}"
                explained.add(raised[-1].index)               # said here, not again in the notes
            else:
                result.hint = f"not answered: {one_line(verdict.hint)}"
        elif (stub_left or not_implemented) and "NotImplementedError" in verdict.hint:
            result.status = NOT_ATTEMPTED
        else:
            result.status, result.hint = FAIL, one_line(verdict.hint)
    for k, cell in run.cells.items():
        if cell.timed_out:
            row.flags.append(f"cell {cell.index + 1} ran past the {timeout:g} s timeout")
        elif cell.error and cell.index not in explained and cell.exercise is None \
                and cell.error[0] != "NotImplementedError" and k != run.stopped_at:
            row.notes.append(f"cell {cell.index + 1} raised {_said(cell.error)}")
    if run.limit:
        row.flags.append(f"stopped: it {run.limit}")
    elif run.stopped:
        row.notes.append(run.stopped)
