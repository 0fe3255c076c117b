"""Grade a class's notebooks into a gradebook: ``python -m labkit.grade SUBMISSIONS``.

Every submitted notebook runs top to bottom in a fresh kernel (nbclient, the engine under
``pytest --nbval-lax``), in a scratch folder of its own, with a per-cell timeout. Each
``# CHECK exercise X.Y`` cell becomes that exercise's result (pass, fail with the grader's
hint, not attempted, not run), weighted by ``labkit.exercises.points``; integrity checks
(edited check cells, graders' internals, timeouts, unknown notebooks) become flags. The
result is one row per student and notebook, as CSV, HTML and a summary on the terminal.

Modules, in the order a submission meets them: ``collect`` (who handed in what), ``notebook``
(one submission: check cells restored, integrity, verdicts), ``integrity`` (what the
student's code imports), ``execute`` (the kernel), ``run`` (the class, N at a time),
``report`` (CSV, HTML, terminal). See docs/grading.md.
"""

from .collect import Submission, collect
from .notebook import FAIL, NOT_ATTEMPTED, NOT_RUN, PASS, Result, Row
from .report import csv_text, html_text, summary
from .run import Gradebook, grade_class

__all__ = ["grade_class", "Gradebook", "Row", "Result", "Submission", "collect", "csv_text",
           "html_text", "summary", "PASS", "FAIL", "NOT_ATTEMPTED", "NOT_RUN"]
