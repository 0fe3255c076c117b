"""What a submission's own code reaches for that a lab exercise never needs: flags for the instructor.

Grades never depend on this reading (they come from the graders, outside the kernel, on the
answers the kernel hands out: see docs/grading.md). It points the instructor at code that
tried to reach the grading machinery, so that a person reads it. Flagged, in a student's code
cell (the lab's own cells, unchanged, are not read):

* **the graders' internals**: from ``labkit.exercises``, anything but the graders themselves
  (``check_*``) and what the distributed notebook's own cells import there (chapter 2's
  ``naive``); a whole grader module; a private module; anything of ``labkit.grade``; a string
  naming either package;
* **the kernel's machinery**, which a notebook could use to change what its own kernel hands
  out: IPython's input and AST transformers, event hooks, user expressions and formatters,
  ``builtins`` and ``__import__``,
  ``sys.modules`` and the import system, frames, closures and code objects, ``gc``,
  ``ctypes``, ``exec``/``eval``/``compile``;
* **processes and signals**: ``os.kill``, ``fork``, ``setsid``, ``subprocess``, ``signal``,
  shell commands (``!cmd``) other than a few that only look;
* **replacing an attribute of a module on the grading path** (``grader.check_x = ...``,
  ``setattr(module, ...)``; labkit, ``builtins``, ``sys``, IPython, ... but not a library's
  settings such as ``plotly.io.renderers.default``) and defining a function named like one of
  the lab's graders;
* **strings naming any of these** (``getattr(builtins, "__import__")``) or the solutions (a
  string of one word or path: prose in a docstring is not read).

A capability the distributed notebook's own cells use (chapter 8 starts threads and talks to
its server) is not flagged. Names that merely start with ``check`` (``check_count``) are not
flagged. This is a static reading: code written to hide (a name assembled at run time) can
pass it unseen, which is why grades do not depend on it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

PACKAGE = "labkit.exercises"
GRADE = "labkit.grade"
GRADER_PREFIX = "check_"

#: module -> (its dangerous attributes, or None when importing the module at all is flagged)
MODULES: dict[str, tuple[str, ...] | None] = {
    "builtins": None, "ctypes": None, "gc": None, "signal": None, "subprocess": None, "pty": None,
    "multiprocessing": None, "importlib": None,
    "sys": ("modules", "_getframe", "settrace", "setprofile", "meta_path", "path_hooks", "path_importer_cache",
            "addaudithook", "_current_frames", "builtin_module_names"),
    "os": ("kill", "killpg", "fork", "forkpty", "setsid", "setpgid", "system", "popen", "execv", "execve",
           "execvp", "execvpe", "execl", "execle", "execlp", "execlpe", "spawnv", "spawnve", "spawnl",
           "posix_spawn", "posix_spawnp", "pidfd_open"),
    "inspect": ("currentframe", "stack", "getouterframes", "getinnerframes", "getclosurevars", "trace"),
}
#: Attribute names that reach the kernel's machinery whatever object they are read from.
ATTRIBUTES = {
    "input_transformers_cleanup", "input_transformers_post", "ast_transformers", "input_transformer_manager",
    "register_magic_function", "set_custom_exc", "CustomTB", "showtraceback", "run_cell", "run_ast_nodes",
    "__closure__", "__code__", "__globals__", "__builtins__", "__import__", "__subclasses__", "__loader__",
    "f_back", "f_locals", "f_globals", "f_builtins", "gi_frame", "tb_frame", "co_code", "cell_contents",
    "__traceback__", "user_expressions", "display_formatter", "for_type", "user_global_ns",
}
EVENTS = ("pre_run_cell", "post_run_cell", "pre_execute", "post_execute")
CALLS = {"exec", "eval", "compile", "__import__", "breakpoint"}
#: Shell commands that only look (``!ls``); any other ``!cmd`` or ``%%bash`` is flagged.
LOOKING = ("ls", "pwd", "nvidia-smi", "lscpu", "nproc", "free", "df", "uname", "which", "pip list",
           "pip show", "pip freeze", "python --version", "echo")
PYTHON_CELL_MAGICS = ("time", "timeit", "capture", "prun", "debug")
STRINGS = ATTRIBUTES | {"builtins", "modules", "solutions", *EVENTS}


@dataclass(frozen=True, slots=True)
class Use:
    """One thing a cell reaches: where, what, and how (the flag reads "cell N <how> <what>")."""
    cell: int        # position in the notebook
    what: str        # e.g. "labkit.exercises.memory.shared_prompt_counts", "sys.modules"
    how: str         # "imports", "refers to", "names in a string", "defines", "uses", "replaces", "runs"

    def text(self) -> str:
        return f"cell {self.cell + 1} {self.how} {self.what}"


def python_of(source: str) -> str:
    """A cell's code as plain Python: IPython's magics and shell escapes become the calls they
    stand for (``!ls`` -> ``get_ipython().system('ls')``), and the body of a cell magic that
    runs Python (``%%time``) is read as that Python; a cell IPython cannot read is kept."""
    head, _, body = source.lstrip().partition("\n")
    if head.startswith("%%") and head[2:].split(" ")[0] in PYTHON_CELL_MAGICS:
        return python_of(body)
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


def _in(package: str, module: str) -> bool:
    return module == package or module.startswith(package + ".")


#: Modules whose attributes a student replacing is flagged (``plotly.io.renderers.default = ...``
#: and other settings are not): the grading path's.
GUARDED = ("labkit", "builtins", "sys", "os", "json", "importlib", "IPython", "ipykernel", "jupyter_client",
           "zmq", "types", "inspect")


def _guarded(module: str) -> bool:
    return any(_in(g, module) for g in GUARDED)


def _shell(node: ast.Call) -> str | None:
    """The command of ``get_ipython().system(...)``/``getoutput``/a shell cell magic, else None."""
    func = node.func
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call)
            and _dotted(func.value.func) == "get_ipython"):
        return None
    args = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    if func.attr in ("system", "getoutput") and args:
        return args[0].strip()
    if func.attr == "run_cell_magic" and args and args[0] in ("bash", "sh", "script", "system", "sx", "perl",
                                                                "ruby", "python", "python3", "writefile"):
        return f"%%{args[0]} {args[-1].strip()}"
    if func.attr == "run_line_magic" and args and args[0] in ("system", "sx"):
        return args[-1].strip()
    return None


class _Reader(ast.NodeVisitor):
    """Everything of the list in the module docstring that one cell's code does."""

    def __init__(self, cell: int, graders: set[str]):
        self.cell, self.graders, self.found = cell, graders, []
        self.aliases: dict[str, str] = {}        # local name -> module it stands for

    def add(self, what: str, how: str) -> None:
        self.found.append(Use(self.cell, what, how))

    def _module(self, module: str, how: str = "imports") -> None:
        top = module.split(".")[0]
        if _in(PACKAGE, module) or _in(GRADE, module):
            self.add(module, how)
        elif MODULES.get(top, ()) is None and top in MODULES:
            self.add(module, how)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._module(alias.name)
            top = alias.name.split(".")[0]
            self.aliases[alias.asname or top] = alias.name if alias.asname else top

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level:
            return
        for alias in node.names:
            full = f"{module}.{alias.name}"
            self.aliases[alias.asname or alias.name] = full
            if _in(PACKAGE, full) or _in(GRADE, full) or module == "labkit" and alias.name in ("exercises", "grade"):
                self.add(full, "imports")
            elif module in MODULES and (MODULES[module] is None or alias.name in MODULES[module]):
                self.add(full, "imports")
            elif alias.name in ATTRIBUTES:
                self.add(full, "imports")

    def _resolve(self, dotted: str) -> str:
        head, _, rest = dotted.partition(".")
        return f"{self.aliases[head]}.{rest}" if head in self.aliases and rest else self.aliases.get(head, dotted)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        dotted = _dotted(node)
        full = self._resolve(dotted) if dotted else None
        if node.attr in ATTRIBUTES:
            self.add(full or f"….{node.attr}", "uses")
        elif node.attr == "register" and isinstance(node.value, ast.Attribute) and node.value.attr == "events":
            self.add("IPython's event hooks (events.register)", "uses")
        elif full and isinstance(node.ctx, ast.Load):
            module, _, attr = full.rpartition(".")
            if module in MODULES and MODULES[module] and attr in MODULES[module]:
                self.add(full, "uses")
            elif (_in(PACKAGE, full) and full.count(".") >= 2) or _in(GRADE, full):
                self.add(full, "refers to")
        if not isinstance(node.ctx, ast.Load) and isinstance(node.value, (ast.Name, ast.Attribute)):
            base = _dotted(node.value)
            if base and base.split(".")[0] in self.aliases and _guarded(self._resolve(base)):
                self.add(f"{self._resolve(base)}.{node.attr}", "replaces")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name in CALLS:
            self.add(f"{name}()", "uses")
        elif name in ("setattr", "delattr", "vars") and node.args and isinstance(node.args[0], ast.Name) \
                and node.args[0].id in self.aliases:
            self.add(f"{name}({self.aliases[node.args[0].id]}, …)", "uses")
        command = _shell(node)
        if command is not None and not any(command == c or command.startswith(c + " ") for c in LOOKING):
            self.add(f"the shell command `{command[:60]}`", "runs")
        self.generic_visit(node)

    def _defines(self, name: str) -> None:
        if name in self.graders:
            self.add(name, "defines")

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._defines(node.name)
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._defines(node.name)
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store):
            self._defines(node.id)
        elif node.id in ("__builtins__", "__import__"):
            self.add(node.id, "uses")

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str):
            text = node.value.strip()
            if " " not in text and (PACKAGE in text or GRADE in text or text in STRINGS or "solutions/" in text):
                self.add(repr(text[:60]), "names in a string")


