"""The graders of chapter 12 (structured outputs), table-driven.

As in ``tests/test_exercises_ch4_8.py``: right answers in every accepted form pass with a
one-line verdict; plausible wrong answers fail, each named after the student mistake it models
and checked for the hint that names it; the stub, None, wrong types and junk get an
``AssertionError`` with a hint, never a traceback from inside the grader; no failure message
gives the answer away in any form its grader accepts (``answer_forms``). The expected values
come from the graders' module, which asks XGrammar (12.1) and a real block table (12.3).
"""

from __future__ import annotations

import numpy as np
import pytest

from labkit.exercises import structured as X
from test_exercises_ch4_8 import MODULE_OF, Case, right, run_case, wrong

MODULE_OF.setdefault("12", X)     # run_case scans each hint for this module's answer_forms()


def sets(**changes):
    """12.1's right answers, with some replaced."""
    def make():
        answers = {name: set(ids) for name, ids in X.ex1_expected().items()}
        answers.update(changes)
        return answers["allowed_start"], answers["allowed_mid"], answers["allowed_end"]
    return make


def by_text(name: str) -> list[str]:
    return [X.EX1_VOCAB[t] for t in sorted(X.ex1_expected()[name])]


# ---- 12.2: functions students write -------------------------------------------------------------
def walk_right(step, state, token):
    for char in token:
        state = step(state, char)
        if state is None:
            return False
    return True


def first_char_only(step, state, token):
    return step(state, token[0]) is not None


def stale_state(step, state, token):
    return all(step(state, c) is not None for c in token)


def any_char(step, state, token):
    return any(step(state, c) is not None for c in token)


def must_complete(step, state, token):
    end = X.walk(step, state, token)
    return end in X.NUMBER_ACCEPTING | X.QUOTED_ACCEPTING


def returns_state(step, state, token):
    return X.walk(step, state, token)


def numpy_bool(step, state, token):
    return np.bool_(walk_right(step, state, token))


def stub(step, state, token):
    raise NotImplementedError("read the token one character at a time")


def crashes(step, state, token):
    return token[5] == "x"


def allows_all(step, state, token):
    return True


def right_but_for_quotes(step, state, token):
    return walk_right(step, state, token) if '"' not in token else first_char_only(step, state, token)


def three():
    r = X.jump_blocks()
    return r["blocks_during"], r["blocks_after"], r["tokens_gained"]


def three_with(**changes):
    def make():
        r = {**X.jump_blocks(), **changes}
        return r["blocks_during"], r["blocks_after"], r["tokens_gained"]
    return make


