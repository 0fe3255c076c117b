"""Benchmark one engine iteration: ``python -m labkit.bench step``.

Times the model runner on two steps, a batch of decodes and a prefill (one long prompt, or
``--prompts N`` fresh prompts of ``--prefill`` tokens each in one step: a wave of requests):

    python -m labkit.bench step                      # smollm2-135m, batch 64 at context 400, 512-token prefill
    python -m labkit.bench step --batch 8 --context 128 --prefill 128 --prompts 8   # a class's wave of eight
    python -m labkit.bench step --model tiny-llama --batch 8 --context 100

Reports the median wall time of each step over a few repetitions (after a warm-up), with
the share spent in attention (all three paged ops) measured separately, and the process's
CPU time. Where ``kernels`` times one attention call in isolation and ``serve`` a whole
workload, this says what a step costs and how much of it attention is.

On a shared machine run it with ``OMP_NUM_THREADS=1``: one thread's CPU time does not
suffer from other processes, while OpenMP threads that spin-wait for a busy core do.

``--ops`` adds where the time of each step goes, op by op (``op_breakdown``): matrix
multiplies, attention, the element-wise rest (embedding, norms, RoPE, SwiGLU, residual
adds), sampling, scheduling and tensor building, Python in between; each with its floor,
the time it would take at this machine's measured matmul peak (FLOPs) or read bandwidth
(bytes), whichever is longer. ``--markdown`` prints those tables as in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import replace

import torch

from ..model.runner import ModelRunner, SeqChunk
from ..utils import cdiv


class _WrappedOps:
    """An attention backend with each of its three calls passed through ``_around`` (what a
    subclass does around a call: time it, label it). Keyword arguments pass through: a
    quantized cache's ``k_scales``, ``v_scales``."""

    def __init__(self, ops):
        self.ops, self.name = ops, getattr(ops, "name", "ops")

    def _around(self, fn, *a, **kw):
        raise NotImplementedError

    def reshape_and_cache(self, *a, **kw):
        return self._around(self.ops.reshape_and_cache, *a, **kw)

    def decode(self, *a, **kw):
        return self._around(self.ops.decode, *a, **kw)

    def prefill(self, *a, **kw):
        return self._around(self.ops.prefill, *a, **kw)


class _TimedOps(_WrappedOps):
    """Wraps an attention backend and accumulates the time spent in it."""

    def __init__(self, ops):
        super().__init__(ops)
        self.seconds, self.cpu_seconds = 0.0, 0.0

    def _around(self, fn, *a, **kw):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn(*a, **kw)
        self.seconds += time.perf_counter() - t0
        self.cpu_seconds += time.process_time() - c0
        return out

    @property
    def fused(self):
        """The CPU backend's fused ops, if any; its rotary + cache write counts as attention
        (it is the cache write), the norm and SwiGLU ops do not."""
        f = getattr(self.ops, "fused", None)
        return None if f is None else replace(f, rope_and_cache=lambda *a: self._around(f.rope_and_cache, *a))


def bench_chunks(runner: ModelRunner, batch: int = 64, context: int = 400, prefill: int = 512,
                 seed: int = 0, prompts: int = 1) -> tuple[list[SeqChunk], list[SeqChunk]]:
    """The two benchmark steps: ``batch`` decodes at ``context`` tokens (blocks scattered
    over the cache, as after a while of serving) and ``prompts`` fresh ``prefill``-token prompts."""
    rng = random.Random(seed)
    bs = runner.block_size
    vocab = runner.vocab_size
    per_seq, per_prompt = cdiv(context, bs), cdiv(prefill, bs)
    if batch * per_seq > runner.num_blocks or prompts * per_prompt > runner.num_blocks:
        raise ValueError(f"the KV cache ({runner.num_blocks} blocks) is too small for this benchmark")
    blocks = list(range(runner.num_blocks))
    rng.shuffle(blocks)
    decode = [SeqChunk([rng.randrange(vocab)], context - 1, blocks[i * per_seq:(i + 1) * per_seq])
              for i in range(batch)]
    pre = [SeqChunk([rng.randrange(vocab) for _ in range(prefill)], 0, blocks[i * per_prompt:(i + 1) * per_prompt])
           for i in range(prompts)]
    return decode, pre


