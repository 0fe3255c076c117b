"""Model drafts: a cheaper forward pass guesses the next ``k`` tokens, one at a time.

Two proposers, one loop (``ModelDrafter.draft_next``). After a step has verified its chunk
and sampled its token ``t`` at position ``P``, the drafter runs ``k`` small decodes for the
next step: ``t`` at ``P``, then its own first guess at ``P + 1``, and so on, each reading the
K/V of everything before it. The guesses are the draft's argmax (a point mass), or samples
from its distribution q (``draft_sampling="sample"``; rejection sampling then keeps the
output's distribution). They join the sequence before the next plan, as any proposer's do.

* ``draft_layers`` (self-speculation, as LayerSkip): the draft is the target's own first
  ``n`` layers, then its final norm and LM head. Its K/V for those layers *is* the target's:
  it reads the cache the target wrote, and the draft costs no cache of its own. The K/V it
  writes for its guesses' positions lands in slots the scheduler reserved past the chunk
  (``num_lookahead_tokens``); the next step's verification computes every layer of those
  positions again, and the slots go back after the step.
* ``draft_model``: a separate model with the same tokenizer, with a K/V cache of its own
  indexed by the *same* block ids as the target's (the same block table serves both). It
  keeps that cache in step: it runs every chunk the target runs (``mirror``), and makes the
  same copy-on-write copies and swaps. Its cache costs ``layers x kv_heads x head_dim`` of
  the draft per slot, on top of the target's.

The draft's K/V writes are scratch: the positions it writes are recomputed by the next
verification before anything reads them as the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model.runner import ModelRunner, SeqChunk
from ..model.sampler import SamplingRow, inverse_cdf, make_generator, position_seed, probabilities, uniforms
from ..request import Sequence
from .proposer import Draft

#: Mixed into a draft's seeds: a draft's sampling never reuses the generator of the
#: target's position (its uniforms must be independent of the verification's).
DRAFT_SALT = 0x5EED_D4AF


@dataclass(slots=True)
class DraftJob:
    """One sequence to draft for after a step: its token ``token`` at ``position`` (sampled by
    the step, no K/V yet) and how many guesses to make (its lookahead slots)."""

    seq: Sequence
    position: int
    token: int
    count: int


@dataclass(slots=True)
class ModelDrafter:
    """The draft loop shared by ``draft_layers`` and ``draft_model``; ``forward(chunks)``
    returns the draft's logits at each chunk's token."""

    k: int
    name: str
    sampling: str = "argmax"
    needs_lookahead = True
    _next: dict[Sequence, tuple[int, Draft]] = field(default_factory=dict)   # seq -> (its length, guesses)

    def forward(self, chunks: list[SeqChunk]) -> torch.Tensor:
        raise NotImplementedError

    def propose(self, seq: Sequence, room: int) -> Draft | None:
        """The guesses made after the last step, if made for the tokens ``seq`` holds now."""
        made = self._next.pop(seq, None)
        if made is None or made[0] != len(seq.token_ids):
            return None
        return made[1].cut(room)

    def forget(self) -> None:
        """Drop guesses nobody took (their sequence finished, was preempted or is not decoding)."""
        self._next.clear()

    @torch.inference_mode()
    def draft_next(self, jobs: list[DraftJob]) -> None:
        """Run the draft for ``jobs``: ``count`` decodes each, all jobs batched per decode."""
        self._next.clear()
        live = [j for j in jobs if j.count > 0]
        tokens = {id(j): [] for j in live}
        probs = {id(j): [] for j in live}
        step = 0
        while live:
            chunks = [SeqChunk([tokens[id(j)][-1] if step else j.token], j.position + step,
                               j.seq.block_table.block_ids, True, False) for j in live]
            logits = self.forward(chunks)
            best = logits.argmax(dim=-1).tolist()
            for row, job in enumerate(live):
                params = job.seq.request.params
                if self.sampling == "argmax" or params.greedy:
                    tokens[id(job)].append(best[row])
                    continue
                token, q = self._sample(logits[row], job, job.position + step + 1)
                tokens[id(job)].append(token)
                probs[id(job)].append(q)
            step += 1
            live = [j for j in live if len(tokens[id(j)]) < j.count]
        for job in jobs:
            if job.count > 0:
                qs = probs[id(job)]
                q = torch.stack(qs) if qs and len(qs) == job.count else None
                self._next[job.seq] = (job.position + 1, Draft(tokens[id(job)], self.name, q))

    def _sample(self, logits: torch.Tensor, job: DraftJob, position: int) -> tuple[int, torch.Tensor]:
        """A guess for ``position`` sampled from q (the request's temperature, top-k, top-p and
        min-p over the draft's logits), and q."""
        params = job.seq.request.params
        gen = None
        if params.seed is not None:
            gen = make_generator(position_seed(params.seed, job.seq.index, position) ^ DRAFT_SALT)
        q = probabilities(logits[None], [SamplingRow(params.temperature, params.top_p, params.top_k, None,
                                                     params.min_p)])[0]
        return int(inverse_cdf(q[None], uniforms([gen]))[0]), q


@dataclass(slots=True)
class DraftLayersProposer(ModelDrafter):
    """``{"method": "draft_layers", "num_layers": n}``: the target's first ``n`` layers draft."""

    runner: ModelRunner | None = None
    num_layers: int = 1

    def forward(self, chunks: list[SeqChunk]) -> torch.Tensor:
        return self.runner.execute(chunks, num_layers=self.num_layers)


@dataclass(slots=True)
class DraftModelProposer(ModelDrafter):
    """``{"model": NAME}``: a separate draft model, its cache mirroring the target's blocks."""

    runner: ModelRunner | None = None
    host_cache: object = None           # its host pool for swapping (None: no swapping)

    def forward(self, chunks: list[SeqChunk]) -> torch.Tensor:
        return self.runner.execute(chunks)

    @torch.inference_mode()
    def mirror(self, chunks: list[SeqChunk], copies: list[tuple[int, int]]) -> None:
        """Compute the draft's K/V for the chunks the target computes (no logits needed)."""
        quiet = [SeqChunk(c.token_ids, c.num_computed_tokens, c.block_ids, False, c.is_prefill) for c in chunks]
        self.runner.execute(quiet, copies)


def build_proposer(config, runner: ModelRunner, num_host_blocks: int = 0):
    """The proposer a ``SpeculativeConfig`` asks for, on the target ``runner``. Raises
    ``ValueError`` for a draft that cannot serve this target (too deep, another vocabulary)."""
    from .ngram import NgramProposer

    k = config.num_speculative_tokens
    if config.method == "ngram":
        return NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft_layers":
        if config.num_layers >= runner.spec.num_layers:
            raise ValueError(f"speculative_config: num_layers={config.num_layers}, but {runner.name} has "
                             f"{runner.spec.num_layers} layers: a draft must be shallower than its target")
        return DraftLayersProposer(k, "draft_layers", config.draft_sampling, runner=runner,
                                   num_layers=config.num_layers)
    draft = ModelRunner(config.model, block_size=runner.block_size, num_blocks=runner.num_blocks,
                        attention_backend=runner.attention_backend, dtype=runner.dtype, device=runner.device,
                        kv_cache_dtype=getattr(runner, "kv_cache_dtype", "auto"))
    if draft.vocab_size != runner.vocab_size:
        raise ValueError(f"speculative_config: the draft {draft.name} has a vocabulary of {draft.vocab_size} tokens, "
                         f"the target {runner.name} {runner.vocab_size}: a draft model needs the target's tokenizer")
    host = draft.kv_cache.host_pool(num_host_blocks) if num_host_blocks else None
    return DraftModelProposer(k, "draft_model", config.draft_sampling, runner=draft, host_cache=host)
