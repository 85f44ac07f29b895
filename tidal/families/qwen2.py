"""Qwen2 / Qwen2.5: dense decoder, bias on q/k/v, full attention in every layer."""

from tidal.families.base import Family

FAMILY = Family(name="qwen2", model_types=("qwen2",), engine_model="tidal.engine.native.models.dense:Qwen2ForCausalLM", exact=True)