def step_timings(runner: ModelRunner, batch: int = 64, context: int = 400, prefill: int = 512,
                 repeats: int = 5, seed: int = 0, prompts: int = 1) -> dict:
    """Median seconds of a decode step (``batch`` sequences at ``context`` tokens) and of a
    step prefilling ``prompts`` fresh ``prefill``-token prompts, each with the part spent in
    attention ops."""
    decode, pre = bench_chunks(runner, batch, context, prefill, seed, prompts)
    timed = _TimedOps(runner.ops)
    ops, runner.ops = runner.ops, timed
    try:
        out = {}
        for name, chunks in (("decode", decode), ("prefill", pre)):
            runner.execute(chunks)  # warm-up
            walls, cpus, attn, attn_cpu = [], [], [], []
            for _ in range(repeats):
                timed.seconds = timed.cpu_seconds = 0.0
                t0, c0 = time.perf_counter(), time.process_time()
                runner.execute(chunks)
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
                attn.append(timed.seconds)
                attn_cpu.append(timed.cpu_seconds)
            out[f"{name}_s"] = statistics.median(walls)
            out[f"{name}_attention_s"] = statistics.median(attn)
            # CPU seconds of this process: with one thread, a contention-proof measure of the work
            out[f"{name}_cpu_s"] = statistics.median(cpus)
            out[f"{name}_attention_cpu_s"] = statistics.median(attn_cpu)
    finally:
        runner.ops = ops
    out.update(batch=batch, context=context, prefill_tokens=prefill, prefill_prompts=prompts,
               threads=torch.get_num_threads(), backend=runner.attention_backend, model=runner.name)
    out["decode_tok_per_s"] = batch / out["decode_s"]
    out["prefill_tok_per_s"] = prompts * prefill / out["prefill_s"]
    return out


# ---- where the time goes, op by op ------------------------------------------------------

# Top-level torch ops that are matrix multiplies (their children, e.g. aten::mm under
# aten::matmul, are inside them). Everything else that is not attention is element-wise.
_PANELS = "labkit::linear_panels"  # labkit's C++ matmul (kernels/linear_cpu.py), labelled by _LabelledPanels
_MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "aten::bmm",
               "mkldnn::_linear_pointwise", "mkl::_mkl_linear", _PANELS}
_ATTENTION = "labkit::attention"
_FUSED = "labkit::fused"  # the CPU backend's fused rotary + cache write, add + RMSNorm, SiLU * up


class _ProfiledOps(_WrappedOps):
    """Wraps an attention backend so that each call is one labelled profiler range."""

    def _around(self, fn, *a, **kw):
        with torch.profiler.record_function(_ATTENTION):
            return fn(*a, **kw)

    @property
    def fused(self):
        """The CPU backend's fused element-wise ops (C++, invisible to the profiler on their
        own), each labelled: they count as element-wise."""
        f = getattr(self.ops, "fused", None)
        if f is None:
            return None

        def labelled(fn):
            def call(*a):
                with torch.profiler.record_function(_FUSED):
                    return fn(*a)
            return call
        return replace(f, rope_and_cache=labelled(f.rope_and_cache), add_rms_norm=labelled(f.add_rms_norm),
                       silu_and_mul=labelled(f.silu_and_mul))


class _LabelledPanels:
    """A ``Linear``'s compiled module with its multiply in a labelled profiler range: a call
    into the C++ extension is invisible to the profiler on its own."""

    def __init__(self, ext):
        self.ext = ext

    def linear_panels(self, *a):
        with torch.profiler.record_function(_PANELS):
            return self.ext.linear_panels(*a)

    def linear_panels_silu_mul(self, *a):
        """The MLP's gate/up multiply with SiLU * up fused in (``Linear.silu_mul``): counted as
        matmul, its element-wise epilogue included (a few percent of it)."""
        with torch.profiler.record_function(_PANELS):
            return self.ext.linear_panels_silu_mul(*a)


