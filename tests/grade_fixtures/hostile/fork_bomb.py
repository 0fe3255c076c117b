"""Attack (mine): fork until something gives. Must: the guard stops this sandbox when its
processes and threads pass the limit; the machine and the other rows are untouched."""
# where: start
import os
import time

for _ in range(100_000):
    if os.fork() == 0:
        time.sleep(600)                  # LABKIT-HOSTILE
        os._exit(0)
