"""Graders for the engine's memory arithmetic and the real model (chapters 0, 1, 3 and 6).

* chapter 0: the KV cache of the running engine (capacity, bytes per token), read off
  ``llm.stats()`` and the model's config;
* chapter 1: the KV footprint of a large model (Llama-3-70B) and what fits beside it;
* chapter 3: how much of a prompt automatic prefix caching reuses, on a real allocator;
* chapter 6: prefix caching and throughput measured on the real model.

Expected values come from labkit: ``labkit.model.kv_cache.kv_bytes_per_token`` on the
model's config, the roofline model's ``ModelSpec`` for Llama-3-70B, a real
``BlockAllocator`` with prefix caching, and the engine's own counters.
"""

from __future__ import annotations

import math
from typing import Mapping

from ._grading import (check_close, check_quantity, fail, fmt, graded, number_forms, passed, quantity_forms,
                       read_count, read_number, read_ratio)

#: Byte units for ``read_quantity`` (base unit: the byte).
BYTE_UNITS: dict[str, float] = {
    "B": 1.0, "bytes": 1.0, "byte": 1.0, "KiB": 1024.0, "MiB": 2.0**20, "GiB": 2.0**30, "TiB": 2.0**40,
    "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
}


def _human(nbytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:,.4g} {unit}"
    return f"{nbytes:,.0f} B"


def _kv_formula_mistakes(layers: int, kv_heads: int, heads: int, head_dim: int, itemsize: int,
                         other_itemsize: int) -> list[tuple[float, str]]:
    right = 2 * layers * kv_heads * head_dim * itemsize
    return [
        (right / 2, "That is K or V alone: every token stores a key AND a value vector per layer (×2)."),
        (right * heads / kv_heads, f"That uses all {heads} query heads. With grouped-query attention "
                                   f"only the {kv_heads} KV heads are cached (num_key_value_heads)."),
        (right / layers, f"That is one layer's worth: every one of the {layers} layers keeps its own K and V."),
        (right / itemsize, "That counts elements, not bytes: multiply by the bytes per element."),
        (right * 8, "That is bits: divide by 8 (or multiply elements by bytes, not bits)."),
        (right * other_itemsize / itemsize, f"Check the dtype: {itemsize} bytes per element here."),
    ]


def _engine_stats(llm) -> dict:
    """``llm.stats()``, or a failure that says which object the grader needs."""
    stats = getattr(llm, "stats", None)
    if not callable(stats) or not hasattr(llm, "scheduler"):
        fail(f"llm: pass the engine you loaded (llm = LLM(...)), not {type(llm).__name__} {llm!r:.60}.")
    return stats()


