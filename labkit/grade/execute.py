"""Run one notebook's cells the way ``pytest --nbval-lax`` does, in a sandboxed kernel.

Execution is nbclient's (nbval's engine), driven one cell at a time so that a cell that runs
past the timeout is interrupted and the run goes on with the next cell, and a kernel that dies
(``os._exit``, a crash, a limit) ends the run without losing what ran before it.

The kernel is ipykernel, started by ``sandbox.Sandbox.command``: its sockets are Unix sockets
in its connection folder (``transport="ipc"``: a sandbox has no network, so no TCP between the
grader and the kernel), interrupts are sent as messages (a signal would reach the sandbox's
launcher, not the kernel), no message larger than ``MAX_MESSAGE`` is accepted from it, and it
sends what cells print in pieces (``outstream``) so that all of it is counted. The outputs are
counted (``guard`` stops a notebook that prints too much) and dropped. An answer
cell runs nothing itself: its execute request carries the expression that hands its answers in
(``user_expressions``, evaluated by IPython with ``eval``, past any input or AST transformer a
notebook installed), and the value comes back in the reply, for the judge.
"""

from __future__ import annotations

import ast
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import zmq
from jupyter_client.manager import AsyncKernelManager
from jupyter_core.utils import run_sync
from nbclient import NotebookClient
from nbclient.exceptions import DeadKernelError

from .guard import Guard, Watch
from .probe import MAX_BYTES
from .sandbox import Sandbox

#: The error name a cell that ran past the timeout is recorded with.
TIMED_OUT = "CellTimeout"
#: After a timeout the kernel is interrupted; if it does not answer within this many
#: seconds (the student's code swallows KeyboardInterrupt, say), the run stops there.
INTERRUPT_GRACE_S = 15
MAX_MESSAGE = 16 << 20
OUTSTREAM = "labkit.grade.outstream.ChunkedOutStream"     # prints reach the grader in countable pieces


@dataclass(slots=True)
class Cell:
    """One cell of the run: its position in the submitted notebook (``index``), its code, and
    for an answer cell the exercise it hands in and the expression that hands it in."""
    index: int
    source: str
    exercise: str | None = None
    expression: str | None = None


@dataclass(slots=True)
class CellRun:
    """What happened to one cell of the run."""
    index: int                      # position in the submitted notebook (markdown cells count)
    error: tuple[str, str] | None = None    # (exception name, message) when it raised
    timed_out: bool = False
    exercise: str | None = None     # an answer cell's exercise


@dataclass(slots=True)
class Execution:
    """The cells that ran, in run order, what the answer cells handed in, and why the run
    stopped early, if it did (``stopped_at``: the run position it stopped in)."""
    cells: dict[int, CellRun] = field(default_factory=dict)
    answers: dict[str, list[str]] = field(default_factory=dict)
    stopped: str | None = None
    stopped_at: int | None = None
    limit: str | None = None        # the limit the guard stopped it for, if any
    peak_mb: float = 0.0


class SandboxedKernelManager(AsyncKernelManager):
    """ipykernel in ``box``, talking over Unix sockets in ``workdir/conn``."""

    def __init__(self, box: Sandbox, workdir: Path, job: int, **kwargs):
        super().__init__(kernel_name="python3", **kwargs)
        self.box, self.workdir, self.job = box, workdir, job
        conn = workdir / "conn"
        self.transport = "ipc"
        self.ip = str(conn / "k")
        self.connection_file = str(conn / "kernel.json")
        self.context.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)

    def format_kernel_cmd(self, extra_arguments=None) -> list[str]:
        self.kernel_spec.interrupt_mode = "message"
        argv = super().format_kernel_cmd(extra_arguments) + [f"--IPKernelApp.outstream_class={OUTSTREAM}"]
        env = self._launch_args.get("env") or {}
        return self.box.command(argv, self.workdir, env, self.job)

    def write_connection_file(self, **kwargs) -> None:
        super().write_connection_file(**kwargs)
        uid = self.box.uid(self.job)
        if uid is not None:
            os.chown(self.connection_file, uid, uid)

    def client(self, **kwargs):
        return super().client(context=self.context, **kwargs)      # its sockets capped too


class _Quiet(NotebookClient):
    """A client that keeps no outputs (verdicts come from the execute replies, and a cell
    printing in a loop must not fill the grader's memory), only counts them."""

    watch: Watch | None = None

    def output(self, outs, msg, display_id, cell_index):
        content = msg.get("content", {})
        data = content.get("data") or {}
        size = len(content.get("text") or "") + sum(len(v) if isinstance(v, str) else 64 for v in data.values())
        if self.watch is not None:
            self.watch.printed += size
        return None


def _answer(reply: dict) -> str | None:
    """The text an answer cell's expression returned, from its execute reply (None if none)."""
    said = (reply.get("user_expressions") or {}).get("answer")
    if not isinstance(said, dict) or said.get("status") != "ok":
        return None
    text = (said.get("data") or {}).get("text/plain")
    if not isinstance(text, str) or len(text) > 2 * MAX_BYTES:
        return None
    try:
        value = ast.literal_eval(text)          # the repr of a str: a literal, nothing to run
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, str) else None


