"""The lab's notebooks: solutions pass grading, student versions fail only where they should.

* ``notebooks/`` is exactly what ``python -m labkit.notebooks generate`` makes of
  ``solutions/``, and no notebook stores outputs, execution counts or widget state;
* every notebook follows the conventions (Colab cell first, kernelspec, check cells);
* every solution notebook passes ``pytest --nbval-lax`` (the grading command, run in a
  subprocess on the file itself);
* every student notebook, run top to bottom, fails, and only in its stub cells (``raise
  NotImplementedError``) and its ``# CHECK`` cells, and every check cell fails: no
  exercise passes unsolved, and no explanation cell depends on an answer;
* the grading command reports a student notebook's failures cell by cell.

plus fast unit tests of the generator. The graders have their own tables
(``tests/test_exercises.py``, ``tests/test_exercises_ch4_8.py``), and the run of each student
notebook is also scanned for answers printed before their check (``tests/test_answer_leaks.py``
scans the sources). The module is marked
``notebook``; the tests that run notebooks are also ``slow`` (the whole lab runs twice:
~3.5 min on 2 idle cores). Notebooks that use the real model are skipped, with the reason,
when it is not cached (``make model``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("nbval")

from test_answer_leaks import declared_forms, leaks  # noqa: E402

from labkit.notebooks import (CHECK_PREFIX, DEFAULT_HINT, NotebookError, Paths, check,  # noqa: E402
                              dumps, generate, is_check_cell, is_solution_cell, is_stub_cell,
                              needs_model, read, strip, stored_state, student_version, stub_source,
                              verify_submission)

pytestmark = pytest.mark.notebook

ROOT = Path(__file__).resolve().parent.parent
PATHS = Paths(ROOT)
SOLUTIONS = PATHS.solution_files()
STUDENT = [PATHS.notebooks / p.name for p in SOLUTIONS]
COLAB_URL = "git+https://github.com/labkit-lab/labkit"
CELL_TIMEOUT_S = 600
# PyTorch's OpenMP threads spin while they wait; on a busy machine (other tests, other users)
# that makes a decode step 10-20x slower. Kernels started from here inherit this.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")



def _model_cached() -> bool:
    try:
        from labkit.model.loader import _cache_complete, default_model_dir
        return _cache_complete(default_model_dir())
    except Exception:   # noqa: BLE001
        return False


def _skip_without_model(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    if needs_model(text) and not _model_cached():
        pytest.skip(f"{path.name} needs the default model, which is not cached here (make model)")


def _ids(paths):
    return [p.stem for p in paths]


# ---- static checks -----------------------------------------------------------------------
def test_there_are_notebooks():
    assert len(SOLUTIONS) >= 7, f"expected chapters 0-6 at least in solutions/, found {[p.name for p in SOLUTIONS]}"


def test_generated_notebooks_are_up_to_date():
    problems = check(PATHS)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", SOLUTIONS + STUDENT, ids=[f"solutions/{p.stem}" for p in SOLUTIONS]
                         + [f"notebooks/{p.stem}" for p in STUDENT])
def test_no_stored_outputs_or_widget_state(path):
    assert path.exists(), f"{path} is missing: python -m labkit.notebooks generate"
    assert not stored_state(read(path)), stored_state(read(path))


@pytest.mark.parametrize("path", SOLUTIONS, ids=_ids(SOLUTIONS))
def test_conventions(path):
    nb = read(path)
    assert nb.metadata.get("kernelspec", {}).get("name"), "no kernelspec: JupyterLab would ask for a kernel"
    first = nb.cells[0]
    assert first.cell_type == "code" and '"google.colab" in sys.modules' in first.source, \
        "the first cell must install labkit on Colab only (guarded by 'google.colab' in sys.modules)"
    assert COLAB_URL in first.source, f"the Colab cell must install from {COLAB_URL}"
    checks = [c for c in nb.cells if is_check_cell(c)]
    solutions = [i for i, c in enumerate(nb.cells) if is_solution_cell(c)]
    assert solutions, "no exercise: no ### BEGIN SOLUTION region"
    assert checks, f"no check cell (a code cell whose first line starts with {CHECK_PREFIX!r})"
    for i in solutions:
        assert any(is_check_cell(c) for c in nb.cells[i + 1:]), f"the exercise in cell {i} is never checked"
    for c in checks:
        assert "check" in c.source.split("\n", 1)[-1], f"check cell calls no grader: {c.source[:80]!r}"


# ---- running the notebooks ------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("path", SOLUTIONS, ids=_ids(SOLUTIONS))
def test_solution_passes_grading(path):
    """``pytest --nbval-lax`` on the solution notebook: every cell runs without raising."""
    _skip_without_model(path)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "-p", "no:cacheprovider",
         f"--nbval-cell-timeout={CELL_TIMEOUT_S}", "-q", "-o", "addopts=", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=30 * 60)
    took = time.monotonic() - t0
    assert proc.returncode == 0, f"{path.name} fails under nbval ({took:.0f} s):\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    print(f"{path.name}: passed under nbval in {took:.0f} s")


def _run_allowing_errors(path: Path):
    """Execute a notebook cell by cell; return (notebook, indices of cells that raised)."""
    from nbclient import NotebookClient
    nb = read(path)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    failed = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
              and any(o.get("output_type") == "error" for o in c.get("outputs", []))]
    return nb, failed


def _describe(nb, i) -> str:
    err = next(o for o in nb.cells[i].outputs if o.get("output_type") == "error")
    return f"cell {i} ({nb.cells[i].source.splitlines()[0][:60]!r}): {err['ename']}: {err['evalue'][:200]}"


@pytest.mark.slow
@pytest.mark.parametrize("path", STUDENT, ids=_ids(STUDENT))
def test_student_notebook_fails_only_in_check_cells(path):
    _skip_without_model(path)
    nb, failed = _run_allowing_errors(path)
    stubs = {i for i, c in enumerate(nb.cells) if is_stub_cell(c)}
    checks = {i for i, c in enumerate(nb.cells) if is_check_cell(c)}
    assert failed, f"{path.name} passes unsolved: its check cells do not grade anything"
    elsewhere = [i for i in failed if i not in stubs | checks]
    assert not elsewhere, ("cells that are neither exercises nor checks fail in the unsolved notebook "
                           "(they must not use an exercise's answer):\n"
                           + "\n".join(_describe(nb, i) for i in elsewhere))
    passing_checks = sorted(checks - set(failed))
    assert not passing_checks, ("check cells pass in the unsolved notebook: "
                                + ", ".join(f"cell {i}" for i in passing_checks))
    forms, _ = declared_forms()
    printed = leaks(nb, forms, f"notebooks/{path.name}, run unsolved")
    assert not printed, "a cell prints an exercise's answer before its check:\n" + "\n".join(printed)


@pytest.mark.slow
def test_grading_command_reports_each_unsolved_exercise():
    """``pytest --nbval-lax`` on an unsolved notebook: one failed test item per stub or
    check cell that raises (chapter 1: quick, no model needed)."""
    path = PATHS.notebooks / "01_kv_cache.ipynb"
    if not path.exists():
        pytest.skip("notebooks/01_kv_cache.ipynb is missing")
    _skip_without_model(path)
    nb = read(path)
    raising = [c for c in nb.cells if is_check_cell(c) or (is_stub_cell(c) and "def " not in c.source)]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "-p", "no:cacheprovider",
         "-q", "-o", "addopts=", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=15 * 60)
    assert proc.returncode == 1, proc.stdout[-3000:]
    m = re.search(r"(\d+) failed", proc.stdout)
    assert m and int(m.group(1)) == len(raising), proc.stdout[-3000:]


# ---- the generator -----------------------------------------------------------------------------
def test_stub_replaces_each_region_keeping_indentation_and_hint():
    src = ("x = 1\n"
           "### BEGIN SOLUTION hint: add \"one\"\n"
           "y = x + 1\n"
           "### END SOLUTION\n"
           "def f(a):\n"
           "    ### BEGIN SOLUTION\n"
           "    return a\n"
           "    ### END SOLUTION\n"
           "print(y)")
    assert stub_source(src) == ("x = 1\n"
                                'raise NotImplementedError("add \\"one\\"")\n'
                                "def f(a):\n"
                                f"    raise NotImplementedError(\"{DEFAULT_HINT}\")\n"
                                "print(y)")
    assert stub_source("no regions\nhere") == "no regions\nhere"


@pytest.mark.parametrize("src, message", [
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION", "inside the region"),
    ("x\n### END SOLUTION", "without BEGIN"),
    ("### BEGIN SOLUTION\nx = 1", "never closed"),
    ("### BEGIN SOLUTIONS\nx\n### END SOLUTION", "malformed marker"),
])
def test_stub_rejects_unbalanced_or_malformed_markers(src, message):
    with pytest.raises(NotebookError, match=message):
        stub_source(src)


def _notebook(cells, **metadata):
    nb = nbformat.v4.new_notebook(metadata=metadata)
    for i, (kind, src) in enumerate(cells):
        cell = nbformat.v4.new_code_cell(src) if kind == "code" else nbformat.v4.new_markdown_cell(src)
        cell.id = f"c{i}"
        nb.cells.append(cell)
    return nb


def test_student_version_strips_run_state_and_keeps_the_kernelspec():
    nb = _notebook([("code", "### BEGIN SOLUTION\nx = 1\n### END SOLUTION"), ("code", "# CHECK\ncheck(x)")],
                   widgets={"application/vnd.jupyter.widget-state+json": {"state": {}}},
                   language_info={"name": "python", "version": "3.11.7"})
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", text="hi")]
    nb.cells[0].execution_count = 3
    nb.cells[0].metadata["execution"] = {"iopub.status.busy": "2026"}
    nb.cells[1].metadata["tags"] = ["keep-me"]
    out = student_version(nb)
    assert not stored_state(out)
    assert out.metadata["kernelspec"]["name"] == "python3"
    assert out.metadata["language_info"] == {"name": "python"}
    assert out.cells[0].source == f'raise NotImplementedError("{DEFAULT_HINT}")'
    assert out.cells[1].metadata["tags"] == ["keep-me"]
    assert is_stub_cell(out.cells[0]) and is_check_cell(out.cells[1]) and not is_check_cell(out.cells[0])
    with pytest.raises(NotebookError, match="code cells"):
        student_version(_notebook([("markdown", "### BEGIN SOLUTION\nx\n### END SOLUTION")]))


def test_generate_check_strip_and_verify(tmp_path):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "labkit").mkdir()
    paths = Paths(tmp_path)
    nb = _notebook([("code", "### BEGIN SOLUTION hint: h\nx = 1\n### END SOLUTION"),
                    ("code", "# CHECK exercise 1\nassert x == 1")])
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", text="ok")]
    (tmp_path / "solutions" / "01_x.ipynb").write_text(nbformat.writes(nb))
    problems = check(paths)
    assert any("stores outputs" in p for p in problems) and any("missing" in p for p in problems)
    assert strip(paths) == ["01_x.ipynb"] and strip(paths) == []
    assert generate(paths) == ["01_x.ipynb"] and generate(paths) == []
    assert check(paths) == []
    student = paths.notebooks / "01_x.ipynb"
    assert 'raise NotImplementedError(\\"h\\")' in student.read_text()
    assert dumps(read(student)) == student.read_text()                       # stable layout
    (paths.notebooks / "99_stale.ipynb").write_text(student.read_text())
    assert any("99_stale" in p for p in check(paths))
    student.write_text(student.read_text().replace("NotImplementedError", "NotImplementedErr0r"))
    assert any("differs" in p for p in check(paths))
    generate(paths)
    assert check(paths) == [] and not (paths.notebooks / "99_stale.ipynb").exists()

    submitted = read(student)
    assert verify_submission(student, paths) == []
    submitted.cells[1].source = "# CHECK exercise 1\npass"
    (tmp_path / "alice.ipynb").write_text(dumps(submitted))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "01_x.ipynb").write_text(dumps(submitted))
    assert any("edited" in p for p in verify_submission(tmp_path / "sub" / "01_x.ipynb", paths))
