"""The gradebook (``python -m labkit.grade``, ``make grade``), piece by piece, then on a class built
from the lab's own chapter 2: solved, unsolved, wrong answers of each kind, a tampered check
cell, a grader monkeypatched through an import, an endless loop, ``sys.exit``, deleted files, a
dead kernel, a corrupt file, a missing notebook, an unknown notebook, a file nobody can be told
the owner of.

The fast tests need no kernel: who handed in what, every notebook format a student can hand in,
check cells paired and what a student changed in them, the static flags (and their false
alarms), the judge reading only plain data, answers crossing from a kernel's namespace to the
graders as JSON, a passing bug-hunt test run again from its source on its own (and what it cannot
forge there), the verdict rules, the reports. The class is graded once by ``make grade``
(about a minute on 2 cores); the hostile class is tests/test_grade_hostile.py, the sandbox's
walls tests/test_grade_sandbox.py.
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
import re
import shutil
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

from labkit.exercises import bughunt  # noqa: E402
from labkit.exercises.points import POINTS, points  # noqa: E402
from labkit.grade import FAIL, NOT_ATTEMPTED, NOT_RUN, PASS, Gradebook, Result, Row, collect, csv_text  # noqa: E402
from labkit.grade import html_text  # noqa: E402
from labkit.grade.checks import compare  # noqa: E402
from labkit.grade.collect import exercises_of  # noqa: E402
from labkit.grade.execute import CellRun, Execution  # noqa: E402
from labkit.grade.formats import Unreadable, parse  # noqa: E402
from labkit.grade.integrity import forbidden  # noqa: E402
from labkit.grade.judge import PASS as JUDGED_PASS  # noqa: E402
from labkit.grade.judge import UNANSWERED, form, judge  # noqa: E402
from labkit.grade.notebook import Distributed, _verdicts, prepare  # noqa: E402
from labkit.grade.probe import IN_KERNEL  # noqa: E402
from labkit.grade.report import row_line, summary_text  # noqa: E402
from labkit.notebooks import Paths, exercise_id, is_check_cell, match_check_cells, read  # noqa: E402

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
    # It waits rather than spins: the timeout is the same, and the suite's other worker keeps
    # its core for 30 s (test_a_loop_is_interrupted... interrupts a spinning one, and a deaf one).
    frank.cells[i].source = "import time\nwhile True:\n    time.sleep(0.1)"
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


# ---- who handed in what ---------------------------------------------------------------------------------
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


def test_one_row_per_student_and_notebook_the_newest_file_graded(tmp_path):
    """Two files of one notebook: the newest by modification time is graded, the others named."""
    text = (PATHS.notebooks / CHAPTER).read_text()
    now = time.time()
    for relative, age in (("alice/02_paging.ipynb", 300), ("alice/02_paging (1).ipynb", 0),
                          ("alice/old/02_paging.ipynb", 900), ("bob__02_paging.ipynb", 50),
                          ("bob/02_paging.ipynb", 50)):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
        os.utime(tmp_path / relative, (now - age, now - age))
    lab = {CHAPTER: exercises_of(read(PATHS.notebooks / CHAPTER))}
    subs = collect(tmp_path, lab)
    assert [(s.student, s.path.relative_to(tmp_path).as_posix(), s.ignored) for s in subs] == [
        ("alice", "alice/02_paging (1).ipynb", ("alice/02_paging.ipynb", "alice/old/02_paging.ipynb")),
        ("bob", "bob__02_paging.ipynb", ("bob/02_paging.ipynb",)),           # a tie: the last by name
    ]


# ---- every notebook a student can hand in ------------------------------------------------------------------
def _as(version: tuple[int, int], *, ids: bool, colab: bool = False, lists: bool = False) -> str:
    """Chapter 2's student notebook written as another tool would write it."""
    data = json.loads(nbformat.writes(read(PATHS.notebooks / CHAPTER)))
    data["nbformat"], data["nbformat_minor"] = version
    for k, cell in enumerate(data["cells"]):
        cell.pop("id", None)
        if ids:
            cell["id"] = f"cell-{k}"
        if colab:
            cell["metadata"] = {"id": f"colab{k:04d}"}
        text = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        cell["source"] = text.splitlines(keepends=True) if lists else text
    return json.dumps(data)


@pytest.mark.parametrize("version, ids, colab, lists", [
    ((4, 5), True, False, False), ((4, 4), False, False, False), ((4, 4), False, False, True),
    ((4, 2), False, False, True), ((4, 0), False, True, True), ((4, 1), False, False, False),
    ((4, 4), True, False, False),           # ids a 4.4 notebook should not have: kept, not an error
], ids=["4.5-jupyterlab", "4.4-classic", "4.4-lists", "4.2", "4.0-colab", "4.1", "4.4-with-ids"])
def test_every_nbformat_4_notebook_is_read_as_4_5_with_its_check_cells(version, ids, colab, lists):
    nb = parse(_as(version, ids=ids, colab=colab, lists=lists), salt="alice__02_paging")
    nbformat.validate(nb)
    assert (nb.nbformat, nb.nbformat_minor) == (4, 5)
    assert [exercise_id(c) for c in nb.cells if exercise_id(c)] == ["2.1", "2.2", "2.3", "2.4"]
    assert len({c.id for c in nb.cells}) == len(nb.cells)
    if colab:
        assert nb.cells[0].id == "colab0000"
    if not ids and not colab:
        assert nb == parse(_as(version, ids=ids, colab=colab, lists=lists), salt="alice__02_paging")   # stable ids
    matches, extra = match_check_cells(nb, read(PATHS.notebooks / CHAPTER))
    assert all(m.found is not None and not m.edited for m in matches) and extra == []


