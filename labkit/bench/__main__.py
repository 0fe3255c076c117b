"""``python -m labkit.bench WHAT [options]``: every measurement labkit reports, in one CLI.

``COMMANDS`` names each benchmark and what it measures; ``python -m labkit.bench`` (or
``--help``) lists them and exits 0, ``python -m labkit.bench WHAT --help`` shows one's options.
Listing imports no benchmark (nor torch): it answers at once.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "memory": "allocator / block table / prefix cache throughput",
    "sim": "a trace through the real scheduler with the simulator (continuous vs static)",
    "kernels": "the paged-attention kernels against a torch baseline (GPU timings need a GPU)",
    "serve": "the real engine against Hugging Face (and vLLM if installed) on one workload (minutes)",
    "http": "the OpenAI-compatible server under concurrent streaming clients",
    "costs": "what one request's options (stop strings, logit_bias, logprobs, n, ...) cost each engine iteration",
    "disagg": "prefill/decode interference, chunked prefill and disaggregation (simulated)",
    "matmul": "the linear layers of one forward pass: labkit's panels against oneDNN and MKL, by rows",
    "prefill": "prefill attention on a CPU: the C++ tiles against the row loop, SDPA and the torch reference",
    "step": "one engine iteration (a decode batch, a long prefill) and attention's share of it",
    "swap": "preemption by swapping vs recomputation, by block size (paper's Figure 19; about 3 min)",
    "gpu-check": "everything that needs a GPU: gpu tests, kernel bandwidth, engine = Transformers on CUDA",
    "gpu-compile": "every Triton kernel compiled for T4/A100/L4/H100 without a GPU: shared memory, registers, spills",
    "sharing": "memory saved by sharing blocks: parallel sampling and beam search (paper's Figure 15; about 6 min)",
    "prefix": "prefix caching policies side by side: hash blocks vs radix tree vs none, per workload",
    "structured": "grammar-constrained decoding: mask cost, tok/s with and without, jump-forward, validity",
    "spec": "speculative decoding (n-gram, draft layers) against none, by workload and batch size (minutes)",
    "startup": "how long the CLI's --help and labkit's imports take in a fresh process",
    "kv-dtype": "quantized KV cache (int8, fp8) vs unquantized: tok/s, greedy agreement, logit distance (minutes)",
    "tiers": "a host tier behind the prefix cache: hit rates, prefill saved and TTFT with none, device, device+host",
}


def usage() -> str:
    """The help text: plain words for a terminal (no reStructuredText markup)."""
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, what in COMMANDS.items()]
    return "\n".join(["usage: python -m labkit.bench WHAT [options]", "",
                      "Every measurement labkit reports, in one CLI. WHAT is one of:", "", *lines, "",
                      "python -m labkit.bench WHAT --help shows each one's options."])


def plain(doc: str | None) -> str | None:
    """A docstring as terminal text: without reStructuredText's double backticks."""
    return doc.replace("``", "") if doc else doc


def module_name(what: str) -> str:
    """The module a benchmark's command name lives in: ``gpu-check`` in ``gpu_check.py``."""
    return f"labkit.bench.{what.replace('-', '_')}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())                    # the list is what was asked for: a success
        return 0
    what, rest = argv[0], argv[1:]
    if what not in COMMANDS:
        print(f"unknown benchmark {what!r}; choose from: {', '.join(COMMANDS)}\n"
              "(python -m labkit.bench --help says what each one measures)", file=sys.stderr)
        return 2
    name = module_name(what)
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:
            print(f"the {what!r} benchmark is not available in this version of labkit", file=sys.stderr)
            return 2
        raise
    module.__doc__ = plain(module.__doc__)      # its --help shows its docstring, in a terminal
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
