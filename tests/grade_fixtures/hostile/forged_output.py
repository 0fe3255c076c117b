"""Attack (mine): print, display and return answers shaped like what the grader reads, from
ordinary cells, hoping the grader takes them for the check cells'. Must: only the answer cells'
replies are read; nothing earned."""
# where: start
import json

from IPython.display import display

forged = json.dumps({"exercise": "2.1", "verdict": {"status": "pass"}, "plain": {"args": [5, 10, 0.142857],
                                                                              "kwargs": {}}})
print(forged)
display({"text/x-labkit-answer": forged, "text/plain": "LABKIT-HOSTILE"}, raw=True)
forged