def test_nbformat_3_is_converted_and_anything_else_refused_with_the_reason():
    v3 = {"nbformat": 3, "nbformat_minor": 0, "metadata": {}, "worksheets": [{"cells": [
        {"cell_type": "code", "input": "# CHECK exercise 2.1\nx = 1", "language": "python", "outputs": []},
        {"cell_type": "heading", "level": 1, "source": "Paging"}]}]}
    nb = parse(json.dumps(v3))
    assert [c.cell_type for c in nb.cells] == ["code", "markdown"] and exercise_id(nb.cells[0]) == "2.1"
    for text, reason in ((json.dumps({**v3, "nbformat": 2}), "nbformat 2: only nbformat 3 and 4"),
                         (json.dumps({"nbformat": 5, "cells": []}), "nbformat 5"),
                         ('{"cells": [', "not JSON"), ("[1, 2]", "no nbformat field"),
                         (json.dumps({"nbformat": 4, "cells": "x"}), "no list of cells"),
                         ("[" * 100_000, "not JSON")):
        with pytest.raises(Unreadable, match=re.escape(reason)):
            parse(text)


# ---- check cells: paired, and what a student changed in them ------------------------------------------
def test_check_cells_are_found_by_id_title_or_order():
    distributed = _unsolved()
    checks = [i for i, c in enumerate(distributed.cells) if is_check_cell(c)]
    submitted = read(PATHS.notebooks / CHAPTER)
    submitted.cells[checks[0]].source = "print('trust me')"               # same id, no # CHECK line
    submitted.cells[checks[1]].id = "renamed-by-some-tool"                # found by its title
    submitted.cells[checks[1]].source += "\n\n# looks right\n"            # a comment and blank lines: not an edit
    del submitted.cells[checks[3]]                                        # deleted
    submitted.cells.append(nbformat.v4.new_code_cell("# CHECK exercise 2.9\nprint('✓')"))
    submitted.cells.append(nbformat.v4.new_code_cell(submitted.cells[checks[2]].source))   # run again: a copy
    matches, extra = match_check_cells(submitted, distributed)
    assert [(m.title, m.found, m.edited) for m in matches] == [
        ("# CHECK exercise 2.1", checks[0], True), ("# CHECK exercise 2.2", checks[1], False),
        ("# CHECK exercise 2.3", checks[2], False), ("# CHECK exercise 2.4", None, False)]
    assert extra == [len(submitted.cells) - 2]                            # the copy is not extra
    no_ids = read(PATHS.notebooks / CHAPTER)
    for cell in no_ids.cells:
        cell.id = f"x{id(cell)}"
    no_ids.cells[checks[0]].source = "num_blocks = 5\n" + no_ids.cells[checks[0]].source   # typed above # CHECK
    assert match_check_cells(no_ids, distributed)[0][0].found == checks[0]


def _check(exercise: str):
    return next(c for c in Distributed.read(PATHS.notebooks / CHAPTER).checks if c.exercise == exercise)


def test_what_a_student_changed_in_a_check_cell_is_honoured_or_flagged():
    check = _check("2.1")
    src = check.source
    assert compare(src + "\n\n# ran it twice\n", check).kind == "same"
    assert compare(src.replace("\n\n", "\n  \n\n"), check).kind == "same"
    assert compare(src.replace("(num_blocks, wasted_slots", "(num_blocks,wasted_slots"), check).kind == "same"
    typed = compare("num_blocks = 5\nwasted_slots = 10\n" + src + "\nprint(num_blocks)", check)
    assert (typed.kind, typed.prelude) == ("added", "num_blocks = 5\nwasted_slots = 10\nprint(num_blocks)")
    call = compare("from labkit.exercises import check_exercise_2\ncheck_exercise_2(5, 10, 10 / 70)", check)
    assert (call.kind, call.args, call.prelude) == ("call", ("5", "10", "10 / 70"), "")
    assert compare('# CHECK exercise 2.1\nprint("✓ all good")', check).kind == "removed"
    assert compare("# CHECK exercise 2.1\nthis is not ( python", check).kind == "unreadable"
    keywords = _check_of("01_kv_cache.ipynb", "1.3")
    assert compare(keywords.source.replace("fraction_used=fraction_used, ", "") + "", keywords).kind == "call"


