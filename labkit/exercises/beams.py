"""Graders for chapter 9, "Beams and swaps": beam search on shared blocks, the memory that
sharing saves, and swapping against recomputation.

Every expected value is computed here from labkit itself: 9.1 plays the exercise's beam
pattern on real block tables (``labkit.memory.beam_tree.BeamTree``: ``BlockAllocator``,
``BlockTable.fork``, copy-on-write); 9.2 forks real block tables for parallel sampling and
counts their blocks; 9.3 asks the simulator's cost model for each block size.

    from labkit.exercises.beams import check_beam_blocks
    check_beam_blocks(blocks_held=..., blocks_without_sharing=..., copies=...)

The expected-value helpers (``beam_pattern_expected``, ...) serve the tests; the student
notebook imports only the graders.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..memory import BlockAllocator, BlockTable
from ..memory.beam_tree import BeamTree
from ._grading import (agrees, check_exact, check_share, fail, graded, passed, read_count, read_share,
                       share_forms, sig)

# ---- exercise 9.1: blocks held by a beam-search request after forks and deaths -------------------
EX1_PROMPT, EX1_BLOCK_SIZE = 10, 4
#: The exercise's beam pattern: for each step, the beam each surviving candidate extends.
EX1_STEPS = (("b0", "b0", "b0"), ("b0", "b0", "b1"), ("b3", "b3", "b3"))


@dataclass(slots=True, frozen=True)
class BeamCounts:
    blocks_held: int               # physical blocks the live beams hold (shared ones once)
    blocks_without_sharing: int    # the same beams, each with its own copy of every block
    copies: int                    # copy-on-write copies made over the three steps
    forks: int
    deaths: int
    held_if_dead_kept: int         # what a manager that never freed dead beams would hold


@functools.lru_cache(maxsize=None)
def beam_pattern_expected() -> BeamCounts:
    """Play exercise 9.1's pattern on real block tables and count."""
    tree = BeamTree(EX1_PROMPT, EX1_BLOCK_SIZE, num_blocks=64, num_host_blocks=1)
    for parents in EX1_STEPS:
        tree.step(parents)
    tree.device.check_invariants()
    # The same pattern with deaths never freed: what "beams that die free at once" saves.
    keep = BeamTree(EX1_PROMPT, EX1_BLOCK_SIZE, num_blocks=64, num_host_blocks=1)
    zombies = []
    for parents in EX1_STEPS:
        zombies += [beam.table.fork() for beam in keep.live if beam.label not in parents]   # kept alive
        keep.step(parents)
    return BeamCounts(tree.num_physical_blocks, tree.num_logical_blocks, tree.num_copies, tree.num_forks,
                      tree.num_deaths, keep.device.num_used_blocks)


@graded("9.1")
def check_beam_blocks(blocks_held: object, blocks_without_sharing: object, copies: object) -> None:
    """Exercise 9.1: a beam search of width 3 over a 10-token prompt, blocks of 4 tokens,
    steps as in the notebook. After the third step: the physical blocks the beams hold, the
    blocks they would hold each with its own copy, and the copy-on-write copies made in all."""
    c = beam_pattern_expected()
    held = read_count("blocks_held", blocks_held)
    logical = read_count("blocks_without_sharing", blocks_without_sharing)
    n = read_count("copies", copies)
    if held == c.blocks_without_sharing and logical == c.blocks_held:
        fail("blocks_held and blocks_without_sharing look swapped: a block that several tables name is held "
             "once, so the physical count can never exceed the count without sharing.")
    check_exact("blocks_held", held, c.blocks_held, mistakes=[
        (c.held_if_dead_kept, "A beam that is not extended at a step dies, and its table is freed at "
                              "once: its private blocks go back to the pool."),
        (c.blocks_without_sharing, "Count physical blocks: a block named by several live tables is "
                                   "one block in the pool, counted once."),
    ], hint="After the third step, list the three live beams' block tables and count the distinct "
            "physical blocks they name.")
    check_exact("blocks_without_sharing", logical, c.blocks_without_sharing, mistakes=[
        (c.blocks_held, "Without sharing, every live beam keeps its own copy of each of its blocks: "
                        "count table by table."),
    ], hint="Without sharing, each live beam needs a block for every block-size run of its tokens "
            "(prompt and generated).")
    check_exact("copies", n, c.copies, mistakes=[
        (c.forks, "Not every fork copies: a copy is made only when a beam writes into a partly "
                  "filled block that another beam still holds."),
        (c.forks + 1, "Not every fork copies: a copy is made only when a beam writes into a partly "
                      "filled block that another beam still holds."),
        (0, "Forking shares the partly filled last block too; the first beams to write into it "
            "must copy it."),
    ], hint="At each step, look at the block the new tokens go into: is it partly filled, and is "
            "it still held by another live beam when a beam writes? The last writer holds it alone.")
    passed(f"Exercise 9.1: {c.blocks_held} physical blocks for {c.blocks_without_sharing} logical ones "
           f"({c.forks} forks, {c.deaths} deaths, {c.copies} copy-on-write copies): beams share "
           "their whole common history, and only the partly filled block is ever copied.")


