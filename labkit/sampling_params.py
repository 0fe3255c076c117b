"""How to sample a request's tokens and when to stop. Names follow vLLM's offline API."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """Per-request generation settings, checked when made so bad values never reach the engine.

    ``temperature=0`` is greedy decoding (argmax, exactly Hugging Face's greedy).
    ``n`` samples share the prompt: it is prefilled once, then the sequence forks and the
    samples share the prompt's KV blocks copy-on-write.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                  # 0 (or -1): no top-k cut
    seed: int | None = None         # same seed, same tokens, whatever else is in the batch
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        def bad(name: str, why: str) -> None:
            raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature < float("inf"):
            bad("temperature", "must be a number >= 0 (0 means greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad("seed", "must be an integer or None")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of token ids (integers >= 0)")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", "must be an integer in [0, max_tokens]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
