"""A second tier behind the prefix cache: evicted cached blocks wait in host memory.

The device pool's prefix cache forgets a cached-free block when it needs the room
(``BlockAllocator.allocate`` evicts it). With a host tier (vLLM's CPU offloading,
``kv_offloading_size``; SGLang's HiCache; LMCache) the block is first copied to a host
block and filed there under the same chained hash; a later prompt whose chain continues
past the device cache's hits finds it there and gets it copied back, which costs
``block_bytes / link_bandwidth`` instead of the FLOPs of recomputing ``block_size`` tokens.

The host pool is the one swapping uses (a ``BlockAllocator`` of its own, with the hash
policy): a tier block is a *cached-free* host block, so a swap-out that needs the room
evicts it, least recently used first, and nothing a swapped sequence holds is ever
dropped. Both device policies feed the same tier: the radix tree names an evicted block by
the hash chain of its path (``RadixTree.entry``), so the tier needs only one kind of key.

The copies join the step's swap lists (``plan.swap_out``: device -> host, ``plan.swap_in``:
host -> device), which the executor makes before anything else in the step. What keeps
them right, with two pools and blocks changing hands within one planning pass:

* a device block's K/V changes only when a step runs (copies, then the batch), and the
  device -> host copies go first: an evicted block is read before its new holder writes it;
* every host block that a copy of this step writes (an offload) or reads (a load, or a
  swap-in: its table is freed before the step runs) is *pinned*, held with a reference
  count, until the step has run (``copies_done``), so no other copy of the same step can
  take it;
* a host hit is pinned before the device blocks it loads into are allocated: those
  allocations may evict device blocks into the host pool, which must not push out the hit.

The host copy stays after a load (the tier is inclusive): when the device evicts the block
again it is already on the host, and no copy is made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from .prefix_cache import CacheEntry, HashPrefixCache, hash_full_blocks

if TYPE_CHECKING:   # type hints only
    from .allocator import BlockAllocator
    from .block_table import BlockTable


class HostTier:
    """Cached blocks evicted from ``device`` kept in ``host`` (a hash-policy pool) and
    brought back on a hit. Attaches itself to ``device`` as its lower tier.

    Invariant, between steps (after ``copies_done``): every tier block is cached-free in
    the host pool (reference count 0, filed under the chained hash of the device block it
    copies), and no copy is pending.
    """

    def __init__(self, device: BlockAllocator, host: BlockAllocator, bytes_per_block: int = 0,
                 num_blocks: int | None = None):
        if not isinstance(host.prefix_cache, HashPrefixCache):
            raise ValueError("a host tier needs a host pool with the hash policy (it files blocks by their hash)")
        if device.prefix_cache is None:
            raise ValueError("a host tier keeps blocks the prefix cache evicts: turn prefix caching on")
        if host.block_size != device.block_size:
            raise ValueError(f"host blocks of {host.block_size} tokens behind device blocks of {device.block_size}")
        self.device, self.host = device, host
        self.block_size = device.block_size
        self.bytes_per_block = bytes_per_block
        self.capacity = host.num_blocks if num_blocks is None else num_blocks   # blocks given to the tier
        self._cache: HashPrefixCache = host.prefix_cache
        self._out: list[tuple[int, int]] = []     # (device block, host block) offloads not in a plan yet
        self._in: list[tuple[BlockTable, list[tuple[int, int]], int]] = []   # loads not in a plan yet:
        #                                     (table, its (host block, device block) pairs, blocks looked up)
        self._pinned: list[int] = []              # host blocks named by those copies
        self._in_flight: list[int] = []           # host blocks named by the copies of the step running now
        self.last_offloads: list[tuple[int, int]] = []   # what the last step copied down and up
        self.last_loads: list[tuple[int, int]] = []      # (for widgets and tests: read after a step)
        self._step_done = True
        self.num_offloaded_blocks = 0             # copies device -> host
        self.num_loaded_blocks = 0                # copies host -> device (hits)
        self.num_queries = 0                      # full blocks looked up here (after a device miss)
        self.num_already_offloaded = 0            # evicted blocks the tier already held: no copy
        self.num_dropped = 0                      # evicted blocks the tier had no room for
        device.attach_lower_tier(self)

    # ---- down: the device evicts a cached block ----------------------------------------
    def offload(self, block_id: int, entry: CacheEntry) -> None:
        """The device pool is evicting ``block_id`` (it caches ``entry``): keep a host copy
        under the same hash, unless one is already here or the host pool has no block to
        give (every host block is held: swapped sequences, pinned copies)."""
        kept = self._cache.peek(entry.block_hash, entry.parent_hash, entry.token_ids)
        if kept is not None:
            self.host.hold_cached(kept)         # used again: most recently used end of the host's LRU
            self.host.free(kept)
            self.num_already_offloaded += 1
            return
        if self.host.num_free_blocks == 0:
            self.num_dropped += 1
            return
        h = self.host.allocate()                 # may evict the host's least recently used block: it is forgotten
        if not self._cache.register(h, entry.block_hash, entry.parent_hash, entry.token_ids):
            self.host.free(h)                    # another block owns the hash (a collision): keep nothing
            self.num_dropped += 1
            return
        self.host.set_fill(h, self.block_size)
        self._out.append((block_id, h))
        self._pinned.append(h)
        self.num_offloaded_blocks += 1

    # ---- up: a prompt's chain continues here ---------------------------------------------
    def match(self, token_ids: Sequence[int], max_tokens: int | None, salt: str | None,
              device_blocks: Sequence[int]) -> list[int]:
        """The host blocks that continue the prompt's chain after its device hits
        ``device_blocks``, up to the first miss, whole blocks within ``max_tokens``. Changes nothing."""
        parent = self.device.cache_entry(device_blocks[-1]).block_hash if device_blocks else None
        hits = []
        for block_hash, parent_hash, block in hash_full_blocks(token_ids, self.block_size, max_tokens, salt,
                                                               first_block=len(device_blocks),
                                                               parent_hash=parent):
            h = self._cache.peek(block_hash, parent_hash, block)
            if h is None:
                break
            hits.append(h)
        return hits

    def load(self, table: BlockTable, token_ids: Sequence[int], host_blocks: Sequence[int],
             num_queries: int) -> None:
        """Give ``table`` (holding its device hits) fresh device blocks for the next
        ``len(host_blocks)`` blocks of ``token_ids``, filled by copies from ``host_blocks``
        before the step runs. ``num_queries``: the full blocks looked up here for it."""
        for h in host_blocks:                    # pinned first: see the module's docstring
            self.host.hold_cached(h)
        self._pinned += host_blocks
        start, bs = table.num_tokens, self.block_size
        table.append_tokens(token_ids[start:start + len(host_blocks) * bs], computed=False)
        pairs = list(zip(host_blocks, table.block_ids[start // bs:], strict=True))
        self._in.append((table, pairs, num_queries))

    def pin(self, host_blocks: Sequence[int]) -> None:
        """Hold ``host_blocks`` until the step has run: a swap-in reads them then, after
        freeing them now (an offload decided meanwhile must not take them)."""
        for h in host_blocks:
            self.host.incref(h)
        self._pinned += host_blocks

    # ---- the step's copies ----------------------------------------------------------------
    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The offloads and loads decided since the last call, for this step's plan: they
        run before anything else in the step (``copies_done`` unpins their host blocks)."""
        if self._step_done:                       # the first call for a new step
            self.last_offloads, self.last_loads, self._step_done = [], [], False
        out, loads = self._out, []
        for table, pairs, num_queries in self._in:
            if table.freed:
                continue         # given up in the same pass (a beam group admitted whole or not at all)
            loads += pairs
            self.num_loaded_blocks += len(pairs)
            self.num_queries += num_queries
        self._out, self._in = [], []
        self._in_flight += self._pinned
        self._pinned = []
        self.last_offloads += out
        self.last_loads += loads
        return out, loads

    def copies_done(self) -> None:
        """The step whose copies ``take_copies`` gave has run: its host blocks become
        cached-free (evictable, least recently used last)."""
        for h in self._in_flight:
            self.host.free(h)
        self._in_flight = []
        self._step_done = True

    def reset(self) -> int:
        """Forget every tier block no copy needs. Returns how many."""
        return self.host.reset_prefix_cache()

    # ---- numbers ------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks the tier holds now (cached on the host)."""
        return self._cache.num_cached_blocks

    def stats(self) -> dict:
        """The tier's counters, for ``LLM.stats()``, ``/metrics`` and the simulator
        (``docs/kv_offloading.md`` defines each)."""
        b = self.bytes_per_block
        return {
            "kv_offloading_blocks": self.capacity,
            "num_host_cached_blocks": self.num_blocks,
            "num_offloaded_blocks": self.num_offloaded_blocks,
            "num_host_cache_hits": self.num_loaded_blocks,
            "num_host_cache_queries": self.num_queries,
            "host_cache_hit_rate": self.num_loaded_blocks / self.num_queries if self.num_queries else 0.0,
            "num_offloads_skipped": self.num_already_offloaded,
            "num_offloads_dropped": self.num_dropped,
            "num_host_evictions": self.host.num_evictions,
            "kv_offloaded_bytes": self.num_offloaded_blocks * b,
            "kv_loaded_bytes": self.num_loaded_blocks * b,
        }

    @property
    def pinned_blocks(self) -> list[int]:
        """Host blocks held for copies that have not run yet (none between steps, but for
        evictions decided after the last plan was made)."""
        return self._pinned + self._in_flight

    def check(self) -> None:
        """Assert the tier's part of the invariants (tests call it between steps)."""
        self.host.check_invariants()
        for h in self._pinned + self._in_flight:
            assert self.host.ref_count(h) > 0, f"pinned host block {h} is not held"
