"""The verdict on one exercise, reached in the grading process from what the kernel handed in.

The kernel is the student's: what it hands in (``probe.hand_in``'s JSON) is read as data,
strictly, and judged here by labkit's graders as this process imported them, before any
kernel ran. A student's code can change what its kernel hands in, never how it is judged:

* a value answer (``plain``) goes to the grader itself, which reads numbers, strings, lists,
  dicts (and sets and the plain facts of live objects, in ``labkit.exercises``' own form);
* a code answer (``ran``: what the student's function or test did on the grader's inputs)
  goes to the grader's ``judge``;
* a ready verdict (``verdict``) is accepted only for a grader that can take neither form yet
  (``probe.IN_KERNEL``), and never for one that can: a kernel cannot choose to be trusted.

Anything else (no answer, two answers, malformed data, an answer for another exercise) fails
the exercise, and says why.
"""

from __future__ import annotations

import contextlib
import io
import json
import threading
from dataclasses import dataclass, field

from .checks import Check
from .probe import IN_KERNEL

PASS, FAIL, UNANSWERED = "pass", "fail", "unanswered"
MAX_BYTES = 4 << 20
_LOCK = threading.Lock()      # graders print their verdict: one at a time, stdout captured


@dataclass(slots=True)
class Verdict:
    """What the grader said: ``status`` PASS, FAIL or UNANSWERED (the answers could not even be
    evaluated: ``hint`` holds the error), and what the kernel showed that the flags should say."""
    status: str
    hint: str = ""
    seen: list[str] = field(default_factory=list)
    in_kernel: bool = False


def form(grader) -> str:
    """How ``grader`` (as imported here) takes its answers: "ran", "plain", or "verdict"
    (judged in the kernel: a grader without either form, or one of ``probe.IN_KERNEL``)."""
    if f"{grader.__module__}:{grader.__name__}" in IN_KERNEL:
        return "verdict"
    if callable(getattr(grader, "probe", None)) and callable(getattr(grader, "judge", None)):
        return "ran"
    if callable(getattr(grader, "plain_arguments", None)):
        return "plain"
    return "verdict"


def _graded(call) -> Verdict:
    try:
        with _LOCK, contextlib.redirect_stdout(io.StringIO()):
            call()
    except AssertionError as e:
        return Verdict(FAIL, str(e) or "the grader rejected the answers")
    except Exception as e:   # noqa: BLE001 - a grader that breaks on strange data still gives a verdict
        return Verdict(FAIL, f"the answers could not be graded ({type(e).__name__}: {str(e)[:200]})")
    return Verdict(PASS)


def _plain(value: object, depth: int = 0) -> bool:
    """JSON's own types only, nested at most 64 deep (what ``json.loads`` makes, checked anyway)."""
    if depth > 64:
        return False
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, list):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False


def judge(check: Check, handed: list[str], plan: dict) -> Verdict:
    """The verdict on ``check``'s exercise from the texts its answer cell emitted (``handed``)
    and the ``plan`` its code answer ran under."""
    if not handed:
        return Verdict(FAIL, "no answer reached the grader: the check cell did not run as distributed",
                       ["handed in no answer"])
    if len(handed) > 1:
        return Verdict(FAIL, f"{len(handed)} answers were handed in for one check",
                       [f"handed in {len(handed)} answers"])
    text = handed[0]
    if not isinstance(text, str) or len(text) > MAX_BYTES:
        return Verdict(FAIL, "the answer handed in is not readable data", ["handed in unreadable data"])
    try:
        payload = json.loads(text)
    except (ValueError, RecursionError):
        return Verdict(FAIL, "the answer handed in is not readable data", ["handed in unreadable data"])
    if not isinstance(payload, dict) or payload.get("exercise") != check.exercise or not _plain(payload):
        return Verdict(FAIL, "the answer handed in is not this exercise's", ["handed in another exercise's answer"])
    seen = [s[:200] for s in payload.get("seen", []) if isinstance(s, str)][:10] \
        if isinstance(payload.get("seen"), list) else []
    verdict = _judge(check, payload, plan)
    verdict.seen += seen
    return verdict


def _judge(check: Check, payload: dict, plan: dict) -> Verdict:
    if isinstance(payload.get("unanswered"), str):
        return Verdict(UNANSWERED, payload["unanswered"])
    if isinstance(payload.get("error"), str):
        return Verdict(FAIL, f"the answers could not be handed in ({payload['error']})")
    grader = check.function()
    how = form(grader)
    if how == "ran" and "ran" in payload:
        return _graded(lambda: grader.judge(payload["ran"], plan=plan))
    if how == "plain" and isinstance(payload.get("plain"), dict):
        args, kwargs = payload["plain"].get("args"), payload["plain"].get("kwargs")
        if isinstance(args, list) and isinstance(kwargs, dict):
            return _graded(lambda: grader(*args, **kwargs))
    if how == "verdict" and isinstance(payload.get("verdict"), dict):
        said = payload["verdict"]
        if said.get("status") == "pass":
            return Verdict(PASS, in_kernel=True)
        return Verdict(FAIL, str(said.get("message") or "the grader rejected the answers"), in_kernel=True)
    return Verdict(FAIL, f"the answer handed in is not in the form its grader reads ({how})",
                   [f"handed in a {'/'.join(k for k in ('ran', 'plain', 'verdict') if k in payload) or 'bare'} "
                    f"answer where the grader reads {how}"])
