"""The block view: the physical KV block pool as a grid, and one sequence's block table.

Drawn from a ``snapshot`` (see ``pool.py``), never from a model of its own:

* the **pool**: one cell per physical block, in id order, ``columns`` per row. A free block
  is white; a cached-free block (reference count 0, still holding a prefix the cache may
  hand out again) is pale yellow with a dashed border; a held block has its owning
  request's colour, dark for the slots that hold a token and light for the empty ones, so
  internal fragmentation is visible at a glance. A block shared by several tables has a
  black border and its reference count (``×2``).
* the **logical block table** of one sequence, below: logical block ``L0, L1, ...`` with
  an arrow to the physical block that stores it. Two forked sequences point at the same
  physical cells until one of them writes (copy-on-write).

Hovering a cell shows its tokens, reference count, owners and fill.

``block_figure_dict`` returns a plain plotly figure dict (no plotly import: testable, and
reused for the replay's animation frames); ``block_figure`` wraps it in a ``go.Figure``.
Every figure has the same traces in the same order, so a live widget can update a
``FigureWidget`` trace by trace and a replay can animate between frames.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

from . import colors as C
from .pool import request_of, status_line

CELL_PX = 46            # a block's size on screen
PAD = 0.07              # gap around a cell, in cell units
GAP_ROWS = 1.1          # space between the pool and the logical table, in rows
MAX_HOVER_TOKENS = 16   # tokens listed in a hover label before "..."

# Trace order: fixed, because live updates and animation frames address traces by index.
POOL, SLOTS, LOGICAL, ARROWS = 0, 1, 2, 3


def _default_columns(num_blocks: int) -> int:
    return min(num_blocks, 16)


def _tokens_text(tokens) -> str:
    shown = ", ".join(str(t) for t in tokens[:MAX_HOVER_TOKENS])
    return f"[{shown}{', ...' if len(tokens) > MAX_HOVER_TOKENS else ''}]"


def _quoted(token_text: Callable[[list[int]], str], tokens) -> str:
    """The tokens' text, quoted and made safe for a plotly label (which reads HTML)."""
    try:
        text = token_text(list(tokens))
    except Exception:           # a tokenizer that cannot decode these ids: show none
        return "?"
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("\n", "↵")
    return f"“{text}”"


def layout_geometry(num_blocks: int, columns: int | None = None, logical_blocks: int = 1) -> dict:
    """Where things go, in cell units (y grows downward as negative numbers): pool rows,
    logical rows, and the y of the logical table's top edge."""
    cols = columns or _default_columns(num_blocks)
    pool_rows = math.ceil(num_blocks / cols)
    logical_rows = max(1, math.ceil(logical_blocks / cols))
    logical_top = -(pool_rows + GAP_ROWS)
    return {"columns": cols, "pool_rows": pool_rows, "logical_rows": logical_rows,
            "logical_top": logical_top, "bottom": logical_top - logical_rows}


def _cell(index: int, cols: int, top: float = 0.0) -> tuple[float, float, float, float]:
    """(x0, x1, y0, y1) of cell ``index`` in a grid whose top edge is at ``top``."""
    r, c = divmod(index, cols)
    return c + PAD, c + 1 - PAD, top - r - 1 + PAD, top - r - PAD


def _rect(x0, x1, y0, y1, fill, line="rgba(0,0,0,0)", width=1.0, dash="solid") -> dict:
    return {"type": "rect", "xref": "x", "yref": "y", "x0": x0, "x1": x1, "y0": y0, "y1": y1,
            "fillcolor": fill, "line": {"color": line, "width": width, "dash": dash},
            "layer": "below"}


def _block_shapes(x0, x1, y0, y1, state, fill, block_size, ref_count, color) -> list[dict]:
    """The rectangles of one block: a background, and the filled part in full colour."""
    if state == "free":
        return [_rect(x0, x1, y0, y1, C.FREE, C.FREE_LINE)]
    shared = ref_count > 1
    line = C.SHARED_LINE if shared else "rgba(0,0,0,0)"
    width = 2.5 if shared else 1.0
    if state == "cached-free":
        return [_rect(x0, x1, y0, y1, C.CACHED_FREE, C.CACHED_FREE_LINE, 1.5, "dot")]
    shapes = [_rect(x0, x1, y0, y1, C.tint(color, 0.72))]
    if fill:
        shapes.append(_rect(x0, x0 + (x1 - x0) * fill / block_size, y0, y1, color))
    if shared:     # the border last, over the fill
        shapes.append(_rect(x0, x1, y0, y1, "rgba(0,0,0,0)", line, width))
    return shapes


