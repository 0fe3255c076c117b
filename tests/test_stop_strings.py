"""Stop strings: one automaton per list, a cost per character that does not grow with the
number of stop strings, and the same cut whatever the tokens.

* the automaton against a brute-force reference: the cut (where the first stop string to
  end begins; of those ending together, the longest) and the holdback (the longest tail
  that could still become a stop string), fed in random pieces;
* the work per character, counted (not timed): with 20,000 stop strings it is what it is
  with one;
* through the engine: stop strings at the server's cap, beyond it, spanning tokens, with
  min_tokens, n > 1, both prefix-cache policies; every block free afterwards.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.stop_strings import StopMatcher, StopStrings, stop_strings


def first_cut(text: str, stops: list[str]) -> int | None:
    """The reference: the smallest end over all occurrences, then the longest stop string
    ending there; the cut is where it begins."""
    for end in range(1, len(text) + 1):
        lengths = [len(s) for s in stops if text[:end].endswith(s)]
        if lengths:
            return end - max(lengths)
    return None


def pending(text: str, stops: list[str]) -> int:
    """The reference holdback: the longest tail of ``text`` that is a proper prefix of a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def feed_in_pieces(matcher: StopMatcher, text: str, cuts: list[int]) -> int | None:
    for end in sorted(set(cuts)) + [len(text)]:
        cut = matcher.feed(text[:end])
        if cut is not None:
            return cut
    return None


ALPHABET = "abcé\U0001f600"           # few letters: stop strings overlap and recur often
texts = st.text(ALPHABET + "xyz ", max_size=40)
stop_lists = st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=1, max_size=6)


@settings(max_examples=400, deadline=None)
@given(stop_lists, texts, st.lists(st.integers(0, 40), max_size=8))
def test_the_cut_and_the_holdback_equal_the_reference_whatever_the_pieces(stops, text, cuts):
    matcher = StopMatcher(stops)
    cut = feed_in_pieces(matcher, text, [c for c in cuts if c <= len(text)])
    assert cut == first_cut(text, stops)
    if cut is None:
        assert matcher.pending == pending(text, stops)


@settings(max_examples=200, deadline=None)
@given(stop_lists, texts, st.integers(0, 40))
def test_an_unarmed_matcher_follows_the_text_and_stops_at_nothing(stops, text, armed_at):
    """min_tokens: matches ending before the matcher is armed do not count; the first one
    ending after does, even when it began before."""
    armed_at = min(armed_at, len(text))
    matcher = StopMatcher(stops)
    assert matcher.feed(text[:armed_at], armed=False) is None
    cut = matcher.feed(text)
    ends = [e for e in range(armed_at + 1, len(text) + 1) if any(text[:e].endswith(s) for s in stops)]
    assert cut == (None if not ends else ends[0] - max(len(s) for s in stops if text[:ends[0]].endswith(s)))


def test_overlapping_and_nested_stop_strings():
    assert first_cut("xabcd", ["abcd", "bc"]) == 2       # "bc" ends first: the text is "xa"
    m = StopMatcher(["abcd", "bc"])
    assert m.feed("xabcd") == 2
    m = StopMatcher(["ab", "b"])                          # both end at the same character: the longer
    assert m.feed("xab") == 1
    m = StopMatcher(["aab"])
    assert m.feed("aaa") is None and m.pending == 2 and m.feed("aaab") == 1
    m = StopMatcher(["\n\nUser:", "</s>"])
    assert m.feed("Hi.\n\nUs") is None and m.pending == 4
    assert m.feed("Hi.\n\nUse") is None and m.feed("Hi.\n\nUser:") == 3


class CountingList(list):
    """A list that counts how often it is indexed: the automaton's work, measured exactly."""

    reads = 0

    def __getitem__(self, i):
        CountingList.reads += 1
        return super().__getitem__(i)


def work_per_char(stops: list[str], text: str) -> float:
    automaton = StopStrings(stops)
    automaton._goto = CountingList(automaton._goto)
    automaton._fail = CountingList(automaton._fail)
    automaton._match = CountingList(automaton._match)
    CountingList.reads = 0
    matcher = StopMatcher(automaton)
    for end in range(1, len(text) + 1):                  # one character per token: the worst split
        assert matcher.feed(text[:end]) is None
    return CountingList.reads / len(text)


