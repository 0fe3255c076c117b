"""ModelRunner: turns one scheduled iteration into one forward pass over the paged KV cache.

The scheduler hands over a list of ``SeqChunk``s: for each sequence, the tokens to compute
now (a prefill chunk, or the one new token of a decode), the position of the first of them,
and the physical blocks that hold the sequence's KV. The runner

1. applies the copy-on-write block copies the block manager asked for,
2. packs every chunk's tokens into one flat batch, in the scheduler's order (prefill chunks
   first, then decodes), and builds the index tensors attention needs (``pack_chunks``):
   ``positions``, ``slot_mapping`` (where each new token's K/V goes), ``block_tables``,
   ``context_lens`` and ``query_start_loc``,
3. runs the model once, and returns logits only at the last token of the chunks that asked
   for them (a prefill chunk that is not the prompt's last needs none).

The tensors are built with numpy over concatenated lists: no Python loop runs per token.
``pack_chunks_reference`` builds the same arrays with plain loops, one token at a time: it
is the definition the vectorized code is tested against.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..utils import cdiv
from .kv_cache import KVCache
from .llama import AttentionMetadata, LlamaModel, ModelSpec, linear_layout
from .loader import LoadedModel, load_model


@dataclass(slots=True)
class SeqChunk:
    """The work for one sequence in one iteration.

    token_ids: the tokens to compute now (positions ``num_computed_tokens ..`` onwards).
    num_computed_tokens: tokens already in the KV cache = the position of the first of them.
    block_ids: the sequence's physical blocks, covering at least every position computed.
    compute_logits: whether to return logits at its last token (False for a non-final prefill chunk).
    is_prefill: whether it runs as a prefill (attention over a chunk of queries) or a decode
      (one query). The engine passes the scheduler's ``ScheduledSeq.is_prefill``; a chunk
      built by hand that leaves it None is a prefill when it has more than one token.
      Prefill chunks must come before decodes, as the scheduler orders them.
    all_logits: return logits at every token of the chunk, not only its last (prompt
      logprobs need them); its rows then come in token order, the last one being the
      sampling row when ``compute_logits``.
    """

    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    compute_logits: bool = True
    is_prefill: bool | None = None
    all_logits: bool = False

    def __post_init__(self) -> None:
        if self.is_prefill is None:
            self.is_prefill = len(self.token_ids) > 1


@dataclass(slots=True)
class PackedBatch:
    """One iteration's chunks packed into flat index arrays (numpy, int64 unless noted).

    Chunk ``i`` owns tokens ``query_start_loc[i] : query_start_loc[i + 1]``; the first
    ``num_prefills`` chunks are prefills. ``block_tables`` rows are padded with block 0,
    never read past ``context_lens``.
    """

    input_ids: np.ndarray          # [num_tokens]
    positions: np.ndarray          # [num_tokens] position of each token in its sequence
    slot_mapping: np.ndarray       # [num_tokens] cache slot its K/V is written to
    block_tables: np.ndarray       # [num_chunks, max blocks] int32
    blocks_needed: np.ndarray      # [num_chunks] blocks covering each context
    context_lens: np.ndarray       # [num_chunks] tokens in the cache after this iteration
    query_start_loc: np.ndarray    # [num_chunks + 1]
    logits_indices: np.ndarray     # tokens whose logits are returned, in chunk order: each chunk's
                                   # last token if it wants logits, every token if ``all_logits``
    num_prefills: int


def pack_chunks(chunks: list[SeqChunk], block_size: int, num_blocks: int, max_model_len: int) -> PackedBatch:
    """Pack ``chunks`` (prefills first) into index arrays, checking them on the way.
    Raises ``ValueError`` naming the first bad chunk."""
    lens, context_lens, num_prefills = _chunk_extents(chunks, max_model_len)
    query_start_loc = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    input_ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks),
                            dtype=np.int64, count=num_tokens)
    block_tables, blocks_needed = _block_tables(chunks, context_lens, block_size, num_blocks)
    positions, slot_mapping = _token_slots(block_tables, context_lens - lens, lens, query_start_loc, block_size)
    wanted = np.fromiter((c.compute_logits for c in chunks), dtype=bool, count=len(chunks))
    logits_indices = query_start_loc[1:][wanted] - 1
    if any(c.all_logits for c in chunks):   # prompt logprobs: every token of those chunks
        every = np.fromiter((c.all_logits for c in chunks), dtype=bool, count=len(chunks))
        counts = np.where(every, lens, wanted.astype(np.int64))
        ends = np.repeat(query_start_loc[1:], counts)
        logits_indices = ends - (np.cumsum(counts)[np.repeat(np.arange(len(chunks)), counts)]
                                 - np.arange(int(counts.sum())))
    return PackedBatch(input_ids, positions, slot_mapping, block_tables, blocks_needed, context_lens,
                       query_start_loc, logits_indices, num_prefills)


def _chunk_extents(chunks: list[SeqChunk], max_model_len: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Per chunk: tokens computed now, and context length after; and how many prefills lead."""
    n = len(chunks)
    lens = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=n)
    if (lens < 1).any():
        raise ValueError("every SeqChunk needs at least one token")
    is_prefill = np.fromiter((c.is_prefill for c in chunks), dtype=bool, count=n)
    num_prefills = int(is_prefill.sum())
    if not is_prefill[:num_prefills].all():
        raise ValueError("prefill chunks must come before decode chunks (the scheduler's order)")
    if (lens[num_prefills:] != 1).any():
        raise ValueError("a decode chunk computes exactly one token")
    context_lens = np.fromiter((c.num_computed_tokens for c in chunks), dtype=np.int64, count=n) + lens
    if int(context_lens.max()) > max_model_len:
        raise ValueError(f"a sequence reaches {int(context_lens.max())} tokens, more than "
                         f"max_model_len={max_model_len}")
    return lens, context_lens, num_prefills


