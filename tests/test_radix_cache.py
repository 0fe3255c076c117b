"""The radix-tree prefix cache (SGLang's RadixAttention) beside the hash cache.

Unit tests of the tree (page-granular matching, splits, deduplication, leaf-first LRU
eviction, nothing evicted while held), the workloads that share prefixes, the comparison
benchmark, and the end-to-end promise: greedy tokens with the radix cache equal those with
no cache, on tiny-llama (many stresses) and on SmolLM2-135M (short). The random
interleavings are in ``test_memory_properties.py`` (``RadixMachine``).
"""

from __future__ import annotations

import json
import random

import pytest

from labkit import LLM, SamplingParams
from labkit.model import load_model
from labkit.memory import BlockAllocator, BlockTable, NoFreeBlocksError, RadixTree, hash_prefix
from labkit.sim import (TraceRequest, branching_trace, few_shot_trace, load_trace, multi_turn_trace, save_trace,
                        simulate, shared_prompt_trace)
from labkit.sim.executor import dummy_token


def radix(num_blocks: int = 16, block_size: int = 2) -> BlockAllocator:
    return BlockAllocator(num_blocks, block_size, enable_prefix_caching="radix")


def table_with(alloc: BlockAllocator, tokens, reuse: bool = False) -> BlockTable:
    table = BlockTable(alloc)
    if reuse:
        table.reuse_cached_prefix(tokens, len(tokens) - 1)
    table.append_tokens(tokens[table.num_tokens:])
    alloc.check_invariants()
    return table


def shape(tree: RadixTree) -> list[tuple]:
    return [(n.token_ids, len(n.children)) for n in tree.nodes()][1:]


# ---- the policy values ---------------------------------------------------------------
def test_policy_values_and_bad_ones():
    assert BlockAllocator(4, 2).prefix_cache is None and BlockAllocator(4, 2).radix is None
    assert BlockAllocator(4, 2, enable_prefix_caching=True).enable_prefix_caching == "hash"
    assert BlockAllocator(4, 2, enable_prefix_caching="hash").radix is None
    alloc = radix()
    assert isinstance(alloc.radix, RadixTree) and alloc.prefix_cache is alloc.radix
    assert alloc.enable_prefix_caching == "radix"
    for bad in ("lru", "Radix", 1.5, ["radix"]):
        with pytest.raises(ValueError, match="enable_prefix_caching"):
            BlockAllocator(4, 2, enable_prefix_caching=bad)


def test_hash_only_operations_live_on_the_hash_policy():
    """Lookups by block hash are the hash policy's own: neither the radix tree nor the
    allocator offers them (block tables reach every policy through the same protocol)."""
    alloc = radix()
    table_with(alloc, [1, 2, 3])
    for name in ("lookup", "peek", "register"):
        assert not hasattr(alloc.prefix_cache, name) and not hasattr(alloc, name)
        assert callable(getattr(BlockAllocator(4, 2, enable_prefix_caching="hash").prefix_cache, name))


# ---- matching ------------------------------------------------------------------------
def test_match_is_page_granular_changes_nothing_and_respects_max_tokens():
    alloc = radix(block_size=4)
    a = table_with(alloc, list(range(11)))              # two full blocks and a partial one
    tree = alloc.radix
    before = (shape(tree), [alloc.ref_count(b) for b in range(alloc.num_blocks)])
    assert tree.match_prefix(list(range(11))) == (8, a.block_ids[:2])   # never the partial block
    assert tree.match_prefix(list(range(6)) + [99] * 5) == (4, a.block_ids[:1])
    assert tree.match_prefix(list(range(8)), max_tokens=7) == (4, a.block_ids[:1])
    assert tree.match_prefix([5, 1, 2, 3]) == (0, [])
    assert (shape(tree), [alloc.ref_count(b) for b in range(alloc.num_blocks)]) == before
    assert BlockTable(alloc).peek_cached_prefix(list(range(11)), 10) == a.block_ids[:2]


