"""How to sample a request's tokens and when to stop. Names follow vLLM's offline API."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import InvalidParameter
from .structured.params import StructuredOutputsParams

GREEDY_EPS = 1e-5   # temperatures below this are greedy (argmax), as in vLLM
MAX_LOGPROBS = 20   # the most top-k logprobs a request may ask for (OpenAI's limit)


def is_greedy(temperature: float) -> bool:
    """Whether ``temperature`` means greedy decoding: the one definition every layer uses."""
    return temperature < GREEDY_EPS


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def validate_distribution(temperature: float, top_p: float = 1.0, top_k: int = 0,
                          owner: str = "SamplingParams") -> None:
    """Raise ``InvalidParameter`` (naming ``owner.field``) for settings that define no distribution.
    ``SamplingParams`` and the sampler's ``SamplingRow`` both check with this."""
    if not (_is_number(temperature) and math.isfinite(temperature) and temperature >= 0):
        raise InvalidParameter(f"{owner}.temperature={temperature!r}: must be a finite number >= 0 (0 means greedy)",
                               "temperature")
    if not (_is_number(top_p) and 0.0 < top_p <= 1.0):
        raise InvalidParameter(f"{owner}.top_p={top_p!r}: must be in (0, 1]", "top_p")
    if not (isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= -1):
        raise InvalidParameter(f"{owner}.top_k={top_k!r}: must be an integer >= 0 (0 or -1 disables it)", "top_k")


@dataclass(slots=True)
class SamplingParams:
    """Per-request generation settings, checked when made so bad values never reach the engine.

    ``temperature=0`` (below ``GREEDY_EPS``) is greedy decoding (argmax, exactly Hugging
    Face's greedy).
    ``n`` samples share the prompt: it is prefilled once, then the sequence forks and the
    samples share the prompt's KV blocks copy-on-write.

    Logits are processed in this order (``docs/sampling.md``): ``logit_bias`` is added;
    ``repetition_penalty`` (Transformers' rule, over prompt and generated tokens), then
    ``presence_penalty`` and ``frequency_penalty`` (OpenAI's rule, over generated tokens
    only); then greedy takes the argmax, or random sampling applies temperature, top-k,
    top-p and min-p and draws. Greedy requests get the bias and penalties too.

    ``logprobs=k`` / ``prompt_logprobs=k`` report the model's RAW log-probabilities (before
    any of the processing above) of each generated / prompt token plus the k most likely.
    A request asking ``prompt_logprobs`` does not read its prompt from the prefix cache (it
    needs the logits at every prompt position, which cached blocks do not keep); it still
    publishes its own blocks for later requests.

    ``structured_outputs`` (``docs/structured_outputs.md``): the output must match a JSON
    Schema, a regex, a choice or a grammar. The tokens the grammar forbids get logit ``-inf``
    first, before the bias and penalties; ``logprobs`` are then read after that mask. Refused
    alongside it: ``stop``, ``stop_token_ids``, ``min_tokens`` and ``ignore_eos``, which would
    end or extend the text where the grammar does not (the grammar says where it ends).
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
    logprobs: int | None = None             # top-k logprobs per generated token (0: the chosen only)
    prompt_logprobs: int | None = None      # top-k logprobs per prompt token
    presence_penalty: float = 0.0           # logit -= presence * (token generated yet)
    frequency_penalty: float = 0.0          # logit -= frequency * (times generated)
    repetition_penalty: float = 1.0         # seen logits: / penalty if > 0, * penalty if < 0
    min_p: float = 0.0                      # drop tokens with p < min_p * p_max
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit first
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must match

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None and isinstance(self.logit_bias, dict):
            # JSON keys arrive as strings ("50256": 5); accept those, as OpenAI does.
            try:
                self.logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                pass  # validate() names the bad key
        self.validate()

    def validate(self) -> None:
        """Raise ``InvalidParameter`` (a ``ValueError``) naming the first bad field."""
        def bad(name: str, why: str) -> None:
            raise InvalidParameter(f"SamplingParams.{name}={getattr(self, name)!r}: {why}", name)

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        validate_distribution(self.temperature, self.top_p, self.top_k)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad("seed", "must be an integer or None")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of token ids (integers >= 0)")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) \
                or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", "must be an integer in [0, max_tokens]")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_LOGPROBS):
                bad(name, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (_is_number(v) and -2.0 <= v <= 2.0):
                bad(name, "must be a number in [-2, 2]")
        if not (_is_number(self.repetition_penalty) and math.isfinite(self.repetition_penalty)
                and self.repetition_penalty > 0):
            bad("repetition_penalty", "must be a finite number > 0 (1 disables it)")
        if not (_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0):
            bad("min_p", "must be a number in [0, 1]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", "must be a dict {token id: bias} or None")
            for t, b in self.logit_bias.items():
                if not (isinstance(t, int) and not isinstance(t, bool) and t >= 0):
                    bad("logit_bias", f"key {t!r} is not a token id (an integer >= 0)")
                if not (_is_number(b) and -100.0 <= b <= 100.0):
                    bad("logit_bias", f"bias {b!r} for token {t} must be a number in [-100, 100]")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", "must be a labkit.StructuredOutputsParams or None")
            self.structured_outputs.validate()
            for name, default in (("stop", []), ("stop_token_ids", []), ("min_tokens", 0), ("ignore_eos", False)):
                if getattr(self, name) != default:
                    bad(name, "cannot be combined with structured_outputs: the grammar decides where the "
                        "output ends (a stop would cut it short of valid, ignoring the end would run past it)")

    @property
    def needs_penalties(self) -> bool:
        """Whether any logit processing beyond temperature/top-k/top-p is asked for."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 \
            or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)


