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



class Stopwatch:
    """A long step's progress, shown while it runs: ``labkit: compiling ... 45 s`` redrawn in
    place once a second on a terminal or in a notebook, then ``labkit: compiling ... done in
    74 s``. Where nothing redraws (a log file, CI), one line when it starts and one when it
    ends. So a first run never looks stuck, and the last line is the step's real duration.

        with Stopwatch("labkit: converting the model") as watch:
            convert()
        watch.seconds          # how long it took
    """

    def __init__(self, what: str, every_s: float = 1.0):
        import sys

        self.what, self.every_s, self.seconds = what, every_s, 0.0
        self._stream = sys.stderr
        self._live = sys.stderr.isatty() or "ipykernel" in sys.modules   # as progress_bar decides
        self._thread = None

    def __enter__(self) -> "Stopwatch":
        import threading
        import time

        self._t0 = time.perf_counter()
        self._stop = threading.Event()
        if self._live:
            self._thread = threading.Thread(target=self._redraw, daemon=True)
            self._thread.start()
        else:
            print(f"{self.what}...", file=self._stream, flush=True)
        return self

    def _redraw(self) -> None:
        import time

        while not self._stop.wait(self.every_s):
            print(f"\r{self.what}... {time.perf_counter() - self._t0:.0f} s", end="", file=self._stream, flush=True)

    def __exit__(self, exc_type, exc, tb) -> None:
        import time

        self.seconds = time.perf_counter() - self._t0
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        verdict = "done" if exc_type is None else "failed"
        start = "\r" if self._live else ""
        print(f"{start}{self.what}... {verdict} in {self.seconds:.0f} s", file=self._stream, flush=True)
