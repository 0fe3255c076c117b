"""``python -m labkit.bench prefix``: prefix-caching policies side by side, per workload.

Each workload runs three times on the same engine, once per policy: ``none`` (no prefix
cache), ``hash`` (vLLM's chained block hashes) and ``radix`` (SGLang's radix tree). Reported
per run:

* ``hit_rate``: prompt tokens served from the cache / prompt tokens admitted (a prompt
  readmitted after a preemption counts again: its cached part is again not recomputed);
* ``blocks_mean``, ``blocks_peak``: KV blocks held by sequences, over the iterations;
* ``evictions``: cached blocks evicted to make room;
* ``ttft_p50_s``, ``ttft_p99_s`` and ``output_tok_per_s`` (simulated time, or wall time
  with ``--real``); ``preemptions``;
* ``cache_us_per_request``: CPU time spent inside the prefix cache's own methods (lookups,
  insertions, evictions), per request: what the policy costs the CPU. Measured with the
  thread's CPU clock around each call (other processes' load does not count; the clock
  reads add well under a microsecond per call).

Examples::

    python -m labkit.bench prefix                     # simulator, long traces
    python -m labkit.bench prefix --num-blocks 1500 --json
    python -m labkit.bench prefix --real              # SmolLM2-135M, short prompt sets
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

from ..utils import percentile
from . import table_header, table_line

POLICIES = ("none", "hash", "radix")
CACHE_METHODS = ("match", "acquire", "reused", "publish", "released", "revived", "evict")


def sim_workloads(scale: float = 1.0, seed: int = 0) -> dict:
    """The simulator's long traces (``scale`` multiplies their request counts)."""
    from ..sim import branching_trace, few_shot_trace, multi_turn_trace, shared_prompt_trace

    def n(k: int) -> int:
        return max(1, round(k * scale))

    return {
        "multi-turn": multi_turn_trace(num_sessions=n(96), turns=4, rate=0.5, seed=seed),
        "few-shot": few_shot_trace(num_requests=n(300), rate=0.5, seed=seed),
        "branching": branching_trace(num_roots=n(12), branching=(4, 3), rate=0.1, seed=seed),
        "shared-prompt": shared_prompt_trace(num_requests=n(400), system_prompt_len=600, rate=1.0, seed=seed),
    }


def time_cache_calls(cache) -> list[float]:
    """Wrap the policy object's methods so each call adds its CPU time (this thread's) to
    the returned one-element list (instance attributes shadow the class's methods).

    Only outermost calls are timed: the methods call each other (the hash cache's
    ``acquire`` calls ``match``; ``acquire`` and ``publish`` reach ``revived`` and
    ``released`` through the allocator), and a nested call's time is already inside its
    caller's."""
    total = [0.0]
    depth = [0]                 # timed calls under way: only the outermost reads the clock
    for name in CACHE_METHODS:
        method = getattr(cache, name)

        @functools.wraps(method)
        def timed(*args, _method=method, **kwargs):
            depth[0] += 1
            start = time.thread_time() if depth[0] == 1 else None
            try:
                return _method(*args, **kwargs)
            finally:
                depth[0] -= 1
                if start is not None:
                    total[0] += time.thread_time() - start
        setattr(cache, name, timed)
    return total


def _policy_value(policy: str):
    return False if policy == "none" else policy


def _row(workload: str, policy: str, scheduler, records, requests, cache_s: float, makespan: float) -> dict:
    from ..sim.run import prefix_cache_metrics

    alloc = scheduler.allocator
    alloc.check_invariants()
    cache = prefix_cache_metrics(scheduler)
    held = [r.num_used_blocks for r in records if r.num_running]
    ttft = [r.metrics.time_to_first_token if hasattr(r, "metrics") else r.first_token_time - r.arrival_time
            for r in requests]
    ttft = [t for t in ttft if t is not None]
    out_tokens = sum(len(r.outputs[0].token_ids) if hasattr(r, "outputs") else r.seqs[0].num_output_tokens
                     for r in requests)
    return {
        "workload": workload, "policy": policy, "requests": len(requests),
        "prompt_tokens": cache["prefix_cached_tokens"] + scheduler.num_prompt_tokens_computed,
        "cached_tokens": cache["prefix_cached_tokens"], "hit_rate": cache["prefix_hit_rate"],
        "blocks_mean": sum(held) / len(held) if held else 0.0, "blocks_peak": max(held, default=0),
        "evictions": alloc.num_evictions, "preemptions": scheduler.num_preemptions,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "output_tok_per_s": out_tokens / makespan if makespan > 0 else float("nan"),
        "cache_us_per_request": 1e6 * cache_s / max(1, len(requests)),
        "leaked_blocks": alloc.num_used_blocks,
    }


