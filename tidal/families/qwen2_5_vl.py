"""Qwen2.5-VL: the Qwen2 decoder with M-RoPE and its own (window-attention) vision tower."""

from tidal.families.base import Family

FAMILY = Family(name="qwen2_5_vl", model_types=("qwen2_5_vl",),
                engine_model="tidal.engine.native.models.dense:Qwen2_5_VLForConditionalGeneration",
                text_prefix="model.language_model.")
