"""Graders for chapter 12: structured outputs (grammar-constrained decoding).

* 12.1: which tokens of a toy vocabulary a grammar allows next, after three texts. The
  expected sets come from XGrammar itself, on the toy vocabulary (``toy_mask``): the same
  engine that masks the real model's logits;
* 12.2: ``token_allowed(step, state, token)``, a token walked through an automaton one
  character at a time; checked on the chapter's automata against the reference walk. Its
  two halves (``probe`` runs the student's function on the grader's cases, ``judge`` gives
  the verdict) let ``labkit.grade`` run the function where it lives and judge it elsewhere;
* 12.3: jump-forward on the block table: the blocks a sequence holds while its drafted
  tokens are computed and after the rejected ones give their slots back, and the tokens it
  gains; measured on a real ``BlockAllocator`` and ``BlockTable`` (``jump_blocks``).

The notebook imports the automata, the toy vocabulary and the exercises' constants from
here, so that the student's runs and the grader's are the same.
"""

from __future__ import annotations

import functools
import re

from ._grading import check_exact, fail, graded, passed, read_collection, read_count, shown

# ---- automata the chapter builds by hand ----------------------------------------------------
#: A number as JSON writes one, minus the exponent: ``-?(0|[1-9][0-9]*)(\.[0-9]+)?``.
#: state -> {characters: next state}; a character in no entry of its state falls off.
NUMBER_DFA = {
    "start": {"-": "sign", "0": "zero", "123456789": "int"},
    "sign": {"0": "zero", "123456789": "int"},
    "zero": {".": "dot"},
    "int": {"0123456789": "int", ".": "dot"},
    "dot": {"0123456789": "frac"},
    "frac": {"0123456789": "frac"},
}
NUMBER_ACCEPTING = frozenset({"zero", "int", "frac"})

#: A quoted lowercase word, ``"[a-z]+"``: exercise 12.1's grammar.
LOWER = "abcdefghijklmnopqrstuvwxyz"
QUOTED_DFA = {
    "start": {'"': "open"},
    "open": {LOWER: "word"},
    "word": {LOWER: "word", '"': "closed"},
    "closed": {},
}
QUOTED_ACCEPTING = frozenset({"closed"})


def dfa_step(dfa: dict[str, dict[str, str]]):
    """The automaton ``dfa`` as a function ``step(state, char) -> next state, or None`` (the
    character falls off: no match of the grammar continues this way)."""
    def step(state: str, char: str) -> str | None:
        for chars, following in dfa.get(state, {}).items():
            if char in chars:
                return following
        return None
    step.__name__ = "step"
    return step


number_step = dfa_step(NUMBER_DFA)
quoted_step = dfa_step(QUOTED_DFA)


def walk(step, state: str | None, text: str) -> str | None:
    """The state after reading ``text`` from ``state`` (None once a character falls off)."""
    for char in text:
        if state is None:
            return None
        state = step(state, char)
    return state


# ---- exercise 12.1: which tokens may come next ------------------------------------------------
EX1_REGEX = r'"[a-z]+"'
#: The toy vocabulary: token id -> its text; the last one is the end-of-sequence token.
EX1_VOCAB = ['"', "a", "ab", 'b"', '""', '"a', "A", 'a"b', '"ab"', " ", "ba", '"b', "<eos>"]
EX1_EOS = len(EX1_VOCAB) - 1
#: The three texts after which the exercise asks for the allowed tokens.
EX1_TEXTS = {"allowed_start": "", "allowed_mid": '"ab', "allowed_end": '"ab"'}


def toy_mask(regex: str, vocab: list[str], eos: int, text: str) -> frozenset[int]:
    """The token ids XGrammar allows after ``text`` for ``regex`` over ``vocab`` (each token
    read as its literal text, ``eos`` the stop token): the mask the engine would apply."""
    import xgrammar as xgr

    from ..structured.bitmask import allocate_bitmask, allowed_tokens
    info = xgr.TokenizerInfo(list(vocab), xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[eos])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_regex(regex))
    if text and not matcher.accept_string(text):
        raise ValueError(f"{text!r} is not a prefix of any match of {regex!r}")
    bitmask = allocate_bitmask(1, len(vocab))
    matcher.fill_next_token_bitmask(bitmask)
    return frozenset(allowed_tokens(bitmask[0], len(vocab)))


