"""The memory layer's one growth entry point (``BlockManager.allocate_slots``), its one
copy-on-write rule, the beam fork/death rule, and the prefix-cache contract.

The central property: for any plan (tables that share blocks by forks, prefix-cache hits
that revive cached-free blocks, host tables moved in, lookahead slots), ``blocks_needed``
is exactly what ``allocate_slots`` then takes from the pool; when it does not fit, nothing
changes at all.
"""

from __future__ import annotations

import inspect
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.memory import (BeamTree, BlockAllocator, BlockManager, BlockTable, Growth, HashPrefixCache,
                           PrefixCachePolicy, RadixTree, beam_successors, copies_on_write, match_limit)


def snapshot(allocator: BlockAllocator, tables: list[BlockTable]) -> tuple:
    cache = allocator.prefix_cache
    return ([allocator.ref_count(b) for b in range(allocator.num_blocks)], allocator.num_free_blocks,
            allocator.num_filled_slots, allocator.num_cache_queries, allocator.num_cache_hits,
            cache._state() if cache is not None else None,
            [(list(t.block_ids), list(t.token_ids), list(t.block_hashes), t.num_published_blocks) for t in tables])


def random_tables(rng: random.Random, alloc: BlockAllocator, host: BlockAllocator) -> list[BlockTable]:
    """Live tables on both pools: prompts (some shared, so the cache hits), forks that share
    partly filled last blocks, tables freed (their cached blocks cached-free), tables moved."""
    tables: list[BlockTable] = []
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    for _ in range(rng.randrange(2, 8)):
        kind = rng.random()
        live = [t for t in tables if not t.freed and t.allocator is alloc]
        try:
            if kind < 0.4 or not live:
                t = BlockTable(alloc, rng.choice([None, None, "s"]))
                tables.append(t)
                prompt = rng.choice(prompts) + [rng.randrange(3) for _ in range(rng.randrange(3))]
                t.reuse_cached_prefix(prompt, len(prompt) - 1)
                t.append_tokens(prompt[t.num_tokens:])
            elif kind < 0.7:
                tables.append(rng.choice(live).fork())
            elif kind < 0.85:
                rng.choice(live).free()
            else:
                src = rng.choice(live)
                moved, _ = src.copy_to(host, {})
                src.free()
                tables.append(moved)
                if rng.random() < 0.5:
                    tables.append(moved.fork())          # host tables sharing blocks
        except MemoryError:
            pass
    return [t for t in tables if not t.freed]


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.integers(0, 2**32 - 1), st.sampled_from([False, "hash", "radix"]))
def test_blocks_needed_is_exactly_what_allocate_slots_takes(seed, policy):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    alloc = BlockAllocator(rng.randrange(6, 24), bs, enable_prefix_caching=policy)
    host = BlockAllocator(32, bs)
    tables = random_tables(rng, alloc, host)
    manager = BlockManager(alloc)
    plan = []
    for t in rng.sample(tables, rng.randrange(len(tables) + 1)):
        # a host table moves in as a whole; one on the device grows by a few tokens
        plan.append(Growth(t, [rng.randrange(3) for _ in range(rng.randrange(4))],
                           num_lookahead_tokens=rng.choice([0, 0, 0, 1, bs + 1])))
    if rng.random() < 0.5:                      # an admission: a new table and its prefix-cache hit
        prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
        new = BlockTable(alloc)
        prefix = manager.find_cached_prefix(new, prompt, len(prompt) - 1)
        plan.append(Growth(new, prompt[prefix.num_tokens:], prefix=prefix))
        tables.append(new)
    need = manager.blocks_needed(plan)
    reserve = rng.choice([0, 0, 1, 3])
    before = snapshot(alloc, tables)
    free = alloc.num_free_blocks
    done = manager.allocate_slots(plan, reserve)
    alloc.check_invariants()
    if need > free - reserve:
        assert done is None
        assert snapshot(alloc, tables) == before, "a refused plan changed something"
        return
    assert done is not None
    assert free - alloc.num_free_blocks == need, "blocks_needed is not what the plan took"
    for g in plan:
        assert g.table.allocator is alloc
        assert len(g.table.block_ids) * bs >= g.table.num_tokens + g.num_lookahead_tokens
    # Every table writes only into blocks it holds alone (copy-on-write did its job).
    for g in plan:
        if g.new_token_ids:
            first, last = g.table.num_tokens - len(g.new_token_ids), g.table.num_tokens - 1
            assert all(alloc.ref_count(g.table.block_ids[b]) == 1 for b in range(first // bs, last // bs + 1))
    for t in {id(t): t for t in tables + [g.table for g in plan] if not t.freed}.values():
        t.free()
    alloc.check_invariants()
    assert alloc.num_used_blocks == 0 and host.num_used_blocks == 0


def test_copies_on_write_counts_every_writer_but_the_last_holder():
    assert copies_on_write(1, 1) == 0          # a table alone in its block writes in place
    assert copies_on_write(1, 2) == 1          # a fork: the writer copies, the other keeps it
    assert copies_on_write(2, 2) == 1          # both write: the second finds it its own
    assert copies_on_write(2, 3) == 2          # a third holder keeps the original
    alloc = BlockAllocator(8, 4)
    parent = BlockTable(alloc)
    parent.append_tokens([1, 2])
    kids = [parent.fork(), parent.fork()]
    assert parent.blocks_needed(1) == 1 and BlockManager(alloc).blocks_needed([Growth(parent, [3])]) == 1
    plan = [Growth(t, [3]) for t in [parent] + kids]
    assert BlockManager(alloc).blocks_needed(plan) == 2
    done = BlockManager(alloc).allocate_slots(plan)
    assert len(done.copies) == 2 and alloc.num_used_blocks == 3


def test_a_plan_that_does_not_fit_changes_nothing_and_the_watermark_counts():
    alloc = BlockAllocator(4, 2, enable_prefix_caching="hash")
    a = BlockTable(alloc)
    a.append_tokens([1, 2, 3])
    manager = BlockManager(alloc)
    plan = [Growth(a, [4, 5, 6])]                  # block 2 fills, one more needed
    assert manager.blocks_needed(plan) == 1
    assert manager.allocate_slots(plan, reserve=2) is None and a.num_tokens == 3
    assert manager.allocate_slots(plan, reserve=1) is not None and a.num_tokens == 6


def test_lookahead_slots_are_reserved_past_the_new_tokens_and_truncate_gives_them_back():
    """Speculative decoding's shape: slots for the token and k drafts, then the rejected go."""
    alloc = BlockAllocator(16, 4)
    t = BlockTable(alloc)
    t.append_tokens(list(range(6)))
    manager = BlockManager(alloc)
    done = manager.allocate_slots([Growth(t, [6], num_lookahead_tokens=5)])
    assert done is not None and t.num_tokens == 7 and len(t.block_ids) == 3   # room for 12
    t.append_tokens([7, 8, 9])                      # three drafts land in reserved slots
    assert len(t.block_ids) == 3
    t.truncate(8)                                   # two rejected: block 2 is left empty
    assert t.num_tokens == 8 and len(t.block_ids) == 2 and alloc.num_used_blocks == 2
    alloc.check_invariants()


def test_moved_tables_copy_each_shared_block_once_and_grow():
    device, host = BlockAllocator(16, 4), BlockAllocator(16, 4)
    t = BlockTable(host)
    t.append_tokens(list(range(6)))
    u = t.fork()
    manager = BlockManager(device)
    plan = [Growth(t, [6]), Growth(u, [7])]
    assert manager.blocks_needed(plan) == 2 + 1     # two blocks moved once, one copy-on-write
    done = manager.allocate_slots(plan)
    assert len(done.moved) == 2 and len(done.copies) == 1
    assert host.num_used_blocks == 0 and device.num_used_blocks == 3
    assert [g.table.token_ids for g in plan] == [list(range(6)) + [6], list(range(6)) + [7]]


def test_beam_successors_deaths_and_forks():
    assert beam_successors(3, [2, 0, 2, 2]) == [[1], [], [0, 2, 3]]
    assert beam_successors(2, []) == [[], []]


def test_beam_tree_follows_the_same_rule():
    tree = BeamTree(prompt_len=6, block_size=4)
    labels = tree.step(["b0", "b0", "b0"])          # one beam becomes three
    assert labels == ["b0", "b1", "b2"] and tree.num_forks == 2
    labels = tree.step(["b2", "b0", "b2"])          # b1 dies; b2 forks once more
    assert labels == ["b2", "b0", "b3"] and tree.num_deaths == 1
    tree.device.check_invariants()


@pytest.mark.parametrize("policy", [HashPrefixCache, RadixTree])
def test_both_policies_implement_the_whole_contract(policy):
    members = [name for name, _ in inspect.getmembers(PrefixCachePolicy) if not name.startswith("_")]
    assert {"match", "acquire", "reused", "publish", "released", "revived", "evict", "reset", "is_cached",
            "entry", "num_cached_blocks", "num_evictable", "evictable_blocks", "check"} <= set(members)
    alloc = BlockAllocator(8, 2, enable_prefix_caching=policy.policy)
    cache = alloc.prefix_cache
    for name in members + ["policy", "block_size"]:
        assert hasattr(cache, name), f"{policy.__name__} lacks {name}"
        if callable(getattr(PrefixCachePolicy, name, None)):
            want = list(inspect.signature(getattr(PrefixCachePolicy, name)).parameters)
            have = list(inspect.signature(getattr(policy, name)).parameters)
            assert have == want, f"{policy.__name__}.{name}{have} != the contract's {want}"


def test_match_limit_is_the_one_clamp():
    assert match_limit(10, None) == 10
    assert match_limit(10, 4) == 4
    assert match_limit(10, 40) == 10
    assert match_limit(10, -3) == 0


def test_policies_read_reference_counts_through_the_public_view():
    alloc = BlockAllocator(8, 2, enable_prefix_caching="radix")
    assert alloc.prefix_cache._refs is alloc.ref_counts
    t = BlockTable(alloc)
    t.append_tokens([1, 2, 3])
    assert list(alloc.ref_counts[:2]) == [1, 1]
