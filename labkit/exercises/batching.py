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
from ..utils import cdiv
from ._grading import (check_exact, check_number, check_share, fail, graded, number_forms, passed, read_count,
                       share_forms, sig)

# ---- exercise 4.1: one static batch --------------------------------------------------------
EX41_PROMPT = 10
EX41_OUTPUTS = (12, 40, 28, 8)     # busy and idle shares differ: neither passes for the other


def ex41_trace() -> list[TraceRequest]:
    """Four requests at t=0, 10-token prompts, outputs of 12, 40, 28 and 8 tokens."""
    return [TraceRequest(EX41_PROMPT, n) for n in EX41_OUTPUTS]


@functools.lru_cache(maxsize=None)
def _static_batch() -> tuple[int, float]:
    run = simulate(ex41_trace(), "static", num_blocks=64, block_size=16, max_num_seqs=4,
                   reserve="max_tokens", max_model_len=None)
    records = run.records
    width = 4
    busy = sum(len(r.ran) for r in records) / (width * len(records))
    return len(records), busy


@graded("4.1")
def check_static_batch(iterations: object, busy_fraction: object) -> None:
    """Exercise 4.1: the four requests of ``ex41_trace()`` form one static batch. How many
    iterations does it run (a count), and what fraction of its 4 × iterations sequence slots
    compute a token of a request that has not finished (3 significant figures, a fraction or a
    percent)?"""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    steps, busy = _static_batch()
    longest, total = max(EX41_OUTPUTS), sum(EX41_OUTPUTS)
    n = read_count("iterations", iterations)
    check_exact("iterations", n, steps,
                mistakes=[(total, "The four requests run side by side, not one after another."),
                          (min(EX41_OUTPUTS), "A static batch does not end when its first request "
                                              "does: when does it end?")],
                hint="When does a static batch end, and how many tokens does a running request get per "
                     "iteration? (The iteration that computes the prompts also samples each request's first "
                     "token.)")
    check_share("busy_fraction", busy_fraction, busy,
                mistakes=[(1 - busy, "That is the idle share; the question asks for the busy one."),
                          (total / (4 * (longest + 1)), "Count the iterations without a separate prefill."),
                          (total / (4 * total), "The batch's slots are 4 per iteration of the batch, not "
                                                "one per token produced."),
                          (len(EX41_OUTPUTS) * min(EX41_OUTPUTS) / (4 * longest),
                           "A request keeps computing until its own last token, not only while all four "
                           "are unfinished.")],
                hint="Count the slots in which a request that had not finished yet got a token, "
                     "out of all the batch's slots over all its iterations.")
    passed(f"{steps} iterations (the longest request's {longest} tokens); {total} of {4 * steps} "
           f"sequence slots did work: {sig(100 * busy)}%. The other {sig(100 * (1 - busy))}% held memory and a "
           "batch slot for requests that had already finished, while others waited.")


# ---- exercise 4.2: the pool from which preemption stops --------------------------------------
#: The trace and the settings of exercise 4.2 (the notebook imports them).
EX42_TRACE = dict(dataset="alpaca", num_requests=60, rate=8.0, seed=3, max_len=512)
EX42_SIM = dict(block_size=16, max_num_seqs=32, max_model_len=512)


def _blocks(r: TraceRequest, block_size: int) -> int:
    """Blocks one request holds at its full length (prompt + output)."""
    return cdiv(r.prompt_len + r.output_len, block_size)


@functools.lru_cache(maxsize=None)
def ex42_pools() -> range:
    """The pool sizes exercise 4.2 asks about: from the smallest pool that holds the longest
    request (``simulate`` refuses less) to the largest one worth trying, where the
    ``max_num_seqs`` longest requests all fit at full length at once, so that nothing running
    can ever run out of blocks (no preemption is possible there or above)."""
    bs, seqs = EX42_SIM["block_size"], EX42_SIM["max_num_seqs"]
    need = sorted((_blocks(r, bs) for r in synthetic_trace(**EX42_TRACE)), reverse=True)
    return range(need[0], sum(need[:seqs]) + 1)


@functools.lru_cache(maxsize=None)
def ex42_preemptions(num_blocks: int) -> int:
    """Preemptions when ``EX42_TRACE`` runs on ``num_blocks`` blocks (continuous batching)."""
    trace = synthetic_trace(**EX42_TRACE)
    return simulate(trace, num_blocks=num_blocks, keep_records=False, **EX42_SIM).metrics["num_preemptions"]


def ex42_expected() -> int:
    """The answer of exercise 4.2: one more than the largest pool of the range that preempts."""
    pools = ex42_pools()
    return 1 + next((n for n in reversed(pools) if ex42_preemptions(n)), pools.start - 1)


