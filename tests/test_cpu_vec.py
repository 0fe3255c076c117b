"""The C++ kernels on every instruction set this CPU runs.

The kernels are written once over one vector type (``kernels/csrc/vec.h``: an AVX-512
register, two AVX2 registers, or 16 plain floats), and ``kernels/cpu_extension.py`` builds
the one this CPU runs best. Here each build this CPU can run (on an AVX-512 machine: all
three, the lesser ones forced as ``LABKIT_CPU_ISA`` does) is held to the torch references:
decode attention (fp32 and bf16 caches, head sizes 16-128, every compiled group and the
run-time one, block sizes 1-64, ragged lengths, block tables with holes over a cache whose
other blocks hold NaN), prefill rows, the fused element-wise ops (rows that are not a
multiple of 16 long), bf16 rounding, and the vector exp's accuracy. The ISA choice itself
(what the CPU reports, what the build is named) is tested on the CPUs' own flag lines.
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from labkit.kernels import cpu_extension
from labkit.kernels.kv_quant import dequantize, quantize
from labkit.kernels.paged_decode_attention import decode_attention_torch
from labkit.kernels.reshape_and_cache import reshape_and_cache_ref
from labkit.model.llama import RMSNorm, apply_rope

NATIVE = cpu_extension.cpu_isa()


def _isa_param(isa):
    # the native build is the one every other test uses; a lesser one is one more compile
    return pytest.param(isa, marks=() if isa == NATIVE else pytest.mark.slow)


@pytest.fixture(scope="module", params=[_isa_param(isa) for isa in cpu_extension.ISAS])
def ext(request):
    """The extension built for one ISA (skipped where this CPU cannot run it)."""
    isa = request.param
    if isa not in cpu_extension.runnable_isas():
        pytest.skip(f"this CPU does not run {isa} (its best: {NATIVE})")
    why_not = cpu_extension._why_not()
    if why_not is not None:
        pytest.skip(f"not built here: {why_not}")
    module = cpu_extension.load(isa=isa)
    assert module is not None, cpu_extension.status(isa)[1]  # a compiler is here: failing to build is a bug
    assert module.isa() == isa, "the build's vectors are not the ISA it was built for"
    return module


def _paged(lens, block_size, kv_heads, head_dim, heads, dtype, seed=0):
    """A paged batch whose block tables use a scattered third of the cache and end in holes
    (-1) past each context; every block no sequence owns holds NaN, so a kernel that reads
    one poisons its output."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lens, dtype=torch.int32)
    width = int((lens.max() + block_size - 1) // block_size) + 2
    num_blocks = 3 * len(lens) * width
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * width].view(len(lens), width).int()
    owned = torch.zeros(num_blocks, dtype=torch.bool)
    for s, n in enumerate(lens.tolist()):
        used = (n + block_size - 1) // block_size
        owned[tables[s, :used].long()] = True
        tables[s, used:] = -1
    k[~owned] = float("nan")
    v[~owned] = float("nan")
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    return q, k, v, tables, lens


def _reference(q, k, v, tables, lens, scale):
    return decode_attention_torch(q, k, v, tables.clamp(min=0), lens, scale)  # the reference gathers whole rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [
    (64, 9, 3),     # SmolLM2: group 3
    (64, 8, 8),     # group 1
    (64, 4, 2),     # group 2
    (128, 32, 8),   # Llama-3-8B: group 4
    (128, 16, 2),   # group 8
    (64, 10, 2),    # group 5: the run-time-group loop
    (128, 12, 2),   # group 6, head 128: the run-time-group loop
    (16, 4, 2),     # tiny-llama: one vector per head row
    (32, 6, 1),
])
@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 64])
def test_decode_matches_the_reference(ext, dtype, head_dim, heads, kv_heads, block_size):
    """Lengths around the block size and the 16-token chunk: one token, a partial chunk, full
    blocks, one token into the next block, and long ones."""
    lens = [1, 7, block_size, block_size + 1, 3 * block_size - 1, 97, 300]
    q, k, v, tables, lens = _paged(lens, block_size, kv_heads, head_dim, heads, dtype)
    out = ext.paged_decode_attention(q, k, v, tables, lens, 0.3)
    torch.testing.assert_close(out, _reference(q, k, v, tables, lens, 0.3), atol=2e-5, rtol=2e-5)


