"""Layer 3: the simulator. The real scheduler and block manager, a cost model instead of a model."""

from .cost_model import BatchShape, LinearCostModel
from .executor import SimExecutor, dummy_token
from .run import POLICIES, SimResult, make_scheduler, percentile, simulate, summarize
from .traces import (DATASETS, TraceRequest, branching_trace, few_shot_trace, load_trace,
                     multi_turn_trace, poisson_arrivals, save_trace, shared_prompt_trace, synthetic_trace)

__all__ = [
    "BatchShape", "LinearCostModel", "SimExecutor", "dummy_token", "POLICIES", "SimResult",
    "make_scheduler", "percentile", "simulate", "summarize", "DATASETS", "TraceRequest",
    "load_trace", "poisson_arrivals", "save_trace", "shared_prompt_trace", "synthetic_trace",
    "multi_turn_trace", "few_shot_trace", "branching_trace",
]
