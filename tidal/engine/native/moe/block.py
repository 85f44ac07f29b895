"""The sparse MoE block (``mlp`` of an MoE decoder layer): route, then run the routed experts.

Weight names as in ``transformers`` 5: ``mlp.gate.weight`` (router), ``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``.
"""

from __future__ import annotations

import torch
from torch import nn

from tidal.engine.native.moe.experts import FusedExperts
from tidal.engine.native.moe.record import RoutingSink
from tidal.engine.native.moe.router import TopKRouter
from tidal.engine.native.parallel import TPGroup


class SparseMoeBlock(nn.Module):
    """``index``: this block's ordinal among the model's MoE layers; ``sink``: the model's
    :class:`RoutingSink`, where it writes its routing while the runner records."""

    def __init__(self, *, hidden: int, num_experts: int, top_k: int, intermediate: int, norm_topk_prob: bool,
                 tp: TPGroup, ops, dtype: torch.dtype, index: int, sink: RoutingSink):
        super().__init__()
        self.gate = TopKRouter(hidden, num_experts, top_k, norm_topk_prob, dtype)
        self.experts = FusedExperts(num_experts, hidden, intermediate, tp, ops, dtype)
        self.index, self.sink = index, sink

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        routing = self.gate(x_TH)
        self.sink.write(self.index, routing.experts_TK)
        return self.experts(x_TH, routing)
