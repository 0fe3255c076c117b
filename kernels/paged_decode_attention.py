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
  comes from the block table. With ``block_size >= 16`` a tile is exactly one block; with
  block size 8 a tile spans two.
* **Online softmax.** softmax(q K^T) V is computed in one pass over the tiles, never holding
  all scores: keep, per query row, the running maximum ``m``, the running denominator ``l``
  and the running output ``acc``; when a tile raises the maximum, rescale ``l`` and ``acc``
  by ``exp(m_old - m_new)``. At the end ``out = acc / l``. This is the idea of
  FlashAttention; paged decode kernels in vLLM (PagedAttention) use the same update.

``paged_decode_attention_ref`` is the torch reference with the same signature: gather each
sequence's blocks into a dense padded tensor, then one masked
``scaled_dot_product_attention``. It is the ``"torch"`` backend's decode, and the fallback
of the CPU kernel (``paged_decode_attention_cpu.py``) for dtypes other than fp32.

Every entry point checks its arguments first (``_common.check_attention_inputs``): the
kernel itself trusts them, and a block id past the cache would make it read memory it
does not own.
"""

import torch

from ._common import (
    LOG2E,
    check_attention_inputs,
    check_triton_launch,
    dot_precision,
    next_power_of_2,
    padded_head_dim,
    paged_attention_torch,
    tl,
    triton,
)


@triton.jit
def paged_token_offsets(block_table_row_ptr, tok, tok_mask, stride_cb, stride_co,
                        BLOCK_SIZE: tl.constexpr):
    """Offsets (in elements) of tokens ``tok`` of one sequence inside the paged cache.

    The one place where paging happens: position -> (block table entry, offset in block).
    Masked-off tokens read no table entry (their garbage is never dereferenced) and get
    offset 0; every load that uses the offsets is masked with ``tok_mask`` too.
    The prefill kernel calls this as well.
    """
    block_id = tl.load(block_table_row_ptr + tok // BLOCK_SIZE, mask=tok_mask, other=0)
    # int64: block_id * stride_cb overflows int32 once the cache passes 2**31 elements.
    return block_id.to(tl.int64) * stride_cb + (tok % BLOCK_SIZE) * stride_co


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
def _paged_decode_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    qk_scale,                                   # softmax scale * log2(e)
    stride_qs, stride_qh, stride_qd,            # q and out: [num_seqs, num_heads, head_dim]
    stride_os, stride_oh, stride_od,
    stride_cb, stride_co, stride_ch, stride_cd,  # caches: [blocks, block_size, kv_heads, d]
    stride_bt,                                  # block_tables: [num_seqs, max_blocks]
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx_len = tl.load(context_lens_ptr + seq)

    # Rows = the query heads of this KV head, padded to GROUP_PAD (>= 16 so tl.dot accepts
    # the shape on every GPU); padding rows load zeros and are never stored.
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    row_mask = g < GROUP
    d_mask = d < HEAD_DIM
    head = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_qs + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)

    block_table_row = block_tables_ptr + seq * stride_bt
    head_offset = kv_head * stride_ch
    offs_t = tl.arange(0, TILE)
    for start in range(0, ctx_len, TILE):
        tok = start + offs_t
        tok_mask = tok < ctx_len            # partly filled last block: stop at the length
        kv = paged_token_offsets(block_table_row, tok, tok_mask, stride_cb, stride_co, BLOCK_SIZE)
        kv_ptrs = kv[:, None] + head_offset + d[None, :] * stride_cd
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        # other=0: slots past the length may hold NaN; zeros keep 0 * v clean.
        k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(tok_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, DOT_PRECISION)

    out = acc / l_i[:, None]
    tl.store(out_ptr + seq * stride_os + head[:, None] * stride_oh + d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Decode attention over the paged cache (Triton). Returns ``out`` shaped like ``q``.

    q [num_seqs, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size,
    num_kv_heads, head_dim]; block_tables [num_seqs, max_blocks_per_seq] int32;
    context_lens [num_seqs] int32, each >= 1 (the query's own K/V already cached);
    ``scale`` multiplies q.k (usually head_dim ** -0.5). fp32, fp16, and bf16 on a GPU.
    """
    group = check_attention_inputs(q, k_cache, v_cache, block_tables, context_lens)
    check_triton_launch(_paged_decode_kernel, q, k_cache, v_cache, block_tables, context_lens)
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q ({q.dtype}) and the cache ({k_cache.dtype}) must share a dtype")
    num_seqs, _, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        out, q, k_cache, v_cache, block_tables, context_lens,
        scale * LOG2E,
        *q.stride(), *out.stride(), *k_cache.stride(), block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=padded_head_dim(head_dim),
        BLOCK_SIZE=block_size, TILE=max(16, block_size),
        DOT_PRECISION=dot_precision(q.dtype),
    )
    return out


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """Torch reference of :func:`paged_decode_attention`: same arguments, same result.

    Gather each sequence's blocks into a dense [seqs, max_len, kv_heads, d] tensor (padding
    zeroed), then one masked ``scaled_dot_product_attention`` with the query heads folded
    per KV head (see ``_common.paged_attention_torch``; on CPU it works through the batch in
    cache-sized chunks of sequences). No Python loop over sequences or tokens.
    """
    check_attention_inputs(q, k_cache, v_cache, block_tables, context_lens)
    return decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale)


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """The reference's computation, for callers that have already checked the arguments."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    q_pos = (context_lens.long() - 1)[:, None]  # the new token is the sequence's last
    out = paged_attention_torch(q[:, None], q_pos, k_cache, v_cache, block_tables, context_lens, scale)
    return out[:, 0]
