"""Llama 2/3: dense decoder, full attention in every layer."""

from tidal.families.base import Family

FAMILY = Family(name="llama", model_types=("llama",), engine_model="tidal.engine.native.models.dense:LlamaForCausalLM", exact=True)
