"""OLMoE (OLMoE-1B-7B): every layer sparse (softmax top-k, renormalised when ``norm_topk_prob``, no
shared expert); q/k RMSNorm over all heads together and ``clip_qkv`` (``transformers`` 5.25
``OlmoeDecoderLayer``). The experts' intermediate size is the config's ``intermediate_size``."""

from typing import Any

from tidal.families.base import Family, MoEShape


def moe(text: Any) -> MoEShape:
    return MoEShape(experts=int(text.num_experts), top_k=int(text.num_experts_per_tok),
                    expert_intermediate=int(text.intermediate_size),
                    router="softmax_topk_renorm" if getattr(text, "norm_topk_prob", False) else "softmax_topk")


FAMILY = Family(name="olmoe", model_types=("olmoe",), engine_model="tidal.engine.native.models.olmoe:OlmoeForCausalLM",
                moe=moe, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"), qk_norm="projection", exact=True)
