"""Beam groups: a beam-search request's beams are planned, admitted and stepped together.

The scheduler's collaborator for beam search (``labkit.beam_search`` decides which beams
live; this module applies its verdict to the scheduler's sequences). The beams of one
request step together: every beam must have its next-token log-probabilities before the
search can choose, so they run in the same batch, are preempted together (``Scheduler``,
``Swapper``) and are admitted all or none. After each step, beams that no candidate
continues die at once (their blocks return before anyone copies), and a beam with several
children forks, its children sharing every block (``memory.beam_successors``: the same
rule chapter 9's ``BeamTree`` replays).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..memory import beam_successors
from ..request import Request, Sequence, Status
from .plan import StepPlan
from .records import SchedulerOutput

if TYPE_CHECKING:   # the scheduler owns its beam groups; the import is for type hints only
    from .scheduler import Scheduler


class BeamGroups:
    """The beam-search side of one scheduler, and its counters."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.num_forks = 0                # beams forked from a parent beam
        self.num_deaths = 0               # beams that no candidate continued: freed at once

    def schedule_running(self, i: int, plan: StepPlan) -> int:
        """The running phase for the beams of one request, ``running[i]`` the first of them
        (a request's running beams sit next to each other: forks go after their parent, groups
        are admitted and swapped in together). Each beam computes its missing tokens, but its
        last one (whose log-probabilities feed the beam step) only in an iteration where
        every beam of the request computes its last one. When the blocks run short the
        newest sequences give way, maybe these beams themselves. Returns the index of the
        next sequence to plan."""
        running = self.scheduler.running
        request = running[i].request
        end = i
        while end < len(running) and running[end].request is request:
            end += 1
        group = running[i:end]
        todo = [s.num_uncomputed_tokens for s in group]
        last = len(group) == len(request.live_beams) and sum(todo) <= plan.budget
        counts, left = [], plan.budget
        for t in todo:
            n = max(0, min(t if last else t - 1, left))
            counts.append(n)
            left -= n
        return end if self.scheduler.grow(i, group, counts, plan) else i

    def admit(self, group: list[Sequence], budget: int) -> list[int] | None:
        """Admit every waiting beam of one request, or none (returns None, changing nothing
        but prefix-cache recency, and what the blocks it took for a moment evicted: with a host
        tier, those are offloaded, and its loads are dropped); else the tokens each computes now.
        As in the running phase, a beam computes its last token only if all of them can in this
        iteration."""
        sched = self.scheduler
        hits = [sched.blocks.find_cached_prefix(sched.new_table(s), s.token_ids, len(s.token_ids) - 1).num_tokens
                for s in group]
        last = sum(len(s.token_ids) - h for s, h in zip(group, hits, strict=True)) <= budget
        counts, left = [], budget
        for seq, h in zip(group, hits, strict=True):
            cap = left if last else max(0, min(left, len(seq.token_ids) - 1 - h))
            n = sched.admit(seq, cap)
            if n is None:
                for done in group[:len(counts)]:     # undo: the group waits whole
                    done.block_table.free()
                    done.block_table = None
                    done.num_computed_tokens = done.num_cached_tokens = 0
                return None
            counts.append(n)
            left -= n
        return counts

    def take_logprobs(self, beam: Sequence, logprobs: list[dict] | None) -> None:
        """Keep the next-token log-probabilities the executor gave ``beam`` (one ``{token:
        Logprob}``, for its one sample) until every beam of its request has its own."""
        if not logprobs:
            raise ValueError(f"{beam}: beam search needs the executor's log-probabilities, got none")
        beam.beam_logprobs = {t: lp.logprob for t, lp in logprobs[0].items()}

    def step_ready(self, output: SchedulerOutput, now: float) -> list[Request]:
        """A beam step for every beam-search request of ``output`` whose beams all have their
        log-probabilities now (beams back from host memory may complete a request); returns
        the requests whose search is over."""
        requests = {s.seq.request.request_id: s.seq.request for s in output.scheduled if s.num_samples}
        requests.update((s.request.request_id, s.request) for s in output.swapped_in)
        finished = []
        for request in requests.values():
            if request.beam is not None and (done := self.step(request, now)) is not None:
                finished.append(done)
        return finished

    def step(self, request: Request, now: float) -> Request | None:
        """Once every live beam of ``request`` has its next-token log-probabilities: one step
        of beam search (``labkit.beam_search``), applied to the sequences. Beams that no
        candidate continues die first (their blocks return at once, before anyone copies);
        then each surviving parent keeps its first child in its own sequence and forks one
        sequence per further child, sharing every block (the partly filled last block is
        copied on write when the children append). Returns the request when the search is
        over (its hypotheses are ``request.beam_search.outputs()``), else None."""
        sched = self.scheduler
        beams = request.live_beams
        if not beams:
            return None                         # aborted while the batch ran: nothing to do
        if any(b.beam_logprobs is None or b.status is not Status.RUNNING for b in beams):
            return None                         # a beam is still computing: they step together
        search = request.beam_search
        length = beams[0].num_output_tokens + 1
        step = search.step([(b.output_token_ids, b.cumulative_logprob, b.beam_logprobs) for b in beams], length)
        for b in beams:
            b.beam_logprobs = None
        if request.first_token_time is None:
            request.first_token_time = now
        if step.done:
            reason = "length" if length >= search.max_new_tokens else "stop"
            retired = None
            for b in beams:
                retired = sched.finish_sequence(b, reason, now) or retired
            return retired
        children = beam_successors(len(beams), [c.parent for c in step.running])
        for b, kids in zip(beams, children, strict=True):
            if not kids:
                sched.finish_sequence(b, "pruned", now)
                self.num_deaths += 1
        for b, kids in zip(beams, children, strict=True):
            if kids:
                family = [b] + sched.fork_children(b, len(kids) - 1)
                self.num_forks += len(kids) - 1
                for member, k in zip(family, kids, strict=True):
                    c = step.running[k]
                    member.token_ids.append(c.token)
                    member.cumulative_logprob = c.cum_logprob
                    sched.num_generated_tokens += 1
        request.forked = True
        return None
