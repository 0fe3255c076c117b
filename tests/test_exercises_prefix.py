"""The graders of chapter 10 (prefix caching: hash blocks vs a radix tree), table-driven.

As in ``tests/test_exercises_ch4_8.py``: right answers in every accepted form pass with a one-line
verdict; plausible wrong answers fail, each named after the student mistake it models and checked
for the hint that names it; the stub, None, wrong types and junk get an ``AssertionError`` with a
hint, never a traceback from inside the grader; no failure message gives the answer away in any
form its grader accepts (``answer_forms``). The expected values come from the graders' module,
which measures them on the real engine and allocator; the table derives its wrong answers from the
exercises' constants, so it follows the engine.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import torch

from labkit.exercises import prefix as P
from labkit.memory import BlockAllocator, BlockTable
from test_exercises_ch4_8 import MODULE_OF, Case, right, run_case, wrong

MODULE_OF.setdefault("10", P)     # run_case scans each hint for this module's answer_forms()

E1 = P.EX1_SYSTEM + P.EX1_MESSAGE + P.EX1_ANSWER            # turn 1's history, in tokens
BS = P.EX1_BLOCK_SIZE


@functools.lru_cache(maxsize=None)
def measured() -> tuple[int, int, int]:
    m = P._ex1_measured()
    return m["hash_tokens"], m["radix_tokens"], m["radix_page1_tokens"]


def with_(**changes):
    """The right answers of 10.1, with some replaced."""
    h, r, r1 = measured()
    answers = {"hash_tokens": h, "radix_tokens": r, "radix_page1_tokens": r1, **changes}
    return lambda: (answers["hash_tokens"], answers["radix_tokens"], answers["radix_page1_tokens"])


@functools.lru_cache(maxsize=None)
def order() -> list[int]:
    return list(P._ex2_measured()[0])


@functools.lru_cache(maxsize=None)
def scenario_facts() -> dict:
    """Read off the scenario's tree: the blocks chat C holds, a parent with its child, D's blocks."""
    s = P.eviction_scenario()
    tree = s.allocator.radix
    held = sorted(b for t in s.tables.values() for b in t.block_ids)
    chain = next(n.block_ids for n in tree.nodes() if len(n.block_ids) >= 2 and tree.ref_count(n) == 0
                 and n.block_ids[-1] in order())
    leaves = tree.evictable_leaves()
    return {"held": held, "parent_first": chain[0], "last_leaf": leaves[-1].block_ids}


def most_recent_first() -> list[int]:
    """Leaves' blocks, the most recently used leaf first, each from its end."""
    s = P.eviction_scenario()
    return [b for leaf in reversed(s.allocator.radix.evictable_leaves()) for b in reversed(leaf.block_ids)][:3]


@functools.lru_cache(maxsize=None)
def hash_order() -> list[int]:
    """What a plain LRU queue over blocks takes: the hash cache's evictions on the same scenario."""
    return list(P._ex2_measured()[1])


def ring_order():
    o = order()
    return [o[1], o[0], o[2]]


