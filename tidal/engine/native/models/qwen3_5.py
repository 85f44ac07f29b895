"""Qwen3.5 / Qwen3.6 dense (HF ``qwen3_5_text``, and ``qwen3_5``'s text tower): hybrid layers,
tensor-parallel, as ``transformers`` defines them.

``config.layer_types[i]`` says what layer i mixes tokens with:
- ``linear_attention``: Gated DeltaNet (:mod:`tidal.models.gated_delta_rule`): fused
  ``in_proj_qkv`` -> causal short conv -> gated delta rule over a fixed-size per-sequence state, then
  a gated RMSNorm (``z``) and ``out_proj``. Its state (short-conv state and delta-rule state) lives in
  the engine's :class:`~tidal.engine.native.state_pool.StatePool`, at the slot each row of a step
  names (``meta.state_slots_B``); no KV.
- ``full_attention``: paged attention whose ``q_proj`` yields a query and an output gate per head
  (``o = o_proj(attn * sigmoid(gate))``), per-head q/k RMSNorm, RoPE on the first
  ``partial_rotary_factor`` of each head's dims.
Every RMSNorm but the gated one scales by ``1 + weight`` (zero-centred weights, as HF stores them).

Weight names: HF's own (``model.layers.3.self_attn.q_proj.weight``, ``model.layers.0.linear_attn.A_log``),
and a ``Qwen3_5ForConditionalGeneration``'s text tower (``model.language_model.*``); its vision
tower (``model.visual.*``) is not loaded: text-only RL (image prompts are refused before they get here).
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
    _divide,
    rope_cos_sin,
)
from tidal.models.gated_delta_rule import (
    exact_gated_delta_rule,
    exact_short_conv,
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    fla_available,
    fla_chunk_varlen,
    fla_recurrent_step,
    recurrent_gated_delta_rule,
)
from tidal import exact
from tidal.engine.native.models.dense import DecoderLM
from tidal.engine.native.parallel import TPGroup
from tidal.families import text_config

LINEAR, FULL = "linear_attention", "full_attention"


def rotary_dim_of(cfg) -> int:
    params = getattr(cfg, "rope_parameters", None) or {}
    return int(cfg.head_dim * params.get("partial_rotary_factor", 1.0))


def _sections(full: torch.Tensor, param: torch.Tensor, sizes: list[int], tp: TPGroup):
    """(destination, source) pairs of a tensor made of consecutive ``sizes`` along dim 0, each split
    over the TP group (rank r keeps the r-th part of every section)."""
    out, dst, src = [], 0, 0
    for size in sizes:
        n = size // tp.size
        out.append((param.data.narrow(0, dst, n), full.narrow(0, src + tp.rank * n, n)))
        dst, src = dst + n, src + size
    return out


class SectionedColumnLinear(MergedColumnParallelLinear):
    """A column-parallel linear that HF stores fused: consecutive output sections, each split over
    the TP group, loaded from the one full tensor."""

    def __init__(self, in_features, sizes: list[int], tp, dtype):
        super().__init__(in_features, sizes, False, tp, dtype)
        self.sizes = sizes

    def weight_slices(self, param, full, shard_id=None):
        return _sections(full, param, self.sizes, self.tp)


class ZeroCentredRMSNorm(nn.Module):
    """HF's Qwen3.5 RMSNorm: ``y = normalize(x) * (1 + weight)`` in float32, cast back; with an
    optional fused residual add (``forward(x, residual) -> (y, x + residual)``)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)

    def weight_slices(self, param, full, shard_id=None):
        return [(param.data, full)]

    def forward(self, x, residual=None):
        if residual is not None:
            x = residual + x
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())
        return y.to(x.dtype), x


