"""After the executor: what an iteration's samples do to its sequences.

``Scheduler.update`` calls ``apply_samples``: every scheduled sequence has the K/V of its
chunk now (its full blocks go to the prefix cache); a sequence that sampled gains its token
and is checked for a stop; an n > 1 request forks into its samples after its prefill
(``make_children``); a beam-search request's beams hand their log-probabilities to
``BeamGroups`` for a beam step instead. Finished sequences retire in ``finish_sequence``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..memory import BlockTable
from ..request import Request, Sequence, Status
from .checks import stop_reason
from .records import SchedulerOutput

if TYPE_CHECKING:   # the scheduler calls in; the import is for type hints only
    from .scheduler import Scheduler

# Called for each sequence that just gained a token, before the token-level stop checks:
# True when its text now contains a stop string (the engine's detokenizer answers).
StopStringCheck = Callable[[Sequence], bool]


def apply_samples(sched: Scheduler, output: SchedulerOutput, sampled: list[list[int]], now: float,
                  stop_string: StopStringCheck | None, logprobs: list[list[dict] | None] | None) -> list[Request]:
    """``Scheduler.update``'s work (its docstring says what each argument holds). Returns the
    requests that finished in this iteration."""
    finished: list[Request] = []
    if sched.tier is not None:
        sched.tier.copies_done()           # the step ran: its copies have read and written their host blocks
    for k, (item, tokens) in enumerate(zip(output.scheduled, sampled, strict=True)):
        seq = item.seq
        if seq.status is not Status.RUNNING:
            continue                       # aborted while the batch ran
        seq.num_computed_tokens += item.num_new_tokens
        seq.block_table.cache_computed_blocks(seq.num_computed_tokens)
        if item.is_prefill:
            sched.num_prompt_tokens_computed += item.num_new_tokens
        if item.num_samples == 0:
            continue
        if len(tokens) != item.num_samples:
            raise ValueError(f"{seq}: expected {item.num_samples} sampled tokens, got {len(tokens)}")
        request = seq.request
        if request.beam is not None:        # no sampled token: a beam step, once all beams are in
            sched.beams.take_logprobs(seq, logprobs[k] if logprobs is not None else None)
            continue
        family = [seq]
        if not request.forked:
            family += sched.fork_children(seq, len(tokens) - 1)
            request.forked = True
        if request.first_token_time is None:
            request.first_token_time = now
        for member, token in zip(family, tokens, strict=True):
            member.token_ids.append(token)
            sched.num_generated_tokens += 1
            if stop_string is not None and stop_string(member):
                reason: str | None = "stop"
            else:
                reason = stop_reason(member, token, sched.eos_token_ids, sched.max_model_len)
            if reason is not None and (done := sched.finish_sequence(member, reason, now)) is not None:
                finished.append(done)
    return finished + sched.beams.step_ready(output, now)


def make_children(running: list[Sequence], parent: Sequence, count: int,
                  new_table: Callable[[], BlockTable]) -> list[Sequence]:
    """``count`` running children of ``parent`` (its tokens, its computed K/V, its
    log-probabilities so far), each on the table ``new_table()`` gives (a fork of the
    parent's, sharing every block; or the static baseline's copy), placed right after it in
    ``running``."""
    children = []
    at = running.index(parent) + 1
    for _ in range(count):
        child = Sequence(parent.request, list(parent.token_ids), index=len(parent.request.seqs))
        child.block_table = new_table()
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        if parent.logprobs is not None:
            child.logprobs = list(parent.logprobs)
            child.cumulative_logprob = parent.cumulative_logprob
        child.status = Status.RUNNING
        parent.request.seqs.append(child)
        parent.request.unfinished.append(child)
        children.append(child)
    running[at:at] = children
    return children
