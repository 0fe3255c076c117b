"""Benchmark paged decode attention: ``python -m labkit.bench kernels``.

On a CUDA GPU (compute capability 7.5+) it times the Triton decode kernel over a grid of
batch sizes and context lengths and reports, per shape:

* time per call (CUDA events, median of ``--repeats``),
* achieved memory bandwidth: bytes of K, V, q and out moved / time. Decode attention reads
  every cached K/V byte once and does little arithmetic per byte, so this number against
  the GPU's peak (H100 SXM ~3.3 TB/s) says how good the kernel is;
* the same kernel split flash-decoding style (``--partition-size`` tokens per program, then
  a reduce kernel), and which of the two the kernel's own heuristic picks for that shape;
* achieved bandwidth as a fraction of the device's *measured* copy bandwidth (a large
  tensor copy, read + write, timed the same way): how close to the memory floor it runs;
* the time of the torch baseline: gather the blocks into contiguous tensors, then
  ``scaled_dot_product_attention`` (exactly ``paged_decode_attention_ref``).

On a CPU there is nothing to time for Triton (its interpreter is a debugging tool, not a
kernel): the CPU decode kernel (``paged_decode_attention_cpu``: C++ where it could be built,
else Numba, reading the paged cache in place: the engine's decode on a CPU) and the torch reference run on a few small
shapes instead. ``--ref-cpu`` times both at the CPU engine's own shape (SmolLM2-135M: fp32,
9 query / 3 KV heads, head_dim 64, block size 16; batch 64 at context 512 unless told
otherwise) and multiplies by the model's 30 layers.

The C++ kernel is built for the best instruction set this CPU runs (``LABKIT_CPU_ISA``
chooses a lesser one: ``kernels/cpu_extension.py``); ``--isa avx512 avx2 portable`` (or
``all``) also times the kernel of each of those builds, every one compiled for this machine,
in the same run, call by call in turn, so that a busy machine slows them alike: the AVX2 and
portable figures of an AVX-512 machine, and a fair comparison of the three. The load average
is printed with the figures (the machine may be shared).
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

from labkit.kernels import (
    cpu_extension,
    paged_decode_attention,
    paged_decode_attention_cpu,
    paged_decode_attention_ref,
    select_attention_backend,
)
from labkit.kernels.paged_decode_attention import DEFAULT_PARTITION_SIZE, multiprocessor_count, choose_partition_size
from labkit.kernels.paged_decode_attention_cpu import HAS_NUMBA
from labkit.bench import time_in_turn
from labkit.utils import cdiv

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
GPU_BATCHES = [1, 8, 32, 64, 128, 256]
GPU_CONTEXTS = [512, 1024, 2048, 4096, 8192]
CPU_BATCHES = [1, 8]
CPU_CONTEXTS = [128, 512]
ENGINE_LAYERS = 30  # SmolLM2-135M: one decode call per layer per step


def make_decode_inputs(batch: int, context: int, num_heads: int, num_kv_heads: int,
                       head_dim: int, block_size: int, dtype: torch.dtype,
                       device: torch.device, seed: int = 0):
    """A decode batch whose sequences all hold ``context`` tokens, their blocks scattered
    over the pool in random order (as after a while of serving). Returns the arguments of
    ``paged_decode_attention``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = cdiv(context, block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=device)
    block_tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, num_heads, head_dim, generator=gen, device=device, dtype=dtype)
    return q, k_cache, v_cache, block_tables, context_lens, head_dim ** -0.5