def test_the_work_per_character_does_not_grow_with_the_number_of_stop_strings():
    """The issue's attack: 20,000 distinct 8-character stop strings. Each character costs a
    few table reads, with 20,000 stop strings as with one (the old matcher did 20,000 finds)."""
    rng = random.Random(0)
    digits = "0123456789"
    text = "".join(rng.choice(digits) for _ in range(3000))     # every character walks the trie
    many = sorted({"".join(rng.choice(digits) for _ in range(8)) for _ in range(20_000)} - {
        text[i:i + 8] for i in range(len(text))})                 # none of them occurs: no early stop
    one = [many[0]]
    assert len(many) > 19_000
    heavy, light = work_per_char(many, text), work_per_char(one, text)
    # Amortised: a fail step undoes a step down the trie, so reads <= 3 x 2 per character.
    assert heavy <= 6.0 and light <= 6.0, (heavy, light)


def test_an_automaton_is_shared_while_used_and_freed_after():
    import gc
    import weakref
    a = stop_strings(("x", "y"))
    assert stop_strings(["x", "y"]) is a and StopMatcher(["x", "y"]).automaton is a
    gone = weakref.ref(a)
    del a
    gc.collect()
    assert gone() is None                                   # nobody uses it: not kept
    with pytest.raises(ValueError):
        StopStrings([])
    with pytest.raises(ValueError):
        StopStrings(["ok", ""])


# ---- through the engine ------------------------------------------------------------------
@pytest.fixture(scope="module", params=["hash", "radix"])
def llm(request):
    from labkit import LLM
    return LLM("tiny-llama", num_blocks=96, enable_prefix_caching=request.param)


def _free(llm) -> None:
    llm.allocator.check_invariants()
    llm.reset_prefix_cache()
    assert llm.allocator.num_free_blocks == llm.allocator.num_blocks
    assert llm.engine.num_tracked_sequences == 0


def test_engine_cuts_where_the_reference_does_at_and_beyond_the_cap(llm):
    """Stop strings taken from the model's own greedy text (so they do occur, spanning
    tokens), hidden among the server's cap of 32 x 128 characters, then among 20,000 (what
    the server refuses, but the offline API accepts): the same cut as the reference on the
    unstopped text, finish reason "stop"; n = 3 samples share the prompt; blocks all free."""
    from labkit import SamplingParams
    prompt = list(range(20, 60))
    free = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)
    text = free[0].outputs[0].text
    assert len(text) > 12
    rng = random.Random(1)
    wanted = [text[9:12], text[5:7] + "\x00never"]            # the first occurs; the second never
    filler = ["".join(chr(rng.randrange(0x4E00, 0x4E80)) for _ in range(rng.randint(1, 128))) for _ in range(30)]
    for stops in (wanted + filler, wanted + [f"{i:08d}" for i in range(20_000)]):
        out = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=stops, n=3),
                           use_tqdm=False)[0]
        ref = first_cut(text, stops)
        assert ref is not None and ref <= 9
        for o in out.outputs:
            assert o.text == text[:ref] and o.finish_reason == "stop"
    _free(llm)


def test_streamed_deltas_never_show_what_a_stop_string_cuts(llm):
    from labkit import SamplingParams
    prompt = list(range(30, 70))
    text = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = text[10:14]
    shown = ""
    for out in llm.generate_stream([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                            stop=[stop, text[10:12] + "\x01"])):
        shown += out.delta[0]
        assert text[:first_cut(text, [stop])].startswith(shown)       # never past the cut
    assert shown == text[:first_cut(text, [stop])] == out.outputs[0].text
    _free(llm)


def test_min_tokens_holds_stop_strings_back_until_it_is_reached(llm):
    """A stop string counts only if it ends in the text of a token at or after the
    min_tokens-th (vLLM's rule): the cut equals the reference computed from each token's
    text, read from an unstopped stream."""
    from labkit import SamplingParams
    prompt = list(range(130, 170))                           # its text repeats itself (tiny-llama, seeded)
    free = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ends, text = [0], ""                     # ends[t]: characters after t tokens
    for out in llm.generate_stream([prompt], free):
        text += out.delta[0]
        ends.append(len(text))
    min_tokens = 12
    # a stop string in the first 3 tokens' text that occurs again after the min_tokens-th
    stop = next(c for c in (text[i:i + k] for k in (2, 1) for i in range(ends[3])) if c in text[ends[min_tokens]:])
    held = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop],
                                                 min_tokens=min_tokens), use_tqdm=False)[0].outputs[0]
    first_end = next(e for e in range(ends[min_tokens - 1] + 1, len(text) + 1) if text[:e].endswith(stop))
    assert held.finish_reason == "stop" and held.text == text[:first_end - len(stop)]
    assert len(held.token_ids) >= min_tokens and text.find(stop) < ends[3]     # an early one was passed over
    _free(llm)
