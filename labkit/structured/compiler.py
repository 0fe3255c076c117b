"""Grammars compiled against the model's vocabulary, once per distinct spec.

Compiling is where XGrammar does its expensive work: for every state of the grammar's
pushdown automaton it sorts the vocabulary into tokens that are always accepted, always
rejected, or *context-dependent* (their fate depends on the stack below), and stores the
first two kinds as ready-made masks. The result is a few tens of milliseconds for a
realistic schema, so it is done once per spec and kept (an LRU of ``capacity`` grammars):
a server receives the same schema again and again.

The vocabulary is the model's, with its special tokens (``<|im_start|>``, ``<repo_name>``)
left out of every grammar: they are never written as text, and the detokenizer drops them,
so allowing them inside a JSON string would let the text differ from what the grammar read.
The model's end-of-sequence tokens are the grammar's stop tokens: allowed exactly where the
output may end.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from .params import StructuredOutputsParams, parse_grammar


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """XGrammar's ``TokenizerInfo`` for ``tokenizer`` over ``vocab_size`` logits: its
    encoding detected by XGrammar, special tokens blanked (never allowed), ``stop_token_ids``
    allowed where the grammar may end."""
    import xgrammar as xgr

    stops = sorted(set(stop_token_ids))
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
    vocab = [""] * vocab_size
    for token, i in tokenizer.get_vocab().items():
        if i < vocab_size:
            vocab[i] = token
    for i in getattr(tokenizer, "all_special_ids", []):
        if i < vocab_size and i not in stops:
            vocab[i] = ""           # an empty token is never part of any grammar's text
    return xgr.TokenizerInfo(vocab, detected.vocab_type, vocab_size=vocab_size, stop_token_ids=stops,
                             add_prefix_space=detected.add_prefix_space)


class GrammarCache:
    """Compiled grammars by spec key, least recently used evicted past ``capacity``; safe to
    share between threads (two threads compiling one new spec each compile it once).

    ``compile(params)`` returns XGrammar's ``CompiledGrammar`` for a request's
    ``StructuredOutputsParams``; ``hits``, ``misses`` and ``compile_s`` say what the cache
    saved and what compiling cost.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], capacity: int = 128,
                 max_threads: int = 2):
        import xgrammar as xgr

        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_enabled=False)
        self._grammars: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()       # a server compiles on its own thread, the engine reads on its
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self.compile_s = 0.0

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of ``params`` (cached); ``ValueError`` naming the problem if
        it cannot be compiled."""
        key = params.key()
        with self._lock:
            compiled = self._grammars.get(key)
            if compiled is not None:
                self._grammars.move_to_end(key)
                self.hits += 1
                return compiled
        grammar = parse_grammar(key)
        t0 = time.perf_counter()
        try:
            compiled = self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"StructuredOutputsParams.{key[0]}: cannot compile it for this model's "
                             f"vocabulary ({str(e).strip().splitlines()[0][:200]})") from None
        with self._lock:
            self.compile_s += time.perf_counter() - t0
            self.misses += 1
            self._grammars[key] = compiled
            if len(self._grammars) > self.capacity:
                self._grammars.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._grammars)
