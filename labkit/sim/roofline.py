"""A roofline cost model: how long an iteration takes, from FLOPs and bytes.

``LinearCostModel`` fits three numbers to one machine. This model *derives* an iteration's
time from the model's shape and the hardware's datasheet, so the same code answers "what if
this ran Llama-3-70B on H200s?" and explains *why* prefill and decode behave so differently.

First principles
----------------
An iteration runs the model once over every token in the batch (prefill chunks and decode
tokens together). Two kinds of work dominate, and each is bounded by one of two resources:

* **Linear layers** (Q/K/V/O projections, the MLP, the LM head). Every token multiplies
  with every weight: ``2 * params`` FLOPs per token (one multiply and one add per weight),
  so ``2 * P * T`` FLOPs for ``T`` tokens. The weights must be read from memory once per
  iteration whatever ``T`` is: ``P * dtype_bytes`` bytes. Arithmetic intensity is
  therefore ``2T / dtype_bytes`` FLOPs per byte: it *grows with the batch*. A decode
  iteration has one token per sequence (T = batch size, tens), far below the hardware's
  ridge point ``F / B`` (H100: ~295 FLOPs/byte at peak): **decode is memory-bound**,
  its time is "read all the weights once". A prefill chunk has hundreds or thousands of
  tokens: **prefill is compute-bound**, its time grows with the tokens.
* **Attention.** Each (query, key) pair costs ``4 * heads * head_dim`` FLOPs per layer
  (``q.k`` and ``p.v``). A decode token reads its whole context's K and V
  (``kv_bytes_per_token`` per context token) for a handful of FLOPs per byte: memory-bound,
  and the bytes grow with batch x context. A prefill chunk re-uses each loaded key for a tile
  of queries (FlashAttention tiles of ~128 rows): compute-bound.

Per kind of work the time is ``max(FLOPs / F, bytes / B)`` (``combine="max"``): the roofline.
A GPU kernel streams its operands while its tensor cores compute, so it takes the longer of
the two, not their sum. The kinds run one after another (separate kernels), so their times
add, plus a fixed per-iteration overhead (scheduling, sampling, kernel launches):

    t = overhead + roof(linear FLOPs, weight bytes) + roof(attention FLOPs, KV bytes)

Why not ``max`` over the whole iteration? Because that would let decode attention's KV
reads hide behind the linear layers' compute, which separate kernels do not do. Why not a
plain sum of compute and memory? Because on GPUs loads and math overlap within a kernel.
On the 2-core CPU, however, the measured step times fit ``compute + memory`` (no overlap)
much better than ``max``: the CPU preset uses ``combine="sum"``.

``F`` and ``B`` are *achieved* figures: datasheet peak x an efficiency factor (large bf16
GEMMs reach ~60-80 % of peak tensor FLOP/s, streaming kernels ~80-90 % of HBM bandwidth).
What is left out (on purpose, so the model stays readable): activation traffic, norms and
rotary embeddings, tensor-parallel all-reduces, kernel tiling and wave quantization,
clock throttling, CUDA-graph effects. Expect tens of percent, not factors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .cost_model import BatchShape, SwapLink, measure_memcpy

#: Queries that share one load of a key/value in prefill attention (a FlashAttention tile).
PREFILL_QUERY_TILE = 128


# ---- models ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only (Llama-style) transformer: all a cost model needs."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2                 # bf16 / fp16: 2; fp32: 4
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf_config(cls, config, name: str | None = None, dtype_bytes: int | None = None) -> "ModelSpec":
        """From a Hugging Face config (a ``PretrainedConfig`` or its ``config.json`` dict)."""
        get = (config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d))
        heads = get("num_attention_heads")
        hidden = get("hidden_size")
        if dtype_bytes is None:
            dtype = str(get("torch_dtype", "bfloat16") or "bfloat16")
            dtype_bytes = 4 if "32" in dtype else 2
        return cls(
            name=name or get("_name_or_path", None) or get("model_type", "model"),
            num_layers=get("num_hidden_layers"), hidden_size=hidden, num_heads=heads,
            num_kv_heads=get("num_key_value_heads", None) or heads,
            head_dim=get("head_dim", None) or hidden // heads,
            intermediate_size=get("intermediate_size"), vocab_size=get("vocab_size"),
            dtype_bytes=dtype_bytes, tie_word_embeddings=bool(get("tie_word_embeddings", False)))

    def with_dtype(self, dtype_bytes: int) -> "ModelSpec":
        return replace(self, dtype_bytes=dtype_bytes)

    # -- parameters -------------------------------------------------------------------
    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer's matrix multiplies (norms are negligible)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size   # Q, K+V, O, gate/up/down

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """All parameters (embeddings once if tied), norms included."""
        emb = self.vocab_size * self.hidden_size
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return self.num_layers * self.layer_params + emb * (1 if self.tie_word_embeddings else 2) + norms

    @property
    def weight_bytes(self) -> int:
        """Memory the weights occupy."""
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token, all layers: what a context token costs in memory (and on a link)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs for one (query, key) pair over all layers: q.k and p.v, 2 FLOPs per multiply-add."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def __str__(self) -> str:
        return (f"{self.name}: {self.num_params / 1e9:.3g} B params, {self.weight_bytes / 2**30:.3g} GiB "
                f"of weights, {self.kv_bytes_per_token / 1024:.4g} KiB of KV per token")


MODELS: dict[str, ModelSpec] = {
    # HuggingFaceTB/SmolLM2-135M(-Instruct) config.json; labkit's default model (fp32 on the CPU)
    "smollm2-135m": ModelSpec("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, 4, tie_word_embeddings=True),
    # meta-llama/Meta-Llama-3-8B and -70B config.json, bf16
    "llama-3-8b": ModelSpec("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256, 2),
    "llama-3-70b": ModelSpec("Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256, 2),
    # meta-llama/Llama-2-13b-hf config.json, fp16: multi-head attention (40 KV heads), so
    # 800 KiB of KV per token like the paper's OPT-13B (the swapping chapter's default)
    "llama-2-13b": ModelSpec("Llama-2-13B", 40, 5120, 40, 40, 128, 13824, 32000, 2),
}


# ---- hardware -------------------------------------------------------------------------
@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator (or the CPU): peak figures, the share of them a real engine achieves,
    the fixed cost of an iteration, and whether compute and memory traffic overlap."""

    name: str
    peak_flops: float              # dense FLOP/s at the model's dtype (bf16 on GPUs, fp32 on the CPU)
    peak_bandwidth: float          # memory bytes/s (HBM on GPUs)
    memory_bytes: float            # capacity, for weights + KV cache
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    overhead_s: float = 0.002      # per iteration: scheduler, sampler, launches
    combine: str = "max"           # "max": loads overlap math (GPU); "sum": they do not (CPU fit)
    link_bandwidth: float = 50e9   # bytes/s per direction to another instance (KV transfer)
    source: str = ""
    host_link: str = "pcie4-x16"   # the link to host memory that swapped KV blocks cross (HOST_LINKS)

    @property
    def flops(self) -> float:
        """Achieved FLOP/s."""
        return self.peak_flops * self.flops_efficiency

    @property
    def bandwidth(self) -> float:
        """Achieved bytes/s."""
        return self.peak_bandwidth * self.bandwidth_efficiency

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity above which work is compute-bound (achieved figures)."""
        return self.flops / self.bandwidth


# NVLink figures are per direction (A100: 600 GB/s total, H100/H200: 900 GB/s total).
HARDWARE: dict[str, HardwareSpec] = {
    "a100-80gb": HardwareSpec("A100-80GB-SXM", 312e12, 2.039e12, 80e9, link_bandwidth=300e9,
                              source="NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense, 2,039 GB/s HBM2e",
                              host_link="pcie4-x16"),
    "h100-sxm": HardwareSpec("H100-SXM", 989e12, 3.35e12, 80e9, link_bandwidth=450e9,
                             source="NVIDIA H100 datasheet: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3",
                             host_link="pcie5-x16"),
    "h200": HardwareSpec("H200-SXM", 989e12, 4.8e12, 141e9, link_bandwidth=450e9,
                         source="NVIDIA H200 datasheet: 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e",
                         host_link="pcie5-x16"),
    # Fitted (least squares) to transformers' fp32 decode steps of SmolLM2-135M on the 2-core
    # development CPU: batch 1: 38 ms (32 ms in matmuls), batch 16 at context 300: 88 ms,
    # batch 64: 219 ms (shared/bench/README.md). The figures are achieved, so efficiency 1.
    # "sum": compute and memory do not overlap there. KV "link": a memcpy between processes.
    "cpu-2core": HardwareSpec("2-core Zen 5 CPU (transformers fp32 fit)", 140.3e9, 17.88e9, 24 * 2**30,
                              flops_efficiency=1.0, bandwidth_efficiency=1.0, overhead_s=0.0083,
                              combine="sum", link_bandwidth=10e9, host_link="cpu-memcpy",
                              source="fit to peer decode-step timings, shared/bench/README.md"),
    # The same machine with vLLM's CPU kernels: cpu-2core's FLOP/s and bandwidth scaled up
    # (overhead down) by one factor, 2.33, chosen so that the simulator serves the peer
    # 64-request workload (18,336 prompt + 9,588 output tokens, all at t=0; chunked
    # prefill, 4096 tokens, block 128: vLLM's CPU defaults) in the 29.5 s vLLM measured.
    # One number calibrates one factor: the split between compute and memory is cpu-2core's.
    "cpu-2core-vllm": HardwareSpec("2-core Zen 5 CPU (vLLM fp32 fit)", 327.3e9, 41.72e9, 24 * 2**30,
                                   flops_efficiency=1.0, bandwidth_efficiency=1.0, overhead_s=0.00356,
                                   combine="sum", link_bandwidth=10e9, host_link="cpu-memcpy",
                                   source="cpu-2core scaled to vLLM's 29.5 s, shared/bench/README.md"),
}

#: Links a KV cache can travel over between instances, bytes/s per direction.
LINKS: dict[str, float] = {
    "nvlink-a100": 300e9, "nvlink-h100": 450e9, "ib-ndr-400g": 50e9, "ib-hdr-200g": 25e9,
    "pcie4-x16": 25e9, "pcie5-x16": 50e9, "ethernet-100g": 12.5e9, "cpu-memcpy": 10e9,
}


#: Links between device and host memory, for swapping: (bytes/s per direction achieved with
#: pinned memory and large transfers, fixed seconds per transfer). PCIe 4.0 x16 carries
#: 31.5 GB/s raw per direction, 5.0 x16 twice that; about 80 % is achieved. The fixed cost
#: of one cudaMemcpyAsync (launch, DMA setup) is taken as 5 us: an assumption of the
#: order measured for small copies, not a datasheet figure (override it with
#: ``roofline(..., host_link=...)`` and ``HOST_LINKS``). "cpu-memcpy" is this machine's
#: memcpy, measured once per process (``labkit.sim.cost_model.measure_memcpy``).
HOST_LINKS: dict[str, tuple[float, float] | None] = {
    "pcie4-x16": (25e9, 5e-6),
    "pcie5-x16": (50e9, 5e-6),
    "cpu-memcpy": None,
}


def get_model(model: "str | ModelSpec") -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    try:
        return MODELS[model.lower()]
    except KeyError:
        raise ValueError(f"unknown model {model!r}; presets: {', '.join(MODELS)} "
                         "(or build a ModelSpec, e.g. ModelSpec.from_hf_config(config))") from None


def get_hardware(hardware: "str | HardwareSpec") -> HardwareSpec:
    if isinstance(hardware, HardwareSpec):
        return hardware
    try:
        return HARDWARE[hardware.lower()]
    except KeyError:
        raise ValueError(f"unknown hardware {hardware!r}; presets: {', '.join(HARDWARE)}") from None


# ---- the cost model -------------------------------------------------------------------
@dataclass
class RooflineCostModel:
    """Iteration time from FLOPs and bytes: ``overhead + roof(linear) + roof(attention)``.

    Same interface as ``LinearCostModel`` (``iteration_time(shape)``), so ``SimExecutor``
    and ``labkit.sim.simulate`` accept it. ``tp`` GPUs in tensor parallel split the weights
    and the KV: FLOP/s and bandwidth scale by ``tp`` (communication is not modelled).
    """

    model: ModelSpec
    hardware: HardwareSpec
    tp: int = 1
    name: str = field(default="")

    def __post_init__(self) -> None:
        self.model = get_model(self.model)
        self.hardware = get_hardware(self.hardware)
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.hardware.combine not in ("max", "sum"):
            raise ValueError(f"combine must be 'max' or 'sum', got {self.hardware.combine!r}")
        if not self.name:
            tp = f" x{self.tp}" if self.tp > 1 else ""
            self.name = f"roofline {self.model.name} on {self.hardware.name}{tp}"

    # -- resources ----------------------------------------------------------------------
    @property
    def flops(self) -> float:
        return self.hardware.flops * self.tp

    @property
    def bandwidth(self) -> float:
        return self.hardware.bandwidth * self.tp

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    @property
    def weight_read_params(self) -> int:
        """Weights every iteration reads: all layers' matrices plus the LM head (the
        embedding table is only gathered, a few rows per token)."""
        return self.model.num_layers * self.model.layer_params + self.model.lm_head_params

    def _roof(self, flops: float, nbytes: float) -> tuple[float, float, float]:
        compute, memory = flops / self.flops, nbytes / self.bandwidth
        both = max(compute, memory) if self.hardware.combine == "max" else compute + memory
        return compute, memory, both

    # -- the interface ------------------------------------------------------------------
    def breakdown(self, shape: BatchShape) -> dict:
        """Where an iteration's time goes: each kind of work's compute and memory time."""
        m = self.model
        if shape.num_tokens == 0:
            return {"overhead_s": 0.0, "linear_s": 0.0, "attention_s": 0.0, "total_s": 0.0,
                    "linear_compute_s": 0.0, "linear_memory_s": 0.0,
                    "attention_compute_s": 0.0, "attention_memory_s": 0.0, "bound": "idle"}
        # Linear layers: every token through every layer; logits only for the sequences that
        # sample (at most one token per scheduled sequence; mid-prompt chunks compute none,
        # counted anyway: the LM head is a few percent of a chunk's FLOPs).
        lin_flops = 2 * m.num_layers * m.layer_params * shape.num_tokens \
            + 2 * m.lm_head_params * min(shape.num_seqs, shape.num_tokens)
        lin_bytes = self.weight_read_params * m.dtype_bytes
        lc, lm, lin = self._roof(lin_flops, lin_bytes)
        # Attention: FLOPs per (query, key) pair; bytes: K/V written for every new token,
        # read in full by each decode token, read once per query tile by prefill chunks.
        pairs = shape.decode_context_tokens + shape.prefill_context_tokens
        kv_read = shape.decode_context_tokens + shape.prefill_context_tokens / PREFILL_QUERY_TILE
        attn_bytes = (kv_read + shape.num_tokens) * m.kv_bytes_per_token
        ac, am, attn = self._roof(m.attention_flops_per_pair * pairs, attn_bytes)
        overhead = self.hardware.overhead_s
        total = overhead + lin + attn
        compute, memory = lc + ac, lm + am
        return {"overhead_s": overhead, "linear_s": lin, "attention_s": attn, "total_s": total,
                "linear_compute_s": lc, "linear_memory_s": lm,
                "attention_compute_s": ac, "attention_memory_s": am,
                "bound": "compute" if compute >= memory else "memory"}

    def iteration_time(self, shape: BatchShape) -> float:
        return self.breakdown(shape)["total_s"]

    @property
    def swap_link(self) -> SwapLink:
        """The hardware's host link as vLLM v0 used it for swapping: each block of each
        layer's K and V a transfer of its own (``2 * num_layers`` per block)."""
        name = self.hardware.host_link
        if name not in HOST_LINKS:
            raise ValueError(f"unknown host link {name!r}; presets: {', '.join(HOST_LINKS)}")
        bandwidth, latency = HOST_LINKS[name] or measure_memcpy()
        return SwapLink(bandwidth, latency, self.model.kv_bytes_per_token, 2 * self.model.num_layers, name=name)

    # -- derived numbers the notebook and the exercises use ------------------------------
    def ridge_tokens(self) -> float:
        """Tokens per iteration at which the linear layers turn compute-bound: reading the
        weights (``P * bytes / B``) takes as long as multiplying them (``2 * P * T / F``),
        i.e. ``T = F * dtype_bytes / (2 * B)``. Below it, extra tokens ride along for free."""
        return self.flops * self.model.dtype_bytes / (2 * self.bandwidth)

    def prefill_time(self, prompt_len: int, start: int = 0) -> float:
        """One prompt chunk of ``prompt_len`` tokens after ``start`` computed ones, alone."""
        return self.iteration_time(batch_shape(prefill=[(prompt_len, start)]))

    def decode_time(self, batch: int, context: int) -> float:
        """One decode iteration of ``batch`` sequences with ``context`` tokens each."""
        return self.iteration_time(batch_shape(decode=[context] * batch))

    def kv_cache_blocks(self, block_size: int = 16, memory_utilization: float = 0.9) -> int:
        """KV blocks that fit beside the weights in ``memory_utilization`` of the instance's
        memory (``tp`` devices): vLLM's ``gpu_memory_utilization`` arithmetic."""
        free = self.hardware.memory_bytes * self.tp * memory_utilization - self.model.weight_bytes
        if free <= 0:
            raise ValueError(f"{self.model.name} ({self.model.weight_bytes / 1e9:.1f} GB of weights) does not "
                             f"fit in {self.tp} x {self.hardware.name}; raise tp")
        return int(free // (block_size * self.model.kv_bytes_per_token))


def batch_shape(decode: list[int] = (), prefill: list[tuple[int, int]] = ()) -> BatchShape:
    """A ``BatchShape`` from its parts: one context length per decode sequence (the tokens
    before the one being decoded, plus it), and ``(num_tokens, start)`` per prefill chunk.
    Counts context exactly as ``BatchShape.of`` does for a real scheduler plan."""
    shape = BatchShape(num_seqs=len(decode) + len(prefill))
    for context in decode:
        shape.num_decode_tokens += 1
        shape.decode_context_tokens += context
    for n, start in prefill:
        shape.num_prefill_tokens += n
        shape.prefill_context_tokens += n * start + n * (n + 1) // 2
    return shape


def roofline(model: "str | ModelSpec" = "llama-3-8b", hardware: "str | HardwareSpec" = "h100-sxm",
             tp: int = 1, **hardware_overrides) -> RooflineCostModel:
    """A roofline cost model from presets, e.g. ``roofline("llama-3-70b", "h200", tp=2)``;
    keyword arguments override hardware fields (``flops_efficiency=0.5``, ``overhead_s=0``)."""
    hw = get_hardware(hardware)
    if hardware_overrides:
        hw = replace(hw, **hardware_overrides)
    return RooflineCostModel(get_model(model), hw, tp)


def fit_hardware(model: "str | ModelSpec", measurements: list[tuple[BatchShape, float]],
                 name: str = "fitted", **fields) -> HardwareSpec:
    """Fit a ``combine="sum"`` hardware description to measured iterations of ``model``.

    With no overlap, ``t = overhead + bytes / B + FLOPs / F`` is linear in
    ``(1, 1/B, 1/F)``: a least-squares fit on (shape, seconds) pairs gives the achieved
    bandwidth, FLOP/s and per-iteration overhead. Needs pairs that vary both the tokens and
    the context (or a pure-weights pair), else the system is singular.
    """
    import numpy as np

    probe = RooflineCostModel(get_model(model), HardwareSpec("probe", 1.0, 1.0, math.inf,
                                                             flops_efficiency=1, bandwidth_efficiency=1,
                                                             overhead_s=0.0, combine="sum"))
    rows, y = [], []
    for shape, seconds in measurements:
        b = probe.breakdown(shape)
        rows.append([1.0, b["linear_memory_s"] + b["attention_memory_s"],
                     b["linear_compute_s"] + b["attention_compute_s"]])
        y.append(seconds)
    (overhead, inv_b, inv_f), *_ = np.linalg.lstsq(np.array(rows), np.array(y), rcond=None)
    if inv_b <= 0 or inv_f <= 0:
        raise ValueError("the measurements do not determine positive FLOP/s and bandwidth; "
                         "add shapes that vary the batch and the context")
    return HardwareSpec(name, 1.0 / inv_f, 1.0 / inv_b, fields.pop("memory_bytes", 24 * 2**30),
                        flops_efficiency=1.0, bandwidth_efficiency=1.0, overhead_s=max(0.0, float(overhead)),
                        combine="sum", **fields)
