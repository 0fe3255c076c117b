"""The lab's notebooks: solutions pass grading, student versions fail only where they should.

* ``notebooks/`` is exactly what ``python -m labkit.notebooks generate`` makes of
  ``solutions/``, and no notebook stores outputs, execution counts or widget state;
* every notebook follows the conventions: it opens on its title, the install cell comes right
  after it, labkit is imported before torch, check cells call graders; the install cell fails
  at once, saying what to set, where its source cannot be reached;
* the text matches the lab: chapter 0's map lists every chapter, no chapter says a feature
  labkit has is missing (nor that the compiled kernels need a newer GPU than they do, or that
  the T4 falls back), chapter 9's reading of its swap figures holds;
* every chapter runs once, in one kernel, as a student and solved (``grading_plan``): the student
  notebook, top to bottom, fails, and only in its stub cells (``raise NotImplementedError``) and
  its ``# CHECK`` cells, and every check cell fails, saying "not answered yet" rather than raising
  a ``NameError``: no exercise passes unsolved, and no explanation cell depends on an answer; at
  each check, the solution's exercise cells and the check run, then the cell before it and the
  check again, and pass both times (a verdict does not depend on how many times a cell ran);
* a solution notebook passes the grading command (``pytest --nbval-lax``, on chapter 1);
* the grading command reports a student notebook's failures cell by cell.

plus fast unit tests of the generator. The graders have their own tables
(``tests/test_exercises*.py``), and the run of each student notebook is also scanned for
answers printed before their check (``tests/test_answer_leaks.py`` scans the sources). The module
is marked ``notebook``; the tests that run notebooks are also ``slow``. Notebooks that use the
real model are skipped, with the reason, when it is not cached (``make model``).
"""

from __future__ import annotations

import importlib.util
import inspect
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

from labkit.notebooks import (CHECK_PREFIX, DEFAULT_HINT, NotebookError, Paths, check, colab,  # noqa: E402
                              dumps, generate, install_cell, install_cell_problems, is_check_cell,
                              is_solution_cell, is_stub_cell, is_title_cell, needs_model, read, strip,
                              stored_state, student_version, stub_source, torch_before_labkit,
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
    assert is_title_cell(nb.cells[0]) and re.match(r"# Chapter \d+ — ", nb.cells[0].source), \
        "a chapter opens on its title: '# Chapter N — ...'"
    assert not install_cell_problems(nb), install_cell_problems(nb)
    assert COLAB_URL in nb.cells[1].source, f"the install cell must install from {COLAB_URL} by default"
    checks = [c for c in nb.cells if is_check_cell(c)]
    solutions = [i for i, c in enumerate(nb.cells) if is_solution_cell(c)]
    assert solutions, "no exercise: no ### BEGIN SOLUTION region"
    assert checks, f"no check cell (a code cell whose first line starts with {CHECK_PREFIX!r})"
    for i in solutions:
        assert any(is_check_cell(c) for c in nb.cells[i + 1:]), f"the exercise in cell {i} is never checked"
    for c in checks:
        assert "check" in c.source.split("\n", 1)[-1], f"check cell calls no grader: {c.source[:80]!r}"


@pytest.mark.parametrize("path", SOLUTIONS + STUDENT, ids=[f"solutions/{p.stem}" for p in SOLUTIONS]
                         + [f"notebooks/{p.stem}" for p in STUDENT])
def test_labkit_is_imported_before_torch(path):
    """``import labkit`` sets how OpenMP's threads wait; it works only before torch loads."""
    first = torch_before_labkit(read(path))
    assert first is None, f"cell {first} of {path.name} imports torch (or a package that loads it) before labkit"


def test_torch_before_labkit_finds_the_order():
    def nb(*sources):
        return _notebook([("code", src) for src in sources])
    assert torch_before_labkit(nb("import torch\nimport labkit")) == 0
    assert torch_before_labkit(nb("import platform", "from transformers import AutoModel", "import labkit")) == 1
    assert torch_before_labkit(nb("import labkit  # first\nimport torch")) is None
    assert torch_before_labkit(nb("from labkit import LLM", "import torch")) is None
    assert torch_before_labkit(nb("x = 1")) is None


def _install_cell_as_python(source: str) -> str:
    from IPython.core.inputtransformer2 import TransformerManager
    return TransformerManager().transform_cell(install_cell(source))


@pytest.mark.parametrize("source", ["http://127.0.0.1:9/labkit-0.1.0-py3-none-any.whl",
                                    "/nonexistent/course/labkit-0.1.0-py3-none-any.whl",
                                    "git+http://127.0.0.1:9/labkit@fall"],
                         ids=["unreachable-url", "missing-wheel", "unreachable-git"])
def test_the_install_cell_fails_at_once_saying_what_to_set(tmp_path, source):
    """Where labkit is missing and its source cannot be reached, the install cell raises within
    seconds, naming LABKIT_SOURCE and where the wheel comes from (not a git error, then success)."""
    code = _install_cell_as_python(COLAB_URL)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["LABKIT_SOURCE"] = source
    t0 = time.monotonic()
    # -S: no site-packages, so labkit is missing, as on a fresh Colab runtime; the cell must fail
    # before it reaches pip (which -S would not find either)
    run = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=60)
    took = time.monotonic() - t0
    assert run.returncode != 0 and took < 15, (took, run.stdout, run.stderr)
    assert "RuntimeError: cannot reach" in run.stderr and "Set LABKIT_SOURCE" in run.stderr \
        and "make dist" in run.stderr, run.stderr


