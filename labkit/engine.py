"""The engine loop: schedule -> execute -> update, once per iteration.

The same loop drives the real model (``ModelExecutor``: a Llama on paged KV, plus the
sampler) and the simulator (``SimExecutor``: a cost model and deterministic dummy tokens).
Only the executor differs, so the notebooks' animations, the simulator's long traces and
real generation all go through the same scheduler and block manager.

An executor has one method, ``execute(plan) -> ExecuteResult``, and two attributes:
``simulated`` (whether its durations are modelled rather than measured) and
``vocab_size`` (token ids a prompt may hold). One that drafts (``ModelExecutor`` with
speculative or jump-forward decoding on) also has ``speculator``, whose guesses the engine
fits around the scheduler (``labkit.spec_decode.speculator``). Given a tokenizer, the engine also turns
tokens into text as they arrive and stops sequences at their stop strings, in the same
iteration. Requests and sequences retire in one place, ``Scheduler.finish_sequence``.
"""

from __future__ import annotations

import copy
import itertools
import time
from dataclasses import dataclass
from typing import Protocol

from .beam_search import num_candidates
from .detokenizer import IncrementalDetokenizer
from .errors import InvalidParameter, LimitExceeded, RequestError
from .request import Request, Sequence, Status
from .sampling_params import BeamSearchParams, SamplingParams
from .scheduler import Scheduler, SchedulerOutput, StepRecord, held_slot_fill, kv_cache_usage
from .stop_strings import StopMatcher


@dataclass(slots=True)
class ExecuteResult:
    """What an executor returns: tokens sampled per scheduled sequence, and the time taken.

    Optional, for requests that ask (None otherwise, and from executors without a model):
    ``logprobs[i]`` holds one ``{token: Logprob}`` per token in ``sampled[i]``;
    ``prompt_logprobs[i]`` is ``(first, entries)``: the entries of prompt tokens
    ``first, first + 1, ..`` that ``scheduled[i]``'s chunk computed.
    """

    sampled: list[list[int]]
    duration_s: float
    logprobs: list[list[dict] | None] | None = None
    prompt_logprobs: list[tuple[int, list[dict]] | None] | None = None


class Executor(Protocol):
    simulated: bool
    vocab_size: int

    def execute(self, plan: SchedulerOutput) -> ExecuteResult: ...


