"""The graders of chapters 0-3 (and chapter 6's, which live in ``engine``), as one table.

For every grader: right answers in at least two equivalent forms pass (rounded to the stated 3
significant figures, or with more digits); at least four plausible wrong answers fail, each with
the hint for the student mistake it models (the test id names the mistake); the stub, None, a
wrong type and other junk get a hint, never a traceback of the grader's own; and no hint gives
away the expected value in any form the grader accepts (``answer_forms()``). The graders that
take the engine judge the same from its plain facts (``engine_facts``) and whatever the engine
served in between. The expected values come from the real allocator and engine; the few checks
of them against hand counts are at the end. The rules every grader shares (the rounding rule at
its boundaries, hints that never navigate) are tested in ``tests/test_exercises_rules.py``."""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_answer_leaks import find_form

from labkit import LLM, SamplingParams
from labkit.exercises import _grading as g
from labkit.exercises import bughunt, engine, memory
from labkit.exercises.memory import (SHARING_SAFE, SHARING_STATEMENTS, check_exercise_1, check_exercise_2,
                                     check_exercise_3, shared_prompt_counts)
from labkit.memory import BlockAllocator, BlockTable

FORMS = {**memory.answer_forms(), **engine.answer_forms(), **bughunt.answer_forms()}
SPEEDUP = {"labkit": {"wall_s": 2.5, "output_tokens": 100}, "hf-static": {"wall_s": 4.0, "output_tokens": 100}}
SPEEDUP_3 = {"labkit": {"wall_s": 3.0, "output_tokens": 90}, "hf-static": {"wall_s": 4.0, "output_tokens": 90}}   # 4/3


