"""labkit's C++ CPU kernels, compiled once on this machine, at setup.

Production CPU engines (vLLM's CPU build, IPEX) run attention in hand-written C++; so does
labkit's ``cpu`` backend when it can. The sources are in ``kernels/csrc/``; torch's
extension builder (``torch.utils.cpp_extension.load``) compiles them with this machine's
C++ compiler, for this machine's CPU (``-march=native``: AVX-512 where there is AVX-512),
into ``~/.cache/torch_extensions`` (or ``$TORCH_EXTENSIONS_DIR``), where every later
process, notebook kernel and test run loads the build in well under a second.

``make setup`` (so ``make lab`` and ``make test``) compiles them, with ``python -m labkit
kernels``, so that no notebook cell waits on a compiler. Compiling takes ~2 min of CPU time:
about :data:`COMPILE_TIME` on 2 idle cores, several times that on a busy machine; a
progress line counts the seconds meanwhile (:class:`labkit.utils.Stopwatch`). Where setup
did not run (Colab, a wheel), the first use compiles them the same way, once. The build is
named after a hash of the sources (headers included), the flags, torch's version and the
CPU's feature flags, so an edit, an upgrade or another machine kind gets its own build,
never a stale one; and a library of that name is imported as it is, from any checkout or
any copy of the build folder, without asking ninja (whose check looks at paths and times).

The kernels run on torch's own OpenMP thread pool (``at::parallel_for``), the pool its
matrix multiplies use: one pool for the whole forward pass.

Builds are serialized by an advisory lock (``fcntl.flock``) on a file beside the build
directory. The operating system drops that lock when its holder dies, so a build killed
half-way (Ctrl-C, a CI timeout) cannot block later ones: torch's own ``lock`` file, which
such a build leaves behind and which torch waits on forever, is known to be stale whenever
labkit holds its lock, and is removed with a note.

Nothing here is required: without a compiler (or ninja, or OpenMP), or with
``LABKIT_CPU_EXTENSION=0``, :func:`load` returns None and says why (:func:`status`), and
the ``cpu`` backend uses its Numba kernel instead.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from labkit.utils import Stopwatch

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(CSRC / name for name in ("paged_decode_attention.cpp", "fused_ops.cpp", "bindings.cpp"))
# Measured: python -m labkit kernels on an empty cache, 2 cores at load average 10-30: 334, 482
# and 646 s (119-157 s of CPU time). Said before compiling, so that a first run is not
# mistaken for a hang.
COMPILE_TIME = "about 2 min of CPU time: 1-2 min on 2 idle cores, 5-11 min measured on a busy 2-core machine"

_lock = threading.Lock()
_module: ModuleType | None = None
_reason: str | None = None  # why there is no module, once load() has failed


def _cflags() -> list[str]:
    arch = "-mcpu=native" if platform.machine() in ("aarch64", "arm64") else "-march=native"
    # -ffast-math lets the compiler reorder fp32 sums into SIMD lanes, as any vector kernel does
    return ["-O3", arch, "-ffast-math", "-fopenmp", "-DNDEBUG"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build_name() -> str:
    """The build's name: changes with the sources, flags, torch version and CPU features."""
    import torch
    h = hashlib.sha256()
    for src in _source_files():
        h.update(src.name.encode() + src.read_bytes())
    h.update(" ".join(_cflags()).encode() + torch.__version__.encode() + _cpu_flags().encode())
    return "labkit_cpu_" + h.hexdigest()[:12]


def _source_files() -> list[Path]:
    """Every file the build reads from ``csrc/``: the compiled sources and the headers they include."""
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".h", ".hpp"))


def _library(name: str, build_dir: Path) -> Path:
    return build_dir / f"{name}{'.pyd' if sys.platform == 'win32' else '.so'}"   # torch's LIB_EXT


