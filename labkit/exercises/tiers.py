"""Graders for chapter 13: more tokens per byte (a quantized KV cache) and per tier (a host tier).

* 13.1: bytes per token of Llama-3-8B's KV cache in bf16 and in int8 with one fp32 scale per
  token and KV head (labkit's and vLLM's per-token-head layout), and how many times more tokens
  the same memory holds; computed by ``labkit.model.kv_cache.kv_bytes_per_token``, the function
  that sizes the engine's own cache;
* 13.2: copy or recompute: a 1024-token document of Llama-3-8B (bf16) comes back from host
  memory over PCIe 4.0 x16 (25 GB/s, latency ignored), against prefilling it again on an A100
  (the roofline cost model's time, ``EX2_PREFILL_S``): the copy's time in milliseconds, and the
  link bandwidth at which both take as long;
* 13.3: a loop of documents larger than the KV cache, served one request at a time on the real
  scheduler and block manager (``tier_rounds``): the prompt tokens the second round computes
  with the device cache alone and with a host tier, and the blocks the tier brings back.

The notebook imports the exercises' constants from here, so that the student's numbers and
the grader's are the same.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

from ._grading import check_exact, check_number, check_quantity, fail, graded, passed, read_count, shown, sig

# ---- exercise 13.1: bytes per token, quantized ---------------------------------------------------
EX1_MODEL = "Llama-3-8B"
EX1_LAYERS = 32
EX1_KV_HEADS = 8
EX1_HEAD_DIM = 128
EX1_ATTENTION_HEADS = 32      # query heads: grouped-query attention shares each KV head among 4


def _llama_config(num_kv_heads: int = EX1_KV_HEADS) -> SimpleNamespace:
    return SimpleNamespace(num_hidden_layers=EX1_LAYERS, num_key_value_heads=num_kv_heads,
                           num_attention_heads=EX1_ATTENTION_HEADS, head_dim=EX1_HEAD_DIM,
                           hidden_size=EX1_ATTENTION_HEADS * EX1_HEAD_DIM)


@functools.lru_cache(maxsize=None)
def ex1_expected() -> dict[str, float]:
    """The engine's own sizing function on the model's shape: bf16, and int8 with its scales."""
    import torch

    from ..model.kv_cache import kv_bytes_per_token
    bf16 = kv_bytes_per_token(_llama_config(), torch.bfloat16)
    int8 = kv_bytes_per_token(_llama_config(), torch.int8)
    return {"bf16_bytes": bf16, "int8_bytes": int8, "tokens_ratio": bf16 / int8}


def _ex1_mistakes() -> dict[str, list[tuple[float, str]]]:
    L, H, D, Q = EX1_LAYERS, EX1_KV_HEADS, EX1_HEAD_DIM, EX1_ATTENTION_HEADS
    kv = ("Every layer stores two tensors per token, K and V.")
    heads = ("Only the KV heads are cached: with grouped-query attention several query heads read one KV "
             "head, and the query heads' projections are not kept.")
    scales = ("A quantized number needs its scale to mean anything: count the fp32 scales stored beside the "
              "int8 values (one per token and KV head, for K and for V).")
    scale_size = "A scale is an fp32 number: four bytes."
    per_element = ("The scale is shared by a whole head's row of head_dim numbers; it is not one per number.")
    bits = "Count bytes, not bits."
    bf16 = [(L * H * D * 2, kv), (2 * L * Q * D * 2, heads), (2 * L * H * D * 2 * 8, bits), (2 * L * H * D * 4,
            "bf16 is two bytes per number.")]
    int8 = [(2 * L * H * D, scales), (L * H * (D + 4), kv), (2 * L * Q * (D + 4), heads),
            (2 * L * H * (D + 2), scale_size), (2 * L * H * (D + 1), scale_size), (2 * L * H * D * 5, per_element),
            (2 * L * H * (D + 4) * 8, bits)]
    e = ex1_expected()
    ratio = [(2.0, scales), (1 / e["tokens_ratio"], "More tokens fit where each takes fewer bytes: divide the "
                                                    "bf16 size by the int8 size."),
             (2 * L * H * D * 2 / (2 * L * H * (D + 2)), scale_size), (4.0, "The cache here is bf16, two bytes a "
                                                                          "number, not fp32.")]
    return {"bf16_bytes": bf16, "int8_bytes": int8, "tokens_ratio": ratio}


@graded("13.1")
def check_quantized_bytes(bf16_bytes: object, int8_bytes: object, tokens_ratio: object) -> None:
    """Exercise 13.1: Llama-3-8B (``EX1_LAYERS`` layers, ``EX1_KV_HEADS`` KV heads of
    ``EX1_HEAD_DIM``): KV bytes per token in bf16, in int8 with an fp32 scale per token and KV
    head (K and V each), and how many times more tokens the same memory holds in int8, to 3
    significant figures."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    right, mistakes = ex1_expected(), _ex1_mistakes()
    hints = {"bf16_bytes": "Count what one token leaves in every layer: which tensors, how many heads of how "
                           "many numbers, how many bytes each.",
             "int8_bytes": "Count the int8 numbers as in bf16, then what else a quantized cache must store for "
                           "each token to read them back.",
             "tokens_ratio": "The same bytes hold as many tokens as each token's size divides into them."}
    for name, value in (("bf16_bytes", bf16_bytes), ("int8_bytes", int8_bytes)):
        if value is None or value is Ellipsis:
            fail(f"{name}: no answer yet ({shown(value)}). Give a whole number of bytes.")
        n = read_count(name, value)
        wrong = [(v, h) for v, h in mistakes[name] if v != right[name]]
        check_exact(name, n, right[name], mistakes=wrong, hint=hints[name])
    wrong = [(v, h) for v, h in mistakes["tokens_ratio"] if sig(v) != sig(right["tokens_ratio"])]
    check_number("tokens_ratio", tokens_ratio, right["tokens_ratio"], mistakes=wrong,
                 hint=hints["tokens_ratio"], ratio=True)
    passed(f"{right['bf16_bytes']:,} bytes a token in bf16, {right['int8_bytes']:,} in int8 with its scales: "
           f"{sig(right['tokens_ratio'])}x the tokens in the same memory (the scales keep it under 2x).")


