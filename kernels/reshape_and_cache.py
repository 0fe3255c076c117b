"""Write new keys and values into the paged KV cache.

Every step the model computes K and V for its new tokens (one per decoding sequence, a
chunk per prefilling one). Before attention can read them they must land in the cache,
which is not one tensor per sequence but a pool of fixed-size blocks shared by all of them:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

The block manager decides where each token goes and the executor flattens that into one
number per token, its *slot*:

    slot = block_id * block_size + offset_in_block      (-1: do not write this token)

so token ``i`` is copied to ``k_cache[slot // block_size, slot % block_size]``. The name
(vLLM's) says what happens: a [num_tokens, kv_heads, head_dim] tensor is scattered
("reshaped") into blocks. Slots of one call must be distinct. Slot -1 marks padding
tokens (or tokens whose cache entry already exists) and is skipped. Both functions check
every slot against the cache first: the kernel's stores are not bounds-checked.

A quantized cache (``kv_cache_dtype`` "int8" or "fp8", ``kv_quant.py``) is written the same
way, each token's K and V of each KV head quantized on the way in: one byte per number, and
its scale (the vector's largest magnitude over 127 or 448) into ``k_scales`` / ``v_scales``
[num_blocks, block_size, num_kv_heads] at the same (block, offset, head).

Layout: ``reshape_and_cache`` is the Triton kernel's wrapper (checks, then the launch that
``plan_reshape_and_cache`` decides), ``reshape_and_cache_ref`` the torch reference with the
same signature; tests compare them.
"""

import torch

from ._common import (
    INDEX_DTYPES,
    Launch,
    check_kv_cache,
    check_on_cache_device,
    check_slot_mapping,
    check_triton_launch,
    next_power_of_2,
    tl,
    triton,
)
from .kv_quant import QMAX, as_bytes, check_kv_scales, quantize


@triton.jit
def round_to_e4m3(y):
    """``y`` (fp32, |y| <= 448) rounded to the nearest fp8 e4m3 number, ties to even, as fp32.

    Why by hand: the conversion that follows is then exact, so every GPU and the Triton
    interpreter store the same bytes as torch's ``.to(torch.float8_e4m3fn)`` (the
    interpreter's own fp32 -> fp8 rounding loses the carry into the exponent: 1.97 became 1).
    A normal e4m3 number keeps 3 of fp32's 23 mantissa bits: add half of the 20 dropped
    bits' weight (less one, plus the kept last bit: ties to even), then clear them; a carry
    runs into the exponent as it should. Below 2**-6 e4m3 is subnormal, multiples of 2**-9:
    ``y * 512`` rounded to a whole number by adding and taking away 1.5 * 2**23."""
    bits = y.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000        # -0x100000: 0xFFF00000, the kept bits
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = ((y * 512.0 + 12582912.0) - 12582912.0) / 512.0     # 12582912 = 1.5 * 2**23
    return tl.where(tl.abs(y) < 0.015625, subnormal, normal)


