"""Graders for chapter 8 (online serving): read a live server's timings and step records.

The expected values come from the run the student just made: the client-side timings of
the requests they sent, and the engine's ``StepRecord``s (``server.engine.records()``).

* ``check_ttft_p50``: the median time to first token, from the client's timings;
* ``check_joins``: the iteration at which each request joined the running batch, and which
  requests were decoding in the iteration where a given one joined.
"""

from __future__ import annotations

import statistics
from typing import Iterable, Mapping, Sequence

from ._grading import explain_mistake, fail, fmt, is_close, passed, read_count, read_number


def _get(timing, key: str) -> float:
    value = timing[key] if isinstance(timing, Mapping) else getattr(timing, key)
    return float(value)


def ttfts(timings: Iterable) -> list[float]:
    """Time to first token of each request: ``first_token - sent`` (seconds)."""
    return [_get(t, "first_token") - _get(t, "sent") for t in timings]


def _medians(values: Sequence[float]) -> list[float]:
    """The median, then the lower and upper middle values (nearest-rank conventions)."""
    xs = sorted(values)
    return [statistics.median(xs), xs[(len(xs) - 1) // 2], xs[len(xs) // 2]]


def check_ttft_p50(answer, timings) -> None:
    """Exercise 1: the p50 (median) TTFT of the requests in ``timings``, in seconds.

    ``timings``: one dict (or object) per request with ``sent``, ``first_token`` and
    ``done`` times in seconds on the client's clock.
    """
    timings = list(timings)
    if not timings:
        fail("no timings to grade: run the cell that sends the requests first.")
    x = read_number("ttft_p50", answer)
    if x < 0:
        fail("ttft_p50: a time to first token cannot be negative; subtract the send time from the "
             "first-token time, not the other way round.")
    values = ttfts(timings)
    expected = _medians(values)
    tol = 1e-4                                    # seconds: rounding to 0.1 ms is fine
    if any(is_close(x, e, rel=0.01, abs_tol=tol) for e in expected):
        passed(f"TTFT p50 = {x * 1e3:.1f} ms over {len(values)} requests: half of the users saw "
               f"their first token sooner than that.")
        return
    mistakes = [
        (statistics.mean(values), "that is the mean; p50 is the median (half the values lie below it)."),
        (statistics.median(_get(t, "done") - _get(t, "sent") for t in timings),
         "that is the median latency (until the last token); TTFT stops at the first token."),
        (statistics.median(_get(t, "done") - _get(t, "first_token") for t in timings),
         "that is the median time spent streaming after the first token; TTFT is from sending to "
         "the first token."),
        (statistics.median(_get(t, "first_token") for t in timings),
         "that is the median first-token time itself; subtract each request's own send time."),
    ]
    mistakes += [(e * 1e3, "that looks like milliseconds; give seconds.") for e in expected]
    hint = explain_mistake(x, mistakes, rel=0.01, abs_tol=tol)
    fail(f"ttft_p50: {fmt(x)} s is not right. " + (hint or
         "For each request take first_token - sent, then the median of those values."))


def first_iterations(records: Sequence, ids: Iterable[str] | None = None) -> dict[str, int]:
    """``{request id: step of the first record in which it ran}`` (its first prefill)."""
    joined: dict[str, int] = {}
    for rec in records:
        for rid, _index, _n, _phase in rec.ran:
            joined.setdefault(rid, rec.step)
    if ids is not None:
        wanted = list(ids)
        joined = {rid: joined[rid] for rid in wanted if rid in joined}
    return joined


def decoding_at(records: Sequence, step: int) -> set[str]:
    """Requests that decoded in iteration ``step``."""
    for rec in records:
        if rec.step == step:
            return {rid for rid, _i, _n, phase in rec.ran if phase == "decode"}
    return set()


def check_joins(joined, shared_with, records: Sequence, ids: Sequence[str], request_id: str) -> None:
    """Exercise 2: ``joined[rid]`` is the iteration (``StepRecord.step``) at which each
    request in ``ids`` first ran; ``shared_with`` is the set of requests that were
    *decoding* in the iteration where ``request_id`` joined."""
    records = list(records)
    if not records:
        fail("no step records to grade: run the cell that sends the requests first.")
    expected = first_iterations(records, ids)
    if joined is Ellipsis or joined is None:
        fail("joined: replace the `...` placeholder with a dict {request id: iteration}.")
    if not isinstance(joined, Mapping):
        fail(f"joined: expected a dict {{request id: iteration}}, got {type(joined).__name__}.")
    missing = [rid for rid in expected if rid not in joined]
    if missing:
        fail(f"joined: {len(missing)} of the {len(expected)} requests are missing, e.g. {missing[0]!r}.")
    extra = [rid for rid in joined if rid not in expected]
    if extra:
        fail(f"joined: {extra[0]!r} is not one of the requests sent in this experiment.")
    answers = {rid: read_count(f"joined[{rid!r}]", joined[rid]) for rid in expected}
    wrong = [rid for rid in expected if answers[rid] != expected[rid]]
    if wrong:
        positions = {rec.step: k for k, rec in enumerate(records)}
        if all(answers[rid] == positions.get(expected[rid]) for rid in expected):
            fail("joined: those are positions in the list of records; give each record's `step` "
                 "(the engine's iteration number) instead.")
        last = {}
        for rec in records:
            for rid, *_ in rec.ran:
                last[rid] = rec.step
        if all(answers[rid] == last.get(rid) for rid in wrong):
            fail("joined: those are the iterations in which the requests ran for the last time; "
                 "a request joins the batch at the first record whose `ran` names it.")
        fail(f"joined: {len(wrong)} of {len(expected)} iterations are wrong, e.g. for {wrong[0]!r}. "
             "Walk the records in order and note the first `rec.step` whose `rec.ran` names the request.")

    want = decoding_at(records, expected[request_id])
    if shared_with is Ellipsis or shared_with is None:
        fail("shared_with: replace the `...` placeholder with a set of request ids.")
    if isinstance(shared_with, str) or not isinstance(shared_with, Iterable):
        fail(f"shared_with: expected a set of request ids, got {type(shared_with).__name__}.")
    got = set(shared_with)
    if request_id in got:
        fail(f"shared_with: {request_id!r} itself was prefilling (its prompt), not decoding, "
             "in the iteration where it joined.")
    if got != want:
        everyone = {rid for rec in records if rec.step == expected[request_id] for rid, *_ in rec.ran}
        if got == everyone - {request_id}:
            fail("shared_with: keep only the requests whose phase was 'decode' in that iteration.")
        fail(f"shared_with: not quite: look at the record with step == joined[{request_id!r}] and keep "
             "the requests whose phase is 'decode'.")
    if want:
        passed(f"{request_id} joined at iteration {expected[request_id]}, its prompt computed in the same "
               f"forward pass as {len(want)} other requests' next tokens: continuous batching.")
    else:
        passed(f"{request_id} joined at iteration {expected[request_id]}, when no one else was decoding.")

