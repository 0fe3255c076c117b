"""The host tier behind the prefix cache (``labkit/memory/host_tier.py``, ``LLM(kv_offloading_size=...)``).

A cached block the device pool evicts is copied to a host block under the same chained hash;
a later prompt whose chain continues past its device hits gets it copied back. These tests
check the mechanism block by block (both policies), then the real engine: greedy tokens equal
to transformers' and to the engine without a tier, with hits that really came from the host.
The random-use machines of ``test_engine_properties.py`` run the tier too, with a shadow of
the KV cache that checks every slot a sequence reads.
"""

from __future__ import annotations

import pytest
import torch

from labkit import LLM, SamplingParams
from labkit.engine import Engine
from labkit.memory import BlockAllocator, BlockManager, BlockTable, Growth, HostTier
from labkit.scheduler import make_scheduler
from labkit.server.metrics import parse_metrics, render_metrics
from labkit.sim import SimExecutor

BS = 4
POLICIES = ["hash", "radix"]


def pools(policy: str, device_blocks: int = 4, host_blocks: int = 8):
    device = BlockAllocator(device_blocks, BS, policy)
    host = BlockAllocator(host_blocks, BS, "hash")
    return device, host, HostTier(device, host, bytes_per_block=1000)


def cached_table(device: BlockAllocator, tokens: list[int], salt: str | None = None) -> BlockTable:
    """A table whose blocks are computed and published, then let go: its full blocks are cached-free."""
    table = BlockTable(device, salt)
    table.append_tokens(tokens)
    table.free()
    return table


def step_runs(tier: HostTier) -> tuple[list, list]:
    """What a step does with the tier's copies: takes them into its plan, runs, reports back."""
    copies = tier.take_copies()
    tier.copies_done()
    return copies


# ---- the mechanism, block by block ----------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_an_evicted_block_is_offloaded_and_a_later_prompt_loads_it_back(policy):
    device, host, tier = pools(policy)
    doc = list(range(100, 108))                      # two full blocks
    cached_table(device, doc)
    assert device.num_cached_free_blocks == 2
    other = BlockTable(device)
    other.append_tokens(list(range(200, 216)), computed=False)   # needs all 4 blocks: evicts both
    out, loads = step_runs(tier)
    assert len(out) == 2 and not loads
    assert {d for d, _ in out} <= set(other.block_ids)           # read before their new holder writes
    assert tier.num_blocks == 2 and host.num_used_blocks == 0     # cached-free on the host once copied
    other.free()

    blocks = BlockManager(device)
    table = BlockTable(device)
    prefix = blocks.find_cached_prefix(table, doc + [1], len(doc))
    assert prefix.blocks == [] and len(prefix.host_blocks) == 2 and prefix.num_tokens == 8
    assert blocks.allocate_slots([Growth(table, [1], prefix=prefix)]) is not None
    out, loads = tier.take_copies()
    assert not out and [h for h, _ in loads] == prefix.host_blocks
    assert [d for _, d in loads] == table.block_ids[:2]            # the loads fill the table's first blocks
    assert all(host.ref_count(h) == 1 for h in prefix.host_blocks), "a load pins its host block until it ran"
    tier.check()
    tier.copies_done()
    assert host.num_used_blocks == 0
    s = tier.stats()
    assert (s["num_offloaded_blocks"], s["num_host_cache_hits"], s["num_host_cache_queries"]) == (2, 2, 2)
    assert s["kv_offloaded_bytes"] == s["kv_loaded_bytes"] == 2000
    table.cache_computed_blocks(8)                                 # the step ran: published on the device again
    assert device.num_cached_blocks == 2
    table.free()
    device.check_invariants()
    tier.check()


