"""Graders for chapter 11: speculative decoding on paged KV.

* 11.1: a verify step on the block table: the blocks a sequence holds while its guesses are
  computed, after the rejected ones give their slots back, and the slots given back; measured
  on a real ``BlockAllocator`` and ``BlockTable`` (``verify_blocks``), as the engine's
  ``Speculator.settle`` does it;
* 11.2: the expected-speedup formula of Leviathan et al. (2023): for an acceptance rate ``a``
  (each guess kept with probability ``a``, independently, until the first rejection), ``k``
  guesses per step and a draft that costs ``c`` target steps per guess, the tokens a verifying
  step gives a sequence, ``(1 - a^(k+1)) / (1 - a)``, and the speedup over plain decoding,
  that divided by ``k c + 1`` (``expected_tokens_per_step``, ``expected_speedup``);
* 11.3: the batch size from which speculation stops paying, in the linear cost model fitted to
  this lab's CPU (``LinearCostModel``: a step costs ``fixed_s + per_token_s`` per token it
  computes), found by evaluating the model at every batch size (``crossover_batch``).

The notebook imports the exercises' constants from here, so that the student's numbers and
the grader's are the same.
"""

from __future__ import annotations

import functools

from ._grading import check_exact, check_number, fail, graded, passed, read_count, shown, sig

# ---- the formula -------------------------------------------------------------------------------


def expected_tokens_per_step(a: float, k: int) -> float:
    """Tokens one verifying step gives a sequence, on average, when each of its ``k`` guesses is
    kept with probability ``a`` until the first rejection, plus the step's own token:
    ``1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)``."""
    return float(k + 1) if a == 1 else (1 - a ** (k + 1)) / (1 - a)


def expected_speedup(a: float, k: int, c: float) -> float:
    """Tokens per unit of time against plain decoding: a step with guesses costs the ``k``
    guesses' drafting (``c`` target steps each) plus one target step that verifies them all
    (memory-bound decode: about one step's cost whatever ``k``)."""
    return expected_tokens_per_step(a, k) / (k * c + 1)


# ---- exercise 11.2 --------------------------------------------------------------------------------
EX2_ACCEPTANCE = 0.8      # a
EX2_GUESSES = 4           # k
EX2_DRAFT_COST = 0.1      # c: one guess of the draft costs a tenth of a target step


def ex2_expected() -> dict[str, float]:
    a, k, c = EX2_ACCEPTANCE, EX2_GUESSES, EX2_DRAFT_COST
    return {"tokens_per_step": expected_tokens_per_step(a, k), "speedup": expected_speedup(a, k, c)}


def _ex2_mistakes() -> dict[str, list[tuple[float, str]]]:
    a, k, c = EX2_ACCEPTANCE, EX2_GUESSES, EX2_DRAFT_COST
    e = expected_tokens_per_step(a, k)
    own = ("Count the step's own token too: even when the first guess is rejected, the verifying step "
           "samples a token of its own at that position, so a step always gives at least one.")
    independent = ("A guess is kept only if every guess before it was kept: the first rejection ends the "
                   "step. The j-th guess survives with probability a^j, not a.")
    return {
        "tokens_per_step": [((1 - a ** k) / (1 - a), own), (k * a, own), (1 + k * a, independent),
                            (1 / (1 - a), "The step verifies k guesses, not an endless run of them: the sum "
                                          "stops after the k-th.")],
        "speedup": [(e, "The draft is not free: each of the k guesses costs c of a target step, on top of "
                        "the one target step that verifies them."),
                    (e / (k * c), "The verifying step itself costs one target step: count it beside the "
                                  "k guesses' drafting."),
                    (e / ((k + 1) * c + 1), "Only the k guesses are drafted; the step's own token comes from "
                                            "the target's verifying pass, not from the draft."),
                    ((1 - a ** k) / (1 - a) / (k * c + 1), own), ((1 + k * a) / (k * c + 1), independent)],
    }


