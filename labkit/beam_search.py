"""Beam search, one step at a time: which candidates live, which finish, when to stop.

A beam-search request keeps ``beam_width`` *beams*: partial outputs, each a sequence of
the engine with its own block table. Beams share their common prefix's KV blocks by
reference count, as the samples of ``n > 1`` do (PagedAttention paper, section 4.4).
Every step, after the model has run every live beam once:

1. **Candidates.** Each beam offers its ``c * beam_width`` most likely next tokens, scored
   by *cumulative* log-probability: the beam's own plus the token's. The best
   ``c * beam_width`` of all of them are kept, best first. ``c = max(2, 1 + number of EOS
   ids)`` (2 with ``ignore_eos``): even if every EOS id ranks among them, ``beam_width``
   candidates that do not end remain (``num_candidates``).
2. **Finished hypotheses.** A candidate that ends (an EOS token, unless ``ignore_eos``, or
   the ``max_tokens``-th token) and ranks among the first ``beam_width`` becomes a finished
   hypothesis, scored ``cumulative log-prob / length ** length_penalty`` (``length``: the
   tokens it generated, its EOS included). The ``beam_width`` best hypotheses are kept.
3. **Next beams.** The best ``beam_width`` candidates that do not end are the beams of the
   next step. A beam that is the parent of none of them *dies*: the engine frees its blocks
   at once. A parent with several children *forks*: they share its blocks, and the partly
   filled last block is copied only when a second child writes into it (copy-on-write).
4. **Stop** when no running beam can still beat the worst kept hypothesis, when
   ``early_stopping=True`` and ``beam_width`` hypotheses are finished, or when every
   candidate ended (``max_tokens`` reached).

These are exactly the rules of Hugging Face Transformers' ``_beam_search`` (5.x), so that
``LLM.beam_search`` returns the beams, in the order, of ``generate(num_beams=k,
do_sample=False, num_return_sequences=k, length_penalty=..., early_stopping=...)``:
log-probabilities are the raw ``log_softmax`` of the logits (no temperature, no
processors), scores are added and divided in float32 as there, ties keep the candidate
of the lower (beam, token) first. vLLM's own ``beam_search`` differs (its length counts
the prompt, every EOS candidate finishes, there is no early stopping): labkit follows the
reference it can be tested against. ``docs/beam_search.md`` says more.

This module knows nothing of blocks or schedulers: ``BeamSearch.step`` takes the beams'
log-probabilities and returns a ``BeamStep``; ``Scheduler`` applies it to sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .sampling_params import BeamSearchParams


def num_candidates(params: BeamSearchParams, eos_token_ids: frozenset[int] | set[int]) -> int:
    """Candidates kept per step, and so log-probabilities each beam needs from the model:
    ``max(2, 1 + number of EOS ids) * beam_width`` (Transformers' ``beams_to_keep``), so that
    ``beam_width`` candidates that do not end remain even when every EOS id ranks first."""
    num_eos = 0 if params.ignore_eos else len(eos_token_ids)
    return max(2, 1 + num_eos) * params.beam_width


def hypothesis_score(cumulative: float, length: int, length_penalty: float) -> float:
    """The score a finished hypothesis is ranked by: ``cumulative / length ** length_penalty``,
    in float32 as Transformers (near-ties must break the same way)."""
    return float(np.float32(cumulative) / np.float32(length ** length_penalty))


@dataclass(slots=True)
class Candidate:
    """One way to extend a beam: ``beams[parent]`` + ``token``, with its cumulative log-prob."""

    parent: int
    token: int
    cum_logprob: float


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: its generated tokens, cumulative log-prob and length-penalised score."""

    output_token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str          # "stop": it generated an EOS token; "length": max_tokens reached


@dataclass(slots=True)
class BeamStep:
    """What one step decided: the next beams (best first), and whether the search is over."""

    running: list[Candidate]
    done: bool
    num_new_hypotheses: int = 0


@dataclass(slots=True)
class BeamSearch:
    """The state of one request's search between steps: its finished hypotheses (best
    first, at most ``beam_width``) and whether a running beam may still beat them.

    ``max_new_tokens`` is ``params.max_tokens`` capped by the model's length (None: not
    capped, ``params.max_tokens``); it must be at least 1.
    """

    params: BeamSearchParams
    eos_token_ids: frozenset[int] = frozenset()
    max_new_tokens: int | None = None
    finished: list[Hypothesis] = field(default_factory=list)
    improvable: bool = True     # Transformers' "is_early_stop_heuristic_unsatisfied"

    def __post_init__(self) -> None:
        if self.max_new_tokens is None:
            self.max_new_tokens = self.params.max_tokens
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"BeamSearch.max_new_tokens must be an integer >= 1 (or None for "
                             f"params.max_tokens), got {self.max_new_tokens!r}")

    @property
    def width(self) -> int:
        return self.params.beam_width

    @property
    def num_candidates(self) -> int:
        return num_candidates(self.params, self.eos_token_ids)

    def candidates(self, beams: list[tuple[float, dict[int, float]]]) -> list[Candidate]:
        """Step 1: the best ``num_candidates`` continuations over all beams, best first.
        ``beams[b]`` is (cumulative log-prob, {token: log-prob} of its most likely tokens)."""
        parents = [b for b, (_, top) in enumerate(beams) for _ in top]
        tokens = [t for _, top in beams for t in top]
        # Cumulative log-probs in float32, as Transformers adds them (one vector op: this
        # runs for every request at every step of the simulator's long traces).
        cums = np.array([cum for cum, _ in beams], dtype=np.float32)[parents]
        total = cums + np.array([lp for _, top in beams for lp in top.values()], dtype=np.float32)
        best = np.lexsort((tokens, parents, -total))[:self.num_candidates]
        return [Candidate(parents[j], tokens[j], float(total[j])) for j in best]

    def ends(self, token: int, length: int) -> bool:
        """Whether a candidate whose last token is ``token``, ``length`` tokens long, ends."""
        return length >= self.max_new_tokens or (not self.params.ignore_eos and token in self.eos_token_ids)

    def step(self, beams: list[tuple[list[int], float, dict[int, float]]], length: int) -> BeamStep:
        """One step over the live beams ``(output tokens so far, cumulative log-prob, top
        log-probs)``; ``length`` is the number of tokens each beam holds after this step."""
        k, params = self.width, self.params
        cands = self.candidates([(cum, top) for _, cum, top in beams])
        ends = [self.ends(c.token, length) for c in cands]
        # 3. The next beams: the best candidates that do not end.
        running = [c for c, e in zip(cands, ends, strict=True) if not e][:k]
        # 2. New hypotheses: candidates among the first k that end, while they may still count.
        new = 0
        full = len(self.finished) >= k
        if self.improvable and not (full and params.early_stopping is True):
            for c, e in zip(cands[:k], ends[:k], strict=True):
                if e:
                    tokens = beams[c.parent][0] + [c.token]
                    eos = not params.ignore_eos and c.token in self.eos_token_ids
                    reason = "stop" if eos else "length"
                    self.finished.append(Hypothesis(tokens, c.cum_logprob,
                                                    hypothesis_score(c.cum_logprob, length, params.length_penalty),
                                                    reason))
                    new += 1
            self.finished.sort(key=lambda h: -h.score)   # stable: older hypotheses win ties
            del self.finished[k:]
        # 4. The stop rule.
        if self.improvable and len(self.finished) >= k and running:
            best_length = self.max_new_tokens if params.early_stopping == "never" \
                and params.length_penalty > 0 else length
            best_possible = hypothesis_score(running[0].cum_logprob, best_length, params.length_penalty)
            self.improvable = best_possible > min(h.score for h in self.finished)
        done = (not self.improvable or not running or all(ends)
                or (params.early_stopping is True and len(self.finished) >= k))
        return BeamStep(running, done, new)

    def outputs(self) -> list[Hypothesis]:
        """The finished hypotheses, best first (what the request returns)."""
        return list(self.finished)
