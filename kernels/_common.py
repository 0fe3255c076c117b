"""Helpers shared by the kernel files: argument checks, the Triton import, and the torch
building blocks of the references.

Nothing here is a kernel. Read the kernel files first; come here when one of them calls
``check_*``, ``gather_paged_kv``, ``dense_gqa_attention`` or builds a :class:`Launch`.

Triton is imported here, once, with a guard: on a machine without it, ``triton`` and ``tl``
are stand-ins that let the kernel files *define* their ``@triton.jit`` functions (so the
torch references in those files stay importable) and refuse, with the original import
error, the moment someone tries to launch one.
"""

import contextlib
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F

from labkit.utils import cdiv

from .kv_quant import as_bytes, check_kv_scales, dequantize, is_quantized

try:
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: ImportError | None = None
except ImportError as _err:  # pragma: no cover - exercised only where triton is absent
    TRITON_IMPORT_ERROR = _err

    class _MissingTriton:
        """Stands in for ``triton`` and ``triton.language`` when Triton is not installed."""

        def __getattr__(self, name: str) -> "_MissingTriton":
            return self  # tl.constexpr, tl.float32 ...: only used as annotations at import

        def __call__(self, fn=None, **kwargs) -> "_MissingTriton":
            return self  # @triton.jit

        def __getitem__(self, grid) -> "_MissingTriton":
            raise RuntimeError(f"Triton is not installed ({TRITON_IMPORT_ERROR}); "
                               "use the 'torch' attention backend") from TRITON_IMPORT_ERROR

    triton = tl = _MissingTriton()  # type: ignore[assignment]

