"""The plan of one iteration while the scheduler's phases build it.

``Scheduler.schedule`` makes one ``StepPlan`` and hands it to each phase in turn (running
sequences, swap-in, admission); each phase reads the token budget left and adds what it
decided. Nothing about the iteration lives on the scheduler itself, so a phase's inputs
and outputs are all in one visible place. ``output`` turns it into the ``SchedulerOutput``
that the executor reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..memory import Growth
from ..request import Sequence
from .records import ScheduledSeq, SchedulerOutput


@dataclass(slots=True)
class StepPlan:
    """What the phases have decided so far in this iteration, and the token budget left."""

    budget: int                                                       # tokens still to give out
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)       # copy-on-write (src, dst)
    preempted: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0                                        # prompt tokens from the prefix cache
    swap_out: list[tuple[int, int]] = field(default_factory=list)     # (device block, host block)
    swapped_out: list[Sequence] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)      # (host block, device block)
    swapped_in: list[Sequence] = field(default_factory=list)
    # Device block -> its host copy, for blocks swapped out in this iteration and still held
    # on the device: a second victim holding the same block shares the copy.
    host_copies: dict[int, int] = field(default_factory=dict)

    def add(self, seq: Sequence, num_new: int) -> None:
        """Schedule ``seq``'s next ``num_new`` tokens in this iteration, out of the budget
        (its block table already holds their slots)."""
        self.scheduled.append(ScheduledSeq.next_chunk(seq, num_new))
        self.budget -= num_new

    def output(self, step: int, block_size: int) -> SchedulerOutput:
        """The finished plan, prefill chunks before decodes (the layout the model runner packs)."""
        self.scheduled.sort(key=lambda s: not s.is_prefill)
        return SchedulerOutput(step, self.scheduled, self.copies, self.preempted, self.num_cached_tokens,
                               swap_out=self.swap_out, swap_in=self.swap_in, swapped_out=self.swapped_out,
                               swapped_in=self.swapped_in, block_size=block_size)


def growth(seq: Sequence, num_new: int) -> Growth:
    """``seq``'s block table growing by its next ``num_new`` tokens (computed this iteration)."""
    start = seq.num_computed_tokens
    return Growth(seq.block_table, seq.token_ids[start:start + num_new])