def block_figure_dict(snap: Mapping, selected: str | None = None, *, columns: int | None = None,
                      color: Callable[[str], str] | None = None, logical_blocks: int | None = None,
                      title: str | None = None,
                      token_text: Callable[[list[int]], str] | None = None) -> dict:
    """The block view of ``snap`` as a plotly figure dict (see the module docstring).

    ``selected``: the label of the sequence whose logical table is drawn (default: the
    first in ``snap["tables"]``, the oldest running). ``title``: default the status line
    (and the event, if any); ``""`` for none. ``color``: request id -> colour
    (pass one ``ColorMap`` to keep colours across figures). ``logical_blocks``: room to
    leave for the logical table (a replay fixes it so that frames share axes).
    ``token_text``: token ids -> text (a tokenizer's ``decode``), to show in hover labels.
    """
    pool, tables = snap["pool"], snap["tables"]
    color = color or C.ColorMap()
    n, bs = pool["num_blocks"], pool["block_size"]
    if selected is None:
        selected = next(iter(tables), None)
    table = tables.get(selected) if selected is not None else None
    n_logical = len(table["block_ids"]) if table else 0
    geo = layout_geometry(n, columns, max(n_logical, logical_blocks or 0))
    cols = geo["columns"]

    # Assign colours in pool order first, then any request with no blocks.
    for owners in pool["owners"]:
        for label in owners:
            color(request_of(label))
    for label in tables:
        color(request_of(label))

    shapes: list[dict] = []
    px, py, ptext, phover, pbg = [], [], [], [], []
    slot_x, slot_y = [], []
    for b in range(n):
        x0, x1, y0, y1 = _cell(b, cols)
        state, refs, fill = pool["state"][b], pool["ref_count"][b], pool["fill"][b]
        owners = pool["owners"][b]
        rcolor = color(request_of(owners[0])) if owners else C.FREE
        shapes += _block_shapes(x0, x1, y0, y1, state, fill, bs, refs, rcolor)
        px.append((x0 + x1) / 2)
        py.append((y0 + y1) / 2)
        ptext.append(f"{b}<br><b>×{refs}</b>" if refs > 1 else str(b))
        pbg.append(rcolor if state == "used" else (C.CACHED_FREE if state == "cached-free" else "#ffffff"))
        lines = [f"<b>block {b}</b> · {state}" + (f" · refs {refs}" if state == "used" else "")]
        if owners:
            lines.append("owners: " + ", ".join(owners))
        if state != "free":
            lines.append(f"fill {fill}/{bs} slots")
        if pool["cached"][b]:
            lines.append("in the prefix cache" + (" (reusable prefix)" if state == "cached-free" else ""))
        if pool["tokens"][b]:
            lines.append("tokens " + _tokens_text(pool["tokens"][b]))
            if token_text is not None:
                lines.append("text " + _quoted(token_text, pool["tokens"][b]))
        phover.append("<br>".join(lines))
        if bs <= 8 and state != "free":        # slot dividers: one token per slot
            for k in range(1, bs):
                xs = x0 + (x1 - x0) * k / bs
                slot_x += [xs, xs, None]
                slot_y += [y0, y0 + (y1 - y0) * 0.22, None]

    # The selected sequence's logical blocks, and an arrow from each to its physical block.
    lx, ly, ltext, lhover = [], [], [], []
    ax, ay, asize = [], [], []
    top = geo["logical_top"]
    if table:
        rid = request_of(selected)
        rcolor = color(rid)
        n_tok = table["num_tokens"]
        for i, block_id in enumerate(table["block_ids"]):
            x0, x1, y0, y1 = _cell(i, cols, top)
            held = min(bs, max(0, n_tok - i * bs))
            shapes += _block_shapes(x0, x1, y0, y1, "used", held, bs,
                                    pool["ref_count"][block_id], rcolor)
            lx.append((x0 + x1) / 2)
            ly.append((y0 + y1) / 2)
            ltext.append(f"L{i}→{block_id}")
            tok = pool["tokens"][block_id][:held] if pool["tokens"][block_id] else ()
            lhover.append(f"<b>{selected}</b> logical block {i} → physical block {block_id}"
                          f"<br>positions {i * bs}..{i * bs + bs - 1}, {held} filled"
                          f"<br>refs {pool['ref_count'][block_id]}"
                          + (f"<br>tokens {_tokens_text(tok)}" if tok else ""))
            # Arrow from the top of the logical cell to the bottom of the physical one.
            bx0, bx1, by0, _ = _cell(block_id, cols)
            ax += [(x0 + x1) / 2, (bx0 + bx1) / 2, None]
            ay += [y1, by0, None]
            asize += [0, 11, 0]

    status = snap.get("status", {})
    chips = "  ".join(f"<span style='color:{color(request_of(label))}'>■</span> {label}"
                      for label in tables)
    head = title if title is not None else status_line(status) if status else ""
    if title is None and snap.get("event"):
        head += f" · <b>{snap['event']}</b>"
    annotations = [
        _label(0, 0.12, f"<b>physical KV blocks</b> ({n} × {bs} slots)"),
        _label(0, top + 0.12, f"<b>block table of {selected}</b> (logical → physical)" if table
               else f"<b>block table of {selected}</b>: holds no blocks now" if selected
               else "<b>block table</b>: no sequence holds blocks"),
    ]
    if chips:
        annotations.append({"xref": "paper", "yref": "paper", "x": 0, "y": 1.0,
                            "xanchor": "left", "yanchor": "bottom", "showarrow": False,
                            "align": "left", "text": chips, "font": {"size": 12}})

    rows = geo["pool_rows"] + GAP_ROWS + geo["logical_rows"]
    width = cols * CELL_PX + 40
    top_margin = 62 if head else 34          # the title's line, then the request chips
    height = int(rows * CELL_PX + 30 + top_margin + 40)
    data = [
        {"type": "scatter", "name": "physical blocks", "x": px, "y": py, "mode": "markers+text",
         "text": ptext, "hovertext": phover, "hoverinfo": "text",
         "textfont": {"size": 10, "color": C.TEXT},
         "marker": {"symbol": "square", "size": CELL_PX * 0.86, "color": "rgba(0,0,0,0)"},
         "hoverlabel": {"bgcolor": pbg, "font": {"color": C.TEXT}},
         "customdata": [[b, pool["state"][b], pool["ref_count"][b], ",".join(pool["owners"][b])]
                        for b in range(n)],
         "showlegend": False},
        {"type": "scatter", "name": "slots", "x": slot_x, "y": slot_y, "mode": "lines",
         "line": {"color": "rgba(255,255,255,0.95)", "width": 1.2}, "hoverinfo": "skip",
         "showlegend": False},
        {"type": "scatter", "name": "logical blocks", "x": lx, "y": ly, "mode": "markers+text",
         "text": ltext, "hovertext": lhover, "hoverinfo": "text",
         "textfont": {"size": 10, "color": C.TEXT},
         "marker": {"symbol": "square", "size": CELL_PX * 0.86, "color": "rgba(0,0,0,0)"},
         "showlegend": False},
        {"type": "scatter", "name": "block table", "x": ax, "y": ay, "mode": "lines+markers",
         "line": {"color": C.shade(color(request_of(selected)), 0.35) if table else C.MUTED,
                  "width": 1.4},
         "marker": {"symbol": "arrow", "angleref": "previous", "size": asize or [0],
                    "color": C.shade(color(request_of(selected)), 0.35) if table else C.MUTED},
         "opacity": 0.6, "hoverinfo": "skip", "showlegend": False},
    ]
    data += _legend_entries()
    layout = {
        "title": {"text": head, "x": 0.01, "xanchor": "left", "y": 0.985, "yanchor": "top",
                  "font": {"size": 13}},
        "width": width, "height": height,
        "margin": {"l": 20, "r": 20, "t": top_margin, "b": 40},
        "xaxis": {"range": [-0.05, cols + 0.05], "visible": False, "fixedrange": True,
                  "constrain": "domain"},
        "yaxis": {"range": [geo["bottom"] - 0.05, 0.55], "visible": False, "fixedrange": True,
                  "scaleanchor": "x", "scaleratio": 1, "constrain": "domain"},
        "shapes": shapes,
        "annotations": annotations,
        "plot_bgcolor": "#ffffff", "paper_bgcolor": "#ffffff",
        "hovermode": "closest",
        "legend": {"orientation": "h", "x": 0, "xanchor": "left", "y": 0, "yanchor": "top",
                   "font": {"size": 11}, "itemclick": False, "itemdoubleclick": False},
        "dragmode": False,
    }
    return {"data": data, "layout": layout}


