"""Where KV-cache memory goes: the waste accounting of the vLLM paper (Kwon et al., 2023).

The paper's Figure 2 splits the KV memory that serving a set of requests takes into four
kinds of slot (a slot holds one token's K and V):

* **token states**            -- slots that hold the KV of a token the request has now;
* **reservation**             -- slots set aside for tokens the request *will* still produce
  (used eventually, but idle now);
* **internal fragmentation**  -- slots set aside that will *never* hold a token: reserved
  beyond the length the request actually reaches;
* **external fragmentation**  -- free slots that cannot be used: holes between reservations
  too small for the next request's reservation.

We add the slots nobody holds and anybody could use (**free**), so that the five counts
add up to the memory's size. Two policies are accounted here:

* **contiguous reservation** (the naive server, Orca): each request reserves one
  contiguous range of slots for its maximum length up front (prompt + max_tokens, or the
  model's whole context). Its holes are modelled by ``ContiguousAllocator``, first fit.
* **paged** (vLLM): blocks of ``block_size`` slots, taken one at a time as tokens arrive.
  No reservation; any free block serves any request, so no external fragmentation; the only
  waste is the empty tail of each sequence's last block, under one block per sequence.

``live_paged_waste`` reads the same categories off a running ``BlockAllocator`` and its
``BlockTable``s (shared blocks count once: that is what sharing saves).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, NamedTuple, Sequence

from labkit.utils import cdiv

if TYPE_CHECKING:   # annotations only: waste accounting needs nothing from them at import
    from .allocator import BlockAllocator
    from .block_table import BlockTable


# ---- the records ----------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class SeqUsage:
    """One request's lengths, in tokens, as the accounting needs them.

    ``num_tokens``: tokens that have KV now (prompt + output so far).
    ``final_len``:  tokens it will have when it finishes (prompt + its real output length).
    ``max_len``:    what a contiguous server must reserve because it cannot know
    ``final_len``: prompt + max_tokens, or the model's maximum length.
    Invariant: ``0 <= num_tokens <= final_len <= max_len``.
    """

    num_tokens: int
    final_len: int
    max_len: int

    def __post_init__(self) -> None:
        if not 0 <= self.num_tokens <= self.final_len <= self.max_len:
            raise ValueError(
                "need 0 <= num_tokens <= final_len <= max_len, got "
                f"{self.num_tokens}, {self.final_len}, {self.max_len}"
            )

    @classmethod
    def request(cls, prompt_len: int, output_len: int, *, generated: int | None = None,
                max_tokens: int | None = None, max_model_len: int | None = None) -> "SeqUsage":
        """A request with ``prompt_len`` prompt tokens that will produce ``output_len`` tokens,
        ``generated`` of them so far (default: all, i.e. finished). Its contiguous reservation
        is prompt + ``max_tokens`` when given, else the model's ``max_model_len``; with both,
        the smaller."""
        generated = output_len if generated is None else generated
        limits = [n for n in (None if max_tokens is None else prompt_len + max_tokens, max_model_len)
                  if n is not None]
        if not limits:
            raise ValueError("give max_tokens, max_model_len or both: the reservation's length")
        return cls(prompt_len + generated, prompt_len + output_len, min(limits))


@dataclass(slots=True, frozen=True)
class Waste:
    """Slot counts per category for one snapshot of KV memory.

    Invariant: ``token_slots + reserved_slots + internal_fragmentation +
    external_fragmentation + free_slots == total_slots``; every count is >= 0.
    ``cached_free_slots`` is the part of ``free_slots`` that still holds a reusable prefix
    (paged, prefix caching); ``logical_tokens`` counts every sequence's tokens, so with
    shared blocks it exceeds ``token_slots`` (physical) by what sharing saved.
    """

    token_slots: int
    reserved_slots: int
    internal_fragmentation: int
    external_fragmentation: int
    free_slots: int
    total_slots: int
    cached_free_slots: int = 0
    logical_tokens: int | None = None

    def __post_init__(self) -> None:
        parts = (self.token_slots, self.reserved_slots, self.internal_fragmentation,
                 self.external_fragmentation, self.free_slots, self.cached_free_slots)
        if min(parts) < 0:
            raise ValueError(f"negative slot count in {self}")
        if sum(parts[:5]) != self.total_slots:
            raise ValueError(f"categories add up to {sum(parts[:5])}, not total_slots={self.total_slots}")
        if self.cached_free_slots > self.free_slots:
            raise ValueError("cached_free_slots is part of free_slots, cannot exceed it")
        if self.logical_tokens is None:
            object.__setattr__(self, "logical_tokens", self.token_slots)

    @property
    def allocated_slots(self) -> int:
        """Slots held by requests: token states + reservation + internal fragmentation."""
        return self.token_slots + self.reserved_slots + self.internal_fragmentation

    @property
    def wasted_slots(self) -> int:
        """Slots that hold no token yet are not free for others: the paper's three wastes."""
        return self.reserved_slots + self.internal_fragmentation + self.external_fragmentation

    @property
    def utilization(self) -> float:
        """Token slots / allocated slots: the share of what requests hold that holds KV.
        (0.0 when nothing is allocated.)"""
        return self.token_slots / self.allocated_slots if self.allocated_slots else 0.0

    @property
    def waste_fraction(self) -> float:
        """Wasted / (allocated + external fragmentation): the paper's Figure 2 bars, where
        the memory a policy *consumes* includes the holes it leaves unusable."""
        consumed = self.allocated_slots + self.external_fragmentation
        return self.wasted_slots / consumed if consumed else 0.0

    @property
    def sharing_savings(self) -> int:
        """Token slots that sharing saved: sequences' tokens minus physical token slots."""
        return self.logical_tokens - self.token_slots

    def fractions(self) -> dict[str, float]:
        """Each category as a fraction of ``total_slots`` (they sum to 1)."""
        total = self.total_slots or 1
        return {
            "tokens": self.token_slots / total,
            "reserved": self.reserved_slots / total,
            "internal_fragmentation": self.internal_fragmentation / total,
            "external_fragmentation": self.external_fragmentation / total,
            "free": self.free_slots / total,
        }

    def summary(self) -> str:
        """One line for a notebook: each category's share of the memory."""
        names = {"tokens": "tokens", "reserved": "reserved", "internal_fragmentation": "internal frag",
                 "external_fragmentation": "external frag", "free": "free"}
        parts = [f"{names[k]} {v:.1%}" for k, v in self.fractions().items()]
        return (f"{self.total_slots} slots: " + " | ".join(parts)
                + f"  (utilization {self.utilization:.1%}, waste {self.waste_fraction:.1%})")


