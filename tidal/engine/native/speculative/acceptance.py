"""Exact acceptance of deterministic drafts (speculative sampling with a point-mass proposal).

A verify step feeds each drafting sequence its last token and ``k`` drafted tokens ``d_1..d_k`` as
``k + 1`` consecutive rows; row ``t`` yields the target distribution ``p_t`` of the token after
``d_t`` (``d_0``: the last sampled token). Row ``t < k`` verifies ``d_{t+1}``, the last row has no
draft (the bonus token).

Every row draws its token exactly as the plain path would at that position: the inverse-CDF draw
:func:`tidal.engine.sampler.sample` from ``p_t`` with the row's keyed uniform (the sequence's seed
and key, the token's index: :func:`tidal.engine.sampler.keyed_uniforms`), the argmax when greedy.
The draft is accepted when that draw equals it; the first row whose draw differs (or the bonus row)
emits its draw, and later rows are void. So:

- the emitted tokens are token for token those of the plain path with the same seed (each emitted
  row's context holds only accepted drafts, i.e. the plain path's own tokens, so ``p_t`` is the
  plain path's distribution there): exactly ``p``, with the plain path's logprobs;
- a draft ``d`` is accepted with probability ``P(draw = d) = p(d) = min(1, p(d) / q(d))`` for the
  proposal ``q = delta(d)``: the acceptance rate of Leviathan et al. (2023, Algorithm 1), whose
  rejection draw from ``norm(max(0, p - q))`` this coupling realises (a rejected row's draw is
  never ``d``, and has law ``p`` without ``d``, renormalised).

``p`` is the processed distribution of the plain path (:func:`tidal.engine.sampler.process_logits`:
temperature, top-k, top-p, renormalised), and the logprob returned for every emitted token is
``log p_t(token)`` under it.
"""

from __future__ import annotations

import torch

from tidal.engine.sampler import sample
from tidal.sampling_filter import SamplingFilter

VOID = -1  # the token of a row past its sequence's first rejection


def accept(logits_TV: torch.Tensor, draft_T: torch.Tensor, group_T: torch.Tensor, u_T: torch.Tensor | None, *,
           sampling: SamplingFilter) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify the drafts of a batch of ``T`` rows.

    ``logits_TV``: the target's logits per row; ``draft_T``: the token each row verifies (``VOID`` for
    a sequence's last row, and for plain decode rows, which are one-row groups); ``group_T``: the
    sequence index of each row, non-decreasing; ``u_T``: each row's keyed uniform (None when
    greedy). Returns ``(token_T int64, logp_T fp32)``: the emitted token of each row (``VOID`` past
    its sequence's first rejection) and its logprob under the processed target distribution."""
    token_T, logp_T = sample(logits_TV, sampling.temperature, sampling.top_k, sampling.top_p, u_T, min_p=sampling.min_p)
    ok_T = (draft_T >= 0) & (token_T == draft_T)
    return torch.where(emitted(ok_T, group_T), token_T, VOID), logp_T


def emitted(ok_T: torch.Tensor, group_T: torch.Tensor) -> torch.Tensor:
    """Which rows are emitted: those with no rejected row (``~ok_T``) before them in their sequence
    (``group_T``, non-decreasing); so a sequence emits its accepted rows up to and including its
    first rejected one."""
    bad_T = (~ok_T).long()
    before_T = bad_T.cumsum(0) - bad_T  # rejections before each row, over the whole batch
    first_T = torch.ones_like(group_T, dtype=torch.bool)
    first_T[1:] = group_T[1:] != group_T[:-1]
    start_T = torch.cummax(torch.where(first_T, torch.arange(len(group_T), device=group_T.device), 0), 0).values
    return before_T == before_T[start_T]
