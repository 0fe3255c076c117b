"""Tests of the waste accounting (vLLM paper, Figure 2 categories) and the first-fit
contiguous allocator that models a reserving server's holes."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.memory import (BlockAllocator, BlockTable, ContiguousAllocator, Hole, SeqUsage, Waste,
                           contiguous_waste, live_paged_waste, paged_waste, reservation)


# ---- records -------------------------------------------------------------------------------
def test_seq_usage_checks_its_lengths():
    SeqUsage(0, 0, 0)
    for bad in [(-1, 0, 0), (5, 4, 10), (1, 11, 10)]:
        with pytest.raises(ValueError):
            SeqUsage(*bad)


def test_seq_usage_request_takes_either_reservation_rule():
    assert SeqUsage.request(100, 50, max_tokens=256) == SeqUsage(150, 150, 356)
    assert SeqUsage.request(100, 50, generated=10, max_model_len=4096) == SeqUsage(110, 150, 4096)
    assert SeqUsage.request(100, 50, max_tokens=256, max_model_len=300).max_len == 300
    with pytest.raises(ValueError, match="max_tokens"):
        SeqUsage.request(100, 50)


def test_waste_checks_that_the_categories_add_up():
    Waste(1, 2, 3, 4, 5, 15)
    with pytest.raises(ValueError, match="add up"):
        Waste(1, 2, 3, 4, 5, 16)
    with pytest.raises(ValueError, match="negative"):
        Waste(-1, 2, 3, 4, 5, 13)
    with pytest.raises(ValueError, match="cached"):
        Waste(1, 0, 0, 0, 2, 3, cached_free_slots=3)


# ---- the chapter's numbers ------------------------------------------------------------------
def test_a_200_token_request_in_a_4096_slot_reservation_uses_4_9_percent():
    one = SeqUsage.request(0, 200, max_model_len=4096)
    w = contiguous_waste([one])
    assert (w.token_slots, w.reserved_slots, w.internal_fragmentation) == (200, 0, 3896)
    assert w.utilization == pytest.approx(200 / 4096) and round(100 * w.utilization, 1) == 4.9
    assert w.waste_fraction == pytest.approx(3896 / 4096)
    many = contiguous_waste([one] * 100)
    assert many.utilization == w.utilization and many.allocated_slots == 409_600
    assert "4.9%" in w.summary()


def test_reservation_and_internal_fragmentation_mid_generation():
    # 100 of its 200 tokens so far: 100 more will come (reserved), 3896 never will.
    w = contiguous_waste([SeqUsage(100, 200, 4096)], total_slots=5000)
    assert (w.token_slots, w.reserved_slots, w.internal_fragmentation, w.free_slots) == (100, 100, 3896, 904)
    assert w.allocated_slots == 4096 and w.wasted_slots == 3996
    assert sum(w.fractions().values()) == pytest.approx(1.0)


def test_the_papers_orca_variants():
    s = SeqUsage(150, 200, 4096)
    assert [reservation(s, r) for r in ("max", "pow2", "oracle")] == [4096, 256, 200]
    assert reservation(SeqUsage(10, 3000, 2048 + 1000), "pow2") == 3048   # capped at max_len
    assert reservation(SeqUsage(0, 1, 8), "pow2") == 1
    oracle = contiguous_waste([s], reserve="oracle")
    assert oracle.internal_fragmentation == 0 and oracle.reserved_slots == 50   # still reserved
    with pytest.raises(ValueError, match="reserve"):
        reservation(s, "buddy")


def test_paged_waste_is_the_empty_tail_of_each_last_block():
    w = paged_waste([SeqUsage(70, 70, 70)], block_size=16)
    assert (w.token_slots, w.internal_fragmentation, w.reserved_slots, w.external_fragmentation) == (70, 10, 0, 0)
    seqs = [SeqUsage(n, n + 5, 4096) for n in range(0, 200, 7)]
    w = paged_waste(seqs, block_size=16, total_slots=10_000)
    assert w.internal_fragmentation < 16 * len(seqs)          # under one block per sequence
    assert w.free_slots == 10_000 - w.allocated_slots
    with pytest.raises(ValueError, match="total_slots"):
        paged_waste(seqs, block_size=16, total_slots=100)


def sample_workload(max_tokens: int, n: int = 200, seed: int = 0) -> list[SeqUsage]:
    """Chat-like requests caught mid-generation: prompts of 16-512 tokens, outputs with a
    long tail (mean ~200), each somewhere between its first and last token."""
    rng = random.Random(seed)
    seqs = []
    for _ in range(n):
        prompt = rng.randint(16, 512)
        output = min(max_tokens, int(rng.expovariate(1 / 200)) + 1)
        seqs.append(SeqUsage.request(prompt, output, generated=rng.randint(0, output),
                                     max_tokens=max_tokens, max_model_len=2048))
    return seqs


def test_reserving_the_maximum_wastes_60_to_80_percent_paging_almost_nothing():
    seqs = sample_workload(max_tokens=1024)
    contiguous = contiguous_waste(seqs)
    assert 0.6 <= contiguous.waste_fraction <= 0.8
    model_max = contiguous_waste([SeqUsage(s.num_tokens, s.final_len, 2048) for s in seqs])
    assert model_max.waste_fraction > contiguous.waste_fraction >= 0.6
    paged = paged_waste(seqs, block_size=16)
    assert paged.waste_fraction < 0.04
    # The paper's Figure 2 ordering: Max < Pow2 < Oracle < paged, in token-state share.
    shares = [contiguous_waste(seqs, reserve=r).utilization for r in ("max", "pow2", "oracle")]
    assert shares == sorted(shares) and shares[-1] < paged.utilization


# ---- external fragmentation -------------------------------------------------------------------
def test_holes_too_small_for_the_next_request_are_external_fragmentation():
    memory = ContiguousAllocator(3500)
    a, b, c = (memory.allocate(1000) for _ in range(3))
    assert (a, b, c) == (0, 1000, 2000)
    memory.free(b)
    assert memory.holes == [Hole(1000, 1000), Hole(3000, 500)]
    assert memory.num_free_slots == 1500 and memory.largest_hole == 1000
    assert memory.allocate(1200) is None          # 1500 slots free, none of them usable
    seqs = [SeqUsage(300, 600, 1000), SeqUsage(1000, 1000, 1000)]
    w = contiguous_waste(seqs, allocator=memory, next_request_slots=1200)
    assert (w.external_fragmentation, w.free_slots, w.total_slots) == (1500, 0, 3500)
    assert w.waste_fraction == pytest.approx((300 + 400 + 1500) / (2000 + 1500))
    # A smaller next request fits in the middle hole: only the 500-slot tail is unusable.
    w = contiguous_waste(seqs, allocator=memory, next_request_slots=800)
    assert (w.external_fragmentation, w.free_slots) == (500, 1000)
    # Default: a request like the largest one held (1000 slots).
    assert contiguous_waste(seqs, allocator=memory).external_fragmentation == 500
    with pytest.raises(ValueError, match="same state"):
        contiguous_waste(seqs[:1], allocator=memory)


def test_contiguous_allocator_first_fit_and_merging():
    memory = ContiguousAllocator(100)
    starts = [memory.allocate(10) for _ in range(10)]
    assert starts == list(range(0, 100, 10)) and memory.allocate(1) is None
    for s in (10, 30, 20):                        # free 10 and 30, then 20 between them
        memory.free(s)
    assert memory.holes == [Hole(10, 30)]          # merged both ways
    assert memory.allocate(5) == 10                # first fit: the lowest hole that fits
    assert memory.size_of(10) == 5 and memory.allocations[10] == 5
    memory.free(0)
    assert memory.holes == [Hole(0, 10), Hole(15, 25)]
    memory.check_invariants()
    with pytest.raises(ValueError, match="double free"):
        memory.free(0)
    with pytest.raises(ValueError):
        memory.allocate(0)
    with pytest.raises(ValueError):
        ContiguousAllocator(0)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.integers(1, 64), st.lists(st.tuples(st.booleans(), st.integers(1, 20), st.integers(0, 99)),
                                    max_size=60))
def test_contiguous_allocator_matches_a_slot_bitmap(num_slots, ops):
    """First fit over maximal free runs == the lowest start of a long enough free run."""
    memory, used, live = ContiguousAllocator(num_slots), [False] * num_slots, {}
    for do_alloc, size, pick in ops:
        if do_alloc or not live:
            runs, start = [], None
            for i, u in enumerate(used + [True]):
                if not u and start is None:
                    start = i
                elif u and start is not None:
                    runs.append((start, i - start))
                    start = None
            fit = next((s for s, n in runs if n >= size), None)
            assert memory.largest_hole == max((n for _, n in runs), default=0)
            assert memory.allocate(size) == fit
            if fit is not None:
                used[fit:fit + size] = [True] * size
                live[fit] = size
        else:
            start = sorted(live)[pick % len(live)]
            length = live.pop(start)
            memory.free(start)
            used[start:start + length] = [False] * length
        memory.check_invariants()
        assert memory.num_free_slots == used.count(False)


# ---- the live allocator ---------------------------------------------------------------------
def test_live_paged_waste_counts_shared_blocks_once():
    allocator = BlockAllocator(num_blocks=16, block_size=4)
    parent = BlockTable(allocator)
    parent.append_tokens(range(10))               # 3 blocks, the last holds 2 tokens
    children = [parent.fork() for _ in range(3)]
    w = live_paged_waste(allocator, [parent] + children)
    assert (w.token_slots, w.internal_fragmentation, w.logical_tokens) == (10, 2, 40)
    assert w.sharing_savings == 30 and w.free_slots == 13 * 4 and w.total_slots == 64
    assert w.utilization == pytest.approx(allocator.held_slot_fill)
    for i, child in enumerate(children):
        child.append_tokens([100 + i])            # copy-on-write of the shared last block
    w = live_paged_waste(allocator, [parent] + children)
    assert w.token_slots == 8 + 4 * 2 + 3 and allocator.num_used_blocks == 2 + 4
    assert w.utilization == pytest.approx(allocator.held_slot_fill)
    with pytest.raises(ValueError, match="every live table"):
        live_paged_waste(allocator, [parent])


def test_live_paged_waste_reports_cached_free_blocks_as_free():
    allocator = BlockAllocator(num_blocks=8, block_size=4, enable_prefix_caching=True)
    table = BlockTable(allocator)
    table.append_tokens(range(9))
    table.free()
    w = live_paged_waste(allocator, [table])      # freed tables are skipped
    assert (w.free_slots, w.cached_free_slots, w.allocated_slots) == (32, 8, 0)


def test_live_paged_waste_of_a_reserved_table():
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    table = BlockTable(allocator)
    table.reserve(12)                              # the static baseline: 3 blocks up front
    table.append_tokens(range(5))
    w = live_paged_waste(allocator, [table])       # future unknown: the empty block is reserved
    assert (w.token_slots, w.reserved_slots, w.internal_fragmentation) == (5, 4, 3)
    w = live_paged_waste(allocator, [table], final_lens=[7])   # it will stop at 7 tokens
    assert (w.token_slots, w.reserved_slots, w.internal_fragmentation) == (5, 2, 5)
    with pytest.raises(ValueError, match="one length per table"):
        live_paged_waste(allocator, [table], final_lens=[])
