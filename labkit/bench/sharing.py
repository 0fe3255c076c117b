"""``python -m labkit.bench sharing``: memory saved by sharing blocks, the vLLM paper's Figure 15.

Parallel sampling (``n`` samples of one prompt) shares the prompt's blocks; beam search
shares far more: beams fork from each other at every step, so most of each beam's blocks
are its ancestors'. For each trace and each width, this runs every request of the trace
with that ``n`` or beam width through the real scheduler and block manager (simulated
time), and reports the saving as the paper defines it: blocks saved by sharing divided by
the blocks the same sequences would hold without sharing (each its own copy), summed
over the run's iterations (``labkit.sim.run.sharing_saving``).

Examples::

    python -m labkit.bench sharing                      # the table, ShareGPT- and Alpaca-like
    python -m labkit.bench sharing --json
    python -m labkit.bench sharing --real --model smollm2-135m   # plus the real model, a few prompts

The paper's figures (Kwon et al., SOSP'23, section 6.3 and Figure 15, OPT-13B) are the
ranges its text gives over widths 2-6; they are printed beside ours (``PAPER``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ..sim import simulate, synthetic_trace
from ..sim.run import sharing_saving

#: The vLLM paper's memory savings (section 6.3, Figure 15), percent, over widths 2-6:
#: (dataset, method) -> (lowest, highest). The paper gives ranges in its text, not each bar.
PAPER = {
    ("alpaca", "parallel"): (6.1, 9.8),
    ("alpaca", "beam"): (37.6, 55.2),
    ("sharegpt", "parallel"): (16.2, 30.5),
    ("sharegpt", "beam"): (44.3, 66.3),
}
METHODS = ("parallel", "beam")
RUN_TIME = "about 6 min on 2 cores"   # the default table, measured: python -m labkit.bench sharing
REAL_PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about memory.",
    "What is the capital of France, and what is it known for?",
    "List three uses of a paper clip.",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit.bench sharing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", default="sharegpt,alpaca", help="comma-separated (default: sharegpt,alpaca)")
    p.add_argument("--widths", default="2,4,6", help="n and beam widths to run (default: 2,4,6)")
    p.add_argument("--methods", default="parallel,beam", help="parallel, beam or both (default)")
    p.add_argument("--num-requests", type=int, default=200, help="requests per trace (default 200)")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s (default: all at t=0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--real", action="store_true", help="also measure the real model on a few prompts")
    p.add_argument("--model", default="smollm2-135m", help="the model for --real (default smollm2-135m)")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per prompt for --real (default 32)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{what} wants comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--{what} wants integers >= 1, got {text!r}")
    return values


def _names(text: str, choices, what: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in choices]
    if not names or bad:
        raise ValueError(f"--{what}: choose from {', '.join(choices)}, got {text!r}")
    return names


def simulated_saving(dataset: str, method: str, width: int, *, num_requests: int = 200,
                     rate: float | None = None, seed: int = 0, block_size: int = 16,
                     num_blocks: int = 4096, max_num_seqs: int = 256, max_model_len: int = 2048) -> dict:
    """One cell of the table: the trace served with ``n = width`` or beam search of ``width``."""
    trace = synthetic_trace(dataset, num_requests, rate=rate, seed=seed, max_len=max_model_len)
    kind = {"n": width} if method == "parallel" else {"beam_width": width}
    res = simulate(trace, block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                   max_model_len=max_model_len, **kind)
    m = res.metrics
    return {"dataset": dataset, "method": method, "width": width, "saving_pct": m["blocks_saved_by_sharing_pct"],
            "blocks_saved_mean": m["blocks_saved_by_sharing"], "num_preemptions": m["num_preemptions"],
            "steps": m["steps"], "paper_range_pct": list(PAPER[dataset, method])}


def real_saving(llm, method: str, width: int, prompts: list[str], max_tokens: int) -> dict:
    """The saving on the real model: ``prompts`` served together with ``n = width`` samples
    (temperature 1, seeded) or beam search of ``width``, the engine's own step records."""
    from ..sampling_params import SamplingParams
    engine = llm.engine
    first = len(engine.records)
    t0 = time.perf_counter()
    if method == "parallel":
        llm.generate(prompts, SamplingParams(n=width, temperature=1.0, seed=0, max_tokens=max_tokens,
                                             ignore_eos=True), use_tqdm=False)
    else:
        from ..sampling_params import BeamSearchParams
        llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True))
    records = engine.records[first:]
    saved, share = sharing_saving(records)
    return {"model": llm.runner.name, "method": method, "width": width, "saving_pct": 100 * share,
            "blocks_saved_mean": saved, "prompts": len(prompts), "max_tokens": max_tokens,
            "steps": len(records), "wall_s": time.perf_counter() - t0}


