"""Paged prefill attention: chunks of new query tokens against paged context, causally.

A prompt is not always prefilled in one go, nor from scratch:

* **prefix caching**: the first blocks of a prompt may already be in the cache (another
  request had the same system prompt); only the remaining tokens are computed;
* **chunked prefill**: a long prompt is split over several steps so that decoding
  sequences are not stalled; each chunk attends to all earlier chunks.

So each sequence ``i`` brings a *chunk* of ``L_i`` new query tokens whose K/V have just been
written into the cache (``reshape_and_cache``), and ``context_lens[i]`` counts all of its
tokens, the chunk included. Query ``j`` of the chunk sits at position
``p = context_lens[i] - L_i + j`` and attends causally to positions ``0..p``: the cached
prefix or earlier chunks, then the chunk up to itself.

Several sequences' chunks are packed into one tensor: ``q`` is [total_query_tokens,
num_heads, head_dim], and sequence ``i``'s rows are
``query_start_loc[i]:query_start_loc[i + 1]`` (cumulative chunk lengths, like vLLM's
varlen layout). Chunks of different lengths mix freely in one call.

The kernel builds on ``paged_decode_attention`` (read that first) and reuses its two
``@triton.jit`` helpers, the paged address computation and the online-softmax step. What is
new: a program owns a *tile of query tokens* (times the GQA group of one KV head) instead of
one token, and the causal mask. Grid = sequences x KV heads x query tiles; the rows of a
tile are token-major, ``row = token * GROUP_PAD + head_in_group``, so the queries of one KV
head still share every K/V tile they load. A query tile stops reading keys at the last
position any of its rows can see.

``paged_prefill_attention_ref`` is the torch reference with the same signature;
``paged_prefill_attention_cpu`` the CPU backend's (contexts up to ``TILES_MAX_CONTEXT`` in the
C++ tiles of ``csrc/prefill_attention.cpp``, longer ones through SDPA).
"""

import torch
import torch.nn.functional as F

from ._common import (
    LOG2E,
    Launch,
    check_attention_inputs,
    check_triton_launch,
    dot_precision,
    gather_paged_kv_dequantized,
    kernel_tile,
    next_power_of_2,
    padded_head_dim,
    paged_attention_torch,
    reference_compute_dtype,
    tl,
    triton,
)
from .paged_decode_attention import (check_cache_dtype, load_kv_tile, online_softmax_step, paged_token_offsets,
                                     scale_args)

# Rows (query tokens x group heads) per program. 64 keeps tl.dot's M dimension well above
# its minimum and the accumulator [64, head_dim] in registers, with 4 warps up to head dims
# of 64 and tiles of 16 keys. Past that, 4 warps spill registers: 8 then, and on GPUs before
# sm_80 (the T4: no asynchronous copies, operands staged through registers) 32 rows for head
# dims of 128 (python -m labkit.bench gpu-compile measures each choice; docs/gpu.md).
_QUERY_ROWS = 64


def _rows_and_warps(head_dim_pad: int, tile: int, capability: tuple[int, int] | None,
                    widened_fp32: bool = False) -> tuple[int, int]:
    """(query rows, num_warps) of a prefill program for this head dim and key tile on this GPU.
    ``widened_fp32``: fp32 queries over a quantized cache, whose byte tiles are widened to fp32
    beside the accumulator: 4 warps spill there (sm_80: 255 registers and 664 bytes of spill
    stores, head dim 64), 8 do not (201 registers)."""
    old_gpu = capability is not None and capability < (8, 0)
    rows = _QUERY_ROWS // 2 if head_dim_pad >= 128 and old_gpu else _QUERY_ROWS
    return rows, (8 if head_dim_pad >= 128 or tile >= 32 or (widened_fp32 and not old_gpu) else 4)


