"""Run another checkout's labkit, its kernels included: ``python -m labkit.bench.checkout DIR MODULE [ARGS]``.

A before and after in the same run needs both versions side by side: an older commit's files
(``git worktree add /tmp/old COMMIT``, or ``git archive``) and this one. Run from ``DIR``,
``python -m labkit`` finds ``DIR/labkit`` first on the path, but not ``DIR/kernels``, which is
``labkit.kernels`` only where an install maps it (pyproject's package-dir): this checkout's
editable install would answer instead, and the older Python would run the newer C++ kernels.
This runner puts a finder for ``labkit.kernels`` in front of every other, so that both halves
come from ``DIR``:

    python -m labkit.bench.checkout /tmp/old labkit.bench step --batch 8 --prefill 128
    python -m labkit.bench http --vs-vllm --labkit-src /tmp/old      # uses it for each server

(The kernels build of ``DIR`` has a name of its own, a hash of its sources: both builds live in
the extension cache side by side.)
"""

from __future__ import annotations

import os
import sys

# The bootstrap, as a program of its own: it must not import this checkout's labkit first.
BOOTSTRAP = """\
import importlib.abc, importlib.util, os, runpy, sys
src, module = os.path.abspath(sys.argv[1]), sys.argv[2]
class Kernels(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "labkit.kernels":
            kernels = os.path.join(src, "kernels")
            return importlib.util.spec_from_file_location(
                name, os.path.join(kernels, "__init__.py"), submodule_search_locations=[kernels])
sys.meta_path.insert(0, Kernels())
sys.path.insert(0, src)
sys.argv = [module, *sys.argv[3:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def command(src: str, module: str, *args: str) -> list[str]:
    """``python -m MODULE ARGS`` with ``src``'s labkit (and kernels), as a command line."""
    return [sys.executable, "-c", BOOTSTRAP, os.path.abspath(src), module, *args]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    src = argv[0]
    if not os.path.isdir(os.path.join(src, "labkit")) or not os.path.isdir(os.path.join(src, "kernels")):
        print(f"{src}: not a labkit checkout (no labkit/ and kernels/ folders)", file=sys.stderr)
        return 2
    os.execv(sys.executable, command(src, argv[1], *argv[2:]))


if __name__ == "__main__":
    sys.exit(main())