class GatedRMSNorm(nn.Module):
    """``weight * normalize(x) * silu(z)`` per value head (HF's ``Qwen3_5RMSNormGated``)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def weight_slices(self, param, full, shard_id=None):
        return [(param.data, full)]

    def forward(self, x_ND, z_ND):
        x32 = x_ND.float()
        y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x_ND.dtype)
        return (self.weight * y * F.silu(z_ND.float())).to(x_ND.dtype)


class ShortConvWeight(nn.Module):
    """The depthwise conv's weight ``[channels, 1, K]`` (HF's ``conv1d.weight``), channels in
    sections (q, k, v) split over the TP group like ``in_proj_qkv``."""

    def __init__(self, sizes: list[int], kernel: int, tp: TPGroup, dtype):
        super().__init__()
        self.sizes, self.tp = sizes, tp
        self.weight = nn.Parameter(torch.zeros(sum(sizes) // tp.size, 1, kernel, dtype=dtype), requires_grad=False)

    def weight_slices(self, param, full, shard_id=None):
        return _sections(full, param, self.sizes, self.tp)


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet layer over the state pool's slots: ``conv_state`` ``[slots, C, K - 1]`` and
    ``ssm_state`` ``[slots, Hv, dk, dv]`` (float32) are views set by the engine (empty while it sleeps)."""

    def __init__(self, cfg, tp: TPGroup, dtype):
        super().__init__()
        self.hk = _divide(cfg.linear_num_key_heads, tp.size, "linear_num_key_heads")
        self.hv = _divide(cfg.linear_num_value_heads, tp.size, "linear_num_value_heads")
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        key_dim, value_dim = cfg.linear_num_key_heads * self.dk, cfg.linear_num_value_heads * self.dv
        sizes = [key_dim, key_dim, value_dim]
        self.in_proj_qkv = SectionedColumnLinear(cfg.hidden_size, sizes, tp, dtype)
        self.in_proj_z = SectionedColumnLinear(cfg.hidden_size, [value_dim], tp, dtype)
        self.in_proj_b = SectionedColumnLinear(cfg.hidden_size, [cfg.linear_num_value_heads], tp, dtype)
        self.in_proj_a = SectionedColumnLinear(cfg.hidden_size, [cfg.linear_num_value_heads], tp, dtype)
        self.conv1d = ShortConvWeight(sizes, cfg.linear_conv_kernel_dim, tp, dtype)
        self.A_log = nn.Parameter(torch.zeros(self.hv, dtype=dtype), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.zeros(self.hv, dtype=dtype), requires_grad=False)
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps, dtype)
        self.out_proj = RowParallelLinear(value_dim, cfg.hidden_size, False, tp, dtype)
        self.tp = tp
        self.conv_state = torch.empty(0)
        self.ssm_state = torch.empty(0)

    def weight_slices(self, param, full, shard_id=None):  # A_log, dt_bias: one value per value head
        return _sections(full, param, [self.hv * self.tp.size], self.tp)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """This rank's (short-conv state, delta-rule state) shapes of one sequence."""
        w = self.conv1d.weight
        return (w.shape[0], w.shape[2] - 1), (self.hv, self.dk, self.dv)

    def forward(self, x_TH: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        T = x_TH.shape[0]
        qkv_TC = self.in_proj_qkv(x_TH)
        weight_CK = self.conv1d.weight[:, 0]
        beta_TH = self.in_proj_b(x_TH).sigmoid()
        g_TH = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x_TH).float() + self.dt_bias)
        slots = meta.state_slots_B
        if exact.active():  # exact mode (docs/exact.md): the recurrent form, as packed training runs it
            o_THV = self._exact(qkv_TC, weight_CK, g_TH, beta_TH, meta)
        elif x_TH.is_cuda and fla_available():  # pragma: no cover - CUDA with flash-linear-attention only
            o_THV = self._fla(qkv_TC, weight_CK, g_TH, beta_TH, meta)
        elif meta.is_prefill:
            o_THV = torch.empty(T, self.hv, self.dv, dtype=x_TH.dtype, device=x_TH.device)
            start = 0
            for s, n in zip(meta.state_slots, meta.query_lens):
                rows = slice(start, start + n)
                y_TC, self.conv_state[s] = causal_conv1d(qkv_TC[rows], weight_CK, self.conv_state[s])
                q, k, v = self._heads(y_TC)
                o_THV[rows], self.ssm_state[s] = chunk_gated_delta_rule(q, k, v, g_TH[rows], beta_TH[rows], self.ssm_state[s])
                start += n
        else:
            conv_BCW, ssm_BHKV = self.conv_state[slots], self.ssm_state[slots]
            y_TC = causal_conv1d_step(qkv_TC, weight_CK, conv_BCW)
            o_THV = recurrent_gated_delta_rule(*self._heads(y_TC), g_TH, beta_TH, ssm_BHKV)
            self.conv_state[slots], self.ssm_state[slots] = conv_BCW, ssm_BHKV
        z = self.in_proj_z(x_TH).view(T * self.hv, self.dv)
        o = self.norm(o_THV.reshape(T * self.hv, self.dv), z)
        return self.out_proj(o.view(T, self.hv * self.dv))

    def _exact(self, qkv_TC, weight_CK, g_TH, beta_TH, meta: AttnMetadata):
        """Exact mode's short conv (each output from its window of K inputs) and recurrent delta rule
        (:func:`~tidal.models.gated_delta_rule.exact_gated_delta_rule`), from the slots' states."""
        K = weight_CK.shape[1]
        if not meta.is_prefill:
            slots = meta.state_slots_B
            conv_BCW, ssm_BHKV = self.conv_state[slots], self.ssm_state[slots]
            window_BCK = torch.cat((conv_BCW, qkv_TC[..., None].to(conv_BCW.dtype)), dim=-1)
            y_TC = exact_short_conv(window_BCK, weight_CK).to(qkv_TC.dtype)
            q, k, v = self._heads(y_TC)
            o, final = exact_gated_delta_rule(q[:, None], k[:, None], v[:, None], g_TH[:, None], beta_TH[:, None], ssm_BHKV)
            self.conv_state[slots], self.ssm_state[slots] = window_BCK[..., 1:], final
            return o[:, 0]
        o_THV = torch.empty(qkv_TC.shape[0], self.hv, self.dv, dtype=qkv_TC.dtype, device=qkv_TC.device)
        start = 0
        for s, n in zip(meta.state_slots, meta.query_lens):
            rows = slice(start, start + n)
            full_CL = torch.cat((self.conv_state[s], qkv_TC[rows].t().to(self.conv_state.dtype)), dim=1)  # [C, K - 1 + n]
            y_TC = exact_short_conv(full_CL.unfold(1, K, 1).transpose(0, 1), weight_CK).to(qkv_TC.dtype)
            self.conv_state[s] = full_CL[:, n:]
            q, k, v = self._heads(y_TC)
            o, final = exact_gated_delta_rule(q[None], k[None], v[None], g_TH[None, rows], beta_TH[None, rows], self.ssm_state[s][None])
            o_THV[rows], self.ssm_state[s] = o[0], final[0]
            start += n
        return o_THV

    def _fla(self, qkv_TC, weight_CK, g_TH, beta_TH, meta: AttnMetadata):  # pragma: no cover
        """The delta rule through flash-linear-attention's kernels (prefill: one varlen call over the
        batch's sequences from their slots' states; decode: the fused recurrent step)."""
        slots = meta.state_slots_B
        if not meta.is_prefill:
            conv_BCW, ssm_BHKV = self.conv_state[slots], self.ssm_state[slots]
            y_TC = causal_conv1d_step(qkv_TC, weight_CK, conv_BCW)
            o_THV = fla_recurrent_step(*self._heads(y_TC), g_TH, beta_TH, ssm_BHKV)
            self.conv_state[slots], self.ssm_state[slots] = conv_BCW, ssm_BHKV
            return o_THV
        y_TC, start = torch.empty_like(qkv_TC), 0
        for s, n in zip(meta.state_slots, meta.query_lens):
            y_TC[start : start + n], self.conv_state[s] = causal_conv1d(qkv_TC[start : start + n], weight_CK, self.conv_state[s])
            start += n
        o_THV, final = fla_chunk_varlen(*self._heads(y_TC), g_TH, beta_TH, meta.cu_seqlens_q_B1.long(), self.ssm_state[slots])
        self.ssm_state[slots] = final
        return o_THV

    def _heads(self, y_TC):
        T, kd = y_TC.shape[0], self.hk * self.dk
        q, k, v = y_TC.split([kd, kd, self.hv * self.dv], dim=-1)
        return q.view(T, self.hk, self.dk), k.view(T, self.hk, self.dk), v.view(T, self.hv, self.dv)


