"""The gradebook (``python -m labkit.grade``, ``make grade``) on a class built from the lab's
own chapter 2: solved, unsolved, wrong answers of each kind, a tampered check cell, a grader
monkeypatched through an import, an endless loop, ``sys.exit``, deleted files, a dead kernel,
a corrupt file, a missing notebook, an unknown notebook, a file nobody can be told the owner of.

The whole class is graded once (about a minute on 2 cores) by ``make grade``, and the CSV must
be exactly the one written below; the fast tests around it check the pieces: the points table,
the layouts, check-cell pairing, the integrity rule, the reports' escaping.
"""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import string
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

from labkit.exercises.points import POINTS, points  # noqa: E402
from labkit.grade import FAIL, NOT_ATTEMPTED, PASS, Gradebook, Result, Row, collect, csv_text, html_text  # noqa: E402
from labkit.grade.collect import exercises_of  # noqa: E402
from labkit.grade.integrity import forbidden  # noqa: E402
from labkit.grade.report import row_line, summary_text  # noqa: E402
from labkit.notebooks import (Paths, exercise_id, is_check_cell, is_stub_cell, match_check_cells,  # noqa: E402
                              read)

ROOT = Path(__file__).resolve().parent.parent
PATHS = Paths(ROOT)
CHAPTER = "02_paging.ipynb"
CELL_TIMEOUT_S = 30          # the endless loop costs this once; every honest cell of chapter 2 takes < 5 s


# ---- the points table ------------------------------------------------------------------------------
def _check_ids(folder: Path) -> list[str]:
    ids = []
    for path in sorted(folder.glob("*.ipynb")):
        for cell in read(path).cells:
            if is_check_cell(cell):
                assert exercise_id(cell), f"{path.name}: {cell.source.splitlines()[0]!r} names no exercise"
                ids.append(exercise_id(cell))
    return ids


def test_every_check_cell_has_points_and_every_points_entry_a_check_cell():
    ids = _check_ids(PATHS.solutions)
    assert len(ids) == len(set(ids)), f"an exercise id is used twice: {sorted(ids)}"
    assert set(ids) - set(POINTS) == set(), "check cells without points in labkit/exercises/points.py"
    assert set(POINTS) - set(ids) == set(), "points for exercises that no check cell grades"
    assert all(isinstance(p, int) and p > 0 for p in POINTS.values())
    with pytest.raises(KeyError, match="no points"):
        points("9.9")


# ---- the class ---------------------------------------------------------------------------------------
def _cell(nb, needle: str) -> int:
    """The position of the one code cell containing ``needle``."""
    found = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and needle in c.source]
    assert len(found) == 1, f"{needle!r} is in cells {found}"
    return found[0]


def _solved():
    return read(PATHS.solutions / CHAPTER)


def _unsolved():
    return read(PATHS.notebooks / CHAPTER)


def _stub_of(nb_unsolved, function: str) -> str:
    return nb_unsolved.cells[_cell(nb_unsolved, f"def {function}(impl):")].source


