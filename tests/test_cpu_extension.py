"""labkit's C++ CPU kernels (kernels/csrc, built by kernels/cpu_extension.py) against the
readable references they replace: decode attention, the fused rotary + cache write,
add + RMSNorm and SiLU * up. Skipped, with the reason, where they cannot be built."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from labkit.kernels import cpu_extension
from labkit.kernels.paged_decode_attention import decode_attention_torch
from labkit.kernels.paged_decode_attention_cpu import paged_decode_attention_cpu
from labkit.kernels.reshape_and_cache import reshape_and_cache_ref
from labkit.model.llama import RMSNorm, apply_rope

EXT = cpu_extension.load()
needs_ext = pytest.mark.skipif(EXT is None, reason=cpu_extension.status()[1])


def _paged(num_seqs, lens, block_size, kv_heads, head_dim, heads, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lens, dtype=torch.int32)
    per_seq = int((lens.max() + block_size - 1) // block_size)
    num_blocks = num_seqs * per_seq + 3
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: num_seqs * per_seq].view(num_seqs, per_seq).int()
    q = torch.randn(num_seqs, heads, head_dim, generator=g)
    return q, k, v, tables, lens


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [
    (64, 9, 3),    # SmolLM2: the compiled group-of-3 loop
    (64, 8, 8),    # multi-head attention: group 1
    (64, 4, 2),    # group 2
    (128, 32, 8),  # Llama-3-8B's shape: group 4
    (128, 16, 2),  # group 8
    (128, 32, 32), # 32 KV heads: two passes over each block
    (64, 10, 2),   # group 5: the run-time-group loop
    (16, 4, 2),    # tiny-llama
    (32, 6, 1),
])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_cpp_decode_matches_the_reference(dtype, head_dim, heads, kv_heads, block_size):
    lens = [1, block_size, block_size + 1, 3 * block_size - 1, 97]
    q, k, v, tables, lens = _paged(len(lens), lens, block_size, kv_heads, head_dim, heads, dtype)
    out = paged_decode_attention_cpu(q, k, v, tables, lens, 0.3, impl="cpp")
    ref = decode_attention_torch(q, k, v, tables, lens, 0.3)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 32, 8), (64, 10, 2)])
def test_prefill_rows_kernel_is_causal_attention_over_each_rows_prefix(dtype, head_dim, heads, kv_heads):
    """paged_prefill_attention_rows: row r is a decode query over the first row_lens[r]
    tokens of sequence row_seq[r]. Three chunks: a fresh prompt, a chunk after a 23-token
    prefix, a one-token chunk after 40 tokens; each row against the reference decode of
    that row alone."""
    q, k, v, tables, lens = _paged(3, [37, 23 + 14, 41], 16, kv_heads, head_dim, heads, dtype, seed=5)
    chunks = [(0, 37), (23, 14), (40, 1)]          # (tokens before the chunk, chunk length)
    row_seq = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, (_, n) in enumerate(chunks)])
    row_lens = torch.cat([torch.arange(p + 1, p + n + 1, dtype=torch.int32) for p, n in chunks])
    qr = torch.randn(len(row_seq), heads, head_dim, generator=torch.Generator().manual_seed(6))
    out = EXT.paged_prefill_attention_rows(qr, k, v, tables, row_lens, row_seq, 0.2)
    expect = decode_attention_torch(qr, k, v, tables[row_seq.long()], row_lens, 0.2)
    torch.testing.assert_close(out, expect, atol=2e-5, rtol=2e-5)
    with pytest.raises(RuntimeError, match="one per query row"):
        EXT.paged_prefill_attention_rows(qr, k, v, tables, row_lens[:-1], row_seq, 0.2)


@needs_ext
def test_the_vectorized_kernel_is_reported_for_the_shapes_it_covers():
    """AVX-512 and AVX2 builds run SmolLM2's and Llama's shapes vectorized (the prefill wrapper
    takes the row kernel only then); other groups and small heads take the run-time-group loop."""
    simd = cpu_extension.build_isa() != "portable"
    assert EXT.isa() == cpu_extension.build_isa()
    assert EXT.vectorized(64, 3) == simd and EXT.vectorized(128, 4) == simd
    assert not EXT.vectorized(64, 5) and not EXT.vectorized(16, 2)


@needs_ext
def test_cpp_decode_balances_long_and_short_sequences():
    """Sequences of very different lengths in one batch (the work is handed out longest first)."""
    lens = [2000, 1, 17, 1500, 3, 900, 64, 2, 1200, 5]
    q, k, v, tables, lens = _paged(len(lens), lens, 16, 3, 64, 9, torch.float32, seed=3)
    torch.testing.assert_close(paged_decode_attention_cpu(q, k, v, tables, lens, 0.125, impl="cpp"),
                               decode_attention_torch(q, k, v, tables, lens, 0.125), atol=2e-5, rtol=2e-5)


@needs_ext
def test_shapes_without_a_cpp_kernel_fall_back_or_say_why():
    q, k, v, tables, lens = _paged(3, [5, 40, 130], 128, 2, 48, 4, torch.float32)  # head_dim 48, block 128
    assert not EXT.supports(48, 2, 128)
    with pytest.raises(RuntimeError, match="C\\+\\+ decode kernel cannot run"):
        paged_decode_attention_cpu(q, k, v, tables, lens, 0.2, impl="cpp")
    torch.testing.assert_close(paged_decode_attention_cpu(q, k, v, tables, lens, 0.2),  # auto: Numba
                               decode_attention_torch(q, k, v, tables, lens, 0.2), atol=2e-5, rtol=2e-5)


@needs_ext
def test_cpp_decode_refuses_a_block_id_outside_the_cache():
    q, k, v, tables, lens = _paged(2, [20, 20], 16, 3, 64, 9, torch.float32)
    bad = tables.clone()
    bad[1, 1] = k.shape[0] + 5
    with pytest.raises(ValueError, match=str(k.shape[0] + 5)):
        paged_decode_attention_cpu(q, k, v, bad, lens, 0.1, impl="cpp")


def test_an_unknown_impl_is_named():
    q, k, v, tables, lens = _paged(1, [3], 16, 1, 16, 2, torch.float32)
    with pytest.raises(ValueError, match="unknown impl 'fast'"):
        paged_decode_attention_cpu(q, k, v, tables, lens, 0.1, impl="fast")


# --- fused element-wise ops against the model's readable versions ---------------------------

def _tol(dtype):
    return dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache_equals_apply_rope_then_reshape_and_cache(dtype):
    heads, kv_heads, d, block_size, num_blocks, n = 9, 3, 64, 16, 12, 21
    g = torch.Generator().manual_seed(1)
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

    q = EXT.rope_and_cache(qkv, cos, sin, k_out, v_out, slots, heads)
    torch.testing.assert_close(q, qk[:, :heads], **_tol(dtype))
    torch.testing.assert_close(k_out, k_ref, **_tol(dtype))   # written slots equal, the others untouched
    assert torch.equal(v_out, v_ref)


@needs_ext
def test_rope_and_cache_refuses_a_slot_outside_the_cache():
    cache = torch.zeros(2, 4, 1, 8)
    qkv, cs = torch.randn(2, 3 * 8), torch.ones(2, 4)
    with pytest.raises(RuntimeError, match="slot 8 of token 1 is outside the cache"):
        EXT.rope_and_cache(qkv, cs, cs, cache, cache.clone(), torch.tensor([0, 8]), 1)
    assert not cache.any()


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_equals_add_then_rmsnorm(dtype, with_delta):
    g = torch.Generator().manual_seed(2)
    stream = torch.randn(7, 576, generator=g).to(dtype)
    delta = torch.randn(7, 576, generator=g).to(dtype) if with_delta else None
    norm = RMSNorm(torch.rand(576, generator=g).to(dtype) + 0.5, 1e-5)
    expected_stream = stream + delta if with_delta else stream.clone()
    expected = norm(expected_stream)
    out = EXT.add_rms_norm(stream, delta, norm.weight.data, norm.eps)
    torch.testing.assert_close(stream, expected_stream, **_tol(dtype))   # updated in place
    torch.testing.assert_close(out, expected, **_tol(dtype))


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_equals_silu_times_up(dtype):
    x = torch.randn(5, 2 * 1536, generator=torch.Generator().manual_seed(4)).to(dtype) * 4
    gate, up = x.float().chunk(2, dim=-1)
    torch.testing.assert_close(EXT.silu_and_mul(x), (F.silu(gate) * up).to(dtype), **_tol(dtype))


@needs_ext
def test_fused_ops_refuse_bad_inputs_with_their_reason():
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        EXT.silu_and_mul(torch.ones(2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="delta must match x"):
        EXT.add_rms_norm(torch.ones(2, 4), torch.ones(3, 4), torch.ones(4), 1e-5)


# --- the engine on the C++ path, and the one thread pool -------------------------------------

@needs_ext
def test_cpu_backend_uses_the_fused_ops_and_equals_the_torch_backend():
    from labkit import LLM, SamplingParams
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [(9 * i) % 250 for i in range(70)]]
    fast = LLM("tiny-llama", attention_backend="cpu", num_blocks=64, block_size=8)
    assert fast.runner.ops.fused is not None
    ref = LLM("tiny-llama", attention_backend="torch", num_blocks=64, block_size=8)
    assert ref.runner.ops.fused is None
    assert ([o.outputs[0].token_ids for o in fast.generate(prompts, params, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)])


@needs_ext
@pytest.mark.slow
@pytest.mark.parametrize("mode,policy", [("recompute", "continuous"), ("swap", "continuous"),
                                         ("recompute", "static")])
def test_smollm2_row_prefill_under_pressure_equals_the_torch_backend_and_frees_every_block(mode, policy):
    """SmolLM2's shapes take the vectorized decode, the row-loop prefill and (fp32 on a SIMD
    build) the linear layers on panels. Five prompts sharing a system prompt (prefix-cache
    hits), a pool of 18 blocks and 64-token chunks (chunked prefill, a preemption where the
    policy preempts): greedy tokens equal the torch backend's; then n=3 with a stop string,
    and an abort mid-request; every block ends free. Both policies."""
    from labkit import LLM, SamplingParams
    from labkit.model.llama import linear_layout
    system = "You are a careful assistant who answers in one short paragraph. " * 6
    prompts = [system + q for q in ("What is paging?", "Explain a block table.", "Why copy on write?",
                                    "What is preemption?", "Define prefill.")]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ref = LLM(num_blocks=400, attention_backend="torch", enable_prefix_caching=False)
    expect = [o.outputs[0].token_ids for o in ref.generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(num_blocks=18, max_num_seqs=8, max_num_batched_tokens=64, attention_backend="cpu",
              preemption_mode=mode, policy=policy)
    assert llm.runner.linear_layout == linear_layout(torch.device("cpu"), torch.float32)[0]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == expect
    if policy == "continuous":
        assert llm.stats()["num_preemptions"] >= 1
    sampled = SamplingParams(n=3, max_tokens=30, temperature=0.8, seed=1, stop=["."])
    if policy == "continuous":
        outs = llm.generate(prompts[:2], sampled, use_tqdm=False)
        assert all(len(o.outputs) == 3 for o in outs)
        assert all("." not in c.text for o in outs for c in o.outputs)         # cut before the stop string
    else:  # the baseline refuses n > 1 by name and goes on serving
        with pytest.warns(UserWarning, match="the static baseline serves n=1 only"):
            outs = llm.generate(prompts[:2], sampled, use_tqdm=False)
        assert all(o.outputs[0].finish_reason == "error" for o in outs)
        outs = llm.generate(prompts[:2], SamplingParams(max_tokens=30, temperature=0.8, seed=1, stop=["."]),
                            use_tqdm=False)
        assert all(o.outputs[0].token_ids and "." not in o.outputs[0].text for o in outs)
    request = llm.engine.add_request(ref.runner.tokenizer.encode(prompts[0]), SamplingParams(max_tokens=50))
    for _ in range(3):
        llm.engine.step()
    llm.engine.abort(request.request_id)
    while llm.engine.has_unfinished:
        llm.engine.step()
    llm.allocator.check_invariants()
    llm.reset_prefix_cache()
    assert llm.stats()["num_free_blocks"] == 18


_POOL_PROBE = """
import os, sys
from labkit import LLM, SamplingParams
llm = LLM("tiny-llama", attention_backend="cpu", num_blocks=64, block_size=8)
llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
maps = open(f"/proc/{os.getpid()}/maps").read().splitlines()
omp = sorted({line.split()[-1] for line in maps if "gomp" in line or "libomp" in line or "libiomp" in line})
print(repr((omp, "numba.np.ufunc.omppool" in sys.modules, llm.runner.attention_backend_reason)))
"""


@needs_ext
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/maps")
@pytest.mark.slow
def test_one_openmp_runtime_serves_matmuls_and_attention():
    """Issue 14: one thread pool. With the C++ kernels a generation loads one OpenMP
    runtime (torch's), and Numba's OpenMP layer is never started."""
    env = dict(os.environ, OMP_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", _POOL_PROBE], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    runtimes, numba_pool, reason = eval(out.stdout.strip().splitlines()[-1])
    assert len(runtimes) == 1, runtimes
    assert not numba_pool
    assert "C++ decode attention" in reason


def test_disabling_the_extension_falls_back_to_numba_and_says_so():
    code = ("from labkit.kernels import cpu_extension, select_attention_backend\n"
            "print(cpu_extension.status()); print(select_attention_backend('auto', 'cpu'))")
    env = dict(os.environ, LABKIT_CPU_EXTENSION="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "disabled by LABKIT_CPU_EXTENSION=0" in out.stdout
    assert "Numba decode attention" in out.stdout


def test_the_extension_builds_wherever_a_compiler_and_ninja_exist():
    """A broken C++ source must fail CI, not quietly skip every test above and fall back."""
    why_not = cpu_extension._why_not()
    if why_not is not None:
        pytest.skip(f"not built here: {why_not}")
    assert EXT is not None, cpu_extension.status()[1]


@needs_ext
def test_fp16_on_the_cpu_backend_keeps_the_torch_element_wise_ops():
    """The fused C++ ops take fp32 and bf16: an fp16 model runs the readable versions."""
    from labkit import LLM, SamplingParams
    llm = LLM("tiny-llama", attention_backend="cpu", dtype="float16", num_blocks=32, block_size=8)
    assert llm.runner.ops.fused is None
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_clear_stale_lock_removes_only_torchs_lock_file(tmp_path, capsys):
    (tmp_path / "keep.so").write_text("")
    assert cpu_extension.clear_stale_lock(tmp_path) is False
    (tmp_path / "lock").write_text("")
    assert cpu_extension.clear_stale_lock(tmp_path) is True
    assert not (tmp_path / "lock").exists() and (tmp_path / "keep.so").exists()
    assert "interrupted" in capsys.readouterr().err


_LOAD_PROBE = """
from labkit.kernels import cpu_extension
print(cpu_extension.load() is not None)
"""


@needs_ext
def test_a_build_killed_mid_compile_does_not_block_the_next_load():
    """A build interrupted mid-compile leaves torch's ``lock`` file in the build directory,
    and torch waits on it forever. labkit's own lock (freed by the OS when its holder dies)
    tells that file is stale: the next process removes it and loads instead of hanging."""
    from torch.utils.cpp_extension import _get_build_directory
    from pathlib import Path
    build_dir = Path(_get_build_directory(cpu_extension.build_name(), verbose=False))
    with cpu_extension._build_lock(build_dir):  # no labkit build runs now: the lock is a dead one's
        (build_dir / "lock").write_text("")
    try:
        out = subprocess.run([sys.executable, "-c", _LOAD_PROBE], capture_output=True, text=True,
                             timeout=300)
    finally:
        (build_dir / "lock").unlink(missing_ok=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True"      # the library was there: loaded, not blocked


def test_a_build_after_an_interrupted_one_clears_its_lock(fresh_loader, capsys):
    """No library yet, and torch's lock left by a build killed mid-compile: the next build
    removes it (labkit's own lock says no one else builds) and goes on."""
    build_dir = cpu_extension.build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / "lock").write_text("")
    assert cpu_extension.load() == "the module" and len(fresh_loader) == 1
    assert "left by a build that was interrupted" in capsys.readouterr().err
    assert not (build_dir / "lock").exists()


def test_builds_wait_for_each_other_and_a_dead_builder_frees_the_lock(tmp_path):
    """The lock is an flock: a second holder waits while the first lives, and gets it as soon
    as the first process dies without releasing anything."""
    fcntl = pytest.importorskip("fcntl", reason="flock is POSIX; no build runs elsewhere")
    build_dir = tmp_path / "labkit_cpu_x"
    hold = ("import sys, time; sys.path[:0] = {path!r}\n"
            "from pathlib import Path\n"
            "from labkit.kernels import cpu_extension\n"
            "with cpu_extension._build_lock(Path({d!r})):\n"
            "    print('held', flush=True); time.sleep(600)\n").format(path=sys.path, d=str(build_dir))
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with open(build_dir.with_name(build_dir.name + ".labkit-lock"), "a+") as f:
            with pytest.raises(BlockingIOError):
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            holder.kill()
            holder.wait(timeout=30)
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free at once: the OS dropped it
    finally:
        holder.kill()


# ---- compiled at setup, found by every later load, never a silent wait --------------------------
def test_make_setup_compiles_the_kernels():
    """``make setup`` (so ``make lab`` and ``make test``) ends with ``python -m labkit kernels``."""
    import shutil
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run(["make", "--no-print-directory", "-n", "-C", str(root), "setup",
                          f"VENV={Path(sys.executable).parent.parent}"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "-m labkit kernels" in run.stdout, run.stdout


def test_the_kernels_were_built_before_the_tests_started():
    """Under ``make test``, setup compiled the kernels: the build loads without compiling, and
    its library is older than this test process (nothing in the test run compiled it)."""
    if "MAKELEVEL" not in os.environ:
        pytest.skip("checks what `make test`'s setup step left; this run did not come through make")
    if cpu_extension._why_not() is not None:
        pytest.skip(f"not built here: {cpu_extension._why_not()}")
    psutil = pytest.importorskip("psutil")
    assert cpu_extension.is_built(), f"make setup left no up-to-date build in {cpu_extension.build_directory()}"
    library = next(cpu_extension.build_directory().glob("*.so"))
    assert library.stat().st_mtime < psutil.Process().create_time(), f"{library} was compiled during the tests"


_COPY_PROBE = """
from labkit.kernels import cpu_extension
print(cpu_extension.load() is not None, cpu_extension.is_built())
"""


@needs_ext
def test_a_build_loads_as_it_is_wherever_it_was_copied(tmp_path, monkeypatch):
    """The library's name is a hash of what it was built from: found, it is imported as it is.
    A copy of the build folder elsewhere (a grader's sandbox), without its object files or
    ninja's records, loads without compiling anything and without changing the folder."""
    import shutil
    name = cpu_extension.build_name()
    source = cpu_extension.build_directory(name)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    copy = cpu_extension.build_directory(name)
    copy.mkdir(parents=True, exist_ok=True)
    shutil.copy2(next(source.glob(f"{name}*.so")), copy)
    before = sorted(p.name for p in copy.iterdir())
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    run = subprocess.run([sys.executable, "-c", _COPY_PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["True", "True"] and "compiling" not in run.stderr, run.stderr
    assert sorted(p.name for p in copy.iterdir()) == before


@pytest.fixture
def fresh_loader(tmp_path, monkeypatch):
    """cpu_extension.load() as in a new process on a machine where nothing is built yet,
    with torch's builder replaced by one that takes a second and builds nothing."""
    import torch.utils.cpp_extension as builder
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(cpu_extension, "_tried", {})
    monkeypatch.setattr(cpu_extension, "_reasons", {})
    monkeypatch.setattr(cpu_extension, "_why_not", lambda: None)
    compiled = []

    def fake_build(name, sources, **kwargs):
        time.sleep(1.2)
        compiled.append(name)
        return "the module"
    monkeypatch.setattr(builder, "load", fake_build)
    return compiled


def test_a_first_compile_says_how_long_it_takes_and_took(fresh_loader, capsys):
    assert cpu_extension.load() == "the module" and len(fresh_loader) == 1
    err = capsys.readouterr().err
    assert cpu_extension.COMPILE_TIME in err and "make setup" in err
    assert re.search(r"compiling the C\+\+ CPU kernels\.\.\. done in [12] s", err), err
    assert cpu_extension.load() == "the module" and len(fresh_loader) == 1     # once per process


def test_a_load_waiting_for_another_build_says_so(fresh_loader, capsys):
    import fcntl
    import threading
    build_dir = cpu_extension.build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir.with_name(build_dir.name + ".labkit-lock"), "a+") as other:
        fcntl.flock(other, fcntl.LOCK_EX)                     # "another process" builds for 1.5 s
        threading.Timer(1.5, fcntl.flock, (other, fcntl.LOCK_UN)).start()
        assert cpu_extension.load() == "the module"
    err = capsys.readouterr().err
    assert re.search(r"waiting for another process compiling the C\+\+ CPU kernels\.\.\. done in [12] s", err), err


def test_the_default_build_is_resolved_once_per_setting(monkeypatch):
    """Every attention call of every layer asks load() for the default build: after the first
    answer that is a dict read, not the CPU's flags read from /proc/cpuinfo again (~50 us a
    time: 1.5 ms of a 40 ms decode step). Another LABKIT_CPU_ISA is resolved afresh."""
    monkeypatch.delenv("LABKIT_CPU_ISA", raising=False)
    first = cpu_extension.load()

    def again(*args):
        raise AssertionError("resolved again")
    monkeypatch.setattr(cpu_extension, "_load", again)
    monkeypatch.setattr(cpu_extension, "_cpu_flags", again)
    assert all(cpu_extension.load() is first for _ in range(3))
    monkeypatch.setenv("LABKIT_CPU_ISA", "portable")
    with pytest.raises(AssertionError, match="resolved again"):
        cpu_extension.load()


@pytest.mark.skipif(not cpu_extension._is_x86(), reason="the flags are read from /proc/cpuinfo on x86 only")
def test_the_cpu_flags_are_read_once(monkeypatch):
    reads = []
    real = Path.read_text

    def counted(self, *args, **kwargs):
        reads.append(str(self))
        return real(self, *args, **kwargs)
    cpu_extension._cpu_flags.cache_clear()
    monkeypatch.setattr(Path, "read_text", counted)
    try:
        isas = {cpu_extension.cpu_isa() for _ in range(5)}
    finally:
        cpu_extension._cpu_flags.cache_clear()
    assert len(isas) == 1 and reads.count("/proc/cpuinfo") == 1, reads


@needs_ext
def test_cpu_prefill_takes_empty_chunks_and_an_empty_batch():
    """The one-call path of paged_prefill_attention_cpu: a sequence with no rows this step
    between two that have some, and a step with no sequences at all, as the reference."""
    from labkit.kernels import paged_prefill_attention_cpu, paged_prefill_attention_ref
    _, k, v, tables, lens = _paged(3, [20, 11, 33], 16, 3, 64, 9, torch.float32, seed=4)
    starts = torch.tensor([0, 20, 20, 25], dtype=torch.int32)       # chunks of 20, 0 and 5 rows
    q = torch.randn(25, 9, 64, generator=torch.Generator().manual_seed(5))
    out = paged_prefill_attention_cpu(q, k, v, tables, lens, starts, 0.125)
    torch.testing.assert_close(out, paged_prefill_attention_ref(q, k, v, tables, lens, starts, 0.125),
                               atol=2e-5, rtol=2e-5)
    none = paged_prefill_attention_cpu(q[:0], k, v, tables[:0], lens[:0], starts[:1], 0.125)
    assert none.shape == (0, 9, 64)
