"""Record a run one snapshot per iteration, then replay it: with a slider, or kernel-free.

A ``Recording`` is a list of block-view snapshots (``pool.snapshot``) plus the colours and
grid they are drawn with. It fills up while the live widget steps (``LiveEngineWidget``),
while ``record_engine`` runs an engine to the end, or while ``record_trace`` serves a
simulator trace. Then:

* ``ReplayWidget(recording)`` (``replay_widget.py``): a slider and play button over the
  snapshots, in the kernel;
* ``recording.figure()``: a ``go.Figure`` with one animation frame per snapshot and its own
  slider and play button, which needs no kernel: for slides, or a static HTML page;
* ``recording.export_html(path)``: that figure as one self-contained HTML file.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from . import _deps
from .blocks import ARROWS, LOGICAL, POOL, SLOTS, block_figure_dict
from .colors import ColorMap
from .pool import snapshot

if TYPE_CHECKING:
    from ..engine import Engine
    from ..sim import SimResult, TraceRequest

ANIMATED_TRACES = [POOL, SLOTS, LOGICAL, ARROWS]


class Recording:
    """Snapshots of one run, oldest first, and how to draw them (columns, colours).

    ``max_snapshots`` bounds memory on long runs: beyond it, every other snapshot is
    dropped (the replay keeps its whole span at half the time resolution).
    """

    def __init__(self, snapshots: list[dict] | None = None, *, columns: int | None = None,
                 max_snapshots: int = 4000):
        self.snapshots: list[dict] = list(snapshots or [])
        self.columns = columns
        self.colors = ColorMap()
        self.max_snapshots = max_snapshots

    def __len__(self) -> int:
        return len(self.snapshots)

    def __getitem__(self, i: int) -> dict:
        return self.snapshots[i]

    def __iter__(self) -> Iterator[dict]:
        return iter(self.snapshots)

    def append(self, snap: dict) -> None:
        self.snapshots.append(snap)
        if len(self.snapshots) > self.max_snapshots:
            self.snapshots = self.snapshots[::2]

    def capture(self, engine: "Engine") -> dict:
        """Snapshot ``engine`` now and keep it."""
        snap = snapshot(engine)
        self.append(snap)
        return snap

    # ---- what each frame shows ----------------------------------------------------------
    def selections(self, follow: str | None = None) -> list[str | None]:
        """The sequence whose block table each snapshot shows: ``follow`` while it holds
        blocks; otherwise the one shown before, while it lasts, else the oldest running."""
        chosen, current = [], follow
        for snap in self.snapshots:
            tables = snap["tables"]
            if follow is not None and follow in tables:
                current = follow
            elif current not in tables:
                current = next(iter(tables), None)
            chosen.append(current)
        return chosen

    def frame_dict(self, i: int, selected: str | None = None, logical_blocks: int | None = None) -> dict:
        """The block-view figure dict of snapshot ``i``."""
        return block_figure_dict(self.snapshots[i], selected, columns=self.columns,
                                 color=self.colors, logical_blocks=logical_blocks)

    def logical_room(self, selections: list[str | None]) -> int:
        return max((len(s["tables"][label]["block_ids"]) for s, label in zip(self.snapshots, selections)
                    if label in s["tables"]), default=1)

    # ---- a kernel-free animation -------------------------------------------------------
    def figure(self, follow: str | None = None, frame_ms: int = 350, max_frames: int = 400):
        """A ``go.Figure`` that animates the recording by itself (frames, slider, play/pause).

        At most ``max_frames`` frames (evenly spaced snapshots; the last always included):
        each frame carries the whole pool, so very long recordings would make a heavy page.
        """
        if not self.snapshots:
            raise ValueError("the recording is empty: step the engine (or capture) first")
        go = _deps.go()
        picks = _evenly(len(self.snapshots), max_frames)
        selections = self.selections(follow)
        room = self.logical_room(selections)
        dicts = [self.frame_dict(i, selections[i], room) for i in picks]
        frames, steps = [], []
        for i, d in zip(picks, dicts):
            name = str(i)
            layout = d["layout"]
            frames.append({"name": name, "traces": ANIMATED_TRACES,
                           "data": [d["data"][t] for t in ANIMATED_TRACES],
                           "layout": {"shapes": layout["shapes"], "annotations": layout["annotations"],
                                      "title": layout["title"]}})
            steps.append({"label": _frame_label(self.snapshots[i], i), "method": "animate",
                          "args": [[name], {"mode": "immediate", "frame": {"duration": 0, "redraw": True},
                                            "transition": {"duration": 0}}]})
        base = dicts[0]
        layout = base["layout"]
        extra = 110
        layout["height"] += extra
        layout["margin"] = dict(layout["margin"], b=layout["margin"]["b"] + extra)
        play = {"frame": {"duration": frame_ms, "redraw": True}, "fromcurrent": True,
                "transition": {"duration": 0}, "mode": "immediate"}
        layout["updatemenus"] = [{
            "type": "buttons", "direction": "left", "showactive": False,
            "x": 0, "xanchor": "left", "y": 0, "yanchor": "top", "pad": {"t": 48, "r": 10},
            "buttons": [
                {"label": "▶ play", "method": "animate", "args": [None, play]},
                {"label": "❚❚ pause", "method": "animate",
                 "args": [[None], {"mode": "immediate", "frame": {"duration": 0, "redraw": False},
                                   "transition": {"duration": 0}}]},
            ]}]
        layout["sliders"] = [{
            "active": 0, "steps": steps, "x": 0.22, "len": 0.78, "xanchor": "left",
            "y": 0, "yanchor": "top", "pad": {"t": 40},
            "currentvalue": {"prefix": "iteration ", "font": {"size": 12}},
        }]
        return go.Figure(data=base["data"], layout=layout, frames=frames)

    def export_html(self, path: str | Path, follow: str | None = None, frame_ms: int = 350,
                    max_frames: int = 400, include_plotlyjs: bool | str = True) -> Path:
        """Write the animation (``figure``) to ``path`` as one HTML file that works offline
        (plotly.js embedded; pass ``include_plotlyjs="cdn"`` for a small file)."""
        path = Path(path)
        fig = self.figure(follow, frame_ms, max_frames)
        fig.write_html(str(path), include_plotlyjs=include_plotlyjs, auto_play=False,
                       full_html=True)
        return path


def _frame_label(snap: dict, i: int) -> str:
    """The slider label of a snapshot: its iteration, starred when it was taken after an
    action between iterations (a fork, an abort)."""
    return f"{snap['status'].get('num_steps', i)}{'*' if snap.get('event') else ''}"


def _evenly(n: int, k: int) -> list[int]:
    """Up to ``k`` indices spread evenly over ``range(n)``, first and last included."""
    if n <= k:
        return list(range(n))
    return sorted({round(j * (n - 1) / (k - 1)) for j in range(k)})


def replay_figure(recording: Recording, follow: str | None = None, **options):
    """``recording.figure(...)``: the kernel-free animation of a recorded run."""
    return recording.figure(follow, **options)


def export_html(recording: Recording, path: str | Path, **options) -> Path:
    """``recording.export_html(path, ...)``."""
    return recording.export_html(path, **options)


# ---- making recordings ---------------------------------------------------------------
def record_engine(engine: "Engine", max_steps: int = 10_000, recording: Recording | None = None,
                  columns: int | None = None) -> Recording:
    """Step ``engine`` until it has nothing left (or ``max_steps``), one snapshot per
    iteration (plus one of the state before the first)."""
    rec = recording if recording is not None else Recording(columns=columns)
    if not rec.snapshots:
        rec.capture(engine)
    for _ in range(max_steps):
        if not engine.has_unfinished:
            break
        engine.step()
        rec.capture(engine)
    return rec


def record_trace(trace: list["TraceRequest"], policy: str = "continuous", *, columns: int | None = None,
                 block_size: int = 4, num_blocks: int = 48, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 64, enable_prefix_caching: bool = False,
                 max_model_len: int | None = None, reserve: str = "max_tokens",
                 max_steps: int = 5000) -> tuple[Recording, "SimResult"]:
    """Serve ``trace`` with the simulator, as ``labkit.sim.simulate`` does (same scheduler,
    same arrival handling), keeping a snapshot after every iteration.

    Small defaults (a 48-block pool of 4-slot blocks) suit a trace of a few short
    requests, the size that reads well on screen. Returns the recording and the run's
    ``SimResult``.
    """
    from ..sim import simulate

    rec = Recording(columns=columns)
    steps = []

    def capture(engine):
        if len(steps) > max_steps:
            raise RuntimeError(f"the trace did not finish within {max_steps} iterations")
        steps.append(None)
        rec.capture(engine)

    result = simulate(trace, policy, block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
                      max_model_len=max_model_len, reserve=reserve, on_step=capture)
    return rec, result
