"""Attack (issue 26): signal the grader's own process (in the old grader this ended the run with
no gradebook): every process it can find but itself gets SIGKILL, then its parent SIGTERM; it
hands in how many processes it could list, and how many task ids it could reach at all, as its
answer to 2.1. Must: the run goes on; it saw only its own sandbox (its kernel and the sandbox's
init; the task ids are their threads)."""
# where: start
import os
import signal

listed = [int(p) for p in os.listdir("/proc") if p.isdigit()]
seen = list(listed)
for pid in listed:
    if pid not in (os.getpid(), 1):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
for pid in range(2, 50_000):                     # pids it cannot list: probe them blindly
    if pid not in seen:
        try:
            os.kill(pid, 0)
            seen.append(pid)
        except OSError:
            pass
try:
    os.kill(os.getppid(), signal.SIGTERM)
except OSError:
    pass
# Its answer to 2.1 says what it saw (the row shows it in the grader's hint).
num_blocks, wasted_slots, internal_fragmentation = f"LABKIT-HOSTILE saw {len(listed)} processes, {len(seen)} ids", 0, 0
