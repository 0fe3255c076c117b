"""Attack (issue 26): a child detached with setsid kills every process it can, over and over,
for the rest of the grading run (in the old grader it killed the other students' kernels).
Must: it kills only its own kernel; every other row is as if it did not exist."""
# where: start
import subprocess
import time

subprocess.Popen(["setsid", "sh", "-c", "while :; do kill -9 -1; sleep 0.2; done # LABKIT-HOSTILE"],
                 start_new_session=True)
time.sleep(5)
