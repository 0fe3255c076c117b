"""Small tools for exercise graders: read an answer, compare it, explain a wrong one.

Every grader in ``labkit.exercises`` follows one pattern:

1. compute the expected values from the real engine (allocator, scheduler, kernels), not
   from a hard-coded table, so that the exercise and the code can never disagree;
2. read the student's answer in every form the exercise invites (a fraction or a percent;
   a bare number in the unit the exercise names, and in no other; a string with a unit,
   converted) and never guess: a bare 500 where MiB are asked is 500 MiB, not 500 GiB;
3. on a wrong answer, raise ``AssertionError`` whose message *teaches*: if the answer is a
   known mistake (dividing the wrong way round, forgetting a factor, mixing up units) say
   which; never state the expected value, or the formula that gives it: point at the
   concept or the step, so the student still has something to find;
4. on a right answer, print one line starting with a check mark that restates the result;
5. answer every input with a hint, never with a traceback of the grader's own: None, a
   wrong type, NaN, a stub that still raises ``NotImplementedError``, a function that
   returns garbage (``graded`` is the safety net that guarantees it).

Each grader module also defines ``answer_forms()``: for each exercise, the strings that
would give its answer away in the forms its grader accepts. A test scans the student
notebooks and every hint for them.

Notebook check cells call graders; ``pytest --nbval-lax`` fails a cell that raises, so a
wrong answer fails the notebook's test run whatever outputs the notebook stored.
"""

from __future__ import annotations

import functools
import math
import numbers
import re
from typing import Callable, Iterable, Mapping, NoReturn, Sequence, TypeVar

F = TypeVar("F", bound=Callable[..., None])

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


def graded(exercise: str) -> Callable[[F], F]:
    """Decorate the grader of ``exercise`` (e.g. "1.2") so that it answers every input with
    a hint: a wrong answer's ``AssertionError`` passes through; a student's function that
    still raises ``NotImplementedError``, and anything else raised while grading (an answer
    of a shape nobody anticipated, a function that returns garbage) becomes an
    ``AssertionError`` that says so, without a traceback of the grader's own."""
    def decorate(grader: F) -> F:
        @functools.wraps(grader)
        def wrapper(*args, **kwargs):
            __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
            try:
                return grader(*args, **kwargs)
            except AssertionError:
                raise
            except NotImplementedError:
                message = (f"Exercise {exercise}: your code still raises NotImplementedError: replace "
                           "the `raise NotImplementedError(...)` line with your solution.")
            except Exception as e:       # noqa: BLE001 - any input gets a hint, not a crash
                message = (f"Exercise {exercise}: these answers could not be graded ({type(e).__name__}: "
                           f"{str(e)[:200]}). Check that each one has the form the exercise asks for.")
            raise AssertionError(message) from None
        return wrapper  # type: ignore[return-value]
    return decorate


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: a message echoes an answer, never pages of it."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def fmt(x: float, digits: int = 4) -> str:
    """A number as a person would write it: 0.0488, 14.29, 500,000."""
    if isinstance(x, numbers.Integral) or float(x).is_integer() and abs(x) >= 1:
        return f"{int(x):,}"
    return f"{x:.{digits}g}"


def read_number(name: str, value: object) -> float:
    """``value`` as a float, or a failure that says what was expected.

    Accepts ints, floats, numpy scalars and numeric strings ("4.9", "1,000", a quotient
    "10/70"); a string ending in ``%`` is returned as a percent number ("4.9%" -> 4.9). Rejects None (and
    ``...``), bools, NaN and infinities.
    """
    if value is Ellipsis or value is None:
        fail(f"{name}: no answer yet ({shown(value)}). Replace the exercise cell's "
             "`raise NotImplementedError(...)` line with your answer (a number).")
    if isinstance(value, bool):
        fail(f"{name}: expected a number, got {shown(value)}.")
    if isinstance(value, str):
        text = value.strip().replace(",", "").replace("_", "").rstrip("%").strip()
        ratio = re.fullmatch(r"([-+0-9.eE]+)\s*/\s*([-+0-9.eE]+)", text)     # "10/70", as written on paper
        try:
            value = float(ratio[1]) / float(ratio[2]) if ratio else float(text)
        except (ValueError, ZeroDivisionError):
            fail(f"{name}: expected a number, got the text {shown(value)}.")
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        fail(f"{name}: expected a number, got {type(value).__name__} {shown(value)}.")
    if not math.isfinite(x):
        fail(f"{name}: expected a finite number, got {x}.")
    return x


