"""Block hashes for automatic prefix caching.

A full block is identified by its tokens *and everything before them*: the K and V of a
token depend on the whole prefix, so two blocks with equal tokens but different prefixes
hold different KV. The hash of block ``i`` therefore chains over the hash of block ``i-1``:

    h_0 = H(ROOT_HASH, tokens_0),   h_i = H(h_{i-1}, tokens_i)

Equal hashes mean equal prefixes (up to the hash's collision odds, 2^-128 with BLAKE2b-128).

A *salt* (vLLM's ``cache_salt``) starts a chain somewhere else: a salted prompt's first
block hangs off ``root_hash(salt)`` instead of ``ROOT_HASH``, so every block of the chain
hashes differently, and two requests share cached blocks only if they carry the same salt
(or none). A server with API keys salts each request with its key, so one student can
never hit, and time, another student's cached prompt.
The allocator also compares the block's tokens and parent hash on every hit, so two
different blocks whose own hashes collide never share KV. A collision between two
*ancestors'* hashes is not caught (the parent is known by its hash only): there the chain
trusts the 128-bit hash, as vLLM trusts its own.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

from .policy import POLICIES, match_limit, prefix_cache_policy  # noqa: F401 (re-exported: they lived here)

if TYPE_CHECKING:   # type hints only: the allocator imports this module
    from .allocator import BlockAllocator
    from .block_table import BlockTable

ROOT_HASH = 0


def root_hash(salt: str | None = None) -> int:
    """The parent hash of a prompt's first block: ``ROOT_HASH`` without a salt, else 128
    bits of BLAKE2b over the salt (personalised, so no block hash can equal it by design)."""
    if salt is None:
        return ROOT_HASH
    h = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16, person=b"labkit-salt")
    return int.from_bytes(h.digest(), "little")



@dataclass(slots=True)
class CacheEntry:
    """What the prefix cache remembers about a full block: its chained hash and its tokens.

    The tokens are kept so that a hit is confirmed by comparison, never trusted to the hash
    alone (two different blocks with the same hash must not share KV).
    """

    block_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """The chained hash of one full block: 128 bits of BLAKE2b over (parent, tokens)."""
    h = hashlib.blake2b(parent_hash.to_bytes(16, "little"), digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def hash_full_blocks(token_ids: Sequence[int], block_size: int, max_tokens: int | None = None,
                     salt: str | None = None, *, first_block: int = 0,
                     parent_hash: int | None = None) -> Iterator[tuple[int, int, tuple[int, ...]]]:
    """Walk the chain: yield ``(hash, parent hash, tokens)`` of each full block within the
    first ``max_tokens`` tokens (all of them when None), in order, starting from
    ``root_hash(salt)``; or from block ``first_block`` on, ``parent_hash`` being the hash of
    the block before it (a table extending the chain it has). A partial tail is not hashed:
    only full blocks are ever shared. Lazy, so a lookup that misses at block ``i`` hashes no
    further. The one walk of the chain: lookups, publication and ``RadixTree.entry`` use it."""
    limit = match_limit(len(token_ids), max_tokens)
    parent = root_hash(salt) if parent_hash is None else parent_hash
    for start in range(first_block * block_size, limit - block_size + 1, block_size):
        block = tuple(token_ids[start:start + block_size])
        block_hash = hash_block(parent, block)
        yield block_hash, parent, block
        parent = block_hash


def hash_prefix(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """The chained hashes of every full block of ``token_ids`` (a partial tail is not hashed)."""
    return [block_hash for block_hash, _, _ in hash_full_blocks(token_ids, block_size, salt=salt)]


class HashPrefixCache:
    """vLLM's automatic prefix caching, the allocator's ``"hash"`` policy.

    Each full, computed block is filed under its chained hash; a prompt reuses the blocks of
    its hash chain up to the first miss. Unreferenced cached blocks wait in one LRU queue
    (oldest first) and any of them may be evicted, whatever its position in a prefix.
    Per block table it keeps ``table.block_hashes``, the chain so far.
    """

    policy = "hash"

    def __init__(self, allocator: BlockAllocator):
        self._alloc = allocator
        self.block_size = allocator.block_size
        self._lru: OrderedDict[int, None] = OrderedDict()   # cached-free blocks, oldest first
        self._entries: dict[int, CacheEntry] = {}          # block id -> what it caches
        self._by_hash: dict[int, int] = {}                 # block hash -> block id

    # ---- the hash policy's own operations: one block, by its hash ---------------------
    def peek(self, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The block cached under ``block_hash`` if it holds exactly these tokens after this
        parent, else None. Changes nothing."""
        block_id = self._by_hash.get(block_hash)
        if block_id is None:
            return None
        entry = self._entries[block_id]
        if entry.parent_hash != parent_hash or entry.token_ids != token_ids:
            return None   # a hash collision: never share KV on the hash alone
        return block_id

    def lookup(self, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """``peek``, and on a hit the caller becomes a holder (a cached-free block is revived).
        Counted in the allocator's hit rate. Returns the block id, or None on a miss."""
        block_id = self.peek(block_hash, parent_hash, token_ids)
        self._alloc.record_lookups(1, block_id is not None)
        if block_id is not None:
            self._alloc.hold_cached(block_id)
        return block_id

    def register(self, block_id: int, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]) -> bool:
        """File a full, held block under its chained hash. Returns whether it was added: a
        block whose hash is already cached elsewhere stays private (the first one wins)."""
        if self._alloc.ref_count(block_id) == 0:
            raise ValueError(f"block {block_id} is free; only held blocks can be cached")
        if block_hash in self._by_hash or block_id in self._entries:
            return False
        self._entries[block_id] = CacheEntry(block_hash, parent_hash, token_ids)
        self._by_hash[block_hash] = block_id
        return True

    # ---- the policy contract (``policy.PrefixCachePolicy``) -----------------------------
    def match(self, token_ids: Sequence[int], max_tokens: int | None = None, salt: str | None = None) -> list[int]:
        """The cached blocks of the prompt's hash chain (from ``root_hash(salt)``), up to
        the first miss. Changes nothing."""
        hits = []
        for block_hash, parent, block in hash_full_blocks(token_ids, self.block_size, max_tokens, salt):
            block_id = self.peek(block_hash, parent, block)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def acquire(self, token_ids: Sequence[int], max_tokens: int | None = None, salt: str | None = None) -> list[int]:
        """``match``, and every block found gains a holder."""
        blocks = self.match(token_ids, max_tokens, salt)
        for block_id in blocks:
            self._alloc.hold_cached(block_id)
        return blocks

    def reused(self, table: BlockTable) -> None:
        """``table`` was just filled by ``acquire``: its hash chain is the blocks' hashes."""
        table.block_hashes = [self._entries[b].block_hash for b in table.block_ids]

    def publish(self, table: BlockTable, num_computed_tokens: int) -> None:
        """File every full block within the first ``num_computed_tokens`` tokens of
        ``table`` under its chained hash (from ``root_hash(table.salt)``), in order (a block
        already filed elsewhere under the same hash stays private: the first one wins)."""
        chain = table.block_hashes
        for block_hash, parent, block in hash_full_blocks(
                table.token_ids, self.block_size, num_computed_tokens, table.salt,
                first_block=len(chain), parent_hash=chain[-1] if chain else None):
            self.register(table.block_ids[len(chain)], block_hash, parent, block)
            chain.append(block_hash)

    # ---- state and eviction -----------------------------------------------------------
    def is_cached(self, block_id: int) -> bool:
        return block_id in self._entries

    def entry(self, block_id: int) -> CacheEntry | None:
        return self._entries.get(block_id)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._entries)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def released(self, block_id: int) -> None:
        """A cached block lost its last holder: most recently used end of the LRU."""
        self._lru[block_id] = None

    def revived(self, block_id: int) -> None:
        del self._lru[block_id]

    def evict(self, with_entry: bool = False) -> tuple[int, CacheEntry | None]:
        """Forget the least recently released cached block; return it and what it cached."""
        block_id, _ = self._lru.popitem(last=False)
        entry = self._forget(block_id)
        return block_id, entry if with_entry else None

    def reset(self) -> list[int]:
        """Forget every unreferenced cached block; return them, oldest first."""
        freed = list(self._lru)
        self._lru.clear()
        for block_id in freed:
            self._forget(block_id)
        return freed

    def evictable_blocks(self) -> set[int]:
        return set(self._lru)

    def check(self) -> None:
        for block_id in self._lru:
            assert block_id in self._entries, f"cached-free block {block_id} has no cache entry"
        for block_hash, block_id in self._by_hash.items():
            assert self._entries[block_id].block_hash == block_hash
        assert len(self._by_hash) == len(self._entries)

    def _forget(self, block_id: int) -> CacheEntry:
        entry = self._entries.pop(block_id)
        del self._by_hash[entry.block_hash]
        return entry

    def _state(self) -> tuple:
        return list(self._lru), dict(self._entries), dict(self._by_hash)

    def __eq__(self, other: object) -> bool:
        """Same cached blocks, same hashes, same LRU order (tests compare snapshots)."""
        if not isinstance(other, HashPrefixCache):
            return NotImplemented
        return self._state() == other._state()

    __hash__ = None   # mutable
