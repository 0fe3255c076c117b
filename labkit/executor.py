"""The real executor: the scheduler's plan, run through a Llama on paged KV, then sampled.

``ModelExecutor`` is what the engine calls every iteration when it serves a model. It turns
each ``ScheduledSeq`` into a ``SeqChunk`` (tokens to compute, first position, the sequence's
physical blocks, prefill or decode as the scheduler decided), lets the ``ModelRunner`` apply
the copy-on-write copies and run one forward over the whole mixed batch, and samples from
the logits of the sequences whose chunk ends their known tokens (``n`` samples at a fork).

Requests that ask for more pay for it, and only they: ``structured_outputs`` masks their
rows of logits first (the tokens their grammar forbids get ``-inf``: ``labkit.structured``);
``logit_bias`` and the penalties process their rows before sampling; ``logprobs`` reads
the logits at the sampled tokens (raw, or after the grammar's mask); ``prompt_logprobs``
makes the runner return the logits of every token of their prompt chunks
(``SeqChunk.all_logits``). See docs/sampling.md and docs/structured_outputs.md.

Seeded sampling is independent of batching and of preemption: each sampled token draws
from a generator seeded by (request seed, sample index, position), so the same request
gets the same tokens whatever else runs beside it, and a recomputed sequence continues
exactly as it would have.

Speculative decoding (``labkit.spec_decode``) and jump-forward decoding, its grammar-driven
case, add guessed tokens at the end of a decoding sequence's chunk. The executor then returns
logits at each of them and samples every guessed position as a step of its own would (its
mask, its penalties, its generator); ``spec_decode.rejection`` decides which guesses stay.
A model proposer drafts after the verification, for the next step, on slots reserved past
the chunk.
"""

from __future__ import annotations

import threading
import time

import torch

from .engine import ExecuteResult
from .model.kv_cache import KVCache, swap_blocks
from .model.runner import ModelRunner, SeqChunk
from .model.sampler import (PenaltyRow, SamplingRow, apply_penalties, logprob_entries, make_generator,
                            position_seed, probabilities, sample)
from .scheduler import SchedulerOutput
from .spec_decode import DraftJob, SpeculativeConfig, Speculator, accepted_prefix, build_proposer, speculative_sample
from .structured.matchers import MaskRow


_MAKING_GRAMMARS = threading.Lock()


