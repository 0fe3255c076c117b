"""The quantized KV cache: ``LLM(kv_cache_dtype="int8" | "fp8")`` (labkit/kernels/kv_quant.py).

One byte per number and one fp32 scale per token and KV head. Held here:

* the cache write (``reshape_and_cache``): the torch reference and the Triton kernel store
  the same bytes and scales, within half a step of what was written;
* every attention backend reading a quantized cache (torch reference, Triton under the
  interpreter, the C++ CPU kernel) equals the unquantized reference over the dequantized
  cache, on adversarial batches (scales of slots no sequence owns are NaN);
* the model's logits with a quantized cache stay within a tolerance pinned per dtype of
  the unquantized cache's (tiny-llama here; docs/kv_quantization.md has SmolLM2's figures);
* memory: the same budget holds ``kv_bytes_per_token(model dtype) / kv_bytes_per_token(int8)``
  times the blocks, as ``stats()`` and the load banner say;
* every path that copies blocks (copy-on-write of parallel samples, beam forks, swapping to
  the host pool and back) copies their scales: outputs equal the unpreempted run's, and a
  copy that forgot the scales is caught; prefix caching reuses blocks with their scales;
  every block is free at the end;
* unknown names and dtypes a backend cannot read are refused with the allowed ones named.

The C++ kernel on the lesser instruction sets (AVX2, portable) is tests/test_cpu_vec.py's.
"""

import os

import torch

if not torch.cuda.is_available():  # must precede the first import of labkit.kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

import labkit.kernels as K  # noqa: E402
from labkit import LLM, BeamSearchParams, SamplingParams  # noqa: E402
from labkit.kernels import cpu_extension  # noqa: E402
from labkit.kernels import kv_quant as Q  # noqa: E402
from labkit.model.kv_cache import KVCache, kv_bytes_per_token, plan_kv_cache, swap_blocks  # noqa: E402
from labkit.model.runner import ModelRunner, SeqChunk, check_backend_kv_dtype  # noqa: E402

QDTYPES = [pytest.param(torch.int8, id="int8"), pytest.param(torch.float8_e4m3fn, id="fp8")]
KV_NAMES = ["int8", "fp8"]
# The model's logits with a quantized cache against the unquantized cache's (tiny-llama,
# 3 sequences, a prefill then 24 teacher-forced decode steps). Measured: max |d logit| /
# max |logit| 0.0034 (int8) and 0.018 (fp8); KL(unquantized || quantized) per position at
# most 4e-4 and 0.015. Pinned at about 3x.
LOGIT_REL_TOL = {"int8": 0.01, "fp8": 0.05}
KL_TOL = {"int8": 1.5e-3, "fp8": 0.05}
ATTENTION_TOL = dict(atol=1e-5, rtol=1e-5)   # a quantized cache against its dequantized copy, fp32


def _interpreter_reason() -> str | None:
    if not K.HAS_TRITON:
        return "Triton is not installed"
    if not K.triton_is_interpreted():
        return "the Triton kernels were compiled for a GPU in this process (TRITON_INTERPRET unset)"
    return None


def _cpp_reason() -> str | None:
    return None if cpu_extension.load() is not None else cpu_extension.status()[1]


# ------------------------------------------------------------------------ batches


