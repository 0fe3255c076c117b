"""Beam search on shared blocks, and swapping, drawn step by step: the beam tree, each beam's
block table, the device pool and the host pool.

``BeamTree`` (``labkit.memory.beam_tree``) plays beam search's memory side on the real memory
layer, one decoding step at a time: forks share blocks, deaths free them at once, the first
writer into a shared, partly filled last block copies it, and ``swap_out()``/``swap_in()``
move the beams' blocks to a host pool and back (preemption by swapping).

Every change leaves a snapshot (plain data); ``beam_figure_dict`` draws one, and
``BeamWidget`` steps through them (Back / Step / play and a slider), in JupyterLab 4
(ipywidgets 8) and Colab (ipywidgets 7). ``beam_animation`` is the kernel-free version
(plotly frames) for slides.

    tree = BeamTree(prompt_len=10, block_size=4)
    tree.step(["b0", "b0", "b0"])          # the prompt's beam forks into three
    tree.step(["b0", "b0", "b1"])          # b2 dies, b0 forks again
    BeamWidget(tree)
"""

from __future__ import annotations

from ..memory.beam_tree import Beam, BeamTree  # noqa: F401  (re-exported: the widget's model)
from . import _deps
from . import colors as C

# Trace order: fixed, so that a live figure updates trace by trace and frames animate.
EDGES, NODES, TABLE, DEVICE, HOST = 0, 1, 2, 3, 4
SHARED_COLOR = "#4e79a7"        # a block held by several beams
PRIVATE_COLOR = "#a0cbe8"       # a block held by one beam
DEAD_COLOR = "#d9d9d9"


