"""``python -m labkit.bench gpu-compile [--json]``: every Triton kernel the engine launches,
compiled for the GPUs students get, on a machine without one.

Triton compiles for a GPU it cannot see (``ptxas`` ships in the triton wheel). For each
target (sm_75: Colab's free T4; sm_80: A100; sm_89: L4; sm_90: H100), each dtype the engine
runs there (fp16 and fp32 everywhere, bf16 from sm_80) and each shape (the default model's,
and head dims 64/96/128 x GQA groups 1-8 x block sizes 8/16/32/64), this:

1. plans the launches with the kernel files' own ``plan_*`` functions, the code every
   launch goes through (same grid, compile-time constants, num_warps and num_stages), on
   stand-in tensors (``meta``: shapes, strides, dtypes, no memory) laid out as the model
   passes them: the cache write, decode at a large batch and at batch 1 over a long context
   (where the engine splits it, flash-decoding, on that GPU), a prefill chunk;
2. compiles each launch as Triton's JIT would on that GPU (``kernel.warmup``, with a stand-in
   driver that reports the target), and reads ptxas' report: registers, spills, stack;
3. checks each build against the GPU's limits. A build that does not compile, or would not
   launch (more shared memory than a block may have, more registers than a thread or a
   block may have, too many threads), fails the run: exit status 1. Spills and the
   estimated occupancy are reported, not failed.

Builds shared by several shapes compile once. The compile runs in worker processes
(``--jobs``) with ``TRITON_INTERPRET=0`` (a process whose kernels were defined under the
interpreter cannot compile them) and a fresh temporary Triton cache, deleted afterwards:
nothing lands in the repository, nothing is reused from an earlier run.

Quantized KV caches (``kv_cache_dtype`` "int8" and "fp8": ``labkit/kernels/kv_quant.py``) are
one more axis: the cache write, decode and prefill kernels read and write int8 or fp8 e4m3
bytes with their scales, a build of their own. int8 on every target; fp8 from sm_89 (the L4,
the H100: Triton's fp8e4nv needs the fp8 conversion instructions those GPUs have, and the
engine refuses fp8 with the triton backend below them).

``--quick`` is the subset the CI test compiles (tests/test_gpu_compile.py): every kernel,
target, dtype and KV cache dtype on the default model's shape, and two grid shapes that
together span the head dims, GQA groups and block sizes on the T4 (the least shared memory)
and the H100 (the newest code generation), in each of their dtypes: about 190 builds.
The default is the full matrix (docs/gpu.md has its figures and how long it takes).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Target:
    """A GPU the kernels are built for and the limits a launch must fit (CUDA C++ Programming
    Guide, "Technical Specifications per Compute Capability")."""

    name: str                     # sm_75 ...
    arch: int                     # compute capability as Triton spells it: 75, 80, 89, 90
    gpu: str                      # the GPU students get with it
    dtypes: tuple[str, ...]       # what the engine runs there
    kv_dtypes: tuple[str, ...]    # the KV cache dtypes it runs there ("auto": the model's)
    num_sms: int                  # multiprocessors: the split-decode choice depends on it
    max_shared: int               # shared memory a block may use, opt-in maximum (bytes)
    shared_per_sm: int
    max_warps_per_sm: int
    max_blocks_per_sm: int
    reserved_shared: int = 1024   # shared memory the CUDA runtime keeps per block (8.0+)
    regs_per_sm: int = 65536
    max_regs_per_block: int = 65536
    max_regs_per_thread: int = 255
    max_threads: int = 1024


TARGETS = {t.name: t for t in (
    Target("sm_75", 75, "T4", ("fp16", "fp32"), ("auto", "int8"), 40, 64 << 10, 64 << 10, 32, 16, reserved_shared=0),
    Target("sm_80", 80, "A100", ("fp16", "bf16", "fp32"), ("auto", "int8"), 108, 163 << 10, 164 << 10, 64, 32),
    Target("sm_89", 89, "L4", ("fp16", "bf16", "fp32"), ("auto", "int8", "fp8"), 58, 99 << 10, 100 << 10, 48, 24),
    Target("sm_90", 90, "H100", ("fp16", "bf16", "fp32"), ("auto", "int8", "fp8"), 132, 227 << 10, 228 << 10,
           64, 32),
)}
DTYPES = ("fp16", "bf16", "fp32")
KV_DTYPES = ("auto", "int8", "fp8")   # kv_cache_dtype: the model's dtype, or quantized (kernels/kv_quant.py)
HEAD_DIMS = (64, 96, 128)
GROUPS = tuple(range(1, 9))
BLOCK_SIZES = (8, 16, 32, 64)
GRID_KV_HEADS = 8                 # Llama-3-8B's and Mistral-7B's: the widest cache-write tile
#: --quick compiles its two grid shapes for these: the least shared memory a block may have (the
#: T4's 64 KiB, where the largest tiles bind first) and the newest GPU (Hopper's code generation).
QUICK_GRID_TARGETS = ("sm_75", "sm_90")


@dataclass(frozen=True, slots=True)
class Shape:
    """The attention shape of one model at one block size."""

    name: str                     # the model's, or "grid"
    num_kv_heads: int
    group: int                    # query heads per KV head (GQA)
    head_dim: int
    block_size: int

    @property
    def label(self) -> str:
        return f"{self.name} d{self.head_dim} g{self.group} kv{self.num_kv_heads} bs{self.block_size}"


def model_shape(name: str) -> tuple[int, int, int] | str:
    """(num_kv_heads, group, head_dim) from a model's config.json: ``name`` is the default
    model (when cached) or a checkpoint directory. A string says why it could not be read."""
    from labkit.model.loader import DEFAULT_MODEL, default_model_dir
    default = name in (DEFAULT_MODEL, "smollm2", "smollm2-135m-instruct")
    path = (default_model_dir() if default else Path(name).expanduser()) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except OSError:
        return f"{name}: no config at {path}" + (" (make model fetches it)" if default else "")
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return kv_heads, heads // kv_heads, head_dim


def matrix_shapes(models: list[str], head_dims, groups, block_sizes, quick: bool) -> tuple[list[Shape], list[str]]:
    """The shapes to compile, and notes on models that could not be read."""
    notes, shapes = [], []
    for name in models:
        got = model_shape(name)
        if isinstance(got, str):
            notes.append(got)
            continue
        kv, group, d = got
        label = Path(name).name if os.path.isdir(os.path.expanduser(name)) else name
        shapes += [Shape(label, kv, group, d, bs) for bs in ((16,) if quick else block_sizes)]
    if quick:   # together: head dims 64 (the model), 96, 128; groups 1, 3, 8; blocks 8, 16, 32
        if not shapes:      # SmolLM2's shape, when it is not cached
            shapes.append(Shape("grid", GRID_KV_HEADS, 3, 64, 16))
        shapes += [Shape("grid", GRID_KV_HEADS, 8, 128, 32), Shape("grid", GRID_KV_HEADS, 1, 96, 8)]
    else:
        shapes += [Shape("grid", GRID_KV_HEADS, g, d, bs) for d in head_dims for g in groups for bs in block_sizes]
    return shapes, notes


# ----------------------------------------------------------------------------- the worker side
# Everything below down to the next rule runs in worker processes, where labkit.kernels is
# imported with TRITON_INTERPRET=0.

TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
TORCH_KV_DTYPES = {"int8": "int8", "fp8": "float8_e4m3fn"}


def engine_launches(shape: Shape, dtype: str, target: Target, kv_dtype: str = "auto") -> list:
    """The launches the engine makes for ``shape`` on ``target`` (its multiprocessors and
    compute capability choose the split and the prefill tile), planned by the kernels' own
    code on ``meta`` tensors laid out as ``labkit.model.llama.Attention`` passes them: q and k are views of the rotated
    [tokens, q + kv heads, d] tensor, v of the projection's [tokens, q + 2 kv heads, d]; each
    layer's caches are views of the one [layers, 2, blocks, block_size, kv heads, d] tensor.

    Scenarios: the cache write of a prefill chunk; decode at batch 256 (one program per
    sequence and KV head) and at batch 1 over 4096 tokens (where the plan splits the context
    when the GPU has idle multiprocessors); a 512-token prefill chunk. ``kv_dtype`` "int8" or
    "fp8": the same over a quantized cache, with its scales laid out as ``KVCache.scales``."""
    import torch

    from labkit.kernels.paged_decode_attention import plan_decode
    from labkit.kernels.paged_prefill_attention import plan_prefill
    from labkit.kernels.reshape_and_cache import plan_reshape_and_cache

    dt = getattr(torch, TORCH_DTYPES[dtype])
    H, KV, d, bs = shape.group * shape.num_kv_heads, shape.num_kv_heads, shape.head_dim, shape.block_size
    meta = dict(device="meta")

    def activations(tokens: int):
        qkv = torch.empty(tokens, H + 2 * KV, d, dtype=dt, **meta)
        qk = torch.empty(tokens, H + KV, d, dtype=dt, **meta)        # apply_rope's output
        return qk[:, :H], qk[:, H:], qkv[:, H + KV:]

    cache_dt = getattr(torch, TORCH_KV_DTYPES[kv_dtype]) if kv_dtype != "auto" else dt
    cache = torch.empty(2, 2, 4096, bs, KV, d, dtype=cache_dt, **meta)
    k_cache, v_cache = cache[1, 0], cache[1, 1]
    quant = {}
    if kv_dtype != "auto":
        scales = torch.empty(2, 2, 4096, bs, KV, dtype=torch.float32, **meta)
        quant = dict(k_scales=scales[1, 0], v_scales=scales[1, 1])
    scale = d ** -0.5

    def index(rows: int, context: int):
        width = -(-context // bs)
        return (torch.empty(rows, width, dtype=torch.int32, **meta), torch.empty(rows, dtype=torch.int32, **meta))

    launches = []
    q, k, v = activations(512)
    slots = torch.empty(512, dtype=torch.int64, **meta)
    launches.append(plan_reshape_and_cache(k, v, k_cache, v_cache, slots, **quant))
    for batch, context in ((256, 1024), (1, 4096)):
        q = activations(batch)[0]
        tables, lens = index(batch, context)
        launches += plan_decode(torch.empty_like(q), q, k_cache, v_cache, tables, lens, scale,
                                num_sms=target.num_sms, **quant)
    q = activations(512)[0]
    tables, lens = index(1, 1024)
    starts = torch.empty(2, dtype=torch.int32, **meta)
    launches.append(plan_prefill(torch.empty_like(q), q, k_cache, v_cache, tables, lens, starts, scale, 512,
                                 capability=divmod(target.arch, 10), **quant))
    unique = {}
    for launch in launches:                 # decode may plan the same kernel in both scenarios
        unique.setdefault((launch.name, tuple(sorted(launch.constexprs.items()))), launch)
    return list(unique.values())


class _TargetDriver:
    """Stands in for Triton's CUDA driver where Triton asks which GPU it compiles for: it
    reports ``target``. ``kernel.warmup`` then specializes and compiles exactly as a launch
    on that GPU would, and launches nothing."""

    def __init__(self, target) -> None:
        self.target = target

    def get_current_device(self):
        return f"gpu-compile:{self.target.arch}"   # a key of its own in each kernel's cache

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target


_PTXAS = {"registers": r"Used (\d+) registers", "stack": r"(\d+) bytes stack frame",
          "spill_stores": r"(\d+) bytes spill stores", "spill_loads": r"(\d+) bytes spill loads",
          "static_shared": r"(\d+) bytes smem"}


def parse_ptxas(log: str) -> dict[str, int]:
    """Registers, stack, spills and static shared memory of the entry function, from ptxas -v."""
    out = {}
    for key, pattern in _PTXAS.items():
        found = re.findall(pattern, log)
        out[key] = int(found[-1]) if found else 0
    if not re.search(_PTXAS["registers"], log):
        raise RuntimeError("ptxas reported no register count (was the build taken from a cache?)")
    return out


_SEEN: dict[str, dict] = {}      # resources by build hash: a build Triton has cached compiles once


def compile_launch(launch, seen: dict = _SEEN) -> dict:
    """Compile one planned launch for the active target; its resources, or the error."""
    row = {"kernel": launch.name.strip("_").removesuffix("_kernel"), "grid": list(launch.grid),
           "constexprs": dict(launch.constexprs), "num_warps": launch.num_warps, "num_stages": launch.num_stages}
    log = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):   # Triton prints ptxas' report (TRITON_DUMP_PTXAS_LOG=1)
            compiled = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.constexprs,
                                            num_warps=launch.num_warps, num_stages=launch.num_stages)
        if compiled.hash not in seen:           # a build shared with an earlier shape compiles once
            seen[compiled.hash] = {"shared": compiled.metadata.shared, **parse_ptxas(log.getvalue())}
        row.update(seen[compiled.hash], build=compiled.hash[:12])
    except Exception as e:  # noqa: BLE001 - any failure to build is this build's result
        row.update(error=f"{type(e).__name__}: {_first_lines(str(e))}")
    row["seconds"] = round(time.perf_counter() - t0, 3)
    return row


def _first_lines(text: str, n: int = 6) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[:n])


def compile_unit(unit: dict) -> list[dict]:
    """Every launch of ``unit`` (one target, one dtype, one KV cache dtype, shapes of one head dim)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    target = TARGETS[unit["target"]]
    rows = []
    kv_of = unit.get("kv_dtypes") or {}     # shape label -> its KV cache dtypes (default: the model's)
    # The worker only compiles: its Triton talks to the stand-in from here on (without a GPU
    # there is no real driver to go back to).
    driver.set_active(_TargetDriver(GPUTarget("cuda", target.arch, 32)))
    for fields in unit["shapes"]:
        shape = Shape(**fields)
        for kv_dtype in kv_of.get(shape.label, ["auto"]):
            where = {"target": target.name, "gpu": target.gpu, "dtype": unit["dtype"], "kv_dtype": kv_dtype,
                     "shape": shape.label, **asdict(shape)}
            try:
                launches = engine_launches(shape, unit["dtype"], target, kv_dtype)
            except Exception as e:  # noqa: BLE001 - a shape the launchers refuse is a result too
                rows.append({**where, "kernel": "(plan)", "error": f"{type(e).__name__}: {_first_lines(str(e))}"})
                continue
            rows += [{**where, **compile_launch(launch)} for launch in launches]
    return rows


