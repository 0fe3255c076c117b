"""Paged decode attention: one new query token per sequence against its cached K/V.

During decoding each running sequence contributes one token per step. Its query must
attend over every earlier token's key and value, which live in the paged KV cache:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

A sequence's tokens are *not* contiguous there. Its block table lists its blocks in order:
token ``t`` of sequence ``s`` sits in block ``block_tables[s, t // block_size]`` at offset
``t % block_size``. The blocks can be anywhere in the pool, in any order, shared with other
sequences (prefix caching, copy-on-write forks). Entries past the sequence's last block are
unused and may hold garbage; slots past ``context_lens[s]`` in the last block were never
written. The kernel reads neither.

What one program computes (grid = sequences x KV heads):

* **GQA.** With grouped-query attention ``num_heads = group * num_kv_heads`` and query head
  ``h`` uses KV head ``h // group``. One program owns one KV head and all ``group`` query
  heads that read it, as the rows of a small matrix, so each KV block is read from memory
  once per KV head, not once per query head. Decode is memory-bound: this is the saving.
* **Paging.** The keys are walked in tiles of ``TILE`` tokens; each token's cache address
  comes from the block table. With blocks of 16 or 32 tokens a tile is exactly one block;
  with blocks of 8 a tile spans two, with blocks of 64 it is half of one (``kernel_tile``).
* **Online softmax.** softmax(q K^T) V is computed in one pass over the tiles, never holding
  all scores: keep, per query row, the running maximum ``m``, the running denominator ``l``
  and the running output ``acc``; when a tile raises the maximum, rescale ``l`` and ``acc``
  by ``exp(m_old - m_new)``. At the end ``out = acc / l``. This is the idea of
  FlashAttention; paged decode kernels in vLLM (PagedAttention) use the same update.

**Flash-decoding: splitting long contexts.** One program per (sequence, KV head) is
``num_seqs * num_kv_heads`` programs: at batch 4 with 8 KV heads, 32 programs on a GPU with
100+ streaming multiprocessors, each walking a whole 8k-token context alone, while most of
the GPU idles. The split path cuts each context into partitions of ``partition_size`` tokens,
one program per (sequence, KV head, partition), each running the same online softmax over
its partition only and storing its partial result: running max ``m``, denominator ``l`` and
unnormalised output ``acc``. A second, small kernel combines a sequence's partials exactly
as the online softmax combines tiles: ``M = max_p m_p``, ``l = sum_p l_p 2^(m_p - M)``,
``out = sum_p acc_p 2^(m_p - M) / l``. The result equals the unsplit kernel's up to float
rounding. ``choose_partition_size`` splits only when the unsplit grid would leave the GPU's
multiprocessors idle and a context spans more than one partition (FlashDecoding; vLLM's
PagedAttention V2 and its Triton decode kernels do the same).

**A quantized cache** (``kv_cache_dtype`` "int8" or "fp8": one byte per number, one fp32
scale per token and KV head, ``kv_quant.py``) is read tile by tile as it is: the kernel
loads the bytes and their scales, multiplies, and goes on in q's dtype. The cache's bytes
are what crosses memory, a quarter of fp32's; the dequantized tile lives in registers only.

``paged_decode_attention_ref`` is the torch reference with the same signature: gather each
sequence's blocks into a dense padded tensor, then one masked
``scaled_dot_product_attention``. It is the ``"torch"`` backend's decode, and the fallback
of the CPU kernel (``paged_decode_attention_cpu.py``) for dtypes other than fp32.

Every entry point checks its arguments first (``_common.check_attention_inputs``): the
kernel itself trusts them, and a block id past the cache would make it read memory it
does not own.
"""

import torch

from labkit.utils import cdiv

from ._common import (
    LOG2E,
    Launch,
    check_attention_inputs,
    check_triton_launch,
    dot_precision,
    kernel_tile,
    next_power_of_2,
    padded_head_dim,
    paged_attention_torch,
    tl,
    triton,
)
from .kv_quant import is_quantized


