"""Qwen3-MoE in the native engine: the Qwen3 decoder (per-head q/k RMSNorm) with the sparse layers
of its family (:mod:`tidal.families.qwen3_moe`) as MoE blocks."""

from __future__ import annotations

import torch

from tidal.engine.native.models.dense import Qwen3ForCausalLM
from tidal.engine.native.models.moe_layers import body_config, use_moe_blocks
from tidal.engine.native.parallel import TPGroup
from tidal.families.qwen3_moe import moe


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE: softmax top-k routing (renormalised if ``norm_topk_prob``), no shared expert;
    layers in ``mlp_only_layers`` or off the ``decoder_sparse_step`` keep a dense MLP."""

    def __init__(self, cfg, tp: TPGroup, ops, dtype: torch.dtype):
        shape = moe(cfg)
        super().__init__(body_config(cfg, shape, tp), tp, ops, dtype)
        self.config = cfg
        use_moe_blocks(self, cfg, shape, tp, ops, dtype)
