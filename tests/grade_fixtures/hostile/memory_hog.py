"""Attack (mine): several processes, each under the per-process memory limit, that together hold
more than the notebook's limit. Must: the guard stops the sandbox ("used more than ... of
memory"); nobody else is touched."""
# where: start
import os
import time

for _ in range(4):
    if os.fork() == 0:
        blob = b"\1" * (600 << 20)       # LABKIT-HOSTILE: touched, so it is resident
        time.sleep(600)
        os._exit(0)
time.sleep(600)
