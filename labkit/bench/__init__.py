"""Benchmarks: ``python -m labkit.bench WHAT`` (``__main__.COMMANDS`` lists them)."""

import statistics
import time


def time_in_turn(fns: dict, warmup: int, repeats: int) -> dict[str, float]:
    """Median milliseconds per call of each function, the functions called in turn (one call
    each per round, the order rotating): on a shared machine a busy moment slows them all
    alike, which timing one after the other would not."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def table_header(columns: list[tuple[str, str]]) -> str:
    """A fixed-width table's column names, each as wide as its format (``(name, "{:>10.3f}")``
    pairs; every format is at least as wide as its name)."""
    return "  ".join(f"{name:<{_width(fmt)}}" if "<" in fmt else f"{name:>{_width(fmt)}}" for name, fmt in columns)


def table_line(columns: list[tuple[str, str]], row: dict) -> str:
    """One row of that table."""
    return "  ".join(fmt.format(row[name]) for name, fmt in columns)


def _width(fmt: str) -> int:
    return int("".join(c for c in fmt.split(":")[1].split(".")[0] if c.isdigit()))
