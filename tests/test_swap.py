"""Preemption by swapping (issue 16): a victim's KV blocks go to a host pool and come back.

The anchor: greedy tokens under swap equal those under recompute and those with no
preemption at all, on the real model and on tiny-llama, with pools small enough to force
many preemptions; and nothing is lost in either pool, whatever ends a request.
"""

from __future__ import annotations

import random

import pytest
import torch

from labkit import LLM, SamplingParams
from labkit.engine import Engine
from labkit.memory import BlockAllocator
from labkit.model.kv_cache import KVCache, swap_blocks
from labkit.request import Status
from labkit.scheduler import Scheduler, make_scheduler
from labkit.sim import SimExecutor


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def check_pools(scheduler: Scheduler) -> None:
    """Both pools keep their invariants, and every reference count is exactly the number of
    block tables holding the block: running tables on the device, swapped ones on the host."""
    pools = [(scheduler.allocator, scheduler.sequences_holding_blocks())]
    if scheduler.host_allocator is not None:
        pools.append((scheduler.host_allocator, list(scheduler.swapped)))
    for alloc, seqs in pools:
        alloc.check_invariants()
        holders: dict[int, int] = {}
        for seq in seqs:
            assert seq.block_table.allocator is alloc, f"{seq} holds blocks of the wrong pool"
            assert seq.block_table.num_tokens == seq.num_computed_tokens or seq.status is Status.RUNNING
            for b in seq.block_table.block_ids:
                holders[b] = holders.get(b, 0) + 1
        for b in range(alloc.num_blocks):
            assert alloc.ref_count(b) == holders.get(b, 0), f"block {b}: refcount != holders"
    for seq in scheduler.swapped:
        assert seq.status is Status.SWAPPED and seq.num_computed_tokens > 0


def drain(llm_or_engine, check=True) -> None:
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    while engine.has_unfinished:
        engine.step()
        if check:
            check_pools(engine.scheduler)


def assert_both_pools_free(scheduler: Scheduler) -> None:
    check_pools(scheduler)
    assert scheduler.allocator.num_used_blocks == 0, "device blocks leaked"
    if scheduler.host_allocator is not None:
        assert scheduler.host_allocator.num_used_blocks == 0, "host blocks leaked"
    assert not scheduler.swapped and not scheduler.has_unfinished


def run(llm: LLM, prompts, params) -> list[list[list[int]]]:
    """Every sample's tokens, stepping by hand so that the pools are checked every iteration."""
    requests = [llm.engine.add_request(p if isinstance(p, list) else llm.tokenizer.encode(p), params)
                for p in prompts]
    drain(llm)
    assert_both_pools_free(llm.scheduler)
    out = [[list(s.output_token_ids) for s in r.seqs] for r in requests]
    for r in requests:
        llm.engine.release(r)
    return out


# ---- the real model: swap == recompute == no preemption ---------------------------------
REAL_PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:",
    "To make a good cup of tea, you",
    "The three primary colors are",
]


@pytest.mark.slow
def test_real_model_greedy_tokens_equal_under_swap_recompute_and_none():
    params = greedy(24)
    ample = LLM("smollm2-135m", num_blocks=64, block_size=4)
    want = run(ample, REAL_PROMPTS, params)
    assert ample.stats()["num_preemptions"] == 0
    del ample
    for mode in ("recompute", "swap"):
        # 12 blocks of 4 tokens: room for about two of the four sequences at once.
        llm = LLM("smollm2-135m", num_blocks=12, block_size=4, preemption_mode=mode, num_host_blocks=64)
        assert run(llm, REAL_PROMPTS, params) == want, mode
        stats = llm.stats()
        assert stats["num_preemptions"] >= 4, stats
        if mode == "swap":
            assert stats["num_swap_outs"] == stats["num_preemptions"] and stats["num_swap_fallbacks"] == 0
            assert stats["num_swap_ins"] == stats["num_swap_outs"]
            assert stats["num_swapped_blocks_out"] == stats["num_swapped_blocks_in"] > 0
            assert stats["swap_s"] > 0
        else:
            assert stats["num_swap_outs"] == 0 and stats["num_host_blocks"] == 0


