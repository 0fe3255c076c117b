"""Regressions: the engine driven as a curious student or a buggy client drives it.

Each test reproduces one finding of the adversarial review (issue 13) and failed before
its fix. Loops are bounded, so a regression to a hang fails instead of hanging CI.
"""

from __future__ import annotations

import pytest

from labkit import LLM, SamplingParams
from labkit.engine import Engine
from labkit.memory import BlockAllocator
from labkit.scheduler import Scheduler, StaticScheduler, make_scheduler
from labkit.sim import SimExecutor

MAX_STEPS = 500


def drain(engine: Engine, max_steps: int = MAX_STEPS) -> int:
    """Step until nothing is left; fail (instead of hanging) past ``max_steps``."""
    for step in range(max_steps):
        if not engine.has_unfinished:
            return step
        engine.step()
        engine.scheduler.allocator.check_invariants()
    raise AssertionError(f"the engine did not drain in {max_steps} steps: "
                         f"{engine.scheduler.requests}")


def assert_idle(engine: Engine) -> None:
    alloc = engine.scheduler.allocator
    alloc.check_invariants()
    assert alloc.num_used_blocks == 0, "blocks leaked"
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.scheduler.requests
    assert engine.num_tracked_sequences == 0, "per-sequence text state leaked"


@pytest.fixture(scope="module")
def tiny_static():
    return LLM("tiny-llama", policy="static", max_num_seqs=2, num_blocks=64, block_size=8)


# ---- finding 1: static batching + stop strings hung ------------------------------------
def test_static_policy_with_stop_strings_drains(tiny_static):
    llm = tiny_static
    prompt = [5, 6, 7, 8]
    probe = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert len(probe.text) >= 4, probe
    stop = probe.text[2:4]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=[stop])
    engine = llm.engine
    requests = [engine.add_request(prompt, params) for _ in range(3)]
    drain(engine)
    for r in requests:
        assert r.seqs[0].finish_reason == "stop"
        assert engine.text_of(r.seqs[0]) == probe.text[:probe.text.index(stop)]
        engine.release(r)
    assert_idle(engine)


def test_static_policy_stop_strings_through_generate(tiny_static):
    # The same through the public API (it used to never return).
    out = tiny_static.generate([[5, 6, 7, 8]] * 3,
                               SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)
    stop = out[0].outputs[0].text[2:4]
    outs = tiny_static.generate([[5, 6, 7, 8]] * 3,
                                SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=stop),
                                use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["stop"] * 3
    assert_idle(tiny_static.engine)


# ---- finding 2: abort rewrote the finish reasons of finished samples --------------------
@pytest.mark.parametrize("policy", ["continuous"])
def test_abort_keeps_the_finish_reason_of_finished_samples(policy):
    alloc = BlockAllocator(64, 4)
    engine = Engine(make_scheduler(policy, alloc, max_num_seqs=8), SimExecutor(vocab_size=100))
    r = engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=10, n=3, ignore_eos=True))
    engine.step()                                     # prefill, fork into 3 samples
    assert len(r.seqs) == 3
    engine.scheduler.finish_sequence(r.seqs[1], "stop")
    assert engine.abort(r.request_id)
    assert [s.finish_reason for s in r.seqs] == ["abort", "stop", "abort"]
    assert r.finished_time is not None
    assert_idle(engine)


def test_finish_reason_is_set_once():
    alloc = BlockAllocator(64, 4)
    engine = Engine(Scheduler(alloc, max_num_seqs=8), SimExecutor(vocab_size=100))
    r = engine.add_request([1, 2, 3], SamplingParams(max_tokens=10, n=2, ignore_eos=True))
    engine.step()
    engine.scheduler.finish_sequence(r.seqs[0], "stop")
    engine.scheduler.finish_sequence(r.seqs[0], "length")     # a second end changes nothing
    assert r.seqs[0].finish_reason == "stop"
    drain(engine)
    assert [s.finish_reason for s in r.seqs] == ["stop", "length"]
    assert_idle(engine)


