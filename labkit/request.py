"""Requests and sequences: the records the scheduler moves between its queues.

A *request* is what a user sent: a prompt and its SamplingParams. It owns one *sequence*
per sample: one at first; ``n > 1`` forks more when the prompt's prefill completes.
A sequence is what the scheduler schedules and what owns a block table.

A sequence's life: WAITING -> RUNNING -> FINISHED, and back to WAITING when preempted
(by recompute), or to SWAPPED and back to RUNNING (preempted by swapping: its KV waits in
host blocks, every computed token kept).
Its ``token_ids`` are prompt + generated tokens; ``num_computed_tokens`` of them have K/V
in the cache. Preemption by recompute drops the KV (``num_computed_tokens = 0``) but keeps
every token, so a resumed sequence continues exactly where it stopped.
"""

from __future__ import annotations

import enum
import itertools
import numbers

from .errors import InvalidParameter
from .memory import BlockTable
from .sampling_params import BeamSearchParams, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"     # preempted by swapping: its KV waits in host blocks
    FINISHED = "finished"


_seq_ids = itertools.count()


class Sequence:
    """One stream of tokens with its own block table."""

    __slots__ = ("seq_id", "request", "index", "token_ids", "num_prompt_tokens",
                 "num_computed_tokens", "block_table", "status", "finish_reason",
                 "num_preemptions", "num_cached_tokens", "num_external_tokens",
                 "logprobs", "cumulative_logprob", "beam_logprobs")

    def __init__(self, request: "Request", token_ids: list[int], index: int = 0):
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index                       # which of the request's n samples
        self.token_ids = token_ids
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: BlockTable | None = None
        self.status = Status.WAITING
        # None while unfinished; then "stop" (a stop token or string, or EOS), "length",
        # "abort", or "pruned": a beam that no candidate of the beam step continued
        # (it died; its request's hypotheses live in ``request.beam_search``).
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.num_cached_tokens = 0               # prompt tokens served by the prefix cache
        # Leading tokens whose KV was computed elsewhere and arrives with the sequence (a
        # prefill instance's transfer, disaggregated serving). Admission takes them as
        # computed, once: a later preemption drops that KV like any other.
        self.num_external_tokens = 0
        # One {token id: Logprob} per generated token, when SamplingParams.logprobs is set
        # (the engine appends them as tokens arrive; a fork copies its parent's). A beam keeps
        # only its cumulative log-probability: the beam step sets it.
        wants = request.params.logprobs is not None and request.beam is None
        self.logprobs: list | None = [] if wants else None
        self.cumulative_logprob: float | None = 0.0 if wants or request.beam is not None else None
        # A beam's next-token log-probabilities {token: logprob}, held until every beam of its
        # request has its own: then they step together (scheduler/beams.py, BeamGroups.step).
        self.beam_logprobs: dict[int, float] | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than the last token lacks K/V: a (re)computation of a prompt."""
        return len(self.token_ids) - self.num_computed_tokens > 1 or self.num_output_tokens == 0

    def __repr__(self) -> str:
        return (f"Sequence({self.request.request_id}#{self.index}, {self.status.value}, "
                f"tokens={len(self.token_ids)}, computed={self.num_computed_tokens})")


class Request:
    """A user's request: prompt, sampling settings, its sequences and its timings.

    A beam-search request (``params`` a ``BeamSearchParams``) keeps it in ``beam``, runs its
    beams with ``beam.sampling_params()`` (greedy, reporting the top log-probabilities: as
    many as the beam step keeps candidates, set by the scheduler), and holds its search
    state in ``beam_search`` (set by the scheduler). Its live beams are the ``seqs`` not
    finished; beams that died stay there, finished.

    ``cache_salt`` (vLLM's): the prefix-cache namespace of the request's block tables. Its
    prompt reuses, and publishes, cached blocks only among requests with the same salt
    (None: the shared namespace), so a salt nobody else knows keeps its prompt private.

    Times are in the engine's clock (wall seconds for the real model, simulated seconds
    for the simulator); None until the event happens.
    """

    __slots__ = ("request_id", "prompt_token_ids", "params", "arrival_time", "seqs",
                 "first_scheduled_time", "first_token_time", "finished_time", "forked",
                 "prompt", "error", "prompt_logprobs", "beam", "beam_search", "cache_salt", "unfinished")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | BeamSearchParams,
                 arrival_time: float = 0.0, prompt: str | None = None, cache_salt: str | None = None):
        check_cache_salt(cache_salt)
        self.cache_salt = cache_salt
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.beam: BeamSearchParams | None = params if isinstance(params, BeamSearchParams) else None
        self.beam_search = None                  # labkit.beam_search.BeamSearch, for beam requests
        if self.beam is not None:
            params = self.beam.sampling_params()
        self.params = params
        self.arrival_time = arrival_time
        self.prompt = prompt
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        # n > 1 forks once, after the prompt's prefill; a beam request forks into its beams then.
        self.forked = params.n == 1 and self.beam is None
        self.error: str | None = None
        # With SamplingParams.prompt_logprobs: one entry per prompt token computed so far
        # (entry 0, the first token, has none: None). It fills in prompt order, chunk by chunk.
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.seqs = [Sequence(self, list(self.prompt_token_ids))]
        # The sequences not finished yet, in the order they were made: a fork adds its children,
        # Scheduler.finish_sequence (the one place a sequence retires) takes each out. Beam search
        # makes and kills sequences every step; scanning all of ``seqs`` for the live ones would
        # make a long search quadratic.
        self.unfinished: list[Sequence] = list(self.seqs)

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether the prompt's logits are still wanted (prompt_logprobs not complete): such a
        request must compute its prompt, not read it from the prefix cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def width(self) -> int:
        """Batch slots the request's sequences take: ``n`` (``beam_width``) until it forks
        (its one sequence becomes n after the prompt's prefill), then 1 per sequence."""
        if self.forked:
            return 1
        return self.beam.beam_width if self.beam is not None else self.params.n

    @property
    def live_beams(self) -> list["Sequence"]:
        """The sequences of a beam-search request that are not finished: its beams now."""
        return list(self.unfinished)

    @property
    def finished(self) -> bool:
        # Before an n > 1 request forks it has one sequence; it can only finish by sampling
        # its first token (which forks it first) or by an abort, so "none unfinished" is right
        # either way.
        return not self.unfinished

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, prompt={len(self.prompt_token_ids)} tokens, n={self.params.n})"


