"""OLMo 3: sliding-window layers interleaved with full ones (``layer_types``), norms after the
attention and the MLP (not before), q/k RMSNorm over the whole projection, RoPE per layer type."""

from tidal.families.base import Family, layer_type_caches

FAMILY = Family(name="olmo3", model_types=("olmo3",), engine_model="tidal.engine.native.models.olmo3:Olmo3ForCausalLM",
                layer_caches=layer_type_caches, packed_kernels=frozenset({"attention", "sliding_window"}),
                qk_norm="projection")