@pytest.mark.parametrize("policy", POLICIES)
def test_the_host_continues_the_device_hits_and_stops_at_the_first_miss(policy):
    device, host, tier = pools(policy, device_blocks=6)
    doc = list(range(100, 112))                      # three blocks
    cached_table(device, doc)
    hog = BlockTable(device)
    hog.append_tokens(list(range(300, 320)), computed=False)      # five blocks: two of the doc's are evicted
    step_runs(tier)
    hog.free()
    # Both policies evict a sequence's tail first: the head stays on the device, the rest went to the host.
    found = BlockManager(device).find_cached_prefix(BlockTable(device), doc + [1], 12)
    assert (len(found.blocks), len(found.host_blocks)) == (1, 2) and found.num_host_queries == 2
    # A prompt that diverges in the second block: at most the first block is found anywhere.
    diverged = doc[:4] + [9, 9, 9, 9] + doc[8:] + [1]
    p = BlockManager(device).find_cached_prefix(BlockTable(device), diverged, 12)
    assert len(p.blocks) + len(p.host_blocks) <= 1
    # The last prompt token is never reused, and a partial block never: a 7-token limit finds one block.
    p = BlockManager(device).find_cached_prefix(BlockTable(device), doc, 7)
    assert p.num_tokens <= 4
    tier.check()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_block_loaded_back_and_evicted_again_is_not_copied_twice(policy):
    device, host, tier = pools(policy)
    doc = list(range(100, 108))
    cached_table(device, doc)
    hog = BlockTable(device)
    hog.append_tokens(list(range(200, 216)), computed=False)
    step_runs(tier)
    hog.free()
    table = BlockTable(device)
    blocks = BlockManager(device)
    blocks.allocate_slots([Growth(table, [1], prefix=blocks.find_cached_prefix(table, doc + [1], 8))])
    step_runs(tier)
    table.cache_computed_blocks(8)
    table.free()
    hog = BlockTable(device)
    hog.append_tokens(list(range(200, 216)), computed=False)      # evicts the doc's blocks again
    out, _ = step_runs(tier)
    assert out == [] and tier.num_already_offloaded == 2 and tier.num_offloaded_blocks == 2
    hog.free()
    tier.check()


def test_a_full_tier_forgets_its_least_recently_used_block():
    device, host, tier = pools("hash", device_blocks=2, host_blocks=2)
    for i in range(3):                               # three one-block docs through a two-block host pool
        cached_table(device, list(range(10 * i, 10 * i + 4)))
        hog = BlockTable(device)
        hog.append_tokens(list(range(500, 508)), computed=False)
        step_runs(tier)
        hog.free()
        device.reset_prefix_cache()
    assert tier.num_blocks == 2 and host.num_evictions >= 1
    blocks = BlockManager(device)
    first = blocks.find_cached_prefix(BlockTable(device), [0, 1, 2, 3, 9], 4)
    last = blocks.find_cached_prefix(BlockTable(device), [20, 21, 22, 23, 9], 4)
    assert first.host_blocks == [] and len(last.host_blocks) == 1
    tier.check()


def test_a_salt_never_loads_another_salts_blocks():
    device, host, tier = pools("hash")
    doc = list(range(100, 108))
    cached_table(device, doc, salt="alice")
    hog = BlockTable(device)
    hog.append_tokens(list(range(200, 216)), computed=False)
    step_runs(tier)
    hog.free()
    blocks = BlockManager(device)
    assert blocks.find_cached_prefix(BlockTable(device, "bob"), doc + [1], 8).host_blocks == []
    assert blocks.find_cached_prefix(BlockTable(device), doc + [1], 8).host_blocks == []
    assert len(blocks.find_cached_prefix(BlockTable(device, "alice"), doc + [1], 8).host_blocks) == 2


def test_an_evicted_block_the_host_has_no_room_for_is_dropped_not_waited_for():
    device, host, tier = pools("hash", host_blocks=1)
    held = host.allocate()                           # a swapped sequence's block: never given up
    cached_table(device, list(range(100, 104)))
    hog = BlockTable(device)
    hog.append_tokens(list(range(200, 216)), computed=False)
    assert tier.take_copies() == ([], []) and tier.num_dropped == 1
    hog.free()
    host.free(held)


def test_a_tier_needs_a_prefix_cache_and_a_hash_host_pool():
    with pytest.raises(ValueError, match="prefix caching"):
        HostTier(BlockAllocator(4, BS), BlockAllocator(4, BS, "hash"))
    with pytest.raises(ValueError, match="hash policy"):
        HostTier(BlockAllocator(4, BS, "hash"), BlockAllocator(4, BS))
    with pytest.raises(ValueError, match="prefix caching"):
        make_scheduler("continuous", BlockAllocator(4, BS), num_offload_blocks=4)
    with pytest.raises(ValueError, match="num_offload_blocks"):
        make_scheduler("continuous", BlockAllocator(4, BS, "hash"), num_offload_blocks=-1)