@graded("11.2")
def check_speedup_formula(tokens_per_step: object, speedup: object) -> None:
    """Exercise 11.2: for acceptance rate ``EX2_ACCEPTANCE``, ``EX2_GUESSES`` guesses per step and
    a draft cost of ``EX2_DRAFT_COST`` target steps per guess: the expected tokens a verifying
    step gives a sequence, and the expected speedup over plain decoding, to 3 significant figures."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    right, mistakes = ex2_expected(), _ex2_mistakes()
    hints = {"tokens_per_step": "Add up, position by position, the chance that the step gets that far: the "
                                "j-th guess is kept only if all the guesses before it were.",
             "speedup": "Compare tokens per unit of time: what does one step with guesses cost, in target "
                        "steps, and what does it give?"}
    for name, value in (("tokens_per_step", tokens_per_step), ("speedup", speedup)):
        wrong = [(v, h) for v, h in mistakes[name] if sig(v) != sig(right[name])]
        check_number(name, value, right[name], mistakes=wrong, hint=hints[name], ratio=name == "speedup")
    passed(f"{sig(right['tokens_per_step'])} tokens per verifying step where plain decoding gives 1, for "
           f"{sig(EX2_GUESSES * EX2_DRAFT_COST + 1)} steps' cost: a {sig(right['speedup'])}x speedup.")


# ---- exercise 11.1: a verify step on the block table ------------------------------------------------
EX1_BLOCK_SIZE = 4
EX1_TOKENS = 22           # tokens in the sequence; its last one was sampled last step (no K/V yet)
EX1_GUESSES = 8           # guesses prompt lookup makes this step
EX1_ACCEPTED = 2          # guesses the target keeps, before the first it rejects


def verify_blocks(tokens: int = EX1_TOKENS, guesses: int = EX1_GUESSES, accepted: int = EX1_ACCEPTED,
                  block_size: int = EX1_BLOCK_SIZE) -> dict[str, int]:
    """One verify step on a real block table, as ``Speculator.settle`` does it: the sequence's
    ``tokens - 1`` computed tokens hold slots; the step gives slots to its last token and the
    guesses, computes them, and the rejected guesses give theirs back (``BlockTable.truncate``,
    a block left empty goes back to the pool). Returns the blocks held during and after the
    step, and the slots given back."""
    from ..memory import BlockAllocator, BlockTable
    allocator = BlockAllocator(64, block_size)
    table = BlockTable(allocator)
    table.append_tokens(range(tokens - 1), computed=False)
    table.append_tokens(range(1 + guesses), computed=False)       # the step's chunk: last token + guesses
    during, slots_during = table.num_blocks, table.num_tokens
    table.truncate(tokens + accepted)                             # the rejected guesses' slots go back
    after = table.num_blocks
    given_back = slots_during - table.num_tokens
    assert allocator.num_used_blocks == after
    table.free()
    allocator.check_invariants()
    return {"blocks_during": during, "blocks_after": after, "slots_given_back": given_back}


def _ex1_mistakes() -> dict[str, list[tuple[int, str]]]:
    t, k, a, bs = EX1_TOKENS, EX1_GUESSES, EX1_ACCEPTED, EX1_BLOCK_SIZE
    blocks = (lambda n: -(-n // bs))
    last = ("Which tokens get slots in this step? The last sampled token has no K/V yet: it is computed in "
            "this step, with the guesses.")
    new_token = ("The token this step samples gets no slot yet: its K/V is computed in the next step, as every "
                 "sampled token's is.")
    kept = ("What happens to the guesses the target did not agree with? Their K/V was computed, but they are "
            "not part of the text: their slots are given back.")
    return {
        "blocks_during": [(blocks(t - 1 + k), last), (blocks(t + k + 1), new_token),
                          *[(n, "That is before the step: the guesses need slots too, to be computed.")
                            for n in sorted({blocks(t - 1), blocks(t)})]],
        "blocks_after": [(blocks(t + k), kept), (blocks(t + a + 1), new_token),
                         (blocks(t), "The accepted guesses stay: they are now part of the text, with their K/V."),
                         (blocks(t - 1 + a), last)],
        "slots_given_back": [(k - a + 1, "The last sampled token keeps its slot: its K/V was computed in this "
                                         "step, and it is part of the text."),
                             (k, "The accepted guesses keep their slots: only the rejected ones give theirs "
                                 "back."),
                             (a, "Count the guesses that were rejected, not those that were kept."),
                             (0, kept)],
    }


@graded("11.1")
def check_verify_blocks(blocks_during: object, blocks_after: object, slots_given_back: object) -> None:
    """Exercise 11.1: a sequence of ``EX1_TOKENS`` tokens (its last one sampled in the previous
    step), blocks of ``EX1_BLOCK_SIZE``, ``EX1_GUESSES`` guesses of which the first
    ``EX1_ACCEPTED`` are kept: blocks held while the step runs, blocks held after it, slots given back."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    right = verify_blocks()
    mistakes = _ex1_mistakes()
    hints = {"blocks_during": "Count the slots the step's chunk needs, then the blocks that hold them.",
             "blocks_after": "Count the tokens whose K/V the sequence keeps after the step.",
             "slots_given_back": "Which of the slots the step filled hold K/V of tokens that are not in the text?"}
    for name, value in (("blocks_during", blocks_during), ("blocks_after", blocks_after),
                        ("slots_given_back", slots_given_back)):
        if value is None or value is Ellipsis:
            fail(f"{name}: no answer yet ({shown(value)}). Give a whole number.")
        n = read_count(name, value)
        wrong = [(v, h) for v, h in mistakes[name] if v != right[name]]
        check_exact(name, n, right[name], mistakes=wrong, hint=hints[name])
    passed(f"{right['blocks_during']} blocks while the {1 + EX1_GUESSES} tokens are computed, "
           f"{right['blocks_after']} after the {right['slots_given_back']} rejected guesses give their slots back "
           f"({right['blocks_during'] - right['blocks_after']} blocks back to the pool).")


