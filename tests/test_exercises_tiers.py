"""The graders of chapter 13 (a quantized KV cache, a host tier), table-driven.

As in ``tests/test_exercises_ch4_8.py``: right answers in every accepted form pass with a
one-line verdict; plausible wrong answers fail, each named after the student mistake it models
and checked for the hint that names it; the stub, None, wrong types and junk get an
``AssertionError`` with a hint, never a traceback from inside the grader; no failure message
gives the answer away in any form its grader accepts (``answer_forms``). The expected values
come from the graders' module: the engine's own cache sizing (13.1), the roofline cost model
(13.2) and the real scheduler with and without a host tier (13.3).
"""

from __future__ import annotations

import numpy as np
import pytest

from labkit.exercises import tiers as T
from test_exercises_ch4_8 import MODULE_OF, Case, right, run_case, wrong

MODULE_OF.setdefault("13", T)     # run_case scans each hint for this module's answer_forms()

L, H, D, Q = T.EX1_LAYERS, T.EX1_KV_HEADS, T.EX1_HEAD_DIM, T.EX1_ATTENTION_HEADS
BF16, INT8 = 2 * L * H * D * 2, 2 * L * H * (D + 4)


def one(**changes):
    def make():
        r = {**T.ex1_expected(), **changes}
        return r["bf16_bytes"], r["int8_bytes"], r["tokens_ratio"]
    return make


def two(**changes):
    def make():
        r = {**T.ex2_expected(), **changes}
        return r["load_ms"], r["break_even_gbps"]
    return make


def three(**changes):
    def make():
        r = {**T.ex3_expected(), **changes}
        return r["computed_device_only"], r["computed_with_tier"], r["host_hits"]
    return make


LOAD = T.EX2_TOKENS * BF16 / (T.EX2_LINK_GBPS * 1e9) * 1e3
EVEN = T.EX2_TOKENS * BF16 / T.ex2_prefill_s() / 1e9


def stub():
    raise NotImplementedError("count what one token leaves in every layer")


