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
sequence is *preempted by recompute*: its blocks are freed and it goes back to the head
of the waiting queue with every token it has, to be recomputed (prefilled) when memory
returns. It loses nothing; it only pays the recompute.

A sequence ends in one place, ``finish_sequence``, whatever ends it: a stop token or
string, its length, an abort. It sets the finish reason once, returns the blocks (policy
hook ``_release``), and retires the request when its last sequence is done.

Policy hooks (``_admit``, ``_release``, ``_batch_may_grow``) let the static-batching
baseline (``static.py``) reuse everything else.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable

from ..memory import BlockAllocator, BlockTable
from ..request import Request, Sequence, Status
from ..utils import cdiv
from .records import ScheduledSeq, SchedulerOutput, StepRecord, held_slot_fill, kv_cache_usage

# Called for each sequence that just gained a token, before the token-level stop checks:
# True when its text now contains a stop string (the engine's detokenizer answers).
StopStringCheck = Callable[[Sequence], bool]


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
    ):
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

    # ---- requests in and out -------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request, or raise ``ValueError`` saying why it can never be served.
        A rejected request changes nothing."""
        self.check_request(request)
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

    # ---- one iteration -----------------------------------------------------------
    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        """Plan the next iteration; the block tables grow to cover the tokens it computes.
        ``now`` (the engine's clock) stamps requests scheduled for the first time."""
        self.step += 1
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []

        # 1. Running sequences, oldest first. If memory runs out, the newest give way.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            table = seq.block_table
            while table.blocks_needed(num_new) > self.allocator.num_free_blocks:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break                   # it preempted itself: it was the newest left
            if num_new > 0:
                copies += self._grow(seq, num_new)
                scheduled.append(self._scheduled(seq, num_new))
                budget -= num_new
            i += 1

        # 2. Waiting requests, in order, while budgets and blocks allow (not in an
        #    iteration that had to preempt: memory is short, admitting would thrash).
        num_cached = 0
        if not preempted and self._batch_may_grow():
            width = self._num_seq_slots_promised() if self.waiting else 0
            while self.waiting and budget > 0:
                seq = self.waiting[0]
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
        return SchedulerOutput(self.step, scheduled, copies, preempted, num_cached)

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
        table = BlockTable(self.allocator)
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
        """Preempt by recompute: drop the KV, keep every token, go to the queue's head."""
        seq.block_table.free()
        seq.block_table = None
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- after the executor ------------------------------------------------------
    def update(self, output: SchedulerOutput, sampled: list[list[int]], now: float,
               stop_string: StopStringCheck | None = None) -> list[Request]:
        """Record what the iteration computed and sampled; finish what is done.

        ``sampled[i]`` holds the tokens sampled for ``output.scheduled[i]`` (as many as its
        ``num_samples``). ``stop_string``, if given, is asked about each sequence that
        gained a token, before its stop tokens and length (a stop string wins, as in vLLM).
        Returns the requests that finished in this iteration.
        """
        finished: list[Request] = []
        for item, tokens in zip(output.scheduled, sampled, strict=True):
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
        return finished

    def _fork(self, parent: Sequence, count: int) -> list[Sequence]:
        """Parallel sampling: ``count`` children share the parent's blocks (copy-on-write)."""
        children = []
        at = self.running.index(parent) + 1
        for _ in range(count):
            child = Sequence(parent.request, list(parent.token_ids), index=len(parent.request.seqs))
            child.block_table = parent.block_table.fork()
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
        )
