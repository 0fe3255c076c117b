"""The real executor: the scheduler's plan, run through a Llama on paged KV, then sampled.

``ModelExecutor`` is what the engine calls every iteration when it serves a model. It
turns each ``ScheduledSeq`` into a ``SeqChunk`` (tokens to compute, first position,
the sequence's physical blocks, prefill or decode as the scheduler decided), lets the ``ModelRunner`` apply the copy-on-write copies
and run one forward over the whole mixed batch, and samples from the logits of the
sequences whose chunk ends their known tokens (``n`` samples at a fork).

Seeded sampling is independent of batching and of preemption: each sampled token draws
from a generator seeded by (request seed, sample index, position), so the same request
gets the same tokens whatever else runs beside it, and a recomputed sequence continues
exactly as it would have.
"""

from __future__ import annotations

import time

import torch

from .engine import ExecuteResult
from .model.runner import ModelRunner, SeqChunk
from .model.sampler import SamplingRow, make_generator, sample
from .scheduler import SchedulerOutput


def _row_seed(seed: int, index: int, position: int) -> int:
    return (seed * 1_000_003 + index * 10_007 + position) % (2**63 - 1)


class ModelExecutor:
    """Runs plans on a real model: forward pass + sampling, timed on the wall clock."""

    simulated = False

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.vocab_size = runner.vocab_size

    def execute(self, plan: SchedulerOutput) -> ExecuteResult:
        t0 = time.perf_counter()
        chunks = [SeqChunk(item.token_ids, item.num_computed_tokens, item.seq.block_table.block_ids,
                           item.num_samples > 0, item.is_prefill)
                  for item in plan.scheduled]
        logits = self.runner.execute(chunks, plan.copies)
        rows: list[SamplingRow] = []
        row_of: list[int] = []            # which logits row each sampling row reads
        r = 0
        for item in plan.scheduled:
            if item.num_samples == 0:
                continue
            params = item.seq.request.params
            for index in item.sample_indices:
                gen = None
                if params.seed is not None and not params.greedy:
                    gen = make_generator(_row_seed(params.seed, index, item.sample_position))
                rows.append(SamplingRow(params.temperature, params.top_p, params.top_k, gen))
                row_of.append(r)
            r += 1
        sampled_flat: list[int] = []
        if rows:
            table = logits if len(row_of) == logits.shape[0] else logits[torch.tensor(row_of)]
            sampled_flat = sample(table, rows)
        sampled, k = [], 0
        for item in plan.scheduled:
            sampled.append(sampled_flat[k:k + item.num_samples])
            k += item.num_samples
        return ExecuteResult(sampled, time.perf_counter() - t0)
