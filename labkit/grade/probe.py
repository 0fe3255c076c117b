"""What an answer cell runs in the student's kernel: the answers, handed out as plain data.

In a graded run every check cell is replaced by an answer cell (``checks.answer``) whose
execute request asks the kernel to evaluate ``hand_in(...)`` as a user expression: IPython
evaluates those with ``eval``, past the input and AST transformers a notebook may have
installed. ``hand_in`` evaluates the check's arguments in the student's namespace and returns
JSON text (never pickle), which comes back in the kernel's reply and is read by the grader
outside the kernel:

* a value answer: the grader's ``plain_arguments`` (numbers, strings, lists, dicts; live
  objects such as the engine as the plain facts the grader needs), judged outside by the
  same grader;
* a code answer (a bug-hunt test, a kernel function): the grader's ``probe`` runs the
  student's code here, on the inputs the grader chose, and emits what it did (each run's
  outcome, each output as numbers), which the grader's ``judge`` reads outside. For a grader
  marked ``rerun`` (the bug hunt's: a test is its code, not a value) it also hands in the
  test's source and what the source uses from the notebook (``source_of``), which the grading
  process runs again on its own, in a clean sandbox, under labkit's own probe (``rerun.py``);
* a grader that can take neither yet (``IN_KERNEL``) is run here and its verdict handed in;
  the grading process accepts a verdict only for such a grader.

Everything here runs in the student's kernel, so everything here can be replaced by the
student's code: nothing the grading process reads from it is trusted beyond "these are the
answers this kernel hands in". ``observations`` adds what it sees of the usual tampering
(IPython transformers, a replaced ``__import__`` or grader), for the flags only.
"""

from __future__ import annotations

import json

MAX_BYTES = 4 << 20          # an answer (or a code answer's outputs) larger than this is not handed in
MAX_SOURCE = 256 << 10       # a test's source (with what it uses) larger than this is not handed in
#: IN-KERNEL: graders judged in the student's kernel, their verdict handed in, until they read
#: plain data right. None today; a grader named here is the only kind whose verdict the grading
#: process accepts from a kernel.
IN_KERNEL: frozenset[str] = frozenset()


def observations(module: str | None = None, name: str | None = None) -> list[str]:
    """Signs of tampering visible from here (empty in an honest kernel)."""
    import builtins
    import os
    import sys
    seen = []
    try:
        from IPython import get_ipython
        ip = get_ipython()
    except ImportError:
        ip = None
    if ip is not None:
        foreign = [f for f in [*ip.input_transformers_cleanup, *ip.input_transformers_post]
                   if not getattr(f, "__module__", "").startswith("IPython.")]
        if foreign:
            seen.append(f"IPython input transformers added ({', '.join(getattr(f, '__name__', '?') for f in foreign)})")
        if ip.ast_transformers:
            seen.append(f"IPython AST transformers added ({len(ip.ast_transformers)})")
    importer = builtins.__import__
    if getattr(importer, "__module__", None) != "builtins" or type(importer).__name__ != "builtin_function_or_method":
        seen.append("builtins.__import__ replaced")
    if module and name:
        import labkit.exercises as package
        home = os.path.dirname(package.__file__ or "")
        loaded = sys.modules.get(module)                  # (not loaded: its import failed, and says so)
        if loaded is not None and not (getattr(loaded, "__file__", "") or "").startswith(home):
            seen.append(f"sys.modules[{module!r}] is not labkit's module")
        elif loaded is not None:
            fn = getattr(loaded, name, None)
            parts = [getattr(fn, "__wrapped__", fn), *(getattr(fn, a) for a in ("probe", "judge", "plain_arguments")
                                                       if hasattr(fn, a))]
            if not all(getattr(getattr(p, "__code__", None), "co_filename", "").startswith(home) for p in parts):
                seen.append(f"{module}.{name} is not labkit's grader")
    return seen