def machine_peaks(dtype: torch.dtype = torch.float32, seconds: float = 0.5) -> dict:
    """This process's measured ceilings: matmul GFLOP/s in ``dtype`` (a [512, 1536] x
    [1536, 576] multiply, the MLP's down projection at prefill) and read bandwidth in GB/s
    (summing 256 MiB, far larger than any cache), at the current thread count. With one
    thread the clock is the process's CPU time, which other processes on the machine do not
    inflate (they still share its memory bandwidth)."""
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter

    def rate(fn, work):
        fn()
        n, t0 = 0, clock()
        while clock() - t0 < seconds:
            fn()
            n += 1
        return work * n / (clock() - t0)

    a, b = torch.randn(512, 1536).to(dtype), torch.randn(1536, 576).to(dtype)
    big = torch.ones(64 << 20, dtype=torch.float32)
    return {"matmul_gflops": rate(lambda: a @ b, 2 * 512 * 1536 * 576 / 1e9),
            "read_gbps": rate(big.sum, big.numel() * 4 / 1e9)}


def _floors(runner: ModelRunner, chunks: list[SeqChunk], peaks: dict) -> dict:
    """Seconds each op category takes at least: max(FLOPs / matmul peak, bytes / bandwidth)."""
    s, cfg = runner.spec, runner.kv_cache
    item = torch.empty((), dtype=runner.dtype).element_size()
    tokens = sum(len(c.token_ids) for c in chunks)
    rows = sum(c.compute_logits for c in chunks)
    hd, kvd = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    layer_params = s.hidden_size * (hd + 2 * kvd) + hd * s.hidden_size + 3 * s.hidden_size * s.intermediate_size
    head_params = s.vocab_size * s.hidden_size
    flops = 2 * tokens * layer_params * s.num_layers + 2 * rows * head_params
    weight_bytes = (layer_params * s.num_layers + head_params) * item
    peak, bw = peaks["matmul_gflops"] * 1e9, peaks["read_gbps"] * 1e9
    # Attention: every query reads its whole context's K and V once, and does 4 * d FLOPs per
    # (query head, key): scores and weighted values.
    keys = sum(sum(c.num_computed_tokens + j + 1 for j in range(len(c.token_ids))) for c in chunks)
    context = sum(c.num_computed_tokens + len(c.token_ids) for c in chunks)
    kv_bytes = 2 * s.num_layers * context * kvd * cfg.data.element_size()
    attn_flops = 4 * s.num_layers * keys * hd
    # Element-wise: per layer each token's activations pass through memory about 16 times
    # (two norms, RoPE, SwiGLU, two residual adds: reads and writes), and the cache write.
    elem_bytes = tokens * s.num_layers * item * (16 * s.hidden_size + 3 * s.intermediate_size + 2 * kvd)
    return {"matmul": max(flops / peak, weight_bytes / bw),
            "attention": max(attn_flops / peak, kv_bytes / bw),
            "elementwise": elem_bytes / bw,
            "sampling": rows * s.vocab_size * 4 / bw,
            "flops": flops, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "attn_flops": attn_flops}


def _scheduling_seconds(batch: int, context: int, block_size: int, steps: int = 20) -> float:
    """Seconds of schedule() + update() per decode step at ``batch`` sequences of ``context``
    tokens: the real scheduler and block manager, driven by the simulator's executor."""
    from ..engine import Engine
    from ..memory import BlockAllocator
    from ..sampling_params import SamplingParams
    from ..scheduler import make_scheduler
    from ..sim.executor import SimExecutor

    num_blocks = batch * (cdiv(context + steps + 2, block_size) + 1)
    sched = make_scheduler("continuous", BlockAllocator(num_blocks, block_size), max_num_seqs=batch,
                           max_num_batched_tokens=max(2048, context * batch), max_model_len=context + steps + 8)
    engine = Engine(sched, SimExecutor(), keep_records=False)
    for i in range(batch):
        engine.add_request([(7 * i + j) % 1000 for j in range(context - 1)],
                           SamplingParams(max_tokens=steps + 2, ignore_eos=True))
    engine.step()  # the prefills
    engine.schedule_s, engine.num_steps = 0.0, 0
    c0 = time.process_time()
    for _ in range(steps):
        engine.step()
    if torch.get_num_threads() == 1:  # CPU time of whole steps (the simulator's executor is ~free)
        return (time.process_time() - c0) / steps
    return engine.schedule_s / engine.num_steps