@functools.lru_cache(maxsize=None)
def ex1_expected() -> dict[str, frozenset[int]]:
    return {name: toy_mask(EX1_REGEX, EX1_VOCAB, EX1_EOS, text) for name, text in EX1_TEXTS.items()}


def _ex1_mistakes(text: str) -> list[tuple[frozenset[int], str]]:
    """The sets the usual misunderstandings give after ``text``, with what to say about each.
    Worked out by walking the exercise's automaton by hand-coded wrong rules.

    A hint is about a whole answer, never about one of its tokens: a wrong rule that gives the
    right set but for one token (the end-of-sequence token added mid-word; after '' the first
    character's rule, which differs only on ``'""'``) would, by its hint, single that token out,
    and the answer would be one flip away. Those sets get the method's hint, which names every
    concept (all of a token's characters; the end token only after a complete match)."""
    state = walk(quoted_step, "start", text)
    if state in QUOTED_ACCEPTING:
        return []                 # after a complete match every wrong answer gets the method's hint
    ordinary = range(len(EX1_VOCAB) - 1)
    right = frozenset(t for t in ordinary if walk(quoted_step, state, EX1_VOCAB[t]) is not None)
    first_char = {t for t in ordinary if quoted_step(state, EX1_VOCAB[t][0]) is not None}
    ends_accepting = {t for t in ordinary if walk(quoted_step, state, EX1_VOCAB[t]) in QUOTED_ACCEPTING}
    hints = [
        (first_char, "A token is all of its characters, not only its first: each must fit, one after the "
                     "other, or the text leaves the grammar in the middle of the token."),
        ({t for t in right if len(EX1_VOCAB[t]) == 1},
         "Tokens of several characters count too: one is allowed when every character of it fits, in "
         "turn. That is the point of the exercise: tokens do not stop where the grammar's pieces do."),
        (ends_accepting, "A token may leave the text unfinished: it is allowed when the text stays on "
                         "its way to a match (the rest can come in later tokens), not only when it "
                         "completes one."),
    ]
    return [(frozenset(s), h) for s, h in hints if len(frozenset(s) ^ right) >= 2]


def _read_token_set(name: str, value: object) -> frozenset[int]:
    """A set of tokens given by id (0..12) or by text (``'"a'``), in any container."""
    items = read_collection(name, value, "token ids")
    ids = set()
    for item in items:
        if isinstance(item, str) and item in EX1_VOCAB:
            ids.add(EX1_VOCAB.index(item))
            continue
        if isinstance(item, str) and re.fullmatch(r"\s*\d+\s*", item):
            item = int(item)
        if hasattr(item, "item") and not isinstance(item, (list, tuple, str)):
            item = item.item()
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < len(EX1_VOCAB):
            fail(f"{name}: {shown(item)} is not a token of the toy vocabulary: give token ids "
                 f"0..{len(EX1_VOCAB) - 1} (or the tokens' texts).")
        ids.add(item)
    return frozenset(ids)


