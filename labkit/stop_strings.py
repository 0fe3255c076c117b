"""Stop strings: where a growing text first holds one, at a cost per character that does
not grow with how many stop strings there are.

The obvious check, ``text.find(stop)`` for every stop string after every token, costs
(number of stop strings) x (their length) per token, on the engine's thread: one request
with 20,000 stop strings made every request in the batch wait. Here one automaton matches
all of a request's stop strings at once (Aho and Corasick, 1975): a trie of the strings,
where each node also knows the longest proper suffix of its text that is a node too (its
*fail* link). The text goes in one character at a time and moves one state, and the state
is always the longest tail of the text that begins some stop string. So:

* a stop string ends at this character exactly when a whole one is a suffix of the
  state's text (``longest match`` below, precomputed per node along the fail links);
* a stream holds back exactly the state's depth: the trailing characters that could
  still grow into a stop string (``StopMatcher.pending``), and shows the rest.

Cost: amortised O(1) per character whatever the number of stop strings (a fail step
shortens the state, which grew by at most one per character), and at most the longest
stop string's length on one character; building is linear in their total length, once per
distinct list (automata are shared while some sequence uses them).

Where the text is cut: before the stop string that *ends first*; of several ending at the
same character, the longest (it starts first). That answer depends only on the text, not
on how the tokens split it, so streaming and non-streaming agree and a stop string that
spans two tokens is found like any other. (vLLM scans its list in order and cuts at the
first string found in the new text; the two differ only when stop strings overlap inside
one token's text.)
"""

from __future__ import annotations

import weakref
from typing import Sequence


class StopStrings:
    """The Aho-Corasick automaton of a list of stop strings (immutable, shareable).

    State 0 is the root (the empty text). Per state: ``_goto`` (child by character),
    ``_fail`` (longest proper suffix that is a state), ``_depth`` (its text's length) and
    ``_match`` (length of the longest stop string that is a suffix of its text, 0: none).
    """

    __slots__ = ("strings", "max_len", "_goto", "_fail", "_depth", "_match", "_alphabet", "__weakref__")

    def __init__(self, strings: Sequence[str]):
        if not strings or not all(isinstance(s, str) and s for s in strings):
            raise ValueError("stop strings must be a non-empty list of non-empty strings")
        self.strings = tuple(strings)
        self.max_len = max(len(s) for s in self.strings)
        goto: list[dict[str, int]] = [{}]
        depth, match = [0], [0]
        for s in self.strings:                       # the trie
            node = 0
            for ch in s:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = goto[node][ch] = len(goto)
                    goto.append({})
                    depth.append(depth[node] + 1)
                    match.append(0)
                node = nxt
            match[node] = len(s)                     # a whole stop string ends here
        fail = [0] * len(goto)
        queue = list(goto[0].values())               # breadth first: a fail link points up
        for node in queue:
            for ch, child in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(ch, 0)
                # The node's own string, if it is one, is its longest suffix; else inherit.
                match[child] = match[child] or match[fail[child]]
                queue.append(child)
        self._goto, self._fail, self._depth, self._match = goto, fail, depth, match
        self._alphabet = frozenset(goto[0]).union(*goto)   # characters in any stop string

    @property
    def num_states(self) -> int:
        return len(self._goto)

    def scan(self, state: int, text: str, start: int = 0) -> tuple[int, int | None]:
        """Feed ``text[start:]`` from ``state``. Returns ``(new state, cut)``: ``cut`` is
        where the first stop string that ends in ``text[start:]`` begins (None if none
        does); the state is then the one after that stop string's last character."""
        goto, fail, match, alphabet = self._goto, self._fail, self._match, self._alphabet
        for i in range(start, len(text)):
            ch = text[i]
            if ch not in alphabet:                   # in no stop string: back to the root
                state = 0
                continue
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if match[state]:
                return state, i + 1 - match[state]
        return state, None

    def match_length(self, state: int) -> int:
        """Length of the longest stop string that ends at ``state`` (0: none does)."""
        return self._match[state]

    def depth(self, state: int) -> int:
        """How many trailing characters of the text fed so far could begin a stop string."""
        return self._depth[state]


_shared: weakref.WeakValueDictionary[tuple[str, ...], StopStrings] = weakref.WeakValueDictionary()


def stop_strings(strings: Sequence[str]) -> StopStrings:
    """The automaton for ``strings``, built once and shared while any matcher holds it (a
    request's ``n`` samples, or many requests with the same list, build it once)."""
    key = tuple(strings)
    automaton = _shared.get(key)
    if automaton is None:
        automaton = _shared[key] = StopStrings(key)
    return automaton


class StopMatcher:
    """One sequence's progress through its stop strings, fed as its text grows.

    Invariant: ``fed`` characters of the text have gone through the automaton, and
    ``state`` is where they led."""

    __slots__ = ("automaton", "state", "fed")

    def __init__(self, strings: Sequence[str] | StopStrings):
        self.automaton = strings if isinstance(strings, StopStrings) else stop_strings(strings)
        self.state = 0
        self.fed = 0

    def feed(self, text: str, armed: bool = True) -> int | None:
        """Advance over ``text[fed:]`` (the text gained since the last call: ``text`` must
        extend what was fed before). Returns where to cut ``text`` (the start of the first
        stop string that ends in the new part) or None. With ``armed=False`` (``min_tokens``
        not reached yet) the text is followed but no stop string counts."""
        cut = None
        start = self.fed
        while True:
            self.state, cut = self.automaton.scan(self.state, text, start)
            if cut is None or armed:
                break
            start = cut + self.automaton.match_length(self.state)      # ignored: keep going
        self.fed = len(text) if cut is None else cut + self.automaton.match_length(self.state)
        return cut

    @property
    def pending(self) -> int:
        """Trailing characters of the text fed so far that could still become a stop
        string: what a stream holds back (0 once none could)."""
        return self.automaton.depth(self.state)