def _globals_used(code) -> set[str]:
    """The global names ``code`` (and the functions and comprehensions inside it) reads."""
    import dis
    import types
    names, todo = set(), [code]
    while todo:
        c = todo.pop()
        names |= {i.argval for i in dis.get_instructions(c) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
        todo += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    return names


def _def_time_names(source: str) -> set[str]:
    """Names a ``def`` evaluates where it is defined: its decorators, defaults and annotations."""
    import ast
    tree = ast.parse(source)
    found = set()
    for node in tree.body[:1]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            parts = list(node.decorator_list)
            if not isinstance(node, ast.ClassDef):
                a = node.args
                parts += [*a.defaults, *(d for d in a.kw_defaults if d is not None),
                          *([node.returns] if node.returns else []),
                          *(x.annotation for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
                            if x is not None and x.annotation is not None)]
            else:
                parts += node.bases
            found |= {n.id for part in parts for n in ast.walk(part) if isinstance(n, ast.Name)}
    return found


def source_of(fn) -> dict:
    """``fn`` (a student's test) as source to run on its own: {"source": ..., "name": ...}, the
    source holding ``fn``'s ``def`` and what it uses from the notebook (the functions and classes
    defined there, as their source; modules and imported functions as imports; plain constants
    as literals), else {"error": why it cannot be run on its own}."""
    import ast
    import inspect
    import sys
    import textwrap
    import types
    if not isinstance(fn, types.FunctionType):
        return {"error": f"{type(fn).__name__} is not a function"}
    glob = fn.__globals__
    imports: list[str] = []
    constants: list[str] = []
    defs: dict[int, str] = {}
    aliases: list[str] = []
    todo, done = [fn], set()
    while todo:
        obj = todo.pop()
        if id(obj) in done:
            continue
        done.add(id(obj))
        what = getattr(obj, "__name__", "?")
        if isinstance(obj, types.FunctionType) and obj.__closure__:
            return {"error": f"{what} is defined inside another function: define it at the top of a cell"}
        if getattr(obj, "__name__", "") == "<lambda>":
            return {"error": "a lambda cannot be run on its own: write a def"}
        try:
            source = textwrap.dedent(inspect.getsource(obj))
            names = _def_time_names(source)
        except (OSError, TypeError, SyntaxError) as e:
            return {"error": f"the source of {what} cannot be read ({type(e).__name__})"}
        defs[id(obj)] = source
        if isinstance(obj, types.FunctionType):
            names |= _globals_used(obj.__code__)
        else:
            names |= {n for v in vars(obj).values() if isinstance(v, types.FunctionType)
                      for n in _globals_used(v.__code__)}
        for name in sorted(names):
            if name not in glob:
                continue                                  # a builtin, or undefined (as in the kernel)
            value = glob[name]
            module = getattr(value, "__module__", None)
            if isinstance(value, types.ModuleType):
                imports.append(f"import {value.__name__}" if value.__name__ == name else
                               f"import {value.__name__} as {name}")
            elif isinstance(value, (types.FunctionType, type)) and module == glob.get("__name__"):
                todo.append(value)
                if value.__name__ != name:
                    aliases.append(f"{name} = {value.__name__}")
            elif callable(value) and module and module != glob.get("__name__") and "." not in value.__qualname__ \
                    and getattr(sys.modules.get(module), value.__qualname__, None) is value:
                imports.append(f"from {module} import {value.__qualname__} as {name}")
            else:
                try:
                    literal = repr(value)
                    ok = len(literal) < MAX_SOURCE and ast.literal_eval(literal) == value
                except Exception:   # noqa: BLE001 - not a literal, then
                    ok = False
                if not ok:
                    return {"error": f"{what} uses {name}, a {type(value).__name__} value of the notebook's that "
                                     "cannot be carried to a run of its own: create it inside the test"}
                constants.append(f"{name} = {literal}")
    text = "\n".join(sorted(set(imports)) + constants) + "\n\n\n" + "\n\n".join(reversed(defs.values())) \
        + ("\n\n" + "\n".join(aliases) if aliases else "") + "\n"
    if len(text) > MAX_SOURCE:
        return {"error": f"its source is {len(text) >> 10} KiB: too large to run on its own"}
    return {"source": text, "name": fn.__name__}


def _text(payload: dict) -> str:
    text = json.dumps(payload)
    if len(text) > MAX_BYTES:
        text = json.dumps({"exercise": payload.get("exercise"),
                           "error": f"the answer is {len(text) >> 20} MiB of data: too large to hand in"})
    return text


def _judged_here(fn, args: tuple, kwargs: dict) -> dict:
    import contextlib
    import io
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            fn(*args, **kwargs)
    except AssertionError as e:
        return {"status": "fail", "message": str(e)}
    except Exception as e:   # noqa: BLE001 - reported as the verdict
        return {"status": "fail", "message": f"{type(e).__name__}: {e}"}
    return {"status": "pass"}


def hand_in(exercise: str, grader: str, answers, plan: dict) -> str:
    """``exercise``'s answers (``answers()`` -> (args, kwargs)) for ``grader``
    (``module:function``), as JSON text (module docstring). Never raises: what went wrong is
    part of what it hands in."""
    payload: dict = {"exercise": exercise}
    module, name = grader.split(":")
    try:
        args, kwargs = answers()
    except Exception as e:   # noqa: BLE001 - an answer not defined yet, or a stub that raised
        payload["unanswered"] = f"{type(e).__name__}: {e}"[:1000]
        args = None
    if args is not None:
        payload.update(_handed(module, name, args, kwargs, plan))
    try:
        payload["seen"] = observations(module, name)
    except Exception:   # noqa: BLE001 - observations are a courtesy
        pass
    try:
        return _text(payload)
    except (TypeError, ValueError) as e:    # a probe's data that is not JSON after all
        return _text({"exercise": exercise, "error": f"the answer is not plain data ({e})"})


def _handed(module: str, name: str, args: tuple, kwargs: dict, plan: dict) -> dict:
    """The answers in the form the grader reads (module docstring)."""
    try:
        import importlib
        fn = getattr(importlib.import_module(module), name)
        if f"{module}:{name}" in IN_KERNEL:
            return {"verdict": _judged_here(fn, args, kwargs)}
        if callable(getattr(fn, "probe", None)):
            source = None
            if getattr(fn, "rerun", False):          # read before the test runs (and could change itself)
                source = source_of(args[0] if args else next(iter(kwargs.values()), None))
            handed = {"ran": fn.probe(*args, **kwargs, plan=plan)}
            return handed if source is None else {**handed, "source": source}
        if callable(getattr(fn, "plain_arguments", None)):
            return {"plain": fn.plain_arguments(*args, **kwargs)}
        return {"verdict": _judged_here(fn, args, kwargs)}
    except Exception as e:   # noqa: BLE001 - handed in as what it is
        return {"error": f"{type(e).__name__}: {e}"[:1000]}
