"""The one place that answers "can these block tables grow by this plan?" and grows them.

Every way a sequence gains KV slots goes through ``BlockManager.allocate_slots`` (vLLM v1's
``KVCacheManager.allocate_slots``, in this project's words): a waiting request admitted with
its prefix-cache hit, a running sequence's next chunk or decode token, a beam-search
request's beams growing together, a swapped request's tables coming back from the host
pool. The scheduler decides *how many* tokens each sequence computes; this module decides
whether the pool can give them slots, counting every block exactly once:

* a new block for each block boundary the tokens cross (``cdiv``, less what the table holds);
* a copy of a shared, partly filled last block for each table that writes into it
  (copy-on-write), but for the last of its holders, who finds it its own by then;
* a cached-free block that a prefix-cache hit revives (it stops being evictable);
* one block per block of a table moved in from another pool (each shared block once);
* a new block for each block a host tier's hit brings back (``host_tier.py``): it is
  counted like any block the prefix needs beyond the device hits.

Either every table of the plan grows, or none does and ``None`` says so. The plan's
tables may name ``num_lookahead_tokens`` slots past their new tokens (speculative
decoding's drafts); ``BlockTable.truncate`` gives back the tail a step did not keep.

``beam_successors`` is the other rule beam search needs on blocks: which beams die, which
continue in place and which fork.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .allocator import BlockAllocator
from .block_table import BlockTable, CopyOnWrite, blocks_to_add, copies_on_write
from .policy import match_limit


@dataclass(slots=True)
class CachedPrefix:
    """A prefix-cache hit found for an empty table and not taken yet: the cached ``blocks``
    that begin ``token_ids``, looked up within its first ``max_tokens`` tokens (the last
    prompt token is never reused: its logits must be computed), and the ``host_blocks`` of
    a host tier that continue it (copied into new device blocks when taken)."""

    blocks: list[int]
    token_ids: Sequence[int]
    max_tokens: int | None
    block_size: int
    host_blocks: list[int] = field(default_factory=list)
    num_host_queries: int = 0          # full blocks looked up in the host tier

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV the hit holds, on the device or the host: they need no compute."""
        return (len(self.blocks) + len(self.host_blocks)) * self.block_size


@dataclass(slots=True)
class Growth:
    """One table's part of a plan: take ``prefix`` (an empty table's prefix-cache hit), then
    give ``new_token_ids`` slots (their K/V is computed this step), then reserve
    ``num_lookahead_tokens`` slots past them.

    A table of another pool (a swapped sequence's host table) is first copied into the
    manager's pool; ``allocate_slots`` then puts the new table in ``table`` (the old one is
    freed)."""

    table: BlockTable
    new_token_ids: Sequence[int] = ()
    num_lookahead_tokens: int = 0
    prefix: CachedPrefix | None = None


@dataclass(slots=True)
class Allocation:
    """What ``allocate_slots`` did: the copy-on-write copies, and the ``(source block,
    destination block)`` copies of the tables moved in from another pool. The executor makes
    the moves first, then the copy-on-write copies, before the step runs."""

    copies: list[CopyOnWrite] = field(default_factory=list)
    moved: list[CopyOnWrite] = field(default_factory=list)


