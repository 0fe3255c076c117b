"""Attack (mine): look for what a student should never see: the instructor's secrets in the
environment, other students' submissions and kernels, the solutions, the grader's files, the
network. It hands in what it found as its answer to 2.1 (the row shows it in the grader's hint).
Must: it finds nothing (its own connection folder aside: the sandbox shows it at its host path)."""
# where: start
import os
import socket
import sys

found = [k for k, v in os.environ.items() if "LABKIT-HOSTILE-secret" in v or k == "INSTRUCTOR_TOKEN"]
own = os.path.dirname(os.path.dirname(next(a for a in sys.argv if a.endswith(".json"))))
for top in ("/", "/tmp", "/root", "/home", "/work", "/srv", "/mnt", "/opt", "/var"):
    for folder, dirs, files in os.walk(top):
        if folder.startswith(("/proc", "/sys", "/usr", "/etc", "/dev")) or folder.count("/") > 5:
            dirs[:] = []
            continue
        if folder.startswith(own):
            continue
        found += [os.path.join(folder, f) for f in files if f.endswith(".ipynb") or f.startswith("alice")]
        found += [os.path.join(folder, d) for d in dirs if d.startswith(("alice", "solutions", ".git"))
                  or folder.startswith("/tmp/labkit-grade") and not own.startswith(os.path.join(folder, d))]
try:
    socket.create_connection(("1.1.1.1", 53), timeout=2).close()
    found.append("network")
except OSError:
    pass
num_blocks, wasted_slots, internal_fragmentation = "LABKIT-HOSTILE found " + (", ".join(found[:3]) or "nothing"), 0, 0
