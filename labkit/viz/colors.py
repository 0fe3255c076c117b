"""Colours shared by every view, so that one request has one colour everywhere.

Request colours are handed out in order of first appearance (``ColorMap``), not by hash:
neighbours in time get distinct colours and a replay keeps each request's colour from its
first frame to its last. The palette is mid-light (black text stays readable on it).
"""

from __future__ import annotations

# ColorBrewer Set2 + the light half of Tableau 20: 16 distinguishable mid-light colours.
PALETTE = (
    "#66c2a5", "#fc8d62", "#8da0cb", "#e78ac3", "#a6d854", "#ffd92f", "#e5c494", "#9edae5",
    "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d",
)

FREE = "#ffffff"
FREE_LINE = "#c8c8c8"
CACHED_FREE = "#fff1b8"
CACHED_FREE_LINE = "#c9a227"
SHARED_LINE = "#222222"
TEXT = "#222222"
MUTED = "#777777"

# Scheduler timeline states and the waste chart's categories.
STATE_COLORS = {
    "prefill": "#f28e2b",
    "decode": "#4e79a7",
    "waiting": "#d9d9d9",
    "preempted": "#e15759",
}
WASTE_COLORS = {
    "token_slots": "#4e79a7",
    "reserved_slots": "#f28e2b",
    "internal_fragmentation": "#e15759",
    "external_fragmentation": "#b07aa1",
    "free_slots": "#e8e8e8",
}


def tint(hex_color: str, amount: float) -> str:
    """``hex_color`` mixed with white: ``amount`` 0 gives the colour, 1 gives white."""
    h = hex_color.lstrip("#")
    r, g, b = (int(h[i:i + 2], 16) for i in (0, 2, 4))
    mix = lambda c: round(c + (255 - c) * amount)   # noqa: E731
    return f"#{mix(r):02x}{mix(g):02x}{mix(b):02x}"


def shade(hex_color: str, amount: float) -> str:
    """``hex_color`` mixed with black: ``amount`` 0 gives the colour, 1 gives black."""
    h = hex_color.lstrip("#")
    r, g, b = (int(h[i:i + 2], 16) for i in (0, 2, 4))
    mix = lambda c: round(c * (1 - amount))   # noqa: E731
    return f"#{mix(r):02x}{mix(g):02x}{mix(b):02x}"


class ColorMap:
    """Request id -> colour, first come first served, cycling through ``PALETTE``."""

    def __init__(self, palette: tuple[str, ...] = PALETTE):
        self.palette = palette
        self._colors: dict[str, str] = {}

    def __call__(self, request_id: str) -> str:
        color = self._colors.get(request_id)
        if color is None:
            color = self.palette[len(self._colors) % len(self.palette)]
            self._colors[request_id] = color
        return color

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._colors
