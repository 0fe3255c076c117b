"""Run one notebook the way ``pytest --nbval-lax`` does: a fresh kernel, every code cell in
order, a cell failing only by raising.

Execution is nbclient's (nbval's engine), driven one cell at a time so that a cell that runs
past the timeout is interrupted and the run goes on with the next cell, and a kernel that dies
(``os._exit``, a crash, out of memory) ends the run without losing what ran before it. The
kernel starts in ``workdir``, a scratch copy made for this one submission: a notebook that
deletes or writes files touches nothing of anyone else's.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import DeadKernelError

#: The error name a cell that ran past the timeout is recorded with.
TIMED_OUT = "CellTimeout"
#: After a timeout the kernel is interrupted; if it does not answer within this many
#: seconds (the student's code swallows KeyboardInterrupt, say), the run stops there.
INTERRUPT_GRACE_S = 15


@dataclass(slots=True)
class CellRun:
    """What happened to one code cell."""
    index: int                      # position in the notebook (markdown cells count)
    error: tuple[str, str] | None = None    # (exception name, message) when it raised
    timed_out: bool = False


@dataclass(slots=True)
class Execution:
    """The cells that ran, in order, and why the run stopped early, if it did."""
    cells: dict[int, CellRun] = field(default_factory=dict)
    stopped: str | None = None      # e.g. "the kernel died in cell 12"
    stopped_at: int | None = None   # the cell it stopped in; later cells never ran


class _Quiet(NotebookClient):
    """A client that keeps no outputs: verdicts come from the execute replies, and a cell
    printing in an endless loop until the timeout must not fill the grader's memory."""

    def output(self, outs, msg, display_id, cell_index):
        return None


def kernel_env(jobs: int) -> dict[str, str]:
    """The kernels' environment: this one, with OpenMP threads sharing the cores between
    ``jobs`` parallel kernels and waiting passively (spinning threads make a busy machine
    10-20x slower)."""
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, jobs))))
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    return env


def run_notebook(nb: nbformat.NotebookNode, workdir: Path, timeout: float, *,
                 env: dict[str, str] | None = None, kernel_name: str = "python3",
                 startup_timeout: float = 120, grace: float = INTERRUPT_GRACE_S) -> Execution:
    """Execute ``nb`` in a fresh kernel started in ``workdir``; each code cell gets ``timeout``
    seconds, after which nbclient interrupts the kernel and the run goes on (if the kernel
    answers within ``grace`` seconds)."""
    replies: dict[int, dict] = {}
    client = _Quiet(nb, timeout=timeout, kernel_name=kernel_name, allow_errors=True,
                    interrupt_on_timeout=True, startup_timeout=startup_timeout, record_timing=False,
                    error_on_timeout={"ename": TIMED_OUT, "evalue": f"ran past the {timeout:g} s timeout",
                                      "traceback": []},
                    resources={"metadata": {"path": str(workdir)}})
    client.on_cell_executed = lambda cell, cell_index, execute_reply: replies.__setitem__(
        cell_index, (execute_reply or {}).get("content", {}))
    run = Execution()
    # The kernel's own stdout/stderr (not the cells' output, which comes over ZMQ) is its
    # start-up chatter: kept off the grader's terminal.
    with client.setup_kernel(env=env or kernel_env(1), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL):
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code" or not cell.source.strip():
                continue
            result = run.cells[index] = CellRun(index)
            try:
                client.execute_cell(cell, index)
            except DeadKernelError:
                result.error = ("DeadKernelError", "the kernel died")
                run.stopped, run.stopped_at = (f"the kernel died by cell {index + 1} (exit(), os._exit, "
                                               "a crash or out of memory)"), index
                break
            reply = replies.pop(index, {})
            if reply.get("status") == "error":
                result.error = (reply.get("ename", "Error"), reply.get("evalue", ""))
                result.timed_out = result.error[0] == TIMED_OUT
            if result.timed_out and not _responsive(client, index, replies, grace):
                run.stopped, run.stopped_at = (f"cell {index + 1} ran past the timeout and the kernel "
                                               "did not stop when interrupted"), index
                break
    return run


def _responsive(client: NotebookClient, index: int, replies: dict[int, dict], grace: float) -> bool:
    """Whether the kernel, interrupted after a timeout, runs a trivial cell within the grace
    period (code that swallows KeyboardInterrupt keeps it busy: the run must stop then)."""
    timeout, client.timeout = client.timeout, grace
    try:
        client.execute_cell(nbformat.v4.new_code_cell("pass"), index)
        return replies.pop(index, {}).get("ename") != TIMED_OUT
    except DeadKernelError:
        return False
    finally:
        client.timeout = timeout