def test_decode_with_many_kv_heads_and_a_large_softmax_range(ext):
    """32 KV heads, scores spread over ~200 (a new maximum in a late block must rescale what
    came before, and most weights underflow to 0). Held to the reference in fp64: a score of
    ~100 computed in fp32 is off by ~1e-5, and so, relatively, is its weight exp(s - m); the
    fp32 reference is itself 1.6e-5 off, and HEAD's AVX-512 kernel 4.5e-5."""
    q, k, v, tables, lens = _paged([5, 130, 600], 16, 32, 128, 32, torch.float32, seed=1)
    out = ext.paged_decode_attention(q * 20, k, v, tables, lens, 0.5)
    exact = _reference((q * 20).double(), k.double(), v.double(), tables, lens, 0.5).float()
    torch.testing.assert_close(out, exact, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_rows_are_causal_attention_over_each_rows_prefix(ext, dtype):
    """Row r attends to the first row_lens[r] tokens of sequence row_seq[r]: a fresh prompt, a
    chunk after a 23-token prefix, a one-token chunk after 40 tokens."""
    q, k, v, tables, lens = _paged([37, 23 + 14, 41], 16, 3, 64, 9, dtype, seed=5)
    chunks = [(0, 37), (23, 14), (40, 1)]  # (tokens before the chunk, chunk length)
    row_seq = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, (_, n) in enumerate(chunks)])
    row_lens = torch.cat([torch.arange(p + 1, p + n + 1, dtype=torch.int32) for p, n in chunks])
    qr = torch.randn(len(row_seq), 9, 64, generator=torch.Generator().manual_seed(6))
    out = ext.paged_prefill_attention_rows(qr, k, v, tables, row_lens, row_seq, 0.2)
    expect = _reference(qr, k, v, tables[row_seq.long()], row_lens, 0.2)
    torch.testing.assert_close(out, expect, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 16, 2), (32, 6, 1), (16, 4, 4)])
def test_prefill_tiles_are_the_rows_of_their_chunks(ext, dtype, head_dim, heads, kv_heads):
    """paged_prefill_attention_tiles (csrc/prefill_attention.cpp) works out each row's sequence
    and length itself: the rows entry's output given them (within float rounding: the tiles sum
    in another order), and the reference's, for a fresh prompt, a chunk after a prefix, an empty
    chunk, a one-token chunk and a 17-row chunk (a tile and a row past it); a chunk longer than
    its context is refused."""
    q, k, v, tables, lens = _paged([37, 23 + 14, 9, 41, 100], 16, kv_heads, head_dim, heads, dtype, seed=7)
    chunks = [(0, 37), (23, 14), (9, 0), (40, 1), (83, 17)]
    starts = torch.tensor([0, 37, 51, 51, 52, 69], dtype=torch.int32)
    row_seq = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, (_, n) in enumerate(chunks)])
    row_lens = torch.cat([torch.arange(p + 1, p + n + 1, dtype=torch.int32) for p, n in chunks])
    qr = torch.randn(len(row_seq), heads, head_dim, generator=torch.Generator().manual_seed(8))
    out = ext.paged_prefill_attention_tiles(qr, k, v, tables, lens, starts, 0.2, amx=False)  # AMX: the tests below
    torch.testing.assert_close(out, ext.paged_prefill_attention_rows(qr, k, v, tables, row_lens, row_seq, 0.2),
                               atol=1e-5, rtol=2e-5)
    torch.testing.assert_close(out, _reference(qr, k, v, tables[row_seq.long()], row_lens, 0.2), atol=2e-5, rtol=2e-5)
    with pytest.raises(RuntimeError, match="sequence 2: a chunk of 10 rows in a context of 9"):
        ext.paged_prefill_attention_tiles(torch.randn(79, heads, head_dim), k, v, tables, lens,
                                          torch.tensor([0, 37, 51, 61, 62, 79], dtype=torch.int32), 0.2)


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(48, 6, 2), (80, 8, 2), (96, 4, 4), (112, 7, 1)])
def test_prefill_tiles_take_every_head_size_of_16s(ext, head_dim, heads, kv_heads):
    """Head sizes that are multiples of 16 but not powers of two (Phi's 80, 96, ...): each output
    row is written exactly head_dim wide (a wider write would overwrite the next head's output,
    or run past the tensor), and equals the reference; the NaN in every block nobody owns stays
    unread."""
    q, k, v, tables, lens = _paged([40, 9 + 20, 3], 16, kv_heads, head_dim, heads, torch.float32, seed=head_dim)
    chunks = [(0, 40), (9, 20), (2, 1)]
    starts = torch.tensor([0, 40, 60, 61], dtype=torch.int32)
    row_seq = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, (_, n) in enumerate(chunks)])
    row_lens = torch.cat([torch.arange(p + 1, p + n + 1, dtype=torch.int32) for p, n in chunks])
    qr = torch.randn(61, heads, head_dim, generator=torch.Generator().manual_seed(1))
    out = ext.paged_prefill_attention_tiles(qr, k, v, tables, lens, starts, 0.1)
    torch.testing.assert_close(out, _reference(qr, k, v, tables[row_seq.long()], row_lens, 0.1), atol=2e-5, rtol=2e-5)