def _check_of(notebook: str, exercise: str):
    return next(c for c in Distributed.read(PATHS.notebooks / notebook).checks if c.exercise == exercise)


@pytest.mark.parametrize("notebook", sorted(p.name for p in PATHS.notebooks.glob("*.ipynb")))
def test_every_check_cell_names_one_grader_that_can_judge_outside_the_kernel(notebook):
    """Each check cell calls one grader (imported in it or earlier), importable here, and each
    grader reads plain data or has a probe and a judge: none is left to judge in the kernel."""
    lab = Distributed.read(PATHS.notebooks / notebook)
    assert [c.exercise for c in lab.checks] == exercises_of(read(PATHS.notebooks / notebook))
    for check in lab.checks:
        grader = check.function()
        assert grader.__name__ == check.grader.split(":")[1]
        if check.grader in IN_KERNEL:                   # each one named, with the reason, in probe.py
            assert form(grader) == "verdict"
        else:
            assert form(grader) in ("plain", "ran"), f"{check.exercise}: {check.grader} is judged in the kernel"


def test_graders_judged_in_the_kernel_are_few_and_named():
    assert IN_KERNEL == frozenset()       # every grader reads plain data or has a probe and a judge


# ---- flags: what reaches the grading machinery, and no false alarm ---------------------------------------
def test_integrity_flags_what_reaches_the_grading_machinery():
    distributed = ["from labkit.exercises.bughunt import naive, paged, time_allocations"]
    graders = {"check_exercise_2", "check_free_list_test"}
    cells = [
        (0, "from labkit.exercises.bughunt import naive, paged\nfrom labkit.exercises import check_exercise_2"),
        (1, "from labkit.exercises.memory import shared_prompt_counts"),
        (2, "import labkit.exercises.bughunt as b\nb.check_free_list_test = print"),
        (3, "import labkit\nx = labkit.exercises._grading.fail"),
        (4, "import importlib\nm = importlib.import_module('labkit.exercises.memory')"),
        (5, "def check_exercise_2(*args):\n    pass"),
        (6, "%%time\nfrom labkit.exercises._grading import fail"),
        (7, "this is not python"),
        (8, "get_ipython().input_transformers_cleanup.append(lambda lines: [])"),
        (9, "import builtins\nbuiltins.__import__ = None"),
        (10, "import sys\nsys.modules['labkit.exer' + 'cises.memory'].x = 1"),
        (11, "import os, signal\nos.kill(1, signal.SIGKILL)"),
        (12, "exec(open('/work/solutions/02_paging.ipynb').read())"),
        (13, "!kill -9 -1\n!ls -la\n!pip list"),
        (14, "f = lambda: 0\nf.__closure__"),
        (15, "from labkit.grade import probe"),
    ]
    got = [u.text() for u in forbidden(cells, distributed, graders)]
    assert got == [
        "cell 2 imports labkit.exercises.memory.shared_prompt_counts",
        "cell 3 imports labkit.exercises.bughunt",
        "cell 3 replaces labkit.exercises.bughunt.check_free_list_test",
        "cell 4 refers to labkit.exercises._grading.fail",
        "cell 5 imports importlib",
        "cell 5 names in a string 'labkit.exercises.memory'",
        "cell 6 defines check_exercise_2",
        "cell 7 imports labkit.exercises._grading.fail",
        "cell 9 uses ….input_transformers_cleanup",
        "cell 10 imports builtins",
        "cell 10 uses builtins.__import__",
        "cell 10 replaces builtins.__import__",
        "cell 11 uses sys.modules",
        "cell 12 imports signal",
        "cell 12 uses os.kill",
        "cell 13 uses exec()",
        "cell 13 names in a string '/work/solutions/02_paging.ipynb'",
        "cell 14 runs the shell command `kill -9 -1`",
        "cell 15 uses f.__closure__",
        "cell 16 imports labkit.grade.probe",
    ]


def test_honest_code_raises_no_flag():
    """Names that start with check, looking at code, timing, threads, printing: all honest."""
    cells = [(0, "check_count = 3\ncheck_id = 'x'\ndef check_total():\n    return check_count\n"
                 "class check_list(list):\n    pass"),
             (1, "import inspect\nfrom labkit.exercises.bughunt import naive\n"
                 "print(inspect.getsource(naive.BlockManager))"),
             (2, "import time, threading, math, os\nt = time.perf_counter()\nos.environ.get('HOME')\nos.getcwd()"),
             (3, '"""A docstring that mentions labkit.exercises and the solutions of builtins."""\nx = 1'),
             (4, "%time x = sum(range(10))\n!nvidia-smi\n!pip list\n%pip install plotly"),
             (5, "import plotly.io as pio\npio.renderers.default = 'notebook'\nimport torch\n"
                 "torch.backends.cudnn.benchmark = True"),
             (6, "%pip install -q labkit\nimport importlib.util, sys\nif 'google.colab' in sys.modules:\n    pass")]
    distributed = ["%pip install labkit\nimport importlib.util, sys\n"
                   "if 'google.colab' in sys.modules:\n    import plotly.io",
                   "from labkit.exercises.bughunt import naive, paged, time_allocations"]
    assert forbidden(cells, distributed, {"check_exercise_2"}) == []
    assert [u.text() for u in forbidden([(0, "import sys\nsys.modules.clear()")], distributed)] == [
        "cell 1 uses sys.modules"]                     # outside an install cell: flagged