# ---- a first-fit contiguous allocator ---------------------------------------------------
class Hole(NamedTuple):
    """A run of free slots ``[start, start + length)``."""

    start: int
    length: int


class ContiguousAllocator:
    """Hands out contiguous ranges of slots, first fit: the memory model of a server that
    reserves one range per request (and of the static-batching baseline).

    Invariant: holes are sorted by start, non-empty, and never touch (freeing merges a
    hole with its neighbours); holes and allocations tile ``[0, num_slots)`` exactly.
    ``allocate`` and ``free`` cost O(number of holes).
    """

    __slots__ = ("num_slots", "_holes", "_allocations")

    def __init__(self, num_slots: int):
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be a positive integer, got {num_slots!r}")
        self.num_slots = num_slots
        self._holes: list[Hole] = [Hole(0, num_slots)]
        self._allocations: dict[int, int] = {}   # start -> length

    def allocate(self, num_slots: int) -> int | None:
        """Reserve ``num_slots`` contiguous slots in the first hole that fits; return its
        start, or None when no hole is large enough (even if enough slots are free in all:
        that shortfall is external fragmentation)."""
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be a positive integer, got {num_slots!r}")
        for i, (start, length) in enumerate(self._holes):
            if length >= num_slots:
                if length == num_slots:
                    del self._holes[i]
                else:
                    self._holes[i] = Hole(start + num_slots, length - num_slots)
                self._allocations[start] = num_slots
                return start
        return None

    def free(self, start: int) -> None:
        """Return the range that begins at ``start``, merging it with adjacent holes."""
        length = self._allocations.pop(start, None)
        if length is None:
            raise ValueError(f"no allocation starts at slot {start} (double free?)")
        i = bisect.bisect_left(self._holes, Hole(start, 0))
        end = start + length
        # Merge with the following hole if it begins where we end ...
        if i < len(self._holes) and self._holes[i].start == end:
            end += self._holes.pop(i).length
        # ... and with the preceding hole if it ends where we begin.
        if i > 0 and self._holes[i - 1].start + self._holes[i - 1].length == start:
            start = self._holes[i - 1].start
            i -= 1
            del self._holes[i]
        self._holes.insert(i, Hole(start, end - start))

    def size_of(self, start: int) -> int:
        """Length of the allocation that begins at ``start``."""
        return self._allocations[start]

    @property
    def holes(self) -> list[Hole]:
        """The free runs, in address order."""
        return list(self._holes)

    @property
    def allocations(self) -> dict[int, int]:
        """start -> length of every live allocation."""
        return dict(self._allocations)

    @property
    def num_free_slots(self) -> int:
        return sum(h.length for h in self._holes)

    @property
    def num_allocated_slots(self) -> int:
        return self.num_slots - self.num_free_slots

    @property
    def largest_hole(self) -> int:
        """The largest request ``allocate`` can satisfy now."""
        return max((h.length for h in self._holes), default=0)

    def unusable_slots(self, request_slots: int) -> int:
        """Free slots in holes smaller than ``request_slots``: external fragmentation as
        seen by a request that needs that many contiguous slots."""
        return sum(h.length for h in self._holes if h.length < request_slots)

    def check_invariants(self) -> None:
        pieces = sorted([(h.start, h.length) for h in self._holes] + list(self._allocations.items()))
        at = 0
        for start, length in pieces:
            assert length > 0 and start == at, f"gap or overlap at slot {at}: {pieces}"
            at += length
        assert at == self.num_slots, f"pieces cover {at} of {self.num_slots} slots"
        for a, b in itertools.pairwise(self._holes):
            assert a.start + a.length < b.start, f"holes {a} and {b} touch or are out of order"

    def __repr__(self) -> str:
        return (f"ContiguousAllocator(num_slots={self.num_slots}, allocations={len(self._allocations)}, "
                f"holes={[tuple(h) for h in self._holes]})")