# ---- finding 3: the public fork could exceed max_num_seqs --------------------------------
def test_public_fork_counts_the_samples_of_requests_not_yet_forked():
    alloc = BlockAllocator(128, 4)
    sched = Scheduler(alloc, max_num_seqs=3, max_num_batched_tokens=8)
    engine = Engine(sched, SimExecutor(vocab_size=100))
    a = engine.add_request([1, 2], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()                                     # a decodes from now on
    engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=5, n=2, ignore_eos=True))
    engine.step()                                     # b's first chunk: 2 slots promised
    assert len(sched.running) == 2
    with pytest.raises(ValueError, match="max_num_seqs"):
        sched.fork(a.seqs[0])
    for _ in range(MAX_STEPS):
        assert len(sched.running) <= sched.max_num_seqs
        if not engine.has_unfinished:
            break
        engine.step()
    assert_idle(engine)


# ---- finding 4: an abandoned stream leaked the detokenizer state --------------------------
def test_abandoned_stream_leaves_no_state():
    llm = LLM("tiny-llama", num_blocks=64, block_size=8)
    stream = llm.generate_stream([[5, 6, 7], [9, 10]],
                                 SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, n=2))
    next(stream)
    next(stream)
    stream.close()                                    # the consumer walks away
    assert_idle(llm.engine)
    assert not llm.engine.deltas
    # The engine still serves, and a stream read to the end leaves nothing either.
    outs = list(llm.generate_stream([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0)))
    assert outs[-1].finished
    assert_idle(llm.engine)


# ---- finding 6: KV arriving from elsewhere was published before it existed -------------
def test_arriving_kv_enters_the_prefix_cache_only_after_its_iteration():
    alloc = BlockAllocator(64, 4, enable_prefix_caching=True)
    sched = Scheduler(alloc, max_num_seqs=4, max_num_batched_tokens=64)
    engine = Engine(sched, SimExecutor(vocab_size=100))
    prompt = list(range(10, 23))                      # 13 tokens: 3 full blocks
    moved = engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    moved.seqs[0].num_external_tokens = 12
    plan = sched.schedule()
    assert plan.scheduled[0].num_new_tokens == 1
    # Before any executor ran, nobody may find those blocks in the cache.
    probe = engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    assert probe.seqs[0].block_table is None
    from labkit.memory import BlockTable
    assert BlockTable(alloc).peek_cached_prefix(prompt, len(prompt) - 1) == []
    sched.update(plan, engine.executor.execute(plan).sampled, 0.0)
    # Once the iteration ran, the blocks are shareable.
    assert len(BlockTable(alloc).peek_cached_prefix(prompt, len(prompt) - 1)) == 3
    drain(engine)
    assert probe.seqs[0].num_cached_tokens == 12
    assert_idle(engine)


# ---- misspelled options are errors, not silently ignored ------------------------------
def test_static_scheduler_rejects_unknown_options():
    with pytest.raises(TypeError):
        StaticScheduler(BlockAllocator(8, 4), max_num_seq=4)          # typo
    with pytest.raises(ValueError, match="polic"):
        make_scheduler("fcfs", BlockAllocator(8, 4))