class Engine:
    """Owns a scheduler and an executor and runs iterations.

    The clock is the wall clock for a real executor, and a simulated clock (advanced by
    the executor's modelled durations) for a simulated one; request timings use it.
    ``records`` keeps one ``StepRecord`` per iteration when ``keep_records`` is true.
    """

    def __init__(self, scheduler: Scheduler, executor: Executor, tokenizer=None,
                 keep_records: bool = True):
        self.scheduler = scheduler
        self.executor = executor
        self.tokenizer = tokenizer
        self.keep_records = keep_records
        self.records: list[StepRecord] = []
        self._ids = itertools.count()
        self._sim_now = 0.0
        self._t0 = time.perf_counter()
        self.busy_s = 0.0               # time spent in iterations (executor + bookkeeping)
        self.schedule_s = 0.0           # time spent in schedule() + update(), measured
        self.num_steps = 0
        self.last_plan: SchedulerOutput | None = None
        self._detok: dict[int, IncrementalDetokenizer] = {}   # seq_id -> its text so far
        self.deltas: dict[int, str] = {}                      # seq_id -> text gained last step
        self._shown: dict[int, int] = {}                      # seq_id -> chars already in deltas
        self._stops: dict[int, StopMatcher] = {}              # seq_id -> its place in its stop strings

    @property
    def now(self) -> float:
        if self.executor.simulated:
            return self._sim_now
        return time.perf_counter() - self._t0

    def advance_to(self, t: float) -> None:
        """Move a simulated clock forward (idle time until the next arrival)."""
        if self.executor.simulated and t > self._sim_now:
            self._sim_now = t

    # ---- requests ------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | BeamSearchParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    prompt: str | None = None, cache_salt: str | None = None) -> Request:
        """Queue a request; it joins the batch at the next iteration with room for it.
        ``BeamSearchParams`` make it a beam-search request (its beams are its sequences).
        ``cache_salt``: its prefix-cache namespace (vLLM's; ``Request``).
        Raises a ``RequestError`` (a ``ValueError``, ``labkit/errors.py``; changing nothing)
        if it can never be served: bad sampling parameters, a grammar that does not compile,
        token ids outside the vocabulary, a prompt too long for the model or the KV cache."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise ValueError(f"expected SamplingParams or BeamSearchParams, got {type(params).__name__}")
        params.validate()
        vocab = self.executor.vocab_size
        if isinstance(params, BeamSearchParams) and num_candidates(params, self.scheduler.eos_token_ids) > vocab:
            raise LimitExceeded(f"request {request_id!r}: beam_width={params.beam_width} needs "
                                f"{num_candidates(params, self.scheduler.eos_token_ids)} candidate tokens per "
                                f"beam (max(2, 1 + EOS ids) x beam_width), more than the vocabulary's {vocab}",
                                "beam_width")
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidParameter(f"request {request_id!r}: token ids out of range [0, {vocab}): {bad[:5]}",
                                   "prompt")
        if isinstance(params, SamplingParams) and params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidParameter(f"SamplingParams.logit_bias: token {max(params.logit_bias)} is outside the "
                                   f"vocabulary [0, {vocab})", "logit_bias")
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            _check_grammar(self.executor, params)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        request = Request(request_id, prompt_token_ids, params,
                          self.now if arrival_time is None else arrival_time, prompt=prompt, cache_salt=cache_salt)
        self.scheduler.add_request(request)
        return request

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks now (its finished samples keep their finish
        reason). Returns False when no unfinished request has that id."""
        return self.scheduler.abort(request_id, self.now)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- one iteration -----------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one iteration. Returns the requests that finished in it. Raises
        ``RuntimeError`` when requests are unfinished yet nothing could be scheduled (a
        scheduler bug: nothing would ever change, and a caller's loop would hang)."""
        start = self.now
        t0 = time.perf_counter()
        spec = getattr(self.executor, "speculator", None)   # speculative decoding (labkit.spec_decode)
        if spec is not None:
            spec.stop_strings = self._stop_string_at
            spec.draft(self.scheduler)                # guessed tokens join their sequences
        plan = self.scheduler.schedule(start)
        if spec is not None:
            spec.fit(plan, self.scheduler)            # guesses the plan gave no slot are taken back
        t1 = time.perf_counter()
        self.last_plan = plan
        if plan.is_empty:
            self.deltas.clear()
            if self.scheduler.has_unfinished:
                # Nothing will change by itself: stepping again would spin forever.
                raise RuntimeError(
                    f"the scheduler planned nothing while {len(self.scheduler.requests)} requests are "
                    f"unfinished ({self.scheduler.num_running} running, {self.scheduler.num_waiting} "
                    "waiting): a scheduling bug, reported instead of hanging")
            return []
        result = self.executor.execute(plan)
        t2 = time.perf_counter()
        if spec is not None:                          # rejected guesses give their slots back
            spec.settle(plan, self.scheduler, keep_empty_blocks=self.scheduler.policy == "static")
        if self.executor.simulated:
            self._sim_now += result.duration_s
        end = self.now
        if self.tokenizer is None:
            finished = self.scheduler.update(plan, result.sampled, end, logprobs=result.logprobs)
        else:
            finished = self.scheduler.update(plan, result.sampled, end, self._detokenize, result.logprobs)
            self._collect_deltas(plan)
        if result.logprobs is not None or result.prompt_logprobs is not None:
            _record_logprobs(plan, result)
        t3 = time.perf_counter()
        self.schedule_s += (t1 - t0) + (t3 - t2)
        self.busy_s += end - start
        self.num_steps += 1
        if self.keep_records:
            record = self.scheduler.make_record(plan, finished, start, end - start)
            if spec is not None:
                record.num_draft_tokens, record.num_accepted_tokens = spec.step_drafted, spec.step_accepted
            self.records.append(record)
        return finished

    def run(self) -> None:
        """Step until every queued request has finished."""
        while self.scheduler.has_unfinished:
            self.step()

    def _detokenize(self, seq: Sequence) -> bool:
        """Extend ``seq``'s text with its new tokens; True if it now holds a stop string
        (the text is cut before it, as vLLM does). The scheduler asks this in ``update``,
        so a stop string ends the sequence there, with the one finish reason it gets."""
        detok = self._detok.get(seq.seq_id)
        if detok is None:
            detok = self._detok[seq.seq_id] = IncrementalDetokenizer(self.tokenizer)
        new = seq.output_token_ids[len(detok.token_ids):]
        params = seq.request.params
        if not params.stop:
            detok.add(new)
            return False
        # One token at a time: a step that kept guessed tokens (speculative decoding) gains
        # several, and min_tokens arms the stop strings at a token of its own.
        before = seq.num_output_tokens - len(new)
        for j, token in enumerate(new):
            detok.add([token])
            if self._cut_at_stop(seq, detok, before + j + 1 >= params.min_tokens):
                return True
        return False

    def _collect_deltas(self, plan: SchedulerOutput) -> None:
        """``deltas``: the text each sampled sequence gained in this iteration. Text that
        might still turn out to begin a stop string is held back until it cannot, so a
        stream never shows characters that the stop later cuts."""
        self.deltas.clear()
        for item in plan.scheduled:
            seqs = item.seq.request.seqs
            for index in item.sample_indices:
                detok = self._detok.get(seqs[index].seq_id) if index < len(seqs) else None
                if detok is None:
                    continue                  # aborted while the batch ran: never sampled
                seq = seqs[index]
                shown = self._shown.get(seq.seq_id, 0)
                end = len(detok.text)
                if seq.status is not Status.FINISHED:
                    end -= self._stop_prefix_len(seq)
                self.deltas[seq.seq_id] = detok.text[shown:end]
                self._shown[seq.seq_id] = max(shown, end)

    def _cut_at_stop(self, seq: Sequence, detok: IncrementalDetokenizer, armed: bool) -> bool:
        """Feed ``seq``'s new text to its stop-string automaton (``labkit/stop_strings.py``:
        a cost per character that does not grow with the number of stop strings); if a stop
        string ends in it, cut the text where that string begins. ``armed=False`` (fewer
        than ``min_tokens`` tokens yet): follow the text, stop at nothing."""
        matcher = self._stops.get(seq.seq_id)
        if matcher is None:
            matcher = self._stops[seq.seq_id] = StopMatcher(seq.request.params.stop)
        cut = matcher.feed(detok.text, armed)
        if cut is None:
            return False
        detok.text = detok.text[:cut]
        return True

    def _stop_string_at(self, seq: Sequence, tokens: list[int]) -> int | None:
        """The index of the first of ``tokens`` (guesses a step keeps, to follow ``seq``'s output
        so far) after which ``seq``'s text holds a stop string, or None. Reads copies of its
        detokenizer and stop automaton: the text state stays as it was (``update`` feeds them)."""
        if self.tokenizer is None or not seq.request.params.stop:
            return None
        known = self._detok.get(seq.seq_id)
        detok = IncrementalDetokenizer(self.tokenizer)
        if known is not None:
            detok.token_ids, detok.text = list(known.token_ids), known.text
            detok.prefix_offset, detok.read_offset = known.prefix_offset, known.read_offset
        matcher = copy.copy(self._stops.get(seq.seq_id) or StopMatcher(seq.request.params.stop))
        done = len(seq.output_token_ids) - len(tokens)    # the guesses are at the end of the sequence
        detok.add(seq.output_token_ids[len(detok.token_ids):done])
        min_tokens = seq.request.params.min_tokens
        for j, token in enumerate(tokens):
            detok.add([token])
            if matcher.feed(detok.text, done + j + 1 >= min_tokens) is not None:
                return j
        return None

    def _stop_prefix_len(self, seq: Sequence) -> int:
        """Length of the longest tail of ``seq``'s text that could still become a stop
        string (0 without stop strings): its automaton's depth, O(1)."""
        matcher = self._stops.get(seq.seq_id)
        return matcher.pending if matcher is not None else 0

    def text_of(self, seq: Sequence) -> str:
        """The detokenized output of ``seq`` so far (stop strings cut away)."""
        detok = self._detok.get(seq.seq_id)
        return detok.text if detok is not None else ""

    def release(self, request: Request) -> None:
        """Forget a finished request's text state (the caller has read its output)."""
        for seq in request.seqs:
            self._detok.pop(seq.seq_id, None)
            self.deltas.pop(seq.seq_id, None)
            self._shown.pop(seq.seq_id, None)
            self._stops.pop(seq.seq_id, None)

    @property
    def num_tracked_sequences(self) -> int:
        """Sequences whose text the engine still keeps (0 once every request was released)."""
        return len(self._detok.keys() | self._shown.keys() | self._stops.keys())

    # ---- numbers for notebooks and benchmarks --------------------------------------
    def stats(self) -> dict:
        """The engine's and the KV cache's numbers now; ``docs/stats.md`` defines each key."""
        s, a = self.scheduler, self.scheduler.allocator
        return {
            "policy": s.policy,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_free_blocks": a.num_free_blocks,
            "num_used_blocks": a.num_used_blocks,
            "num_cached_free_blocks": a.num_cached_free_blocks,
            "num_total_blocks": a.num_blocks,
            "block_size": a.block_size,
            "kv_cache_usage": kv_cache_usage(a),
            "held_slot_fill": held_slot_fill(a),
            "prefix_cache_hit_rate": a.prefix_cache_hit_rate,
            "num_prefix_cache_queries": a.num_cache_queries,
            "num_prefix_cache_hits": a.num_cache_hits,
            "num_cached_prompt_tokens": s.num_cached_prompt_tokens,
            "num_preemptions": s.num_preemptions,
            "num_generated_tokens": s.num_generated_tokens,
            "num_prompt_tokens_computed": s.num_prompt_tokens_computed,
            "num_steps": self.num_steps,
            **s.tier_stats(),
            **self._spec_stats(),
        }

    def _spec_stats(self) -> dict:
        """Speculative decoding's counters (``spec_decode_*``: drafts, drafted and accepted
        tokens, acceptance rate, mean acceptance length), when the executor speculates."""
        config = getattr(self.executor, "speculative_config", None)
        if config is None:
            return {}
        stats = self.executor.speculator.stats
        return {"spec_decode_method": config.method, "num_speculative_tokens": config.num_speculative_tokens,
                **stats.as_dict()}


def _check_grammar(executor: Executor, params: SamplingParams) -> None:
    """Compile a request's grammar for the model's vocabulary now (cached per spec), so a
    grammar that cannot serve is refused at ``add_request``: ``ValueError``."""
    grammars = getattr(executor, "grammars", None)
    if grammars is None:
        raise RequestError(f"SamplingParams.structured_outputs: {type(executor).__name__} cannot constrain "
                           "its tokens (the simulator samples dummy tokens): serve a model",
                           "structured_outputs", "unsupported_parameter")
    grammars.check(params.structured_outputs)


def _record_logprobs(plan: SchedulerOutput, result: ExecuteResult) -> None:
    """Append the iteration's logprobs to the sequences that gained those tokens in
    ``update`` (and the prompt's to its request). A sequence that did not gain its token
    (aborted while the batch ran) gets none, so ``logprobs`` always matches the output."""
    for k, item in enumerate(plan.scheduled):
        request = item.seq.request
        if result.prompt_logprobs is not None and result.prompt_logprobs[k] is not None:
            first, entries = result.prompt_logprobs[k]
            have = request.prompt_logprobs
            if first <= len(have):
                have.extend(entries[len(have) - first:])
        if result.logprobs is None or result.logprobs[k] is None:
            continue
        for index, entry in zip(item.sample_indices, result.logprobs[k], strict=True):
            seq = request.seqs[index] if index < len(request.seqs) else None
            if seq is None or seq.logprobs is None or len(seq.logprobs) != seq.num_output_tokens - 1:
                continue
            seq.logprobs.append(entry)
            seq.cumulative_logprob += entry[seq.token_ids[-1]].logprob
