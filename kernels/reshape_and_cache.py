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


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,          # key [num_tokens, kv_heads, head_dim]
    stride_vt, stride_vh, stride_vd,          # value, same shape, maybe other strides
    stride_cb, stride_co, stride_ch, stride_cd,  # cache [blocks, block_size, kv_heads, d]
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
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
    # Cast on the way in: the cache may be stored narrower (fp16) than the activations.
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Shapes, dtypes and devices, then every slot against the cache (one host sync): the
    Triton kernel stores without bounds checks, so a slot past the cache would overwrite
    memory that is not the cache's."""
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
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
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key[i]``, ``value[i]`` into cache slot ``slot_mapping[i]`` (Triton), in place.

    key, value: [num_tokens, num_kv_heads, head_dim]; caches:
    [num_blocks, block_size, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int32/int64,
    distinct slots, -1 = skip.
    """
    _check(key, value, k_cache, v_cache, slot_mapping)
    check_triton_launch(_reshape_and_cache_kernel, key, value, k_cache, v_cache)
    if slot_mapping.shape[0]:
        plan_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)()


def plan_reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> Launch:
    """The cache write's launch (arguments already checked): one program per token, each
    copying a [kv_heads, head_dim] tile padded to powers of two."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    return Launch(
        _reshape_and_cache_kernel, (slot_mapping.shape[0],),
        (key, value, k_cache, v_cache, slot_mapping, *key.stride(), *value.stride(), *k_cache.stride()),
        dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_PAD=next_power_of_2(num_kv_heads),
             HEAD_DIM_PAD=next_power_of_2(head_dim), BLOCK_SIZE=block_size),
    )


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Torch reference of :func:`reshape_and_cache`: same arguments, same effect.

    Viewing the cache as [num_blocks * block_size, kv_heads, head_dim] turns slots into
    row numbers, so the whole write is one ``index_copy_`` per cache.
    """
    _check(key, value, k_cache, v_cache, slot_mapping)
    _, _, num_kv_heads, head_dim = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping.long()
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    for cache, new in ((k_cache, key), (v_cache, value)):
        rows = cache.view(-1, num_kv_heads, head_dim)  # a view: writes land in the cache
        rows.index_copy_(0, slots, new.to(cache.dtype))