def _import_built(name: str, build_dir: Path) -> ModuleType | None:
    """The library built before, imported as it is, or None where there is none (or it does
    not import: a link cut short). Its name is a hash of everything it was built from, so a
    library of that name is this build: no need to ask ninja, whose up-to-date check looks at
    source paths and times (another checkout, a copy of the build folder in a grader's
    sandbox, a touched file) and would compile again for nothing."""
    import importlib.util
    library = _library(name, build_dir)
    if not library.exists():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError):
        return None
    return module


def _why_not() -> str | None:
    """A reason not to try compiling at all, or None."""
    if os.environ.get("LABKIT_CPU_EXTENSION", "1").strip().lower() in ("0", "false", "no", "off"):
        return "disabled by LABKIT_CPU_EXTENSION=0"
    if sys.platform == "win32":
        return "not built on Windows (torch's extension builder needs MSVC there)"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH)"
    from torch.utils.cpp_extension import is_ninja_available
    if not is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


@contextmanager
def _build_lock(build_dir: Path):
    """Hold the one-builder-at-a-time lock for ``build_dir``; while it is held, no labkit
    process is compiling there, so a torch ``lock`` file inside is a dead build's leftover."""
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no flock, and no build either (see _why_not)
        yield
        return
    with open(build_dir.with_name(build_dir.name + ".labkit-lock"), "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:        # another process is building: wait, saying so
            with Stopwatch("labkit: waiting for another process compiling the C++ CPU kernels"):
                fcntl.flock(f, fcntl.LOCK_EX)  # freed when it finishes, or dies
        try:
            clear_stale_lock(build_dir)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def clear_stale_lock(build_dir: Path) -> bool:
    """Remove torch's ``lock`` file from ``build_dir`` (call only under :func:`_build_lock`):
    a build interrupted mid-compile leaves it, and torch would wait on it forever."""
    stale = build_dir / "lock"
    if not stale.exists():
        return False
    stale.unlink(missing_ok=True)
    print(f"labkit: removed {stale}, left by a build that was interrupted",
          file=sys.stderr, flush=True)
    return True


def load(verbose: bool = False) -> ModuleType | None:
    """The compiled module, building it on first use; None (see :func:`status`) when it
    cannot be built here. Thread-safe; tried once per process."""
    global _module, _reason
    with _lock:
        if _module is not None or _reason is not None:
            return _module
        _reason = _why_not()
        if _reason is not None:
            return None
        from torch.utils.cpp_extension import load as build
        name = build_name()
        build_dir = build_directory(name)
        try:
            _module = _import_built(name, build_dir)     # built already (by make setup): no lock, no ninja
            if _module is not None:
                return _module
            with _build_lock(build_dir):
                _module = _import_built(name, build_dir)  # built meanwhile by the process we waited for
                if _module is None:
                    print(f"labkit: compiling its C++ CPU kernels for this CPU, once ({COMPILE_TIME}); "
                          "`make setup` does this ahead of time", file=sys.stderr, flush=True)
                    with Stopwatch("labkit: compiling the C++ CPU kernels"):
                        _module = build(name, [str(src) for src in SOURCES], extra_cflags=_cflags(),
                                        extra_ldflags=["-fopenmp"], verbose=verbose)
        except Exception as e:  # a compiler without OpenMP, a broken toolchain...
            first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            _reason = f"compiling failed ({first[:200]})"
            print(f"labkit: C++ CPU kernels unavailable, using the Numba kernel: {_reason}",
                  file=sys.stderr, flush=True)
        return _module


def build_directory(name: str | None = None) -> Path:
    """Where the build named ``name`` (default: this machine's, :func:`build_name`) lives."""
    from torch.utils.cpp_extension import _get_build_directory
    return Path(_get_build_directory(name or build_name(), verbose=False))


def is_built(name: str | None = None) -> bool:
    """Whether this machine's build exists (loading it then compiles nothing)."""
    name = name or build_name()
    return _library(name, build_directory(name)).exists()


def status() -> tuple[bool, str]:
    """(available, a sentence saying what is used and why)."""
    if load() is not None:
        return True, "C++ kernels compiled for this CPU"
    return False, f"C++ kernels unavailable: {_reason}"