def test_a_hit_takes_whole_blocks_and_splits_the_node_it_ends_in():
    alloc = radix(block_size=2)
    a = table_with(alloc, [1, 2, 3, 4, 5, 6, 7])
    tree = alloc.radix
    assert shape(tree) == [((1, 2, 3, 4, 5, 6), 0)]     # one node of three blocks
    b = BlockTable(alloc)
    assert b.reuse_cached_prefix([1, 2, 3, 4, 9, 9], 5) == 4
    assert b.block_ids == a.block_ids[:2] and b.num_published_blocks == 2
    assert shape(tree) == [((1, 2, 3, 4), 1), ((5, 6), 0)]
    upper = tree.node_of(a.block_ids[0])
    assert upper.hit_count == 1 and tree.ref_count(upper) == 2 and tree.ref_count(tree.node_of(a.block_ids[2])) == 1
    b.append_tokens([9, 9])
    assert shape(tree) == [((1, 2, 3, 4), 2), ((5, 6), 0), ((9, 9), 0)]
    assert alloc.cache_entry(b.block_ids[2]).block_hash == hash_prefix([1, 2, 3, 4, 9, 9], 2)[2]
    alloc.check_invariants()


def test_a_hit_never_shares_kv_for_different_tokens():
    alloc = radix(block_size=2)
    table_with(alloc, [1, 2, 3, 4, 5])
    # Same tokens in another order, or one token different, or the same block after another
    # prefix: the match stops before the first block whose whole prefix differs.
    expected = {(1, 2, 4, 3, 5): 2, (2, 1, 3, 4, 5): 0, (1, 9, 3, 4, 5): 0, (9, 9, 3, 4, 5): 0,
                (1, 2, 3, 4, 5): 4}
    for other, n in expected.items():
        assert alloc.radix.match_prefix(other)[0] == n, other