def run_cells(cells: list[Cell], box: Sandbox, workdir: Path, timeout: float, *, guard: Guard, job: int = 0,
              env: dict[str, str], startup_timeout: float = 120, grace: float = INTERRUPT_GRACE_S) -> Execution:
    """Execute ``cells`` in order in a fresh kernel in ``box``; each gets ``timeout`` seconds,
    after which the kernel is interrupted and the run goes on (if it answers within ``grace``
    seconds). ``workdir``: this notebook's scratch folder on the host."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c.source) for c in cells])
    box.prepare(workdir, job)
    km = SandboxedKernelManager(box, workdir, job)
    cwd = workdir / "home" / "notebook" if box.kind == "none" else workdir     # (a sandbox sets its own)
    client = _Quiet(nb, km=km, timeout=timeout, allow_errors=True, interrupt_on_timeout=True,
                    startup_timeout=startup_timeout, record_timing=False,
                    error_on_timeout={"ename": TIMED_OUT, "evalue": f"ran past the {timeout:g} s timeout",
                                      "traceback": []},
                    resources={"metadata": {"path": str(cwd)}})
    replies: dict[int, dict] = {}
    client.on_cell_executed = lambda cell, cell_index, execute_reply: replies.__setitem__(
        cell_index, (execute_reply or {}).get("content", {}))
    run = Execution()
    watch = None
    expression: list[str | None] = [None]       # the current answer cell's, for its execute request
    try:
        # The kernel's own stdout/stderr (not the cells' output, which comes over ZMQ) is its
        # start-up chatter: kept off the grader's terminal.
        with client.setup_kernel(env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL):
            watch = client.watch = guard.watch(km.provisioner.pid, box.limits, workdir / "conn")
            execute = client.kc.execute

            def with_answer(code, *args, **kwargs):
                if expression[0] is not None:
                    kwargs["user_expressions"] = {"answer": expression[0]}
                return execute(code, *args, **kwargs)

            client.kc.execute = with_answer
            for k, (cell, source) in enumerate(zip(nb.cells, cells)):
                result = run.cells[k] = CellRun(source.index, exercise=source.exercise)
                expression[0] = source.expression
                try:
                    client.execute_cell(cell, k)
                except DeadKernelError:
                    result.error = ("DeadKernelError", "the kernel died")
                    run.stopped = (f"stopped in cell {source.index + 1}: it {watch.reason}" if watch.reason else
                                   f"the kernel died by cell {source.index + 1} (exit(), os._exit, a crash "
                                   "or out of memory)")
                    run.stopped_at, run.limit = k, watch.reason
                    break
                reply = replies.pop(k, {})
                if source.exercise is not None and (text := _answer(reply)) is not None:
                    run.answers.setdefault(source.exercise, []).append(text)
                if reply.get("status") == "error":
                    result.error = (str(reply.get("ename", "Error"))[:200], str(reply.get("evalue", ""))[:2000])
                    result.timed_out = result.error[0] == TIMED_OUT
                if watch.reason is not None:           # stopped for a limit, the reply already sent
                    run.stopped = f"stopped in cell {source.index + 1}: it {watch.reason}"
                    run.stopped_at, run.limit = k, watch.reason
                    break
                if result.timed_out and not _responsive(client, k, replies, grace, expression):
                    run.stopped, run.stopped_at = (f"cell {source.index + 1} ran past the timeout and the kernel "
                                                   "did not stop when interrupted"), k
                    break
    finally:
        _end_kernel(client, km)
        if watch is not None:
            guard.forget(watch)
            run.peak_mb = watch.peak_mb
    return run


def _end_kernel(client: NotebookClient, km: SandboxedKernelManager) -> None:
    """Kill the run's kernel and its sandbox now. nbclient leaves running a kernel that it did
    not start itself, and one deaf to interrupts would spin on, taking CPU from every notebook
    graded after it. The client's channels stop first: the manager's cleanup closes the ZMQ
    context their threads still read from."""
    if client.kc is not None:
        client.kc.stop_channels()
        client.kc = None
    if km.has_kernel:
        run_sync(km.shutdown_kernel)(now=True)


def _responsive(client: NotebookClient, index: int, replies: dict[int, dict], grace: float,
                expression: list | None = None) -> bool:
    """Whether the kernel, interrupted after a timeout, runs a trivial cell within the grace
    period (code that swallows KeyboardInterrupt keeps it busy: the run must stop then)."""
    if expression is not None:
        expression[0] = None
    timeout, client.timeout = client.timeout, grace
    try:
        client.execute_cell(nbformat.v4.new_code_cell("pass"), index)
        return replies.pop(index, {}).get("ename") != TIMED_OUT
    except DeadKernelError:
        return False
    finally:
        client.timeout = timeout
