"""Paged decode attention on a CPU: the decode kernel's algorithm as a compiled loop.

The torch reference (``paged_decode_attention_ref``) gathers every sequence's blocks into
a dense tensor and then attends: the K/V bytes are copied once more than they need to be,
and decode is memory-bound, so that copy costs about as much as the attention itself.
This kernel reads K and V *in place*, following the block table exactly as the Triton
kernel does, and is compiled by Numba (``@njit(parallel=True)``): one task per
sequence, spread over the CPU cores.

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
Same signature as the reference; fp32 only (others fall back to the reference).

The loop is compiled without bounds checks (``boundscheck=False``: a check per load would
cost more than the load). So the arguments are checked once per call, before it runs,
with the reference's checks (``_common.check_attention_inputs``): shapes, dtypes,
devices, every context length against its table row, every block id a sequence uses
against the cache. A bad block id is a ``ValueError`` that names it, not a segfault or
a silent read of another sequence's memory.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from ._common import check_attention_inputs
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


def _decode_kernel(q, k_cache, v_cache, block_tables, context_lens, scale, out):
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    for s in prange(num_seqs):
        n = context_lens[s]
        qs = np.empty((num_heads, head_dim), dtype=np.float32)
        for h in range(num_heads):
            for d in range(head_dim):
                qs[h, d] = q[s, h, d] * scale
        # Running max of the scores. A finite "minus infinity": fastmath lets the compiler
        # assume there are no infinities, and exp(-1e30 - m) is 0 all the same.
        m = np.full(num_heads, -1e30, dtype=np.float32)
        total = np.zeros(num_heads, dtype=np.float32)         # running softmax denominator
        acc = np.zeros((num_heads, head_dim), dtype=np.float32)
        p = np.empty((num_heads, block_size), dtype=np.float32)
        for b in range((n + block_size - 1) // block_size):
            keys = k_cache[block_tables[s, b]]        # [block_size, kv_heads, head_dim]
            values = v_cache[block_tables[s, b]]
            used = min(block_size, n - b * block_size)
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
        for h in range(num_heads):
            inv = np.float32(1.0) / total[h]
            for d in range(head_dim):
                out[s, h, d] = acc[h, d] * inv


if HAS_NUMBA:
    # fastmath lets the compiler vectorise the dot products (it reorders the fp32 sums,
    # as any SIMD or GPU kernel does); cache=True keeps the compiled code between runs.
    _decode_kernel = njit(parallel=True, fastmath=True, cache=True, boundscheck=False)(_decode_kernel)


def paged_decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """Decode attention over the paged cache, read in place (same contract as the reference)."""
    check_attention_inputs(q, k_cache, v_cache, block_tables, context_lens)  # the loop trusts them
    usable = (HAS_NUMBA and q.device.type == "cpu" and q.dtype == torch.float32
              and k_cache.dtype == torch.float32)
    if not usable:
        return decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    out = torch.empty(q.shape, dtype=torch.float32)
    _decode_kernel(q.contiguous().numpy(), k_cache.numpy(), v_cache.numpy(),
                   block_tables.to(torch.int32).contiguous().numpy(),
                   context_lens.to(torch.int32).contiguous().numpy(), np.float32(scale), out.numpy())
    return out
