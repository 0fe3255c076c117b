"""Attention kernels: every Triton kernel against its torch reference, and every torch
reference against a naive dense attention that reads the cache token by token.

The Triton cases run twice when they can: on CPU through the Triton interpreter (the
kernels must then have been defined under TRITON_INTERPRET=1, which this module and
``labkit.kernels`` arrange on machines without CUDA) and compiled on a CUDA GPU of compute
capability 8.0+ (marked ``gpu``; skipped elsewhere with the reason). Interpreter shapes
are kept tiny: the interpreter runs one program at a time in numpy.

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

# ------------------------------------------------------------------------ fixtures


def _cuda_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device: compiled Triton kernels need an NVIDIA GPU of compute capability 8.0+"
    if torch.cuda.get_device_capability() < (8, 0):
        return f"{torch.cuda.get_device_name()} is below compute capability 8.0 (Triton needs 8.0+)"
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
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
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
    torch.testing.assert_close(chunked, whole, atol=0, rtol=0)


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


# ------------------------------------------------------------------ backends


def test_auto_on_cpu_is_the_cpu_kernels_or_the_torch_reference():
    backend, reason = K.select_attention_backend("auto", "cpu")
    assert "no CUDA device" in reason and "8.0" in reason
    assert backend == ("cpu" if K.backend.HAS_NUMBA else "torch")
    if backend == "cpu":
        ops = K.get_attention_ops("cpu")
        assert ops.decode is K.paged_decode_attention_cpu and ops.prefill is K.paged_prefill_attention_ref


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


def test_references_work_inside_and_outside_inference_mode():
    # The engine runs under torch.inference_mode; the CPU workspace a reference caches there
    # must not break a later call outside it (inference tensors cannot be written outside).
    q, k_cache, v_cache, tables, lens = make_decode_batch(16, 4, 2, 16, [5, 17])
    with torch.inference_mode():
        inside = K.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.25)
    outside = K.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.25)
    torch.testing.assert_close(inside, outside)
