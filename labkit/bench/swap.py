"""``python -m labkit.bench swap``: preemption by swapping against recomputation, by block size.

The PagedAttention paper (section 7.3, Figure 19) compares the two ways of preempting a
sequence: *swapping* its KV blocks to host memory and back over PCIe, or *recomputing*
them (a prefill of its tokens) when it resumes. It measures (a) the time each takes to
move or rebuild the same KV, by block size (8 to 256 tokens): swapping pays for many small
transfers when blocks are small, recomputation does not depend on the block size; and
(b) end-to-end, the normalized latency (seconds per output token, averaged over requests)
of a ShareGPT trace served under memory pressure in each mode.

Three parts, each a JSON object under its name with ``--json``:

* ``micro``: Figure 19a from the cost models: swap-out, swap-in and recompute time of
  ``--tokens`` tokens of KV, per block size (roofline model on ``--hardware``, whose
  host link is PCIe 4.0 x16 on A100s, 5.0 x16 on H100/H200; vLLM v0's per-layer copies);
* ``sim``: Figure 19b in the simulator: the real scheduler serves one ShareGPT-like trace
  with a KV pool of ``--kv-tokens`` tokens, once per mode and block size. Besides the
  normalized latency, each row gives the mode's *overhead*: the seconds of swap copies
  (swap), or the tokens recomputed times the cost model's marginal prefill cost per token
  (recompute), and that overhead as a share of the run;
* ``real``: the same comparison measured on the real engine (``--real-model``), block
  sizes 8 to 128, a short workload and a pool small enough to force preemptions; wall
  time, the measured seconds in swap copies, and the tokens recomputed. It also checks
  that both modes give the same greedy tokens.

Examples::

    python -m labkit.bench swap --json
    python -m labkit.bench swap --parts micro,sim --model llama-3-8b --hardware h100-sxm
    python -m labkit.bench swap --parts real --real-model tiny-llama --granularity layer
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ..utils import cdiv

PARTS = ("micro", "sim", "real")
RUN_TIME = "about 3 min on 2 cores"   # all three parts with the defaults, measured: python -m labkit.bench swap


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit.bench swap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="micro,sim,real", help=f"comma-separated, from {PARTS}")
    p.add_argument("--block-sizes", default="8,16,32,64,128,256", help="micro and sim block sizes")
    p.add_argument("--model", default="llama-2-13b",
                   help="roofline model preset (micro, sim); the default has multi-head attention and "
                        "800 KiB of KV per token, like the paper's OPT-13B")
    p.add_argument("--hardware", default="a100-80gb", help="roofline hardware preset (micro, sim)")
    p.add_argument("--tokens", type=int, default=1024, help="micro: tokens of KV moved or recomputed")
    p.add_argument("--num-requests", type=int, default=200, help="sim: ShareGPT-like requests")
    p.add_argument("--rate", type=float, default=8.0, help="sim: Poisson arrivals, requests/s")
    p.add_argument("--kv-tokens", type=int, default=8192,
                   help="sim: KV pool in tokens (num_blocks = kv_tokens / block_size); small, to force preemption")
    p.add_argument("--swap-tokens", type=int, default=None,
                   help="sim: host pool in tokens (default: 4 x --kv-tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--real-model", default="smollm2-135m", help="real: the model served")
    p.add_argument("--real-block-sizes", default="8,16,32,64,128")
    p.add_argument("--real-prompts", type=int, default=8, help="real: prompts in the workload")
    p.add_argument("--real-max-tokens", type=int, default=32, help="real: tokens generated per prompt")
    p.add_argument("--real-kv-tokens", type=int, default=256,
                   help="real: KV pool in tokens, small enough to force preemptions")
    p.add_argument("--granularity", default="gather", choices=("gather", "layer"),
                   help="real: labkit's gathered copy, or vLLM v0's copy per block per layer")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


# ---- (a) Figure 19a from the cost models ---------------------------------------------
def micro(model: str, hardware: str, tokens: int, block_sizes: list[int]) -> dict:
    """Time to swap ``tokens`` tokens of KV out and in, per block size, against the time to
    recompute them (one prefill chunk of that many tokens), on a roofline model."""
    from ..sim.roofline import roofline

    cost = roofline(model, hardware)
    link = cost.swap_link
    recompute = cost.prefill_time(tokens)
    rows = []
    for bs in block_sizes:
        blocks = cdiv(tokens, bs)
        out = link.copy_time(blocks, bs)
        rows.append({"block_size": bs, "swap_out_ms": 1e3 * out, "swap_in_ms": 1e3 * out,
                     "swap_in_out_ms": 2e3 * out, "recompute_ms": 1e3 * recompute,
                     "effective_link_GBps": link.effective_bandwidth(bs) / 1e9})
    return {"model": cost.model.name, "hardware": cost.hardware.name, "host_link": link.name,
            "link_GBps": link.bandwidth / 1e9, "link_latency_us": link.latency_s * 1e6,
            "transfers_per_block": link.transfers_per_block, "tokens": tokens, "rows": rows}


# ---- (b) Figure 19b in the simulator -------------------------------------------------
def simulated(model: str, hardware: str, block_sizes: list[int], num_requests: int, rate: float,
              kv_tokens: int, swap_tokens: int, seed: int) -> dict:
    """One ShareGPT-like trace, served by the real scheduler under each mode and block size."""
    from ..sim import simulate, synthetic_trace
    from ..sim.roofline import roofline

    cost = roofline(model, hardware)
    trace = synthetic_trace("sharegpt", num_requests, rate=rate, seed=seed, max_len=2048)
    # A recomputed token costs what one more prompt token costs a prefill: the marginal
    # cost, from the cost model (it rides in batches with other work, so not the whole prefill).
    per_token = (cost.prefill_time(2048) - cost.prefill_time(1024)) / 1024
    rows = []
    for bs in block_sizes:
        for mode in ("recompute", "swap"):
            res = simulate(trace, "continuous", block_size=bs, num_blocks=max(1, kv_tokens // bs),
                           max_num_seqs=256, max_num_batched_tokens=max(2048, bs), cost_model=cost,
                           preemption_mode=mode, num_host_blocks=max(1, swap_tokens // bs),
                           keep_records=False)
            m = res.metrics
            overhead = m["swap_time_s"] if mode == "swap" else m["recomputed_tokens"] * per_token
            rows.append({"block_size": bs, "mode": mode, "normalized_latency_s": m["normalized_latency_s"],
                         "makespan_s": m["makespan_s"], "num_preemptions": m["num_preemptions"],
                         "num_swap_outs": m["num_swap_outs"], "num_swap_fallbacks": m["num_swap_fallbacks"],
                         "swap_time_s": m["swap_time_s"], "recomputed_tokens": m["recomputed_tokens"],
                         "overhead_s": overhead,
                         "overhead_share": overhead / m["makespan_s"] if m["makespan_s"] else 0.0,
                         "leaked_blocks": m["leaked_blocks"] + m["leaked_host_blocks"]})
    return {"model": cost.model.name, "hardware": cost.hardware.name, "host_link": cost.swap_link.name,
            "trace": f"sharegpt x{num_requests} at {rate} req/s (seed {seed})", "kv_tokens": kv_tokens,
            "swap_tokens": swap_tokens, "recompute_s_per_token": per_token, "rows": rows}


# ---- the real engine, measured --------------------------------------------------------
def measured(model: str, block_sizes: list[int], num_prompts: int, max_tokens: int, kv_tokens: int,
             granularity: str) -> dict:
    """The real engine under each mode and block size: wall time, seconds in swap copies
    (measured around the copies), tokens recomputed, blocks of either pool still held at the
    end (``leaked_blocks``, as the simulated part reports); the greedy tokens of both modes
    must agree (they are returned as ``same_tokens``)."""
    from .. import LLM, SamplingParams

    prompts = [f"Question {i}: explain in a few sentences why the sky is blue, then why sunsets are red."
               if i % 2 == 0 else f"Story {i}: once upon a time, in a small village by the sea, there lived"
               for i in range(num_prompts)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for bs in block_sizes:
        tokens_by_mode = {}
        for mode in ("recompute", "swap"):
            llm = LLM(model, block_size=bs, num_blocks=max(1, cdiv(kv_tokens, bs)), preemption_mode=mode,
                      num_host_blocks=max(1, cdiv(4 * kv_tokens, bs)), enable_prefix_caching=False)
            llm.engine.executor.swap_granularity = granularity
            llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm up
            before = llm.stats()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            refused = [o.error for o in outs if o.error]
            if refused:
                raise ValueError(f"block size {bs}: the pool of {kv_tokens} KV tokens refuses a request "
                                 f"({refused[0]}); raise --real-kv-tokens")
            s = llm.stats()
            sched = llm.engine.scheduler           # every request done: nothing may hold a block
            host = sched.host_allocator
            leaked = sched.allocator.num_used_blocks + (host.num_used_blocks if host is not None else 0)
            prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
            tokens_by_mode[mode] = [o.outputs[0].token_ids for o in outs]
            rows.append({"block_size": bs, "mode": mode, "wall_s": wall,
                         "swap_s": s["swap_s"] - before["swap_s"],
                         "num_preemptions": s["num_preemptions"] - before["num_preemptions"],
                         "num_swapped_blocks": s["num_swapped_blocks_out"] + s["num_swapped_blocks_in"]
                         - before["num_swapped_blocks_out"] - before["num_swapped_blocks_in"],
                         "recomputed_tokens": s["num_prompt_tokens_computed"] - before["num_prompt_tokens_computed"]
                         - prompt_tokens,
                         "normalized_latency_s": sum(o.metrics.finished_time - o.metrics.arrival_time
                                                     for o in outs) / (len(outs) * max_tokens),
                         "leaked_blocks": leaked})
        rows[-1]["same_tokens"] = rows[-2]["same_tokens"] = tokens_by_mode["recompute"] == tokens_by_mode["swap"]
    return {"model": model, "granularity": granularity, "prompts": num_prompts, "max_tokens": max_tokens,
            "kv_tokens": kv_tokens, "rows": rows}


def _table(title: str, rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = [title, "  ".join(f"{k:>14}" for k in keys)]
    for r in rows:
        lines.append("  ".join(f"{r[k]:>14.4g}" if isinstance(r[k], float) else f"{r[k]!s:>14}" for k in keys))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    bad = [x for x in parts if x not in PARTS]
    if bad:
        print(f"unknown part(s) {bad}; choose from {PARTS}", file=sys.stderr)
        return 2
    sizes = _ints(args.block_sizes)
    out = {}
    print(f"swap: {', '.join(parts)} ({RUN_TIME} with the defaults)", file=sys.stderr, flush=True)
    try:
        if "micro" in parts:
            out["micro"] = micro(args.model, args.hardware, args.tokens, sizes)
        if "sim" in parts:
            swap_tokens = args.swap_tokens if args.swap_tokens is not None else 4 * args.kv_tokens
            out["sim"] = simulated(args.model, args.hardware, sizes, args.num_requests, args.rate,
                                   args.kv_tokens, swap_tokens, args.seed)
        if "real" in parts:
            out["real"] = measured(args.real_model, _ints(args.real_block_sizes), args.real_prompts,
                                   args.real_max_tokens, args.real_kv_tokens, args.granularity)
    except ValueError as e:
        print(f"swap: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
        return 0
    for name, part in out.items():
        head = {k: v for k, v in part.items() if k != "rows"}
        print(_table(f"== {name}: {json.dumps(head)}", part["rows"]), end="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
