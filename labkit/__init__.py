"""labkit: a small, real LLM serving engine to learn PagedAttention and continuous batching from.

    from labkit import LLM, SamplingParams
    llm = LLM()                       # SmolLM2-135M-Instruct, paged KV, continuous batching
    llm.generate("Hello", SamplingParams(max_tokens=16, temperature=0))

The layers, bottom up: ``labkit.memory`` (blocks, block tables, copy-on-write, prefix
cache), ``labkit.kernels`` (paged attention), ``labkit.scheduler`` (continuous and static
batching), ``labkit.model`` (a Llama on paged KV), ``labkit.engine`` (the loop),
``labkit.sim`` (the same loop with a cost model), ``labkit.viz`` (widgets),
``labkit.llm`` and ``labkit.server`` (the APIs).
"""

from .openmp import configure_openmp_wait

configure_openmp_wait()  # before anything loads torch's OpenMP runtime: see labkit/openmp.py

# The imports below come after configure_openmp_wait() on purpose: anything they pull in
# (torch, one day) must find the OpenMP setting already made.
from .outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestOutput  # noqa: E402
from .sampling_params import BeamSearchParams, SamplingParams  # noqa: E402
from .structured import StructuredOutputsParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "StructuredOutputsParams"]


def __getattr__(name):
    # LLM pulls in torch and transformers: import it on first use, so that the memory
    # layer and the simulator stay light to import (widgets, tests, the notebooks' first cells).
    if name == "LLM":
        from .llm import LLM
        return LLM
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")
