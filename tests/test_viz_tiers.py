"""The tiers' view (``labkit.viz.tiers``): snapshots read from the engine, drawn as frames."""

from __future__ import annotations

import pytest

from labkit import SamplingParams
from labkit.engine import Engine
from labkit.memory import BlockAllocator
from labkit.scheduler import make_scheduler
from labkit.sim import SimExecutor
from labkit.viz import record_tiers, tier_figure, tier_figure_dict

DOCS = [[100 * (i + 1) + j for j in range(12)] for i in range(3)]


def engine(offload: int = 16) -> Engine:
    alloc = BlockAllocator(8, 4, "hash")
    sched = make_scheduler("continuous", alloc, max_num_seqs=1, max_num_batched_tokens=64, watermark=0.0,
                           num_offload_blocks=offload)
    return Engine(sched, SimExecutor(vocab_size=500), keep_records=False)


def test_snapshots_follow_the_engine_and_mark_each_steps_copies():
    e = engine()
    prompts = [d + [1] for d in DOCS] + [d + [2] for d in DOCS]
    snaps = record_tiers(e, prompts, SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(snaps) == e.num_steps + 1 and snaps[0]["event"] == "start"
    down = sum(len(s["offloaded"]) for s in snaps)
    up = sum(len(s["loaded"]) for s in snaps)
    stats = e.scheduler.tier_stats()
    assert down == stats["num_offloaded_blocks"] > 0 and up == stats["num_host_cache_hits"] > 0
    last = snaps[-1]
    assert last["device"].count("used") == 0                       # idle: nothing held
    assert last["host"].count("tier") == stats["num_host_cached_blocks"]
    step = next(s for s in snaps if s["loaded"])
    fig = tier_figure_dict(step)
    device, host = fig["data"]
    assert len(device["x"]) == 8 and len(host["x"]) == 16
    for h, d in step["loaded"]:                                     # both ends of a load outlined green
        assert device["marker"]["line"]["color"][d] == host["marker"]["line"]["color"][h] == "#59a14f"
    assert "block(s) back up" in step["event"]


def test_the_figure_has_a_frame_per_snapshot_and_an_engine_without_a_tier_is_told_why():
    e = engine()
    snaps = record_tiers(e, [DOCS[0] + [1], DOCS[0] + [2]], SamplingParams(max_tokens=1, ignore_eos=True))
    fig = tier_figure(snaps)
    assert len(fig.frames) == len(snaps) and len(fig.layout.sliders[0].steps) == len(snaps)
    with pytest.raises(ValueError, match="nothing to show"):
        tier_figure([])
    alloc = BlockAllocator(8, 4, "hash")
    plain = Engine(make_scheduler("continuous", alloc), SimExecutor(vocab_size=500))
    with pytest.raises(ValueError, match="no host tier"):
        record_tiers(plain, [[1, 2, 3]], SamplingParams(max_tokens=1))