def run_worker() -> int:
    """A worker process: units (JSON) on stdin, one JSON line per build on stdout."""
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr                     # anything else printed goes to stderr
    units = json.load(sys.stdin)
    import warnings
    warnings.filterwarnings("ignore", module="triton")
    import labkit.kernels as K
    if not K.HAS_TRITON:
        print(f"gpu-compile: Triton is not installed ({K._common.TRITON_IMPORT_ERROR})", file=sys.stderr)
        return 2
    if K.triton_is_interpreted():
        print("gpu-compile: the kernels were defined under TRITON_INTERPRET=1 in this worker", file=sys.stderr)
        return 2
    for unit in units:
        for row in compile_unit(unit):
            protocol.write(json.dumps(row) + "\n")
        protocol.write(json.dumps({"unit_done": True}) + "\n")
        protocol.flush()
    return 0


# ----------------------------------------------------------------------------- the parent side


def launch_problems(row: dict, target: Target) -> list[str]:
    """Why a compiled build would not launch on ``target`` (empty: it launches)."""
    problems = []
    threads = row["num_warps"] * 32
    shared = row["shared"] + row["static_shared"]
    if threads > target.max_threads:
        problems.append(f"{threads} threads per block > {target.max_threads}")
    if shared > target.max_shared:
        problems.append(f"shared memory {shared} B per block > {target.max_shared} B on {target.gpu}")
    if row["registers"] > target.max_regs_per_thread:
        problems.append(f"{row['registers']} registers per thread > {target.max_regs_per_thread}")
    if _regs_per_warp(row["registers"]) * row["num_warps"] > target.max_regs_per_block:
        problems.append(f"{row['registers']} registers x {threads} threads > {target.max_regs_per_block} per block")
    return problems


