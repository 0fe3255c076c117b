"""Iteration-level scheduling: continuous batching with chunked prefill and preemption.

Every iteration (``schedule``) the scheduler decides which sequences run and how many of
their tokens are computed, within two budgets: ``max_num_seqs`` sequences and
``max_num_batched_tokens`` tokens. Running sequences go first (oldest admission first):
each decodes one token, or continues its prompt in chunks. Then waiting requests are
admitted in arrival order (FCFS) while the budgets and the KV blocks allow. After the
executor has run the batch, ``update`` appends the sampled tokens, and sequences that
finished leave the batch at once, their blocks returning to the pool: the next iteration
can admit a waiting request into the room they left. That is continuous batching.

Every block a sequence gains comes from one call, ``BlockManager.allocate_slots``, which
grows a whole plan of tables or none. When a running sequence cannot grow, the most recently
admitted sequence is *preempted*, in one of two ways (``preemption_mode``, as vLLM v0):

- **recompute** (the default): its blocks are freed and it goes back to the head of the
  waiting queue with every token it has, to be prefilled again when memory returns.
- **swap**: its KV blocks are copied to a pool of host blocks and it waits in the
  ``swapped`` queue (``swapper.py``); swapped requests come back, oldest first, before any
  waiting request is admitted. When the host pool is full, swap falls back to recompute.

Either way the sequence loses nothing; it pays the recompute, or the copies.

The scheduler's parts: ``StepPlan`` (``plan.py``) carries one iteration's decisions from
phase to phase; ``preemption.py`` takes sequences out of the batch when blocks run
short; ``Swapper`` owns the host side; ``BeamGroups`` (``beams.py``) keeps a beam-search
request's beams together (planned, preempted, swapped and admitted all or none) and
applies each beam step; ``StaticScheduler`` (``static.py``) is the static-batching
baseline, the same scheduler with its policy hooks (``admit``, ``_release``,
``_batch_may_grow``, ``tokens_to_hold``, ``fork_children``) changed.

A sequence ends in one place, ``finish_sequence``, whatever ends it: a stop token or
string, its length, an abort, or, for a beam, being pruned by the beam step (finish
reason ``"pruned"``). It sets the finish reason once, returns the blocks (policy hook
``_release``), and retires the request when its last sequence is done.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from ..beam_search import BeamSearch
from ..memory import BlockAllocator, BlockManager, BlockTable, Growth, HostTier
from ..request import Request, Sequence, Status
from .beams import BeamGroups
from .checks import check_config, check_fork, check_offload, check_request
from .outputs import StopStringCheck, apply_samples, make_children
from .plan import StepPlan, growth
from .preemption import preempt_newest
from .records import SchedulerOutput, StepRecord, step_record
from .swapper import Swapper


class Scheduler:
    """FCFS continuous-batching scheduler over a ``BlockAllocator``.

    Invariants kept between iterations: every RUNNING sequence has a block table holding
    exactly its ``num_computed_tokens`` tokens; WAITING and FINISHED sequences hold no
    blocks (the static policy holds finished sequences' blocks until its batch ends);
    SWAPPED sequences hold host blocks only.
    """

    policy = "continuous"

    def __init__(self, allocator: BlockAllocator, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 enable_chunked_prefill: bool = True, max_model_len: int | None = None, watermark: float = 0.01,
                 eos_token_ids: Iterable[int] = (), preemption_mode: str = "recompute", num_host_blocks: int = 0,
                 num_offload_blocks: int = 0, bytes_per_block: int = 0):
        check_config(max_num_seqs, max_num_batched_tokens, watermark, preemption_mode, num_host_blocks)
        check_offload(allocator, num_offload_blocks)
        self.allocator = allocator
        self.blocks = BlockManager(allocator)
        self.block_size = allocator.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_model_len = max_model_len
        # Blocks kept back at admission so running sequences can still grow a while.
        self.watermark_blocks = int(watermark * allocator.num_blocks)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.preemption_mode = preemption_mode

        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []       # in admission order: the last is preempted first
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        # One host pool: blocks for swapping and, behind the prefix cache, a host tier
        # (its blocks are cached-free host blocks: a swap-out that needs them evicts them).
        num_swap_blocks = num_host_blocks if preemption_mode == "swap" else 0
        host_blocks = num_swap_blocks + num_offload_blocks
        self.host_allocator: BlockAllocator | None = (
            BlockAllocator(host_blocks, self.block_size, "hash" if num_offload_blocks else False)
            if host_blocks else None)
        self.tier = (HostTier(allocator, self.host_allocator, bytes_per_block, num_offload_blocks)
                     if num_offload_blocks else None)
        self.swapper = Swapper(self, self.host_allocator if num_swap_blocks else None)
        self.swapped = self.swapper.swapped     # oldest admission first; their tables hold host blocks
        self.beams = BeamGroups(self)
        self.step = 0
        self.num_preemptions = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens_computed = 0
        self.num_cached_prompt_tokens = 0

    # ---- requests in and out -------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request, or raise ``ValueError`` saying why it can never be served.
        A rejected request changes nothing."""
        self.check_request(request)
        if request.beam is not None:
            request.beam_search = BeamSearch(request.beam, self.eos_token_ids,
                                             self.max_len(request) - len(request.prompt_token_ids))
            # Each beam reports as many log-probabilities as the step keeps candidates.
            request.params.logprobs = request.beam_search.num_candidates
        self.requests[request.request_id] = request
        self.waiting.extend(request.seqs)

    def check_request(self, request: Request) -> None:
        """Raise ``ValueError`` if ``request`` can never be served by this scheduler (``checks.py``)."""
        check_request(self, request)

    def max_len(self, request: Request) -> int:
        """The most tokens one sequence of ``request`` can reach: prompt + max_tokens,
        capped by the model's length."""
        longest = len(request.prompt_token_ids) + request.params.max_tokens
        return longest if self.max_model_len is None else min(longest, self.max_model_len)

    def tokens_to_hold(self, request: Request, longest: int) -> int:
        """KV slots one sequence of ``request`` may need at most (policy hook)."""
        return longest

    def abort(self, request_id: str, now: float = 0.0) -> bool:
        """Stop a request now, whatever its state, freeing its blocks at once. Samples that
        had already finished keep their finish reason. Returns False when no unfinished
        request has that id."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        for seq in list(request.seqs):
            self.finish_sequence(seq, "abort", now)
        return True

    def finish_sequence(self, seq: Sequence, reason: str, now: float = 0.0) -> Request | None:
        """End ``seq`` now: the one place a sequence retires, whatever ended it. Its finish
        reason is set once (a finished sequence is left alone); its blocks go back (policy hook
        ``_release``). Returns its request if that retires too (its last sequence: it leaves
        ``requests`` with its ``finished_time``), else None."""
        if seq.status is Status.FINISHED:
            return None
        queue = {Status.RUNNING: self.running, Status.SWAPPED: self.swapped}.get(seq.status, self.waiting)
        queue.remove(seq)                       # a swapped table holds host blocks: _release frees them
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.request.unfinished.remove(seq)
        if seq.block_table is not None:
            self._release(seq, reason)
        request = seq.request
        if not request.finished or self.requests.get(request.request_id) is not request:
            return None
        del self.requests[request.request_id]
        request.finished_time = now
        return request

    # ---- one iteration -----------------------------------------------------------
    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        """Plan the next iteration; the block tables grow to cover the tokens it computes.
        ``now`` (the engine's clock) stamps requests scheduled for the first time."""
        self.step += 1
        plan = StepPlan(self.max_num_batched_tokens)
        # 1. Running sequences, oldest first; if memory runs out, the newest give way.
        self._schedule_running(plan)
        # 2. Swapped sequences come back before any new request is admitted (vLLM v0's
        #    order), oldest first; not in an iteration that preempted (memory is short).
        if self.swapped and not plan.preempted:
            self.swapper.swap_in(plan)
        # 3. Waiting requests, in order (not after a preemption: admitting would thrash;
        #    nor while a request waits in host memory: it goes first).
        if not plan.preempted and not self.swapped and self._batch_may_grow():
            self._admit_waiting(plan, now)
        self.num_cached_prompt_tokens += plan.num_cached_tokens
        output = plan.output(self.step, self.block_size)
        self.add_tier_copies(output)
        return output

    def add_tier_copies(self, output: SchedulerOutput) -> None:
        """Put the host tier's copies decided so far (offloads of evicted blocks, loads of
        host hits) into ``output``: they run with its swaps, before its batch. ``schedule``
        calls it; so must anything that allocates for the step after ``schedule`` (speculative
        decoding's lookahead slots), for an evicted block is written by the step it joins."""
        if self.tier is not None:
            offloads, loads = self.tier.take_copies()
            output.swap_out += offloads
            output.swap_in += loads

    def _schedule_running(self, plan: StepPlan) -> None:
        """Phase 1: each running sequence computes its next chunk or decode token (a
        beam-search request's beams are planned, and give way, together)."""
        i = 0
        while i < len(self.running) and plan.budget > 0:
            seq = self.running[i]
            if seq.request.beam is not None:
                i = self.beams.schedule_running(i, plan)
            elif self.grow(i, [seq], [min(seq.num_uncomputed_tokens, plan.budget)], plan):
                i += 1
            else:
                break                       # it preempted itself: it was the newest left

    def grow(self, first: int, group: list[Sequence], counts: list[int], plan: StepPlan) -> bool:
        """Grow the running ``group`` (from ``running[first]`` on) by ``counts`` tokens each and
        schedule them; while the blocks are short, preempt the newest running sequence.
        Returns False when that was the group itself."""
        growths = [growth(seq, n) for seq, n in zip(group, counts, strict=True)]
        while (done := self.blocks.allocate_slots(growths)) is None:
            preempt_newest(self, first, plan)
            if group[0].status is not Status.RUNNING:
                return False
        plan.copies += done.copies
        for seq, n in zip(group, counts, strict=True):
            if n:
                plan.add(seq, n)
        return True

    def _admit_waiting(self, plan: StepPlan, now: float) -> None:
        """Phase 3: admit waiting requests in arrival order while the batch slots, the token
        budget and the blocks allow (FCFS: nobody overtakes the head of the queue). The
        waiting beams of a beam-search request are admitted together, or not yet."""
        width = self.num_seq_slots_promised() if self.waiting else 0
        while self.waiting and plan.budget > 0:
            head = self.waiting[0]
            request = head.request
            group = [s for s in self.waiting if s.request is request] if request.beam is not None else [head]
            group_width = sum(s.request.width for s in group)
            if width + group_width > self.max_num_seqs:
                break
            if request.beam is not None:
                counts = self.beams.admit(group, plan.budget)
            else:
                counts = [self.admit(head, plan.budget)]
            if counts is None or counts[0] is None:
                break
            width += group_width
            for seq, n in zip(group, counts, strict=True):
                self.waiting.remove(seq)
                seq.status = Status.RUNNING
                self.running.append(seq)
                plan.num_cached_tokens += seq.num_cached_tokens
                if n:
                    plan.add(seq, n)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now

    def admit(self, seq: Sequence, budget: int) -> int | None:
        """Give the waiting ``seq`` a block table for its first chunk (policy hook). Returns
        the tokens it computes now, or None (changing nothing) if it does not fit. A
        prefix-cache hit cuts both the blocks and the tokens to compute."""
        tokens, external = seq.token_ids, seq.num_external_tokens
        table = self.new_table(seq)
        # The last token is always computed: its logits give the next token. A request that
        # wants its prompt's logprobs computes every prompt position (cached KV has no logits).
        limit = 0 if seq.request.needs_prompt_logits else len(tokens) - 1
        # KV that arrived with the sequence (disaggregated prefill) is held, not computed.
        prefix = None if external else self.blocks.find_cached_prefix(table, tokens, limit)
        num_cached = external or prefix.num_tokens
        remaining = len(tokens) - num_cached
        num_new = min(remaining, budget)
        if num_new < remaining and not self.enable_chunked_prefill:
            return None
        held = prefix.num_tokens if prefix is not None else 0
        # computed=False, always: these slots get their K/V when the iteration runs (arriving KV
        # too: no executor has written it into these blocks yet), so they enter the prefix
        # cache in update(), not now.
        if self.blocks.allocate_slots([Growth(table, tokens[held:num_cached + num_new], prefix=prefix)],
                                      self.admission_reserve()) is None:
            return None
        seq.block_table = table
        seq.num_computed_tokens, seq.num_cached_tokens, seq.num_external_tokens = num_cached, held, 0
        return num_new

    def admission_reserve(self) -> int:
        """Blocks that admissions and swap-ins must leave free: the watermark, while
        sequences run that may still grow."""
        return self.watermark_blocks if self.running else 0

    def num_seq_slots_promised(self) -> int:
        """Batch slots the running sequences will fill: an n > 1 request that has not
        forked yet forks into n sequences after its prefill, so it counts n."""
        return sum(s.request.width for s in self.running)

    def new_table(self, seq: Sequence) -> BlockTable:
        """An empty block table for ``seq``, in its request's prefix-cache namespace."""
        return BlockTable(self.allocator, seq.request.cache_salt)

    def _batch_may_grow(self) -> bool:
        """Whether new requests may join now (policy hook: continuous batching says always)."""
        return True

    # ---- after the executor ------------------------------------------------------
    def update(self, output: SchedulerOutput, sampled: list[list[int]], now: float,
               stop_string: StopStringCheck | None = None,
               logprobs: list[list[dict] | None] | None = None) -> list[Request]:
        """Record what the iteration computed and sampled; finish what is done.

        ``sampled[i]`` holds the tokens sampled for ``output.scheduled[i]`` (as many as its
        ``num_samples``). ``stop_string``, if given, is asked about each sequence that
        gained a token, before its stop tokens and length (a stop string wins, as in vLLM).
        ``logprobs[i]`` (the executor's, one ``{token: Logprob}`` per sample) feeds the
        beams of beam-search requests: they take no sampled token, but a beam step
        (``BeamGroups.step``) once every beam of the request has its log-probabilities.
        Returns the requests that finished in this iteration.
        """
        return apply_samples(self, output, sampled, now, stop_string, logprobs)

    def _release(self, seq: Sequence, reason: str) -> None:
        """Return a finished sequence's blocks (policy hook: continuous frees at once)."""
        seq.block_table.free()
        seq.block_table = None

    # ---- forks ---------------------------------------------------------------------
    def fork(self, parent: Sequence) -> Sequence:
        """Fork a decoding sequence now (what beam search and on-demand sampling do): the
        child shares every block with its parent and runs from the next iteration on.
        Raises ``ValueError`` (changing nothing) for a sequence that is not decoding, or
        when the batch is full."""
        check_fork(self, parent)
        return self.fork_children(parent, 1)[0]

    def fork_children(self, parent: Sequence, count: int) -> list[Sequence]:
        """Parallel sampling and beam search: ``count`` children that share the parent's
        blocks (copy-on-write), running right after it (policy hook)."""
        return make_children(self.running, parent, count, parent.block_table.fork)

    # ---- numbers -------------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        """Sequences whose KV waits in host blocks (preempted by swapping)."""
        return len(self.swapped)

    # The parts' counters, where callers have always read them (docs/stats.md, docs/swapping.md).
    num_swap_outs = property(lambda self: self.swapper.num_swap_outs)
    num_swap_ins = property(lambda self: self.swapper.num_swap_ins)
    num_swapped_blocks_out = property(lambda self: self.swapper.num_blocks_out)
    num_swapped_blocks_in = property(lambda self: self.swapper.num_blocks_in)
    num_swap_fallbacks = property(lambda self: self.swapper.num_fallbacks)
    num_beam_forks = property(lambda self: self.beams.num_forks)
    num_beam_deaths = property(lambda self: self.beams.num_deaths)

    def swap_stats(self) -> dict:
        """The swapping counters, for ``LLM.stats()`` and the simulator's metrics."""
        return self.swapper.stats()

    def tier_stats(self) -> dict:
        """The host tier's counters (``HostTier.stats``), or {} without a tier."""
        return self.tier.stats() if self.tier is not None else {}

    def sequences_holding_blocks(self) -> list[Sequence]:
        """Every sequence that holds KV blocks now, in admission order (the widgets draw them)."""
        return list(self.running)

    def make_record(self, output: SchedulerOutput, finished: list[Request],
                    time_s: float, duration_s: float) -> StepRecord:
        """A plain summary of the iteration, for widgets, plots and benchmarks."""
        return step_record(self, output, finished, time_s, duration_s)
