"""``python -m labkit.bench tiers``: reuse larger than the KV cache, with no prefix cache, the
device cache only, and the device cache plus a host tier, in one run on the real engine.

The workload is a set of shared documents, each asked several questions, in rounds: every
document once per round, one request at a time (a class reading a reading list, a
retrieval app over a few long files). A document comes back only after all the others
have passed through the KV cache, which is sized (``--num-blocks``) to hold about half of
them: the device cache alone has evicted a document before it is asked again, and a host
tier (``--offload-blocks``, every document's blocks by default) still holds it.

Reported per configuration (``none``, ``device``, ``device+host``):

* ``device_hit``, ``host_hit``: full prompt blocks found per lookup, in each tier (the host is
  asked only about blocks the device missed);
* ``prefill_tokens``: prompt tokens computed; ``saved``: the share of prompt tokens not computed;
* ``ttft_mean_s``, ``ttft_p50_s``, ``ttft_p99_s``: time to first token, wall clock (one request
  at a time, so it is the prefill, plus the copies back from the host);
* ``offloaded_mib``, ``loaded_mib``: bytes copied device -> host and host -> device;
* ``equal``: whether every greedy output equals the first configuration's (``none``, unless
  ``--configs`` says otherwise).

On a CPU both pools are host memory, so the copies are memcpy; the counters and the
mechanism are the ones a GPU server runs. The last table models a GPU with the roofline
cost model: prefilling one document against copying its blocks back over PCIe.

Examples::

    python -m labkit.bench tiers
    python -m labkit.bench tiers --docs 6 --doc-tokens 512 --questions 2 --json
    python -m labkit.bench tiers --model tiny-llama --docs 4 --doc-tokens 64 --block-size 4
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from ..utils import percentile
from . import table_header, table_line

CONFIGS = ("none", "device", "device+host")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit.bench tiers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="the model served (tiny-llama: fast, random weights)")
    p.add_argument("--docs", type=int, default=8, help="shared documents (default 8)")
    p.add_argument("--doc-tokens", type=int, default=768, help="tokens per document (default 768)")
    p.add_argument("--questions", type=int, default=3, help="questions per document: rounds (default 3)")
    p.add_argument("--question-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="device KV blocks (default: about half the documents' blocks, plus one request's room)")
    p.add_argument("--offload-blocks", type=int, default=None,
                   help="host tier blocks (default: every document's blocks)")
    p.add_argument("--policy", default="hash", choices=("hash", "radix"), help="the device prefix cache")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def workload(vocab: int, args) -> list[list[int]]:
    """The prompts, in serving order: round r asks every document its r-th question."""
    rng = random.Random(args.seed)
    docs = [[rng.randrange(3, vocab) for _ in range(args.doc_tokens)] for _ in range(args.docs)]
    return [doc + [rng.randrange(3, vocab) for _ in range(args.question_tokens)]
            for _ in range(args.questions) for doc in docs]


def sizes(args) -> tuple[int, int]:
    """(device blocks, host tier blocks) for the workload."""
    per_doc = -(-args.doc_tokens // args.block_size)
    room = -(-(args.doc_tokens + args.question_tokens + args.max_tokens) // args.block_size) + 1
    device = args.num_blocks or max(room, (args.docs // 2) * per_doc + room)
    host = args.offload_blocks or args.docs * per_doc
    return device, host


def run_config(config: str, prompts: list[list[int]], args) -> tuple[dict, list[list[int]]]:
    from ..llm import LLM
    from ..sampling_params import SamplingParams

    device, host = sizes(args)
    llm = LLM(args.model, block_size=args.block_size, num_blocks=device, max_num_seqs=1, watermark=0.0,
              enable_prefix_caching=False if config == "none" else args.policy,
              num_offload_blocks=host if config == "device+host" else None)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    outputs, ttft = [], []
    start = time.perf_counter()
    for prompt in prompts:              # one request at a time: its TTFT is its own prefill
        t0 = time.perf_counter()
        stream = llm.generate_stream([prompt], params)
        first = next(stream)
        ttft.append(time.perf_counter() - t0)
        last = first
        for last in stream:
            pass
        outputs.append(list(last.outputs[0].token_ids))
    wall = time.perf_counter() - start
    s = llm.stats()
    prompt_tokens = sum(map(len, prompts))
    mib = 2 ** 20
    row = {
        "config": config,
        "device_hit": s["prefix_cache_hit_rate"],
        "host_hit": s.get("host_cache_hit_rate", 0.0),
        "prefill_tokens": s["num_prompt_tokens_computed"],
        "saved": 1 - s["num_prompt_tokens_computed"] / prompt_tokens,
        "ttft_mean_s": statistics.fmean(ttft), "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "wall_s": wall,
        "offloaded_mib": s.get("kv_offloaded_bytes", 0) / mib, "loaded_mib": s.get("kv_loaded_bytes", 0) / mib,
        "device_blocks": device, "host_blocks": host if config == "device+host" else 0,
        "host_hits": s.get("num_host_cache_hits", 0), "host_evictions": s.get("num_host_evictions", 0),
        "copy_s": s["swap_s"],
    }
    return row, outputs


def gpu_model(args) -> list[dict]:
    """What the same trade is on GPUs (roofline model, labkit's gathered copies: one transfer
    per tensor per step): prefilling one document against copying its blocks back."""
    from ..sim.cost_model import BatchShape, SwapLink
    from ..sim.roofline import HOST_LINKS, RooflineCostModel

    rows = []
    n = args.doc_tokens
    for model, hardware in (("llama-3-8b", "a100-80gb"), ("llama-3-8b", "h100-sxm"), ("llama-3-70b", "h100-sxm")):
        cost = RooflineCostModel(model, hardware)
        prefill = cost.iteration_time(BatchShape(num_prefill_tokens=n, num_seqs=1,
                                                 prefill_context_tokens=n * (n + 1) // 2))
        bandwidth, latency = HOST_LINKS[cost.hardware.host_link]
        link = SwapLink(bandwidth, latency, cost.kv_bytes_per_token, 1, name=cost.hardware.host_link)
        load = link.copy_time(-(-n // args.block_size), args.block_size)
        rows.append({"model": model, "hardware": cost.hardware.name, "link": link.name,
                     "prefill_ms": prefill * 1e3, "load_ms": load * 1e3, "speedup": prefill / load})
    return rows


COLUMNS = [("config", "{:<11}"), ("device_hit", "{:>10.1%}"), ("host_hit", "{:>8.1%}"),
           ("prefill_tokens", "{:>14d}"), ("saved", "{:>6.1%}"), ("ttft_mean_s", "{:>11.3f}"),
           ("ttft_p50_s", "{:>10.3f}"), ("ttft_p99_s", "{:>10.3f}"), ("wall_s", "{:>7.1f}"),
           ("offloaded_mib", "{:>13.1f}"), ("loaded_mib", "{:>10.1f}"), ("equal", "{!s:>5}")]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        print(f"tiers: unknown configs {bad}; choose from {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    for name in ("docs", "doc_tokens", "questions", "question_tokens", "max_tokens", "block_size"):
        if getattr(args, name) < 1:
            print(f"tiers: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    from ..model import load_model
    vocab = load_model(args.model).config.vocab_size
    prompts = workload(vocab, args)
    device, host = sizes(args)
    settings = {"model": args.model, "policy": args.policy, "docs": args.docs, "doc_tokens": args.doc_tokens,
                "questions": args.questions, "requests": len(prompts), "block_size": args.block_size,
                "device_blocks": device, "host_tier_blocks": host, "max_tokens": args.max_tokens}
    if not args.json:
        print(json.dumps(settings))
        print(table_header(COLUMNS), flush=True)
    rows, reference = [], None
    for config in configs:
        row, outputs = run_config(config, prompts, args)
        reference = outputs if reference is None else reference
        row["equal"] = outputs == reference
        rows.append(row)
        if not args.json:
            print(table_line(COLUMNS, row), flush=True)
    gpu = gpu_model(args)
    if args.json:
        print(json.dumps({"settings": settings, "rows": rows, "gpu_model": gpu}))
    else:
        print(f"\nOn a GPU (roofline model), one {args.doc_tokens}-token document: prefill it, or copy its "
              f"{-(-args.doc_tokens // args.block_size)} blocks back from host memory")
        for g in gpu:
            print(f"  {g['model']:<12} {g['hardware']:<16} {g['link']:<10} prefill {g['prefill_ms']:8.2f} ms   "
                  f"load {g['load_ms']:7.2f} ms   ({g['speedup']:.1f}x)")
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