@pytest.mark.parametrize("solution", [p for p in PATHS.solution_files() if (PATHS.notebooks / p.name).exists()],
                         ids=lambda p: p.stem)
def test_a_solved_notebook_handed_in_as_is_raises_no_flag(solution):
    """No false alarms: every chapter's solution, as a submission, keeps its check cells and does
    nothing the static reading flags."""
    lab = Distributed.read(PATHS.notebooks / solution.name)
    row = Row("s", solution.name, "f")
    cells, places = prepare(row, read(solution), lab)
    assert row.flags == [] and row.notes == [] and sorted(places) == sorted(lab.exercises)


# ---- answers cross as plain data; the verdict is reached outside the kernel ----------------------------
def _handed(cells, namespace: dict) -> dict[str, list[str]]:
    """What the answer cells of a run plan hand in, their expressions evaluated in ``namespace``
    (as IPython evaluates a user expression: no transformer involved)."""
    return {c.exercise: [eval(c.expression, namespace)] for c in cells if c.exercise}


def _solved_namespace() -> dict:
    namespace: dict = {}
    for cell in _solved().cells:
        if cell.cell_type == "code" and ("BEGIN SOLUTION" in cell.source or cell.source.startswith("import math")):
            exec("from labkit.exercises.bughunt import naive, paged, time_allocations\nimport math\n"
                 + cell.source.split("print(")[0], namespace)
    return namespace


def test_answers_reach_the_graders_as_json_and_get_their_verdicts():
    lab = Distributed.read(PATHS.notebooks / CHAPTER)
    row = Row("s", CHAPTER, "f", [Result(e, NOT_RUN, points(e)) for e in lab.exercises])
    cells, places = prepare(row, _solved(), lab)
    handed = _handed(cells, _solved_namespace())
    for exercise, texts in handed.items():
        assert judge(places[exercise].check, texts, places[exercise].plan).status == JUDGED_PASS, exercise
        json.loads(texts[0])                                          # plain JSON, nothing else
    wrong = {**_solved_namespace(), "num_blocks": 4, "test_shared_blocks_survive_a_free": lambda impl: None}
    handed = _handed(cells, wrong)
    verdict = judge(places["2.1"].check, handed["2.1"], {})
    assert verdict.status == "fail" and verdict.hint.startswith("num_blocks: 4 is not right")
    verdict = judge(places["2.4"].check, handed["2.4"], places["2.4"].plan)
    assert verdict.status == "fail" and "passes on the naive implementation" in verdict.hint
    unanswered = judge(places["2.1"].check, _handed(cells, {})["2.1"], {})
    assert unanswered.status == UNANSWERED and "NameError" in unanswered.hint


def test_the_judge_reads_only_plain_data_and_never_takes_a_kernel_at_its_word():
    check = _check("2.1")
    fine = json.dumps({"exercise": "2.1", "plain": {"args": [5, 10, 10 / 70], "kwargs": {}}})
    assert judge(check, [fine], {}).status == JUDGED_PASS
    for handed, hint in (
            ([], "no answer reached the grader"),
            ([fine, fine], "2 answers were handed in"),
            (["not json"], "not readable data"),
            (["[" * 100_000], "not readable data"),
            ([json.dumps({"exercise": "2.2", "plain": {"args": [5, 10, 10 / 70], "kwargs": {}}})],
             "not this exercise's"),
            ([json.dumps({"exercise": "2.1", "verdict": {"status": "pass"}})], "not in the form its grader reads"),
            ([json.dumps({"exercise": "2.1", "ran": {"outcomes": []}})], "not in the form its grader reads"),
            ([json.dumps({"exercise": "2.1", "plain": {"args": [5, 10], "kwargs": {}}})], "2.1"),
            ([json.dumps({"exercise": "2.1", "plain": {"args": [{"__object__": "Yes", "repr": "5"}, 10, 0.14],
                                                        "kwargs": {}}})], "num_blocks"),
            ([json.dumps({"exercise": "2.1", "error": "RuntimeError: boom"})], "could not be handed in")):
        verdict = judge(check, handed, {})
        assert verdict.status == "fail" and hint in verdict.hint, (handed[:1], verdict)
    code = _check("2.2")
    plan = code.function().plan(random.Random(0))
    forged = {"name": "t", "outcomes": [{"kind": k, "result": "passed"} for k in plan["order"]][:-1]}
    assert "could not be read" in judge(code, [json.dumps({"exercise": "2.2", "ran": forged})], plan).hint
    said = judge(code, [json.dumps({"exercise": "2.2", "ran": {"name": "t", "outcomes": [
        {"kind": "correct", "result": "passed"} for _ in plan["order"]]}})], plan)
    assert said.status == "fail" and "passes on the naive implementation" in said.hint   # the plan's kinds count


