"""Blocks moving between tiers: the device pool, the host tier behind it, and each step's copies.

``record_tiers`` serves prompts on an engine with a host tier (``LLM(num_offload_blocks=...)``
or the simulator's) and keeps one snapshot per iteration, read from the engine's own
allocators and the tier's ``last_offloads`` / ``last_loads``: which device blocks are held,
cached-free or free, which host blocks hold a tier copy or a swapped sequence's block, and
which blocks the iteration copied down (an eviction the tier kept) and up (a hit brought
back instead of recomputed). ``tier_figure`` draws the snapshots as frames with a slider (no
kernel needed); ``tier_figure_dict`` is one snapshot as plain data.

    llm = LLM(num_blocks=48, num_offload_blocks=96, max_num_seqs=1)
    snaps = record_tiers(llm.engine, [doc_a + q1, doc_b + q1, doc_a + q2], params)
    tier_figure(snaps).show()
"""

from __future__ import annotations

from . import _deps
from . import colors as C

USED = "#4e79a7"            # a device block held by a sequence
TIER = "#f28e2b"            # a host block holding an evicted cached block (the tier)
SWAPPED = "#b07aa1"         # a host block holding a swapped sequence's block
DOWN = "#e15759"            # outline: copied device -> host this iteration
UP = "#59a14f"              # outline: copied host -> device this iteration
COLUMNS = 16


def tier_snapshot(engine, step: int, event: str) -> dict:
    """The pools and the last iteration's tier copies, as plain data."""
    sched = engine.scheduler
    device, tier = sched.allocator, sched.tier
    if tier is None:
        raise ValueError("this engine has no host tier: build it with num_offload_blocks (or kv_offloading_size)")
    host = tier.host
    return {
        "step": step, "event": event,
        "device": [device.state(b) for b in range(device.num_blocks)],
        "host": ["free" if host.state(b) == "free" else
                 "tier" if host.is_cached(b) else "swapped" for b in range(host.num_blocks)],
        "offloaded": [list(p) for p in tier.last_offloads] if step else [],
        "loaded": [list(p) for p in tier.last_loads] if step else [],
        "stats": {k: v for k, v in tier.stats().items() if k.startswith(("num_", "host_"))},
        "device_hits": device.num_cache_hits,
    }


def record_tiers(engine, prompts: list[list[int]], params, one_at_a_time: bool = True) -> list[dict]:
    """Serve ``prompts`` (token ids) with ``params`` on ``engine`` and snapshot every iteration.
    ``one_at_a_time``: each prompt after the previous finished (the reuse pattern is then
    plain to see); else all queued at once. Run it on an engine with no other request."""
    snaps = [tier_snapshot(engine, 0, "start")]
    step = 0
    batches = [[p] for p in prompts] if one_at_a_time else [list(prompts)]
    for k, batch in enumerate(batches):
        for i, prompt in enumerate(batch):
            engine.add_request(list(prompt), params, request_id=f"p{k + i}")
        while engine.has_unfinished:
            engine.step()
            step += 1
            tier = engine.scheduler.tier
            moved = []
            if tier.last_offloads:
                moved.append(f"{len(tier.last_offloads)} block(s) down to the host")
            if tier.last_loads:
                moved.append(f"{len(tier.last_loads)} block(s) back up")
            snaps.append(tier_snapshot(engine, step, "; ".join(moved) or "no copies"))
    return snaps


def _cells(states: list[str], colors: dict[str, str], y0: float, x0: float, marked: dict[int, str]):
    xs, ys, fill, line, text = [], [], [], [], []
    for b, state in enumerate(states):
        xs.append(x0 + b % COLUMNS)
        ys.append(y0 - b // COLUMNS)
        fill.append(colors[state])
        line.append(marked.get(b, C.FREE_LINE))
        text.append(str(b))
    return xs, ys, fill, line, text


def tier_figure_dict(snap: dict, title: str | None = None) -> dict:
    """A plotly figure dict of one snapshot: the device pool (left) and the host pool (right),
    blocks copied down outlined red on both sides, blocks brought up outlined green. The
    same two traces in the same order always (frames animate)."""
    down_d = {d: DOWN for d, _ in snap["offloaded"]}
    down_h = {h: DOWN for _, h in snap["offloaded"]}
    up_h = {h: UP for h, _ in snap["loaded"]}
    up_d = {d: UP for _, d in snap["loaded"]}
    device_colors = {"used": USED, "cached-free": C.CACHED_FREE, "free": C.FREE}
    host_colors = {"tier": TIER, "swapped": SWAPPED, "free": C.FREE}
    dx, dy, dfill, dline, dtext = _cells(snap["device"], device_colors, 0, 0, {**down_d, **up_d})
    hx, hy, hfill, hline, htext = _cells(snap["host"], host_colors, 0, COLUMNS + 2, {**down_h, **up_h})

    def trace(name, x, y, fill, line, text):
        return {"type": "scatter", "x": x, "y": y, "mode": "markers+text", "text": text, "name": name,
                "textfont": {"size": 9}, "hoverinfo": "text",
                "marker": {"symbol": "square", "size": 22, "color": fill, "line": {"color": line, "width": 3}}}

    s = snap["stats"]
    rows = max((len(snap["device"]) - 1) // COLUMNS, (len(snap["host"]) - 1) // COLUMNS) + 1
    hidden = {"showgrid": False, "zeroline": False, "showticklabels": False}
    heading = title or f"step {snap['step']}: {snap['event']}"
    return {
        "data": [trace("device pool", dx, dy, dfill, dline, dtext),
                 trace("host pool", hx, hy, hfill, hline, htext)],
        "layout": {
            "title": {"text": f"{heading}<br><sub>device hits {snap['device_hits']} · host hits "
                              f"{s['num_host_cache_hits']} · offloaded {s['num_offloaded_blocks']} · tier holds "
                              f"{s['num_host_cached_blocks']} · host evictions {s['num_host_evictions']}</sub>",
                      "x": 0.01},
            "showlegend": False, "height": 170 + 28 * rows, "plot_bgcolor": "white",
            "margin": {"l": 10, "r": 10, "t": 90, "b": 10},
            "xaxis": {**hidden, "range": [-0.8, 2 * COLUMNS + 2.8]},
            "yaxis": {**hidden, "range": [-rows + 0.4, 1.2]},
            "annotations": [
                {"text": "device pool: held · <span style='color:#c9a227'>cached-free</span> · free",
                 "x": -0.5, "y": 0.9, "showarrow": False, "xanchor": "left"},
                {"text": "host pool: <span style='color:#f28e2b'>tier</span> · "
                         "<span style='color:#b07aa1'>swapped</span> · free",
                 "x": COLUMNS + 1.5, "y": 0.9, "showarrow": False, "xanchor": "left"},
            ],
        },
    }


def tier_figure(snaps: list[dict]):
    """A ``go.Figure`` with one frame per snapshot and a slider: needs no kernel."""
    if not snaps:
        raise ValueError("nothing to show: no snapshot yet")
    drawn = [tier_figure_dict(s) for s in snaps]
    frames = [{"name": str(i), "data": d["data"], "layout": {"title": d["layout"]["title"]}}
              for i, d in enumerate(drawn)]
    fig = tier_figure_dict(snaps[0])
    fig["frames"] = frames
    fig["layout"]["sliders"] = [{"steps": [{"label": str(i), "method": "animate",
                                            "args": [[str(i)], {"mode": "immediate", "frame": {"duration": 0}}]}
                                           for i in range(len(snaps))], "currentvalue": {"prefix": "step "}}]
    return _deps.go().Figure(fig)
