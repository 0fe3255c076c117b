"""How many points each exercise is worth: declared once, here, beside the graders.

Keys are the exercise ids of the notebooks' check cells (``# CHECK exercise 2.1`` -> "2.1");
``python -m labkit.grade`` adds them up per notebook, and the test suite checks that every
check cell in ``solutions/`` has an entry here and every entry a check cell.

The weights follow the work an exercise asks for: one point for a single piece of arithmetic,
two for a multi-part answer or a measurement, three for code that must be right in general
(a test that catches a bug, a kernel step, a plan). Change them freely: grading reads them
at run time.
"""

from __future__ import annotations

POINTS: dict[str, int] = {
    # 00 setup and tour
    "0.1": 1,   # KV capacity and bytes per token of the loaded engine
    "0.2": 1,   # iterations of a 4-request batch, predicted and measured
    # 01 the KV cache
    "1.1": 1,   # Llama-3-70B bytes per token
    "1.2": 1,   # one 4096-token request, and how many fit in 45 GB
    "1.3": 1,   # reservation waste
    # 02 paging
    "2.1": 1,   # internal fragmentation of one request
    "2.2": 3,   # bug hunt: a test that generated tokens get slots
    "2.3": 3,   # bug hunt: a test that allocation does not slow with the pool size
    "2.4": 3,   # bug hunt: a test that shared blocks survive a free
    # 03 sharing
    "3.1": 2,   # copy-on-write copies of an n=4 fork
    "3.2": 1,   # prefix-cache reuse
    "3.3": 2,   # 500 sessions sharing a prompt, and why they may
    # 04 continuous batching
    "4.1": 1,   # one static batch: iterations and busy share
    "4.2": 2,   # the pool size from which no larger pool preempts
    "4.3": 2,   # speedup under the CPU and GPU cost models
    # 05 the Triton kernel
    "5.1": 2,   # slot mapping
    "5.2": 3,   # the online-softmax step
    "5.3": 3,   # one sequence's paged decode
    # 06 end to end
    "6.1": 1,   # measured speedup over static batching
    "6.2": 2,   # prefix-cache savings, predicted then measured
    "6.3": 2,   # what min-p keeps at temperature 0.5, from the engine's logprobs
    # 07 disaggregation
    "7.1": 1,   # the roofline's ridge point
    "7.2": 2,   # prefill tokens that double a decode step
    "7.3": 2,   # chunked-prefill budget
    "7.4": 3,   # prefill and decode instances for a latency target
    # 08 online serving
    "8.1": 1,   # median time to first token
    "8.2": 2,   # which requests joined a running batch
    # 09 beams and swaps
    "9.1": 2,   # blocks held by a beam search after forks and deaths, and its copies
    "9.2": 1,   # the saving of parallel sampling for two widths
    "9.3": 2,   # the block size from which swapping beats recomputation
    # 10 prefix caching: hash blocks vs a radix tree
    "10.1": 2,  # tokens a chat's second turn reuses under three caches
    "10.2": 2,  # the radix tree's next three eviction victims
    # 11 speculative decoding
    "11.1": 2,  # a verify step on the block table: blocks during and after, slots given back
    "11.2": 1,  # the expected tokens per verifying step and speedup, from the formula
    "11.3": 2,  # the batch size from which speculation stops paying, in a cost model
    # 12 structured outputs
    "12.1": 2,  # the tokens a grammar allows next over a toy vocabulary, after three texts
    "12.2": 3,  # a token walked through an automaton
    "12.3": 2,  # a jump-forward step on the block table: blocks during and after, tokens gained
    # 13 memory tiers: a quantized KV cache and a host tier
    "13.1": 2,  # bytes per token in bf16 and int8 with scales, and the tokens ratio
    "13.2": 2,  # copy a document back over PCIe or recompute it: time, break-even bandwidth
    "13.3": 2,  # a loop of documents larger than the cache: tokens computed without and with a tier
}


def points(exercise: str) -> int:
    """The weight of ``exercise`` ("2.1"); a clear error for an id nobody declared."""
    try:
        return POINTS[exercise]
    except KeyError:
        raise KeyError(f"exercise {exercise!r} has no points in labkit/exercises/points.py; "
                       f"add it there (declared: {', '.join(POINTS)})") from None
