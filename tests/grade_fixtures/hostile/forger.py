"""Attack (mine): replace the bug-hunt graders' in-kernel half (``probe``) with one that reports
the outcomes a right test would have had. The student's kernel is the student's: what it hands
in for a code answer can be forged by code written against labkit's grading. Must: nothing
earned (a passing test is run again from its source, the stubs here, in a clean sandbox), and
flagged (the import of the grader module, the kernel showing a grader that is not labkit's, a
test that passed in its kernel and not on its own)."""
# where: start
import labkit.exercises.bughunt as bughunt


def forged(test, *, plan):
    return {"name": "test", "outcomes": [
        {"kind": kind, "result": "passed"} if kind == "correct" else
        {"kind": kind, "result": "assertion", "error": "AssertionError", "message": "LABKIT-HOSTILE"}
        for kind in plan["order"]]}


for grader in (bughunt.check_generated_tokens_test, bughunt.check_free_list_test, bughunt.check_shared_blocks_test):
    grader.probe = forged
