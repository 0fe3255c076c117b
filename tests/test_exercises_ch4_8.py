"""The graders of chapters 4-8, table-driven: what a class of students would hand in.

For every grader: at least two equivalent right answers pass; at least four plausible wrong
answers fail, each case named after the student mistake it models and checked for the hint
that names it; the stub (a function that still raises ``NotImplementedError``), None and a
wrong type fail with a hint too; and junk of every kind (NaN, zeros, negatives, huge numbers,
lists, strings, functions that return garbage or raise) gets an ``AssertionError`` with a
message, never a traceback from inside the grader. No failure message contains the
exercise's answer in any form its grader accepts (``answer_forms``, scanned as in
``tests/test_answer_leaks.py``).

Expected values come from the graders' modules (the real simulator, cost model and
allocator), computed once per module run; the wrong answers are derived from them, so the
table follows a recalibrated cost model.
"""

from __future__ import annotations

import functools
import math
import statistics
import types
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch

from labkit.exercises import batching as B
from labkit.exercises import disagg as D
from labkit.exercises import kernels as K
from labkit.exercises import serving as S
from labkit.exercises._grading import fmt, sig
from labkit.sim import TraceRequest, simulate
from test_answer_leaks import find_form

MODULE_OF = {"4": B, "5": K, "7": D, "8": S}


@dataclass(frozen=True)
class Case:
    """One answer handed to one grader: ``match`` None means it must pass, else the failure
    message must match it (a regular expression)."""

    exercise: str
    grader: Callable
    args: Callable[[], tuple]       # built lazily: expected values are computed on first use
    match: str | None = None


def right(exercise, grader, args, name):
    return pytest.param(Case(exercise, grader, args), id=f"{exercise}-right-{name}")


def wrong(exercise, grader, args, match, name):
    return pytest.param(Case(exercise, grader, args, match), id=f"{exercise}-{name}")


@functools.lru_cache(maxsize=None)
def forms(exercise: str) -> tuple[str, ...]:
    """The answer's forms: the module's ``answer_forms``, plus, for chapter 8 (whose answers
    come from a live run), this table's own median."""
    declared = tuple(MODULE_OF[exercise.split(".")[0]].answer_forms().get(exercise, ()))
    own = (f"{MEDIAN:g}", f"{MEDIAN * 1e3:g}", f"{MEDIAN:.3f}") if exercise == "8.1" else ()
    return declared + own


def run_case(case: Case, capsys) -> None:
    args = case.args()
    if case.match is None:
        case.grader(*args)
        out = capsys.readouterr().out.strip()
        assert out.startswith("✓ ") and "\n" not in out, out
        return
    with pytest.raises(AssertionError, match=case.match) as info:
        case.grader(*args)
    message = str(info.value)
    assert message.strip(), "an empty failure message teaches nothing"
    given = " ".join([*map(str, args), *(form for a in args if isinstance(a, (int, float))
                                         for form in (f"{a:g}", fmt(a), sig(a)))])
    # ^ echoing the student's own answer back is fine
    for form in forms(case.exercise):
        if find_form(given, form) is None:
            assert find_form(message, form) is None, f"the hint gives the answer away ({form!r}): {message}"


# ---- chapter 4 ------------------------------------------------------------------------------------
def _pool_curve() -> tuple[int, int, int]:
    """(the answer, the first preemption-free pool, the largest pool that preempts)."""
    pools = B.ex42_pools()
    last = max(n for n in pools if B.ex42_preemptions(n))
    first_zero = next(n for n in pools if not B.ex42_preemptions(n))
    return last + 1, first_zero, last


def _ratios():
    return B.ex43_ratios()


