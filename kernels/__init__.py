"""labkit.kernels: the attention kernels of the engine, in Triton, with torch references.

Read in this order; each file stands on its own (kernel, torch reference, launcher):

1. ``reshape_and_cache.py``        write new K/V into their cache slots
2. ``paged_decode_attention.py``   one query per sequence over its blocks (GQA, online softmax)
3. ``paged_prefill_attention.py``  chunks of queries over paged context, causally
4. ``paged_decode_attention_cpu.py`` the decode kernel's algorithm as a Numba loop, for CPUs
5. ``csrc/``                       the same in C++ (what production CPU engines run), with the
                                   fused element-wise ops; ``cpu_extension.py`` compiles them
                                   on first use, for this machine's CPU
6. ``backend.py``                  "auto" | "torch" | "triton" | "cpu", and the ops of each

The KV cache of a layer is ``k_cache``, ``v_cache``: [num_blocks, block_size, num_kv_heads,
head_dim]; a token's slot is ``block_id * block_size + offset``.

Every function checks its arguments before any kernel runs (the kernels themselves index
without bounds checks): a block id or slot outside the cache, a context longer than its
block-table row, a wrong shape, dtype or device is a ``ValueError`` that names it.
``index_tensors_checked`` lets a model check one step's index tensors once for all its
layers instead of once per call.

Import-time contract:

* ``import labkit.kernels`` never touches a GPU (``torch.cuda.is_available()`` creates no
  CUDA context) and works without Triton installed: the torch references always import,
  the Triton launchers then refuse with the import error.
* Triton fixes interpreter vs compiler when a ``@triton.jit`` function is defined. So on a
  machine without CUDA this module sets ``TRITON_INTERPRET=1`` (``setdefault``: an explicit
  value wins) *before* importing the kernel files, and the Triton kernels run on CPU tensors
  through the interpreter. The variable is process-wide: other Triton code defined later in
  the process is interpreted too (it could not be compiled without a GPU anyway).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ._common import HAS_TRITON, index_tensors_checked  # noqa: E402
from .backend import (  # noqa: E402
    BACKENDS,
    AttentionOps,
    FusedOps,
    get_attention_ops,
    select_attention_backend,
    triton_is_interpreted,
)
from .paged_decode_attention import paged_decode_attention, paged_decode_attention_ref  # noqa: E402
from .paged_decode_attention_cpu import paged_decode_attention_cpu  # noqa: E402
from .paged_prefill_attention import (  # noqa: E402
    paged_prefill_attention, paged_prefill_attention_cpu, paged_prefill_attention_ref)
from .reshape_and_cache import reshape_and_cache, reshape_and_cache_ref  # noqa: E402

__all__ = [
    "AttentionOps",
    "BACKENDS",
    "FusedOps",
    "HAS_TRITON",
    "get_attention_ops",
    "index_tensors_checked",
    "paged_decode_attention",
    "paged_decode_attention_cpu",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_cpu",
    "paged_prefill_attention_ref",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "select_attention_backend",
    "triton_is_interpreted",
]
