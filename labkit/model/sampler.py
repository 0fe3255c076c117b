"""Turning logits into next tokens: greedy, temperature, top-k, top-p, per-request seeds.

``sample(logits, rows)`` takes one ``SamplingRow`` per row of ``logits``. Greedy rows
(``is_greedy``: temperature 0, or below ``GREEDY_EPS``) are one ``argmax`` over all of
them, exactly what Hugging Face's greedy ``generate`` does. Random rows are filtered and
normalised together, then each draws one uniform number from *its own*
``torch.Generator`` and picks its token by inverse CDF: a request with a seed gets the
same tokens whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling_params import is_greedy, validate_distribution


@dataclass(slots=True)
class SamplingRow:
    """Sampling settings of one row of logits (the engine builds it from SamplingParams)."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 or -1: all
    generator: torch.Generator | None = None  # per-request stream (seeded requests); None: global RNG

    def __post_init__(self):
        validate_distribution(self.temperature, self.top_p, self.top_k, owner="SamplingRow")

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)


def make_generator(seed: int | None, device="cpu") -> torch.Generator | None:
    """A generator for a request's seed (None: no seed, use the global RNG)."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(int(seed))


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
        for i, t in zip(greedy, ids):
            out[i] = t
    rand = [i for i, r in enumerate(rows) if not r.greedy]
    if rand:
        ids = _sample_random(logits[rand], [rows[i] for i in rand]).tolist()
        for i, t in zip(rand, ids):
            out[i] = t
    return out


def probabilities(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distributions the random rows are drawn from ``[B, V]`` (after temperature, top-k, top-p)."""
    logits = logits.float()
    temps = torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=logits.device)
    logits = logits / temps[:, None]
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
    probs = probabilities(logits, rows)
    # One uniform per row, from the row's own generator when it has one.
    u = torch.empty(len(rows), dtype=torch.float64)
    shared = [i for i, r in enumerate(rows) if r.generator is None]
    if shared:
        u[shared] = torch.rand(len(shared), dtype=torch.float64)
    for i, r in enumerate(rows):
        if r.generator is not None:
            u[i] = torch.rand(1, dtype=torch.float64, generator=r.generator, device=r.generator.device).item()
    # Inverse CDF: the first token whose cumulative probability exceeds u (zero-probability
    # tokens never qualify: their cumulative sum does not move).
    cdf = probs.double().cumsum(dim=-1)
    u = u.to(cdf.device)[:, None] * cdf[:, -1:]
    idx = torch.searchsorted(cdf, u, right=True).squeeze(1)
    last = (cdf < cdf[:, -1:]).sum(dim=-1)  # the last token with probability > 0 (rounding guard)
    return torch.minimum(idx, last)
