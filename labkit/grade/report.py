"""The gradebook's three faces: a CSV for a spreadsheet or an LMS, a self-contained HTML page,
and plain lines on the terminal ending in a per-exercise summary (what the class missed).

CSV columns: ``student, notebook, file, points, max_points``, one column per exercise (``pass``,
``fail: <the grader's hint>``, ``not attempted``, ``not run``, or empty when the exercise is not
in that row's notebook), then ``flags`` (integrity: edited or deleted check cells, what reached
for the grading machinery, limits hit, unknown notebooks), ``notes`` (what kept a notebook from
being graded in full: missing, corrupt, a kernel that died, a cell that raised; older files
ignored), each a ``; ``-separated list on one line, and ``sandbox`` (how its kernel was
isolated: ``bwrap``, ``unshare``, or ``none``).

Every cell is one line of plain text, and one that a spreadsheet would read as a formula
(starting with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return: a student named
``=HYPERLINK(...)``) is written with a leading ``'``, as OWASP advises.
"""

from __future__ import annotations

import csv
import html
import io
import os
from collections import Counter
from pathlib import Path
from typing import TextIO

from .notebook import FAIL, NOT_ATTEMPTED, NOT_RUN, PASS, Result, Row, one_line
from .run import Gradebook

STATUSES = (PASS, FAIL, NOT_ATTEMPTED, NOT_RUN)
FORMULA = ("=", "+", "-", "@", "\t", "\r")


def safe(value: object) -> object:
    """A CSV cell: numbers as they are, text on one line and never read as a formula."""
    if not isinstance(value, str):
        return value
    text = one_line(value, limit=4000, lines=1000)
    return "'" + text if text.startswith(FORMULA) else text


def cell_text(result: Result | None) -> str:
    if result is None:
        return ""
    return f"{FAIL}: {result.hint}" if result.status == FAIL and result.hint else result.status


def _by_exercise(row: Row) -> dict[str, Result]:
    return {r.exercise: r for r in row.results}


