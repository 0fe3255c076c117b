"""What a submission's own code reaches for that it should not: the graders' internals.

The rule (documented in docs/grading.md): outside the check cells, a student's code may use
from ``labkit.exercises`` only

* the graders themselves, the ``check_*`` functions (running a check early is how students
  test their answers), and
* whatever the distributed notebook itself imports from it in its ordinary cells (chapter 2's
  ``naive`` block manager, chapter 4's traces).

Anything else there is flagged: the expected-value helpers the graders compute answers with
(``shared_prompt_counts``), private modules (``labkit.exercises._grading``), a whole module
(``import labkit.exercises.memory``, which would let a cell replace a grader), a string naming
``labkit.exercises`` (``importlib``, ``sys.modules``), and a cell that defines its own
``check_*`` function (a check cell that does not import its grader would call it).

This is a static reading of the code, a deterrent and a pointer for the instructor, not a
sandbox: code determined to cheat can hide from it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

PACKAGE = "labkit.exercises"
GRADER_PREFIX = "check_"


@dataclass(frozen=True, slots=True)
class Use:
    """One reference to the graders' package: where, and what it reaches."""
    cell: int        # position in the notebook
    what: str        # e.g. "labkit.exercises.memory.shared_prompt_counts"
    how: str         # "imports", "refers to", "names in a string", "defines"


def _python(source: str) -> str:
    """A cell's code as plain Python (IPython magics and shell escapes removed; the body of a
    cell magic such as ``%%time`` read as the Python it runs)."""
    if source.lstrip().startswith("%%"):
        return _python(source.lstrip().partition("\n")[2])
    try:
        from IPython.core.inputtransformer2 import TransformerManager
        return TransformerManager().transform_cell(source)
    except Exception:   # noqa: BLE001 - IPython missing or the cell beyond repair: read it as is
        return source


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _in_package(module: str) -> bool:
    return module == PACKAGE or module.startswith(PACKAGE + ".")


def uses(source: str, cell: int) -> list[Use]:
    """Every reference to ``labkit.exercises`` in one cell's code, and every ``check_*``
    function it defines."""
    try:
        tree = ast.parse(_python(source))
    except SyntaxError:
        return []                 # it raises when run; nothing it names can take effect
    found: list[Use] = []
    aliases = {"labkit": "labkit"}        # local name -> the module it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _in_package(alias.name):
                    found.append(Use(cell, alias.name, "imports"))
                if alias.name == "labkit" or alias.name.startswith("labkit."):
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else "labkit"
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if _in_package(node.module) or node.module == "labkit":
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    if node.module == "labkit" and alias.name != "exercises":
                        continue
                    found.append(Use(cell, target, "imports"))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name.startswith(GRADER_PREFIX):
                found.append(Use(cell, node.name, "defines"))
        elif isinstance(node, (ast.Name)) and isinstance(node.ctx, ast.Store):
            if node.id.startswith(GRADER_PREFIX):
                found.append(Use(cell, node.id, "defines"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and PACKAGE in node.value:
            found.append(Use(cell, node.value.strip()[:80], "names in a string"))
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            dotted = _dotted(node)
            if dotted:
                head, _, rest = dotted.partition(".")
                full = f"{aliases[head]}.{rest}" if head in aliases and rest else None
                if full and _in_package(full) and full.count(".") >= 2:
                    found.append(Use(cell, full, "refers to"))
    return _outermost(found)


def _outermost(found: list[Use]) -> list[Use]:
    """Drop ``a.b`` where ``a.b.c`` of the same cell was found too (ast.walk sees both)."""
    names = {(u.cell, u.what) for u in found if u.how == "refers to"}
    return [u for u in found if not (u.how == "refers to" and any(
        c == u.cell and w.startswith(u.what + ".") for c, w in names))]


def allowed(use: Use, distributed: set[str]) -> bool:
    """Whether ``use`` keeps to the rule; ``distributed`` holds what the distributed
    notebook's ordinary cells reach in the package themselves."""
    if use.what in distributed:
        return True
    leaf = use.what.rsplit(".", 1)[-1]
    return use.how == "imports" and leaf.startswith(GRADER_PREFIX) and "._" not in use.what


def forbidden(cells: list[tuple[int, str]], distributed_cells: list[str]) -> list[Use]:
    """The uses in ``cells`` ((position, source) of a submission's ordinary code cells) that
    break the rule, given the distributed notebook's ordinary code cells."""
    reached = {u.what for k, src in enumerate(distributed_cells) for u in uses(src, k)}
    return [u for index, src in cells for u in uses(src, index) if not allowed(u, reached)]
