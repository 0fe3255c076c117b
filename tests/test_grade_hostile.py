"""A class where some students attack the gradebook (tests/grade_fixtures/hostile/), graded twice.

The attackers do everything issue 26 found working against the old grader (patch the graders
through the editable install, kill other kernels from a setsid child, signal the grader, empty
the check cells with IPython's input or AST transformers, replace graders on their module or in
``sys.modules`` under a computed name, replace ``builtins.__import__``, run the solutions from
disk) and more (fork bombs, memory over many processes, output floods, full disks, the kernel's
connection folder, snooping for secrets and other submissions, forged answers in ordinary
cells, answers built to break a grader, tests that count their calls or read the
implementations' code, a forged in-kernel probe). The honest students hand in what honest
students do: solved, unsolved, half right, comments and blank lines in check cells, a check cell
run twice (copied) or moved, names that start with ``check``, an answer typed at the top of a
check cell, nbformat 4.4 without cell ids, Colab's nbformat 4.0, two files of one notebook, a
name a spreadsheet would run as a formula.

Graded twice (the whole class, where a few attackers' files are handed in twice under two
names; the honest students alone, the same files), it must show that:

* each honest student's row is the same with all the attackers in the class and without any
  (which also grades the same notebooks twice);
* an attacker's two copies get the same row (but for the name);
* no attack earns a point its notebook did not earn: not a kernel rewritten against labkit's
  grading to report what a right test would have done (a test that passes is run again on its
  own, from its source, in a clean sandbox), nor a test that recognises the implementations by
  reading their code (its source reaches for closures: it is not run, and fails);
* every attack that reaches for the grading machinery is flagged, every limit hit is named;
* the checkout (and this Python's import hooks) is byte-identical afterwards, but for the
  bytecode caches Python writes itself (none of which carries the attacks' marker; compared in
  full wherever nobody is editing the checkout meanwhile: see ``_edited``), and no process of
  theirs outlives the run.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

from labkit.grade import csv_text, grade_class  # noqa: E402
from labkit.grade.run import fingerprint, installation  # noqa: E402
from labkit.grade.sandbox import Limits  # noqa: E402
from labkit.notebooks import (Paths, is_check_cell, is_install_cell, is_solution_cell, is_stub_cell,  # noqa: E402
                              read)

pytestmark = [pytest.mark.slow, pytest.mark.notebook]

ROOT = Path(__file__).resolve().parent.parent
PATHS = Paths(ROOT)
CHAPTER = "02_paging.ipynb"
ATTACKS = ROOT / "tests" / "grade_fixtures" / "hostile"
MARKER = "LABKIT-HOSTILE"
SECRET = "LABKIT-HOSTILE-secret"
LIMITS = Limits(memory_mb=1536, output_mb=2, scratch_mb=64, processes=256, wall_s=600)
FORMULA_NAME = '=HYPERLINK("evil")'

#: Honest students: (points, flags, notes) their row must have.
HONEST = {
    "alice": (10, [], []),
    "bob": (0, [], []),
    "carol": (6, [], []),
    "erin": (10, [], ["check cell 2.1 holds code of the student's: it ran just before the check"]),
    "fay": (10, [], []),
    "gina": (10, [], ["graded as 02_paging.ipynb: 02_paging (1).ipynb holds its check cells",
                      "ignored older files of this notebook: gina/02_paging.ipynb"]),
    FORMULA_NAME: (0, [], []),
}
#: Attackers: (points, what its flags and notes must say). Points are what the notebook earned:
#: nothing, but for the killer that attacks after its solved checks.
EXPECTED = {
    "patch_files": (0, ["imports labkit.exercises"]),
    "setsid_killer": (0, ["imports subprocess", "the kernel died"]),
    "killer_after_checks": (10, ["imports subprocess", "the kernel died"]),
    "signal_grader": (0, ["uses os.kill", "saw 2 processes"]),       # and reached no task outside: see the test
    "input_transformer": (0, ["input_transformers_cleanup", "IPython input transformers added"]),
    "ast_transformer": (0, ["ast_transformers", "IPython AST transformers added"]),
    "replace_graders": (0, ["imports labkit.exercises.memory", "is not labkit's grader",
                            "handed in a verdict answer where the grader reads ran"]),
    "sys_modules": (0, ["uses sys.modules", "handed in a verdict answer where the grader reads ran"]),
    "builtins_import": (0, ["imports builtins", "builtins.__import__ replaced"]),
    "run_solutions": (0, ["names in a string 'solutions'", "found 0 solutions"]),
    "fork_bomb": (0, ["uses os.fork", "stopped: it ran more than 256 processes and threads"]),
    "memory_hog": (0, ["uses os.fork", "stopped: it used more than 1536 MiB of memory"]),
    "output_flood": (0, ["stopped: it printed more than 2 MiB"]),
    "disk_fill": (0, ["LABKIT-HOSTILE wrote"]),        # and no more than its scratch space: see the test
    "conn_writer": (0, ["stopped: it wrote into its kernel's connection folder"]),
    "snoop": (0, ["found nothing"]),
    "forged_output": (0, []),
    "hostile_answers": (0, []),
    "counting_test": (0, []),
    "identifier_test": (0, ["uses fn.__closure__", "its test, run again on its own, uses fn.__closure__",
                            "it reads the implementations instead of testing what they do"]),
    "forger": (0, ["imports labkit.exercises.bughunt", "is not labkit's grader",
                   "passed in its own kernel, not when run again on its own"]),
}
#: Attackers whose files are in the class twice, the copy under their name + AGAIN_SUFFIX.
AGAIN = ["setsid_killer", "killer_after_checks", "signal_grader", "input_transformer", "forger"]
AGAIN_SUFFIX = "_again"


# ---- the class -----------------------------------------------------------------------------------------
def _solved():
    return read(PATHS.solutions / CHAPTER)


def _unsolved():
    return read(PATHS.notebooks / CHAPTER)


def _index(nb, needle: str) -> int:
    found = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and needle in c.source]
    assert len(found) == 1, f"{needle!r} is in cells {found}"
    return found[0]


def _trimmed(nb):
    """The notebook with only what grading needs: the install cell, the imports, the stubs and
    the check cells (a student may delete the rest; it keeps the hostile class fast)."""
    keep = []
    for cell in nb.cells:
        if cell.cell_type == "code" and (is_install_cell(cell) or is_stub_cell(cell) or is_solution_cell(cell)
                                         or is_check_cell(cell) or "from labkit" in cell.source):
            keep.append(cell)
    nb.cells = keep
    return nb


def _attack(name: str):
    """The notebook of attacker ``name`` (module docstring of tests/grade_fixtures/hostile/)."""
    source = (ATTACKS / f"{name}.py").read_text(encoding="utf-8")
    where = re.search(r"^# where: (\S+)", source, re.M).group(1)
    nb = _solved() if re.search(r"^# base: solved", source, re.M) else _trimmed(_unsolved())
    cell = lambda: nbformat.v4.new_code_cell(source)   # noqa: E731 - a fresh cell (and id) each time
    if where == "end":
        nb.cells.append(cell())
    elif where == "start":
        nb.cells.insert(_index(nb, "from labkit.memory import") + 1, cell())
    elif where == "before-checks":                     # after the stubs, so that it is what gets checked
        for i in reversed([i for i, c in enumerate(nb.cells) if is_check_cell(c)]):
            nb.cells.insert(i, cell())
    else:
        raise ValueError(f"{name}: where: {where}?")
    return nb


def _erin():
    """Solved, with what honest students do to check cells, saved by a classic Notebook (4.4)."""
    nb = _trimmed(_solved())
    stub = _index(nb, "num_blocks = math.ceil(70 / 16)")
    answer = nb.cells[stub].source
    nb.cells[stub].source = _unsolved().cells[_index(_unsolved(), "blocks are allocated whole")].source
    check = _index(nb, "# CHECK exercise 2.1")
    body = "\n".join(line for line in answer.splitlines() if "SOLUTION" not in line and "print" not in line
                     and "internal_fragmentation)" not in line and not line.startswith("      "))
    nb.cells[check].source = f"import math\n{body}\n\n{nb.cells[check].source}\n"     # the answer typed in the check
    for cell in nb.cells:
        if is_check_cell(cell):
            cell.source = cell.source.replace("\n\n", "\n\n\n   \n") + "\n# ran it twice, it passes  \n"
    copy = _index(nb, "# CHECK exercise 2.2")
    nb.cells.insert(copy + 1, nbformat.v4.new_code_cell(nb.cells[copy].source))            # a check run twice
    nb.cells.insert(2, nbformat.v4.new_code_cell("check_count = 3\ncheck_id = 'erin'\n\n"
                                                 "def check_total():\n    return check_count"))
    moved = nb.cells.pop(_index(nb, "# CHECK exercise 2.4"))
    nb.cells.append(moved)                                                                # moved to the end
    data = json.loads(nbformat.writes(nb))
    data["nbformat_minor"] = 4
    for c in data["cells"]:
        c.pop("id", None)
    return json.dumps(data, indent=1)


def _fay():
    """Solved, as Colab saves it: nbformat 4.0, ids in metadata, sources as lists of lines."""
    data = json.loads(nbformat.writes(_trimmed(_solved())))
    data["nbformat_minor"] = 0
    data["metadata"] = {"colab": {"provenance": []}, "kernelspec": {"name": "python3", "display_name": "Python 3"}}
    for k, c in enumerate(data["cells"]):
        c.pop("id", None)
        c["metadata"] = {"id": f"colab{k:04d}"}
        c["source"] = c["source"].splitlines(keepends=True) if isinstance(c["source"], str) else c["source"]
    return json.dumps(data, indent=2)


def _carol():
    nb = _trimmed(_solved())
    i = _index(nb, "num_blocks = math.ceil(70 / 16)")
    nb.cells[i].source = nb.cells[i].source.replace("math.ceil(70 / 16)", "70 // 16")
    i = _index(nb, "def test_allocation_does_not_slow_with_pool_size(impl):")
    nb.cells[i].source = _unsolved().cells[_index(_unsolved(), "def test_allocation_does_not_slow")].source
    return nb


def build(folder: Path, attackers: list[str], honest: bool = True) -> None:
    def save(text_or_nb, relative: str, mtime: float | None = None) -> None:
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text_or_nb if isinstance(text_or_nb, str) else nbformat.writes(text_or_nb), encoding="utf-8")
        if mtime is not None:
            os.utime(path, (mtime, mtime))

    if honest:
        save(_solved(), f"alice/{CHAPTER}")
        save(_unsolved(), f"bob/{CHAPTER}")
        save(_carol(), f"carol/{CHAPTER}")
        save(_erin(), f"erin/{CHAPTER}")
        save(_fay(), f"fay/{CHAPTER}")
        now = time.time()
        save(_trimmed(_unsolved()), f"gina/{CHAPTER}", now - 3600)          # handed in first...
        save(_trimmed(_solved()), "gina/02_paging (1).ipynb", now)           # ...then the final version
        save(_trimmed(_unsolved()), f"{FORMULA_NAME}/{CHAPTER}")
    for name in attackers:
        save(_attack(name), f"{name}/{CHAPTER}")


# ---- grading it ----------------------------------------------------------------------------------------
def _row(row) -> tuple:
    """A row without its timing: what two runs must agree on."""
    return (row.student, row.notebook, row.file, row.points, [(r.exercise, r.status, r.hint) for r in row.results],
            row.flags, row.notes, row.sandbox)


def _hostile_processes() -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if MARKER.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass
    return found


def _sandboxed(box, tried) -> None:
    """Refuse to grade the hostile class without a sandbox, before its first kernel starts: its
    attacks (``kill -9 -1`` in a loop, fork bombs, full disks) would run on this machine itself."""
    if box.kind == "none":
        pytest.fail(f"no sandbox works here, so the hostile class is not run: {box.detail}", pytrace=False)


def _grade(folder: Path):
    os.environ["INSTRUCTOR_TOKEN"] = SECRET                   # what snoop.py looks for
    try:
        return grade_class(folder, root=ROOT, jobs=3, timeout=60, limits=LIMITS, on_sandbox=_sandboxed)
    finally:
        del os.environ["INSTRUCTOR_TOKEN"]


#: What the checkout may gain while its notebooks are graded: Python's own bytecode caches (the
#: grader imports labkit; Numba caches compiled functions there too). Nothing else.
CACHES = ("__pycache__",)


def _files(paths: list[Path]) -> dict[str, str]:
    """sha256 of every file under ``paths``, caches included (``run.fingerprint`` leaves them out)."""
    out = dict(fingerprint(paths))
    for base in paths:
        if base.is_dir():
            for p in base.rglob("*"):
                if p.is_file() and str(p) not in out:
                    out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _edited(watched: list[Path]) -> str | None:
    """Why the checkout cannot be compared byte for byte (someone's uncommitted edits of the watched
    files: a development machine, where they may go on changing during the run), or None when it
    can: a clean checkout (CI's fresh clone), or one that is not a git checkout at all.
    ``LABKIT_STRICT_CHECKOUT=1`` (or ``CI``) compares it whatever git says."""
    if os.environ.get("CI") or os.environ.get("LABKIT_STRICT_CHECKOUT"):
        return None
    mine = [str(p) for p in watched if p.resolve().is_relative_to(ROOT)]     # (the .pth files may lie elsewhere)
    try:
        done = subprocess.run(["git", "status", "--porcelain", "--", *mine], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:            # not a git checkout (an unpacked sdist): nothing edits it
        return None
    lines = done.stdout.splitlines()
    return f"uncommitted edits in the checkout ({len(lines)} files, e.g. {lines[0].strip()})" if lines else None


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """The class graded whole (``first``), where the ``AGAIN`` attackers' files are handed in
    twice; the honest students alone, the very same files (``honest``)."""
    watched = installation(PATHS) + [p for p in (ROOT / "Makefile", ROOT / "pyproject.toml")]
    edited = _edited(watched)
    before = _files(watched)
    workrooms = set(Path("/tmp").glob("labkit-grade-*"))
    honest, full = (tmp_path_factory.mktemp(n) for n in ("honest-only", "hostile-class"))
    build(honest, [])
    shutil.copytree(honest, full, dirs_exist_ok=True)               # copy2: the same bytes and times
    build(full, list(EXPECTED), honest=False)
    for name in AGAIN:          # handed in twice, under two names: graded in other kernels, at other times
        shutil.copytree(full / name, full / (name + AGAIN_SUFFIX))
    first = _grade(full)
    only_honest = _grade(honest)
    time.sleep(1)
    return {"first": first, "honest": only_honest, "before": before, "after": _files(watched),
            "edited": edited, "workrooms": set(Path("/tmp").glob("labkit-grade-*")) - workrooms,
            "processes": _hostile_processes()}


def _rows(book) -> dict[str, object]:
    return {row.student: row for row in book.rows}


def test_the_honest_students_are_graded_the_same_whoever_else_is_in_the_class(graded):
    first, alone = _rows(graded["first"]), _rows(graded["honest"])
    assert set(alone) == set(HONEST), sorted(alone)                  # the class without a single attacker
    assert set(first) == set(HONEST) | set(EXPECTED) | {n + AGAIN_SUFFIX for n in AGAIN}, sorted(first)
    for student, (points, flags, notes) in HONEST.items():
        row = first[student]
        assert (row.points, row.flags, row.notes) == (points, flags, notes), _row(row)
        assert _row(row) == _row(alone[student]), student
    assert graded["first"].sandbox.split()[0] in ("bwrap", "unshare"), graded["first"].sandbox


def test_no_attack_earns_a_point_it_did_not_earn_and_each_is_named(graded):
    rows = _rows(graded["first"])
    wrote = int(re.search(r"wrote (\d+) MiB", rows["disk_fill"].results[0].hint).group(1))
    assert 0 < wrote <= 3 * LIMITS.scratch_mb, rows["disk_fill"].results[0].hint   # home, /tmp, /dev/shm: capped
    ids = int(re.search(r"saw 2 processes, (\d+) ids", rows["signal_grader"].results[0].hint).group(1))
    assert ids < 64, rows["signal_grader"].results[0].hint        # its kernel's threads; the host has hundreds
    for name, (points, evidence) in EXPECTED.items():
        row = rows[name]
        said = " | ".join([*row.flags, *row.notes, *(r.hint for r in row.results)])
        assert row.points == points, f"{name}: {row.points} points: {said}"
        for text in evidence:
            assert text in said, f"{name}: {text!r} not in {said!r}"
        if points and name not in ("killer_after_checks",):
            assert row.flags, f"{name} took {points} points unflagged"


def test_an_attack_graded_twice_gives_the_same_row(graded):
    # The honest students' files were graded twice too (with the attackers, and without: above).
    rows = _rows(graded["first"])
    for name in AGAIN:
        once, twice = repr(_row(rows[name])), repr(_row(rows[name + AGAIN_SUFFIX])).replace(name + AGAIN_SUFFIX, name)
        assert once == twice, (name, once, twice)


def test_the_checkout_is_untouched_and_nothing_of_the_attacks_is_left(graded):
    changed = sorted(p for p in graded["before"].keys() | graded["after"].keys()
                     if graded["before"].get(p) != graded["after"].get(p))
    marked = [p for p in changed if Path(p).exists() and MARKER.encode() in Path(p).read_bytes()]
    assert not marked, f"the attacks wrote into {marked}"
    assert not [p for p in changed if not Path(p).exists() and not set(Path(p).parts) & set(CACHES)], \
        "files of the checkout were deleted"
    # Byte for byte but for Python's own caches, wherever nobody edits the checkout meanwhile (CI's
    # fresh clone; a development machine's uncommitted edits may go on during the run: there
    # only the marker tells the attacks' traces from the others').
    if graded["edited"] is None:
        assert [p for p in changed if not set(Path(p).parts) & set(CACHES)] == [], changed
    assert graded["processes"] == [], "processes of the attackers outlived the grading"
    assert graded["workrooms"] == set(), "grading left its scratch folders behind"
    for book in (graded["first"], graded["honest"]):
        assert not any(MARKER in w for w in book.warnings), book.warnings


def test_the_gradebook_itself_is_safe(graded):
    text = csv_text(graded["first"])
    records = list(csv.DictReader(io.StringIO(text)))
    formula = [r for r in records if r["student"].lstrip("'") == FORMULA_NAME]
    assert len(formula) == 1 and formula[0]["student"] == "'" + FORMULA_NAME
    assert all("\n" not in v and "\r" not in v for r in records for v in r.values())
    assert len({(r["student"], r["notebook"]) for r in records}) == len(records)      # one row each
    assert all(not v.startswith(("=", "+", "-", "@")) for r in records for v in r.values() if v)
