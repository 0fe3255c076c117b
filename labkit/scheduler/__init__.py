"""Layer 2: who runs each iteration. Continuous batching and the static baseline share one
scheduler and one block manager; they differ only in policy hooks."""

from typing import Iterable

from ..memory import BlockAllocator
from .records import ScheduledSeq, SchedulerOutput, StepRecord, held_slot_fill, kv_cache_usage
from .checks import PREEMPTION_MODES
from .scheduler import Scheduler
from .static import StaticScheduler

POLICIES = ("continuous", "static")


def make_scheduler(policy: str, allocator: BlockAllocator, *, max_num_seqs: int = 64,
                   max_num_batched_tokens: int = 2048, enable_chunked_prefill: bool = True,
                   max_model_len: int | None = None, watermark: float = 0.01,
                   eos_token_ids: Iterable[int] = (), reserve: str = "max_tokens",
                   preemption_mode: str = "recompute", num_host_blocks: int = 0,
                   num_offload_blocks: int = 0, bytes_per_block: int = 0) -> Scheduler:
    """The scheduler for ``policy`` ("continuous" or "static") on ``allocator``.

    Takes every option of both policies, so callers can switch policy alone; each policy
    reads its own: the static baseline has no token budget, chunking or watermark (its
    batch is prefilled whole), and continuous batching reserves nothing (no ``reserve``).
    A misspelled option is a ``TypeError``, an unknown policy a ``ValueError``.

    ``preemption_mode`` ("recompute" or "swap", with ``num_host_blocks`` host blocks)
    says what continuous batching does with a victim's KV; the static baseline reserves
    every request's room up front and never preempts, so it has no host pool for swapping.
    ``num_offload_blocks`` host blocks (either policy) keep the cached blocks the prefix
    cache evicts, a host tier (``memory/host_tier.py``; ``bytes_per_block`` sizes its byte
    counters).
    """
    if preemption_mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
    if policy == "continuous":
        return Scheduler(allocator, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                         enable_chunked_prefill=enable_chunked_prefill, max_model_len=max_model_len,
                         watermark=watermark, eos_token_ids=eos_token_ids,
                         preemption_mode=preemption_mode, num_host_blocks=num_host_blocks,
                         num_offload_blocks=num_offload_blocks, bytes_per_block=bytes_per_block)
    if policy == "static":
        return StaticScheduler(allocator, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                               reserve=reserve, eos_token_ids=eos_token_ids,
                               num_offload_blocks=num_offload_blocks, bytes_per_block=bytes_per_block)
    raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")


__all__ = ["Scheduler", "StaticScheduler", "ScheduledSeq", "SchedulerOutput", "StepRecord",
           "POLICIES", "PREEMPTION_MODES", "make_scheduler", "kv_cache_usage", "held_slot_fill"]
