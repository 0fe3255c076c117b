"""Graders for chapter 8 (online serving): read a live server's timings and step records.

The expected values come from the run the student just made: the client-side timings of
the requests they sent, and the engine's ``StepRecord``s (``server.engine.records()``).

* ``check_ttft_p50`` (8.1): the median time to first token, from the client's timings, as
  ``statistics.median`` defines it (for an even count, the mean of the two middle values);
* ``check_joins`` (8.2): the iteration at which each request joined the running batch, and which
  requests were decoding in the iteration where a given one joined.
"""

from __future__ import annotations

import statistics
from typing import Iterable, Mapping, Sequence

from ._grading import check_quantity, fail, graded, passed, read_collection, read_count, shown, sig

#: Units a time may be given in (base: seconds); a bare number is read in seconds.
TIME_UNITS = {"s": 1.0, "ms": 1e-3}
_OVERWRITTEN = ("Did a cell overwrite it? Rerun the cell that sends the requests (and the one that reads the "
                "records), and keep your own values under other names.")


def _get(timing, key: str) -> float:
    value = timing[key] if isinstance(timing, Mapping) else getattr(timing, key)
    return float(value)


def timing_facts(timings: object) -> list[dict[str, float]]:
    """``timings`` (one dict or object per request with ``sent``, ``first_token`` and ``done``)
    as plain dicts, or a failure that says what is wrong with it (a name a student's cell
    reused, say ``timings = [ttft, ...]``)."""
    if isinstance(timings, (str, bytes, Mapping)) or not isinstance(timings, Iterable):
        fail(f"timings: expected the list of per-request timings, got {type(timings).__name__} "
             f"{shown(timings)}. {_OVERWRITTEN}")
    rows = []
    for t in timings:
        try:
            rows.append({key: _get(t, key) for key in ("sent", "first_token", "done")})
        except (KeyError, AttributeError, TypeError, ValueError):
            fail(f"timings: expected one dict per request with 'sent', 'first_token' and 'done', got "
                 f"{shown(t)}. {_OVERWRITTEN}")
    return rows


def ttfts(timings: Iterable) -> list[float]:
    """Time to first token of each request: ``first_token - sent`` (seconds)."""
    return [_get(t, "first_token") - _get(t, "sent") for t in timings]