CH13 = [
    # ---- 13.1 ----------------------------------------------------------------------------------
    right("13.1", T.check_quantized_bytes, one(), "ints-and-float"),
    right("13.1", T.check_quantized_bytes, lambda: (str(BF16), float(INT8), f"{BF16 / INT8:.3f}x"), "strings"),
    right("13.1", T.check_quantized_bytes, lambda: (np.int64(BF16), np.array(INT8), np.float32(BF16 / INT8)), "numpy"),
    wrong("13.1", T.check_quantized_bytes, one(bf16_bytes=BF16 // 2), "K and V", "forgets-k-and-v"),
    wrong("13.1", T.check_quantized_bytes, one(bf16_bytes=2 * L * Q * D * 2), "Only the KV heads", "query-heads"),
    wrong("13.1", T.check_quantized_bytes, one(bf16_bytes=BF16 * 8), "bytes, not bits", "bits"),
    wrong("13.1", T.check_quantized_bytes, one(bf16_bytes=2 * L * H * D * 4), "two bytes per number", "fp32"),
    wrong("13.1", T.check_quantized_bytes, one(int8_bytes=2 * L * H * D), "count the fp32 scales", "no-scales"),
    wrong("13.1", T.check_quantized_bytes, one(int8_bytes=2 * L * H * (D + 2)), "four bytes", "bf16-scales"),
    wrong("13.1", T.check_quantized_bytes, one(int8_bytes=2 * L * H * D * 5), "not one per number",
          "a-scale-per-number"),
    wrong("13.1", T.check_quantized_bytes, one(tokens_ratio=2.0), "count the fp32 scales", "ratio-without-scales"),
    wrong("13.1", T.check_quantized_bytes, one(tokens_ratio=INT8 / BF16), "divide the bf16 size", "upside-down"),
    wrong("13.1", T.check_quantized_bytes, one(tokens_ratio=4.0), "not fp32", "against-fp32"),
    wrong("13.1", T.check_quantized_bytes, one(int8_bytes=70000), "what else a quantized cache must store",
          "a-guess"),
    wrong("13.1", T.check_quantized_bytes, one(tokens_ratio=1.9), "significant figures", "two-figures"),
    wrong("13.1", T.check_quantized_bytes, one(bf16_bytes=None), "no answer yet", "none"),
    wrong("13.1", T.check_quantized_bytes, one(int8_bytes="lots"), "expected a number", "words"),
    wrong("13.1", T.check_quantized_bytes, one(bf16_bytes=stub), "expected", "the-stub-function"),
    wrong("13.1", T.check_quantized_bytes, one(tokens_ratio=float("nan")), "finite", "nan"),
    # ---- 13.2 ----------------------------------------------------------------------------------
    right("13.2", T.check_copy_or_recompute, two(), "floats"),
    right("13.2", T.check_copy_or_recompute, lambda: (round(LOAD, 3), f"{EVEN:.6g}"), "rounded-and-string"),
    right("13.2", T.check_copy_or_recompute, lambda: (np.float64(LOAD), np.array(EVEN)), "numpy"),
    wrong("13.2", T.check_copy_or_recompute, two(load_ms=LOAD * 2**30 / 1e9), "10\\^9 bytes", "gib"),
    wrong("13.2", T.check_copy_or_recompute, two(load_ms=LOAD * 8), "not bits", "bits"),
    wrong("13.2", T.check_copy_or_recompute, two(load_ms=LOAD / 2), "Which bytes cross the link", "k-only"),
    wrong("13.2", T.check_copy_or_recompute, two(load_ms=LOAD / L), "Which bytes cross the link", "one-layer"),
    wrong("13.2", T.check_copy_or_recompute, two(load_ms=LOAD / 1e3), "unit", "seconds-written-as-ms"),
    right("13.2", T.check_copy_or_recompute, lambda: (f"{LOAD:.3f} ms", EVEN), "ms-string"),
    right("13.2", T.check_copy_or_recompute, lambda: (f"{LOAD / 1e3:.6f} s", EVEN), "seconds-string"),
    wrong("13.2", T.check_copy_or_recompute, two(load_ms=f"{LOAD / 1e3:.3g} ms"), "unit", "seconds-labelled-ms"),
    wrong("13.2", T.check_copy_or_recompute, two(break_even_gbps=T.ex2_prefill_s() * 1e3 / LOAD),
          "is a bandwidth", "time-ratio"),
    wrong("13.2", T.check_copy_or_recompute, two(break_even_gbps=EVEN * 8), "not bits", "break-even-in-bits"),
    wrong("13.2", T.check_copy_or_recompute, two(break_even_gbps=EVEN * 1e9 / 2**30), "10\\^9 bytes", "break-even-gib"),
    wrong("13.2", T.check_copy_or_recompute, two(load_ms=7.77), "bytes over bandwidth", "a-guess"),
    wrong("13.2", T.check_copy_or_recompute, two(break_even_gbps=0.512), "which bandwidth", "a-guess-2"),
    wrong("13.2", T.check_copy_or_recompute, two(load_ms=5.4), "significant figures", "two-figures"),
    wrong("13.2", T.check_copy_or_recompute, two(load_ms=None), "no answer yet", "none"),
    wrong("13.2", T.check_copy_or_recompute, two(break_even_gbps="fast"), "expected a number", "words"),
    # ---- 13.3 ----------------------------------------------------------------------------------
    right("13.3", T.check_tier_rounds, three(), "ints"),
    right("13.3", T.check_tier_rounds, lambda: tuple(str(x) for x in three()()), "strings"),
    right("13.3", T.check_tier_rounds, lambda: tuple(np.int64(x) for x in three()()), "numpy"),
    wrong("13.3", T.check_tier_rounds, three(computed_device_only=T.EX3_DOCS), "Play the pool",
          "device-keeps-everything"),
    wrong("13.3", T.check_tier_rounds, three(computed_device_only=T.EX3_DOCS * (T.EX3_DOC_TOKENS + 1)),
          "Play the pool", "device-keeps-nothing"),
    wrong("13.3", T.check_tier_rounds, three(computed_with_tier=0), "last token is always computed",
          "questions-cached"),
    wrong("13.3", T.check_tier_rounds, three(computed_with_tier=T.EX3_DOCS * (T.EX3_DOC_TOKENS + 1)),
          "copied back, not computed", "tier-does-nothing"),
    wrong("13.3", T.check_tier_rounds, three(host_hits=T.EX3_DOCS * T.EX3_DOC_TOKENS // T.EX3_BLOCK_SIZE),
          "found there first", "all-from-the-host"),
    wrong("13.3", T.check_tier_rounds, three(host_hits=0), "blocks the device cache misses", "no-host-hits"),
    wrong("13.3", T.check_tier_rounds, three(computed_device_only=100), "Follow the pool's blocks", "a-guess"),
    wrong("13.3", T.check_tier_rounds, three(host_hits=None), "no answer yet", "none"),
    wrong("13.3", T.check_tier_rounds, three(computed_with_tier=1.5), "not an integer", "a-fraction"),
    wrong("13.3", T.check_tier_rounds, three(host_hits=-3), "cannot be negative", "negative"),
]


@pytest.mark.parametrize("case", CH13)
def test_grader_table(case: Case, capsys):
    run_case(case, capsys)


def test_table_covers_every_grader_with_enough_cases():
    graders = {c.values[0].grader for c in CH13}
    for name in dir(T):
        if name.startswith("check_") and getattr(T, name).__module__ == T.__name__:
            assert getattr(T, name) in graders, f"{name} is not in the table"
    for grader in graders:
        cases = [c.values[0] for c in CH13 if c.values[0].grader is grader]
        assert sum(c.match is None for c in cases) >= 2
        assert sum(c.match is not None for c in cases) >= 4


def test_the_byte_counts_are_the_engines_own():
    """13.1's answer is what sizes a real cache: a KVCache of that shape holds that many bytes a token."""
    import torch

    from labkit.model.kv_cache import KVCache
    for dtype, per_token in ((torch.bfloat16, BF16), (torch.int8, INT8)):
        cache = KVCache(L, 1, 16, H, D, dtype, "cpu")
        assert cache.nbytes == 16 * per_token
    assert T.ex1_expected() == {"bf16_bytes": BF16, "int8_bytes": INT8, "tokens_ratio": BF16 / INT8}


def test_the_rounds_follow_the_scheduler_and_the_tier_helps():
    alone, tiered = T.tier_rounds(0), T.tier_rounds(T.EX3_TIER)
    prompt_tokens = T.EX3_DOCS * (T.EX3_DOC_TOKENS + 1)
    assert alone["round1"] == tiered["round1"] == prompt_tokens      # nothing cached yet
    assert T.EX3_DOCS <= tiered["round2"] < alone["round2"] < prompt_tokens
    assert tiered["host_hits"] > 0 and alone["host_hits"] == 0
    assert T.tier_rounds(1)["round2"] >= tiered["round2"]           # a tier of one block helps less