def _chunked_calls(ext, qs, k, v, tables, lens):
    """run(seqs, chunks): the tiles' output for rows [a, b) of each sequence in seqs (its queries
    in qs, sequences of the given lengths one after the other), as one call."""
    def run(seqs, chunks):
        first = [sum(lens[:s]) for s in seqs]
        rows = torch.cat([qs[f + a:f + b] for f, (a, b) in zip(first, chunks)])
        starts = torch.tensor([0] + list(torch.tensor([b - a for a, b in chunks]).cumsum(0)), dtype=torch.int32)
        ctx = torch.tensor([b for _, b in chunks], dtype=torch.int32)
        return ext.paged_prefill_attention_tiles(rows, k, v, tables[list(seqs)], ctx, starts, 0.125)
    return run


def test_prefill_tiles_do_not_depend_on_the_batch_or_the_chunking(ext):
    """A row's attention is the same bits whichever tile, chunk or batch it falls in (the CPU
    backend's logits are batch-invariant): a 45-token prompt's rows, computed as one chunk
    alone, beside two other sequences, and as chunks of 20 + 25 and 8 + 37 tokens. A chunk of
    fewer than 8 rows takes the row loop instead (a tile would pack its whole context for a few
    rows), whatever else the call holds: the rows entry's bits, alone or beside tiled chunks."""
    q, k, v, tables, lens = _paged([45, 30, 70], 16, 3, 64, 9, torch.float32, seed=11)
    qs = torch.randn(45 + 30 + 70, 9, 64, generator=torch.Generator().manual_seed(12))

    run = _chunked_calls(ext, qs, k, v, tables, [45, 30, 70])

    alone = run([0], [(0, 45)])
    assert torch.equal(run([1, 0, 2], [(0, 30), (0, 45), (0, 70)])[30:75], alone)
    assert torch.equal(torch.cat([run([0], [(0, 20)]), run([0], [(20, 45)])]), alone)
    assert torch.equal(torch.cat([run([0], [(0, 8)]), run([2, 0], [(0, 70), (8, 45)])[70:]]), alone)
    tail = run([0], [(40, 45)])                        # 5 rows: the row loop
    rows = ext.paged_prefill_attention_rows(qs[40:45], k, v, tables, torch.arange(41, 46, dtype=torch.int32),
                                            torch.zeros(5, dtype=torch.int32), 0.125)
    assert torch.equal(tail, rows)
    assert torch.equal(run([1, 0, 2], [(0, 30), (40, 45), (63, 70)])[30:35], rows)


