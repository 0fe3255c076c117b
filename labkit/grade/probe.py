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
  outcome, each output as numbers), which the grader's ``judge`` reads outside;
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
            return {"ran": fn.probe(*args, **kwargs, plan=plan)}
        if callable(getattr(fn, "plain_arguments", None)):
            return {"plain": fn.plain_arguments(*args, **kwargs)}
        return {"verdict": _judged_here(fn, args, kwargs)}
    except Exception as e:   # noqa: BLE001 - handed in as what it is
        return {"error": f"{type(e).__name__}: {e}"[:1000]}