@graded("12.1")
def check_allowed_tokens(allowed_start: object, allowed_mid: object, allowed_end: object) -> None:
    """Exercise 12.1: for ``EX1_REGEX`` over the toy vocabulary ``EX1_VOCAB``, the ids of the
    tokens allowed next after each text of ``EX1_TEXTS``: nothing yet, ``"ab``, ``"ab"``."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    expected = ex1_expected()
    for name, value in (("allowed_start", allowed_start), ("allowed_mid", allowed_mid), ("allowed_end", allowed_end)):
        if value is None or value is Ellipsis:
            fail(f"{name}: no answer yet ({shown(value)}). Give a set of token ids, e.g. {{1, 2}}.")
        got = _read_token_set(name, value)
        if got == expected[name]:
            continue
        text = EX1_TEXTS[name]
        hint = next((h for s, h in _ex1_mistakes(text) if s == got), None)
        fail(f"{name}: not the tokens the grammar allows after {text!r}. " + (hint or (
            "Walk each token's characters through the automaton, starting where the text so far left "
            "it: a token is allowed when the text stays a prefix of some match; the end-of-sequence "
            "token only where the text so far is a complete match.")))
    sizes = ", ".join(f"{len(expected[n])}" for n in EX1_TEXTS)
    passed(f"These are XGrammar's masks after '', '\"ab' and '\"ab\"' ({sizes} tokens of 13): multi-character "
           "tokens cross the grammar's pieces, and the end token comes only once the match is complete.")


# ---- exercise 12.2: a token walked through an automaton -------------------------------------
def token_allowed_reference(step, state: str, token: str) -> bool:
    """Whether ``token`` may come next from ``state``: every character, in turn, has somewhere
    to go. (Where the walk ends does not matter: later tokens can finish the match.)"""
    return walk(step, state, token) is not None


def _ex2_cases() -> list[tuple[str, str, str]]:
    """(automaton, state, token): tokens that fit wholly, fall off at their first, middle or
    last character, end unfinished, end complete, or need the state to move to fit."""
    cases = []
    for token in ["-", "-0", "-01", "12", "12.", "1.5", "1.5.", "0.", "00", "007", "7-", ".5", "3.14", "-.",
                  "9", "x", "1x"]:
        cases.append(("number", "start", token))
    for state, token in [("int", "0"), ("int", ".25"), ("int", "-"), ("zero", "5"), ("zero", ".0"),
                         ("dot", "."), ("dot", "12"), ("frac", "99"), ("frac", "9.9"), ("sign", "0.1")]:
        cases.append(("number", state, token))
    for token in ['"', '"a', '"ab"', '""', '"A', 'a', '"b"c', '"x"']:
        cases.append(("quoted", "start", token))
    for state, token in [("word", 'b"'), ("word", 'a"b'), ("word", "ba"), ("word", '"'), ("open", '"'),
                         ("open", "abc"), ("closed", '"'), ("closed", "a"), ("word", "aB")]:
        cases.append(("quoted", state, token))
    return cases


_STEPS = {"number": number_step, "quoted": quoted_step}


def _ex2_variants(step, state: str, token: str) -> dict[str, bool]:
    """What the usual wrong walks answer, by name."""
    return {"first": step(state, token[0]) is not None,
            "stale": all(step(state, c) is not None for c in token),
            "any": any(step(state, c) is not None for c in token),
            "last": walk(step, state, token[:-1]) is not None and step(state, token[-1]) is not None}


_EX2_HINTS = {
    "first": "It looks at the token's first character only: the others must fit too, each where the "
             "one before it left the automaton.",
    "stale": "Each character is tried from the state the text started in; the automaton moves with "
             "every character, so each one must be tried from where the one before it led.",
    "any": "One character that fits is not enough: every character of the token must fit, in turn.",
    "last": "The last character is tried from the wrong state: carry the state along the whole token.",
}


def _probe_token_allowed(token_allowed: object, *, plan: dict | None = None) -> list:
    """The student's answers on every case, as plain data (the first failure ends the list)."""
    out = []
    for automaton, state, token in _ex2_cases():
        if token_allowed is Ellipsis or token_allowed is None or not callable(token_allowed):
            out.append({"fail": f"token_allowed: pass your function itself, not {shown(token_allowed)}."})
            break
        try:
            answer = token_allowed(_STEPS[automaton], state, token)
        except NotImplementedError:
            out.append({"fail": "token_allowed: your function still raises NotImplementedError: write it."})
            break
        except Exception as e:   # noqa: BLE001 - the student's error becomes a hint
            out.append({"fail": f"token_allowed: calling it raised {type(e).__name__}: {str(e)[:120]}"})
            break
        if hasattr(answer, "item") and not isinstance(answer, (str, list)):
            try:
                answer = answer.item()
            except Exception:  # noqa: BLE001 - judged as what it is
                pass
        out.append({"answer": answer if isinstance(answer, (bool, int, float, str, type(None))) else
                    {"type": type(answer).__name__}})
    return out