# ---- drawing -----------------------------------------------------------------------------
def _pool_cells(refs: list[int], columns: int, y0: float) -> tuple[list, list, list, list]:
    xs, ys, color, text = [], [], [], []
    for x, rc in enumerate(refs):
        xs.append(x % columns)
        ys.append(y0 - x // columns)
        color.append(C.FREE if rc == 0 else SHARED_COLOR if rc > 1 else PRIVATE_COLOR)
        text.append(f"{x}" + (f"<br>×{rc}" if rc > 1 else ""))
    return xs, ys, color, text


def beam_figure_dict(snap: dict, max_steps: int | None = None, title: str | None = None) -> dict:
    """A plotly figure dict of one snapshot: the beam tree (left), the live beams' block
    tables (right, a block held by several beams in dark blue with its reference count),
    the device pool and the host pool beneath. Same five traces in the same order always."""
    tree = snap["tree"]
    last = max(max_steps or 0, snap["step"], 1)
    lane = {label: i for i, (label, *_rest) in enumerate(tree)}
    ex, ey, nx, ny, ncolor, ntext = [], [], [], [], [], []
    for label, parent, born, died in tree:
        end = died if died is not None else snap["step"]
        if parent is not None:                       # the fork: from the parent's lane
            ex += [born - 1, born, None]
            ey += [-lane[parent], -lane[label], None]
        ex += [born, end, None]
        ey += [-lane[label], -lane[label], None]
        nx.append(end)
        ny.append(-lane[label])
        ncolor.append(DEAD_COLOR if died is not None else C.STATE_COLORS["decode"])
        ntext.append(label + (" ✝" if died is not None else ""))
    tables = snap["tables"]
    refs = snap["host"] if any(t["on_host"] for t in tables.values()) else snap["device"]
    tx, ty, tcolor, ttext = [], [], [], []
    for label, t in tables.items():                  # each table beside its beam in the tree
        for i, x in enumerate(t["blocks"]):
            rc = refs[x]
            tx.append(i)
            ty.append(-lane[label])
            tcolor.append(SHARED_COLOR if rc > 1 else PRIVATE_COLOR)
            ttext.append(f"{'h' if t['on_host'] else ''}{x}" + (f" ×{rc}" if rc > 1 else ""))
    columns = 16
    dx, dy, dcolor, dtext = _pool_cells(snap["device"], columns, 0)
    hx, hy, hcolor, htext = _pool_cells(snap["host"], columns, 0)
    hx = [x + columns + 1 for x in hx]                # the host pool to the right of the device's
    square = lambda color, size: {"symbol": "square", "size": size, "color": color,   # noqa: E731
                                  "line": {"color": C.FREE_LINE, "width": 1}}
    data = [
        {"type": "scatter", "x": ex, "y": ey, "mode": "lines", "line": {"color": C.MUTED, "width": 2},
         "hoverinfo": "skip", "xaxis": "x", "yaxis": "y", "name": "beam tree"},
        {"type": "scatter", "x": nx, "y": ny, "mode": "markers+text", "text": ntext,
         "textposition": "middle right", "marker": {"size": 12, "color": ncolor},
         "xaxis": "x", "yaxis": "y", "name": "beams", "hoverinfo": "text"},
        {"type": "scatter", "x": tx, "y": ty, "mode": "markers+text", "text": ttext,
         "textfont": {"size": 10}, "marker": square(tcolor, 30), "xaxis": "x2", "yaxis": "y2",
         "name": "block tables", "hoverinfo": "text"},
        {"type": "scatter", "x": dx, "y": dy, "mode": "markers+text", "text": dtext,
         "textfont": {"size": 9}, "marker": square(dcolor, 24), "xaxis": "x3", "yaxis": "y3",
         "name": "device pool", "hoverinfo": "text"},
        {"type": "scatter", "x": hx, "y": hy, "mode": "markers+text", "text": htext,
         "textfont": {"size": 9}, "marker": square(hcolor, 24), "xaxis": "x3", "yaxis": "y3",
         "name": "host pool", "hoverinfo": "text"},
    ]
    rows = max(len(tree), 1)
    pool_rows = max((len(snap["device"]) - 1) // columns, (len(snap["host"]) - 1) // columns) + 1
    hidden = {"showgrid": False, "zeroline": False, "showticklabels": False}
    saved = snap["logical"] - snap["physical"]
    heading = title or (f"step {snap['step']}: {snap['event']}" if snap["event"] else f"step {snap['step']}")
    layout = {
        "title": {"text": f"{heading}<br><sub>{snap['physical']} blocks held, {snap['logical']} without "
                          f"sharing ({saved} saved) · forks {snap['forks']} · deaths {snap['deaths']} · "
                          f"copy-on-write copies {snap['copies']}</sub>", "x": 0.01},
        "showlegend": False, "height": 260 + 26 * rows + 30 * pool_rows,
        "margin": {"l": 10, "r": 10, "t": 110, "b": 10},
        "plot_bgcolor": "white",
        "xaxis": {**hidden, "domain": [0, 0.38], "range": [-0.5, last + 1.2]},
        "yaxis": {**hidden, "domain": [0.38, 1], "range": [-rows + 0.5, 0.6]},
        "xaxis2": {**hidden, "domain": [0.42, 1], "range": [-0.7, 12.5]},
        "yaxis2": {**hidden, "domain": [0.38, 1], "range": [-rows + 0.5, 0.6]},
        "xaxis3": {**hidden, "domain": [0, 1], "range": [-0.7, 2 * columns + 0.7]},
        "yaxis3": {**hidden, "domain": [0, 0.3], "range": [-pool_rows + 0.4, 1.0]},
        "annotations": [
            {"text": "beam tree", "x": 0, "y": 1.0, "xref": "paper", "yref": "paper", "showarrow": False,
             "xanchor": "left", "yanchor": "bottom"},
            {"text": "live beams' block tables (physical ids, ×refcount)", "x": 0.42, "y": 1.0,
             "xref": "paper", "yref": "paper", "showarrow": False, "xanchor": "left", "yanchor": "bottom"},
            {"text": "device pool", "x": 0, "y": 0.3, "xref": "paper", "yref": "paper", "showarrow": False,
             "xanchor": "left", "yanchor": "bottom"},
            {"text": "host pool (swap space)", "x": 0.52, "y": 0.3, "xref": "paper", "yref": "paper",
             "showarrow": False, "xanchor": "left", "yanchor": "bottom"},
        ],
    }
    return {"data": data, "layout": layout}


def beam_figure(snap: dict, **kwargs):
    """``beam_figure_dict`` as a ``go.Figure``."""
    return _deps.go().Figure(beam_figure_dict(snap, **kwargs))


def beam_animation(tree: "BeamTree | list[dict]"):
    """A ``go.Figure`` with one frame per snapshot and its own slider: needs no kernel."""
    snaps = _snapshots(tree)
    steps = max(s["step"] for s in snaps)
    frames = [{"name": str(i), "data": beam_figure_dict(s, steps)["data"],
               "layout": {"title": beam_figure_dict(s, steps)["layout"]["title"]}} for i, s in enumerate(snaps)]
    fig = beam_figure_dict(snaps[0], steps)
    fig["frames"] = frames
    fig["layout"]["sliders"] = [{"steps": [{"label": str(i), "method": "animate",
                                            "args": [[str(i)], {"mode": "immediate", "frame": {"duration": 0}}]}
                                           for i in range(len(snaps))], "currentvalue": {"prefix": "snapshot "}}]
    return _deps.go().Figure(fig)


def _snapshots(tree: "BeamTree | list[dict]") -> list[dict]:
    snaps = tree.snapshots if isinstance(tree, BeamTree) else list(tree)
    if not snaps:
        raise ValueError("nothing to show: no snapshot yet")
    return snaps


def demo_tree(block_size: int = 4) -> BeamTree:
    """The chapter's demonstration: a width-3 beam search that forks, loses beams, is
    swapped out to the host pool and back, and goes on."""
    tree = BeamTree(prompt_len=6, block_size=block_size, num_blocks=16, num_host_blocks=16)
    tree.step(["b0", "b0", "b0"])
    tree.step(["b1", "b1", "b0"])
    tree.step(["b1", "b3", "b3"])
    tree.swap_out()
    tree.swap_in()
    tree.step(["b3", "b3", "b1"])
    tree.step(["b3", "b3", "b3"])
    return tree


def record_engine_beams(engine, prompt_token_ids: list[int], params, request_id: str = "beams") -> list[dict]:
    """Run one beam-search request on ``engine`` (the real model's, ``llm.engine``, or the
    simulator's) to its end, and return a snapshot after each iteration, in the form
    ``BeamTree.snapshot`` gives, read from the engine's own sequences and allocators: the
    widget then shows what the engine did. ``params``: a ``BeamSearchParams``. Run it on an
    engine with no other request (the pools drawn are the whole engine's)."""
    from ..request import Status
    sched = engine.scheduler
    request = engine.add_request(list(prompt_token_ids), params, request_id=request_id)
    parents: dict[int, int | None] = {0: None}
    born: dict[int, int] = {0: 0}
    died: dict[int, int] = {}
    copies, step, snaps = 0, 0, []

    def snap(event: str) -> dict:
        host = sched.host_allocator
        live = [s for s in request.seqs if s.block_table is not None]
        tables = {f"b{s.index}": {"blocks": list(s.block_table.block_ids), "tokens": len(s.token_ids),
                                  "on_host": s.status is Status.SWAPPED} for s in live}
        device_refs = [sched.allocator.ref_count(x) for x in range(sched.allocator.num_blocks)]
        host_refs = [host.ref_count(x) for x in range(host.num_blocks)] if host is not None else []
        physical = len({(s.status is Status.SWAPPED, x) for s in live for x in s.block_table.block_ids})
        return {"step": step, "event": event,
                "tree": [(f"b{i}", None if parents[i] is None else f"b{parents[i]}", born[i], died.get(i))
                         for i in sorted(parents)],
                "tables": tables, "device": device_refs, "host": host_refs, "physical": physical,
                "logical": sum(len(t["blocks"]) for t in tables.values()), "copies": copies,
                "forks": sched.num_beam_forks, "deaths": sched.num_beam_deaths}

    snaps.append(snap("queued: one beam, the prompt"))
    while not request.finished:
        before = {s.index: tuple(s.token_ids) for s in request.seqs}
        engine.step()
        step += 1
        copies += engine.records[-1].num_copies if engine.records else 0
        for s in request.seqs:
            if s.index not in parents:           # a fork: its parent held its tokens but the last
                parents[s.index] = next((i for i, t in before.items() if t == tuple(s.token_ids[:-1])), 0)
                born[s.index] = step
            if s.finish_reason == "pruned" and s.index not in died:
                died[s.index] = step
        new = [f"b{parents[i]}→b{i}" for i in parents if born[i] == step]
        gone = [f"b{i}" for i in died if died[i] == step]
        what = (([f"fork {', '.join(new)}"] if new else [])
                + ([f"{', '.join(gone)} {'dies' if len(gone) == 1 else 'die'}"] if gone else []))
        snaps.append(snap(f"iteration {step}: " + ("; ".join(what) or ("finished" if request.finished
                                                                        else "the beams compute"))))
    return snaps


class BeamWidget:
    """Back / Step / play and a slider over a ``BeamTree``'s snapshots, redrawing the figure.

    ``figure_widget``: as ``FigureView`` (None: the best available here). The widget shows
    ``.box`` (an ipywidgets ``VBox``); displaying the object shows it too.
    """

    def __init__(self, tree: "BeamTree | list[dict]", figure_widget: bool | None = None,
                 interval_ms: int = 900):
        from ._render import FigureView
        W = _deps.widgets()
        self.snapshots = _snapshots(tree)
        self.steps = max(s["step"] for s in self.snapshots)
        last = len(self.snapshots) - 1
        self.back = W.Button(description="◀ Back", layout=W.Layout(width="90px"))
        self.next = W.Button(description="Step ▶", layout=W.Layout(width="90px"))
        self.slider = W.IntSlider(value=0, min=0, max=last, description="snapshot",
                                  continuous_update=True, layout=W.Layout(width="380px"))
        self.play = W.Play(value=0, min=0, max=last, interval=interval_ms, description="play")
        W.jslink((self.play, "value"), (self.slider, "value"))
        self.status = W.HTML()
        self.view = FigureView(self._frame(0), figure_widget)
        self.back.on_click(lambda _: self.show(max(0, self.index - 1)))
        self.next.on_click(lambda _: self.show(min(last, self.index + 1)))
        self.slider.observe(lambda change: self.show(change["new"]), names="value")
        self.box = W.VBox([W.HBox([self.back, self.next, self.play, self.slider]), self.status,
                           self.view.widget])
        self.index = -1
        self.show(0)

    def _frame(self, i: int) -> dict:
        return beam_figure_dict(self.snapshots[i], self.steps)

    def show(self, i: int) -> None:
        """Draw snapshot ``i`` (the slider follows)."""
        if i == getattr(self, "index", None):
            return
        self.index = i
        self.slider.value = i
        snap = self.snapshots[i]
        self.view.show(self._frame(i))
        self.status.value = (f"<code>{snap['event']}</code> · held {snap['physical']} blocks, "
                             f"{snap['logical']} without sharing")

    def _ipython_display_(self) -> None:
        from IPython.display import display
        display(self.box)
