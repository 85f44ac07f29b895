"""Qwen3.5 / Qwen3.6 dense (``qwen3_5_text``; ``qwen3_5`` is the ``ForConditionalGeneration`` whose
text tower is under ``text_config``, weights under ``model.language_model``): hybrid layers, as
``config.layer_types`` lists them: Gated DeltaNet (``linear_attention``: a fixed-size recurrent state
per sequence: the short-conv state ``[2 * Hk * dk + Hv * dv, K - 1]`` and the delta-rule state
``[Hv, dk, dv]``, float32) and gated full attention (``full_attention``: paged KV). Text-only
(``text_only``): a ``ForConditionalGeneration`` checkpoint trains and rolls out its text tower, its
vision tower is not loaded (:mod:`tidal.engine.native.models.qwen3_5`)."""

from typing import Any

from tidal.families.base import Family, LayerCache, head_dim_of, kv_heads_of


def hybrid_caches(text: Any) -> list[LayerCache]:
    """``recurrent`` for each ``linear_attention`` layer, ``full_kv`` for each ``full_attention`` one."""
    hk, hv = int(text.linear_num_key_heads), int(text.linear_num_value_heads)
    dk, dv = int(text.linear_key_head_dim), int(text.linear_value_head_dim)
    state = LayerCache(kind="recurrent", state_shapes=((2 * hk * dk + hv * dv, int(text.linear_conv_kernel_dim) - 1),
                                                       (hv, dk, dv)), state_dtype="float32")
    full = LayerCache(kind="full_kv", kv_heads=kv_heads_of(text), head_dim=head_dim_of(text))
    caches = {"linear_attention": state, "full_attention": full}
    unknown = sorted(set(text.layer_types) - set(caches))
    if unknown:
        raise ValueError(f"qwen3_5: layer_types {unknown} are none of {sorted(caches)}")
    return [caches[kind] for kind in text.layer_types]


FAMILY = Family(
    name="qwen3_5", model_types=("qwen3_5", "qwen3_5_text"),
    engine_model="tidal.engine.native.models.qwen3_5:Qwen3_5ForCausalLM",
    layer_caches=hybrid_caches,
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj",
                  "gate_proj", "up_proj", "down_proj"),
    packed_kernels=frozenset({"attention", "linear_attention"}),
    text_prefix="model.language_model.", text_only=True, qk_norm="head", exact=True,
)
