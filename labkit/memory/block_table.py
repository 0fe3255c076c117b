"""A sequence's block table: logical blocks -> physical blocks, filled as tokens arrive.

Logical block ``i`` of a sequence holds its tokens ``[i * block_size, (i + 1) * block_size)``;
``block_ids[i]`` says which physical block stores their K and V. The slot of token ``t``
is ``block_ids[t // block_size] * block_size + t % block_size``: the executor writes the
token's K/V there and the attention kernel reads it back by following the same table.

Blocks are allocated on demand, one when the previous one is full, so a sequence wastes
less than one block. ``fork`` shares every block with a child (reference counts up);
appending into a shared, partly filled last block first copies it (copy-on-write) and
reports ``(src, dst)`` so the executor can copy the KV data. Full blocks are never written
again, so only the last block can ever need a copy.

A table owns its ``block_ids`` and ``token_ids``; the allocator owns the blocks' reference
counts (the table changes them only through ``allocate``, ``incref``, ``hold_cached`` and
``free``). The prefix-cache policy keeps its per-table state here (``block_hashes``,
``num_published_blocks``) and changes ``block_ids`` only through ``adopt_cached_block``.
The scheduler grows tables through ``BlockManager.allocate_slots``, which counts with the
same two rules as ``blocks_needed`` below (``blocks_to_add``, ``copies_on_write``).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from labkit.utils import cdiv

from .allocator import BlockAllocator, NoFreeBlocksError

CopyOnWrite = tuple[int, int]   # (source block id, destination block id)


def blocks_to_add(num_tokens: int, num_blocks: int, block_size: int) -> int:
    """Blocks a table holding ``num_blocks`` must add to hold ``num_tokens`` tokens (0 if it can)."""
    return max(0, cdiv(num_tokens, block_size) - num_blocks)


def copies_on_write(num_writers: int, num_holders: int) -> int:
    """Block copies made when ``num_writers`` tables write into one partly filled block that
    ``num_holders`` tables hold (the writers among them). A writer copies the block while
    another table still holds it: so all of them do when a holder outside them remains,
    and all but the last otherwise (it finds the block its own by then)."""
    return num_writers if num_holders > num_writers else num_writers - 1


class BlockTable:
    """One sequence's map from logical to physical KV blocks.

    Invariants: ``len(block_ids) == ceil(num_tokens / block_size)``; the table writes only
    into its last block, and only when it is the block's sole holder (reference count 1).
    """

    __slots__ = ("allocator", "block_size", "block_ids", "token_ids", "block_hashes",
                 "num_published_blocks", "num_cached_tokens", "freed", "salt")

    def __init__(self, allocator: BlockAllocator, salt: str | None = None):
        self.allocator = allocator
        # The prefix cache's namespace (vLLM's ``cache_salt``): this table reuses and
        # publishes cached blocks only among tables with the same salt (None: the shared one).
        self.salt = salt
        self.block_size = allocator.block_size
        self.block_ids: list[int] = []
        self.token_ids: list[int] = []      # the tokens that have a slot, in order
        # The prefix-cache policy's per-table state, written by the policy only:
        self.block_hashes: list[int] = []   # chained hashes of the full blocks (hash prefix cache)
        self.num_published_blocks = 0       # leading blocks inserted in the radix tree (radix cache)
        self.num_cached_tokens = 0          # leading tokens whose KV came from the prefix cache
        self.freed = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def num_free_slots(self) -> int:
        """Allocated slots not holding a token: the last block's tail (internal
        fragmentation), plus any blocks reserved ahead of time by ``reserve``."""
        return len(self.block_ids) * self.block_size - len(self.token_ids)

    def slot(self, position: int) -> int:
        """The physical slot of the token at ``position``."""
        block, offset = divmod(position, self.block_size)
        return self.block_ids[block] * self.block_size + offset

    def blocks_needed(self, num_new_tokens: int) -> int:
        """How many blocks ``append_tokens`` of that many tokens would take from the pool,
        counting the copy of a shared last block. Changes nothing. (One table's case of
        ``BlockManager.blocks_needed``, by the same two rules.)"""
        if num_new_tokens <= 0:
            return 0
        partial = self.partial_block()
        cow = 0 if partial is None else copies_on_write(1, self.allocator.ref_count(partial))
        return blocks_to_add(len(self.token_ids) + num_new_tokens, len(self.block_ids), self.block_size) + cow

    def partial_block(self) -> int | None:
        """The partly filled block the next token goes into, or None when the next token
        starts a new block: the only block a write may have to copy first."""
        n = len(self.token_ids)
        return self.block_ids[n // self.block_size] if n % self.block_size else None

    # ---- prefix caching ------------------------------------------------------------
    def reuse_cached_prefix(self, token_ids: Sequence[int], max_tokens: int | None = None) -> int:
        """On an empty table, take the cached full blocks that begin ``token_ids``.

        Only whole blocks within the first ``max_tokens`` tokens are matched (the scheduler
        passes ``len(prompt) - 1``: the last prompt token must be computed to get logits).
        Returns the number of tokens whose KV is reused; they need no compute. The table now
        holds those blocks: a caller that then gives up on it must ``free()`` it.
        Whichever policy caches (hash or radix), the answer is the same kind: whole blocks.
        """
        self._check_live()
        if self.token_ids:
            raise ValueError("reuse_cached_prefix works on an empty block table only")
        cache = self.allocator.prefix_cache
        if cache is None:
            return 0
        blocks = self.allocator.acquire_cached_prefix(token_ids, max_tokens, self.salt)
        self.block_ids = blocks
        self.token_ids = list(token_ids[:len(blocks) * self.block_size])
        cache.reused(self)
        self.num_cached_tokens = len(self.token_ids)
        return self.num_cached_tokens

    def peek_cached_prefix(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """The cached blocks ``reuse_cached_prefix`` would take, without taking anything.
        (The scheduler uses it to count what admitting a request would cost.)"""
        cache = self.allocator.prefix_cache
        return [] if cache is None else cache.match(token_ids, max_tokens, self.salt)

    # ---- growth ------------------------------------------------------------------
    def append_tokens(self, token_ids: Iterable[int], computed: bool = True) -> list[CopyOnWrite]:
        """Give each new token a slot, allocating blocks as the last one fills.

        Returns the copy-on-write copies made (at most one: the shared last block). Either
        every token gets a slot or, when the pool is short, ``NoFreeBlocksError`` is raised
        and nothing changes.

        With prefix caching, blocks this append fills are published to the cache at once
        when ``computed`` (their K/V is already there). The scheduler appends *before* the
        model computes the K/V, so it passes ``computed=False`` and calls
        ``cache_computed_blocks`` after the iteration: a block must never be shared
        before its K/V exists.
        """
        if self.freed:
            raise ValueError("this block table was freed; create a new one")
        new = token_ids if isinstance(token_ids, list) else list(token_ids)
        if not new:
            return []
        alloc, bs = self.allocator, self.block_size
        start = len(self.token_ids)
        end = start + len(new)
        need = self.blocks_needed(len(new))
        if need > alloc.num_free_blocks:
            raise NoFreeBlocksError(
                f"appending {len(new)} tokens needs {need} blocks, only {alloc.num_free_blocks} are free")
        copies: list[CopyOnWrite] = []
        src = self.partial_block()
        if src is not None and copies_on_write(1, alloc.ref_count(src)):
            # Copy-on-write: another table holds our partly filled last block. Writing into
            # it would change their sequence, so we take a private copy and drop our share.
            dst = alloc.allocate()
            alloc.free(src)
            self.block_ids[start // bs] = dst
            copies.append((src, dst))
        for _ in range(blocks_to_add(end, len(self.block_ids), bs)):
            self.block_ids.append(alloc.allocate())
        self.token_ids.extend(new)
        for b in range(start // bs, (end - 1) // bs + 1):
            alloc.set_fill(self.block_ids[b], min(bs, end - b * bs))
        if computed:
            self.cache_computed_blocks(end)
        return copies

    def cache_computed_blocks(self, num_computed_tokens: int) -> None:
        """Publish to the prefix cache every full block within the first
        ``num_computed_tokens`` tokens (those whose K/V has been written), in order.

        Hash policy: each block is filed under a hash chained on the previous one's. Radix
        policy: the blocks are inserted as a path of the tree; where the tree already holds
        a block for the same prefix (computed by another request at the same time), this
        table switches to the tree's block and its own copy returns to the pool, so
        ``block_ids`` of full, published blocks may change here (never their K/V's meaning).
        """
        cache = self.allocator.prefix_cache
        if cache is not None:
            cache.publish(self, num_computed_tokens)

    def reserve(self, num_tokens: int) -> None:
        """Allocate, now, every block needed to hold ``num_tokens`` tokens in all.

        This is what static batching does: reserve a request's maximum length up front.
        Paged serving never calls it; the unfilled reserved slots are the waste that
        on-demand allocation avoids. Raises ``NoFreeBlocksError`` (changing nothing) when
        the pool is short.
        """
        self._check_live()
        need = blocks_to_add(num_tokens, len(self.block_ids), self.block_size)
        if need > self.allocator.num_free_blocks:
            raise NoFreeBlocksError(f"reserving {num_tokens} tokens needs {need} more blocks, "
                                    f"only {self.allocator.num_free_blocks} are free")
        for _ in range(need):
            self.block_ids.append(self.allocator.allocate())

    def truncate(self, num_tokens: int, free_empty_blocks: bool = True) -> None:
        """Give back the slots of every token after the first ``num_tokens``: tokens that got
        slots for a step but are not kept (drafted tokens the model rejected: jump-forward
        decoding, speculative decoding). Blocks left empty return to the pool, unless
        ``free_empty_blocks`` is False (a reservation made ahead, as static batching does,
        keeps them). Only slots whose K/V was never published may go: a block already in
        the prefix cache is full and kept whole."""
        self._check_live()
        if not 0 <= num_tokens <= len(self.token_ids):
            raise ValueError(f"truncate({num_tokens}): the table holds {len(self.token_ids)} tokens")
        bs, alloc = self.block_size, self.allocator
        published = max(len(self.block_hashes), self.num_published_blocks) * bs
        if num_tokens < published:
            raise ValueError(f"truncate({num_tokens}): the first {published} tokens' blocks are in the prefix cache")
        old = len(self.token_ids)
        del self.token_ids[num_tokens:]
        keep, had = cdiv(num_tokens, bs), cdiv(old, bs)
        if num_tokens % bs:
            alloc.set_fill(self.block_ids[keep - 1], num_tokens % bs)
        for b in self.block_ids[keep:had]:
            alloc.set_fill(b, 0)
        if free_empty_blocks:
            # Every block past the kept tokens is empty now, including blocks allocated ahead
            # for slots that were never filled (a step's lookahead for guessed tokens).
            for b in self.block_ids[keep:]:
                alloc.free(b)
            del self.block_ids[keep:]

    def adopt_cached_block(self, index: int, block_id: int) -> None:
        """Hold the prefix cache's ``block_id`` as logical block ``index``, in place of this
        table's own copy of the same tokens, which goes back to the pool. The radix policy
        does this when two tables computed the same prefix at once: the tokens, and so the
        K/V, are the same; only where they live changes."""
        own = self.block_ids[index]
        self.allocator.hold_cached(block_id)
        self.allocator.free(own)
        self.block_ids[index] = block_id

    # ---- sharing and release -------------------------------------------------------
    def fork(self) -> "BlockTable":
        """A child table that shares every block with this one (reference counts go up).
        The first of the two to append into the shared last block copies it."""
        self._check_live()
        if len(self.block_ids) * self.block_size - len(self.token_ids) >= self.block_size:
            # Blocks reserved ahead of the tokens would be shared empty, and copy-on-write
            # only guards the block being filled: both tables would write the next ones.
            raise ValueError("cannot fork a table holding reserved blocks ahead of its tokens")
        child = BlockTable(self.allocator, self.salt)
        for block_id in self.block_ids:
            self.allocator.incref(block_id)
        child.block_ids = list(self.block_ids)
        child.token_ids = list(self.token_ids)
        child.block_hashes = list(self.block_hashes)
        child.num_published_blocks = self.num_published_blocks
        child.num_cached_tokens = self.num_cached_tokens
        return child

    def copy_to(self, dst: BlockAllocator,
                moved: dict[int, int]) -> tuple["BlockTable", list[CopyOnWrite]]:
        """A table holding this table's tokens on blocks of ``dst`` (the other pool: swapping
        out to the host, or back in), and the ``(source block, destination block)`` copies that
        fill them. ``moved`` maps source blocks already copied in the same move: a block shared
        by several tables is copied once and its copy shared by reference count; it gains the
        new copies. This table is left as it is (its caller frees it). The new table republishes
        its full blocks to ``dst``'s prefix cache only once they hold KV there
        (``cache_computed_blocks``)."""
        self._check_live()
        new = BlockTable(dst, self.salt)
        pairs: list[CopyOnWrite] = []
        for src in self.block_ids:
            to = moved.get(src)
            if to is None:
                to = moved[src] = dst.allocate()
                pairs.append((src, to))
            else:
                dst.incref(to)
            dst.set_fill(to, self.allocator.fill(src))
            new.block_ids.append(to)
        new.token_ids = list(self.token_ids)
        new.num_cached_tokens = self.num_cached_tokens
        return new, pairs

    def free(self) -> None:
        """Let go of every block; the table cannot be used afterwards.

        Blocks are released last-first, so that with prefix caching the LRU evicts a
        sequence's tail before its head (heads are the prefixes others are likely to share).
        """
        if self.freed:
            raise ValueError("double free: this block table was already freed")
        for block_id in reversed(self.block_ids):
            self.allocator.free(block_id)
        self.block_ids = []
        self.freed = True

    def _check_live(self) -> None:
        if self.freed:
            raise ValueError("this block table was freed; create a new one")

    def __repr__(self) -> str:
        return f"BlockTable(tokens={len(self.token_ids)}, blocks={self.block_ids})"
