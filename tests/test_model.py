"""The paged Llama against Hugging Face transformers, the KV cache, and the sampler.

Fast tests use the random ``tiny-llama`` (and small random Qwen2 / RoPE-scaled configs);
the ``slow`` ones use SmolLM2-135M (fetched and cached on first use).
"""

from __future__ import annotations

import random

import pytest
import torch

from labkit.model import (
    KVCache,
    ModelRunner,
    SamplingRow,
    SeqChunk,
    kv_bytes_per_token,
    load_model,
    make_generator,
    num_blocks_for_budget,
    probabilities,
    random_model,
    sample,
    tiny_config,
)
from labkit.model.runner import pack_chunks, pack_chunks_reference

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama")


@pytest.fixture(scope="module")
def tiny_hf(tiny):
    return tiny.hf_model()


@pytest.fixture(scope="module")
def runner(tiny):
    return ModelRunner(tiny, block_size=4, num_blocks=128, attention_backend="torch")


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """Logits at every position of ``ids`` ([len, vocab])."""
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def prompt(n: int, seed: int, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


class Blocks:
    """A toy block allocator handing out shuffled, non-contiguous physical blocks."""

    def __init__(self, num_blocks: int, seed: int = 0):
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def take(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        return out


def blocks_for(n_tokens: int, block_size: int) -> int:
    return -(-n_tokens // block_size)


# ------------------------------------------------------------------------------------ logits


def test_full_prefill_matches_hf(runner, tiny_hf):
    alloc = Blocks(runner.num_blocks, seed=1)
    for n, seed in ((1, 0), (7, 1), (33, 2), (100, 3)):
        ids = prompt(n, seed)
        out = runner.execute([SeqChunk(ids, 0, alloc.take(blocks_for(n, runner.block_size)))])
        assert out.shape == (1, runner.vocab_size) and out.dtype == torch.float32
        torch.testing.assert_close(out[0], hf_logits(tiny_hf, ids)[-1], atol=ATOL, rtol=0)


def test_batched_prefill_matches_hf(runner, tiny_hf):
    alloc = Blocks(runner.num_blocks, seed=2)
    prompts = [prompt(n, 10 + n) for n in (5, 17, 2, 40)]
    chunks = [SeqChunk(p, 0, alloc.take(blocks_for(len(p), 4))) for p in prompts]
    out = runner.execute(chunks)
    for row, p in zip(out, prompts):
        torch.testing.assert_close(row, hf_logits(tiny_hf, p)[-1], atol=ATOL, rtol=0)


def test_chunked_prefill_matches_hf(runner, tiny_hf):
    ids = prompt(45, 4)
    ref = hf_logits(tiny_hf, ids)
    blocks = Blocks(runner.num_blocks, seed=3).take(blocks_for(45, 4))
    cuts = [0, 6, 7, 20, 45]  # chunks of 6, 1, 13 and 25 tokens, not aligned to blocks
    for a, b in zip(cuts, cuts[1:]):
        out = runner.execute([SeqChunk(ids[a:b], a, blocks)])
        torch.testing.assert_close(out[0], ref[b - 1], atol=ATOL, rtol=0)
    # A chunk that does not ask for logits returns none.
    assert runner.execute([SeqChunk(ids[:10], 0, blocks, compute_logits=False)]).shape == (0, runner.vocab_size)


def test_decode_steps_match_hf(runner, tiny_hf):
    ids = prompt(30, 5)
    ref = hf_logits(tiny_hf, ids)
    blocks = Blocks(runner.num_blocks, seed=4).take(blocks_for(30, 4))
    out = runner.execute([SeqChunk(ids[:12], 0, blocks)])
    torch.testing.assert_close(out[0], ref[11], atol=ATOL, rtol=0)
    for pos in range(12, 30):
        out = runner.execute([SeqChunk([ids[pos]], pos, blocks[: blocks_for(pos + 1, 4)])])
        torch.testing.assert_close(out[0], ref[pos], atol=ATOL, rtol=0)


def test_mixed_batch_one_execute(runner, tiny_hf):
    """One sequence prefills while others decode, in one forward; logits come back in chunk order."""
    alloc = Blocks(runner.num_blocks, seed=5)
    seqs = [prompt(n, 20 + n) for n in (9, 14, 23, 31)]
    blocks = [alloc.take(blocks_for(len(s), 4)) for s in seqs]
    # Prefill everything but the last token of seqs 0-2 (no logits wanted), nothing of seq 3.
    runner.execute([SeqChunk(s[:-1], 0, b, compute_logits=False) for s, b in zip(seqs[:3], blocks[:3])])
    chunks = [
        SeqChunk(seqs[3][:20], 0, blocks[3], compute_logits=True),       # prefill chunk
        SeqChunk([seqs[0][-1]], len(seqs[0]) - 1, blocks[0]),            # decode
        SeqChunk([seqs[1][-1]], len(seqs[1]) - 1, blocks[1], compute_logits=False),  # decode, no logits
        SeqChunk([seqs[2][-1]], len(seqs[2]) - 1, blocks[2]),            # decode
    ]
    # The runner packs in the scheduler's order (prefills first) and never re-sorts.
    with pytest.raises(ValueError, match="prefill chunks must come before"):
        runner.execute([chunks[1], chunks[0]])
    out = runner.execute(chunks)
    assert out.shape == (3, runner.vocab_size)
    torch.testing.assert_close(out[0], hf_logits(tiny_hf, seqs[3])[19], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], hf_logits(tiny_hf, seqs[0])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[2], hf_logits(tiny_hf, seqs[2])[-1], atol=ATOL, rtol=0)
    # The rest of seq 3 (a final chunk) alongside the next decode of seq 1.
    nxt = 7
    out = runner.execute([SeqChunk(seqs[3][20:], 20, blocks[3]),
                          SeqChunk([nxt], len(seqs[1]), blocks[1] + alloc.take(1))])
    torch.testing.assert_close(out[0], hf_logits(tiny_hf, seqs[3])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], hf_logits(tiny_hf, seqs[1] + [nxt])[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [1, 8, 16, 64])
def test_block_sizes_and_shuffled_blocks(tiny, tiny_hf, block_size):
    r = ModelRunner(tiny, block_size=block_size, num_blocks=512 // block_size + 8, attention_backend="torch")
    ids = prompt(50, 6)
    ref = hf_logits(tiny_hf, ids)
    blocks = Blocks(r.num_blocks, seed=block_size).take(blocks_for(50, block_size))
    out = r.execute([SeqChunk(ids[:37], 0, blocks)])
    torch.testing.assert_close(out[0], ref[36], atol=ATOL, rtol=0)
    for pos in range(37, 50):
        out = r.execute([SeqChunk([ids[pos]], pos, blocks)])  # extra trailing block ids are fine
        torch.testing.assert_close(out[0], ref[pos], atol=ATOL, rtol=0)


def test_copy_on_write_fork(runner, tiny_hf):
    """Two sequences share a prefix's blocks; the shared partial block is copied before a write."""
    bs = runner.block_size
    alloc = Blocks(runner.num_blocks, seed=7)
    base = prompt(10, 8)  # 2 full blocks + 2 tokens in a third
    a_blocks = alloc.take(3)
    runner.execute([SeqChunk(base, 0, a_blocks)])
    b_blocks = a_blocks[:2] + alloc.take(1)
    a_next, b_next = 11, 99
    out = runner.execute([SeqChunk([a_next], 10, a_blocks), SeqChunk([b_next], 10, b_blocks)],
                         copies=[(a_blocks[2], b_blocks[2])])
    torch.testing.assert_close(out[0], hf_logits(tiny_hf, base + [a_next])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], hf_logits(tiny_hf, base + [b_next])[-1], atol=ATOL, rtol=0)
    assert bs == 4


def test_copy_blocks_all_layers_and_simultaneous():
    cache = KVCache(num_layers=3, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8)
    cache.data.copy_(torch.randn_like(cache.data))
    before = cache.data.clone()
    cache.copy_blocks([(1, 4), (4, 5), (0, 2)])  # 4 -> 5 reads block 4 before it is overwritten
    for layer in range(3):  # the per-layer caches are views of the one tensor
        assert cache.k_caches[layer].data_ptr() == cache.data[layer, 0].data_ptr()
        assert cache.v_caches[layer].data_ptr() == cache.data[layer, 1].data_ptr()
    torch.testing.assert_close(cache.data[:, :, 4], before[:, :, 1], rtol=0, atol=0)
    torch.testing.assert_close(cache.data[:, :, 5], before[:, :, 4], rtol=0, atol=0)
    torch.testing.assert_close(cache.data[:, :, 2], before[:, :, 0], rtol=0, atol=0)
    for b in (0, 1, 3):
        torch.testing.assert_close(cache.data[:, :, b], before[:, :, b], rtol=0, atol=0)
    cache.copy_blocks([])  # no-op


def test_kv_sizing_helpers(tiny):
    smol = tiny_config(num_hidden_layers=30, num_key_value_heads=3, num_attention_heads=9, hidden_size=576)
    assert kv_bytes_per_token(smol) == 2 * 30 * 3 * 64 * 4
    assert kv_bytes_per_token(smol, torch.bfloat16) == 2 * 30 * 3 * 64 * 2
    assert num_blocks_for_budget(smol, 16, 1 << 30) == (1 << 30) // (46080 * 16)
    cache = KVCache.from_config(tiny.config, block_size=16, budget_bytes=1 << 20)
    assert cache.num_blocks == (1 << 20) // (kv_bytes_per_token(tiny.config) * 16)
    assert cache.nbytes <= 1 << 20 and cache.bytes_per_block == kv_bytes_per_token(tiny.config) * 16
    assert cache.k_caches[0].shape == (cache.num_blocks, 16, 2, 16)
    r = ModelRunner(tiny, block_size=8, kv_budget_bytes=1 << 20, attention_backend="torch")
    assert r.num_blocks == (1 << 20) // (kv_bytes_per_token(tiny.config) * 8)
    with pytest.raises(ValueError):
        KVCache.from_config(tiny.config, block_size=16, budget_bytes=10)


@pytest.mark.parametrize("seed", range(40))
def test_packing_equals_the_plain_loop_reference(seed):
    """The vectorized packing builds exactly the index tensors the one-token-at-a-time
    definition does, on random plans: prefills (chunks of any length, from any computed
    position) then decodes, shuffled blocks, spare trailing block ids, logits or not."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    num_blocks = 512
    chunks = []
    num_prefills = rng.randint(0, 4)
    for is_prefill in [True] * num_prefills + [False] * rng.randint(0 if num_prefills else 1, 5):
        computed = rng.randint(0, 60)
        num_new = rng.randint(1, 40) if is_prefill else 1
        needed = -(-(computed + num_new) // block_size)
        block_ids = rng.sample(range(num_blocks), needed + rng.randint(0, 2))
        chunks.append(SeqChunk([rng.randrange(384) for _ in range(num_new)], computed, block_ids,
                               compute_logits=rng.random() < 0.7, is_prefill=is_prefill))
    packed = pack_chunks(chunks, block_size, num_blocks, max_model_len=512)
    ref = pack_chunks_reference(chunks, block_size)
    assert packed.positions.tolist() == ref["positions"]
    assert packed.slot_mapping.tolist() == ref["slot_mapping"]
    assert packed.context_lens.tolist() == ref["context_lens"]
    assert packed.query_start_loc.tolist() == ref["query_start_loc"]
    for row, ref_row in zip(packed.block_tables.tolist(), ref["block_tables"]):
        assert row[:len(ref_row)] == ref_row      # beyond: padding, never read past context_lens
    assert packed.input_ids.tolist() == [t for c in chunks for t in c.token_ids]
    assert packed.num_prefills == sum(c.is_prefill for c in chunks)
    ends = [q - 1 for q, c in zip(ref["query_start_loc"][1:], chunks) if c.compute_logits]
    assert packed.logits_indices.tolist() == ends


def test_packing_rejects_plans_the_kernels_cannot_run():
    with pytest.raises(ValueError, match="exactly one token"):
        pack_chunks([SeqChunk([1, 2], 0, [0], is_prefill=False)], 4, 8, 512)
    with pytest.raises(ValueError, match="before decode"):
        pack_chunks([SeqChunk([1], 3, [0]), SeqChunk([1, 2], 0, [1])], 4, 8, 512)


def test_runner_attributes_and_errors(runner, tiny):
    assert runner.max_model_len == 512 and runner.vocab_size == 384
    assert runner.eos_token_ids == [257] and runner.tokenizer is tiny.tokenizer
    assert runner.config.model_type == "llama"
    assert runner.execute([]).shape == (0, 384)
    with pytest.raises(ValueError, match="blocks"):
        runner.execute([SeqChunk([1, 2, 3, 4, 5], 0, [0])])  # 5 tokens need 2 blocks of 4
    with pytest.raises(ValueError, match="max_model_len"):
        runner.execute([SeqChunk([1], 512, list(range(129)))])
    with pytest.raises(ValueError):
        runner.execute([SeqChunk([], 0, [0])])
    with pytest.raises(ValueError, match="block ids"):
        runner.execute([SeqChunk([1, 2], 0, [runner.num_blocks])])


def test_custom_attention_ops_object(tiny, tiny_hf):
    """Any object with reshape_and_cache / decode / prefill can serve as the backend."""
    from labkit.kernels import get_attention_ops

    ops = get_attention_ops("torch")
    calls = []

    class Counting:
        name = "counting"

        def reshape_and_cache(self, *a):
            calls.append("write")
            return ops.reshape_and_cache(*a)

        def decode(self, *a):
            calls.append("decode")
            return ops.decode(*a)

        def prefill(self, *a):
            calls.append("prefill")
            return ops.prefill(*a)

    r = ModelRunner(tiny, block_size=4, num_blocks=16, attention_backend=Counting())
    ids = prompt(6, 9)
    r.execute([SeqChunk(ids[:5], 0, [3, 1])])
    out = r.execute([SeqChunk(ids[5:], 5, [3, 1])])
    torch.testing.assert_close(out[0], hf_logits(tiny_hf, ids)[-1], atol=ATOL, rtol=0)
    assert calls.count("prefill") == 2 and calls.count("decode") == 2 and calls.count("write") == 4
    with pytest.raises(TypeError):
        ModelRunner(tiny, num_blocks=4, attention_backend=object())


def test_bf16_model_close_to_hf_bf16():
    m = load_model("tiny-llama", dtype=torch.bfloat16)
    hf = m.hf_model()
    r = ModelRunner(m, block_size=4, num_blocks=32, attention_backend="torch", dtype=torch.bfloat16)
    ids = prompt(30, 12)
    ref = hf_logits(hf, ids)
    out = r.execute([SeqChunk(ids[:29], 0, list(range(8)))])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out[0], ref[28], atol=0.5, rtol=0.02)
    out = r.execute([SeqChunk(ids[29:], 29, list(range(8)))])
    torch.testing.assert_close(out[0], ref[29], atol=0.5, rtol=0.02)


# ------------------------------------------------------------------ other Llama-family configs


def _random_runner_and_hf(config, seed=3):
    loaded = random_model(config, seed=seed)
    return ModelRunner(loaded, block_size=8, num_blocks=64, attention_backend="torch"), loaded.hf_model()


@pytest.mark.parametrize("kind", ["qwen2", "mistral", "llama3-rope", "linear-rope", "tied-mha"])
def test_llama_family_variants_match_hf(kind):
    from transformers import MistralConfig, Qwen2Config

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if kind == "qwen2":  # q/k/v biases, tied embeddings
        config = Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6)
    elif kind == "mistral":
        config = MistralConfig(**common, sliding_window=None, head_dim=32)
    elif kind == "llama3-rope":
        config = tiny_config(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                             rope_theta=500000.0)
    elif kind == "linear-rope":
        config = tiny_config(rope_scaling={"rope_type": "linear", "factor": 4.0})
    else:
        config = tiny_config(num_key_value_heads=4, tie_word_embeddings=True)
    runner, hf = _random_runner_and_hf(config)
    ids = prompt(40, 11)
    ref = hf_logits(hf, ids)
    blocks = Blocks(runner.num_blocks, seed=11).take(5)
    out = runner.execute([SeqChunk(ids[:25], 0, blocks)])
    torch.testing.assert_close(out[0], ref[24], atol=ATOL, rtol=0)
    for pos in range(25, 40):
        out = runner.execute([SeqChunk([ids[pos]], pos, blocks)])
        torch.testing.assert_close(out[0], ref[pos], atol=ATOL, rtol=0)
    if kind == "qwen2":
        assert runner.model.layers[0].attn.qkv_proj.bias is not None


# ------------------------------------------------------------------------- greedy generation


def greedy_generate(runner: ModelRunner, prompts: list[list[int]], max_new: int, chunk: int = 10_000,
                    seed: int = 0) -> list[list[int]]:
    """A minimal engine loop: chunked prefill of all prompts together, then batched decode."""
    bs = runner.block_size
    alloc = Blocks(runner.num_blocks, seed=seed)
    need = [blocks_for(len(p) + max_new, bs) for p in prompts]
    blocks = [alloc.take(n) for n in need]
    done = [0] * len(prompts)  # prompt tokens computed
    outs: list[list[int]] = [[] for _ in prompts]
    rows = [SamplingRow() for _ in prompts]
    while any(len(o) < max_new for o in outs):
        prefills, decodes, who_prefill, who_decode = [], [], [], []   # the runner takes prefills first
        for i, p in enumerate(prompts):
            if len(outs[i]) >= max_new:
                continue
            if done[i] < len(p):  # still prefilling (chunked)
                end = min(len(p), done[i] + chunk)
                prefills.append(SeqChunk(p[done[i]:end], done[i], blocks[i], compute_logits=end == len(p),
                                         is_prefill=True))
                done[i] = end
                if end == len(p):
                    who_prefill.append(i)
            else:
                pos = len(p) + len(outs[i]) - 1
                decodes.append(SeqChunk([outs[i][-1]], pos, blocks[i], is_prefill=False))
                who_decode.append(i)
        chunks, who = prefills + decodes, who_prefill + who_decode
        logits = runner.execute(chunks)
        for i, tok in zip(who, sample(logits, [rows[i] for i in who])):
            outs[i].append(tok)
    return outs


def hf_greedy(hf, ids: list[int], max_new: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def test_greedy_generation_matches_hf_generate(runner, tiny_hf):
    prompts = [prompt(n, 30 + n) for n in (3, 19, 8, 41)]
    ours = greedy_generate(runner, prompts, max_new=24, chunk=7)
    for p, o in zip(prompts, ours):
        assert o == hf_greedy(tiny_hf, p, 24)


# ------------------------------------------------------------------------------- the sampler


def test_sampler_greedy_is_argmax():
    logits = torch.randn(6, 1000)
    assert sample(logits, [SamplingRow() for _ in range(6)]) == logits.argmax(-1).tolist()
    rows = [SamplingRow(), SamplingRow(temperature=1.0, generator=make_generator(0)), SamplingRow(temperature=0.0)]
    out = sample(logits[:3], rows)
    assert out[0] == logits[0].argmax().item() and out[2] == logits[2].argmax().item()
    assert SamplingRow(temperature=1e-7).greedy


def test_sampler_seed_reproducible_regardless_of_batch():
    torch.manual_seed(0)
    steps = [torch.randn(5, 500) for _ in range(20)]

    def run(batch_rows: list[int]) -> list[int]:
        row = SamplingRow(temperature=0.9, top_p=0.95, top_k=50, generator=make_generator(1234))
        others = [SamplingRow(temperature=1.3, generator=make_generator(k)) for k in range(5)]
        toks = []
        for logits in steps:
            rows = [others[i] if i != batch_rows[0] else row for i in range(len(batch_rows))]
            picked = logits[batch_rows]  # the seeded row sees the same logits, at another index
            toks.append(sample(picked, rows)[batch_rows[0]])
        return toks

    a = run([0, 1, 2])
    b = run([0])
    c = run([0, 4, 3, 2, 1])
    assert a == b == c
    assert len(set(a)) > 1  # actually random


def test_sampler_top_k_and_top_p_restrict_support():
    torch.manual_seed(1)
    logits = torch.randn(1, 200) * 3
    top5 = set(logits[0].topk(5).indices.tolist())
    g = make_generator(7)
    seen = {sample(logits, [SamplingRow(temperature=2.0, top_k=5, generator=g)])[0] for _ in range(300)}
    assert seen <= top5 and len(seen) >= 3
    probs = logits.softmax(-1)[0]
    sorted_p, order = probs.sort(descending=True)
    k = int((sorted_p.cumsum(0) < 0.6).sum()) + 1  # smallest prefix reaching 0.6
    nucleus = set(order[:k].tolist())
    seen = {sample(logits, [SamplingRow(temperature=1.0, top_p=0.6, generator=g)])[0] for _ in range(300)}
    assert seen <= nucleus
    p = probabilities(logits, [SamplingRow(temperature=1.0, top_p=0.6)])[0]
    assert set(p.nonzero().squeeze(1).tolist()) == nucleus
    torch.testing.assert_close(p.sum(), torch.tensor(1.0))
    # top_p so small that only the most likely token is left: same as greedy
    assert sample(logits, [SamplingRow(temperature=1.0, top_p=1e-6, generator=g)]) == [order[0].item()]


def test_sampler_temperature_shapes_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p1 = probabilities(logits, [SamplingRow(temperature=1.0)])[0]
    torch.testing.assert_close(p1, logits.softmax(-1)[0])
    p_hot = probabilities(logits, [SamplingRow(temperature=10.0)])[0]
    p_cold = probabilities(logits, [SamplingRow(temperature=0.1)])[0]
    assert p_cold[0] > p1[0] > p_hot[0]
    g = make_generator(3)
    draws = [sample(logits, [SamplingRow(temperature=1.0, generator=g)])[0] for _ in range(2000)]
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / 2000
    assert (freq - p1).abs().max() < 0.05


@pytest.mark.parametrize("bad", [dict(temperature=-0.5), dict(temperature=float("nan")),
                                 dict(temperature=float("inf")), dict(top_p=0.0), dict(top_p=1.5),
                                 dict(top_k=-2), dict(top_k=2.5)])
def test_sampler_rejects_invalid_settings(bad):
    with pytest.raises(ValueError):
        SamplingRow(**bad)


def test_sampler_shape_mismatch():
    with pytest.raises(ValueError):
        sample(torch.randn(2, 10), [SamplingRow()])


# ------------------------------------------------------------------------- SmolLM2-135M (slow)


@pytest.fixture(scope="module")
def smol():
    return load_model("smollm2-135m")


@pytest.mark.slow
def test_smollm2_logits_match_hf(smol):
    hf = smol.hf_model()
    r = ModelRunner(smol, block_size=16, num_blocks=64, attention_backend="torch")
    tok = smol.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):\n    "
             "\"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:"]
    alloc = Blocks(r.num_blocks, seed=0)
    for text in texts:
        ids = tok(text).input_ids
        ref = hf_logits(hf, ids)
        blocks = alloc.take(blocks_for(len(ids), 16))
        half = len(ids) // 2
        out = r.execute([SeqChunk(ids[:half], 0, blocks, compute_logits=False)])
        out = r.execute([SeqChunk(ids[half:-1], half, blocks)])
        torch.testing.assert_close(out[0], ref[-2], atol=ATOL, rtol=0)
        out = r.execute([SeqChunk(ids[-1:], len(ids) - 1, blocks)])
        torch.testing.assert_close(out[0], ref[-1], atol=ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_smollm2_greedy_matches_hf_generate(smol, backend):
    """The readable reference and the CPU fast path (packed weights, C++ or Numba decode,
    prompts row by row through the same loop or SDPA) both give Transformers' greedy tokens
    in fp32."""
    if backend == "cpu":
        _cpu_backend_or_skip()
    hf = smol.hf_model()
    r = ModelRunner(smol, block_size=16, num_blocks=128, attention_backend=backend)
    tok = smol.tokenizer
    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "List three prime numbers and explain why they are prime."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for q in questions]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
    ours = greedy_generate(r, prompts, max_new=24, chunk=16)
    for p, o in zip(prompts, ours):
        assert o == hf_greedy(hf, p, 24)


# ------------------------------------------------- the CPU fast path (packed oneDNN linears)


def _cpu_backend_or_skip():
    from labkit.kernels.paged_decode_attention_cpu import HAS_NUMBA
    if not HAS_NUMBA:
        pytest.skip("the 'cpu' backend needs Numba")


@pytest.mark.parametrize("layout", ["auto", "panels", "onednn"])
def test_cpu_backend_packs_linears_and_matches_hf(tiny, tiny_hf, layout, monkeypatch):
    """The fast path (packed weights: labkit's panels or oneDNN's; C++ decode) gives HF's
    logits, prefill and decode, and the readable "torch" backend keeps the plain weights."""
    _cpu_backend_or_skip()
    from labkit.kernels import cpu_extension
    from labkit.model.llama import Linear, linear_layout

    if layout == "panels" and cpu_extension.load() is None:
        pytest.skip(f"panels need the C++ kernels: {cpu_extension.status()[1]}")
    if layout == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN (mkldnn)")
    monkeypatch.setenv("LABKIT_CPU_LINEAR", layout)
    fast = ModelRunner(tiny, block_size=4, num_blocks=64, attention_backend="cpu")
    expected = linear_layout(torch.device("cpu"), torch.float32)[0]
    assert fast.linear_layout == expected and (layout == "auto" or expected == layout)
    linears = [m for m in fast.model.modules() if isinstance(m, Linear)]
    assert linears and all((m.packed is not None) == (expected == "onednn") for m in linears)
    assert all((m.panels is not None) == (expected == "panels") and (m.weight_t is None) == bool(expected)
               for m in linears)
    plain = ModelRunner(tiny, block_size=4, num_blocks=64, attention_backend="torch")
    assert not plain.packed_linears and plain.linear_layout is None
    assert all(m.packed is None and m.panels is None for m in plain.model.modules() if isinstance(m, Linear))
    ids = prompt(37, 5)
    ref = hf_logits(tiny_hf, ids)
    blocks = Blocks(fast.num_blocks, seed=2).take(blocks_for(len(ids), 4))
    out = fast.execute([SeqChunk(ids[:30], 0, blocks)])
    torch.testing.assert_close(out[0], ref[29], atol=ATOL, rtol=0)
    for i in range(30, len(ids)):   # decode steps read the paged cache through the Numba kernel
        out = fast.execute([SeqChunk([ids[i]], i, blocks)])
        torch.testing.assert_close(out[0], ref[i], atol=ATOL, rtol=0)


def test_cpu_backend_greedy_generation_matches_hf_generate(tiny, tiny_hf):
    _cpu_backend_or_skip()
    fast = ModelRunner(tiny, block_size=4, num_blocks=128, attention_backend="cpu")
    prompts = [prompt(n, 60 + n) for n in (3, 19, 8, 41)]
    ours = greedy_generate(fast, prompts, max_new=24, chunk=7)
    for p, o in zip(prompts, ours):
        assert o == hf_greedy(tiny_hf, p, 24)
