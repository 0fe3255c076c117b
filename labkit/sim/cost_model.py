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

    def iteration_time(self, shape: BatchShape) -> float:
        return (self.fixed_s + self.per_token_s * shape.num_tokens
                + self.per_prefill_context_token_s * shape.prefill_context_tokens
                + self.per_decode_context_token_s * shape.decode_context_tokens)
