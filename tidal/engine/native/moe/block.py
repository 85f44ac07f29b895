"""The sparse MoE block (``mlp`` of an MoE decoder layer): route, then run the routed experts.

Weight names as in ``transformers`` 5: ``mlp.gate.weight`` (router), ``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``.
"""

from __future__ import annotations

import torch
from torch import nn

from tidal.engine.native.moe.experts import FusedExperts
from tidal.engine.native.moe.router import TopKRouter
from tidal.engine.native.parallel import TPGroup


class SparseMoeBlock(nn.Module):
    def __init__(self, *, hidden: int, num_experts: int, top_k: int, intermediate: int, norm_topk_prob: bool,
                 tp: TPGroup, ops, dtype: torch.dtype):
        super().__init__()
        self.gate = TopKRouter(hidden, num_experts, top_k, norm_topk_prob, dtype)
        self.experts = FusedExperts(num_experts, hidden, intermediate, tp, ops, dtype)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        return self.experts(x_TH, self.gate(x_TH))
