"""What a proposer is: something that guesses a sequence's next tokens before the step.

A proposer's ``propose(seq, room)`` returns a ``Draft`` of at most ``room`` tokens that
would follow ``seq``'s tokens, or None. The speculator asks it before the scheduler plans;
the draft's tokens join the sequence and are verified by the step's forward pass.

Proposers that run a model (``draft.DraftLayersProposer``, ``draft.DraftModelProposer``)
draft *after* a step instead, for the next one (as vLLM does): their ``needs_lookahead`` is
true, and ``draft_next`` runs on slots reserved past the step's chunk. ``propose`` then
hands over what ``draft_next`` computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..request import Sequence


@dataclass(slots=True)
class Draft:
    """Guessed tokens for one sequence, and where they came from.

    ``probs`` (``[len(tokens), vocab]``): the distributions q the tokens were sampled from,
    when they were (a model draft with ``draft_sampling="sample"``); None for point masses
    (prompt lookup, a grammar's forced tokens, a draft's argmax)."""

    tokens: list[int]
    proposer: str
    probs: torch.Tensor | None = None

    def cut(self, n: int) -> Draft:
        """The first ``n`` tokens of this draft."""
        return Draft(self.tokens[:n], self.proposer, None if self.probs is None else self.probs[:n])


class Proposer(Protocol):
    name: str
    needs_lookahead: bool       # drafts by running a model after the step (slots reserved for it)

    def propose(self, seq: Sequence, room: int) -> Draft | None: ...
