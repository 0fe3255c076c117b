"""Turning logits into next tokens: penalties, greedy, temperature, min-p, top-k, top-p,
per-request seeds; and the log-probabilities that show what the model believed.

``sample(logits, rows)`` takes one ``SamplingRow`` per row of ``logits``. Greedy rows
(``is_greedy``: temperature 0, or below ``GREEDY_EPS``) are one ``argmax`` over all of
them, exactly what Hugging Face's greedy ``generate`` does. Random rows are filtered and
normalised together, then each draws one uniform number from *its own*
``torch.Generator`` and picks its token by inverse CDF: a request with a seed gets the
same tokens whatever else shares its batch.

Before that, ``apply_penalties`` processes the rows that ask for it (``PenaltyRow``):
logit bias, then the repetition penalty, then presence and frequency penalties, as tensor
ops over those rows only. ``logprob_entries`` reads the RAW distribution (before any
processing; after the grammar's mask for a constrained request, whose forbidden tokens are
then no candidates) at chosen tokens and its top-k. Rows that ask for neither pay nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..outputs import Logprob
from ..sampling_params import is_greedy, validate_distribution


@dataclass(slots=True)
class SamplingRow:
    """Sampling settings of one row of logits (the engine builds it from SamplingParams)."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 or -1: all
    generator: torch.Generator | None = None  # per-request stream (seeded requests); None: global RNG
    min_p: float = 0.0  # keep tokens with probability >= min_p * the top token's (after temperature)

    def __post_init__(self):
        validate_distribution(self.temperature, self.top_p, self.top_k, owner="SamplingRow")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingRow.min_p={self.min_p!r}: must be in [0, 1]")

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)


def make_generator(seed: int | None, device="cpu") -> torch.Generator | None:
    """A generator for a request's seed (None: no seed, use the global RNG)."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(int(seed))


def position_seed(seed: int, index: int, position: int) -> int:
    """The seed of the generator that samples position ``position`` of sample ``index`` of a
    request seeded with ``seed``: one generator per token, so a seeded request gets the same
    tokens whatever else runs beside it, after a preemption, and with speculative decoding
    (each drafted position is sampled by the generator a step of its own would use)."""
    return (seed * 1_000_003 + index * 10_007 + position) % (2**63 - 1)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """One token id per row of ``logits`` ``[B, V]``, following each row's settings."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} sampling rows")
    out = [0] * len(rows)
    greedy = [i for i, r in enumerate(rows) if r.greedy]
    if greedy:
        if len(greedy) == len(rows):
            return logits.argmax(dim=-1).tolist()
        ids = logits[greedy].argmax(dim=-1).tolist()
        for i, t in zip(greedy, ids, strict=True):
            out[i] = t
    rand = [i for i, r in enumerate(rows) if not r.greedy]
    if rand:
        ids = _sample_random(logits[rand], [rows[i] for i in rand]).tolist()
        for i, t in zip(rand, ids, strict=True):
            out[i] = t
    return out


