"""Speculative decoding around the engine's step: draft, fit, verify, settle.

Decoding one token per step reads every weight of the model once per step, and at small
batches that read is the step's whole cost: the arithmetic for one token or for five is
about the same. So if something cheap can *guess* the next few tokens, one forward pass can
check them all, and each right guess is a token for free. What guesses is a *proposer*
(``proposer.py``): prompt lookup (``ngram.py``), the target's own first layers or a small
model (``draft.py``), or a grammar that forces its next tokens (jump-forward decoding,
``labkit.structured.jump_forward``). The ``Speculator`` is the mechanism they share, in four
moves around the engine's ordinary step:

1. **draft** (before the scheduler plans): each decoding sequence may get a proposer's
   guesses appended to its tokens. To the scheduler they are tokens without K/V, like a
   prompt's: it plans them in the sequence's chunk, counts them against the token budget and
   gives them slots through ``BlockManager.allocate_slots``, like any other. A sequence
   drafts only while the blocks its guesses need fit beside one free block per running
   sequence, and the guesses of all sequences fit in the token budget beside everyone's own
   token: speculation must not preempt anybody, nor starve anybody;
2. **fit** (after it planned): guesses that got no slot (the sequence was not scheduled, or
   its chunk ends before them) are taken back out. A drafting chunk is a decode of several
   tokens; the runner computes it as one chunk. A proposer that drafts with a model after
   the step (for the next one) gets its slots now: ``num_lookahead_tokens`` past the chunk;
3. **verify** (in the executor): the chunk returns logits at each position; each position is
   judged as ``rejection.py`` says (the point-mass rule reproduces decoding's very tokens).
   The first rejected guess ends it; the token sampled there is the step's own. So does a
   kept guess that would end the sequence (a stop token, a stop string): decoding would
   have stopped there;
4. **settle** (before the scheduler's update): the rejected guesses and the lookahead give
   their slots back (``BlockTable.truncate``; a block left empty returns to the pool); the
   kept ones stay, with their logprobs, as tokens of the sequence.

Invariant between engine steps: no sequence holds a guess or a lookahead slot (every guess
was kept, or taken back out with its slot).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..memory import Growth
from ..request import Sequence, Status
from .proposer import Draft, Proposer


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters since the engine started, in vLLM's names (``docs/stats.md``).

    ``num_drafts``: sequence-steps that verified at least one guess; ``num_draft_tokens``:
    guesses verified; ``num_accepted_tokens``: guesses kept; ``num_dropped``: guesses that
    never ran: no room for them in the step's token budget or the block pool, or no slot in
    the plan. ``accepted_per_position[j]`` counts the
    ``j``-th guesses of a draft that were kept, ``drafted_per_position[j]`` those verified."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_dropped: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Kept guesses / verified guesses (0.0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a drafting step gives a sequence, on average: its kept guesses plus its own
        token (vLLM's "mean acceptance length"; 1.0 before any draft)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def add(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for counts, n in ((self.drafted_per_position, drafted), (self.accepted_per_position, accepted)):
            counts.extend([0] * (n - len(counts)))
            for j in range(n):
                counts[j] += 1

    # Jump-forward's names (docs/structured_outputs.md, chapter 12)
    num_drafted = property(lambda self: self.num_draft_tokens)
    num_accepted = property(lambda self: self.num_accepted_tokens)
    num_jumps = property(lambda self: self.num_drafts)

    def as_dict(self, prefix: str = "spec_decode_") -> dict:
        return {f"{prefix}num_drafts": self.num_drafts, f"{prefix}num_draft_tokens": self.num_draft_tokens,
                f"{prefix}num_accepted_tokens": self.num_accepted_tokens,
                f"{prefix}num_dropped_tokens": self.num_dropped,
                f"{prefix}acceptance_rate": self.acceptance_rate,
                f"{prefix}mean_acceptance_length": self.mean_acceptance_length}


@dataclass(slots=True)
class DraftOutcome:
    """What one sequence's guesses became in one step (the widget draws these).

    ``drafted``: the guesses verified, from ``first_position`` on; ``accepted``: how many were
    kept; ``token``: the step's own token after them (None when the step sampled none);
    ``lookahead``: slots reserved past the chunk for the next step's model draft. Blocks are
    the sequence's block ids while the step ran and after its slots were given back."""

    request_id: str
    index: int
    proposer: str
    first_position: int
    drafted: list[int]
    accepted: int
    token: int | None
    lookahead: int
    blocks_during: list[int]
    blocks_after: list[int]
    block_size: int

    @property
    def slots_given_back(self) -> int:
        return len(self.drafted) - self.accepted + self.lookahead


