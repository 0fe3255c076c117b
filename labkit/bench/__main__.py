"""``python -m labkit.bench WHAT [options]``: every measurement labkit reports, in one CLI.

    memory   allocator / block table / prefix cache throughput
    sim      a trace through the real scheduler with the simulator (continuous vs static)
    kernels  the paged-attention kernels against a torch baseline (GPU timings need a GPU)
    serve    the real engine against Hugging Face (and vLLM if installed) on one workload
    http     the OpenAI-compatible server under concurrent streaming clients
    disagg   prefill/decode interference, chunked prefill and disaggregation (simulated)

``python -m labkit.bench WHAT --help`` shows each one's options.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = ("memory", "sim", "kernels", "serve", "http", "disagg")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    what, rest = argv[0], argv[1:]
    if what not in COMMANDS:
        print(f"unknown benchmark {what!r}; choose from: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(f"labkit.bench.{what}")
    except ModuleNotFoundError as e:
        if e.name == f"labkit.bench.{what}":
            print(f"the {what!r} benchmark is not available in this version of labkit", file=sys.stderr)
            return 2
        raise
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