# ---- the two policies -----------------------------------------------------------------
RESERVE_POLICIES = ("max", "pow2", "oracle")


def reservation(seq: SeqUsage, reserve: str = "max") -> int:
    """Slots a contiguous server reserves for ``seq``.

    ``"max"``: its maximum length (what a server that cannot know the output length does:
    the paper's Orca (Max)); ``"pow2"``: the final length rounded up to a power of two,
    at most ``max_len`` (Orca (Pow2)); ``"oracle"``: exactly the final length, as if the
    output length were known in advance (Orca (Oracle)): no internal fragmentation, but
    the reservation for future tokens remains.
    """
    if reserve == "max":
        return seq.max_len
    if reserve == "oracle":
        return seq.final_len
    if reserve == "pow2":
        return min(seq.max_len, 1 << max(0, seq.final_len - 1).bit_length())
    raise ValueError(f"reserve must be one of {RESERVE_POLICIES}, got {reserve!r}")


def contiguous_waste(seqs: Iterable[SeqUsage], *, reserve: str = "max",
                     total_slots: int | None = None, allocator: ContiguousAllocator | None = None,
                     next_request_slots: int | None = None) -> Waste:
    """Waste when each sequence holds one contiguous reservation (see ``reservation``).

    Per sequence: ``num_tokens`` token slots, ``final_len - num_tokens`` reserved for the
    tokens still to come, ``reservation - final_len`` internal fragmentation.

    External fragmentation needs the layout of memory: pass the ``allocator`` that holds
    these reservations (its allocated slots must equal their sum) and the size of the next
    request's reservation (default: the largest reservation now held); free slots in holes
    smaller than that are external fragmentation. Without an allocator the reservations
    are taken to sit back to back from slot 0 (no holes), in ``total_slots`` slots (default:
    just enough).
    """
    seqs = list(seqs)
    sizes = [reservation(s, reserve) for s in seqs]
    tokens = sum(s.num_tokens for s in seqs)
    reserved = sum(s.final_len - s.num_tokens for s in seqs)
    internal = sum(size - s.final_len for s, size in zip(seqs, sizes, strict=True))
    allocated = sum(sizes)
    if allocator is not None:
        if total_slots is not None and total_slots != allocator.num_slots:
            raise ValueError("total_slots disagrees with the allocator's num_slots")
        if allocator.num_allocated_slots != allocated:
            raise ValueError(f"the allocator holds {allocator.num_allocated_slots} slots but these "
                             f"sequences reserve {allocated}: they must describe the same state")
        request = next_request_slots if next_request_slots is not None else max(sizes, default=1)
        external = allocator.unusable_slots(request)
        return Waste(tokens, reserved, internal, external, allocator.num_free_slots - external,
                     allocator.num_slots)
    total = allocated if total_slots is None else total_slots
    if total < allocated:
        raise ValueError(f"the reservations need {allocated} slots, more than total_slots={total}")
    return Waste(tokens, reserved, internal, 0, total - allocated, total)