# ---- tiny-llama: every feature that meets preemption ------------------------------------
@pytest.fixture(scope="module")
def tiny_prompts():
    rng = random.Random(1)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in (3, 9, 17, 6, 25, 12)]


def tiny(mode="swap", num_blocks=14, **kw) -> LLM:
    kw.setdefault("block_size", 4)
    kw.setdefault("max_num_batched_tokens", 32)
    if mode == "swap":
        kw.setdefault("num_host_blocks", 64)
    return LLM("tiny-llama", num_blocks=num_blocks, preemption_mode=mode, **kw)


def test_tiny_swap_equals_recompute_equals_no_preemption(tiny_prompts):
    params = greedy(24)
    want = run(tiny("recompute", num_blocks=256), tiny_prompts, params)
    for mode in ("recompute", "swap"):
        llm = tiny(mode)
        assert run(llm, tiny_prompts, params) == want, mode
        assert llm.stats()["num_preemptions"] >= 4
    records = llm.engine.records
    assert any(r.swapped_out for r in records) and any(r.swapped_in for r in records)
    assert max(r.num_swapped for r in records) > 0 and records[-1].num_swapped == 0


def test_full_host_pool_falls_back_to_recompute_and_stays_exact(tiny_prompts):
    params = greedy(24)
    want = run(tiny("recompute", num_blocks=256), tiny_prompts, params)
    llm = tiny(num_host_blocks=3)             # room for about one victim
    assert run(llm, tiny_prompts, params) == want
    stats = llm.stats()
    assert stats["num_swap_fallbacks"] > 0 and stats["num_swap_outs"] > 0
    assert stats["num_preemptions"] == stats["num_swap_outs"] + stats["num_swap_fallbacks"]


def test_parallel_samples_share_host_blocks_and_stay_exact(tiny_prompts):
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=7, n=3, ignore_eos=True)
    want = run(tiny("recompute", num_blocks=512), tiny_prompts[:4], params)
    llm = tiny(num_blocks=24, max_num_seqs=12)
    shared = 0
    requests = [llm.engine.add_request(p, params) for p in tiny_prompts[:4]]
    while llm.engine.has_unfinished:
        llm.engine.step()
        check_pools(llm.scheduler)
        host = llm.scheduler.host_allocator
        shared = max([shared] + [host.ref_count(b) for s in llm.scheduler.swapped for b in s.block_table.block_ids])
    assert [[s.output_token_ids for s in r.seqs] for r in requests] == want
    assert llm.stats()["num_swap_outs"] > 0
    assert shared > 1, "siblings swapped together should share their prefix's host copy"
    assert_both_pools_free(llm.scheduler)


def test_beam_search_under_swap_equals_no_preemption(tiny_prompts):
    from labkit import BeamSearchParams
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)

    def beams(llm):
        outs = llm.beam_search(tiny_prompts[:4], params)
        assert_both_pools_free(llm.scheduler)
        return [[(s.output_token_ids, s.cum_logprob) for s in o.sequences] for o in outs]

    def tokens(result):
        return [[t for t, _ in seqs] for seqs in result]

    def logprobs(result):
        return [lp for seqs in result for _, lp in seqs]
    want = beams(tiny("recompute", num_blocks=512))
    for host_blocks in (64, 3):         # room for every beam group; for none: beams swap all or none
        llm = tiny(num_blocks=24, max_num_seqs=12, num_host_blocks=host_blocks)
        got = beams(llm)
        assert tokens(got) == tokens(want), host_blocks
        # A group that falls back to recomputation re-prefills its K/V in one batched pass, not
        # token by token: the same maths, rounded in another order (fp32), so the scores agree
        # to float rounding, not bit for bit.
        assert logprobs(got) == pytest.approx(logprobs(want), abs=1e-3), host_blocks
        stats = llm.stats()
        assert stats["num_swap_outs" if host_blocks == 64 else "num_swap_fallbacks"] > 0, stats


