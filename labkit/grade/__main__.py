"""python -m labkit.grade SUBMISSIONS [--out grades.csv] [--html report.html] [--jobs N] [--timeout S]
[--sandbox auto|bwrap|unshare|none] [--memory MiB] [--max-output MiB] [--notebook-timeout S]"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .report import csv_text, html_text, row_line, summary_text, use_colour, write
from .run import grade_class
from .sandbox import KINDS, Limits

DEFAULT_JOBS = max(1, min(4, os.cpu_count() or 1))
DEFAULT_LIMITS = Limits()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m labkit.grade",
        description="Run every submitted notebook in a fresh sandboxed kernel and write a gradebook: one row per "
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
    parser.add_argument("--notebook-timeout", type=float, default=DEFAULT_LIMITS.wall_s,
                        help=f"seconds a whole notebook may run (default {DEFAULT_LIMITS.wall_s:g})")
    parser.add_argument("--memory", type=int, default=DEFAULT_LIMITS.memory_mb,
                        help=f"MiB of memory a notebook's kernel may use (default {DEFAULT_LIMITS.memory_mb})")
    parser.add_argument("--max-output", type=int, default=DEFAULT_LIMITS.output_mb,
                        help=f"MiB a notebook may print (default {DEFAULT_LIMITS.output_mb})")
    parser.add_argument("--sandbox", choices=("auto", *KINDS), default="auto",
                        help="how each kernel is isolated: auto (default: bwrap, else unshare, else none, "
                             "with a warning), or one of them (an error if it does not work here)")
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
    try:
        limits = Limits(memory_mb=args.memory, output_mb=args.max_output, wall_s=args.notebook_timeout)
    except ValueError as e:
        parser.error(str(e))

    colour = use_colour(sys.stdout)

    def progress(row, done, total):
        print(row_line(row, done, total, colour), flush=True)

    def told(box, tried):
        if box.kind == "none":
            print("\n".join(["", "WARNING: NO SANDBOX. Each student's code will run with your permissions: it can",
                             "read and change your files, other students' notebooks and their grades.",
                             *(f"  tried {t}" for t in tried),
                             "Install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap) or allow user",
                             "namespaces, or grade in a container or as an unprivileged user.", ""]),
                  file=sys.stderr, flush=True)
        else:
            print(f"sandbox: {box.kind} ({box.detail})", flush=True)

    try:
        book = grade_class(args.submissions, root=args.root, jobs=args.jobs, timeout=args.timeout,
                           only=set(args.notebook) if args.notebook else None, sandbox=args.sandbox,
                           limits=limits, on_row=progress, on_sandbox=told)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
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