@graded("8.1", plain={"timings": timing_facts})
def check_ttft_p50(answer, timings) -> None:
    """Exercise 8.1: the p50 TTFT of the requests in ``timings``, in seconds (or a string with
    a unit, "s" or "ms"), to 3 significant figures, as ``statistics.median`` defines it: the
    middle value, or for an even count the mean of the two middle values.

    ``timings``: one dict (or object) per request with ``sent``, ``first_token`` and
    ``done`` times in seconds on the client's clock.
    """
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    timings = timing_facts(timings)
    if not timings:
        fail("no timings to grade: run the cell that sends the requests first.")
    values = sorted(ttfts(timings))
    expected = statistics.median(values)
    middle = "the two middle values"
    mistakes = [(values[(len(values) - 1) // 2], f"That is the lower of {middle}; with an even number "
                 "of requests, statistics.median takes the mean of the two."),
                (values[len(values) // 2], f"That is the upper of {middle}; with an even number of "
                 "requests, statistics.median takes the mean of the two.")] if len(values) % 2 == 0 else []
    mistakes += [
        (statistics.mean(values), "That is the mean; p50 is the median (half the values lie below it)."),
        (statistics.median(t["done"] - t["sent"] for t in timings),
         "That is the median latency (until the last token); TTFT stops at the first token."),
        (statistics.median(t["done"] - t["first_token"] for t in timings),
         "That is the median time spent streaming after the first token; TTFT is from sending to "
         "the first token."),
        (statistics.median(t["first_token"] for t in timings),
         "That is the median first-token time itself; subtract each request's own send time."),
    ]
    check_quantity("ttft_p50", answer, expected, units=TIME_UNITS, default_unit="s", mistakes=mistakes,
                   negative_hint="A wait cannot be negative: were the two times subtracted the wrong way round?",
                   hint="TTFT is measured per request, from its sending to its first token; p50 is the median "
                        "of those, as defined in the exercise.")
    passed(f"TTFT p50 = {sig(expected * 1e3)} ms over {len(values)} requests: half of the users saw "
           f"their first token sooner than that.")


def record_facts(records: object) -> list[dict]:
    """The engine's step records as plain data: ``[{"step": int, "ran": [[request id, sample
    index, tokens, phase], ...]}, ...]``, or a failure that says what is wrong with them."""
    if isinstance(records, (str, bytes, Mapping)) or not isinstance(records, Iterable):
        fail(f"records: expected the engine's step records, got {type(records).__name__} {shown(records)}. "
             + _OVERWRITTEN)
    out = []
    for rec in records:
        if isinstance(rec, Mapping):
            step, ran = rec.get("step"), rec.get("ran")
        elif hasattr(rec, "ran") and hasattr(rec, "step"):
            step, ran = rec.step, rec.ran
        else:
            fail(f"records: expected the engine's StepRecords (server.engine.records(...)), got {shown(rec)}. "
                 + _OVERWRITTEN)
        try:
            out.append({"step": int(step), "ran": [[str(rid), int(i), int(n), str(phase)]
                                                   for rid, i, n, phase in ran]})
        except (TypeError, ValueError):
            fail(f"records: a record's step or ran is not what the engine writes: {shown(rec)}. " + _OVERWRITTEN)
    return out


def first_iterations(records: Sequence, ids: Iterable[str] | None = None) -> dict[str, int]:
    """``{request id: step of the first record in which it ran}`` (its first prefill)."""
    joined: dict[str, int] = {}
    for rec in record_facts(records):
        for rid, _index, _n, _phase in rec["ran"]:
            joined.setdefault(rid, rec["step"])
    if ids is not None:
        wanted = list(ids)
        joined = {rid: joined[rid] for rid in wanted if rid in joined}
    return joined


def decoding_at(records: Sequence, step: int) -> set[str]:
    """Requests that decoded in iteration ``step``."""
    for rec in record_facts(records):
        if rec["step"] == step:
            return {rid for rid, _i, _n, phase in rec["ran"] if phase == "decode"}
    return set()


@graded("8.2", plain={"records": record_facts})
def check_joins(joined, shared_with, records: Sequence, ids: Sequence[str], request_id: str) -> None:
    """Exercise 8.2: ``joined[rid]`` is the iteration (``StepRecord.step``) at which each
    request in ``ids`` first ran; ``shared_with`` is the set (or list) of requests that were
    *decoding* in the iteration where ``request_id`` joined."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    records = record_facts(records)
    if not records:
        fail("no step records to grade: run the cell that sends the requests first.")
    wanted = list(ids) if isinstance(ids, Iterable) and not isinstance(ids, (str, bytes, Mapping)) else []
    if not wanted or not all(isinstance(rid, str) for rid in wanted):
        fail(f"ids: expected the list of the experiment's request ids, got {shown(ids)}. " + _OVERWRITTEN)
    expected = first_iterations(records, wanted)
    if not isinstance(request_id, str) or request_id not in expected:
        fail(f"late: expected the id of a request that ran in the experiment (the last user's), got "
             f"{shown(request_id)}. " + _OVERWRITTEN)
    if not isinstance(joined, Mapping):
        fail(f"joined: expected a dict {{request id: iteration}}, got {type(joined).__name__}.")
    missing = [rid for rid in expected if rid not in joined]
    if missing:
        fail(f"joined: {len(missing)} of the {len(expected)} requests are missing, e.g. {missing[0]!r}.")
    extra = [rid for rid in joined if rid not in expected]
    if extra:
        fail(f"joined: {extra[0]!r} is not one of the requests sent in this experiment.")
    answers = {rid: read_count(f"joined[{rid!r}]", joined[rid]) for rid in expected}
    if answers != expected:
        positions = {rec["step"]: k for k, rec in enumerate(records)}
        last = {}
        for rec in records:
            for rid, *_ in rec["ran"]:
                last[rid] = rec["step"]
        first_decode = {}
        for rec in records:
            for rid, _i, _n, phase in rec["ran"]:
                if phase == "decode":
                    first_decode.setdefault(rid, rec["step"])
        if all(answers[rid] == positions.get(expected[rid]) for rid in expected):
            fail("joined: those are positions in the list of records; give each record's `step` "
                 "(the engine's iteration number) instead.")
        if all(answers[rid] == last.get(rid) for rid in expected):
            fail("joined: those are the iterations in which the requests ran for the last time; "
                 "a request joins the batch at the first record whose `ran` names it.")
        if all(answers[rid] == first_decode.get(rid) for rid in expected):
            fail("joined: those are the iterations of the requests' first decode; a request joins the batch "
                 "when its prompt is computed (prefill), in the first record whose `ran` names it.")
        fail("joined: not every request's iteration is right. Walk the records in order and note, for each "
             "request, the first `rec.step` whose `rec.ran` names it.")

    want = decoding_at(records, expected[request_id])
    if isinstance(shared_with, (str, Mapping)):
        fail(f"shared_with: expected a set of request ids, got {type(shared_with).__name__}.")
    got = set()
    for rid in read_collection("shared_with", shared_with, "request ids"):
        if not isinstance(rid, str):
            fail(f"shared_with: expected request ids (strings like {request_id!r}), got "
                 f"{type(rid).__name__} {shown(rid)}.")
        got.add(rid)
    if got != want:
        everyone = {rid for rec in records if rec["step"] == expected[request_id] for rid, *_ in rec["ran"]}
        if got == everyone - {request_id}:
            fail("shared_with: keep only the requests whose phase was 'decode' in that iteration.")
        fail(f"shared_with: not the right requests. Look at the record with step == joined[{request_id!r}] and "
             f"keep the requests whose phase is 'decode' there ({request_id!r} itself was having its prompt "
             "computed).")
    if want:
        passed(f"{request_id} joined at iteration {expected[request_id]}, its prompt computed in the same "
               f"forward pass as {len(want)} other requests' next tokens: continuous batching.")
    else:
        passed(f"{request_id} joined at iteration {expected[request_id]}, when no one else was decoding.")


def answer_forms() -> dict[str, list[str]]:
    """Chapter 8's answers come from the student's own live run, so no fixed string gives them
    away; the leak scan has nothing to look for here (the hints never print an expected value)."""
    return {"8.1": [], "8.2": []}