# ---- chapter 0: the engine you just loaded ------------------------------------------------
@graded("0.1")
def check_kv_capacity(llm, capacity_tokens: object, bytes_per_token: object) -> None:
    """Exercise 0.1: from ``llm.stats()``, how many tokens the engine's KV cache holds, and
    how many bytes of KV one token takes (a number of bytes, or a string with a unit)."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    from ..model.kv_cache import kv_bytes_per_token
    stats = _engine_stats(llm)
    capacity = stats["num_total_blocks"] * stats["block_size"]
    config, dtype = llm.runner.config, llm.runner.dtype
    per_token = kv_bytes_per_token(config, dtype)
    if stats["kv_cache_bytes"] != capacity * per_token:    # the engine must agree with the formula
        raise RuntimeError(f"the engine reports {stats['kv_cache_bytes']} KV bytes for {capacity} "
                           f"tokens of {per_token} bytes: a bug in labkit, not in your answer")
    cap = read_count("capacity_tokens", capacity_tokens)
    mistakes = [(stats["num_total_blocks"], "That is the number of blocks; each block holds block_size tokens.")]
    if stats["num_free_blocks"] != stats["num_total_blocks"]:
        mistakes.append((stats["num_free_blocks"] * stats["block_size"],
                         "That counts only the free blocks; the question asks for all of them."))
    check_close("capacity_tokens", cap, capacity, rel=0, mistakes=mistakes,
                hint="Which counters give the cache's size in blocks, and the size of one block?")
    check_quantity("bytes_per_token", bytes_per_token, per_token, units=BYTE_UNITS,
                             default_unit="B", rel=0.01,
                             mistakes=[(stats["kv_cache_bytes"] / stats["num_total_blocks"],
                                        "That is bytes per block; divide by the tokens per block too.")]
                             + _kv_formula_mistakes(config.num_hidden_layers, _kv_heads(config),
                                                    config.num_attention_heads, _head_dim(config),
                                                    _itemsize(dtype), 2 if _itemsize(dtype) == 4 else 4),
                             hint="How many bytes does the cache take in all, and how many tokens "
                                  "does it hold?")
    passed(f"{capacity:,} tokens of KV ({stats['num_total_blocks']:,} blocks × {stats['block_size']}); "
           f"{per_token:,} bytes = {_human(per_token)} per token = 2 (K and V) × "
           f"{config.num_hidden_layers} layers × {_kv_heads(config)} KV heads × {_head_dim(config)} dims × "
           f"{_itemsize(dtype)} bytes.")


def _kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _itemsize(dtype) -> int:
    import torch
    return torch.empty((), dtype=dtype).element_size()


# ---- chapter 1: Llama-3-70B -------------------------------------------------------------
EX_70B_CONTEXT = 4096
EX_70B_FREE_BYTES = 45e9        # 80 GB A100 minus ~35 GB of 4-bit weights (the lesson's figures)
#: The PagedAttention lesson ("PagedAttention and continuous batching") says a 4096-token
#: Llama-3-70B request takes ~320 MB of KV (it is off by 4×) ...
LESSON_PER_REQUEST_MB = 320
LESSON_CONCURRENT = 140         # ... and that 140 such requests fit in 45 GB


def _llama70b():
    from ..sim.roofline import MODELS
    return MODELS["llama-3-70b"]


@graded("1.1")
def check_kv_bytes_70b(bytes_per_token: object) -> None:
    """Exercise 1.1: bytes of KV one token takes in Llama-3-70B (80 layers, 8 KV heads of 128
    dims, 64 query heads, bf16): a number of bytes, or a string with a unit ("... KiB")."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    m = _llama70b()
    expected = m.kv_bytes_per_token
    check_quantity("bytes_per_token", bytes_per_token, expected, units=BYTE_UNITS, default_unit="B",
                   rel=0.01,
                   mistakes=_kv_formula_mistakes(m.num_layers, m.num_kv_heads, m.num_heads, m.head_dim,
                                                 m.dtype_bytes, 4),
                   hint="Go through section 1's reasoning with Llama-3-70B's config: what does each "
                        "token leave behind, in every layer, for every KV head?")
    passed(f"2 × {m.num_layers} × {m.num_kv_heads} × {m.head_dim} × {m.dtype_bytes} B = {expected:,} B "
           f"= {expected // 1024} KiB per token (without GQA, all {m.num_heads} heads: "
           f"{_human(expected * m.num_heads // m.num_kv_heads)}).")