class ModelExecutor:
    """Runs plans on a real model: forward pass + sampling, timed on the wall clock."""

    simulated = False

    def __init__(self, runner: ModelRunner, host_cache: KVCache | None = None, jump_forward: bool = False,
                 speculative_config: dict | SpeculativeConfig | None = None):
        self.runner = runner
        # Host blocks for preemption by swapping (None in recompute mode): indexed by the
        # scheduler's host allocator as the runner's KV cache is by its block allocator.
        self.host_cache = host_cache
        self.swap_s = 0.0               # wall seconds spent copying blocks to and from the host
        self.swap_granularity = "gather"  # or "layer": vLLM v0's copy per block per layer (kv_cache.swap_blocks)
        self._token_texts: dict[int, str] = {}    # token id -> decode([id]), for logprobs (at most the vocab)
        self.tokenizer = runner.tokenizer
        self.vocab_size = runner.vocab_size
        self._grammars = None             # labkit.structured.GrammarMatchers, made by the first request that asks
        # Speculative decoding (docs/speculative_decoding.md): the configured proposer, and the
        # mechanism every proposer shares.
        self.speculative_config = SpeculativeConfig.from_dict(speculative_config)
        config = self.speculative_config
        self.proposer = None if config is None else build_proposer(
            config, runner, host_cache.num_blocks if host_cache is not None else 0)
        self._speculator = Speculator([], lambda: self._grammars,
                                      None if config is None else config.disable_by_batch_size)
        # Jump-forward decoding for constrained requests (docs/structured_outputs.md): switch it on
        # or off between steps; its proposer is made when both it and a grammar are there.
        self.jump_forward = jump_forward
        self._jump = None

    @property
    def grammars(self):
        """The grammar matchers of constrained requests (``labkit.structured.matchers``),
        made on first use: XGrammar is loaded only when a request asks for structure."""
        if self._grammars is None:
            from .structured.matchers import GrammarMatchers
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer, and this executor has none")
            with _MAKING_GRAMMARS:      # a server compiles on its grammar thread: one instance, whoever asks first
                if self._grammars is None:
                    self._grammars = GrammarMatchers(self.tokenizer, self.vocab_size, self.runner.eos_token_ids)
        return self._grammars

    @property
    def jump(self):
        """The jump-forward proposer (``labkit.structured.jump_forward``) when ``jump_forward`` is
        on and a constrained request has come; else None."""
        if not self.jump_forward or self._grammars is None:
            return None
        if self._jump is None:
            from .structured.jump_forward import JumpForward
            self._jump = JumpForward(self._grammars, self._speculator)
        return self._jump

    @property
    def speculator(self) -> Speculator | None:
        """The speculative-decoding mechanism (``labkit.spec_decode.Speculator``) with this step's
        proposers: the grammar's (jump-forward) first, then the configured one; None when there
        is none. The engine calls it around each step; its counters last the engine's life."""
        proposers = [p for p in (self.jump, self.proposer) if p is not None]
        if not proposers:
            return None
        self._speculator.proposers = proposers
        return self._speculator

    def execute(self, plan: SchedulerOutput) -> ExecuteResult:
        t0 = time.perf_counter()
        spec = self.speculator
        wants_prompt = [_prompt_targets(item) for item in plan.scheduled]
        guesses = [spec.draft_of(item) if spec is not None else None for item in plan.scheduled]
        drafts = [len(g.tokens) if g is not None else 0 for g in guesses]
        chunks = [SeqChunk(item.token_ids, item.num_computed_tokens, item.seq.block_table.block_ids,
                           item.num_samples > 0, item.is_prefill or item.num_new_tokens > 1,
                           all_logits=targets is not None or d > 0)
                  for item, targets, d in zip(plan.scheduled, wants_prompt, drafts, strict=True)]
        if plan.swap_out or plan.swap_in:
            self._swap(plan)
        logits = self.runner.execute(chunks, plan.copies)
        mirror = getattr(self.proposer, "mirror", None)
        if mirror is not None:            # a draft model keeps its own cache in step with the target's
            mirror(chunks, plan.copies)
        if self._grammars is not None:
            self._grammars.forget_finished()
        rows: list[SamplingRow] = []
        row_of: list[int] = []            # which logits row each sampling row reads
        row_at: list[tuple] = []          # (scheduled item, position of the token it samples) per sampling row
        penalized: list[int] = []         # sampling rows with logit processing
        grammar_rows: list = []           # sampling rows a grammar constrains (structured.MaskRow)
        prompt_lp: list[tuple[int, list[dict]] | None] | None = None    # built only when asked
        end = 0                           # logits rows used so far
        for k, item in enumerate(plan.scheduled):
            targets, d = wants_prompt[k], drafts[k]
            start = end
            end += len(item.token_ids) if targets is not None or d else int(item.num_samples > 0)
            if targets is not None:       # row start + j predicts token num_computed + j + 1
                first, last = targets
                base = start - item.num_computed_tokens - 1
                prompt = item.seq.request.prompt_token_ids
                top = item.seq.request.params.prompt_logprobs
                entries = logprob_entries(logits[base + first:base + last + 1], prompt[first:last + 1],
                                          [top] * (last + 1 - first), self._decode)
                if prompt_lp is None:
                    prompt_lp = [None] * len(plan.scheduled)
                prompt_lp[k] = (first, entries)
            if item.num_samples == 0:
                continue
            params = item.seq.request.params
            for index in item.sample_indices:
                # The d guessed positions are sampled too, each as a step of its own would sample
                # it (spec_decode.rejection): the grammar's state after the guesses before it, the
                # penalties counting them, the generator of its position.
                for j in range(d + 1):
                    position = item.sample_position - d + j
                    gen = None
                    if params.seed is not None and not params.greedy:
                        gen = make_generator(position_seed(params.seed, index, position))
                    if params.needs_penalties:
                        penalized.append(len(rows))
                    if params.structured_outputs is not None:
                        assumed = tuple(item.seq.token_ids[position - j:position])
                        grammar_rows.append(MaskRow(len(rows), item.seq.request, index, assumed))
                    rows.append(SamplingRow(params.temperature, params.top_p, params.top_k, gen, params.min_p))
                    row_of.append(end - 1 - d + j)
                    row_at.append((item, position))
        # Sampled guesses (a draft's q known) are judged by rejection sampling, their rows
        # apart; every other row is sampled as decoding samples it.
        judged = [k for k, (item, g) in enumerate(zip(plan.scheduled, guesses, strict=True))
                  if g is not None and g.probs is not None and item.num_samples and not item.seq.request.params.greedy]
        sampled_flat: list[int] = []
        table = processed = None
        if rows:
            identity = row_of == list(range(logits.shape[0]))
            table = logits if identity else logits[torch.tensor(row_of, device=logits.device)]
            if grammar_rows:              # in place: logprobs are read after the mask too
                self.grammars.mask(table, grammar_rows)
            processed = table
            if penalized:
                processed = table.clone()
                processed[penalized] = apply_penalties(table[penalized], _penalty_rows(row_at, penalized))
            sampled_flat = self._sample_plain(processed, rows, _rows_of(plan, drafts, judged))
        # Each item's tokens, and the sampling rows that chose them: a sequence keeps its guesses
        # up to the first one verification rejects, and the token sampled there is the step's.
        sampled: list[list[int]] = []
        chosen: list[list[tuple[int, int]]] = []      # per item: (sampling row, token) of each token it gains
        r = 0
        for k, item in enumerate(plan.scheduled):
            d = drafts[k]
            if d and item.num_samples:
                draft = guesses[k].tokens
                if k in judged:
                    kept, token = speculative_sample(probabilities(processed[r:r + d + 1], rows[r:r + d + 1]),
                                                     guesses[k].probs, draft,
                                                     [row.generator for row in rows[r:r + d + 1]])
                else:
                    kept = accepted_prefix(draft, sampled_flat[r:r + d + 1])
                    token = sampled_flat[r + kept]
                stop = spec.first_finish(item.seq, draft[:kept]) if kept else None
                if stop is not None:      # decoding would have ended at that guess: so does the step
                    kept, token = stop, draft[stop]
                chosen.append([(r + j, t) for j, t in enumerate(draft[:kept] + [token])])
                sampled.append([token])
            else:
                chosen.append([(r + j, sampled_flat[r + j]) for j in range(item.num_samples)])
                sampled.append(sampled_flat[r:r + item.num_samples])
            r += item.num_samples * (d + 1)
        for item, gained in zip(plan.scheduled, chosen, strict=True):
            request = item.seq.request
            if not gained or request.params.structured_outputs is None:
                continue
            if len(item.sample_indices) > 1:          # n samples at a fork: one token each
                for index, (_, token) in zip(item.sample_indices, gained, strict=True):
                    self.grammars.accept(request, index, [token])
            else:                                     # one sample: a jump's kept drafts, then its token
                self.grammars.accept(request, item.sample_indices[0], [t for _, t in gained])
        logprobs = None                   # built only when a sampled request asks
        if any(item.num_samples and item.seq.request.params.logprobs is not None for item in plan.scheduled):
            logprobs = self._sample_logprobs(plan, table, chosen, drafts)
        if spec is not None:
            for k, item in enumerate(plan.scheduled):
                if drafts[k] and item.num_samples:
                    entries = logprobs[k] if logprobs is not None else None
                    spec.verified(item.seq, len(chosen[k]) - 1, chosen[k][-1][1], entries[:-1] if entries else None)
                    if entries:
                        logprobs[k] = entries[-1:]
            if getattr(self.proposer, "needs_lookahead", False):
                self._draft_next(plan, spec, drafts, chosen)
        return ExecuteResult(sampled, time.perf_counter() - t0, logprobs, prompt_lp)

    def _sample_plain(self, processed: torch.Tensor, rows: list[SamplingRow], plain: list[int] | None) -> list[int]:
        """Sample the rows in ``plain`` (None: all) as decoding does; other rows get 0 (rejection
        sampling judges them)."""
        if plain is None:
            return sample(processed, rows)
        out = [0] * len(rows)
        if plain:
            for r, t in zip(plain, sample(processed[plain], [rows[r] for r in plain]), strict=True):
                out[r] = t
        return out

    def _draft_next(self, plan: SchedulerOutput, spec: Speculator, drafts: list[int],
                    chosen: list[list[tuple[int, int]]]) -> None:
        """A model proposer's guesses for the next step, from each sequence's new token on, in
        the lookahead slots the speculator reserved (``spec_decode.draft``)."""
        jobs = []
        for k, item in enumerate(plan.scheduled):
            count = spec.lookahead_of(item.seq)
            if count and chosen[k]:
                kept, token = len(chosen[k]) - 1, chosen[k][-1][1]
                jobs.append(DraftJob(item.seq, item.sample_position - drafts[k] + kept, token, count))
        self.proposer.draft_next(jobs)

    def _swap(self, plan: SchedulerOutput) -> None:
        """Apply the plan's swaps before its copy-on-write copies and its batch: swap-out
        first (the device blocks it frees may be refilled by swap-in or by the batch in this
        same iteration), then swap-in (its blocks may be copied on write next)."""
        if self.host_cache is None:
            raise RuntimeError("the plan swaps blocks but this executor has no host pool: "
                               "build it with host_cache (LLM(preemption_mode='swap') does)")
        t0 = time.perf_counter()
        device = self.runner.kv_cache
        swap_blocks(device, self.host_cache, plan.swap_out, self.swap_granularity)
        swap_blocks(self.host_cache, device, plan.swap_in, self.swap_granularity)
        draft_host = getattr(self.proposer, "host_cache", None)
        if draft_host is not None:        # a draft model's cache moves with the target's
            draft_cache = self.proposer.runner.kv_cache
            swap_blocks(draft_cache, draft_host, plan.swap_out, self.swap_granularity)
            swap_blocks(draft_host, draft_cache, plan.swap_in, self.swap_granularity)
        if device.data.device.type == "cuda":
            torch.cuda.synchronize(device.data.device)   # so that swap_s measures the copies
        self.swap_s += time.perf_counter() - t0

    def _sample_logprobs(self, plan: SchedulerOutput, table: torch.Tensor, chosen: list[list[tuple[int, int]]],
                         drafts: list[int]) -> list[list[dict] | None]:
        """Per scheduled item, one ``{token: Logprob}`` per token it gains (``chosen``: the
        sampling row and token of each) when its request asks for logprobs, else None; read
        from ``table`` (the logits each sampling row sampled from, before any processing but
        the grammar's mask). A jump's drafts get theirs too (the engine files them)."""
        logprobs: list[list[dict] | None] = [None] * len(plan.scheduled)
        rows, tokens, tops, owners = [], [], [], []
        for k, item in enumerate(plan.scheduled):
            top = item.seq.request.params.logprobs
            if top is not None and chosen[k]:
                rows += [r for r, _ in chosen[k]]
                tokens += [t for _, t in chosen[k]]
                tops += [top] * len(chosen[k])
                owners.append((k, len(chosen[k])))
        entries = logprob_entries(table[rows], tokens, tops, self._decode)
        i = 0
        for k, count in owners:
            logprobs[k] = entries[i:i + count]
            i += count
        return logprobs

    def _decode(self, token_id: int) -> str | None:
        """A token's own text (a ``Logprob``'s ``decoded_token``), decoded once per token id:
        a request asking 20 alternatives per token of a long prompt would otherwise run the
        tokenizer 21 times per token, in one iteration that every other request waits for."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text


def _rows_of(plan: SchedulerOutput, drafts: list[int], judged: list[int]) -> list[int] | None:
    """The sampling rows outside the ``judged`` items' (None when no item is judged: all rows)."""
    if not judged:
        return None
    skip, r = set(), 0
    for k, item in enumerate(plan.scheduled):
        n = item.num_samples * (drafts[k] + 1)
        if k in judged:
            skip.update(range(r, r + n))
        r += n
    return [i for i in range(r) if i not in skip]


