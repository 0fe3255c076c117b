"""Roofline cost model, colocated / chunked / disaggregated serving, and the chapter's graders."""

from __future__ import annotations

import json

import pytest

from labkit.exercises import disagg as ex
from labkit.memory import BlockAllocator
from labkit.request import Request
from labkit.sampling_params import SamplingParams
from labkit.scheduler import Scheduler
from labkit.scheduler.preemption import preempt
from labkit.sim import TraceRequest, simulate
from labkit.sim.cost_model import BatchShape
from labkit.sim.disagg import (SLO, colocated, disaggregated, max_goodput, rate_at_attainment, serve,
                               standard_configs, workload_trace)
from labkit.sim.roofline import (HARDWARE, MODELS, ModelSpec, batch_shape, fit_hardware, get_model,
                                 roofline)

H100_8B = roofline("llama-3-8b", "h100-sxm")


# ---- the roofline model ------------------------------------------------------------------
def test_model_presets_have_the_published_sizes():
    assert get_model("smollm2-135m").num_params == 134_515_008          # SmolLM2-135M, tied embeddings
    assert get_model("llama-3-8b").num_params == pytest.approx(8.03e9, rel=0.005)
    assert get_model("llama-3-70b").num_params == pytest.approx(70.6e9, rel=0.005)
    assert get_model("llama-3-8b").kv_bytes_per_token == 2 * 32 * 8 * 128 * 2      # 128 KiB
    config = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
              "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
              "tie_word_embeddings": True, "torch_dtype": "float32"}
    spec = ModelSpec.from_hf_config(config, name="SmolLM2-135M")
    assert spec == MODELS["smollm2-135m"]


def test_decode_time_is_linear_in_bytes_read():
    """Memory-bound decode: time = overhead + (weights + KV read) / bandwidth, exactly."""
    cm, kv, bw = H100_8B, H100_8B.kv_bytes_per_token, H100_8B.bandwidth
    t = {(b, c): cm.decode_time(b, c) for b in (1, 8, 16) for c in (512, 1024, 2048)}
    # Doubling every context adds exactly the extra KV bytes over the bandwidth.
    for b in (1, 8, 16):
        assert t[b, 2048] - t[b, 1024] == pytest.approx(b * 1024 * kv / bw, rel=1e-6)
        assert t[b, 1024] - t[b, 512] == pytest.approx(b * 512 * kv / bw, rel=1e-6)
    # Batch 1 is "read the weights once": the weight bytes over the bandwidth, plus overhead.
    weights = cm.weight_read_params * cm.model.dtype_bytes
    assert t[1, 512] == pytest.approx(cm.hardware.overhead_s + (weights + 513 * kv) / bw, rel=1e-6)
    for b in (1, 8, 16):
        assert cm.breakdown(batch_shape(decode=[1024] * b))["bound"] == "memory"


