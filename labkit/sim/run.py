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

__all__ = ["POLICIES", "SimResult", "make_scheduler", "percentile", "sharing_saving", "simulate", "summarize"]


@dataclass
class SimResult:
    """A simulated run: the requests (with their timings), the step records, the metrics."""

    requests: list[Request]
    records: list[StepRecord]
    engine: Engine
    metrics: dict = field(default_factory=dict)


def simulate(trace: list[TraceRequest], policy: str = "continuous", *, block_size: int = 16,
             num_blocks: int = 2048, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
             enable_chunked_prefill: bool = True, enable_prefix_caching: bool | str = False,
             max_model_len: int | None = 2048, reserve: str = "model", watermark: float = 0.01,
             cost_model=None, vocab_size: int = 32000, keep_records: bool = True,
             progress: bool = False, on_step=None, n: int = 1,
             beam_width: int | None = None, preemption_mode: str = "recompute",
             num_host_blocks: int = 0, swap_link=None, num_offload_blocks: int = 0) -> SimResult:
    """Serve ``trace`` under ``policy``; every output runs to its trace length (no EOS).
    ``on_step(engine)``, if given, is called before the first iteration and after each one
    (the replay widget records snapshots with it). ``n`` > 1: every request samples ``n``
    outputs (parallel sampling); ``beam_width``: every request runs beam search of that
    width instead (the SimExecutor's pseudo log-probabilities make its beams fork and die).
    ``preemption_mode="swap"`` preempts by swapping to ``num_host_blocks`` host blocks, each
    copy costed on ``swap_link`` (default: the cost model's link, see ``SwapLink``).
    ``num_offload_blocks``: a host tier behind the prefix cache (``memory/host_tier.py``),
    its copies costed on the same link."""
    request_params = _request_params(n, beam_width)
    allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching)
    scheduler = make_scheduler(policy, allocator, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                               max_num_batched_tokens=max_num_batched_tokens, watermark=watermark,
                               preemption_mode=preemption_mode, num_host_blocks=num_host_blocks,
                               enable_chunked_prefill=enable_chunked_prefill, reserve=reserve,
                               num_offload_blocks=num_offload_blocks,
                               bytes_per_block=block_size * getattr(cost_model, "kv_bytes_per_token", 0))
    engine = Engine(scheduler, SimExecutor(cost_model, vocab_size, swap_link), keep_records=keep_records)

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
            params = request_params(r.output_len)
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


def _request_params(n: int, beam_width: int | None):
    """``max_tokens -> params`` for every request of a run: one greedy output, ``n`` parallel
    samples, or beam search of ``beam_width``. Checked once, before anything runs."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    if beam_width is not None:
        if n != 1:
            raise ValueError(f"give n (parallel sampling) or beam_width (beam search), not both: "
                             f"n={n}, beam_width={beam_width}")
        from ..sampling_params import BeamSearchParams
        BeamSearchParams(beam_width=beam_width, max_tokens=1, ignore_eos=True)   # names a bad width now
        return lambda max_tokens: BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens,
                                                   ignore_eos=True)
    # The simulator's tokens do not depend on the temperature; n > 1 asks for random sampling
    # only so that the parameters read as they would on a real model.
    temperature = 0.0 if n == 1 else 1.0
    return lambda max_tokens: SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                             temperature=temperature, n=n)


def sharing_saving(records: list[StepRecord]) -> tuple[float, float]:
    """Memory saved by sharing over a run, as the vLLM paper's Figure 15 measures it.

    Each iteration, the sequences' block tables name ``num_logical_blocks`` blocks: what they
    would hold if each had its own copy; the pool holds ``num_used_blocks``. Returns (blocks
    saved, averaged over the iterations; saved / without sharing, summed over the iterations:
    the fraction of the memory that sharing saved). (0.0, 0.0) for a run with no block held.
    """
    logical = sum(r.num_logical_blocks for r in records)
    saved = sum(r.num_logical_blocks - r.num_used_blocks for r in records)
    if not records or logical == 0:
        return 0.0, 0.0
    return saved / len(records), saved / logical


def _swap_metrics(engine: Engine, reqs: list[Request]) -> dict:
    """Preemption's figures: the scheduler's swap counters, the modelled seconds spent on
    swap copies, prompt tokens recomputed, and the paper's latency metric (Figure 19b):
    the mean over requests of latency / output tokens."""
    sched = engine.scheduler
    host = sched.host_allocator
    if host is not None:
        host.check_invariants()
    norm = [(r.finished_time - r.arrival_time) / max(1, _output_len(r))
            for r in reqs if r.finished_time is not None]
    prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
    return {
        **sched.swap_stats(),
        **sched.tier_stats(),
        "swap_time_s": getattr(engine.executor, "swap_s", 0.0),
        "recomputed_tokens": sched.num_prompt_tokens_computed + sched.num_cached_prompt_tokens - prompt_tokens,
        "normalized_latency_s": sum(norm) / len(norm) if norm else float("nan"),
        "leaked_host_blocks": host.num_used_blocks if host is not None else 0,
    }


def prefix_cache_metrics(scheduler) -> dict:
    """The prefix cache's figures for a run: its policy, the share of admitted prompt tokens
    it served (a prompt readmitted after a preemption counts again), and its evictions."""
    alloc = scheduler.allocator
    cached, computed = scheduler.num_cached_prompt_tokens, scheduler.num_prompt_tokens_computed
    return {"prefix_caching": alloc.enable_prefix_caching or "none",
            "prefix_hit_rate": cached / (cached + computed) if cached + computed else 0.0,
            "prefix_cached_tokens": cached, "prefix_evictions": alloc.num_evictions}


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
    tpot = [(r.finished_time - r.first_token_time) / (_output_len(r) - 1)
            for r in reqs if r.finished_time is not None and _output_len(r) > 1]
    saved, saved_share = sharing_saving(recs)
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
        "blocks_saved_by_sharing": saved,
        "blocks_saved_by_sharing_pct": 100 * saved_share,
        "leaked_blocks": alloc.num_used_blocks,
        **prefix_cache_metrics(engine.scheduler),
        **_swap_metrics(engine, reqs),
        "steps": engine.num_steps,
        "scheduler_wall_s": engine.schedule_s,
    }


def _output_len(request) -> int:
    """Tokens the request generated: its longest sequence (samples of n > 1 and beams of a
    beam search end at different lengths; a beam that died early is not the answer)."""
    return max(seq.num_output_tokens for seq in request.seqs)
