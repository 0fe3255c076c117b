"""Attack (mine): the one host folder a sandbox may write is its kernel's connection folder (the
Jupyter sockets): fill it. Must: the guard stops the sandbox at once ("wrote into its kernel's
connection folder"); the host's disk keeps at most a few MiB, removed with the folder."""
# where: start
import os
import sys

connection = next(arg for arg in sys.argv if arg.endswith(".json"))
folder = os.path.dirname(connection)
with open(os.path.join(folder, "fill"), "wb") as f:
    for _ in range(4096):
        f.write(b"LABKIT-HOSTILE".ljust(1 << 20, b"."))
        f.flush()