@dataclass(slots=True)
class SpecStep:
    """One engine step's outcomes (``Speculator.observer`` receives it)."""

    step: int
    outcomes: list[DraftOutcome]


class Speculator:
    """The guesses of the step in flight, and what became of them.

    ``proposers`` are asked in order; the first that guesses anything for a sequence wins (a
    grammar's forced tokens before prompt lookup). ``grammars()`` returns the engine's grammar
    matchers (None before a constrained request came): a constrained sequence's guesses from
    any other proposer are cut before the first token its grammar forbids.
    ``disable_by_batch_size`` (vLLM's): proposers other than the grammar's rest in a step whose
    running batch is larger (the gain fades as the batch grows; docs/speculative_decoding.md).
    ``stop_strings(seq, tokens)``: the index of the first of ``tokens`` after which ``seq``'s
    text would hold a stop string (the engine answers), or None."""

    def __init__(self, proposers: list[Proposer], grammars: Callable[[], object] = lambda: None,
                 disable_by_batch_size: int | None = None):
        self.proposers = list(proposers)
        self.grammars = grammars
        self.disable_by_batch_size = disable_by_batch_size
        self.stats = SpecDecodeStats()
        self.by_proposer: dict[str, SpecDecodeStats] = {}
        self.stop_strings: Callable[[Sequence, list[int]], int | None] | None = None
        self.observer: Callable[[SpecStep], None] | None = None
        self.step_drafted = 0             # guesses verified in the last step
        self.step_accepted = 0            # of which kept
        self._drafts: dict[Sequence, Draft] = {}
        self._lookahead: dict[Sequence, int] = {}
        self._accepted: dict[Sequence, tuple[int, int | None]] = {}    # seq -> (kept, the step's token)
        self._logprobs: dict[Sequence, list] = {}
        self._before: dict[Sequence, int] = {}       # seq -> its output tokens before its guesses
        self._eos: frozenset[int] = frozenset()

    def stats_of(self, proposer: str) -> SpecDecodeStats:
        """The counters of one proposer's guesses (``"ngram"``, ``"jump_forward"``, ...)."""
        return self.by_proposer.setdefault(proposer, SpecDecodeStats())

    def active(self, batch: int) -> list[Proposer]:
        """The proposers that draft in a step with ``batch`` running sequences."""
        limit = self.disable_by_batch_size
        if limit is None or batch <= limit:
            return self.proposers
        return [p for p in self.proposers if p.name == "jump_forward"]

    # ---- 1. draft -----------------------------------------------------------------------
    def draft(self, scheduler) -> None:
        """Append guesses to the decoding sequences (module docstring, move 1)."""
        self._eos = scheduler.eos_token_ids
        running = scheduler.running
        proposers = self.active(len(running))
        if proposers:
            spare = scheduler.allocator.num_free_blocks - len(running)
            budget = scheduler.max_num_batched_tokens - sum(s.num_uncomputed_tokens for s in running)
            for seq in running:
                room = _room(seq, scheduler.max_model_len)
                if room <= 0 or not _decoding(seq):
                    continue
                draft = next((d for p in proposers if (d := p.propose(seq, room)) is not None and d.tokens), None)
                if draft is None:
                    continue
                if seq.request.params.structured_outputs is not None and draft.proposer != "jump_forward":
                    draft = draft.cut(self._grammar_prefix(seq, draft.tokens))
                n = min(len(draft.tokens), max(budget, 0))
                table = seq.block_table
                need = table.blocks_needed(1 + n) - table.blocks_needed(1)
                if need > spare:
                    n = 0
                self._drop(draft.proposer, len(draft.tokens) - n)    # no room in this step for them
                if n == 0:
                    continue
                spare -= need
                budget -= n
                self._before[seq] = seq.num_output_tokens
                seq.token_ids.extend(draft.tokens[:n])
                self._drafts[seq] = draft.cut(n)
        for p in self.proposers:            # a model's guesses are for one step only
            if hasattr(p, "forget"):
                p.forget()

    def _drop(self, proposer: str, n: int) -> None:
        """Count ``n`` guesses that will not run in this step (no slot, no token budget)."""
        self.stats.num_dropped += n
        self.stats_of(proposer).num_dropped += n

    def _grammar_prefix(self, seq: Sequence, tokens: list[int]) -> int:
        """How many leading ``tokens`` the sequence's grammar allows, one after the other."""
        grammars = self.grammars()
        if grammars is None:
            return 0
        matcher = grammars.matcher(seq.request, seq.index)
        n = 0
        for t in tokens:
            if t in grammars.never_allowed or matcher.is_terminated() or not matcher.accept_token(t):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return n

    # ---- 2. fit ---------------------------------------------------------------------------
    def fit(self, plan, scheduler) -> None:
        """Take back the guesses the plan gives no slot; mark drafting chunks as decodes (of
        several tokens: they run as one chunk) and keep multi-token chunks first, the order
        the model runner packs; reserve lookahead slots for model proposers."""
        items = {item.seq: item for item in plan.scheduled}
        for seq, draft in list(self._drafts.items()):
            n = len(draft.tokens)
            item = items.get(seq)
            if item is None or seq.status is not Status.RUNNING:
                cut = n                 # not scheduled, or preempted: no guess got a slot
            else:
                cut = min(n, len(seq.token_ids) - item.sample_position)   # past the end of its chunk
            if cut:
                del seq.token_ids[len(seq.token_ids) - cut:]
                self._drop(draft.proposer, cut)
            if item is not None:
                if cut and item.num_samples == 0:
                    item.sample_indices = (seq.index,)      # the chunk now ends the sequence: it samples
                item.is_prefill = False                     # a decode, of 1 + the guesses left
            if n - cut:
                self._drafts[seq] = draft.cut(n - cut)
            else:
                del self._drafts[seq]
                self._before.pop(seq, None)
        if self._drafts:
            plan.scheduled.sort(key=lambda item: not (item.is_prefill or item.num_new_tokens > 1))
        k = max((p.k for p in self.active(len(scheduler.running)) if p.needs_lookahead), default=0)
        if k:
            self._reserve_lookahead(plan, scheduler, k)

    def _reserve_lookahead(self, plan, scheduler, k: int) -> None:
        """Slots past the chunk of each sequence that samples one token this step, where a model
        proposer writes its guesses' K/V after the step (up to ``k``, within the sequence's
        length). A sequence the pool cannot serve now simply guesses nothing next step."""
        for item in plan.scheduled:
            seq = item.seq
            if item.num_samples != 1 or seq.request.beam is not None or seq.status is not Status.RUNNING:
                continue
            n = min(k, scheduler.max_len(seq.request) - item.sample_position)
            if n > 0 and scheduler.blocks.allocate_slots([Growth(seq.block_table, (), n)]) is not None:
                self._lookahead[seq] = n
        scheduler.add_tier_copies(plan)     # blocks these slots evicted go to the host tier first

    def draft_of(self, item) -> Draft | None:
        """The guesses at the end of ``item``'s chunk (None for a chunk without)."""
        return self._drafts.get(item.seq) if self._drafts else None

    def lookahead_of(self, seq: Sequence) -> int:
        """Slots reserved past ``seq``'s chunk this step for a model proposer (0: none)."""
        return self._lookahead.get(seq, 0)

    # ---- 3. verify (the executor reports) ------------------------------------------------------
    def first_finish(self, seq: Sequence, tokens: list[int]) -> int | None:
        """The index of the first of ``tokens`` (guesses the step keeps, in order) that would
        end ``seq`` as a token of its own: a stop token, EOS, a stop string; None if none
        does. ``max_tokens`` and the model's length need no check: guesses never pass them."""
        params = seq.request.params
        before = self._before.get(seq, seq.num_output_tokens)
        for j, t in enumerate(tokens):
            if before + j + 1 >= params.min_tokens and (
                    t in params.stop_token_ids or (not params.ignore_eos and t in self._eos)):
                return j
        if params.stop and self.stop_strings is not None:
            return self.stop_strings(seq, tokens)
        return None

    def verified(self, seq: Sequence, accepted: int, token: int | None, logprobs: list | None = None) -> None:
        """The executor's verdict: ``seq``'s first ``accepted`` guesses stay, ``token`` follows
        them (with the kept guesses' logprob entries, when the request asks for logprobs)."""
        self._accepted[seq] = (accepted, token)
        if logprobs:
            self._logprobs[seq] = logprobs

    def first_positions(self) -> dict[Sequence, int]:
        """Each drafting sequence's position of its first guess (while the step is in flight)."""
        return {seq: len(seq.token_ids) - len(d.tokens) for seq, d in self._drafts.items()}

    # ---- 4. settle --------------------------------------------------------------------------
    def settle(self, plan, scheduler, keep_empty_blocks: bool = False) -> None:
        """Give back the slots of rejected guesses and of the lookahead, before the scheduler's
        update counts the chunk as computed: the sequence keeps its accepted guesses; the step's
        own token is appended by the update as usual. ``keep_empty_blocks``: a policy that
        reserves blocks ahead (the static baseline) keeps the blocks this empties."""
        outcomes: list[DraftOutcome] = []
        self.step_drafted = self.step_accepted = 0
        for item in plan.scheduled:
            seq = item.seq
            draft = self._drafts.pop(seq, None)
            lookahead = self._lookahead.pop(seq, 0)
            self._before.pop(seq, None)
            if draft is None and not lookahead:
                continue
            tokens = draft.tokens if draft is not None else []
            accepted, token = self._accepted.pop(seq, (0, None))
            if seq.status is not Status.RUNNING:
                accepted = 0
            first = len(seq.token_ids) - len(tokens)
            rejected = len(tokens) - accepted
            if rejected:
                del seq.token_ids[len(seq.token_ids) - rejected:]
                item.num_new_tokens -= rejected
            table = seq.block_table
            during = list(table.block_ids) if table is not None else []
            if table is not None and not table.freed:
                table.truncate(len(seq.token_ids), free_empty_blocks=not keep_empty_blocks)
            entries = self._logprobs.pop(seq, None)
            if entries and seq.logprobs is not None:
                for t, entry in zip(seq.token_ids[len(seq.token_ids) - accepted:], entries, strict=True):
                    seq.logprobs.append(entry)
                    seq.cumulative_logprob += entry[t].logprob
            if tokens:
                self.stats.add(len(tokens), accepted)
                self.stats_of(draft.proposer).add(len(tokens), accepted)
                self.step_drafted += len(tokens)
                self.step_accepted += accepted
                scheduler.num_generated_tokens += accepted
            if self.observer is not None:
                outcomes.append(DraftOutcome(seq.request.request_id, seq.index,
                                             draft.proposer if draft is not None else "",
                                             first, list(tokens), accepted, token, lookahead, during,
                                             list(table.block_ids) if table is not None else [],
                                             scheduler.block_size))
        self._drafts.clear()
        self._lookahead.clear()
        self._accepted.clear()
        self._logprobs.clear()
        self._before.clear()
        if self.observer is not None:
            self.observer(SpecStep(scheduler.step, outcomes))


def _decoding(seq: Sequence) -> bool:
    """Whether ``seq`` is a plain decoding sample: running, past its prompt, one uncomputed
    token (the one sampled last), not a beam (beams step together; they do not speculate)."""
    return (seq.status is Status.RUNNING and seq.request.beam is None and seq.num_uncomputed_tokens == 1
            and seq.num_output_tokens > 0)


def _room(seq: Sequence, max_model_len: int | None) -> int:
    """Guesses ``seq`` may take: the step's own token must still fit in ``max_tokens`` and the
    model's length after them."""
    room = seq.request.params.max_tokens - seq.num_output_tokens - 1
    if max_model_len is not None:
        room = min(room, max_model_len - len(seq.token_ids) - 1)
    return room
