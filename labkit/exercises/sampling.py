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
import numbers
from dataclasses import dataclass
from typing import Mapping

from ._grading import check_exact, check_number, fail, fmt, graded, passed, read_count, read_number, sig

EX_PROMPT = "My favourite colour is"
EX_TEMPERATURE = 0.5
EX_MIN_P = 0.1


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


def step_facts(step: dict) -> dict:
    """One step's logprobs dict as plain data: the raw logprobs, most likely first, and the
    most likely token's text."""
    ranked = sorted(step.values(), key=lambda lp: lp.rank)
    top = ranked[0]
    return {"logprobs": [float(lp.logprob) for lp in ranked],
            "top_text": top.decoded_token if top.decoded_token is not None else ""}


def min_p_facts(llm, prompt: str = EX_PROMPT) -> dict:
    """What exercise 6.3 is graded against, as plain data: ``step_facts`` of the first token
    greedy decoding generates after ``prompt`` on the engine ``llm`` (one engine step)."""
    return step_facts(first_step_logprobs(llm, prompt))


def _logprobs(facts: object) -> tuple[list[float], str]:
    """The facts ``min_p_facts`` makes, checked."""
    if not isinstance(facts, Mapping):
        fail(f"llm: pass the engine you loaded (llm = LLM(...)), not {type(facts).__name__} {facts!r:.60}.")
    lps = facts.get("logprobs")
    if (not isinstance(lps, list) or len(lps) < 2
            or not all(isinstance(x, numbers.Real) and math.isfinite(x) and x <= 0 for x in lps)):
        fail("llm: pass the engine you loaded (llm = LLM(...)); its logprobs are missing from what was passed.")
    return sorted((float(x) for x in lps), reverse=True), str(facts.get("top_text", ""))


def min_p_cut(step: dict | list, temperature: float, min_p: float = 0.0, top_text: str = "") -> MinPCut:
    """Apply ``temperature`` and ``min_p`` to one step's reported tokens with labkit's sampler.
    ``step``: the engine's logprobs dict, or the raw logprobs as a list.

    ``exact`` is False when every reported token survives: the cut then lies among tokens the
    engine did not report, and the count is only a lower bound.
    """
    import torch

    from ..model.sampler import SamplingRow, probabilities
    if isinstance(step, Mapping):
        facts = step_facts(step)
        lps, top_text = facts["logprobs"], facts["top_text"]
    else:
        lps = sorted(step, reverse=True)
    logits = torch.tensor([lps], dtype=torch.float32)
    probs = probabilities(logits, [SamplingRow(temperature=temperature, min_p=min_p)])[0]
    survivors = int((probs > 0).sum())
    return MinPCut(reported=len(lps), survivors=survivors, p_top=float(probs[0]), top_text=top_text,
                   exact=survivors < len(lps))


@graded("6.3", plain={"llm": min_p_facts})
def check_min_p(llm, survivors: object, p_top: object, *, temperature: float = EX_TEMPERATURE,
                min_p: float = EX_MIN_P) -> None:
    """Exercise 6.3: at the first generated token of ``EX_PROMPT``, sampling with ``temperature``
    and ``min_p`` (no top-k, no top-p): ``survivors``, how many tokens the sampler may still
    draw (a count); ``p_top``, the probability that it draws the most likely one, to 3
    significant figures."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    lps, top_text = _logprobs(llm)
    temperature, min_p = read_number("temperature", temperature), read_number("min_p", min_p)
    right = min_p_cut(lps, temperature, min_p, top_text)
    if not right.exact:
        raise RuntimeError(f"all {right.reported} reported tokens pass min_p={min_p} at temperature "
                           f"{temperature}: the reported logprobs do not decide the cut")
    no_temperature = min_p_cut(lps, 1.0, min_p)
    raw = [math.exp(x) for x in lps]
    n = read_count("survivors", survivors)
    check_exact("survivors", n, right.survivors, mistakes=[
        (no_temperature.survivors, "That is the cut on the raw distribution. Min-p compares the "
                                   "probabilities the sampler draws from: after temperature."),
        (sum(p >= min_p for p in raw), "That keeps tokens whose raw probability is at least min_p itself. "
                                       "Min-p is relative: at least min_p times the most likely token's."),
        (right.reported, "That is how many tokens the engine reported, not how many pass the cut."),
    ], hint="For each reported token, how does its probability after temperature compare with the "
            "most likely token's? Only differences of logprobs matter.")
    p = read_number("p_top", p_top)
    if not 0 <= p <= 1:
        fail(f"p_top: {fmt(p)} is not a probability: give it as a fraction between 0 and 1.")
    tempered = min_p_cut(lps, temperature, 0.0)
    cut_raw = raw[0] / sum(raw[:right.survivors])
    check_number("p_top", p_top, right.p_top, mistakes=[
        (raw[0], "That is the model's raw probability: temperature and the cut change it."),
        (tempered.p_top, "That applies temperature but forgets the cut: the tokens min-p drops get "
                         "probability 0, and the survivors share all of it."),
        (cut_raw, "The survivors are right, but their probabilities are raw ones: renormalise the "
                  "probabilities after temperature."),
        (no_temperature.p_top, "That is min-p on the raw distribution, without temperature."),
        (1 / right.survivors, "The survivors do not become equally likely: they keep their relative "
                              "weights after temperature."),
        (min_p_cut(lps, 1 / temperature, min_p).p_top,
         "Temperature divides the logits (logprob / T); this multiplies them."),
    ], hint="In which order does the sampler apply temperature and min-p, and where does the "
            "probability of the tokens it drops go?")
    passed(f"{right.survivors} of the {right.reported} reported tokens survive min_p={min_p} at "
           f"temperature {temperature}; {right.top_text!r} is drawn with probability {sig(right.p_top)} "
           f"(the model's raw probability: {sig(raw[0])}). At temperature 1 the same min_p keeps "
           f"{no_temperature.survivors}: min-p follows how sure the model is.")


def answer_forms() -> dict[str, list[str]]:
    """The answer depends on the model's weights (read at check time), so the forms are the key
    expressions of a solution rather than its numbers."""
    return {
        "6.3": ["(lp - top) / temperature", "(lp - top) / EX_TEMPERATURE", "/ temperature) >= min_p",
                "p / p_max >= min_p", "logprob - top) / temperature"],
    }