def op_breakdown(runner: ModelRunner, chunks: list[SeqChunk], peaks: dict, repeats: int = 3) -> dict:
    """Where one step's time goes: median seconds per category over ``repeats`` profiled
    runs (after a warm-up), the step's unprofiled wall time, and each category's floor.

    Categories: ``matmul`` (every projection and the LM head), ``attention`` (the backend's
    three paged ops, cache write included), ``elementwise`` (embedding, norms, RoPE, SwiGLU,
    residual adds, gathers of the logits rows), ``python`` (the forward pass's wall time not
    inside any op: Python and dispatch), ``tensor_building`` (``runner.prepare``: packing
    the chunks into index tensors), ``sampling`` (fp32 logits and greedy argmax).
    ``scheduling`` is added by the caller (it needs an engine, not a runner).

    With one thread the forward pass's categories are in CPU time: on a shared machine the
    profiler's wall times include the moments the thread waited for a core, which fall on
    every op alike, so each run's categories are scaled by its CPU time / wall time;
    tensor building, sampling and scheduling are measured in CPU time directly.
    """
    from ..model.sampler import SamplingRow, sample

    rows = [SamplingRow() for c in chunks if c.compute_logits]
    one_thread = torch.get_num_threads() == 1
    from ..model.llama import Linear
    ops, runner.ops = runner.ops, _ProfiledOps(runner.ops)
    on_panels = [m for m in runner.model.modules() if isinstance(m, Linear) and m.panels is not None]
    for m in on_panels:
        m._ext = _LabelledPanels(m._ext)
    samples: dict[str, list[float]] = {}
    try:
        with torch.inference_mode():
            for r in range(repeats + 1):
                t0, c0 = time.perf_counter(), time.process_time()
                input_ids, positions, meta, logits_indices = runner.prepare(chunks)
                t1, c1 = time.perf_counter(), time.process_time()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    logits = runner.model(input_ids, positions, meta, runner.kv_cache, runner.ops, logits_indices)
                t2, c2 = time.perf_counter(), time.process_time()
                sample(logits.float(), rows)
                t3, c3 = time.perf_counter(), time.process_time()
                if r == 0:
                    continue  # warm-up
                cats = {"matmul": 0.0, "attention": 0.0, "elementwise": 0.0}
                for e in prof.events():
                    if e.cpu_parent is not None:
                        continue
                    cat = ("attention" if e.name == _ATTENTION else
                           "matmul" if e.name in _MATMUL_OPS else "elementwise")
                    cats[cat] += e.cpu_time_total / 1e6
                cats["python"] = max(0.0, (t2 - t1) - sum(cats.values()))
                if one_thread:  # see cpu_time_seconds: the waits for a core fall on every op alike
                    scale = min(1.0, (c2 - c1) / (t2 - t1))
                    cats = {k: v * scale for k, v in cats.items()}
                cats["tensor_building"] = (c1 - c0) if one_thread else (t1 - t0)
                cats["sampling"] = (c3 - c2) if one_thread else (t3 - t2)
                for k, v in cats.items():
                    samples.setdefault(k, []).append(v)
    finally:
        runner.ops = ops
        for m in on_panels:
            m._ext = m._ext.ext
    out = {k: statistics.median(v) for k, v in samples.items()}
    floors = _floors(runner, chunks, peaks)
    return {"seconds": out, "floors": {k: floors[k] for k in ("matmul", "attention", "elementwise", "sampling")},
            "work": {k: floors[k] for k in ("flops", "weight_bytes", "kv_bytes", "attn_flops")}}


def _bound(measured: float, floor: float) -> str:
    return f"{floor / measured:.0%} of floor speed" if floor and measured else "overhead (no floor)"


