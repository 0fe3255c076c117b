"""Small arithmetic shared by every layer (no imports from labkit, so any module may use it)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative integers: how many size-``b`` pieces hold ``a`` items.

    ``cdiv(33, 16) == 3``: 33 tokens need three 16-slot blocks. Integer-only, so it is exact
    where ``math.ceil(a / b)`` would round through a float.
    """
    return -(-a // b)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between order statistics (numpy's default
    method); nan when there are no values."""
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def progress_bar(total: int, enabled: bool = True, desc: str = "generate"):
    """A tqdm bar on stderr, or None when disabled, when tqdm is missing, or when nobody
    would see it redraw: stderr is not a terminal and no Jupyter kernel shows a widget
    (test and CI logs stay one line per run instead of hundreds of redraws)."""
    import sys

    if not enabled or not (sys.stderr.isatty() or "ipykernel" in sys.modules):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, file=sys.stderr, unit="req")