# ---- exercise 9.2: what sharing saves for parallel sampling of a width ------------------------
EX2_PROMPT, EX2_OUTPUT, EX2_BLOCK_SIZE = 161, 338, 16     # the paper's ShareGPT means
EX2_WIDTHS = (2, 6)


@functools.lru_cache(maxsize=None)
def sampling_saving_expected(n: int, prompt_len: int = EX2_PROMPT, output_len: int = EX2_OUTPUT,
                             block_size: int = EX2_BLOCK_SIZE) -> tuple[float, int, int]:
    """(saving, physical blocks, logical blocks) when ``n`` samples of one prompt have each
    generated ``output_len`` tokens: real block tables, forked after the prompt, decoding in
    turn as the engine does."""
    alloc = BlockAllocator(n * (prompt_len + output_len) // block_size + 2 * n + 2, block_size)
    first = BlockTable(alloc)
    first.append_tokens(range(prompt_len))
    tables = [first] + [first.fork() for _ in range(n - 1)]
    for step in range(output_len):
        for i, table in enumerate(tables):
            table.append_tokens([100_000 + 1000 * i + step])
    logical = sum(t.num_blocks for t in tables)
    physical = alloc.num_used_blocks
    for t in tables:
        t.free()
    alloc.check_invariants()
    return (logical - physical) / logical, physical, logical


@graded("9.2")
def check_sampling_saving(saving_n2: object, saving_n6: object) -> None:
    """Exercise 9.2: a 161-token prompt, 338 tokens generated by each sample, blocks of 16.
    The share of memory that sharing saves (blocks saved / blocks without sharing) once every
    sample has its 338 tokens, for n = 2 and n = 6, to 3 significant figures (fractions or
    percents)."""
    e2, e6 = (sampling_saving_expected(n)[0] for n in EX2_WIDTHS)
    try:
        a2, a6 = read_share("x", saving_n2), read_share("x", saving_n6)
        swapped = agrees(a2.number, e6 / a2.scale) and agrees(a6.number, e2 / a6.scale)
    except AssertionError:
        swapped = False              # not numbers: the checks below say so, per answer
    if swapped:
        fail("saving_n2 and saving_n6 look swapped: with more samples, more tables share the same "
             "prompt blocks.")
    for name, value, n in (("saving_n2", saving_n2, EX2_WIDTHS[0]), ("saving_n6", saving_n6, EX2_WIDTHS[1])):
        expected, physical, logical = sampling_saving_expected(n)
        tokens_share = (n - 1) * EX2_PROMPT / (n * (EX2_PROMPT + EX2_OUTPUT))
        partial_shared = _partial_block_shared(n)
        check_share(name, value, expected, mistakes=[
            (tokens_share, "That counts tokens; memory comes in blocks, and only whole blocks can be "
                           "shared."),
            (partial_shared, "The prompt's last block is only partly filled: the first token each "
                             "sample writes into it makes a copy, so it is not shared in the end."),
            ((logical - physical) / physical, "Divide by the blocks the samples would hold without "
                                              "sharing, not by those they hold with it."),
            ((n - 1) / n, "Only the prompt is shared; each sample's own tokens need blocks of their own."),
        ], hint="Count the blocks each sample's table names (prompt and output), and the blocks the "
                "samples hold together: which of them are shared at the end?")
    passed(f"Exercise 9.2: sharing saves {sig(100 * e2)}% at n = 2 and {sig(100 * e6)}% at n = 6: it grows with n but "
           "is capped by the prompt's share of each sample's blocks (the paper reports 16.2-30.5% "
           "on ShareGPT for parallel sampling). Beams share much more: their outputs, too.")


def _partial_block_shared(n: int) -> float:
    """The saving if the prompt's partly filled last block stayed shared (it does not)."""
    from ..utils import cdiv
    per_sample = cdiv(EX2_PROMPT + EX2_OUTPUT, EX2_BLOCK_SIZE)
    shared = cdiv(EX2_PROMPT, EX2_BLOCK_SIZE)
    logical = n * per_sample
    return (logical - (shared + n * (per_sample - shared))) / logical


# ---- exercise 9.3: the block size from which swapping beats recomputation ---------------------
EX3_MODEL, EX3_HARDWARE = "llama-3-8b", "h100-sxm"     # chapter 7's running example, PCIe 5.0 to the host
EX3_TOKENS = 1024
EX3_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)


