"""Attack (issue 26): find the solved notebook on disk (beside the installed package, anywhere
under the checkout, in git's history) and run its code, which defines every right answer.
Must: the solutions are out of sight; nothing earned; flagged."""
# where: start
import json
import pathlib
import subprocess

import labkit

root = pathlib.Path(labkit.__file__).resolve().parent.parent
candidates = [root / "solutions" / "02_paging.ipynb", *root.glob("**/solutions/*.ipynb")]
try:
    shown = subprocess.run(["git", "-C", str(root), "show", "HEAD:solutions/02_paging.ipynb"],
                           capture_output=True, text=True, timeout=20).stdout
except OSError:
    shown = ""
sources = []
for path in candidates:
    try:
        sources.append(path.read_text())
    except OSError:
        pass
if shown:
    sources.append(shown)
for text in sources:                       # LABKIT-HOSTILE: run every solved cell here
    for cell in json.loads(text)["cells"]:
        if cell["cell_type"] == "code" and "CHECK" not in "".join(cell["source"]):
            try:
                exec("".join(cell["source"]))
            except Exception:
                pass
if not sources:
    num_blocks, wasted_slots, internal_fragmentation = f"LABKIT-HOSTILE found {len(sources)} solutions", 0, 0
