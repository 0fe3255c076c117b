"""Generate the student notebooks (``notebooks/``) from the solved ones (``solutions/``).

``solutions/`` is the single source. In its code cells, each exercise's answer sits
between two marker lines::

    ### BEGIN SOLUTION hint: divide the slots used by the slots reserved
    fraction_used = 200 / 4096
    ### END SOLUTION

``generate`` writes ``notebooks/NAME.ipynb`` for every ``solutions/NAME.ipynb`` with each
such region replaced by one line, indented like the BEGIN marker::

    raise NotImplementedError("divide the slots used by the slots reserved")

(the hint after ``hint:`` is optional; without one a generic hint is used). Everything
else is kept identical, except what running a notebook adds: outputs, execution counts,
per-cell execution metadata and widget state (plotly's FigureWidget stores megabytes of
JavaScript there) are stripped; a python3 kernelspec is written as ipykernel's, what Jupyter
itself writes (another kernel's is kept).

Conventions the notebooks follow (and the tests check):

* a **stub cell** is a code cell with a solution region (in the student notebook: with the
  ``raise NotImplementedError`` line that replaced it);
* a **check cell** is a code cell whose first line starts with ``# CHECK``; it calls a
  grader from ``labkit.exercises``, which raises ``AssertionError`` with a hint on a wrong
  answer. A student notebook run top to bottom may fail in stub and check cells only:
  other cells never use an exercise's answer;
* a notebook opens on its title: its first cell is the markdown cell with the chapter's ``#``
  heading, and the **install cell**, ``install_cell()``, comes right after it as the first code
  cell. On Colab and wherever labkit is not installed, it installs labkit from
  ``LABKIT_SOURCE`` (this module's constant, or the environment variable of that name at run
  time), and where that source cannot be reached it fails at once, saying what to set and
  where the wheel comes from. On a machine without an NVIDIA GPU it then compiles the C++ CPU
  kernels (``python -m labkit kernels``, which says how long that takes and counts the seconds),
  so that no later cell waits on a compiler; on a GPU runtime Triton's kernels run instead, and
  nothing is compiled. ``colab`` writes it into every solution; ``check`` fails when
  one differs or stands elsewhere;
* a notebook imports labkit before torch (``import labkit`` sets how OpenMP's threads wait,
  which only works before torch loads): ``torch_before_labkit`` finds a cell that does not;
* cells whose output varies from run to run (plots, widgets, timings) start with
  ``# NBVAL_IGNORE_OUTPUT``; grading runs ``pytest --nbval-lax``, which compares no
  output anyway, so a cell fails only by raising.

Commands (from the repository root)::

    python -m labkit.notebooks generate   # write notebooks/ from solutions/
    python -m labkit.notebooks check      # exit 1 if notebooks/ is stale or anything stores outputs
    python -m labkit.notebooks strip      # strip outputs and widget state from solutions/ in place
    python -m labkit.notebooks colab      # write the install cell (INSTALL_CELL) after every solution's title
    python -m labkit.notebooks verify submissions/   # students' check cells unchanged?
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

BEGIN = re.compile(r"^(?P<indent>[ \t]*)### BEGIN SOLUTION(?:[ \t]+hint:[ \t]*(?P<hint>.*?))?[ \t]*$")
END = re.compile(r"^[ \t]*### END SOLUTION[ \t]*$")
MARKER = re.compile(r"###[ \t]*(BEGIN|END)[ \t]+SOLUTION")
STUB_PREFIX = "raise NotImplementedError("
DEFAULT_HINT = "replace this line with your solution"
CHECK_PREFIX = "# CHECK"

# Metadata a run adds and a committed notebook must not carry.
VOLATILE_CELL_METADATA = ("execution", "ExecuteTime", "widgets")
KEPT_NOTEBOOK_METADATA = ("kernelspec", "language_info", "colab", "accelerator")
# The kernelspec Jupyter writes for ipykernel's python3 kernel: stored as such, a notebook
# saved from JupyterLab and stripped again does not change.
DEFAULT_KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}

# ---- the install cell: the first code cell of every notebook ---------------------------------
#: Where a notebook's first cell installs labkit from, on Colab and any runtime where labkit
#: is not installed: a pip Git URL (``git+https://host/owner/repo[@ref]``) or a wheel's URL
#: (``make dist`` builds it). The one place to change for a course hosted elsewhere: edit it,
#: then ``python -m labkit.notebooks colab`` and ``generate``. A student (or a course's setup
#: cell) can override it at run time with the environment variable ``LABKIT_SOURCE``, which
#: may also be a wheel's path on the runtime's disk.
LABKIT_SOURCE = "git+https://github.com/labkit-lab/labkit"

INSTALL_CELL = """\
#@title Install labkit where it is missing (Colab, Kaggle); under `make lab` this cell does nothing
# From $LABKIT_SOURCE when set (your course's labkit wheel: a path or URL), else from the default below.
import glob, importlib.util, os, pathlib, re, sys, urllib.request
if getattr(importlib.util.find_spec("labkit"), "origin", None) is None:   # (a folder named labkit is not it)
    src = os.environ.get("LABKIT_SOURCE", @SOURCE@)
    src = src if "://" in src else pathlib.Path(src).resolve().as_uri()
    try:                                       # reachable? fail now, not after pip's retries
        urllib.request.urlopen(re.sub(r"^git\\+|@[\\w.-]+$", "", src), timeout=10).close()
    except (OSError, ValueError) as e:
        raise RuntimeError(f"cannot reach {src} ({e}). Set LABKIT_SOURCE to your course's labkit wheel "
                           "(an instructor builds it with `make dist`), e.g. os.environ['LABKIT_SOURCE'] "
                           "= '/content/labkit-0.1.0-py3-none-any.whl', then run this cell again.") from None
    %pip install -q "labkit[lab,serve] @ {src}"
    if globals().get("_exit_code"):
        raise RuntimeError(f"pip could not install labkit from {src}: its message is above.")
    importlib.invalidate_caches()
    if not glob.glob("/dev/nvidia[0-9]*"):     # no NVIDIA GPU: compile the C++ CPU kernels now, not in a later cell
        !"{sys.executable}" -m labkit kernels