def _judge_token_allowed(ran: object, *, plan: dict | None = None) -> None:
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    cases = _ex2_cases()
    if not isinstance(ran, list) or not ran or len(ran) > len(cases) or not all(isinstance(r, dict) for r in ran):
        fail("token_allowed: what the function returned could not be read.")
    for r in ran:
        if "fail" in r:
            fail(str(r["fail"]))
    if len(ran) != len(cases):
        fail("token_allowed: what the function returned could not be read.")
    answers = [r.get("answer") for r in ran]
    for a in answers:
        if not isinstance(a, bool):
            what = a.get("type") if isinstance(a, dict) else type(a).__name__
            fail(f"token_allowed: return True or False, got {shown(a)} ({what}).")
    right = [token_allowed_reference(_STEPS[m], s, t) for m, s, t in cases]
    if answers == right:
        passed(f"token_allowed agrees with the automaton on all {len(cases)} cases: a token fits when each "
               "of its characters, in turn, has somewhere to go; where it ends does not matter.")
        return
    for name, hint in _EX2_HINTS.items():
        if answers == [_ex2_variants(_STEPS[m], s, t)[name] for m, s, t in cases]:
            fail(f"token_allowed: {hint}")
    if all(answers):
        fail("token_allowed: it allows every token; a token whose characters the automaton cannot read, one "
             "after the other, must be refused.")
    if answers == [walk(_STEPS[m], s, t) in (NUMBER_ACCEPTING | QUOTED_ACCEPTING) for m, s, t in cases]:
        fail("token_allowed: it only allows tokens that complete a match. A token may leave the text "
             "unfinished: later tokens can complete it.")
    wrong = next(i for i, (a, b) in enumerate(zip(answers, right)) if a != b)
    automaton, state, token = cases[wrong]
    fail(f"token_allowed: wrong for the {automaton} automaton in state {state!r} with the token {token!r}. "
         "Walk it by hand: from the state, read the token's characters one at a time with step; what "
         "does it mean when step returns None?")


