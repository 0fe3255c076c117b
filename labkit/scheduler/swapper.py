"""Preemption by swapping (vLLM v0's ``preemption_mode="swap"``): a victim's KV blocks are
copied to a pool of host blocks, and copied back when the device has room again.

The scheduler's collaborator for everything host-side: the host pool (a ``BlockAllocator``
of its own, with the same reference counts and copy-on-write rules as the device's), the
queue of swapped sequences, swapping out when the scheduler preempts, and the swap-in phase
of each iteration. The executor makes the copies the plan lists (``swap_out`` first, then
``swap_in``, then copy-on-write), before the batch runs.

A swapped sequence keeps its computed tokens; one that computed nothing has no KV to swap
and is simply sent to wait (so a SWAPPED sequence always has ``num_computed_tokens > 0``).
A beam-search request's beams go out and come back together, all or none: they step
together, so a beam alone on either side would wait for siblings that could never follow.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from ..memory import BlockAllocator
from ..request import Sequence, Status
from .plan import StepPlan, growth

if TYPE_CHECKING:   # the scheduler owns its swapper; the import is for type hints only
    from .scheduler import Scheduler


class Swapper:
    """The swapped queue of one scheduler and its side of the host pool. With no ``host``
    (preemption by recompute) nothing is ever swapped. The pool may also hold a host tier's
    blocks (cached-free: a swap-out evicts them when it needs the room)."""

    def __init__(self, scheduler: Scheduler, host: BlockAllocator | None):
        self.scheduler = scheduler
        self.host = host
        self.swapped: deque[Sequence] = deque()   # oldest admission first; their tables hold host blocks
        self.num_swap_outs = 0            # sequences swapped out
        self.num_swap_ins = 0             # sequences swapped back in
        self.num_blocks_out = 0           # block copies device -> host
        self.num_blocks_in = 0            # block copies host -> device
        # Swap-mode preemptions that recomputed: the host pool was full, a sibling beam had to
        # be recomputed (beams swap all or none), or the victim had no K/V computed yet.
        self.num_fallbacks = 0

    # ---- out -------------------------------------------------------------------------
    def swap_out(self, seq: Sequence, plan: StepPlan) -> bool:
        """Move the preempted ``seq``'s blocks to host blocks (the executor copies them,
        device -> host, before this iteration's batch runs). Returns False, changing nothing,
        when it cannot: no host pool, too few free host blocks, no K/V to move, or a sibling
        beam that must be recomputed.

        Shared blocks: a device block that a sequence swapped out earlier in this iteration
        also held (its n > 1 siblings, its beams, a prefix-cache hit) is copied once and its
        host copy shared by reference count, as on the device (``plan.host_copies``). One
        still held by a running sequence is copied, and the runner keeps it. The freed
        device blocks keep their K/V until the copies have read them (swap-out comes first),
        so prefix-cache registrations stay true.
        """
        table, running = seq.block_table, self.scheduler.running
        # Only computed K/V is swapped: none in slots grown for this iteration.
        if self.host is None or not seq.num_computed_tokens or table.num_tokens != seq.num_computed_tokens:
            return False
        if seq.request.beam is not None:
            # Beams go all or none: with those preempted beside it (running, out of the running
            # list), unless one of them already had to be recomputed, or will be (it computed
            # nothing yet: no K/V to swap).
            if any(s.status is Status.WAITING for s in seq.request.seqs):
                return False
            together = [s for s in seq.request.seqs if s.status is Status.RUNNING and s not in running]
            if not all(s.num_computed_tokens for s in together):
                return False
        else:
            together = [seq]
        new = {b for s in together for b in s.block_table.block_ids} - plan.host_copies.keys()
        if len(new) > self.host.num_free_blocks:
            return False
        host_table, pairs = table.copy_to(self.host, plan.host_copies)
        device, device_blocks = self.scheduler.allocator, list(table.block_ids)
        table.free()
        for b in device_blocks:
            if device.ref_count(b) == 0:        # free now: it may be reused in this iteration
                del plan.host_copies[b]
        seq.block_table = host_table
        seq.status = Status.SWAPPED
        self.swapped.appendleft(seq)            # victims go newest first: the oldest stays ahead
        plan.swap_out += pairs
        plan.swapped_out.append(seq)
        self.num_swap_outs += 1
        self.num_blocks_out += len(pairs)
        return True

    # ---- in --------------------------------------------------------------------------
    def swap_in(self, plan: StepPlan) -> None:
        """The swap-in phase: bring swapped requests back, a request at a time, oldest first,
        while device blocks and batch slots allow, and schedule them in this iteration
        (FCFS: when the oldest cannot come back, nobody overtakes it).

        A request's swapped sequences come back together. A beam-search request's beams
        always do, all or none. A beam may come back computing nothing in this iteration (its
        siblings used the token budget). The samples of an n > 1 request are independent:
        when nothing else runs and they do not all fit, as many as fit come back, so that
        nobody waits forever (the rest follow as room frees)."""
        sched = self.scheduler
        width = sched.num_seq_slots_promised()
        while self.swapped and plan.budget > 0:
            request = self.swapped[0].request
            group = [s for s in self.swapped if s.request is request]
            while group:
                counts = self.plan_swap_in(group, plan.budget)
                group_width = sum(s.request.width for s in group)
                if counts is not None and width + group_width <= sched.max_num_seqs:
                    break
                if sched.running or request.beam is not None:
                    return                  # wait until running sequences make room
                group.pop()
            if not group:
                return
            growths = [growth(seq, n) for seq, n in zip(group, counts, strict=True)]
            done = sched.blocks.allocate_slots(growths, sched.admission_reserve())
            assert done is not None, "plan_swap_in said the group fits"
            for seq, g in zip(group, growths, strict=True):
                self.swapped.remove(seq)
                seq.block_table = g.table
                seq.status = Status.RUNNING
                sched.running.append(seq)
                plan.swapped_in.append(seq)
            plan.swap_in += done.moved
            plan.copies += done.copies
            self.num_blocks_in += len(done.moved)
            self.num_swap_ins += len(group)
            width += group_width
            for seq, n in zip(group, counts, strict=True):
                if n:
                    plan.add(seq, n)

    def plan_swap_in(self, group: list[Sequence], budget: int) -> list[int] | None:
        """Tokens each sequence of ``group`` would compute if swapped in now, or None when
        the token budget or the device blocks (for its host blocks, each copied once, and for
        its growth, copy-on-write included) do not allow it. Changes nothing.

        A beam may plan 0 tokens: it computed its token before it was swapped, or its
        siblings used the budget. It comes back with them all the same (beams return
        together) and computes in a later iteration. Any other sequence needs a chunk."""
        sched = self.scheduler
        counts = []
        for seq in group:
            n = min(seq.num_uncomputed_tokens, budget)
            if n < seq.num_uncomputed_tokens and not sched.enable_chunked_prefill:
                n = 0                       # the whole rest in one chunk, or nothing
            if n == 0 and seq.num_uncomputed_tokens and seq.request.beam is None:
                return None
            budget -= n
            counts.append(n)
        # The block manager counts, as for every other growth: the host blocks (each copied
        # once), the new blocks, and copy-on-write of a shared partly filled last block.
        growths = [growth(seq, n) for seq, n in zip(group, counts, strict=True)]
        return counts if sched.blocks.can_allocate(growths, sched.admission_reserve()) else None

    # ---- numbers ---------------------------------------------------------------------
    def stats(self) -> dict:
        """The swapping counters, for ``LLM.stats()`` and the simulator's metrics
        (``docs/swapping.md`` defines each)."""
        host = self.host
        return {
            "preemption_mode": self.scheduler.preemption_mode,
            "num_swapped": len(self.swapped),
            "num_swap_outs": self.num_swap_outs,
            "num_swap_ins": self.num_swap_ins,
            "num_swapped_blocks_out": self.num_blocks_out,
            "num_swapped_blocks_in": self.num_blocks_in,
            "num_swap_fallbacks": self.num_fallbacks,
            "num_host_blocks": host.num_blocks if host is not None else 0,
            "num_free_host_blocks": host.num_free_blocks if host is not None else 0,
        }