# ---- the scheduler: one host pool for swapping and the tier ------------------------------------
def sim_engine(policy: str, num_blocks: int, offload: int, **kwargs) -> Engine:
    alloc = BlockAllocator(num_blocks, BS, policy)
    sched = make_scheduler("continuous", alloc, max_num_seqs=kwargs.pop("max_num_seqs", 1),
                           max_num_batched_tokens=64, watermark=0.0, num_offload_blocks=offload, **kwargs)
    return Engine(sched, SimExecutor(vocab_size=500), keep_records=False)


def run(engine: Engine, prompts, max_tokens: int = 2) -> None:
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()


DOCS = [[100 * (i + 1) + j for j in range(12)] for i in range(3)]       # three 3-block documents


@pytest.mark.parametrize("policy", POLICIES)
def test_reuse_beyond_the_device_pool_comes_back_from_the_host(policy):
    plain, tiered = sim_engine(policy, 8, 0), sim_engine(policy, 8, 16)
    for engine in (plain, tiered):
        run(engine, [d + [1] for d in DOCS])          # three docs through an 8-block pool: the first is evicted
        run(engine, [d + [2] for d in DOCS])          # and asked about again
    assert tiered.scheduler.num_cached_prompt_tokens > plain.scheduler.num_cached_prompt_tokens
    assert tiered.scheduler.num_prompt_tokens_computed < plain.scheduler.num_prompt_tokens_computed
    s = tiered.stats()
    assert s["num_host_cache_hits"] > 0 and s["num_offloaded_blocks"] >= s["num_host_cache_hits"]
    assert s["num_prefix_cache_queries"] >= s["num_prefix_cache_hits"]
    for engine in (plain, tiered):
        sched = engine.scheduler
        assert sched.allocator.num_used_blocks == 0
        sched.allocator.check_invariants()
    assert tiered.scheduler.host_allocator.num_used_blocks == 0
    tiered.scheduler.tier.check()


def test_a_swap_out_takes_the_tiers_blocks_it_needs():
    engine = sim_engine("hash", 8, 6, preemption_mode="swap", num_host_blocks=2, max_num_seqs=4)
    run(engine, [d + [1] for d in DOCS])             # fills the tier with evicted documents
    sched = engine.scheduler
    assert sched.tier.num_blocks > 0
    run(engine, [[400 + i] * 6 for i in range(4)], max_tokens=12)   # four growing sequences: preemption
    assert sched.num_swap_outs > 0 and sched.num_swap_fallbacks == 0
    assert sched.host_allocator.num_evictions > 0, "the victims' blocks came from the tier's"
    assert sched.host_allocator.num_used_blocks == 0 and sched.allocator.num_used_blocks == 0
    sched.tier.check()


def test_metrics_report_both_tiers():
    engine = sim_engine("hash", 8, 16)
    run(engine, [d + [1] for d in DOCS] + [d + [2] for d in DOCS])
    m = parse_metrics(render_metrics(engine.stats()))
    assert m["labkit_prefix_cache_host_hits_total"] == engine.stats()["num_host_cache_hits"] > 0
    assert m["labkit_kv_offloaded_blocks_total"] > 0 and m["labkit_prefix_cache_queries_total"] > 0
    assert "labkit_kv_offload_blocks" in m and "labkit_kv_loaded_bytes_total" in m


