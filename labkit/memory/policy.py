"""The prefix-cache contract: what a policy (hash blocks, radix tree) must do, and for whom.

A prefix cache remembers which full, computed blocks hold which prefix, so that a later
prompt starting the same way reuses their KV instead of computing it. labkit has two
policies, chosen with ``enable_prefix_caching``: ``"hash"`` (vLLM's chained block hashes,
``HashPrefixCache``) and ``"radix"`` (SGLang's radix tree, ``RadixTree``). Both keep their
blocks in the same ``BlockAllocator`` and obey ``PrefixCachePolicy`` below; the allocator
and the block tables call nothing else, so either policy (or a third: a host tier behind
the cache would be one) serves every caller unchanged.

Who owns what:

* the **allocator** owns every block's reference count and its free/cached-free/used state.
  A policy reads counts (``BlockAllocator.ref_counts``, a read-only view) and changes them
  only through the allocator (``hold_cached``, ``free``);
* a **block table** owns its ``block_ids`` and ``token_ids``. A policy keeps its own
  per-table state there (the hash chain ``block_hashes``, the radix tree's
  ``num_published_blocks``), and swaps a table's private block for the cache's copy of the
  same prefix only through ``BlockTable.adopt_cached_block``;
* the **policy** owns which cached block holds which prefix, and the eviction order of
  the cached-free ones.

A policy only ever caches whole blocks, and only once their K/V is computed (``publish``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:   # type hints only: the allocator imports this module
    from .block_table import BlockTable
    from .prefix_cache import CacheEntry

# The values ``enable_prefix_caching`` takes, and the policy each means.
POLICIES = {False: None, None: None, "none": None, True: "hash", "hash": "hash", "radix": "radix"}


def prefix_cache_policy(value: bool | str | None) -> str | None:
    """``"hash"``, ``"radix"`` or None (off) for an ``enable_prefix_caching`` value:
    True means the hash cache (vLLM's), False or None turns caching off."""
    try:
        return POLICIES[value]
    except (KeyError, TypeError):
        raise ValueError(f"enable_prefix_caching must be True, False, 'hash' or 'radix', got {value!r}") from None


def match_limit(num_tokens: int, max_tokens: int | None) -> int:
    """How many leading tokens of a ``num_tokens``-token prompt a lookup may match: all of
    them, or the first ``max_tokens`` (never fewer than 0). Whole blocks within them match."""
    return num_tokens if max_tokens is None else max(0, min(max_tokens, num_tokens))


class PrefixCachePolicy(Protocol):
    """What the allocator and the block tables ask of a prefix-cache policy.

    Lookups take a ``salt`` (vLLM's ``cache_salt``): a namespace of its own, so that two
    requests share cached blocks only if they carry the same salt (or none). Every method
    that takes or gives blocks keeps the allocator's three-state invariant (``check``
    asserts the policy's part of it).
    """

    policy: str                 # "hash" or "radix"
    block_size: int

    # ---- lookups (a new table's prompt) ------------------------------------------------
    def match(self, token_ids: Sequence[int], max_tokens: int | None = None, salt: str | None = None) -> list[int]:
        """The cached blocks that begin ``token_ids``, whole blocks within the first
        ``max_tokens`` tokens (``match_limit``). Changes nothing."""
        ...

    def acquire(self, token_ids: Sequence[int], max_tokens: int | None = None, salt: str | None = None) -> list[int]:
        """``match``, and the caller becomes a holder of every block found (each through
        ``BlockAllocator.hold_cached``)."""
        ...

    def reused(self, table: BlockTable) -> None:
        """An empty ``table`` was just filled with blocks from ``acquire``: set its per-table state."""
        ...

    # ---- publication (a table's computed blocks) ---------------------------------------
    def publish(self, table: BlockTable, num_computed_tokens: int) -> None:
        """Cache every full block within ``table``'s first ``num_computed_tokens`` tokens
        (their K/V is written). A policy may instead switch the table to a cached copy of
        the same prefix (``BlockTable.adopt_cached_block``)."""
        ...

    # ---- the allocator's calls, as blocks change state ----------------------------------
    def released(self, block_id: int) -> None:
        """A cached block lost its last holder: it becomes cached-free (evictable)."""
        ...

    def revived(self, block_id: int) -> None:
        """A cached-free block gained a holder: no longer evictable."""
        ...

    def evict(self, with_entry: bool = False) -> tuple[int, CacheEntry | None]:
        """Forget one cached-free block, the policy's next victim, and return it (the
        allocator hands it out) with, when ``with_entry``, what it cached (a host tier files
        the block under it; else None). Only called while ``num_evictable > 0``."""
        ...

    def reset(self) -> list[int]:
        """Forget every cached-free block; return them (they become plain free)."""
        ...

    # ---- state -------------------------------------------------------------------------
    def is_cached(self, block_id: int) -> bool: ...

    def entry(self, block_id: int) -> CacheEntry | None:
        """The tokens a cached block holds and the chained hashes naming it (None if not cached)."""
        ...

    @property
    def num_cached_blocks(self) -> int: ...

    @property
    def num_evictable(self) -> int:
        """Cached blocks with no holder: the allocator counts them as free."""
        ...

    def evictable_blocks(self) -> set[int]: ...

    def check(self) -> None:
        """Assert the policy's invariants against the allocator's counts (tests call it)."""
        ...

