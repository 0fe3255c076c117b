"""No answer handed out: no student notebook shows an exercise's answer before its check.

Each grader module of ``labkit.exercises`` may define ``answer_forms() -> dict[str, list[str]]``:
exercise id ("7.4") -> the distinctive strings that would give that exercise's answer away,
in the forms its grader accepts ("3P+2D", "116 blocks", a formula a hint must not state).
This module collects them from every module that defines the function and scans

* every student notebook (``notebooks/*.ipynb``): markdown and code sources, including the
  stub hints (``raise NotImplementedError("...")``), and any stored outputs, in every cell
  *before* that exercise's ``# CHECK exercise X.Y`` cell;
* the string literals of every grader module (its hints and messages), outside
  ``answer_forms`` itself and the ``passed(...)`` verdicts; a literal that is nothing but the
  form (the constant that defines the answer) is not a hint and is not reported.

Forms match on token boundaries: "3P+2D" is found in "use 3P+2D" but not in "13P+2D", and
"116" not in "1160" or "116.5". The self-tests at the end plant leaks in a made-up notebook to
show that the scanner finds them, so that a clean result means something. The hints that
graders compute at run time are scanned by the grader tables (``tests/test_exercises*.py``).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import nbformat
import pytest

import labkit.exercises
from labkit.notebooks import exercise_id

ROOT = Path(__file__).resolve().parent.parent
STUDENT_NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


# ---- the scanner ------------------------------------------------------------------------------
def form_pattern(form: str) -> re.Pattern:
    """``form`` as a whole token: no letter, digit or decimal point glued to either end."""
    return re.compile(r"(?<![\w.])" + re.escape(form) + r"(?![\w]|\.\d)")


def find_form(text: str, form: str) -> str | None:
    """The context of the first occurrence of ``form`` in ``text`` as a token, or None."""
    m = form_pattern(form).search(text)
    return None if m is None else text[max(0, m.start() - 40):m.end() + 40].replace("\n", " ")


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


#: Output types a reader sees as text. Plot and widget payloads (plotly JSON, its HTML) are
#: left out: their data arrays hold every number on an axis, which says nothing.
TEXT_MIME = ("text/plain", "text/markdown")


def _output_text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []) or []:
        text = out.get("text", "")
        parts.append("".join(text) if isinstance(text, list) else text)
        for mime in TEXT_MIME:
            value = (out.get("data") or {}).get(mime, "")
            parts.append("".join(value) if isinstance(value, list) else str(value))
        parts.append(" ".join(out.get("traceback", []) or []))
    return "\n".join(parts)


def check_cells(nb) -> dict[str, int]:
    """Exercise id -> index of its ``# CHECK exercise X.Y`` cell."""
    found = {}
    for index, cell in enumerate(nb.cells):
        exercise = exercise_id(cell)
        if exercise is not None:
            found.setdefault(exercise, index)
    return found


def leaks(nb, forms: dict[str, list[str]], name: str = "notebook") -> list[str]:
    """Every answer form that appears, in a source or an output, before its exercise's check."""
    problems = []
    for exercise, index in check_cells(nb).items():
        for form in forms.get(exercise, []):
            for k, cell in enumerate(nb.cells[:index]):
                for where, text in (("source", _source(cell)), ("output", _output_text(cell))):
                    context = find_form(text, form)
                    if context is not None:
                        problems.append(f"{name}, cell {k} ({cell.get('cell_type')} {where}): the answer "
                                        f"of exercise {exercise} ({form!r}) before its check (cell "
                                        f"{index}): ...{context}...")
    return problems


# ---- what the grader modules declare -------------------------------------------------------------
def grader_modules() -> list:
    return [importlib.import_module(f"labkit.exercises.{info.name}")
            for info in pkgutil.iter_modules(labkit.exercises.__path__) if not info.name.startswith("_")]


def declared_forms() -> tuple[dict[str, list[str]], list[str]]:
    """(exercise id -> forms, names of the modules without ``answer_forms``)."""
    forms: dict[str, list[str]] = {}
    without = []
    for module in grader_modules():
        if not hasattr(module, "answer_forms"):
            without.append(module.__name__)
            continue
        for exercise, strings in module.answer_forms().items():
            assert exercise not in forms, f"exercise {exercise} declared twice ({module.__name__})"
            assert all(isinstance(s, str) and s.strip() for s in strings), (module.__name__, exercise)
            forms[exercise] = list(strings)
    return forms, without


@pytest.fixture(scope="module")
def declared():
    return declared_forms()


@pytest.mark.slow   # declared_forms() computes every exercise's answers (seconds)
def test_the_scan_has_something_to_scan(declared):
    forms, without = declared
    assert STUDENT_NOTEBOOKS, "no student notebooks: python -m labkit.notebooks generate"
    assert sum(map(len, forms.values())) >= 10, f"too few answer forms to mean anything: {forms}"
    if without:
        print("grader modules without answer_forms (not scanned):", ", ".join(without))


@pytest.mark.slow   # declared_forms() computes every exercise's answers (seconds)
def test_every_declared_exercise_has_a_check_cell(declared):
    forms, _ = declared
    checked = {ex for path in STUDENT_NOTEBOOKS for ex in check_cells(nbformat.read(path, as_version=4))}
    stale = sorted(set(forms) - checked)
    assert not stale, f"answer_forms names exercises no student notebook checks: {stale}"


