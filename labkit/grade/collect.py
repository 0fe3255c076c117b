"""Who handed in what: the submissions folder read as (student, notebook, file) triples.

Two layouts, which may be mixed:

* ``SUBMISSIONS/<student>/<notebook>.ipynb`` (deeper folders are searched too: the student is
  the first folder under SUBMISSIONS);
* ``SUBMISSIONS/<student>__<notebook>.ipynb`` (two underscores), e.g. ``alice__02_paging.ipynb``.

A file named otherwise (``02_paging (1).ipynb``) is graded as the lab notebook whose check
cells it holds, if one does; a file in neither layout, or not one of the lab's notebooks, is
still listed (the student read from what its name allows), so that the report names it. For every student,
each of the lab's notebooks that anyone handed in and that student did not is listed as
missing (``path`` None). Jupyter's ``.ipynb_checkpoints``, hidden files and macOS's
``__MACOSX`` folders are skipped.

One student, one notebook, one row: where a student handed in several files of one notebook
(``02_paging.ipynb`` and ``02_paging (1).ipynb``), the newest by modification time is graded
(on a tie, the last by name) and the others are listed in its row as ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from ..notebooks import STUDENT_SEPARATOR as SEPARATOR
from ..notebooks import exercise_id
from .formats import Unreadable, load

SKIPPED = (".ipynb_checkpoints", "__MACOSX")


@dataclass(frozen=True, slots=True)
class Submission:
    """One notebook one student handed in (or should have: ``path`` is None if missing)."""
    student: str
    notebook: str             # the file name, e.g. "02_paging.ipynb"
    path: Path | None
    problem: str = ""         # why its student or notebook could not be told, if so
    renamed: str = ""         # the file's own name, when it was recognised as ``notebook`` by its content
    ignored: tuple[str, ...] = ()   # older files of the same notebook by the same student, not graded

    @property
    def known(self) -> bool:
        return not self.problem


def _skipped(relative: Path) -> bool:
    return any(part in SKIPPED or part.startswith(".") for part in relative.parts)


def _unknown(notebook: str, lab: Mapping[str, Sequence[str]]) -> str:
    """Why ``notebook`` is not graded, with the lab's notebook it was perhaps renamed from."""
    close = difflib.get_close_matches(notebook, sorted(lab), n=1, cutoff=0.6)
    return "unknown notebook: not one of the lab's" + (f" (a renamed {close[0]}?)" if close else "")


def exercises_of(nb) -> list[str]:
    """The exercises a notebook's check cells grade: what identifies a lab notebook."""
    return [e for e in map(exercise_id, nb.cells) if e]


def identify(path: Path, lab: Mapping[str, Sequence[str]]) -> str | None:
    """The lab notebook a renamed file is, told by its check cells: the one notebook whose
    check cells it shares, at least half of them; None if unreadable or ambiguous."""
    try:
        mine = set(exercises_of(load(path)))
    except Unreadable:
        return None
    shared = [name for name, theirs in lab.items() if mine & set(theirs)]
    if len(shared) == 1 and 2 * len(mine & set(lab[shared[0]])) >= len(lab[shared[0]]):
        return shared[0]
    return None


def collect(root: Path, lab: Mapping[str, Sequence[str]], only: set[str] | None = None) -> list[Submission]:
    """The submissions under ``root``; ``lab`` maps each of the lab's notebook file names to
    the exercises of its check cells (``exercises_of``). A file with another name is recognised
    by its check cells if it can be (``identify``: "02_paging (1).ipynb"). With ``only``,
    just those notebooks (and none is then reported missing elsewhere)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such folder of submissions")
    found: list[Submission] = []
    students: set[str] = {d.name for d in root.iterdir() if d.is_dir() and not _skipped(d.relative_to(root))}
    for path in sorted(root.rglob("*.ipynb")):
        relative = path.relative_to(root)
        if _skipped(relative) or not path.is_file():
            continue
        if len(relative.parts) > 1:
            student, notebook = relative.parts[0], path.name
            problem = "" if notebook in lab else _unknown(notebook, lab)
        elif SEPARATOR in path.stem:
            student, _, notebook = path.name.rpartition(SEPARATOR)
            problem = "" if notebook in lab else _unknown(notebook, lab)
        else:
            student, notebook = path.stem, path.name
            problem = (f"cannot tell whose it is: put it in a folder named after the student, "
                       f"or name it <student>{SEPARATOR}{path.name}")
        renamed = ""
        if problem.startswith("unknown notebook") and (same := identify(path, lab)):
            renamed, notebook, problem = path.name, same, ""
        if not problem.startswith("cannot tell"):
            students.add(student)
        if only is not None and notebook not in only and not problem:
            continue
        found.append(Submission(student, notebook, path, problem, renamed))
    found = _newest(found, root)
    graded = only if only is not None else {s.notebook for s in found if s.known}
    handed = {(s.student, s.notebook) for s in found}
    for student in sorted(students):
        for notebook in sorted(graded):
            if (student, notebook) not in handed:
                found.append(Submission(student, notebook, None))
    return sorted(found, key=lambda s: (s.student, s.notebook, str(s.path or "")))


def _newest(found: list[Submission], root: Path) -> list[Submission]:
    """One submission per student and known notebook: the newest file, naming the others."""
    groups: dict[tuple[str, str], list[Submission]] = {}
    for s in found:
        if s.known:
            groups.setdefault((s.student, s.notebook), []).append(s)
    keep = [s for s in found if not s.known]
    for group in groups.values():
        group.sort(key=lambda s: (s.path.stat().st_mtime, str(s.path)))
        newest, older = group[-1], group[:-1]
        ignored = tuple(str(s.path.relative_to(root)) for s in reversed(older))
        keep.append(dataclasses.replace(newest, ignored=ignored) if ignored else newest)
    return keep