def _bf16_attention(q, k, v, tables, lens, scale):
    """Attention as the AMX tiles compute it, in fp64: the scaled queries rounded to bf16, the
    probabilities exp(s - max) rounded to bf16 for the values' sum, the softmax's sum from the
    unrounded ones. Rows as the decode reference takes them: one query row per entry."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[2]
    bs = k.shape[1]
    for r in range(q.shape[0]):
        n = int(lens[r])
        slots = [int(tables[r, t // bs]) * bs + t % bs for t in range(n)]
        kk = k.flatten(0, 1)[slots].double()     # [n, kv_heads, D]
        vv = v.flatten(0, 1)[slots].double()
        for h in range(q.shape[1]):
            qs = (q[r, h] * scale).bfloat16().double()
            s = kk[:, h // group] @ qs
            p = torch.exp(s - s.max())
            out[r, h] = (p.float().bfloat16().double() @ vv[:, h // group]) / p.sum()
    return out.float()


def _amx_or_skip(ext):
    if not ext.amx_tiles():
        pytest.skip(f"this build's tiles do not run on AMX here (C++ build {ext.isa()}: AMX needs a CPU with "
                    "AMX-BF16, such as an Intel Xeon of Sapphire Rapids or later, and a kernel that allows it)")


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 16, 2), (32, 6, 1), (96, 4, 4)])
def test_prefill_tiles_on_amx_are_attention_with_bf16_queries_and_weights(ext, head_dim, heads, kv_heads):
    """A bf16 cache on a CPU with AMX: both multiplies on the matrix unit, the queries and the
    probabilities rounded to bf16 (as vLLM's AMX kernel and torch's bf16 SDPA round them), the sums
    fp32. Held tightly to that computation done in fp64, and loosely (bf16's precision) to exact
    attention: a fresh prompt, a chunk after a prefix, an empty chunk, a one-token chunk (the row
    loop), a 17-row chunk (a tile and one row), a 300-token prompt; NaN in every unowned block and
    in every slot past a context (the packed keys and values must be zero there, not read)."""
    _amx_or_skip(ext)
    q, k, v, tables, lens = _paged([37, 23 + 14, 9, 41, 100, 300], 16, kv_heads, head_dim, heads, torch.bfloat16,
                                   seed=head_dim)
    for s, n in enumerate(lens.tolist()):   # and in the slots past each context, inside its last block
        if n % 16:
            k[tables[s, n // 16], n % 16:] = float("nan")
            v[tables[s, n // 16], n % 16:] = float("nan")
    chunks = [(0, 37), (23, 14), (9, 0), (40, 1), (83, 17), (0, 300)]
    starts = torch.tensor([0, 37, 51, 51, 52, 69, 369], dtype=torch.int32)
    row_seq = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, (_, n) in enumerate(chunks)])
    row_lens = torch.cat([torch.arange(p + 1, p + n + 1, dtype=torch.int32) for p, n in chunks])
    qr = torch.randn(len(row_seq), heads, head_dim, generator=torch.Generator().manual_seed(8))
    out = ext.paged_prefill_attention_tiles(qr, k, v, tables, lens, starts, 0.2)
    tiled = torch.ones(len(row_seq), dtype=torch.bool)
    tiled[51] = not ext.supports(head_dim, heads // kv_heads, 16)  # the one-token chunk: the row loop, where it runs
    tables_r = tables[row_seq.long()]
    emulated = _bf16_attention(qr, k, v, tables_r, row_lens, 0.2)[tiled]
    # Equal to fp32's rounding but where a weight sits on a bf16 rounding boundary (the kernel's
    # fp32 exp and the fp64 one round it to neighbouring bf16 numbers): a few in a thousand.
    off = (out[tiled] - emulated).abs() > 2e-5 + 2e-5 * emulated.abs()
    assert off.float().mean() < 5e-3 and (out[tiled] - emulated).abs().max() < 2e-3
    exact = _reference(qr.double(), k.double(), v.double(), tables_r, row_lens, 0.2).float()
    torch.testing.assert_close(out, exact, atol=3e-2, rtol=3e-2)
    assert (out - exact).abs().mean() < 2e-3
    fp32 = ext.paged_prefill_attention_tiles(qr, k, v, tables, lens, starts, 0.2, amx=False)
    assert not torch.equal(out[tiled], fp32[tiled])   # the AMX path ran (the fp32 tiles round nothing)
    assert torch.equal(out[~tiled], fp32[~tiled])   # (an empty selection where the row loop has no kernel)


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(48, 6, 2), (80, 8, 2), (112, 7, 1)])
def test_prefill_tiles_take_head_sizes_amx_cannot_on_avx512(ext, head_dim, heads, kv_heads):
    """A bf16 cache whose head size is not a multiple of 32 (an AMX tile's row holds 32 bf16):
    the fp32 tiles, whatever the CPU, bit for bit what ``amx=False`` gives."""
    q, k, v, tables, lens = _paged([40, 9 + 20], 16, kv_heads, head_dim, heads, torch.bfloat16, seed=3)
    starts = torch.tensor([0, 40, 60], dtype=torch.int32)
    qr = torch.randn(60, heads, head_dim, generator=torch.Generator().manual_seed(4))
    assert torch.equal(ext.paged_prefill_attention_tiles(qr, k, v, tables, lens, starts, 0.1),
                       ext.paged_prefill_attention_tiles(qr, k, v, tables, lens, starts, 0.1, amx=False))


def test_prefill_tiles_on_amx_do_not_depend_on_the_batch_or_the_chunking(ext):
    """On AMX as on AVX-512, a row's attention is the same bits whichever tile, chunk or batch it
    falls in: a 45-token prompt alone, beside two other sequences, and as chunks of 20 + 25 and
    8 + 37 (16-row tiles: its rows fall in other tiles each time)."""
    _amx_or_skip(ext)
    q, k, v, tables, lens = _paged([45, 30, 70], 16, 3, 64, 9, torch.bfloat16, seed=11)
    qs = torch.randn(45 + 30 + 70, 9, 64, generator=torch.Generator().manual_seed(12))

    run = _chunked_calls(ext, qs, k, v, tables, [45, 30, 70])

    alone = run([0], [(0, 45)])
    assert torch.equal(run([1, 0, 2], [(0, 30), (0, 45), (0, 70)])[30:75], alone)
    assert torch.equal(torch.cat([run([0], [(0, 20)]), run([0], [(20, 45)])]), alone)
    assert torch.equal(torch.cat([run([0], [(0, 8)]), run([2, 0], [(0, 70), (8, 45)])[70:]]), alone)
    # A chunk of fewer than 8 rows takes the fp32 row loop: its rows equal the AMX tiles' within the
    # bf16 rounding of queries and weights, not to the bit (the one place chunking shows).
    tail = run([0], [(40, 45)])
    assert not torch.equal(tail, alone[40:])
    torch.testing.assert_close(tail, alone[40:], atol=1e-2, rtol=1e-2)


QUANTIZED = [pytest.param(torch.int8, id="int8"), pytest.param(torch.float8_e4m3fn, id="fp8")]


@pytest.mark.parametrize("qdtype", QUANTIZED)
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 16, 2), (32, 6, 1), (64, 10, 2)])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_decode_and_prefill_rows_read_a_quantized_cache(ext, qdtype, head_dim, heads, kv_heads, block_size):
    """int8 and fp8 bytes widened in the inner loop, K's scale on each score, V's on each
    weight (the tiles: K's on each key as it is packed): the reference over the dequantized
    cache. The blocks no sequence owns hold NaN, so their scales are NaN: a kernel that reads
    one poisons its output."""
    lens = [1, 7, block_size, block_size + 1, 97]
    q, k, v, tables, lens = _paged(lens, block_size, kv_heads, head_dim, heads, torch.float32)
    (kq, ks), (vq, vs) = quantize(k * 3, qdtype), quantize(v, qdtype)
    kd, vd = dequantize(kq, ks), dequantize(vq, vs)
    out = ext.paged_decode_attention(q, kq, vq, tables, lens, 0.3, ks, vs)
    torch.testing.assert_close(out, _reference(q, kd, vd, tables, lens, 0.3), atol=2e-5, rtol=2e-5)
    row_seq = torch.tensor([4, 4, 2, 1], dtype=torch.int32)      # rows of sequences' prefixes
    row_lens = torch.tensor([97, 50, block_size, 3], dtype=torch.int32)
    rows = ext.paged_prefill_attention_rows(q[row_seq.long()], kq, vq, tables, row_lens, row_seq, 0.3, ks, vs)
    expect = _reference(q[row_seq.long()], kd, vd, tables[row_seq.long()], row_lens, 0.3)
    torch.testing.assert_close(rows, expect, atol=2e-5, rtol=2e-5)
    # the same rows as chunks for the tiles: sequence 4's last 48 rows, 2's last, 1's first 3
    sel = torch.tensor([4, 2, 1])
    starts = torch.tensor([0, 48, 49, 52], dtype=torch.int32)
    ctx = torch.tensor([97, block_size, 3], dtype=torch.int32)
    chunk_q = torch.cat([q[[4] * 48], q[[2]], q[[1] * 3]])
    tiles = ext.paged_prefill_attention_tiles(chunk_q, kq, vq, tables[sel], ctx, starts, 0.3, ks, vs)
    tile_lens = torch.cat([torch.arange(50, 98), torch.tensor([block_size]), torch.arange(1, 4)]).to(torch.int32)
    expect = _reference(chunk_q, kd, vd, tables[sel.repeat_interleave(torch.tensor([48, 1, 3]))], tile_lens, 0.3)
    torch.testing.assert_close(tiles, expect, atol=2e-5, rtol=2e-5)


def test_every_fp8_byte_reads_as_torch_converts_it(ext):
    """vec.h decodes e4m3 field by field (subnormals, both signs, the largest 448): a sequence
    of one token attends to it alone, so the output is that token's value row exactly."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)   # NaNs excluded
    rows = torch.cat([codes, torch.zeros(256 - len(codes), dtype=torch.uint8)]).view(16, 1, 1, 16)   # padded: 16 x 16
    v = rows.view(torch.float8_e4m3fn)                  # 16 blocks of one token, one head of 16
    scales = torch.ones(16, 1, 1)
    out = ext.paged_decode_attention(torch.zeros(16, 1, 16), v, v, torch.arange(16, dtype=torch.int32)[:, None],
                                     torch.ones(16, dtype=torch.int32), 1.0, scales, scales)
    assert torch.equal(out.view(16, 16), v.float().view(16, 16))


def test_vectorized_means_simd_registers_and_a_compiled_group(ext):
    """The prefill wrapper takes the row kernel only where this is true."""
    simd = ext.isa() != "portable"
    assert ext.vectorized(64, 3) == simd and ext.vectorized(128, 8) == simd
    assert not ext.vectorized(64, 5) and not ext.vectorized(16, 2)


# --- the vector exp ---------------------------------------------------------------------------

def test_exp_is_within_2_ulp_over_the_range_softmax_and_silu_use(ext):
    x = torch.linspace(-87.0, 88.0, 1_000_003)  # not a multiple of 16: the last step is partial
    got = ext.vec_exp(x).double()
    exact = x.double().exp()
    ulp = exact.float().nextafter(torch.tensor(float("inf"))).double() - exact.float().double()
    worst = ((got - exact).abs() / ulp).max().item()
    assert worst <= 2.0, f"{ext.isa()}: {worst:.2f} ulp"


def test_exp_at_the_edges(ext):
    x = torch.tensor([0.0, 1.0, -1e30, -200.0, -104.0])
    got = ext.vec_exp(x)
    assert got[0] == 1.0 and abs(got[1].item() - 2.718281828) < 1e-6
    assert (got[2:] == 0).all(), got  # softmax's "minus infinity" and far-off scores weigh nothing
    assert ext.vec_exp(torch.tensor([88.0]))[0] > 1e38  # large, finite or not: silu(-88) is ~0 either way


# --- fused element-wise ops, rows that are not a multiple of 16 long -------------------------

def _tol(dtype):
    return dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 40, 64])
def test_rope_and_cache(ext, dtype, d):
    heads, kv_heads, block_size, num_blocks, n = 5, 1, 8, 6, 11
    g = torch.Generator().manual_seed(d)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    angles = torch.rand(n, d // 2, generator=g) * 6.28
    cos, sin = angles.cos(), angles.sin()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    k_ref = torch.randn(num_blocks, block_size, kv_heads, d, generator=g).to(dtype)
    v_ref = torch.randn(num_blocks, block_size, kv_heads, d, generator=g).to(dtype)
    k_out, v_out = k_ref.clone(), v_ref.clone()
    x = qkv.view(n, heads + 2 * kv_heads, d)
    qk = apply_rope(x[:, : heads + kv_heads].float(), cos[:, None], sin[:, None]).to(dtype)
    reshape_and_cache_ref(qk[:, heads:], x[:, heads + kv_heads:], k_ref, v_ref, slots)
    q = ext.rope_and_cache(qkv, cos, sin, k_out, v_out, slots, heads)
    torch.testing.assert_close(q, qk[:, :heads], **_tol(dtype))
    torch.testing.assert_close(k_out, k_ref, **_tol(dtype))
    assert torch.equal(v_out, v_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [576, 100, 7])
def test_add_rms_norm(ext, dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    stream = (torch.randn(9, hidden, generator=g) * 3).to(dtype)
    delta = torch.randn(9, hidden, generator=g).to(dtype)
    norm = RMSNorm(torch.rand(hidden, generator=g).to(dtype) + 0.5, 1e-5)
    expected_stream = stream + delta
    expected = norm(expected_stream)
    out = ext.add_rms_norm(stream, delta, norm.weight.data, norm.eps)
    # the residual add rounds as torch's does: bf16 + bf16 computed in fp32, rounded to nearest even
    assert torch.equal(stream, expected_stream)
    torch.testing.assert_close(out, expected, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [1536, 37])
def test_silu_and_mul(ext, dtype, inter):
    x = (torch.randn(5, 2 * inter, generator=torch.Generator().manual_seed(4)) * 6).to(dtype)
    x[0, :4] = torch.tensor([100.0, -100.0, 0.0, -90.0])  # exp's clamps, both ways
    gate, up = x.float().chunk(2, dim=-1)
    torch.testing.assert_close(ext.silu_and_mul(x), (F.silu(gate) * up).to(dtype), **_tol(dtype))


def test_bf16_stores_round_halfway_cases_to_even(ext):
    """The residual add x += delta in bf16 is exact in fp32, then rounded by the vector store:
    sums exactly halfway between two bf16 numbers go to the even one, as torch's do."""
    k = torch.arange(21, dtype=torch.float32)  # 21 lanes: a full vector and a partial one
    stream = (1 + k * 2**-7).to(torch.bfloat16).view(1, -1)  # consecutive bf16 numbers
    delta = torch.full_like(stream, 2**-8)  # half a step: every sum is a tie
    expected = stream + delta
    assert torch.equal(expected.float().view(-1), 1 + (k + 1).div(2, rounding_mode="floor") * 2 * 2**-7)
    ext.add_rms_norm(stream, delta, torch.ones(21, dtype=torch.bfloat16), 1e-5)
    assert torch.equal(stream, expected)


# --- which ISA is built: what the CPU reports, never what the compiler could target ---------

SAPPHIRE_RAPIDS = ("flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2 avx512f avx512dq avx512cd "
                   "avx512bw avx512vl avx512_bf16 amx_bf16 amx_tile")
ZEN3 = ("flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse "
        "sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl pni pclmulqdq monitor "
        "ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand lahf_lm cmp_legacy svm "
        "abm sse4a misalignsse 3dnowprefetch fsgsbase bmi1 avx2 smep bmi2 erms invpcid rdseed adx smap clflushopt "
        "clwb sha_ni xsaveopt xsavec xgetbv1 xsaves clzero wbnoinvd umip pku ospke vaes vpclmulqdq rdpid fsrm")
SANDY_BRIDGE = "flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx popcnt aes xsave"  # AVX, no AVX2 or FMA
GRAVITON = "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm"


@pytest.fixture
def cpu(monkeypatch):
    """Pretend to be another CPU: set(flags_line, machine). Nothing is loaded or built under
    it (load()'s per-ISA memo is swapped for an empty one and restored after)."""
    monkeypatch.delenv("LABKIT_CPU_ISA", raising=False)
    monkeypatch.setattr(cpu_extension, "_tried", {})

    def pretend(flags, machine="x86_64"):
        monkeypatch.setattr(cpu_extension, "_cpu_flags", lambda: flags)
        monkeypatch.setattr(cpu_extension.platform, "machine", lambda: machine)
    return pretend


@pytest.mark.parametrize("flags,machine,best", [
    (SAPPHIRE_RAPIDS, "x86_64", "avx512"),
    (ZEN3, "x86_64", "avx2"),
    (SANDY_BRIDGE, "x86_64", "portable"),
    (GRAVITON, "aarch64", "portable"),
])
def test_the_isa_is_the_best_the_cpu_reports(cpu, flags, machine, best):
    cpu(flags, machine)
    assert cpu_extension.cpu_isa() == best == cpu_extension.build_isa()
    assert cpu_extension.runnable_isas() == cpu_extension.ISAS[cpu_extension.ISAS.index(best):]
    native = "-mcpu=native" if machine == "aarch64" else "-march=native"
    assert native in cpu_extension._cflags(best)  # its own ISA: the compiler asks this CPU, and tunes for it


def test_a_lesser_isa_can_be_forced_with_its_own_flags_and_build_name(cpu, monkeypatch):
    cpu(SAPPHIRE_RAPIDS)
    names = {isa: cpu_extension.build_name(isa) for isa in cpu_extension.ISAS}
    assert all(f"_{isa}_" in name for isa, name in names.items()) and len(set(names.values())) == 3
    monkeypatch.setenv("LABKIT_CPU_ISA", "avx2")
    assert cpu_extension.build_isa() == "avx2" and cpu_extension.build_name() == names["avx2"]
    assert "-march=native" not in cpu_extension._cflags("avx2") and "-mavx2" in cpu_extension._cflags("avx2")
    assert not any(flag.startswith(("-m", "-march")) for flag in cpu_extension._cflags("portable"))


def test_the_build_name_is_per_cpu_and_isa(cpu):
    """A build for one machine kind is never loaded on another: the name holds the ISA and a
    hash of the CPU's flags (a shared home directory serves both kinds)."""
    cpu(SAPPHIRE_RAPIDS)
    on_spr = cpu_extension.build_name("avx2")
    cpu(ZEN3)
    assert cpu_extension.build_name("avx2") != on_spr
    assert cpu_extension.build_name().startswith("labkit_cpu_avx2_")


@pytest.mark.parametrize("wanted,says", [("avx512", "does not run avx512"), ("sse4", "one of auto, avx512")])
def test_an_isa_the_cpu_lacks_or_an_unknown_one_is_refused_with_the_reason(cpu, monkeypatch, wanted, says):
    """An AVX-512 build on a Zen 3 would stop at its first AVX-512 instruction (SIGILL): it is
    never built there; the backend falls back to the Numba loop and says why."""
    cpu(ZEN3)
    monkeypatch.setenv("LABKIT_CPU_ISA", wanted)
    with pytest.raises(ValueError, match=says):
        cpu_extension.build_isa()
    assert cpu_extension.load() is None
    assert says in cpu_extension.status()[1]
    if wanted in cpu_extension.ISAS:
        assert cpu_extension.load(isa=wanted) is None and says in cpu_extension.status(wanted)[1]


_FORCED_PROBE = """
from labkit.kernels import cpu_extension, select_attention_backend
ext = cpu_extension.load()
print(ext.isa() if ext is not None else None)
print(cpu_extension.status()[1])
print(select_attention_backend("auto", "cpu")[1])
"""


def _probe(isa):
    env = dict(os.environ, LABKIT_CPU_ISA=isa)
    out = subprocess.run([sys.executable, "-c", _FORCED_PROBE], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-3:], out.stderr


def test_an_unknown_labkit_cpu_isa_falls_back_to_numba_and_says_why():
    (isa, status, backend), err = _probe("sse4")
    assert isa == "None" and "LABKIT_CPU_ISA='sse4'" in status
    assert "Numba decode attention" in backend and "LABKIT_CPU_ISA='sse4'" in err


@pytest.mark.slow
def test_labkit_cpu_isa_chooses_the_build_the_engine_runs(ext):
    """End to end: LABKIT_CPU_ISA=<isa> in a fresh process loads that build (the one the
    fixture compiled) and the cpu backend uses it."""
    (isa, status, backend), _ = _probe(ext.isa())
    assert isa == ext.isa() and f"({ext.isa()} build)" in status
    assert "C++ decode attention" in backend


@pytest.mark.slow
def test_bench_times_every_isa_in_turn(capsys):
    from labkit.bench.kernels import main
    assert main(["--ref-cpu", "--batch", "2", "--context", "64", "--repeats", "2", "--isa", "all"]) == 0
    out = capsys.readouterr().out
    assert "load average" in out
    for isa in cpu_extension.runnable_isas():
        assert f"{isa} ms" in out


# ---- linear layers on panels (csrc/linear.cpp) -------------------------------------------

@pytest.mark.parametrize("out_features,in_features",
                         [(960, 576), (576, 1536), (17, 5), (33, 64), (1, 3), (48, 16), (70, 24), (100, 24)])
def test_linear_panels_equal_f_linear_for_every_row_count(ext, out_features, in_features):
    """Every remainder of the row tiles (1-7 rows past a multiple of 8 or 6), panel counts that
    leave a last group of 1, 2 or 3 panels (groups of 3 on AVX-512) and one whose last panel is
    padding, x in one row block and in several (135 rows of 576 or 1536 floats pass 256 KB),
    with and without a bias, against F.linear in float64; and the same bits whatever the number
    of rows (batch invariance)."""
    from labkit.kernels.linear_cpu import linear_panels, pack_panels
    g = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    panels = pack_panels(w)
    x = torch.randn(135, in_features, generator=g)
    for b in (None, bias):
        full = linear_panels(ext, x, panels, out_features, b)
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        torch.testing.assert_close(full.double(), ref, atol=2e-5 * in_features ** 0.5, rtol=1e-5)
        for m in (0, 1, 2, 3, 5, 6, 7, 8, 9, 12, 16, 17):
            part = linear_panels(ext, x[:m], panels, out_features, b)
            assert part.shape == (m, out_features)
            assert torch.equal(part, full[:m]), f"{m} rows differ from the same rows among 135"


@pytest.mark.parametrize("inter,in_features,rows", [(1536, 576, 135), (48, 24, 17), (16, 5, 3), (80, 64, 1100)])
def test_fused_swiglu_is_the_matmul_then_silu_and_mul_bit_for_bit(ext, inter, in_features, rows):
    """linear_panels_silu_mul (gate/up and SiLU * up in one pass) gives the bits of linear_panels
    followed by silu_and_mul, with and without a bias, for gate groups of 3, 1 and 5 panels and
    x in one row block or ten; and their float64 reference. A width that is not whole panels
    for gate and up is refused."""
    from labkit.kernels.linear_cpu import linear_panels, pack_panels
    g = torch.Generator().manual_seed(inter)
    w = torch.randn(2 * inter, in_features, generator=g) / in_features ** 0.5
    bias = torch.randn(2 * inter, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    panels = pack_panels(w)
    for b in (None, bias):
        fused = ext.linear_panels_silu_mul(x, panels, 2 * inter, b)
        assert torch.equal(fused, ext.silu_and_mul(linear_panels(ext, x, panels, 2 * inter, b)))
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        torch.testing.assert_close(fused.double(), F.silu(ref[:, :inter]) * ref[:, inter:], atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ext.linear_panels_silu_mul(x, pack_panels(torch.randn(40, in_features)), 40, None)


def test_linear_panels_row_blocks_of_a_long_prefill(ext):
    """A prefill's x is cut into row blocks that each fit in L2 (linear.cpp, kBlockBytes): 1100
    rows of 576 floats are ten blocks. Every row equals the reference, and the same row computed
    in a batch of 3 (one block), bit for bit, wherever the block boundaries fall."""
    from labkit.kernels.linear_cpu import linear_panels, pack_panels
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(200, 576, generator=g), torch.randn(200, generator=g)
    x = torch.randn(1100, 576, generator=g)
    panels = pack_panels(w)
    full = linear_panels(ext, x, panels, 200, b)
    torch.testing.assert_close(full.double(), F.linear(x.double(), w.double(), b.double()),
                               atol=2e-5 * 576 ** 0.5, rtol=1e-5)
    for r in range(0, 1100 - 3, 97):
        assert torch.equal(linear_panels(ext, x[r:r + 3], panels, 200, b), full[r:r + 3]), f"rows {r}-{r + 2}"
