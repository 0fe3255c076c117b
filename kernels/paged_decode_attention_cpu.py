"""Paged decode attention on a CPU: the decode kernel's algorithm as a compiled loop.

The torch reference (``paged_decode_attention_ref``) gathers every sequence's blocks into
a dense tensor and then attends: the K/V bytes are copied once more than they need to be,
and decode is memory-bound, so that copy costs about as much as the attention itself.
This kernel reads K and V *in place*, following the block table exactly as the Triton
kernel does, and is compiled by Numba (``@njit(parallel=True)``): one task per
sequence, spread over the CPU cores.

Each task:

1. scores: for every context position ``t``, find its slot through the block table
   (``block_tables[s, t // block_size]``, offset ``t % block_size``) and dot its keys with
   the query heads (GQA: each KV head serves ``group`` query heads). The keys of all KV
   heads of a token are one contiguous row of the block, so each row is read once, whole:
   one task per sequence rather than per (sequence, KV head), which would read a third of
   each row at a time and pay for the rest of the cache lines anyway;
2. softmax over the scores (max-subtracted, in fp32);
3. output: the probability-weighted sum of the values, read through the block table again.

Two passes over K then V, instead of the GPU kernel's one-pass online softmax: a CPU core
keeps a whole row of scores in its cache, and the two-pass form has fewer exponentials.
Same signature as the reference; fp32 only (others fall back to the reference).
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from .paged_decode_attention import paged_decode_attention_ref

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
        # 1. scores. A token's keys for all KV heads are one contiguous row of the block:
        #    read it once, for every query head (GQA: group query heads per KV head).
        scores = np.empty((num_heads, n), dtype=np.float32)
        for t in range(n):
            keys = k_cache[block_tables[s, t // block_size], t % block_size]   # [kv_heads, head_dim]
            for kvh in range(num_kv_heads):
                for g in range(group):
                    h = kvh * group + g
                    acc = np.float32(0.0)
                    for d in range(head_dim):
                        acc += qs[h, d] * keys[kvh, d]
                    scores[h, t] = acc
        # 2. softmax per query head
        for h in range(num_heads):
            m = scores[h].max()
            total = np.float32(0.0)
            for t in range(n):
                e = np.float32(math.exp(scores[h, t] - m))
                scores[h, t] = e
                total += e
            inv = np.float32(1.0) / total
            for t in range(n):
                scores[h, t] *= inv
        # 3. the probability-weighted sum of the values, each value row read once
        acc_v = np.zeros((num_heads, head_dim), dtype=np.float32)
        for t in range(n):
            values = v_cache[block_tables[s, t // block_size], t % block_size]
            for kvh in range(num_kv_heads):
                for g in range(group):
                    h = kvh * group + g
                    p = scores[h, t]
                    for d in range(head_dim):
                        acc_v[h, d] += p * values[kvh, d]
        for h in range(num_heads):
            for d in range(head_dim):
                out[s, h, d] = acc_v[h, d]


if HAS_NUMBA:
    # fastmath lets the compiler vectorise the dot products (it reorders the fp32 sums,
    # as any SIMD or GPU kernel does); cache=True keeps the compiled code between runs.
    _decode_kernel = njit(parallel=True, fastmath=True, cache=True, boundscheck=False)(_decode_kernel)


def paged_decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """Decode attention over the paged cache, read in place (same contract as the reference)."""
    usable = (HAS_NUMBA and q.device.type == "cpu" and q.dtype == torch.float32
              and k_cache.dtype == torch.float32 and v_cache.dtype == torch.float32)
    if not usable:
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    out = torch.empty(q.shape, dtype=torch.float32)
    _decode_kernel(q.contiguous().numpy(), k_cache.numpy(), v_cache.numpy(),
                   block_tables.to(torch.int32).contiguous().numpy(),
                   context_lens.to(torch.int32).contiguous().numpy(), np.float32(scale), out.numpy())
    return out
