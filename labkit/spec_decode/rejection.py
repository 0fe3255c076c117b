"""Verification: which drafted tokens a step keeps, so that the output is what decoding gives.

The step's forward pass returns, at each drafted position ``j``, the target's distribution
``p_j`` (after the request's temperature, top-k, top-p, min-p, penalties and grammar, exactly
as a step of its own would compute it there). Two rules keep the output exact:

**Point-mass drafts** (prompt lookup, a grammar's forced tokens, a draft model's argmax):
sample position ``j`` from ``p_j`` as decoding would, with the same generator, and keep the
draft while the sample equals it (``accepted_prefix``); the first sample that differs is the
step's own token. This *is* rejection sampling for a draft distribution ``q`` = one-hot:
the draft ``x`` is kept with probability ``p(x) = min(1, p(x)/q(x))``, and given a rejection
the sample is distributed as ``p`` without ``x``, renormalised: ``(p - q)+`` normalised. And
because each position draws from the generator a step of its own would use, a seeded request
gets the very tokens it gets without speculation.

**Sampled drafts** (``draft_sampling="sample"``: ``x_j ~ q_j``): keep ``x_j`` with probability
``min(1, p_j(x_j) / q_j(x_j))``; at the first rejection, sample the step's token from the
residual ``(p_j - q_j)+``, normalised; when every draft is kept, sample one more token from
the distribution after the last (``speculative_sample``). Leviathan et al. (2023) and Chen
et al. (2023) prove the kept tokens are distributed as ``p``: for every token ``x``,
``P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) (p(x) - q(x))+ / sum_y (p(y) - q(y))+
= min(p(x), q(x)) + (p(x) - q(x))+ = p(x)``. The output's distribution is the same; its
seeded tokens are not those of decoding without speculation (the uniform draws mean other
things).

``acceptance_probability`` and ``residual`` are the two formulas, kept apart so that a test
can break one and watch the distribution test fail.
"""

from __future__ import annotations

import torch

from ..model.sampler import inverse_cdf, uniforms


def accepted_prefix(drafted: list[int], sampled: list[int]) -> int:
    """How many leading drafts equal the token sampled at their position (point masses).
    ``sampled`` may be one longer (the token after the last draft): it is not compared."""
    return next((j for j, (d, s) in enumerate(zip(drafted, sampled, strict=False)) if d != s), len(drafted))


def acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)): the chance a draft ``x`` drawn from q is kept, where the target gives p."""
    return torch.clamp(p_x / q_x, max=1.0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(p - q)+: where the target wants more than the draft gave. Sampling from it (normalised)
    after a rejection makes up for the mass the draft took where p < q. Where it is all zero
    (p equals q up to rounding, so a rejection almost never happens) it is p itself."""
    r = torch.clamp(p - q, min=0.0)
    return torch.where(r.sum() > 0, r, p)


def speculative_sample(p: torch.Tensor, q: torch.Tensor, drafted: list[int],
                       generators: list[torch.Generator | None]) -> tuple[int, int]:
    """Rejection sampling over one sequence's sampled drafts.

    ``p``: ``[d + 1, V]`` the target's distributions at the drafted positions and after the
    last; ``q``: ``[d, V]`` the draft's, each ``drafted[j]`` sampled from ``q[j]``;
    ``generators``: ``d + 1``, each position's (None: torch's global one). Returns
    ``(kept, token)``: how many drafts are kept, and the token the step adds after them."""
    d = len(drafted)
    for j, x in enumerate(drafted):
        u = uniforms([generators[j]])[0].item()
        if u < float(acceptance_probability(p[j, x], q[j, x])):
            continue
        r = residual(p[j], q[j])
        return j, int(inverse_cdf(r[None], uniforms([generators[j]]))[0])
    return d, int(inverse_cdf(p[d][None], uniforms([generators[d]]))[0])