def read_ratio(name: str, value: object) -> float:
    """A ratio such as a speedup: a number, or a string written the way speedups are
    ("1.6x", "1.6×", "1.6 x")."""
    if isinstance(value, str):
        value = re.sub(r"\s*[x×]\s*$", "", value.strip(), flags=re.IGNORECASE)
    return read_number(name, value)


def read_fraction(name: str, value: object) -> float:
    """A share given as a fraction (0.049) or a percent (4.9, "4.9%"), returned as a fraction.

    Values above 1 are read as percents, and so is any string ending in ``%``; a share
    cannot exceed 100%. (So the exercise's two forms, 0.05 and 5, are both read right; an
    answer off by a factor of 100 is caught by ``check_share``.)
    """
    percent = isinstance(value, str) and value.strip().endswith("%")
    x = read_number(name, value)
    if x < 0:
        fail(f"{name}: a share cannot be negative (got {fmt(x)}).")
    if percent or x > 1:
        x /= 100
    if x > 1:
        fail(f"{name}: {fmt(x * 100)}% is more than everything; a share is at most 100%. (A bare "
             "number up to 1 is read as a fraction, above 1 as a percent: was a percent multiplied "
             "by 100 once too often?)")
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
                  default_unit: str, *, negative_hint: str = "") -> tuple[float, str | None]:
    """A non-negative number with an optional unit, converted to the base unit of ``units``.

    ``"488.3 GiB"`` -> (500019.2, "GiB"); ``1000`` -> (1000 * units[default_unit], None):
    the second item is the unit the student wrote, or None when the answer was bare. A bare
    number is read in ``default_unit`` and in no other. A negative amount fails, with
    ``negative_hint`` (what usually produces one) when given.
    """
    base, unit = _read_quantity(name, value, units, default_unit)
    if base < 0:
        fail(f"{name}: this amount cannot be negative (got {shown(value)}). {negative_hint}".rstrip())
    return base, unit


def _read_quantity(name: str, value: object, units: Mapping[str, float],
                   default_unit: str) -> tuple[float, str | None]:
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([-+0-9.,_eE]+)\s*([A-Za-z]+)?\s*", value)
        if m is None:
            fail(f"{name}: expected a number with an optional unit like '2 GiB', got {shown(value)}.")
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
    """The hint of the known mistake ``answer`` matches, if any; when several mistakes give
    the same value (×8 is bits, and also 64 query heads over 8 KV heads), all their hints."""
    hints = [hint for value, hint in mistakes if is_close(answer, value, rel, abs_tol)]
    return " Or: ".join(dict.fromkeys(hints)) or None


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


def check_share(name: str, value: object, expected: float | Sequence[float], *,
                rel: float = 0.01, mistakes: Sequence[Mistake] = (), hint: str = "") -> tuple[float, float]:
    """``check_close`` for a share read by ``read_fraction`` (0.05, 5 or "5%"), echoed as both
    forms; an answer off by a factor of 100 gets a hint about the fraction/percent mix-up.
    Returns (the matched expected share, the answer as a fraction)."""
    share = read_fraction(name, value)
    targets = [expected] if isinstance(expected, numbers.Real) else list(expected)
    mixups = [(t / 100, "That is 100× too small: a fraction divided by 100, or a percent written "
                        "where a fraction was read? (0.05 and 5 both mean 5%.)") for t in targets]
    match = check_close(name, share, targets, rel=rel, mistakes=list(mistakes) + mixups, hint=hint,
                        shown=f"{share:.4g} ({share:.2%})")
    return match, share