# ---- the text matches the lab -------------------------------------------------------------------------
def _markdown(nb) -> str:
    return "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")


def test_the_map_of_the_lab_lists_every_chapter():
    numbers = sorted(int(p.name[:2]) for p in SOLUTIONS if p.name[:2].isdigit() and p.name[:2] != "00")
    tour = _markdown(read(PATHS.solutions / "00_setup_and_tour.ipynb"))
    table = tour[tour.index("A map of the lab"):]
    listed = sorted(int(m) for m in re.findall(r"^\|\s*(\d+)\s+\S", table, re.MULTILINE))
    assert listed == numbers, f"chapter 0's map lists chapters {listed}, the lab has {numbers}"


#: What labkit has, how a chapter would mention it, and how to tell that it exists.
FEATURES = {
    "swapping": (r"\bswap", lambda: "preemption_mode" in inspect.signature(__import__("labkit").LLM).parameters),
    "log probabilities": (r"log[- ]?prob", lambda: hasattr(__import__("labkit").SamplingParams(), "logprobs")),
    "beam search": (r"beam search", lambda: hasattr(__import__("labkit"), "BeamSearchParams")),
    "API keys": (r"authenticat|api[- ]keys?", lambda: importlib.util.find_spec("labkit.server.auth") is not None),
    "a radix tree": (r"radix", lambda: importlib.util.find_spec("labkit.memory.radix_cache") is not None),
    "chunked prefill": (r"chunked prefill", lambda: "enable_chunked_prefill" in inspect.signature(
        __import__("labkit").LLM).parameters),
    "structured outputs": (r"structured output", lambda: hasattr(__import__("labkit").SamplingParams(),
                                                                "structured_outputs")),
    "streaming": (r"\bstream", lambda: True),
}
#: Ways of saying something is missing: the feature named after the phrase ("it adds what ... needs: X"),
#: or before it ("X is not implemented").
MISSING_AFTER = re.compile(r"adds what|\blacks\b|is missing:|are missing:|labkit (?:does not|cannot) ", re.IGNORECASE)
MISSING_BEFORE = re.compile(r"not (?:yet )?implemented|(?:is|are) not (?:yet )?supported|not available", re.IGNORECASE)