def _ex42_mistakes(answer: int) -> list[tuple[float, str]]:
    """The pools students answer 4.2 with when they get the idea wrong, and what to say. The trap
    (a pool that avoids preemption by luck, below the answer) is looked for only up to ``answer``:
    it costs a simulation per pool."""
    pools = ex42_pools()
    bs = EX42_SIM["block_size"]
    everything = sum(_blocks(r, bs) for r in synthetic_trace(**EX42_TRACE))
    mistakes = [
        (pools.stop - 1, "That is the pool where the longest requests all fit at full length, so nothing can "
                         "be preempted there by construction; the question asks from which pool on no "
                         "preemption happens on this trace."),
        (everything, "That reserves every request's full length at once: static batching's sizing, not "
                     "what continuous batching needs."),
    ]
    if answer < ex42_expected():
        first_free = next((n for n in range(pools.start, answer + 1) if not ex42_preemptions(n)), None)
        if first_free == answer:
            mistakes.append((answer, "That pool happens to avoid preemption, but the count does not fall steadily "
                                     "with the pool size: is every pool of the range above it free of it too?"))
    return mistakes


@graded("4.2")
def check_preemption_free_pool(num_blocks: object) -> None:
    """Exercise 4.2: the smallest ``num_blocks`` in ``ex42_pools()`` from which no pool of
    ``ex42_pools()`` preempts: ``EX42_TRACE`` under continuous batching (``EX42_SIM``) runs
    without a single preemption on it and on every larger pool of the range."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    pools = ex42_pools()
    n = read_count("num_blocks", num_blocks)
    if n not in pools:
        fail(f"num_blocks: {n:,} is not one of the pool sizes to consider, ex42_pools() = {pools.start} to "
             f"{pools.stop - 1}.")
    check_exact("num_blocks", n, ex42_expected(), mistakes=lambda: _ex42_mistakes(n),
                hint="Count the preemptions on every pool size of ex42_pools() (each run takes a few "
                     "hundredths of a second), and find the smallest size s such that no size from s to the end of the "
                     "range preempts.")
    bs = EX42_SIM["block_size"]
    total = sum(_blocks(r, bs) for r in synthetic_trace(**EX42_TRACE))
    below = f"; {n - 1} preempts" if n > pools.start else ""
    passed(f"from {n} blocks ({n * bs:,} token slots) up, no pool preempts{below}. A smaller pool may "
           f"still avoid preemption by luck of admission timing, but not for good. Reserving every "
           f"request's full length would take {total} blocks.")


# ---- exercise 4.3: the speedup depends on the cost model ---------------------------------------
#: The trace and the settings of exercise 4.3 (the notebook imports them).
EX43_TRACE = dict(dataset="sharegpt", num_requests=200, seed=0, max_len=2048)
EX43_SIM = dict(num_blocks=2048, block_size=16, max_num_seqs=64, max_model_len=2048, reserve="model")
EX43_GPU = ("llama-3-8b", "a100-80gb")


def ex43_cost_models() -> dict:
    """The two cost models: the CPU fit (None: the simulator's default) and a GPU roofline."""
    return {"cpu": None, "gpu": roofline(*EX43_GPU)}


@functools.lru_cache(maxsize=None)
def ex43_ratios() -> dict[str, float]:
    """Continuous over static output tokens/s, per cost model, on the exercise's trace."""
    trace = synthetic_trace(**EX43_TRACE)
    out = {}
    for name, cm in ex43_cost_models().items():
        tps = {p: simulate(trace, p, cost_model=cm, keep_records=False, **EX43_SIM).metrics["output_tok_per_s"]
               for p in ("static", "continuous")}
        out[name] = tps["continuous"] / tps["static"]
    return out


@graded("4.3")
def check_speedups(cpu_ratio: object, gpu_ratio: object) -> None:
    """Exercise 4.3: continuous / static output tokens per second on ``EX43_TRACE`` with
    ``EX43_SIM``, under the CPU cost model (the simulator's default) and under the roofline
    model of Llama-3-8B on an A100, each to 3 significant figures."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    ratios = ex43_ratios()
    for name, value in (("cpu_ratio", cpu_ratio), ("gpu_ratio", gpu_ratio)):
        expected = ratios[name[:3]]
        check_number(name, value, expected, ratio=True,
                     mistakes=[(1 / expected, "That is static over continuous; divide continuous's "
                                              "throughput by static's."),
                               (ratios["gpu" if name == "cpu_ratio" else "cpu"],
                                "That is the other cost model's ratio."),
                               (expected - 1, "That is how much more, not how many times as much: a speedup "
                                              "is a ratio of the two throughputs.")],
                     hint="Simulate synthetic_trace(**EX43_TRACE) under both policies with **EX43_SIM "
                          "and the cost model, and compare metrics['output_tok_per_s'].")
    passed(f"continuous batching serves this trace {sig(ratios['cpu'])}× faster with the CPU cost model "
           f"and {sig(ratios['gpu'])}× faster on the A100 roofline: same scheduler, same memory, "
           "different hardware economics.")


def answer_forms() -> dict[str, list[str]]:
    """What would give each exercise's answer away if a student saw it before the check
    (``tests/test_answer_leaks.py`` scans the student notebooks and the hints for it)."""
    steps, busy = _static_batch()
    pool = ex42_expected()
    ratios = ex43_ratios()
    return {
        "4.1": [f"{steps} iterations", f"busy_fraction = {busy:g}"] + share_forms(busy),
        "4.2": [f"{pool}", f"{pool} blocks"],
        "4.3": [form for r in ratios.values() for n in number_forms(r) for form in (n, f"{n}×", f"{n}x")],
    }
