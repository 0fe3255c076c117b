"""Choosing the attention backend: the Triton kernels or their torch references.

Two backends compute the same three operations (write K/V into the cache, decode
attention, prefill attention):

* ``"triton"``: the kernels in this package. Compiled, they need an NVIDIA GPU of compute
  capability 7.5+ (Colab's free T4, A100, L4, H100...): fp16 and fp32 on all of them, bf16
  from 8.0 (the T4 has no bf16 units). ``python -m labkit.bench gpu-compile`` compiles every
  kernel for sm_75, sm_80, sm_89 and sm_90 without a GPU, and checks each build fits the GPU.
  On a CPU they can run under the Triton interpreter (``TRITON_INTERPRET=1``): correct, very
  slow, for tests and for stepping through a kernel.
* ``"torch"``: the references (gather blocks + ``scaled_dot_product_attention``). They run
  anywhere, on any dtype.
* ``"cpu"``: the CPU's fast path ("what production does"): decode reads the paged cache
  in place, with a C++ kernel compiled for this CPU on first use (``csrc/``,
  ``cpu_extension.py``) or, where none can be built, a Numba-compiled loop
  (``paged_decode_attention_cpu.py``; fp32 and bf16 caches); prefill chunks of short
  contexts go through the same C++ loop, one query row at a time, longer ones through one
  causal SDPA call each (``paged_prefill_attention_cpu``); the rest is the references; the model
  runner also packs its weights for oneDNN (``labkit.model.llama.Linear.pack``). Chapters 5 and
  6 teach from the references.

``"auto"`` picks compiled Triton where it can run, the CPU kernels on a CPU (when Numba
is installed) and the torch reference elsewhere, and says why, so the engine can print
the reason once. :func:`default_dtype` is the dtype the model takes when the user leaves it
to labkit: fp32, or fp16 on GPUs below compute capability 8.0, whose tensor cores are fp16's.

Interpreter or compiler is decided when the ``@triton.jit`` functions are *defined*, i.e.
when ``labkit.kernels`` is imported: ``labkit/kernels/__init__.py`` sets
``TRITON_INTERPRET=1`` (unless already set) on machines without CUDA, before importing the
kernels. The decision cannot be changed afterwards in the same process.
"""

from dataclasses import dataclass
from typing import Callable

import torch

from ._common import (BF16_MIN_COMPUTE_CAPABILITY, HAS_TRITON, MIN_COMPUTE_CAPABILITY, TRITON_IMPORT_ERROR,
                      bf16_unsupported, gpu_name, kernel_is_interpreted)
from .paged_decode_attention import _paged_decode_kernel, paged_decode_attention, paged_decode_attention_ref
from .paged_prefill_attention import (paged_prefill_attention, paged_prefill_attention_cpu,
                                      paged_prefill_attention_ref)
from .paged_decode_attention_cpu import HAS_NUMBA, NUMBA_IMPORT_ERROR, paged_decode_attention_cpu
from .reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

BACKENDS = ("auto", "torch", "triton", "cpu")
_NO_CUDA = ("torch reference: no CUDA device (Triton runs compiled on CUDA GPUs of compute "
            "capability 7.5+)")


def _cpu_reason(why: str) -> str:
    """What the ``cpu`` backend runs here, and why it was chosen. Building the C++ kernels
    (once per machine, ~30 s) happens here, when the backend is chosen, not mid-generation."""
    from . import cpu_extension
    compiled, what = cpu_extension.status()
    decode = ("C++ decode attention reading the paged cache in place, fused rotary/cache-write, "
              "add+RMSNorm and SiLU*up" if compiled
              else f"Numba decode attention reading the paged cache in place ({what})")
    from .paged_prefill_attention import TILES_MAX_CONTEXT
    prefill = (f"prefill chunks of up to {TILES_MAX_CONTEXT} tokens of context in C++ tiles of query rows (a bf16 "
               "cache on AMX where the CPU has it), longer ones causal SDPA" if compiled
               else "causal SDPA for prefill chunks")
    return f"CPU kernels: {decode}, {prefill}, torch references for the rest ({why})"


