"""Plain records that pass between the scheduler, the executors and the viewers.

``SchedulerOutput`` is one iteration's plan: which sequences compute how many tokens, and
which KV blocks must be copied first (copy-on-write). ``StepRecord`` is what happened in
one iteration, kept for the widgets, plots and benchmarks: cheap, plain numbers and ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..request import Sequence


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of an iteration: compute K/V (and maybe logits) for
    ``token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens]``."""

    seq: Sequence
    num_new_tokens: int
    num_samples: int        # tokens to sample after this chunk: 0 (mid-prompt), 1, or n at a fork
    is_prefill: bool        # computing prompt (or recomputing preempted) tokens, not decoding
    start: int              # position of the first token computed (num_computed_tokens at scheduling)

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start:self.start + self.num_new_tokens]

    @property
    def phase(self) -> str:
        return "prefill" if self.is_prefill else "decode"


@dataclass(slots=True)
class SchedulerOutput:
    """The plan for one iteration. Prefill chunks come before decodes in ``scheduled``."""

    step: int
    scheduled: list[ScheduledSeq]
    copies: list[tuple[int, int]]           # (src block, dst block) KV copies to do first
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class StepRecord:
    """What one iteration did, in numbers the widgets and benchmarks read.

    ``ran`` lists ``(request_id, seq_index, num_tokens, phase)`` with phase ``"prefill"``
    or ``"decode"``. ``kv_utilization`` is filled slots / slots in held blocks.
    """

    step: int
    time_s: float                   # engine clock when the iteration started
    duration_s: float               # how long it took (measured, or the cost model's figure)
    ran: list[tuple[str, int, int, str]]
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_free_blocks: int
    num_cached_free_blocks: int
    kv_utilization: float
    preempted: list[str]            # request ids preempted before this iteration
    finished: list[str]             # request ids that finished in this iteration
    num_cached_tokens: int          # prompt tokens served from the prefix cache at admission
    num_copies: int                 # copy-on-write block copies