class BlockManager:
    """Grows block tables on one ``BlockAllocator`` by whole plans, or not at all.

    The allocator owns the blocks and their reference counts; the tables own their block
    lists; this class only counts and then asks them (``BlockTable.append_tokens``,
    ``reuse_cached_prefix``, ``reserve``, ``copy_to``), so nothing here touches another
    object's fields.
    """

    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self.block_size = allocator.block_size

    def find_cached_prefix(self, table: BlockTable, token_ids: Sequence[int],
                           max_tokens: int | None) -> CachedPrefix:
        """The prefix-cache hit an empty ``table`` would take for ``token_ids``: device blocks,
        then the host tier's continuation of the chain (if the pool has a tier). Changes nothing."""
        blocks = table.peek_cached_prefix(token_ids, max_tokens)
        prefix = CachedPrefix(blocks, token_ids, max_tokens, self.block_size)
        tier = self.allocator.lower_tier
        if tier is not None:
            limit = match_limit(len(token_ids), max_tokens) // self.block_size
            if len(blocks) < limit:
                prefix.host_blocks = tier.match(token_ids, max_tokens, table.salt, blocks)
                prefix.num_host_queries = len(prefix.host_blocks) + (len(blocks) + len(prefix.host_blocks) < limit)
        return prefix

    def blocks_needed(self, plan: Sequence[Growth]) -> int:
        """How many blocks ``allocate_slots(plan)`` takes from the pool (evictable cached-free
        blocks count as free, so a hit that revives one takes it). Changes nothing."""
        alloc, bs = self.allocator, self.block_size
        holders: dict[int, int] = {}      # block of another pool -> the plan's tables naming it
        revived: set[int] = set()
        for g in plan:
            if g.table.allocator is not alloc:
                for b in g.table.block_ids:
                    holders[b] = holders.get(b, 0) + 1
            if g.prefix is not None:
                revived.update(b for b in g.prefix.blocks if alloc.ref_count(b) == 0)
        need = len(holders) + len(revived)
        writers: dict[tuple[bool, int], int] = {}   # (moved?, partly filled block) -> tables writing it
        for g in plan:
            table = g.table
            held, num_tokens = len(table.block_ids), table.num_tokens
            if g.prefix is not None:                # an empty table: it will hold the hit's blocks
                held, num_tokens = len(g.prefix.blocks), g.prefix.num_tokens
            end = num_tokens + len(g.new_token_ids) + g.num_lookahead_tokens
            need += blocks_to_add(end, held, bs)
            partial = table.partial_block()
            if g.new_token_ids and partial is not None:
                key = (table.allocator is not alloc, partial)
                writers[key] = writers.get(key, 0) + 1
        for (moved, block), m in writers.items():
            need += copies_on_write(m, holders[block] if moved else alloc.ref_count(block))
        return need

    def can_allocate(self, plan: Sequence[Growth], reserve: int = 0) -> bool:
        """Whether ``plan`` fits and leaves ``reserve`` blocks free (the admission watermark)."""
        return self.blocks_needed(plan) <= self.allocator.num_free_blocks - reserve

    def allocate_slots(self, plan: Sequence[Growth], reserve: int = 0) -> Allocation | None:
        """Grow every table of ``plan``, in order, or return None (changing nothing) when the
        pool cannot give the blocks and still keep ``reserve`` free.

        New slots are not published to the prefix cache: their K/V does not exist yet.
        The caller publishes them once the step has run (``BlockTable.cache_computed_blocks``)."""
        if not self.can_allocate(plan, reserve):
            return None
        done = Allocation()
        moved: dict[int, int] = {}        # source block -> its copy here: a shared block moves once
        tier = self.allocator.lower_tier
        if tier is not None:
            # The host blocks moved in are read when the step runs: no host-tier copy decided
            # before then may write into them once they are freed (``HostTier.pin``).
            for g in plan:
                if g.table.allocator is tier.host:
                    tier.pin(g.table.block_ids)
        for g in plan:
            if g.table.allocator is not self.allocator:
                table, pairs = g.table.copy_to(self.allocator, moved)
                g.table.free()
                g.table = table
                done.moved += pairs
        for g in plan:
            table = g.table
            if g.prefix is not None:
                table.reuse_cached_prefix(g.prefix.token_ids, g.prefix.max_tokens)
                if g.prefix.num_host_queries:       # the host tier's part: new blocks, filled by copies
                    self.allocator.lower_tier.load(table, g.prefix.token_ids, g.prefix.host_blocks,
                                                   g.prefix.num_host_queries)
            if g.new_token_ids:
                done.copies += table.append_tokens(g.new_token_ids, computed=False)
            if g.num_lookahead_tokens:
                table.reserve(table.num_tokens + g.num_lookahead_tokens)
        return done


def beam_successors(num_beams: int, parents: Sequence[int]) -> list[list[int]]:
    """Beam search's fork/death rule on block tables. ``parents[k]``: the beam (index) the
    k-th surviving candidate extends. Returns, for each beam, the candidates that extend it,
    in candidate order.

    A beam with none *dies*, and frees its blocks before anything else happens (so a fork of
    the same step can use them). A beam with some keeps its table for the first of them
    (it continues in place) and *forks* once for each further one: the forks share every
    block, and the partly filled last block is copied by the second writer (copy-on-write).
    """
    children: list[list[int]] = [[] for _ in range(num_beams)]
    for k, parent in enumerate(parents):
        children[parent].append(k)
    return children