CH4 = [
    right("4.1", B.check_static_batch, lambda: (40, 0.55), "fraction"),
    right("4.1", B.check_static_batch, lambda: ("40", "55.0%"), "strings-with-percent"),
    right("4.1", B.check_static_batch, lambda: (40.0, 55), "bare-percent"),
    right("4.1", B.check_static_batch, lambda: (40, 88 / 160), "unrounded"),
    right("4.1", B.check_static_batch, lambda: (np.int64(40), np.float32(0.55)), "numpy-scalars"),
    # one off: the method hint (naming the slip would say "one off"), which teaches the prefill step
    wrong("4.1", B.check_static_batch, lambda: (41, 0.55), "also samples", "counts-a-separate-prefill-iteration"),
    wrong("4.1", B.check_static_batch, lambda: (39, 0.55), "also samples", "forgets-the-first-iteration's-token"),
    wrong("4.1", B.check_static_batch, lambda: (30, 0.55), "When does a static batch end", "a-guess"),
    wrong("4.1", B.check_static_batch, lambda: (88, 0.55), "side by side", "runs-requests-one-after-another"),
    wrong("4.1", B.check_static_batch, lambda: (8, 0.55), "does not end when its first",
          "batch-ends-with-first-request"),
    wrong("4.1", B.check_static_batch, lambda: (40, 0.45), "idle share", "gives-the-idle-share"),
    wrong("4.1", B.check_static_batch, lambda: (40, 0.25), "4 per iteration", "one-slot-per-token"),
    wrong("4.1", B.check_static_batch, lambda: (40, 0.2), "until its own last token", "counts-only-while-all-run"),
    wrong("4.1", B.check_static_batch, lambda: (40, 0.0055), "divided by 100 once too often",
          "percent-divided-by-100-twice"),
    wrong("4.1", B.check_static_batch, lambda: (40, 88 / 164), "without a separate prefill",
          "busy-with-a-prefill-iteration"),
    right("4.2", B.check_preemption_free_pool, lambda: (_pool_curve()[0],), "int"),
    right("4.2", B.check_preemption_free_pool, lambda: (str(_pool_curve()[0]),), "string"),
    right("4.2", B.check_preemption_free_pool, lambda: (float(_pool_curve()[0]),), "float"),
    wrong("4.2", B.check_preemption_free_pool, lambda: (_pool_curve()[1],), "does not fall steadily",
          "first-preemption-free-pool-from-below"),
    wrong("4.2", B.check_preemption_free_pool, lambda: (_pool_curve()[2],), "Count the preemptions on every pool",
          "a-pool-that-preempts"),
    wrong("4.2", B.check_preemption_free_pool, lambda: (_pool_curve()[0] + 1,), "Count the preemptions on every pool",
          "one-above"),
    wrong("4.2", B.check_preemption_free_pool, lambda: (B.ex42_pools().stop - 1,), "by construction",
          "the-top-of-the-range"),
    wrong("4.2", B.check_preemption_free_pool, lambda: (B.ex42_pools().start - 1,), "not one of the pool sizes",
          "smaller-than-the-longest-request"),
    wrong("4.2", B.check_preemption_free_pool, lambda: (B.ex42_pools().stop + 50,), "not one of the pool sizes",
          "beyond-the-range"),
    right("4.3", B.check_speedups, lambda: (_ratios()["cpu"], _ratios()["gpu"]), "floats"),
    right("4.3", B.check_speedups, lambda: (f"{_ratios()['cpu']:.3g}", f"{_ratios()['gpu']:.3g}"), "3-figure-strings"),
    right("4.3", B.check_speedups, lambda: (f"{_ratios()['cpu']:.4f}×", f"{_ratios()['gpu']:.4f}x"),
          "written-as-speedups"),
    wrong("4.3", B.check_speedups, lambda: (1 / _ratios()["cpu"], 1 / _ratios()["gpu"]), "static over continuous",
          "divides-static-by-continuous"),
    wrong("4.3", B.check_speedups, lambda: (_ratios()["gpu"], _ratios()["cpu"]), "other cost model",
          "swaps-the-cost-models"),
    wrong("4.3", B.check_speedups, lambda: (_ratios()["cpu"], _ratios()["cpu"]), "other cost model",
          "default-cost-model-twice"),
    wrong("4.3", B.check_speedups, lambda: (_ratios()["cpu"] - 1, _ratios()["gpu"] - 1), "how much more",
          "gives-the-gain-not-the-ratio"),
    wrong("4.3", B.check_speedups, lambda: (100 * _ratios()["cpu"], _ratios()["gpu"]), "Simulate",
          "gives-a-percent"),
    wrong("4.3", B.check_speedups, lambda: (f"{_ratios()['cpu']:.1f}", _ratios()["gpu"]), "3 significant figures",
          "one-decimal"),
]


# ---- chapter 5 ------------------------------------------------------------------------------------
def slots_gather(bt, lens, bs):
    pos = lens.long() - 1
    return bt.long().gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs


def slots_loop(bt, lens, bs):
    out = []
    for s in range(len(lens)):
        pos = int(lens[s]) - 1
        out.append(int(bt[s, pos // bs]) * bs + pos % bs)
    return out                                  # a list: the grader takes any 1-D sequence


def slots_at(pos_fn, block_fn=None, offset_fn=None):
    """A student's slot mapping with one step done their way."""
    def student(bt, lens, bs):
        pos = pos_fn(lens.long())
        blocks = block_fn(bt.long(), pos, bs) if block_fn else bt.long().gather(1, (pos // bs)[:, None])[:, 0]
        return blocks * bs + (offset_fn(pos, bs) if offset_fn else pos % bs)
    return student


def step_right(m, denom, acc, s, v):
    m_new = torch.maximum(m, s.max(dim=1).values)
    alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[:, None])
    return m_new, denom * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ v


def step_in_rows(m, denom, acc, s, v):
    """The same step written row by row, returning a list."""
    ms, denoms, accs = [], [], []
    for r in range(s.shape[0]):
        m_new = max(float(m[r]), float(s[r].max()))
        p = torch.exp(s[r] - m_new)
        scale = math.exp(float(m[r]) - m_new) if math.isfinite(float(m[r])) else 0.0
        ms.append(m_new)
        denoms.append(float(denom[r]) * scale + float(p.sum()))
        accs.append(acc[r] * scale + p @ v)
    return [torch.tensor(ms), torch.tensor(denoms), torch.stack(accs)]


def step_variant(rescale_l=True, rescale_acc=True, accumulate=True, subtract_max=True):
    def student(m, denom, acc, s, v):
        m_new = torch.maximum(m, s.max(dim=1).values)
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[:, None]) if subtract_max else torch.exp(s)
        if not subtract_max:
            alpha = torch.ones_like(alpha)
        if not accumulate:
            return m_new, p.sum(dim=1), p @ v
        return (m_new, (denom * alpha if rescale_l else denom) + p.sum(dim=1),
                (acc * alpha[:, None] if rescale_acc else acc) + p @ v)
    return student


def step_max_over_columns(m, denom, acc, s, v):
    m_new = s.max(dim=0).values                  # over the tile's rows instead of each row's scores
    return m_new, denom, acc


online_softmax_step = step_right      # the notebook's name for exercise 5.2's answer


def decode_variant(use_table=True, whole_blocks=False, gqa="group", partial_last=True, scale_scores=True):
    """A student's ``paged_decode_one`` (the notebook's scaffold), with one step done their way."""
    def student(q, k_cache, v_cache, block_table, context_len, scale):
        num_heads, d = q.shape
        _, bs, kv_heads, _ = k_cache.shape
        group = num_heads // kv_heads
        out = torch.empty_like(q)
        for h in range(num_heads):
            kv = h // group if gqa == "group" else h % kv_heads
            m, denom, acc = torch.full((1,), -math.inf), torch.zeros(1), torch.zeros(1, d)
            n_blocks = math.ceil(context_len / bs) if partial_last else context_len // bs
            for i in range(n_blocks):
                block = int(block_table[i]) if use_table else i
                n = bs if whole_blocks else min(bs, context_len - i * bs)
                k, v = k_cache[block, :n, kv], v_cache[block, :n, kv]
                scores = q[h:h + 1] @ k.T * (scale if scale_scores else 1.0)
                m, denom, acc = online_softmax_step(m, denom, acc, scores, v)
            out[h] = (acc / denom[:, None])[0]
        return out
    return student


def decode_calling(step) -> Callable:
    """A right ``decode_variant()`` that calls ``step`` as the notebook's global
    ``online_softmax_step`` (the student's own answer to 5.2)."""
    right_one = decode_variant()
    return types.FunctionType(right_one.__code__, {**globals(), "online_softmax_step": step},
                              right_one.__name__, right_one.__defaults__, right_one.__closure__)


def decode_vectorized(q, k_cache, v_cache, block_table, context_len, scale):
    """A right answer without tiles: gather every slot through the block table, then softmax."""
    bs, kv_heads = k_cache.shape[1], k_cache.shape[2]
    pos = torch.arange(context_len)
    slots = block_table.long()[pos // bs] * bs + pos % bs
    k = k_cache.reshape(-1, kv_heads, k_cache.shape[-1])[slots]
    v = v_cache.reshape(-1, kv_heads, v_cache.shape[-1])[slots]
    group = q.shape[0] // kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)   # [n, heads, d]
    w = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * scale, dim=1)
    return torch.einsum("hn,nhd->hd", w, v)


def stub(*args):
    raise NotImplementedError("look up the block of position context_lens[s] - 1")


def raises_value_error(*args):
    raise ValueError("student bug")


CH5 = [
    right("5.1", K.check_slot_mapping, lambda: (slots_gather,), "gather"),
    right("5.1", K.check_slot_mapping, lambda: (slots_loop,), "python-loop-returning-a-list"),
    wrong("5.1", K.check_slot_mapping, lambda: (lambda bt, lens, bs: lens - 1,), "positions in the sequence",
          "returns-positions-not-slots"),
    wrong("5.1", K.check_slot_mapping, lambda: (slots_at(lambda lens: lens),), "context_len - 1, not context_len",
          "uses-context-len-as-the-newest-position"),
    wrong("5.1", K.check_slot_mapping,
          lambda: (lambda bt, lens, bs: bt.long().gather(1, ((lens.long() - 1) // bs)[:, None])[:, 0],),
          "block ids", "returns-block-ids"),
    wrong("5.1", K.check_slot_mapping, lambda: (slots_at(lambda lens: lens - 1, lambda bt, pos, bs: bt[0, pos // bs]),),
          "not one of this sequence's blocks", "reads-the-first-rows-block-table"),
    wrong("5.1", K.check_slot_mapping, lambda: (slots_at(lambda lens: lens - 1, lambda bt, pos, bs: bt[:, 0]),),
          "not the one holding its newest token", "always-the-first-logical-block"),
    wrong("5.1", K.check_slot_mapping,
          lambda: (slots_at(lambda lens: lens - 1, offset_fn=lambda pos, bs: bs - 1 - pos % bs),),
          "wrong offset", "offset-counted-from-the-blocks-end"),
    wrong("5.1", K.check_slot_mapping,
          lambda: (slots_at(lambda lens: lens - 1, offset_fn=lambda pos, bs: (pos + 1) % bs),),
          "context_len - 1, not context_len", "offset-off-by-one"),
    wrong("5.1", K.check_slot_mapping, lambda: (lambda bt, lens, bs: slots_gather(bt, lens, bs)[:, None],),
          "expected shape", "returns-a-column"),
    right("5.2", K.check_online_softmax, lambda: (step_right,), "vectorized"),
    right("5.2", K.check_online_softmax, lambda: (step_in_rows,), "row-by-row-returning-a-list"),
    wrong("5.2", K.check_online_softmax, lambda: (step_variant(rescale_acc=False),), "acc is not rescaled",
          "forgets-to-rescale-acc"),
    wrong("5.2", K.check_online_softmax, lambda: (step_variant(rescale_l=False),), "l is not rescaled",
          "forgets-to-rescale-l"),
    wrong("5.2", K.check_online_softmax, lambda: (step_variant(rescale_l=False, rescale_acc=False),),
          "neither l nor acc", "rescales-nothing"),
    wrong("5.2", K.check_online_softmax, lambda: (step_variant(accumulate=False),), "forgets the earlier tiles",
          "replaces-instead-of-accumulating"),
    wrong("5.2", K.check_online_softmax, lambda: (step_variant(subtract_max=False),), "NaN or inf",
          "exp-without-subtracting-the-maximum"),
    wrong("5.2", K.check_online_softmax, lambda: (step_max_over_columns,), "expected shape",
          "maximum-over-the-wrong-dimension"),
    wrong("5.2", K.check_online_softmax, lambda: (lambda m, denom, acc, s, v: None,), "return the three updated values",
          "updates-in-place-returns-nothing"),
    right("5.3", K.check_paged_decode, lambda: (decode_variant(),), "tile-by-tile"),
    right("5.3", K.check_paged_decode, lambda: (decode_vectorized,), "gather-all-slots"),
    wrong("5.3", K.check_paged_decode, lambda: (decode_variant(use_table=False),), "block table",
          "ignores-the-block-table"),
    wrong("5.3", K.check_paged_decode, lambda: (decode_variant(whole_blocks=True),), "partly filled",
          "reads-the-whole-last-block"),
    wrong("5.3", K.check_paged_decode, lambda: (decode_variant(gqa="modulo"),), "GQA",
          "pairs-query-heads-with-the-wrong-kv-heads"),
    wrong("5.3", K.check_paged_decode, lambda: (decode_variant(partial_last=False),), "Check each step",
          "skips-the-partly-filled-last-block"),
    wrong("5.3", K.check_paged_decode, lambda: (decode_variant(scale_scores=False),), "differs from the reference",
          "forgets-the-scale"),
    wrong("5.3", K.check_paged_decode, lambda: (lambda q, *a: q[:, :-1],), "expected shape", "returns-a-wrong-shape"),
    right("5.3", K.check_paged_decode, lambda: (decode_calling(step_right),), "the-notebook-scaffold"),
    wrong("5.3", K.check_paged_decode, lambda: (decode_calling(stub),), "does not pass exercise 5.2 yet",
          "calls-an-unsolved-online-softmax-step"),
    wrong("5.3", K.check_paged_decode, lambda: (decode_calling(step_variant(rescale_acc=False)),),
          "does not pass exercise 5.2 yet", "calls-a-wrong-online-softmax-step"),
]
for _exercise, _grader in (("5.1", K.check_slot_mapping), ("5.2", K.check_online_softmax),
                           ("5.3", K.check_paged_decode)):
    CH5 += [
        wrong(_exercise, _grader, lambda: (stub,), "NotImplementedError", "stub-still-raises"),
        wrong(_exercise, _grader, lambda: (None,), "pass your function", "none"),
        wrong(_exercise, _grader, lambda: (42,), "pass your function", "a-number-not-a-function"),
        wrong(_exercise, _grader, lambda: (raises_value_error,), "raised ValueError", "function-raises"),
        wrong(_exercise, _grader, lambda: (lambda *a: "garbage",), "expected|return", "returns-garbage"),
    ]


# ---- chapter 7 ------------------------------------------------------------------------------------
def _cm():
    return D.cost_model()


def _first_chunk_only_budget() -> int:
    """The budget a student finds who times only the first chunk (the cheapest one)."""
    from labkit.sim.roofline import batch_shape
    return max(b for b in range(D.EX3_BATCH + 1, D.EX3_BATCH + D.EX3_PROMPT + 1)
               if _cm().iteration_time(batch_shape(decode=[D.EX3_CONTEXT] * D.EX3_BATCH,
                                                   prefill=[(b - D.EX3_BATCH, 0)])) <= D.EX3_ITL_SLO)


def _plan():
    return D.plan_expected()


CH7 = [
    right("7.1", D.check_ridge_point, lambda: (D.ridge_expected(),), "float"),
    right("7.1", D.check_ridge_point, lambda: (f"{D.ridge_expected():.3g}",), "3-figure-string"),
    right("7.1", D.check_ridge_point, lambda: (np.float64(D.ridge_expected()),), "numpy"),
    wrong("7.1", D.check_ridge_point,
          lambda: (_cm().hardware.peak_flops * _cm().model.dtype_bytes / (2 * _cm().hardware.peak_bandwidth),),
          "datasheet peaks", "uses-the-datasheet-peaks"),
    wrong("7.1", D.check_ridge_point, lambda: (D.ridge_expected() / _cm().model.dtype_bytes,), "bytes",
          "forgets-the-bytes-per-weight"),
    wrong("7.1", D.check_ridge_point, lambda: (D.ridge_expected() * 2,), "multiply and an add",
          "one-flop-per-weight"),
    wrong("7.1", D.check_ridge_point, lambda: (_cm().bandwidth / _cm().flops,), "bytes per FLOP", "inverts-the-ratio"),
    wrong("7.1", D.check_ridge_point, lambda: (32,), "3 significant figures", "answers-the-decode-batch"),
    wrong("7.1", D.check_ridge_point, lambda: (f"{D.ridge_expected():.2g}",), "3 significant figures", "two-figures"),
    right("7.2", D.check_prefill_doubling, lambda: (D.doubling_expected(),), "int"),
    right("7.2", D.check_prefill_doubling, lambda: (f"{D.doubling_expected():,}",), "string-with-comma"),
    wrong("7.2", D.check_prefill_doubling, lambda: (D.doubling_expected() - 1,), "Time the iteration", "one-below"),
    wrong("7.2", D.check_prefill_doubling, lambda: (round(D.cost_model().ridge_tokens()) - 40,), "Time the iteration",
          "stops-at-the-ridge-point"),
    wrong("7.2", D.check_prefill_doubling, lambda: (D._doubling_mistakes()[0][0],), "alone",
          "times-the-prompt-alone"),
    wrong("7.2", D.check_prefill_doubling, lambda: (_mistake_of(D._doubling_mistakes(), "32 decodes, not one"),),
          "32 decodes, not one", "compares-with-one-decode"),
    wrong("7.2", D.check_prefill_doubling, lambda: (D.doubling_expected() * 2,), "Time the iteration", "far-above"),
    wrong("7.2", D.check_prefill_doubling, lambda: (0,), "Time the iteration", "zero"),
    right("7.3", D.check_chunk_budget, lambda: (D.chunk_budget_expected(),), "exact"),
    right("7.3", D.check_chunk_budget, lambda: (str(D.chunk_budget_expected()),), "string"),
    wrong("7.3", D.check_chunk_budget, lambda: (D.chunk_budget_expected() + 1,), "For one budget", "one-above"),
    wrong("7.3", D.check_chunk_budget, lambda: (D.chunk_budget_expected() - 8,), "For one budget",
          "a-scan-in-steps-of-8"),
    wrong("7.3", D.check_chunk_budget, lambda: (_first_chunk_only_budget(),), "not the slowest",
          "times-only-the-first-chunk"),
    wrong("7.3", D.check_chunk_budget, lambda: (D.chunk_budget_expected() // 2,), "For one budget", "half"),
    wrong("7.3", D.check_chunk_budget, lambda: (D.chunk_budget_expected() - D.EX3_BATCH,), "decodes .*included",
          "gives-the-chunk-not-the-budget"),
    wrong("7.3", D.check_chunk_budget, lambda: (D.EX3_BATCH,), "no room", "budget-of-only-the-decodes"),
    wrong("7.3", D.check_chunk_budget, lambda: (D.EX3_BATCH + D.EX3_PROMPT,), "whole prompt in one iteration",
          "the-whole-prompt-at-once"),
    right("7.4", D.check_instance_plan, lambda: (_plan().num_prefill, _plan().num_decode), "ints"),
    right("7.4", D.check_instance_plan, lambda: (str(_plan().num_prefill), float(_plan().num_decode)), "mixed-forms"),
    wrong("7.4", D.check_instance_plan,
          lambda: (math.ceil(D.PROBLEM.rate * _plan().prefill_time_s), _plan().num_decode), "M/D/1 queue",
          "forgets-the-queueing-delay"),
    wrong("7.4", D.check_instance_plan, lambda: (_plan().num_prefill + 1, _plan().num_decode), "Step 1",
          "one-prefill-instance-too-many"),
    wrong("7.4", D.check_instance_plan, lambda: (_plan().num_prefill, _plan().num_decode - 1), "Step 2",
          "one-requests-tokens-per-second"),
    wrong("7.4", D.check_instance_plan, lambda: (_plan().num_prefill, _plan().num_decode + 2), "Step 2|Several",
          "too-many-decode-instances"),
    wrong("7.4", D.check_instance_plan,
          lambda: (_plan().num_prefill, _mistake_of(D._plan_mistakes()[1], "by sequences")),
          "divides tokens per second by sequences", "tokens-per-second-over-sequences"),
    wrong("7.4", D.check_instance_plan, lambda: (0, 0), "at least one instance", "zeros"),
    wrong("7.4", D.check_instance_plan, lambda: (_plan().num_prefill, 0), "at least one instance", "no-decode-pool"),
]


def _mistake_of(mistakes, words: str) -> int:
    """The answer of the declared mistake whose hint says ``words`` (it must differ from the answer)."""
    return next(int(value) for value, hint in mistakes if words in hint)


# ---- chapter 8 ------------------------------------------------------------------------------------
TTFTS = [0.10, 0.12, 0.15, 0.30, 0.45, 0.60, 0.80, 1.00]
TIMINGS = [{"id": f"user-{i}", "sent": 0.5 * i, "first_token": 0.5 * i + t, "done": 0.5 * i + t + 1.5 + 0.1 * i}
           for i, t in enumerate(TTFTS)]
MEDIAN = statistics.median(TTFTS)


def _timing_objects():
    """The same timings as objects with attributes (a dataclass a student's client might keep)."""
    return [types.SimpleNamespace(**t) for t in TIMINGS]


@functools.lru_cache(maxsize=None)
def _served():
    """A warm-up request, then four more that join a running batch (step records as the
    server keeps them: the experiment's records start at a step > 0)."""
    trace = [TraceRequest(8, 6, arrival_s=0.0), TraceRequest(20, 12, arrival_s=1.0),
             TraceRequest(12, 10, arrival_s=1.0), TraceRequest(30, 8, arrival_s=1.05),
             TraceRequest(16, 6, arrival_s=1.2)]
    records = simulate(trace, num_blocks=64, block_size=4, max_num_seqs=4).records
    mark = next(k for k, r in enumerate(records) if any(rid == "r1" for rid, *_ in r.ran))
    return records[mark:], ["r1", "r2", "r3", "r4"]


def _joins(request_id="r4", **changes):
    records, ids = _served()
    joined = S.first_iterations(records, ids)
    shared = S.decoding_at(records, joined[request_id])
    joined = {**joined, **changes}
    return joined, shared, records, ids, request_id


def _positions():
    """Where each request first ran, as an index into the list of records."""
    records, ids = _served()
    return {rid: next(k for k, rec in enumerate(records) if any(x == rid for x, *_ in rec.ran)) for rid in ids}


def _last_iterations():
    records, ids = _served()
    last = {}
    for rec in records:
        for rid, *_ in rec.ran:
            last[rid] = rec.step
    return {rid: last[rid] for rid in ids}


CH8 = [
    right("8.1", S.check_ttft_p50, lambda: (MEDIAN, TIMINGS), "seconds"),
    right("8.1", S.check_ttft_p50, lambda: (f"{MEDIAN * 1e3:.1f} ms", TIMINGS), "milliseconds-with-unit"),
    right("8.1", S.check_ttft_p50, lambda: (f"{MEDIAN} s", TIMINGS), "seconds-with-unit"),
    right("8.1", S.check_ttft_p50, lambda: (round(MEDIAN, 3), TIMINGS), "rounded-to-3-figures"),
    right("8.1", S.check_ttft_p50, lambda: (f"{MEDIAN * 1e3:.3g} ms", TIMINGS), "ms-to-3-figures"),
    right("8.1", S.check_ttft_p50, lambda: (MEDIAN, _timing_objects()), "timing-objects"),
    wrong("8.1", S.check_ttft_p50, lambda: (0.38, TIMINGS), "3 significant figures", "two-figures"),
    wrong("8.1", S.check_ttft_p50, lambda: (sorted(TTFTS)[3], TIMINGS), "lower of the two middle values",
          "lower-middle-value"),
    wrong("8.1", S.check_ttft_p50, lambda: (sorted(TTFTS)[4], TIMINGS), "upper of the two middle values",
          "upper-middle-value"),
    wrong("8.1", S.check_ttft_p50, lambda: (statistics.mean(TTFTS), TIMINGS), "mean", "mean-not-median"),
    wrong("8.1", S.check_ttft_p50, lambda: (statistics.median(t["done"] - t["sent"] for t in TIMINGS), TIMINGS),
          "latency", "median-latency-to-the-last-token"),
    wrong("8.1", S.check_ttft_p50,
          lambda: (statistics.median(t["done"] - t["first_token"] for t in TIMINGS), TIMINGS), "streaming",
          "median-streaming-time"),
    wrong("8.1", S.check_ttft_p50, lambda: (statistics.median(t["first_token"] for t in TIMINGS), TIMINGS),
          "subtract each request's own send time", "forgets-the-send-time"),
    wrong("8.1", S.check_ttft_p50, lambda: (MEDIAN * 1e3, TIMINGS), "unit mix-up.*read in seconds",
          "bare-milliseconds"),
    wrong("8.1", S.check_ttft_p50, lambda: (f"{MEDIAN} ms", TIMINGS), "unit mix-up.*You wrote ms",
          "seconds-labelled-ms"),
    wrong("8.1", S.check_ttft_p50, lambda: (-MEDIAN, TIMINGS), "negative.*wrong way round",
          "subtracts-the-wrong-way-round"),
    wrong("8.1", S.check_ttft_p50, lambda: (MEDIAN, []), "no timings", "no-requests-sent-yet"),
    wrong("8.1", S.check_ttft_p50, lambda: ("fast", TIMINGS), "ttft_p50", "words"),
    right("8.2", S.check_joins, lambda: _joins(), "dict-and-set"),
    right("8.2", S.check_joins, lambda: (lambda j, s, *rest: ({k: str(v) for k, v in j.items()}, sorted(s), *rest))(
        *_joins()), "string-steps-and-a-list"),
    wrong("8.2", S.check_joins, lambda: (_positions(), *_joins()[1:]), "positions in the list",
          "list-positions-not-steps"),
    wrong("8.2", S.check_joins, lambda: (_last_iterations(), *_joins()[1:]), "last time", "last-iteration-not-first"),
    wrong("8.2", S.check_joins, lambda: ({k: v for k, v in _joins()[0].items() if k != "r3"}, *_joins()[1:]),
          "missing", "a-request-missing"),
    wrong("8.2", S.check_joins, lambda: ({**_joins()[0], "r0": 1}, *_joins()[1:]), "not one of the requests",
          "includes-the-warm-up-request"),
    wrong("8.2", S.check_joins, lambda: (_joins()[0], _joins()[1] | {"r4"}, *_joins()[2:]), "not the right requests",
          "counts-the-joining-request"),
    wrong("8.2", S.check_joins, lambda: ({k: v + 1 for k, v in _joins()[0].items()}, *_joins()[1:]),
          "first decode", "first-decode-not-first-prefill"),
    right("8.2", S.check_joins, lambda: (_joins()[0], tuple(_joins()[1]), *_joins()[2:]), "a-tuple"),
    right("8.2", S.check_joins, lambda: (_joins()[0], np.array(sorted(_joins()[1])), *_joins()[2:]), "an-array"),
    right("8.2", S.check_joins, lambda: (*_joins()[:2], S.record_facts(_joins()[2]), *_joins()[3:]),
          "records-as-plain-data"),
    wrong("8.2", S.check_joins, lambda: (_joins("r2")[0], {"r1"}, *_joins("r2")[2:]), "phase was 'decode'",
          "counts-requests-that-were-prefilling"),
    wrong("8.2", S.check_joins, lambda: (_joins()[0], set(), *_joins()[2:]), "not the right requests", "nobody"),
    wrong("8.2", S.check_joins, lambda: (None, *_joins()[1:]), "expected a dict", "joined-none"),
    wrong("8.2", S.check_joins, lambda: (_joins()[0], "r1", *_joins()[2:]), "expected a set", "shared-with-a-string"),
    wrong("8.2", S.check_joins, lambda: (_joins()[0], [["r1"]], *_joins()[2:]), "expected request ids",
          "shared-with-nested-lists"),
    wrong("8.2", S.check_joins, lambda: (_joins()[0], None, *_joins()[2:]), "no answer yet", "shared-with-none"),
]


@pytest.mark.parametrize("case", CH4 + CH5 + CH7 + CH8)
def test_grader_table(case, capsys):
    run_case(case, capsys)


def test_table_covers_every_grader_with_enough_cases():
    params = CH4 + CH5 + CH7 + CH8
    graders = {c.values[0].grader for c in params}
    for module in (B, K, D, S):
        for name in dir(module):
            if name.startswith("check_") and getattr(module, name).__module__ == module.__name__:
                assert getattr(module, name) in graders, f"{module.__name__}.{name} is not in the table"
    for grader in graders:
        cases = [c.values[0] for c in params if c.values[0].grader is grader]
        assert sum(c.match is None for c in cases) >= 2, f"{grader.__name__}: fewer than 2 right forms"
        assert sum(c.match is not None for c in cases) >= 4, f"{grader.__name__}: fewer than 4 wrong answers"


# ---- junk: every value grader answers anything with a hint, never a traceback of its own ---------
JUNK = [None, ..., "", "abc", "12 parsecs", [1], {"a": 1}, (), float("nan"), float("inf"), -1, 0, 1e30, True,
        object(), torch.tensor([1.0, 2.0])]
VALUE_GRADERS = [
    ("4.1", B.check_static_batch, lambda: [40, 0.55]),
    ("4.2", B.check_preemption_free_pool, lambda: [_pool_curve()[0]]),
    ("4.3", B.check_speedups, lambda: [_ratios()["cpu"], _ratios()["gpu"]]),
    ("7.1", D.check_ridge_point, lambda: [D.ridge_expected()]),
    ("7.2", D.check_prefill_doubling, lambda: [D.doubling_expected()]),
    ("7.3", D.check_chunk_budget, lambda: [D.chunk_budget_expected()]),
    ("7.4", D.check_instance_plan, lambda: [_plan().num_prefill, _plan().num_decode]),
    ("8.1", S.check_ttft_p50, lambda: [MEDIAN, TIMINGS]),
    ("8.2", S.check_joins, lambda: list(_joins())),
]


@pytest.mark.parametrize("exercise, grader, good", VALUE_GRADERS, ids=[v[0] for v in VALUE_GRADERS])
def test_value_graders_answer_junk_with_a_hint(exercise, grader, good):
    base = good()
    positions = range(2) if exercise == "8.2" else range(len(base) - (exercise == "8.1"))
    for position in positions:
        for junk in JUNK:
            args = list(base)
            args[position] = junk
            try:
                grader(*args)
            except AssertionError as e:
                assert str(e).strip(), (exercise, position, junk)
                continue
            except Exception as e:      # noqa: BLE001 - the point of the test
                pytest.fail(f"{exercise}: answer {junk!r} in argument {position} crashed the grader: "
                            f"{type(e).__name__}: {e}")
            pytest.fail(f"{exercise}: junk {junk!r} in argument {position} passed")


GARBAGE_RESULTS = [None, "abc", 3.0, [[1, 2]], torch.zeros(0), torch.full((6,), float("nan")),
                   (torch.zeros(3),), {"m": 1}]


@pytest.mark.parametrize("grader", [K.check_slot_mapping, K.check_online_softmax, K.check_paged_decode],
                         ids=["5.1", "5.2", "5.3"])
def test_function_graders_answer_garbage_results_with_a_hint(grader):
    for result in GARBAGE_RESULTS:
        with pytest.raises(AssertionError):
            grader(lambda *a, result=result: result)


def test_no_pool_above_the_range_of_exercise_4_2_preempts():
    """``ex42_pools()`` ends where preemption has become impossible, as the exercise says."""
    top = B.ex42_pools().stop - 1
    assert all(B.ex42_preemptions(n) == 0 for n in (top, top + 1, top + 37))


def test_exercise_4_2_has_exactly_one_right_answer_and_a_trap():
    """The curve is not monotone (the lesson), so the first preemption-free pool from below is
    not the answer, and exactly one pool of the range passes."""
    answer, first_zero, _ = _pool_curve()
    assert first_zero < answer, "the trace no longer shows the non-monotone curve the lesson is about"
    passing = []
    for n in B.ex42_pools():
        try:
            B.check_preemption_free_pool(n)
        except AssertionError:
            continue
        passing.append(n)
    assert passing == [answer]


# ---- what the check cells pass besides the answers, overwritten by a student's cell ---------------
@pytest.mark.parametrize("timings, match", [
    ([t["first_token"] - t["sent"] for t in TIMINGS], "overwrite it"),   # timings = [ttft, ...]
    (None, "overwrite it"), ("timings", "overwrite it"), ([{"sent": 0.0}], "'first_token'"),
    ({"user-0": TIMINGS[0]}, "overwrite it")],
    ids=["reused-the-name-for-the-ttfts", "none", "string", "a-key-missing", "a-dict"])
def test_ttft_grader_names_overwritten_timings(timings, match):
    with pytest.raises(AssertionError, match=match):
        S.check_ttft_p50(MEDIAN, timings)


@pytest.mark.parametrize("position, junk, match", [
    (2, [0.1, 0.2], "StepRecords"), (2, None, "step records"), (2, "records", "step records"),
    (3, None, "ids:"), (3, [], "ids:"), (3, "user-0", "ids:"), (4, None, "late:"), (4, "nobody", "late:"),
    (4, ["r4"], "late:")], ids=["records-of-floats", "records-none", "records-string", "ids-none", "ids-empty",
                                "ids-string", "late-none", "late-unknown", "late-a-list"])
def test_joins_grader_names_overwritten_context(position, junk, match):
    args = list(_joins())
    args[position] = junk
    with pytest.raises(AssertionError, match=match):
        S.check_joins(*args)


def test_8_2_live_step_records_cross_to_the_grading_process_as_facts(capsys):
    """The gradebook judges 8.2 outside the kernel from ``plain_arguments``: a list of the
    engine's StepRecords (live objects) must cross as their facts, not as stand-ins, so that a
    right answer passes there too, and a wrong one still fails."""
    import json
    right_answers = _joins()
    plain = json.loads(json.dumps(S.check_joins.plain_arguments(*right_answers)))
    assert all(isinstance(rec, dict) and "ran" in rec for rec in plain["args"][2])
    S.check_joins(*plain["args"], **plain["kwargs"])
    assert capsys.readouterr().out.startswith("✓")
    wrong_answers = ({k: v + 1 for k, v in right_answers[0].items()}, *right_answers[1:])
    plain = json.loads(json.dumps(S.check_joins.plain_arguments(*wrong_answers)))
    with pytest.raises(AssertionError):
        S.check_joins(*plain["args"], **plain["kwargs"])
