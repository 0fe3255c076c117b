"""The memory chapter's graders: right answers pass in every reasonable form, wrong ones
fail with a hint that teaches, and the expected values come from the real allocator."""

from __future__ import annotations

import pytest

from labkit.exercises import (check_exercise_1, check_exercise_2, check_exercise_3,
                              shared_prompt_counts)
from labkit.exercises import _grading as g
from labkit.memory import BlockAllocator, BlockTable


def verdict(capsys) -> str:
    out = capsys.readouterr().out.strip()
    assert out.count("\n") == 0 and out.startswith("✓ "), out
    return out


def fails(match: str, fn, *args):
    with pytest.raises(AssertionError, match=match) as info:
        fn(*args)
    return str(info.value)


# ---- exercise 1 ------------------------------------------------------------------------------
@pytest.mark.parametrize("used, util", [
    (200 / 4096, 200 / 4096), (0.0488, 0.049), (4.88, 4.9), ("4.9%", "4.88 %"), (0.05, 5),
])
def test_exercise_1_accepts_fractions_and_percents(capsys, used, util):
    check_exercise_1(used, util)
    line = verdict(capsys)
    assert "200/4096 = 4.9%" in line and "409,600" in line


@pytest.mark.parametrize("used, util, hint", [
    (4096 / 200, 0.0488, "divided 4096 by 200"),
    (0.951, 0.0488, "share wasted"),
    (200 / 3896, 0.0488, "empty slots"),
    (0.2, 0.0488, "used / reserved"),
    (0.0488, 0.000488, "grow 100"),
    (0.0488, 1.0, "private"),
    (0.0488, 0.3, "over the 100"),
])
def test_exercise_1_rejects_with_a_hint(used, util, hint):
    message = fails(hint, check_exercise_1, used, util)
    assert "0.0488" not in message.split("is not right")[-1]   # the hint never gives it away


def test_graders_reject_placeholders_and_nonsense():
    fails("placeholder", check_exercise_1, ..., 0.05)
    fails("expected a number", check_exercise_1, "about five", 0.05)
    fails("expected a number", check_exercise_1, True, 0.05)
    fails("negative", check_exercise_1, -0.05, 0.05)
    fails("more than everything", check_exercise_1, 250, 0.05)
    fails("finite", check_exercise_1, float("nan"), 0.05)


# ---- exercise 2 ------------------------------------------------------------------------------
def test_exercise_2_expected_values_come_from_a_real_block_table():
    allocator = BlockAllocator(num_blocks=8, block_size=16)
    table = BlockTable(allocator)
    for token in range(70):
        table.append_tokens([token])                # decode-style, one at a time
    assert (table.num_blocks, table.num_free_slots) == (5, 10)


@pytest.mark.parametrize("frag", [10 / 70, 0.1429, 14.29, "14.3%", 0.143])
def test_exercise_2_accepts(capsys, frag):
    check_exercise_2(5, 10, frag)
    assert "5 blocks, 10 empty slots, 10/70 = 14.3%" in verdict(capsys)


@pytest.mark.parametrize("args, hint", [
    ((4, 10, 0.143), "round up"),
    ((4.375, 10, 0.143), "allocated whole"),
    ((6, 10, 0.143), "how many blocks"),
    ((5, 6, 0.143), "how many tokens the last block holds"),
    ((5, 70, 0.143), "minus tokens stored"),
    ((5, 10, 0.125), "relative to the sequence length"),
    ((5, 10, 6 / 70), "tokens in the last block"),
    ((5, 10, 0.5), "wasted slots / sequence length"),
    ((5, 10.5, 0.143), "integer"),
])
def test_exercise_2_rejects_with_a_hint(args, hint):
    fails(hint, check_exercise_2, *args)


# ---- exercise 3 ------------------------------------------------------------------------------
def test_exercise_3_counts_come_from_500_real_tables():
    c = shared_prompt_counts()
    assert c.blocks_per_session == 63               # 62 full blocks + one holding 8 tokens
    assert c.blocks_shared == 63                    # 500 tables, one copy
    assert c.copies == 499                          # the last one to write keeps the original
    assert c.blocks_diverged == 62 + 500
    assert c.prompt_slots_diverged == 62 * 16 + 500 * 8


def test_exercise_3_counts_agree_with_the_prefix_cache_route():
    """500 tables that find the prompt in the prefix cache share the same 62 full blocks
    and each compute the partial 63rd themselves: the same 562 blocks as the forks."""
    allocator = BlockAllocator(num_blocks=600, block_size=16, enable_prefix_caching=True)
    prompt = list(range(1000))
    tables = []
    for session in range(500):
        table = BlockTable(allocator)
        reused = table.reuse_cached_prefix(prompt, max_tokens=len(prompt) - 1)
        assert reused == (0 if session == 0 else 992)
        table.append_tokens(prompt[reused:] + [1000 + session])
        tables.append(table)
    assert allocator.num_used_blocks == shared_prompt_counts().blocks_diverged
    allocator.check_invariants()


