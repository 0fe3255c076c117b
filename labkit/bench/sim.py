"""``python -m labkit.bench sim``: a trace through the real scheduler, simulated time.

Examples::

    python -m labkit.bench sim --dataset sharegpt --num-requests 1000 --policy both --json
    python -m labkit.bench sim --trace my.jsonl --policy static --reserve max_tokens --json
    python -m labkit.bench sim --overhead 256,1024      # wall time per schedule() call
    python -m labkit.bench sim --policy continuous --num-blocks 400 --preemption-mode swap --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ..memory import BlockAllocator
from ..sampling_params import SamplingParams
from ..request import Request
from ..scheduler import Scheduler
from ..sim import (LinearCostModel, POLICIES, SimExecutor, branching_trace, few_shot_trace, load_trace,
                   multi_turn_trace, shared_prompt_trace, simulate, synthetic_trace)


# Prefix-sharing workloads: (number of requests, rate or None, seed) -> trace.
PREFIX_DATASETS = {
    "multi-turn": lambda n, rate, seed: multi_turn_trace(num_sessions=max(1, n // 4), turns=4, rate=rate, seed=seed),
    "few-shot": lambda n, rate, seed: few_shot_trace(num_requests=n, rate=rate, seed=seed),
    "branching": lambda n, rate, seed: branching_trace(num_roots=max(1, n // 16), branching=(4, 3), rate=rate,
                                                       seed=seed),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit.bench sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("workload")
    src.add_argument("--trace", help="JSONL trace file (prompt_len, output_len, arrival_s per line)")
    src.add_argument("--dataset", default="sharegpt",
                     choices=["sharegpt", "alpaca", "shared-prompt", "multi-turn", "few-shot", "branching"],
                     help="synthetic trace when --trace is not given (default: sharegpt); multi-turn "
                          "(sessions of 4 turns), few-shot and branching (4 continuations of a prompt, "
                          "3 of each: 16 requests per tree) share prefixes: try them with "
                          "--prefix-caching hash|radix")
    src.add_argument("--num-requests", type=int, default=1000)
    src.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s (default: all at t=0)")
    src.add_argument("--seed", type=int, default=0)
    eng = p.add_argument_group("engine")
    eng.add_argument("--policy", default="both", choices=[*POLICIES, "both"])
    eng.add_argument("--block-size", type=int, default=16)
    eng.add_argument("--num-blocks", type=int, default=2048)
    eng.add_argument("--max-num-seqs", type=int, default=256)
    eng.add_argument("--max-num-batched-tokens", type=int, default=2048)
    eng.add_argument("--max-model-len", type=int, default=2048)
    eng.add_argument("--reserve", default="model", choices=["model", "max_tokens"],
                     help="static policy: reserve the model's max length or prompt+max_tokens")
    eng.add_argument("--no-chunked-prefill", action="store_true")
    eng.add_argument("--prefix-caching", nargs="?", const="hash", default=False, choices=("hash", "radix"),
                     help="prefix caching policy: hash (vLLM's chained block hashes; the bare flag) "
                          "or radix (SGLang's radix tree); off without the flag")
    eng.add_argument("--n", type=int, default=1,
                     help="parallel sampling: every request samples N outputs sharing its prompt (default 1)")
    eng.add_argument("--beam-width", type=int, default=None,
                     help="beam search of this width for every request instead (see blocks_saved_by_sharing)")
    eng.add_argument("--preemption-mode", default="recompute", choices=("recompute", "swap"),
                     help="what a preempted sequence's KV becomes: dropped and recomputed, or swapped "
                          "to host blocks (needs --num-host-blocks); see python -m labkit.bench swap")
    eng.add_argument("--num-host-blocks", type=int, default=None,
                     help="host blocks for --preemption-mode swap (default: as many as --num-blocks)")
    eng.add_argument("--cost", default=None, metavar="FIXED,PER_TOKEN,PER_PREFILL_CTX,PER_DECODE_CTX",
                     help="linear cost model in seconds (default: fitted to SmolLM2-135M on this CPU)")
    eng.add_argument("--roofline", default=None, metavar="MODEL@HARDWARE",
                     help="roofline cost model from presets instead, e.g. llama-3-8b@a100-80gb "
                          "(see labkit.sim.roofline)")
    p.add_argument("--overhead", default=None, metavar="N[,N...]",
                   help="instead: measure wall time per schedule()+update() with N running requests")
    p.add_argument("--calibrate", action="store_true",
                   help="instead: fit the linear cost model to the real engine (smollm2-135m) on this machine")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.calibrate:
        from ..sim.calibrate import calibrate
        model, err = calibrate()
        print(json.dumps({"fixed_s": model.fixed_s, "per_token_s": model.per_token_s,
                          "per_prefill_context_token_s": model.per_prefill_context_token_s,
                          "per_decode_context_token_s": model.per_decode_context_token_s,
                          "relative_error_total_time": err}))
        return 0
    if args.overhead:
        result = {f"running_{n}": measure_overhead(int(n)) for n in args.overhead.split(",")}
        print(json.dumps(result, indent=None if args.json else 2))
        return 0
    if args.trace:
        trace = load_trace(args.trace)
    elif args.dataset == "shared-prompt":
        trace = shared_prompt_trace(args.num_requests, rate=args.rate, seed=args.seed)
    elif args.dataset in PREFIX_DATASETS:
        trace = PREFIX_DATASETS[args.dataset](args.num_requests, args.rate, args.seed)
    else:
        trace = synthetic_trace(args.dataset, args.num_requests, rate=args.rate, seed=args.seed,
                                max_len=args.max_model_len)
    cost = None
    if args.cost:
        try:
            fixed, per_token, per_prefill, per_decode = (float(x) for x in args.cost.split(","))
        except ValueError:
            print(f"--cost wants four numbers FIXED,PER_TOKEN,PER_PREFILL_CTX,PER_DECODE_CTX, got {args.cost!r}",
                  file=sys.stderr)
            return 2
        cost = LinearCostModel(fixed, per_token, per_prefill, per_decode, name="custom")
    elif args.roofline:
        from ..sim.roofline import roofline
        model, _, hardware = args.roofline.partition("@")
        try:
            cost = roofline(model, hardware or "a100-80gb")
        except ValueError as e:
            print(f"--roofline: {e}", file=sys.stderr)
            return 2
    policies = POLICIES if args.policy == "both" else (args.policy,)
    results = {}
    for policy in policies:
        try:
            res = run_policy(args, trace, policy, cost)
        except ValueError as e:            # a bad --n / --beam-width, a request that can never fit
            print(f"sim: {e}", file=sys.stderr)
            return 2
        m = res.metrics
        m["schedule_ms_per_step"] = 1000 * m["scheduler_wall_s"] / max(1, m["steps"])
        m["cost_model"] = res.engine.executor.cost_model.name
        results[policy] = m
    if len(results) == 1:
        out = next(iter(results.values()))
    else:
        out = dict(results)
        out["throughput_ratio_continuous_over_static"] = (
            results["continuous"]["output_tok_per_s"] / results["static"]["output_tok_per_s"])
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=2))
    return 0


def run_policy(args, trace, policy: str, cost):
    """One policy's simulated run with the command line's engine options."""
    return simulate(trace, policy, block_size=args.block_size, num_blocks=args.num_blocks,
                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                    enable_chunked_prefill=not args.no_chunked_prefill,
                    enable_prefix_caching=args.prefix_caching, max_model_len=args.max_model_len,
                    reserve=args.reserve, cost_model=cost, keep_records=True,
                    progress=not args.no_progress and not args.json,
                    n=args.n, beam_width=args.beam_width, preemption_mode=args.preemption_mode,
                    num_host_blocks=(args.num_host_blocks if args.num_host_blocks is not None else
                                     args.num_blocks if args.preemption_mode == "swap" else 0))


def measure_overhead(num_running: int, iterations: int = 50) -> dict:
    """Wall time of ``schedule()`` and ``update()`` with ``num_running`` decoding sequences."""
    block_size = 16
    alloc = BlockAllocator(num_running * 64 + 64, block_size)
    sched = Scheduler(alloc, max_num_seqs=num_running, max_num_batched_tokens=max(2048, num_running * 128))
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    for i in range(num_running):
        sched.add_request(Request(f"r{i}", [1 + (i + j) % 1000 for j in range(100)], params))
    executor = SimExecutor()

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        sampled = executor.execute(plan).sampled      # dummy tokens, not timed
        t2 = time.perf_counter()
        sched.update(plan, sampled, 0.0)
        return t1 - t0, time.perf_counter() - t2

    while any(s.is_prefill for s in sched.running) or sched.waiting:
        step()                                       # get everyone into decode first
    for _ in range(5):
        step()
    sch, upd = [], []
    for _ in range(iterations):
        a, b = step()
        sch.append(a)
        upd.append(b)
    sch.sort()
    upd.sort()
    return {"schedule_ms_median": 1000 * sch[len(sch) // 2], "update_ms_median": 1000 * upd[len(upd) // 2],
            "num_running": sched.num_running}


if __name__ == "__main__":
    sys.exit(main())
