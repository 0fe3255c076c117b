"""Graders for the engine's memory arithmetic and the real model (chapters 0, 1, 3 and 6).

* chapter 0: the KV cache of the running engine (capacity, bytes per token), read off
  ``llm.stats()`` and the model's config;
* chapter 1: the KV footprint of a large model (Llama-3-70B) and what fits beside it;
* chapter 3: how much of a prompt automatic prefix caching reuses, on a real allocator;
* chapter 6: prefix caching and throughput measured on the real model.

Expected values come from labkit: ``labkit.model.kv_cache.kv_bytes_per_token`` on the
model's config, the roofline model's ``ModelSpec`` for Llama-3-70B, a real
``BlockAllocator`` with prefix caching, the simulator running the engine's own scheduler
settings, and the student's own measurements. The graders that take the engine (0.1, 0.2,
6.2) read only its configuration numbers (``engine_facts``), never its state: a verdict does
not change with what the engine served before.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Mapping

from ._grading import (check_exact, check_number, check_quantity, fail, fmt, graded, number_forms,
                       passed, quantity_forms, read_count, read_number, sig)

#: Byte units for ``read_quantity`` (base unit: the byte).
BYTE_UNITS: dict[str, float] = {
    "B": 1.0, "bytes": 1.0, "byte": 1.0, "KiB": 1024.0, "MiB": 2.0**20, "GiB": 2.0**30, "TiB": 2.0**40,
    "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
}


def _human(nbytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{sig(nbytes / size)} {unit}"
    return f"{nbytes:,.0f} B"


def _kv_formula_mistakes(layers: int, kv_heads: int, heads: int, head_dim: int, itemsize: int,
                         other_itemsize: int) -> list[tuple[float, str]]:
    right = 2 * layers * kv_heads * head_dim * itemsize
    return [
        (right / 2, "Every token stores a key AND a value vector per layer: count both."),
        (right * heads / kv_heads, f"That uses all {heads} query heads. With grouped-query attention "
                                   f"only the {kv_heads} KV heads are cached (num_key_value_heads)."),
        (right / layers, f"Every one of the {layers} layers keeps its own K and V."),
        (right / itemsize, "That counts elements, not bytes: what does one element take?"),
        (right * 8, "That counts bits, not bytes."),
        (right * other_itemsize / itemsize, f"Check the dtype: {itemsize} bytes per element here."),
    ]


#: The engine's configuration numbers the chapter 0 and 6 graders read (``engine_facts``).
ENGINE_FACTS = ("num_total_blocks", "block_size", "kv_cache_bytes", "num_hidden_layers", "num_key_value_heads",
                "num_attention_heads", "head_dim", "dtype_bytes", "max_num_seqs", "max_num_batched_tokens",
                "max_model_len")


def engine_facts(llm) -> dict[str, int]:
    """The configuration of the engine ``llm`` (an ``LLM``) as plain numbers: its KV pool, its
    model's shape and its scheduler's limits. Nothing in it changes while the engine serves."""
    if not callable(getattr(llm, "stats", None)) or not hasattr(llm, "scheduler") or not hasattr(llm, "runner"):
        fail(f"llm: pass the engine you loaded (llm = LLM(...)), not {type(llm).__name__} {llm!r:.60}.")
    import torch
    stats, config, sched = llm.stats(), llm.runner.config, llm.scheduler
    return {
        "num_total_blocks": int(stats["num_total_blocks"]), "block_size": int(stats["block_size"]),
        "kv_cache_bytes": int(stats["kv_cache_bytes"]),
        "num_hidden_layers": int(config.num_hidden_layers),
        "num_key_value_heads": int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
        "num_attention_heads": int(config.num_attention_heads),
        "head_dim": int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads),
        "dtype_bytes": int(torch.empty((), dtype=llm.runner.dtype).element_size()),
        "max_num_seqs": int(sched.max_num_seqs), "max_num_batched_tokens": int(sched.max_num_batched_tokens),
        "max_model_len": int(sched.max_model_len),
    }


def _facts(llm: object) -> dict[str, int]:
    """``engine_facts`` as the grader receives them, checked: every number present and positive."""
    if not isinstance(llm, Mapping):
        fail(f"llm: pass the engine you loaded (llm = LLM(...)), not {type(llm).__name__} {llm!r:.60}.")
    missing = [k for k in ENGINE_FACTS if not isinstance(llm.get(k), numbers.Integral) or llm[k] <= 0]
    if missing:
        fail(f"llm: pass the engine you loaded (llm = LLM(...)); these facts about it are missing: "
             f"{', '.join(missing)}.")
    return {k: int(llm[k]) for k in ENGINE_FACTS}


# ---- chapter 0: the engine you just loaded ------------------------------------------------
@graded("0.1", plain={"llm": engine_facts})
def check_kv_capacity(llm, capacity_tokens: object, bytes_per_token: object) -> None:
    """Exercise 0.1: from ``llm.stats()``, how many tokens the engine's KV cache holds (a count),
    and how many bytes of KV one token takes (3 significant figures: a number of bytes, or a
    string with a unit)."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    f = _facts(llm)
    capacity = f["num_total_blocks"] * f["block_size"]
    per_token = (2 * f["num_hidden_layers"] * f["num_key_value_heads"] * f["head_dim"] * f["dtype_bytes"])
    if f["kv_cache_bytes"] != capacity * per_token:    # the engine must agree with the formula
        raise RuntimeError(f"the engine reports {f['kv_cache_bytes']} KV bytes for {capacity} "
                           f"tokens of {per_token} bytes: a bug in labkit, not in your answer")
    cap = read_count("capacity_tokens", capacity_tokens)
    check_exact("capacity_tokens", cap, capacity,
                mistakes=[(f["num_total_blocks"], "That is the number of blocks; how many tokens does each hold?")],
                hint="Which counters give the cache's size in blocks, and the size of one block?")
    check_quantity("bytes_per_token", bytes_per_token, per_token, units=BYTE_UNITS, default_unit="B",
                   mistakes=[(f["kv_cache_bytes"] / f["num_total_blocks"],
                              "That is bytes per block: a block holds several tokens.")]
                   + _kv_formula_mistakes(f["num_hidden_layers"], f["num_key_value_heads"],
                                          f["num_attention_heads"], f["head_dim"], f["dtype_bytes"],
                                          2 if f["dtype_bytes"] == 4 else 4),
                   hint="How many bytes does the cache take in all, and how many tokens does it hold?")
    passed(f"{capacity:,} tokens of KV ({f['num_total_blocks']:,} blocks × {f['block_size']}); "
           f"{per_token:,} bytes = {_human(per_token)} per token = 2 (K and V) × "
           f"{f['num_hidden_layers']} layers × {f['num_key_value_heads']} KV heads × {f['head_dim']} dims × "
           f"{f['dtype_bytes']} bytes.")


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
    dims, 64 query heads, bf16), to 3 significant figures: a number of bytes, or a string with a
    unit ("... KiB")."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    m = _llama70b()
    expected = m.kv_bytes_per_token
    check_quantity("bytes_per_token", bytes_per_token, expected, units=BYTE_UNITS, default_unit="B",
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
    fit in the 45 GB (45 × 10^9 bytes) left beside 4-bit weights on an 80 GB GPU: bytes to 3
    significant figures (or a string with a unit), requests as a count."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    m = _llama70b()
    per_request = EX_70B_CONTEXT * m.kv_bytes_per_token
    fit = math.floor(EX_70B_FREE_BYTES / per_request)
    lesson_mistake = "That is the lesson's figure: work it out from your own bytes per token."
    check_quantity(
        "request_bytes", request_bytes, per_request, units=BYTE_UNITS, default_unit="B",
        mistakes=[(LESSON_PER_REQUEST_MB * 1e6, lesson_mistake),
                  (LESSON_PER_REQUEST_MB * 2**20, lesson_mistake),
                  (per_request / 2, "Every token stores a key AND a value vector per layer: count both."),
                  (per_request * 8, "That counts bits, not bytes.")],
        hint="How many tokens does the request hold, and what does each one cost?")
    n = read_number("requests_that_fit", requests_that_fit)
    if n == LESSON_CONCURRENT:
        fail(f"requests_that_fit: {LESSON_CONCURRENT} is the lesson's number, built on its 320 MB figure. "
             "Use your own per-request figure.")
    if not n.is_integer():
        fail(f"requests_that_fit: {fmt(n)} requests? A request's KV cannot be partly resident: "
             "count whole requests.")
    gib_reading = 45 * 2**30 / per_request
    check_exact("requests_that_fit", read_count("requests_that_fit", n), fit,
                mistakes=[(math.ceil(EX_70B_FREE_BYTES / per_request),
                           "A request cannot be partly resident: whole requests only, and none may overflow."),
                          (math.floor(gib_reading), "You read 45 GB as 45 GiB: GB are 10^9 bytes, GiB 2^30 bytes; "
                                                    "the exercise gives 45 × 10^9 bytes.")],
                hint="How many whole requests' KV fit in the memory left for the cache? (A request is resident "
                     "in full or not at all.)")
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
    check_exact("copies", k, c.copies,
                mistakes=[(n, "The last sample to write finds its block held by nobody else any more "
                              "(reference count 1): it writes in place, no copy."),
                          (0, f"The last block holds {p % bs} tokens and has free slots: the first "
                              "append into it would change what the others see, so it is copied first."),
                          (n * (full + 1), "Only the block being written is copied; full blocks are "
                                           "never written again and stay shared.")],
                hint="Which block does each append write into, and who else holds it at that moment?")
    b = read_count("blocks_after", blocks_after)
    check_exact("blocks_after", b, c.blocks_diverged,
                mistakes=[(n * c.blocks_per_session, "That is without sharing: the full blocks stay shared."),
                          (c.blocks_shared, "That is before the samples diverge: what does a copy-on-write add?"),
                          (c.blocks_shared + n, "Does every sample copy? Think of the last one to write: who "
                                                "else holds its block then?")],
                hint="Which blocks are still shared by all four, and what did each copy add?")
    passed(f"{p} tokens = {full} full blocks + 1 block holding {p % bs}: {c.blocks_shared} blocks shared by "
           f"{n} samples; the first {c.copies} to append copy the partial block, the last writes in "
           f"place: {c.blocks_diverged} blocks (without sharing: {n * c.blocks_per_session}).")


# ---- chapter 3: automatic prefix caching ---------------------------------------------------
EX_PREFIX_SYSTEM = 1000
EX_PREFIX_QUESTION = 50
EX_PREFIX_BLOCK = 16


@functools.lru_cache(maxsize=None)
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
    check_exact("reused_tokens", r, reused,
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
    check_exact("computed_tokens", c, computed,
                mistakes=[(q, "The system-prompt tokens that share a block with the question are "
                              "recomputed too."),
                          (s + q, "The cached tokens need no compute: only the rest of B's prompt runs.")],
                hint="Every token of B's prompt is either served from the cache or computed.")
    passed(f"{reused // bs} full blocks = {reused} tokens reused, {computed} computed "
           f"({s % bs} system-prompt tokens share a block with the question, and the question itself). "
           f"Compute saved: {reused / (s + q):.0%} of B's prompt.")


# ---- chapter 6: the real model ---------------------------------------------------------------
@graded("6.2", plain={"llm": engine_facts})
def check_prefix_savings(llm, shared_prefix_len: int, num_followers: int, predicted_cached: object,
                         measured: Mapping[str, int]) -> None:
    """Exercise 6.2: after one warm-up request on an empty prefix cache, ``num_followers``
    requests share the warm-up's first ``shared_prefix_len`` prompt tokens. ``predicted_cached``:
    how many prompt tokens the prefix cache should serve them in all (a count). ``measured``: the
    engine's counter changes over the followers' call,
    ``{"num_cached_prompt_tokens": ..., "num_prompt_tokens_computed": ...}``."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    bs = _facts(llm)["block_size"]
    shared_prefix_len, num_followers = read_count("shared_prefix_len", shared_prefix_len), read_count(
        "num_followers", num_followers)
    per_request = (shared_prefix_len // bs) * bs
    expected = num_followers * per_request
    p = read_count("predicted_cached", predicted_cached)
    check_exact("predicted_cached", p, expected,
                mistakes=[(num_followers * shared_prefix_len,
                           f"Only full blocks of {bs} tokens are cached: does the shared prefix end on a block "
                           "boundary?"),
                          ((num_followers + 1) * per_request,
                           "The warm-up request found an empty cache: it computed everything."),
                          (per_request, f"That is one request's share; {num_followers} requests each reuse it."),
                          (num_followers * (-(-shared_prefix_len // bs)) * bs,
                           "The block that mixes shared and private tokens differs between requests: a miss.")],
                hint="Which of a follower's blocks can the cache serve, and how many followers are there?")
    got = measured.get("num_cached_prompt_tokens") if isinstance(measured, Mapping) else None
    if got is None:
        fail("measured: pass a dict with the engine's 'num_cached_prompt_tokens' (and "
             "'num_prompt_tokens_computed') changes over the followers' call.")
    got = read_count("measured['num_cached_prompt_tokens']", got)
    if got > expected:
        fail(f"measured: the followers found {got:,} prompt tokens cached, more than the warm-up alone can "
             "leave (your prediction, which is right). Something else had cached their prompts already: "
             "a run of this cell or of a later one. Start the measurement from an empty cache "
             "(llm.reset_prefix_cache()), then run the warm-up, then the followers.")
    if got < expected:
        fail(f"measured: the followers found only {got:,} prompt tokens cached, fewer than your (right) "
             "prediction. Did the warm-up finish before the followers started (a block enters the cache "
             "only once its K and V are computed), with enable_prefix_caching on, and is the measured figure "
             "the change of the counter over the followers' call alone?")
    passed(f"{num_followers} × {per_request} = {expected:,} prompt tokens served from the cache, as "
           "measured: that many tokens' K and V were never computed.")


@graded("6.1")
def check_speedup(measured: Mapping[str, Mapping[str, float]], speedup: object) -> None:
    """Exercise 6.1: ``measured`` maps an engine name to ``{"wall_s", "output_tokens"}``;
    ``speedup`` is labkit's output tokens/s divided by hf-static's, to 3 significant figures."""
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
    ratio = tps / base
    check_number("speedup", speedup, ratio, ratio=True,
                 mistakes=[(1 / ratio, "That is hf-static over labkit; the speedup is labkit's rate over "
                                       "hf-static's."),
                           (ratio - 1, "That is how much faster, not how many times as fast: a speedup is a "
                                       "ratio of the two rates."),
                           (100 * (ratio - 1), "That is the gain in percent; a speedup is a ratio of the two "
                                               "rates.")],
                 hint="Compare the two engines' output rates (tokens per second), labkit's over hf-static's.")
    passed(f"labkit {sig(tps)} tok/s vs hf-static {sig(base)} tok/s: {sig(ratio)}× on this machine, now.")


@graded("0.2", plain={"llm": engine_facts})
def check_batch_iterations(llm, prompt_lens: list[int], max_tokens: int, predicted_steps: object,
                           measured_steps: object) -> None:
    """Exercise 0.2: prompts of ``prompt_lens`` tokens, submitted together, each generating
    exactly ``max_tokens`` tokens (EOS ignored). How many engine iterations does serving
    them take (a count)? ``measured_steps``: the change of ``llm.stats()["num_steps"]``.
    The expected count comes from the engine's scheduler settings, simulated."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    f = _facts(llm)
    lens = [read_count("prompt_lens", n) for n in prompt_lens]
    max_tokens = read_count("max_tokens", max_tokens)
    expected = _iterations(tuple(lens), max_tokens, tuple(sorted(f.items())))
    k = len(lens)
    p = read_count("predicted_steps", predicted_steps)
    check_exact("predicted_steps", p, expected,
                mistakes=[(k * max_tokens, f"That would be one request at a time. Continuous batching runs "
                                           f"all {k} in the same iterations: one token each per iteration."),
                          (k * (max_tokens - 1) + 1, "All prompts are prefilled together, and the decodes "
                                                     "run together too.")],
                hint="Each iteration gives every running request one new token, and the first one (the prefill, "
                     "which computes the prompts) already samples each request's first token.")
    m = read_count("measured_steps", measured_steps)
    if m != expected:
        fail(f"measured_steps: {m:,} does not match your prediction, which is right. Measure the change of "
             "llm.stats()['num_steps'] over the generate call alone: read it just before and just after.")
    passed(f"{expected} iterations for {k} × {max_tokens} = {k * max_tokens} tokens: the first iteration "
           f"prefills all {k} prompts and samples their first tokens, each later one decodes a token "
           "for every request at once.")


@functools.lru_cache(maxsize=64)
def _iterations(prompt_lens: tuple[int, ...], max_tokens: int, facts: tuple) -> int:
    """Iterations the engine of ``facts`` takes to serve the prompts together: the same scheduler,
    with the simulator's executor in place of the model."""
    from ..sim import TraceRequest, simulate
    f = dict(facts)
    sim = simulate([TraceRequest(n, max_tokens) for n in prompt_lens], num_blocks=f["num_total_blocks"],
                   block_size=f["block_size"], max_num_seqs=f["max_num_seqs"],
                   max_num_batched_tokens=f["max_num_batched_tokens"], max_model_len=f["max_model_len"],
                   keep_records=False)
    return sim.engine.num_steps


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
