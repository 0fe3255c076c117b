"""What the block view draws, read off the real allocator and block tables: plain data only.

Everything here is a pure function from engine objects to dicts and lists (no plotly), so
that tests can check the picture against the allocator, and so that a replay can store one
cheap ``snapshot`` per iteration and draw it later.

Sequences are named by *labels*: ``"r3"`` for a request's first sequence and ``"r3#1"``,
``"r3#2"``... for the samples forked from it. A label's request is the part before ``#``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from ..scheduler.records import held_slot_fill, kv_cache_usage

if TYPE_CHECKING:
    from ..engine import Engine
    from ..memory import BlockAllocator, BlockTable
    from ..request import Sequence
    from ..scheduler import Scheduler


def seq_label(seq: "Sequence") -> str:
    """``"r3"`` for a request's first sequence, ``"r3#i"`` for its i-th fork (stable for life)."""
    rid = seq.request.request_id
    return rid if seq.index == 0 else f"{rid}#{seq.index}"


def request_of(label: str) -> str:
    """The request id of a sequence label."""
    return label.split("#", 1)[0]


def _scheduler(source) -> "Scheduler":
    return getattr(source, "scheduler", source)


def live_sequences(source: "Engine | Scheduler") -> list["Sequence"]:
    """Every sequence that holds KV blocks now, in admission order.

    That is ``Scheduler.sequences_holding_blocks()``: the running sequences, plus what a
    policy keeps after a sequence finished (the static baseline holds a finished request's
    reservation until its batch ends).
    """
    return [seq for seq in _scheduler(source).sequences_holding_blocks()
            if seq.block_table is not None and not seq.block_table.freed]


def live_tables(source: "Engine | Scheduler") -> dict[str, "BlockTable"]:
    """label -> block table of every sequence holding blocks (see ``live_sequences``)."""
    return {seq_label(seq): seq.block_table for seq in live_sequences(source)}


def pool_view(allocator: "BlockAllocator", tables: Mapping[str, "BlockTable"],
              with_tokens: bool = True) -> dict:
    """One entry per physical block, in block-id order, as parallel lists.

    Returns ``{"num_blocks", "block_size", "state", "ref_count", "fill", "cached",
    "owners", "tokens"}``: ``state`` is the allocator's ``"free" | "cached-free" |
    "used"``; ``owners`` the labels of the tables holding the block (in ``tables`` order);
    ``tokens`` the token ids the block holds (from a holder's table, or from the prefix
    cache's entry for a cached-free block; ``()`` for a free one, and for all when
    ``with_tokens`` is false). ``tables`` should hold every live table (``live_tables``):
    a used block that none of them holds is drawn as used by ``"?"``.
    """
    n, bs = allocator.num_blocks, allocator.block_size
    owners: list[list[str]] = [[] for _ in range(n)]
    tokens: list[tuple[int, ...]] = [()] * n
    for label, table in tables.items():
        if table.freed:
            continue
        ids = table.token_ids
        for index, block_id in enumerate(table.block_ids):
            owners[block_id].append(label)
            if with_tokens and not tokens[block_id]:
                tokens[block_id] = tuple(ids[index * bs:(index + 1) * bs])
    state = [allocator.state(b) for b in range(n)]
    if with_tokens:
        for b in range(n):
            if state[b] == "cached-free":
                entry = allocator.cache_entry(b)
                tokens[b] = entry.token_ids if entry is not None else ()
    for b in range(n):
        if state[b] == "used" and not owners[b]:
            owners[b].append("?")
    return {
        "num_blocks": n,
        "block_size": bs,
        "state": state,
        "ref_count": [allocator.ref_count(b) for b in range(n)],
        "fill": [allocator.fill(b) if state[b] != "free" else 0 for b in range(n)],
        "cached": [allocator.is_cached(b) for b in range(n)],
        "owners": [tuple(o) for o in owners],
        "tokens": tokens,
    }


def table_view(tables: Mapping[str, "BlockTable"]) -> dict[str, dict]:
    """label -> ``{"block_ids": [...], "num_tokens": int}``: each logical block table,
    copied (tables change in place as the engine runs)."""
    return {label: {"block_ids": list(t.block_ids), "num_tokens": t.num_tokens}
            for label, t in tables.items() if not t.freed}


def status_view(engine: "Engine") -> dict:
    """The numbers of the widgets' status line, read from the engine now, under the
    names ``Engine.stats()`` gives them (``docs/stats.md``)."""
    stats = engine.stats()
    view = {key: stats[key] for key in _STATUS_KEYS}
    view["time_s"] = engine.now
    return view


_STATUS_KEYS = ("num_steps", "num_running", "num_waiting", "num_free_blocks", "num_cached_free_blocks",
                "num_used_blocks", "num_total_blocks", "kv_cache_usage", "held_slot_fill", "num_preemptions")


def snapshot(engine: "Engine", with_tokens: bool = True) -> dict:
    """Everything the block view draws for ``engine`` now: ``{"pool", "tables", "status"}``.

    About ``num_blocks`` short lists, tuple slices of existing token lists and a copy of
    each block table's ids: cheap enough to keep one per iteration for a replay.
    """
    tables = live_tables(engine)
    return {"pool": pool_view(engine.scheduler.allocator, tables, with_tokens),
            "tables": table_view(tables),
            "status": status_view(engine)}


def allocator_snapshot(allocator: "BlockAllocator", tables: Mapping[str, "BlockTable"],
                       step: int = 0) -> dict:
    """A ``snapshot`` of a bare allocator and its tables (no engine): for the memory
    chapter, where students drive ``BlockTable`` by hand."""
    return {
        "pool": pool_view(allocator, tables),
        "tables": table_view(tables),
        "status": {"num_steps": step, "num_free_blocks": allocator.num_free_blocks,
                   "num_cached_free_blocks": allocator.num_cached_free_blocks,
                   "num_used_blocks": allocator.num_used_blocks, "num_total_blocks": allocator.num_blocks,
                   "kv_cache_usage": kv_cache_usage(allocator), "held_slot_fill": held_slot_fill(allocator)},
    }


def status_line(status: Mapping) -> str:
    """``"step 5 · running 3 · waiting 1 · free 12/32 blocks (2 cached) · KV cache usage 63%
    · held slots filled 87% · preemptions 0"``: the parts ``status`` has."""
    parts = [f"step {status['num_steps']}"]
    for key in ("num_running", "num_waiting"):
        if key in status:
            parts.append(f"{key[4:]} {status[key]}")
    cached = status.get("num_cached_free_blocks", 0)
    parts.append(f"free {status['num_free_blocks']}/{status['num_total_blocks']} blocks"
                 + (f" ({cached} cached)" if cached else ""))
    parts.append(f"KV cache usage {status['kv_cache_usage']:.0%}")
    if status.get("num_used_blocks", 1):      # with nothing held, the fill is undefined
        parts.append(f"held slots filled {status['held_slot_fill']:.0%}")
    if "num_preemptions" in status:
        parts.append(f"preemptions {status['num_preemptions']}")
    return " · ".join(parts)
