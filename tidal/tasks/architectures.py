"""The tiny model of each family that a built-in task can build (``task.architecture``), torch-free:
the ``transformers`` config and model classes, by name, and the family's own settings on top of
the task's shape (``hidden_size``, ``num_layers``, ``num_heads``, ``num_kv_heads``,
``intermediate_size``). Each family runs on the native engine (:mod:`tidal.families`)."""

from __future__ import annotations

# architecture -> (transformers config class, causal LM class)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
}
# the tiny Qwen3-MoE's (and Qwen3.5-MoE's) experts: MOE_EXPERTS of intermediate_size / 2 each,
# top-MOE_TOP_K renormalised
MOE_EXPERTS, MOE_TOP_K = 8, 2
# the sliding window of the tiny Gemma 3 / OLMo 3 (tokens): shorter than a quickstart prompt and its
# answer (~15-20 tokens), so the window shapes what the model computes
TINY_SLIDING_WINDOW = 8


def family_settings(architecture: str, *, head_dim: int, num_layers: int, intermediate_size: int) -> dict:
    """The config keywords a family needs beyond the task's shape: an explicit ``head_dim`` (Qwen3
    and Gemma 3 default to 128 / 256), and for the sliding-window families every layer but the last
    a ``sliding_attention`` one (the last is ``full_attention``) with :data:`TINY_SLIDING_WINDOW`;
    Qwen3.5: :func:`qwen3_5_settings` (Qwen3.5-MoE: with the MoE of the tiny Qwen3-MoE and a shared expert)."""
    if architecture in ("qwen2", "llama"):
        return {}
    if architecture == "qwen3":
        return {"head_dim": head_dim}
    if architecture == "qwen3_moe":  # every layer sparse: MOE_EXPERTS experts of intermediate_size / 2, top-MOE_TOP_K
        return {"head_dim": head_dim, "num_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K,
                "moe_intermediate_size": max(1, intermediate_size // 2), "norm_topk_prob": True}
    if architecture == "qwen3_5":
        return qwen3_5_settings(head_dim=head_dim, num_layers=num_layers)
    if architecture == "qwen3_5_moe":  # the tiny Qwen3.5, every layer sparse with a shared expert of intermediate_size / 2
        width = max(1, intermediate_size // 2)
        return {**qwen3_5_settings(head_dim=head_dim, num_layers=num_layers), "num_experts": MOE_EXPERTS,
                "num_experts_per_tok": MOE_TOP_K, "moe_intermediate_size": width, "shared_expert_intermediate_size": width}
    layer_types = ["sliding_attention"] * (num_layers - 1) + ["full_attention"]
    sliding = {"head_dim": head_dim, "sliding_window": TINY_SLIDING_WINDOW, "layer_types": layer_types}
    if architecture == "gemma3":
        return {**sliding, "query_pre_attn_scalar": head_dim}
    if architecture == "olmo3":
        return sliding
    raise ValueError(f"task.architecture={architecture!r}: choose one of {sorted(ARCHITECTURES)}")


def qwen3_5_settings(*, head_dim: int, num_layers: int) -> dict:
    """The tiny Qwen3.5: every layer but the last a Gated DeltaNet one (``linear_attention``, 2 key
    and 4 value heads of ``head_dim``), the last gated full attention
    (half its head dims rotated, as the released models' ``partial_rotary_factor`` of 0.25 rotates a
    quarter of 256); at least 2 layers so both kinds take part."""
    if num_layers < 2:
        raise ValueError("task.architecture=qwen3_5 needs task.num_layers >= 2 (linear-attention layers and a full-attention one)")
    return {"head_dim": head_dim, "layer_types": ["linear_attention"] * (num_layers - 1) + ["full_attention"],
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": head_dim,
            "linear_value_head_dim": head_dim,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}