def test_prefill_time_grows_with_flops_and_small_batches_ride_free():
    cm = H100_8B
    # Compute-bound prefill: the time difference is the FLOP difference over the FLOP/s.
    lin = 2 * cm.model.num_layers * cm.model.layer_params
    d_flops = lin * 2048 + cm.model.attention_flops_per_pair * (4096 * 4097 // 2 - 2048 * 2049 // 2)
    assert cm.prefill_time(4096) - cm.prefill_time(2048) == pytest.approx(d_flops / cm.flops, rel=0.02)
    assert cm.breakdown(batch_shape(prefill=[(2048, 0)]))["bound"] == "compute"
    # Below the ridge point extra tokens are almost free; above it, time ~ tokens.
    ridge = cm.ridge_tokens()
    assert ridge == pytest.approx(cm.flops * 2 / (2 * cm.bandwidth))
    assert cm.prefill_time(int(ridge * 0.5)) < 1.05 * cm.prefill_time(1)
    assert cm.prefill_time(int(ridge * 8)) == pytest.approx(2 * cm.prefill_time(int(ridge * 4)), rel=0.1)
    # Faster hardware is faster; tensor parallelism splits the work.
    assert roofline("llama-3-8b", "h200").decode_time(32, 1024) < cm.decode_time(32, 1024)
    assert roofline("llama-3-8b", "a100-80gb").prefill_time(1024) > cm.prefill_time(1024)
    assert roofline("llama-3-70b", "h100-sxm", tp=4).prefill_time(1024) == pytest.approx(
        roofline("llama-3-70b", "h100-sxm").prefill_time(1024) / 4, rel=0.05)
    with pytest.raises(ValueError, match="raise tp"):
        roofline("llama-3-70b", "h100-sxm").kv_cache_blocks()


def test_cpu_preset_matches_the_peer_decode_steps_and_can_be_refitted():
    cpu = roofline("smollm2-135m", "cpu-2core")
    for batch, seconds in ((1, 0.038), (16, 0.088), (64, 0.219)):
        assert cpu.decode_time(batch, 300) == pytest.approx(seconds, rel=0.1)
    shapes = [batch_shape(decode=[c] * b) for b in (1, 8, 64) for c in (10, 1000)] + [batch_shape(prefill=[(200, 0)])]
    hw = fit_hardware("smollm2-135m", [(s, cpu.iteration_time(s)) for s in shapes])
    assert hw.flops == pytest.approx(HARDWARE["cpu-2core"].flops, rel=1e-6)
    assert hw.bandwidth == pytest.approx(HARDWARE["cpu-2core"].bandwidth, rel=1e-6)
    assert hw.overhead_s == pytest.approx(HARDWARE["cpu-2core"].overhead_s, rel=1e-6)


def test_batch_shape_counts_context_like_the_scheduler():
    """batch_shape builds the same BatchShape as BatchShape.of on a real plan."""
    alloc = BlockAllocator(64, 16)
    sched = Scheduler(alloc, max_num_seqs=4, max_num_batched_tokens=100)
    sched.add_request(Request("a", list(range(30)), SamplingParams(max_tokens=5, ignore_eos=True)))
    plan = sched.schedule()
    sched.update(plan, [[1]], 0.0)
    sched.add_request(Request("b", list(range(150)), SamplingParams(max_tokens=5, ignore_eos=True)))
    plan = sched.schedule()      # a decodes at context 31; b prefills 99 tokens from 0
    assert BatchShape.of(plan) == batch_shape(decode=[31], prefill=[(99, 0)])


# ---- the scheduler hook: KV that arrives from a prefill instance ----------------------------
def test_transferred_kv_is_admitted_as_computed_and_dropped_on_preemption():
    alloc = BlockAllocator(32, 4)
    sched = Scheduler(alloc, max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(10))
    request = Request("r", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    seq = request.seqs[0]
    seq.token_ids.append(77)                 # the first token, sampled by the prefill instance
    seq.num_external_tokens = len(prompt)
    sched.add_request(request)
    plan = sched.schedule()
    (item,) = plan.scheduled
    assert (item.num_new_tokens, item.is_prefill, item.num_computed_tokens) == (1, False, 10)   # a plain decode
    assert seq.block_table.num_tokens == 11 and alloc.num_used_blocks == 3
    assert seq.num_external_tokens == 0 and sched.num_cached_prompt_tokens == 0
    sched.update(plan, [[5]], 0.0)
    preempt(sched, sched.running.pop())       # memory pressure: the transferred KV goes too
    plan = sched.schedule()
    assert plan.scheduled[0].num_new_tokens == 12 and plan.scheduled[0].is_prefill   # recompute all
    bad = Request("x", [1, 2], SamplingParams(max_tokens=2))
    bad.seqs[0].num_external_tokens = 2
    with pytest.raises(ValueError, match="at least one token"):
        sched.add_request(bad)


# ---- the three configurations -------------------------------------------------------------
@pytest.fixture(scope="module")
def mixed():
    """Long prompts, moderate outputs, near saturation on 2+2 H100s: interference shows."""
    trace = workload_trace(160, rate=40, prompt_mean=1536, output_mean=96, sigma=0.5, seed=1)
    results = {cfg.name: serve(trace, cfg, H100_8B, keep_records=True)
               for cfg in standard_configs(2, 2, chunk=512)}
    return trace, results


def test_one_colocated_instance_is_exactly_simulate():
    trace = workload_trace(40, rate=5, prompt_mean=200, output_mean=30, seed=3, max_len=2048)
    ref = simulate(trace, cost_model=H100_8B, max_num_batched_tokens=256, num_blocks=512, max_model_len=2048)
    got = serve(trace, colocated(1, 256, num_blocks=512, max_model_len=2048), H100_8B)
    by_id = {r.request_id: r for r in ref.requests}
    for s in got.requests:
        r = by_id[s.request_id]
        assert (s.first_token_time, s.finished_time) == (r.first_token_time, r.finished_time)


def test_three_configs_serve_everything_and_leak_nothing(mixed):
    trace, results = mixed
    assert set(results) == {"colocated", "chunked", "disaggregated"}
    for res in results.values():      # serve() already ran check_cluster; say it again here
        m = res.metrics(SLO(1.0, 0.05))
        assert m["finished"] == m["requests"] == len(trace) and m["leaked_blocks"] == 0
        assert sum(len(r.token_times) for r in res.requests) == sum(t.output_len for t in trace)
        for r in res.requests:
            assert r.arrival_time <= r.first_token_time == r.token_times[0] <= r.finished_time == r.token_times[-1]
            assert r.token_times == sorted(r.token_times)
        assert 0 < min(m["utilization"].values()) and max(m["utilization"].values()) <= 1 + 1e-9


def test_chunked_prefill_lowers_tail_tpot(mixed):
    _, results = mixed
    whole, chunked = results["colocated"].metrics(), results["chunked"].metrics()
    assert chunked["tpot_p99_s"] < 0.8 * whole["tpot_p99_s"]
    assert chunked["itl_p99_s"] < 0.5 * whole["itl_p99_s"]
    # No chunked iteration is longer than a full token budget's worth of work.
    budget = results["chunked"].config.max_num_batched_tokens
    longest = max(rec.duration_s for inst in results["chunked"].instances for rec in inst.engine.records)
    assert longest < H100_8B.iteration_time(batch_shape(decode=[8192] * 32, prefill=[(budget, 8192)]))


def test_disaggregation_removes_prefill_interference(mixed):
    _, results = mixed
    dis = results["disaggregated"]
    for inst in dis.instances:
        for rec in inst.engine.records:
            if inst.role == "decode":
                assert rec.num_prefill_tokens == 0, "a decode instance computed a prompt"
            else:
                assert rec.num_decode_tokens == 0 and rec.num_prefill_tokens > 0
    m, whole, chunked = dis.metrics(), results["colocated"].metrics(), results["chunked"].metrics()
    assert m["tpot_p99_s"] < chunked["tpot_p99_s"] < whole["tpot_p99_s"]
    # Between tokens on the decode instance: one decode iteration, never a prompt's.
    decode_itls = [g for r in dis.requests for g in r.itls[1:]]
    worst_decode = max(rec.duration_s for inst in dis.instances if inst.role == "decode"
                       for rec in inst.engine.records)
    assert max(decode_itls) <= worst_decode + 1e-12
    # The KV transfer: prompt bytes over the link, from the prefill to the decode instance.
    r = dis.requests[0]
    assert r.transfer_s == pytest.approx(r.prompt_len * H100_8B.kv_bytes_per_token
                                         / HARDWARE["h100-sxm"].link_bandwidth)
    assert r.prefill_instance.startswith("prefill") and r.decode_instance.startswith("decode")


def test_disaggregated_pools_survive_memory_pressure_and_one_token_outputs():
    trace = [TraceRequest(300 + 37 * i % 200, 1 if i % 5 == 0 else 40 + i, 0.01 * i) for i in range(30)]
    for router in ("least_loaded", "round_robin"):
        res = serve(trace, disaggregated(2, 1, num_blocks=60, max_model_len=1024, router=router), H100_8B,
                    keep_records=True)
        assert res.metrics()["num_preemptions"] > 0     # the decode instance had to recompute
        assert all(r.decode_instance == "" for r in res.requests if r.output_len == 1)


def test_goodput_and_attainment():
    trace = workload_trace(60, rate=20, prompt_mean=1024, output_mean=64, seed=2)
    res = serve(trace, colocated(2, 512), H100_8B)
    loose, tight = res.metrics(SLO(10, 1)), res.metrics(SLO(0.001, 0.001))
    assert loose["slo_attainment"] == 1 and tight["slo_attainment"] == 0
    assert loose["goodput_rps"] == pytest.approx(60 / res.makespan_s)
    assert loose["goodput_per_device_rps"] == pytest.approx(loose["goodput_rps"] / 2)
    rate = max_goodput(colocated(1, 512), SLO(0.5, 0.02), H100_8B, duration_s=3, iterations=3,
                       low=2, high=8, prompt_mean=1024, output_mean=64)
    assert 2 <= rate < 64
    assert rate_at_attainment([1, 2, 3], [1.0, 0.95, 0.85]) == pytest.approx(2.5)
    assert rate_at_attainment([1, 2], [0.5, 0.4]) == 0 and rate_at_attainment([1, 2], [1, 1]) == 2


def test_bench_cli_prints_one_json_object(capsys):
    from labkit.bench.disagg import main
    assert main(["--num-requests", "40", "--rate", "20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["configs"]) == {"colocated", "chunked", "disaggregated"}
    assert all(c["finished"] == 40 and c["leaked_blocks"] == 0 for c in out["configs"].values())
    assert {"goodput_per_device_rps", "ttft_p99_s", "tpot_p90_s", "utilization"} <= set(out["configs"]["chunked"])


# ---- graders -------------------------------------------------------------------------------
# The rules every grader keeps (3 significant figures, containers, no navigating hints, no
# search faster by hints) are tested for all of them in test_exercises_rules.py; here, that
# 7.1-7.4 recognise the mistakes of their own method and say what went wrong.
def test_graders_accept_right_answers(capsys):
    ex.check_ridge_point(ex.ridge_expected())
    ex.check_ridge_point(f"{ex.ridge_expected():.0f}")
    ex.check_prefill_doubling(ex.doubling_expected())
    ex.check_chunk_budget(ex.chunk_budget_expected())
    plan = ex.plan_expected()
    ex.check_instance_plan(plan.num_prefill, plan.num_decode)
    assert capsys.readouterr().out.count("✓") == 5


def _mistake(mistakes, words):
    """The answer of the known mistake whose hint says ``words``."""
    found = [n for n, hint in mistakes() if words in hint]
    assert found, f"no known mistake says {words!r}"
    return found[0]


@pytest.mark.parametrize("grader, answer, hint", [
    (ex.check_ridge_point, lambda: 989 / 3.35, "datasheet peaks"),
    (ex.check_ridge_point, lambda: ex.ridge_expected() / 2, "2 bytes"),
    (ex.check_ridge_point, ..., "no answer yet"),
    (ex.check_prefill_doubling, lambda: _mistake(ex._doubling_mistakes, "alone"), "shares one reading"),
    (ex.check_prefill_doubling, lambda: _mistake(ex._doubling_mistakes, "not one"), "batch of 32 decodes"),
    (ex.check_prefill_doubling, lambda: ex.doubling_expected() + 1, "Time the iteration"),   # the method
    (ex.check_chunk_budget, lambda: ex.chunk_budget_expected() - ex.EX3_BATCH, "32 decodes"),
    (ex.check_chunk_budget, lambda: ex.EX3_BATCH + ex.EX3_PROMPT, "whole prompt"),
    (ex.check_chunk_budget, lambda: ex.chunk_budget_expected() + 1, "time every iteration"),  # the method
    (ex.check_chunk_budget, lambda: 10, "no room"),
])
def test_graders_reject_wrong_answers_with_a_hint(grader, answer, hint):
    with pytest.raises(AssertionError, match=hint):
        grader(answer() if callable(answer) else answer)


@pytest.mark.parametrize("wrong", [lambda e: e + 1, lambda e: e - 1, lambda e: e * 2, lambda e: e // 2])
def test_chunk_budget_hints_never_say_which_way(wrong):
    """A wrong budget that is no known mistake gets the method, never a direction (issue 27)."""
    with pytest.raises(AssertionError) as err:
        ex.check_chunk_budget(wrong(ex.chunk_budget_expected()))
    text = str(err.value).lower()
    assert not any(w in text for w in ("larger", "smaller", "higher", "lower", "too many", "too few"))


def test_instance_plan_grader_names_the_slip_it_sees():
    """Each known slip of 7.4 gets its own diagnosis, except one that lands next to the answer,
    which gets the method (naming it would say "one off"); so does any other wrong count."""
    plan = ex.plan_expected()
    prefill, decode = ex._plan_mistakes()
    assert prefill and decode
    for pool, expected, slips, method in (("prefill", plan.num_prefill, prefill, "Step 1"),
                                          ("decode", plan.num_decode, decode, "Step 2")):
        for n, hint in slips:
            if n < 1:
                continue
            answer = (n, plan.num_decode) if pool == "prefill" else (plan.num_prefill, n)
            with pytest.raises(AssertionError) as err:
                ex.check_instance_plan(*answer)
            assert (hint if abs(n - expected) > 1 else method) in str(err.value), (pool, n)
    with pytest.raises(AssertionError, match="Step 1"):
        ex.check_instance_plan(plan.num_prefill + 1, plan.num_decode)


def test_chunk_budget_grader_times_the_slowest_chunk():
    """The grader times only the last full and the last partial chunk: the same as all."""
    for budget in list(range(33, 120, 7)) + list(range(120, 4200, 61)):
        assert ex.worst_chunked_iteration(budget) == ex.worst_chunked_iteration_brute(budget), budget