# ---- found by the property test: no chunking + preemption could never recompute --------
def test_without_chunking_a_request_that_may_outgrow_the_token_budget_is_refused():
    # A preempted sequence is recomputed whole (prompt + output) in one iteration; without
    # chunked prefill that must fit the token budget, or it waits forever.
    sched = Scheduler(BlockAllocator(64, 4), max_num_batched_tokens=24, enable_chunked_prefill=False)
    engine = Engine(sched, SimExecutor(vocab_size=100))
    with pytest.raises(ValueError, match="never be recomputed"):
        engine.add_request(list(range(1, 21)), SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request(list(range(1, 21)), SamplingParams(max_tokens=4, ignore_eos=True))
    drain(engine)
    assert_idle(engine)


# ---- one way to read prompts: bools are not token ids ------------------------------------
def test_bool_token_ids_are_refused_by_llm_and_async_engine():
    import asyncio

    from labkit.server.async_engine import AsyncEngine

    llm = LLM("tiny-llama", num_blocks=32, block_size=8)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[True, 5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.stats()["num_steps"] == 0 and not llm.scheduler.has_unfinished

    async def refused() -> str:
        with AsyncEngine(llm) as engine:
            with pytest.raises(ValueError, match="token ids") as err:
                await engine.add_request([True, 5, 6], SamplingParams(max_tokens=2))
            ok = await engine.add_request([1, 5, 6], SamplingParams(max_tokens=2, temperature=0.0))
            outs = [o async for o in ok]
            return str(err.value), outs[-1]
    message, last = asyncio.run(refused())
    assert last.finished and len(last.outputs[0].token_ids) == 2
    out = llm.generate([[1, 5, 6]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == last.outputs[0].token_ids, "the two APIs build the same output"


# ---- stats that say what they are (issue 15) ------------------------------------------
def test_kv_cache_usage_is_the_held_share_and_zero_when_idle():
    alloc = BlockAllocator(16, 4)
    engine = Engine(Scheduler(alloc), SimExecutor(vocab_size=100))
    stats = engine.stats()
    assert stats["kv_cache_usage"] == 0.0 and stats["held_slot_fill"] == 0.0
    engine.add_request([1] * 6, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()                                          # 6 tokens computed, 1 sampled: 2 blocks
    stats = engine.stats()
    assert stats["num_used_blocks"] == 2
    assert stats["kv_cache_usage"] == 2 / 16
    assert stats["held_slot_fill"] == 6 / 8
    record = engine.records[-1]
    assert (record.kv_cache_usage, record.held_slot_fill) == (2 / 16, 6 / 8)


def test_every_stats_key_is_documented_and_named_alike_everywhere():
    import pathlib
    import re

    from labkit.server.metrics import METRICS
    from labkit.viz.pool import snapshot

    doc = (pathlib.Path(__file__).parent.parent / "docs" / "stats.md").read_text()
    documented = set(re.findall(r"^\| `(\w+)` \|", doc, flags=re.M))
    # An engine that speculates, with a host tier: its spec_decode_* and tier keys come on top
    # of every other engine's.
    llm = LLM("tiny-llama", num_blocks=16, block_size=8, num_offload_blocks=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    from labkit.server.async_engine import AsyncEngine
    with AsyncEngine(llm, start=False) as server:
        server_keys = set(server.stats())
    engine_keys = set(llm.engine.stats())
    llm_only = set(llm.stats()) - engine_keys
    assert engine_keys <= documented, engine_keys - documented
    assert llm_only <= set(re.findall(r"`(\w+)` \(", doc)), llm_only
    assert server_keys - engine_keys - llm_only <= documented | {"model", "max_model_len"}, \
        server_keys - engine_keys - documented
    # The widgets and /metrics read the same keys.
    status = snapshot(llm.engine)["status"]
    assert set(status) - {"time_s"} <= engine_keys, set(status) - engine_keys
    metric_keys = {key for _, _, key, _ in METRICS}
    assert metric_keys <= server_keys, metric_keys - server_keys
    for name, _, key, _ in METRICS:
        assert f"`{name}`" in doc or name.removeprefix("labkit_") in doc, name


# ---- one meaning of "greedy", one validator ----------------------------------------------
def test_greedy_and_validation_mean_the_same_in_params_and_sampler():
    from labkit.model.sampler import SamplingRow

    for t in (0.0, 1e-7, 1e-5, 0.5):
        assert SamplingParams(temperature=t).greedy == SamplingRow(temperature=t).greedy
    for bad in (dict(temperature=True), dict(temperature=float("nan")), dict(top_p=0.0), dict(top_k=-2)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingRow(**bad)


# ---- a scheduler that can make no progress is reported, not spun on ----------------------
def test_a_scheduler_that_plans_nothing_raises_instead_of_hanging():
    class Stuck(Scheduler):                  # e.g. a student's policy hook gone wrong
        def _batch_may_grow(self) -> bool:
            return False

    engine = Engine(Stuck(BlockAllocator(16, 4)), SimExecutor(vocab_size=100))
    assert engine.step() == []               # idle: nothing to do is fine
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="planned nothing"):
        engine.step()
