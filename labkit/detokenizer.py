"""Incremental detokenization: the text a stream shows, one token at a time.

Decoding each new token on its own is wrong: tokenizers merge bytes and spaces across
token boundaries, and a multi-byte character may be split over several tokens. So we
decode a small window twice, the text up to the previous token (``prefix``) and up to the
new one, and emit the difference, holding it back while it ends in an incomplete
character (U+FFFD). This is the algorithm vLLM and TGI use; its cost per token is
constant, not proportional to the length of the output.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into a growing string, exactly once per char."""

    __slots__ = ("tokenizer", "token_ids", "prefix_offset", "read_offset", "text")

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0   # where the window we re-decode starts
        self.read_offset = 0     # tokens before this have been turned into text
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the text they completed (possibly empty)."""
        self.token_ids.extend(token_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(self.token_ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""            # nothing printable yet: wait for the rest of the character
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta
