"""Property tests of the memory layer: random interleavings against a shadow model.

A hypothesis state machine drives one ``BlockAllocator`` (tight: a handful of blocks, so
eviction and ``NoFreeBlocksError`` happen often) through random appends, forks (also
before the forked blocks are published), copy-on-writes, frees, prefix-cache reuses, cache
resets and swaps (``copy_to`` a host pool and back, siblings together or one at a time), and
after every step checks what the chapter promises:

* ``allocator.check_invariants()``: every block is free, cached-free or referenced;
* each block's reference count equals the number of live tables holding it;
* a table only ever writes into a block it holds alone (else a copy-on-write happens first);
* each table holds exactly the tokens appended to it (shadow model);
* the KV it reads back is its own: the simulated KV memory stores, for each slot, the
  whole prefix the token was computed with (a token's K/V depends on every token before
  it), so sharing a block computed under another prefix would be caught;
* every prefix-cache entry's block holds the KV it claims, and a reuse takes exactly the
  blocks the cache maps the prompt's chained hashes to;
* after everything is freed, every block is back (free or cached-free).

The same machine runs with each prefix-cache policy (``RadixMachine``: SGLang's radix tree).
For the radix tree it also checks, after every step, that the tree and the allocator agree
(``RadixTree.check``: one node per cached block, uniform reference counts per node, the LRU
heap complete), that no block a live table has published was evicted (nothing is evicted
while referenced), that each table's blocks in the tree are its leading ones and the tree's
path for its tokens (what eviction's bookkeeping rests on), and that a reuse takes exactly
the longest whole-block prefix whose KV some cached block holds, computed from the simulated
KV memory, not from the tree.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant,
                                 multiple, precondition, rule, run_state_machine_as_test)

from labkit.memory import ROOT_HASH, BlockAllocator, BlockTable, NoFreeBlocksError, hash_block
from labkit.utils import cdiv

# Prompts share prefixes, so the prefix cache hits (and misses) often.
SYSTEM = [7, 7, 1, 2, 3, 4, 5, 6, 8]
PROMPTS = [SYSTEM, SYSTEM + [9], SYSTEM + [1, 1, 1, 1, 2], SYSTEM[:5], [3, 1, 4, 1, 5, 9, 2, 6],
           [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [1] * 12]
TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=5)

SETTINGS = settings(max_examples=300, stateful_step_count=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def snapshot(allocator: BlockAllocator) -> dict:
    """The allocator's whole state (its containers copied one level: their items are
    ints and immutable cache entries), and its prefix-cache policy's state by value."""
    snap = {k: v.copy() if hasattr(v, "copy") else v for k, v in vars(allocator).items() if k != "_cache"}
    snap["_cache"] = allocator.prefix_cache._state() if allocator.prefix_cache is not None else None
    return snap


class Live:
    """A live table and its shadow: what was appended, and how much of it has KV written."""

    def __init__(self, table: BlockTable, tokens: list[int], computed: int, reserved: bool = False):
        self.table, self.tokens, self.computed, self.reserved = table, tokens, computed, reserved