def test_prefix_caching_with_swap_is_exact_and_registrations_stay_true(tiny_prompts):
    system = list(range(100, 124))          # 6 blocks of 4 tokens, shared by every prompt
    prompts = [system + p for p in tiny_prompts]
    params = greedy(16)
    want = run(tiny("recompute", num_blocks=512, enable_prefix_caching=False), prompts, params)
    llm = tiny(num_blocks=40, enable_prefix_caching=True)
    assert run(llm, prompts, params) == want
    assert llm.stats()["prefix_cache_hit_rate"] > 0 and llm.stats()["num_swap_outs"] > 0
    # Whatever the cache now holds is true: a second run, served from it, gives the same tokens.
    assert run(llm, prompts, params) == want


def test_chunked_prefill_victims_swap_mid_prompt(tiny_prompts):
    prompts = [p * 3 for p in tiny_prompts]          # long prompts, chunks of 8 tokens
    params = greedy(12)
    want = run(tiny("recompute", num_blocks=512), prompts, params)
    llm = tiny(num_blocks=30, max_num_batched_tokens=8)
    assert run(llm, prompts, params) == want
    assert llm.stats()["num_swap_outs"] > 0


def test_stop_strings_under_swap(tiny_prompts):
    ample = tiny("recompute", num_blocks=256)
    probe = ample.generate(tiny_prompts, greedy(24), use_tqdm=False)
    stops = [o.outputs[0].text[6:9] or "x" for o in probe]
    want = ample.generate(tiny_prompts, [greedy(24, stop=[s]) for s in stops], use_tqdm=False)
    llm = tiny()
    got = llm.generate(tiny_prompts, [greedy(24, stop=[s]) for s in stops], use_tqdm=False)
    assert [(o.outputs[0].text, o.outputs[0].finish_reason) for o in got] == \
        [(o.outputs[0].text, o.outputs[0].finish_reason) for o in want]
    assert any(o.outputs[0].finish_reason == "stop" for o in got)
    assert llm.stats()["num_swap_outs"] > 0
    assert_both_pools_free(llm.scheduler)


def test_aborting_a_swapped_request_frees_its_host_blocks(tiny_prompts):
    llm = tiny()
    engine = llm.engine
    requests = [engine.add_request(p, greedy(24)) for p in tiny_prompts]
    while not engine.scheduler.swapped:
        engine.step()
        check_pools(engine.scheduler)
    victim = engine.scheduler.swapped[0].request
    host = engine.scheduler.host_allocator
    assert host.num_used_blocks > 0
    assert engine.abort(victim.request_id)
    check_pools(engine.scheduler)
    assert all(s.status is Status.FINISHED and s.finish_reason == "abort" for s in victim.seqs)
    assert victim not in {s.request for s in engine.scheduler.swapped}
    drain(engine)
    assert all(r.finished for r in requests)
    assert_both_pools_free(engine.scheduler)


def test_static_policy_accepts_swap_mode_and_never_preempts(tiny_prompts):
    want = run(tiny("recompute", num_blocks=256), tiny_prompts, greedy(12))
    llm = LLM("tiny-llama", policy="static", num_blocks=64, block_size=8, preemption_mode="swap",
              num_host_blocks=8)
    assert llm.scheduler.host_allocator is None      # it reserves up front: nothing to swap
    assert run(llm, tiny_prompts, greedy(12)) == want
    assert llm.stats()["num_preemptions"] == 0


# ---- the simulator: the same scheduler, dummy tokens, a modelled copy cost ---------------
def test_simulator_swaps_exactly_and_charges_the_copies():
    def serve(mode: str, num_blocks: int):
        alloc = BlockAllocator(num_blocks, 4)
        sched = make_scheduler("continuous", alloc, preemption_mode=mode, num_host_blocks=64,
                               max_num_batched_tokens=32)
        engine = Engine(sched, SimExecutor(vocab_size=100))
        rng = random.Random(0)
        reqs = [engine.add_request([rng.randrange(100) for _ in range(rng.randint(3, 20))],
                                   greedy(rng.randint(5, 30))) for _ in range(8)]
        drain(engine)
        assert_both_pools_free(sched)
        return [r.seqs[0].token_ids for r in reqs], engine
    want, _ = serve("recompute", 400)
    got, engine = serve("swap", 24)
    assert got == want
    swaps = [r for r in engine.records if r.swapped_out or r.swapped_in]
    assert swaps and engine.scheduler.num_swapped_blocks_out > 0
    executor = engine.executor
    assert executor.num_swapped_blocks == 2 * engine.scheduler.num_swapped_blocks_out
    assert executor.swap_s > 0


