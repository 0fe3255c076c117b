"""Attention kernels: every Triton kernel against its torch reference, and every torch
reference against a naive dense attention that reads the cache token by token.

The Triton cases run twice when they can: on CPU through the Triton interpreter (the
kernels must then have been defined under TRITON_INTERPRET=1, which this module and
``labkit.kernels`` arrange on machines without CUDA) and compiled on a CUDA GPU of compute
capability 7.5+ (marked ``gpu``; skipped elsewhere with the reason). Interpreter shapes
are kept tiny: the interpreter runs one program at a time in numpy. That the kernels
compile for the GPUs students get (sm_75 to sm_90) is tests/test_gpu_compile.py's to show.

Every paged batch here is adversarial on purpose: blocks are shuffled over the pool,
unused block-table entries hold garbage (huge and negative ids), and every cache slot no
sequence owns is NaN, so a kernel that reads past a context length or follows an unused
table entry poisons its output.
"""

import importlib.util
import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():  # must precede the first import of labkit.kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import labkit.kernels as K  # noqa: E402
from labkit.utils import cdiv  # noqa: E402

# ------------------------------------------------------------------------ fixtures


def _cuda_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device: compiled Triton kernels need an NVIDIA GPU of compute capability 7.5+"
    if torch.cuda.get_device_capability() < K.MIN_COMPUTE_CAPABILITY:
        return f"{torch.cuda.get_device_name()} is below compute capability 7.5 (the kernels are built for 7.5+)"
    if K.triton_is_interpreted():
        return "TRITON_INTERPRET=1 was set when labkit.kernels was imported: nothing runs compiled"
    return None


def _interpreter_skip_reason() -> str | None:
    if not K.HAS_TRITON:
        return "Triton is not installed"
    if not K.triton_is_interpreted():
        return ("the Triton kernels were compiled for the GPU in this process; run with "
                "TRITON_INTERPRET=1 to test them under the CPU interpreter too")
    return None


@pytest.fixture(params=[pytest.param("cpu", id="interpreter"),
                        pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)])
def device(request) -> torch.device:
    """Where the Triton kernels run: CPU through the interpreter, or a CUDA GPU compiled."""
    reason = _interpreter_skip_reason() if request.param == "cpu" else _cuda_skip_reason()
    if reason:
        pytest.skip(reason)
    return torch.device(request.param)


TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]

# ---------------------------------------------------------------- paged test batches


