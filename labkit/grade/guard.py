"""The limits a sandbox cannot set on itself, watched from outside: one thread for the class.

Every ``PERIOD`` seconds the guard reads ``/proc`` once and, for each kernel it watches, adds
up what the sandbox's processes hold: memory (proportional set size, so that the pages a forked
child shares with its parent count once; resident size where that cannot be read), processes
and threads. It also checks
the notebook's wall time, what its cells printed (counted by ``execute``) and its connection
folder (the one host folder a sandbox may write: only the kernel's sockets belong there). A
kernel over a limit is killed, with every process of its sandbox (SIGKILL to its process
group; the sandbox's init dies with it and takes the namespace's processes along), and the
reason is kept for the row. Per-process rlimits (``sandbox.Limits``) stop a single allocation
before the guard sees it; the guard catches what adds up.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .sandbox import Limits

PERIOD = 0.25
CONN_BYTES = 1 << 20        # a connection file and six sockets take a few hundred bytes
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(slots=True, eq=False)
class Watch:
    """One kernel under watch: its launcher's pid (the root of its process tree), its limits,
    and what the run reports (``printed`` bytes); ``reason`` is set once it is stopped."""
    pid: int
    limits: Limits
    conn: Path
    started: float = field(default_factory=time.monotonic)
    printed: int = 0
    reason: str | None = None
    peak_mb: float = 0.0

    def stop(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        for kill in (lambda: os.killpg(self.pid, signal.SIGKILL), lambda: os.kill(self.pid, signal.SIGKILL)):
            try:
                kill()
            except (ProcessLookupError, PermissionError):
                pass


def _processes() -> dict[int, tuple[int, int, int]]:
    """pid -> (parent pid, resident bytes, threads), for every process on this machine."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()      # after "(comm)", which may hold spaces
        table[int(name)] = (int(fields[1]), int(fields[21]) * PAGE, int(fields[17]))
    return table


def _memory(pid: int, resident: int) -> int:
    """``pid``'s proportional set size in bytes (its resident size if that is unreadable)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resident


def _tree(root: int, table: dict[int, tuple[int, int, int]]) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            out.append(pid)
            todo += children.get(pid, [])
    return out


def _folder_bytes(path: Path, limit: int) -> int:
    total = 0
    for folder, dirs, files in os.walk(path):
        total += 4096 * (len(dirs) + len(files))
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
        if total > limit:
            break
    return total


class Guard:
    """Watches kernels (``watch``/``forget``) from a daemon thread until ``close``."""

    def __init__(self, period: float = PERIOD):
        self._watches: set[Watch] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._can_read = os.path.isdir("/proc")
        self._thread = threading.Thread(target=self._loop, args=(period,), name="labkit-guard", daemon=True)
        self._thread.start()

    def watch(self, pid: int, limits: Limits, conn: Path) -> Watch:
        w = Watch(pid, limits, conn)
        with self._lock:
            self._watches.add(w)
        return w

    def forget(self, w: Watch) -> None:
        with self._lock:
            self._watches.discard(w)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)

    def check(self, w: Watch, table: dict | None) -> None:
        """One look at ``w``; stops it if a limit is passed."""
        lim = w.limits
        if time.monotonic() - w.started > lim.wall_s:
            w.stop(f"ran past the notebook's {lim.wall_s:g} s limit")
        elif w.printed > lim.output_mb << 20:
            w.stop(f"printed more than {lim.output_mb} MiB")
        elif _folder_bytes(w.conn, CONN_BYTES) > CONN_BYTES:
            w.stop("wrote into its kernel's connection folder")
        elif table is not None:
            pids = _tree(w.pid, table)
            threads = sum(table[p][2] for p in pids)
            if threads > lim.processes:
                w.stop(f"ran more than {lim.processes} processes and threads")
                return
            memory = sum(_memory(p, table[p][1]) for p in pids)
            w.peak_mb = max(w.peak_mb, memory / 2**20)
            if memory > lim.memory_mb << 20:
                w.stop(f"used more than {lim.memory_mb} MiB of memory")

    def _loop(self, period: float) -> None:
        while not self._closed.wait(period):
            with self._lock:
                watches = [w for w in self._watches if w.reason is None]
            if not watches:
                continue
            table = _processes() if self._can_read else None
            for w in watches:
                try:
                    self.check(w, table)
                except Exception:   # noqa: BLE001 - the guard must outlive any one odd process
                    pass
