"""The sparse MoE block (``mlp`` of an MoE decoder layer): route, then run the routed experts; a
family with a shared expert (Qwen3.5-MoE) adds it, scaled per token by its sigmoid gate.

Weight names as in ``transformers`` 5: ``mlp.gate.weight`` (router), ``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``; the shared expert's ``mlp.shared_expert.{gate,up,down}_proj.weight`` and
``mlp.shared_expert_gate.weight`` ``[1, H]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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


class SharedExpertGate(nn.Module):
    """``mlp.shared_expert_gate``: ``sigmoid(x w^T)`` per token, ``w`` ``[1, H]`` replicated on every
    TP rank (each rank scales its partial shared-expert output by the same gate)."""

    def __init__(self, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden, dtype=dtype), requires_grad=False)

    def weight_slices(self, param, full, shard_id=None):
        return [(param.data, full)]

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x_TH, self.weight))


class SharedExpertMoeBlock(SparseMoeBlock):
    """A sparse block with one always-on shared expert (``transformers`` 5.25
    ``Qwen3_5MoeSparseMoeBlock``): ``y = experts(x) + sigmoid(x w_g^T) * shared_expert(x)``.
    ``shared_expert``: the gated MLP of the shared expert's width (its own TP all-reduce)."""

    def __init__(self, *, shared_expert: nn.Module, **block):
        super().__init__(**block)
        self.shared_expert = shared_expert
        self.shared_expert_gate = SharedExpertGate(block["hidden"], block["dtype"])

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        routed_TH = super().forward(x_TH)
        return routed_TH + self.shared_expert_gate(x_TH) * self.shared_expert(x_TH)
