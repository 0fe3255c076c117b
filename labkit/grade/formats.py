"""Every notebook a student can hand in, read as one kind: nbformat 4.5, code and text only.

JupyterLab and Notebook 7 write nbformat 4.5 (cells carry ids); classic Notebook before 6.1,
older VS Code and many tools write 4.0-4.4 (no ids); Colab writes 4.0 with its own ids in each
cell's metadata; IPython 1-3 wrote 3 (cells inside "worksheets"). ``load`` reads all of them
and rebuilds each cell from what grading needs: its type, its source (a string or a list of
lines), and an id. A cell keeps the id it carries (a 4.5 id, else Colab's); a cell without one
gets an id made from its position, so a notebook read twice is the same notebook. Outputs,
execution counts, attachments and metadata are dropped: only the code is run, and what a
notebook stored proves nothing. nbformat 3 goes through nbformat's own converter first; any
other version is refused with the reason.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import nbformat

#: Larger than any notebook of the lab with its outputs; a bigger file is not read at all.
MAX_BYTES = 64 << 20
CELL_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


class Unreadable(ValueError):
    """A file that cannot be graded as a notebook; the message says why, in one line."""


def _source(cell: dict) -> str:
    src = cell.get("source", cell.get("input", ""))     # v3 code cells keep their code in "input"
    if isinstance(src, list):
        src = "".join(s for s in src if isinstance(s, str))
    return src if isinstance(src, str) else ""


def _id(cell: dict, index: int, taken: set[str], salt: str) -> str:
    for candidate in (cell.get("id"), (cell.get("metadata") or {}).get("id")):
        if isinstance(candidate, str) and CELL_ID.match(candidate) and candidate not in taken:
            return candidate
    made = hashlib.sha1(f"{salt}/{index}".encode()).hexdigest()[:8]
    while made in taken:
        made = hashlib.sha1(made.encode()).hexdigest()[:8]
    return made


def parse(text: str, salt: str = "") -> nbformat.NotebookNode:
    """A notebook's JSON text as nbformat 4.5 (see the module docstring); ``Unreadable`` if not."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise Unreadable(f"not JSON ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(data, dict) or "nbformat" not in data:
        raise Unreadable("not a notebook (no nbformat field)")
    major = data.get("nbformat")
    if major == 3:
        try:
            data = nbformat.convert(nbformat.from_dict(data), 4)
        except Exception as e:   # noqa: BLE001 - nbformat's converter on a malformed v3 file
            raise Unreadable(f"nbformat 3 that could not be converted ({type(e).__name__}: {str(e)[:120]})") from None
    elif major != 4:
        raise Unreadable(f"nbformat {major!r}: only nbformat 3 and 4 (every Jupyter since 2014) can be graded; "
                         "open it in Jupyter and save it again")
    cells = data.get("cells")
    if not isinstance(cells, list):
        raise Unreadable("not a notebook (no list of cells)")
    nb = nbformat.v4.new_notebook()
    taken: set[str] = set()
    for index, cell in enumerate(cells):
        if not isinstance(cell, dict):
            continue
        kind = cell.get("cell_type")
        cell_id = _id(cell, index, taken, salt)
        taken.add(cell_id)
        if kind == "code":
            nb.cells.append(nbformat.v4.new_code_cell(_source(cell), id=cell_id))
        elif kind in ("markdown", "raw"):
            maker = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_raw_cell
            nb.cells.append(maker(_source(cell), id=cell_id))
    return nb


def load(path: Path) -> nbformat.NotebookNode:
    """The notebook at ``path`` (see ``parse``); ``Unreadable`` with the reason if it cannot be."""
    try:
        size = Path(path).stat().st_size
        if size > MAX_BYTES:
            raise Unreadable(f"{size >> 20} MiB: larger than any notebook of the lab ({MAX_BYTES >> 20} MiB)")
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise Unreadable("not UTF-8 text") from None
    except OSError as e:
        raise Unreadable(f"cannot be read ({e.strerror or e})") from None
    return parse(text, salt=Path(path).stem)