ASSUMPTIONS = [
    "The shared KV is read-only: no session writes into a shared block.",
    "A token's KV depends only on the prefix before it, which is identical for every session.",
    "the system prompt tokens are the same at the same positions, with the same model weights",
    "Blocks are immutable once filled; a writer copies first",
    "causal attention: later tokens never change earlier K and V",
    "Nobody modifies the shared blocks",
]


@pytest.mark.parametrize("without, with_, what", [
    (500_000, 1000, "ideal"),
    ("500000 MiB", "1000 MiB", "ideal"),
    ("488.3 GiB", "0.98 GiB", "ideal"),
    (488.28, 1, "ideal"),                         # bare numbers read as GiB when MiB does not fit
    ("500 GiB", "1 GiB", "ideal"),                # 1000 MiB rounded to 1 GiB is within rounding
    (504_000, 1008, "whole blocks"),
    (500_000, 4992, "copy-on-write copies"),
])
def test_exercise_3_accepts_ideal_and_block_exact_answers(capsys, without, with_, what):
    for assumption in ASSUMPTIONS:
        check_exercise_3(without, with_, assumption)
        line = verdict(capsys)
        assert "500,000 MiB" in line and "read-only" in line
        assert {"ideal": "Block-exact", "whole blocks": "You counted whole blocks",
                "copy-on-write copies": "You counted the copy-on-write copies"}[what] in line


@pytest.mark.parametrize("without, with_, hint", [
    (1000, 1000, "one session's copy"),
    (500_000, 500_000, "without sharing"),
    (500_000, 504_000, "without sharing"),
    (500_000, 2, "does not split"),
    (500_000, 8992, "copied last blocks whole"),
    (500_000, 4000, "full blocks are stored once"),
    (500_000, "3 TB", "how many copies"),
    (250_000, 1000, "sessions × tokens"),
])
def test_exercise_3_rejects_wrong_sizes_with_a_hint(without, with_, hint):
    fails(hint, check_exercise_3, without, with_, ASSUMPTIONS[0])


@pytest.mark.parametrize("assumption, hint", [
    ("", "as a sentence"),
    (None, "as a sentence"),
    (42, "as a sentence"),
    ("memory", "say a little more"),
    ("the GPU has enough memory", "does not name"),
    ("I don't know, the same prefix maybe", "does not hold"),
    ("sessions are independent requests", "does not name"),
])
def test_exercise_3_rejects_missing_or_wrong_assumptions(assumption, hint):
    fails(hint, check_exercise_3, 500_000, 1000, assumption)


def test_exercise_3_rejects_unknown_units():
    fails("unknown unit", check_exercise_3, "500000 parsecs", 1000, ASSUMPTIONS[0])


# ---- the reusable helpers --------------------------------------------------------------------
def test_grading_helpers():
    assert g.read_fraction("x", 0.25) == 0.25 and g.read_fraction("x", 25) == 0.25
    assert g.read_fraction("x", "0.5%") == 0.005 and g.read_fraction("x", 1) == 1.0
    assert g.read_count("x", 5.0) == 5
    assert g.read_number("x", "1,000") == 1000
    assert g.read_quantity("m", "2 GiB", g.MEMORY_UNITS_MIB, "MiB") == (2048, "GiB")
    assert g.read_quantity("m", "2 gb", g.MEMORY_UNITS_MIB, "MiB")[1] == "GB"
    assert g.read_quantity("m", 3, g.MEMORY_UNITS_MIB, "MiB") == (3, None)
    assert g.is_close(101, 100, rel=0.01) and not g.is_close(102, 100, rel=0.01)
    assert g.is_close(0.4, 0, abs_tol=0.5)
    assert g.closest(99, [100, 98.5], rel=0.02) == 100          # rounded: the preferred one
    assert g.closest(98.6, [100, 98.5], rel=0.02) == 98.5       # within a fifth: that one
    assert g.check_close("x", 1.001, [5, 1]) == 1
    with pytest.raises(AssertionError, match="x: 7 is not right. because"):
        g.check_close("x", 7, 1, mistakes=[(7, "because")], hint="generic")
    with pytest.raises(AssertionError, match="generic"):
        g.check_close("x", 8, 1, mistakes=[(7, "because")], hint="generic")
    assert g.check_text("t", "It is read only.", [r"read[- ]?only"]) == "read only"
    assert g.fmt(500000) == "500,000" and g.fmt(0.048828125) == "0.04883"
