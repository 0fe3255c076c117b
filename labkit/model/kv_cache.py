"""The paged KV cache: fixed-size physical blocks, allocated once.

For every layer there is a K and a V tensor of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. A token's *slot* is
``block_id * block_size + offset``; which blocks belong to which sequence is decided by the
block manager (``labkit.memory``), which knows nothing about tensors. All layers live in one
tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` so that a
copy-on-write copy of a block is a single indexed copy across every layer.

A quantized cache (``kv_cache_dtype`` "int8" or "fp8": ``labkit.kernels.kv_quant``) stores
one byte per number and, beside the numbers, one fp32 scale per token and KV head: the
tensor ``scales`` ``[num_layers, 2, num_blocks, block_size, num_kv_heads]``, indexed by block
exactly as ``data`` is. Invariant: a block's scales are part of the block. Every copy of a
block (copy-on-write, a beam's fork, a swap to the host pool and back) copies its scales in
the same call; a prefix-cache hit reuses the block, scales and all.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass

import torch

from ..utils import cdiv

DEFAULT_KV_BUDGET_BYTES = 2 << 30  # ModelRunner's default when given no size (LLM always plans one: plan_kv_cache)

# The share of free memory a default KV cache may take. On a CPU the same memory holds the
# notebook, the browser and other kernels: a quarter. On a GPU the engine is the tenant, but
# activations (logits of a 2048-token batch: ~0.4 GB for SmolLM2) need room: 80% of what is
# free once the weights are loaded.
KV_MEMORY_FRACTION = {"cpu": 0.25, "cuda": 0.8}


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _num_kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def kv_bytes_per_token(config, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of K and V one token takes across all layers, in a cache of ``dtype``:
    2 * layers * kv_heads * (head_dim * itemsize, plus a quantized cache's 4-byte scale)."""
    from labkit.kernels.kv_quant import bytes_per_head_row   # lazy: importing the kernels imports Triton
    return 2 * config.num_hidden_layers * _num_kv_heads(config) * bytes_per_head_row(dtype, _head_dim(config))


