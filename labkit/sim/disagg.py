"""Colocated, chunked and disaggregated serving of one trace, on simulated instances.

An *instance* is one engine: its own ``BlockAllocator``, ``Scheduler`` and ``Engine`` with a
``SimExecutor`` (the real scheduler and block manager, a cost model's durations) and its
own clock. A *cluster* is a set of instances and a router; ``serve`` drives them with a small
discrete-event loop so that every instance sees arrivals and KV transfers in global time
order. Three configurations of the same GPUs, on the same trace:

* **colocated**: every instance does both phases; prompts are prefilled whole
  (``enable_chunked_prefill=False``, a token budget as large as the longest prompt). A long
  prompt's iteration stalls every decode batched with it: *prefill-decode interference*.
* **chunked** (Sarathi-Serve): the same instances with a per-iteration token budget; running
  decodes go first and a prompt fills the rest of the budget, chunk by chunk, so no iteration
  is much longer than a decode iteration plus one chunk.
* **disaggregated** (DistServe): ``num_prefill`` instances only prefill (each request runs
  there with ``max_tokens=1``: the prompt and the first token), then its KV cache travels
  over a link (``prompt_len * kv_bytes_per_token / link_bandwidth`` seconds, one transfer at
  a time per prefill instance) to one of ``num_decode`` instances, which admits it with the
  prompt's KV already in place (``Sequence.num_external_tokens``: it allocates the blocks
  but computes nothing) and decodes the rest. Decode iterations never contain a prompt.

Timings follow DistServe's definitions: TTFT = first token - arrival (the prefill instance
returns the first token); TPOT = (finish - first token) / (output tokens - 1), which in the
disaggregated case includes the KV transfer and the queueing at the decode instance.
ITL (Sarathi-Serve's TBT) is each gap between consecutive tokens of a request.
Goodput is the rate of requests meeting *both* SLOs (see ``summarize_cluster`` and
``max_goodput`` for the two senses of the word).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field, replace

from ..engine import Engine
from ..memory import BlockAllocator
from ..request import Request
from ..sampling_params import SamplingParams
from ..scheduler import Scheduler
from .cost_model import LinearCostModel
from .executor import SimExecutor
from .run import percentile
from .traces import TraceRequest, _lognormal, poisson_arrivals

ROLES = ("colocated", "prefill", "decode")
ROUTERS = ("least_loaded", "round_robin")


# ---- configuration ----------------------------------------------------------------------
@dataclass(frozen=True)
class SLO:
    """Latency targets: DistServe's pair. A request *attains* the SLO when both hold."""

    ttft_s: float
    tpot_s: float


