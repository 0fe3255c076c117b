"""Jump-forward decoding: where a grammar forces the next tokens, compute them in one step.

After ``{"name": "Ada", `` a schema with an ``age`` property leaves no choice: the next text
is ``"age": ``. Decoding it the plain way costs one step per token, each a forward pass that
can only confirm what the grammar already knew. SGLang's compressed finite-state machine
skips such stretches. In labkit it is speculative decoding with the grammar as the
proposer: ``JumpForward.propose`` drafts the tokens the grammar forces next (XGrammar's
``find_jump_forward_tokens``), and ``labkit.spec_decode.Speculator`` does the rest, as for
every proposer:

1. **draft** (before the scheduler plans): the forced tokens are appended to the sequence;
   to the scheduler they are tokens without KV yet, planned in its chunk within the token
   budget, given slots by ``BlockManager.allocate_slots``;
2. **fit** (after it planned): drafts that got no slot are taken back out;
3. **verify** (in the executor): each drafted position is sampled exactly as a step of its
   own would have sampled it (the grammar's mask for the state after the drafts before it,
   the same penalties, the same seeded generator); the first drafted token that differs from
   its sample ends the jump, and that sample is the step's token;
4. **settle**: the drafted tokens after it give their slots back (``BlockTable.truncate``; a
   block left empty returns to the pool).

So a jump never changes the output: greedy tokens equal step-by-step masked decoding, and so
do seeded samples (each position draws from its own generator). A draft can still be
rejected, although the grammar forces its *text*: the tokenizer may spell that text in
several ways (``":`` or ``"`` + ``:``), and the model's choice wins.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..request import Sequence
from ..spec_decode.proposer import Draft
from ..spec_decode.speculator import SpecDecodeStats
from .matchers import GrammarMatchers

#: The most tokens drafted for one sequence in one step.
MAX_JUMP = 16


@dataclass(slots=True)
class JumpForward:
    """The grammar as a proposer: for a constrained sequence, the tokens its grammar forces next.

    ``stats`` counts its drafts only (the speculator keeps them per proposer)."""

    grammars: GrammarMatchers
    speculator: object = None           # the Speculator whose counters ``stats`` reads
    max_tokens: int = MAX_JUMP
    name: str = "jump_forward"
    needs_lookahead = False

    def propose(self, seq: Sequence, room: int) -> Draft | None:
        """The forced tokens of ``seq``'s grammar, at most ``min(max_tokens, room)`` of them."""
        if seq.request.params.structured_outputs is None:
            return None
        matcher = self.grammars.matcher(seq.request, seq.index)
        if matcher.is_terminated():
            return None
        tokens = matcher.find_jump_forward_tokens()[:min(self.max_tokens, room)]
        return Draft(list(tokens), self.name) if tokens else None

    @property
    def stats(self) -> SpecDecodeStats:
        """Counters of the jumps since the engine started (``num_drafted``, ``num_accepted``,
        ``num_jumps``, ``num_dropped``)."""
        if self.speculator is None:
            return SpecDecodeStats()
        return self.speculator.stats_of(self.name)
