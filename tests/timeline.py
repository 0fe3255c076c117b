"""Where a ``make test`` run's workers wait: read the files LABKIT_TEST_TIMELINE=DIR wrote.

    LABKIT_TEST_TIMELINE=/tmp/tl make test
    python tests/timeline.py /tmp/tl [--gaps N] [--top N]

For each worker: when it started and ended, the time inside tests (setup, call, teardown) and
the gaps between them (collection, xdist's scheduling, a worker with nothing left to take);
then the longest gaps, and the longest test phases of the run.
"""

from __future__ import annotations

import argparse
import pathlib


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=pathlib.Path)
    parser.add_argument("--gaps", type=int, default=10, help="how many of the longest gaps to list")
    parser.add_argument("--top", type=int, default=25, help="how many of the longest test phases to list")
    args = parser.parse_args(argv)
    rows = []
    for path in sorted(args.folder.glob("*.tsv")):
        for line in path.read_text().splitlines():
            worker, start, end, phase, test = line.split("\t", 4)
            rows.append((worker, float(start), float(end), phase, test))
    if not rows:
        raise SystemExit(f"no timeline in {args.folder}")
    t0 = min(r[1] for r in rows)
    t1 = max(r[2] for r in rows)
    print(f"{len(rows)} test phases, {t1 - t0:.0f} s from the first to the last")
    gaps = []
    for worker in sorted({r[0] for r in rows}):
        mine = sorted((r for r in rows if r[0] == worker), key=lambda r: r[1])
        busy = sum(r[2] - r[1] for r in mine)
        for before, after in zip(mine, mine[1:]):
            gaps.append((after[1] - before[2], worker, before[2] - t0, before[4], after[4]))
        tail = t1 - mine[-1][2]
        print(f"{worker}: first at {mine[0][1] - t0:.0f} s, last ended at {mine[-1][2] - t0:.0f} s, "
              f"busy {busy:.0f} s, idle {t1 - t0 - busy:.0f} s (of which {tail:.0f} s at the end)")
    print(f"\nlongest {args.gaps} gaps between one worker's tests:")
    for gap, worker, at, before, after in sorted(gaps, reverse=True)[:args.gaps]:
        print(f"  {gap:7.1f} s  {worker} at {at:.0f} s: after {before}  before {after}")
    print(f"\nlongest {args.top} test phases:")
    for worker, start, end, phase, test in sorted(rows, key=lambda r: r[2] - r[1], reverse=True)[:args.top]:
        print(f"  {end - start:7.1f} s  {worker} {start - t0:5.0f}-{end - t0:5.0f} s  {phase:8} {test}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
