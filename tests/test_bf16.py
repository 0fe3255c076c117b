"""bf16 on CPU: ``LLM(dtype="bfloat16")`` keeps weights and KV cache in bf16, runs the CPU
backend's fast paths (packed oneDNN weights, the Numba decode kernel reading a bf16 cache)
and stays close to fp32.

The tolerance is the one docs/performance.md documents: bf16 keeps 8 significant bits, so
logits move by up to ~3% of the largest logit's magnitude (measured: tiny-llama max |diff|
1.0%, mean 0.2%; SmolLM2-135M max 3.0%, mean 0.7-1.3%), and the tests allow twice that.
Greedy tokens can therefore differ from fp32 where two candidates are closer than that;
the fp32 path is the one that equals Transformers token for token.
"""

from __future__ import annotations

import pytest
import torch

from labkit import LLM, SamplingParams
from labkit.model import ModelRunner, SeqChunk, llama, load_model

# max |bf16 logit - fp32 logit| <= REL_MAX * max |fp32 logit|; mean |diff| <= REL_MEAN * that
REL_MAX, REL_MEAN = 0.06, 0.025


def _needs_numba():
    from labkit.kernels.paged_decode_attention_cpu import HAS_NUMBA
    if not HAS_NUMBA:
        pytest.skip("the 'cpu' backend needs Numba")


