"""Iteration-level scheduling: continuous batching with chunked prefill and preemption.

Every iteration (``schedule``) the scheduler decides which sequences run and how many of
their tokens are computed, within two budgets: ``max_num_seqs`` sequences and
``max_num_batched_tokens`` tokens. Running sequences go first (oldest admission first):
each decodes one token, or continues its prompt in chunks. Then waiting requests are
admitted in arrival order (FCFS) while the budgets and the KV blocks allow. After the
executor has run the batch, ``update`` appends the sampled tokens, and sequences that
finished leave the batch at once, their blocks returning to the pool: the next iteration
can admit a waiting request into the room they left. That is continuous batching.

When a running sequence needs a block and none is free, the most recently admitted
sequence is *preempted*, in one of two ways (``preemption_mode``, as vLLM v0):

- **recompute** (the default): its blocks are freed and it goes back to the head of the
  waiting queue with every token it has, to be prefilled again when memory returns.
- **swap**: its KV blocks are copied to a pool of host blocks (``host_allocator``) and it
  waits in the ``swapped`` queue, its computed tokens kept (a swapped sequence always has
  some: one that computed nothing is simply sent to wait). Swapped requests come back,
  oldest first, before any waiting request is admitted; their blocks are copied back and
  they go on where they stopped. When the host pool is full, swap falls back to recompute.
  ``SchedulerOutput.swap_out`` / ``swap_in`` tell the executor which blocks to copy.

Either way the sequence loses nothing; it pays the recompute, or the copies.

Beam search: a request's beams step together (``labkit.beam_search``), so they are
planned, preempted, swapped, swapped in and admitted together, all or none.

A sequence ends in one place, ``finish_sequence``, whatever ends it: a stop token or
string, its length, an abort, or, for a beam, being pruned by the beam step (finish
reason ``"pruned"``). It sets the finish reason once, returns the blocks (policy hook
``_release``), and retires the request when its last sequence is done.

Policy hooks (``_admit``, ``_release``, ``_batch_may_grow``) let the static-batching
baseline (``static.py``) reuse everything else.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable

from ..beam_search import BeamSearch, num_candidates
from ..memory import BlockAllocator, BlockTable
from ..request import Request, Sequence, Status
from ..sampling_params import MAX_LOGPROBS
from ..utils import cdiv
from .records import ScheduledSeq, SchedulerOutput, StepRecord, held_slot_fill, kv_cache_usage

# Called for each sequence that just gained a token, before the token-level stop checks:
# True when its text now contains a stop string (the engine's detokenizer answers).
StopStringCheck = Callable[[Sequence], bool]

PREEMPTION_MODES = ("recompute", "swap")


class Scheduler:
    """FCFS continuous-batching scheduler over a ``BlockAllocator``.

    Invariants kept between iterations: every RUNNING sequence has a block table holding
    exactly its ``num_computed_tokens`` tokens; WAITING and FINISHED sequences hold no
    blocks (the static policy holds finished sequences' blocks until its batch ends).
    """

    policy = "continuous"

    def __init__(
        self,
        allocator: BlockAllocator,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_chunked_prefill: bool = True,
        max_model_len: int | None = None,
        watermark: float = 0.01,
        eos_token_ids: Iterable[int] = (),
        preemption_mode: str = "recompute",
        num_host_blocks: int = 0,
    ):
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        if preemption_mode == "swap" and (not isinstance(num_host_blocks, int) or num_host_blocks < 1):
            raise ValueError("preemption_mode='swap' needs a host pool: num_host_blocks must be a positive "
                             f"integer, got {num_host_blocks!r}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be a fraction in [0, 1), got {watermark}")
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_model_len = max_model_len
        # Blocks kept back at admission so running sequences can still grow a while.
        self.watermark_blocks = int(watermark * allocator.num_blocks)
        self.eos_token_ids = frozenset(eos_token_ids)

        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []       # in admission order: the last is preempted first
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.step = 0
        self.num_preemptions = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens_computed = 0
        self.num_cached_prompt_tokens = 0
        self.num_beam_forks = 0           # beams forked from a parent beam (beam search)
        self.num_beam_deaths = 0          # beams that no candidate continued: freed at once

        # Preemption by swapping (vLLM v0's preemption_mode="swap"): a victim's blocks are
        # copied to a pool of host blocks with its own allocator, and copied back later.
        self.preemption_mode = preemption_mode
        self.host_allocator: BlockAllocator | None = (
            BlockAllocator(num_host_blocks, self.block_size) if preemption_mode == "swap" else None)
        self.swapped: deque[Sequence] = deque()  # oldest admission first; their tables hold host blocks
        self.num_swap_outs = 0            # sequences swapped out
        self.num_swap_ins = 0             # sequences swapped back in
        self.num_swapped_blocks_out = 0   # block copies device -> host
        self.num_swapped_blocks_in = 0    # block copies host -> device
        # Swap-mode preemptions that recomputed: the host pool was full, a sibling beam had to
        # be recomputed (beams swap all or none), or the victim had no K/V computed yet.
        self.num_swap_fallbacks = 0
        # This iteration's swaps, gathered by _preempt / the swap-in phase for SchedulerOutput.
        self._step_swap_out: list[tuple[int, int]] = []
        self._step_swap_map: dict[int, int] = {}   # device block -> its host copy, this iteration
        self._step_swapped_out: list[Sequence] = []

    # ---- requests in and out -------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request, or raise ``ValueError`` saying why it can never be served.
        A rejected request changes nothing."""
        self.check_request(request)
        if request.beam is not None:
            request.beam_search = BeamSearch(request.beam, self.eos_token_ids,
                                             self._max_len(request) - len(request.prompt_token_ids))
            # Each beam reports as many log-probabilities as the step keeps candidates.
            request.params.logprobs = request.beam_search.num_candidates
        self.requests[request.request_id] = request
        self.waiting.extend(request.seqs)

    def check_request(self, request: Request) -> None:
        """Raise ``ValueError`` if ``request`` can never be served by this scheduler."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if request.params.n > self.max_num_seqs:
            raise ValueError(f"request {rid!r}: n={request.params.n} samples exceed "
                             f"max_num_seqs={self.max_num_seqs}")
        num_prompt = len(request.prompt_token_ids)
        if num_prompt == 0:
            raise ValueError(f"request {rid!r}: the prompt is empty")
        if any(not 0 <= s.num_external_tokens < len(s.token_ids) for s in request.seqs):
            raise ValueError(f"request {rid!r}: KV arriving from elsewhere must leave at least "
                             "one token to compute")
        if self.max_model_len is not None and num_prompt >= self.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt of {num_prompt} tokens is too long: the model "
                f"allows {self.max_model_len} tokens in all (prompt + at least one new token)")
        longest = self._max_len(request)
        if not self.enable_chunked_prefill and longest > self.max_num_batched_tokens:
            # A preempted sequence is recomputed whole, prompt and output: in one iteration.
            raise ValueError(
                f"request {rid!r}: prompt + max_tokens = {longest} tokens exceeds "
                f"max_num_batched_tokens={self.max_num_batched_tokens} and chunked prefill is off: "
                "once preempted, it could never be recomputed")
        capacity = self.allocator.num_blocks * self.block_size
        if self._tokens_to_hold(request, longest) > capacity:
            raise ValueError(
                f"request {rid!r}: needs room for {self._tokens_to_hold(request, longest)} tokens "
                f"but the whole KV cache holds {capacity} "
                f"({self.allocator.num_blocks} blocks x {self.block_size})")
        if request.beam is not None:
            self._check_beams(request, longest)

    def _check_beams(self, request: Request, longest: int) -> None:
        """A beam-search request must fit as a whole: its beams step together, so all of them
        run in one batch, and after a preemption by recompute each beam holds its own copy
        of every block (sharing resumes only at the next forks)."""
        rid, k = request.request_id, request.beam.beam_width
        wanted = num_candidates(request.beam, self.eos_token_ids)
        if wanted > MAX_LOGPROBS:
            raise ValueError(
                f"request {rid!r}: beam_width={k} with {len(self.eos_token_ids)} EOS ids needs the "
                f"{wanted} best tokens of each beam (max(2, 1 + EOS ids) x beam_width), more than the "
                f"{MAX_LOGPROBS} log-probabilities reported per token: lower beam_width or set ignore_eos")
        if k > self.max_num_seqs:
            raise ValueError(f"request {rid!r}: beam_width={k} beams exceed max_num_seqs={self.max_num_seqs} "
                             "(the beams of a request run in the same batch)")
        if k > self.max_num_batched_tokens:
            raise ValueError(f"request {rid!r}: beam_width={k} beams exceed max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}: they could never decode in one iteration")
        if not self.enable_chunked_prefill and k * longest > self.max_num_batched_tokens:
            raise ValueError(
                f"request {rid!r}: beam_width x (prompt + max_tokens) = {k} x {longest} tokens exceeds "
                f"max_num_batched_tokens={self.max_num_batched_tokens} and chunked prefill is off: once "
                "preempted, its beams could never be recomputed together")
        blocks = k * cdiv(self._tokens_to_hold(request, longest), self.block_size)
        if blocks > self.allocator.num_blocks:
            raise ValueError(
                f"request {rid!r}: beam_width={k} beams of up to {longest} tokens may need {blocks} blocks "
                f"(each its own copy after a preemption), but the KV cache has {self.allocator.num_blocks}")

    def _max_len(self, request: Request) -> int:
        """The most tokens one sequence of ``request`` can reach: prompt + max_tokens,
        capped by the model's length."""
        longest = len(request.prompt_token_ids) + request.params.max_tokens
        return longest if self.max_model_len is None else min(longest, self.max_model_len)

    def _tokens_to_hold(self, request: Request, longest: int) -> int:
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
        """End ``seq`` now: the one place a sequence retires, whatever ended it.

        Its finish reason is set here, once (a finished sequence is left alone); its blocks
        go back (policy hook ``_release``). When it was its request's last unfinished
        sequence, the request retires too: it leaves ``requests``, gets its
        ``finished_time`` and is returned. Otherwise returns None.
        """
        if seq.status is Status.FINISHED:
            return None
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.SWAPPED:
            self.swapped.remove(seq)     # its table holds host blocks: _release frees them
        else:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq.block_table is not None:
            self._release(seq, reason)
        request = seq.request
        if not request.finished or self.requests.get(request.request_id) is not request:
            return None
        del self.requests[request.request_id]
        request.finished_time = now
        return request

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

    def swap_stats(self) -> dict:
        """The swapping counters, for ``LLM.stats()`` and the simulator's metrics
        (``docs/swapping.md`` defines each)."""
        host = self.host_allocator
        return {
            "preemption_mode": self.preemption_mode,
            "num_swapped": self.num_swapped,
            "num_swap_outs": self.num_swap_outs,
            "num_swap_ins": self.num_swap_ins,
            "num_swapped_blocks_out": self.num_swapped_blocks_out,
            "num_swapped_blocks_in": self.num_swapped_blocks_in,
            "num_swap_fallbacks": self.num_swap_fallbacks,
            "num_host_blocks": host.num_blocks if host is not None else 0,
            "num_free_host_blocks": host.num_free_blocks if host is not None else 0,
        }

    # ---- one iteration -----------------------------------------------------------
    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        """Plan the next iteration; the block tables grow to cover the tokens it computes.
        ``now`` (the engine's clock) stamps requests scheduled for the first time."""
        self.step += 1
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []
        self._step_swap_out, self._step_swap_map, self._step_swapped_out = [], {}, []

        # 1. Running sequences, oldest first. If memory runs out, the newest give way
        #    (a beam-search request's beams are planned, and give way, together).
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.request.beam is not None:
                i, budget = self._schedule_beams(i, budget, scheduled, copies, preempted)
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            table = seq.block_table
            while table.blocks_needed(num_new) > self.allocator.num_free_blocks:
                self._preempt_newest(i, preempted)
                if seq.status is not Status.RUNNING:
                    break
            if seq.status is not Status.RUNNING:
                break                   # it preempted itself: it was the newest left
            if num_new > 0:
                copies += self._grow(seq, num_new)
                scheduled.append(self._scheduled(seq, num_new))
                budget -= num_new
            i += 1

        # 1b. Swapped sequences come back before any new request is admitted (vLLM v0's
        #     order), a request at a time, oldest first; not in an iteration that preempted.
        swap_in: list[tuple[int, int]] = []
        swapped_in: list[Sequence] = []
        if self.swapped and not preempted:
            budget = self._swap_in_phase(budget, scheduled, copies, swap_in, swapped_in)

        # 2. Waiting requests, in order, while budgets and blocks allow (not in an
        #    iteration that had to preempt: memory is short, admitting would thrash;
        #    nor while a request waits in host memory: it goes first).
        num_cached = 0
        if not preempted and not self.swapped and self._batch_may_grow():
            width = self._num_seq_slots_promised() if self.waiting else 0
            while self.waiting and budget > 0:
                seq = self.waiting[0]
                if seq.request.beam is not None:
                    # A beam-search request's waiting beams are admitted together, or not yet.
                    group = [s for s in self.waiting if s.request is seq.request]
                    group_width = sum(s.request.width for s in group)
                    if width + group_width > self.max_num_seqs:
                        break
                    plans = self._admit_beams(group, budget)
                    if plans is None:
                        break
                    width += group_width
                    for member, (num_new, new_copies) in zip(group, plans):
                        self.waiting.remove(member)
                        member.status = Status.RUNNING
                        self.running.append(member)
                        num_cached += member.num_cached_tokens
                        copies += new_copies
                        if num_new:
                            scheduled.append(self._scheduled(member, num_new))
                        budget -= num_new
                    if seq.request.first_scheduled_time is None:
                        seq.request.first_scheduled_time = now
                    continue
                seq_width = seq.request.width
                if width + seq_width > self.max_num_seqs:
                    break
                admitted = self._admit(seq, budget)
                if admitted is None:
                    break               # FCFS: nobody overtakes the head of the queue
                self.waiting.popleft()
                width += seq_width
                num_new, new_copies = admitted
                seq.status = Status.RUNNING
                self.running.append(seq)
                num_cached += seq.num_cached_tokens
                copies += new_copies
                scheduled.append(self._scheduled(seq, num_new))
                budget -= num_new
                if seq.request.first_scheduled_time is None:
                    seq.request.first_scheduled_time = now

        # Prefill chunks first, then decodes: the layout the model runner packs.
        scheduled.sort(key=lambda s: not s.is_prefill)
        self.num_cached_prompt_tokens += num_cached
        return SchedulerOutput(self.step, scheduled, copies, preempted, num_cached,
                               swap_out=self._step_swap_out, swap_in=swap_in,
                               swapped_out=self._step_swapped_out, swapped_in=swapped_in,
                               block_size=self.block_size)

    # ---- beam search: a request's beams are planned, preempted and admitted together ------
    def _preempt_newest(self, first: int, preempted: list[Sequence]) -> None:
        """Preempt the newest running sequence. A beam takes its sibling beams with it (those
        at index >= ``first``, not yet planned in this iteration): beams can only step
        together, so a beam left running alone would hold blocks and wait."""
        victim = self.running.pop()
        group = [victim]
        if victim.request.beam is not None:
            group += [s for s in self.running[first:] if s.request is victim.request]
            for s in group[1:]:
                self.running.remove(s)
        for s in group:
            self._preempt(s)
            preempted.append(s)

    def _schedule_beams(self, i: int, budget: int, scheduled: list[ScheduledSeq],
                        copies: list[tuple[int, int]], preempted: list[Sequence]) -> tuple[int, int]:
        """Phase 1 for the beams of one request, ``running[i]`` the first of them (a request's
        running beams sit next to each other: forks go after their parent, groups are
        admitted and swapped in together). Each beam computes its missing tokens, but its
        last one (whose log-probabilities feed the beam step) only in an iteration where
        every beam of the request computes its last one: beams step together. When the
        blocks run short the newest sequences give way, maybe these beams themselves.
        Returns (index of the next sequence to plan, token budget left)."""
        request = self.running[i].request
        end = i
        while end < len(self.running) and self.running[end].request is request:
            end += 1
        group = self.running[i:end]
        todo = [s.num_uncomputed_tokens for s in group]
        last = len(group) == len(request.live_beams) and sum(todo) <= budget
        plan, left = [], budget
        for t in todo:
            n = max(0, min(t if last else t - 1, left))
            plan.append(n)
            left -= n
        while self._beam_blocks_needed(group, plan) > self.allocator.num_free_blocks:
            self._preempt_newest(i, preempted)
            if group[0].status is not Status.RUNNING:
                return i, budget        # they preempted themselves: they were the newest left
        for seq, n in zip(group, plan):
            if n:
                copies += self._grow(seq, n)
                scheduled.append(self._scheduled(seq, n))
        return end, left

    def _beam_blocks_needed(self, group: list[Sequence], plan: list[int]) -> int:
        """Blocks that growing each beam of ``group`` by ``plan`` tokens takes, copy-on-write
        counted exactly: of m beams writing into a shared, partly filled last block, all m
        copy it if someone else holds it too, else m - 1 (the last writer holds it alone)."""
        need, writers = 0, {}
        for seq, n in zip(group, plan):
            if not n:
                continue
            table = seq.block_table
            shared = table.num_tokens % self.block_size and self.allocator.ref_count(table.block_ids[-1]) > 1
            need += table.blocks_needed(n) - bool(shared)
            if shared:
                writers[table.block_ids[-1]] = writers.get(table.block_ids[-1], 0) + 1
        for block, m in writers.items():
            need += m if self.allocator.ref_count(block) > m else m - 1
        return need

    def _admit_beams(self, group: list[Sequence], budget: int) -> list[tuple[int, list]] | None:
        """Admit every waiting beam of one request, or none (returns None, changing nothing
        but prefix-cache recency). As in phase 1, a beam computes its last token only if
        all of them can in this iteration."""
        hits = [len(BlockTable(self.allocator, s.request.cache_salt).peek_cached_prefix(
                    s.token_ids, len(s.token_ids) - 1)) * self.block_size for s in group]
        last = sum(len(s.token_ids) - h for s, h in zip(group, hits)) <= budget
        plans, left = [], budget
        for seq, h in zip(group, hits):
            cap = left if last else max(0, min(left, len(seq.token_ids) - 1 - h))
            admitted = self._admit(seq, cap)
            if admitted is None:
                for done in group[:len(plans)]:     # undo: the group waits whole
                    done.block_table.free()
                    done.block_table = None
                    done.num_computed_tokens = done.num_cached_tokens = 0
                return None
            plans.append(admitted)
            left -= admitted[0]
        return plans

    def _num_seq_slots_promised(self) -> int:
        """Batch slots the running sequences will fill: an n > 1 request that has not
        forked yet forks into n sequences after its prefill, so it counts n."""
        return sum(s.request.width for s in self.running)

    def _grow(self, seq: Sequence, num_new: int) -> list[tuple[int, int]]:
        start = seq.num_computed_tokens
        # computed=False: these slots get their K/V only when the iteration runs, so
        # they enter the prefix cache in update(), not now.
        return seq.block_table.append_tokens(seq.token_ids[start:start + num_new], computed=False)

    def _scheduled(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        """The plan for one sequence. Samples: none mid-prompt; one per sample index of the
        request (0 .. n-1) when an n > 1 request forks; else one for the sequence itself."""
        if seq.num_computed_tokens + num_new < len(seq.token_ids):
            indices: tuple[int, ...] = ()
        elif seq.request.forked:
            indices = (seq.index,)
        else:
            indices = tuple(range(seq.request.params.n))
        return ScheduledSeq(seq, num_new, seq.is_prefill, seq.num_computed_tokens, indices)

    def _batch_may_grow(self) -> bool:
        """Whether new requests may join now (policy hook: continuous batching says always)."""
        return True

    def _admit(self, seq: Sequence, budget: int) -> tuple[int, list[tuple[int, int]]] | None:
        """Give the waiting ``seq`` a block table for its first chunk, or return None if
        it does not fit now. Prefix-cache hits cut both the blocks and the tokens to compute."""
        tokens = seq.token_ids
        table = BlockTable(self.allocator, seq.request.cache_salt)
        external = seq.num_external_tokens
        # The last token is always computed: its logits give the next token. A request that
        # wants its prompt's logprobs computes every prompt position (cached KV has no logits).
        limit = 0 if seq.request.needs_prompt_logits else len(tokens) - 1
        hits = [] if external else table.peek_cached_prefix(tokens, limit)
        num_cached = external or len(hits) * self.block_size
        remaining = len(tokens) - num_cached
        num_new = min(remaining, budget)
        if num_new < remaining and not self.enable_chunked_prefill:
            return None
        revived = sum(1 for b in hits if self.allocator.ref_count(b) == 0)
        need = cdiv(num_cached + num_new, self.block_size) - len(hits) + revived
        reserve = self.watermark_blocks if self.running else 0
        if need > self.allocator.num_free_blocks - reserve:
            return None
        if external:
            # KV that arrived with the sequence (disaggregated prefill): hold it, compute none.
            # Like computed KV, it enters the prefix cache only once this iteration has run
            # (update): before that, no executor has written it into these blocks.
            table.append_tokens(tokens[:external], computed=False)
            seq.num_computed_tokens, seq.num_cached_tokens, seq.num_external_tokens = external, 0, 0
        else:
            seq.num_computed_tokens = table.reuse_cached_prefix(tokens, limit)
            seq.num_cached_tokens = seq.num_computed_tokens
        seq.block_table = table
        return num_new, self._grow(seq, num_new)

    def _preempt(self, seq: Sequence) -> None:
        """Take ``seq`` out of the running batch, keeping every token.

        In "swap" mode its KV blocks are copied to host blocks and it waits in ``swapped``,
        its ``num_computed_tokens`` kept (``_swap_out``). In "recompute" mode, or when it
        cannot be swapped (counted in ``num_swap_fallbacks``), its KV is dropped and it goes
        to the head of the waiting queue, to be prefilled again.
        """
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.preemption_mode == "swap":
            # Only computed K/V is swapped. A sequence that computed nothing yet (a beam
            # admitted with no chunk) has none: it just waits, so a SWAPPED sequence always
            # has num_computed_tokens > 0. Nor may its table hold slots grown for this
            # iteration (no K/V in them yet to copy).
            table = seq.block_table
            if seq.num_computed_tokens and table.num_tokens == seq.num_computed_tokens and self._swap_out(seq):
                return
            self.num_swap_fallbacks += 1
        seq.block_table.free()
        seq.block_table = None
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _swap_out(self, seq: Sequence) -> bool:
        """Preempt by swapping: move ``seq``'s blocks to host blocks (the executor copies
        them, device -> host, before this iteration's batch runs). Returns False, changing
        nothing, when the host pool has too few free blocks.

        Shared blocks: a device block that a sequence swapped out earlier in this iteration
        also held (its n > 1 siblings, its beams, a prefix-cache hit) is copied once and
        its host copy shared by reference count, as on the device. One still held by a
        running sequence is copied, and the runner keeps it. The freed device blocks keep
        their K/V until the copies have read them (swap-out comes first), so prefix-cache
        registrations stay true.
        """
        table = seq.block_table
        together = [seq]
        if seq.request.beam is not None:
            # Beams are swapped all or none: with those preempted beside it (running, out of
            # the running list), unless one of them already had to be recomputed, or will
            # be (it computed nothing yet: no K/V to swap).
            if any(s.status is Status.WAITING for s in seq.request.seqs):
                return False
            together = [s for s in seq.request.seqs if s.status is Status.RUNNING and s not in self.running]
            if not all(s.num_computed_tokens for s in together):
                return False
        new = {b for s in together for b in s.block_table.block_ids} - self._step_swap_map.keys()
        if len(new) > self.host_allocator.num_free_blocks:
            return False
        host_table, pairs = table.copy_to(self.host_allocator, self._step_swap_map)
        device_blocks = list(table.block_ids)
        table.free()
        for b in device_blocks:
            if self.allocator.ref_count(b) == 0:    # free now: it may be reused this iteration
                del self._step_swap_map[b]
        seq.block_table = host_table
        seq.status = Status.SWAPPED
        self.swapped.appendleft(seq)            # victims go newest first: oldest stays ahead
        self._step_swap_out += pairs
        self._step_swapped_out.append(seq)
        self.num_swap_outs += 1
        self.num_swapped_blocks_out += len(pairs)
        return True

    def _swap_in_phase(self, budget: int, scheduled: list[ScheduledSeq], copies: list[tuple[int, int]],
                       swap_in: list[tuple[int, int]], swapped_in: list[Sequence]) -> int:
        """Bring swapped requests back, a request at a time, oldest first, while device
        blocks and batch slots allow, and schedule them in this iteration (FCFS: when the
        oldest cannot come back, nobody overtakes it).

        A request's swapped sequences come back together. A beam-search request's beams
        always do, all or none: they step together, so a beam back alone would wait for
        siblings that could never follow. A beam may come back computing nothing in this
        iteration (its siblings used the token budget). The samples of an n > 1 request
        are independent: when nothing else runs and they do not all fit, as many as fit
        come back, so that nobody waits forever (the rest follow as room frees).
        Returns the token budget left."""
        width = self._num_seq_slots_promised()
        while self.swapped and budget > 0:
            request = self.swapped[0].request
            group = [s for s in self.swapped if s.request is request]
            while group:
                plan = self._swap_in_plan(group, budget)
                seq_width = sum(s.request.width for s in group)
                if plan is not None and width + seq_width <= self.max_num_seqs:
                    break
                if self.running or request.beam is not None:
                    return budget           # wait until running sequences make room
                group.pop()
            if not group:
                return budget
            moved: dict[int, int] = {}          # host block -> its device copy
            for seq in group:
                self.swapped.remove(seq)
                host_table = seq.block_table
                seq.block_table, pairs = host_table.copy_to(self.allocator, moved)
                host_table.free()
                swap_in += pairs
                self.num_swapped_blocks_in += len(pairs)
                seq.status = Status.RUNNING
                self.running.append(seq)
                swapped_in.append(seq)
            self.num_swap_ins += len(group)
            width += seq_width
            for seq, num_new in zip(group, plan):   # grow once every table is rebuilt: a
                if num_new:                         # shared last block is then copied on write
                    copies += self._grow(seq, num_new)
                    scheduled.append(self._scheduled(seq, num_new))
                    budget -= num_new
        return budget

    def _swap_in_plan(self, group: list[Sequence], budget: int) -> list[int] | None:
        """Tokens each sequence of ``group`` would compute if swapped in now, or None when
        the token budget or the device blocks (for its host blocks, each copied once, and
        for its growth, copy-on-write included) do not allow it.

        A beam may plan 0 tokens: it computed its token before it was swapped, or its
        siblings used the budget. It comes back with them all the same (beams return
        together) and computes in a later iteration. Any other sequence needs a chunk."""
        bs = self.block_size
        holders: dict[int, int] = {}
        for seq in group:
            for b in seq.block_table.block_ids:
                holders[b] = holders.get(b, 0) + 1
        need, plan = len(holders), []
        for seq in group:
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new < seq.num_uncomputed_tokens and not self.enable_chunked_prefill:
                num_new = 0                 # the whole rest in one chunk, or nothing
            if num_new == 0 and seq.num_uncomputed_tokens and seq.request.beam is None:
                return None
            budget -= num_new
            plan.append(num_new)
            table, computed = seq.block_table, seq.num_computed_tokens
            need += cdiv(computed + num_new, bs) - len(table.block_ids)
            if computed % bs and holders[table.block_ids[-1]] > 1:
                need += 1                   # the shared, partly filled last block: copy-on-write
        reserve = self.watermark_blocks if self.running else 0
        return plan if need <= self.allocator.num_free_blocks - reserve else None

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
        (``_beam_step``) once every beam of the request has its log-probabilities.
        Returns the requests that finished in this iteration.
        """
        finished: list[Request] = []
        beam_requests: dict[str, Request] = {}
        for k, (item, tokens) in enumerate(zip(output.scheduled, sampled, strict=True)):
            seq = item.seq
            if seq.status is not Status.RUNNING:
                continue                       # aborted while the batch ran
            seq.num_computed_tokens += item.num_new_tokens
            seq.block_table.cache_computed_blocks(seq.num_computed_tokens)
            if item.is_prefill:
                self.num_prompt_tokens_computed += item.num_new_tokens
            if item.num_samples == 0:
                continue
            if len(tokens) != item.num_samples:
                raise ValueError(f"{seq}: expected {item.num_samples} sampled tokens, got {len(tokens)}")
            request = seq.request
            if request.beam is not None:
                entry = logprobs[k][0] if logprobs is not None and logprobs[k] else None
                if entry is None:
                    raise ValueError(f"{seq}: beam search needs the executor's log-probabilities, got none")
                seq.beam_logprobs = {t: lp.logprob for t, lp in entry.items()}
                beam_requests[request.request_id] = request
                continue
            family = [seq]
            if not request.forked:
                family += self._fork(seq, len(tokens) - 1)
                request.forked = True
            if request.first_token_time is None:
                request.first_token_time = now
            for member, token in zip(family, tokens):
                member.token_ids.append(token)
                self.num_generated_tokens += 1
                if stop_string is not None and stop_string(member):
                    reason: str | None = "stop"
                else:
                    reason = self._stop_reason(member, token)
                if reason is not None:
                    done = self.finish_sequence(member, reason, now)
                    if done is not None:
                        finished.append(done)
        for seq in output.swapped_in:           # beams back from host memory may be ready
            if seq.request.beam is not None:
                beam_requests.setdefault(seq.request.request_id, seq.request)
        for request in beam_requests.values():
            done = self._beam_step(request, now)
            if done is not None:
                finished.append(done)
        return finished

    def _beam_step(self, request: Request, now: float) -> Request | None:
        """Once every live beam of ``request`` has its next-token log-probabilities: one step
        of beam search (``labkit.beam_search``), applied to the sequences. Beams that no
        candidate continues die first (their blocks return at once, before anyone copies);
        then each surviving parent keeps its first child in its own sequence and forks
        one sequence per further child, sharing every block (the partly filled last block
        is copied on write when the children append). Returns the request when the search
        is over (its hypotheses are ``request.beam_search.outputs()``), else None."""
        beams = request.live_beams
        if not beams:
            return None                         # aborted while the batch ran: nothing to do
        if any(b.beam_logprobs is None or b.status is not Status.RUNNING for b in beams):
            return None                         # a beam is still computing: they step together
        search = request.beam_search
        length = beams[0].num_output_tokens + 1
        step = search.step([(b.output_token_ids, b.cumulative_logprob, b.beam_logprobs) for b in beams], length)
        for b in beams:
            b.beam_logprobs = None
        if request.first_token_time is None:
            request.first_token_time = now
        if step.done:
            reason = "length" if length >= search.max_new_tokens else "stop"
            retired = None
            for b in beams:
                retired = self.finish_sequence(b, reason, now) or retired
            return retired
        children: list[list] = [[] for _ in beams]
        for c in step.running:
            children[c.parent].append(c)
        for b, kids in zip(beams, children):
            if not kids:
                self.finish_sequence(b, "pruned", now)
                self.num_beam_deaths += 1
        for b, kids in zip(beams, children):
            if kids:
                family = [b] + self._fork(b, len(kids) - 1)
                self.num_beam_forks += len(kids) - 1
                for member, c in zip(family, kids):
                    member.token_ids.append(c.token)
                    member.cumulative_logprob = c.cum_logprob
                    self.num_generated_tokens += 1
        request.forked = True
        return None

    def _fork(self, parent: Sequence, count: int) -> list[Sequence]:
        """Parallel sampling and beam search: ``count`` children share the parent's blocks
        (copy-on-write)."""
        return self._make_children(parent, count, None)

    def _make_children(self, parent: Sequence, count: int, reserve: int | None) -> list[Sequence]:
        """``_fork``, or with ``reserve`` given (the static baseline), children that share
        nothing: each gets a table of its own reserving ``reserve`` tokens, holding the
        parent's tokens (the caller copies their KV)."""
        children = []
        at = self.running.index(parent) + 1
        for _ in range(count):
            child = Sequence(parent.request, list(parent.token_ids), index=len(parent.request.seqs))
            if reserve is None:
                child.block_table = parent.block_table.fork()
            else:
                child.block_table = BlockTable(self.allocator, parent.request.cache_salt)
                child.block_table.reserve(reserve)
                child.block_table.append_tokens(parent.token_ids[:parent.num_computed_tokens], computed=False)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            if parent.logprobs is not None:
                child.logprobs = list(parent.logprobs)
                child.cumulative_logprob = parent.cumulative_logprob
            child.status = Status.RUNNING
            parent.request.seqs.append(child)
            children.append(child)
        self.running[at:at] = children
        return children

    def fork(self, parent: Sequence) -> Sequence:
        """Fork a decoding sequence now (what beam search and on-demand sampling do): the
        child shares every block with its parent and runs from the next iteration on.
        Raises ``ValueError`` (changing nothing) for a sequence that is not decoding, or
        when the batch is full."""
        if parent.status is not Status.RUNNING or parent not in self.running:
            raise ValueError(f"{parent} is not running")
        if parent.num_output_tokens == 0 or parent.num_uncomputed_tokens != 1:
            raise ValueError(f"{parent} is still prefilling its prompt: fork it once it decodes")
        if self._num_seq_slots_promised() >= self.max_num_seqs:
            raise ValueError(f"the batch is full (max_num_seqs={self.max_num_seqs}, counting the "
                             "samples of n > 1 requests that fork after their prefill)")
        return self._fork(parent, 1)[0]

    def sequences_holding_blocks(self) -> list[Sequence]:
        """Every sequence that holds KV blocks now, in admission order (the widgets draw them)."""
        return list(self.running)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.request.params
        num_out = seq.num_output_tokens
        if token in params.stop_token_ids and num_out >= params.min_tokens:
            return "stop"
        if not params.ignore_eos and token in self.eos_token_ids and num_out >= params.min_tokens:
            return "stop"
        if num_out >= params.max_tokens:
            return "length"
        if self.max_model_len is not None and len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _release(self, seq: Sequence, reason: str) -> None:
        """Return a finished sequence's blocks (policy hook: continuous frees at once)."""
        seq.block_table.free()
        seq.block_table = None

    # ---- records -------------------------------------------------------------------
    def make_record(self, output: SchedulerOutput, finished: list[Request],
                    time_s: float, duration_s: float) -> StepRecord:
        """A plain summary of the iteration, for widgets, plots and benchmarks."""
        ran, prefill, decode = [], 0, 0
        for item in output.scheduled:
            ran.append((item.seq.request.request_id, item.seq.index, item.num_new_tokens, item.phase))
            if item.is_prefill:
                prefill += item.num_new_tokens
            else:
                decode += item.num_new_tokens
        alloc = self.allocator
        logical = sum(len(s.block_table.block_ids) for s in self.sequences_holding_blocks()
                      if s.block_table is not None)
        return StepRecord(
            step=output.step, time_s=time_s, duration_s=duration_s, ran=ran,
            num_prefill_tokens=prefill, num_decode_tokens=decode,
            num_running=len(self.running), num_waiting=len(self.waiting),
            num_used_blocks=alloc.num_used_blocks, num_free_blocks=alloc.num_free_blocks,
            num_cached_free_blocks=alloc.num_cached_free_blocks,
            kv_cache_usage=kv_cache_usage(alloc), held_slot_fill=held_slot_fill(alloc),
            preempted=[s.request.request_id for s in output.preempted],
            finished=[r.request_id for r in finished],
            num_cached_tokens=output.num_cached_tokens,
            num_copies=len(output.copies),
            swapped_out=[s.request.request_id for s in output.swapped_out],
            swapped_in=[s.request.request_id for s in output.swapped_in],
            num_swapped=len(self.swapped),
            num_logical_blocks=logical,
        )
