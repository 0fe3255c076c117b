"""Preemption: taking running sequences out of the batch when the KV blocks run short.

When a running sequence cannot grow (``Scheduler.grow``), the most recently admitted
sequence gives way: FCFS protects the oldest. It loses nothing. In ``"recompute"`` mode
(the default) its blocks are freed and it waits at the head of the queue with every token
it has, to be prefilled again; in ``"swap"`` mode its KV blocks are copied to host blocks
(``Swapper.swap_out``) and it waits in the swapped queue. A swap that cannot be done (the
host pool is full, a sibling beam must recompute, no K/V computed yet) falls back to
recompute, and is counted (``num_swap_fallbacks``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..request import Sequence, Status
from .plan import StepPlan

if TYPE_CHECKING:   # the scheduler calls these; the import is for type hints only
    from .scheduler import Scheduler


def preempt_newest(sched: Scheduler, first: int, plan: StepPlan) -> None:
    """Preempt the newest running sequence. A beam takes its sibling beams with it (those at
    index >= ``first``, not yet planned in this iteration): beams can only step together,
    so a beam left running alone would hold blocks and wait."""
    victim = sched.running.pop()
    group = [victim]
    if victim.request.beam is not None:
        group += [s for s in sched.running[first:] if s.request is victim.request]
        for s in group[1:]:
            sched.running.remove(s)
    for s in group:
        preempt(sched, s, plan)
        plan.preempted.append(s)


def preempt(sched: Scheduler, seq: Sequence, plan: StepPlan | None = None) -> None:
    """Take ``seq`` (already out of ``sched.running``) out of the batch, keeping every token.
    In "swap" mode its KV goes to host blocks (only within a step, whose plan carries the
    copies). Otherwise, or when it cannot be swapped, its KV is dropped and it goes to the
    head of the waiting queue, to be prefilled again."""
    seq.num_preemptions += 1
    sched.num_preemptions += 1
    if sched.preemption_mode == "swap":
        if plan is not None and sched.swapper.swap_out(seq, plan):
            return
        sched.swapper.num_fallbacks += 1
    seq.block_table.free()
    seq.block_table = None
    seq.num_computed_tokens = 0
    seq.status = Status.WAITING
    sched.waiting.appendleft(seq)