def num_blocks_for_budget(config, block_size: int, budget_bytes: int, dtype: torch.dtype = torch.float32) -> int:
    """How many blocks of ``block_size`` tokens fit in ``budget_bytes``."""
    return int(budget_bytes // (kv_bytes_per_token(config, dtype) * block_size))


def size_text(nbytes: float) -> str:
    """Bytes as people read them: ``'512 KiB'``, ``'16 MiB'``, ``'3.8 GiB'``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}" if unit == "GiB" else f"{nbytes / scale:.0f} {unit}"
    return f"{nbytes:.0f} bytes"


@dataclass(slots=True, frozen=True)
class DeviceMemory:
    """Memory a device can give now: ``nbytes``, and ``what`` it is (``"available"``: free
    now; ``"installed"``: the machine's total, where free memory cannot be read)."""

    nbytes: int
    what: str = "available"


def device_memory(device) -> DeviceMemory | None:
    """Free memory on ``device``: a GPU's free memory; on a CPU, Linux's MemAvailable (what
    can be allocated without swapping), else the installed total; None if nothing tells."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return DeviceMemory(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return DeviceMemory(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:  # macOS and other Unixes: the installed total
        return DeviceMemory(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "installed")
    except (AttributeError, ValueError, OSError):
        return None


@dataclass(slots=True, frozen=True)
class KVPlan:
    """How many KV blocks an engine gets, and ``how`` that number was chosen (the load
    banner prints it)."""

    num_blocks: int
    how: str


def plan_kv_cache(config, dtype: torch.dtype, block_size: int, *, max_num_seqs: int, max_model_len: int,
                  num_blocks: int | None = None, kv_cache_memory: int | None = None, device="cpu",
                  memory: DeviceMemory | None = None) -> KVPlan:
    """The KV cache's size: ``num_blocks`` or ``kv_cache_memory`` bytes when given (refused
    when the device has not that much free), else the default rule:

    * at most what ``max_num_seqs`` sequences of ``max_model_len`` tokens can ever hold
      (more blocks could never be used at once), and
    * at most :data:`KV_MEMORY_FRACTION` of the device's free memory (``memory``, probed
      when None).

    So tiny-llama (512-token context) takes 16 MiB, and SmolLM2 (8192 tokens, 45 KiB per
    token in fp32: 22.5 GiB for 64 full sequences) takes a quarter of what the machine has free.
    """
    per_block = kv_bytes_per_token(config, dtype) * block_size
    device = torch.device(device)
    memory = memory if memory is not None else device_memory(device)
    if num_blocks is not None or kv_cache_memory is not None:
        blocks = num_blocks if num_blocks is not None else int(kv_cache_memory // per_block)
        given = (f"num_blocks={num_blocks}" if num_blocks is not None
                 else f"kv_cache_memory={size_text(kv_cache_memory)}")
        if blocks < 1:
            raise ValueError(f"a KV budget of {kv_cache_memory} bytes holds no block of {block_size} tokens "
                             f"({per_block} bytes each)")
        if memory is not None and blocks * per_block > memory.nbytes:
            raise ValueError(f"the KV cache would take {blocks * per_block / 2**30:.2f} GiB but only "
                             f"{memory.nbytes / 2**30:.2f} GiB of {device.type} memory is {memory.what}; "
                             "ask for fewer num_blocks or a smaller kv_cache_memory")
        return KVPlan(blocks, f"{given}, as given")
    full = max_num_seqs * cdiv(max_model_len, block_size)
    full_text = f"{max_num_seqs} sequences x {max_model_len} tokens (max_num_seqs x max_model_len)"
    fraction = KV_MEMORY_FRACTION.get(device.type, KV_MEMORY_FRACTION["cpu"])
    if memory is None:
        return KVPlan(full, f"{full_text}; this machine's free memory cannot be read")
    share = int(memory.nbytes * fraction // per_block)
    share_text = f"{fraction:.0%} of the {size_text(memory.nbytes)} of {device.type} memory {memory.what}"
    if full <= share:
        return KVPlan(full, f"{full_text}, within {share_text}")
    if share < 1:
        raise ValueError(f"{share_text} holds no KV block of {block_size} tokens ({size_text(per_block)}): "
                         "free some memory, or give num_blocks / kv_cache_memory")
    return KVPlan(share, f"{share_text}; {full_text} would take {size_text(full * per_block)}. "
                         "num_blocks= or kv_cache_memory= sets another size")


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device="cpu", pin_memory: bool = False) -> torch.Tensor:
    """A tensor of zeros. In CPU memory (not pinned) it lives in an anonymous mapping, which the
    OS hands out zero-filled a page at a time as it is first written: a 2 GiB cache is there at
    once, not after seconds of writing zeros, and holds memory only for the blocks used so far
    (``KVCache.populate`` writes them all at once). Elsewhere, torch.zeros."""
    if torch.device(device).type != "cpu" or pin_memory or not hasattr(mmap, "MAP_ANONYMOUS"):   # (Windows)
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    # anonymous (zero-filled, page-aligned) and private (a forked child gets a copy, as with malloc)
    pages = mmap.mmap(-1, max(1, nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


class KVCache:
    """K/V blocks for every layer of one model (and, quantized, their scales)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device="cpu", pin_memory: bool = False):
        from labkit.kernels.kv_quant import SCALE_DTYPE, is_quantized   # lazy: the kernels import Triton
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        # Zeros, not empty: a kernel that multiplies masked-out slots by 0 must not meet NaN garbage.
        self.data = zeroed((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype, device,
                           pin_memory)
        self.k_caches = [self.data[i, 0] for i in range(num_layers)]  # views, one per layer
        self.v_caches = [self.data[i, 1] for i in range(num_layers)]
        # A quantized cache's scales, one per token and KV head, laid out as ``data`` is without
        # its last dimension; None for a cache in the model's dtype.
        self.scales = (zeroed((num_layers, 2, num_blocks, block_size, num_kv_heads), SCALE_DTYPE, device,
                              pin_memory) if is_quantized(dtype) else None)
        self.k_scales = [None if self.scales is None else self.scales[i, 0] for i in range(num_layers)]
        self.v_scales = [None if self.scales is None else self.scales[i, 1] for i in range(num_layers)]

    def populate(self) -> None:
        """Bring every page of the cache into memory now, its contents unchanged (one byte per
        page is written back as it was), so that no step later pays the OS's first-touch page
        faults: for a long-running server, and for a benchmark timed against engines that
        zero-fill their caches at start (vLLM's does). Without it, pages arrive as blocks fill."""
        for t in self._tensors():
            t.reshape(-1).view(torch.uint8)[::mmap.PAGESIZE].mul_(1)

    @property
    def quantized(self) -> bool:
        """Whether this cache stores int8 / fp8 numbers with scales (``kv_cache_dtype``)."""
        return self.scales is not None

    def _tensors(self) -> list[torch.Tensor]:
        """What a copy of blocks must copy: the numbers (as bytes for fp8, which torch cannot
        index), and a quantized cache's scales; dim 2 is the block in each."""
        from labkit.kernels.kv_quant import as_bytes
        return [as_bytes(self.data)] + ([] if self.scales is None else [self.scales])

    @classmethod
    def from_config(cls, config, block_size: int = 16, num_blocks: int | None = None,
                    budget_bytes: int | None = None, dtype: torch.dtype = torch.float32, device="cpu") -> "KVCache":
        """Size the cache by ``num_blocks`` or, if None, by ``budget_bytes`` (default 2 GiB).
        ``dtype``: what the cache stores (the model's dtype, or int8 / float8_e4m3fn)."""
        if num_blocks is None:
            num_blocks = num_blocks_for_budget(config, block_size, budget_bytes or DEFAULT_KV_BUDGET_BYTES, dtype)
            if num_blocks < 1:
                raise ValueError(f"a KV budget of {budget_bytes} bytes holds no block of {block_size} tokens")
        return cls(config.num_hidden_layers, num_blocks, block_size, _num_kv_heads(config), _head_dim(config),
                   dtype, device)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes in every layer, K and V, scales included."""
        return sum(t[:, :, 0].numel() * t.element_size() for t in self._tensors())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def copy_blocks(self, pairs) -> None:
        """Copy-on-write: for each ``(src, dst)`` copy block ``src`` into ``dst``, in every layer
        (a quantized cache's scales with it).

        All sources are read before any destination is written (one gather, one scatter).
        """
        if not pairs:
            return
        idx = torch.as_tensor(pairs, dtype=torch.long, device=self.data.device).view(-1, 2)
        src, dst = idx[:, 0], idx[:, 1]
        for t in self._tensors():
            t.index_copy_(2, dst, t.index_select(2, src))

    def host_pool(self, num_blocks: int) -> "KVCache":
        """A host-memory pool of ``num_blocks`` blocks shaped like this cache's, for
        preemption by swapping: pinned (page-locked) when this cache is on a GPU, so that
        copies over PCIe run at full speed; plain CPU tensors otherwise."""
        pin = self.data.device.type == "cuda"
        return KVCache(self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
                       self.dtype, "cpu", pin_memory=pin)

    def __repr__(self) -> str:
        scales = " + fp32 scales" if self.quantized else ""
        return (f"KVCache(layers={self.num_layers}, blocks={self.num_blocks}, block_size={self.block_size}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, {self.dtype}{scales}, "
                f"{self.nbytes / 2**20:.0f} MiB)")


SWAP_GRANULARITIES = ("gather", "layer")


def swap_blocks(src: KVCache, dst: KVCache, pairs, granularity: str = "gather") -> None:
    """Swapping: for each ``(s, d)`` copy block ``s`` of ``src`` into block ``d`` of ``dst``,
    every layer's K and V: device -> host to swap out, host -> device to swap in.

    ``granularity="gather"`` (labkit's way): the blocks are gathered into one buffer on the
    source's device, moved in one transfer and scattered on the destination's, a handful of
    calls whatever the count. ``"layer"`` copies each block of each layer's K and V on its
    own, ``2 * num_layers`` copies per block, as vLLM v0 did (the paper's Figure 19 measures
    that). On a CPU both pools are CPU tensors, and either is still a real copy between pools.
    A quantized cache's scales travel with their blocks, the same way.
    """
    if granularity not in SWAP_GRANULARITIES:
        raise ValueError(f"granularity must be one of {SWAP_GRANULARITIES}, got {granularity!r}")
    if not pairs:
        return
    if (src.block_size, src.num_layers, src.dtype) != (dst.block_size, dst.num_layers, dst.dtype):
        raise ValueError(f"cannot swap between differently shaped caches: {src} and {dst}")
    if granularity == "layer":
        for s, d in pairs:
            for layer in range(src.num_layers):
                dst.k_caches[layer][d].copy_(src.k_caches[layer][s])
                dst.v_caches[layer][d].copy_(src.v_caches[layer][s])
                if src.quantized:
                    dst.k_scales[layer][d].copy_(src.k_scales[layer][s])
                    dst.v_scales[layer][d].copy_(src.v_scales[layer][s])
        return
    idx = torch.as_tensor(pairs, dtype=torch.long).view(-1, 2)
    for s_t, d_t in zip(src._tensors(), dst._tensors(), strict=True):
        staged = s_t.index_select(2, idx[:, 0].to(s_t.device))
        staged = staged.to(d_t.device)    # blocking: the host side reads it next
        d_t.index_copy_(2, idx[:, 1].to(d_t.device), staged)
