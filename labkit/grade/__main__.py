"""python -m labkit.grade SUBMISSIONS [--out grades.csv] [--html report.html] [--jobs N] [--timeout S]"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .report import csv_text, html_text, row_line, summary_text, use_colour, write
from .run import grade_class

DEFAULT_JOBS = max(1, min(4, os.cpu_count() or 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m labkit.grade",
        description="Run every submitted notebook in a fresh kernel and write a gradebook: one row per "
                    "student and notebook, one column per exercise. Layouts: SUBMISSIONS/<student>/<notebook>"
                    ".ipynb or SUBMISSIONS/<student>__<notebook>.ipynb (see docs/grading.md).")
    parser.add_argument("submissions", type=Path, help="the folder of submitted notebooks")
    parser.add_argument("--out", type=Path, default=Path("grades.csv"), help="CSV gradebook (default: grades.csv)")
    parser.add_argument("--html", type=Path, default=None, help="also write a self-contained HTML report here")
    parser.add_argument("--jobs", "-j", type=int, default=DEFAULT_JOBS,
                        help=f"notebooks graded at a time (default here: {DEFAULT_JOBS}, the number of cores "
                             "up to 4; each kernel holds torch, and in chapters 0, 1 and 6 the model)")
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds a cell may run before it is interrupted (default 300)")
    parser.add_argument("--notebook", action="append", default=None, metavar="NAME",
                        help="grade only this notebook, e.g. 02_paging.ipynb (repeatable); students "
                             "who did not hand it in are listed as missing")
    parser.add_argument("--root", type=Path, default=None,
                        help="the labkit checkout whose notebooks/ were distributed (default: found from here)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout:g}")

    colour = use_colour(sys.stdout)

    def progress(row, done, total):
        print(row_line(row, done, total, colour), flush=True)

    try:
        book = grade_class(args.submissions, root=args.root, jobs=args.jobs, timeout=args.timeout,
                           only=set(args.notebook) if args.notebook else None, on_row=progress)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: no gradebook written (the notebooks already running finish first)",
              file=sys.stderr)
        return 130
    write(args.out, csv_text(book))
    written = [str(args.out)]
    if args.html:
        write(args.html, html_text(book))
        written.append(str(args.html))
    print(summary_text(book, colour))
    print(f"wrote {', '.join(written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
