"""Benchmark prefill attention on a CPU: ``python -m labkit.bench prefill``.

Times one attention call of a prefill step (one layer's; the report also gives it times the
model's layers) for a few chunk shapes, by each of:

* ``tiles``: the CPU backend's kernel (``kernels/csrc/prefill_attention.cpp``): eight query
  rows at a time, scores as a register-tiled multiply against key panels, an exact softmax,
  then the values (a chunk of fewer than eight rows goes to the row loop, as in the engine);
  a bf16 cache on a CPU with AMX: sixteen rows at a time, both multiplies on the matrix unit;
* ``tiles-fp32``: the same kernel told not to use AMX (``amx=False``): a bf16 cache's tiles
  widened to fp32 and multiplied on AVX-512, what a CPU without AMX runs (with an fp32 cache,
  or where AMX is not there, the same as ``tiles``);
* ``rows``: the decode loop run once per query row (``paged_prefill_attention_rows``), the
  simplest correct prefill on the paged cache: every row reads its whole context again;
* ``sdpa``: the backend's path for long contexts: the chunk's context gathered from the cache,
  then torch's fused ``scaled_dot_product_attention`` (causal, or with a mask after a prefix);
* ``reference``: ``paged_prefill_attention_ref``, the plain torch reference the others are
  tested against.

A shape is ``NxL`` (N fresh prompts of L tokens, each its own chunk: a wave of requests),
``L@P`` (a chunk of L tokens after P tokens already in the cache: chunked prefill, a prefix-cache
hit), or ``NxL@P`` (N such chunks). The methods are timed in turn, call by call, so that a busy
machine slows them alike; medians of ``--repeats``. GFLOP/s counts the causal part only, what any of them must compute:
4 x head_dim FLOPs per query head and key it sees (q.k and p.v, a multiply and an add each).

    python -m labkit.bench prefill                       # SmolLM2-135M's heads, fp32
    python -m labkit.bench prefill --shapes 8x128 512@1536 --methods tiles rows
    python -m labkit.bench prefill --dtype bfloat16 --methods tiles tiles-fp32 sdpa   # AMX against AVX-512
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

import torch

from labkit.bench import time_in_turn
from labkit.kernels import cpu_extension

# The module (labkit.kernels exports a function of the same name): its TILES_MAX_CONTEXT is read per call.
prefill = importlib.import_module("labkit.kernels.paged_prefill_attention")

DEFAULT_SHAPES = ["1x128", "8x128", "1x512", "128@384", "32x1@500", "1x1024", "512@1536", "1x2048"]
METHODS = ("tiles", "tiles-fp32", "rows", "sdpa", "reference")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_shape(shape: str) -> list[tuple[int, int]]:
    """``"8x128"`` -> eight (prefix 0, chunk 128); ``"512@1536"`` -> [(1536, 512)];
    ``"16x1@500"`` -> sixteen one-token chunks after 500 cached tokens each."""
    try:
        count, x, rest = shape.rpartition("x")
        length, at, before = rest.partition("@")
        chunks = [(int(before) if at else 0, int(length))] * (int(count) if x else 1)
    except ValueError:
        raise ValueError(f"shape {shape!r}: write NxL (N fresh prompts of L tokens), L@P (a chunk of L "
                         "tokens after P in the cache) or NxL@P") from None
    if not chunks or any(n <= 0 or p < 0 for p, n in chunks):
        raise ValueError(f"shape {shape!r}: lengths and counts must be positive")
    return chunks


def batch(chunks: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, block_size: int,
          dtype: torch.dtype, seed: int = 0):
    """A paged cache holding each sequence's context in scattered blocks, and the chunks' queries."""
    g = torch.Generator().manual_seed(seed)
    lens = [p + n for p, n in chunks]
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + 1
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(chunks), max(per_seq), dtype=torch.int32)
    for s, n in enumerate(per_seq):
        tables[s, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    starts = torch.tensor([0] + [n for _, n in chunks], dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(int(starts[-1]), heads, head_dim, generator=g)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32), starts


def causal_flops(chunks: list[tuple[int, int]], heads: int, head_dim: int) -> int:
    """Multiply-adds x 2 of q.k and p.v over the keys each query row sees."""
    seen = sum(n * p + n * (n + 1) // 2 for p, n in chunks)
    return 4 * head_dim * heads * seen


def methods_for(ext, chunks, q, k, v, tables, lens, starts, scale: float) -> dict:
    """Each method as a call of no arguments on this batch."""
    row_seq = torch.cat([torch.full((n,), s, dtype=torch.int32) for s, (_, n) in enumerate(chunks)])
    row_lens = torch.cat([torch.arange(p + 1, p + n + 1, dtype=torch.int32) for p, n in chunks])

    def sdpa():
        saved, prefill.TILES_MAX_CONTEXT = prefill.TILES_MAX_CONTEXT, -1     # every chunk on the long path
        try:
            return prefill.paged_prefill_attention_cpu(q, k, v, tables, lens, starts, scale)
        finally:
            prefill.TILES_MAX_CONTEXT = saved

    return {"tiles": lambda: ext.paged_prefill_attention_tiles(q, k, v, tables, lens, starts, scale),
            "tiles-fp32": lambda: ext.paged_prefill_attention_tiles(q, k, v, tables, lens, starts, scale, amx=False),
            "rows": lambda: ext.paged_prefill_attention_rows(q, k, v, tables, row_lens, row_seq, scale),
            "sdpa": sdpa,
            "reference": lambda: prefill.paged_prefill_attention_ref(q, k, v, tables, lens, starts, scale)}


def run(shapes: list[str], methods=METHODS, heads: int = 9, kv_heads: int = 3, head_dim: int = 64,
        block_size: int = 16, dtype: str = "float32", repeats: int = 9, layers: int = 30) -> dict:
    ext = cpu_extension.load()
    if ext is None and {"tiles", "tiles-fp32", "rows"} & set(methods):
        raise SystemExit(f"labkit's C++ kernels are not built here: {cpu_extension.status()[1]}")
    amx = ext is not None and dtype == "bfloat16" and bool(ext.amx_tiles())
    out = {"isa": ext.isa() if ext is not None else None, "amx": amx, "threads": torch.get_num_threads(),
           "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "block_size": block_size, "dtype": dtype,
           "layers": layers,
           "shapes": {}}
    for shape in shapes:
        chunks = parse_shape(shape)
        q, k, v, tables, lens, starts = batch(chunks, heads, kv_heads, head_dim, block_size, DTYPES[dtype])
        fns = {m: f for m, f in methods_for(ext, chunks, q, k, v, tables, lens, starts, head_dim ** -0.5).items()
               if m in methods}
        ms = time_in_turn(fns, warmup=1, repeats=repeats)
        flops = causal_flops(chunks, heads, head_dim)
        out["shapes"][shape] = {m: {"ms": round(t, 3), "model_ms": round(t * layers, 1),
                                    "gflop_per_s": round(flops / t / 1e6, 1)}
                                for m, t in ms.items()}
    return out


def table(result: dict) -> str:
    names = list(next(iter(result["shapes"].values())))
    lines = [f"prefill attention, {result['heads']} query / {result['kv_heads']} KV heads of {result['head_dim']}, "
             f"block size {result['block_size']}, {result['dtype']} cache, {result['threads']} threads, "
             f"C++ build {result['isa']}{', AMX tiles' if result.get('amx') else ''}; "
             f"ms per layer (x {result['layers']} layers), GFLOP/s of the causal part",
             "", "| shape | " + " | ".join(f"{n} ms (x{result['layers']}, GFLOP/s)" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for shape, row in result["shapes"].items():
        lines.append(f"| {shape} | " + " | ".join(f"{row[n]['ms']} ({row[n]['model_ms']}, {row[n]['gflop_per_s']})"
                                                for n in names) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit.bench prefill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES,
                   help="NxL: N fresh prompts of L tokens; L@P: a chunk of L tokens after P cached ones")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--heads", type=int, default=9, help="query heads (default 9: SmolLM2-135M)")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the KV cache's dtype")
    p.add_argument("--layers", type=int, default=30, help="layers a step runs (the report multiplies by it)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        for shape in args.shapes:
            parse_shape(shape)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    result = run(args.shapes, args.methods, args.heads, args.kv_heads, args.head_dim, args.block_size, args.dtype,
                 args.repeats, args.layers)
    print(json.dumps(result, indent=1) if args.json else table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
