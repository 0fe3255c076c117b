"""The scheduler timeline: a Gantt chart of requests over iterations, and KV usage beneath.

Each request is a row; each iteration colours it by what the request did in it:
**prefill** (its prompt, or the recompute of a preempted sequence), **decode** (one new
token per sequence), **waiting** (arrived, not in the batch), **preempted** (thrown out of
the batch to free memory, waiting to be recomputed). Under it, the share of the KV pool
held (KV cache usage) and the share of held slots holding a token, per iteration.

Side by side on the same requests, static batching (a batch runs until its longest member
ends; nobody joins meanwhile) and continuous batching (requests join and leave every
iteration) show why the latter finishes sooner and keeps memory busier.

``timeline_data`` is plain data from ``StepRecord``s (unit-testable); ``timeline_figure``
draws one or more runs; ``compare_schedulers`` simulates a trace under each policy and
draws them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from . import _deps
from .colors import STATE_COLORS

if TYPE_CHECKING:
    from ..request import Request
    from ..scheduler import StepRecord
    from ..sim import SimResult, TraceRequest

STATES = ("prefill", "decode", "waiting", "preempted")
POLICY_TITLES = {"static": "static batching", "continuous": "continuous batching"}


def timeline_data(records: Sequence["StepRecord"], requests: Iterable["Request"] | None = None) -> dict:
    """What the Gantt chart draws, from the engine's step records.

    Returns ``{"requests": ids (arrival order), "steps", "start_s", "duration_s",
    "cells": {id: [state or None per record]}, "tokens": {id: {"prefill": n, "decode": n}},
    "segments": [runs of one state: {"request", "state", "first", "last", "start_s",
    "end_s", "start_step", "end_step"}], "kv": {"num_used_blocks", "num_total_blocks",
    "kv_cache_usage", "held_slot_fill"}}``.

    A request counts as *waiting* from its arrival (needs ``requests``; without them, from
    its first appearance in the records) until it runs, and as *preempted* from a
    preemption until it runs again; it runs in *prefill* if any of its sequences computes
    prompt (or recomputed) tokens in the iteration, else in *decode*.
    """
    records = list(records)
    reqs = list(requests) if requests is not None else []
    arrival = {r.request_id: r.arrival_time for r in reqs}
    finish = {r.request_id: r.finished_time for r in reqs if r.finished_time is not None}
    order = sorted(arrival, key=lambda rid: arrival[rid])
    first_seen: dict[str, int] = {}
    for k, rec in enumerate(records):
        for rid in [x[0] for x in rec.ran] + list(rec.preempted):
            first_seen.setdefault(rid, k)
    order += sorted((rid for rid in first_seen if rid not in arrival), key=first_seen.get)

    cells = {rid: [None] * len(records) for rid in order}
    tokens = {rid: {"prefill": 0, "decode": 0} for rid in order}
    preempted = dict.fromkeys(order, False)
    done: set[str] = set()
    for k, rec in enumerate(records):
        phases: dict[str, set[str]] = {}
        for rid, _index, n, phase in rec.ran:
            phases.setdefault(rid, set()).add(phase)
            tokens[rid][phase] += n
        for rid in rec.preempted:
            preempted[rid] = True
        for rid in order:
            if rid in done:
                continue
            if rid in phases:
                cells[rid][k] = "prefill" if "prefill" in phases[rid] else "decode"
                preempted[rid] = False
                continue
            arrived = (arrival[rid] <= rec.time_s + 1e-12) if rid in arrival else k >= first_seen[rid]
            gone = rid in finish and finish[rid] <= rec.time_s + 1e-12
            if arrived and not gone:
                cells[rid][k] = "preempted" if preempted[rid] else "waiting"
        done.update(rec.finished)

    start = [rec.time_s for rec in records]
    duration = [rec.duration_s for rec in records]
    steps = [rec.step for rec in records]
    segments = []
    for rid in order:
        row, k = cells[rid], 0
        while k < len(row):
            if row[k] is None:
                k += 1
                continue
            j = k
            while j + 1 < len(row) and row[j + 1] == row[k]:
                j += 1
            segments.append({"request": rid, "state": row[k], "first": k, "last": j,
                             "start_s": start[k], "end_s": start[j] + duration[j],
                             "start_step": steps[k], "end_step": steps[j]})
            k = j + 1
    used = [rec.num_used_blocks for rec in records]
    total = [rec.num_used_blocks + rec.num_free_blocks for rec in records]
    return {
        "requests": order, "steps": steps, "start_s": start, "duration_s": duration,
        "cells": cells, "tokens": tokens, "segments": segments,
        "kv": {"num_used_blocks": used, "num_total_blocks": total,
               "kv_cache_usage": [rec.kv_cache_usage for rec in records],
               "held_slot_fill": [rec.held_slot_fill for rec in records]},
    }


def _runs(runs) -> dict[str, tuple[list, list]]:
    """Normalise the accepted inputs to ``{title: (records, requests)}``."""
    if hasattr(runs, "records"):
        runs = {getattr(runs, "metrics", {}).get("policy", "run"): runs}
    out = {}
    for name, run in runs.items():
        if hasattr(run, "records"):
            out[name] = (run.records, getattr(run, "requests", None), getattr(run, "metrics", {}))
        else:
            records, requests = run
            out[name] = (records, requests, {})
    return out


def timeline_figure(runs: "SimResult | Mapping[str, SimResult | tuple]", x: str = "time",
                    title: str | None = None):
    """Gantt chart (top) and KV usage (bottom) of one run or of several side by side.

    ``runs``: a ``SimResult``, or ``{name: SimResult}``, or ``{name: (records, requests)}``
    (e.g. from ``Engine.records`` and your requests). Names ``"static"`` and
    ``"continuous"`` get descriptive titles. ``x``: ``"time"`` (simulated or measured
    seconds: runs share one time axis, so the faster one is visibly shorter) or
    ``"step"`` (iterations). Returns a ``go.Figure``.
    """
    if x not in ("time", "step"):
        raise ValueError(f"x must be 'time' or 'step', got {x!r}")
    go = _deps.go()
    from plotly.subplots import make_subplots

    runs = _runs(runs)
    names = list(runs)
    data = {name: timeline_data(rec, req) for name, (rec, req, _m) in runs.items()}
    titles = []
    for name in names:
        m = runs[name][2]
        t = POLICY_TITLES.get(name, name)
        if m:
            t += (f"<br><sup>done in {m['makespan_s']:.2f} s · {m['output_tok_per_s']:.0f} tok/s · "
                  f"mean KV cache usage {m['kv_cache_usage_mean']:.0%}"
                  + (f" · {m['num_preemptions']} preemptions" if m.get("num_preemptions") else "")
                  + "</sup>")
        titles.append(t)
    fig = make_subplots(rows=2, cols=len(names), shared_xaxes="columns", shared_yaxes="rows",
                        row_heights=[0.72, 0.28], vertical_spacing=0.07, horizontal_spacing=0.05,
                        column_titles=titles)
    all_ids: list[str] = []
    for name in names:
        all_ids += [rid for rid in data[name]["requests"] if rid not in all_ids]

    for col, name in enumerate(names, start=1):
        d = data[name]
        for state in STATES:
            segs = [s for s in d["segments"] if s["state"] == state]
            if x == "time":
                base = [s["start_s"] for s in segs]
                length = [s["end_s"] - s["start_s"] for s in segs]
            else:
                base = [s["start_step"] - 0.5 for s in segs]
                length = [s["end_step"] - s["start_step"] + 1 for s in segs]
            hover = [f"{s['request']}: {state}<br>iterations {s['start_step']}–{s['end_step']}"
                     f"<br>{s['start_s']:.3f}–{s['end_s']:.3f} s" for s in segs]
            fig.add_trace(go.Bar(
                orientation="h", y=[s["request"] for s in segs], x=length, base=base,
                name=state, legendgroup=state, showlegend=col == 1,
                marker={"color": STATE_COLORS[state], "line": {"width": 0}},
                hovertext=hover, hoverinfo="text", width=0.78), row=1, col=col)
        xs = d["start_s"] if x == "time" else d["steps"]
        kv = d["kv"]
        fig.add_trace(go.Scatter(
            x=xs, y=[100 * f for f in kv["kv_cache_usage"]], name="KV cache usage (% of blocks held)",
            legendgroup="held", showlegend=col == 1, mode="lines", line={"shape": "hv", "color": "#59a14f"},
            fill="tozeroy", fillcolor="rgba(89,161,79,0.25)",
            customdata=list(zip(kv["num_used_blocks"], kv["num_total_blocks"])),
            hovertemplate="%{customdata[0]}/%{customdata[1]} blocks held<extra></extra>"),
            row=2, col=col)
        fig.add_trace(go.Scatter(
            x=xs, y=[100 * u for u in kv["held_slot_fill"]], name="held slots filled (%)",
            legendgroup="util", showlegend=col == 1, mode="lines",
            line={"shape": "hv", "color": "#222222", "width": 1.3, "dash": "dot"},
            hovertemplate="held slots filled %{y:.0f}%<extra></extra>"), row=2, col=col)

    xtitle = "time (s)" if x == "time" else "iteration"
    fig.update_layout(
        barmode="overlay", bargap=0.15, height=max(380, 16 * len(all_ids) + 300),
        margin={"l": 60, "r": 20, "t": 90 if title else 70, "b": 95},
        legend={"orientation": "h", "x": 0, "y": 0, "yref": "container", "yanchor": "bottom"},
        plot_bgcolor="#ffffff", hovermode="closest",
        title={"text": title, "x": 0.01} if title else None,
    )
    fig.update_yaxes(categoryorder="array", categoryarray=all_ids[::-1], row=1, tickfont={"size": 10})
    fig.update_yaxes(range=[0, 105], ticksuffix="%", row=2, gridcolor="#eeeeee")
    fig.update_xaxes(gridcolor="#eeeeee", row=1)
    fig.update_xaxes(title_text=xtitle, row=2, gridcolor="#eeeeee")
    if len(names) > 1:        # one x scale for all: a longer run is a longer bar
        fig.update_xaxes(matches="x")
    return fig


def simulate_policies(trace: list["TraceRequest"], policies: Sequence[str] = ("static", "continuous"),
                      **simulate_options) -> dict[str, "SimResult"]:
    """``labkit.sim.simulate`` of the same trace under each policy: ``{policy: SimResult}``."""
    from ..sim import simulate
    return {policy: simulate(trace, policy, **simulate_options) for policy in policies}


def compare_schedulers(trace: list["TraceRequest"], policies: Sequence[str] = ("static", "continuous"),
                       x: str = "time", **simulate_options):
    """Simulate ``trace`` under each policy and draw the timelines side by side.
    ``simulate_options`` go to ``labkit.sim.simulate`` (pool size, budgets, ...)."""
    return timeline_figure(simulate_policies(trace, policies, **simulate_options), x=x)