@graded("12.2")
def check_token_allowed(token_allowed) -> None:
    """Exercise 12.2: ``token_allowed(step, state, token) -> bool``: whether ``token`` may come
    next from ``state`` of the automaton ``step`` (``step(state, char)`` -> next state, or None)."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    _judge_token_allowed(_probe_token_allowed(token_allowed))


check_token_allowed.probe, check_token_allowed.judge = _probe_token_allowed, _judge_token_allowed


# ---- exercise 12.3: jump-forward on the block table --------------------------------------------
EX3_BLOCK_SIZE = 4
EX3_TOKENS = 14           # tokens in the sequence; its last one was sampled last step (no K/V yet)
EX3_DRAFTED = 12          # tokens the grammar forces next, drafted this step
EX3_ACCEPTED = 2          # drafts the model's own sampling agrees with, before the first it does not


def jump_blocks(tokens: int = EX3_TOKENS, drafted: int = EX3_DRAFTED, accepted: int = EX3_ACCEPTED,
                block_size: int = EX3_BLOCK_SIZE) -> dict[str, int]:
    """One jump on a real block table: the sequence's ``tokens - 1`` computed tokens hold slots;
    the step gives slots to its last token and the drafts, computes them, and the rejected
    drafts give theirs back (``BlockTable.truncate``). Returns the blocks held during and
    after the step, and the tokens the sequence gains (the kept drafts and the step's own)."""
    from ..memory import BlockAllocator, BlockTable
    allocator = BlockAllocator(64, block_size)
    table = BlockTable(allocator)
    table.append_tokens(range(tokens - 1), computed=False)
    table.append_tokens(range(1 + drafted), computed=False)       # the step's chunk: last token + drafts
    during = table.num_blocks
    table.truncate(tokens + accepted)                             # the rejected drafts' slots go back
    after = table.num_blocks
    assert allocator.num_used_blocks == after
    table.free()
    allocator.check_invariants()
    return {"blocks_during": during, "blocks_after": after, "tokens_gained": accepted + 1}


def _ex3_mistakes() -> dict[str, list[tuple[float, str]]]:
    t, k, a, bs = EX3_TOKENS, EX3_DRAFTED, EX3_ACCEPTED, EX3_BLOCK_SIZE
    blocks = (lambda n: -(-n // bs))
    slot_of_last = ("Which tokens get slots in this step? The last sampled token has no K/V yet: it is "
                    "computed in this step, with the drafts.")
    new_token = ("The token this step samples gets no slot yet: its K/V is computed in the next step, as "
                 "every sampled token's is.")
    kept = ("What happens to the drafts the model did not agree with? Their K/V was computed, but they are "
            "not part of the text: their slots are given back.")
    return {
        "blocks_during": [(blocks(t - 1 + k), slot_of_last), (blocks(t + k + 1), new_token),
                          *[(n, "That is before the step: the drafts need slots too, to be computed.")
                            for n in sorted({blocks(t - 1), blocks(t)})]],
        "blocks_after": [(blocks(t + k), kept), (blocks(t + a + 1), new_token),
                         (blocks(t), "The accepted drafts stay: they are now part of the text, with their K/V."),
                         (blocks(t - 1 + a), slot_of_last)],
        "tokens_gained": [(a, "Besides the drafts it kept, what does the step itself give the sequence?"),
                          (k + 1, kept), (k, kept), (1, "The drafts the model agreed with are kept: the "
                                                        "sequence gains them too, without a step each.")],
    }


@graded("12.3")
def check_jump_blocks(blocks_during: object, blocks_after: object, tokens_gained: object) -> None:
    """Exercise 12.3: a sequence of ``EX3_TOKENS`` tokens (its last one sampled in the previous
    step), blocks of ``EX3_BLOCK_SIZE``, drafts ``EX3_DRAFTED`` forced tokens, of which the first
    ``EX3_ACCEPTED`` are kept: blocks held while the step runs, blocks held after it, tokens gained."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    right = jump_blocks()
    mistakes = _ex3_mistakes()
    hints = {"blocks_during": "Count the slots the step's chunk needs, then the blocks that hold them.",
             "blocks_after": "Count the tokens whose K/V the sequence keeps after the step.",
             "tokens_gained": "Which tokens does the sequence have after the step that it did not have before?"}
    for name, value in (("blocks_during", blocks_during), ("blocks_after", blocks_after),
                        ("tokens_gained", tokens_gained)):
        if value is None or value is Ellipsis:
            fail(f"{name}: no answer yet ({shown(value)}). Give a whole number.")
        n = read_count(name, value)
        wrong = [(v, h) for v, h in mistakes[name] if v != right[name]]
        check_exact(name, n, right[name], mistakes=wrong, hint=hints[name])
    passed(f"{right['blocks_during']} blocks while the {1 + EX3_DRAFTED} tokens are computed, "
           f"{right['blocks_after']} after the rejected drafts give theirs back; the sequence gains "
           f"{right['tokens_gained']} tokens in one step instead of {right['tokens_gained']} steps.")


# ---- answer forms, for the leak scan ----------------------------------------------------------
def answer_forms() -> dict[str, list[str]]:
    """12.1's sets in the ways a student writes them; 12.2's key expressions."""
    forms = []
    for ids in ex1_expected().values():
        items = sorted(ids)
        if len(items) < 2:
            continue                      # a one-token set ({12}) is too short to be found only as a leak
        for sep in (", ", ","):
            body = sep.join(map(str, items))
            forms += ["{" + body + "}", "[" + body + "]", "(" + body + ")"]
    three = jump_blocks()
    return {
        "12.1": list(dict.fromkeys(forms)),
        "12.3": [f"blocks_during = {three['blocks_during']}", f"blocks_after = {three['blocks_after']}",
                 f"tokens_gained = {three['tokens_gained']}"],
        "12.2": ["state = step(state, char)", "state = step(state, c)", "state = step(state, ch)",
                 "walk(step, state, token) is not None"],
    }