# ---- exercise 13.2: copy it back, or compute it again ----------------------------------------------
EX2_TOKENS = 1024                # the document (its answers sit far from a rounding boundary)
TIME_UNITS = {"s": 1.0, "ms": 1e-3}
EX2_LINK_GBPS = 25.0             # PCIe 4.0 x16, one direction, GB/s (10^9 bytes a second)
EX2_HARDWARE = "a100-80gb"


@functools.lru_cache(maxsize=None)
def ex2_prefill_s() -> float:
    """Seconds to prefill the document on the A100, by the roofline cost model (one sequence)."""
    from ..sim.cost_model import BatchShape
    from ..sim.roofline import RooflineCostModel
    n = EX2_TOKENS
    cost = RooflineCostModel("llama-3-8b", EX2_HARDWARE)
    return cost.iteration_time(BatchShape(num_prefill_tokens=n, num_seqs=1, prefill_context_tokens=n * (n + 1) // 2))


def ex2_expected() -> dict[str, float]:
    nbytes = EX2_TOKENS * ex1_expected()["bf16_bytes"]
    return {"load_ms": nbytes / (EX2_LINK_GBPS * 1e9) * 1e3, "break_even_gbps": nbytes / ex2_prefill_s() / 1e9}


def _ex2_mistakes() -> dict[str, list[tuple[float, str]]]:
    e = ex2_expected()
    per_token = ex1_expected()["bf16_bytes"]
    gib = ("The link's GB are 10^9 bytes, not 2^30.")
    bits = "Bandwidth here is in bytes a second (GB/s), not bits."
    what = ("Which bytes cross the link: the document's K and V for every layer, in the cache's dtype (bf16).")
    load = [(e["load_ms"] * 2**30 / 1e9, gib), (e["load_ms"] * 1e9 / 2**30, gib), (e["load_ms"] * 8, bits),
            (e["load_ms"] / 2, what), (e["load_ms"] * 2, what),
            (e["load_ms"] / EX1_LAYERS, what), (e["load_ms"] * ex1_expected()["int8_bytes"] / per_token, what)]
    load = [(ms / 1e3, hint) for ms, hint in load]          # in seconds, the unit check_quantity compares in
    even = [(e["break_even_gbps"] * 1e9 / 2**30, gib), (e["break_even_gbps"] * 8, bits),
            (ex2_prefill_s() * 1e3 / e["load_ms"], "The break-even point is a bandwidth: the bytes to move over "
                                                    "the time recomputing takes."),
            (e["break_even_gbps"] / 2, what), (e["break_even_gbps"] * 2, what)]
    return {"load_ms": load, "break_even_gbps": even}


@graded("13.2")
def check_copy_or_recompute(load_ms: object, break_even_gbps: object) -> None:
    """Exercise 13.2: an ``EX2_TOKENS``-token document of Llama-3-8B, cached in bf16: milliseconds
    to copy its KV back over a ``EX2_LINK_GBPS`` GB/s link (latency ignored), and the link
    bandwidth in GB/s at which the copy takes as long as prefilling it again
    (``EX2_PREFILL_S`` seconds), each to 3 significant figures."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    right, mistakes = ex2_expected(), _ex2_mistakes()
    hints = {"load_ms": "Time is bytes over bandwidth: how many bytes does the document's cache take?",
             "break_even_gbps": "At the break-even point the copy's time equals the prefill's: which bandwidth "
                                "moves the document's bytes in exactly that time?"}
    load_s = right["load_ms"] / 1e3
    wrong = [(v, h) for v, h in mistakes["load_ms"] if sig(v) != sig(load_s)]
    check_quantity("load_ms", load_ms, load_s, units=TIME_UNITS, default_unit="ms", mistakes=wrong,
                   hint=hints["load_ms"])       # a bare number is in ms; "5.37 ms" or "0.00537 s" too
    wrong = [(v, h) for v, h in mistakes["break_even_gbps"] if sig(v) != sig(right["break_even_gbps"])]
    check_number("break_even_gbps", break_even_gbps, right["break_even_gbps"], mistakes=wrong,
                 hint=hints["break_even_gbps"])
    passed(f"{sig(right['load_ms'])} ms to copy the document back against {sig(ex2_prefill_s() * 1e3)} ms to "
           f"recompute it: copying wins on any link faster than {sig(right['break_even_gbps'])} GB/s, and PCIe "
           f"carries {sig(EX2_LINK_GBPS)}.")


# ---- exercise 13.3: a loop larger than the cache ------------------------------------------------------
EX3_BLOCK_SIZE = 4
EX3_DOC_TOKENS = 12              # three full blocks
EX3_DOCS = 3
EX3_POOL = 8                     # device blocks: fewer than the documents take, with a request running
EX3_TIER = 16                    # host tier blocks: room for every document


def ex3_prompts() -> list[list[int]]:
    """Round 1 asks each document a question (one token), round 2 another, in the same order."""
    docs = [[100 * (i + 1) + j for j in range(EX3_DOC_TOKENS)] for i in range(EX3_DOCS)]
    return [doc + [900 + q] for q in range(2) for doc in docs]


def tier_rounds(offload_blocks: int) -> dict[str, int]:
    """Serve ``ex3_prompts`` one request at a time (one output token each) on the real scheduler
    and block manager (hash prefix cache, ``EX3_POOL`` blocks), with a host tier of
    ``offload_blocks`` blocks (0: none). Returns the prompt tokens computed per round, and the
    blocks the tier brought back."""
    from ..engine import Engine
    from ..memory import BlockAllocator
    from ..sampling_params import SamplingParams
    from ..scheduler import make_scheduler
    from ..sim import SimExecutor

    allocator = BlockAllocator(EX3_POOL, EX3_BLOCK_SIZE, "hash")
    sched = make_scheduler("continuous", allocator, max_num_seqs=1, max_num_batched_tokens=256, watermark=0.0,
                           num_offload_blocks=offload_blocks)
    engine = Engine(sched, SimExecutor(vocab_size=1000), keep_records=False)
    computed = []
    prompts = ex3_prompts()
    for start in (0, EX3_DOCS):
        before = sched.num_prompt_tokens_computed
        for prompt in prompts[start:start + EX3_DOCS]:
            engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
            while engine.has_unfinished:
                engine.step()
        computed.append(sched.num_prompt_tokens_computed - before)
    assert allocator.num_used_blocks == 0
    return {"round1": computed[0], "round2": computed[1],
            "host_hits": sched.tier_stats().get("num_host_cache_hits", 0)}


@functools.lru_cache(maxsize=None)
def ex3_expected() -> dict[str, int]:
    alone, tiered = tier_rounds(0), tier_rounds(EX3_TIER)
    return {"computed_device_only": alone["round2"], "computed_with_tier": tiered["round2"],
            "host_hits": tiered["host_hits"]}


def _ex3_mistakes() -> dict[str, list[tuple[int, str]]]:
    prompt = EX3_DOC_TOKENS + 1
    blocks = EX3_DOC_TOKENS // EX3_BLOCK_SIZE
    everything, questions = EX3_DOCS * prompt, EX3_DOCS
    lru = ("Play the pool through both rounds, request by request: a finished request's full blocks stay cached, "
           "released tail first; an admission takes free blocks first and only then evicts the least recently "
           "released cached block. Part of a document may survive where the rest of it did not.")
    last = "A prompt's last token is always computed (its logits give the next token): it is never a cache hit."
    return {
        "computed_device_only": [(questions, lru), (everything, lru), (0, last),
                                 (everything - (EX3_DOCS - 1) * EX3_DOC_TOKENS, lru)],
        "computed_with_tier": [(0, last), (everything, "The tier keeps what the device evicts: a document found "
                                                       "there is copied back, not computed."),
                               (questions + EX3_DOC_TOKENS, lru)],
        "host_hits": [(EX3_DOCS * blocks, "A document the device still caches is found there first: the tier "
                                          "is asked only for the blocks the device misses."),
                      (EX3_DOCS * (blocks + 1), "Only full blocks are cached; the block holding the question "
                                                "token is computed."),
                      (0, "The tier is asked for the blocks the device cache misses.")],
    }


@graded("13.3")
def check_tier_rounds(computed_device_only: object, computed_with_tier: object, host_hits: object) -> None:
    """Exercise 13.3: ``EX3_DOCS`` documents of ``EX3_DOC_TOKENS`` tokens (blocks of
    ``EX3_BLOCK_SIZE``), a device pool of ``EX3_POOL`` blocks with the hash prefix cache, one
    request at a time, two rounds of one-token questions: the prompt tokens round 2 computes
    with the device cache alone, and with a host tier of ``EX3_TIER`` blocks, and the blocks the
    tier copies back."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    right, mistakes = ex3_expected(), _ex3_mistakes()
    hints = {"computed_device_only": "Follow the pool's blocks request by request: which cached blocks are still "
                                     "there when each document comes back?",
             "computed_with_tier": "Follow the evicted blocks too: where are they when their document comes back?",
             "host_hits": "Count the blocks that round 2 finds in the host tier, not on the device."}
    for name, value in (("computed_device_only", computed_device_only), ("computed_with_tier", computed_with_tier),
                        ("host_hits", host_hits)):
        if value is None or value is Ellipsis:
            fail(f"{name}: no answer yet ({shown(value)}). Give a whole number.")
        n = read_count(name, value)
        wrong = [(v, h) for v, h in mistakes[name] if v != right[name]]
        check_exact(name, n, right[name], mistakes=wrong, hint=hints[name])
    passed(f"Round 2 computes {right['computed_device_only']} prompt tokens with the device cache alone and "
           f"{right['computed_with_tier']} with the tier, which copies {right['host_hits']} blocks back: a loop "
           "larger than the cache defeats LRU (it evicts what comes back soonest), and the tier turns those "
           "evictions into hits.")


# ---- answer forms, for the leak scan ----------------------------------------------------------
def answer_forms() -> dict[str, list[str]]:
    """For each exercise, the strings that would give its answer away (for the leak scan)."""
    one, two, three = ex1_expected(), ex2_expected(), ex3_expected()
    return {
        "13.1": [f"bf16_bytes = {one['bf16_bytes']}", f"int8_bytes = {one['int8_bytes']}",
                 f"tokens_ratio = {sig(one['tokens_ratio'])}", f"{sig(one['tokens_ratio'])}x"],
        "13.2": [f"load_ms = {sig(two['load_ms'])}", f"break_even_gbps = {sig(two['break_even_gbps'])}",
                 f"{sig(two['break_even_gbps'])} GB/s"],
        "13.3": [f"{name} = {value}" for name, value in three.items()],
    }