def missing_features(text: str) -> list[str]:
    """The features labkit has that a sentence of ``text`` says are missing."""
    found = []
    for sentence in re.split(r"(?<=[.!?])\s+", text.replace("\n", " ")):
        windows = [sentence[m.end():] for m in MISSING_AFTER.finditer(sentence)]
        windows += [sentence[:m.start()] for m in MISSING_BEFORE.finditer(sentence)]
        for name, (pattern, exists) in FEATURES.items():
            if any(re.search(pattern, w, re.IGNORECASE) for w in windows) and exists():
                found.append(f"{name}: {sentence.strip()[:160]}")
    return found


@pytest.mark.parametrize("path", SOLUTIONS, ids=_ids(SOLUTIONS))
def test_no_chapter_says_a_feature_labkit_has_is_missing(path):
    wrong = missing_features(_markdown(read(path)))
    assert not wrong, f"{path.name} says these are missing, but labkit has them:\n" + "\n".join(wrong)


#: A GPU the compiled kernels are said to need: "compute capability 8.0+", "8.0 or newer"...
NEEDS_CAPABILITY = re.compile(r"\b(\d+)\.(\d)(?:\+|\s+or\s+(?:newer|later|above|higher))")
#: ... or said not to run them: "the T4 falls back", "cannot run on a T4".
T4_REFUSED = re.compile(r"\bT4\b.*\b(?:falls?\s+back|cannot\s+run|can't\s+run|not\s+supported|refuse)"
                        r"|\b(?:falls?\s+back|cannot\s+run|can't\s+run)\b.*\bT4\b", re.IGNORECASE)
BF16 = re.compile(r"\bbf16\b|bfloat16", re.IGNORECASE)


def stale_gpu_claims(text: str) -> list[str]:
    """Sentences of ``text`` that say the compiled Triton kernels need a GPU newer than they do
    (labkit.kernels.MIN_COMPUTE_CAPABILITY, 7.5: the T4), or that a T4 falls back. bf16's own
    floor (8.0) may be named: a sentence about bf16 is not counted."""
    from labkit.kernels import MIN_COMPUTE_CAPABILITY
    found = []
    for sentence in re.split(r"(?<=[.!?])\s+", text.replace("\n", " ")):
        if BF16.search(sentence):
            continue
        above = [m.group(0) for m in NEEDS_CAPABILITY.finditer(sentence)
                 if (int(m.group(1)), int(m.group(2))) > tuple(MIN_COMPUTE_CAPABILITY)]
        if above or T4_REFUSED.search(sentence):
            found.append(sentence.strip()[:160])
    return found


@pytest.mark.parametrize("path", SOLUTIONS, ids=_ids(SOLUTIONS))
def test_no_chapter_says_the_kernels_need_a_newer_gpu_than_they_do(path):
    nb = read(path)
    wrong = stale_gpu_claims("\n".join(c.source for c in nb.cells if c.cell_type in ("markdown", "code")))
    assert not wrong, (f"{path.name} says the compiled kernels need compute capability above 7.5, or that "
                       "a T4 falls back (they run there, in fp16 or fp32):\n" + "\n".join(wrong))


def test_the_gpu_claim_scan_finds_what_the_chapters_used_to_say():
    """Sentences chapters 0 and 5 once had, and what they say now."""
    assert stale_gpu_claims("Triton compiles only for NVIDIA GPUs of compute capability 8.0 or newer "
                            "(A100, L4, H100...).")
    assert stale_gpu_claims("Colab's free T4 is 7.5, so there the engine falls back and says so.")
    assert stale_gpu_claims('print("No CUDA GPU of compute capability 8.0+ here: the compiled kernels are not run")')
    assert not stale_gpu_claims("Compiled, on an NVIDIA GPU of compute capability 7.5+: Colab's free T4 in fp16.")
    assert not stale_gpu_claims("A T4 has no bf16: bf16 needs compute capability 8.0+, and the engine falls back "
                                "to the torch reference for it.")
    assert not stale_gpu_claims('print(f"{name:>16}: {t * 1e6:8.0f} µs per call")')


