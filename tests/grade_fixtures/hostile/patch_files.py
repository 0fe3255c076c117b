"""Attack (issue 26): append a pass-everything grader to labkit's grader modules through the
installed (editable) package, and plant code in site-packages (sitecustomize.py, a .pth file),
the solutions, the notebooks and the Makefile. Must: every write fails (read-only or out of
sight), the checkout is byte-identical afterwards, and the row earns nothing."""
# where: start
import pathlib
import site

import labkit
import labkit.exercises

MARK = "\n# LABKIT-HOSTILE\ndef check_exercise_2(*args, **kwargs):\n    print('✓')\n"
package = pathlib.Path(labkit.exercises.__file__).parent
root = pathlib.Path(labkit.__file__).resolve().parent.parent
targets = [*package.glob("*.py"), pathlib.Path(labkit.__file__), root / "solutions" / "02_paging.ipynb",
           root / "notebooks" / "02_paging.ipynb", root / "Makefile"]
for folder in site.getsitepackages():
    targets += [pathlib.Path(folder) / "sitecustomize.py", pathlib.Path(folder) / "labkit-hostile.pth"]
written = []
for target in targets:
    try:
        with open(target, "a") as f:
            f.write(MARK)
        written.append(target.name)
    except OSError:
        pass
print("written:", written)
