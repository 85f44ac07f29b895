"""Qwen3 (dense): per-head q/k RMSNorm, full attention in every layer."""

from tidal.families.base import Family

FAMILY = Family(name="qwen3", model_types=("qwen3",), engine_model="tidal.engine.native.models.dense:Qwen3ForCausalLM",
                qk_norm="head", exact=True)
