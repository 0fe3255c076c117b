"""The physical block pool: which KV blocks are free, who holds the others, and the prefix cache.

PagedAttention splits the KV cache into ``num_blocks`` physical blocks of ``block_size``
token slots each. This module hands out block *ids* only; the tensors that hold K and V
belong to the executor (memory knows no tensors).

Every block is in exactly one of three states, and the allocator keeps it so:

* **free**        -- on the free stack, reference count 0, holds nothing useful;
* **cached-free** -- reference count 0 but still holding a full block of a prefix that a
  later request may reuse; it sits in an LRU queue and is evicted (its hash forgotten)
  only when the free stack is empty and somebody needs a block;
* **referenced**  -- reference count >= 1: held by that many block tables.

Allocation and freeing are O(1): a stack of free ids (the sketch in the vLLM article pops
from the front of a Python list, which is O(n) per call) and an ordered dict for the LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class NoFreeBlocksError(MemoryError):
    """Raised when a block is asked for and every block is referenced.

    The scheduler avoids it by checking ``num_free_blocks`` first; seeing it means a
    caller asked for memory it had not budgeted for. Nothing is changed when it is raised.
    """


@dataclass(slots=True)
class CacheEntry:
    """What the prefix cache remembers about a full block: its chained hash and its tokens.

    The tokens are kept so that a hit is confirmed by comparison, never trusted to the hash
    alone (two different blocks with the same hash must not share KV).
    """

    block_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]


class BlockAllocator:
    """Owns ``num_blocks`` physical KV blocks: a free pool, reference counts, a prefix cache.

    Invariant: for every block id, exactly one of (on the free stack), (in the LRU of
    cached-free blocks), (reference count > 0) holds. Reference counts never go negative.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = False):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._fill = [0] * num_blocks          # slots of each block that hold a token
        self.num_filled_slots = 0              # sum of _fill over referenced blocks
        # Reversed so that the first allocations hand out ids 0, 1, 2, ...: easier to read in demos.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # LRU order: oldest first
        self._entries: dict[int, CacheEntry] = {}                  # block id -> what it caches
        self._by_hash: dict[int, int] = {}                         # block hash -> block id
        # Counters for statistics and the widgets; plain ints, cheap to read.
        self.num_evictions = 0
        self.num_cache_queries = 0
        self.num_cache_hits = 0

    # ---- state ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out now: truly free plus cached-free (evictable)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix (evicted last, LRU first)."""
        return len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one block table."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, referenced or not."""
        return len(self._entries)

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold ``block_id``."""
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        """Whether ``block_id`` is registered in the prefix cache."""
        return block_id in self._entries

    def cache_entry(self, block_id: int) -> CacheEntry | None:
        return self._entries.get(block_id)

    def state(self, block_id: int) -> str:
        """``"free"``, ``"cached-free"`` or ``"used"``: the three states of the invariant."""
        self._check_id(block_id)
        if self._ref_counts[block_id] > 0:
            return "used"
        return "cached-free" if block_id in self._cached_free else "free"

    # ---- allocate / share / free ---------------------------------------------------------
    def allocate(self) -> int:
        """Take one block (reference count 1). Evicts the least recently used cached-free
        block when no plain free block is left. Raises ``NoFreeBlocksError`` when none can be had."""
        if self._free:
            block_id = self._free.pop()
        elif self._cached_free:
            block_id, _ = self._cached_free.popitem(last=False)
            self._forget(block_id)
            self.num_evictions += 1
        else:
            raise NoFreeBlocksError(
                f"all {self.num_blocks} KV blocks are in use; free some or preempt a sequence"
            )
        self._ref_counts[block_id] = 1
        self._fill[block_id] = 0
        return block_id

    def incref(self, block_id: int) -> None:
        """One more table holds ``block_id`` (fork, or a prefix-cache hit on a used block)."""
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is free; allocate it instead of sharing it")
        self._ref_counts[block_id] += 1

    def free(self, block_id: int) -> None:
        """One table lets go of ``block_id``. At zero the block becomes free, or cached-free
        when it holds a cached prefix (most recently used end of the LRU)."""
        self._check_id(block_id)
        count = self._ref_counts[block_id]
        if count == 0:
            raise ValueError(f"double free: block {block_id} is not held by anyone")
        self._ref_counts[block_id] = count - 1
        if count == 1:
            self.num_filled_slots -= self._fill[block_id]
            if block_id in self._entries:
                self._cached_free[block_id] = None
            else:
                self._free.append(block_id)

    def set_fill(self, block_id: int, num_tokens: int) -> None:
        """Record how many slots of a held block hold tokens (the block table calls this)."""
        self.num_filled_slots += num_tokens - self._fill[block_id]
        self._fill[block_id] = num_tokens

    def fill(self, block_id: int) -> int:
        """How many slots of ``block_id`` hold tokens."""
        return self._fill[block_id]

    @property
    def kv_cache_usage(self) -> float:
        """Share of the pool held by sequences: vLLM's "KV cache usage" (0.0 when idle)."""
        return self.num_used_blocks / self.num_blocks

    @property
    def held_slot_fill(self) -> float:
        """Share of the slots in held blocks that hold a token (0.0 when nothing is held).

        Paged allocation keeps this near 1: only each sequence's last block is partly empty.
        Shared blocks count once: that is the point of sharing.
        """
        used = self.num_used_blocks * self.block_size
        return self.num_filled_slots / used if used else 0.0

    # ---- prefix cache ----------------------------------------------------------------
    def lookup(self, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """Find a cached block holding exactly ``token_ids`` under ``block_hash``.

        On a hit the caller becomes a holder: the reference count goes up (a cached-free
        block is revived out of the LRU). Returns the block id, or None on a miss.
        """
        self.num_cache_queries += 1
        block_id = self.peek(block_hash, parent_hash, token_ids)
        if block_id is None:
            return None
        self.num_cache_hits += 1
        if self._ref_counts[block_id] == 0:
            del self._cached_free[block_id]
            self.num_filled_slots += self._fill[block_id]
        self._ref_counts[block_id] += 1
        return block_id

    def peek(self, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """Like ``lookup`` but changes nothing: for admission checks that may not admit."""
        block_id = self._by_hash.get(block_hash)
        if block_id is None:
            return None
        entry = self._entries[block_id]
        if entry.parent_hash != parent_hash or entry.token_ids != token_ids:
            return None   # a hash collision: never share KV on the hash alone
        return block_id

    def register(self, block_id: int, block_hash: int, parent_hash: int,
                 token_ids: tuple[int, ...]) -> bool:
        """Publish a full, referenced block in the prefix cache. Returns whether it was added:
        a block whose hash is already cached elsewhere stays private (the first one wins)."""
        if not self.enable_prefix_caching:
            return False
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is free; only held blocks can be cached")
        if block_hash in self._by_hash or block_id in self._entries:
            return False
        self._entries[block_id] = CacheEntry(block_hash, parent_hash, token_ids)
        self._by_hash[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached-free prefix (they become plain free). Returns how many."""
        n = len(self._cached_free)
        while self._cached_free:
            block_id, _ = self._cached_free.popitem(last=False)
            self._forget(block_id)
            self._free.append(block_id)
        return n

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits per lookup of a full prompt block since the start (0.0 before any lookup)."""
        return self.num_cache_hits / self.num_cache_queries if self.num_cache_queries else 0.0

    # ---- checks ------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the three-state invariant. Cheap enough for tests after every operation."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free stack twice"
        cached = set(self._cached_free)
        assert not (free & cached), f"blocks both free and cached-free: {sorted(free & cached)}"
        for block_id, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block_id} has a negative reference count {count}"
            states = (block_id in free) + (block_id in cached) + (count > 0)
            assert states == 1, f"block {block_id} is in {states} states (free/cached/used)"
        for block_id in cached:
            assert block_id in self._entries, f"cached-free block {block_id} has no cache entry"
        filled = sum(f for b, f in enumerate(self._fill) if self._ref_counts[b] > 0)
        assert filled == self.num_filled_slots, f"filled-slot count {self.num_filled_slots} != {filled}"
        for block_hash, block_id in self._by_hash.items():
            assert self._entries[block_id].block_hash == block_hash
        assert len(self._by_hash) == len(self._entries)

    def _forget(self, block_id: int) -> None:
        entry = self._entries.pop(block_id)
        del self._by_hash[entry.block_hash]

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")

    def __repr__(self) -> str:
        return (
            f"BlockAllocator(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"free={len(self._free)}, cached_free={len(self._cached_free)}, used={self.num_used_blocks})"
        )