_CPU_WHY = "no CUDA device; Triton runs compiled on CUDA GPUs of compute capability 7.5+"


@dataclass(frozen=True)
class AttentionOps:
    """The three attention operations of one backend, with the signatures of
    :func:`reshape_and_cache`, :func:`paged_decode_attention` and
    :func:`paged_prefill_attention`."""

    name: str                                  # "torch", "triton" or "cpu"
    reshape_and_cache: Callable[..., None]
    decode: Callable[..., torch.Tensor]
    prefill: Callable[..., torch.Tensor]
    fused: "FusedOps | None" = None            # the CPU backend's fused element-wise ops, when built


@dataclass(frozen=True)
class FusedOps:
    """Element-wise steps of a layer fused into one pass each (the ``cpu`` backend, C++:
    ``csrc/fused_ops.cpp``). The model uses them when its ops carry them and its readable
    torch versions otherwise (``labkit.model.llama``: ``apply_rope`` + ``reshape_and_cache``,
    ``add_and_norm``, ``MLP.forward``)."""

    rope_and_cache: Callable[..., torch.Tensor]  # (qkv, cos, sin, k_cache, v_cache, slots, num_heads) -> q
    add_rms_norm: Callable[..., torch.Tensor]    # (residual, delta | None, weight, eps) -> normed
    silu_and_mul: Callable[..., torch.Tensor]    # ([gate | up]) -> silu(gate) * up


def triton_is_interpreted() -> bool:
    """True when this process's Triton kernels run under the interpreter (fixed at import)."""
    return HAS_TRITON and kernel_is_interpreted(_paged_decode_kernel)


def _check_name(name: str, options: tuple[str, ...]) -> None:
    if name not in options:
        raise ValueError(f"unknown attention backend {name!r}; choose one of "
                         + ", ".join(repr(o) for o in options))


def select_attention_backend(requested: str = "auto", device: torch.device | str | None = None,
                             dtype: torch.dtype | None = None) -> tuple[str, str]:
    """Resolve ``requested`` ("auto" | "torch" | "triton" | "cpu") for ``device`` into
    ``(backend, reason)``, backend being "torch", "triton" or "cpu" and reason a sentence
    for the user.

    ``device`` None means CUDA if available, else CPU. ``dtype`` is the model's (None: the
    one it would take by default, :func:`default_dtype`). "auto" never fails; an explicit
    "triton" that cannot run raises RuntimeError saying why and what to do instead.
    """
    _check_name(requested, BACKENDS)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if requested == "torch":
        return "torch", "torch reference: requested"
    if requested == "cpu":
        if device.type != "cpu":
            raise RuntimeError(f"attention backend 'cpu' runs on CPU tensors, not on {device}")
        if not HAS_NUMBA:
            raise RuntimeError(f"attention backend 'cpu' needs Numba ({NUMBA_IMPORT_ERROR}); use 'torch'")
        return "cpu", _cpu_reason("requested")

    if device.type != "cuda" or not torch.cuda.is_available():
        if requested == "auto":
            if device.type == "cpu" and HAS_NUMBA:
                return "cpu", _cpu_reason(_CPU_WHY)
            return "torch", _NO_CUDA
        if device.type == "cuda":
            raise RuntimeError(f"attention backend 'triton' on {device}: no CUDA device is available")
        if not HAS_TRITON:
            raise RuntimeError(f"attention backend 'triton' needs Triton, which is not installed "
                               f"({TRITON_IMPORT_ERROR}); use 'torch' or 'auto'")
        if not triton_is_interpreted():
            raise RuntimeError(
                f"attention backend 'triton' on {device} runs the Triton interpreter, but "
                "labkit.kernels was imported without TRITON_INTERPRET=1, so its kernels are "
                "compiled for a GPU. Set TRITON_INTERPRET=1 in the environment before anything "
                "imports labkit.kernels or triton (Triton reads it when kernels are defined, its "
                "own included), or use 'torch' or 'auto'")
        if dtype == torch.bfloat16:
            raise RuntimeError("attention backend 'triton' on the CPU runs the Triton interpreter, which "
                               "computes bf16 wrongly: use dtype='float32' or 'float16' with it, or "
                               "the 'cpu' or 'torch' backend for bf16")
        return "triton", (f"Triton interpreter on {device} (TRITON_INTERPRET=1): exact but very "
                          "slow, for tests and for stepping through the kernels")

    if not HAS_TRITON:
        why = f"Triton is not installed ({TRITON_IMPORT_ERROR})"
        if requested == "auto":
            return "torch", f"torch reference: {why}"
        raise RuntimeError(f"attention backend 'triton': {why}; use 'torch' or 'auto'")
    gpu = gpu_name(device)
    if torch.cuda.get_device_capability(device) < MIN_COMPUTE_CAPABILITY:
        why = f"{gpu}: labkit's Triton kernels are built for compute capability 7.5+ (T4, A100, L4, H100...)"
        if requested == "auto":
            return "torch", f"torch reference: {why}"
        raise RuntimeError(f"attention backend 'triton' cannot run on {why}; use 'torch' or 'auto'")
    no_bf16 = bf16_unsupported(device) if dtype == torch.bfloat16 else None
    if no_bf16:
        if requested == "auto":
            return "torch", (f"torch reference: {no_bf16}; the Triton kernels run here in fp16 "
                             "(dtype='float16', the default on this GPU) or fp32")
        raise RuntimeError(f"attention backend 'triton' cannot run bf16 on {no_bf16}. Use dtype='float16' "
                           "(the default on this GPU) or 'float32' for the Triton kernels, or the 'torch' "
                           "backend for bf16")
    if triton_is_interpreted():
        why = "TRITON_INTERPRET=1 was set when labkit.kernels was imported, so Triton would run its slow interpreter"
        if requested == "auto":
            return "torch", f"torch reference: {why}"
        return "triton", f"Triton interpreter on {gpu}: {why}"
    return "triton", f"Triton kernels compiled for {gpu}"