def test_bug_hunt_runs_come_in_an_order_a_counting_test_cannot_guess():
    orders = {tuple(bughunt.run_plan(random.Random(seed), 2, 3)["order"]) for seed in range(300)}
    flawed_first = ("naive", "naive", "flaw", "flaw", "correct", "correct", "correct")
    assert len(orders) > 100 and all(sorted(o) == sorted(flawed_first) for o in orders)
    assert not any(all(k != "correct" for k in o[:4]) or all(k == "correct" for k in o[:3]) for o in orders)
    assert bughunt.run_plan(random.Random(7), 2, 3) == bughunt.run_plan(random.Random(7), 2, 3)
    calls = {"n": 0}

    def counting(impl):                        # fails the first four calls, passes afterwards
        calls["n"] += 1
        assert calls["n"] > 4, "counted"

    for _ in range(20):                        # each call draws a new order: it never passes
        calls["n"] = 0
        with pytest.raises(AssertionError, match="Exercise 2.2 .*(passes on|fails on the correct)"):
            bughunt.check_generated_tokens_test(counting)


@pytest.mark.slow
def test_verdicts_from_what_the_cells_raised():
    """Each exercise's result from what ran (no kernel): the rules of ``notebook._verdicts``."""
    lab = Distributed.read(PATHS.notebooks / CHAPTER)

    def verdicts(nb, namespace, errors: dict[int, tuple], stopped_at: int | None = None):
        row = Row("s", CHAPTER, "f", [Result(e, NOT_RUN, points(e)) for e in lab.exercises])
        cells, places = prepare(row, nb, lab)
        handed = _handed(cells, namespace)
        last = len(cells) if stopped_at is None else stopped_at + 1
        run = Execution({k: CellRun(c.index,
                                    errors.get(c.index) if not c.exercise else errors.get(("answer", c.exercise)),
                                    (errors.get(c.index) or ("",))[0] == "CellTimeout", c.exercise)
                         for k, c in enumerate(cells[:last])},
                        {e: t for e, t in handed.items()}, "stopped" if stopped_at is not None else None, stopped_at)
        _verdicts(row, cells, places, lab, run, 30)
        return [(r.status, r.hint) for r in row.results], row.notes, row.flags

    solved, unsolved = _solved(), _unsolved()
    value = _cell(solved, "num_blocks = math.ceil(70 / 16)")
    answers = _solved_namespace()
    got, notes, flags = verdicts(solved, answers, {2: ("ImportError", "no plotly")})
    assert [s for s, _ in got] == [PASS] * 4 and notes == ["cell 3 raised ImportError: no plotly"] and flags == []
    partial = {k: v for k, v in answers.items() if k not in ("num_blocks", "wasted_slots", "internal_fragmentation")}
    got, notes, _ = verdicts(solved, partial, {value: ("TypeError", "bad operand")})
    assert got[0] == (FAIL, f"cell {value + 1} raised TypeError: bad operand") and notes == []
    got, _, _ = verdicts(solved, partial, {})
    assert got[0] == (FAIL, "not answered: NameError: name 'num_blocks' is not defined")
    got, notes, _ = verdicts(unsolved, {},
                             {_cell(unsolved, "blocks are allocated whole"): ("NotImplementedError", "x")})
    assert [s for s, _ in got] == [NOT_ATTEMPTED] * 4 and notes == []        # stubs: not attempted, no note
    check_23 = _cell(solved, "# CHECK exercise 2.3")
    got, notes, _ = verdicts(solved, answers, {("answer", "2.3"): ("CellTimeout", "ran past")}, stopped_at=None)
    got, notes, _ = verdicts(solved, answers, {}, stopped_at=len(solved.cells))
    got, _, _ = verdicts(solved, answers, {}, stopped_at=_answer_slot(solved, lab, "2.3"))
    assert [s for s, _ in got] == [PASS, PASS, NOT_RUN, NOT_RUN]
    assert check_23 > value


TESTS = """\
import math as m
from labkit.exercises.bughunt import time_allocations
SIZE = 4


def _manager(impl):
    return impl.BlockManager(num_gpu_blocks=8, block_size=SIZE)


def test_slots(impl):
    manager = _manager(impl)
    scheduler = impl.Scheduler(manager)
    req = impl.SequenceRequest("a", prompt_tokens=list(range(6)), max_tokens=10)
    scheduler.add_request(req)
    while not req.is_finished:
        scheduler.schedule_iteration()
        if not req.is_finished:
            assert len(req.block_table) * manager.block_size >= req.num_tokens, f"short of slots ({m.pi:.0f})"


def stub(impl):
    raise NotImplementedError("write the test")


def reads_code(impl):
    assert impl.Scheduler.schedule_iteration.__closure__ is not None


crowd = object()


def uses_a_live_object(impl):
    assert crowd is not None


def outer(size):
    def inner(impl):
        return impl.BlockManager(num_gpu_blocks=size)
    return inner
"""


