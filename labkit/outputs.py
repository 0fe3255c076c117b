"""What ``LLM.generate`` returns: vLLM-shaped records, so code ports between the two."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request import Request


@dataclass(slots=True)
class Logprob:
    """One token's log-probability at one position, as vLLM reports it.

    ``logprob`` is the natural log of the token's probability under the model's RAW
    distribution: ``log_softmax`` of the logits, before temperature, penalties,
    ``logit_bias`` and top-k/top-p/min-p (vLLM's default "raw_logprobs"). So it says what
    the model believes, whatever the sampler then did with it.
    """

    logprob: float
    rank: int                           # 1 = the most likely token at that position
    decoded_token: str | None = None    # tokenizer.decode([id]); None without a tokenizer


SampleLogprobs = list[dict[int, Logprob]]          # one dict per generated token
PromptLogprobs = list[dict[int, Logprob] | None]   # one per prompt token; the first is None


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request (``n`` of them when ``SamplingParams.n > 1``).

    With ``SamplingParams.logprobs=k``, ``logprobs[i]`` maps the i-th generated token and
    the k most likely tokens at that position (k or k + 1 entries) to their ``Logprob``;
    ``cumulative_logprob`` is the sum of the chosen tokens' logprobs. Both None otherwise.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None      # "stop", "length", "abort", "error"; None while running
                                          # (a beam search's dead beams say "pruned": docs/beam_search.md)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timings in seconds on the engine's clock."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """A request's prompt and samples. In a stream, ``outputs[i].text`` grows and
    ``delta`` holds the text each sample gained in the last iteration."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None
    delta: list[str] = field(default_factory=list)
    # With SamplingParams.prompt_logprobs=k: entry i > 0 holds prompt token i's Logprob given
    # the tokens before it, plus the k most likely tokens there; entry 0 is None.
    prompt_logprobs: PromptLogprobs | None = None


def request_output(request: "Request", texts: list[str], delta: list[str] | None = None) -> RequestOutput:
    """The output of ``request`` now: one ``CompletionOutput`` per sample, in sample order
    (``request.seqs`` order). ``texts[i]`` and ``delta[i]`` are sample ``i``'s text so far
    and text gained (the caller keeps the detokenizer); ``LLM`` and ``AsyncEngine`` both
    build their outputs here."""
    seqs = request.seqs
    return RequestOutput(
        request_id=request.request_id, prompt=request.prompt,
        prompt_token_ids=list(request.prompt_token_ids),
        outputs=[CompletionOutput(s.index, text, list(s.output_token_ids), s.finish_reason,
                                  None if s.logprobs is None else list(s.logprobs), s.cumulative_logprob)
                 for s, text in zip(seqs, texts, strict=True)],
        finished=request.finished,
        metrics=RequestMetrics(request.arrival_time, request.first_scheduled_time,
                               request.first_token_time, request.finished_time),
        num_cached_tokens=max((s.num_cached_tokens for s in seqs), default=0),
        delta=list(delta) if delta is not None else [],
        prompt_logprobs=None if request.prompt_logprobs is None else list(request.prompt_logprobs))


def error_output(request_id: str, prompt: str | None, prompt_token_ids: list[int], error: str,
                 arrival_time: float) -> RequestOutput:
    """The finished output of a request that was rejected: ``finish_reason="error"``."""
    return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=list(prompt_token_ids),
                         outputs=[CompletionOutput(0, "", [], "error")], finished=True,
                         metrics=RequestMetrics(arrival_time), error=error)


@dataclass(slots=True)
class BeamSearchSequence:
    """One finished beam of ``LLM.beam_search`` (vLLM's names).

    ``tokens`` is prompt + output, as in vLLM; ``cum_logprob`` the sum of the output tokens'
    raw log-probabilities; ``score`` the length-penalised score the beams are ranked by
    (``cum_logprob / len(output_token_ids) ** length_penalty``).
    """

    tokens: list[int]
    output_token_ids: list[int]
    text: str
    cum_logprob: float
    score: float
    finish_reason: str | None = None    # "stop" (EOS), "length", "abort"


@dataclass(slots=True)
class BeamSearchOutput:
    """A beam-search request's result: its ``sequences``, best score first."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]
    error: str | None = None
