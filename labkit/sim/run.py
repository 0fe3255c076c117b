"""Run a trace through the real scheduler and block manager with the simulator's executor.

``simulate`` builds the same objects the real engine uses (``BlockAllocator``, the
scheduler ``make_scheduler`` gives for the policy, ``Engine``), swaps the model for ``SimExecutor``,
releases each request at its arrival time on the simulated clock, and measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine import Engine
from ..memory import BlockAllocator
from ..request import Request
from ..sampling_params import SamplingParams
from ..scheduler import POLICIES, StepRecord, make_scheduler
from ..utils import percentile, progress_bar
from .executor import SimExecutor
from .traces import TraceRequest

__all__ = ["POLICIES", "SimResult", "make_scheduler", "percentile", "simulate", "summarize"]


@dataclass
class SimResult:
    """A simulated run: the requests (with their timings), the step records, the metrics."""

    requests: list[Request]
    records: list[StepRecord]
    engine: Engine
    metrics: dict = field(default_factory=dict)


def simulate(trace: list[TraceRequest], policy: str = "continuous", *, block_size: int = 16,
             num_blocks: int = 2048, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
             enable_chunked_prefill: bool = True, enable_prefix_caching: bool = False,
             max_model_len: int | None = 2048, reserve: str = "model", watermark: float = 0.01,
             cost_model=None, vocab_size: int = 32000, keep_records: bool = True,
             progress: bool = False, on_step=None) -> SimResult:
    """Serve ``trace`` under ``policy``; every output runs to its trace length (no EOS).
    ``on_step(engine)``, if given, is called before the first iteration and after each one
    (the replay widget records snapshots with it)."""
    allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching)
    scheduler = make_scheduler(policy, allocator, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                               max_num_batched_tokens=max_num_batched_tokens, watermark=watermark,
                               enable_chunked_prefill=enable_chunked_prefill, reserve=reserve)
    engine = Engine(scheduler, SimExecutor(cost_model, vocab_size), keep_records=keep_records)

    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_s)
    requests: list[Request] = []
    bar = progress_bar(len(trace), progress, f"sim {policy}")
    nxt = 0
    if on_step is not None:
        on_step(engine)
    while nxt < len(order) or engine.has_unfinished:
        if not engine.has_unfinished and nxt < len(order):
            engine.advance_to(trace[order[nxt]].arrival_s)       # idle until the next arrival
        while nxt < len(order) and trace[order[nxt]].arrival_s <= engine.now:
            i = order[nxt]
            r = trace[i]
            params = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)
            requests.append(engine.add_request(r.prompt_token_ids(i, vocab_size), params,
                                               request_id=f"r{i}", arrival_time=r.arrival_s))
            nxt += 1
        done = engine.step()
        if on_step is not None:
            on_step(engine)
        if bar is not None and done:
            bar.update(len(done))
    if bar is not None:
        bar.close()
    result = SimResult(requests, engine.records, engine)
    result.metrics = summarize(result)
    return result


def summarize(result: SimResult) -> dict:
    """The benchmark's JSON fields, computed from request timings and step records."""
    reqs, recs, engine = result.requests, result.records, result.engine
    alloc = engine.scheduler.allocator
    alloc.check_invariants()
    out_tokens = sum(s.num_output_tokens for r in reqs for s in r.seqs)
    start = min((r.arrival_time for r in reqs), default=0.0)
    end = max((r.finished_time for r in reqs if r.finished_time is not None), default=start)
    makespan = end - start
    ttft = [r.first_token_time - r.arrival_time for r in reqs if r.first_token_time is not None]
    latency = [r.finished_time - r.arrival_time for r in reqs if r.finished_time is not None]
    tpot = [(r.finished_time - r.first_token_time) / (r.seqs[0].num_output_tokens - 1)
            for r in reqs if r.finished_time is not None and r.seqs[0].num_output_tokens > 1]
    return {
        "policy": engine.scheduler.policy,
        "requests": len(reqs),
        "finished": sum(1 for r in reqs if r.finished),
        "output_tokens": out_tokens,
        "makespan_s": makespan,
        "output_tok_per_s": out_tokens / makespan if makespan > 0 else float("nan"),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
        "latency_p50_s": percentile(latency, 50), "latency_p99_s": percentile(latency, 99),
        "kv_cache_usage_mean": sum(r.kv_cache_usage for r in recs) / len(recs) if recs else float("nan"),
        "held_slot_fill_mean": sum(r.held_slot_fill for r in recs) / len(recs) if recs else float("nan"),
        "peak_running": max((r.num_running + len(r.finished) for r in recs), default=0),
        "num_preemptions": engine.scheduler.num_preemptions,
        "leaked_blocks": alloc.num_used_blocks,
        "steps": engine.num_steps,
        "scheduler_wall_s": engine.schedule_s,
    }