def _tests(tmp_path, name: str = "student_tests"):
    (tmp_path / f"{name}.py").write_text(TESTS, encoding="utf-8")
    sys.path.insert(0, str(tmp_path))
    try:
        import importlib
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))


def test_a_bug_hunt_test_is_handed_in_as_source_that_runs_on_its_own(tmp_path):
    from labkit.grade.probe import source_of
    mod = _tests(tmp_path)
    said = source_of(mod.test_slots)
    assert said["name"] == "test_slots" and "SIZE = 4" in said["source"] and "import math as m" in said["source"]
    assert "def _manager(impl)" in said["source"] and "crowd" not in said["source"]
    alone: dict = {}
    exec(said["source"], alone)                              # nothing of the module needed
    bughunt.check_generated_tokens_test(alone["test_slots"])
    for fn, why in ((mod.uses_a_live_object, "uses crowd, a object value of the notebook's"),
                    (mod.outer(8), "defined inside another function"), (lambda impl: None, "a lambda"),
                    (print, "not a function")):
        assert why in source_of(fn)["error"], fn


def test_a_passing_bug_hunt_test_is_judged_again_from_its_source_not_the_kernels_word(tmp_path):
    from labkit.grade.probe import source_of
    from labkit.grade.rerun import again
    lab = Distributed.read(PATHS.notebooks / CHAPTER)
    check = _check("2.2")
    plan = check.function().plan(random.Random(3))
    mod = _tests(tmp_path, "student_tests_2")
    calls = []

    def run(grader, source, name, plan):                      # the clean sandbox, here in-process
        calls.append(name)
        namespace: dict = {}
        exec(source, namespace)
        return check.function().probe(namespace[name], plan=plan)

    def kernel(test, forged: bool = False, source=None) -> list[str]:
        ran = ({"name": "t", "outcomes": [{"kind": k, "result": "passed" if k == "correct" else "assertion",
                                            "error": "AssertionError", "message": "x"} for k in plan["order"]]}
               if forged else check.function().probe(test, plan=plan))
        return [json.dumps({"exercise": "2.2", "ran": ran, "source": source_of(test) if source is None else source})]

    def verdict(handed):
        return again(check, judge(check, handed, plan), handed, plan, lab.code, lab.graders, run)

    assert verdict(kernel(mod.test_slots)).status == JUDGED_PASS and calls == ["test_slots"]
    forged = verdict(kernel(mod.stub, forged=True))                  # a kernel whose probe was replaced
    assert forged.status == "fail" and "NotImplementedError" in forged.hint
    assert "passed in its own kernel, not when run again on its own" in forged.seen
    calls.clear()
    closure = verdict(kernel(mod.reads_code, forged=True))
    assert closure.status == "fail" and "reads the implementations instead of testing" in closure.hint
    assert calls == [] and "its test, run again on its own, uses impl.Scheduler.schedule_iteration.__closure__" \
        in closure.seen
    missing = verdict(kernel(mod.test_slots, source=False))
    assert missing.status == "fail" and "handed in no source of its test" in missing.seen and calls == []
    unreadable = verdict(kernel(mod.test_slots, source={"error": "a lambda cannot be run on its own: write a def"}))
    assert unreadable.status == "fail" and "write a def" in unreadable.hint and unreadable.seen == []
    failing = kernel(mod.stub)                                       # a failing kernel's word stands: not run
    assert verdict(failing) == judge(check, failing, plan) and calls == []


def test_the_test_run_again_runs_in_a_process_of_its_own_and_cannot_forge_its_result(tmp_path):
    from labkit.grade.guard import Guard
    from labkit.grade.probe import source_of
    from labkit.grade.rerun import run_source
    from labkit.grade.sandbox import Limits, Sandbox, make_plan
    box = Sandbox("none", make_plan([PATHS.solutions]), Limits(memory_mb=1024))
    plan = bughunt.check_generated_tokens_test.plan(random.Random(5))
    grader = "labkit.exercises.bughunt:check_generated_tokens_test"
    mod = _tests(tmp_path, "student_tests_3")
    said = source_of(mod.test_slots)
    guard = Guard()
    try:
        ran = run_source(box, guard, tmp_path, 0, 60, grader, said["source"], said["name"], plan)
        bughunt.check_generated_tokens_test.judge(ran, plan=plan)
        forged = json.dumps({"ran": {"name": "t", "outcomes": []}})
        printing = f"print({forged!r})\nimport sys\nsys.stdout.write({forged!r})\n\n" + said["source"]
        assert run_source(box, guard, tmp_path, 0, 60, grader, printing, "test_slots", plan) == ran
        assert "KeyError" in run_source(box, guard, tmp_path, 0, 60, grader, said["source"], "nope", plan)
        assert "timeout" in run_source(box, guard, tmp_path, 0, 2, grader, "while True:\n    pass\n", "x", plan)
    finally:
        guard.close()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("0-again-")] == []


