"""Grader for chapter 6's sampling exercise (6.3): what min-p keeps, read off the engine's logprobs.

The engine reports the model's RAW log-probabilities (``SamplingParams(logprobs=k)``): the
``log_softmax`` of its logits, before temperature and the filters. Min-p keeps the tokens whose
probability *after temperature* is at least ``min_p`` times the most likely one's. A ratio of
two probabilities depends only on the difference of their logits, so the k most likely tokens
the engine reports decide the cut exactly: once one of them fails it, every token after it
fails too.

The expected values come from the real engine at check time (one greedy step on a fixed
prompt) and from labkit's own sampler (``labkit.model.sampler.probabilities``), never from a
table: if the model, the engine's logprobs or the sampler changed, the grader would follow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._grading import check_close, fail, fmt, graded, passed, read_count, read_number

EX_PROMPT = "My favourite colour is"
EX_TEMPERATURE = 0.5
EX_MIN_P = 0.1
P_TOP_TOLERANCE = 0.005          # absolute, on a probability: three decimals are enough


@dataclass(slots=True)
class MinPCut:
    """What min-p leaves of one step's distribution, as labkit's sampler computes it."""

    reported: int             # tokens in the engine's logprobs dict (the top-k, plus the chosen one)
    survivors: int            # tokens the sampler may still draw
    p_top: float              # the probability it draws the most likely token
    top_text: str             # that token's text, for the verdict
    exact: bool               # False when every reported token survives (the cut lies beyond them)


def first_step_logprobs(llm, prompt: str = EX_PROMPT) -> dict:
    """The engine's logprobs dict ``{token id: Logprob}`` for the first token greedy decoding
    generates after ``prompt``, with as many alternatives as the engine reports."""
    from ..sampling_params import MAX_LOGPROBS, SamplingParams
    if not callable(getattr(llm, "generate", None)) or not hasattr(llm, "scheduler"):
        fail(f"llm: pass the engine you loaded (llm = LLM(...)), not {type(llm).__name__} {llm!r:.60}.")
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=MAX_LOGPROBS, ignore_eos=True)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    if not out.logprobs:
        raise RuntimeError("the engine returned no logprobs although they were asked for: a bug in labkit")
    return out.logprobs[0]


def min_p_cut(step: dict, temperature: float, min_p: float = 0.0) -> MinPCut:
    """Apply ``temperature`` and ``min_p`` to one step's reported tokens with labkit's sampler.

    ``exact`` is False when every reported token survives: the cut then lies among tokens the
    engine did not report, and the count is only a lower bound.
    """
    import torch

    from ..model.sampler import SamplingRow, probabilities
    ranked = sorted(step.items(), key=lambda item: item[1].rank)
    logits = torch.tensor([[lp.logprob for _, lp in ranked]], dtype=torch.float32)
    probs = probabilities(logits, [SamplingRow(temperature=temperature, min_p=min_p)])[0]
    survivors = int((probs > 0).sum())
    return MinPCut(reported=len(ranked), survivors=survivors, p_top=float(probs[0]),
                   top_text=ranked[0][1].decoded_token or str(ranked[0][0]),
                   exact=survivors < len(ranked))


def _raw_probs(step: dict) -> list[float]:
    return sorted((math.exp(lp.logprob) for lp in step.values()), reverse=True)


@graded("6.3")
def check_min_p(llm, survivors: object, p_top: object, *, prompt: str = EX_PROMPT,
                temperature: float = EX_TEMPERATURE, min_p: float = EX_MIN_P) -> None:
    """Exercise 6.3: at the first generated token of ``prompt``, sampling with ``temperature``
    and ``min_p`` (no top-k, no top-p): ``survivors``, how many tokens the sampler may still
    draw; ``p_top``, the probability that it draws the most likely one (within 0.005)."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    step = first_step_logprobs(llm, prompt)
    right = min_p_cut(step, temperature, min_p)
    if not right.exact:
        raise RuntimeError(f"all {right.reported} reported tokens pass min_p={min_p} at temperature "
                           f"{temperature}: the reported logprobs do not decide the cut")
    no_temperature = min_p_cut(step, 1.0, min_p)
    raw = _raw_probs(step)
    n = read_count("survivors", survivors)
    check_close("survivors", n, right.survivors, rel=0, mistakes=[
        (no_temperature.survivors, "That is the cut on the raw distribution. Min-p compares the "
                                   "probabilities the sampler draws from: after temperature."),
        (sum(p >= min_p for p in raw), "That keeps tokens whose probability is at least min_p itself. "
                                       "Min-p is relative: at least min_p times the most likely token's."),
        (right.reported, "That is how many tokens the engine reported, not how many pass the cut."),
        (right.survivors - 1, "The most likely token always survives: it is compared with itself."),
    ], hint="For each reported token, how does its probability after temperature compare with the "
            "most likely token's? Only differences of logprobs matter.")
    p = read_number("p_top", p_top)
    if p > 1 and p <= 100:
        fail(f"p_top: {fmt(p)} is more than 1: give the probability as a fraction between 0 and 1.")
    if not 0 <= p <= 1:
        fail(f"p_top: {fmt(p)} is not a probability (between 0 and 1).")
    tempered = min_p_cut(step, temperature, 0.0)
    cut_raw = raw[0] / sum(raw[:right.survivors])
    check_close("p_top", p, right.p_top, rel=0, abs_tol=P_TOP_TOLERANCE, mistakes=[
        (raw[0], "That is the model's raw probability: temperature and the cut change it."),
        (tempered.p_top, "That applies temperature but forgets the cut: the tokens min-p drops get "
                         "probability 0, and the survivors share all of it."),
        (cut_raw, "The survivors are right, but their probabilities are raw ones: renormalise the "
                  "probabilities after temperature."),
        (no_temperature.p_top, "That is min-p on the raw distribution, without temperature."),
        (1 / right.survivors, "The survivors do not become equally likely: they keep their relative "
                              "weights after temperature."),
        (min_p_cut(step, 1 / temperature, min_p).p_top,
         "Temperature divides the logits (logprob / T); this multiplies them."),
    ], hint="In which order does the sampler apply temperature and min-p, and where does the "
            "probability of the tokens it drops go?")
    passed(f"{right.survivors} of the {right.reported} reported tokens survive min_p={min_p} at "
           f"temperature {temperature}; {right.top_text!r} is drawn with probability {right.p_top:.3f} "
           f"(the model's raw probability: {raw[0]:.3f}). At temperature 1 the same min_p keeps "
           f"{no_temperature.survivors}: min-p follows how sure the model is.")


def answer_forms() -> dict[str, list[str]]:
    """The answer depends on the model's weights (read at check time), so the forms are the key
    expressions of a solution rather than its numbers."""
    return {
        "6.3": ["(lp - top) / temperature", "(lp - top) / EX_TEMPERATURE", "/ temperature) >= min_p",
                "p / p_max >= min_p", "logprob - top) / temperature"],
    }