@triton.jit
def paged_token_offsets(block_table_row_ptr, tok, tok_mask, stride_cb, stride_co, stride_sb, stride_so,
                        BLOCK_SIZE: tl.constexpr):
    """Offsets (in elements) of tokens ``tok`` of one sequence inside the paged cache, and
    inside its scales (a quantized cache's ``[blocks, block_size, kv_heads]``; strides 0
    otherwise, and nobody reads them).

    The one place where paging happens: position -> (block table entry, offset in block).
    Masked-off tokens read no table entry (their garbage is never dereferenced) and get
    offset 0; every load that uses the offsets is masked with ``tok_mask`` too.
    The prefill kernel calls this as well.
    """
    block_id = tl.load(block_table_row_ptr + tok // BLOCK_SIZE, mask=tok_mask, other=0)
    # int64: block_id * stride_cb overflows int32 once the cache passes 2**31 elements.
    block_id = block_id.to(tl.int64)
    offset = tok % BLOCK_SIZE
    return block_id * stride_cb + offset * stride_co, block_id * stride_sb + offset * stride_so


@triton.jit
def load_kv_tile(cache_ptr, scales_ptr, kv_ptrs, kv_mask, scale_ptrs, tok_mask, like,
                 QUANTIZED: tl.constexpr):
    """A [TILE, d] tile of K or V in the dtype of ``like`` (the queries). A quantized cache's
    bytes are widened and multiplied by each token's scale here, in registers: the
    dequantization in the inner loop. Masked tokens load 0 (slots past the length may hold
    NaN; zeros keep 0 * v clean). The prefill kernel calls this as well."""
    x = tl.load(cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
    if QUANTIZED:
        scale = tl.load(scales_ptr + scale_ptrs, mask=tok_mask, other=0.0)
        x = x.to(tl.float32) * scale[:, None]
    return x.to(like.dtype)


@triton.jit
def online_softmax_step(m_i, l_i, acc, s, v, DOT_PRECISION: tl.constexpr):
    """Fold one tile of scores ``s`` [rows, TILE] (base-2 logits, masked = -inf) and its
    values ``v`` [TILE, d] into the running (max ``m_i``, denominator ``l_i``, output ``acc``).

    Invariant: a row's first tile holds at least one unmasked score, so ``m_i`` is finite
    from then on and exp2(-inf - m) is a clean 0 (no -inf - -inf = NaN).
    The prefill kernel calls this as well.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)          # rescales what was accumulated under the old max
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def load_query_rows(q_ptr, seq, kv_head, stride_qs, stride_qh, stride_qd,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """The query heads of one KV head, as the rows of a [GROUP_PAD, HEAD_DIM_PAD] matrix
    (GROUP_PAD >= 16 so tl.dot accepts the shape on every GPU; padding rows and lanes load
    zeros and are never stored). Returns (q, head ids, row mask, lanes d, lane mask)."""
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    row_mask = g < GROUP
    d_mask = d < HEAD_DIM
    head = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_qs + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    return q, head, row_mask, d, d_mask


@triton.jit
def attend_token_range(q, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, block_table_row, head_offset,
                       scale_head_offset, start, end, d, d_mask, qk_scale, stride_cb, stride_co, stride_cd,
                       stride_sb, stride_so,
                       GROUP_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       QUANTIZED: tl.constexpr):
    """The online softmax of the query rows ``q`` over tokens ``start .. end-1`` of one
    sequence (``start`` a multiple of ``TILE``, ``end > start``), tile by tile: returns the
    running (max ``m``, denominator ``l``, unnormalised output ``acc``). The unsplit kernel
    runs it over the whole context, the split one over its partition."""
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    offs_t = tl.arange(0, TILE)
    for tile_start in range(start, end, TILE):
        tok = tile_start + offs_t
        tok_mask = tok < end                # partly filled last block: stop at the length
        kv, sc = paged_token_offsets(block_table_row, tok, tok_mask, stride_cb, stride_co, stride_sb, stride_so,
                                     BLOCK_SIZE)
        kv_ptrs = kv[:, None] + head_offset + d[None, :] * stride_cd
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        sc_ptrs = sc + scale_head_offset
        k = load_kv_tile(k_cache_ptr, k_scales_ptr, kv_ptrs, kv_mask, sc_ptrs, tok_mask, q, QUANTIZED)
        v = load_kv_tile(v_cache_ptr, v_scales_ptr, kv_ptrs, kv_mask, sc_ptrs, tok_mask, q, QUANTIZED)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(tok_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, DOT_PRECISION)
    return m_i, l_i, acc


# Triton compiles a kernel again for each new "specialization" of its integer arguments (equal
# to 1, a multiple of 16, anything else). Strides that follow the batch (the block table's
# width, the number of partitions) would make the engine recompile as contexts grow, and make
# the build the compile check (labkit.bench.gpu_compile) proves differ from the one that runs:
# they are not specialized. Every other integer argument is fixed by the model's shapes.
_BATCH_STRIDES = ["stride_bt", "stride_ms", "stride_mh", "stride_as", "stride_ah"]


@triton.jit(do_not_specialize=["stride_bt"])
def _paged_decode_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, block_tables_ptr, context_lens_ptr,
    qk_scale,                                   # softmax scale * log2(e)
    stride_qs, stride_qh, stride_qd,            # q and out: [num_seqs, num_heads, head_dim]
    stride_os, stride_oh, stride_od,
    stride_cb, stride_co, stride_ch, stride_cd,  # caches: [blocks, block_size, kv_heads, d]
    stride_sb, stride_so, stride_sh,            # scales (quantized caches): [blocks, block_size, kv_heads]
    stride_bt,                                  # block_tables: [num_seqs, max_blocks]
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx_len = tl.load(context_lens_ptr + seq)

    # Rows = the query heads of this KV head: each K/V tile is read once for all of them.
    q, head, row_mask, d, d_mask = load_query_rows(q_ptr, seq, kv_head, stride_qs, stride_qh, stride_qd,
                                                   GROUP, GROUP_PAD, HEAD_DIM, HEAD_DIM_PAD)
    m_i, l_i, acc = attend_token_range(
        q, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, block_tables_ptr + seq * stride_bt,
        kv_head * stride_ch, kv_head * stride_sh, 0, ctx_len, d, d_mask, qk_scale, stride_cb, stride_co,
        stride_cd, stride_sb, stride_so, GROUP_PAD, HEAD_DIM_PAD, BLOCK_SIZE, TILE, DOT_PRECISION, QUANTIZED)

    out = acc / l_i[:, None]
    tl.store(out_ptr + seq * stride_os + head[:, None] * stride_oh + d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=_BATCH_STRIDES)
def _paged_decode_split_kernel(
    m_ptr, l_ptr, acc_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, block_tables_ptr,
    context_lens_ptr, qk_scale,
    stride_qs, stride_qh, stride_qd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_sb, stride_so, stride_sh,
    stride_bt,
    stride_ms, stride_mh, stride_mp,            # m and l: [num_seqs, num_heads, max_partitions]
    stride_as, stride_ah, stride_ap, stride_ad,  # acc: [num_seqs, num_heads, max_partitions, d]
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PARTITION: tl.constexpr,
    DOT_PRECISION: tl.constexpr, QUANTIZED: tl.constexpr,
):
    """One (sequence, KV head, partition): the online softmax over tokens
    ``[part * PARTITION, (part + 1) * PARTITION)`` only, stored unnormalised. A partition
    past the context stores nothing; the reduce kernel never reads it."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    ctx_len = tl.load(context_lens_ptr + seq)
    start = part * PARTITION
    if start < ctx_len:
        q, head, row_mask, d, d_mask = load_query_rows(q_ptr, seq, kv_head, stride_qs, stride_qh, stride_qd,
                                                       GROUP, GROUP_PAD, HEAD_DIM, HEAD_DIM_PAD)
        m_i, l_i, acc = attend_token_range(
            q, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, block_tables_ptr + seq * stride_bt,
            kv_head * stride_ch, kv_head * stride_sh, start, tl.minimum(start + PARTITION, ctx_len), d, d_mask,
            qk_scale, stride_cb, stride_co, stride_cd, stride_sb, stride_so, GROUP_PAD, HEAD_DIM_PAD, BLOCK_SIZE,
            TILE, DOT_PRECISION, QUANTIZED)
        ml_off = seq * stride_ms + head * stride_mh + part * stride_mp
        tl.store(m_ptr + ml_off, m_i, mask=row_mask)
        tl.store(l_ptr + ml_off, l_i, mask=row_mask)
        tl.store(acc_ptr + seq * stride_as + head[:, None] * stride_ah + part * stride_ap
                 + d[None, :] * stride_ad, acc, mask=row_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=_BATCH_STRIDES[1:])
def _paged_decode_reduce_kernel(
    out_ptr, m_ptr, l_ptr, acc_ptr, context_lens_ptr,
    stride_os, stride_oh, stride_od,
    stride_ms, stride_mh, stride_mp,
    stride_as, stride_ah, stride_ap, stride_ad,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PARTITION: tl.constexpr,
):
    """One (sequence, KV head): combine the partitions' (m, l, acc) into the output, with the
    online softmax's own rescaling, partition after partition."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx_len = tl.load(context_lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    row_mask = g < GROUP
    d_mask = d < HEAD_DIM
    head = kv_head * GROUP + g
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for part in range(0, tl.cdiv(ctx_len, PARTITION)):
        ml_off = seq * stride_ms + head * stride_mh + part * stride_mp
        # padding rows: m = 0, l = 1, acc = 0 keep them finite; they are never stored
        m_p = tl.load(m_ptr + ml_off, mask=row_mask, other=0.0)
        l_p = tl.load(l_ptr + ml_off, mask=row_mask, other=1.0)
        acc_p = tl.load(acc_ptr + seq * stride_as + head[:, None] * stride_ah + part * stride_ap
                        + d[None, :] * stride_ad, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        m_new = tl.maximum(m_i, m_p)        # finite: every stored partition held a token
        alpha = tl.exp2(m_i - m_new)        # 0 for the first partition (m_i = -inf)
        beta = tl.exp2(m_p - m_new)
        l_i = l_i * alpha + l_p * beta
        acc = acc * alpha[:, None] + acc_p * beta[:, None]
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + seq * stride_os + head[:, None] * stride_oh + d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


DEFAULT_PARTITION_SIZE = 512    # tokens per program when splitting (vLLM's PagedAttention V2: 512)


def choose_partition_size(num_seqs: int, num_kv_heads: int, max_context_len: int,
                          num_sms: int | None, tile: int = 16) -> int:
    """The partition size for the split path, or 0 for one program per (sequence, KV head).

    Split when the unsplit grid has fewer programs than the GPU has streaming
    multiprocessors (``num_sms``; None off a GPU: never) and some context spans more than one
    partition. The partition is a whole number of tiles.
    """
    if not num_sms or num_seqs * num_kv_heads >= num_sms:
        return 0
    size = cdiv(DEFAULT_PARTITION_SIZE, tile) * tile
    return size if max_context_len > size else 0


def multiprocessor_count(device: torch.device) -> int | None:
    """Streaming multiprocessors of a CUDA device (what a grid must fill); None elsewhere."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, partition_size: int | None = None, *,
                           k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over the paged cache (Triton). Returns ``out`` shaped like ``q``.

    q [num_seqs, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size,
    num_kv_heads, head_dim]; block_tables [num_seqs, max_blocks_per_seq] int32;
    context_lens [num_seqs] int32, each >= 1 (the query's own K/V already cached);
    ``scale`` multiplies q.k (usually head_dim ** -0.5). fp32 and fp16; bf16 on GPUs of
    compute capability 8.0+.
    ``partition_size``: None chooses (:func:`choose_partition_size`; never off a GPU), 0
    never splits, N splits every context into partitions of N tokens (a multiple of the
    kernel's tile, :func:`kernel_tile` of the block size), flash-decoding style.
    A quantized cache (int8, fp8) needs its ``k_scales``, ``v_scales`` [num_blocks,
    block_size, num_kv_heads] (``kv_quant.py``); its tiles are dequantized as they are read.
    """
    check_attention_inputs(q, k_cache, v_cache, block_tables, context_lens, k_scales=k_scales, v_scales=v_scales)
    check_triton_launch(_paged_decode_kernel, q, k_cache, v_cache, block_tables, context_lens)
    check_cache_dtype(q, k_cache)
    out = torch.empty_like(q)
    if q.shape[0]:
        for launch in plan_decode(out, q, k_cache, v_cache, block_tables, context_lens, scale, partition_size,
                                  k_scales=k_scales, v_scales=v_scales):
            launch()
    return out


def check_cache_dtype(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """The Triton kernels read a cache of q's own dtype, or a quantized one (int8, fp8)."""
    if q.dtype != k_cache.dtype and not is_quantized(k_cache.dtype):
        raise ValueError(f"q ({q.dtype}) and the cache ({k_cache.dtype}) must share a dtype "
                         "(or the cache be quantized: int8, fp8)")


def scale_args(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scales: torch.Tensor | None,
               v_scales: torch.Tensor | None) -> tuple[tuple, tuple, bool]:
    """(scale pointers, their strides, QUANTIZED) for a launch. An unquantized cache has no
    scales: its kernels never read the scale pointers (QUANTIZED is a compile-time constant),
    so the caches stand in for them, with strides 0."""
    if k_scales is None:
        return (k_cache, v_cache), (0, 0, 0), False
    return (k_scales, v_scales), tuple(k_scales.stride()), True


def plan_decode(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                partition_size: int | None = None, num_sms: int | None = None, *,
                k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> list[Launch]:
    """The launches of one decode call (arguments already checked): the unsplit kernel, or
    the split kernel then the reduce, whose partials it allocates here (fp32, on q's device).
    ``num_sms``: the GPU's multiprocessors, for :func:`choose_partition_size` (None: q's device's).

    Everything is decided from shapes, dtypes and the device, never from tensor values, so
    ``python -m labkit.bench gpu-compile`` can plan the same launches on ``meta`` tensors.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    tile = kernel_tile(block_size)
    # The longest context the block tables can describe: known on the host, no device sync.
    max_context_len = block_tables.shape[1] * block_size
    if partition_size is None:
        partition_size = choose_partition_size(num_seqs, num_kv_heads, max_context_len,
                                               num_sms or multiprocessor_count(q.device), tile)
    if not isinstance(partition_size, int) or partition_size < 0 or partition_size % tile:
        raise ValueError(f"partition_size must be 0 (no split) or a positive multiple of the kernel's "
                         f"tile ({tile} tokens for blocks of {block_size}); got {partition_size!r}")
    group = num_heads // num_kv_heads
    shapes = dict(GROUP=group, GROUP_PAD=max(16, next_power_of_2(group)),
                  HEAD_DIM=head_dim, HEAD_DIM_PAD=padded_head_dim(head_dim))
    scales, scale_strides, quantized = scale_args(k_cache, v_cache, k_scales, v_scales)
    tiles = dict(BLOCK_SIZE=block_size, TILE=tile, DOT_PRECISION=dot_precision(q.dtype), QUANTIZED=quantized)
    # 8 warps once a K/V tile reaches 32 x 128: with 4, fp32 builds spill registers on
    # sm_89 and sm_90 (python -m labkit.bench gpu-compile; docs/gpu.md has the figures).
    warps = 8 if tile * shapes["HEAD_DIM_PAD"] >= 4096 else 4
    if not partition_size:
        return [Launch(_paged_decode_kernel, (num_seqs, num_kv_heads),
                       (out, q, k_cache, v_cache, *scales, block_tables, context_lens, scale * LOG2E,
                        *q.stride(), *out.stride(), *k_cache.stride(), *scale_strides, block_tables.stride(0)),
                       {**shapes, **tiles}, num_warps=warps)]
    num_partitions = cdiv(max_context_len, partition_size)
    m = torch.empty(num_seqs, num_heads, num_partitions, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)  # noqa: E741 (FlashAttention's m and l: running max and denominator)
    acc = torch.empty(num_seqs, num_heads, num_partitions, head_dim, dtype=torch.float32, device=q.device)
    split = Launch(_paged_decode_split_kernel, (num_seqs, num_kv_heads, num_partitions),
                   (m, l, acc, q, k_cache, v_cache, *scales, block_tables, context_lens, scale * LOG2E,
                    *q.stride(), *k_cache.stride(), *scale_strides, block_tables.stride(0), *m.stride(),
                    *acc.stride()),
                   {**shapes, **tiles, "PARTITION": partition_size}, num_warps=warps)
    reduce = Launch(_paged_decode_reduce_kernel, (num_seqs, num_kv_heads),
                    (out, m, l, acc, context_lens, *out.stride(), *m.stride(), *acc.stride()),
                    {**shapes, "PARTITION": partition_size})
    return [split, reduce]


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, *, k_scales: torch.Tensor | None = None,
                               v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`paged_decode_attention`: same arguments, same result.

    Gather each sequence's blocks into a dense [seqs, max_len, kv_heads, d] tensor (padding
    zeroed), then one masked ``scaled_dot_product_attention`` with the query heads folded
    per KV head (see ``_common.paged_attention_torch``; on CPU it works through the batch in
    cache-sized chunks of sequences). No Python loop over sequences or tokens. A quantized
    cache is dequantized as it is gathered (``k_scales``, ``v_scales``: ``kv_quant.py``).
    """
    check_attention_inputs(q, k_cache, v_cache, block_tables, context_lens, k_scales=k_scales, v_scales=v_scales)
    return decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale, k_scales, v_scales)


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, k_scales: torch.Tensor | None = None,
                           v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's computation, for callers that have already checked the arguments."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    q_pos = (context_lens.long() - 1)[:, None]  # the new token is the sequence's last
    out = paged_attention_torch(q[:, None], q_pos, k_cache, v_cache, block_tables, context_lens, scale,
                                k_scales, v_scales)
    return out[:, 0]
