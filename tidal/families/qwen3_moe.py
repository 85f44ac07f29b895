"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention; softmax top-k routing, renormalised
over the top-k when ``norm_topk_prob``; no shared expert; layers in ``mlp_only_layers`` or off the
``decoder_sparse_step`` keep a dense MLP (``transformers`` 5.25 ``Qwen3MoeDecoderLayer``)."""

from typing import Any

from tidal.families.base import Family, MoEShape


def moe(text: Any) -> MoEShape | None:
    experts = int(getattr(text, "num_experts", 0) or 0)
    if experts == 0:
        return None
    step = int(getattr(text, "decoder_sparse_step", 1) or 1)
    skip = set(getattr(text, "mlp_only_layers", None) or [])
    dense = tuple(i for i in range(int(text.num_hidden_layers)) if i in skip or (i + 1) % step)
    return MoEShape(experts=experts, top_k=int(text.num_experts_per_tok), expert_intermediate=int(text.moe_intermediate_size),
                    router="softmax_topk_renorm" if getattr(text, "norm_topk_prob", False) else "softmax_topk",
                    dense_layers=dense)


FAMILY = Family(name="qwen3_moe", model_types=("qwen3_moe",), engine_model="tidal.engine.native.models.qwen3_moe:Qwen3MoeForCausalLM",
                moe=moe, qk_norm="head", exact=True)