HAS_TRITON = TRITON_IMPORT_ERROR is None
SUPPORTED_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The GPUs the kernels are built for (``python -m labkit.bench gpu-compile`` compiles every one
# of them for sm_75, sm_80, sm_89 and sm_90): compute capability 7.5 (Colab's free T4) and newer,
# fp16 and fp32 everywhere; bf16 from 8.0 (A100, L4, H100), the first GPUs with bf16 units.
MIN_COMPUTE_CAPABILITY = (7, 5)
BF16_MIN_COMPUTE_CAPABILITY = (8, 0)
MAX_HEAD_DIM = 256
# The kernels compute exp(x) as exp2(x * log2(e)) (exp2 is the hardware instruction) and fold
# log2(e) into the softmax scale once, on the host.
LOG2E = math.log2(math.e)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (tl.arange needs power-of-two lengths)."""
    return 1 << max(0, (n - 1).bit_length())


def kernel_is_interpreted(kernel) -> bool:
    """True when ``kernel`` was decorated while TRITON_INTERPRET=1 was set.

    Triton decides at decoration time (module import), not at launch: the type of the
    decorated object is the ground truth, whatever the environment says now.
    """
    return type(kernel).__name__ == "InterpretedFunction"


@dataclass(frozen=True, slots=True)
class Launch:
    """One kernel launch as its launcher decides it on the host: the kernel, its grid, its
    arguments, and what Triton compiles it for (``constexprs``, ``num_warps``, ``num_stages``).

    Each kernel file has one ``plan_*`` function that builds its launches from the tensors;
    the launcher checks the tensors, then runs the plan. The ahead-of-time compile check
    (``python -m labkit.bench gpu-compile``) runs the same plans on stand-in tensors (torch's
    ``meta`` device: shapes, strides and dtypes, no memory) and compiles them for GPUs it does
    not have, so what it checks is what the engine launches: the rules that pick the grid and
    the compile-time constants exist once.
    """

    kernel: Any                                  # a @triton.jit function
    grid: tuple[int, ...]
    args: tuple                                  # runtime arguments, in the kernel's order
    constexprs: dict[str, Any] = field(default_factory=dict)
    num_warps: int = 4                           # Triton's defaults for NVIDIA GPUs, said out loud:
    num_stages: int = 3                          # the compile check reports what they cost

    @property
    def name(self) -> str:
        return getattr(self.kernel, "__name__", None) or self.kernel.fn.__name__

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages)


# --------------------------------------------------------------------------- checks


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate a layer's paged cache; returns (num_blocks, block_size, num_kv_heads, head_dim).

    Invariant the kernels rely on: K and V share one shape and one memory layout, so a
    token's offset computed once addresses both.
    """
    if k_cache.dim() != 4:
        raise ValueError("k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(k_cache.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                         "must have the same shape and strides")
    if k_cache.dtype != v_cache.dtype or k_cache.device != v_cache.device:
        raise ValueError("k_cache and v_cache must share dtype and device")
    if not (k_cache.dtype.is_floating_point or is_quantized(k_cache.dtype)):
        raise ValueError(f"the KV cache must be a floating-point tensor (or int8, quantized: kv_quant.py), "
                         f"got {k_cache.dtype}")
    if k_cache.dtype.itemsize == 1 and not is_quantized(k_cache.dtype):
        raise ValueError(f"an 8-bit float KV cache is e4m3 (torch.float8_e4m3fn, kv_cache_dtype 'fp8'), "
                         f"not {k_cache.dtype}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    return num_blocks, block_size, num_kv_heads, head_dim


INDEX_DTYPES = (torch.int32, torch.int64)


def check_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           query_start_loc: torch.Tensor | None = None,
                           k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> int:
    """Validate a paged attention call before anything reads memory; returns the GQA group.

    A quantized cache (int8, fp8) comes with its ``k_scales`` and ``v_scales``
    (``kv_quant.check_kv_scales``); any other with neither.

    Decode (``query_start_loc`` None): one query row per sequence. Prefill: rows of sequence
    ``i`` at ``query_start_loc[i]:query_start_loc[i + 1]``.

    Query head ``h`` reads KV head ``h // group`` (the convention of Hugging Face's
    ``repeat_kv``): the ``group`` query heads of one KV head are consecutive.

    Shapes, dtypes and devices are checked first, then the *values* that become memory
    addresses (see :func:`check_block_tables`). The kernels index without bounds checks
    (Triton loads, Numba's ``boundscheck=False``): a bad id here would be a segfault or a
    silent read of someone else's memory there, so every entry point calls this once.
    """
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_kv_scales(k_cache, k_scales, v_scales)
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be [tokens, num_heads, {head_dim}], got {tuple(q.shape)}")
    if not q.dtype.is_floating_point:
        raise ValueError(f"q must be a floating-point tensor, got {q.dtype}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if block_tables.dim() != 2 or block_tables.dtype not in INDEX_DTYPES:
        raise ValueError("block_tables must be an int32 or int64 [num_seqs, max_blocks_per_seq] "
                         f"tensor, got {block_tables.dtype} of shape {tuple(block_tables.shape)}")
    num_seqs = block_tables.shape[0]
    if context_lens.shape != (num_seqs,) or context_lens.dtype not in INDEX_DTYPES:
        raise ValueError(f"context_lens must be an int32 or int64 [num_seqs] = [{num_seqs}] tensor, "
                         f"got {context_lens.dtype} of shape {tuple(context_lens.shape)}")
    if query_start_loc is None and q.shape[0] != num_seqs:
        raise ValueError(f"decode takes one query per sequence: q has {q.shape[0]} rows but "
                         f"block_tables has {num_seqs}")
    if query_start_loc is not None and (query_start_loc.shape != (num_seqs + 1,)
                                        or query_start_loc.dtype not in INDEX_DTYPES):
        raise ValueError(f"query_start_loc must be an int32 or int64 [num_seqs + 1] = [{num_seqs + 1}] "
                         f"tensor of cumulative chunk lengths, got {query_start_loc.dtype} of shape "
                         f"{tuple(query_start_loc.shape)}")
    check_on_cache_device(k_cache, q=q, block_tables=block_tables, context_lens=context_lens,
                          query_start_loc=query_start_loc)
    check_block_tables(block_tables, context_lens, num_blocks, block_size, query_start_loc, q.shape[0])
    return q.shape[1] // num_kv_heads


def check_on_cache_device(cache: torch.Tensor, **named: torch.Tensor | None) -> None:
    """Every named tensor (None: absent) lives where the cache does: a kernel given a host
    pointer for a device one reads garbage, or faults."""
    elsewhere = [f"{name} on {t.device}" for name, t in named.items()
                 if t is not None and t.device != cache.device]
    if elsewhere:
        raise ValueError(f"every tensor must be on the cache's device ({cache.device}), got "
                         + ", ".join(elsewhere))


def check_block_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int,
                       block_size: int, query_start_loc: torch.Tensor | None = None,
                       num_queries: int = 0) -> None:
    """The value checks: every address a kernel will compute lies inside the cache.

    - each context length is >= 1 (a sequence attends at least to the token being computed)
      and fits in its table row (``ceil(len / block_size)`` columns);
    - every block id a sequence *uses* (the table entries covering its context) is in
      ``[0, num_blocks)``. Entries past a sequence's last block are not looked at: the engine
      leaves them as they are, garbage included, and no kernel reads them;
    - prefill: ``query_start_loc`` runs from 0 to the number of query rows without
      decreasing, and no chunk is longer than its sequence's context (which includes it).

    Vectorized, one host synchronisation, whatever the batch: a handful of tensor operations
    on the [num_seqs, max_blocks] table, no per-token work (measured on a CPU at batch 64,
    context 400: ~25 us, under 1% of the decode call it guards). The slow search for
    *which* entry is wrong runs only once something is. Tensors registered by
    :func:`index_tensors_checked` (a model's step, checked once for all its layers) skip it.
    """
    num_seqs, width = block_tables.shape
    key = ("tables", id(block_tables), id(context_lens), id(query_start_loc), num_blocks, block_size,
           None if query_start_loc is None else num_queries)
    if key in _checked_this_step():
        return
    if num_seqs == 0:
        if query_start_loc is not None and num_queries:
            raise ValueError(f"q has {num_queries} rows but there are no sequences")
        return
    if width == 0:
        raise ValueError("block_tables has no columns: every sequence needs at least one block")
    ids = torch.where(blocks_in_use(context_lens, width, block_size), block_tables, 0)
    stats = [*context_lens.aminmax(), *ids.aminmax()]
    if query_start_loc is not None:
        chunk_lens = query_start_loc[1:] - query_start_loc[:-1]
        stats += [query_start_loc[0], query_start_loc[-1], chunk_lens.min(),
                  (context_lens - chunk_lens).min()]
    values = torch.stack(stats).tolist()  # the one host sync
    shortest, longest, lowest_id, highest_id = values[:4]
    if shortest < 1:
        s = int((context_lens < 1).nonzero()[0, 0])
        raise ValueError(f"context_lens[{s}] is {shortest}: every sequence attends to at least the "
                         "token being computed, so each context length must be >= 1")
    if cdiv(longest, block_size) > width:
        s = int(context_lens.argmax())
        raise ValueError(f"context_lens[{s}] is {longest} tokens, which span "
                         f"{cdiv(longest, block_size)} blocks of {block_size}, but block_tables "
                         f"has only {width} columns")
    if lowest_id < 0 or highest_id >= num_blocks:
        s, b = ((ids < 0) | (ids >= num_blocks)).nonzero()[0].tolist()
        last = min(int(context_lens[s]), (b + 1) * block_size) - 1
        raise ValueError(f"block_tables[{s}, {b}] is {int(ids[s, b])}, not a block of this cache "
                         f"(ids 0..{num_blocks - 1}); sequence {s} reads it for its tokens "
                         f"{b * block_size}..{last}")
    if query_start_loc is None:
        return
    first, end, shortest_chunk, slack = values[4:]
    if first != 0:
        raise ValueError(f"query_start_loc[0] must be 0, got {first}")
    if shortest_chunk < 0:
        i = int((chunk_lens < 0).nonzero()[0, 0])
        raise ValueError(f"query_start_loc must not decrease: query_start_loc[{i + 1}] = "
                         f"{int(query_start_loc[i + 1])} < query_start_loc[{i}] = {int(query_start_loc[i])}")
    if end != num_queries:
        raise ValueError(f"query_start_loc[-1] is {end} but q has {num_queries} rows")
    if slack < 0:
        s = int((context_lens < chunk_lens).nonzero()[0, 0])
        raise ValueError(f"sequence {s} brings a chunk of {int(chunk_lens[s])} tokens but its "
                         f"context_lens is {int(context_lens[s])}: the context includes the chunk")


def check_slot_mapping(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Every slot is a slot of the cache (``0 .. num_slots - 1``) or -1 (skip the token).
    One host sync; a no-op for a tensor registered by :func:`index_tensors_checked`."""
    if slot_mapping.numel() == 0 or ("slots", id(slot_mapping), num_slots) in _checked_this_step():
        return
    lowest, highest = torch.stack(slot_mapping.aminmax()).tolist()
    if lowest < -1 or highest >= num_slots:
        i = int(((slot_mapping < -1) | (slot_mapping >= num_slots)).nonzero()[0, 0])
        raise ValueError(f"slot_mapping[{i}] is {int(slot_mapping[i])}, not a slot of this cache "
                         f"(0..{num_slots - 1} = num_blocks * block_size - 1, or -1 to skip the token)")


# The index tensors checked for the step now running on this thread (see below).
_step = threading.local()


def _checked_this_step() -> frozenset:
    return getattr(_step, "keys", frozenset())


@contextlib.contextmanager
def index_tensors_checked(
    num_blocks: int, block_size: int, slot_mapping: torch.Tensor,
    attention: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]],
) -> Iterator[None]:
    """Check one step's index tensors once, then let every layer's kernels trust them.

    A model calls the kernels once per layer with the *same* block tables, context lengths
    and slots; checking their values 30 times gives 30 times the same answer, and on a GPU
    each check is a host sync that stalls the launch queue. So the model checks them here,
    on entry (``slot_mapping`` against the cache's slots; each ``(block_tables,
    context_lens, query_start_loc or None, num_queries)`` with :func:`check_block_tables`),
    and inside the block the kernels skip the value checks for exactly these tensor
    objects (by identity, not by value) and this cache geometry, on this thread.
    Everything else is still checked in full, and so are shapes, dtypes and devices.
    Whoever enters the block promises not to modify these tensors inside it.
    """
    check_slot_mapping(slot_mapping, num_blocks * block_size)
    keys = {("slots", id(slot_mapping), num_blocks * block_size)}
    held = [slot_mapping]  # alive for the whole block, so that no other tensor reuses an id
    for block_tables, context_lens, query_start_loc, num_queries in attention:
        check_block_tables(block_tables, context_lens, num_blocks, block_size, query_start_loc, num_queries)
        keys.add(("tables", id(block_tables), id(context_lens), id(query_start_loc), num_blocks,
                  block_size, None if query_start_loc is None else num_queries))
        held += [block_tables, context_lens, query_start_loc]
    outer = _checked_this_step()
    _step.keys = outer | keys
    try:
        yield
    finally:
        _step.keys = outer


def blocks_in_use(context_lens: torch.Tensor, num_columns: int, block_size: int) -> torch.Tensor:
    """[num_seqs, num_columns] mask of the block-table entries that hold context: entry ``b``
    of sequence ``s`` does iff its first token, ``b * block_size``, is < ``context_lens[s]``.
    The other entries may be garbage and must never be dereferenced."""
    first_token = torch.arange(0, num_columns * block_size, block_size, device=context_lens.device)
    return first_token < context_lens[:, None]


def check_triton_launch(kernel, *tensors: torch.Tensor) -> None:
    """Refuse, with a message that says what to do, a launch that cannot give right answers.

    - Triton absent: say so.
    - Kernels compiled for a GPU (TRITON_INTERPRET unset at import) but CPU tensors.
    - bf16 under the interpreter: it computes bf16 silently wrong, so refuse instead.
    - bf16 on a GPU below compute capability 8.0 (the T4): it has no bf16 units.
    """
    if not HAS_TRITON:
        raise RuntimeError(f"Triton is not installed ({TRITON_IMPORT_ERROR}); use the 'torch' "
                           "attention backend") from TRITON_IMPORT_ERROR
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        devices = ", ".join(sorted({str(t.device) for t in tensors}))
        raise ValueError("all tensors must be on one device, got " + devices)
    dtype = tensors[0].dtype
    if dtype not in SUPPORTED_KERNEL_DTYPES:
        raise ValueError(f"the Triton kernels take fp16, bf16 or fp32, got {dtype}")
    interpreted = kernel_is_interpreted(kernel)
    if not interpreted and device.type != "cuda":
        raise RuntimeError(
            f"the Triton kernels were compiled for a GPU but the tensors are on {device}. To run them "
            "on the CPU through the Triton interpreter, set TRITON_INTERPRET=1 in the environment "
            "before importing labkit.kernels (Triton reads it when the kernels are defined); "
            "otherwise use the 'torch' attention backend")
    if interpreted and dtype == torch.bfloat16:
        raise ValueError("bf16 is refused under the Triton interpreter (TRITON_INTERPRET=1): it "
                         "computes bf16 wrongly without an error. Use fp16 or fp32 on CPU; bf16 "
                         "works with the compiled kernels on a GPU")
    if not interpreted and dtype == torch.bfloat16:
        why = bf16_unsupported(device)
        if why:
            raise ValueError(f"bf16 is refused by the Triton kernels on {why}. Use fp16 there "
                             "(LLM(dtype='float16'), the default on such a GPU), or the 'torch' attention backend")


def gpu_name(device: torch.device) -> str:
    """``Tesla T4 (compute capability 7.5)``: how messages name a CUDA device."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"


def bf16_unsupported(device: torch.device) -> str | None:
    """Why ``device``, a CUDA GPU, cannot run the kernels in bf16 (it names the GPU), or None
    when it can. GPUs below compute capability 8.0 have no bf16 units: their tensor cores
    multiply fp16, and Triton would have to emulate every bf16 conversion."""
    if torch.cuda.get_device_capability(device) >= BF16_MIN_COMPUTE_CAPABILITY:
        return None
    return f"{gpu_name(device)}: bf16 needs compute capability 8.0+ (this GPU has no bf16 units)"


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact fp32 products for fp32 (the default, tf32, keeps only
    10 mantissa bits on Ampere+ and would miss the 1e-5 contract); fp16/bf16 ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def kernel_tile(block_size: int) -> int:
    """Keys per step of the attention kernels' loop: one block of 16 or 32 tokens; two blocks
    of 8 (tl.dot wants 16+); half a block of 64 (a 64 x 128 fp32 tile does not fit a T4's
    64 KiB of shared memory, and spills registers elsewhere: python -m labkit.bench gpu-compile).
    Any works: each token's address comes from the block table."""
    return min(max(16, block_size), 32)


def padded_head_dim(head_dim: int) -> int:
    """Head dim as the kernels see it: a power of two >= 16 (tl.arange and tl.dot want both);
    the extra lanes are masked off on every load and store."""
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} > {MAX_HEAD_DIM} is not supported by the Triton kernels")
    return max(16, next_power_of_2(head_dim))


# ------------------------------------------------------------- torch reference blocks


def gather_paged_kv(cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, max_len: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy each sequence's tokens out of the paged cache into a dense, padded tensor.

    cache [num_blocks, block_size, kv_heads, d], block_tables [S, >= blocks needed],
    context_lens [S] -> [S, T, kv_heads, d] with T = max_len rounded up to whole blocks.
    Row t of sequence s is token t of s; rows at t >= context_lens[s] are zeros.

    Why the care:
    - table entries past a sequence's last block may be garbage (the engine leaves unused
      entries as they are): they are replaced by block 0 before the gather;
    - cache slots past a sequence's length were never written and may hold anything, NaN
      included; a masked score still multiplies V (0 * NaN = NaN), so padding is zeroed.
    One ``index_select`` on the cache viewed as [num_blocks, block_bytes] copies whole
    blocks (much faster than indexing the 4-d tensor). ``out``, if given, is a contiguous
    buffer of at least the result's size and the cache's dtype; the result is a view of it.
    """
    if cache.dtype != as_bytes(cache).dtype:    # fp8: gather its bytes (torch has no fp8 index_select)
        return gather_paged_kv(as_bytes(cache), block_tables, context_lens, max_len,
                               None if out is None else as_bytes(out)).view(cache.dtype)
    num_blocks, block_size, kv_heads, head_dim = cache.shape
    num_seqs = block_tables.shape[0]
    blocks = cdiv(max_len, block_size)
    table = block_tables[:, :blocks].long()
    table = torch.where(blocks_in_use(context_lens, blocks, block_size), table, 0)
    rows = cache.reshape(num_blocks, -1)
    if out is None:
        dense = rows.index_select(0, table.flatten())
    else:
        dense = out[: table.numel() * rows.shape[1]].view(table.numel(), rows.shape[1])
        torch.index_select(rows, 0, table.flatten(), out=dense)
    tokens = dense.view(num_seqs * blocks * block_size, kv_heads * head_dim)
    padding = torch.arange(blocks * block_size, device=cache.device) >= context_lens[:, None]
    tokens.index_fill_(0, padding.flatten().nonzero().squeeze(1), 0)
    return dense.view(num_seqs, blocks * block_size, kv_heads, head_dim)


def dense_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of padded queries over dense, padded keys, GQA without copying K/V.

    q [S, L, H, d]; k, v [S, T, kv_heads, d]; q_pos [S, L] = absolute position of each query:
    query (s, j) sees keys 0..q_pos[s, j]. Returns [S, L, H, d].

    GQA trick: the ``group = H // kv_heads`` query heads sharing a KV head are folded into
    that head's query rows, giving q [S, kv_heads, L * group, d] against k [S, kv_heads, T, d]:
    plain multi-head attention, one pass over each KV head, no ``repeat_interleave`` of K/V.
    The work is one ``scaled_dot_product_attention`` call (its fused CPU/GPU kernels never
    materialise the [L*group, T] score matrix).
    Invariant: every query sees at least key 0 (q_pos >= 0), so no softmax row is empty.
    """
    num_seqs, q_len, num_heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    group = num_heads // kv_heads
    folded = q.reshape(num_seqs, q_len, kv_heads, group, head_dim).transpose(1, 2)
    folded = folded.reshape(num_seqs, kv_heads, q_len * group, head_dim)
    visible = torch.arange(kv_len, device=q.device) <= q_pos[..., None]  # [S, L, T]
    mask = visible[:, None, :, None, :].expand(num_seqs, 1, q_len, group, kv_len)
    mask = mask.reshape(num_seqs, 1, q_len * group, kv_len)
    out = F.scaled_dot_product_attention(folded, k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, scale=scale)
    out = out.view(num_seqs, kv_heads, q_len, group, head_dim).transpose(1, 2)
    return out.reshape(num_seqs, q_len, num_heads, head_dim)


def reference_compute_dtype(t: torch.Tensor) -> torch.dtype:
    """dtype the torch references compute in: the kernels accumulate in fp32, so on CPU the
    references upcast fp16/bf16 too; CUDA's fused SDPA kernels already accumulate in fp32."""
    if t.device.type == "cuda" or t.dtype in (torch.float32, torch.float64):
        return t.dtype
    return torch.float32


# On CPU the references gather a few sequences at a time (about this many bytes of K and V)
# into two buffers kept per thread and reused from chunk to chunk and call to call, so the
# copies stay in the processor's cache until the attention reads them. Gathering a whole
# batch into fresh tensors (decode at batch 64, context 512: 50 MB) is 2-3x slower: torch's
# CPU allocator returns big blocks to the OS, so every call page-faults fresh memory, then
# reads it all back from DRAM.
CPU_GATHER_CHUNK_BYTES = 8 << 20
_workspaces = threading.local()


def _cpu_workspace(like: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two flat buffers (for K and for V) of ``numel`` elements of ``like``'s dtype, reused
    by later calls on this thread (never shared between threads)."""
    buffers = getattr(_workspaces, "buffers", None)
    if buffers is None:
        buffers = _workspaces.buffers = {}
    # A buffer made inside torch.inference_mode (the engine runs there) is an inference
    # tensor, which may not be written outside it: keep one set per mode.
    key = (like.dtype, like.device, torch.is_inference_mode_enabled())
    if key not in buffers or buffers[key][0].numel() < numel:
        buffers[key] = (torch.empty(numel, dtype=like.dtype, device=like.device),
                        torch.empty(numel, dtype=like.dtype, device=like.device))
    return buffers[key]


def gather_paged_kv_dequantized(cache: torch.Tensor, scales: torch.Tensor | None, block_tables: torch.Tensor,
                                context_lens: torch.Tensor, max_len: int, dtype: torch.dtype,
                                out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`gather_paged_kv`, then in ``dtype``: for a quantized cache (``scales`` given,
    [num_blocks, block_size, kv_heads]) the gathered numbers times their scales, gathered
    the same way (padding rows get scale 0: zeros still)."""
    dense = gather_paged_kv(cache, block_tables, context_lens, max_len, out)
    if scales is None:
        return dense.to(dtype)
    dense_scales = gather_paged_kv(scales.unsqueeze(-1), block_tables, context_lens, max_len)[..., 0]
    return dequantize(dense, dense_scales, dtype)


def paged_attention_torch(q: torch.Tensor, q_pos: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, block_tables: torch.Tensor,
                          context_lens: torch.Tensor, scale: float,
                          k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """The torch references' common core: padded queries against paged K/V.

    q [S, L, H, d] (padded per sequence), q_pos [S, L] the absolute position of each query,
    caches [num_blocks, block_size, kv_heads, d], block_tables [S, ...], context_lens [S].
    Returns [S, L, H, d] in q's dtype. Query (s, j) sees tokens 0..q_pos[s, j] of
    sequence s, which must all be < context_lens[s]. A quantized cache (int8, fp8) is read
    with its scales ``k_scales``, ``v_scales`` [num_blocks, block_size, kv_heads]: each
    gathered row times its scale (``kv_quant.py``).

    Gather + dense attention, vectorized over sequences; on CPU over chunks of sequences
    sized by ``CPU_GATHER_CHUNK_BYTES`` (a loop over a handful of chunks, not sequences).
    """
    dtype = reference_compute_dtype(q)
    num_seqs = q.shape[0]
    lens = context_lens.tolist()  # one host sync for all chunk sizes
    _, _, kv_heads, head_dim = k_cache.shape
    bytes_per_seq = 2 * max(lens) * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    k_buf = v_buf = None
    if q.device.type == "cuda":  # its caching allocator recycles memory; one chunk is best
        chunk = num_seqs
    else:
        chunk = max(1, CPU_GATHER_CHUNK_BYTES // bytes_per_seq)
        block_size = k_cache.shape[1]
        padded_len = cdiv(max(lens), block_size) * block_size
        k_buf, v_buf = _cpu_workspace(k_cache, min(chunk, num_seqs) * padded_len * kv_heads * head_dim)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    for first in range(0, num_seqs, chunk):
        seqs = slice(first, first + chunk)
        max_len = max(lens[seqs])
        k = gather_paged_kv_dequantized(k_cache, k_scales, block_tables[seqs], context_lens[seqs], max_len,
                                        dtype, k_buf)
        v = gather_paged_kv_dequantized(v_cache, v_scales, block_tables[seqs], context_lens[seqs], max_len,
                                        dtype, v_buf)
        out[seqs] = dense_gqa_attention(q[seqs].to(dtype), k, v, q_pos[seqs], scale)
    return out.to(q.dtype)
