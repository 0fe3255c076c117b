"""Paged decode attention on a CPU: the decode kernel's algorithm as a compiled loop.

The torch reference (``paged_decode_attention_ref``) gathers every sequence's blocks into
a dense tensor and then attends: the K/V bytes are copied once more than they need to be,
and decode is memory-bound, so that copy costs about as much as the attention itself.
The kernels here read K and V *in place*, following the block table exactly as the Triton
kernel does. There are two, with one algorithm:

* **the Numba loop** in this file (``@njit(parallel=True)``), the one to read: Python
  syntax, one task per sequence, spread over the CPU cores;
* **the C++ kernel** (``csrc/paged_decode_attention.cpp``, compiled on this machine by
  ``cpu_extension.py``), what production CPU engines run: head_dim fixed at compile time,
  the next block prefetched while this one is computed, and torch's own thread pool. It is
  used whenever it could be built (about 2x faster in fp32 and 2.5x in bf16 here: ``python
  -m labkit.bench kernels``); ``impl="numba"`` asks for the loop.

Each task walks its sequence's blocks in order, as the GPU kernel walks its tiles:

1. scores of the block's tokens against every query head (GQA: each KV head serves
   ``group`` query heads). The keys of all KV heads of a token are one contiguous row of
   the block, so each row is read once, whole: one task per sequence rather than per
   (sequence, KV head), which would read a third of each row at a time and pay for the
   rest of its cache lines anyway;
2. online softmax: keep, per query head, the running maximum ``m``, the running
   denominator and the running output; a block that raises the maximum first rescales
   them by ``exp(m_old - m_new)`` (the FlashAttention update);
3. add the block's values, weighted by ``exp(score - m)``; divide by the denominator at the end.

K and V are each read once, in place, and the block's scores never leave the L1 cache.
Same signature as the reference; fp32 and bf16 caches (bf16 is widened to fp32 block by
block, in L1); the C++ kernel reads quantized caches too (int8 and fp8 with their scales,
``kv_quant.py``: dequantized in its inner loop), the Numba loop does not; other dtypes
fall back to the reference.

The loops are compiled without bounds checks (a check per load would cost more than the
load). So the arguments are checked once per call, before they run, with the reference's
checks (``_common.check_attention_inputs``): shapes, dtypes, devices, every context length
against its table row, every block id a sequence uses against the cache. A bad block id is
a ``ValueError`` that names it, not a segfault or a silent read of another sequence's memory.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from . import cpu_extension
from ._common import check_attention_inputs
from .kv_quant import QUANTIZED_DTYPES
from .paged_decode_attention import decode_attention_torch

try:
    import numba
    from numba import njit, prange
    HAS_NUMBA = True
    NUMBA_IMPORT_ERROR = None
    # torch runs its matrix multiplies on an OpenMP thread pool. Numba's OpenMP layer
    # behaves best beside it: its default "workqueue" threads fight torch's spinning
    # OpenMP threads for the cores (measured here: 2x slower steps). An explicit choice
    # (NUMBA_THREADING_LAYER) wins.
    if "NUMBA_THREADING_LAYER" not in os.environ:
        numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
except ImportError as e:  # pragma: no cover - numba is a dependency on CPU machines
    HAS_NUMBA = False
    NUMBA_IMPORT_ERROR = e

_pool_started = False


def _start_numba_pool() -> None:
    """Start Numba's thread pool with threads that sleep, not spin, when idle.

    torch's wheels bring their own OpenMP runtime and Numba's "omp" layer loads the
    system's: two pools on the same cores. Each runtime's idle threads spin-wait by default
    (OMP_WAIT_POLICY unset), so after every attention call Numba's threads would keep
    spinning on the cores torch's next matrix multiply needs, and on a busy machine a
    spinning thread can hold the core the thread it waits for needs. The runtime reads
    OMP_WAIT_POLICY once, when it is loaded, which is when Numba starts its pool: set
    PASSIVE for that moment only (torch's runtime, loaded with torch, is unaffected, and
    nothing leaks to child processes). A user's own OMP_WAIT_POLICY is left alone."""
    global _pool_started
    if _pool_started:
        return
    _pool_started = True
    if "OMP_WAIT_POLICY" in os.environ:
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        from numba.np.ufunc import parallel
        parallel._launch_threads()
    except Exception:  # pragma: no cover - the kernel's first call starts the pool anyway
        pass
    finally:
        del os.environ["OMP_WAIT_POLICY"]


