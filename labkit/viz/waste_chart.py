"""The waste chart: where KV memory goes, in the vLLM paper's Figure 2 categories.

Stacked bars, one per policy, split into **token states** (slots holding a token's K/V),
**reservation** (set aside for tokens still to come), **internal fragmentation** (set aside,
never to be used), **external fragmentation** (free, but in holes too small for the next
reservation) and, optionally, **free**. The accounting is ``labkit.memory.waste``'s; this
module only arranges and draws it.

``waste_data`` is plain numbers (unit-testable); ``waste_figure`` draws any
``{name: Waste}``; ``compare_waste`` builds the paper's comparison (contiguous
reservation with max / pow2 / oracle sizes, and paged) for one set of requests;
``live_waste`` reads a running engine.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Mapping, Sequence

from labkit.utils import cdiv

from . import _deps
from .colors import WASTE_COLORS

if TYPE_CHECKING:
    from ..engine import Engine
    from ..memory import ContiguousAllocator, SeqUsage, Waste

CATEGORIES = (
    ("token_slots", "token states"),
    ("reserved_slots", "reservation"),
    ("internal_fragmentation", "internal fragmentation"),
    ("external_fragmentation", "external fragmentation"),
    ("free_slots", "free"),
)
NORMALIZE = {
    None: "KV slots",
    "total": "% of the KV memory",
    "consumed": "% of the memory the requests consume",
}
RESERVE_NAMES = {"max": "Orca (Max)", "pow2": "Orca (Pow2)", "oracle": "Orca (Oracle)"}


def waste_data(wastes: Mapping[str, "Waste"], normalize: str | None = "consumed") -> dict:
    """The bars as numbers: ``{"labels", "categories": [(key, name)], "values": {key: [...]},
    "totals": [...], "unit"}``.

    ``normalize``: None gives slot counts (every bar, free included, sums to its
    ``total_slots``); ``"total"`` gives percentages of all memory (sums to 100);
    ``"consumed"`` gives percentages of what the requests consume, allocated slots plus
    external fragmentation, without the free slots: the paper's Figure 2 (sums to 100).
    """
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize must be one of {list(NORMALIZE)}, got {normalize!r}")
    labels = list(wastes)
    cats = [c for c in CATEGORIES if normalize != "consumed" or c[0] != "free_slots"]
    values: dict[str, list[float]] = {key: [] for key, _ in cats}
    totals = []
    for w in wastes.values():
        if normalize is None:
            denom, total = 1.0, w.total_slots
        elif normalize == "total":
            denom, total = (w.total_slots or 1) / 100.0, 100.0
        else:
            consumed = w.allocated_slots + w.external_fragmentation
            denom, total = (consumed or 1) / 100.0, 100.0 if consumed else 0.0
        for key, _ in cats:
            values[key].append(getattr(w, key) / denom)
        totals.append(total)
    return {"labels": labels, "categories": cats, "values": values, "totals": totals,
            "unit": NORMALIZE[normalize]}


def waste_figure(wastes: Mapping[str, "Waste"], normalize: str | None = "consumed",
                 title: str | None = None):
    """Stacked bars of ``{name: Waste}`` (see ``waste_data`` for ``normalize``), each
    bar labelled with its share of token states. Returns a ``go.Figure``."""
    go = _deps.go()
    d = waste_data(wastes, normalize)
    pct = normalize is not None
    fig = go.Figure()
    for key, name in d["categories"]:
        vals = d["values"][key]
        fig.add_trace(go.Bar(
            x=d["labels"], y=vals, name=name, marker={"color": WASTE_COLORS[key], "line": {"width": 0}},
            text=[f"{v:.0f}%" if pct and v >= 4 else "" for v in vals], textposition="inside",
            insidetextanchor="middle", textfont={"color": "#ffffff" if key != "free_slots" else "#444"},
            hovertemplate=f"%{{x}}<br>{name}: %{{y:.{1 if pct else 0}f}}{'%' if pct else ' slots'}<extra></extra>"))
    fig.update_layout(
        barmode="stack", bargap=0.35, height=430, width=max(420, 150 * len(d["labels"]) + 220),
        yaxis={"title": d["unit"], "range": [0, 100] if pct else None, "gridcolor": "#eeeeee",
               "ticksuffix": "%" if pct else ""},
        title={"text": title or "Where the KV cache memory goes", "x": 0.01},
        legend={"traceorder": "reversed"}, plot_bgcolor="#ffffff",
        margin={"l": 60, "r": 20, "t": 60, "b": 50},
    )
    return fig


def fragmented_layout(seqs: Sequence["SeqUsage"], reserve: str = "max", total_slots: int | None = None,
                      seed: int = 0) -> "ContiguousAllocator":
    """A contiguous memory holding the reservations of ``seqs``, after some churn.

    A server's memory is not packed: requests that finished earlier left holes between
    the ones still running. We model that by placing, before each of our requests, a
    reservation of a departed request (its size drawn from ours), first fit, and freeing
    all the departed ones at the end. The holes they leave are what ``contiguous_waste``
    counts as external fragmentation. Deterministic for a given ``seed``; ``ValueError``
    if the reservations cannot fit into ``total_slots``.
    """
    from ..memory import ContiguousAllocator, reservation
    sizes = [reservation(s, reserve) for s in seqs]
    total = total_slots if total_slots is not None else 2 * sum(sizes)
    mem = ContiguousAllocator(total)
    rng = random.Random(seed)
    departed = []
    for size in sizes:
        ghost = mem.allocate(rng.choice(sizes)) if sizes else None
        if ghost is not None:
            departed.append(ghost)
        start = mem.allocate(size)
        while start is None and departed:        # no room: let a departed request go first
            mem.free(departed.pop(rng.randrange(len(departed))))
            start = mem.allocate(size)
        if start is None:
            raise ValueError(f"the reservations ({sum(sizes)} slots with reserve={reserve!r}) do not "
                             f"fit in {total} slots")
    for ghost in departed:
        mem.free(ghost)
    return mem


def compare_waste(seqs: Sequence["SeqUsage"], block_size: int = 16, *, total_slots: int | None = None,
                  reserves: Sequence[str] = ("max", "pow2", "oracle"), churn: bool = True,
                  seed: int = 0) -> dict[str, "Waste"]:
    """The paper's comparison for one set of requests: ``{name: Waste}`` for contiguous
    reservation with each of ``reserves`` (named as the paper's Orca variants) and for
    paged allocation (vLLM). With ``churn`` the contiguous layouts have holes left by
    departed requests (``fragmented_layout``), hence external fragmentation; without, the
    reservations sit back to back. ``total_slots`` (default: room for the largest
    layout) is the same for every bar."""
    from ..memory import contiguous_waste, paged_waste, reservation
    seqs = list(seqs)
    if total_slots is None:
        largest = max((sum(reservation(s, r) for s in seqs) for r in reserves), default=0)
        paged = sum(cdiv(s.num_tokens, block_size) * block_size for s in seqs)
        total_slots = cdiv(max(2 * largest, paged, 1), block_size) * block_size   # room for churn
    out: dict[str, Waste] = {}
    for r in reserves:
        name = RESERVE_NAMES.get(r, r)
        if churn:
            layout = fragmented_layout(seqs, r, total_slots, seed)
            out[name] = contiguous_waste(seqs, reserve=r, allocator=layout)
        else:
            out[name] = contiguous_waste(seqs, reserve=r, total_slots=total_slots)
    out["vLLM (paged)"] = paged_waste(seqs, block_size, total_slots=total_slots)
    return out


def live_waste(engine: "Engine", known_lengths: bool = False) -> "Waste":
    """The engine's KV memory now, in the same categories (``live_paged_waste`` over every
    live block table). ``known_lengths``: count the empty slots a sequence will still fill
    (up to prompt + max_tokens: right for the simulator, which ignores EOS) as reservation
    rather than internal fragmentation."""
    from ..memory import live_paged_waste
    from .pool import live_sequences
    seqs = live_sequences(engine)
    final = None
    if known_lengths:
        final = [s.num_prompt_tokens + s.request.params.max_tokens for s in seqs]
    return live_paged_waste(engine.scheduler.allocator, [s.block_table for s in seqs], final)
