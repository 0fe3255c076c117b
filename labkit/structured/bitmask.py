"""The token bitmask: which tokens a grammar allows next, one bit per token.

A row of the bitmask covers the vocabulary in 32-bit words: bit ``t % 32`` of word
``t // 32`` is 1 when token ``t`` may come next. (A boolean per token would be 32 times
larger: 49,152 tokens are 1,536 words, 6 KiB a row.) XGrammar fills the rows; applying one
sets the logits of the forbidden tokens to ``-inf``, so that softmax gives them probability
zero and no sampler, greedy or random, can pick them.

``apply_bitmask`` applies rows in place with XGrammar's kernel (CPU, or Triton on a GPU);
``apply_bitmask_reference`` is the same operation in plain torch, a few lines to read and
the definition the kernel is tested against. ``allowed_tokens`` unpacks a row into ids.
"""

from __future__ import annotations

import torch

WORD_BITS = 32


def num_words(vocab_size: int) -> int:
    """32-bit words per bitmask row."""
    return (vocab_size + WORD_BITS - 1) // WORD_BITS


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 ``[num_rows, num_words]`` bitmask with every token allowed."""
    return torch.full((num_rows, num_words(vocab_size)), -1, dtype=torch.int32)


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool ``[rows, vocab_size]``: True where the token is allowed."""
    shifts = torch.arange(WORD_BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1          # [rows, words, 32], low bit first
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Set forbidden tokens' logits to ``-inf``, in place, on ``rows`` of ``logits`` (all when
    None); row ``i`` of ``logits`` reads row ``i`` of ``bitmask``."""
    rows = list(range(logits.shape[0])) if rows is None else rows
    if rows:
        allowed = unpack(bitmask[rows].to(logits.device), logits.shape[-1])
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """``apply_bitmask_reference`` with XGrammar's kernel: in place, only ``rows`` touched.
    ``bitmask`` lives on the CPU (where XGrammar fills it) and is copied to the logits'
    device first when that is a GPU."""
    if not rows:
        return
    import xgrammar as xgr

    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)


def allowed_tokens(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    """The ids a bitmask row allows, ascending."""
    return torch.nonzero(unpack(bitmask_row.reshape(1, -1), vocab_size)[0]).flatten().tolist()