@dataclass(slots=True)
class BeamSearchParams:
    """Beam search settings (vLLM's ``BeamSearchParams`` names), checked when made.

    ``beam_width`` beams are kept; each step extends every beam by its most likely tokens
    (``max(2, 1 + number of EOS ids) * beam_width`` of them, Transformers' ``beams_to_keep``:
    ``2 * beam_width`` with one EOS id or ``ignore_eos``) and keeps the best candidates by
    cumulative log-probability.
    ``max_tokens`` new tokens at most. A hypothesis's score is its cumulative log-probability
    divided by ``length ** length_penalty``, its length counting the tokens it generated (the
    EOS token included): > 0 favours longer outputs, < 0 shorter ones, 0 compares sums.
    ``ignore_eos``: the end-of-sequence token is an ordinary token, so every beam runs to
    ``max_tokens``. ``early_stopping`` is Transformers' (not in vLLM's class): ``False`` stops
    when no running beam can beat the worst kept hypothesis at its current length (the
    default); ``True`` stops as soon as ``beam_width`` hypotheses are finished; ``"never"``
    assumes the best case, ``max_tokens`` long, before stopping. ``docs/beam_search.md``
    gives the rules; ``labkit/beam_search.py`` is the algorithm.
    """

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``InvalidParameter`` (a ``ValueError``) naming the first bad field."""
        def bad(name: str, why: str) -> None:
            raise InvalidParameter(f"BeamSearchParams.{name}={getattr(self, name)!r}: {why}", name)

        if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool) \
                or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            bad("beam_width", f"must be an integer in [1, {MAX_BEAM_WIDTH}] (each beam reads at "
                f"least its 2 * beam_width best tokens, and at most {MAX_LOGPROBS} log-probabilities are "
                "kept per token, as in vLLM)")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not (_is_number(self.length_penalty) and math.isfinite(self.length_penalty)):
            bad("length_penalty", "must be a finite number (1.0: average log-probability per token)")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be True or False")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            bad("early_stopping", "must be True, False or 'never' (Transformers' meanings)")

    def sampling_params(self) -> SamplingParams:
        """What the engine runs each beam with: greedy, with the most likely tokens' raw
        log-probabilities reported (the beam step picks from those). ``2 * beam_width`` here;
        the scheduler raises it to ``max(2, 1 + number of EOS ids) * beam_width`` for a model
        with several EOS ids (``labkit.beam_search.num_candidates``)."""
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=self.ignore_eos,
                              logprobs=2 * self.beam_width)


MAX_BEAM_WIDTH = MAX_LOGPROBS // 2