_SUPERSCRIPT = {2: "²", 3: "³", 4: "⁴"}
_UNIT_NAMES = {"B": "bytes"}


def unit_mixup(answer: float, expected: float | Sequence[float], rel: float, *,
               written_unit: str | None, default_unit: str) -> str | None:
    """The hint for an ``answer`` that is right but for its unit: off by a power of 1000 or
    1024 (a prefix step: MiB for GiB, bytes for KiB) or by decimal against binary prefixes
    (GB = 10^9 bytes, GiB = 2^30), or a combination; None when no such factor explains it."""
    targets = [expected] if isinstance(expected, numbers.Real) else list(expected)
    best: tuple[float, int, int] | None = None
    for target in targets:
        if answer <= 0 or target <= 0:
            continue
        ratio = answer / target
        for i in range(-4, 5):
            for j in range(-4, 5):
                factor = 1000.0**i * 1024.0**j
                miss = abs(math.log(ratio / factor))
                # GB against GiB is a factor of 1.02-1.1, where a coarsely rounded answer falls
                # too: call it a mix-up only when the factor fits (nearly) exactly.
                tol = min(rel, 0.004) if abs(math.log(factor)) < math.log(1.2) else rel
                if (i, j) != (0, 0) and is_close(ratio, factor, tol) and (best is None or miss < best[0]):
                    best = (miss, i, j)
    if best is None:
        return None
    _, i, j = best
    factor = 1000.0**i * 1024.0**j
    direction = "large" if factor > 1 else "small"
    if i == 0 or j == 0:                        # a pure prefix step: 1,024², not 1,048,576
        k = abs(i or j)
        size = f"{'1,000' if i else '1,024'}{_SUPERSCRIPT.get(k, '')} times too {direction}"
    else:
        size = f"{fmt(max(factor, 1 / factor), 3)} times too {direction}"
    if i + j == 0:
        what = "decimal and binary prefixes are mixed up (GB = 10^9 bytes, GiB = 2^30 bytes)"
    elif i == 0 or j == 0:
        what = "a unit mix-up (one prefix step is a factor of 1,024 for KiB, MiB, GiB and 1,000 for KB, MB, GB)"
    else:
        what = ("a unit mix-up: prefix steps, and decimal against binary prefixes "
                "(GB = 10^9 bytes, GiB = 2^30 bytes)")
    unit_name = _UNIT_NAMES.get(default_unit, default_unit)
    where = (f"You wrote {written_unit}: is that the unit your number is in?" if written_unit else
             f"A bare number is read in {unit_name} and in no other unit: give the amount in {unit_name}, "
             "or as a string with its unit.")
    return f"It is {size}: {what}. {where}"


def check_quantity(name: str, value: object, expected: float | Sequence[float], *,
                   units: Mapping[str, float], default_unit: str, rel: float = 0.01,
                   mistakes: Sequence[Mistake] = (), hint: str = "") -> tuple[float, float, str]:
    """``check_close`` for an amount with a unit. A bare number is read in ``default_unit``
    (and in no other), a string with a unit is converted. A wrong answer gets the hint of the
    known mistake it matches, else of the unit mix-up that explains it, else ``hint``.
    Returns (matched expected value, the answer in base units, the unit it was read in).
    Expected values and mistakes are in base units.
    """
    base, unit = read_quantity(name, value, units, default_unit)
    targets = [expected] if isinstance(expected, numbers.Real) else list(expected)
    match = closest(base, targets, rel)
    if match is not None:
        return match, base, unit or default_unit
    echo = shown(value) if isinstance(value, str) else f"{fmt(base / units[default_unit])} {default_unit}"
    near = any(is_close(base, t, 0.1) for t in targets)
    why = (explain_mistake(base, mistakes, rel)
           or unit_mixup(base, targets, rel, written_unit=unit, default_unit=default_unit)
           or (f"Close, but further off than rounding allows ({rel:.0%}): keep more digits, and check "
               "each factor." if near else hint))
    fail(f"{name}: {echo} is not right. {why}".rstrip())


