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

from ._grading import check_close, check_quantity, fail, passed, read_count, read_number

#: Byte units for ``read_quantity`` (base unit: the byte).
BYTE_UNITS: dict[str, float] = {
    "B": 1.0, "bytes": 1.0, "KiB": 1024.0, "MiB": 2.0**20, "GiB": 2.0**30, "TiB": 2.0**40,
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


# ---- chapter 0: the engine you just loaded ------------------------------------------------
def check_kv_capacity(llm, capacity_tokens: object, bytes_per_token: object) -> None:
    """Chapter 0: from ``llm.stats()``, how many tokens the engine's KV cache holds, and how
    many bytes of KV one token takes (bytes of the cache / tokens it holds)."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    from ..model.kv_cache import kv_bytes_per_token
    stats = llm.stats()
    capacity = stats["num_total_blocks"] * stats["block_size"]
    config, dtype = llm.runner.config, llm.runner.dtype
    per_token = kv_bytes_per_token(config, dtype)
    assert stats["kv_cache_bytes"] == capacity * per_token      # the engine agrees with the formula
    cap = read_count("capacity_tokens", capacity_tokens)
    mistakes = [(stats["num_total_blocks"], "That is the number of blocks; each block holds block_size tokens.")]
    if stats["num_free_blocks"] != stats["num_total_blocks"]:
        mistakes.append((stats["num_free_blocks"] * stats["block_size"],
                         "That counts only the free blocks; the question asks for all of them."))
    check_close("capacity_tokens", cap, capacity, rel=0, mistakes=mistakes,
                hint="Tokens the cache holds = number of blocks × tokens per block.")
    x, _, _ = check_quantity("bytes_per_token", bytes_per_token, per_token, units=BYTE_UNITS,
                             default_unit="B", rel=0.01,
                             mistakes=[(stats["kv_cache_bytes"] / stats["num_total_blocks"],
                                        "That is bytes per block; divide by the tokens per block too.")]
                             + _kv_formula_mistakes(config.num_hidden_layers, _kv_heads(config),
                                                    config.num_attention_heads, _head_dim(config),
                                                    _itemsize(dtype), 2 if _itemsize(dtype) == 4 else 4),
                             hint="Bytes per token = kv_cache_bytes / (tokens the cache holds).")
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
EX_70B_FREE_BYTES = 45e9        # 80 GB A100 minus ~35 GB of 4-bit weights (the seed's figures)
SEED_PER_REQUEST_MB = 320       # the seed article's (wrong) figure per 4096-token request
SEED_CONCURRENT = 140           # ... and the concurrency it derives from it


def _llama70b():
    from ..sim.roofline import MODELS
    return MODELS["llama-3-70b"]


def check_kv_bytes_70b(bytes_per_token: object) -> None:
    """Chapter 1: bytes of KV one token takes in Llama-3-70B (80 layers, 8 KV heads of 128
    dims, 64 query heads, bf16). A number of bytes, or a string with a unit ("320 KiB")."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    m = _llama70b()
    expected = m.kv_bytes_per_token
    check_quantity("bytes_per_token", bytes_per_token, expected, units=BYTE_UNITS, default_unit="B",
                   bare_also=("KiB",), rel=0.01,
                   mistakes=_kv_formula_mistakes(m.num_layers, m.num_kv_heads, m.num_heads, m.head_dim,
                                                 m.dtype_bytes, 4),
                   hint="Per token and layer the cache keeps one key and one value vector per KV head: "
                        "2 × layers × KV heads × head dim × bytes per element.")
    passed(f"2 × {m.num_layers} × {m.num_kv_heads} × {m.head_dim} × {m.dtype_bytes} B = {expected:,} B "
           f"= {expected // 1024} KiB per token (without GQA, all {m.num_heads} heads: "
           f"{_human(expected * m.num_heads // m.num_kv_heads)}).")


def check_70b_requests(request_bytes: object, requests_that_fit: object) -> None:
    """Chapter 1: the KV of one 4096-token Llama-3-70B request, and how many such requests
    fit in the 45 GB (45 × 10^9 bytes) left beside 4-bit weights on an 80 GB GPU."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    m = _llama70b()
    per_request = EX_70B_CONTEXT * m.kv_bytes_per_token
    fit = math.floor(EX_70B_FREE_BYTES / per_request)
    fit_gib = math.floor(45 * 2**30 / per_request)
    check_quantity(
        "request_bytes", request_bytes, per_request, units=BYTE_UNITS, default_unit="B",
        bare_also=("GiB", "MiB"), rel=0.02,
        mistakes=[(SEED_PER_REQUEST_MB * 1e6, "That is the seed article's figure, and it is off by 4×: "
                                              "recompute 4096 × the bytes per token yourself."),
                  (SEED_PER_REQUEST_MB * 2**20, "That is the seed article's figure, and it is off by 4×: "
                                                "recompute 4096 × the bytes per token yourself."),
                  (per_request / 2, "That counts only K or only V."),
                  (per_request * 8, "That is bits, not bytes.")],
        hint="One request = context tokens × bytes per token.")
    n = read_number("requests_that_fit", requests_that_fit)
    if n == SEED_CONCURRENT:
        fail(f"requests_that_fit: {SEED_CONCURRENT} is the seed's number, built on its 320 MB figure. "
             "Divide the 45 GB by your own per-request figure.")
    note = ""
    if n == fit_gib and fit_gib != fit:
        note = f" (You read 45 GB as 45 GiB, which gives {fit_gib}; 45 × 10^9 bytes gives {fit}.)"
    else:
        check_close("requests_that_fit", n, fit, rel=0,
                    mistakes=[(math.ceil(EX_70B_FREE_BYTES / per_request),
                               "A request cannot be partly resident: round down."),
                              (EX_70B_FREE_BYTES / per_request, "Whole requests only: round down.")],
                    hint="Requests that fit = floor(free bytes / bytes per request).")
    passed(f"4096 × {m.kv_bytes_per_token // 1024} KiB = {_human(per_request)} per request (not 320 MB); "
           f"45 GB holds {fit} of them, not {SEED_CONCURRENT}: at full context the seed's GPU serves "
           f"~{SEED_CONCURRENT // fit}× fewer requests than it claims.{note}")


# ---- chapter 3: fork and copy-on-write ----------------------------------------------------
EX_FORK_PROMPT = 37
EX_FORK_SAMPLES = 4
EX_FORK_BLOCK = 16


def check_fork_copies(blocks_after: object, copies: object) -> None:
    """Chapter 3: a 37-token prompt (blocks of 16) is forked into 4 samples (the original
    and 3 forks), and each of the 4 then appends one token of its own. How many physical
    blocks are in use afterwards, and how many copy-on-write copies were made?"""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    from .memory import shared_prompt_counts
    c = shared_prompt_counts(EX_FORK_SAMPLES, EX_FORK_PROMPT, EX_FORK_BLOCK)
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
                hint="Blocks in use = the shared blocks + one new block per copy.")
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


def check_prefix_reuse(reused_tokens: object, computed_tokens: object) -> None:
    """Chapter 3: request A (1000-token system prompt + a 50-token question) has finished;
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
                          (-(-s // bs) * bs, f"Block {s // bs} mixes the last {s % bs} system-prompt tokens "
                                             "with the question: its hash differs between A and B, so it is a miss."),
                          (s + q, "The questions differ: their blocks hash differently and are not shared."),
                          (s // bs, "That is the number of blocks; the question asks for tokens.")],
                hint=f"A cached block is reused when its tokens and every token before it match. "
                     f"How many whole blocks of {bs} lie inside the shared {s} tokens?")
    c = read_count("computed_tokens", computed_tokens)
    check_close("computed_tokens", c, computed, rel=0,
                mistakes=[(q, f"The {s % bs} system-prompt tokens of the partial block are recomputed too."),
                          (s + q, "The cached tokens need no compute: only the rest of B's prompt runs.")],
                hint="Computed = B's prompt length - tokens served from the cache.")
    passed(f"{reused // bs} full blocks = {reused} tokens reused, {computed} computed "
           f"({s % bs} system-prompt tokens share a block with the question, and the question itself). "
           f"Compute saved: {reused / (s + q):.0%} of B's prompt.")


# ---- chapter 6: the real model ---------------------------------------------------------------
def check_prefix_savings(llm, shared_prefix_len: int, num_followers: int, predicted_cached: object,
                         measured: Mapping[str, int]) -> None:
    """Chapter 6: after one warm-up request, ``num_followers`` requests share the warm-up's
    first ``shared_prefix_len`` prompt tokens. ``predicted_cached``: how many prompt tokens
    the prefix cache should serve in all. ``measured``: the engine's counter deltas,
    ``{"num_cached_prompt_tokens": ..., "num_prompt_tokens_computed": ...}``."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    bs = llm.stats()["block_size"]
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
                hint=f"Each follower reuses the whole {bs}-token blocks of the shared prefix.")
    got = measured.get("num_cached_prompt_tokens") if isinstance(measured, Mapping) else None
    if got is None:
        fail("measured: pass a dict with the engine's 'num_cached_prompt_tokens' (and "
             "'num_prompt_tokens_computed') for the followers' run.")
    if got != expected:
        fail(f"measured: the engine reports {got} cached prompt tokens, your prediction (right) says "
             f"{expected}. Did the followers run after the warm-up finished (a block enters the cache "
             "only once its KV is computed), with enable_prefix_caching=True, and is the measured "
             "figure the difference of the counter before and after their run?")
    passed(f"{num_followers} × {per_request} = {expected:,} prompt tokens served from the cache, as "
           "measured: that many tokens' K and V were never computed.")


def check_speedup(measured: Mapping[str, Mapping[str, float]], speedup: object) -> None:
    """Chapter 6: ``measured`` maps an engine name to ``{"wall_s", "output_tokens"}``;
    ``speedup`` is labkit's output tokens/s divided by hf-static's."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    try:
        ours, theirs = measured["labkit"], measured["hf-static"]
        tps = ours["output_tokens"] / ours["wall_s"]
        base = theirs["output_tokens"] / theirs["wall_s"]
    except (KeyError, TypeError, ZeroDivisionError):
        fail("measured: expected {'labkit': {'wall_s', 'output_tokens'}, 'hf-static': {...}} "
             "as the measuring cell builds it; run that cell first.")
    if ours["output_tokens"] != theirs["output_tokens"]:
        fail("measured: the two engines produced different numbers of tokens; compare equal work.")
    x = read_number("speedup", speedup)
    check_close("speedup", x, tps / base, rel=0.01,
                mistakes=[(base / tps, "That is hf-static over labkit; the speedup is labkit's rate over hf-static's."),
                          (ours["wall_s"] / theirs["wall_s"], "Same work, so the ratio of rates is the inverse "
                                                             "ratio of times: hf time / labkit time.")],
                hint="speedup = (labkit output tokens / labkit seconds) / (hf output tokens / hf seconds).")
    passed(f"labkit {tps:.1f} tok/s vs hf-static {base:.1f} tok/s: {tps / base:.2f}× on this machine, now.")


def check_batch_iterations(llm, prompt_lens: list[int], max_tokens: int, predicted_steps: object,
                           measured_steps: object) -> None:
    """Chapter 0: prompts of ``prompt_lens`` tokens, submitted together, each generating
    exactly ``max_tokens`` tokens (EOS ignored). How many engine iterations does serving
    them take? ``measured_steps``: the change of ``llm.stats()["num_steps"]``."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    from ..sim import TraceRequest, simulate
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