T, K, A, BS = X.EX3_TOKENS, X.EX3_DRAFTED, X.EX3_ACCEPTED, X.EX3_BLOCK_SIZE
blocks = (lambda n: -(-n // BS))

CH12 = [
    # ---- 12.1 --------------------------------------------------------------------------------
    right("12.1", X.check_allowed_tokens, sets(), "sets-of-ids"),
    right("12.1", X.check_allowed_tokens, lambda: tuple(sorted(s) for s in sets()()), "sorted-lists"),
    right("12.1", X.check_allowed_tokens, lambda: tuple(by_text(n) for n in X.EX1_TEXTS), "token-texts"),
    right("12.1", X.check_allowed_tokens, lambda: tuple(np.array(sorted(s)) for s in sets()()), "arrays"),
    wrong("12.1", X.check_allowed_tokens, sets(allowed_mid={0, 1, 2, 3, 4, 5, 7, 8, 10, 11}),
          "all of its characters, not only its first", "first-character-only"),
    wrong("12.1", X.check_allowed_tokens, sets(allowed_mid={0, 1}), "several characters count too",
          "single-character-tokens-only"),
    wrong("12.1", X.check_allowed_tokens, sets(allowed_mid={0, 3}), "may leave the text unfinished",
          "only-tokens-that-complete-a-match"),
    # one token from the answer: the method's hint, which names both concepts (a hint of its own would
    # single that token out, issue 27)
    wrong("12.1", X.check_allowed_tokens, sets(allowed_mid={0, 1, 2, 3, 10, X.EX1_EOS}),
          "end-of-sequence token only where the text so far is a complete match", "end-token-mid-word"),
    wrong("12.1", X.check_allowed_tokens, sets(allowed_end=set()), "Walk each token's characters",
          "nothing-at-the-end"),
    wrong("12.1", X.check_allowed_tokens, sets(allowed_end={0, X.EX1_EOS}), "Walk each token's characters",
          "another-quote-after-the-match"),
    wrong("12.1", X.check_allowed_tokens, sets(allowed_start={0}), "several characters count too",
          "only-the-quote-at-the-start"),
    wrong("12.1", X.check_allowed_tokens, sets(allowed_start={0, 5, 8, 11, 4}), "Walk each token's characters",
          "empty-word-allowed"),
    wrong("12.1", X.check_allowed_tokens, sets(allowed_mid={1, 2, 10}), "Walk each token's characters", "a-guess"),
    wrong("12.1", X.check_allowed_tokens, sets(allowed_start=None), "no answer yet", "none"),
    wrong("12.1", X.check_allowed_tokens, sets(allowed_start={0, 99}), "not a token of the toy vocabulary",
          "out-of-range"),
    wrong("12.1", X.check_allowed_tokens, sets(allowed_end="everything"), "not a token of the toy vocabulary", "words"),
    wrong("12.1", X.check_allowed_tokens, sets(allowed_end=3.5), "expected a list", "a-number"),
    wrong("12.1", X.check_allowed_tokens, sets(allowed_mid={True, 2}), "not a token of the toy vocabulary", "a-bool"),
    # ---- 12.2 --------------------------------------------------------------------------------
    right("12.2", X.check_token_allowed, lambda: (walk_right,), "loop"),
    right("12.2", X.check_token_allowed, lambda: (lambda step, state, token: X.walk(step, state, token) is not None,),
          "via-walk"),
    right("12.2", X.check_token_allowed, lambda: (numpy_bool,), "numpy-bool"),
    wrong("12.2", X.check_token_allowed, lambda: (first_char_only,), "first character only", "first-character-only"),
    wrong("12.2", X.check_token_allowed, lambda: (stale_state,), "from the state the text started in", "stale-state"),
    wrong("12.2", X.check_token_allowed, lambda: (any_char,), "One character that fits is not enough", "any-character"),
    wrong("12.2", X.check_token_allowed, lambda: (must_complete,), "only allows tokens that complete a match",
          "must-end-accepting"),
    wrong("12.2", X.check_token_allowed, lambda: (allows_all,), "allows every token", "allows-everything"),
    wrong("12.2", X.check_token_allowed, lambda: (right_but_for_quotes,), "Walk it by hand", "wrong-on-some-tokens"),
    wrong("12.2", X.check_token_allowed, lambda: (returns_state,), "return True or False", "returns-the-state"),
    wrong("12.2", X.check_token_allowed, lambda: (stub,), "still raises NotImplementedError", "stub"),
    wrong("12.2", X.check_token_allowed, lambda: (crashes,), "raised IndexError", "crashes"),
    wrong("12.2", X.check_token_allowed, lambda: (None,), "pass your function itself", "none"),
    wrong("12.2", X.check_token_allowed, lambda: (3,), "pass your function itself", "a-number"),
    # ---- 12.3 --------------------------------------------------------------------------------
    right("12.3", X.check_jump_blocks, three, "ints"),
    right("12.3", X.check_jump_blocks, lambda: tuple(str(x) for x in three()), "strings"),
    right("12.3", X.check_jump_blocks, lambda: tuple(float(x) for x in three()), "floats"),
    right("12.3", X.check_jump_blocks, lambda: tuple(np.int64(x) for x in three()), "numpy"),
    wrong("12.3", X.check_jump_blocks, three_with(blocks_after=blocks(T + K)), "What happens to the drafts",
          "keeps-the-rejected-drafts"),
    wrong("12.3", X.check_jump_blocks, three_with(blocks_during=blocks(T - 1)), "That is before the step",
          "before-the-step"),
    wrong("12.3", X.check_jump_blocks, three_with(tokens_gained=K + 1), "What happens to the drafts",
          "gains-every-draft"),
    wrong("12.3", X.check_jump_blocks, three_with(tokens_gained=1), "The drafts the model agreed with are kept",
          "one-token-per-step"),
    wrong("12.3", X.check_jump_blocks, three_with(tokens_gained=A), "Which tokens does the sequence have",
          "forgets-the-steps-own-token"),
    wrong("12.3", X.check_jump_blocks, three_with(blocks_after=blocks(T + A + 1)), "Count the tokens whose K/V",
          "gives-the-new-token-a-slot"),
    wrong("12.3", X.check_jump_blocks, three_with(blocks_during=blocks(T + K) + 1),
          "Count the slots the step's chunk needs", "one-block-too-many"),
    wrong("12.3", X.check_jump_blocks, three_with(blocks_during=(T + K)), "Count the slots",
          "counts-slots-not-blocks"),
    wrong("12.3", X.check_jump_blocks, three_with(blocks_after=None), "no answer yet", "none"),
    wrong("12.3", X.check_jump_blocks, three_with(blocks_after=2.5), "not an integer", "a-fraction"),
    wrong("12.3", X.check_jump_blocks, three_with(tokens_gained="many"), "expected a number", "words"),
    wrong("12.3", X.check_jump_blocks, three_with(blocks_during=-7), "cannot be negative", "negative"),
]


@pytest.mark.parametrize("case", CH12)
def test_grader_table(case: Case, capsys):
    run_case(case, capsys)


def test_table_covers_every_grader_with_enough_cases():
    graders = {c.values[0].grader for c in CH12}
    for name in dir(X):
        if name.startswith("check_") and getattr(X, name).__module__ == X.__name__:
            assert getattr(X, name) in graders, f"{name} is not in the table"
    for grader in graders:
        cases = [c.values[0] for c in CH12 if c.values[0].grader is grader]
        assert sum(c.match is None for c in cases) >= 2
        assert sum(c.match is not None for c in cases) >= 4


def test_the_toy_masks_are_what_the_automaton_says():
    """XGrammar's masks (what the grader expects) equal the hand-written automaton's walk, with
    the end token exactly where the walk ends in an accepting state."""
    for name, text in X.EX1_TEXTS.items():
        state = X.walk(X.quoted_step, "start", text)
        walked = {t for t, tok in enumerate(X.EX1_VOCAB[:-1]) if X.walk(X.quoted_step, state, tok) is not None}
        if state in X.QUOTED_ACCEPTING:
            walked.add(X.EX1_EOS)
        assert X.ex1_expected()[name] == walked


def test_the_jump_answer_follows_the_block_table():
    """Measured on a real table, and it moves with the exercise's numbers."""
    assert X.jump_blocks() == {"blocks_during": blocks(T + K), "blocks_after": blocks(T + A), "tokens_gained": A + 1}
    assert X.jump_blocks(tokens=5, drafted=3, accepted=3, block_size=4) == \
        {"blocks_during": 2, "blocks_after": 2, "tokens_gained": 4}


def test_probe_and_judge_give_the_verdict_of_the_grader(capsys):
    """12.2's halves, as labkit.grade runs them apart: plain data in between."""
    import json
    ran = json.loads(json.dumps(X.check_token_allowed.probe(walk_right)))
    X.check_token_allowed.judge(ran)
    assert capsys.readouterr().out.startswith("✓")
    with pytest.raises(AssertionError, match="first character only"):
        X.check_token_allowed.judge(json.loads(json.dumps(X.check_token_allowed.probe(first_char_only))))