def _label(x: float, y: float, text: str) -> dict:
    return {"xref": "x", "yref": "y", "x": x + PAD, "y": y, "xanchor": "left",
            "yanchor": "bottom", "showarrow": False, "text": text, "font": {"size": 12}}


def _legend_entries() -> list[dict]:
    """Key entries (no data): what the cell styles mean."""
    def entry(name, fill, line, width=1.0):
        return {"type": "scatter", "name": name, "x": [None], "y": [None], "mode": "markers",
                "marker": {"symbol": "square", "size": 13, "color": fill,
                           "line": {"color": line, "width": width}},
                "hoverinfo": "skip", "showlegend": True}
    return [
        entry("free", C.FREE, C.FREE_LINE),
        entry("cached-free (reusable prefix)", C.CACHED_FREE, C.CACHED_FREE_LINE, 1.5),
        entry("held: dark = tokens, light = empty slots", C.PALETTE[2], C.tint(C.PALETTE[2], 0.72), 3),
        entry("shared (×reference count)", "#ffffff", C.SHARED_LINE, 2.5),
    ]


def block_figure(snap: Mapping, selected: str | None = None, **options):
    """The block view of ``snap`` as a ``plotly.graph_objects.Figure`` (``fig.show()``).

    ``snap`` comes from ``labkit.viz.snapshot(engine)`` or, for a bare allocator and
    hand-made block tables, ``labkit.viz.allocator_snapshot(allocator, {"A": t1, ...})``.
    Options as ``block_figure_dict``.
    """
    from ._deps import go
    return go().Figure(block_figure_dict(snap, selected, **options))