def _block_tables(chunks: list[SeqChunk], context_lens: np.ndarray, block_size: int,
                  num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """One row of physical block ids per chunk, as wide as the longest context needs."""
    n = len(chunks)
    blocks_needed = cdiv(context_lens, block_size)
    num_block_ids = np.fromiter((len(c.block_ids) for c in chunks), dtype=np.int64, count=n)
    if (num_block_ids < blocks_needed).any():
        i = int(np.flatnonzero(num_block_ids < blocks_needed)[0])
        raise ValueError(f"chunk needs {blocks_needed[i]} blocks for {context_lens[i]} tokens "
                         f"but has {num_block_ids[i]} block_ids")
    width = int(blocks_needed.max())
    take = np.minimum(num_block_ids, width)        # extra trailing block ids are ignored
    flat = np.fromiter(itertools.chain.from_iterable(c.block_ids[:width] for c in chunks),
                       dtype=np.int32, count=int(take.sum()))
    if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= num_blocks):
        raise ValueError(f"block ids must be in [0, {num_blocks}), got {int(flat.min())}..{int(flat.max())}")
    rows = np.repeat(np.arange(n), take)
    cols = np.arange(flat.size) - np.repeat(np.cumsum(take) - take, take)
    block_tables = np.zeros((n, width), dtype=np.int32)
    block_tables[rows, cols] = flat
    return block_tables, blocks_needed


def _token_slots(block_tables: np.ndarray, starts: np.ndarray, lens: np.ndarray,
                 query_start_loc: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per token: its position in its sequence, and the cache slot its K/V goes to."""
    num_tokens = int(query_start_loc[-1])
    seq_of_token = np.repeat(np.arange(len(lens)), lens)
    positions = np.arange(num_tokens) + np.repeat(starts - query_start_loc[:-1], lens)
    block_of_token = block_tables[seq_of_token, positions // block_size].astype(np.int64)
    return positions, block_of_token * block_size + positions % block_size


def pack_chunks_reference(chunks: list[SeqChunk], block_size: int) -> dict[str, list]:
    """The index arrays of ``pack_chunks``, one token at a time in plain Python: slow, and
    the definition. (Unpadded block tables; no checks.)"""
    positions, slot_mapping, block_tables, context_lens, query_start_loc = [], [], [], [], [0]
    for chunk in chunks:
        context_len = chunk.num_computed_tokens + len(chunk.token_ids)
        used = chunk.block_ids[:cdiv(context_len, block_size)]
        for position in range(chunk.num_computed_tokens, context_len):
            positions.append(position)
            slot_mapping.append(used[position // block_size] * block_size + position % block_size)
        block_tables.append(list(used))
        context_lens.append(context_len)
        query_start_loc.append(query_start_loc[-1] + len(chunk.token_ids))
    return {"positions": positions, "slot_mapping": slot_mapping, "block_tables": block_tables,
            "context_lens": context_lens, "query_start_loc": query_start_loc}


def _default_num_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class ModelRunner:
    """Owns the model weights, the KV cache and the attention backend."""

    def __init__(self, model: str | LoadedModel = "smollm2-135m", block_size: int = 16,
                 num_blocks: int | None = None, kv_budget_bytes: int | None = None,
                 attention_backend="auto", dtype: torch.dtype | str = torch.float32, device="cpu",
                 num_threads: int | None = None, kv_cache_dtype: str | torch.dtype = "auto"):
        """``kv_cache_dtype``: "auto" (the model's dtype), "int8" or "fp8" (a quantized cache:
        ``labkit.kernels.kv_quant``); refused (ValueError) before anything loads when unknown."""
        from labkit.kernels.kv_quant import kv_cache_dtype_name, resolve_kv_cache_dtype
        self.device = torch.device(device)
        dtype, self.dtype_reason = resolve_dtype(dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)   # what the cache stores
        self.kv_cache_dtype_name = kv_cache_dtype_name(self.kv_cache_dtype)
        if self.device.type == "cpu":
            # Use every core we may run on, unless the user pinned a count (OMP_NUM_THREADS).
            if num_threads is None and "OMP_NUM_THREADS" not in os.environ:
                num_threads = _default_num_threads()
            if num_threads:
                torch.set_num_threads(num_threads)
        t0 = time.perf_counter()
        loaded = model if isinstance(model, LoadedModel) else load_model(model, dtype=dtype, device=device)
        self.name = loaded.name
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.generation_config = loaded.generation_config
        self.eos_token_ids: list[int] = loaded.eos_token_ids
        self.spec = ModelSpec.from_config(self.config)
        self.vocab_size = self.spec.vocab_size
        self.max_model_len = self.spec.max_position
        self.dtype = dtype
        sd = {k: v.to(device=self.device, dtype=dtype) for k, v in loaded.state_dict.items()}
        self.model = LlamaModel(self.spec, self.config, sd).to(self.device).eval()
        del sd

        self.ops, self.attention_backend_reason = _resolve_backend(attention_backend, self.device, dtype)
        self.attention_backend = getattr(self.ops, "name", type(self.ops).__name__)
        if getattr(self.ops, "fused", None) is not None and dtype not in (torch.float32, torch.bfloat16):
            self.ops = dataclasses.replace(self.ops, fused=None)  # the fused C++ ops take fp32 and bf16 only
        if self.attention_backend == "cpu" and dtype == torch.float16:
            self.attention_backend_reason = ("CPU backend in fp16: the torch reference's decode and SDPA for "
                                             "prefill chunks (the C++ and Numba kernels and oneDNN's packed "
                                             "weights take fp32 and bf16: fp16 on a CPU saves memory, not time)")
        # The CPU backend is the fast path: its matmuls use packed weights too (labkit's C++
        # loop on panels in fp32, oneDNN's packed weights in bf16). The "torch" backend keeps
        # the plain ones, the reference chapters 5 and 6 read.
        layout, ext = linear_layout(self.device, dtype) if self.attention_backend == "cpu" else (None, None)
        self.linear_layout = layout  # "panels", "onednn", or None: plain weights
        if layout is not None:
            self.model.pack_linears(layout, ext)
            self.attention_backend_reason += ("; matmuls by labkit's C++ loop on weights packed in panels"
                                              if layout == "panels" else "; matmuls on oneDNN-packed weights")
        elif self.attention_backend == "cpu" and dtype == torch.bfloat16:
            self.attention_backend_reason += ("; matmuls on plain bf16 weights, widened to fp32 (this CPU has "
                                              "no bf16 matrix kernels: bf16 saves memory here, not time)")
        self.block_size = block_size
        check_backend_kv_dtype(self.attention_backend, self.kv_cache_dtype, self.device)
        self.kv_cache = KVCache.from_config(self.config, block_size, num_blocks, kv_budget_bytes,
                                            self.kv_cache_dtype, self.device)
        self.num_blocks = self.kv_cache.num_blocks
        self.load_time_s = time.perf_counter() - t0

    @property
    def packed_linears(self) -> bool:
        """Whether the linear layers run on packed weights (either layout)."""
        return self.linear_layout is not None

    # -----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, chunks: list[SeqChunk], copies: list[tuple[int, int]] | None = None,
                num_layers: int | None = None) -> torch.Tensor:
        """Run one iteration. Returns fp32 logits ``[num chunks with compute_logits, vocab]`` in chunk order.
        ``num_layers``: only the first layers and the LM head (a self-speculative draft,
        ``LlamaModel.forward``); None runs the whole model."""
        if copies:
            self.kv_cache.copy_blocks(copies)
        if not chunks:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        if num_layers is not None and not 1 <= num_layers <= self.spec.num_layers:
            raise ValueError(f"num_layers={num_layers}: the model has {self.spec.num_layers} layers")
        input_ids, positions, meta, logits_indices = self.prepare(chunks)
        logits = self.model(input_ids, positions, meta, self.kv_cache, self.ops, logits_indices, num_layers)
        return logits.float()

    def prepare(self, chunks: list[SeqChunk]):
        """Pack the chunks: returns (input_ids, positions, AttentionMetadata, logits_indices)
        as tensors on the device."""
        b = pack_chunks(chunks, self.block_size, self.num_blocks, self.max_model_len)
        p, n = b.num_prefills, len(chunks)
        dev = self.device
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
        meta = AttentionMetadata(
            slot_mapping=t(b.slot_mapping),
            num_prefill_tokens=int(b.query_start_loc[p]),
            prefill_block_tables=t(b.block_tables[:p, : int(b.blocks_needed[:p].max())]) if p else None,
            prefill_context_lens=t(b.context_lens[:p].astype(np.int32)) if p else None,
            prefill_query_start_loc=t(b.query_start_loc[: p + 1].astype(np.int32)) if p else None,
            decode_block_tables=t(b.block_tables[p:, : int(b.blocks_needed[p:].max())]) if p < n else None,
            decode_context_lens=t(b.context_lens[p:].astype(np.int32)) if p < n else None,
        )
        return t(b.input_ids), t(b.positions), meta, t(b.logits_indices)

    # -----------------------------------------------------------------------------------------
    def __repr__(self) -> str:
        return (f"ModelRunner({self.name!r}, layers={self.spec.num_layers}, backend={self.attention_backend!r}, "
                f"{self.kv_cache})")


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype, device) -> tuple[torch.dtype, str]:
    """The model's dtype from what the user gave: ``"auto"`` (labkit chooses for ``device``:
    fp32, or fp16 on GPUs below compute capability 8.0 such as Colab's T4; see
    ``labkit.kernels.default_dtype``), a name of :data:`DTYPES`, or a ``torch.dtype``.
    Returns (dtype, the words the load line prints)."""
    # Imported here, before anything loads Transformers (which imports Triton through
    # torch._dynamo): labkit.kernels must choose Triton's interpreter first on a CPU.
    from labkit.kernels import default_dtype

    if isinstance(dtype, torch.dtype):
        return dtype, str(dtype).removeprefix("torch.")
    if dtype == "auto":
        return default_dtype(device)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose 'auto' or one of {', '.join(DTYPES)}")
    return DTYPES[dtype], str(DTYPES[dtype]).removeprefix("torch.")


def check_backend_kv_dtype(backend: str, kv_dtype: torch.dtype, device: torch.device) -> None:
    """Refuse (ValueError, saying what works) a quantized cache a backend cannot read.
    Every built-in backend reads int8 and fp8 (e4m3) caches, except Triton's fp8 on GPUs
    below compute capability 8.9 (no fp8 conversion instructions: the T4 and the A100),
    where int8 or the torch backend works."""
    if backend != "triton" or kv_dtype != torch.float8_e4m3fn or device.type != "cuda":
        return
    from labkit.kernels.kv_quant import FP8_MIN_COMPUTE_CAPABILITY
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_COMPUTE_CAPABILITY:
        raise ValueError(f"kv_cache_dtype 'fp8' on the triton backend needs compute capability "
                         f"{'.'.join(map(str, FP8_MIN_COMPUTE_CAPABILITY))}+ (fp8 conversions); this GPU is "
                         f"{'.'.join(map(str, capability))}: use kv_cache_dtype 'int8', or attention_backend='torch'")


def _resolve_backend(backend, device: torch.device, dtype: torch.dtype | None = None):
    """``backend``: "auto" | "torch" | "triton" (see ``labkit.kernels``), or any object with
    ``reshape_and_cache``, ``decode`` and ``prefill`` methods (e.g. your own kernels).

    Returns (ops, reason): reason says why this backend was chosen (for ``dtype``: a T4 runs
    the Triton kernels in fp16 and fp32, not bf16).
    """
    if not isinstance(backend, str):
        for name in ("reshape_and_cache", "decode", "prefill"):
            if not callable(getattr(backend, name, None)):
                raise TypeError(f"attention backend {backend!r} has no callable .{name}")
        return backend, "user-supplied attention ops"
    from labkit.kernels import get_attention_ops, select_attention_backend

    name, reason = select_attention_backend(backend, device, dtype)
    return get_attention_ops(name), reason
