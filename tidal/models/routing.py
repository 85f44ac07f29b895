"""Top-k routing exactly as the ``transformers`` 5 MoE families define it (Qwen3-MoE, OLMoE):

    logits_TE = x_TH W_EH^T                          (in the model dtype)
    p_TE      = softmax(logits_TE)                   (in float32)
    w_TK, e_TK = top-k of p_TE                       (ties: torch.topk's order)
    w_TK     /= sum_k w_TK      if norm_topk_prob
    w_TK      = w_TK.to(model dtype)

:func:`replay_weights` gives the gate weights of a *given* expert choice from the same logits (routing
replay: the experts come from the rollout, the weights from the trainer's router, so the router still
gets gradient). Torch only: the native engine's router (:mod:`tidal.engine.native.moe.router`) and the
trainer's routing replay (:mod:`tidal.models.moe`) both compute with these.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F


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