@pytest.mark.slow   # declared_forms() computes every exercise's answers (seconds)
@pytest.mark.parametrize("path", STUDENT_NOTEBOOKS, ids=[p.stem for p in STUDENT_NOTEBOOKS])
def test_no_answer_before_its_check(declared, path):
    forms, _ = declared
    problems = leaks(nbformat.read(path, as_version=4), forms, f"notebooks/{path.name}")
    assert not problems, "\n".join(problems)


def _string_literals(module) -> list[tuple[int, str]]:
    """(line, text) of the module's string literals, f-strings' literal parts included, outside
    ``answer_forms`` (which must spell the forms out) and outside ``passed(...)`` calls (a
    verdict for a right answer may restate it)."""
    tree = ast.parse(inspect.getsource(module))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.FunctionDef) and node.name == "answer_forms") or (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "passed"):
            skip.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.lineno not in skip]


@pytest.mark.parametrize("module", [m for m in grader_modules() if hasattr(m, "answer_forms")],
                         ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_grader_hints_state_no_answer(module):
    forms = module.answer_forms()
    problems = [f"{module.__name__}, line {line}: {form!r} (exercise {exercise}) in ...{context}..."
                for line, text in _string_literals(module)
                for exercise, strings in forms.items() for form in strings
                if text.strip() != form                    # the literal that defines the answer
                and (context := find_form(text, form)) is not None]
    assert not problems, "\n".join(problems)


# Names a student notebook must not import from labkit.exercises: helpers that compute an answer.
ANSWER_HELPER = re.compile(r"expected|answer|ratios|solution|solve", re.IGNORECASE)


def answer_helper_imports(nb) -> list[str]:
    """``from labkit.exercises... import X`` of a helper that computes an expected value."""
    found = []
    for index, cell in enumerate(nb.cells):
        if cell.get("cell_type") != "code":
            continue
        try:
            tree = ast.parse(_source(cell))
        except SyntaxError:            # IPython magics (the Colab cell)
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("labkit.exercises"):
                found += [f"cell {index}: from {node.module} import {a.name}" for a in node.names
                          if ANSWER_HELPER.search(a.name)]
            elif isinstance(node, ast.Attribute) and ANSWER_HELPER.search(node.attr) and \
                    "exercises" in ast.unparse(node.value):
                found.append(f"cell {index}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", STUDENT_NOTEBOOKS, ids=[p.stem for p in STUDENT_NOTEBOOKS])
def test_student_notebooks_import_no_expected_value_helper(path):
    found = answer_helper_imports(nbformat.read(path, as_version=4))
    assert not found, f"notebooks/{path.name} imports a helper that computes an answer:\n" + "\n".join(found)


def test_helper_import_scan_finds_a_planted_import():
    nb = _made_up_notebook(("code", "from labkit.exercises.disagg import (check_instance_plan,\n"
                                    "                                     plan_expected)"),
                           ("code", "import labkit.exercises.batching\nlabkit.exercises.batching.ex43_ratios()"),
                           ("code", "from labkit.exercises.batching import EX42_SIM, ex42_pools"))
    assert len(answer_helper_imports(nb)) == 2


# ---- the scanner catches what it should, and only that -------------------------------------------------
def _made_up_notebook(*cells) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    for kind, src in cells:
        nb.cells.append(nbformat.v4.new_code_cell(src) if kind == "code" else nbformat.v4.new_markdown_cell(src))
    return nb


FORMS = {"7.4": ["3P+2D"], "4.2": ["116"], "5.1": ["pos // block_size] * block_size"]}


@pytest.mark.parametrize("cell", [
    ("markdown", "The best plan is 3P+2D, as you will see."),
    ("code", 'print("plan:", "3P+2D")'),
    ("code", 'raise NotImplementedError("hint: the answer is 3P+2D")'),
    ("markdown", "A pool of 116 blocks is enough."),
    ("code", "slot = block_tables[s, pos // block_size] * block_size + pos % block_size"),
], ids=["markdown", "code", "stub-hint", "number", "formula"])
def test_scanner_finds_a_planted_leak(cell):
    nb = _made_up_notebook(cell, ("code", "# CHECK exercise 7.4\ncheck(x)"),
                           ("code", "# CHECK exercise 4.2\ncheck(y)"), ("code", "# CHECK exercise 5.1\ncheck(z)"))
    assert len(leaks(nb, FORMS)) == 1


def test_scanner_finds_a_leak_in_stored_outputs():
    nb = _made_up_notebook(("code", "print(plan)"), ("code", "# CHECK exercise 7.4\ncheck(x)"))
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", text="3P+2D\n")]
    assert leaks(nb, FORMS)
    nb.cells[0].outputs = [nbformat.v4.new_output("execute_result", data={"text/plain": "'3P+2D'"})]
    assert leaks(nb, FORMS)
    plot = {"application/vnd.plotly.v1+json": {"data": [{"x": list(range(100, 130))}]}}
    nb.cells[0].outputs = [nbformat.v4.new_output("display_data", data=plot)]
    assert not leaks(nb, {"7.4": ["116"]}), "a plot's axis data is not a printed answer"


@pytest.mark.parametrize("text", ["13P+2D", "3P+2DD", "1160 blocks", "116.5 blocks", "0.116", "x116"])
def test_scanner_matches_whole_tokens_only(text):
    assert find_form(text, "3P+2D") is None and find_form(text, "116") is None


def test_scanner_ignores_what_comes_after_the_check():
    nb = _made_up_notebook(("code", "# CHECK exercise 7.4\ncheck(x)"), ("markdown", "So 3P+2D it is."))
    assert leaks(nb, FORMS) == []
