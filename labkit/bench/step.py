"""Benchmark one engine iteration: ``python -m labkit.bench step``.

Times the model runner on two steps, a batch of decodes and one long prefill:

    python -m labkit.bench step                      # smollm2-135m, batch 64 at context 400, 512-token prefill
    python -m labkit.bench step --model tiny-llama --batch 8 --context 100

Reports the median wall time of each step over a few repetitions (after a warm-up), with
the share spent in attention (all three paged ops) measured separately, and the process's
CPU time. Where ``kernels`` times one attention call in isolation and ``serve`` a whole
workload, this says what a step costs and how much of it attention is.

On a shared machine run it with ``OMP_NUM_THREADS=1``: one thread's CPU time does not
suffer from other processes, while OpenMP threads that spin-wait for a busy core do.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from ..model.runner import ModelRunner, SeqChunk
from ..utils import cdiv


class _TimedOps:
    """Wraps an attention backend and accumulates the time spent in it."""

    def __init__(self, ops):
        self.ops, self.name, self.seconds, self.cpu_seconds = ops, getattr(ops, "name", "ops"), 0.0, 0.0

    def _timed(self, fn, *a):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn(*a)
        self.seconds += time.perf_counter() - t0
        self.cpu_seconds += time.process_time() - c0
        return out

    def reshape_and_cache(self, *a):
        return self._timed(self.ops.reshape_and_cache, *a)

    def decode(self, *a):
        return self._timed(self.ops.decode, *a)

    def prefill(self, *a):
        return self._timed(self.ops.prefill, *a)


def step_timings(runner: ModelRunner, batch: int = 64, context: int = 400, prefill: int = 512,
                 repeats: int = 5, seed: int = 0) -> dict:
    """Median seconds of a decode step (``batch`` sequences at ``context`` tokens) and of a
    ``prefill``-token prompt, each with the part spent in attention ops."""
    rng = random.Random(seed)
    bs = runner.block_size
    vocab = runner.vocab_size
    per_seq = cdiv(context, bs)
    if batch * per_seq > runner.num_blocks or cdiv(prefill, bs) > runner.num_blocks:
        raise ValueError(f"the KV cache ({runner.num_blocks} blocks) is too small for this benchmark")
    blocks = list(range(runner.num_blocks))
    rng.shuffle(blocks)
    decode = [SeqChunk([rng.randrange(vocab)], context - 1, blocks[i * per_seq:(i + 1) * per_seq])
              for i in range(batch)]
    pre = [SeqChunk([rng.randrange(vocab) for _ in range(prefill)], 0, blocks[: cdiv(prefill, bs)])]
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
    out.update(batch=batch, context=context, prefill_tokens=prefill, threads=torch.get_num_threads(),
               backend=runner.attention_backend, model=runner.name)
    out["decode_tok_per_s"] = batch / out["decode_s"]
    out["prefill_tok_per_s"] = prefill / out["prefill_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m labkit.bench step", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--backend", default="auto")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    need = max(a.batch * cdiv(a.context, a.block_size), cdiv(a.prefill, a.block_size)) + 1
    runner = ModelRunner(a.model, block_size=a.block_size, num_blocks=need, attention_backend=a.backend,
                         dtype=dtype)
    r = step_timings(runner, a.batch, a.context, a.prefill, a.repeats)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
