"""Block hashes for automatic prefix caching.

A full block is identified by its tokens *and everything before them*: the K and V of a
token depend on the whole prefix, so two blocks with equal tokens but different prefixes
hold different KV. The hash of block ``i`` therefore chains over the hash of block ``i-1``:

    h_0 = H(ROOT_HASH, tokens_0),   h_i = H(h_{i-1}, tokens_i)

Equal hashes mean equal prefixes (up to the hash's collision odds, 2^-128 with BLAKE2b-128).
The allocator also compares the block's tokens and parent hash on every hit, so two
different blocks whose own hashes collide never share KV. A collision between two
*ancestors'* hashes is not caught (the parent is known by its hash only): there the chain
trusts the 128-bit hash, as vLLM trusts its own.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Iterator, Sequence

ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """The chained hash of one full block: 128 bits of BLAKE2b over (parent, tokens)."""
    h = hashlib.blake2b(parent_hash.to_bytes(16, "little"), digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def hash_full_blocks(token_ids: Sequence[int], block_size: int,
                     max_tokens: int | None = None) -> Iterator[tuple[int, int, tuple[int, ...]]]:
    """Walk the chain: yield ``(hash, parent hash, tokens)`` of each full block within the
    first ``max_tokens`` tokens (all of them when None), in order. A partial tail is not
    hashed: only full blocks are ever shared. Lazy, so a lookup that misses at block ``i``
    hashes no further."""
    limit = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
    parent = ROOT_HASH
    for start in range(0, limit - block_size + 1, block_size):
        block = tuple(token_ids[start:start + block_size])
        block_hash = hash_block(parent, block)
        yield block_hash, parent, block
        parent = block_hash


def hash_prefix(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of every full block of ``token_ids`` (a partial tail is not hashed)."""
    return [block_hash for block_hash, _, _ in hash_full_blocks(token_ids, block_size)]
