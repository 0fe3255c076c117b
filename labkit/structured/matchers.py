"""Each sample's place in its grammar, and the masks that follow from it.

A constrained request gets one XGrammar ``GrammarMatcher`` per sample (``n`` of them), made
from its compiled grammar when its first token is sampled and advanced by every token its
sample gains. A matcher is a pushdown automaton's state: the stack of grammar rules the
text so far is inside of. From it XGrammar fills the sample's bitmask row: the
context-independent tokens from the masks precomputed at compile time, the few
context-dependent ones by running them against the stack.

``GrammarMatchers`` is what the executor talks to: ``mask`` fills and applies the rows of a
batch that ask (the others are not touched: a request that asks for nothing pays nothing),
``accept`` advances matchers by the tokens sampled. Matchers are keyed by (request, sample
index): they survive preemption, swapping and recomputation, since every token is kept, and
they are dropped when their request finishes.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from .bitmask import allocate_bitmask, apply_bitmask
from .compiler import GrammarCache
from .params import StructuredOutputsParams


#: From this many rows a batch's bitmask is filled by XGrammar's thread pool (with more than
#: one thread to spare): below it, or on a machine whose cores the model's own threads keep
#: busy, one row after another on the engine's thread is faster (a row takes microseconds).
PARALLEL_FILL_ROWS = 64


def default_fill_threads() -> int:
    """Threads for filling bitmasks: half the cores this process may use (the model's matmuls
    want the rest), at most 8; 1 on a machine with fewer than 4."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:          # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores // 2)) if cores >= 4 else 1


@dataclass(slots=True)
class MaskRow:
    """One row of logits to mask: its row number, whose matcher, and the drafted tokens to
    assume accepted first (jump-forward's verification rows; empty otherwise)."""

    row: int
    request: object
    index: int
    assumed: tuple[int, ...] = ()


class GrammarMatchers:
    """The matchers of every running constrained sample, their grammars and their masks.

    ``mask_s`` is the time spent filling and applying masks, ``num_masked_rows`` the rows
    masked and ``num_mask_calls`` the batches that had any (``stats()``)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_threads: int | None = None):
        max_threads = default_fill_threads() if max_threads is None else max_threads
        self.grammars = GrammarCache(tokenizer, vocab_size, stop_token_ids, max_threads=max_threads)
        self.vocab_size = vocab_size
        # Tokens no grammar ever allows (special tokens, blanked in the vocabulary): a draft that
        # proposes one is cut there without asking a matcher, which would log a warning for it.
        self.never_allowed = frozenset(self.grammars.info.special_token_ids) - set(stop_token_ids)
        self._matchers: dict[object, list] = {}   # request -> one matcher per sample index (None: not yet)
        self._batch = None                         # xgrammar.BatchGrammarMatcher, made on first use
        self._bitmask = allocate_bitmask(0, vocab_size)
        self.max_threads = max_threads
        # Called as observer(rows, raw logits of those rows, their bitmask rows) whenever a batch
        # is masked: how the chapter's widget sees each step (labkit.viz.structured). None: nothing.
        self.observer = None
        self.mask_s = 0.0
        self.num_masked_rows = 0
        self.num_mask_calls = 0

    # ---- matchers --------------------------------------------------------------------
    def check(self, params: StructuredOutputsParams) -> None:
        """Compile ``params``' grammar now (cached): ``ValueError`` if it cannot be."""
        self.grammars.compile(params)

    def matcher(self, request, index: int):
        """The matcher of ``request``'s sample ``index``, made at its grammar's start when new."""
        import xgrammar as xgr

        slots = self._matchers.get(request)
        if slots is None:
            slots = self._matchers[request] = [None] * max(1, request.params.n)
        if index >= len(slots):
            slots.extend([None] * (index + 1 - len(slots)))
        if slots[index] is None:
            compiled = self.grammars.compile(request.params.structured_outputs)
            slots[index] = xgr.GrammarMatcher(compiled)
        return slots[index]

    def accept(self, request, index: int, tokens: list[int]) -> None:
        """Advance sample ``index`` of ``request`` by ``tokens``. A token its mask forbade is
        a bug (the sampler only draws allowed tokens): raised, never silently dropped."""
        m = self.matcher(request, index)
        for t in tokens:
            if not m.accept_token(t):
                raise RuntimeError(f"request {request.request_id!r}: token {t} is not allowed by its grammar, "
                                   "yet it was sampled (a masking bug)")

    def is_terminated(self, request, index: int) -> bool:
        """Whether sample ``index`` has ended its grammar (accepted a stop token)."""
        return self.matcher(request, index).is_terminated()

    def forget_finished(self) -> None:
        """Drop the matchers of requests that have finished (or were aborted)."""
        for request in [r for r in self._matchers if r.finished]:
            del self._matchers[request]

    @property
    def num_tracked_requests(self) -> int:
        return len(self._matchers)

    # ---- masks -------------------------------------------------------------------------
    def fill(self, rows: list[MaskRow], num_rows: int) -> torch.Tensor:
        """A ``[num_rows, words]`` bitmask whose ``rows`` are filled from their matchers'
        states (the other rows hold whatever a previous step left: only ``rows`` are applied).
        Plain rows are filled one after another (or by XGrammar's thread pool, for a large
        batch); a verification row advances its matcher by its assumed tokens, fills, and
        rolls back."""
        import xgrammar as xgr

        if self._bitmask.shape[0] < num_rows:
            self._bitmask = allocate_bitmask(max(num_rows, 2 * self._bitmask.shape[0]), self.vocab_size)
        bitmask = self._bitmask[:num_rows]
        plain = [r for r in rows if not r.assumed]
        if self.max_threads > 1 and len(plain) >= PARALLEL_FILL_ROWS:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(self.max_threads)
            self._batch.batch_fill_next_token_bitmask([self.matcher(r.request, r.index) for r in plain],
                                                      bitmask, indices=[r.row for r in plain])
            plain = []
        for r in plain:
            self.matcher(r.request, r.index).fill_next_token_bitmask(bitmask, r.row)
        for r in rows:
            if r.assumed:
                m = self.matcher(r.request, r.index)
                for t in r.assumed:
                    if not m.accept_token(t):
                        raise RuntimeError(f"drafted token {t} is not allowed by the grammar that drafted it")
                m.fill_next_token_bitmask(bitmask, r.row)
                m.rollback(len(r.assumed))
        return bitmask

    def mask(self, logits: torch.Tensor, rows: list[MaskRow]) -> None:
        """Set every token the grammar forbids to ``-inf`` on ``rows`` of ``logits``, in place."""
        if not rows:
            return
        t0 = time.perf_counter()
        bitmask = self.fill(rows, logits.shape[0])
        t1 = time.perf_counter()
        if self.observer is not None:        # outside the timing: a widget's copies are not the mask's cost
            index = [r.row for r in rows]
            self.observer(rows, logits[index].detach().float().cpu(), bitmask[index].clone())
        t2 = time.perf_counter()
        apply_bitmask(logits, bitmask, [r.row for r in rows])
        self.mask_s += (t1 - t0) + (time.perf_counter() - t2)
        self.num_masked_rows += len(rows)
        self.num_mask_calls += 1

    def stats(self) -> dict:
        g = self.grammars
        return {"num_grammars_cached": len(g), "grammar_cache_hits": g.hits, "grammar_cache_misses": g.misses,
                "grammar_compile_s": g.compile_s, "mask_s": self.mask_s, "num_masked_rows": self.num_masked_rows,
                "num_mask_calls": self.num_mask_calls}
