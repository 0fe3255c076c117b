"""The graders of chapter 9 ("Beams and swaps"), table-driven: what a class would hand in.

As ``tests/test_exercises_ch4_8.py``: for every grader at least two equivalent right answers
pass; at least four plausible wrong answers fail, each named after the mistake it models and
checked for the hint that names it; the stub, None, wrong types and junk get an
``AssertionError`` with a message, never a traceback of the grader's own; no failure message
contains the answer in a form the grader accepts (``answer_forms``). Expected values come
from the graders' module (real block tables, the simulator's cost model): the wrong answers
are derived from them, never typed in.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from labkit.exercises import beams as E
from labkit.memory import BeamTree
from test_answer_leaks import find_form
from test_exercises_ch4_8 import right, wrong
from test_exercises_ch4_8 import test_value_graders_answer_junk_with_a_hint as junk_check


def _beams():
    return E.beam_pattern_expected()


def _saving(n):
    return E.sampling_saving_expected(n)[0]


def _both(f2=None, f6=None):
    """Answers to 9.2, each the right saving unless replaced."""
    return (_saving(2) if f2 is None else f2, _saving(6) if f6 is None else f6)


CH9 = [
    # 9.1
    right("9.1", E.check_beam_blocks, lambda: (_beams().blocks_held, _beams().blocks_without_sharing,
                                               _beams().copies), "ints"),
    right("9.1", E.check_beam_blocks, lambda: (str(_beams().blocks_held), f"{_beams().blocks_without_sharing}.0",
                                               float(_beams().copies)), "strings-and-floats"),
    wrong("9.1", E.check_beam_blocks, lambda: (_beams().held_if_dead_kept, _beams().blocks_without_sharing,
                                               _beams().copies), "freed at once", "dead-beams-keep-their-blocks"),
    wrong("9.1", E.check_beam_blocks, lambda: (_beams().blocks_without_sharing, _beams().blocks_held,
                                               _beams().copies), "swapped", "physical-and-logical-swapped"),
    wrong("9.1", E.check_beam_blocks, lambda: (_beams().blocks_held, _beams().blocks_held, _beams().copies),
          "own copy", "logical-equals-physical"),
    wrong("9.1", E.check_beam_blocks, lambda: (_beams().blocks_without_sharing, _beams().blocks_without_sharing,
                                               _beams().copies), "counted once", "counts-shared-blocks-per-table"),
    wrong("9.1", E.check_beam_blocks, lambda: (_beams().blocks_held, _beams().blocks_without_sharing,
                                               _beams().forks), "Not every fork copies", "a-copy-per-fork"),
    wrong("9.1", E.check_beam_blocks, lambda: (_beams().blocks_held, _beams().blocks_without_sharing, 0),
          "must copy it", "forks-never-copy"),
    wrong("9.1", E.check_beam_blocks, lambda: (_beams().blocks_held + 1, _beams().blocks_without_sharing,
                                               _beams().copies), "distinct physical blocks", "off-by-one-held"),
    wrong("9.1", E.check_beam_blocks, lambda: (2.5, _beams().blocks_without_sharing, _beams().copies),
          "integer", "half-a-block"),
    wrong("9.1", E.check_beam_blocks, lambda: (None, None, None), "no answer yet", "unanswered"),
    # 9.2
    right("9.2", E.check_sampling_saving, lambda: _both(), "fractions"),
    right("9.2", E.check_sampling_saving, lambda: (f"{100 * _saving(2):.2f}%", round(100 * _saving(6), 2)),
          "percents"),
    right("9.2", E.check_sampling_saving, lambda: (np.float32(_saving(2)), torch.tensor(_saving(6))),
          "numpy-and-torch"),
    wrong("9.2", E.check_sampling_saving,
          lambda: _both(f2=(2 - 1) * E.EX2_PROMPT / (2 * (E.EX2_PROMPT + E.EX2_OUTPUT))),
          "counts tokens", "tokens-not-blocks"),
    wrong("9.2", E.check_sampling_saving, lambda: _both(f6=E._partial_block_shared(6)), "partly filled",
          "partial-prompt-block-shared"),
    wrong("9.2", E.check_sampling_saving,
          lambda: _both(f2=(lambda _saving, physical, logical: (logical - physical) / physical)
                        (*E.sampling_saving_expected(2))),
          "not by those they hold", "divided-by-physical"),
    wrong("9.2", E.check_sampling_saving, lambda: _both(f6=5 / 6), "Only the prompt is shared",
          "everything-shared-but-one"),
    wrong("9.2", E.check_sampling_saving, lambda: _both(f2=_saving(2) / 100), "divided by 100 once too often",
          "percent-divided-twice"),
    wrong("9.2", E.check_sampling_saving, lambda: _both(f2=16, f6=26), "3 significant figures", "whole-percents"),
    right("9.2", E.check_sampling_saving, lambda: (f"{100 * _saving(2):.3g}%", f"{_saving(6):.3g}"), "3-figures"),
    wrong("9.2", E.check_sampling_saving, lambda: _both(f2=_saving(6), f6=_saving(2)), "look swapped",
          "widths-swapped"),
    wrong("9.2", E.check_sampling_saving, lambda: _both(f6=-0.2), "negative", "negative"),
    # 9.3
    right("9.3", E.check_swap_crossover, lambda: (E.crossover_expected(),), "int"),
    right("9.3", E.check_swap_crossover, lambda: (f"{E.crossover_expected()}",), "string"),
    right("9.3", E.check_swap_crossover, lambda: (float(E.crossover_expected()),), "float"),
    wrong("9.3", E.check_swap_crossover, lambda: (_mistake(lambda b: E.swap_time(b, both_ways=False)),),
          "both copies", "swap-out-only"),
    wrong("9.3", E.check_swap_crossover, lambda: (_mistake(lambda b: E.swap_time(b, _link(latency_s=0.0))),),
          "fixed cost", "bandwidth-only"),
    wrong("9.3", E.check_swap_crossover, lambda: (_mistake(lambda b: E.swap_time(b, _link(transfers_per_block=1))),),
          "not one transfer", "one-transfer-per-block"),
    wrong("9.3", E.check_swap_crossover, lambda: (E.EX3_BLOCK_SIZES[-1],), "For each block size",
          "cheapest-not-first-cheaper"),
    wrong("9.3", E.check_swap_crossover, lambda: (24,), "not one of the block sizes", "not-a-listed-size"),
    wrong("9.3", E.check_swap_crossover, lambda: ("16 KiB",), "block_size", "a-unit"),
]


def _link(**changes):
    from dataclasses import replace
    return replace(E.swap_cost_model().swap_link, **changes)


def _mistake(cost) -> int:
    """The block size a student modelling the swap cost as ``cost`` would find; the table's
    case is meaningful only if it differs from the answer."""
    found = E._first_cheaper(cost)
    assert found is not None and found != E.crossover_expected(), "this mistake no longer gives a wrong answer"
    return found


def forms(exercise: str) -> tuple[str, ...]:
    return tuple(E.answer_forms().get(exercise, ()))


@pytest.mark.parametrize("case", CH9)
def test_grader_table(case, capsys):
    args = case.args()
    if case.match is None:
        case.grader(*args)
        out = capsys.readouterr().out.strip()
        assert out.startswith("✓ ") and "\n" not in out, out
        return
    with pytest.raises(AssertionError, match=case.match) as info:
        case.grader(*args)
    message = str(info.value)
    given = " ".join(map(str, args))            # echoing the student's own answer back is fine
    for form in forms(case.exercise):
        if find_form(given, form) is None:
            assert find_form(message, form) is None, f"the hint gives the answer away ({form!r}): {message}"


def test_table_covers_every_grader_with_enough_cases():
    graders = {c.values[0].grader for c in CH9}
    for name in dir(E):
        if name.startswith("check_") and getattr(E, name).__module__ == E.__name__:
            assert getattr(E, name) in graders, f"{name} is not in the table"
    for grader in graders:
        cases = [c.values[0] for c in CH9 if c.values[0].grader is grader]
        assert sum(c.match is None for c in cases) >= 2, f"{grader.__name__}: fewer than 2 right forms"
        assert sum(c.match is not None for c in cases) >= 4, f"{grader.__name__}: fewer than 4 wrong answers"


VALUE_GRADERS = [
    ("9.1", E.check_beam_blocks, lambda: [_beams().blocks_held, _beams().blocks_without_sharing, _beams().copies]),
    ("9.2", E.check_sampling_saving, lambda: list(_both())),
    ("9.3", E.check_swap_crossover, lambda: [E.crossover_expected()]),
]


@pytest.mark.parametrize("exercise, grader, good", VALUE_GRADERS, ids=[v[0] for v in VALUE_GRADERS])
def test_value_graders_answer_junk_with_a_hint(exercise, grader, good):
    junk_check(exercise, grader, good)      # chapters 4-8's junk, in every argument


# ---- the expected values are the memory layer's, not a table's ----------------------------------------
def test_beam_pattern_counts_follow_the_block_tables():
    """9.1's counts are what the block tables hold: recount them from the tree's tables."""
    tree = BeamTree(E.EX1_PROMPT, E.EX1_BLOCK_SIZE, num_blocks=64, num_host_blocks=1)
    for parents in E.EX1_STEPS:
        tree.step(parents)
    tables = [b.table.block_ids for b in tree.live]
    c = _beams()
    assert c.blocks_held == len({x for t in tables for x in t}) < c.blocks_without_sharing == sum(map(len, tables))
    assert c.copies > 0 and c.copies < c.forks           # some forks copy, not all: the lesson
    assert c.held_if_dead_kept > c.blocks_held           # freeing the dead saves blocks here


def test_sampling_saving_grows_with_n_and_stays_below_the_prompt_share():
    savings = [_saving(n) for n in (1, 2, 4, 6, 8)]
    assert savings[0] == 0 and savings == sorted(savings)
    assert savings[-1] < E.EX2_PROMPT / (E.EX2_PROMPT + E.EX2_OUTPUT)


def test_swap_crossover_is_where_the_costs_cross():
    """9.3's answer: swapping is dearer than recomputing just below it, cheaper at it and above."""
    b = E.crossover_expected()
    sizes = E.EX3_BLOCK_SIZES
    assert all(E.swap_time(s) >= E.recompute_time() for s in sizes if s < b)
    assert all(E.swap_time(s) < E.recompute_time() for s in sizes if s >= b)
    assert sizes[0] < b, "swapping wins at every block size: the exercise shows no crossover"