def _penalty_rows(row_at: list[tuple], wanted: list[int]) -> list[PenaltyRow]:
    """The ``PenaltyRow`` of each sampling row in ``wanted``: its request's settings, and the
    tokens before the position it samples (a jump's drafted positions see the drafts before them)."""
    out = []
    for r in wanted:
        item, position = row_at[r]
        seq, params = item.seq, item.seq.request.params
        tokens = seq.token_ids if position == len(seq.token_ids) else seq.token_ids[:position]
        out.append(PenaltyRow(tokens, seq.num_prompt_tokens, params.repetition_penalty,
                              params.presence_penalty, params.frequency_penalty, params.logit_bias))
    return out


def _prompt_targets(item) -> tuple[int, int] | None:
    """The prompt tokens (first, last index) whose logprobs this chunk yields, or None.

    The logits at position p give the logprob of token p + 1. Entries fill in prompt
    order, so only tokens past those already recorded (``request.prompt_logprobs``) count:
    a prompt recomputed after a preemption is not reported twice."""
    request = item.seq.request
    if not item.is_prefill or not request.needs_prompt_logits:
        return None
    first = max(len(request.prompt_logprobs), item.num_computed_tokens + 1)
    last = min(item.sample_position, len(request.prompt_token_ids) - 1)
    return (first, last) if first <= last else None
