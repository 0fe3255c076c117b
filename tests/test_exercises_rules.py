"""The rules every value grader keeps, tested on each exercise's whole answer space.

* **One rounding rule, at its boundaries.** Every number an exercise asks for is judged to 3
  significant figures in the form the student wrote it in: in every form the exercise invites
  (fraction and percent, each unit), an answer just inside the rounding window of the expected
  value passes and one just outside fails, and so does a coarser rounding.
* **Hints that diagnose, never navigate.** Each exercise's answer space (a range of counts, a
  grid of 3-figure numbers around the answer, every pick of statements, every eviction order)
  is enumerated and every wrong answer graded: all of them but a few known mistakes get one
  and the same message (so a message says nothing about where the answer lies), no message
  says higher/lower or which item is wrong, and the attacks that solved the old graders in a
  few calls (bisection on the hints' wording, item-by-item elimination) need at least as many
  calls as guessing blind.
* **Plain data.** Every grader gives the same verdict to ``plain_arguments`` of its arguments,
  carried as JSON, as to the live arguments.

The graders that take the engine are called with plain facts (``engine_facts``-shaped dicts,
logprobs as a list): the verdicts depend on nothing else, so no model is needed here.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import random
import re
import statistics
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest

from labkit.exercises import _grading as g
from labkit.exercises import batching as B
from labkit.exercises import beams as BM
from labkit.exercises import disagg as D
from labkit.exercises import engine as EN
from labkit.exercises import memory as M
from labkit.exercises import prefix as P
from labkit.exercises import sampling as SA
from labkit.exercises import serving as S
from labkit.exercises import speculative as SP
from labkit.exercises import structured as X
from labkit.exercises import tiers as TI
from labkit.sim import TraceRequest, simulate

# ---- plain facts standing in for the live objects -------------------------------------------------
#: A small engine's configuration, as ``engine_facts`` gives it (consistent: bytes = blocks x tokens x per token).
FACTS = {"num_total_blocks": 64, "block_size": 8, "num_hidden_layers": 2, "num_key_value_heads": 2,
         "num_attention_heads": 4, "head_dim": 16, "dtype_bytes": 4, "max_num_seqs": 64,
         "max_num_batched_tokens": 2048, "max_model_len": 512}
PER_TOKEN = 2 * 2 * 2 * 16 * 4
FACTS["kv_cache_bytes"] = 64 * 8 * PER_TOKEN
PROMPT_LENS, MAX_TOKENS = [5, 9, 3, 12], 6
#: First-step logprobs (most likely first) where min-p 0.1 at temperature 0.5 keeps 3 of 8.
LOGPROBS = {"logprobs": [-0.4, -1.3, -1.5, -1.9, -2.6, -3.0, -3.4, -4.2], "top_text": " blue"}
TIMINGS = [{"sent": 0.5 * i, "first_token": 0.5 * i + t, "done": 0.5 * i + t + 1.5}
           for i, t in enumerate([0.10, 0.12, 0.15, 0.30, 0.45, 0.60, 0.80, 1.00])]
MEASURED = {"labkit": {"wall_s": 3.0, "output_tokens": 90}, "hf-static": {"wall_s": 4.0, "output_tokens": 90}}


@functools.lru_cache(maxsize=None)
def records() -> tuple[list[dict], list[str]]:
    trace = [TraceRequest(8, 6, arrival_s=0.0), TraceRequest(20, 12, arrival_s=1.0),
             TraceRequest(12, 10, arrival_s=1.0), TraceRequest(30, 8, arrival_s=1.05),
             TraceRequest(16, 6, arrival_s=1.2)]
    recs = S.record_facts(simulate(trace, num_blocks=64, block_size=4, max_num_seqs=4).records)
    mark = next(k for k, r in enumerate(recs) if any(rid == "r1" for rid, *_ in r["ran"]))
    return recs[mark:], ["r1", "r2", "r3", "r4"]


def _steps() -> int:
    return simulate([TraceRequest(n, MAX_TOKENS) for n in PROMPT_LENS], num_blocks=64, block_size=8,
                    max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=512,
                    keep_records=False).engine.num_steps


def _min_p():
    return SA.min_p_cut(LOGPROBS["logprobs"], SA.EX_TEMPERATURE, SA.EX_MIN_P)


def _joins():
    recs, ids = records()
    joined = S.first_iterations(recs, ids)
    return joined, S.decoding_at(recs, joined["r4"])


# ---- every value exercise: how to call it, its right answers, the space of each answer ----------------
@dataclass
class Part:
    """One answer of an exercise: its position in the call, how it is judged ("count": exact;
    "number": 3 figures, in ``forms``), and the candidates a search would try (``space``)."""

    index: int
    kind: str
    space: Callable[[], list]
    expected: Callable[[], float] | None = None           # "number" parts: the value, in base units
    forms: dict[str, Callable[[float], object]] = field(default_factory=dict)
    also: tuple[float, ...] = ()          # other accepted values (3.3: the block-exact counts)


@dataclass
class Exercise:
    """An exercise's grader, the arguments its check cell passes around the answers (as plain
    facts), its right answers and its parts."""

    id: str
    grader: Callable
    right: Callable[[], tuple]
    parts: list[Part]
    before: Callable[[], tuple] = lambda: ()
    after: Callable[[], tuple] = lambda: ()

    def args(self, answers) -> list:
        return [*self.before(), *answers, *self.after()]

    def grade(self, *answers) -> None:
        self.grader(*self.args(answers))


def counts(lo: int, hi: int) -> Callable[[], list]:
    return lambda: list(range(lo, hi + 1))


def grid(center: Callable[[], float], decades: float = 1.0, per_decade: int = 150,
         top: float = math.inf) -> Callable[[], list]:
    """3-figure numbers spread over ``decades`` either side of the expected value (every one of
    them near the answer, ``per_decade`` per decade far from it), up to ``top``."""
    def make():
        x = center()
        near = [float(g.round_sig(x * (1 + k / 1000))) for k in range(-60, 61)]
        far = [float(g.round_sig(x * 10 ** (decades * k / per_decade))) for k in range(-per_decade, per_decade + 1)]
        return sorted(v for v in set(near + far) - {0.0} if v <= top)
    return make


SHARE = {"fraction": lambda x: x, "percent": lambda x: 100 * x, "percent string": lambda x: f"{100 * x!r}%"}
BYTES = {"bytes": lambda x: x, "KiB": lambda x: f"{x / 1024!r} KiB", "MiB": lambda x: f"{x / 2**20!r} MiB",
         "GB": lambda x: f"{x / 1e9!r} GB"}
MIB = {"MiB": lambda x: x, "GiB": lambda x: f"{x / 1024!r} GiB", "MB": lambda x: f"{x * 2**20 / 1e6!r} MB"}
SECONDS = {"seconds": lambda x: x, "ms": lambda x: f"{x * 1e3!r} ms", "s string": lambda x: f"{x!r} s"}
RATIO = {"number": lambda x: x, "with x": lambda x: f"{x!r}x"}


def _n2() -> float:
    return BM.sampling_saving_expected(2)[0]


def _n6() -> float:
    return BM.sampling_saving_expected(6)[0]


EXERCISES = [
    Exercise("0.1", EN.check_kv_capacity, lambda: (64 * 8, PER_TOKEN),
             [Part(0, "count", counts(0, 1100)), Part(1, "number", grid(lambda: PER_TOKEN), lambda: PER_TOKEN, BYTES)],
             before=lambda: (FACTS,)),
    Exercise("0.2", EN.check_batch_iterations, lambda: (_steps(), _steps()),
             [Part(0, "count", counts(0, 80)), Part(1, "count", counts(0, 80))],
             before=lambda: (FACTS, PROMPT_LENS, MAX_TOKENS)),
    Exercise("1.1", EN.check_kv_bytes_70b, lambda: (327_680,),
             [Part(0, "number", grid(lambda: 327_680), lambda: 327_680, BYTES)]),
    Exercise("1.2", EN.check_70b_requests, lambda: (4096 * 327_680, 33),
             [Part(0, "number", grid(lambda: 4096 * 327_680), lambda: 4096 * 327_680, BYTES),
              Part(1, "count", counts(0, 300))]),
    Exercise("1.3", M.check_exercise_1, lambda: (200 / 4096, 200 / 4096),
             [Part(0, "number", grid(lambda: 200 / 4096), lambda: 200 / 4096, SHARE),
              Part(1, "number", grid(lambda: 200 / 4096), lambda: 200 / 4096, SHARE)]),
    Exercise("2.1", M.check_exercise_2, lambda: (5, 10, 10 / 70),
             [Part(0, "count", counts(0, 40)), Part(1, "count", counts(0, 40)),
              Part(2, "number", grid(lambda: 10 / 70, 0.8), lambda: 10 / 70, SHARE)]),
    Exercise("3.1", EN.check_fork_copies, lambda: (6, 3),
             [Part(0, "count", counts(0, 40)), Part(1, "count", counts(0, 40))]),
    Exercise("3.2", EN.check_prefix_reuse, lambda: (992, 58),
             [Part(0, "count", counts(0, 1100)), Part(1, "count", counts(0, 1100))]),
    Exercise("3.3", M.check_exercise_3, lambda: (500_000, 1000, "BEH"),
             [Part(0, "number", grid(lambda: 500_000), lambda: 500_000, MIB, also=(504_000,)),
              Part(1, "number", grid(lambda: 1000), lambda: 1000, MIB, also=(1008, 4992)),
              Part(2, "set", lambda: [set(p) for k in range(1, 11) for p in itertools.combinations("ABCDEFGHIJ", k)])]),
    Exercise("4.1", B.check_static_batch, lambda: (40, 0.55),
             [Part(0, "count", counts(0, 200)), Part(1, "number", grid(lambda: 0.55, 0.25), lambda: 0.55, SHARE)]),
    Exercise("4.2", B.check_preemption_free_pool, lambda: (B.ex42_expected(),),
             [Part(0, "count", lambda: list(B.ex42_pools()))]),
    Exercise("4.3", B.check_speedups, lambda: (B.ex43_ratios()["cpu"], B.ex43_ratios()["gpu"]),
             [Part(0, "number", grid(lambda: B.ex43_ratios()["cpu"]), lambda: B.ex43_ratios()["cpu"], RATIO),
              Part(1, "number", grid(lambda: B.ex43_ratios()["gpu"]), lambda: B.ex43_ratios()["gpu"], RATIO)]),
    Exercise("6.1", EN.check_speedup, lambda: (4 / 3,),
             [Part(0, "number", grid(lambda: 4 / 3), lambda: 4 / 3, RATIO)], before=lambda: (MEASURED,)),
    Exercise("6.2", EN.check_prefix_savings,
             lambda: (96, {"num_cached_prompt_tokens": 96, "num_prompt_tokens_computed": 24}),
             [Part(0, "count", counts(0, 400))], before=lambda: (FACTS, 37, 3)),
    Exercise("6.3", SA.check_min_p, lambda: (_min_p().survivors, _min_p().p_top),
             [Part(0, "count", counts(0, 30)),
              Part(1, "number", grid(lambda: _min_p().p_top, 0.4, top=1.0), lambda: _min_p().p_top,
                   {"fraction": lambda x: x})],
             before=lambda: (LOGPROBS,)),
    Exercise("7.1", D.check_ridge_point, lambda: (D.ridge_expected(),),
             [Part(0, "number", grid(D.ridge_expected), D.ridge_expected, {"number": lambda x: x})]),
    Exercise("7.2", D.check_prefill_doubling, lambda: (D.doubling_expected(),), [Part(0, "count", counts(0, 3000))]),
    Exercise("7.3", D.check_chunk_budget, lambda: (D.chunk_budget_expected(),),
             [Part(0, "count", counts(D.EX3_BATCH + 1, D.EX3_BATCH + D.EX3_PROMPT))]),
    Exercise("7.4", D.check_instance_plan, lambda: (D.plan_expected().num_prefill, D.plan_expected().num_decode),
             [Part(0, "count", counts(1, 60)), Part(1, "count", counts(1, 60))]),
    Exercise("8.1", S.check_ttft_p50, lambda: (statistics.median(t["first_token"] - t["sent"] for t in TIMINGS),),
             [Part(0, "number", grid(lambda: 0.375), lambda: 0.375, SECONDS)], after=lambda: (TIMINGS,)),
    Exercise("8.2", S.check_joins, lambda: _joins(),
             [Part(1, "set", lambda: [set(p) for k in range(0, 5) for p in itertools.combinations(
                 ["r1", "r2", "r3", "r4"], k)])], after=lambda: (*records(), "r4")),
    Exercise("9.1", BM.check_beam_blocks, lambda: (6, 12, 3),
             [Part(0, "count", counts(0, 40)), Part(1, "count", counts(0, 40)), Part(2, "count", counts(0, 40))]),
    Exercise("9.2", BM.check_sampling_saving, lambda: (_n2(), _n6()),
             [Part(0, "number", grid(_n2, 0.7), _n2, SHARE), Part(1, "number", grid(_n6, 0.5), _n6, SHARE)]),
    Exercise("9.3", BM.check_swap_crossover, lambda: (BM.crossover_expected(),),
             [Part(0, "count", lambda: list(BM.EX3_BLOCK_SIZES))]),
    Exercise("10.1", P.check_follow_up_reuse, lambda: tuple(P._ex1_measured().values()),
             [Part(0, "count", counts(0, 400)), Part(1, "count", counts(0, 400)), Part(2, "count", counts(0, 400))]),
    Exercise("10.2", P.check_eviction_order, lambda: (list(P._ex2_measured()[0]),),
             [Part(0, "sequence", lambda: [list(p) for p in itertools.permutations(range(P.EX2_POOL), 3)])]),
    Exercise("11.1", SP.check_verify_blocks,
             lambda: tuple(SP.verify_blocks()[n] for n in ("blocks_during", "blocks_after", "slots_given_back")),
             [Part(0, "count", counts(0, 60)), Part(1, "count", counts(0, 60)), Part(2, "count", counts(0, 60))]),
    Exercise("11.2", SP.check_speedup_formula,
             lambda: (SP.ex2_expected()["tokens_per_step"], SP.ex2_expected()["speedup"]),
             [Part(0, "number", grid(lambda: SP.ex2_expected()["tokens_per_step"], 0.7),
                   lambda: SP.ex2_expected()["tokens_per_step"], {"number": lambda x: x}),
              Part(1, "number", grid(lambda: SP.ex2_expected()["speedup"], 0.7), lambda: SP.ex2_expected()["speedup"],
                   RATIO)]),
    Exercise("11.3", SP.check_crossover_batch, lambda: (SP.crossover_batch(),), [Part(0, "count", counts(1, 200))]),
    Exercise("12.1", X.check_allowed_tokens, lambda: tuple(set(X.ex1_expected()[n]) for n in X.EX1_TEXTS),
             [Part(k, "set", lambda: [set(p) for n in range(len(X.EX1_VOCAB) + 1)
                                      for p in itertools.combinations(range(len(X.EX1_VOCAB)), n)])
              for k in range(len(X.EX1_TEXTS))]),
    Exercise("13.1", TI.check_quantized_bytes, lambda: tuple(TI.ex1_expected().values()),
             [Part(0, "count", counts(TI.ex1_expected()["bf16_bytes"] - 800, TI.ex1_expected()["bf16_bytes"] + 800)),
              Part(1, "count", counts(TI.ex1_expected()["int8_bytes"] - 800, TI.ex1_expected()["int8_bytes"] + 800)),
              Part(2, "number", grid(lambda: TI.ex1_expected()["tokens_ratio"], 0.7),
                   lambda: TI.ex1_expected()["tokens_ratio"], RATIO)]),
    Exercise("13.2", TI.check_copy_or_recompute, lambda: tuple(TI.ex2_expected().values()),
             [Part(0, "number", grid(lambda: TI.ex2_expected()["load_ms"]), lambda: TI.ex2_expected()["load_ms"] / 1e3,
                   {"ms": lambda x: x * 1e3, "ms string": lambda x: f"{x * 1e3!r} ms",
                    "s string": lambda x: f"{x!r} s"}),
              Part(1, "number", grid(lambda: TI.ex2_expected()["break_even_gbps"]),
                   lambda: TI.ex2_expected()["break_even_gbps"], {"number": lambda x: x})]),
    Exercise("13.3", TI.check_tier_rounds, lambda: tuple(TI.ex3_expected().values()),
             [Part(0, "count", counts(0, 60)), Part(1, "count", counts(0, 60)), Part(2, "count", counts(0, 60))]),
    Exercise("12.3", X.check_jump_blocks, lambda: tuple(X.jump_blocks()[n] for n in ("blocks_during", "blocks_after",
                                                                                  "tokens_gained")),
             [Part(0, "count", counts(0, 60)), Part(1, "count", counts(0, 60)), Part(2, "count", counts(0, 60))]),
]
BY_ID = {e.id: e for e in EXERCISES}


def verdict(exercise: Exercise, answers) -> str | None:
    """None when the answers pass, else the failure message."""
    return _verdict(exercise.grader, exercise.args(answers))


def _verdict(grader, args, kwargs=None) -> str | None:
    try:
        grader(*args, **(kwargs or {}))
    except AssertionError as e:
        return str(e)
    return None


def with_part(exercise: Exercise, part: Part, value) -> list:
    answers = list(exercise.right())
    answers[part.index] = value
    return answers


def test_the_registry_covers_every_value_grader():
    """Every grader of the modules above that takes values (not functions) is in ``EXERCISES``: a
    grader of code (12.2's ``token_allowed``) comes in two halves, ``probe`` and ``judge``."""
    graded = {e.grader for e in EXERCISES}
    for module in (EN, M, B, D, S, SA, BM, P, SP, X, TI):
        for name in dir(module):
            f = getattr(module, name)
            if getattr(f, "judge", None) is not None:
                continue                                   # runs the student's function: judged in its own tests
            if name.startswith("check_") and getattr(f, "__module__", "") == module.__name__:
                assert f in graded, f"{module.__name__}.{name} ({f.exercise}) is not in EXERCISES"


@pytest.mark.parametrize("exercise", EXERCISES, ids=[e.id for e in EXERCISES])
def test_the_right_answers_pass(exercise, capsys):
    assert verdict(exercise, exercise.right()) is None
    assert capsys.readouterr().out.startswith("✓ ")


# ---- the rounding rule at its boundaries -----------------------------------------------------------
NUMBER_PARTS = [(e, p, form) for e in EXERCISES for p in e.parts if p.kind == "number" for form in p.forms]


@pytest.mark.parametrize("exercise, part, form", NUMBER_PARTS,
                         ids=[f"{e.id}-answer{p.index}-{form}" for e, p, form in NUMBER_PARTS])
def test_the_rounding_rule_at_its_boundaries(exercise, part, form, capsys):
    """In each invited form: the value rounded to 3 figures passes, and so do answers just inside
    its rounding window; just outside fails, and so does the value rounded to 2 figures (unless
    that happens to be the same number)."""
    write = part.forms[form]
    expected = part.expected()
    scale = float(write(1.0).split()[0].rstrip("x%")) if isinstance(write(1.0), str) else float(write(1.0))
    shown = expected * scale                          # the expected value in this form's unit
    low, high = g.precision_window(shown)
    r = float(g.round_sig(shown))
    inside = [r, low + 0.02 * (r - low), high - 0.02 * (high - r), shown]
    outside = [low - 0.02 * (r - low), high + 0.02 * (high - r)]
    for x in inside:
        message = verdict(exercise, with_part(exercise, part, write(x / scale)))
        assert message is None, f"{write(x / scale)!r} is within rounding of {shown!r} but fails: {message}"
    capsys.readouterr()
    for x in outside:
        if any(g.agrees(x, other * scale) for other in part.also):
            continue                                   # another accepted form's window
        message = verdict(exercise, with_part(exercise, part, write(x / scale)))
        assert message is not None, f"{write(x / scale)!r} is outside the 3-figure window of {shown!r} but passes"
        assert "significant figures" not in message, message      # written with many figures: judged, not sent back
    two = float(g.round_sig(shown, 2))
    if g.round_sig(two) != g.round_sig(shown):
        message = verdict(exercise, with_part(exercise, part, write(two / scale) if form != "percent string"
                                              else f"{g.round_sig(shown, 2)}%"))
        assert message is not None, f"{two!r} (2 figures) passes for {shown!r}"


# ---- hints that diagnose, never navigate --------------------------------------------------------------
#: Words that tell a student which way to go, how far, or which item of an answer is wrong.
NAVIGATION = re.compile(
    r"\b(higher|lower|larger|smaller|bigger|too (?:small|large|big|many|few|high|low|much|little)|more than"
    r"|are needed|fewer|closer|further|look (?:lower|higher|up|down)|upward|downward|one short|off by|close,"
    r"|round (?:it )?(?:up|down)|not quite|nearly|almost|wrong order|right blocks|times too)\b", re.IGNORECASE)


def label(message: str, answer) -> str:
    """A message without the echo of the student's own answer: what it tells about anything else."""
    m = re.match(r"^([^:]+): .*? is not right\. (.*)$", message, re.S)
    if m:
        return f"{m.group(1)}: {m.group(2)}"
    message = re.sub(r"\(.*? has \d+\)", "(…)", message)
    return message.replace(str(answer), "<answer>")


@functools.lru_cache(maxsize=None)
def labels(exercise_id: str, index: int) -> tuple[tuple[object, str | None], ...]:
    """Every candidate of one part's space with its label (None where it passes)."""
    exercise = BY_ID[exercise_id]
    part = next(p for p in exercise.parts if p.index == index)
    out = []
    for x in part.space():
        message = verdict(exercise, with_part(exercise, part, x))
        out.append((x, None if message is None else label(message, x)))
    return tuple(out)


SPACES = [(e, p) for e in EXERCISES for p in e.parts]
#: The precision hint: about the form of an answer (its figures), the same wherever the answer lies.
FORM = re.compile(r"give it to 3 significant figures, as the exercise asks")
#: Known mistakes may name their concept, each on a few answers (unit mix-ups: one per prefix step);
#: an answer space may have at most this many answers outside the one method hint.
KNOWN_MISTAKES_MAX = 24


@pytest.mark.parametrize("exercise, part", SPACES, ids=[f"{e.id}-answer{p.index}" for e, p in SPACES])
def test_wrong_answers_get_one_message_but_for_known_mistakes(exercise, part):
    """Over the whole space, every wrong answer but a few known mistakes gets the same message,
    and no message navigates."""
    graded = labels(exercise.id, part.index)
    right = [x for x, lab in graded if lab is None]
    wrong = [lab for _, lab in graded if lab is not None]
    assert len(right) >= 1 or part.kind in ("set", "sequence"), f"{exercise.id}: no right answer in the space"
    wrong = [lab for lab in wrong if not FORM.search(lab)]      # "give it to 3 figures": says how it is written
    generic, count = collections_mode(wrong)
    special = len(wrong) - count
    limit = KNOWN_MISTAKES_MAX + (len(wrong) // 50 if part.kind == "number" else 0)
    others = sorted({lab for lab in wrong if lab != generic})[:6]
    assert special <= limit, (f"{exercise.id} answer {part.index}: {special} of {len(wrong)} wrong answers get a "
                              "message of their own: " + "; ".join(others))
    navigating = sorted({lab for lab in wrong if NAVIGATION.search(lab)})
    assert not navigating, f"{exercise.id}: hints that navigate: {navigating[:3]}"


def collections_mode(values: list[str]) -> tuple[str, int]:
    counts_: dict[str, int] = {}
    for v in values:
        counts_[v] = counts_.get(v, 0) + 1
    return max(counts_.items(), key=lambda kv: kv[1])


def blind_cost(n: int) -> float:
    """Expected calls to find one right answer among ``n`` candidates, trying them in random order."""
    return (n + 1) / 2


def bisection_cost(graded: tuple, rng: random.Random, trials: int = 30) -> float:
    """The attack on ordered spaces: bisect on the hints' wording (a hint that reads like the one at
    the low end means "go higher"), then try what is left in random order. Average calls over
    random sub-ranges that hold the answer."""
    xs = [x for x, _ in graded]
    lab = {i: graded[i][1] for i in range(len(xs))}
    answer = next(i for i in range(len(xs)) if lab[i] is None)
    costs = []
    for _ in range(trials):
        lo, hi = rng.randint(0, answer), rng.randint(answer, len(xs) - 1)
        tried = set()

        def ask(i):
            tried.add(i)
            return lab[i]
        found = ask(lo) is None or ask(hi) is None
        low_label = lab[lo]
        a, b = lo, hi
        while not found and b - a > 1:
            mid = (a + b) // 2
            here = ask(mid)
            if here is None:
                found = True
            elif here == low_label:
                a = mid
            else:
                b = mid
        cost = len(tried)
        if not found:
            rest = (hi - lo + 1) - len(tried)
            cost += (rest + 1) / 2
        costs.append(cost)
    return statistics.mean(costs)


ORDERED = [(e, p) for e, p in SPACES if p.kind in ("count", "number") and len(p.space()) > 8]


# 4.2's space is graded by a simulation per pool (seconds): make test runs it, make test-fast does not.
@pytest.mark.parametrize("exercise, part", [pytest.param(e, p, marks=[pytest.mark.slow] if e.id == "4.2" else [])
                                            for e, p in ORDERED], ids=[f"{e.id}-answer{p.index}" for e, p in ORDERED])
def test_bisecting_on_the_hints_is_no_faster_than_guessing(exercise, part):
    graded = labels(exercise.id, part.index)
    rng = random.Random(0)
    attack = bisection_cost(graded, rng)
    rng = random.Random(0)
    blind = []
    answer = next(i for i, (_, lab) in enumerate(graded) if lab is None)
    for _ in range(30):
        lo, hi = rng.randint(0, answer), rng.randint(answer, len(graded) - 1)
        # guessing also starts with the ends of the range, then tries the rest in random order
        blind.append(1.0 if answer == lo else 2.0 if answer == hi else 2 + blind_cost(hi - lo - 1))
    assert attack >= 0.9 * statistics.mean(blind), (
        f"{exercise.id}: reading the hints finds the answer in {attack:.1f} calls on average, guessing "
        f"in {statistics.mean(blind):.1f}: the hints say where it lies")


FINITE = [(e, p) for e, p in SPACES if p.kind in ("set", "sequence") or (p.kind == "count" and len(p.space()) <= 8)]


@pytest.mark.parametrize("exercise, part", FINITE, ids=[f"{e.id}-answer{p.index}" for e, p in FINITE])
def test_no_hint_tells_which_item_is_wrong(exercise, part):
    """Sets and orders (3.3's letters, 8.2's requests, 10.2's blocks, 9.3's sizes): every wrong
    answer but a few known mistakes gets the same hint, and no hint names an item of the
    answer (a letter, a request, a block)."""
    graded = labels(exercise.id, part.index)
    generic, _ = collections_mode([lab for _, lab in graded if lab is not None])
    special = {lab for _, lab in graded if lab is not None and lab != generic}
    assert len([1 for _, lab in graded if lab is not None and lab != generic]) <= KNOWN_MISTAKES_MAX, special
    items = {str(item) for x, _ in graded if part.kind in ("set", "sequence") for item in x}
    for lab in special:                   # (the one generic hint, the same for every answer, says nothing)
        hint = lab.split(": ", 1)[-1]
        named = [item for item in items if re.search(rf"(?<![\w.]){re.escape(item)}(?![\w.])", hint)
                 and len(item) > 1 or re.search(rf"\b(statement|block|request) {re.escape(item)}\b", hint)]
        assert not named, f"{exercise.id}: a hint names {named}: {lab}"


SET_PARTS = [(e, p) for e, p in SPACES if p.kind == "set"]


def singleton_attack_cost(graded: dict[frozenset, str | None], items: list[str]) -> float:
    """The attack on picks of items: grade every one-item pick, group the items by the hint they
    got, then try unions of the groups (smallest first), then everything else in random order.
    Expected calls to find the right pick."""
    by_item = {item: graded[frozenset({item})] for item in items}
    if any(lab is None for lab in by_item.values()):
        return float(len(items))
    groups: dict[str, list[str]] = {}
    for item, lab in by_item.items():
        groups.setdefault(lab, []).append(item)
    tries = [frozenset(itertools.chain(*c)) for k in range(1, len(groups) + 1)
             for c in itertools.combinations(groups.values(), k)]
    right = next(p for p, lab in graded.items() if lab is None)
    calls = len(items)
    for pick in tries:
        calls += 1
        if pick == right:
            return float(calls)
    rest = len(graded) - len(items) - len(tries)
    return calls + (rest + 1) / 2


@pytest.mark.parametrize("exercise, part", SET_PARTS, ids=[f"{e.id}-answer{p.index}" for e, p in SET_PARTS])
def test_grouping_items_by_their_hints_is_no_faster_than_guessing(exercise, part):
    """The attack against the same search with the hints ignored (every wrong pick read as one
    "wrong"): the one-item picks first, then all the items, then the rest in random order. Where
    the answer is one item (12.1 after a complete match: the end token alone) both find it among
    the one-item picks; elsewhere the blind search costs what guessing does."""
    graded = {frozenset(x): lab for x, lab in labels(exercise.id, part.index)}
    items = sorted({item for pick in graded for item in pick})
    blind = singleton_attack_cost(ignoring_hints(graded), items)
    assert blind >= min(blind_cost(len(graded)), len(items))
    assert singleton_attack_cost(graded, items) >= 0.9 * blind


def ignoring_hints(graded: dict[frozenset, str | None]) -> dict[frozenset, str | None]:
    """The verdicts a search that ignores the hints reads: right, or one and the same "wrong"."""
    return {pick: None if lab is None else "wrong" for pick, lab in graded.items()}


@pytest.mark.parametrize("exercise, part", SET_PARTS, ids=[f"{e.id}-answer{p.index}" for e, p in SET_PARTS])
def test_one_item_away_from_the_answer_gets_the_method_hint(exercise, part):
    """The probe that found 12.1's leak: the right pick with one item added or taken away. A hint
    of its own there (the end token mid-word, 12.1's empty word) would say which item to flip."""
    graded = {frozenset(x): lab for x, lab in labels(exercise.id, part.index)}
    generic, _ = collections_mode([lab for lab in graded.values() if lab is not None])
    right = [pick for pick, lab in graded.items() if lab is None]
    items = {item for pick in graded for item in pick}
    for pick in right:
        for item in items:
            flipped = pick ^ {item}
            if flipped in graded and graded[flipped] is not None:
                assert graded[flipped] == generic, f"{exercise.id}: flipping {item!r}: {graded[flipped]}"


def test_the_attacks_find_hints_that_navigate_or_name_items():
    """The search tests can fail: "look lower" is solved by bisection in a few calls, and hints
    that name a wrong letter by grouping the letters."""
    graded = tuple((x, None if x == 613 else ("go higher" if x < 613 else "look lower")) for x in range(1000))
    assert bisection_cost(graded, random.Random(0)) < 0.2 * blind_cost(500)
    items, right = list("ABCDEFGHIJ"), frozenset("BEH")
    picks = [frozenset(p) for k in range(1, 11) for p in itertools.combinations(items, k)]
    naming = {p: None if p == right else (f"statement {min(p - right)} does not belong" if p - right
                                          else "not enough") for p in picks}
    assert singleton_attack_cost(naming, items) < 0.1 * blind_cost(len(picks))


# ---- plain data -------------------------------------------------------------------------------------------
PLAIN = [(e, kind) for e in EXERCISES for kind in ("right", "wrong")]


@pytest.mark.parametrize("exercise, kind", PLAIN, ids=[f"{e.id}-{k}" for e, k in PLAIN])
def test_plain_arguments_give_the_same_verdict(exercise, kind, capsys):
    """``plain_arguments`` of the call, through JSON, and back into the grader: the same verdict
    and the same verdict line."""
    answers = list(exercise.right())
    if kind == "wrong":
        part = exercise.parts[0]
        answers[part.index] = next(x for x, lab in labels(exercise.id, part.index) if lab is not None)
    answers = [np.array(sorted(a)) if isinstance(a, set) and exercise.id == "8.2" else a for a in answers]
    capsys.readouterr()
    live = verdict(exercise, answers)
    out_live = capsys.readouterr().out
    plain = json.loads(json.dumps(exercise.grader.plain_arguments(*exercise.args(answers))))
    assert _verdict(exercise.grader, plain["args"], plain["kwargs"]) == live
    assert capsys.readouterr().out == out_live


def test_plain_data_keeps_what_the_containers_mean():
    """A set stays a set (10.2 refuses one: the order matters), numpy and torch values become
    numbers and lists, and a value that is no data is described, so the hint can still name it."""
    import torch
    assert g.to_plain({"b", "a"}) == {"__set__": ["a", "b"]}
    assert g.from_plain(json.loads(json.dumps(g.to_plain({"B", "E", "H"})))) == {"B", "E", "H"}
    assert g.to_plain(np.float32(0.5)) == 0.5 and g.to_plain(np.array([1, 2])) == [1, 2]
    assert g.to_plain(torch.tensor([3, 4])) == [3, 4] and g.to_plain((1, 2)) == [1, 2]
    described = g.from_plain(json.loads(json.dumps(g.to_plain(object()))))
    assert type(described).__name__ == "object" and "object" in repr(described)
    with pytest.raises(AssertionError, match="order matters"):
        P.check_eviction_order(*json.loads(json.dumps(P.check_eviction_order.plain_arguments({2, 5, 1})))["args"])
    with pytest.raises(AssertionError, match="got object"):
        B.check_static_batch(*json.loads(json.dumps(B.check_static_batch.plain_arguments(object(), 0.55)))["args"])


# ---- "not answered yet" instead of a NameError ------------------------------------------------------
def test_an_unanswered_check_cell_says_so_and_names_the_variables():
    interactiveshell = pytest.importorskip("IPython.core.interactiveshell")
    shell = interactiveshell.InteractiveShell()          # a fresh shell: the hook installs on it alone
    assert g.install_unanswered_hook(shell)
    shown = []
    shell._showtraceback = lambda etype, value, stb: shown.append((etype.__name__, str(value)))
    result = shell.run_cell("# CHECK exercise 1.3\nfrom labkit.exercises import check_exercise_1\n\n"
                            "check_exercise_1(fraction_used=fraction_used, utilization_100=utilization_100)")
    assert isinstance(result.error_in_exec, g.NotAnsweredYet)                # the cell still fails, as that
    (name, message), = shown
    assert name == "NotAnsweredYet" and "Exercise 1.3 is not answered yet" in message
    assert "`fraction_used`, `utilization_100` are not defined" in message
    shown.clear()
    shell.run_cell("fraction_used = 0.0488\n")
    shell.run_cell("# CHECK exercise 1.3\ncheck_exercise_1(fraction_used, utilization_100)")
    assert "`utilization_100` is not defined" in shown[0][1] and "fraction_used" not in shown[0][1]
    shown.clear()
    shell.run_cell("# CHECK exercise 7.1\ncheck_ridge_point(ridge_tokens)")      # the grader's import skipped
    assert "`ridge_tokens`" in shown[0][1] and "`check_ridge_point` is not defined yet either" in shown[0][1]


def test_other_name_errors_show_as_usual():
    interactiveshell = pytest.importorskip("IPython.core.interactiveshell")
    shell = interactiveshell.InteractiveShell()
    g.install_unanswered_hook(shell)
    shown = []
    shell.showtraceback = lambda *a, **k: shown.append("usual")
    shell._showtraceback = lambda etype, value, stb: shown.append(etype.__name__)
    shell.run_cell("print(no_such_name)")
    shell.run_cell("def f():\n    return no_such_name\n")
    shell.run_cell("# CHECK exercise 1.3\nf()")            # raised inside a function, not by the check's own names
    assert shown == ["usual", "usual"]
    other = interactiveshell.InteractiveShell()
    other.set_custom_exc((ValueError,), lambda *a, **k: None)
    assert not g.install_unanswered_hook(other)           # never over someone else's handler
