"""Structured outputs: grammar-constrained decoding with XGrammar (chapter 12).

A request asks its output to match a JSON Schema, a regex, a choice or a grammar
(``StructuredOutputsParams``). At every step the engine masks the logits of the tokens the
grammar forbids, so whatever the sampler picks keeps the text inside the grammar; where the
grammar forces the next several tokens, jump-forward decoding appends them without a step
each. One concept per module:

* ``params``: ``StructuredOutputsParams`` (vLLM's names), checked without a tokenizer;
* ``compiler``: grammars compiled against the model's vocabulary, cached per spec;
* ``bitmask``: the one-bit-per-token mask, how it is applied, a torch reference;
* ``matchers``: each sample's grammar state, and the mask rows of a batch;
* ``jump_forward``: drafting the tokens a grammar forces, verifying them, giving back the
  slots of those the model would not have chosen.

Only ``params`` is imported here: a program that never asks for structure never loads
XGrammar or torch through this package.
"""

from .params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
