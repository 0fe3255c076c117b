"""ModelRunner: turns one scheduled iteration into one forward pass over the paged KV cache.

The scheduler hands over a list of ``SeqChunk``s: for each sequence, the tokens to compute
now (a prefill chunk, or the one new token of a decode), the position of the first of them,
and the physical blocks that hold the sequence's KV. The runner

1. applies the copy-on-write block copies the block manager asked for,
2. packs every chunk's tokens into one flat batch (prefill chunks first, then decodes) and
   builds the index tensors attention needs: ``positions``, ``slot_mapping`` (where each new
   token's K/V goes), ``block_tables``, ``context_lens`` and ``query_start_loc``,
3. runs the model once, and returns logits only at the last token of the chunks that asked
   for them (a prefill chunk that is not the prompt's last needs none).

The tensors are built with numpy over concatenated lists: no Python loop runs per token.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from .kv_cache import KVCache
from .llama import AttentionMetadata, LlamaModel, ModelSpec
from .loader import LoadedModel, load_model


@dataclass(slots=True)
class SeqChunk:
    """The work for one sequence in one iteration.

    token_ids: the tokens to compute now (positions ``start_pos .. start_pos + len - 1``).
    start_pos: position of the first of them (= number of tokens already in the KV cache).
    block_ids: the sequence's physical blocks, covering at least positions ``0 .. start_pos + len - 1``.
    compute_logits: whether to return logits at its last token (False for a non-final prefill chunk).
    """

    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    compute_logits: bool = True


def _default_num_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class ModelRunner:
    """Owns the model weights, the KV cache and the attention backend."""

    def __init__(self, model: str | LoadedModel = "smollm2-135m", block_size: int = 16,
                 num_blocks: int | None = None, kv_budget_bytes: int | None = None,
                 attention_backend="auto", dtype: torch.dtype = torch.float32, device="cpu",
                 num_threads: int | None = None):
        self.device = torch.device(device)
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

        self.ops, self.attention_backend_reason = _resolve_backend(attention_backend, self.device)
        self.attention_backend = getattr(self.ops, "name", type(self.ops).__name__)
        self.block_size = block_size
        self.kv_cache = KVCache.from_config(self.config, block_size, num_blocks, kv_budget_bytes, dtype, self.device)
        self.num_blocks = self.kv_cache.num_blocks
        self.load_time_s = time.perf_counter() - t0

    # -----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, chunks: list[SeqChunk], copies: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """Run one iteration. Returns fp32 logits ``[num chunks with compute_logits, vocab]`` in chunk order."""
        if copies:
            self.kv_cache.copy_blocks(copies)
        if not chunks:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        input_ids, positions, meta, logits_indices = self.prepare(chunks)
        logits = self.model(input_ids, positions, meta, self.kv_cache, self.ops, logits_indices)
        return logits.float()

    def prepare(self, chunks: list[SeqChunk]):
        """Pack the chunks: returns (input_ids, positions, AttentionMetadata, logits_indices)."""
        bs = self.block_size
        n = len(chunks)
        lens = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=n)
        if (lens < 1).any():
            raise ValueError("every SeqChunk needs at least one token")
        # Prefill chunks (more than one token) first, then decodes; a stable order otherwise.
        is_prefill = lens > 1
        order = np.concatenate((np.flatnonzero(is_prefill), np.flatnonzero(~is_prefill)))
        num_prefills = int(is_prefill.sum())
        ordered = [chunks[i] for i in order] if num_prefills and num_prefills < n else chunks
        if ordered is not chunks:
            lens = lens[order]
        else:
            order = np.arange(n)

        starts = np.fromiter((c.start_pos for c in ordered), dtype=np.int64, count=n)
        context_lens = starts + lens
        if int(context_lens.max()) > self.max_model_len:
            raise ValueError(f"a sequence reaches {int(context_lens.max())} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        query_start_loc = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        input_ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in ordered),
                                dtype=np.int64, count=num_tokens)

        # Block tables: one row per sequence, padded with block 0 (never read past context_lens).
        blocks_needed = (context_lens + bs - 1) // bs
        num_block_ids = np.fromiter((len(c.block_ids) for c in ordered), dtype=np.int64, count=n)
        if (num_block_ids < blocks_needed).any():
            i = int(np.flatnonzero(num_block_ids < blocks_needed)[0])
            raise ValueError(f"chunk needs {blocks_needed[i]} blocks for {context_lens[i]} tokens "
                             f"but has {num_block_ids[i]} block_ids")
        width = int(blocks_needed.max())
        take = np.minimum(num_block_ids, width)
        flat = np.fromiter(itertools.chain.from_iterable(c.block_ids[:width] for c in ordered),
                           dtype=np.int32, count=int(take.sum()))
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= self.num_blocks):
            raise ValueError(f"block ids must be in [0, {self.num_blocks}), got {int(flat.min())}..{int(flat.max())}")
        rows = np.repeat(np.arange(n), take)
        cols = np.arange(flat.size) - np.repeat(np.cumsum(take) - take, take)
        block_tables = np.zeros((n, width), dtype=np.int32)
        block_tables[rows, cols] = flat

        # Per token: its sequence, its position, and the cache slot its K/V goes to.
        seq_of_token = np.repeat(np.arange(n), lens)
        positions = np.arange(num_tokens) + np.repeat(starts - query_start_loc[:-1], lens)
        slot_mapping = block_tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs

        # Logits rows: the last token of each chunk that wants them, in the caller's chunk order.
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(n)
        wanted = np.fromiter((c.compute_logits for c in chunks), dtype=bool, count=n)
        logits_indices = query_start_loc[1:][rank[wanted]] - 1

        p = num_prefills
        num_prefill_tokens = int(query_start_loc[p])
        dev = self.device
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
        meta = AttentionMetadata(
            slot_mapping=t(slot_mapping),
            num_prefill_tokens=num_prefill_tokens,
            prefill_block_tables=t(block_tables[:p, : int(blocks_needed[:p].max())]) if p else None,
            prefill_context_lens=t(context_lens[:p].astype(np.int32)) if p else None,
            prefill_query_start_loc=t(query_start_loc[: p + 1].astype(np.int32)) if p else None,
            decode_block_tables=t(block_tables[p:, : int(blocks_needed[p:].max())]) if p < n else None,
            decode_context_lens=t(context_lens[p:].astype(np.int32)) if p < n else None,
        )
        return t(input_ids), t(positions), meta, t(logits_indices)

    # -----------------------------------------------------------------------------------------
    def __repr__(self) -> str:
        return (f"ModelRunner({self.name!r}, layers={self.spec.num_layers}, backend={self.attention_backend!r}, "
                f"{self.kv_cache})")


def _resolve_backend(backend, device: torch.device):
    """``backend``: "auto" | "torch" | "triton" (see ``labkit.kernels``), or any object with
    ``reshape_and_cache``, ``decode`` and ``prefill`` methods (e.g. your own kernels).

    Returns (ops, reason): reason says why this backend was chosen.
    """
    if not isinstance(backend, str):
        for name in ("reshape_and_cache", "decode", "prefill"):
            if not callable(getattr(backend, name, None)):
                raise TypeError(f"attention backend {backend!r} has no callable .{name}")
        return backend, "user-supplied attention ops"
    from labkit.kernels import get_attention_ops, select_attention_backend

    name, reason = select_attention_backend(backend, device)
    return get_attention_ops(name), reason