def run_sim(workload: str, trace, policy: str, args) -> dict:
    """One simulated run; repeated ``args.repeat`` times (the simulation is deterministic,
    so every repetition does the same work) and the cache's CPU time is the fastest one's:
    the machine's other load only ever adds time."""
    from ..sim import simulate

    cache_s = []
    for _ in range(max(1, args.repeat)):
        timers: list = []

        def on_step(engine):
            if not timers and engine.scheduler.allocator.prefix_cache is not None:
                timers.append(time_cache_calls(engine.scheduler.allocator.prefix_cache))

        res = simulate(trace, block_size=args.block_size, num_blocks=args.num_blocks,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       enable_prefix_caching=_policy_value(policy), keep_records=True, on_step=on_step)
        cache_s.append(timers[0][0] if timers else 0.0)
    reqs = res.requests
    start = min(r.arrival_time for r in reqs)
    end = max(r.finished_time for r in reqs)
    return _row(workload, policy, res.engine.scheduler, res.records, reqs, min(cache_s), end - start)


# ---- the real model: short prompt sets, run in rounds (a turn needs the previous answer) ----
REAL_SYSTEM = ("You are a patient teaching assistant for a course on operating systems. Answer in "
               "one or two short sentences, precisely, and say when a question is ambiguous. ")
REAL_QUESTIONS = ["What is a page table?", "Why do caches use LRU?", "What is copy-on-write?",
                  "What does a scheduler do?", "What is a context switch?", "Why is paging useful?"]
REAL_FOLLOW_UPS = ["Give an example.", "And what can go wrong?", "Summarise that in five words."]
REAL_EXAMPLES = [
    "Q: What is a process? A: A running program with its own address space and resources.\n",
    "Q: What is a thread? A: A flow of execution inside a process, sharing its memory.\n",
    "Q: What is a mutex? A: A lock that lets one thread at a time into a critical section.\n",
    "Q: What is a semaphore? A: A counter that threads wait on and signal to share resources.\n",
    "Q: What is virtual memory? A: Each process sees its own large address space, mapped to RAM.\n",
]


def real_rounds(workload: str) -> list[list]:
    """The real prompt sets as rounds; a round is a list of ``(key, parent key, text)``: the
    prompt is the parent's prompt and answer (if any) followed by ``text``."""
    if workload == "shared-prompt":     # two waves: the first computes the system prompt together
        wave = [(f"q{i}", None, REAL_SYSTEM + "Question: " + q) for i, q in enumerate(REAL_QUESTIONS)]
        return [wave[:3], wave[3:]]
    if workload == "multi-turn":
        first = [(f"s{i}t0", None, REAL_SYSTEM + "User: " + q + "\nAssistant:")
                 for i, q in enumerate(REAL_QUESTIONS[:4])]
        rounds = [first]
        for t, follow in enumerate(REAL_FOLLOW_UPS[:2], 1):
            rounds.append([(f"s{i}t{t}", f"s{i}t{t - 1}", "\nUser: " + follow + "\nAssistant:") for i in range(4)])
        return rounds
    if workload == "few-shot":
        orders = [(0, 1, 2, 3), (0, 1, 3, 2), (1, 0, 2, 4), (0, 2, 4), (3, 4, 0, 1), (0, 1, 2, 4)]
        return [[(f"f{i}", None, "Answer like the examples.\n" + "".join(REAL_EXAMPLES[e] for e in order)
                  + "Q: " + REAL_QUESTIONS[i] + " A:") for i, order in enumerate(orders)]]
    if workload == "branching":
        root = REAL_SYSTEM + "Problem: a cache of 4 pages sees the requests 1 2 3 4 1 5 1 2. "
        level1 = [(f"b{i}", None, root + f"Approach {i + 1}: " + how) for i, how in
                  enumerate(["simulate LRU step by step.", "simulate FIFO.", "count distinct pages."])]
        level2 = [(f"b{i}{j}", f"b{i}", " Now check: " + c) for i in range(3) for j, c in
                  enumerate(["is that right?", "what is the hit rate?"])]
        return [level1, level2]
    raise ValueError(f"unknown workload {workload!r}")


