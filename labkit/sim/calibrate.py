"""Fit the simulator's linear cost model to the real engine's measured iterations.

Serve a workload with the real model, record each iteration's ``BatchShape`` and its
measured duration, and solve the least-squares problem

    duration ~ fixed + per_token * tokens + per_prefill_context * prompt keys read
                     + per_decode_context * decode keys read

so that simulated time tracks real time for this model on this machine.
"""

from __future__ import annotations

import numpy as np

from ..engine import ExecuteResult
from .cost_model import BatchShape, LinearCostModel


class RecordingExecutor:
    """Wraps a real executor; remembers (shape, seconds) for every iteration it runs."""

    def __init__(self, inner):
        self.inner = inner
        self.simulated = inner.simulated
        self.tokenizer = getattr(inner, "tokenizer", None)
        self.samples: list[tuple[BatchShape, float]] = []

    def execute(self, plan) -> ExecuteResult:
        result = self.inner.execute(plan)
        self.samples.append((BatchShape.of(plan), result.duration_s))
        return result


def fit_linear_cost_model(samples: list[tuple[BatchShape, float]], name: str = "fitted") -> LinearCostModel:
    """Least-squares fit of the four coefficients (each clipped at zero)."""
    if len(samples) < 4:
        raise ValueError(f"need at least 4 measured iterations to fit 4 coefficients, got {len(samples)}")
    a = np.array([[1.0, s.num_tokens, s.prefill_context_tokens, s.decode_context_tokens] for s, _ in samples])
    y = np.array([t for _, t in samples])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return LinearCostModel(*(max(0.0, float(c)) for c in coef), name=name)


def calibrate(model: str = "smollm2-135m", num_requests: int = 32, seed: int = 0, **llm_options):
    """Serve a small default workload on the real engine and fit the cost model to it.
    Returns (LinearCostModel, relative error of the fitted total time)."""
    from ..bench.serve import default_workload
    from ..llm import LLM
    from ..sampling_params import SamplingParams

    w = default_workload(model, num_requests, seed, output_range=(16, 128))
    llm = LLM(model, enable_prefix_caching=False, **llm_options)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)   # warm-up
    rec = RecordingExecutor(llm.engine.executor)
    llm.engine.executor = rec
    llm.generate([r["prompt_token_ids"] for r in w["requests"]],
                 [SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=True) for r in w["requests"]],
                 use_tqdm=False)
    fitted = fit_linear_cost_model(rec.samples, name=f"{model}-fitted")
    measured = sum(t for _, t in rec.samples)
    predicted = sum(fitted.iteration_time(s) for s, _ in rec.samples)
    return fitted, abs(predicted - measured) / measured