# ---- the chapter's measurements: simulate(n=, beam_width=), sharing_saving, bench sharing ------------
def test_sharing_saving_of_one_parallel_sampling_request_is_block_arithmetic():
    """One request, n = 3, a 20-token prompt (5 blocks of 4), 6 new tokens. After the prefill the
    3 samples' tables name the 5 prompt blocks each (all shared); from then on each sample also
    holds one block of its own, where its new tokens' K/V go (24 tokens: 6 blocks per table);
    after the last iteration everything is freed."""
    from labkit.sim import TraceRequest, simulate
    from labkit.sim.run import sharing_saving
    res = simulate([TraceRequest(20, 6)], block_size=4, num_blocks=64, n=3)
    pairs = [(r.num_logical_blocks, r.num_used_blocks) for r in res.records]
    assert pairs == [(3 * 5, 5)] + [(3 * 6, 5 + 3)] * 4 + [(0, 0)]
    saved, share = sharing_saving(res.records)
    assert saved == pytest.approx((10 + 4 * 10) / 6) and share == pytest.approx(50 / (15 + 4 * 18))
    assert res.metrics["blocks_saved_by_sharing_pct"] == pytest.approx(100 * share)
    assert sharing_saving([]) == (0.0, 0.0)


def test_beam_search_saves_more_than_parallel_sampling_in_the_simulator():
    from labkit.sim import simulate, synthetic_trace
    trace = synthetic_trace("alpaca", 8, seed=3)
    one = simulate(trace, num_blocks=1024).metrics["blocks_saved_by_sharing_pct"]
    par = simulate(trace, num_blocks=1024, n=4).metrics
    beam = simulate(trace, num_blocks=1024, beam_width=4).metrics
    assert one == 0 and 0 < par["blocks_saved_by_sharing_pct"] < beam["blocks_saved_by_sharing_pct"]
    assert par["leaked_blocks"] == beam["leaked_blocks"] == 0 and beam["finished"] == len(trace)


