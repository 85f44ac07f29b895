"""Top-k routing exactly as the ``transformers`` 5 MoE families define it (Qwen3-MoE, OLMoE):

    logits_TE = x_TH W_EH^T                          (in the model dtype)
    p_TE      = softmax(logits_TE)                   (in float32)
    w_TK, e_TK = top-k of p_TE                       (ties: torch.topk's order)
    w_TK     /= sum_k w_TK      if norm_topk_prob
    w_TK      = w_TK.to(model dtype)

:func:`replay_weights` gives the gate weights of a *given* expert choice from the same logits (routing
replay: the experts come from the rollout, the weights from the trainer's router, so the router still
gets gradient). Torch only; no engine state.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class Routing:
    """One MoE layer's routing of ``T`` tokens: ``weights_TK`` (model dtype) for ``experts_TK`` (int64)."""

    weights_TK: torch.Tensor
    experts_TK: torch.Tensor


def route(logits_TE: torch.Tensor, top_k: int, norm_topk_prob: bool) -> Routing:
    """The softmax top-k routing above; weights in ``logits_TE``'s dtype."""
    probs_TE = F.softmax(logits_TE, dim=-1, dtype=torch.float32)
    top_TK, experts_TK = torch.topk(probs_TE, top_k, dim=-1)
    if norm_topk_prob:
        top_TK = top_TK / top_TK.sum(dim=-1, keepdim=True)
    return Routing(top_TK.to(logits_TE.dtype), experts_TK)


def replay_weights(logits_TE: torch.Tensor, experts_TK: torch.Tensor, norm_topk_prob: bool) -> torch.Tensor:
    """Gate weights ``[T, K]`` (``logits_TE``'s dtype) of the given ``experts_TK``: the softmax
    probabilities of those experts, renormalised over them if ``norm_topk_prob`` -- what :func:`route`
    gives when its top-k is ``experts_TK``; differentiable in ``logits_TE``."""
    probs_TE = F.softmax(logits_TE, dim=-1, dtype=torch.float32)
    top_TK = probs_TE.gather(-1, experts_TK.long())
    if norm_topk_prob:
        top_TK = top_TK / top_TK.sum(dim=-1, keepdim=True)
    return top_TK.to(logits_TE.dtype)


class TopKRouter(nn.Module):
    """The router ``mlp.gate``: weight ``[E, H]`` replicated on every TP rank (it is small and every
    rank needs the same choice)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool, dtype: torch.dtype):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden, dtype=dtype), requires_grad=False)

    def weight_slices(self, param, full, shard_id=None):
        return [(param.data, full)]

    def forward(self, x_TH: torch.Tensor) -> Routing:
        return route(F.linear(x_TH, self.weight), self.top_k, self.norm_topk_prob)
