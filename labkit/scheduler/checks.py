"""The limits a scheduler checks: its own settings, a request when it arrives, and a
sequence after each new token.

``Scheduler.add_request`` calls ``check_request`` first: a request that no amount of
waiting would let run (a prompt longer than the model, more KV than the whole cache, beams
that could never step together) gets a ``RequestError`` (a ``ValueError``, ``labkit/errors.py``)
naming the limit and the field at fault, and changes nothing; the engine keeps serving
the others. Everything else is admitted eventually.
``stop_reason`` says whether a sequence is done after the token it just gained (stop
strings are the engine's: they need the text).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..beam_search import num_candidates
from ..errors import ContextLengthExceeded, DuplicateRequestId, InvalidParameter, LimitExceeded
from ..request import Request, Sequence, Status
from ..sampling_params import MAX_LOGPROBS
from ..utils import cdiv

if TYPE_CHECKING:   # the checks read the scheduler's limits; the import is for type hints only
    from .scheduler import Scheduler

PREEMPTION_MODES = ("recompute", "swap")


def check_config(max_num_seqs: int, max_num_batched_tokens: int, watermark: float, preemption_mode: str,
                 num_host_blocks: int) -> None:
    """Raise ``ValueError`` naming the first scheduler setting that makes no sense."""
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


def check_offload(allocator, num_offload_blocks: int) -> None:
    """Raise ``ValueError`` for a host tier that cannot work: a negative size, or no prefix
    cache in front of it (the tier keeps what the cache evicts)."""
    if isinstance(num_offload_blocks, bool) or not isinstance(num_offload_blocks, int) or num_offload_blocks < 0:
        raise ValueError(f"num_offload_blocks must be a non-negative integer, got {num_offload_blocks!r}")
    if num_offload_blocks and allocator.prefix_cache is None:
        raise ValueError("a host tier (kv_offloading_size) keeps the blocks the prefix cache evicts: "
                         "turn prefix caching on (enable_prefix_caching=True, 'hash' or 'radix')")


def check_request(sched: Scheduler, request: Request) -> None:
    """Raise a ``RequestError`` if ``sched`` can never serve ``request``."""
    rid = request.request_id
    if rid in sched.requests:
        raise DuplicateRequestId(f"request id {rid!r} is already in use")
    if request.params.n > sched.max_num_seqs:
        raise LimitExceeded(f"request {rid!r}: n={request.params.n} samples exceed max_num_seqs={sched.max_num_seqs}",
                            "n")
    num_prompt = len(request.prompt_token_ids)
    if num_prompt == 0:
        raise InvalidParameter(f"request {rid!r}: the prompt is empty", "prompt")
    if any(not 0 <= s.num_external_tokens < len(s.token_ids) for s in request.seqs):
        raise InvalidParameter(f"request {rid!r}: KV arriving from elsewhere must leave at least one token to "
                               "compute", "prompt")
    if sched.max_model_len is not None and num_prompt >= sched.max_model_len:
        raise ContextLengthExceeded(
            f"request {rid!r}: prompt of {num_prompt} tokens is too long: the model "
            f"allows {sched.max_model_len} tokens in all (prompt + at least one new token)")
    longest = sched.max_len(request)
    if not sched.enable_chunked_prefill and longest > sched.max_num_batched_tokens:
        # A preempted sequence is recomputed whole, prompt and output: in one iteration.
        raise ContextLengthExceeded(
            f"request {rid!r}: prompt + max_tokens = {longest} tokens exceeds "
            f"max_num_batched_tokens={sched.max_num_batched_tokens} and chunked prefill is off: "
            "once preempted, it could never be recomputed")
    capacity, need = sched.allocator.num_blocks * sched.block_size, sched.tokens_to_hold(request, longest)
    if need > capacity:
        raise ContextLengthExceeded(f"request {rid!r}: needs room for {need} tokens but the whole KV cache "
                                    f"holds {capacity} ({sched.allocator.num_blocks} blocks x {sched.block_size})")
    if request.beam is not None:
        check_beams(sched, request, longest)


def check_beams(sched: Scheduler, request: Request, longest: int) -> None:
    """A beam-search request must fit as a whole: its beams step together, so all of them
    run in one batch, and after a preemption by recompute each beam holds its own copy of
    every block (sharing resumes only at the next forks)."""
    rid, k = request.request_id, request.beam.beam_width
    wanted = num_candidates(request.beam, sched.eos_token_ids)
    if wanted > MAX_LOGPROBS:
        raise LimitExceeded(
            f"request {rid!r}: beam_width={k} with {len(sched.eos_token_ids)} EOS ids needs the "
            f"{wanted} best tokens of each beam (max(2, 1 + EOS ids) x beam_width), more than the "
            f"{MAX_LOGPROBS} log-probabilities reported per token: lower beam_width or set ignore_eos",
            "beam_width")
    if k > sched.max_num_seqs:
        raise LimitExceeded(f"request {rid!r}: beam_width={k} beams exceed max_num_seqs={sched.max_num_seqs} "
                            "(the beams of a request run in the same batch)", "beam_width")
    if k > sched.max_num_batched_tokens:
        raise LimitExceeded(f"request {rid!r}: beam_width={k} beams exceed max_num_batched_tokens="
                            f"{sched.max_num_batched_tokens}: they could never decode in one iteration",
                            "beam_width")
    if not sched.enable_chunked_prefill and k * longest > sched.max_num_batched_tokens:
        raise LimitExceeded(
            f"request {rid!r}: beam_width x (prompt + max_tokens) = {k} x {longest} tokens exceeds "
            f"max_num_batched_tokens={sched.max_num_batched_tokens} and chunked prefill is off: once "
            "preempted, its beams could never be recomputed together", "beam_width")
    num_blocks = sched.allocator.num_blocks
    blocks = k * cdiv(sched.tokens_to_hold(request, longest), sched.block_size)
    if blocks > num_blocks:
        raise LimitExceeded(
            f"request {rid!r}: beam_width={k} beams of up to {longest} tokens may need {blocks} blocks "
            f"(each its own copy after a preemption), but the KV cache has {num_blocks}", "beam_width")


def check_fork(sched: Scheduler, parent: Sequence) -> None:
    """Raise ``ValueError`` unless ``parent`` can fork now: it decodes, and the batch has a
    slot for the child."""
    if parent.status is not Status.RUNNING or parent not in sched.running:
        raise ValueError(f"{parent} is not running")
    if parent.num_output_tokens == 0 or parent.num_uncomputed_tokens != 1:
        raise ValueError(f"{parent} is still prefilling its prompt: fork it once it decodes")
    if sched.num_seq_slots_promised() >= sched.max_num_seqs:
        raise ValueError(f"the batch is full (max_num_seqs={sched.max_num_seqs}, counting the "
                         "samples of n > 1 requests that fork after their prefill)")


def stop_reason(seq: Sequence, token: int, eos_token_ids: frozenset[int], max_model_len: int | None) -> str | None:
    """``"stop"`` (a stop token or EOS, once ``min_tokens`` are out), ``"length"``
    (``max_tokens`` out, or the model's length reached) or None, for ``seq`` that just
    gained ``token``."""
    params = seq.request.params
    num_out = seq.num_output_tokens
    if token in params.stop_token_ids and num_out >= params.min_tokens:
        return "stop"
    if not params.ignore_eos and token in eos_token_ids and num_out >= params.min_tokens:
        return "stop"
    if num_out >= params.max_tokens:
        return "length"
    if max_model_len is not None and len(seq.token_ids) >= max_model_len:
        return "length"
    return None
