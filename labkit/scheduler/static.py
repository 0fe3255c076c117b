"""The static-batching baseline: the naive server that PagedAttention and Orca replaced.

A batch is formed from the head of the queue; each request reserves, up front, room for
its maximum length (prompt + max_tokens, or the model's whole context); the batch runs
until its *longest* request finishes, and nothing joins it meanwhile. Finished requests
keep their reservation until the batch ends. Prompts are prefilled all at once, as
``generate`` on a padded batch does.

It is the continuous scheduler with three policy hooks changed, running on the same
block manager, so that comparisons measure the policy and nothing else.

Beam search, done the naive way: each beam reserves its own maximum length (a request
reserves ``beam_width`` of them when admitted), and a fork copies every block its parent
has filled into the child's reservation (what reordering a contiguous KV cache costs), so
nothing is shared. A beam that dies gives its reservation back at once, for a fork of the
same step to take.
"""

from __future__ import annotations

import sys
from typing import Iterable

from ..errors import LimitExceeded
from ..memory import BlockAllocator, BlockTable, Growth
from ..request import Request, Sequence
from ..utils import cdiv
from .outputs import make_children
from .scheduler import Scheduler


class StaticScheduler(Scheduler):
    """Static batching with max-length reservation, on the shared ``BlockAllocator``.

    ``reserve="max_tokens"`` reserves prompt + max_tokens per request; ``reserve="model"``
    reserves the model's maximum length (what a server that does not know the output
    length must do).
    """

    policy = "static"

    def __init__(self, allocator: BlockAllocator, max_num_seqs: int = 64,
                 max_model_len: int | None = None, reserve: str = "max_tokens",
                 eos_token_ids: Iterable[int] = (), num_offload_blocks: int = 0, bytes_per_block: int = 0):
        if num_offload_blocks:
            raise ValueError("the static baseline never reuses cached prefixes: a host tier behind it would only "
                             "copy blocks (serve with policy='continuous', or drop kv_offloading_size)")
        if reserve not in ("max_tokens", "model"):
            raise ValueError(f"reserve must be 'max_tokens' or 'model', got {reserve!r}")
        if reserve == "model" and max_model_len is None:
            raise ValueError("reserve='model' needs max_model_len")
        # The whole batch's prompts go in one iteration: no token budget, no chunking.
        super().__init__(allocator, max_num_seqs=max_num_seqs, max_num_batched_tokens=sys.maxsize,
                         enable_chunked_prefill=False, max_model_len=max_model_len,
                         watermark=0.0, eos_token_ids=eos_token_ids,
                         num_offload_blocks=num_offload_blocks, bytes_per_block=bytes_per_block)
        self.reserve = reserve
        self._held: list[Sequence] = []   # finished, blocks kept until the batch ends
        self._fork_copies: list[tuple[int, int]] = []   # beam forks' block copies, for the next plan

    def check_request(self, request: Request) -> None:
        if request.params.n != 1:
            raise LimitExceeded(f"request {request.request_id!r}: the static baseline serves n=1 only", "n")
        super().check_request(request)

    def tokens_to_hold(self, request: Request, longest: int) -> int:
        return self.max_model_len if self.reserve == "model" else longest

    def fork(self, parent: Sequence) -> Sequence:
        raise ValueError("forking needs the continuous scheduler: the static baseline reserves "
                         "blocks ahead of the tokens, and a shared reserved block would be "
                         "written without a copy")

    def sequences_holding_blocks(self) -> list[Sequence]:
        # Finished members of the batch keep their reservation until the batch ends.
        return self.running + self._held

    def _batch_may_grow(self) -> bool:
        return not self.running and not self._held

    def _reservation(self, request: Request) -> int:
        return self.tokens_to_hold(request, self.max_len(request))

    def _promised_blocks(self) -> int:
        """Blocks promised to the beams that admitted beam requests fork into after their
        prefill: they reserve then, and must find the room."""
        return sum((s.request.width - 1) * cdiv(self._reservation(s.request), self.block_size)
                   for s in self.running if s.request.beam is not None)

    def admit(self, seq: Sequence, budget: int) -> int | None:
        """The whole prompt in one chunk, on a table reserving the request's maximum length
        (and room for the beams it will fork into), or None."""
        reservation, tokens = self._reservation(seq.request), seq.token_ids
        need = cdiv(reservation, self.block_size) * seq.request.width
        if need + self._promised_blocks() > self.allocator.num_free_blocks:
            return None
        table = self.new_table(seq)
        self.blocks.allocate_slots([Growth(table, tokens, num_lookahead_tokens=reservation - len(tokens))])
        seq.block_table = table
        return len(tokens)

    def schedule(self, now: float = 0.0):
        plan = super().schedule(now)
        # Fork copies first: they fill the children's reservations from their parents'
        # blocks before any beam writes its next token.
        plan.copies[:0] = self._fork_copies
        self._fork_copies = []
        return plan

    def fork_children(self, parent: Sequence, count: int) -> list[Sequence]:
        """A beam fork without sharing: each child reserves its own maximum length and
        gets a copy of every block the parent has filled."""
        def copy() -> BlockTable:
            table = self.new_table(parent)
            table.reserve(self._reservation(parent.request))
            table.append_tokens(parent.token_ids[:parent.num_computed_tokens], computed=False)
            return table

        children = make_children(self.running, parent, count, copy)
        for child in children:
            filled = cdiv(child.num_computed_tokens, self.block_size)
            self._fork_copies += zip(parent.block_table.block_ids[:filled], child.block_table.block_ids[:filled],
                                     strict=True)
        return children

    def _release(self, seq: Sequence, reason: str) -> None:
        if reason in ("abort", "pruned"):
            # Its client is gone, or the beam died: no reason to hold its memory (a dead
            # beam's reservation goes to the fork that replaces it).
            super()._release(seq, reason)
        else:
            self._held.append(seq)

    def finish_sequence(self, seq: Sequence, reason: str, now: float = 0.0) -> Request | None:
        request = super().finish_sequence(seq, reason, now)
        if not self.running and self._held:
            # The batch's longest request is done: only now does its memory come back.
            for held in self._held:
                super()._release(held, held.finish_reason)
            self._held.clear()
        return request
