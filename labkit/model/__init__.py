"""The real model: a Llama-family decoder on a paged KV cache, its loader and the sampler.

    from labkit.model import ModelRunner, SeqChunk
    runner = ModelRunner("tiny-llama", block_size=16, num_blocks=64)
    logits = runner.execute([SeqChunk(token_ids=[1, 2, 3], num_computed_tokens=0, block_ids=[5])])

Submodules: ``loader`` (weights, config, tokenizer; ``python -m labkit.model.loader fetch``),
``kv_cache`` (the paged KV tensors), ``llama`` (the decoder), ``runner`` (one forward per
engine iteration), ``sampler`` (greedy / temperature / top-k / top-p / seeds).
Names are imported lazily, so ``python -m labkit.model.loader`` runs cleanly.
"""

from importlib import import_module

_EXPORTS = {
    "kv_cache": ["DEFAULT_KV_BUDGET_BYTES", "KVCache", "kv_bytes_per_token", "num_blocks_for_budget"],
    "llama": ["AttentionMetadata", "LlamaModel", "ModelSpec"],
    "loader": ["DEFAULT_MODEL", "TINY_MODEL", "LoadedModel", "ModelLoadError", "default_model_dir",
               "fetch_default_model", "load_model", "random_model", "tiny_config"],
    "runner": ["ModelRunner", "SeqChunk"],
    "sampler": ["SamplingRow", "make_generator", "probabilities", "sample"],
}
_WHERE = {name: mod for mod, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        value = getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
