"""Speculative decoding: guess the next tokens cheaply, check them all in one step.

* ``config``: ``SpeculativeConfig``, vLLM's ``speculative_config`` dict read and checked;
* ``proposer``: what a proposer is (``Draft``, ``Proposer``);
* ``ngram``: prompt lookup, guesses from the sequence's own earlier tokens;
* ``draft``: model drafts, the target's first layers (``draft_layers``) or a small model
  (``draft_model``), run after each step for the next one;
* ``rejection``: which guesses a step keeps, so that the output is what decoding gives;
* ``speculator``: the mechanism around the engine's step (draft, fit, verify, settle) that
  every proposer shares, jump-forward decoding's grammar among them
  (``labkit.structured.jump_forward``).

docs/speculative_decoding.md explains the whole, with measurements; chapter 11 teaches it.
"""

from .config import METHODS, SpeculativeConfig
from .draft import DraftJob, DraftLayersProposer, DraftModelProposer, build_proposer
from .ngram import NgramProposer, lookup
from .proposer import Draft, Proposer
from .rejection import accepted_prefix, acceptance_probability, residual, speculative_sample
from .speculator import DraftOutcome, SpecDecodeStats, SpecStep, Speculator

__all__ = ["METHODS", "SpeculativeConfig", "DraftJob", "DraftLayersProposer", "DraftModelProposer", "build_proposer",
           "NgramProposer", "lookup", "Draft", "Proposer", "accepted_prefix", "acceptance_probability", "residual",
           "speculative_sample", "DraftOutcome", "SpecDecodeStats", "SpecStep", "Speculator"]
