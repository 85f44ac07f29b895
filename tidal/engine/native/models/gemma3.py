"""Gemma 3 on paged KV: ``gemma3_text`` (``Gemma3ForCausalLM``) and the text tower of
``Gemma3ForConditionalGeneration`` (``gemma3``) for text-only RL. As HF's ``modeling_gemma3``:

- RMSNorm ``normalize(x) * (1 + w)`` in fp32, cast back after the weight; per-head q/k norms;
  the input and post-attention norms around attention, pre- and post-feed-forward norms around the MLP,
  each added to the residual after its post norm;
- token embeddings scaled by ``sqrt(hidden)`` (rounded to the weights' dtype first);
- attention scale ``query_pre_attn_scalar ** -0.5``; ``sliding_attention`` layers attend within
  ``sliding_window`` tokens and use the ``sliding_attention`` RoPE (``rope_local_base_freq``);
- MLP ``down(gelu_tanh(gate) * up)``; logits soft-capped when ``final_logit_softcapping`` is set.

Not supported (a clear error): ``attn_logit_softcapping`` (the paged kernels do not cap scores),
``use_bidirectional_attention``, images (the vision tower is not loaded: its weights are skipped).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tidal.engine.native.attention import AttnMetadata, PagedAttention
from tidal.engine.native.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tidal.engine.native.models.dense import PagedLM, head_dim_of
from tidal.engine.native.models.layer_types import LayerTypeRope, layer_windows
from tidal.engine.native.parallel import TPGroup
from tidal.families import text_tower_name

TEXT_PREFIX = "model.language_model."  # a ForConditionalGeneration's text tower (in memory)


class GemmaRMSNorm(nn.Module):
    """``normalize(x) * (1 + w)`` in fp32, then cast to x's dtype (HF ``Gemma3RMSNorm``)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)

    def weight_slices(self, param, full, shard_id=None):
        return [(param.data, full)]

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg, tp: TPGroup, ops, dtype, window: int | None):
        super().__init__()
        d, bias = head_dim_of(cfg), bool(cfg.attention_bias)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads, bias, tp, dtype)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, bias, tp, dtype)
        self.nh, self.nkv, self.d = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d
        self.q_norm = GemmaRMSNorm(d, cfg.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(d, cfg.rms_norm_eps, dtype)
        self.attn = PagedAttention(self.nh, self.nkv, d, ops, scale=cfg.query_pre_attn_scalar**-0.5, window=window)
        self.ops = ops

    def forward(self, positions_T, x_TH, cos_sin_PD, meta: AttnMetadata):
        T = x_TH.shape[0]
        q, k, v = self.qkv_proj(x_TH).split([self.nh * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
        q = self.q_norm(q.reshape(T, self.nh, self.d))
        k = self.k_norm(k.reshape(T, self.nkv, self.d))
        v = v.reshape(T, self.nkv, self.d)
        q = self.ops.rope_store(q, k, v, positions_T, cos_sin_PD, self.attn.k_cache, self.attn.v_cache,
                                self.attn.meta_of(meta).slot_mapping_T)
        return self.o_proj(self.attn(q, meta).reshape(T, self.nh * self.d))


class Gemma3MLP(nn.Module):
    def __init__(self, cfg, tp: TPGroup, dtype):
        super().__init__()
        act = getattr(cfg, "hidden_activation", None) or cfg.hidden_act
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation={act!r}: Gemma 3 in the native engine uses gelu_pytorch_tanh")
        i = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [i, i], False, tp, dtype)
        self.down_proj = RowParallelLinear(i, cfg.hidden_size, False, tp, dtype)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3Layer(nn.Module):
    def __init__(self, cfg, tp, ops, dtype, window: int | None):
        super().__init__()
        self.window = window
        self.self_attn = Gemma3Attention(cfg, tp, ops, dtype, window)
        self.mlp = Gemma3MLP(cfg, tp, dtype)
        eps, H = cfg.rms_norm_eps, cfg.hidden_size
        self.input_layernorm = GemmaRMSNorm(H, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(H, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(H, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(H, eps, dtype)

    def forward(self, positions_T, x_TH, cos_sin_PD, meta):
        h = self.self_attn(positions_T, self.input_layernorm(x_TH), cos_sin_PD, meta)
        x_TH = x_TH + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x_TH))
        return x_TH + self.post_feedforward_layernorm(h)


class Gemma3Body(nn.Module):
    """``model.*`` (``model.language_model.*`` in a ForConditionalGeneration checkpoint)."""

    def __init__(self, cfg, tp, ops, dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(Gemma3Layer(cfg, tp, ops, dtype, w) for w in layer_windows(cfg))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class Gemma3ForCausalLM(PagedLM):
    """Gemma 3's decoder (see the module docstring); the config may be a ``Gemma3Config`` (its text
    config is used, the vision tower is not built) or a ``Gemma3TextConfig``."""

    def __init__(self, cfg, tp: TPGroup, ops, dtype: torch.dtype):
        super().__init__()
        text = cfg.get_text_config()
        if getattr(text, "attn_logit_softcapping", None) is not None:
            raise ValueError("attn_logit_softcapping is set: the native engine's paged attention does not cap "
                             "scores; set engine.backend: hf")
        if getattr(text, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True is not a causal LM; set engine.backend: hf")
        self.config = text
        self.model = Gemma3Body(text, tp, ops, dtype)
        self.lm_head = ParallelLMHead(self.model.embed_tokens, bool(getattr(text, "tie_word_embeddings", True)), tp, dtype)
        self.max_positions = text.max_position_embeddings
        self.rope = LayerTypeRope(text, head_dim_of(text), self.max_positions, dtype)
        # HF's scale: sqrt(hidden) in fp32 rounded to the weights' dtype; a device buffer, so that a
        # captured decode graph reads it (no host-to-device copy inside the graph)
        self.register_buffer("embed_scale", torch.tensor(text.hidden_size**0.5, dtype=torch.float32).to(dtype), False)
        self.softcap = getattr(text, "final_logit_softcapping", None)

    @property
    def cos_sin_PD(self) -> torch.Tensor:
        """The full-attention RoPE table (its dtype and device are the KV cache's: ModelRunner)."""
        return self.rope.cos_sin_PD

    def forward(self, ids_T: torch.Tensor, positions_T: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        """Final hidden states ``[T, H]``."""
        x = self.model.embed_tokens(ids_T) * self.embed_scale
        for layer in self.model.layers:
            x = layer(positions_T, x, self.rope.table(layer.window), meta)
        return self.model.norm(x)

    def compute_logits(self, hidden_BH: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden_BH)
        if logits is None or self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap

    def weight_slices(self, named_tensors: Iterable[tuple[str, torch.Tensor]]):
        """Text weights named as a causal LM's (``model.*``) or a ForConditionalGeneration's, in
        memory or on disk (:func:`tidal.families.text_tower_name`); the vision tower's and the
        projector's are skipped (text-only RL)."""
        for name, full in named_tensors:
            text = name if name.startswith("model.") and not name.startswith(("model.vision_tower.", "model.multi_modal_projector.")) \
                and not name.startswith(TEXT_PREFIX) else text_tower_name(name, TEXT_PREFIX)
            if text is None:
                continue
            for _, slices in super().weight_slices([(text, full)]):
                yield name, slices
