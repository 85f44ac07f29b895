"""Model shapes: the real Qwen2.5 configs (random weights) and two tiny ones for CPU runs (``tiny``,
and ``tiny2``, a wider and deeper one over the same vocabulary: the CPU matrix's distillation
teacher), with the counts the bounds need. A shape is the keyword set of ``transformers.Qwen2Config``,
or with a ``model_type`` that of its family's config (``30b-a3b``: Qwen3-30B-A3B's shape, a
mixture of experts: its counts come from :class:`tidal.memory.plan.ModelShape` and the family's
:class:`~tidal.families.MoEShape`)."""

from __future__ import annotations

import numpy as np

from tidal import families
from tidal.memory.plan import ModelShape

_QWEN25 = dict(rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6)

SHAPES: dict[str, dict] = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, **_QWEN25),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, **_QWEN25),
    "3b": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
               intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True, **_QWEN25),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False, **_QWEN25),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1024, tie_word_embeddings=True, rope_theta=10000.0,
                 max_position_embeddings=4096, rms_norm_eps=1e-6),
    "tiny2": dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=192, vocab_size=1024, tie_word_embeddings=True, rope_theta=10000.0,
                  max_position_embeddings=4096, rms_norm_eps=1e-6),
}
SHAPES["30b-a3b"] = dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                        num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936,
                        tie_word_embeddings=False, rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6)
SIZE_ORDER = ["0.5b", "1.5b", "3b", "7b"]

def _every(n: int, layers: int, other: str, last: str) -> list[str]:
    """``layer_types`` with ``last`` at every ``n``-th layer, ``other`` elsewhere (the families'
    default patterns, written out: the parent process reads them without ``transformers``)."""
    return [last if i % n == n - 1 else other for i in range(layers)]


# Each model family the native engine runs, at about 1-2B with its real layer shapes (random weights):
# the GPU check of every family (``python -m bench.grpo matrix --families``, issue 50 item 2).
FAMILY_SHAPES: dict[str, dict] = {
    # Qwen3.5 hybrid: 3 Gated DeltaNet : 1 gated full attention, 16 linear heads of 128, head_dim 256
    "qwen3_5-2b": dict(model_type="qwen3_5_text", hidden_size=2048, num_hidden_layers=24, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=256, intermediate_size=6144, vocab_size=248320,
                       linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=True,
                       layer_types=_every(4, 24, "linear_attention", "full_attention"),
                       rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
                       max_position_embeddings=32768, rms_norm_eps=1e-6),
    # Gemma 3 1B: sliding window 512 in 5 of every 6 layers
    "gemma3-1b": dict(model_type="gemma3_text", hidden_size=1152, num_hidden_layers=26, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=256, intermediate_size=6912, vocab_size=262144,
                      sliding_window=512, query_pre_attn_scalar=256,
                      layer_types=_every(6, 26, "sliding_attention", "full_attention"), max_position_embeddings=32768,
                      tie_word_embeddings=True, rms_norm_eps=1e-6),
    # OLMo 3: sliding window 4096 in 3 of every 4 layers
    "olmo3-1b": dict(model_type="olmo3", hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                     num_key_value_heads=16, intermediate_size=8192, vocab_size=100352, sliding_window=4096,
                     layer_types=_every(4, 16, "sliding_attention", "full_attention"), max_position_embeddings=8192, tie_word_embeddings=False, rms_norm_eps=1e-6),
    # dense Qwen3 1.7B
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=6144, vocab_size=151936,
                       tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-6,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Qwen3-MoE: 64 experts, top-8, hidden 1024, 16 layers
    "qwen3_moe-1b": dict(model_type="qwen3_moe", hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
                         num_key_value_heads=4, head_dim=128, intermediate_size=3072, moe_intermediate_size=512,
                         num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936,
                         tie_word_embeddings=False, max_position_embeddings=32768, rms_norm_eps=1e-6),
    # Qwen3.5-MoE: the hybrid backbone with 64 experts top-8 and a shared expert
    "qwen3_5_moe-1b": dict(model_type="qwen3_5_moe_text", hidden_size=1024, num_hidden_layers=16, num_attention_heads=8,
                           num_key_value_heads=2, head_dim=256, moe_intermediate_size=512,
                           shared_expert_intermediate_size=512, num_experts=64, num_experts_per_tok=8,
                           vocab_size=248320, linear_num_key_heads=16, linear_num_value_heads=16,
                           linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                           layer_types=_every(4, 16, "linear_attention", "full_attention"), tie_word_embeddings=False, max_position_embeddings=32768, rms_norm_eps=1e-6),
}
SHAPES.update(FAMILY_SHAPES)


def model_shape(shape: dict) -> ModelShape | None:
    """The memory plan's shape of a family shape (one with a ``model_type``), None for a hand-written Qwen2 one."""
    return ModelShape.from_hf_config(shape) if "model_type" in shape else None


def attention_layers(shape: dict) -> int:
    """Layers that attend over KV (a hybrid's linear-attention layers do not)."""
    ms = model_shape(shape)
    if ms is None:
        return shape["num_hidden_layers"]
    return sum(1 for c in ms.caches() if c.has_kv)