CH10 = [
    # ---- 10.1 --------------------------------------------------------------------------------
    right("10.1", P.check_follow_up_reuse, with_(), "ints"),
    right("10.1", P.check_follow_up_reuse, lambda: tuple(str(x) for x in measured()), "strings"),
    right("10.1", P.check_follow_up_reuse, lambda: tuple(float(x) for x in measured()), "floats"),
    wrong("10.1", P.check_follow_up_reuse, with_(radix_tokens=E1 - 1), "page-granular",
          "radix-matches-every-token-at-block-size-16"),
    wrong("10.1", P.check_follow_up_reuse, with_(hash_tokens=E1), "keys and matches whole blocks",
          "hash-counts-the-partial-block"),
    # one token off: the method hint (a mistake's own hint would confirm "one off")
    wrong("10.1", P.check_follow_up_reuse, with_(radix_page1_tokens=E1), "had their K and V computed before",
          "counts-the-last-answer-token"),
    wrong("10.1", P.check_follow_up_reuse, with_(radix_page1_tokens=(E1 - 1) // BS * BS),
          "not cut at 16-token block boundaries", "rounds-one-token-pages-to-blocks"),
    wrong("10.1", P.check_follow_up_reuse, with_(hash_tokens=P.EX1_SYSTEM // BS * BS), "Only the system prompt",
          "only-the-system-prompt-is-cached"),
    wrong("10.1", P.check_follow_up_reuse, with_(radix_page1_tokens=P.EX1_SYSTEM + P.EX1_MESSAGE),
          "What about turn 1's answer", "forgets-the-answer-is-cached"),
    wrong("10.1", P.check_follow_up_reuse, with_(hash_tokens=E1 + P.EX1_FOLLOW_UP - 1), "Not every token you counted",
          "counts-the-new-message"),
    wrong("10.1", P.check_follow_up_reuse, with_(hash_tokens=(E1 - 1) // BS), "Count tokens, not blocks",
          "gives-blocks-not-tokens"),
    wrong("10.1", P.check_follow_up_reuse, with_(radix_tokens=-(-E1 // BS) * BS), "partly filled block is never shared",
          "rounds-up-to-whole-blocks"),
    wrong("10.1", P.check_follow_up_reuse, with_(hash_tokens=0), "not thrown away", "thinks-finished-means-gone"),
    wrong("10.1", P.check_follow_up_reuse, with_(radix_tokens=37), "Which of turn 2's tokens", "a-guess"),
    wrong("10.1", P.check_follow_up_reuse, with_(hash_tokens=12.5), "integer", "a-fraction"),
    wrong("10.1", P.check_follow_up_reuse, with_(hash_tokens=None), "no answer yet", "none"),
    wrong("10.1", P.check_follow_up_reuse, with_(radix_tokens=float("nan")), "finite", "nan"),
    wrong("10.1", P.check_follow_up_reuse, with_(radix_tokens=[1, 2]), "expected a number", "a-list"),
    wrong("10.1", P.check_follow_up_reuse, with_(radix_tokens="lots"), "expected a number", "text"),
    wrong("10.1", P.check_follow_up_reuse, with_(hash_tokens=-16), "negative", "negative"),
    # ---- 10.2 --------------------------------------------------------------------------------
    right("10.2", P.check_eviction_order, lambda: (order(),), "list"),
    right("10.2", P.check_eviction_order, lambda: (tuple(order()),), "tuple"),
    right("10.2", P.check_eviction_order, lambda: (", ".join(map(str, order())),), "string"),
    right("10.2", P.check_eviction_order, lambda: ([str(b) for b in order()],), "strings"),
    wrong("10.2", P.check_eviction_order, lambda: (hash_order(),), "plain LRU queue over blocks.*leaves only",
          "hash-lru-order-not-leaf-first"),
    # Any other wrong answer gets the one method hint: which block is wrong, or that the blocks are
    # right but not their order, would let the answer be found by trying.
    wrong("10.2", P.check_eviction_order, lambda: (list(reversed(order())),), "the tree has changed",
          "reversed-order-a-parent-first"),
    wrong("10.2", P.check_eviction_order, lambda: (most_recent_first(),), "longest ago, not most recently",
          "most-recently-used-leaf-first"),
    wrong("10.2", P.check_eviction_order, lambda: ([order()[0], order()[1], scenario_facts()["last_leaf"][-1]],),
          "parent may become a leaf", "a-parent-never-becomes-a-leaf"),
    wrong("10.2", P.check_eviction_order, lambda: (sorted(set(range(P.EX2_POOL)) - set(P._ex2_measured()[2]))[:3],),
          "not the order in which blocks were first filled", "fifo"),
    wrong("10.2", P.check_eviction_order, lambda: ([order()[0], scenario_facts()["parent_first"], order()[1]],),
          "the tree has changed", "a-parent-before-its-child"),
    wrong("10.2", P.check_eviction_order, lambda: ([scenario_facts()["held"][0], *order()[:2]],),
          "the tree has changed", "evicts-a-block-though-held"),
    wrong("10.2", P.check_eviction_order, lambda: ([order()[0], order()[1], scenario_facts()["held"][-1]],),
          "the tree has changed", "evicts-a-running-requests-block"),
    wrong("10.2", P.check_eviction_order, lambda: (ring_order(),), "the tree has changed", "right-blocks-wrong-order"),
    wrong("10.2", P.check_eviction_order, lambda: ([order()[0], *scenario_facts()["last_leaf"][::-1]],),
          "the tree has changed", "evicts-the-newest-leaf-second"),
    right("10.2", P.check_eviction_order, lambda: (np.array(order()),), "numpy-array"),
    right("10.2", P.check_eviction_order, lambda: (torch.tensor(order()),), "tensor"),
    wrong("10.2", P.check_eviction_order, lambda: (set(order()),), "order matters", "a-set"),
    wrong("10.2", P.check_eviction_order, lambda: (order()[:2],), "expected 3 block ids", "too-few"),
    wrong("10.2", P.check_eviction_order, lambda: ([order()[0]] * 3,), "appears twice", "a-block-twice"),
    wrong("10.2", P.check_eviction_order, lambda: ([order()[0], order()[1], 99],), "not a block of this pool",
          "out-of-range"),
    wrong("10.2", P.check_eviction_order, lambda: (None,), "no answer yet", "none"),
    wrong("10.2", P.check_eviction_order, lambda: (3,), "expected a list", "a-number"),
    wrong("10.2", P.check_eviction_order, lambda: ("first, second, third",), "expected a number", "words"),
    wrong("10.2", P.check_eviction_order, lambda: ([1.5, 2, 3],), "integer", "a-fraction"),
]


@pytest.mark.parametrize("case", CH10)
def test_grader_table(case: Case, capsys):
    run_case(case, capsys)


def test_table_covers_every_grader_with_enough_cases():
    graders = {c.values[0].grader for c in CH10}
    for name in dir(P):
        if name.startswith("check_") and getattr(P, name).__module__ == P.__name__:
            assert getattr(P, name) in graders, f"{name} is not in the table"
    for grader in graders:
        cases = [c.values[0] for c in CH10 if c.values[0].grader is grader]
        assert sum(c.match is None for c in cases) >= 2
        assert sum(c.match is not None for c in cases) >= 4


def test_expected_values_come_from_the_engine_and_follow_it():
    """The three counts differ where the policies differ, and move with the exercise's settings."""
    h, r, r1 = measured()
    assert h == r == (E1 - 1) // BS * BS       # whole blocks, under both policies
    assert r1 == E1 - 1                         # one-token pages: every computed token
    assert P._follow_up_reuse("radix", 1, answer=P.EX1_ANSWER + 7) == (E1 + 7 + P.EX1_FOLLOW_UP, E1 + 6)


def test_the_eviction_answer_is_what_the_allocator_does():
    s = P.eviction_scenario()
    assert s.allocator.num_free_blocks == s.allocator.num_cached_free_blocks   # no plainly free block
    leaves = s.allocator.radix.evictable_leaves()
    assert order()[0] == leaves[0].block_ids[-1]
    taken = [s.allocator.allocate() for _ in range(P.EX2_EVICTIONS)]
    assert taken == order()
    s.allocator.radix.check()
    s.allocator.check_invariants()


def test_scenario_is_the_same_for_both_policies_up_to_the_cache():
    """The same requests, in the same batches, reusing the same tokens; only the blocks differ
    (the tree folds B's copy of the system prompt into A's, the hash cache keeps it private)."""
    hashed, radix = P.eviction_scenario("hash"), P.eviction_scenario("radix")
    steps = (lambda s: [re.sub(r"computed on blocks .*", "", line) for line in s.log])
    assert steps(hashed) == steps(radix) and len(radix.log) >= 6
    assert any("the table now holds" in line for line in radix.log)
    assert not any("the table now holds" in line for line in hashed.log)
    assert isinstance(radix.tables["D"], BlockTable) and radix.allocator.radix is not None
    assert BlockAllocator(4, 4, enable_prefix_caching="hash").radix is None


def test_plain_lru_over_blocks_evicts_a_parent_before_its_child_and_the_tree_does_not():
    """The point of exercise 10.2, on the real caches: the hash cache's LRU queue takes a block
    while a cached block continues its prefix; the tree only ever takes a leaf's last block."""
    hashed = P.eviction_scenario("hash")
    stranded = []
    for _ in range(P.EX2_EVICTIONS):
        entries = {b: e for b in range(P.EX2_POOL) if (e := hashed.allocator.cache_entry(b)) is not None}
        victim = hashed.allocator.allocate()
        assert victim in entries and hashed.allocator.cache_entry(victim) is None
        stranded += [b for b, e in entries.items() if b != victim and e.parent_hash == entries[victim].block_hash
                     and hashed.allocator.cache_entry(b) is not None]
    assert stranded, "the hash cache's order evicts no parent before its child: the exercise would not tell"
    assert hash_order() != order()

    radix = P.eviction_scenario("radix")
    tree = radix.allocator.radix
    for expected in order():
        leaves = tree.evictable_leaves()
        assert expected in {leaf.block_ids[-1] for leaf in leaves}      # a leaf's last block, nothing else
        assert radix.allocator.allocate() == expected
        tree.check()


def _hint(name: str, value: int) -> str:
    h, r, r1 = measured()
    answers = {"hash_tokens": h, "radix_tokens": r, "radix_page1_tokens": r1, name: value}
    with pytest.raises(AssertionError) as info:
        P.check_follow_up_reuse(*answers.values())
    return str(info.value).split(" is not right. ", 1)[1]


def test_hints_of_10_1_point_at_the_step_not_the_distance():
    """A hint must not let the answer follow from the wrong answer by arithmetic: no number
    of its own (beyond the exercise's block size), and one hint for every answer the same
    misunderstanding produces, so that it confirms no distance and no unit."""
    f = P.EX1_FOLLOW_UP
    for name in P.EX1_CACHES:
        for value, hint in P._ex1_mistakes(name):
            # "turn 1" names a turn
            numbers = re.findall(r"\d+", re.sub(r"turn \d", "", hint, flags=re.IGNORECASE))
            assert set(numbers) <= {"0", str(BS)}, (name, value, hint)
            assert not re.search(r"too many|too few|one token (too|more|less)|a number of blocks", hint,
                                 re.IGNORECASE), hint
    # counted the new message, with or without the last sampled token: the same hint, no count confirmed
    # (the last sampled token alone is one off the answer: it gets the method hint, like any answer)
    assert _hint("radix_page1_tokens", E1 + f) == _hint("radix_page1_tokens", E1 + f - 1)
    assert _hint("radix_page1_tokens", E1) == _hint("radix_page1_tokens", 37)
    for name in ("hash_tokens", "radix_tokens"):
        blocks = (E1 - 1) // BS
        assert _hint(name, blocks) == _hint(name, blocks - 1) == _hint(name, blocks + 1)   # any count of blocks
        assert _hint(name, E1 - 1) == _hint(name, E1) == _hint(name, -(-E1 // BS) * BS)
