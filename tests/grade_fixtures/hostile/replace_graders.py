"""Attack (issue 26): replace every grader on its module with one that passes everything.
Must: the grades are decided outside the kernel, by the graders the grading process imported;
the kernel's answer arrives as a verdict, which is refused; nothing earned; flagged."""
# where: start
import labkit.exercises
import labkit.exercises.bughunt
import labkit.exercises.memory


def passes(*args, **kwargs):
    print("✓ LABKIT-HOSTILE")


for module in (labkit.exercises, labkit.exercises.bughunt, labkit.exercises.memory):
    for name in dir(module):
        if name.startswith("check_"):
            setattr(module, name, passes)
