"""Qwen3.5-MoE / Qwen3.6-MoE in the native engine: the Qwen3.5 hybrid decoder
(:mod:`tidal.engine.native.models.qwen3_5`: Gated DeltaNet and gated full attention over the state
pool and paged KV) with every layer's MLP the sparse block of its family
(:mod:`tidal.families.qwen3_5_moe`): softmax top-k renormalised, plus the shared expert scaled by
its sigmoid gate (:class:`~tidal.engine.native.moe.block.SharedExpertMoeBlock`). Weight names and
the ``ForConditionalGeneration`` layout as Qwen3.5's."""

from __future__ import annotations

import torch

from tidal.engine.native.models.moe_layers import body_config, use_moe_blocks
from tidal.engine.native.models.qwen3_5 import Qwen3_5ForCausalLM
from tidal.engine.native.parallel import TPGroup
from tidal.families import text_config
from tidal.families.qwen3_5_moe import moe


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE, text only: :class:`Qwen3_5ForCausalLM` whose dense MLPs (built ``tp.size`` wide,
    the config having no ``intermediate_size``) are replaced by MoE blocks, with a ``routing_sink``."""

    def __init__(self, hf_config, tp: TPGroup, ops, dtype: torch.dtype):
        cfg = text_config(hf_config)
        shape = moe(cfg)
        super().__init__(body_config(cfg, shape, tp), tp, ops, dtype)
        self.config = cfg
        use_moe_blocks(self, cfg, shape, tp, ops, dtype)