class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate, per-head q/k norms and partial RoPE, on paged KV."""

    def __init__(self, cfg, tp: TPGroup, ops, dtype):
        super().__init__()
        d = cfg.head_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        # q_proj holds [query | gate] per head: as 2 * heads "heads" of head_dim it shards by heads
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, 2 * cfg.num_attention_heads, cfg.num_key_value_heads,
                                          bias, tp, dtype)
        self.nh, self.nkv, self.d = self.qkv_proj.num_heads // 2, self.qkv_proj.num_kv_heads, d
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, bias, tp, dtype)
        self.q_norm = ZeroCentredRMSNorm(d, cfg.rms_norm_eps, dtype)
        self.k_norm = ZeroCentredRMSNorm(d, cfg.rms_norm_eps, dtype)
        self.rotary = rotary_dim_of(cfg)
        self.attn = PagedAttention(self.nh, self.nkv, d, ops)
        self.ops = ops
        # RoPE is applied here (on the first ``rotary`` dims); the cache write goes through the
        # backend's rope_store with an identity rotation (cos 1, sin 0) at position 0
        self.register_buffer("identity_1D", torch.cat([torch.ones(1, d // 2), torch.zeros(1, d // 2)], -1).to(dtype), False)

    def forward(self, positions_T, x_TH, cos_sin_PR, meta: AttnMetadata):
        T, nh, d = x_TH.shape[0], self.nh, self.d
        qg, k, v = self.qkv_proj(x_TH).split([2 * nh * d, self.nkv * d, self.nkv * d], dim=-1)
        q, gate = qg.view(T, nh, 2 * d).split([d, d], dim=-1)
        q = self._rope(self.q_norm(q.reshape(-1, d))[0].view(T, nh, d), positions_T, cos_sin_PR)
        k = self._rope(self.k_norm(k.reshape(-1, d))[0].view(T, self.nkv, d), positions_T, cos_sin_PR)
        zeros_T = torch.zeros_like(positions_T)
        q = self.ops.rope_store(q, k, v.view(T, self.nkv, d), zeros_T, self.identity_1D, self.attn.k_cache,
                                self.attn.v_cache, meta.slot_mapping_T)
        o = self.attn(q, meta).reshape(T, nh * d) * torch.sigmoid(gate.reshape(T, nh * d))
        return self.o_proj(o)

    def _rope(self, x_THD, positions_T, cos_sin_PR):
        r, half = self.rotary, self.rotary // 2
        cs = cos_sin_PR[positions_T]
        cos, sin = cs[:, None, :half], cs[:, None, half:]
        x1, x2, rest = x_THD[..., :half], x_THD[..., half:r], x_THD[..., r:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


class MLP(nn.Module):
    def __init__(self, cfg, tp, dtype, ops):
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [i, i], False, tp, dtype)
        self.down_proj = RowParallelLinear(i, cfg.hidden_size, False, tp, dtype)
        self.ops = ops

    def forward(self, x):
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


class HybridLayer(nn.Module):
    def __init__(self, cfg, kind: str, tp, ops, dtype):
        super().__init__()
        self.kind = kind
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, tp, dtype)
        else:
            self.self_attn = GatedAttention(cfg, tp, ops, dtype)
        self.mlp = MLP(cfg, tp, dtype, ops)
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, positions_T, x_TH, residual_TH, cos_sin, meta):
        x_TH, residual_TH = self.input_layernorm(x_TH, residual_TH)
        if self.kind == LINEAR:
            x_TH = self.linear_attn(x_TH, meta)
        else:
            x_TH = self.self_attn(positions_T, x_TH, cos_sin, meta)
        x_TH, residual_TH = self.post_attention_layernorm(x_TH, residual_TH)
        return self.mlp(x_TH), residual_TH


class HybridBody(nn.Module):
    def __init__(self, cfg, tp, ops, dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(HybridLayer(cfg, kind, tp, ops, dtype) for kind in cfg.layer_types)
        self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class Qwen3_5ForCausalLM(DecoderLM):
    """Qwen3.5 dense, text only. Besides :class:`DecoderLM`'s interface: :meth:`linear_layers` (the
    Gated DeltaNet layers, whose state the engine's state pool holds) and
    :meth:`state_shapes`; :meth:`layer_attentions` lists the full-attention layers only."""

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, hf_config, tp: TPGroup, ops, dtype: torch.dtype):
        nn.Module.__init__(self)  # not DecoderLM's body: the layers differ
        cfg = text_config(hf_config)
        kinds = set(cfg.layer_types)
        if not kinds <= {LINEAR, FULL}:
            raise ValueError(f"layer_types {sorted(kinds - {LINEAR, FULL})} are not Qwen3.5 layers")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={cfg.hidden_act!r}: only silu is supported")
        self.config = cfg
        self._load_targets: dict = {}
        self.model = HybridBody(cfg, tp, ops, dtype)
        self.lm_head = ParallelLMHead(self.model.embed_tokens, bool(getattr(cfg, "tie_word_embeddings", False)), tp, dtype)
        self.max_positions = cfg.max_position_embeddings
        self.register_buffer("cos_sin_PD", rope_cos_sin(cfg, rotary_dim_of(cfg), self.max_positions, dtype), False)

    def forward(self, ids_T, positions_T, meta: AttnMetadata, embeds_TH=None, cos_sin_TD=None) -> torch.Tensor:
        if embeds_TH is not None or cos_sin_TD is not None:
            raise ValueError("Qwen3.5 in the native engine is text-only")
        x, residual = self.model.embed_tokens(ids_T), None
        for layer in self.model.layers:
            x, residual = layer(positions_T, x, residual, self.cos_sin_PD, meta)
        return self.model.norm(x, residual)[0]

    def layer_attentions(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers if layer.kind == FULL]

    def linear_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if layer.kind == LINEAR]

    def weight_slices(self, named_tensors: Iterable[tuple[str, torch.Tensor]]):
        """Text weights named either way (``model.language_model.*`` or ``model.*``); the vision
        tower and the multi-token-prediction head (``mtp.*``) of released checkpoints are skipped."""
        for name, full in named_tensors:
            if name.startswith(("model.visual.", "visual.", "mtp.")):
                continue
            text = "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") else name
            for _, slices in super().weight_slices([(text, full)]):
                yield name, slices