def uses(source: str, cell: int, graders: set[str] = frozenset()) -> list[Use]:
    """Every use in one cell's code (module docstring), outermost first, each once."""
    try:
        tree = ast.parse(python_of(source))
    except SyntaxError:
        return []                 # it raises when run; nothing it names can take effect
    reader = _Reader(cell, set(graders))
    reader.visit(tree)
    return _outermost(reader.found)


def _outermost(found: list[Use]) -> list[Use]:
    """Each use once, and ``a.b`` dropped where ``a.b.c`` of the same cell was found too."""
    seen, out = set(), []
    imported = {u.what for u in found if u.how == "imports"}
    for u in found:
        if (u.how, u.what) in seen or any(v.how == u.how and v.what.startswith(u.what + ".") for v in found) \
                or (u.how == "refers to" and u.what in imported):
            continue
        seen.add((u.how, u.what))
        out.append(u)
    return out


def allowed(use: Use, distributed: set[tuple[str, str]]) -> bool:
    """Whether ``use`` keeps to the rules; ``distributed`` holds what the distributed
    notebook's own cells do themselves, as (how, what)."""
    if (use.how, use.what) in distributed:
        return True
    if use.how == "refers to" and any(how == "imports" and (use.what == what or use.what.startswith(what + "."))
                                      for how, what in distributed):
        return True                                 # an attribute of what the lab's own cells import
    leaf = use.what.rsplit(".", 1)[-1]
    return use.how == "imports" and _in(PACKAGE, use.what) and leaf.startswith(GRADER_PREFIX) and "._" not in use.what


def forbidden(cells: list[tuple[int, str]], distributed_cells: list[str], graders: set[str] = frozenset()) -> list[Use]:
    """The uses in ``cells`` ((position, source) of a submission's code cells, check cells
    excluded) that break the rules, given the distributed notebook's own code cells. A cell
    that is one of the distributed cells unchanged is not read; an install cell (another
    version of it, say) may do what the distributed install cell does (look at
    ``sys.modules``), a student's other cells may not."""
    from ..notebooks import _normalized, is_install_cell
    install = (lambda src: is_install_cell({"cell_type": "code", "source": src}))
    theirs = {_normalized(src) for src in distributed_cells}
    reached = {(u.how, u.what) for k, src in enumerate(distributed_cells) if not install(src)
               for u in uses(src, k, graders)}
    installing = reached | {(u.how, u.what) for k, src in enumerate(distributed_cells) if install(src)
                            for u in uses(src, k, graders)}
    return [u for index, src in cells if _normalized(src) not in theirs
            for u in uses(src, index, graders) if not allowed(u, installing if install(src) else reached)]
