"""Graders for the three exercises of the PagedAttention lesson ("PagedAttention and
continuous batching", whose exercises 1-3 are this lab's 1.3, 2.1 and 3.3).

Every expected value is computed here from the real memory layer: the waste accounting
for exercise 1.3, a real ``BlockTable`` for 2.1, and 500 real block tables sharing one
prompt for 3.3. If the engine's block size or accounting changed, the graders would
follow it.

    from labkit.exercises import check_exercise_1
    check_exercise_1(fraction_used=..., utilization_100=...)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..memory import BlockAllocator, BlockTable, SeqUsage, contiguous_waste, paged_waste
from ._grading import (MEMORY_UNITS_MIB, check_choices, check_exact, check_quantity, check_share,
                       fail, fmt, graded, passed, quantity_forms, read_count, read_number, share_forms, sig)

# ---- exercise 1.3 (the lesson's exercise 1): what a max-length reservation wastes -----------------------------------
EX1_GENERATED = 200        # tokens the request produces
EX1_RESERVED = 4096        # slots naive serving reserved for it: the model's maximum length
EX1_REQUESTS = 100


@functools.lru_cache(maxsize=None)
def _exercise_1_expected() -> tuple[float, float]:
    one = SeqUsage.request(prompt_len=0, output_len=EX1_GENERATED, max_model_len=EX1_RESERVED)
    return (contiguous_waste([one]).utilization,
            contiguous_waste([one] * EX1_REQUESTS).utilization)


@graded("1.3")
def check_exercise_1(fraction_used: object, utilization_100: object) -> None:
    """Exercise 1.3: a request generates 200 tokens into a 4096-slot reservation. Give the
    fraction of the reservation used, and the utilization with 100 such requests in
    parallel, each to 3 significant figures, as a fraction (0.0123) or a percent (1.23)."""
    single, many = _exercise_1_expected()
    wasted = 1 - single
    check_share(
        "fraction_used", fraction_used, single,
        mistakes=[
            (EX1_RESERVED / EX1_GENERATED / 100,
             "You divided the reservation by what is used: the other way round."),
            (wasted, "That is the share wasted; the question asks for the share used."),
            (EX1_GENERATED / (EX1_RESERVED - EX1_GENERATED),
             "You divided by the empty slots only; the whole is every slot reserved."),
        ],
        hint="Compare the slots that hold tokens with all the slots reserved for the request.",
    )
    check_share(
        "utilization_100", utilization_100, many,
        mistakes=[
            (single / EX1_REQUESTS,
             "More requests do not dilute the use: the used slots grow 100×, and so do the reserved ones."),
            (wasted, "That is the share wasted; utilization is the share used."),
            (1.0, "Each reservation is private: one request cannot put its tokens in another's "
                  "empty slots, so running 100 of them fills nothing more."),
        ],
        hint=f"Count, over the {EX1_REQUESTS} requests together, the slots that hold tokens and the "
             "slots reserved.",
    )
    used_slots, reserved_slots = EX1_REQUESTS * EX1_GENERATED, EX1_REQUESTS * EX1_RESERVED
    passed(f"Exercise 1.3: {EX1_GENERATED}/{EX1_RESERVED} = {sig(100 * single)}% of the reservation holds tokens; "
           f"with {EX1_REQUESTS} such requests still {sig(100 * many)}% ({used_slots:,} of {reserved_slots:,} "
           f"slots): reserving the maximum wastes {sig(100 * wasted)}% however many requests run.")


# ---- exercise 2.1 (the lesson's exercise 2): internal fragmentation of one paged sequence ----------------------------
EX2_BLOCK_SIZE = 16
EX2_TOKENS = 70


@functools.lru_cache(maxsize=None)
def _exercise_2_expected() -> tuple[int, int, float]:
    """Append 70 tokens to a real block table and read its blocks and empty slots."""
    allocator = BlockAllocator(num_blocks=8, block_size=EX2_BLOCK_SIZE)
    table = BlockTable(allocator)
    table.append_tokens(range(EX2_TOKENS))
    waste = paged_waste([SeqUsage(EX2_TOKENS, EX2_TOKENS, EX2_TOKENS)], EX2_BLOCK_SIZE)
    assert waste.internal_fragmentation == table.num_free_slots   # the two views agree
    return table.num_blocks, table.num_free_slots, table.num_free_slots / EX2_TOKENS


@graded("2.1")
def check_exercise_2(num_blocks: object, wasted_slots: object, internal_fragmentation: object) -> None:
    """Exercise 2.1: blocks of 16 slots, a sequence of 70 tokens. Give the blocks it occupies,
    the empty slots of its last block (counts, exact), and the internal fragmentation as a
    fraction (or percent) of the sequence length, to 3 significant figures."""
    blocks, empty, frag = _exercise_2_expected()
    bs, n = EX2_BLOCK_SIZE, EX2_TOKENS
    nb = read_number("num_blocks", num_blocks)
    if not nb.is_integer():
        fail(f"num_blocks: {fmt(nb)} blocks? Blocks are allocated whole: a partly filled "
             "block still takes a whole block.")
    check_exact("num_blocks", read_count("num_blocks", nb), blocks,
                mistakes=[(n // bs, "That counts the full blocks only; the tokens left over after them "
                                    "need a block too.")],
                hint=f"Each block holds {bs} tokens, and a partly filled block is still a whole block: how many "
                     f"blocks do {n} tokens need?")
    check_exact("wasted_slots", read_count("wasted_slots", wasted_slots), empty,
                mistakes=[(n % bs, "That is how many tokens the last block holds; the question asks for "
                                   "its empty slots.")],
                hint="Only the last block can have empty slots: how many of its slots hold no token?")
    check_share(
        "internal_fragmentation", internal_fragmentation, frag,
        mistakes=[
            (empty / (blocks * bs), "That is relative to the allocated slots; the exercise measures the "
                                    "wasted slots against the sequence's length."),
            ((n % bs) / n, "That uses the tokens in the last block, not its empty slots."),
        ],
        hint="Express the wasted slots as a share of the sequence's length, as the exercise defines it.",
    )
    passed(f"Exercise 2.1: {n} tokens fill {n // bs} blocks and {n % bs} slots of one more: {blocks} blocks, "
           f"{empty} empty slots, {empty}/{n} = {sig(100 * frag)}% internal fragmentation (never more than "
           f"{bs - 1} slots per sequence, however long it grows).")


# ---- exercise 3.3 (the lesson's exercise 3): sharing a system prompt with copy-on-write ------------------------------
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


#: Exercise 3.3's statements: the student picks those that make the sharing safe. Three
#: are needed; the others are the misconceptions students bring (or true but beside the point).
SHARING_STATEMENTS: dict[str, str] = {
    "A": "All sessions use the same tokenizer.",
    "B": "A token's K and V depend only on that token, its position and the tokens before it "
         "(and the model's weights): attention is causal.",
    "C": "The KV cache is deterministic: a model always computes the same K and V.",
    "D": "The sessions' prefixes hold the same tokens; where in the sequence they stand does not matter.",
    "E": "Every session's prefix is the same tokens at the same positions, run through the same "
         "model weights.",
    "F": "Attention is not causal: each token's K and V take the whole sequence into account.",
    "G": "Each session, computing the prefix on its own, would get bit-for-bit the same K and V "
         "whatever else ran in its batch.",
    "H": "No session writes into a block that another still holds: a writer copies the block "
         "first (copy-on-write).",
    "I": "The GPU has enough memory for every session's own copy of the prefix.",
    "J": "The sessions release the prefix in the order they started.",
}
SHARING_SAFE = frozenset("BEH")
#: Why each other statement is not a reason, for the verdict of a right pick (a wrong pick gets
#: one hint whatever it holds: naming a wrong or a missing statement would give the letters away).
NOT_WHY = {
    "A": "one tokenizer does not make two prompts equal",
    "C": "determinism says nothing about two different sessions",
    "D": "false: rotary embeddings make a key depend on its position",
    "F": "false: attention is causal",
    "G": "false across batches (the order of float sums changes), and not needed",
    "I": "that is what sharing saves, not what makes it safe",
    "J": "reference counts handle any order",
}
PICK_HINT = ("Sharing is safe when the one stored copy of the prefix's K and V is exactly what every session "
             "would compute for itself, and stays so while the sessions write their own tokens. Judge each "
             "statement twice: is it true? And if it is, is it a reason for that? (A true statement can be "
             "beside the point, and a false one is never a reason.) Chapter 3's opening and its copy-on-write "
             "section have what you need.")


@graded("3.3")
def check_exercise_3(without_mib: object, with_mib: object, safe_because: object) -> None:
    """Exercise 3.3: 500 sessions share a 1000-token system prompt, 1 MiB of KV per token.
    Give the prefix's KV memory without and with copy-on-write block sharing, to 3 significant
    figures (bare numbers are MiB; strings with a unit like "2 GiB" are converted), and
    ``safe_because``: the letters of the ``SHARING_STATEMENTS`` that make the sharing safe
    (a set such as {"X", "Y"}, or a list, tuple or string of letters)."""
    c = shared_prompt_counts()
    n, p, bs, mib = EX3_SESSIONS, EX3_PROMPT, EX3_BLOCK_SIZE, EX3_MIB_PER_TOKEN
    ideal_without, exact_without = n * p * mib, n * c.blocks_per_session * bs * mib
    ideal_with, blocks_with = p * mib, c.blocks_shared * bs * mib
    diverged_with = c.prompt_slots_diverged * mib
    full, tail = p // bs, p % bs
    got_without, _, _ = check_quantity(
        "without_mib", without_mib, [ideal_without, exact_without], units=MEMORY_UNITS_MIB,
        default_unit="MiB",
        mistakes=[(p * mib, "That is one session's copy; without sharing each of the 500 sessions "
                            "stores its own copy of the prefix.")],
        hint="Without sharing, what does every session store, and how many sessions are there?",
    )
    got_with, _, _ = check_quantity(
        "with_mib", with_mib, [ideal_with, blocks_with, diverged_with], units=MEMORY_UNITS_MIB,
        default_unit="MiB",
        mistakes=[
            (ideal_without, "That is the memory without sharing; with sharing the sessions' block "
                            "tables all point at the same physical blocks."),
            (exact_without, "That is the memory without sharing; with sharing the sessions' block "
                            "tables all point at the same physical blocks."),
            (p * mib / n, "Sharing does not split the prefix into 500 parts: one full copy is "
                          "stored, and all 500 sessions read it."),
            ((full + n) * bs * mib, f"That counts the {n} copied last blocks whole, but only some of "
                                    "each one's slots hold prompt tokens."),
            (n * tail * mib, f"That is only the {n} copies of the partial last block; the full "
                             "blocks are stored once, and they count too."),
        ],
        hint="With copy-on-write sharing, how many copies of the prefix's KV exist?",
    )
    check_choices("safe_because", safe_because, SHARING_STATEMENTS, SHARING_SAFE, hint=PICK_HINT)
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
    passed(f"Exercise 3.3: without sharing {n} × {p} MiB = {ideal_without:,} MiB "
           f"({ideal_without / 1024:,.1f} GiB){without_note}; with sharing the prefix is stored once: "
           f"{ideal_with:,} MiB, {ratio:.0f}× less. {exact} Safe because attention is causal (a token's K and V "
           "depend only on it and the tokens before it), the prefix is the same tokens at the same "
           "positions through the same weights in every session, and a session that writes copies first. The others: "
           + "; ".join(f"{k}, {why}" for k, why in NOT_WHY.items()) + ".")


def answer_forms() -> dict[str, list[str]]:
    """For each exercise, the strings that would give its answer away (for the leak scan)."""
    single, many = _exercise_1_expected()
    blocks, empty, frag = _exercise_2_expected()
    c = shared_prompt_counts()
    picks = sorted(SHARING_SAFE)
    return {
        "1.3": share_forms(single),
        "2.1": share_forms(frag) + [f"{empty}/{EX2_TOKENS}", f"{empty} / {EX2_TOKENS}"],
        "3.3": (quantity_forms(EX3_SESSIONS * EX3_PROMPT * EX3_MIB_PER_TOKEN, MEMORY_UNITS_MIB,
                               ["MiB", "GiB"])
                + quantity_forms(EX3_PROMPT * EX3_MIB_PER_TOKEN, MEMORY_UNITS_MIB, ["MiB"])
                + quantity_forms(c.prompt_slots_diverged * EX3_MIB_PER_TOKEN, MEMORY_UNITS_MIB, ["MiB"])
                + ["{" + ", ".join(f"{q}{x}{q}" for x in picks) + "}" for q in "'\""]
                + ["".join(picks), ", ".join(picks)]),
    }
