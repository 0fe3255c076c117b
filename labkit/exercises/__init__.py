"""Exercise graders: one function per exercise, called from the notebooks' check cells.

A grader raises ``AssertionError`` with a hint that teaches on a wrong answer and prints a
one-line verdict on a right one, and answers every other input (None, a wrong type, a
stub that still raises) with a hint too; expected values come from the real engine, and a
verdict depends only on the grader's arguments (see ``_grading`` for the rules every grader
keeps: one rounding rule, hints that diagnose and never navigate, plain-data arguments).
``memory`` grades the PagedAttention lesson's three exercises (this lab's 1.3, 2.1 and
3.3), ``engine`` the engine arithmetic of chapters 0, 1, 3 and 6, ``bughunt`` chapter 2's
tests, ``batching`` chapter 4, ``kernels`` chapter 5, ``sampling`` chapter 6's sampling
exercise (6.3), ``disagg`` chapter 7, ``serving`` chapter 8, ``beams`` chapter 9 (beam search
on shared blocks and swapping), ``prefix`` chapter 10 (prefix caching by hashes and by a
radix tree), ``speculative`` chapter 11 (speculative decoding on the block table),
``structured`` chapter 12 and ``tiers`` chapter 13 (a quantized KV cache, a host tier). Each
grader module's ``answer_forms()`` lists what would give its answers away.

Importing this package in a notebook's kernel makes a check cell whose answer variables are
not defined yet say "not answered yet" and name them, instead of raising a ``NameError``
(``_grading.install_unanswered_hook``).
"""

from ._grading import install_unanswered_hook
from .memory import (SHARING_STATEMENTS, SharedPromptCounts, check_exercise_1, check_exercise_2,
                     check_exercise_3, shared_prompt_counts)

install_unanswered_hook()

__all__ = ["check_exercise_1", "check_exercise_2", "check_exercise_3", "SHARING_STATEMENTS",
           "SharedPromptCounts", "shared_prompt_counts"]
