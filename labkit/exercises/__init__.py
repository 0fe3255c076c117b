"""Exercise graders: one function per exercise, called from the notebooks' check cells.

A grader raises ``AssertionError`` with a hint that teaches on a wrong answer and prints a
one-line verdict on a right one, and answers every other input (None, a wrong type, a
stub that still raises) with a hint too; expected values come from the real engine.
``memory`` grades the PagedAttention lesson's three exercises (this lab's 1.3, 2.1 and
3.3), ``engine`` the engine arithmetic of chapters 0, 1, 3 and 6, ``bughunt`` chapter 2's
tests, ``sampling`` chapter 6's sampling exercise (6.3), and one module per later chapter
the rest (``beams``: chapter 9, beam search on shared blocks and swapping; ``prefix``:
chapter 10, prefix caching by hashes and by a radix tree).
``_grading`` holds the shared helpers
for reading answers (units exactly, shares, picks of statements) and comparing them.
Each grader module's ``answer_forms()`` lists what would give its answers away.
"""

from .memory import (SHARING_STATEMENTS, SharedPromptCounts, check_exercise_1, check_exercise_2,
                     check_exercise_3, shared_prompt_counts)

__all__ = ["check_exercise_1", "check_exercise_2", "check_exercise_3", "SHARING_STATEMENTS",
           "SharedPromptCounts", "shared_prompt_counts"]
