"""Check cells, read: which grader each one calls with what, and what a student did to it.

A distributed check cell (``# CHECK exercise 2.1``) imports a grader from ``labkit.exercises``
and calls it once on the exercise's answers::

    from labkit.exercises import check_exercise_2
    check_exercise_2(num_blocks, wasted_slots, internal_fragmentation)

``read_checks`` turns each into a ``Check``: the exercise, the grader (``module:function``,
resolved through the notebook's own imports, which may sit in an earlier cell), and the source
of each argument. In the sandboxed run the check cell is replaced by an *answer cell*
(``answer``) whose request has the kernel evaluate those arguments in the student's namespace
and hand them out as plain data (``probe.hand_in``); the grader runs outside the kernel
(``judge``).

``compare`` says what a student's copy of a check cell changed, statement by statement
(comments and layout never count):

* nothing: graded as distributed;
* statements added around the grader call (an answer typed at the top of the check cell):
  honoured, run just before the check, and noted;
* the grader call's arguments changed: graded with the arguments the student's call passes
  (their answers, judged by the real grader), and flagged;
* the grader call gone or the cell not Python: graded with the distributed call, and flagged.
"""

from __future__ import annotations

import ast
import importlib
import json
from dataclasses import dataclass

from ..notebooks import exercise_id, is_check_cell
from .integrity import python_of

PACKAGE = "labkit.exercises"


@dataclass(frozen=True, slots=True)
class Check:
    """One check cell of a distributed notebook."""
    exercise: str                            # "2.1"
    grader: str                              # "labkit.exercises.memory:check_exercise_2"
    name: str                                # what the cell calls it: "check_exercise_2"
    args: tuple[str, ...]                    # each positional argument's source
    kwargs: tuple[tuple[str, str], ...]      # (name, source) of each keyword argument
    source: str                              # the cell as distributed
    key: str                                 # its call's arguments as they parse (``_call_key``)

    def function(self):
        """The grader itself, imported here (in the grading process: never the kernel's copy)."""
        module, name = self.grader.split(":")
        return getattr(importlib.import_module(module), name)


@dataclass(frozen=True, slots=True)
class Edit:
    """What a submitted check cell changed (see the module docstring)."""
    kind: str                                # "same", "added", "call", "removed", "unreadable"
    prelude: str = ""                        # the student's own statements, to run before the check
    args: tuple[str, ...] = ()               # the student's call's arguments, when kind == "call"
    kwargs: tuple[tuple[str, str], ...] = ()


