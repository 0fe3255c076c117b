"""Exercise graders: one function per exercise, called from the notebooks' check cells.

A grader raises ``AssertionError`` with a hint that teaches on a wrong answer and prints a
one-line verdict on a right one; expected values come from the real engine. One module
per chapter (``memory`` for exercises 1-3); ``_grading`` holds the shared helpers for
reading answers and comparing them "close enough", for the later chapters' graders too.
"""

from .memory import (SharedPromptCounts, check_exercise_1, check_exercise_2, check_exercise_3,
                     shared_prompt_counts)

__all__ = ["check_exercise_1", "check_exercise_2", "check_exercise_3",
           "SharedPromptCounts", "shared_prompt_counts"]