class MemoryMachine(RuleBasedStateMachine):
    CACHING: bool | str | None = None     # None: drawn per example (off or hash)
    tables = Bundle("tables")

    def __init__(self):
        super().__init__()
        self.live: list[Live] = []
        self.kv: dict[int, tuple[int, ...]] = {}   # slot -> the prefix its token was computed with

    @initialize(num_blocks=st.integers(3, 24), block_size=st.sampled_from([1, 2, 3, 4]),
                caching=st.booleans())
    def setup(self, num_blocks, block_size, caching):
        caching = caching if self.CACHING is None else self.CACHING
        self.allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching=caching)
        self.bs = block_size

    # ---- the simulated executor -----------------------------------------------------
    def write_kv(self, live: Live, upto: int, publish: bool = True) -> None:
        """Compute K/V for tokens [computed, upto) and write them into their slots, as the
        model would: only into blocks this table holds alone. Then publish them, unless
        ``publish`` is False (a caller that forks first publishes later)."""
        t = live.table
        for p in range(live.computed, upto):
            block = t.block_ids[p // self.bs]
            assert self.allocator.ref_count(block) == 1, (
                f"position {p} would be written into block {block}, shared by "
                f"{self.allocator.ref_count(block)} tables")
            self.kv[t.slot(p)] = tuple(live.tokens[:p + 1])
        live.computed = max(live.computed, upto)
        if publish:
            t.cache_computed_blocks(live.computed)

    def copy_block(self, src: int, dst: int, src_kv: dict | None = None, dst_kv: dict | None = None) -> None:
        """Copy a block's simulated KV (within the device memory, or between it and the
        host's: ``src_kv``, ``dst_kv``)."""
        src_kv = self.kv if src_kv is None else src_kv
        dst_kv = self.kv if dst_kv is None else dst_kv
        for i in range(self.bs):
            if src * self.bs + i in src_kv:
                dst_kv[dst * self.bs + i] = src_kv[src * self.bs + i]
            else:
                dst_kv.pop(dst * self.bs + i, None)

    def cached_prefix_len(self, prompt: list[int], limit: int) -> int:
        """Oracle from the simulated KV memory alone: how many whole blocks of ``prompt``
        (within ``limit`` tokens) some cached block holds the KV of, each block after the one
        before (a cached block holds the prefix its last slot was computed with)."""
        bs, alloc = self.bs, self.allocator
        held = {self.kv.get(b * bs + bs - 1) for b in range(alloc.num_blocks) if alloc.is_cached(b)}
        n = 0
        while (n + 1) * bs <= limit and tuple(prompt[:(n + 1) * bs]) in held:
            n += 1
        return n

    def expected_hits(self, prompt: list[int], limit: int) -> list[int]:
        """The blocks the cache maps the prompt's chained hashes to, asked block by block."""
        if not self.allocator.enable_prefix_caching:
            return []
        if self.allocator.radix is not None:
            tree = self.allocator.radix
            n, blocks = tree.match_prefix(prompt, limit)
            assert n == self.cached_prefix_len(prompt, limit) * self.bs, (
                f"the tree matches {n} tokens of {prompt}, cached KV covers "
                f"{self.cached_prefix_len(prompt, limit)} blocks")
            return blocks
        hits, parent = [], ROOT_HASH
        for start in range(0, limit - self.bs + 1, self.bs):
            chunk = tuple(prompt[start:start + self.bs])
            h = hash_block(parent, chunk)
            block = self.allocator.prefix_cache.peek(h, parent, chunk)
            if block is None:
                break
            hits.append(block)
            parent = h
        return hits

    # ---- rules ----------------------------------------------------------------------
    @rule(target=tables, prompt=st.sampled_from(PROMPTS), extra=st.lists(st.integers(0, 3), max_size=3),
          reuse=st.booleans(), computed=st.booleans())
    def new_table(self, prompt, extra, reuse, computed):
        prompt = prompt + extra
        table = BlockTable(self.allocator)
        live = Live(table, [], 0)
        if reuse:
            expected = self.expected_hits(prompt, len(prompt) - 1)
            n = table.reuse_cached_prefix(prompt, max_tokens=len(prompt) - 1)
            assert n == len(expected) * self.bs and table.block_ids == expected
            assert n <= len(prompt) - 1 and table.num_cached_tokens == n
            live.tokens, live.computed = list(prompt[:n]), n
            # The reused KV was computed with exactly this prefix.
            for p in range(n):
                assert self.kv[table.slot(p)] == tuple(prompt[:p + 1])
        self.live.append(live)
        if not self._append(live, prompt[len(live.tokens):], computed):
            self.preempt()      # not enough memory to admit it: roll back
        return live

    @rule(target=tables, prompt=st.sampled_from(PROMPTS), room=st.integers(0, 6))
    def new_reserved_table(self, prompt, room):
        """The static baseline: reserve prompt + room tokens up front, then fill."""
        table = BlockTable(self.allocator)
        before = snapshot(self.allocator)
        try:
            table.reserve(len(prompt) + room)
        except NoFreeBlocksError:
            assert snapshot(self.allocator) == before and table.block_ids == []
            table.free()
            return multiple()
        assert table.num_blocks == cdiv(len(prompt) + room, self.bs)
        live = Live(table, [], 0, reserved=True)
        self.live.append(live)
        assert self._append(live, prompt, True), "the reservation must hold the prompt"
        return live

    @rule(live=tables, tokens=TOKENS, computed=st.booleans())
    def append(self, live, tokens, computed):
        if live.table.freed:
            return
        if not self._append(live, tokens, computed):
            self.preempt()

    def preempt(self) -> None:
        """Out of blocks: free the newest sequence, as a scheduler preempts (recompute)."""
        victim = self.live.pop()
        victim.table.free()

    def _append(self, live: Live, tokens: list[int], computed: bool) -> bool:
        t, alloc = live.table, self.allocator
        n = len(live.tokens)
        next_block = t.block_ids[n // self.bs] if n % self.bs else None
        must_copy = next_block is not None and alloc.ref_count(next_block) > 1
        before, table_before = snapshot(alloc), (list(t.block_ids), list(t.token_ids))
        # The radix tree may switch a published block for its own copy of the same KV: the
        # shadow executor must write the KV first, as the engine does (computed=False, then
        # the model runs, then cache_computed_blocks).
        publish_now = computed and alloc.radix is None
        try:
            copies = t.append_tokens(tokens, computed=publish_now)
        except NoFreeBlocksError:
            # Nothing changed, and the refusal was right.
            assert snapshot(alloc) == before
            assert (list(t.block_ids), list(t.token_ids)) == table_before
            assert t.blocks_needed(len(tokens)) > alloc.num_free_blocks
            return False
        assert t.blocks_needed(0) == 0
        if must_copy:
            assert copies == [(next_block, t.block_ids[n // self.bs])]
            assert alloc.ref_count(copies[0][1]) == 1
        else:
            assert copies == []
        for src, dst in copies:
            self.copy_block(src, dst)
        live.tokens += tokens
        if computed:
            self.write_kv(live, len(live.tokens))
        return True

    @rule(live=tables, upto=st.integers(0, 40))
    def compute(self, live, upto):
        """The model catches up with appended tokens (chunked: maybe only part of them)."""
        if not live.table.freed:
            self.write_kv(live, min(len(live.tokens), max(live.computed, upto)))

    @rule(target=tables, live=tables)
    def fork(self, live):
        if live.table.freed or live.computed < len(live.tokens):
            return live    # the engine forks right after a step: all KV written
        t = live.table
        if t.num_blocks > cdiv(len(live.tokens), self.bs):
            before = snapshot(self.allocator)
            with pytest.raises(ValueError, match="reserved"):
                t.fork()   # empty reserved blocks cannot be shared safely
            assert snapshot(self.allocator) == before
            return live
        child = Live(t.fork(), list(live.tokens), live.computed, live.reserved)
        self.live.append(child)
        return child

    @rule(target=tables, live=tables, tokens=st.lists(st.integers(0, 3), min_size=1, max_size=2))
    def fork_and_diverge(self, live, tokens):
        """Parallel sampling: fork, then parent and child each write their own next token."""
        child = self.fork(live)
        if child is not live:
            if not (self._append(child, tokens, True) and self._append(live, tokens[::-1] + [0], True)):
                self.preempt()
        return child

    @rule(target=tables, live=tables, child_first=st.booleans(), publish_both=st.booleans())
    def fork_before_publish(self, live, child_first, publish_both):
        """The KV is written, then the table is forked before it publishes: two tables share
        unpublished full blocks (as a swap-in rebuilds n > 1 siblings or beams). Then one
        publishes, or both, in either order."""
        if live.table.freed or live.table.num_blocks > cdiv(len(live.tokens), self.bs):
            return live
        self.write_kv(live, len(live.tokens), publish=False)
        child = self.fork(live)
        order = [child, live] if child_first else [live, child]
        for member in order[:1 + publish_both]:
            member.table.cache_computed_blocks(member.computed)
        return child

    @rule(picks=st.lists(st.integers(0, 7), min_size=1, max_size=3, unique=True), together=st.booleans(),
          reverse=st.booleans())
    def swap_out_and_in(self, picks, together, reverse):
        """Preemption by swapping: some tables move to a host pool (``copy_to``, blocks they
        share copied once), their device blocks are freed, and they come back, all together
        (siblings: the device copies are shared again, unpublished) or one at a time; then
        each publishes what it had computed, in the order drawn. If the device pool cannot
        take them back, they are dropped (as a recompute preemption would)."""
        group = [self.live[i] for i in picks if i < len(self.live)]
        if not group:
            return
        host, host_kv = BlockAllocator(64, self.bs), {}
        moved: dict[int, int] = {}
        for live in group:
            old = live.table
            live.table, pairs = old.copy_to(host, moved)
            for src, dst in pairs:
                self.copy_block(src, dst, self.kv, host_kv)
            old.free()
        self.allocator.check_invariants()
        batches = [group] if together else [[live] for live in group]
        for batch in batches:
            need = len({b for live in batch for b in live.table.block_ids})
            if need > self.allocator.num_free_blocks:
                for live in batch:
                    live.table.free()
                    self.live.remove(live)
                continue
            moved = {}
            for live in batch:
                host_table = live.table
                live.table, pairs = host_table.copy_to(self.allocator, moved)
                for src, dst in pairs:
                    self.copy_block(src, dst, host_kv, self.kv)
                host_table.free()
            for live in reversed(batch) if reverse else batch:
                live.table.cache_computed_blocks(live.computed)
        assert host.num_used_blocks == 0, "a host block leaked"

    @rule(live=consumes(tables))
    def free(self, live):
        if not live.table.freed:
            live.table.free()
            self.live.remove(live)

    @precondition(lambda self: hasattr(self, "allocator"))
    @rule()
    def reset_prefix_cache(self):
        cached_free = self.allocator.num_cached_free_blocks
        assert self.allocator.reset_prefix_cache() == cached_free
        assert self.allocator.num_cached_free_blocks == 0

    # ---- invariants -----------------------------------------------------------------
    @invariant()
    def memory_is_consistent(self):
        if not hasattr(self, "allocator"):
            return
        alloc, bs = self.allocator, self.bs
        alloc.check_invariants()
        holders = [0] * alloc.num_blocks
        for live in self.live:
            t = live.table
            assert not t.freed
            assert len(set(t.block_ids)) == len(t.block_ids), "a table holds a block twice"
            for b in t.block_ids:
                holders[b] += 1
            assert t.token_ids == live.tokens
            if live.reserved:
                assert t.num_blocks >= cdiv(len(live.tokens), bs)
            else:
                assert t.num_blocks == cdiv(len(live.tokens), bs)
            for p in range(live.computed):
                assert self.kv.get(t.slot(p)) == tuple(live.tokens[:p + 1]), (
                    f"table reads someone else's KV at position {p}")
        for b in range(alloc.num_blocks):
            assert alloc.ref_count(b) == holders[b], f"block {b}: {alloc.ref_count(b)} refs, {holders[b]} holders"
            assert (alloc.state(b) == "used") == (holders[b] > 0)
            if alloc.radix is not None and alloc.is_cached(b):   # the tree's path is the block's KV
                node = alloc.radix.node_of(b)
                path = alloc.radix._path_tokens(node)
                end = len(path) - len(node.token_ids) + (node.block_ids.index(b) + 1) * bs
                assert self.kv[b * bs + bs - 1] == tuple(path[:end]), f"block {b} holds other KV than its path"
            entry = alloc.cache_entry(b)
            if entry is not None:   # a cached block holds the KV it is cached for
                assert len(entry.token_ids) == bs
                assert entry.block_hash == hash_block(entry.parent_hash, entry.token_ids)
                for i, token in enumerate(entry.token_ids):
                    assert self.kv[b * bs + i][-1] == token
        assert alloc.num_free_blocks + alloc.num_used_blocks == alloc.num_blocks
        if alloc.radix is not None:     # nothing a live table published was evicted
            for live in self.live:
                t = live.table
                for b in t.block_ids[:t.num_published_blocks]:
                    assert alloc.is_cached(b) and alloc.ref_count(b) > 0, (
                        f"block {b}, published and held, is no longer in the tree")
                # What the tree's bookkeeping rests on: a table's blocks in the tree are its
                # leading ones, and they are the tree's path for its tokens.
                in_tree = [alloc.is_cached(b) for b in t.block_ids]
                n = in_tree.index(False) if False in in_tree else len(in_tree)
                assert not any(in_tree[n:]), f"{t}: a block in the tree after one that is not"
                assert alloc.radix.match(t.token_ids, n * bs)[:n] == t.block_ids[:n], (
                    f"{t}: its blocks in the tree are not the tree's path for its tokens")

    def teardown(self):
        if not hasattr(self, "allocator"):
            return
        for live in self.live:
            live.table.free()
        self.live.clear()
        alloc = self.allocator
        alloc.check_invariants()
        assert alloc.num_free_blocks == alloc.num_blocks and alloc.num_used_blocks == 0
        assert all(alloc.state(b) in ("free", "cached-free") for b in range(alloc.num_blocks))
        assert alloc.num_cached_free_blocks == alloc.num_cached_blocks


class PrefixCachingMachine(MemoryMachine):
    """Prefix caching always on: reuse, LRU revival and eviction in every example."""

    CACHING = True


class RadixMachine(MemoryMachine):
    """The radix-tree policy: splits, leaf eviction, deduplication, in every example."""

    CACHING = "radix"


def test_memory_layer_under_random_interleavings():
    run_state_machine_as_test(MemoryMachine, settings=SETTINGS)


def test_prefix_cache_under_random_interleavings():
    run_state_machine_as_test(PrefixCachingMachine, settings=SETTINGS)


@pytest.mark.slow
def test_radix_cache_under_random_interleavings():
    run_state_machine_as_test(RadixMachine, settings=SETTINGS)
