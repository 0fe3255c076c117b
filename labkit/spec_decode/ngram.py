"""Prompt-lookup decoding: guess the next tokens by finding the text's tail earlier in it.

A summary quotes its document, an edited function repeats most of the original, a chat
answer names what the question named. So the last few tokens of a sequence have often
appeared before, in the prompt or the output, and what followed them then is a good guess
for what follows now. The proposer takes the longest tail of ``n`` tokens
(``prompt_lookup_max`` down to ``prompt_lookup_min``) that occurs earlier, and proposes the
``k`` tokens that followed its most recent earlier occurrence. It costs no model, no KV and
no memory: a search over token ids (vectorised with numpy), microseconds per sequence.

Its guesses are point masses (the token is certain, for the proposer): verification
samples each position as decoding would and keeps the drafts while they agree
(``rejection.accepted_prefix``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..request import Sequence
from .proposer import Draft


def lookup(tokens: list[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """The ``k`` (or fewer) tokens that followed the most recent earlier occurrence of the
    longest tail of ``tokens`` of length ``max_n`` down to ``min_n``; [] when no tail of
    those lengths occurs earlier. An occurrence must end before the last token (it may
    overlap the tail), so at least one token follows it."""
    arr = np.asarray(tokens, dtype=np.int64)
    size = len(arr)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        # windows[i] = arr[i:i + n] for the starts i whose window ends before the last token
        windows = sliding_window_view(arr[:size - 1], n)
        hits = np.flatnonzero((windows == arr[size - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n           # the token after the latest occurrence
            return arr[start:start + k].tolist()
    return []


@dataclass(slots=True)
class NgramProposer:
    """``speculative_config={"method": "ngram", ...}``: drafts from the sequence's own tokens."""

    k: int
    min_n: int
    max_n: int
    name: str = "ngram"
    needs_lookahead = False             # it computes nothing: no KV slot needed to draft

    def propose(self, seq: Sequence, room: int) -> Draft | None:
        """At most ``min(k, room)`` tokens for ``seq`` (prompt + output so far)."""
        tokens = lookup(seq.token_ids, min(self.k, room), self.min_n, self.max_n)
        return Draft(tokens, self.name) if tokens else None