def default_dtype(device: torch.device | str | None = None) -> tuple[torch.dtype, str]:
    """The model's dtype (activations, weights, KV cache) when the user leaves it to labkit
    (``dtype="auto"``) on ``device``, and a sentence saying why.

    fp32 by default: in fp32 the engine gives Transformers' greedy tokens exactly. On a CUDA
    GPU below compute capability 8.0 (Colab's free T4) fp16: its tensor cores multiply fp16
    (65 TFLOPS on a T4, against 8 in fp32) and it has no bf16, so fp16 is what its Triton
    kernels and matmuls run fast in.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if (device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) < BF16_MIN_COMPUTE_CAPABILITY):
        return torch.float16, (f"float16, the default on {gpu_name(device)}: its tensor cores multiply "
                               "fp16 and it has no bf16; dtype='float32' for fp32")
    return torch.float32, "float32"


_TORCH_OPS = AttentionOps("torch", reshape_and_cache_ref, paged_decode_attention_ref,
                          paged_prefill_attention_ref)
_TRITON_OPS = AttentionOps("triton", reshape_and_cache, paged_decode_attention,
                           paged_prefill_attention)
_CPU_OPS = AttentionOps("cpu", reshape_and_cache_ref, paged_decode_attention_cpu,
                        paged_prefill_attention_cpu)


def get_attention_ops(backend: str) -> AttentionOps:
    """The operations of a resolved backend, "torch", "triton" or "cpu" (resolve "auto"
    with :func:`select_attention_backend` first: the choice depends on the device)."""
    _check_name(backend, ("torch", "triton", "cpu"))
    if backend == "triton" and not HAS_TRITON:
        raise RuntimeError(f"attention backend 'triton' needs Triton, which is not installed "
                           f"({TRITON_IMPORT_ERROR}); use 'torch'")
    if backend == "cpu":
        from . import cpu_extension
        ext = cpu_extension.load()
        if ext is not None:  # the C++ build adds the fused element-wise ops
            return AttentionOps("cpu", reshape_and_cache_ref, paged_decode_attention_cpu, paged_prefill_attention_cpu,
                                FusedOps(ext.rope_and_cache, ext.add_rms_norm, ext.silu_and_mul))
    return {"torch": _TORCH_OPS, "triton": _TRITON_OPS, "cpu": _CPU_OPS}[backend]
