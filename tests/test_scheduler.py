"""The scheduler under random workloads: budgets, memory invariants, FCFS, nothing lost."""

from __future__ import annotations

import collections

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from labkit.engine import Engine
from labkit.memory import BlockAllocator
from labkit.request import Request, Status
from labkit.sampling_params import SamplingParams
from labkit.scheduler import Scheduler, StaticScheduler
from labkit.sim import SimExecutor, dummy_token


def check_step(engine: Engine, plan) -> None:
    """Invariants that must hold right after schedule() (before the executor runs)."""
    sched = engine.scheduler
    alloc = sched.allocator
    alloc.check_invariants()
    assert len(plan.scheduled) <= sched.max_num_seqs
    assert sched.num_running <= sched.max_num_seqs
    assert plan.num_tokens <= sched.max_num_batched_tokens
    # Reference counts equal the number of live tables holding each block.
    holders = collections.Counter()
    for seq in sched.running + getattr(sched, "_held", []):
        assert seq.block_table is not None and not seq.block_table.freed
        holders.update(seq.block_table.block_ids)
    for block_id in range(alloc.num_blocks):
        assert alloc.ref_count(block_id) == holders[block_id], block_id
    # Nobody writes into a block another live table holds (copy-on-write did its job).
    bs = alloc.block_size
    for item in plan.scheduled:
        table = item.seq.block_table
        assert table.num_tokens == item.num_computed_tokens + item.num_new_tokens
        for b in range(item.num_computed_tokens // bs, (item.num_computed_tokens + item.num_new_tokens - 1) // bs + 1):
            assert alloc.ref_count(table.block_ids[b]) == 1, (item.seq, b)
    for seq in sched.waiting:
        assert seq.block_table is None and seq.status is Status.WAITING


def run_checked(engine: Engine, arrivals: dict[int, list], aborts: dict[int, list[str]], max_steps=5000):
    """Drive the engine step by step, adding and aborting requests at given steps."""
    sched = engine.scheduler
    first_admitted: dict[str, int] = {}
    step = 0
    while step < max_steps and (sched.has_unfinished or any(k >= step for k in arrivals)):
        for args in arrivals.get(step, []):
            engine.add_request(*args)
        for rid in aborts.get(step, []):
            engine.abort(rid)
        plan = sched.schedule(engine.now)
        check_step(engine, plan)
        for item in plan.scheduled:
            first_admitted.setdefault(item.seq.request.request_id, step)
        if not plan.is_empty:
            result = engine.executor.execute(plan)
            sched.update(plan, result.sampled, engine.now)
        step += 1
    assert step < max_steps, "the scheduler did not finish the workload (livelock?)"
    return first_admitted


workloads = st.lists(
    st.tuples(
        st.integers(1, 70),        # prompt length
        st.integers(1, 30),        # max_tokens
        st.integers(0, 25),        # arrival step
        st.integers(1, 3),         # n
        st.one_of(st.none(), st.integers(0, 40)),   # abort at step
    ),
    min_size=1, max_size=14,
)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads, block_size=st.sampled_from([4, 8, 16]), max_num_seqs=st.integers(3, 8),
       max_num_batched_tokens=st.integers(8, 96), spare_blocks=st.integers(0, 12),
       prefix_caching=st.booleans(), shared_prefix=st.integers(0, 40))