def table(rows: list[dict], real: list[dict]) -> str:
    """The rows as the paper's figure reads: one line per dataset and method."""
    lines = ["memory saved by sharing (% of the blocks without sharing), simulated traces",
             f"{'trace':<10} {'method':<9} " + " ".join(f"{'w=' + str(w):>7}" for w in _widths(rows))
             + "   paper (Fig. 15, widths 2-6)"]
    for dataset, method in dict.fromkeys((r["dataset"], r["method"]) for r in rows):
        cells = {r["width"]: r["saving_pct"] for r in rows if (r["dataset"], r["method"]) == (dataset, method)}
        low, high = PAPER[dataset, method]
        lines.append(f"{dataset:<10} {method:<9} " + " ".join(
            f"{cells[w]:>6.1f}%" if w in cells else f"{'':>7}" for w in _widths(rows))
            + f"   {low:.1f}-{high:.1f}%")
    preempted = {f"{r['dataset']} {r['method']} {r['width']}": r["num_preemptions"]
                 for r in rows if r["num_preemptions"]}
    if preempted:
        lines.append("preemptions (a preempted sample or beam is recomputed alone, unshared): "
                     + ", ".join(f"{k}: {v}" for k, v in preempted.items()))
    if real:
        lines += ["", f"real model ({real[0]['model']}, {real[0]['prompts']} prompts, "
                      f"{real[0]['max_tokens']} new tokens each)"]
        for r in real:
            lines.append(f"{'':<10} {r['method']:<9} w={r['width']}: {r['saving_pct']:5.1f}%  "
                         f"({r['blocks_saved_mean']:.1f} blocks saved per iteration, {r['wall_s']:.1f} s)")
    return "\n".join(lines)


def _widths(rows: list[dict]) -> list[int]:
    return sorted({r["width"] for r in rows})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from ..sim.traces import DATASETS
        datasets = _names(args.datasets, list(DATASETS), "datasets")
        methods = _names(args.methods, METHODS, "methods")
        widths = _ints(args.widths, "widths")
        cells = [(d, m, w) for d in datasets for m in methods for w in widths]
        print(f"sharing: {len(cells)} simulations of {args.num_requests} requests ({RUN_TIME} with the "
              "defaults); a line as each ends", file=sys.stderr, flush=True)
        rows = []
        for i, (d, m, w) in enumerate(cells, 1):
            t0 = time.perf_counter()
            rows.append(simulated_saving(d, m, w, num_requests=args.num_requests, rate=args.rate, seed=args.seed,
                                         block_size=args.block_size, num_blocks=args.num_blocks,
                                         max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len))
            print(f"sharing: [{i}/{len(cells)}] {d} {m} width {w}: {rows[-1]['saving_pct']:.1f}% saved "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    except ValueError as e:
        print(f"sharing: {e}", file=sys.stderr)
        return 2
    real = []
    if args.real:
        from ..llm import LLM
        llm = LLM(args.model, block_size=args.block_size, enable_prefix_caching=False)
        real = [real_saving(llm, m, w, REAL_PROMPTS, args.max_tokens) for m in methods for w in widths]
    if args.json:
        print(json.dumps({"simulated": rows, "real": real}))
    else:
        print(table(rows, real))
    return 0


if __name__ == "__main__":
    sys.exit(main())
