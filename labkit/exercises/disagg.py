"""Graders for the disaggregation chapter (prefill/decode interference, chunked prefill,
disaggregated pools).

Every expected value is computed here from labkit's roofline cost model
(``labkit.sim.roofline``) for Llama-3-8B on one H100-SXM, the chapter's running example:
change the model's efficiencies and the graders follow.

    from labkit.exercises.disagg import check_ridge_point
    check_ridge_point(ridge_tokens)

Exercises 7.1-7.4. The expected-value helpers (``ridge_expected``, ``plan_expected``, ...)
serve the tests; the student notebook imports only the graders.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..sim.roofline import RooflineCostModel, batch_shape, roofline
from ._grading import check_exact, check_number, fail, graded, number_forms, passed, read_count, sig

MODEL, HARDWARE_NAME = "llama-3-8b", "h100-sxm"


@functools.lru_cache(maxsize=None)
def cost_model() -> RooflineCostModel:
    """The chapter's cost model: Llama-3-8B, bf16, one H100-SXM."""
    return roofline(MODEL, HARDWARE_NAME)


# ---- exercise 7.1: the ridge point -------------------------------------------------------
def ridge_expected() -> float:
    return cost_model().ridge_tokens()


@graded("7.1")
def check_ridge_point(tokens: object) -> None:
    """Exercise 7.1: how many tokens must one iteration carry before Llama-3-8B's linear layers
    on an H100 become compute-bound (multiplying the weights takes as long as reading them),
    with the *achieved* FLOP/s and bandwidth of ``cost_model().hardware``? To 3 significant
    figures."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    cm = cost_model()
    hw = cm.hardware
    expected = ridge_expected()
    b = cm.model.dtype_bytes
    peak = hw.peak_flops * b / (2 * hw.peak_bandwidth)
    check_number(
        "tokens", tokens, expected,
        mistakes=[
            (peak, "That uses the datasheet peaks. Real kernels reach only part of them: use the "
                   "achieved figures, cm.flops and cm.bandwidth (peak x efficiency)."),
            (expected / b, f"Each bf16 weight is {b} bytes: reading the weights moves more bytes "
                           "than there are weights."),
            (expected * 2, "Count the FLOPs per weight and token: a multiply and an add."),
            (expected * 2 / b, "Both the FLOPs per weight and the bytes per weight are missing: compare "
                               "a time with a time (FLOPs / FLOP/s and bytes / bytes/s)."),
            (1 / expected, "That is bytes per FLOP; the ridge is where the two times are equal."),
        ],
        hint="Write down how long the linear layers take to multiply T tokens with the weights, "
             "and how long they take to read the weights once; the ridge is the T where the two are "
             "equal.",
    )
    passed(f"Exercise 7.1: T = F·bytes / (2·B) = {sig(cm.flops / 1e12)} TFLOP/s × {b} B / (2 × "
           f"{sig(cm.bandwidth / 1e12)} TB/s) = {sig(expected)} tokens. A decode batch of 32 is far "
           "below it (memory-bound: the weights are read for 32 tokens' worth of math); a "
           "1,000-token prompt is far above it (compute-bound).")


# ---- exercise 7.2: when a prefill doubles a decode iteration -------------------------------
EX2_BATCH, EX2_CONTEXT = 32, 1024


def decode_alone_time() -> float:
    return cost_model().decode_time(EX2_BATCH, EX2_CONTEXT)


def mixed_time(prefill_tokens: int) -> float:
    """One iteration: the decode batch plus a fresh prompt of ``prefill_tokens`` tokens."""
    chunks = [(prefill_tokens, 0)] if prefill_tokens > 0 else []
    return cost_model().iteration_time(batch_shape(decode=[EX2_CONTEXT] * EX2_BATCH, prefill=chunks))


@functools.lru_cache(maxsize=None)
def doubling_expected() -> int:
    """Smallest prompt that, batched with the decodes, makes the iteration twice as long."""
    target = 2 * decode_alone_time()
    lo, hi = 0, 1
    while mixed_time(hi) < target:
        lo, hi = hi, hi * 2
    while hi - lo > 1:                      # mixed_time grows with the prompt
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if mixed_time(mid) < target else (lo, mid)
    return hi


@graded("7.2")
def check_prefill_doubling(prefill_tokens: object) -> None:
    """Exercise 7.2: 32 sequences decode at context 1,024 (Llama-3-8B, H100). What is the
    smallest prompt (in tokens, prefilled whole in the same iteration) that makes the
    iteration, hence every one of those 32 users' next token, take at least twice as long?
    A count, exact."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    expected = doubling_expected()
    t0 = decode_alone_time()
    n = read_count("prefill_tokens", prefill_tokens)
    check_exact("prefill_tokens", n, expected, mistakes=_doubling_mistakes,
                hint="Time the iteration of the 32 decodes with an n-token prompt beside them (batch_shape, "
                     "cm.iteration_time) for every n, and compare it with the decode-only iteration.")
    passed(f"Exercise 7.2: a {expected:,}-token prompt turns a {sig(t0 * 1e3)} ms decode iteration into "
           f"{sig(mixed_time(expected) * 1e3)} ms. Below ~{cost_model().ridge_tokens() - EX2_BATCH:.0f} tokens "
           "a prompt rides along almost free (the weights are read anyway); above, every prompt "
           "token adds compute time that all 32 decoding users wait for: interference.")


