"""How the OpenMP threads behind torch wait for work: set before torch loads.

torch runs its matrix multiplies, and labkit's C++ kernels, on one OpenMP thread pool. Between
two parallel regions, GNU OpenMP's idle threads spin (by default ~300,000 rounds) before they
sleep. On a quiet machine that saves a wake-up; on a busy one (a student's laptop with a
browser, a second notebook, a compile) a spinning thread holds a core that the thread it waits
for needs, and a step takes many times longer.

``GOMP_SPINCOUNT=1000`` makes an idle thread spin briefly, then sleep. Measured with
``python -m labkit.bench serve --engines labkit --contend`` (fp32, 64-request workload, one
competing busy process on the 2-core development machine), output tok/s quiet / contended:

=========================  =======  =========  =================
setting                    quiet    contended  contended / quiet
=========================  =======  =========  =================
torch's default            184.0    69.2       0.38
GOMP_SPINCOUNT=10000       185.5    77.6       0.42
GOMP_SPINCOUNT=1000        196.0    106.8      0.55
OMP_WAIT_POLICY=PASSIVE    174.6    114.3      0.65
=========================  =======  =========  =================

1000 keeps the quiet speed (within run-to-run noise) and most of PASSIVE's gain under load;
PASSIVE costs ~5-10% on a quiet machine. The runtime reads these variables once, when torch
loads it: so ``import labkit`` sets the default before anything imports torch, and does
nothing when torch is already loaded, or when the user chose (``OMP_WAIT_POLICY`` or
``GOMP_SPINCOUNT`` set), or when ``LABKIT_GOMP_SPINCOUNT=default`` asks to leave OpenMP alone
(``LABKIT_GOMP_SPINCOUNT=N`` sets another count).

Where labkit came too late, the setting still reaches every process started afterwards that
inherits this environment, which is how it holds whatever the import order in the lab:
``make lab``'s Jupyter server imports labkit (``.jupyter/jupyter_server_config.py``), so
every kernel it starts has ``GOMP_SPINCOUNT`` before its first cell; the test suite's and the
grader's kernels inherit it from their parent the same way. A script that imports torch
first cannot be fixed from inside: ``LLM()`` then says so once (:func:`warn_if_too_late`),
with what to do. Chapter 00's chat request (27 tokens, one competing busy process, load
average 9-20 from other work): 10.5-14.1 s from a script importing labkit first, 166-195 s
from one importing torch first, 10.4-12.8 s in a ``make lab`` kernel whose code imports
torch first.
"""

from __future__ import annotations

import os
import sys
import warnings

DEFAULT_SPIN_COUNT = "1000"
set_by_labkit: str | None = None  # what configure_openmp_wait put in os.environ, if anything
too_late = False  # import labkit found torch loaded, with nothing chosen: the spin is torch's default
_warned = False

TOO_LATE_MESSAGE = (
    "labkit: torch was imported before labkit, so OpenMP's threads spin at torch's default while they "
    "wait; on a busy machine (a browser, another notebook) each step can take several times longer. "
    "Import labkit before torch (make `import labkit` the first import of the notebook or script and "
    "restart it), or start Python with GOMP_SPINCOUNT={count} set (`make lab` does this for its "
    "notebooks). LABKIT_GOMP_SPINCOUNT=default silences this.")


def configure_openmp_wait(environ=os.environ, modules=sys.modules) -> str | None:
    """Set ``GOMP_SPINCOUNT`` for this process unless it is too late (torch is loaded) or the
    user decided. Returns the value set, or None when nothing was changed."""
    wanted = environ.get("LABKIT_GOMP_SPINCOUNT", DEFAULT_SPIN_COUNT).strip()
    if wanted.lower() in ("", "default", "off"):
        return None
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return None
    if "torch" in modules:
        if environ is os.environ:
            global too_late
            too_late = True
        return None
    if not wanted.isdigit():
        raise ValueError(f"LABKIT_GOMP_SPINCOUNT must be a whole number of spins or 'default', got {wanted!r}")
    environ["GOMP_SPINCOUNT"] = wanted
    if environ is os.environ:
        global set_by_labkit
        set_by_labkit = wanted
    return wanted


def warn_if_too_late(num_threads: int) -> bool:
    """Say once per process, as a warning, that OpenMP started with torch's default spin
    (``import labkit`` came after ``import torch`` and nothing was chosen), and what to do.
    Silent with one thread (nothing spins), and after ``LABKIT_GOMP_SPINCOUNT=default``.
    Returns whether it warned now."""
    global _warned
    if _warned or not too_late or num_threads < 2 or not sys.platform.startswith("linux"):
        return False       # GOMP_SPINCOUNT is GNU OpenMP's: torch's runtime on Linux
    if os.environ.get("LABKIT_GOMP_SPINCOUNT", "").strip().lower() in ("default", "off"):
        return False
    _warned = True
    warnings.warn(TOO_LATE_MESSAGE.format(count=DEFAULT_SPIN_COUNT), RuntimeWarning, stacklevel=3)
    return True
