"""Graders for the memory chapter's exercises (PagedAttention and the waste it removes).

Every expected value is computed here from the real memory layer: the waste accounting
for exercise 1, a real ``BlockTable`` for exercise 2, and 500 real block tables sharing
one prompt for exercise 3. If the engine's block size or accounting changed, the graders
would follow it.

    from labkit.exercises import check_exercise_1
    check_exercise_1(fraction_used=..., utilization_100=...)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..memory import BlockAllocator, BlockTable, SeqUsage, contiguous_waste, paged_waste
from ._grading import (MEMORY_UNITS_MIB, check_close, check_quantity, check_text, fail, fmt,
                       passed, read_count, read_fraction, read_number)

# ---- exercise 1: what a max-length reservation wastes -----------------------------------
EX1_GENERATED = 200        # tokens the request produces
EX1_RESERVED = 4096        # slots naive serving reserved for it: the model's maximum length
EX1_REQUESTS = 100


def _exercise_1_expected() -> tuple[float, float]:
    one = SeqUsage.request(prompt_len=0, output_len=EX1_GENERATED, max_model_len=EX1_RESERVED)
    return (contiguous_waste([one]).utilization,
            contiguous_waste([one] * EX1_REQUESTS).utilization)


def check_exercise_1(fraction_used: object, utilization_100: object) -> None:
    """Exercise 1: a request generates 200 tokens into a 4096-slot reservation. Give the
    fraction of the reservation used, and the utilization with 100 such requests in
    parallel (fractions like 0.05 or percents like 5 are both fine)."""
    single, many = _exercise_1_expected()
    wasted = 1 - single
    used = read_fraction("fraction_used", fraction_used)
    check_close(
        "fraction_used", used, single, rel=0.03, shown=_as_percent(used),
        mistakes=[
            (EX1_RESERVED / EX1_GENERATED / 100,
             "You divided 4096 by 200 (reserved by used); the fraction used is used / reserved."),
            (wasted, "That is the share wasted (3896 empty slots); the question asks for the share used."),
            (EX1_GENERATED / (EX1_RESERVED - EX1_GENERATED),
             "You divided by the empty slots (3896); divide by all the slots reserved (4096)."),
        ],
        hint="Fraction used = slots holding tokens / slots reserved.",
    )
    util = read_fraction("utilization_100", utilization_100)
    check_close(
        "utilization_100", util, many, rel=0.03, shown=_as_percent(util),
        mistakes=[
            (single / EX1_REQUESTS,
             "More requests do not dilute the use: the used slots grow 100×, and so do the reserved ones."),
            (wasted, "That is the share wasted; utilization is the share used."),
            (1.0, "Each reservation is private: one request cannot put its tokens in another's "
                  "empty slots, so running 100 of them fills nothing more."),
        ],
        hint=f"Utilization = all slots holding tokens / all slots reserved, over the {EX1_REQUESTS} "
             "requests together.",
    )
    used_slots, reserved_slots = EX1_REQUESTS * EX1_GENERATED, EX1_REQUESTS * EX1_RESERVED
    passed(f"Exercise 1: {EX1_GENERATED}/{EX1_RESERVED} = {single:.1%} of the reservation holds tokens; "
           f"with {EX1_REQUESTS} such requests still {many:.1%} ({used_slots:,} of {reserved_slots:,} "
           f"slots): reserving the maximum wastes {wasted:.1%} however many requests run.")


# ---- exercise 2: internal fragmentation of one paged sequence ----------------------------
EX2_BLOCK_SIZE = 16
EX2_TOKENS = 70


def _exercise_2_expected() -> tuple[int, int, float]:
    """Append 70 tokens to a real block table and read its blocks and empty slots."""
    allocator = BlockAllocator(num_blocks=8, block_size=EX2_BLOCK_SIZE)
    table = BlockTable(allocator)
    table.append_tokens(range(EX2_TOKENS))
    waste = paged_waste([SeqUsage(EX2_TOKENS, EX2_TOKENS, EX2_TOKENS)], EX2_BLOCK_SIZE)
    assert waste.internal_fragmentation == table.num_free_slots   # the two views agree
    return table.num_blocks, table.num_free_slots, table.num_free_slots / EX2_TOKENS


def check_exercise_2(num_blocks: object, wasted_slots: object, internal_fragmentation: object) -> None:
    """Exercise 2: blocks of 16 slots, a sequence of 70 tokens. Give the blocks it occupies,
    the empty slots of its last block, and the internal fragmentation as a fraction (or
    percent) of the sequence length."""
    blocks, empty, frag = _exercise_2_expected()
    bs, n = EX2_BLOCK_SIZE, EX2_TOKENS
    nb = read_number("num_blocks", num_blocks)
    if not nb.is_integer():
        fail(f"num_blocks: {fmt(nb)} blocks? Blocks are allocated whole: a partly filled "
             f"block still takes a whole block, so round {n}/{bs} up.")
    check_close("num_blocks", read_count("num_blocks", nb), blocks, rel=0,
                mistakes=[(n // bs, f"{n // bs} full blocks hold {n // bs * bs} tokens; the other "
                                    f"{n % bs} still need a block of their own: round up.")],
                hint=f"Each block holds {bs} tokens; how many blocks do {n} tokens need?")
    check_close("wasted_slots", read_count("wasted_slots", wasted_slots), empty, rel=0,
                mistakes=[(n % bs, f"{n % bs} is how many tokens the last block holds ({n} - "
                                   f"{n // bs * bs}); the wasted slots are the rest of that block.")],
                hint="Wasted slots = slots in the blocks you counted minus tokens stored.")
    share = read_fraction("internal_fragmentation", internal_fragmentation)
    check_close(
        "internal_fragmentation", share, frag, rel=0.02, shown=_as_percent(share),
        mistakes=[
            (empty / (blocks * bs), f"{empty}/{blocks * bs} is the share of the allocated slots; the "
                                    f"exercise asks relative to the sequence length, {n} tokens."),
            ((n % bs) / n, f"{n % bs} is the number of tokens in the last block, not the empty slots."),
        ],
        hint=f"Internal fragmentation = wasted slots / sequence length ({n} tokens).",
    )
    passed(f"Exercise 2: {n} tokens fill {n // bs} blocks and {n % bs} slots of one more: {blocks} blocks, "
           f"{empty} empty slots, {empty}/{n} = {frag:.1%} internal fragmentation (never more than "
           f"{bs - 1} slots per sequence, however long it grows).")


# ---- exercise 3: sharing a system prompt with copy-on-write ------------------------------
EX3_SESSIONS = 500
EX3_PROMPT = 1000
EX3_MIB_PER_TOKEN = 1
EX3_BLOCK_SIZE = 16


@dataclass(slots=True, frozen=True)
class SharedPromptCounts:
    """Blocks and slots measured on real block tables for exercise 3 (block size 16)."""

    blocks_per_session: int        # one private copy of the prompt: ceil(1000 / 16) = 63
    blocks_shared: int             # all sessions forked from one table, before they diverge
    blocks_diverged: int           # after each session wrote its first own token (COW)
    copies: int                    # copy-on-write copies made when they diverged
    prompt_slots_diverged: int     # slots holding prompt tokens after divergence


@functools.lru_cache(maxsize=None)
def shared_prompt_counts(sessions: int = EX3_SESSIONS, prompt_len: int = EX3_PROMPT,
                         block_size: int = EX3_BLOCK_SIZE) -> SharedPromptCounts:
    """Run exercise 3 on the real memory layer: one table holds the prompt, ``sessions - 1``
    forks share it, then every session appends a token of its own."""
    allocator = BlockAllocator(num_blocks=prompt_len // block_size + 1 + sessions, block_size=block_size)
    first = BlockTable(allocator)
    first.append_tokens(range(prompt_len))
    per_session = first.num_blocks   # what each session would hold alone, without sharing
    tables = [first] + [first.fork() for _ in range(sessions - 1)]
    blocks_shared = allocator.num_used_blocks
    copies = 0
    for i, table in enumerate(tables):
        copies += len(table.append_tokens([prompt_len + i]))   # the sessions diverge
    allocator.check_invariants()
    # Slots holding prompt tokens: count each physical block once.
    prompt_slots: dict[int, int] = {}
    for table in tables:
        for index, block_id in enumerate(table.block_ids):
            prompt_slots[block_id] = max(0, min(block_size, prompt_len - index * block_size))
    return SharedPromptCounts(per_session, blocks_shared, allocator.num_used_blocks, copies,
                              sum(prompt_slots.values()))


_ASSUMPTION_HINT = (
    "What must hold for 500 sessions to read one copy of the prefix's K and V, and for "
    "copy-on-write to be enough? Think about what a token's KV depends on and who may write it."
)
_ASSUMPTION_ACCEPT = [
    r"read[- ]?only", r"immutab", r"unchang", r"never (be )?(written|modified|changed|overwritten|updated)",
    r"(not|n't|no one|nobody|never|none)\b.{0,30}\b(writ|modif|chang|overwr|updat|mutat)",
    r"(same|identical|equal)\b.{0,30}\b(tokens?|prefix|prompt|positions?|model|weights|inputs?|context)",
    r"(tokens?|prefix|prompt|positions?|weights|model)\b.{0,40}\b(same|identical|equal)",
    r"depends? (only )?on\b.{0,30}\b(prefix|preceding|previous|earlier|before|tokens)",
    r"causal", r"determinis",
]
_ASSUMPTION_REJECT = [r"\b(i don'?t know|no idea|idk|dunno)\b"]


def check_exercise_3(without_mib: object, with_mib: object, assumption: object) -> None:
    """Exercise 3: 500 sessions share a 1000-token system prompt, 1 MiB of KV per token.
    Give the prefix's KV memory without and with copy-on-write block sharing (numbers in
    MiB, or strings with a unit like "488 GiB"), and, as a sentence, the assumption that
    makes the sharing safe."""
    c = shared_prompt_counts()
    n, p, bs, mib = EX3_SESSIONS, EX3_PROMPT, EX3_BLOCK_SIZE, EX3_MIB_PER_TOKEN
    ideal_without, exact_without = n * p * mib, n * c.blocks_per_session * bs * mib
    ideal_with, blocks_with = p * mib, c.blocks_shared * bs * mib
    diverged_with = c.prompt_slots_diverged * mib
    full, tail = p // bs, p % bs
    got_without, _, _ = check_quantity(
        "without_mib", without_mib, [ideal_without, exact_without], units=MEMORY_UNITS_MIB,
        default_unit="MiB", bare_also=("GiB",), rel=0.025,
        mistakes=[(p * mib, "That is one session's copy; without sharing each of the 500 sessions "
                            "stores its own copy of the prefix.")],
        hint="Without sharing, every session stores the whole prefix: sessions × tokens × MiB per token.",
    )
    got_with, _, _ = check_quantity(
        "with_mib", with_mib, [ideal_with, blocks_with, diverged_with], units=MEMORY_UNITS_MIB,
        default_unit="MiB", bare_also=("GiB",), rel=0.025,
        mistakes=[
            (ideal_without, "That is the memory without sharing; with sharing the sessions' block "
                            "tables all point at the same physical blocks."),
            (exact_without, "That is the memory without sharing; with sharing the sessions' block "
                            "tables all point at the same physical blocks."),
            (p * mib / n, "Sharing does not split the prefix into 500 parts: one full copy is "
                          "stored, and all 500 sessions read it."),
            ((full + n) * bs * mib, f"That counts the {n} copied last blocks whole, but only {tail} "
                                    f"of each one's {bs} slots hold prompt tokens."),
            (n * tail * mib, f"That is only the {n} copies of the partial last block; the {full} full "
                             "blocks are stored once, and they count too."),
        ],
        hint="With copy-on-write sharing, how many copies of the prefix's KV exist?",
    )
    check_text("assumption", assumption, _ASSUMPTION_ACCEPT, reject=_ASSUMPTION_REJECT,
               hint=_ASSUMPTION_HINT)
    ratio = ideal_without / ideal_with
    if got_with == ideal_with:
        exact = (f"Block-exact with {bs}-slot blocks: {full} full blocks + 1 block holding the last "
                 f"{tail} tokens ({c.blocks_shared} blocks = {blocks_with:,} MiB) while shared; when the "
                 f"sessions diverge each one copies that partial block ({c.copies} copies), "
                 f"so the prefix then takes {full * bs} + {n} × {tail} = {diverged_with:,} MiB.")
    elif got_with == blocks_with:
        exact = (f"You counted whole blocks: {c.blocks_shared} × {bs} = {blocks_with:,} MiB, vs {ideal_with:,} "
                 f"MiB ideal. When the sessions diverge, each copies the partial last block "
                 f"({tail} prompt tokens): {diverged_with:,} MiB.")
    else:
        exact = (f"You counted the copy-on-write copies: {full} shared full blocks ({full * bs} MiB) + "
                 f"{n} private copies of the block holding the last {tail} prompt tokens = "
                 f"{diverged_with:,} MiB; the ideal (one copy, no block rounding) is {ideal_with:,} MiB.")
    without_note = ("" if got_without == ideal_without else
                    f" ({n} × {c.blocks_per_session} blocks × {bs} slots; {ideal_without:,} MiB of it holds tokens)")
    passed(f"Exercise 3: without sharing {n} × {p} MiB = {ideal_without:,} MiB "
           f"({ideal_without / 1024:,.1f} GiB){without_note}; with sharing the prefix is stored once: "
           f"{ideal_with:,} MiB, {ratio:.0f}× less. {exact} Safe because the shared KV is read-only: "
           "a token's K and V depend only on the tokens before it (same tokens, same positions, "
           "same model), and a session that writes copies first.")


def _as_percent(share: float) -> str:
    return f"{share:.4g} ({share:.2%})"