def _first_reaching(time_of, target: float) -> int | None:
    """The smallest n >= 1 with ``time_of(n) >= target`` (times grow with n), or None below 65,536."""
    if time_of(1 << 16) < target:
        return None
    lo, hi = 0, 1 << 16
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if time_of(mid) < target else (lo, mid)
    return hi


@functools.lru_cache(maxsize=None)
def _doubling_mistakes() -> list[tuple[float, str]]:
    """The prompts students find for 7.2 when one step of the method goes wrong."""
    cm = cost_model()
    t0 = decode_alone_time()
    expected = doubling_expected()
    found = [
        (_first_reaching(cm.prefill_time, 2 * t0),
         "That prompt *alone* takes twice a decode iteration; batched with the decodes it shares one reading "
         "of the weights. Time the prompt together with the 32 decodes."),
        (_first_reaching(mixed_time, 2 * cm.decode_time(1, EX2_CONTEXT)),
         "The decode-only iteration to compare with is the batch of 32 decodes, not one."),
        (_first_reaching(lambda n: cm.iteration_time(batch_shape(decode=[EX2_CONTEXT] * EX2_BATCH,
                                                                 prefill=[(n, EX2_CONTEXT)])), 2 * t0),
         "The prompt is new: it is prefilled from position 0, with no earlier context to attend to."),
    ]
    return [(n, hint) for n, hint in found if n is not None and n != expected]


# ---- exercise 7.3: a chunk budget that keeps every token on time ----------------------------
EX3_BATCH, EX3_CONTEXT, EX3_PROMPT, EX3_ITL_SLO = 32, 1024, 4096, 0.020


def worst_chunked_iteration(budget: int) -> float:
    """Longest iteration while a 4,096-token prompt is chunk-prefilled beside 32 decodes
    (context 1,024, held fixed) with ``budget`` tokens per iteration: decodes go first, the
    prompt fills the rest (Sarathi-Serve's stall-free batches). Later chunks attend to more
    keys, so the slowest is the last full chunk or the last, shorter one."""
    chunk = budget - EX3_BATCH
    if chunk < 1:
        raise ValueError(f"a budget of {budget} tokens leaves no room for the prompt beside {EX3_BATCH} decodes")
    full, rest = divmod(EX3_PROMPT, chunk)
    candidates = [(chunk, (full - 1) * chunk)] if full else []
    if rest:
        candidates.append((rest, full * chunk))
    cm = cost_model()
    return max(cm.iteration_time(batch_shape(decode=[EX3_CONTEXT] * EX3_BATCH, prefill=[c]))
               for c in candidates)