# ---- the real engine: tiny-llama, real copies between two pools --------------------------------
def hf_greedy(hf, prompts, n):
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False)
        outs.append(y[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module")
def tiny_work():
    from labkit.model import load_model
    loaded = load_model("tiny-llama")
    docs = [[3 + (7 * i + 11 * j) % 380 for j in range(16)] for i in range(3)]    # four blocks each
    prompts = [d + [5 + k] for k in range(2) for d in docs]     # each document asked twice, in turn
    return {"prompts": prompts, "ref": hf_greedy(loaded.hf_model(), prompts, 6)}


TIER_CONFIGS = {
    "hash": dict(enable_prefix_caching="hash"),
    "radix": dict(enable_prefix_caching="radix"),
    "hash-swap": dict(enable_prefix_caching="hash", preemption_mode="swap", num_host_blocks=4),
    "radix-chunked": dict(enable_prefix_caching="radix", max_num_batched_tokens=8),
}


@pytest.mark.parametrize("name", TIER_CONFIGS)
def test_tiny_greedy_with_a_host_tier_equals_hf_and_hits_come_from_the_host(tiny_work, name):
    options = dict(block_size=BS, num_blocks=12, max_num_seqs=1, watermark=0.0) | TIER_CONFIGS[name]
    tiered = LLM("tiny-llama", num_offload_blocks=32, **options)
    plain = LLM("tiny-llama", **options)
    got = [o.outputs[0].token_ids for o in tiered.generate(tiny_work["prompts"], greedy(6), use_tqdm=False)]
    base = [o.outputs[0].token_ids for o in plain.generate(tiny_work["prompts"], greedy(6), use_tqdm=False)]
    assert got == base == tiny_work["ref"]
    s, p = tiered.stats(), plain.stats()
    assert s["num_host_cache_hits"] >= 6, "the second round should find its documents on the host"
    assert s["num_prompt_tokens_computed"] < p["num_prompt_tokens_computed"]
    assert s["kv_loaded_bytes"] == s["num_host_cache_hits"] * tiered.runner.kv_cache.bytes_per_block
    assert tiered.allocator.num_used_blocks == 0 and tiered.scheduler.host_allocator.num_used_blocks == 0
    tiered.scheduler.tier.check()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_llm_sizes_the_tier_in_gib_and_says_so(capsys):
    llm = LLM("tiny-llama", num_blocks=16, kv_offloading_size=0.001)
    blocks = int(0.001 * 2**30 // llm.runner.kv_cache.bytes_per_block)
    assert llm.stats()["kv_offloading_blocks"] == blocks > 0
    assert f"host tier {blocks} blocks" in capsys.readouterr().err
    assert llm.scheduler.host_allocator.num_blocks == blocks


@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_offloading_size=-1), "kv_offloading_size must be a positive"),
    (dict(kv_offloading_size="1"), "kv_offloading_size must be a positive"),
    (dict(num_offload_blocks=0), "num_offload_blocks must be a positive"),
    (dict(kv_offloading_size=1, num_offload_blocks=4), "not both"),
    (dict(kv_offloading_size=1, enable_prefix_caching=False), "turn prefix caching on"),
    (dict(kv_offloading_size=1e6), "host memory"),
    (dict(kv_offloading_size=1, policy="static"), "static baseline never reuses"),
])
def test_llm_refuses_a_tier_that_cannot_work(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM("tiny-llama", num_blocks=16, **kwargs)


def test_reset_prefix_cache_empties_both_tiers():
    llm = LLM("tiny-llama", block_size=BS, num_blocks=12, max_num_seqs=1, num_offload_blocks=32)
    llm.generate([[3 + j for j in range(16)] + [5], [200 + j for j in range(16)] + [5],
                  [100 + j for j in range(16)] + [5]], greedy(2), use_tqdm=False)
    assert llm.scheduler.tier.num_blocks > 0
    llm.reset_prefix_cache()
    assert llm.scheduler.tier.num_blocks == 0 and llm.allocator.num_cached_blocks == 0


def test_the_benchmark_runs_the_three_configurations_and_the_tier_saves_prefill(capsys):
    """``python -m labkit.bench tiers`` (the README's line is only parsed: this runs it, small)."""
    import json

    from labkit.bench import tiers
    code = tiers.main(["--model", "tiny-llama", "--docs", "4", "--doc-tokens", "32", "--questions", "2",
                       "--block-size", "4", "--max-tokens", "3", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    rows = {r["config"]: r for r in out["rows"]}
    assert set(rows) == {"none", "device", "device+host"} and all(r["equal"] for r in rows.values())
    assert rows["none"]["saved"] == 0.0 and rows["device+host"]["host_hit"] > 0.5
    assert rows["device+host"]["prefill_tokens"] < rows["device"]["prefill_tokens"]
    assert rows["device+host"]["loaded_mib"] > 0 and out["gpu_model"][0]["load_ms"] < out["gpu_model"][0]["prefill_ms"]
    assert tiers.main(["--configs", "device,cloud"]) == 2


def test_the_simulator_runs_the_tier_and_costs_its_copies_on_a_gpus_link():
    """On a modelled A100 (roofline) with labkit's gathered copies over PCIe 4.0: chat sessions
    that come back after the device evicted them compute less and start sooner with the tier."""
    from labkit.sim import multi_turn_trace, simulate
    from labkit.sim.cost_model import SwapLink
    from labkit.sim.roofline import HOST_LINKS, RooflineCostModel

    trace = multi_turn_trace(num_sessions=24, turns=3, rate=4.0, seed=0)
    cost = RooflineCostModel("llama-3-8b", "a100-80gb")
    link = SwapLink(*HOST_LINKS["pcie4-x16"], cost.kv_bytes_per_token, 1, name="pcie4-x16, gathered")
    runs = {off: simulate(trace, enable_prefix_caching=True, num_blocks=300, cost_model=cost, swap_link=link,
                          num_offload_blocks=off, keep_records=False) for off in (0, 2048)}
    plain, tiered = runs[0], runs[2048]
    assert tiered.metrics["num_host_cache_hits"] > 0 and tiered.metrics["swap_time_s"] > 0
    assert tiered.metrics["kv_loaded_bytes"] == tiered.metrics["num_host_cache_hits"] * 16 * cost.kv_bytes_per_token
    computed = {k: r.engine.scheduler.num_prompt_tokens_computed for k, r in runs.items()}
    assert computed[2048] < computed[0]
    ttft = {k: sum(q.first_token_time - q.arrival_time for q in r.requests) / len(r.requests) for k, r in runs.items()}
    assert ttft[2048] < ttft[0]
    assert plain.metrics["leaked_host_blocks"] == tiered.metrics["leaked_host_blocks"] == 0


def test_a_load_given_up_in_the_same_pass_is_neither_copied_nor_counted():
    """A beam group admitted whole or not at all frees a table after its host hits were loaded:
    those loads leave the plan, and the hit counters do not count them."""
    device, host, tier = pools("hash")
    doc = list(range(100, 108))
    cached_table(device, doc)
    hog = BlockTable(device)
    hog.append_tokens(list(range(200, 216)), computed=False)
    step_runs(tier)
    hog.free()
    blocks = BlockManager(device)
    table = BlockTable(device)
    blocks.allocate_slots([Growth(table, [1], prefix=blocks.find_cached_prefix(table, doc + [1], 8))])
    table.free()                                     # the group did not fit: undone
    out, loads = tier.take_copies()
    assert loads == [] and tier.stats()["num_host_cache_hits"] == 0 and tier.stats()["num_host_cache_queries"] == 0
    tier.copies_done()
    assert host.num_used_blocks == 0 and device.num_used_blocks == 0
    tier.check()


def test_a_block_evicted_again_moves_to_the_fresh_end_of_the_hosts_lru():
    device, host, tier = pools("hash", device_blocks=4, host_blocks=2)
    a, b = list(range(10, 14)), list(range(20, 24))
    for doc in (a, b):                               # both offloaded: a is the host's oldest
        cached_table(device, doc)
        hog = BlockTable(device)
        hog.append_tokens(list(range(500, 516)), computed=False)
        step_runs(tier)
        hog.free()
        device.reset_prefix_cache()
    cached_table(device, a)                          # a computed again on the device, and evicted again
    hog = BlockTable(device)
    hog.append_tokens(list(range(500, 516)), computed=False)
    assert tier.take_copies() == ([], []) and tier.num_already_offloaded == 1
    tier.copies_done()
    hog.free()
    device.reset_prefix_cache()
    cached_table(device, list(range(30, 34)))        # a third document needs the host's oldest block: b's
    hog = BlockTable(device)
    hog.append_tokens(list(range(500, 516)), computed=False)
    step_runs(tier)
    hog.free()
    found = BlockManager(device)
    assert found.find_cached_prefix(BlockTable(device), a + [1], 4).host_blocks != []
    assert found.find_cached_prefix(BlockTable(device), b + [1], 4).host_blocks == []