def test_the_missing_feature_scan_finds_what_the_chapters_used_to_say():
    """Two sentences the lab once had (chapters 4 and 8), each about a feature labkit has."""
    assert missing_features("vLLM calls this recompute preemption; the alternative, swapping the blocks out "
                            "to CPU memory, is not implemented here.")
    assert len(missing_features("It adds what a shared service needs: authentication, request priorities, "
                                "log probabilities, and tensor parallelism.")) == 2
    assert not missing_features("Beyond what labkit has (API keys, log probabilities), it adds what a large "
                                "service needs: request priorities.")


def test_chapter_9_reads_its_swap_figures_right():
    """The chapter's simulation (the same call as its cell): swapping loses with the smallest
    blocks, the two modes stay within a few percent of each other from 16-token blocks on, and
    both get slower with large blocks, as the text below it says."""
    from labkit.sim import simulate, synthetic_trace
    from labkit.sim.roofline import roofline
    cm13 = roofline("llama-2-13b", "a100-80gb")
    trace = synthetic_trace("sharegpt", 60, rate=8, seed=0)
    latency = {(mode, bs): simulate(trace, block_size=bs, num_blocks=8192 // bs, cost_model=cm13, preemption_mode=mode,
                                    num_host_blocks=4 * 8192 // bs if mode == "swap" else 0,
                                    keep_records=False).metrics["normalized_latency_s"]
               for mode in ("recompute", "swap") for bs in (8, 16, 32, 64, 128, 256)}
    assert latency["swap", 8] > latency["recompute", 8]
    gaps = [latency["swap", bs] / latency["recompute", bs] - 1 for bs in (16, 32, 64, 128, 256)]
    assert max(abs(g) for g in gaps) < 0.05 and min(gaps) < 0 < max(gaps), gaps     # close, and no clear winner
    assert all(latency[mode, 256] > latency[mode, 64] for mode in ("recompute", "swap"))
    text = _markdown(read(PATHS.solutions / "09_beams_and_swaps.ipynb"))
    assert "within a few percent" in text and "a little ahead or even" not in text


# ---- running the notebooks ------------------------------------------------------------------
#: A step of a notebook's run: run a cell of the student notebook or of the solution, or enter or
#: leave an exercise's solved state (below).
STUDENT_CELL, SOLVED_CELL, ENTER, LEAVE = "student", "solved", "enter", "leave"


def grading_plan(nb) -> list[tuple[str, int]]:
    """How to run a chapter once, in one kernel, as a student and as its solution.

    The student notebook runs top to bottom. At each check cell, after the student's (unsolved)
    check ran, the exercise is *entered*: the solution's versions of the exercise cells since the
    previous check run, then the check; then the cell before the check and the check run again
    (a verdict must not depend on how many times a cell ran). Leaving the exercise puts the
    student's names back, so that the cells after it run as they would for a student who skipped
    it; the solutions' names are laid over the student's again on entering the next exercise (a
    later solution may use an earlier one's answer)."""
    plan: list[tuple[str, int]] = []
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    since_check: list[int] = []
    for k, i in enumerate(code):
        plan.append((STUDENT_CELL, i))
        if is_solution_cell(nb.cells[i]):
            since_check.append(i)
        if not is_check_cell(nb.cells[i]):
            continue
        plan += [(ENTER, -1)] + [(SOLVED_CELL, j) for j in since_check] + [(SOLVED_CELL, i)]
        if k > 0:
            plan += [(SOLVED_CELL, code[k - 1]), (SOLVED_CELL, i)]
        plan.append((LEAVE, -1))
        since_check = []
    return plan