def kv_bytes_per_sequence(shape: dict, seq_lens, dtype_bytes: int = 2) -> np.ndarray:
    """K and V one sequence keeps at each of ``seq_lens`` tokens (a window layer: its window's tokens
    at most), as float64."""
    ms = model_shape(shape)
    caches = ms.caches() if ms is not None else families.layer_caches({"model_type": "qwen2", **shape})
    lens = np.asarray(seq_lens, dtype=np.float64)
    total = np.zeros_like(lens)
    for c in caches:
        if c.has_kv:
            per_token = families.kv_bytes_per_token([c], dtype_bytes, 1)
            total += per_token * (lens if c.window is None else np.minimum(lens, c.window))
    return total


def moe_shape(shape: dict) -> ModelShape | None:
    """The memory plan's shape of a mixture-of-experts ``shape`` (its ``moe`` set), None for a dense one."""
    if "model_type" not in shape:
        return None
    ms = ModelShape.from_hf_config(shape)
    return ms if ms.moe is not None else None


def head_dim(shape: dict) -> int:
    return shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]


def expert_matmul_params(shape: dict) -> int:
    """One routed expert's weights (gate, up, down); 0 for a dense model."""
    ms = moe_shape(shape)
    return 0 if ms is None else 3 * ms.hidden * ms.moe.expert_intermediate


def sparse_layers(shape: dict) -> int:
    ms = moe_shape(shape)
    return 0 if ms is None else ms.layers - len(ms.moe.dense_layers)


def attention_dim(shape: dict) -> int:
    """Query width (heads x head_dim): the inner dimension of QK^T and AV."""
    return shape["num_attention_heads"] * head_dim(shape)


def layer_matmul_params(shape: dict) -> int:
    """Weights of one decoder layer's matmuls (q, k, v, o, gate, up, down; no biases or norms)."""
    h, q = shape["hidden_size"], attention_dim(shape)
    kv = shape["num_key_value_heads"] * head_dim(shape)
    return h * q + 2 * h * kv + q * h + 3 * h * shape["intermediate_size"]


def body_matmul_params(shape: dict) -> int:
    """Matmul weights that every token goes through (all decoder layers; an MoE layer's router and
    its top-k experts; a family shape's layers as its family declares them, norms included)."""
    ms = moe_shape(shape)
    if ms is None:
        family = model_shape(shape)
        if family is not None:
            return family.active_params() - family.embedding_params() - family.hidden
        return shape["num_hidden_layers"] * layer_matmul_params(shape)
    return _non_expert_body(shape) + sparse_layers(shape) * ms.moe.top_k * expert_matmul_params(shape)


def _non_expert_body(shape: dict) -> int:
    """An MoE's layer weights but its routed experts: token mixers (attention, or a hybrid's Gated
    DeltaNet), routers, shared experts, dense layers' MLPs and norms, as its family declares them."""
    ms = moe_shape(shape)
    active = ms.active_params() - ms.embedding_params() - ms.hidden
    return active - sparse_layers(shape) * ms.moe.top_k * expert_matmul_params(shape)


def decode_matmul_params(shape: dict, experts_touched: float | None = None) -> float:
    """Matmul weights one decode step reads: every dense weight and the LM head, and of the routed
    experts those the step's rows touched, ``experts_touched`` summed over the MoE layers (the
    engine's ``moe_experts_touched / moe_decode_steps``); None: the fewest any step touches, its
    ``top_k`` per MoE layer. A dense model: :func:`matmul_params`."""
    ms = moe_shape(shape)
    if ms is None:
        return matmul_params(shape)
    touched = sparse_layers(shape) * ms.moe.top_k if experts_touched is None else experts_touched
    return _non_expert_body(shape) + touched * expert_matmul_params(shape) + head_params(shape)


def head_params(shape: dict) -> int:
    """The LM head's weights (V x H); with tied embeddings these are the embedding's."""
    return shape["vocab_size"] * shape["hidden_size"]


def matmul_params(shape: dict) -> int:
    """Weights in matmuls: the layers plus the LM head (the input embedding is a lookup)."""
    return body_matmul_params(shape) + head_params(shape)


def param_count(shape: dict) -> int:
    """All parameters of a Qwen2 model (q/k/v biases, no o bias, 2 norms per layer, final norm; the
    embedding once when tied, twice when not); of an MoE, every expert (:meth:`ModelShape.params`)."""
    ms = model_shape(shape)
    if ms is not None:
        return ms.params()
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    kv = shape["num_key_value_heads"] * head_dim(shape)
    per_layer = layer_matmul_params(shape) + attention_dim(shape) + 2 * kv + 2 * h
    embeddings = head_params(shape) * (1 if shape.get("tie_word_embeddings", True) else 2)
    return layers * per_layer + embeddings + h


def attended_tokens(shape: dict, seq_lens) -> np.ndarray:
    """Keys that one query at the end of each sequence of ``seq_lens`` tokens meets, summed over the
    layers that attend (a sliding-window layer's at most its window; a hybrid's linear layers none)."""
    ms = model_shape(shape)
    caches = ms.caches() if ms is not None else families.layer_caches({"model_type": "qwen2", **shape})
    s = np.asarray(seq_lens, dtype=np.float64)
    return sum(s if c.window is None else np.minimum(s, c.window) for c in caches if c.has_kv)


def kv_bytes_per_token(shape: dict, dtype_bytes: int = 2) -> int:
    """K and V of every layer for one token, as the shape's family (Qwen2 for a hand-written one)
    declares its layers' caches (a window layer counted whole: see :func:`kv_bytes_per_sequence`)."""
    ms = model_shape(shape)
    caches = ms.caches() if ms is not None else families.layer_caches({"model_type": "qwen2", **shape})
    return families.kv_bytes_per_token(caches, dtype_bytes, 1)
