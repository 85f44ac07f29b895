"""The native engine's router module (``mlp.gate``): the routing math is
:func:`tidal.models.routing.route`, shared with the trainer's routing replay."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.models.routing import Routing, route


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
