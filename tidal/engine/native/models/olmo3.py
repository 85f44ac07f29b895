"""OLMo 3 on paged KV (``Olmo3ForCausalLM``), as HF's ``modeling_olmo3``:

- no norm before attention or the MLP: ``post_attention_layernorm`` on the attention's output and
  ``post_feedforward_layernorm`` on the MLP's, each then added to the residual;
- RMSNorm ``(w * normalize(x))`` in fp32, cast back after the weight;
- q and k RMSNorm over the whole projection (all heads together, before the head split and RoPE);
- ``sliding_attention`` layers attend within ``sliding_window`` tokens; RoPE per layer type;
- SiLU MLP, attention scale ``head_dim ** -0.5``.

Tensor parallelism is not supported (the q/k norms span every head): ``engine.tp_size: 1``.
"""

from __future__ import annotations

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


class Olmo3RMSNorm(nn.Module):
    """``(w * normalize(x))`` in fp32, then cast to x's dtype (HF ``Olmo3RMSNorm``)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def weight_slices(self, param, full, shard_id=None):
        return [(param.data, full)]

    def forward(self, x):
        x32 = x.float()
        return (self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class Olmo3Attention(nn.Module):
    def __init__(self, cfg, tp: TPGroup, ops, dtype, window: int | None):
        super().__init__()
        d, bias = head_dim_of(cfg), bool(cfg.attention_bias)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads, bias, tp, dtype)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, bias, tp, dtype)
        self.nh, self.nkv, self.d = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d
        self.q_norm = Olmo3RMSNorm(self.nh * d, cfg.rms_norm_eps, dtype)
        self.k_norm = Olmo3RMSNorm(self.nkv * d, cfg.rms_norm_eps, dtype)
        self.attn = PagedAttention(self.nh, self.nkv, d, ops, window=window)
        self.ops = ops

    def forward(self, positions_T, x_TH, cos_sin_PD, meta: AttnMetadata):
        T = x_TH.shape[0]
        q, k, v = self.qkv_proj(x_TH).split([self.nh * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
        q = self.q_norm(q).view(T, self.nh, self.d)
        k = self.k_norm(k).view(T, self.nkv, self.d)
        v = v.reshape(T, self.nkv, self.d)
        q = self.ops.rope_store(q, k, v, positions_T, cos_sin_PD, self.attn.k_cache, self.attn.v_cache,
                                self.attn.meta_of(meta).slot_mapping_T)
        return self.o_proj(self.attn(q, meta).reshape(T, self.nh * self.d))


class Olmo3MLP(nn.Module):
    def __init__(self, cfg, tp: TPGroup, ops, dtype):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act={cfg.hidden_act!r}: only silu is supported")
        i = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [i, i], False, tp, dtype)
        self.down_proj = RowParallelLinear(i, cfg.hidden_size, False, tp, dtype)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Olmo3Layer(nn.Module):
    def __init__(self, cfg, tp, ops, dtype, window: int | None):
        super().__init__()
        self.window = window
        self.self_attn = Olmo3Attention(cfg, tp, ops, dtype, window)
        self.mlp = Olmo3MLP(cfg, tp, ops, dtype)
        self.post_attention_layernorm = Olmo3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_feedforward_layernorm = Olmo3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, positions_T, x_TH, cos_sin_PD, meta):
        x_TH = x_TH + self.post_attention_layernorm(self.self_attn(positions_T, x_TH, cos_sin_PD, meta))
        return x_TH + self.post_feedforward_layernorm(self.mlp(x_TH))


class Olmo3Body(nn.Module):
    def __init__(self, cfg, tp, ops, dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(Olmo3Layer(cfg, tp, ops, dtype, w) for w in layer_windows(cfg))
        self.norm = Olmo3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class Olmo3ForCausalLM(PagedLM):
    """OLMo 3's decoder (see the module docstring)."""

    def __init__(self, cfg, tp: TPGroup, ops, dtype: torch.dtype):
        super().__init__()
        if tp.size > 1:
            raise ValueError("OLMo 3's q/k RMSNorm spans every head: the native engine runs it with engine.tp_size: 1")
        self.config = cfg
        self.model = Olmo3Body(cfg, tp, ops, dtype)
        self.lm_head = ParallelLMHead(self.model.embed_tokens, bool(getattr(cfg, "tie_word_embeddings", False)), tp, dtype)
        self.max_positions = cfg.max_position_embeddings
        self.rope = LayerTypeRope(cfg, head_dim_of(cfg), self.max_positions, dtype)

    @property
    def cos_sin_PD(self) -> torch.Tensor:
        """The full-attention RoPE table (its dtype and device are the KV cache's: ModelRunner)."""
        return self.rope.cos_sin_PD

    def forward(self, ids_T: torch.Tensor, positions_T: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        """Final hidden states ``[T, H]``."""
        x = self.model.embed_tokens(ids_T)
        for layer in self.model.layers:
            x = layer(positions_T, x, self.rope.table(layer.window), meta)
        return self.model.norm(x)