def _regs_per_warp(registers: int) -> int:
    return math.ceil(registers * 32 / 256) * 256   # registers are allocated per warp, 256 at a time


def occupancy(row: dict, target: Target) -> float:
    """Resident warps per multiprocessor over the most it can hold, by the CUDA occupancy
    rules for registers (allocated per warp, 256 at a time), shared memory (plus the runtime's
    reserve per block) and warps; an estimate (it ignores shared memory's granularity)."""
    warps = row["num_warps"]
    blocks = min(target.max_warps_per_sm // warps, target.max_blocks_per_sm)
    if row["registers"]:
        blocks = min(blocks, (target.regs_per_sm // _regs_per_warp(row["registers"])) // warps)
    shared = row["shared"] + row["static_shared"] + target.reserved_shared
    if shared:
        blocks = min(blocks, target.shared_per_sm // shared)
    return blocks * warps / target.max_warps_per_sm


def judge(row: dict) -> dict:
    """A build's verdict: "compile error", "no launch" (with the problems), "spills" (it
    launches, spilling registers to local memory) or "ok"; and its estimated occupancy."""
    if "error" in row:
        return {**row, "status": "compile error"}
    target = TARGETS[row["target"]]
    problems = launch_problems(row, target)
    status = "no launch" if problems else ("spills" if row["spill_stores"] or row["spill_loads"] else "ok")
    return {**row, "status": status, "problems": problems, "occupancy": round(occupancy(row, target), 3),
            "shared_limit": target.max_shared}


def plan_units(shapes: list[Shape], targets: list[str], dtypes: list[str], kv_dtypes=KV_DTYPES,
               quantized_shapes: list[Shape] | None = None) -> list[dict]:
    """Work units: one target, one dtype, the shapes of one head dim, each with the KV cache
    dtypes it compiles for (``kv_dtypes``: the quantized ones on ``quantized_shapes``, None:
    every shape, and only on targets that run them, ``Target.kv_dtypes``). Builds of
    different units never coincide (a kernel that reads no cache, the split decode's reduce,
    is the same build whatever the cache: it stays within its unit), so each worker's
    in-memory cache dedupes what can be deduped."""
    quantized_labels = {s.label for s in (shapes if quantized_shapes is None else quantized_shapes)}
    units = []
    for t in targets:
        for dt in dtypes:
            if dt not in TARGETS[t].dtypes:
                continue
            runs = [kv for kv in kv_dtypes if kv in TARGETS[t].kv_dtypes]
            for d in sorted({s.head_dim for s in shapes}):
                these = [s for s in shapes if s.head_dim == d]
                kv_of = {s.label: [kv for kv in runs if kv == "auto" or s.label in quantized_labels]
                         for s in these}
                these = [s for s in these if kv_of[s.label]]
                if these:
                    units.append({"target": t, "dtype": dt, "shapes": [asdict(s) for s in these],
                                  "kv_dtypes": {s.label: kv_of[s.label] for s in these}})
    return units


def run_workers(units: list[dict], jobs: int, progress) -> tuple[list[dict], list[str], str]:
    """Compile ``units`` in ``jobs`` worker processes, with a fresh Triton cache deleted
    afterwards; (rows, errors of workers that died, where the cache was)."""
    cache = tempfile.mkdtemp(prefix="labkit-gpu-compile-")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": cache, "TRITON_DUMP_PTXAS_LOG": "1"}
    shares: list[list[dict]] = [[] for _ in range(max(1, min(jobs, len(units))))]
    for unit in sorted(units, key=lambda u: -len(u["shapes"])):   # the biggest first, to the least loaded
        min(shares, key=lambda s: sum(len(u["shapes"]) for u in s)).append(unit)
    rows: list[dict] = []
    errors: list[str] = []
    procs: list[subprocess.Popen] = []
    lock = threading.Lock()

    def work(share: list[dict]) -> None:
        proc = subprocess.Popen([sys.executable, "-m", "labkit.bench.gpu_compile", "--worker"], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        stderr = []
        drain = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)
        drain.start()
        proc.stdin.write(json.dumps(share))
        proc.stdin.close()
        for line in proc.stdout:
            got = json.loads(line)
            with lock:
                if got.get("unit_done"):
                    progress()
                else:
                    rows.append(got)
        proc.wait()
        drain.join()
        if proc.returncode:
            with lock:
                errors.append(f"a worker exited with status {proc.returncode}: {''.join(stderr)[-1500:]}")

    threads = [threading.Thread(target=work, args=(share,)) for share in shares if share]
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)) if main else None   # killed: as Ctrl-C
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:                # interrupted or killed: no worker outlives the run
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        shutil.rmtree(cache, ignore_errors=True)
    return rows, errors, cache


def summarize(rows: list[dict]) -> list[dict]:
    """One line per kernel x target x dtype: builds, the worst resources, the statuses."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["kernel"], r["target"], r["dtype"], r.get("kv_dtype", "auto")), []).append(r)
    lines = []
    for (kernel, target, dtype, kv_dtype), rs in sorted(groups.items()):
        built = [r for r in rs if "error" not in r]
        lines.append({
            "kernel": kernel, "target": target, "gpu": TARGETS[target].gpu, "dtype": dtype, "kv_dtype": kv_dtype,
            "shapes": len(rs),
            "builds": len({r["build"] for r in built}),
            "max_shared": max((r["shared"] + r["static_shared"] for r in built), default=0),
            "shared_limit": TARGETS[target].max_shared,
            "registers": [min((r["registers"] for r in built), default=0),
                          max((r["registers"] for r in built), default=0)],
            "max_spill_stores": max((r["spill_stores"] for r in built), default=0),
            "min_occupancy": min((r["occupancy"] for r in built), default=0.0),
            "statuses": {s: sum(r["status"] == s for r in rs) for s in sorted({r["status"] for r in rs})},
        })
    return lines


def format_table(summary: list[dict]) -> str:
    head = (f"{'kernel':<22} {'target':<6} {'gpu':<5} {'dtype':<5} {'kv':<4} {'shapes':>6} {'builds':>6}  "
            f"{'shared max / limit':>20}  {'registers':>9}  {'spills':>6}  {'occupancy':>9}  status")
    lines = [head, "-" * len(head)]
    for s in summary:
        shared = f"{s['max_shared'] / 1024:.1f} / {s['shared_limit'] >> 10} KiB"
        low, high = s["registers"]
        regs = f"{low}-{high}" if low != high else str(low)
        status = ", ".join(f"{n} {k}" for k, n in s["statuses"].items())
        lines.append(f"{s['kernel']:<22} {s['target']:<6} {s['gpu']:<5} {s['dtype']:<5} {s['kv_dtype']:<4} "
                     f"{s['shapes']:>6} "
                     f"{s['builds']:>6}  {shared:>20}  {regs:>9}  {s['max_spill_stores']:>5}B  "
                     f"{s['min_occupancy']:>9.0%}  {status}")
    return "\n".join(lines)


def _csv(kind, values: str | None, default):
    if values is None:
        return list(default)
    return [kind(v.strip()) for v in values.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit.bench gpu-compile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print every build (kernel x target x dtype x shape) as JSON")
    p.add_argument("--out", help="also write the JSON report to this file")
    p.add_argument("--quick", action="store_true", help="the CI test's subset: 3 shapes instead of the full grid "
                   "(the grid's two on sm_75 and sm_90)")
    p.add_argument("--targets", help=f"comma-separated, from {','.join(TARGETS)} (default: all)")
    p.add_argument("--dtypes", help="comma-separated, from fp16,bf16,fp32 (default: each target's)")
    p.add_argument("--kv-dtypes", help="KV cache dtypes, comma-separated, from auto,int8,fp8 (default: each "
                                       "target's; --quick compiles the quantized ones on its first shape)")
    p.add_argument("--head-dims", help="grid head dims (default 64,96,128)")
    p.add_argument("--groups", help="grid GQA groups, query heads per KV head (default 1..8)")
    p.add_argument("--block-sizes", help="block sizes (default 8,16,32,64)")
    p.add_argument("--model", action="append",
                   help="a model whose shape to add: the default model (when cached) or a checkpoint directory; "
                        "repeatable (default: the default model)")
    p.add_argument("--no-model", action="store_true", help="the grid only")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: the cores)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return run_worker()

    targets = _csv(str, args.targets, TARGETS)
    dtypes = _csv(str, args.dtypes, DTYPES)
    kv_dtypes = _csv(str, args.kv_dtypes, KV_DTYPES)
    bad = ([t for t in targets if t not in TARGETS] + [d for d in dtypes if d not in DTYPES]
           + [k for k in kv_dtypes if k not in KV_DTYPES])
    if bad or not targets or not dtypes or not kv_dtypes or args.jobs < 1:
        print(f"gpu-compile: unknown target or dtype {bad}; targets: {', '.join(TARGETS)}; dtypes: "
              f"{', '.join(DTYPES)}; kv dtypes: {', '.join(KV_DTYPES)}; --jobs >= 1", file=sys.stderr)
        return 2
    try:
        head_dims, groups, block_sizes = (_csv(int, v, d) for v, d in ((args.head_dims, HEAD_DIMS),
                                                                       (args.groups, GROUPS),
                                                                       (args.block_sizes, BLOCK_SIZES)))
    except ValueError as e:
        print(f"gpu-compile: {e}", file=sys.stderr)
        return 2
    from labkit.model.loader import DEFAULT_MODEL
    models = [] if args.no_model else (args.model or [DEFAULT_MODEL])
    shapes, notes = matrix_shapes(models, head_dims, groups, block_sizes, args.quick)
    if args.quick:   # the first shape everywhere, with the quantized caches; the grid's where limits bind
        units = (plan_units(shapes[:1], targets, dtypes, kv_dtypes)
                 + plan_units(shapes[1:], [t for t in targets if t in QUICK_GRID_TARGETS], dtypes,
                              [k for k in kv_dtypes if k == "auto"]))
    else:
        units = plan_units(shapes, targets, dtypes, kv_dtypes)
    if not units:
        print("gpu-compile: nothing to compile (no target runs those dtypes)", file=sys.stderr)
        return 2
    for note in notes:
        print(f"gpu-compile: skipped {note}", file=sys.stderr)

    t0 = time.perf_counter()
    done = [0]
    tty = sys.stderr.isatty()

    def progress() -> None:       # one line redrawn on a terminal, a line per unit in a log
        done[0] += 1
        print(("\r" if tty else "") + f"[gpu-compile] {done[0]}/{len(units)} units, {time.perf_counter() - t0:.0f} s",
              end="" if tty and done[0] < len(units) else "\n", file=sys.stderr, flush=True)

    rows, errors, cache = run_workers(units, args.jobs, progress)
    rows = sorted((judge(r) for r in rows),
                  key=lambda r: (r["target"], r["dtype"], r.get("kv_dtype", "auto"), r["kernel"], r["shape"]))
    report = {"meta": {"triton": importlib.metadata.version("triton"), "seconds": round(time.perf_counter() - t0, 1),
                       "jobs": args.jobs, "quick": args.quick, "shapes": [s.label for s in shapes],
                       "skipped": notes, "cache_dir": cache, "targets": {t: asdict(TARGETS[t]) for t in targets}},
              "summary": summarize(rows), "failures": failures(rows) + errors, "builds": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report) if args.json else report_text(report))
    return 1 if report["failures"] or not rows else 0


def failures(rows: list[dict]) -> list[str]:
    """One line per build that does not compile or would not launch."""
    return [f"{r['kernel']} {r['target']} {r['dtype']}{_kv_label(r)} {r['shape']}: "
            f"{r.get('error') or '; '.join(r['problems'])}"
            for r in rows if r["status"] in ("compile error", "no launch")]


def _kv_label(row: dict) -> str:
    """'' for a cache in the model's dtype, ' kv int8' / ' kv fp8' for a quantized one."""
    kv = row.get("kv_dtype", "auto")
    return "" if kv == "auto" else f" kv {kv}"


def report_text(report: dict) -> str:
    rows, meta = report["builds"], report["meta"]
    builds = len({(r["target"], r["dtype"], r.get("build")) for r in rows})
    head = (f"gpu-compile: {len(rows)} kernel x target x dtype x shape entries, {builds} distinct builds of "
            f"{len({r['kernel'] for r in rows})} kernels for "
            f"{', '.join(f'{t} ({TARGETS[t].gpu})' for t in meta['targets'])}; Triton {meta['triton']}, "
            f"{meta['seconds']:.0f} s with {meta['jobs']} worker(s)\n")
    tail = ([f"FAILED {f}" for f in report["failures"]] if report["failures"] else
            ["\nevery build compiles and fits its GPU's limits (shared memory per block, registers)"])
    return "\n".join([head, format_table(report["summary"]), *tail])


if __name__ == "__main__":
    sys.exit(main())
