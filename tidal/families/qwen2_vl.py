"""Qwen2-VL: the Qwen2 decoder with M-RoPE and a vision tower; text under ``model.language_model``."""

from tidal.families.base import Family

FAMILY = Family(name="qwen2_vl", model_types=("qwen2_vl",),
                engine_model="tidal.engine.native.models.dense:Qwen2VLForConditionalGeneration",
                text_prefix="model.language_model.")
