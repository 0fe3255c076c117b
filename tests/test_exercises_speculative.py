"""The graders of chapter 11 (speculative decoding), table-driven.

As in ``tests/test_exercises_ch4_8.py``: right answers in every accepted form pass with a
one-line verdict; plausible wrong answers fail, each named after the student mistake it models
and checked for the hint that names it; the stub, None, wrong types and junk get an
``AssertionError`` with a hint, never a traceback from inside the grader; no failure message
gives the answer away in any form its grader accepts (``answer_forms``). The expected values
come from the graders' module: the formula (11.2), a real block table (11.1) and the lab's
linear cost model (11.3).
"""

from __future__ import annotations

import numpy as np
import pytest

from labkit.exercises import speculative as SP
from test_exercises_ch4_8 import MODULE_OF, Case, right, run_case, wrong

MODULE_OF.setdefault("11", SP)     # run_case scans each hint for this module's answer_forms()

A, K, C = SP.EX2_ACCEPTANCE, SP.EX2_GUESSES, SP.EX2_DRAFT_COST
E = (1 - A ** (K + 1)) / (1 - A)


def one(**changes):
    def make():
        r = {**SP.ex2_expected(), **changes}
        return r["tokens_per_step"], r["speedup"]
    return make


T, G, KEPT, BS = SP.EX1_TOKENS, SP.EX1_GUESSES, SP.EX1_ACCEPTED, SP.EX1_BLOCK_SIZE
blocks = (lambda n: -(-n // BS))


def two(**changes):
    def make():
        r = {**SP.verify_blocks(), **changes}
        return r["blocks_during"], r["blocks_after"], r["slots_given_back"]
    return make


def stub():
    raise NotImplementedError("add up the chances of reaching each position")


CH11 = [
    # ---- 11.2 ----------------------------------------------------------------------------------
    right("11.2", SP.check_speedup_formula, one(), "floats"),
    right("11.2", SP.check_speedup_formula, lambda: (round(E, 3), f"{E / (K * C + 1):.3f}x"), "rounded-and-x"),
    right("11.2", SP.check_speedup_formula, lambda: (np.float32(E), np.array(E / (K * C + 1))), "numpy"),
    wrong("11.2", SP.check_speedup_formula, one(tokens_per_step=(1 - A ** K) / (1 - A)), "Count the step's own token",
          "sums-k-terms"),
    wrong("11.2", SP.check_speedup_formula, one(tokens_per_step=1 + K * A), "only if every guess before it",
          "guesses-independent"),
    wrong("11.2", SP.check_speedup_formula, one(tokens_per_step=1 / (1 - A)), "not an endless run",
          "infinite-series"),
    wrong("11.2", SP.check_speedup_formula, one(speedup=E), "The draft is not free", "draft-for-free"),
    wrong("11.2", SP.check_speedup_formula, one(speedup=E / (K * C)), "The verifying step itself costs",
          "verify-for-free"),
    wrong("11.2", SP.check_speedup_formula, one(speedup=E / ((K + 1) * C + 1)), "Only the k guesses are drafted",
          "drafts-k-plus-one"),
    wrong("11.2", SP.check_speedup_formula, one(speedup=7.52), "Compare tokens per unit of time", "a-guess"),
    wrong("11.2", SP.check_speedup_formula, one(tokens_per_step=3.4), "significant figures", "two-figures"),
    wrong("11.2", SP.check_speedup_formula, one(tokens_per_step=None), "no answer yet", "none"),
    wrong("11.2", SP.check_speedup_formula, one(speedup="fast"), "expected a number", "words"),
    wrong("11.2", SP.check_speedup_formula, one(speedup=float("nan")), "finite", "nan"),
    # ---- 11.1 ----------------------------------------------------------------------------------
    right("11.1", SP.check_verify_blocks, two(), "ints"),
    right("11.1", SP.check_verify_blocks, lambda: tuple(str(x) for x in two()()), "strings"),
    right("11.1", SP.check_verify_blocks, lambda: tuple(float(x) for x in two()()), "floats"),
    right("11.1", SP.check_verify_blocks, lambda: tuple(np.int64(x) for x in two()()), "numpy"),
    wrong("11.1", SP.check_verify_blocks, two(blocks_during=blocks(T - 1)), "That is before the step",
          "before-the-step"),
    wrong("11.1", SP.check_verify_blocks, two(blocks_after=blocks(T + G)), "What happens to the guesses",
          "keeps-the-rejected-guesses"),
    wrong("11.1", SP.check_verify_blocks, two(blocks_after=blocks(T + KEPT + 1)), "Count the tokens whose K/V",
          "gives-the-new-token-a-slot"),
    wrong("11.1", SP.check_verify_blocks, two(slots_given_back=G), "The accepted guesses keep their slots",
          "gives-back-every-guess"),
    wrong("11.1", SP.check_verify_blocks, two(slots_given_back=KEPT), "rejected, not those that were kept",
          "counts-the-kept"),
    wrong("11.1", SP.check_verify_blocks, two(slots_given_back=G - KEPT + 1), "Which of the slots the step filled",
          "gives-back-the-last-token"),
    wrong("11.1", SP.check_verify_blocks, two(slots_given_back=0), "What happens to the guesses", "nothing-back"),
    wrong("11.1", SP.check_verify_blocks, two(blocks_during=T + G), "Count the slots", "counts-slots-not-blocks"),
    wrong("11.1", SP.check_verify_blocks, two(blocks_after=None), "no answer yet", "none"),
    wrong("11.1", SP.check_verify_blocks, two(blocks_after=2.5), "not an integer", "a-fraction"),
    wrong("11.1", SP.check_verify_blocks, two(slots_given_back="some"), "expected a number", "words"),
    wrong("11.1", SP.check_verify_blocks, two(blocks_during=-7), "cannot be negative", "negative"),
    wrong("11.1", SP.check_verify_blocks, two(slots_given_back=G - KEPT + 5), "Which of the slots the step filled",
          "a-guess"),
    # ---- 11.3 ----------------------------------------------------------------------------------
    right("11.3", SP.check_crossover_batch, lambda: (SP.crossover_batch(),), "int"),
    right("11.3", SP.check_crossover_batch, lambda: (str(SP.crossover_batch()),), "string"),
    right("11.3", SP.check_crossover_batch, lambda: (np.int64(SP.crossover_batch()),), "numpy"),
    wrong("11.3", SP.check_crossover_batch, lambda: (SP._first_not_paying(computed=SP.EX3_GUESSES),),
          "k \\+ 1 tokens each, not k", "computes-k-tokens"),
    wrong("11.3", SP.check_crossover_batch,
          lambda: (SP._first_not_paying(gained=1 + SP.EX3_GUESSES * SP.EX3_ACCEPTANCE),),
          "not 1 \\+ k a", "guesses-independent"),
    wrong("11.3", SP.check_crossover_batch, lambda: (1000,), "find where their ratio reaches 1", "a-guess"),
    wrong("11.3", SP.check_crossover_batch, lambda: (None,), "no answer yet", "none"),
    wrong("11.3", SP.check_crossover_batch, lambda: ([18, 19],), "expected", "a-list"),
    wrong("11.3", SP.check_crossover_batch, lambda: (stub,), "expected", "the-stub-function"),
]


@pytest.mark.parametrize("case", CH11)
def test_grader_table(case: Case, capsys):
    run_case(case, capsys)


def test_table_covers_every_grader_with_enough_cases():
    graders = {c.values[0].grader for c in CH11}
    for name in dir(SP):
        if name.startswith("check_") and getattr(SP, name).__module__ == SP.__name__:
            assert getattr(SP, name) in graders, f"{name} is not in the table"
    for grader in graders:
        cases = [c.values[0] for c in CH11 if c.values[0].grader is grader]
        assert sum(c.match is None for c in cases) >= 2
        assert sum(c.match is not None for c in cases) >= 4


def test_the_formula_is_the_sum_of_the_chances_of_getting_that_far():
    for a in (0.0, 0.3, 0.8, 0.999):
        for k in (1, 3, 7):
            assert SP.expected_tokens_per_step(a, k) == pytest.approx(sum(a ** j for j in range(k + 1)))
    assert SP.expected_tokens_per_step(1.0, 4) == 5
    assert SP.expected_speedup(0.8, 4, 0.0) == pytest.approx(SP.expected_tokens_per_step(0.8, 4))


def test_the_verify_answer_follows_the_block_table():
    """Measured on a real table, and it moves with the exercise's numbers."""
    assert SP.verify_blocks() == {"blocks_during": blocks(T + G), "blocks_after": blocks(T + KEPT),
                                  "slots_given_back": G - KEPT}
    assert SP.verify_blocks(tokens=5, guesses=3, accepted=3, block_size=4) == \
        {"blocks_during": 2, "blocks_after": 2, "slots_given_back": 0}


def test_the_crossover_is_where_the_speedup_reaches_one():
    b = SP.crossover_batch()
    assert b > 1
    assert SP.batch_speedup(b) <= 1 < SP.batch_speedup(b - 1)
    assert SP.batch_speedup(1) > 1.5          # at batch 1 speculation pays well


def test_the_verify_exercise_matches_what_the_engine_does():
    """11.1's rule is the engine's: a speculating engine's outcomes hold blocks for every
    guessed slot while verifying, and for the kept tokens only after."""
    from test_spec_decode import NGRAM, make_engine

    from labkit import SamplingParams
    from labkit.model.loader import tiny_llama
    from labkit.viz.speculative import record_speculation

    engine = make_engine(tiny_llama(), NGRAM, block_size=4)
    outcomes = record_speculation(engine, [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]],
                                  SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert outcomes and any(o.accepted < len(o.drafted) for o in outcomes)
    for o in outcomes:
        assert o.lookahead == 0                 # prompt lookup reserves none
        r = SP.verify_blocks(o.first_position, len(o.drafted), o.accepted, o.block_size)
        assert (len(o.blocks_during), len(o.blocks_after)) == (r["blocks_during"], r["blocks_after"])
        assert o.slots_given_back == r["slots_given_back"]
    assert engine.scheduler.allocator.num_used_blocks == 0