def _logits_along(runner: ModelRunner, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits after the prompt and after each of ``tokens`` fed one at a time (decode steps)."""
    blocks = list(range(-(-(len(prompt) + len(tokens)) // runner.block_size)))
    rows = [runner.execute([SeqChunk(prompt, 0, blocks)])[0]]
    for i, t in enumerate(tokens):
        rows.append(runner.execute([SeqChunk([t], len(prompt) + i, blocks)])[0])
    return torch.stack(rows)


def _assert_close_to_fp32(out16: torch.Tensor, out32: torch.Tensor) -> None:
    scale = out32.abs().max().item()
    diff = (out16 - out32).abs()
    assert diff.max().item() <= REL_MAX * scale, (diff.max().item(), scale)
    assert diff.mean().item() <= REL_MEAN * scale, (diff.mean().item(), scale)


def test_bf16_llm_loads_bf16_weights_and_cache_and_generates():
    llm = LLM("tiny-llama", dtype="bfloat16", num_blocks=64, block_size=8)
    runner = llm.runner
    assert runner.dtype == torch.bfloat16 and runner.kv_cache.data.dtype == torch.bfloat16
    assert runner.model.embed_weight.dtype == torch.bfloat16
    assert runner.model.layers[0].input_norm.weight.dtype == torch.bfloat16
    outs = llm.generate([[1, 2, 3, 4, 5], [9] * 20], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 12]
    assert all(0 <= t < runner.vocab_size for o in outs for t in o.outputs[0].token_ids)
    again = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids   # deterministic
    stats = llm.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_bf16_rejects_an_unknown_dtype_by_name():
    with pytest.raises(ValueError, match="unknown dtype"):
        LLM("tiny-llama", dtype="bfloat17", num_blocks=8)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_bf16_logits_close_to_fp32(backend):
    """Prefill and decode logits of the bf16 model are within the documented tolerance of
    fp32's, on the fast path (packed weights, Numba bf16 decode) and on the reference."""
    if backend == "cpu":
        _needs_numba()
    m32, m16 = load_model("tiny-llama"), load_model("tiny-llama", dtype=torch.bfloat16)
    r32 = ModelRunner(m32, block_size=4, num_blocks=64, attention_backend=backend)
    r16 = ModelRunner(m16, block_size=4, num_blocks=64, attention_backend=backend, dtype=torch.bfloat16)
    assert r16.kv_cache.data.dtype == torch.bfloat16
    for prompt in ([3, 1, 4, 1, 5, 9, 2, 6], [(7 * i) % 250 for i in range(45)]):
        follow = [11, 22, 33, 44, 55, 66]
        out32, out16 = _logits_along(r32, prompt, follow), _logits_along(r16, prompt, follow)
        assert out16.dtype == torch.float32   # the runner hands the sampler fp32 logits
        _assert_close_to_fp32(out16, out32)


def test_bf16_fast_path_agrees_with_the_bf16_reference():
    """Same bf16 weights, two backends: the fast one (oneDNN bf16 matmuls, the kernel's
    fp32 accumulation) and the reference differ only by rounding."""
    _needs_numba()
    m16 = load_model("tiny-llama", dtype=torch.bfloat16)
    fast = ModelRunner(m16, block_size=4, num_blocks=64, attention_backend="cpu", dtype=torch.bfloat16)
    ref = ModelRunner(m16, block_size=4, num_blocks=64, attention_backend="torch", dtype=torch.bfloat16)
    prompt, follow = [(5 * i + 3) % 250 for i in range(30)], [1, 2, 3, 4]
    _assert_close_to_fp32(_logits_along(fast, prompt, follow), _logits_along(ref, prompt, follow))


def test_bf16_packs_its_weights_where_onednn_has_bf16_kernels():
    _needs_numba()
    if not llama._onednn_runs_bf16():
        pytest.skip("this CPU has no oneDNN bf16 kernels (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): bf16 weights stay plain")
    fast = ModelRunner(load_model("tiny-llama", dtype=torch.bfloat16), block_size=4, num_blocks=64,
                       attention_backend="cpu", dtype=torch.bfloat16)
    assert fast.packed_linears
    assert all(m.packed is not None for m in fast.model.modules() if isinstance(m, llama.Linear))


def test_bf16_on_a_cpu_without_onednn_bf16_keeps_plain_weights_and_agrees(monkeypatch):
    """An AVX2-only CPU (AMD Zen 3, older Intel): oneDNN refuses to pack a bf16 weight there,
    so the CPU backend keeps the plain one and still serves, close to the reference."""
    _needs_numba()
    monkeypatch.setattr(llama, "_onednn_runs_bf16", lambda: False)
    m16 = load_model("tiny-llama", dtype=torch.bfloat16)
    fast = ModelRunner(m16, block_size=4, num_blocks=64, attention_backend="cpu", dtype=torch.bfloat16)
    assert not fast.packed_linears and "widened to fp32" in fast.attention_backend_reason
    assert all(m.packed is None for m in fast.model.modules() if isinstance(m, llama.Linear))
    ref = ModelRunner(m16, block_size=4, num_blocks=64, attention_backend="torch", dtype=torch.bfloat16)
    prompt, follow = [(7 * i + 1) % 250 for i in range(30)], [4, 3, 2, 1]
    _assert_close_to_fp32(_logits_along(fast, prompt, follow), _logits_along(ref, prompt, follow))
    llm = LLM("tiny-llama", dtype="bfloat16", num_blocks=64, block_size=8)
    outs = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(outs[0].outputs[0].token_ids) == 8 and not llm.runner.packed_linears


@pytest.mark.slow
def test_smollm2_bf16_logits_close_to_fp32():
    """SmolLM2-135M: bf16 logits within the documented tolerance of fp32 on real prompts."""
    _needs_numba()
    m32, m16 = load_model("smollm2-135m"), load_model("smollm2-135m", dtype=torch.bfloat16)
    r32 = ModelRunner(m32, block_size=16, num_blocks=32, attention_backend="cpu")
    r16 = ModelRunner(m16, block_size=16, num_blocks=32, attention_backend="cpu", dtype=torch.bfloat16)
    tok = m32.tokenizer
    for text in ("The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return"):
        ids = tok(text).input_ids
        out32 = _logits_along(r32, ids, [])
        out16 = _logits_along(r16, ids, [])
        _assert_close_to_fp32(out16, out32)