@pytest.mark.parametrize("kwargs, match", [({"n": 0}, "n must be"), ({"n": 2, "beam_width": 2}, "not both"),
                                           ({"beam_width": 0}, "beam_width"), ({"n": True}, "n must be")])
def test_simulate_names_bad_widths(kwargs, match):
    from labkit.sim import TraceRequest, simulate
    with pytest.raises(ValueError, match=match):
        simulate([TraceRequest(4, 2)], **kwargs)


def test_bench_sharing_prints_the_table_beside_the_paper(capsys):
    import json
    from labkit.bench.sharing import PAPER, main
    assert main(["--datasets", "alpaca", "--widths", "2", "--num-requests", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {(r["method"], r["width"]) for r in out["simulated"]} == {("parallel", 2), ("beam", 2)}
    assert all(r["paper_range_pct"] == list(PAPER["alpaca", r["method"]]) for r in out["simulated"])
    assert out["real"] == []
    assert main(["--datasets", "alpaca", "--widths", "2", "--num-requests", "4"]) == 0
    assert "paper (Fig. 15" in capsys.readouterr().out
    for bad in (["--widths", "0"], ["--widths", "two"], ["--datasets", "imdb"], ["--methods", "greedy"]):
        assert main(bad) == 2
    assert "sharing:" in capsys.readouterr().err


def test_bench_sim_takes_n_and_beam_width(capsys):
    import json
    from labkit.bench.sim import main
    args = ["--dataset", "alpaca", "--num-requests", "4", "--policy", "continuous", "--json"]
    assert main(args + ["--beam-width", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["blocks_saved_by_sharing_pct"] > 0
    assert main(args + ["--n", "0"]) == 2 and "n must be" in capsys.readouterr().err
