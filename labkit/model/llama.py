"""A Llama-family decoder that reads and writes a paged KV cache.

Covers Llama / SmolLM2 / Mistral / Qwen2-style models: RMSNorm, rotary position embeddings
(RoPE), grouped-query attention (GQA), SwiGLU MLP, tied or untied embeddings, optional
q/k/v biases (Qwen2). Weights come straight from a Hugging Face state dict; the forward pass
is plain torch, written to be read.

One forward call processes a *packed* batch: the tokens of every scheduled sequence laid end
to end, prefill chunks first, then single decode tokens. There is no batch dimension and no
padding: a tensor of hidden states is ``[num_tokens, hidden]``. The attention layer writes
the new K/V into their cache slots and then attends over each sequence's blocks, so a
sequence's past never has to be contiguous in memory.

Two load-time tricks make it fast on a CPU without changing the maths: the q, k and v
projections are concatenated into one matrix (one matmul instead of three), and so are the
gate and up projections of the MLP.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .kv_cache import KVCache
from .loader import check_supported

_HAS_RMS_NORM = hasattr(F, "rms_norm")  # torch >= 2.4


# ---------------------------------------------------------------------------------------------
# shapes and settings read from the Hugging Face config


@dataclass(frozen=True)
class ModelSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int  # longest sequence the model supports
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, config) -> "ModelSpec":
        check_supported(config)
        heads = config.num_attention_heads
        max_position = config.max_position_embeddings
        window = getattr(config, "sliding_window", None)
        uses_window = getattr(config, "use_sliding_window", config.model_type == "mistral")
        if window and uses_window:  # within the window, full attention is sliding attention
            max_position = min(max_position, int(window))
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps,
            max_position=max_position,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )


# ---------------------------------------------------------------------------------------------
# rotary position embeddings


def rope_parameters(config) -> tuple[float, dict]:
    """(theta, scaling dict) from either the transformers-5 ``rope_parameters`` or the older fields."""
    rp = dict(getattr(config, "rope_parameters", None) or {})
    theta = rp.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    scaling = rp if rp.get("rope_type", rp.get("type")) else dict(getattr(config, "rope_scaling", None) or {})
    return float(theta), scaling


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (fp32, ``[head_dim / 2]``) and the cos/sin scale, as transformers computes them."""
    theta, scaling = rope_parameters(config)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("partial rotary embeddings are not supported")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":  # position interpolation: positions / factor
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":  # Llama 3.1: slow (long-wavelength) frequencies are stretched
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope_type == "dynamic":
        raise NotImplementedError("dynamic NTK RoPE depends on the sequence length; not supported")
    try:  # other static schemes (yarn, longrope): use transformers' own formula
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        return inv_freq.float(), float(scale)
    except KeyError:
        raise NotImplementedError(f"unsupported rope_type {rope_type!r}") from None


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once; ``forward`` rotates q and k in one go."""

    def __init__(self, config, head_dim: int, max_position: int):
        super().__init__()
        inv_freq, scale = rope_inv_freq(config, head_dim)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)  # [max_position, head_dim / 2]
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for these positions, shaped ``[num_tokens, 1, head_dim / 2]`` to broadcast over heads."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + d/2]) by angle position * inv_freq[i] (the "rotate half" layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# ---------------------------------------------------------------------------------------------
# what attention needs to know about the packed batch


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per forward by the runner; shared by all layers.

    Tokens ``[0, num_prefill_tokens)`` belong to prefill chunks (``query_start_loc`` marks
    where each chunk starts), the rest are one decode token per sequence.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    num_prefill_tokens: int
    prefill_block_tables: torch.Tensor | None  # [num_prefills, max_blocks] int32
    prefill_context_lens: torch.Tensor | None  # [num_prefills] int32, including the chunk
    prefill_query_start_loc: torch.Tensor | None  # [num_prefills + 1] int32
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [num_decodes] int32, including the new token

    def checked(self, kv_cache: KVCache):
        """A context in which the index tensors have been checked against ``kv_cache`` once,
        for all layers: the kernels then skip re-checking their values in every layer (on a
        GPU, a host sync each). See ``labkit.kernels.index_tensors_checked``."""
        from labkit.kernels import index_tensors_checked  # lazy: importing the kernels imports Triton

        attention = []
        if self.prefill_block_tables is not None:
            attention.append((self.prefill_block_tables, self.prefill_context_lens,
                              self.prefill_query_start_loc, self.num_prefill_tokens))
        if self.decode_block_tables is not None:
            attention.append((self.decode_block_tables, self.decode_context_lens, None, 0))
        return index_tensors_checked(kv_cache.num_blocks, kv_cache.block_size, self.slot_mapping, attention)


# ---------------------------------------------------------------------------------------------
# the layers


class Linear(nn.Module):
    """y = x @ W.T + b, like ``F.linear``, with W stored transposed (``[in, out]``, contiguous).

    Why transposed: on CPU, MKL multiplies ``x @ W_t`` with a plain row-major right-hand side
    20-60% faster than ``F.linear``'s transposed view for the batch sizes of decoding (8-64
    tokens), and identically for large ones. The result is the same maths (bit-identical from
    ~64 tokens up, float-rounding differences below).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features = weight.shape[0]
        self.weight_t = nn.Parameter(weight.t().contiguous(), requires_grad=False)  # [in, out]
        self.bias = None if bias is None else nn.Parameter(bias.clone(), requires_grad=False)
        self.packed: torch.Tensor | None = None  # oneDNN's blocked copy of W, once ``pack`` ran
        self.panels: torch.Tensor | None = None  # or W in panels for labkit's C++ loop (``pack_panels``)
        self._ext = None                         # the compiled module that multiplies panels

    def pack(self) -> None:
        """What production CPU engines do (vLLM's CPU build, IPEX): reorder W once, at load,
        into oneDNN's blocked layout, so that every multiply streams it in the order its
        AVX-512 micro-kernel consumes it. Measured here: 15-25% faster than MKL's sgemm on
        the plain matrix in fp32, more for the LM head; bf16 uses the BF16 dot-product
        instructions. Same maths, other rounding order. The plain ``weight_t`` is dropped
        (the packed copy replaces it, not doubles it)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight_t.detach().t().contiguous(), 64)
        self.weight_t = None

    def pack_panels(self, ext) -> None:
        """Reorder W once, at load, into panels of 16 output columns for labkit's own C++
        multiply (``kernels/linear_cpu.py``, ``csrc/linear.cpp``), which streams the weights
        at memory's speed when few rows are multiplied (decoding), and sums every output in
        one order whatever the number of rows. fp32 only. The plain ``weight_t`` is dropped."""
        from labkit.kernels.linear_cpu import pack_panels
        self.panels = pack_panels(self.weight_t.detach().t())
        self._ext = ext
        self.weight_t = None

    @property
    def fuses_silu(self) -> bool:
        """Whether :meth:`silu_mul` can run: weights on panels, gate and up whole panels each."""
        return self.panels is not None and self.out_features % 32 == 0

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of this layer's output, for an MLP's stacked [gate | up] weight on
        panels, in one C++ pass that never writes the [tokens, 2 * inter] product to memory
        (``csrc/linear.cpp``); the same bits as ``forward`` then ``silu_and_mul``."""
        lead = x.shape[:-1]
        y = self._ext.linear_panels_silu_mul(x.reshape(-1, x.shape[-1]).contiguous(), self.panels,
                                             self.out_features, self.bias)
        return y.view(*lead, self.out_features // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            if x.dim() == 2:  # the model's case: [tokens, features]
                return self._ext.linear_panels(x.contiguous(), self.panels, self.out_features, self.bias)
            from labkit.kernels.linear_cpu import linear_panels
            return linear_panels(self._ext, x, self.panels, self.out_features, self.bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if x.dtype == torch.bfloat16 and x.device.type == "cpu" and not _onednn_runs_bf16():
            # A CPU without bf16 matrix kernels (AVX2 only): torch's bf16 matmul falls back to a
            # loop at ~1 GFLOP/s there (measured on Zen 3: 60x slower than fp32), so widen to
            # fp32 for the multiply. The weights stay bf16 in memory; the maths is fp32's.
            out = x.float() @ self.weight_t.float()
            if self.bias is not None:
                out += self.bias.float()
            return out.to(torch.bfloat16)
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)


def can_pack_linears(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's packed linear is there: a CPU build of torch with mkldnn, fp32 or bf16; for
    bf16 also a CPU that oneDNN's bf16 kernels run on (AVX-512 BW/VL/DQ or AVX-NE-CONVERT).
    Without one (an AVX2-only CPU such as AMD Zen 3) bf16 weights stay plain and
    ``Linear.forward`` widens each multiply to fp32."""
    if not (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype == torch.float32 or _onednn_runs_bf16()


LINEAR_LAYOUTS = ("onednn", "panels")
LINEAR_CHOICES = ("auto", *LINEAR_LAYOUTS)  # LABKIT_CPU_LINEAR's values


def linear_layout(device: torch.device, dtype: torch.dtype) -> tuple[str | None, object]:
    """(layout, module) of the CPU backend's linear layers here: "panels" (labkit's C++ loop,
    ``kernels/linear_cpu.py``, with the compiled module that runs it) for fp32 where the C++
    kernels are built with SIMD vectors (AVX-512 or AVX2); else "onednn" where
    :func:`can_pack_linears`; else None (plain weights, ``F.linear``'s maths). The panels were
    measured faster than oneDNN at decoding's few rows and as fast at a prefill's hundreds
    (``python -m labkit.bench matmul``); oneDNN keeps bf16, whose dot-product instructions
    (AVX512-BF16, AMX) the loop does not use. ``LABKIT_CPU_LINEAR=onednn`` (or ``panels``)
    chooses; ``auto`` is the default. ValueError for another value, or for panels where
    they cannot run."""
    wanted = os.environ.get("LABKIT_CPU_LINEAR", "auto").strip().lower() or "auto"
    if wanted not in LINEAR_CHOICES:
        raise ValueError(f"LABKIT_CPU_LINEAR={wanted!r} is not one of {', '.join(LINEAR_CHOICES)}")
    ext = None
    if device.type == "cpu" and dtype == torch.float32 and wanted != "onednn":
        from labkit.kernels import cpu_extension
        ext = cpu_extension.load()
    if wanted == "panels":
        if ext is None:
            raise ValueError("LABKIT_CPU_LINEAR=panels needs fp32 on a CPU and labkit's C++ kernels "
                             f"({'not built here' if dtype == torch.float32 else f'this model is {dtype}'})")
        return "panels", ext
    if ext is not None and ext.isa() != "portable":
        return "panels", ext
    return ("onednn" if can_pack_linears(device, dtype) else None), None


@functools.cache
def _onednn_runs_bf16() -> bool:
    # torch's own answer, then a try of the very calls Linear makes: oneDNN refuses a bf16
    # weight on a CPU it has no bf16 kernels for.
    if hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported") and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16), 64)
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 16, dtype=torch.bfloat16), w, None, "none", [], "")
        return True
    except RuntimeError:
        return False


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.clone(), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x / sqrt(mean(x^2) + eps) * weight, the same arithmetic as transformers' LlamaRMSNorm,
        # in fp32 whatever the model's dtype. For fp32 torch's fused rms_norm gives the very
        # same bits in one op instead of five.
        if x.dtype == torch.float32 and _HAS_RMS_NORM:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, qkv_weight, qkv_bias, o_weight, o_bias):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = Linear(qkv_weight, qkv_bias)  # q, k and v stacked: [(H + 2 * KV) * d, hidden]
        self.o_proj = Linear(o_weight, o_bias)

    def forward(self, x, cos, sin, meta: AttentionMetadata, k_cache, v_cache, ops,
                k_scales=None, v_scales=None) -> torch.Tensor:
        """``k_scales``, ``v_scales``: a quantized cache's scales (``kv_cache.KVCache``), passed
        to every kernel; None for a cache in the model's dtype (and then not passed at all, so
        that a backend of your own needs no such arguments)."""
        n, H, KV, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        fused = getattr(ops, "fused", None)
        scales = {} if k_scales is None else {"k_scales": k_scales, "v_scales": v_scales}
        if fused is not None and not scales:  # the CPU backend: rotation and the cache write in one pass (C++)
            q = fused.rope_and_cache(self.qkv_proj(x), cos, sin, k_cache, v_cache, meta.slot_mapping, H)
        else:  # (a quantized cache is written by reshape_and_cache, which quantizes: fused has no such write)
            qkv = self.qkv_proj(x).view(n, H + 2 * KV, d)
            qk = apply_rope(qkv[:, : H + KV], cos, sin)  # rotate q and k heads together
            q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + KV:]
            ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, **scales)  # write before reading

        p = meta.num_prefill_tokens
        if p == n:  # prefill chunks only
            out = ops.prefill(q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_context_lens,
                              meta.prefill_query_start_loc, self.scale, **scales)
        elif p == 0:  # decode tokens only
            out = ops.decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale,
                             **scales)
        else:  # a mixed batch
            out = torch.cat((
                ops.prefill(q[:p], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_context_lens,
                            meta.prefill_query_start_loc, self.scale, **scales),
                ops.decode(q[p:], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                           self.scale, **scales),
            ))
        return self.o_proj(out.reshape(n, H * d))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up as one matmul."""

    def __init__(self, gate_up_weight, gate_up_bias, down_weight, down_bias):
        super().__init__()
        self.gate_up_proj = Linear(gate_up_weight, gate_up_bias)  # gate and up stacked: [2 * inter, hidden]
        self.down_proj = Linear(down_weight, down_bias)

    def forward(self, x: torch.Tensor, fused=None) -> torch.Tensor:
        if fused is not None and self.gate_up_proj.fuses_silu:  # the CPU backend on panels: matmul and activation
            return self.down_proj(self.gate_up_proj.silu_mul(x))  # in one pass (C++)
        gate_up = self.gate_up_proj(x)
        if fused is not None:  # the CPU backend: silu(gate) * up in one pass (C++)
            return self.down_proj(fused.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, attn: Attention, mlp: MLP, input_norm: RMSNorm, post_attn_norm: RMSNorm):
        super().__init__()
        self.attn, self.mlp = attn, mlp
        self.input_norm, self.post_attn_norm = input_norm, post_attn_norm

    def forward(self, h, residual, cos, sin, meta, k_cache, v_cache, ops, k_scales=None, v_scales=None):
        """Returns (output, residual); the residual stream is updated in place."""
        fused = getattr(ops, "fused", None)
        if residual is None:  # the first layer: the embeddings start the residual stream
            residual, h = h, None
        h = self.attn(add_and_norm(self.input_norm, residual, h, fused), cos, sin, meta, k_cache, v_cache, ops,
                      k_scales, v_scales)
        return self.mlp(add_and_norm(self.post_attn_norm, residual, h, fused), fused), residual


def add_and_norm(norm: RMSNorm, residual: torch.Tensor, delta: torch.Tensor | None, fused) -> torch.Tensor:
    """``residual += delta`` (in place; skipped when delta is None), then ``norm(residual)``:
    one pass over memory with the CPU backend's fused op (C++), two torch ops otherwise."""
    if fused is not None:
        return fused.add_rms_norm(residual, delta, norm.weight, norm.eps)
    if delta is not None:
        residual.add_(delta)
    return norm(residual)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head; ``forward`` returns logits at chosen tokens."""

    def __init__(self, spec: ModelSpec, config, state_dict: dict[str, torch.Tensor]):
        super().__init__()
        self.spec = spec
        sd = state_dict

        def get(name):
            return sd.get(name)

        def cat(*names):
            ts = [get(n) for n in names]
            if all(t is None for t in ts):
                return None
            if any(t is None for t in ts):
                raise ValueError(f"some but not all of {names} are present")
            return torch.cat(ts, dim=0).contiguous()

        embed = get("model.embed_tokens.weight")
        if embed is None:
            raise ValueError("state dict has no model.embed_tokens.weight")
        # Every kept tensor is a copy: the state dict (possibly memory-mapped from the checkpoint
        # file) can be freed once the model is built.
        self.embed_weight = nn.Parameter(embed.clone(), requires_grad=False)
        layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            attn = Attention(
                spec,
                cat(p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"),
                cat(p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"),
                get(p + "self_attn.o_proj.weight"), get(p + "self_attn.o_proj.bias"),
            )
            mlp = MLP(
                cat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                cat(p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"),
                get(p + "mlp.down_proj.weight"), get(p + "mlp.down_proj.bias"),
            )
            layers.append(DecoderLayer(attn, mlp, RMSNorm(get(p + "input_layernorm.weight"), spec.rms_norm_eps),
                                       RMSNorm(get(p + "post_attention_layernorm.weight"), spec.rms_norm_eps)))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(get("model.norm.weight"), spec.rms_norm_eps)
        lm_head = get("lm_head.weight")
        if lm_head is None or spec.tie_word_embeddings:
            lm_head = self.embed_weight  # tied: the output projection is the embedding matrix
        self.lm_head = Linear(lm_head)
        self.rotary = RotaryEmbedding(config, spec.head_dim, spec.max_position)

    def pack_linears(self, layout: str = "onednn", ext=None) -> None:
        """Switch every projection and the LM head to packed weights: oneDNN's (``layout``
        "onednn", ``Linear.pack``) or panels for labkit's C++ loop ("panels", ``ext`` the
        compiled module: ``Linear.pack_panels``). The CPU backend does this at load, as
        :func:`linear_layout` says. Irreversible for this model."""
        if layout not in LINEAR_LAYOUTS:
            raise ValueError(f"unknown linear layout {layout!r}; choose one of {', '.join(LINEAR_LAYOUTS)}")
        for m in self.modules():
            if isinstance(m, Linear) and m.packed is None and m.panels is None:
                if layout == "panels":
                    m.pack_panels(ext)
                else:
                    m.pack()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache, ops, logits_indices: torch.Tensor, num_layers: int | None = None) -> torch.Tensor:
        """``input_ids``/``positions``: ``[num_tokens]``. Returns logits ``[len(logits_indices), vocab]``.

        ``num_layers``: run only the first ``num_layers`` decoder layers, then the final norm and
        the LM head (an early exit: speculative decoding's self-drafting, as LayerSkip). Those
        layers read and write their own K/V in ``kv_cache``, the full model's: the other
        layers' K/V of these tokens is left as it was."""
        h = F.embedding(input_ids, self.embed_weight)
        # the fused rotation (CPU backend) computes in fp32 from fp32 tables, [tokens, d / 2]; it
        # writes only caches in the model's dtype (a quantized one goes through apply_rope)
        fused = getattr(ops, "fused", None) is not None and not kv_cache.quantized
        cos, sin = self.rotary.tables(positions, torch.float32 if fused else h.dtype)
        residual = None
        layers = zip(self.layers, kv_cache.k_caches, kv_cache.v_caches, kv_cache.k_scales, kv_cache.v_scales,
                     strict=True)
        with meta.checked(kv_cache):  # once here, not in each layer's kernels
            for layer, k_cache, v_cache, k_scales, v_scales in itertools.islice(layers, num_layers):
                h, residual = layer(h, residual, cos, sin, meta, k_cache, v_cache, ops, k_scales, v_scales)
        # Only the tokens whose next-token distribution is wanted go through the norm and the head.
        last = residual[logits_indices] + h[logits_indices]
        return self.lm_head(self.norm(last))
