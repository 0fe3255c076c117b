"""``speculative_config``: what to draft with, and how many tokens, in vLLM's words.

    LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                 "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    LLM(..., speculative_config={"method": "draft_layers", "num_layers": 8, "num_speculative_tokens": 3})
    LLM(..., speculative_config={"model": "tiny-llama", "num_speculative_tokens": 3})

The keys are vLLM's where vLLM has them (``method``, ``model``, ``num_speculative_tokens``,
``prompt_lookup_min``, ``prompt_lookup_max``, ``disable_by_batch_size``); ``num_layers``
(the draft's depth, for ``draft_layers``) and ``draft_sampling`` are labkit's. A key that
is not one of these, or a value out of range, is refused with a ``ValueError`` naming it,
before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Mapping

#: The drafting methods: prompt lookup; the target's own first layers (self-speculation);
#: a separate, smaller model with the same tokenizer.
METHODS = ("ngram", "draft_layers", "draft_model")
#: How a model draft picks its tokens: "argmax" (a point mass: with seeds, the output is the
#: very tokens decoding without speculation gives) or "sample" (from the draft's
#: distribution q: the output has the same distribution, by rejection sampling).
DRAFT_SAMPLING = ("argmax", "sample")
#: vLLM's default prompt-lookup window when neither bound is given.
DEFAULT_LOOKUP = 5


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """One engine's speculative decoding settings (``from_dict`` reads vLLM's dict)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None        # ngram: the shortest suffix matched
    prompt_lookup_max: int | None = None        # ngram: the longest suffix matched
    num_layers: int | None = None               # draft_layers: how many of the target's layers draft
    model: object = None                        # draft_model: a model name, path or LoadedModel
    draft_sampling: str = "argmax"              # draft_layers, draft_model: see DRAFT_SAMPLING
    disable_by_batch_size: int | None = None    # no drafting in a step whose batch is larger

    @classmethod
    def from_dict(cls, spec: Mapping | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """The config a ``speculative_config=`` value asks for (None: no speculation).
        ``"method"`` may be left out when ``"model"`` names a draft model; vLLM v0's
        ``"model": "[ngram]"`` means the n-gram method."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if not isinstance(spec, Mapping):
            raise ValueError(f"speculative_config must be a dict (vLLM's keys), got {type(spec).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; labkit takes {sorted(known)}")
        values = dict(spec)
        if values.get("model") == "[ngram]":
            values.pop("model")
            values.setdefault("method", "ngram")
        if values.get("method") is None:
            if values.get("model") is None:
                raise ValueError("speculative_config needs a 'method' (one of "
                                 f"{', '.join(METHODS)}) or a draft 'model'")
            values["method"] = "draft_model"
        if "num_speculative_tokens" not in values:
            raise ValueError("speculative_config needs 'num_speculative_tokens': how many tokens to draft per step")
        if values["method"] == "ngram":
            lo, hi = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
            values["prompt_lookup_min"] = lo if lo is not None else (hi if hi is not None else DEFAULT_LOOKUP)
            values["prompt_lookup_max"] = hi if hi is not None else values["prompt_lookup_min"]
        config = cls(**values)
        config.check()
        return config

    def check(self) -> None:
        """``ValueError`` naming the first setting that cannot work."""
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {METHODS}, got {self.method!r}")
        if not _is_int(self.num_speculative_tokens) or not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError("speculative_config: num_speculative_tokens must be an integer in [1, 64], "
                             f"got {self.num_speculative_tokens!r}")
        wrong = [name for name, used in (("prompt_lookup_min", self.method == "ngram"),
                                         ("prompt_lookup_max", self.method == "ngram"),
                                         ("num_layers", self.method == "draft_layers"),
                                         ("model", self.method == "draft_model"))
                 if not used and getattr(self, name) is not None]
        if wrong:
            raise ValueError(f"speculative_config: {wrong} do not apply to method {self.method!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (_is_int(lo) and _is_int(hi) and 1 <= lo <= hi):
                raise ValueError("speculative_config: need integers 1 <= prompt_lookup_min <= prompt_lookup_max, "
                                 f"got {lo!r} and {hi!r}")
        if self.method == "draft_layers" and (not _is_int(self.num_layers) or self.num_layers < 1):
            raise ValueError("speculative_config: draft_layers needs num_layers, a positive integer "
                             f"(how many of the target's first layers draft), got {self.num_layers!r}")
        if self.method == "draft_model" and self.model is None:
            raise ValueError("speculative_config: draft_model needs 'model', the draft's name or path")
        if self.draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(f"speculative_config: draft_sampling must be one of {DRAFT_SAMPLING}, "
                             f"got {self.draft_sampling!r}")
        if self.disable_by_batch_size is not None and (not _is_int(self.disable_by_batch_size)
                                                       or self.disable_by_batch_size < 1):
            raise ValueError("speculative_config: disable_by_batch_size must be a positive integer or None, "
                             f"got {self.disable_by_batch_size!r}")

    def describe(self) -> str:
        """A short label, for load lines and benchmark tables."""
        k = self.num_speculative_tokens
        if self.method == "ngram":
            return f"ngram k={k} n={self.prompt_lookup_min}..{self.prompt_lookup_max}"
        if self.method == "draft_layers":
            return f"draft_layers k={k} layers={self.num_layers}"
        name = self.model if isinstance(self.model, str) else getattr(self.model, "name", "draft")
        return f"draft_model {name} k={k}"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
