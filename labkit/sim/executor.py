"""The simulator's executor: the real scheduler's batches, a cost model's durations.

``SimExecutor`` stands where the model would: it receives the same plan (which sequences,
how many tokens, which copy-on-write copies) and returns sampled tokens and a duration.
The tokens are dummy but *deterministic*: a function of the request, the sample index and
the position, so that a preempted and recomputed sequence produces exactly the tokens it
would have produced without preemption (as greedy decoding with a real model does).

Beam-search requests need more than a token: each beam's most likely next tokens with their
log-probabilities. ``pseudo_logprobs`` makes them up, deterministically from the beam's
last tokens and position, so that beams fork and die in simulation as they do on a model
(and a preempted beam gets the same numbers again).
"""

from __future__ import annotations

import math
import random
import zlib

from ..engine import ExecuteResult
from ..outputs import Logprob
from ..scheduler import SchedulerOutput
from .cost_model import BatchShape, LinearCostModel, SwapLink, cpu_swap_link


def dummy_token(request_id: str, index: int, position: int, vocab_size: int) -> int:
    """A stand-in for the token a model would sample: same inputs, same token."""
    return zlib.crc32(f"{request_id}/{index}/{position}".encode()) % vocab_size


def pseudo_logprobs(request_id: str, token_ids: list[int], count: int, vocab_size: int) -> dict[int, Logprob]:
    """Stand-in log-probabilities of ``count`` next tokens of a beam whose tokens are
    ``token_ids``: same request, position and last four tokens, same answer. Their
    probabilities are uneven (squared exponential draws, 90 % of the mass in all), so the
    best beams change from step to step, as with a model."""
    rng = random.Random(zlib.crc32(f"{request_id}/{len(token_ids)}/{token_ids[-4:]}".encode()))
    tokens = rng.sample(range(vocab_size), count)
    weights = sorted((rng.expovariate(1.0) ** 2 for _ in tokens), reverse=True)
    total = sum(weights)
    return {t: Logprob(math.log(0.9 * w / total), rank + 1)
            for rank, (t, w) in enumerate(zip(tokens, weights))}


class SimExecutor:
    """Executes a plan with no model: dummy tokens and a modelled duration."""

    simulated = True
    tokenizer = None

    def __init__(self, cost_model=None, vocab_size: int = 32000, swap_link: SwapLink | None = None):
        self.cost_model = cost_model if cost_model is not None else LinearCostModel()
        self.vocab_size = vocab_size
        self.num_copies = 0
        # Swapping's copies cost link time (``SwapLink``): the cost model's own link unless
        # given (a PCIe preset for roofline hardware, this machine's memcpy for the CPU fit).
        self._swap_link = swap_link
        self.num_swapped_blocks = 0     # block copies out and in
        self.swap_s = 0.0               # modelled seconds spent copying them

    @property
    def swap_link(self) -> SwapLink:
        if self._swap_link is None:
            self._swap_link = getattr(self.cost_model, "swap_link", None) or cpu_swap_link()
        return self._swap_link

    def swap_time(self, plan: SchedulerOutput) -> float:
        """Seconds the plan's swap-out and swap-in copies take on the link, one after the
        other, before the batch runs (vLLM v0 did not overlap them with compute either)."""
        if not plan.swap_out and not plan.swap_in:
            return 0.0
        link = self.swap_link
        return link.copy_time(len(plan.swap_out), plan.block_size) + link.copy_time(len(plan.swap_in), plan.block_size)

    def execute(self, plan: SchedulerOutput) -> ExecuteResult:
        self.num_copies += len(plan.copies)   # a real executor would copy the KV blocks here
        sampled = [[dummy_token(item.seq.request.request_id, i, item.sample_position, self.vocab_size)
                    for i in item.sample_indices] for item in plan.scheduled]
        logprobs = None
        if any(item.num_samples and item.seq.request.beam is not None for item in plan.scheduled):
            logprobs = [[pseudo_logprobs(item.seq.request.request_id, item.seq.token_ids,
                                         item.seq.request.params.logprobs, self.vocab_size)]
                        if item.num_samples and item.seq.request.beam is not None else None
                        for item in plan.scheduled]
        swap = self.swap_time(plan)
        self.num_swapped_blocks += len(plan.swap_out) + len(plan.swap_in)
        self.swap_s += swap
        return ExecuteResult(sampled, self.cost_model.iteration_time(BatchShape.of(plan)) + swap, logprobs)