@dataclass(frozen=True)
class ClusterConfig:
    """How many instances of which role, and how each schedules.

    ``num_prefill == num_decode == 0``: ``num_colocated`` instances doing both phases.
    ``num_blocks=None`` sizes each instance's KV cache from the cost model's memory
    (``RooflineCostModel.kv_cache_blocks``), or 4096 blocks for a model-less cost model.
    """

    name: str = "colocated"
    num_colocated: int = 1
    num_prefill: int = 0
    num_decode: int = 0
    max_num_batched_tokens: int = 8192      # colocated and decode instances
    enable_chunked_prefill: bool = False
    prefill_max_num_batched_tokens: int = 8192
    prefill_chunked: bool = False
    max_num_seqs: int = 256
    num_blocks: int | None = None
    block_size: int = 16
    max_model_len: int = 8192
    link_bandwidth: float | None = None     # bytes/s; None: the cost model's hardware link
    link_latency_s: float = 0.0
    router: str = "least_loaded"
    tp: int = 1                              # devices per instance (for per-device goodput)

    @property
    def disaggregated(self) -> bool:
        return self.num_prefill > 0 or self.num_decode > 0

    @property
    def num_instances(self) -> int:
        return self.num_prefill + self.num_decode if self.disaggregated else self.num_colocated

    @property
    def num_devices(self) -> int:
        return self.num_instances * self.tp

    def validate(self) -> None:
        if self.disaggregated and (self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError(f"{self.name}: a disaggregated cluster needs >= 1 prefill and >= 1 decode "
                             f"instance, got {self.num_prefill} and {self.num_decode}")
        if not self.disaggregated and self.num_colocated < 1:
            raise ValueError(f"{self.name}: num_colocated must be >= 1")
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; choose from {ROUTERS}")
        if self.link_bandwidth is not None and self.link_bandwidth <= 0:
            raise ValueError("link_bandwidth must be > 0 bytes/s")


def colocated(num_instances: int = 1, chunk: int | None = None, *, name: str | None = None,
              max_model_len: int = 8192, **options) -> ClusterConfig:
    """``num_instances`` engines doing both phases: whole prompts when ``chunk`` is None,
    else chunked prefill with a budget of ``chunk`` tokens per iteration."""
    if chunk is None:
        # Room for the longest prompt *and* a full batch of decodes: a prompt never waits
        # for the decodes to drain (vLLM without chunking runs prompts first instead).
        budget = max_model_len + options.get("max_num_seqs", ClusterConfig.max_num_seqs)
        return ClusterConfig(name or "colocated", num_colocated=num_instances, enable_chunked_prefill=False,
                             max_num_batched_tokens=budget, max_model_len=max_model_len, **options)
    return ClusterConfig(name or "chunked", num_colocated=num_instances, enable_chunked_prefill=True,
                         max_num_batched_tokens=chunk, max_model_len=max_model_len, **options)


def disaggregated(num_prefill: int = 1, num_decode: int = 1, *, name: str | None = None,
                  max_model_len: int = 8192, **options) -> ClusterConfig:
    """``num_prefill`` prefill-only and ``num_decode`` decode-only engines. Prefill instances
    take whole prompts (a budget of ``max_model_len`` tokens); decode instances chunk only
    when a preempted sequence must recompute."""
    options.setdefault("prefill_max_num_batched_tokens", max_model_len)
    options.setdefault("enable_chunked_prefill", True)
    options.setdefault("max_num_batched_tokens", 2048)
    return ClusterConfig(name or "disaggregated", num_prefill=num_prefill, num_decode=num_decode,
                         max_model_len=max_model_len, **options)


def standard_configs(num_prefill: int = 1, num_decode: int = 1, chunk: int = 512,
                     **options) -> list[ClusterConfig]:
    """The chapter's three configurations on the same ``num_prefill + num_decode`` devices:
    colocated (no chunking), colocated with chunked prefill, disaggregated."""
    n = num_prefill + num_decode
    return [colocated(n, None, **options), colocated(n, chunk, **options),
            disaggregated(num_prefill, num_decode, **options)]


# ---- one instance -----------------------------------------------------------------------
class _TimedExecutor(SimExecutor):
    """``SimExecutor`` that also notes when each sampled token leaves (for ITL)."""

    def __init__(self, cost_model, vocab_size: int, token_times: dict[str, list[float]]):
        super().__init__(cost_model, vocab_size)
        self.token_times = token_times
        self.clock = lambda: 0.0

    def execute(self, plan):
        result = super().execute(plan)
        end = self.clock() + result.duration_s
        for item in plan.scheduled:
            if item.num_samples:
                self.token_times.setdefault(item.seq.request.request_id, []).append(end)
        return result


class Instance:
    """One engine of a cluster: allocator + scheduler + simulated executor + its clock."""

    def __init__(self, name: str, role: str, cost_model, *, num_blocks: int, block_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int, enable_chunked_prefill: bool,
                 max_model_len: int, vocab_size: int, keep_records: bool,
                 token_times: dict[str, list[float]]):
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; choose from {ROLES}")
        self.name, self.role = name, role
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.scheduler = Scheduler(self.allocator, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   enable_chunked_prefill=enable_chunked_prefill, max_model_len=max_model_len)
        executor = _TimedExecutor(cost_model, vocab_size, token_times)
        self.engine = Engine(self.scheduler, executor, keep_records=keep_records)
        executor.clock = lambda: self.engine.now
        self.num_requests = 0
        self.inbound = 0                 # KV transfers under way to this instance

    @property
    def now(self) -> float:
        return self.engine.now

    @property
    def busy_s(self) -> float:
        return self.engine.busy_s

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_unfinished

    def load(self) -> tuple:
        """What a least-loaded router compares: for a prefill instance the prompt tokens it
        still has to compute, for the others the requests it holds (then its used blocks)."""
        if self.role == "prefill":
            pending = sum(s.num_uncomputed_tokens for r in self.scheduler.requests.values() for s in r.seqs)
            return (pending, len(self.scheduler.requests))
        return (len(self.scheduler.requests) + self.inbound, self.allocator.num_used_blocks)

    def add(self, request: Request, t: float) -> None:
        """Queue ``request`` at global time ``t`` (an idle instance's clock jumps to ``t``)."""
        if not self.has_work:
            self.engine.advance_to(t)
        self.scheduler.add_request(request)
        self.num_requests += 1

    def step(self) -> list[Request]:
        steps = self.engine.num_steps
        done = self.engine.step()
        if self.engine.num_steps == steps:
            raise RuntimeError(f"{self.name} has unfinished requests but scheduled nothing "
                               f"({self.scheduler.num_waiting} waiting, {self.allocator})")
        return done

    def __repr__(self) -> str:
        return f"Instance({self.name}, {self.role}, now={self.now:.3f}s, requests={len(self.scheduler.requests)})"


# ---- results ----------------------------------------------------------------------------
@dataclass
class ServedRequest:
    """One trace request as its user saw it, across instances."""

    request_id: str
    prompt_len: int
    output_len: int
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)   # when each output token left
    prefill_instance: str = ""
    decode_instance: str = ""
    transfer_s: float = 0.0              # time on the link (0 when colocated)
    transfer_wait_s: float = 0.0         # queued behind other transfers on the same link

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for one-token outputs."""
        if self.output_len < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.output_len - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    def meets(self, slo: SLO) -> bool:
        tpot = self.tpot
        return self.ttft <= slo.ttft_s and (tpot is None or tpot <= slo.tpot_s)


@dataclass
class ClusterResult:
    config: ClusterConfig
    requests: list[ServedRequest]
    instances: list[Instance]
    cost_model: object

    @property
    def makespan_s(self) -> float:
        start = min(r.arrival_time for r in self.requests)
        return max(r.finished_time for r in self.requests) - start

    def ttfts(self) -> list[float]:
        return [r.ttft for r in self.requests]

    def tpots(self) -> list[float]:
        return [t for r in self.requests if (t := r.tpot) is not None]

    def itls(self) -> list[float]:
        return [g for r in self.requests for g in r.itls]

    def utilization(self) -> dict[str, float]:
        """Busy fraction of each instance over the run (first arrival to last finish)."""
        span = self.makespan_s
        return {i.name: (i.busy_s / span if span > 0 else 0.0) for i in self.instances}

    def metrics(self, slo: SLO | None = None) -> dict:
        return summarize_cluster(self, slo)


def summarize_cluster(result: ClusterResult, slo: SLO | None = None) -> dict:
    """TTFT / TPOT / ITL percentiles, SLO attainment and goodput, utilization per pool.

    ``goodput_rps``: requests that met *both* SLOs per second of the run (first arrival to
    last finish), the rate of useful work at this load; ``goodput_per_device_rps`` divides it by
    the devices. DistServe's headline number is a different reading of the same idea, the
    highest *arrival rate* whose attainment stays >= 90 % (``max_goodput``).
    """
    cfg = result.config
    ttft, tpot, itl = result.ttfts(), result.tpots(), result.itls()
    span = result.makespan_s
    util = result.utilization()
    out = {
        "config": cfg.name,
        "instances": cfg.num_instances,
        "devices": cfg.num_devices,
        "pools": ({"prefill": cfg.num_prefill, "decode": cfg.num_decode} if cfg.disaggregated
                  else {"colocated": cfg.num_colocated}),
        "chunk_tokens": cfg.max_num_batched_tokens if cfg.enable_chunked_prefill and not cfg.disaggregated else None,
        "requests": len(result.requests),
        "finished": sum(1 for r in result.requests if r.finished_time is not None),
        "makespan_s": span,
        "output_tok_per_s": sum(r.output_len for r in result.requests) / span if span > 0 else math.nan,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_s"] = percentile(values, q)
    out["itl_max_s"] = max(itl, default=math.nan)
    if cfg.disaggregated:
        out["kv_transfer_mean_s"] = sum(r.transfer_s for r in result.requests) / len(result.requests)
        out["kv_transfer_wait_mean_s"] = sum(r.transfer_wait_s for r in result.requests) / len(result.requests)
    pools: dict[str, list[float]] = {}
    for inst in result.instances:
        pools.setdefault(inst.role, []).append(util[inst.name])
    out["utilization"] = {role: sum(v) / len(v) for role, v in pools.items()}
    out["utilization_per_instance"] = util
    out["num_preemptions"] = sum(i.scheduler.num_preemptions for i in result.instances)
    out["leaked_blocks"] = sum(i.allocator.num_used_blocks for i in result.instances)
    if slo is not None:
        ok = sum(1 for r in result.requests if r.meets(slo))
        out["slo"] = {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}
        out["slo_attainment"] = ok / len(result.requests)
        out["ttft_attainment"] = sum(1 for r in result.requests if r.ttft <= slo.ttft_s) / len(result.requests)
        out["tpot_attainment"] = sum(1 for r in result.requests if r.tpot is None or r.tpot <= slo.tpot_s) \
            / len(result.requests)
        out["goodput_rps"] = ok / span if span > 0 else math.nan
        out["goodput_per_device_rps"] = out["goodput_rps"] / cfg.num_devices
    return out


# ---- the discrete-event driver ------------------------------------------------------------
_ARRIVE, _PREFILLED, _KV_ARRIVES = 0, 1, 2


def serve(trace: list[TraceRequest], config: ClusterConfig, cost_model=None, *,
          prefill_cost_model=None, kv_bytes_per_token: int | None = None, vocab_size: int = 32000,
          keep_records: bool = False, check: bool = True) -> ClusterResult:
    """Serve ``trace`` on the cluster ``config`` describes; every output runs to its trace
    length. ``prefill_cost_model`` (default: ``cost_model``) times the prefill pool, so the
    two pools may differ (DistServe picks each phase's parallelism separately).

    The loop: among the next event (an arrival, a finished prefill, a KV transfer landing)
    and the instance whose clock is furthest behind (among those with work), take whichever
    comes first; an instance steps only after every event up to its clock has been
    delivered, so no instance reacts to the future. An iteration in progress cannot take a
    request that arrives during it: the request waits for the next one, as in a real engine.
    """
    config.validate()
    cost_model = cost_model if cost_model is not None else LinearCostModel()
    prefill_cost_model = prefill_cost_model if prefill_cost_model is not None else cost_model
    if kv_bytes_per_token is None:
        kv_bytes_per_token = getattr(cost_model, "kv_bytes_per_token", None)
    if kv_bytes_per_token is None:       # a model-less cost model: SmolLM2-135M fp32 on the CPU
        kv_bytes_per_token = 2 * 30 * 3 * 64 * 4
    link = config.link_bandwidth
    if link is None:
        hw = getattr(cost_model, "hardware", None)
        link = hw.link_bandwidth if hw is not None else 10e9

    token_times: dict[str, list[float]] = {}

    def make(name: str, role: str, model) -> Instance:
        blocks = config.num_blocks
        if blocks is None:
            blocks = model.kv_cache_blocks(config.block_size) if hasattr(model, "kv_cache_blocks") else 4096
        prefill_only = role == "prefill"
        return Instance(
            name, role, model, num_blocks=blocks, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=(config.prefill_max_num_batched_tokens if prefill_only
                                    else config.max_num_batched_tokens),
            enable_chunked_prefill=config.prefill_chunked if prefill_only else config.enable_chunked_prefill,
            max_model_len=config.max_model_len, vocab_size=vocab_size, keep_records=keep_records,
            token_times=token_times)

    if config.disaggregated:
        front = [make(f"prefill{i}", "prefill", prefill_cost_model) for i in range(config.num_prefill)]
        back = [make(f"decode{i}", "decode", cost_model) for i in range(config.num_decode)]
    else:
        front = [make(f"gpu{i}", "colocated", cost_model) for i in range(config.num_colocated)]
        back = []
    instances = front + back
    rr = {"front": itertools.count(), "back": itertools.count()}

    def route(pool: list[Instance], key: str) -> Instance:
        if config.router == "round_robin" or len(pool) == 1:
            return pool[next(rr[key]) % len(pool)]
        return min(pool, key=lambda inst: inst.load())

    served: dict[str, ServedRequest] = {}
    prompts: dict[str, list[int]] = {}
    link_free = {inst.name: 0.0 for inst in front}
    events: list[tuple[float, int, int, object]] = []
    seq = itertools.count()
    for i, r in enumerate(trace):
        heapq.heappush(events, (r.arrival_s, next(seq), _ARRIVE, i))

    def on_arrival(t: float, i: int) -> None:
        r = trace[i]
        rid = f"r{i}"
        inst = route(front, "front")
        prompt = r.prompt_token_ids(i, vocab_size)
        max_tokens = 1 if config.disaggregated else r.output_len
        request = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
                          arrival_time=r.arrival_s)
        served[rid] = ServedRequest(rid, r.prompt_len, r.output_len, r.arrival_s, prefill_instance=inst.name)
        prompts[rid] = prompt
        inst.add(request, t)

    def on_prefilled(t: float, payload) -> None:
        request, src = payload
        rid = request.request_id
        dst = route(back, "back")
        start = max(t, link_free[src.name])
        duration = len(request.prompt_token_ids) * kv_bytes_per_token / link
        link_free[src.name] = start + duration
        s = served[rid]
        s.transfer_s, s.transfer_wait_s, s.decode_instance = duration, start - t, dst.name
        dst.inbound += 1
        heapq.heappush(events, (start + duration + config.link_latency_s, next(seq), _KV_ARRIVES,
                                (request, dst)))

    def on_kv_arrives(t: float, payload) -> None:
        done, dst = payload
        rid = done.request_id
        r = served[rid]
        request = Request(rid, prompts[rid], SamplingParams(max_tokens=r.output_len, ignore_eos=True,
                                                            temperature=0.0), arrival_time=r.arrival_time)
        seq0 = request.seqs[0]
        seq0.token_ids.append(done.seqs[0].token_ids[-1])     # the first token, from the prefill instance
        seq0.num_external_tokens = r.prompt_len              # the prompt's KV came over the link
        request.first_token_time = done.first_token_time
        dst.inbound -= 1
        dst.add(request, t)

    def finished(inst: Instance, requests: list[Request]) -> None:
        for request in requests:
            s = served[request.request_id]
            if inst.role == "prefill":
                s.first_token_time = request.first_token_time
                if s.output_len > 1:
                    heapq.heappush(events, (inst.now, next(seq), _PREFILLED, (request, inst)))
                    continue
            elif inst.role == "colocated":
                s.first_token_time = request.first_token_time
            s.finished_time = request.finished_time
            s.token_times = token_times.pop(request.request_id, [])

    handlers = {_ARRIVE: on_arrival, _PREFILLED: on_prefilled, _KV_ARRIVES: on_kv_arrives}
    while True:
        busy = [inst for inst in instances if inst.has_work]
        nxt = min(busy, key=lambda inst: inst.now) if busy else None
        if events and (nxt is None or events[0][0] <= nxt.now):
            t, _, kind, payload = heapq.heappop(events)
            handlers[kind](t, payload)
        elif nxt is not None:
            finished(nxt, nxt.step())
        else:
            break

    # (Disaggregated: a request's token times hold the prefill instance's first token, then
    # the decode instance's, since both executors note them under the same request id.)
    result = ClusterResult(config, [served[f"r{i}"] for i in range(len(trace))], instances, cost_model)
    if check:
        check_cluster(result)
    return result


def check_cluster(result: ClusterResult) -> None:
    """Every request finished with all its tokens, no instance holds a block, each pool's
    allocator keeps its invariants. Raises ``AssertionError`` otherwise."""
    for inst in result.instances:
        inst.allocator.check_invariants()
        assert inst.allocator.num_used_blocks == 0, f"{inst.name} leaked {inst.allocator.num_used_blocks} blocks"
        assert not inst.scheduler.has_unfinished, f"{inst.name} still has requests"
    for r in result.requests:
        assert r.finished_time is not None and r.first_token_time is not None, f"{r.request_id} did not finish"
        assert len(r.token_times) == r.output_len, (r.request_id, len(r.token_times), r.output_len)
        assert r.arrival_time <= r.first_token_time <= r.finished_time


# ---- workloads and sweeps ---------------------------------------------------------------
def workload_trace(num_requests: int = 200, rate: float | None = 10.0, prompt_mean: float = 1024,
                   output_mean: float = 128, sigma: float = 0.5, seed: int = 0,
                   max_len: int = 8192) -> list[TraceRequest]:
    """A trace with log-normal prompt and output lengths of the given means and Poisson
    arrivals: long prompts and moderate outputs (summarization, RAG, long chats) are where
    prefill-decode interference bites. ``sigma=0`` gives fixed lengths."""
    rng = random.Random(seed)
    arrivals = poisson_arrivals(num_requests, rate, seed)
    trace = []
    for t in arrivals:
        if sigma > 0:
            p = _lognormal(rng, prompt_mean, sigma, 1, max_len - 2)
            o = _lognormal(rng, output_mean, sigma, 1, max_len - 1 - p)
        else:
            p, o = int(prompt_mean), int(output_mean)
        trace.append(TraceRequest(p, o, t))
    return trace


def compare(trace: list[TraceRequest], configs: list[ClusterConfig], cost_model=None,
            slo: SLO | None = None, **kwargs) -> dict[str, dict]:
    """``serve`` the same trace under each configuration; their metrics by name."""
    return {cfg.name: serve(trace, cfg, cost_model, **kwargs).metrics(slo) for cfg in configs}


def steady_trace(rate: float, duration_s: float = 5.0, min_requests: int = 50, seed: int = 0,
                 **trace_kwargs) -> list[TraceRequest]:
    """A trace that lasts ``duration_s`` seconds of arrivals at ``rate`` (at least
    ``min_requests``): comparing rates needs equal durations, not equal counts, or the high
    rates become short bursts that end before the queues build up."""
    n = max(min_requests, math.ceil(rate * duration_s))
    return workload_trace(n, rate, seed=seed, **trace_kwargs)


def attainment_curve(config: ClusterConfig, rates: list[float], slo: SLO, cost_model=None, *,
                     duration_s: float = 5.0, min_requests: int = 50, seed: int = 0,
                     **trace_kwargs) -> list[float]:
    """SLO attainment (fraction of requests meeting both SLOs) at each arrival rate:
    DistServe's figures. The same seed draws the same lengths at every rate."""
    return [serve(steady_trace(rate, duration_s, min_requests, seed, **trace_kwargs), config,
                  cost_model).metrics(slo)["slo_attainment"] for rate in rates]


def max_goodput(config: ClusterConfig, slo: SLO, cost_model=None, *, target: float = 0.9,
                low: float = 0.1, high: float = 100.0, iterations: int = 8, duration_s: float = 10.0,
                min_requests: int = 50, seed: int = 0, per_device: bool = True, **trace_kwargs) -> float:
    """DistServe's goodput: the highest arrival rate (requests/s) whose SLO attainment is
    at least ``target``, found by bisection over traces of ``duration_s`` seconds (per
    device when ``per_device``). Assumes attainment falls as the rate grows (true here up to
    sampling noise). Each probe is a full simulation: long durations at high rates are slow."""
    def ok(rate: float) -> bool:
        trace = steady_trace(rate, duration_s, min_requests, seed, **trace_kwargs)
        return serve(trace, config, cost_model).metrics(slo)["slo_attainment"] >= target

    if not ok(low):
        return 0.0
    while ok(high):
        if high > 1e5:
            raise ValueError("attainment stays above target at any rate: is the trace too short?")
        low, high = high, high * 2
    for _ in range(iterations):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if ok(mid) else (low, mid)
    return low / config.num_devices if per_device else low


def rate_at_attainment(rates: list[float], attainment: list[float], target: float = 0.9) -> float:
    """Read goodput off an attainment curve: the rate where attainment falls through
    ``target``, interpolated linearly between the measured rates (0 if even the lowest
    rate misses it, the highest rate if none does)."""
    pairs = sorted(zip(rates, attainment))
    if not pairs or pairs[0][1] < target:
        return 0.0
    for (r0, a0), (r1, a1) in zip(pairs, pairs[1:]):
        if a1 < target:
            return r0 + (r1 - r0) * (a0 - target) / (a0 - a1)
    return pairs[-1][0]


def with_name(config: ClusterConfig, name: str) -> ClusterConfig:
    return replace(config, name=name)
