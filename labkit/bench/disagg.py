"""``python -m labkit.bench disagg``: prefill/decode interference, chunked prefill and
disaggregation, simulated on the real scheduler with a roofline cost model.

Runs one trace under three configurations of the same devices: colocated without chunking,
colocated with chunked prefill, and disaggregated prefill/decode pools; prints TTFT, TPOT and
ITL percentiles, SLO attainment, goodput (per device too) and pool utilization.

Examples::

    python -m labkit.bench disagg --json
    python -m labkit.bench disagg --model llama-3-8b --hardware h100-sxm --rate 40 \\
        --prefill 2 --decode 2 --chunk 512 --ttft-slo 0.4 --tpot-slo 0.015 --json
    python -m labkit.bench disagg --model llama-3-70b --hardware h200 --tp 2 --rate 4 --json
    python -m labkit.bench disagg --trace my.jsonl --link ib-ndr-400g --json
    python -m labkit.bench disagg --max-goodput --json      # DistServe's goodput (bisection)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ..sim.disagg import SLO, max_goodput, serve, standard_configs, workload_trace
from ..sim.roofline import HARDWARE, LINKS, MODELS, roofline
from ..sim.traces import load_trace, synthetic_trace


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit.bench disagg", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("workload")
    w.add_argument("--trace", help="JSONL trace (prompt_len, output_len, arrival_s per line)")
    w.add_argument("--dataset", default="long", choices=["long", "sharegpt", "alpaca"],
                   help="synthetic trace when --trace is not given: 'long' = log-normal prompts of "
                        "--prompt-mean and outputs of --output-mean tokens (default)")
    w.add_argument("--num-requests", type=int, default=300)
    w.add_argument("--rate", type=float, default=40.0, help="Poisson arrivals, requests/s")
    w.add_argument("--prompt-mean", type=float, default=1536)
    w.add_argument("--output-mean", type=float, default=128)
    w.add_argument("--sigma", type=float, default=0.5, help="log-normal width (0: fixed lengths)")
    w.add_argument("--seed", type=int, default=1)
    m = p.add_argument_group("model and hardware")
    m.add_argument("--model", default="llama-3-8b", choices=sorted(MODELS))
    m.add_argument("--hardware", default="h100-sxm", choices=sorted(HARDWARE))
    m.add_argument("--tp", type=int, default=1, help="devices per instance (tensor parallel)")
    m.add_argument("--link", default=None,
                   help=f"KV link: a preset ({', '.join(LINKS)}) or bytes/s; default: the hardware's NVLink")
    c = p.add_argument_group("cluster")
    c.add_argument("--prefill", type=int, default=2, help="prefill instances (disaggregated)")
    c.add_argument("--decode", type=int, default=2, help="decode instances (disaggregated)")
    c.add_argument("--chunk", type=int, default=512, help="token budget per iteration, chunked config")
    c.add_argument("--max-num-seqs", type=int, default=256)
    c.add_argument("--max-model-len", type=int, default=8192)
    c.add_argument("--num-blocks", type=int, default=None, help="per instance (default: from memory)")
    c.add_argument("--router", default="least_loaded", choices=["least_loaded", "round_robin"])
    s = p.add_argument_group("SLOs")
    s.add_argument("--ttft-slo", type=float, default=0.4, help="seconds")
    s.add_argument("--tpot-slo", type=float, default=0.015, help="seconds")
    p.add_argument("--max-goodput", action="store_true",
                   help="also search each config's highest rate with >= 90%% SLO attainment (slower)")
    p.add_argument("--goodput-duration", type=float, default=10.0,
                   help="seconds of arrivals per --max-goodput probe (default 10)")
    p.add_argument("--goodput-iterations", type=int, default=6, help="bisection steps (default 6)")
    p.add_argument("--json", action="store_true", help="print one JSON object on one line")
    return p


def _link(value: str | None) -> float | None:
    if value is None or value in LINKS:
        return LINKS.get(value)
    try:
        return float(value)
    except ValueError:
        return -1.0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.prefill < 1 or args.decode < 1:
        print("--prefill and --decode must be >= 1", file=sys.stderr)
        return 2
    link = _link(args.link)
    if link is not None and link <= 0:
        print(f"--link: unknown link {args.link!r}; presets: {', '.join(LINKS)}, or bytes/s > 0", file=sys.stderr)
        return 2
    cost = roofline(args.model, args.hardware, tp=args.tp)
    if args.trace:
        trace = load_trace(args.trace)
        source = {"trace": args.trace}
    elif args.dataset == "long":
        trace = workload_trace(args.num_requests, args.rate, args.prompt_mean, args.output_mean,
                               args.sigma, args.seed, max_len=args.max_model_len)
        source = {"dataset": "long", "rate": args.rate, "prompt_mean": args.prompt_mean,
                  "output_mean": args.output_mean, "sigma": args.sigma, "seed": args.seed}
    else:
        trace = synthetic_trace(args.dataset, args.num_requests, rate=args.rate, seed=args.seed,
                                max_len=args.max_model_len)
        source = {"dataset": args.dataset, "rate": args.rate, "seed": args.seed}
    slo = SLO(args.ttft_slo, args.tpot_slo)
    configs = standard_configs(args.prefill, args.decode, args.chunk, max_num_seqs=args.max_num_seqs,
                               max_model_len=args.max_model_len, num_blocks=args.num_blocks,
                               router=args.router, link_bandwidth=link, tp=args.tp)
    out: dict = {
        "model": cost.model.name, "hardware": cost.hardware.name, "tp": args.tp, "cost_model": cost.name,
        "workload": {**source, "requests": len(trace),
                     "prompt_tokens": sum(r.prompt_len for r in trace),
                     "output_tokens": sum(r.output_len for r in trace)},
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "ridge_tokens": cost.ridge_tokens(),
        "configs": {},
    }
    t0 = time.perf_counter()
    for cfg in configs:
        metrics = serve(trace, cfg, cost).metrics(slo)
        metrics.pop("slo", None)
        if args.max_goodput:
            metrics["max_goodput_per_device_rps"] = max_goodput(
                cfg, slo, cost, duration_s=args.goodput_duration, iterations=args.goodput_iterations,
                low=1.0, high=max(2.0, args.rate), seed=args.seed,
                prompt_mean=args.prompt_mean, output_mean=args.output_mean, sigma=args.sigma,
                max_len=args.max_model_len)
        out["configs"][cfg.name] = metrics
    out["wall_s"] = time.perf_counter() - t0
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