# ---- the block copies themselves --------------------------------------------------------
@pytest.mark.parametrize("granularity", ["gather", "layer"])
def test_swap_blocks_moves_every_layer_between_pools(granularity):
    device = KVCache(3, 6, 4, 2, 8)
    device.data.normal_()
    host = device.host_pool(5)
    assert host.data.device.type == "cpu" and host.data.shape[2] == 5
    before = device.data.clone()
    swap_blocks(device, host, [(1, 4), (3, 0)], granularity)
    device.data.zero_()
    swap_blocks(host, device, [(4, 2), (0, 5)], granularity)
    assert torch.equal(device.data[:, :, 2], before[:, :, 1])
    assert torch.equal(device.data[:, :, 5], before[:, :, 3])
    assert torch.count_nonzero(device.data[:, :, [0, 1, 3, 4]]) == 0


def test_swap_link_model_small_blocks_pay_per_transfer():
    """The paper's explanation of Figure 19: with vLLM v0's per-layer copies, small blocks
    mean many small transfers, and the link's effective bandwidth collapses."""
    from labkit.sim.roofline import HOST_LINKS, roofline
    a100, h100 = roofline("llama-2-13b", "a100-80gb"), roofline("llama-2-13b", "h100-sxm")
    assert a100.model.num_params == 13_015_864_320                         # Llama-2-13B, published
    assert (a100.swap_link.name, h100.swap_link.name) == ("pcie4-x16", "pcie5-x16")
    link = a100.swap_link
    assert link.transfers_per_block == 2 * 40 and link.kv_bytes_per_token == 2 * 40 * 5120 * 2
    tokens = 1024
    times = [link.copy_time(tokens // bs, bs) for bs in (8, 16, 64, 256)]
    assert times == sorted(times, reverse=True) and times[0] > 2 * times[-1]
    bandwidth, latency = HOST_LINKS["pcie4-x16"]
    big = tokens // 256
    assert times[-1] == pytest.approx(big * 80 * latency + tokens * link.kv_bytes_per_token / bandwidth)
    assert link.effective_bandwidth(8) < link.effective_bandwidth(256) < bandwidth
    assert h100.swap_link.copy_time(4, 256) < link.copy_time(4, 256)
    assert link.copy_time(0, 16) == 0.0
    # This machine's memcpy is measured once and cached.
    cpu = roofline("smollm2-135m", "cpu-2core").swap_link
    assert cpu.bandwidth > 1e8 and cpu.name == "cpu-memcpy"
    assert roofline("smollm2-135m", "cpu-2core").swap_link == cpu


def test_swap_benchmark_reproduces_figure_19s_shape(capsys):
    import json

    from labkit.bench.swap import main
    assert main(["--parts", "micro,sim", "--block-sizes", "8,64", "--num-requests", "40", "--rate", "40",
                 "--kv-tokens", "2048", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    micro = out["micro"]["rows"]
    assert micro[0]["swap_in_out_ms"] > micro[1]["swap_in_out_ms"]          # small blocks pay per transfer
    assert micro[0]["recompute_ms"] == micro[1]["recompute_ms"]             # recompute ignores blocks
    rows = {(r["block_size"], r["mode"]): r for r in out["sim"]["rows"]}
    assert all(r["leaked_blocks"] == 0 and r["num_preemptions"] > 0 for r in rows.values())
    assert rows[8, "swap"]["num_swap_outs"] > 0 and rows[8, "recompute"]["recomputed_tokens"] > 0
    assert rows[8, "swap"]["overhead_s"] / rows[8, "swap"]["num_swap_outs"] > \
        rows[64, "swap"]["overhead_s"] / rows[64, "swap"]["num_swap_outs"]
    assert main(["--parts", "nope"]) == 2


# ---- bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    (dict(preemption_mode="swapping"), "preemption_mode"),
    (dict(preemption_mode="swap", swap_space=-1.0), "swap_space"),
    (dict(preemption_mode="swap", swap_space=float("nan")), "swap_space"),
    (dict(preemption_mode="swap", swap_space=2.0**40), "host memory"),
    (dict(preemption_mode="swap", swap_space=1e-9), "holds no KV block"),
    (dict(preemption_mode="swap", num_host_blocks=0), "num_host_blocks"),
])
def test_bad_swap_settings_are_refused_clearly(kw, match):
    with pytest.raises(ValueError, match=match):
        LLM("tiny-llama", num_blocks=16, block_size=4, **kw)


def test_scheduler_refuses_swap_without_a_host_pool():
    with pytest.raises(ValueError, match="num_host_blocks"):
        make_scheduler("continuous", BlockAllocator(8, 4), preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode"):
        make_scheduler("static", BlockAllocator(8, 4), preemption_mode="host")


# ---- seeded mixes of beam search, n > 1 and plain requests (the review's workloads) ------
def mixed_requests(seed: int, num: int = 10) -> list[tuple[list[int], object]]:
    """Half beam search (any width, EOS live or not, every early-stopping mode), a quarter
    n > 1 sampling, a quarter plain: the random mixes that found the bugs tested below."""
    from labkit import BeamSearchParams
    rng = random.Random(seed)
    out: list[tuple[list[int], object]] = []
    for j in range(num):
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 25))]
        kind = rng.random()
        if kind < 0.5:
            params: object = BeamSearchParams(rng.randrange(1, 5), rng.randrange(1, 20), ignore_eos=rng.random() < 0.5,
                                              length_penalty=rng.choice([1.0, 0.0, 2.0, -1.0]),
                                              early_stopping=rng.choice([False, True, "never"]))
        elif kind < 0.75:
            params = SamplingParams(max_tokens=rng.randrange(1, 20), n=rng.randrange(1, 4), temperature=1.0,
                                    seed=j, ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=rng.randrange(1, 20), temperature=0, ignore_eos=rng.random() < 0.5)
        out.append((prompt, params))
    return out


