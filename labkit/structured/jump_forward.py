"""Jump-forward decoding: where a grammar forces the next tokens, compute them in one step.

After ``{"name": "Ada", `` a schema with an ``age`` property leaves no choice: the next text
is ``"age": ``. Decoding it the plain way costs one step per token, each a forward pass that
can only confirm what the grammar already knew. SGLang's compressed finite-state machine
skips such stretches; labkit does it in four moves, around the engine's ordinary step:

1. **draft** (before the scheduler plans): for a constrained sequence that is decoding, ask
   its matcher for the tokens the grammar forces next (XGrammar's
   ``find_jump_forward_tokens``) and append them to the sequence. To the scheduler they are
   ordinary tokens without KV yet: it plans them in the sequence's chunk and gives them
   slots in its blocks like any other (``BlockManager.allocate_slots``), within the token
   budget;
2. **fit** (after it planned): drafts that got no slot (the sequence was not scheduled,
   was preempted, or its chunk ends before them) are taken back out; the chunk of a
   drafting sequence is a decode of several tokens, computed as one chunk;
3. **verify** (in the executor): the chunk returns logits at every position, and each
   position is sampled exactly as a step of its own would have sampled it: the grammar's
   mask for the state after the drafts before it, the same penalties, the same seeded
   generator. The first drafted token that differs from its sample ends the jump, and that
   sample is the step's token;
4. **settle** (before the scheduler's update): the drafted tokens after it give their slots
   back (``BlockTable.truncate``; a block left empty returns to the pool).

So a jump never changes the output: greedy tokens equal step-by-step masked decoding, and so
do seeded samples (each position draws from its own generator). A draft can still be
rejected, although the grammar forces its *text*: the tokenizer may spell that text in
several ways (``":`` or ``"`` + ``:``), and the model's choice wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..request import Sequence, Status
from .matchers import GrammarMatchers

#: The most tokens drafted for one sequence in one step.
MAX_JUMP = 16


@dataclass(slots=True)
class JumpStats:
    """Counters since the engine started: drafted and accepted tokens, the steps that drafted."""

    num_drafted: int = 0
    num_accepted: int = 0
    num_jumps: int = 0                  # sequence-steps that carried at least one draft
    num_dropped: int = 0                # drafts taken back before they ran (no slot this step)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0


@dataclass(slots=True)
class JumpForward:
    """The drafts of the step in flight, and what became of them.

    Invariant between engine steps: no sequence holds a drafted token (every draft was
    accepted, became part of the output, or was taken back out with its slot)."""

    grammars: GrammarMatchers
    max_tokens: int = MAX_JUMP
    stats: JumpStats = field(default_factory=JumpStats)
    _drafts: dict[Sequence, int] = field(default_factory=dict)        # seq -> drafted tokens at its end
    _accepted: dict[Sequence, int] = field(default_factory=dict)      # seq -> drafts the model agreed with
    _logprobs: dict[Sequence, list] = field(default_factory=dict)     # seq -> the accepted drafts' logprobs

    # ---- 1. draft -----------------------------------------------------------------------
    def draft(self, scheduler) -> None:
        """Append the tokens each decoding constrained sequence's grammar forces next. A
        sequence drafts only while its blocks for them fit beside one free block per running
        sequence: speculative slots must not preempt anybody."""
        allocator = scheduler.allocator
        spare = allocator.num_free_blocks - len(scheduler.running)
        for seq in scheduler.running:
            params = seq.request.params
            if (params.structured_outputs is None or seq.request.beam is not None or seq.status is not Status.RUNNING
                    or seq.num_uncomputed_tokens != 1 or seq.num_output_tokens == 0):
                continue
            matcher = self.grammars.matcher(seq.request, seq.index)
            if matcher.is_terminated():
                continue
            room = min(self.max_tokens, params.max_tokens - seq.num_output_tokens - 1)
            if scheduler.max_model_len is not None:
                room = min(room, scheduler.max_model_len - len(seq.token_ids) - 1)
            if room <= 0:
                continue
            tokens = matcher.find_jump_forward_tokens()[:room]
            if not tokens:
                continue
            table = seq.block_table
            need = table.blocks_needed(1 + len(tokens)) - table.blocks_needed(1)
            if need > spare:
                continue
            spare -= need
            seq.token_ids.extend(tokens)
            self._drafts[seq] = len(tokens)
            self.stats.num_drafted += len(tokens)

    # ---- 2. fit ---------------------------------------------------------------------------
    def fit(self, plan) -> None:
        """Take back the drafts the plan gives no slot; mark drafting chunks as decodes (of
        several tokens: they run as one chunk) and keep multi-token chunks first, the order
        the model runner packs."""
        if not self._drafts:
            return
        items = {item.seq: item for item in plan.scheduled}
        for seq, n in list(self._drafts.items()):
            item = items.get(seq)
            if item is None or seq.status is not Status.RUNNING:
                cut = n                 # not scheduled, or preempted: no draft got a slot
            else:
                cut = min(n, len(seq.token_ids) - item.sample_position)   # past the end of its chunk
            if cut:
                del seq.token_ids[len(seq.token_ids) - cut:]
                self.stats.num_drafted -= cut
                self.stats.num_dropped += cut
            left = n - cut
            if item is not None:
                if cut and item.num_samples == 0:
                    item.sample_indices = (seq.index,)      # the chunk now ends the sequence: it samples
                item.is_prefill = False                     # a decode, of 1 + left tokens
            if left:
                self._drafts[seq] = left
                self.stats.num_jumps += 1
            else:
                del self._drafts[seq]
        plan.scheduled.sort(key=lambda item: not (item.is_prefill or item.num_new_tokens > 1))

    def num_drafts(self, item) -> int:
        """Drafted tokens at the end of ``item``'s chunk (0 for a chunk without)."""
        return self._drafts.get(item.seq, 0) if self._drafts else 0

    # ---- 3. verify (the executor reports) ------------------------------------------------------
    def verified(self, seq: Sequence, accepted: int, logprobs: list | None = None) -> None:
        """The executor's verdict: ``seq``'s first ``accepted`` drafts are what sampling chose
        (with their logprob entries, when the request asks for logprobs)."""
        self._accepted[seq] = accepted
        if logprobs:
            self._logprobs[seq] = logprobs

    # ---- 4. settle --------------------------------------------------------------------------
    def settle(self, plan, keep_empty_blocks: bool = False) -> None:
        """Give back the slots of rejected drafts, before the scheduler's update counts the
        chunk as computed: the sequence keeps its accepted drafts, the step's own token is
        appended by the update as usual. ``keep_empty_blocks``: a policy that reserves blocks
        ahead (the static baseline) keeps the blocks the drafts emptied."""
        for item in plan.scheduled:
            seq = item.seq
            n = self._drafts.pop(seq, 0)
            if not n:
                continue
            accepted = self._accepted.pop(seq, 0) if seq.status is Status.RUNNING else 0
            rejected = n - accepted
            if rejected:
                del seq.token_ids[len(seq.token_ids) - rejected:]
                if seq.block_table is not None and not seq.block_table.freed:
                    seq.block_table.truncate(len(seq.token_ids), free_empty_blocks=not keep_empty_blocks)
                item.num_new_tokens -= rejected
            entries = self._logprobs.pop(seq, None)
            if entries and seq.logprobs is not None:
                for token, entry in zip(seq.token_ids[len(seq.token_ids) - accepted:], entries):
                    seq.logprobs.append(entry)
                    seq.cumulative_logprob += entry[token].logprob
            self.stats.num_accepted += accepted
        self._drafts.clear()
        self._accepted.clear()
        self._logprobs.clear()