def make_paged_kv(context_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                  spare_blocks: int = 3, seed: int = 0):
    """Caches holding ``context_lens`` tokens per sequence, the adversarial way.

    Returns (k_cache, v_cache, block_tables int32, context_lens int32). Blocks are a random
    permutation of the pool; every slot not covered by a context is NaN; every table entry
    past a sequence's last block is garbage.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [cdiv(n, block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    width = max(blocks_per_seq) + 2
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    table = torch.randint(-(10**6), 10**6, (len(context_lens), width), generator=gen)
    for s, (n, nb) in enumerate(zip(context_lens, blocks_per_seq)):
        ids = [pool.pop() for _ in range(nb)]
        table[s, :nb] = torch.tensor(ids)
        for t in range(n):
            k_cache[ids[t // block_size], t % block_size] = torch.randn(num_kv_heads, head_dim, generator=gen)
            v_cache[ids[t // block_size], t % block_size] = torch.randn(num_kv_heads, head_dim, generator=gen)
    return (k_cache.to(dtype=dtype, device=device), v_cache.to(dtype=dtype, device=device),
            table.to(dtype=torch.int32, device=device),
            torch.tensor(context_lens, dtype=torch.int32, device=device))


def naive_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor,
                    chunk_lens: list[int], scale: float) -> torch.Tensor:
    """Obviously correct, obviously slow: per sequence, read its tokens one by one through
    the block table, then per query and head a float64 softmax. Query head h uses KV head
    h // group. q holds the sequences' chunks back to back (decode: chunks of 1)."""
    num_heads, block_size = q.shape[1], k_cache.shape[1]
    group = num_heads // k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    for s, chunk in enumerate(chunk_lens):
        n = int(context_lens[s])
        slots = [(int(block_tables[s, t // block_size]), t % block_size) for t in range(n)]
        keys = torch.stack([k_cache[b, o] for b, o in slots]).double()    # [n, kv_heads, d]
        values = torch.stack([v_cache[b, o] for b, o in slots]).double()
        for j in range(chunk):
            pos = n - chunk + j
            for h in range(num_heads):
                scores = keys[: pos + 1, h // group] @ q[row, h].double() * scale
                out[row, h] = torch.softmax(scores, 0) @ values[: pos + 1, h // group]
            row += 1
    return out


# block size, num_heads, num_kv_heads, head_dim, context lengths: together they cover
# context length 1, exactly full blocks, partly filled last blocks, GQA groups 1, 3 and 4,
# block sizes 8..64, head_dim 64, 128 and 80 (padded to 128 inside the kernels).
DECODE_CASES = [
    pytest.param(8, 2, 2, 64, [1, 8, 13, 24], id="bs8-g1"),
    pytest.param(16, 9, 3, 64, [1, 16, 37, 5], id="bs16-g3"),
    pytest.param(32, 8, 2, 128, [1, 32, 45, 64], id="bs32-g4-d128"),
    pytest.param(64, 4, 1, 64, [70, 1, 64], id="bs64-g4"),
    pytest.param(16, 4, 2, 80, [3, 19], id="bs16-g2-d80"),
]

# block size, num_heads, num_kv_heads, head_dim, (prior context, chunk length) per sequence:
# fresh prompts, chunks after cached prefixes (block-aligned or not), one-token chunks,
# chunks longer than a query tile.
PREFILL_CASES = [
    pytest.param(8, 2, 2, 64, [(0, 5), (3, 1), (8, 16), (13, 20)], id="bs8-g1"),
    pytest.param(16, 9, 3, 64, [(0, 1), (16, 16), (5, 30), (40, 3)], id="bs16-g3"),
    pytest.param(64, 4, 1, 64, [(0, 70), (60, 9), (64, 1)], id="bs64-g4"),
    pytest.param(32, 8, 2, 128, [(0, 33), (32, 1), (7, 9)], id="bs32-g4-d128"),
]


def make_decode_batch(block_size, num_heads, num_kv_heads, head_dim, context_lens,
                      dtype=torch.float32, device="cpu", seed=0):
    k_cache, v_cache, tables, lens = make_paged_kv(context_lens, block_size, num_kv_heads,
                                                   head_dim, dtype, device, seed=seed)
    q = torch.randn(len(context_lens), num_heads, head_dim,
                    generator=torch.Generator().manual_seed(seed + 1)).to(dtype=dtype, device=device)
    return q, k_cache, v_cache, tables, lens


def make_prefill_batch(block_size, num_heads, num_kv_heads, head_dim, chunks,
                       dtype=torch.float32, device="cpu", seed=0):
    context_lens = [prior + chunk for prior, chunk in chunks]
    k_cache, v_cache, tables, lens = make_paged_kv(context_lens, block_size, num_kv_heads,
                                                   head_dim, dtype, device, seed=seed)
    chunk_lens = [chunk for _, chunk in chunks]
    starts = torch.tensor([0] + chunk_lens).cumsum(0).to(dtype=torch.int32, device=device)
    q = torch.randn(sum(chunk_lens), num_heads, head_dim,
                    generator=torch.Generator().manual_seed(seed + 1)).to(dtype=dtype, device=device)
    return q, k_cache, v_cache, tables, lens, starts, chunk_lens


# ------------------------------------------------------------ reshape_and_cache


def _cache_write_case(dtype, device, slot_dtype):
    """Six tokens for a 4-block cache of block size 8: two skipped (slot -1), one at the
    very last slot; key/value are non-contiguous slices (as from a fused projection)."""
    gen = torch.Generator().manual_seed(3)
    fused = torch.randn(6, 2, 3, 64, generator=gen).to(dtype=dtype, device=device)
    key, value = fused[:, 0, :2], fused[:, 1, :2]                     # [6, 2, 64], strided
    slots = torch.tensor([9, -1, 0, 31, -1, 17], dtype=slot_dtype, device=device)
    k_cache = torch.randn(4, 8, 2, 64, generator=gen).to(dtype=dtype, device=device)
    return key, value, k_cache, k_cache.clone() + 1, slots


def test_reshape_and_cache_ref_writes_each_slot():
    key, value, k_cache, v_cache, slots = _cache_write_case(torch.float32, "cpu", torch.int64)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect_k[slot // 8, slot % 8] = key[i]
            expect_v[slot // 8, slot % 8] = value[i]
    K.reshape_and_cache_ref(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_kernel_matches_ref(device, dtype, slot_dtype):
    key, value, k_cache, v_cache, slots = _cache_write_case(dtype, device, slot_dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    K.reshape_and_cache_ref(key, value, ref_k, ref_v, slots)
    K.reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


# ------------------------------------------------------------------------- decode


@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_dim, context_lens", DECODE_CASES)
def test_decode_ref_matches_naive(block_size, num_heads, num_kv_heads, head_dim, context_lens):
    q, k_cache, v_cache, tables, lens = make_decode_batch(block_size, num_heads, num_kv_heads,
                                                          head_dim, context_lens)
    scale = head_dim ** -0.5
    out = K.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, scale)
    expect = naive_attention(q, k_cache, v_cache, tables, lens, [1] * len(context_lens), scale)
    torch.testing.assert_close(out.double(), expect, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_dim, context_lens", DECODE_CASES)
def test_decode_kernel_matches_ref(device, dtype, block_size, num_heads, num_kv_heads, head_dim,
                                   context_lens):
    q, k_cache, v_cache, tables, lens = make_decode_batch(block_size, num_heads, num_kv_heads,
                                                          head_dim, context_lens, dtype, device)
    scale = head_dim ** -0.5
    out = K.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    ref = K.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_dim, context_lens", DECODE_CASES)
def test_cpu_decode_kernel_matches_naive(block_size, num_heads, num_kv_heads, head_dim, context_lens):
    pytest.importorskip("numba", reason="the CPU decode kernel needs Numba")
    q, k_cache, v_cache, tables, lens = make_decode_batch(block_size, num_heads, num_kv_heads,
                                                          head_dim, context_lens)
    scale = head_dim ** -0.5
    out = K.paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, scale)
    expect = naive_attention(q, k_cache, v_cache, tables, lens, [1] * len(context_lens), scale)
    assert out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out.double(), expect, **TOL[torch.float32])


def test_decode_ref_handles_chunks_of_the_batch(monkeypatch):
    """The CPU reference gathers a few sequences at a time: the chunking must not show."""
    q, k_cache, v_cache, tables, lens = make_decode_batch(16, 9, 3, 64, [1, 16, 37, 5, 50, 2, 33])
    whole = K.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125)
    monkeypatch.setattr(K._common, "CPU_GATHER_CHUNK_BYTES", 1)  # one sequence per chunk
    chunked = K.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125)
    # Not bitwise: with several threads SDPA splits its reductions by batch size (float
    # noise, ~1e-7). A wrong chunk boundary would be off by O(1).
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------ prefill


@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_dim, chunks", PREFILL_CASES)
def test_prefill_ref_matches_naive(block_size, num_heads, num_kv_heads, head_dim, chunks):
    q, k_cache, v_cache, tables, lens, starts, chunk_lens = make_prefill_batch(
        block_size, num_heads, num_kv_heads, head_dim, chunks)
    scale = head_dim ** -0.5
    out = K.paged_prefill_attention_ref(q, k_cache, v_cache, tables, lens, starts, scale)
    expect = naive_attention(q, k_cache, v_cache, tables, lens, chunk_lens, scale)
    torch.testing.assert_close(out.double(), expect, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_dim, chunks", PREFILL_CASES)
def test_prefill_kernel_matches_ref(device, dtype, block_size, num_heads, num_kv_heads, head_dim,
                                    chunks):
    q, k_cache, v_cache, tables, lens, starts, _ = make_prefill_batch(
        block_size, num_heads, num_kv_heads, head_dim, chunks, dtype, device)
    scale = head_dim ** -0.5
    out = K.paged_prefill_attention(q, k_cache, v_cache, tables, lens, starts, scale)
    ref = K.paged_prefill_attention_ref(q, k_cache, v_cache, tables, lens, starts, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_prefill_ref_of_one_token_chunks_is_decode():
    q, k_cache, v_cache, tables, lens = make_decode_batch(16, 9, 3, 64, [1, 16, 37, 5])
    starts = torch.arange(5, dtype=torch.int32)
    prefill = K.paged_prefill_attention_ref(q, k_cache, v_cache, tables, lens, starts, 0.125)
    decode = K.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(prefill, decode, atol=1e-6, rtol=1e-6)


def test_prefill_skips_empty_chunks(device):
    """A sequence with no new tokens this step (chunk length 0) contributes no rows."""
    q, k_cache, v_cache, tables, lens, _, _ = make_prefill_batch(8, 2, 2, 64, [(0, 4), (5, 3)],
                                                                 device=device)
    starts = torch.tensor([0, 4, 4, 7], dtype=torch.int32, device=device)
    tables = torch.cat([tables[:1], tables[:1], tables[1:]])  # seq 1: same blocks, empty chunk
    lens = torch.stack([lens[0], lens[0], lens[1]])
    out = K.paged_prefill_attention(q, k_cache, v_cache, tables, lens, starts, 0.125)
    ref = K.paged_prefill_attention_ref(q, k_cache, v_cache, tables, lens, starts, 0.125)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


# ------------------------------------------------------ references, property-based


@settings(max_examples=25, deadline=None)
@given(block_size=st.sampled_from([8, 16, 32]), kv_heads=st.integers(1, 3),
       group=st.sampled_from([1, 2, 3, 4]), head_dim=st.sampled_from([16, 64]),
       chunks=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
def test_refs_match_naive_on_random_batches(block_size, kv_heads, group, head_dim, chunks, seed):
    num_heads = kv_heads * group
    q, k_cache, v_cache, tables, lens, starts, chunk_lens = make_prefill_batch(
        block_size, num_heads, kv_heads, head_dim, chunks, seed=seed)
    scale = head_dim ** -0.5
    out = K.paged_prefill_attention_ref(q, k_cache, v_cache, tables, lens, starts, scale)
    expect = naive_attention(q, k_cache, v_cache, tables, lens, chunk_lens, scale)
    torch.testing.assert_close(out.double(), expect, **TOL[torch.float32])
    last = starts[1:].long() - 1  # each chunk's last query is a decode query
    decode = K.paged_decode_attention_ref(q[last], k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(decode.double(), expect[last], **TOL[torch.float32])


# ------------------------------------------------------------------ refusals


def test_bf16_is_refused_under_the_interpreter():
    if _interpreter_skip_reason():
        pytest.skip(_interpreter_skip_reason())
    q, k_cache, v_cache, tables, lens = make_decode_batch(8, 2, 2, 64, [3], torch.bfloat16)
    with pytest.raises(ValueError, match="bf16"):
        K.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    # the torch reference has no such limit
    assert K.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125).dtype == torch.bfloat16


@pytest.mark.parametrize("op", [K.paged_decode_attention, K.paged_decode_attention_ref])
def test_bad_shapes_are_refused(op):
    q, k_cache, v_cache, tables, lens = make_decode_batch(8, 4, 2, 64, [3])
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        op(q[:, :3], k_cache, v_cache, tables, lens, 0.125)
    with pytest.raises(ValueError, match="power of two"):
        op(q, k_cache[:, :6], v_cache[:, :6], tables, lens, 0.125)


# ------------------------------------------- bad inputs: a clear error, never a crash
#
# The kernels index without bounds checks (Triton loads and stores, Numba's
# boundscheck=False), so every entry point checks its arguments once per call. Students call
# these functions directly (chapter 5): a wrong block id must be a ValueError naming it.

DECODE_OPS = [pytest.param(K.paged_decode_attention_ref, id="ref"),
              pytest.param(K.paged_decode_attention_cpu, id="cpu"),
              pytest.param(K.paged_decode_attention, id="triton")]
PREFILL_OPS = [pytest.param(K.paged_prefill_attention_ref, id="ref"),
               pytest.param(K.paged_prefill_attention, id="triton")]
CACHE_WRITE_OPS = [pytest.param(K.reshape_and_cache_ref, id="ref"),
                   pytest.param(K.reshape_and_cache, id="triton")]


def _with(tensor: torch.Tensor, index, value) -> torch.Tensor:
    tensor = tensor.clone()
    tensor[index] = value
    return tensor


# (what is wrong, how to break a 2-sequence decode batch of block size 8, the error's words)
BAD_DECODE_INPUTS = [
    pytest.param(lambda a: a.update(tables=_with(a["tables"], (1, 1), a["k"].shape[0])),
                 r"block_tables\[1, 1\] is \d+, not a block of this cache \(ids 0\.\.\d+\); "
                 r"sequence 1 reads it for its tokens 8\.\.10", id="block-id-past-the-cache"),
    pytest.param(lambda a: a.update(tables=_with(a["tables"], (0, 0), -1)),
                 r"block_tables\[0, 0\] is -1, not a block", id="negative-block-id"),
    pytest.param(lambda a: a.update(lens=_with(a["lens"], 1, 8 * a["tables"].shape[1] + 1)),
                 r"context_lens\[1\] is \d+ tokens, which span \d+ blocks of 8, but block_tables "
                 r"has only \d+ columns", id="context-longer-than-the-table"),
    pytest.param(lambda a: a.update(lens=_with(a["lens"], 0, 0)),
                 r"context_lens\[0\] is 0.*>= 1", id="empty-context"),
    pytest.param(lambda a: a.update(tables=a["tables"].float()),
                 "block_tables must be an int32 or int64", id="float-block-table"),
    pytest.param(lambda a: a.update(lens=a["lens"].bool()),
                 "context_lens must be an int32 or int64", id="bool-context-lens"),
    pytest.param(lambda a: a.update(lens=a["lens"][:1]),
                 r"context_lens must be .* \[num_seqs\] = \[2\]", id="context-lens-too-short"),
    pytest.param(lambda a: a.update(q=a["q"][:1]),
                 "decode takes one query per sequence: q has 1 rows but block_tables has 2",
                 id="one-query-too-few"),
    pytest.param(lambda a: a.update(q=a["q"].to(torch.int32)),
                 "q must be a floating-point tensor", id="integer-q"),
    pytest.param(lambda a: a.update(k=a["k"].to(torch.int32), v=a["v"].to(torch.int32)),
                 "KV cache must be a floating-point tensor", id="integer-cache"),
    pytest.param(lambda a: a.update(k=a["k"].to("meta"), v=a["v"].to("meta")),
                 r"every tensor must be on the cache's device \(meta\), got q on cpu, "
                 "block_tables on cpu, context_lens on cpu", id="cache-on-another-device"),
]


def _decode_args() -> dict:
    q, k, v, tables, lens = make_decode_batch(8, 4, 2, 16, [3, 11])  # blocks: 1 and 2 of 8
    return dict(q=q, k=k, v=v, tables=tables, lens=lens)


@pytest.mark.parametrize("breakage, message", BAD_DECODE_INPUTS)
@pytest.mark.parametrize("op", DECODE_OPS)
def test_decode_refuses_bad_inputs(op, breakage, message):
    args = _decode_args()
    if op is not K.paged_decode_attention:  # the unbroken batch is fine (garbage past each
        op(*args.values(), 0.25)            # sequence's last block included)
    breakage(args)
    with pytest.raises(ValueError, match=message):
        op(*args.values(), 0.25)


def _prefill_args() -> dict:
    q, k, v, tables, lens, starts, _ = make_prefill_batch(8, 4, 2, 16, [(0, 3), (5, 4)])
    return dict(q=q, k=k, v=v, tables=tables, lens=lens, starts=starts)


BAD_PREFILL_INPUTS = [
    pytest.param(lambda a: a.update(tables=_with(a["tables"], (1, 0), 10**6)),
                 r"block_tables\[1, 0\] is 1000000, not a block", id="block-id-past-the-cache"),
    pytest.param(lambda a: a.update(starts=a["starts"] + 1),
                 r"query_start_loc\[0\] must be 0, got 1", id="starts-not-at-zero"),
    pytest.param(lambda a: a.update(starts=_with(a["starts"], 1, 8)),
                 r"query_start_loc must not decrease: query_start_loc\[2\] = 7 < "
                 r"query_start_loc\[1\] = 8", id="decreasing-starts"),
    pytest.param(lambda a: a.update(q=a["q"][:-1]),
                 r"query_start_loc\[-1\] is 7 but q has 6 rows", id="fewer-rows-than-chunks"),
    pytest.param(lambda a: a.update(lens=_with(a["lens"], 0, 2)),
                 "sequence 0 brings a chunk of 3 tokens but its context_lens is 2",
                 id="chunk-longer-than-context"),
    pytest.param(lambda a: a.update(starts=a["starts"][:-1]),
                 r"query_start_loc must be an int32 or int64 \[num_seqs \+ 1\] = \[3\]",
                 id="starts-too-short"),
]


@pytest.mark.parametrize("breakage, message", BAD_PREFILL_INPUTS)
@pytest.mark.parametrize("op", PREFILL_OPS)
def test_prefill_refuses_bad_inputs(op, breakage, message):
    args = _prefill_args()
    breakage(args)
    with pytest.raises(ValueError, match=message):
        op(*args.values(), 0.25)


@pytest.mark.parametrize("slot, message", [
    pytest.param(32, r"slot_mapping\[3\] is 32, not a slot of this cache \(0\.\.31", id="past-the-cache"),
    pytest.param(-2, r"slot_mapping\[3\] is -2, not a slot.*or -1 to skip", id="negative"),
])
@pytest.mark.parametrize("op", CACHE_WRITE_OPS)
def test_cache_write_refuses_slots_outside_the_cache(op, slot, message):
    key, value, k_cache, v_cache, slots = _cache_write_case(torch.float32, "cpu", torch.int64)
    before = k_cache.clone()
    with pytest.raises(ValueError, match=message):
        op(key, value, k_cache, v_cache, _with(slots, 3, slot))
    assert torch.equal(k_cache, before)  # refused before anything was written


@pytest.mark.parametrize("op", CACHE_WRITE_OPS)
def test_cache_write_refuses_wrong_dtypes_and_devices(op):
    key, value, k_cache, v_cache, slots = _cache_write_case(torch.float32, "cpu", torch.int64)
    with pytest.raises(ValueError, match="key and value must be floating-point"):
        op(key.to(torch.int32), value, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping must be a 1-d int32 or int64 tensor, got torch.float32"):
        op(key, value, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match=r"cache's device \(meta\), got key on cpu, value on cpu, "
                                         "slot_mapping on cpu"):
        op(key, value, k_cache.to("meta"), v_cache.to("meta"), slots)


def _count_value_checks(monkeypatch) -> list:
    """Count the value checks of block tables that really run (skipped ones do not reach
    ``blocks_in_use``; the CPU kernel, unlike the references, never calls it otherwise)."""
    calls = []
    real = K._common.blocks_in_use
    monkeypatch.setattr(K._common, "blocks_in_use", lambda *a: calls.append(1) or real(*a))
    return calls


def test_index_tensors_checked_checks_once_and_only_those_tensors(monkeypatch):
    pytest.importorskip("numba", reason="the CPU decode kernel needs Numba")
    q, k, v, tables, lens = make_decode_batch(8, 4, 2, 16, [3, 11])
    slots = torch.tensor([2, 10], dtype=torch.int64)
    calls = _count_value_checks(monkeypatch)
    with K.index_tensors_checked(k.shape[0], 8, slots, [(tables, lens, None, 2)]):
        assert len(calls) == 1                          # checked on entry
        for _ in range(3):                              # then trusted, as in every layer
            K.paged_decode_attention_cpu(q, k, v, tables, lens, 0.25)
        assert len(calls) == 1
        bad = _with(tables, (1, 1), k.shape[0])         # another tensor: checked in full
        with pytest.raises(ValueError, match=r"block_tables\[1, 1\]"):
            K.paged_decode_attention_cpu(q, k, v, bad, lens, 0.25)
        with pytest.raises(ValueError, match="not a block"):   # same tensors, a smaller cache
            K.paged_decode_attention_cpu(q, k[:1], v[:1], tables, lens, 0.25)
        with pytest.raises(ValueError, match="one query per sequence"):  # shapes: every call
            K.paged_decode_attention_cpu(q[:1], k, v, tables, lens, 0.25)
    assert len(calls) == 3                              # the other tensor, the other cache
    K.paged_decode_attention_cpu(q, k, v, tables, lens, 0.25)
    assert len(calls) == 4                              # outside the block: checked again
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] is 99"):  # and entering checks
        with K.index_tensors_checked(k.shape[0], 8, _with(slots, 1, 99), []):
            pass


def test_the_model_checks_its_index_tensors_once_per_step_not_per_layer(monkeypatch):
    pytest.importorskip("numba", reason="the CPU decode kernel needs Numba")
    from labkit.model.runner import ModelRunner, SeqChunk
    runner = ModelRunner("tiny-llama", block_size=8, num_blocks=8, attention_backend="cpu")
    assert runner.spec.num_layers > 1
    runner.execute([SeqChunk(list(range(1, 12)), 0, [3, 5])])          # prefill
    calls = _count_value_checks(monkeypatch)
    runner.execute([SeqChunk([7], 11, [3, 5])])                        # one decode step
    assert len(calls) == 1


def test_cpu_decode_kernel_with_a_block_past_the_cache_raises_instead_of_crashing():
    """In a child process, so that a regression fails this test instead of killing pytest:
    before the checks, the Numba loop (compiled with boundscheck=False) read block 10**9 of
    a 4-block cache and the process died of SIGSEGV."""
    pytest.importorskip("numba", reason="the CPU decode kernel needs Numba")
    code = """
import torch
import labkit.kernels as K
q, cache = torch.randn(1, 2, 16), torch.randn(4, 8, 2, 16)
for bad in (10**9, -10**9, 4):
    try:
        K.paged_decode_attention_cpu(q, cache, cache, torch.tensor([[bad]], dtype=torch.int32),
                                     torch.tensor([5], dtype=torch.int32), 0.25)
        print("accepted", bad)
    except ValueError as err:
        print("refused", bad, "not a block of this cache" in str(err))
"""
    result = _run_python(code)
    assert result.returncode == 0, f"exit status {result.returncode}: {result.stderr[-2000:]}"
    assert result.stdout.split("\n")[:3] == [f"refused {bad} True" for bad in (10**9, -10**9, 4)]


# ------------------------------------------------------------------ backends


def test_auto_on_cpu_is_the_cpu_kernels_or_the_torch_reference():
    backend, reason = K.select_attention_backend("auto", "cpu")
    assert "no CUDA device" in reason and "7.5" in reason
    assert backend == ("cpu" if K.backend.HAS_NUMBA else "torch")
    if backend == "cpu":
        ops = K.get_attention_ops("cpu")
        from labkit.kernels.paged_prefill_attention import paged_prefill_attention_cpu
        assert ops.decode is K.paged_decode_attention_cpu and ops.prefill is paged_prefill_attention_cpu


def test_torch_is_always_available():
    assert K.select_attention_backend("torch", "cpu")[0] == "torch"
    ops = K.get_attention_ops("torch")
    assert ops.name == "torch"
    assert (ops.reshape_and_cache, ops.decode, ops.prefill) == (
        K.reshape_and_cache_ref, K.paged_decode_attention_ref, K.paged_prefill_attention_ref)


def test_unknown_backend_lists_the_options():
    with pytest.raises(ValueError, match="'auto', 'torch', 'triton'"):
        K.select_attention_backend("flash", "cpu")
    with pytest.raises(ValueError, match="'torch', 'triton'"):
        K.get_attention_ops("auto")


def test_triton_on_cpu_is_the_interpreter():
    if _interpreter_skip_reason():
        pytest.skip(_interpreter_skip_reason())
    backend, reason = K.select_attention_backend("triton", "cpu")
    assert backend == "triton" and "interpreter" in reason
    ops = K.get_attention_ops("triton")
    assert (ops.name, ops.decode, ops.prefill) == ("triton", K.paged_decode_attention,
                                                   K.paged_prefill_attention)


def test_triton_on_cpu_without_interpreter_says_how_to_fix(monkeypatch):
    monkeypatch.setattr(K.backend, "triton_is_interpreted", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        K.select_attention_backend("triton", "cpu")


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA GPU of the given (name, capability), as far as labkit's checks can tell, with
    the kernels compiled for it (not interpreted): ``fake_gpu("Tesla T4", (7, 5))``."""
    def install(name: str, capability: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(K.backend, "HAS_TRITON", True)
        monkeypatch.setattr(K.backend, "triton_is_interpreted", lambda: False)
    return install


def test_auto_on_a_t4_is_triton_in_fp16_and_fp32(fake_gpu):
    fake_gpu("Tesla T4", (7, 5))
    for dtype in (None, torch.float16, torch.float32):
        backend, reason = K.select_attention_backend("auto", "cuda", dtype)
        assert backend == "triton" and reason == "Triton kernels compiled for Tesla T4 (compute capability 7.5)"
    assert K.select_attention_backend("triton", "cuda", torch.float16)[0] == "triton"
    assert K.default_dtype("cuda")[0] == torch.float16


def test_bf16_on_a_t4_falls_back_to_the_torch_reference_or_is_refused(fake_gpu):
    fake_gpu("Tesla T4", (7, 5))
    backend, reason = K.select_attention_backend("auto", "cuda", torch.bfloat16)
    assert backend == "torch"
    assert "Tesla T4 (compute capability 7.5): bf16 needs compute capability 8.0+" in reason
    assert "dtype='float16'" in reason
    with pytest.raises(RuntimeError, match=r"cannot run bf16 on Tesla T4.*dtype='float16'.*'torch' backend"):
        K.select_attention_backend("triton", "cuda", torch.bfloat16)
    # and the launchers themselves refuse it, before Triton would see it
    from types import SimpleNamespace
    from labkit.kernels._common import check_triton_launch
    t = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"bf16 is refused by the Triton kernels on Tesla T4.*dtype='float16'"):
        check_triton_launch(object(), t, t)
    check_triton_launch(object(), SimpleNamespace(device=t.device, dtype=torch.float16))   # fp16 passes


def test_gpus_from_sm_80_run_bf16_and_older_ones_than_the_t4_run_no_kernel(fake_gpu):
    fake_gpu("NVIDIA A100-SXM4-40GB", (8, 0))
    assert K.select_attention_backend("auto", "cuda", torch.bfloat16)[0] == "triton"
    assert K.default_dtype("cuda")[0] == torch.float32
    fake_gpu("Tesla V100-SXM2-16GB", (7, 0))
    backend, reason = K.select_attention_backend("auto", "cuda", torch.float16)
    assert backend == "torch" and "built for compute capability 7.5+" in reason
    with pytest.raises(RuntimeError, match="cannot run on Tesla V100.*use 'torch' or 'auto'"):
        K.select_attention_backend("triton", "cuda")


def test_the_model_dtype_follows_the_gpu_unless_asked(fake_gpu):
    from labkit.model.runner import resolve_dtype
    assert resolve_dtype("auto", "cpu") == (torch.float32, "float32")
    fake_gpu("Tesla T4", (7, 5))
    dtype, why = resolve_dtype("auto", "cuda")
    assert dtype == torch.float16
    assert why.startswith("float16, the default on Tesla T4 (compute capability 7.5)") and "dtype='float32'" in why
    assert resolve_dtype("float32", "cuda") == (torch.float32, "float32")       # asked: kept
    assert resolve_dtype(torch.bfloat16, "cuda") == (torch.bfloat16, "bfloat16")
    with pytest.raises(ValueError, match="unknown dtype 'half32'; choose 'auto' or one of float32, fp32"):
        resolve_dtype("half32", "cuda")


def test_triton_interpreter_refuses_bf16_when_the_backend_is_chosen():
    if _interpreter_skip_reason():
        pytest.skip(_interpreter_skip_reason())
    with pytest.raises(RuntimeError, match="computes bf16 wrongly"):
        K.select_attention_backend("triton", "cpu", torch.bfloat16)


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**environ, **env}, timeout=120)


def test_import_without_triton_keeps_the_references():
    code = """
import sys
sys.modules["triton"] = None  # import triton now raises ImportError
import torch
import labkit.kernels as K
assert not K.HAS_TRITON
print(K.select_attention_backend("auto", "cpu")[0])
q = torch.randn(1, 2, 16); cache = torch.randn(2, 8, 2, 16)
out = K.get_attention_ops("torch").decode(q, cache, cache, torch.tensor([[1]]), torch.tensor([5]), 0.25)
print(tuple(out.shape))
try:
    K.get_attention_ops("triton")
except RuntimeError as err:
    print("refused:", "not installed" in str(err))
"""
    result = _run_python(code)
    assert result.returncode == 0, result.stderr
    auto = "cpu" if importlib.util.find_spec("numba") else "torch"   # the CPU kernels need no Triton
    assert result.stdout.split("\n")[:3] == [auto, "(1, 2, 16)", "refused: True"]


@pytest.mark.slow
def test_the_engine_sets_up_the_interpreter_before_transformers_imports_triton():
    """Transformers imports torch._dynamo, which imports Triton: Triton's own @jit library
    (tl.max ...) is then defined compiled, and an interpreted kernel calling it fails. LLM()
    imports labkit.kernels first; code that imports Triton first gets compiled kernels and
    a clear refusal of the interpreter, not a crash inside Triton."""
    if torch.cuda.is_available() or not K.HAS_TRITON:
        pytest.skip("needs a machine without CUDA, with Triton")
    code = """
from labkit import LLM, SamplingParams
llm = LLM("tiny-llama", attention_backend="triton", num_blocks=8)
out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
print(len(out[0].outputs[0].token_ids))
"""
    result = _run_python(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "2"
    code = """
import triton.language
import labkit.kernels as K
print(not K.triton_is_interpreted())
try:
    K.select_attention_backend("triton", "cpu")
except RuntimeError as err:
    print("TRITON_INTERPRET=1" in str(err) and "or triton" in str(err))
"""
    result = _run_python(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True", "True"]


def test_compiled_kernels_on_cpu_are_refused_with_the_fix():
    """TRITON_INTERPRET=0 at import on a CPU-only machine: kernels compiled for a GPU."""
    if torch.cuda.is_available() or not K.HAS_TRITON:
        pytest.skip("needs a machine without CUDA, with Triton")
    code = """
import torch
import labkit.kernels as K
assert not K.triton_is_interpreted()
try:
    K.paged_decode_attention(torch.randn(1, 2, 16), torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16),
                             torch.tensor([[1]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32), 0.25)
except RuntimeError as err:
    print("TRITON_INTERPRET=1" in str(err))
"""
    result = _run_python(code, TRITON_INTERPRET="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_bench_cpu_smoke(capsys):
    from labkit.bench.kernels import main
    assert main(["--ref-cpu", "--batch", "2", "--context", "64", "--repeats", "2"]) == 0
    assert "ms" in capsys.readouterr().out


def test_bench_step_smoke(capsys):
    """``python -m labkit.bench step``: one decode step and one prefill of the real runner,
    with the time spent in the attention ops measured inside them."""
    import json

    from labkit.bench.step import main
    assert main(["--model", "tiny-llama", "--batch", "2", "--context", "20", "--prefill", "16",
                 "--repeats", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == "tiny-llama" and result["batch"] == 2
    for step in ("decode", "prefill"):
        assert 0 < result[f"{step}_attention_s"] < result[f"{step}_s"]


def test_bench_step_times_a_wave_of_prompts(capsys):
    """``--prompts N``: the prefill step holds N fresh prompts (a class's wave of requests), its
    rate counts all their tokens, and the --ops tables say so."""
    import json

    from labkit.bench.step import main
    args = ["--model", "tiny-llama", "--batch", "2", "--context", "20", "--prefill", "16", "--repeats", "1"]
    assert main(args + ["--prompts", "3"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["prefill_prompts"] == 3 and r["prefill_tokens"] == 16
    from labkit.bench.step import ModelRunner, step_timings
    t = step_timings(ModelRunner("tiny-llama", num_blocks=16), batch=2, context=20, prefill=16, repeats=1, prompts=3)
    assert t["prefill_tok_per_s"] == pytest.approx(3 * 16 / t["prefill_s"])
    assert main(args + ["--prompts", "3", "--markdown"]) == 0
    assert "prefill step, 3 16-token prompts" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--prompts must be at least 1"):
        main(args + ["--prompts", "0"])


def test_bench_prefill_times_every_method_on_each_shape(capsys):
    """``python -m labkit.bench prefill``: the C++ tiles (on AMX where it runs, and without), the
    row loop, SDPA and the reference on fresh prompts and on a chunk after cached tokens;
    GFLOP/s from the causal work; a shape it cannot read is refused by name."""
    import json

    from labkit.bench.prefill import causal_flops, main, parse_shape
    from labkit.kernels import cpu_extension
    assert parse_shape("2x16") == [(0, 16), (0, 16)] and parse_shape("8@24") == [(24, 8)]
    assert causal_flops([(0, 2), (3, 1)], heads=1, head_dim=1) == 4 * (1 + 2 + 4)
    if cpu_extension.load() is None:
        pytest.skip(f"labkit's C++ kernels are not built here: {cpu_extension.status()[1]}")
    args = ["--shapes", "2x16", "8@24", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--repeats", "1"]
    assert main(args + ["--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert list(r["shapes"]) == ["2x16", "8@24"]
    for row in r["shapes"].values():
        assert set(row) == {"tiles", "tiles-fp32", "rows", "sdpa", "reference"}
        assert all(m["ms"] > 0 and m["gflop_per_s"] > 0 and m["model_ms"] == pytest.approx(30 * m["ms"], abs=0.1)
                   for m in row.values())
    assert main(args) == 0
    assert "| 8@24 |" in capsys.readouterr().out
    assert main(["--shapes", "8by128"]) == 2
    assert "shape '8by128'" in capsys.readouterr().err


def test_references_work_inside_and_outside_inference_mode():
    # The engine runs under torch.inference_mode; the CPU workspace a reference caches there
    # must not break a later call outside it (inference tensors cannot be written outside).
    q, k_cache, v_cache, tables, lens = make_decode_batch(16, 4, 2, 16, [5, 17])
    with torch.inference_mode():
        inside = K.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.25)
    outside = K.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.25)
    torch.testing.assert_close(inside, outside)


# ------------------------------------------------- flash-decoding: the split decode path

# block size, partition size (a multiple of the tile, max(16, block size)), context lengths:
# contexts of one token, one partition exactly, one token past it, several partitions with
# a partly filled last block; GQA group 3 (SmolLM2's) and 1.
SPLIT_CASES = [
    pytest.param(16, 16, 9, 3, [1, 16, 17, 50], id="bs16-p16-g3"),
    pytest.param(16, 48, 9, 3, [47, 48, 49, 100], id="bs16-p48-g3"),
    pytest.param(8, 32, 2, 2, [1, 8, 33, 70], id="bs8-p32-g1"),
    pytest.param(32, 64, 8, 2, [64, 65, 130], id="bs32-p64-g4"),
    pytest.param(64, 64, 4, 1, [1, 64, 129], id="bs64-p64-g4"),
]


@pytest.mark.parametrize("block_size, partition_size, num_heads, num_kv_heads, context_lens", SPLIT_CASES)
def test_split_decode_matches_unsplit_and_ref(device, block_size, partition_size, num_heads, num_kv_heads,
                                              context_lens):
    q, k_cache, v_cache, tables, lens = make_decode_batch(block_size, num_heads, num_kv_heads, 64,
                                                          context_lens, torch.float32, device)
    args = (q, k_cache, v_cache, tables, lens, 0.125)
    split = K.paged_decode_attention(*args, partition_size=partition_size)
    unsplit = K.paged_decode_attention(*args, partition_size=0)
    ref = K.paged_decode_attention_ref(*args)
    assert split.shape == q.shape and not split.isnan().any()
    torch.testing.assert_close(split, ref, **TOL[torch.float32])
    torch.testing.assert_close(split, unsplit, **TOL[torch.float32])


def test_split_decode_fp16_matches_ref(device):
    q, k_cache, v_cache, tables, lens = make_decode_batch(16, 9, 3, 64, [5, 40], torch.float16, device)
    out = K.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, partition_size=16)
    ref = K.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, ref, **TOL[torch.float16])


# ------------------------------------------------------------------ fp16 against fp32
# What a T4 runs. fp16 keeps 11 significant bits (unit roundoff u = 2**-11 ~ 4.9e-4). The
# kernels and references read fp16, accumulate in fp32 and round the output once; against an
# fp32 computation on the unrounded inputs the inputs' rounding adds its share. Attention
# outputs here are at most ~4 in magnitude, so 5e-3 absolute and relative (~10 u) holds with
# room: measured at most 1.5e-3 (decode and prefill, kernels and references alike).
FP16_VS_FP32 = dict(atol=5e-3, rtol=5e-3)


def _half(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.half() for t in tensors]


FP16_OPS = [pytest.param("ref", id="torch-ref"), pytest.param("cpu", id="cpu-backend"),
            pytest.param("triton", id="triton-interpreter")]


def _ops(which: str) -> K.AttentionOps:
    if which == "triton" and _interpreter_skip_reason():
        pytest.skip(_interpreter_skip_reason())
    if which == "cpu" and not K.backend.HAS_NUMBA:
        pytest.skip("the 'cpu' backend needs Numba")
    return K.get_attention_ops({"ref": "torch"}.get(which, which))


@pytest.mark.parametrize("which", FP16_OPS)
@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_dim, context_lens", DECODE_CASES[:3])
def test_fp16_decode_is_fp32_within_fp16_rounding(which, block_size, num_heads, num_kv_heads, head_dim,
                                                  context_lens):
    ops = _ops(which)
    q, k_cache, v_cache, tables, lens = make_decode_batch(block_size, num_heads, num_kv_heads, head_dim,
                                                          context_lens)
    fp32 = K.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    out = ops.decode(*_half(q, k_cache, v_cache), tables, lens, head_dim ** -0.5)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), fp32, **FP16_VS_FP32)


@pytest.mark.parametrize("which", FP16_OPS)
@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_dim, chunks", PREFILL_CASES[1:])
def test_fp16_prefill_is_fp32_within_fp16_rounding(which, block_size, num_heads, num_kv_heads, head_dim, chunks):
    ops = _ops(which)
    q, k_cache, v_cache, tables, lens, starts, _ = make_prefill_batch(block_size, num_heads, num_kv_heads,
                                                                      head_dim, chunks)
    fp32 = K.paged_prefill_attention_ref(q, k_cache, v_cache, tables, lens, starts, head_dim ** -0.5)
    out = ops.prefill(*_half(q, k_cache, v_cache), tables, lens, starts, head_dim ** -0.5)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), fp32, **FP16_VS_FP32)


@pytest.mark.parametrize("which", FP16_OPS)
def test_fp16_cache_write_rounds_fp32_activations_once(which):
    """An fp16 cache written from fp32 or fp16 activations holds their fp16 rounding, exactly."""
    ops = _ops(which)
    key, value = torch.randn(2, 5, 3, 64).unbind(0)
    slots = torch.tensor([3, -1, 17, 8, 30])
    for k, v in ((key, value), (key.half(), value.half())):
        k_cache, v_cache = torch.zeros(2, 4, 8, 3, 64, dtype=torch.float16).unbind(0)
        ops.reshape_and_cache(k, v, k_cache, v_cache, slots)
        keep = slots >= 0
        assert torch.equal(k_cache.view(-1, 3, 64)[slots[keep]], key[keep].half())
        assert torch.equal(v_cache.view(-1, 3, 64)[slots[keep]], value[keep].half())


def test_prefill_as_planned_for_a_t4_matches_ref():
    """On GPUs before sm_80 a prefill program of head dim 128 takes 32 query rows, not 64 (the
    compile check's register figures): that plan, run by the interpreter, is still exact."""
    if _interpreter_skip_reason():
        pytest.skip(_interpreter_skip_reason())
    from labkit.kernels.paged_prefill_attention import plan_prefill
    for dtype in (torch.float32, torch.float16):
        q, k_cache, v_cache, tables, lens, starts, chunk_lens = make_prefill_batch(
            16, 4, 2, 128, [(0, 40), (9, 23)], dtype)
        out = torch.empty_like(q)
        t4 = plan_prefill(out, q, k_cache, v_cache, tables, lens, starts, 128 ** -0.5, max(chunk_lens), (7, 5))
        a100 = plan_prefill(out, q, k_cache, v_cache, tables, lens, starts, 128 ** -0.5, max(chunk_lens), (8, 0))
        assert t4.constexprs["QUERY_TILE"] * t4.constexprs["GROUP_PAD"] == 32 and t4.num_warps == 8
        assert a100.constexprs["QUERY_TILE"] * a100.constexprs["GROUP_PAD"] == 64
        t4()
        ref = K.paged_prefill_attention_ref(q, k_cache, v_cache, tables, lens, starts, 128 ** -0.5)
        torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("partition_size", [8, 24, -16, 16.0])
def test_split_decode_refuses_partitions_that_are_not_whole_tiles(partition_size):
    q, k_cache, v_cache, tables, lens = make_decode_batch(16, 4, 2, 16, [5, 17])
    with pytest.raises(ValueError, match="partition_size must be 0 .* multiple of the kernel's tile"):
        K.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, partition_size=partition_size)


def test_choose_partition_size_splits_only_small_grids_with_long_contexts():
    from labkit.kernels.paged_decode_attention import DEFAULT_PARTITION_SIZE, choose_partition_size
    p = DEFAULT_PARTITION_SIZE
    assert choose_partition_size(2, 8, 8192, num_sms=132) == p          # 16 programs, 132 SMs: split
    assert choose_partition_size(64, 8, 8192, num_sms=132) == 0         # 512 programs fill the GPU
    assert choose_partition_size(2, 8, p, num_sms=132) == 0             # one partition: nothing to split
    assert choose_partition_size(2, 8, 8192, num_sms=None) == 0         # off a GPU: never
    assert choose_partition_size(1, 1, 8192, num_sms=132, tile=48) % 48 == 0


# ------------------------------------------------- the CPU backend's fast paths (PERF-SPEED)

from labkit.kernels.paged_prefill_attention import paged_prefill_attention_cpu  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(block_size=st.sampled_from([8, 16]), kv_heads=st.integers(1, 3), group=st.sampled_from([1, 3]),
       head_dim=st.sampled_from([16, 64]),
       chunks=st.lists(st.tuples(st.sampled_from([0, 0, 5, 17]), st.integers(1, 40)), min_size=1, max_size=5),
       seed=st.integers(0, 2**16), rows_max_context=st.sampled_from([0, 20, 10_000]))
def test_cpu_prefill_matches_naive_on_mixed_batches(block_size, kv_heads, group, head_dim, chunks, seed,
                                                    rows_max_context):
    """Short contexts take the C++ tiles (where they run vectorized), the others SDPA
    (causal for fresh prompts, masked after earlier tokens), in one call: the result is the
    naive attention whatever the mix (prefix hits, one-token chunks, NaN in every slot
    nobody owns). ``rows_max_context`` moves the line between the two paths: none, some,
    all of the chunks on the tiles."""
    prefill = sys.modules[paged_prefill_attention_cpu.__module__]  # the module, not the function it exports
    num_heads = kv_heads * group
    q, k_cache, v_cache, tables, lens, starts, chunk_lens = make_prefill_batch(
        block_size, num_heads, kv_heads, head_dim, chunks, seed=seed)
    scale = head_dim ** -0.5
    saved, prefill.TILES_MAX_CONTEXT = prefill.TILES_MAX_CONTEXT, rows_max_context
    try:
        out = paged_prefill_attention_cpu(q, k_cache, v_cache, tables, lens, starts, scale)
    finally:
        prefill.TILES_MAX_CONTEXT = saved
    expect = naive_attention(q, k_cache, v_cache, tables, lens, chunk_lens, scale)
    torch.testing.assert_close(out.double(), expect, **TOL[torch.float32])


def test_cpu_prefill_is_the_cpu_backends_prefill_and_checks_its_inputs():
    assert K.get_attention_ops("cpu").prefill is paged_prefill_attention_cpu
    q, k_cache, v_cache, tables, lens, starts, _ = make_prefill_batch(8, 4, 2, 16, [(0, 9)])
    bad = tables.clone()
    bad[0, 0] = 10_000
    with pytest.raises(ValueError, match="not a block of this cache"):
        paged_prefill_attention_cpu(q, k_cache, v_cache, bad, lens, starts, 0.25)


@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_dim, context_lens", DECODE_CASES)
def test_cpu_decode_kernel_reads_bf16_caches(block_size, num_heads, num_kv_heads, head_dim, context_lens):
    """A bf16 cache is widened block by block inside the kernel: the result is the naive
    attention over the same bf16 values (computed in float64), rounded to bf16 once."""
    pytest.importorskip("numba", reason="the CPU decode kernel needs Numba")
    q, k_cache, v_cache, tables, lens = make_decode_batch(block_size, num_heads, num_kv_heads,
                                                          head_dim, context_lens, dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    out = K.paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, scale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    expect = naive_attention(q.float(), k_cache.float(), v_cache.float(), tables, lens, [1] * len(context_lens), scale)
    torch.testing.assert_close(out.double(), expect.to(torch.bfloat16).double(), atol=2e-2, rtol=1e-2)


def test_bench_step_ops_breakdown(capsys):
    """``python -m labkit.bench step --ops``: every category measured, floors from the work
    the step really does (the decode step's KV bytes are its contexts' K and V in every
    layer), and the markdown tables docs/performance.md quotes."""
    import json

    from labkit.bench.step import main
    args = ["--model", "tiny-llama", "--batch", "3", "--context", "20", "--prefill", "16", "--repeats", "1"]
    assert main(args + ["--ops"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["peaks"]["matmul_gflops"] > 0 and r["peaks"]["read_gbps"] > 0
    for kind in ("decode", "prefill"):
        sec = r[f"{kind}_ops"]["seconds"]
        assert set(sec) == {"matmul", "attention", "elementwise", "python", "tensor_building", "sampling",
                            "scheduling"}
        assert sec["matmul"] > 0 and sec["attention"] > 0 and all(v >= 0 for v in sec.values())
        assert all(v > 0 for v in r[f"{kind}_ops"]["work"].values())   # floors: work / peak (JSON rounds them)
        assert all(v >= 0 for v in r[f"{kind}_ops"]["floors"].values())
    from labkit.model import load_model
    cfg = load_model("tiny-llama").config
    kv_dim = cfg.num_key_value_heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    assert r["decode_ops"]["work"]["kv_bytes"] == 2 * cfg.num_hidden_layers * 3 * 20 * kv_dim * 4
    assert main(args + ["--markdown"]) == 0
    table = capsys.readouterr().out
    assert "| matmul |" in table and "| attention |" in table and "decode step, batch 3" in table
