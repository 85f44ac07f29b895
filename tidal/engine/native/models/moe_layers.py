"""What the MoE engine models share: their sparse layers' MLPs as
:class:`~tidal.engine.native.moe.block.SparseMoeBlock` (router ``mlp.gate``, stacked experts
``mlp.experts.*``; with the family's shared expert a
:class:`~tidal.engine.native.moe.block.SharedExpertMoeBlock`), at the layers the family's
:class:`~tidal.families.MoEShape` makes sparse."""

from __future__ import annotations

import copy

import torch

from tidal.engine.native.models.dense import MLP, DecoderLM
from tidal.engine.native.moe.block import SharedExpertMoeBlock, SparseMoeBlock
from tidal.engine.native.moe.record import RoutingSink
from tidal.engine.native.parallel import TPGroup
from tidal.families import MoEShape


def body_config(cfg, shape: MoEShape, tp: TPGroup):
    """The config the dense body is built from: ``cfg`` itself when some layer keeps a dense MLP; else
    a copy whose dense MLP is ``tp.size`` wide, since every one of them is replaced (no transient
    full-size dense MLP per layer)."""
    if shape.dense_layers:
        return cfg
    small = copy.copy(cfg)
    small.intermediate_size = tp.size
    return small


def use_moe_blocks(model: DecoderLM, cfg, shape: MoEShape, tp: TPGroup, ops, dtype: torch.dtype) -> None:
    """Give ``model`` a ``routing_sink`` and replace the MLP of every sparse layer of ``shape``."""
    if shape.shared_experts > 1 or (shape.shared_experts and not shape.shared_expert_gate):
        raise NotImplementedError(f"{cfg.model_type}: {shape.shared_experts} shared experts per layer, gated: "
                                  f"{shape.shared_expert_gate}; the native engine runs one with a sigmoid gate (Qwen3.5-MoE's)")
    layers = shape.sparse_layers(cfg.num_hidden_layers)
    model.routing_sink = RoutingSink(len(layers), shape.top_k, shape.experts)
    for index, i in enumerate(layers):
        block = dict(hidden=cfg.hidden_size, num_experts=shape.experts, top_k=shape.top_k,
                     intermediate=shape.expert_intermediate, norm_topk_prob=shape.router == "softmax_topk_renorm",
                     tp=tp, ops=ops, dtype=dtype, index=index, sink=model.routing_sink)
        if shape.shared_experts:
            shared = MLP(cfg, tp, ops, dtype, bias=False, intermediate=shape.shared_intermediate)
            model.model.layers[i].mlp = SharedExpertMoeBlock(shared_expert=shared, **block)
        else:
            model.model.layers[i].mlp = SparseMoeBlock(**block)
