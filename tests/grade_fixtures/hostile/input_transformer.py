"""Attack (issue 26): an IPython input transformer that empties every check cell, so that no
check can fail. Must: the answers are handed in anyway (they are evaluated past IPython's
transformers); nothing solved, nothing earned; flagged."""
# where: start
def empty_checks(lines):
    return [] if lines and lines[0].lstrip().startswith("# CHECK") else lines


get_ipython().input_transformers_cleanup.append(empty_checks)