def markdown_tables(result: dict) -> str:
    """The ``--ops`` breakdown as markdown tables, one per step kind."""
    peaks = result["peaks"]
    one = result.get("threads") == 1
    lines = [f"Machine ceilings measured in this run: matmul {peaks['matmul_gflops']:.0f} GFLOP/s "
             f"({result['dtype']}, {result['threads']} thread{'s' * (not one)}), read bandwidth "
             f"{peaks['read_gbps']:.1f} GB/s" + (" (CPU time: one thread)." if one else ".")]
    for kind in ("decode", "prefill"):
        b = result[f"{kind}_ops"]
        sec, floors = b["seconds"], b["floors"]
        total = sum(sec.values())
        prompts = result.get("prefill_prompts", 1)
        what = (f"decode step, batch {result['batch']}, context {result['context']}" if kind == "decode"
                else f"prefill step, {'one' if prompts == 1 else prompts} {result['prefill_tokens']}-token "
                     f"prompt{'s' * (prompts > 1)}")
        step = result[f"{kind}_cpu_s" if one else f"{kind}_s"]
        lines += ["", f"**{what}**: {total * 1e3:.0f} ms in all "
                  f"(the step alone {step * 1e3:.0f} ms{' CPU' if one else ''}, then sampling and scheduling)", "",
                  "| op | ms | share | floor ms | bound by | at |", "|---|---|---|---|---|---|"]
        bound = {"matmul": "FLOPs" if b["work"]["flops"] / (peaks["matmul_gflops"] * 1e9)
                 >= b["work"]["weight_bytes"] / (peaks["read_gbps"] * 1e9) else "weight bytes",
                 "attention": "FLOPs" if b["work"]["attn_flops"] / (peaks["matmul_gflops"] * 1e9)
                 >= b["work"]["kv_bytes"] / (peaks["read_gbps"] * 1e9) else "KV bytes",
                 "elementwise": "activation bytes", "sampling": "logits bytes"}
        for k in ("matmul", "attention", "elementwise", "sampling", "scheduling", "tensor_building", "python"):
            ms = sec.get(k, 0.0) * 1e3
            fl = floors.get(k)
            lines.append(f"| {k.replace('_', ' ')} | {ms:.1f} | {sec.get(k, 0.0) / total:.0%} | "
                         f"{'' if fl is None else f'{fl * 1e3:.1f}'} | {bound.get(k, '-')} | "
                         f"{_bound(sec.get(k, 0.0), fl) if fl is not None else 'overhead (no floor)'} |")
    return "\n".join(lines)


def _rounded(x):
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return round(x, 4) if isinstance(x, float) else x


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit.bench step", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--prefill", type=int, default=512, help="tokens of each prompt of the prefill step")
    p.add_argument("--prompts", type=int, default=1, help="fresh prompts in the prefill step (default 1)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--backend", default="auto")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ops", action="store_true", help="add the per-op breakdown with floors")
    p.add_argument("--markdown", action="store_true", help="print the --ops tables as markdown")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    a.ops = a.ops or a.markdown
    dtype = getattr(torch, a.dtype)
    if a.prompts < 1:
        raise SystemExit("--prompts must be at least 1")
    need = max(a.batch * cdiv(a.context, a.block_size), a.prompts * cdiv(a.prefill, a.block_size)) + 1
    runner = ModelRunner(a.model, block_size=a.block_size, num_blocks=need, attention_backend=a.backend,
                         dtype=dtype)
    r = step_timings(runner, a.batch, a.context, a.prefill, a.repeats, prompts=a.prompts)
    if a.ops:
        r.update(dtype=a.dtype, peaks=machine_peaks(dtype))
        decode, pre = bench_chunks(runner, a.batch, a.context, a.prefill, prompts=a.prompts)
        for kind, chunks in (("decode", decode), ("prefill", pre)):
            r[f"{kind}_ops"] = op_breakdown(runner, chunks, r["peaks"], repeats=a.repeats)
        r["decode_ops"]["seconds"]["scheduling"] = _scheduling_seconds(a.batch, a.context, a.block_size)
        r["prefill_ops"]["seconds"]["scheduling"] = _scheduling_seconds(a.prompts, a.prefill, a.block_size)
    if a.markdown:
        print(markdown_tables(r))
        return 0
    print(json.dumps(_rounded(r), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