def _answer_slot(nb, lab, exercise: str) -> int:
    cells, _ = prepare(Row("s", CHAPTER, "f"), nb, lab)
    return next(k for k, c in enumerate(cells) if c.exercise == exercise)


# ---- the reports ---------------------------------------------------------------------------------------------
def test_reports_escape_what_students_wrote_and_stay_plain_off_a_terminal():
    evil = "<script>alert('x')</script>, \"quoted\""
    rows = [Row("<b>mallory</b>", CHAPTER, "m.ipynb", [Result("2.1", FAIL, 1, evil), Result("2.2", PASS, 3)],
                flags=[f"cell 3 imports {evil}"], notes=["line one; line two"], sandbox="bwrap"),
            Row("zoe", CHAPTER, "z.ipynb", [Result("2.1", NOT_ATTEMPTED, 1), Result("2.2", PASS, 3)], sandbox="bwrap")]
    book = Gradebook(rows, ["2.1", "2.2"], 12.0, 2, "bwrap (test)")
    page = html_text(book)
    assert "<script>" not in page and "<b>mallory" not in page and "&lt;script&gt;" in page
    assert "<link" not in page and "src=" not in page                    # self-contained
    records = list(csv.DictReader(io.StringIO(csv_text(book))))
    assert records[0]["2.1"] == f"fail: {evil}" and records[0]["points"] == "3" and records[0]["max_points"] == "4"
    assert records[1]["2.1"] == "not attempted" and records[1]["points"] == "3" and records[1]["sandbox"] == "bwrap"
    text = summary_text(book) + row_line(rows[0], 1, 2)
    assert "\033[" not in text and "sandbox: bwrap (test)" in text
    assert re.search(r"^2\.1\s+1\s+0\s+1\s+1\s+0\s", summary_text(book), re.M)
    assert "\033[" in row_line(rows[1], 2, 2, colour=True)
    assert "Per student" not in page                                     # one notebook: nothing to add up
    rows.append(Row("zoe", "03_sharing.ipynb", "z3.ipynb", [Result("3.1", PASS, 2)]))
    page = html_text(Gradebook(rows, ["2.1", "2.2", "3.1"], 12.0, 2))
    assert "<td>zoe</td><td class='num'>3</td><td class='num'>2</td><td class='num'>5/6</td>" in page


@pytest.mark.parametrize("name", ['=HYPERLINK("http://x","y")', "+1+1", "-2+3", "@SUM(A1)", "\t=1", "\r=1"])
def test_the_csv_never_holds_a_formula_and_every_cell_is_one_line(name):
    rows = [Row(name, CHAPTER, f"{name}/x.ipynb", [Result("2.1", FAIL, 1, "=evil\nsecond line")],
                flags=["-flag\r\nmore"], notes=["@note\u2028next"], sandbox="none")]
    records = list(csv.reader(io.StringIO(csv_text(Gradebook(rows, ["2.1"], 1.0, 1)))))
    assert len(records) == 2
    for value in records[1]:
        assert not value.startswith(("=", "+", "-", "@", "\t", "\r")) and "\n" not in value and "\r" not in value
    assert records[1][0].lstrip("'").strip() == name.strip()


def test_cli_refuses_bad_arguments_clearly(tmp_path, capsys):
    from labkit.grade.__main__ import main
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert main([str(tmp_path)]) == 2
    assert "no .ipynb files" in capsys.readouterr().err
    for bad in (["--jobs", "0"], ["--memory", "0"], ["--max-output", "-1"], ["--sandbox", "docker"]):
        with pytest.raises(SystemExit):
            main([str(tmp_path), *bad])
    (tmp_path / "a").mkdir()
    nbformat.write(nbformat.v4.new_notebook(), tmp_path / "a" / CHAPTER)
    assert main([str(tmp_path), "--notebook", "99_nope.ipynb"]) == 2
    assert "not notebooks of the lab" in capsys.readouterr().err


# ---- the kernel: timeouts ---------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.notebook
def test_a_loop_is_interrupted_and_a_kernel_deaf_to_interrupts_ends_its_run(tmp_path):
    import labkit
    from labkit.grade.execute import Cell, run_cells
    from labkit.grade.guard import Guard
    from labkit.grade.sandbox import Limits, detect, kernel_env, make_plan
    plan = make_plan([PATHS.solutions])
    box, _ = detect("auto", plan=plan, limits=Limits(), forbidden=[str(PATHS.solutions)], readonly=labkit.__path__[0])
    sources = ["x = 1", "while True:\n    pass", "y = x + 1",
               "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass", "z = 3"]
    guard = Guard()
    env = kernel_env(plan) if box.kind != "none" else kernel_env(plan, home=str(tmp_path / "home"))
    (tmp_path / "home" / "notebook").mkdir(parents=True)
    try:
        run = run_cells([Cell(i, src) for i, src in enumerate(sources)], box, tmp_path, timeout=3, guard=guard,
                        env=env, grace=3)
    finally:
        guard.close()
    assert [(c.index, c.error is None, c.timed_out) for c in run.cells.values()] == [
        (0, True, False), (1, False, True), (2, True, False), (3, False, True)]      # z = 3 never ran
    assert run.stopped_at == 3 and "did not stop when interrupted" in run.stopped
    # ... and the deaf kernel is gone when the run ends: left spinning, it would take CPU from
    # every notebook graded after it (its command line names this test's folder).
    import time

    import psutil

    def left() -> list[int]:
        return [p.pid for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or ())]
    deadline = time.monotonic() + 10
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left(), "the kernel (or its sandbox) outlived its run"