def test_grading_plan_runs_each_exercise_unsolved_then_solved_twice():
    nb = _notebook([("markdown", "# t"), ("code", "a"), ("code", "### BEGIN SOLUTION\nx\n### END SOLUTION"),
                    ("markdown", "text"), ("code", "# CHECK exercise 1\ncheck(x)"), ("code", "b"),
                    ("code", "### BEGIN SOLUTION\ny\n### END SOLUTION"), ("code", "c"),
                    ("code", "# CHECK exercise 2\ncheck(y)")])
    S, V = STUDENT_CELL, SOLVED_CELL
    assert grading_plan(nb) == [(S, 1), (S, 2), (S, 4), (ENTER, -1), (V, 2), (V, 4), (V, 2), (V, 4), (LEAVE, -1),
                                (S, 5), (S, 6), (S, 7), (S, 8), (ENTER, -1), (V, 6), (V, 8), (V, 7), (V, 8),
                                (LEAVE, -1)]


#: Kernel code for entering and leaving an exercise. Leaving keeps each name the solution bound,
#: with the value the student had then; entering lays it over the student's names again unless the
#: student's value has changed since (a later cell rebound it, as it would in the solution too).
#: The names IPython keeps (``_``, ``_i3``, ``Out``...) and these steps' own are left alone.
_KEEP = r"^(_+|_i+|_i?\d+|_oh|_ih|_dh|In|Out|get_ipython|exit|quit|__lk_\w*)$"
_SETUP = (f"import re as __lk_re\n__lk_keep = __lk_re.compile({_KEEP!r}).match\n"
          "__lk_solved, __lk_none = {}, object()")
_ENTER = ("__lk_student = {k: v for k, v in globals().items() if not __lk_keep(k)}\n"
          "globals().update({k: v for k, (v, was) in __lk_solved.items() if __lk_student.get(k, __lk_none) is was})")
_LEAVE = ("for __lk_k in [k for k in globals() if not __lk_keep(k)]:\n"
          "    __lk_was = __lk_student.get(__lk_k, __lk_none)\n"
          "    if globals()[__lk_k] is not __lk_was:\n"
          "        __lk_solved[__lk_k] = (globals()[__lk_k], __lk_was)\n"
          "    if __lk_was is __lk_none:\n"
          "        del globals()[__lk_k]\n"
          "globals().update(__lk_student)")


def test_entering_and_leaving_an_exercise_swaps_its_names():
    scope: dict = {}
    for src in (_SETUP, "a = 1\nf = 'stub'\nh = 'stub'", _ENTER, "f = 'solved'\ng = f + '!'\nh = 'solved'",
                _LEAVE):
        exec(src, scope)
    assert (scope["a"], scope["f"], scope["h"], "g" in scope) == (1, "stub", "stub", False)
    exec("a = 2\nh = 'rebound'", scope)        # a cell after the exercise rebinds h
    exec(_ENTER, scope)
    assert (scope["a"], scope["f"], scope["g"], scope["h"]) == (2, "solved", "solved!", "rebound")
    exec(_LEAVE, scope)
    assert (scope["a"], scope["f"], scope["h"], "g" in scope) == (2, "stub", "rebound", False)
    exec(_ENTER, scope)
    assert (scope["f"], scope["g"]) == ("solved", "solved!")    # still there for a third exercise