# ---- exercise 11.3: where speculation stops paying ----------------------------------------------------
EX3_ACCEPTANCE = 0.6      # a
EX3_GUESSES = 4           # k
EX3_MAX_BATCH = 256


def _step_time(tokens: int) -> float:
    """A decode step computing ``tokens`` tokens, by the lab's linear CPU cost model, short
    contexts (its attention terms left out): ``fixed_s + per_token_s * tokens``."""
    from ..sim.cost_model import BatchShape, LinearCostModel
    return LinearCostModel().iteration_time(BatchShape(num_decode_tokens=tokens, num_seqs=1))


def batch_speedup(batch: int, a: float = EX3_ACCEPTANCE, k: int = EX3_GUESSES, computed: int | None = None,
                  gained: float | None = None) -> float:
    """Tokens per second with speculation over without, at ``batch`` sequences: each sequence's
    step computes ``computed`` (k + 1) tokens and gains ``gained`` (the expected tokens per step)."""
    computed = k + 1 if computed is None else computed
    gained = expected_tokens_per_step(a, k) if gained is None else gained
    return (batch * gained / _step_time(batch * computed)) / (batch / _step_time(batch))


def _first_not_paying(**variant) -> int | None:
    return next((b for b in range(1, EX3_MAX_BATCH + 1) if batch_speedup(b, **variant) <= 1), None)


@functools.lru_cache(maxsize=None)
def crossover_batch() -> int:
    """The smallest batch size at which speculation is no faster than plain decoding."""
    found = _first_not_paying()
    assert found is not None
    return found


def _ex3_mistakes() -> list[tuple[int, str]]:
    a, k = EX3_ACCEPTANCE, EX3_GUESSES
    out = [(_first_not_paying(computed=k), "A sequence's step computes its k guesses and the last sampled "
                                           "token: k + 1 tokens each, not k."),
           (_first_not_paying(gained=1 + k * a), "A guess is kept only if every guess before it was: the "
                                                 "tokens a step gains are the formula of 11.2, not 1 + k a."),
           (_first_not_paying(gained=(1 - a ** k) / (1 - a)), "Count the step's own token in what it gains: "
                                                              "the formula of 11.2 sums k + 1 terms."),
           (_first_not_paying(gained=k * a), "Count the step's own token in what it gains: a step gives at "
                                             "least one token.")]
    return [(b, h) for b, h in out if b is not None and b != crossover_batch()]


@graded("11.3")
def check_crossover_batch(batch: object) -> None:
    """Exercise 11.3: in the lab's linear cost model (a step costs ``fixed_s + per_token_s`` per
    token it computes), with acceptance rate ``EX3_ACCEPTANCE`` and ``EX3_GUESSES`` guesses per
    sequence, the smallest batch size at which speculation is no faster than plain decoding."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    if batch is None or batch is Ellipsis:
        fail(f"batch: no answer yet ({shown(batch)}). Give a whole number of sequences.")
    b = read_count("batch", batch)
    expected = crossover_batch()
    check_exact("batch", b, expected, mistakes=_ex3_mistakes(),
                hint="Write the tokens per second of a batch of B sequences both ways (a step's time from the "
                     "cost model, the tokens it gives from 11.2's formula) and find where their ratio reaches 1.")
    passed(f"From {expected} sequences on, speculation is no faster: at batch 1 it gives "
           f"{sig(batch_speedup(1))}x, because the fixed cost of a step, which guesses share for free, is a "
           f"smaller and smaller part of a step that already computes a whole batch's tokens.")


# ---- answer forms, for the leak scan ----------------------------------------------------------
def answer_forms() -> dict[str, list[str]]:
    """For each exercise, the strings that would give its answer away (for the leak scan)."""
    one, two, three = ex2_expected(), verify_blocks(), crossover_batch()
    return {
        "11.2": [f"tokens_per_step = {sig(one['tokens_per_step'])}", f"speedup = {sig(one['speedup'])}",
                 f"{sig(one['speedup'])}x"],
        "11.1": [f"{name} = {value}" for name, value in two.items()],
        "11.3": [f"batch = {three}", f"batch size {three}", f"{three} sequences"],
    }
