"""The physical block pool: which KV blocks are free, who holds the others, and the prefix cache.

PagedAttention splits the KV cache into ``num_blocks`` physical blocks of ``block_size``
token slots each. This module hands out block *ids* only; the tensors that hold K and V
belong to the executor (memory knows no tensors).

Every block is in exactly one of three states, and the allocator keeps it so:

* **free**        -- on the free stack, reference count 0, holds nothing useful;
* **cached-free** -- reference count 0 but still holding a full block of a prefix that a
  later request may reuse; the prefix cache evicts it (forgets it) only when the free stack
  is empty and somebody needs a block;
* **referenced**  -- reference count >= 1: held by that many block tables.

Allocation and freeing are O(1): a stack of free ids (the sketch in the vLLM article pops
from the front of a Python list, which is O(n) per call).

Reference counts belong to the allocator alone: a block's count is the number of block
tables that name it, and only the allocator's methods change it (``allocate`` sets 1,
``incref`` and ``hold_cached`` add a holder, ``free`` drops one). Everybody else reads them
(``ref_count``, or the read-only view ``ref_counts``). ``docs/architecture.md`` says who
calls what.

The prefix cache is a policy the allocator holds, chosen at construction
(``enable_prefix_caching``): ``"hash"`` (vLLM's chained block hashes, ``HashPrefixCache``;
``True`` means this one) or ``"radix"`` (SGLang's radix tree, ``RadixTree``). Both keep
their blocks here, with the same reference counts and the same three states, and obey the
same contract (``policy.PrefixCachePolicy``); they differ in how a prompt finds its cached
prefix and in which cached-free block is evicted first.
"""

from __future__ import annotations

from typing import Sequence

from .policy import PrefixCachePolicy, match_limit, prefix_cache_policy
from .prefix_cache import CacheEntry, HashPrefixCache
from .radix_cache import RadixTree


class NoFreeBlocksError(MemoryError):
    """Raised when a block is asked for and every block is referenced.

    The scheduler avoids it by checking ``num_free_blocks`` first; seeing it means a
    caller asked for memory it had not budgeted for. Nothing is changed when it is raised.
    """


