"""Small tools for exercise graders: read an answer, compare it, explain a wrong one.

Every grader in ``labkit.exercises`` follows one pattern:

1. compute the expected values from the real engine (allocator, scheduler, kernels), not
   from a hard-coded table, so that the exercise and the code can never disagree;
2. read the student's answer leniently (a fraction or a percent, MiB or GiB, a number or
   a string with a unit);
3. on a wrong answer, raise ``AssertionError`` whose message *teaches*: if the answer is a
   known mistake (dividing the wrong way round, forgetting a factor) say which; never print
   the expected value, so the student still has something to find;
4. on a right answer, print one line starting with a check mark that restates the result.

Notebook check cells call graders; ``pytest --nbval-lax`` fails a cell that raises, so a
wrong answer fails the notebook's test run whatever outputs the notebook stored.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Iterable, Mapping, NoReturn, Sequence

# A known mistake: the value it produces and what to say about it.
Mistake = tuple[float, str]

#: Memory units in MiB, for ``read_quantity`` (matched case-insensitively).
MEMORY_UNITS_MIB: dict[str, float] = {
    "B": 1 / 2**20, "KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0, "TiB": 1024.0**2,
    "KB": 1e3 / 2**20, "MB": 1e6 / 2**20, "GB": 1e9 / 2**20, "TB": 1e12 / 2**20,
}


def _unit(units: Mapping[str, float], name: str) -> str | None:
    """The key of ``units`` spelled ``name`` in any case."""
    lowered = name.lower()
    return next((u for u in units if u.lower() == lowered), None)


def fail(message: str) -> NoReturn:
    """Reject an answer: the message is all the student sees, so make it teach."""
    raise AssertionError(message)


def passed(message: str) -> None:
    """Accept an answer with a one-line verdict."""
    print(f"✓ {message}")


def fmt(x: float, digits: int = 4) -> str:
    """A number as a person would write it: 0.0488, 14.29, 500,000."""
    if isinstance(x, numbers.Integral) or float(x).is_integer() and abs(x) >= 1:
        return f"{int(x):,}"
    return f"{x:.{digits}g}"


def read_number(name: str, value: object) -> float:
    """``value`` as a float, or a failure that says what was expected.

    Accepts ints, floats, numpy scalars and numeric strings ("4.9", "1,000"); a string
    ending in ``%`` is returned as a percent number ("4.9%" -> 4.9). Rejects ``...``
    (the notebook's placeholder), None, bools, NaN and infinities.
    """
    if value is Ellipsis or value is None:
        fail(f"{name}: replace the `...` placeholder with your answer (a number).")
    if isinstance(value, bool):
        fail(f"{name}: expected a number, got {value!r}.")
    if isinstance(value, str):
        text = value.strip().replace(",", "").replace("_", "").rstrip("%").strip()
        try:
            value = float(text)
        except ValueError:
            fail(f"{name}: expected a number, got the text {value!r}.")
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        fail(f"{name}: expected a number, got {type(value).__name__} {value!r}.")
    if not math.isfinite(x):
        fail(f"{name}: expected a finite number, got {x}.")
    return x


def read_fraction(name: str, value: object) -> float:
    """A share given as a fraction (0.049) or a percent (4.9, "4.9%"), returned as a fraction.

    Values above 1 are read as percents, and so is any string ending in ``%``; a share
    cannot exceed 100%.
    """
    percent = isinstance(value, str) and value.strip().endswith("%")
    x = read_number(name, value)
    if x < 0:
        fail(f"{name}: a share cannot be negative (got {fmt(x)}).")
    if percent or x > 1:
        x /= 100
    if x > 1:
        fail(f"{name}: {fmt(x * 100)}% is more than everything; a share is at most 100%.")
    return x


def read_count(name: str, value: object) -> int:
    """A whole number of things (blocks, slots, tokens)."""
    x = read_number(name, value)
    if not x.is_integer():
        fail(f"{name}: count whole things: {fmt(x)} is not an integer.")
    if x < 0:
        fail(f"{name}: a count cannot be negative (got {fmt(x)}).")
    return int(x)


def read_quantity(name: str, value: object, units: Mapping[str, float],
                  default_unit: str) -> tuple[float, str | None]:
    """A number with an optional unit, converted to the base unit of ``units``.

    ``"488.3 GiB"`` -> (500019.2, "GiB"); ``1000`` -> (1000 * units[default_unit], None):
    the second item is the unit the student wrote, or None when the answer was bare (the
    grader may then try other readings, e.g. GiB for a bare 488).
    """
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([-+0-9.,_eE]+)\s*([A-Za-z]+)?\s*", value)
        if m is None:
            fail(f"{name}: expected a number with an optional unit like '1000 MiB', got {value!r}.")
        number, unit = m.group(1), m.group(2)
        x = read_number(name, number)
        if unit is not None:
            key = _unit(units, unit)
            if key is None:
                fail(f"{name}: unknown unit {unit!r}; use one of {', '.join(units)}.")
            return x * units[key], key
        return x * units[default_unit], None
    return read_number(name, value) * units[default_unit], None


def is_close(answer: float, expected: float, rel: float = 0.01, abs_tol: float = 0.0) -> bool:
    """Whether ``answer`` equals ``expected`` up to rounding: relative ``rel`` or ``abs_tol``."""
    return abs(answer - expected) <= max(rel * abs(expected), abs_tol)


def closest(answer: float, candidates: Iterable[float], rel: float = 0.01,
            abs_tol: float = 0.0) -> float | None:
    """Which acceptable value ``answer`` stands for, or None if it is close to none.

    ``candidates`` are in order of preference (the ideal answer first). An answer within a
    fifth of the tolerance of one candidate is that one; otherwise a rounded answer is
    read as the first candidate it is close to: "1 GiB" for 1000 MiB (ideal) rather than
    1008 MiB (block-exact), which are both within rounding of it.
    """
    candidates = list(candidates)
    tight = [c for c in candidates if is_close(answer, c, rel / 5, abs_tol / 5)]
    if tight:
        return min(tight, key=lambda c: abs(answer - c))
    return next((c for c in candidates if is_close(answer, c, rel, abs_tol)), None)


def explain_mistake(answer: float, mistakes: Sequence[Mistake], rel: float = 0.01,
                    abs_tol: float = 0.0) -> str | None:
    """The hint of the known mistake ``answer`` matches, if any."""
    for value, hint in mistakes:
        if is_close(answer, value, rel, abs_tol):
            return hint
    return None


def check_close(name: str, answer: float, expected: float | Sequence[float], *,
                rel: float = 0.01, abs_tol: float = 0.0, mistakes: Sequence[Mistake] = (),
                hint: str = "", shown: str | None = None) -> float:
    """Accept ``answer`` when close to ``expected`` (one value or several acceptable ones)
    and return the one it matched; otherwise fail with the matching mistake's hint, else
    with the generic ``hint``. ``shown`` is how the answer is echoed (default: the number).
    """
    targets = [expected] if isinstance(expected, numbers.Real) else list(expected)
    match = closest(answer, targets, rel, abs_tol)
    if match is not None:
        return match
    said = shown if shown is not None else fmt(answer)
    why = explain_mistake(answer, mistakes, rel, abs_tol) or hint
    fail(f"{name}: {said} is not right. {why}".rstrip())


def check_text(name: str, text: object, accept: Sequence[str], *, reject: Sequence[str] = (),
               hint: str = "", min_words: int = 2) -> str:
    """Accept free text that matches one of the ``accept`` regular expressions (searched,
    case-insensitive) and none of ``reject``; return the matched fragment.

    Lenient on purpose: graders cannot read prose, so they look for the idea's key words
    and only reject empty, too short or clearly off-topic answers.
    """
    if text is Ellipsis or text is None or not isinstance(text, str) or not text.strip():
        fail(f"{name}: write your answer as a sentence in a string. {hint}".rstrip())
    words = re.findall(r"[\w-]+", text)
    if len(words) < min_words:
        fail(f"{name}: say a little more than {text.strip()!r}. {hint}".rstrip())
    lowered = " ".join(text.lower().split())
    for pattern in reject:
        if re.search(pattern, lowered):
            fail(f"{name}: {text.strip()!r} does not hold. {hint}".rstrip())
    for pattern in accept:
        m = re.search(pattern, lowered)
        if m:
            return m.group(0)
    fail(f"{name}: {text.strip()!r} does not name the condition. {hint}".rstrip())


def check_quantity(name: str, value: object, expected: float | Sequence[float], *,
                   units: Mapping[str, float], default_unit: str, bare_also: Sequence[str] = (),
                   rel: float = 0.01, mistakes: Sequence[Mistake] = (),
                   hint: str = "") -> tuple[float, float, str]:
    """``check_close`` for an answer with a unit. A bare number is read in ``default_unit``
    and then, if that does not match, in each of ``bare_also`` (a student who writes 488
    for 488 GiB is right). Returns (matched expected value, the answer in base units, the
    unit it was read in). Expected values and mistakes are in base units.
    """
    base, unit = read_quantity(name, value, units, default_unit)
    readings = [(base, unit)] if unit else [(base, default_unit)]
    if unit is None:
        raw = base / units[default_unit]
        readings += [(raw * units[u], u) for u in bare_also]
    targets = [expected] if isinstance(expected, numbers.Real) else list(expected)
    for x, u in readings:
        match = closest(x, targets, rel)
        if match is not None:
            return match, x, u
    x, u = readings[0]
    shown = f"{value!r}" if isinstance(value, str) else f"{fmt(x / units[u])} {u}"
    check_close(name, x, targets, rel=rel, mistakes=mistakes, hint=hint, shown=shown)
    raise AssertionError("unreachable")   # check_close failed above