# ---- structured questions ------------------------------------------------------------------
def read_choices(name: str, value: object, options: Iterable[str]) -> frozenset[str]:
    """The statements a student picked, by letter: "b, d", "BD", ["b", "d"] or {"b", "d"};
    returned upper-cased. Unknown letters, an empty pick and other types fail with a hint."""
    options = {o.upper() for o in options}
    listed = ", ".join(sorted(options))
    if value is None or value is Ellipsis:
        fail(f"{name}: no answer yet ({shown(value)}). Pick the letters of the statements, e.g. {{'X', 'Y'}}.")
    if isinstance(value, str):
        items = [t for t in re.split(r"[\s,;/&+]+", value.strip()) if t]
        if len(items) == 1 and len(items[0]) > 1 and all(c.upper() in options for c in items[0]):
            items = list(items[0])       # "bd"
    elif isinstance(value, (set, frozenset, list, tuple)):
        items = list(value)
        if not all(isinstance(item, str) for item in items):
            fail(f"{name}: give the statements' letters as strings ({listed}), got {shown(value)}.")
    else:
        fail(f"{name}: expected a set of letters like {{'X', 'Y'}}, got {type(value).__name__} {shown(value)}.")
    picked = {item.strip().strip("()[]{}'\"").upper() for item in items} - {""}
    unknown = sorted(p for p in picked if p not in options)
    if unknown:
        fail(f"{name}: {shown(unknown[0])} is not one of the statements' letters ({listed}).")
    if not picked:
        fail(f"{name}: pick at least one statement ({listed}).")
    return frozenset(picked)


def check_choices(name: str, value: object, options: Mapping[str, str], right: Iterable[str], *,
                  why_wrong: Mapping[str, str], why_needed: Mapping[str, str]) -> frozenset[str]:
    """Grade a pick of statements exactly: it must be ``right``, no more, no less. A wrong
    pick fails with the hint that explains its misconception (``why_wrong[letter]``), a
    missing one with a hint at the idea it states (``why_needed[letter]``), never its letter."""
    right = frozenset(r.upper() for r in right)
    picked = read_choices(name, value, options)
    wrong = sorted(picked - right)
    if wrong:
        more = f" ({len(wrong) - 1} more of your picks do not hold either.)" if len(wrong) > 1 else ""
        fail(f"{name}: statement {wrong[0]} does not belong: {why_wrong[wrong[0]]}{more}")
    missing = sorted(right - picked)
    if missing:
        fail(f"{name}: everything you picked holds, but it is not enough. {why_needed[missing[0]]}")
    return picked


# ---- answer forms, for the leak scan ---------------------------------------------------------
def number_forms(x: float) -> list[str]:
    """How a student might write ``x``: "327680", "327,680", "1.25", "33.53" (to 3-4 digits)."""
    if float(x).is_integer():
        n = int(x)
        return list(dict.fromkeys([str(n), f"{n:,}", f"{n:_}"]))
    return list(dict.fromkeys(f"{x:.{d}g}" for d in (3, 4) if "e" not in f"{x:.{d}g}"))


def quantity_forms(base: float, units: Mapping[str, float], names: Iterable[str]) -> list[str]:
    """``base`` (in the base unit of ``units``) written in each unit of ``names``, with and
    without a space: "1.25 GiB", "1.25GiB", "1,280 MiB"."""
    forms = []
    for unit in names:
        for number in number_forms(base / units[unit]):
            forms += [f"{number} {unit}", f"{number}{unit}"]
    return list(dict.fromkeys(forms))
