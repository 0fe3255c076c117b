"""Cache salts (vLLM's ``cache_salt``): a salted prompt's cached blocks are found only by
requests with the same salt, under both prefix-cache policies.

* block tables: same salt shares, another salt or none does not; a fork and a copy to the
  host pool keep the salt; the radix tree's entries hash as the hash cache chains them;
  a salt's tree is dropped with its last block (many salts do not pile up roots);
* the engine: ``LLM.generate`` with vLLM's prompt dicts, n > 1, both policies; every block
  free at the end, invariants checked throughout.
"""

from __future__ import annotations

import pytest

from labkit.memory import BlockAllocator, BlockTable, hash_prefix, root_hash

BS = 4
PROMPT = list(range(100, 117))            # 4 full blocks and one token


def publish(alloc: BlockAllocator, salt: str | None, tokens=PROMPT) -> BlockTable:
    table = BlockTable(alloc, salt)
    table.append_tokens(tokens)            # computed: published at once
    return table


@pytest.mark.parametrize("policy", ["hash", "radix"])
def test_only_the_same_salt_reuses_a_prefix(policy):
    alloc = BlockAllocator(64, BS, policy)
    owner = publish(alloc, "alice")
    for salt, hits in (("alice", 4), ("bob", 0), (None, 0), ("alice\x00", 0), ("", 0)):
        probe = BlockTable(alloc, salt)
        assert len(probe.peek_cached_prefix(PROMPT)) == hits, (salt, policy)
        assert probe.reuse_cached_prefix(PROMPT, len(PROMPT) - 1) == hits * BS
        probe.free()
        alloc.check_invariants()
    unsalted = publish(alloc, None)
    assert len(BlockTable(alloc, None).peek_cached_prefix(PROMPT)) == 4
    assert len(BlockTable(alloc, "alice").peek_cached_prefix(PROMPT)) == 4     # alice's own, still
    owner.free()
    unsalted.free()
    alloc.check_invariants()
    assert alloc.num_free_blocks == alloc.num_blocks


@pytest.mark.parametrize("policy", ["hash", "radix"])
def test_fork_and_copy_keep_the_salt(policy):
    alloc, host = BlockAllocator(64, BS, policy), BlockAllocator(64, BS, policy)
    table = publish(alloc, "alice")
    child = table.fork()
    moved, _ = table.copy_to(host, {})
    assert child.salt == moved.salt == "alice"
    moved.cache_computed_blocks(len(PROMPT))
    assert len(BlockTable(host, "alice").peek_cached_prefix(PROMPT)) == 4
    assert BlockTable(host, "bob").peek_cached_prefix(PROMPT) == []
    for t in (table, child):
        t.free()
    moved.free()
    for a in (alloc, host):
        a.check_invariants()
        assert a.num_free_blocks == a.num_blocks


def test_the_salt_starts_the_hash_chain_and_the_radix_tree_agrees():
    assert root_hash(None) == 0 and root_hash("a") != root_hash("b") != 0
    chains = {salt: hash_prefix(PROMPT, BS, salt) for salt in (None, "alice", "bob")}
    assert len({h for chain in chains.values() for h in chain}) == 12            # no block shared
    radix = BlockAllocator(64, BS, "radix")
    hashed = BlockAllocator(64, BS, "hash")
    for salt in ("alice", None):
        tables = [publish(radix, salt), publish(hashed, salt)]
        for a, t in zip((radix, hashed), tables):
            assert [a.cache_entry(b).block_hash for b in t.block_ids[:4]] == chains[salt]


def test_a_salt_tree_goes_with_its_last_block():
    """A thousand salts, each a cached prompt, then evicted: no root is left behind."""
    alloc = BlockAllocator(16, BS, "radix")
    for i in range(1000):
        publish(alloc, f"salt-{i}", PROMPT[:8]).free()       # 2 blocks each; the pool recycles them
    tree = alloc.radix
    assert len(tree._roots) <= 1 + 16 // 2
    alloc.reset_prefix_cache()
    assert list(tree._roots.values()) == [tree.root]
    alloc.check_invariants()


# ---- through the engine ----------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["hash", "radix"])
def test_generate_with_prompt_dicts_and_salts(policy):
    from labkit import LLM, SamplingParams
    llm = LLM("tiny-llama", num_blocks=64, enable_prefix_caching=policy)
    params = SamplingParams(max_tokens=3, temperature=0, n=2)
    ids = list(range(10, 60))                # 50 tokens: 3 full blocks of 16 reusable

    def cached(prompt) -> int:
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        assert out.error is None and len(out.outputs) == 2
        llm.allocator.check_invariants()
        return out.num_cached_tokens

    assert cached({"prompt_token_ids": ids, "cache_salt": "alice"}) == 0
    assert cached({"prompt_token_ids": ids, "cache_salt": "alice"}) == 48
    assert cached({"prompt_token_ids": ids, "cache_salt": "bob"}) == 0
    assert cached(ids) == 0 and cached({"prompt_token_ids": ids}) == 48          # unsalted: its own namespace
    text = "the same words under two salts " * 2
    assert cached({"prompt": text, "cache_salt": "x"}) == 0
    assert cached({"prompt": text, "cache_salt": "y"}) == 0
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt": "x", "cache_salt": ""}, params)
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "x", "multi_modal_data": {}}, params)
    llm.reset_prefix_cache()
    assert llm.allocator.num_free_blocks == llm.allocator.num_blocks
