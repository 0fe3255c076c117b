"""Graders for chapter 4: static vs continuous batching, preemption, what the speedup depends on.

Every expected value comes from the simulator, that is, from labkit's real ``Scheduler`` /
``StaticScheduler`` and ``BlockAllocator`` with a cost model in place of the model
(``labkit.sim.simulate``). The exercises' settings are constants of this module, and the
notebook imports them, so that the student's runs and the grader's are the same runs.
"""

from __future__ import annotations

import functools

from ..sim import TraceRequest, simulate, synthetic_trace
from ..sim.roofline import roofline
from ._grading import check_close, fail, passed, read_count, read_fraction, read_number

# ---- exercise 4.1: one static batch --------------------------------------------------------
EX41_PROMPT = 10
EX41_OUTPUTS = (12, 40, 20, 8)


def ex41_trace() -> list[TraceRequest]:
    """Four requests at t=0, 10-token prompts, outputs of 12, 40, 20 and 8 tokens."""
    return [TraceRequest(EX41_PROMPT, n) for n in EX41_OUTPUTS]


@functools.lru_cache(maxsize=None)
def _static_batch() -> tuple[int, float]:
    run = simulate(ex41_trace(), "static", num_blocks=64, block_size=16, max_num_seqs=4,
                   reserve="max_tokens", max_model_len=None)
    records = run.records
    width = 4
    busy = sum(len(r.ran) for r in records) / (width * len(records))
    return len(records), busy


def check_static_batch(iterations: object, busy_fraction: object) -> None:
    """Exercise 4.1: the four requests of ``ex41_trace()`` form one static batch. How many
    iterations does it run, and what fraction of its 4 × iterations sequence slots compute
    a token of a request that has not finished?"""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    steps, busy = _static_batch()
    longest, total = max(EX41_OUTPUTS), sum(EX41_OUTPUTS)
    n = read_count("iterations", iterations)
    check_close("iterations", n, steps, rel=0,
                mistakes=[(longest + 1, "The iteration that computes the prompts also samples each "
                                        "request's first token: there is no extra prefill iteration."),
                          (total, "The four requests run side by side, not one after another."),
                          (min(EX41_OUTPUTS), "A static batch does not end when its first request "
                                              "does: it ends with its longest.")],
                hint="A static batch runs until its longest request has all its tokens; each "
                     "iteration gives every unfinished request one token.")
    f = read_fraction("busy_fraction", busy_fraction)
    check_close("busy_fraction", f, busy, rel=0.02,
                mistakes=[(1 - busy, "That is the idle share; the question asks for the busy one."),
                          (total / (4 * (longest + 1)), "Count the iterations without a separate prefill.")],
                hint="Busy slots = tokens produced in all (one per request per iteration it runs); "
                     "all slots = 4 × iterations.")
    passed(f"{steps} iterations (the longest request's {longest} tokens); {total} of {4 * steps} "
           f"sequence slots did work: {busy:.0%}. The other {1 - busy:.0%} held memory and a batch "
           "slot for requests that had already finished, while others waited.")


# ---- exercise 4.2: the speedup depends on the cost model ---------------------------------------
#: The trace and the settings of exercise 4.2 (the notebook imports them).
EX42_TRACE = dict(dataset="sharegpt", num_requests=200, seed=0, max_len=2048)
EX42_SIM = dict(num_blocks=2048, block_size=16, max_num_seqs=64, max_model_len=2048, reserve="model")
EX42_GPU = ("llama-3-8b", "a100-80gb")


def ex42_cost_models() -> dict:
    """The two cost models: the CPU fit (None: the simulator's default) and a GPU roofline."""
    return {"cpu": None, "gpu": roofline(*EX42_GPU)}


@functools.lru_cache(maxsize=None)
def ex42_ratios() -> dict[str, float]:
    """Continuous over static output tokens/s, per cost model, on the exercise's trace."""
    trace = synthetic_trace(**EX42_TRACE)
    out = {}
    for name, cm in ex42_cost_models().items():
        tps = {p: simulate(trace, p, cost_model=cm, keep_records=False, **EX42_SIM).metrics["output_tok_per_s"]
               for p in ("static", "continuous")}
        out[name] = tps["continuous"] / tps["static"]
    return out


def check_speedups(cpu_ratio: object, gpu_ratio: object) -> None:
    """Exercise 4.2: continuous / static output tokens per second on ``EX42_TRACE`` with
    ``EX42_SIM``, under the CPU cost model (the simulator's default) and under the roofline
    model of Llama-3-8B on an A100."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    ratios = ex42_ratios()
    for name, value in (("cpu_ratio", cpu_ratio), ("gpu_ratio", gpu_ratio)):
        x = read_number(name, value)
        expected = ratios[name[:3]]
        check_close(name, x, expected, rel=0.01,
                    mistakes=[(1 / expected, "That is static over continuous; divide continuous's "
                                             "throughput by static's."),
                              (ratios["gpu" if name == "cpu_ratio" else "cpu"],
                               "That is the other cost model's ratio.")],
                    hint="Simulate synthetic_trace(**EX42_TRACE) under both policies with **EX42_SIM "
                         "and the cost model, and divide metrics['output_tok_per_s'].")
    passed(f"continuous batching serves this trace {ratios['cpu']:.1f}× faster with the CPU cost model "
           f"and {ratios['gpu']:.1f}× faster on the A100 roofline: same scheduler, same memory, "
           "different hardware economics.")


# ---- exercise 4.3: the smallest pool without preemption -----------------------------------------
EX43_TRACE = dict(dataset="alpaca", num_requests=60, rate=8.0, seed=3, max_len=512)
EX43_SIM = dict(block_size=16, max_num_seqs=32, max_model_len=512)


def ex43_preemptions(num_blocks: int) -> int:
    """Preemptions when ``EX43_TRACE`` runs on ``num_blocks`` blocks (continuous batching)."""
    trace = synthetic_trace(**EX43_TRACE)
    return simulate(trace, num_blocks=num_blocks, keep_records=False, **EX43_SIM).metrics["num_preemptions"]


def check_smallest_pool(num_blocks: object) -> None:
    """Exercise 4.3: the smallest ``num_blocks`` with which continuous batching serves
    ``EX43_TRACE`` (settings ``EX43_SIM``) without a single preemption, while one block
    fewer preempts at least once."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    n = read_count("num_blocks", num_blocks)
    trace = synthetic_trace(**EX43_TRACE)
    bs = EX43_SIM["block_size"]
    smallest_possible = max(-(-(r.prompt_len + r.output_len) // bs) for r in trace)
    if n < smallest_possible:
        fail(f"num_blocks: {n} blocks cannot even hold the longest request "
             f"({smallest_possible} blocks); the simulator refuses it.")
    here = ex43_preemptions(n)
    if here:
        fail(f"num_blocks: with {n} blocks the scheduler still preempts {here} time(s). Look higher.")
    if n > smallest_possible:
        below = ex43_preemptions(n - 1)
        if not below:
            fail(f"num_blocks: {n - 1} blocks serve the trace without preemption too. Look lower: "
                 "the smallest pool is where one block fewer forces a preemption.")
    total = sum(-(-(r.prompt_len + r.output_len) // bs) for r in trace)
    passed(f"{n} blocks ({n * bs:,} token slots) serve all {len(trace)} requests without preemption; "
           f"{n - 1} would not. Reserving every request's full length at once would take {total} blocks.")