def test_random_workloads_keep_every_invariant(workload, block_size, max_num_seqs, max_num_batched_tokens,
                                               spare_blocks, prefix_caching, shared_prefix):
    longest = max(p + m for p, m, *_ in workload)
    num_blocks = -(-longest // block_size) + 1 + spare_blocks     # tight: preemption happens
    alloc = BlockAllocator(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    sched = Scheduler(alloc, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    engine = Engine(sched, SimExecutor(vocab_size=1000), keep_records=False)
    arrivals, aborts, expected = collections.defaultdict(list), collections.defaultdict(list), {}
    for i, (plen, max_tokens, at, n, abort_at) in enumerate(workload):
        prompt = [(7 * j) % 50 for j in range(min(shared_prefix, plen))] + [100 + i] * max(0, plen - shared_prefix)
        rid = f"r{i}"
        arrivals[at].append((prompt, SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True, seed=i),
                             rid))
        expected[rid] = (max_tokens, n)
        if abort_at is not None:
            aborts[abort_at].append(rid)
    requests = {}
    original_add = engine.add_request

    def add(prompt, params, rid):
        requests[rid] = original_add(prompt, params, request_id=rid)
    engine.add_request = add
    first_admitted = run_checked(engine, arrivals, aborts)

    # Nothing lost: every request finished with exactly max_tokens tokens, or was aborted.
    for rid, request in requests.items():
        assert request.finished, rid
        max_tokens, n = expected[rid]
        reasons = {s.finish_reason for s in request.seqs}
        if "abort" not in reasons:
            assert len(request.seqs) == n
            assert all(s.num_output_tokens == max_tokens for s in request.seqs), request.seqs
            assert reasons == {"length"}
    # FCFS: requests are first admitted in the order they were added.
    order = [rid for at in sorted(arrivals) for (_, _, rid) in arrivals[at] if rid in first_admitted]
    steps = [first_admitted[rid] for rid in order]
    assert steps == sorted(steps), "a later request was admitted before an earlier one"
    # The pool is whole.
    alloc.check_invariants()
    assert alloc.num_used_blocks == 0
    assert alloc.num_free_blocks == alloc.num_blocks
    assert not sched.running and not sched.waiting and not sched.requests


def drive(engine: Engine) -> None:
    while engine.has_unfinished:
        engine.step()
        engine.scheduler.allocator.check_invariants()


def test_preempted_request_resumes_with_the_same_tokens():
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [[i + 1] * (10 + 7 * i) for i in range(6)]

    def serve(num_blocks):
        alloc = BlockAllocator(num_blocks, 4)
        engine = Engine(Scheduler(alloc, max_num_seqs=6, max_num_batched_tokens=64), SimExecutor(vocab_size=1000))
        reqs = [engine.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
        drive(engine)
        assert alloc.num_used_blocks == 0
        return [r.seqs[0].output_token_ids for r in reqs], engine.scheduler.num_preemptions

    roomy, n_roomy = serve(1000)
    tight, n_tight = serve(30)
    assert n_roomy == 0 and n_tight > 0, "the tight pool must force preemption"
    assert tight == roomy
    # And the tokens are the simulator's deterministic ones, position by position.
    for i, out in enumerate(roomy):
        start = len(prompts[i])
        assert out == [dummy_token(f"r{i}", 0, start + k, 1000) for k in range(40)]


def test_preemption_takes_the_most_recently_admitted():
    alloc = BlockAllocator(8, 4)
    engine = Engine(Scheduler(alloc, max_num_seqs=4, max_num_batched_tokens=100, watermark=0.0),
                    SimExecutor(vocab_size=10))
    a = engine.add_request([1] * 8, SamplingParams(max_tokens=12, ignore_eos=True), request_id="a")
    b = engine.add_request([2] * 8, SamplingParams(max_tokens=12, ignore_eos=True), request_id="b")
    preempted = []
    while engine.has_unfinished:
        plan = engine.scheduler.schedule()
        preempted += [s.request.request_id for s in plan.preempted]
        if not plan.is_empty:
            engine.scheduler.update(plan, engine.executor.execute(plan).sampled, 0.0)
    assert preempted and set(preempted) == {"b"}
    assert a.seqs[0].num_output_tokens == b.seqs[0].num_output_tokens == 12


def test_finished_request_frees_blocks_and_a_waiting_one_joins_next_iteration():
    alloc = BlockAllocator(6, 4)
    engine = Engine(Scheduler(alloc, max_num_seqs=2, max_num_batched_tokens=100, watermark=0.0),
                    SimExecutor(vocab_size=10))
    short = engine.add_request([1] * 4, SamplingParams(max_tokens=2, ignore_eos=True), request_id="short")
    engine.add_request([2] * 4, SamplingParams(max_tokens=10, ignore_eos=True), request_id="long")
    late = engine.add_request([3] * 4, SamplingParams(max_tokens=3, ignore_eos=True), request_id="late")
    steps_done = 0
    while short.finished_time is None:
        engine.step()
        steps_done += 1
    assert engine.scheduler.num_waiting == 1          # "late" waited: max_num_seqs=2
    assert late.first_scheduled_time is None and late.seqs[0].status is Status.WAITING
    plan = engine.scheduler.schedule()
    assert late in [s.seq.request for s in plan.scheduled]
    engine.scheduler.update(plan, engine.executor.execute(plan).sampled, 0.0)
    while engine.has_unfinished:
        engine.step()
    assert late.finished and late.seqs[0].num_output_tokens == 3


def test_chunked_prefill_splits_a_long_prompt_and_mixes_decodes():
    alloc = BlockAllocator(100, 16)
    sched = Scheduler(alloc, max_num_seqs=4, max_num_batched_tokens=32)
    engine = Engine(sched, SimExecutor(vocab_size=10))
    engine.add_request([1] * 5, SamplingParams(max_tokens=20, ignore_eos=True), request_id="small")
    engine.step()
    engine.add_request([2] * 100, SamplingParams(max_tokens=2, ignore_eos=True), request_id="big")
    mixed = 0
    while engine.has_unfinished:
        plan = sched.schedule()
        phases = {s.seq.request.request_id: s.phase for s in plan.scheduled}
        assert plan.num_tokens <= 32
        if phases.get("small") == "decode" and phases.get("big") == "prefill":
            mixed += 1
        sched.update(plan, engine.executor.execute(plan).sampled, 0.0)
    assert mixed >= 3      # 100 prompt tokens in chunks of <= 31 next to a decode


def test_prefix_cache_hits_cut_blocks_and_compute():
    alloc = BlockAllocator(64, 16, enable_prefix_caching=True)
    sched = Scheduler(alloc, max_num_seqs=4, max_num_batched_tokens=512)
    engine = Engine(sched, SimExecutor(vocab_size=1000))
    system = list(range(64))
    engine.add_request(system + [100, 101], SamplingParams(max_tokens=2, ignore_eos=True), request_id="a")
    drive(engine)
    before = sched.num_prompt_tokens_computed
    r = engine.add_request(system + [200], SamplingParams(max_tokens=2, ignore_eos=True), request_id="b")
    drive(engine)
    assert r.seqs[0].num_cached_tokens == 64
    assert sched.num_prompt_tokens_computed - before == 1
    assert alloc.num_used_blocks == 0 and alloc.num_cached_free_blocks >= 4


def test_parallel_sampling_forks_after_prefill_and_copies_on_write():
    alloc = BlockAllocator(32, 4)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=64)
    engine = Engine(sched, SimExecutor(vocab_size=1000))
    r = engine.add_request([5] * 10, SamplingParams(max_tokens=5, n=3, ignore_eos=True), request_id="p")
    engine.step()                              # prefill once, sample 3 tokens, fork
    assert len(r.seqs) == 3
    shared = r.seqs[0].block_table.block_ids
    assert all(s.block_table.block_ids == shared for s in r.seqs)
    assert all(alloc.ref_count(b) == 3 for b in shared)
    plan = sched.schedule()                    # each writes into the shared partial block
    assert len(plan.copies) == 2               # two copy, the last holder writes in place
    sched.update(plan, engine.executor.execute(plan).sampled, 0.0)
    drive(engine)
    outs = [s.output_token_ids for s in r.seqs]
    assert len({tuple(o) for o in outs}) == 3 and all(len(o) == 5 for o in outs)
    assert alloc.num_used_blocks == 0


def test_abort_frees_blocks_at_once_in_any_state():
    alloc = BlockAllocator(40, 4)
    sched = Scheduler(alloc, max_num_seqs=1, max_num_batched_tokens=8)
    engine = Engine(sched, SimExecutor(vocab_size=10))
    engine.add_request([1] * 20, SamplingParams(max_tokens=5, ignore_eos=True), request_id="running")
    engine.add_request([1] * 20, SamplingParams(max_tokens=5, ignore_eos=True), request_id="waiting")
    engine.step()                              # first chunk of "running"
    assert alloc.num_used_blocks > 0
    assert engine.abort("running") and engine.abort("waiting")
    assert not engine.abort("nobody")
    assert alloc.num_used_blocks == 0 and not sched.has_unfinished
    alloc.check_invariants()


@pytest.mark.parametrize("prompt_len, max_tokens, match", [
    (0, 4, "empty"),
    (64, 4, "too long"),
    (40, 100, "whole KV cache"),
])
def test_requests_that_can_never_run_are_rejected_and_change_nothing(prompt_len, max_tokens, match):
    alloc = BlockAllocator(8, 4)
    sched = Scheduler(alloc, max_model_len=64)
    with pytest.raises(ValueError, match=match):
        sched.add_request(Request("x", [1] * prompt_len, SamplingParams(max_tokens=max_tokens)))
    assert not sched.has_unfinished and alloc.num_free_blocks == 8


def test_static_batch_holds_memory_until_its_longest_request_ends():
    alloc = BlockAllocator(64, 4)
    sched = StaticScheduler(alloc, max_num_seqs=2)
    engine = Engine(sched, SimExecutor(vocab_size=10))
    a = engine.add_request([1] * 4, SamplingParams(max_tokens=2, ignore_eos=True), request_id="a")
    b = engine.add_request([1] * 4, SamplingParams(max_tokens=10, ignore_eos=True), request_id="b")
    c = engine.add_request([1] * 4, SamplingParams(max_tokens=2, ignore_eos=True), request_id="c")
    engine.step()
    reserved = alloc.num_used_blocks
    assert reserved == 2 + 4                  # ceil(6/4) + ceil(14/4): the maximum lengths, up front
    while a.finished_time is None:
        engine.step()
    assert alloc.num_used_blocks == reserved  # a is done but its reservation is held
    while b.finished_time is None:
        engine.step()
        assert c.first_scheduled_time is None  # nothing joins a running static batch
    assert alloc.num_used_blocks == 0
    drive(engine)
    assert c.finished and alloc.num_used_blocks == 0


def test_static_and_continuous_share_the_engine_and_continuous_wins():
    from labkit.sim import simulate, synthetic_trace
    trace = synthetic_trace("sharegpt", 200, seed=1)
    cont = simulate(trace, "continuous", num_blocks=1024).metrics
    stat = simulate(trace, "static", num_blocks=1024).metrics
    for m in (cont, stat):
        assert m["finished"] == 200 and m["leaked_blocks"] == 0
        assert m["output_tokens"] == sum(r.output_len for r in trace)
    assert cont["held_slot_fill_mean"] > 0.9 > 0.5 > stat["held_slot_fill_mean"]
    assert cont["peak_running"] > stat["peak_running"]
    assert cont["output_tok_per_s"] > stat["output_tok_per_s"]
