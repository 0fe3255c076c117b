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
  Triton's own library (``tl.max``, ``tl.cdiv``...) is ``@triton.jit`` code too: when
  something imported Triton first (``torch._dynamo`` does, and Transformers imports that),
  it was defined compiled, and an interpreted kernel calling it fails. So then the variable
  is left unset: the kernels are compiled for a GPU, ``"auto"`` never picks them on a CPU,
  and ``attention_backend="triton"`` says to set ``TRITON_INTERPRET=1`` before starting.
  (``labkit.LLM`` imports this package before Transformers, so this only happens to code
  that imports Triton, Transformers or ``torch._dynamo`` first.)
* ``TRITON_INTERPRET=0`` in the environment compiles the kernels even without a GPU: that is
  how ``python -m labkit.bench gpu-compile`` builds them for GPUs it does not have.
"""

import os
import sys


def _hand_over_to_the_installed_kernels() -> None:
    """Run from the repository's root, Python finds this folder as a top-level ``kernels`` too.

    That is the name of Hugging Face's kernel-hub package, which Transformers 5 imports when it
    is installed. Such an import gets the installed package: found by the import system's own
    finders (an editable install's included) with the repository's root left out of
    ``sys.path`` for the search, and put in ``sys.modules`` in place of this module. With none
    installed it is an ``ImportError`` saying what this folder is. (``importlib.reload`` of the
    hub package from the root is not supported: it would find this file again.)
    """
    import importlib.util

    root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if os.path.realpath(p or os.getcwd()) != root]
    try:
        spec = None
        for finder in sys.meta_path:     # not importlib.util.find_spec: it answers with this module
            find = getattr(finder, "find_spec", None)
            spec = find(__name__, None) if find is not None else None
            if spec is not None:
                break
    finally:
        sys.path[:] = saved
    if spec is None or spec.loader is None:
        raise ImportError(f"{os.path.dirname(__file__)} is the package labkit.kernels: import it by that name",
                          name=__name__)
    module = importlib.util.module_from_spec(spec)
    sys.modules[__name__] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[__name__]
        raise


if __name__ == "kernels":
    _hand_over_to_the_installed_kernels()
elif __name__ != "labkit.kernels":
    raise ImportError(f"{os.path.dirname(__file__)} is the package labkit.kernels, imported here as {__name__}: "
                      "import it as labkit.kernels", name=__name__)
else:
    import torch

    if not torch.cuda.is_available() and "triton.language" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from ._common import (
        BF16_MIN_COMPUTE_CAPABILITY, HAS_TRITON, MIN_COMPUTE_CAPABILITY, Launch, index_tensors_checked)
    from .backend import (
        BACKENDS,
        AttentionOps,
        FusedOps,
        default_dtype,
        get_attention_ops,
        select_attention_backend,
        triton_is_interpreted,
    )
    from .paged_decode_attention import paged_decode_attention, paged_decode_attention_ref
    from .paged_decode_attention_cpu import paged_decode_attention_cpu
    from .paged_prefill_attention import (
        paged_prefill_attention, paged_prefill_attention_cpu, paged_prefill_attention_ref)
    from .reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

    __all__ = [
        "AttentionOps",
        "BACKENDS",
        "BF16_MIN_COMPUTE_CAPABILITY",
        "FusedOps",
        "HAS_TRITON",
        "Launch",
        "MIN_COMPUTE_CAPABILITY",
        "default_dtype",
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