def worst_chunked_iteration_brute(budget: int) -> float:
    """The same, timing every chunk (what a student's loop does)."""
    chunk = budget - EX3_BATCH
    cm = cost_model()
    return max(cm.iteration_time(batch_shape(decode=[EX3_CONTEXT] * EX3_BATCH,
                                             prefill=[(min(chunk, EX3_PROMPT - start), start)]))
               for start in range(0, EX3_PROMPT, chunk))


@functools.lru_cache(maxsize=None)
def chunk_budget_expected() -> int:
    """Largest budget whose slowest iteration meets the ITL SLO (every budget is tried)."""
    ok = [b for b in range(EX3_BATCH + 1, EX3_BATCH + EX3_PROMPT + 1)
          if worst_chunked_iteration(b) <= EX3_ITL_SLO]
    if not ok:
        raise ValueError("not even one prompt token per iteration meets the SLO")
    return max(ok)


@functools.lru_cache(maxsize=None)
def _chunk_budget_mistakes() -> list[tuple[float, str]]:
    """The budgets students find for 7.3 when one step of the method goes wrong."""
    cm = cost_model()
    expected = chunk_budget_expected()
    first_chunk_only = max(b for b in range(EX3_BATCH + 1, EX3_BATCH + EX3_PROMPT + 1)
                           if cm.iteration_time(batch_shape(decode=[EX3_CONTEXT] * EX3_BATCH,
                                                            prefill=[(b - EX3_BATCH, 0)])) <= EX3_ITL_SLO)
    found = [
        (first_chunk_only, "Later chunks attend to all the earlier ones: the first chunk is the cheapest, "
                           "not the slowest. Time every chunk of the prompt."),
        (expected - EX3_BATCH, "The budget counts every token of the iteration, the 32 decodes (which go "
                               "first) included, not only the prompt's chunk."),
        (EX3_BATCH + EX3_PROMPT, "That prefills the whole prompt in one iteration: chunking is what keeps an "
                                 "iteration within the SLO."),
    ]
    return [(n, hint) for n, hint in found if n != expected]


