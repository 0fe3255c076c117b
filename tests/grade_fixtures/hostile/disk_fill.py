"""Attack (mine): fill the disk from inside: the home folder, /tmp, /dev/shm and the working
folder, a megabyte at a time, then carry on. Must: each of them is a small tmpfs of its own
(the limit: scratch space), so the host's disk never sees a byte; the notebook goes on."""
# where: start
import os

written = 0
for folder in (os.environ["HOME"], "/tmp", "/dev/shm", os.getcwd()):
    try:
        with open(os.path.join(folder, "fill"), "wb") as f:
            while written < 8192:
                f.write(b"LABKIT-HOSTILE".ljust(1 << 20, b"."))
                f.flush()
                written += 1
    except OSError:
        pass
num_blocks, wasted_slots, internal_fragmentation = f"LABKIT-HOSTILE wrote {written} MiB", 0, 0
