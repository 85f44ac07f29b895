"""Gemma 3 (text, and the text tower of ``Gemma3ForConditionalGeneration`` for text-only RL):
sliding-window layers interleaved with full ones (``layer_types``), (1 + w) RMSNorm, scaled
embeddings, q/k norm, pre/post feed-forward norms, GELU (tanh)."""

from tidal.families.base import Family, layer_type_caches

FAMILY = Family(name="gemma3", model_types=("gemma3", "gemma3_text"),
                engine_model="tidal.engine.native.models.gemma3:Gemma3ForCausalLM",
                layer_caches=layer_type_caches, packed_kernels=frozenset({"attention", "sliding_window"}),
                text_prefix="model.language_model.", text_only=True, qk_norm="head", norms_per_layer=4, exact=True)