def quantized_batch(lens, block_size, num_heads, num_kv_heads, head_dim, qdtype, chunks=None, seed=0):
    """A paged batch over a quantized cache, the adversarial way: blocks shuffled over the
    pool, table entries past each sequence's last block garbage, and every slot no token
    owns poisoned (scale NaN; fp8 bytes NaN too). Returns (q, k, v, k_scales, v_scales,
    tables, lens, query_start_loc or None, k_dequantized, v_dequantized)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 3
    width = max(blocks_per_seq) + 2
    pool = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.randint(-10**6, 10**6, (len(lens), width), generator=g)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for s, (n, nb) in enumerate(zip(lens, blocks_per_seq)):
        ids = [pool.pop() for _ in range(nb)]
        tables[s, :nb] = torch.tensor(ids)
        for t in range(n):
            owned[ids[t // block_size], t % block_size] = True
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = []
    for spread in (3.0, 1.0):           # keys wider than values, as in a model
        x = torch.randn(shape, generator=g) * spread
        x[0, 0, 0] = 0.0                # a vector of zeros: scale 0
        stored, scales = Q.quantize(x, qdtype)
        scales[~owned] = float("nan")
        if qdtype == torch.float8_e4m3fn:
            Q.as_bytes(stored)[~owned] = 0x7F        # e4m3fn's NaN
        caches.append((stored, scales, Q.dequantize(stored, scales)))
    (k, ks, kd), (v, vs, vd) = caches
    tables, lens = tables.int(), torch.tensor(lens, dtype=torch.int32)
    rows = len(lens) if chunks is None else sum(chunks)
    q = torch.randn(rows, num_heads, head_dim, generator=g)
    starts = None if chunks is None else torch.tensor([0, *chunks]).cumsum(0).int()
    return q, k, v, ks, vs, tables, lens, starts, kd, vd


DECODE_CASES = [   # block size, heads, KV heads, head dim, context lengths
    pytest.param(16, 9, 3, 64, [1, 16, 37, 5], id="bs16-g3-d64"),     # SmolLM2's heads
    pytest.param(8, 4, 2, 32, [3, 19, 8], id="bs8-g2-d32"),          # two blocks per Triton tile
    pytest.param(64, 4, 1, 64, [70, 1], id="bs64-g4"),
]
PREFILL_CASES = [  # block size, heads, KV heads, head dim, (prior context, chunk) per sequence
    pytest.param(16, 9, 3, 64, [(0, 5), (16, 16), (5, 20)], id="bs16-g3-d64"),
    pytest.param(8, 4, 2, 32, [(0, 9), (3, 1), (8, 8)], id="bs8-g2-d32"),
]


def _cpp_decode(*args, **kw):
    return K.paged_decode_attention_cpu(*args, impl="cpp", **kw)


_NEEDS_INTERPRETER = pytest.mark.skipif(_interpreter_reason() is not None, reason=str(_interpreter_reason()))
DECODE_OPS = [pytest.param(K.paged_decode_attention_ref, id="torch"),
              pytest.param(K.paged_decode_attention, id="triton", marks=_NEEDS_INTERPRETER),
              pytest.param(_cpp_decode, id="cpp",
                           marks=pytest.mark.skipif(_cpp_reason() is not None, reason=str(_cpp_reason())))]
PREFILL_OPS = [pytest.param(K.paged_prefill_attention_ref, id="torch"),
               pytest.param(K.paged_prefill_attention, id="triton", marks=_NEEDS_INTERPRETER),
               pytest.param(K.paged_prefill_attention_cpu, id="cpu")]   # C++ rows where they run vectorized, else SDPA


# ------------------------------------------------------------------------ quantize, write


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_quantize_stays_within_half_a_step_and_zeros_stay_zeros(qdtype):
    x = torch.randn(200, 3, 64) * torch.logspace(-3, 2, 200)[:, None, None]
    x[7, 1] = 0.0
    stored, scales = Q.quantize(x, qdtype)
    assert stored.dtype == qdtype and scales.shape == (200, 3) and scales.dtype == torch.float32
    back = Q.dequantize(stored, scales)
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.equal(scales, amax[..., 0] / Q.QMAX[qdtype])
    assert torch.isfinite(stored.float()).all() and stored.float().abs().max() <= Q.QMAX[qdtype]
    if qdtype == torch.int8:      # a uniform grid: half a step of amax / 127
        assert ((back - x).abs() <= amax / 254 * (1 + 1e-5) + 1e-30).all()
    else:                         # 3 mantissa bits: half an ulp, 2**-4 relative (subnormals: 2**-10 of the step)
        assert ((back - x).abs() <= x.abs() / 16 + scales[..., None] * 2**-10 + 1e-30).all()
    assert (scales[7, 1] == 0) and (back[7, 1] == 0).all()
    # A vector of tiny numbers (QMAX / amax would overflow to inf, and 0 * inf is NaN): zeros
    # stay zeros, the largest maps to QMAX.
    tiny, _ = Q.quantize(torch.tensor([[1e-38, 0.0, -1e-38, 5e-39]]), qdtype)
    assert torch.isfinite(tiny.float()).all() and tiny.float()[0, 1] == 0, tiny
    assert tiny.float()[0, 0] == Q.QMAX[qdtype] and tiny.float()[0, 2] == -Q.QMAX[qdtype]


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_cache_write_stores_bytes_and_scales_at_each_slot_and_triton_stores_the_same(qdtype):
    g = torch.Generator().manual_seed(3)
    num_blocks, block_size, kv_heads, d = 6, 8, 3, 32
    key, value = torch.randn(20, kv_heads, d, generator=g) * 4, torch.randn(20, kv_heads, d, generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:20]
    slots[5] = -1                                             # skipped
    made = []
    writers = [K.reshape_and_cache_ref] + ([K.reshape_and_cache] if _interpreter_reason() is None else [])
    for write in writers:
        k = torch.zeros(num_blocks, block_size, kv_heads, d, dtype=qdtype)
        v, ks, vs = torch.zeros_like(k), torch.zeros(num_blocks, block_size, kv_heads), torch.zeros(
            num_blocks, block_size, kv_heads)
        write(key, value, k, v, slots, k_scales=ks, v_scales=vs)
        made.append((k, v, ks, vs))
    k, v, ks, vs = made[0]
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, block_size)
        want_k, want_ks = Q.quantize(key[i], qdtype)
        assert torch.equal(Q.as_bytes(k[b, o]), Q.as_bytes(want_k)) and torch.equal(ks[b, o], want_ks)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert (ks.view(-1, kv_heads)[~written] == 0).all()       # nothing else touched
    for other in made[1:]:                                    # Triton: the same bytes, the same scales
        for a, b in zip(made[0], other):
            assert torch.equal(Q.as_bytes(a), Q.as_bytes(b))


# ------------------------------------------------------------------------ attention, per backend


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("block_size, heads, kv_heads, head_dim, lens", DECODE_CASES)
@pytest.mark.parametrize("op", DECODE_OPS)
def test_decode_over_a_quantized_cache_equals_the_reference_over_its_dequantized_copy(
        op, block_size, heads, kv_heads, head_dim, lens, qdtype):
    q, k, v, ks, vs, tables, lens_t, _, kd, vd = quantized_batch(lens, block_size, heads, kv_heads, head_dim, qdtype)
    want = K.paged_decode_attention_ref(q, kd, vd, tables, lens_t, head_dim ** -0.5)
    got = op(q, k, v, tables, lens_t, head_dim ** -0.5, k_scales=ks, v_scales=vs)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **ATTENTION_TOL)


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("block_size, heads, kv_heads, head_dim, chunks", PREFILL_CASES)
@pytest.mark.parametrize("op", PREFILL_OPS)
def test_prefill_over_a_quantized_cache_equals_the_reference_over_its_dequantized_copy(
        op, block_size, heads, kv_heads, head_dim, chunks, qdtype):
    lens = [prior + n for prior, n in chunks]
    q, k, v, ks, vs, tables, lens_t, starts, kd, vd = quantized_batch(
        lens, block_size, heads, kv_heads, head_dim, qdtype, chunks=[n for _, n in chunks])
    want = K.paged_prefill_attention_ref(q, kd, vd, tables, lens_t, starts, head_dim ** -0.5)
    got = op(q, k, v, tables, lens_t, starts, head_dim ** -0.5, k_scales=ks, v_scales=vs)
    torch.testing.assert_close(got, want, **ATTENTION_TOL)


@_NEEDS_INTERPRETER
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_fp16_queries_over_a_quantized_cache_with_triton(qdtype):
    q, k, v, ks, vs, tables, lens, _, kd, vd = quantized_batch([1, 16, 37], 16, 9, 3, 64, qdtype)
    want = K.paged_decode_attention_ref(q, kd, vd, tables, lens, 0.125)
    got = K.paged_decode_attention(q.half(), k, v, tables, lens, 0.125, k_scales=ks, v_scales=vs)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, atol=3e-3, rtol=3e-3)


# ------------------------------------------------------------------------ the model's logits


def _teacher_forced_logits(kv_cache_dtype: str, backend: str = "cpu", steps: int = 24) -> torch.Tensor:
    """Logits of tiny-llama over 3 prompts (a prefill) and ``steps`` decode steps of fixed
    tokens, in one runner: [steps + 1, 3, vocab]."""
    runner = ModelRunner("tiny-llama", num_blocks=64, kv_cache_dtype=kv_cache_dtype, attention_backend=backend)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (40, 7, 23)]
    blocks = [list(range(20 * i, 20 * i + 20)) for i in range(3)]
    out = [runner.execute([SeqChunk(p, 0, b) for p, b in zip(prompts, blocks)])]
    forced = torch.randint(3, 300, (steps, 3), generator=g).tolist()
    for t in range(steps):
        out.append(runner.execute([SeqChunk([forced[t][i]], len(prompts[i]) + t, blocks[i]) for i in range(3)]))
    return torch.stack(out)


@pytest.fixture(scope="module")
def unquantized_logits():
    return _teacher_forced_logits("auto")


def _assert_logits_close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    rel = float((got - want).abs().max() / want.abs().max())
    p, log_q = want.log_softmax(-1), got.log_softmax(-1)
    kl = float((p.exp() * (p - log_q)).sum(-1).max())
    assert rel <= LOGIT_REL_TOL[name] and kl <= KL_TOL[name], (name, rel, kl)
    assert rel > 0, "a quantized cache that changes nothing is not quantized"


@pytest.mark.parametrize("name", KV_NAMES)
def test_logits_with_a_quantized_cache_stay_within_the_pinned_tolerance(unquantized_logits, name):
    _assert_logits_close(_teacher_forced_logits(name), unquantized_logits, name)


@pytest.mark.slow
@_NEEDS_INTERPRETER
@pytest.mark.parametrize("name", KV_NAMES)
def test_every_backend_gives_the_same_quantized_logits(unquantized_logits, name):
    # The torch and Triton backends compute K and V with the same matmuls, so they quantize the
    # same numbers: the same bytes, the same logits to float rounding. The CPU backend's matmuls
    # (labkit's panels in fp32, oneDNN's packed weights in bf16) round differently, and a rounding
    # difference can move a number to the next fp8 or int8 step: it is held to the tolerance
    # against the unquantized cache.
    torch_logits = _teacher_forced_logits(name, "torch", steps=4)
    torch.testing.assert_close(_teacher_forced_logits(name, "triton", steps=4), torch_logits, atol=1e-4, rtol=1e-4)
    for got in (torch_logits, _teacher_forced_logits(name, "cpu", steps=4)):
        _assert_logits_close(got, unquantized_logits[:5], name)


# ------------------------------------------------------------------------ memory


def _config(head_dim: int) -> LlamaConfig:
    # SmolLM2-135M's attention shape (30 layers, 3 KV heads of 64); head dim 128 for Llama-sized models
    heads = 9 if head_dim == 64 else 4
    return LlamaConfig(num_hidden_layers=30, num_attention_heads=heads, num_key_value_heads=3,
                       hidden_size=heads * head_dim, head_dim=head_dim, intermediate_size=64, vocab_size=32)


@pytest.mark.parametrize("head_dim, over_fp32, over_bf16", [(64, 256 / 68, 128 / 68), (128, 512 / 132, 256 / 132)])
def test_a_budget_holds_more_blocks_by_the_byte_ratio(head_dim, over_fp32, over_bf16):
    config = _config(head_dim)

    def blocks(dtype):
        return plan_kv_cache(config, dtype, 16, max_num_seqs=64, max_model_len=4096,
                             kv_cache_memory=1 << 30, memory=None).num_blocks
    for qdtype in (torch.int8, torch.float8_e4m3fn):
        assert kv_bytes_per_token(config, qdtype) == 2 * 30 * 3 * (head_dim + 4)      # a byte each, and the scale
        assert blocks(qdtype) / blocks(torch.float32) == pytest.approx(over_fp32, rel=1e-3)
        assert blocks(qdtype) / blocks(torch.bfloat16) == pytest.approx(over_bf16, rel=1e-3)
        assert blocks(qdtype) / blocks(torch.float16) == pytest.approx(over_bf16, rel=1e-3)
    assert over_fp32 > 3.7 and over_bf16 > 1.85       # what the scales cost: 4 bytes per head_dim bytes


@pytest.mark.parametrize("name", KV_NAMES)
def test_llm_sizes_its_cache_by_the_ratio_and_says_so(name, capsys):
    budget = 1 << 20
    plain = LLM("tiny-llama", kv_cache_memory=budget)
    capsys.readouterr()
    llm = LLM("tiny-llama", kv_cache_memory=budget, kv_cache_dtype=name)
    banner = capsys.readouterr().err
    stats, ratio = llm.stats(), 16 * 4 / (16 + 4)            # tiny-llama: head dim 16, fp32
    assert stats["kv_cache_dtype"] == name and stats["kv_cache_block_ratio"] == pytest.approx(ratio)
    assert plain.stats()["kv_cache_dtype"] == "float32" and plain.stats()["kv_cache_block_ratio"] == 1
    assert stats["num_total_blocks"] == pytest.approx(plain.stats()["num_total_blocks"] * ratio, abs=1)
    assert stats["kv_cache_bytes"] <= budget
    assert f"{name} with fp32 scales per token and head: {ratio:.2f}x the blocks" in banner
    assert llm.runner.kv_cache.data.dtype == Q.KV_CACHE_DTYPES[name]


# ------------------------------------------------------------------------ copies of blocks


def test_copies_and_swaps_of_blocks_carry_their_scales():
    cache = KVCache(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float8_e4m3fn)
    assert cache.quantized and cache.bytes_per_block == 2 * 2 * 4 * 2 * (8 + 4)
    Q.as_bytes(cache.data).copy_(torch.randint(0, 0x7E, cache.data.shape, dtype=torch.uint8))
    cache.scales.copy_(torch.rand(cache.scales.shape))
    before_data, before_scales = Q.as_bytes(cache.data).clone(), cache.scales.clone()
    cache.copy_blocks([(1, 4), (4, 5)])        # 4 -> 5 reads block 4 before it is overwritten
    for src, dst in ((1, 4), (4, 5)):
        assert torch.equal(Q.as_bytes(cache.data)[:, :, dst], before_data[:, :, src])
        assert torch.equal(cache.scales[:, :, dst], before_scales[:, :, src])
    for granularity in ("gather", "layer"):
        host = cache.host_pool(3)
        swap_blocks(cache, host, [(4, 0), (2, 2)], granularity)
        assert torch.equal(host.scales[:, :, 0], cache.scales[:, :, 4])
        assert torch.equal(Q.as_bytes(host.data)[:, :, 2], Q.as_bytes(cache.data)[:, :, 2])
        swap_blocks(host, cache, [(0, 3)], granularity)
        assert torch.equal(cache.scales[:, :, 3], cache.scales[:, :, 4])


def _tiny(name, num_blocks=256, **kw) -> LLM:
    kw.setdefault("block_size", 4)
    kw.setdefault("max_num_batched_tokens", 32)
    return LLM("tiny-llama", num_blocks=num_blocks, kv_cache_dtype=name, **kw)


PROMPTS = [[(7 * i + 3 * j) % 380 + 3 for j in range(n)] for i, n in enumerate((3, 9, 17, 6, 25, 11))]


def _greedy(llm: LLM, prompts=PROMPTS, n: int = 1, max_tokens: int = 16) -> list[list[list[int]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n)
    outs = [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    _assert_all_blocks_free(llm)
    return outs


def _assert_all_blocks_free(llm: LLM) -> None:
    scheduler = llm.scheduler
    scheduler.allocator.check_invariants()
    assert scheduler.allocator.num_used_blocks == 0, "device blocks leaked"
    if scheduler.host_allocator is not None:
        assert scheduler.host_allocator.num_used_blocks == 0, "host blocks leaked"
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]


@pytest.mark.parametrize("name", KV_NAMES)
def test_preemption_by_swapping_and_prefix_caching_keep_quantized_outputs_equal(name):
    want = _greedy(_tiny(name, enable_prefix_caching=False))
    swapped = _tiny(name, num_blocks=14, preemption_mode="swap", num_host_blocks=64, enable_prefix_caching=False)
    assert _greedy(swapped) == want
    assert swapped.stats()["num_swap_outs"] > 0
    system = list(range(100, 124))                 # 6 blocks shared by every prompt
    prompts = [system + p for p in PROMPTS]
    want = _greedy(_tiny(name, enable_prefix_caching=False), prompts)
    cached = _tiny(name, enable_prefix_caching=True)
    assert _greedy(cached, prompts) == want
    assert _greedy(cached, prompts) == want        # the second time from the cache, scales and all
    assert cached.stats()["prefix_cache_hit_rate"] > 0


@pytest.mark.parametrize("name", KV_NAMES)
def test_copy_on_write_of_parallel_samples_copies_the_scales(name, monkeypatch):
    # Greedy samples of one request are all the n=1 output. Prompts of 3, 9, 17... tokens end
    # inside a block of 4: each further sample writes into a copy of that block.
    single = [outs * 3 for outs in _greedy(_tiny(name))]
    llm = _tiny(name)
    assert _greedy(llm, n=3) == single
    # A copy that forgot the scales would leave the copied block's tokens scaled by whatever
    # its scale slots held: the check above must be able to tell.
    monkeypatch.setattr(KVCache, "_tensors", lambda self: [Q.as_bytes(self.data)])
    assert _greedy(_tiny(name), n=3) != single


@pytest.mark.parametrize("name", KV_NAMES)
def test_beam_search_with_a_quantized_cache_under_swapping_equals_no_preemption(name):
    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)

    def beams(llm):
        outs = llm.beam_search(PROMPTS[:4], params)
        _assert_all_blocks_free(llm)
        return [[s.output_token_ids for s in o.sequences] for o in outs]
    want = beams(_tiny(name, num_blocks=512))
    llm = _tiny(name, num_blocks=24, max_num_seqs=12, preemption_mode="swap", num_host_blocks=64)
    assert beams(llm) == want
    assert llm.stats()["num_swap_outs"] > 0


# ------------------------------------------------------------------------ refusals


def test_an_unknown_kv_cache_dtype_names_the_allowed_ones():
    allowed = ", ".join(repr(n) for n in Q.KV_CACHE_DTYPES)
    with pytest.raises(ValueError, match=f"unknown kv_cache_dtype 'fp4'; choose one of {allowed}"):
        LLM("tiny-llama", kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'fp8_e5m2'"):
        Q.resolve_kv_cache_dtype("fp8_e5m2", torch.float32)
    assert Q.resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert Q.resolve_kv_cache_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn


def test_kernels_refuse_a_quantized_cache_without_its_scales_and_caches_they_cannot_read():
    q, k, v, ks, vs, tables, lens, _, kd, vd = quantized_batch([3, 9], 8, 4, 2, 32, torch.int8)
    for op in (K.paged_decode_attention_ref, K.paged_decode_attention_cpu):
        with pytest.raises(ValueError, match="int8 KV cache needs its k_scales and v_scales"):
            op(q, k, v, tables, lens, 0.2)
        with pytest.raises(ValueError, match="belong to a quantized cache"):
            op(q, kd, vd, tables, lens, 0.2, k_scales=ks, v_scales=vs)
        with pytest.raises(ValueError, match=r"k_scales must be a contiguous fp32 \[num_blocks, block_size"):
            op(q, k, v, tables, lens, 0.2, k_scales=ks[:, :4], v_scales=vs)
        with pytest.raises(ValueError, match="8-bit float KV cache is e4m3"):
            op(q, kd.to(torch.float8_e5m2), vd.to(torch.float8_e5m2), tables, lens, 0.2, k_scales=ks, v_scales=vs)
    with pytest.raises(ValueError, match="int8 KV cache needs its k_scales"):
        K.reshape_and_cache_ref(kd[0], vd[0], k, v, torch.arange(8))
    with pytest.raises(RuntimeError, match="reads fp32 and bf16 caches, not quantized ones"):
        K.paged_decode_attention_cpu(q, k, v, tables, lens, 0.2, impl="numba", k_scales=ks, v_scales=vs)


def test_triton_fp8_below_compute_capability_8_9_is_refused_with_what_works(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"'fp8' on the triton backend needs compute capability 8\.9\+.*"
                                         r"this GPU is 8\.0: use kv_cache_dtype 'int8', or attention_backend='torch'"):
        check_backend_kv_dtype("triton", torch.float8_e4m3fn, torch.device("cuda"))
    check_backend_kv_dtype("triton", torch.int8, torch.device("cuda"))        # int8 runs there
    check_backend_kv_dtype("torch", torch.float8_e4m3fn, torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    check_backend_kv_dtype("triton", torch.float8_e4m3fn, torch.device("cuda"))


def test_the_cli_and_the_vllm_port_know_the_same_names():
    from labkit import __main__ as cli
    from labkit import vllm_port
    assert cli.KV_CACHE_DTYPES == tuple(Q.KV_CACHE_DTYPES) and set(vllm_port.KV_CACHE_DTYPES) == set(Q.KV_CACHE_DTYPES)
    args = cli._parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
    assert args.kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["serve", "--kv-cache-dtype", "fp4"])
    assert vllm_port.vllm_kv_cache_dtype("int8", cpu=False) == "int8_per_token_head"
    assert vllm_port.vllm_kv_cache_dtype("fp8", cpu=False) == "fp8_per_token_head"
    assert vllm_port.vllm_kv_cache_dtype("fp8", cpu=True) == "fp8"        # per-tensor scale: the nearest it has
    with pytest.raises(ValueError, match="vLLM's CPU build has no int8 KV cache"):
        vllm_port.vllm_kv_cache_dtype("int8", cpu=True)


# ------------------------------------------------------------------------ the benchmark


def test_the_benchmark_refuses_bad_options_and_reports_agreement(capsys):
    from labkit.bench import kv_dtype as B
    assert B.main(["--kv-dtypes", "int8,auto"]) == 2                # the baseline comes first
    assert B.main(["--kv-dtypes", "auto,int4"]) == 2
    assert "unknown ['int4']" in capsys.readouterr().err
    assert B.agreement([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 5]]) == {
        "requests_equal": 1, "tokens_before_first_divergence": 4, "output_tokens": 5}


@pytest.mark.slow
def test_the_benchmark_runs_each_kv_cache_dtype_and_measures_the_logits(tmp_path, capsys):
    import json

    from labkit.bench import kv_dtype as B
    prompts = [[(5 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate((9, 30))]
    reference = [o[0] for o in _greedy(_tiny("auto"), prompts, max_tokens=8)]
    workload = tmp_path / "w.json"
    requests = [{"prompt_token_ids": p, "max_tokens": 8, "reference_output_token_ids": r}
                for p, r in zip(prompts, reference)]
    workload.write_text(json.dumps({"requests": requests}))
    assert B.main(["--model", "tiny-llama", "--workload", str(workload), "--kv-dtypes", "auto,int8", "--json",
                   "--kv-gib", "0.01"]) == 0
    report = json.loads(capsys.readouterr().out)
    runs = report["engines"]["labkit"]
    assert runs["auto"]["vs_reference"]["requests_equal"] == 2 and runs["int8"]["output_tok_per_s"] > 0
    assert runs["int8"]["vs_auto"]["output_tokens"] == 16 and "speedup_vs_auto" in runs["int8"]
    distance = report["logit_distance"]["int8"]
    assert distance["positions"] == 16 and 0 < distance["max_abs_logit_diff_rel"] <= LOGIT_REL_TOL["int8"]


@pytest.mark.parametrize("policy", ["hash", "radix"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("name", KV_NAMES)
def test_a_quantized_cache_under_attack_ends_with_every_block_free(name, mode, policy):
    """Stop strings, n > 1 (sampled: copy-on-write of the prompt's last block), an abort in
    the middle, a shared prefix under either prefix-cache policy, in a pool small enough to
    preempt: every request ends the way it was asked to, and every block (and its host copy)
    comes back."""
    llm = _tiny(name, num_blocks=20, preemption_mode=mode, prefix_caching=policy, max_num_seqs=8,
                **({"num_host_blocks": 64} if mode == "swap" else {}))
    probe = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    # tiny-llama's byte-level text is short: stop at a character that first comes after the start
    stop = next((c for c in probe.text[1:] if c != "\ufffd" and probe.text.index(c) > 0), None)
    assert stop is not None, probe
    engine, system = llm.engine, list(range(100, 112))
    stopped = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                            stop=[stop]))
    sampled = [engine.add_request(system + p, SamplingParams(max_tokens=10, temperature=1.0, seed=i, n=3,
                                                             ignore_eos=True)) for i, p in enumerate(PROMPTS[:4])]
    doomed = engine.add_request(system + PROMPTS[5], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
        if steps == 3:
            assert engine.abort(doomed.request_id)
        assert steps < 500, "the engine stopped making progress"
    assert stopped.seqs[0].finish_reason == "stop"
    assert engine.text_of(stopped.seqs[0]) == probe.text[:probe.text.index(stop)]
    for r in sampled:
        assert len(r.seqs) == 3 and all(len(s.output_token_ids) == 10 for s in r.seqs)
    assert doomed.seqs[0].finish_reason == "abort"
    assert llm.stats()["num_preemptions"] > 0, "the pool should have been too small for all of them"
    for r in [stopped, *sampled, doomed]:
        engine.release(r)
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn],
                         ids=["fp32", "bf16", "fp16", "int8", "fp8"])
def test_a_new_cache_is_zeros_in_every_dtype_and_populate_keeps_its_contents(dtype):
    """The cache lives in an anonymous mapping the OS zero-fills as pages are first written
    (``kv_cache.zeroed``): every slot reads 0 (a kernel multiplying masked-out slots by 0 must
    not meet garbage), the layers' views write into the one tensor, and ``populate`` (every
    page in at once) leaves what was written as it was."""
    cache = KVCache(3, 5, 16, 2, 64, dtype)
    assert cache.data.dtype == dtype and cache.data.shape == (3, 2, 5, 16, 2, 64) and cache.data.is_contiguous()
    assert cache.quantized == (cache.scales is not None) == (dtype in (torch.int8, torch.float8_e4m3fn))
    for t in [cache.data] + ([cache.scales] if cache.quantized else []):
        assert not t.float().abs().sum()
    cache.k_caches[2][4, 15] = 1
    assert cache.data.float()[2, 0, 4, 15].eq(1).all() and cache.data.float().sum() == 2 * 64
    before = [t.clone() for t in cache._tensors()]
    cache.populate()                 # pages in, contents kept: safe on a cache already serving
    assert all(torch.equal(a, b) for a, b in zip(before, cache._tensors(), strict=True))
