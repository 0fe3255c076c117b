"""Graders for chapter 10: prefix caching by chained block hashes and by a radix tree.

Every expected value is measured on the real engine or memory layer with the policy in
question (``enable_prefix_caching="hash"`` or ``"radix"``), never written down:

* 10.1 serves a chat's first turn on the real scheduler (the simulator's executor in place
  of the model), then its follow-up turn, and reads how many of the follow-up's prompt
  tokens the prefix cache served: under the hash cache, under the radix tree with pages of
  one block, and under the radix tree with pages of one token (SGLang's default);
* 10.2 runs the chapter's chat scenario (``eviction_scenario``) on a radix-tree allocator
  whose pool is full, then lets three allocations evict, and compares the blocks they take
  back with the student's prediction. The same scenario on the hash cache is run too: its
  plain LRU queue over blocks evicts a prefix before a cached continuation of it, which the
  tree never does, so an answer that ignores the tree's shape is recognised and told so.

The notebook imports the scenario and the exercises' constants from here, so that the
student's runs and the grader's are the same runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ..memory import BlockAllocator, BlockTable
from ._grading import check_exact, fail, graded, passed, read_count, read_sequence

# ---- exercise 10.1: what a chat's follow-up turn reuses ----------------------------------------------
EX1_SYSTEM = 100          # system prompt tokens
EX1_MESSAGE = 30          # the user's first message
EX1_ANSWER = 45           # tokens the model answers in turn 1
EX1_FOLLOW_UP = 20        # the user's second message
EX1_BLOCK_SIZE = 16
#: The three caches of the exercise: (prefix-caching policy, block size = page size).
EX1_CACHES = {"hash_tokens": ("hash", EX1_BLOCK_SIZE), "radix_tokens": ("radix", EX1_BLOCK_SIZE),
              "radix_page1_tokens": ("radix", 1)}


def chat_prompts(system: int = EX1_SYSTEM, message: int = EX1_MESSAGE,
                 follow_up: int = EX1_FOLLOW_UP) -> tuple[list[int], list[int], list[int]]:
    """(system prompt, first message, second message): distinct token ids, deterministic."""
    return ([(7 * i + 3) % 30_000 for i in range(system)], list(range(30_000, 30_000 + message)),
            list(range(31_000, 31_000 + follow_up)))


def _follow_up_reuse(policy: str, block_size: int, answer: int = EX1_ANSWER) -> tuple[int, int]:
    """Serve turn 1 (system prompt + first message, ``answer`` tokens generated) to the end,
    then turn 2 (turn 1's prompt and answer + the second message) on one engine with the
    prefix cache ``policy``. Returns (turn 2's prompt length, its tokens served from the cache)."""
    from ..engine import Engine
    from ..sampling_params import SamplingParams
    from ..scheduler import make_scheduler
    from ..sim import SimExecutor

    system, first, second = chat_prompts()
    allocator = BlockAllocator(4 * (EX1_SYSTEM + EX1_MESSAGE + answer + EX1_FOLLOW_UP) // block_size + 8,
                               block_size, enable_prefix_caching=policy)
    scheduler = make_scheduler("continuous", allocator, max_num_seqs=4, max_num_batched_tokens=1024)
    engine = Engine(scheduler, SimExecutor(), keep_records=False)
    turn1 = engine.add_request(system + first, SamplingParams(max_tokens=answer, ignore_eos=True),
                               request_id="turn1")
    while engine.has_unfinished:
        engine.step()
    prompt2 = list(turn1.seqs[0].token_ids) + second
    turn2 = engine.add_request(prompt2, SamplingParams(max_tokens=1, ignore_eos=True), request_id="turn2")
    while engine.has_unfinished:
        engine.step()
    allocator.check_invariants()
    return len(prompt2), turn2.seqs[0].num_cached_tokens


@functools.lru_cache(maxsize=None)
def _ex1_measured() -> dict[str, int]:
    return {name: _follow_up_reuse(policy, bs)[1] for name, (policy, bs) in EX1_CACHES.items()}


def _ex1_mistakes(name: str) -> list[tuple[float, str]]:
    """What students answer for one of the three caches, and what to say about each.

    A hint points at the step that went wrong, never at the distance to the answer: it must
    not confirm that a wrong answer is off by a known amount ("one token too many") or only by
    its unit ("that is a number of blocks"), or the answer follows from the hint by arithmetic.
    So one hint covers every answer that the same misunderstanding gives (every count of
    blocks, every count that includes tokens turn 1 never computed)."""
    _, bs = EX1_CACHES[name]
    s, m, a, f = EX1_SYSTEM, EX1_MESSAGE, EX1_ANSWER, EX1_FOLLOW_UP
    history = s + m + a
    whole = (lambda n: n // EX1_BLOCK_SIZE * EX1_BLOCK_SIZE)
    only_system = ("Only the system prompt? All of turn 1 went through the model, and its blocks stayed in "
                   "the cache when it finished.")
    no_answer = ("What about turn 1's answer? Think about when the K and V of each token the model "
                 "generated are computed, and whether turn 2's prompt repeats them.")
    uncomputed = ("Count only the tokens the cache can hand out: those whose K and V an earlier request "
                  "computed, by feeding them into the model as input. Not every token you counted went in.")
    common = [(s, only_system), (whole(s), only_system), (s + m, no_answer), (whole(s + m), no_answer),
              (history + f, uncomputed), (history + f - 1, uncomputed),
              (0, "Turn 1 finished, but its blocks were not thrown away: they stay in the cache (reference "
                  "count 0) until the pool needs them, and this pool is large.")]
    if bs > 1:
        granular = ("How does this cache cut a match? labkit's radix tree is page-granular: a node holds whole "
                    "blocks, so a match ends at a block boundary and a partly filled block is never shared "
                    "(SGLang's default page is one token; here a page is a block)." if name == "radix_tokens" else
                    "How does this cache cut a match? The hash cache keys and matches whole blocks: a block "
                    "gets a hash only once it is full, and a partly filled one is never shared.")
        blocks = ("Count tokens, not blocks or pages: the question asks how many of turn 2's prompt tokens "
                  "the cache hands out.")
        return common + [
            # counted every token, every computed one, or every block's slots: one hint for all three
            (history, granular), (history - 1, granular), (-(-history // bs) * bs, granular),
            *[(n, blocks) for n in range(1, -(-(history + f) // bs) + 1)],
        ]
    return common + [
        (history, uncomputed),
        *[(n, "With one-token pages a match is not cut at 16-token block boundaries: every token whose K "
              "and V exist can be matched.") for n in sorted({whole(history), whole(history - 1)})],
    ]


@graded("10.1")
def check_follow_up_reuse(hash_tokens: object, radix_tokens: object, radix_page1_tokens: object) -> None:
    """Exercise 10.1: a chat's first turn (a 100-token system prompt, a 30-token message, a
    45-token answer) has finished; its second turn sends the whole of turn 1 plus a 20-token
    message. How many of turn 2's prompt tokens come from the prefix cache with the hash
    cache (blocks of 16), the radix tree (pages = blocks of 16), and the radix tree with
    pages of one token?"""
    measured = _ex1_measured()
    answers = {"hash_tokens": hash_tokens, "radix_tokens": radix_tokens,
               "radix_page1_tokens": radix_page1_tokens}
    for name, value in answers.items():
        policy, bs = EX1_CACHES[name]
        check_exact(name, read_count(name, value), measured[name], mistakes=_ex1_mistakes(name),
                    hint=f"Which of turn 2's tokens had their K and V computed before, and how does the "
                         f"{policy} cache with {bs}-token pages cut a match?")
    h, r, r1 = (measured[k] for k in EX1_CACHES)
    history = EX1_SYSTEM + EX1_MESSAGE + EX1_ANSWER
    passed(f"Exercise 10.1: turn 1 holds {history} tokens, {history - 1} of them computed (the last answer "
           f"token was never fed back). Hash cache: {h} tokens ({h // EX1_BLOCK_SIZE} whole blocks); radix "
           f"tree with 16-token pages: {r}, the same whole blocks; with 1-token pages: {r1}. Page "
           "granularity, not the data structure, decides how much of one follow-up matches.")


# ---- exercise 10.2: which blocks the radix tree evicts next ----------------------------------------------
EX2_BLOCK_SIZE = 4
EX2_SYSTEM = 8            # two blocks of system prompt, shared by chats A and B
EX2_EVICTIONS = 3
EX2_POOL = 8              # exactly what the scenario holds: no block is left plainly free


@dataclass(slots=True)
class Scenario:
    """The chat scenario of exercise 10.2, left as its last step left it."""

    allocator: BlockAllocator
    tables: dict[str, BlockTable] = field(default_factory=dict)   # still running: held blocks
    prompts: dict[str, list[int]] = field(default_factory=dict)    # every request's prompt, by name
    log: list[str] = field(default_factory=list)                   # what each step did, in order


def eviction_scenario(policy: str = "radix") -> Scenario:
    """Four requests on a pool of 8 blocks of 4 tokens, with the prefix cache ``policy``.

    1. chats A and B arrive together, in one batch: each is the system prompt S (8 tokens)
       and its own 4-token message. Both are prefilled in the same iteration, before either's
       blocks are in any cache, so each computes S; then they publish their blocks, A first.
       The radix tree keeps A's copy of S and B switches to it (its own copy goes back to
       the pool); the hash cache keeps A's copy too, but B's stays private, and B's message
       block is filed under the hash chained on S: a continuation of A's S blocks;
    2. A finishes, then B finishes;
    3. request D, unrelated (8 tokens), keeps running;
    4. request E, unrelated (8 tokens), finishes.

    A table frees its blocks last-first (``BlockTable.free``). Afterwards no block is
    plainly free: every block is either held by D or cached.
    """
    allocator = BlockAllocator(EX2_POOL, EX2_BLOCK_SIZE, enable_prefix_caching=policy)
    scenario = Scenario(allocator)
    system = list(range(100, 100 + EX2_SYSTEM))
    batches = [[("A", system + [201, 202, 203, 204]), ("B", system + [301, 302, 303, 304])],
               [("D", [501, 502, 503, 504, 505, 506, 507, 508])],
               [("E", [601, 602, 603, 604, 605, 606, 607, 608])]]
    finishing = ["A", "B", "E"]          # in this order, each after its batch
    for batch in batches:
        # As the scheduler does: every request of the batch gets its cached prefix and its
        # slots first; the blocks are published once the iteration has computed their K/V.
        running = []
        for name, prompt in batch:
            scenario.prompts[name] = prompt
            table = BlockTable(allocator)
            reused = table.reuse_cached_prefix(prompt, len(prompt) - 1)
            table.append_tokens(prompt[reused:], computed=False)
            running.append((name, prompt, table, reused))
        for name, prompt, table, reused in running:
            computed_on = list(table.block_ids)
            table.cache_computed_blocks(len(prompt))
            scenario.tables[name] = table
            together = f", in one batch with {len(batch) - 1} more" if len(batch) > 1 else ""
            switched = ("" if table.block_ids == computed_on else
                        f"; published: the cache kept an earlier copy, the table now holds {table.block_ids}")
            scenario.log.append(f"{name}: {len(prompt)} tokens{together}, {reused} from the cache, computed "
                                f"on blocks {computed_on}{switched}")
        for name in [n for n in finishing if n in scenario.tables]:
            scenario.tables.pop(name).free()
            scenario.log.append(f"{name} finishes")
    scenario.log.append(", ".join(scenario.tables) + " keeps running")
    allocator.check_invariants()
    return scenario


def _held_blocks(scenario: Scenario) -> set[int]:
    return {b for table in scenario.tables.values() for b in table.block_ids}


def _evictions_after(scenario: Scenario, count: int = EX2_EVICTIONS) -> list[int]:
    """The blocks ``count`` allocations take back from the cache, in order (the pool has no
    plainly free block left, so each allocation evicts). Changes the scenario's allocator."""
    before = scenario.allocator.num_evictions
    taken = [scenario.allocator.allocate() for _ in range(count)]
    assert scenario.allocator.num_evictions - before == count, "an allocation did not evict"
    return taken


@functools.lru_cache(maxsize=None)
def _ex2_measured() -> tuple[tuple[int, ...], tuple[int, ...], frozenset[int], tuple[int, ...]]:
    """(the radix tree's eviction order, the hash cache's, the blocks the running requests
    hold, the last block of each unreferenced leaf before any eviction, least recently used
    first)."""
    radix = eviction_scenario("radix")
    held = frozenset(_held_blocks(radix))
    tails = tuple(leaf.block_ids[-1] for leaf in radix.allocator.radix.evictable_leaves())
    order = tuple(_evictions_after(radix))
    hashed = tuple(_evictions_after(eviction_scenario("hash")))
    return order, hashed, held, tails


def _order_if(rule: str) -> tuple[int, ...]:
    """The blocks three allocations would take from a fresh scenario under a mistaken ``rule``:
    "mru" (most recently used leaf first), "first" (a leaf's first block, not its last), "no-parent"
    (a parent never becomes a leaf), "fifo" (the order blocks were first filled)."""
    tree = eviction_scenario("radix").allocator.radix
    held = _ex2_measured()[2]
    leaves = [(leaf.last_access, list(leaf.block_ids)) for leaf in tree.evictable_leaves()]
    if rule == "fifo":
        filled = [b for b in range(EX2_POOL) if b not in held]
        return tuple(filled[:EX2_EVICTIONS])
    if rule == "no-parent":
        leaves.sort()
        return tuple(b for _, blocks in leaves for b in reversed(blocks))[:EX2_EVICTIONS]
    if rule == "mru":
        leaves.sort(reverse=True)
        return tuple(b for _, blocks in leaves for b in reversed(blocks))[:EX2_EVICTIONS]
    if rule == "first":
        order = list(_ex2_measured()[0])
        nodes = {b: list(node.block_ids) for node in tree.nodes() for b in node.block_ids}
        return tuple(nodes[b][0] if len(nodes[b]) > 1 and b == nodes[b][-1] else b for b in order)
    raise ValueError(rule)


def _ex2_mistakes() -> list[tuple[tuple[int, ...], str]]:
    """Whole answers that one misunderstanding of eviction gives, and what to say about each (a
    hint about a whole answer; never which of its blocks is right or wrong)."""
    order, hashed, _, _ = _ex2_measured()
    found = [
        (hashed, "That is a plain LRU queue over blocks, in the order their last holders let them go (what "
                 "the hash cache evicts). The tree evicts leaves only: a block goes only once nothing cached "
                 "continues its prefix. Look at the tree's shape: which nodes are leaves, and when does a "
                 "parent become one?"),
        (_order_if("mru"), "An LRU cache evicts what was used longest ago, not most recently."),
        (_order_if("first"), "Within a node, the later block continues the earlier one: a leaf gives back its "
                             "last block first."),
        (_order_if("no-parent"), "When a leaf's last block goes, its parent may become a leaf itself, with its "
                                 "own last use: it competes with the other leaves from then on."),
        (_order_if("fifo"), "Eviction follows the last use of a node (a match, a publish and a release all "
                            "count), not the order in which blocks were first filled."),
    ]
    return [(answer, hint) for answer, hint in found if answer != order]


def _read_blocks(name: str, value: object) -> list[int]:
    items = read_sequence(name, value, f"{EX2_EVICTIONS} block ids, the first evicted first")
    blocks = [read_count(f"{name}[{k}]", v) for k, v in enumerate(items)]
    if len(blocks) != EX2_EVICTIONS:
        fail(f"{name}: expected {EX2_EVICTIONS} block ids (one per allocation), got {len(blocks)}.")
    if len(set(blocks)) != len(blocks):
        fail(f"{name}: a block appears twice; once evicted and handed out, it is no longer cached.")
    outside = [b for b in blocks if b >= EX2_POOL]
    if outside:
        fail(f"{name}: {outside[0]} is not a block of this pool (ids 0 to {EX2_POOL - 1}).")
    return blocks


@graded("10.2")
def check_eviction_order(evicted: object) -> None:
    """Exercise 10.2: after ``eviction_scenario()`` the pool of 8 blocks has no free block left.
    Three requests each need one new block: give the ids of the three blocks the radix tree
    evicts for them, in order (a list, tuple or array such as ``[x, y, z]``)."""
    order, hashed, held, tails = _ex2_measured()
    blocks = tuple(_read_blocks("evicted", evicted))
    if blocks == order:
        note = ("The hash cache would have evicted the same blocks in the same order here." if hashed == order
                else f"The hash cache's plain LRU queue over blocks would have taken {list(hashed)}: a prefix "
                     "before the cached block that continues it, which then stays in memory, unreachable.")
        passed(f"Exercise 10.2: {order[0]}, then {order[1]}, then {order[2]}: least recently used leaves "
               f"first, never a referenced block, and a parent only once its children are gone. {note}")
        return
    hint = next((h for answer, h in _ex2_mistakes() if answer == blocks), None)
    fail(f"evicted: {list(blocks)} is not right. " + (hint or
         "Take the tree's leaves whose blocks nobody holds, order them by their last use (a match, a publish "
         "and a release all count), give back the least recently used leaf's last block, and look again: the "
         "tree has changed."))


def answer_forms() -> dict[str, list[str]]:
    """For each exercise, the strings that would give its answer away (for the leak scan)."""
    measured = _ex1_measured()
    order = _ex2_measured()[0]
    triples = [", ".join(map(str, order)), ",".join(map(str, order))]
    return {
        "10.1": [str(measured[name]) for name in EX1_CACHES],
        "10.2": [f"[{t}]" for t in triples] + [f"({t})" for t in triples],
    }


__all__ = ["EX1_ANSWER", "EX1_BLOCK_SIZE", "EX1_CACHES", "EX1_FOLLOW_UP", "EX1_MESSAGE", "EX1_SYSTEM",
           "EX2_BLOCK_SIZE", "EX2_EVICTIONS", "EX2_POOL", "Scenario", "chat_prompts", "check_eviction_order",
           "check_follow_up_reuse", "eviction_scenario"]