def serve_mix(seed: int, num_blocks: int = 24, **kw) -> Scheduler:
    """Serve ``mixed_requests(seed)`` in the simulator, arrivals trickling in, both pools
    checked every iteration; every request must finish and leave both pools free."""
    kw = {"max_num_seqs": 16, "max_num_batched_tokens": 64, "max_model_len": 512, **kw}
    sched = make_scheduler("continuous", BlockAllocator(num_blocks, 4), **kw)
    engine = Engine(sched, SimExecutor(vocab_size=1000))
    rng = random.Random(seed * 7 + 1)
    pending = mixed_requests(seed)
    while pending or engine.has_unfinished:
        while pending and (not engine.has_unfinished or rng.random() < 0.8):
            prompt, params = pending.pop(0)
            try:
                engine.add_request(prompt, params)
            except ValueError:
                pass                             # can never fit this pool: refused, as it should
        if engine.has_unfinished:
            engine.step()                        # raises if the scheduler plans nothing (a hang)
            check_pools(sched)
            assert engine.num_steps < 3000, "no progress"
    assert_both_pools_free(sched)
    return sched


@pytest.mark.parametrize("seed", [4, 8, 117])
def test_beams_swap_back_in_together_within_a_small_token_budget(seed):
    """Budget 12 tokens, host pool 10 blocks. These seeds once admitted a beam with no chunk
    (its siblings used the budget) and, preempted, "swapped" it with no KV at all
    (check_pools asserts swapped => num_computed_tokens > 0); in seeds 8 and 117 its group
    then came back from host memory partly, one beam alone, which waited for siblings
    that could never follow (the scheduler then planned nothing)."""
    sched = serve_mix(seed, preemption_mode="swap", num_host_blocks=10, max_num_batched_tokens=12)
    assert sched.num_swap_ins > 0
    assert sched.num_preemptions == sched.num_swap_outs + sched.num_swap_fallbacks


