"""What ``LLM.generate`` returns: vLLM-shaped records, so code ports between the two."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request (``n`` of them when ``SamplingParams.n > 1``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None      # "stop", "length", "abort", "error"; None while running

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
