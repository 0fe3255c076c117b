"""``python -m labkit.bench startup``: how long labkit's commands take to answer in a fresh process.

A command-line tool should answer ``--help`` at once. labkit's parsers import neither torch
nor the server (``labkit/__main__.py``): their answer costs the Python interpreter's start and
labkit's light top-level package. Loading the engine (``from labkit import LLM``: torch,
Transformers, the kernels) is measured beside them, for scale: that is what ``--help`` saves.

Each command runs ``--repeat`` times in a new interpreter (this one, ``sys.executable``),
after one unmeasured warm-up run (the operating system's file cache); the table gives the
median and the fastest wall time, and whether the command imports torch (one more run
under ``python -X importtime``). Other work on the machine slows every row alike: compare
rows of one run, and note the load average.

Examples::

    python -m labkit.bench startup
    python -m labkit.bench startup --repeat 10 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

# What is measured: each command exactly as a user types it (python: this interpreter).
COMMANDS = {
    "python -m labkit --help": ["-m", "labkit", "--help"],
    "python -m labkit serve --help": ["-m", "labkit", "serve", "--help"],
    "python -m labkit.bench": ["-m", "labkit.bench"],
    "python -c 'import labkit'": ["-c", "import labkit"],
    "python -c 'from labkit import LLM'": ["-c", "from labkit import LLM"],
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit.bench startup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5, help="measured runs of each command (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run_once(args: list[str]) -> float:
    """Wall seconds of one fresh interpreter running ``args``; a failure is an error."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"python {' '.join(args)} exited {done.returncode}: {done.stderr[-500:]}")
    return wall


def imports_torch(args: list[str]) -> bool:
    """Whether ``args`` imports torch (one more run, under ``-X importtime``, not timed)."""
    done = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True, timeout=300)
    return any(line.rsplit("|", 1)[-1].strip() == "torch" for line in done.stderr.splitlines())


def measure(repeat: int) -> list[dict]:
    rows = []
    for name, args in COMMANDS.items():
        run_once(args)                                        # warm the file cache
        times = [run_once(args) for _ in range(repeat)]
        rows.append({"command": name, "median_s": statistics.median(times), "min_s": min(times),
                     "imports_torch": imports_torch(args)})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.repeat < 1:
        print("startup: --repeat must be >= 1", file=sys.stderr)
        return 2
    rows = measure(args.repeat)
    if args.json:
        print(json.dumps({"repeat": args.repeat, "python": sys.version.split()[0], "rows": rows}))
    else:
        print(table(rows, args.repeat))
    return 0


def table(rows: list[dict], repeat: int) -> str:
    width = max(len(r["command"]) for r in rows)
    lines = [f"{'command':<{width}}  median    fastest   imports torch   ({repeat} fresh processes each)"]
    for r in rows:
        torch_loaded = "yes" if r["imports_torch"] else "no"
        lines.append(f"{r['command']:<{width}}  {r['median_s']:6.2f} s  {r['min_s']:6.2f} s  {torch_loaded}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
