"""Exact acceptance of deterministic drafts (speculative sampling with a point-mass proposal).

A verify step feeds each drafting sequence its last token and ``k`` drafted tokens ``d_1..d_k`` as
``k + 1`` consecutive rows; row ``t`` yields the target distribution ``p_t`` of the token after
``d_t`` (``d_0``: the last sampled token). Row ``t < k`` verifies ``d_{t+1}``, the last row has no
draft (the bonus token). With the proposal ``q = delta(d)`` the rule of Leviathan et al. (2023,
Algorithm 1) reads:

    accept d with probability min(1, p(d) / q(d)) = p(d);
    on rejection draw from norm(max(0, p - q)) = p with d removed, renormalised.

The emitted token at a row then has law ``P(d) = p(d)`` and ``P(x) = (1 - p(d)) p(x) / (1 - p(d)) =
p(x)`` for ``x != d``: exactly ``p``. A sequence emits its accepted drafts and the token of its first
rejected (or bonus) row; later rows are void. Greedy (temperature 0) is prefix matching against
the argmax. ``p`` is the processed distribution of the plain path
(:func:`tidal.engine.sampler.process_logits`: temperature, top-k, top-p, renormalised), and the
logprob returned for every emitted token is ``log p_t(token)`` under it, what the plain path
returns for that token.
"""

from __future__ import annotations

import torch

from tidal.engine.sampler import process_logits

VOID = -1  # the token of a row past its sequence's first rejection


def residual_scores(scores_TV: torch.Tensor, draft_T: torch.Tensor, has_draft_T: torch.Tensor) -> torch.Tensor:
    """Gumbel-max scores of ``norm(max(0, p - delta(d)))`` from those of ``p`` (``log p + Gumbel
    noise``): the draft's score set to -inf on rows with a draft. Renormalising does not move an
    argmax, so the argmax of these is a draw from the target with the draft removed (a row whose
    draft holds all the mass is never rejected and its draw never used)."""
    return torch.where(has_draft_T[:, None], scores_TV.scatter(-1, draft_T[:, None], float("-inf")), scores_TV)


def accept(logits_TV: torch.Tensor, draft_T: torch.Tensor, group_T: torch.Tensor, *, temperature: float,
           top_k: int, top_p: float, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify the drafts of a batch of ``T`` rows.

    ``logits_TV``: the target's logits per row; ``draft_T``: the token each row verifies (``VOID`` for
    a sequence's last row, and for plain decode rows, which are one-row groups); ``group_T``: the
    sequence index of each row, non-decreasing. Returns ``(token_T int64, logp_T fp32)``: the emitted
    token of each row (``VOID`` past its sequence's first rejection) and its logprob under the
    processed target distribution."""
    logp_TV = process_logits(logits_TV, temperature, top_k, top_p)
    has_T = draft_T >= 0
    d_T = draft_T.clamp_min(0)
    logp_d_T = logp_TV.gather(-1, d_T[:, None]).squeeze(-1)
    if temperature == 0:
        target_T = logp_TV.argmax(-1)
        ok_T = has_T & (target_T == d_T)
        final_T = target_T
    else:
        u_T = torch.rand(logp_d_T.shape, device=logp_d_T.device, generator=generator)
        ok_T = has_T & (u_T < logp_d_T.exp())
        g_TV = torch.rand(logp_TV.shape, device=logp_TV.device, generator=generator)
        scores_TV = logp_TV - torch.log(-torch.log(g_TV.clamp_min(1e-20)))  # Gumbel-max
        final_T = residual_scores(scores_TV, d_T, has_T).argmax(-1)
    token_T = torch.where(ok_T, d_T, final_T)
    # a row is emitted while no earlier row of its sequence was rejected
    bad_T = (~ok_T).long()
    before_T = bad_T.cumsum(0) - bad_T  # rejections before each row, over the whole batch
    first_T = torch.ones_like(group_T, dtype=torch.bool)
    first_T[1:] = group_T[1:] != group_T[:-1]
    start_T = torch.cummax(torch.where(first_T, torch.arange(len(group_T), device=group_T.device), 0), 0).values
    emitted_T = before_T == before_T[start_T]
    logp_T = logp_TV.gather(-1, token_T[:, None]).squeeze(-1)
    return torch.where(emitted_T, token_T, VOID), logp_T