@triton.jit(do_not_specialize=["stride_bt"])  # the block table's width follows the batch
def _paged_prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, block_tables_ptr, context_lens_ptr,
    query_start_loc_ptr,
    qk_scale,                                   # softmax scale * log2(e)
    stride_qt, stride_qh, stride_qd,            # q and out: [total_tokens, num_heads, head_dim]
    stride_ot, stride_oh, stride_od,
    stride_cb, stride_co, stride_ch, stride_cd,  # caches: [blocks, block_size, kv_heads, d]
    stride_sb, stride_so, stride_sh,            # scales (quantized caches): [blocks, block_size, kv_heads]
    stride_bt,                                  # block_tables: [num_seqs, max_blocks]
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, QUERY_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    first = tl.program_id(2) * QUERY_TILE       # first chunk token of this query tile
    q_start = tl.load(query_start_loc_ptr + seq)
    chunk_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if first >= chunk_len:                      # the grid is sized for the longest chunk
        return
    ctx_len = tl.load(context_lens_ptr + seq)
    prior = ctx_len - chunk_len                 # tokens cached before this chunk

    r = tl.arange(0, QUERY_TILE * GROUP_PAD)
    j = first + r // GROUP_PAD                  # chunk token of each row
    g = r % GROUP_PAD                           # query head (within the group) of each row
    row_mask = (j < chunk_len) & (g < GROUP)
    # Padding rows (j past the chunk) keep a position >= prior, so they see key 0 and their
    # softmax stays finite; they are never stored.
    q_pos = prior + j
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM
    head = kv_head * GROUP + g
    io_mask = row_mask[:, None] & d_mask[None, :]
    q_rows = (q_start + j)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_rows + d[None, :] * stride_qd, mask=io_mask, other=0.0)

    m_i = tl.full([QUERY_TILE * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([QUERY_TILE * GROUP_PAD], tl.float32)
    acc = tl.zeros([QUERY_TILE * GROUP_PAD, HEAD_DIM_PAD], tl.float32)

    block_table_row = block_tables_ptr + seq * stride_bt
    head_offset = kv_head * stride_ch
    offs_t = tl.arange(0, TILE)
    # Keys past the tile's last query position are invisible to every row: stop there.
    kv_end = tl.minimum(ctx_len, prior + first + QUERY_TILE)
    for start in range(0, kv_end, TILE):
        tok = start + offs_t
        tok_mask = tok < kv_end
        kv, sc = paged_token_offsets(block_table_row, tok, tok_mask, stride_cb, stride_co, stride_sb, stride_so,
                                     BLOCK_SIZE)
        kv_ptrs = kv[:, None] + head_offset + d[None, :] * stride_cd
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        sc_ptrs = sc + kv_head * stride_sh
        k = load_kv_tile(k_cache_ptr, k_scales_ptr, kv_ptrs, kv_mask, sc_ptrs, tok_mask, q, QUANTIZED)
        v = load_kv_tile(v_cache_ptr, v_scales_ptr, kv_ptrs, kv_mask, sc_ptrs, tok_mask, q, QUANTIZED)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        causal = tok[None, :] <= q_pos[:, None]
        s = tl.where(causal & tok_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, DOT_PRECISION)

    out = acc / l_i[:, None]
    o_rows = (q_start + j)[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(out_ptr + o_rows + d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, scale: float, *,
                            k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed prefill chunks over the paged cache (Triton).

    q [total_query_tokens, num_heads, head_dim], rows of sequence i at
    ``query_start_loc[i]:query_start_loc[i + 1]``; caches [num_blocks, block_size,
    num_kv_heads, head_dim] already holding the chunks' K/V; block_tables
    [num_seqs, max_blocks_per_seq] int32; context_lens [num_seqs] int32, each including its
    chunk (so >= the chunk length); query_start_loc [num_seqs + 1] int32.
    Returns ``out`` shaped like ``q``. A quantized cache (int8, fp8) needs its ``k_scales``,
    ``v_scales`` (``kv_quant.py``); its tiles are dequantized as they are read.
    """
    check_attention_inputs(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, k_scales, v_scales)
    check_triton_launch(_paged_prefill_kernel, q, k_cache, v_cache, block_tables, context_lens,
                        query_start_loc)
    check_cache_dtype(q, k_cache)
    out = torch.empty_like(q)
    if context_lens.shape[0] == 0 or q.shape[0] == 0:
        return out
    # One host sync: the grid's third axis must cover the longest chunk.
    max_chunk = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    plan_prefill(out, q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, max_chunk,
                 k_scales=k_scales, v_scales=v_scales)()
    return out


def plan_prefill(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 scale: float, max_chunk: int, capability: tuple[int, int] | None = None, *,
                 k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> Launch:
    """The prefill launch (arguments already checked; ``max_chunk`` the longest chunk, which
    sizes the grid): a program owns a query tile of ``QUERY_TILE`` tokens times the padded GQA
    group, 64 rows (32 on GPUs before sm_80 with head dims past 64), 4 or 8 warps (``_rows_and_warps``).
    ``capability``: the GPU's (None: q's device's; off a GPU it does not matter)."""
    num_seqs, num_heads, head_dim = context_lens.shape[0], q.shape[1], q.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    if capability is None and q.device.type == "cuda":
        capability = torch.cuda.get_device_capability(q.device)
    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    head_dim_pad, tile = padded_head_dim(head_dim), kernel_tile(block_size)
    rows, warps = _rows_and_warps(head_dim_pad, tile, capability,
                                  widened_fp32=k_scales is not None and q.dtype == torch.float32)
    query_tile = max(1, rows // group_pad)
    scales, scale_strides, quantized = scale_args(k_cache, v_cache, k_scales, v_scales)
    return Launch(
        _paged_prefill_kernel, (num_seqs, num_kv_heads, triton.cdiv(max_chunk, query_tile)),
        (out, q, k_cache, v_cache, *scales, block_tables, context_lens, query_start_loc, scale * LOG2E,
         *q.stride(), *out.stride(), *k_cache.stride(), *scale_strides, block_tables.stride(0)),
        dict(GROUP=group, GROUP_PAD=group_pad, QUERY_TILE=query_tile, HEAD_DIM=head_dim,
             HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size, TILE=tile,
             DOT_PRECISION=dot_precision(q.dtype), QUANTIZED=quantized),
        num_warps=warps,
    )


def _ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """ceil(log2(x)) of positive integers, exactly (frexp's exponent is (x-1).bit_length())."""
    return torch.frexp((x - 1).double()).exponent


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, context_lens: torch.Tensor,
                                query_start_loc: torch.Tensor, scale: float, *,
                                k_scales: torch.Tensor | None = None,
                                v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`paged_prefill_attention`: same arguments, same result.

    Chunks are padded into [seqs, longest chunk, heads, d] and their context gathered into
    [seqs, longest context, kv_heads, d]; one masked SDPA call then does the rest.
    Padding everything to the longest chunk and context would waste work quadratically
    when a 1000-token prompt shares a batch with one-token chunks, so sequences are first
    grouped by (ceil log2 chunk length, ceil log2 context length): within a group padding
    at most doubles each side. The loop runs over these few groups, not over sequences.
    A quantized cache is dequantized as it is gathered (``kv_quant.py``).
    """
    check_attention_inputs(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, k_scales, v_scales)
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    starts = query_start_loc[:-1].long()
    chunk_lens = query_start_loc[1:].long() - starts
    ctx_lens = context_lens.long()
    group_key = _ceil_log2(chunk_lens) * 64 + _ceil_log2(ctx_lens)
    group_key = torch.where(chunk_lens > 0, group_key, -1)  # empty chunks: nothing to do
    for key in torch.unique(group_key).tolist():
        if key < 0:
            continue
        seqs = (group_key == key).nonzero().squeeze(1)
        lens, ctx = chunk_lens[seqs, None], ctx_lens[seqs]
        j = torch.arange(int(lens.max()), device=q.device)
        real = j < lens                                   # [seqs, longest chunk]
        j = torch.minimum(j, lens - 1)                    # padding repeats the last query
        rows = starts[seqs, None] + j                     # row of q for each (seq, j)
        q_pos = ctx[:, None] - lens + j                   # absolute position of the query
        o = paged_attention_torch(q[rows], q_pos, k_cache, v_cache, block_tables[seqs], ctx, scale,
                                  k_scales, v_scales)
        out[rows[real]] = o[real]
    return out


# Chunks whose whole context is at most this many tokens take the C++ tiles
# (csrc/prefill_attention.cpp); longer ones take SDPA. Measured on a 2-core Intel Xeon
# (AVX-512), SmolLM2's 9/3 heads of 64, fp32, one fresh chunk, tiles vs SDPA: 8.1 vs 15.2 ms at
# 1024 tokens, 38.7 vs 45.2 at 2048; a 512-token chunk after 3584 cached tokens 48.2 vs 45.2:
# each row's scores are kept whole (8 rows x the context, 128 KB at 4096 tokens), and SDPA's
# online softmax over tiles of keys wins once they stop fitting in L2.
TILES_MAX_CONTEXT = 2048
# The cache dtypes the C++ loops read (csrc/paged_decode_attention.cpp, prefill_attention.cpp):
# fp32, bf16, and the quantized int8 and fp8 (e4m3), dequantized as they are read.
CPP_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn)


def _tile_kernel(q: torch.Tensor, k_cache: torch.Tensor):
    """The compiled module when prefill tiles run vectorized here (an AVX-512 or AVX2 build,
    head sizes a multiple of 16 up to 128), else None."""
    if q.device.type != "cpu" or k_cache.dtype not in CPP_CACHE_DTYPES:
        return None
    head_dim = q.shape[2]
    if head_dim % 16 or head_dim > 128 or q.shape[1] % k_cache.shape[2]:
        return None
    from . import cpu_extension
    ext = cpu_extension.load()
    if ext is None or ext.isa() == "portable":
        return None
    return ext


def paged_prefill_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, context_lens: torch.Tensor,
                                query_start_loc: torch.Tensor, scale: float, *,
                                k_scales: torch.Tensor | None = None,
                                v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU backend's prefill (same arguments and result as the reference).

    * **Contexts of at most** ``TILES_MAX_CONTEXT`` **tokens** (where the C++ kernels run
      vectorized): every such chunk in one call of the tiled loop
      (``kernels/csrc/prefill_attention.cpp``). Row ``j`` of a chunk attends to the first
      ``context_lens[i] - L_i + j + 1`` tokens of its sequence: exactly the causal mask,
      whatever came before the chunk (a cached prefix, earlier chunks). Eight rows at a time
      multiply their queries with each key panel (scores), take an exact softmax per row, and
      multiply-add the values read in place from the cache; only the causal part is computed.
    * **Otherwise**, each chunk takes one fused ``scaled_dot_product_attention(...,
      enable_gqa=True)`` call over its own context, gathered once from the cache ([1, heads,
      tokens, d], 4-d: with 3-d inputs torch takes its slow unfused path, 3x here). A
      *fresh* prompt (its chunk is its whole context) attends to nothing but itself: plain
      ``is_causal=True``, and the fused kernel skips the upper triangle. A chunk that
      follows earlier tokens sees all of them and itself causally: query ``i`` at position
      ``ctx - n + i`` attends to keys ``j <= ctx - n + i``, an explicit boolean mask.

    A quantized cache (int8, fp8: ``kv_quant.py``): the C++ loop dequantizes as it reads;
    the SDPA path gathers the chunk's context dequantized.
    """
    check_attention_inputs(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, k_scales, v_scales)
    ext = _tile_kernel(q, k_cache)
    if ext is not None and context_lens.numel() and int(context_lens.max()) <= TILES_MAX_CONTEXT:  # the common case
        return ext.paged_prefill_attention_tiles(
            q.float().contiguous(), k_cache, v_cache, block_tables.to(torch.int32).contiguous(),
            context_lens.to(torch.int32).contiguous(), query_start_loc.to(torch.int32).contiguous(), float(scale),
            k_scales, v_scales).to(q.dtype)
    starts, ctx = query_start_loc.tolist(), context_lens.tolist()  # one host sync each
    out = torch.empty_like(q)
    num_seqs = len(ctx)
    long_seqs = range(num_seqs)
    if ext is not None:
        short = [i for i in range(num_seqs) if ctx[i] <= TILES_MAX_CONTEXT and starts[i + 1] > starts[i]]
        long_seqs = [i for i in range(num_seqs) if ctx[i] > TILES_MAX_CONTEXT]
        if short:
            _prefill_tiles(ext, q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                          starts, short, scale, out, k_scales, v_scales)
    dtype = reference_compute_dtype(q)
    for i in long_seqs:
        a, b, c = starts[i], starts[i + 1], ctx[i]
        n = b - a
        if n == 0:
            continue
        k, v = (gather_paged_kv_dequantized(cache, scales, block_tables[i:i + 1], context_lens[i:i + 1], c,
                                            dtype)[0, :c]
                for cache, scales in ((k_cache, k_scales), (v_cache, v_scales)))   # [c, kv_heads, d]
        if n == c:
            mask, causal = None, n > 1
        else:
            positions = torch.arange(c - n, c, device=q.device)
            mask, causal = torch.arange(c, device=q.device)[None, :] <= positions[:, None], False
        o = F.scaled_dot_product_attention(q[a:b].to(dtype).transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=mask, is_causal=causal,
                                           scale=scale, enable_gqa=True)
        out[a:b] = o[0].transpose(0, 1).to(q.dtype)
    return out


def _prefill_tiles(ext, q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                   starts: list[int], seqs: list[int], scale: float, out: torch.Tensor,
                   k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> None:
    """Chunks ``seqs`` (some of the batch's sequences) through the C++ tiles: their rows
    gathered, passed as a batch of their own, and scattered back into ``out``."""
    sel = torch.tensor(seqs)
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in seqs])
    chunk_lens = (query_start_loc[1:] - query_start_loc[:-1])[sel]
    sub_starts = F.pad(chunk_lens.cumsum(0), (1, 0)).to(torch.int32)
    o = ext.paged_prefill_attention_tiles(q[rows].float().contiguous(), k_cache, v_cache,
                                          block_tables[sel].to(torch.int32).contiguous(),
                                          context_lens[sel].to(torch.int32).contiguous(), sub_starts,
                                          float(scale), k_scales, v_scales)
    out[rows] = o.to(q.dtype)