def bytes_moved(batch: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> int:
    """Bytes a decode call must move at least: all cached K and V once, q in, out back."""
    size = torch.finfo(dtype).bits // 8
    kv = 2 * batch * context * num_kv_heads * head_dim
    q_and_out = 2 * batch * num_heads * head_dim
    return (kv + q_and_out) * size


def time_ms(fn, device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds per call: CUDA events on a GPU (no host overhead in the number
    beyond launch), wall clock on a CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def isa_builds(wanted: list[str]) -> dict[str, object]:
    """The C++ extension built for each instruction set asked for ("all": every one this CPU
    runs), compiling what is not built yet; one that cannot be built or run here is an error."""
    isas = cpu_extension.runnable_isas() if "all" in wanted else tuple(dict.fromkeys(wanted))
    builds = {}
    for isa in isas:
        ext = cpu_extension.load(isa=isa)
        if ext is None:
            raise SystemExit(f"--isa {isa}: {cpu_extension.status(isa)[1]}")
        builds[isa] = ext
    return builds


def copy_gbps(device: torch.device, nbytes: int = 2**30, repeats: int = 10) -> float:
    """The device's measured memory bandwidth: GB/s of one large tensor copy (bytes read +
    bytes written), median of ``repeats``. The ceiling a memory-bound kernel is held to."""
    if device.type == "cpu":
        nbytes = min(nbytes, 2**28)        # a CPU copies slowly: 256 MiB says enough
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, warmup=2, repeats=repeats)
    return 2 * nbytes / ms / 1e6


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m labkit.bench kernels",
                                description="Time paged decode attention: the Triton kernel on a GPU, "
                                            "the torch reference everywhere.")
    p.add_argument("--batch", type=int, nargs="+", help="batch sizes (default: 1..256 on GPU)")
    p.add_argument("--context", type=int, nargs="+", help="context lengths (default: 512..8192 on GPU)")
    p.add_argument("--head-dim", type=int, nargs="+", help="head dims (default: 64 128 on GPU, 64 on CPU)")
    p.add_argument("--num-heads", type=int, help="query heads (default 32; 9 with --ref-cpu)")
    p.add_argument("--num-kv-heads", type=int, help="KV heads (default 8; 3 with --ref-cpu)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--partition-size", type=int, default=None,
                   help=f"tokens per program of the split (flash-decoding) kernel; default "
                        f"{DEFAULT_PARTITION_SIZE}, rounded up to whole tiles")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default fp16 on GPU, fp32 on CPU")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per shape (median reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-baseline", action="store_true", help="skip the torch gather + SDPA baseline")
    p.add_argument("--max-cache-gib", type=float, default=24.0,
                   help="skip shapes whose K+V cache exceeds this (GiB)")
    p.add_argument("--ref-cpu", action="store_true",
                   help="time the CPU decode kernel and the torch reference at the CPU engine's "
                        "shapes (fp32, batch 64, context 512, 9/3 heads, head_dim 64, block 16)")
    p.add_argument("--isa", nargs="+", choices=[*cpu_extension.ISAS, "all"],
                   help="also time the C++ decode kernel built for these instruction sets (all: every one "
                        "this CPU runs), in turn with each other in the same run")
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.ref_cpu:
        device = torch.device("cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device available; run without --device cuda to time the torch reference on CPU",
              file=sys.stderr)
        return 2
    backend, reason = select_attention_backend("auto", device)
    use_triton = backend == "triton" and not args.ref_cpu
    on_gpu = device.type == "cuda"
    use_cpu_kernel = device.type == "cpu" and HAS_NUMBA
    dtype = DTYPES[args.dtype or ("fp32" if args.ref_cpu or not on_gpu else "fp16")]
    if args.ref_cpu:
        batches, contexts, head_dims = args.batch or [64], args.context or [512], args.head_dim or [64]
        num_heads, num_kv_heads = args.num_heads or 9, args.num_kv_heads or 3
    else:
        batches = args.batch or (GPU_BATCHES if on_gpu else CPU_BATCHES)
        contexts = args.context or (GPU_CONTEXTS if on_gpu else CPU_CONTEXTS)
        head_dims = args.head_dim or ([64, 128] if on_gpu else [64])
        num_heads, num_kv_heads = args.num_heads or 32, args.num_kv_heads or 8

    notes = [f"backend: {backend} ({reason})"]
    tile = max(16, args.block_size)
    partition = args.partition_size or cdiv(DEFAULT_PARTITION_SIZE, tile) * tile
    ceiling = copy_gbps(device)
    notes.append(f"measured copy bandwidth: {ceiling:.1f} GB/s (read + write of a large tensor); "
                 "'of copy' = achieved / that")
    if use_triton:
        notes.append("triton: one program per (sequence, KV head); split: flash-decoding, "
                     f"partitions of {partition} tokens then a reduce; auto: what the kernel picks "
                     f"for the shape ({multiprocessor_count(device)} SMs)")
    else:
        notes.append("Triton timings need a CUDA GPU of compute capability 7.5+ (the Triton "
                      "interpreter is not timed): timing the "
                      + ("CPU decode kernel and the " if use_cpu_kernel else "") + "torch reference")
    builds = {}
    if device.type == "cpu":
        notes.append(f"CPU threads: {torch.get_num_threads()}; load average {_load_average()}")
        if use_cpu_kernel:
            compiled, what = cpu_extension.status()
            notes.append(f"cpu: {what}" if compiled else f"cpu: the Numba loop ({what})")
        if args.isa:
            builds = isa_builds(args.isa)
            notes.append(f"{', '.join(builds)}: the C++ kernel of each build alone (no input checks), "
                         "timed call by call in turn")

    rows = []
    for head_dim in head_dims:
        for batch in batches:
            for context in contexts:
                cache_gib = 2 * batch * context * num_kv_heads * head_dim * torch.finfo(dtype).bits / 8 / 2**30
                row = dict(head_dim=head_dim, batch=batch, context=context, num_heads=num_heads,
                           num_kv_heads=num_kv_heads, block_size=args.block_size,
                           dtype=str(dtype).removeprefix("torch."))
                if cache_gib > args.max_cache_gib:
                    rows.append({**row, "skipped": f"K+V cache {cache_gib:.1f} GiB > --max-cache-gib"})
                    continue
                inputs = make_decode_inputs(batch, context, num_heads, num_kv_heads, head_dim,
                                            args.block_size, dtype, device)
                moved = bytes_moved(batch, context, num_heads, num_kv_heads, head_dim, dtype)
                if use_triton:
                    ms = time_ms(lambda inputs=inputs: paged_decode_attention(*inputs, partition_size=0), device,
                                 args.warmup, args.repeats)
                    row.update(triton_ms=ms, triton_gbps=moved / ms / 1e6, triton_of_copy=moved / ms / 1e6 / ceiling)
                    ms = time_ms(lambda inputs=inputs: paged_decode_attention(*inputs, partition_size=partition),
                                 device, args.warmup, args.repeats)
                    row.update(split_ms=ms, split_gbps=moved / ms / 1e6, split_of_copy=moved / ms / 1e6 / ceiling,
                               auto="split" if choose_partition_size(batch, num_kv_heads, context,
                                                                     multiprocessor_count(device), tile) else "triton")
                if use_cpu_kernel and dtype in (torch.float32, torch.bfloat16):  # fp16 falls back to the reference
                    ms = time_ms(lambda inputs=inputs: paged_decode_attention_cpu(*inputs), device,
                                 args.warmup, args.repeats)
                    row.update(cpu_ms=ms, cpu_gbps=moved / ms / 1e6, cpu_of_copy=moved / ms / 1e6 / ceiling)
                if builds and dtype in (torch.float32, torch.bfloat16):
                    q, k, v, tables, lens, scale = inputs
                    q = q.float().contiguous()
                    isa_ms = time_in_turn({isa: (lambda ext=ext: ext.paged_decode_attention(q, k, v, tables, lens,
                                                                                             scale))
                                           for isa, ext in builds.items()}, args.warmup, args.repeats)
                    row.update({f"{isa}_ms": ms for isa, ms in isa_ms.items()})
                    row.update({f"{isa}_gbps": moved / ms / 1e6 for isa, ms in isa_ms.items()})
                if not args.no_baseline or not use_triton:
                    try:
                        ms = time_ms(lambda inputs=inputs: paged_decode_attention_ref(*inputs), device,
                                     args.warmup, args.repeats)
                        row.update(torch_ms=ms, torch_gbps=moved / ms / 1e6)
                    except torch.cuda.OutOfMemoryError:
                        row.update(torch_ms=None, torch_note="out of memory")
                if args.ref_cpu:
                    row.update(per_step_ms=row.get("cpu_ms", row["torch_ms"]) * ENGINE_LAYERS)
                rows.append(row)
                del inputs
                if on_gpu:
                    torch.cuda.empty_cache()

    if device.type == "cpu":
        notes.append(f"load average after: {_load_average()}")
    meta = dict(device=torch.cuda.get_device_name(device) if on_gpu else "cpu",
                torch=torch.__version__, copy_gbps=ceiling, partition_size=partition if use_triton else None,
                notes=notes)
    if args.json:
        print(json.dumps(dict(meta=meta, results=rows), indent=2))
        return 0
    for note in notes:
        print(f"# {note}")
    header = f"{'d':>4} {'batch':>5} {'ctx':>6}"
    if use_triton:
        header += (f" {'triton ms':>10} {'GB/s':>8} {'of copy':>7}"
                   f" {'split ms':>10} {'GB/s':>8} {'of copy':>7} {'auto':>6}")
    if use_cpu_kernel:
        header += f" {'cpu ms':>10} {'GB/s':>8} {'of copy':>7}"
    for isa in builds:
        header += f" {isa + ' ms':>11} {'GB/s':>6}"
    header += f" {'torch ms':>10} {'GB/s':>8}"
    if use_triton and not args.no_baseline:
        header += f" {'speedup':>8}"
    if args.ref_cpu:
        header += f"  {'x' + str(ENGINE_LAYERS) + ' layers ms':>16}"
    print(header)
    for row in rows:
        line = f"{row['head_dim']:>4} {row['batch']:>5} {row['context']:>6}"
        if "skipped" in row:
            print(f"{line}  skipped: {row['skipped']}")
            continue
        if use_triton:
            line += (f" {row['triton_ms']:>10.3f} {row['triton_gbps']:>8.1f} {row['triton_of_copy']:>7.0%}"
                     f" {row['split_ms']:>10.3f} {row['split_gbps']:>8.1f} {row['split_of_copy']:>7.0%}"
                     f" {row['auto']:>6}")
        if use_cpu_kernel:
            line += (f" {row['cpu_ms']:>10.3f} {row['cpu_gbps']:>8.1f} {row['cpu_of_copy']:>7.0%}" if "cpu_ms" in row
                     else f" {'(fp32/bf16)':>10} {'':>8} {'':>7}")
        for isa in builds:
            line += (f" {row[isa + '_ms']:>11.3f} {row[isa + '_gbps']:>6.1f}" if isa + "_ms" in row
                     else f" {'':>11} {'':>6}")
        if row.get("torch_ms") is not None:
            line += f" {row['torch_ms']:>10.3f} {row['torch_gbps']:>8.1f}"
            if use_triton:
                line += f" {row['torch_ms'] / row['triton_ms']:>7.1f}x"
        elif "torch_ms" in row:
            line += f" {'OOM':>10} {'':>8}"
        if args.ref_cpu:
            line += f"  {row['per_step_ms']:>16.1f}"
        print(line)
    return 0


def _load_average() -> str:
    """The 1-, 5- and 15-minute load averages (what else ran on the machine meanwhile)."""
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # not available on this platform
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
