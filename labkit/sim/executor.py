"""The simulator's executor: the real scheduler's batches, a cost model's durations.

``SimExecutor`` stands where the model would: it receives the same plan (which sequences,
how many tokens, which copy-on-write copies) and returns sampled tokens and a duration.
The tokens are dummy but *deterministic*: a function of the request, the sample index and
the position, so that a preempted and recomputed sequence produces exactly the tokens it
would have produced without preemption (as greedy decoding with a real model does).
"""

from __future__ import annotations

import zlib

from ..engine import ExecuteResult
from ..scheduler import SchedulerOutput
from .cost_model import BatchShape, LinearCostModel


def dummy_token(request_id: str, index: int, position: int, vocab_size: int) -> int:
    """A stand-in for the token a model would sample: same inputs, same token."""
    return zlib.crc32(f"{request_id}/{index}/{position}".encode()) % vocab_size


class SimExecutor:
    """Executes a plan with no model: dummy tokens and a modelled duration."""

    simulated = True
    tokenizer = None

    def __init__(self, cost_model=None, vocab_size: int = 32000):
        self.cost_model = cost_model if cost_model is not None else LinearCostModel()
        self.vocab_size = vocab_size
        self.num_copies = 0

    def execute(self, plan: SchedulerOutput) -> ExecuteResult:
        self.num_copies += len(plan.copies)   # a real executor would copy the KV blocks here
        sampled = [[dummy_token(item.seq.request.request_id, i, item.sample_position, self.vocab_size)
                    for i in item.sample_indices] for item in plan.scheduled]
        return ExecuteResult(sampled, self.cost_model.iteration_time(BatchShape.of(plan)))
