"""SGLang's RadixAttention prefix cache: cached prefixes kept in a radix tree of blocks.

The hash cache (``prefix_cache.py``) remembers each full block under a hash chained over
everything before it; a lookup walks the prompt block by block. The radix tree stores the
same knowledge as a tree: each edge is a run of tokens and the physical blocks holding their
K/V, and a prompt's cached prefix is the path it matches from the root. Both designs keep
the same blocks in the same allocator; they differ in what they can see and in what they
evict:

* **matching** walks the tree by token comparison (no hashing); a follow-up turn of a chat,
  a few-shot prompt, a branch of a tree-of-thought all find their shared prefix as one path;
* **eviction** takes the least recently used *leaf* first, so a prefix stays as long as
  something cached below it does (the hash cache's LRU may drop a system prompt's block and
  keep the orphaned blocks after it: no lookup reaches them until a request computes that
  block again, and then, content-addressed, they are found again);
* **insertion** publishes a sequence's computed blocks as one path, at every chunk boundary
  of its prefill and as its decode fills blocks: requests running at the same time share.

Page granularity (the choice made here): a node's tokens are always a whole number of
blocks, so a match, a split and an eviction all happen on block boundaries, and a block is
shared whole or not at all. SGLang's default page size is 1 token: a node may end anywhere
and a prompt reuses every token it shares, at the price of a slot-level allocator. With
``page_size > 1`` SGLang also matches whole pages only (it truncates the key to a multiple of
the page size), which is what labkit does with its blocks: a prompt reuses at most
``floor(shared / block_size) * block_size`` tokens (and, as for the hash cache, never its last
token, whose logits must be computed).

Invariants the tree keeps with its allocator (``check`` asserts them):

* every block in the tree is held by exactly one node, at the position of its tokens;
* all blocks of a node have the same reference count, the number of sequences holding that
  node (``ref_count(node)``): a match ending inside a node splits it first;
* a sequence holding a node holds every node above it, so reference counts never grow
  going down a path and every unreferenced cached block can be reached by evicting leaves;
  when a sequence publishes a block the tree already holds (two requests computed the same
  prefix at once), it switches to the tree's block and gives its own copy back (SGLang does
  the same), so the prefix is stored once;
* blocks may be shared before they are published (a fork before publishing; n > 1 samples
  or beams swapped back in together, ``BlockTable.copy_to``). Tables share only prefixes,
  so the holders of a sequence's unpublished blocks only ever drop out along it: ``publish``
  makes one node per run of equal reference counts, and never switches a *shared* copy for
  the tree's block (its other holders would keep it, below a path they do not hold): that
  sequence publishes nothing further until its copy is its own (or the tree's is evicted);
* only unreferenced leaves are evicted, least recently used first, one block at a time from
  the leaf's end (the allocator asks for one block at a time).

Nodes split, never merge (as in SGLang); a leaf that the same sequences extend grows in
place instead of gaining a one-block child, so a long decode stays one node.

Salts (vLLM's ``cache_salt``; a server with API keys salts each request with its key): each
salt has a tree of its own, under a root of its own, and a table walks and publishes only
in its salt's tree (``BlockTable.salt``). Trees are known by the salt's hash
(``root_hash``, 128 bits: what the hash cache chains from), so no salt string is kept.
``root`` is the tree of unsalted requests; a salt's root is made when its first block is
published and dropped when its last one is evicted.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

from .policy import match_limit
from .prefix_cache import ROOT_HASH, CacheEntry, hash_full_blocks, root_hash

if TYPE_CHECKING:   # memory knows its allocator; the import is for type hints only
    from .allocator import BlockAllocator
    from .block_table import BlockTable


@dataclass(slots=True, eq=False)
class RadixNode:
    """One edge of the tree: a run of whole blocks and the physical blocks holding their K/V.

    ``children`` are keyed by the tokens of their first block (siblings differ there).
    ``hit_count``: how many prompts reused (part of) this node; ``last_access``: the tree's
    logical clock when a request last matched, published or let go of it (LRU order).
    """

    token_ids: tuple[int, ...]
    block_ids: list[int]
    parent: RadixNode | None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    hit_count: int = 0
    last_access: int = 0
    id: int = 0                 # creation order: a stable name, and the LRU's tie-break
    root_hash: int = ROOT_HASH  # a root's namespace: its salt's hash (prefix_cache.root_hash)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return (f"RadixNode(id={self.id}, tokens={len(self.token_ids)}, blocks={self.block_ids}, "
                f"children={len(self.children)}, hits={self.hit_count}, last_access={self.last_access})")


class RadixTree:
    """The radix-tree prefix-cache policy of a ``BlockAllocator`` (``allocator.radix``).

    The allocator owns the blocks and their reference counts; the tree says which cached
    blocks hold which prefix, and which one to evict next. Read-only view for widgets:
    ``root``, ``nodes()``, ``ref_count(node)``, ``evictable_leaves()``, ``num_evictions``;
    ``match_prefix`` answers what a prompt would reuse without changing anything.
    """

    policy = "radix"

    def __init__(self, allocator: BlockAllocator):
        self._alloc = allocator
        self._refs = allocator.ref_counts           # the allocator's counts (a read-only view)
        self.block_size = allocator.block_size
        self.root = RadixNode((), [], None)
        self._roots: dict[int, RadixNode] = {ROOT_HASH: self.root}     # one tree per salt, by its hash
        self._node_of: dict[int, RadixNode] = {}     # block id -> the node holding it
        self._num_unreferenced = 0                   # cached blocks with reference count 0
        # (last_access, id, push number, leaf): candidate victims, stale entries skipped on pop.
        self._heap: list[tuple[int, int, int, RadixNode]] = []
        self._pushes = 0
        self._clock = 0
        self._next_id = 1
        self.num_evictions = 0          # blocks evicted to make room (reset_prefix_cache not counted)
        self.num_deduplicated = 0       # private copies given back for the tree's block

    # ---- read-only view ---------------------------------------------------------------
    def ref_count(self, node: RadixNode) -> int:
        """How many sequences hold ``node`` (all its blocks share this count); 0 for the root."""
        return self._refs[node.block_ids[-1]] if node.block_ids else 0

    def nodes(self) -> Iterator[RadixNode]:
        """Every node, root first, in pre-order (children in insertion order); then each
        salt's tree the same way."""
        stack = list(reversed(self._roots.values()))
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(list(node.children.values())))

    def evictable_leaves(self) -> list[RadixNode]:
        """The unreferenced leaves, in eviction order: the next victim first (least recently
        used; ties go to the older node). Eviction takes the victim's last block."""
        leaves = [n for n in self.nodes() if self._evictable(n)]
        return sorted(leaves, key=lambda n: (n.last_access, n.id))

    @property
    def num_cached_blocks(self) -> int:
        return len(self._node_of)

    @property
    def num_evictable(self) -> int:
        """Cached blocks nobody holds: all can be evicted, leaves first."""
        return self._num_unreferenced

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._node_of

    def node_of(self, block_id: int) -> RadixNode | None:
        return self._node_of.get(block_id)

    def entry(self, block_id: int) -> CacheEntry | None:
        """The block's tokens and the chained hashes the hash cache would file it under
        (derived from its path: the tree itself keeps no hashes)."""
        node = self._node_of.get(block_id)
        if node is None:
            return None
        path = self._path_tokens(node)
        bs = self.block_size
        end = len(path) - len(node.token_ids) + (node.block_ids.index(block_id) + 1) * bs
        top = node
        while top.parent is not None:
            top = top.parent
        *_, (block_hash, parent, block) = hash_full_blocks(path[:end], bs, parent_hash=top.root_hash)
        return CacheEntry(block_hash, parent, block)

    def match_prefix(self, token_ids: Sequence[int], max_tokens: int | None = None,
                     salt: str | None = None) -> tuple[int, list[int]]:
        """``(num_tokens, block_ids)``: the longest cached whole-block prefix of ``token_ids``
        (within the first ``max_tokens`` tokens, in ``salt``'s tree). Changes nothing."""
        blocks = self.match(token_ids, max_tokens, salt)
        return len(blocks) * self.block_size, blocks

    # ---- the policy contract (``policy.PrefixCachePolicy``) -----------------------------
    def match(self, token_ids: Sequence[int], max_tokens: int | None = None, salt: str | None = None) -> list[int]:
        """The blocks of the longest cached whole-block prefix (in ``salt``'s tree). Changes nothing."""
        blocks: list[int] = []
        for node, k in self._walk(token_ids, max_tokens, salt):
            blocks += node.block_ids[:k]
        return blocks

    def acquire(self, token_ids: Sequence[int], max_tokens: int | None = None, salt: str | None = None) -> list[int]:
        """Take the longest cached prefix for a new sequence (in ``salt``'s tree): every
        matched block gains a holder (the allocator's count), matched nodes are touched and
        counted as hits. A match ending inside a node splits it, so that the sequence holds
        whole nodes."""
        path = self._walk(token_ids, max_tokens, salt)
        if not path:
            return []
        self._clock += 1
        node, k = path[-1]
        if k < len(node.block_ids):
            path[-1] = (self._split(node, k), k)
        blocks: list[int] = []
        for node, _ in path:
            node.hit_count += 1
            node.last_access = self._clock
            for b in node.block_ids:
                self._alloc.hold_cached(b)
            blocks += node.block_ids
        return blocks

    def reused(self, table: BlockTable) -> None:
        """``table`` was just filled with blocks from ``acquire``: they are all in the tree."""
        table.num_published_blocks = len(table.block_ids)

    def publish(self, table: BlockTable, num_computed_tokens: int) -> None:
        """Insert the table's full blocks within its first ``num_computed_tokens`` tokens
        (their K/V is written) as a path. Where the tree already holds a block for the same
        prefix, the table switches to it and its own copy goes back to the pool; unless other
        tables share that copy: then publication stops there, and the next call retries
        (``table.num_published_blocks`` says how far it got)."""
        bs = self.block_size
        upto = num_computed_tokens // bs
        if upto <= table.num_published_blocks:
            return
        self._clock += 1
        tokens, ids = table.token_ids, table.block_ids
        key = root_hash(table.salt)
        node, i = self._roots.get(key), 0
        if node is None:                           # the salt's first block: its tree begins
            node = self._roots[key] = RadixNode((), [], None, id=self._new_id(), root_hash=key)
        while i < upto:
            child = node.children.get(tuple(tokens[i * bs:(i + 1) * bs]))
            if child is None:
                break
            if ids[i] != child.block_ids[0] and self._refs[ids[i]] > 1:
                # Our copy is shared with tables that have not published it (n > 1 samples or
                # beams back from a swap, a fork before publishing). Switching to the tree's
                # block alone would leave them holding blocks below a path they do not hold.
                # Stop: the prefix is cached already; we publish once our copy is ours alone.
                # (A node's first block tells: if it is the tree's we hold the whole node, and
                # if our copy of it is private, so are the ones after it.)
                upto = i
                break
            k = self._common_blocks(child, tokens, i * bs, upto * bs)
            if k < len(child.block_ids):
                child = self._split(child, k)
            for j, tree_block in enumerate(child.block_ids):
                if ids[i + j] != tree_block:    # the same prefix computed twice: keep the tree's copy
                    table.adopt_cached_block(i + j, tree_block)
                    self.num_deduplicated += 1
            child.last_access = self._clock
            node, i = child, i + k
        # The new blocks, as nodes of blocks with the same holders. Whoever holds a block
        # holds every block before it (tables share prefixes), so along the table the holders
        # only ever drop out: a run of equal reference counts is a run of the same holders.
        while i < upto:
            count = self._refs[ids[i]]
            end = i + 1
            while end < upto and self._refs[ids[end]] == count:
                end += 1
            new_blocks, new_tokens = ids[i:end], tuple(tokens[i * bs:end * bs])
            if node.parent is not None and node.is_leaf and self.ref_count(node) == count:
                node.token_ids += new_tokens        # the same holders extend their leaf
                node.block_ids += new_blocks
            else:
                node = self._add_child(node, new_tokens, list(new_blocks))
            node.last_access = self._clock
            for b in new_blocks:
                self._node_of[b] = node
            i = end
        table.num_published_blocks = i

    def released(self, block_id: int) -> None:
        """A cached block lost its last holder: it stays cached, now evictable."""
        self._num_unreferenced += 1
        node = self._node_of[block_id]
        self._clock += 1
        node.last_access = self._clock
        self._push_if_evictable(node)      # (re)queued at its new time; older entries go stale

    def revived(self, block_id: int) -> None:
        """An unreferenced cached block gained a holder (a hit): no longer evictable."""
        self._num_unreferenced -= 1

    def evict(self, with_entry: bool = False) -> tuple[int, CacheEntry | None]:
        """Forget the last block of the least recently used unreferenced leaf, and return it
        (the allocator hands it out) with, when ``with_entry``, the hash chain naming it
        (``entry``: a host tier files it under that). Only called while ``num_evictable > 0``."""
        while True:
            if not self._heap:
                raise RuntimeError(f"radix tree: {self._num_unreferenced} unreferenced cached blocks but no "
                                   "evictable leaf (a block was shared outside its path: the invariant broke)")
            last_access, _, _, node = heapq.heappop(self._heap)
            if self._evictable(node) and node.last_access == last_access:
                break
        key = node.token_ids[:self.block_size]
        entry = self.entry(node.block_ids[-1]) if with_entry else None
        block_id = node.block_ids.pop()
        node.token_ids = node.token_ids[:-self.block_size]
        del self._node_of[block_id]
        self._num_unreferenced -= 1
        self.num_evictions += 1
        if node.block_ids:
            self._push_if_evictable(node)
        else:
            parent = node.parent
            del parent.children[key]
            node.parent = None
            if parent.parent is None and parent is not self.root and not parent.children:
                del self._roots[parent.root_hash]  # the salt's last cached block is gone
            self._push_if_evictable(parent)
        return block_id, entry

    def reset(self) -> list[int]:
        """Forget every unreferenced cached block (leaves first). Returns them; the
        eviction counter does not move (nothing was needed)."""
        before, freed = self.num_evictions, []
        while self._num_unreferenced:
            freed.append(self.evict()[0])
        self.num_evictions = before
        return freed

    def evictable_blocks(self) -> set[int]:
        return {b for b in self._node_of if self._refs[b] == 0}

    def check(self) -> None:
        """Assert the tree's invariants against the allocator's counts (tests call it)."""
        bs, seen, unreferenced = self.block_size, {}, 0
        for key, root in self._roots.items():
            assert root.parent is None and root.root_hash == key, f"{root} is not the root of salt hash {key}"
            assert root is self.root or root.children, f"the tree of salt hash {key} is empty but kept"
        for node in self.nodes():
            if node.parent is None:
                assert not node.block_ids and not node.token_ids
            else:
                assert node.block_ids, f"{node} is empty"
                assert len(node.token_ids) == bs * len(node.block_ids), f"{node}: not whole blocks"
                assert node.parent.children.get(node.token_ids[:bs]) is node, f"{node}: wrong key"
                refs = {self._refs[b] for b in node.block_ids}
                assert len(refs) == 1, f"{node}: blocks with different reference counts {refs}"
                assert self.ref_count(node) <= self.ref_count(node.parent) or node.parent.parent is None, (
                    f"{node} is held by more sequences than its parent")
            for child in node.children.values():
                assert child.parent is node
            for b in node.block_ids:
                assert b not in seen, f"block {b} is in two nodes"
                seen[b] = node
                unreferenced += self._refs[b] == 0
        assert seen == self._node_of, "the block -> node index disagrees with the tree"
        assert unreferenced == self._num_unreferenced, (
            f"{self._num_unreferenced} unreferenced cached blocks counted, {unreferenced} in the tree")
        live = {id(n) for t, _, _, n in self._heap if self._evictable(n) and n.last_access == t}
        for node in self.nodes():
            if self._evictable(node):
                assert id(node) in live, f"evictable {node} is missing from the LRU heap"

    # ---- inside ----------------------------------------------------------------------
    def _walk(self, token_ids: Sequence[int], max_tokens: int | None,
              salt: str | None = None) -> list[tuple[RadixNode, int]]:
        """The matched path in ``salt``'s tree: ``(node, blocks matched in it)``, only the
        last one partial."""
        bs = self.block_size
        limit = match_limit(len(token_ids), max_tokens)
        limit -= limit % bs
        path, node, pos = [], self._roots.get(root_hash(salt)), 0
        while node is not None and pos < limit:
            child = node.children.get(tuple(token_ids[pos:pos + bs]))
            if child is None:
                break
            k = self._common_blocks(child, token_ids, pos, limit)
            path.append((child, k))
            if k < len(child.block_ids):
                break
            node, pos = child, pos + k * bs
        return path

    def _common_blocks(self, node: RadixNode, token_ids: Sequence[int], start: int, end: int) -> int:
        """How many of ``node``'s blocks equal the tokens at ``[start, end)`` (at least its first,
        which its key matched)."""
        bs, mine = self.block_size, node.token_ids
        n = min(len(mine), end - start) // bs
        if tuple(token_ids[start:start + n * bs]) == mine[:n * bs]:
            return n
        k = 1
        while k < n and tuple(token_ids[start + k * bs:start + (k + 1) * bs]) == mine[k * bs:(k + 1) * bs]:
            k += 1
        return k

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut ``node`` after its first ``k`` blocks; return the new upper part, a node with
        one child. The node object keeps the lower part and its children; it stays exactly
        as evictable as it was (same last block, same children), and is queued if it is."""
        bs = self.block_size
        upper = RadixNode(node.token_ids[:k * bs], node.block_ids[:k], node.parent,
                          hit_count=node.hit_count, last_access=node.last_access, id=self._new_id())
        node.parent.children[node.token_ids[:bs]] = upper
        node.token_ids, node.block_ids = node.token_ids[k * bs:], node.block_ids[k:]
        node.parent = upper
        upper.children[node.token_ids[:bs]] = node
        for b in upper.block_ids:
            self._node_of[b] = upper
        self._push_if_evictable(node)
        return upper

    def _add_child(self, parent: RadixNode, token_ids: tuple[int, ...], block_ids: list[int]) -> RadixNode:
        child = RadixNode(token_ids, block_ids, parent, id=self._new_id())
        parent.children[token_ids[:self.block_size]] = child
        return child

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _evictable(self, node: RadixNode) -> bool:
        return (node.parent is not None and not node.children and bool(node.block_ids)
                and self._refs[node.block_ids[-1]] == 0)

    def _push_if_evictable(self, node: RadixNode) -> None:
        if self._evictable(node):
            self._pushes += 1
            heapq.heappush(self._heap, (node.last_access, node.id, self._pushes, node))
            if len(self._heap) > 4 * len(self._node_of) + 64:    # drop stale entries now and then
                self._heap = [(n.last_access, n.id, 0, n) for n in self.nodes() if self._evictable(n)]
                heapq.heapify(self._heap)

    def _path_tokens(self, node: RadixNode) -> list[int]:
        parts = []
        while node is not None:
            parts.append(node.token_ids)
            node = node.parent
        return [t for part in reversed(parts) for t in part]

    def _state(self) -> tuple:
        nodes = tuple((n.id, n.parent.id if n.parent else None, n.token_ids, tuple(n.block_ids), n.hit_count,
                       n.last_access) for n in self.nodes())
        heap = sorted((t, i, k) for t, i, k, _ in self._heap)
        return (nodes, {b: n.id for b, n in self._node_of.items()}, heap, self._num_unreferenced,
                self._clock, self._next_id, self.num_evictions, self.num_deduplicated)

    def __eq__(self, other: object) -> bool:
        """Same tree, same LRU state, same counters (tests compare snapshots)."""
        if not isinstance(other, RadixTree):
            return NotImplemented
        return self._state() == other._state()

    __hash__ = None   # mutable

    def __repr__(self) -> str:
        return (f"RadixTree(nodes={sum(1 for _ in self.nodes()) - 1}, cached_blocks={len(self._node_of)}, "
                f"evictable={self._num_unreferenced}, evictions={self.num_evictions})")