def _run_plan(solution: Path, student: Path, plan: list[tuple[str, int]]):
    """Run ``plan`` in one kernel started in the student's folder, errors allowed; return the two
    notebooks (each cell keeps the outputs of its last run) and the errors of each, as
    [(cell index, error output), ...] in the order they happened."""
    from nbclient import NotebookClient
    nbs = {STUDENT_CELL: read(student), SOLVED_CELL: read(solution)}
    assert len(nbs[STUDENT_CELL].cells) == len(nbs[SOLVED_CELL].cells), f"{student} is stale: make notebooks"
    # the client stores each cell it ran into its own notebook, by index: give it a scratch copy
    client = NotebookClient(read(student), timeout=CELL_TIMEOUT_S, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(student.parent)}})
    errors: dict[str, list] = {STUDENT_CELL: [], SOLVED_CELL: []}

    def bookkeeping(source: str) -> None:
        cell = nbformat.v4.new_code_cell(source)
        client.execute_cell(cell, 0, store_history=False)
        assert not cell.outputs, f"entering or leaving an exercise failed: {cell.outputs}"

    with client.setup_kernel():
        bookkeeping(_SETUP)
        for kind, i in plan:
            if kind in (ENTER, LEAVE):
                bookkeeping(_ENTER if kind == ENTER else _LEAVE)
                continue
            cell = nbs[kind].cells[i]
            cell.outputs = []
            client.execute_cell(cell, i)
            errors[kind] += [(i, o) for o in cell.outputs if o.get("output_type") == "error"]
    return nbs[STUDENT_CELL], nbs[SOLVED_CELL], errors


def _describe(nb, i, err=None) -> str:
    err = err or next(o for o in nb.cells[i].outputs if o.get("output_type") == "error")
    return f"cell {i} ({nb.cells[i].source.splitlines()[0][:60]!r}): {err['ename']}: {err['evalue'][:300]}"


def test_the_run_finds_a_cell_that_uses_an_answer_and_lays_answers_over_later_exercises(tmp_path):
    """A chapter whose explanation cell prints exercise 1's answer, and whose exercise 2 builds on
    exercise 1's: the student's run finds the explanation cell (it fails there as the student's
    would), and exercise 2's solution finds exercise 1's answer."""
    cells = [("markdown", "# Chapter 1 — t"), ("code", "a = 1"),
             ("code", "### BEGIN SOLUTION\nx = a + 1\n### END SOLUTION"),
             ("code", "# CHECK exercise 1\nassert x == 2\nprint('✓')"), ("code", "print(x * 10)"),
             ("code", "### BEGIN SOLUTION\ny = x + 1\n### END SOLUTION"),
             ("code", "# CHECK exercise 2\nassert y == 3\nprint('✓')")]
    solution, student = tmp_path / "solutions" / "01_t.ipynb", tmp_path / "notebooks" / "01_t.ipynb"
    for path, nb in ((solution, _notebook(cells)), (student, student_version(_notebook(cells)))):
        path.parent.mkdir()
        path.write_text(dumps(nb))
    unsolved, solved, errors = _run_plan(solution, student, grading_plan(read(solution)))
    assert not errors[SOLVED_CELL], errors[SOLVED_CELL]
    assert [i for i, _ in errors[STUDENT_CELL]] == [2, 3, 4, 5, 6], errors[STUDENT_CELL]
    assert "NameError" in _describe(unsolved, 4) and "20" not in str(unsolved.cells[4].outputs)
    assert "✓" in str(solved.cells[6].outputs)