@graded("7.3")
def check_chunk_budget(budget: object) -> None:
    """Exercise 7.3: the largest ``max_num_batched_tokens`` (decodes + prompt chunk per
    iteration) that keeps every iteration within a 20 ms ITL SLO while a 4,096-token prompt
    is chunk-prefilled beside 32 decodes at context 1,024. A count, exact."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    expected = chunk_budget_expected()
    b = read_count("budget", budget)
    if b <= EX3_BATCH:
        fail(f"budget: {b} tokens leave no room beside the {EX3_BATCH} decodes (which go first); "
             "the prompt would never advance.")
    check_exact("budget", b, expected, mistakes=_chunk_budget_mistakes,
                hint="For one budget, time every iteration of the chunked prompt (each chunk with the 32 "
                     "decodes, attending to the chunks before it) and keep the slowest; then find the largest "
                     "budget whose slowest iteration is within 20 ms.")
    chunk = expected - EX3_BATCH
    passed(f"Exercise 7.3: a budget of {expected:,} tokens ({chunk:,}-token chunks, "
           f"{math.ceil(EX3_PROMPT / chunk)} iterations for the prompt) keeps every iteration ≤ "
           f"{EX3_ITL_SLO * 1e3:.0f} ms; unchunked, this prompt's iteration would take "
           f"{sig(mixed_time_for(EX3_PROMPT) * 1e3)} ms. The cost: the prompt's TTFT grows by the extra "
           "iterations, and each chunk re-reads the weights.")


def mixed_time_for(prompt: int) -> float:
    return cost_model().iteration_time(batch_shape(decode=[EX3_CONTEXT] * EX3_BATCH, prefill=[(prompt, 0)]))


# ---- exercise 7.4: how many prefill and decode instances --------------------------------------
@dataclass(frozen=True)
class PlanProblem:
    """A DistServe-style provisioning question, with its numbers."""

    rate: float = 30.0           # requests/s, Poisson
    prompt_len: int = 2048
    output_len: int = 256
    ttft_slo_s: float = 0.100    # on the *mean* TTFT (M/D/1 queue)
    tpot_slo_s: float = 0.025
    block_size: int = 16


PROBLEM = PlanProblem()


@dataclass(frozen=True)
class Plan:
    prefill_time_s: float        # one prompt, alone on an instance
    num_prefill: int
    decode_batch: int            # largest batch meeting the TPOT SLO that fits in the KV cache
    decode_batch_memory: int     # largest batch the KV cache alone allows
    decode_tok_per_s: float      # one decode instance at that batch
    num_decode: int


def md1_ttft(rate: float, service_s: float) -> float:
    """Mean time in an M/D/1 queue (Poisson arrivals, fixed service time): the service time
    plus the mean wait ``rate·D² / (2(1 - rate·D))``; infinite when the server is saturated."""
    rho = rate * service_s
    return math.inf if rho >= 1 else service_s + rate * service_s ** 2 / (2 * (1 - rho))


@functools.lru_cache(maxsize=None)
def plan_expected(problem: PlanProblem = PROBLEM) -> Plan:
    cm = cost_model()
    d = cm.prefill_time(problem.prompt_len)
    n_p = 1
    while md1_ttft(problem.rate / n_p, d) > problem.ttft_slo_s:
        n_p += 1
    context = problem.prompt_len + problem.output_len          # the worst case: the last token
    by_memory = cm.kv_cache_blocks(problem.block_size) * problem.block_size // context
    batch = 0
    while batch < by_memory and cm.decode_time(batch + 1, context) <= problem.tpot_slo_s:
        batch += 1
    if batch == 0:
        raise ValueError("not even one sequence meets the TPOT SLO")
    tok_per_s = batch / cm.decode_time(batch, context)
    n_d = math.ceil(problem.rate * (problem.output_len - 1) / tok_per_s)
    return Plan(d, n_p, batch, by_memory, tok_per_s, n_d)


@functools.lru_cache(maxsize=None)
def _plan_mistakes(problem: PlanProblem = PROBLEM) -> tuple[list[tuple[float, str]], list[tuple[float, str]]]:
    """(prefill, decode) pool sizes students give for 7.4 when one step goes wrong, with hints."""
    cm = cost_model()
    plan = plan_expected(problem)
    prefill = [(math.ceil(problem.rate * plan.prefill_time_s),
                "That many instances keep up on average, but Poisson arrivals queue: the SLO is on the mean "
                "TTFT, which includes the time a prompt waits (M/D/1).")]
    context = problem.prompt_len + problem.output_len

    def pool(batch: int, tokens_per_request: int, at: int = context) -> int:
        return math.ceil(problem.rate * tokens_per_request / (batch / cm.decode_time(batch, at)))

    at_prompt = 0
    while (at_prompt < plan.decode_batch_memory
           and cm.decode_time(at_prompt + 1, problem.prompt_len) <= problem.tpot_slo_s):
        at_prompt += 1
    decode = [
        (pool(plan.decode_batch_memory, problem.output_len - 1),
         "The KV memory is one limit on the decode batch; the TPOT SLO is another, at the longest context."),
        (pool(plan.decode_batch, problem.output_len),
         "The first output token comes from the prefill instance: the decode pool produces the rest."),
        (pool(at_prompt, problem.output_len - 1, problem.prompt_len),
         "Size the batch for the longest context a sequence reaches, prompt and output: that is where its "
         "iteration is slowest."),
        (math.ceil(problem.rate * (problem.output_len - 1) / plan.decode_batch),
         "That divides tokens per second by sequences: an instance produces a batch's worth of tokens per "
         "iteration, so its rate is the batch over the iteration's time."),
        (math.ceil((problem.output_len - 1) / plan.decode_tok_per_s),
         "That is one request's tokens; the pool must produce the tokens of every request that arrives in a "
         "second."),
    ]
    return ([(n, h) for n, h in prefill if n != plan.num_prefill],
            [(n, h) for n, h in decode if n != plan.num_decode])


@graded("7.4")
def check_instance_plan(num_prefill: object, num_decode: object) -> None:
    """Exercise 7.4: Poisson arrivals at 30 requests/s, every prompt 2,048 tokens and every
    output 256 tokens, Llama-3-8B on H100s; SLOs: mean TTFT ≤ 100 ms, TPOT ≤ 25 ms. How many
    prefill and how many decode instances (one GPU each)? Two counts, exact."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    p = PROBLEM
    plan = plan_expected(p)
    n_p = read_count("num_prefill", num_prefill)
    n_d = read_count("num_decode", num_decode)
    for name, n in (("num_prefill", n_p), ("num_decode", n_d)):
        if n < 1:
            fail(f"{name}: a disaggregated deployment needs at least one instance in each pool, got {n}.")
    check_exact("num_prefill", n_p, plan.num_prefill, mistakes=lambda: _plan_mistakes(p)[0],
                hint="Step 1: with the load split over n instances, each is an M/D/1 queue; find the smallest n "
                     "whose mean TTFT (the prefill time plus the mean wait) meets the SLO.")
    check_exact("num_decode", n_d, plan.num_decode, mistakes=lambda: _plan_mistakes(p)[1],
                hint="Step 2: the decode batch one instance can run (both limits: the TPOT SLO at the longest "
                     "context, and the KV memory), the tokens per second that batch produces, and the tokens "
                     "per second the pool must produce.")
    naive_p = math.ceil(p.rate * plan.prefill_time_s)
    ttft_ms, naive_ms = (sig(md1_ttft(p.rate / n, plan.prefill_time_s) * 1e3) for n in (plan.num_prefill, naive_p))
    passed(f"Exercise 7.4: prefill takes {sig(plan.prefill_time_s * 1e3)} ms per prompt → {plan.num_prefill} "
           f"prefill instances (M/D/1 mean TTFT {ttft_ms} ms; {naive_p} would be {naive_ms} ms); decode batch "
           f"{plan.decode_batch} (TPOT-bound; memory allows {plan.decode_batch_memory}) gives "
           f"{plan.decode_tok_per_s:,.0f} tokens/s per instance → {plan.num_decode} decode instances. "
           f"{plan.num_prefill}P + {plan.num_decode}D: simulate it to see the tail.")


__all__ = ["cost_model", "check_ridge_point", "check_prefill_doubling", "check_chunk_budget",
           "check_instance_plan", "PlanProblem", "PROBLEM", "Plan", "plan_expected", "md1_ttft",
           "worst_chunked_iteration", "worst_chunked_iteration_brute", "mixed_time", "decode_alone_time"]


def answer_forms() -> dict[str, list[str]]:
    """What would give each exercise's answer away if a student saw it before the check
    (``tests/test_answer_leaks.py`` scans the student notebooks and the hints for it)."""
    ridge, plan = ridge_expected(), plan_expected()
    p, d = plan.num_prefill, plan.num_decode
    return {
        "7.1": [f"{ridge:.0f} tokens", f"{ridge:.1f}", f"{ridge:.2f}"] + number_forms(ridge),
        "7.2": sorted({f"{doubling_expected()}", f"{doubling_expected():,}"}),
        "7.3": sorted({f"{chunk_budget_expected()}", f"{chunk_budget_expected():,}"}),
        "7.4": [f"{p}P+{d}D", f"{p}P + {d}D", f"{p} prefill and {d} decode",
                f"disaggregated({p}, {d}", f"num_prefill, num_decode = {p}, {d}"],
    }
