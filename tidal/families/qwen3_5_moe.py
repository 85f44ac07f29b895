"""Qwen3.5-MoE / Qwen3.6-MoE (Qwen3.5-35B-A3B, Qwen3.6-35B-A3B; ``qwen3_5_moe_text``, and
``qwen3_5_moe``'s text tower under ``text_config``, weights under ``model.language_model``): the
Qwen3.5 hybrid layers (:mod:`tidal.families.qwen3_5`: Gated DeltaNet and gated full attention, as
``config.layer_types`` lists them) with a sparse MLP in every layer: softmax top-k routing always
renormalised over the top-k, and one shared expert of ``shared_expert_intermediate_size`` whose
output a per-token sigmoid gate (``shared_expert_gate``) scales (``transformers`` 5.25
``Qwen3_5MoeSparseMoeBlock``)."""

import dataclasses
from typing import Any

from tidal.families.base import MoEShape
from tidal.families.qwen3_5 import FAMILY as QWEN3_5


def moe(text: Any) -> MoEShape:
    return MoEShape(experts=int(text.num_experts), top_k=int(text.num_experts_per_tok),
                    expert_intermediate=int(text.moe_intermediate_size), shared_experts=1,
                    shared_intermediate=int(text.shared_expert_intermediate_size), shared_expert_gate=True,
                    peft_maps_expert_names=False, router="softmax_topk_renorm")


# LoRA defaults (Qwen3.5's): attention and Gated DeltaNet projections and the shared expert's
# gate_proj, up_proj, down_proj; the routed experts only through model.lora.target_parameters
FAMILY = dataclasses.replace(
    QWEN3_5, name="qwen3_5_moe", model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    engine_model="tidal.engine.native.models.qwen3_5_moe:Qwen3_5MoeForCausalLM", moe=moe,
)