# ---- insertion: chunk boundaries, decode, deduplication ------------------------------
def test_chunks_are_published_as_computed_and_concurrent_requests_share():
    alloc = radix(num_blocks=12, block_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    a, b = BlockTable(alloc), BlockTable(alloc)
    a.append_tokens(prompt[:4], computed=False)
    b.append_tokens(prompt[:4], computed=False)          # both prefill the same chunk at once
    assert alloc.num_used_blocks == 4 and alloc.num_cached_blocks == 0    # nothing shared before its KV
    a.cache_computed_blocks(4)                           # the iteration ran: a's chunk is published
    b.cache_computed_blocks(4)                           # b finds it: switches, gives its copies back
    assert b.block_ids == a.block_ids and alloc.num_used_blocks == 2
    assert alloc.radix.num_deduplicated == 2 and all(alloc.ref_count(x) == 2 for x in a.block_ids)
    c = BlockTable(alloc)                                # a third request, admitted after the chunk
    assert c.reuse_cached_prefix(prompt, len(prompt) - 1) == 4
    alloc.check_invariants()
    for t in (a, b, c):
        t.free()
    alloc.check_invariants()
    assert alloc.num_used_blocks == 0 and alloc.num_cached_free_blocks == 2


def test_the_hash_cache_keeps_concurrent_duplicates_private():
    alloc = BlockAllocator(12, 2, enable_prefix_caching="hash")
    a, b = BlockTable(alloc), BlockTable(alloc)
    a.append_tokens([1, 2, 3, 4], computed=False)
    b.append_tokens([1, 2, 3, 4], computed=False)
    a.cache_computed_blocks(4)
    b.cache_computed_blocks(4)
    assert b.block_ids != a.block_ids and alloc.num_used_blocks == 4    # the contrast the docs draw


def test_a_long_decode_stays_one_node():
    alloc = radix(num_blocks=40, block_size=2)
    table = table_with(alloc, [1, 2, 3])
    for token in range(10, 40):
        table.append_tokens([token])
    assert len(shape(alloc.radix)) == 1 and alloc.radix.num_cached_blocks == 16
    alloc.check_invariants()


def test_forked_samples_publish_their_own_branches():
    alloc = radix(num_blocks=16, block_size=2)
    parent = table_with(alloc, [1, 2, 3, 4])
    child = parent.fork()
    parent.append_tokens([5, 6])
    child.append_tokens([7, 8])
    assert shape(alloc.radix) == [((1, 2, 3, 4), 2), ((5, 6), 0), ((7, 8), 0)]
    alloc.check_invariants()
    parent.free()
    child.free()
    alloc.check_invariants()


# ---- blocks shared before they are published (forks, swap-ins of siblings) --------------
def test_a_shared_run_and_a_private_run_become_two_nodes():
    """Forked before publishing: the shared blocks have two holders, each table's own next
    block one. One node per run of the same holders, so eviction sees whole nodes."""
    alloc = radix(num_blocks=16, block_size=2)
    a = BlockTable(alloc)
    a.append_tokens([1, 2, 3, 4], computed=False)
    b = a.fork()
    a.append_tokens([5, 6], computed=False)
    b.append_tokens([7, 8], computed=False)
    a.cache_computed_blocks(6)
    assert shape(alloc.radix) == [((1, 2, 3, 4), 1), ((5, 6), 0)]
    alloc.check_invariants()
    b.cache_computed_blocks(6)
    assert shape(alloc.radix) == [((1, 2, 3, 4), 2), ((5, 6), 0), ((7, 8), 0)]
    alloc.check_invariants()
    a.free()
    b.free()
    alloc.check_invariants()
    assert alloc.radix.num_evictable == 4 and alloc.num_free_blocks == alloc.num_blocks


def test_a_shared_copy_is_not_switched_for_the_trees_block():
    """Two tables share private copies of a prefix the tree already holds (a fork before
    publishing). Switching one of them to the tree's blocks would leave the other holding
    blocks below a path it does not hold; so neither switches nor publishes until its copy is
    its own. Then it switches, publishes the rest, and every block comes back in the end."""
    alloc = radix(num_blocks=16, block_size=4)
    prefix = list(range(100, 112))
    first = table_with(alloc, prefix)                           # the tree: one node of 3 blocks
    a = BlockTable(alloc)
    a.append_tokens(prefix + [1, 2, 3, 4], computed=False)
    b = a.fork()
    for table in (a, b):
        table.cache_computed_blocks(16)
        alloc.check_invariants()
        assert table.num_published_blocks == 0 and not set(table.block_ids) & set(first.block_ids)
    assert alloc.radix.num_deduplicated == 0
    b.free()
    a.cache_computed_blocks(16)
    assert a.block_ids[:3] == first.block_ids and a.num_published_blocks == 4
    assert alloc.radix.num_deduplicated == 3 and shape(alloc.radix) == [(tuple(prefix), 1), ((1, 2, 3, 4), 0)]
    alloc.check_invariants()
    first.free()
    a.free()
    alloc.check_invariants()
    assert alloc.num_free_blocks == alloc.num_blocks
    assert sorted(alloc.allocate() for _ in range(alloc.num_blocks)) == list(range(alloc.num_blocks))


SWAPPED_SIBLINGS = [TraceRequest(9, 5, 0.01, tokens=(23, 31, 9, 22, 46, 41, 12, 7, 33)),
                    TraceRequest(8, 4, 0.03, tokens=(23, 31, 9, 22, 46, 41, 29, 12))]


def check_every_step(engine) -> None:
    engine.scheduler.allocator.check_invariants()


@pytest.mark.parametrize("policy", ["hash", "radix"])
def test_n2_samples_swapped_in_together_keep_the_cache_consistent(policy):
    """n = 2 samples preempted by swapping come back sharing device copies no cache holds,
    while the tree may still hold their prefix: the cache and the allocator agree after every
    step. (Under the radix policy this trace once stranded an unreferenced leaf: "no
    evictable leaf" from allocate.)"""
    res = simulate(SWAPPED_SIBLINGS, block_size=2, num_blocks=11, max_num_seqs=8, max_num_batched_tokens=64,
                   n=2, enable_prefix_caching=policy, preemption_mode="swap", num_host_blocks=64,
                   max_model_len=64, watermark=0.0, on_step=check_every_step)
    assert res.engine.scheduler.num_swap_ins > 0
    assert all(r.finished for r in res.requests) and res.metrics["leaked_blocks"] == 0


@pytest.mark.parametrize("policy", ["hash", "radix"])
def test_random_samples_and_beams_with_swapping_keep_the_cache_consistent(policy):
    """Seeded small traces (a shared system prompt, n = 2 samples or 2 beams, a pool that
    forces swapping), every step checked."""
    swaps = 0
    for seed in range(12):
        rng = random.Random(seed)
        system = [rng.randrange(50) for _ in range(rng.choice([4, 8, 12]))]
        trace = []
        for _ in range(rng.randint(3, 8)):
            tokens = tuple(system + [rng.randrange(50) for _ in range(rng.randint(0, 6))])
            trace.append(TraceRequest(len(tokens), rng.randint(2, 14), rng.choice([0, 0, 0.01, 0.05]), tokens=tokens))
        width = rng.choice([dict(n=2), dict(beam_width=2)])
        res = simulate(trace, block_size=rng.choice([2, 4]), num_blocks=rng.randint(26, 40), max_num_seqs=8,
                       max_num_batched_tokens=64, enable_prefix_caching=policy, preemption_mode="swap",
                       num_host_blocks=64, max_model_len=64, watermark=0.0, on_step=check_every_step, **width)
        assert all(r.finished for r in res.requests) and res.metrics["leaked_blocks"] == 0
        swaps += res.engine.scheduler.num_swap_ins
    assert swaps > 0


# ---- eviction ------------------------------------------------------------------------
def test_eviction_takes_the_least_recently_used_leaf_first_and_never_a_held_block():
    alloc = radix(num_blocks=8, block_size=2)
    tree = alloc.radix
    system = [1, 2, 3, 4]
    old = table_with(alloc, system + [5, 6, 0])
    new = table_with(alloc, system + [7, 8, 0], reuse=True)
    old.free()
    new.free()
    leaves = tree.evictable_leaves()
    assert [n.token_ids for n in leaves] == [(5, 6), (7, 8)]      # released first, evicted first
    victim = leaves[0].block_ids[-1]
    held = table_with(alloc, system + [7, 8, 9], reuse=True)         # holds system and (7, 8)
    assert [n.token_ids for n in tree.evictable_leaves()] == [(5, 6)]
    assert alloc.num_free_blocks == alloc.num_blocks - alloc.num_used_blocks
    taken = [alloc.allocate() for _ in range(alloc.num_free_blocks)]
    assert victim in taken and tree.num_evictions == 1               # the one evictable leaf went
    assert alloc.radix.match_prefix(system + [7, 8, 9])[0] == 6      # what is held stays
    with pytest.raises(NoFreeBlocksError):
        alloc.allocate()
    for b in taken:
        alloc.free(b)
    held.free()
    alloc.check_invariants()


def test_a_prefix_outlives_the_leaves_below_it():
    """Leaf-first: the system prompt's blocks go only after every branch below them."""
    alloc = radix(num_blocks=6, block_size=2)
    system = [1, 2, 3, 4]
    for suffix in ([5, 6], [7, 8]):
        table_with(alloc, system + suffix + [0], reuse=True).free()
    tree, order = alloc.radix, []
    while tree.num_evictable:
        victim = tree.evictable_leaves()[0]
        before, last = tree.num_evictions, victim.token_ids[-2:]
        alloc.allocate()                      # plain free blocks go first, then evictions
        if tree.num_evictions > before:
            order.append(last)
    assert order == [(5, 6), (7, 8), (3, 4), (1, 2)]
    alloc.check_invariants()


def test_reset_forgets_only_unreferenced_prefixes_and_counts_no_evictions():
    alloc = radix(num_blocks=8, block_size=2)
    kept = table_with(alloc, [1, 2, 3])
    table_with(alloc, [1, 2, 5, 6, 7], reuse=True).free()
    assert alloc.reset_prefix_cache() == 1                         # (5, 6): (1, 2) is still held
    assert alloc.radix.num_evictions == 0 and alloc.num_cached_blocks == 1
    kept.free()
    alloc.check_invariants()


# ---- workloads -------------------------------------------------------------------------
def test_multi_turn_histories_grow_with_the_simulated_answers():
    trace = multi_turn_trace(num_sessions=3, turns=3, system_prompt_len=20, seed=1)
    assert trace == multi_turn_trace(num_sessions=3, turns=3, system_prompt_len=20, seed=1)
    assert all(r.prompt_len == len(r.tokens) for r in trace)
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    system = trace[0].tokens[:20]
    assert all(r.tokens[:20] == system for r in trace)
    # Each later turn starts with an earlier request's prompt and that request's output.
    later = [r for r in trace if r.prompt_len > 150]
    for r in later:
        parents = [(i, p) for i, p in enumerate(trace) if p is not r and r.tokens[:p.prompt_len] == p.tokens
                   and p.prompt_len < r.prompt_len]
        if parents:
            i, p = max(parents, key=lambda ip: ip[1].prompt_len)
            answer = [dummy_token(f"r{i}", 0, p.prompt_len + k, 32000) for k in range(p.output_len)]
            assert list(r.tokens[p.prompt_len:p.prompt_len + p.output_len]) == answer
    assert sum(1 for r in trace if any(q is not r and r.tokens[:q.prompt_len] == q.tokens for q in trace)) == 6


def test_few_shot_and_branching_share_what_they_should():
    few = few_shot_trace(num_requests=30, num_examples=5, shots=(2, 4), instruction_len=16, seed=3)
    assert all(r.tokens[:16] == few[0].tokens[:16] for r in few)
    assert len({r.tokens[16:40] for r in few}) > 3                  # different orders and subsets
    tree = branching_trace(num_roots=2, branching=(3, 2), root_len=50, seed=2)
    assert len(tree) == 2 * (3 + 6)
    roots = {r.tokens[:50] for r in tree}
    assert len(roots) == 2
    level2 = [r for r in tree if any(q.tokens != r.tokens and r.tokens[:q.prompt_len] == q.tokens for q in tree)]
    assert len(level2) == 12
    with pytest.raises(ValueError, match="shots"):
        few_shot_trace(num_examples=3, shots=(2, 4))
    with pytest.raises(ValueError, match="branching"):
        branching_trace(branching=(3, 0))


def test_a_trace_with_tokens_survives_save_and_load(tmp_path):
    trace = branching_trace(num_roots=1, branching=(2,), root_len=10) + shared_prompt_trace(2, 5)
    save_trace(trace, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == trace
    (tmp_path / "bad.jsonl").write_text('{"prompt_len": 3, "output_len": 1, "tokens": [1, 2]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: 2 tokens for prompt_len 3"):
        load_trace(tmp_path / "bad.jsonl")


@pytest.mark.parametrize("make", [lambda: multi_turn_trace(num_sessions=8, turns=3, rate=None),
                                  lambda: branching_trace(num_roots=2, rate=None),
                                  lambda: few_shot_trace(num_requests=40, rate=None)])
def test_simulated_workloads_leak_nothing_and_share_concurrent_prefixes(make):
    trace = make()
    for policy in ("hash", "radix"):
        res = simulate(trace, num_blocks=400, block_size=16, enable_prefix_caching=policy, max_num_seqs=32)
        assert all(r.finished for r in res.requests)
        assert res.metrics["leaked_blocks"] == 0 and res.metrics["prefix_hit_rate"] > 0.1
        assert res.metrics["prefix_caching"] == policy
    # Everything arrives at once: requests prefill their shared prefix side by side, and the
    # tree keeps one copy of it (the hash cache keeps each request's own until it finishes).
    assert res.engine.scheduler.allocator.radix.num_deduplicated > 0


def test_prefix_bench_reports_every_policy(capsys):
    from labkit.bench import prefix
    assert prefix.main(["--scale", "0.03", "--workloads", "multi-turn,branching", "--num-blocks", "300",
                        "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["workload"], r["policy"]) for r in rows] == [
        (w, p) for w in ("multi-turn", "branching") for p in ("none", "hash", "radix")]
    for r in rows:
        assert r["leaked_blocks"] == 0
        assert (r["hit_rate"] > 0) == (r["policy"] != "none")
        assert (r["cache_us_per_request"] > 0) == (r["policy"] != "none")
    assert prefix.main(["--policies", "lru"]) == 2


@pytest.mark.parametrize("policy", ["hash", "radix"])
def test_prefix_bench_times_only_outermost_cache_calls(monkeypatch, policy):
    """The cache's methods call each other (the hash cache's acquire calls its match; acquire
    reaches revived through the allocator): a nested call's time is inside its caller's and
    must not count twice. With a clock that ticks once per read, each outermost call adds
    exactly one tick."""
    from types import SimpleNamespace

    from labkit.bench import prefix
    ticks = iter(range(10**6))
    monkeypatch.setattr(prefix, "time", SimpleNamespace(thread_time=lambda: next(ticks)))
    alloc = BlockAllocator(8, 2, enable_prefix_caching=policy)
    total = prefix.time_cache_calls(alloc.prefix_cache)
    table_with(alloc, [1, 2, 3, 4, 5]).free()
    before = total[0]
    BlockTable(alloc).reuse_cached_prefix([1, 2, 3, 4, 5], max_tokens=4)   # revives 2 blocks
    assert total[0] - before == 2           # acquire (match, revived inside it) and reused


# ---- the engine: greedy tokens with the radix cache == without a cache -------------------
def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def shared_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(37)]
    prompts = [system + [rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 16, 23)]
    prompts.append(prompts[1] + [rng.randrange(3, vocab) for _ in range(12)])    # a follow-up turn
    prompts.append(list(prompts[2]))                                           # the same prompt again
    prompts.append([rng.randrange(3, vocab) for _ in range(30)])              # nothing shared
    return prompts


RADIX_STRESSES = {
    "default": dict(),
    "small-blocks": dict(block_size=4),
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(num_blocks=20, block_size=8, max_num_batched_tokens=64),
    "static": dict(policy="static"),
    "swap": dict(num_blocks=20, block_size=8, max_num_batched_tokens=64, preemption_mode="swap",
                 num_host_blocks=64),
}


SEEDED_SAMPLES = SamplingParams(max_tokens=8, n=3, temperature=0.8, seed=5)


@pytest.fixture(scope="module")
def tiny_reference():
    llm = LLM("tiny-llama", num_blocks=256, block_size=16, enable_prefix_caching=False)
    prompts = shared_prompts(load_model("tiny-llama").config.vocab_size)
    outs = llm.generate(prompts, greedy(20), use_tqdm=False)
    samples = llm.generate(prompts[:2], SEEDED_SAMPLES, use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs], [[c.token_ids for c in o.outputs] for o in samples]


@pytest.mark.parametrize("stress", RADIX_STRESSES)
def test_tiny_greedy_with_radix_equals_no_cache(tiny_reference, stress):
    prompts, reference, samples = tiny_reference
    options = dict(num_blocks=256, block_size=16)
    options.update(RADIX_STRESSES[stress])
    llm = LLM("tiny-llama", prefix_caching="radix", **options)
    # Twice: the first pass shares among concurrent requests, the second hits a warm tree.
    for _ in range(2):
        outs = llm.generate(prompts, greedy(20), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
    if stress != "static":      # n > 1 forks the prompt's blocks: the samples share the tree's
        n_outs = llm.generate(prompts[:2], SEEDED_SAMPLES, use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in n_outs] == samples
    alloc = llm.engine.scheduler.allocator
    alloc.check_invariants()
    assert alloc.num_used_blocks == 0 and not llm.engine.scheduler.has_unfinished
    if stress != "static":
        assert llm.engine.scheduler.num_cached_prompt_tokens > 0
    if stress == "preemption":
        assert llm.stats()["num_preemptions"] > 0
    if stress == "swap":
        assert llm.engine.scheduler.num_swap_ins > 0


def test_llm_prefix_caching_keyword():
    llm = LLM("tiny-llama", num_blocks=32, prefix_caching="radix")
    assert llm.engine.scheduler.allocator.radix is not None
    assert LLM("tiny-llama", num_blocks=32, enable_prefix_caching="radix").engine.scheduler.allocator.radix
    with pytest.raises(ValueError, match="disagree"):
        LLM("tiny-llama", num_blocks=32, enable_prefix_caching=False, prefix_caching="radix")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM("tiny-llama", num_blocks=32, enable_prefix_caching="lru")


@pytest.mark.slow
def test_smollm2_greedy_with_radix_equals_no_cache():
    system = ("You are a helpful assistant for a course on operating systems. "
              "Answer briefly and precisely. ")
    questions = ["What is a page table?", "What is copy-on-write?", "Why do caches use LRU?"]
    plain = LLM("smollm2-135m", num_blocks=128, enable_prefix_caching=False)
    tree = LLM("smollm2-135m", num_blocks=128, prefix_caching="radix")
    prompts = [system + q for q in questions]
    ref = plain.generate(prompts, greedy(12), use_tqdm=False)
    got = tree.generate(prompts, greedy(12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    # The next turn holds the answer: it reuses the whole history's blocks.
    follow = [p + o.outputs[0].text + " Give an example." for p, o in zip(prompts, ref)]
    ref2 = plain.generate(follow, greedy(12), use_tqdm=False)
    got2 = tree.generate(follow, greedy(12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got2] == [o.outputs[0].token_ids for o in ref2]
    assert min(o.num_cached_tokens for o in got2) >= 16
    alloc = tree.engine.scheduler.allocator
    alloc.check_invariants()
    assert alloc.num_used_blocks == 0