@functools.lru_cache(maxsize=None)
def swap_cost_model():
    """The chapter's cost model: Llama-3-8B on one H100, its host link as ``swap_link``."""
    from ..sim.roofline import roofline
    return roofline(EX3_MODEL, EX3_HARDWARE)


def swap_time(block_size: int, link=None, tokens: int = EX3_TOKENS, both_ways: bool = True) -> float:
    """Seconds to swap a ``tokens``-token sequence's blocks out (and back in, ``both_ways``)."""
    from ..utils import cdiv
    link = link or swap_cost_model().swap_link
    return (2 if both_ways else 1) * link.copy_time(cdiv(tokens, block_size), block_size)


def recompute_time(tokens: int = EX3_TOKENS) -> float:
    """Seconds to recompute the sequence's KV: one prefill of its tokens."""
    return swap_cost_model().prefill_time(tokens)


def _first_cheaper(cost) -> int | None:
    return next((b for b in EX3_BLOCK_SIZES if cost(b) < recompute_time()), None)


def crossover_expected() -> int:
    """The smallest block size of ``EX3_BLOCK_SIZES`` at which swapping out and in costs
    less than recomputing, by the cost model."""
    found = _first_cheaper(swap_time)
    assert found is not None, "swapping never beats recomputation here: the exercise needs another setting"
    return found


@functools.lru_cache(maxsize=None)
def _crossover_mistakes() -> list[tuple[float, str]]:
    """The block sizes students find for 9.3 when they cost the swap another way, with what
    to say; a size that several ways give gets all their hints (the student made one of them)."""
    from dataclasses import replace
    link = swap_cost_model().swap_link
    expected = crossover_expected()
    mistakes = [
        (_first_cheaper(lambda b: swap_time(b, both_ways=False)),
         "A swapped sequence must come back before it can run again: does your cost include both copies?"),
        (_first_cheaper(lambda b: swap_time(b, replace(link, latency_s=0.0))),
         "Bandwidth alone makes every block size equal. Each transfer also pays a fixed cost "
         "(link.latency_s), and small blocks mean many transfers."),
        (_first_cheaper(lambda b: swap_time(b, replace(link, transfers_per_block=1))),
         "A block is not one transfer: vLLM v0 copied each layer's K and V of it separately "
         "(link.transfers_per_block)."),
    ]
    return [(b, hint) for b, hint in mistakes if b is not None and b != expected]


@graded("9.3")
def check_swap_crossover(block_size: object) -> None:
    """Exercise 9.3: a preempted 1,024-token sequence of Llama-3-8B on an H100 (``cm``): of the
    block sizes 8-256, the smallest at which swapping it out and back in over ``cm.swap_link``
    costs less than recomputing its KV (one prefill of its tokens)."""
    expected = crossover_expected()
    b = read_count("block_size", block_size)
    if b not in EX3_BLOCK_SIZES:
        fail(f"block_size: {b} is not one of the block sizes to compare ({', '.join(map(str, EX3_BLOCK_SIZES))}).")
    check_exact("block_size", b, expected, mistakes=_crossover_mistakes,
                hint="For each block size, time the copies both ways with link.copy_time (how many blocks "
                     "does the sequence hold?) and compare with cm.prefill_time of its tokens.")
    passed(f"Exercise 9.3: from {expected}-token blocks on, swapping ({sig(swap_time(expected) * 1e3)} ms out "
           f"and in) beats recomputing ({sig(recompute_time() * 1e3)} ms); with 8-token blocks it takes "
           f"{sig(swap_time(EX3_BLOCK_SIZES[0]) * 1e3)} ms, because every small transfer pays the link's "
           "fixed cost (the paper's Figure 19).")


def answer_forms() -> dict[str, list[str]]:
    """For each exercise, the strings that would give its answer away (for the leak scan)."""
    c = beam_pattern_expected()

    return {
        "9.1": [f"{c.blocks_held} physical blocks", f"{c.blocks_held} blocks held",
                f"{c.blocks_without_sharing} logical blocks", f"{c.copies} copies",
                f"{c.copies} copy-on-write copies", f"blocks_held = {c.blocks_held}",
                f"blocks_without_sharing = {c.blocks_without_sharing}", f"copies = {c.copies}"],
        "9.2": [form for n in EX2_WIDTHS for form in share_forms(sampling_saving_expected(n)[0])],
        "9.3": [f"{crossover_expected()}-token blocks", f"block_size = {crossover_expected()}",
                f"block size {crossover_expected()}", f"blocks of {crossover_expected()}"],
    }