def test_a_beam_swapped_in_may_compute_nothing_but_comes_back_with_its_siblings():
    """The swap-in plan of a beam group under a budget too small for every beam: the first
    beams take the tokens, the last plans 0 and comes back all the same (all or none)."""
    from labkit import BeamSearchParams
    sched = make_scheduler("continuous", BlockAllocator(64, 4), preemption_mode="swap", num_host_blocks=64)
    engine = Engine(sched, SimExecutor(vocab_size=1000))
    req = engine.add_request(list(range(3)), BeamSearchParams(3, 8, ignore_eos=True))
    while len(req.live_beams) < 3:
        engine.step()
    beams = list(req.live_beams)                 # each owes the token it just took
    assert [b.num_uncomputed_tokens for b in beams] == [1, 1, 1]
    assert sched.swapper.plan_swap_in(beams, 2) == [1, 1, 0]
    assert sched.swapper.plan_swap_in(beams, 3) == [1, 1, 1]


@pytest.mark.parametrize("when", ["swapped_in", "swapped_out"])
def test_aborts_between_schedule_and_update_of_a_swap(when):
    """The async server aborts while a batch runs: here, the requests this very iteration
    swaps in (or out). update() must skip them (a beam request swapped in had no live beam
    left for its beam step: IndexError), and nothing may leak from either pool."""
    hits = 0
    for seed in range(12):
        sched = make_scheduler("continuous", BlockAllocator(24, 4), max_model_len=512, max_num_batched_tokens=64,
                               preemption_mode="swap", num_host_blocks=60)
        engine = Engine(sched, SimExecutor(vocab_size=1000))
        for prompt, params in mixed_requests(seed):
            try:
                engine.add_request(prompt, params)
            except ValueError:
                pass
        while engine.has_unfinished:
            plan = sched.schedule(engine.now)
            assert not plan.is_empty and sched.step < 3000
            victims = {s.request.request_id for s in getattr(plan, when)}
            hits += sum(sched.requests[r].beam is not None for r in victims)
            for rid in victims:
                sched.abort(rid)
            result = engine.executor.execute(plan)
            sched.update(plan, result.sampled, engine.now, logprobs=result.logprobs)
            check_pools(sched)
        assert_both_pools_free(sched)
    assert hits > 0, "no beam request was aborted mid-swap: the test tests nothing"


@pytest.mark.slow
def test_swap_benchmark_measures_the_real_engine_at_two_block_sizes(capsys):
    """The benchmark's ``real`` part (the README runs it on SmolLM2 at 16 and 128), here on
    tiny-llama: a pool small enough that both modes preempt at both sizes, swap moving blocks
    and recompute recomputing tokens, with the same greedy tokens either way."""
    import json

    from labkit.bench.swap import main
    assert main(["--parts", "real", "--real-model", "tiny-llama", "--real-block-sizes", "16,128",
                 "--real-prompts", "4", "--real-max-tokens", "48", "--real-kv-tokens", "192", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["real"]
    rows = {(r["block_size"], r["mode"]): r for r in out["rows"]}
    assert sorted(rows) == [(16, "recompute"), (16, "swap"), (128, "recompute"), (128, "swap")]
    for (bs, mode), r in rows.items():
        assert r["same_tokens"] is True and r["num_preemptions"] > 0 and r["wall_s"] > 0, (bs, mode, r)
        assert r["leaked_blocks"] == 0, (bs, mode, r)
        if mode == "swap":
            assert r["num_swapped_blocks"] > 0 and r["swap_s"] > 0 and r["recomputed_tokens"] == 0, (bs, r)
        else:
            assert r["num_swapped_blocks"] == 0 and r["swap_s"] == 0 and r["recomputed_tokens"] > 0, (bs, r)
    # Without --json, the same part as a table (one block size: the columns, each mode a row).
    assert main(["--parts", "real", "--real-model", "tiny-llama", "--real-block-sizes", "16",
                 "--real-prompts", "4", "--real-max-tokens", "48", "--real-kv-tokens", "192"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("== real: ") and "same_tokens" in printed[1]
    assert [line.split()[:2] for line in printed[2:4]] == [["16", "recompute"], ["16", "swap"]]
    assert all(line.split()[-1] == "True" for line in printed[2:4])
    # A pool that cannot hold one request is refused with the flag to raise, not served wrong.
    with pytest.warns(UserWarning, match="request rejected"):
        assert main(["--parts", "real", "--real-model", "tiny-llama", "--real-block-sizes", "16",
                     "--real-prompts", "2", "--real-max-tokens", "8", "--real-kv-tokens", "32"]) == 2
    assert "--real-kv-tokens" in capsys.readouterr().err