REAL_WORKLOADS = ("multi-turn", "few-shot", "branching", "shared-prompt")


def run_real(llm, workload: str, policy: str, max_tokens: int) -> dict:
    from ..sampling_params import SamplingParams

    scheduler = llm.engine.scheduler
    cache = scheduler.allocator.prefix_cache
    timer = time_cache_calls(cache) if cache is not None else [0.0]
    llm.engine.records.clear()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    history: dict[str, list[int]] = {}
    outputs, start = [], time.perf_counter()
    for round_ in real_rounds(workload):
        prompts = [history.get(parent, []) + llm.tokenizer.encode(text, add_special_tokens=parent is None)
                   for _, parent, text in round_]
        outs = llm.generate(prompts, params, use_tqdm=False)
        for (key, _, _), prompt, out in zip(round_, prompts, outs):
            history[key] = prompt + list(out.outputs[0].token_ids)
        outputs += outs
    wall = time.perf_counter() - start
    return _row(workload, policy, scheduler, llm.engine.records, outputs, timer[0], wall)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit.bench prefix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--real", action="store_true", help="SmolLM2-135M on short prompt sets instead of the simulator")
    p.add_argument("--model", default="smollm2-135m", help="with --real (tiny-llama: fast, random text)")
    p.add_argument("--workloads", default=None, help="comma-separated subset of the workloads")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks (default: 1024 simulated, 256 real: small enough that the cache evicts)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--scale", type=float, default=1.0, help="simulator: multiply the traces' request counts")
    p.add_argument("--repeat", type=int, default=3,
                   help="simulator: runs per cell; the cache's CPU time is the fastest run's (default 3)")
    p.add_argument("--max-tokens", type=int, default=24, help="--real: tokens generated per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


COLUMNS = [("workload", "{:<13}"), ("policy", "{:<6}"), ("hit_rate", "{:>8.1%}"), ("blocks_mean", "{:>11.1f}"),
           ("blocks_peak", "{:>11d}"), ("evictions", "{:>9d}"), ("preemptions", "{:>11d}"),
           ("ttft_p50_s", "{:>10.3f}"), ("ttft_p99_s", "{:>10.3f}"), ("output_tok_per_s", "{:>16.1f}"),
           ("cache_us_per_request", "{:>20.1f}")]


def header() -> str:
    return table_header(COLUMNS)


def line(row: dict) -> str:
    return table_line(COLUMNS, row)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        print(f"prefix: unknown policies {bad}; choose from {POLICIES}", file=sys.stderr)
        return 2
    names = REAL_WORKLOADS if args.real else tuple(sim_workloads(0.01))
    chosen = names if args.workloads is None else tuple(w.strip() for w in args.workloads.split(","))
    if any(w not in names for w in chosen):
        print(f"prefix: unknown workloads {[w for w in chosen if w not in names]}; choose from {names}",
              file=sys.stderr)
        return 2
    settings = {"mode": "real" if args.real else "sim",
                "model": args.model if args.real else "simulated SmolLM2-135M cost",
                "block_size": args.block_size, "num_blocks": args.num_blocks or (256 if args.real else 1024),
                "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                "repeat": 1 if args.real else args.repeat}
    rows: list[dict] = []

    def done(row: dict) -> None:       # the table grows row by row: a long --real run shows progress
        rows.append(row)
        if not args.json:
            print(line(row), flush=True)

    if not args.json:
        print(json.dumps(settings))
        print(header(), flush=True)
    if args.real:
        from ..llm import LLM
        num_blocks = args.num_blocks or 256
        for workload in chosen:
            for policy in policies:     # a fresh engine per cell: counters and cache start empty
                llm = LLM(args.model, block_size=args.block_size, num_blocks=num_blocks,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          enable_prefix_caching=_policy_value(policy))
                done(run_real(llm, workload, policy, args.max_tokens))
    else:
        traces = sim_workloads(args.scale, args.seed)
        for workload in chosen:
            for policy in policies:
                done(run_sim(workload, traces[workload], policy, _sim_args(args)))
    if args.json:
        print(json.dumps({"settings": settings, "rows": rows}))
    return 0


def _sim_args(args):
    if args.num_blocks is None:
        args.num_blocks = 1024
    return args



if __name__ == "__main__":
    sys.exit(main())