def _imports(tree: ast.AST, names: dict[str, str]) -> None:
    """Record what ``from M import a as b`` and ``import M as b`` bind, as ``b -> M:a`` / ``b -> M``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}:{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name


def _grader_of(call: ast.Call, names: dict[str, str]) -> str | None:
    """``module:function`` of a call to a grader of ``labkit.exercises``, else None."""
    func = call.func
    if isinstance(func, ast.Name) and ":" in names.get(func.id, ""):
        target = names[func.id]
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in names:
        target = f"{names[func.value.id].split(':')[0]}:{func.attr}"
    else:
        return None
    module = target.split(":")[0]
    return target if module == PACKAGE or module.startswith(PACKAGE + ".") else None


def _called_name(call: ast.Call) -> str:
    return call.func.id if isinstance(call.func, ast.Name) else ast.unparse(call.func)


def _arguments(call: ast.Call, source: str) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        raise ValueError("a grader call with *args or **kwargs")
    segment = (lambda node: ast.get_source_segment(source, node) or ast.unparse(node))
    return (tuple(segment(a) for a in call.args),
            tuple((k.arg, segment(k.value)) for k in call.keywords))


def read_checks(distributed) -> list[Check]:
    """The ``Check`` of every check cell of a distributed notebook, in order. Raises
    ``ValueError`` for a check cell that does not call exactly one grader (a lab bug)."""
    names: dict[str, str] = {}
    checks = []
    for cell in distributed.cells:
        if cell.cell_type != "code":
            continue
        code = python_of(cell.source)
        try:
            tree = ast.parse(code)
        except SyntaxError:
            if is_check_cell(cell):
                raise ValueError(f"check cell {cell.source.splitlines()[0]!r} is not valid Python") from None
            continue                        # a lab cell that only runs in IPython: it imports no grader
        _imports(tree, names)
        if not is_check_cell(cell):
            continue
        exercise = exercise_id(cell)
        calls = [(c, g) for c in ast.walk(tree) if isinstance(c, ast.Call) and (g := _grader_of(c, names))]
        if exercise is None or len(calls) != 1:
            raise ValueError(f"check cell {cell.source.splitlines()[0]!r} must name its exercise and call "
                             f"exactly one grader of {PACKAGE} (it calls {len(calls)})")
        call, grader = calls[0]
        module, function = grader.split(":")
        real = getattr(importlib.import_module(module), function)
        args, kwargs = _arguments(call, code)
        checks.append(Check(exercise, f"{real.__module__}:{real.__name__}", _called_name(call), args, kwargs,
                            cell.source, _call_key(call)))
    return checks


def compare(submitted: str, check: Check) -> Edit:
    """What the student's copy ``submitted`` of ``check``'s cell changed (module docstring)."""
    code = python_of(submitted)
    try:
        mine = ast.parse(code)
    except SyntaxError:
        return Edit("unreadable")
    pending = [ast.dump(s) for s in ast.parse(python_of(check.source)).body]
    prelude, call = [], None
    for statement in mine.body:
        key = ast.dump(statement)
        calls = [c for c in ast.walk(statement) if isinstance(c, ast.Call) and _called_name(c) == check.name]
        if calls:
            call = calls[-1]                       # the check's call, or the student's own version of it
        if key in pending:
            pending.remove(key)
        elif not calls and not (isinstance(statement, (ast.Import, ast.ImportFrom)) and _only_graders(statement)):
            prelude.append(ast.get_source_segment(code, statement) or ast.unparse(statement))
    text = "\n".join(prelude)
    if call is None or any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return Edit("removed", text)
    if _call_key(call) == check.key:
        return Edit("added" if prelude else "same", text)
    args, kwargs = _arguments(call, code)
    return Edit("call", text, args, kwargs)


def _call_key(call: ast.Call) -> str:
    """A call's arguments as they parse (so ``f(a,b)`` and ``f(a, b)`` are one)."""
    keywords = sorted(call.keywords, key=lambda k: k.arg or "")
    return ast.dump(ast.Tuple([*call.args, *(ast.Tuple([ast.Constant(k.arg), k.value], ast.Load())
                                             for k in keywords)], ast.Load()))


def _only_graders(statement: ast.stmt) -> bool:
    """An import of graders only (a check cell's own import line, perhaps reworded)."""
    if isinstance(statement, ast.ImportFrom):
        return bool(statement.module) and statement.module.startswith("labkit.exercises")
    return all(a.name.startswith("labkit.exercises") for a in statement.names)


def answer(check: Check, args: tuple[str, ...] | None = None,
           kwargs: tuple[tuple[str, str], ...] | None = None, plan: dict | None = None) -> tuple[str, str]:
    """What stands for ``check``'s cell in the sandboxed run: a cell that runs nothing, and the
    expression its execute request asks the kernel to evaluate afterwards (``user_expressions``,
    which IPython evaluates without its input or AST transformers). The expression hands the
    answers (``args``/``kwargs``: the check's own unless given) to ``probe.hand_in``, whose
    return value, plain data as JSON text, comes back in the kernel's reply."""
    args = check.args if args is None else args
    kwargs = check.kwargs if kwargs is None else kwargs
    positional = "".join(f"{a}, " for a in args)
    keywords = ", ".join(f"{json.dumps(k)}: {v}" for k, v in kwargs)
    expression = (f"__import__('labkit.grade.probe', fromlist=['hand_in']).hand_in("
                  f"{json.dumps(check.exercise)}, {json.dumps(check.grader)}, "
                  f"lambda: (({positional}), {{{keywords}}}), {json.dumps(plan or {})})")
    return f"# CHECK exercise {check.exercise}: its answers go to the grader, outside this kernel", expression