@pytest.mark.slow
@pytest.mark.parametrize("path", SOLUTIONS, ids=_ids(SOLUTIONS))
def test_each_exercise_fails_unsolved_then_passes_solved_twice(path):
    """One run per chapter (``grading_plan``), in one kernel:

    * as a student, top to bottom: the notebook fails, and only in its stub and check cells;
      every check fails, saying "not answered yet" where nothing was answered, and no NameError
      is shown; no cell prints an exercise's answer before its check; no explanation cell depends
      on an answer (the cells after an exercise run with the student's names, not the solution's);
    * solved: every solution cell and check runs without raising, and every check passes a
      second time after the cell before it ran again."""
    _skip_without_model(path)
    student = PATHS.notebooks / path.name
    t0 = time.monotonic()
    plan = grading_plan(read(path))
    unsolved, solved, errors = _run_plan(path, student, plan)
    took = time.monotonic() - t0

    assert not errors[SOLVED_CELL], (
        f"{path.name}, solved, with every check cell and the cell before it run twice ({took:.0f} s):\n"
        + "\n".join(_describe(solved, i, e) for i, e in errors[SOLVED_CELL]))
    checks = {i for i, c in enumerate(solved.cells) if is_check_cell(c)}
    assert all("✓" in "".join(o.get("text", "") for o in solved.cells[i].outputs) for i in checks)

    failed = sorted({i for i, _ in errors[STUDENT_CELL]})
    stubs = {i for i, c in enumerate(unsolved.cells) if is_stub_cell(c)}
    assert failed, f"{student.name} passes unsolved: its check cells do not grade anything"
    elsewhere = [i for i in failed if i not in stubs | checks]
    assert not elsewhere, ("cells that are neither exercises nor checks fail in the unsolved notebook "
                           "(they must not use an exercise's answer):\n"
                           + "\n".join(_describe(unsolved, i) for i in elsewhere))
    passing_checks = sorted(checks - set(failed))
    assert not passing_checks, ("check cells pass in the unsolved notebook: "
                                + ", ".join(f"cell {i}" for i in passing_checks))
    # Run All shows no NameError: a check whose answers are not defined says "not answered yet"
    name_errors = [i for i in failed for o in unsolved.cells[i].outputs if o.get("output_type") == "error"
                   and (o["ename"] == "NameError" or "NameError" in "".join(o.get("traceback", [])))]
    assert not name_errors, "NameError shown in " + ", ".join(_describe(unsolved, i) for i in name_errors)
    unanswered = [i for i in checks if any(o.get("ename") == "NotAnsweredYet" for o in unsolved.cells[i].outputs)]
    assert all("not answered yet" in _describe(unsolved, i) for i in unanswered)
    forms, _ = declared_forms()
    printed = leaks(unsolved, forms, f"notebooks/{student.name}, run unsolved")
    assert not printed, "a cell prints an exercise's answer before its check:\n" + "\n".join(printed)
    print(f"{path.name}: unsolved and solved in {took:.0f} s, {len(plan)} steps")


@pytest.mark.slow
def test_grading_command_passes_a_solution():
    """``pytest --nbval-lax`` (the grading command) on a solution notebook: every check passes
    under nbval (chapter 1: quick, no model needed)."""
    path = PATHS.solutions / "01_kv_cache.ipynb"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "-p", "no:cacheprovider",
         f"--nbval-cell-timeout={CELL_TIMEOUT_S}", "-q", "-o", "addopts=", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=30 * 60)
    assert proc.returncode == 0, f"{path.name} fails under nbval:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"


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
    nb = _notebook([("code", "import torch"), ("markdown", "# Chapter 1 — x"),
                    ("code", "### BEGIN SOLUTION hint: h\nx = 1\n### END SOLUTION"),
                    ("code", "# CHECK exercise 1\nassert x == 1")])
    nb.cells[3].outputs = [nbformat.v4.new_output("stream", text="ok")]
    (tmp_path / "solutions" / "01_x.ipynb").write_text(nbformat.writes(nb))
    problems = check(paths)
    assert any("stores outputs" in p for p in problems) and any("missing" in p for p in problems)
    assert any("open on its title" in p for p in problems) and any("imports torch before labkit" in p for p in problems)
    assert strip(paths) == ["01_x.ipynb"] and strip(paths) == []
    assert colab(paths) == ["01_x.ipynb"] and colab(paths) == []      # the title first, then the install cell
    fixed = read(tmp_path / "solutions" / "01_x.ipynb")
    assert is_title_cell(fixed.cells[0]) and fixed.cells[1].source == install_cell()
    fixed.cells[2].source = "import labkit\nimport torch"
    (tmp_path / "solutions" / "01_x.ipynb").write_text(dumps(fixed))
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
    submitted.cells[4].source = "# CHECK exercise 1\npass"
    (tmp_path / "alice.ipynb").write_text(dumps(submitted))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "01_x.ipynb").write_text(dumps(submitted))
    assert any("edited" in p for p in verify_submission(tmp_path / "sub" / "01_x.ipynb", paths))