# ---- the fixture class, graded by make grade -----------------------------------------------------------
#: Each row: student, notebook, file, points, the exercises' cells (a grader's hint by its first
#: words: the graders' wording is theirs), flags, notes. ``$name`` is a cell number of build_class.
EXPECTED_ROWS = [
    ("alice", CHAPTER, "alice/02_paging.ipynb", 10, ["pass"] * 4, "", ""),
    ("bob", CHAPTER, "bob__02_paging.ipynb", 0, ["not attempted"] * 4, "", ""),
    ("carol", CHAPTER, "carol/02_paging.ipynb", 3,
     ["fail: num_blocks: 4", "fail: Exercise 2.2 (flaw 1, generated tokens): test_generated_tokens_have_slots "
      "passes on the naive implementation", "pass", "not attempted"], "", ""),
    ("dave", CHAPTER, "dave/02_paging.ipynb", 6,
     ["fail: internal_fragmentation: 0.125", "pass",
      "fail: the answer handed in is not in the form its grader reads (ran)", "pass"],
     "edited check cell 2.1: its grader call was removed (graded with the distributed one); "
     "cell $patch imports labkit.exercises.bughunt; "
     "cell $patch replaces labkit.exercises.bughunt.check_free_list_test; "
     "check 2.3: handed in a verdict answer where the grader reads ran; "
     "check 2.3: labkit.exercises.bughunt.check_free_list_test is not labkit's grader", ""),
    ("frank", CHAPTER, "frank/02_paging.ipynb", 9,
     ["fail: cell $loop ran past the 30 s timeout", "pass", "pass", "pass"],
     "cell $loop ran past the 30 s timeout", ""),
    ("grace", CHAPTER, "grace/02_paging.ipynb", 4, ["pass", "pass", "not run", "not run"], "",
     "cell $exit raised SystemExit: done here; "
     "the kernel died by cell $dead (exit(), os._exit, a crash or out of memory)"),
    ("judy", CHAPTER, "judy/02_paging.ipynb", 0, ["not run"] * 4, "",
     "corrupt: not JSON (JSONDecodeError: Expecting ',' delimiter: line 1 column 51 (char 50))"),
    ("kim", CHAPTER, "", 0, ["not run"] * 4, "", "missing: not handed in"),
    ("kim", "my_homework.ipynb", "kim/my_homework.ipynb", 0, [""] * 4, "unknown notebook: not one of the lab's", ""),
    ("stray", "stray.ipynb", "stray.ipynb", 0, [""] * 4,
     "cannot tell whose it is: put it in a folder named after the student, or name it <student>__stray.ipynb", ""),
]


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
    text = graded["grades"].read_text(encoding="utf-8")
    records = list(csv.DictReader(io.StringIO(text)))
    assert list(records[0])[:5] == ["student", "notebook", "file", "points", "max_points"]
    assert list(records[0])[-3:] == ["flags", "notes", "sandbox"]
    fill = (lambda t: string.Template(t).substitute(graded["cells"]))
    for record, (student, notebook, file, points_, cells, flags, notes) in zip(records, EXPECTED_ROWS, strict=True):
        assert (record["student"], record["notebook"], record["file"], int(record["points"])) == \
            (student, notebook, file, points_), record
        for exercise, want in zip(("2.1", "2.2", "2.3", "2.4"), cells):
            assert record[exercise].startswith(fill(want)) and (want.startswith("fail") or record[exercise] == want), \
                (student, exercise, record[exercise])
        assert (record["flags"], record["notes"]) == (fill(flags), fill(notes)), record
        assert record["sandbox"] in ("bwrap", "unshare"), record["sandbox"]


@pytest.mark.slow
@pytest.mark.notebook
def test_the_report_and_the_terminal_say_the_same(graded):
    page = graded["report"].read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.count("<tr>") == 1 + 4 + 1 + 10
    assert "edited check cell 2.1" in page and "&lt;student&gt;__stray.ipynb" in page and "sandbox:" in page
    out = graded["stdout"]
    assert "\033[" not in out                                  # not a terminal: no colour codes
    assert re.search(r"^2\.1\s+1\s+2\s+3\s+1\s+2\s", out, re.M), out     # the summary table
    assert "flagged (4):" in out and f"wrote {graded['grades']}" in out and out.startswith("sandbox: ")


@pytest.mark.slow
@pytest.mark.notebook
def test_grading_touched_no_submission(graded):
    after = {p: p.read_bytes() for p in graded["subs"].rglob("*") if p.is_file()}
    assert after == graded["before"]
