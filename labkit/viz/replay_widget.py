"""Replay a ``Recording`` in the kernel: a slider and a play button over its snapshots.

(For a replay that needs no kernel, use ``Recording.figure()`` / ``export_html``.)
Importing this module needs ipywidgets.
"""

from __future__ import annotations

from . import _deps
from .pool import status_line
from .replay import Recording


class ReplayWidget(_deps.widgets().VBox):
    """A slider (with play button) over a ``Recording``, redrawing the block view.

    ``follow``: the sequence whose block table to show (default: the oldest running one
    of each moment). ``figure_widget``: as ``FigureView`` (None: the best available).
    """

    def __init__(self, recording: Recording, follow: str | None = None,
                 figure_widget: bool | None = None, interval_ms: int = 300):
        from ._render import FigureView
        W = _deps.widgets()
        if not len(recording):
            raise ValueError("the recording is empty: step the engine (or capture) first")
        self.recording = recording
        self._selections = recording.selections(follow)
        self._room = recording.logical_room(self._selections)
        last = len(recording) - 1
        self.slider = W.IntSlider(value=0, min=0, max=last, description="iteration",
                                  continuous_update=True, layout=W.Layout(width="460px"))
        self.play = W.Play(value=0, min=0, max=last, interval=interval_ms, description="play")
        W.jslink((self.play, "value"), (self.slider, "value"))
        self.status = W.HTML()
        self.view = FigureView(self._frame(0), figure_widget)
        self.slider.observe(lambda change: self.show(change["new"]), names="value")
        super().__init__([W.HBox([self.play, self.slider]), self.status, self.view.widget])
        self.show(0)

    def _frame(self, i: int) -> dict:
        return self.recording.frame_dict(i, self._selections[i], self._room)

    def show(self, i: int) -> None:
        """Draw snapshot ``i``."""
        self.index = i
        self.view.show(self._frame(i))
        snap = self.recording[i]
        event = f" · <b>{snap['event']}</b>" if snap.get("event") else ""
        self.status.value = f"<code>{status_line(snap['status'])}</code>{event}"