def csv_text(book: Gradebook) -> str:
    """The gradebook as CSV text (one row per student and notebook)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["student", "notebook", "file", "points", "max_points", *book.exercises, "flags", "notes",
                     "sandbox"])
    for row in book.rows:
        results = _by_exercise(row)
        writer.writerow([safe(v) for v in (row.student, row.notebook, row.file, row.points, row.max_points,
                                           *(cell_text(results.get(e)) for e in book.exercises),
                                           "; ".join(row.flags), "; ".join(row.notes), row.sandbox)])
    return out.getvalue()


def summary(book: Gradebook) -> list[dict]:
    """Per exercise: its points, how many rows passed / failed / did not attempt / did not run
    it, and the hint most often given (the idea the class missed)."""
    table = []
    for exercise in book.exercises:
        results = [r for row in book.rows for r in row.results if r.exercise == exercise]
        counts = Counter(r.status for r in results)
        hints = Counter(r.hint for r in results if r.status == FAIL and r.hint)
        top, times = hints.most_common(1)[0] if hints else ("", 0)
        table.append({"exercise": exercise, "points": results[0].max_points if results else 0,
                      **{s: counts.get(s, 0) for s in STATUSES}, "top_hint": top, "top_hint_count": times})
    return table


def _count(book: Gradebook) -> str:
    """"30 notebooks of 30 students", in good English for 1 too."""
    notebooks, students = len(book.rows), len({r.student for r in book.rows})
    return (f"{notebooks} notebook{'s' * (notebooks != 1)} of {students} "
            f"student{'s' * (students != 1)}")


# ---- the terminal ---------------------------------------------------------------------------
def use_colour(stream: TextIO) -> bool:
    """ANSI colours only on a terminal, and never with NO_COLOR set (https://no-color.org)."""
    return hasattr(stream, "isatty") and stream.isatty() and not os.environ.get("NO_COLOR") \
        and os.environ.get("TERM") != "dumb"


def _paint(text: str, code: str, colour: bool) -> str:
    return f"\033[{code}m{text}\033[0m" if colour else text


def row_line(row: Row, done: int, total: int, colour: bool = False) -> str:
    """One finished notebook, as a progress line."""
    width = len(str(total))
    score = f"{row.points}/{row.max_points}" if row.max_points else "-"
    code = "32" if row.max_points and row.points == row.max_points else "31" if row.points == 0 else "33"
    said = "; ".join([*(f"FLAG {f}" for f in row.flags), *row.notes])
    return (f"[{done:>{width}}/{total}] {row.student:<16} {row.notebook:<28} "
            f"{_paint(f'{score:>7}', code, colour)} {row.seconds:6.1f} s" + (f"  {said}" if said else ""))


def summary_text(book: Gradebook, colour: bool = False) -> str:
    """The per-exercise table, then the flagged and incomplete notebooks."""
    lines = ["", f"{'exercise':<9} {'points':>6} {'passed':>7} {'failed':>7} {'not attempted':>14} "
             f"{'not run':>8}  most frequent hint"]
    for s in summary(book):
        hint = f"({s['top_hint_count']}x) {s['top_hint']}" if s["top_hint"] else ""
        lines.append(f"{s['exercise']:<9} {s['points']:>6} {_paint(f'{s[PASS]:>7}', '32', colour)} "
                     f"{_paint(f'{s[FAIL]:>7}', '31', colour)} {s[NOT_ATTEMPTED]:>14} {s[NOT_RUN]:>8}  "
                     f"{hint[:90]}")
    flagged = [r for r in book.rows if r.flags]
    if flagged:
        lines += ["", _paint(f"flagged ({len(flagged)}):", "1", colour)]
        lines += [f"  {r.student} {r.notebook}: {'; '.join(r.flags)}" for r in flagged]
    incomplete = [r for r in book.rows if r.notes]
    if incomplete:
        lines += ["", f"not graded in full ({len(incomplete)}):"]
        lines += [f"  {r.student} {r.notebook}: {'; '.join(r.notes)}" for r in incomplete]
    lines += ["", f"{_count(book)} graded in {book.seconds:.0f} s "
                  f"({book.jobs} at a time), sandbox: {book.sandbox}"]
    lines += [_paint(f"WARNING: {w}", "1;31", colour) for w in book.warnings]
    return "\n".join(lines)


# ---- HTML -----------------------------------------------------------------------------------
_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0 2em; }
th, td { border: 1px solid #ccc; padding: 4px 8px; vertical-align: top; text-align: left; }
th { background: #f3f3f3; position: sticky; top: 0; }
td.num { text-align: right; }
td.pass { background: #dff5e1; } td.fail { background: #fde2e1; }
td.na { background: #f4f4f4; color: #777; } td.notrun { background: #fff4d6; }
td.hint { max-width: 28em; font-size: 12px; }
.small { font-size: 12px; color: #555; max-width: 30em; }
.flag { color: #a40000; font-weight: 600; }
"""
_CLASS = {PASS: "pass", FAIL: "fail", NOT_ATTEMPTED: "na", NOT_RUN: "notrun"}


def html_text(book: Gradebook, title: str = "labkit gradebook") -> str:
    """The gradebook as one self-contained HTML page (no scripts, no links); every piece of
    text from a submission is escaped."""
    e = html.escape
    parts = [f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>{e(title)}</title>"
             f"<style>{_CSS}</style></head><body>", f"<h1>{e(title)}</h1>",
             f"<p>{_count(book)}, graded in "
             f"{book.seconds:.0f} s ({book.jobs} at a time); sandbox: {e(book.sandbox)}.</p>",
             *(f"<p class='flag'>WARNING: {e(w)}</p>" for w in book.warnings), "<h2>Per exercise</h2><table><tr>"
             "<th>exercise</th><th>points</th><th>passed</th><th>failed</th><th>not attempted</th>"
             "<th>not run</th><th>most frequent hint</th></tr>"]
    for s in summary(book):
        hint = f"({s['top_hint_count']}×) {s['top_hint']}" if s["top_hint"] else ""
        parts.append(f"<tr><td>{e(s['exercise'])}</td><td class='num'>{s['points']}</td>"
                     f"<td class='num'>{s[PASS]}</td><td class='num'>{s[FAIL]}</td>"
                     f"<td class='num'>{s[NOT_ATTEMPTED]}</td><td class='num'>{s[NOT_RUN]}</td>"
                     f"<td class='hint'>{e(hint)}</td></tr>")
    parts.append("</table><h2>Gradebook</h2><table><tr><th>student</th><th>notebook</th><th>points</th>"
                 + "".join(f"<th>{e(x)}</th>" for x in book.exercises) + "<th>flags</th><th>notes</th></tr>")
    for row in book.rows:
        results = _by_exercise(row)
        cells = []
        for x in book.exercises:
            r = results.get(x)
            if r is None:
                cells.append("<td></td>")
            else:
                hint = f"<div class='small'>{e(r.hint)}</div>" if r.hint else ""
                cells.append(f"<td class='{_CLASS[r.status]}'>{e(r.status)} {r.points}/{r.max_points}{hint}</td>")
        flags = "".join(f"<div class='flag'>{e(f)}</div>" for f in row.flags)
        notes = "".join(f"<div class='small'>{e(n)}</div>" for n in row.notes)
        parts.append(f"<tr><td>{e(row.student)}</td><td>{e(row.notebook)}<div class='small'>{e(row.file)}</div></td>"
                     f"<td class='num'>{row.points}/{row.max_points}</td>{''.join(cells)}"
                     f"<td>{flags}</td><td>{notes}</td></tr>")
    parts.append("</table>")
    parts += _per_student(book)
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _per_student(book: Gradebook) -> list[str]:
    """When several notebooks were graded: each student's points per notebook and in all."""
    e = html.escape
    notebooks = sorted({r.notebook for r in book.rows if r.max_points})
    if len(notebooks) < 2:
        return []
    best = {(row.student, row.notebook): row for row in book.rows if row.max_points}   # one row each (collect)
    out = ["<h2>Per student</h2><table><tr><th>student</th>"
           + "".join(f"<th>{e(n)}</th>" for n in notebooks) + "<th>total</th></tr>"]
    for student in sorted({r.student for r in book.rows}):
        rows = [best.get((student, n)) for n in notebooks]
        cells = "".join(f"<td class='num'>{r.points}</td>" if r else "<td></td>" for r in rows)
        total = sum(r.points for r in rows if r)
        most = sum(r.max_points for r in rows if r)
        out.append(f"<tr><td>{e(student)}</td>{cells}<td class='num'>{total}/{most}</td></tr>")
    out.append("</table>")
    return out


def write(path: Path, text: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text, encoding="utf-8")