@graded("1.2")
def check_70b_requests(request_bytes: object, requests_that_fit: object) -> None:
    """Exercise 1.2: the KV of one 4096-token Llama-3-70B request, and how many such requests
    fit in the 45 GB (45 × 10^9 bytes) left beside 4-bit weights on an 80 GB GPU."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    m = _llama70b()
    per_request = EX_70B_CONTEXT * m.kv_bytes_per_token
    fit = math.floor(EX_70B_FREE_BYTES / per_request)
    lesson_mistake = ("That is the lesson's figure, and it is off by 4×: work it out from your own "
                      "bytes per token.")
    check_quantity(
        "request_bytes", request_bytes, per_request, units=BYTE_UNITS, default_unit="B", rel=0.02,
        mistakes=[(LESSON_PER_REQUEST_MB * 1e6, lesson_mistake),
                  (LESSON_PER_REQUEST_MB * 2**20, lesson_mistake),
                  (per_request / 2, "That counts only K or only V."),
                  (per_request * 8, "That is bits, not bytes.")],
        hint="How many tokens does the request hold, and what does each one cost?")
    n = read_number("requests_that_fit", requests_that_fit)
    if n == LESSON_CONCURRENT:
        fail(f"requests_that_fit: {LESSON_CONCURRENT} is the lesson's number, built on its 320 MB figure. "
             "Use your own per-request figure.")
    if not n.is_integer():
        fail(f"requests_that_fit: {fmt(n)} requests? A request's KV cannot be partly resident: "
             "count whole requests.")
    gib_reading = 45 * 2**30 / per_request
    check_close("requests_that_fit", read_count("requests_that_fit", n), fit, rel=0,
                mistakes=[(math.ceil(EX_70B_FREE_BYTES / per_request),
                           "A request cannot be partly resident: whole requests only, and none may overflow."),
                          (math.floor(gib_reading), "You read 45 GB as 45 GiB: GB are 10^9 bytes, GiB 2^30 bytes; "
                                                    "the exercise gives 45 × 10^9 bytes.")],
                hint="How many whole requests' KV fit in the memory left for the cache?")
    passed(f"4096 × {m.kv_bytes_per_token // 1024} KiB = {_human(per_request)} per request (not 320 MB); "
           f"45 GB holds {fit} of them, not {LESSON_CONCURRENT}: at full context the lesson's GPU serves "
           f"~{LESSON_CONCURRENT // fit}× fewer requests than it claims.")


# ---- chapter 3: fork and copy-on-write ----------------------------------------------------
EX_FORK_PROMPT = 37
EX_FORK_SAMPLES = 4
EX_FORK_BLOCK = 16


def _fork_expected():
    from .memory import shared_prompt_counts
    return shared_prompt_counts(EX_FORK_SAMPLES, EX_FORK_PROMPT, EX_FORK_BLOCK)


@graded("3.1")
def check_fork_copies(blocks_after: object, copies: object) -> None:
    """Exercise 3.1: a 37-token prompt (blocks of 16) is forked into 4 samples (the original
    and 3 forks), and each of the 4 then appends one token of its own. How many physical
    blocks are in use afterwards, and how many copy-on-write copies were made?"""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    c = _fork_expected()
    n, p, bs = EX_FORK_SAMPLES, EX_FORK_PROMPT, EX_FORK_BLOCK
    full = p // bs
    k = read_count("copies", copies)
    check_close("copies", k, c.copies, rel=0,
                mistakes=[(n, "The last sample to write finds its block held by nobody else any more "
                              "(reference count 1): it writes in place, no copy."),
                          (0, f"The last block holds {p % bs} tokens and has free slots: the first "
                              "append into it would change what the others see, so it is copied first."),
                          (n * (full + 1), "Only the block being written is copied; full blocks are "
                                           "never written again and stay shared.")],
                hint="Which block does each append write into, and who else holds it at that moment?")
    b = read_count("blocks_after", blocks_after)
    check_close("blocks_after", b, c.blocks_diverged, rel=0,
                mistakes=[(n * c.blocks_per_session, "That is without sharing: the full blocks stay shared."),
                          (c.blocks_shared, "That is before the samples diverge: each copy-on-write adds a block."),
                          (c.blocks_shared + n, "One sample writes into the original block in place.")],
                hint="Which blocks are still shared by all four, and what did each copy add?")
    passed(f"{p} tokens = {full} full blocks + 1 block holding {p % bs}: {c.blocks_shared} blocks shared by "
           f"{n} samples; the first {c.copies} to append copy the partial block, the last writes in "
           f"place: {c.blocks_diverged} blocks (without sharing: {n * c.blocks_per_session}).")


# ---- chapter 3: automatic prefix caching ---------------------------------------------------
EX_PREFIX_SYSTEM = 1000
EX_PREFIX_QUESTION = 50
EX_PREFIX_BLOCK = 16


def prefix_reuse_expected(system: int = EX_PREFIX_SYSTEM, question: int = EX_PREFIX_QUESTION,
                          block_size: int = EX_PREFIX_BLOCK) -> tuple[int, int]:
    """Serve request A, then B (same system prompt, another question) on a real allocator
    with prefix caching: (tokens of B served from the cache, tokens of B to compute)."""
    from ..memory import BlockAllocator, BlockTable
    alloc = BlockAllocator(2 * (system + question) // block_size + 4, block_size, enable_prefix_caching=True)
    shared = list(range(1000, 1000 + system))
    a_tokens = shared + list(range(50_000, 50_000 + question))
    b_tokens = shared + list(range(60_000, 60_000 + question))
    a = BlockTable(alloc)
    a.append_tokens(a_tokens)             # computed: its full blocks enter the cache
    a.free()                              # A finished; its blocks stay cached-free
    b = BlockTable(alloc)
    reused = b.reuse_cached_prefix(b_tokens, len(b_tokens) - 1)
    b.free()
    alloc.check_invariants()
    return reused, len(b_tokens) - reused


@graded("3.2")
def check_prefix_reuse(reused_tokens: object, computed_tokens: object) -> None:
    """Exercise 3.2: request A (1000-token system prompt + a 50-token question) has finished;
    request B brings the same system prompt and another 50-token question. Blocks of 16,
    prefix caching on. How many of B's tokens come from the cache, and how many must be
    computed?"""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    reused, computed = prefix_reuse_expected()
    s, q, bs = EX_PREFIX_SYSTEM, EX_PREFIX_QUESTION, EX_PREFIX_BLOCK
    r = read_count("reused_tokens", reused_tokens)
    check_close("reused_tokens", r, reused, rel=0,
                mistakes=[(s, f"Only full blocks are cached and matched. {s} is not a multiple of {bs}: "
                              f"the block holding token {s - 1} also holds the start of the question."),
                          (-(-s // bs) * bs, "The block that holds the end of the system prompt also holds "
                                             "the start of the question: its hash differs between A and B, so "
                                             "it is a miss."),
                          (s + q, "The questions differ: their blocks hash differently and are not shared."),
                          (s // bs, "That is the number of blocks; the question asks for tokens.")],
                hint="A cached block is reused when its tokens and every token before it match. "
                     "Which of B's blocks lie entirely inside the shared system prompt?")
    c = read_count("computed_tokens", computed_tokens)
    check_close("computed_tokens", c, computed, rel=0,
                mistakes=[(q, "The system-prompt tokens that share a block with the question are "
                              "recomputed too."),
                          (s + q, "The cached tokens need no compute: only the rest of B's prompt runs.")],
                hint="Every token of B's prompt is either served from the cache or computed.")
    passed(f"{reused // bs} full blocks = {reused} tokens reused, {computed} computed "
           f"({s % bs} system-prompt tokens share a block with the question, and the question itself). "
           f"Compute saved: {reused / (s + q):.0%} of B's prompt.")


# ---- chapter 6: the real model ---------------------------------------------------------------
@graded("6.2")
def check_prefix_savings(llm, shared_prefix_len: int, num_followers: int, predicted_cached: object,
                         measured: Mapping[str, int]) -> None:
    """Exercise 6.2: after one warm-up request, ``num_followers`` requests share the warm-up's
    first ``shared_prefix_len`` prompt tokens. ``predicted_cached``: how many prompt tokens
    the prefix cache should serve in all. ``measured``: the engine's counter deltas,
    ``{"num_cached_prompt_tokens": ..., "num_prompt_tokens_computed": ...}``."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    bs = _engine_stats(llm)["block_size"]
    per_request = (shared_prefix_len // bs) * bs
    expected = num_followers * per_request
    p = read_count("predicted_cached", predicted_cached)
    check_close("predicted_cached", p, expected, rel=0,
                mistakes=[(num_followers * shared_prefix_len,
                           f"Only full blocks of {bs} tokens are cached: round the shared prefix down."),
                          ((num_followers + 1) * per_request,
                           "The warm-up request found an empty cache: it computed everything."),
                          (per_request, f"That is one request's share; {num_followers} requests each reuse it."),
                          (num_followers * (-(-shared_prefix_len // bs)) * bs,
                           "The block that mixes shared and private tokens differs between requests: a miss.")],
                hint="Which of a follower's blocks can the cache serve, and how many followers are there?")
    got = measured.get("num_cached_prompt_tokens") if isinstance(measured, Mapping) else None
    if got is None:
        fail("measured: pass a dict with the engine's 'num_cached_prompt_tokens' (and "
             "'num_prompt_tokens_computed') for the followers' run.")
    got = read_count("measured['num_cached_prompt_tokens']", got)
    if got != expected:
        fail(f"measured: the engine reports {got} cached prompt tokens, your prediction (right) says "
             f"{expected}. Did the followers run after the warm-up finished (a block enters the cache "
             "only once its KV is computed), with enable_prefix_caching=True, and is the measured "
             "figure the difference of the counter before and after their run?")
    passed(f"{num_followers} × {per_request} = {expected:,} prompt tokens served from the cache, as "
           "measured: that many tokens' K and V were never computed.")


@graded("6.1")
def check_speedup(measured: Mapping[str, Mapping[str, float]], speedup: object) -> None:
    """Exercise 6.1: ``measured`` maps an engine name to ``{"wall_s", "output_tokens"}``;
    ``speedup`` is labkit's output tokens/s divided by hf-static's."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    try:
        ours, theirs = measured["labkit"], measured["hf-static"]
        tps = float(ours["output_tokens"]) / float(ours["wall_s"])
        base = float(theirs["output_tokens"]) / float(theirs["wall_s"])
        if not (math.isfinite(tps) and math.isfinite(base) and tps > 0 and base > 0):
            raise ValueError("rates must be positive")
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        fail("measured: expected {'labkit': {'wall_s', 'output_tokens'}, 'hf-static': {...}} "
             "as the measuring cell builds it; run that cell first.")
    if ours["output_tokens"] != theirs["output_tokens"]:
        fail("measured: the two engines produced different numbers of tokens; compare equal work.")
    x = read_ratio("speedup", speedup)
    check_close("speedup", x, tps / base, rel=0.01,
                mistakes=[(base / tps, "That is hf-static over labkit; the speedup is labkit's rate over hf-static's."),
                          (ours["wall_s"] / theirs["wall_s"], "Same work, so the ratio of rates is the inverse "
                                                             "ratio of times: hf time / labkit time.")],
                hint="Compare the two engines' output rates (tokens per second), labkit's over hf-static's.")
    passed(f"labkit {tps:.1f} tok/s vs hf-static {base:.1f} tok/s: {tps / base:.2f}× on this machine, now.")


@graded("0.2")
def check_batch_iterations(llm, prompt_lens: list[int], max_tokens: int, predicted_steps: object,
                           measured_steps: object) -> None:
    """Exercise 0.2: prompts of ``prompt_lens`` tokens, submitted together, each generating
    exactly ``max_tokens`` tokens (EOS ignored). How many engine iterations does serving
    them take? ``measured_steps``: the change of ``llm.stats()["num_steps"]``."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    from ..sim import TraceRequest, simulate
    _engine_stats(llm)
    sched = llm.scheduler
    trace = [TraceRequest(n, max_tokens) for n in prompt_lens]
    sim = simulate(trace, num_blocks=sched.allocator.num_blocks, block_size=sched.block_size,
                   max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
                   max_model_len=sched.max_model_len, keep_records=False)
    expected = sim.engine.num_steps           # the same scheduler, with the simulator's executor
    k = len(prompt_lens)
    p = read_count("predicted_steps", predicted_steps)
    check_close("predicted_steps", p, expected, rel=0,
                mistakes=[(k * max_tokens, f"That would be one request at a time. Continuous batching runs "
                                           f"all {k} in the same iterations: one token each per iteration."),
                          (max_tokens + 1, "The iteration that computes a prompt (prefill) also samples its "
                                           "first token: there is no separate prefill step here."),
                          (k * (max_tokens - 1) + 1, "All prompts are prefilled together, and the decodes "
                                                     "run together too.")],
                hint="Each iteration gives every running request one new token.")
    m = read_count("measured_steps", measured_steps)
    if m != expected:
        fail(f"measured_steps: {m}, but serving these prompts takes {expected} iterations. Take the "
             "difference of llm.stats()['num_steps'] just before and just after the generate call.")
    passed(f"{expected} iterations for {k} × {max_tokens} = {k * max_tokens} tokens: the first iteration "
           f"prefills all {k} prompts and samples their first tokens, each later one decodes a token "
           "for every request at once.")


def answer_forms() -> dict[str, list[str]]:
    """For each exercise, the strings that would give its answer away (for the leak scan):
    the values in the forms the graders accept, and for answers that depend on the machine
    (the engine's size, a timing) the key expression."""
    m = _llama70b()
    per_token, per_request = m.kv_bytes_per_token, EX_70B_CONTEXT * m.kv_bytes_per_token
    fit = math.floor(EX_70B_FREE_BYTES / per_request)
    fork = _fork_expected()
    reused, computed = prefix_reuse_expected()
    formula = [2, m.num_layers, m.num_kv_heads, m.head_dim, m.dtype_bytes]
    return {
        "0.1": ['stats["num_total_blocks"] * stats["block_size"]',
                "stats['num_total_blocks'] * stats['block_size']",
                'stats["kv_cache_bytes"] / capacity_tokens'],
        "0.2": ["predicted_steps = params.max_tokens", "predicted_steps = 16", "16 iterations, not"],
        "1.1": (number_forms(per_token) + quantity_forms(per_token, BYTE_UNITS, ["KiB"])
                + [sep.join(str(f) for f in formula) for sep in (" * ", "*", " × ", "×")]),
        "1.2": (number_forms(per_request) + quantity_forms(per_request, BYTE_UNITS, ["GiB", "MiB"])
                + [f"{fit} requests", f"{fit} of them", f"floor(45e9 / {per_request})"]),
        "3.1": [f"{fork.copies} copies", f"{fork.blocks_diverged} blocks in use",
                f"{fork.blocks_diverged} physical blocks"],
        "3.2": [f"{reused} tokens", f"{reused} of", f"{computed} tokens", f"{reused} reused",
                f"{computed} computed"],
        "6.1": ['rate["labkit"] / rate["hf-static"]'],
        "6.2": ["(shared_prefix_len // block_size) * block_size",
                "num_followers * (shared_prefix_len // "],
    }