def paged_waste(seqs: Iterable[SeqUsage], block_size: int, *,
                total_slots: int | None = None) -> Waste:
    """Waste under paged allocation: each sequence holds ``ceil(num_tokens / block_size)``
    blocks, taken on demand. The empty tail of each last block is internal fragmentation
    (the next tokens may fill some of it, but nothing is set aside for them: a request
    that stops leaves it empty); no reservation; no external fragmentation (any free block
    fits any request). Sequences are independent here: see ``live_paged_waste`` for sharing.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    seqs = list(seqs)
    tokens = sum(s.num_tokens for s in seqs)
    allocated = sum(cdiv(s.num_tokens, block_size) * block_size for s in seqs)
    total = allocated if total_slots is None else total_slots
    if total < allocated:
        raise ValueError(f"the blocks need {allocated} slots, more than total_slots={total}")
    return Waste(tokens, 0, allocated - tokens, 0, total - allocated, total)


def live_paged_waste(allocator: "BlockAllocator", tables: Iterable["BlockTable"],
                     final_lens: Sequence[int] | None = None) -> Waste:
    """The categories of the allocator's memory right now, given every live block table.

    A physical block counts once however many tables share it; its token slots are the
    tokens it holds (a full block: ``block_size``; a sequence's last block: the rest).
    An empty slot at logical position ``p`` of a table counts as reservation when the
    table will still write there (``p < final_len``) and as internal fragmentation when it
    never will. Without ``final_lens`` (one per table) the future is unknown: slots in
    blocks reserved ahead of the tokens (``BlockTable.reserve``, the static baseline) count
    as reservation, the empty tail of the block being filled as internal fragmentation.
    Cached-free blocks are free (evictable) and reported in ``cached_free_slots``.
    ``tables`` must account for every used block, or the categories would not add up:
    ``ValueError`` then.
    """
    bs = allocator.block_size
    tables = [t for t in tables]
    if final_lens is not None and len(final_lens) != len(tables):
        raise ValueError("final_lens needs one length per table")
    seen: set[int] = set()
    tokens = reserved = internal = logical = 0
    for i, table in enumerate(tables):
        if table.freed:
            continue
        n = table.num_tokens
        logical += n
        for index, block_id in enumerate(table.block_ids):
            if block_id in seen:      # shared: its slots were counted with its first holder
                continue
            seen.add(block_id)
            held = min(bs, max(0, n - index * bs))
            tokens += held
            lo, hi = index * bs + held, (index + 1) * bs      # the empty positions
            if final_lens is not None:
                ahead = min(hi - lo, max(0, final_lens[i] - lo))
            else:
                ahead = hi - lo if held == 0 else 0
            reserved += ahead
            internal += hi - lo - ahead
    if len(seen) != allocator.num_used_blocks:
        raise ValueError(f"the tables hold {len(seen)} blocks but the allocator has "
                         f"{allocator.num_used_blocks} in use: pass every live table")
    return Waste(tokens, reserved, internal, 0, allocator.num_free_blocks * bs,
                 allocator.num_blocks * bs, cached_free_slots=allocator.num_cached_free_blocks * bs,
                 logical_tokens=logical)