if "google.colab" in sys.modules:
    import plotly.io as pio
    pio.renderers.default = "colab"\
"""
#: Colab shows a cell whose ``cellView`` is ``form`` as its ``#@title`` line alone (the code one click away).
INSTALL_CELL_METADATA = {"cellView": "form"}


def install_cell(source: str = LABKIT_SOURCE) -> str:
    """The first code cell of every notebook, installing labkit from ``source`` by default."""
    return INSTALL_CELL.replace("@SOURCE@", json.dumps(source))


def is_install_cell(cell) -> bool:
    """A code cell that pip-installs labkit (the template's, or an older or hand-made one)."""
    src = _source(cell)
    return cell.get("cell_type") == "code" and "pip install" in src and "labkit" in src


def is_title_cell(cell) -> bool:
    """A markdown cell that opens with a level-1 heading (``# Chapter 3 — Sharing``)."""
    return cell.get("cell_type") == "markdown" and _source(cell).lstrip().startswith("# ")


#: An import of torch, or of a package that loads it (and with it OpenMP's runtime).
_TORCH_IMPORT = re.compile(r"^\s*(?:import|from)\s+(torch|transformers|triton|vllm)\b", re.MULTILINE)
_LABKIT_IMPORT = re.compile(r"^\s*(?:import|from)\s+labkit\b", re.MULTILINE)


def torch_before_labkit(nb) -> int | None:
    """The index of the first code cell that imports torch (or transformers, triton, vllm)
    before any cell, or any earlier line of that cell, imports labkit; None when labkit comes
    first everywhere."""
    for index, cell in enumerate(nb.cells):
        if cell.get("cell_type") != "code":
            continue
        src = _source(cell)
        torch_at, labkit_at = _TORCH_IMPORT.search(src), _LABKIT_IMPORT.search(src)
        if labkit_at and (torch_at is None or labkit_at.start() < torch_at.start()):
            return None
        if torch_at:
            return index
    return None


class NotebookError(ValueError):
    """A solution notebook breaks the conventions (unbalanced markers, marker in markdown)."""


# ---- cells -----------------------------------------------------------------------------
def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def is_check_cell(cell) -> bool:
    """A code cell whose first line starts with ``# CHECK``."""
    return cell.get("cell_type") == "code" and _source(cell).lstrip("\n").startswith(CHECK_PREFIX)


def is_solution_cell(cell) -> bool:
    """A code cell of a solution notebook holding a ``### BEGIN SOLUTION`` region."""
    return cell.get("cell_type") == "code" and any(BEGIN.match(line) for line in _source(cell).splitlines())


def is_stub_cell(cell) -> bool:
    """A code cell of a student notebook where a solution region was replaced by a stub."""
    return cell.get("cell_type") == "code" and any(
        line.strip().startswith(STUB_PREFIX) for line in _source(cell).splitlines())


def stub_source(source: str, where: str = "cell") -> str:
    """``source`` with every solution region replaced by a ``raise NotImplementedError``."""
    out: list[str] = []
    region = None                     # (indent, hint, line number) of the open BEGIN marker
    for number, line in enumerate(source.split("\n"), start=1):
        begin, end = BEGIN.match(line), END.match(line)
        if begin:
            if region is not None:
                raise NotebookError(f"{where}, line {number}: BEGIN SOLUTION inside the region "
                                    f"opened on line {region[2]}")
            region = (begin.group("indent"), (begin.group("hint") or "").strip() or DEFAULT_HINT, number)
        elif end:
            if region is None:
                raise NotebookError(f"{where}, line {number}: END SOLUTION without BEGIN SOLUTION")
            indent, hint, _ = region
            out.append(f"{indent}{STUB_PREFIX}{json.dumps(hint, ensure_ascii=False)})")
            region = None
        elif MARKER.search(line):
            raise NotebookError(f"{where}, line {number}: malformed marker {line.strip()!r}; write "
                                "'### BEGIN SOLUTION [hint: ...]' or '### END SOLUTION' on a line of its own")
        elif region is None:
            out.append(line)
    if region is not None:
        raise NotebookError(f"{where}: BEGIN SOLUTION on line {region[2]} is never closed")
    return "\n".join(out)


#: Code that loads the real model (the default one unless told otherwise).
NEEDS_MODEL = re.compile(r"\bLLM\(|fetch_default_model|load_model\(|default_workload\(")


def needs_model(text: str) -> bool:
    """Whether a notebook's text loads the real model, which must then be cached first."""
    return bool(NEEDS_MODEL.search(text))


# ---- notebooks ---------------------------------------------------------------------------
def clean(nb) -> "nbformat.NotebookNode":
    """A copy of ``nb`` without outputs, execution counts, run metadata or widget state."""
    nb = nbformat.from_dict(json.loads(json.dumps(nb)))
    meta = {k: v for k, v in nb.metadata.items() if k in KEPT_NOTEBOOK_METADATA}
    if meta.get("kernelspec", {}).get("name", "python3") == "python3":
        meta["kernelspec"] = dict(DEFAULT_KERNELSPEC)     # another kernel's spec is kept as is
    if "language_info" in meta:       # its version fields describe the machine that last ran it
        meta["language_info"] = {"name": meta["language_info"].get("name", "python")}
    nb.metadata = nbformat.from_dict(meta)
    for cell in nb.cells:
        cell.source = _source(cell)
        for key in VOLATILE_CELL_METADATA:
            cell.metadata.pop(key, None)
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        else:
            cell.pop("outputs", None)
            cell.pop("execution_count", None)
    return nb


def student_version(nb, name: str = "notebook") -> "nbformat.NotebookNode":
    """The student notebook of a solution notebook: cleaned, solution regions stubbed."""
    nb = clean(nb)
    for index, cell in enumerate(nb.cells):
        where = f"{name}, cell {index}"
        if cell.cell_type == "code":
            cell.source = stub_source(cell.source, where)
        elif MARKER.search(cell.source):
            raise NotebookError(f"{where}: solution markers belong in code cells, not {cell.cell_type}")
    return nb


def read(path: Path) -> "nbformat.NotebookNode":
    """Read a notebook; cells without an id get one derived from the file name and their
    position (nbformat would invent random ones, and generation must be reproducible)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if data.get("nbformat", 4) == 4 and data.get("nbformat_minor", 0) >= 5:
        for index, cell in enumerate(data.get("cells", [])):
            if "id" not in cell:
                cell["id"] = hashlib.sha1(f"{Path(path).stem}/{index}".encode()).hexdigest()[:8]
    for cell in data.get("cells", []):
        cell["source"] = _source(cell)       # stored as a list of lines; worked on as one string
    return nbformat.from_dict(data)


def dumps(nb) -> str:
    """The exact text a notebook is stored as (nbformat's layout, one trailing newline)."""
    return nbformat.writes(nb, version=4).rstrip("\n") + "\n"


def stored_state(nb) -> list[str]:
    """What a committed notebook should not carry: outputs, counts, widget state."""
    problems = []
    if "widgets" in nb.metadata:
        problems.append("notebook metadata holds widget state ('widgets')")
    for index, cell in enumerate(nb.cells):
        if cell.get("outputs"):
            problems.append(f"cell {index} stores outputs")
        if cell.get("execution_count") is not None:
            problems.append(f"cell {index} stores an execution count")
        for key in VOLATILE_CELL_METADATA:
            if key in cell.get("metadata", {}):
                problems.append(f"cell {index} stores '{key}' metadata")
    return problems


@dataclass
class Paths:
    root: Path

    @property
    def solutions(self) -> Path:
        return self.root / "solutions"

    @property
    def notebooks(self) -> Path:
        return self.root / "notebooks"

    def solution_files(self) -> list[Path]:
        return sorted(self.solutions.glob("*.ipynb"))


def find_root(start: Path | None = None) -> Path:
    """The checkout holding ``solutions/``: the working directory or a parent, else the
    directory above the ``labkit`` package (an editable install)."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / "solutions").is_dir() and (d / "labkit").is_dir():
            return d
    pkg_parent = Path(__file__).resolve().parent.parent
    if (pkg_parent / "solutions").is_dir():
        return pkg_parent
    raise FileNotFoundError("no solutions/ directory found: run this from a labkit checkout (or pass --root)")


def expected_notebooks(paths: Paths) -> dict[str, str]:
    """File name -> the text ``generate`` writes for it."""
    out = {}
    for path in paths.solution_files():
        out[path.name] = dumps(student_version(read(path), f"solutions/{path.name}"))
    return out


def generate(paths: Paths) -> list[str]:
    """Write ``notebooks/`` from ``solutions/``; remove student notebooks whose solution is
    gone. Returns the names written or changed."""
    expected = expected_notebooks(paths)
    paths.notebooks.mkdir(exist_ok=True)
    changed = []
    for name, text in expected.items():
        target = paths.notebooks / name
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            target.write_text(text, encoding="utf-8")
            changed.append(name)
    for stale in sorted(paths.notebooks.glob("*.ipynb")):
        if stale.name not in expected:
            stale.unlink()
            changed.append(f"{stale.name} (removed: no solutions/{stale.name})")
    return changed


def check(paths: Paths) -> list[str]:
    """Every way ``notebooks/`` differs from what ``generate`` would write, and every
    solution notebook that stores outputs or widget state. Empty when all is well."""
    problems = []
    try:
        expected = expected_notebooks(paths)
    except NotebookError as e:
        return [str(e)]
    for path in paths.solution_files():
        nb = read(path)
        for p in stored_state(nb):
            problems.append(f"solutions/{path.name}: {p} (python -m labkit.notebooks strip)")
        problems += [f"solutions/{path.name}: {p}" for p in install_cell_problems(nb)]
        torch_first = torch_before_labkit(nb)
        if torch_first is not None:
            problems.append(f"solutions/{path.name}: cell {torch_first} imports torch before labkit is imported "
                            "(import labkit first: it sets how OpenMP's threads wait, before torch loads)")
    present = {p.name for p in paths.notebooks.glob("*.ipynb")} if paths.notebooks.is_dir() else set()
    for name, text in expected.items():
        target = paths.notebooks / name
        if name not in present:
            problems.append(f"notebooks/{name} is missing (python -m labkit.notebooks generate)")
        elif target.read_text(encoding="utf-8") != text:
            problems.append(f"notebooks/{name} differs from what solutions/{name} generates "
                            "(edit solutions/, then python -m labkit.notebooks generate)")
    for name in sorted(present - set(expected)):
        problems.append(f"notebooks/{name} has no solutions/{name}")
    return problems


def strip(paths: Paths) -> list[str]:
    """Clean every solution notebook in place (outputs, counts, widget state)."""
    changed = []
    for path in paths.solution_files():
        text = path.read_text(encoding="utf-8")
        new = dumps(clean(read(path)))
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(path.name)
    return changed


def install_cell_problems(nb, source: str = LABKIT_SOURCE) -> list[str]:
    """How ``nb`` breaks the install-cell convention: its title first, the install cell
    (``install_cell(source)``) right after it as the first code cell."""
    if not nb.cells or not is_title_cell(nb.cells[0]):
        return ["it does not open on its title (a markdown cell starting with '# ')"]
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    if not code or not is_install_cell(nb.cells[code[0]]):
        return ["its first code cell is not the install cell (python -m labkit.notebooks colab, then generate)"]
    problems = []
    if code[0] != 1:
        problems.append("the install cell does not come right after the title (python -m labkit.notebooks colab)")
    cell = nb.cells[code[0]]
    if cell.source != install_cell(source) or any(cell.metadata.get(k) != v for k, v in INSTALL_CELL_METADATA.items()):
        problems.append("its install cell differs from install_cell() (python -m labkit.notebooks colab, then "
                        "generate)")
    return problems


def colab(paths: Paths, source: str = LABKIT_SOURCE) -> list[str]:
    """Make every solution open on its title, followed by the install cell
    (``install_cell(source)``): an existing install cell is replaced and moved there, otherwise
    one is inserted. Returns the names changed. ``generate`` then carries it into ``notebooks/``."""
    changed = []
    for path in paths.solution_files():
        nb = read(path)
        old = next((c for c in nb.cells if is_install_cell(c)), None)
        if old is not None:
            nb.cells.remove(old)
            cell = old
        else:
            cell = nbformat.v4.new_code_cell()
            cell.id = hashlib.sha1(f"{path.stem}/install".encode()).hexdigest()[:8]
        cell.source = install_cell(source)
        cell.metadata.update(INSTALL_CELL_METADATA)
        title = next((i for i, c in enumerate(nb.cells) if is_title_cell(c)), None)
        if title is not None and title != 0:
            nb.cells.insert(0, nb.cells.pop(title))
        nb.cells.insert(1 if title is not None else 0, cell)
        text = dumps(nb)
        if text != path.read_text(encoding="utf-8"):
            path.write_text(text, encoding="utf-8")
            changed.append(path.name)
    return changed


#: A check cell's first line names its exercise: ``# CHECK exercise 2.1``.
CHECK_TITLE = re.compile(r"^#\s*CHECK\s+exercise\s+(?P<id>\S+)")


def exercise_id(cell) -> str | None:
    """The exercise a check cell grades ("2.1"), None for any other cell or a check cell
    that names none."""
    if not is_check_cell(cell):
        return None
    m = CHECK_TITLE.match(_source(cell).lstrip("\n"))
    return m.group("id") if m else None


@dataclass(slots=True)
class CheckCellMatch:
    """One check cell of a distributed notebook and the submitted cell that stands for it."""
    index: int              # its position among the distributed notebook's cells
    title: str              # its first line, e.g. "# CHECK exercise 2.1"
    source: str             # what it says in the distributed notebook
    found: int | None       # the submitted cell's position; None when the check cell is gone
    edited: bool            # the submitted cell says something else


def _normalized(source: str) -> str:
    """A cell's code without its comments and layout (blank lines, spaces between tokens):
    what it does, not how it looks. A cell that is not Python (a typo, a magic) is compared
    line by line, trailing spaces and blank lines aside."""
    import io
    import tokenize
    layout = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
              tokenize.ENDMARKER}
    try:
        tokens = tokenize.generate_tokens(io.StringIO(source).readline)
        return " ".join(t.string for t in tokens if t.type not in layout)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return "\n".join(line.rstrip() for line in source.splitlines() if line.strip())


def match_check_cells(submitted, distributed) -> tuple[list[CheckCellMatch], list[int]]:
    """Pair each check cell of ``distributed`` with the cell of ``submitted`` holding it.

    A cell is found by its id (Jupyter keeps cell ids, so an edited check cell, even one
    whose ``# CHECK`` line was removed, is still recognised), else as the first unpaired
    check cell with the same first line, else as the first unpaired code cell holding that line
    further down (a notebook without cell ids whose check cell has code typed above it).
    Returns the pairs, in the distributed order, and the positions of the submitted check
    cells that stand for none (extra ones). A copy of one
    of the lab's check cells (same first line: a check duplicated to run it again) is neither
    paired nor extra. ``edited`` ignores comments and layout.
    """
    wanted = [(i, c) for i, c in enumerate(distributed.cells) if is_check_cell(c)]
    checks = [i for i, c in enumerate(submitted.cells) if is_check_cell(c)]
    ids = {c.get("id"): i for i, c in enumerate(submitted.cells) if c.get("id") and c.get("cell_type") == "code"}
    found: list[int | None] = [None] * len(wanted)
    used: set[int] = set()
    for k, (_, cell) in enumerate(wanted):                       # 1. same cell id
        i = ids.get(cell.get("id")) if cell.get("id") else None
        if i is not None and i not in used:
            found[k] = i
            used.add(i)
    for k, (_, cell) in enumerate(wanted):                       # 2. same first line
        if found[k] is None:
            title = _source(cell).lstrip("\n").splitlines()[0].strip()
            i = next((i for i in checks if i not in used
                      and _source(submitted.cells[i]).lstrip("\n").splitlines()[0].strip() == title), None)
            if i is not None:
                found[k] = i
                used.add(i)
    for k, (_, cell) in enumerate(wanted):                       # 3. the first line further down (code typed above it)
        if found[k] is None:
            title = _source(cell).lstrip("\n").splitlines()[0].strip()
            i = next((i for i, c in enumerate(submitted.cells) if i not in used and c.get("cell_type") == "code"
                      and title in (line.strip() for line in _source(c).splitlines())), None)
            if i is not None:
                found[k] = i
                used.add(i)
    matches = []
    for (index, cell), i in zip(wanted, found, strict=True):
        source = _source(cell)
        edited = i is not None and _normalized(_source(submitted.cells[i])) != _normalized(source)
        matches.append(CheckCellMatch(index, source.lstrip("\n").splitlines()[0].strip(), source, i, edited))
    titles = {m.title for m in matches}
    return matches, [i for i in checks if i not in used
                     and _source(submitted.cells[i]).lstrip("\n").splitlines()[0].strip() not in titles]


#: A submission may be named ``<student>__<notebook>.ipynb`` (see ``labkit.grade.collect``).
STUDENT_SEPARATOR = "__"


def verify_submission(path: Path, paths: Paths) -> list[str]:
    """Whether a student's notebook still has the check cells it was given: the ``# CHECK``
    cells of ``notebooks/<same name>`` (``alice__02_paging.ipynb`` is ``02_paging.ipynb``),
    each present and unchanged (grading runs whatever the file holds, so an edited check
    would grade nothing). See ``match_check_cells``."""
    name = Path(path).name.rpartition(STUDENT_SEPARATOR)[2]
    original = paths.notebooks / name
    if not original.exists():
        return [f"{path}: no notebooks/{name} to compare with"]
    try:
        submitted = read(Path(path))
    except (OSError, ValueError) as e:
        return [f"{path}: not a readable notebook ({e})"]
    matches, extra = match_check_cells(submitted, read(original))
    problems = []
    for m in matches:
        if m.found is None:
            problems.append(f"{path}: check cell {m.title!r} is missing")
        elif m.edited:
            problems.append(f"{path}: check cell {m.title!r} was edited")
    if extra:
        problems.append(f"{path}: {len(extra)} extra check cell(s)")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.notebooks",
                                     description="Student notebooks from solutions/ (see the module docstring).")
    parser.add_argument("command", choices=("generate", "check", "strip", "colab", "verify"))
    parser.add_argument("submissions", nargs="*", type=Path,
                        help="verify: student notebooks whose check cells to compare with notebooks/")
    parser.add_argument("--root", type=Path, default=None, help="the checkout (default: found from here)")
    args = parser.parse_args(argv)
    try:
        paths = Paths(args.root.resolve() if args.root else find_root())
        if args.command == "verify":
            files = [f for p in args.submissions for f in (sorted(p.rglob("*.ipynb")) if p.is_dir() else [p])]
            problems = [msg for f in files if ".ipynb_checkpoints" not in f.parts
                        for msg in verify_submission(f, paths)]
            print("\n".join(problems) or f"{len(files)} notebooks: every check cell is intact")
            return 1 if problems else 0
        if args.command == "generate":
            changed = generate(paths)
            print("\n".join(f"wrote notebooks/{n}" for n in changed) or "notebooks/ is up to date")
            return 0
        if args.command == "colab":
            changed = colab(paths)
            print("\n".join(f"wrote the install cell into solutions/{n}" for n in changed)
                  or f"every solution installs labkit from {LABKIT_SOURCE}")
            return 0
        if args.command == "strip":
            changed = strip(paths)
            print("\n".join(f"stripped solutions/{n}" for n in changed) or "solutions/ is clean")
            return 0
        problems = check(paths)
    except (NotebookError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    print(f"notebooks/ is up to date with solutions/ ({len(paths.solution_files())} notebooks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