# ---- the engines some graders read (tiny-llama: random weights, fast) -------------------------
@pytest.fixture(scope="module")
def ctx():
    """What the notebooks' check cells pass besides the answers, measured on tiny-llama."""
    llm = LLM("tiny-llama", num_blocks=64, block_size=8)
    stats = llm.stats()
    cfg = llm.runner.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    prompts = [list(range(10, 10 + n)) for n in (5, 9, 3, 12)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    before = llm.stats()["num_steps"]
    llm.generate(prompts, params, use_tqdm=False)
    steps = llm.stats()["num_steps"] - before

    cached = LLM("tiny-llama", num_blocks=64, block_size=8, enable_prefix_caching=True)
    shared = list(range(20, 57))                                   # 37 shared tokens: 4 whole blocks
    answer = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    cached.generate([shared + [200, 201]], answer, use_tqdm=False)  # the warm-up
    before = cached.stats()
    cached.generate([shared + [100 + i, 150 + i, 3] for i in range(3)], answer, use_tqdm=False)
    after = cached.stats()
    measured = {k: after[k] - before[k] for k in ("num_cached_prompt_tokens", "num_prompt_tokens_computed")}
    return SimpleNamespace(llm=llm, capacity=stats["num_total_blocks"] * stats["block_size"],
                           per_token=per_token, prompt_lens=[len(p) for p in prompts], max_tokens=6,
                           steps=steps, cached=cached, shared=len(shared), followers=3, measured=measured)


# Each grader: how to call it with the answers (the context supplies what the notebook does).
GRADERS = {
    "0.1": lambda c, a, b: engine.check_kv_capacity(c.llm, a, b),
    "0.2": lambda c, a, b: engine.check_batch_iterations(c.llm, c.prompt_lens, c.max_tokens, a, b),
    "1.1": lambda c, a: engine.check_kv_bytes_70b(a),
    "1.2": lambda c, a, b: engine.check_70b_requests(a, b),
    "1.3": lambda c, a, b: check_exercise_1(a, b),
    "2.1": lambda c, a, b, d: check_exercise_2(a, b, d),
    "3.1": lambda c, a, b: engine.check_fork_copies(a, b),
    "3.2": lambda c, a, b: engine.check_prefix_reuse(a, b),
    "3.3": lambda c, a, b, d: check_exercise_3(a, b, d),
    "6.1": lambda c, a, b: engine.check_speedup(a, b),
    "6.2": lambda c, a, b: engine.check_prefix_savings(c.cached, c.shared, c.followers, a, b),
}
#: A right answer for each grader, as a function of the context.
RIGHT = {
    "0.1": lambda c: (c.capacity, c.per_token),
    "0.2": lambda c: (c.max_tokens, c.steps),
    "1.1": lambda c: (2 * 80 * 8 * 128 * 2,),
    "1.2": lambda c: (4096 * 2 * 80 * 8 * 128 * 2, math.floor(45e9 / (4096 * 2 * 80 * 8 * 128 * 2))),
    "1.3": lambda c: (200 / 4096, 200 / 4096),
    "2.1": lambda c: (5, 10, 10 / 70),
    "3.1": lambda c: (6, 3),
    "3.2": lambda c: (992, 58),
    "3.3": lambda c: (500_000, 1000, set(SHARING_SAFE)),
    "6.1": lambda c: (SPEEDUP, 1.6),
    "6.2": lambda c: (c.followers * 32, c.measured),
}


def answers(c, exercise, **changes):
    """The right answers to ``exercise`` with some replaced: ``{position: value}`` keys a0, a1..."""
    args = list(RIGHT[exercise](c))
    for key, value in changes.items():
        args[int(key[1:])] = value(c) if getattr(value, "ctx", False) else value
    return args


def no_leak(exercise: str, message: str) -> None:
    """No form of the expected answer in the hint (the student's own answer, echoed before
    "is not right.", may be anything)."""
    hint = message.split(" is not right. ", 1)[-1]
    leaked = [form for form in FORMS.get(exercise, []) if find_form(hint, form)]
    assert not leaked, f"the hint of {exercise} gives away {leaked}: {message}"


# ---- right answers, in every form the exercise invites ------------------------------------------
def ctx_value(f):
    """Mark an answer that depends on the context (computed when the test runs)."""
    f.ctx = True
    return f


RIGHT_FORMS = [
    ("0.1", "exact numbers", {}),
    ("0.1", "bytes as a string with KiB", {"a1": ctx_value(lambda c: f"{c.per_token / 1024} KiB")}),
    ("0.1", "numeric strings", {"a0": ctx_value(lambda c: str(c.capacity)),
                                "a1": ctx_value(lambda c: f"{c.per_token} B")}),
    ("0.1", "numpy scalars", {"a0": ctx_value(lambda c: np.int64(c.capacity)),
                              "a1": ctx_value(lambda c: np.float32(c.per_token))}),
    ("0.2", "ints", {}),
    ("0.2", "float and string", {"a0": 6.0, "a1": ctx_value(lambda c: str(c.steps))}),
    ("0.2", "a 0-d tensor", {"a0": torch.tensor(6)}),
    ("1.1", "bytes", {}),
    ("1.1", "KiB string", {"a0": "320 KiB"}),
    ("1.1", "KiB string without space", {"a0": "320KiB"}),
    ("1.1", "bytes string with thousands separator", {"a0": "327,680 bytes"}),
    ("1.1", "MiB to 3 figures", {"a0": "0.313 MiB"}),
    ("1.2", "bytes", {}),
    ("1.2", "GiB string", {"a0": "1.25 GiB"}),
    ("1.2", "MiB string and float count", {"a0": "1280 MiB", "a1": 33.0}),
    ("1.2", "GB string to 3 figures", {"a0": "1.34 GB"}),
    ("1.2", "bytes to 3 figures", {"a0": 1.34e9}),
    ("1.3", "fractions", {}),
    ("1.3", "percents to 3 figures", {"a0": 4.88, "a1": 4.883}),
    ("1.3", "percent strings", {"a0": "4.88%", "a1": "4.88 %"}),
    ("1.3", "fraction to 3 figures", {"a0": 0.0488, "a1": "0.04883"}),
    ("1.3", "numpy float32", {"a0": np.float32(200 / 4096)}),
    ("2.1", "fraction", {}),
    ("2.1", "percent to 3 figures", {"a2": 14.3}),
    ("2.1", "percent string and float counts", {"a0": 5.0, "a1": 10.0, "a2": "14.3%"}),
    ("2.1", "a quotient written as text", {"a2": "10/70"}),
    ("2.1", "more digits than asked", {"a2": 14.2857}),
    ("3.1", "ints", {}),
    ("3.1", "strings", {"a0": "6", "a1": "3"}),
    ("3.2", "ints", {}),
    ("3.2", "floats", {"a0": 992.0, "a1": 58.0}),
    ("3.3", "MiB numbers and a set", {}),
    ("3.3", "strings with units and a string of letters", {"a0": "488 GiB", "a1": "1000 MiB", "a2": "b, e, h"}),
    ("3.3", "GiB to 3 figures and a list", {"a0": "488.3 GiB", "a1": "0.977 GiB", "a2": ["H", "B", "E"]}),
    ("3.3", "whole blocks, letters run together", {"a0": 504_000, "a1": 1008, "a2": "BEH"}),
    ("3.3", "copy-on-write copies counted, a tuple", {"a1": 4992, "a2": ("e", "h", "b")}),
    ("3.3", "a set literal typed inside quotes", {"a2": "{'B', 'E', 'H'}"}),
    ("3.3", "an array of letters", {"a2": np.array(["B", "E", "H"])}),
    ("6.1", "float", {}),
    ("6.1", "string", {"a1": "1.6"}),
    ("6.1", "more digits", {"a1": 1.6004}),
    ("6.1", "written as a speedup", {"a1": "1.60×"}),
    ("6.1", "with an x", {"a1": "1.6x"}),
    ("6.1", "a ratio that does not terminate, to 3 figures", {"a0": SPEEDUP_3, "a1": "1.33"}),
    ("6.2", "int", {}),
    ("6.2", "string", {"a0": ctx_value(lambda c: str(c.followers * 32))}),
]


@pytest.mark.parametrize("exercise, form, changes", RIGHT_FORMS, ids=[f"{e}-{f}" for e, f, _ in RIGHT_FORMS])
def test_right_answers_pass(ctx, capsys, exercise, form, changes):
    GRADERS[exercise](ctx, *answers(ctx, exercise, **changes))
    out = capsys.readouterr().out.strip()
    assert out.startswith("✓ ") and "\n" not in out, out


def test_every_grader_has_two_right_forms_and_four_mistakes():
    for exercise in GRADERS:
        assert sum(e == exercise for e, _, _ in RIGHT_FORMS) >= 2, exercise
        assert sum(e == exercise for e, _, _, _ in MISTAKES) >= 4, exercise
    for number in (1, 2, 3):
        assert sum(n == number for n, _, _ in BUGHUNT_RIGHT) >= 2
        assert sum(n == number for n, _, _, _ in BUGHUNT_WRONG) >= 4


# ---- plausible wrong answers, each named after the mistake it models ------------------------------
MISTAKES = [
    # 0.1
    ("0.1", "counted-blocks-not-tokens", {"a0": ctx_value(lambda c: c.llm.stats()["num_total_blocks"])},
     "number of blocks"),
    ("0.1", "bytes-per-block", {"a1": ctx_value(lambda c: c.per_token * 8)}, "per block|bits"),
    ("0.1", "k-or-v-only", {"a1": ctx_value(lambda c: c.per_token // 2)}, "key AND a value"),
    ("0.1", "counted-elements-not-bytes", {"a1": ctx_value(lambda c: c.per_token // 4)}, "elements, not bytes"),
    ("0.1", "kib-number-read-as-bytes", {"a1": ctx_value(lambda c: c.per_token / 1024)}, "unit mix-up.*read in bytes"),
    ("0.1", "capacity-off-by-one-block", {"a0": ctx_value(lambda c: c.capacity - 8)}, "size in blocks"),
    # 0.2
    ("0.2", "one-request-at-a-time", {"a0": 24}, "one request at a time"),
    ("0.2", "separate-prefill-step", {"a0": 7}, "already samples"),
    ("0.2", "no-token-at-prefill", {"a0": 5}, "already samples"),
    ("0.2", "measured-the-total-not-the-change", {"a1": ctx_value(lambda c: c.llm.stats()["num_steps"] + 100)},
     "change of"),
    ("0.2", "tokens-not-iterations", {"a0": 6 * 4 + 6}, "Each iteration gives"),
    ("0.2", "fractional", {"a0": 6.5}, "integer"),
    # 1.1
    ("1.1", "k-or-v-only", {"a0": 163_840}, "key AND a value"),
    ("1.1", "all-query-heads-no-gqa", {"a0": 2_621_440}, "KV heads"),
    ("1.1", "one-layer", {"a0": 4096}, "80 layers"),
    ("1.1", "bits", {"a0": 327_680 * 8}, "bits"),
    ("1.1", "fp32-not-bf16", {"a0": 655_360}, "dtype"),
    ("1.1", "kib-number-without-unit", {"a0": 320}, "unit mix-up.*bare number is read in bytes"),
    ("1.1", "kb-for-kib", {"a0": "320 KB"}, "binary and decimal"),
    ("1.1", "kib-to-2-figures", {"a0": "0.31 MiB"}, "3 significant figures"),
    # 1.2
    ("1.2", "lesson-320-mb", {"a0": "320 MB"}, "lesson's figure"),
    ("1.2", "lesson-140-requests", {"a1": 140}, "lesson's number"),
    ("1.2", "k-or-v-only", {"a0": 4096 * 327_680 // 2}, "key AND a value"),
    ("1.2", "bits", {"a0": 4096 * 327_680 * 8}, "bits"),
    ("1.2", "gib-number-without-unit", {"a0": 1.25}, "unit mix-up"),
    ("1.2", "gb-for-gib", {"a0": "1.25 GB"}, "binary and decimal"),
    ("1.2", "gib-for-gb", {"a0": "1.34 GiB"}, "binary and decimal"),
    ("1.2", "rounded-up", {"a1": 34}, "whole requests"),     # one off: the method hint, which names the idea
    ("1.2", "fractional-requests", {"a1": 33.53}, "whole requests"),
    ("1.2", "45-gb-read-as-gib", {"a1": 36}, "45 GiB"),
    ("1.2", "rounded-to-2-figures", {"a0": "1.3 GiB"}, "give it to 3 significant figures"),
    # 1.3
    ("1.3", "divided-reserved-by-used", {"a0": 4096 / 200}, "other way round"),
    ("1.3", "share-wasted", {"a0": 0.951}, "share wasted"),
    ("1.3", "divided-by-empty-slots", {"a0": 200 / 3896}, "empty slots only"),
    ("1.3", "percent-divided-by-100-again", {"a0": 0.000488}, "divided by 100 once too often"),
    ("1.3", "percent-multiplied-by-100", {"a0": 488}, "multiplied by 100"),
    ("1.3", "utilization-diluted-by-100", {"a1": 0.000488}, "grow 100"),
    ("1.3", "utilization-full", {"a1": 1.0}, "private"),
    ("1.3", "utilization-guess", {"a1": 0.314}, "over the 100"),
    ("1.3", "rounded-to-2-figures", {"a0": 4.9}, "give it to 3 significant figures.*4.9%? has 2"),
    ("1.3", "whole-percent", {"a1": 5}, "give it to 3 significant figures"),
    # 2.1
    ("2.1", "rounded-down", {"a0": 4}, "still a whole block"),
    ("2.1", "fractional-blocks", {"a0": 4.375}, "allocated whole"),
    ("2.1", "one-block-too-many", {"a0": 6}, "how many blocks"),
    ("2.1", "tokens-in-last-block", {"a1": 6}, "tokens the last block holds"),
    ("2.1", "all-tokens", {"a1": 70}, "Only the last block"),
    ("2.1", "relative-to-allocated-slots", {"a2": 0.125}, "allocated slots"),
    ("2.1", "last-block-tokens-over-length", {"a2": 6 / 70}, "tokens in the last block"),
    ("2.1", "fraction-divided-by-100", {"a2": 0.00143}, "divided by 100 once too often"),
    ("2.1", "half-integer-slots", {"a1": 10.5}, "integer"),
    ("2.1", "rounded-to-2-figures", {"a2": "14%"}, "3 significant figures"),
    # 3.1
    ("3.1", "every-sample-copies", {"a1": 4, "a0": 7}, "who else holds it"),
    ("3.1", "nobody-copies", {"a1": 0}, "copied first"),
    ("3.1", "copies-whole-table", {"a1": 12}, "Only the block being written"),
    ("3.1", "blocks-without-sharing", {"a0": 12}, "without sharing"),
    ("3.1", "blocks-before-divergence", {"a0": 3}, "before the samples diverge"),
    ("3.1", "last-writer-copies-too", {"a0": 7}, "what did each copy add"),
    # 3.2
    ("3.2", "partial-block-counted", {"a0": 1000}, "Only full blocks"),
    ("3.2", "rounded-up-to-blocks", {"a0": 1008}, "hash differs"),
    ("3.2", "questions-shared-too", {"a0": 1050}, "questions differ"),
    ("3.2", "blocks-not-tokens", {"a0": 62}, "number of blocks"),
    ("3.2", "only-the-question-computed", {"a1": 50}, "recomputed too"),
    ("3.2", "everything-computed", {"a1": 1050}, "need no compute"),
    # 3.3
    ("3.3", "bare-gib-number-finding-1", {"a0": 500, "a1": 1}, "unit mix-up.*read in MiB"),
    ("3.3", "bare-gib-number-binary", {"a0": 488.28}, "unit mix-up"),
    ("3.3", "gb-for-gib", {"a0": "500 GB"}, "binary and decimal"),
    ("3.3", "1000-mib-read-as-1-gib", {"a0": "500 GiB"}, "binary and decimal"),
    ("3.3", "block-exact-read-as-gib", {"a0": "504 GiB"}, "binary and decimal"),
    ("3.3", "one-sessions-copy", {"a0": 1000}, "one session's copy"),
    ("3.3", "with-equals-without", {"a1": 500_000}, "without sharing"),
    ("3.3", "prefix-split-500-ways", {"a1": 2}, "does not split"),
    ("3.3", "copied-blocks-counted-whole", {"a1": 8992}, "copied last blocks whole"),
    ("3.3", "only-the-copied-blocks", {"a1": 4000}, "full blocks are stored once"),
    ("3.3", "one-gib-for-1000-mib", {"a1": "1 GiB"}, "binary and decimal"),
    ("3.3", "gib-rounded-off", {"a0": "490 GiB"}, "what does every session store"),
    ("3.3", "gib-to-2-figures", {"a0": "4.9e2 GiB"}, "3 significant figures"),
    ("3.3", "picked-same-tokenizer", {"a2": {"A", "B", "E", "H"}}, "not the right set"),
    ("3.3", "picked-not-causal", {"a2": {"B", "E", "F", "H"}}, "not the right set"),
    ("3.3", "picked-positions-do-not-matter", {"a2": {"B", "D", "H"}}, "not the right set"),
    ("3.3", "picked-bit-for-bit", {"a2": {"B", "E", "G", "H"}}, "not the right set"),
    ("3.3", "forgot-copy-on-write", {"a2": {"B", "E"}}, "not the right set"),
    ("3.3", "unknown-letter", {"a2": "B, E, H, Z"}, "not one of"),
    ("3.3", "prose-instead-of-letters", {"a2": "the prefix is read-only"}, "not one of"),
    # 6.1
    ("6.1", "hf-over-labkit", {"a1": 0.625}, "hf-static over labkit"),
    ("6.1", "labkit-rate-not-ratio", {"a1": "40.0"}, "Compare the two engines"),
    ("6.1", "rate-difference", {"a1": "15.0"}, "Compare the two engines"),
    ("6.1", "a-whole-number", {"a1": 2}, "3 significant figures"),
    ("6.1", "percent-faster", {"a1": "60%"}, "gain in percent"),
    ("6.1", "how-much-faster", {"a1": 0.6}, "how much faster"),
    ("6.1", "rounded-to-2-figures", {"a0": SPEEDUP_3, "a1": 1.3}, "3 significant figures"),
    ("6.1", "measured-not-built", {"a0": {}}, "run that cell first"),
    # 6.2
    ("6.2", "partial-block-counted", {"a0": 3 * 37}, "block boundary"),
    ("6.2", "warm-up-counted", {"a0": 4 * 32}, "empty cache"),
    ("6.2", "one-follower-only", {"a0": 32}, "one request's share"),
    ("6.2", "mixed-block-counted", {"a0": 3 * 40}, "a miss"),
    ("6.2", "measured-wrong-delta", {"a1": {"num_cached_prompt_tokens": 0, "num_prompt_tokens_computed": 0}},
     "fewer than your"),
    ("6.2", "measured-after-a-rerun", {"a1": {"num_cached_prompt_tokens": 140, "num_prompt_tokens_computed": 0}},
     "empty cache.*reset_prefix_cache"),
    ("6.2", "measured-not-a-dict", {"a1": 96}, "pass a dict"),
]


@pytest.mark.parametrize("exercise, mistake, changes, hint", MISTAKES, ids=[f"{e}-{m}" for e, m, _, _ in MISTAKES])
def test_wrong_answers_fail_with_the_hint_for_that_mistake(ctx, exercise, mistake, changes, hint):
    with pytest.raises(AssertionError, match=hint) as info:
        GRADERS[exercise](ctx, *answers(ctx, exercise, **changes))
    no_leak(exercise, str(info.value))


# ---- any other input: a hint, never a traceback of the grader's own ---------------------------------
def _stub(*args, **kwargs):
    raise NotImplementedError("replace this line with your solution")


JUNK = {
    "none": None, "ellipsis": ..., "empty-string": "", "text": "about five", "list": [1, 2], "dict": {"a": 1},
    "nan": float("nan"), "inf": float("inf"), "negative": -3, "zero": 0, "bool": True, "object": object(),
    "stub-function": _stub, "huge-string": "1e999", "negative-gib": "-5 GiB", "unit-only": "GiB",
}


@pytest.mark.parametrize("junk", list(JUNK), ids=list(JUNK))
@pytest.mark.parametrize("exercise", list(GRADERS))
def test_any_input_gets_a_hint_not_a_crash(ctx, capsys, exercise, junk):
    n = len(RIGHT[exercise](ctx))
    for position in range(n):
        with pytest.raises(AssertionError) as info:
            GRADERS[exercise](ctx, *answers(ctx, exercise, **{f"a{position}": JUNK[junk]}))
        message = str(info.value)
        assert message.strip() and "Traceback" not in message
        no_leak(exercise, message)
    assert "✓" not in capsys.readouterr().out


@pytest.mark.parametrize("exercise", ["0.1", "0.2", "6.2"])
@pytest.mark.parametrize("junk", [None, "llm", 42, SimpleNamespace(stats=lambda: {}), {"block_size": 16}, [1, 2]],
                         ids=["none", "string", "int", "a-namespace", "facts-missing", "a-list"])
def test_graders_that_read_the_engine_name_it_when_given_something_else(ctx, exercise, junk):
    c = SimpleNamespace(**{**vars(ctx), "llm": junk, "cached": junk})
    with pytest.raises(AssertionError, match="engine you loaded"):
        GRADERS[exercise](c, *RIGHT[exercise](ctx))


# ---- the engine's graders judge its configuration, as plain data, never its state -------------------
@pytest.mark.parametrize("exercise", ["0.1", "0.2", "6.2"])
@pytest.mark.parametrize("answers", ["right", "wrong"])
def test_engine_graders_give_the_same_verdict_from_plain_facts(ctx, capsys, exercise, answers):
    """What the grader says to the live engine it says to ``engine_facts`` of it, carried as
    JSON (how a grader running outside the student's kernel receives it)."""
    import json
    args = answers_for(ctx, exercise, wrong=answers == "wrong")
    engine_of = {"0.1": ctx.llm, "0.2": ctx.llm, "6.2": ctx.cached}[exercise]
    grader = {"0.1": engine.check_kv_capacity, "0.2": engine.check_batch_iterations,
              "6.2": engine.check_prefix_savings}[exercise]
    extra = {"0.1": [], "0.2": [ctx.prompt_lens, ctx.max_tokens], "6.2": [ctx.shared, ctx.followers]}[exercise]
    verdicts = []
    plain = json.loads(json.dumps(grader.plain_arguments(engine_of, *extra, *args)))
    assert isinstance(plain["args"][0], dict) and set(plain["args"][0]) == set(engine.ENGINE_FACTS)
    for call in (lambda: grader(engine_of, *extra, *args), lambda: grader(*plain["args"], **plain["kwargs"]),
                 lambda: grader(engine.engine_facts(engine_of), *extra, *args)):
        try:
            call()
            verdicts.append(capsys.readouterr().out)
        except AssertionError as e:
            verdicts.append(str(e))
    assert verdicts[0] == verdicts[1] == verdicts[2], verdicts


def answers_for(c, exercise, wrong=False):
    args = RIGHT[exercise](c)
    if not wrong:
        return list(args)
    first = args[0] + 1 if isinstance(args[0], int) else args[0]
    return [first, *args[1:]]


def test_engine_graders_do_not_depend_on_what_the_engine_served(ctx, capsys):
    """0.1, 0.2 and 6.2 read the engine's configuration only: serving more requests in between
    (the free blocks, the counters, the prefix cache all change) changes no verdict."""
    def verdicts():
        out = []
        for exercise in ("0.1", "0.2", "6.2"):
            GRADERS[exercise](ctx, *RIGHT[exercise](ctx))
            out.append(capsys.readouterr().out)
        return out

    before = verdicts()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for llm in (ctx.llm, ctx.cached):
        llm.generate([list(range(20, 57)) + [7, 8], list(range(300, 340))], params, use_tqdm=False)
    assert verdicts() == before


@pytest.mark.parametrize("garbage", [{"labkit": {"wall_s": 0, "output_tokens": 10},
                                      "hf-static": {"wall_s": 1, "output_tokens": 10}},
                                     {"labkit": "fast", "hf-static": {}}, [1, 2], None,
                                     {"labkit": {"wall_s": 1, "output_tokens": 10},
                                      "hf-static": {"wall_s": 1, "output_tokens": 9}}])
def test_speedup_grader_rejects_broken_measurements(garbage):
    with pytest.raises(AssertionError, match="measured"):
        engine.check_speedup(garbage, 1.6)


def test_grader_failures_never_chain_the_graders_own_traceback():
    with pytest.raises(AssertionError) as info:
        check_exercise_3(500_000, 1000, _stub)
    assert info.value.__cause__ is None and (info.value.__context__ is None or info.value.__suppress_context__)


# ---- chapter 2's bug hunt: tests judged by behaviour ------------------------------------------------
def _generated(impl, num_gpu_blocks=8):
    manager = impl.BlockManager(num_gpu_blocks=num_gpu_blocks, block_size=4)
    scheduler = impl.Scheduler(manager)
    req = impl.SequenceRequest("a", prompt_tokens=list(range(6)), max_tokens=10)
    scheduler.add_request(req)
    while not req.is_finished:
        scheduler.schedule_iteration()
        assert req.is_finished or len(req.block_table) * manager.block_size >= req.num_tokens, "no slot"


def _generated_by_slot_count(impl):
    """Another right test: the last token's slot must exist after a few decode steps."""
    manager = impl.BlockManager(num_gpu_blocks=16, block_size=2)
    scheduler = impl.Scheduler(manager)
    req = impl.SequenceRequest("b", prompt_tokens=[1, 2], max_tokens=5)
    scheduler.add_request(req)
    for _ in range(3):
        scheduler.schedule_iteration()
    assert (req.num_tokens - 1) // manager.block_size < len(req.block_table), "last token has no block"


def _timing(impl, large=200_000, factor=10):
    t_small = bughunt.time_allocations(impl.BlockManager(num_gpu_blocks=1_000), 1_000)
    t_large = bughunt.time_allocations(impl.BlockManager(num_gpu_blocks=large), 1_000)
    assert t_large < factor * t_small, f"{t_small:.4f} s vs {t_large:.4f} s"


def _timing_ratio_of_many(impl):
    """Another right test: compare 2,000 allocations from pools of 2,000 and 300,000."""
    ratios = []
    for _ in range(2):
        t_small = bughunt.time_allocations(impl.BlockManager(num_gpu_blocks=2_000), 2_000)
        t_large = bughunt.time_allocations(impl.BlockManager(num_gpu_blocks=300_000), 2_000)
        ratios.append(t_large / t_small)
    assert min(ratios) < 8, f"ratios {ratios}"


def _shared(impl):
    manager = impl.BlockManager(num_gpu_blocks=8, block_size=4)
    scheduler = impl.Scheduler(manager)
    parent = impl.SequenceRequest("p", prompt_tokens=list(range(8)), max_tokens=2)
    scheduler.add_request(parent)
    scheduler.schedule_iteration()
    child = scheduler.fork(parent, "c")
    child.max_tokens = 6
    scheduler.schedule_iteration()
    new = [manager.allocate_block() for _ in range(manager.num_free_blocks)]
    assert not set(new) & set(child.block_table), "stolen"


def _shared_by_free_count(impl):
    """Another right test: after the parent finishes, the child's blocks are not free."""
    manager = impl.BlockManager(num_gpu_blocks=6, block_size=4)
    scheduler = impl.Scheduler(manager)
    parent = impl.SequenceRequest("p", prompt_tokens=list(range(4)), max_tokens=1)
    scheduler.add_request(parent)
    scheduler._admit()
    child = scheduler.fork(parent, "c")
    child.max_tokens = 9
    scheduler.schedule_iteration()
    assert manager.num_free_blocks <= 6 - len(child.block_table), "a held block is free"


def _flaky(impl, calls=[0]):       # noqa: B006 - the counter is the point: fails on the 3rd correct run
    _timing(impl)
    calls[0] += 1
    assert calls[0] % 3, "noise"


def _by_name(impl):
    assert getattr(impl, "name", "") == "paged", "not paged"


def _by_class(impl):
    assert isinstance(impl.BlockManager(num_gpu_blocks=8, block_size=4), bughunt.PagedBlockManager), "naive"


def _by_type_name(impl):
    assert "Paged" in type(impl.BlockManager(num_gpu_blocks=8, block_size=4)).__name__, "naive"


def _by_attribute(impl):
    assert hasattr(impl.BlockManager(num_gpu_blocks=8, block_size=4), "allocator"), "no allocator"


def _by_source(impl):
    """Reads the code instead of running it: the naive free list's `pop(0)`."""
    assert "pop(0)" not in inspect.getsource(impl.BlockManager.allocate_block), "naive code"


def _returns_verdict(impl):
    """The check of _generated, returned instead of asserted."""
    manager = impl.BlockManager(num_gpu_blocks=8, block_size=4)
    scheduler = impl.Scheduler(manager)
    req = impl.SequenceRequest("a", prompt_tokens=list(range(6)), max_tokens=10)
    scheduler.add_request(req)
    ok = True
    while not req.is_finished:
        scheduler.schedule_iteration()
        ok = ok and (req.is_finished or len(req.block_table) * manager.block_size >= req.num_tokens)
    return ok


def _freed_block_reused_first(impl):
    """Tests the order of the free list (last in, first out), not its cost."""
    manager = impl.BlockManager(num_gpu_blocks=8, block_size=4)
    ids = [manager.allocate_block() for _ in range(4)]
    manager.free_sequence_blocks([ids[1]])
    assert manager.allocate_block() == ids[1], "a freed block is not reused first"


def _empty(impl):
    pass


def _always_fails(impl):
    assert False, "always"


def _crashes(impl):
    impl.BlockManager(num_gpu_blocks=8).allocate_blocks(3)   # a typo: AttributeError


def _never_ends(impl):
    """The right idea in a pool too small for the request: a correct manager makes it wait forever."""
    _generated(impl, num_gpu_blocks=2)


BUGHUNT = {1: bughunt.check_generated_tokens_test, 2: bughunt.check_free_list_test, 3: bughunt.check_shared_blocks_test}
BUGHUNT_RIGHT = [
    (1, "slots-checked-every-iteration", _generated), (1, "last-token-has-a-block", _generated_by_slot_count),
    (2, "pool-1000-vs-200000-within-10x", _timing), (2, "best-ratio-of-two-rounds", _timing_ratio_of_many),
    (3, "survivor-blocks-not-handed-out", _shared), (3, "survivor-blocks-not-free", _shared_by_free_count),
]
BUGHUNT_WRONG = [
    (number, mistake, test, hint) for number in (1, 2, 3) for mistake, test, hint in [
        ("asserts-impl-name", _by_name, "correct implementation too"),
        ("asserts-isinstance", _by_class, "correct implementation too"),
        ("asserts-class-name", _by_type_name, "correct implementation too"),
        ("asserts-an-attribute", _by_attribute, "has this flaw and no other"),
        ("reads-the-source-code", _by_source, "passes on the naive implementation"),
        ("empty-test", _empty, "passes on the naive implementation"),
        ("fails-everywhere", _always_fails, "correct implementation too"),
        ("crashes-instead-of-asserting", _crashes, "bug in the test itself"),
        ("stub", _stub, "write the test"),
    ]
] + [
    (1, "exposes-another-flaw", _shared, "has this flaw and no other"),
    (1, "never-ends-on-the-correct-manager", _never_ends, "never finish"),
    (1, "returns-the-verdict-instead-of-asserting", _returns_verdict, "returned False.*assert"),
    (2, "flaky-timing", _flaky, "(?s)then failed.*flaky"),
    (2, "tests-the-order-not-the-cost", _freed_block_reused_first, "has this flaw and no other"),
    (2, "tight-margin-on-a-tiny-pool", lambda impl: _timing(impl, large=1_000, factor=0.5),
     "correct implementation too"),
    (3, "exposes-another-flaw", _generated, "has this flaw and no other"),
]


@pytest.mark.parametrize("number, name, test", BUGHUNT_RIGHT, ids=[f"2.{n + 1}-{m}" for n, m, _ in BUGHUNT_RIGHT])
def test_bughunt_accepts_tests_that_judge_behaviour(capsys, number, name, test):
    BUGHUNT[number](test)
    assert capsys.readouterr().out.startswith("✓ ")


@pytest.mark.parametrize("number, mistake, test, hint", BUGHUNT_WRONG,
                         ids=[f"2.{n + 1}-{m}" for n, m, _, _ in BUGHUNT_WRONG])
def test_bughunt_rejects_tests_that_do_not_judge_behaviour(number, mistake, test, hint):
    with pytest.raises(AssertionError, match=hint) as info:
        BUGHUNT[number](test)
    message = str(info.value)
    no_leak(f"2.{number + 1}", message)
    assert "time_allocations(" not in message and "10×" not in message   # no recipe


@pytest.mark.parametrize("junk", [None, ..., "test_x", 42], ids=["none", "ellipsis", "string", "int"])
@pytest.mark.parametrize("number", [1, 2, 3])
def test_bughunt_graders_want_a_function(number, junk):
    with pytest.raises(AssertionError, match="test function itself"):
        BUGHUNT[number](junk)


def test_bughunt_implementations_under_grading_reveal_nothing():
    impls = [bughunt._anonymous(bughunt.NaiveBlockManager, bughunt.NaiveScheduler),
             bughunt._anonymous(bughunt.PagedBlockManager, bughunt.PagedScheduler)]
    managers = [impl.BlockManager(num_gpu_blocks=8, block_size=4) for impl in impls]
    assert all(type(m).__name__ == "BlockManager" and type(m).__module__ == "impl" for m in managers)
    assert not any(isinstance(m, (bughunt.NaiveBlockManager, bughunt.PagedBlockManager)) for m in managers)
    assert not any(hasattr(impl, "name") for impl in impls)
    flaw_only = [bughunt._anonymous(*bughunt._FLAW_ONLY[n]).BlockManager(num_gpu_blocks=8) for n in (2, 3)]
    correct = set(dir(managers[1]))
    assert all(set(dir(m)) == correct for m in flaw_only)   # the mutants look like the correct one
    for method in ("allocate_block", "free_sequence_blocks", "fork_blocks"):   # and so does their code
        assert len({inspect.getsource(getattr(type(m), method)) for m in managers + flaw_only}) == 1, method


# ---- the shared helpers ----------------------------------------------------------------------------------
def test_bare_numbers_are_read_in_the_named_unit_only():
    assert g.read_quantity("m", 3, g.MEMORY_UNITS_MIB, "MiB") == (3, None)
    assert g.read_quantity("m", "2 GiB", g.MEMORY_UNITS_MIB, "MiB") == (2048, "GiB")
    assert g.read_quantity("m", "2 gb", g.MEMORY_UNITS_MIB, "MiB")[1] == "GB"
    with pytest.raises(AssertionError, match="unit mix-up.*read in MiB"):
        g.check_quantity("m", 2, 2000, units=g.MEMORY_UNITS_MIB, default_unit="MiB")
    with pytest.raises(AssertionError, match="unit mix-up.*You wrote GiB") as info:
        g.check_quantity("m", "2048 GiB", 2048, units=g.MEMORY_UNITS_MIB, default_unit="MiB")
    assert "too large" not in str(info.value) and "1,024 times" not in str(info.value)   # no direction, no factor
    with pytest.raises(AssertionError, match="negative"):
        g.read_quantity("m", "-1 MiB", g.MEMORY_UNITS_MIB, "MiB")
    assert g.unit_mixup(g.Written(7.0), 5, units=g.MEMORY_UNITS_MIB, default_unit="MiB") is None
    times = {"s": 1.0, "ms": 1e-3}
    assert g.unit_mixup(g.Written(1.024), 1.0, units=times, default_unit="s") is None   # no binary prefixes for time
    assert "1,000" in g.unit_mixup(g.Written(1000.0), 1.0, units=times, default_unit="s")


def test_reading_shares_counts_and_containers():
    assert g.read_fraction("x", 0.25) == 0.25 and g.read_fraction("x", 25) == 0.25
    assert g.read_fraction("x", "0.5%") == 0.005 and g.read_fraction("x", 1) == 1.0
    assert g.read_count("x", 5.0) == g.read_count("x", np.int64(5)) == g.read_count("x", torch.tensor(5)) == 5
    assert g.read_number("x", "1,000") == 1000 and g.read_number("x", np.array(2.5)) == 2.5
    assert g.read_number("x", "10 / 70") == 10 / 70 and g.read_ratio("x", "1.6×") == g.read_ratio("x", "1.6 x") == 1.6
    for bad in ("10/0", "1/2/3", "a/b"):
        with pytest.raises(AssertionError, match="expected a number"):
            g.read_number("x", bad)
    for bad, match in [(None, "raise NotImplementedError"), (True, "expected a number"), (float("nan"), "finite"),
                       ("five", "expected a number"), (np.array([1.0, 2.0]), "one number"),
                       (torch.tensor([3]), "one number")]:
        with pytest.raises(AssertionError, match=match):
            g.read_number("x", bad)
    assert g.read_sequence("x", (1, 2)) == g.read_sequence("x", np.array([1, 2])) == g.read_sequence(
        "x", torch.tensor([1, 2])) == [1, 2]
    assert g.read_sequence("x", "[1, 2]") == ["1", "2"]
    with pytest.raises(AssertionError, match="order matters"):
        g.read_sequence("x", {1, 2})
    assert sorted(g.read_collection("x", {1, 2})) == [1, 2]


def test_the_rounding_rule():
    """3 significant figures in the form written; more digits are fine; ties either way; an
    unrounded answer within float noise passes; counts of figures follow the written form."""
    assert g.agrees(0.0488, 200 / 4096) and g.agrees(0.04883, 200 / 4096) and not g.agrees(0.049, 200 / 4096)
    assert g.agrees(488, 500_000 / 1024) and not g.agrees(500, 500_000 / 1024)
    assert g.agrees(1.335, 1.335) and g.agrees(1.33, 1.335) and g.agrees(1.34, 1.335)   # a tie: either way
    assert g.agrees(0.1 + 0.2, 0.3) and not g.agrees(0.0, 1e-9) and g.agrees(0.0, 0.0)
    assert g.precision_window(4.8828) == pytest.approx((4.875, 4.885))
    assert g.precision_window(1.0) == pytest.approx((0.9995, 1.005))       # below a power of ten: finer
    assert [g.written_figures(v) for v in (0.049, "4.90", 500, 10, "1e3", "10/70", np.float32(0.0488), 14.2857)] \
        == [2, 3, 3, 2, 1, None, 3, 6]
    assert g.sig(0.048828125) == "0.0488" and g.sig(500_000) == "500,000" and g.sig(1.25) == "1.25" \
        and g.sig(14.2857) == "14.3"


def test_closeness_and_mistakes_at_the_stated_precision():
    assert g.is_close(101, 100, rel=0.01) and not g.is_close(102, 100, rel=0.01)
    assert g.check_number("x", 1.001, [5, 1]) == 1
    with pytest.raises(AssertionError, match="x: 7 is not right. because"):
        g.check_number("x", 7, 1, mistakes=[(7, "because")], hint="generic")
    with pytest.raises(AssertionError, match="generic"):
        g.check_number("x", "8.00", 1, mistakes=[(7, "because")], hint="generic")
    with pytest.raises(AssertionError, match="Several slips.*because.*Or: also"):
        g.check_number("x", 7, 1, mistakes=[(7, "because"), (7.001, "also")], hint="generic")
    with pytest.raises(AssertionError, match="3 significant figures"):      # coarse: the form, not the value
        g.check_number("x", "7.1", 7.1234, mistakes=[(7.0, "because")], hint="generic")
    with pytest.raises(AssertionError, match="because"):     # a coarse answer that IS a known mistake: its hint
        g.check_number("x", "7.1", 7.1234, mistakes=[(7.1, "because")], hint="generic")
    assert g.fmt(500000) == "500,000" and g.fmt(0.048828125) == "0.04883"


def test_picks_of_statements_are_read_in_every_invited_form():
    options = "ABCD"
    for value in ({"a", "c"}, ["C", "A"], ("a", "c"), "a, c", "AC", "c a", frozenset("AC"), np.array(["A", "C"])):
        assert g.read_choices("p", value, options) == {"A", "C"}
    for bad, match in [(None, "no answer"), (set(), "at least one"), ("a, x", "not one of"),
                       ([1, 2], "as strings"), (3, "set of letters")]:
        with pytest.raises(AssertionError, match=match):
            g.read_choices("p", bad, options)


def test_a_wrong_pick_names_no_statement():
    """Every wrong pick of 3.3 gets one and the same message: naming a wrong or a missing
    statement would let the letters be found one by one."""
    import itertools
    messages = set()
    for k in range(1, len(SHARING_STATEMENTS) + 1):
        for pick in itertools.combinations(sorted(SHARING_STATEMENTS), k):
            if set(pick) == SHARING_SAFE:
                continue
            with pytest.raises(AssertionError) as info:
                check_exercise_3(500_000, 1000, set(pick))
            messages.add(str(info.value))
    assert len(messages) == 1, messages


def test_answer_forms_are_distinctive_and_cover_every_exercise():
    assert set(FORMS) >= set(GRADERS) | {"2.2", "2.3", "2.4"}
    assert all(len(form) >= 3 for forms in FORMS.values() for form in forms)


def test_graded_turns_any_error_into_a_hint():
    @g.graded("9.9")
    def grader(x):
        return 1 / x

    with pytest.raises(AssertionError, match="Exercise 9.9: these answers could not be graded"):
        grader(0)

    @g.graded("9.9")
    def calls(f):
        f()

    with pytest.raises(AssertionError, match="still raises NotImplementedError"):
        calls(_stub)


# ---- the expected values come from the real memory layer ---------------------------------------------
def test_exercise_2_1_expected_values_come_from_a_real_block_table():
    allocator = BlockAllocator(num_blocks=8, block_size=16)
    table = BlockTable(allocator)
    for token in range(70):
        table.append_tokens([token])                # decode-style, one at a time
    assert (table.num_blocks, table.num_free_slots) == (5, 10)


def test_exercise_3_3_counts_come_from_500_real_tables():
    c = shared_prompt_counts()
    assert c.blocks_per_session == 63               # 62 full blocks + one holding 8 tokens
    assert c.blocks_shared == 63                    # 500 tables, one copy
    assert c.copies == 499                          # the last one to write keeps the original
    assert c.blocks_diverged == 62 + 500
    assert c.prompt_slots_diverged == 62 * 16 + 500 * 8


def test_exercise_3_3_counts_agree_with_the_prefix_cache_route():
    """500 tables that find the prompt in the prefix cache share the same 62 full blocks
    and each compute the partial 63rd themselves: the same 562 blocks as the forks."""
    allocator = BlockAllocator(num_blocks=600, block_size=16, enable_prefix_caching=True)
    prompt = list(range(1000))
    for session in range(500):
        table = BlockTable(allocator)
        reused = table.reuse_cached_prefix(prompt, max_tokens=len(prompt) - 1)
        assert reused == (0 if session == 0 else 992)
        table.append_tokens(prompt[reused:] + [1000 + session])
    assert allocator.num_used_blocks == shared_prompt_counts().blocks_diverged
    allocator.check_invariants()


def test_exercise_3_3_statements_have_a_verdict_each():
    """Every statement is either needed or explained, once the pick is right, as not a reason."""
    assert SHARING_SAFE < set(SHARING_STATEMENTS)
    assert set(memory.NOT_WHY) == set(SHARING_STATEMENTS) - SHARING_SAFE