class BlockAllocator:
    """Owns ``num_blocks`` physical KV blocks: a free pool, reference counts, a prefix cache.

    Invariant: for every block id, exactly one of (on the free stack), (cached by the prefix
    cache with reference count 0), (reference count > 0) holds. Reference counts never go
    negative.

    ``enable_prefix_caching``: False (off), True or ``"hash"`` (chained block hashes, as
    vLLM), ``"radix"`` (a radix tree, as SGLang). The attribute keeps the policy's name
    (``"hash"``, ``"radix"``) or False; ``prefix_cache`` is the policy object (None when off)
    and ``radix`` the tree when the policy is radix (None otherwise).
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool | str = False):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        policy = prefix_cache_policy(enable_prefix_caching)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching: str | bool = policy or False
        self._ref_counts = [0] * num_blocks
        self._fill = [0] * num_blocks          # slots of each block that hold a token
        self.num_filled_slots = 0              # sum of _fill over referenced blocks
        # Reversed so that the first allocations hand out ids 0, 1, 2, ...: easier to read in demos.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cache: PrefixCachePolicy | None = (
            None if policy is None else HashPrefixCache(self) if policy == "hash" else RadixTree(self))
        # A host tier behind the cache (``HostTier``): it is told of every block evicted.
        self.lower_tier = None
        # Counters for statistics and the widgets; plain ints, cheap to read.
        self.num_evictions = 0
        self.num_cache_queries = 0
        self.num_cache_hits = 0

    # ---- state ------------------------------------------------------------------------
    @property
    def prefix_cache(self) -> PrefixCachePolicy | None:
        """The prefix-cache policy object (None when prefix caching is off)."""
        return self._cache

    @property
    def ref_counts(self) -> Sequence[int]:
        """Every block's reference count, by block id: a read-only view (only the allocator
        writes counts) for the policies, which read many per call."""
        return self._ref_counts

    @property
    def free_block_ids(self) -> tuple[int, ...]:
        """The truly free blocks, in stack order (the last is handed out next): a copy, for
        widgets, exercises and tests (cached-free blocks are the policy's, not listed here)."""
        return tuple(self._free)

    @property
    def radix(self) -> RadixTree | None:
        """The radix tree, when the policy is ``"radix"`` (None otherwise)."""
        return self._cache if isinstance(self._cache, RadixTree) else None

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out now: truly free plus cached-free (evictable)."""
        cache = self._cache
        return len(self._free) + (cache.num_evictable if cache is not None else 0)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix (evicted last, in the policy's order)."""
        return self._cache.num_evictable if self._cache is not None else 0

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one block table."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, referenced or not."""
        return self._cache.num_cached_blocks if self._cache is not None else 0

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold ``block_id``."""
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        """Whether ``block_id`` is registered in the prefix cache."""
        return self._cache is not None and self._cache.is_cached(block_id)

    def cache_entry(self, block_id: int) -> CacheEntry | None:
        """The tokens a cached block holds and their chained hashes (None if not cached)."""
        return self._cache.entry(block_id) if self._cache is not None else None

    def state(self, block_id: int) -> str:
        """``"free"``, ``"cached-free"`` or ``"used"``: the three states of the invariant."""
        self._check_id(block_id)
        if self._ref_counts[block_id] > 0:
            return "used"
        return "cached-free" if self.is_cached(block_id) else "free"

    # ---- allocate / share / free ---------------------------------------------------------
    def allocate(self) -> int:
        """Take one block (reference count 1). Evicts a cached-free block (the policy picks
        which: the least recently used block, or the last block of the least recently used
        leaf) when no plain free block is left. Raises ``NoFreeBlocksError`` when none can be had."""
        if self._free:
            block_id = self._free.pop()
        elif self._cache is not None and self._cache.num_evictable:
            tier = self.lower_tier
            block_id, entry = self._cache.evict(with_entry=tier is not None)
            self.num_evictions += 1
            if tier is not None:            # its K/V is still there: the tier copies it before the step runs
                tier.offload(block_id, entry)
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
            if self._cache is not None and self._cache.is_cached(block_id):
                self._cache.released(block_id)
            else:
                self._free.append(block_id)

    def hold_cached(self, block_id: int) -> None:
        """One more holder for a block the prefix cache holds: a hit, or a table switching
        to the cache's copy. A cached-free block is revived (no longer evictable)."""
        if self._ref_counts[block_id] == 0:
            self._cache.revived(block_id)
            self.num_filled_slots += self._fill[block_id]
        self._ref_counts[block_id] += 1

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
    def attach_lower_tier(self, tier) -> None:
        """Send every evicted cached block to ``tier`` (a ``HostTier``: ``tier.offload(block_id,
        entry)``) before it is handed out again."""
        if self._cache is None:
            raise ValueError("a lower tier keeps blocks the prefix cache evicts: turn prefix caching on")
        self.lower_tier = tier

    def acquire_cached_prefix(self, token_ids, max_tokens: int | None = None, salt: str | None = None) -> list[int]:
        """The cached blocks that begin ``token_ids`` (whole blocks within the first
        ``max_tokens`` tokens, under ``salt``'s namespace), each with one more holder: the
        caller now holds them.
        Counted as the hash cache counts: one query per full block looked up, up to the
        first miss. ``[]`` when prefix caching is off."""
        if self._cache is None:
            return []
        blocks = self._cache.acquire(token_ids, max_tokens, salt)
        limit = match_limit(len(token_ids), max_tokens)
        self.record_lookups(len(blocks) + (len(blocks) < limit // self.block_size), len(blocks))
        return blocks

    def record_lookups(self, num_queries: int, num_hits: int) -> None:
        """Count prefix-cache lookups of full blocks, and how many hit (``prefix_cache_hit_rate``)."""
        self.num_cache_queries += num_queries
        self.num_cache_hits += num_hits

    def reset_prefix_cache(self) -> int:
        """Forget every cached-free prefix (they become plain free). Returns how many."""
        if self._cache is None:
            return 0
        freed = self._cache.reset()
        self._free.extend(freed)
        return len(freed)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits per lookup of a full prompt block since the start (0.0 before any lookup)."""
        return self.num_cache_hits / self.num_cache_queries if self.num_cache_queries else 0.0

    # ---- checks ------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the three-state invariant. Cheap enough for tests after every operation."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free stack twice"
        cached = self._cache.evictable_blocks() if self._cache is not None else set()
        assert not (free & cached), f"blocks both free and cached-free: {sorted(free & cached)}"
        for block_id, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block_id} has a negative reference count {count}"
            states = (block_id in free) + (block_id in cached) + (count > 0)
            assert states == 1, f"block {block_id} is in {states} states (free/cached/used)"
        assert len(cached) == self.num_cached_free_blocks, "the cache miscounts its cached-free blocks"
        filled = sum(f for b, f in enumerate(self._fill) if self._ref_counts[b] > 0)
        assert filled == self.num_filled_slots, f"filled-slot count {self.num_filled_slots} != {filled}"
        if self._cache is not None:
            self._cache.check()

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")

    def __repr__(self) -> str:
        return (
            f"BlockAllocator(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"free={len(self._free)}, cached_free={self.num_cached_free_blocks}, used={self.num_used_blocks}, "
            f"prefix_caching={self.enable_prefix_caching!r})"
        )