def is_token_id(t) -> bool:
    """An integer that is not a bool (``True`` would otherwise pass as token 1)."""
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def check_cache_salt(salt) -> None:
    """A cache salt is None or a non-empty string (vLLM's rule); else ``ValueError``."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidParameter(f"cache_salt must be a non-empty string or None, got {salt!r}", "cache_salt")


def split_prompt(prompt) -> tuple[str | list[int], str | None]:
    """A prompt as vLLM's offline API takes it, as ``(text or token ids, cache_salt)``: a
    string, token ids, ``{"prompt": text}`` or ``{"prompt_token_ids": ids}`` (vLLM's
    ``TextPrompt``/``TokensPrompt``), the dicts with an optional ``"cache_salt"``. A dict
    with other keys (multi-modal data, say) raises ``ValueError`` naming them."""
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"})
    if unknown:
        raise InvalidParameter(f"a prompt dict takes 'prompt' or 'prompt_token_ids' and an optional 'cache_salt'; "
                               f"labkit does not support {unknown}", "prompt")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise InvalidParameter("a prompt dict needs exactly one of 'prompt' (text) and 'prompt_token_ids'", "prompt")
    salt = prompt.get("cache_salt")
    check_cache_salt(salt)
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise InvalidParameter(f"'prompt' in a prompt dict must be a string, got "
                                   f"{type(prompt['prompt']).__name__}", "prompt")
        return prompt["prompt"], salt
    return prompt["prompt_token_ids"], salt


def encode_prompt(prompt, tokenizer) -> tuple[str | None, list[int]]:
    """A prompt as (its text or None, its token ids): text is tokenized with the special
    tokens, as Hugging Face's ``generate`` does; token ids are taken as given (the engine
    checks their range); a prompt dict (``split_prompt``) gives its text or ids. Anything
    else (``True`` is not a token id) raises ``ValueError``. ``LLM`` and ``AsyncEngine``
    both read prompts with this."""
    prompt, _ = split_prompt(prompt)
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, (list, tuple)) and all(is_token_id(t) for t in prompt):
        return None, [int(t) for t in prompt]
    shown = f" {prompt[:5]!r}" if isinstance(prompt, (list, tuple)) else ""
    raise InvalidParameter("a prompt must be a string or a list of token ids (integers), got "
                           f"{type(prompt).__name__}{shown}", "prompt")
