"""A quantized KV cache: K and V stored in one byte per number, with a scale beside them.

``LLM(kv_cache_dtype=...)`` takes vLLM's option and names:

* ``"auto"``: the cache has the model's dtype (fp32, bf16 or fp16): nothing here applies;
* ``"fp8"`` (also ``"fp8_e4m3"``): 8-bit floats, e4m3 (4 exponent bits, 3 mantissa bits,
  largest finite value 448: ``torch.float8_e4m3fn``, Triton's ``fp8e4nv``);
* ``"int8"``: 8-bit integers -127..127 (symmetric: -128 is never written).

(``"fp8_per_token_head"`` and ``"int8_per_token_head"``, vLLM's names for exactly this
scheme, are accepted too.) One byte instead of 4 (fp32) or 2 (bf16, fp16): the same memory
holds about 4x or 2x the blocks, less what the scales take (below).

**Scales: one per token and KV head** (vLLM's ``*_per_token_head`` modes). Every token's
key (and value) vector of one KV head, ``head_dim`` numbers, is stored as

    stored = round(x / scale),  scale = max|x| / QMAX          (QMAX: 127 for int8, 448 for fp8)

and read back as ``stored * scale``. The scales live in the cache's blocks, next to the
numbers they scale: for every layer a ``k_scales`` and a ``v_scales`` tensor of shape
``[num_blocks, block_size, num_kv_heads]``, fp32; the scale of ``k_cache[b, o, h, :]`` is
``k_scales[b, o, h]``. Why this granularity, and not one scale per block and head, or per
tensor:

* **a block fills one token at a time.** During decoding a block's 16 tokens arrive in 16
  steps. A scale per block fixed by its first token clips the later ones that are larger;
  growing it means re-quantizing the tokens already stored (rounding them twice). A scale
  per token is written once, with its token, and never changes;
* **batch invariance.** A token's stored bytes depend on that token alone, not on what
  else shared its block or its batch, nor on what the cache saw before (a per-tensor
  scale computed at run time would). So a prefix cached by one request is what another
  would have computed, and recomputing a preempted sequence writes the same bytes;
* **no calibration.** A per-tensor scale (vLLM's plain ``"fp8"``, 1.0 by default) needs
  scales measured offline for int8 to be usable; here every vector uses its whole range.

The price is 4 bytes of scale per ``head_dim`` bytes: for head dim 64, 68 bytes instead of
256 (fp32, 3.76x the blocks) or 128 (bf16, 1.88x); for 128, 3.88x and 1.94x
(:func:`bytes_per_head_row`). vLLM's per-token-head modes pay the same (an fp32 scale at the
end of each head's row).

Where each step happens: the cache-write op quantizes (``reshape_and_cache``: torch here,
Triton in ``reshape_and_cache.py``), every attention kernel dequantizes as it reads (the
torch references in ``_common.paged_attention_torch``, the Triton kernels tile by tile, the
C++ CPU kernel in its inner loop over ``vec.h``). Copies of blocks (copy-on-write, beam
forks, swapping to the host pool) copy the scales with the numbers: ``labkit.model.kv_cache``.
"""

from __future__ import annotations

import torch

# What each kv_cache_dtype name stores: None means the model's own dtype (nothing quantized).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "int8": torch.int8,
    "fp8_per_token_head": torch.float8_e4m3fn,   # vLLM's name for the same scheme
    "int8_per_token_head": torch.int8,
}
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)
# The largest magnitude each stored type holds: a vector's largest |x| is stored as this.
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.float32