def build_class(folder: Path) -> dict[str, int]:
    """The fixture class (see the module docstring), written under ``folder``. Returns the
    (1-based) numbers of the cells the gradebook names, which follow chapter 2's layout."""
    def save(nb, relative: str) -> None:
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, folder / relative)

    cells: dict[str, int] = {}
    save(_solved(), f"alice/{CHAPTER}")                                  # everything right
    save(_unsolved(), f"bob__{CHAPTER}")                                  # nothing done; file-name layout

    carol = _solved()                                                     # one wrong answer of each kind
    i = _cell(carol, "num_blocks = math.ceil(70 / 16)")
    carol.cells[i].source = carol.cells[i].source.replace("math.ceil(70 / 16)", "70 // 16")
    i = _cell(carol, "def test_generated_tokens_have_slots(impl):")
    carol.cells[i].source = "def test_generated_tokens_have_slots(impl):\n    pass   # looks fine to me"
    i = _cell(carol, "def test_shared_blocks_survive_a_free(impl):")
    carol.cells[i].source = _stub_of(_unsolved(), "test_shared_blocks_survive_a_free")
    save(carol, f"carol/{CHAPTER}")

    dave = _solved()                                                      # a tampered check, a patched grader
    i = _cell(dave, "num_blocks = math.ceil(70 / 16)")
    dave.cells[i].source = "num_blocks, wasted_slots, internal_fragmentation = 5, 10, 0.125"
    i = _cell(dave, "# CHECK exercise 2.1")
    dave.cells[i].source = '# CHECK exercise 2.1\nprint("✓ all good")'
    i = cells["patch"] = _cell(dave, "def test_allocation_does_not_slow_with_pool_size(impl):")
    dave.cells[i].source = (_stub_of(_unsolved(), "test_allocation_does_not_slow_with_pool_size")
                            + "\n\nimport labkit.exercises.bughunt as grader\n"
                            "grader.check_free_list_test = lambda test: print('✓')")
    save(dave, f"dave/{CHAPTER}")

    frank = _solved()                                                     # an endless loop
    i = cells["loop"] = _cell(frank, "num_blocks = math.ceil(70 / 16)")
    frank.cells[i].source = "while True:\n    pass"
    save(frank, f"frank/{CHAPTER}")

    grace = _solved()                                                     # exits, deletes, kills its kernel
    i = _cell(grace, "# CHECK exercise 2.1")
    cells["exit"] = i + 1
    grace.cells.insert(i + 1, nbformat.v4.new_code_cell(
        "import os, sys\nfor name in os.listdir('.'):\n    os.remove(name)\nsys.exit('done here')"))
    i = cells["dead"] = _cell(grace, "def test_allocation_does_not_slow_with_pool_size(impl):")
    grace.cells[i].source = "import os\nos._exit(1)"
    save(grace, f"grace/{CHAPTER}")

    (folder / "judy").mkdir()                                             # a truncated download
    (folder / "judy" / CHAPTER).write_text('{"cells": [{"cell_type": "code", "source": "x = 1"')
    save(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")]), "kim/my_homework.ipynb")
    save(nbformat.v4.new_notebook(), "stray.ipynb")                       # whose?
    return {name: index + 1 for name, index in cells.items()}


# ---- the layouts, check-cell pairing, the integrity rule (fast) ---------------------------------------
def test_collect_reads_both_layouts_and_lists_what_is_missing(tmp_path):
    empty = nbformat.writes(nbformat.v4.new_notebook())
    for relative in ("alice/02_paging.ipynb", "alice/lab/03_sharing.ipynb", "bob__02_paging.ipynb",
                     "carol/my_work.ipynb", "carol/.ipynb_checkpoints/02_paging-checkpoint.ipynb",
                     "__MACOSX/alice/02_paging.ipynb", "stray.ipynb"):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(empty)
    (tmp_path / "dave").mkdir()                       # handed in nothing but a renamed copy
    shutil.copy(PATHS.notebooks / "03_sharing.ipynb", tmp_path / "dave" / "03_sharing (1).ipynb")
    lab = {name: exercises_of(read(PATHS.notebooks / name)) for name in ("02_paging.ipynb", "03_sharing.ipynb")}
    got = [(s.student, s.notebook, s.path.relative_to(tmp_path).as_posix() if s.path else None, s.known)
           for s in collect(tmp_path, lab)]
    assert got == [
        ("alice", "02_paging.ipynb", "alice/02_paging.ipynb", True),
        ("alice", "03_sharing.ipynb", "alice/lab/03_sharing.ipynb", True),
        ("bob", "02_paging.ipynb", "bob__02_paging.ipynb", True),
        ("bob", "03_sharing.ipynb", None, True),
        ("carol", "02_paging.ipynb", None, True),
        ("carol", "03_sharing.ipynb", None, True),
        ("carol", "my_work.ipynb", "carol/my_work.ipynb", False),
        ("dave", "02_paging.ipynb", None, True),
        ("dave", "03_sharing.ipynb", "dave/03_sharing (1).ipynb", True),
        ("stray", "stray.ipynb", "stray.ipynb", False),
    ]
    assert [s.renamed for s in collect(tmp_path, lab) if s.renamed] == ["03_sharing (1).ipynb"]
    only = collect(tmp_path, lab, only={"03_sharing.ipynb"})
    assert {(s.student, s.notebook) for s in only if s.known} == {
        ("alice", "03_sharing.ipynb"), ("bob", "03_sharing.ipynb"), ("carol", "03_sharing.ipynb"),
        ("dave", "03_sharing.ipynb")}
    with pytest.raises(FileNotFoundError, match="no such folder"):
        collect(tmp_path / "nowhere", lab)


def test_check_cells_are_found_by_id_title_or_order():
    distributed = _unsolved()
    checks = [i for i, c in enumerate(distributed.cells) if is_check_cell(c)]
    submitted = read(PATHS.notebooks / CHAPTER)
    submitted.cells[checks[0]].source = "print('trust me')"               # same id, no # CHECK line
    submitted.cells[checks[1]].id = "renamed-by-some-tool"                # found by its title
    submitted.cells[checks[1]].source += "\n\n"                           # trailing blank lines: not an edit
    del submitted.cells[checks[3]]                                        # deleted
    submitted.cells.append(nbformat.v4.new_code_cell("# CHECK exercise 2.9\nprint('✓')"))
    matches, extra = match_check_cells(submitted, distributed)
    assert [(m.title, m.found, m.edited) for m in matches] == [
        ("# CHECK exercise 2.1", checks[0], True), ("# CHECK exercise 2.2", checks[1], False),
        ("# CHECK exercise 2.3", checks[2], False), ("# CHECK exercise 2.4", None, False)]
    assert extra == [len(submitted.cells) - 1]


def test_integrity_rule_allows_graders_and_the_notebooks_own_imports():
    distributed = ["from labkit.exercises.bughunt import naive, paged, time_allocations"]
    cells = [
        (0, "from labkit.exercises.bughunt import naive, paged\nfrom labkit.exercises import check_exercise_2"),
        (1, "from labkit.exercises.memory import shared_prompt_counts"),
        (2, "import labkit.exercises.bughunt as b\nb.check_free_list_test = print"),
        (3, "import labkit\nx = labkit.exercises._grading.fail"),
        (4, "import importlib\nm = importlib.import_module('labkit.exercises.memory')"),
        (5, "def check_exercise_2(*args):\n    pass"),
        (6, "%%time\nfrom labkit.exercises._grading import fail"),
        (7, "this is not python"),
    ]
    got = [(u.cell, u.how, u.what) for u in forbidden(cells, distributed)]
    assert got == [
        (1, "imports", "labkit.exercises.memory.shared_prompt_counts"),
        (2, "imports", "labkit.exercises.bughunt"),
        (3, "refers to", "labkit.exercises._grading.fail"),
        (4, "names in a string", "labkit.exercises.memory"),
        (5, "defines", "check_exercise_2"),
        (6, "imports", "labkit.exercises._grading.fail"),
    ]


@pytest.mark.parametrize("solution", PATHS.solution_files(), ids=lambda p: p.stem)
def test_a_solved_notebook_handed_in_as_is_raises_no_flag(solution):
    """No false alarms: every chapter's solution, as a submission, keeps its check cells and
    uses nothing of the graders' beyond what its student notebook does."""
    submitted, distributed = read(solution), read(PATHS.notebooks / solution.name)
    matches, extra = match_check_cells(submitted, distributed)
    assert [m.title for m in matches if m.found is None or m.edited] == [] and extra == []
    checks = {m.found for m in matches}
    mine = [(i, c.source) for i, c in enumerate(submitted.cells) if c.cell_type == "code" and i not in checks]
    theirs = [c.source for c in distributed.cells if c.cell_type == "code" and not is_check_cell(c)]
    assert forbidden(mine, theirs) == []


def test_verdicts_from_what_the_cells_raised():
    """Each exercise's result from the cells' errors alone (no kernel): the rules of
    ``labkit.grade.notebook._verdicts``, on chapter 2's layout."""
    from labkit.grade.execute import CellRun, Execution
    from labkit.grade.notebook import NOT_RUN, _stub_lines, _verdicts, exercise_ids

    distributed = _unsolved()
    ids = exercise_ids(distributed)
    stubs = _stub_lines(distributed, ids)

    def verdicts(nb, errors: dict[int, tuple], stopped_at=None):
        matches, _ = match_check_cells(nb, distributed)
        run = Execution({i: CellRun(i, errors.get(i), errors.get(i, ("",))[0] == "CellTimeout")
                         for i, c in enumerate(nb.cells) if c.cell_type == "code"
                         and (stopped_at is None or i <= stopped_at)}, "stopped" if stopped_at else None, stopped_at)
        row = Row("s", CHAPTER, "f", [Result(i, NOT_RUN, points(i)) for i in ids])
        _verdicts(row, nb, matches, stubs, run, 30)
        return [(r.status, r.hint) for r in row.results], row.notes

    solved = _solved()
    value, check_21, test_22, check_22, check_23, check_24 = (
        _cell(solved, "num_blocks = math.ceil(70 / 16)"), _cell(solved, "# CHECK exercise 2.1"),
        _cell(solved, "def test_generated_tokens_have_slots"), _cell(solved, "# CHECK exercise 2.2"),
        _cell(solved, "# CHECK exercise 2.3"), _cell(solved, "# CHECK exercise 2.4"))
    got, notes = verdicts(solved, {
        value: ("TypeError", "bad operand"), check_21: ("NameError", "name 'num_blocks' is not defined"),
        check_22: ("AssertionError", "first line\nsecond line\nthird line"),
        check_23: ("CellTimeout", "ran past the 30 s timeout"), 2: ("ImportError", "no plotly")},
        stopped_at=check_23)
    assert got == [(FAIL, f"cell {value + 1} raised TypeError: bad operand"), (FAIL, "first line second line"),
                   (FAIL, f"cell {check_23 + 1} ran past the 30 s timeout"), (NOT_RUN, "")]
    assert notes == ["cell 3 raised ImportError: no plotly", "stopped"]

    still = "test_generated_tokens_have_slots still raises NotImplementedError: write the test."
    got, _ = verdicts(solved, {check_22: ("AssertionError", still)})        # no stub left: a real failure
    assert got[1] == (FAIL, still)
    unsolved = _unsolved()
    stub_21 = next(i for i, c in enumerate(unsolved.cells) if is_stub_cell(c))     # exercise 2.1's
    got, notes = verdicts(unsolved, {stub_21: ("NotImplementedError", "round 70 / 16 up"),
                                     check_21: ("NameError", "name 'num_blocks' is not defined"),
                                     check_22: ("AssertionError", still), check_24: ("KeyError", "x")})
    assert [s for s, _ in got] == [NOT_ATTEMPTED, NOT_ATTEMPTED, PASS, FAIL] and notes == []
    assert test_22 == _cell(unsolved, "def test_generated_tokens_have_slots")


def test_reports_escape_what_students_wrote_and_stay_plain_off_a_terminal():
    evil = "<script>alert('x')</script>, \"quoted\""
    rows = [Row("<b>mallory</b>", CHAPTER, "m.ipynb", [Result("2.1", FAIL, 1, evil), Result("2.2", PASS, 3)],
                flags=[f"cell 3 imports {evil}"], notes=["line one; line two"]),
            Row("zoe", CHAPTER, "z.ipynb", [Result("2.1", NOT_ATTEMPTED, 1), Result("2.2", PASS, 3)])]
    book = Gradebook(rows, ["2.1", "2.2"], 12.0, 2)
    page = html_text(book)
    assert "<script>" not in page and "<b>mallory" not in page and "&lt;script&gt;" in page
    assert "<link" not in page and "src=" not in page                    # self-contained
    records = list(csv.DictReader(io.StringIO(csv_text(book))))
    assert records[0]["2.1"] == f"fail: {evil}" and records[0]["points"] == "3" and records[0]["max_points"] == "4"
    assert records[1]["2.1"] == "not attempted" and records[1]["points"] == "3"
    text = summary_text(book) + row_line(rows[0], 1, 2)
    assert "\033[" not in text
    assert re.search(r"^2\.1\s+1\s+0\s+1\s+1\s+0\s", summary_text(book), re.M)
    assert "\033[" in row_line(rows[1], 2, 2, colour=True)
    assert "Per student" not in page                                     # one notebook: nothing to add up
    rows.append(Row("zoe", "03_sharing.ipynb", "z3.ipynb", [Result("3.1", PASS, 2)]))
    page = html_text(Gradebook(rows, ["2.1", "2.2", "3.1"], 12.0, 2))
    assert "<td>zoe</td><td class='num'>3</td><td class='num'>2</td><td class='num'>5/6</td>" in page


def test_cli_refuses_bad_arguments_clearly(tmp_path, capsys):
    from labkit.grade.__main__ import main
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert main([str(tmp_path)]) == 2
    assert "no .ipynb files" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--jobs", "0"])
    (tmp_path / "a").mkdir()
    nbformat.write(nbformat.v4.new_notebook(), tmp_path / "a" / CHAPTER)
    assert main([str(tmp_path), "--notebook", "99_nope.ipynb"]) == 2
    assert "not notebooks of the lab" in capsys.readouterr().err


# ---- the kernel: timeouts ---------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.notebook
def test_a_loop_is_interrupted_and_a_kernel_deaf_to_interrupts_ends_its_run(tmp_path):
    from labkit.grade.execute import run_notebook
    cells = ["x = 1", "while True:\n    pass", "y = x + 1",
             "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass", "z = 3"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    run = run_notebook(nb, tmp_path, timeout=3, grace=3)
    assert [(c.index, c.error is None, c.timed_out) for c in run.cells.values()] == [
        (0, True, False), (1, False, True), (2, True, False), (3, False, True)]      # z = 3 never ran
    assert run.stopped_at == 3 and "did not stop when interrupted" in run.stopped


# ---- the fixture class, graded by make grade -----------------------------------------------------------
EXPECTED_CSV = string.Template("""\
student,notebook,file,points,max_points,2.1,2.2,2.3,2.4,flags,notes
alice,02_paging.ipynb,alice/02_paging.ipynb,10,10,pass,pass,pass,pass,,
bob,02_paging.ipynb,bob__02_paging.ipynb,0,10,not attempted,not attempted,not attempted,not attempted,,
carol,02_paging.ipynb,carol/02_paging.ipynb,3,10,fail: num_blocks: 4 is not right. That counts the full blocks only; the tokens left over after them need a block too.,"fail: Exercise 2.2 (flaw 1, generated tokens): test_generated_tokens_have_slots passes on the naive implementation, so it does not expose this flaw. After every iteration, what must hold between the tokens a running request holds and the slots its block table gives it?",pass,not attempted,,
dave,02_paging.ipynb,dave/02_paging.ipynb,9,10,fail: internal_fragmentation: 0.125 (12.50%) is not right. That is relative to the allocated slots; the exercise measures the wasted slots against the sequence's length.,pass,pass,pass,edited check cell 2.1 (graded with the distributed one); cell $patch imports labkit.exercises.bughunt,
frank,02_paging.ipynb,frank/02_paging.ipynb,9,10,fail: cell $loop ran past the 30 s timeout,pass,pass,pass,cell $loop ran past the 30 s timeout,
grace,02_paging.ipynb,grace/02_paging.ipynb,4,10,pass,pass,not run,not run,,"cell $exit raised SystemExit: done here; the kernel died by cell $dead (exit(), os._exit, a crash or out of memory)"
judy,02_paging.ipynb,judy/02_paging.ipynb,0,10,not run,not run,not run,not run,,"corrupt: not a readable notebook (JSONDecodeError: Expecting ',' delimiter: line 1 column 51 (char 50))"
kim,02_paging.ipynb,,0,10,not run,not run,not run,not run,,missing: not handed in
kim,my_homework.ipynb,kim/my_homework.ipynb,0,0,,,,,unknown notebook: not one of the lab's,
stray,stray.ipynb,stray.ipynb,0,0,,,,,"cannot tell whose it is: put it in a folder named after the student, or name it <student>__stray.ipynb",
""")


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """The class, graded once by ``make grade`` (or the module's CLI where make is missing)."""
    folder = tmp_path_factory.mktemp("class")
    subs, out = folder / "submissions", folder / "out"
    cells = build_class(subs)
    before = {p: p.read_bytes() for p in subs.rglob("*") if p.is_file()}
    grades, report = out / "grades.csv", out / "report.html"
    # No NO_COLOR: plain output must come from stdout not being a terminal. No MAKEFLAGS: under
    # `make test` they describe the outer make (its jobserver), not this one.
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    if shutil.which("make"):
        # -o setup: the venv running this test is the one to grade with; do not reinstall it.
        venv = Path(sys.prefix)
        cmd = ["make", "-s", "-o", "setup", "grade", f"VENV={venv}", f"DIR={subs}", f"GRADES={grades}",
               f"REPORT={report}", "JOBS=2", f"CELL_TIMEOUT={CELL_TIMEOUT_S}"]
    else:
        cmd = [sys.executable, "-m", "labkit.grade", str(subs), "--out", str(grades), "--html", str(report),
               "--jobs", "2", "--timeout", str(CELL_TIMEOUT_S)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return {"cells": cells, "subs": subs, "before": before, "grades": grades, "report": report, "stdout": done.stdout}


@pytest.mark.slow
@pytest.mark.notebook
def test_make_grade_writes_the_expected_gradebook(graded):
    got = graded["grades"].read_text(encoding="utf-8")
    assert got == EXPECTED_CSV.substitute(graded["cells"]), got


@pytest.mark.slow
@pytest.mark.notebook
def test_the_report_and_the_terminal_say_the_same(graded):
    page = graded["report"].read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.count("<tr>") == 1 + 4 + 1 + 10
    assert "edited check cell 2.1" in page and "&lt;student&gt;__stray.ipynb" in page
    out = graded["stdout"]
    assert "\033[" not in out                                  # not a terminal: no colour codes
    assert re.search(r"^2\.1\s+1\s+2\s+3\s+1\s+2\s", out, re.M), out     # the summary table
    assert "flagged (4):" in out and f"wrote {graded['grades']}" in out


@pytest.mark.slow
@pytest.mark.notebook
def test_grading_touched_no_submission(graded):
    after = {p: p.read_bytes() for p in graded["subs"].rglob("*") if p.is_file()}
    assert after == graded["before"]
