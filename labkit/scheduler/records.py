"""Plain records that pass between the scheduler, the executors and the viewers.

``SchedulerOutput`` is one iteration's plan: which sequences compute how many tokens, and
which KV blocks must be copied first (copy-on-write). ``StepRecord`` is what happened in
one iteration, kept for the widgets, plots and benchmarks: cheap, plain numbers and ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from ..memory import BlockAllocator
from ..request import Request, Sequence

if TYPE_CHECKING:   # a record is read from the scheduler; the import is for type hints only
    from .scheduler import Scheduler


def kv_cache_usage(allocator: BlockAllocator) -> float:
    """Share of the KV pool held by sequences: vLLM's "KV cache usage" (0.0 when idle)."""
    return allocator.kv_cache_usage


def held_slot_fill(allocator: BlockAllocator) -> float:
    """Share of the slots in held blocks that hold a token: how little paging wastes.
    0.0 when no block is held (nothing is filled, nothing is wasted)."""
    return allocator.held_slot_fill


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of an iteration: compute K/V (and maybe logits) for
    ``token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens]``, then sample
    one token for each index in ``sample_indices``.

    Everything here is decided once, by the scheduler; executors and the engine read it.
    """

    seq: Sequence
    num_new_tokens: int
    is_prefill: bool            # computing prompt (or recomputing preempted) tokens, not decoding
    num_computed_tokens: int    # tokens with K/V before this iteration: the first computed position
    # The request's sample indices that get a token after this chunk: () mid-prompt,
    # (seq.index,) usually, (0, .., n-1) when an n > 1 request forks after its prefill.
    sample_indices: tuple[int, ...] = ()

    @classmethod
    def next_chunk(cls, seq: Sequence, num_new: int) -> ScheduledSeq:
        """``seq`` computing its next ``num_new`` tokens. Samples: none mid-prompt; one per
        sample index of the request (0 .. n-1) when an n > 1 request forks after this chunk;
        else one for the sequence itself."""
        if seq.num_computed_tokens + num_new < len(seq.token_ids):
            indices: tuple[int, ...] = ()
        elif seq.request.forked:
            indices = (seq.index,)
        else:
            indices = tuple(range(seq.request.params.n))
        return cls(seq, num_new, seq.is_prefill, seq.num_computed_tokens, indices)

    @property
    def num_samples(self) -> int:
        return len(self.sample_indices)

    @property
    def sample_position(self) -> int:
        """Position of the token sampled after this chunk (seeds and dummy tokens use it)."""
        return self.num_computed_tokens + self.num_new_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.num_computed_tokens:self.sample_position]

    @property
    def phase(self) -> str:
        return "prefill" if self.is_prefill else "decode"


@dataclass(slots=True)
class SchedulerOutput:
    """The plan for one iteration. Prefill chunks come before decodes in ``scheduled``."""

    step: int
    scheduled: list[ScheduledSeq]
    copies: list[tuple[int, int]]           # (src block, dst block) KV copies to do first
    preempted: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0              # prompt tokens admitted from the prefix cache
    # Preemption by swapping: block copies the executor makes, swap-out first, then
    # swap-in, then the copy-on-write ``copies``, all before the batch runs.
    swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)    # (host block, device block)
    swapped_out: list[Sequence] = field(default_factory=list)       # sequences swapped out now
    swapped_in: list[Sequence] = field(default_factory=list)        # sequences swapped back in now
    block_size: int = 0                     # tokens per block (a swap's cost depends on it)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class StepRecord:
    """What one iteration did, in numbers the widgets and benchmarks read.

    ``ran`` lists ``(request_id, seq_index, num_tokens, phase)`` with phase ``"prefill"``
    or ``"decode"``. The queue, block and usage fields are read at the iteration's end
    (finished sequences gone); ``docs/stats.md`` defines each.
    """

    step: int
    time_s: float                   # engine clock when the iteration started
    duration_s: float               # how long it took (measured, or the cost model's figure)
    ran: list[tuple[str, int, int, str]]
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_free_blocks: int
    num_cached_free_blocks: int
    kv_cache_usage: float           # held blocks / all blocks (vLLM's KV-cache usage)
    held_slot_fill: float           # filled slots / slots in held blocks (0.0 when none is held)
    preempted: list[str]            # request ids preempted before this iteration
    finished: list[str]             # request ids that finished in this iteration
    num_cached_tokens: int          # prompt tokens served from the prefix cache at admission
    num_copies: int                 # copy-on-write block copies
    swapped_out: list[str] = field(default_factory=list)   # request ids swapped out to host blocks
    swapped_in: list[str] = field(default_factory=list)    # request ids swapped back in
    num_swapped: int = 0            # sequences waiting in host blocks at the iteration's end
    # Blocks the sequences holding blocks would hold if nothing were shared: the sum of their
    # block tables' lengths. Blocks saved by sharing = num_logical_blocks - num_used_blocks.
    num_logical_blocks: int = 0
    # Speculative decoding (labkit.spec_decode): guessed tokens verified in this iteration, and
    # how many of them were kept (the engine fills them in; 0 without speculation).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


def step_record(sched: Scheduler, output: SchedulerOutput, finished: list[Request],
                time_s: float, duration_s: float) -> StepRecord:
    """The ``StepRecord`` of the iteration ``output`` planned, read from ``sched`` at its end."""
    ran, prefill, decode = [], 0, 0
    for item in output.scheduled:
        ran.append((item.seq.request.request_id, item.seq.index, item.num_new_tokens, item.phase))
        if item.is_prefill:
            prefill += item.num_new_tokens
        else:
            decode += item.num_new_tokens
    alloc = sched.allocator
    logical = sum(len(s.block_table.block_ids) for s in sched.sequences_holding_blocks() if s.block_table is not None)
    return StepRecord(
        step=output.step, time_s=time_s, duration_s=duration_s, ran=ran,
        num_prefill_tokens=prefill, num_decode_tokens=decode,
        num_running=len(sched.running), num_waiting=len(sched.waiting),
        num_used_blocks=alloc.num_used_blocks, num_free_blocks=alloc.num_free_blocks,
        num_cached_free_blocks=alloc.num_cached_free_blocks,
        kv_cache_usage=kv_cache_usage(alloc), held_slot_fill=held_slot_fill(alloc),
        preempted=[s.request.request_id for s in output.preempted],
        finished=[r.request_id for r in finished],
        num_cached_tokens=output.num_cached_tokens,
        num_copies=len(output.copies),
        swapped_out=[s.request.request_id for s in output.swapped_out],
        swapped_in=[s.request.request_id for s in output.swapped_in],
        num_swapped=len(sched.swapped),
        num_logical_blocks=logical,
    )