def resolve_kv_cache_dtype(kv_cache_dtype: str | torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache stores for ``kv_cache_dtype`` ("auto": ``model_dtype``).
    A name not in :data:`KV_CACHE_DTYPES` is a ValueError that lists them."""
    if isinstance(kv_cache_dtype, torch.dtype):
        if kv_cache_dtype in QUANTIZED_DTYPES or kv_cache_dtype == model_dtype:
            return kv_cache_dtype
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype} is neither the model's dtype ({model_dtype}) nor one "
                         f"of the quantized ones ({', '.join(map(str, QUANTIZED_DTYPES))})")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of "
                         + ", ".join(repr(name) for name in KV_CACHE_DTYPES))
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    """How a cache dtype is named in the load banner and ``stats()``: "int8", "fp8" (e4m3),
    or the model dtype's own name ("float32", "bfloat16", "float16")."""
    return {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}.get(dtype) or str(dtype).removeprefix("torch.")


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` stores quantized numbers (and so has scales)."""
    return dtype in QUANTIZED_DTYPES


def bytes_per_head_row(dtype: torch.dtype, head_dim: int) -> int:
    """Bytes one token's K (or V) of one KV head takes in a cache of ``dtype``: ``head_dim``
    numbers, plus its fp32 scale when quantized."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return head_dim * itemsize + (torch.empty((), dtype=SCALE_DTYPE).element_size() if is_quantized(dtype) else 0)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor viewed as its bytes (uint8), any other as it is. torch implements
    few operations on fp8 (no index_copy_ or index_select on a CPU): copying and gathering
    blocks of a cache moves bytes, so it works on this view."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., head_dim] as (stored [..., head_dim] of ``dtype``, scales [...] fp32): one
    scale per vector of the last dimension, that vector's largest magnitude over
    :data:`QMAX`. The definition the Triton cache-write kernel follows.

    int8 rounds half away from zero (what a float-to-int conversion after adding +-0.5 does,
    in Triton too); fp8 rounds to nearest even (torch's and the GPU's conversion). A vector
    of zeros gets scale 0 and stores zeros. Every stored value is finite: |x / scale| <= QMAX.
    """
    if not is_quantized(dtype):
        raise ValueError(f"quantize stores int8 or float8_e4m3fn, not {dtype}")
    qmax = QMAX[dtype]
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scales = amax / qmax
    # x / amax first: it is at most 1, where qmax / amax overflows to inf for a vector of
    # tiny numbers (|x| < 1e-36) and 0 * inf is NaN. An all-zero vector divides by 1: zeros.
    y = xf / torch.where(amax > 0, amax, torch.ones_like(amax))[..., None] * qmax
    if dtype == torch.int8:
        stored = (y + torch.where(y >= 0, 0.5, -0.5)).trunc().clamp(-qmax, qmax).to(torch.int8)
    else:
        stored = y.clamp(-qmax, qmax).to(dtype)
    return stored, scales


def dequantize(stored: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``stored * scales`` (one scale per vector of the last dimension), in ``dtype``."""
    return (stored.float() * scales.float()[..., None]).to(dtype)


def check_kv_scales(k_cache: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None) -> bool:
    """Validate a layer's scales against its cache; returns whether the cache is quantized.

    Invariant the kernels rely on: a quantized cache (int8, fp8) comes with both scale
    tensors, fp32, ``[num_blocks, block_size, num_kv_heads]``, contiguous, on the cache's
    device; an unquantized cache with neither (``_common.check_kv_cache`` checks the dtype)."""
    quantized = is_quantized(k_cache.dtype)
    if not quantized:
        if k_scales is not None or v_scales is not None:
            raise ValueError(f"k_scales and v_scales belong to a quantized cache (int8, fp8); this one is "
                             f"{k_cache.dtype}")
        return False
    if k_scales is None or v_scales is None:
        raise ValueError(f"a {kv_cache_dtype_name(k_cache.dtype)} KV cache needs its k_scales and v_scales "
                         "(one fp32 scale per token and KV head)")
    expected = tuple(k_cache.shape[:3])
    for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
        if tuple(s.shape) != expected or s.dtype != SCALE_DTYPE or not s.is_contiguous():
            raise ValueError(f"{name} must be a contiguous fp32 [num_blocks, block_size, num_kv_heads] = "
                             f"{list(expected)} tensor, got {s.dtype} of shape {tuple(s.shape)}")
        if s.device != k_cache.device:
            raise ValueError(f"{name} is on {s.device}, the cache on {k_cache.device}")
    return True


# Triton's fp8 e4m3 (fp8e4nv) needs the fp8 conversion instructions of compute capability 8.9+
# (L4, H100); a T4 or an A100 runs the int8 cache with the Triton kernels, fp8 with the torch
# backend. ``python -m labkit.bench gpu-compile`` checks both sides of this line.
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)
