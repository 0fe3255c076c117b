"""How long an iteration takes, without running a model.

The simulator's executor asks a cost model for the duration of each planned batch. The
batch is summarised by its ``BatchShape``: how many prompt tokens and decode tokens it
computes, and how much context their attention reads.

``LinearCostModel`` is the simplest faithful model of a CPU or GPU forward pass:

    t = fixed + per_token * (batched tokens)
              + per_prefill_context_token * (keys read by prompt tokens)
              + per_decode_context_token * (keys read by decode tokens)

* ``fixed``: what every iteration pays whatever its size (reading the weights once,
  Python and kernel-launch overhead);
* ``per_token``: the matrix multiplies, linear in the tokens computed;
* the context terms: attention, linear in the keys and values read.

Its defaults were fitted to labkit's own engine serving SmolLM2-135M in fp32 on the
2-core development CPU (``python -m labkit.bench sim --calibrate`` repeats the fit);
the roofline model of the disaggregation chapter (``labkit.sim.roofline``) derives the
same three terms from FLOPs and bytes instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..scheduler import SchedulerOutput


@dataclass(slots=True)
class BatchShape:
    """What a cost model needs to know about one iteration's batch."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_seqs: int = 0
    decode_context_tokens: int = 0      # sum of context lengths read by decode tokens
    prefill_context_tokens: int = 0     # sum over prompt tokens of the keys each attends to

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @classmethod
    def of(cls, plan: SchedulerOutput) -> "BatchShape":
        shape = cls(num_seqs=len(plan.scheduled))
        for item in plan.scheduled:
            n, start = item.num_new_tokens, item.num_computed_tokens
            if item.is_prefill:
                shape.num_prefill_tokens += n
                # token j of the chunk attends to start + j + 1 keys (causal)
                shape.prefill_context_tokens += n * start + n * (n + 1) // 2
            else:
                shape.num_decode_tokens += n
                shape.decode_context_tokens += start + n
        return shape


@dataclass(slots=True)
class LinearCostModel:
    """Iteration time = fixed + per_token * tokens + the attention terms.

    Attention is split by phase because its cost per key read differs: a prefill chunk
    reads each key once for many queries (compute-bound, cheap per pair), while each
    decode token reads its whole context for one query (memory-bound, dear per key).
    """

    # Fitted by ``python -m labkit.bench sim --calibrate`` to labkit serving SmolLM2-135M in
    # fp32 on the 2-core development CPU (CPU attention backend), 2026-11-29.
    fixed_s: float = 0.033
    per_token_s: float = 0.00089
    per_prefill_context_token_s: float = 0.9e-6
    per_decode_context_token_s: float = 6.3e-6
    name: str = "cpu-smollm2-135m-fp32"

    @property
    def swap_link(self) -> SwapLink:
        """Swapping on the machine these coefficients were fitted on: its memcpy, measured."""
        return cpu_swap_link()

    def iteration_time(self, shape: BatchShape) -> float:
        return (self.fixed_s + self.per_token_s * shape.num_tokens
                + self.per_prefill_context_token_s * shape.prefill_context_tokens
                + self.per_decode_context_token_s * shape.decode_context_tokens)


# ---- swapping: the cost of moving KV blocks between device and host ------------------
@dataclass(frozen=True, slots=True)
class SwapLink:
    """The link swapped KV blocks cross between device memory and host memory.

    Copying ``n`` blocks one way takes ``n * transfers_per_block * (latency_s +
    bytes_per_transfer / bandwidth)``. vLLM v0 copied each block of each layer's K and V
    as its own transfer (``2 * num_layers`` per block), so a transfer carries
    ``block_size * kv_bytes_per_token / transfers_per_block`` bytes: with small blocks,
    the fixed cost per transfer dominates and the link's effective bandwidth collapses.
    That is the paper's explanation of Figure 19 (section 7.3), and this is its model.
    """

    bandwidth: float            # bytes/s, one direction, large transfers
    latency_s: float            # fixed cost of one transfer (launch, DMA setup)
    kv_bytes_per_token: int     # K and V of one token, every layer
    transfers_per_block: int    # separate copies per block: 2 * num_layers in vLLM v0
    name: str = ""

    def bytes_per_transfer(self, block_size: int) -> float:
        return block_size * self.kv_bytes_per_token / self.transfers_per_block

    def copy_time(self, num_blocks: int, block_size: int) -> float:
        """Seconds to copy ``num_blocks`` blocks of ``block_size`` tokens one way."""
        if num_blocks <= 0:
            return 0.0
        per_transfer = self.latency_s + self.bytes_per_transfer(block_size) / self.bandwidth
        return num_blocks * self.transfers_per_block * per_transfer

    def effective_bandwidth(self, block_size: int) -> float:
        """Bytes/s actually achieved with blocks of ``block_size`` tokens."""
        return self.bytes_per_transfer(block_size) / (
            self.latency_s + self.bytes_per_transfer(block_size) / self.bandwidth)


@functools.lru_cache(maxsize=1)
def measure_memcpy(nbytes: int = 32 << 20, small_bytes: int = 256, repeats: int = 5) -> tuple[float, float]:
    """This machine's host memcpy: ``(bandwidth bytes/s, seconds per small copy)``, measured
    once per process (cached; about 0.1 s). On a CPU the "device" and "host" pools are both
    host memory, so this is the link a swap crosses there. The small-copy time is the fixed
    cost of one copy call (torch's dispatch included), what a per-transfer copy pays."""
    import time

    import torch

    src = torch.empty(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)                                    # first touch: page faults, not copying
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    bandwidth = nbytes / best
    count = 256
    small_src = src[: count * small_bytes // 4].view(count, -1)
    small_dst = dst[: count * small_bytes // 4].view(count, -1)
    t0 = time.perf_counter()
    for i in range(count):
        small_dst[i].copy_(small_src[i])
    per_copy = (time.perf_counter() - t0) / count
    latency = max(0.0, per_copy - small_bytes / bandwidth)
    return bandwidth, latency


# SmolLM2-135M in fp32 (what LinearCostModel was fitted on): 2 (K, V) x 30 layers x 3 KV
# heads x 64 dims x 4 bytes per token.
SMOLLM2_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4


def cpu_swap_link(kv_bytes_per_token: int = SMOLLM2_KV_BYTES_PER_TOKEN) -> SwapLink:
    """Swapping in labkit's engine on this machine, from its measured memcpy: the engine
    gathers an iteration's blocks, every layer at once, into one buffer and scatters them
    (``labkit.model.kv_cache.swap_blocks``): two passes over the bytes, one call per block
    at most. So block size barely matters here, unlike vLLM v0's per-layer transfers."""
    bandwidth, latency = measure_memcpy()
    return SwapLink(bandwidth / 2, latency, kv_bytes_per_token, 1, name="this machine's memcpy (gathered)")