def probabilities(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distributions the random rows are drawn from ``[B, V]`` (after temperature,
    min-p, top-k, top-p, in that order, as vLLM)."""
    logits = logits.float()
    temps = torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=logits.device)
    logits = logits / temps[:, None]
    if any(r.min_p > 0 for r in rows):  # min-p: drop tokens far less likely than the top one
        min_ps = torch.tensor([r.min_p for r in rows], dtype=torch.float32, device=logits.device)
        p = logits.softmax(dim=-1)
        logits = logits.masked_fill(p < min_ps[:, None] * p.max(dim=-1, keepdim=True).values, float("-inf"))
    V = logits.shape[-1]
    ks = [r.top_k if 0 < r.top_k < V else V for r in rows]
    if any(k < V for k in ks):  # top-k: mask everything below each row's k-th largest logit
        kmax = max(ks)
        top = logits.topk(kmax, dim=-1).values  # [B, kmax], sorted descending
        kth = top.gather(1, torch.tensor(ks, device=logits.device)[:, None] - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    top_ps = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=logits.device)
    if bool((top_ps < 1.0).any()):  # top-p (nucleus): keep the head of the sorted distribution
        sorted_p, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p
        drop = mass_before >= top_ps[:, None]  # never drops the most likely token
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    return inverse_cdf(probabilities(logits, rows), uniforms([r.generator for r in rows]))


def uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One uniform number in [0, 1) per entry (float64), from its own generator when it has
    one, else from torch's global one."""
    u = torch.empty(len(generators), dtype=torch.float64)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        u[shared] = torch.rand(len(shared), dtype=torch.float64)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, dtype=torch.float64, generator=g, device=g.device).item()
    return u


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs`` ``[B, V]`` (each summing to 1, or any positive total: rows are
    scaled by their sum), the token that the uniform ``u[i]`` picks: the first whose
    cumulative probability exceeds it. Zero-probability tokens never qualify (their
    cumulative sum does not move)."""
    cdf = probs.double().cumsum(dim=-1)
    u = u.to(cdf.device)[:, None] * cdf[:, -1:]
    idx = torch.searchsorted(cdf, u, right=True).squeeze(1)
    last = (cdf < cdf[:, -1:]).sum(dim=-1)  # the last token with probability > 0 (rounding guard)
    return torch.minimum(idx, last)


@dataclass(slots=True)
class PenaltyRow:
    """What one row's logit processing needs: its settings and its tokens so far.

    ``token_ids`` is prompt + generated (the repetition penalty sees both); the presence
    and frequency penalties count only the generated ones, ``token_ids[num_prompt_tokens:]``.
    """

    token_ids: list[int]
    num_prompt_tokens: int
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None


def _token_table(lists: list[list[int]], pad: int, device) -> torch.Tensor:
    """``lists`` as one ``[B, longest]`` int64 tensor, padded with ``pad``."""
    width = max((len(x) for x in lists), default=0)
    out = torch.full((len(lists), max(width, 1)), pad, dtype=torch.int64)
    for i, x in enumerate(lists):       # one copy per row, not per token
        if x:
            out[i, :len(x)] = torch.as_tensor(x, dtype=torch.int64)
    return out.to(device)


def apply_penalties(logits: torch.Tensor, rows: list[PenaltyRow]) -> torch.Tensor:
    """``logits`` ``[B, V]`` after each row's processing, in this order: ``logit_bias`` added;
    repetition penalty over prompt + generated tokens (Transformers'
    ``RepetitionPenaltyLogitsProcessor``: a seen token's logit is divided by the penalty
    when positive, multiplied when negative); presence and frequency penalties over the
    generated tokens (OpenAI's: ``logit -= presence * (count > 0) + frequency * count``).
    Returns a new tensor; ``logits`` is left as it was (its raw values give the logprobs)."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} penalty rows")
    out = logits.float().clone()
    B, V = out.shape
    dev = out.device
    bias = [(i, t, b) for i, r in enumerate(rows) if r.logit_bias for t, b in r.logit_bias.items()]
    if bias:
        ri, ti, bi = zip(*bias, strict=True)
        if max(ti) >= V:
            raise ValueError(f"logit_bias names token {max(ti)}, outside the vocabulary [0, {V})")
        out.index_put_((torch.tensor(ri, device=dev), torch.tensor(ti, device=dev)),
                       torch.tensor(bi, dtype=out.dtype, device=dev), accumulate=True)
    rep = [i for i, r in enumerate(rows) if r.repetition_penalty != 1.0]
    if rep:
        ids = _token_table([rows[i].token_ids for i in rep], V, dev)   # pad = V: a spare column
        seen = torch.zeros(len(rep), V + 1, dtype=torch.bool, device=dev).scatter_(1, ids, True)[:, :V]
        pen = torch.tensor([rows[i].repetition_penalty for i in rep], dtype=out.dtype, device=dev)[:, None]
        x = out[rep]
        out[rep] = torch.where(seen, torch.where(x < 0, x * pen, x / pen), x)
    occ = [i for i, r in enumerate(rows) if r.presence_penalty != 0.0 or r.frequency_penalty != 0.0]
    if occ:
        ids = _token_table([rows[i].token_ids[rows[i].num_prompt_tokens:] for i in occ], V, dev)
        counts = torch.zeros(len(occ), V + 1, dtype=out.dtype, device=dev).scatter_add_(
            1, ids, torch.ones_like(ids, dtype=out.dtype))[:, :V]
        pres = torch.tensor([rows[i].presence_penalty for i in occ], dtype=out.dtype, device=dev)[:, None]
        freq = torch.tensor([rows[i].frequency_penalty for i in occ], dtype=out.dtype, device=dev)[:, None]
        out[occ] -= pres * (counts > 0).to(out.dtype) + freq * counts
    return out


def logprob_entries(logits: torch.Tensor, token_ids: list[int], num_top: list[int],
                    decode=None) -> list[dict[int, Logprob]]:
    """For each row of raw ``logits`` ``[B, V]``: ``{token: Logprob}`` for ``token_ids[i]``
    and the row's ``num_top[i]`` most likely tokens, under ``log_softmax(logits)`` (the
    model's raw distribution). Ranks count the tokens strictly more likely, plus one.
    ``decode(id) -> str`` fills ``decoded_token`` when given."""
    if logits.shape[0] != len(token_ids) or len(num_top) != len(token_ids):
        raise ValueError(f"logits {tuple(logits.shape)}, {len(token_ids)} tokens and "
                         f"{len(num_top)} top-k counts differ")
    if not token_ids:
        return []
    lp = logits.float().log_softmax(dim=-1)
    chosen = torch.tensor(token_ids, dtype=torch.int64, device=lp.device)[:, None]
    chosen_lp = lp.gather(1, chosen)
    ranks = ((lp > chosen_lp).sum(dim=-1) + 1).tolist()
    chosen_lp = chosen_lp.squeeze(1).tolist()
    kmax = max(num_top)
    top_lp, top_ids = (lp.topk(kmax, dim=-1) if kmax else (lp[:, :0], chosen[:, :0]))
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    name = decode if decode is not None else (lambda _t: None)
    out = []
    for i, t in enumerate(token_ids):
        entry = {t: Logprob(chosen_lp[i], ranks[i], name(t))}
        for r in range(num_top[i]):
            tid = top_ids[i][r]
            if tid not in entry and top_lp[i][r] > -math.inf:   # a masked token (-inf) is no candidate
                entry[tid] = Logprob(top_lp[i][r], r + 1, name(tid))
        out.append(entry)
    return out