@triton.jit
def quantize_rows(x, mask, QMAX: tl.constexpr, IS_INT8: tl.constexpr):
    """Rows of ``x`` [heads, d] (fp32) as (numbers to store, fp32, and one scale per row):
    ``x / scale`` rounded as ``kv_quant.quantize`` rounds it, scale = max|x| / QMAX. Masked
    lanes count as 0. The numbers come back already rounded to the cache's type, so the
    caller's cast to it is exact."""
    amax = tl.max(tl.where(mask, tl.abs(x), 0.0), 1)
    # x / amax first, as the reference: QMAX / amax overflows for a row of tiny numbers. An
    # all-zero row (or a padding one) divides by 1: zeros, no 0 / 0.
    y = x / tl.where(amax > 0, amax, 1.0)[:, None] * QMAX
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if IS_INT8:
        # half away from zero, then the int conversion truncates: round(y), as the reference
        y = y + tl.where(y >= 0, 0.5, -0.5)
        y = y.to(tl.int32).to(tl.float32)
    else:
        y = round_to_e4m3(y)
    return y, amax / QMAX


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scales_ptr, v_scales_ptr,
    stride_kt, stride_kh, stride_kd,          # key [num_tokens, kv_heads, head_dim]
    stride_vt, stride_vh, stride_vd,          # value, same shape, maybe other strides
    stride_cb, stride_co, stride_ch, stride_cd,  # cache [blocks, block_size, kv_heads, d]
    stride_sb, stride_so, stride_sh,          # scales [blocks, block_size, kv_heads] (quantized caches)
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    QUANTIZED: tl.constexpr, QMAX: tl.constexpr, IS_INT8: tl.constexpr,
):
    # One program per token: it copies that token's [kv_heads, head_dim] tile of K and V.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: slot * strides can exceed 2**31
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    # The pads make tl.arange's power-of-two lengths fit any head count and head_dim.
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    src_k = key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd
    src_v = value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd
    dst = block_id * stride_cb + offset * stride_co + h[:, None] * stride_ch + d[None, :] * stride_cd
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    if QUANTIZED:   # one byte per number, and each head's scale at the token's slot
        k, k_scale = quantize_rows(k.to(tl.float32), mask, QMAX, IS_INT8)
        v, v_scale = quantize_rows(v.to(tl.float32), mask, QMAX, IS_INT8)
        scale_dst = block_id * stride_sb + offset * stride_so + h * stride_sh
        tl.store(k_scales_ptr + scale_dst, k_scale, mask=h < NUM_KV_HEADS)
        tl.store(v_scales_ptr + scale_dst, v_scale, mask=h < NUM_KV_HEADS)
    # Cast on the way in: the cache may be stored narrower (fp16, int8, fp8) than the activations.
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, slot_mapping: torch.Tensor,
           k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> None:
    """Shapes, dtypes and devices, then every slot against the cache (one host sync): the
    Triton kernel stores without bounds checks, so a slot past the cache would overwrite
    memory that is not the cache's."""
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_kv_scales(k_cache, k_scales, v_scales)
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in INDEX_DTYPES:
        raise ValueError(f"slot_mapping must be a 1-d int32 or int64 tensor, got {slot_mapping.dtype} "
                         f"of shape {tuple(slot_mapping.shape)}")
    expected = (slot_mapping.shape[0], num_kv_heads, head_dim)
    if key.shape != expected or value.shape != expected:
        raise ValueError(f"key and value must be {expected} (num_tokens, num_kv_heads, head_dim), "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if not (key.dtype.is_floating_point and value.dtype.is_floating_point):
        raise ValueError(f"key and value must be floating-point tensors, got {key.dtype} and {value.dtype}")
    check_on_cache_device(k_cache, key=key, value=value, slot_mapping=slot_mapping)
    check_slot_mapping(slot_mapping, num_blocks * block_size)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                      k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> None:
    """Write ``key[i]``, ``value[i]`` into cache slot ``slot_mapping[i]`` (Triton), in place.

    key, value: [num_tokens, num_kv_heads, head_dim]; caches:
    [num_blocks, block_size, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int32/int64,
    distinct slots, -1 = skip. A quantized cache (int8, fp8) needs ``k_scales`` and
    ``v_scales`` [num_blocks, block_size, num_kv_heads] fp32: each token's scales land there.
    """
    _check(key, value, k_cache, v_cache, slot_mapping, k_scales, v_scales)
    check_triton_launch(_reshape_and_cache_kernel, key, value, k_cache, v_cache)
    if slot_mapping.shape[0]:
        plan_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scales, v_scales)()


def plan_reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> Launch:
    """The cache write's launch (arguments already checked): one program per token, each
    copying a [kv_heads, head_dim] tile padded to powers of two (quantizing it, with scales)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    quantized = k_scales is not None
    # An unquantized cache has no scales: the kernel never touches its scale pointers
    # (QUANTIZED is a compile-time constant), so the cache itself stands in for them.
    k_s, v_s = (k_scales, v_scales) if quantized else (k_cache, v_cache)
    return Launch(
        _reshape_and_cache_kernel, (slot_mapping.shape[0],),
        (key, value, k_cache, v_cache, slot_mapping, k_s, v_s, *key.stride(), *value.stride(), *k_cache.stride(),
         *(k_scales.stride() if quantized else (0, 0, 0))),
        dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_PAD=next_power_of_2(num_kv_heads),
             HEAD_DIM_PAD=next_power_of_2(head_dim), BLOCK_SIZE=block_size, QUANTIZED=quantized,
             QMAX=QMAX.get(k_cache.dtype, 0.0), IS_INT8=k_cache.dtype == torch.int8),
    )


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                          k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> None:
    """Torch reference of :func:`reshape_and_cache`: same arguments, same effect.

    Viewing the cache as [num_blocks * block_size, kv_heads, head_dim] turns slots into
    row numbers, so the whole write is one ``index_copy_`` per cache (and per scale tensor,
    viewed as [num_blocks * block_size, kv_heads], for a quantized one: ``kv_quant.quantize``).
    """
    _check(key, value, k_cache, v_cache, slot_mapping, k_scales, v_scales)
    _, _, num_kv_heads, head_dim = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping.long()
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    for cache, scales, new in ((k_cache, k_scales, key), (v_cache, v_scales, value)):
        rows = cache.view(-1, num_kv_heads, head_dim)  # a view: writes land in the cache
        if scales is None:
            rows.index_copy_(0, slots, new.to(cache.dtype))
            continue
        stored, new_scales = quantize(new, cache.dtype)
        as_bytes(rows).index_copy_(0, slots, as_bytes(stored))
        scales.view(-1, num_kv_heads).index_copy_(0, slots, new_scales)