def _attend_block(qs, keys, values, used, m, total, acc, p):
    """Steps 1-3 for one block: fold its first ``used`` tokens into one sequence's running
    max ``m``, denominator ``total`` and output ``acc`` (all per query head). ``qs`` holds
    the scaled queries [heads, d]; ``keys``/``values`` the block [block_size, kv_heads, d] in
    fp32; ``p`` is scratch [heads, block_size]."""
    num_heads, head_dim = qs.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    # 1. scores of this block; a token's keys for all KV heads are one contiguous row
    for o in range(used):
        for kvh in range(num_kv_heads):
            for g in range(group):
                h = kvh * group + g
                dot = np.float32(0.0)
                for d in range(head_dim):
                    dot += qs[h, d] * keys[o, kvh, d]
                p[h, o] = dot
    # 2. online softmax: a new maximum rescales what was accumulated so far
    for h in range(num_heads):
        m_new = m[h]
        for o in range(used):
            m_new = max(m_new, p[h, o])
        alpha = np.float32(math.exp(m[h] - m_new))
        total[h] *= alpha
        for d in range(head_dim):
            acc[h, d] *= alpha
        for o in range(used):
            e = np.float32(math.exp(p[h, o] - m_new))
            p[h, o] = e
            total[h] += e
        m[h] = m_new
    # 3. accumulate the values, weighted by the unnormalised probabilities
    for o in range(used):
        for kvh in range(num_kv_heads):
            for g in range(group):
                h = kvh * group + g
                w = p[h, o]
                for d in range(head_dim):
                    acc[h, d] += w * values[o, kvh, d]


def _start_sequence(q_seq, scale, block_size):
    """One sequence's state: scaled queries [heads, d], running max, running denominator,
    output accumulator, and the block's score scratch."""
    num_heads, head_dim = q_seq.shape
    qs = np.empty((num_heads, head_dim), dtype=np.float32)
    for h in range(num_heads):
        for d in range(head_dim):
            qs[h, d] = q_seq[h, d] * scale
    # Running max of the scores. A finite "minus infinity": fastmath lets the compiler
    # assume there are no infinities, and exp(-1e30 - m) is 0 all the same.
    m = np.full(num_heads, -1e30, dtype=np.float32)
    total = np.zeros(num_heads, dtype=np.float32)         # running softmax denominator
    acc = np.zeros((num_heads, head_dim), dtype=np.float32)
    p = np.empty((num_heads, block_size), dtype=np.float32)
    return qs, m, total, acc, p


def _finish_sequence(acc, total, out_seq):
    """Divide by the softmax denominator at the end."""
    num_heads, head_dim = acc.shape
    for h in range(num_heads):
        inv = np.float32(1.0) / total[h]
        for d in range(head_dim):
            out_seq[h, d] = acc[h, d] * inv


