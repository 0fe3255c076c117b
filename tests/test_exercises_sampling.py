"""The grader of exercise 6.3 (what min-p keeps, from the engine's logprobs), as a table.

Right answers in every form the exercise invites pass; each plausible wrong answer fails with
the hint for its mistake, and no hint states the answer; any other input (None, text, a
stub that still raises, an object that is not the engine) gets a hint, never a traceback.

The engine is tiny-llama (random weights, fast). Its first-step distribution after the
exercise's prompt is peakier than SmolLM2's, so the table grades it at temperature 2.0, where
min-p=0.1 keeps several tokens but not all the reported ones; the notebook uses the grader's
defaults on the real model (``tests/test_notebooks.py`` runs it).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from test_answer_leaks import find_form

from labkit import LLM
from labkit.exercises import sampling
from labkit.exercises._grading import number_forms

TEMPERATURE = 2.0
MIN_P = 0.1


@pytest.fixture(scope="module")
def ctx():
    llm = LLM("tiny-llama", num_blocks=32, block_size=8)
    step = sampling.first_step_logprobs(llm)
    right = sampling.min_p_cut(step, TEMPERATURE, MIN_P)
    lps = sorted((lp.logprob for lp in step.values()), reverse=True)
    # A plain reference, independent of the sampler: min-p keeps p_i >= min_p * p_max after
    # temperature, i.e. exp((lp_i - lp_max) / T) >= min_p; the top token's share of what is kept.
    weights = [math.exp((lp - lps[0]) / TEMPERATURE) for lp in lps]
    kept = [w for w in weights if w >= MIN_P]
    assert right.exact and 2 <= right.survivors < len(lps), "pick settings that cut among the reported tokens"
    assert right.survivors == len(kept) and math.isclose(right.p_top, 1 / sum(kept), rel_tol=1e-5)
    raw = [math.exp(lp) for lp in lps]
    return SimpleNamespace(llm=llm, survivors=right.survivors, p_top=right.p_top, raw=raw, lps=lps,
                           reported=len(lps), weights=weights,
                           forms=number_forms(right.survivors) + number_forms(round(right.p_top, 4)))


_ENGINE = object()      # "the context's engine" (None is one of the wrong things to pass)


def grade(c, survivors, p_top, llm=_ENGINE):
    sampling.check_min_p(c.llm if llm is _ENGINE else llm, survivors, p_top, temperature=TEMPERATURE,
                         min_p=MIN_P)


def no_leak(c, message: str) -> None:
    hint = message.split(" is not right. ", 1)[-1]
    leaked = [form for form in c.forms if find_form(hint, form)]
    assert not leaked, f"the hint gives away {leaked}: {message}"


# ---- right answers ------------------------------------------------------------------------------
RIGHT_FORMS = {
    "exact": lambda c: (c.survivors, c.p_top),
    "p to 3 significant figures": lambda c: (c.survivors, float(f"{c.p_top:.3g}")),
    "strings": lambda c: (str(c.survivors), f"{c.p_top:.4f}"),
    "numpy scalars": lambda c: (np.int64(c.survivors), np.float32(c.p_top)),
    "count as a float": lambda c: (float(c.survivors), c.p_top),
}


@pytest.mark.parametrize("form", list(RIGHT_FORMS))
def test_right_answers_pass(ctx, capsys, form):
    grade(ctx, *RIGHT_FORMS[form](ctx))
    out = capsys.readouterr().out.strip()
    assert out.startswith("✓ ") and "\n" not in out, out


@pytest.mark.slow
def test_the_default_exercise_cuts_among_the_reported_tokens_of_the_real_model():
    """The notebook's settings must decide the cut from the reported logprobs (else the grader
    refuses to grade); checked where the real model is cached."""
    pytest.importorskip("transformers")
    from labkit.model.loader import _cache_complete, default_model_dir
    if not _cache_complete(default_model_dir()):
        pytest.skip("the default model is not cached (make model)")
    llm = LLM(num_blocks=16)
    right = sampling.min_p_cut(sampling.first_step_logprobs(llm), sampling.EX_TEMPERATURE, sampling.EX_MIN_P)
    assert right.exact and 2 <= right.survivors < right.reported


# ---- named wrong answers ----------------------------------------------------------------------
def _tempered_no_cut(c):
    w = [math.exp(lp / TEMPERATURE) for lp in c.lps]
    return w[0] / sum(w)


MISTAKES = {
    "min-p-before-temperature": (lambda c: (sum(w >= MIN_P for w in [p / c.raw[0] for p in c.raw]), c.p_top),
                                 "raw distribution"),
    "absolute-threshold": (lambda c: (sum(p >= MIN_P for p in c.raw), c.p_top), "Min-p is relative"),
    "counted-the-reported-tokens": (lambda c: (c.reported, c.p_top), "how many tokens the engine reported"),
    "left-out-the-top-token": (lambda c: (c.survivors - 1, c.p_top), "Only differences of logprobs matter"),
    "two-figures": (lambda c: (c.survivors, f"{c.p_top:.2g}" if f"{c.p_top:.2g}" != f"{c.p_top:.3g}" else "0.5"),
                    "3 significant figures"),
    "raw-probability": (lambda c: (c.survivors, c.raw[0]), "raw probability"),
    "temperature-without-the-cut": (lambda c: (c.survivors, _tempered_no_cut(c)), "forgets the cut"),
    "raw-probabilities-renormalised": (lambda c: (c.survivors, c.raw[0] / sum(c.raw[:c.survivors])),
                                       "their probabilities are raw ones"),
    "uniform-over-survivors": (lambda c: (c.survivors, 1 / c.survivors), "do not become equally likely"),
    "percent-not-fraction": (lambda c: (c.survivors, 100 * c.p_top), "as a fraction"),
    "off-by-a-lot": (lambda c: (c.survivors + 5, c.p_top), "Only differences of logprobs matter"),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_wrong_answers_fail_with_the_hint_for_that_mistake(ctx, mistake):
    make, hint = MISTAKES[mistake]
    survivors, p_top = make(ctx)
    assert (survivors, p_top) != (ctx.survivors, ctx.p_top), "this mistake gives the right answer here"
    with pytest.raises(AssertionError, match=hint) as info:
        grade(ctx, survivors, p_top)
    no_leak(ctx, str(info.value))


# ---- any other input ----------------------------------------------------------------------------
def _stub(*args, **kwargs):
    raise NotImplementedError("replace this line with your solution")


JUNK = {"none": None, "ellipsis": ..., "text": "four or so", "list": [4], "nan": float("nan"),
        "inf": float("inf"), "negative": -1, "bool": True, "object": object(), "stub-function": _stub,
        "above-one": 1.5}


@pytest.mark.parametrize("position", [0, 1])
@pytest.mark.parametrize("junk", list(JUNK))
def test_any_input_gets_a_hint_not_a_crash(ctx, capsys, junk, position):
    args = [ctx.survivors, ctx.p_top]
    args[position] = JUNK[junk]
    with pytest.raises(AssertionError) as info:
        grade(ctx, *args)
    message = str(info.value)
    assert message.strip() and "Traceback" not in message
    no_leak(ctx, message)
    assert "✓" not in capsys.readouterr().out


class _StubAnswer:
    """An answer computed by a helper the student has not written yet: using it raises."""

    def __float__(self):
        raise NotImplementedError


@pytest.mark.parametrize("position", [0, 1])
def test_a_stub_that_still_raises_is_named(ctx, position):
    args = [ctx.survivors, ctx.p_top]
    args[position] = _StubAnswer()
    with pytest.raises(AssertionError, match="still raises NotImplementedError"):
        grade(ctx, *args)


@pytest.mark.parametrize("junk", [None, "llm", 42, SimpleNamespace(generate=lambda *a, **k: [])])
def test_the_grader_names_the_engine_when_given_something_else(ctx, junk):
    with pytest.raises(AssertionError, match="engine you loaded"):
        grade(ctx, ctx.survivors, ctx.p_top, llm=junk)