def _decode_kernel(q, k_cache, v_cache, block_tables, context_lens, scale, out):
    """fp32 caches: each block is read in place."""
    block_size = k_cache.shape[1]
    for s in prange(q.shape[0]):
        n = context_lens[s]
        qs, m, total, acc, p = _start_sequence(q[s], scale, block_size)
        for b in range((n + block_size - 1) // block_size):
            block = block_tables[s, b]
            _attend_block(qs, k_cache[block], v_cache[block], min(block_size, n - b * block_size),
                          m, total, acc, p)
        _finish_sequence(acc, total, out[s])


def _decode_kernel_bf16(q, k_bits, v_bits, block_tables, context_lens, scale, out):
    """bf16 caches, passed as their raw 16-bit patterns (uint16): a bf16 number is the top
    half of the fp32 number with the same bits, so widening is a shift. Each block is
    widened into an fp32 scratch block (in L1), then attended exactly as in fp32: half the
    bytes read from memory, the same arithmetic."""
    block_size, num_kv_heads, head_dim = k_bits.shape[1], k_bits.shape[2], k_bits.shape[3]
    for s in prange(q.shape[0]):
        n = context_lens[s]
        qs, m, total, acc, p = _start_sequence(q[s], scale, block_size)
        k_wide = np.zeros((block_size, num_kv_heads, head_dim), dtype=np.uint32)
        v_wide = np.zeros((block_size, num_kv_heads, head_dim), dtype=np.uint32)
        keys, values = k_wide.view(np.float32), v_wide.view(np.float32)
        for b in range((n + block_size - 1) // block_size):
            block = block_tables[s, b]
            used = min(block_size, n - b * block_size)
            kb, vb = k_bits[block], v_bits[block]
            for o in range(used):
                for kvh in range(num_kv_heads):
                    for d in range(head_dim):
                        k_wide[o, kvh, d] = np.uint32(kb[o, kvh, d]) << 16
                        v_wide[o, kvh, d] = np.uint32(vb[o, kvh, d]) << 16
            _attend_block(qs, keys, values, used, m, total, acc, p)
        _finish_sequence(acc, total, out[s])


if HAS_NUMBA:
    # fastmath lets the compiler vectorise the dot products (it reorders the fp32 sums,
    # as any SIMD or GPU kernel does); cache=True keeps the compiled code between runs.
    _start_sequence = njit(fastmath=True, cache=True, boundscheck=False)(_start_sequence)
    _finish_sequence = njit(fastmath=True, cache=True, boundscheck=False)(_finish_sequence)
    _attend_block = njit(fastmath=True, cache=True, boundscheck=False)(_attend_block)
    _decode_kernel = njit(parallel=True, fastmath=True, cache=True, boundscheck=False)(_decode_kernel)
    _decode_kernel_bf16 = njit(parallel=True, fastmath=True, cache=True, boundscheck=False)(_decode_kernel_bf16)


IMPLS = ("auto", "cpp", "numba")


def paged_decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, *, impl: str = "auto", k_scales: torch.Tensor | None = None,
                               v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over the paged cache, read in place (same contract as the reference).

    ``impl``: "auto" (the C++ kernel where it was built and has these shapes, else the Numba
    loop), "cpp" or "numba" (that one, or an error saying why it cannot run). A quantized
    cache (int8, fp8) comes with its ``k_scales``, ``v_scales``; the C++ kernel reads it, and
    where it cannot run, the torch reference (the Numba loop reads fp32 and bf16 only)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; choose one of {', '.join(map(repr, IMPLS))}")
    check_attention_inputs(q, k_cache, v_cache, block_tables, context_lens,  # the loops trust them
                           k_scales=k_scales, v_scales=v_scales)
    quantized = k_scales is not None
    usable = (q.device.type == "cpu" and k_cache.dtype in (torch.float32, torch.bfloat16, *QUANTIZED_DTYPES)
              and k_cache.is_contiguous() and v_cache.is_contiguous())
    ext = cpu_extension.load() if usable and impl != "numba" else None
    if ext is not None and not ext.supports(q.shape[2], q.shape[1] // k_cache.shape[2], k_cache.shape[1]):
        ext = None
    if impl == "cpp" and ext is None:
        raise RuntimeError("the C++ decode kernel cannot run here: " + (
            cpu_extension.status()[1] if usable else "it needs contiguous fp32, bf16, int8 or fp8 CPU caches")
            + " (or these shapes have no kernel)")
    if impl == "numba" and not (usable and HAS_NUMBA and not quantized):
        why = NUMBA_IMPORT_ERROR or ("it reads fp32 and bf16 caches, not quantized ones" if quantized
                                     else "not CPU fp32/bf16 caches")
        raise RuntimeError(f"the Numba decode kernel cannot run here ({why})")
    if q.shape[0] == 0:
        return torch.empty_like(q)
    tables, lens = block_tables.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous()
    if ext is not None:
        return ext.paged_decode_attention(q.float().contiguous(), k_cache, v_cache, tables, lens,
                                          float(scale), k_scales, v_scales).to(q.dtype)
    if not (usable and HAS_NUMBA) or quantized:
        return decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale, k_scales, v_scales)
    _start_numba_pool()
    out = torch.empty(q.shape, dtype=torch.float32)
    args = (tables.numpy(), lens.numpy(), np.float32(scale), out.numpy())
    q32 = q.float().contiguous().numpy()
    if k_cache.dtype == torch.float32:
        _decode_kernel(q32, k_cache.numpy(), v_cache.numpy(), *args)
    else:  # numpy has no bf16: hand over the bits
        _decode_kernel_bf16(q32, k_cache.view(torch.uint16).numpy(), v_cache.view(torch.uint16).numpy(), *args)
    return out.to(q.dtype)
